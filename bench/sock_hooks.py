"""PB-2, taken apart: what the cgroup connect hook itself costs per connect() (and the
release hook per close()), from the kernel's own program statistics (BPF_ENABLE_STATS:
run_time_ns / run_cnt of this run's kbp_connect4 and kbp_release only, whatever other
programs the machine runs), beside the connect() p50 of the same sets against the floor.

One namespace lab (agent/lab/nodelab.py) with its cgroup: `client0` → `server0` with no
program and outside the cgroup (the floor), and `client` (in the cgroup, the dataplane on
its veth, --socket-lb all) → ClusterIPs served by `server`:

    floor      client0 → server0 pod IP, no programs, no hooks
    sock       client → 10.96.255.254:80 (one backend, no affinity)
    affinity   client → 10.96.255.253:80 (one backend, ClientIP affinity)
    udp        client, a UDP socket connect()ed to 10.96.255.254:80 (the same Service's
               UDP port; the hook only: no datagram is sent)
    pod_ip     client → server pod IP:8080 (no frontend has that port: the hook leaves)
    pod_ip80   client → server pod IP:80 (a frontend port, no Service at that address)

Sets run in rounds of rotating order. The statistics cost the kernel two clock reads per
program run (they are in run_time_ns too), so compare figures of this tool with each
other, not with connect.py's.

    .venv/bin/python -m bench.sock_hooks [--connects N] [--rounds R]
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if not __package__:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if TYPE_CHECKING:
    from agent.lab.nodelab import Pod

THIS_FILE = Path(__file__).resolve()
PORT = 8080
AFFINITY_IP = "10.96.255.253"
TARGET_IP = "10.96.255.254"
FRONTEND_PORT = 80
KINDS = ("floor", "sock", "affinity", "udp", "pod_ip", "pod_ip80")
# The hook timed, the one at close(), and the tc programs on the pods' veths.
PROGRAMS = ("kbp_connect4", "kbp_release", "kbp_from_pod", "kbp_to_pod")
BPF_STATS_RUN_TIME = 0  # enum bpf_stats_type
PROG_INFO_SIZE = 224  # struct bpf_prog_info up to verified_insns
RUN_TIME_AT, RUN_CNT_AT, XLATED_LEN_AT, JITED_LEN_AT, VERIFIED_AT = 192, 200, 20, 16, 216


def pod_udp_connect(ip: str, port: int, count: int) -> dict[str, Any]:
    """`count` UDP sockets connect()ed to ip:port (no datagram), each timed."""
    samples: list[int] = []
    clock = time.perf_counter_ns
    for _ in range(count):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            start = clock()
            sock.connect((ip, port))
            samples.append(clock() - start)
    return {"ns": samples, "errors": 0, "first_error": ""}


def run_in_pod(
    pod: Pod, mode: str, ip: str, port: int, count: int, cgroup: Path | None
) -> dict[str, Any]:
    """The pod side of this file in `pod` (and in `cgroup`, where the hooks are)."""
    from agent.lab.toolkit import in_cgroup, in_netns

    argv = in_netns(pod.ns, [sys.executable, str(THIS_FILE), mode, ip, str(port), str(count)])
    proc = subprocess.run(in_cgroup(cgroup, argv), capture_output=True, text=True, timeout=600,
                          check=False)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} in {pod.name} exited {proc.returncode}: {proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class ProgramStats:
    """Run time and count of one loaded program (by fd), while statistics are enabled."""

    def __init__(self, prog_fd: int) -> None:
        self._lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
        self._fd = prog_fd

    def info(self) -> bytes:
        buf = ctypes.create_string_buffer(PROG_INFO_SIZE)
        size = ctypes.c_uint32(PROG_INFO_SIZE)
        rc = self._lib.bpf_obj_get_info_by_fd(self._fd, buf, ctypes.byref(size))
        if rc < 0:
            raise OSError(-rc, "bpf_obj_get_info_by_fd")
        return buf.raw

    def sample(self) -> tuple[int, int]:
        raw = self.info()
        return (int.from_bytes(raw[RUN_TIME_AT : RUN_TIME_AT + 8], "little"),
                int.from_bytes(raw[RUN_CNT_AT : RUN_CNT_AT + 8], "little"))  # fmt: skip

    def sizes(self) -> dict[str, int]:
        raw = self.info()

        def u32(at: int) -> int:
            return int.from_bytes(raw[at : at + 4], "little")

        return {"xlated_insns": u32(XLATED_LEN_AT) // 8, "jited_bytes": u32(JITED_LEN_AT),
                "verified_insns": u32(VERIFIED_AT)}  # fmt: skip


def enable_stats() -> int:
    """An fd that keeps the kernel's program statistics on while it is open (refcounted:
    another user's sysctl or fd is not disturbed)."""
    fd = ctypes.CDLL("libbpf.so.1", use_errno=True).bpf_enable_stats(BPF_STATS_RUN_TIME)
    if fd < 0:
        raise OSError(-fd, "bpf_enable_stats")
    return fd


