"""kube-proxy's configuration file (KubeProxyConfiguration, kubeproxy.config.k8s.io/v1alpha1)
read as settings: what kubeadm keeps in the `kube-proxy` ConfigMap drives this agent.

Every field is known: an unknown field (or a field of the wrong type) is an error, as
kube-proxy's strict decoding makes it. A field with an equivalent setting becomes that
setting's value; a field whose meaning this agent already has (or that cannot apply to
it) is accepted; a field set to anything but its zero value (kube-proxy's "use the
default") without an equivalent is named in `unmapped`, which the caller reports in one
warning line (an error with --strict). docs/kube-proxy.md is the table of all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GROUP = "kubeproxy.config.k8s.io"
API_VERSION = f"{GROUP}/v1alpha1"
KIND = "KubeProxyConfiguration"

# The v1alpha1 schema: field -> its type, or a nested schema. "any" fields are checked no
# further (logging's vmodule list, a quantity that YAML gives as a number or a string).
_DURATION, _STR, _BOOL, _INT, _NUMBER, _STRLIST, _BOOLMAP, _ANY = (
    "duration", "string", "boolean", "integer", "number", "list of strings",
    "map of booleans", "any",
)  # fmt: skip
_BUFFER = {"infoBufferSize": _ANY, "splitStream": _BOOL}
SCHEMA: dict[str, Any] = {
    "apiVersion": _STR,
    "kind": _STR,
    "featureGates": _BOOLMAP,
    "clientConnection": {
        "kubeconfig": _STR, "acceptContentTypes": _STR, "contentType": _STR,
        "qps": _NUMBER, "burst": _INT,
    },
    "logging": {
        "format": _STR, "flushFrequency": _ANY, "verbosity": _INT, "vmodule": _ANY,
        "options": {"json": _BUFFER, "text": _BUFFER},
    },
    "hostnameOverride": _STR,
    "bindAddress": _STR,
    "healthzBindAddress": _STR,
    "metricsBindAddress": _STR,
    "bindAddressHardFail": _BOOL,
    "enableProfiling": _BOOL,
    "showHiddenMetricsForVersion": _STR,
    "serviceProxyName": _STR,
    "mode": _STR,
    "iptables": {
        "masqueradeBit": _INT, "masqueradeAll": _BOOL, "localhostNodePorts": _BOOL,
        "syncPeriod": _DURATION, "minSyncPeriod": _DURATION,
    },
    "ipvs": {
        "syncPeriod": _DURATION, "minSyncPeriod": _DURATION, "scheduler": _STR,
        "excludeCIDRs": _STRLIST, "strictARP": _BOOL, "tcpTimeout": _DURATION,
        "tcpFinTimeout": _DURATION, "udpTimeout": _DURATION,
    },
    "nftables": {
        "masqueradeBit": _INT, "masqueradeAll": _BOOL,
        "syncPeriod": _DURATION, "minSyncPeriod": _DURATION,
    },
    "winkernel": {
        "networkName": _STR, "sourceVip": _STR, "enableDSR": _BOOL,
        "rootHnsEndpointName": _STR, "forwardHealthCheckVip": _BOOL,
    },
    "detectLocalMode": _STR,
    "detectLocal": {"bridgeInterface": _STR, "interfaceNamePrefix": _STR},
    "clusterCIDR": _STR,
    "nodePortAddresses": _STRLIST,
    "oomScoreAdj": _INT,
    "conntrack": {
        "maxPerCore": _INT, "min": _INT, "tcpEstablishedTimeout": _DURATION,
        "tcpCloseWaitTimeout": _DURATION, "tcpBeLiberal": _BOOL,
        "udpTimeout": _DURATION, "udpStreamTimeout": _DURATION,
    },
    "configSyncPeriod": _DURATION,
    "portRange": _STR,
}  # fmt: skip

# Field -> setting, where the meaning is equal (values pass through the setting's own
# conversion and checks, which then name the field).
DIRECT: dict[str, str] = {
    "hostnameOverride": "node",
    "serviceProxyName": "service_proxy_name",
    "clientConnection.kubeconfig": "kubeconfig",
    "nodePortAddresses": "nodeport_addresses",
    "conntrack.tcpEstablishedTimeout": "conntrack_tcp_timeout_established",
    "conntrack.tcpCloseWaitTimeout": "conntrack_tcp_timeout_close_wait",
    "conntrack.udpTimeout": "conntrack_udp_timeout",
    "conntrack.udpStreamTimeout": "conntrack_udp_timeout_stream",
    "logging.verbosity": "verbosity",
    "logging.format": "log_format",
}
# Fields mapped by a rule of their own below (the table in docs/kube-proxy.md says how).
RULES = (
    "bindAddress", "healthzBindAddress", "metricsBindAddress", "clusterCIDR",
    "detectLocalMode", "detectLocal.interfaceNamePrefix",
    "iptables.syncPeriod", "iptables.minSyncPeriod", "nftables.syncPeriod",
    "nftables.minSyncPeriod", "ipvs.syncPeriod", "ipvs.minSyncPeriod",
)  # fmt: skip
# Fields accepted whatever their value: this agent has their meaning already, or they
# cannot apply to it (the docs say why for each).
ACCEPTED = (
    "apiVersion", "kind",
    "mode",  # a hint only: --dataplane auto picks eBPF, else iptables
    "bindAddressHardFail",  # the agent always exits when it cannot bind a port
    "showHiddenMetricsForVersion",  # no metric of this agent is hidden
    "configSyncPeriod",  # no informer cache to resync: --sync-period re-applies all
    "winkernel",  # Windows only
)  # fmt: skip
# The proxy modes kube-proxy knows, and the section whose sync periods each one reads.
MODES = {"": "iptables", "iptables": "iptables", "nftables": "nftables", "ipvs": "ipvs",
         "kernelspace": None}  # fmt: skip
DETECT_LOCAL_MODES = ("", "ClusterCIDR", "NodeCIDR", "BridgeInterface", "InterfaceNamePrefix")
DEFAULT_HEALTHZ_PORT, DEFAULT_METRICS_PORT = 10256, 10249


def is_kube_proxy_configuration(document: dict[Any, Any]) -> bool:
    """Whether a --config document is kube-proxy's (by kind or by API group)."""
    api_version = str(document.get("apiVersion", ""))
    return document.get("kind") == KIND or api_version.split("/")[0] == GROUP


