"""A lab pod's server, run inside the pod's network namespace: answers every TCP
connection and UDP datagram with the pod's name, so a client can tell which backend
served it; TCP then echoes until the peer closes, so a streaming client notices any
disturbance (a reset, a lost or misrouted segment). With --report-peer every answer is
"NAME PEER-ADDRESS" instead, so a client also learns whether its source was translated.

Usage: podserver.py --name NAME --ports 80,8080 [--protos tcp,udp] [--report-peer]
Prints `ready` on stdout once every socket is bound (IPv4 and IPv6 on each port).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket


class NameReplier(asyncio.DatagramProtocol):
    """UDP: answer each datagram with the pod's name (and the sender's address)."""

    def __init__(self, name: bytes, report_peer: bool = False) -> None:
        self.name = name
        self.report_peer = report_peer
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        assert self.transport is not None
        answer = self.name + f" {addr[0]}".encode() if self.report_peer else self.name
        self.transport.sendto(answer, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # an ICMP error about an earlier reply; nothing to do


def bound_socket(family: int, kind: int, port: int) -> socket.socket:
    sock = socket.socket(family, kind)
    if kind == socket.SOCK_STREAM:
        # Restart quickly past TIME_WAIT. Not for UDP, where it would let a second
        # server share the port and steal datagrams.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        # One socket per family: the IPv6 one must not also take IPv4 as mapped addresses.
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
    sock.setblocking(False)
    return sock


async def serve(name: str, ports: list[int], protos: list[str], report_peer: bool = False) -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
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
    for port in ports:
        for family in (socket.AF_INET, socket.AF_INET6):
            if "tcp" in protos:
                sock = bound_socket(family, socket.SOCK_STREAM, port)
                servers.append(await asyncio.start_server(answer, sock=sock, backlog=512))
            if "udp" in protos:
                sock = bound_socket(family, socket.SOCK_DGRAM, port)
                await loop.create_datagram_endpoint(
                    lambda: NameReplier(name.encode(), report_peer), sock=sock
                )
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    print("ready", flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--ports", required=True, help="comma-separated port numbers")
    parser.add_argument("--protos", default="tcp,udp", help="tcp, udp or tcp,udp")
    parser.add_argument(
        "--report-peer", action="store_true", help="answer 'NAME PEER-ADDRESS'"
    )
    args = parser.parse_args()
    ports = [int(port) for port in args.ports.split(",")]
    protos = [proto for proto in args.protos.split(",") if proto]
    unknown = set(protos) - {"tcp", "udp"}
    if unknown:
        parser.error(f"unknown protocol(s): {', '.join(sorted(unknown))}")
    asyncio.run(serve(args.name, ports, protos, args.report_peer))


if __name__ == "__main__":
    main()
