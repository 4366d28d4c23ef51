"""The compiler: ClusterState + this node → NodeState. Pure; no I/O, no kernel.

Every Kubernetes semantic the dataplanes rely on is decided here and nowhere else:
which Services are programmed, their frontends on this node, and which endpoints each
kind of traffic may use (readiness with the serving-terminating fallback, topology hints,
topology keys, traffic policies, multi-cluster preference). The selection follows
kube-proxy's `CategorizeEndpoints` (pkg/proxy/topology.go) and extends it as
docs/semantics.md describes.

Compilation is per Service: `Compiler.update` recompiles only the Services whose inputs
changed and recomputes the revision from cached per-entry digests.
"""

from __future__ import annotations

import bisect
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from operator import attrgetter

from ..gcpause import gc_paused
from . import conventions as c
from .ip import in_networks, ip_family, ip_sort_key, parse_ip
from .nodestate import (
    CLUSTER_IP,
    EXTERNAL_IP,
    FRONTEND_ORDER,
    LOAD_BALANCER,
    NODE_PORT,
    Backend,
    Changes,
    Frontend,
    NodeInfo,
    NodeState,
    ServiceEntry,
    backends_of,
    is_external,
    revision_of,
    uses_endpoints,
)
from .types import ClusterState, Endpoint, EndpointSlice, Node, Service, ServiceKey

PRIMARY = "primary"  # --nodeport-addresses=primary: the node's primary IP of each family

# Values of ServiceEntry.topology besides the topology keys themselves.
NO_TOPOLOGY = "None"
PREFER_SAME_ZONE = "PreferSameZone"
PREFER_SAME_NODE = "PreferSameNode"
NO_MATCH = "NoMatch"  # topology keys set, none shared with a ready endpoint: no backends
LOCAL_CLUSTER = "LocalCluster"  # LocalFirst kept traffic in this cluster
ANY_CLUSTER = "AnyCluster"  # LocalFirst found no ready endpoint here and used every cluster

_Candidate = tuple[Backend, Endpoint]


@dataclass(frozen=True)
class CompileOptions:
    """Node-level settings that change what the compiler produces."""

    node_ips: tuple[str, ...] = ()  # replaces the Node object's addresses when set
    node_labels: Mapping[str, str] = field(default_factory=dict)  # added to the Node's labels
    # CIDRs whose node addresses answer NodePorts; ("primary",) for the primary IPs;
    # empty for every node address (kube-proxy's meaning of the flag).
    nodeport_addresses: tuple[str, ...] = ()
    cluster_cidrs: tuple[str, ...] = ()
    cluster_name: str | None = None
    service_proxy_name: str | None = None


@dataclass(frozen=True)
class _Context:
    node: NodeInfo
    cluster_name: str | None
    service_proxy_name: str | None
    nodes: Mapping[str, Node]  # every known Node, for topology keys


def resolve_node(state: ClusterState, name: str, options: CompileOptions) -> NodeInfo:
    """This node as the compiler sees it: the Node object plus the options' overrides."""
    node = state.nodes.get(name)
    labels = dict(node.labels) if node else {}
    labels.update(options.node_labels)
    if options.node_ips:
        addresses = tuple(dict.fromkeys(parse_ip(ip)[1] for ip in options.node_ips))
    else:
        addresses = node.addresses if node else ()
    return NodeInfo(
        name=name,
        zone=labels.get(c.LABEL_ZONE) or None,
        labels=labels,
        addresses=addresses,
        cluster_cidrs=options.cluster_cidrs,
        cluster_name=options.cluster_name,
        nodeport_addresses=_nodeport_ips(addresses, options.nodeport_addresses),
    )


def _nodeport_ips(addresses: tuple[str, ...], cidrs: tuple[str, ...]) -> tuple[str, ...]:
    """The node's addresses that accept NodePort traffic (--nodeport-addresses: CIDRs,
    `primary`, or every address when empty), in the node's order."""
    if cidrs == (PRIMARY,):
        chosen: Iterable[str] = {ip_family(a): a for a in reversed(addresses)}.values()
    elif cidrs:
        networks = tuple(ipaddress.ip_network(n, strict=False) for n in cidrs)
        chosen = [a for a in addresses if in_networks(a, networks)]
    else:
        return addresses
    kept = set(chosen)
    return tuple(a for a in addresses if a in kept)


