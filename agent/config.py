"""Settings: one documented dataclass; every field is a CLI flag and a KBP_* env var.

Precedence: command-line flag, then environment variable, then default. List-valued
settings take comma-separated values in the environment.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field, fields
from typing import Any

from .model.compile import PRIMARY, CompileOptions
from .model.ip import parse_cidr, parse_ip

ENV_PREFIX = "KBP_"


def _opt(flag: str, help: str, *, short: str | None = None, **kwargs: Any) -> dict[str, Any]:
    return {"flag": flag, "short": short, "help": help, **kwargs}


@dataclass
class Settings:
    manifests: list[str] = field(
        default_factory=list,
        metadata=_opt(
            "--manifests",
            "manifest files or directories (searched recursively)",
            nargs="+",
            metavar="PATH",
        ),
    )
    node: str = field(
        default_factory=socket.gethostname,
        metadata=_opt("--node", "name of this node (default: the hostname)", metavar="NAME"),
    )
    node_ip: list[str] = field(
        default_factory=list,
        metadata=_opt(
            "--node-ip",
            "this node's address; repeat for dual-stack; replaces the Node object's addresses",
            action="append",
            metavar="IP",
        ),
    )
    node_label: list[str] = field(
        default_factory=list,
        metadata=_opt(
            "--node-label",
            "a label of this node, added to (or overriding) the Node object's labels",
            action="append",
            metavar="KEY=VALUE",
        ),
    )
    nodeport_addresses: list[str] = field(
        default_factory=list,
        metadata=_opt(
            "--nodeport-addresses",
            "CIDRs whose node addresses accept NodePort traffic, or 'primary' for the node's "
            "primary IPs; default: every node address (kube-proxy's flag)",
            metavar="CIDR,...",
            comma=True,
        ),
    )
    cluster_cidr: list[str] = field(
        default_factory=list,
        metadata=_opt(
            "--cluster-cidr",
            "pod CIDRs of the cluster (one per family)",
            metavar="CIDR,...",
            comma=True,
        ),
    )
    cluster_name: str | None = field(
        default=None,
        metadata=_opt(
            "--cluster-name",
            "this cluster's name in a multi-cluster set; slices whose "
            "multicluster.kubernetes.io/source-cluster differs are remote",
            metavar="NAME",
        ),
    )
    service_proxy_name: str | None = field(
        default=None,
        metadata=_opt(
            "--service-proxy-name",
            "handle only Services labelled service.kubernetes.io/service-proxy-name=NAME; "
            "default: only Services without that label",
            metavar="NAME",
        ),
    )
    output: str = field(
        default="yaml",
        metadata=_opt("--output", "output format", short="-o", choices=("yaml", "json")),
    )
    strict: bool = field(
        default=False,
        metadata=_opt(
            "--strict", "exit non-zero when any input problem is reported", action="store_true"
        ),
    )
    log_level: str = field(
        default="info",
        metadata=_opt(
            "--log-level", "log verbosity", choices=("debug", "info", "warning", "error")
        ),
    )

    def compile_options(self) -> CompileOptions:
        labels = {}
        for item in self.node_label:
            key, _, value = item.partition("=")
            labels[key] = value
        return CompileOptions(
            node_ips=tuple(self.node_ip),
            node_labels=labels,
            nodeport_addresses=tuple(self.nodeport_addresses),
            cluster_cidrs=tuple(parse_cidr(c)[1] for c in self.cluster_cidr),
            cluster_name=self.cluster_name or None,
            service_proxy_name=self.service_proxy_name or None,
        )

    def validate(self) -> None:
        """Raise ValueError naming the setting that is wrong."""
        for f in fields(self):  # flags are checked by argparse, env vars only here
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(
                    f"{f.metadata['flag']}: {getattr(self, f.name)!r} is not one of "
                    f"{', '.join(choices)}"
                )
        for ip in self.node_ip:
            try:
                parse_ip(ip)
            except ValueError as err:
                raise ValueError(f"--node-ip: {err}") from None
        for item in self.node_label:
            if "=" not in item or not item.partition("=")[0]:
                raise ValueError(f"--node-label: {item!r} is not KEY=VALUE")
        if PRIMARY in self.nodeport_addresses and self.nodeport_addresses != [PRIMARY]:
            raise ValueError("--nodeport-addresses: 'primary' cannot be combined with CIDRs")
        for name in ("nodeport_addresses", "cluster_cidr"):
            for cidr in getattr(self, name):
                if cidr == PRIMARY and name == "nodeport_addresses":
                    continue
                try:
                    parse_cidr(cidr)
                except ValueError as err:
                    raise ValueError(f"--{name.replace('_', '-')}: {err}") from None


SETTINGS_FIELDS = {f.name: f for f in fields(Settings)}


def add_arguments(parser: argparse.ArgumentParser, names: list[str]) -> None:
    """Add the flags of the named settings; help texts show the env var and default."""
    for name in names:
        f = SETTINGS_FIELDS[name]
        meta = dict(f.metadata)
        flag, short, help_text = meta.pop("flag"), meta.pop("short"), meta.pop("help")
        if meta.pop("comma", False):
            meta["action"] = "append"
        env = ENV_PREFIX + name.upper()
        flags = [short, flag] if short else [flag]
        parser.add_argument(
            *flags, dest=name, default=None, help=f"{help_text} [env {env}]", **meta
        )


def settings_from(
    args: argparse.Namespace, names: list[str], environ: dict[str, str] | None = None
) -> Settings:
    """Settings from parsed flags, falling back to KBP_* env vars, then defaults."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, Any] = {}
    for name in names:
        f = SETTINGS_FIELDS[name]
        value = getattr(args, name, None)
        is_list = f.default_factory is list  # type: ignore[comparison-overlap]
        if value is not None and is_list and f.metadata.get("comma"):
            value = [v.strip() for item in value for v in item.split(",") if v.strip()]
        if value is None or value is False:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                value = _from_env(f.type, raw, is_list)
        if value is not None:
            values[name] = value
    settings = Settings(**values)
    settings.validate()
    return settings


def _from_env(type_name: object, raw: str, is_list: bool) -> Any:
    if is_list:
        return [v.strip() for v in raw.split(",") if v.strip()]
    if type_name in ("bool", bool):
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return raw
