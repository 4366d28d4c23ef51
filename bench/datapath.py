"""PB-1: nanoseconds per packet of the tc and XDP service programs through
BPF_PROG_TEST_RUN, with 10 to 100k Services x 10 endpoints in the maps, each beside an
empty program of its own type (the floors).

Also the shared pieces of the eBPF benchmarks (connect.py, maps.py): synthetic NodeStates
of N ClusterIP Services, a bench network namespace, and the real EbpfDataplane loaded
into a fresh pin directory and removed again, also on failure or Ctrl-C.

Method. `BPF_PROG_TEST_RUN` with repeat > 1 runs the program again on the same skb,
which the program rewrote on the first run (the DNAT), so later runs would time a
different path. Every figure is therefore taken one call per run (repeat = 1), reading
the kernel's own duration of that run, for the program and for the floor alike, so both
carry the same per-call overhead (the kernel's clock reads around the run); the
difference is the program's own cost. Variants whose packet the program leaves alone
(miss) are also timed with repeat = N, as the published figures are. Calls of all
variants are interleaved in chunks so drift hits them alike.

XDP. The kernel runs an XDP test on the loopback device of the calling thread's network
namespace, so the measuring thread enters the bench namespace, where a link, a permanent
neighbour and routes to the backend and client ranges let the program's
`bpf_fib_lookup` succeed: the forward variants run the whole path (decision, DNAT + SNAT
rewrite, next hop, MAC rewrite) and end in XDP_REDIRECT, which a test run only returns (no
frame is sent anywhere). A flow's conntrack entry remembers its next hop for 100 ms
(lib/ext.h KBP_HOP_CACHE_NS), so the hot variants reuse it; new flows ask the FIB.
Frames to local backends and non-Services end in XDP_PASS.

    .venv/bin/python -m bench.datapath [--quick] [--services N ...] [--calls C]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import ipaddress
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.dataplane.ebpf import codec, inspect, libbpf
from agent.dataplane.ebpf import frames as P
from agent.dataplane.ebpf.dataplane import EbpfDataplane
from agent.dataplane.ebpf.external import DEFAULT_SNAT_PORTS
from agent.dataplane.ebpf.inspect import XDP_VERDICTS
from agent.dataplane.ebpf.maps import MapSizes
from agent.model.nodestate import (
    CLUSTER_IP,
    LOAD_BALANCER,
    NODE_PORT,
    Backend,
    Frontend,
    NodeInfo,
    NodeState,
    ServiceEntry,
    revision_of,
)
from bench import compile as compile_bench
from bench.compile import RESULTS, git_commit, mark

BPFFS = Path("/sys/fs/bpf")
BENCH_PREFIX = "kbp-bench-"
NO_INTERFACES = "kbpbench-none"  # a --pod-interfaces glob that matches nothing

# Synthetic address plan (no address is configured on an interface for PB-1 and maps.py;
# connect.py routes only the target Service's backend, inside its lab):
#   Service i      ClusterIP 10.96.0.10 + i (10.96.0.0/12), TCP port 80 → 8080
#   its backends   10.128.0.1 + i x E + j (10.128.0.0/9), port 8080, on node "node-b"
#   client         10.244.0.2, source ports from 1024 up
#   not a Service  10.244.9.9:80
# With external frontends (PB-1's XDP part; `external=True`):
#   Service i      also LoadBalancer VIP 198.18.0.0 + i, port 80 (198.18.0.0/15, RFC 2544's
#                  benchmarking range: 131,072 VIPs, one per Service up to 100k and beyond),
#                  and, for i < 2768 only, NodePort 192.0.2.10:30000 + i: a node has
#                  one port per NodePort Service in 30000-32767, so like a real cluster
#                  only 2768 Services can have one (i % 2768 would collide)
#   node address   192.0.2.10 (NodeInfo; kbp_config's SNAT source), SNAT ports 61000-65535
#   local Service  one more Service, index N, whose backends are on this node ("node-a")
#   outside client 203.0.113.7, source ports from 1024 up
#   not a Service  192.0.2.10:22 (the node's own SSH port)
#   next hop       198.51.100.1 (02:00:00:00:00:01) on a veth link in the bench
#                  namespace, the route to 10.128.0.0/9 and 203.0.113.0/24
CLUSTER_IP_BASE = int(ipaddress.IPv4Address("10.96.0.10"))
BACKEND_BASE = int(ipaddress.IPv4Address("10.128.0.1"))
FRONTEND_PORT, BACKEND_PORT = 80, 8080
CLIENT = "10.244.0.2"
NOT_A_SERVICE = "10.244.9.9"
FRAME_BYTES = 64  # a minimum-size Ethernet frame: the 54-byte SYN and trailer padding
TC_ACT_OK = 0
NODE_ADDRESS = "192.0.2.10"
LB_VIP_BASE = int(ipaddress.IPv4Address("198.18.0.0"))
NODE_PORT_BASE, NODE_PORTS = 30000, 2768  # the default NodePort range, 30000-32767
EXTERNAL_CLIENT = "203.0.113.7"
NODE_OWN_PORT = 22
NEXT_HOP, NEXT_HOP_MAC = "198.51.100.1", "02:00:00:00:00:01"
FIB_LINK = "kbpbench0"  # the link in the bench namespace the routes point at
XDP_PASS, XDP_TX, XDP_REDIRECT = 2, 3, 4
CLONE_NEWNET = 0x40000000

# Targets and anchors (bench/README.md, PB-1).
TARGET_HOT_NET_NS = 60  # hot ≤ floor + 60 ns
TARGET_MISS_NET_NS = 40  # miss ≤ floor + 40 ns
TARGET_SPREAD_GROWTH = 2.0  # spread at 100k ≤ 2 x spread at 10
REF_PB1 = "Katran's whole XDP LB 101-119 ns/pkt (same method); a BPF hash lookup 20-32 ns"

_names = itertools.count()


# --- shared: synthetic NodeStates --------------------------------------------------------


def ipv4(value: int) -> str:
    return str(ipaddress.IPv4Address(value))


def cluster_ip_of(i: int) -> str:
    return ipv4(CLUSTER_IP_BASE + i)


def backend_ip_of(i: int, j: int, endpoints: int) -> str:
    return ipv4(BACKEND_BASE + i * endpoints + j)


def lb_vip_of(i: int) -> str:
    return ipv4(LB_VIP_BASE + i)


def external_frontends(i: int) -> tuple[Frontend, ...]:
    """Service i's LoadBalancer VIP, and its NodePort when i < NODE_PORTS."""
    vip = (Frontend(LOAD_BALANCER, lb_vip_of(i), FRONTEND_PORT),)
    if i >= NODE_PORTS:
        return vip
    return (Frontend(NODE_PORT, NODE_ADDRESS, NODE_PORT_BASE + i), *vip)


