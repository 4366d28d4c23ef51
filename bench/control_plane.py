"""Benchmark of the control plane against kmock over HTTP (issue 4 §6; PB-7, PB-5's first half).

Runs the real KubernetesSource + StateStore + SyncLoop (min_sync_period 0) + a recording
FakeDataplane in this process against kmock, a Kubernetes API emulator run in a child
process and loaded with N Services x M endpoints (bench/common/workload.py's generator); the
source lists and watches it over real HTTP with the `kubernetes` client.

PB-7 (coalescing): after the initial sync, noise-only updates are written through the API
(merge PATCHes), one category at a time: labels and annotations, resourceVersion-only
re-sends, other nodes' hints in Services without hints, Node status churn; then a mixed
stream with 1 % real changes (an endpoint's readiness) as the control. For each: API
events received, store real changes, NodeState revisions, dataplane applies, kernel writes.

PB-5 (control-plane half): single real changes at a steady rate, written over HTTP, each
timed from the write and from the watch event's arrival in the source to
FakeDataplane.apply being called with a NodeState that contains it, with the steps in
between; then bursts of 100 changes (1 per 10 ms, and all at once) published by kmock,
with and without the FakeDataplane's own diff on the sync thread: how many applies.

Timestamps come from probes installed without editing agent/ (see Probe). Figures are
printed beside their targets (bench/README.md, PB-5/PB-7); results go to
bench/results/control_plane.json. Not a test: it always exits 0 unless it crashes.

    .venv/bin/python bench/control_plane.py [--quick] [--services N ...] [--profile]
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import cProfile
import gc
import http.client
import io
import json
import pstats
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import urllib3
from kubernetes import client

import agent.k8s.source as source_module
from agent.dataplane.fake import FakeDataplane
from agent.k8s import KubernetesSource, make_client
from agent.metrics import Metrics
from agent.model.compile import CompileOptions, compile
from agent.model.nodestate import NodeState, ServiceEntry
from agent.sync.loop import SyncLoop
from agent.sync.store import KINDS, StateStore, Value, key_of, kind_of
from bench.common.apiserver import COLLECTIONS, KmockProcess, fingerprint, process_cpu
from bench.common.report import RESULTS, Stat, fmt_s, machine, mark, results_path, write_results
from bench.common.workload import THIS_NODE, Generator, Obj, Workload

# Targets (issue 4 §6) and published anchors (bench/README.md, PB-5, PB-7).
TARGET_REVISIONS_PER_EVENT = 0.05  # ≤ 1-5 % of API events become NodeState revisions
TARGET_ARRIVAL_TO_APPLY_P99 = 0.010  # watch event → dataplane apply called, p99 ≤ 10 ms
TARGET_BURST_APPLIES = 10  # 100 changes at once coalesce into "a few write batches"
REF_PB7 = "kpng: 0.93 % of API events became real changes"
BURSTS = (("paced", 1.0), ("at_once", 0.0))  # the bursts' spacing, in burst_seconds/burst
REF_PB5 = "kube-proxy nft: +1 Service beside 10k ≈141 ms; iptables partial sync 0.6-0.9 s"

LIST_PATHS = {
    "services": "/api/v1/services",
    "endpointslices": "/apis/discovery.k8s.io/v1/endpointslices",
    "nodes": "/api/v1/nodes",
}
NOISE_LABEL = "bench.kube-bpf-proxy.io/churn"
NOISE_ANNOTATION = "bench.kube-bpf-proxy.io/note"
TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
WAIT = 30.0  # seconds to wait for events or applies before reporting them missing


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def object_path(kind: str, namespace: str | None, name: str) -> str:
    _, collection, namespaced = COLLECTIONS[kind]
    return (collection.format(ns=namespace) if namespaced else collection) + "/" + name


# --- writes through the API --------------------------------------------------------------


class Writer:
    """Merge PATCHes to kmock over one keep-alive HTTP connection; every write carries a
    fresh resourceVersion, as the API server would give it."""

    def __init__(self, port: int) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self.round_trips: list[float] = []
        self.version = 10_000_000

    def next_version(self) -> str:
        self.version += 1
        return str(self.version)

    def patch(self, kind: str, namespace: str | None, name: str, body: Obj) -> tuple[float, float]:
        """Send; return (time before sending, time the response was read)."""
        data = json.dumps(body, separators=(",", ":")).encode()
        path = object_path(kind, namespace, name)
        start = time.perf_counter()
        self.connection.request(
            "PATCH", path, body=data, headers={"Content-Type": "application/merge-patch+json"}
        )
        response = self.connection.getresponse()
        text = response.read()
        end = time.perf_counter()
        if response.status >= 300:
            raise RuntimeError(f"PATCH {path}: {response.status} {text[:200]!r}")
        self.round_trips.append(end - start)
        return start, end

    def get(self, path: str) -> tuple[bytes, float]:
        start = time.perf_counter()
        self.connection.request("GET", path)
        response = self.connection.getresponse()
        body = response.read()
        return body, time.perf_counter() - start

    def close(self) -> None:
        self.connection.close()


# --- the cluster as the benchmark changes it ---------------------------------------------


@dataclass
class SliceCopy:
    """What the benchmark keeps of one Service's (only) EndpointSlice."""

    index: int  # Service index in the generator
    namespace: str
    service: str
    name: str
    endpoints: list[Obj]  # kept up to date with what was written
    flip: int = -1  # the endpoint whose readiness control changes toggle
    hinted: int = -1  # the endpoint whose node hint the noise changes


@dataclass
class Change:
    """One real change: endpoint `ip` of `slice_` became ready or not ready."""

    slice_: SliceCopy
    ip: str
    ready: bool
    version: str = ""
    written: float = 0.0  # before the PATCH was sent; for bursts, when kmock put it
    # Filled in by `match`:
    arrived: float | None = None  # the watch event's line read by the source
    upserted: float | None = None  # the decoded slice handed to the store
    sync: SyncRecord | None = None  # the first sync whose apply contains the change


def is_ready(endpoint: Obj) -> bool:
    conditions = endpoint.get("conditions") or {}
    return bool(conditions.get("ready")) and not conditions.get("terminating")