@dataclass
class Translation:
    """Settings from a KubeProxyConfiguration: name -> (value, field it came from)."""

    values: dict[str, tuple[Any, str]] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)  # set fields with no equivalent


def translate(document: dict[Any, Any]) -> Translation:
    """The settings a KubeProxyConfiguration document means; ValueError naming the field
    for an unknown field, a value of the wrong type, or an unknown apiVersion or mode."""
    if document.get("apiVersion") != API_VERSION or document.get("kind") != KIND:
        raise ValueError(
            f"apiVersion {document.get('apiVersion')!r}, kind {document.get('kind')!r}: "
            f"expected {API_VERSION} {KIND}"
        )
    leaves: dict[str, Any] = {}
    _walk(document, SCHEMA, "", leaves)
    out = Translation()
    set_fields = {path: value for path, value in leaves.items() if not _zero(value)}

    def put(name: str, value: Any, path: str) -> None:
        out.values[name] = (value, path)

    for path, name in DIRECT.items():
        if path in set_fields:
            value = set_fields[path]
            put(name, value.strip().lower() if name == "node" else value, path)
    mode = leaves.get("mode") or ""
    if mode not in MODES:
        raise ValueError(f"mode: {mode!r} is not one of {', '.join(repr(m) for m in MODES)}")
    section = MODES[mode]
    for key, name in (("syncPeriod", "sync_period"), ("minSyncPeriod", "min_sync_period")):
        path = f"{section}.{key}"
        if section and path in set_fields:
            put(name, set_fields[path], path)
    # bindAddress: kube-proxy's override of the node's primary IP (0.0.0.0 and :: unset).
    bind = set_fields.get("bindAddress", "").strip()
    if bind and bind not in ("0.0.0.0", "::"):
        put("node_ip", [bind], "bindAddress")
    for path, name, port in (
        ("healthzBindAddress", "healthz_bind_address", DEFAULT_HEALTHZ_PORT),
        ("metricsBindAddress", "metrics_bind_address", DEFAULT_METRICS_PORT),
    ):
        if path in set_fields:
            put(name, _with_port(set_fields[path], port), path)
    if "clusterCIDR" in set_fields:
        cidrs = [c.strip() for c in set_fields["clusterCIDR"].split(",") if c.strip()]
        put("cluster_cidr", cidrs, "clusterCIDR")
    unmapped_paths = _detect_local(leaves, set_fields, put)
    handled = {*DIRECT, *RULES}
    for path in set_fields:
        top, _, _ = path.partition(".")
        if path in handled or path in ACCEPTED or top in ACCEPTED:
            continue
        if top in MODES.values() and top != section:
            continue  # another mode's section: kube-proxy ignores it too
        unmapped_paths.append(path)
    out.unmapped = sorted(set(unmapped_paths))
    return out


