"""NodeStates of N ClusterIP Services built directly, without the compiler: the eBPF
benchmarks' synthetic address plan (PB-1, PB-2, PB-4, the metrics bench)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence

from agent.model.nodestate import (
    CLUSTER_IP,
    LOAD_BALANCER,
    NODE_PORT,
    Backend,
    Frontend,
    NodeInfo,
    NodeState,
    ServiceEntry,
    revision_of,
)

from .workload import ipv4

# Synthetic address plan (no address is configured on an interface for PB-1 and maps.py;
# connect.py routes only the target Service's backend, inside its lab):
#   Service i      ClusterIP 10.96.0.10 + i (10.96.0.0/12), TCP port 80 → 8080
#   its backends   10.128.0.1 + i x E + j (10.128.0.0/9), port 8080, on node "node-b"
#   client         10.244.0.2, source ports from 1024 up
#   not a Service  10.244.9.9:80
# With external frontends (PB-1's XDP part; `external=True`):
#   Service i      also LoadBalancer VIP 198.18.0.0 + i, port 80 (198.18.0.0/15, RFC 2544's
#                  benchmarking range: 131,072 VIPs, one per Service up to 100k and beyond),
#                  and, for i < 2768 only, NodePort 192.0.2.10:30000 + i: a node has
#                  one port per NodePort Service in 30000-32767, so like a real cluster
#                  only 2768 Services can have one (i % 2768 would collide)
#   node address   192.0.2.10 (NodeInfo; kbp_config's SNAT source), SNAT ports 61000-65535
#   local Service  one more Service, index N, whose backends are on this node ("node-a")
#   outside client 203.0.113.7, source ports from 1024 up
#   not a Service  192.0.2.10:22 (the node's own SSH port)
#   next hop       198.51.100.1 (02:00:00:00:00:01) on a veth link in the bench
#                  namespace, the route to 10.128.0.0/9 and 203.0.113.0/24
CLUSTER_IP_BASE = int(ipaddress.IPv4Address("10.96.0.10"))
BACKEND_BASE = int(ipaddress.IPv4Address("10.128.0.1"))
FRONTEND_PORT, BACKEND_PORT = 80, 8080
CLIENT = "10.244.0.2"
NOT_A_SERVICE = "10.244.9.9"
NODE_ADDRESS = "192.0.2.10"
LB_VIP_BASE = int(ipaddress.IPv4Address("198.18.0.0"))
NODE_PORT_BASE, NODE_PORTS = 30000, 2768  # the default NodePort range, 30000-32767
EXTERNAL_CLIENT = "203.0.113.7"
NODE_OWN_PORT = 22


def cluster_ip_of(i: int) -> str:
    return ipv4(CLUSTER_IP_BASE + i)


def backend_ip_of(i: int, j: int, endpoints: int) -> str:
    return ipv4(BACKEND_BASE + i * endpoints + j)


def lb_vip_of(i: int) -> str:
    return ipv4(LB_VIP_BASE + i)


def external_frontends(i: int) -> tuple[Frontend, ...]:
    """Service i's LoadBalancer VIP, and its NodePort when i < NODE_PORTS."""
    vip = (Frontend(LOAD_BALANCER, lb_vip_of(i), FRONTEND_PORT),)
    if i >= NODE_PORTS:
        return vip
    return (Frontend(NODE_PORT, NODE_ADDRESS, NODE_PORT_BASE + i), *vip)


def service_entry(
    name: str,
    cluster_ip: str,
    backends: Sequence[tuple[str, int]],
    *,
    local: bool = False,
    external: Sequence[Frontend] = (),
) -> ServiceEntry:
    """A ClusterIP entry (TCP 80) with ready backends, as compile() would emit it, plus the
    `external` frontends (NodePort, LoadBalancer) given."""
    members = tuple(
        Backend(ip, port, "node-a" if local else "node-b", None, None, local, True, True, False)
        for ip, port in backends
    )
    return ServiceEntry(
        namespace="bench",
        name=name,
        port="http",
        protocol="TCP",
        ip_family="IPv4",
        frontends=(Frontend(CLUSTER_IP, cluster_ip, FRONTEND_PORT), *external),
        affinity_timeout=None,
        internal_traffic_policy="Cluster",
        external_traffic_policy="Cluster",
        health_check_node_port=None,
        topology="None",
        has_endpoints=True,
        cluster_backends=members,
        local_backends=None,
    ).sealed()


def synthetic_entries(
    count: int, endpoints: int, first: int = 0, *, external: bool = False
) -> list[ServiceEntry]:
    """Services first..first+count-1 (named svc-NNNNNN, so they sort in index order), with
    external frontends (see the address plan) when `external`."""
    return [
        service_entry(
            f"svc-{i:06d}",
            cluster_ip_of(i),
            [(backend_ip_of(i, j, endpoints), BACKEND_PORT) for j in range(endpoints)],
            external=external_frontends(i) if external else (),
        )
        for i in range(first, first + count)
    ]


def local_entry(i: int, endpoints: int) -> ServiceEntry:
    """Service i with external frontends and every backend on this node."""
    return service_entry(
        f"svc-{i:06d}-local",
        cluster_ip_of(i),
        [(backend_ip_of(i, j, endpoints), BACKEND_PORT) for j in range(endpoints)],
        local=True,
        external=external_frontends(i),
    )


def nodestate_of(entries: Iterable[ServiceEntry]) -> NodeState:
    ordered = tuple(sorted(entries, key=lambda e: e.sort_key))
    node = NodeInfo("node-a", None, {}, (NODE_ADDRESS,))
    return NodeState(node, revision_of(e.digest for e in ordered), ordered)