def _context(state: ClusterState, name: str, options: CompileOptions) -> _Context:
    return _Context(
        node=resolve_node(state, name, options),
        cluster_name=options.cluster_name,
        service_proxy_name=options.service_proxy_name,
        nodes=state.nodes,
    )


def compile(state: ClusterState, node: str, options: CompileOptions | None = None) -> NodeState:
    """The complete NodeState of `node` (pure: reads `state`, changes nothing)."""
    return Compiler(node, options or CompileOptions()).full(state)


class Compiler:
    """Keeps the last compiled entries so one change costs one Service.

    The entries of all Services are kept flat and sorted, beside their Service keys and
    digests; an update splices one Service's range (found by bisection) in all three,
    so publishing a new NodeState costs a tuple copy and one hash over the digests.
    """

    def __init__(self, node: str, options: CompileOptions) -> None:
        self.node_name = node
        self.options = options
        self._entries: list[ServiceEntry] = []  # sorted by ServiceEntry.sort_key
        self._keys: list[ServiceKey] = []  # the Service key of each entry
        self._digests: list[bytes] = []  # the digest of each entry
        self._backends = 0  # backends over all entries (NodeState.backend_count)
        # Services with topology keys, by the nodes their endpoints run on: another node's
        # labels matter only to these (and only when that node changes).
        self._keyed_nodes: dict[ServiceKey, frozenset[str]] = {}
        self._keyed_by_node: dict[str, set[ServiceKey]] = {}
        self._context: _Context | None = None
        self._state: NodeState | None = None

    def full(self, state: ClusterState) -> NodeState:
        """Recompile every Service."""
        self._context = ctx = _context(state, self.node_name, self.options)
        slices = state.slices_by_service
        entries: list[ServiceEntry] = []
        with gc_paused():  # bulk allocation of acyclic values (see agent/gcpause.py)
            for key, service in state.services.items():
                entries.extend(compile_service(service, slices.get(key), ctx))
        entries.sort(key=attrgetter("sort_key"))
        self._entries = entries
        self._keys = [(e.namespace, e.name) for e in entries]
        self._digests = [e.digest for e in entries]
        self._backends = sum(map(backends_of, entries))
        self._keyed_nodes, self._keyed_by_node = {}, {}
        for key, service in state.services.items():
            self._index_nodes(key, service, slices.get(key))
        return self._publish()

    def _index_nodes(
        self, key: ServiceKey, service: Service | None, slices: Mapping[str, EndpointSlice] | None
    ) -> None:
        """Keep the node → topology-keyed Services index of `key` current."""
        nodes: frozenset[str] = frozenset()
        if service is not None and service.topology_keys:
            nodes = frozenset(
                ep.node_name
                for endpoint_slice in (slices or {}).values()
                for ep in endpoint_slice.endpoints
                if ep.node_name is not None
            )
        old = self._keyed_nodes.get(key, frozenset())
        if service is not None and service.topology_keys:
            self._keyed_nodes[key] = nodes
        else:
            self._keyed_nodes.pop(key, None)
        for name in old - nodes:
            keyed = self._keyed_by_node[name]
            keyed.discard(key)
            if not keyed:
                del self._keyed_by_node[name]
        for name in nodes - old:
            self._keyed_by_node.setdefault(name, set()).add(key)

    def depending_on(self, nodes: Iterable[str]) -> set[ServiceKey]:
        """The Services with topology keys that have an endpoint on one of `nodes`: the
        only ones another node's labels can change."""
        keyed = self._keyed_by_node
        return {key for name in nodes for key in keyed.get(name, ())}

    def update(self, state: ClusterState) -> NodeState:
        """Recompile what changed since the last call (consumes `state`'s change log)."""
        services, nodes = state.take_changes()
        ctx = _context(state, self.node_name, self.options)
        previous = self._context
        if (
            self._state is None
            or previous is None
            or ctx.node != previous.node  # its NodePort addresses included
        ):
            return self.full(state)
        if not services and not nodes:
            return self._state
        self._context = ctx
        if nodes:  # other nodes' labels only matter to topology-keyed Services on them
            services |= self.depending_on(nodes)
        try:
            return self._update(state, services, ctx)
        except BaseException:
            # The change log is consumed and the entries may be half spliced: the next
            # call compiles everything again, so no change of this batch is lost.
            self._state = None
            raise

    def _update(self, state: ClusterState, services: set[ServiceKey], ctx: _Context) -> NodeState:
        assert self._state is not None
        base = self._state.revision
        slices = state.slices_by_service
        for key in services:
            service = state.services.get(key)
            entries = compile_service(service, slices.get(key), ctx) if service else ()
            self._index_nodes(key, service, slices.get(key))
            low = bisect.bisect_left(self._keys, key)
            high = bisect.bisect_right(self._keys, key, low)
            self._backends += sum(map(backends_of, entries)) - sum(
                map(backends_of, self._entries[low:high])
            )
            self._entries[low:high] = entries
            self._keys[low:high] = [key] * len(entries)
            self._digests[low:high] = [e.digest for e in entries]
        return self._publish(Changes(base, frozenset(services)))

    def _publish(self, changes: Changes | None = None) -> NodeState:
        assert self._context is not None
        self._state = NodeState(
            self._context.node,
            revision_of(self._digests),
            tuple(self._entries),
            self._backends,
            changes,
        )
        return self._state


