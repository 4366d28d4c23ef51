"""Packet fixtures through BPF_PROG_TEST_RUN: what the tc programs make of single frames.

Each test loads the real datapath (bpf/tc_from_pod.c + bpf/tc_to_pod.c) with its maps
pinned under a fresh bpffs directory, writes map entries the way the agent would, runs
frames through `kbp_from_pod` (tc ingress on the pod's host veth: packets leaving the pod)
or `kbp_to_pod` (tc egress: packets to the pod) and checks every rewritten field and the
full L3/L4 checksums of the output.

Address plan (nothing here is configured on an interface; frames only):
  client pod       10.244.0.2      fd00:244::2       source port 40000 (+n)
  backends         10.244.1.5-8    fd00:244:1::5-8   port 8080
  ClusterIP        10.96.0.10      fd00:96::10       port 80 (TCP and UDP)
  second ClusterIP 10.96.0.20      fd00:96::20       port 80, same backend (clashes)
  other addresses  10.244.9.9      fd00:244:9::9     not services
"""

from __future__ import annotations

import json
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from agent.dataplane.ebpf import abi, codec, external, kernel, libbpf
from agent.dataplane.ebpf import frames as P

pytestmark = pytest.mark.kernel

C = abi.const
TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT = 0, 2, 7
TCP, UDP = P.PROTO_TCP, P.PROTO_UDP

CLIENT = {4: "10.244.0.2", 6: "fd00:244::2"}
BACKENDS = {
    4: [f"10.244.1.{n}" for n in (5, 6, 7, 8)],
    6: [f"fd00:244:1::{n}" for n in (5, 6, 7, 8)],
}
CLUSTER_IP = {4: "10.96.0.10", 6: "fd00:96::10"}
CLUSTER_IP_2 = {4: "10.96.0.20", 6: "fd00:96::20"}  # a second Service on the same backend
OTHER = {4: "10.244.9.9", 6: "fd00:244:9::9"}
FRONTEND_PORT, BACKEND_PORT, CLIENT_PORT = 80, 8080, 40000

# Small maps: the tests write a handful of entries; compile-time sizes keep loading fast.
SIZES = {"services": 256, "slots": 1024, "backends": 256, "ct": 1024, "affinity": 256}


@dataclass
class Datapath:
    """The loaded programs and their maps, with writers shaped like the agent's."""

    loaded: kernel.LoadedPrograms
    next_backend_id: int = 100
    backend_ids: dict[tuple[int, str], int] = field(default_factory=dict)

    def from_pod(self, frame: bytes) -> libbpf.TestRun:
        return libbpf.prog_test_run(self.loaded.fd("kbp_from_pod"), frame)

    def to_pod(self, frame: bytes) -> libbpf.TestRun:
        return libbpf.prog_test_run(self.loaded.fd("kbp_to_pod"), frame)

    # writers

    def add_backend(
        self, service_id: int, ip: str, port: int = BACKEND_PORT, flags: int = 0
    ) -> int:
        backend_id = self.next_backend_id
        self.next_backend_id += 1
        value = abi.new("kbp_backend", port=abi.be16(port), family=abi.family_of(ip),
                        flags=flags, service_id=service_id)  # fmt: skip
        abi.set_addr(value.addr, ip)
        self.mark_backend_port(port)
        self.loaded.map("kbp_backends").update(struct.pack("=I", backend_id), abi.to_bytes(value))
        self.backend_ids[(service_id, ip)] = backend_id
        return backend_id

    def mark_port(self, port: int, flag: int) -> None:
        """A kbp_ports bit, as the agent sets it before a backend or frontend with `port`
        is written."""
        table, key = self.loaded.map("kbp_ports"), struct.pack("=I", port)
        table.update(key, bytes([(table.lookup(key) or b"\x00")[0] | flag]))

    def mark_backend_port(self, port: int) -> None:
        self.mark_port(port, C.KBP_PORT_F_BACKEND)

    def delete_backend(self, backend_id: int) -> None:
        assert self.loaded.map("kbp_backends").delete(struct.pack("=I", backend_id))

    def write_set(self, set_id: int, backend_ids: list[int]) -> None:
        slots, backends = self.loaded.map("kbp_slots"), self.loaded.map("kbp_backends")
        for index, backend_id in enumerate(backend_ids):
            # a slot carries a copy of its backend (the backend is written first); the set
            # is the run of slots from its id
            copy = backends.lookup(struct.pack("=I", backend_id)) or codec.NO_COPY
            slots.update(codec.slot_key(set_id + index), codec.slot_value(backend_id, copy))

    def write_service(
        self,
        service_id: int,
        family: int,
        proto: int,
        set_id: int,
        count: int,
        flags: int = C.KBP_SVC_F_HAS_ENDPOINTS,
        affinity_timeout: int = 0,
        frontend: str = "",
        *,
        port: int = FRONTEND_PORT,
        fe_type: int = C.KBP_FE_CLUSTER_IP,
        internal_set_id: int | None = None,
        internal_count: int | None = None,
    ) -> None:
        """A kbp_services entry: the ClusterIP's unless `frontend`, `port` and `fe_type`
        say otherwise; the internal set is the set unless given. `flags` beside the bits
        the type gives every frontend of it, as the agent writes them."""
        key = abi.new("kbp_frontend_key", port=abi.be16(port), proto=proto, family=family)
        abi.set_addr(key.addr, frontend or CLUSTER_IP[family])
        value = abi.new(
            "kbp_service",
            service_id=service_id,
            flags=flags | abi.FRONTEND_FLAGS[fe_type],
            set_id=set_id,
            count=count,
            internal_set_id=set_id if internal_set_id is None else internal_set_id,
            internal_count=count if internal_count is None else internal_count,
            affinity_timeout=affinity_timeout,
            type=fe_type,
        )
        self.mark_port(port, C.KBP_PORT_F_FRONTEND)
        self.loaded.map("kbp_services").update(abi.to_bytes(key), abi.to_bytes(value))

    def service(
        self,
        family: int = 4,
        proto: int = TCP,
        backends: int = 1,
        *,
        service_id: int = 1,
        set_id: int = 1,
        flags: int = C.KBP_SVC_F_HAS_ENDPOINTS,
        affinity_timeout: int = 0,
    ) -> list[int]:
        """A ClusterIP service with the first `backends` backends; their ids."""
        ids = [self.add_backend(service_id, ip) for ip in BACKENDS[family][:backends]]
        self.write_set(set_id, ids)
        self.write_service(service_id, family, proto, set_id, len(ids), flags, affinity_timeout)
        return ids

    def write_config(self, snat_ports: tuple[int, int] = (61000, 65535)) -> None:
        """kbp_config as the agent writes it at its first apply (the SNAT port range is
        where clashing client ports are remapped to)."""
        value = external.config_value(["192.168.0.1"], ["10.244.0.0/16"], 0, snat_ports)
        self.loaded.map("kbp_config").update(bytes(4), value)

    def ct_stat(self, index: int) -> int:
        raw = self.loaded.map("kbp_ct_stats").lookup(struct.pack("=I", index))
        assert raw is not None
        return sum(struct.unpack(f"={len(raw) // 8}Q", raw))

    def write_affinity(self, client: str, service_id: int, backend_id: int, last_used: int) -> None:
        key = abi.new("kbp_affinity_key", service_id=service_id, family=abi.family_of(client))
        abi.set_addr(key.client, client)
        value = abi.new("kbp_affinity", last_used=last_used, backend_id=backend_id)
        self.loaded.map("kbp_affinity").update(abi.to_bytes(key), abi.to_bytes(value))

    def clear_conntrack(self) -> None:
        ct = self.loaded.map("kbp_ct")
        stored = ct.keys()
        for key in stored:
            ct.delete(key)

    # readers

    def _percpu(self, name: str, struct_name: str, index: int) -> dict[str, int]:
        m = self.loaded.map(name)
        raw = m.lookup(struct.pack("=I", index))
        assert raw is not None
        size = abi.ffi.sizeof(f"struct {struct_name}")
        stride = (size + 7) // 8 * 8
        totals: dict[str, int] = {}
        for off in range(0, len(raw), stride):
            value = abi.from_bytes(struct_name, raw[off : off + size])
            for name_, _, _ in abi.layout(struct_name):
                totals[name_] = totals.get(name_, 0) + getattr(value, name_)
        return totals

    def counters(self, service_id: int) -> dict[str, int]:
        return self._percpu("kbp_counters", "kbp_counters", service_id)

    def drops(self, reason: int) -> dict[str, int]:
        return self._percpu("kbp_drops", "kbp_drop_counters", reason)

    def affinity_backend(self, client: str, service_id: int) -> int | None:
        key = abi.new("kbp_affinity_key", service_id=service_id, family=abi.family_of(client))
        abi.set_addr(key.client, client)
        raw = self.loaded.map("kbp_affinity").lookup(abi.to_bytes(key))
        return None if raw is None else abi.from_bytes("kbp_affinity", raw).backend_id


