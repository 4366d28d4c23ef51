"""A lab pod's client, run inside the pod's network namespace.

many IP PORT --proto tcp|udp -n N: N exchanges, each on a new socket (so a new flow and,
  unless --source-port fixes it, a new source port); every answer is the serving pod's
  name. Prints one JSON line: {"counts": {name: n}, "errors": {class: n}, "details": [..]}.
  --same-socket (UDP) sends all N datagrams from one socket: one flow. --interval S
  waits S seconds after each exchange; -n 0 goes on until SIGTERM.
stream IP PORT: one TCP connection; prints `backend NAME`, then every --interval sends a
  numbered line, checks its echo and prints `ok SEQ`; on the first failure prints
  `error CLASS DETAIL` and exits 1. SIGTERM closes the connection cleanly and exits 0.
idle IP PORT -n N: N TCP connections opened and left idle; prints one JSON line
  {"backends": [name, ...], "ports": [client port, ...]} once all have answered, waits
  for a line on stdin (the caller does its worst meanwhile), then sends a line on each
  connection and prints {"echoed": n, "errors": {class: n}, "details": [..]}.
pair IP1 IP2 PORT -n N: N pairs of TCP connections, both of a pair from one source port
  (SO_REUSEADDR; from --first-port on, below the ephemeral range) to two addresses at the
  same time, each then echoing a line; prints
  {"pairs": n_both_worked, "errors": {...}, "details": [..]}. --pause: once a pair has
  answered, print {"opened": port} and wait for a line on stdin before the echoes;
  --second-first: echo on the IP2 connection first. --proto udp: two connect()ed UDP
  sockets instead, each asking for an answer twice, in turns (a socket only hears its
  own peer, so an answer delivered to the wrong one is a timeout).
reuse IP1 IP2 PORT -n N: N times, one source port (from --first-port on) used for a TCP
  connection to IP1 that echoes a line and closes with FINs both ways (no RST), then for
  one to IP2 that does the same; prints {"reused": n_both_worked, "errors": .., ..}.
  --proto udp: a connect()ed UDP socket to each in turn, closed after its answer.

items (the `lab` command's requests): reads {"items": [{"id", "proto": "tcp"|"udp", "ip",
  "port", "n", "timeout", "give_up_after", "peer"}]} as JSON on stdin; TCP items are HTTP
  GETs (http.client), each on a new connection or socket (a new flow); prints {"id":
  {"counts": {pod: n}, "errors": {class: n}, "details": [...], "peers": {pod: {address:
  n}}}} as one JSON line. give_up_after stops an item after that many timeouts in all (0:
  never), so a broken frontend costs seconds, not minutes. With "peer": true the server is
  asked which source address it saw (podserver.py's X-Peer header, or its answer to a
  `peer` datagram).

Standalone on purpose (no package imports): it starts in well under a second.
Error classes: refused, timeout, reset, unreachable, other.
"""

from __future__ import annotations

import argparse
import errno
import http.client
import ipaddress
import json
import signal
import socket
import struct
import sys
import time
from collections import Counter
from typing import Any


def classify(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, TimeoutError | socket.timeout):
        return "timeout"
    if isinstance(
        exc,
        ConnectionResetError | BrokenPipeError | ConnectionAbortedError
        | http.client.RemoteDisconnected,
    ):  # fmt: skip
        return "reset"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    return "other"


def describe(exc: BaseException) -> str:
    code = getattr(exc, "errno", None)
    name = errno.errorcode.get(code, "") if code else ""
    return f"{type(exc).__name__}{'(' + name + ')' if name else ''}: {exc}"


def family_of(ip: str) -> int:
    return socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET


def new_socket(ip: str, kind: int, timeout: float, source_port: int | None) -> socket.socket:
    sock = socket.socket(family_of(ip), kind)
    sock.settimeout(timeout)
    if source_port is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("::" if family_of(ip) == socket.AF_INET6 else "0.0.0.0", source_port))
        if kind == socket.SOCK_STREAM:
            # Close with a RST, leaving no TIME_WAIT, so the next connection can reuse
            # the same source port (the same 5-tuple) at once.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return sock


