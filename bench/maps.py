"""PB-4 (full sync, map-write phase), PB-5 (one change → last kernel write) and PB-8 (map
writes from Python, per element vs batch) against the real pinned maps of the eBPF
dataplane, each beside its floor measured in the same run.

PB-8: entries of the two big maps (`kbp_slots`: 8-byte key, 32-byte value, a copy of the
backend's entry and its id, since ABI 4; `kbp_backends`: 4-byte key, 28-byte value with an
address) written into the empty map one
`BPF_MAP_UPDATE_ELEM` at a time, as one `BPF_MAP_UPDATE_BATCH` of pre-encoded bytes (the
floor), and the way the dataplane writes them (codec.py encodes each entry, join, batch:
`dataplane._update`, with codec's address cache cold as at agent start); deletes alike.

PB-4: bench/compile.py's generated cluster (N Services x 10 endpoints, no headless ones,
nodePorts made unique) as one JSON LIST, synced into empty maps as the agent does at
start: decode (`load_manifests`), compile, `EbpfDataplane.apply(full=True)` (read the
maps, the planner's full plan, writes) with its `_write` timed inside; the plan (a
`Planner`'s full pass from empty maps, its diff and capacity included) and diff +
capacity check also timed on their own. Floors: `json.loads` of the file with the
cyclic GC off, and a raw batch write of the same elements, pre-encoded. Also the restart
path (read the maps back, plan and diff against them: no writes) and deleting everything.

PB-5: from that full sync, single changes timed from the event's JSON text to
`EbpfDataplane.apply` returning (decode → `Compiler.update` → apply: the planner's
incremental plan + writes): an endpoint turning not ready, an endpoint added, a Service
added, a Service deleted; paced (20/s, 100/s with --quick), each after the previous one
finished. Then a burst of 100 readiness changes coalesced into one apply, and the same
undone one by one without pause. The floor of a change: decoding its event plus one
batch write of as many pre-encoded elements as it wrote. At the end the kernel's maps,
resolved to addresses, are compared with the oracle's translation (`translate`) of the
final state.

    .venv/bin/python -m bench.maps [--quick] [--services N ...] [--pb 4 5 8]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.dataplane.ebpf import codec
from agent.dataplane.ebpf.abi import const
from agent.dataplane.ebpf.dataplane import EbpfDataplane
from agent.dataplane.ebpf.libbpf import Map
from agent.dataplane.ebpf.maps import (
    BackendValue,
    KernelContent,
    MapSizes,
    Writes,
    check_capacity,
    diff,
)
from agent.dataplane.ebpf.plan import Planner
from agent.dataplane.ebpf.slots import SlotSpace
from agent.dataplane.ebpf.translate import translate
from agent.model.compile import CompileOptions, Compiler, compile
from agent.model.decode import decode_object
from agent.model.nodestate import NodeState, revision_of
from agent.model.types import ClusterState
from agent.sources.manifests import load_manifests
from bench.common.kernel import bench_dataplane, bench_netns, leftovers
from bench.common.nodestates import BACKEND_BASE
from bench.common.report import (
    RESULTS,
    Summary,
    fmt_s,
    header,
    machine,
    mark,
    terminate_as_interrupt,
    write_results,
)
from bench.common.workload import (
    ENDPOINTS,
    THIS_NODE,
    Change,
    Cluster,
    generate,
    ipv4,
    make_changes,
    map_sizes_for_generated,
    set_objects,
    slices_of,
)

# Targets and anchors (bench/README.md, PB-4, PB-5, PB-8).
TARGET_FULL_SYNC_S_PER_10K = 3.0  # 10k x 10: JSON LIST → programmed maps ≤ 3 s (linear)
TARGET_WRITES_S_PER_10K = 0.5  # of which map writes ≤ 0.5 s
TARGET_CHANGE_P99_S = 0.010  # one change → last kernel write, p99 ≤ 10 ms
TARGET_FLAT = 1.5  # "flat from 1k to 30k", read as: p99 at the largest N ≤ 1.5 x at 1k
TARGET_BATCH_RATIO = 1.5  # the dataplane's batched writes within 1.5 x of the batch floor
REF_PB4 = (
    "iptables-restore of the equivalent kube-proxy ruleset here: 3.7-4.0 s (legacy), "
    "9.7-12.8 s (nft); kube-proxy nftables: minutes"
)
REF_PB5 = "kube-proxy nftables adds 1 Service beside 10k in ≈141 ms; iptables partial 0.6-0.9 s"
REF_PB8 = "batch 0.32-0.61 µs per element, per element from Python ≈2 µs (here, earlier)"
CHANGE_KINDS = ("not_ready", "endpoint_added", "service_added", "service_deleted")


# --- helpers -------------------------------------------------------------------------------


def seconds(fn: Callable[[], Any], gc_enabled: bool = True) -> tuple[float, Any]:
    """(wall seconds, result) of fn() after a full collection; the cyclic GC as asked."""
    gc.collect()
    if not gc_enabled:
        gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        return time.perf_counter() - start, result
    finally:
        gc.enable()


def fmt_row(label: str, s: Summary, extra: str = "", width: int = 46) -> str:
    spread = f"{fmt_s(min(s.samples))}-{fmt_s(max(s.samples))}"
    return (
        f"{label:<{width}} {fmt_s(s.median):>9} {fmt_s(s.p99):>9} {spread:>21} {len(s.samples):>4}"
        f"  {extra}"
    )


def map_of(dp: EbpfDataplane, name: str) -> Map:
    return dp.programs.map(name)


def encoded(writes: Writes) -> dict[str, tuple[bytes, bytes, int]]:
    """The upserts of `writes` as the batches the dataplane sends, pre-encoded; the sets
    one after the other from kbp_slots' index 1, as in empty maps."""
    values = {i: codec.backend_value(v) for i, v in writes.backends_to_upsert.items()}
    members = [b for content in writes.sets_to_write.values() for b in content]
    batches = {
        "kbp_backends": [(codec.backend_key(i), value) for i, value in values.items()],
        "kbp_slots": [
            (codec.slot_key(1 + i), codec.slot_value(b, values.get(b, codec.NO_COPY)))
            for i, b in enumerate(members)
        ],
        "kbp_services": [
            (codec.frontend_key(k), codec.service_value(v))
            for k, v in writes.services_to_upsert.items()
        ],
    }
    return {
        name: (b"".join(k for k, _ in items), b"".join(v for _, v in items), len(items))
        for name, items in batches.items()
        if items
    }