@pytest.fixture
def datapath(bpf_pin_dir) -> Iterator[Datapath]:
    loaded = kernel.load_programs(bpf_pin_dir, SIZES)
    try:
        yield Datapath(loaded)
    finally:
        loaded.close()


# Frames from the client pod and replies from backends.


def client_frame(
    family: int,
    proto: int,
    *,
    sport: int = CLIENT_PORT,
    dst: str = "",
    dport: int = FRONTEND_PORT,
    flags: str = "S",
    payload: bytes = b"",
    client: str = "",
    **kw,
) -> bytes:
    src = client or CLIENT[family]
    dst = dst or CLUSTER_IP[family]
    if proto == TCP:
        return P.tcp_frame(src, dst, sport, dport, flags=flags, payload=payload, **kw)
    return P.udp_frame(src, dst, sport, dport, payload, **kw)


def backend_reply(
    family: int,
    proto: int,
    backend: str,
    *,
    dport: int = CLIENT_PORT,
    dst: str = "",
    flags: str = "SA",
    payload: bytes = b"",
    **kw,
) -> bytes:
    dst = dst or CLIENT[family]
    if proto == TCP:
        return P.tcp_frame(backend, dst, BACKEND_PORT, dport, flags=flags, payload=payload, **kw)
    return P.udp_frame(backend, dst, BACKEND_PORT, dport, payload, **kw)


def assert_checksums_valid(pkt: P.Packet) -> None:
    assert pkt.ip_checksum_ok, "IPv4 header checksum"
    assert pkt.l4_checksum_ok, f"L4 checksum {pkt.l4_checksum:#06x}"


def flow_hash(src: str, dst: str, sport: int, dport: int, proto: int) -> int:
    """Python mirror of lb_flow_hash (bpf/lib/lb.h): Murmur3 mixing over ten words."""
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    def mix(h: int, k: int) -> int:
        k = (k * 0xCC9E2D51) & mask
        k = rotl(k, 15)
        k = (k * 0x1B873593) & mask
        h ^= k
        h = rotl(h, 13)
        return (h * 5 + 0xE6546B64) & mask

    words = list(struct.unpack("!4I", abi.addr_bytes(src)))
    words += list(struct.unpack("!4I", abi.addr_bytes(dst)))
    words += [(sport << 16) | dport, proto]
    h = 0
    for word in words:
        h = mix(h, word)
    h ^= 40
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & mask
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & mask
    h ^= h >> 16
    return h


FAMILIES_AND_PROTOCOLS = [
    pytest.param(4, TCP, id="IPv4 TCP"),
    pytest.param(4, UDP, id="IPv4 UDP"),
    pytest.param(6, TCP, id="IPv6 TCP"),
    pytest.param(6, UDP, id="IPv6 UDP"),
]


# Translation


