"""Settings: one documented dataclass; every field is a CLI flag and a KBP_* env var.

Precedence: command-line flag, then environment variable, then the --config file, then
default. List-valued settings take comma-separated values in the environment. Every
setting has a type and a range, checked at start: a value that is out of range, or of
another type (`true` or `1.9` for a number), stops the command with one line naming the
setting and where the value came from. Nothing is coerced.

The dataplanes' options are declared beside their code (agent/dataplane/options.py and
each dataplane's options.py: default, range, flag and help); their rows here take all of
that from the declaration (`_declared`), and `dataplane_options` builds the dataplanes'
option objects from the checked settings. The dataplanes never import this module.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import socket
import sys
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

import yaml

from . import kubeproxy
from .dataplane.ebpf.options import EbpfOptions, MapSizes, Timeouts
from .dataplane.iptables.options import IptablesOptions
from .dataplane.options import between as _between
from .dataplane.options import build, declared, format_duration
from .dataplane.options import duration as _duration
from .dataplane.select import DataplaneOptions
from .model.compile import PRIMARY, CompileOptions
from .model.ip import parse_cidr, parse_ip

ENV_PREFIX = "KBP_"


def default_node_name() -> str:
    """The hostname, lower-cased as kube-proxy does (Node names are lower-case)."""
    return socket.gethostname().lower()


def _setting(
    default: Any,
    flag: str,
    help: str,
    metavar: str | None = None,
    check: Callable[[Any], None] | None = None,
    **kwargs: Any,
) -> Any:
    """A Settings field: its default (a list or a function: made afresh for each Settings),
    flag, help and metavar; `check` raises ValueError for a bad value. Other keywords go to
    argparse, but `short` (the short flag), `comma` (comma-separated, flag repeatable) and
    `aliases` (kube-proxy's flags of equal meaning, docs/kube-proxy.md)."""
    metadata = {"flag": flag, "short": kwargs.pop("short", None),
                "aliases": kwargs.pop("aliases", ()), "help": help, **kwargs}  # fmt: skip
    if metavar is not None:
        metadata["metavar"] = metavar
    if check is not None:
        metadata["check"] = check
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    if callable(default):
        return field(default_factory=default, metadata=metadata)
    return field(default=default, metadata=metadata)


def _declared(cls: type, name: str) -> Any:
    """The Settings field of an option a dataplane declares (agent/dataplane/options.py):
    its flag, help, default as written, check and choices, from the declaration."""
    meta = dict(next(f for f in fields(cls) if f.name == name).metadata)
    flag, help_text, written = meta.pop("flag"), meta.pop("help"), meta.pop("written")
    metavar, check, choices = meta.pop("metavar"), meta.pop("check"), meta.pop("choices")
    meta.pop("parse")
    if choices is not None:
        meta["choices"] = tuple(str(choice) for choice in choices)
    return _setting(written, flag, help_text, metavar, check, **meta)


# A table: one setting a row, as _setting(default, flag, help, metavar, check, argparse...)
# or _declared(the options dataclass declaring it, its field).
# fmt: off
@dataclass
class Settings:
    manifests: list[str] = _setting([], "--manifests",
        "manifest files or directories (searched recursively)",
        "PATH", lambda paths: _each(paths, _nonempty), nargs="+")
    node: str = _setting(default_node_name, "--node",
        "name of this node (default: the hostname, lower-cased)",
        "NAME", lambda name: _dns_subdomain(name), aliases=("--hostname-override",))
    node_ip: list[str] = _setting([], "--node-ip",
        "this node's address; repeat for dual-stack; replaces the Node object's addresses",
        "IP", lambda ips: _one_per_family(ips, parse_ip, "address"), action="append")
    node_label: list[str] = _setting([], "--node-label",
        "a label of this node, added to (or overriding) the Node object's labels",
        "KEY=VALUE", lambda items: _each(items, _label), action="append")
    nodeport_addresses: list[str] = _setting([], "--nodeport-addresses",
        "CIDRs whose node addresses accept NodePort traffic, or 'primary' for the node's "
        "primary IPs; default: every node address (kube-proxy's flag)",
        "CIDR,...", lambda cidrs: _nodeport_addresses(cidrs), comma=True)
    cluster_cidr: list[str] = _setting([], "--cluster-cidr",
        "pod CIDRs of the cluster (one per family)",
        "CIDR,...", lambda cidrs: _one_per_family(cidrs, parse_cidr, "CIDR"), comma=True)
    cluster_name: str | None = _setting(None, "--cluster-name",
        "this cluster's name in a multi-cluster set; slices whose "
        "multicluster.kubernetes.io/source-cluster differs are remote",
        "NAME", lambda name: _label_value(name, empty=False))
    service_proxy_name: str | None = _setting(None, "--service-proxy-name",
        "handle only Services labelled service.kubernetes.io/service-proxy-name=NAME; "
        "default: only Services without that label",
        "NAME", lambda name: _label_value(name, empty=False))
    kubeconfig: str | None = _setting(None, "--kubeconfig",
        "kubeconfig file; default: in-cluster service account, else $KUBECONFIG, "
        "else ~/.kube/config",
        "FILE", lambda path: _nonempty(path))
    dataplane: str = _declared(DataplaneOptions, "dataplane")
    iptables_backend: str = _declared(IptablesOptions, "backend")
    bpffs: str = _declared(EbpfOptions, "pin_dir")
    lock_dir: str = _setting("/run/kube-bpf-proxy", "--lock-dir",
        "directory of the node's lock files (one per --bpffs): `run` holds its lock while "
        "it runs, a second `run` waits for it, `cleanup` refuses while it is held",
        "DIR", lambda path: _absolute(path))
    pod_interfaces: list[str] = _declared(EbpfOptions, "pod_interfaces")
    external_interfaces: list[str] = _declared(EbpfOptions, "external_interfaces")
    xdp: str = _declared(EbpfOptions, "xdp")
    cgroup_root: str = _declared(DataplaneOptions, "cgroup_root")
    socket_lb: str = _declared(EbpfOptions, "socket_lb")
    tc_attach: str = _declared(EbpfOptions, "tc_attach")
    snat_port_range: str = _declared(EbpfOptions, "snat_ports")
    maglev_table_size: int = _declared(EbpfOptions, "maglev_table_size")
    map_size_services: int = _declared(MapSizes, "services")
    map_size_slots: int = _declared(MapSizes, "slots")
    map_size_backends: int = _declared(MapSizes, "backends")
    map_size_ct: int = _declared(MapSizes, "ct")
    map_size_affinity: int = _declared(MapSizes, "affinity")
    conntrack_tcp_timeout_syn: float = _declared(Timeouts, "tcp_syn")
    conntrack_tcp_timeout_established: float = _declared(Timeouts, "tcp_established")
    conntrack_tcp_timeout_close_wait: float = _declared(Timeouts, "tcp_close_wait")
    conntrack_tcp_timeout_time_wait: float = _declared(Timeouts, "tcp_time_wait")
    conntrack_udp_timeout: float = _declared(Timeouts, "udp")
    conntrack_udp_timeout_stream: float = _declared(Timeouts, "udp_stream")
    conntrack_sweep_interval: float = _declared(EbpfOptions, "ct_sweep_interval")
    remove_kube_proxy_rules: bool = _setting(False, "--remove-kube-proxy-rules",
        "remove kube-proxy's iptables chains, nftables tables and IPVS state from this node "
        "once this agent has programmed the cluster's state (and again whenever a full "
        "resync finds them); conntrack entries stay, so open connections keep their NAT",
        action="store_true")
    min_sync_period: float = _setting(0.0, "--min-sync-period",
        "minimum time between syncs (e.g. 1s); 0 applies changes at once, coalescing "
        "those that arrive during a sync",
        "DURATION", _duration(0.0, 3600.0), aliases=("--iptables-min-sync-period",))
    sync_period: float = _setting(30.0, "--sync-period",
        "full resync period (e.g. 30s); a resync writes nothing when the kernel matches",
        "DURATION", _duration(1.0, 86400.0), aliases=("--iptables-sync-period",))
    api_idle_timeout: float = _setting(30.0, "--api-idle-timeout",
        "a watch of the API server silent this long gets a liveness probe (GET /version); "
        "like the HTTP/2 ping of kube-proxy's client",
        "DURATION", _duration(1.0, 600.0))
    api_request_timeout: float = _setting(15.0, "--api-request-timeout",
        "longest wait for the API server: to connect, to answer a request (each read of "
        "a list, a watch's headers) and a liveness probe; a frozen server is reported "
        "unreachable after --api-idle-timeout plus this",
        "DURATION", _duration(1.0, 300.0))
    metrics_bind_address: str = _setting("127.0.0.1:10249", "--metrics-bind-address",
        "address of /metrics and /state",
        "HOST:PORT", lambda bind: _bind_address(bind))
    healthz_bind_address: str = _setting("0.0.0.0:10256", "--healthz-bind-address",
        "address of /healthz, /livez and /readyz",
        "HOST:PORT", lambda bind: _bind_address(bind))
    state_socket: str | None = _setting(None, "--state-socket",
        "also serve /state and its watch (/state?watch=true) on a unix socket at this "
        "path, mode 0600, for node-local consumers (docs/nodestate.md)",
        "PATH", lambda path: _absolute(path))
    state_watchers: int = _setting(128, "--state-watchers",
        "most /state?watch=true streams served at once, on the metrics address and the "
        "state socket together; more are answered 429",
        "N", _between(1, 4096))
    log_format: str = _setting("text", "--log-format", "log line format",
        choices=("text", "json"), aliases=("--logging-format",))
    verbosity: int = _setting(0, "--v", "log verbosity like kube-proxy's -v: 0-1 info, 2+ debug",
        "N", _between(0, 10), short="-v")
    config: str | None = _setting(None, "--config",
        "YAML file with any of these settings (keys as the flags without dashes, "
        "e.g. sync-period or sync_period), or kube-proxy's KubeProxyConfiguration "
        "(docs/kube-proxy.md); flags and env vars win over it",
        "FILE", lambda path: _nonempty(path))
    output: str = _setting("yaml", "--output", "output format",
        short="-o", choices=("yaml", "json"))
    service_metrics: str = _setting("services", "--service-metrics",
        "per-Service traffic at /metrics (eBPF): one series per Service, per Service "
        "port, or none (bounds the cardinality on large clusters)",
        choices=("none", "services", "ports"))
    inspect_output: str = _setting("table", "--output", "output format",
        short="-o", choices=("table", "json"))
    strict: bool = _setting(False, "--strict", "refuse a --config KubeProxyConfiguration "
        "with fields that have no equivalent; compile: exit non-zero when any input problem "
        "is reported",
        action="store_true")
    log_level: str = _setting("info", "--log-level", "log verbosity",
        choices=("debug", "info", "warning", "error"))
    # fmt: on

    def dataplane_options(self) -> DataplaneOptions:
        """The options of every dataplane (agent/dataplane/select.py), from these settings;
        call after `settings_from` checked them."""
        return build(DataplaneOptions, self._values())

    def conntrack_timeouts(self) -> Timeouts:
        """The eBPF conntrack's idle timeouts (what `inspect conntrack` judges flows by)."""
        return build(Timeouts, self._values())

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SETTINGS_FIELDS}

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