class Cluster:
    """Names and pools of objects to change, from the same generator as kmock's.

    Pools (by Service index, disjoint): controls (i % 4 == 0: ClusterIP, one port, no
    hints, ≥ 3 ready endpoints) flip one endpoint's readiness; hint noise (i % 4 == 1: no
    hints, ≥ 2 ready endpoints) moves a node hint on one ready endpoint between other
    nodes; re-sent objects (i % 4 == 2: whole copies kept); labels and annotations
    (i % 4 == 3). Full copies are kept only where needed: this process also runs the
    agent, whose cyclic GC should not be scanning a second copy of the cluster.
    """

    def __init__(self, workload: Workload) -> None:
        items = Generator(workload).items(headless=False)
        self.fingerprint = fingerprint(items)
        self.counts = {kind: 0 for kind in KINDS}
        self.nodes: list[str] = []
        self.services: list[tuple[int, str, str]] = []  # (index, namespace, name)
        self.slices: dict[int, list[SliceCopy]] = {}
        self.resend: list[Obj] = []
        resend_limit = 400
        for obj in items:
            kind, meta = obj["kind"], obj["metadata"]
            self.counts[kind] += 1
            if kind == "Node":
                self.nodes.append(meta["name"])
                continue
            name = (
                meta["name"] if kind == "Service" else meta["labels"]["kubernetes.io/service-name"]
            )
            index = int(name.removeprefix("svc-"))
            if kind == "Service":
                self.services.append((index, meta["namespace"], meta["name"]))
            else:
                self.slices.setdefault(index, []).append(
                    SliceCopy(index, meta["namespace"], name, meta["name"], obj["endpoints"])
                )
            if index % 4 == 2 and len(self.resend) < resend_limit:
                self.resend.append(obj)
        del items
        self.other_nodes = [n for n in self.nodes if n != THIS_NODE]
        self.controls: list[SliceCopy] = []
        self.hinted: list[SliceCopy] = []
        for index, slices in sorted(self.slices.items()):
            if len(slices) != 1:
                continue
            copy = slices[0]
            ready = [j for j, ep in enumerate(copy.endpoints) if is_ready(ep)]
            plain = index % 10 not in (3, 5) and index % 20 != 0 and index % 50 != 1
            if index % 4 == 0 and plain and len(ready) >= 3:
                copy.flip = ready[0]
                self.controls.append(copy)
            elif index % 4 == 1 and index % 10 != 5 and len(ready) >= 2:
                copy.hinted = ready[-1]
                self.hinted.append(copy)
        self.labelled = [s for s in self.services if s[0] % 4 == 3]
        self._next_control = 0
        for slices in self.slices.values():
            for copy in slices:
                if copy.flip < 0 and copy.hinted < 0:
                    copy.endpoints = []  # only names are needed

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def take_controls(self, count: int) -> list[SliceCopy]:
        """`count` control slices, distinct when the pool allows, cycling through it."""
        pool = self.controls
        chosen = [pool[(self._next_control + k) % len(pool)] for k in range(count)]
        self._next_control = (self._next_control + count) % len(pool)
        return chosen

    def flip(self, copy: SliceCopy, version: str) -> tuple[Change, Obj]:
        """Toggle the readiness of the slice's control endpoint; return the change and
        the merge patch (the whole endpoints list: merge patches replace lists)."""
        endpoint = copy.endpoints[copy.flip]
        ready = not is_ready(endpoint)
        endpoint["conditions"] = {"ready": ready, "serving": ready, "terminating": False}
        patch = {
            "metadata": {"resourceVersion": version, "annotations": {TRIGGER_TIME: now_rfc3339()}},
            "endpoints": copy.endpoints,
        }
        return Change(copy, endpoint["addresses"][0], ready, version), patch


# --- the agent under test, with probes ----------------------------------------------------


@dataclass
class SyncRecord:
    """One run of SyncLoop.sync, as the probes saw it."""

    start: float
    end: float = 0.0
    compile_s: float = 0.0
    apply_at: float | None = None  # when FakeDataplane.apply was called
    apply_s: float = 0.0  # how long the fake took
    bookkeeping_s: float = 0.0  # SyncLoop._succeeded: metrics, status, followers
    state: NodeState | None = None  # what it was given
    writes: int = 0


class RecordingDataplane(FakeDataplane):
    """FakeDataplane that also notes when each apply was called, within which sync.

    With `defer` set, `apply` only takes the state (as held) and the FakeDataplane's
    diff, which walks every entry, is run after the phase by `count_deferred`: the
    same write counts, without the fake's own cost on the sync thread."""

    def __init__(self, probe: Probe) -> None:
        super().__init__()
        self.probe = probe
        self.defer = False
        self.deferred: list[NodeState] = []

    def apply(self, state: NodeState, full: bool = False) -> int:
        called = time.perf_counter()
        if self.defer:
            self.attempts += 1
            self._held = state
            self.applied.append((state, full))
            self.applied_event.set()
            self.deferred.append(state)
            writes = 0
        else:
            writes = super().apply(state, full)
        record = self.probe.current
        if record is not None:
            record.apply_at = called
            record.apply_s = time.perf_counter() - called
            record.state = state
            record.writes = writes
        return writes

    def count_deferred(self, start: NodeState | None, metrics: Metrics) -> int:
        """The FakeDataplane's writes for the deferred applies, from `start` on; added to
        its total and to kbp_kernel_writes_total as the applies would have."""
        counter = FakeDataplane()
        counter._held = start
        writes = sum(counter.apply(state) for state in self.deferred)
        self.deferred.clear()
        self.writes += writes
        metrics.kernel_writes.labels(self.name).inc(writes)
        return writes


class Probe:
    """Timestamps along the path of an event, taken without editing agent/: the source's
    line reader (a module function), the watchers' list steps, the store's `upsert` and
    `mark_synced`, the sync loop's runner function, compiler and `_succeeded` (instance
    attributes), the dataplane's `apply`, and the cyclic GC's pauses (gc.callbacks)."""

    def __init__(self) -> None:
        self.recording = False
        self.line_count = 0  # watch events read by the source (cheaper than the metric)
        self.lines: list[tuple[float, bytes]] = []
        self.upserts: list[tuple[float, str, tuple[str, str]]] = []
        self.syncs: list[SyncRecord] = []
        self.current: SyncRecord | None = None
        self.in_sync = False
        self.synced_at: float | None = None  # the last initial list reached the store
        self.lists: dict[str, dict[str, float]] = {}  # resource → fetch/total seconds
        self.gc_pauses: list[tuple[float, float, int]] = []  # (start, seconds, generation)
        self.profiler: cProfile.Profile | None = None  # the sync thread's, with --profile
        self.profiling = False
        self._gc_started = 0.0
        self._original_lines = source_module._lines

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            seconds = time.perf_counter() - self._gc_started
            self.gc_pauses.append((self._gc_started, seconds, info["generation"]))

    def install_gc(self) -> None:
        gc.callbacks.append(self._gc)

    def uninstall_gc(self) -> None:
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._gc)

    def gc_between(self, start: float, end: float) -> list[tuple[float, float, int]]:
        return [p for p in self.gc_pauses if start <= p[0] < end]

    def wrap_source(self, source: KubernetesSource) -> None:
        for watcher in source._watchers:
            times = self.lists.setdefault(watcher.resource.name, {})
            list_all, list_pages = watcher._list, watcher._list_pages

            def timed_pages(
                list_pages: Callable[[], tuple[list[Any], str]] = list_pages,
                times: dict[str, float] = times,
            ) -> tuple[list[Any], str]:
                started = time.perf_counter()
                try:
                    return list_pages()
                finally:
                    times.setdefault("fetch_and_json_s", time.perf_counter() - started)

            def timed_list(
                list_all: Callable[[], str] = list_all, times: dict[str, float] = times
            ) -> str:
                started = time.perf_counter()
                try:
                    return list_all()
                finally:
                    times.setdefault("list_s", time.perf_counter() - started)
                    times.setdefault("done_at", time.perf_counter())

            watcher._list_pages = timed_pages  # type: ignore[method-assign]
            watcher._list = timed_list  # type: ignore[method-assign]

    def install_lines(self) -> None:
        original = self._original_lines

        def lines(response: urllib3.BaseHTTPResponse, *rest: Any) -> Iterator[bytes]:
            for line in original(response, *rest):
                self.line_count += 1
                if self.recording:
                    self.lines.append((time.perf_counter(), line))
                yield line

        source_module._lines = lines

    def uninstall_lines(self) -> None:
        source_module._lines = self._original_lines

    def wrap_store(self, store: StateStore) -> None:
        upsert = store.upsert

        def recording_upsert(value: Value) -> bool:
            if self.recording:
                self.upserts.append((time.perf_counter(), kind_of(value), key_of(value)))
            return upsert(value)

        store.upsert = recording_upsert  # type: ignore[method-assign]
        mark_synced = store.mark_synced

        def noting_mark_synced(name: str) -> None:
            mark_synced(name)
            if store.synced and self.synced_at is None:
                self.synced_at = time.perf_counter()

        store.mark_synced = noting_mark_synced  # type: ignore[method-assign]

    def wrap_loop(self, loop: SyncLoop) -> None:
        run = loop.runner._fn
        update = loop.compiler.update
        succeeded = loop._succeeded

        def sync(periodic: bool = False) -> None:
            record = SyncRecord(time.perf_counter())
            self.current = record
            self.in_sync = True
            profiler = self.profiler if self.profiling else None
            if profiler is not None:
                profiler.enable()  # profiles this (the sync) thread only
            try:
                run(periodic)
            finally:
                if profiler is not None:
                    profiler.disable()
                record.end = time.perf_counter()
                self.in_sync = False
                self.current = None
                self.syncs.append(record)

        def timed_succeeded(*args: Any) -> None:
            started = time.perf_counter()
            try:
                succeeded(*args)
            finally:
                if self.current is not None:
                    self.current.bookkeeping_s = time.perf_counter() - started

        def timed_update(state: Any) -> NodeState:
            started = time.perf_counter()
            try:
                return update(state)
            finally:
                if self.current is not None:
                    self.current.compile_s = time.perf_counter() - started

        loop.runner._fn = sync
        loop.compiler.update = timed_update  # type: ignore[method-assign]
        loop._succeeded = timed_succeeded  # type: ignore[method-assign]

    def clear(self) -> None:
        self.lines.clear()
        self.upserts.clear()


