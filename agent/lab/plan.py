"""The lab's cluster planned from manifests (pure): which nodes get a namespace, which pod
runs where with which addresses and ports, a client pod per node, an outside client on the
node network, the routes of the node network, and which endpoints the lab cannot reach and
why.

Pods come from the EndpointSlices, headless ones included (a LeaderWorkerSet's pods are
only listed there): one pod per endpoint address of this cluster on a Node of the
manifests. A pod is named after the endpoint's targetRef, else its hostname, else
`<service>-<node suffix>` (`web-b` for an endpoint of web on node-b); the IPv4 and IPv6
endpoints of one dual-stack pod share that name and become one pod with both addresses.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..model import conventions as c
from ..model.compile import is_programmed, slice_cluster
from ..model.ip import parse_ip
from ..model.nodestate import CLUSTER_IP, NODE_PORT, NodeState
from ..model.types import ClusterState, EndpointSlice

IPV4 = "IPv4"
IPV6 = "IPv6"
# Each node's pods are routed to it per prefix of this length (Calico-style blocks):
# 10.244.2.0/24 and fd00:244:2::/64 via node-b's address on the node network.
POD_PREFIX_LENGTH = {IPV4: 24, IPV6: 64}
# The outside client's address: the first of these (counting up) that no node, pod or
# Service uses and no pod prefix holds; TEST-NET-1 and the documentation prefix, where the
# examples' nodes are, so the example source range 192.0.0.0/16 admits it.
OUTSIDE_FIRST = {IPV4: "192.0.2.100", IPV6: "2001:db8::100"}
OUTSIDE_CANDIDATES = 100
OUTSIDE_NAME = "outside"


@dataclass(frozen=True, slots=True)
class LabNode:
    """A node namespace: its addresses on the node network and its pods' prefixes."""

    name: str
    short: str  # "a" for node-a: used in pod names
    ipv4: str | None
    ipv6: str | None
    pod_prefixes: tuple[str, ...]  # routed via this node by every other node

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(ip for ip in (self.ipv4, self.ipv6) if ip)


