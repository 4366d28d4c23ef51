"""PB-1: nanoseconds per packet of the tc service program through BPF_PROG_TEST_RUN, with
10 to 100k Services x 10 endpoints in the maps, beside an empty tc program (the floor).

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

    .venv/bin/python -m bench.datapath [--quick] [--services N ...] [--calls C]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import ipaddress
import itertools
import json
import math
import os
import random
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

from agent.dataplane.ebpf import libbpf
from agent.dataplane.ebpf.dataplane import EbpfDataplane
from agent.dataplane.ebpf.plan import MapSizes
from agent.model.nodestate import (
    CLUSTER_IP,
    Backend,
    Frontend,
    NodeInfo,
    NodeState,
    ServiceEntry,
    revision_of,
)
from bench import compile as compile_bench
from bench.compile import RESULTS, git_commit, mark
from tests.kernel import packets as P

BPFFS = Path("/sys/fs/bpf")
BENCH_PREFIX = "kbp-bench-"
NO_INTERFACES = "kbpbench-none"  # a --pod-interfaces glob that matches nothing

# Synthetic address plan (nothing is configured on an interface for PB-1 and maps.py;
# connect.py routes only the target Service's backend, inside its lab):
#   Service i      ClusterIP 10.96.0.10 + i (10.96.0.0/12), TCP port 80 → 8080
#   its backends   10.128.0.1 + i x E + j (10.128.0.0/9), port 8080, on node "node-b"
#   client         10.244.0.2, source ports from 1024 up
#   not a Service  10.244.9.9:80
CLUSTER_IP_BASE = int(ipaddress.IPv4Address("10.96.0.10"))
BACKEND_BASE = int(ipaddress.IPv4Address("10.128.0.1"))
FRONTEND_PORT, BACKEND_PORT = 80, 8080
CLIENT = "10.244.0.2"
NOT_A_SERVICE = "10.244.9.9"
FRAME_BYTES = 64  # a minimum-size Ethernet frame: the 54-byte SYN and trailer padding
TC_ACT_OK = 0

# Targets and anchors (../shared/BENCHMARKS.md PB-1).
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


def service_entry(
    name: str, cluster_ip: str, backends: Sequence[tuple[str, int]], *, local: bool = False
) -> ServiceEntry:
    """A ClusterIP entry (TCP 80) with ready backends, as compile() would emit it."""
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
        frontends=(Frontend(CLUSTER_IP, cluster_ip, FRONTEND_PORT),),
        affinity_timeout=None,
        internal_traffic_policy="Cluster",
        external_traffic_policy="Cluster",
        health_check_node_port=None,
        topology="None",
        has_endpoints=True,
        cluster_backends=members,
        local_backends=None,
    ).sealed()


def synthetic_entries(count: int, endpoints: int, first: int = 0) -> list[ServiceEntry]:
    """Services first..first+count-1 (named svc-NNNNNN, so they sort in index order)."""
    return [
        service_entry(
            f"svc-{i:06d}",
            cluster_ip_of(i),
            [(backend_ip_of(i, j, endpoints), BACKEND_PORT) for j in range(endpoints)],
        )
        for i in range(first, first + count)
    ]


def nodestate_of(entries: Iterable[ServiceEntry]) -> NodeState:
    ordered = tuple(sorted(entries, key=lambda e: e.sort_key))
    node = NodeInfo("node-a", None, {}, ("192.0.2.10",))
    return NodeState(node, revision_of(e.digest for e in ordered), ordered)


def _pow2_at_least(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, n))))


def map_sizes_for(services: int, endpoints: int, ct: int = 262144) -> MapSizes:
    """Maps sized for N Services x E endpoints with a little headroom (powers of two):
    100k x 10 gets 131,072 frontends and 1,048,576 slots and backends."""
    return MapSizes(
        services=_pow2_at_least(max(1024, services * 1.2 + 16)),
        slots=_pow2_at_least(max(4096, services * endpoints * 1.02 + 64)),
        backends=_pow2_at_least(max(4096, services * endpoints * 1.02 + 64)),
        ct=ct,
        affinity=1024,
    )


# --- shared: namespaces, pins, the dataplane ---------------------------------------------


@contextlib.contextmanager
def bench_netns() -> Iterator[str]:
    """An empty network namespace of this run, for the dataplane's netlink side: nothing
    is attached to any interface of the machine's own namespace."""
    name = f"{BENCH_PREFIX}{os.getpid()}-{next(_names)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False, capture_output=True)


