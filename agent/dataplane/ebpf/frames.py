"""Build and parse Ethernet frames (IPv4/IPv6, TCP/UDP/ICMP/ICMPv6): the packets `explain`
runs the programs on, and the packet tests' fixtures.

Pure Python with real checksums, so a test can hand a frame to BPF_PROG_TEST_RUN and
check every field and checksum of what comes back.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass, field

ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
ETH_P_ARP = 0x0806
PROTO_ICMP = 1
PROTO_TCP = 6
PROTO_UDP = 17
PROTO_ICMPV6 = 58

TCP_FIN, TCP_SYN, TCP_RST, TCP_PSH, TCP_ACK = 0x01, 0x02, 0x04, 0x08, 0x10
_TCP_FLAG_LETTERS = {"F": TCP_FIN, "S": TCP_SYN, "R": TCP_RST, "P": TCP_PSH, "A": TCP_ACK}

POD_MAC = bytes.fromhex("0a0000000001")  # the pod's eth0
HOST_MAC = bytes.fromhex("0a0000000002")  # the host-side veth


def tcp_flags(letters: str) -> int:
    """Flag letters to bits: "SA" is SYN|ACK."""
    value = 0
    for letter in letters:
        value |= _TCP_FLAG_LETTERS[letter]
    return value


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of `data`, as the value to put in the field."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _packed(ip: str) -> bytes:
    return ipaddress.ip_address(ip).packed


def _pseudo_header(src: str, dst: str, proto: int, length: int) -> bytes:
    s, d = _packed(src), _packed(dst)
    if len(s) == 4:
        return s + d + struct.pack("!BBH", 0, proto, length)
    return s + d + struct.pack("!IxxxB", length, proto)


def _with_checksum(segment: bytes, offset: int, value: int) -> bytes:
    return segment[:offset] + struct.pack("!H", value) + segment[offset + 2 :]


def tcp_segment(
    src: str,
    dst: str,
    sport: int,
    dport: int,
    *,
    flags: str = "S",
    seq: int = 1000,
    ack: int = 0,
    window: int = 65535,
    options: bytes = b"",
    payload: bytes = b"",
) -> bytes:
    """A TCP header (+ options, payload) with its checksum over the pseudo-header."""
    if len(options) % 4:
        raise ValueError("TCP options must be a multiple of 4 bytes")
    doff = (20 + len(options)) // 4
    header = struct.pack(
        "!HHIIBBHHH", sport, dport, seq, ack, doff << 4, tcp_flags(flags), window, 0, 0
    )
    segment = header + options + payload
    csum = checksum(_pseudo_header(src, dst, PROTO_TCP, len(segment)) + segment)
    return _with_checksum(segment, 16, csum)


def udp_datagram(
    src: str, dst: str, sport: int, dport: int, payload: bytes = b"", *, zero_checksum: bool = False
) -> bytes:
    """A UDP header + payload; `zero_checksum` sends "no checksum" (IPv4 only, RFC 768)."""
    datagram = struct.pack("!HHHH", sport, dport, 8 + len(payload), 0) + payload
    if zero_checksum:
        return datagram
    csum = checksum(_pseudo_header(src, dst, PROTO_UDP, len(datagram)) + datagram)
    # A computed 0 is sent as 0xffff: 0 means "no checksum".
    return _with_checksum(datagram, 6, csum or 0xFFFF)


def ipv4_packet(
    src: str,
    dst: str,
    proto: int,
    payload: bytes,
    *,
    ttl: int = 64,
    ident: int = 1,
    options: bytes = b"",
    more_fragments: bool = False,
    fragment_offset: int = 0,
) -> bytes:
    """An IPv4 header (+ options) with its checksum, then `payload`. Offset in 8-byte units."""
    if len(options) % 4:
        raise ValueError("IPv4 options must be a multiple of 4 bytes")
    ihl = (20 + len(options)) // 4
    frag = (0x2000 if more_fragments else 0) | fragment_offset
    header = struct.pack(
        "!BBHHHBBH4s4s",
        0x40 | ihl,
        0,
        ihl * 4 + len(payload),
        ident,
        frag,
        ttl,
        proto,
        0,
        _packed(src),
        _packed(dst),
    )
    header += options
    return _with_checksum(header, 10, checksum(header)) + payload


def ipv6_packet(
    src: str, dst: str, next_header: int, payload: bytes, *, hop_limit: int = 64
) -> bytes:
    header = struct.pack(
        "!IHBB16s16s", 6 << 28, len(payload), next_header, hop_limit, _packed(src), _packed(dst)
    )
    return header + payload


def ethernet(
    payload: bytes, ethertype: int, *, src: bytes = POD_MAC, dst: bytes = HOST_MAC
) -> bytes:
    return dst + src + struct.pack("!H", ethertype) + payload


def ip_packet(src: str, dst: str, proto: int, l4: bytes) -> bytes:
    """IPv4 or IPv6 by the address family, in an Ethernet frame from the pod."""
    if ":" in src:
        return ethernet(ipv6_packet(src, dst, proto, l4), ETH_P_IPV6)
    return ethernet(ipv4_packet(src, dst, proto, l4), ETH_P_IP)


def tcp_frame(src: str, dst: str, sport: int, dport: int, **tcp: object) -> bytes:
    """A whole frame from the pod: Ethernet, IPv4/IPv6, TCP (see tcp_segment)."""
    return ip_packet(src, dst, PROTO_TCP, tcp_segment(src, dst, sport, dport, **tcp))  # type: ignore[arg-type]


def udp_frame(
    src: str, dst: str, sport: int, dport: int, payload: bytes = b"", **udp: object
) -> bytes:
    return ip_packet(
        src,
        dst,
        PROTO_UDP,
        udp_datagram(src, dst, sport, dport, payload, **udp),  # type: ignore[arg-type]
    )


@dataclass
class Packet:
    """A parsed frame: the fields tests look at, and whether each checksum verifies."""

    eth_dst: bytes
    eth_src: bytes
    ethertype: int
    version: int = 0
    src: str = ""
    dst: str = ""
    proto: int = 0
    ttl: int = 0
    ip_header_len: int = 0
    ip_total_len: int = 0  # IPv4 total length / IPv6 40 + payload length
    ip_checksum_ok: bool = True  # IPv6 has none
    fragment_offset: int = 0
    more_fragments: bool = False
    dont_fragment: bool = False
    sport: int = 0
    dport: int = 0
    seq: int = 0
    ack: int = 0
    flags: int = 0
    l4_checksum: int = 0
    l4_checksum_ok: bool = False
    icmp_type: int = -1
    icmp_code: int = -1
    quoted: bytes = b""  # ICMP errors: the invoking packet as quoted
    payload: bytes = b""
    raw: bytes = field(default=b"", repr=False)

    def has_flags(self, letters: str) -> bool:
        return self.flags == tcp_flags(letters)


def parse(frame: bytes) -> Packet:
    """Parse a frame built here or returned by a program; raises ValueError when short."""
    if len(frame) < 14:
        raise ValueError(f"frame of {len(frame)} bytes")
    pkt = Packet(frame[:6], frame[6:12], struct.unpack("!H", frame[12:14])[0], raw=frame)
    l3 = frame[14:]
    if pkt.ethertype == ETH_P_IP:
        l4 = _parse_ipv4(pkt, l3)
    elif pkt.ethertype == ETH_P_IPV6:
        l4 = _parse_ipv6(pkt, l3)
    else:
        return pkt
    if pkt.fragment_offset:
        pkt.payload = l4
        return pkt
    pseudo = _pseudo_header(pkt.src, pkt.dst, pkt.proto, len(l4))
    if pkt.proto == PROTO_TCP:
        _parse_tcp(pkt, l4, pseudo)
    elif pkt.proto == PROTO_UDP:
        _parse_udp(pkt, l4, pseudo)
    elif pkt.proto in (PROTO_ICMP, PROTO_ICMPV6):
        _parse_icmp(pkt, l4, pseudo if pkt.proto == PROTO_ICMPV6 else b"")
    else:
        pkt.payload = l4
    return pkt


def _parse_ipv4(pkt: Packet, l3: bytes) -> bytes:
    ver_ihl, _tos, total, _ident, frag, ttl, proto, _csum = struct.unpack("!BBHHHBBH", l3[:12])
    pkt.version, pkt.ip_header_len = ver_ihl >> 4, (ver_ihl & 0xF) * 4
    pkt.ip_total_len, pkt.ttl, pkt.proto = total, ttl, proto
    pkt.src = str(ipaddress.IPv4Address(l3[12:16]))
    pkt.dst = str(ipaddress.IPv4Address(l3[16:20]))
    pkt.ip_checksum_ok = checksum(l3[: pkt.ip_header_len]) == 0
    pkt.fragment_offset, pkt.more_fragments = frag & 0x1FFF, bool(frag & 0x2000)
    pkt.dont_fragment = bool(frag & 0x4000)
    return l3[pkt.ip_header_len : total]


def _parse_ipv6(pkt: Packet, l3: bytes) -> bytes:
    first, plen, nxt, hops = struct.unpack("!IHBB", l3[:8])
    pkt.version, pkt.proto, pkt.ttl, pkt.ip_header_len = first >> 28, nxt, hops, 40
    pkt.ip_total_len = 40 + plen
    pkt.src = str(ipaddress.IPv6Address(l3[8:24]))
    pkt.dst = str(ipaddress.IPv6Address(l3[24:40]))
    return l3[40 : 40 + plen]


def _parse_tcp(pkt: Packet, l4: bytes, pseudo: bytes) -> None:
    sport, dport, seq, ack, doff, flags, _win, csum = struct.unpack("!HHIIBBHH", l4[:18])
    pkt.sport, pkt.dport, pkt.seq, pkt.ack, pkt.flags = sport, dport, seq, ack, flags
    pkt.l4_checksum = csum
    pkt.l4_checksum_ok = checksum(pseudo + l4) == 0
    pkt.payload = l4[(doff >> 4) * 4 :]


def _parse_udp(pkt: Packet, l4: bytes, pseudo: bytes) -> None:
    pkt.sport, pkt.dport, _length, csum = struct.unpack("!HHHH", l4[:8])
    pkt.l4_checksum = csum
    # Zero: "no checksum" (IPv4); nothing to verify.
    pkt.l4_checksum_ok = csum == 0 or checksum(pseudo + l4) == 0
    pkt.payload = l4[8:]


def _parse_icmp(pkt: Packet, l4: bytes, pseudo: bytes) -> None:
    pkt.icmp_type, pkt.icmp_code, csum = struct.unpack("!BBH", l4[:4])
    pkt.l4_checksum = csum
    pkt.l4_checksum_ok = checksum(pseudo + l4) == 0
    pkt.quoted = l4[8:]


def parse_quoted_ip(quoted: bytes) -> Packet:
    """The invoking packet an ICMP error quotes (IP header + first L4 bytes), parsed
    without checksum verification of the truncated L4 part."""
    ethertype = ETH_P_IPV6 if quoted[0] >> 4 == 6 else ETH_P_IP
    pkt = Packet(b"", b"", ethertype, raw=quoted)
    l4 = _parse_ipv4(pkt, quoted) if ethertype == ETH_P_IP else _parse_ipv6(pkt, quoted)
    # The quoted L4 bytes are cut short of the lengths the header declares.
    l4 = quoted[pkt.ip_header_len :]
    if len(l4) >= 4:
        pkt.sport, pkt.dport = struct.unpack("!HH", l4[:4])
    pkt.payload = l4
    return pkt
