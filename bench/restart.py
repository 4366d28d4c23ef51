"""PB-13: restarts (issue 14 §3 and §4).

`kill` (§4): an agent SIGKILLed at random points of a large eBPF apply, 100 trials. The
maps start holding state A (or B) wholly; an agent process applies the other state and is
killed after a delay drawn uniformly from [0, the apply's duration]; the maps must then
hold, per Service, the old or the new state, never neither, and kbp_meta must not name a
revision the maps do not wholly hold; the next agent process applies the new state and
the maps must hold exactly it. Then the same back the other way. Before the random
trials, every boundary between two map writes of an apply is tried once in each
direction (the agent kills itself right after its K-th write call). The trial itself, its
states and its checks are tests/kernel/killapply.py (the kernel test runs a few); its
agent processes run the real EbpfDataplane on the pins (no bcc compile per process, see
there).

`sync` (§3): see `sync_main`.

    .venv/bin/python -m bench.restart kill [--trials 100] [--services 5000] [--endpoints 10]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.dataplane.ebpf.dataplane import remove_pins
from agent.dataplane.ebpf.kernel import load_programs
from bench.compile import RESULTS
from bench.datapath import (
    BENCH_PREFIX,
    BPFFS,
    bench_netns,
    header,
    leftovers,
    machine,
    terminate_as_interrupt,
    write_results,
)
from tests.kernel.killapply import (
    Cluster,
    Trial,
    apply_whole,
    kill_delays,
    map_sizes,
    trial,
)

MAX_WRITE_CALLS = 60


@contextlib.contextmanager
def bench_pins() -> Iterator[Path]:
    """A pin directory of this run (bench.datapath.remove_orphans knows the name)."""
    pin_dir = BPFFS / f"{BENCH_PREFIX}{os.getpid()}-kill"
    try:
        yield pin_dir
    finally:
        remove_pins(pin_dir)


def flip(which: str) -> str:
    return "B" if which == "A" else "A"


def trial_json(t: Trial) -> dict[str, Any]:
    return {
        "old": t.old,
        "cut": t.cut,
        "finished_before_kill": t.finished,
        "outcome": t.verdict.outcome,
        "kbp_meta": t.verdict.meta,
        "frontends": t.verdict.frontends,
        "violations": t.verdict.violations[:10],
        "converge": t.converge,
        "converge_problems": t.converge_problems,
    }


def kill_main(args: argparse.Namespace) -> dict[str, Any]:
    cluster = Cluster(args.services, args.endpoints)
    sizes = map_sizes(cluster)
    began = time.perf_counter()
    cluster.build(sizes)
    a, b = cluster.states["A"], cluster.states["B"]
    print(f"states: A {len(a.services)} entries / {a.backend_count()} backends, "
          f"B {len(b.services)} / {b.backend_count()}, {len(cluster.views['A'])} and "
          f"{len(cluster.views['B'])} frontends (built in {time.perf_counter() - began:.1f} s)",
          flush=True)  # fmt: skip
    trials: list[Trial] = []
    with bench_netns() as ns, bench_pins() as pins:
        load_programs(pins, asdict(sizes)).close()
        apply_whole(cluster, "A", pins, ns)
        calibration = [apply_whole(cluster, w, pins, ns) for w in ("B", "A", "B", "A")]
        apply_s = statistics.median(r["apply_s"] for r in calibration)
        first = statistics.median(r["first_write_s"] for r in calibration)
        last = statistics.median(r["last_write_s"] for r in calibration)
        calls = statistics.median(r["write_calls"] for r in calibration)
        print(f"a whole apply A<->B: {apply_s * 1000:.0f} ms (median of 4), "
              f"{statistics.median(r['writes'] for r in calibration):.0f} writes in {calls:.0f} "
              f"write calls, the first ending at {first * 1000:.0f} ms, the last at "
              f"{last * 1000:.0f} ms", flush=True)  # fmt: skip

        old = "A"
        sweep: list[Trial] = []
        for direction in ("A", "B"):
            old = direction
            for k in range(1, MAX_WRITE_CALLS + 1):
                t = trial(cluster, old, pins, ns, die_after_write=k)
                sweep.append(t)
                old = flip(old)
                if t.finished:
                    break
                # back to `direction` for the next boundary: the trial left the new state
                apply_whole(cluster, direction, pins, ns)
                old = direction
        print(f"every write boundary ({len(sweep)} trials): outcomes "
              f"{' '.join(f'{t.verdict.outcome[0]}' for t in sweep)} "
              f"(o old, m mixed, n new), violations "
              f"{sum(len(t.verdict.violations) for t in sweep)}, convergence failures "
              f"{sum(bool(t.converge_problems) for t in sweep)}", flush=True)  # fmt: skip

        delays = kill_delays(args.trials, apply_s, args.seed)
        for n, delay in enumerate(delays, 1):
            t = trial(cluster, old, pins, ns, delay=delay)
            trials.append(t)
            old = flip(old)
            if n % 10 == 0:
                print(f"  {n} trials: {dict(Counter(t.verdict.outcome for t in trials))}",
                      flush=True)  # fmt: skip

    outcomes = Counter(t.verdict.outcome for t in trials)
    violations = sum(len(t.verdict.violations) for t in trials)
    failures = sum(bool(t.converge_problems) for t in trials)
    finished = sum(t.finished for t in trials)
    conv_writes = [t.converge["writes"] for t in trials]
    conv_s = [t.converge["open_s"] + t.converge["apply_s"] for t in trials]
    metas = Counter(t.verdict.meta for t in trials)
    print(
        f"\n## PB-13 kill: {args.trials} SIGKILLs at uniformly random points of an apply "
        f"({cluster.services} Services x {cluster.endpoints} endpoints, A<->B)"
    )
    print(f"outcomes: old {outcomes['old']}, mixed per Service but whole {outcomes['mixed']}, "
          f"new {outcomes['new']} (of which the apply had completed before the signal: "
          f"{finished}); kbp_meta after the kill: {dict(metas)}")  # fmt: skip
    print(
        f"violations (a frontend neither old nor new, unresolvable, or kbp_meta naming a "
        f"state the maps do not hold): {violations}; convergence failures: {failures}"
    )
    print(f"convergence (a new agent: open the maps, plan, write): writes median "
          f"{statistics.median(conv_writes):.0f} (min {min(conv_writes)}, max "
          f"{max(conv_writes)}), time median {statistics.median(conv_s) * 1000:.0f} ms "
          f"(max {max(conv_s) * 1000:.0f} ms)")  # fmt: skip
    return {
        "services": cluster.services,
        "endpoints": cluster.endpoints,
        "map_sizes": asdict(sizes),
        "calibration": calibration,
        "sweep": [trial_json(t) for t in sweep],
        "trials": [trial_json(t) for t in trials],
        "delays": delays,
        "outcomes": dict(outcomes),
        "violations": violations,
        "convergence_failures": failures,
        "convergence_writes_median": statistics.median(conv_writes),
        "convergence_seconds_median": statistics.median(conv_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="PB-13: restarts (not a test; exits 0).")
    sub = parser.add_subparsers(dest="scenario", required=True)
    kill = sub.add_parser("kill", help="SIGKILL at random points of an eBPF apply")
    kill.add_argument("--trials", type=int, default=100)
    kill.add_argument("--services", type=int, default=5000)
    kill.add_argument("--endpoints", type=int, default=10)
    kill.add_argument("--seed", type=int, default=14)
    kill.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    terminate_as_interrupt()
    info = machine()
    header(f"bench/restart.py {args.scenario} (PB-13)", info)
    began = time.perf_counter()
    try:
        report = kill_main(args)
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers() or 'nothing'})")
        return 130
    seconds = time.perf_counter() - began
    out = args.json or RESULTS / f"restart-{args.scenario}.json"
    write_results(out, {
        "benchmark": "bench/restart.py",
        "id": "PB-13",
        "scenario": args.scenario,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        **report,
        "duration_s": seconds,
    })  # fmt: skip
    print(f"\nran in {seconds:.0f} s; results in {out}; left over: {leftovers() or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
