"""Both dataplanes end to end, one scenario suite: NodeStates compiled from Kubernetes
objects, programmed by the eBPF and by the iptables dataplane, and ordinary TCP/UDP
clients in lab pods connecting to ClusterIPs.

Address plan (tests/lab/nodelab.py): one node namespace (this is node-a) with pods
    client1 10.244.1.1   client2 10.244.1.2
    be1 10.244.1.3       be2 10.244.1.4       be3 10.244.1.5     (fd00:244:1::N too)
every backend serving TCP and UDP on 8080 and answering with its pod name.
The node routes the ClusterIP ranges into a sink interface (see lab.py): untranslated
Service traffic times out, and reaches the FORWARD hook where iptables can REJECT it.
Services get ClusterIPs 10.96.0.x and fd00:96::x; endpoints "elsewhere" are on node-b
(10.244.2.x), which does not exist in the lab: they must never receive traffic here.

Every scenario runs once per dataplane: eBPF with --socket-lb all (the pods' sockets are
translated at connect() by the cgroup hooks, attached to a cgroup the lab made and every
pod process runs in), eBPF with --socket-lb off (the pods go through tc), and iptables
(ids like `[ebpf-all-TCP]`, `[ebpf-off-TCP]`, `[iptables-TCP]`). One lab and one
dataplane serve all of a dataplane's scenarios (building them takes seconds); each test
programs its own Services, so a test's state replaces the previous one. A scenario that
does not apply to one dataplane says so in its parametrisation (`not_on`), and the reason
shows in pytest's report. Where the socket hooks answer differently from a packet path
(a DROP fails connect() at once with EHOSTUNREACH instead of a timeout), the test says
so through `Env.dropped`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from agent.dataplane.base import Dataplane, DataplaneError
from agent.dataplane.ebpf.abi import versioned
from agent.dataplane.ebpf.dataplane import EbpfDataplane, remove_pins
from agent.dataplane.ebpf.maps import MapSizes
from agent.dataplane.ebpf.options import EbpfOptions, SocketLb, TcAttach, Xdp
from agent.dataplane.ebpf.pods import cookie_key
from agent.lab.toolkit import PODCLIENT
from agent.model.compile import compile
from agent.model.nodestate import NodeState
from tests.lab.nodelab import Lab, Pod, Stream

from ..builders import default_nodes, make_endpoint, make_service, make_slice, state_of
from .tchooks import our_tc_programs

DATAPLANES = ("ebpf-all", "ebpf-off", "iptables", "nftables")  # eBPF: --socket-lb all and off
# The dataplanes that program netfilter (not_on marks of eBPF-only scenarios name both).
NETFILTER = ("iptables", "nftables")
POD_INTERFACES = ("vethkbp*",)
PORT = 8080
BACKENDS = ("be1", "be2", "be3")
UDP_SOURCE_PORT = 40123  # fixed, so two clients one after the other are one UDP flow


class Env:
    """One lab with its pods and the dataplane under test programming it."""

    def __init__(self, lab: Lab, param: str, pin_dir: Path, sizes: MapSizes | None = None) -> None:
        self.lab = lab
        self.sizes = sizes or MapSizes(4096, 65536, 4096, 4096, 1024)
        self.kind, _, socket_lb = param.partition("-")
        self.socket_lb = socket_lb or None  # eBPF: --socket-lb
        self.pin_dir = pin_dir  # eBPF only
        self.tc_attach: str | None = None  # eBPF: --tc-attach (None: $KBP_TC_ATTACH or auto)
        self.pods = lab.pods
        self.dataplane: Dataplane | None = None
        self.next_ip = 10

    def pod(self, name: str) -> Pod:
        return self.pods[name]

    def start_dataplane(self) -> Dataplane:
        """A new dataplane object on this lab: the first one, or a restarted agent's (the
        eBPF one reopens the pinned maps and replaces the programs in place)."""
        if self.kind == "ebpf":
            assert self.socket_lb is not None
            tc_attach = TcAttach(self.tc_attach) if self.tc_attach is not None else None
            return EbpfDataplane(EbpfOptions(
                self.pin_dir, POD_INTERFACES, self.sizes, netns=self.lab.node_ns,
                cgroup=self.lab.cgroup, socket_lb=SocketLb(self.socket_lb), tc_attach=tc_attach,
            ))  # fmt: skip
        if self.kind == "nftables":
            from agent.dataplane.nftables.dataplane import NftablesDataplane

            return NftablesDataplane(POD_INTERFACES, netns=self.lab.node_ns)
        from agent.dataplane.iptables.dataplane import IptablesDataplane

        return IptablesDataplane(POD_INTERFACES, netns=self.lab.node_ns)

    def program(self, *objects: dict) -> NodeState:
        state = compile(state_of(*default_nodes(), *objects), "node-a")
        self.running().apply(state)
        return state

    def running(self) -> Dataplane:
        assert self.dataplane is not None, "no dataplane: an earlier restart failed"
        return self.dataplane

    @property
    def sockets_translated(self) -> bool:
        """Do the socket hooks translate the pods' connect() here (--socket-lb all)?"""
        return self.kind == "ebpf" and self.socket_lb == "all"

    @property
    def dropped(self) -> str:
        """The error class a client sees for a DROP: connect() fails at once when the
        socket hooks decide, a packet path leaves it to time out."""
        return "unreachable" if self.sockets_translated else "timeout"

    def cluster_ip(self) -> tuple[str, str]:
        """A fresh ClusterIP pair per Service, so no test inherits another's flows."""
        self.next_ip += 1
        return f"10.96.0.{self.next_ip}", f"fd00:96::{self.next_ip:x}"

    def remove_dataplane(self) -> list[str]:
        """Clean up through the dataplane (or, when none is running, through the module's
        cleanup function); returns whatever is still left behind afterwards."""
        try:
            if self.dataplane is not None:
                self.dataplane.cleanup()
            elif self.kind == "ebpf":
                from agent.dataplane.ebpf.dataplane import cleanup
                from agent.dataplane.ebpf.netlink import TcAttacher

                with TcAttacher(self.lab.node_ns) as attacher:
                    cleanup(self.pin_dir, attacher)
            elif self.kind == "nftables":
                from agent.dataplane.nftables.dataplane import cleanup as cleanup_nft

                cleanup_nft(netns=self.lab.node_ns)
            else:
                from agent.dataplane.iptables.dataplane import cleanup

                cleanup(netns=self.lab.node_ns)
        finally:
            left = self.leftovers()
            if self.kind == "ebpf":
                remove_pins(self.pin_dir)  # never leave pins behind, even after a failure
            # iptables rules and tc filters go away with the node namespace itself
        return left

    def leftovers(self) -> list[str]:
        """What the dataplane installed and is still there: pins and tc filters for eBPF,
        KBP- chains and rules for iptables."""
        if self.kind == "ebpf":
            left = []
            if self.pin_dir.exists():
                left = [str(pin) for pin in sorted(self.pin_dir.iterdir())] or [str(self.pin_dir)]
            for pod in self.pods.values():
                hooks = our_tc_programs(self.lab.node_ns, pod.host_ifname)
                left += [f"{pod.host_ifname} {hook}" for hook in hooks]
            return left
        if self.kind == "nftables":
            tables = self.lab.run_in_node("nft", "list", "tables")
            return [line for line in tables.splitlines() if "kube-bpf-proxy" in line]
        rules = self.lab.run_in_node("iptables-save") + self.lab.run_in_node("ip6tables-save")
        return [line for line in rules.splitlines() if "KBP-" in line]


