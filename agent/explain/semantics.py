"""The semantic half of `explain`: from a NodeState (and, when the manifests are at hand,
the endpoints the compiler chose from), which frontend a query names, which backend set
its packets use and why, each backend of that set, the endpoints left out and why. Pure.

The set a packet uses and what it meets are the model's answer (agent/model/outcome.py,
the dataplanes' rules of docs/nodestate.md); this module only names the reasons.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..model.compile import (
    ANY_CLUSTER,
    LOCAL_CLUSTER,
    NO_MATCH,
    PREFER_SAME_NODE,
    PREFER_SAME_ZONE,
)
from ..model.conventions import TOPOLOGY_KEY_ANY
from ..model.ip import in_networks
from ..model.nodestate import CLUSTER_IP, LOAD_BALANCER, Backend, Frontend, NodeState, ServiceEntry
from ..model.outcome import (
    BACKENDS,
    CLUSTER_BACKENDS,
    DROPPED,
    REFUSED,
    SOURCE_NOT_ALLOWED,
    outcome,
    source_allowed,
    topology_tiers,
)
from ..model.types import Endpoint

# Where a packet comes from.
POD = "pod"
NODE = "node"
OUTSIDE = "outside"
# The client address of `--from outside` without an address: RFC 2544's benchmarking
# range, which no example or cluster uses.
DEFAULT_OUTSIDE_IP = "198.18.0.1"

# Outcomes beyond the model's BACKENDS / REFUSED / DROPPED (agent/model/outcome.py).
NOT_A_SERVICE = "not-a-service"

PROTOCOLS = ("TCP", "UDP", "SCTP")

Candidates = Sequence[tuple[Backend, Endpoint]]
# node label lookup for topology keys: (node name, key) -> value
NodeLabel = Callable[[str | None, str], str | None]


class QueryError(ValueError):
    """The query names nothing explainable; the message says what and why."""


@dataclass(frozen=True, slots=True)
class Source:
    kind: str  # POD | NODE | OUTSIDE
    ip: str  # the packet's source address
    note: str = ""  # how the kind was decided

    @property
    def text(self) -> str:
        return {POD: "a pod", NODE: "the node", OUTSIDE: "outside the cluster"}[self.kind]


@dataclass(frozen=True, slots=True)
class Target:
    """`--to` parsed: an address (ip, port, protocol) or a Service (namespace, name, port)."""

    ip: str | None = None
    port: int | None = None
    protocol: str = "TCP"
    namespace: str | None = None
    name: str | None = None
    port_name: str | None = None  # ns/name:port with a name instead of a number


@dataclass
class Explanation:
    source: Source
    frontend: Frontend | None
    protocol: str
    entry: ServiceEntry | None
    outcome: str  # BACKENDS | REFUSED | DROPPED | NOT_A_SERVICE
    set_name: str = ""
    why: list[str] = field(default_factory=list)
    backends: list[Backend] = field(default_factory=list)
    left_out: list[tuple[Backend, str]] = field(default_factory=list)
    left_out_complete: bool = True  # False: NodeState only; topology's drops are unseen
    note: str = ""

    @property
    def service(self) -> str:
        if self.entry is None:
            return ""
        e = self.entry
        return f"{e.namespace}/{e.name}" + (f":{e.port}" if e.port else "")

    def to_dict(self) -> dict[str, Any]:
        fe = self.frontend
        return {
            "source": {"kind": self.source.kind, "ip": self.source.ip, "note": self.source.note},
            "frontend": None if fe is None else {**fe.to_dict(), "protocol": self.protocol},
            "service": self.service or None,
            "outcome": self.outcome,
            "set": self.set_name or None,
            "why": list(self.why),
            "backends": [backend_dict(b) for b in self.backends],
            "leftOut": [{**backend_dict(b), "reason": r} for b, r in self.left_out],
            "leftOutComplete": self.left_out_complete,
            "note": self.note or None,
        }


def address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def conditions(b: Backend) -> str:
    parts = [name for name, on in (("ready", b.ready), ("serving", b.serving),
                                   ("terminating", b.terminating)) if on]  # fmt: skip
    return ",".join(parts) or "not-ready"


def where(b: Backend) -> str:
    """`node-b, zone-1` / `cluster member2`."""
    if b.cluster is not None:
        return f"cluster {b.cluster}" + (f", node {b.node_name}" if b.node_name else "")
    place = f"node {b.node_name}" if b.node_name else "no node"
    return place + (f", {b.zone}" if b.zone else "") + (" (this node)" if b.local else "")


def backend_dict(b: Backend) -> dict[str, Any]:
    return {"address": address(b.ip, b.port), **b.to_dict(), "conditions": conditions(b)}


# --- the query ---------------------------------------------------------------------------


def parse_target(text: str) -> Target:
    """`10.96.0.10:80/TCP`, `[fd00:96::10]:80/UDP`, `default/web:http` or `default/web:80`
    (protocol optional, TCP by default)."""
    body, protocol = text, "TCP"
    head, _, tail = text.rpartition("/")
    if head and tail.upper() in PROTOCOLS:
        body, protocol = head, tail.upper()
    if "/" in body:  # namespace/name:port
        namespace, _, rest = body.partition("/")
        name, _, port = rest.partition(":")
        if not namespace or not name or not port:
            raise QueryError(f"--to {text!r}: expected NAMESPACE/NAME:PORT (port name or number)")
        if port.isdigit():
            return Target(protocol=protocol, namespace=namespace, name=name, port=int(port))
        return Target(protocol=protocol, namespace=namespace, name=name, port_name=port)
    if body.startswith("["):
        ip, _, port = body[1:].partition("]:")
    else:
        ip, _, port = body.rpartition(":")
    try:
        canonical = str(ipaddress.ip_address(ip))
    except ValueError:
        raise QueryError(f"--to {text!r}: {ip!r} is not an IP address") from None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise QueryError(f"--to {text!r}: expected IP:PORT/PROTOCOL with a port 1-65535")
    return Target(ip=canonical, port=int(port), protocol=protocol)


def parse_source(text: str, state: NodeState) -> Source:
    """`node`, `outside`, `outside:IP` or an IP: a node address is the node, an address
    in the cluster CIDRs a pod, any other address outside the cluster (a pod, when no
    --cluster-cidr tells them apart)."""
    node = state.node
    if text == NODE:
        if not node.addresses:
            raise QueryError("--from node: this node has no address (--node-ip)")
        return Source(NODE, node.addresses[0], "the node's primary address")
    if text == OUTSIDE or text.startswith(OUTSIDE + ":"):
        ip = text.partition(":")[2] or DEFAULT_OUTSIDE_IP
        return Source(OUTSIDE, _ip(ip, "--from"), "" if ":" in text else "a stand-in address")
    ip = _ip(text, "--from")
    if ip in node.addresses:
        return Source(NODE, ip, "one of the node's addresses")
    if not node.cluster_cidrs:
        return Source(POD, ip, "taken for one: no --cluster-cidr tells pods from outside clients")
    if in_networks(ip, tuple(ipaddress.ip_network(c) for c in node.cluster_cidrs)):
        return Source(POD, ip, "inside --cluster-cidr")
    return Source(OUTSIDE, ip, "outside --cluster-cidr")


def _ip(text: str, flag: str) -> str:
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise QueryError(f"{flag} {text!r}: expected an IP address, node or outside") from None


def find_frontend(
    state: NodeState, target: Target, source: Source
) -> tuple[ServiceEntry, Frontend] | None:
    """The entry and frontend the target names; None for an address no frontend has.
    A Service target takes its ClusterIP for pods and the node and an external frontend
    of this node for outside clients, in the family of the source address."""
    if target.ip is not None:
        for entry in state.services:
            if entry.protocol != target.protocol:
                continue
            for fe in entry.frontends:
                if fe.ip == target.ip and fe.port == target.port:
                    return entry, fe
        return None
    family = "IPv6" if ":" in source.ip else "IPv4"
    named = [
        e for e in state.services
        if e.namespace == target.namespace and e.name == target.name
        and e.protocol == target.protocol and e.ip_family == family
    ]  # fmt: skip
    if not named:
        raise QueryError(f"--to: no {family} {target.protocol} entry of Service "
                         f"{target.namespace}/{target.name} in this node's NodeState")  # fmt: skip
    for entry in named:
        cluster_ip = entry.frontends[0]
        if target.port_name is not None and entry.port != target.port_name:
            continue
        if target.port is not None and cluster_ip.port != target.port:
            continue
        if source.kind != OUTSIDE:
            return entry, cluster_ip
        external = [f for f in entry.frontends if f.type != CLUSTER_IP]
        if not external:
            raise QueryError(f"--to: {entry.namespace}/{entry.name} port {entry.port or '-'} "
                             "has no NodePort, ExternalIP or LoadBalancer frontend on this "
                             "node: outside clients cannot reach it here")  # fmt: skip
        return entry, external[0]
    ports = ", ".join(f"{e.port or '-'} ({e.frontends[0].port})" for e in named)
    wanted = target.port_name if target.port_name is not None else target.port
    raise QueryError(f"--to: Service {target.namespace}/{target.name} has no port {wanted!r}; "
                     f"its ports: {ports}")  # fmt: skip


# --- the explanation ---------------------------------------------------------------------


def explain(
    state: NodeState,
    source: Source,
    target: Target,
    candidates: Candidates | None = None,
    node_label: NodeLabel | None = None,
) -> Explanation:
    """Where a packet from `source` to `target` goes on this node, by the NodeState.
    `candidates`: every endpoint of the entry's port the compiler chose from (with the
    manifests); without them the endpoints left out are those the NodeState still lists."""
    found = find_frontend(state, target, source)
    if found is None:
        return Explanation(
            source, None, target.protocol, None, NOT_A_SERVICE,
            note=f"{address(target.ip or '', target.port or 0)}/{target.protocol} is no "
            "frontend of this node: the packet passes untranslated",
        )  # fmt: skip
    entry, frontend = found
    result = outcome(entry, frontend, source.ip, from_outside=source.kind == OUTSIDE)
    set_name, used = result.set_name, result.backends
    out = Explanation(source, frontend, entry.protocol, entry, result.kind, set_name)
    out.why = _why(entry, frontend, source, set_name, used)
    out.backends = list(used)
    if result.reason == SOURCE_NOT_ALLOWED:
        out.note = f"loadBalancerSourceRanges {', '.join(frontend.source_ranges)} do not " \
            f"admit {source.ip}"  # fmt: skip
        return out
    if result.kind == REFUSED:
        out.note = "no endpoints: the Service has no usable endpoint anywhere"
    elif result.kind == DROPPED:
        out.note = _dropped_note(entry, set_name)
    if candidates is None:
        out.left_out = _left_out_from_state(entry, set_name, used)
        out.left_out_complete = False
    else:
        out.left_out = _left_out(entry, state, set_name, used, candidates, node_label)
    return out


def _dropped_note(entry: ServiceEntry, set_name: str) -> str:
    if set_name == CLUSTER_BACKENDS:
        return "no backend in clusterBackends for this node (topology left none); " \
            "endpoints exist elsewhere"  # fmt: skip
    policy = "internal" if entry.internal_traffic_policy == "Local" else "external"
    return f"{policy}TrafficPolicy Local and no local endpoint; endpoints exist elsewhere"


def _why(
    entry: ServiceEntry, fe: Frontend, source: Source, set_name: str, used: Sequence[Backend]
) -> list[str]:
    why: list[str] = []
    if fe.type == CLUSTER_IP:
        why.append(f"to a ClusterIP: internalTrafficPolicy {entry.internal_traffic_policy} "
                   f"→ {set_name}")  # fmt: skip
    elif source.kind == OUTSIDE:
        rule = f"externalTrafficPolicy {entry.external_traffic_policy} → {set_name}"
        if entry.external_traffic_policy == "Local":
            rule += " (endpoints on this node only; the client's address is kept)"
        why.append(f"from outside to a {fe.type}: {rule}")
    else:
        why.append(
            f"from {source.text} to a {fe.type}: clusterBackends whatever "
            f"externalTrafficPolicy ({entry.external_traffic_policy}), as kube-proxy"
        )
    if fe.type == LOAD_BALANCER and fe.source_ranges:
        verb = "admit" if source_allowed(source.ip, fe) else "do not admit"
        why.append(f"loadBalancerSourceRanges {', '.join(fe.source_ranges)} {verb} {source.ip}")
    if set_name == CLUSTER_BACKENDS:
        why.extend(_topology_why(entry.topology))
    if used and all(b.terminating for b in used):
        why.append("no ready endpoint: serving-terminating endpoints are used (fallback, "
                   "topology ignored)")  # fmt: skip
    if entry.affinity_timeout is not None:
        why.append(f"sessionAffinity ClientIP ({entry.affinity_timeout} s): a client keeps "
                   "the backend of its last new connection")  # fmt: skip
    if len(used) > 1:
        why.append(_algorithm_why(entry.lb_algorithm))
    return why


def _algorithm_why(algorithm: str) -> str:
    if algorithm == "maglev":
        return "lbAlgorithm maglev: the flow hash picks a slot of the Maglev table"
    if algorithm == "random":
        return "lbAlgorithm random: each new connection takes a random slot"
    return "lbAlgorithm hash: the hash of the 5-tuple picks the slot (the same source " \
        "port gives the same backend while the set is unchanged)"  # fmt: skip


# Why each topology tier of a NodeState entry (compile's `topology` field) took its set.
_TIER_WHY = {
    LOCAL_CLUSTER: "LocalFirst: this cluster has ready endpoints, so other clusters' "
                   "endpoints are left out",
    ANY_CLUSTER: "LocalFirst: no ready endpoint in this cluster, so endpoints of every "
                 "cluster are used",
    PREFER_SAME_ZONE: "topology PreferSameZone: every ready endpoint has a zone hint and "
                      "some name this node's zone: only those",
    PREFER_SAME_NODE: "topology PreferSameNode: every ready endpoint has a node hint and "
                      "some name this node: only those",
    NO_MATCH: "topology keys: no key is shared with a ready endpoint's node and none is "
              "'*': no backend",
    TOPOLOGY_KEY_ANY: "topology keys: no closer key matched; '*' takes every ready endpoint",
}  # fmt: skip


def _topology_why(topology: str) -> list[str]:
    tiers = topology_tiers(topology)
    if not tiers:
        return ["topology None: no hints cover every ready endpoint with one for this node, "
                "and no topology keys"]  # fmt: skip
    return [
        _TIER_WHY.get(tier)
        or f"topology keys: {tier} is the first key this node shares with a ready "
        "endpoint's node: only endpoints with the same value"
        for tier in tiers
    ]


def _left_out_from_state(
    entry: ServiceEntry, set_name: str, used: Sequence[Backend]
) -> list[tuple[Backend, str]]:
    """What the NodeState's other set lists beyond the used one."""
    kept = {(b.ip, b.port) for b in used}
    other = entry.local_backends if set_name == CLUSTER_BACKENDS else entry.cluster_backends
    out = []
    for b in other or ():
        if (b.ip, b.port) in kept:
            continue
        if set_name == CLUSTER_BACKENDS:
            out.append((b, "left out of clusterBackends by topology"))
        else:
            out.append((b, _not_local(b)))
    return out