@dataclass(frozen=True, slots=True)
class LabPod:
    """A pod namespace on a node: its addresses and what it serves (TCP: HTTP, UDP: echo),
    always answering with `namespace/name`."""

    namespace: str
    name: str
    node: str
    ipv4: str | None
    ipv6: str | None
    tcp_ports: tuple[int, ...] = ()
    udp_ports: tuple[int, ...] = ()
    client: bool = False

    @property
    def full_name(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(ip for ip in (self.ipv4, self.ipv6) if ip)

    def serves(self, protocol: str, port: int) -> bool:
        ports = {"TCP": self.tcp_ports, "UDP": self.udp_ports}.get(protocol, ())
        return port in ports


@dataclass(frozen=True, slots=True)
class LabOutside:
    """A client outside the cluster: a namespace on the node network (the bridge) with an
    address in no pod, node or Service range, as a host behind a router would have."""

    name: str
    ipv4: str | None
    ipv6: str | None
    entry_node: str  # where it sends traffic for ExternalIPs and LoadBalancer VIPs

    @property
    def full_name(self) -> str:
        return self.name

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(ip for ip in (self.ipv4, self.ipv6) if ip)


@dataclass(frozen=True, slots=True)
class Unreachable:
    """An endpoint address the lab has no pod for."""

    ip: str
    services: tuple[str, ...]  # namespace/name of the Services whose slices list it
    reason: str


@dataclass(frozen=True, slots=True)
class LabPlan:
    nodes: tuple[LabNode, ...]
    pods: tuple[LabPod, ...]  # backends and clients
    unreachable: tuple[Unreachable, ...]
    service_addresses: tuple[str, ...]  # ClusterIPs, ExternalIPs, LoadBalancer VIPs
    not_proxied: tuple[tuple[str, str], ...]  # (namespace/name, why) of Services left alone
    external_addresses: tuple[str, ...] = ()  # ExternalIPs and LoadBalancer VIPs
    outside: LabOutside | None = None
    _by_ip: dict[str, LabPod] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for pod in self.pods:
            for ip in pod.addresses:
                self._by_ip[ip] = pod

    def node(self, name: str) -> LabNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def pod_at(self, ip: str) -> LabPod | None:
        return self._by_ip.get(ip)

    def client_of(self, node: str) -> LabPod:
        for pod in self.pods:
            if pod.client and pod.node == node:
                return pod
        raise KeyError(node)

    def pods_on(self, node: str) -> tuple[LabPod, ...]:
        return tuple(p for p in self.pods if p.node == node)

    def unreachable_reasons(self) -> dict[str, str]:
        return {u.ip: u.reason for u in self.unreachable}


@dataclass
class _Record:
    """One endpoint address of one slice, as the lab needs it."""

    namespace: str
    service: str
    family: str
    ip: str
    node: str | None
    hostname: str | None
    target: tuple[str, str] | None  # (namespace, name) of a Pod targetRef
    ports: tuple[tuple[str, int], ...]  # (protocol, port)
    cluster: str | None  # None for this cluster


def plan_lab(
    slices: Iterable[Mapping[str, Any]], state: ClusterState, node_states: Iterable[NodeState]
) -> LabPlan:
    """The lab for these raw EndpointSlice objects (headless ones included), the decoded
    cluster (Nodes for names, addresses and labels; Services for what is not proxied) and
    the NodeStates compiled from it (their frontends: the Service addresses)."""
    records = [r for obj in slices for r in _records(obj)]
    unreachable: dict[str, tuple[set[str], str]] = {}
    usable: list[_Record] = []
    for record in records:
        reason = _unreachable_reason(record, state)
        if reason is None:
            usable.append(record)
        else:
            owners, _ = unreachable.setdefault(record.ip, (set(), reason))
            owners.add(f"{record.namespace}/{record.service}")
    # An address is a pod when any slice places it on a lab node (a remote copy of the
    # same address elsewhere does not make the pod unreachable).
    for record in usable:
        unreachable.pop(record.ip, None)

    shorts = _short_names(sorted({r.node for r in usable if r.node}))
    pods = _pods(usable, shorts)
    nodes = []
    for name in sorted({p.node for p in pods}):
        node = state.nodes[name]
        nodes.append(
            LabNode(
                name=name,
                short=shorts[name],
                ipv4=next((ip for ip in node.addresses if ":" not in ip), None),
                ipv6=next((ip for ip in node.addresses if ":" in ip), None),
                pod_prefixes=(),
            )
        )
    nodes = _with_prefixes(nodes, pods)
    taken = {r.ip for r in records}
    clients = [_client(node, taken) for node in nodes]
    all_pods = tuple(pods) + tuple(c for c in clients if c is not None)
    frontends = [fe for ns in node_states for entry in ns.services for fe in entry.frontends]
    service_addresses = _addresses(fe.ip for fe in frontends if fe.type != NODE_PORT)
    return LabPlan(
        nodes=tuple(nodes),
        pods=all_pods,
        unreachable=tuple(
            Unreachable(ip, tuple(sorted(owners)), reason)
            for ip, (owners, reason) in sorted(unreachable.items(), key=lambda i: _ip_key(i[0]))
        ),
        service_addresses=service_addresses,
        not_proxied=_not_proxied(state),
        external_addresses=_addresses(
            fe.ip for fe in frontends if fe.type not in (CLUSTER_IP, NODE_PORT)
        ),
        outside=_outside(nodes, all_pods, taken | set(service_addresses)),
    )


def _records(obj: Mapping[str, Any]) -> list[_Record]:
    """The endpoint addresses of one raw slice; [] for anything malformed (the manifest
    loader already reported it) or of no use (FQDN slices)."""
    try:
        meta = obj.get("metadata") or {}
        labels = meta.get("labels") or {}
        annotations = meta.get("annotations") or {}
        namespace = meta.get("namespace") or "default"
        service = labels.get(c.LABEL_SERVICE_NAME)
        family = obj.get("addressType")
        if not service or family not in (IPV4, IPV6):
            return []
        marker = EndpointSlice(
            namespace, str(meta.get("name")), service, family, (), (),
            provision_cluster=annotations.get(c.ANNOTATION_KARMADA_PROVISION_CLUSTER),
            source_cluster=labels.get(c.LABEL_MCS_SOURCE_CLUSTER),
            managed_by=labels.get(c.LABEL_MANAGED_BY),
        )  # fmt: skip
        cluster = slice_cluster(marker, None)  # the agents run without --cluster-name
        ports = tuple(
            (str(p.get("protocol") or "TCP"), int(p["port"]))
            for p in obj.get("ports") or ()
            if isinstance(p, Mapping) and p.get("port")
        )
        out = []
        for endpoint in obj.get("endpoints") or ():
            addresses = endpoint.get("addresses") or ()
            if not addresses:
                continue
            ip = parse_ip(addresses[0], family)[1]  # the first address, as kube-proxy
            ref = endpoint.get("targetRef") or {}
            target = None
            if ref.get("kind", "Pod") == "Pod" and ref.get("name"):
                target = (ref.get("namespace") or namespace, ref["name"])
            record = _Record(
                namespace, service, family, ip, endpoint.get("nodeName"),
                endpoint.get("hostname"), target, ports, cluster,
            )  # fmt: skip
            out.append(record)
        return out
    except (AttributeError, KeyError, TypeError, ValueError):
        return []


def _unreachable_reason(record: _Record, state: ClusterState) -> str | None:
    if record.cluster is not None:
        return f"in remote cluster {record.cluster}"
    if not record.node:
        return "no nodeName"
    if record.node not in state.nodes:
        return f"on node {record.node}, which the manifests do not define"
    node = state.nodes[record.node]
    if not any((":" in ip) == (record.family == IPV6) for ip in node.addresses):
        return f"node {record.node} has no {record.family} address"
    return None


def _short_names(nodes: list[str]) -> dict[str, str]:
    """node-a -> a, unless two nodes would share a suffix (then the whole name)."""
    suffixes = {name: name.rsplit("-", 1)[-1] for name in nodes}
    counts = defaultdict(int)
    for suffix in suffixes.values():
        counts[suffix] += 1
    return {name: s if counts[s] == 1 else name for name, s in suffixes.items()}


def _pods(records: list[_Record], shorts: Mapping[str, str]) -> list[LabPod]:
    """One pod per identity: targetRef, else hostname, else (Service, node, ordinal)
    — the same for a dual-stack pod's IPv4 and IPv6 endpoints."""
    records = sorted(records, key=lambda r: (r.namespace, r.service, r.family, _ip_key(r.ip)))
    by_ip: dict[str, list[_Record]] = defaultdict(list)
    for record in records:
        by_ip[record.ip].append(record)

    # Ordinals of derived identities: the n-th address of a Service on a node, per family.
    ordinals: dict[str, int] = {}
    seen: dict[tuple[str, str, str, str], int] = defaultdict(int)
    for ip, group in by_ip.items():
        first = group[0]
        key = (first.namespace, first.service, first.node or "", first.family)
        ordinals[ip] = seen[key]
        seen[key] += 1

    identities: dict[tuple[str, str], dict[str, Any]] = {}
    for ip, group in sorted(by_ip.items(), key=lambda item: _ip_key(item[0])):
        named = next((r for r in group if r.target), None) or next(
            (r for r in group if r.hostname), None
        )
        first = group[0]
        if named is not None and named.target:
            namespace, name = named.target
        elif named is not None:
            namespace, name = named.namespace, str(named.hostname)
        else:
            namespace = first.namespace
            name = f"{first.service}-{shorts[first.node or '']}"
            if ordinals[ip]:
                name += f"-{ordinals[ip] + 1}"
        identity = _free_identity(identities, (namespace, name), first)
        pod = identities.setdefault(
            identity, {"node": first.node, "ips": {}, "tcp": set(), "udp": set()}
        )
        pod["ips"][first.family] = ip
        for record in group:
            for protocol, port in record.ports:
                if protocol in ("TCP", "UDP"):
                    pod[protocol.lower()].add(port)
    pods = []
    for (namespace, name), pod in identities.items():
        pods.append(
            LabPod(
                namespace=namespace,
                name=name,
                node=pod["node"],
                ipv4=pod["ips"].get(IPV4),
                ipv6=pod["ips"].get(IPV6),
                tcp_ports=tuple(sorted(pod["tcp"])),
                udp_ports=tuple(sorted(pod["udp"])),
            )
        )
    return _unique_names(sorted(pods, key=lambda p: (p.node, p.full_name)))


def _free_identity(
    identities: Mapping[tuple[str, str], Mapping[str, Any]],
    identity: tuple[str, str],
    record: _Record,
) -> tuple[str, str]:
    """identity, or identity with a suffix when it already has an address of this family
    or lives on another node (two pods cannot share a name)."""
    namespace, name = identity
    n = 1
    while True:
        candidate = (namespace, name if n == 1 else f"{name}-x{n}")
        existing = identities.get(candidate)
        if existing is None or (
            record.family not in existing["ips"] and existing["node"] == record.node
        ):
            return candidate
        n += 1


def _unique_names(pods: list[LabPod]) -> list[LabPod]:
    """Pod names (without namespace) unique across the lab: they name its namespaces."""
    seen: set[str] = set()
    out = []
    for pod in pods:
        name, n = pod.name, 1
        while name in seen:
            n += 1
            name = f"{pod.name}-{n}"
        seen.add(name)
        out.append(pod if name == pod.name else _replace(pod, name=name))
    return out


def _replace(pod: LabPod, **changes: Any) -> LabPod:
    values = {f: getattr(pod, f) for f in LabPod.__dataclass_fields__}
    values.update(changes)
    return LabPod(**values)


def _prefix(ip: str) -> str:
    family = IPV6 if ":" in ip else IPV4
    network = ipaddress.ip_network(f"{ip}/{POD_PREFIX_LENGTH[family]}", strict=False)
    return str(network)


def _with_prefixes(nodes: list[LabNode], pods: list[LabPod]) -> list[LabNode]:
    """Each node's pod prefixes: those only its pods use (a prefix shared by pods of two
    nodes is not routed; those pods get host routes instead, see `routes`)."""
    owners: dict[str, set[str]] = defaultdict(set)
    for pod in pods:
        for ip in pod.addresses:
            owners[_prefix(ip)].add(pod.node)
    out = []
    for node in nodes:
        mine = sorted(
            (p for p, o in owners.items() if o == {node.name}),
            key=lambda p: (":" in p, _ip_key(p.split("/")[0])),
        )
        out.append(_replace_node(node, pod_prefixes=tuple(mine)))
    return out


def _replace_node(node: LabNode, **changes: Any) -> LabNode:
    values = {f: getattr(node, f) for f in LabNode.__dataclass_fields__}
    values.update(changes)
    return LabNode(**values)


def _client(node: LabNode, taken: set[str]) -> LabPod | None:
    """client-<suffix>: the highest free host of the node's first IPv4 prefix (.254),
    and the IPv6 address with the same digits in its first IPv6 prefix (::254)."""
    v4 = next((p for p in node.pod_prefixes if ":" not in p), None)
    if v4 is None or node.ipv4 is None:
        return None
    network = ipaddress.IPv4Network(v4)
    hosts = [h for h in network.hosts() if str(h) not in taken]
    if not hosts:
        return None
    ipv4 = hosts[-1]
    ipv6 = None
    v6 = next((p for p in node.pod_prefixes if ":" in p), None)
    if v6 is not None and node.ipv6 is not None:
        candidate = str(ipaddress.IPv6Network(v6).network_address + int(str(int(ipv4) & 0xFF), 16))
        ipv6 = candidate if candidate not in taken else None
    return LabPod("default", f"client-{node.short}", node.name, str(ipv4), ipv6, client=True)


def _outside(nodes: list[LabNode], pods: tuple[LabPod, ...], taken: set[str]) -> LabOutside | None:
    """The outside client: an address per family some node has, none used by a node, a pod
    or a Service and none inside a pod prefix (it must not pass for a pod)."""
    used = taken | {ip for node in nodes for ip in node.addresses}
    used |= {ip for pod in pods for ip in pod.addresses}
    prefixes = [ipaddress.ip_network(p) for node in nodes for p in node.pod_prefixes]
    chosen: dict[str, str | None] = {}
    for family, attr in ((IPV4, "ipv4"), (IPV6, "ipv6")):
        chosen[family] = None
        if not any(getattr(node, attr) for node in nodes):
            continue  # no node network in this family
        first = ipaddress.ip_address(OUTSIDE_FIRST[family])
        for n in range(OUTSIDE_CANDIDATES):
            candidate = first + n
            if str(candidate) not in used and not any(
                candidate in net for net in prefixes if net.version == candidate.version
            ):
                chosen[family] = str(candidate)
                break
    if not any(chosen.values()):
        return None
    # Its namespace and bridge port are named like those of pods and nodes: no clash.
    names = {pod.name for pod in pods} | {node.name for node in nodes} | {"net"}
    name, n = OUTSIDE_NAME, 1
    while name in names:
        n += 1
        name = f"{OUTSIDE_NAME}-{n}"
    return LabOutside(name, chosen[IPV4], chosen[IPV6], entry_node=nodes[0].name)


def outside_routes(plan: LabPlan) -> list[tuple[str, str | None]]:
    """(destination, gateway) routes of the outside client: every node address on-link
    (gateway None), and the ExternalIPs and LoadBalancer VIPs via its entry node's address
    in their family, as a router in front of the cluster would send them."""
    outside = plan.outside
    if outside is None:
        return []
    entry = plan.node(outside.entry_node)
    out: list[tuple[str, str | None]] = []
    for node in plan.nodes:
        if node.ipv4 and outside.ipv4:
            out.append((f"{node.ipv4}/32", None))
        if node.ipv6 and outside.ipv6:
            out.append((f"{node.ipv6}/128", None))
    for address in plan.external_addresses:
        if ":" in address and entry.ipv6 and outside.ipv6:
            out.append((f"{address}/128", entry.ipv6))
        elif ":" not in address and entry.ipv4 and outside.ipv4:
            out.append((f"{address}/32", entry.ipv4))
    return out


def routes(plan: LabPlan, node_name: str) -> list[tuple[str, str]]:
    """(destination, gateway) routes node_name needs on the node network to reach every
    other node's pods: their prefixes, and host routes for pods outside any prefix."""
    this = plan.node(node_name)
    out: list[tuple[str, str]] = []
    for other in plan.nodes:
        if other.name == node_name:
            continue
        # A family this node has no address in has no node network to route over.
        gateways = {4: other.ipv4 if this.ipv4 else None, 6: other.ipv6 if this.ipv6 else None}
        for prefix in other.pod_prefixes:
            gateway = gateways[ipaddress.ip_network(prefix).version]
            if gateway:
                out.append((prefix, gateway))
        covered = [ipaddress.ip_network(p) for p in other.pod_prefixes]
        for pod in plan.pods_on(other.name):
            for ip in pod.addresses:
                address = ipaddress.ip_address(ip)
                if any(address in net for net in covered if net.version == address.version):
                    continue
                gateway = gateways[address.version]
                if gateway:
                    out.append((f"{ip}/{128 if address.version == 6 else 32}", gateway))
    return out


def _addresses(ips: Iterable[str]) -> tuple[str, ...]:
    """The Service addresses of these frontends, each once, in address order."""
    return tuple(sorted(set(ips), key=_ip_key))


def _not_proxied(state: ClusterState) -> tuple[tuple[str, str], ...]:
    out = []
    for (namespace, name), service in sorted(state.services.items()):
        if is_programmed(service, None):
            continue
        if service.type == "ExternalName":
            why = "ExternalName: DNS only, not proxied (as kube-proxy)"
        elif not service.cluster_ips:
            why = "headless: not proxied (as kube-proxy)"
        else:
            why = f"claimed by service-proxy-name {service.proxy_name}: not proxied"
        out.append((f"{namespace}/{name}", why))
    return tuple(out)


def _ip_key(ip: str) -> tuple[int, int]:
    address = ipaddress.ip_address(ip)
    return (address.version, int(address))


def backend_pod(
    plan: LabPlan, client: LabPod | LabOutside, ip: str, protocol: str, port: int
) -> tuple[LabPod | None, str]:
    """The lab pod that answers client at ip:port/protocol, or (None, why it cannot). The
    outside client's requests are forwarded by its entry node."""
    pod = plan.pod_at(ip)
    if pod is None:
        return None, plan.unreachable_reasons().get(ip, "no pod in the lab")
    if not pod.serves(protocol, port):
        return None, f"{pod.full_name} serves no {port}/{protocol} in the lab"
    from_node = client.node if isinstance(client, LabPod) else client.entry_node
    if pod.node != from_node:
        family_attr = "ipv6" if ":" in ip else "ipv4"
        for node in (plan.node(from_node), plan.node(pod.node)):
            if getattr(node, family_attr) is None:
                family = IPV6 if ":" in ip else IPV4
                return None, f"node {node.name} has no {family} address on the node network"
    return pod, ""