@contextlib.contextmanager
def lab_env(
    param: str,
    clients: Sequence[str],
    protos: Sequence[str],
    pins: str,
    sizes: MapSizes | None = None,
    *,
    cgroup: bool = False,
) -> Iterator[Env]:
    """A lab of the `clients` pods and BACKENDS serving PORT over `protos`, programmed by
    the `param` dataplane (pins in BPFFS/`pins`-N; `cgroup`: the pods' own cgroup for the
    eBPF socket hooks); asserts at the end that the dataplane left nothing behind."""
    from ..conftest import (
        BPFFS,
        missing_kernel_prerequisites,
        require_iptables,
        require_nftables,
    )

    if missing_kernel_prerequisites():
        pytest.skip("kernel prerequisites missing")  # the per-test hook reports why
    kind = param.partition("-")[0]
    with Lab(cgroup=cgroup and kind == "ebpf") as lab:
        for name in clients:
            lab.add_pod(name)
        for name in BACKENDS:
            lab.add_pod(name).serve([PORT], protos)
        if kind == "iptables":
            require_iptables(lab.node_ns)
        if kind == "nftables":
            require_nftables(lab.node_ns)
        made = Env(lab, param, BPFFS / f"{pins}-{time.monotonic_ns()}", sizes)
        try:
            made.dataplane = made.start_dataplane()
            yield made
        finally:
            left = made.remove_dataplane()
        assert left == [], f"{kind} cleanup left behind: {left}"


@pytest.fixture(scope="module", params=DATAPLANES)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    clients, protos = ("client1", "client2"), ("tcp", "udp")
    with lab_env(request.param, clients, protos, "kbp-test-dataplane", cgroup=True) as made:
        yield made


def not_on(kind: str | tuple[str, ...], reason: str) -> pytest.MarkDecorator:
    """This scenario does not apply to the `kind` dataplane(s): skipped there with
    `reason`, run on the others (the same module-scoped `env` fixtures, chosen
    indirectly)."""
    kinds = (kind,) if isinstance(kind, str) else kind
    skip = pytest.mark.skip(reason=f"not on {' or '.join(kinds)}: {reason}")
    return pytest.mark.parametrize(
        "env",
        [pytest.param(k, marks=skip) if k.partition("-")[0] in kinds else k for k in DATAPLANES],
        indirect=True,
    )


def service(
    env: Env,
    name: str,
    endpoints: list[dict],
    *,
    protocol: str = "TCP",
    dual_stack: bool = False,
    mutate: Callable[[dict], None] | None = None,
    ip4: str | None = None,
) -> tuple[list[dict], str, str]:
    """A Service on port 80 → 8080 with one slice per family; (objects, v4 IP, v6 IP).
    A fresh ClusterIP unless ip4 names the one of an earlier version of the Service."""
    fresh4, ip6 = env.cluster_ip()
    ip4 = ip4 or fresh4

    def spec(obj: dict) -> None:
        obj["spec"]["clusterIP"] = ip4
        obj["spec"]["clusterIPs"] = [ip4, ip6] if dual_stack else [ip4]
        if dual_stack:
            obj["spec"]["ipFamilies"] = ["IPv4", "IPv6"]
            obj["spec"]["ipFamilyPolicy"] = "RequireDualStack"
        obj["spec"]["ports"][0]["protocol"] = protocol
        if mutate is not None:
            mutate(obj)

    def ports(obj: dict) -> None:
        obj["ports"][0]["protocol"] = protocol

    objects = [make_service(name=name, mutate=spec)]
    v4 = [e for e in endpoints if ":" not in e["addresses"][0]]
    v6 = [e for e in endpoints if ":" in e["addresses"][0]]
    objects.append(make_slice(name=f"{name}-v4", service=name, endpoints=v4, mutate=ports))
    if dual_stack:
        objects.append(
            make_slice(name=f"{name}-v6", service=name, endpoints=v6, mutate=ports, family="IPv6")
        )
    return objects, ip4, ip6


def local(pod: Pod, family: int = 4, **conditions: bool) -> dict:
    return make_endpoint(pod.ipv4 if family == 4 else pod.ipv6, "node-a", **conditions)


def backends(env: Env, *names: str, family: int = 4) -> list[dict]:
    return [local(env.pod(n), family) for n in names]