def service_entry(
    name: str,
    cluster_ip: str,
    backends: Sequence[tuple[str, int]],
    *,
    local: bool = False,
    external: Sequence[Frontend] = (),
) -> ServiceEntry:
    """A ClusterIP entry (TCP 80) with ready backends, as compile() would emit it, plus the
    `external` frontends (NodePort, LoadBalancer) given."""
    members = tuple(
        Backend(ip, port, "node-a" if local else "node-b", None, None, local, True, True, False)
        for ip, port in backends
    )
    return ServiceEntry(
        namespace="bench",
        name=name,
        port="http",
        protocol="TCP",
        ip_family="IPv4",
        frontends=(Frontend(CLUSTER_IP, cluster_ip, FRONTEND_PORT), *external),
        affinity_timeout=None,
        internal_traffic_policy="Cluster",
        external_traffic_policy="Cluster",
        health_check_node_port=None,
        topology="None",
        has_endpoints=True,
        cluster_backends=members,
        local_backends=None,
    ).sealed()


def synthetic_entries(
    count: int, endpoints: int, first: int = 0, *, external: bool = False
) -> list[ServiceEntry]:
    """Services first..first+count-1 (named svc-NNNNNN, so they sort in index order), with
    external frontends (see the address plan) when `external`."""
    return [
        service_entry(
            f"svc-{i:06d}",
            cluster_ip_of(i),
            [(backend_ip_of(i, j, endpoints), BACKEND_PORT) for j in range(endpoints)],
            external=external_frontends(i) if external else (),
        )
        for i in range(first, first + count)
    ]


def local_entry(i: int, endpoints: int) -> ServiceEntry:
    """Service i with external frontends and every backend on this node."""
    return service_entry(
        f"svc-{i:06d}-local",
        cluster_ip_of(i),
        [(backend_ip_of(i, j, endpoints), BACKEND_PORT) for j in range(endpoints)],
        local=True,
        external=external_frontends(i),
    )


def nodestate_of(entries: Iterable[ServiceEntry]) -> NodeState:
    ordered = tuple(sorted(entries, key=lambda e: e.sort_key))
    node = NodeInfo("node-a", None, {}, (NODE_ADDRESS,))
    return NodeState(node, revision_of(e.digest for e in ordered), ordered)


def _pow2_at_least(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, n))))


def map_sizes_for(
    services: int, endpoints: int, ct: int = 262144, frontends: int | None = None
) -> MapSizes:
    """Maps sized for N Services x E endpoints with a little headroom (powers of two):
    100k x 10 gets 131,072 frontends and 1,048,576 slots and backends. `frontends`: when
    Services have more than their ClusterIP."""
    return MapSizes(
        services=_pow2_at_least(max(1024, (frontends or services) * 1.2 + 16)),
        slots=_pow2_at_least(max(4096, services * endpoints * 1.02 + 64)),
        backends=_pow2_at_least(max(4096, services * endpoints * 1.02 + 64)),
        ct=ct,
        affinity=1024,
    )


# --- shared: namespaces, pins, the dataplane ---------------------------------------------


def remove_orphans() -> list[str]:
    """Remove the namespaces and pin directories of bench runs whose process is gone.
    `finally` cannot run when a process dies outright: LLVM ends the process when bcc's
    compile fails a backend check (the BPF stack limit, say), and so does SIGKILL."""
    pattern = re.compile(rf"^{re.escape(BENCH_PREFIX)}(?:pb3-)?(\d+)-")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir("/run/netns"):
            m = pattern.match(name)
            if m and not _alive(int(m.group(1))):
                subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)
                removed.append(name)
    for path in BPFFS.iterdir():
        m = pattern.match(path.name)
        if m and not _alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def bench_netns() -> Iterator[str]:
    """An empty network namespace of this run, for the dataplane's netlink side: nothing
    is attached to any interface of the machine's own namespace. Orphans of dead runs
    go first (remove_orphans)."""
    for name in remove_orphans():
        print(f"  removed {name}, left by a bench run that died", file=sys.stderr)
    name = f"{BENCH_PREFIX}{os.getpid()}-{next(_names)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)


def route_external_ranges(netns: str) -> None:
    """In the bench namespace only: forwarding on, and the backend and outside-client ranges
    routed via a permanent neighbour on a link of its own, so that the XDP program's FIB lookups
    succeed as on a node. The link has no address, so the dataplane never takes it for an
    external interface; it goes away with the namespace."""

    def ip(*args: str) -> None:
        subprocess.run(["ip", "-n", netns, *args], check=True, capture_output=True)

    ip("link", "set", "lo", "up")
    # A veth pair with both ends here (this kernel has no dummy driver): up, with a carrier.
    ip("link", "add", FIB_LINK, "type", "veth", "peer", "name", f"{FIB_LINK}p")
    ip("link", "set", f"{FIB_LINK}p", "up")
    ip("link", "set", FIB_LINK, "address", "02:00:00:00:00:02", "up")
    ip("neigh", "add", NEXT_HOP, "lladdr", NEXT_HOP_MAC, "dev", FIB_LINK, "nud", "permanent")
    for net in ("10.128.0.0/9", "203.0.113.0/24"):
        ip("route", "add", net, "via", NEXT_HOP, "dev", FIB_LINK, "onlink")
    subprocess.run(
        ["nsenter", f"--net=/run/netns/{netns}", "sysctl", "-qw", "net.ipv4.conf.all.forwarding=1"],
        check=True,
        capture_output=True,
    )