@dataclass
class Snapshot:
    """Counters at one moment (PB-7 takes differences)."""

    at: float
    events: dict[str, float]  # API events by type, all resources
    store_events: dict[str, int]
    store_changes: dict[str, int]
    revisions: float
    applies: int
    writes: int
    kernel_writes: float
    agent_cpu: float  # the source's watch threads + the sync thread
    kmock_cpu: float
    syncs: int

    def minus(self, before: Snapshot) -> dict[str, Any]:
        events = {k: self.events[k] - before.events.get(k, 0) for k in self.events}
        return {
            "seconds": self.at - before.at,
            "api_events": sum(v for k, v in events.items() if k != "LIST"),
            "api_events_by_type": {k: v for k, v in events.items() if v},
            "store_events": sum(self.store_events.values()) - sum(before.store_events.values()),
            "store_changes": sum(self.store_changes.values()) - sum(before.store_changes.values()),
            "store_changes_by_kind": {
                k: self.store_changes[k] - before.store_changes[k] for k in self.store_changes
            },
            "revisions": self.revisions - before.revisions,
            "applies": self.applies - before.applies,
            "kernel_writes": self.writes - before.writes,
            "kernel_writes_metric": self.kernel_writes - before.kernel_writes,
            "agent_cpu_s": self.agent_cpu - before.agent_cpu,
            "kmock_cpu_s": self.kmock_cpu - before.kmock_cpu,
            "syncs": self.syncs - before.syncs,
        }


class Agent:
    """KubernetesSource + StateStore + SyncLoop + RecordingDataplane, as `run` wires them
    (without the local API), watching kmock."""

    def __init__(self, kmock_process: KmockProcess) -> None:
        self.kmock = kmock_process
        self.probe = Probe()
        self.metrics = Metrics()
        self.store = StateStore()
        self.dataplane = RecordingDataplane(self.probe)
        configuration = client.Configuration()
        configuration.host = kmock_process.url
        self.api_client = make_client(configuration)
        # kmock never ends a watch (it ignores timeoutSeconds) and replays every object
        # on each new one: long timeouts keep the watches open for the whole run.
        self.source = KubernetesSource(
            self.api_client,
            self.store,
            self.metrics,
            THIS_NODE,
            None,
            watch_timeout=3600,
            read_timeout=3600,
            idle_timeout=3600,
            request_timeout=300,
        )
        # min_sync_period 0 (the default); no periodic resync during the run: it is
        # time-driven, not caused by events, and would blur the per-event counts.
        self.loop = SyncLoop(
            self.store,
            THIS_NODE,
            CompileOptions(),
            self.dataplane,
            self.metrics,
            min_sync_period=0.0,
            sync_period=3600.0,
        )
        self.probe.wrap_store(self.store)
        self.probe.wrap_source(self.source)
        self.probe.wrap_loop(self.loop)
        self.threads: dict[str, int] = {}

    def start(self) -> None:
        self.probe.install_gc()
        self.probe.install_lines()
        self.loop.start()
        self.source.start()
        for thread in threading.enumerate():
            if (thread.name.startswith("kbp-k8s-") or thread.name == "sync") and thread.native_id:
                self.threads[thread.name] = thread.native_id

    def stop(self) -> None:
        self.source.stop()
        self.loop.stop()
        self.api_client.close()
        self.probe.uninstall_lines()
        self.probe.uninstall_gc()

    # --- counters -------------------------------------------------------------------
    def sample(self, name: str, labels: dict[str, str] | None = None) -> float:
        return self.metrics.registry.get_sample_value(name, labels or {}) or 0.0

    def events(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for resource in LIST_PATHS:
            for kind in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR", "LIST"):
                value = self.sample("kbp_api_events_total", {"resource": resource, "type": kind})
                out[kind] = out.get(kind, 0.0) + value
        return out

    def watch_events(self) -> int:
        """Watch events read so far (equal to kbp_api_events_total without LIST, which is
        costly to poll: each read walks the registry)."""
        return self.probe.line_count

    def thread_cpu(self) -> dict[str, float]:
        return {name: process_cpu("self", tid) for name, tid in self.threads.items()}

    def snapshot(self) -> Snapshot:
        with self.store.lock:
            store_events = dict(self.store.counts.events)
            store_changes = dict(self.store.counts.changes)
        return Snapshot(
            at=time.perf_counter(),
            events=self.events(),
            store_events=store_events,
            store_changes=store_changes,
            revisions=self.sample("kbp_nodestate_revisions_total"),
            applies=len(self.dataplane.applied),
            writes=self.dataplane.writes,
            kernel_writes=self.sample("kbp_kernel_writes_total", {"dataplane": "fake"}),
            agent_cpu=sum(self.thread_cpu().values()),
            kmock_cpu=self.kmock.cpu_seconds(),
            syncs=len(self.probe.syncs),
        )

    def idle(self) -> bool:
        runner = self.loop.runner
        with runner._cond:
            requested = runner._requested
        return not requested and not self.probe.in_sync

    def settle(self, watch_events: float, timeout: float = WAIT, quiet: float = 0.03) -> bool:
        """Wait until `watch_events` events were received and the sync loop has been
        idle for `quiet` seconds. False on timeout."""
        deadline = time.monotonic() + timeout
        while self.watch_events() < watch_events:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        quiet_since: float | None = None
        while time.monotonic() < deadline:
            if self.idle():
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= quiet:
                    return True
            else:
                quiet_since = None
            time.sleep(0.002)
        return False


# --- matching a change to its event, upsert and apply -------------------------------------


def entries_of(state: NodeState, namespace: str, name: str) -> tuple[ServiceEntry, ...]:
    services = state.services
    low = bisect.bisect_left(services, (namespace, name), key=lambda e: (e.namespace, e.name))
    high = bisect.bisect_right(
        services, (namespace, name), lo=low, key=lambda e: (e.namespace, e.name)
    )
    return services[low:high]


def reflects(state: NodeState, change: Change) -> bool:
    """Whether `state` programs the change: the endpoint among the Service's ready
    cluster backends exactly when it became ready."""
    entries = entries_of(state, change.slice_.namespace, change.slice_.service)
    if not entries:
        return False
    present = any(
        b.ip == change.ip and b.ready for e in entries for b in (e.cluster_backends or ())
    )
    return present == change.ready


def match(changes: list[Change], probe: Probe) -> None:
    """Fill in each change's arrival, upsert and sync from the probes' records."""
    arrivals: dict[str, float] = {}
    for at, line in probe.lines:
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            version = json.loads(line)["object"]["metadata"]["resourceVersion"]
            arrivals.setdefault(str(version), at)
    upserts: dict[tuple[str, str], list[float]] = {}
    for at, kind, key in probe.upserts:
        if kind == "EndpointSlice":
            upserts.setdefault(key, []).append(at)
    applied = [r for r in probe.syncs if r.apply_at is not None and r.state is not None]
    starts = [r.apply_at for r in applied]
    for change in changes:
        change.arrived = arrivals.get(change.version)
        after = change.arrived if change.arrived is not None else change.written
        key = (change.slice_.namespace, change.slice_.name)
        times = upserts.get(key, [])
        i = bisect.bisect_left(times, after)
        change.upserted = times[i] if i < len(times) else None
        for record in applied[bisect.bisect_left(starts, change.written) :]:
            assert record.state is not None
            if reflects(record.state, change):
                change.sync = record
                break


@dataclass
class Latencies:
    """PB-5 figures of a list of matched changes (seconds)."""

    write_to_apply: list[float] = field(default_factory=list)
    write_to_arrival: list[float] = field(default_factory=list)
    arrival_to_apply: list[float] = field(default_factory=list)
    arrival_to_upsert: list[float] = field(default_factory=list)
    upsert_to_sync: list[float] = field(default_factory=list)
    sync_to_apply: list[float] = field(default_factory=list)
    compile: list[float] = field(default_factory=list)
    fake_apply: list[float] = field(default_factory=list)
    bookkeeping: list[float] = field(default_factory=list)
    missed: int = 0

    @classmethod
    def of(cls, changes: list[Change]) -> Latencies:
        out = cls()
        for c in changes:
            record = c.sync
            if record is None or record.apply_at is None or c.arrived is None:
                out.missed += 1
                continue
            out.write_to_apply.append(record.apply_at - c.written)
            out.write_to_arrival.append(c.arrived - c.written)
            out.arrival_to_apply.append(record.apply_at - c.arrived)
            if c.upserted is not None:
                out.arrival_to_upsert.append(c.upserted - c.arrived)
                out.upsert_to_sync.append(record.start - c.upserted)
            out.sync_to_apply.append(record.apply_at - record.start)
            out.compile.append(record.compile_s)
            out.fake_apply.append(record.apply_s)
            out.bookkeeping.append(record.bookkeeping_s)
        return out


# --- phases ------------------------------------------------------------------------------


@dataclass
class Plan:
    noise_per_category: int
    mixed: int  # writes in the mixed stream; 1 % are real changes
    changes: int  # PB-5 steady changes
    rate: float  # PB-5 steady changes per second
    burst: int  # changes in each burst
    burst_seconds: float  # the paced burst's span


@dataclass
class SizeResult:
    workload: Workload
    kmock: dict[str, Any] = field(default_factory=dict)
    initial: dict[str, Any] = field(default_factory=dict)
    pb7: list[dict[str, Any]] = field(default_factory=list)
    pb5: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)