def run(args: argparse.Namespace) -> int:
    from agent.dataplane.ebpf.cgroup import netns_cookie
    from agent.lab.nodelab import Lab
    from bench.common.kernel import bench_dataplane, map_sizes_for
    from bench.common.nodestates import nodestate_of, service_entry
    from bench.common.report import Summary, header, machine, terminate_as_interrupt
    from bench.connect import set_socket_lb

    terminate_as_interrupt()
    info = machine()
    header("bench/sock_hooks.py (PB-2, the connect hook)", info, "")
    print(f"{args.connects} connects per set, {args.rounds} rounds; bpf sources "
          f"{os.environ.get('KBP_BPF_SOURCE_DIR') or 'of this checkout'}", flush=True)  # fmt: skip
    loads = [os.getloadavg()[0]]
    with Lab(cgroup=True) as lab:
        client0, server0 = lab.add_pod("client0"), lab.add_pod("server0")
        client, server = lab.add_pod("client"), lab.add_pod("server")
        server0.serve([PORT], ("tcp",))
        server.serve([PORT, FRONTEND_PORT], ("tcp",))
        plain = service_entry("zz-target", TARGET_IP, [(server.ipv4, PORT)], local=True)
        sticky = service_entry("zy-sticky", AFFINITY_IP, [(server.ipv4, PORT)], local=True)
        sticky = dataclasses.replace(sticky, affinity_timeout=10800).sealed()
        with bench_dataplane(map_sizes_for(10, 10), lab.node_ns, [client.host_ifname,
                             server.host_ifname], lab.cgroup) as dp:  # fmt: skip
            udp = dataclasses.replace(plain, protocol="UDP").sealed()
            dp.apply(nodestate_of([plain, udp, sticky]))
            set_socket_lb(dp, "all")
            dp.conntrack.run_once()  # the collector's pass builds kbp_ct_gate, as an agent's
            print(f"client netns cookie {netns_cookie(client.ns)}", flush=True)
            stats = {p: ProgramStats(dp.programs.fd(p)) for p in PROGRAMS}
            targets: dict[str, tuple[Pod, str, int, str]] = {
                "floor": (client0, server0.ipv4, PORT, "--pod-connect"),
                "sock": (client, TARGET_IP, FRONTEND_PORT, "--pod-connect"),
                "affinity": (client, AFFINITY_IP, FRONTEND_PORT, "--pod-connect"),
                "udp": (client, TARGET_IP, FRONTEND_PORT, "--pod-udp"),
                "pod_ip": (client, server.ipv4, PORT, "--pod-connect"),
                "pod_ip80": (client, server.ipv4, FRONTEND_PORT, "--pod-connect"),
            }
            samples: dict[str, list[int]] = {k: [] for k in KINDS}
            hook = {(k, p): [0, 0] for k in KINDS for p in PROGRAMS}
            stats_fd = enable_stats()
            try:
                for r in range(args.rounds):
                    for kind in KINDS[r % len(KINDS) :] + KINDS[: r % len(KINDS)]:
                        pod, ip, port, mode = targets[kind]
                        cgroup = None if kind == "floor" else lab.cgroup
                        before = {p: s.sample() for p, s in stats.items()}
                        out = run_in_pod(pod, mode, ip, port, args.connects, cgroup)
                        after = {p: s.sample() for p, s in stats.items()}
                        if out["errors"]:
                            raise RuntimeError(f"{kind}: {out['first_error']}")
                        samples[kind] += out["ns"]
                        for p in PROGRAMS:
                            hook[kind, p][0] += after[p][0] - before[p][0]
                            hook[kind, p][1] += after[p][1] - before[p][1]
                    loads.append(os.getloadavg()[0])
            finally:
                os.close(stats_fd)
            sizes = stats[PROGRAMS[0]].sizes()
    floor = Summary(samples["floor"]).median
    print(f"\n{PROGRAMS[0]}: {sizes}")
    print(f"{'kind':<10} {'p50 µs':>8} {'- floor':>8}" + "".join(
        f" {p + ' ns/run':>20} {'runs':>6}" for p in PROGRAMS))  # fmt: skip
    for kind in KINDS:
        s = Summary(samples[kind])
        line = f"{kind:<10} {s.median / 1000:8.2f} {(s.median - floor) / 1000:+8.2f}"
        for p in PROGRAMS:
            ns, cnt = hook[kind, p]
            line += f" {f'{ns / cnt:.0f}' if cnt else '-':>20} {cnt:>6}"
        print(line)
    print(f"load average (1 min) during the run: {min(loads):.2f}-{max(loads):.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("--pod-connect", "--pod-udp"):
        from bench.connect import WARMUP, pod_connect

        ip, port, count = argv[1], int(argv[2]), int(argv[3])
        if argv[0] == "--pod-udp":
            out = pod_udp_connect(ip, port, count)
        else:
            out = pod_connect(ip, port, count, WARMUP, None)
        print(json.dumps(out), flush=True)
        return 0
    parser = argparse.ArgumentParser(
        description="The connect hook's own cost per run (kernel program statistics) and "
        "connect() p50 against the floor (not a test; always exits 0)."
    )
    parser.add_argument("--connects", type=int, default=2000, help="connect() calls per set")
    parser.add_argument("--rounds", type=int, default=4, help="sets per kind")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
