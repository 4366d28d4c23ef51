"""PB-13: restarts (issue 14 §3 and §4).

`kill` (issue 14 §4): an agent SIGKILLed at random points of a large eBPF apply, 100 trials. The
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

`sync` (issue 14 §3): the first sync of an agent restarted while the cluster did not change, at
10k Services x 10 endpoints served by kmock, on both dataplanes (see `sync_main`).

    .venv/bin/python -m bench.restart kill [--trials 100] [--services 5000] [--endpoints 10]
    .venv/bin/python -m bench.restart sync [--services 10000] [--dataplanes ebpf iptables]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.dataplane.ebpf import codec
from agent.dataplane.ebpf.abi import versioned
from agent.dataplane.ebpf.dataplane import cleanup as ebpf_cleanup
from agent.dataplane.ebpf.dataplane import remove_pins
from agent.dataplane.ebpf.kernel import load_programs
from agent.dataplane.ebpf.libbpf import Map
from agent.dataplane.ebpf.netlink import TcAttacher
from agent.dataplane.iptables.dataplane import cleanup as iptables_cleanup
from agent.lab.toolkit import in_netns, ip_batch, run
from bench.common.apiserver import KmockProcess
from bench.common.kernel import BENCH_PREFIX, BPFFS, bench_netns, inside_netns, leftovers
from bench.common.report import (
    RESULTS,
    header,
    machine,
    mark,
    terminate_as_interrupt,
    write_results,
)
from bench.common.workload import THIS_NODE, Workload
from tests.builders import write_kubeconfig
from tests.kernel.agentproc import AgentProcess
from tests.kernel.killapply import (
    Cluster,
    Trial,
    apply_whole,
    kill_delays,
    map_sizes,
    read_maps,
    read_tables,
    resolve,
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
    cluster = Cluster(args.services, args.endpoints, dataplane=args.dataplane)
    sizes = map_sizes(cluster)
    ebpf = args.dataplane == "ebpf"
    trials: list[Trial] = []
    sweep: list[Trial] = []
    with contextlib.ExitStack() as stack:
        ns = stack.enter_context(bench_netns())
        pins = stack.enter_context(bench_pins())
        home = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        began = time.perf_counter()
        cluster.build(sizes, home)
        a, b = cluster.states["A"], cluster.states["B"]
        print(f"states: A {len(a.services)} entries / {a.backend_count()} backends, "
              f"B {len(b.services)} / {b.backend_count()}, {len(cluster.views['A'])} and "
              f"{len(cluster.views['B'])} frontends (built in "
              f"{time.perf_counter() - began:.1f} s)", flush=True)  # fmt: skip
        if ebpf:
            load_programs(pins, asdict(sizes)).close()
        else:
            stack.callback(iptables_cleanup, ns)
        calibration = []
        for which in ("A", "B", "A", "B", "A"):
            calibration.append(apply_whole(cluster, which, pins, ns))
            if not ebpf:
                cluster.tables[which] = read_tables(ns)
        calibration = calibration[1:]  # the first apply started from nothing
        apply_s = statistics.median(r["apply_s"] for r in calibration)
        print(
            f"a whole apply A<->B: {apply_s * 1000:.0f} ms (median of 4), "
            f"{statistics.median(r['writes'] for r in calibration):.0f} writes",
            end="",
        )
        if ebpf:
            first = statistics.median(r["first_write_s"] for r in calibration)
            last = statistics.median(r["last_write_s"] for r in calibration)
            calls = statistics.median(r["write_calls"] for r in calibration)
            print(f" in {calls:.0f} write calls, the first ending at {first * 1000:.0f} ms, "
                  f"the last at {last * 1000:.0f} ms", end="")  # fmt: skip
        print(flush=True)

        old = "A"
        for k in range(1, MAX_WRITE_CALLS + 1 if ebpf else 1):
            t = trial(cluster, old, pins, ns, die_after_write=k)
            sweep.append(t)
            old = flip(old)
            if t.finished:
                break
        if sweep:
            print(f"every write boundary ({len(sweep)} trials, alternating A->B, B->A): "
                  f"outcomes {' '.join(t.verdict.outcome[0] for t in sweep)} "
                  f"(o old, m mixed, n new), violations "
                  f"{sum(len(t.verdict.violations) for t in sweep)}, convergence failures "
                  f"{sum(bool(t.converge_problems) for t in sweep)}", flush=True)  # fmt: skip

        delays = kill_delays(args.trials, apply_s, args.seed)
        for n, delay in enumerate(delays, 1):
            t = trial(cluster, old, pins, ns, delay=delay)
            trials.append(t)
            old = flip(old)
            if n % 10 == 0:
                print(f"  {n} trials: {dict(Counter(t.verdict.outcome for t in trials))}, "
                      f"violations {sum(len(t.verdict.violations) for t in trials)}",
                      flush=True)  # fmt: skip

    outcomes = Counter(t.verdict.outcome for t in trials)
    violations = sum(len(t.verdict.violations) for t in trials)
    failures = sum(bool(t.converge_problems) for t in trials)
    finished = sum(t.finished for t in trials)
    conv_writes = [t.converge["writes"] for t in trials]
    conv_s = [t.converge["open_s"] + t.converge["apply_s"] for t in trials]
    metas = Counter(t.verdict.meta for t in trials)
    what = (
        "kbp_meta"
        if ebpf
        else "tables (4/6 family, n/f nat/filter: o old, n new, b both; markers: - empty)"
    )
    print(
        f"\n## PB-13 kill, {args.dataplane}: {args.trials} SIGKILLs at uniformly random points "
        f"of an apply ({cluster.services} Services x {cluster.endpoints} endpoints, A<->B)"
    )
    print(f"outcomes: old {outcomes['old']}, mixed per Service but whole {outcomes['mixed']}, "
          f"new {outcomes['new']} (of which the apply had completed before the signal: "
          f"{finished}); {what} after the kill: {dict(metas)}")  # fmt: skip
    rule = (
        "a frontend neither old nor new, unresolvable, or kbp_meta naming a state the maps "
        "do not hold" if ebpf else "a table neither old nor new"
    )  # fmt: skip
    print(f"violations ({rule}): {violations}; convergence failures: {failures}")
    print(f"convergence (a new agent: start, read the kernel, plan, write): writes median "
          f"{statistics.median(conv_writes):.0f} (min {min(conv_writes)}, max "
          f"{max(conv_writes)}), time median {statistics.median(conv_s) * 1000:.0f} ms "
          f"(max {max(conv_s) * 1000:.0f} ms)")  # fmt: skip
    return {
        "dataplane": args.dataplane,
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


# --- sync: the first sync after a restart, at 10k Services -------------------------------

POD_VETH = "kbpr0"  # a pod interface in the bench namespace, so the eBPF programs attach
SAMPLE_PAUSE = 0.05  # seconds between the end of one sample and the next (--sample-pause)
_JUMP = re.compile(r" -[jg] (KBP-[\w-]+)")
_DNAT = re.compile(r"--to-destination (\S+)")


class EbpfView:
    """The eBPF dataplane's service now, against what it served before the restart. A
    sample checks that our programs are on both hooks of the pod interface and that
    WINDOW frontends, a window that moves on at each sample so that consecutive samples
    go round them all, resolve completely (kbp_services → every slot of its sets →
    every slot's backend, by point lookups) to the backends they had. (Reading the whole
    maps takes seconds at 10k Services on this machine: too coarse a clock.)"""

    WINDOW = 500

    def __init__(self, pin_dir: Path, ns: str) -> None:
        self.attacher = TcAttacher(ns)
        self.maps = {name: Map.pinned(str(pin_dir / versioned(name)))
                     for name in ("kbp_services", "kbp_slots", "kbp_backends")}  # fmt: skip
        content, _meta = read_maps(pin_dir)
        resolved = resolve(content)
        self.baseline = resolved.views
        self.problems = resolved.broken
        self.keys = sorted(self.baseline, key=str)
        self.cursor = 0

    def _members(self, set_id: int, count: int) -> tuple[Any, ...] | None:
        out = []
        for index in range(count):
            slot = self.maps["kbp_slots"].lookup(codec.slot_key(set_id + index))
            if slot is None or not codec.slot_backend_id(slot):  # past the array, or free
                return None
            raw = self.maps["kbp_backends"].lookup(codec.backend_key(codec.slot_backend_id(slot)))
            if raw is None:
                return None
            b = codec.decode_backend(raw)
            out.append((b.addr, b.port, b.family, b.flags))
        return tuple(sorted(out))

    def view_of(self, key: Any) -> Any:
        raw = self.maps["kbp_services"].lookup(codec.frontend_key(key))
        if raw is None:
            return None
        v = codec.decode_service(raw)
        return (v.flags, v.type, v.affinity_timeout, self._members(v.set_id, v.count),
                self._members(v.internal_set_id, v.internal_count))  # fmt: skip

    def check(self) -> tuple[int, int, str]:
        """(Services checked, unserved among them, why)."""
        hooks = {(a.ifname, a.direction) for a in self.attacher.attached()}
        missing = [d for d in ("ingress", "egress") if (POD_VETH, d) not in hooks]
        window = [self.keys[(self.cursor + i) % len(self.keys)]
                  for i in range(min(self.WINDOW, len(self.keys)))]  # fmt: skip
        self.cursor = (self.cursor + len(window)) % len(self.keys)
        wrong = [k for k in window if self.view_of(k) != self.baseline[k]]
        if missing:
            return len(window), len(self.keys), f"no kbp_ program on {POD_VETH} {missing}"
        return len(window), len(wrong), f"e.g. {wrong[0]}" if wrong else ""

    def close(self) -> None:
        self.attacher.close()
        for m in self.maps.values():
            m.close()


class IptablesView:
    """The iptables dataplane's service now (IPv4, nat table) against what it served
    before the restart: each KBP-SERVICES rule with the DNAT destinations reachable from
    it through KBP- chains, and the jumps from PREROUTING and OUTPUT to KBP-SERVICES. A
    sample is one iptables-save of the nat table and checks every Service."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.baseline, self.problems = self.snapshot()

    def snapshot(self) -> tuple[dict[str, frozenset[str] | None], list[str]]:
        text = run(in_netns(self.ns, ["iptables-save", "-t", "nat"]))
        chains: dict[str, list[str]] = {}
        for line in text.splitlines():
            if line.startswith("-A "):
                chain, _, rule = line[3:].partition(" ")
                chains.setdefault(chain, []).append(rule)
        problems = [f"no jump from {base} to KBP-SERVICES" for base in ("PREROUTING", "OUTPUT")
                    if not any("-j KBP-SERVICES" in r for r in chains.get(base, []))]  # fmt: skip
        memo: dict[str, frozenset[str]] = {}

        def destinations(chain: str, seen: frozenset[str] = frozenset()) -> frozenset[str]:
            if chain in memo:
                return memo[chain]
            found: set[str] = set()
            for rule in chains.get(chain, []):
                found.update(_DNAT.findall(rule))
                for target in _JUMP.findall(rule):
                    if target not in seen:
                        found |= destinations(target, seen | {chain})
            memo[chain] = frozenset(found)
            return memo[chain]

        views = {rule: destinations(_JUMP.findall(rule)[0]) if _JUMP.findall(rule) else None
                 for rule in chains.get("KBP-SERVICES", [])}  # fmt: skip
        return views, problems

    def check(self) -> tuple[int, int, str]:
        views, problems = self.snapshot()
        if problems:
            return len(self.baseline), len(self.baseline), problems[0]
        wrong = [k for k, v in self.baseline.items() if views.get(k) != v]
        return len(self.baseline), len(wrong), f"e.g. {wrong[0]}" if wrong else ""

    def close(self) -> None:
        pass


