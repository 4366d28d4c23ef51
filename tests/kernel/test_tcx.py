"""tc programs as tcx links (TcAttacher with a pin directory) against a real kernel: the
attach is tcx where the kernel has it, traffic passes, a second attach swaps the program
in the pinned link, moving a hook from clsact to tcx and back loses no packet and counts
none twice, other tools' tcx links and clsact filters stay, a removed interface leaves
no pin, and cleanup leaves no link, pin or filter.

Address plan: the lab's pods (client, server; 10.244.x.y in the lab's node namespace);
UDP datagrams from client to server port 9999 are what the counting programs count, on
the server's host veth egress (towards the server pod).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.dataplane.ebpf import inspect, libbpf
from agent.dataplane.ebpf.dataplane import cleanup
from agent.dataplane.ebpf.netlink import (
    TCX_PIN_PREFIX,
    TcAttacher,
    run_in_netns,
    tcx_supported,
)
from tests.lab.nodelab import Lab, Pod

from ..conftest import kernel_required
from .test_netlink import has_clsact, tc_filters

COUNTED_PORT = 9999

# Counts UDP/IPv4 datagrams to COUNTED_PORT in slot 0; `other_count` does the same in its
# own table and lets the packet go on to the next program (TCX_NEXT), as a CNI's might.
COUNTING_PROG = rf"""
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/udp.h>

BPF_ARRAY(counts, u64, 1);

static __always_inline int counted(struct __sk_buff *skb)
{{
    void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;
    struct ethhdr *eth = data;
    struct iphdr *ip = (void *)(eth + 1);
    struct udphdr *udp = (void *)(ip + 1);
    if ((void *)(udp + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP))
        return 0;
    return ip->protocol == 17 /* UDP */ && ip->ihl == 5 && udp->dest == bpf_htons({COUNTED_PORT});
}}

int kbp_count(struct __sk_buff *skb)
{{
    if (counted(skb))
        counts.increment(0);
    return TC_ACT_OK;
}}

