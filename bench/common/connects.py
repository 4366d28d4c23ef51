"""What the PB-2 benchmarks (connect.py, sock_hooks.py, tc_cost.py) share: the address
plan of their targets, the pod side of a timed connect() and of the one echo server
process, and where the processes run.

The pod side runs in a fresh interpreter inside a pod (this file as a script with
`--serve`, or a benchmark script importing it): module-level imports stay in the standard
library so it starts quickly; the node side imports what it needs inside its functions.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.model.nodestate import NodeState, ServiceEntry
    from tests.lab.nodelab import Pod

THIS_FILE = Path(__file__).resolve()
PORT = 8080
# The pod-IP set through the programs uses its own port: a direct connection whose tuple
# equals the reply side of an earlier ClusterIP flow (same client port, backend IP and
# port) is hijacked by that flow's stale conntrack reply entry (see the report), which
# would time this set out instead of measuring the miss path.
DIRECT_PORT = 8081
MAX_FAILURES = 20  # a set stops after this many failed connects (each waits 2 s)
TARGET_IP = "10.96.255.254"  # the target that sorts last (also the only one below N = 3)
TARGET_PORT = 80
WARMUP = 20  # untimed connections first: neighbour resolution, caches
CLONE_NEWNET = 0x40000000
POSITIONS = ("first", "middle", "last")  # of the target Service in NodeState order
TARGET_IPS = {"first": "10.96.255.252", "middle": "10.96.255.253", "last": TARGET_IP}
# Each target has its own backend port, for the reason DIRECT_PORT has one: with a shared
# backend, a connect() to one ClusterIP from a source port an earlier flow to another used
# gets its SYN-ACK reverse-translated by that flow's stale eBPF conntrack entry (the reply
# key names the backend and the client, not the ClusterIP), and times out.
BACKEND_PORTS = {"first": 8082, "middle": 8083, "last": PORT}
SERVER_PORTS = sorted({PORT, DIRECT_PORT, *BACKEND_PORTS.values()})


# --- pod side ------------------------------------------------------------------------------


def pin(pid: int, cpu: int | None) -> None:
    """Keep process `pid` (0: this one) on `cpu` (None: leave it where it is)."""
    if cpu is not None:
        os.sched_setaffinity(pid, {cpu})


def pod_connect(
    ip: str,
    port: int,
    count: int,
    warmup: int,
    cpu: int | None,
    source_port: Callable[[int], int] | None = None,
) -> dict[str, Any]:
    """Time `count` sequential connect() calls (after `warmup` untimed ones) on `cpu`; each
    socket is closed with a RST (SO_LINGER 0). `source_port(k)`: the port the k-th socket
    binds first (SO_REUSEADDR), outside the timed part; None: the kernel picks one."""
    pin(0, cpu)
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
            if source_port is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("0.0.0.0", source_port(k)))
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


def enter(netns: str, cgroup: str | None) -> None:
    """Move this process into `cgroup` (if given) and its network namespace to `netns` (a
    /run/netns path): sockets made afterwards belong to that pod (and that cgroup's hooks)."""
    import ctypes

    if cgroup:
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(netns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns({netns}): {os.strerror(errno)}")
    finally:
        os.close(fd)


def serve(listen: list[str]) -> None:
    """Every pod's server in one process: for each NETNS=PORT,PORT... a listening TCP socket
    per port made in that network namespace; each connection gets a greeting line, then its
    bytes echoed until the peer closes. One plain selector loop, so every path the bench
    measures ends in the same process and code (the path, not the server, must differ)."""
    import selectors

    selector = selectors.DefaultSelector()
    for item in listen:
        netns, _, ports = item.partition("=")
        enter(netns, None)
        for port in ports.split(","):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("0.0.0.0", int(port)))
            sock.listen(512)
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, None)
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            sock = key.fileobj  # type: ignore[assignment]
            if key.data is None:  # a listener: take what is queued
                while True:
                    try:
                        conn, _ = sock.accept()
                    except OSError:
                        break
                    conn.setblocking(False)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    try:
                        conn.send(b"echo\n")
                    except OSError:  # reset already (connect() sets close with RST)
                        conn.close()
                        continue
                    selector.register(conn, selectors.EVENT_READ, True)
                continue
            try:
                data = sock.recv(65536)
                if data:
                    sock.sendall(data)
            except OSError:
                data = b""
            if not data:
                selector.unregister(sock)
                sock.close()


def echo_connection(ip: str, port: int, what: str) -> socket.socket:
    """A TCP connection to serve's echo at ip:port, Nagle off, its greeting line read."""
    sock = socket.create_connection((ip, port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    greeting = b""
    while not greeting.endswith(b"\n"):  # serve sends its name first
        data = sock.recv(256)
        if not data:
            raise EOFError(f"{what}: the server closed the connection")
        greeting += data
    return sock


# --- node side -----------------------------------------------------------------------------


def start_server(listen: list[tuple[Pod, list[int]]], cgroup: Path | None) -> subprocess.Popen:
    """The one server process (serve) for the pods in `listen`, in `cgroup` as a pod's
    processes are; returns once every socket listens."""
    from agent.lab.toolkit import LabError
    from tests.lab.kit import in_cgroup, read_line, stop_process

    spec = [f"/run/netns/{pod.ns}={','.join(map(str, ports))}" for pod, ports in listen]
    argv = in_cgroup(cgroup, [sys.executable, str(THIS_FILE), "--serve", *spec])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)  # stderr: the bench's
    line = read_line(proc, timeout=10).strip()
    if line != "ready":
        stop_process(proc)
        raise LabError(f"the bench's server did not start ({line!r})")
    return proc


def placements(rounds: int) -> list[tuple[int | None, int | None]]:
    """(client CPU, servers' CPU) per round for the connect() sets: the client on one CPU and
    every server on another, alternating which is which, so every path is measured with the
    same placement in each round (left to itself the scheduler puts a path's client and
    server on one CPU in one set and on two in the next). None: one CPU, nothing to place."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return [(None, None)] * rounds
    return [(cpus[r % 2], cpus[(r + 1) % 2]) for r in range(rounds)]


def slope_ns_per_service(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (N, ns) points."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return sxy / sxx if sxx else 0.0


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


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--serve":  # NETNS=PORT,PORT ...
        serve(argv[1:])
        return 0
    print("usage: connects.py --serve NETNS=PORT,PORT ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
