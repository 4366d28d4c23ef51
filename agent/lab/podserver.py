"""A lab pod's server, run inside the pod's network namespace: answers on its TCP ports
and datagrams on its UDP ports with the pod's name, so a client can tell which backend
served it.

TCP: by default the name is sent at once, then every byte is echoed until the peer
closes, so a streaming client notices any disturbance (a reset, a lost or misrouted
segment). With --http it answers one HTTP request instead (the `lab` command's clients),
the name as the body and the source address it saw in the header `X-Peer`.

With --report-peer every answer is "NAME PEER-ADDRESS", so a client also learns whether
its source was translated; a UDP datagram `peer` asks for that answer in any case.

Usage: podserver.py --name NAME [--tcp 80,8080] [--udp 53] [--http] [--report-peer]
Prints `ready` on stdout once every socket is bound (IPv4 and IPv6 on each port).
Standalone on purpose (no package imports): it starts in well under a second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import sys

MAX_REQUEST = 16384  # bytes of request head a client may send before it is cut off
REQUEST_TIMEOUT = 5.0  # seconds a client may take to send its request head
PEER_REQUEST = b"peer"  # a UDP datagram asking for the source address in the answer
PEER_HEADER = "X-Peer"  # the HTTP header with the source address the server saw


class NameReplier(asyncio.DatagramProtocol):
    """UDP: answer each datagram with the pod's name (and the sender's address)."""

    def __init__(self, name: bytes, report_peer: bool) -> None:
        self.name = name
        self.report_peer = report_peer
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        if self.transport is not None:
            peer = self.report_peer or data == PEER_REQUEST
            self.transport.sendto(self.name + (f" {addr[0]}".encode() if peer else b""), addr)

    def error_received(self, exc: Exception) -> None:
        pass  # an ICMP error about an earlier reply: nothing to do


def bound_socket(family: int, kind: int, port: int) -> socket.socket:
    sock = socket.socket(family, kind)
    if kind == socket.SOCK_STREAM:
        # Restart quickly past TIME_WAIT. Not for UDP, where a second server could then
        # share the port and steal datagrams.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        # One socket per family: the IPv6 one must not also take IPv4 as mapped addresses.
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    sock.setblocking(False)
    return sock


def http_answer(name: str, peer: str) -> bytes:
    body = (name + "\n").encode()
    head = (
        "HTTP/1.1 200 OK\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"{PEER_HEADER}: {peer}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


async def serve(
    name: str, tcp_ports: list[int], udp_ports: list[int], http: bool, report_peer: bool
) -> None:
    async def on_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                await reader.readuntil(b"\r\n\r\n")
            peer = writer.get_extra_info("peername")
            writer.write(http_answer(name, str(peer[0]) if peer else "?"))
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client reset, vanished or sent no HTTP: nothing to answer
        finally:
            writer.close()

    async def on_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        greeting = name
        if report_peer:
            greeting += f" {writer.get_extra_info('peername')[0]}"
        try:
            writer.write((greeting + "\n").encode())
            await writer.drain()
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass  # the client reset or vanished: nothing to answer any more
        finally:
            writer.close()

    loop = asyncio.get_running_loop()
    servers = []
    for family in (socket.AF_INET, socket.AF_INET6):
        for port in tcp_ports:
            sock = bound_socket(family, socket.SOCK_STREAM, port)
            servers.append(await asyncio.start_server(
                on_http if http else on_stream, sock=sock, backlog=512, limit=MAX_REQUEST,
            ))  # fmt: skip
        for port in udp_ports:
            sock = bound_socket(family, socket.SOCK_DGRAM, port)
            await loop.create_datagram_endpoint(
                lambda: NameReplier(name.encode(), report_peer), sock=sock
            )
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(signum, stop.set)
    print("ready", flush=True)
    with contextlib.suppress(OSError):
        # Whoever waited for `ready` may be gone (a kept lab): stdout is of no use now.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    await stop.wait()
    for server in servers:
        server.close()


def ports(text: str) -> list[int]:
    return [int(port) for port in text.split(",") if port]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--tcp", type=ports, default=[], help="comma-separated TCP ports")
    parser.add_argument("--udp", type=ports, default=[], help="comma-separated UDP ports")
    parser.add_argument("--http", action="store_true", help="TCP answers one HTTP request")
    parser.add_argument("--report-peer", action="store_true", help="answer 'NAME PEER-ADDRESS'")
    args = parser.parse_args()
    asyncio.run(serve(args.name, args.tcp, args.udp, args.http, args.report_peer))


if __name__ == "__main__":
    main()