@contextlib.contextmanager
def inside_netns(netns: str) -> Iterator[None]:
    """This thread (only) in the bench namespace, and back on exit: test runs use the
    loopback device of the caller's namespace, and XDP's FIB lookups its routes."""
    libc = ctypes.CDLL(None, use_errno=True)

    def enter(fd: int, where: str) -> None:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"setns into {where}: {os.strerror(code)}")

    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            enter(target, netns)
        finally:
            os.close(target)
        try:
            yield
        finally:
            enter(home, "the original network namespace")
    finally:
        os.close(home)


@contextlib.contextmanager
def bench_dataplane(
    sizes: MapSizes,
    netns: str,
    pod_interfaces: Sequence[str] = (NO_INTERFACES,),
    cgroup: Path | None = None,
) -> Iterator[EbpfDataplane]:
    """The real EbpfDataplane (compiled with bcc) on a fresh pin directory, its socket
    hooks on `cgroup` when one is given (--socket-lb all); detached, unpinned and removed
    on exit."""
    pin_dir = BPFFS / f"{BENCH_PREFIX}{os.getpid()}-{next(_names)}"
    dataplane: EbpfDataplane | None = None
    try:
        dataplane = EbpfDataplane(pin_dir, list(pod_interfaces), sizes, netns=netns, watch=False,
                                  cgroup=cgroup)  # fmt: skip
        yield dataplane
    finally:
        if dataplane is not None:
            dataplane.cleanup()
        shutil.rmtree(pin_dir, ignore_errors=True)


