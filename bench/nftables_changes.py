"""PB-9, nftables: what one change costs the kernel, by what the transaction writes (issue
36). bench/nftables_sync.py measures the dataplane; this says where its one-change figures
come from.

On this kernel (nf_tables in 6.x) a transaction that adds a rule with an expression that
has a `validate` operation (a verdict, DNAT, most `meta` keys, a verdict-map lookup) or a
map element whose verdict is a `goto`/`jump` makes the commit validate the whole table:
every chain reachable from every base chain, every element of every verdict map on the way
(nf_tables_validate → nft_table_validate → nft_chain_validate). Plain set and map elements
(data, not verdicts) and rules without such expressions do not. The dataplane's layout
(agent/dataplane/nftables/render.py) therefore writes a change as data elements only; this
measures that and what the exceptions cost beside a large table.

Per size, in a fresh network namespace: the nftables dataplane's table for the workload's
NodeState (as bench/nftables_sync.py builds it), written whole (wall time, and the CPU of the
agent and of nft); then single-statement transactions, each undone by the next (the table
stays the same), timed by wall clock and by the `nft` process's user and kernel CPU:

    data element        an element of the hairpin set
    slot element        an endpoint slot (in a pick chain's TCP map): what most changes
                        write
    pick-set element    a frontend added to a pick chain's set
    DNAT rule           `meta l4proto tcp dnat to ...` in a chain of its own (validation:
                        a new pick chain, an IPv6 affinity entry's chain)
    goto element        an `affinity-chains` element going to that chain (validation: an
                        IPv6 affinity entry's frontend)

and the dataplane's own one-change transactions for the workload's changes
(bench.common.workload.make_changes), timed as the dataplane runs them. (The data-only
prototype this script measured before the dataplane took its layout is in
bench/notes/nftables_sync.md.)

    .venv/bin/python -m bench.nftables_changes [--quick] [--services N ...] [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.dataplane.iptables.backend import command
from agent.dataplane.nftables.dataplane import NftablesDataplane
from agent.dataplane.nftables.dataplane import cleanup as nftables_cleanup
from agent.dataplane.options import DEFAULT_POD_INTERFACES
from bench.common.kernel import bench_netns, leftovers
from bench.common.report import (
    Summary,
    fmt_s,
    header,
    machine,
    results_path,
    terminate_as_interrupt,
    write_results,
)
from bench.common.rulesets import recompile, workload
from bench.common.workload import ENDPOINTS, make_changes

T4 = "ip kube-bpf-proxy"
PAIR = "10.255.0.1 . 10.255.0.1"
KEY = "10.255.0.1 . tcp . 80"  # a frontend no Service has


class Timed:
    """`nft -f` in a namespace, with the wall time and the nft process's CPU."""

    def __init__(self, ns: str) -> None:
        self.ns = ns

    def __call__(self, text: str) -> tuple[float, float, float]:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(command(self.ns, ["nft", "-f", "-"]), input=text,
                              capture_output=True, text=True, check=False)  # fmt: skip
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"nft -f: {proc.stderr.strip()[:500]}\n{text[:500]}")
        return wall, after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime


def _cpu() -> float:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))  # fmt: skip
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def summarize(samples: list[tuple[float, float, float]]) -> dict[str, Any]:
    wall, user, kernel = (Summary([s[i] for s in samples]) for i in range(3))
    return {"wall_s": wall.to_json(), "user_s": user.to_json(), "kernel_s": kernel.to_json()}


def line(name: str, figures: dict[str, Any], extra: str = "") -> None:
    w, u, k = figures["wall_s"], figures["user_s"], figures["kernel_s"]
    # CPU times come in scheduler ticks (4 ms here): their mean, not their median
    print(f"  {name:<40} wall {fmt_s(w['median']):>8} / p99 {fmt_s(w['p99']):>8} / min "
          f"{fmt_s(w['min']):>8}   nft CPU: user {fmt_s(u['mean']):>8}, kernel "
          f"{fmt_s(k['mean']):>8}{extra}",
          flush=True)  # fmt: skip


def probes(pick: str) -> dict[str, tuple[str, str]]:
    """Single statements and their undoing, on our table (chain `bench-probe` and the pick
    chain `pick` exist)."""
    return {
        "data element (hairpin set)": (f"add element {T4} hairpin {{ {PAIR} }}",
                                       f"delete element {T4} hairpin {{ {PAIR} }}"),
        "slot element (pick-…-tcp)": (
            f"add element {T4} {pick}-tcp {{ {KEY} . 0 : 10.255.0.2 . 80 }}",
            f"delete element {T4} {pick}-tcp {{ {KEY} . 0 }}"),
        "DNAT rule": (f"add rule {T4} bench-probe meta l4proto tcp dnat to 10.255.0.1:80",
                      f"flush chain {T4} bench-probe"),
        "goto element (affinity-chains)": (
            f"add element {T4} affinity-chains {{ {KEY} : goto bench-probe }}",
            f"delete element {T4} affinity-chains {{ {KEY} }}"),
        "pick-set element": (f"add element {T4} {pick} {{ {KEY} }}",
                             f"delete element {T4} {pick} {{ {KEY} }}"),
    }  # fmt: skip