SETTINGS_FIELDS = {f.name: f for f in fields(Settings)}

# The eBPF conntrack's settings: its timeouts (in Timeouts' order), then the sweep.
CONNTRACK_TIMEOUTS = tuple(declared(Timeouts))
CONNTRACK_SETTINGS = [*CONNTRACK_TIMEOUTS, "conntrack_sweep_interval"]


def add_arguments(parser: argparse.ArgumentParser, names: list[str]) -> None:
    """Add the flags of the named settings; help texts show the env var and default.

    Flags stay text here: `settings_from` converts and checks them as it does env vars,
    so every bad value gets the same one-line error naming where it came from."""
    for name in names:
        f = SETTINGS_FIELDS[name]
        meta = dict(f.metadata)
        flag, short, help_text = meta.pop("flag"), meta.pop("short"), meta.pop("help")
        aliases = meta.pop("aliases")
        meta.pop("check", None)
        if meta.pop("comma", False):
            meta["action"] = "append"
        env = ENV_PREFIX + name.upper()
        flags = [short, flag, *aliases] if short else [flag, *aliases]
        parser.add_argument(
            *flags, dest=name, default=None, help=f"{help_text} [env {env}]", **meta
        )


def settings_from(
    args: argparse.Namespace,
    names: list[str],
    environ: dict[str, str] | None = None,
    warn: Callable[[str], None] | None = None,
) -> Settings:
    """Settings from parsed flags, then KBP_* env vars, then the --config file, then
    defaults, each converted without coercion and checked against its range. Raises
    ValueError naming the setting and where its value came from (`--sync-period`,
    `KBP_SYNC_PERIOD`, `--config FILE: sync-period`, `--node (default)`).

    The --config file is our settings file or kube-proxy's KubeProxyConfiguration; the
    latter's fields without an equivalent go to `warn` in one line (default: stderr), or
    raise ValueError when the command's --strict is set."""
    environ = dict(os.environ) if environ is None else environ
    file_values: dict[str, tuple[Any, str]] = {}
    if "config" in names:
        path = getattr(args, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
        if path:
            file_values, unmapped = _read_config(path, names)
            if unmapped:
                strict = "strict" in names and (
                    getattr(args, "strict", False)
                    or environ.get(ENV_PREFIX + "STRICT", "").strip().lower() in _TRUE
                )
                message = (
                    f"--config {path}: KubeProxyConfiguration fields without a kube-bpf-proxy "
                    f"equivalent, not applied: {', '.join(unmapped)} (docs/kube-proxy.md)"
                )
                if strict:
                    raise ValueError(f"{message}; refused with --strict")
                (warn or _warn_stderr)(message)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name in names:
        f = SETTINGS_FIELDS[name]
        flag = f.metadata["flag"]
        env = ENV_PREFIX + name.upper()
        value = getattr(args, name, None)
        if value is not None and value is not False:
            where = flag
            if isinstance(value, list) and f.metadata.get("comma"):
                value = _split(value)
            value = _convert(f, value, where, text=True)
        elif env in environ:
            where = env
            value = _convert(f, environ[env], where, text=True, split=True)
        elif name in file_values:
            value, where = file_values[name]
        else:
            value, where = None, f"{flag} (default)"
        if value is not None:
            values[name] = value
        sources[name] = where
    settings = Settings(**values)
    for name in names:
        check_value(SETTINGS_FIELDS[name], getattr(settings, name), sources[name])
    check_together(settings, sources)
    return settings


def check_value(f: Field[Any], value: Any, where: str) -> None:
    """Check one setting's value against its choices and range; ValueError naming `where`."""
    choices = f.metadata.get("choices")
    try:
        if choices and value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        check = f.metadata.get("check")
        if check is not None and value is not None:
            check(value)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def check_together(settings: Settings, sources: dict[str, str]) -> None:
    """The checks that involve two settings; `sources` says where each value came from."""

    def where(name: str) -> str:
        return sources.get(name, SETTINGS_FIELDS[name].metadata["flag"])

    if settings.min_sync_period > settings.sync_period:
        raise ValueError(
            f"{where('min_sync_period')}: {format_duration(settings.min_sync_period)} is "
            f"longer than the full resync period ({where('sync_period')}: "
            f"{format_duration(settings.sync_period)})"
        )


def parse_duration(text: str | float) -> float:
    """Seconds from a number or a Go-style duration ("500ms", "30s", "1m30s", "2h");
    ValueError for anything else, a negative or a non-finite (nan, inf) value."""
    if isinstance(text, bool):
        raise ValueError(f"{_show(text)} is not a duration (e.g. 500ms, 30s, 1m)")
    if isinstance(text, int):
        seconds = float(text) if abs(text) < 10**300 else math.inf
    elif isinstance(text, float):
        seconds = text
    else:
        stripped = str(text).strip()
        try:
            seconds = float(stripped)
        except ValueError:
            parts = _DURATION.findall(stripped)
            if not parts or "".join(n + u for n, u in parts) != stripped:
                raise ValueError(f"{text!r} is not a duration (e.g. 500ms, 30s, 1m)") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(seconds):
        raise ValueError(f"{text!r} is not a finite duration")
    if seconds < 0:
        raise ValueError(f"{text!r} is negative")
    return seconds


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_INTEGER = re.compile(r"[+-]?[0-9]+")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _split(items: list[str]) -> list[str]:
    return [v.strip() for item in items for v in str(item).split(",") if v.strip()]


def _convert(f: Field[Any], raw: Any, where: str, *, text: bool, split: bool = False) -> Any:
    """A value as the setting's type, from text (a flag or env var; `split` a list at
    commas) or from YAML (the config file, whose types must already match). No coercion:
    `true` or `1.9` is not a number, `5` is not a name."""
    kind = str(f.type)
    try:
        if raw is None:
            return None  # a config file key left empty: the default
        if kind.startswith("list"):
            items = raw if isinstance(raw, list) else [raw]
            if not all(isinstance(item, str) for item in items):
                raise ValueError(f"{_show(raw)} is not a list of strings")
            return _split(items) if split or not text or f.metadata.get("comma") else items
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            if text and str(raw).strip().lower() in _TRUE + _FALSE:
                return str(raw).strip().lower() in _TRUE
            raise ValueError(f"{_show(raw)} is not a boolean (true or false)")
        if kind == "int":
            if text and isinstance(raw, str) and _INTEGER.fullmatch(raw.strip()):
                return int(raw.strip())
            if not text and type(raw) is int:
                return raw
            raise ValueError(f"{_show(raw)} is not an integer")
        if kind == "float":  # the durations
            if not text or isinstance(raw, str):
                return parse_duration(raw)
            raise ValueError(f"{_show(raw)} is not a duration")
        if not isinstance(raw, str):
            raise ValueError(f"{_show(raw)} is not a string (quote it in YAML)")
        return raw
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _show(raw: Any) -> str:
    """A value as the user wrote it: YAML's true/false, else Python's repr."""
    return str(raw).lower() if isinstance(raw, bool) else repr(raw)


def _warn_stderr(message: str) -> None:
    print(f"kube-bpf-proxy: warning: {message}", file=sys.stderr)


def _read_config(path: str, names: list[str]) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    """The settings of a --config file for a command taking `names`: name → (value, where
    it came from); and a KubeProxyConfiguration's fields that have no equivalent. A setting
    of another command is skipped (one file serves every command); an unknown one is an
    error. A file of several YAML documents (kubeadm's configuration file) is read for
    its KubeProxyConfiguration."""
    try:
        with open(path, encoding="utf-8") as stream:
            documents = [d for d in yaml.safe_load_all(stream) if d is not None]
    except (OSError, yaml.YAMLError) as err:
        message = " ".join(str(err).split())  # YAML errors span several lines
        raise ValueError(f"--config {path}: {message}") from None
    document = documents[0] if documents else None
    if len(documents) > 1:
        found = [d for d in documents
                 if isinstance(d, dict) and kubeproxy.is_kube_proxy_configuration(d)]  # fmt: skip
        if len(found) != 1:
            raise ValueError(
                f"--config {path}: {len(documents)} YAML documents, {len(found)} of them a "
                f"{kubeproxy.KIND}: expected one mapping of settings, or one "
                f"{kubeproxy.KIND} among other documents"
            )
        document = found[0]
    if document is None:
        return {}, []
    if not isinstance(document, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings")
    if kubeproxy.is_kube_proxy_configuration(document):
        try:
            translation = kubeproxy.translate(document)
        except ValueError as err:
            raise ValueError(f"--config {path}: {kubeproxy.KIND}: {err}") from None
        items = [(name, raw, key) for name, (raw, key) in translation.values.items()]
        unmapped = translation.unmapped
    else:
        items = [(str(key).replace("-", "_"), raw, key) for key, raw in document.items()]
        unmapped = []
    values: dict[str, tuple[Any, str]] = {}
    for name, raw, key in items:
        if name not in SETTINGS_FIELDS or name == "config":
            raise ValueError(f"--config {path}: unknown setting {key!r}")
        if name not in names:
            continue  # another command's setting
        where = f"--config {path}: {key}"
        values[name] = (_convert(SETTINGS_FIELDS[name], raw, where, text=False), where)
    return values, unmapped


# --- the checks of single settings (ValueError without the setting's name) -------------

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def _nonempty(text: str) -> None:
    if not text.strip():
        raise ValueError("must not be empty")


def _each(items: list[str], check: Callable[[str], None]) -> None:
    for item in items:
        check(item)


def _absolute(path: str) -> None:
    if not os.path.isabs(path):
        raise ValueError(f"{path!r} is not an absolute path")


def _dns_subdomain(name: str) -> None:
    """A Kubernetes object name (RFC 1123 subdomain), as Node names are."""
    if not 0 < len(name) <= 253 or not all(_DNS_LABEL.fullmatch(p) for p in name.split(".")):
        raise ValueError(
            f"{name!r} is not a node name (lower-case letters, digits, '-' and '.', "
            "at most 253 characters)"
        )


def _label_value(value: str, *, empty: bool = True) -> None:
    if not value and not empty:
        raise ValueError("must not be empty")
    if value and (len(value) > 63 or not _LABEL_NAME.fullmatch(value)):
        raise ValueError(
            f"{value!r} is not a label value (at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit)"
        )


def _label(item: str) -> None:
    """KEY=VALUE with a label key ([prefix/]name) and a label value."""
    key, sep, value = item.partition("=")
    prefix, slash, name = key.rpartition("/")
    if not sep or not name:
        raise ValueError(f"{item!r} is not KEY=VALUE")
    if slash:
        try:
            _dns_subdomain(prefix)
        except ValueError:
            raise ValueError(f"{item!r}: {prefix!r} is not a DNS subdomain") from None
    if len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        raise ValueError(f"{item!r}: {name!r} is not a label name")
    _label_value(value)


def _one_per_family(items: list[str], parse: Callable[[str], tuple[str, str]], what: str) -> None:
    seen: dict[str, str] = {}
    for item in items:
        family, _ = parse(item)
        if family in seen:
            raise ValueError(
                f"one {what} per family: {seen[family]!r} and {item!r} are both {family}"
            )
        seen[family] = item


def _nodeport_addresses(items: list[str]) -> None:
    if PRIMARY in items:
        if items != [PRIMARY]:
            raise ValueError("'primary' cannot be combined with CIDRs")
        return
    for item in items:
        parse_cidr(item)


def _bind_address(bind: str) -> None:
    from .api.serving import parse_bind  # the HTTP layer owns the syntax

    parse_bind(bind)