@contextlib.contextmanager
def bench_dataplane(
    sizes: MapSizes, netns: str, pod_interfaces: Sequence[str] = (NO_INTERFACES,)
) -> Iterator[EbpfDataplane]:
    """The real EbpfDataplane (compiled with bcc) on a fresh pin directory; detached,
    unpinned and removed on exit."""
    pin_dir = BPFFS / f"{BENCH_PREFIX}{os.getpid()}-{next(_names)}"
    dataplane: EbpfDataplane | None = None
    try:
        dataplane = EbpfDataplane(pin_dir, list(pod_interfaces), sizes, netns=netns, watch=False)
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
        yield {name: module.load_func(name.encode(), BPF.SCHED_CLS).fd
               for name in CALIBRATION_PROGRAMS}  # fmt: skip
    finally:
        module.cleanup()


def expect(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"sanity check failed: {what}")


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


def measure_size(
    services: int,
    endpoints: int,
    calls: int,
    repeat: int,
    rounds: int,
    netns: str,
    calibration: dict[str, int],
) -> SizeResult:
    sizes = map_sizes_for(services, endpoints)
    print(f"\n# {services} Services x {endpoints} endpoints: maps {sizes}", flush=True)
    began = time.perf_counter()
    entries = synthetic_entries(services, endpoints)
    state = nodestate_of(entries)
    print(f"  NodeState built in {time.perf_counter() - began:.1f} s", flush=True)
    with bench_dataplane(sizes, netns) as dp:
        load_seconds = time.perf_counter() - began
        started = time.perf_counter()
        writes = dp.apply(state)
        apply_seconds = time.perf_counter() - started
        print(f"  applied {writes} map writes in {apply_seconds:.1f} s", flush=True)
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

        floor_fd = calibration["kbp_bench_empty"]
        lookup_fd, update_fd = calibration["kbp_bench_lookup"], calibration["kbp_bench_update"]
        libbpf.prog_test_run(update_fd, established)  # the key the lookups find

        sports = itertools.cycle(range(1024, 65000))
        new_flows = [frame(hot_ip, next(sports)) for _ in range(calls)]
        spread = [frame(cluster_ip_of(rng.randrange(services)), next(sports)) for _ in range(calls)]
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
        ]  # fmt: skip
        interleave(variants, calls)
        rep = repeated(
            {
                "floor": (floor_fd, miss),
                "miss": (from_pod, miss),
                "lookup": (lookup_fd, established),
                "update": (update_fd, established),
            },
            repeat,
            rounds,
        )
    return SizeResult(
        services,
        endpoints,
        sizes,
        load_seconds,
        apply_seconds,
        {v.name: Summary(v.samples) for v in variants},
        rep,
        repeat,
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
}
REPEAT_TEXT = {
    "floor": "floor",
    "miss": "miss",
    "lookup": "1 LRU lookup",
    "update": "1 LRU update",
}
VARIANT_TARGET = {
    "hot_new": TARGET_HOT_NET_NS,
    "hot_same_syn": TARGET_HOT_NET_NS,
    "hot_established": TARGET_HOT_NET_NS,
    "miss": TARGET_MISS_NET_NS,
}