def scratch_slots(count: int, first: int = 1) -> tuple[bytes, bytes]:
    """`count` slots of kbp_slots (an array) from index `first`, which must be free."""
    keys = b"".join(codec.slot_key(first + i) for i in range(count))
    values = b"".join(codec.slot_value(i + 1, codec.NO_COPY) for i in range(count))
    return keys, values


def zeroed(target: Map, keys: bytes, count: int) -> None:
    """Free `count` slots of kbp_slots, as the dataplane frees a set's (an array's elements
    are zeroed, not deleted)."""
    target.update_batch(keys, codec.FREE_SLOT * count, count)


def empty_nodestate(like: NodeState) -> NodeState:
    return NodeState(like.node, revision_of(()), ())


# --- PB-8 ------------------------------------------------------------------------------------


@dataclass
class BatchResult:
    map: str
    count: int
    per_element: dict[str, Summary]  # method_op → seconds per element


@dataclass
class Elements:
    """`count` entries of one map three ways: pre-encoded bytes (joined and one by one),
    and the plan's values the dataplane encodes itself."""

    keys: bytes
    values: bytes
    key_list: list[bytes]
    value_list: list[bytes]
    agent_items: Callable[[], list[tuple[bytes, bytes]]]  # encode as dataplane._write does
    agent_keys: Callable[[], list[bytes]]


