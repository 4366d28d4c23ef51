"""Builders for Kubernetes objects as the API serves them (plain dicts), with mutators.

Address plan used across the unit tests:

    this node     node-a  zone-1  rack r1   192.0.2.10, 2001:db8::10
    other nodes   node-b  zone-1  rack r2   192.0.2.11
                  node-c  zone-2  rack r1   192.0.2.12
    pods          10.244.<node>.<n>  (node-a 1, node-b 2, node-c 3); fd00:244:<node>::<n>
    ClusterIPs    10.96.0.0/16, fd00:96::/112
    external      203.0.113.0/24 (ExternalIPs, LoadBalancer VIPs)
    remote pods   10.245.0.0/16 (cluster member2)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.model.decode import decode_object
from agent.model.types import ClusterState

Obj = dict[str, Any]
Mutator = Callable[[Obj], None] | None

NODE = "node-a"


def make_service(namespace: str = "default", name: str = "svc", mutate: Mutator = None) -> Obj:
    """A ClusterIP Service 10.96.0.1 with one TCP port "http" 80 → 8080."""
    obj: Obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": namespace, "name": name},
        "spec": {
            "type": "ClusterIP",
            "clusterIP": "10.96.0.1",
            "clusterIPs": ["10.96.0.1"],
            "ports": [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}],
        },
    }
    if mutate:
        mutate(obj)
    return obj


def make_endpoint(
    ip: str,
    node: str | None = None,
    *,
    ready: bool | None = True,
    serving: bool | None = None,
    terminating: bool | None = None,
    zone: str | None = None,
    zone_hints: list[str] | None = None,
    node_hints: list[str] | None = None,
) -> Obj:
    endpoint: Obj = {"addresses": [ip], "conditions": {}}
    for key, value in (("ready", ready), ("serving", serving), ("terminating", terminating)):
        if value is not None:
            endpoint["conditions"][key] = value
    if node:
        endpoint["nodeName"] = node
    if zone:
        endpoint["zone"] = zone
    hints: Obj = {}
    if zone_hints is not None:
        hints["forZones"] = [{"name": z} for z in zone_hints]
    if node_hints is not None:
        hints["forNodes"] = [{"name": n} for n in node_hints]
    if hints:
        endpoint["hints"] = hints
    return endpoint


def make_slice(
    namespace: str = "default",
    name: str = "svc-1",
    service: str = "svc",
    endpoints: list[Obj] | None = None,
    mutate: Mutator = None,
    *,
    port: int = 8080,
    port_name: str = "http",
    family: str = "IPv4",
) -> Obj:
    """An EndpointSlice of `service` with one TCP port `port_name` → `port`."""
    obj: Obj = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": namespace,
            "name": name,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": family,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        "endpoints": endpoints if endpoints is not None else [],
    }
    if mutate:
        mutate(obj)
    return obj


# Pod n of a node is 10.244.<index>.<n> and fd00:244:<index>::<n> (the plan above).
NODE_INDEX = {"node-a": 1, "node-b": 2, "node-c": 3}


def ep(n: int, node: str = "node-b", **conditions: bool) -> Obj:
    """Pod n of `node` as an endpoint, ready unless conditions say otherwise."""
    return make_endpoint(f"10.244.{NODE_INDEX[node]}.{n}", node, **conditions)


def ep6(n: int, node: str = "node-b") -> Obj:
    """Pod n of `node` as an IPv6 endpoint."""
    return make_endpoint(f"fd00:244:{NODE_INDEX[node]}::{n}", node)


def spec(**fields: object) -> Callable[[Obj], None]:
    """A mutator that sets `fields` in an object's spec."""
    return lambda obj: obj["spec"].update(fields)


def both(*mutators: Callable[[Obj], None]) -> Callable[[Obj], None]:
    """A mutator that applies `mutators` in turn."""

    def mutate(obj: Obj) -> None:
        for m in mutators:
            m(obj)

    return mutate


def make_node(name: str = NODE, labels: dict[str, str] | None = None, *ips: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": dict(labels or {})},
        "status": {"addresses": [{"type": "InternalIP", "address": ip} for ip in ips]},
    }


def default_nodes() -> list[Obj]:
    return [
        make_node(
            "node-a",
            {"topology.kubernetes.io/zone": "zone-1", "example.com/rack": "r1"},
            "192.0.2.10",
            "2001:db8::10",
        ),
        make_node(
            "node-b",
            {"topology.kubernetes.io/zone": "zone-1", "example.com/rack": "r2"},
            "192.0.2.11",
        ),
        make_node(
            "node-c",
            {"topology.kubernetes.io/zone": "zone-2", "example.com/rack": "r1"},
            "192.0.2.12",
        ),
    ]


def state_of(*objects: Obj) -> ClusterState:
    """Decode objects into a ClusterState; a malformed object fails the test."""
    state = ClusterState()
    for obj in objects:
        decoded = decode_object(obj)
        assert decoded.error is None, f"{decoded.ref}: {decoded.error}"
        if decoded.value is None:
            continue
        setter = {
            "Service": state.set_service,
            "EndpointSlice": state.set_slice,
            "Node": state.set_node,
        }
        setter[decoded.kind](decoded.value)  # type: ignore[operator]
    return state


def write_kubeconfig(path: Path, server: str) -> str:
    """A kubeconfig at `path` for the API server `server` with a bearer token (TLS not
    verified); its path."""
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}',\n"
        "  insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: secret}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    return str(path)