def restarted(env: Env, state: NodeState) -> int:
    """The agent stopped (what it programmed stays in the kernel) and a new one started
    with env's settings on the same node; returns the writes of its first apply of
    `state`. The new one serves the rest of the test."""
    env.running().close()
    env.dataplane = None
    env.dataplane = env.start_dataplane()
    return env.dataplane.apply(state)


def assert_echoing(streams: Sequence[Stream], where: str) -> None:
    """Each stream still echoes: five more messages come back (it was not cut)."""
    for stream in streams:
        ok_before, _ = stream.check()
        _, error = stream.wait_for(ok_before + 5)
        assert error is None, f"stream to {stream.backend} {where}: {error}"


# --- balancing --------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["TCP", "UDP"])
def test_connections_to_a_cluster_ip_reach_every_backend(env: Env, protocol: str) -> None:
    objects, ip4, _ = service(env, f"web-{protocol.lower()}", backends(env, *BACKENDS),
                              protocol=protocol)  # fmt: skip
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, protocol.lower(), 60)
    assert result.errors == {}, result.details
    assert set(result.counts) == set(BACKENDS), result.counts


@pytest.mark.parametrize("protocol", ["TCP", "UDP"])
def test_ipv6_connections_to_a_cluster_ip_reach_every_backend(env: Env, protocol: str) -> None:
    endpoints = backends(env, *BACKENDS) + backends(env, *BACKENDS, family=6)
    objects, _, ip6 = service(env, f"web6-{protocol.lower()}", endpoints, protocol=protocol,
                              dual_stack=True)  # fmt: skip
    env.program(*objects)
    result = env.pod("client1").connect_many(ip6, 80, protocol.lower(), 60)
    assert result.errors == {}, result.details
    assert set(result.counts) == set(BACKENDS), result.counts


def test_client_ip_affinity_keeps_each_client_on_one_backend(env: Env) -> None:
    def affinity(obj: dict) -> None:
        obj["spec"]["sessionAffinity"] = "ClientIP"
        obj["spec"]["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 60}}

    objects, ip4, _ = service(env, "sticky", backends(env, *BACKENDS), mutate=affinity)
    env.program(*objects)
    for client in ("client1", "client2"):
        result = env.pod(client).connect_many(ip4, 80, "tcp", 20)
        assert result.errors == {}, result.details
        assert len(result.counts) == 1, f"{client} spread over {result.counts}"


def test_maglev_service_reaches_every_backend(env: Env) -> None:
    # iptables has no Maglev: it selects at random, which must reach every backend too.
    def maglev(obj: dict) -> None:
        obj["metadata"]["annotations"] = {"kube-bpf-proxy.io/lb-algorithm": "maglev"}

    objects, ip4, _ = service(env, "hashed", backends(env, *BACKENDS), protocol="UDP",
                              mutate=maglev)  # fmt: skip
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, "udp", 60)
    assert result.errors == {}, result.details
    assert set(result.counts) == set(BACKENDS), result.counts


# --- changes ----------------------------------------------------------------------------


def test_removed_backend_gets_no_new_connections_and_others_keep_theirs(env: Env) -> None:
    objects, ip4, _ = service(env, "shrink", backends(env, *BACKENDS))
    env.program(*objects)
    streams = [env.pod("client1").stream(ip4, 80) for _ in range(6)]
    try:
        by_backend = {s.backend for s in streams}
        assert by_backend <= set(BACKENDS)
        gone = "be1"
        objects, _, _ = service(env, "shrink", backends(env, "be2", "be3"), ip4=ip4)
        env.program(*objects)
        result = env.pod("client2").connect_many(ip4, 80, "tcp", 40)
        assert result.errors == {}, result.details
        assert set(result.counts) == {"be2", "be3"}, result.counts
        assert_echoing([s for s in streams if s.backend != gone], "that survived")
        # and an added backend gets traffic
        objects, _, _ = service(env, "shrink", backends(env, *BACKENDS), ip4=ip4)
        env.program(*objects)
        result = env.pod("client2").connect_many(ip4, 80, "tcp", 60)
        assert set(result.counts) == set(BACKENDS), result.counts
    finally:
        for stream in streams:
            stream.close()


def test_udp_flow_to_a_removed_backend_moves_to_another(env: Env) -> None:
    objects, ip4, _ = service(env, "udp-move", backends(env, *BACKENDS), protocol="UDP")
    env.program(*objects)
    client = env.pod("client1")

    def one_flow() -> dict[str, int]:
        """Five datagrams from one socket on a fixed source port: one UDP flow, which
        the next call continues (same 5-tuple)."""
        result = client.connect_many(ip4, 80, "udp", 5, source_port=UDP_SOURCE_PORT,
                                     same_socket=True)  # fmt: skip
        assert result.errors == {}, result.details
        assert len(result.counts) == 1, f"one flow spread over {result.counts}"
        return dict(result.counts)

    (gone,) = one_flow()
    assert one_flow() == {gone: 5}  # the flow keeps its backend while the set is unchanged
    kept = [name for name in BACKENDS if name != gone]
    objects, _, _ = service(env, "udp-move", backends(env, *kept), protocol="UDP", ip4=ip4)
    env.program(*objects)
    (now,) = one_flow()
    assert now in kept, f"the flow stayed on removed backend {gone}"