NoiseWrite = tuple[str, str | None, str, Obj]  # kind, namespace, name, merge patch


class Noise:
    """Noise-only writes by category; none can change any NodeState entry."""

    def __init__(self, cluster: Cluster, writer: Writer) -> None:
        self.cluster = cluster
        self.writer = writer
        self.counter = 0

    def _tick(self) -> int:
        self.counter += 1
        return self.counter

    def service_label(self) -> NoiseWrite:
        k = self._tick()
        _, namespace, name = self.cluster.labelled[k % len(self.cluster.labelled)]
        meta = {"resourceVersion": self.writer.next_version(), "labels": {NOISE_LABEL: str(k)}}
        return "Service", namespace, name, {"metadata": meta}

    def service_annotation(self) -> NoiseWrite:
        k = self._tick()
        _, namespace, name = self.cluster.labelled[k % len(self.cluster.labelled)]
        annotations = {NOISE_ANNOTATION: f"rollout {k}", "example.com/owner": f"team-{k % 7}"}
        meta = {"resourceVersion": self.writer.next_version(), "annotations": annotations}
        return "Service", namespace, name, {"metadata": meta}

    def slice_metadata(self) -> NoiseWrite:
        k = self._tick()
        index, _, _ = self.cluster.labelled[k % len(self.cluster.labelled)]
        copy = self.cluster.slices[index][0]
        meta = {
            "resourceVersion": self.writer.next_version(),
            "labels": {NOISE_LABEL: str(k)},
            "annotations": {NOISE_ANNOTATION: f"reconciled {k}"},
        }
        return "EndpointSlice", copy.namespace, copy.name, {"metadata": meta}

    def resend(self) -> NoiseWrite:
        """The whole object again (a re-PUT; kmock 0.8 has no PUT, and a merge PATCH of
        the whole object is the same), differing only in resourceVersion."""
        obj = self.cluster.resend[self._tick() % len(self.cluster.resend)]
        obj["metadata"]["resourceVersion"] = self.writer.next_version()
        return obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"], obj

    def other_node_hint(self) -> NoiseWrite:
        """A ready endpoint of a Service without hints gets a node hint naming another
        node (or another one): kube-proxy ignores hints unless every ready endpoint has
        one, and the compiler's backends carry no hints, so no entry can change. (This
        one is a real change to the store: the slice's decoded value differs.)"""
        k = self._tick()
        copy = self.cluster.hinted[k % len(self.cluster.hinted)]
        node = self.cluster.other_nodes[k % len(self.cluster.other_nodes)]
        copy.endpoints[copy.hinted]["hints"] = {"forNodes": [{"name": node}]}
        patch = {
            "metadata": {"resourceVersion": self.writer.next_version()},
            "endpoints": copy.endpoints,
        }
        return "EndpointSlice", copy.namespace, copy.name, patch

    def other_node_status(self) -> NoiseWrite:
        k = self._tick()
        node = self.cluster.other_nodes[k % len(self.cluster.other_nodes)]
        return "Node", None, node, self._node_status(k, annotations=True)

    def own_node_status(self) -> NoiseWrite:
        return "Node", None, THIS_NODE, self._node_status(self._tick(), annotations=False)

    def _node_status(self, k: int, annotations: bool) -> Obj:
        stamp = now_rfc3339()
        meta: Obj = {"resourceVersion": self.writer.next_version()}
        if annotations:
            meta["annotations"] = {
                "node.alpha.kubernetes.io/ttl": "0",
                "volumes.kubernetes.io/controller-managed-attach-detach": "true",
                NOISE_ANNOTATION: f"heartbeat {k}",
            }
        conditions = [
            {
                "type": kind,
                "status": "True" if kind == "Ready" else "False",
                "lastHeartbeatTime": stamp,
                "lastTransitionTime": "2025-01-15T10:00:00Z",
                "reason": "KubeletReady" if kind == "Ready" else f"KubeletHasNo{kind}",
            }
            for kind in ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure")
        ]
        return {"metadata": meta, "status": {"conditions": conditions}}

    def categories(self) -> list[tuple[str, str, Callable[[], NoiseWrite]]]:
        return [
            ("service_labels", "Service labels", self.service_label),
            ("service_annotations", "Service annotations", self.service_annotation),
            ("slice_metadata", "EndpointSlice labels + annotations", self.slice_metadata),
            ("resend", "resourceVersion only (whole object re-sent)", self.resend),
            (
                "other_node_hints",
                "other nodes' hints, Services without hints",
                self.other_node_hint,
            ),
            ("other_node_status", "other nodes' status + annotations", self.other_node_status),
            ("own_node_status", "this node's status heartbeat", self.own_node_status),
        ]