@pytest.mark.parametrize(("family", "proto"), FAMILIES_AND_PROTOCOLS)
def test_a_packet_to_a_cluster_ip_is_sent_to_its_backend_with_valid_checksums(
    datapath, family, proto
):
    datapath.service(family, proto)
    frame = client_frame(family, proto, payload=b"hello backend")

    run = datapath.from_pod(frame)

    assert run.retval == TC_ACT_OK
    out = P.parse(run.data_out)
    assert (out.src, out.sport) == (CLIENT[family], CLIENT_PORT)
    assert (out.dst, out.dport) == (BACKENDS[family][0], BACKEND_PORT)
    assert out.payload == b"hello backend"
    assert (out.eth_src, out.eth_dst, out.ttl) == (P.POD_MAC, P.HOST_MAC, 64)
    assert len(run.data_out) == len(frame)
    assert_checksums_valid(out)


@pytest.mark.parametrize(("family", "proto"), FAMILIES_AND_PROTOCOLS)
def test_a_backends_reply_gets_the_cluster_ip_back_as_its_source(datapath, family, proto):
    datapath.service(family, proto)
    datapath.from_pod(client_frame(family, proto))
    reply = backend_reply(family, proto, BACKENDS[family][0], payload=b"hello client")

    run = datapath.to_pod(reply)

    assert run.retval == TC_ACT_OK
    out = P.parse(run.data_out)
    assert (out.src, out.sport) == (CLUSTER_IP[family], FRONTEND_PORT)
    assert (out.dst, out.dport) == (CLIENT[family], CLIENT_PORT)
    assert out.payload == b"hello client"
    assert_checksums_valid(out)


def test_replies_are_looked_up_only_from_ports_a_backend_served_on(datapath):
    # kbp_ports gates the reply lookup: the agent marks a backend's port before it
    # writes the backend and never unmarks it. Unmarked, the same reply passes untouched.
    datapath.service(4, TCP)
    datapath.from_pod(client_frame(4, TCP))
    reply = backend_reply(4, TCP, BACKENDS[4][0])
    assert P.parse(datapath.to_pod(reply).data_out).src == CLUSTER_IP[4]

    datapath.loaded.map("kbp_ports").update(struct.pack("=I", BACKEND_PORT), b"\x00")

    assert datapath.to_pod(reply).data_out == reply


def test_frontends_are_looked_up_only_at_ports_a_frontend_used(datapath):
    # The frontend bit of kbp_ports gates the frontend lookup the same way: without it a
    # SYN to the ClusterIP passes as a non-service packet.
    datapath.service(4, TCP)
    table, key = datapath.loaded.map("kbp_ports"), struct.pack("=I", FRONTEND_PORT)
    table.update(key, bytes([table.lookup(key)[0] & ~C.KBP_PORT_F_FRONTEND]))
    syn = client_frame(4, TCP)

    assert datapath.from_pod(syn).data_out == syn
    datapath.mark_port(FRONTEND_PORT, C.KBP_PORT_F_FRONTEND)
    assert P.parse(datapath.from_pod(syn).data_out).dst in BACKENDS[4]


def test_a_local_backends_reply_is_translated_at_its_own_veth_ingress_too(datapath):
    datapath.service(4, TCP)
    datapath.from_pod(client_frame(4, TCP))

    run = datapath.from_pod(backend_reply(4, TCP, BACKENDS[4][0]))

    out = P.parse(run.data_out)
    assert run.retval == TC_ACT_OK
    assert (out.src, out.sport, out.dst) == (CLUSTER_IP[4], FRONTEND_PORT, CLIENT[4])
    assert_checksums_valid(out)


def test_a_translated_reply_is_not_translated_again_at_the_clients_egress(datapath):
    datapath.service(4, TCP)
    datapath.from_pod(client_frame(4, TCP))
    translated = datapath.from_pod(backend_reply(4, TCP, BACKENDS[4][0])).data_out

    run = datapath.to_pod(translated)

    assert run.retval == TC_ACT_OK
    assert run.data_out == translated


def test_a_direct_connection_reusing_a_closed_flows_ports_is_not_translated(datapath):
    # A ClusterIP flow client:CLIENT_PORT -> backend ends; later the client connects to
    # the same backend directly from the same port. Its SYN must clear the old reply
    # entry, or the backend's SYN-ACK would come back disguised as the ClusterIP.
    datapath.service(4, TCP, backends=1)
    backend = BACKENDS[4][0]
    datapath.from_pod(client_frame(4, TCP))
    datapath.from_pod(client_frame(4, TCP, flags="R"))

    direct = datapath.from_pod(client_frame(4, TCP, dst=backend, dport=BACKEND_PORT))
    run = datapath.to_pod(backend_reply(4, TCP, backend))

    assert direct.retval == TC_ACT_OK
    assert P.parse(direct.data_out).dst == backend
    out = P.parse(run.data_out)
    assert (out.src, out.sport) == (backend, BACKEND_PORT)


def test_a_udp_datagram_without_checksum_keeps_a_zero_checksum_both_ways(datapath):
    datapath.service(4, UDP)

    out = P.parse(
        datapath.from_pod(client_frame(4, UDP, payload=b"x" * 9, zero_checksum=True)).data_out
    )
    back = P.parse(
        datapath.to_pod(backend_reply(4, UDP, BACKENDS[4][0], zero_checksum=True)).data_out
    )

    assert (out.dst, out.dport, out.l4_checksum) == (BACKENDS[4][0], BACKEND_PORT, 0)
    assert (back.src, back.sport, back.l4_checksum) == (CLUSTER_IP[4], FRONTEND_PORT, 0)
    assert out.ip_checksum_ok and back.ip_checksum_ok


def test_a_packet_with_ip_options_is_translated_with_valid_checksums(datapath):
    datapath.service(4, TCP)
    segment = P.tcp_segment(CLIENT[4], CLUSTER_IP[4], CLIENT_PORT, FRONTEND_PORT, payload=b"opt")
    # Router Alert (RFC 2113), 4 bytes: the TCP header starts 24 bytes into the packet.
    ip = P.ipv4_packet(CLIENT[4], CLUSTER_IP[4], TCP, segment, options=bytes([148, 4, 0, 0]))

    out = P.parse(datapath.from_pod(P.ethernet(ip, P.ETH_P_IP)).data_out)

    assert out.ip_header_len == 24
    assert (out.dst, out.dport, out.payload) == (BACKENDS[4][0], BACKEND_PORT, b"opt")
    assert_checksums_valid(out)


