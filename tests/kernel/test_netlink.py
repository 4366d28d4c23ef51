"""TcAttacher and LinkWatcher against a real kernel: programs attached to a lab pod's host
veth in the lab's node namespace count real traffic, a second attach replaces the program
in place, detach leaves other tools' filters alone, and the watcher reports new
interfaces well within a second. Nothing here touches the machine's own interfaces.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import subprocess
import threading
import time

import pytest

from agent.dataplane.ebpf.hops import HopEpoch
from agent.dataplane.ebpf.libbpf import Map
from agent.dataplane.ebpf.netlink import (
    FILTER_HANDLE,
    FILTER_PRIORITY,
    Attachment,
    Link,
    LinkWatcher,
    NetlinkError,
    PodInterfaces,
    RouteWatcher,
    TcAttacher,
)
from agent.lab.toolkit import SINK, in_netns
from tests.lab.nodelab import Lab

PORT = 8080
CONNECTIONS = 5

# Counts packets per hook: slot 0 at ingress (leaving the pod), slot 1 at egress (to it).
COUNTER_PROG = r"""
#include <uapi/linux/bpf.h>
#include <uapi/linux/pkt_cls.h>

BPF_ARRAY(kbp_test_counts, u64, 2);

int kbp_test_in(struct __sk_buff *skb)
{
    kbp_test_counts.increment(0);
    return TC_ACT_OK;
}

int kbp_test_out(struct __sk_buff *skb)
{
    kbp_test_counts.increment(1);
    return TC_ACT_OK;
}
"""


class Programs:
    """One load of COUNTER_PROG: its own program ids and its own counters."""

    def __init__(self) -> None:
        from bcc import BPF

        self.bpf = BPF(text=COUNTER_PROG.encode())
        self.fd_in = self.bpf.load_func(b"kbp_test_in", BPF.SCHED_CLS).fd
        self.fd_out = self.bpf.load_func(b"kbp_test_out", BPF.SCHED_CLS).fd

    def counts(self) -> tuple[int, int]:
        table = self.bpf[b"kbp_test_counts"]
        return table[0].value, table[1].value

    def close(self) -> None:
        self.bpf.cleanup()


def prog_id(fd: int) -> int:
    """The kernel's id of a BPF program fd of this process."""
    with open(f"/proc/self/fdinfo/{fd}") as info:
        for line in info:
            if line.startswith("prog_id:"):
                return int(line.split()[1])
    raise AssertionError(f"fd {fd} is not a BPF program")


def tc_filters(lab: Lab, ifname: str, direction: str) -> list[dict]:
    """Filters on one clsact hook as tc itself reports them (header entries dropped)."""
    out = lab.run_in_node("tc", "-j", "filter", "show", "dev", ifname, direction)
    return [f for f in json.loads(out or "[]") if "options" in f]


def has_clsact(lab: Lab, ifname: str) -> bool:
    out = lab.run_in_node("tc", "-j", "qdisc", "show", "dev", ifname)
    return any(q["kind"] == "clsact" for q in json.loads(out or "[]"))


def add_foreign_filter(lab: Lab, ifname: str, direction: str, pref: int, handle: int) -> None:
    """A classic-BPF filter another tool might own: nameless, answers 'no match'."""
    lab.run_in_node("tc", "qdisc", "replace", "dev", ifname, "clsact")
    lab.run_in_node(
        "tc", "filter", "add", "dev", ifname, direction, "pref", str(pref),
        "handle", hex(handle), "bpf", "bytecode", "1,6 0 0 0,",
    )  # fmt: skip


@pytest.fixture(scope="module")
def programs():
    """Two independent loads: attaching the second replaces the first."""
    first, second = Programs(), Programs()
    yield first, second
    first.close()
    second.close()


@pytest.fixture
def attacher(lab: Lab):
    made = TcAttacher(netns=lab.node_ns)
    yield made
    made.close()


@pytest.fixture
def pods(lab: Lab):
    client, server = lab.add_pod("client"), lab.add_pod("server")
    server.serve([PORT])
    return client, server


def attach_both(attacher: TcAttacher, index: int, progs: Programs) -> None:
    assert attacher.attach(index, "ingress", progs.fd_in, "kbp_test_in")
    assert attacher.attach(index, "egress", progs.fd_out, "kbp_test_out")