def initial_sync(agent: Agent, cluster: Cluster, result: SizeResult) -> bool:
    """Start the agent; time the lists, the first apply and kmock's replay of every object
    as ADDED on the new watches. True when it all happened."""
    before_cpu = agent.kmock.cpu_seconds()
    probe = agent.probe
    started = time.perf_counter()
    agent.start()
    deadline = time.monotonic() + 600
    while not agent.dataplane.applied and time.monotonic() < deadline:
        time.sleep(0.005)
    ok = bool(agent.dataplane.applied)
    seen_applied = time.perf_counter()
    # kmock ignores resourceVersion: each watch replays every object as ADDED.
    replay_ok = agent.settle(cluster.total, timeout=600)
    replayed = time.perf_counter()
    first = next((r for r in probe.syncs if r.apply_at is not None), None)
    applied = first.apply_at if first and first.apply_at else seen_applied
    pauses = probe.gc_between(started, applied)
    lists = {
        name: {
            "fetch_and_json_s": t.get("fetch_and_json_s"),
            "list_s": t.get("list_s"),
            "start_to_listed_s": t["done_at"] - started if "done_at" in t else None,
        }
        for name, t in probe.lists.items()
    }
    result.initial = {
        "start_to_synced_s": (probe.synced_at or replayed) - started,
        "start_to_first_apply_s": applied - started,
        "lists": lists,
        "first_sync_compile_s": first.compile_s if first else None,
        "first_apply_fake_s": first.apply_s if first else None,
        "first_apply_writes": first.writes if first else None,
        "entries": len(first.state.services) if first and first.state else 0,
        "gc_until_first_apply_s": sum(p[1] for p in pauses),
        "gc_collections_until_first_apply": [sum(1 for p in pauses if p[2] == g) for g in range(3)],
        "start_to_replay_done_s": replayed - started,
        "replay_complete": replay_ok,
        "kmock_cpu_s": agent.kmock.cpu_seconds() - before_cpu,
        "agent_cpu_s": sum(agent.thread_cpu().values()),
        "thread_cpu_s": agent.thread_cpu(),
    }
    return ok and replay_ok


def replay_counts(agent: Agent) -> dict[str, Any]:
    """PB-7's first row: kmock's replay of every object on each new watch (unchanged
    objects; the lists stored each of them once)."""
    events = agent.events()
    applied = [r for r in agent.probe.syncs if r.apply_at is not None]
    with agent.store.lock:
        store_events = sum(agent.store.counts.events.values())
        changes = sum(agent.store.counts.changes.values())
    return {
        "key": "replay",
        "label": "watch replay after the lists (kmock)",
        "api_writes": 0,
        "api_events": events["ADDED"],
        "list_items": events["LIST"],
        "store_events": store_events - events["LIST"],
        "store_changes": changes - events["LIST"],  # every listed object was new
        "revisions": agent.sample("kbp_nodestate_revisions_total") - 1,  # beyond the first
        "applies": len(agent.dataplane.applied) - 1,
        "kernel_writes": sum(r.writes for r in applied[1:]),
    }


def pb7(agent: Agent, cluster: Cluster, writer: Writer, plan: Plan, result: SizeResult) -> None:
    noise = Noise(cluster, writer)
    expected = agent.watch_events()
    for key, label, make in noise.categories():
        before = agent.snapshot()
        for _ in range(plan.noise_per_category):
            writer.patch(*make())
        expected += plan.noise_per_category
        settled = agent.settle(expected)
        row = {"key": key, "label": label, "api_writes": plan.noise_per_category, "noise": True}
        row.update(agent.snapshot().minus(before), settled=settled)
        result.pb7.append(row)
        print(f"  PB-7 {label}: {row['api_events']:.0f} events", flush=True)
    # The mixed stream: every 100th write a real change, the rest noise in turn.
    makers = [make for _, _, make in noise.categories()]
    before = agent.snapshot()
    controls = 0
    for k in range(plan.mixed):
        if k % 100 == 50:
            change, patch = cluster.flip(cluster.take_controls(1)[0], writer.next_version())
            writer.patch("EndpointSlice", change.slice_.namespace, change.slice_.name, patch)
            controls += 1
        else:
            writer.patch(*makers[k % len(makers)]())
    expected += plan.mixed
    settled = agent.settle(expected)
    row = {
        "key": "mixed",
        "label": "mixed stream, 1 % real changes",
        "api_writes": plan.mixed,
        "real_changes": controls,
        "noise": False,
    }
    row.update(agent.snapshot().minus(before), settled=settled)
    result.pb7.append(row)


def pb5_steady(agent: Agent, cluster: Cluster, writer: Writer, plan: Plan) -> list[Change]:
    probe = agent.probe
    probe.clear()
    probe.recording = True
    changes: list[Change] = []
    interval = 1.0 / plan.rate
    expected = agent.watch_events()
    next_at = time.perf_counter()
    for copy in cluster.take_controls(plan.changes):
        # Single changes: the previous one received and the sync loop idle first (a
        # stall in kmock must not turn the next writes into a burst).
        agent.settle(expected, quiet=0.005)
        delay = next_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        next_at = max(next_at, time.perf_counter()) + interval
        change, patch = cluster.flip(copy, writer.next_version())
        change.written, _ = writer.patch("EndpointSlice", copy.namespace, copy.name, patch)
        changes.append(change)
        expected += 1
    agent.settle(expected)
    probe.recording = False
    match(changes, probe)
    return changes


def pb5_burst(
    agent: Agent, cluster: Cluster, writer: Writer, plan: Plan, interval: float, defer: bool
) -> tuple[list[Change], dict[str, Any]]:
    """`plan.burst` changes published by kmock one every `interval` seconds (0: all at
    once); count the applies that resulted. `defer`: the FakeDataplane's diff runs after
    the burst (see RecordingDataplane), leaving the sync thread to the agent.

    Through kmock's control channel rather than HTTP PATCHes: kmock's PATCH handler scans
    every object (13 ms a write at 10k Services), so HTTP writes cannot reach 100/s.
    The watch events are the ones its PATCH handler would send, over the same HTTP
    streams."""
    probe = agent.probe
    probe.clear()
    probe.recording = True
    expected = agent.watch_events()
    before = agent.snapshot()
    syncs_before = len(probe.syncs)
    changes: list[Change] = []
    batch = []
    for copy in cluster.take_controls(min(plan.burst, len(cluster.controls))):
        change, patch = cluster.flip(copy, writer.next_version())
        batch.append(["EndpointSlice", copy.namespace, copy.name, patch])
        changes.append(change)
    held = agent.dataplane.held
    agent.dataplane.defer = defer
    sent = time.perf_counter()
    put_at = agent.kmock.burst(batch, interval)
    for change, at in zip(changes, put_at, strict=True):
        change.written = at
    settled = agent.settle(expected + len(changes))
    probe.recording = False
    agent.dataplane.defer = False
    agent.dataplane.count_deferred(held, agent.metrics)
    after = agent.snapshot()
    match(changes, probe)
    applied = [c.sync.apply_at for c in changes if c.sync and c.sync.apply_at is not None]
    arrivals = [c.arrived for c in changes if c.arrived is not None]
    records = [r for r in probe.syncs[syncs_before:] if r.apply_at is not None]
    first = min(put_at)
    last = max(applied) if applied else None
    summary = {
        "changes": len(changes),
        "interval_s": interval,
        "fake_diff_deferred": defer,
        "command_to_first_put_s": first - sent,
        "put_span_s": max(put_at) - first,
        "arrival_span_s": (max(arrivals) - min(arrivals)) if arrivals else None,
        "applies": len(records),
        "changes_per_apply": len(changes) / max(1, len(records)),
        "syncs": len(probe.syncs) - syncs_before,
        "first_put_to_last_apply_s": (last - first) if last is not None else None,
        "fake_apply_s": sum(r.apply_s for r in records),
        "compile_s": sum(r.compile_s for r in probe.syncs[syncs_before:]),
        "bookkeeping_s": sum(r.bookkeeping_s for r in probe.syncs[syncs_before:]),
        "gc_s": sum(p[1] for p in probe.gc_between(first, last or first)),
        "missed": sum(1 for c in changes if c.sync is None),
        "settled": settled,
        **{k: v for k, v in after.minus(before).items() if k != "api_events_by_type"},
    }
    return changes, summary