@pytest.mark.parametrize("sweep", [False, True], ids=["gate-unbuilt", "swept"])
def test_one_client_port_alternating_between_a_service_and_its_backend(
    env: Env, sweep: bool
) -> None:
    """A pod reaches a Service, then the backend's own address, then the Service again,
    all from one source port (what the socket hooks and tc together produce when a pod's
    connections are translated now at connect(), now at tc): every connection works.
    `swept`: the collector runs before each connection, so tc consults kbp_ct_gate as the
    collector built it (the closed flow's entries are kept until their time-wait ends),
    not only as the datapath set it."""
    objects, ip4, _ = service(env, "reuse-swept" if sweep else "reuse", backends(env, "be1"))
    env.program(*objects)
    client, backend = env.pod("client1"), env.pod("be1")
    port = UDP_SOURCE_PORT + (2 if sweep else 1)
    for ip, target in ((ip4, 80), (backend.ipv4, PORT), (ip4, 80), (backend.ipv4, PORT),
                       (ip4, 80)):  # fmt: skip
        if sweep and isinstance(env.running(), EbpfDataplane):
            env.running().conntrack.run_once()  # type: ignore[attr-defined]
        result = client.connect_many(ip, target, "tcp", 1, source_port=port)
        assert result.counts == {"be1": 1}, (ip, result.details)


@pytest.mark.parametrize("family", [4, 6], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("protocol", ["tcp", "udp"])
@pytest.mark.parametrize("mode", ["reuse", "pair"])
def test_a_bound_client_port_reaches_two_services_that_share_their_backend(
    env: Env, mode: str, protocol: str, family: int
) -> None:
    """A client binds one source port for two Services whose only endpoint is the same
    pod: `reuse`, one after the other (TCP: the first closed, its TIME_WAIT held by the
    client), `pair`, both open at once. kube-proxy's NAT remaps the clashing port; so must
    we. Translated at connect(), the second socket's tuple would be the first's, which the
    kernel refuses (TCP) or confuses (UDP answers reach the wrong socket): the socket hook
    leaves it to tc, which remaps it (counted as a remap)."""
    both = backends(env, "be1") + backends(env, "be1", family=6)
    name = f"{mode}-{protocol}-v{family}"
    first, a4, a6 = service(env, f"{name}-a", both, protocol=protocol.upper(), dual_stack=True)
    second, b4, b6 = service(env, f"{name}-b", both, protocol=protocol.upper(), dual_stack=True)
    ip_a, ip_b = (a4, b4) if family == 4 else (a6, b6)
    env.program(*first, *second)
    ebpf = env.running() if isinstance(env.running(), EbpfDataplane) else None
    remapped = ebpf.conntrack.remapped_total() if ebpf else 0  # type: ignore[attr-defined]
    first_port = {"pair": 20000, "reuse": 21000}[mode] + (100 if protocol == "udp" else 0)
    first_port += 0 if family == 4 else 200
    out = env.pod("client1").run(sys.executable, str(PODCLIENT), mode, ip_a, ip_b, "80",
                                 "-n", "20", "--proto", protocol,
                                 "--first-port", str(first_port), timeout=240)  # fmt: skip
    report = json.loads(out.strip().splitlines()[-1])
    assert report["pairs" if mode == "pair" else "reused"] == 20, report
    if ebpf is not None and (mode == "pair" or protocol == "tcp") and env.sockets_translated:
        assert ebpf.conntrack.remapped_total() - remapped >= 20  # type: ignore[attr-defined]


# One connection from a bound port held to a Service, then `n` connections from the same
# port to another Service on the same backend, one after the other, each closed with a
# RST (no TIME_WAIT, so the next may take the same tuple).
RECONNECTS = """
import socket, struct
def bound():
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.settimeout(5)
    sock.bind(("0.0.0.0", {port}))
    return sock
held = bound()
held.connect(("{first}", 80))
held.recv(100)
for _ in range({n}):
    sock = bound()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.connect(("{second}", 80))
    sock.recv(100)
    sock.close()
print("done", flush=True)
"""


@not_on(NETFILTER, "kbp_ct is the eBPF dataplane's conntrack")
def test_reconnecting_a_bound_port_whose_tuple_is_taken_holds_one_remapped_port(env: Env) -> None:
    """Each new connection from a port whose translated tuple a held socket takes is a
    remapped flow; the one before it on the same tuple is over, and its remapped port is
    given back (else every reconnect would hold one more SNAT port until connect() fails
    with EADDRNOTAVAIL)."""
    from agent.dataplane.ebpf import abi

    first, ip_a, _ = service(env, "again-a", backends(env, "be1"))
    second, ip_b, _ = service(env, "again-b", backends(env, "be1"))
    env.program(*first, *second)
    client, backend = env.pod("client1"), env.pod("be1")
    port = 22500
    out = client.run(sys.executable, "-c", RECONNECTS.format(port=port, first=ip_a, second=ip_b,
                                                             n=60), timeout=120)  # fmt: skip
    assert out.strip() == "done"
    table = env.running().programs.map("kbp_ct")  # type: ignore[attr-defined]
    remapped = set()  # reply entries that restore the second Service to the client
    for raw_key, raw_entry in table.items():
        key = abi.from_bytes("kbp_ct_key", raw_key)
        entry = abi.from_bytes("kbp_ct_entry", raw_entry)
        if (key.dir == abi.const.KBP_CT_REPLY
                and abi.get_addr(key.saddr, key.family) == backend.ipv4
                and abi.get_addr(key.daddr, key.family) == client.ipv4
                and abi.get_addr(entry.addr, key.family) == ip_b):  # fmt: skip
            remapped.add(abi.from_be16(key.dport))
    assert len(remapped) <= 1, f"{len(remapped)} remapped ports held for one live flow"


@not_on(NETFILTER, "kbp_ct_gate is the eBPF dataplane's")
def test_reply_gate_covers_every_reply_entry_and_forgets_collected_flows(env: Env) -> None:
    """kbp_ct_gate, which lets tc skip the conntrack lookups of flows it never translated:
    the datapath sets a reply entry's slot on both sides (the C and Python hashes agree),
    a sweep keeps the slots of the entries it keeps, and a flow the collector removed no
    longer holds its slot."""
    if env.sockets_translated:
        pytest.skip("the pods' flows are translated at connect() here: tc writes no entries")
    from agent.dataplane.ebpf.abi import const
    from agent.dataplane.ebpf.ctgate import SLOTS, ReplyGate, slot_of

    dataplane = env.running()
    assert isinstance(dataplane, EbpfDataplane)
    objects, ip4, _ = service(env, "gate", backends(env, *BACKENDS))
    env.program(*objects)
    result = env.pod("client2").connect_many(ip4, 80, "tcp", 6)
    assert result.errors == {}, result.details
    table, gate = dataplane.programs.map("kbp_ct"), dataplane.programs.map("kbp_ct_gate")

    def replies() -> set[bytes]:
        return {key for key, _ in table.items() if key[-2] == const.KBP_CT_REPLY}  # dir

    def slot(index: int) -> int:
        raw = gate.lookup(index.to_bytes(4, "little"))
        assert raw is not None
        return raw[0]

    before = replies()
    assert len(before) >= 6
    for key in replies():
        assert slot(slot_of(key)) == 1 and slot(SLOTS + slot_of(key)) == 1, key.hex()
    report = dataplane.conntrack.run_once()
    side = ReplyGate(gate).current_side()
    assert side is not None and report.gate_slots is not None
    for key in replies():
        assert slot(side * SLOTS + slot_of(key)) == 1, key.hex()
    # A minute on: the closed flows' time-wait (10 s) is over, they are collected.
    report = dataplane.conntrack.run_once(time.monotonic_ns() + 60 * 10**9)
    assert report.collected >= 12, report
    side = ReplyGate(gate).current_side()
    assert side is not None
    live = {slot_of(key) for key in replies()}
    freed = {slot_of(key) for key in before} - live
    assert freed, "every collected flow shares a slot with a live one"
    assert all(slot(side * SLOTS + s) == 0 for s in freed)


# A connected UDP socket kept open: one exchange per line read on stdin, printed as JSON
# ({"answer": pod} or {"error": errno name}); after an error the socket is made and
# connected again, as a client that sees its socket fail does.
UDP_SESSION = r"""
import errno, json, socket, sys
ip, port = sys.argv[1], int(sys.argv[2])

def connected():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    s.connect((ip, port))
    return s

s = connected()
for _ in sys.stdin:
    try:
        s.send(b"ping")
        print(json.dumps({"answer": s.recv(100).decode()}), flush=True)
    except OSError as exc:
        name = "timeout" if isinstance(exc, TimeoutError) else errno.errorcode.get(exc.errno)
        print(json.dumps({"error": name}), flush=True)
        s.close()
        s = connected()
"""


def test_connected_udp_socket_leaves_a_removed_backend(env: Env) -> None:
    """The removed backend's pod keeps serving here, so a socket still pointed at it
    would keep getting its answers: it must not. tc re-selects at the flow's next packet;
    a socket the hooks translated is destroyed at the apply (one failed call), and the
    client's new socket reaches a backend still in the Service."""
    objects, ip4, _ = service(env, "udp-session", backends(env, *BACKENDS), protocol="UDP")
    env.program(*objects)
    argv = env.pod("client1").argv([sys.executable, "-c", UDP_SESSION, ip4, "80"])
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None

    def exchange() -> dict:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    try:
        first = [exchange() for _ in range(3)]
        gone = first[0].get("answer")
        assert gone in BACKENDS and first == [{"answer": gone}] * 3, first
        kept = [name for name in BACKENDS if name != gone]
        objects, _, _ = service(env, "udp-session", backends(env, *kept), protocol="UDP",
                                ip4=ip4)  # fmt: skip
        env.program(*objects)
        after = [exchange() for _ in range(4)]
        answers = [seen["answer"] for seen in after if "answer" in seen]
        errors = [seen["error"] for seen in after if "error" in seen]
        assert gone not in answers, after
        assert set(answers) <= set(kept) and len(answers) >= 3, after
        if env.sockets_translated:
            # Destroyed and so no longer connected: a send() fails with EDESTADDRREQ, a
            # recv() waiting meanwhile with ECONNABORTED; either way once.
            assert errors in (["EDESTADDRREQ"], ["ECONNABORTED"]), after
        else:
            assert errors == [], after
    finally:
        proc.stdin.close()
        proc.wait(10)
        proc.stdout.close()


# --- empty sets -------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["tcp", "udp"])
def test_service_without_endpoints_refuses_promptly(env: Env, protocol: str) -> None:
    objects, ip4, _ = service(env, f"empty-{protocol}", [], protocol=protocol.upper())
    env.program(*objects)
    started = time.monotonic()
    result = env.pod("client1").connect_many(ip4, 80, protocol, 3, timeout=2.0)
    assert result.errors == {"refused": 3}, result.details
    assert time.monotonic() - started < 3.0  # three attempts, none waited for a timeout


def test_local_policy_with_endpoints_only_elsewhere_drops(env: Env) -> None:
    def itp_local(obj: dict) -> None:
        obj["spec"]["internalTrafficPolicy"] = "Local"

    elsewhere = [make_endpoint("10.244.2.7", "node-b")]
    objects, ip4, _ = service(env, "local-only", elsewhere, mutate=itp_local)
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, "tcp", 2, timeout=0.5)
    assert result.errors == {env.dropped: 2}, result.details


