"""PB-2, taken apart: what the cgroup connect hook itself costs per connect() (and the
release hook per close()), from the kernel's own program statistics (BPF_ENABLE_STATS:
run_time_ns / run_cnt of this run's kbp_connect4 and kbp_release only, whatever other
programs the machine runs), beside the connect() p50 of the same sets against the floor,
with N ClusterIP Services programmed (--services; the measured ones among them).

One namespace lab (tests/lab/nodelab.py) with its cgroup: `client0` → `server0` with no
program and outside the cgroup (the floor), and `client` (in the cgroup, the dataplane on
its veth, --socket-lb all) → ClusterIPs served by `server`:

    floor       client0 → server0 pod IP, no programs, no hooks
    floor2      the same again, as another kind: the A/A check (how far two identical
                paths read apart in one run)
    sock        client → 10.96.255.254:80 (one backend, no affinity)
    affinity    client → 10.96.255.253:80 (one backend, ClientIP affinity)
    udp         client, a UDP socket connect()ed to 10.96.255.254:80 (the same Service's
                UDP port; the hook only: no datagram is sent)
    pod_ip      client → server pod IP:8080 (no frontend has that port: the hook leaves)
    pod_ip80    client → server pod IP:80 (a frontend port, no Service at that address)
    floor_bound client0 → server0 pod IP from a source port bound before connect() (the
                floor of the two kinds below: a bound socket skips the port search)
    bound       client → 10.96.255.254:80 from a bound source port whose translated
                tuple is free: what the hook's tuple check (issue 31) adds
    taken       client → 10.96.255.252:80 (a second Service, same backend) from the source
                port of a socket held open to 10.96.255.254:80: the translated tuple is
                taken, so the hook writes a remapped flow and leaves the connection to tc
                (the fallback path; tc's programs then translate every packet)

Bound ports come from the lab's reserved range (40000-41999: no ephemeral connection
holds them); `bound` and `floor_bound` cycle through 40000-40999, `taken` binds 41999 for
every socket, its first one held open for the set. Every socket is closed with a RST,
so no TIME_WAIT piles up. A taken set claims one port of the SNAT range per connect()
for its remapped flow, and the reply entry of each superseded flow stays (the collector
keeps it as established): hence shorter taken sets (--taken-connects) and kbp_ct emptied
before each (forget_flows), so every set starts from the same empty range.

Per size, sets run in rounds of rotating order, the client on one CPU and the one server
process (bench/connect.py's serve, every server pod's listeners) on the other, swapped
every round. The hook's ns per run is reported per size with its range over rounds, and
for `sock` its slope over the sizes. The statistics cost the kernel two clock reads per
program run (they are in run_time_ns too), so compare figures of this tool with each
other, not with connect.py's.

    .venv/bin/python -m bench.sock_hooks [--services 1,10000,30000] [--connects N]
                                         [--taken-connects N] [--rounds R]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if not __package__:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from tests.lab.nodelab import Pod

THIS_FILE = Path(__file__).resolve()
PORT = 8080
SECOND_IP = "10.96.255.252"  # a second Service with the same backend (the taken set)
AFFINITY_IP = "10.96.255.253"
TARGET_IP = "10.96.255.254"
FRONTEND_PORT = 80
KINDS = ("floor", "floor2", "sock", "affinity", "udp", "pod_ip", "pod_ip80", "floor_bound",
         "bound", "taken")  # fmt: skip
BOUND_KINDS = ("bound", "taken")  # measured against floor_bound too
# Source ports bound on purpose, from the lab's reserved range (agent/lab/toolkit.py).
BOUND_FIRST, BOUND_SPAN = 40000, 1000
TAKEN_PORT = 41999
# The hook timed, the one at close(), and the tc programs on the pods' veths.
PROGRAMS = ("kbp_connect4", "kbp_release", "kbp_from_pod", "kbp_to_pod")
# Targets (bench/README.md, PB-2 re-based for issue 31): the connect hook's own cost.
TARGET_HOOK_NS = 300  # kbp_connect4 ns per TCP connect() to a ClusterIP at 10k Services
TARGET_HOOK_AT = 10_000
TARGET_FLAT = 1.2  # flat from 1 to 30k: the largest size's figure ≤ 1.2x the smallest's


def pod_udp_connect(ip: str, port: int, count: int, cpu: int | None) -> dict[str, Any]:
    """`count` UDP sockets connect()ed to ip:port (no datagram), each timed."""
    from bench.common.connects import pin

    pin(0, cpu)
    samples: list[int] = []
    clock = time.perf_counter_ns
    for _ in range(count):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            start = clock()
            sock.connect((ip, port))
            samples.append(clock() - start)
    return {"ns": samples, "errors": 0, "first_error": ""}


def pod_bound_connect(
    ip: str, port: int, count: int, cpu: int | None, hold: str | None, warmup: int
) -> dict[str, Any]:
    """Time `count` TCP connect() calls (after `warmup` untimed ones), each from a source
    port bound first (SO_REUSEADDR), closed with a RST. Without `hold` the ports cycle
    through BOUND_FIRST.. (a tuple no socket holds); with it every socket binds TAKEN_PORT,
    of which a first socket, connected to `hold`:port and held open, takes the tuple."""
    from bench.common.connects import pin, pod_connect

    pin(0, cpu)
    held = None
    if hold:
        held = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("0.0.0.0", TAKEN_PORT))
        held.connect((hold, port))

    def source_port(k: int) -> int:
        return TAKEN_PORT if held else BOUND_FIRST + k % BOUND_SPAN

    try:
        return pod_connect(ip, port, count, warmup, cpu, source_port)
    finally:
        if held is not None:
            held.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            held.close()


def run_in_pod(
    pod: Pod, mode: str, ip: str, port: int, count: int, cpu: int | None,
    cgroup: Path | None, hold: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The pod side of this file in `pod` (and in `cgroup`, where the hooks are)."""
    from agent.lab.toolkit import in_netns
    from tests.lab.kit import in_cgroup

    argv = [sys.executable, str(THIS_FILE), mode, ip, str(port), str(count),
            "-" if cpu is None else str(cpu), hold or "-"]  # fmt: skip
    proc = subprocess.run(in_cgroup(cgroup, in_netns(pod.ns, argv)), capture_output=True,
                          text=True, timeout=600, check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} in {pod.name} exited {proc.returncode}: {proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measured_entries(server_ip: str) -> list[Any]:
    """The Services the sets connect to (named to sort after the synthetic svc-NNNNNN):
    TCP and UDP ports of one Service, one with ClientIP affinity, and a second Service on
    the same backend (the taken set's)."""
    from bench.common.nodestates import service_entry

    backend = [(server_ip, PORT)]
    plain = service_entry("zz-target", TARGET_IP, backend, local=True)
    udp = dataclasses.replace(plain, protocol="UDP").sealed()
    sticky = service_entry("zy-sticky", AFFINITY_IP, backend, local=True)
    sticky = dataclasses.replace(sticky, affinity_timeout=10800).sealed()
    second = service_entry("zx-second", SECOND_IP, backend, local=True)
    return [plain, udp, sticky, second]


def forget_flows(dp: Any) -> int:
    """Empty kbp_ct and kbp_ct_remap (only the taken sets' remapped flows are there: the
    hooks' flows write none). Each connect() of a taken set leaves its remapped flow's
    reply entry behind once the next one, on the same tuple, rewrites the forward entry;
    the collector keeps such a reply entry as an established flow, so the claimed SNAT
    ports would add up from set to set (see bench/notes/connect.md, issue 31) and the sets would
    measure the fill of the range instead of the path. Returns the entries removed."""
    removed = 0
    for name in ("kbp_ct", "kbp_ct_remap"):
        table = dp.programs.map(name)
        keys = table.keys()
        if keys:
            table.delete_keys(keys)
        removed += len(keys)
    return removed


@dataclasses.dataclass
class SizeSets:
    """What the sets of one size measured: per kind and round, the connect() samples and,
    per program, (run_time_ns, run_cnt) of the set; failures per kind."""

    applied: dict[str, float]
    samples: dict[str, list[list[int]]]
    hook: dict[str, dict[str, list[tuple[int, int]]]]
    errors: dict[str, int]

    @classmethod
    def empty(cls, applied: dict[str, float]) -> SizeSets:
        hook: dict[str, dict[str, list[tuple[int, int]]]] = {
            k: {p: [] for p in PROGRAMS} for k in KINDS
        }
        return cls(applied, {k: [] for k in KINDS}, hook, dict.fromkeys(KINDS, 0))


def ns_per_run(pairs: list[tuple[int, int]]) -> float | None:
    ns, cnt = sum(x for x, _ in pairs), sum(c for _, c in pairs)
    return ns / cnt if cnt else None


def report_size(
    n: int, sets: SizeSets, kinds: tuple[str, ...], notes: dict[str, str]
) -> dict[str, Any]:
    """Print one size's table (connect() p50 against the floor, per round too; each
    program's ns per run, over all rounds and the range of the rounds); its JSON."""
    import statistics

    from bench.common.report import Summary

    def median_of(rounds: list[list[int]]) -> float:
        return Summary([ns for one in rounds for ns in one]).median

    floor = median_of(sets.samples["floor"])
    floor_bound = median_of(sets.samples["floor_bound"])
    print(f"\n## {n} Services ({sets.applied['entries']} entries); connect() p50 net of the "
          f"floor {floor / 1000:.2f} µs, per round: median (range); hook ns per run over all "
          f"rounds (range of the rounds)")  # fmt: skip
    head = (f"{'kind':<12} {'p50 µs':>7} {'- floor':>8} {'per round':>22}"
            + "".join(f" {p + ' ns/run':>28} {'runs':>6}" for p in PROGRAMS))  # fmt: skip
    print(head)
    print("-" * len(head))
    out: dict[str, Any] = {}
    for kind in kinds:
        errors = sets.errors[kind]
        rounds = [one for one in sets.samples[kind] if one]
        if not rounds:
            print(f"{kind:<12} no samples ({errors} failed: {notes.get(kind, '')})")
            continue
        s = Summary([ns for one in rounds for ns in one])
        ref = sets.samples["floor_bound" if kind in BOUND_KINDS else "floor"]
        nets = [statistics.median(ours) - statistics.median(base)
                for ours, base in zip(sets.samples[kind], ref, strict=True)
                if ours and base]  # fmt: skip
        rounds_text = (f"{statistics.median(nets) / 1000:+.2f} ({min(nets) / 1000:+.2f}.."
                       f"{max(nets) / 1000:+.2f})")  # fmt: skip
        line = (f"{kind:<12} {s.median / 1000:7.2f} {(s.median - floor) / 1000:+8.2f} "
                f"{rounds_text:>22}")  # fmt: skip
        entry: dict[str, Any] = {**s.to_json(), "net_of_floor_ns": s.median - floor,
                                 "round_nets_ns": nets, "errors": errors,
                                 "programs": {}}  # fmt: skip
        for p in PROGRAMS:
            pairs = sets.hook[kind][p]
            total = ns_per_run(pairs)
            per_round = [ns / cnt for ns, cnt in pairs if cnt]
            cnt = sum(c for _, c in pairs)
            text = (f"{total:.0f} ({min(per_round):.0f}-{max(per_round):.0f})"
                    if total is not None else "-")  # fmt: skip
            line += f" {text:>28} {cnt:>6}"
            entry["programs"][p] = {"ns_per_run": total, "rounds": per_round, "runs": cnt}
        if kind in BOUND_KINDS:
            entry["net_of_floor_bound_ns"] = s.median - floor_bound
            line += f"  (- floor_bound {(s.median - floor_bound) / 1000:+.2f})"
        if errors:
            line += f"  ({errors} failed: {notes.get(kind, '')})"
        print(line)
        out[kind] = entry
    return {"applied": sets.applied, "kinds": out}


def report_rebased(report: dict[str, Any], sizes_n: list[int]) -> dict[str, Any]:
    """PB-2 as re-based in issue 31: (a) the hook's ns per connect() by size, its slope and
    targets; (c) connect() p50 net of the floor beside the floor's A/A spread."""
    from bench.common.connects import slope_ns_per_service
    from bench.common.report import mark

    print("\n## PB-2 re-based (bench/README.md): (a) the connect hook's ns per connect(), "
          "(c) connect() p50 net of the floor with the floor's A/A spread")  # fmt: skip
    summary: dict[str, Any] = {}
    for kind in ("sock", "affinity", "udp", "bound", "taken", "pod_ip"):
        points = [(n, report[str(n)]["kinds"][kind]["programs"][PROGRAMS[0]]["ns_per_run"])
                  for n in sizes_n if kind in report[str(n)]["kinds"]]  # fmt: skip
        points = [(n, v) for n, v in points if v is not None]
        if not points:
            continue
        text = ", ".join(f"{n}: {v:.0f}" for n, v in points)
        entry: dict[str, Any] = {"points": points}
        if len(points) >= 2:
            slope = slope_ns_per_service(points)
            flat = points[-1][1] / points[0][1]
            entry.update(slope_ns_per_1k=slope * 1000, last_over_first=flat)
            text += (f"; slope {slope * 1000:+.2f} ns per 1k Services, {points[-1][0]} / "
                     f"{points[0][0]}: x{flat:.2f}")  # fmt: skip
            if kind == "sock":
                entry["flat_mark"] = mark(flat <= TARGET_FLAT)
                text += f" {entry['flat_mark']} (flat: ≤ x{TARGET_FLAT})"
        at = dict(points).get(TARGET_HOOK_AT)
        if kind == "sock" and at is not None:
            entry["at_10k_mark"] = mark(at <= TARGET_HOOK_NS)
            text += (f"; at {TARGET_HOOK_AT}: {at:.0f} ns {entry['at_10k_mark']} "
                     f"(≤ {TARGET_HOOK_NS})")  # fmt: skip
        print(f"(a) {PROGRAMS[0]} ns/run, {kind}: {text}")
        summary[kind] = entry
    for n in sizes_n:
        kinds = report[str(n)]["kinds"]
        parts = [f"{k} {kinds[k]['net_of_floor_ns'] / 1000:+.2f}" for k in
                 ("sock", "affinity", "pod_ip") if k in kinds]  # fmt: skip
        parts += [f"{k} {kinds[k]['net_of_floor_bound_ns'] / 1000:+.2f} (vs floor_bound)"
                  for k in BOUND_KINDS if k in kinds]  # fmt: skip
        aa = ""
        if "floor2" in kinds:
            nets = kinds["floor2"]["round_nets_ns"]
            aa = (f"; A/A floor2 - floor {kinds['floor2']['net_of_floor_ns'] / 1000:+.2f} µs "
                  f"(per round {min(nets) / 1000:+.2f}..{max(nets) / 1000:+.2f})")  # fmt: skip
        print(f"(c) {n} Services: connect() p50 - floor ({kinds['floor']['median'] / 1000:.2f} "
              f"µs): {', '.join(parts)}{aa}")  # fmt: skip
    return summary


def run(args: argparse.Namespace) -> int:
    from agent.dataplane.ebpf.cgroup import netns_cookie
    from bench.common.connects import pin, placements, set_socket_lb, start_server
    from bench.common.kernel import bench_dataplane, leftovers, map_sizes_for
    from bench.common.nodestates import nodestate_of, synthetic_entries
    from bench.common.progstats import ProgramStats, enable_stats
    from bench.common.report import (
        header,
        machine,
        results_path,
        terminate_as_interrupt,
        write_results,
    )
    from tests.lab.kit import stop_process
    from tests.lab.nodelab import Lab

    sizes_n = sorted({int(x) for x in args.services.split(",") if x.strip()})
    wanted = set(args.kinds.split(",")) if args.kinds else set(KINDS)
    if wanted - set(KINDS):
        print(f"--kinds: no kind {', '.join(sorted(wanted - set(KINDS)))}; the kinds are "
              f"{', '.join(KINDS)}", file=sys.stderr)  # fmt: skip
        return 2
    measuring = tuple(k for k in KINDS if k in wanted | {"floor", "floor_bound"})
    terminate_as_interrupt()
    info = machine()
    header("bench/sock_hooks.py (PB-2, the connect hook)", info, "")
    print(f"Services {sizes_n} (the 4 measured entries among them; 1: those alone), "
          f"{args.endpoints} endpoints per synthetic one; {args.connects} connects per set "
          f"({args.taken_connects} for taken), {args.rounds} rounds per size; bpf sources "
          f"{os.environ.get('KBP_BPF_SOURCE_DIR') or 'of this checkout'}", flush=True)  # fmt: skip
    began = time.perf_counter()
    loads = [os.getloadavg()[0]]
    by_size: dict[int, SizeSets] = {}
    notes: dict[str, str] = {}
    sizes: dict[str, int] = {}
    try:
        with Lab(cgroup=True) as lab:
            client0, server0 = lab.add_pod("client0"), lab.add_pod("server0")
            client, server = lab.add_pod("client"), lab.add_pod("server")
            measured = measured_entries(server.ipv4)
            others = synthetic_entries(max(0, max(sizes_n) - len(measured) + 1), args.endpoints)
            map_sizes = map_sizes_for(max(sizes_n), args.endpoints)
            # kind: (pod, address, port, pod-side mode, the held socket's address)
            targets: dict[str, tuple[Pod, str, int, str, str | None]] = {
                "floor": (client0, server0.ipv4, PORT, "--pod-connect", None),
                "floor2": (client0, server0.ipv4, PORT, "--pod-connect", None),
                "sock": (client, TARGET_IP, FRONTEND_PORT, "--pod-connect", None),
                "affinity": (client, AFFINITY_IP, FRONTEND_PORT, "--pod-connect", None),
                "udp": (client, TARGET_IP, FRONTEND_PORT, "--pod-udp", None),
                "pod_ip": (client, server.ipv4, PORT, "--pod-connect", None),
                "pod_ip80": (client, server.ipv4, FRONTEND_PORT, "--pod-connect", None),
                "floor_bound": (client0, server0.ipv4, PORT, "--pod-bound", None),
                "bound": (client, TARGET_IP, FRONTEND_PORT, "--pod-bound", None),
                "taken": (client, SECOND_IP, FRONTEND_PORT, "--pod-bound", TARGET_IP),
            }
            with contextlib.ExitStack() as stack:
                dp = stack.enter_context(bench_dataplane(
                    map_sizes, lab.node_ns, [client.host_ifname, server.host_ifname],
                    lab.cgroup))  # fmt: skip
                server_proc = start_server([(server0, [PORT]), (server, [PORT, FRONTEND_PORT])],
                                           lab.cgroup)  # fmt: skip
                stack.callback(stop_process, server_proc)
                print(f"client netns cookie {netns_cookie(client.ns)}; maps {map_sizes}",
                      flush=True)  # fmt: skip
                stats = {p: ProgramStats(dp.programs.fd(p)) for p in PROGRAMS}
                stack.callback(os.close, enable_stats())
                for n in sizes_n:
                    # N Services in all, the measured ones among them (the UDP port is the
                    # TCP Service's second entry).
                    state = nodestate_of([*others[: max(0, n - len(measured) + 1)], *measured])
                    started = time.perf_counter()
                    writes = dp.apply(state)
                    sets = by_size[n] = SizeSets.empty({
                        "seconds": time.perf_counter() - started, "writes": writes,
                        "entries": len(state.services)})  # fmt: skip
                    set_socket_lb(dp, "all")
                    dp.conntrack.run_once()  # builds kbp_ct_gate, as an agent's
                    print(f"# {n} Services: {len(state.services)} entries, applied {writes} "
                          f"writes in {sets.applied['seconds']:.2f} s", flush=True)  # fmt: skip
                    for r, (client_cpu, server_cpu) in enumerate(placements(args.rounds)):
                        pin(server_proc.pid, server_cpu)
                        at = r % len(measuring)
                        for kind in measuring[at:] + measuring[:at]:
                            pod, ip, port, mode, hold = targets[kind]
                            count = args.connects
                            if kind == "taken":
                                count = args.taken_connects
                                forget_flows(dp)
                            before = {p: st.sample() for p, st in stats.items()}
                            cgroup = None if pod is client0 else lab.cgroup
                            out = run_in_pod(pod, mode, ip, port, count, client_cpu, cgroup,
                                             hold)  # fmt: skip
                            after = {p: st.sample() for p, st in stats.items()}
                            sets.samples[kind].append(out["ns"])
                            sets.errors[kind] += out["errors"]
                            if out["first_error"]:
                                notes.setdefault(kind, out["first_error"])
                            for p in PROGRAMS:
                                sets.hook[kind][p].append(
                                    (after[p][0] - before[p][0], after[p][1] - before[p][1])
                                )
                        loads.append(os.getloadavg()[0])
                sizes = stats[PROGRAMS[0]].sizes()
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers() or 'nothing'})")
        return 130

    print(f"\n{PROGRAMS[0]}: {sizes}")
    report = {str(n): report_size(n, by_size[n], measuring, notes) for n in sizes_n}
    summary = report_rebased(report, sizes_n)
    seconds = time.perf_counter() - began
    loads.append(os.getloadavg()[0])
    print(f"load average (1 min) during the run: {loads[0]:.2f} at the start, "
          f"{min(loads):.2f}-{max(loads):.2f}, {loads[-1]:.2f} at the end")  # fmt: skip
    out = results_path(args, "sock_hooks")
    write_results(out, {
        "benchmark": "bench/sock_hooks.py",
        "id": "PB-2",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": info,
        "load_average": loads,
        "connects_per_set": args.connects,
        "taken_connects_per_set": args.taken_connects,
        "rounds": args.rounds,
        "endpoints_per_service": args.endpoints,
        "program_sizes": sizes,
        "unit": "ns",
        "sizes": report,
        "hook": summary,
        "duration_s": seconds,
    })  # fmt: skip
    print(f"ran in {seconds:.0f} s; results in {out}; left over: {leftovers() or 'nothing'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("--pod-connect", "--pod-udp", "--pod-bound"):
        from bench.common.connects import WARMUP, pod_connect

        ip, port, count = argv[1], int(argv[2]), int(argv[3])
        cpu = None if argv[4] == "-" else int(argv[4])
        hold = None if argv[5] == "-" else argv[5]
        if argv[0] == "--pod-udp":
            out = pod_udp_connect(ip, port, count, cpu)
        elif argv[0] == "--pod-bound":
            out = pod_bound_connect(ip, port, count, cpu, hold, WARMUP)
        else:
            out = pod_connect(ip, port, count, WARMUP, cpu)
        print(json.dumps(out), flush=True)
        return 0
    parser = argparse.ArgumentParser(
        description="The connect hook's own cost per run (kernel program statistics) and "
        "connect() p50 against the floor (not a test; always exits 0)."
    )
    parser.add_argument("--services", default="1",
                        help="comma-separated sizes, Services programmed in all (the measured "
                        "ones among them), e.g. 1,10000,30000; default 1")  # fmt: skip
    parser.add_argument("--endpoints", type=int, default=10, metavar="E",
                        help="endpoints per synthetic Service")  # fmt: skip
    parser.add_argument("--connects", type=int, default=2000, help="connect() calls per set")
    parser.add_argument("--taken-connects", type=int, default=500,
                        help="connect() calls per taken set (each claims a SNAT port)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=4, help="sets per kind and size")
    parser.add_argument("--kinds", help="comma-separated kinds to measure (default all; floor "
                        f"and floor_bound always): {', '.join(KINDS)}")  # fmt: skip
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
