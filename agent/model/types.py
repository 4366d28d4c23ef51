"""The model's plain, immutable view of the Kubernetes objects the compiler reads.

Objects are decoded once (see `decode`) into these frozen values; the compiler and
everything after it never touch Kubernetes dicts or client classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

ServiceKey = tuple[str, str]  # (namespace, name)

NO_HINTS: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class ServicePort:
    name: str  # "" when unnamed
    protocol: str  # TCP | UDP | SCTP
    port: int  # the Service port, 1..65535
    node_port: int  # 0 when none was allocated


@dataclass(frozen=True, slots=True)
class Service:
    namespace: str
    name: str
    type: str  # ClusterIP | NodePort | LoadBalancer | ExternalName
    cluster_ips: tuple[str, ...]  # canonical; empty for headless or unallocated Services
    ports: tuple[ServicePort, ...] = ()
    external_ips: tuple[str, ...] = ()
    load_balancer_ips: tuple[str, ...] = ()  # status ingress IPs in VIP mode only
    load_balancer_source_ranges: tuple[str, ...] = ()  # normalised CIDRs
    affinity_timeout: int | None = None  # ClientIP affinity in seconds; None = no affinity
    external_traffic_policy: str = "Cluster"
    internal_traffic_policy: str = "Cluster"
    health_check_node_port: int = 0
    proxy_name: str | None = None  # value of service.kubernetes.io/service-proxy-name
    topology_keys: tuple[str, ...] = ()  # kube-bpf-proxy.io/topology-keys, in order
    multi_cluster: str = "RemoteAndLocal"  # or LocalFirst
    lb_algorithm: str = "hash"  # kube-bpf-proxy.io/lb-algorithm: hash | maglev | random

    @property
    def key(self) -> ServiceKey:
        return (self.namespace, self.name)


@dataclass(frozen=True, slots=True)
class Endpoint:
    ip: str  # canonical; the first of the endpoint's addresses
    ready: bool
    serving: bool
    terminating: bool
    node_name: str | None = None
    zone: str | None = None
    zone_hints: frozenset[str] = NO_HINTS
    node_hints: frozenset[str] = NO_HINTS


@dataclass(frozen=True, slots=True)
class SlicePort:
    name: str
    protocol: str
    port: int  # target port on the endpoints


@dataclass(frozen=True, slots=True)
class EndpointSlice:
    namespace: str
    name: str
    service_name: str  # from kubernetes.io/service-name
    family: str  # IPv4 | IPv6 (FQDN slices are not decoded)
    ports: tuple[SlicePort, ...]
    endpoints: tuple[Endpoint, ...]
    # Multi-cluster markers, interpreted by the compiler (docs/semantics.md).
    provision_cluster: str | None = None  # endpointslice.karmada.io/provision-cluster
    source_cluster: str | None = None  # multicluster.kubernetes.io/source-cluster
    managed_by: str | None = None  # endpointslice.kubernetes.io/managed-by
    # endpoints.kubernetes.io/last-change-trigger-time as Unix time: when the change this
    # slice carries happened (for kubeproxy_network_programming_duration_seconds). Not
    # compared: a slice differing only here is the same slice.
    trigger_time: float | None = field(default=None, compare=False)

    @property
    def service_key(self) -> ServiceKey:
        return (self.namespace, self.service_name)


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    # InternalIPs then ExternalIPs, canonical, without duplicates.
    addresses: tuple[str, ...] = ()
    # False while the Node is being deleted or drained by the cluster autoscaler
    # (kube-proxy's nodeEligible: /healthz turns 503 so load balancers move away).
    eligible: bool = True


class ClusterState:
    """Everything the sources know, indexed for the compiler, with change tracking.

    Setters compare the previous value with the new one and record only real changes
    (kube-proxy's change trackers); `take_changes` hands them to an incremental compiler.
    """

    def __init__(self) -> None:
        self.services: dict[ServiceKey, Service] = {}
        self.slices: dict[tuple[str, str], EndpointSlice] = {}
        self.slices_by_service: dict[ServiceKey, dict[str, EndpointSlice]] = {}
        self.nodes: dict[str, Node] = {}
        self._changed_services: set[ServiceKey] = set()
        self._changed_nodes: set[str] = set()

    # --- Services -------------------------------------------------------------
    def set_service(self, service: Service) -> bool:
        key = service.key
        if self.services.get(key) == service:
            return False
        self.services[key] = service
        self._changed_services.add(key)
        return True

    def delete_service(self, namespace: str, name: str) -> bool:
        if self.services.pop((namespace, name), None) is None:
            return False
        self._changed_services.add((namespace, name))
        return True

    # --- EndpointSlices -------------------------------------------------------
    def set_slice(self, endpoint_slice: EndpointSlice) -> bool:
        key = (endpoint_slice.namespace, endpoint_slice.name)
        previous = self.slices.get(key)
        if previous == endpoint_slice:
            return False
        if previous is not None and previous.service_key != endpoint_slice.service_key:
            self._unindex(previous)
        self.slices[key] = endpoint_slice
        self.slices_by_service.setdefault(endpoint_slice.service_key, {})[endpoint_slice.name] = (
            endpoint_slice
        )
        self._changed_services.add(endpoint_slice.service_key)
        return True

    def delete_slice(self, namespace: str, name: str) -> bool:
        previous = self.slices.pop((namespace, name), None)
        if previous is None:
            return False
        self._unindex(previous)
        return True

    def _unindex(self, endpoint_slice: EndpointSlice) -> None:
        key = endpoint_slice.service_key
        by_name = self.slices_by_service.get(key)
        if by_name is not None:
            by_name.pop(endpoint_slice.name, None)
            if not by_name:
                del self.slices_by_service[key]
        self._changed_services.add(key)

    # --- Nodes ----------------------------------------------------------------
    def set_node(self, node: Node) -> bool:
        if self.nodes.get(node.name) == node:
            return False
        self.nodes[node.name] = node
        self._changed_nodes.add(node.name)
        return True

    def delete_node(self, name: str) -> bool:
        if self.nodes.pop(name, None) is None:
            return False
        self._changed_nodes.add(name)
        return True

    # --- change tracking ------------------------------------------------------
    def take_changes(self) -> tuple[set[ServiceKey], set[str]]:
        """Return and forget the (Service keys, node names) changed since the last call."""
        services, nodes = self._changed_services, self._changed_nodes
        self._changed_services, self._changed_nodes = set(), set()
        return services, nodes
