"""What PB-1's benchmarks share (bench/datapath.py, and bench/katran.py, which times
Katran's XDP balancer beside ours): the 64-byte frames they send, and the XDP program's
frames checked once to take the paths they are named for."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from agent.dataplane.ebpf import frames as P
from agent.dataplane.ebpf import inspect, libbpf
from agent.dataplane.ebpf.external import DEFAULT_SNAT_PORTS
from bench.common.kernel import NEXT_HOP_MAC
from bench.common.nodestates import (
    BACKEND_PORT,
    CLIENT,
    EXTERNAL_CLIENT,
    FRONTEND_PORT,
    NODE_ADDRESS,
    NODE_OWN_PORT,
    lb_vip_of,
)

FRAME_BYTES = 64  # a minimum-size Ethernet frame: the 54-byte SYN and trailer padding
XDP_PASS, XDP_TX, XDP_REDIRECT = 2, 3, 4


def frame(dst: str, sport: int, flags: str = "S", src: str = CLIENT, dport: int = 80) -> bytes:
    raw = P.tcp_frame(src, dst, sport, dport, flags=flags)
    return raw + bytes(FRAME_BYTES - len(raw))


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
