"""Small HTTP servers for the agent's local API, all on one asyncio event-loop thread.

`serve(bind, routes)` parses a `host:port` bind address, binds, and answers GET and HEAD,
one request per connection, until `Server.close()`, which stops at once and drops open
connections. Request logs go to `logging` at debug level, never to stderr.

The health port binds every address by default, so these servers must outlast clients
that connect and never finish. Three limits do that (module constants, documented in
docs/operations.md):

* a whole request head must arrive within `REQUEST_DEADLINE` of the connection being
  accepted (a deadline, not a per-byte idle timeout), and the client has
  `RESPONSE_DEADLINE` (plus a second per MiB) to take the answer;
* one client address (an IPv6 client: its /64) holds at most `MAX_PER_ADDRESS`
  connections on one port: a new one closes that address's oldest;
* all servers together hold at most `MAX_CONNECTIONS` (and never more than half the
  open-files limit): a new one closes the oldest connection of the address that holds
  the most.

A handler may answer with a `Stream` instead of a `Response` (a watch): its head goes
out at once, then its producer writes pieces for as long as the connection lasts. A
stream has no response deadline; what bounds it is its producer's (write only while the
client keeps up: `StreamSink.writable`), and it leaves its client address's group, so a
host's watches count toward the server-wide cap and the producer's own limit, not
toward `MAX_PER_ADDRESS`. `serve_unix` serves the same routes on a unix socket.

An idle connection costs about 2 KB and no thread, so thousands of them do not
slow anyone else's request. Handlers that may block (rendering a large document) run on
a few worker threads per server; those that only read memory run on the loop itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import ipaddress
import json
import logging
import os
import queue
import re
import resource
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.message import Message
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

REQUEST_DEADLINE = 10.0  # seconds from accept until the request line and headers are in
RESPONSE_DEADLINE = 10.0  # seconds the client has to read the answer and close, plus:
MIN_READ_RATE = 1 << 20  # bytes a second: a large answer (/state) gets size / rate more
MAX_PER_ADDRESS = 64  # connections one client address (IPv6: one /64) may hold per port
MAX_CONNECTIONS = 4096  # connections all servers hold together (also ≤ half of ulimit -n)
MAX_REQUEST_LINE = 8192  # bytes; a longer request line is answered 414
MAX_HEAD = 32768  # bytes of request line and headers; more is answered 431
MAX_HEADERS = 100  # header fields; more is answered 431
WORKERS = 2  # default threads per server for handlers that may block
CLOSE_TIMEOUT = 5.0  # seconds close() waits for the threads it started
START_TIMEOUT = 5.0  # seconds serve() waits for the event loop to take a new listener
BACKLOG = 1024  # listen queue, and connections accepted per loop iteration
OPEN_FILES_WANTED = 65536  # soft RLIMIT_NOFILE the agent asks for at start
ALLOWED_METHODS = ("GET", "HEAD")

_HEAD_END = re.compile(rb"\r?\n\r?\n")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(r"HTTP/(\d)\.(\d)")
_WARN_EVERY = 60.0  # seconds between warnings about dropped connections, per server
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Request:
    method: str  # GET or HEAD
    path: str  # without the query string
    query: Mapping[str, list[str]]
    headers: Message

    def param(self, name: str, default: str | None = None) -> str | None:
        """The last value of query parameter `name`, else `default`."""
        values = self.query.get(name)
        return values[-1] if values else default

    def header(self, name: str) -> str:
        return self.headers.get(name, "") or ""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


class StreamSink:
    """Where a Stream's producer writes (on the event loop's thread only, except
    `call_soon`). `writable` is False while the client has not taken what was written
    (asyncio paused writing) or once the connection is gone; `on_writable` is called when
    it becomes writable again."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self.on_writable: Callable[[], None] | None = None

    @property
    def writable(self) -> bool:
        conn = self._conn
        return conn.stage == _STREAMING and not conn.paused

    @property
    def client(self) -> str:
        return self._conn.client

    def write(self, data: bytes) -> None:
        if self._conn.stage == _STREAMING and self._conn.transport is not None:
            self._conn.transport.write(data)

    def call_soon(self, function: Callable[[], None]) -> None:
        """Run `function` on the event loop (from any thread); nothing once it stopped."""
        with contextlib.suppress(RuntimeError):
            self._conn.server.shared.loop.call_soon_threadsafe(function)

    def close(self) -> None:
        """End the stream: what was written is sent, then the connection closes."""
        if self._conn.transport is not None:
            self._conn.transport.close()