def test_internal_traffic_policy_local_uses_only_this_nodes_endpoints(env: Env) -> None:
    def itp_local(obj: dict) -> None:
        obj["spec"]["internalTrafficPolicy"] = "Local"

    endpoints = [*backends(env, "be2"), make_endpoint("10.244.2.7", "node-b")]
    objects, ip4, _ = service(env, "itp-local", endpoints, mutate=itp_local)
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, "tcp", 20)
    assert result.errors == {}, result.details
    assert result.counts == {"be2": 20}


def test_terminating_endpoints_serve_when_none_is_ready(env: Env) -> None:
    endpoints = [
        local(env.pod("be3"), ready=False, serving=True, terminating=True),
        local(env.pod("be1"), ready=False, serving=False, terminating=True),
    ]
    objects, ip4, _ = service(env, "draining", endpoints)
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, "tcp", 10)
    assert result.errors == {}, result.details
    assert result.counts == {"be3": 10}


def test_zone_hints_keep_connections_to_this_nodes_zone(env: Env) -> None:
    """Topology hints (every endpoint hinted): node-a is in zone-1, so only the endpoints
    hinted for zone-1 serve it; the one hinted for zone-2 gets nothing."""
    endpoints = [
        make_endpoint(env.pod("be1").ipv4, "node-a", zone="zone-1", zone_hints=["zone-1"]),
        make_endpoint(env.pod("be2").ipv4, "node-a", zone="zone-1", zone_hints=["zone-1"]),
        make_endpoint(env.pod("be3").ipv4, "node-a", zone="zone-2", zone_hints=["zone-2"]),
    ]
    objects, ip4, _ = service(env, "zoned", endpoints)
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, "tcp", 30)
    assert result.errors == {}, result.details
    assert set(result.counts) == {"be1", "be2"}, result.counts