class Sampler:
    """Samples a view (EbpfView, IptablesView) again and again on a thread. A Service is
    unserved in a sample when the kernel lacks what served it before the restart: its
    frontend (or dispatch rule) is missing, does not resolve, or resolves to other
    backends, or the programs (jump rules) that lead to it are missing. The time any
    Service is unserved is the sum of the intervals from a sample that found one to the
    next sample."""

    def __init__(self, view: EbpfView | IptablesView, pause: float = SAMPLE_PAUSE) -> None:
        self.view = view
        self.pause = pause
        self.samples: list[tuple[float, float, int, int, str]] = []  # start, end, checked,
        # unserved, why
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            checked, unserved, why = self.view.check()
            self.samples.append((began, time.perf_counter(), checked, unserved, why))
            self._stop.wait(self.pause)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(60)
        s = self.samples
        unserved_s = sum(s[i + 1][0] - s[i][0] for i in range(len(s) - 1) if s[i][3])
        gaps = [s[i + 1][0] - s[i][0] for i in range(len(s) - 1)]
        bad = [x for x in s if x[3]]
        return {
            "samples": len(s),
            "services_checked": sum(x[2] for x in s),
            "sample_seconds_median": statistics.median(x[1] - x[0] for x in s) if s else None,
            "largest_gap_s": max(gaps, default=None),
            "samples_with_unserved": len(bad),
            "unserved_s": unserved_s,
            "most_unserved": max((x[3] for x in s), default=0),
            "first_unserved_why": bad[0][4] if bad else None,
        }


