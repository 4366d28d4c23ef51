"""Settings: one documented dataclass; every field is a CLI flag and a KBP_* env var.

Precedence: command-line flag, then environment variable, then default. List-valued
settings take comma-separated values in the environment.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from dataclasses import Field, dataclass, field, fields
from typing import Any

import yaml

from .model.compile import PRIMARY, CompileOptions
from .model.ip import parse_cidr, parse_ip

ENV_PREFIX = "KBP_"

# Host-side names the common CNI plugins give the pod-facing end of a pod's veth pair:
DEFAULT_POD_INTERFACES: tuple[str, ...] = (
    "veth*",  # generic veth CNIs: bridge/ptp plugins, flannel, kindnet, Docker, Weave
    "cali*",  # Calico
    "lxc*",  # Cilium (lxc<hash>)
    "eni*",  # AWS VPC CNI
    "gke*",  # GKE's own dataplane
)


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
    kubeconfig: str | None = field(
        default=None,
        metadata=_opt(
            "--kubeconfig",
            "kubeconfig file; default: in-cluster service account, else $KUBECONFIG, "
            "else ~/.kube/config",
            metavar="FILE",
        ),
    )
    dataplane: str = field(
        default="auto",
        metadata=_opt(
            "--dataplane",
            "what programs the NodeState: auto picks the best available and says why; "
            "none compiles and serves it without programming anything (a dry run)",
            choices=("auto", "ebpf", "iptables", "none"),
        ),
    )
    bpffs: str = field(
        default="/sys/fs/bpf/kube-bpf-proxy",
        metadata=_opt(
            "--bpffs",
            "directory on a bpffs where the eBPF dataplane pins its maps (kbp_*_v<N>)",
            metavar="DIR",
        ),
    )
    pod_interfaces: list[str] = field(
        default_factory=lambda: list(DEFAULT_POD_INTERFACES),
        metadata=_opt(
            "--pod-interfaces",
            "globs of the host-side pod interfaces the eBPF dataplane attaches to "
            f"(default: {','.join(DEFAULT_POD_INTERFACES)}, the common CNI prefixes)",
            metavar="GLOB,...",
            comma=True,
        ),
    )
    external_interfaces: list[str] = field(
        default_factory=list,
        metadata=_opt(
            "--external-interfaces",
            "globs of the node's external interfaces, where the eBPF dataplane serves "
            "NodePort, LoadBalancer and ExternalIP traffic from outside (tc, and XDP); "
            "default: the interfaces that carry the node's --nodeport-addresses",
            metavar="GLOB,...",
            comma=True,
        ),
    )
    xdp: str = field(
        default="true",
        metadata=_opt(
            "--xdp",
            "XDP on the external interfaces: true tries native mode, then generic; native "
            "or generic insist on one; false leaves external traffic to tc alone",
            choices=("true", "false", "native", "generic"),
        ),
    )
    cgroup_root: str = field(
        default="auto",
        metadata=_opt(
            "--cgroup-root",
            "cgroup (v2) whose processes the eBPF dataplane's socket hooks serve: connect() "
            "and sendmsg() of the node's own processes to a Service go straight to a "
            "backend; auto: the cgroup2 mount's root (every process); none: off",
            metavar="DIR|auto|none",
        ),
    )
    snat_port_range: str = field(
        default="61000-65535",
        metadata=_opt(
            "--snat-port-range",
            "source ports for external flows the eBPF dataplane forwards to backends on "
            "other nodes (SNAT to this node's address); keep it outside the node's "
            "net.ipv4.ip_local_port_range and the NodePort range",
            metavar="LOW-HIGH",
        ),
    )
    maglev_table_size: int = field(
        default=16381,
        metadata=_opt(
            "--maglev-table-size",
            "slots of each Maglev table (a prime larger than a Service's backend count; "
            "more slots spread load more evenly and cost more map entries)",
            type=int,
            metavar="PRIME",
        ),
    )
    map_size_services: int = field(
        default=65536,
        metadata=_opt(
            "--map-size-services", "frontend entries (and service ids)", type=int, metavar="N"
        ),
    )
    map_size_slots: int = field(
        default=262144,
        metadata=_opt(
            "--map-size-slots",
            "backend slots over all Services, Maglev tables included",
            type=int,
            metavar="N",
        ),
    )
    map_size_backends: int = field(
        default=262144,
        metadata=_opt(
            "--map-size-backends", "(Service port, endpoint) pairs", type=int, metavar="N"
        ),
    )
    map_size_ct: int = field(
        default=262144,
        metadata=_opt(
            "--map-size-ct",
            "conntrack entries (two per connection; LRU)",
            type=int,
            metavar="N",
        ),
    )
    map_size_affinity: int = field(
        default=65536,
        metadata=_opt(
            "--map-size-affinity",
            "sessionAffinity ClientIP entries (LRU)",
            type=int,
            metavar="N",
        ),
    )
    conntrack_tcp_timeout_syn: float = field(
        default=120.0,
        metadata=_opt(
            "--conntrack-tcp-timeout-syn",
            "eBPF conntrack: idle timeout of a TCP flow whose SYN got no answer yet "
            "(netfilter's SYN_SENT)",
            metavar="DURATION",
            type=lambda text: parse_duration(text),
        ),
    )
    conntrack_tcp_timeout_established: float = field(
        default=86400.0,
        metadata=_opt(
            "--conntrack-tcp-timeout-established",
            "eBPF conntrack: idle timeout of an established TCP flow (kube-proxy's flag "
            "and default)",
            metavar="DURATION",
            type=lambda text: parse_duration(text),
        ),
    )
    conntrack_tcp_timeout_close_wait: float = field(
        default=3600.0,
        metadata=_opt(
            "--conntrack-tcp-timeout-close-wait",
            "eBPF conntrack: idle timeout of a TCP flow with a FIN seen one way (half "
            "closed; kube-proxy's flag and default)",
            metavar="DURATION",
            type=lambda text: parse_duration(text),
        ),
    )
    conntrack_tcp_timeout_time_wait: float = field(
        default=10.0,
        metadata=_opt(
            "--conntrack-tcp-timeout-time-wait",
            "eBPF conntrack: how long a TCP flow stays after FINs both ways or a RST "
            "(the entries only translate: a late segment still reaches its backend by the "
            "flow hash)",
            metavar="DURATION",
            type=lambda text: parse_duration(text),
        ),
    )
    conntrack_udp_timeout: float = field(
        default=30.0,
        metadata=_opt(
            "--conntrack-udp-timeout",
            "eBPF conntrack: idle timeout of a UDP flow that got no reply yet (kube-proxy's "
            "flag; the kernel's default)",
            metavar="DURATION",
            type=lambda text: parse_duration(text),
        ),
    )
    conntrack_udp_timeout_stream: float = field(
        default=120.0,
        metadata=_opt(
            "--conntrack-udp-timeout-stream",
            "eBPF conntrack: idle timeout of a UDP flow that got a reply (kube-proxy's "
            "flag; the kernel's default)",
            metavar="DURATION",
            type=lambda text: parse_duration(text),
        ),
    )
    conntrack_sweep_interval: float = field(
        default=10.0,
        metadata=_opt(
            "--conntrack-sweep-interval",
            "eBPF conntrack: how often the agent removes expired and closed flows from "
            "kbp_ct (0: never; the LRU alone then makes room)",
            metavar="DURATION",
            type=lambda text: parse_duration(text),
        ),
    )
    min_sync_period: float = field(
        default=0.0,
        metadata=_opt(
            "--min-sync-period",
            "minimum time between syncs (e.g. 1s); 0 applies changes at once, coalescing "
            "those that arrive during a sync",
            metavar="DURATION",
            type=lambda text: parse_duration(text),
        ),
    )
    sync_period: float = field(
        default=30.0,
        metadata=_opt(
            "--sync-period",
            "full resync period (e.g. 30s); a resync writes nothing when the kernel matches",
            metavar="DURATION",
            type=lambda text: parse_duration(text),
        ),
    )
    metrics_bind_address: str = field(
        default="127.0.0.1:10249",
        metadata=_opt(
            "--metrics-bind-address", "address of /metrics and /state", metavar="HOST:PORT"
        ),
    )
    healthz_bind_address: str = field(
        default="0.0.0.0:10256",
        metadata=_opt(
            "--healthz-bind-address",
            "address of /healthz, /livez and /readyz",
            metavar="HOST:PORT",
        ),
    )
    log_format: str = field(
        default="text",
        metadata=_opt("--log-format", "log line format", choices=("text", "json")),
    )
    verbosity: int = field(
        default=0,
        metadata=_opt(
            "--v",
            "log verbosity like kube-proxy's -v: 0-1 info, 2+ debug",
            short="-v",
            type=int,
            metavar="N",
        ),
    )
    config: str | None = field(
        default=None,
        metadata=_opt(
            "--config",
            "YAML file with any of these settings (keys as the flags without dashes, "
            "e.g. sync-period or sync_period); flags and env vars win over it",
            metavar="FILE",
        ),
    )
    output: str = field(
        default="yaml",
        metadata=_opt("--output", "output format", short="-o", choices=("yaml", "json")),
    )
    inspect_output: str = field(
        default="table",
        metadata=_opt("--output", "output format", short="-o", choices=("table", "json")),
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

    def map_sizes(self) -> dict[str, int]:
        """Sizes of the eBPF maps, by map (services, slots, backends, ct, affinity)."""
        return {
            name: getattr(self, f"map_size_{name}")
            for name in ("services", "slots", "backends", "ct", "affinity")
        }

    def conntrack_timeouts(self) -> dict[str, float]:
        """The eBPF conntrack's idle timeouts in seconds, by state (the fields of
        agent.dataplane.ebpf.conntrack.Timeouts)."""
        return {state: getattr(self, name) for state, name in CONNTRACK_TIMEOUTS.items()}

    def snat_ports(self) -> tuple[int, int]:
        """--snat-port-range as (low, high); ValueError naming the flag."""
        low, sep, high = self.snat_port_range.strip().partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            raise ValueError(
                f"--snat-port-range: {self.snat_port_range!r} is not LOW-HIGH"
            ) from None
        if not 1024 <= first <= last <= 65535:
            raise ValueError(
                f"--snat-port-range: {self.snat_port_range!r} must lie within 1024-65535, "
                "low <= high"
            )
        return first, last

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
        for name in (
            "map_size_services",
            "map_size_slots",
            "map_size_backends",
            "map_size_ct",
            "map_size_affinity",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be at least 1")
        if self.maglev_table_size < 3 or any(
            self.maglev_table_size % d == 0 for d in range(2, int(self.maglev_table_size**0.5) + 1)
        ):
            raise ValueError(f"--maglev-table-size: {self.maglev_table_size} is not a prime")
        if not self.pod_interfaces:
            raise ValueError("--pod-interfaces: at least one glob is required")
        self.snat_ports()
        for name in CONNTRACK_TIMEOUTS.values():  # (the sweep interval may be 0: off)
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be more than 0")
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

# The eBPF conntrack's timeouts: Timeouts field -> setting.
CONNTRACK_TIMEOUTS = {
    "tcp_syn": "conntrack_tcp_timeout_syn",
    "tcp_established": "conntrack_tcp_timeout_established",
    "tcp_close_wait": "conntrack_tcp_timeout_close_wait",
    "tcp_time_wait": "conntrack_tcp_timeout_time_wait",
    "udp": "conntrack_udp_timeout",
    "udp_stream": "conntrack_udp_timeout_stream",
}
CONNTRACK_SETTINGS = [*CONNTRACK_TIMEOUTS.values(), "conntrack_sweep_interval"]


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
    """Settings from parsed flags, then KBP_* env vars, then the --config file, then
    defaults. Raises ValueError naming the setting (and its source) that is wrong."""
    environ = dict(os.environ) if environ is None else environ
    file_values: dict[str, Any] = {}
    if "config" in names:
        path = getattr(args, "config", None) or environ.get(ENV_PREFIX + "CONFIG")
        if path:
            file_values = _read_config(path, names)
    values: dict[str, Any] = {}
    for name in names:
        f = SETTINGS_FIELDS[name]
        value = getattr(args, name, None)
        if isinstance(value, list) and f.metadata.get("comma"):
            value = _split(value)
        if value is None or value is False:
            raw = environ.get(ENV_PREFIX + name.upper())
            if raw is not None:
                value = _convert(f, raw, f"{ENV_PREFIX}{name.upper()}")
            elif name in file_values:
                value = file_values[name]
        if value is not None:
            values[name] = value
    settings = Settings(**values)
    settings.validate()
    return settings


def parse_duration(text: str | float) -> float:
    """Seconds from a number or a Go-style duration ("500ms", "30s", "1m30s", "2h")."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        stripped = str(text).strip()
        try:
            seconds = float(stripped)
        except ValueError:
            parts = _DURATION.findall(stripped)
            if not parts or "".join(n + u for n, u in parts) != stripped:
                raise ValueError(f"{text!r} is not a duration (e.g. 500ms, 30s, 1m)") from None
            seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if seconds < 0:
        raise ValueError(f"{text!r} is negative")
    return seconds


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def _split(items: list[str]) -> list[str]:
    return [v.strip() for item in items for v in str(item).split(",") if v.strip()]


def _convert(f: Field[Any], raw: Any, source: str) -> Any:
    """A value from the environment (text) or the config file (YAML) as the setting's type."""
    kind = str(f.type)
    try:
        if kind.startswith("list"):
            return _split(raw if isinstance(raw, list) else [raw])
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            return str(raw).strip().lower() in ("1", "true", "yes", "on")
        if f.metadata.get("type") is not None:
            return f.metadata["type"](raw)
        if kind == "int":
            return int(raw)
        return None if raw is None else str(raw)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err}") from None


def _read_config(path: str, names: list[str]) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as stream:
            document = yaml.safe_load(stream)
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"--config {path}: {err}") from None
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings")
    values: dict[str, Any] = {}
    for key, raw in document.items():
        name = str(key).replace("-", "_")
        if name not in names or name == "config":
            raise ValueError(f"--config {path}: unknown setting {key!r}")
        values[name] = _convert(SETTINGS_FIELDS[name], raw, f"--config {path}: {key}")
    return values