# --- one Service -------------------------------------------------------------------------


def is_programmed(service: Service, service_proxy_name: str | None) -> bool:
    """Whether this proxy handles the Service at all (kube-proxy's ShouldSkipService and
    the service-proxy-name claim; docs/semantics.md)."""
    if service.type == "ExternalName" or not service.cluster_ips:
        return False
    if service_proxy_name:
        return service.proxy_name == service_proxy_name
    return service.proxy_name is None


def slice_cluster(endpoint_slice: EndpointSlice, cluster_name: str | None) -> str | None:
    """The cluster a slice's endpoints live in: None for this one (docs/semantics.md)."""
    for marker in (endpoint_slice.provision_cluster, endpoint_slice.source_cluster):
        if marker and marker != cluster_name:  # an empty marker names no cluster
            return marker
    if (
        endpoint_slice.managed_by in c.KARMADA_MANAGED_BY
        and endpoint_slice.provision_cluster is None
    ):
        return c.UNKNOWN_CLUSTER
    return None


def compile_service(
    service: Service, slices: Mapping[str, EndpointSlice] | None, ctx: _Context
) -> tuple[ServiceEntry, ...]:
    """The entries of one Service: one per (ServicePort, IP family of its ClusterIPs)."""
    if not is_programmed(service, ctx.service_proxy_name):
        return ()
    hc_port = None
    if (
        service.type == "LoadBalancer"
        and service.external_traffic_policy == "Local"
        and service.health_check_node_port
    ):
        hc_port = service.health_check_node_port
    entries: list[ServiceEntry] = []
    for cluster_ip in service.cluster_ips:
        family = ip_family(cluster_ip)
        merged = _merge_endpoints(service, slices or {}, family, ctx)
        external_ips = [ip for ip in service.external_ips if ip_family(ip) == family]
        lb_ips = [ip for ip in service.load_balancer_ips if ip_family(ip) == family]
        ranges = tuple(r for r in service.load_balancer_source_ranges if ip_family(r) == family)
        for port in service.ports:
            has_node_port = port.node_port != 0 and service.type in ("NodePort", "LoadBalancer")
            frontends = [Frontend(CLUSTER_IP, cluster_ip, port.port)]
            if has_node_port:
                frontends += [
                    Frontend(NODE_PORT, ip, port.node_port) for ip in ctx.node.nodeport_ips(family)
                ]
            frontends += [Frontend(EXTERNAL_IP, ip, port.port) for ip in external_ips]
            frontends += [Frontend(LOAD_BALANCER, ip, port.port, ranges) for ip in lb_ips]
            frontends.sort(key=lambda f: (FRONTEND_ORDER[f.type], ip_sort_key(f.ip), f.port))

            # The types the Service asks for (a NodePort even where this node has no
            # NodePort address): they decide the effective policy and the sets.
            types = [CLUSTER_IP, *[NODE_PORT] * has_node_port, *[EXTERNAL_IP] * bool(external_ips),
                     *[LOAD_BALANCER] * bool(lb_ips)]  # fmt: skip
            external = any(map(is_external, types))
            etp = "Local" if external and service.external_traffic_policy == "Local" else "Cluster"
            itp = service.internal_traffic_policy
            uses_cluster, uses_local = uses_endpoints(itp, etp, types)
            candidates = merged.get((port.name, port.protocol), [])
            cluster, topology = (
                _cluster_backends(candidates, service, ctx) if uses_cluster else (None, NO_TOPOLOGY)
            )
            entries.append(
                ServiceEntry(
                    namespace=service.namespace,
                    name=service.name,
                    port=port.name,
                    protocol=port.protocol,
                    ip_family=family,
                    frontends=tuple(dict.fromkeys(frontends)),
                    affinity_timeout=service.affinity_timeout,
                    internal_traffic_policy=itp,
                    external_traffic_policy=etp,
                    health_check_node_port=hc_port,
                    topology=topology,
                    has_endpoints=any(_usable(ep) for _, ep in candidates),
                    cluster_backends=cluster,
                    local_backends=_local_backends(candidates) if uses_local else None,
                    lb_algorithm=service.lb_algorithm,
                ).sealed()
            )
    entries.sort(key=attrgetter("sort_key"))
    return tuple(entries)


