"""PB-3: forwarded packets/s through the Service path on veth, 64-byte UDP: kbp's tc and
XDP programs against the same path with no-op programs (the floors) and against the
iptables fallback's DNAT, one topology per variant, all measured in interleaved rounds.

Topology, one per variant (namespaces kbp-bench-pb3-<pid>-<variant>-<role>; nothing of the
machine's own namespace is touched):

    gen  --veth g0|n0-->  node  --veth n1|r0-->  sink

    gen    g0 192.0.2.2/24 (02:00:00:00:10:01). A bench XDP program run by
           BPF_PROG_TEST_RUN in live-frames mode with g0 as its ingress device returns
           XDP_TX for every run, which transmits the frame out of g0 into n0. The frame is
           60 bytes (64 with the FCS): Ethernet, IPv4 from the client 10.10.0.1, UDP with
           checksum 0 (allowed for IPv4) and 18 bytes of payload; the program rewrites the
           headers on every run (recycled pages keep what the receivers wrote) and sets the
           UDP source port to one of FLOWS ports in turn, so conntrack sees FLOWS flows.
    node   the node under test, IPv4 forwarding on, rp_filter off. n0 192.0.2.1/24
           (02:00:00:00:10:02): its external interface, the program under test on its
           ingress; GRO on, which gives the veth a NAPI context so that g0 can transmit XDP
           frames into it without an XDP program on n0. n1 (02:00:00:00:11:01) has no
           address of its own, so the node's one address 192.0.2.1 is also the source that
           MASQUERADE picks (the same as kbp's SNAT address). Routes: 10.10.0.0/16 via
           192.0.2.2 dev n0; 192.0.3.2 dev n1; 10.244.9.0/24 via 192.0.3.2 dev n1.
           Permanent neighbours for 192.0.2.2 and 192.0.3.2: no ARP during the run.
    sink   "another node hosting the backend": r0 192.0.3.2/24 and the backend pod address
           10.244.9.2/32 (02:00:00:00:11:02). A bench XDP program (native; --sink tc: at
           tc ingress, GRO on r0) counts and drops every frame, by kind: to the backend
           10.244.9.2:8080 from the node 192.0.2.1 (translated), to it from the client
           range (forwarded as sent), other.

The Service: LoadBalancer VIP 203.0.113.10:80/UDP, externalTrafficPolicy Cluster, one
ready backend 10.244.9.2:8080 on another node; so the eBPF path DNATs and SNATs to the
node address, as for any remote backend, and so does the iptables fallback (DNAT in
PREROUTING, MASQUERADE in POSTROUTING). IPv6 is off in every namespace.

Variants: gen-only (the sink program dropping on n0: what the generator and the first
hop cost), noop-tc (an empty tc program on n0 ingress; frames to the backend address; the
kernel forwards), tc (EbpfDataplane, external interface n0, XDP off; frames to the VIP),
iptables (IptablesDataplane, no BPF on n0; frames to the VIP), noop-xdp (an XDP program
on n0 that rewrites the MACs and bpf_redirect()s to n1; frames to the backend address)
and xdp (EbpfDataplane with native XDP on n0: decide, DNAT + SNAT, FIB, XDP_REDIRECT).
The tc programs attach as the agent's --tc-attach auto does (tcx links where the kernel
has them); noop-tc is the empty program as a clsact filter, noop-tcx the same as a tcx
link, tc-clsact kbp's tc with --tc-attach clsact: the two ways side by side. The target
tc / noop compares like with like (noop-tcx when tc ran as tcx links).

Method. Each window is one BPF_PROG_TEST_RUN call of N runs from one thread pinned to one
CPU, in the gen namespace; forwarded pps = frames the sink counted as translated as
expected / wall time of the call. Frames are handed from g0 to n0's NAPI, which the
kernel schedules on the CPU that transmitted (the generator's), so the generator, the
forwarding and the sink all run there unless the softirq work moves; /proc/softirqs and
the sink's per-CPU counts say where it ran.

    .venv/bin/python -m bench.forward [--quick] [--rounds R] [--window S] [--cpu C]
                                      [--sink xdp|tc] [--variants V ...]
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.dataplane.base import DataplaneError
from agent.dataplane.ebpf import codec, inspect, libbpf
from agent.dataplane.ebpf import frames as P
from agent.dataplane.ebpf.dataplane import EbpfDataplane
from agent.dataplane.ebpf.inspect import XDP_VERDICTS
from agent.dataplane.ebpf.netlink import TcAttacher
from agent.dataplane.ebpf.options import EbpfOptions, TcAttach, Xdp
from agent.dataplane.iptables.dataplane import IptablesDataplane
from agent.lab.toolkit import NO_RP_FILTER, in_netns, ip_batch, run, sysctl
from agent.model.nodestate import (
    CLUSTER_IP,
    LOAD_BALANCER,
    Backend,
    Frontend,
    NodeInfo,
    NodeState,
    ServiceEntry,
    revision_of,
)
from bench.common.kernel import (
    BENCH_PREFIX,
    BPFFS,
    NO_INTERFACES,
    inside_netns,
    leftovers,
    map_sizes_for,
    remove_orphans,
)
from bench.common.report import (
    Summary,
    header,
    machine,
    mark,
    results_path,
    terminate_as_interrupt,
    write_results,
)
from tests.lab.kit import Cleanup, link_index

PREFIX = f"{BENCH_PREFIX}pb3-"  # namespaces and pin directories of this benchmark

# Address plan (see the module docstring).
CLIENT = "10.10.0.1"
CLIENT_NET = "10.10.0.0/16"
GEN_ADDRESS = "192.0.2.2"
NODE_ADDRESS = "192.0.2.1"  # n0, and kbp_config's SNAT source (NodeInfo.addresses)
SINK_ADDRESS = "192.0.3.2"
BACKEND, BACKEND_PORT = "10.244.9.2", 8080
BACKEND_NET = "10.244.9.0/24"
VIP, VIP_PORT = "203.0.113.10", 80
CLUSTER_IP_ADDRESS = "10.96.0.10"
MAC = {
    "g0": "02:00:00:00:10:01",
    "n0": "02:00:00:00:10:02",
    "n1": "02:00:00:00:11:01",
    "r0": "02:00:00:00:11:02",
}
FLOWS = 256  # UDP source ports the generator cycles through
SPORT_BASE = 20000
PAYLOAD = 18  # 14 + 20 + 8 + 18 = 60 bytes, 64 on a wire with the FCS
FRAME_BYTES = 60
HEADER_BYTES = 42  # Ethernet + IPv4 + UDP: what the generator rewrites on every run
BATCH = 64  # frames per live-frames batch (the kernel's default)

XDP_ABORTED, XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = 0, 1, 2, 3, 4

# The sink's counters (kbp_bench_sink_count slots).
SINK_TRANSLATED, SINK_AS_SENT, SINK_OTHER_IPV4_UDP, SINK_OTHER = 0, 1, 2, 3
SINK_SLOTS = ("translated", "as_sent", "other_ipv4_udp", "other")

# Targets and anchors (bench/README.md, PB-3; issue 6).
TARGET_TC_OF_NOOP = 0.70
TARGET_TC_OF_IPTABLES = 1.5
ANCHOR_XDP_OF_IPTABLES = 4.8
REFERENCE = "Cilium: tc-eBPF ≈1.7x iptables, XDP ≥4.8x iptables"

VARIANTS = ("gen-only", "noop-tc", "noop-tcx", "tc", "tc-clsact", "iptables", "noop-xdp", "xdp")
VARIANT_TEXT = {
    "gen-only": "the generator and one veth hop alone: the sink's XDP drop on n0",
    "noop-tc": "floor (tc): empty tc program on n0 (clsact), to the backend address",
    "noop-tcx": "the same empty program as a tcx link, to the backend address",
    "tc": "kbp tc (EbpfDataplane, XDP off, --tc-attach auto: tcx here), to the VIP",
    "tc-clsact": "kbp tc as above with --tc-attach clsact, to the VIP",
    "iptables": "iptables fallback (IptablesDataplane), to the VIP",
    "noop-xdp": "floor (XDP): MAC rewrite + bpf_redirect to n1, to the backend address",
    "xdp": "kbp XDP (EbpfDataplane, native), to the VIP",
}


def mac_bytes(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


def le32(ip: str) -> int:
    """An IPv4 address as the u32 a little-endian load of its network-order bytes gives."""
    return int.from_bytes(socket.inet_aton(ip), "little")


# --- the bench's own programs (bcc, like bench/common/kernel.py's floors) -----------------------


def _mac_stores(pointer: str, offset: int, mac: str) -> str:
    return " ".join(f"{pointer}[{offset + i}] = {b:#04x};" for i, b in enumerate(mac_bytes(mac)))


def bench_c() -> str:
    """The generator, the sink and the two floors. Addresses are compared as the u32 a
    load from the packet gives on this little-endian machine."""
    client_net = ipaddress.ip_network(CLIENT_NET)
    return f"""