# --- one size ----------------------------------------------------------------------------


def kmock_costs(kmock_process: KmockProcess, writer: Writer) -> dict[str, Any]:
    """kmock's own cost, measured before the agent starts: a LIST of each resource over
    HTTP (server + transfer) and its JSON decode in this process."""
    out: dict[str, Any] = {"load_in_process_s": kmock_process.load_s}
    for resource, path in LIST_PATHS.items():
        cpu = kmock_process.cpu_seconds()
        body, seconds = writer.get(path)
        started = time.perf_counter()
        items = len(json.loads(body)["items"])
        decode = time.perf_counter() - started
        out[resource] = {
            "list_s": seconds,
            "bytes": len(body),
            "items": items,
            "json_decode_s": decode,
            "kmock_cpu_s": kmock_process.cpu_seconds() - cpu,
        }
    return out


def run_size(workload: Workload, plan: Plan, log: IO[str], profile: bool) -> SizeResult:
    result = SizeResult(workload)
    began = time.perf_counter()
    kmock_process = KmockProcess(workload, log)
    cluster = Cluster(workload)
    if cluster.fingerprint != kmock_process.fingerprint:
        raise RuntimeError("kmock and the benchmark generated different clusters")
    print(
        f"  kmock up in {time.perf_counter() - began:.1f} s ({cluster.total} objects); "
        f"pools: {len(cluster.controls)} control, {len(cluster.hinted)} hint slices",
        flush=True,
    )
    writer = Writer(kmock_process.port)
    agent = Agent(kmock_process)
    result.kmock["objects"] = cluster.total
    if profile:
        agent.probe.profiler = cProfile.Profile()
    try:
        result.kmock.update(kmock_costs(kmock_process, writer))
        if not initial_sync(agent, cluster, result):
            print("  the initial sync did not complete", flush=True)
            return result
        print(f"  initial sync in {result.initial['start_to_first_apply_s']:.2f} s", flush=True)
        result.pb7.append(replay_counts(agent))
        # The controls must start out ready and programmed, or the checks mean nothing.
        held = agent.dataplane.held
        assert held is not None
        for copy in cluster.controls:
            ip = copy.endpoints[copy.flip]["addresses"][0]
            if not reflects(held, Change(copy, ip, True)):
                raise RuntimeError(f"control {copy.namespace}/{copy.service} is not as expected")
        agent.probe.profiling = profile
        writes_before = len(writer.round_trips)
        pb7(agent, cluster, writer, plan, result)
        noise_trips = writer.round_trips[writes_before:]
        phase_start = time.perf_counter()
        steady = pb5_steady(agent, cluster, writer, plan)
        steady_pauses = agent.probe.gc_between(phase_start, time.perf_counter())
        print(f"  PB-5 steady: {len(steady)} changes", flush=True)
        bursts = {}
        for key, interval in BURSTS:
            for defer in (False, True):
                name = key + ("_deferred" if defer else "")
                spacing = interval * plan.burst_seconds / plan.burst
                bursts[name] = pb5_burst(agent, cluster, writer, plan, spacing, defer)
        agent.probe.profiling = False
        result.pb5 = {"steady": steady, "steady_gc": steady_pauses, "bursts": bursts}
        result.kmock["patch_round_trip"] = Stat(noise_trips).to_json()
        rows = [r for r in result.pb7 if r["key"] != "replay"]
        result.kmock["cpu_per_write_s"] = sum(r["kmock_cpu_s"] for r in rows) / max(
            1, sum(r["api_writes"] for r in rows)
        )
        # The end state must be what a full compile of the store gives.
        with agent.store.lock:
            full = compile(agent.store.state, THIS_NODE, CompileOptions())
        held = agent.dataplane.held
        result.checks = {
            "held_equals_full_compile": held is not None and held.revision == full.revision,
            "kernel_writes_metric_equals_fake_writes": agent.sample(
                "kbp_kernel_writes_total", {"dataplane": "fake"}
            )
            == agent.dataplane.writes,
            "sync_errors": sum(
                sample.value
                for metric in agent.metrics.sync_errors.collect()
                for sample in metric.samples
                if sample.name.endswith("_total")
            ),
            "events_equal_writes": all(
                r["api_events"] == r["api_writes"] and r["settled"] for r in rows
            ),
        }
    finally:
        agent.stop()
        writer.close()
        kmock_process.close()
    if agent.probe.profiler is not None:
        write_profile(agent.probe.profiler, workload)
    return result


def write_profile(profiler: cProfile.Profile, workload: Workload) -> None:
    out = RESULTS / f"control_plane-profile-{workload.services}x{workload.endpoints}.txt"
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        f"== cProfile of the sync thread during PB-7 and PB-5, {workload.services} Services x "
        f"{workload.endpoints} endpoints (FakeDataplane.apply included) ==\n{text.getvalue()}"
    )
    profiler.dump_stats(out.with_suffix(".prof"))
    print(f"  profile of the sync thread: {out}", flush=True)


# --- output ------------------------------------------------------------------------------


def pct(value: float) -> str:
    return f"{value:.2%}" if value < 0.1 else f"{value:.1%}"


def fmt_opt(seconds: float | None) -> str:
    return "-" if seconds is None else fmt_s(seconds)


def print_setup(result: SizeResult) -> None:
    k, i = result.kmock, result.initial
    names = list(LIST_PATHS)
    print("\n### setup: kmock's own cost, and the initial sync (wall clock unless CPU)")

    def line(metric: str, value: str) -> None:
        print(f"{metric:<52} {value}")

    line("kmock: load the objects (its process, no HTTP)", fmt_s(k["load_in_process_s"]))
    line(
        "kmock: LIST over HTTP (services/slices/nodes)",
        " / ".join(f"{fmt_s(k[n]['list_s'])} ({k[n]['bytes'] / 2**20:.1f} MiB)" for n in names),
    )
    line(
        "here: JSON decode of those LISTs (the floor)",
        " / ".join(fmt_s(k[n]["json_decode_s"]) for n in names),
    )
    if "patch_round_trip" in k:
        trips = k["patch_round_trip"]
        line(
            "kmock: PATCH round trip (PB-7's writes)",
            f"median {fmt_s(trips['median'])}, p99 {fmt_s(trips['p99'])}; kmock CPU "
            f"{fmt_s(k['cpu_per_write_s'])} per write",
        )
    if not i:
        return
    lists = i["lists"]
    line(
        "agent: list fetch + JSON (services/slices/nodes)",
        " / ".join(fmt_opt(lists.get(n, {}).get("fetch_and_json_s")) for n in names),
    )
    line(
        "agent: whole list with decode + store (same)",
        " / ".join(fmt_opt(lists.get(n, {}).get("list_s")) for n in names),
    )
    line("agent: start → every list in the store", fmt_s(i["start_to_synced_s"]))
    line(
        "agent: start → first apply (full NodeState)",
        f"{fmt_s(i['start_to_first_apply_s'])}; compile {fmt_opt(i['first_sync_compile_s'])}, "
        f"fake apply {fmt_opt(i['first_apply_fake_s'])}, {i['entries']} entries",
    )
    gens = i["gc_collections_until_first_apply"]
    line(
        "agent process: cyclic GC until the first apply",
        f"{fmt_s(i['gc_until_first_apply_s'])} in {gens[0]}/{gens[1]}/{gens[2]} collections "
        "(gen 0/1/2)",
    )
    line(
        "agent: start → kmock's watch replay absorbed",
        f"{fmt_s(i['start_to_replay_done_s'])}; CPU: agent {i['agent_cpu_s']:.1f} s, kmock "
        f"{i['kmock_cpu_s']:.1f} s",
    )


