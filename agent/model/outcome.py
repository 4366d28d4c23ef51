"""What becomes of a packet at a frontend of a NodeState (pure): the outcome oracle that
`explain`, the lab and the tests ask, so that each states the dataplanes' rules once.

The set a packet uses is docs/nodestate.md's. From a pod (or the node): to a ClusterIP,
`localBackends` under internalTrafficPolicy Local, else `clusterBackends`; to a NodePort,
ExternalIP or LoadBalancer frontend, `clusterBackends`. From outside the cluster (to those
external frontends): `localBackends` under externalTrafficPolicy Local, else
`clusterBackends`. loadBalancerSourceRanges that do not admit the client drop it at a
LoadBalancer frontend (pods at the VIP too, as kube-proxy), never at a NodePort. An empty
set answers like kube-proxy: refused (TCP RST, ICMP port unreachable) when the Service has
no endpoints at all, a silent drop (the client times out) when endpoints exist elsewhere.

For an outside client the oracle also says which source address each backend sees: the
client's own under externalTrafficPolicy Local; under Cluster, the entry node's (SNAT) when
the backend is on another node, so that replies come back through it to be untranslated.
For a backend on the entry node under Cluster the dataplanes differ on purpose: eBPF
translates only the destination (the pod sees the client), the iptables dataplane
masquerades all of it as kube-proxy does (the pod sees a node address).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from .compile import NO_TOPOLOGY
from .nodestate import FRONTEND_KINDS, Backend, Frontend, ServiceEntry

# The sets of a NodeState entry, by their document names.
CLUSTER_BACKENDS = "clusterBackends"
LOCAL_BACKENDS = "localBackends"

# What the packet meets.
BACKENDS = "backends"  # a backend of the set answers
REFUSED = "refused"  # refused at once (TCP RST, ICMP port unreachable)
DROPPED = "dropped"  # dropped silently: the client times out

# Why a packet meets no backend (Outcome.reason).
SOURCE_NOT_ALLOWED = "loadBalancerSourceRanges"  # the ranges do not admit the client
NO_ENDPOINTS = "no endpoints"  # the Service has no usable endpoint anywhere
ENDPOINTS_ELSEWHERE = "endpoints elsewhere"  # the set is empty, other endpoints exist

# The source address a backend sees for an outside client's request.
KEPT = "client"  # the client's own address
SNAT = "node"  # an address of the node the request entered

# The dataplane that masquerades an outside client's request to a local backend too.
IPTABLES = "iptables"
NFTABLES = "nftables"
NETFILTER = (IPTABLES, NFTABLES)  # both masquerade every outsider of an eTP Cluster Service


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a packet from one client meets at one frontend."""

    kind: str  # BACKENDS | REFUSED | DROPPED
    set_name: str  # CLUSTER_BACKENDS | LOCAL_BACKENDS: the set the packet uses
    backends: tuple[Backend, ...]  # that set (also when the packet never reaches it)
    reason: str = ""  # REFUSED | DROPPED: SOURCE_NOT_ALLOWED | NO_ENDPOINTS | ...ELSEWHERE


def used_set(
    entry: ServiceEntry, frontend: Frontend, from_outside: bool = False
) -> tuple[str, tuple[Backend, ...]]:
    """The backend set a packet to this frontend uses, and its name; from a pod or the
    node unless from_outside. A ClusterIP has one set whoever sends (the ClusterIP rule)."""
    name = LOCAL_BACKENDS if entry.uses_local(frontend.type, from_outside) else CLUSTER_BACKENDS
    return name, entry.backends_for(frontend.type, from_outside)


def source_allowed(client_ip: str, frontend: Frontend) -> bool:
    """Whether the frontend's loadBalancerSourceRanges (if any) admit client_ip."""
    if not FRONTEND_KINDS[frontend.type].source_ranges or not frontend.source_ranges:
        return True
    address = ipaddress.ip_address(client_ip)  # never in a network of the other family
    return any(address in ipaddress.ip_network(cidr) for cidr in frontend.source_ranges)


def outcome(
    entry: ServiceEntry, frontend: Frontend, client_ip: str, from_outside: bool = False
) -> Outcome:
    """What a packet from client_ip (a pod or the node; outside the cluster when
    from_outside) meets at frontend of entry. loadBalancerSourceRanges come before the set
    (both dataplanes apply them to pods at the VIP too: iptables in KBP-FW, eBPF in
    lb_source_admitted)."""
    set_name, backends = used_set(entry, frontend, from_outside)
    if not source_allowed(client_ip, frontend):
        return Outcome(DROPPED, set_name, backends, SOURCE_NOT_ALLOWED)
    if backends:
        return Outcome(BACKENDS, set_name, backends)
    if entry.has_endpoints:
        return Outcome(DROPPED, set_name, backends, ENDPOINTS_ELSEWHERE)
    return Outcome(REFUSED, set_name, backends, NO_ENDPOINTS)


def source_seen(entry: ServiceEntry, backend: Backend, dataplane: str) -> str:
    """KEPT or SNAT: the source address backend sees for an outside client's request to
    an external frontend of entry, on a node running `dataplane` (see the module
    docstring)."""
    if entry.external_traffic_policy == "Local":
        return KEPT
    if not backend.local or dataplane in NETFILTER:
        return SNAT
    return KEPT


def topology_tiers(topology: str) -> list[str]:
    """The tiers of a NodeState entry's `topology` field (compile's), in the order the
    compiler applied them; [] for none."""
    return [] if topology == NO_TOPOLOGY else topology.split("+")