def test_attached_programs_count_traffic_in_both_directions(lab, attacher, pods, programs):
    client, server = pods
    progs, _ = programs
    attach_both(attacher, server.host_ifindex, progs)

    before = progs.counts()
    for ip in (server.ipv4, server.ipv6):
        result = client.connect_many(ip, PORT, "tcp", CONNECTIONS)
        assert result.counts == {"server": CONNECTIONS}, result
    after = progs.counts()

    # Each connection: SYN/ACK/data/FIN leave the client towards the server (egress of
    # the server's host veth) and the server's answers come back (its ingress).
    assert after[0] - before[0] >= 2 * 3 * CONNECTIONS
    assert after[1] - before[1] >= 2 * 3 * CONNECTIONS
    assert sorted(attacher.attached(), key=lambda a: a.direction) == [
        Attachment(server.host_ifindex, server.host_ifname, "egress", "kbp_test_out",
                   prog_id(progs.fd_out)),
        Attachment(server.host_ifindex, server.host_ifname, "ingress", "kbp_test_in",
                   prog_id(progs.fd_in)),
    ]  # fmt: skip
    (ingress,) = tc_filters(lab, server.host_ifname, "ingress")
    assert ingress["pref"] == FILTER_PRIORITY
    assert ingress["options"]["direct-action"] is True


def test_second_attach_replaces_the_program_in_place(lab, attacher, pods, programs):
    client, server = pods
    old, new = programs
    attach_both(attacher, server.host_ifindex, old)
    (before,) = tc_filters(lab, server.host_ifname, "egress")

    attach_both(attacher, server.host_ifindex, new)

    (after,) = tc_filters(lab, server.host_ifname, "egress")  # still exactly one filter
    assert (after["pref"], after["options"]["handle"]) == (before["pref"], hex(FILTER_HANDLE))
    assert before["options"]["prog"]["id"] == prog_id(old.fd_out)
    assert after["options"]["prog"]["id"] == prog_id(new.fd_out)
    assert {a.prog_id for a in attacher.attached()} == {prog_id(new.fd_in), prog_id(new.fd_out)}
    # Traffic now runs through the new program only.
    old_counts, new_counts = old.counts(), new.counts()
    assert client.connect_many(server.ipv4, PORT, "udp", CONNECTIONS).answered == CONNECTIONS
    assert old.counts() == old_counts
    assert new.counts()[1] - new_counts[1] >= CONNECTIONS


def test_detach_removes_only_our_filters(lab, attacher, pods, programs):
    _, server = pods
    progs, _ = programs
    ifname = server.host_ifname
    attach_both(attacher, server.host_ifindex, progs)
    add_foreign_filter(lab, ifname, "ingress", pref=2, handle=7)

    assert attacher.detach(server.host_ifindex) == 2

    assert attacher.attached() == []
    assert [f["options"]["handle"] for f in tc_filters(lab, ifname, "ingress")] == ["0x7"]
    assert tc_filters(lab, ifname, "egress") == []
    assert has_clsact(lab, ifname), "clsact removed although another filter still uses it"

    # Alone, our filters take clsact with them.
    lab.run_in_node("tc", "filter", "del", "dev", ifname, "ingress", "pref", "2")
    attach_both(attacher, server.host_ifindex, progs)
    assert attacher.detach(server.host_ifindex) == 2
    assert not has_clsact(lab, ifname)
    assert attacher.detach(server.host_ifindex) == 0  # nothing left: a no-op


def test_attach_refuses_to_replace_a_foreign_filter_and_names_the_interface(
    lab, attacher, pods, programs
):
    _, server = pods
    progs, _ = programs
    add_foreign_filter(lab, server.host_ifname, "ingress", FILTER_PRIORITY, FILTER_HANDLE)

    with pytest.raises(NetlinkError, match=f"{server.host_ifname}.*left it alone"):
        attacher.attach(server.host_ifindex, "ingress", progs.fd_in, "kbp_test_in")
    (foreign,) = tc_filters(lab, server.host_ifname, "ingress")
    assert "bytecode" in foreign["options"]


def test_attach_errors_name_the_interface(lab, attacher, pods):
    _, server = pods
    not_a_program = os.open("/dev/null", os.O_RDONLY)
    try:
        with pytest.raises(NetlinkError, match=f"ingress of interface {server.host_ifname} "):
            attacher.attach(server.host_ifindex, "ingress", not_a_program, "kbp_test_in")
    finally:
        os.close(not_a_program)
    with pytest.raises(ValueError, match="kbp_"):
        attacher.attach(server.host_ifindex, "ingress", 0, "not_ours")
    with pytest.raises(ValueError, match="direction"):
        attacher.attach(server.host_ifindex, "sideways", 0, "kbp_test_in")  # type: ignore[arg-type]


def test_vanished_interface_is_ignored(lab, attacher, programs):
    progs, _ = programs
    doomed = lab.add_pod("doomed")
    lab.remove_pod("doomed")  # its veth pair goes with its namespace

    assert attacher.attach(doomed.host_ifindex, "ingress", progs.fd_in, "kbp_test_in") is False
    assert attacher.detach(doomed.host_ifindex) == 0