def print_size(r: SizeResult) -> dict[str, Any]:
    floor = r.single["floor"].median
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
        net = s.median - floor
        target = VARIANT_TARGET.get(name)
        target_text = f"≤ floor + {target} ns" if target is not None else ""
        ok = mark(net <= target) if target is not None else ""
        if target is not None:
            marks[name] = {"net_ns": net, "target_net_ns": target, "mark": ok}
        net_text = "" if name == "floor" else f"{net:+.0f} ns"
        spread_text = f"{min(s.samples):.0f}-{max(s.samples):.0f}"
        print(
            f"{VARIANT_TEXT[name]:<44} {s.median:>7.0f} {s.p99:>7.0f} {spread_text:>13} "
            f"{s.mean:>7.1f} {len(s.samples):>6}  {net_text:>8}  {target_text:<16} {ok:4}"
        )
    floor_n = r.repeated["floor"].median
    for name, s in r.repeated.items():
        net = s.median - floor_n
        is_miss = name == "miss"
        ok = mark(net <= TARGET_MISS_NET_NS) if is_miss else ""
        if is_miss:
            marks["miss_repeat"] = {"net_ns": net, "target_net_ns": TARGET_MISS_NET_NS, "mark": ok}
        label = f"{REPEAT_TEXT[name]}, repeat={r.repeat} (kernel average)"
        print(
            f"{label:<44} {s.median:>7.0f} {s.p99:>7.0f} "
            f"{f'{min(s.samples):.0f}-{max(s.samples):.0f}':>13} {s.mean:>7.1f} "
            f"{len(s.samples):>6}  {('' if name == 'floor' else f'{net:+.0f} ns'):>8}  "
            f"{('≤ floor + 40 ns' if is_miss else ''):<16} {ok:4}"
        )
    print(f"(ns per packet; kernel-reported; maps filled in {r.apply_seconds:.1f} s; "
          f"XDP: n/a, the dataplane has no XDP program)")  # fmt: skip
    return marks


def spread_growth(results: list[SizeResult]) -> dict[str, Any] | None:
    """Spread at the largest N over spread at the smallest, raw and net of the floor."""
    if len(results) < 2:
        return None
    small, large = results[0], results[-1]

    def net(r: SizeResult) -> float:
        return r.single["spread"].median - r.single["floor"].median

    raw = large.single["spread"].median / small.single["spread"].median
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PB-1: ns/packet of the tc service program via BPF_PROG_TEST_RUN "
        "(not a test; always exits 0)."
    )
    parser.add_argument("--quick", action="store_true", help="10 and 10k Services, < 1 minute")
    parser.add_argument("--services", type=int, nargs="+", metavar="N",
                        help="sizes (default 10 1000 10000 100000)")  # fmt: skip
    parser.add_argument("--endpoints", type=int, default=10, metavar="E")
    parser.add_argument("--calls", type=int, help="single runs per variant and size")
    parser.add_argument("--repeat", type=int, default=10000, help="N of the repeat=N figures")
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
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
    try:
        with bench_netns() as netns, calibration_programs(262144) as calibration:
            for n in sizes:
                r = measure_size(n, args.endpoints, calls, args.repeat, rounds, netns, calibration)
                results.append(r)
                marks = print_size(r)
                report.append({
                    "services": r.services,
                    "endpoints_per_service": r.endpoints,
                    "map_sizes": dataclasses.asdict(r.sizes),
                    "apply_seconds": r.apply_seconds,
                    "repeat": r.repeat,
                    "single_ns": {k: s.to_json() for k, s in r.single.items()},
                    "repeated_ns": {k: s.to_json() for k, s in r.repeated.items()},
                    "targets": marks,
                })  # fmt: skip
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers() or 'nothing'})")
        return 130
    growth = spread_growth(results)
    print(f"\n## targets (BENCHMARKS.md PB-1); anchors: {REF_PB1}")
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
    for r in results:
        one = r.single["lookup"].median - r.single["floor"].median
        if one > 0:
            costs = ", ".join(
                f"{name} {(r.single[name].median - r.single['floor'].median) / one:.1f}"
                for name in ("miss", "hot_established", "hot_same_syn", "hot_new", "spread")
            )
            print(f"{r.services:>7} Services, in units of one LRU lookup ({one:.0f} ns): {costs}")
    if growth is not None:
        note = "" if growth["to"] >= 100_000 else " (the target is stated for 100k)"
        print(
            f"spread at {growth['to']} / spread at {growth['from']}: {growth['raw_ratio']:.2f}x "
            f"{growth['mark']}; net of the floor {growth['net_ratio']:.2f}x {growth['net_mark']} "
            f"(≤ {TARGET_SPREAD_GROWTH:.0f}x){note}"
        )
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
        "reference": REF_PB1,
        "duration_s": seconds,
    })  # fmt: skip
    print(f"\nran in {seconds:.0f} s (load average now {os.getloadavg()[0]:.2f}); "
          f"results in {out}; left over: {leftovers() or 'nothing'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