def read_line(sock: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            raise EOFError(f"connection closed after {line!r}")
        line += chunk
    return line


def tcp_exchange(ip: str, port: int, timeout: float, source_port: int | None) -> str:
    with new_socket(ip, socket.SOCK_STREAM, timeout, source_port) as sock:
        sock.connect((ip, port))
        return read_line(sock).decode().strip()


def udp_exchange(sock: socket.socket) -> str:
    sock.send(b"ping")
    return sock.recv(4096).decode().strip()


def run_many(args: argparse.Namespace) -> int:
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    details: list[str] = []
    shared: socket.socket | None = None
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    done = 0
    while not stopping and (args.n == 0 or done < args.n):
        done += 1
        if args.interval and done > 1:
            time.sleep(args.interval)
        try:
            if args.proto == "tcp":
                counts[tcp_exchange(args.ip, args.port, args.timeout, args.source_port)] += 1
            elif args.same_socket:
                if shared is None:
                    shared = new_socket(args.ip, socket.SOCK_DGRAM, args.timeout, args.source_port)
                    # connect(): replies must come from IP:PORT (the reverse NAT's job),
                    # and ICMP port unreachable surfaces as ECONNREFUSED.
                    shared.connect((args.ip, args.port))
                counts[udp_exchange(shared)] += 1
            else:
                with new_socket(args.ip, socket.SOCK_DGRAM, args.timeout, args.source_port) as s:
                    s.connect((args.ip, args.port))
                    counts[udp_exchange(s)] += 1
        except (OSError, EOFError) as exc:
            errors[classify(exc)] += 1
            if len(details) < 5 and describe(exc) not in details:
                details.append(describe(exc))
    if shared is not None:
        shared.close()
    print(json.dumps({"counts": counts, "errors": errors, "details": details}), flush=True)
    return 0


def run_stream(args: argparse.Namespace) -> int:
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    sequence = 0
    try:
        with socket.socket(family_of(args.ip), socket.SOCK_STREAM) as sock:
            sock.settimeout(args.timeout)
            sock.connect((args.ip, args.port))
            print(f"backend {read_line(sock).decode().strip()}", flush=True)
            while not stopping:
                sequence += 1
                message = f"{sequence}\n".encode()
                sock.sendall(message)
                echoed = read_line(sock)
                if echoed != message:
                    print(f"error other echo {echoed!r} for {message!r}", flush=True)
                    return 1
                print(f"ok {sequence}", flush=True)
                time.sleep(args.interval)
            sock.shutdown(socket.SHUT_WR)
    except (OSError, EOFError) as exc:
        if stopping:
            return 0
        print(f"error {classify(exc)} {describe(exc)}", flush=True)
        return 1
    return 0


def _echo(sock: socket.socket, message: bytes) -> None:
    sock.sendall(message)
    echoed = read_line(sock)
    if echoed != message:
        raise EOFError(f"echo {echoed!r} for {message!r}")


def _report(errors: Counter[str], details: list[str], exc: BaseException) -> None:
    errors[classify(exc)] += 1
    if len(details) < 5 and describe(exc) not in details:
        details.append(describe(exc))


def run_idle(args: argparse.Namespace) -> int:
    socks = []
    names = []
    for _ in range(args.n):
        sock = socket.socket(family_of(args.ip), socket.SOCK_STREAM)
        sock.settimeout(args.timeout)
        sock.connect((args.ip, args.port))
        names.append(read_line(sock).decode().strip())
        socks.append(sock)
    ports = [sock.getsockname()[1] for sock in socks]
    print(json.dumps({"backends": names, "ports": ports}), flush=True)
    sys.stdin.readline()
    echoed, errors, details = 0, Counter(), []
    for n, sock in enumerate(socks):
        try:
            _echo(sock, f"still there {n}\n".encode())
            echoed += 1
        except (OSError, EOFError) as exc:
            _report(errors, details, exc)
        sock.close()
    print(json.dumps({"echoed": echoed, "errors": errors, "details": details}), flush=True)
    return 0


def _ask(sock: socket.socket) -> None:
    """One datagram on a connected UDP socket, and its answer (from the socket's peer)."""
    sock.send(b"ping")
    if not sock.recv(4096):
        raise EOFError("empty answer")


def run_pair(args: argparse.Namespace) -> int:
    pairs, errors, details = 0, Counter(), []
    kind = socket.SOCK_DGRAM if args.proto == "udp" else socket.SOCK_STREAM
    for n in range(args.n):
        port = args.first_port + n
        socks = []
        try:
            for ip in (args.ip1, args.ip2):
                sock = new_socket(ip, kind, args.timeout, None)
                socks.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("::" if family_of(ip) == socket.AF_INET6 else "0.0.0.0", port))
                sock.connect((ip, args.port))
            if kind == socket.SOCK_DGRAM:
                for sock in (*socks, *reversed(socks)):
                    _ask(sock)
                pairs += 1
                continue
            for sock in socks:  # both open at once, then both used
                read_line(sock)
            if args.pause:  # the test does something to the flows first
                print(json.dumps({"opened": port}), flush=True)
                sys.stdin.readline()
            for sock in reversed(socks) if args.second_first else socks:
                _echo(sock, f"pair {n}\n".encode())
            pairs += 1
        except (OSError, EOFError) as exc:
            _report(errors, details, exc)
        finally:
            for sock in socks:
                sock.close()
    print(json.dumps({"pairs": pairs, "errors": errors, "details": details}), flush=True)
    return 0


