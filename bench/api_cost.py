"""PB-12: what one agent costs the API server in a cluster of thousands of nodes (issue 20).

A simulated cluster (default 5,000 Nodes of 10-20 KB with their image lists, whose status
is updated once per node per 5 minutes; 10,000 Services x 10 endpoints plus LWS-style
headless Services and Services claimed by another proxy; the usual churn of slices and
Services), served by a small API server of our own in a child process. Time is
compressed (`--compression`, 10 by default: a node's 5-minute status period takes 30 s).

Three clients run side by side against it, each in its own process, all as node-000:

* `kube-proxy`: kube-proxy's watch set done by a plain client: Services and
  EndpointSlices with `!service.kubernetes.io/service-proxy-name,
  !service.kubernetes.io/headless`, its own Node by `fieldSelector=metadata.name`; paged
  lists, bookmarks, each event decoded with json.loads into a cache (an informer's work;
  kube-proxy itself asks for protobuf, which this server does not speak);
* `agent`: this checkout's KubernetesSource + StateStore + SyncLoop (dataplane `none`);
* `main`: the same, with the `agent/` package of `--baseline` (default: the merge base
  with `main`), which watches every Node in full.

Phase A runs without topology keys; phase B adds `kube-bpf-proxy.io/topology-keys:
example.com/rack` to `--keyed` Services (racks of 40 nodes). Per client and phase: bytes
and events received per simulated minute by resource (counted by the server: response
bodies, without HTTP headers and chunk framing), CPU seconds per simulated minute and
RSS (from the client), and the targets: phase A bytes <= 1.1 x kube-proxy's; phase B
the agent's Node traffic (its own Node + node labels) <= 1/20 of main's.

Why not kmock: it ignores label and field selectors, resourceVersion and the Accept
header (every client would receive everything, in full), answers every watch with all
objects first, and scans every object on each write (13 ms per PATCH at 10k objects,
while this run writes about 170 Nodes per second). The server here keeps each object's
JSON, serializes an event once for every watch, and honours what the clients ask.

    .venv/bin/python bench/api_cost.py [--quick] [--nodes N] [--services N] [--phase S]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import hashlib
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(ROOT))
# The `main` client runs the baseline's agent/: its directory goes first. (Nothing here
# imports agent/ at module level, so the client picks the package it was given.)
AGENT_PATH = os.environ.get("KBP_BENCH_AGENT_PATH")
if AGENT_PATH:
    sys.path.insert(0, AGENT_PATH)
Obj = dict[str, Any]

THIS_NODE = "node-000"
RACK = "example.com/rack"
RACK_SIZE = 40
KEYS_ANNOTATION = "kube-bpf-proxy.io/topology-keys"
STATUS_PERIOD = 300.0  # seconds between a node's status updates (the kubelet's default)
SLICE_CHANGES = 10.0  # EndpointSlice updates per second in the whole cluster (uncompressed)
SERVICE_CHANGES = 0.5  # Service updates per second (uncompressed)
HISTORY = 4000  # watch events kept for resuming; older resourceVersions get 410
BOOKMARK_EVERY = 30.0  # seconds (real) between BOOKMARKs on a watch
TARGET_RATIO_NO_KEYS = 1.1  # bytes/min <= 1.1 x kube-proxy's without topology keys
TARGET_NODE_SHARE = 1 / 20  # with topology keys: Node traffic <= 1/20 of the full watch
ROLES = ("kube-proxy", "agent", "main")
IMAGES_MARK = "@images-of-pool-%d"
WRITES = "(writes)"  # the server's own row in its stats: the churn it made
PATHS = {
    "/api/v1/services": "services",
    "/apis/discovery.k8s.io/v1/endpointslices": "endpointslices",
    "/api/v1/nodes": "nodes",
}
KUBE_PROXY_SELECTOR = "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"


# --- the cluster -------------------------------------------------------------------------


def _hex(seed: str, n: int = 64) -> str:
    out = ""
    while len(out) < n:
        seed = hashlib.sha256(seed.encode()).hexdigest()
        out += seed
    return out[:n]


class Cluster:
    """Generated objects and their churn. Nodes share one image list per node pool
    (eight pools of 34-76 images), so 5,000 Node dicts fit in memory."""

    def __init__(self, nodes: int, services: int, endpoints: int, seed: int = 1) -> None:
        from bench.common.workload import Generator, Workload

        self.rng = random.Random(seed)
        headless = services // 10
        self.workload = Workload(services, endpoints, headless, nodes=nodes, seed=seed)
        self.generator = Generator(self.workload)
        self.images = [self._images(pool, 34 + pool * 6) for pool in range(8)]
        self.nodes = [self._node(k) for k in range(nodes)]
        self.services: list[Obj] = []
        self.slices: list[Obj] = []
        for i in range(services):
            service, *slices = self.generator.service(i)
            if i % 50 == 7:  # 2 % claimed by another proxy, as are their slices
                for obj in (service, *slices):
                    obj["metadata"].setdefault("labels", {})[
                        "service.kubernetes.io/service-proxy-name"
                    ] = "other-proxy"
            self.services.append(service)
            self.slices.extend(slices)
        for r in range(headless):
            service, endpoint_slice = self.generator.headless(r)
            self.services.append(service)
            self.slices.append(endpoint_slice)

    @staticmethod
    def _images(pool: int, count: int) -> list[Obj]:
        return [
            {
                "names": [
                    f"registry.example.com/pool-{pool}/team-{j % 17}/app-{j}@sha256:"
                    + _hex(f"{pool}/{j}"),
                    f"registry.example.com/pool-{pool}/team-{j % 17}/app-{j}:v1.{j % 9}.{j % 5}",
                ],
                "sizeBytes": 10_000_000 + 7_919_123 * j % 900_000_000,
            }
            for j in range(count)
        ]

    def _node(self, k: int) -> Obj:
        name = f"node-{k:03d}"
        pool = k % 8
        zone = f"zone-{k % 3}"
        uid = _hex(f"uid/{name}", 32)
        labels = {
            "beta.kubernetes.io/arch": "amd64",
            "beta.kubernetes.io/instance-type": "p5.48xlarge",
            "beta.kubernetes.io/os": "linux",
            "failure-domain.beta.kubernetes.io/region": "region-1",
            "failure-domain.beta.kubernetes.io/zone": zone,
            "kubernetes.io/arch": "amd64",
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "node.kubernetes.io/instance-type": "p5.48xlarge",
            "topology.kubernetes.io/region": "region-1",
            "topology.kubernetes.io/zone": zone,
            "example.com/node-pool": f"pool-{pool}",
            RACK: f"rack-{k // RACK_SIZE:03d}",
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        }
        fields = {
            "f:metadata": {
                "f:annotations": {".": {}, "f:node.alpha.kubernetes.io/ttl": {}},
                "f:labels": {f"f:{key}": {} for key in labels},
            }
        }
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": f"{uid[:8]}-{uid[8:12]}-{uid[12:16]}-{uid[16:20]}-{uid[20:]}",
                "resourceVersion": "1",
                "creationTimestamp": "2026-01-15T10:00:00Z",
                "labels": labels,
                "annotations": {
                    "node.alpha.kubernetes.io/ttl": "0",
                    "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                    "csi.volume.kubernetes.io/nodeid": json.dumps(
                        {"ebs.csi.aws.com": f"i-{uid[:17]}"}
                    ),
                },
                "managedFields": [
                    {
                        "manager": "kubelet",
                        "operation": "Update",
                        "apiVersion": "v1",
                        "time": "2026-01-15T10:00:00Z",
                        "fieldsType": "FieldsV1",
                        "fieldsV1": fields,
                    },
                    {
                        "manager": "kubelet",
                        "operation": "Update",
                        "apiVersion": "v1",
                        "time": "2026-01-15T10:00:00Z",
                        "fieldsType": "FieldsV1",
                        "subresource": "status",
                        "fieldsV1": {
                            "f:status": {"f:conditions": {}, "f:images": {}, "f:nodeInfo": {}}
                        },
                    },
                ],
            },
            "spec": {
                "podCIDR": f"10.{128 + k // 256}.{k % 256}.0/24",
                "podCIDRs": [f"10.{128 + k // 256}.{k % 256}.0/24"],
                "providerID": f"aws:///region-1{'abc'[k % 3]}/i-{uid[:17]}",
            },
            "status": {
                "capacity": {
                    "cpu": "192",
                    "memory": "2097152000Ki",
                    "pods": "110",
                    "nvidia.com/gpu": "8",
                    "ephemeral-storage": "3800000000Ki",
                },
                "allocatable": {
                    "cpu": "191450m",
                    "memory": "2062437376Ki",
                    "pods": "110",
                    "nvidia.com/gpu": "8",
                    "ephemeral-storage": "3502283250360",
                },
                "conditions": [
                    {
                        "type": kind,
                        "status": "True" if kind == "Ready" else "False",
                        "lastHeartbeatTime": "2026-01-15T10:00:00Z",
                        "lastTransitionTime": "2026-01-15T10:00:00Z",
                        "reason": f"Kubelet{'Ready' if kind == 'Ready' else 'Has' + kind}",
                        "message": f"kubelet reports {kind}",
                    }
                    for kind in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
                ],
                "addresses": [
                    {"type": "InternalIP", "address": f"192.168.{k // 250}.{k % 250 + 1}"},
                    {"type": "Hostname", "address": name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                "nodeInfo": {
                    "machineID": _hex(f"m/{name}", 32),
                    "systemUUID": _hex(f"s/{name}", 32),
                    "bootID": _hex(f"b/{name}", 32),
                    "kernelVersion": "6.8.0-1021-aws",
                    "osImage": "Ubuntu 24.04.1 LTS",
                    "containerRuntimeVersion": "containerd://1.7.24",
                    "kubeletVersion": "v1.31.4",
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
                "images": IMAGES_MARK % pool,  # the pool's list, spliced in as JSON
            },
        }

    def heartbeat(self, node: Obj, now: str) -> None:
        """A kubelet status report: heartbeat times and the managed-fields time move."""
        for condition in node["status"]["conditions"]:
            condition["lastHeartbeatTime"] = now
        node["metadata"]["managedFields"][1]["time"] = now

    def flip_endpoint(self, endpoint_slice: Obj) -> None:
        endpoints = endpoint_slice.get("endpoints") or []
        if endpoints:
            conditions = self.rng.choice(endpoints)["conditions"]
            conditions["ready"] = not conditions.get("ready", True)

    def touch_service(self, service: Obj, n: int) -> None:
        annotations = service["metadata"].setdefault("annotations", {})
        annotations["deployment.example.com/revision"] = str(n)


# --- the API server ----------------------------------------------------------------------


@dataclass
class Item:
    """One object as served: its selection fields and its JSON, full and metadata-only."""

    namespace: str | None
    name: str
    labels: dict[str, str]
    full: bytes
    meta: bytes


@dataclass
class Event:
    rv: int
    kind: str
    old: Item | None
    new: Item


@dataclass(eq=False)
class Watch:
    """An open watch. Events are written to its connection as they happen (the
    transport buffers them), and counted then."""

    role: str
    resource: str
    selected: Callable[[Item | None], bool]
    partial: bool
    writer: asyncio.StreamWriter
    stat: list[int]

    def send(self, data: bytes) -> None:
        if self.writer.transport.is_closing():
            return
        self.stat[0] += len(data)
        self.stat[1] += 1
        self.writer.write(b"%x\r\n%s\r\n" % (len(data), data))


def _item(obj: Obj, images: list[bytes]) -> Item:
    meta = obj["metadata"]
    full = json.dumps(obj, separators=(",", ":")).encode()
    status = obj.get("status")
    if isinstance(status, dict) and isinstance(status.get("images"), str):
        # A Node: its pool's image list, serialized once (the bulk of a Node's JSON).
        mark = json.dumps(status["images"]).encode()
        full = full.replace(mark, images[int(status["images"].rpartition("-")[2])], 1)
    return Item(
        meta.get("namespace"),
        meta["name"],
        dict(meta.get("labels") or {}),
        full,
        json.dumps(meta, separators=(",", ":")).encode(),
    )


def _partial(item: Item) -> bytes:
    return (
        b'{"apiVersion":"meta.k8s.io/v1","kind":"PartialObjectMetadata","metadata":'
        + item.meta
        + b"}"
    )


class Server:
    """The API server of this benchmark (see the module's docstring)."""

    def __init__(self, cluster: Cluster, compression: float) -> None:
        self.cluster = cluster
        self.compression = compression
        self.images = [json.dumps(i, separators=(",", ":")).encode() for i in cluster.images]
        self.rv = 1
        self.items: dict[str, dict[tuple[str | None, str], Item]] = {r: {} for r in PATHS.values()}
        self.order: dict[str, list[tuple[str | None, str]]] = {}
        self.history: collections.deque[tuple[str, Event]] = collections.deque(maxlen=HISTORY)
        self.watches: dict[str, set[Watch]] = {r: set() for r in PATHS.values()}
        # role → resource label → [bytes, events]
        self.stats: dict[str, dict[str, list[int]]] = collections.defaultdict(
            lambda: collections.defaultdict(lambda: [0, 0])
        )
        self.churn = False
        self.keyed = 0
        for resource_name, objects in (
            ("nodes", cluster.nodes),
            ("services", cluster.services),
            ("endpointslices", cluster.slices),
        ):
            for obj in objects:
                self._store(resource_name, obj)
            self.order[resource_name] = sorted(self.items[resource_name], key=str)

    def _store(self, resource_name: str, obj: Obj) -> tuple[Item | None, Item]:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        new = _item(obj, self.images)
        key = (new.namespace, new.name)
        old = self.items[resource_name].get(key)
        self.items[resource_name][key] = new
        return old, new

    def modify(self, resource_name: str, obj: Obj) -> None:
        old, new = self._store(resource_name, obj)
        event = Event(self.rv, "MODIFIED", old, new)
        self.history.append((resource_name, event))
        self.stats[WRITES][resource_name][1] += 1
        full = partial = None
        for watch in self.watches[resource_name]:
            data = self._event_bytes(watch, event)
            if data is None:
                continue
            if data == b"full":
                full = full or b'{"type":"MODIFIED","object":' + new.full + b"}\n"
                data = full
            elif data == b"partial":
                partial = partial or b'{"type":"MODIFIED","object":' + _partial(new) + b"}\n"
                data = partial
            watch.send(data)

    @staticmethod
    def _event_bytes(watch: Watch, event: Event) -> bytes | None:
        """What `watch` sees of `event`: b"full"/b"partial" for a MODIFIED (the shared
        bytes), an ADDED or DELETED line when the object enters or leaves its selection."""
        now, before = watch.selected(event.new), watch.selected(event.old)
        if now and before:
            return b"partial" if watch.partial else b"full"
        if not now and not before:
            return None
        kind = b"ADDED" if now else b"DELETED"
        body = _partial(event.new) if watch.partial else event.new.full
        return b'{"type":"' + kind + b'","object":' + body + b"}\n"

    # --- churn ----------------------------------------------------------------------------
    async def churn_loop(self) -> None:
        """Node status reports, slice and Service updates at their compressed rates."""
        cluster, c = self.cluster, self.compression
        rates = {
            "nodes": len(cluster.nodes) / STATUS_PERIOD * c,
            "endpointslices": SLICE_CHANGES * c,
            "services": SERVICE_CHANGES * c,
        }
        due = dict.fromkeys(rates, 0.0)
        next_node = 0
        touched = 0
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.02)
            # By the clock, not by the ticks: a loaded machine sleeps longer than asked.
            elapsed, last = time.monotonic() - last, time.monotonic()
            if not self.churn:
                continue
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            for resource_name, rate in rates.items():
                # A server that falls behind drops the backlog beyond a quarter second
                # (catching up would starve the clients' requests); the writes line says
                # what it made.
                due[resource_name] = min(due[resource_name] + rate * elapsed, rate / 4 + 1)
                while due[resource_name] >= 1:
                    due[resource_name] -= 1
                    if resource_name == "nodes":
                        node = cluster.nodes[next_node]
                        next_node = (next_node + 1) % len(cluster.nodes)
                        cluster.heartbeat(node, now)
                        self.modify("nodes", node)
                    elif resource_name == "endpointslices":
                        endpoint_slice = cluster.rng.choice(cluster.slices)
                        cluster.flip_endpoint(endpoint_slice)
                        self.modify("endpointslices", endpoint_slice)
                    else:
                        touched += 1
                        service = cluster.rng.choice(cluster.services)
                        cluster.touch_service(service, touched)
                        self.modify("services", service)

    def add_topology_keys(self, count: int) -> None:
        """Give `count` Services with a ClusterIP the rack key, one per rack first."""
        services = [s for s in self.cluster.services if s["spec"].get("clusterIP") != "None"]
        for service in services[self.keyed : self.keyed + count]:
            service["metadata"].setdefault("annotations", {})[KEYS_ANNOTATION] = RACK
            self.modify("services", service)
        self.keyed += count

    # --- HTTP -------------------------------------------------------------------------------
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                _method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = header.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                url = urllib.parse.urlsplit(target)
                params = dict(urllib.parse.parse_qsl(url.query))
                role = headers.get("user-agent", "").partition("kbp-bench/")[2] or "other"
                if url.path in PATHS and params.get("watch") in ("true", "1"):
                    await self._watch(writer, role, PATHS[url.path], params, headers)
                    return
                if url.path in PATHS:
                    body = self._list(role, PATHS[url.path], params, headers)
                elif url.path == "/version":
                    body = b'{"major":"1","minor":"31","gitVersion":"v1.31.4"}'
                elif url.path == "/bench/stats":
                    body = json.dumps(
                        {"rv": self.rv, "stats": self.stats, "watches": self._open_watches()}
                    ).encode()
                elif url.path == "/bench/churn":
                    self.churn = params.get("on") == "1"
                    body = b"{}"
                elif url.path == "/bench/keys":
                    self.add_topology_keys(int(params["count"]))
                    body = b"{}"
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                    + str(len(body)).encode()
                    + b"\r\n\r\n"
                    + body
                )
                await writer.drain()
        except (ConnectionError, ValueError):
            return
        finally:
            writer.close()

    def _open_watches(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = collections.defaultdict(list)
        for resource_name, watches in self.watches.items():
            for watch in watches:
                out[watch.role].append(resource_name + (" (metadata)" if watch.partial else ""))
        return out

    def _selection(self, params: Mapping[str, str]) -> Callable[[Item | None], bool]:
        from tests.api.emulator import field_matcher, label_matcher  # the tests' parsers

        labels = label_matcher(params.get("labelSelector"))
        fields = field_matcher(params.get("fieldSelector"))

        def selected(item: Item | None) -> bool:
            if item is None:
                return False
            meta = {"metadata": {"name": item.name, "namespace": item.namespace}}
            return fields(meta) and labels(item.labels)

        return selected

    @staticmethod
    def _label(resource_name: str, partial: bool) -> str:
        return "nodes-metadata" if partial else resource_name

    def _list(
        self, role: str, resource_name: str, params: Mapping[str, str], headers: Mapping[str, str]
    ) -> bytes:
        partial = "as=PartialObjectMetadataList" in headers.get("accept", "")
        selected = self._selection(params)
        order = self.order[resource_name]
        start = int(params.get("continue") or 0)
        limit = int(params.get("limit") or 0) or len(order)
        items, position = [], start
        while position < len(order) and len(items) < limit:
            item = self.items[resource_name][order[position]]
            position += 1
            if selected(item):
                items.append(_partial(item) if partial else item.full)
        token = str(position) if position < len(order) else ""
        kind = b"PartialObjectMetadataList" if partial else b"List"
        body = (
            b'{"kind":"'
            + kind
            + b'","apiVersion":"v1","metadata":{"resourceVersion":"'
            + str(self.rv).encode()
            + b'","continue":"'
            + token.encode()
            + b'"},"items":['
            + b",".join(items)
            + b"]}"
        )
        stat = self.stats[role][self._label(resource_name, partial)]
        stat[0] += len(body)
        stat[1] += len(items)
        return body

    async def _watch(
        self,
        writer: asyncio.StreamWriter,
        role: str,
        resource_name: str,
        params: Mapping[str, str],
        headers: Mapping[str, str],
    ) -> None:
        partial = "as=PartialObjectMetadata" in headers.get("accept", "")
        stat = self.stats[role][self._label(resource_name, partial)]
        watch = Watch(role, resource_name, self._selection(params), partial, writer, stat)
        since = int(params.get("resourceVersion") or 0)
        timeout = float(params.get("timeoutSeconds") or 1800)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        oldest = self.history[0][1].rv if self.history else self.rv
        if since and since < oldest - 1:
            gone = (
                b'{"type":"ERROR","object":{"kind":"Status","apiVersion":"v1","status":'
                b'"Failure","code":410,"reason":"Expired","message":"too old"}}\n'
            )
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(gone), gone))
            await writer.drain()
            return
        for resource_of, event in list(self.history):
            if resource_of == resource_name and event.rv > since:
                data = self._event_bytes(watch, event)
                if data in (b"full", b"partial"):
                    body = _partial(event.new) if partial else event.new.full
                    data = b'{"type":"MODIFIED","object":' + body + b"}\n"
                if data is not None:
                    watch.send(data)
        self.watches[resource_name].add(watch)
        deadline = time.monotonic() + timeout
        try:
            while not writer.transport.is_closing():
                left = deadline - time.monotonic()
                if left <= 0:
                    writer.write(b"0\r\n\r\n")
                    break
                await asyncio.sleep(min(left, BOOKMARK_EVERY))
                kind = b"PartialObjectMetadata" if partial else b"Status"
                watch.send(
                    b'{"type":"BOOKMARK","object":{"kind":"' + kind + b'","apiVersion":'
                    b'"v1","metadata":{"resourceVersion":"' + str(self.rv).encode() + b'"}}}\n'
                )
            await writer.drain()
        finally:
            self.watches[resource_name].discard(watch)