@pytest.mark.parametrize("protocol", ["tcp", "udp"])
def test_pod_reaching_its_own_service_is_served_by_itself(env: Env, protocol: str) -> None:
    objects, ip4, _ = service(env, f"hairpin-{protocol}", backends(env, "be1"),
                              protocol=protocol.upper())  # fmt: skip
    env.program(*objects)
    result = env.pod("be1").connect_many(ip4, 80, protocol, 10)
    assert result.errors == {}, result.details
    assert result.counts == {"be1": 10}


def test_dual_stack_socket_reaches_an_ipv4_service(env: Env) -> None:
    """An IPv6 socket naming ::ffff:<ClusterIP> (the kernel sends IPv4; only the IPv6
    socket hooks run)."""
    objects, ip4, _ = service(env, "mapped", backends(env, *BACKENDS))
    env.program(*objects)
    result = env.pod("client1").connect_many(f"::ffff:{ip4}", 80, "tcp", 30)
    assert result.errors == {}, result.details
    assert set(result.counts) == set(BACKENDS), result.counts


LB_VIP = "203.0.113.9"


def test_load_balancer_source_ranges_judge_the_pods_address(env: Env) -> None:
    def ranged(obj: dict) -> None:
        obj["spec"]["type"] = "LoadBalancer"
        obj["spec"]["loadBalancerSourceRanges"] = [f"{env.pod('client1').ipv4}/32"]
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": LB_VIP}]}}

    # What nothing translates goes into the sink, like the ClusterIP ranges (lab.py).
    env.lab.run_in_node("ip", "route", "replace", f"{LB_VIP}/32", "dev", "kbpsink")
    objects, _, _ = service(env, "ranged", backends(env, *BACKENDS), mutate=ranged)
    env.program(*objects)
    admitted = env.pod("client1").connect_many(LB_VIP, 80, "tcp", 20)
    assert admitted.errors == {}, admitted.details
    assert set(admitted.counts) == set(BACKENDS), admitted.counts
    refused = env.pod("client2").connect_many(LB_VIP, 80, "tcp", 2, timeout=0.5)
    assert refused.errors == {env.dropped: 2}, refused.details


# The client of the next test: one exchange with IP:PORT over PROTO; prints the answer
# and the peer the socket API showed (getpeername for TCP, recvfrom's source for UDP).
PEER_CLIENT = r"""
import json, socket, sys
ip, port, proto = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
with socket.socket(socket.AF_INET, kind) as s:
    s.settimeout(5)
    if proto == "tcp":
        s.connect((ip, port))
        answer, peer = s.makefile().readline().strip(), s.getpeername()
    else:
        s.sendto(b"ping", (ip, port))
        data, peer = s.recvfrom(100)
        answer = data.decode()
print(json.dumps({"answer": answer, "peer": list(peer)}))
"""


def _conntrack_entries_of(env: Env, frontend: str) -> int:
    """kbp_ct entries of flows to `frontend`: forward keys to it, replies restoring it."""
    from agent.dataplane.ebpf.abi import from_bytes, get_addr

    dataplane = env.running()
    assert isinstance(dataplane, EbpfDataplane)
    found = 0
    for key, value in dataplane.programs.map("kbp_ct").items():
        ct_key, entry = from_bytes("kbp_ct_key", key), from_bytes("kbp_ct_entry", value)
        addresses = {get_addr(ct_key.daddr, ct_key.family), get_addr(entry.addr, ct_key.family)}
        found += frontend in addresses
    return found


@not_on(NETFILTER, "kbp_ct is the eBPF dataplane's conntrack")
@pytest.mark.parametrize("protocol", ["tcp", "udp"])
def test_socket_translated_flows_write_no_conntrack_and_show_the_cluster_ip(
    env: Env, protocol: str
) -> None:
    objects, ip4, _ = service(env, f"peer-{protocol}", backends(env, *BACKENDS),
                              protocol=protocol.upper())  # fmt: skip
    env.program(*objects)
    for _ in range(3):
        shown = json.loads(env.pod("client1").run(sys.executable, "-c", PEER_CLIENT, ip4, "80",
                                                  protocol))  # fmt: skip
        assert shown["answer"] in BACKENDS, shown
        assert shown["peer"] == [ip4, 80], shown  # the application sees the ClusterIP
    entries = _conntrack_entries_of(env, ip4)
    if env.sockets_translated:
        assert entries == 0  # translated at connect(): no packet was NATed
    else:
        assert entries >= 2 * 3  # tc: a forward and a reply entry per flow


# --- operations -------------------------------------------------------------------------


def test_new_pod_reaches_a_service_without_an_apply(env: Env) -> None:
    objects, ip4, _ = service(env, "late", backends(env, "be2"))
    env.program(*objects)
    pod = env.lab.add_pod("latecomer")
    if isinstance(env.dataplane, EbpfDataplane):
        # The netlink watcher attaches the programs to the new host veth within a second.
        # (iptables rules match the pods' interfaces by name pattern: nothing to attach.)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if pod.host_ifindex in env.dataplane.links.attached:
                break
            time.sleep(0.02)
    result = pod.connect_many(ip4, 80, "tcp", 5)
    assert result.counts == {"be2": 5}, (result.counts, result.details)


