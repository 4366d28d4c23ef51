"""PB-14: the cost of a /metrics scrape with per-Service traffic (issue 18 §2) at N
Services, against the real eBPF dataplane's pinned maps, per `--service-metrics` mode.

bench/maps.py's generated cluster (N Services x 10 endpoints) is applied into fresh maps;
every live service id gets non-zero per-CPU counters and a tenth of them drop counts, so
every series is exported. Timed side by side in one run: a whole scrape (the registry
rendered as /metrics text, every other metric of the agent included) with
`--service-metrics none` (the floor), `services` and `ports`; the per-Service text alone
beside the same series built as prometheus_client objects (the reference); and
`inspect counters`' way of reading kbp_counters (every entry of the array, decoded).
RSS (VmRSS) is read after a warm-up and again after every further batch of scrapes:
growth across scrapes would be a leak.

    .venv/bin/python -m bench.metrics [--quick] [--services N ...] [--scrapes K]
"""

from __future__ import annotations

import argparse
import gc
import os
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.dataplane.ebpf import codec, service_metrics
from agent.dataplane.ebpf.abi import DROP_REASONS, packer
from agent.dataplane.ebpf.libbpf import possible_cpus
from agent.metrics import Metrics
from agent.model.compile import CompileOptions, compile
from agent.model.nodestate import NodeState, revision_of
from agent.sources.manifests import load_manifests
from bench.common.kernel import bench_dataplane, bench_netns, leftovers
from bench.common.report import (
    RESULTS,
    Summary,
    header,
    machine,
    terminate_as_interrupt,
    write_results,
)
from bench.common.workload import THIS_NODE, generate, map_sizes_for_generated

TARGET_SCRAPE_S = 0.100  # issue 18: a scrape under 100 ms at 10k Services
MODES = ("none", "services", "ports")


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def fill_counters(dp: Any, ids: list[int]) -> int:
    """Non-zero per-CPU counters for every live id; drop counts for every tenth."""
    counters = dp.programs.map("kbp_counters")
    stride = (packer("kbp_counters").size + 7) // 8 * 8
    cpus = possible_cpus()
    for n, service_id in enumerate(ids):
        value = b"".join(
            struct.pack("=4Q", 1000 + n + cpu, 64_000 + n, 10 + cpu, 0).ljust(stride, b"\0")
            for cpu in range(cpus)
        )
        counters.update(codec.backend_key(service_id), value)
    drops = dp.programs.map("kbp_svc_drops")
    key = packer("kbp_svc_drop_key")
    written = 0
    for service_id in ids[::10]:
        drops.update(key.pack(service_id, 0), struct.pack("=Q", 3) * cpus)
        written += 1
    return written


def client_objects(dp: Any, mode: str) -> bytes:
    """The per-Service series as prometheus_client families, rendered by it."""
    from prometheus_client.core import CounterMetricFamily
    from prometheus_client.exposition import generate_latest as render

    traffic = dp._service_traffic(mode)
    labels = traffic._labeller()
    sums = traffic.traffic(labels)

    class Collect:
        def collect(self) -> list[CounterMetricFamily]:
            fams = service_metrics.families(traffic.label_names)
            for key, values in sums.items():
                for column in range(3):
                    fams[column].add_metric(list(key), values[column])
            return fams

    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(Collect())
    return render(registry)


CPU_TIMES: list[float] = []  # thread CPU seconds of the calls `timed` timed last


def timed(fn: Any, repeat: int) -> list[float]:
    """Wall seconds per call; the calls' CPU seconds (this thread's, which other work on
    a loaded machine does not inflate as it does the wall time) go to CPU_TIMES."""
    out = []
    CPU_TIMES.clear()
    for _ in range(repeat):
        started, cpu = time.perf_counter(), time.thread_time()
        fn()
        out.append(time.perf_counter() - started)
        CPU_TIMES.append(time.thread_time() - cpu)
    return out


