"""Health-probe latency while the file source reads one very large manifest (issue 21).

    .venv/bin/python bench/big_manifest.py              # a 200 MB `kind: List`, ~2 min
    .venv/bin/python bench/big_manifest.py --size 50    # 50 MB

The file (tests/bigmanifest.py: one YAML document, a `kind: List` of Services with an
EndpointSlice of ten endpoints each) is read by `load_file` in a worker process that also
serves `/healthz` on 127.0.0.1 with the agent's serving layer, as the agent does, once
parsing in the worker itself (as before: `child_from=None`) and once through the parser
child process (`parse_in_child`, what files above `CHILD_FROM` get), side by side. This
process probes `/healthz` every `--interval` seconds, each on a new connection, from
before the load starts until it ends. Printed per way: the load time, the objects
decoded, the worker's peak RSS and the parser child's, and the probes' median, p99 and
worst latency with how many took over 1 s (the target: none).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common.probe import (
    Probe,
    ProbeFigures,
    cell,
    healthz_handler,
    probe_figures,
    probe_until,
)
from bench.common.report import ROOT, fmt_s, machine, mark, results_path, write_results
from tests.bigmanifest import write_list

TARGET = 1.0  # seconds: every probe answered within this
WAYS = {"in the agent's process": "inline", "parser child process": "child"}


@dataclass
class Figures(ProbeFigures):
    way: str
    load_seconds: float
    objects: int
    reports: int
    worker_peak_rss_mib: float
    child_peak_rss_mib: float


def worker(mode: str, path: Path) -> None:
    """Serve /healthz, then load `path`; print the port, then one JSON line of figures."""
    from agent.api.serving import serve
    from agent.sources.manifests import CHILD_FROM, load_file

    server = serve("127.0.0.1:0", {"/healthz": healthz_handler()}, name="bench")
    print(json.dumps({"port": server.port}), flush=True)
    sys.stdin.readline()  # the prober is running
    started = time.monotonic()
    assert path.stat().st_size > CHILD_FROM
    load = load_file(path, child_from=None if mode == "inline" else CHILD_FROM)
    seconds = time.monotonic() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(
        json.dumps(
            {
                "seconds": seconds,
                "objects": len(load.entries),
                "reports": [str(r) for r in load.reports[:5]],
                "report_count": len(load.reports),
                "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "child_peak_rss_kib": children,
            }
        ),
        flush=True,
    )
    sys.stdin.readline()
    server.close()


def measure(way: str, mode: str, path: Path, args: argparse.Namespace) -> Figures:
    process = subprocess.Popen(
        [sys.executable, __file__, "--worker", mode, str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert process.stdin is not None and process.stdout is not None
    port = json.loads(process.stdout.readline())["port"]
    results: list[Probe] = []
    done = threading.Event()
    thread = threading.Thread(
        target=probe_until, args=(port, args.probe_timeout, args.interval, done.is_set, results)
    )
    thread.start()
    time.sleep(0.5)
    process.stdin.write("go\n")
    process.stdin.flush()
    line = process.stdout.readline()
    done.set()
    thread.join()
    process.stdin.write("stop\n")
    process.stdin.close()
    process.wait(timeout=60)
    figures = json.loads(line)
    for report in figures["reports"]:
        print(f"  report: {report}")
    return Figures(
        way=way,
        load_seconds=figures["seconds"],
        objects=figures["objects"],
        reports=figures["report_count"],
        worker_peak_rss_mib=figures["peak_rss_kib"] / 1024,
        child_peak_rss_mib=figures["child_peak_rss_kib"] / 1024,
        **probe_figures(results, TARGET),
    )


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=200.0, help="manifest size in MB")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between probes")
    parser.add_argument("--probe-timeout", type=float, default=30.0)
    parser.add_argument("--json", type=Path, help="results file (default bench/results/)")
    args = parser.parse_args()
    load_average = [round(x, 2) for x in os.getloadavg()]
    results = []
    with tempfile.TemporaryDirectory(prefix="kbp-bench-big-") as directory:
        path = Path(directory) / "big.yaml"
        services = write_list(path, int(args.size * 1e6))
        size = path.stat().st_size
        print(
            f"{path.name}: {size / 1e6:.0f} MB, one kind: List of {services} Services and "
            f"{services} EndpointSlices; load average {load_average}"
        )
        columns = ["way", "load", "objects", "worker peak RSS", "child peak RSS", "probes",
                   "median", "p99", "worst", "> 1 s"]  # fmt: skip
        print("\n| " + " | ".join(columns) + " |")
        print("|" + " --- |" * len(columns))
        for way, mode in WAYS.items():
            f = measure(way, mode, path, args)
            results.append(asdict(f))

            print(
                f"| {f.way} | {fmt_s(f.load_seconds)} | {f.objects} "
                f"| {f.worker_peak_rss_mib:.0f} MiB | {f.child_peak_rss_mib:.0f} MiB "
                f"| {f.probes} | {cell(f.median)} | {cell(f.p99)} | {cell(f.worst)} "
                f"| {f.over_target} {mark(f.over_target == 0)} |",
                flush=True,
            )
    inline, child = results
    if inline["worst"] and child["worst"]:
        print(
            f"\nworst probe: {inline['worst'] / child['worst']:.1f}x lower through the child; "
            f"load time ratio child/inline {child['load_seconds'] / inline['load_seconds']:.2f}"
        )
    out = results_path(args, "big_manifest")
    write_results(out, {
        "machine": machine(),
        "settings": {"size_bytes": size, "services": services, "interval": args.interval},
        "results": results,
    })  # fmt: skip
    print(f"\nresults written to {out}")


if __name__ == "__main__":
    main()
