"""PB-1: nanoseconds per packet of the tc and XDP service programs through
BPF_PROG_TEST_RUN, with 10 to 100k Services x 10 endpoints in the maps, each beside an
empty program of its own type (the floors).

Synthetic NodeStates (bench/common/nodestates.py), the bench namespace and the real
EbpfDataplane on a fresh pin directory, removed again also on failure or Ctrl-C
(bench/common/kernel.py), are shared with the other eBPF benchmarks.

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
import dataclasses
import itertools
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.dataplane.ebpf import codec, libbpf
from agent.dataplane.ebpf import frames as P
from agent.dataplane.ebpf.external import DEFAULT_SNAT_PORTS
from agent.dataplane.ebpf.inspect import XDP_VERDICTS
from agent.dataplane.ebpf.maps import MapSizes
from bench.common.kernel import (
    bench_dataplane,
    bench_netns,
    calibration_programs,
    inside_netns,
    leftovers,
    map_sizes_for,
    route_external_ranges,
)
from bench.common.nodestates import (
    BACKEND_PORT,
    CLIENT,
    EXTERNAL_CLIENT,
    NODE_ADDRESS,
    NODE_PORT_BASE,
    NODE_PORTS,
    NOT_A_SERVICE,
    backend_ip_of,
    cluster_ip_of,
    lb_vip_of,
    local_entry,
    nodestate_of,
    synthetic_entries,
)
from bench.common.pb1 import (
    FRAME_BYTES,
    XDP_PASS,
    expect,
    frame,
    xdp_frames,
)
from bench.common.report import (
    RESULTS,
    Summary,
    header,
    machine,
    mark,
    results_path,
    terminate_as_interrupt,
    write_results,
)

TC_ACT_OK = 0

# Targets and anchors (bench/README.md, PB-1).
TARGET_HOT_NET_NS = 60  # hot ≤ floor + 60 ns
TARGET_MISS_NET_NS = 40  # miss ≤ floor + 40 ns
TARGET_SPREAD_GROWTH = 2.0  # spread at 100k ≤ 2 x spread at 10
REF_PB1 = "Katran's whole XDP LB 101-119 ns/pkt (same method); a BPF hash lookup 20-32 ns"


# --- shared: synthetic NodeStates --------------------------------------------------------


# --- shared: namespaces, pins, the dataplane ---------------------------------------------


# --- shared: figures ---------------------------------------------------------------------


# --- PB-1 ----------------------------------------------------------------------------------


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
    out = results_path(args, "datapath")
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