def test_a_first_fragment_is_translated_and_a_later_fragment_passes_untouched(datapath):
    datapath.service(4, UDP)
    datagram = P.udp_datagram(CLIENT[4], CLUSTER_IP[4], CLIENT_PORT, FRONTEND_PORT, b"a" * 24)
    first = P.ethernet(
        P.ipv4_packet(CLIENT[4], CLUSTER_IP[4], UDP, datagram[:16], ident=7, more_fragments=True),
        P.ETH_P_IP,
    )
    later = P.ethernet(
        P.ipv4_packet(CLIENT[4], CLUSTER_IP[4], UDP, datagram[16:], ident=7, fragment_offset=2),
        P.ETH_P_IP,
    )

    out_first = P.parse(datapath.from_pod(first).data_out)
    run_later = datapath.from_pod(later)

    assert (out_first.dst, out_first.dport, out_first.more_fragments) == (
        BACKENDS[4][0],
        BACKEND_PORT,
        True,
    )
    assert out_first.ip_checksum_ok
    assert (run_later.retval, run_later.data_out) == (TC_ACT_OK, later)


NOT_FOR_A_SERVICE = {
    "to another address": lambda: client_frame(4, TCP, dst=OTHER[4]),
    "to the ClusterIP on another port": lambda: client_frame(4, TCP, dport=443),
    "to the ClusterIP with another protocol": lambda: client_frame(4, UDP),
    "IPv6 to another address": lambda: client_frame(6, TCP, dst=OTHER[6]),
    "ICMP echo to the ClusterIP": lambda: P.ethernet(
        P.ipv4_packet(
            CLIENT[4], CLUSTER_IP[4], P.PROTO_ICMP, bytes([8, 0, 0xF7, 0xFF, 0, 0, 0, 0])
        ),
        P.ETH_P_IP,
    ),
    "IPv6 with an extension header to the ClusterIP": lambda: P.ethernet(
        # Hop-by-hop options (PadN) then TCP: extension headers are not walked.
        P.ipv6_packet(
            CLIENT[6],
            CLUSTER_IP[6],
            0,
            bytes([TCP, 0, 1, 4, 0, 0, 0, 0])
            + P.tcp_segment(CLIENT[6], CLUSTER_IP[6], CLIENT_PORT, FRONTEND_PORT),
        ),
        P.ETH_P_IPV6,
    ),
    "an ARP request": lambda: P.ethernet(bytes(28), P.ETH_P_ARP),
}


@pytest.mark.parametrize("make_frame", NOT_FOR_A_SERVICE.values(), ids=NOT_FOR_A_SERVICE.keys())
def test_packets_not_for_a_service_pass_untouched_both_ways(
    datapath, make_frame: Callable[[], bytes]
):
    datapath.service(4, TCP)
    datapath.service(6, TCP, service_id=2, set_id=2)
    frame = make_frame()

    ingress, egress = datapath.from_pod(frame), datapath.to_pod(frame)

    assert (ingress.retval, ingress.data_out) == (TC_ACT_OK, frame)
    assert (egress.retval, egress.data_out) == (TC_ACT_OK, frame)