def _usable(ep: Endpoint) -> bool:
    return ep.ready or (ep.serving and ep.terminating)


def _merge_endpoints(
    service: Service, slices: Mapping[str, EndpointSlice], family: str, ctx: _Context
) -> dict[tuple[str, str], list[_Candidate]]:
    """Endpoints of every slice of the Service, per (port name, protocol), one per ip:port.

    A slice's ports apply to all of its endpoints, so one port name may map to different
    target ports in different slices. Of duplicates, a non-terminating copy wins, then one
    of this cluster, then the first in slice-name order. Sorted by ip, then port.
    """
    wanted = {(p.name, p.protocol) for p in service.ports}
    node_name = ctx.node.name
    buckets: dict[
        tuple[str, str], dict[tuple[str, int], tuple[Backend, Endpoint, tuple[bool, bool]]]
    ] = {}
    for slice_name in sorted(slices):
        endpoint_slice = slices[slice_name]
        if endpoint_slice.family != family:
            continue
        cluster = slice_cluster(endpoint_slice, ctx.cluster_name)
        remote = cluster is not None
        for slice_port in endpoint_slice.ports:
            key = (slice_port.name, slice_port.protocol)
            if key not in wanted:
                continue
            bucket = buckets.setdefault(key, {})
            port = slice_port.port
            for ep in endpoint_slice.endpoints:
                rank = (ep.terminating, remote)
                previous = bucket.get((ep.ip, port))
                if previous is not None and previous[2] <= rank:
                    continue
                local = not remote and ep.node_name == node_name
                backend = Backend(
                    ep.ip, port, ep.node_name, ep.zone, cluster, local,
                    ep.ready, ep.serving, ep.terminating,
                )  # fmt: skip
                bucket[(ep.ip, port)] = (backend, ep, rank)
    return {
        key: [(b, ep) for (b, ep, _) in sorted(bucket.values(), key=_backend_order)]
        for key, bucket in buckets.items()
    }


def _backend_order(item: tuple[Backend, Endpoint, tuple[bool, bool]]) -> tuple[object, int]:
    return ip_sort_key(item[0].ip), item[0].port


def _local_backends(candidates: list[_Candidate]) -> tuple[Backend, ...]:
    """kube-proxy's local endpoints: ready ones on this node, else serving-terminating ones."""
    mine = [(b, ep) for b, ep in candidates if b.local]
    return tuple(b for b, ep in mine if ep.ready) or tuple(
        b for b, ep in mine if ep.serving and ep.terminating
    )