def run_size(dp: Any, n: int, tmp: Path, scrapes: int) -> dict[str, Any]:
    cluster = generate(n, tmp)
    state, _ = load_manifests([cluster.path])
    node_state = compile(state, THIS_NODE, CompileOptions())
    cluster.path.unlink()
    dp.apply(node_state, full=True)
    gc.freeze()  # as the agent's sync loop does with the first programmed state
    labels = service_metrics.labels_of(node_state.services, dp.maps.current.services, "ports")
    ids = sorted(labels)
    dropped = fill_counters(dp, ids)
    print(
        f"# {n} Services: {len(node_state.services)} entries, {len(ids)} service ids, "
        f"{dropped} with drops",
        flush=True,
    )
    result: dict[str, Any] = {
        "services": n,
        "entries": len(node_state.services),
        "ids": len(ids),
        "modes": {},
    }
    for mode in MODES:
        metrics = Metrics()
        dp.register_metrics(metrics, mode)

        def scrape(metrics: Metrics = metrics) -> bytes:
            return metrics.exposition("")[0]

        body = scrape()
        for _ in range(5):  # warm-up: label caches, allocator
            scrape()
        rss_before = rss_kib()
        samples = timed(scrape, scrapes)
        cpu = list(CPU_TIMES)
        rss_mid = rss_kib()
        samples += timed(scrape, scrapes)
        cpu += CPU_TIMES
        rss_after = rss_kib()
        row: dict[str, Any] = {
            "scrape": Summary(samples).to_json(),
            "scrape_cpu": Summary(cpu).to_json(),
            "body_bytes": len(body),
            "series": body.count(b"\nkbp_service_"),
            "rss_kib": [rss_before, rss_mid, rss_after],
        }
        if mode != "none":
            [render] = metrics.text_sections
            row["collector"] = Summary(timed(render, scrapes)).to_json()
            row["collector_cpu"] = Summary(list(CPU_TIMES)).to_json()
            # the same series built as prometheus_client objects and rendered by it: the
            # way this started, kept as the reference
            row["prometheus_client"] = Summary(
                timed(lambda m=mode: client_objects(dp, m), max(3, scrapes // 10))
            ).to_json()
        result["modes"][mode] = row
    counters = dp.programs.map("kbp_counters")
    result["inspect_read"] = Summary(
        timed(lambda: codec.percpu_sums(counters, "kbp_counters"), max(3, scrapes // 10))
    ).to_json()
    dp.apply(NodeState(node_state.node, revision_of([]), ()), full=True)
    return result


def report(results: list[dict[str, Any]]) -> None:
    print("\nPB-14: one /metrics scrape (whole registry rendered), seconds: median / p99")
    for r in results:
        print(f"\n{r['services']} Services ({r['entries']} entries, {r['ids']} ids):")
        floor = r["modes"]["none"]["scrape"]["median"]
        for mode in MODES:
            row = r["modes"][mode]
            s, cpu = row["scrape"], row["scrape_cpu"]
            verdict = "meets" if cpu["p99"] < TARGET_SCRAPE_S else "MISSES"
            rss = row["rss_kib"]
            print(
                f"  --service-metrics {mode:<8} wall {s['median'] * 1e3:7.1f} / "
                f"{s['p99'] * 1e3:7.1f} ms, CPU {cpu['median'] * 1e3:6.1f} / "
                f"{cpu['p99'] * 1e3:6.1f} ms  [{verdict} < {TARGET_SCRAPE_S * 1e3:.0f} ms CPU]"
                f"\n      {s['median'] / floor:5.1f} x none (wall); {row['series']} "
                f"kbp_service_ series, {row['body_bytes'] // 1024} KiB; "
                f"RSS {rss[0]} → {rss[1]} → {rss[2]} KiB"
            )
            if "collector" in row:
                c, ref = row["collector_cpu"], row["prometheus_client"]
                print(
                    f"      the per-Service text alone: CPU {c['median'] * 1e3:6.1f} ms "
                    f"(median); as prometheus_client objects (reference): wall "
                    f"{ref['median'] * 1e3:7.1f} ms vs {row['collector']['median'] * 1e3:7.1f}"
                )
        i = r["inspect_read"]
        print(f"  inspect's read of all of kbp_counters: {i['median'] * 1e3:.1f} ms (median)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="PB-14 /metrics scrape cost (not a test).")
    parser.add_argument("--quick", action="store_true", help="10k Services, fewer scrapes")
    parser.add_argument("--services", type=int, nargs="+", metavar="N")
    parser.add_argument("--scrapes", type=int, help="scrapes per half (default 100; quick 30)")
    args = parser.parse_args(argv)
    sizes_wanted = args.services or ([10_000] if args.quick else [1000, 10_000])
    scrapes = args.scrapes or (30 if args.quick else 100)
    terminate_as_interrupt()
    info = machine()
    header("bench/metrics.py (PB-14)", info)
    top = max(sizes_wanted)
    sizes = map_sizes_for_generated(top)
    results = []
    began = time.perf_counter()
    try:
        with (
            bench_netns() as netns,
            tempfile.TemporaryDirectory(prefix="kbp-bench-") as tmp,
            bench_dataplane(sizes, netns) as dp,
        ):
            for n in sizes_wanted:
                results.append(run_size(dp, n, Path(tmp), scrapes))
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers() or 'nothing'})")
        return 130
    report(results)
    document = {
        "benchmark": "bench/metrics.py",
        "ids": ["PB-14"],
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "drop_reasons": len(DROP_REASONS),
        "results": results,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "duration_s": time.perf_counter() - began,
    }
    out = RESULTS / ("metrics-quick.json" if args.quick else "metrics.json")
    write_results(out, document)
    print(
        f"\nran in {document['duration_s']:.0f} s (load average now "
        f"{os.getloadavg()[0]:.2f}); results in {out}; left over: {leftovers() or 'nothing'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