def ready_after(ns: str, url: str, began: float, limit: float) -> float | None:
    """Seconds from `began` until GET url answers 200 (polled every 20 ms from inside
    namespace ns); None when it does not within `limit` s."""
    result: list[float] = []

    def poll() -> None:
        with inside_netns(ns):
            while time.perf_counter() - began < limit:
                with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        result.append(time.perf_counter() - began)
                        return
                time.sleep(0.02)

    thread = threading.Thread(target=poll, name="readyz")
    thread.start()
    thread.join()
    return result[0] if result else None


def health_url(agent: AgentProcess) -> str:
    line = agent.lines[agent.wait_for_line("health server listening on")]
    return f"http://{line.rsplit(' ', 1)[-1]}/readyz"


def first_sync(agent: AgentProcess, after: int, timeout: float) -> dict[str, Any]:
    """The agent's first sync, from its log: writes (0 when the kernel already held it)."""
    n = agent.wait_for_line("sync: ", after, timeout)
    while not re.search(r"sync: (applied revision|the kernel already holds)", agent.lines[n]):
        n = agent.wait_for_line("sync: ", n + 1, timeout)
    line = agent.lines[n]
    writes = re.search(r"(\d+) writes in ([\d.]+) ms", line)
    nothing = re.search(r"nothing to write \(([\d.]+) ms\)", line)
    return {
        "log": line.split("sync: ", 1)[1],
        "writes": int(writes.group(1)) if writes else 0,
        "apply_ms": float(writes.group(2))
        if writes
        else float(nothing.group(1))
        if nothing
        else None,
    }