def _cluster_backends(
    candidates: list[_Candidate], service: Service, ctx: _Context
) -> tuple[tuple[Backend, ...], str]:
    """kube-proxy's cluster endpoints after multi-cluster preference and topology.

    Returns the backends and the topology tiers that applied, joined with "+".
    """
    tiers: list[str] = []
    pool = candidates
    if service.multi_cluster == c.LOCAL_FIRST and any(b.cluster is not None for b, _ in candidates):
        if any(b.cluster is None and ep.ready for b, ep in candidates):
            pool = [(b, ep) for b, ep in candidates if b.cluster is None]
            tiers.append(LOCAL_CLUSTER)
        else:
            tiers.append(ANY_CLUSTER)
    ready = [(b, ep) for b, ep in pool if ep.ready]
    if ready:
        if service.topology_keys:
            ready, mode = _by_topology_keys(ready, service.topology_keys, ctx)
        else:
            ready, mode = _by_hints(ready, ctx.node)
        if mode:
            tiers.append(mode)
        chosen = tuple(b for b, _ in ready)
    else:
        # No ready endpoint anywhere in the pool: serving-terminating ones, ignoring topology.
        chosen = tuple(b for b, ep in pool if ep.serving and ep.terminating)
    return chosen, "+".join(tiers) or NO_TOPOLOGY


def _by_hints(ready: list[_Candidate], node: NodeInfo) -> tuple[list[_Candidate], str | None]:
    """kube-proxy's topologyModeFromHints + availableForTopology, over ready endpoints.

    Hints of remote-cluster endpoints name the other cluster's nodes and zones; they are
    treated as absent, so a pool with remote endpoints ignores hints (kube-proxy's rule
    that every ready endpoint must carry a hint).
    """
    all_node_hints = all_zone_hints = True
    for_node = for_zone = False
    for backend, ep in ready:
        remote = backend.cluster is not None
        if remote or not ep.node_hints:
            all_node_hints = False
        elif node.name in ep.node_hints:
            for_node = True
        if remote or not ep.zone_hints:
            all_zone_hints = False
        elif node.zone is not None and node.zone in ep.zone_hints:
            for_zone = True
    if all_node_hints and for_node:
        return [(b, ep) for b, ep in ready if node.name in ep.node_hints], PREFER_SAME_NODE
    if all_zone_hints and for_zone:
        return [(b, ep) for b, ep in ready if node.zone in ep.zone_hints], PREFER_SAME_ZONE
    return ready, None


def _by_topology_keys(
    ready: list[_Candidate], keys: tuple[str, ...], ctx: _Context
) -> tuple[list[_Candidate], str]:
    """KEP-536 topologyKeys: the first key whose value this node shares with at least one
    ready endpoint's node wins; "*" takes any endpoint; no match leaves no backend.
    Remote-cluster endpoints match only "*" (their nodes are not ours)."""
    node = ctx.node
    for key in keys:
        if key == c.TOPOLOGY_KEY_ANY:
            return ready, key
        mine = node.labels.get(key)
        if mine is None:
            continue
        chosen = [
            (b, ep) for b, ep in ready
            if b.cluster is None and _node_label(ep.node_name, key, ctx) == mine
        ]  # fmt: skip
        if chosen:
            return chosen, key
    return [], NO_MATCH


def _node_label(node_name: str | None, key: str, ctx: _Context) -> str | None:
    if node_name is None:
        return None
    if node_name == ctx.node.name:
        return ctx.node.labels.get(key)
    other = ctx.nodes.get(node_name)
    return other.labels.get(key) if other else None


def endpoint_candidates(
    state: ClusterState, node: str, options: CompileOptions, key: ServiceKey, family: str
) -> dict[tuple[str, str], list[tuple[Backend, Endpoint]]]:
    """Every endpoint of the Service `key` the compiler chose from, per (port name,
    protocol), before readiness, topology and policies: what `explain` compares a set
    with to say why an endpoint was left out."""
    service = state.services.get(key)
    if service is None:
        return {}
    ctx = _context(state, node, options)
    return _merge_endpoints(service, state.slices_by_service.get(key) or {}, family, ctx)


def node_label(state: ClusterState, node: NodeInfo, other: str | None, key: str) -> str | None:
    """The value of label `key` on node `other` as topology keys read it (this node's
    labels include --node-label)."""
    ctx = _Context(node, None, None, state.nodes)
    return _node_label(other, key, ctx)