def slot_elements(count: int) -> Elements:
    """Sets of 1,024 slots one after the other from index 1 of the empty kbp_slots."""
    sets = {1 + s * 1024: tuple(range(s * 1024 + 1, min(count, (s + 1) * 1024) + 1))
            for s in range((count + 1023) // 1024)}  # fmt: skip
    keys, values = scratch_slots(count)
    return Elements(
        keys, values,
        [keys[i * 4 : (i + 1) * 4] for i in range(count)],
        [values[i * codec.SLOT_SIZE : (i + 1) * codec.SLOT_SIZE] for i in range(count)],
        lambda: [(codec.slot_key(base + index), codec.slot_value(backend_id, codec.NO_COPY))
                 for base, members in sets.items()
                 for index, backend_id in enumerate(members)],
        lambda: [codec.slot_key(base + index)
                 for base, members in sets.items() for index in range(len(members))],
    )  # fmt: skip


def backend_elements(count: int) -> Elements:
    """Backends with distinct addresses (10.128.0.0 + i), as many as a full sync has."""
    values_by_id = {
        i + 1: BackendValue(ipv4(BACKEND_BASE + i), 8080, const.KBP_FAMILY_IPV4, 0, 1 + i // 10)
        for i in range(count)
    }
    key_list = [codec.backend_key(i) for i in values_by_id]
    value_list = [codec.backend_value(v) for v in values_by_id.values()]

    def agent_items() -> list[tuple[bytes, bytes]]:
        return [(codec.backend_key(i), codec.backend_value(v)) for i, v in values_by_id.items()]

    return Elements(
        b"".join(key_list), b"".join(value_list), key_list, value_list, agent_items,
        lambda: [codec.backend_key(i) for i in values_by_id],
    )  # fmt: skip


PB8_MAPS = {"kbp_slots": slot_elements, "kbp_backends": backend_elements}


def pb8(dp: EbpfDataplane, counts: list[int], repeats: dict[int, int]) -> list[BatchResult]:
    out = []
    for name, elements_of in PB8_MAPS.items():
        for count in counts:
            print(f"  PB-8: {name}, {count} entries x {repeats[count]} ...", flush=True)
            out.append(pb8_size(name, map_of(dp, name), elements_of(count), count, repeats[count]))
    return out


def pb8_size(name: str, target: Map, e: Elements, count: int, repeat: int) -> BatchResult:
    """Insert `count` entries into the empty map and delete them again, three ways, in
    turn; seconds per element. The dataplane's way starts with codec's address cache
    cleared, as at agent start. kbp_slots is an array: its "delete" zeroes the slots, as
    the dataplane frees a set."""
    array = name == "kbp_slots"
    free = codec.FREE_SLOT

    def agent_update() -> None:
        target.update_items(e.agent_items())

    def agent_delete() -> None:
        if array:
            target.update_items([(k, free) for k in e.agent_keys()])
        else:
            target.delete_keys(e.agent_keys())

    def each_update() -> None:
        update = target.update
        for k, v in zip(e.key_list, e.value_list, strict=True):
            update(k, v)

    def each_delete() -> None:
        if array:
            update = target.update
            for k in e.key_list:
                update(k, free)
            return
        delete = target.delete
        for k in e.key_list:
            delete(k)

    def batch_delete() -> None:
        if array:
            zeroed(target, e.keys, count)
        else:
            target.delete_batch(e.keys, count)

    pairs = {
        "batch": (lambda: target.update_batch(e.keys, e.values, count), batch_delete),
        "agent": (agent_update, agent_delete),
        "each": (each_update, each_delete),
    }  # fmt: skip
    samples: dict[str, list[float]] = {}
    for r in range(repeat):
        order = list(pairs)
        for method in order[r % 3 :] + order[: r % 3]:
            insert, remove = pairs[method]
            if hasattr(codec._addr, "cache_clear"):  # an address cache starts cold
                codec._addr.cache_clear()
            took, _ = seconds(insert, gc_enabled=False)
            samples.setdefault(f"{method}_insert", []).append(took / count)
            took, _ = seconds(remove, gc_enabled=False)
            samples.setdefault(f"{method}_delete", []).append(took / count)
            left = ([k for k in e.key_list if target.lookup(k) != free] if array
                    else target.keys())  # fmt: skip
            assert not left, f"PB-8 left entries behind in {name}"
    return BatchResult(name, count, {k: Summary(v) for k, v in samples.items()})


def print_pb8(results: list[BatchResult]) -> list[dict[str, Any]]:
    print(f"\n## PB-8: map writes from Python into empty maps (µs per element); {REF_PB8}")
    head = (
        f"{'map':<13} {'entries':>8} {'op':<7} {'batch (floor)':>14} {'dataplane':>10} "
        f"{'ratio':>6} {'per element':>12} {'ratio':>6}  target"
    )
    print(head)
    print("-" * len(head))
    report = []
    for r in results:
        for op in ("insert", "delete"):
            floor = r.per_element[f"batch_{op}"].median
            agent = r.per_element[f"agent_{op}"].median
            each = r.per_element[f"each_{op}"].median
            ok = mark(agent <= TARGET_BATCH_RATIO * floor)
            print(
                f"{r.map:<13} {r.count:>8} {op:<7} {floor * 1e6:>14.3f} {agent * 1e6:>10.3f} "
                f"{agent / floor:>5.2f}x {each * 1e6:>12.3f} {each / floor:>5.1f}x  "
                f"dataplane ≤ {TARGET_BATCH_RATIO}x floor {ok}"
            )
            report.append({
                "map": r.map, "entries": r.count, "op": op, "mark": ok,
                **{m: r.per_element[f"{m}_{op}"].to_json() for m in ("batch", "agent", "each")},
            })  # fmt: skip
    print(
        "(median over repeats; 'dataplane' = codec encode + join + batch, as a full sync "
        "writes, codec's address cache cleared first; 'per element' = Map.update/delete in a "
        "Python loop, bytes pre-encoded)"
    )
    return report


# --- PB-4 ------------------------------------------------------------------------------------


@dataclass
class FullSync:
    services: int
    entries: int
    elements: int  # map elements written by the full sync
    endpoints: int
    phases: dict[str, Summary] = field(default_factory=dict)  # seconds


PHASES = (
    ("decode_floor", "floor: json.loads of the LIST, GC off"),
    ("decode", "decode: load_manifests → ClusterState"),
    ("compile", "compile → NodeState"),
    ("plan", "  (plan alone: Planner.plan, full)"),
    ("diff", "  (diff + capacity check alone)"),
    ("apply", "EbpfDataplane.apply(full=True), empty maps"),
    ("write_floor", "floor: raw batch write, pre-encoded"),
    ("write", "  of which map writes (_write)"),
    ("total", "full sync: decode → last write"),
    ("restart", "restart: read maps + plan + diff (0 writes)"),
    ("delete_all", "delete everything (empty NodeState)"),
)


def pb4(dp: EbpfDataplane, cluster: Cluster, repeat: int) -> FullSync:
    print(f"  PB-4: {cluster.workload.services} Services x {repeat} ...", flush=True)
    samples: dict[str, list[float]] = {name: [] for name, _ in PHASES}
    text = cluster.path.read_text()
    result: FullSync | None = None
    for _ in range(repeat):
        result = pb4_once(dp, cluster, text, samples)
    assert result is not None
    result.phases = {name: Summary(v) for name, v in samples.items()}
    return result


def pb4_once(
    dp: EbpfDataplane, cluster: Cluster, text: str, samples: dict[str, list[float]]
) -> FullSync:
    """One full sync into empty maps as the agent makes it at start (decode, compile,
    `apply(full=True)`: read the empty maps, plan, writes), with plan and diff also
    timed on their own; then the restart path, deleting everything, and the floor's raw
    batch write of the same elements (removed again)."""
    assert not dp.maps.current.services, "maps not empty"
    took, _ = seconds(lambda: json.loads(text), gc_enabled=False)
    samples["decode_floor"].append(took)
    decode, (state, _) = seconds(lambda: load_manifests([cluster.path]))
    comp, nodestate = seconds(lambda: compile(state, THIS_NODE, CompileOptions()))
    empty = KernelContent()
    planner = dp.maps.planner
    plan_s, change = seconds(lambda: Planner(
        empty, maglev_table_size=planner.maglev_table_size, sizes=planner.sizes,
    ).plan(nodestate))  # fmt: skip
    desired = change.content

    def diff_and_check() -> Writes:
        writes = diff(empty, desired)
        check_capacity(empty, desired, writes, dp.maps.sizes)
        return writes

    diff_s, writes = seconds(diff_and_check)
    # The real path; its map writes timed by wrapping the instance's _write.
    write_times: list[float] = []
    written: list[Writes] = []
    write = dp.maps._write

    def timed_write(w: Writes, space: SlotSpace) -> None:
        start = time.perf_counter()
        write(w, space)
        write_times.append(time.perf_counter() - start)
        written.append(w)

    dp.maps._write = timed_write  # type: ignore[method-assign]
    try:
        apply_s, count = seconds(lambda: dp.apply(nodestate, full=True))
    finally:
        del dp.maps._write
    # apply() also writes what the plan leaves to the dataplane (kbp_config, the kbp_ports
    # bits, kbp_src_ranges: added to the same Writes before writing) and kbp_meta ("unknown"
    # before unless it says so already, the revision after) and counts them in its result;
    # the diff's elements must be exactly the rest.
    # A plan that does not fit the maps at once is written in stages (Change.stages), each
    # its own _write: the check and the write time take all of them.
    config = sum(len(w.config) for w in written)
    ports = sum(len(w.ports) for w in written)
    ranges = sum(len(w.ranges_to_add) + len(w.ranges_to_delete) for w in written)
    staged = sum(w.count for w in written)
    meta = count - staged
    print(
        f"  apply wrote {count} in {len(written)} stage(s): diff {writes.count} + kbp_config "
        f"{config}, kbp_ports {ports}, kbp_src_ranges {ranges}, kbp_meta {meta}"
    )
    assert staged - config - ports - ranges == writes.count, (
        f"apply wrote {staged - config - ports - ranges} planned elements, diff said "
        f"{writes.count}"
    )
    assert meta in (1, 2), f"apply wrote kbp_meta {meta} times (unknown, then the revision)"
    phases = {"decode": decode, "compile": comp, "plan": plan_s, "diff": diff_s,
              "apply": apply_s, "write": sum(write_times)}  # fmt: skip
    for name, value in phases.items():
        samples[name].append(value)
    samples["total"].append(decode + comp + apply_s)
    restart, rewritten = seconds(lambda: dp.apply(nodestate, full=True))
    assert rewritten == 0, f"restart rewrote {rewritten} elements"
    samples["restart"].append(restart)
    took, _ = seconds(lambda: dp.apply(empty_nodestate(nodestate)))
    samples["delete_all"].append(took)

    # The floor: the same elements, pre-encoded, one batch per map; then removed.
    batches = encoded(writes)
    counters = map_of(dp, "kbp_counters")
    zero = bytes(counters.value_size) * len(writes.counters_reset)
    counter_keys = b"".join(codec.backend_key(i) for i in writes.counters_reset)

    def raw_write() -> None:
        counters.update_batch(counter_keys, zero, len(writes.counters_reset))
        for name in ("kbp_backends", "kbp_slots", "kbp_services"):
            if name in batches:
                keys, values, count = batches[name]
                map_of(dp, name).update_batch(keys, values, count)

    took, _ = seconds(raw_write)
    samples["write_floor"].append(took)
    for name, (keys, _, count) in batches.items():
        if name == "kbp_slots":
            zeroed(map_of(dp, name), keys, count)
        else:
            map_of(dp, name).delete_batch(keys, count)
    return FullSync(cluster.workload.services, len(nodestate.services), writes.count,
                    cluster.workload.total_endpoints)  # fmt: skip


def print_pb4(results: list[FullSync], json_bytes: dict[int, int]) -> list[dict[str, Any]]:
    print(f"\n## PB-4: full sync from a JSON LIST into empty maps; reference: {REF_PB4}")
    report = []
    for r in results:
        scale = r.services / 10_000
        mib = json_bytes[r.services] / 2**20
        print(
            f"\n### {r.services} Services x {ENDPOINTS} endpoints: {r.entries} NodeState "
            f"entries, {r.elements} map elements, JSON {mib:.1f} MiB"
        )
        head = (
            f"{'phase':<46} {'median':>9} {'p99/max':>9} {'min-max':>21} {'n':>4}  "
            f"{'µs/endpoint':>11}  target / ratio to floor"
        )
        print(head)
        print("-" * len(head))
        entry: dict[str, Any] = {"services": r.services, "entries": r.entries,
                                 "map_elements": r.elements, "phases_s": {}}  # fmt: skip
        for name, label in PHASES:
            s = r.phases[name]
            extra = f"{s.median / r.endpoints * 1e6:>11.2f}  "
            if name == "write":
                limit = TARGET_WRITES_S_PER_10K * scale
                ratio = s.median / r.phases["write_floor"].median
                ok = mark(s.median <= limit)
                ok8 = mark(ratio <= TARGET_BATCH_RATIO)
                extra += f"≤ {fmt_s(limit)} {ok}; {ratio:.2f}x floor (PB-8: ≤ 1.5x {ok8})"
                entry["write_batch_mark"] = ok8
                entry["write_mark"] = ok
                entry["write_ratio_to_floor"] = ratio
            elif name == "total":
                limit = TARGET_FULL_SYNC_S_PER_10K * scale
                ok = mark(s.median <= limit)
                floor = r.phases["decode_floor"].median + r.phases["write_floor"].median
                extra += f"≤ {fmt_s(limit)} {ok}; {s.median / floor:.2f}x floor ({fmt_s(floor)})"
                entry["total_mark"] = ok
            elif name == "decode":
                extra += f"{s.median / r.phases['decode_floor'].median:.2f}x floor"
            print(fmt_row(label, s, extra))
            entry["phases_s"][name] = s.to_json()
        report.append(entry)
    if len(results) >= 2:
        per = [(r.services, r.phases["total"].median / r.endpoints * 1e6) for r in results]
        text = ", ".join(f"{n}: {v:.2f}" for n, v in per)
        print(f"\nlinear in N? full sync µs per endpoint: {text}")
    return report


# --- PB-5 ------------------------------------------------------------------------------------


@dataclass
class ChangeTimes:
    total: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    compile: list[float] = field(default_factory=list)
    apply: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    writes: list[int] = field(default_factory=list)


def timed_change(
    dp: EbpfDataplane, state: ClusterState, compiler: Compiler, change: Change, times: ChangeTimes
) -> None:
    gc.collect(0)
    t0 = time.perf_counter()
    values = [decode_object(json.loads(text)).value for text in change.texts]
    change.apply_to_state(state, values)
    t1 = time.perf_counter()
    nodestate = compiler.update(state)
    t2 = time.perf_counter()
    writes = dp.apply(nodestate)
    t3 = time.perf_counter()
    times.decode.append(t1 - t0)
    times.compile.append(t2 - t1)
    times.apply.append(t3 - t2)
    times.total.append(t3 - t0)
    times.writes.append(writes)
    # The floor of this change: decode its event, one batch of as many elements.
    slots = map_of(dp, "kbp_slots")
    first = dp.maps.space.find(max(1, writes))  # slots no set holds
    assert first is not None, "no free run of kbp_slots for the floor's writes"
    keys, values_b = scratch_slots(max(1, writes), first)
    t4 = time.perf_counter()
    for text in change.texts:
        decode_object(json.loads(text))
    slots.update_batch(keys, values_b, max(1, writes))
    times.floor.append(time.perf_counter() - t4)
    zeroed(slots, keys, max(1, writes))


@dataclass
class ChangeResult:
    services: int
    by_kind: dict[str, ChangeTimes]
    burst_coalesced: tuple[float, int]  # seconds, writes of one apply after 100 changes
    burst_each: ChangeTimes  # the same 100 changes, applied one by one without pause
    consistent: bool  # the kernel holds what a full apply of the final state would


def pb5(dp: EbpfDataplane, cluster: Cluster, per_kind: int, pause: float) -> ChangeResult:
    print(f"  PB-5: {cluster.workload.services} Services, {per_kind} changes per kind ...",
          flush=True)  # fmt: skip
    state, _ = load_manifests([cluster.path])
    compiler = Compiler(THIS_NODE, CompileOptions())
    state.take_changes()
    nodestate = compiler.full(state)
    dp.apply(nodestate, full=True)
    # As the daemon does after its first sync: the long-lived heap is frozen out of the
    # cyclic GC's generations.
    gc.collect()
    gc.freeze()
    try:
        by_kind = {kind: ChangeTimes() for kind in CHANGE_KINDS}
        for change in make_changes(cluster, per_kind):
            timed_change(dp, state, compiler, change, by_kind[change.kind])
            time.sleep(pause)

        burst = [c for c in make_changes(cluster, 100) if c.kind == "not_ready"][:100]
        # Coalesced: the watch delivers 100 events, the loop compiles and applies once.
        start = time.perf_counter()
        for change in burst:
            values = [decode_object(json.loads(t)).value for t in change.texts]
            change.apply_to_state(state, values)
        writes = dp.apply(compiler.update(state))
        coalesced = (time.perf_counter() - start, writes)
        # Undo them one by one, each applied at once (no pause): the un-coalesced worst case.
        each = ChangeTimes()
        originals = slices_of(cluster.items)
        for change in burst:
            name = json.loads(change.texts[0])["metadata"]["labels"]["kubernetes.io/service-name"]
            restore = Change("not_ready", [json.dumps(originals[name][0])], set_objects)
            timed_change(dp, state, compiler, restore, each)
        fresh = translate(compiler.full(state), KernelContent(),
                          maglev_table_size=dp.maps.planner.maglev_table_size,
                          sizes=dp.maps.sizes)  # fmt: skip
        consistent = resolved(dp.maps._read_kernel()) == resolved(fresh)
    finally:
        gc.unfreeze()
    dp.apply(empty_nodestate(nodestate))
    return ChangeResult(cluster.workload.services, by_kind, coalesced, each, consistent)


def resolved(content: KernelContent) -> dict[Any, Any]:
    """Each frontend with its flags and the backend addresses of its sets, in slot order:
    comparable across contents whose ids differ (an incrementally kept plan and a fresh one)."""

    def members(set_id: int) -> tuple[tuple[str, int], ...]:
        if not set_id:
            return ()
        return tuple((content.backends[b].addr, content.backends[b].port)
                     for b in content.slots[set_id])  # fmt: skip

    return {
        key: (v.flags, v.type, v.count, members(v.set_id), v.internal_count,
              members(v.internal_set_id))
        for key, v in content.services.items()
    }  # fmt: skip


def print_pb5(results: list[ChangeResult]) -> dict[str, Any]:
    print(f"\n## PB-5: one change → last kernel write (event JSON → decode → Compiler.update → "
          f"EbpfDataplane.apply); reference: {REF_PB5}")  # fmt: skip
    report: dict[str, Any] = {"sizes": []}
    for r in results:
        print(f"\n### {r.services} Services x {ENDPOINTS} endpoints")
        head = (
            f"{'change':<46} {'median':>9} {'p99/max':>9} {'min-max':>21} {'n':>4}  "
            f"{'writes':>6}  target / floor"
        )
        print(head)
        print("-" * len(head))
        every = ChangeTimes()
        entry: dict[str, Any] = {"services": r.services, "kinds": {}}
        for kind, t in r.by_kind.items():
            for name in ("total", "decode", "compile", "apply", "floor", "writes"):
                getattr(every, name).extend(getattr(t, name))
            total = Summary(t.total)
            ok = mark(total.p99 <= TARGET_CHANGE_P99_S)
            median_writes = sorted(t.writes)[len(t.writes) // 2]
            print(fmt_row(f"{kind}: event → last write", total,
                          f"{median_writes:>6}  p99 ≤ 10 ms {ok}; floor "
                          f"{fmt_s(Summary(t.floor).median)}"))  # fmt: skip
            for part in ("decode", "compile", "apply"):
                print(fmt_row(f"    {part}", Summary(getattr(t, part))))
            entry["kinds"][kind] = {
                **{p: Summary(getattr(t, p)).to_json()
                   for p in ("total", "decode", "compile", "apply", "floor")},
                "writes_median": median_writes, "mark": ok,
            }  # fmt: skip
        total = Summary(every.total)
        ok = mark(total.p99 <= TARGET_CHANGE_P99_S)
        floor = Summary(every.floor)
        print(fmt_row("all changes: event → last write", total,
                      f"{'':>6}  p99 ≤ 10 ms {ok}; floor {fmt_s(floor.median)} "
                      f"(p99 {fmt_s(floor.p99)}), {total.median / floor.median:.1f}x"))  # fmt: skip
        seconds_, writes = r.burst_coalesced
        print(f"{'burst of 100 readiness changes, one apply':<46} {fmt_s(seconds_):>9} "
              f"{'':>9} {'':>21} {'':>4}  {writes:>6}  coalesced by the sync loop")  # fmt: skip
        each = Summary(r.burst_each.total)
        extra = f"{sum(r.burst_each.writes):>6}  total {fmt_s(sum(r.burst_each.total))}"
        print(fmt_row("the same 100 undone one by one, no pause", each, extra))
        print(f"kernel maps equal the dataplane's view after all changes: "
              f"{'yes' if r.consistent else 'NO'}")  # fmt: skip
        entry.update({
            "all": total.to_json(), "all_mark": ok, "floor": floor.to_json(),
            "burst_coalesced_s": seconds_, "burst_coalesced_writes": writes,
            "burst_each": each.to_json(), "consistent": r.consistent,
        })  # fmt: skip
        report["sizes"].append(entry)
    if len(results) >= 2:
        small, large = results[0], results[-1]
        growth = Summary(_all(large)).p99 / Summary(_all(small)).p99
        ok = mark(growth <= TARGET_FLAT)
        print(f"\nflat in N? p99 at {large.services} / p99 at {small.services}: {growth:.2f}x "
              f"{ok} (read as ≤ {TARGET_FLAT}x)")  # fmt: skip
        report["flat"] = {"from": small.services, "to": large.services, "p99_ratio": growth,
                          "mark": ok}  # fmt: skip
    return report


def _all(r: ChangeResult) -> list[float]:
    return [x for t in r.by_kind.values() for x in t.total]


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PB-4 map-write phase, PB-5 one change, PB-8 per element vs batch, "
        "against the eBPF dataplane's pinned maps (not a test; always exits 0)."
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, < 1 minute")
    parser.add_argument("--services", type=int, nargs="+", metavar="N",
                        help="PB-4/PB-5 sizes (default 1000 10000 30000; quick: PB-4 at "
                        "10000, PB-5 at 1000 and 10000)")  # fmt: skip
    parser.add_argument("--entries", type=int, nargs="+", metavar="E",
                        help="PB-8 sizes (default 1024 16384 131072 1048576; quick: "
                        "the first three)")  # fmt: skip
    parser.add_argument("--pb", type=int, nargs="+", choices=(4, 5, 8), default=[8, 4, 5])
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    args = parser.parse_args(argv)
    quick = args.quick
    pb4_sizes = args.services or ([10_000] if quick else [1000, 10_000, 30_000])
    pb5_sizes = args.services or ([1000, 10_000] if quick else [1000, 10_000, 30_000])
    entries = args.entries or ([1024, 16384, 131072] if quick else [1024, 16384, 131072, 1048576])
    pb8_repeats = dict(zip(entries, ([10, 4, 2] if quick else [30, 10, 5, 3]), strict=False))
    for count in entries:
        pb8_repeats.setdefault(count, 1 if count >= 1 << 20 else 3)
    per_kind, pause = (20, 0.01) if quick else (50, 0.05)

    terminate_as_interrupt()
    info = machine()
    header("bench/maps.py (PB-4, PB-5, PB-8)", info)
    began = time.perf_counter()
    document: dict[str, Any] = {
        "benchmark": "bench/maps.py",
        "ids": ["PB-4", "PB-5", "PB-8"],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": quick,
        "machine": info,
    }
    try:
        with bench_netns() as netns, tempfile.TemporaryDirectory(prefix="kbp-bench-") as tmp:
            if 8 in args.pb:
                sizes = MapSizes(1024, 2 * max(entries), 2 * max(entries), 4096, 1024)
                with bench_dataplane(sizes, netns) as dp:
                    document["pb8"] = print_pb8(pb8(dp, entries, pb8_repeats))
            wanted = sorted({*(pb4_sizes if 4 in args.pb else []),
                             *(pb5_sizes if 5 in args.pb else [])})  # fmt: skip
            if wanted:
                sizes = map_sizes_for_generated(max(wanted))
                print(f"\nPB-4/PB-5 maps: {sizes}", flush=True)
                with bench_dataplane(sizes, netns) as dp:
                    full_syncs: list[FullSync] = []
                    changes: list[ChangeResult] = []
                    json_bytes: dict[int, int] = {}
                    for n in wanted:
                        started = time.perf_counter()
                        cluster = generate(n, Path(tmp))
                        json_bytes[n] = cluster.json_bytes
                        print(f"# {n} Services x {ENDPOINTS}: generated in "
                              f"{time.perf_counter() - started:.1f} s", flush=True)  # fmt: skip
                        if 4 in args.pb and n in pb4_sizes:
                            repeat = 2 if quick else 3 if n >= 30_000 else 5
                            full_syncs.append(pb4(dp, cluster, repeat))
                        if 5 in args.pb and n in pb5_sizes:
                            changes.append(pb5(dp, cluster, per_kind, pause))
                        cluster.path.unlink()
                        del cluster
                    if full_syncs:
                        document["pb4"] = print_pb4(full_syncs, json_bytes)
                    if changes:
                        document["pb5"] = print_pb5(changes)
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers() or 'nothing'})")
        return 130
    took = time.perf_counter() - began
    document["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    document["duration_s"] = took
    out = args.json or RESULTS / ("maps-quick.json" if quick else "maps.json")
    write_results(out, document)
    print(f"\nran in {took:.0f} s (load average now {os.getloadavg()[0]:.2f}); results in {out}; "
          f"left over: {leftovers() or 'nothing'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