def terminate_as_interrupt() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` removes what it made. bench.compile's
    GC clock (a gc.callbacks hook, registered on import) is removed: an exception raised
    while a gc callback runs is printed and dropped, so a signal landing there was lost."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):
        gc.callbacks.remove(compile_bench.GC._callback)
    signal.signal(signal.SIGTERM, handler)


def leftovers() -> list[str]:
    """Namespaces and pin directories of this process still present (should be none)."""
    prefix = f"{BENCH_PREFIX}{os.getpid()}-"
    found = [p.name for p in BPFFS.iterdir() if p.name.startswith(prefix)]
    with contextlib.suppress(FileNotFoundError):
        found += [n for n in os.listdir("/run/netns") if n.startswith(prefix)]
    return found


# --- shared: figures ---------------------------------------------------------------------


@dataclass
class Summary:
    """Samples in one unit (ns here, seconds or µs elsewhere): median, nearest-rank p99
    (the maximum below 100 samples), min-max, mean."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def p99(self) -> float:
        ordered = sorted(self.samples)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    def to_json(self) -> dict[str, float]:
        return {
            "median": self.median,
            "p99": self.p99,
            "min": min(self.samples),
            "max": max(self.samples),
            "mean": self.mean,
            "n": len(self.samples),
        }


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "kernel": os.uname().release,
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "commit": git_commit(),
    }


def header(name: str, info: dict[str, Any], extra: str = "") -> None:
    print(
        f"{name}: kernel {info['kernel']}, {info['cpus']} CPUs ({info['cpu_model']}), "
        f"Python {info['python']}, commit {info['commit']}, load average "
        f"{info['load_average_at_start'][0]}{extra}",
        flush=True,
    )


def write_results(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


# --- PB-1 ----------------------------------------------------------------------------------


def frame(dst: str, sport: int, flags: str = "S", src: str = CLIENT, dport: int = 80) -> bytes:
    raw = P.tcp_frame(src, dst, sport, dport, flags=flags)
    return raw + bytes(FRAME_BYTES - len(raw))


@dataclass
class Variant:
    name: str
    what: str
    fd: int
    frames: list[bytes]  # one per call (cycled when shorter)
    samples: list[float] = field(default_factory=list)

    def run(self, start: int, count: int) -> None:
        frames, n = self.frames, len(self.frames)
        for k in range(start, start + count):
            self.samples.append(libbpf.prog_test_run(self.fd, frames[k % n]).duration_ns)


def interleave(variants: Sequence[Variant], calls: int, chunk: int = 250) -> None:
    """`calls` single runs of every variant, in chunks taken in turn."""
    for start in range(0, calls, chunk):
        for variant in variants:
            variant.run(start, min(chunk, calls - start))


def repeated(fds: dict[str, tuple[int, bytes]], repeat: int, rounds: int) -> dict[str, Summary]:
    """Kernel average per run of repeat=N calls, `rounds` of each, in turn."""
    out: dict[str, list[float]] = {name: [] for name in fds}
    for _ in range(rounds):
        for name, (fd, data) in fds.items():
            out[name].append(libbpf.prog_test_run(fd, data, repeat=repeat).duration_ns)
    return {name: Summary(samples) for name, samples in out.items()}


# The floor and two calibration programs, compiled by bcc like ours: an empty classifier,
# and one lookup / one update of a 40-byte key (the size of struct kbp_ct_key) taken from
# the frame, in an LRU hash of the conntrack's size: what one map operation costs here.
CALIBRATION_C = """
struct kbp_bench_key { u32 word[10]; };
BPF_TABLE("lru_hash", struct kbp_bench_key, struct kbp_bench_key, kbp_bench_lru, KBP_BENCH_SIZE);

static __always_inline int kbp_bench_key_of(struct __sk_buff *skb, struct kbp_bench_key *key)
{
        void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;

        if (data + 14 + sizeof(*key) > end)
                return -1;
        __builtin_memcpy(key, data + 14, sizeof(*key));
        return 0;
}

int kbp_bench_empty(struct __sk_buff *skb) { return 0; }

int kbp_bench_xdp_empty(struct xdp_md *ctx) { return XDP_PASS; }

int kbp_bench_lookup(struct __sk_buff *skb)
{
        struct kbp_bench_key key = {};

        if (kbp_bench_key_of(skb, &key) == 0 && kbp_bench_lru.lookup(&key))
                return 0;
        return 0;
}

int kbp_bench_update(struct __sk_buff *skb)
{
        struct kbp_bench_key key = {};

        if (kbp_bench_key_of(skb, &key) == 0)
                kbp_bench_lru.update(&key, &key);
        return 0;
}
"""
CALIBRATION_PROGRAMS = ("kbp_bench_empty", "kbp_bench_lookup", "kbp_bench_update")


@contextlib.contextmanager
def calibration_programs(map_size: int) -> Iterator[dict[str, int]]:
    """fds of the floor and calibration programs (the bench's own, so agent/ keeps its one
    bcc import in kernel.py)."""
    from bcc import BPF

    module = BPF(text=CALIBRATION_C.encode(), cflags=[f"-DKBP_BENCH_SIZE={map_size}"])
    try:
        fds = {name: module.load_func(name.encode(), BPF.SCHED_CLS).fd
               for name in CALIBRATION_PROGRAMS}  # fmt: skip
        fds["kbp_bench_xdp_empty"] = module.load_func(b"kbp_bench_xdp_empty", BPF.XDP).fd
        yield fds
    finally:
        module.cleanup()


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"sanity check failed: {what}")


@dataclass
class XdpFrames:
    hot: bytes  # SYN from outside to a VIP with remote backends (conntrack made)
    ack: bytes  # the hot flow's ACK
    local: bytes  # SYN from outside to the local Service's VIP (conntrack made)
    miss: bytes  # SYN to the node's own port 22
    reply: bytes  # the hot flow's backend answering the SNAT address and port


def xdp_frames(
    xdp: int, pin_dir: Path, services: int, hot: int, hot_backends: set[str]
) -> XdpFrames:
    """The XDP variants' frames, each run once to check it takes the path it is named for
    (the first run of the hot and local SYNs creates their conntrack entries, so the
    measured runs are conntrack hits)."""
    hot_vip = lb_vip_of(hot)
    hot_syn = frame(hot_vip, 40000, src=EXTERNAL_CLIENT)
    first = libbpf.prog_test_run(xdp, hot_syn)
    seen = P.parse(first.data_out)
    snat_low, snat_high = DEFAULT_SNAT_PORTS
    expect(
        first.retval == XDP_REDIRECT
        and seen.dst in hot_backends
        and seen.dport == BACKEND_PORT
        and seen.src == NODE_ADDRESS
        and snat_low <= seen.sport <= snat_high
        and seen.eth_dst == bytes.fromhex(NEXT_HOP_MAC.replace(":", "")),
        f"XDP: SYN to {hot_vip}:80 came out as {seen.src}:{seen.sport} → {seen.dst}:"
        f"{seen.dport} ({first.retval})",
    )
    again = libbpf.prog_test_run(xdp, hot_syn)
    expect(again.retval == XDP_REDIRECT and again.data_out == first.data_out,
           "XDP: the same SYN again took another path")  # fmt: skip
    hot_ack = frame(hot_vip, 40000, flags="A", src=EXTERNAL_CLIENT)
    acked = libbpf.prog_test_run(xdp, hot_ack)
    expect(acked.retval == XDP_REDIRECT and P.parse(acked.data_out).sport == seen.sport,
           "XDP: the hot flow's ACK took another path")  # fmt: skip
    reply = frame(NODE_ADDRESS, BACKEND_PORT, flags="SA", src=seen.dst, dport=seen.sport)
    back = libbpf.prog_test_run(xdp, reply)
    seen = P.parse(back.data_out)
    expect(
        back.retval == XDP_REDIRECT
        and (seen.src, seen.sport, seen.dst, seen.dport)
        == (hot_vip, FRONTEND_PORT, EXTERNAL_CLIENT, 40000),
        f"XDP: reply left as {seen.src}:{seen.sport} → {seen.dst}:{seen.dport} ({back.retval})",
    )
    local = frame(lb_vip_of(services), 40001, src=EXTERNAL_CLIENT)
    for _ in range(2):
        out = libbpf.prog_test_run(xdp, local)
        expect(out.retval == XDP_PASS and out.data_out[: len(local)] == local, "XDP: local")
    client = f"{EXTERNAL_CLIENT}:40001"
    flows = [r["translation"] for r in inspect.conntrack(pin_dir)
             if r["direction"] == "forward" and r["source"] == client]  # fmt: skip
    expect(len(flows) == 1 and "source" not in flows[0], f"XDP: local flow's conntrack {flows}")
    miss = frame(NODE_ADDRESS, 65003, src=EXTERNAL_CLIENT, dport=NODE_OWN_PORT)
    out = libbpf.prog_test_run(xdp, miss)
    expect(out.retval == XDP_PASS and out.data_out[: len(miss)] == miss, "XDP: miss")
    return XdpFrames(hot_syn, hot_ack, local, miss, reply)


@dataclass
class SizeResult:
    services: int
    endpoints: int
    sizes: MapSizes
    load_seconds: float
    apply_seconds: float
    single: dict[str, Summary]  # variant → per-call kernel durations (repeat=1), ns
    repeated: dict[str, Summary]  # floor/miss → per-run average of repeat=N calls, ns
    repeat: int
    xdp_verdicts: dict[str, int]  # kbp_xdp_stats packets per verdict after the run


def measure_size(
    services: int,
    endpoints: int,
    calls: int,
    repeat: int,
    rounds: int,
    netns: str,
    calibration: dict[str, int],
) -> SizeResult:
    # Every Service has a ClusterIP and a VIP, the first 2768 a NodePort; plus the local one.
    frontends = 2 * (services + 1) + min(services + 1, NODE_PORTS)
    sizes = map_sizes_for(services + 1, endpoints, frontends=frontends)
    print(f"\n# {services} Services x {endpoints} endpoints: maps {sizes}", flush=True)
    began = time.perf_counter()
    entries = synthetic_entries(services, endpoints, external=True)
    entries.append(local_entry(services, endpoints))
    state = nodestate_of(entries)
    print(f"  NodeState built in {time.perf_counter() - began:.1f} s", flush=True)
    with bench_dataplane(sizes, netns) as dp, inside_netns(netns):
        load_seconds = time.perf_counter() - began
        started = time.perf_counter()
        writes = dp.apply(state)
        apply_seconds = time.perf_counter() - started
        print(f"  applied {writes} map writes in {apply_seconds:.1f} s", flush=True)
        xdp = dp.programs.fd("kbp_xdp_ext")
        from_pod = dp.programs.fd("kbp_from_pod")
        to_pod = dp.programs.fd("kbp_to_pod")
        rng = random.Random(services)
        hot = services // 2
        hot_ip = cluster_ip_of(hot)
        hot_backends = {backend_ip_of(hot, j, endpoints) for j in range(endpoints)}

        # Sanity: the paths really are the ones named (a DNAT to the Service's backend,
        # an untouched miss, a reverse NAT back to the ClusterIP).
        out = libbpf.prog_test_run(from_pod, frame(hot_ip, 65000))
        seen = P.parse(out.data_out)
        expect(
            out.retval == TC_ACT_OK and seen.dst in hot_backends and seen.dport == BACKEND_PORT,
            f"SYN to {hot_ip}:80 came out as {seen.dst}:{seen.dport} ({out.retval})",
        )
        established = frame(hot_ip, 65001)
        out = libbpf.prog_test_run(from_pod, established)
        backend = P.parse(out.data_out).dst
        ack = frame(hot_ip, 65001, flags="A")
        seen = P.parse(libbpf.prog_test_run(from_pod, ack).data_out)
        expect(seen.dst == backend, f"established ACK went to {seen.dst}, not {backend}")
        reply = frame(CLIENT, 8080, flags="SA", src=backend, dport=65001)
        seen = P.parse(libbpf.prog_test_run(to_pod, reply).data_out)
        expect(seen.src == hot_ip and seen.sport == 80, f"reply left as {seen.src}:{seen.sport}")
        miss = frame(NOT_A_SERVICE, 65002)
        expect(libbpf.prog_test_run(from_pod, miss).data_out[: len(miss)] == miss, "miss changed")
        x = xdp_frames(xdp, dp.pin_dir, services, hot, hot_backends)

        floor_fd, xdp_floor_fd = calibration["kbp_bench_empty"], calibration["kbp_bench_xdp_empty"]
        expect(libbpf.prog_test_run(xdp_floor_fd, x.hot).retval == XDP_PASS, "XDP floor")
        lookup_fd, update_fd = calibration["kbp_bench_lookup"], calibration["kbp_bench_update"]
        libbpf.prog_test_run(update_fd, established)  # the key the lookups find

        sports = itertools.cycle(range(1024, 65000))
        new_flows = [frame(hot_ip, next(sports)) for _ in range(calls)]
        spread = [frame(cluster_ip_of(rng.randrange(services)), next(sports)) for _ in range(calls)]
        ext_sports = itertools.cycle(range(1024, 65000))
        xdp_spread = [
            frame(lb_vip_of(rng.randrange(services)), next(ext_sports), src=EXTERNAL_CLIENT)
            for _ in range(calls)
        ]
        variants = [
            Variant("floor", "empty tc program, the same SYN", floor_fd, [established]),
            Variant("hot_new", "SYN to one frontend, new source port each call", from_pod,
                    new_flows),
            Variant("hot_same_syn", "the same SYN again (conntrack hit, kept backend)",
                    from_pod, [established]),
            Variant("hot_established", "ACK of an open flow (conntrack hit)", from_pod, [ack]),
            Variant("spread", "SYN to a random Service each call, new flow", from_pod, spread),
            Variant("miss", "SYN to a non-service address (passes)", from_pod, [miss]),
            Variant("reply", "to_pod: backend's SYN-ACK (reverse NAT)", to_pod, [reply]),
            Variant("lookup", "calibration: one LRU lookup", lookup_fd, [established]),
            Variant("update", "calibration: one LRU update", update_fd, [established]),
            Variant("insert", "calibration: one LRU insert", update_fd, new_flows),
            Variant("xdp_floor", "empty XDP program, the same SYN", xdp_floor_fd, [x.hot]),
            Variant("xdp_hot_fwd", "XDP: the same SYN to a VIP, remote backends (CT hit, "
                    "DNAT+SNAT, next hop reused, REDIRECT)", xdp, [x.hot]),
            Variant("xdp_hot_fwd_ack", "XDP: the hot flow's ACK (CT hit, DNAT+SNAT, next hop "
                    "reused, REDIRECT)", xdp, [x.ack]),
            Variant("xdp_hot_local", "XDP: the same SYN to a VIP, local backends (CT hit, "
                    "PASS)", xdp, [x.local]),
            Variant("xdp_spread", "XDP: SYN to a random Service's VIP, new flow (CT+SNAT "
                    "insert, FIB, REDIRECT)", xdp, xdp_spread),
            Variant("xdp_miss", "XDP: SYN to the node's port 22 (PASS)", xdp, [x.miss]),
            Variant("xdp_reply", "XDP: backend's SYN-ACK to the SNAT port (reverse, "
                    "REDIRECT)", xdp, [x.reply]),
        ]  # fmt: skip
        interleave(variants, calls)
        rep = repeated(
            {
                "floor": (floor_fd, miss),
                "miss": (from_pod, miss),
                "lookup": (lookup_fd, established),
                "update": (update_fd, established),
                # XDP leaves these frames as they came (PASS), so reruns see the same one.
                "xdp_floor": (xdp_floor_fd, x.miss),
                "xdp_miss": (xdp, x.miss),
                "xdp_hot_local": (xdp, x.local),
            },
            repeat,
            rounds,
        )
        verdicts = codec.percpu_sums(dp.programs.map("kbp_xdp_stats"), "kbp_drop_counters")
        xdp_verdicts = {XDP_VERDICTS.get(i, str(i)): sums[0] for i, sums in verdicts.items()}
    return SizeResult(
        services,
        endpoints,
        sizes,
        load_seconds,
        apply_seconds,
        {v.name: Summary(v.samples) for v in variants},
        rep,
        repeat,
        xdp_verdicts,
    )


VARIANT_TEXT = {
    "floor": "floor: empty tc program",
    "hot_new": "hot, new flow (new source port each call)",
    "hot_same_syn": "hot, same SYN again (CT hit)",
    "hot_established": "hot, established (ACK, CT hit)",
    "spread": "spread: random Service, new flow",
    "miss": "miss: not a Service",
    "reply": "reply, to_pod (reverse NAT)",
    "lookup": "calibration: 1 LRU-hash lookup, 40 B key, hit",
    "update": "calibration: 1 LRU-hash update, existing key",
    "insert": "calibration: 1 LRU-hash insert, new key",
    "xdp_floor": "XDP floor: empty XDP program",
    "xdp_hot_fwd": "XDP hot, remote backend: same SYN (CT hit)",
    "xdp_hot_fwd_ack": "XDP hot, remote backend: ACK (CT hit)",
    "xdp_hot_local": "XDP hot, local backend: same SYN (CT hit)",
    "xdp_spread": "XDP spread: random VIP, new flow",
    "xdp_miss": "XDP miss: node's own port 22",
    "xdp_reply": "XDP reply of a SNATed flow (reverse)",
}
# What each XDP variant's packet does in kbp_xdp_ext (printed under the table).
XDP_PATHS = {
    "xdp_hot_fwd": "conntrack hit (and the backend still current: a SYN) → DNAT + SNAT "
    "rewrite, the next hop the flow's conntrack entry remembers (the FIB's, asked at most "
    "every 100 ms per flow), MACs → XDP_REDIRECT",
    "xdp_hot_fwd_ack": "as xdp_hot_fwd, without the backend check (an established segment)",
    "xdp_hot_local": "conntrack hit → decided LOCAL, frame untouched → XDP_PASS (tc rewrites)",
    "xdp_spread": "new flow: backend selection, SNAT port claim (2 conntrack inserts), "
    "rewrite, FIB lookup → XDP_REDIRECT",
    "xdp_miss": "no lookup: no frontend uses port 22 (kbp_ports) and it is outside the SNAT "
    "range → XDP_PASS",
    "xdp_reply": "SNAT-reply hit → reverse rewrite, remembered next hop → XDP_REDIRECT",
}
REPEAT_TEXT = {
    "floor": "floor",
    "miss": "miss",
    "lookup": "1 LRU lookup",
    "update": "1 LRU update",
    "xdp_floor": "XDP floor",
    "xdp_miss": "XDP miss",
    "xdp_hot_local": "XDP hot local",
}
VARIANT_TARGET = {
    "hot_new": TARGET_HOT_NET_NS,
    "hot_same_syn": TARGET_HOT_NET_NS,
    "hot_established": TARGET_HOT_NET_NS,
    "miss": TARGET_MISS_NET_NS,
    "xdp_hot_fwd": TARGET_HOT_NET_NS,
    "xdp_hot_fwd_ack": TARGET_HOT_NET_NS,
    "xdp_hot_local": TARGET_HOT_NET_NS,
    "xdp_miss": TARGET_MISS_NET_NS,
}


def floor_of(name: str) -> str:
    """The empty program of the variant's program type."""
    return "xdp_floor" if name.startswith("xdp_") else "floor"


def print_size(r: SizeResult) -> dict[str, Any]:
    print(
        f"\n## {r.services} Services x {r.endpoints} endpoints (maps: {r.sizes.services} "
        f"frontends, {r.sizes.slots} slots, {r.sizes.backends} backends)"
    )
    head = (
        f"{'variant (repeat=1 per call)':<44} {'median':>7} {'p99':>7} {'min-max':>13} "
        f"{'mean':>7} {'n':>6}  {'- floor':>8}  {'target':<16} {'':4}"
    )
    print(head)
    print("-" * len(head))
    marks: dict[str, Any] = {}
    for name, s in r.single.items():
        net = s.median - r.single[floor_of(name)].median
        target = VARIANT_TARGET.get(name)
        target_text = f"≤ floor + {target} ns" if target is not None else ""
        ok = mark(net <= target) if target is not None else ""
        if target is not None:
            marks[name] = {"net_ns": net, "target_net_ns": target, "mark": ok}
        net_text = "" if name == floor_of(name) else f"{net:+.0f} ns"
        spread_text = f"{min(s.samples):.0f}-{max(s.samples):.0f}"
        print(
            f"{VARIANT_TEXT[name]:<44} {s.median:>7.0f} {s.p99:>7.0f} {spread_text:>13} "
            f"{s.mean:>7.1f} {len(s.samples):>6}  {net_text:>8}  {target_text:<16} {ok:4}"
        )
    for name, s in r.repeated.items():
        net = s.median - r.repeated[floor_of(name)].median
        target = VARIANT_TARGET.get(name)
        ok = mark(net <= target) if target is not None else ""
        if target is not None:
            marks[f"{name}_repeat"] = {"net_ns": net, "target_net_ns": target, "mark": ok}
        label = f"{REPEAT_TEXT[name]}, repeat={r.repeat} (kernel average)"
        print(
            f"{label:<44} {s.median:>7.0f} {s.p99:>7.0f} "
            f"{f'{min(s.samples):.0f}-{max(s.samples):.0f}':>13} {s.mean:>7.1f} "
            f"{len(s.samples):>6}  {('' if name == floor_of(name) else f'{net:+.0f} ns'):>8}  "
            f"{(f'≤ floor + {target} ns' if target is not None else ''):<16} {ok:4}"
        )
    print(f"(ns per packet; kernel-reported; maps filled in {r.apply_seconds:.1f} s; tc "
          f"variants are net of the tc floor, XDP ones of the XDP floor)")  # fmt: skip
    for name, path in XDP_PATHS.items():
        print(f"  {name}: {path}")
    print("  kbp_xdp_stats after the run: "
          + ", ".join(f"{k} {v}" for k, v in sorted(r.xdp_verdicts.items()) if v))  # fmt: skip
    return marks


def spread_growth(results: list[SizeResult], prefix: str = "") -> dict[str, Any] | None:
    """Spread at the largest N over spread at the smallest, raw and net of the floor
    (`prefix` "xdp_": of the XDP program)."""
    if len(results) < 2:
        return None
    small, large = results[0], results[-1]
    spread, floor = f"{prefix}spread", f"{prefix}floor"

    def net(r: SizeResult) -> float:
        return r.single[spread].median - r.single[floor].median

    raw = large.single[spread].median / small.single[spread].median
    net_ratio = net(large) / net(small) if net(small) > 0 else math.inf
    return {
        "from": small.services,
        "to": large.services,
        "raw_ratio": raw,
        "net_ratio": net_ratio,
        "target": TARGET_SPREAD_GROWTH,
        "mark": mark(raw <= TARGET_SPREAD_GROWTH),
        "net_mark": mark(net_ratio <= TARGET_SPREAD_GROWTH),
    }


def run_against(
    checkout: Path, services: int, endpoints: int, calls: int, repeat: int
) -> dict[str, float]:
    """The other checkout's bench/datapath.py for one size, run right after ours (its own
    programs and agent, this interpreter): its medians net of the floor, by variant."""
    out = RESULTS / f"datapath-against-{checkout.name}-{services}.json"
    argv = [
        sys.executable,
        "-m",
        "bench.datapath",
        "--services",
        str(services),
        "--endpoints",
        str(endpoints),
        "--calls",
        str(calls),
        "--repeat",
        str(repeat),
        "--json",
        str(out),
    ]
    print(f"\n# the same size with {checkout}'s programs", flush=True)
    subprocess.run(argv, cwd=checkout, check=True, stdout=subprocess.DEVNULL)
    single = json.loads(out.read_text())["sizes"][0]["single_ns"]
    return {k: v["median"] - single[floor_of(k)]["median"] for k, v in single.items()}


def print_against(
    results: list[SizeResult], against: dict[str, dict[int, dict[str, float]]]
) -> None:
    """Net medians of this tree and each other checkout, side by side."""
    names = list(against)
    print("\n## ns over the floor: this tree | " + " | ".join(names))
    for r in results:
        if not all(r.services in against[c] for c in names):
            continue
        theirs = [against[c][r.services] for c in names]
        print(f"{r.services} Services")
        for name in r.single:
            if name == floor_of(name) or any(name not in t for t in theirs):
                continue
            ours = r.single[name].median - r.single[floor_of(name)].median
            others = " | ".join(f"{t[name]:>+8.0f}" for t in theirs)
            print(f"  {VARIANT_TEXT[name]:<44} {ours:>+8.0f} | {others}")
        for label, spread, ack in (("tc", "spread", "hot_established"),
                                   ("XDP", "xdp_spread", "xdp_hot_fwd_ack")):  # fmt: skip
            ours = (r.single[spread].median - r.single[floor_of(spread)].median) / max(
                r.single[ack].median - r.single[floor_of(ack)].median, 1
            )
            others = " | ".join(f"{t[spread] / max(t[ack], 1):.1f}" for t in theirs)
            print(f"  {label} spread / established: {ours:.1f} | {others}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PB-1: ns/packet of the tc and XDP service programs via BPF_PROG_TEST_RUN "
        "(not a test; always exits 0)."
    )
    parser.add_argument("--quick", action="store_true", help="10 and 10k Services, < 1 minute")
    parser.add_argument("--services", type=int, nargs="+", metavar="N",
                        help="sizes (default 10 1000 10000 100000)")  # fmt: skip
    parser.add_argument("--endpoints", type=int, default=10, metavar="E")
    parser.add_argument("--calls", type=int, help="single runs per variant and size")
    parser.add_argument("--repeat", type=int, default=10000, help="N of the repeat=N figures")
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    parser.add_argument("--against", type=Path, metavar="CHECKOUT", action="append",
                        help="another checkout (e.g. main's, `git archive main`): after each "
                        "size, run its bench/datapath.py for the same size and print both "
                        "side by side")  # fmt: skip
    args = parser.parse_args(argv)
    sizes = args.services or ([10, 10_000] if args.quick else [10, 1000, 10_000, 100_000])
    calls = args.calls or (10000 if args.quick else 40000)
    rounds = 10 if args.quick else 30

    terminate_as_interrupt()
    info = machine()
    header("bench/datapath.py (PB-1)", info, f"; {calls} calls per variant")
    began = time.perf_counter()
    results: list[SizeResult] = []
    report: list[dict[str, Any]] = []
    # checkout → size → its net medians by variant
    against: dict[str, dict[int, dict[str, float]]] = {}
    try:
        with bench_netns() as netns, calibration_programs(262144) as calibration:
            route_external_ranges(netns)
            for n in sizes:
                r = measure_size(n, args.endpoints, calls, args.repeat, rounds, netns, calibration)
                results.append(r)
                marks = print_size(r)
                for checkout in args.against or ():
                    against.setdefault(str(checkout), {})[n] = run_against(
                        checkout, n, args.endpoints, calls, args.repeat
                    )
                report.append({
                    "services": r.services,
                    "endpoints_per_service": r.endpoints,
                    "map_sizes": dataclasses.asdict(r.sizes),
                    "apply_seconds": r.apply_seconds,
                    "repeat": r.repeat,
                    "single_ns": {k: s.to_json() for k, s in r.single.items()},
                    "repeated_ns": {k: s.to_json() for k, s in r.repeated.items()},
                    "xdp_verdicts": r.xdp_verdicts,
                    "targets": marks,
                })  # fmt: skip
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers() or 'nothing'})")
        return 130
    growth = spread_growth(results)
    xdp_growth = spread_growth(results, "xdp_")
    print(f"\n## targets (bench/README.md PB-1); anchors: {REF_PB1}")
    for r, entry in zip(results, report, strict=True):
        t = entry["targets"]
        print(
            f"{r.services:>7} Services: hot new {t['hot_new']['net_ns']:+.0f} ns "
            f"{t['hot_new']['mark']}, same SYN {t['hot_same_syn']['net_ns']:+.0f} ns "
            f"{t['hot_same_syn']['mark']}, established {t['hot_established']['net_ns']:+.0f} ns "
            f"{t['hot_established']['mark']} (≤ +{TARGET_HOT_NET_NS}); miss "
            f"{t['miss']['net_ns']:+.0f} ns {t['miss']['mark']}, repeat=N "
            f"{t['miss_repeat']['net_ns']:+.0f} ns {t['miss_repeat']['mark']} "
            f"(≤ +{TARGET_MISS_NET_NS})"
        )
        print(
            f"{'XDP':>16}: hot remote {t['xdp_hot_fwd']['net_ns']:+.0f} ns "
            f"{t['xdp_hot_fwd']['mark']}, hot local {t['xdp_hot_local']['net_ns']:+.0f} ns "
            f"{t['xdp_hot_local']['mark']} (repeat=N {t['xdp_hot_local_repeat']['net_ns']:+.0f}"
            f" ns {t['xdp_hot_local_repeat']['mark']}) (≤ +{TARGET_HOT_NET_NS}); miss "
            f"{t['xdp_miss']['net_ns']:+.0f} ns {t['xdp_miss']['mark']}, repeat=N "
            f"{t['xdp_miss_repeat']['net_ns']:+.0f} ns {t['xdp_miss_repeat']['mark']} "
            f"(≤ +{TARGET_MISS_NET_NS})"
        )
    for r in results:
        one = r.single["lookup"].median - r.single["floor"].median
        if one > 0:
            costs = ", ".join(
                f"{name} {(r.single[name].median - r.single['floor'].median) / one:.1f}"
                for name in ("miss", "hot_established", "hot_same_syn", "hot_new", "spread")
            )
            print(f"{r.services:>7} Services, in units of one LRU lookup ({one:.0f} ns): {costs}")
    for label, g in (("tc", growth), ("XDP", xdp_growth)):
        if g is None:
            continue
        note = "" if g["to"] >= 100_000 else " (the target is stated for 100k)"
        print(
            f"{label} spread at {g['to']} / spread at {g['from']}: {g['raw_ratio']:.2f}x "
            f"{g['mark']}; net of the floor {g['net_ratio']:.2f}x {g['net_mark']} "
            f"(≤ {TARGET_SPREAD_GROWTH:.0f}x){note}"
        )
    for r in results:
        net = {k: r.single[k].median - r.single[floor_of(k)].median for k in r.single}
        tc_ratio = net["spread"] / max(net["hot_established"], 1)
        xdp_ratio = net["xdp_spread"] / max(net["xdp_hot_fwd_ack"], 1)
        print(f"{r.services:>7} Services: spread / established: tc {tc_ratio:.1f}, XDP "
              f"{xdp_ratio:.1f} (issue 15: ≤ 10)")  # fmt: skip
    if against:
        print_against(results, against)
    seconds = time.perf_counter() - began
    out = args.json or RESULTS / ("datapath-quick.json" if args.quick else "datapath.json")
    write_results(out, {
        "benchmark": "bench/datapath.py",
        "id": "PB-1",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": info,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "frame_bytes": FRAME_BYTES,
        "calls_per_variant": calls,
        "sizes": report,
        "spread_growth": growth,
        "xdp_spread_growth": xdp_growth,
        "variants": VARIANT_TEXT,
        "xdp_paths": XDP_PATHS,
        "address_plan": {
            "node_address": NODE_ADDRESS,
            "lb_vips": f"{lb_vip_of(0)} + i (198.18.0.0/15)",
            "node_ports": f"{NODE_ADDRESS}:{NODE_PORT_BASE} + i for i < {NODE_PORTS}",
            "outside_client": EXTERNAL_CLIENT,
            "local_service": "index N, backends on this node",
            "snat_ports": list(DEFAULT_SNAT_PORTS),
        },
        "reference": REF_PB1,
        "against_net_ns": against or None,
        "duration_s": seconds,
    })  # fmt: skip
    print(f"\nran in {seconds:.0f} s (load average now {os.getloadavg()[0]:.2f}); "
          f"results in {out}; left over: {leftovers() or 'nothing'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
