"""PB-2: TCP connect() latency from a pod to a ClusterIP through the eBPF dataplane and
through the iptables fallback, with 1 to 30k Services loaded, beside a direct connection
between two pods without programs or rules (the floor), all measured in turn in one run.

Two namespace labs (agent/lab/nodelab.py), so the iptables rules never sit on the eBPF or
floor paths (netfilter hooks are per namespace). The eBPF lab has one node namespace and
seven pods on veth pairs: `client`, `client3` and `server` have the tc programs on their
host veths; `client0` and `server0` have none (the floor); `client2` and `server2` have an
empty tc program. The iptables lab (node 2) has `client` and `server` and the IptablesDataplane in
its node namespace (`--pod-interfaces vethkbp*`). The servers run the lab's podserver on
ports 8080-8083. Three target Services (ClusterIPs 10.96.255.252-254:80 → the lab's
server, each on its own port) are named to sort first, in the middle and last among N - 3
synthetic Services x 10 endpoints (bench/common/nodestates.py's address plan; their backends do not
exist):
NodeState order is KBP-SERVICES order, whose rules iptables evaluates one by one, so the
position matters there and should not for eBPF. For each N, rounds of measurement sets
run in rotating order, each one process in a client pod that times many sequential
connect() calls (and closes each with a RST, so no TIME_WAIT piles up):

    floor            client0 → server0 pod IP, no programs on the path
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

Then request/response sets (floor, ebpf:last, sock:last, iptables:last), in rounds of
rotating order as the connect() sets: each one connection, 1-byte messages echoed by the
server (its Python event loop dominates; all kinds share it).

`--tc-attach tcx,clsact` measures every eBPF kind (noop, pod_ip, ebpf:*, sock:*) once per
way of attaching the tc programs, as KIND@MODE, in the same rotation: before a set of the
other mode the bench attaches the datapath's programs and the empty ones that way (the
other kind goes, as when an agent restarts with that --tc-attach).

    .venv/bin/python -m bench.connect [--quick] [--services N ...] [--dataplanes ebpf,iptables]
                                      [--socket-lb all,off] [--tc-attach tcx,clsact]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from agent.lab.nodelab import Pod
    from agent.model.nodestate import NodeState, ServiceEntry
    from bench.common.report import Summary

# The pod side (modes --pod-connect / --pod-rr) runs in a fresh interpreter in the client
# pod: keep module-level imports to the standard library so it starts quickly.

THIS_FILE = Path(__file__).resolve()
PORT = 8080
# The pod-IP set through the programs uses its own port: a direct connection whose tuple
# equals the reply side of an earlier ClusterIP flow (same client port, backend IP and
# port) is hijacked by that flow's stale conntrack reply entry (see the report), which
# would time this set out instead of measuring the miss path.
DIRECT_PORT = 8081
# The pod the sock:* sets connect from. tc's flows of the ebpf:* sets (from `client`, to
# the same backends) keep their conntrack entries for the time-wait after each set, and
# kbp_ct_gate lets tc skip its lookups only for (backend, client) pairs no such entry
# names: with --socket-lb all a pod's flows are the hooks', so its own pod measures that.
SOCK_CLIENT = "client3"
MAX_FAILURES = 20  # a set stops after this many failed connects (each waits 2 s)
TARGET_IP = "10.96.255.254"  # the target that sorts last (also the only one below N = 3)
TARGET_PORT = 80
WARMUP = 20  # untimed connections first: neighbour resolution, caches
POSITIONS = ("first", "middle", "last")  # of the target Service in NodeState order
TARGET_IPS = {"first": "10.96.255.252", "middle": "10.96.255.253", "last": TARGET_IP}
# Each target has its own backend port, for the reason DIRECT_PORT has one: with a shared
# backend, a connect() to one ClusterIP from a source port an earlier flow to another used
# gets its SYN-ACK reverse-translated by that flow's stale eBPF conntrack entry (the reply
# key names the backend and the client, not the ClusterIP), and times out.
BACKEND_PORTS = {"first": 8082, "middle": 8083, "last": PORT}
SERVER_PORTS = sorted({PORT, DIRECT_PORT, *BACKEND_PORTS.values()})
DATAPLANES = ("ebpf", "iptables")
IPTABLES_POD_INTERFACES = ("vethkbp*",)  # the lab's host veths (agent/lab/nodelab.py)
# The iptables dataplane's tools may run this long here: iptables-nft 1.8.9 needs more
# than the module's COMMAND_TIMEOUT (300 s) to restore 10k Services x 10 endpoints.
IPTABLES_TIMEOUT = 3600.0

# Targets and anchors (bench/README.md, PB-2).
TARGET_NET_P50_US = 2.0  # eBPF p50 ≤ floor + 2 µs
TARGET_SOCK_NET_P50_US = 0.5  # socket LB (issue 16): p50 ≤ floor + 0.5 µs
TARGET_SOCK_RR = 0.97  # socket LB: request/response rate ≥ 0.97 of the floor's
SOCKET_LB_MODES = ("all", "off")  # --socket-lb values measured: all = sock:*, off = ebpf:*
TARGET_SLOPE_NS = 1.0  # flat in N: < 1 ns per Service
TARGET_VS_IPTABLES = 10.0  # eBPF ≥ 10x better than the iptables fallback at 10k
REF_PB2 = (
    "kube-proxy iptables first-packet p50 49 / 61 / 274 µs at 5k / 10k / 30k Services; "
    "nftables ≈14 µs flat (KEP-3866); here iptables-nft at 10k, target last: p50 142-181 µs"
)


# --- pod side ------------------------------------------------------------------------------


def pod_connect(ip: str, port: int, count: int, warmup: int) -> dict[str, Any]:
    """Time `count` sequential connect() calls (after `warmup` untimed ones); each socket
    is closed with a RST (SO_LINGER 0)."""
    linger = struct.pack("ii", 1, 0)
    timeout = struct.pack("ll", 2, 0)  # SO_SNDTIMEO bounds a blocking connect()
    samples: list[int] = []
    errors = 0
    first_error = ""
    clock = time.perf_counter_ns
    for k in range(warmup + count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
        try:
            start = clock()
            sock.connect((ip, port))
            elapsed = clock() - start
        except OSError as exc:
            errors += 1
            first_error = first_error or f"{type(exc).__name__}: {exc}"
            if errors >= MAX_FAILURES:
                break
        else:
            if k >= warmup:
                samples.append(elapsed)
        finally:
            sock.close()
    return {"ns": samples, "errors": errors, "first_error": first_error}


def pod_request_response(ip: str, port: int, count: int, warmup: int) -> dict[str, Any]:
    """One connection; `count` 1-byte messages, each timed until its echo is back."""
    samples: list[int] = []
    clock = time.perf_counter_ns
    with socket.create_connection((ip, port), timeout=5) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        greeting = b""
        while not greeting.endswith(b"\n"):  # podserver sends its name first
            greeting += sock.recv(256)
        began = clock()
        for k in range(warmup + count):
            start = clock()
            sock.sendall(b"x")
            if not sock.recv(16):
                raise EOFError("server closed the connection")
            if k >= warmup:
                samples.append(clock() - start)
        total = clock() - began
    return {"ns": samples, "errors": 0, "first_error": "", "total_ns": total}


# --- node side -----------------------------------------------------------------------------


def run_in_pod(
    pod: Pod, mode: str, ip: str, port: int, count: int, cgroup: Path | None = None
) -> dict[str, Any]:
    """The pod side in `pod` (and in `cgroup`, where the socket hooks are, if given)."""
    from agent.lab.toolkit import in_cgroup, in_netns

    argv = in_netns(pod.ns, [sys.executable, str(THIS_FILE), mode, ip, str(port), str(count)])
    argv = in_cgroup(cgroup, argv)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} in {pod.name} exited {proc.returncode}: {proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def slope_ns_per_service(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (N, ns) points."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return sxy / sxx if sxx else 0.0


def us(ns: float) -> str:
    return f"{ns / 1000:.1f}"


def row(label: str, s: Summary, extra: str = "") -> str:
    spread = f"{us(min(s.samples))}-{us(max(s.samples))}"
    return (
        f"{label:<44} {us(s.median):>7} {us(s.p99):>7} {spread:>14} {us(s.mean):>7} "
        f"{len(s.samples):>6}  {extra}"
    )


def set_socket_lb(dataplane: Any, mode: str) -> None:
    """Write --socket-lb `mode` into the dataplane's kbp_config, as an agent started with
    it would (the hooks read it at each connect())."""
    from agent.dataplane.ebpf.abi import from_bytes, to_bytes
    from agent.dataplane.ebpf.external import SOCKET_LB_BITS

    table = dataplane.programs.map("kbp_config")
    config = from_bytes("kbp_config", table.lookup(bytes(4)))
    if config.sock_lb != SOCKET_LB_BITS[mode]:
        config.sock_lb = SOCKET_LB_BITS[mode]
        table.update(bytes(4), to_bytes(config))


def iptables_backend() -> str:
    try:
        out = subprocess.run(["iptables", "--version"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "iptables not found"
    return out.stdout.strip() or out.stderr.strip()


def target_entries(n: int, server_ip: str) -> dict[str, ServiceEntry]:
    """The target Services of a lab for N Services in all: named to sort first, in the
    middle and last among bench/common/nodestates.py's synthetic `svc-NNNNNN` (one below N = 3)."""
    from bench.common.nodestates import service_entry

    if n < len(POSITIONS):
        backends = [(server_ip, BACKEND_PORTS["last"])]
        return {"last": service_entry("zz-target", TARGET_IP, backends, local=True)}
    synthetic = n - len(POSITIONS)
    # "svc-000499-target" sorts right after svc-000499: half the synthetic ones before it
    middle = f"svc-{synthetic // 2 - 1:06d}-target" if synthetic >= 2 else "m-target"
    names = {"first": "aa-target", "middle": middle, "last": "zz-target"}
    return {
        pos: service_entry(
            names[pos], TARGET_IPS[pos], [(server_ip, BACKEND_PORTS[pos])], local=True
        )
        for pos in POSITIONS
    }