def agent_argv(dataplane: str, kubeconfig: Path, pin_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "agent", "run", "--kubeconfig", str(kubeconfig),
        "--node", THIS_NODE, "--dataplane", dataplane, "--pod-interfaces", POD_VETH,
        "--bpffs", str(pin_dir), "--cgroup-root", "none", "--xdp", "false",
        "--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "127.0.0.1:0",
    ]  # fmt: skip


def restart_once(
    dataplane: str, ns: str, kubeconfig: Path, pin_dir: Path, pause: float
) -> dict[str, Any]:
    """An agent syncs from kmock; it is SIGKILLed and a second one started: its first sync,
    its time to ready, and what the kernel served meanwhile."""
    argv = agent_argv(dataplane, kubeconfig, pin_dir)
    limit = 600.0
    began = time.perf_counter()
    first = AgentProcess(ns, argv, f"first {dataplane} agent")
    second: AgentProcess | None = None
    view: EbpfView | IptablesView | None = None
    try:
        cold = first_sync(first, 0, limit)
        cold_ready = ready_after(ns, health_url(first), began, limit)
        print(f"  first agent: {cold['log']}; ready {cold_ready:.1f} s after its start",
              flush=True)  # fmt: skip
        view = EbpfView(pin_dir, ns) if dataplane == "ebpf" else IptablesView(ns)
        if view.problems:
            raise RuntimeError(f"the first agent's state does not serve: {view.problems[:3]}")
        baseline = view.baseline
        sampler = Sampler(view, pause)
        sampler.start()
        time.sleep(0.5)
        killed = time.perf_counter()
        first.stop(signal.SIGKILL)
        second = AgentProcess(ns, argv, f"second {dataplane} agent")
        restarted = time.perf_counter()
        warm = first_sync(second, 0, limit)
        warm_ready = ready_after(ns, health_url(second), restarted, limit)
        time.sleep(2.0)  # and a little after
        sampling = sampler.stop()
        held = list(second.lines)
    finally:
        if view is not None:
            view.close()
        for agent in (first, second):
            if agent is not None:
                agent.stop(signal.SIGKILL if agent is first else signal.SIGTERM)
    print(f"  second agent: {warm['log']}; ready {warm_ready:.2f} s after its start "
          f"({restarted - killed:.3f} s after the SIGKILL)", flush=True)  # fmt: skip
    what = "frontends" if dataplane == "ebpf" else "dispatch rules"
    print(f"  sampled {sampling['samples']} times ({sampling['services_checked']} {what} "
          f"checked, of {len(baseline)}; a sample "
          f"{sampling['sample_seconds_median'] * 1000:.0f} ms, largest gap "
          f"{sampling['largest_gap_s'] * 1000:.0f} ms): time with any Service unserved "
          f"{sampling['unserved_s']:.3f} s ({sampling['samples_with_unserved']} samples)",
          flush=True)  # fmt: skip
    return {
        "dataplane": dataplane,
        "first_agent": {**cold, "ready_s": cold_ready},
        "second_agent": {**warm, "ready_s": warm_ready, "log": held},
        "served": sampling,
        "baseline_entries": len(baseline),
    }