def _not_local(b: Backend) -> str:
    if b.cluster is not None:
        return f"in cluster {b.cluster}: never local (traffic policy Local)"
    return f"on {b.node_name or 'no node'}, not this node (traffic policy Local)"


def _left_out(
    entry: ServiceEntry,
    state: NodeState,
    set_name: str,
    used: Sequence[Backend],
    candidates: Candidates,
    node_label: NodeLabel | None,
) -> list[tuple[Backend, str]]:
    """Each candidate endpoint not in the used set, with the first rule that left it out."""
    kept = {(b.ip, b.port) for b in used}
    tiers = topology_tiers(entry.topology)
    any_ready = any(ep.ready for _, ep in candidates)
    out = []
    for b, ep in candidates:
        if (b.ip, b.port) in kept:
            continue
        if not ep.ready and not (ep.serving and ep.terminating):
            reason = "not ready" + ("" if ep.serving else ", not serving")
        elif set_name != CLUSTER_BACKENDS and not b.local:
            reason = _not_local(b)
        elif not ep.ready and (any_ready if set_name == CLUSTER_BACKENDS else
                               any(e.ready for x, e in candidates if x.local)):  # fmt: skip
            reason = "terminating: ready endpoints exist, so no fallback"
        elif LOCAL_CLUSTER in tiers and b.cluster is not None:
            reason = f"in cluster {b.cluster}: LocalFirst keeps traffic in this cluster"
        else:
            reason = _topology_reason(b, ep, tiers, state, node_label)
        out.append((b, reason))
    return out


