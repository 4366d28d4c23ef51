"""Connected UDP sockets of one network namespace, listed and destroyed through the
kernel's sock_diag netlink family (what `ss -K` uses): the agent's way to move a
connected UDP socket off a backend that left its Service (docs/ebpf.md, "A backend
leaves"). Runs in the calling thread's namespace; pair it with netlink.run_in_netns.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
SOCK_DESTROY = 21
_NLM_F_REQUEST, _NLM_F_ACK, _NLM_F_DUMP = 0x1, 0x4, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_TCP_ESTABLISHED = 1  # a connected UDP socket's sk_state
_HEADER = struct.Struct("=IHHII")
# struct inet_diag_req_v2 up to its id: family, protocol, ext, pad, states.
_REQUEST = struct.Struct("=BBBxI")
# struct inet_diag_sockid: sport, dport (network order), src, dst, if, cookie[2].
_PORTS = struct.Struct("!HH")
_TAIL = struct.Struct("=III")
_MSG_HEAD = struct.Struct("=BBBB")  # struct inet_diag_msg: family, state, timer, retrans


@dataclass(frozen=True, slots=True)
class UdpSocket:
    """A connected UDP socket as sock_diag reports it."""

    family: int  # AF_INET / AF_INET6: the socket's own
    sockid: bytes  # the raw inet_diag_sockid, to name it in SOCK_DESTROY
    cookie: int  # the socket cookie (bpf_get_socket_cookie() of the same socket)
    peer: str  # the address it is connected to (v4-mapped IPv6 written as IPv4)
    peer_port: int


class DestroyUnsupported(OSError):
    """The kernel has no SOCK_DESTROY (built without CONFIG_INET_DIAG_DESTROY)."""


def _request(sock: socket.socket, kind: int, flags: int, body: bytes) -> None:
    sock.send(_HEADER.pack(_HEADER.size + len(body), kind, flags, 1, 0) + body)


def _messages(sock: socket.socket) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of the answers to one request, until DONE or an error/ack."""
    while True:
        data = sock.recv(1 << 16)
        offset = 0
        while offset + _HEADER.size <= len(data):
            length, kind, _flags, _seq, _pid = _HEADER.unpack_from(data, offset)
            if length < _HEADER.size:
                return
            payload = data[offset + _HEADER.size : offset + length]
            offset += (length + 3) & ~3
            if kind == _NLMSG_DONE:
                return
            yield kind, payload
            if kind == _NLMSG_ERROR:
                return


def _peer_of(family: int, dst: bytes) -> str:
    if family == socket.AF_INET:
        return str(ipaddress.IPv4Address(dst[:4]))
    address = ipaddress.IPv6Address(dst)
    mapped = address.ipv4_mapped
    return str(mapped if mapped is not None else address)


def _dump(protocol: int, states: int) -> Iterator[tuple[int, int, bytes]]:
    """(family, state, raw inet_diag_sockid) of this thread's namespace's sockets of
    `protocol` (IPv4 and IPv6) in the states of the bit mask `states`."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       NETLINK_SOCK_DIAG) as sock:  # fmt: skip
        sock.settimeout(5)
        for family in (socket.AF_INET, socket.AF_INET6):
            body = _REQUEST.pack(family, protocol, 0, states)
            _request(sock, SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST | _NLM_F_DUMP, body + bytes(48))
            for kind, payload in _messages(sock):
                if kind == SOCK_DIAG_BY_FAMILY and len(payload) >= 4 + 48:
                    yield payload[0], payload[1], payload[4 : 4 + 48]


def connected_udp() -> list[UdpSocket]:
    """Every connected UDP socket (IPv4 and IPv6) of this thread's namespace."""
    found: list[UdpSocket] = []
    for msg_family, _state, sockid in _dump(socket.IPPROTO_UDP, 1 << _TCP_ESTABLISHED):
        _sport, dport = _PORTS.unpack_from(sockid, 0)
        _ifindex, low, high = _TAIL.unpack_from(sockid, 36)
        if dport == 0:
            continue
        peer = _peer_of(msg_family, sockid[20:36])
        found.append(UdpSocket(msg_family, sockid, low | high << 32, peer, dport))
    return found


# TCP states (include/net/tcp_states.h) by number, for tuple_holders' answer.
TCP_STATES = {1: "ESTABLISHED", 2: "SYN_SENT", 3: "SYN_RECV", 4: "FIN_WAIT1", 5: "FIN_WAIT2",
              6: "TIME_WAIT", 7: "CLOSE", 8: "CLOSE_WAIT", 9: "LAST_ACK", 10: "LISTEN",
              11: "CLOSING"}  # fmt: skip
_NOT_HOLDING = {7, 10}  # a closed socket or a listener holds no connection's tuple


def tuple_holders(
    protocol: int, local: str, local_port: int, peer: str, peer_port: int
) -> list[str]:
    """The states of this thread's namespace's sockets whose own tuple is local:local_port
    to peer:peer_port (TCP: any state that holds a connection, TIME_WAIT included; UDP:
    connected ones, reported as ESTABLISHED): what makes the kernel refuse (TCP) or
    misdeliver (UDP) a second socket with that tuple. IPv4 addresses also match
    v4-mapped IPv6 sockets."""
    want_local, want_peer = ipaddress.ip_address(local), ipaddress.ip_address(peer)
    states = (1 << _TCP_ESTABLISHED) if protocol == socket.IPPROTO_UDP else 0xFFFFFFFF
    found = []
    for msg_family, state, sockid in _dump(protocol, states):
        sport, dport = _PORTS.unpack_from(sockid, 0)
        if (sport, dport) != (local_port, peer_port) or state in _NOT_HOLDING:
            continue
        src = ipaddress.ip_address(_peer_of(msg_family, sockid[4:20]))
        dst = ipaddress.ip_address(_peer_of(msg_family, sockid[20:36]))
        if (src, dst) == (want_local, want_peer):
            found.append(TCP_STATES.get(state, str(state)))
    return found


def destroy(target: UdpSocket) -> bool:
    """SOCK_DESTROY one socket: it is no longer connected, its owner's next call fails.
    False when it was gone already; DestroyUnsupported when the kernel cannot."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       NETLINK_SOCK_DIAG) as sock:  # fmt: skip
        sock.settimeout(5)
        body = _REQUEST.pack(target.family, socket.IPPROTO_UDP, 0, 0xFFFFFFFF) + target.sockid
        _request(sock, SOCK_DESTROY, _NLM_F_REQUEST | _NLM_F_ACK, body)
        for kind, payload in _messages(sock):
            if kind != _NLMSG_ERROR:
                continue
            (code,) = struct.unpack_from("=i", payload)
            if code == 0:
                return True
            if -code in (errno.ENOENT, errno.ESTALE):
                return False
            if -code in (errno.EOPNOTSUPP, errno.EINVAL):
                raise DestroyUnsupported(-code, f"SOCK_DESTROY: {os.strerror(-code)}")
            raise OSError(-code, f"SOCK_DESTROY: {os.strerror(-code)}")
    return False


def destroy_matching(wanted: Callable[[UdpSocket], bool]) -> int:
    """Destroy this namespace's connected UDP sockets that `wanted` picks; how many."""
    return sum(destroy(target) for target in connected_udp() if wanted(target))