BPF_PERCPU_ARRAY(kbp_bench_gen_count, u64, 1);
struct kbp_bench_headers {{ u8 bytes[{HEADER_BYTES}]; }};
BPF_ARRAY(kbp_bench_gen_frame, struct kbp_bench_headers, 1);
BPF_PERCPU_ARRAY(kbp_bench_sink_count, u64, {len(SINK_SLOTS)});
BPF_ARRAY(kbp_bench_fwd_ifindex, u32, 1);

/* The generator. The kernel copies the test's frame into a page only when the page is
 * new; a recycled page holds what the last user left there (the receivers rewrite MACs,
 * TTL, addresses), so every run writes the whole header again from the template the
 * bench put in kbp_bench_gen_frame, then the flow's source port. XDP_TX sends it out of
 * the ingress device given to the test run. */
int kbp_bench_gen(struct xdp_md *ctx)
{{
        void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
        u32 zero = 0;
        u64 *count = kbp_bench_gen_count.lookup(&zero);
        struct kbp_bench_headers *headers = kbp_bench_gen_frame.lookup(&zero);
        u16 *sport = data + 34;

        if (!count || !headers || data + {HEADER_BYTES} > end)
                return XDP_ABORTED;
        __builtin_memcpy(data, headers->bytes, {HEADER_BYTES});
        *sport = bpf_htons({SPORT_BASE} + (u16)(*count % {FLOWS}));
        *count += 1;
        return XDP_TX;
}}

