"""Decode Kubernetes objects (plain dicts from YAML, JSON or the API) into model values.

Validation is strict where a wrong value would change what the kernel does, and every
rejection names the field and says what is wrong. The decoder does what the API server
would do for us (defaults such as protocol TCP) and what kube-proxy's informers filter
server-side (headless and FQDN slices are not decoded); Kubernetes *semantics* — which
endpoints serve which traffic — are left to the compiler.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from . import conventions as c
from .ip import IPV4, IPV6, parse_cidr, parse_ip
from .quote import name as printable
from .quote import one_line, quote
from .types import NO_HINTS, Endpoint, EndpointSlice, Node, Service, ServicePort, SlicePort

Value = Service | EndpointSlice | Node


class Invalid(ValueError):
    """A malformed object; the message starts with the offending field's path."""


@dataclass(frozen=True, slots=True)
class Decoded:
    """The outcome of decoding one object.

    Exactly one of `value`, `error` and `skipped` is set: a model value; what is wrong
    with a malformed object (it must be reported and skipped); or why a well-formed
    object is of no interest (unknown kind, headless or FQDN slice: a debug note).
    `warnings` are problems that did not stop decoding (the fallback taken is stated).
    """

    kind: str
    namespace: str | None
    name: str | None
    value: Value | None = None
    error: str | None = None
    skipped: str | None = None
    warnings: tuple[str, ...] = ()

    @property
    def ref(self) -> str:
        """`Kind namespace/name`, as far as the object told us."""
        return object_ref(self.kind, self.namespace, self.name)


def object_ref(kind: str, namespace: str | None, name: str | None) -> str:
    """How reports name an object: `Kind namespace/name`, `Kind name` without namespace."""
    shown = printable(name) if name else "<unnamed>"
    if namespace is None:
        return f"{printable(kind)} {shown}"
    return f"{printable(kind)} {printable(namespace)}/{shown}"


def decode_object(obj: object) -> Decoded:
    """Decode any supported object; never raises, whatever the input.

    Every message is one line of bounded length (see agent/model/quote.py)."""
    if not isinstance(obj, Mapping):
        return Decoded("<unknown>", None, None, error=f"expected an object, got {_type(obj)}")
    kind = obj.get("kind")
    api_version = obj.get("apiVersion")
    meta = obj.get("metadata")
    namespace, name = _ref(meta)
    if kind is None or kind == "":
        return Decoded("<unknown>", namespace, name, error="kind is missing")
    if not isinstance(kind, str):
        error = f"kind: expected a string, got {_type(kind)} {quote(kind)}"
        return Decoded("<unknown>", namespace, name, error=error)
    if not isinstance(api_version, str | None):
        if kind not in _KINDS:
            return Decoded(kind, namespace, name, skipped="apiVersion is not a string")
        error = f"apiVersion: expected a string, got {_type(api_version)} {quote(api_version)}"
        return Decoded(kind, namespace, name, error=error)
    decoder = _DECODERS.get((api_version, kind))
    if decoder is None and api_version is None and kind in _KINDS:
        return Decoded(kind, namespace, name, error="apiVersion is missing")
    if decoder is None:
        return Decoded(kind, namespace, name, skipped=f"{api_version}/{kind} is not used")
    if kind == "Node":
        namespace = None
    warnings: list[str] = []
    try:
        value = decoder(obj, warnings)
    except Invalid as err:
        return Decoded(kind, namespace, name, error=one_line(str(err)), warnings=_lines(warnings))
    except Exception as err:  # a decoder bug must cost one object, not the whole input
        error = f"cannot be decoded ({type(err).__name__}: {err}; a bug, please report it)"
        return Decoded(kind, namespace, name, error=one_line(error), warnings=_lines(warnings))
    if isinstance(value, str):
        return Decoded(kind, namespace, name, skipped=value, warnings=_lines(warnings))
    return Decoded(kind, namespace, name, value=value, warnings=_lines(warnings))


def _lines(warnings: list[str]) -> tuple[str, ...]:
    return tuple(one_line(w) for w in warnings)


def _ref(meta: object) -> tuple[str | None, str | None]:
    if not isinstance(meta, Mapping):
        return None, None
    name = meta.get("name")
    namespace = meta.get("namespace") or "default"
    return (
        namespace if isinstance(namespace, str) else None,
        name if isinstance(name, str) else None,
    )