int other_count(struct __sk_buff *skb)
{{
    if (counted(skb))
        counts.increment(0);
    return -1;  /* TCX_NEXT / TC_ACT_UNSPEC: the next program decides */
}}
"""


class Counter:
    """One load of COUNTING_PROG: a program (ours or the other tool's) and its count."""

    def __init__(self, function: str = "kbp_count") -> None:
        from bcc import BPF

        self.bpf = BPF(text=COUNTING_PROG.encode())
        self.fd = self.bpf.load_func(function.encode(), BPF.SCHED_CLS).fd
        self.id = libbpf.prog_id(self.fd)

    @property
    def count(self) -> int:
        return self.bpf[b"counts"][0].value

    def close(self) -> None:
        self.bpf.cleanup()


@pytest.fixture(scope="module", autouse=True)
def _tcx_kernel() -> None:
    if not tcx_supported():
        why = f"kernel {os.uname().release} has no tcx (Linux 6.6+)"
        if kernel_required():
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture
def counters() -> Iterator[list[Counter]]:
    made: list[Counter] = []
    yield made
    for counter in made:
        counter.close()


def counter(counters: list[Counter], function: str = "kbp_count") -> Counter:
    made = Counter(function)
    counters.append(made)
    return made


@pytest.fixture
def pin_dir(bpf_pin_dir: Path) -> Path:
    """The suite's bpffs directory for this test (removed with its pins afterwards)."""
    return bpf_pin_dir


@pytest.fixture
def pods(lab: Lab) -> tuple[Pod, Pod]:
    client, server = lab.add_pod("client"), lab.add_pod("server")
    server.serve([8080])
    return client, server


def attacher_for(lab: Lab, pin_dir: Path, mode: str) -> TcAttacher:
    return TcAttacher(lab.node_ns, pin_dir, mode)


def tcx_programs(lab: Lab, index: int, direction: str = "egress") -> list[tuple[int, int]]:
    kind = libbpf.BPF_TCX_EGRESS if direction == "egress" else libbpf.BPF_TCX_INGRESS
    return run_in_netns(lab.node_ns, lambda: libbpf.tcx_query(index, kind))


def send_datagrams(client: Pod, server: Pod, count: int, pace: float = 0.0) -> None:
    """`count` UDP datagrams from the client pod to the server pod's COUNTED_PORT."""

    def send() -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _ in range(count):
                sock.sendto(b"x", (server.ipv4, COUNTED_PORT))
                if pace:
                    time.sleep(pace)

    run_in_netns(client.ns, send)


def settle(*counted: Counter, total: int, timeout: float = 5.0) -> int:
    """The sum of the counts once it reached `total` (or the deadline passed)."""
    deadline = time.monotonic() + timeout
    while (seen := sum(c.count for c in counted)) < total and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def test_auto_attaches_tcx_links_pinned_and_traffic_passes(lab, pods, pin_dir, counters):
    client, server = pods
    ours = counter(counters)
    with attacher_for(lab, pin_dir, "auto") as attacher:
        assert attacher.mode == "tcx"
        assert attacher.attach(server.host_ifindex, "egress", ours.fd, "kbp_count")
        assert attacher.attach(server.host_ifindex, "ingress", ours.fd, "kbp_count")
        found = attacher.attached()
    assert {(a.ifname, a.direction, a.hook, a.prog_id) for a in found} == {
        (server.host_ifname, "egress", "tcx", ours.id),
        (server.host_ifname, "ingress", "tcx", ours.id),
    }
    assert sorted(p.name for p in pin_dir.iterdir()) == [
        f"{TCX_PIN_PREFIX}{server.host_ifindex}_egress",
        f"{TCX_PIN_PREFIX}{server.host_ifindex}_ingress",
    ]
    assert not has_clsact(lab, server.host_ifname)  # no qdisc: tcx needs none
    # The attacher is closed: the pins hold the links, traffic still meets the program.
    send_datagrams(client, server, 50)
    assert settle(ours, total=50) == 50
    result = client.connect_many(server.ipv4, 8080, "tcp", 5)
    assert result.errors == {}, result.details
    # bpftool sees the pinned link (v7.1 may print the link type as a number).
    shown = json.loads(subprocess.run(
        ["bpftool", "-j", "link", "show", "pinned",
         str(pin_dir / f"{TCX_PIN_PREFIX}{server.host_ifindex}_egress")],
        capture_output=True, text=True, check=True,
    ).stdout)  # fmt: skip
    assert shown["prog_id"] == ours.id
    # `kube-bpf-proxy inspect tc` in the node's namespace lists the links and their pins.
    rows = run_in_netns(lab.node_ns, lambda: inspect.tc(pin_dir))
    assert [(r["interface"], r["direction"], r["hook"], r["progId"], r["pin"]) for r in rows] == [
        (
            server.host_ifname,
            d,
            "tcx",
            ours.id,
            str(pin_dir / f"{TCX_PIN_PREFIX}{server.host_ifindex}_{d}"),
        )
        for d in ("egress", "ingress")
    ]


def test_a_second_attach_swaps_the_program_in_the_pinned_link_losing_nothing(
    lab, pods, pin_dir, counters
):
    client, server = pods
    first, second = counter(counters), counter(counters)
    with attacher_for(lab, pin_dir, "tcx") as attacher:
        assert attacher.attach(server.host_ifindex, "egress", first.fd, "kbp_count")
        (link_before,) = [a.link_id for a in attacher.attached()]
    total = 400
    sender = threading.Thread(target=send_datagrams, args=(client, server, total, 0.002))
    sender.start()
    try:
        time.sleep(0.2)
        # A restarted agent: a new attacher on the same pins.
        with attacher_for(lab, pin_dir, "tcx") as attacher:
            assert attacher.attach(server.host_ifindex, "egress", second.fd, "kbp_count")
            (after,) = attacher.attached()
    finally:
        sender.join()
    assert (after.link_id, after.prog_id) == (link_before, second.id)
    assert tcx_programs(lab, server.host_ifindex) == [(second.id, link_before)]
    # Every datagram met exactly one of the two programs: no gap, none counted twice.
    assert settle(first, second, total=total) == total
    assert first.count > 0 and second.count > 0, (first.count, second.count)


def test_clsact_to_tcx_and_back_under_traffic_loses_and_doubles_nothing(
    lab, pods, pin_dir, counters
):
    client, server = pods
    old, new, back = counter(counters), counter(counters), counter(counters)
    index = server.host_ifindex
    stream = client.stream(server.ipv4, 8080)
    total = 600
    sender = threading.Thread(target=send_datagrams, args=(client, server, total, 0.002))
    try:
        with attacher_for(lab, pin_dir, "clsact") as attacher:
            assert attacher.mode == "clsact"
            assert attacher.attach(index, "egress", old.fd, "kbp_count")
            assert attacher.attach(index, "ingress", old.fd, "kbp_count")
        assert len(tc_filters(lab, server.host_ifname, "egress")) == 1
        sender.start()
        time.sleep(0.3)
        # The upgraded agent: tcx first, then our filters and the qdisc go.
        with attacher_for(lab, pin_dir, "auto") as attacher:
            for direction in ("egress", "ingress"):
                assert attacher.attach(index, direction, new.fd, "kbp_count")
            hooks = {(a.direction, a.hook) for a in attacher.attached()}
        assert hooks == {("egress", "tcx"), ("ingress", "tcx")}
        assert not has_clsact(lab, server.host_ifname)
        time.sleep(0.3)
        # Forced back to clsact: the filters first, then the links and their pins go.
        with attacher_for(lab, pin_dir, "clsact") as attacher:
            for direction in ("egress", "ingress"):
                assert attacher.attach(index, direction, back.fd, "kbp_count")
            hooks = {(a.direction, a.hook) for a in attacher.attached()}
        assert hooks == {("egress", "clsact"), ("ingress", "clsact")}
        assert tcx_programs(lab, index) == [] and list(pin_dir.iterdir()) == []
        sender.join()
        assert settle(old, new, back, total=total) == total
        assert min(old.count, new.count, back.count) > 0, (old.count, new.count, back.count)
        ok_before, _ = stream.check()
        _, error = stream.wait_for(ok_before + 3)
        assert error is None, f"stream across the moves: {error}"
    finally:
        if sender.is_alive():
            sender.join()
        stream.close()


def test_while_both_are_attached_only_the_tcx_program_runs(lab, pods, pin_dir, counters):
    """The order the migration relies on: tcx runs before clsact, and our verdict
    (TC_ACT_OK) ends the hook, so the clsact copy does not see the packet again."""
    client, server = pods
    clsact, tcx = counter(counters), counter(counters)
    index = server.host_ifindex
    with attacher_for(lab, pin_dir, "clsact") as attacher:
        assert attacher.attach(index, "egress", clsact.fd, "kbp_count")

    def link() -> int:
        return libbpf.tcx_link_create(tcx.fd, index, libbpf.BPF_TCX_EGRESS)

    link_fd = run_in_netns(lab.node_ns, link)
    try:
        send_datagrams(client, server, 30)
        assert settle(tcx, total=30) == 30
        assert clsact.count == 0
    finally:
        os.close(link_fd)  # unpinned: closing it detaches the link
    send_datagrams(client, server, 10)
    assert settle(clsact, total=10) == 10


def test_other_tools_programs_stay_and_ours_runs_first(lab, pods, pin_dir, counters):
    client, server = pods
    ours, theirs = counter(counters), counter(counters, "other_count")
    index = server.host_ifindex
    their_link = run_in_netns(
        lab.node_ns, lambda: libbpf.tcx_link_create(theirs.fd, index, libbpf.BPF_TCX_EGRESS)
    )
    try:
        lab.run_in_node("tc", "qdisc", "add", "dev", server.host_ifname, "clsact")
        lab.run_in_node("tc", "filter", "add", "dev", server.host_ifname, "egress", "pref",
                        "7", "bpf", "bytecode", "1,6 0 0 0,")  # fmt: skip
        with attacher_for(lab, pin_dir, "tcx") as attacher:
            assert attacher.attach(index, "egress", ours.fd, "kbp_count")
            assert [p for p, _ in tcx_programs(lab, index)] == [ours.id, theirs.id]
            send_datagrams(client, server, 20)
            assert settle(ours, total=20) == 20
            assert attacher.detach(index) == 1
        assert [p for p, _ in tcx_programs(lab, index)] == [theirs.id]
        assert len(tc_filters(lab, server.host_ifname, "egress")) == 1  # theirs, untouched
        assert list(pin_dir.iterdir()) == []
        send_datagrams(client, server, 20)
        assert settle(theirs, total=20) == 20
    finally:
        os.close(their_link)


def test_a_removed_interface_leaves_no_pin(lab, pods, pin_dir, counters):
    _, server = pods
    gone = lab.add_pod("gone")
    ours = counter(counters)
    with attacher_for(lab, pin_dir, "tcx") as attacher:
        for pod in (server, gone):
            assert attacher.attach(pod.host_ifindex, "egress", ours.fd, "kbp_count")
        lab.remove_pod("gone")
        assert attacher.forget(gone.host_ifindex) == [f"{TCX_PIN_PREFIX}{gone.host_ifindex}_egress"]
        assert attacher.attach(gone.host_ifindex, "egress", ours.fd, "kbp_count") is False
        assert [p.name for p in pin_dir.iterdir()] == [
            f"{TCX_PIN_PREFIX}{server.host_ifindex}_egress"
        ]
    # An interface removed while no agent ran: the next attacher unpins its defunct link.
    third = lab.add_pod("third")
    with attacher_for(lab, pin_dir, "tcx") as attacher:
        assert attacher.attach(third.host_ifindex, "egress", ours.fd, "kbp_count")
    lab.remove_pod("third")
    with attacher_for(lab, pin_dir, "tcx"):
        pass
    assert [p.name for p in pin_dir.iterdir()] == [f"{TCX_PIN_PREFIX}{server.host_ifindex}_egress"]


def test_cleanup_leaves_no_link_pin_or_filter(lab, pods, pin_dir, counters):
    client, server = pods
    ours = counter(counters)
    with attacher_for(lab, pin_dir, "tcx") as attacher:
        assert attacher.attach(server.host_ifindex, "egress", ours.fd, "kbp_count")
        assert attacher.attach(server.host_ifindex, "ingress", ours.fd, "kbp_count")
    with attacher_for(lab, pin_dir, "clsact") as attacher:
        assert attacher.attach(client.host_ifindex, "egress", ours.fd, "kbp_count")
    # `kube-bpf-proxy cleanup` runs a TcAttacher without a pin directory.
    with TcAttacher(lab.node_ns) as attacher:
        interfaces, _ = cleanup(pin_dir, attacher)
        assert attacher.attached() == []
    assert sorted(interfaces) == sorted([client.host_ifname, server.host_ifname])
    for pod in (client, server):
        assert tcx_programs(lab, pod.host_ifindex, "egress") == []
        assert tcx_programs(lab, pod.host_ifindex, "ingress") == []
        assert not has_clsact(lab, pod.host_ifname)
    assert not pin_dir.exists()  # remove_pins took the directory, left empty


def test_tcx_mode_without_a_pin_directory_is_refused(lab, monkeypatch):
    with pytest.raises(ValueError, match="pin"):
        TcAttacher(lab.node_ns, None, "tcx")
    # From the environment it is the agent's choice: tools without pins still start.
    monkeypatch.setenv("KBP_TC_ATTACH", "tcx")
    with TcAttacher(lab.node_ns) as attacher:
        assert attacher.mode == "clsact" and attacher.attached() == []
    with pytest.raises(ValueError, match="one of"):
        TcAttacher(lab.node_ns, None, "sideways")