def _topology_reason(
    b: Backend, ep: Endpoint, tiers: list[str], state: NodeState, node_label: NodeLabel | None
) -> str:
    node = state.node
    if PREFER_SAME_ZONE in tiers:
        return f"zone hints {sorted(ep.zone_hints)} do not name this node's zone {node.zone}"
    if PREFER_SAME_NODE in tiers:
        return f"node hints {sorted(ep.node_hints)} do not name this node"
    keys = [t for t in tiers if t not in (LOCAL_CLUSTER, ANY_CLUSTER, TOPOLOGY_KEY_ANY)]
    if keys:
        key = keys[-1]
        if key == NO_MATCH:
            return "topology keys: no key shared with this node"
        if b.cluster is not None:
            return f"in cluster {b.cluster}: topology key {key} matches this cluster's nodes only"
        theirs = node_label(b.node_name, key) if node_label else None
        return f"topology key {key}: node {b.node_name} has {theirs!r}, this node " \
            f"{node.labels.get(key)!r}"  # fmt: skip
    return "left out by the compiler"


# The lines that say more than the traffic policy, most telling first.
_DECIDING = ("loadBalancerSourceRanges", "no ready endpoint", "LocalFirst", "topology keys",
             "topology Prefer")  # fmt: skip


def _deciding(why: list[str]) -> str:
    for start in _DECIDING:
        for line in why:
            if line.startswith(start):
                return line
    return why[0] if why else ""


def verdict(ex: Explanation, chosen: Backend | None = None, kernel_note: str = "") -> str:
    """One line: where the packet goes and the most telling reason; kernel_note is what
    the dataplane added (the program's own choice or reason)."""
    if ex.outcome == NOT_A_SERVICE:
        return "not a Service address: passes untranslated" + kernel_note
    if ex.outcome == REFUSED:
        return "refused: no endpoints (TCP RST / ICMP port unreachable)" + kernel_note
    if ex.outcome == DROPPED:
        return f"dropped: {ex.note}{kernel_note}"
    because = _deciding(ex.why)
    if chosen is not None:
        return f"goes to {address(chosen.ip, chosen.port)} ({where(chosen)}) because " \
            f"{because}{kernel_note}"  # fmt: skip
    if len(ex.backends) == 1:
        b = ex.backends[0]
        return f"goes to {address(b.ip, b.port)} ({where(b)}) because {because}{kernel_note}"
    listed = ", ".join(address(b.ip, b.port) for b in ex.backends)
    return f"goes to one of {len(ex.backends)} backends ({listed}) because {because}{kernel_note}"


__all__ = ["BACKENDS", "DROPPED", "REFUSED", "Explanation", "explain", "verdict"]