def test_links_lists_the_namespace_interfaces(lab, attacher, pods):
    client, server = pods
    links = attacher.links()
    assert Link(client.host_ifindex, client.host_ifname) in links
    assert Link(server.host_ifindex, server.host_ifname) in links
    sink = {SINK, f"{SINK}-peer"}  # the lab's ClusterIP sink (lab.py)
    assert {link.name for link in links} == {"lo", client.host_ifname, server.host_ifname} | sink


def test_pod_interfaces_match_by_glob():
    default = PodInterfaces()
    assert [default.matches(n) for n in ("veth1a2b", "cali123", "lxc9", "eth0", "kbpveth")] == [
        True, True, True, False, False,
    ]  # fmt: skip
    assert PodInterfaces.from_text("tap*, vethkbp?").globs == ("tap*", "vethkbp?")
    with pytest.raises(ValueError):
        PodInterfaces([])


class Calls:
    """Records on_link callbacks with the time each arrived."""

    def __init__(self) -> None:
        self.links: list[tuple[float, Link]] = []
        self._arrived = threading.Condition()

    def __call__(self, link: Link) -> None:
        with self._arrived:
            self.links.append((time.monotonic(), link))
            self._arrived.notify_all()

    def wait_for(self, name: str, timeout: float) -> float | None:
        """When a callback for `name` arrived, waiting at most timeout; None if none."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while True:
                for arrived, link in self.links:
                    if link.name == name:
                        return arrived
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._arrived.wait(remaining)

    def names(self) -> list[str]:
        with self._arrived:
            return [link.name for _, link in self.links]


def test_watcher_reports_existing_new_and_renamed_interfaces(lab):
    existing = lab.add_pod("existing")
    calls = Calls()
    watcher = LinkWatcher(lab.node_ns, ["vethkbp*"], calls)
    watcher.start()
    try:
        assert calls.names() == [existing.host_ifname]  # the initial scan

        created = time.monotonic()
        fresh = lab.add_pod("fresh")
        arrived = calls.wait_for(fresh.host_ifname, timeout=1.0)
        assert arrived is not None, f"no callback for {fresh.host_ifname} within 1 s"
        assert arrived - created < 1.0

        # A link born with another name is reported when renamed into the globs.
        lab.run_in_node("ip", "link", "add", "kbptmp0", "type", "veth", "peer", "kbptmp1")
        lab.run_in_node("ip", "link", "set", "kbptmp0", "name", "vethkbprenamed")
        assert calls.wait_for("vethkbprenamed", timeout=1.0) is not None
        # Changes to a known link (state, addresses) are no new link.
        lab.run_in_node("ip", "link", "set", "vethkbprenamed", "up")
        time.sleep(0.2)
        assert calls.names() == [existing.host_ifname, fresh.host_ifname, "vethkbprenamed"]
    finally:
        watcher.stop()
    assert not any(t.name.startswith("kbp-linkwatch") for t in threading.enumerate())


def test_watcher_and_attacher_attach_a_new_pod_within_a_second(lab, attacher, programs):
    progs, _ = programs

    def attach_new(link: Link) -> None:
        attacher.attach(link.index, "ingress", progs.fd_in, "kbp_test_in")
        attacher.attach(link.index, "egress", progs.fd_out, "kbp_test_out")

    with LinkWatcher(attacher, ["vethkbp*"], attach_new):
        created = time.monotonic()
        pod = lab.add_pod("late")
        deadline = created + 1.0
        while time.monotonic() < deadline:
            if {a.ifname for a in attacher.attached()} == {pod.host_ifname}:
                break
            time.sleep(0.01)
        assert {(a.ifname, a.direction) for a in attacher.attached()} == {
            (pod.host_ifname, "ingress"),
            (pod.host_ifname, "egress"),
        }


def test_attacher_and_watcher_leave_no_threads_or_fds(lab):
    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    before = open_fds()
    for _ in range(3):
        attacher = TcAttacher(lab.node_ns)
        attacher.links()
        watcher = LinkWatcher(attacher, ["vethkbp*"], lambda link: None)
        watcher.start()
        watcher.stop()
        attacher.close()
    leaked = open_fds() - before
    assert not leaked, [os.readlink(f"/proc/self/fd/{fd}") for fd in leaked if fd.isdigit()]
    assert not any(t.name.startswith("kbp-") for t in threading.enumerate())
    with pytest.raises(NetlinkError, match="closed"):
        attacher.links()


def test_attacher_in_a_missing_namespace_fails_clearly():
    with pytest.raises(NetlinkError, match="kbp-lab-missing"):
        TcAttacher("kbp-lab-missing")
    # Unlike pyroute2's own netns= option, a missing namespace is not created.
    assert not os.path.exists("/run/netns/kbp-lab-missing")


def test_the_route_watcher_hears_what_a_next_hop_depends_on_and_nothing_else(netns) -> None:
    """RouteWatcher (the eBPF programs' next-hop epoch, hops.py) in a namespace of its own:
    a route, a rule, a link's MAC address, a neighbour's MAC address or its removal are
    heard; a neighbour going through its states with the same address, or a neighbour
    appearing, is not (a route added after it is the first thing heard)."""
    ns = netns()

    def ip(*argv: str) -> None:
        subprocess.run(in_netns(ns, ["ip", *argv]), check=True)

    # No IPv6 addresses, whose duplicate detection would add routes at its own time.
    subprocess.run(in_netns(ns, ["sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
                                 "net.ipv6.conf.default.disable_ipv6=1"]), check=True)  # fmt: skip
    ip("link", "add", "kbpdummy0", "type", "veth", "peer", "name", "kbpdummy1")
    ip("link", "set", "kbpdummy1", "up")
    ip("link", "set", "kbpdummy0", "up")
    ip("addr", "add", "10.9.0.1/24", "dev", "kbpdummy0")
    ip("neigh", "add", "10.9.0.2", "lladdr", "02:00:00:00:09:02", "nud", "reachable",
       "dev", "kbpdummy0")  # fmt: skip
    heard: queue.Queue[set[str]] = queue.Queue()
    watcher = RouteWatcher(ns, heard.put)
    watcher.start()  # learns the neighbour's address from its dump

    def until(cause: str) -> set[str]:
        """Everything heard up to (and with) the first call naming `cause`."""
        seen: set[str] = set()
        while cause not in seen:
            seen |= heard.get(timeout=5)
        return seen

    try:
        ip("neigh", "change", "10.9.0.2", "lladdr", "02:00:00:00:09:02", "nud", "stale",
           "dev", "kbpdummy0")  # fmt: skip
        ip("neigh", "add", "10.9.0.3", "lladdr", "02:00:00:00:09:03", "nud", "reachable",
           "dev", "kbpdummy0")  # fmt: skip
        ip("route", "add", "10.10.0.0/24", "via", "10.9.0.2")
        assert heard.get(timeout=5) == {"route"}
        ip("neigh", "change", "10.9.0.2", "lladdr", "02:00:00:00:09:04", "dev", "kbpdummy0")
        assert heard.get(timeout=5) == {"neighbour"}
        ip("rule", "add", "from", "10.11.0.0/24", "table", "100")
        assert heard.get(timeout=5) == {"rule"}
        ip("neigh", "del", "10.9.0.3", "dev", "kbpdummy0")
        assert heard.get(timeout=5) == {"neighbour"}
        # (which also flushes the link's neighbours: heard too, maybe in the same read)
        ip("link", "set", "kbpdummy0", "address", "02:00:00:00:09:99")
        assert "link" in until("link")
        assert watcher.failure is None
    finally:
        watcher.stop()


class _OneMap:
    """What HopEpoch asks of the loaded programs: kbp_hop_epoch, here a map of bcc's."""

    def __init__(self) -> None:
        from bcc import BPF

        self.bpf = BPF(text=b"BPF_ARRAY(kbp_hop_epoch, u32, 1);")
        self.table = Map(self.bpf[b"kbp_hop_epoch"].get_fd())

    def map(self, name: str) -> Map:
        assert name == "kbp_hop_epoch"
        return self.table


def test_the_next_hop_epoch_changes_with_what_the_watcher_hears_and_is_0_unwatched(
    netns,
) -> None:
    """HopEpoch (hops.py): a new epoch at start, whatever an earlier agent left, and at
    each change heard; 0 after a clean stop, and 0 when nobody watches (a killed agent's
    epoch would otherwise keep its cached next hops 10 s)."""
    ns = netns()
    programs = _OneMap()
    hops = HopEpoch(programs, ns)  # type: ignore[arg-type]
    programs.table.update(bytes(4), struct.pack("=I", 41))  # a killed agent's
    hops.start()
    try:
        assert hops.value == 42 and hops.changes == {"start": 1}
        subprocess.run(in_netns(ns, ["ip", "link", "set", "lo", "up"]), check=True)
        deadline = time.monotonic() + 5
        while hops.value == 42:  # lo's state, and the local routes that come with it
            assert time.monotonic() < deadline, hops.changes
            time.sleep(0.05)
        assert set(hops.changes) - {"start"} <= {"link", "route"}, hops.changes
        assert hops.status()["watching"] is True
    finally:
        hops.stop()
    assert hops.value == 0 and hops.status()["watching"] is False
    programs.table.update(bytes(4), struct.pack("=I", 7))
    HopEpoch(programs, ns).unwatched()  # type: ignore[arg-type]
    assert programs.map("kbp_hop_epoch").lookup(bytes(4)) == struct.pack("=I", 0)
