"""Synthetic clusters the benchmarks measure with: API-server-shaped Services and
EndpointSlices (Generator, as `kubectl get -o json` shows them), and a generated cluster
as a JSON List with a stream of changes to it (as the watch delivers them)."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.dataplane.ebpf.maps import MapSizes
from agent.model.types import ClusterState, EndpointSlice, Service

Obj = dict[str, Any]
THIS_NODE = "node-000"
ZONES = ("zone-a", "zone-b", "zone-c")
LWS_GROUP_SIZE = 4  # endpoints per headless per-replica Service (leader + 3 workers)
SLICE_MAX = 100  # the EndpointSlice controller's default maxEndpointsPerSlice


@dataclass(frozen=True)
class Workload:
    services: int  # ClusterIP/NodePort/LoadBalancer Services, one EndpointSlice per 100 eps
    endpoints: int  # endpoints per Service
    headless: int  # LWS-style headless per-replica Services, LWS_GROUP_SIZE endpoints each
    nodes: int = 100
    seed: int = 1

    @property
    def label(self) -> str:
        return f"{self.services} x {self.endpoints} (+{self.headless} headless)"

    @property
    def total_endpoints(self) -> int:
        """Endpoints the compiler sees (headless slices are skipped at decode)."""
        return self.services * self.endpoints


def ipv4(value: int) -> str:
    return f"{value >> 24 & 255}.{value >> 16 & 255}.{value >> 8 & 255}.{value & 255}"


class Generator:
    """Deterministic, API-server-shaped objects (as `kubectl get -o json` shows them).

    Address plan: ClusterIPs 10.96.0.0/12 (Service i → 10.96.0.10 + i); pods of node k in
    10.128.0.0/9 at k x 2^14 (a /18 each); node k's InternalIP 192.168.k/256.k%256;
    LoadBalancer VIPs 172.16.0.0/12. Node k is node-NNN in zone ZONES[k % 3].
    """

    def __init__(self, workload: Workload) -> None:
        self.w = workload
        self.rng = random.Random(workload.seed)
        self.pods_on_node = [0] * workload.nodes
        self.resource_version = 100_000

    def _uid(self) -> str:
        return str(uuid.UUID(int=self.rng.getrandbits(128), version=4))

    def _suffix(self) -> str:
        return "".join(self.rng.choices("bcdfghjklmnpqrstvwxz2456789", k=5))

    def _meta(self, namespace: str | None, name: str, **extra: Any) -> Obj:
        self.resource_version += 1
        meta: Obj = {"name": name}
        if namespace is not None:
            meta["namespace"] = namespace
        meta.update(
            uid=self._uid(),
            resourceVersion=str(self.resource_version),
            creationTimestamp="2025-01-15T10:00:00Z",
        )
        meta.update(extra)
        return meta

    def _pod_ip(self, node: int) -> str:
        n = self.pods_on_node[node] = self.pods_on_node[node] + 1
        return ipv4((10 << 24) + (128 << 16) + node * (1 << 14) + n % (1 << 14))

    def node(self, k: int) -> Obj:
        name = f"node-{k:03d}"
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": self._meta(
                None,
                name,
                labels={
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "node.kubernetes.io/instance-type": "m6i.4xlarge",
                    "topology.kubernetes.io/region": "region-1",
                    "topology.kubernetes.io/zone": ZONES[k % len(ZONES)],
                    "example.com/rack": f"rack-{k // 10:02d}",
                },
            ),
            "spec": {"podCIDR": f"10.{128 + k // 4}.{k % 4 * 64}.0/18"},
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": f"192.168.{k // 256}.{k % 256 + 1}"},
                    {"type": "Hostname", "address": name},
                ]
            },
        }

    def _endpoint(self, namespace: str, pod: str, hints: bool) -> Obj:
        node = self.rng.randrange(self.w.nodes)
        roll = self.rng.random()
        if roll < 0.95:
            ready, serving, terminating = True, True, False
        elif roll < 0.98:
            ready, serving, terminating = False, False, False  # starting or failing probe
        else:
            ready, serving, terminating = False, True, True  # rolling update in progress
        zone = ZONES[node % len(ZONES)]
        endpoint: Obj = {
            "addresses": [self._pod_ip(node)],
            "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
            "nodeName": f"node-{node:03d}",
            "targetRef": {"kind": "Pod", "namespace": namespace, "name": pod, "uid": self._uid()},
            "zone": zone,
        }
        if hints and ready:
            endpoint["hints"] = {"forZones": [{"name": zone}]}
        return endpoint

    def service(self, i: int, namespace: str | None = None) -> list[Obj]:
        """Service i and its EndpointSlices. About 5 % NodePort, 2 % LoadBalancer (half
        with externalTrafficPolicy Local), 10 % with a second port, 10 % with topology
        hints, 4 % with ClientIP affinity; 95 % of endpoints ready, 3 % not ready, 2 %
        serving-terminating."""
        namespace = namespace or f"team-{i % 50:02d}"
        name = f"svc-{i:05d}"
        cluster_ip = ipv4((10 << 24) + (96 << 16) + 10 + i)
        ports = [{"name": "http", "port": 80, "protocol": "TCP", "targetPort": 8080}]
        slice_ports = [{"name": "http", "port": 8080, "protocol": "TCP"}]
        if i % 10 == 3:
            ports.append({"name": "metrics", "port": 9090, "protocol": "TCP", "targetPort": 9090})
            slice_ports.append({"name": "metrics", "port": 9090, "protocol": "TCP"})
        spec: Obj = {
            "clusterIP": cluster_ip,
            "clusterIPs": [cluster_ip],
            "internalTrafficPolicy": "Cluster",
            "ipFamilies": ["IPv4"],
            "ipFamilyPolicy": "SingleStack",
            "ports": ports,
            "selector": {"app.kubernetes.io/name": name},
            "sessionAffinity": "None",
            "type": "ClusterIP",
        }
        status: Obj = {"loadBalancer": {}}
        if i % 20 == 0 or i % 50 == 1:
            spec["type"] = "NodePort" if i % 20 == 0 else "LoadBalancer"
            spec["externalTrafficPolicy"] = "Cluster"
            for j, port in enumerate(ports):
                port["nodePort"] = 30000 + (i * 2 + j) % 2768
            if spec["type"] == "LoadBalancer":
                status = {"loadBalancer": {"ingress": [{"ip": ipv4((172 << 24) + (16 << 16) + i)}]}}
                if i % 100 == 1:
                    spec["externalTrafficPolicy"] = "Local"
                    spec["healthCheckNodePort"] = 32000 + i % 700
        if i % 25 == 7:
            spec["sessionAffinity"] = "ClientIP"
            spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 10800}}
        hints = i % 10 == 5
        annotations = {"service.kubernetes.io/topology-mode": "Auto"} if hints else {}
        service: Obj = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self._meta(
                namespace,
                name,
                labels={"app.kubernetes.io/name": name, "app.kubernetes.io/part-of": "shop"},
                annotations=annotations,
            ),
            "spec": spec,
            "status": status,
        }
        service_uid = service["metadata"]["uid"]
        out = [service]
        pod_hash = self._suffix()
        for first in range(0, self.w.endpoints, SLICE_MAX):
            count = min(SLICE_MAX, self.w.endpoints - first)
            endpoints = [
                self._endpoint(namespace, f"{name}-{pod_hash}-{first + j}", hints)
                for j in range(count)
            ]
            out.append(
                {
                    "apiVersion": "discovery.k8s.io/v1",
                    "kind": "EndpointSlice",
                    "metadata": self._meta(
                        namespace,
                        f"{name}-{self._suffix()}",
                        generateName=f"{name}-",
                        labels={
                            "app.kubernetes.io/name": name,
                            "endpointslice.kubernetes.io/managed-by": (
                                "endpointslice-controller.k8s.io"
                            ),
                            "kubernetes.io/service-name": name,
                        },
                        annotations={
                            "endpoints.kubernetes.io/last-change-trigger-time": (
                                "2025-01-15T10:00:00Z"
                            )
                        },
                        ownerReferences=[
                            {
                                "apiVersion": "v1",
                                "blockOwnerDeletion": True,
                                "controller": True,
                                "kind": "Service",
                                "name": name,
                                "uid": service_uid,
                            }
                        ],
                    ),
                    "addressType": "IPv4",
                    "endpoints": endpoints,
                    "ports": slice_ports,
                }
            )
        return out

    def headless(self, r: int) -> list[Obj]:
        """LWS replica r of LeaderWorkerSet llm-<r // 100> (subdomainPolicy
        UniquePerReplica): a headless Service and its slice labelled headless."""
        lws = f"llm-{r // 100:03d}"
        name = f"{lws}-{r % 100}"
        namespace = f"inference-{r % 10}"
        labels = {"leaderworkerset.sigs.k8s.io/name": lws}
        service: Obj = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": self._meta(namespace, name, labels=labels),
            "spec": {
                "clusterIP": "None",
                "clusterIPs": ["None"],
                "internalTrafficPolicy": "Cluster",
                "ipFamilies": ["IPv4"],
                "ipFamilyPolicy": "SingleStack",
                "publishNotReadyAddresses": True,
                "selector": {
                    "leaderworkerset.sigs.k8s.io/name": lws,
                    "leaderworkerset.sigs.k8s.io/group-index": str(r % 100),
                },
                "sessionAffinity": "None",
                "type": "ClusterIP",
            },
            "status": {"loadBalancer": {}},
        }
        endpoints = []
        for w in range(LWS_GROUP_SIZE):
            endpoint = self._endpoint(namespace, f"{name}-{w}" if w else name, hints=False)
            endpoint["hostname"] = f"{name}-{w}" if w else name
            endpoints.append(endpoint)
        endpoint_slice: Obj = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": self._meta(
                namespace,
                f"{name}-{self._suffix()}",
                generateName=f"{name}-",
                labels={
                    **labels,
                    "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                    "kubernetes.io/service-name": name,
                    "service.kubernetes.io/headless": "",
                },
            ),
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": None,
        }
        return [service, endpoint_slice]

    def items(self, headless: bool = True) -> list[Obj]:
        items = [self.node(k) for k in range(self.w.nodes)]
        for i in range(self.w.services):
            items += self.service(i)
        if headless:
            for r in range(self.w.headless):
                items += self.headless(r)
        return items


ENDPOINTS = 10


def map_sizes_for_generated(services: int) -> MapSizes:
    """Maps for `generate`'s cluster of up to `services` Services (powers of two):
    ~1.1 entries per Service (10 % have a second port), 1-2 frontends each, a set per
    entry and one more for Local policies."""
    return MapSizes(
        services=max(4096, 1 << (int(services * 2.6) - 1).bit_length()),
        slots=max(16384, 1 << (int(services * ENDPOINTS * 2.4) - 1).bit_length()),
        backends=max(16384, 1 << (int(services * ENDPOINTS * 2.4) - 1).bit_length()),
        ct=4096,
        affinity=1024,
    )


@dataclass
class Cluster:
    workload: Workload
    path: Path
    items: list[Obj]
    json_bytes: int
    next_node_port: int  # the first nodePort no generated Service uses


def unique_node_ports(items: list[Obj], next_port: int = 30000) -> int:
    """Give every nodePort its own number, as the API server's allocator does: the
    generator's `30000 + (2i + j) % 2768` repeats past ~1.4k NodePort Services (from 10k
    Services on), and two entries wanting one frontend send every change of theirs down
    the dataplane's full (not incremental) plan, which no real cluster would see.
    Returns the next free port."""
    for obj in items:
        if obj["kind"] != "Service":
            continue
        for port in obj["spec"]["ports"]:
            if "nodePort" in port:
                if next_port > 32767:
                    raise ValueError("more nodePorts than the default range 30000-32767")
                port["nodePort"] = next_port
                next_port += 1
    return next_port


def generate(services: int, directory: Path) -> Cluster:
    workload = Workload(services=services, endpoints=ENDPOINTS, headless=0)
    items = Generator(workload).items()
    next_node_port = unique_node_ports(items)
    path = directory / f"cluster-{services}.json"
    with path.open("w") as out:
        json.dump({"apiVersion": "v1", "kind": "List", "items": items}, out, separators=(",", ":"))
    return Cluster(workload, path, items, path.stat().st_size, next_node_port)


@dataclass
class Change:
    kind: str
    texts: list[str]  # the events' objects as JSON (what the watch delivers)
    apply_to_state: Callable[[ClusterState, list[Any]], None]


def slices_of(items: list[Obj]) -> dict[str, list[Obj]]:
    out: dict[str, list[Obj]] = {}
    for obj in items:
        if obj["kind"] == "EndpointSlice":
            out.setdefault(obj["metadata"]["labels"]["kubernetes.io/service-name"], []).append(obj)
    return out


def set_objects(state: ClusterState, values: list[Any]) -> None:
    for value in values:
        if isinstance(value, Service):
            state.set_service(value)
        elif isinstance(value, EndpointSlice):
            state.set_slice(value)


def delete_objects(state: ClusterState, values: list[Any]) -> None:
    for value in values:
        if isinstance(value, EndpointSlice):
            state.delete_slice(value.namespace, value.name)
    for value in values:
        if isinstance(value, Service):
            state.delete_service(value.namespace, value.name)


def make_changes(cluster: Cluster, per_kind: int) -> Iterator[Change]:
    """Changes in turn by kind; each built from the generated objects as the watch would
    deliver them. Readiness flips and added endpoints hit distinct Services."""
    items = copy.deepcopy(cluster.items)  # keep the generator's copy for later sizes
    by_service = slices_of(items)
    names = sorted(by_service)
    step = max(1, len(names) // (2 * per_kind + 1))
    picks = iter(names[::step])
    generator = Generator(dataclasses.replace(cluster.workload, seed=cluster.workload.seed + 7))
    added: list[list[Obj]] = []
    node_port = cluster.next_node_port
    for k in range(per_kind):
        endpoint_slice = by_service[next(picks)][0]
        for endpoint in endpoint_slice["endpoints"]:
            if endpoint["conditions"]["ready"]:
                endpoint["conditions"] = {"ready": False, "serving": False, "terminating": False}
                break
        yield Change("not_ready", [json.dumps(endpoint_slice)], set_objects)

        endpoint_slice = by_service[next(picks)][0]
        extra = copy.deepcopy(endpoint_slice["endpoints"][0])
        extra["addresses"] = [f"10.200.{k // 250}.{k % 250 + 1}"]
        extra["conditions"] = {"ready": True, "serving": True, "terminating": False}
        extra["targetRef"]["name"] += "-added"
        extra.pop("hints", None)
        endpoint_slice["endpoints"].append(extra)
        yield Change("endpoint_added", [json.dumps(endpoint_slice)], set_objects)

        objects = generator.service(cluster.workload.services + k, namespace="bench-added")
        node_port = unique_node_ports(objects, node_port)
        added.append(objects)
        yield Change("service_added", [json.dumps(o) for o in objects], set_objects)
        yield Change("service_deleted", [json.dumps(o) for o in added.pop(0)], delete_objects)