def print_pb7(result: SizeResult) -> None:
    print("\n### PB-7: API events → store changes → NodeState revisions → applies → kernel writes")
    header = (
        f"{'updates written through the API':<44} {'writes':>6} {'events':>6} {'store':>6} "
        f"{'revs':>5} {'apply':>5} {'kwr':>4} {'µs/ev':>6} {'revs/ev':>8}  {'target':<22} "
        f"{'':4}"
    )
    print(header)
    print("-" * len(header))
    print(
        "(store: real changes in the StateStore; revs: NodeState revisions; apply: dataplane\n"
        " applies; kwr: kernel writes (entries the FakeDataplane wrote); µs/ev: agent CPU per\n"
        " event, watch + sync threads, from /proc in 10 ms ticks)"
    )
    totals = dict.fromkeys(("events", "revisions", "applies", "kernel_writes"), 0.0)
    for row in result.pb7:
        events = row["api_events"]
        ratio = row["revisions"] / max(1, events)
        if row["key"] == "replay":
            ok = row["revisions"] == 0 and row["kernel_writes"] == 0
            print(
                f"{row['label']:<44} {'':>6} {events:>6.0f} {row['store_changes']:>6.0f} "
                f"{row['revisions']:>5.0f} {row['applies']:>5} {row['kernel_writes']:>4} "
                f"{'':>6} {pct(ratio):>8}  {'0 revisions, 0 writes':<22} {mark(ok):4}"
            )
            continue
        cpu = row["agent_cpu_s"] / max(1, events) * 1e6
        if row["noise"]:
            for key in totals:
                totals[key] += row["api_events" if key == "events" else key]
            target = "0 revisions, 0 writes"
            ok = row["revisions"] == 0 and row["kernel_writes"] == 0 and row["applies"] == 0
            label = row["label"]
        else:
            target = f"≤ {TARGET_REVISIONS_PER_EVENT:.0%} revs/event"
            ok = ratio <= TARGET_REVISIONS_PER_EVENT
            label = f"{row['label']} ({row['real_changes']} real)"
        lost = "" if events == row["api_writes"] and row["settled"] else "  (events ≠ writes!)"
        print(
            f"{label:<44} {row['api_writes']:>6} {events:>6.0f} {row['store_changes']:>6} "
            f"{row['revisions']:>5.0f} {row['applies']:>5} {row['kernel_writes']:>4} "
            f"{cpu:>6.0f} {pct(ratio):>8}  {target:<22} {mark(ok):4}{lost}"
        )
    ok = totals["revisions"] == 0 and totals["kernel_writes"] == 0
    print(
        f"{'all noise-only updates':<44} {'':>6} {totals['events']:>6.0f} {'':>6} "
        f"{totals['revisions']:>5.0f} {totals['applies']:>5.0f} {totals['kernel_writes']:>4.0f} "
        f"{'':>6} {pct(totals['revisions'] / max(1, totals['events'])):>8}  "
        f"{'0 writes for no-op':<22} {mark(ok):4}"
    )
    print(f"reference: {REF_PB7}")


def print_pb5(result: SizeResult, plan: Plan) -> None:
    pb5 = result.pb5
    print(
        f"\n### PB-5 (control plane): one endpoint's readiness flips in one slice, "
        f"{len(pb5['steady'])} changes at {plan.rate:g}/s, written over HTTP"
    )
    header = (
        f"{'metric':<46} {'median':>9} {'p99/max':>9} {'min-max':>19} {'n':>4}  "
        f"{'target':<16} {'':4}"
    )
    print(header)
    print("-" * len(header))
    print("(p99 = max when n < 100; indented rows are parts of the row above them)")
    lat = Latencies.of(pb5["steady"])
    rows = [
        ("API write → apply called (incl. kmock)", lat.write_to_apply, None),
        ("  API write → event arrival (kmock + HTTP)", lat.write_to_arrival, None),
        ("  event arrival → apply called", lat.arrival_to_apply, TARGET_ARRIVAL_TO_APPLY_P99),
        ("    arrival → store upsert (JSON + decode)", lat.arrival_to_upsert, None),
        ("    store upsert → sync starts (wake-up)", lat.upsert_to_sync, None),
        ("    sync start → apply called", lat.sync_to_apply, None),
        ("      of which Compiler.update", lat.compile, None),
        ("after apply: FakeDataplane.apply itself", lat.fake_apply, None),
        ("after apply: SyncLoop._succeeded", lat.bookkeeping, None),
    ]
    for label, samples, limit in rows:
        if not samples:
            print(f"{label:<46} {'no samples':>9}")
            continue
        s = Stat(samples)
        target = f"p99 ≤ {fmt_s(limit)}" if limit is not None else ""
        ok = mark(s.p99 <= limit) if limit is not None else ""
        spread = f"{fmt_s(min(samples))}-{fmt_s(max(samples))}"
        print(
            f"{label:<46} {fmt_s(s.median):>9} {fmt_s(s.p99):>9} {spread:>19} {len(samples):>4}  "
            f"{target:<16} {ok:4}"
        )
    if lat.missed:
        print(f"changes never seen applied: {lat.missed}  MISS")
    pauses = pb5["steady_gc"]
    hit = sum(
        1
        for c in pb5["steady"]
        if c.arrived is not None
        and c.sync is not None
        and c.sync.apply_at is not None
        and any(c.written <= p[0] < c.sync.apply_at for p in pauses)
    )
    print(
        f"cyclic GC in this process during the phase: {len(pauses)} collections, "
        f"max {fmt_s(max((p[1] for p in pauses), default=0))}, "
        f"total {fmt_s(sum(p[1] for p in pauses))}; {hit} changes had one between write and apply"
    )
    print(f"reference: {REF_PB5}")

    count = next(iter(pb5["bursts"].values()))[1]["changes"]
    print(f"\n### PB-5: bursts of {count} changes (distinct Services), published by kmock")
    header = (
        f"{'burst':<28} {'applies':>7} {'per':>5} {'kwr':>4} {'events over':>11} "
        f"{'→last apply':>11} {'ev→apply p99':>12} {'fake':>8} {'_succ':>7} {'compile':>8}  "
        f"{'target':<18} {'':4}"
    )
    print(header)
    print("-" * len(header))
    print(
        "(per: changes per apply; →last apply: first event put → last change applied; fake,\n"
        " _succ, compile: time the sync thread spent in FakeDataplane.apply, SyncLoop._succeeded\n"
        " and Compiler.update during the burst; fake deferred: the FakeDataplane's diff is run\n"
        " after the burst, so the sync thread does only the agent's work)"
    )
    spacing = plan.burst_seconds / plan.burst
    labels = {"paced": f"1 per {spacing * 1e3:g} ms", "at_once": "all at once"}
    for name, (changes, summary) in pb5["bursts"].items():
        key = name.removesuffix("_deferred")
        label = labels[key] + (", fake deferred" if summary["fake_diff_deferred"] else "")
        target, ok, p99 = burst_verdict(key, changes, summary)
        print(
            f"{label:<28} {summary['applies']:>7} {summary['changes_per_apply']:>5.1f} "
            f"{summary['kernel_writes']:>4} {fmt_opt(summary['arrival_span_s']):>11} "
            f"{fmt_opt(summary['first_put_to_last_apply_s']):>11} {fmt_opt(p99):>12} "
            f"{fmt_s(summary['fake_apply_s']):>8} {fmt_s(summary['bookkeeping_s']):>7} "
            f"{fmt_s(summary['compile_s']):>8}  {target:<18} {mark(ok):4}"
            + (f"  missed {summary['missed']}" if summary["missed"] else "")
        )