@pytest.mark.parametrize("program", ["kbp_from_pod", "kbp_to_pod", "kbp_from_ext", "kbp_to_ext"])
def test_tc_programs_do_not_unclone_the_packets_they_leave_alone(datapath, program):
    """No direct packet write in a tc program: for one, the verifier prepends a prologue
    that unclones every cloned skb the program runs on (bpf_skb_pull_data when
    skb->cloned), and every data segment a TCP socket sends is a clone: each would have its
    head copied at every veth it crosses, translated or not (bpf/lib/nat.h)."""
    prog_id = libbpf.prog_id(datapath.loaded.fd(program))
    dump = subprocess.run(["bpftool", "--json", "prog", "dump", "xlated", "id", str(prog_id)],
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    first = [insn["disasm"] for insn in json.loads(dump)[:8]]

    assert not any("skb_pull_data" in insn for insn in first), first


def test_a_truncated_tcp_header_is_dropped_as_malformed(datapath):
    datapath.service(4, TCP)
    frame = client_frame(4, TCP)
    ip_len = 20 + 12  # the IPv4 header says 12 bytes of TCP follow: too short for a header
    truncated = frame[:14] + P.ipv4_packet(CLIENT[4], CLUSTER_IP[4], TCP, frame[34:46])
    assert len(truncated) == 14 + ip_len

    run = datapath.from_pod(truncated)

    assert run.retval == TC_ACT_SHOT
    assert datapath.drops(C.KBP_DROP_MALFORMED)["packets"] == 1


def _tcp_with_data_offset(family: int, words: int) -> bytes:
    segment = bytearray(P.tcp_segment(CLIENT[family], OTHER[family], CLIENT_PORT, 443))
    segment[12] = words << 4
    return P.ip_packet(CLIENT[family], OTHER[family], TCP, bytes(segment))


def _ipv4_with_header_length(words: int) -> bytes:
    segment = P.tcp_segment(CLIENT[4], OTHER[4], CLIENT_PORT, 443)
    packet = bytearray(P.ipv4_packet(CLIENT[4], OTHER[4], TCP, segment))
    packet[0] = 0x40 | words
    return P.ethernet(bytes(packet), P.ETH_P_IP)


MALFORMED_TO_NO_SERVICE = {
    "TCP data offset 4": lambda: _tcp_with_data_offset(4, 4),
    "IPv6, TCP data offset 4": lambda: _tcp_with_data_offset(6, 4),
    "IPv4 header length 4": lambda: _ipv4_with_header_length(4),
    "TCP header cut short": lambda: client_frame(4, TCP, dst=OTHER[4], dport=443)[: 14 + 20 + 12],
    "UDP header cut short": lambda: client_frame(4, UDP, dst=OTHER[4], dport=443)[: 14 + 20 + 6],
}


@pytest.mark.parametrize("make_frame", MALFORMED_TO_NO_SERVICE.values(),
                         ids=MALFORMED_TO_NO_SERVICE.keys())  # fmt: skip
def test_a_malformed_packet_from_a_pod_is_dropped_though_its_ports_need_no_lookup(
    datapath, make_frame: Callable[[], bytes]
):
    """The programs first look at the ports in place (parse_ports_in_place) and let a
    packet pass when no lookup could match; that look must leave every packet the full
    parse would call malformed to the full path, whatever its ports: such a packet leaving
    a pod is dropped, one entering a pod passes as it is (not ours to police)."""
    datapath.service(4, TCP)
    frame = make_frame()

    ingress, egress = datapath.from_pod(frame), datapath.to_pod(frame)

    assert ingress.retval == TC_ACT_SHOT
    assert datapath.drops(C.KBP_DROP_MALFORMED)["packets"] == 1
    assert (egress.retval, egress.data_out) == (TC_ACT_OK, frame)


# Empty sets: REJECT when no endpoints exist, DROP when they exist elsewhere


@pytest.mark.parametrize("family", [4, 6], ids=["IPv4", "IPv6"])
def test_a_syn_to_a_service_without_endpoints_is_answered_with_rst_ack(datapath, family):
    datapath.write_service(1, family, TCP, set_id=0, count=0, flags=0)
    frame = client_frame(family, TCP, flags="S", seq=123456)

    run = datapath.from_pod(frame)

    assert run.retval == TC_ACT_REDIRECT
    rst = P.parse(run.data_out)
    assert (rst.eth_src, rst.eth_dst) == (P.HOST_MAC, P.POD_MAC)
    assert (rst.src, rst.sport) == (CLUSTER_IP[family], FRONTEND_PORT)
    assert (rst.dst, rst.dport) == (CLIENT[family], CLIENT_PORT)
    assert rst.has_flags("RA")
    assert (rst.seq, rst.ack) == (0, 123457)
    assert rst.payload == b""
    assert len(run.data_out) == 14 + (20 if family == 4 else 40) + 20
    assert_checksums_valid(rst)
    assert datapath.drops(C.KBP_DROP_REJECTED)["packets"] == 1
    assert datapath.counters(1)["drops"] == 1


@pytest.mark.parametrize(
    ("flags", "expected_ack"),
    [("PA", 1010), ("FA", 1011)],
    ids=["data is acknowledged", "data and FIN are acknowledged"],
)
def test_a_segment_to_a_service_without_endpoints_is_reset_at_its_ack(
    datapath, flags, expected_ack
):
    datapath.write_service(1, 4, TCP, set_id=0, count=0, flags=0)
    frame = client_frame(4, TCP, flags=flags, seq=1000, ack=777, payload=b"0123456789")

    rst = P.parse(datapath.from_pod(frame).data_out)

    assert rst.has_flags("RA")
    assert (rst.seq, rst.ack) == (777, expected_ack)
    assert_checksums_valid(rst)


def test_a_reset_to_a_service_without_endpoints_is_dropped_without_an_answer(datapath):
    datapath.write_service(1, 4, TCP, set_id=0, count=0, flags=0)

    run = datapath.from_pod(client_frame(4, TCP, flags="R"))

    assert run.retval == TC_ACT_SHOT


def test_a_udp_datagram_to_a_service_without_endpoints_gets_icmp_port_unreachable(datapath):
    datapath.write_service(1, 4, UDP, set_id=0, count=0, flags=0)
    frame = client_frame(4, UDP, payload=b"q" * 100)

    run = datapath.from_pod(frame)

    assert run.retval == TC_ACT_REDIRECT
    icmp = P.parse(run.data_out)
    assert (icmp.eth_src, icmp.eth_dst) == (P.HOST_MAC, P.POD_MAC)
    assert (icmp.proto, icmp.src, icmp.dst) == (P.PROTO_ICMP, CLUSTER_IP[4], CLIENT[4])
    assert (icmp.icmp_type, icmp.icmp_code) == (3, 3)
    assert_checksums_valid(icmp)
    # Quoted: the client's IP header and the first 8 bytes of its datagram, unchanged.
    assert icmp.quoted == frame[14 : 14 + 20 + 8]
    assert icmp.ip_total_len == 20 + 8 + 28 == len(run.data_out) - 14


def test_a_short_udp_datagram_with_ip_options_gets_its_whole_header_quoted(datapath):
    datapath.write_service(1, 4, UDP, set_id=0, count=0, flags=0)
    datagram = P.udp_datagram(CLIENT[4], CLUSTER_IP[4], CLIENT_PORT, FRONTEND_PORT)
    ip = P.ipv4_packet(CLIENT[4], CLUSTER_IP[4], UDP, datagram, options=bytes([1, 1, 1, 0] * 2))

    icmp = P.parse(datapath.from_pod(P.ethernet(ip, P.ETH_P_IP)).data_out)

    assert (icmp.icmp_type, icmp.icmp_code) == (3, 3)
    assert icmp.quoted == ip
    quoted = P.parse_quoted_ip(icmp.quoted)
    assert (quoted.src, quoted.dst, quoted.sport, quoted.dport) == (
        CLIENT[4],
        CLUSTER_IP[4],
        CLIENT_PORT,
        FRONTEND_PORT,
    )
    assert_checksums_valid(icmp)


def test_a_udp_datagram_to_an_ipv6_service_without_endpoints_gets_icmpv6_port_unreachable(datapath):
    datapath.write_service(1, 6, UDP, set_id=0, count=0, flags=0)
    frame = client_frame(6, UDP, payload=b"q" * 3)

    run = datapath.from_pod(frame)

    assert run.retval == TC_ACT_REDIRECT
    icmp = P.parse(run.data_out)
    assert (icmp.proto, icmp.src, icmp.dst) == (P.PROTO_ICMPV6, CLUSTER_IP[6], CLIENT[6])
    assert (icmp.icmp_type, icmp.icmp_code) == (1, 4)
    assert icmp.l4_checksum_ok
    assert icmp.quoted == frame[14 : 14 + 40 + 8]


@pytest.mark.parametrize(("family", "proto"), FAMILIES_AND_PROTOCOLS)
def test_a_packet_to_a_service_whose_endpoints_are_elsewhere_is_dropped(datapath, family, proto):
    datapath.write_service(1, family, proto, set_id=0, count=0, flags=C.KBP_SVC_F_HAS_ENDPOINTS)
    frame = client_frame(family, proto)

    run = datapath.from_pod(frame)

    assert run.retval == TC_ACT_SHOT
    assert datapath.drops(C.KBP_DROP_NO_BACKEND) == {"packets": 1, "bytes": len(frame)}
    assert datapath.counters(1)["drops"] == 1


# Selection: affinity, Maglev, random

AFFINITY = C.KBP_SVC_F_HAS_ENDPOINTS | C.KBP_SVC_F_AFFINITY


def test_client_ip_affinity_keeps_every_new_connection_on_one_backend(datapath):
    ids = datapath.service(4, TCP, 4, flags=AFFINITY, affinity_timeout=60)
    chosen = {
        P.parse(datapath.from_pod(client_frame(4, TCP, sport=CLIENT_PORT + n)).data_out).dst
        for n in range(24)
    }

    assert len(chosen) == 1
    remembered = datapath.affinity_backend(CLIENT[4], 1)
    assert remembered in ids
    assert chosen == {BACKENDS[4][ids.index(remembered)]}


def test_an_expired_affinity_is_ignored(datapath):
    ids = datapath.service(4, TCP, 1, flags=AFFINITY, affinity_timeout=5)
    # A backend of the same service that is no longer in the set, last used at boot.
    stale = datapath.add_backend(1, BACKENDS[4][3])
    datapath.write_affinity(CLIENT[4], 1, stale, last_used=0)

    out = P.parse(datapath.from_pod(client_frame(4, TCP)).data_out)

    assert out.dst == BACKENDS[4][0]
    assert datapath.affinity_backend(CLIENT[4], 1) == ids[0]


def _removed_backend(datapath: Datapath) -> int:
    gone = datapath.add_backend(1, BACKENDS[4][3])
    datapath.delete_backend(gone)
    return gone


@pytest.mark.parametrize(
    "stale",
    [_removed_backend, lambda datapath: datapath.add_backend(2, BACKENDS[4][3])],
    ids=["to a removed backend", "to another services backend"],
)
def test_an_affinity_to_a_backend_it_may_no_longer_use_is_ignored(datapath, stale):
    datapath.service(4, TCP, 1, flags=AFFINITY, affinity_timeout=10800)
    datapath.write_affinity(CLIENT[4], 1, stale(datapath), last_used=time.monotonic_ns())

    out = P.parse(datapath.from_pod(client_frame(4, TCP)).data_out)

    assert out.dst == BACKENDS[4][0]


def test_maglev_picks_the_table_slot_of_the_flow_hash(datapath):
    table_size = 7
    ids = [datapath.add_backend(1, ip) for ip in BACKENDS[4]]
    table = [ids[i % len(ids)] for i in (0, 1, 2, 3, 1, 2, 3)]  # slot -> backend id
    datapath.write_set(1, table)
    datapath.write_service(1, 4, TCP, 1, table_size, C.KBP_SVC_F_HAS_ENDPOINTS | C.KBP_SVC_F_MAGLEV)

    seen = set()
    for n in range(32):
        sport = CLIENT_PORT + n
        out = P.parse(datapath.from_pod(client_frame(4, TCP, sport=sport)).data_out)
        slot = flow_hash(CLIENT[4], CLUSTER_IP[4], sport, FRONTEND_PORT, TCP) % table_size
        assert out.dst == BACKENDS[4][ids.index(table[slot])], f"source port {sport}"
        seen.add(out.dst)
    assert len(seen) > 1


def test_maglev_sends_the_same_flow_to_the_same_backend_without_conntrack(datapath):
    datapath.service(6, UDP, backends=4, flags=C.KBP_SVC_F_HAS_ENDPOINTS | C.KBP_SVC_F_MAGLEV)
    frame = client_frame(6, UDP)

    chosen = set()
    for _ in range(10):
        chosen.add(P.parse(datapath.from_pod(frame).data_out).dst)
        datapath.clear_conntrack()

    assert len(chosen) == 1


def test_random_selection_spreads_one_tuple_over_all_backends_only_when_asked(datapath):
    # lb-algorithm random: the same tuple, its entries gone each time, lands anywhere.
    datapath.service(4, UDP, backends=4, flags=C.KBP_SVC_F_HAS_ENDPOINTS | C.KBP_SVC_F_RANDOM)
    frame = client_frame(4, UDP)

    chosen = set()
    for _ in range(200):
        chosen.add(P.parse(datapath.from_pod(frame).data_out).dst)
        datapath.clear_conntrack()

    assert chosen == set(BACKENDS[4])


def test_by_default_a_new_flow_takes_the_slot_of_its_flow_hash(datapath):
    ids = datapath.service(4, TCP, backends=4)

    seen = set()
    for n in range(64):
        sport = CLIENT_PORT + n
        out = P.parse(datapath.from_pod(client_frame(4, TCP, sport=sport)).data_out)
        slot = flow_hash(CLIENT[4], CLUSTER_IP[4], sport, FRONTEND_PORT, TCP) % len(ids)
        assert out.dst == BACKENDS[4][slot], f"source port {sport}"
        seen.add(out.dst)
    assert seen == set(BACKENDS[4])


@pytest.mark.parametrize("family", [4, 6], ids=["IPv4", "IPv6"])
def test_a_segment_whose_entries_were_lost_reaches_the_same_backend(datapath, family):
    # Recovery: an established flow's entries deleted by hand (as an eviction would);
    # its next segment is sent to the backend it had, and both entries are back.
    datapath.service(family, TCP, backends=4)
    for n in range(16):
        sport = CLIENT_PORT + n
        first = _backend_of(datapath, client_frame(family, TCP, sport=sport))
        datapath.clear_conntrack()

        ack = client_frame(family, TCP, sport=sport, flags="A", payload=b"still here")
        assert _backend_of(datapath, ack) == first, f"source port {sport}"
        reply = backend_reply(family, TCP, first, dport=sport, flags="A")
        out = P.parse(datapath.to_pod(reply).data_out)
        assert (out.src, out.sport) == (CLUSTER_IP[family], FRONTEND_PORT)


@pytest.mark.parametrize(("family", "proto"), FAMILIES_AND_PROTOCOLS)
def test_one_client_port_to_two_services_sharing_a_backend_gets_a_remapped_port(
    datapath, family, proto
):
    # Both flows would reach the backend as client:40000 -> backend:8080. The second
    # keeps the first's reply entry alone and is sent from a port of the SNAT range;
    # each backend reply gets its own frontend and the client's own port back.
    datapath.write_config()
    datapath.service(family, proto)
    backend = BACKENDS[family][0]
    datapath.write_set(2, [datapath.add_backend(2, backend)])  # ids are per (service, endpoint)
    datapath.write_service(2, family, proto, 2, 1, frontend=CLUSTER_IP_2[family])

    first = P.parse(datapath.from_pod(client_frame(family, proto)).data_out)
    second_frame = client_frame(family, proto, dst=CLUSTER_IP_2[family])
    second = P.parse(datapath.from_pod(second_frame).data_out)

    assert (first.dst, first.sport) == (backend, CLIENT_PORT)
    assert second.dst == backend
    assert 61000 <= second.sport <= 65535
    assert_checksums_valid(second)
    assert datapath.ct_stat(C.KBP_CT_STAT_REMAPPED) == 1
    # later packets of the second flow keep the remapped port
    again = P.parse(datapath.from_pod(client_frame(family, proto, dst=CLUSTER_IP_2[family],
                                                   flags="A")).data_out)  # fmt: skip
    assert again.sport == second.sport
    for dport, frontend in ((CLIENT_PORT, CLUSTER_IP), (second.sport, CLUSTER_IP_2)):
        answer = backend_reply(family, proto, backend, dport=dport)
        reply = P.parse(datapath.to_pod(answer).data_out)
        assert (reply.src, reply.sport) == (frontend[family], FRONTEND_PORT)
        assert (reply.dst, reply.dport) == (CLIENT[family], CLIENT_PORT)
        assert_checksums_valid(reply)


def test_a_flow_reusing_its_own_tuple_to_the_same_service_is_not_remapped(datapath):
    datapath.write_config()
    datapath.service(4, TCP)

    for _ in range(3):
        out = P.parse(datapath.from_pod(client_frame(4, TCP)).data_out)
        assert out.sport == CLIENT_PORT

    assert datapath.ct_stat(C.KBP_CT_STAT_REMAPPED) == 0


# Conntrack


def _backend_of(datapath: Datapath, frame: bytes) -> str:
    return P.parse(datapath.from_pod(frame).data_out).dst


def _ct_entry(datapath: Datapath, src, dst, sport, dport, proto, direction):
    key = abi.new(
        "kbp_ct_key",
        sport=abi.be16(sport),
        dport=abi.be16(dport),
        proto=proto,
        family=abi.family_of(src),
        dir=direction,
    )
    abi.set_addr(key.saddr, src)
    abi.set_addr(key.daddr, dst)
    raw = datapath.loaded.map("kbp_ct").lookup(abi.to_bytes(key))
    return None if raw is None else abi.from_bytes("kbp_ct_entry", raw)


@pytest.mark.parametrize("family", [4, 6], ids=["IPv4", "IPv6"])
def test_a_new_flow_records_a_forward_and_a_reply_conntrack_entry(datapath, family):
    (backend_id,) = datapath.service(family, TCP)
    before = time.monotonic_ns()
    datapath.from_pod(client_frame(family, TCP, flags="S"))

    forward = _ct_entry(
        datapath,
        CLIENT[family],
        CLUSTER_IP[family],
        CLIENT_PORT,
        FRONTEND_PORT,
        TCP,
        C.KBP_CT_FORWARD,
    )
    reply = _ct_entry(
        datapath,
        BACKENDS[family][0],
        CLIENT[family],
        BACKEND_PORT,
        CLIENT_PORT,
        TCP,
        C.KBP_CT_REPLY,
    )

    assert abi.get_addr(forward.addr, family) == BACKENDS[family][0]
    assert abi.from_be16(forward.port) == BACKEND_PORT
    assert abi.get_addr(reply.addr, family) == CLUSTER_IP[family]
    assert abi.from_be16(reply.port) == FRONTEND_PORT
    for entry in (forward, reply):
        assert (entry.backend_id, entry.service_id, entry.flags) == (backend_id, 1, 0)
        # The coarse clock may trail the fine one by a tick (4 ms at HZ=250).
        assert before - 10_000_000 <= entry.last_seen <= time.monotonic_ns()


def test_a_fin_marks_the_flow_closing(datapath):
    datapath.service(4, TCP)
    datapath.from_pod(client_frame(4, TCP, flags="S"))
    datapath.from_pod(client_frame(4, TCP, flags="FA"))

    forward = _ct_entry(
        datapath, CLIENT[4], CLUSTER_IP[4], CLIENT_PORT, FRONTEND_PORT, TCP, C.KBP_CT_FORWARD
    )

    assert forward.flags & C.KBP_CT_F_CLOSING


def test_an_established_flow_keeps_its_backend_when_the_set_changes(datapath):
    first, second = datapath.service(4, TCP, backends=2)
    datapath.write_set(1, [first])
    datapath.write_service(1, 4, TCP, 1, 1)
    assert _backend_of(datapath, client_frame(4, TCP, flags="S")) == BACKENDS[4][0]

    # The set now holds only the second backend (a new set id, then the service flips).
    datapath.write_set(2, [second])
    datapath.write_service(1, 4, TCP, 2, 1)

    assert _backend_of(datapath, client_frame(4, TCP, flags="A")) == BACKENDS[4][0]
    assert _backend_of(datapath, client_frame(4, TCP, flags="S")) == BACKENDS[4][0]  # retransmit
    assert (
        _backend_of(datapath, client_frame(4, TCP, flags="S", sport=CLIENT_PORT + 1))
        == BACKENDS[4][1]
    )


def test_a_retransmitted_syn_keeps_its_backend(datapath):
    datapath.service(4, TCP, backends=4)
    frame = client_frame(4, TCP, flags="S")

    chosen = {_backend_of(datapath, frame) for _ in range(16)}

    assert len(chosen) == 1
    assert datapath.counters(1)["new_flows"] == 1


@pytest.mark.parametrize(
    ("proto", "flags"), [(TCP, "S"), (UDP, "")], ids=["a TCP SYN", "a UDP datagram"]
)
def test_when_the_backend_is_gone_a_new_flow_on_the_same_tuple_reselects(datapath, proto, flags):
    gone, stays = datapath.service(4, proto, backends=2)
    datapath.write_set(1, [gone])
    datapath.write_service(1, 4, proto, 1, 1)
    frame = client_frame(4, proto, flags=flags)
    assert _backend_of(datapath, frame) == BACKENDS[4][0]

    datapath.delete_backend(gone)
    datapath.write_set(2, [stays])
    datapath.write_service(1, 4, proto, 2, 1)
    out = P.parse(datapath.from_pod(frame).data_out)
    reply = P.parse(datapath.to_pod(backend_reply(4, proto, BACKENDS[4][1], flags="SA")).data_out)

    assert out.dst == BACKENDS[4][1]
    assert (reply.src, reply.sport) == (CLUSTER_IP[4], FRONTEND_PORT)
    assert datapath.counters(1)["new_flows"] == 2


def test_when_the_backend_is_gone_an_open_tcp_connection_drains_to_it(datapath):
    gone, stays = datapath.service(4, TCP, backends=2)
    datapath.write_set(1, [gone])
    datapath.write_service(1, 4, TCP, 1, 1)
    datapath.from_pod(client_frame(4, TCP, flags="S"))

    datapath.delete_backend(gone)
    datapath.write_set(2, [stays])
    datapath.write_service(1, 4, TCP, 2, 1)

    assert (
        _backend_of(datapath, client_frame(4, TCP, flags="PA", payload=b"more")) == BACKENDS[4][0]
    )


def test_a_reused_backend_id_with_another_address_does_not_keep_the_flow(datapath):
    (backend_id,) = datapath.service(4, UDP, backends=1)
    frame = client_frame(4, UDP)
    assert _backend_of(datapath, frame) == BACKENDS[4][0]

    # Same id, same service, new endpoint address: ids are reused after deletion, and the
    # set naming it is written anew (its slot carries the new address, as the agent's is).
    value = abi.new("kbp_backend", port=abi.be16(BACKEND_PORT), family=4, service_id=1)
    abi.set_addr(value.addr, BACKENDS[4][2])
    datapath.loaded.map("kbp_backends").update(struct.pack("=I", backend_id), abi.to_bytes(value))
    datapath.write_set(1, [backend_id])

    assert _backend_of(datapath, frame) == BACKENDS[4][2]


# Hairpin


@pytest.mark.parametrize("family", [4, 6], ids=["IPv4", "IPv6"])
def test_a_pod_reaching_its_own_service_is_hairpinned_back_to_itself(datapath, family):
    own = BACKENDS[family][0]
    datapath.service(family, TCP)
    frame = client_frame(family, TCP, client=own, payload=b"me")

    run = datapath.from_pod(frame)

    assert run.retval == TC_ACT_REDIRECT
    out = P.parse(run.data_out)
    assert (out.src, out.sport) == (CLUSTER_IP[family], CLIENT_PORT)
    assert (out.dst, out.dport) == (own, BACKEND_PORT)
    assert (out.eth_src, out.eth_dst) == (P.HOST_MAC, P.POD_MAC)
    assert_checksums_valid(out)

    # The pod answers the frontend address it saw as the source.
    reply = backend_reply(family, TCP, own, dst=CLUSTER_IP[family], payload=b"you")
    run = datapath.from_pod(reply)

    assert run.retval == TC_ACT_REDIRECT
    back = P.parse(run.data_out)
    assert (back.src, back.sport) == (CLUSTER_IP[family], FRONTEND_PORT)
    assert (back.dst, back.dport) == (own, CLIENT_PORT)
    assert back.payload == b"you"
    assert_checksums_valid(back)


def test_a_hairpinned_flow_stays_hairpinned_on_later_packets(datapath):
    own = BACKENDS[4][0]
    datapath.service(4, TCP)
    datapath.from_pod(client_frame(4, TCP, client=own))

    run = datapath.from_pod(client_frame(4, TCP, client=own, flags="A"))

    out = P.parse(run.data_out)
    assert run.retval == TC_ACT_REDIRECT
    assert (out.src, out.dst, out.dport) == (CLUSTER_IP[4], own, BACKEND_PORT)
    assert_checksums_valid(out)


# Counters


def test_counters_count_packets_bytes_and_new_flows_in_both_directions(datapath):
    datapath.service(4, TCP)
    syn = client_frame(4, TCP, flags="S")
    ack = client_frame(4, TCP, flags="A", payload=b"data")
    synack = backend_reply(4, TCP, BACKENDS[4][0], flags="SA")

    datapath.from_pod(syn)
    datapath.to_pod(synack)
    datapath.from_pod(ack)
    datapath.from_pod(client_frame(4, TCP, dst=OTHER[4]))  # not the service's

    assert datapath.counters(1) == {
        "packets": 3,
        "bytes": len(syn) + len(synack) + len(ack),
        "new_flows": 1,
        "drops": 0,
    }
    assert datapath.drops(C.KBP_DROP_NO_BACKEND)["packets"] == 0