def run_reuse(args: argparse.Namespace) -> int:
    """One source port used for ip1, closed with FINs both ways, then for ip2."""
    done, errors, details = 0, Counter(), []
    kind = socket.SOCK_DGRAM if args.proto == "udp" else socket.SOCK_STREAM
    for n in range(args.n):
        port = args.first_port + n
        try:
            for ip in (args.ip1, args.ip2):
                with socket.socket(family_of(ip), kind) as sock:
                    sock.settimeout(args.timeout)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind(("::" if family_of(ip) == socket.AF_INET6 else "0.0.0.0", port))
                    sock.connect((ip, args.port))
                    if kind == socket.SOCK_DGRAM:
                        _ask(sock)
                        continue
                    read_line(sock)
                    _echo(sock, f"reuse {n}\n".encode())
                    sock.shutdown(socket.SHUT_WR)  # our FIN, then the server's
                    if sock.recv(4096) != b"":
                        raise EOFError("data after the echo")
            done += 1
        except (OSError, EOFError) as exc:
            _report(errors, details, exc)
    print(json.dumps({"reused": done, "errors": errors, "details": details}), flush=True)
    return 0


def http_get(ip: str, port: int, timeout: float) -> tuple[str, str | None]:
    """(the pod's name, the source address it saw, if it said)."""
    connection = http.client.HTTPConnection(ip, port, timeout=timeout)
    try:
        connection.request("GET", "/", headers={"Connection": "close"})
        response = connection.getresponse()
        body = response.read().decode(errors="replace").strip()
        if response.status != 200:
            raise http.client.HTTPException(f"HTTP {response.status}: {body[:80]}")
        return body, response.getheader("X-Peer")
    finally:
        connection.close()


def udp_item_exchange(
    ip: str, port: int, timeout: float, peer: bool = False
) -> tuple[str, str | None]:
    """(the pod's name, the source address it saw when asked with `peer`)."""
    with socket.socket(family_of(ip), socket.SOCK_DGRAM) as sock:
        sock.settimeout(timeout)
        # connect(): replies must come from ip:port (the reverse NAT's job), and ICMP port
        # unreachable surfaces as ECONNREFUSED.
        sock.connect((ip, port))
        sock.send(b"peer" if peer else b"ping")
        answer = sock.recv(4096).decode(errors="replace").strip()
    if peer:
        name, _, address = answer.partition(" ")
        return name, address or None
    return answer, None