def burst_verdict(
    key: str, changes: list[Change], summary: dict[str, Any]
) -> tuple[str, bool, float | None]:
    """(target, met, event arrival → apply p99) of one burst. All at once: coalesced into
    a few applies. Paced (100 in 1 s): each change still applied within PB-5's 10 ms."""
    lat = Latencies.of(changes)
    p99 = Stat(lat.arrival_to_apply).p99 if lat.arrival_to_apply else None
    if key == "at_once":
        target = f"≤ {TARGET_BURST_APPLIES} applies"
        ok = summary["applies"] <= TARGET_BURST_APPLIES
    else:
        target = f"ev→apply p99 ≤ {fmt_s(TARGET_ARRIVAL_TO_APPLY_P99)}"
        ok = p99 is not None and p99 <= TARGET_ARRIVAL_TO_APPLY_P99
    return target, ok and not summary["missed"], p99


def print_size(result: SizeResult, plan: Plan) -> None:
    w = result.workload
    print(
        f"\n## {w.services} Services x {w.endpoints} endpoints on {w.nodes} nodes "
        f"({result.kmock.get('objects', '?')} objects in kmock), node {THIS_NODE}"
    )
    print_setup(result)
    if not result.pb7:
        print("(no further figures: the initial sync did not complete)")
        return
    print_pb7(result)
    if result.pb5:
        print_pb5(result, plan)
    checks = result.checks
    print(
        f"\nchecks: final NodeState = full compile of the store: "
        f"{checks.get('held_equals_full_compile')}; kbp_kernel_writes_total = fake writes: "
        f"{checks.get('kernel_writes_metric_equals_fake_writes')}; one event per write: "
        f"{checks.get('events_equal_writes')}; sync errors: {checks.get('sync_errors')}"
    )


def change_json(changes: list[Change]) -> dict[str, Any]:
    lat = Latencies.of(changes)
    out: dict[str, Any] = {"n": len(changes), "missed": lat.missed}
    for name in (
        "write_to_apply",
        "write_to_arrival",
        "arrival_to_apply",
        "arrival_to_upsert",
        "upsert_to_sync",
        "sync_to_apply",
        "compile",
        "fake_apply",
        "bookkeeping",
    ):
        samples = getattr(lat, name)
        if samples:
            out[name] = {**Stat(samples).to_json(), "unit": "s"}
    return out


def pb7_json(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        row = dict(row)
        events = row["api_events"]
        row["revisions_per_event"] = row["revisions"] / max(1, events)
        if row["key"] == "mixed":
            row["target"] = f"revisions/event <= {TARGET_REVISIONS_PER_EVENT}"
            row["mark"] = mark(row["revisions_per_event"] <= TARGET_REVISIONS_PER_EVENT)
        else:
            row["target"] = "0 revisions, 0 kernel writes"
            row["mark"] = mark(row["revisions"] == 0 and row["kernel_writes"] == 0)
        out.append(row)
    return out


def to_json(
    results: list[SizeResult], args: argparse.Namespace, plan: Plan, info: Obj, seconds: float
) -> Obj:
    sizes = []
    for res in results:
        pb5: dict[str, Any] = {}
        if res.pb5:
            steady = change_json(res.pb5["steady"])
            arrival = steady.get("arrival_to_apply")
            if arrival:
                arrival["target"] = f"p99 <= {TARGET_ARRIVAL_TO_APPLY_P99}"
                arrival["mark"] = mark(arrival["p99"] <= TARGET_ARRIVAL_TO_APPLY_P99)
            pauses = res.pb5["steady_gc"]
            steady["gc"] = {
                "collections": len(pauses),
                "max_s": max((p[1] for p in pauses), default=0.0),
                "total_s": sum(p[1] for p in pauses),
            }
            pb5 = {"steady": steady}
            for name, (changes, summary) in res.pb5["bursts"].items():
                target, ok, _ = burst_verdict(name.removesuffix("_deferred"), changes, summary)
                pb5[f"{name}_burst"] = {
                    **summary,
                    **change_json(changes),
                    "target": target,
                    "mark": mark(ok),
                }
        sizes.append(
            {
                "services": res.workload.services,
                "endpoints_per_service": res.workload.endpoints,
                "nodes": res.workload.nodes,
                "kmock": res.kmock,
                "initial_sync": res.initial,
                "pb7": pb7_json(res.pb7),
                "pb5": pb5,
                "checks": res.checks,
            }
        )
    return {
        "benchmark": "bench/control_plane.py",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": info,
        "node": THIS_NODE,
        "plan": plan.__dict__,
        "targets": {
            "revisions_per_event": TARGET_REVISIONS_PER_EVENT,
            "noise_kernel_writes": 0,
            "arrival_to_apply_p99_s": TARGET_ARRIVAL_TO_APPLY_P99,
            "at_once_burst_applies": TARGET_BURST_APPLIES,
        },
        "duration_s": seconds,
        "sizes": sizes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Benchmark the Kubernetes source + sync loop against kmock over HTTP: "
        "PB-7 noise coalescing and PB-5 change latency (not a test; always exits 0)."
    )
    parser.add_argument("--quick", action="store_true", help="1k Services only, < 1 minute")
    parser.add_argument(
        "--services", type=int, nargs="+", metavar="N", help="sizes (default 1000 10000)"
    )
    parser.add_argument("--endpoints", type=int, default=10, metavar="M", help="per Service")
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--noise", type=int, metavar="W", help="writes per noise category")
    parser.add_argument("--mixed", type=int, metavar="W", help="writes in the mixed stream")
    parser.add_argument("--changes", type=int, default=200, help="PB-5 steady changes")
    parser.add_argument("--rate", type=float, help="PB-5 steady changes per second")
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the sync thread during PB-7 and PB-5 (bench/results/...-profile-*.txt)",
    )
    args = parser.parse_args(argv)

    sizes = args.services or ([1000] if args.quick else [1000, 10_000])
    if min(sizes) < 100 or not 3 <= args.endpoints <= 100:
        parser.error("needs --services ≥ 100 and 3 ≤ --endpoints ≤ 100 (one slice a Service)")
    plan = Plan(
        noise_per_category=args.noise or (100 if args.quick else 200),
        mixed=args.mixed or (1000 if args.quick else 2000),
        changes=args.changes,
        rate=args.rate or (20.0 if args.quick else 10.0),
        burst=100,
        burst_seconds=1.0,
    )
    info = machine()
    print(
        f"bench/control_plane.py: Python {info['python']} ({info['implementation']}), "
        f"{info['cpus']} CPUs ({info['cpu_model']}), kernel {info['kernel']}; "
        f"commit {info['commit']}; load average {info['load_average_at_start'][0]}; "
        f"kmock in its own process, the agent (source + store + sync loop + fake dataplane) "
        f"in this one; times are wall clock"
    )
    began = time.perf_counter()
    results = []
    with tempfile.NamedTemporaryFile(
        "w", prefix="kbp-bench-kmock-", suffix=".log", delete=False
    ) as log:
        for n in sizes:
            workload = Workload(n, args.endpoints, 0, args.nodes, args.seed)
            print(f"\n# {n} Services x {args.endpoints} endpoints ...", flush=True)
            result = run_size(workload, plan, log, args.profile)
            print_size(result, plan)
            results.append(result)
    if Path(log.name).stat().st_size == 0:
        Path(log.name).unlink()
    else:
        print(f"\nkmock's stderr: {log.name}")
    seconds = time.perf_counter() - began
    out = results_path(args, "control_plane")
    write_results(out, to_json(results, args, plan, info, seconds))
    print(f"\nran in {seconds:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
