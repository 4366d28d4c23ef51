"""Packet fixtures through BPF_PROG_TEST_RUN for the external-interface programs:
`kbp_from_ext` (tc ingress), `kbp_to_ext` (tc egress) and `kbp_xdp_ext` (XDP).

Every run happens in a thread that entered a fresh network namespace (the test run's
skb device, FIB and ifindex lookups are those of the caller's namespace), where `ext0`
plays the node's external interface with the routes and permanent neighbours below, so
the FIB lookups for backends on other nodes and for replies to clients succeed.

Address plan (only `ext0`, `ext1` and their veth peers exist, inside the test namespace):
  outside client     198.51.100.7     2001:db8:100::7     source port 40000 (+n)
  outsider           203.0.113.200    2001:db8:200::200   outside the source ranges
  source range       198.51.100.0/24  2001:db8:100::/48
  node (ext0)        192.0.2.10/24    2001:db8::10/64     MAC 02:00:00:00:00:10
  router             192.0.2.1        2001:db8::1         MAC 02:00:00:00:00:01, next hop
                                                          of the outside networks
  peer node          192.0.2.11       2001:db8::11        MAC 02:00:00:00:00:11, next hop
                                                          of 10.244.1.0/24, fd00:244:1::/64
  ext1               198.18.0.10/24   -                   MAC 02:00:00:00:01:10
  second peer node   198.18.0.12      -                   MAC 02:00:00:00:00:12, next hop
                                                          of 10.244.2.0/24 (via ext1)
  cluster CIDR       10.244.0.0/16    fd00:244::/32       (kbp_config)
  local backend      10.244.0.5       fd00:244::5         port 8080, KBP_BE_F_LOCAL
  remote backend     10.244.1.5       fd00:244:1::5       port 8080, behind the peer node
  remote via ext1    10.244.2.5       -                   port 8080
  unrouted backend   10.99.0.5        fd00:99::5          port 8080, no route
  pod on a peer      10.244.1.7       fd00:244:1::7       a cluster pod as client
  NodePort           192.0.2.10:30080 [2001:db8::10]:30080
  LoadBalancer VIP   203.0.113.9:80   [2001:db8:113::9]:80
  SNAT ports         61000-65535 (the agent's default), 61000-61001 where the range is full
"""

from __future__ import annotations

import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from agent.dataplane.ebpf import abi, external, kernel, libbpf
from agent.dataplane.ebpf import frames as P
from agent.dataplane.ebpf.maps import FrontendKey
from agent.dataplane.ebpf.netlink import enter_netns

from .test_packets import SIZES, Datapath, _ct_entry, assert_checksums_valid, flow_hash

pytestmark = pytest.mark.kernel

C = abi.const
TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT = 0, 2, 7
XDP_DROP, XDP_PASS, XDP_TX, XDP_REDIRECT = 1, 2, 3, 4
TCP, UDP = P.PROTO_TCP, P.PROTO_UDP

CLIENT = {4: "198.51.100.7", 6: "2001:db8:100::7"}
OUTSIDER = {4: "203.0.113.200", 6: "2001:db8:200::200"}
SOURCE_RANGE = {4: "198.51.100.0/24", 6: "2001:db8:100::/48"}
NODE = {4: "192.0.2.10", 6: "2001:db8::10"}
ROUTER = {4: "192.0.2.1", 6: "2001:db8::1"}
PEER = {4: "192.0.2.11", 6: "2001:db8::11"}
CLUSTER_CIDR = {4: "10.244.0.0/16", 6: "fd00:244::/32"}
LOCAL_BACKEND = {4: "10.244.0.5", 6: "fd00:244::5"}
REMOTE_BACKEND = {4: "10.244.1.5", 6: "fd00:244:1::5"}
REMOTE_VIA_EXT1 = "10.244.2.5"
UNROUTED_BACKEND = {4: "10.99.0.5", 6: "fd00:99::5"}
PEER_POD = {4: "10.244.1.7", 6: "fd00:244:1::7"}
LB_VIP = {4: "203.0.113.9", 6: "2001:db8:113::9"}
NODE_PORT, LB_PORT, BACKEND_PORT, CLIENT_PORT = 30080, 80, 8080, 40000
SNAT_PORTS = external.DEFAULT_SNAT_PORTS
HOP_CACHE_NS = 100_000_000  # bpf/lib/ext.h KBP_HOP_CACHE_NS
HOP_WATCHED_NS = 10_000_000_000  # bpf/lib/ext.h KBP_HOP_WATCHED_NS
CLOCK_MONOTONIC_COARSE = 6  # linux/time.h; bpf_ktime_get_coarse_ns reads this clock

NODE_MAC = bytes.fromhex("020000000010")
EXT1_MAC = bytes.fromhex("020000000110")
ROUTER_MAC = bytes.fromhex("020000000001")
PEER_MAC = bytes.fromhex("020000000011")
PEER2_MAC = bytes.fromhex("020000000012")

FAMILIES = [pytest.param(4, id="IPv4"), pytest.param(6, id="IPv6")]

T = TypeVar("T")