def sync_main(args: argparse.Namespace) -> dict[str, Any]:
    """Issue 14 §3: kmock serves N Services x E endpoints (bench/compile.py's cluster) inside a
    namespace of this run; `kube-bpf-proxy run` (a real agent process, in that namespace,
    with a pod veth there) syncs it; it is SIGKILLed and a second agent started. Printed:
    the second agent's first-sync writes (0 when it found the kernel already holding the
    cluster's state), the time from its start to /readyz 200, and the time any Service
    was unserved between the kill and 2 s after the second agent was ready (see Sampler;
    it must be 0). Then the same with --dataplane iptables."""
    workload = Workload(args.services, args.endpoints, 0)
    results = []
    with contextlib.ExitStack() as stack:
        ns = stack.enter_context(bench_netns())
        ip_batch(ns, ["link set lo up", f"link add {POD_VETH} type veth peer name {POD_VETH}p",
                      f"link set {POD_VETH} up", f"link set {POD_VETH}p up"])  # fmt: skip
        log = stack.enter_context(tempfile.NamedTemporaryFile("w+", suffix="-kmock.log"))
        kmock = KmockProcess(workload, log, prefix=in_netns(ns, []))
        stack.callback(kmock.close)
        print(f"kmock: {workload.label} loaded in {kmock.load_s:.1f} s", flush=True)
        home = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        kubeconfig = Path(write_kubeconfig(home / "kubeconfig", kmock.url))
        for dataplane in args.dataplanes:
            print(f"\n### --dataplane {dataplane}", flush=True)
            pin_dir = BPFFS / f"{BENCH_PREFIX}{os.getpid()}-sync"
            try:
                results.append(restart_once(dataplane, ns, kubeconfig, pin_dir, args.sample_pause))
            finally:
                with TcAttacher(ns) as attacher:
                    ebpf_cleanup(pin_dir, attacher)
                iptables_cleanup(netns=ns)
    print(f"\n## PB-13 sync: restart with an unchanged cluster, {workload.label}")
    for r in results:
        w, s = r["second_agent"], r["served"]
        print(f"{r['dataplane']:>8}: first sync after the restart {w['writes']} writes "
              f"{mark(w['writes'] == 0)} (a cold start wrote {r['first_agent']['writes']}); "
              f"start to /readyz 200 {w['ready_s']:.2f} s (cold {r['first_agent']['ready_s']:.2f}"
              f" s); time with any Service unserved {s['unserved_s']:.3f} s "
              f"{mark(s['unserved_s'] == 0)} ({s['samples']} samples)")  # fmt: skip
    return {"workload": asdict(workload), "runs": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="PB-13: restarts (not a test; exits 0).")
    sub = parser.add_subparsers(dest="scenario", required=True)
    kill = sub.add_parser("kill", help="SIGKILL at random points of an eBPF apply")
    kill.add_argument("--trials", type=int, default=100)
    kill.add_argument("--services", type=int, default=5000)
    kill.add_argument("--endpoints", type=int, default=10)
    kill.add_argument("--seed", type=int, default=14)
    kill.add_argument("--dataplane", choices=("ebpf", "iptables"), default="ebpf")
    kill.add_argument("--json", type=Path)
    sync = sub.add_parser("sync", help="the first sync after a restart at 10k (kmock)")
    sync.add_argument("--services", type=int, default=10_000)
    sync.add_argument("--endpoints", type=int, default=10)
    sync.add_argument("--dataplanes", nargs="+", default=["ebpf", "iptables"],
                      choices=["ebpf", "iptables"])  # fmt: skip
    sync.add_argument("--sample-pause", type=float, default=SAMPLE_PAUSE, metavar="S",
                      help="seconds the sampler rests between samples (it competes with "
                      "the agent for the CPUs)")  # fmt: skip
    sync.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    terminate_as_interrupt()
    info = machine()
    header(f"bench/restart.py {args.scenario} (PB-13)", info)
    began = time.perf_counter()
    try:
        report = kill_main(args) if args.scenario == "kill" else sync_main(args)
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers() or 'nothing'})")
        return 130
    seconds = time.perf_counter() - began
    suffix = f"-{args.dataplane}" if args.scenario == "kill" else ""
    out = args.json or RESULTS / f"restart-{args.scenario}{suffix}.json"
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