def _detect_local(leaves: dict[str, Any], set_fields: dict[str, Any], put: Any) -> list[str]:
    """detectLocalMode and detectLocal: the unmapped fields among them."""
    mode = leaves.get("detectLocalMode") or ""
    if mode not in DETECT_LOCAL_MODES:
        raise ValueError(
            f"detectLocalMode: {mode!r} is not one of "
            f"{', '.join(repr(m) for m in DETECT_LOCAL_MODES)}"
        )
    prefix = set_fields.get("detectLocal.interfaceNamePrefix", "")
    if mode == "InterfaceNamePrefix":
        if not prefix:
            raise ValueError("detectLocal.interfaceNamePrefix: required by detectLocalMode "
                             "InterfaceNamePrefix")  # fmt: skip
        put("pod_interfaces", [prefix + "*"], "detectLocal.interfaceNamePrefix")
    # ClusterCIDR (the default) is clusterCIDR above; NodeCIDR and BridgeInterface have no
    # equivalent: the eBPF dataplane tells pod traffic by --pod-interfaces (and
    # --cluster-cidr), whatever the mode.
    return ["detectLocalMode"] if mode in ("NodeCIDR", "BridgeInterface") else []


def _with_port(address: str, port: int) -> str:
    """kube-proxy takes a bind address with or without its port."""
    address = address.strip()
    if address.startswith("["):
        return address if "]:" in address else f"{address}:{port}"
    if address.count(":") > 1:  # a bare IPv6 address
        return f"[{address}]:{port}"
    return address if ":" in address else f"{address}:{port}"


def _walk(node: Any, schema: dict[str, Any], prefix: str, leaves: dict[str, Any]) -> None:
    """Check `node` against `schema`, collecting leaf values by dotted path."""
    if not isinstance(node, dict):
        raise ValueError(f"{prefix.rstrip('.') or 'the document'}: expected a mapping")
    for key, value in node.items():
        path = f"{prefix}{key}"
        kind = schema.get(key) if isinstance(key, str) else None
        if kind is None:
            raise ValueError(f'unknown field "{path}" (kube-proxy\'s strict decoding refuses it)')
        if isinstance(kind, dict):
            if value is not None:
                _walk(value, kind, path + ".", leaves)
            continue
        if value is not None and not _typed(value, kind):
            raise ValueError(f"{path}: {value!r} is not a {kind}")
        leaves[path] = value


def _typed(value: Any, kind: str) -> bool:
    if kind == _ANY:
        return True
    if kind in (_STR, _DURATION):
        return isinstance(value, str)
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _INT:
        return type(value) is int
    if kind == _NUMBER:
        return type(value) in (int, float)
    if kind == _STRLIST:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if kind == _BOOLMAP:
        return isinstance(value, dict) and all(isinstance(v, bool) for v in value.values())
    raise AssertionError(kind)


def _zero(value: Any) -> bool:
    """kube-proxy's unset: null, or its type's zero value (0s for a duration)."""
    if value is None or value is False or value == 0 or value in ("", [], {}):
        return True
    if isinstance(value, str):
        return value.strip() in ("", "0", "0s", "0ms", "0m", "0h")
    return False
