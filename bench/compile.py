"""Benchmark of the manifest source and the node-local compiler (issue 2 §6, PB-4/5/6;
targets and anchors in bench/README.md).

Generates N Services x M endpoints (ClusterIP with a few NodePort and LoadBalancer ones,
EndpointSlices spread over ~100 nodes in 3 zones) plus LeaderWorkerSet-style headless
per-replica Services, writes them as one JSON LIST and as multi-document YAML, and times
parse, decode, full compile, JSON → NodeState end to end, incremental recompiles, the
cost of the headless Services, retained memory and rendering. Figures are printed side
by side with their floor (measured in the same run), published references and targets;
results go to bench/results/compile.json. Not a test: it always exits 0 unless it crashes.

    .venv/bin/python bench/compile.py [--quick] [--services N ...] [--endpoints M]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import ctypes
import gc
import io
import json
import pstats
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.cli import render
from agent.model.compile import CompileOptions, Compiler, compile
from agent.model.decode import decode_object
from agent.model.types import ClusterState, EndpointSlice, Service
from agent.sources.manifests import YamlLoader, iter_objects, load_manifests
from bench.common.report import (
    GC,
    RESULTS,
    Stat,
    fmt_b,
    fmt_s,
    machine,
    mark,
    results_path,
    write_results,
)
from bench.common.workload import THIS_NODE, Generator, Obj, Workload

# Targets (issue 2 §6) and published anchors (bench/README.md, PB-4/5/6).
TARGET_E2E_S_PER_100K_EP = 3.0  # 10k x 10 from JSON to NodeState ≤ 3 s, linear in size
TARGET_UPDATE_S = 0.005  # one change → affected Service recompiled + new revision
TARGET_BYTES_PER_EP = 1536  # ≤ 1.5 KB per endpoint
TARGET_HEADLESS_SHARE = 0.05  # "next to nothing": ≤ 5 % added to the compile
FLOOR_BYTES_PER_EP = 126  # PB-6's floor: CPython baseline + ≈126 B per endpoint
REF_E2E = "iptables-restore of the same: 3.7-4.0 s legacy, 9.7-12.8 s nft (PB-4)"
REF_UPDATE = "kube-proxy nft: +1 Service beside 10k ≈141 ms (PB-5)"
REF_MEMORY = "kube-proxy nft ≈260 MiB at 10kx2 (PB-6)"


# --- workload ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Files:
    json: Path  # everything, one compact JSON LIST (as the API server serves it)
    yaml: Path  # everything, one object per YAML document (block style, as kubectl)
    json_no_headless: Path  # the same without the headless Services and their slices


def write_files(workload: Workload, directory: Path) -> Files:
    items = Generator(workload).items()
    headless_names = {
        o["metadata"]["name"]
        for o in items
        if o["kind"] == "Service" and o["spec"].get("clusterIP") == "None"
    }

    def is_headless(o: Obj) -> bool:
        name = o["metadata"].get("labels", {}).get("kubernetes.io/service-name")
        return o["metadata"]["name"] in headless_names or name in headless_names

    files = Files(
        directory / "cluster.json", directory / "cluster.yaml", directory / "no-headless.json"
    )
    with files.json.open("w") as out:
        json.dump({"apiVersion": "v1", "kind": "List", "items": items}, out, separators=(",", ":"))
    with files.json_no_headless.open("w") as out:
        json.dump(
            {"apiVersion": "v1", "kind": "List", "items": [o for o in items if not is_headless(o)]},
            out,
            separators=(",", ":"),
        )
    with files.yaml.open("w") as out:
        yaml.dump_all(items, out, Dumper=yaml.CSafeDumper, sort_keys=False, width=200)
    return files


# --- measuring ---------------------------------------------------------------------------


def _run(fn: Callable[[], Any], gc_enabled: bool) -> tuple[float, float]:
    """(wall seconds, GC seconds) of one fn() after a full collection; result dropped."""
    gc.collect()
    if not gc_enabled:
        gc.disable()
    gc_before = GC.seconds
    start = time.perf_counter()
    try:
        result = fn()
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    collected = GC.seconds - gc_before
    del result
    return elapsed, collected


def timed(fn: Callable[[], Any], repeat: int, warmup: int = 0, gc_enabled: bool = True) -> Stat:
    """Wall time of fn() `repeat` times; a full collection before each run and the cyclic
    GC enabled during it, as in the agent (unless gc_enabled is False)."""
    stat = Stat([])
    for i in range(warmup + repeat):
        elapsed, collected = _run(fn, gc_enabled)
        if i >= warmup:
            stat.samples.append(elapsed)
            stat.gc.append(collected)
    gc.collect()
    return stat


def interleaved(fns: dict[str, Callable[[], Any]], repeat: int, no_gc: set[str]) -> dict[str, Stat]:
    """Like `timed` for several functions, run in turn so drift hits them alike."""
    stats = {name: Stat([]) for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            elapsed, collected = _run(fn, name not in no_gc)
            stats[name].samples.append(elapsed)
            stats[name].gc.append(collected)
    gc.collect()
    return stats


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))  # as load_manifests reads it


def read_yaml(path: Path) -> list[Any]:
    return list(yaml.load_all(path.read_text(encoding="utf-8"), Loader=YamlLoader))


def decode_into_state(document: Any) -> ClusterState:
    """Decode + index only, from already parsed objects (the watch path's work)."""
    state = ClusterState()
    for _, obj in iter_objects(document, ""):
        value = decode_object(obj).value
        if isinstance(value, Service):
            state.set_service(value)
        elif isinstance(value, EndpointSlice):
            state.set_slice(value)
        elif value is not None:
            state.set_node(value)
    return state


def end_to_end(path: Path, options: CompileOptions) -> Any:
    state, _ = load_manifests([path])
    return compile(state, THIS_NODE, options)


def service_keys(state: ClusterState) -> list[tuple[str, str]]:
    return sorted(k for k, s in state.services.items() if s.cluster_ips and k[1].startswith("svc"))


def spread(keys: list[Any], count: int) -> Iterator[Any]:
    """`count` items spread evenly over keys (repeating when there are fewer)."""
    for i in range(count):
        yield keys[(i * len(keys)) // count if count <= len(keys) else i % len(keys)]


@dataclass
class Incremental:
    readiness: Stat  # compiler.update after one endpoint's ready flag flipped
    event: Stat  # JSON text of the slice → decode → set_slice → update
    add: Stat  # set_service + set_slice + update for a new Service
    delete: Stat  # delete_slice + delete_service + update
    floor: Stat  # decode of one slice from JSON text (PB-5's floor, without map writes)
    consistent: bool  # the incremental result equals a full compile at the end
    services_per_update: float  # Services recompiled per readiness change (should be 1)
    revisions: int  # readiness changes that changed the revision


def incremental(
    state: ClusterState, workload: Workload, options: CompileOptions, changes: int, adds: int
) -> Incremental:
    compiler = Compiler(THIS_NODE, options)
    state.take_changes()
    current = compiler.full(state)
    keys = service_keys(state)
    # Count the Services each update recompiles: wrap the change log's public reader.
    handed_out: list[int] = []
    take_changes = state.take_changes

    def counting_take_changes() -> tuple[set[tuple[str, str]], set[str]]:
        services, nodes = take_changes()
        handed_out.append(len(services))
        return services, nodes

    state.take_changes = counting_take_changes  # type: ignore[method-assign]

    readiness: list[float] = []
    revisions = 0
    for n, key in enumerate(spread(keys, changes)):
        endpoint_slice = next(iter(state.slices_by_service[key].values()))
        j = n % len(endpoint_slice.endpoints)
        endpoints = list(endpoint_slice.endpoints)
        endpoints[j] = replace(endpoints[j], ready=not endpoints[j].ready)
        state.set_slice(replace(endpoint_slice, endpoints=tuple(endpoints)))
        gc.collect(0)
        start = time.perf_counter()
        new = compiler.update(state)
        readiness.append(time.perf_counter() - start)
        # Not every flip changes the output: a ready endpoint filtered out by zone hints
        # that turns not-ready leaves the backends as they were.
        revisions += new.revision != current.revision
        current = new

    # The watch path for one event: slice JSON → decode → set_slice → update.
    generator = Generator(replace(workload, seed=workload.seed + 1))
    texts = []
    for key in spread(keys, changes):
        objs = generator.service(int(key[1].removeprefix("svc-")), namespace=key[0])
        objs[1]["metadata"]["name"] = next(iter(state.slices_by_service[key]))  # replace it
        texts.append(json.dumps(objs[1], separators=(",", ":")))
    event: list[float] = []
    floor: list[float] = []
    for text in texts:
        gc.collect(0)
        start = time.perf_counter()
        decode_object(json.loads(text))
        floor.append(time.perf_counter() - start)
        start = time.perf_counter()
        value = decode_object(json.loads(text)).value
        assert isinstance(value, EndpointSlice)
        state.set_slice(value)
        compiler.update(state)
        event.append(time.perf_counter() - start)

    new_services = []
    for i in range(adds):
        objs = generator.service(workload.services + i, namespace="bench-added")
        service = decode_object(objs[0]).value
        slices = [decode_object(o).value for o in objs[1:]]
        assert isinstance(service, Service)
        new_services.append((service, slices))
    add: list[float] = []
    for service, slices in new_services:
        gc.collect(0)
        start = time.perf_counter()
        state.set_service(service)
        for endpoint_slice in slices:
            state.set_slice(endpoint_slice)  # type: ignore[arg-type]
        compiler.update(state)
        add.append(time.perf_counter() - start)
    delete: list[float] = []
    for service, slices in new_services:
        gc.collect(0)
        start = time.perf_counter()
        for endpoint_slice in slices:
            state.delete_slice(endpoint_slice.namespace, endpoint_slice.name)  # type: ignore[union-attr]
        state.delete_service(service.namespace, service.name)
        compiler.update(state)
        delete.append(time.perf_counter() - start)

    recompiled = sum(handed_out[:changes])
    del state.take_changes  # back to the class's method
    full = compile(state, THIS_NODE, options)
    final = compiler.update(state)
    return Incremental(
        readiness=Stat(readiness),
        event=Stat(event),
        add=Stat(add),
        delete=Stat(delete),
        floor=Stat(floor),
        consistent=full.revision == final.revision and full == final,
        services_per_update=recompiled / max(1, changes),
        revisions=revisions,
    )


# --- memory (fresh subprocess) -----------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_probe(path: Path, mode: str) -> dict[str, int]:
    """Retained memory of ClusterState (+ Compiler cache and NodeState) after loading `path`.

    tracemalloc: bytes of live Python allocations (exact, but slows the run); rss: the
    process's resident set after a full collection and malloc_trim (includes what the
    allocators keep from the parsed documents)."""
    options = CompileOptions()
    gc.collect()
    out: dict[str, int] = {}
    if mode == "tracemalloc":
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    else:
        base = rss_bytes()
    state, _ = load_manifests([path])
    gc.collect()
    out["state"] = (
        tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else rss_bytes()
    ) - base
    compiler = Compiler(THIS_NODE, options)
    node_state = compiler.full(state)
    gc.collect()
    if mode == "tracemalloc":
        current, peak = tracemalloc.get_traced_memory()
        out["total"] = current - base
        out["peak"] = peak - base
    else:
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        out["total"] = rss_bytes() - base
    out["entries"] = len(node_state.services)
    return out


def run_memory_probe(path: Path, mode: str) -> dict[str, int]:
    proc = subprocess.run(
        [sys.executable, __file__, "--memory-probe", mode, str(path)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(proc.stdout)


# --- profiling ---------------------------------------------------------------------------


def profile(fn: Callable[[], Any], title: str, out: Path, top: int = 25) -> str:
    profiler = cProfile.Profile()
    gc.collect()
    gc_before, collections = GC.seconds, list(GC.collections)
    profiler.enable()
    fn()
    profiler.disable()
    gc_seconds = GC.seconds - gc_before
    counts = [after - before for after, before in zip(GC.collections, collections, strict=True)]
    profiler.dump_stats(out)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return (
        f"== profile: {title} ({out}) ==\n"
        f"cyclic GC during this run: {gc_seconds:.3f} s in {counts} collections (gen 0/1/2); "
        "cProfile charges it to whichever function was allocating\n"
        f"{text.getvalue()}"
    )


# --- one size ----------------------------------------------------------------------------


@dataclass
class Repeats:
    parse_json: int
    parse_yaml: int
    load_yaml: int
    compile: int
    render_yaml: int
    changes: int
    adds: int


@dataclass
class Row:
    metric: str
    stat: Stat | None
    floor: str = ""
    target: str = ""
    mark: str = ""  # PASS | MISS | "" (informational)
    value: str = ""  # instead of stat: a single figure
    key: str = ""


@dataclass
class SizeResult:
    workload: Workload
    files: dict[str, int]
    rows: list[Row] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


def write_profiles(workload: Workload, files: Files, r: Repeats) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    options = CompileOptions()
    tag = f"{workload.services}x{workload.endpoints}"
    report = profile(
        lambda: end_to_end(files.json, options),
        f"end to end {workload.label}",
        RESULTS / f"compile-e2e-{tag}.prof",
    )
    state, _ = load_manifests([files.json])
    report += profile(
        lambda: incremental(state, workload, options, r.changes, 0),
        f"incremental {workload.label}",
        RESULTS / f"compile-incremental-{tag}.prof",
    )
    (RESULTS / f"compile-profile-{tag}.txt").write_text(report)
    print(f"  profiles written to {RESULTS}/compile-*-{tag}.*", flush=True)


def measure_decode(path: Path, repeat: int) -> Stat:
    document = read_json(path)  # alive during the runs, as in load_manifests
    return timed(lambda: decode_into_state(document), repeat, warmup=1)


@dataclass
class Compiled:
    pair: dict[str, Stat]  # full compile with ("compile") and without ("compile_nh") headless
    render_json: Stat
    render_yaml: Stat
    entries: int


def measure_compile(state: ClusterState, files: Files, r: Repeats) -> Compiled:
    options = CompileOptions()
    state_nh, _ = load_manifests([files.json_no_headless])
    nodestate = compile(state, THIS_NODE, options)
    assert compile(state_nh, THIS_NODE, options) == nodestate, "headless changed the output"
    pair = interleaved(
        {
            "compile": lambda: compile(state, THIS_NODE, options),
            "compile_nh": lambda: compile(state_nh, THIS_NODE, options),
        },
        r.compile,
        no_gc=set(),
    )
    return Compiled(
        pair,
        render_json=timed(lambda: render(nodestate, "json"), r.render_yaml + 1),
        render_yaml=timed(lambda: render(nodestate, "yaml"), r.render_yaml),
        entries=len(nodestate.services),
    )


def run_size(workload: Workload, repeats: Repeats, args: argparse.Namespace) -> SizeResult:
    options = CompileOptions()
    with tempfile.TemporaryDirectory(prefix="kbp-bench-") as tmp:
        start = time.perf_counter()
        files = write_files(workload, Path(tmp))
        print(f"  generated in {time.perf_counter() - start:.1f} s", flush=True)
        result = SizeResult(
            workload,
            {
                "json_bytes": files.json.stat().st_size,
                "yaml_bytes": files.yaml.stat().st_size,
                "json_no_headless_bytes": files.json_no_headless.stat().st_size,
            },
        )
        rows = result.rows
        eps = workload.total_endpoints
        r = repeats

        # (a) parse; the floor is JSON decode with the cyclic GC off
        parse_json = timed(lambda: read_json(files.json), r.parse_json, warmup=1)
        parse_json_nogc = timed(lambda: read_json(files.json), r.parse_json, gc_enabled=False)
        parse_yaml = timed(lambda: read_yaml(files.yaml), r.parse_yaml)
        # (b) decode + load into ClusterState
        decode = measure_decode(files.json, r.compile)
        load_json = timed(lambda: load_manifests([files.json]), r.compile)
        load_yaml = timed(lambda: load_manifests([files.yaml]), r.load_yaml)
        # (d) end to end with nothing else alive; (f) with and without the headless
        # Services; and what the cyclic GC costs (a what-if: the agent runs with it on)
        e2e_runs = interleaved(
            {
                "e2e": lambda: end_to_end(files.json, options),
                "e2e_nh": lambda: end_to_end(files.json_no_headless, options),
                "e2e_nogc": lambda: end_to_end(files.json, options),
            },
            r.compile,
            no_gc={"e2e_nogc"},
        )
        e2e = e2e_runs["e2e"]
        # (c) full compile, (f) with and without the headless Services, (h) rendering
        state, _ = load_manifests([files.json])
        compiled = measure_compile(state, files, r)
        pair, full = compiled.pair, compiled.pair["compile"]
        render_json, render_yaml, entries = (
            compiled.render_json,
            compiled.render_yaml,
            compiled.entries,
        )
        # (e) incremental (changes the state, so last)
        inc = incremental(state, workload, options, r.changes, r.adds)
        del state, compiled
        gc.collect()
        # (g) memory, each in a fresh interpreter
        traced = run_memory_probe(files.json, "tracemalloc")
        rss = run_memory_probe(files.json, "rss")
        if args.profile:
            write_profiles(workload, files, r)

    # --- rows ---
    scale = eps / 100_000
    e2e_target = TARGET_E2E_S_PER_100K_EP * scale
    floor = parse_json_nogc.median
    floor_e2e = f"JSON decode {fmt_s(floor)}; x{e2e.median / floor:.1f}"
    rows += [
        Row("(a) parse: JSON decode of the LIST", parse_json, key="parse_json"),
        Row("(a) parse: JSON decode, cyclic GC off", parse_json_nogc, key="parse_json_no_gc"),
        Row("(a) parse: YAML load (C loader)", parse_yaml, key="parse_yaml"),
        Row("(b) decode + index (parsed → ClusterState)", decode, key="decode"),
        Row("(b) load_manifests JSON file", load_json, key="load_json"),
        Row("(b) load_manifests YAML file", load_yaml, key="load_yaml"),
        Row("(c) compile (full, ClusterState → NodeState)", full, key="compile"),
        Row(
            "(c) compile (the same, without headless)",
            pair["compile_nh"],
            key="compile_no_headless",
        ),
        Row(
            "(d) end to end JSON file → NodeState",
            e2e,
            floor=floor_e2e,
            target=f"≤ {fmt_s(e2e_target)}" + (" (3 s/100k ep)" if scale != 1 else ""),
            mark=mark(e2e.median <= e2e_target),
            key="end_to_end",
        ),
        Row(
            "(d) what-if: end to end with cyclic GC off",
            e2e_runs["e2e_nogc"],
            floor=f"x{e2e_runs['e2e_nogc'].median / floor:.1f}",
            target=f"≤ {fmt_s(e2e_target)}",
            mark=mark(e2e_runs["e2e_nogc"].median <= e2e_target),
            key="end_to_end_no_gc",
        ),
        Row("(d) reference", None, value=REF_E2E),
        Row(
            "(e) update: one endpoint's readiness",
            inc.readiness,
            floor=f"slice decode {fmt_s(inc.floor.median)}",
            target=f"p99 ≤ {fmt_s(TARGET_UPDATE_S)}",
            mark=mark(inc.readiness.p99 <= TARGET_UPDATE_S),
            key="update_readiness",
        ),
        Row(
            "(e) update: add one Service (+ slice)",
            inc.add,
            target=f"p99 ≤ {fmt_s(TARGET_UPDATE_S)}",
            mark=mark(inc.add.p99 <= TARGET_UPDATE_S),
            key="update_add_service",
        ),
        Row(
            "(e) update: delete one Service (+ slice)",
            inc.delete,
            target=f"p99 ≤ {fmt_s(TARGET_UPDATE_S)}",
            mark=mark(inc.delete.p99 <= TARGET_UPDATE_S),
            key="update_delete_service",
        ),
        Row("(e) event: slice JSON → decode → update", inc.event, key="update_event"),
        Row("(e) reference", None, value=REF_UPDATE),
        Row(
            "(e) incremental = full; Services/update; new rev.",
            None,
            value=f"{'yes' if inc.consistent else 'NO'}; {inc.services_per_update:.2f}; "
            f"{inc.revisions}/{len(inc.readiness.samples)}",
            mark="" if inc.consistent else "MISS",
        ),
    ]
    compile_delta = pair["compile"].median - pair["compile_nh"].median
    e2e_delta = e2e.median - e2e_runs["e2e_nh"].median
    share = compile_delta / pair["compile_nh"].median
    bytes_share = result.files["json_bytes"] / result.files["json_no_headless_bytes"] - 1
    headless_rows = [
        Row(
            f"(f) headless cost in compile ({workload.headless} Services)",
            None,
            value=f"{fmt_s(compile_delta)} ({share:+.1%})",
            target=f"≤ {TARGET_HEADLESS_SHARE:.0%} of compile",
            mark=mark(share <= TARGET_HEADLESS_SHARE),
            key="headless_compile_delta",
        ),
        Row("(f) end to end without headless", e2e_runs["e2e_nh"], key="end_to_end_no_headless"),
        Row(
            "(f) headless cost end to end (incl. parse)",
            None,
            value=f"{fmt_s(e2e_delta)} ({e2e_delta / e2e_runs['e2e_nh'].median:+.1%}); "
            f"{e2e_delta / max(1, workload.headless) * 1e6:.1f} µs/Service",
            floor=f"they add {bytes_share:+.0%} to the JSON bytes",
            key="headless_e2e_delta",
        ),
    ]
    if workload.headless:
        rows += headless_rows
    else:
        rows.append(Row("(f) headless cost", None, value="no headless Services (--headless 0)"))
    per_ep = traced["total"] / eps
    rss_per_ep = rss["total"] / eps
    rows += [
        Row(
            "(g) memory: state + compiler (tracemalloc)",
            None,
            value=f"{fmt_b(traced['total'])}; {per_ep:.0f} B/endpoint",
            floor=f"≈{FLOOR_BYTES_PER_EP} B/endpoint (PB-6)",
            target=f"≤ {TARGET_BYTES_PER_EP} B/endpoint",
            mark=mark(per_ep <= TARGET_BYTES_PER_EP),
            key="memory_per_endpoint",
        ),
        Row(
            "(g)   of which ClusterState",
            None,
            value=f"{fmt_b(traced['state'])}; {traced['state'] / eps:.0f} B/endpoint",
        ),
        Row(
            "(g)   peak during load + compile",
            None,
            value=f"{fmt_b(traced['peak'])}; {traced['peak'] / eps:.0f} B/endpoint",
        ),
        Row(
            "(g) memory: RSS delta (fresh process)",
            None,
            value=f"{fmt_b(rss['total'])}; {rss_per_ep:.0f} B/endpoint",
            target=f"≤ {TARGET_BYTES_PER_EP} B/endpoint (PB-6)",
            mark=mark(rss_per_ep <= TARGET_BYTES_PER_EP),
            key="memory_rss_per_endpoint",
        ),
        Row("(g) reference", None, value=REF_MEMORY),
        Row("(h) render NodeState as JSON", render_json, key="render_json"),
        Row("(h) render NodeState as YAML", render_yaml, key="render_yaml"),
    ]
    result.extra = {
        "entries": entries,
        "endpoints": eps,
        "memory_tracemalloc": traced,
        "memory_rss": rss,
        "incremental_consistent": inc.consistent,
        "services_recompiled_per_update": inc.services_per_update,
        "readiness_changes_with_new_revision": inc.revisions,
        "update_slice_decode_floor": inc.floor.to_json(),
        "headless_compile_share": share,
        "headless_e2e_delta_s": e2e_delta,
        "bytes_per_endpoint": per_ep,
        "rss_bytes_per_endpoint": rss_per_ep,
    }
    return result


# --- output ------------------------------------------------------------------------------


def print_table(result: SizeResult) -> None:
    w = result.workload
    print(
        f"\n## {w.label}: {w.total_endpoints} endpoints on {w.nodes} nodes, "
        f"{result.extra['entries']} NodeState entries; JSON {fmt_b(result.files['json_bytes'])}, "
        f"YAML {fmt_b(result.files['yaml_bytes'])}"
    )
    header = (
        f"{'metric':<50} {'median':>9} {'p99/max':>9} {'min-max':>19} {'n':>4} {'GC':>4}  "
        f"{'target':<24} {'':4}  floor / reference"
    )
    print(header)
    print("-" * len(header))
    print(
        "(GC: median share of the time spent in CPython's cyclic garbage collector; "
        "p99 = max when n < 100)"
    )
    for row in result.rows:
        if row.stat is not None:
            s = row.stat
            spread_text = f"{fmt_s(min(s.samples))}-{fmt_s(max(s.samples))}"
            share = s.gc_share
            gc_text = "" if share is None else f"{share:.0%}"
            figures = (
                f"{fmt_s(s.median):>9} {fmt_s(s.p99):>9} {spread_text:>19} {len(s.samples):>4}"
                f" {gc_text:>4}"
            )
        else:
            figures = f"{row.value:>51}" if len(row.value) <= 51 else row.value
        if row.stat is None and row.metric.endswith("reference"):
            print(f"{row.metric:<50} {row.value}")
            continue
        print(f"{row.metric:<50} {figures}  {row.target:<24} {row.mark:4}  {row.floor}")


def to_json(results: list[SizeResult], args: argparse.Namespace, info: Obj, seconds: float) -> Obj:
    sizes = []
    for res in results:
        metrics: Obj = {}
        for row in res.rows:
            if row.key and row.stat is not None:
                metrics[row.key] = {**row.stat.to_json(), "unit": "s"}
                if row.mark:
                    metrics[row.key]["target"] = row.target
                    metrics[row.key]["mark"] = row.mark
            elif row.key:
                metrics[row.key] = {"value": row.value, "target": row.target, "mark": row.mark}
        sizes.append(
            {
                "services": res.workload.services,
                "endpoints_per_service": res.workload.endpoints,
                "headless_services": res.workload.headless,
                "nodes": res.workload.nodes,
                "files": res.files,
                "metrics": metrics,
                **res.extra,
            }
        )
    return {
        "benchmark": "bench/compile.py",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": info,  # as at the start of the run
        "node": THIS_NODE,
        "duration_s": seconds,
        "sizes": sizes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Benchmark parse, decode, compile, incremental updates and memory of the "
        "node-local compiler on generated clusters (not a test; always exits 0)."
    )
    parser.add_argument("--quick", action="store_true", help="1k Services only, < 1 minute")
    parser.add_argument(
        "--services", type=int, nargs="+", metavar="N", help="sizes (default 1000 10000)"
    )
    parser.add_argument("--endpoints", type=int, default=10, metavar="M", help="per Service")
    parser.add_argument(
        "--headless",
        type=int,
        metavar="H",
        help="LWS headless per-replica Services (default: as many as --services)",
    )
    parser.add_argument("--nodes", type=int, default=100, help="nodes the endpoints spread over")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    parser.add_argument(
        "--profile", action="store_true", help="also write cProfile output to bench/results/"
    )
    parser.add_argument("--memory-probe", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.memory_probe:
        mode, path = args.memory_probe
        print(json.dumps(memory_probe(Path(path), mode)))
        return 0

    sizes = args.services or ([1000] if args.quick else [1000, 10_000])
    if args.quick:
        repeats = Repeats(
            parse_json=5, parse_yaml=3, load_yaml=2, compile=5, render_yaml=2, changes=200, adds=50
        )
    else:
        repeats = Repeats(
            parse_json=7, parse_yaml=3, load_yaml=2, compile=7, render_yaml=2, changes=200, adds=100
        )
    info = machine()
    print(
        f"bench/compile.py: Python {info['python']} ({info['implementation']}), "
        f"{info['cpus']} CPUs ({info['cpu_model']}), kernel {info['kernel']}, "
        f"YAML loader {info['yaml_loader']}; commit {info['commit']}; "
        f"load average {info['load_average_at_start'][0]}; node {THIS_NODE}; "
        "times are wall clock, GC enabled, a full collection before each run"
    )
    began = time.perf_counter()
    results = []
    for n in sizes:
        workload = Workload(
            services=n,
            endpoints=args.endpoints,
            headless=n if args.headless is None else args.headless,
            nodes=args.nodes,
            seed=args.seed,
        )
        print(f"\n# {workload.label} ...", flush=True)
        result = run_size(workload, repeats, args)
        print_table(result)
        results.append(result)
    seconds = time.perf_counter() - began
    out = results_path(args, "compile")
    write_results(out, to_json(results, args, info, seconds))
    print(f"\nran in {seconds:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
