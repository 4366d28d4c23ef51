"""NodeState (schema v1): the complete, deterministic node-local service map.

This is the contract between the compiler and every dataplane (docs/nodestate.md). Values are
frozen; `to_dict` gives the documented field names and order. Each ServiceEntry carries
the digest of its own canonical JSON, so the document's revision is recomputed from
per-entry digests after an incremental compile instead of re-serialising everything.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .types import ServiceKey

API_VERSION = "kube-bpf-proxy/v1"
KIND = "NodeState"

CLUSTER_IP = "ClusterIP"
NODE_PORT = "NodePort"
EXTERNAL_IP = "ExternalIP"
LOAD_BALANCER = "LoadBalancer"

# The traffic policy that picks a frontend's backend set for a sender ("Which set a
# packet uses" in docs/nodestate.md); None: clusterBackends whatever the policies say.
INTERNAL_POLICY = "internalTrafficPolicy"
EXTERNAL_POLICY = "externalTrafficPolicy"


@dataclass(frozen=True, slots=True)
class FrontendType:
    """What a frontend type means to every consumer: compile, the dataplanes (the eBPF
    programs get it as flag bits of the frontend's value), the lab's expectations. A new
    type is a row of FRONTEND_KINDS and the compile lines that make its frontends."""

    name: str
    words: str  # in iptables rule comments (kube-proxy's)
    # Reached from outside the cluster: its address may be one of the node's own, and
    # externalTrafficPolicy applies (docs/semantics.md); a ClusterIP is not.
    external: bool
    from_inside: str | None  # the policy picking the set for pods and the node
    from_outside: str | None  # ... for clients outside the cluster
    source_ranges: bool = False  # loadBalancerSourceRanges admit its clients
    # Its address belongs to one Service (the API server allocates it): a restarted
    # agent matches the Service's earlier id by it first.
    unique: bool = False


# The one table of frontend types, in document order. The eBPF ABI's KBP_FE_* derive
# from the names, its flag bits from the columns (abi.FRONTEND_TYPES, frontend_flags).
FRONTEND_KINDS: dict[str, FrontendType] = {t.name: t for t in (
    FrontendType(CLUSTER_IP, "cluster IP", external=False, from_inside=INTERNAL_POLICY,
                 from_outside=INTERNAL_POLICY, unique=True),
    FrontendType(NODE_PORT, "node port", external=True, from_inside=None,
                 from_outside=EXTERNAL_POLICY),
    FrontendType(EXTERNAL_IP, "external IP", external=True, from_inside=None,
                 from_outside=EXTERNAL_POLICY),
    FrontendType(LOAD_BALANCER, "loadbalancer IP", external=True, from_inside=None,
                 from_outside=EXTERNAL_POLICY, source_ranges=True),
)}  # fmt: skip
FRONTEND_TYPES = {name: kind.words for name, kind in FRONTEND_KINDS.items()}
FRONTEND_ORDER = {name: order for order, name in enumerate(FRONTEND_KINDS)}


def is_external(frontend_type: str) -> bool:
    """Whether frontends of this type are reached from outside the cluster."""
    return FRONTEND_KINDS[frontend_type].external


@dataclass(frozen=True, slots=True)
class Frontend:
    type: str  # ClusterIP | NodePort | ExternalIP | LoadBalancer
    ip: str
    port: int
    source_ranges: tuple[str, ...] = ()  # LoadBalancer only; empty = any source

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "ip": self.ip, "port": self.port}
        if FRONTEND_KINDS[self.type].source_ranges:
            out["sourceRanges"] = list(self.source_ranges)
        return out


@dataclass(frozen=True, slots=True)
class Backend:
    ip: str
    port: int
    node_name: str | None
    zone: str | None
    cluster: str | None  # None for this cluster, else the source cluster's name
    local: bool  # on this node (and in this cluster)
    ready: bool
    serving: bool
    terminating: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "ip": self.ip,
            "port": self.port,
            "nodeName": self.node_name,
            "zone": self.zone,
            "cluster": self.cluster,
            "local": self.local,
            "ready": self.ready,
            "serving": self.serving,
            "terminating": self.terminating,
        }


@dataclass(frozen=True, slots=True)
class ServiceEntry:
    """One (Service, ServicePort, IP family): frontends and the backend sets they use."""

    namespace: str
    name: str
    port: str  # ServicePort.name
    protocol: str
    ip_family: str  # IPv4 | IPv6: frontends and backends of an entry never mix families
    frontends: tuple[Frontend, ...]
    affinity_timeout: int | None
    internal_traffic_policy: str
    external_traffic_policy: str  # effective: Local only when external frontends exist
    health_check_node_port: int | None
    topology: str
    has_endpoints: bool
    cluster_backends: tuple[Backend, ...] | None
    local_backends: tuple[Backend, ...] | None
    lb_algorithm: str = "hash"  # hash | maglev | random (kube-bpf-proxy.io/lb-algorithm)
    digest: bytes = field(default=b"", compare=False, repr=False)

    @property
    def sort_key(self) -> tuple[str, str, str, str, str]:
        return (self.namespace, self.name, self.port, self.protocol, self.ip_family)

    # Which backend set a frontend uses ("Which set a packet uses" in docs/nodestate.md):
    # the dataplanes and the lab ask these, as kube-proxy's proxiers ask its ServicePort.

    def uses_local(self, frontend_type: str, from_outside: bool = True) -> bool:
        """Whether a packet to a frontend of this type uses localBackends (else
        clusterBackends), by the type's row of FRONTEND_KINDS: a ClusterIP follows
        internalTrafficPolicy whoever sends; an external frontend follows
        externalTrafficPolicy from outside and uses clusterBackends from a pod or the
        node."""
        kind = FRONTEND_KINDS[frontend_type]
        return _is_local(kind.from_outside if from_outside else kind.from_inside,
                         self.internal_traffic_policy, self.external_traffic_policy)  # fmt: skip

    def backends_for(self, frontend_type: str, from_outside: bool = True) -> tuple[Backend, ...]:
        """The set a packet to a frontend of this type uses (see `uses_local`); empty
        when null."""
        local = self.uses_local(frontend_type, from_outside)
        return (self.local_backends if local else self.cluster_backends) or ()

    def to_dict(self) -> dict[str, Any]:
        affinity = None
        if self.affinity_timeout is not None:
            affinity = {"type": "ClientIP", "timeoutSeconds": self.affinity_timeout}
        return {
            "namespace": self.namespace,
            "name": self.name,
            "port": self.port,
            "protocol": self.protocol,
            "ipFamily": self.ip_family,
            "frontends": [f.to_dict() for f in self.frontends],
            "sessionAffinity": affinity,
            "internalTrafficPolicy": self.internal_traffic_policy,
            "externalTrafficPolicy": self.external_traffic_policy,
            "healthCheckNodePort": self.health_check_node_port,
            "topology": self.topology,
            "hasEndpoints": self.has_endpoints,
            "clusterBackends": _backends(self.cluster_backends),
            "localBackends": _backends(self.local_backends),
            "lbAlgorithm": self.lb_algorithm,
        }

    def sealed(self) -> ServiceEntry:
        """Set the digest (SHA-256 of the canonical JSON) once, at construction time."""
        canonical = json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)
        object.__setattr__(self, "digest", hashlib.sha256(canonical.encode()).digest())
        return self


def _is_local(policy: str | None, itp: str, etp: str) -> bool:
    if policy == INTERNAL_POLICY:
        return itp == "Local"
    return policy == EXTERNAL_POLICY and etp == "Local"


def uses_endpoints(itp: str, etp: str, frontend_types: Iterable[str]) -> tuple[bool, bool]:
    """(cluster, local): whether an entry with these traffic policies and frontends of
    these types uses clusterBackends, localBackends (kube-proxy's UsesClusterEndpoints /
    UsesLocalEndpoints): the sets its types pick from inside and from outside. External
    frontends need clusterBackends even with externalTrafficPolicy Local, for traffic
    from pods and the node."""
    cluster = local = False
    for name in set(frontend_types):
        kind = FRONTEND_KINDS[name]
        for policy in (kind.from_inside, kind.from_outside):
            if _is_local(policy, itp, etp):
                local = True
            else:
                cluster = True
    return cluster, local


def _backends(backends: tuple[Backend, ...] | None) -> list[dict[str, Any]] | None:
    return None if backends is None else [b.to_dict() for b in backends]


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    zone: str | None
    labels: Mapping[str, str]
    addresses: tuple[str, ...]  # primary first per family
    cluster_cidrs: tuple[str, ...] = ()
    cluster_name: str | None = None
    # The addresses that answer NodePorts (--nodeport-addresses), primary first per
    # family; None: every address (what a NodeInfo built by hand means).
    nodeport_addresses: tuple[str, ...] | None = None

    def nodeport_ips(self, family: str | None = None) -> tuple[str, ...]:
        """The NodePort addresses, of `family` only when given."""
        chosen = self.addresses if self.nodeport_addresses is None else self.nodeport_addresses
        if family is None:
            return chosen
        v6 = family == "IPv6"
        return tuple(a for a in chosen if (":" in a) == v6)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "zone": self.zone,
            "labels": dict(sorted(self.labels.items())),
            "addresses": list(self.addresses),
            "nodePortAddresses": list(self.nodeport_ips()),
            "clusterCIDRs": list(self.cluster_cidrs),
            "clusterName": self.cluster_name,
        }


def backends_of(entry: ServiceEntry) -> int:
    """How many backends the entry's sets list (clusterBackends + localBackends)."""
    return len(entry.cluster_backends or ()) + len(entry.local_backends or ())


def revision_of(digests: Iterable[bytes]) -> str:
    """Hash of the `services` list: SHA-256 over the entries' digests, in order."""
    return "sha256:" + hashlib.sha256(b"".join(digests)).hexdigest()


@dataclass(frozen=True, slots=True)
class Changes:
    """What `Compiler.update` recompiled or removed since the NodeState of revision
    `base`: the entries of `services` may differ, every other entry is the same object
    in both states (kube-proxy's UpdatedServices, kpng's Changed/Deleted). A consumer
    that holds `base` looks only at these (`since` says what went and came)."""

    base: str
    services: frozenset[ServiceKey]

    def between(
        self, old: Sequence[ServiceEntry], new: Sequence[ServiceEntry]
    ) -> tuple[list[ServiceEntry], list[ServiceEntry]]:
        """(went, came): the entries of the changed Services in `old` (the services of
        the state at `base`) and in `new`, each in NodeState order."""
        keys = sorted(self.services)
        return entries_of(old, keys), entries_of(new, keys)

    @staticmethod
    def since(
        revision: str | None, services: Sequence[ServiceEntry] | None, state: NodeState
    ) -> Delta:
        """What a consumer that holds `services` (the entries of the state of `revision`;
        None: it holds nothing it can name) must apply to hold `state`: the one change
        follower every dataplane uses. The entries of the Services `state`'s Changes name
        when they start from `revision`; nothing when `services` are `state`'s own; else
        a resync, every held entry gone and every entry of `state` come."""
        if services is state.services:
            return Delta((), (), False)
        changes = state.changes
        if services is None or changes is None or changes.base != revision:
            return Delta(services or (), state.services, True)
        went, came = changes.between(services, state.services)
        return Delta(went, came, False)


@dataclass(frozen=True, slots=True)
class Delta:
    """`Changes.since`: the entries that went (of the held state) and that came (of the
    new one), each in NodeState order. Outside them both states hold the same entry
    objects, unless `full`: then `went` is every held entry and `came` every new one."""

    went: Sequence[ServiceEntry]
    came: Sequence[ServiceEntry]
    full: bool  # a resync: the held state is not the base of the new state's Changes

    @property
    def empty(self) -> bool:
        return not self.went and not self.came


def _service_of(entry: ServiceEntry) -> ServiceKey:
    return entry.namespace, entry.name


def entries_of(entries: Sequence[ServiceEntry], keys: list[ServiceKey]) -> list[ServiceEntry]:
    """The entries of the Services `keys` (sorted), found by bisection in `entries` (a
    NodeState's services, in document order): in document order."""
    out: list[ServiceEntry] = []
    for key in keys:  # entries are sorted by sort_key, whose head is the Service key
        low = bisect_left(entries, key, key=_service_of)
        high = bisect_right(entries, key, low, key=_service_of)
        out.extend(entries[low:high])
    return out


@dataclass(frozen=True, slots=True)
class NodeState:
    node: NodeInfo
    revision: str
    services: tuple[ServiceEntry, ...]
    # Backends over every entry's sets, when the producer kept count (the Compiler does,
    # per change): logging and gauges then need not walk every entry per sync.
    counted_backends: int | None = field(default=None, compare=False)
    # Set by Compiler.update: what changed since an earlier revision (not in the document).
    changes: Changes | None = field(default=None, compare=False, repr=False)

    def backend_count(self) -> int:
        if self.counted_backends is not None:
            return self.counted_backends
        return sum(backends_of(e) for e in self.services)

    def to_dict(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "node": self.node.to_dict(),
            "revision": self.revision,
            "services": [e.to_dict() for e in self.services],
        }


def node_state_from_dict(doc: Mapping[str, Any]) -> NodeState:
    """The NodeState a document of `to_dict`'s shape describes (what `/state` and
    `compile -o json` print), for readers of a running agent's state such as `explain`.
    Raises KeyError or TypeError on a document of another shape."""
    node = doc["node"]
    info = NodeInfo(
        name=node["name"],
        zone=node.get("zone"),
        labels=dict(node.get("labels") or {}),
        addresses=tuple(node.get("addresses") or ()),
        cluster_cidrs=tuple(node.get("clusterCIDRs") or ()),
        cluster_name=node.get("clusterName"),
        nodeport_addresses=_tuple_or_none(node.get("nodePortAddresses")),
    )
    entries = tuple(_entry_from_dict(e) for e in doc["services"])
    return NodeState(info, doc["revision"], entries)


def _tuple_or_none(items: list[str] | None) -> tuple[str, ...] | None:
    return None if items is None else tuple(items)


def _entry_from_dict(e: Mapping[str, Any]) -> ServiceEntry:
    affinity = e.get("sessionAffinity")
    return ServiceEntry(
        namespace=e["namespace"],
        name=e["name"],
        port=e["port"],
        protocol=e["protocol"],
        ip_family=e["ipFamily"],
        frontends=tuple(
            Frontend(f["type"], f["ip"], f["port"], tuple(f.get("sourceRanges") or ()))
            for f in e["frontends"]
        ),
        affinity_timeout=affinity["timeoutSeconds"] if affinity else None,
        internal_traffic_policy=e["internalTrafficPolicy"],
        external_traffic_policy=e["externalTrafficPolicy"],
        health_check_node_port=e.get("healthCheckNodePort"),
        topology=e["topology"],
        has_endpoints=e["hasEndpoints"],
        cluster_backends=_backends_from(e.get("clusterBackends")),
        local_backends=_backends_from(e.get("localBackends")),
        lb_algorithm=e.get("lbAlgorithm", "hash"),
    ).sealed()


def _backends_from(items: list[Mapping[str, Any]] | None) -> tuple[Backend, ...] | None:
    if items is None:
        return None
    return tuple(
        Backend(b["ip"], b["port"], b.get("nodeName"), b.get("zone"), b.get("cluster"),
                b["local"], b["ready"], b["serving"], b["terminating"])
        for b in items
    )  # fmt: skip
