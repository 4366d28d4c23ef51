"""PB-2's request/response, taken apart: what the tc programs cost per packet on an
established TCP connection they do not translate, in real traffic (the kernel's own
program statistics: run_time_ns / run_cnt of this run's programs only), beside an empty
tc program and no program at all.

BPF_PROG_TEST_RUN (datapath.py) times a program on a linear, unshared skb with warm
caches; real packets differ in what made kbp_from_pod cost 128-160 ns a run here against
37 for an empty program (see bench/notes/connect.md, "tc on packets it leaves alone"): a data
segment a TCP socket sends is a cloned skb with its payload in pages, and the caches are
cold after the stack and the application ran. This measures that case.

One namespace lab (tests/lab/nodelab.py) with its cgroup and one server process for all
pods (connect.py's serve), client and server on CPU 0. Paths, each a set of 1-byte
exchanges on one connection, in rotating order for `--rounds` rounds:

    floor         client0 → server0 pod IP:8080, no programs on the path
    noop          client2 → server2 pod IP:8080, an empty tc program on both hooks of
                  both veths
    pod_ip        client → server pod IP:8081: no backend uses that port, so the
                  programs' reply checks stop at kbp_ports
    backend_port  client → server pod IP:8080, a backend's port: every reply is checked
                  against kbp_ct_gate (what a socket-translated flow's packets look like)
    sock          client → 10.96.255.254:80 with --socket-lb all: the connect hook points
                  the socket at the backend; tc sees backend_port's packets

Per path: the exchange p50 (µs) and its ratio to the floor's (as connect.py's
request/response, but set after set, not interleaved), then ns per run of each tc program
on the path and their sum per exchange net of the empty program's (each exchange is two
packets, each crossing kbp_from_pod and kbp_to_pod). The statistics add two clock reads to
every run, the empty program's figure included.

    .venv/bin/python -m bench.tc_cost [--exchanges N] [--rounds R] [--services N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

THIS_FILE = Path(__file__).resolve()
CPU = 0
KINDS = ("floor", "noop", "pod_ip", "backend_port", "sock")
PROGRAMS = ("kbp_from_pod", "kbp_to_pod", "kbp_bench_empty")


def pod_echo(ip: str, port: int, count: int) -> None:
    """The pod side: connect, say `ready`, wait for a line on stdin, then `count` timed
    1-byte exchanges on CPU; prints the p50 in ns."""
    from bench.common.connects import echo_connection

    os.sched_setaffinity(0, {CPU})
    sock = echo_connection(ip, port, f"{ip}:{port}")
    print("ready", flush=True)
    sys.stdin.readline()
    clock, samples = time.perf_counter_ns, []
    for _ in range(count):
        start = clock()
        sock.sendall(b"x")
        if not sock.recv(16):
            raise EOFError("the server closed the connection")
        samples.append(clock() - start)
    samples.sort()
    print(samples[len(samples) // 2], flush=True)


def run(args: argparse.Namespace) -> int:
    from agent.dataplane.ebpf.netlink import TcAttacher
    from agent.lab.toolkit import in_netns
    from bench.common.connects import (
        DIRECT_PORT,
        PORT,
        SERVER_PORTS,
        TARGET_IP,
        TARGET_PORT,
        pin,
        set_socket_lb,
        start_server,
        state_with_targets,
        target_entries,
    )
    from bench.common.kernel import bench_dataplane, calibration_programs, map_sizes_for
    from bench.common.nodestates import synthetic_entries
    from bench.common.progstats import ProgramStats, enable_stats
    from bench.common.report import Summary, header, machine, terminate_as_interrupt
    from tests.lab.kit import in_cgroup, stop_process
    from tests.lab.nodelab import Lab

    terminate_as_interrupt()
    header("bench/tc_cost.py (PB-2, tc on packets it leaves alone)", machine(), "")
    print(f"{args.exchanges} exchanges per set, {args.rounds} rounds, client and server on "
          f"CPU {CPU}; {args.services} Services", flush=True)  # fmt: skip
    samples: dict[str, list[int]] = {k: [] for k in KINDS}
    runs = {(k, p): [0, 0] for k in KINDS for p in PROGRAMS}
    with Lab(cgroup=True) as lab, contextlib.ExitStack() as stack:
        client0, server0 = lab.add_pod("client0"), lab.add_pod("server0")
        client2, server2 = lab.add_pod("client2"), lab.add_pod("server2")
        client, server = lab.add_pod("client"), lab.add_pod("server")
        dp = stack.enter_context(bench_dataplane(
            map_sizes_for(args.services, 10), lab.node_ns,
            [client.host_ifname, server.host_ifname], lab.cgroup))  # fmt: skip
        empty = stack.enter_context(calibration_programs(1024))["kbp_bench_empty"]
        attacher = stack.enter_context(TcAttacher(lab.node_ns, dp.pin_dir, dp.links.tc.mode))
        for pod in (client2, server2):
            for direction in ("ingress", "egress"):
                attacher.attach(pod.host_ifindex, direction, empty, "kbp_bench_empty")
        others = synthetic_entries(args.services - 1, 10)
        state, _ = state_with_targets(others, target_entries(args.services, server.ipv4),
                                      args.services)  # fmt: skip
        dp.apply(state)
        set_socket_lb(dp, "all")
        dp.conntrack.run_once()  # the collector's pass builds kbp_ct_gate, as an agent's
        listen = [(server0, [PORT]), (server2, [PORT]), (server, SERVER_PORTS)]
        server_proc = start_server(listen, lab.cgroup)
        stack.callback(stop_process, server_proc)
        pin(server_proc.pid, CPU)
        targets = {
            "floor": (client0, server0.ipv4, PORT),
            "noop": (client2, server2.ipv4, PORT),
            "pod_ip": (client, server.ipv4, DIRECT_PORT),
            "backend_port": (client, server.ipv4, PORT),
            "sock": (client, TARGET_IP, TARGET_PORT),
        }
        stats = {p: ProgramStats(dp.programs.fd(p) if p != "kbp_bench_empty" else empty)
                 for p in PROGRAMS}  # fmt: skip
        stats_fd = enable_stats()
        try:
            for r in range(args.rounds):
                for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
                    pod, ip, port = targets[kind]
                    argv = [sys.executable, str(THIS_FILE), "--pod-echo", ip, str(port),
                            str(args.exchanges)]  # fmt: skip
                    proc = subprocess.Popen(in_cgroup(lab.cgroup, in_netns(pod.ns, argv)),
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            text=True)  # fmt: skip
                    assert proc.stdin is not None and proc.stdout is not None
                    if proc.stdout.readline().strip() != "ready":
                        proc.kill()
                        raise RuntimeError(f"{kind}: the client did not connect")
                    before = {p: s.sample() for p, s in stats.items()}
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                    p50 = int(proc.stdout.readline())
                    after = {p: s.sample() for p, s in stats.items()}
                    proc.wait(timeout=60)
                    samples[kind].append(p50)
                    for p in PROGRAMS:
                        runs[kind, p][0] += after[p][0] - before[p][0]
                        runs[kind, p][1] += after[p][1] - before[p][1]
        finally:
            os.close(stats_fd)
    floor = Summary(samples["floor"]).median
    ns_empty = runs["noop", "kbp_bench_empty"][0] / max(runs["noop", "kbp_bench_empty"][1], 1)
    print(f"\n{'path':<13} {'p50 µs':>7} {'x floor':>8}" + "".join(
        f" {p + ' ns/run':>24}" for p in PROGRAMS) + f" {'net ns/exchange':>16}")  # fmt: skip
    for kind in KINDS:
        p50 = Summary(samples[kind]).median
        line = f"{kind:<13} {p50 / 1000:7.2f} {floor / p50:8.3f}"
        total = count = 0
        exchanges = args.exchanges * args.rounds
        for p in PROGRAMS:
            ns, cnt = runs[kind, p]
            on_path = cnt >= exchanges  # not the few runs of another set's closing packets
            line += f" {f'{ns / cnt:.1f} ({cnt // args.rounds} runs)' if on_path else '-':>24}"
            if on_path:
                total, count = total + ns, count + cnt
        net = (total - count * ns_empty) / exchanges
        print(line + f" {net:+16.1f}")
    print(
        f"\nrate as connect.py reports it: floor p50 / path p50; net ns per exchange: the "
        f"path's program time minus {ns_empty:.1f} ns (the empty program's) per run"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--pod-echo":
        pod_echo(argv[1], int(argv[2]), int(argv[3]))
        return 0
    parser = argparse.ArgumentParser(
        description="What the tc programs cost per packet on an established connection, "
        "from the kernel's program statistics (not a test; always exits 0)."
    )
    parser.add_argument("--exchanges", type=int, default=20_000, help="exchanges per set")
    parser.add_argument("--rounds", type=int, default=5, help="sets per path")
    parser.add_argument("--services", type=int, default=1000,
                        help="Services in the maps (synthetic, 10 endpoints each)")  # fmt: skip
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
