"""A lab client pod's requests, run inside the client's network namespace: HTTP GETs
(http.client) and UDP datagrams to Service frontends, each on a new connection or
socket (a new flow), counting which pod answered.

Reads {"items": [{"id", "proto": "tcp"|"udp", "ip", "port", "n", "timeout",
"give_up_after", "peer"}]} as JSON on stdin; prints {"id": {"counts": {pod: n}, "errors":
{class: n}, "details": [...], "peers": {pod: {address: n}}}} as one JSON line.
give_up_after stops an item after that many timeouts in all (0: never), so a broken
frontend costs seconds, not minutes. With "peer": true the server is asked which source
address it saw (podserver.py's X-Peer header, or its answer to a `peer` datagram).
Standalone on purpose (no package imports). Error classes: refused, timeout, reset,
unreachable, other.
"""

from __future__ import annotations

import errno
import http.client
import ipaddress
import json
import socket
import sys
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


def udp_exchange(ip: str, port: int, timeout: float, peer: bool = False) -> tuple[str, str | None]:
    """(the pod's name, the source address it saw when asked with `peer`)."""
    family = socket.AF_INET6 if ipaddress.ip_address(ip).version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
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
                name, peer = udp_exchange(ip, port, timeout, want_peer)
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


def main() -> int:
    plan = json.load(sys.stdin)
    results = {str(item["id"]): run_item(item) for item in plan["items"]}
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