def serve(args: argparse.Namespace) -> None:
    import logging

    logging.getLogger("asyncio").setLevel(logging.CRITICAL)  # writes to clients that left
    started = time.monotonic()
    cluster = Cluster(args.nodes, args.services, args.endpoints)
    server = Server(cluster, args.compression)
    sizes = [len(item.full) for item in server.items["nodes"].values()]
    meta = [len(item.meta) for item in server.items["nodes"].values()]

    async def main() -> None:
        listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, limit=1 << 20)
        port = listener.sockets[0].getsockname()[1]
        info = {
            "port": port,
            "generated_s": round(time.monotonic() - started, 1),
            "node_bytes": [min(sizes), sum(sizes) // len(sizes), max(sizes)],
            "node_metadata_bytes": sum(meta) // len(meta),
            "objects": {r: len(v) for r, v in server.items.items()},
        }
        print(json.dumps(info), flush=True)
        churn = asyncio.create_task(server.churn_loop())
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes stdin
        churn.cancel()

    asyncio.run(main())


# --- the clients -------------------------------------------------------------------------


def _usage() -> dict[str, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    rss = 0
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return {"cpu": usage.ru_utime + usage.ru_stime, "rss": rss, "max_rss": usage.ru_maxrss * 1024}


def _serve_reports(report: Callable[[], Obj]) -> None:
    """Answer the parent: each line on stdin asks for a report; EOF ends the client."""
    for _ in sys.stdin:
        print(json.dumps({**_usage(), **report()}), flush=True)


def run_agent(url: str, role: str) -> None:
    """This checkout's agent, or the baseline's when its agent/ is first on sys.path."""
    import gc
    import inspect

    from kubernetes import client

    from agent.dataplane.none import NoneDataplane
    from agent.k8s import KubernetesSource, make_client
    from agent.metrics import Metrics
    from agent.model.compile import CompileOptions
    from agent.sync.loop import SyncLoop
    from agent.sync.store import StateStore

    configuration = client.Configuration()
    configuration.host = url
    api = make_client(configuration)
    api.user_agent = f"kbp-bench/{role}"
    store, metrics = StateStore(), Metrics()
    gc.disable()  # as the daemon does until the first apply
    source = KubernetesSource(api, store, metrics, THIS_NODE, None)
    loop = SyncLoop(store, THIS_NODE, CompileOptions(), NoneDataplane(), metrics)
    loop.start()
    source.start()

    def report() -> Obj:
        samples = {}
        for family in metrics.registry.collect():
            if family.name in (
                "kbp_api_bytes_received",
                "kbp_api_events",
                "kbp_nodestate_revisions",
            ):
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                        samples[f"{sample.name}{{{labels}}}"] = sample.value
        with store.lock:
            nodes = len(store.state.nodes)
        return {
            "synced": store.synced and loop.state is not None,
            "nodes_stored": nodes,
            "metrics": samples,
            "code": str(Path(inspect.getfile(KubernetesSource)).parent.parent),
        }

    try:
        _serve_reports(report)
    finally:
        source.stop()
        loop.stop()


def run_kube_proxy(url: str) -> None:
    """kube-proxy's watch set with a plain client: list (paged) then watch each of
    Services, EndpointSlices and this Node, resuming from the last resourceVersion."""
    import urllib3

    http = urllib3.PoolManager(maxsize=4, retries=False)
    headers = {"User-Agent": "kbp-bench/kube-proxy", "Accept": "application/json"}
    cache: dict[str, dict[str, Any]] = {}
    synced: set[str] = set()
    lock = threading.Lock()

    def follow(path: str, query: dict[str, str]) -> None:
        objects = cache.setdefault(path, {})
        version = ""
        while True:
            if not version:
                token = ""
                while True:
                    page = dict(query, limit="500", **({"continue": token} if token else {}))
                    body = json.loads(
                        http.request("GET", url + path, fields=page, headers=headers).data
                    )
                    with lock:
                        for obj in body["items"]:
                            meta = obj["metadata"]
                            objects[f"{meta.get('namespace')}/{meta['name']}"] = obj
                    token = body["metadata"].get("continue") or ""
                    if not token:
                        version = body["metadata"]["resourceVersion"]
                        break
                synced.add(path)
            watch = dict(
                query,
                watch="true",
                allowWatchBookmarks="true",
                resourceVersion=version,
                timeoutSeconds=str(random.randint(300, 600)),
            )
            response = http.request(
                "GET",
                url + path,
                fields=watch,
                headers=headers,
                preload_content=False,
                timeout=urllib3.Timeout(read=90),
            )
            buffer = b""
            try:
                for chunk in response.stream(None):
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        event = json.loads(line)
                        obj = event["object"]
                        meta = obj.get("metadata", {})
                        version = meta.get("resourceVersion", version)
                        if event["type"] == "ERROR":
                            version = ""
                            break
                        key = f"{meta.get('namespace')}/{meta.get('name')}"
                        with lock:
                            if event["type"] == "DELETED":
                                objects.pop(key, None)
                            elif event["type"] != "BOOKMARK":
                                objects[key] = obj
            except (urllib3.exceptions.HTTPError, OSError):
                time.sleep(0.5)
            finally:
                response.release_conn()

    for path, query in (
        ("/api/v1/services", {"labelSelector": KUBE_PROXY_SELECTOR}),
        ("/apis/discovery.k8s.io/v1/endpointslices", {"labelSelector": KUBE_PROXY_SELECTOR}),
        ("/api/v1/nodes", {"fieldSelector": f"metadata.name={THIS_NODE}"}),
    ):
        threading.Thread(target=follow, args=(path, query), daemon=True).start()

    def report() -> Obj:
        with lock:
            return {"synced": len(synced) == 3, "objects": {p: len(o) for p, o in cache.items()}}

    _serve_reports(report)


# --- the run -----------------------------------------------------------------------------


class Child:
    def __init__(self, argv: list[str], env: Mapping[str, str] | None = None) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def line(self) -> Obj:
        assert self.process.stdout is not None
        text = self.process.stdout.readline()
        if not text:
            raise RuntimeError(f"child {self.process.args[2:]} exited ({self.process.wait()})")
        return json.loads(text)

    def report(self) -> Obj:
        assert self.process.stdin is not None
        self.process.stdin.write("report\n")
        self.process.stdin.flush()
        return self.line()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.process.stdin is not None
            self.process.stdin.close()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def get(url: str) -> Obj:
    import urllib.request

    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


def snapshot(url: str, clients: Mapping[str, Child]) -> Obj:
    return {
        "at": time.monotonic(),
        "server": get(url + "/bench/stats"),
        "clients": {role: child.report() for role, child in clients.items()},
    }


def phase_figures(before: Obj, after: Obj, compression: float) -> dict[str, Obj]:
    """Per role: bytes and events per simulated minute by resource, CPU s per simulated
    minute, RSS at the end."""
    minutes = (after["at"] - before["at"]) * compression / 60
    out: dict[str, Obj] = {}
    for role in ROLES:
        now = after["server"]["stats"].get(role, {})
        then = before["server"]["stats"].get(role, {})
        per: dict[str, Obj] = {}
        for label in sorted(set(now) | set(then)):
            b = now.get(label, [0, 0])[0] - then.get(label, [0, 0])[0]
            e = now.get(label, [0, 0])[1] - then.get(label, [0, 0])[1]
            per[label] = {"bytes_per_min": b / minutes, "events_per_min": e / minutes}
        cpu = after["clients"][role]["cpu"] - before["clients"][role]["cpu"]
        out[role] = {
            "resources": per,
            "bytes_per_min": sum(r["bytes_per_min"] for r in per.values()),
            "node_bytes_per_min": sum(
                r["bytes_per_min"] for k, r in per.items() if k.startswith("nodes")
            ),
            "cpu_s_per_min": cpu / minutes,
            "rss": after["clients"][role]["rss"],
            "simulated_minutes": minutes,
        }
    return out


def fmt_bytes(n: float) -> str:
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n:,.0f} B"


def writes_per_minute(before: Obj, after: Obj, compression: float) -> dict[str, float]:
    """The churn the server made, per simulated minute (what the rates asked for: Nodes
    1,000 at 5,000 nodes, slices 600, Services 30), to see that it kept up."""
    minutes = (after["at"] - before["at"]) * compression / 60
    now = after["server"]["stats"].get(WRITES, {})
    then = before["server"]["stats"].get(WRITES, {})
    return {r: (now[r][1] - then.get(r, [0, 0])[1]) / minutes for r in now}


def print_phase(title: str, figures: Mapping[str, Obj], writes: Mapping[str, float]) -> None:
    print(f"\n{title} (per simulated minute)")
    print("writes by the server: " + ", ".join(f"{r} {n:,.0f}" for r, n in sorted(writes.items())))
    labels = sorted({k for f in figures.values() for k in f["resources"]})
    head = ["client", *labels, "total", "events", "CPU s", "RSS"]
    print("| " + " | ".join(head) + " |")
    print("|" + " --- |" * len(head))
    for role, f in figures.items():
        cells = [role]
        for label in labels:
            r = f["resources"].get(label)
            cells.append(
                f"{fmt_bytes(r['bytes_per_min'])} / {r['events_per_min']:,.0f} ev" if r else "—"
            )
        events = sum(r["events_per_min"] for r in f["resources"].values())
        cells += [
            fmt_bytes(f["bytes_per_min"]),
            f"{events:,.0f}",
            f"{f['cpu_s_per_min']:.2f}",
            fmt_bytes(f["rss"]),
        ]
        print("| " + " | ".join(cells) + " |")


def wait_synced(clients: Mapping[str, Child], url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reports = {role: child.report() for role, child in clients.items()}
        watches = get(url + "/bench/stats")["watches"]
        if all(r["synced"] for r in reports.values()) and all(
            len(watches.get(role, [])) >= 3 for role in clients
        ):
            return
        time.sleep(1)
    raise RuntimeError("the clients did not sync in time")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="1,000 nodes, 2,000 Services, 30 s phases"
    )
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--compression", type=float, default=10.0)
    parser.add_argument("--phase", type=float, default=60.0, help="seconds (real) per phase")
    parser.add_argument(
        "--keyed", type=int, default=100, help="Services given topology keys in phase B"
    )
    parser.add_argument(
        "--baseline", default=None, help="git ref of main's code (default: merge base)"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--client", choices=("agent", "kube-proxy"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.nodes, args.services, args.phase = 1000, 2000, 30.0
    # Nodes report in turn: a phase covers whole status periods, so each node (those of
    # this node's rack too) reports equally often in it.
    period = STATUS_PERIOD / args.compression
    args.phase = max(1, round(args.phase / period)) * period
    if args.serve:
        serve(args)
        return 0
    if args.client == "agent":
        run_agent(args.url, args.role)
        return 0
    if args.client == "kube-proxy":
        run_kube_proxy(args.url)
        return 0
    return orchestrate(args)


def orchestrate(args: argparse.Namespace) -> int:
    from bench.common.report import (
        baseline_tree,
        default_baseline,
        machine,
        mark,
        results_path,
        write_results,
    )

    started = time.monotonic()
    info = machine()
    baseline_ref = args.baseline or default_baseline()
    with tempfile.TemporaryDirectory(prefix="kbp-pb12-") as tmp:
        baseline = baseline_tree(baseline_ref, Path(tmp))
        print(
            f"PB-12: {args.nodes} Nodes, {args.services} Services x {args.endpoints} endpoints "
            f"(+{args.services // 10} headless), time x{args.compression:g}, phases of "
            f"{args.phase:g} s; main's code = {baseline[:10]}; load {os.getloadavg()[0]:.1f}"
        )
        server = Child(
            [
                "--serve",
                "--nodes",
                str(args.nodes),
                "--services",
                str(args.services),
                "--endpoints",
                str(args.endpoints),
                "--compression",
                str(args.compression),
            ]
        )
        clients: dict[str, Child] = {}
        try:
            hello = server.line()
            url = f"http://127.0.0.1:{hello['port']}"
            print(
                f"server: generated in {hello['generated_s']} s; objects {hello['objects']}; "
                f"Node JSON min/mean/max {hello['node_bytes']} B, metadata alone "
                f"{hello['node_metadata_bytes']} B"
            )
            env_new = dict(os.environ, PYTHONPATH=str(ROOT))
            env_main = dict(env_new, KBP_BENCH_AGENT_PATH=tmp)
            clients["kube-proxy"] = Child(["--client", "kube-proxy", "--url", url], env_new)
            clients["agent"] = Child(
                ["--client", "agent", "--url", url, "--role", "agent"], env_new
            )
            clients["main"] = Child(["--client", "agent", "--url", url, "--role", "main"], env_main)
            wait_synced(clients, url, 900)
            code = {role: clients[role].report().get("code") for role in ("agent", "main")}
            print(f"synced after {time.monotonic() - started:.0f} s; agent code: {code}")
            initial = snapshot(url, clients)
            get(url + "/bench/churn?on=1")
            time.sleep(2)
            a0 = snapshot(url, clients)
            time.sleep(args.phase)
            a1 = snapshot(url, clients)
            get(url + f"/bench/keys?count={args.keyed}")
            time.sleep(5)  # the metadata watch starts and lists
            b0 = snapshot(url, clients)
            time.sleep(args.phase)
            b1 = snapshot(url, clients)
            print(f"open watches at the end: {b1['server']['watches']}")
            load = os.getloadavg()
        finally:
            for child in clients.values():
                child.close()
            server.close()
    phase_a = phase_figures(a0, a1, args.compression)
    phase_b = phase_figures(b0, b1, args.compression)
    writes_a = writes_per_minute(a0, a1, args.compression)
    writes_b = writes_per_minute(b0, b1, args.compression)
    print_phase("Phase A: no topology keys", phase_a, writes_a)
    print_phase(f"Phase B: {args.keyed} Services with topology keys ({RACK})", phase_b, writes_b)
    ratio_a = phase_a["agent"]["bytes_per_min"] / phase_a["kube-proxy"]["bytes_per_min"]
    ratio_main = phase_a["main"]["bytes_per_min"] / phase_a["kube-proxy"]["bytes_per_min"]
    share_b = phase_b["agent"]["node_bytes_per_min"] / max(
        1.0, phase_b["main"]["node_bytes_per_min"]
    )
    print()
    print(
        f"A: agent bytes/min = {ratio_a:.3f} x kube-proxy's (target <= {TARGET_RATIO_NO_KEYS}): "
        f"{mark(ratio_a <= TARGET_RATIO_NO_KEYS)}; main's code: {ratio_main:.1f} x"
    )
    print(
        f"B: agent Node traffic = 1/{1 / max(share_b, 1e-9):,.0f} of main's full Node watch "
        f"(target <= 1/20): {mark(share_b <= TARGET_NODE_SHARE)}"
    )
    initial_lists = {
        role: sum(v[0] for v in initial["server"]["stats"].get(role, {}).values()) for role in ROLES
    }
    print(
        "initial lists and watches until synced: "
        + ", ".join(f"{r} {fmt_bytes(b)}" for r, b in initial_lists.items())
    )
    agent_metrics = b1["clients"]["agent"]["metrics"]
    print(
        "agent's own counters at the end: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in agent_metrics.items() if "bytes" in k)
    )
    print(f"load average at the end: {load[0]:.1f}; {time.monotonic() - started:.0f} s in all")
    result = {
        "machine": info,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "baseline": baseline,
        "server": hello,
        "phase_a": phase_a,
        "phase_b": phase_b,
        "writes_per_min": {"a": writes_a, "b": writes_b},
        "ratio_a_agent_over_kube_proxy": ratio_a,
        "ratio_a_main_over_kube_proxy": ratio_main,
        "share_b_agent_node_over_main": share_b,
        "initial_bytes": initial_lists,
        "agent_metrics": agent_metrics,
        "load_average_end": load,
    }
    path = results_path(args, "api_cost")
    write_results(path, result)
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