def test_unchanged_state_writes_nothing(env: Env) -> None:
    objects, _, _ = service(env, "steady", backends(env, *BACKENDS))
    state = env.program(*objects)
    assert env.running().apply(state) == 0
    # A full resync compares the eBPF maps with the kernel's; iptables may rewrite every
    # chain then (kube-proxy's periodic full sync), so it has no count to expect.
    if env.kind == "ebpf":
        assert env.running().apply(state, full=True) == 0


def test_restarted_dataplane_takes_over_while_a_connection_stays_open(env: Env) -> None:
    objects, ip4, _ = service(env, "restart", backends(env, *BACKENDS))
    state = env.program(*objects)
    stream = env.pod("client1").stream(ip4, 80)
    try:
        assert stream.backend in BACKENDS, stream.check()
        # The old agent exits (what it programmed stays in the kernel), a new one starts
        # on the same node and syncs the same state. The new object serves later tests.
        first_writes = restarted(env, state)
        if env.kind == "ebpf":
            assert first_writes == 0  # it adopted the pinned maps, which hold the state
        assert_echoing([stream], "across the restart")
        result = env.pod("client2").connect_many(ip4, 80, "tcp", 60)
        assert result.errors == {}, result.details
        assert set(result.counts) == set(BACKENDS), result.counts
        if env.kind == "ebpf":
            assert env.dataplane.apply(state, full=True) == 0  # the kernel already held it
        assert env.dataplane.apply(state) == 0
        assert_echoing([stream], "after the restart")
    finally:
        stream.close()


@not_on(NETFILTER, "kbp_pods is the eBPF dataplane's")
def test_a_pod_whose_namespace_is_unknown_is_served_by_tc(env: Env) -> None:
    """The hooks translate only sockets of namespaces in kbp_pods; any other pod's
    connection is translated at tc, with the same result for the application."""
    if not env.sockets_translated:
        pytest.skip("only --socket-lb all translates the pods' sockets")
    dataplane = env.running()
    assert isinstance(dataplane, EbpfDataplane) and dataplane.links.pod_netns is not None
    known = {pod.ifname: pod for pod in dataplane.links.pod_netns.pods()}
    assert set(known) == {pod.host_ifname for pod in env.pods.values()}
    client = env.pod("client2")
    assert known[client.host_ifname].ipv4 == client.ipv4
    assert dataplane.status_details()["socketHooks"]["pods"] == len(known)
    objects, ip4, _ = service(env, "unknown-pod", backends(env, *BACKENDS))
    env.program(*objects)
    table = dataplane.programs.map("kbp_pods")
    key = cookie_key(known[client.host_ifname].cookie)
    value = table.lookup(key)
    assert value is not None
    table.delete(key)
    try:
        result = client.connect_many(ip4, 80, "tcp", 10)
        assert result.errors == {}, result.details
        assert _conntrack_entries_of(env, ip4) >= 2 * 10  # tc translated them
    finally:
        table.update(key, value)
    before = _conntrack_entries_of(env, ip4)
    result = client.connect_many(ip4, 80, "tcp", 10)
    assert result.errors == {} and _conntrack_entries_of(env, ip4) == before


@not_on(NETFILTER, "--socket-lb is the eBPF dataplane's")
def test_switching_socket_lb_modes_keeps_established_streams(env: Env) -> None:
    """The agent restarted with the other --socket-lb, then back: a stream begun in each
    mode (one translated at connect(), the other at tc) keeps working throughout."""
    objects, ip4, _ = service(env, "switch", backends(env, *BACKENDS))
    state = env.program(*objects)
    original = env.socket_lb
    other = "off" if original == "all" else "all"
    streams = [env.pod("client1").stream(ip4, 80)]
    try:
        for mode in (other, original):
            env.socket_lb = mode
            restarted(env, state)
            streams.append(env.pod("client2").stream(ip4, 80))
            assert_echoing(streams, f"after --socket-lb {mode}")
            result = env.pod("client2").connect_many(ip4, 80, "tcp", 30)
            assert result.errors == {}, result.details
            assert set(result.counts) == set(BACKENDS), result.counts
    finally:
        env.socket_lb = original
        for stream in streams:
            stream.close()


@not_on(NETFILTER, "--tc-attach is the eBPF dataplane's")
def test_moving_between_clsact_and_tcx_keeps_established_streams(env: Env) -> None:
    """An agent of the clsact era upgraded in place to one that attaches tcx links, then
    forced back to clsact: the restarted agent takes each pod interface over at its first
    apply (its kind first, then the other kind goes), and streams begun under each keep
    echoing throughout."""
    from agent.dataplane.ebpf.netlink import tcx_supported

    if not tcx_supported():
        pytest.skip(f"kernel {os.uname().release} has no tcx")
    objects, ip4, _ = service(env, "tcx", backends(env, *BACKENDS))
    state = env.program(*objects)
    streams = []
    try:
        for mode in ("clsact", "tcx", "clsact", None):
            env.tc_attach = mode
            restarted(env, state)
            assert isinstance(env.dataplane, EbpfDataplane)
            expected = {"tcx": "tcx", "clsact": "clsact", None: env.dataplane.links.tc.mode}[mode]
            hooks = {(a.ifname, a.hook) for a in env.dataplane.links.tc.attached()}
            assert hooks == {(pod.host_ifname, expected) for pod in env.pods.values()}, mode
            assert env.dataplane.status_details()["tcAttach"] == expected
            streams.append(env.pod("client1").stream(ip4, 80))
            assert_echoing(streams, f"after --tc-attach {mode}")
            result = env.pod("client2").connect_many(ip4, 80, "tcp", 20)
            assert result.errors == {}, result.details
    finally:
        env.tc_attach = None
        for stream in streams:
            stream.close()