@dataclass(frozen=True, slots=True)
class Stream:
    """A response whose body is written piece by piece while the connection lasts: no
    Content-Length (the body ends when the connection does). `start(sink)` runs on the
    event loop once the head is sent and returns what to call when the connection ends
    (also when the server closes)."""

    status: int
    start: Callable[[StreamSink], Callable[[], None]]
    content_type: str = "application/x-ndjson"
    headers: Mapping[str, str] = field(default_factory=dict)
    # called instead of `start` when the connection went while the handler ran
    abandoned: Callable[[], None] | None = None


Handler = Callable[[Request], Response | Stream]


def json_response(
    status: int, document: Any, headers: Mapping[str, str] | None = None, indent: int = 2
) -> Response:
    body = json.dumps(document, indent=indent, ensure_ascii=False) + "\n"
    return Response(status, body.encode(), "application/json", headers or {})


def text_response(status: int, text: str) -> Response:
    return Response(status, text.encode(), "text/plain; charset=utf-8")


def parse_bind(bind: str) -> tuple[str, int]:
    """`host:port`, `[ipv6]:port` or `:port` → (host, port); host "" means every address.

    Port 0 asks the kernel for a free port (see `Server.port`).
    """
    text = bind.strip()
    if text.startswith("["):
        end = text.find("]")
        if end < 0 or not text[end + 1 :].startswith(":"):
            raise ValueError(f"bind address {bind!r}: expected [IPv6]:PORT")
        host, port_text = text[1:end], text[end + 2 :]
        try:
            if ipaddress.ip_address(host.split("%", 1)[0]).version != 6:
                raise ValueError
        except ValueError:
            raise ValueError(f"bind address {bind!r}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"bind address {bind!r}: expected HOST:PORT")
        if ":" in host:
            raise ValueError(f"bind address {bind!r}: write an IPv6 address as [ADDRESS]:PORT")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"bind address {bind!r}: port must be a number from 0 to 65535")
    return host, int(port_text)


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _family_of(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The socket family and address to bind for an IP literal or a host name."""
    try:
        version = ipaddress.ip_address(host.split("%", 1)[0]).version
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as err:
            raise OSError(errno.EADDRNOTAVAIL, f"cannot resolve {host!r}: {err}") from err
        family, _, _, _, sockaddr = infos[0]
        return family, str(sockaddr[0])
    return (socket.AF_INET6 if version == 6 else socket.AF_INET), host


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to `wanted` (or the hard limit, if lower); never lower
    it. Each connection the servers hold is an open file. Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft, soft
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    after = max(soft, target)
    if after > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (after, hard))
        log.info("open files limit raised from %d to %d", soft, after)
    if after < 2 * MAX_CONNECTIONS:
        log.warning(
            "open files limit is %d (hard limit %s): the HTTP servers will hold at most %d "
            "connections, not %d",
            after, "unlimited" if hard == resource.RLIM_INFINITY else hard,
            max(1, after // 2), MAX_CONNECTIONS,
        )  # fmt: skip
    return soft, after


def connection_cap() -> int:
    """How many connections all servers hold together: `MAX_CONNECTIONS`, but at most half
    the soft open-files limit, so that accepting never fails for want of descriptors."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, soft // 2))


def client_key(host: str) -> str:
    """What the per-address limit counts by: the IPv4 address (also IPv4-mapped IPv6),
    an IPv6 client's /64 (one host usually owns a whole /64)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


# --- the event loop -----------------------------------------------------------------------


class _Loop:
    """The event-loop thread every server shares, with the table of their connections.
    The first `serve` starts it; the last `Server.close` stops it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.users = 0
        self.table = _Table()
        self.thread = threading.Thread(target=self._run, name="kbp-http loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
            left = asyncio.all_tasks(self.loop)  # connections accepted as the last one closed
            for task in left:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        finally:
            self.loop.close()

    def call(self, function: Callable[[], _T], timeout: float = CLOSE_TIMEOUT) -> _T:
        """Run `function` on the loop thread and return its result (from any other thread)."""
        if threading.current_thread() is self.thread:
            return function()
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(function())
            except BaseException as err:
                done.set_exception(err)

        self.loop.call_soon_threadsafe(run)
        return done.result(timeout)


_loop_lock = threading.Lock()
_current: _Loop | None = None


def _acquire_loop() -> _Loop:
    global _current
    with _loop_lock:
        if _current is None:
            _current = _Loop()
        _current.users += 1
        return _current


def _release_loop(shared: _Loop, deadline: float) -> None:
    global _current
    with _loop_lock:
        shared.users -= 1
        if shared.users > 0:
            return
        if _current is shared:
            _current = None
        shared.loop.call_soon_threadsafe(shared.loop.stop)
        if threading.current_thread() is not shared.thread:  # else it stops on return
            shared.thread.join(max(0.0, deadline - time.monotonic()))


class _Table:
    """Every open connection of every server, grouped by (server, client key) in accept
    order: whom to close when a limit is reached. Used on the loop thread only."""

    def __init__(self) -> None:
        self.groups: dict[tuple[int, str], dict[_Connection, None]] = {}
        self.total = 0

    def add(self, conn: _Connection) -> None:
        group = self.groups.setdefault(conn.group, {})
        group[conn] = None
        self.total += 1
        if len(group) > MAX_PER_ADDRESS:
            oldest = next(iter(group))
            oldest.server.dropped(f"{MAX_PER_ADDRESS} connections from {conn.client}")
            oldest.abort()
        if self.total > connection_cap():
            fattest = max(self.groups.values(), key=len)
            oldest = next(iter(fattest))
            conn.server.dropped(f"{self.total - 1} connections open in all")
            oldest.abort()

    def remove(self, conn: _Connection) -> None:
        group = self.groups.get(conn.group)
        if group is None or conn not in group:
            return
        del group[conn]
        self.total -= 1
        if not group:
            del self.groups[conn.group]


class _Workers:
    """Threads that run the handlers which may block, so that the loop never waits."""

    def __init__(self, count: int, name: str) -> None:
        self._count = count
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            while len(self._threads) < self._count:  # started with the first request
                thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                thread.start()
                self._threads.append(thread)
        self._jobs.put(job)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def close(self, deadline: float) -> None:
        with self._lock:
            threads, self._count = list(self._threads), 0
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            if thread is not threading.current_thread():  # a handler closing its server
                thread.join(max(0.0, deadline - time.monotonic()))


# --- one connection -----------------------------------------------------------------------

_READING, _HANDLING, _ANSWERED, _STREAMING, _CLOSED = range(5)


class _Connection(asyncio.Protocol):
    """One client connection: read one request head within the deadline, answer, close."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.client = "?"
        self.group: tuple[int, str] = (id(server), "?")
        self.stage = _READING
        self.buffer = bytearray()
        self.scanned = 0  # bytes of `buffer` known not to end the head
        self.peer_closed = False
        self.timer: asyncio.TimerHandle | None = None
        self.paused = False  # asyncio paused writing: the client is behind
        self.sink: StreamSink | None = None
        self.stream_ended: Callable[[], None] | None = None

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self.client = str(peer[0])
            self.group = (id(self.server), client_key(self.client))
        else:  # a unix socket: no address to group by, each is its own
            self.client = "unix"
            self.group = (id(self.server), f"unix {id(self)}")
        loop = self.server.shared.loop
        self.timer = loop.call_later(REQUEST_DEADLINE, self._request_timed_out)
        self.server.connections.add(self)
        self.server.shared.table.add(self)

    def data_received(self, data: bytes) -> None:
        if self.stage != _READING:
            return  # one request per connection: the rest is read and dropped
        self.buffer += data
        self._parse()

    def eof_received(self) -> bool:
        self.peer_closed = True
        # Keep the write side open for the answer. A stream ends: a watching client that
        # closes has gone (nothing else would tell, while no revision comes to write).
        return self.stage == _HANDLING

    def connection_lost(self, exc: Exception | None) -> None:
        self.stage = _CLOSED
        if self.timer is not None:
            self.timer.cancel()
        self.server.connections.discard(self)
        self.server.shared.table.remove(self)
        ended, self.stream_ended = self.stream_ended, None
        if ended is not None:
            try:
                ended()
            except Exception:
                log.exception("%s: ending a stream to %s failed", self.server.name, self.client)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.sink is not None and self.sink.on_writable is not None:
            self.sink.on_writable()

    def abort(self) -> None:
        """Drop the connection now (a limit was reached, or the server closes)."""
        self.server.shared.table.remove(self)
        if self.transport is not None:
            self.transport.abort()

    # reading
    def _request_timed_out(self) -> None:
        self.timer = None  # this handle is running: nothing to cancel any more
        if self.stage != _READING:
            return
        if self.buffer.strip():
            self._error(408, f"the request was not complete within {REQUEST_DEADLINE:g}s")
        else:
            self.abort()

    def _parse(self) -> None:
        buf = self.buffer
        while buf[:1] in (b"\r", b"\n"):  # blank lines before a request line are allowed
            del buf[:1]
        line_end = buf.find(b"\n", 0, MAX_REQUEST_LINE + 1)
        if line_end < 0 and len(buf) > MAX_REQUEST_LINE:
            self._error(414, f"request line longer than {MAX_REQUEST_LINE} bytes")
            return
        found = _HEAD_END.search(buf, max(0, self.scanned - 3))
        if found is None:
            self.scanned = len(buf)
            if len(buf) > MAX_HEAD:
                self._error(431, f"request headers longer than {MAX_HEAD} bytes")
            return
        if found.end() > MAX_HEAD:
            self._error(431, f"request headers longer than {MAX_HEAD} bytes")
            return
        head = bytes(buf[: found.start()]).decode("latin-1")
        self.buffer = bytearray()
        self.stage = _HANDLING
        if self.timer is not None:
            self.timer.cancel()
        self._dispatch(head)

    def _dispatch(self, head: str) -> None:
        request_line, *header_lines = [line.rstrip("\r") for line in head.split("\n")]
        words = request_line.split()
        if len(words) != 3:
            self._error(400, f"bad request line {request_line[:100]!r}", request_line)
            return
        method, target, version = words
        matched = _VERSION.fullmatch(version)
        if matched is None or not _TOKEN.fullmatch(method):
            self._error(400, f"bad request line {request_line[:100]!r}", request_line)
            return
        if matched.group(1) != "1":
            self._error(505, f"{version} is not supported: use HTTP/1.1", request_line)
            return
        if len(header_lines) > MAX_HEADERS:
            self._error(431, f"more than {MAX_HEADERS} header fields", request_line)
            return
        headers = Message()
        for line in header_lines:
            name, colon, value = line.partition(":")
            if not colon or not _TOKEN.fullmatch(name):  # also obsolete line folding
                self._error(400, f"bad header line {line[:100]!r}", request_line)
                return
            headers[name] = value.strip(" \t")
        if method not in ALLOWED_METHODS:
            self._answer(
                request_line,
                json_response(
                    405,
                    {"error": f"method {method} not allowed"},
                    {"Allow": ", ".join(ALLOWED_METHODS)},
                ),
            )
            return
        try:
            url = urlsplit(target)
            query = parse_qs(url.query)
        except ValueError:  # e.g. an unclosed "[" in an absolute target
            url = None
        if url is None or not (target.startswith("/") or url.scheme):
            self._error(400, f"bad request target {target[:100]!r}", request_line)
            return
        request = Request(method, url.path or "/", query, headers)
        self.server.handle(self, request_line, request)

    # answering
    def _error(self, status: int, message: str, request_line: str = "-") -> None:
        self.stage = _HANDLING
        if self.timer is not None:
            self.timer.cancel()
        self._answer(request_line, json_response(status, {"error": message}))

    def _head(self, response: Response | Stream, length: int | None) -> bytes:
        status = response.status
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        lines = [
            f"HTTP/1.1 {status} {phrase}",
            "Server: kube-bpf-proxy",
            f"Date: {formatdate(usegmt=True)}",
            f"Content-Type: {response.content_type}",
            *([f"Content-Length: {length}"] if length is not None else []),
            "X-Content-Type-Options: nosniff",
            "Cache-Control: no-store",
            "Connection: close",
            *(f"{name}: {value}" for name, value in response.headers.items()),
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _stream(self, request_line: str, response: Stream, head: bool) -> None:
        """Send a Stream's head, then hand the connection to its producer."""
        assert self.transport is not None
        self.transport.write(self._head(response, None))
        log.debug('%s: %s "%s" %d stream', self.server.name, self.client, request_line,
                  response.status)  # fmt: skip
        if head:
            self.stage = _ANSWERED
            self.transport.close()
            if response.abandoned is not None:
                response.abandoned()
            return
        self.stage = _STREAMING
        table = self.server.shared.table
        table.remove(self)  # out of its address's group: see the module docstring
        self.group = (id(self.server), f"stream {id(self)}")
        table.add(self)
        self.sink = StreamSink(self)
        self.stream_ended = response.start(self.sink)

    def _answer(self, request_line: str, response: Response | Stream, head: bool = False) -> None:
        """Send `response` (only its head for HEAD), then close once the client has it."""
        if self.stage != _HANDLING or self.transport is None or self.transport.is_closing():
            if isinstance(response, Stream) and response.abandoned is not None:
                response.abandoned()
            return  # dropped while the handler ran
        if isinstance(response, Stream):
            self._stream(request_line, response, head)
            return
        self.stage = _ANSWERED
        status = response.status
        data = self._head(response, len(response.body))
        if not head:
            data += response.body
        self.transport.write(data)
        log.debug(
            '%s: %s "%s" %d %d',
            self.server.name, self.client, request_line, status, len(response.body),
        )  # fmt: skip
        if self.peer_closed:
            self.transport.close()  # sends what is buffered, then closes
            return
        # Half-close and wait for the client's close: closing at once with unread input
        # would send a reset that can destroy the answer before the client reads it.
        if self.transport.can_write_eof():
            try:
                self.transport.write_eof()
            except OSError as err:
                # The client's close crossed the answer before the loop saw it: its kernel
                # answered the write with a reset (on loopback, before this call), and
                # shutdown() fails with ENOTCONN. There is nobody left to answer.
                log.debug("%s: %s left before its answer: %s", self.server.name, self.client, err)
                self.abort()
                return
        deadline = RESPONSE_DEADLINE + len(data) / MIN_READ_RATE
        self.timer = self.server.shared.loop.call_later(deadline, self.abort)


# --- servers ------------------------------------------------------------------------------


class Server:
    """One listening HTTP server, started by `serve`; `close()` stops it."""

    def __init__(
        self,
        listener: socket.socket,
        routes: Mapping[str, Handler],
        default: Handler | None,
        name: str,
        workers: int,
    ) -> None:
        self.name = name
        self.routes = dict(routes)
        self.default = default
        self.connections: set[_Connection] = set()  # used on the loop thread only
        self._workers = _Workers(workers, f"{name} worker") if workers > 0 else None
        self._lock = threading.Lock()
        self._closed = False
        self._last_warning = 0.0
        if listener.family == socket.AF_UNIX:
            self.host, self.port = str(listener.getsockname()), 0
        else:
            host, port = listener.getsockname()[:2]
            self.host, self.port = str(host), int(port)
        self._v6only = listener.family == socket.AF_INET6 and bool(
            listener.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
        )
        self.shared = _acquire_loop()
        try:
            self._server = self._start(listener)
        except BaseException:
            listener.close()
            _release_loop(self.shared, time.monotonic() + CLOSE_TIMEOUT)
            raise

    def _start(self, listener: socket.socket) -> asyncio.Server:
        """Have the loop serve `listener`, waiting at most START_TIMEOUT."""
        if threading.current_thread() is self.shared.thread:  # it would wait for itself
            raise RuntimeError(f"{self.name}: serve() called on the HTTP event loop's thread")
        start = self.shared.loop.create_server(
            lambda: _Connection(self), sock=listener, backlog=BACKLOG
        )
        future = asyncio.run_coroutine_threadsafe(start, self.shared.loop)
        try:
            return future.result(START_TIMEOUT)
        except concurrent.futures.TimeoutError:
            future.cancel()  # if the loop gets to it, it finds the socket closed anyway
            raise TimeoutError(
                f"{self.name}: the HTTP event loop did not start serving {self.address} "
                f"within {START_TIMEOUT:g} s (is it blocked?)"
            ) from None

    @property
    def address(self) -> str:
        """The bound address as `host:port` (`[v6]:port`), with the real port; a unix
        socket as `unix:PATH`."""
        if self.port == 0 and self.host.startswith("/"):
            return f"unix:{self.host}"
        return format_host_port(self.host, self.port)

    @property
    def url(self) -> str:
        """A URL that reaches this server from this host (loopback for wildcard binds)."""
        host = self.host
        if host == "0.0.0.0" or (host == "::" and not self._v6only):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return f"http://{format_host_port(host, self.port)}"

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def open_connections(self) -> int:
        """How many connections this server holds now (for tests and benchmarks)."""
        return len(self.connections)

    def handle(self, conn: _Connection, request_line: str, request: Request) -> None:
        """Run the handler for `request` (on the loop, or on a worker) and answer."""
        handler = self.routes.get(request.path, self.default)
        head = request.method == "HEAD"
        if handler is None:
            response = json_response(
                404, {"error": f"no such path {request.path!r}", "paths": sorted(self.routes)}
            )
            conn._answer(request_line, response, head)
            return
        if self._workers is None:
            conn._answer(request_line, self._call(handler, request), head)
            return
        loop = self.shared.loop

        def job() -> None:
            response = self._call(handler, request)
            with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
                loop.call_soon_threadsafe(conn._answer, request_line, response, head)

        self._workers.submit(job)

    def _call(self, handler: Handler, request: Request) -> Response | Stream:
        try:
            return handler(request)
        except Exception as err:
            log.exception("%s: %s %s failed", self.name, request.method, request.path)
            return json_response(500, {"error": f"{type(err).__name__}: {err}"})

    def dropped(self, why: str) -> None:
        """A connection was closed to keep a limit: say so, at most once a minute."""
        now = time.monotonic()
        level = logging.DEBUG
        if now - self._last_warning >= _WARN_EVERY:
            self._last_warning = now
            level = logging.WARNING
        log.log(level, "%s %s: %s: closing the oldest", self.name, self.address, why)

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Stop accepting, drop open connections, join every thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout

        def stop() -> None:
            self._server.close()  # closes the listening socket now
            for conn in list(self.connections):
                conn.abort()

        try:
            self.shared.call(stop, max(0.0, deadline - time.monotonic()))
        finally:
            if self._workers is not None:
                self._workers.close(deadline)
            _release_loop(self.shared, deadline)
        log.debug("%s: closed %s", self.name, self.address)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Server {self.name} {self.address}{' closed' if self._closed else ''}>"


def _listen(
    address: tuple[str, int], family: socket.AddressFamily, v6only: bool | None
) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and v6only is not None:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        sock.bind(address)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def serve(
    bind: str,
    routes: Mapping[str, Handler],
    *,
    default: Handler | None = None,
    name: str = "kbp-http",
    workers: int = WORKERS,
) -> Server:
    """Bind `bind` (`host:port`) and serve `routes` (path → handler).

    `default` answers paths not in `routes` (else 404). `workers`: threads that run the
    handlers; 0 runs them on the event loop, for handlers that only read memory and
    never block. Hosts: an IPv4 address binds that family only; an IPv6 address (`[::]:p`
    too) binds IPv6 only; an empty host (`:p`) binds every address of both families
    (IPv4 alone where the kernel has no IPv6); a name is resolved once. Raises ValueError
    for a malformed address and OSError when the address cannot be bound (EADDRINUSE).
    """
    host, port = parse_bind(bind)
    if host == "":
        try:
            listener = _listen(("::", port), socket.AF_INET6, False)
        except OSError as err:
            if err.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                raise
            listener = _listen(("0.0.0.0", port), socket.AF_INET, None)
    else:
        family, address = _family_of(host, port)
        listener = _listen((address, port), family, True if family == socket.AF_INET6 else None)
    server = Server(listener, routes, default, name, workers)
    log.debug("%s: listening on %s", name, server.address)
    return server


def serve_unix(
    path: str,
    routes: Mapping[str, Handler],
    *,
    name: str = "kbp-http",
    workers: int = WORKERS,
    mode: int = 0o600,
) -> Server:
    """`serve` on a unix socket at `path`, which only its owner may use (`mode`). A socket
    file left at `path` by an earlier process is replaced; any other file there is an
    error (FileExistsError)."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise FileExistsError(errno.EEXIST, f"{path} exists and is not a socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        old = os.umask(0o777 & ~mode)  # the file is born with `mode`: no window
        try:
            sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, mode)
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    server = Server(sock, routes, None, name, workers)
    log.debug("%s: listening on %s", name, server.address)
    return server