/* The sink: count by kind and drop, at XDP or at tc ingress (--sink). */
static __always_inline void kbp_bench_count(u8 *p, void *end)
{{
        u32 slot = {SINK_OTHER};
        u64 *count;

        if ((void *)(p + 42) <= end && *(u16 *)(p + 12) == bpf_htons(0x0800) && p[14] == 0x45 &&
            p[23] == 17) {{
                u32 saddr = *(u32 *)(p + 26), daddr = *(u32 *)(p + 30);
                u16 dport = *(u16 *)(p + 36);

                slot = {SINK_OTHER_IPV4_UDP};
                if (daddr == {le32(BACKEND):#x}U && dport == bpf_htons({BACKEND_PORT})) {{
                        if (saddr == {le32(NODE_ADDRESS):#x}U)
                                slot = {SINK_TRANSLATED};
                        else if ((saddr & {le32(str(client_net.netmask)):#x}U) ==
                                 {le32(str(client_net.network_address)):#x}U)
                                slot = {SINK_AS_SENT};
                }}
        }}
        count = kbp_bench_sink_count.lookup(&slot);
        if (count)
                *count += 1;
}}

int kbp_bench_sink(struct xdp_md *ctx)
{{
        kbp_bench_count((void *)(long)ctx->data, (void *)(long)ctx->data_end);
        return XDP_DROP;
}}

int kbp_bench_sink_tc(struct __sk_buff *skb)
{{
        kbp_bench_count((void *)(long)skb->data, (void *)(long)skb->data_end);
        return 2; /* TC_ACT_SHOT */
}}

/* Floor for tc: the hook with an empty program. */
int kbp_bench_tc_noop(struct __sk_buff *skb) {{ return 0; }}

/* Floor for XDP forwarding: the next hop's MACs, then out of n1. */
int kbp_bench_xdp_fwd(struct xdp_md *ctx)
{{
        void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
        u8 *p = data;
        u32 zero = 0;
        u32 *ifindex = kbp_bench_fwd_ifindex.lookup(&zero);

        if (!ifindex || data + 14 > end)
                return XDP_ABORTED;
        {_mac_stores("p", 0, MAC["r0"])}
        {_mac_stores("p", 6, MAC["n1"])}
        return bpf_redirect(*ifindex, 0);
}}
"""


@dataclass
class BenchPrograms:
    gen: int
    sink: int
    sink_tc: int
    tc_noop: int
    xdp_fwd: int
    gen_count: libbpf.Map
    gen_frame: libbpf.Map
    sink_count: libbpf.Map
    fwd_ifindex: libbpf.Map


@contextlib.contextmanager
def bench_programs() -> Iterator[BenchPrograms]:
    from bcc import BPF

    module = BPF(text=bench_c().encode())
    try:
        yield BenchPrograms(
            gen=module.load_func(b"kbp_bench_gen", BPF.XDP).fd,
            sink=module.load_func(b"kbp_bench_sink", BPF.XDP).fd,
            sink_tc=module.load_func(b"kbp_bench_sink_tc", BPF.SCHED_CLS).fd,
            tc_noop=module.load_func(b"kbp_bench_tc_noop", BPF.SCHED_CLS).fd,
            xdp_fwd=module.load_func(b"kbp_bench_xdp_fwd", BPF.XDP).fd,
            gen_count=libbpf.Map(module[b"kbp_bench_gen_count"].map_fd),
            gen_frame=libbpf.Map(module[b"kbp_bench_gen_frame"].map_fd),
            sink_count=libbpf.Map(module[b"kbp_bench_sink_count"].map_fd),
            fwd_ifindex=libbpf.Map(module[b"kbp_bench_fwd_ifindex"].map_fd),
        )
    finally:
        module.cleanup()


def percpu_u64(table: libbpf.Map, index: int) -> list[int]:
    raw = table.lookup(struct.pack("<I", index)) or b""
    return [v for (v,) in struct.iter_unpack("<Q", raw)]


def live_run(prog_fd: int, frame: bytes, repeat: int, ifindex: int) -> None:
    """BPF_PROG_TEST_RUN in live-frames mode: `repeat` runs over copies of `frame`, as if
    received on `ifindex` of the calling thread's namespace; XDP_TX and XDP_REDIRECT
    transmit for real. Batches of BATCH frames."""
    # struct xdp_md: data, data_end, data_meta, ingress_ifindex, rx_queue_index,
    # egress_ifindex; the kernel wants data 0 (no metadata) and data_end = the frame's size.
    ctx = struct.pack("<6I", 0, len(frame), 0, ifindex, 0, 0)
    libbpf.prog_test_run_live(prog_fd, frame, repeat, ctx, BATCH)


def template_frame(dst: str, dport: int) -> bytes:
    udp = P.udp_datagram(CLIENT, dst, SPORT_BASE, dport, bytes(PAYLOAD), zero_checksum=True)
    ip = P.ipv4_packet(CLIENT, dst, P.PROTO_UDP, udp)
    frame = P.ethernet(ip, P.ETH_P_IP, src=mac_bytes(MAC["g0"]), dst=mac_bytes(MAC["n0"]))
    assert len(frame) == FRAME_BYTES, len(frame)
    return frame


# --- topology --------------------------------------------------------------------------------


def in_ns(netns: str, *argv: str) -> str:
    return run(in_netns(netns, argv))


@dataclass
class Topology:
    """gen → node → sink for one variant; `namespaces` are removed by `remove()`."""

    variant: str
    gen: str
    node: str
    sink: str
    g0_index: int = 0
    n1_index: int = 0
    undo: Cleanup = field(default_factory=lambda: Cleanup("bench.forward"))

    @classmethod
    def create(cls, variant: str) -> Topology:
        base = f"{PREFIX}{os.getpid()}-{variant}"
        topo = cls(variant, f"{base}-gen", f"{base}-node", f"{base}-sink")
        try:
            for name in (topo.gen, topo.node, topo.sink):
                topo.undo.namespace(name, {"net.ipv6.conf.all.disable_ipv6": 1,
                                           "net.ipv6.conf.default.disable_ipv6": 1})  # fmt: skip
            topo._wire()
        except BaseException:
            topo.remove()
            raise
        return topo

    def _wire(self) -> None:
        run(["ip", "link", "add", "g0", "netns", self.gen, "address", MAC["g0"], "type", "veth",
              "peer", "name", "n0", "netns", self.node, "address", MAC["n0"]])  # fmt: skip
        run(["ip", "link", "add", "n1", "netns", self.node, "address", MAC["n1"], "type", "veth",
              "peer", "name", "r0", "netns", self.sink, "address", MAC["r0"]])  # fmt: skip
        ip_batch(self.gen, [
            "link set lo up",
            f"addr add {GEN_ADDRESS}/24 dev g0",
            "link set g0 up",
            f"neigh add {NODE_ADDRESS} lladdr {MAC['n0']} dev g0 nud permanent",
        ])  # fmt: skip
        sysctl(self.node, {"net.ipv4.conf.all.forwarding": 1, **NO_RP_FILTER})
        ip_batch(self.node, [
            "link set lo up",
            f"addr add {NODE_ADDRESS}/24 dev n0",
            "link set n0 up",
            "link set n1 up",
            f"neigh add {GEN_ADDRESS} lladdr {MAC['g0']} dev n0 nud permanent",
            f"route add {CLIENT_NET} via {GEN_ADDRESS} dev n0",
            f"route add {SINK_ADDRESS}/32 dev n1",
            f"neigh add {SINK_ADDRESS} lladdr {MAC['r0']} dev n1 nud permanent",
            f"route add {BACKEND_NET} via {SINK_ADDRESS} dev n1",
        ])  # fmt: skip
        sysctl(self.node, {f"net.ipv4.conf.{link}.rp_filter": 0 for link in ("n0", "n1")})
        # n0 needs a NAPI context to take XDP frames from g0; GRO gives it one whatever
        # program sits on n0 (UDP is not aggregated: no rx-udp-gro-forwarding).
        in_ns(self.node, "ethtool", "-K", "n0", "gro", "on")
        ip_batch(self.sink, [
            "link set lo up",
            f"addr add {SINK_ADDRESS}/24 dev r0",
            f"addr add {BACKEND}/32 dev r0",
            "link set r0 up",
        ])  # fmt: skip
        self.g0_index = link_index(self.gen, "g0")
        self.n1_index = link_index(self.node, "n1")

    def remove(self) -> None:
        self.undo.close()


def link_stats(netns: str, name: str) -> dict[str, int]:
    """Kernel and driver counters of one interface (ip -s and ethtool -S), non-zero only."""
    info = json.loads(in_ns(netns, "ip", "-j", "-s", "link", "show", name))[0]
    out = {f"{d}_{k}": v for d in ("rx", "tx") for k, v in info["stats64"][d].items() if v}
    with contextlib.suppress(RuntimeError):
        for line in in_ns(netns, "ethtool", "-S", name).splitlines()[1:]:
            key, _, value = line.strip().partition(":")
            if (
                value.strip().isdigit()
                and int(value)
                and not key.startswith(("rx_queue", "tx_queue"))
            ):
                out[f"ethtool_{key.strip()}"] = int(value)
    return out


# --- the Service, the dataplanes ---------------------------------------------------------------


def node_state() -> NodeState:
    """One UDP Service: ClusterIP + LoadBalancer VIP, ETP Cluster, a backend on node-b."""
    backend = Backend(BACKEND, BACKEND_PORT, "node-b", None, None, False, True, True, False)
    entry = ServiceEntry(
        namespace="bench",
        name="pb3",
        port="udp",
        protocol="UDP",
        ip_family="IPv4",
        frontends=(
            Frontend(CLUSTER_IP, CLUSTER_IP_ADDRESS, VIP_PORT),
            Frontend(LOAD_BALANCER, VIP, VIP_PORT),
        ),
        affinity_timeout=None,
        internal_traffic_policy="Cluster",
        external_traffic_policy="Cluster",
        health_check_node_port=None,
        topology="None",
        has_endpoints=True,
        cluster_backends=(backend,),
        local_backends=None,
    ).sealed()
    node = NodeInfo("node-a", None, {}, (NODE_ADDRESS,))
    return NodeState(node, revision_of([entry.digest]), (entry,))


@dataclass
class Setup:
    """A variant ready to measure: its topology, what sits on n0, and how to check it."""

    name: str
    label: str
    topo: Topology
    frame: bytes
    expected_slot: int  # the sink slot that counts correctly forwarded frames
    ebpf: EbpfDataplane | None = None
    iptables: IptablesDataplane | None = None
    xdp_mode: str = ""
    notes: list[str] = field(default_factory=list)
    repeat: int = 0
    windows: list[dict[str, Any]] = field(default_factory=list)


def ebpf_dataplane(topo: Topology, xdp: str, tc_attach: str = "auto") -> tuple[EbpfDataplane, Path]:
    pin_dir = BPFFS / f"{PREFIX}{os.getpid()}-{topo.variant}"
    try:
        dp = EbpfDataplane(
            EbpfOptions(
                pin_dir,
                (NO_INTERFACES,),
                map_sizes_for(1, 1),
                netns=topo.node,
                watch=False,
                external_interfaces=("n0",),
                xdp=Xdp.parse(xdp),
                tc_attach=TcAttach(tc_attach),
            )
        )
    except BaseException:
        shutil.rmtree(pin_dir, ignore_errors=True)
        raise
    return dp, pin_dir


@contextlib.contextmanager
def variant_setups(
    progs: BenchPrograms, names: Sequence[str], sink_hook: str
) -> Iterator[list[Setup]]:
    """Every variant's topology and programs; all removed on exit, also on failure."""
    setups: list[Setup] = []
    pins: list[Path] = []
    state = node_state()
    to_vip, to_backend = template_frame(VIP, VIP_PORT), template_frame(BACKEND, BACKEND_PORT)
    try:
        for name in names:
            topo = Topology.create(name)
            setups.append(s := Setup(name, name, topo, to_backend, SINK_AS_SENT))
            r0 = link_index(topo.sink, "r0")
            with TcAttacher(topo.sink) as sink:
                if sink_hook == "xdp":
                    sink.attach_xdp(r0, progs.sink, "native")
                else:  # GRO gives r0 the NAPI that XDP_REDIRECT into n1 needs
                    in_ns(topo.sink, "ethtool", "-K", "r0", "gro", "on")
                    sink.attach(r0, "ingress", progs.sink_tc, "kbp_bench_sink_tc")
            n0 = link_index(topo.node, "n0")
            if name == "gen-only":
                with TcAttacher(topo.node) as node:
                    node.attach_xdp(n0, progs.sink, "native")
                s.xdp_mode = "native"
            elif name in ("noop-tc", "noop-tcx"):
                links = None  # clsact; noop-tcx: a tcx link pinned here
                if name == "noop-tcx":
                    links = BPFFS / f"{PREFIX}{os.getpid()}-{name}"
                    links.mkdir()
                    pins.append(links)
                with TcAttacher(topo.node, links, "tcx" if links else "clsact") as node:
                    node.attach(n0, "ingress", progs.tc_noop, "kbp_bench_tc_noop")
            elif name == "noop-xdp":
                progs.fwd_ifindex.update(bytes(4), struct.pack("<I", topo.n1_index))
                with TcAttacher(topo.node) as node:
                    node.attach_xdp(n0, progs.xdp_fwd, "native")
                s.xdp_mode = "native"
            elif name in ("tc", "tc-clsact", "xdp"):
                s.frame, s.expected_slot = to_vip, SINK_TRANSLATED
                mode = "native" if name == "xdp" else "off"
                try:
                    s.ebpf, pin = ebpf_dataplane(topo, mode, "clsact" if name == "tc-clsact"
                                                 else "auto")  # fmt: skip
                except DataplaneError as err:
                    if name != "xdp":
                        raise
                    s.notes.append(f"native XDP failed ({err}); generic instead")
                    s.ebpf, pin = ebpf_dataplane(topo, "generic")
                    s.label = "xdp (generic)"
                pins.append(pin)
                s.ebpf.apply(state)
                s.xdp_mode = s.ebpf.links.xdp_modes.get("n0", "off")
            elif name == "iptables":
                s.frame, s.expected_slot = to_vip, SINK_TRANSLATED
                s.iptables = IptablesDataplane([NO_INTERFACES], netns=topo.node)
                s.iptables.apply(state)
        yield setups
    finally:
        for s in setups:
            with contextlib.suppress(Exception):
                if s.ebpf is not None:
                    s.ebpf.cleanup()  # detaches from n0, unpins, closes
            s.topo.remove()
        for pin in pins:
            shutil.rmtree(pin, ignore_errors=True)


# --- measuring ---------------------------------------------------------------------------------


def net_rx_softirqs() -> list[int]:
    for line in Path("/proc/softirqs").read_text().splitlines():
        if line.strip().startswith("NET_RX:"):
            return [int(v) for v in line.split()[1:]]
    return []


def cpu_ticks() -> list[tuple[int, int]]:
    """Per CPU, (busy, softirq) time from /proc/stat in USER_HZ ticks; busy is user, nice,
    system, irq and softirq."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3].isdigit():
            user, nice, system, _idle, _iowait, irq, softirq = map(int, line.split()[1:8])
            out.append((user + nice + system + irq + softirq, softirq))
    return out


def sink_counts(progs: BenchPrograms) -> list[list[int]]:
    """[slot][cpu] frames the sinks counted."""
    return [percpu_u64(progs.sink_count, i) for i in range(len(SINK_SLOTS))]


def window(progs: BenchPrograms, s: Setup, repeat: int) -> dict[str, Any]:
    """One test-run call of `repeat` frames; what the sink counted meanwhile."""
    sent0 = sum(percpu_u64(progs.gen_count, 0))
    progs.gen_frame.update(bytes(4), s.frame[:HEADER_BYTES])
    sink0, rx0, ticks0 = sink_counts(progs), net_rx_softirqs(), cpu_ticks()
    with inside_netns(s.topo.gen):
        began = time.perf_counter()
        live_run(progs.gen, s.frame, repeat, s.topo.g0_index)
        seconds = time.perf_counter() - began
    time.sleep(0.02)  # the last batch leaves the rings (same CPU, already done in practice)
    sink1, rx1, ticks1 = sink_counts(progs), net_rx_softirqs(), cpu_ticks()
    sent = sum(percpu_u64(progs.gen_count, 0)) - sent0
    per_slot = [
        [b - a for a, b in zip(x, y, strict=True)] for x, y in zip(sink0, sink1, strict=True)
    ]
    good = sum(per_slot[s.expected_slot])
    return {
        "seconds": seconds,
        "runs": repeat,
        "sent": sent,
        "counted": {name: sum(v) for name, v in zip(SINK_SLOTS, per_slot, strict=True)},
        "expected": good,
        "pps": good / seconds,
        "sink_frames_per_cpu": [sum(v[c] for v in per_slot) for c in range(len(per_slot[0]))],
        "net_rx_softirqs_per_cpu": [b - a for a, b in zip(rx0, rx1, strict=True)],
        "busy_ticks_per_cpu": [b[0] - a[0] for a, b in zip(ticks0, ticks1, strict=True)],
        "softirq_ticks_per_cpu": [b[1] - a[1] for a, b in zip(ticks0, ticks1, strict=True)],
    }


@contextlib.contextmanager
def pinned_to(cpu: int) -> Iterator[None]:
    """This thread on one CPU (os.sched_setaffinity(0) is the calling thread)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def verify(s: Setup, progs: BenchPrograms) -> dict[str, Any]:
    """What shows that the variant ran the path it claims (printed and stored)."""
    out: dict[str, Any] = {"xdp_mode": s.xdp_mode}
    with TcAttacher(s.topo.node) as node:
        n0 = link_index(s.topo.node, "n0")
        out["tc_on_n0"] = sorted(f"{a.direction}:{a.hook}:{a.name}" for a in node.attached()
                                 if a.index == n0)  # fmt: skip
        out["xdp_on_n0"] = [f"{x.mode}:{libbpf.prog_name(x.prog_id)}" for x in node.xdp()
                            if x.index == n0]  # fmt: skip
    if s.ebpf is not None:
        pin = s.ebpf.pin_dir
        flows = [r for r in inspect.conntrack(pin) if r["direction"] == "forward"]
        out["kbp_conntrack_forward_flows"] = len(flows)
        out["kbp_conntrack_snat_flows"] = sum(1 for r in flows if "source" in r["translation"])
        out["kbp_counters"] = [r for r in inspect.counters(pin)]
        sums = codec.percpu_sums(s.ebpf.programs.map("kbp_xdp_stats"), "kbp_drop_counters")
        out["kbp_xdp_stats"] = {XDP_VERDICTS.get(i, str(i)): v[0] for i, v in sums.items() if v[0]}
    if s.iptables is not None:
        saved = in_ns(s.topo.node, "iptables-save", "-c", "-t", "nat")
        dnat = [line for line in saved.splitlines() if "-j DNAT" in line]
        out["iptables_dnat_rules"] = [line.split()[0] + " " + " ".join(line.split()[-3:])
                                      for line in dnat]  # fmt: skip
        out["iptables_dnat_packets"] = sum(int(line[1:].split(":")[0]) for line in dnat
                                           if line.startswith("["))  # fmt: skip
        out["conntrack_entries"] = int(in_ns(s.topo.node, "conntrack", "-C").strip() or 0)
    out["links"] = {
        "g0": link_stats(s.topo.gen, "g0"),
        "n0": link_stats(s.topo.node, "n0"),
        "n1": link_stats(s.topo.node, "n1"),
        "r0": link_stats(s.topo.sink, "r0"),
    }
    return out


def check_path(s: Setup, check: dict[str, Any]) -> list[str]:
    """Problems with the variant's claim (empty: it ran the path it is named for)."""
    problems = []
    total = sum(w["sent"] for w in s.windows)
    good = sum(w["expected"] for w in s.windows)
    if total == 0 or good < 0.5 * total:
        problems.append(f"only {good} of {total} frames arrived as expected")
    if s.name in ("tc", "tc-clsact", "xdp") and check["kbp_conntrack_snat_flows"] < FLOWS:
        problems.append(f"{check['kbp_conntrack_snat_flows']} SNAT flows in kbp's conntrack")
    if s.name in ("tc", "tc-clsact") and check["xdp_on_n0"]:
        problems.append(f"XDP on n0: {check['xdp_on_n0']}")
    if s.name == "xdp" and check["kbp_xdp_stats"].get("redirect", 0) < 0.5 * total:
        problems.append(f"kbp_xdp_stats: {check['kbp_xdp_stats']}")
    if s.name == "iptables":
        if check["tc_on_n0"] or check["xdp_on_n0"]:
            problems.append(f"BPF on n0: {check['tc_on_n0']} {check['xdp_on_n0']}")
        if check["iptables_dnat_packets"] < 1:
            problems.append("the DNAT rule counted no packet")
    return problems


# --- main ----------------------------------------------------------------------------------


def summary_of(s: Setup) -> Summary:
    return Summary([w["pps"] for w in s.windows])


def ratio(a: Summary, b: Summary) -> float:
    return a.median / b.median if b.median else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PB-3: forwarded packets/s through the Service path on veth, 64-byte UDP "
        "(not a test; always exits 0)."
    )
    parser.add_argument("--quick", action="store_true", help="short windows, < 1 minute")
    parser.add_argument("--rounds", type=int, help="rounds of every variant (default 10 / 20)")
    parser.add_argument("--window", type=float, help="seconds per window (default 0.25 / 1.0)")
    parser.add_argument("--cpu", type=int, default=1, help="the generator's CPU (default 1)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--sink", choices=("xdp", "tc"), default="xdp",
                        help="where r0 counts and drops (default xdp)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (10 if args.quick else 20)
    window_s = args.window or (0.25 if args.quick else 1.0)

    terminate_as_interrupt()
    for name in remove_orphans():  # of runs that died without their `finally`
        print(f"  removed {name}, left by a bench run that died", file=sys.stderr)
    info = machine()
    backend = iptables_backend()
    header("bench/forward.py (PB-3)", info,
           f"; iptables {backend}; generator on CPU {args.cpu}; {rounds} rounds of "
           f"{window_s} s windows; {FLOWS} UDP flows, {FRAME_BYTES + 4}-byte frames")  # fmt: skip
    began = time.perf_counter()
    try:
        with bench_programs() as progs, variant_setups(progs, args.variants, args.sink) as setups, \
                pinned_to(args.cpu):  # fmt: skip
            print(f"set up in {time.perf_counter() - began:.1f} s", flush=True)
            for s in setups:
                for note in s.notes:
                    print(f"  {s.name}: {note}")
                # Warm-up: the flows enter conntrack and caches warm; then a longer run's
                # rate sets the window's frame count (a short cold run underestimates it).
                window(progs, s, 50_000)
                w = window(progs, s, max(100_000, int(200_000 * window_s)))
                s.repeat = max(20_000, int(w["pps"] * window_s) // BATCH * BATCH or BATCH)
                print(
                    f"  {s.label:<14} warm-up {w['pps'] / 1e6:.2f} Mpps ({w['expected']} of "
                    f"{w['sent']} as expected); {s.repeat} frames per window",
                    flush=True,
                )
            for r in range(rounds):
                order = setups[r % len(setups) :] + setups[: r % len(setups)]
                for s in order:
                    s.windows.append(window(progs, s, s.repeat))
            checks = {s.name: verify(s, progs) for s in setups}
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers(PREFIX) or 'nothing'})")
        return 130
    report = print_report(setups, checks, args.cpu)
    seconds = time.perf_counter() - began
    out = results_path(args, "forward")
    write_results(out, {
        "benchmark": "bench/forward.py",
        "id": "PB-3",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": info,
        "iptables_backend": backend,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "generator_cpu": args.cpu,
        "sink_hook": args.sink,
        "frame_bytes_with_fcs": FRAME_BYTES + 4,
        "flows": FLOWS,
        "batch_size": BATCH,
        "rounds": rounds,
        "window_seconds": window_s,
        "variants": {s.name: {
            "label": s.label,
            "what": VARIANT_TEXT[s.name],
            "frames_per_window": s.repeat,
            "pps": summary_of(s).to_json(),
            "windows": s.windows,
            "check": checks[s.name],
            "notes": s.notes,
        } for s in setups},
        **report,
        "reference": REFERENCE,
        "duration_s": seconds,
    })  # fmt: skip
    print(f"\nran in {seconds:.0f} s (load average now {os.getloadavg()[0]:.2f}); "
          f"results in {out}; left over: {leftovers(PREFIX) or 'nothing'}")  # fmt: skip
    return 0


def iptables_backend() -> str:
    proc = subprocess.run(["iptables", "--version"], capture_output=True, text=True, check=False)
    text = proc.stdout.strip()
    return text.split()[-1].strip("()") if text else "unknown"


def per_cpu_total(s: Setup, key: str) -> list[int]:
    return [sum(w[key][c] for w in s.windows) for c in range(len(s.windows[0][key]))]


def print_report(
    setups: list[Setup], checks: dict[str, dict[str, Any]], cpu: int
) -> dict[str, Any]:
    by_name = {s.name: s for s in setups}
    gen = by_name.get("gen-only")
    gen_ns = 1e9 / summary_of(gen).median if gen is not None else None

    def net_ns(name: str) -> float | None:
        """ns per packet beyond what the generator and the first hop cost."""
        if gen_ns is None or name == "gen-only":
            return None
        return 1e9 / summary_of(by_name[name]).median - gen_ns

    print(f"\n## forwarded packets/s (Mpps over {len(setups[0].windows)} windows each: frames "
          f"the sink counted as expected / wall time of the generator's call)")  # fmt: skip
    head = (f"{'variant':<16} {'median':>7} {'p1':>7} {'p99':>7} {'min-max':>13} {'ns/pkt':>7} "
            f"{'- gen':>7} {'sent':>12} {'lost':>6}  path check")  # fmt: skip
    print(head)
    print("-" * len(head))
    problems: dict[str, list[str]] = {}
    costs: dict[str, Any] = {}
    for s in setups:
        summ = summary_of(s)
        ordered = sorted(summ.samples)
        low = ordered[max(0, len(ordered) // 100)]  # a rate's bad tail is its low end
        sent = sum(w["sent"] for w in s.windows)
        good = sum(w["expected"] for w in s.windows)
        problems[s.name] = check_path(s, checks[s.name])
        net = net_ns(s.name)
        costs[s.name] = {"ns_per_packet": 1e9 / summ.median, "net_of_generator_ns": net}
        print(f"{s.label:<16} {summ.median / 1e6:>7.3f} {low / 1e6:>7.3f} {summ.p99 / 1e6:>7.3f} "
              f"{f'{ordered[0] / 1e6:.3f}-{ordered[-1] / 1e6:.3f}':>13} "
              f"{1e9 / summ.median:>7.0f} {'' if net is None else f'{net:.0f}':>7} "
              f"{sent:>12,} {1 - good / sent if sent else 0:>6.1%}  "
              f"{'ok' if not problems[s.name] else '; '.join(problems[s.name])}")  # fmt: skip
    print("  p1 / p99: the slowest / fastest 1 % of windows; ns/pkt = 1 / median rate; - gen: "
          "net of gen-only (generator + first hop), i.e. the forwarding itself")  # fmt: skip
    for s in setups:
        print(f"  {s.label}: {VARIANT_TEXT[s.name]}")

    print(f"\n## where it ran (sums over the measured windows; generator pinned to CPU {cpu})")
    for s in setups:
        rx, sink = (
            per_cpu_total(s, "net_rx_softirqs_per_cpu"),
            per_cpu_total(s, "sink_frames_per_cpu"),
        )
        busy, soft = (
            per_cpu_total(s, "busy_ticks_per_cpu"),
            per_cpu_total(s, "softirq_ticks_per_cpu"),
        )
        print(f"  {s.label:<14} NET_RX softirqs per CPU {rx}; frames counted per CPU {sink}; "
              f"busy / softirq ticks per CPU {busy} / {soft}")  # fmt: skip

    print("\n## what each variant's path showed")
    for s in setups:
        c = checks[s.name]
        parts = [f"tc on n0 {c['tc_on_n0'] or 'none'}", f"XDP on n0 {c['xdp_on_n0'] or 'none'}"]
        if "kbp_conntrack_snat_flows" in c:
            parts.append(f"kbp conntrack {c['kbp_conntrack_forward_flows']} forward flows "
                         f"({c['kbp_conntrack_snat_flows']} SNAT)")  # fmt: skip
            packets = sum(r.get("packets", 0) for r in c["kbp_counters"] if "serviceId" in r)
            parts.append(f"kbp_counters packets {packets:,}")
            if c["kbp_xdp_stats"]:
                verdicts = sorted(c["kbp_xdp_stats"].items())
                parts.append("kbp_xdp_stats " + ", ".join(f"{k} {v:,}" for k, v in verdicts))
        if "iptables_dnat_packets" in c:
            parts.append(
                f"iptables DNAT rule packets {c['iptables_dnat_packets']} (first packet of "
                f"each flow), conntrack entries {c['conntrack_entries']}"
            )
        print(f"  {s.label:<14} " + "; ".join(parts))
        counted = {k: sum(w["counted"][k] for w in s.windows) for k in SINK_SLOTS}
        print(f"  {'':<14} counted (sink): " + ", ".join(f"{k} {v:,}" for k, v in counted.items()))

    print(f"\n## targets (bench/README.md PB-3; issue 6); anchors: {REFERENCE}")
    ratios: dict[str, Any] = {}

    def show(key: str, a: str, b: str, target: float | None, text: str) -> None:
        if a not in by_name or b not in by_name:
            return
        value = ratio(summary_of(by_name[a]), summary_of(by_name[b]))
        ok = mark(value >= target) if target is not None else ""
        net_a, net_b = net_ns(a), net_ns(b)
        net = net_b / net_a if net_a and net_b else None
        ratios[key] = {"value": value, "target": target, "mark": ok, "net_of_generator": net}
        net_text = "" if net is None else f"  (net of the generator: {net:.2f})"
        print(f"  {by_name[a].label} / {by_name[b].label}: {value:.2f} {text} {ok}{net_text}")

    # Like for like: kbp tc against the empty program attached the same way (tcx here).
    tc_is_tcx = any(":tcx:" in hook for hook in checks.get("tc", {}).get("tc_on_n0", []))
    floor = "noop-tcx" if tc_is_tcx and "noop-tcx" in by_name else "noop-tc"
    show("tc_of_noop_tc", "tc", floor, TARGET_TC_OF_NOOP, f"(target ≥ {TARGET_TC_OF_NOOP})")
    show("tc_of_iptables", "tc", "iptables", TARGET_TC_OF_IPTABLES,
         f"(target ≥ {TARGET_TC_OF_IPTABLES}; Cilium ≈1.7)")  # fmt: skip
    show("xdp_of_iptables", "xdp", "iptables", ANCHOR_XDP_OF_IPTABLES,
         f"(anchor: Cilium ≥ {ANCHOR_XDP_OF_IPTABLES})")  # fmt: skip
    show("xdp_of_noop_xdp", "xdp", "noop-xdp", None, "(XDP's own floor)")
    show("xdp_of_tc", "xdp", "tc", None, "")
    show("noop_xdp_of_noop_tc", "noop-xdp", "noop-tc", None, "(the two floors)")
    show("tc_tcx_of_clsact", "tc", "tc-clsact", None, "(kbp tc: tcx link / clsact filter)")
    show("noop_tcx_of_clsact", "noop-tcx", "noop-tc", None, "(empty: tcx link / clsact filter)")
    print("  Targets are judged on the raw rates; 'net of the generator' compares the "
          "forwarding costs (ns/pkt - gen-only), which the shared generator CPU compresses "
          "in the raw ratios.")  # fmt: skip
    medians = {s.name: statistics.median(summary_of(s).samples) for s in setups}
    return {"ratios": ratios, "median_pps": medians, "costs": costs, "problems": problems}


if __name__ == "__main__":
    sys.exit(main())