@not_on(NETFILTER, "tcx pins are the eBPF dataplane's")
def test_a_removed_pod_interface_leaves_no_tcx_pin(env: Env) -> None:
    """The watcher attaches a new pod's interface as pinned tcx links; when the interface
    goes, the kernel detaches them and the agent removes their pins."""
    dataplane = env.running()
    assert isinstance(dataplane, EbpfDataplane)
    if dataplane.links.tc.mode != "tcx":
        pytest.skip(f"the tc programs attach as {dataplane.links.tc.mode} here")
    pod = env.lab.add_pod("short-lived")
    pins = {env.pin_dir / f"kbp_tcx_{pod.host_ifindex}_{d}" for d in ("ingress", "egress")}
    try:
        assert _within(10.0, lambda: all(pin.exists() for pin in pins)), "never attached"
    finally:
        env.lab.remove_pod("short-lived")
    assert _within(10.0, lambda: not any(pin.exists() for pin in pins)), sorted(
        str(pin) for pin in pins if pin.exists()
    )


def _within(seconds: float, condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@not_on(NETFILTER, "iptables chains have no fixed capacity to refuse a state for")
def test_state_that_does_not_fit_is_refused_and_the_previous_stays(env: Env) -> None:
    objects, ip4, _ = service(env, "before", backends(env, *BACKENDS))
    env.program(*objects)
    many = []
    for n in range(5000):  # more frontends than the 4096-entry services map
        many += [make_service(name=f"s{n}", mutate=_ip(f"10.97.{n // 250}.{n % 250 + 1}"))]
    with pytest.raises(DataplaneError) as caught:
        env.program(*objects, *many)
    assert caught.value.reason == "capacity"
    assert "services" in str(caught.value)
    result = env.pod("client1").connect_many(ip4, 80, "tcp", 20)
    assert result.errors == {} and set(result.counts) == set(BACKENDS)


def _ip(ip: str) -> Callable[[dict], None]:
    def mutate(obj: dict) -> None:
        obj["spec"]["clusterIP"] = ip
        obj["spec"]["clusterIPs"] = [ip]

    return mutate


@not_on(NETFILTER, "map fill ratios and datapath drop counters are eBPF maps")
def test_metrics_show_map_fill_and_datapath_drops(env: Env) -> None:
    from prometheus_client import generate_latest

    from agent.metrics import Metrics

    metrics = Metrics()
    dataplane = env.running()
    assert isinstance(dataplane, EbpfDataplane)
    dataplane.register_metrics(metrics)
    objects, ip4, _ = service(env, "metered", [])
    env.program(*objects)
    env.pod("client1").connect_many(ip4, 80, "tcp", 2, timeout=1.0)
    text = generate_latest(metrics.registry).decode()
    rejected = [
        line for line in text.splitlines()
        if line.startswith('kbp_datapath_drops_total{reason="rejected"}')
    ]  # fmt: skip
    assert rejected and float(rejected[0].split()[-1]) >= 2, text
    services_map = versioned("kbp_services")
    assert f'kbp_map_fill_ratio{{map="{services_map}"}} 0.0002' in text, text


# --- the end ----------------------------------------------------------------------------


def _xdp_mode_of(netns: str, ifname: str) -> str | None:
    """What the kernel says is attached to ifname: native, generic or None."""
    shown = subprocess.run(["ip", "-n", netns, "-j", "link", "show", ifname],
                           capture_output=True, text=True, check=True)  # fmt: skip
    [link] = json.loads(shown.stdout)
    xdp = link.get("xdp")
    return None if xdp is None else {1: "native", 2: "generic"}.get(xdp["mode"], str(xdp))


@pytest.mark.parametrize(("requested", "expected"), [("auto", "generic"), ("native", "native")])
def test_xdp_on_a_veth_runs_generic_unless_native_is_asked_for(
    requested: str, expected: str
) -> None:
    # A native XDP_TX into a veth is read only when the peer has an XDP program as well,
    # which an agent cannot put there; `auto` therefore picks generic on a veth.
    pin_dir = Path(f"/sys/fs/bpf/kbp-test-xdpveth-{os.getpid()}-{time.monotonic_ns()}")
    with Lab() as lab:
        dataplane = None
        try:
            subprocess.run(["ip", "-n", lab.node_ns, "link", "add", "kbpext0", "type", "veth",
                            "peer", "name", "kbpext1"], check=True)  # fmt: skip
            subprocess.run(["ip", "-n", lab.node_ns, "link", "set", "kbpext0", "up"], check=True)
            dataplane = EbpfDataplane(EbpfOptions(
                pin_dir, POD_INTERFACES, MapSizes(1024, 4096, 1024, 4096, 1024),
                netns=lab.node_ns, watch=False, external_interfaces=("kbpext0",),
                xdp=Xdp(requested),
            ))  # fmt: skip
            dataplane.apply(compile(state_of(*default_nodes()), "node-a"))

            assert dataplane.status_details()["xdp"]["interfaces"] == {"kbpext0": expected}
            assert _xdp_mode_of(lab.node_ns, "kbpext0") == expected
        finally:
            if dataplane is not None:
                dataplane.cleanup()
            remove_pins(pin_dir)
    assert not pin_dir.exists()


def test_cleanup_removes_everything_the_dataplane_installed(env: Env) -> None:
    # Defined last, so it runs last for each dataplane: the fixture then has nothing left to
    # clean up (it still checks). Failing here, not in teardown, keeps a leftover of one
    # dataplane from surfacing as a setup error of the other's first test.
    endpoints = backends(env, *BACKENDS) + backends(env, *BACKENDS, family=6)
    objects, _, _ = service(env, "last", endpoints, dual_stack=True)
    env.program(*objects)
    assert env.leftovers() != []  # the check sees what the dataplane installed
    dataplane = env.running()
    env.dataplane = None
    dataplane.cleanup()
    assert env.leftovers() == []