# --- field helpers -----------------------------------------------------------------------


def _type(value: object) -> str:
    return "null" if value is None else type(value).__name__


_SURROGATE = re.compile("[\ud800-\udfff]")


def _text(value: str, path: str) -> str:
    """A string that can be written out: no lone surrogate (JSON's "\\udc80" gives one),
    which no encoder accepts and which would fail every later hash and output."""
    if not value.isascii() and _SURROGATE.search(value):
        raise Invalid(f"{path}: {quote(value)} is not valid Unicode text (a lone surrogate)")
    return value


def _map(obj: Mapping[str, Any], key: str, path: str, required: bool = False) -> Mapping[str, Any]:
    value = obj.get(key)
    if value is None:
        if required:
            raise Invalid(f"{path}: is missing")
        return {}
    if not isinstance(value, Mapping):
        raise Invalid(f"{path}: expected an object, got {_type(value)}")
    return value


def _list(obj: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise Invalid(f"{path}: expected a list, got {_type(value)}")
    return value


def _str(obj: Mapping[str, Any], key: str, path: str, default: str | None = None) -> str | None:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise Invalid(f"{path}: expected a string, got {_type(value)} {quote(value)}")
    return _text(value, path)


def _int(obj: Mapping[str, Any], key: str, path: str, low: int, high: int, default: int) -> int:
    value = obj.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise Invalid(f"{path}: expected an integer, got {_type(value)} {quote(value)}")
    if not low <= value <= high:
        raise Invalid(f"{path}: {quote(value)} is out of range {low}..{high}")
    return value


def _bool(obj: Mapping[str, Any], key: str, path: str) -> bool | None:
    value = obj.get(key)
    if value is None or isinstance(value, bool):
        return value
    raise Invalid(f"{path}: expected true, false or null, got {_type(value)} {quote(value)}")


def _enum(value: str | None, allowed: tuple[str, ...], path: str, default: str) -> str:
    if not value:
        return default
    if value not in allowed:
        raise Invalid(f"{path}: {quote(value)} is not one of {', '.join(allowed)}")
    return value


def _protocol(port: Mapping[str, Any], path: str) -> str:
    """A port's protocol; TCP when unset, as the API server defaults it."""
    return _enum(_str(port, "protocol", f"{path}.protocol"), c.PROTOCOLS, f"{path}.protocol", "TCP")


def _string_map(obj: Mapping[str, Any], key: str, path: str) -> Mapping[str, str]:
    value = _map(obj, key, path)
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise Invalid(f"{path}: {quote(k)}: keys and values must be strings, got {_type(v)}")
        if not (k.isascii() and v.isascii()):
            _text(k, path)
            _text(v, f"{path}[{quote(k)}]")
    return value


def _metadata(obj: Mapping[str, Any]) -> tuple[str, str, Mapping[str, Any]]:
    meta = _map(obj, "metadata", "metadata", required=True)
    name = _str(meta, "name", "metadata.name")
    if not name:
        raise Invalid("metadata.name: is missing")
    namespace = _str(meta, "namespace", "metadata.namespace") or "default"
    return namespace, name, meta


def _ip(text: object, path: str, family: str | None = None) -> tuple[str, str]:
    try:
        return parse_ip(text, family)
    except ValueError as err:
        raise Invalid(f"{path}: {err}") from None


_intern = sys.intern


# --- Service -----------------------------------------------------------------------------


def decode_service(obj: Mapping[str, Any], warnings: list[str]) -> Service:
    namespace, name, meta = _metadata(obj)
    labels = _string_map(meta, "labels", "metadata.labels")
    annotations = _string_map(meta, "annotations", "metadata.annotations")
    spec = _map(obj, "spec", "spec", required=True)
    svc_type = _enum(
        _str(spec, "type", "spec.type"),
        c.SERVICE_TYPES,
        "spec.type",
        "ClusterIP",
    )
    proxy_name = labels.get(c.LABEL_SERVICE_PROXY_NAME)
    cluster_ips = _cluster_ips(spec)
    if svc_type == "ExternalName" or not cluster_ips:
        # Never programmed (kube-proxy's ShouldSkipService): keep decoding to a minimum,
        # thousands of headless per-replica Services must cost next to nothing.
        return Service(namespace, name, svc_type, (), proxy_name=proxy_name)

    ports = _service_ports(spec, warnings)
    external_ips = tuple(
        dict.fromkeys(
            _ip(ip, f"spec.externalIPs[{i}]")[1]
            for i, ip in enumerate(_list(spec, "externalIPs", "spec.externalIPs"))
        )
    )
    source_ranges = sorted(
        {
            parse_cidr_at(cidr, f"spec.loadBalancerSourceRanges[{i}]")
            for i, cidr in enumerate(
                _list(spec, "loadBalancerSourceRanges", "spec.loadBalancerSourceRanges")
            )
        }
    )
    affinity = _enum(
        _str(spec, "sessionAffinity", "spec.sessionAffinity"),
        ("None", "ClientIP"),
        "spec.sessionAffinity",
        "None",
    )
    timeout = None
    if affinity == "ClientIP":
        config = _map(
            _map(spec, "sessionAffinityConfig", "spec.sessionAffinityConfig"),
            "clientIP",
            "spec.sessionAffinityConfig.clientIP",
        )
        timeout = _int(
            config,
            "timeoutSeconds",
            "spec.sessionAffinityConfig.clientIP.timeoutSeconds",
            1,
            c.MAX_AFFINITY_TIMEOUT,
            c.DEFAULT_AFFINITY_TIMEOUT,
        )
    policies = ("Cluster", "Local")
    etp = _enum(
        _str(spec, "externalTrafficPolicy", "spec.externalTrafficPolicy"),
        policies,
        "spec.externalTrafficPolicy",
        "Cluster",
    )
    itp = _enum(
        _str(spec, "internalTrafficPolicy", "spec.internalTrafficPolicy"),
        policies,
        "spec.internalTrafficPolicy",
        "Cluster",
    )
    hc_port = _int(spec, "healthCheckNodePort", "spec.healthCheckNodePort", 0, 65535, 0)
    return Service(
        namespace=namespace,
        name=name,
        type=svc_type,
        cluster_ips=cluster_ips,
        ports=ports,
        external_ips=external_ips,
        load_balancer_ips=_load_balancer_ips(obj) if svc_type == "LoadBalancer" else (),
        load_balancer_source_ranges=tuple(r for _, r in source_ranges),
        affinity_timeout=timeout,
        external_traffic_policy=etp,
        internal_traffic_policy=itp,
        health_check_node_port=hc_port,
        proxy_name=proxy_name,
        topology_keys=_topology_keys(annotations, warnings),
        multi_cluster=_multi_cluster(annotations, warnings),
        lb_algorithm=_lb_algorithm(annotations, warnings),
    )


def parse_cidr_at(cidr: object, path: str) -> tuple[str, str]:
    try:
        return parse_cidr(cidr)
    except ValueError as err:
        raise Invalid(f"{path}: {err}") from None


def _cluster_ips(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """Canonical ClusterIPs, primary first; () for headless or unallocated Services."""
    cluster_ip = _str(spec, "clusterIP", "spec.clusterIP")
    listed = _list(spec, "clusterIPs", "spec.clusterIPs")
    if not listed:  # only the singular field: unallocated, headless, or one address
        if cluster_ip in (None, "", "None"):
            return ()
        return (_ip(cluster_ip, "spec.clusterIP")[1],)
    if listed[0] in ("None", ""):
        if len(listed) > 1:
            raise Invalid(f"spec.clusterIPs: {quote(listed[0])} must be the only entry")
        ips: list[str] = []
    else:
        families: set[str] = set()
        ips = []
        for i, text in enumerate(listed):
            family, ip = _ip(text, f"spec.clusterIPs[{i}]")
            if family in families:
                raise Invalid(f"spec.clusterIPs: more than one {family} address")
            families.add(family)
            ips.append(ip)
    # The singular field, when set, must be the primary (the API server enforces this).
    if cluster_ip:
        primary = ips[0] if ips else listed[0]
        same = (
            _ip(cluster_ip, "spec.clusterIP")[1] == primary
            if ips and cluster_ip != "None"
            else cluster_ip == primary
        )
        if not same:
            raise Invalid(
                f"spec.clusterIP: {quote(cluster_ip)} differs from spec.clusterIPs[0] "
                f"{quote(listed[0])}"
            )
    return tuple(ips)


def _service_ports(spec: Mapping[str, Any], warnings: list[str]) -> tuple[ServicePort, ...]:
    """The ports; of two with the same port (or nodePort) and protocol, which the API
    server rejects, the first keeps it and the later one is reported and left out, so
    no two entries ever claim one frontend."""
    raw = _list(spec, "ports", "spec.ports")
    if not raw:
        raise Invalid("spec.ports: a Service with a cluster IP needs at least one port")
    ports: list[ServicePort] = []
    names: set[str] = set()
    used: dict[tuple[str, str, int], int] = {}  # ("port" | "nodePort", protocol, n) → index
    for i, item in enumerate(raw):
        path = f"spec.ports[{i}]"
        if not isinstance(item, Mapping):
            raise Invalid(f"{path}: expected an object, got {_type(item)}")
        if item.get("port") is None:
            raise Invalid(f"{path}.port: is missing")
        port = _int(item, "port", f"{path}.port", 1, 65535, 0)
        protocol = _protocol(item, path)
        name = _str(item, "name", f"{path}.name", "") or ""
        if name in names:
            raise Invalid(f"{path}.name: duplicate port name {quote(name)}")
        if not name and len(raw) > 1:
            raise Invalid(f"{path}.name: required when a Service has more than one port")
        names.add(name)
        node_port = _int(item, "nodePort", f"{path}.nodePort", 0, 65535, 0)
        first = used.setdefault(("port", protocol, port), i)
        if first != i:
            warnings.append(
                f"{path}: port {port}/{protocol} is also spec.ports[{first}]'s (the API server "
                f"rejects this); spec.ports[{first}] keeps it and this port is ignored"
            )
            continue
        if node_port:
            first = used.setdefault(("nodePort", protocol, node_port), i)
            if first != i:
                warnings.append(
                    f"{path}.nodePort: {node_port}/{protocol} is also spec.ports[{first}]'s (the "
                    f"API server rejects this); spec.ports[{first}] keeps it and this port gets "
                    "no NodePort"
                )
                node_port = 0
        ports.append(ServicePort(_intern(name), protocol, port, node_port))
    return tuple(ports)


def _load_balancer_ips(obj: Mapping[str, Any]) -> tuple[str, ...]:
    status = _map(obj, "status", "status")
    balancer = _map(status, "loadBalancer", "status.loadBalancer")
    ips: dict[str, None] = {}
    for i, ingress in enumerate(_list(balancer, "ingress", "status.loadBalancer.ingress")):
        path = f"status.loadBalancer.ingress[{i}]"
        if not isinstance(ingress, Mapping):
            raise Invalid(f"{path}: expected an object, got {_type(ingress)}")
        ip = _str(ingress, "ip", f"{path}.ip")
        mode = _enum(
            _str(ingress, "ipMode", f"{path}.ipMode"), ("VIP", "Proxy"), f"{path}.ipMode", "VIP"
        )
        if ip and mode == "VIP":  # Proxy mode: the load balancer rewrites the destination
            ips[_ip(ip, f"{path}.ip")[1]] = None
    return tuple(ips)


def _topology_keys(annotations: Mapping[str, str], warnings: list[str]) -> tuple[str, ...]:
    raw = annotations.get(c.ANNOTATION_TOPOLOGY_KEYS)
    if raw is None:
        return ()
    keys = [k.strip() for k in raw.split(",")]
    problem = None
    if not raw.strip() or any(not k for k in keys):
        problem = "has an empty key"
    elif len(keys) > c.TOPOLOGY_KEYS_MAX:
        problem = f"has more than {c.TOPOLOGY_KEYS_MAX} keys"
    elif len(set(keys)) != len(keys):
        problem = "repeats a key"
    elif c.TOPOLOGY_KEY_ANY in keys[:-1]:
        problem = f"{c.TOPOLOGY_KEY_ANY!r} may only be the last key"
    if problem:
        warnings.append(
            f"annotation {c.ANNOTATION_TOPOLOGY_KEYS}={quote(raw)} {problem}; "
            "ignored (no topology-keys preference)"
        )
        return ()
    return tuple(_intern(k) for k in keys)


def _lb_algorithm(annotations: Mapping[str, str], warnings: list[str]) -> str:
    raw = annotations.get(c.ANNOTATION_LB_ALGORITHM)
    if raw is None:
        return c.LB_HASH
    value = raw.strip().lower()
    if value in c.LB_ALGORITHMS:
        return value
    warnings.append(
        f"annotation {c.ANNOTATION_LB_ALGORITHM}={quote(raw)} is not one of "
        f"{', '.join(c.LB_ALGORITHMS)}; using {c.LB_HASH}"
    )
    return c.LB_HASH


def _multi_cluster(annotations: Mapping[str, str], warnings: list[str]) -> str:
    ours = annotations.get(c.ANNOTATION_MULTI_CLUSTER)
    if ours is not None:
        for policy in (c.LOCAL_FIRST, c.REMOTE_AND_LOCAL):
            if ours.strip().lower() == policy.lower():
                return policy
        warnings.append(
            f"annotation {c.ANNOTATION_MULTI_CLUSTER}={quote(ours)} is not "
            f"{c.LOCAL_FIRST} or {c.REMOTE_AND_LOCAL}; using {c.REMOTE_AND_LOCAL}"
        )
        return c.REMOTE_AND_LOCAL
    cilium = annotations.get(c.ANNOTATION_CILIUM_AFFINITY)
    if cilium is not None:
        value = cilium.strip().lower()
        if value == "local":
            return c.LOCAL_FIRST
        if value not in ("", "none"):
            warnings.append(
                f"annotation {c.ANNOTATION_CILIUM_AFFINITY}={quote(cilium)} is not supported "
                f"(only 'local' and 'none'); using {c.REMOTE_AND_LOCAL}"
            )
    return c.REMOTE_AND_LOCAL


# --- EndpointSlice -----------------------------------------------------------------------


def decode_endpoint_slice(obj: Mapping[str, Any], warnings: list[str]) -> EndpointSlice | str:
    namespace, name, meta = _metadata(obj)
    labels = _string_map(meta, "labels", "metadata.labels")
    if c.LABEL_HEADLESS in labels:
        return "slice of a headless Service"
    service_name = labels.get(c.LABEL_SERVICE_NAME)
    if not service_name:
        raise Invalid(f"metadata.labels: {c.LABEL_SERVICE_NAME} is missing, so no Service owns it")
    address_type = _str(obj, "addressType", "addressType")
    if address_type == "FQDN":
        return "FQDN slices are not proxied"
    if address_type not in (IPV4, IPV6):
        raise Invalid(f"addressType: {quote(address_type)} is not one of IPv4, IPv6, FQDN")
    annotations = _string_map(meta, "annotations", "metadata.annotations")
    return EndpointSlice(
        namespace=_intern(namespace),
        name=name,
        service_name=_intern(service_name),
        family=address_type,
        ports=_slice_ports(obj, warnings),
        endpoints=_endpoints(obj, address_type),
        provision_cluster=annotations.get(c.ANNOTATION_KARMADA_PROVISION_CLUSTER),
        source_cluster=labels.get(c.LABEL_MCS_SOURCE_CLUSTER),
        managed_by=labels.get(c.LABEL_MANAGED_BY),
        trigger_time=_timestamp(annotations.get(c.ANNOTATION_TRIGGER_TIME)),
    )


def _timestamp(text: str | None) -> float | None:
    """RFC 3339 to Unix time; None when absent or unreadable (it only feeds a metric)."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except (ValueError, OverflowError, OSError):  # e.g. year 1 in a far-west zone
        return None


def _slice_ports(obj: Mapping[str, Any], warnings: list[str]) -> tuple[SlicePort, ...]:
    """The named ports. A name given twice (the API server rejects it) is kept twice, as
    kube-proxy keeps it: it gathers a port name's endpoints over every entry of that
    name, so each endpoint serves the Service port on both target ports."""
    ports: list[SlicePort] = []
    seen: dict[tuple[str, str], int] = {}
    for i, item in enumerate(_list(obj, "ports", "ports")):
        path = f"ports[{i}]"
        if not isinstance(item, Mapping):
            raise Invalid(f"{path}: expected an object, got {_type(item)}")
        port = _int(item, "port", f"{path}.port", 0, 65535, 0)
        protocol = _protocol(item, path)
        name = _str(item, "name", f"{path}.name")
        # kube-proxy ignores ports without a name key and "all ports" (nil or 0) entries.
        if name is None or port == 0:
            continue
        first = seen.setdefault((name, protocol), i)
        if first != i:
            warnings.append(
                f"{path}.name: {quote(name)}/{protocol} is also ports[{first}]'s name (the API "
                "server rejects this); as kube-proxy, both target ports serve that port name"
            )
        ports.append(SlicePort(_intern(name), protocol, port))
    return tuple(ports)


def _endpoints(obj: Mapping[str, Any], family: str) -> tuple[Endpoint, ...]:
    raw = _list(obj, "endpoints", "endpoints")
    out: list[Endpoint] = []
    for i, item in enumerate(raw):
        if not isinstance(item, Mapping):
            raise Invalid(f"endpoints[{i}]: expected an object, got {_type(item)}")
        addresses = item.get("addresses")
        if not isinstance(addresses, list) or not addresses:
            raise Invalid(f"endpoints[{i}].addresses: expected a non-empty list of addresses")
        # Only the first address is used, as kube-proxy does.
        ip = _ip(addresses[0], f"endpoints[{i}].addresses[0]", family)[1]
        conditions = item.get("conditions")
        if conditions is None:
            ready = serving = True
            terminating = False
        else:
            if not isinstance(conditions, Mapping):
                raise Invalid(f"endpoints[{i}].conditions: expected an object")
            path = f"endpoints[{i}].conditions"
            ready = _bool(conditions, "ready", f"{path}.ready") is not False
            serving = _bool(conditions, "serving", f"{path}.serving") is not False
            terminating = _bool(conditions, "terminating", f"{path}.terminating") is True
        node_name = _str(item, "nodeName", f"endpoints[{i}].nodeName")
        zone = _str(item, "zone", f"endpoints[{i}].zone")
        zone_hints = node_hints = NO_HINTS
        hints = item.get("hints")
        if hints is not None:
            if not isinstance(hints, Mapping):
                raise Invalid(f"endpoints[{i}].hints: expected an object")
            zone_hints = _hint_names(hints, "forZones", f"endpoints[{i}].hints.forZones")
            node_hints = _hint_names(hints, "forNodes", f"endpoints[{i}].hints.forNodes")
        out.append(
            Endpoint(
                ip,
                ready,
                serving,
                terminating,
                _intern(node_name) if node_name else None,
                _intern(zone) if zone else None,
                zone_hints,
                node_hints,
            )
        )
    return tuple(out)


def _hint_names(hints: Mapping[str, Any], key: str, path: str) -> frozenset[str]:
    names = []
    for j, hint in enumerate(_list(hints, key, path)):
        name = hint.get("name") if isinstance(hint, Mapping) else None
        if not isinstance(name, str) or not name:
            raise Invalid(f"{path}[{j}].name: expected a non-empty string")
        names.append(_intern(_text(name, f"{path}[{j}].name")))
    return frozenset(names) if names else NO_HINTS


# --- Node --------------------------------------------------------------------------------


def decode_node(obj: Mapping[str, Any], warnings: list[str]) -> Node:
    meta = _map(obj, "metadata", "metadata", required=True)
    name = _str(meta, "name", "metadata.name")
    if not name:
        raise Invalid("metadata.name: is missing")
    labels = dict(_string_map(meta, "labels", "metadata.labels"))
    status = _map(obj, "status", "status")
    by_type: dict[str, list[str]] = {"InternalIP": [], "ExternalIP": []}
    for i, item in enumerate(_list(status, "addresses", "status.addresses")):
        path = f"status.addresses[{i}]"
        if not isinstance(item, Mapping):
            raise Invalid(f"{path}: expected an object, got {_type(item)}")
        address_type = _str(item, "type", f"{path}.type")
        if address_type in by_type:
            by_type[address_type].append(_ip(item.get("address"), f"{path}.address")[1])
    addresses = tuple(dict.fromkeys(by_type["InternalIP"] + by_type["ExternalIP"]))
    taints = _list(_map(obj, "spec", "spec"), "taints", "spec.taints")
    draining = any(isinstance(t, Mapping) and t.get("key") == c.TAINT_TO_BE_DELETED for t in taints)
    eligible = not meta.get("deletionTimestamp") and not draining
    return Node(_intern(name), labels, addresses, eligible)


_DECODERS = {
    ("v1", "Service"): decode_service,
    ("discovery.k8s.io/v1", "EndpointSlice"): decode_endpoint_slice,
    ("v1", "Node"): decode_node,
}
_KINDS = {kind for _, kind in _DECODERS}
