"""PB-9, nftables: what one change costs the kernel, by what the transaction writes (issue
36). bench/nftables_sync.py measures the dataplane; this says why its one-change figures
grow with the table, and what a layout that does not grow would cost.

On this kernel (nf_tables in 6.x) a transaction that adds a rule with an expression that
has a `validate` operation (a verdict, DNAT, most `meta` keys, a verdict-map lookup) or a
map element whose verdict is a `goto`/`jump` makes the commit validate the whole table:
every chain reachable from every base chain, every element of every verdict map on the way
(nf_tables_validate → nft_table_validate → nft_chain_validate). perf of one change at 10k
Services shows nearly all its kernel time there. Plain set and map elements (data, not
verdicts) and rules without such expressions do not.

Per size, in a fresh network namespace:

    ours      the nftables dataplane's table for the workload's NodeState (as
              bench/nftables_sync.py builds it); then single-statement transactions, each
              undone by the next (the table stays the same), timed by wall clock and by
              the `nft` process's user and kernel CPU:
                data element       an element of the hairpin set (no validation)
                counter rule       `counter` in a chain of its own (no validate operation)
                DNAT rule          `meta l4proto tcp dnat to ...` in that chain (validation)
                goto element       a service-ips element `goto` that chain (validation)
              and the dataplane's own one-change transactions for the workload's changes
              (bench.common.workload.make_changes), timed as the dataplane runs them
    data-only a layout whose changes are elements only (a prototype, not the dataplane):
              fixed chains `pick-<alg>-<n>` (one per algorithm and endpoint count) that DNAT
              with `ip daddr . meta l4proto . th dport . (jhash ... | numgen random) mod n
              map @endpoints`; a set per chain names its frontends; `services` tests the
              sets in turn. Every ClusterIP/external frontend of the IPv4 entries with
              clusterBackends; the same changes written as element deletes and adds. The
              pick chains for 1..64 endpoints (both algorithms) are made with the table, so
              a new connection tests up to 128 sets: a real layout would make them as
              counts appear and nest them. Without traffic policy, masquerading, affinity
              or source ranges: a lower bound of what such a layout costs

    .venv/bin/python -m bench.nftables_changes [--services N ...] [--repeat R]
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
from agent.model.nodestate import ServiceEntry
from agent.sources.manifests import load_manifests
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
PROTO = "ip kbp-data-only"
PAIR = "10.255.0.1 . 10.255.0.1"
BATCH = 2000  # elements per `add element` line
PICK_MAX = 64  # the data-only layout's pick chains: endpoint counts made with the table


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


def probes() -> dict[str, tuple[str, str]]:
    """Single statements and their undoing, on our table (chain `bench-probe` exists)."""
    return {
        "data element (hairpin set)": (f"add element {T4} hairpin {{ {PAIR} }}",
                                       f"delete element {T4} hairpin {{ {PAIR} }}"),
        "counter rule": (f"add rule {T4} bench-probe counter", f"flush chain {T4} bench-probe"),
        "DNAT rule": (f"add rule {T4} bench-probe meta l4proto tcp dnat to 10.255.0.1:80",
                      f"flush chain {T4} bench-probe"),
        "goto element (service-ips)": (
            f"add element {T4} service-ips {{ 10.255.0.1 . tcp . 80 : goto bench-probe }}",
            f"delete element {T4} service-ips {{ 10.255.0.1 . tcp . 80 }}"),
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
    for name, (do, undo) in probes().items():
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


# --- the data-only prototype ---------------------------------------------------------------


def _slots(entry: ServiceEntry) -> dict[str, tuple[str, list[str]]]:
    """frontend key → (pick chain, endpoint per slot) for one IPv4 entry."""
    backends = entry.cluster_backends or ()
    if entry.ip_family != "IPv4" or not backends:
        return {}
    alg = "r" if entry.lb_algorithm == "random" else "h"
    pick = f"pick-{alg}-{len(backends)}"
    targets = [f"{b.ip} . {b.port}" for b in backends]
    proto = entry.protocol.lower()
    return {f"{f.ip} . {proto} . {f.port}": (pick, targets) for f in entry.frontends}


def _pick_commands(pick: str) -> list[str]:
    _, alg, n = pick.split("-")
    slot = (f"jhash ip saddr . th sport . ip daddr . th dport mod {n} seed 0x6b627031"
            if alg == "h" else f"numgen random mod {n}")  # fmt: skip
    return [
        f"add set {PROTO} {pick} {{ type ipv4_addr . inet_proto . inet_service ; }}",
        f"add chain {PROTO} {pick}",
        f"add rule {PROTO} {pick} dnat ip to ip daddr . meta l4proto . th dport . {slot} "
        "map @endpoints",
        f"add rule {PROTO} services ip daddr . meta l4proto . th dport @{pick} goto {pick}",
    ]


def _batched(verb: str, where: str, items: list[str]) -> list[str]:
    return [f"{verb} element {PROTO} {where} {{ {', '.join(items[i : i + BATCH])} }}"
            for i in range(0, len(items), BATCH)]  # fmt: skip


def _elements(layout: dict[str, tuple[str, list[str]]]) -> tuple[dict[str, list[str]], list[str]]:
    members: dict[str, list[str]] = {}
    slots: list[str] = []
    for key, (pick, targets) in layout.items():
        members.setdefault(pick, []).append(key)
        slots += [f"{key} . {i} : {t}" for i, t in enumerate(targets)]
    return members, slots


def measure_data_only(n: int, w: Any, ns: str, per_kind: int) -> dict[str, Any]:
    nft = Timed(ns)
    layout: dict[str, tuple[str, list[str]]] = {}
    by_key = {e.sort_key: e for e in w.nodestate.services}
    for entry in by_key.values():
        layout.update(_slots(entry))
    # Every count up to PICK_MAX (or the largest seen) for both algorithms, made with the
    # table. (The map's typeof says `tcp dport`: with `th dport` nft 1.0.6 cannot read the
    # map back, "conflicting protocols specified: ip vs. th", and refuses any later rule
    # that uses it; the key's type is the same for UDP and SCTP.)
    most = max([PICK_MAX, *(len(t) for _, t in layout.values())])
    picks = [f"pick-{alg}-{k}" for alg in "hr" for k in range(1, most + 1)]
    members, slots = _elements(layout)
    text = [f"add table {PROTO}", f"delete table {PROTO}", f"add table {PROTO}",
            f"add map {PROTO} endpoints {{ typeof ip daddr . meta l4proto . tcp dport . "
            "numgen random mod 2 : ip daddr . tcp dport ; }",
            f"add chain {PROTO} services",
            f"add chain {PROTO} nat-prerouting {{ type nat hook prerouting priority dstnat ; }}",
            f"add rule {PROTO} nat-prerouting jump services",
            f"add chain {PROTO} nat-output {{ type nat hook output priority -100 ; }}",
            f"add rule {PROTO} nat-output jump services"]  # fmt: skip
    for pick in picks:
        text += _pick_commands(pick)
    for pick, keys in members.items():
        text += _batched("add", pick, keys)
    text += _batched("add", "endpoints", slots)
    full = nft("\n".join(text) + "\n")
    print(f"  data-only: {len(layout)} frontends, {len(slots)} endpoint slots, {len(picks)} "
          f"pick chains: written in {fmt_s(full[0])} (nft user {fmt_s(full[1])}, kernel "
          f"{fmt_s(full[2])})", flush=True)  # fmt: skip
    known = set(picks)
    samples = []
    state = w.nodestate
    for change in make_changes(w.cluster, per_kind):
        state, _ = recompile(w, change)
        new = {e.sort_key: e for e in state.services}
        touched = {
            k
            for k in by_key.keys() | new.keys()
            if by_key.get(k) is not new.get(k) and by_key.get(k) != new.get(k)
        }
        old_layout: dict[str, tuple[str, list[str]]] = {}
        new_layout: dict[str, tuple[str, list[str]]] = {}
        for k in touched:
            if k in by_key:
                old_layout.update(_slots(by_key[k]))
            if k in new:
                new_layout.update(_slots(new[k]))
        by_key = new
        went = {k: v for k, v in old_layout.items() if new_layout.get(k) != v}
        came = {k: v for k, v in new_layout.items() if old_layout.get(k) != v}
        commands: list[str] = []
        missing = {p for p, _ in came.values()} - known
        if missing:
            raise RuntimeError(f"data-only: a change needs {missing}, more than PICK_MAX")
        old_members, old_slots = _elements(went)
        for pick, keys in old_members.items():
            commands += _batched("delete", pick, keys)
        commands += _batched("delete", "endpoints", [s.split(" : ")[0] for s in old_slots])
        new_members, new_slots = _elements(came)
        for pick, keys in new_members.items():
            commands += _batched("add", pick, keys)
        commands += _batched("add", "endpoints", new_slots)
        if commands:
            samples.append(nft("\n".join(commands) + "\n"))
    out = {"full": {"wall_s": full[0], "user_s": full[1], "kernel_s": full[2]},
           "frontends": len(layout), "slots": len(slots), "pick_chains": len(picks),
           "one_change": summarize(samples)}  # fmt: skip
    line("data-only: one-change transactions", out["one_change"],
         f"   ({len(samples)} changes)")  # fmt: skip
    nft(f"delete table {PROTO}\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PB-9, nftables: one change's cost by what the transaction writes, and "
        "a data-only layout's (not a test; always exits 0)."
    )
    parser.add_argument("--services", type=int, nargs="+", metavar="N",
                        help="sizes (default 1000 10000 30000)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=20, help="samples per probe")
    parser.add_argument("--changes", type=int, default=10, help="changes per kind")
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    args = parser.parse_args(argv)
    terminate_as_interrupt()
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
                        entry["ours"] = measure_ours(n, w, ns, args.repeat, args.changes)
                        # the changes moved the workload's state: start from the file again
                        w.state, _ = load_manifests([w.cluster.path])
                        w.state.take_changes()
                        w.nodestate = w.compiler.full(w.state)
                        entry["data_only"] = measure_data_only(n, w, ns, args.changes)
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
