"""PB-2: TCP connect() latency from a pod to a ClusterIP through the eBPF dataplane and
through the iptables fallback, with 1 to 30k Services loaded, beside a direct connection
between two pods without programs or rules (the floor), all measured in turn in one run.

Two namespace labs (tests/lab/nodelab.py), so the iptables rules never sit on the eBPF or
floor paths (netfilter hooks are per namespace). The eBPF lab has one node namespace and
seven pods on veth pairs: `client`, `client3` and `server` have the tc programs on their
host veths; `client0` and `server0` have none (the floor); `client2` and `server2` have an
empty tc program. The iptables lab (node 2) has `client` and `server` and the
IptablesDataplane in its node namespace (`--pod-interfaces vethkbp*`). One server process
(serve) listens in every server pod on ports 8080-8083, so every path ends in the same
code. Three target Services (ClusterIPs 10.96.255.252-254:80 → the lab's server, each on
its own port) are named to sort first, in the middle and last among N - 3 synthetic
Services x 10 endpoints (bench/common/nodestates.py's address plan; their backends do not
exist):
NodeState order is KBP-SERVICES order, whose rules iptables evaluates one by one, so the
position matters there and should not for eBPF. For each N, rounds of measurement sets
run in rotating order, each one process in a client pod that times many sequential
connect() calls (and closes each with a RST, so no TIME_WAIT piles up):

    floor            client0 → server0 pod IP, no programs on the path
    floor2           the same again, as another kind: how far two identical paths read apart
    noop             client2 → server2 pod IP, an empty tc program on both hooks of both
                     veths (what the tc hook itself costs)
    ebpf:POSITION    client → the target ClusterIP:80 with --socket-lb off: DNAT at the
                     client's veth, reverse NAT at the server's
    sock:POSITION    client3 → the target ClusterIP:80 with --socket-lb all: the cgroup
                     connect hook points the socket at the backend; tc sees only packets to
                     and from the pod IP (its miss path, kbp_ct_gate clear for the pair)
    pod_ip           client → server pod IP:8081 with the programs attached (their miss path)
    iptables:POSITION  iptables lab: client → the target ClusterIP:80 (nat KBP-SERVICES)
    iptables:pod_ip  iptables lab: client → server pod IP:8081 (every KBP-SERVICES rule
                     checked, none matches)

The socket hooks are attached to a cgroup the lab made, which only the `client` and
`client3` pods' measuring processes join (the floor's and the noop's clients stay outside
it, so no hook runs for them); before each set the bench writes --socket-lb into
kbp_config (off for ebpf:* and pod_ip, all for sock:*), as an agent restarted with that
flag would, and makes a conntrack collector pass, as the agent does every few seconds
(it rebuilds kbp_ct_gate). The floor is the strictest one: no program at all on its
path, where on a node running the dataplane every pod's veth has them.

Where processes run decides these figures more than any program does: on this 2-CPU VM a
1-byte exchange takes about 8 µs when client and server share a CPU and about 55 µs when
they sit on two (each wake-up of the other CPU goes through the hypervisor), and left to
itself the scheduler picks one or the other per set, the same kind differently from set to
set. So the bench places them: in each round of connect() sets the client runs on one CPU
and the server on the other (swapped every round, the same for every kind).

Request/response: per round, one process in the root namespace opens one connection on each
of floor, floor2, noop, pod_ip, ebpf:last, sock:last and iptables:last (from the kind's pod
and cgroup, --socket-lb set before each), then alternates 1-byte exchanges among them, in a
new random order each round, each timed until its echo is back: drift and scheduling fall
on all of them alike, within microseconds. Twice per round: client and server on one CPU
("same") and on two ("split"). The rate is 1 / p50; the ratio the floor's p50 over the
kind's, over the run and per round (the range shows how steady it is). Targets for the
socket hooks: ≥ 0.97 on one CPU, ≥ 0.99 on two (issue 31).

Per kind: p50 and p99 over all sets, the p50 as a multiple of the floor's, and the paired
figure per round (the kind's p50 minus the floor's in the same round: median and range).

    .venv/bin/python -m bench.connect [--quick] [--services N ...] [--dataplanes ebpf,iptables]
                                      [--socket-lb all,off]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common.connects import (
    DIRECT_PORT,
    PORT,
    POSITIONS,
    SERVER_PORTS,
    TARGET_IPS,
    TARGET_PORT,
    WARMUP,
    echo_connection,
    enter,
    pin,
    placements,
    pod_connect,
    set_socket_lb,
    slope_ns_per_service,
    start_server,
    state_with_targets,
    target_entries,
)

if TYPE_CHECKING:
    from bench.common.report import Summary
    from tests.lab.nodelab import Pod

# The pod side (modes --pod-connect / --pod-rr) runs in a fresh interpreter in the client
# pod: keep module-level imports to the standard library so it starts quickly.

THIS_FILE = Path(__file__).resolve()
# The pod the sock:* sets connect from. tc's flows of the ebpf:* sets (from `client`, to
# the same backends) keep their conntrack entries for the time-wait after each set, and
# kbp_ct_gate lets tc skip its lookups only for (backend, client) pairs no such entry
# names: with --socket-lb all a pod's flows are the hooks', so its own pod measures that.
SOCK_CLIENT = "client3"
DATAPLANES = ("ebpf", "iptables")
IPTABLES_POD_INTERFACES = ("vethkbp*",)  # the lab's host veths (tests/lab/nodelab.py)
# The iptables dataplane's tools may run this long here: iptables-nft 1.8.9 needs more
# than the module's COMMAND_TIMEOUT (300 s) to restore 10k Services x 10 endpoints.
IPTABLES_TIMEOUT = 3600.0

# Targets and anchors (bench/README.md, PB-2).
TARGET_NET_P50_US = 2.0  # eBPF p50 ≤ floor + 2 µs
TARGET_SOCK_NET_P50_US = 0.5  # socket LB (issue 16): p50 ≤ floor + 0.5 µs
TARGET_SOCK_RR = 0.97  # socket LB: request/response rate ≥ 0.97 of the floor's, one CPU
TARGET_SOCK_RR_SPLIT = 0.99  # and ≥ 0.99 with client and server on two CPUs (issue 31)
# Request/response: the paths measured side by side in one process, and where the client and
# the servers run: one CPU for all ("same") or the servers on another ("split").
RR_KINDS = ("floor", "floor2", "noop", "pod_ip", "ebpf:last", "sock:last", "iptables:last")
RR_LAYOUTS = ("same", "split")
SOCKET_LB_MODES = ("all", "off")  # --socket-lb values measured: all = sock:*, off = ebpf:*
TARGET_SLOPE_NS = 1.0  # flat in N: < 1 ns per Service
TARGET_VS_IPTABLES = 10.0  # eBPF ≥ 10x better than the iptables fallback at 10k
REF_PB2 = (
    "kube-proxy iptables first-packet p50 49 / 61 / 274 µs at 5k / 10k / 30k Services; "
    "nftables ≈14 µs flat (KEP-3866); here iptables-nft at 10k, target last: p50 142-181 µs"
)


# --- pod side ------------------------------------------------------------------------------


def pod_request_response(cpu: int | None, count: int, warmup: int) -> dict[str, Any]:
    """Request/response over every path at once, from one process. The node side sends one
    JSON line per path ({kind, netns, cgroup, ip, port}): the connection is opened from that
    pod (and cgroup) and answered with `ok`, so the node can set --socket-lb between them;
    then `run`. Then, on `cpu`, `count` rounds (after `warmup`) of one 1-byte exchange on each
    connection in turn, in a new random order every round, each timed until its echo is back:
    whatever the machine does (others' work, where the scheduler puts whom) falls on every
    path alike, within microseconds."""
    conns: dict[str, socket.socket] = {}
    for line in sys.stdin:
        order = json.loads(line)
        if order.get("op") == "run":
            break
        enter(order["netns"], order.get("cgroup"))
        conns[order["kind"]] = echo_connection(order["ip"], order["port"], order["kind"])
        print("ok", flush=True)
    pin(0, cpu)
    import random

    order = list(conns)
    samples: dict[str, list[int]] = {kind: [] for kind in order}
    clock = time.perf_counter_ns
    shuffle = random.Random(16).shuffle
    for k in range(warmup + count):
        # A new order each round: in a fixed cycle each path would always follow the same
        # one (the floor's second connection right after the floor read 1.5% faster).
        shuffle(order)
        for kind in order:
            sock = conns[kind]
            start = clock()
            sock.sendall(b"x")
            if not sock.recv(16):
                raise EOFError(f"{kind}: the server closed the connection")
            elapsed = clock() - start
            if k >= warmup:
                samples[kind].append(elapsed)
    for sock in conns.values():
        sock.close()
    return {"ns": samples}


# --- node side -----------------------------------------------------------------------------


def run_in_pod(
    pod: Pod, ip: str, port: int, count: int, cpu: int | None, cgroup: Path | None = None
) -> dict[str, Any]:
    """connect() timed in `pod` on `cpu` (and in `cgroup`, where the socket hooks are, if
    given)."""
    from agent.lab.toolkit import in_netns
    from tests.lab.kit import in_cgroup

    argv = [sys.executable, str(THIS_FILE), "--pod-connect", ip, str(port), str(count),
            "-" if cpu is None else str(cpu)]  # fmt: skip
    argv = in_cgroup(cgroup, in_netns(pod.ns, argv))
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"connect() in {pod.name} exited {proc.returncode}: {proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclass
class Target:
    """One measured path: the client pod, the address it connects to, the cgroup its
    sockets are made in (where the socket hooks are; None: outside it) and the --socket-lb
    mode written before its connect()."""

    pod: Pod
    ip: str
    port: int
    cgroup: Path | None = None
    socket_lb: str | None = None


def request_response_round(
    paths: dict[str, Target],
    count: int,
    cpu: int | None,
    prepare: Callable[[Target], None],
) -> dict[str, list[int]]:
    """One process holds a connection on every path and alternates 1-byte exchanges among
    them (pod_request_response). Connections outside the hooks' cgroup are opened first (a
    process only moves into the cgroup); `prepare` sets --socket-lb before each."""
    argv = [sys.executable, str(THIS_FILE), "--pod-rr", "-" if cpu is None else str(cpu),
            str(count)]  # fmt: skip
    order = sorted(paths, key=lambda kind: paths[kind].cgroup is not None)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for kind in order:
            path = paths[kind]
            prepare(path)
            proc.stdin.write(json.dumps({
                "kind": kind, "netns": f"/run/netns/{path.pod.ns}", "ip": path.ip,
                "port": path.port, "cgroup": str(path.cgroup) if path.cgroup else None,
            }) + "\n")  # fmt: skip
            proc.stdin.flush()
            if proc.stdout.readline().strip() != "ok":
                raise RuntimeError(f"request/response: no connection on {kind}")
        proc.stdin.write(json.dumps({"op": "run"}) + "\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=600)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"request/response exited {proc.returncode}: {err}")
    return json.loads(out.strip().splitlines()[-1])["ns"]


def us(ns: float) -> str:
    return f"{ns / 1000:.1f}"


def row(label: str, s: Summary, extra: str = "") -> str:
    spread = f"{us(min(s.samples))}-{us(max(s.samples))}"
    return (
        f"{label:<44} {us(s.median):>7} {us(s.p99):>7} {spread:>14} {us(s.mean):>7} "
        f"{len(s.samples):>6}  {extra}"
    )


def iptables_backend() -> str:
    try:
        out = subprocess.run(["iptables", "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "iptables not found"
    return out.stdout.strip() or out.stderr.strip()


def run(args: argparse.Namespace) -> int:
    import statistics
    from unittest import mock

    from agent.dataplane.ebpf.netlink import TcAttacher
    from agent.dataplane.iptables import backend as iptables_module  # its COMMAND_TIMEOUT
    from agent.dataplane.iptables.dataplane import IptablesDataplane, unavailable_reason
    from bench.common.kernel import bench_dataplane, calibration_programs, leftovers, map_sizes_for
    from bench.common.nodestates import synthetic_entries
    from bench.common.report import (
        Summary,
        header,
        machine,
        results_path,
        terminate_as_interrupt,
        write_results,
    )
    from tests.lab.kit import stop_process
    from tests.lab.nodelab import Lab

    dataplanes = [d for d in DATAPLANES if d in args.dataplanes.split(",")]
    ebpf, iptables = "ebpf" in dataplanes, "iptables" in dataplanes
    socket_lb = [m for m in SOCKET_LB_MODES if m in args.socket_lb.split(",")]
    tc_kinds, sock_kinds = "off" in socket_lb, "all" in socket_lb
    sizes_n = sorted(args.services or ([1, 1000, 10_000] if args.quick else
                                       [1, 1000, 10_000, 30_000]))  # fmt: skip
    iptables_n = sorted(args.iptables_services or ([1000] if args.quick else [1000, 10_000]))
    if not iptables:
        iptables_n = []
    all_n = sorted(set(sizes_n if ebpf else []) | set(iptables_n))
    connects = args.connects or (1000 if args.quick else 2000)
    rounds = args.rounds or (3 if args.quick else 8)
    exchanges = args.exchanges or (1000 if args.quick else 3000)
    endpoints = args.endpoints

    terminate_as_interrupt()
    info = machine()
    info["iptables"] = iptables_backend()
    header("bench/connect.py (PB-2)", info, f"; {info['iptables']}")
    print(f"dataplanes: {', '.join(dataplanes)} (--socket-lb {','.join(socket_lb)}); eBPF at "
          f"{sizes_n if ebpf else 'none'}, "
          f"iptables at {iptables_n or 'none'} Services; {connects} connects per set, "
          f"{rounds} rounds per size; µs, wall clock in the client pod (perf_counter around "
          "connect())", flush=True)  # fmt: skip
    began = time.perf_counter()
    report: list[dict[str, Any]] = []
    cleanup_seconds: dict[str, float] = {}
    try:
        with Lab(cgroup=ebpf and sock_kinds) as lab, contextlib.ExitStack() as labs:
            client0, server0 = lab.add_pod("client0"), lab.add_pod("server0")
            others = synthetic_entries(max(all_n) - 1, endpoints)
            targets: dict[str, Target] = {"floor": Target(client0, server0.ipv4, PORT)}
            # The floor measured twice, as two paths: how far two identical paths read apart.
            targets["floor2"] = targets["floor"]
            listen = [(server0, [PORT])]  # the pods bench's server listens in (see serve)
            with contextlib.ExitStack() as stack:
                dp = ipt = None
                if ebpf:
                    client, server = lab.add_pod("client"), lab.add_pod("server")
                    client2, server2 = lab.add_pod("client2"), lab.add_pod("server2")
                    # The socket hooks' client: a pod of its own, as under --socket-lb all
                    # no flow of tc's joins it and the backends (see SOCK_CLIENT).
                    client3 = lab.add_pod(SOCK_CLIENT)
                    sizes = map_sizes_for(max(all_n), endpoints)
                    attached = [client.host_ifname, server.host_ifname, client3.host_ifname]
                    dp = stack.enter_context(bench_dataplane(
                        sizes, lab.node_ns, attached, lab.cgroup, args.tc_attach))  # fmt: skip
                    # The hook's own cost: an empty program on both hooks of another pair
                    # attached as the datapath is, tcx link or clsact filter (the dataplane's
                    # cleanup detaches it with its own kbp_ programs).
                    empty = stack.enter_context(calibration_programs(1024))["kbp_bench_empty"]
                    attacher = stack.enter_context(TcAttacher(lab.node_ns, dp.pin_dir,
                                                              dp.links.tc.mode))  # fmt: skip
                    for pod in (client2, server2):
                        for direction in ("ingress", "egress"):
                            attacher.attach(pod.host_ifindex, direction, empty, "kbp_bench_empty")
                    print(f"eBPF lab: tc programs as {dp.links.tc.mode}; datapath on "
                          f"{', '.join(attached)}; an empty program on "
                          f"{client2.host_ifname}, {server2.host_ifname}; no program on "
                          f"{client0.host_ifname}, {server0.host_ifname}; maps {sizes}",
                          flush=True)  # fmt: skip
                    listen += [(server, SERVER_PORTS), (server2, [PORT])]
                    hooked = lab.cgroup  # the socket hooks' cgroup
                    targets["noop"] = Target(client2, server2.ipv4, PORT)
                    targets["pod_ip"] = Target(client, server.ipv4, DIRECT_PORT, hooked, "off")
                    for pos in POSITIONS:
                        targets[f"ebpf:{pos}"] = Target(client, TARGET_IPS[pos], TARGET_PORT,
                                                        hooked, "off")  # fmt: skip
                        targets[f"sock:{pos}"] = Target(client3, TARGET_IPS[pos], TARGET_PORT,
                                                        hooked, "all")  # fmt: skip
                if iptables:
                    # Its own node namespace: the rules must not sit on the floor's path.
                    lab2 = labs.enter_context(Lab(node=2))
                    reason = unavailable_reason(lab2.node_ns)
                    if reason is not None:
                        raise RuntimeError(f"the iptables dataplane cannot run here: {reason}")
                    ipt_client, ipt_server = lab2.add_pod("client"), lab2.add_pod("server")
                    ipt = IptablesDataplane(list(IPTABLES_POD_INTERFACES), netns=lab2.node_ns)
                    stack.enter_context(
                        mock.patch.object(iptables_module, "COMMAND_TIMEOUT", IPTABLES_TIMEOUT)
                    )

                    def cleanup_iptables(dataplane: IptablesDataplane = ipt) -> None:
                        started = time.perf_counter()
                        dataplane.cleanup()
                        cleanup_seconds["iptables"] = time.perf_counter() - started

                    stack.callback(cleanup_iptables)
                    print(f"iptables lab: {lab2.node_ns}, IptablesDataplane(pod_interfaces="
                          f"{list(IPTABLES_POD_INTERFACES)}); {info['iptables']}",
                          flush=True)  # fmt: skip
                    listen.append((ipt_server, SERVER_PORTS))
                    targets["iptables:pod_ip"] = Target(ipt_client, ipt_server.ipv4, DIRECT_PORT)
                    for pos in POSITIONS:
                        targets[f"iptables:{pos}"] = Target(ipt_client, TARGET_IPS[pos],
                                                            TARGET_PORT)  # fmt: skip

                def prepare(target: Target) -> None:
                    """--socket-lb for a path through the programs, then the collector's
                    pass a running agent makes every few seconds (it rebuilds kbp_ct_gate
                    from the flows tc still holds)."""
                    if dp is not None and target.socket_lb is not None:
                        set_socket_lb(dp, target.socket_lb)
                        dp.conntrack.run_once()

                server_proc = start_server(listen, lab.cgroup)
                stack.callback(stop_process, server_proc)

                def place(cpu: int | None) -> None:
                    pin(server_proc.pid, cpu)

                for n in all_n:
                    applied: dict[str, dict[str, Any]] = {}
                    places: dict[str, dict[str, int]] = {}
                    kinds = ["floor", "floor2"]
                    if dp is not None and n in sizes_n:
                        state, places["ebpf"] = state_with_targets(
                            others, target_entries(n, server.ipv4), n)  # fmt: skip
                        started = time.perf_counter()
                        writes = dp.apply(state)
                        applied["ebpf"] = {"seconds": time.perf_counter() - started,
                                           "writes": writes}  # fmt: skip
                        kinds += ["noop", "pod_ip"]
                        if tc_kinds:
                            kinds += [f"ebpf:{p}" for p in places["ebpf"]]
                        if sock_kinds:
                            kinds += [f"sock:{p}" for p in places["ebpf"]]
                    if ipt is not None and n in iptables_n:
                        state, places["iptables"] = state_with_targets(
                            others, target_entries(n, ipt_server.ipv4), n)  # fmt: skip
                        started = time.perf_counter()
                        writes = ipt.apply(state)
                        applied["iptables"] = {"seconds": time.perf_counter() - started,
                                               "writes": writes}  # fmt: skip
                        kinds += [*(f"iptables:{p}" for p in places["iptables"]),
                                  "iptables:pod_ip"]  # fmt: skip
                    done = "; ".join(
                        f"{name} applied {a['writes']} writes in {a['seconds']:.2f} s"
                        for name, a in applied.items()
                    )
                    print(f"\n# {n} Services: {done}", flush=True)
                    errors: dict[str, int] = dict.fromkeys(kinds, 0)
                    notes: dict[str, str] = {}
                    by_round: dict[str, list[list[int]]] = {k: [] for k in kinds}
                    for r, (client_cpu, server_cpu) in enumerate(placements(rounds)):
                        place(server_cpu)
                        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                            target = targets[kind]
                            prepare(target)
                            out = run_in_pod(target.pod, target.ip, target.port, connects,
                                             client_cpu, target.cgroup)  # fmt: skip
                            by_round[kind].append(out["ns"])
                            errors[kind] += out["errors"]
                            if out["first_error"]:
                                notes.setdefault(kind, out["first_error"])
                    # Request/response: every path in one process, exchanges alternating
                    # among them (request_response_round), with the client and every server
                    # on one CPU ("same") and on two ("split"), the CPUs swapped each round.
                    rr_kinds = [k for k in RR_KINDS if k in kinds]
                    rr_paths = {k: targets[k] for k in rr_kinds}
                    rr_ns: dict[str, dict[str, list[int]]] = {
                        layout: {k: [] for k in rr_kinds} for layout in RR_LAYOUTS
                    }
                    # Per round, each kind's rate against the floor's of the same round.
                    rr_rounds: dict[str, dict[str, list[float]]] = {
                        layout: {k: [] for k in rr_kinds} for layout in RR_LAYOUTS
                    }
                    per_round = max(1, exchanges // rounds)
                    for client_cpu, other_cpu in placements(rounds):
                        for layout in RR_LAYOUTS:
                            place(client_cpu if layout == "same" else other_cpu)
                            got = request_response_round(rr_paths, per_round, client_cpu, prepare)
                            for kind, ns in got.items():
                                rr_ns[layout][kind] += ns
                                if "floor" in got and ns and got["floor"]:
                                    rr_rounds[layout][kind].append(
                                        statistics.median(got["floor"]) / statistics.median(ns)
                                    )
                    rr = {layout: {kind: Summary(ns) for kind, ns in by_kind.items()}
                          for layout, by_kind in rr_ns.items()}  # fmt: skip
                    report.append(print_size(n, by_round, errors, notes, rr, applied, places,
                                             rr_rounds))  # fmt: skip
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers() or 'nothing'})")
        return 130

    summary = print_targets(report)
    if "iptables" in cleanup_seconds:
        print(f"IptablesDataplane.cleanup() of the iptables lab took "
              f"{cleanup_seconds['iptables']:.1f} s")  # fmt: skip
    seconds = time.perf_counter() - began
    out = results_path(args, "connect")
    write_results(out, {
        "benchmark": "bench/connect.py",
        "id": "PB-2",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": info,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "dataplanes": dataplanes,
        "socket_lb": socket_lb,
        "tc_attach": args.tc_attach,
        "connects_per_set": connects,
        "rounds": rounds,
        "endpoints_per_service": endpoints,
        "unit": "ns",
        "sizes": report,
        **summary,
        "iptables_cleanup_seconds": cleanup_seconds.get("iptables"),
        "reference": REF_PB2,
        "duration_s": seconds,
    })  # fmt: skip
    print(f"\nran in {seconds:.0f} s (load average now {os.getloadavg()[0]:.2f}); "
          f"results in {out}; left over: {leftovers() or 'nothing'}")  # fmt: skip
    return 0


LABELS = {
    "floor": "floor: pod → pod IP, no programs",
    "floor2": "the floor again (an A/A check)",
    "noop": "pod → pod IP, empty tc programs",
    "pod_ip": "eBPF: pod → pod IP through the programs",
    "iptables:pod_ip": "iptables: pod → pod IP (misses every rule)",
}


def label_of(kind: str, places: dict[str, dict[str, int]], n: int) -> str:
    if kind in LABELS:
        return LABELS[kind]
    dataplane, pos = kind.split(":")
    name = {"ebpf": "eBPF tc", "sock": "eBPF socket LB", "iptables": "iptables"}[dataplane]
    place = places["ebpf" if dataplane == "sock" else dataplane][pos]
    return f"{name}: pod → ClusterIP, {pos} ({place}/{n})"


def round_nets(by_round: dict[str, list[list[int]]], kind: str) -> list[float]:
    """Per round, the kind's p50 minus the floor's p50 of the same round, ns: paired, so a
    round the machine was busy in moves both."""
    import statistics

    return [statistics.median(ours) - statistics.median(floor)
            for ours, floor in zip(by_round[kind], by_round["floor"], strict=True)
            if ours and floor]  # fmt: skip


def print_size(
    n: int,
    by_round: dict[str, list[list[int]]],
    errors: dict[str, int],
    notes: dict[str, str],
    rr: dict[str, dict[str, Summary]],
    applied: dict[str, dict[str, Any]],
    places: dict[str, dict[str, int]],
    rr_rounds: dict[str, dict[str, list[float]]] | None = None,
) -> dict[str, Any]:
    import statistics

    from bench.common.report import Summary, mark

    stats = {k: Summary([ns for one in rounds for ns in one]) for k, rounds in by_round.items()}
    floor = stats["floor"].median
    head = (
        f"{'connect() latency, µs':<44} {'p50':>7} {'p99':>7} {'min-max':>14} {'mean':>7} "
        f"{'n':>6}  - floor p50 (x floor; per round: median, range)"
    )
    print(head)
    print("-" * len(head))
    marks: dict[str, Any] = {}
    kinds: dict[str, Any] = {}
    for kind, s in stats.items():
        net = (s.median - floor) / 1000
        nets = round_nets(by_round, kind)
        kinds[kind] = {**s.to_json(), "errors": errors[kind], "ratio_to_floor": s.median / floor,
                       "round_nets_ns": nets}  # fmt: skip
        extra = ""
        if kind != "floor":
            mid, low, high = (x / 1000 for x in (statistics.median(nets), min(nets), max(nets)))
            extra = f"{net:+.1f} µs (x{s.median / floor:.2f}; {mid:+.1f}, {low:+.1f}..{high:+.1f})"
        if kind.startswith(("ebpf:", "sock:")):
            target = TARGET_SOCK_NET_P50_US if kind.startswith("sock:") else TARGET_NET_P50_US
            ok = mark(net <= target)
            marks[kind] = {"net_p50_us": net, "mark": ok, "target_us": target}
            extra += f"  ≤ +{target:g} µs {ok}"
        if errors[kind]:
            extra += f"  ({errors[kind]} failed: {notes.get(kind, '')})"
        print(row(label_of(kind, places, n), s, extra))
    if "noop" in stats and "ebpf:last" in stats:
        noop = stats["noop"].median
        ours = (stats["ebpf:last"].median - noop) / 1000
        print(f"{'  of which the tc hooks (noop - floor)':<44} {(noop - floor) / 1000:+7.1f}   "
              f"our programs (ebpf:last - noop): {ours:+.1f} µs")  # fmt: skip
    ratios: dict[str, Any] = {}
    for pos in places.get("iptables", {}):
        if f"ebpf:{pos}" not in stats:
            continue
        ebpf_p50 = stats[f"ebpf:{pos}"].median
        ipt_p50 = stats[f"iptables:{pos}"].median
        raw = ipt_p50 / ebpf_p50
        net = (ipt_p50 - floor) / max(1.0, ebpf_p50 - floor)
        ratios[pos] = {"raw": raw, "net_of_floor": net}
        print(f"  iptables / eBPF p50, target {pos}: {raw:.1f}x as measured, {net:.1f}x net of "
              f"the floor")  # fmt: skip
    rr_json: dict[str, Any] = {}
    for layout, by_kind in rr.items():
        where = ("client and servers on one CPU" if layout == "same"
                 else "client on one CPU, servers on the other")  # fmt: skip
        print(f"request/response, 1-byte echo, every path in one process, {where}:")
        rr_json[layout] = {}
        for kind, s in by_kind.items():
            # The rate at the typical exchange (p50): the mean follows a few stalls.
            extra = f"{1e9 / s.median:,.0f} exchanges/s at p50"
            entry = {**s.to_json(), "per_second_p50": 1e9 / s.median}
            if kind != "floor" and "floor" in by_kind:
                ratio = by_kind["floor"].median / s.median
                entry["rate_vs_floor"] = ratio
                extra += f", {ratio:.3f} of the floor's rate"
                per_round = (rr_rounds or {}).get(layout, {}).get(kind)
                if per_round:
                    entry["round_ratios"] = per_round
                    extra += f" (per round {min(per_round):.3f}-{max(per_round):.3f})"
                if kind == "sock:last":
                    key = "sock:rr" if layout == "same" else f"sock:rr:{layout}"
                    target = TARGET_SOCK_RR if layout == "same" else TARGET_SOCK_RR_SPLIT
                    marks[key] = {"ratio": ratio, "mark": mark(ratio >= target),
                                  "layout": layout, "target": target}  # fmt: skip
                    extra += f" ≥ {target} {marks[key]['mark']}"
            rr_json[layout][kind] = entry
            print(row(f"  {label_of(kind, places, n)}", s, extra))
    entry: dict[str, Any] = {
        "services": n,
        "applied": applied,
        "target_places": places,
        "kinds": kinds,
        "request_response": rr_json,
        "ebpf_marks": marks,
        "iptables_over_ebpf": ratios,
    }
    if "ebpf:last" in marks:  # the figures of earlier runs (one target, sorted last)
        entry["net_p50_us"] = marks["ebpf:last"]["net_p50_us"]
        entry["mark"] = marks["ebpf:last"]["mark"]
    return entry


def print_targets(report: list[dict[str, Any]]) -> dict[str, Any]:
    """The PB-2 targets over all sizes: eBPF near the floor and flat in N, ≥ 10x better
    than iptables at 10k; iptables' own slope (the PB-9 row asks for it)."""
    from bench.common.report import mark

    print(f"\n## targets (bench/README.md PB-2); anchors: {REF_PB2}")
    for e in report:
        kinds = e["kinds"]
        floor = kinds["floor"]["median"]
        parts = [f"{kind} {(kinds[kind]['median'] - floor) / 1000:+.2f} µs {m['mark']} "
                 f"(≤ +{m['target_us']:g})"
                 for kind, m in e["ebpf_marks"].items() if kind in kinds]  # fmt: skip
        if parts:
            print(f"{e['services']:>6} Services: eBPF p50 - floor ({floor / 1000:.1f} µs): "
                  f"{', '.join(parts)}")  # fmt: skip
        for key in ("sock:rr", "sock:rr:split"):
            if key in e["ebpf_marks"]:
                rr = e["ebpf_marks"][key]
                print(f"{'':>6}   socket LB request/response ({rr['layout']} CPU): "
                      f"{rr['ratio']:.3f} of the floor's rate {rr['mark']} "
                      f"(≥ {rr['target']})")  # fmt: skip
    slopes: dict[str, Any] = {}
    for kind in ("ebpf:first", "ebpf:last", "sock:first", "sock:last", "iptables:first",
                 "iptables:middle", "iptables:last", "iptables:pod_ip"):  # fmt: skip
        points = [(e["services"], e["kinds"][kind]["median"] - e["kinds"]["floor"]["median"])
                  for e in report if kind in e["kinds"]]  # fmt: skip
        if len(points) < 2:
            continue
        slope = slope_ns_per_service(points)
        slopes[kind] = {"net_ns_per_service": slope, "points": len(points)}
        text = f"slope of {kind} p50 net of the floor: {slope:+.4f} ns per Service"
        if kind.startswith(("ebpf:", "sock:")):
            slopes[kind]["mark"] = mark(abs(slope) < TARGET_SLOPE_NS)
            text += f" {slopes[kind]['mark']} (|slope| < {TARGET_SLOPE_NS:.0f} ns)"
        print(text)
    versus: dict[str, Any] = {}
    for e in report:
        for pos, r in e["iptables_over_ebpf"].items():
            if e["services"] < 10_000 and any(x["services"] >= 10_000 for x in report
                                              if x["iptables_over_ebpf"]):  # fmt: skip
                continue  # the target is stated at 10k; smaller sizes only without one
            ok_raw = mark(r["raw"] >= TARGET_VS_IPTABLES)
            ok_net = mark(r["net_of_floor"] >= TARGET_VS_IPTABLES)
            versus[f"{e['services']}:{pos}"] = {**r, "mark": ok_raw, "net_mark": ok_net}
            print(f"eBPF vs iptables at {e['services']} Services, target {pos}: "
                  f"{r['raw']:.1f}x as measured {ok_raw}, {r['net_of_floor']:.1f}x net of the "
                  f"floor {ok_net} (≥ {TARGET_VS_IPTABLES:.0f}x)")  # fmt: skip
    return {"slopes": slopes, "ebpf_vs_iptables": versus}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--pod-connect":  # ip port count cpu|-
        cpu = None if argv[4] == "-" else int(argv[4])
        print(json.dumps(pod_connect(argv[1], int(argv[2]), int(argv[3]), WARMUP, cpu)),
              flush=True)  # fmt: skip
        return 0
    if argv and argv[0] == "--pod-rr":  # cpu|- count; the paths on stdin
        cpu = None if argv[1] == "-" else int(argv[1])
        print(json.dumps(pod_request_response(cpu, int(argv[2]), WARMUP)), flush=True)
        return 0
    parser = argparse.ArgumentParser(
        description="PB-2: connect() latency to a ClusterIP through the eBPF dataplane and "
        "the iptables fallback vs a direct pod connection (not a test; always exits 0)."
    )
    parser.add_argument("--quick", action="store_true",
                        help="1, 1k and 10k Services (iptables: 1k), < 1 min")  # fmt: skip
    parser.add_argument("--dataplanes", default=",".join(DATAPLANES),
                        help="comma-separated: ebpf, iptables (default both)")  # fmt: skip
    parser.add_argument("--socket-lb", default=",".join(SOCKET_LB_MODES),
                        help="eBPF --socket-lb modes to measure, comma-separated: all (sock:*, "
                        "the socket hooks), off (ebpf:*, tc); default both")  # fmt: skip
    parser.add_argument("--tc-attach", default="auto", choices=("auto", "tcx", "clsact"),
                        help="how the eBPF lab attaches its tc programs, the datapath's and "
                        "the empty ones alike (the agent's --tc-attach); default auto")  # fmt: skip
    parser.add_argument("--iptables-services", type=int, nargs="+", metavar="N",
                        help="sizes for the iptables dataplane (default 1000 10000; quick: "
                        "1000)")  # fmt: skip
    parser.add_argument(
        "--services",
        type=int,
        nargs="+",
        metavar="N",
        help="Services loaded for eBPF, the targets included (default 1 1000 10000 30000)",
    )
    parser.add_argument(
        "--endpoints", type=int, default=10, metavar="E", help="endpoints per synthetic Service"
    )
    parser.add_argument("--connects", type=int, help="connect() calls per measurement set")
    parser.add_argument("--rounds", type=int, help="sets per kind and size")
    parser.add_argument("--exchanges", type=int, help="request/response exchanges per path and "
                        "layout, spread over the rounds (default 3000; quick: 1000)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    return run(parser.parse_args(argv))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