def measure_ours(n: int, w: Any, ns: str, repeat: int, per_kind: int) -> dict[str, Any]:
    recording: list[tuple[float, float, float]] | None = None

    def run(netns: str | None, argv: Sequence[str], stdin: str | None) -> Any:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(command(netns, argv), input=stdin, capture_output=True,
                              text=True, check=False)  # fmt: skip
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if recording is not None and list(argv[:2]) == ["nft", "-f"]:
            recording.append((wall, after.ru_utime - before.ru_utime,
                              after.ru_stime - before.ru_stime))  # fmt: skip
        return proc

    nft = Timed(ns)
    dp = NftablesDataplane(DEFAULT_POD_INTERFACES, netns=ns, run=run)
    start, cpu = time.perf_counter(), _cpu()
    dp.apply(w.nodestate)
    took, cpu = time.perf_counter() - start, _cpu() - cpu
    print(f"  ours: the table written in {fmt_s(took)} (CPU of the agent and nft, user + "
          f"system: {fmt_s(cpu)})", flush=True)  # fmt: skip
    nft(f"add chain {T4} bench-probe\n")
    out: dict[str, Any] = {"full": {"wall_s": took, "cpu_s": cpu}}
    held = dp._held["IPv4"]
    pick = min(p for p in held.picks if p.startswith("pick-"))
    for name, (do, undo) in probes(pick).items():
        samples = []
        for _ in range(repeat):
            samples.append(nft(do + "\n"))
            nft(undo + "\n")
        out[name] = summarize(samples)
        line(name, out[name])
    nft(f"delete chain {T4} bench-probe\n")
    # the dataplane's own transactions, one per change of the workload
    recording = []
    for change in make_changes(w.cluster, per_kind):
        state, _ = recompile(w, change)
        dp.apply(state)
    name = "the dataplane's one-change transactions"
    out[name] = summarize(recording)
    line(name, out[name], f"   ({len(recording)} changes)")
    # nft reads every table's sets (and chains) of the namespace before a change: ours
    # goes before the next layout is measured
    nftables_cleanup(ns)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PB-9, nftables: one change's cost by what the transaction writes (not "
        "a test; always exits 0)."
    )
    parser.add_argument("--services", type=int, nargs="+", metavar="N",
                        help="sizes (default 1000 10000 30000)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=20, help="samples per probe")
    parser.add_argument("--changes", type=int, default=10, help="changes per kind")
    parser.add_argument("--quick", action="store_true",
                        help="1k and 10k, 5 samples per probe, 3 changes per kind")  # fmt: skip
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    args = parser.parse_args(argv)
    terminate_as_interrupt()
    if args.quick:
        args.services = args.services or [1000, 10_000]
        args.repeat, args.changes = 5, 3
    info = machine()
    nft_version = os.popen("nft --version").read().strip()
    header("bench/nftables_changes.py (PB-9, nftables: one change)", info, f"; {nft_version}")
    began = time.perf_counter()
    report: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kbp-bench-") as tmp:
            for n in args.services or [1000, 10_000, 30_000]:
                w = workload(n, Path(tmp))
                print(f"\n# {n} Services x {ENDPOINTS}", flush=True)
                entry: dict[str, Any] = {"services": n}
                with bench_netns() as ns:
                    try:
                        entry["load_average"] = [round(x, 2) for x in os.getloadavg()]
                        print(f"  load average {entry['load_average']}", flush=True)
                        entry["ours"] = measure_ours(n, w, ns, args.repeat, args.changes)
                    finally:
                        nftables_cleanup(ns)
                report.append(entry)
                w.cluster.path.unlink()
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers() or 'nothing'})")
        return 130
    seconds = time.perf_counter() - began
    out = results_path(args, "nftables_changes")
    write_results(out, {
        "benchmark": "bench/nftables_changes.py", "id": "PB-9 (nftables, one change)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": info, "nft": nft_version,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()], "rows": report,
        "duration_s": seconds,
    })  # fmt: skip
    print(f"\nran in {seconds:.0f} s; results in {out}; left over: {leftovers() or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
