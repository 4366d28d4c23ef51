"""PB-10: conntrack under pressure, the eBPF and the iptables dataplane side by side.

Per dataplane, one namespace lab (tests/lab/nodelab.py): a client pod and three backend
pods (lab podserver, TCP 8080) behind one ClusterIP (10.96.0.10:80). The client opens
N idle connections, then makes short connections (connect, read the greeting, close) at
a steady rate for a fixed time, then sends a line on every idle connection. The eBPF
conntrack map holds 1/8 (--ct-fraction) of the entries the run's flows would need (two
per flow), the
agent's collector sweeping it every --sweep seconds with the default timeouts; iptables
uses the kernel's conntrack as it is. Reported: idle connections that still echo
(target: all), short connections that failed (target: 0), the fill ratio sampled every
second (eBPF: entries counted in kbp_ct / its size; iptables: nf_conntrack_count /
nf_conntrack_max of the node namespace), and the collector's CPU per 100k entries swept.

    .venv/bin/python -m bench.conntrack [--quick] [--idle N] [--rate R] [--seconds T]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

THIS_FILE = Path(__file__).resolve()
PORT = 8080
DATAPLANES = ("ebpf", "iptables")


# --- pod side (a fresh interpreter in the client pod: standard library only) ----------------


def pod_short(ip: str, port: int, rate: float, seconds: float) -> dict[str, Any]:
    """Short TCP connections at `rate` per second for `seconds`: connect, read the
    greeting line, close."""
    ok, failed, errors = 0, 0, {}
    interval, start = 1.0 / rate, time.monotonic()
    n = 0
    while time.monotonic() - start < seconds:
        due = start + n * interval
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        n += 1
        try:
            with socket.create_connection((ip, port), timeout=3) as sock:
                if not sock.recv(256):
                    raise EOFError("closed before the greeting")
            ok += 1
        except (OSError, EOFError) as exc:
            failed += 1
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
    return {"ok": ok, "failed": failed, "errors": errors, "seconds": time.monotonic() - start}


# --- node side -------------------------------------------------------------------------------


class FillSampler:
    """Samples the fill ratio every second in a thread while the load runs."""

    def __init__(self, read: Any) -> None:
        self.read = read
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            try:
                self.samples.append(self.read())
            except (OSError, ValueError):
                continue

    def __enter__(self) -> FillSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def run_one(kind: str, args: argparse.Namespace, flows: int) -> dict[str, Any]:
    from agent.dataplane.ebpf.maps import MapSizes
    from agent.dataplane.ebpf.options import EbpfOptions, Timeouts
    from agent.lab.toolkit import PODCLIENT, in_netns
    from agent.model.compile import compile
    from bench.common.kernel import BENCH_PREFIX, BPFFS
    from tests.builders import default_nodes, make_endpoint, make_service, make_slice, state_of
    from tests.lab.kit import read_line, stop_process
    from tests.lab.nodelab import Lab

    ct_entries = max(256, flows * 2 // args.ct_fraction)
    lost = None
    with Lab() as lab:
        client = lab.add_pod("client")
        names = ("be1", "be2", "be3")
        pods = [lab.add_pod(name) for name in names]
        for pod in pods:
            pod.serve([PORT], ("tcp",))

        def spec(obj: dict) -> None:
            obj["spec"]["clusterIP"] = "10.96.0.10"
            obj["spec"]["clusterIPs"] = ["10.96.0.10"]

        objects = [
            make_service(name="pressure", mutate=spec),
            make_slice(name="pressure-v4", service="pressure",
                       endpoints=[make_endpoint(p.ipv4, "node-a") for p in pods]),
        ]  # fmt: skip
        state = compile(state_of(*default_nodes(), *objects), "node-a")
        dataplane: Any
        if kind == "ebpf":
            from agent.dataplane.ebpf.dataplane import EbpfDataplane

            sizes = MapSizes(4096, 65536, 4096, ct_entries, 1024)
            pin_dir = BPFFS / f"{BENCH_PREFIX}{os.getpid()}-ct"  # as bench.datapath names them
            dataplane = EbpfDataplane(EbpfOptions(
                pin_dir, ("vethkbp*",), sizes, netns=lab.node_ns, ct_timeouts=Timeouts(),
                ct_sweep_interval=args.sweep,
            ))  # fmt: skip
            table = dataplane.programs.map("kbp_ct")
            sweeps: list[Any] = []
            collector = dataplane.conntrack
            original = collector.run_once

            def recorded(now: int | None = None) -> Any:
                report = original(now)
                sweeps.append(report)
                return report

            collector.run_once = recorded  # type: ignore[method-assign]

            def fill() -> float:
                return len(table.keys()) / ct_entries
        else:
            from agent.dataplane.iptables.dataplane import IptablesDataplane

            dataplane = IptablesDataplane(("vethkbp*",), netns=lab.node_ns)
            sweeps = []

            def fill() -> float:
                count = lab.run_in_node("cat", "/proc/sys/net/netfilter/nf_conntrack_count")
                top = lab.run_in_node("cat", "/proc/sys/net/netfilter/nf_conntrack_max")
                return int(count) / int(top)

        try:
            dataplane.apply(state)
            idle_argv = in_netns(client.ns, [sys.executable, str(PODCLIENT), "idle",
                                             "10.96.0.10", "80", "-n", str(args.idle)])  # fmt: skip
            idle = subprocess.Popen(idle_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True)  # fmt: skip
            try:
                json.loads(read_line(idle, timeout=60))
                short_argv = in_netns(client.ns, [sys.executable, str(THIS_FILE), "--pod-short",
                                                  "10.96.0.10", "80", str(args.rate),
                                                  str(args.seconds)])  # fmt: skip
                with FillSampler(fill) as sampler:
                    done = subprocess.run(short_argv, capture_output=True, text=True,
                                          timeout=args.seconds * 4 + 60, check=True)  # fmt: skip
                short = json.loads(done.stdout.strip().splitlines()[-1])
                assert idle.stdin is not None
                idle.stdin.write("go\n")
                idle.stdin.flush()
                after = json.loads(read_line(idle, timeout=120))
                if kind == "ebpf":  # idle flows whose entries the LRU had evicted
                    lost = dataplane.conntrack.lost_total()
            finally:
                stop_process(idle)
        finally:
            dataplane.cleanup()
    swept = sum(r.entries for r in sweeps)
    cpu = sum(r.cpu_seconds for r in sweeps)
    return {
        "dataplane": kind,
        "ct_entries": ct_entries if kind == "ebpf" else None,
        "idle_echoed": after["echoed"],
        "idle": args.idle,
        "short_ok": short["ok"],
        "short_failed": short["failed"],
        "short_errors": short["errors"],
        "short_rate": round(short["ok"] / short["seconds"], 1),
        "fill_samples": [round(x, 3) for x in sampler.samples],
        "sweeps": len(sweeps),
        "collected": sum(r.collected for r in sweeps),
        "lost": lost,
        "collector_cpu_ms_per_100k": round(cpu / swept * 1e5 * 1e3, 1) if swept else None,
    }


def run(args: argparse.Namespace) -> int:
    from bench.common.report import RESULTS, header, machine, terminate_as_interrupt, write_results

    terminate_as_interrupt()
    info = machine()
    header("bench/conntrack.py (PB-10)", info)
    flows = args.idle + int(args.rate * args.seconds)
    print(f"{args.idle} idle connections, short ones at {args.rate}/s for {args.seconds} s "
          f"(~{flows} flows); eBPF kbp_ct at 1/{args.ct_fraction} of their entries, sweep every "
          f"{args.sweep} s", flush=True)  # fmt: skip
    results = []
    for kind in [d for d in DATAPLANES if d in args.dataplanes.split(",")]:
        result = run_one(kind, args, flows)
        results.append(result)
        samples = result["fill_samples"]
        print(f"{kind:9} idle echoed {result['idle_echoed']}/{result['idle']}, short ok "
              f"{result['short_ok']} failed {result['short_failed']} "
              f"({result['short_rate']}/s), fill max {max(samples, default=0):.3f} "
              f"mean {sum(samples) / max(1, len(samples)):.3f}"
              + (f", kbp_ct {result['ct_entries']} entries, {result['sweeps']} sweeps "
                 f"collected {result['collected']}, segments that found no entry "
                 f"{result['lost']}, collector CPU "
                 f"{result['collector_cpu_ms_per_100k']} ms per 100k entries"
                 if kind == "ebpf" else ""), flush=True)  # fmt: skip
    tag = time.strftime("%Y%m%dT%H%M%S")
    write_results(RESULTS / f"conntrack-{tag}.json", {"machine": info, "args": vars(args),
                                                      "results": results})  # fmt: skip
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pod-short", nargs=4, metavar=("IP", "PORT", "RATE", "SECONDS"))
    parser.add_argument("--quick", action="store_true", help="15 s of load instead of 60 s")
    parser.add_argument("--idle", type=int, default=100)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float)
    parser.add_argument("--sweep", type=float, default=2.0, help="collector interval, s")
    parser.add_argument("--ct-fraction", type=int, default=8,
                        help="kbp_ct holds 1/this of the entries the run's flows need")  # fmt: skip
    parser.add_argument("--dataplanes", default="ebpf,iptables")
    args = parser.parse_args()
    if args.pod_short:
        ip, port, rate, seconds = args.pod_short
        print(json.dumps(pod_short(ip, int(port), float(rate), float(seconds))), flush=True)
        return 0
    if args.seconds is None:
        args.seconds = 15.0 if args.quick else 60.0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