def _mac(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


# The test namespace: ext0/ext1 (veth pairs whose peers stay inside), addresses, routes
# and permanent neighbours, so bpf_fib_lookup answers SUCCESS without any traffic.
NETNS_SETUP = [
    f"link add ext0 address {_mac(NODE_MAC)} type veth peer name wire0",
    f"link add ext1 address {_mac(EXT1_MAC)} type veth peer name wire1",
    "link set lo up",
    "link set wire0 up",
    "link set wire1 up",
    "link set ext0 up",
    "link set ext1 up",
    f"addr add {NODE[4]}/24 dev ext0",
    f"addr add {NODE[6]}/64 dev ext0 nodad",
    "addr add 198.18.0.10/24 dev ext1",
    f"neigh add {ROUTER[4]} lladdr {_mac(ROUTER_MAC)} dev ext0 nud permanent",
    f"neigh add {ROUTER[6]} lladdr {_mac(ROUTER_MAC)} dev ext0 nud permanent",
    f"neigh add {PEER[4]} lladdr {_mac(PEER_MAC)} dev ext0 nud permanent",
    f"neigh add {PEER[6]} lladdr {_mac(PEER_MAC)} dev ext0 nud permanent",
    f"neigh add 198.18.0.12 lladdr {_mac(PEER2_MAC)} dev ext1 nud permanent",
    f"route add 198.51.100.0/24 via {ROUTER[4]} dev ext0",
    f"route add 203.0.113.0/24 via {ROUTER[4]} dev ext0",
    f"route add 2001:db8:100::/48 via {ROUTER[6]} dev ext0",
    f"route add 2001:db8:200::/48 via {ROUTER[6]} dev ext0",
    f"route add 10.244.1.0/24 via {PEER[4]} dev ext0",
    f"route add fd00:244:1::/64 via {PEER[6]} dev ext0",
    "route add 10.244.2.0/24 via 198.18.0.12 dev ext1",
]


def _nsenter(netns: str, *argv: str) -> None:
    subprocess.run(["nsenter", f"--net=/run/netns/{netns}", *argv], check=True)


def _skb_ctx(ingress_ifindex: int, ifindex: int) -> bytes:
    # struct __sk_buff up to `cb`: len .. priority (9 words) must be zero apart from
    # mark/priority; then ingress_ifindex and ifindex, then tc_index (zero).
    return struct.pack("=9I3I", *([0] * 9), ingress_ifindex, ifindex, 0)


def _xdp_ctx(frame: bytes, ingress_ifindex: int) -> bytes:
    # struct xdp_md: data, data_end (the frame's length), data_meta, ingress_ifindex,
    # rx_queue_index, egress_ifindex.
    return struct.pack("=6I", 0, len(frame), 0, ingress_ifindex, 0, 0)


@dataclass
class ExtNode(Datapath):
    """The loaded datapath seen from the node's external interface ext0, with writers
    for external frontends and kbp_config shaped like the agent's."""

    runner: ThreadPoolExecutor | None = None
    ext0: int = 0
    ext1: int = 0

    def _in_netns(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        assert self.runner is not None
        return self.runner.submit(fn, *args, **kwargs).result()

    # the programs

    def from_ext(self, frame: bytes, ifindex: int = 0) -> libbpf.TestRun:
        ifindex = ifindex or self.ext0
        fd = self.loaded.fd("kbp_from_ext")
        return self._in_netns(libbpf.prog_test_run, fd, frame, ctx=_skb_ctx(ifindex, ifindex))

    def to_ext(self, frame: bytes) -> libbpf.TestRun:
        fd = self.loaded.fd("kbp_to_ext")
        return self._in_netns(libbpf.prog_test_run, fd, frame, ctx=_skb_ctx(0, self.ext0))

    def xdp(self, frame: bytes, ifindex: int = 0) -> libbpf.TestRun:
        fd = self.loaded.fd("kbp_xdp_ext")
        return self._in_netns(
            libbpf.prog_test_run, fd, frame, ctx=_xdp_ctx(frame, ifindex or self.ext0)
        )

    # writers

    def configure(self, snat_ports: tuple[int, int] = SNAT_PORTS) -> None:
        value = external.config_value(
            [NODE[4], NODE[6]], [CLUSTER_CIDR[4], CLUSTER_CIDR[6]], 0, snat_ports
        )
        self.loaded.map("kbp_config").update(bytes(4), value)

    def add_ext_backend(self, service_id: int, ip: str, *, local: bool) -> int:
        return self.add_backend(service_id, ip, flags=C.KBP_BE_F_LOCAL if local else 0)

    def write_frontend(
        self,
        fe_type: int,
        family: int,
        *,
        set_id: int,
        count: int,
        internal_set_id: int | None = None,
        internal_count: int | None = None,
        flags: int = C.KBP_SVC_F_HAS_ENDPOINTS,
        proto: int = TCP,
        service_id: int = 1,
    ) -> None:
        addr, port = frontend_of(fe_type, family)
        self.write_service(service_id, family, proto, set_id, count, flags, frontend=addr,
                           port=port, fe_type=fe_type, internal_set_id=internal_set_id,
                           internal_count=internal_count)  # fmt: skip

    def service_to(
        self,
        backend: str,
        *,
        local: bool,
        fe_type: int = C.KBP_FE_NODE_PORT,
        flags: int = C.KBP_SVC_F_HAS_ENDPOINTS,
    ) -> int:
        """A frontend of `fe_type` whose one backend (both sets) is `backend`; its id."""
        family = abi.family_of(backend)
        backend_id = self.add_ext_backend(1, backend, local=local)
        self.write_set(1, [backend_id])
        self.write_frontend(fe_type, family, set_id=1, count=1, flags=flags)
        return backend_id

    def admit(self, fe_type: int, family: int, network: str) -> None:
        """A kbp_src_ranges entry, written as the agent writes it (SourceRange)."""
        addr, port = frontend_of(fe_type, family)
        entry = external.SourceRange(FrontendKey(addr, port, TCP, family), network)
        self.loaded.map("kbp_src_ranges").update(entry.key(), entry.value())

    # readers

    def xdp_stats(self, verdict: int) -> dict[str, int]:
        return self._percpu("kbp_xdp_stats", "kbp_drop_counters", verdict)

    def ct(self, src: str, dst: str, sport: int, dport: int, direction: int) -> Any:
        return _ct_entry(self, src, dst, sport, dport, TCP, direction)


def frontend_of(fe_type: int, family: int) -> tuple[str, int]:
    if fe_type == C.KBP_FE_NODE_PORT:
        return NODE[family], NODE_PORT
    return LB_VIP[family], LB_PORT


@pytest.fixture
def node(bpf_pin_dir, netns) -> Iterator[ExtNode]:
    name = netns()
    for command in NETNS_SETUP:
        _nsenter(name, "ip", *command.split())
    _nsenter(
        name,
        "sysctl",
        "-qw",
        "net.ipv4.conf.all.forwarding=1",
        "net.ipv6.conf.all.forwarding=1",
    )
    runner = ThreadPoolExecutor(1, initializer=enter_netns, initargs=(name,))
    loaded = kernel.load_programs(bpf_pin_dir, SIZES)
    try:
        ext = ExtNode(loaded, runner=runner)
        ext.ext0 = runner.submit(socket.if_nametoindex, "ext0").result()
        ext.ext1 = runner.submit(socket.if_nametoindex, "ext1").result()
        ext.configure()
        yield ext
    finally:
        loaded.close()
        runner.shutdown()


# Frames on the wire of ext0.


def frame(
    src: str,
    dst: str,
    sport: int,
    dport: int,
    *,
    flags: str = "S",
    payload: bytes = b"",
    eth_src: bytes = ROUTER_MAC,
    eth_dst: bytes = NODE_MAC,
    ttl: int = 64,
) -> bytes:
    segment = P.tcp_segment(src, dst, sport, dport, flags=flags, payload=payload)
    if ":" in src:
        return P.ethernet(
            P.ipv6_packet(src, dst, TCP, segment, hop_limit=ttl),
            P.ETH_P_IPV6,
            src=eth_src,
            dst=eth_dst,
        )
    return P.ethernet(
        P.ipv4_packet(src, dst, TCP, segment, ttl=ttl), P.ETH_P_IP, src=eth_src, dst=eth_dst
    )


def to_node_port(family: int, *, client: str = "", sport: int = CLIENT_PORT, **kw: Any) -> bytes:
    return frame(client or CLIENT[family], NODE[family], sport, NODE_PORT, **kw)


def to_vip(family: int, *, client: str = "", sport: int = CLIENT_PORT, **kw: Any) -> bytes:
    return frame(client or CLIENT[family], LB_VIP[family], sport, LB_PORT, **kw)


# 1. NodePort to a local backend: DNAT only; the reply is translated at ext0's egress.


@pytest.mark.parametrize("family", FAMILIES)
def test_a_syn_to_a_node_port_with_a_local_backend_reaches_it_with_the_client_source(node, family):
    backend_id = node.service_to(LOCAL_BACKEND[family], local=True)
    syn = to_node_port(family, payload=b"hello pod")

    run = node.from_ext(syn)

    assert run.retval == TC_ACT_OK
    out = P.parse(run.data_out)
    assert (out.src, out.sport) == (CLIENT[family], CLIENT_PORT)
    assert (out.dst, out.dport) == (LOCAL_BACKEND[family], BACKEND_PORT)
    assert (out.eth_src, out.eth_dst, out.ttl) == (ROUTER_MAC, NODE_MAC, 64)
    assert out.payload == b"hello pod"
    assert_checksums_valid(out)

    forward = node.ct(CLIENT[family], NODE[family], CLIENT_PORT, NODE_PORT, C.KBP_CT_FORWARD)
    reply = node.ct(
        LOCAL_BACKEND[family], CLIENT[family], BACKEND_PORT, CLIENT_PORT, C.KBP_CT_REPLY
    )
    assert (abi.get_addr(forward.addr, family), abi.from_be16(forward.port)) == (
        LOCAL_BACKEND[family],
        BACKEND_PORT,
    )
    assert (abi.get_addr(reply.addr, family), abi.from_be16(reply.port)) == (
        NODE[family],
        NODE_PORT,
    )
    for entry in (forward, reply):
        assert (entry.backend_id, entry.service_id) == (backend_id, 1)
        assert entry.flags == C.KBP_CT_F_REPLY_AT_CLIENT
    assert node.counters(1)["new_flows"] == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_a_local_backends_reply_leaves_ext0_from_the_node_port(node, family):
    node.service_to(LOCAL_BACKEND[family], local=True)
    node.from_ext(to_node_port(family))
    reply = frame(
        LOCAL_BACKEND[family],
        CLIENT[family],
        BACKEND_PORT,
        CLIENT_PORT,
        flags="SA",
        payload=b"hello client",
        eth_src=NODE_MAC,
        eth_dst=ROUTER_MAC,
        ttl=63,
    )

    run = node.to_ext(reply)

    assert run.retval == TC_ACT_OK
    out = P.parse(run.data_out)
    assert (out.src, out.sport) == (NODE[family], NODE_PORT)
    assert (out.dst, out.dport) == (CLIENT[family], CLIENT_PORT)
    assert (out.payload, out.ttl) == (b"hello client", 63)
    assert_checksums_valid(out)
    reply_entry = node.ct(
        LOCAL_BACKEND[family], CLIENT[family], BACKEND_PORT, CLIENT_PORT, C.KBP_CT_REPLY
    )
    assert reply_entry.flags & C.KBP_CT_F_SEEN_REPLY


@pytest.mark.parametrize("family", FAMILIES)
def test_an_outside_clients_port_used_for_two_frontends_of_one_local_backend_is_remapped(
    node, family
):
    # The NodePort and the LoadBalancer VIP are two Services sharing the local backend:
    # one client port to both would be one tuple at the pod. The second flow leaves with a
    # port of the SNAT range, its reply comes back from the VIP to the client's own port.
    for service_id, fe_type in ((1, C.KBP_FE_NODE_PORT), (2, C.KBP_FE_LOAD_BALANCER)):
        backend_id = node.add_ext_backend(service_id, LOCAL_BACKEND[family], local=True)
        node.write_set(service_id, [backend_id])
        node.write_frontend(fe_type, family, set_id=service_id, count=1, service_id=service_id)

    first = P.parse(node.from_ext(to_node_port(family)).data_out)
    second = P.parse(node.from_ext(to_vip(family)).data_out)

    assert (first.dst, first.sport) == (LOCAL_BACKEND[family], CLIENT_PORT)
    assert (second.src, second.dst) == (CLIENT[family], LOCAL_BACKEND[family])
    assert SNAT_PORTS[0] <= second.sport <= SNAT_PORTS[1]
    assert_checksums_valid(second)
    answers = ((CLIENT_PORT, NODE[family], NODE_PORT), (second.sport, LB_VIP[family], LB_PORT))
    for dport, frontend, frontend_port in answers:
        reply = frame(LOCAL_BACKEND[family], CLIENT[family], BACKEND_PORT, dport, flags="SA",
                      eth_src=NODE_MAC, eth_dst=ROUTER_MAC)  # fmt: skip
        out = P.parse(node.to_ext(reply).data_out)
        assert (out.src, out.sport) == (frontend, frontend_port)
        assert (out.dst, out.dport) == (CLIENT[family], CLIENT_PORT)
        assert_checksums_valid(out)


def test_packets_of_the_nodes_own_flows_leave_ext0_untouched(node):
    node.service_to(LOCAL_BACKEND[4], local=True)
    own = frame(NODE[4], CLIENT[4], 50000, 443, eth_src=NODE_MAC, eth_dst=ROUTER_MAC)
    answer = frame(CLIENT[4], NODE[4], 443, 50000, flags="SA")

    egress, ingress = node.to_ext(own), node.from_ext(answer)

    assert (egress.retval, egress.data_out) == (TC_ACT_OK, own)
    assert (ingress.retval, ingress.data_out) == (TC_ACT_OK, answer)


# 2. NodePort to a backend on another node: DNAT + SNAT, forwarded with the FIB's next hop.


def _snat_entries(node: ExtNode, family: int, backend: str, client: str, sport: int):
    forward = node.ct(client, NODE[family], sport, NODE_PORT, C.KBP_CT_FORWARD)
    assert forward is not None, "no forward conntrack entry"
    snat_port = abi.from_be16(forward.nat_port)
    reply = node.ct(backend, NODE[family], BACKEND_PORT, snat_port, C.KBP_CT_REPLY)
    return forward, reply, snat_port


@pytest.mark.parametrize("family", FAMILIES)
def test_a_syn_to_a_remote_backend_is_snated_to_the_node_and_forwarded_to_the_peer(node, family):
    backend_id = node.service_to(REMOTE_BACKEND[family], local=False)
    syn = to_node_port(family, payload=b"over there")

    run = node.from_ext(syn)

    assert run.retval == TC_ACT_REDIRECT
    out = P.parse(run.data_out)
    forward, reply, snat_port = _snat_entries(
        node, family, REMOTE_BACKEND[family], CLIENT[family], CLIENT_PORT
    )
    assert SNAT_PORTS[0] <= snat_port <= SNAT_PORTS[1]
    assert (out.src, out.sport) == (NODE[family], snat_port)
    assert (out.dst, out.dport) == (REMOTE_BACKEND[family], BACKEND_PORT)
    assert (out.eth_src, out.eth_dst, out.ttl) == (NODE_MAC, PEER_MAC, 63)
    assert out.payload == b"over there"
    assert len(run.data_out) == len(syn)
    assert_checksums_valid(out)

    assert forward.flags & C.KBP_CT_F_SNAT
    assert not forward.flags & C.KBP_CT_F_REPLY_AT_CLIENT
    assert abi.get_addr(forward.nat_addr, family) == NODE[family]
    assert (abi.get_addr(forward.addr, family), abi.from_be16(forward.port)) == (
        REMOTE_BACKEND[family],
        BACKEND_PORT,
    )
    assert reply is not None, "no reply conntrack entry for the SNAT port"
    assert reply.flags & C.KBP_CT_F_SNAT
    assert (abi.get_addr(reply.addr, family), abi.from_be16(reply.port)) == (
        NODE[family],
        NODE_PORT,
    )
    assert (abi.get_addr(reply.nat_addr, family), abi.from_be16(reply.nat_port)) == (
        CLIENT[family],
        CLIENT_PORT,
    )
    assert (forward.backend_id, reply.backend_id) == (backend_id, backend_id)
    assert node.counters(1)["new_flows"] == 1


def test_later_segments_of_a_snated_flow_keep_its_port(node):
    node.service_to(REMOTE_BACKEND[4], local=False)
    first = P.parse(node.from_ext(to_node_port(4)).data_out)

    later = P.parse(node.from_ext(to_node_port(4, flags="A", payload=b"more")).data_out)

    assert (later.src, later.sport, later.dst) == (NODE[4], first.sport, REMOTE_BACKEND[4])
    assert_checksums_valid(later)
    assert node.counters(1)["new_flows"] == 1


def test_a_syn_to_a_backend_without_a_route_is_dropped_after_conntrack_holds_it(node):
    node.service_to(UNROUTED_BACKEND[4], local=False)

    run = node.from_ext(to_node_port(4))

    assert run.retval == TC_ACT_SHOT
    assert node.drops(C.KBP_DROP_NO_ROUTE)["packets"] == 1
    forward, reply, snat_port = _snat_entries(node, 4, UNROUTED_BACKEND[4], CLIENT[4], CLIENT_PORT)
    assert forward.flags & C.KBP_CT_F_SNAT
    assert abi.get_addr(forward.nat_addr, 4) == NODE[4]
    assert SNAT_PORTS[0] <= snat_port <= SNAT_PORTS[1]
    assert reply is not None and abi.get_addr(reply.nat_addr, 4) == CLIENT[4]


def test_a_packet_whose_ttl_would_expire_is_not_forwarded(node):
    node.service_to(REMOTE_BACKEND[4], local=False)

    run = node.from_ext(to_node_port(4, ttl=1))

    assert run.retval == TC_ACT_SHOT
    assert node.drops(C.KBP_DROP_NO_ROUTE)["packets"] == 1


# 3. SNAT port allocation


def test_two_clients_with_the_same_source_port_get_different_snat_ports(node):
    node.service_to(REMOTE_BACKEND[4], local=False)

    first = P.parse(node.from_ext(to_node_port(4)).data_out)
    second = P.parse(node.from_ext(to_node_port(4, client=OUTSIDER[4])).data_out)

    assert first.src == second.src == NODE[4]
    assert first.sport != second.sport
    for client, out in ((CLIENT[4], first), (OUTSIDER[4], second)):
        reply = node.ct(REMOTE_BACKEND[4], NODE[4], BACKEND_PORT, out.sport, C.KBP_CT_REPLY)
        assert abi.get_addr(reply.nat_addr, 4) == client


def test_a_flows_first_snat_port_try_is_derived_from_its_flow_hash(node):
    # ct_create_snat tries port_min + hash % span first, so a retransmitted SYN handled
    # on another CPU tends to claim the same port; random ports only follow collisions.
    node.service_to(REMOTE_BACKEND[4], local=False)
    span = SNAT_PORTS[1] - SNAT_PORTS[0] + 1

    out = P.parse(node.from_ext(to_node_port(4)).data_out)

    expected = SNAT_PORTS[0] + flow_hash(CLIENT[4], NODE[4], CLIENT_PORT, NODE_PORT, TCP) % span
    assert out.sport == expected


def test_when_every_snat_port_is_taken_a_new_flow_is_dropped(node):
    node.configure(snat_ports=(61000, 61001))
    node.service_to(REMOTE_BACKEND[4], local=False)

    runs = [node.from_ext(to_node_port(4, sport=CLIENT_PORT + n)) for n in range(3)]

    assert [run.retval for run in runs] == [TC_ACT_REDIRECT, TC_ACT_REDIRECT, TC_ACT_SHOT]
    assert {P.parse(run.data_out).sport for run in runs[:2]} == {61000, 61001}
    assert node.drops(C.KBP_DROP_NO_SNAT_PORT)["packets"] == 1
    assert node.counters(1)["drops"] == 1
    third = node.ct(CLIENT[4], NODE[4], CLIENT_PORT + 2, NODE_PORT, C.KBP_CT_FORWARD)
    assert third is None


def test_when_every_snat_port_is_taken_xdp_drops_the_new_flow(node):
    node.configure(snat_ports=(61000, 61000))
    node.service_to(REMOTE_BACKEND[4], local=False)
    node.from_ext(to_node_port(4))

    run = node.xdp(to_node_port(4, sport=CLIENT_PORT + 1))

    assert run.retval == XDP_DROP
    assert node.xdp_stats(C.KBP_XDP_DROP_OTHER)["packets"] == 1
    assert node.drops(C.KBP_DROP_NO_SNAT_PORT)["packets"] == 1


# 4. The reply of a SNATed flow arrives at ext0 and is sent back to the client.


def _backend_answer(family: int, snat_port: int, payload: bytes = b"") -> bytes:
    return frame(
        REMOTE_BACKEND[family],
        NODE[family],
        BACKEND_PORT,
        snat_port,
        flags="SA",
        payload=payload,
        eth_src=PEER_MAC,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_snated_flows_reply_gets_the_node_port_as_source_and_the_client_as_destination(
    node, family
):
    node.service_to(REMOTE_BACKEND[family], local=False)
    snat_port = P.parse(node.from_ext(to_node_port(family)).data_out).sport

    run = node.from_ext(_backend_answer(family, snat_port, b"answer"))

    assert run.retval == TC_ACT_REDIRECT
    out = P.parse(run.data_out)
    assert (out.src, out.sport) == (NODE[family], NODE_PORT)
    assert (out.dst, out.dport) == (CLIENT[family], CLIENT_PORT)
    assert (out.eth_src, out.eth_dst, out.ttl) == (NODE_MAC, ROUTER_MAC, 63)
    assert out.payload == b"answer"
    assert_checksums_valid(out)
    reply = node.ct(REMOTE_BACKEND[family], NODE[family], BACKEND_PORT, snat_port, C.KBP_CT_REPLY)
    assert reply.flags & C.KBP_CT_F_SEEN_REPLY
    assert node.counters(1)["packets"] == 2


def test_a_snated_flows_reply_is_forwarded_by_xdp_too(node):
    node.service_to(REMOTE_BACKEND[4], local=False)
    snat_port = P.parse(node.xdp(to_node_port(4)).data_out).sport

    run = node.xdp(_backend_answer(4, snat_port, b"fast"))

    assert run.retval == XDP_TX
    out = P.parse(run.data_out)
    assert (out.src, out.sport, out.dst, out.dport) == (NODE[4], NODE_PORT, CLIENT[4], CLIENT_PORT)
    assert (out.eth_src, out.eth_dst, out.ttl) == (NODE_MAC, ROUTER_MAC, 63)
    assert_checksums_valid(out)
    assert node.xdp_stats(C.KBP_XDP_TX)["packets"] == 2


def test_a_snated_flows_reply_to_the_egress_hook_is_left_alone(node):
    node.service_to(REMOTE_BACKEND[4], local=False)
    snat_port = P.parse(node.from_ext(to_node_port(4)).data_out).sport
    answer = _backend_answer(4, snat_port)

    run = node.to_ext(answer)

    assert (run.retval, run.data_out) == (TC_ACT_OK, answer)


# XDP forwarding of new flows to other nodes


@pytest.mark.parametrize("family", FAMILIES)
def test_xdp_forwards_a_syn_to_a_remote_backend_out_of_the_same_interface(node, family):
    node.service_to(REMOTE_BACKEND[family], local=False)
    syn = to_node_port(family, payload=b"xdp")

    run = node.xdp(syn)

    assert run.retval == XDP_TX
    out = P.parse(run.data_out)
    _, reply, snat_port = _snat_entries(
        node, family, REMOTE_BACKEND[family], CLIENT[family], CLIENT_PORT
    )
    assert (out.src, out.sport) == (NODE[family], snat_port)
    assert (out.dst, out.dport) == (REMOTE_BACKEND[family], BACKEND_PORT)
    assert (out.eth_src, out.eth_dst, out.ttl) == (NODE_MAC, PEER_MAC, 63)
    assert out.payload == b"xdp"
    assert_checksums_valid(out)
    assert reply is not None
    assert node.xdp_stats(C.KBP_XDP_TX) == {"packets": 1, "bytes": len(syn)}


def test_xdp_redirects_a_syn_whose_next_hop_is_behind_another_interface(node):
    node.service_to(REMOTE_VIA_EXT1, local=False)

    run = node.xdp(to_node_port(4))

    assert run.retval == XDP_REDIRECT
    out = P.parse(run.data_out)
    assert (out.src, out.dst, out.dport) == (NODE[4], REMOTE_VIA_EXT1, BACKEND_PORT)
    assert (out.eth_src, out.eth_dst, out.ttl) == (EXT1_MAC, PEER2_MAC, 63)
    assert_checksums_valid(out)
    assert node.xdp_stats(C.KBP_XDP_REDIRECT)["packets"] == 1


def _set_forward_hop(node: ExtNode, dmac: bytes, age_ns: int) -> None:
    """Make the flow of to_node_port(4) remember `dmac` as its next hop, looked up
    `age_ns` ago by the programs' clock (bpf_ktime_get_coarse_ns)."""
    key = abi.new("kbp_ct_key", sport=abi.be16(CLIENT_PORT), dport=abi.be16(NODE_PORT),
                  proto=TCP, family=4, dir=C.KBP_CT_FORWARD)  # fmt: skip
    abi.set_addr(key.saddr, CLIENT[4])
    abi.set_addr(key.daddr, NODE[4])
    table = node.loaded.map("kbp_ct")
    entry = abi.from_bytes("kbp_ct_entry", table.lookup(abi.to_bytes(key)))
    entry.hop_dmac = dmac
    entry.hop_time = time.clock_gettime_ns(CLOCK_MONOTONIC_COARSE) - age_ns
    table.update(abi.to_bytes(key), abi.to_bytes(entry))


@pytest.mark.parametrize("hook", ["xdp", "tc"])
def test_a_forwarded_flow_remembers_its_next_hop_from_the_fib(node, hook):
    node.service_to(REMOTE_BACKEND[4], local=False)
    send = node.xdp if hook == "xdp" else node.from_ext
    send(to_node_port(4))  # a new flow: the FIB answers (no entry to remember it in yet)
    forward = node.ct(CLIENT[4], NODE[4], CLIENT_PORT, NODE_PORT, C.KBP_CT_FORWARD)
    assert forward.hop_time == 0
    send(to_node_port(4, flags="A"))  # its next packet: the FIB's answer is remembered
    forward = node.ct(CLIENT[4], NODE[4], CLIENT_PORT, NODE_PORT, C.KBP_CT_FORWARD)
    assert (forward.hop_ifindex, bytes(forward.hop_dmac)) == (node.ext0, PEER_MAC)
    assert (bytes(forward.hop_smac), forward.hop_time > 0) == (NODE_MAC, True)

    # Remembered and young: used as it is (no FIB lookup would give this MAC).
    _set_forward_hop(node, ROUTER_MAC, age_ns=1_000_000)
    out = P.parse(send(to_node_port(4, flags="A")).data_out)
    assert (out.eth_dst, out.dst) == (ROUTER_MAC, REMOTE_BACKEND[4])


@pytest.mark.parametrize("hook", ["xdp", "tc"])
def test_a_forwarded_flow_asks_the_fib_again_once_its_next_hop_is_old(node, hook):
    node.service_to(REMOTE_BACKEND[4], local=False)
    send = node.xdp if hook == "xdp" else node.from_ext
    send(to_node_port(4))
    _set_forward_hop(node, ROUTER_MAC, age_ns=2 * HOP_CACHE_NS)

    out = P.parse(send(to_node_port(4, flags="A")).data_out)

    assert out.eth_dst == PEER_MAC
    forward = node.ct(CLIENT[4], NODE[4], CLIENT_PORT, NODE_PORT, C.KBP_CT_FORWARD)
    assert bytes(forward.hop_dmac) == PEER_MAC
    assert time.clock_gettime_ns(CLOCK_MONOTONIC_COARSE) - forward.hop_time < HOP_CACHE_NS


def test_a_snated_flows_reply_remembers_the_next_hop_to_the_client(node):
    node.service_to(REMOTE_BACKEND[4], local=False)
    snat_port = P.parse(node.xdp(to_node_port(4)).data_out).sport

    out = P.parse(node.xdp(_backend_answer(4, snat_port)).data_out)

    assert (out.eth_dst, out.dst) == (ROUTER_MAC, CLIENT[4])
    reply = node.ct(REMOTE_BACKEND[4], NODE[4], BACKEND_PORT, snat_port, C.KBP_CT_REPLY)
    assert (reply.hop_ifindex, bytes(reply.hop_dmac)) == (node.ext0, ROUTER_MAC)


def _hop_slot(addr: str) -> bytes:
    """The kbp_hops index of an address (bpf/maps.c map_hop)."""
    words = struct.unpack("=4I", abi.addr_bytes(addr))
    h = ((words[0] ^ words[1] ^ words[2] ^ words[3]) * 0x9E3779B1) & 0xFFFFFFFF
    return struct.pack("=I", (h ^ (h >> 16)) & (C.KBP_HOP_SLOTS - 1))


def test_a_new_flow_to_a_backend_reuses_the_next_hop_an_earlier_flow_found(node):
    node.service_to(REMOTE_BACKEND[4], local=False)
    hops = node.loaded.map("kbp_hops")
    node.from_ext(to_node_port(4))
    hop = abi.from_bytes("kbp_hop", hops.lookup(_hop_slot(REMOTE_BACKEND[4])))
    assert abi.get_addr(hop.addr, 4) == REMOTE_BACKEND[4]
    assert (hop.in_ifindex, hop.ifindex, bytes(hop.dmac)) == (node.ext0, node.ext0, PEER_MAC)
    assert hop.time > 0
    # A remembered answer is used as it stands: a MAC planted in it is where the next new
    # flow to that backend goes, without a FIB lookup.
    planted = bytes.fromhex("02aabbccddee")
    hop.dmac = list(planted)
    hops.update(_hop_slot(REMOTE_BACKEND[4]), abi.to_bytes(hop))

    out = P.parse(node.from_ext(to_node_port(4, client=OUTSIDER[4])).data_out)

    assert (out.dst, out.eth_dst) == (REMOTE_BACKEND[4], planted)
    # One found for packets that arrived on another interface is not: the FIB answers.
    hop.in_ifindex = node.ext0 + 1000
    hops.update(_hop_slot(REMOTE_BACKEND[4]), abi.to_bytes(hop))
    out = P.parse(node.from_ext(to_node_port(4, sport=CLIENT_PORT + 1)).data_out)
    assert out.eth_dst == PEER_MAC
    hop = abi.from_bytes("kbp_hop", hops.lookup(_hop_slot(REMOTE_BACKEND[4])))
    assert (hop.in_ifindex, bytes(hop.dmac)) == (node.ext0, PEER_MAC)


def _set_epoch(node: ExtNode, epoch: int) -> None:
    """kbp_hop_epoch, as the agent's HopEpoch sets it while it watches (hops.py)."""
    node.loaded.map("kbp_hop_epoch").update(bytes(4), struct.pack("=I", epoch))


@pytest.mark.parametrize("hook", ["xdp", "tc"])
def test_while_the_agent_watches_a_next_hop_holds_until_the_epoch_changes(node, hook):
    node.service_to(REMOTE_BACKEND[4], local=False)
    send = node.xdp if hook == "xdp" else node.from_ext
    _set_epoch(node, 7)
    send(to_node_port(4))
    hops_by_address, key = node.loaded.map("kbp_hops"), _hop_slot(REMOTE_BACKEND[4])
    hop = abi.from_bytes("kbp_hop", hops_by_address.lookup(key))
    assert (abi.get_addr(hop.addr, 4), hop.epoch) == (REMOTE_BACKEND[4], 7)
    assert (hop.in_ifindex, hop.ifindex, bytes(hop.dmac)) == (node.ext0, node.ext0, PEER_MAC)
    # Under the same epoch an answer far older than 100 ms is used as it stands.
    planted = bytes.fromhex("02aabbccddee")
    hop.dmac = list(planted)
    hop.time -= 2 * HOP_CACHE_NS
    hops_by_address.update(key, abi.to_bytes(hop))
    out = P.parse(send(to_node_port(4, client=OUTSIDER[4])).data_out)
    assert (out.dst, out.eth_dst) == (REMOTE_BACKEND[4], planted)
    # A new epoch (a route or neighbour changed): the FIB answers, kept under it.
    _set_epoch(node, 8)
    out = P.parse(send(to_node_port(4, sport=CLIENT_PORT + 1)).data_out)
    assert out.eth_dst == PEER_MAC
    hop = abi.from_bytes("kbp_hop", hops_by_address.lookup(key))
    assert (hop.epoch, bytes(hop.dmac)) == (8, PEER_MAC)
    # Not used under its own epoch either: an answer older than KBP_HOP_WATCHED_NS (an
    # agent killed without saying so), or one for another address (sharing the slot).
    for sport, stale in ((CLIENT_PORT + 2, "old"), (CLIENT_PORT + 3, "another address")):
        hop = abi.from_bytes("kbp_hop", hops_by_address.lookup(key))
        hop.dmac = list(planted)
        if stale == "old":
            hop.time -= HOP_WATCHED_NS
        else:
            abi.set_addr(hop.addr, "192.0.2.99")
        hops_by_address.update(key, abi.to_bytes(hop))
        out = P.parse(send(to_node_port(4, sport=sport)).data_out)
        assert out.eth_dst == PEER_MAC, stale


def test_xdp_passes_a_syn_to_a_backend_without_a_route_untouched_for_tc(node):
    node.service_to(UNROUTED_BACKEND[4], local=False)
    syn = to_node_port(4)

    run = node.xdp(syn)

    assert (run.retval, run.data_out) == (XDP_PASS, syn)
    assert node.xdp_stats(C.KBP_XDP_PASS)["packets"] == 1
    forward = node.ct(CLIENT[4], NODE[4], CLIENT_PORT, NODE_PORT, C.KBP_CT_FORWARD)
    assert forward is not None and forward.flags & C.KBP_CT_F_SNAT


# 5. loadBalancerSourceRanges


def _source_ranged_service(node: ExtNode, family: int) -> None:
    backend_id = node.add_ext_backend(1, LOCAL_BACKEND[family], local=True)
    node.write_set(1, [backend_id])
    node.write_frontend(
        C.KBP_FE_LOAD_BALANCER,
        family,
        set_id=1,
        count=1,
        flags=C.KBP_SVC_F_HAS_ENDPOINTS | C.KBP_SVC_F_SOURCE_RANGES,
    )
    node.write_frontend(C.KBP_FE_NODE_PORT, family, set_id=1, count=1)
    node.admit(C.KBP_FE_LOAD_BALANCER, family, SOURCE_RANGE[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_client_inside_the_source_ranges_reaches_the_load_balancer_vip(node, family):
    _source_ranged_service(node, family)

    run = node.from_ext(to_vip(family))

    assert run.retval == TC_ACT_OK
    out = P.parse(run.data_out)
    assert (out.src, out.dst, out.dport) == (CLIENT[family], LOCAL_BACKEND[family], BACKEND_PORT)
    assert_checksums_valid(out)
    assert node.drops(C.KBP_DROP_SOURCE_RANGE)["packets"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_client_outside_the_source_ranges_is_dropped_at_tc(node, family):
    _source_ranged_service(node, family)
    syn = to_vip(family, client=OUTSIDER[family])

    run = node.from_ext(syn)

    assert run.retval == TC_ACT_SHOT
    assert node.drops(C.KBP_DROP_SOURCE_RANGE) == {"packets": 1, "bytes": len(syn)}
    assert node.counters(1)["drops"] == 1
    assert node.ct(OUTSIDER[family], LB_VIP[family], CLIENT_PORT, LB_PORT, 0) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_client_outside_the_source_ranges_is_dropped_by_xdp(node, family):
    _source_ranged_service(node, family)
    syn = to_vip(family, client=OUTSIDER[family])

    run = node.xdp(syn)

    assert run.retval == XDP_DROP
    assert node.xdp_stats(C.KBP_XDP_DROP_RANGE) == {"packets": 1, "bytes": len(syn)}
    assert node.drops(C.KBP_DROP_SOURCE_RANGE)["packets"] == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_the_node_port_of_a_source_ranged_service_admits_every_client(node, family):
    _source_ranged_service(node, family)

    inside = node.from_ext(to_node_port(family))
    outside = node.from_ext(to_node_port(family, client=OUTSIDER[family]))
    by_xdp = node.xdp(to_node_port(family, client=OUTSIDER[family], sport=CLIENT_PORT + 1))

    for run in (inside, outside):
        assert run.retval == TC_ACT_OK
        assert P.parse(run.data_out).dst == LOCAL_BACKEND[family]
    assert by_xdp.retval == XDP_PASS
    assert node.drops(C.KBP_DROP_SOURCE_RANGE)["packets"] == 0
    assert node.xdp_stats(C.KBP_XDP_DROP_RANGE)["packets"] == 0


# 6. externalTrafficPolicy Local without a local endpoint


def _local_policy_without_local_endpoints(node: ExtNode, family: int) -> None:
    remote = node.add_ext_backend(1, REMOTE_BACKEND[family], local=False)
    node.write_set(2, [remote])  # clusterBackends
    node.write_frontend(
        C.KBP_FE_NODE_PORT, family, set_id=0, count=0, internal_set_id=2, internal_count=1
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_local_policy_without_a_local_endpoint_drops_outside_traffic_at_tc(node, family):
    _local_policy_without_local_endpoints(node, family)
    syn = to_node_port(family)

    run = node.from_ext(syn)

    assert run.retval == TC_ACT_SHOT
    assert node.drops(C.KBP_DROP_NO_BACKEND) == {"packets": 1, "bytes": len(syn)}
    assert node.counters(1)["drops"] == 1


def test_local_policy_without_a_local_endpoint_drops_outside_traffic_in_xdp(node):
    _local_policy_without_local_endpoints(node, 4)

    run = node.xdp(to_node_port(4))

    assert run.retval == XDP_DROP
    assert node.xdp_stats(C.KBP_XDP_DROP_NO_BACKEND)["packets"] == 1
    assert node.drops(C.KBP_DROP_NO_BACKEND)["packets"] == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_local_policy_gives_a_cluster_pod_the_cluster_backends(node, family):
    _local_policy_without_local_endpoints(node, family)

    run = node.from_ext(to_node_port(family, client=PEER_POD[family], eth_src=PEER_MAC))
    by_xdp = node.xdp(
        to_node_port(family, client=PEER_POD[family], sport=CLIENT_PORT + 1, eth_src=PEER_MAC)
    )

    assert run.retval == TC_ACT_REDIRECT
    out = P.parse(run.data_out)
    assert (out.dst, out.dport, out.src) == (REMOTE_BACKEND[family], BACKEND_PORT, NODE[family])
    assert_checksums_valid(out)
    assert by_xdp.retval == XDP_TX
    assert P.parse(by_xdp.data_out).dst == REMOTE_BACKEND[family]
    assert node.drops(C.KBP_DROP_NO_BACKEND)["packets"] == 0


# 7. No endpoints anywhere: REJECT


@pytest.mark.parametrize("family", FAMILIES)
def test_a_syn_to_a_node_port_without_endpoints_is_answered_with_rst_ack(node, family):
    node.write_frontend(C.KBP_FE_NODE_PORT, family, set_id=0, count=0, flags=0)
    syn = frame(CLIENT[family], NODE[family], CLIENT_PORT, NODE_PORT)

    run = node.from_ext(syn)

    assert run.retval == TC_ACT_REDIRECT
    rst = P.parse(run.data_out)
    assert (rst.eth_src, rst.eth_dst) == (NODE_MAC, ROUTER_MAC)
    assert (rst.src, rst.sport) == (NODE[family], NODE_PORT)
    assert (rst.dst, rst.dport) == (CLIENT[family], CLIENT_PORT)
    assert rst.has_flags("RA")
    assert (rst.seq, rst.ack) == (0, 1001)
    assert_checksums_valid(rst)
    assert node.drops(C.KBP_DROP_REJECTED)["packets"] == 1


def test_xdp_passes_a_syn_to_a_node_port_without_endpoints_for_tc_to_reject(node):
    node.write_frontend(C.KBP_FE_NODE_PORT, 4, set_id=0, count=0, flags=0)
    syn = to_node_port(4)

    run = node.xdp(syn)

    assert (run.retval, run.data_out) == (XDP_PASS, syn)
    assert node.xdp_stats(C.KBP_XDP_PASS)["packets"] == 1
    assert node.drops(C.KBP_DROP_REJECTED)["packets"] == 0


# 8. XDP leaves what it does not forward to tc, untouched


NOT_FOR_A_FRONTEND = {
    "to the node on another port": lambda: frame(CLIENT[4], NODE[4], CLIENT_PORT, 22),
    "to the node from IPv6": lambda: frame(CLIENT[6], NODE[6], CLIENT_PORT, 22),
    "UDP to the node port": lambda: P.ethernet(
        P.ipv4_packet(
            CLIENT[4], NODE[4], UDP, P.udp_datagram(CLIENT[4], NODE[4], 53, NODE_PORT, b"q")
        ),
        P.ETH_P_IP,
        src=ROUTER_MAC,
        dst=NODE_MAC,
    ),
    "an ARP request": lambda: P.ethernet(bytes(28), P.ETH_P_ARP, src=ROUTER_MAC, dst=NODE_MAC),
}


@pytest.mark.parametrize("make_frame", NOT_FOR_A_FRONTEND.values(), ids=NOT_FOR_A_FRONTEND.keys())
def test_packets_not_for_a_frontend_pass_xdp_and_tc_untouched(node, make_frame):
    node.service_to(REMOTE_BACKEND[4], local=False)
    packet = make_frame()

    by_xdp, by_tc = node.xdp(packet), node.from_ext(packet)

    assert (by_xdp.retval, by_xdp.data_out) == (XDP_PASS, packet)
    assert (by_tc.retval, by_tc.data_out) == (TC_ACT_OK, packet)
    assert node.xdp_stats(C.KBP_XDP_PASS)["packets"] == 1
    assert node.counters(1)["packets"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_xdp_passes_a_syn_for_a_local_backend_untouched_and_tc_reuses_its_flow(node, family):
    node.service_to(LOCAL_BACKEND[family], local=True)
    syn = to_node_port(family)

    run = node.xdp(syn)

    assert (run.retval, run.data_out) == (XDP_PASS, syn)
    forward = node.ct(CLIENT[family], NODE[family], CLIENT_PORT, NODE_PORT, C.KBP_CT_FORWARD)
    assert forward is not None
    assert abi.get_addr(forward.addr, family) == LOCAL_BACKEND[family]

    by_tc = node.from_ext(syn)

    assert by_tc.retval == TC_ACT_OK
    assert P.parse(by_tc.data_out).dst == LOCAL_BACKEND[family]
    assert node.counters(1)["new_flows"] == 1
