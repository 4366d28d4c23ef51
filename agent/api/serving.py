"""Small HTTP servers for the agent's local API, on the standard library's http.server.

`serve(bind, routes)` parses a `host:port` bind address, binds, and answers requests in
daemon threads until `Server.close()`, which stops at once (no polling interval), drops
open connections and joins every thread it started. Request logs go to `logging` at
debug level, never to stderr.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from socketserver import TCPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

IDLE_TIMEOUT = 10.0  # seconds a connection may stay silent before it is dropped
CLOSE_TIMEOUT = 5.0  # seconds close() waits for the threads it started
MAX_CONNECTIONS = 256  # per server; more concurrent connections are closed at once
_RESOURCE_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


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


Handler = Callable[[Request], Response]


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


class _HTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer that tracks its connection threads and stops without polling."""

    daemon_threads = True
    block_on_close = False  # close() joins the connection threads itself, with a deadline
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        family: socket.AddressFamily,
        v6only: bool | None,
        routes: Mapping[str, Handler],
        default: Handler | None,
        name: str,
    ) -> None:
        self.address_family = family
        self.v6only = v6only
        self.routes = dict(routes)
        self.default = default
        self.name = name
        self.connections: dict[threading.Thread, socket.socket] = {}
        self.connections_lock = threading.Lock()
        self.stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            super().__init__(address, _RequestHandler)
        except BaseException:
            self._wake_r.close()
            self._wake_w.close()
            raise

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6 and self.v6only is not None:
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(self.v6only))
        # Not HTTPServer.server_bind: it also resolves the host's FQDN, a DNS lookup per bind.
        TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])

    def run(self) -> None:
        """Accept connections until `stop()`; each one is handled in its own thread."""
        self.socket.setblocking(False)
        with selectors.DefaultSelector() as selector:
            selector.register(self.socket, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self.stopping:
                for key, _ in selector.select():
                    if key.fileobj is self._wake_r or self.stopping:
                        return
                    try:
                        request, client = self.socket.accept()
                    except OSError as err:  # the client went away, or a spurious wake-up
                        if err.errno in _RESOURCE_ERRORS:  # out of fds or memory: back off
                            log.warning("%s: accept failed: %s", self.name, err)
                            time.sleep(0.1)
                        continue
                    request.setblocking(True)
                    with self.connections_lock:
                        full = len(self.connections) >= MAX_CONNECTIONS
                    if full:  # a flood must not start unbounded threads
                        log.debug(
                            "%s: %d connections open, dropping %s",
                            self.name,
                            MAX_CONNECTIONS,
                            client,
                        )
                        self.shutdown_request(request)
                        continue
                    try:
                        self.process_request(request, client)
                    except Exception:
                        self.handle_error(request, client)
                        self.shutdown_request(request)

    def process_request(self, request: Any, client_address: Any) -> None:
        thread = threading.Thread(
            target=self._connection,
            args=(request, client_address),
            name=f"{self.name} connection",
            daemon=True,
        )
        with self.connections_lock:
            self.connections[thread] = request
        try:
            thread.start()
        except BaseException:  # e.g. no more threads: forget it, run() closes the socket
            with self.connections_lock:
                self.connections.pop(thread, None)
            raise

    def _connection(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self.connections_lock:
                self.connections.pop(threading.current_thread(), None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("%s: error serving %s", self.name, client_address, exc_info=True)

    def stop(self) -> None:
        """Make `run` return (from any thread but its own connection threads)."""
        self.stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def finish_stop(self, deadline: float) -> None:
        """After `run` returned: close the sockets, drop connections, join their threads."""
        self.server_close()
        self._wake_r.close()
        self._wake_w.close()
        with self.connections_lock:
            open_connections = list(self.connections.items())
        for _, request in open_connections:  # wake threads blocked reading a silent client
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)
        for thread, _ in open_connections:
            thread.join(max(0.0, deadline - time.monotonic()))


class _RequestHandler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "kube-bpf-proxy"
    sys_version = ""
    timeout = IDLE_TIMEOUT

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def _not_allowed(self) -> None:
        self._send(
            json_response(
                405, {"error": f"method {self.command} not allowed"}, {"Allow": "GET, HEAD"}
            ),
            head=False,
        )

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def _dispatch(self, head: bool) -> None:
        url = urlsplit(self.path)
        request = Request(self.command, url.path, parse_qs(url.query), self.headers)
        handler = self.server.routes.get(url.path, self.server.default)
        if handler is None:
            response = json_response(
                404, {"error": f"no such path {url.path!r}", "paths": sorted(self.server.routes)}
            )
        else:
            try:
                response = handler(request)
            except Exception as err:
                log.exception("%s: %s %s failed", self.server.name, self.command, url.path)
                response = json_response(500, {"error": f"{type(err).__name__}: {err}"})
        self._send(response, head)

    def _send(self, response: Response, head: bool) -> None:
        try:
            self.send_response(response.status)
            self.send_header("Content-Type", response.content_type)
            self.send_header("Content-Length", str(len(response.body)))
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Cache-Control", "no-store")
            for name, value in response.headers.items():
                self.send_header(name, value)
            self.end_headers()
            if not head:
                self.wfile.write(response.body)
        except OSError as err:  # the client went away
            log.debug("%s: client %s: %s", self.server.name, self.client_address, err)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s: %s %s", self.server.name, self.address_string(), format % args)


class Server:
    """One listening HTTP server, started by `serve`; `close()` stops it and its threads."""

    def __init__(self, httpd: _HTTPServer) -> None:
        self._httpd = httpd
        self._lock = threading.Lock()
        self._closed = False
        host, port = httpd.server_address[:2]
        self.host: str = str(host)
        self.port: int = int(port)
        self._thread = threading.Thread(target=httpd.run, name=httpd.name, daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self._httpd.name

    @property
    def address(self) -> str:
        """The bound address as `host:port` (`[v6]:port`), with the real port."""
        return format_host_port(self.host, self.port)

    @property
    def url(self) -> str:
        """A URL that reaches this server from this host (loopback for wildcard binds)."""
        host = self.host
        if host == "0.0.0.0" or (host == "::" and not self._httpd.v6only):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        return f"http://{format_host_port(host, self.port)}"

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Stop accepting, drop open connections, join every thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + timeout
        self._httpd.stop()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._httpd.finish_stop(deadline)
        log.debug("%s: closed %s", self.name, self.address)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Server {self.name} {self.address}{' closed' if self._closed else ''}>"


def serve(
    bind: str,
    routes: Mapping[str, Handler],
    *,
    default: Handler | None = None,
    name: str = "kbp-http",
) -> Server:
    """Bind `bind` (`host:port`) and serve `routes` (path → handler) in daemon threads.

    `default` answers paths not in `routes` (else 404). Hosts: an IPv4 address binds
    that family only; an IPv6 address (`[::]:p` too) binds IPv6 only; an empty host
    (`:p`) binds every address of both families (IPv4 alone where the kernel has no
    IPv6); a name is resolved once. Raises ValueError for a malformed address and
    OSError when the address cannot be bound (e.g. EADDRINUSE).
    """
    host, port = parse_bind(bind)
    if host == "":
        try:
            httpd = _HTTPServer(("::", port), socket.AF_INET6, False, routes, default, name)
        except OSError as err:
            if err.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                raise
            httpd = _HTTPServer(("0.0.0.0", port), socket.AF_INET, None, routes, default, name)
    else:
        family, address = _family_of(host, port)
        v6only = True if family == socket.AF_INET6 else None
        httpd = _HTTPServer((address, port), family, v6only, routes, default, name)
    server = Server(httpd)
    log.debug("%s: listening on %s", name, server.address)
    return server