def state_with_targets(
    others: list[ServiceEntry], targets: dict[str, ServiceEntry], n: int
) -> tuple[NodeState, dict[str, int]]:
    """The NodeState of N Services and each target's 1-based place in it (= its rule's
    place in KBP-SERVICES: every synthetic entry has one ClusterIP frontend)."""
    from bench.common.nodestates import nodestate_of

    state = nodestate_of([*others[: n - len(targets)], *targets.values()])
    place = {e.sort_key: i + 1 for i, e in enumerate(state.services)}
    return state, {pos: place[t.sort_key] for pos, t in targets.items()}


def run(args: argparse.Namespace) -> int:
    from unittest import mock

    from agent.dataplane.ebpf.dataplane import HOOKS
    from agent.dataplane.ebpf.netlink import TcAttacher
    from agent.dataplane.iptables import backend as iptables_module  # its COMMAND_TIMEOUT
    from agent.dataplane.iptables.dataplane import IptablesDataplane, unavailable_reason
    from agent.lab.nodelab import Lab
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

    dataplanes = [d for d in DATAPLANES if d in args.dataplanes.split(",")]
    ebpf, iptables = "ebpf" in dataplanes, "iptables" in dataplanes
    socket_lb = [m for m in SOCKET_LB_MODES if m in args.socket_lb.split(",")]
    tc_kinds, sock_kinds = "off" in socket_lb, "all" in socket_lb
    attach_modes = [m.strip() for m in args.tc_attach.split(",") if m.strip()]
    by_mode = len(attach_modes) > 1  # eBPF kinds measured once per mode, as KIND@MODE

    def moded(kinds: list[str]) -> list[str]:
        return [f"{k}@{m}" for m in attach_modes for k in kinds] if by_mode else kinds

    sizes_n = sorted(args.services or ([1, 1000, 10_000] if args.quick else
                                       [1, 1000, 10_000, 30_000]))  # fmt: skip
    iptables_n = sorted(args.iptables_services or ([1000] if args.quick else [1000, 10_000]))
    if not iptables:
        iptables_n = []
    all_n = sorted(set(sizes_n if ebpf else []) | set(iptables_n))
    connects = args.connects or (1000 if args.quick else 2000)
    rounds = args.rounds or (3 if args.quick else 8)
    exchanges = 1000 if args.quick else 3000
    endpoints = args.endpoints

    terminate_as_interrupt()
    info = machine()
    info["iptables"] = iptables_backend()
    header("bench/connect.py (PB-2)", info, f"; {info['iptables']}")
    print(f"dataplanes: {', '.join(dataplanes)} (--socket-lb {','.join(socket_lb)}); eBPF at "
          f"{sizes_n if ebpf else 'none'} (tc attached as {', '.join(attach_modes)}), "
          f"iptables at {iptables_n or 'none'} Services; {connects} connects per set, "
          f"{rounds} rounds per size; µs, wall clock in the client pod (perf_counter around "
          "connect())", flush=True)  # fmt: skip
    began = time.perf_counter()
    report: list[dict[str, Any]] = []
    cleanup_seconds: dict[str, float] = {}
    try:
        with Lab(cgroup=ebpf and sock_kinds) as lab, contextlib.ExitStack() as labs:
            client0, server0 = lab.add_pod("client0"), lab.add_pod("server0")
            server0.serve([PORT], ("tcp",))
            others = synthetic_entries(max(all_n) - 1, endpoints)
            targets: dict[str, tuple[Pod, str, int]] = {"floor": (client0, server0.ipv4, PORT)}
            with contextlib.ExitStack() as stack:
                dp = ipt = None
                if ebpf:
                    client, server = lab.add_pod("client"), lab.add_pod("server")
                    client2, server2 = lab.add_pod("client2"), lab.add_pod("server2")
                    # The socket hooks' client: a pod of its own, as under --socket-lb all
                    # no flow of tc's joins it and the backends (see SOCK_CLIENT).
                    client3 = lab.add_pod(SOCK_CLIENT)
                    server.serve(SERVER_PORTS, ("tcp",))
                    server2.serve([PORT], ("tcp",))
                    sizes = map_sizes_for(max(all_n), endpoints)
                    attached = [client.host_ifname, server.host_ifname, client3.host_ifname]
                    dp = stack.enter_context(bench_dataplane(sizes, lab.node_ns, attached,
                                                             lab.cgroup))  # fmt: skip
                    # The hook's own cost: an empty program on both hooks of another pair
                    # (the dataplane's cleanup detaches it with its own kbp_ filters).
                    empty = stack.enter_context(calibration_programs(1024))["kbp_bench_empty"]

                    def attach_tc(mode: str, datapath: Any = dp) -> None:
                        """The datapath's and the empty programs attached as `mode` (tcx or
                        clsact; auto: as the agent would)."""
                        with TcAttacher(lab.node_ns, datapath.pin_dir, mode) as attacher:
                            for pod in (client, server, client3):
                                for direction, program in HOOKS:
                                    attacher.attach(
                                        pod.host_ifindex,
                                        direction,
                                        datapath.programs.fd(program),
                                        program,
                                    )
                            for pod in (client2, server2):
                                for direction in ("ingress", "egress"):
                                    attacher.attach(pod.host_ifindex, direction, empty,
                                                    "kbp_bench_empty")  # fmt: skip
                        attached_as[0] = mode

                    attached_as = [""]
                    attach_tc(attach_modes[0])
                    print(f"eBPF lab: datapath on {', '.join(attached)}; an empty program on "
                          f"{client2.host_ifname}, {server2.host_ifname}; no program on "
                          f"{client0.host_ifname}, {server0.host_ifname}; maps {sizes}",
                          flush=True)  # fmt: skip
                    targets["noop"] = (client2, server2.ipv4, PORT)
                    targets["pod_ip"] = (client, server.ipv4, DIRECT_PORT)
                    for pos in POSITIONS:
                        targets[f"ebpf:{pos}"] = (client, TARGET_IPS[pos], TARGET_PORT)
                        targets[f"sock:{pos}"] = (client3, TARGET_IPS[pos], TARGET_PORT)
                if iptables:
                    # Its own node namespace: the rules must not sit on the floor's path.
                    lab2 = labs.enter_context(Lab(node=2))
                    reason = unavailable_reason(lab2.node_ns)
                    if reason is not None:
                        raise RuntimeError(f"the iptables dataplane cannot run here: {reason}")
                    ipt_client, ipt_server = lab2.add_pod("client"), lab2.add_pod("server")
                    ipt_server.serve(SERVER_PORTS, ("tcp",))
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
                    targets["iptables:pod_ip"] = (ipt_client, ipt_server.ipv4, DIRECT_PORT)
                    for pos in POSITIONS:
                        targets[f"iptables:{pos}"] = (ipt_client, TARGET_IPS[pos], TARGET_PORT)

                def prepare(kind: str) -> Path | None:
                    """--socket-lb for the set; the cgroup its client runs in (the hooks
                    run only there: the floor's and noop's clients stay outside). A
                    KIND@MODE set first attaches the tc programs as MODE."""
                    kind, _, mode = kind.partition("@")
                    if dp is not None and mode and mode != attached_as[0]:
                        attach_tc(mode)
                    if dp is None or not (kind.startswith(("ebpf:", "sock:")) or kind == "pod_ip"):
                        return None
                    set_socket_lb(dp, "all" if kind.startswith("sock:") else "off")
                    # The collector's pass, as a running agent makes every few seconds:
                    # it rebuilds kbp_ct_gate from the flows tc still holds.
                    dp.conntrack.run_once()
                    return lab.cgroup

                for n in all_n:
                    applied: dict[str, dict[str, Any]] = {}
                    places: dict[str, dict[str, int]] = {}
                    kinds = ["floor"]
                    if dp is not None and n in sizes_n:
                        state, places["ebpf"] = state_with_targets(
                            others, target_entries(n, server.ipv4), n)  # fmt: skip
                        started = time.perf_counter()
                        writes = dp.apply(state)
                        applied["ebpf"] = {"seconds": time.perf_counter() - started,
                                           "writes": writes}  # fmt: skip
                        ebpf_kinds = ["noop", "pod_ip"]
                        if tc_kinds:
                            ebpf_kinds += [f"ebpf:{p}" for p in places["ebpf"]]
                        if sock_kinds:
                            ebpf_kinds += [f"sock:{p}" for p in places["ebpf"]]
                        kinds += moded(ebpf_kinds)
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
                    samples: dict[str, list[float]] = {k: [] for k in kinds}
                    errors: dict[str, int] = dict.fromkeys(kinds, 0)
                    notes: dict[str, str] = {}
                    for r in range(rounds):
                        for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                            pod, ip, port = targets[kind.partition("@")[0]]
                            cgroup = prepare(kind)
                            out = run_in_pod(pod, "--pod-connect", ip, port, connects, cgroup)
                            samples[kind] += out["ns"]
                            errors[kind] += out["errors"]
                            if out["first_error"]:
                                notes.setdefault(kind, out["first_error"])
                    # Request/response in rounds of rotating order too, so that the
                    # machine's drift (others' work) falls on every kind alike.
                    rr_kinds = [k for k in ("floor", *moded(["ebpf:last", "sock:last"]),
                                            "iptables:last") if k in kinds]  # fmt: skip
                    rr_ns: dict[str, list[int]] = {k: [] for k in rr_kinds}
                    for r in range(rounds):
                        for kind in rr_kinds[r % len(rr_kinds) :] + rr_kinds[: r % len(rr_kinds)]:
                            pod, ip, port = targets[kind.partition("@")[0]]
                            cgroup = prepare(kind)
                            out = run_in_pod(pod, "--pod-rr", ip, port,
                                             max(1, exchanges // rounds), cgroup)  # fmt: skip
                            rr_ns[kind] += out["ns"]
                    rr = {kind: Summary(ns) for kind, ns in rr_ns.items()}
                    report.append(print_size(n, samples, errors, notes, rr, applied, places))
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
        "tc_attach": attach_modes,
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
    "noop": "pod → pod IP, empty tc programs",
    "pod_ip": "eBPF: pod → pod IP through the programs",
    "iptables:pod_ip": "iptables: pod → pod IP (misses every rule)",
}


def label_of(kind: str, places: dict[str, dict[str, int]], n: int) -> str:
    kind, _, mode = kind.partition("@")
    if mode:
        return f"{label_of(kind, places, n)} [{mode}]"
    if kind in LABELS:
        return LABELS[kind]
    dataplane, pos = kind.split(":")
    name = {"ebpf": "eBPF tc", "sock": "eBPF socket LB", "iptables": "iptables"}[dataplane]
    place = places["ebpf" if dataplane == "sock" else dataplane][pos]
    return f"{name}: pod → ClusterIP, {pos} ({place}/{n})"


def print_size(
    n: int,
    samples: dict[str, list[float]],
    errors: dict[str, int],
    notes: dict[str, str],
    rr: dict[str, Summary],
    applied: dict[str, dict[str, Any]],
    places: dict[str, dict[str, int]],
) -> dict[str, Any]:
    from bench.common.report import Summary, mark

    stats = {k: Summary(v) for k, v in samples.items()}
    floor = stats["floor"].median
    head = (
        f"{'connect() latency, µs':<44} {'p50':>7} {'p99':>7} {'min-max':>14} {'mean':>7} "
        f"{'n':>6}  - floor (p50)"
    )
    print(head)
    print("-" * len(head))
    marks: dict[str, Any] = {}
    for kind, s in stats.items():
        net = (s.median - floor) / 1000
        extra = "" if kind == "floor" else f"{net:+.1f} µs"
        if kind.startswith(("ebpf:", "sock:")):
            target = TARGET_SOCK_NET_P50_US if kind.startswith("sock:") else TARGET_NET_P50_US
            ok = mark(net <= target)
            marks[kind] = {"net_p50_us": net, "mark": ok, "target_us": target}
            extra += f"  ≤ +{target:g} µs {ok}"
        if errors[kind]:
            extra += f"  ({errors[kind]} failed: {notes.get(kind, '')})"
        print(row(label_of(kind, places, n), s, extra))
    for mode in sorted({k.partition("@")[2] for k in stats}):
        at = f"@{mode}" if mode else ""
        if f"noop{at}" not in stats or f"ebpf:last{at}" not in stats:
            continue
        noop = stats[f"noop{at}"].median
        ours = (stats[f"ebpf:last{at}"].median - noop) / 1000
        print(f"{'  of which the tc hooks (noop - floor)' + (f' [{mode}]' if mode else ''):<44} "
              f"{(noop - floor) / 1000:+7.1f}   our programs (ebpf:last - noop): "
              f"{ours:+.1f} µs")  # fmt: skip
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
    rr_labels = {"floor": "request/response, floor (1 B echo)",
                 "ebpf:last": "request/response, eBPF tc ClusterIP",
                 "sock:last": "request/response, eBPF socket LB ClusterIP",
                 "iptables:last": "request/response, iptables ClusterIP"}  # fmt: skip
    for kind in rr:
        base, _, mode = kind.partition("@")
        label = rr_labels[base] + (f" [{mode}]" if mode else "")
        if kind in rr:
            s = rr[kind]
            extra = f"{1e9 / s.mean:,.0f} transactions/s"
            if kind != "floor" and "floor" in rr:
                # The rate at the typical exchange (p50): on a loaded machine the mean
                # follows a few scheduling stalls of either process.
                ratio = rr["floor"].median / s.median
                extra += f", {ratio:.3f} of the floor's rate at p50"
                if base == "sock:last":
                    key = f"sock:rr{kind.removeprefix(base)}"
                    marks[key] = {"ratio": ratio, "mark": mark(ratio >= TARGET_SOCK_RR)}
                    extra += f" ≥ {TARGET_SOCK_RR} {marks[key]['mark']}"
            print(row(label, s, extra))
    entry: dict[str, Any] = {
        "services": n,
        "applied": applied,
        "target_places": places,
        "kinds": {kind: {**s.to_json(), "errors": errors[kind]} for kind, s in stats.items()},
        "request_response": {k: {**s.to_json(), "per_second": 1e9 / s.mean} for k, s in rr.items()},
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
        for key, rr in e["ebpf_marks"].items():
            if key.startswith("sock:rr"):
                print(f"{'':>6}   socket LB request/response{key.removeprefix('sock:rr')}: "
                      f"{rr['ratio']:.3f} of the floor's rate {rr['mark']} "
                      f"(≥ {TARGET_SOCK_RR})")  # fmt: skip
    slopes: dict[str, Any] = {}
    measured = sorted({kind for e in report for kind in e["kinds"]})
    for kind in [k for k in measured if k.startswith(("ebpf:first", "ebpf:last", "sock:first",
                                                      "sock:last"))] + [
        "iptables:first", "iptables:middle", "iptables:last", "iptables:pod_ip",
    ]:  # fmt: skip
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
    if argv and argv[0] in ("--pod-connect", "--pod-rr"):
        ip, port, count = argv[1], int(argv[2]), int(argv[3])
        work = pod_connect if argv[0] == "--pod-connect" else pod_request_response
        print(json.dumps(work(ip, port, count, WARMUP)), flush=True)
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
    parser.add_argument("--tc-attach", default="auto",
                        help="how the eBPF lab attaches its tc programs, comma-separated: "
                        "auto, tcx, clsact; two or more measure every eBPF kind once per "
                        "mode, side by side (e.g. tcx,clsact); default auto")  # fmt: skip
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
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    return run(parser.parse_args(argv))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