def run_item(item: dict[str, Any]) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    details: list[str] = []
    peers: dict[str, Counter[str]] = {}
    want_peer = bool(item.get("peer"))
    give_up_after = int(item.get("give_up_after") or 0)
    for _ in range(int(item["n"])):
        try:
            ip, port, timeout = item["ip"], int(item["port"]), float(item["timeout"])
            if item["proto"] == "tcp":
                name, peer = http_get(ip, port, timeout)
            else:
                name, peer = udp_item_exchange(ip, port, timeout, want_peer)
            counts[name] += 1
            if want_peer:
                peers.setdefault(name, Counter())[peer or "?"] += 1
        except (OSError, http.client.HTTPException) as exc:
            kind = classify(exc)
            errors[kind] += 1
            if len(details) < 3 and describe(exc) not in details:
                details.append(describe(exc))
            if give_up_after and errors["timeout"] >= give_up_after:
                break
    result: dict[str, Any] = {"counts": counts, "errors": errors, "details": details}
    if want_peer:
        result["peers"] = peers
    return result


def run_items() -> int:
    plan = json.load(sys.stdin)
    results = {str(item["id"]): run_item(item) for item in plan["items"]}
    print(json.dumps(results), flush=True)
    return 0


def two_services(modes: Any, name: str, first_port: int) -> argparse.ArgumentParser:
    """A mode's parser for IP1 IP2 PORT -n N from --first-port on."""
    mode = modes.add_parser(name)
    mode.add_argument("ip1")
    mode.add_argument("ip2")
    mode.add_argument("port", type=int)
    mode.add_argument("-n", type=int, default=1)
    mode.add_argument("--first-port", type=int, default=first_port)
    mode.add_argument("--timeout", type=float, default=5.0)
    mode.add_argument("--proto", choices=("tcp", "udp"), default="tcp")
    return mode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    many = modes.add_parser("many")
    many.add_argument("ip")
    many.add_argument("port", type=int)
    many.add_argument("--proto", choices=("tcp", "udp"), default="tcp")
    many.add_argument("-n", type=int, default=1)
    many.add_argument("--timeout", type=float, default=2.0)
    many.add_argument("--source-port", type=int)
    many.add_argument("--same-socket", action="store_true")
    many.add_argument("--interval", type=float, default=0.0)
    stream = modes.add_parser("stream")
    stream.add_argument("ip")
    stream.add_argument("port", type=int)
    stream.add_argument("--interval", type=float, default=0.05)
    stream.add_argument("--timeout", type=float, default=2.0)
    idle = modes.add_parser("idle")
    idle.add_argument("ip")
    idle.add_argument("port", type=int)
    idle.add_argument("-n", type=int, default=1)
    idle.add_argument("--timeout", type=float, default=5.0)
    pair = two_services(modes, "pair", first_port=20000)
    pair.add_argument(
        "--pause",
        action="store_true",
        help="after opening each pair, print a line and wait for one on stdin",
    )
    pair.add_argument("--second-first", action="store_true", help="echo on ip2's socket first")
    two_services(modes, "reuse", first_port=21000)
    modes.add_parser("items", help="JSON items on stdin (the lab command's requests)")
    args = parser.parse_args()
    if args.mode == "items":
        return run_items()
    if args.mode == "reuse":
        return run_reuse(args)
    if args.mode == "idle":
        return run_idle(args)
    if args.mode == "pair":
        return run_pair(args)
    if args.mode == "many":
        if args.same_socket and args.proto != "udp":
            parser.error("--same-socket is for UDP")
        return run_many(args)
    return run_stream(args)


if __name__ == "__main__":
    sys.exit(main())
