"""healthCheckNodePort servers: for LoadBalancer Services with externalTrafficPolicy Local,
answer the cloud load balancer's probes with this node's local endpoint count, so that
only nodes with local endpoints receive traffic (kube-proxy's contract).

Any path, GET or HEAD: 200 when the Service has a ready endpoint on this node and the
proxy is healthy, else 503, with kube-proxy's body and headers::

    {"service": {"namespace": "default", "name": "web"}, "localEndpoints": 2,
     "serviceProxyHealthy": true}
    X-Content-Type-Options: nosniff
    X-Load-Balancing-Endpoint-Weight: 2
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..model.nodestate import NodeState
from .serving import Request, Response, Server, format_host_port, json_response, serve

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServiceHealth:
    """What one healthCheckNodePort reports."""

    namespace: str
    name: str
    local_endpoints: int  # distinct IPs of ready endpoints on this node


def health_checks(state: NodeState) -> tuple[dict[int, ServiceHealth], list[str]]:
    """The ports to serve and what each reports; plus conflict messages.

    A Service's entries (one per port and IP family) all carry its healthCheckNodePort;
    its count is the number of distinct IPs among their ready local backends (kube-proxy
    counts ready endpoints only: a node left with only terminating endpoints fails the
    check, so the load balancer drains it while they finish). Two Services claiming one
    port (the API server prevents it; manifests may not): the first in document order
    keeps it.
    """
    ips: dict[tuple[str, str], set[str]] = {}
    owner: dict[int, tuple[str, str]] = {}
    conflicts: list[str] = []
    for entry in state.services:
        port = entry.health_check_node_port
        if port is None:
            continue
        key = (entry.namespace, entry.name)
        claimed = owner.setdefault(port, key)
        if claimed != key:
            conflicts.append(
                f"healthCheckNodePort {port} of Service {key[0]}/{key[1]} is already used "
                f"by Service {claimed[0]}/{claimed[1]}"
            )
            continue
        local = ips.setdefault(key, set())
        local.update(b.ip for b in entry.local_backends or () if b.ready)
    ports = {
        port: ServiceHealth(ns, name, len(ips[ns, name])) for port, (ns, name) in owner.items()
    }
    return ports, list(dict.fromkeys(conflicts))


@dataclass(eq=False)
class _Port:
    """One healthCheckNodePort: what it reports (swapped atomically, read without a
    lock by the handlers) and its listeners, one per bind address."""

    health: ServiceHealth
    listeners: dict[str, Server] = field(default_factory=dict)


class HealthCheckServers:
    """Follows the applied NodeState (`sync`) with one listener per healthCheckNodePort
    and bind address.

    `bind_addresses`: hosts to listen on; "" (the default) is every address of both
    families, like kube-proxy; give the node's addresses to honour
    `--nodeport-addresses`. `proxy_healthy` reports the proxy's own health
    (`HealthServer.is_healthy`); while it is False every port answers 503.
    """

    def __init__(
        self,
        bind_addresses: Sequence[str] = ("",),
        proxy_healthy: Callable[[], bool] | None = None,
    ) -> None:
        self._hosts = [
            h[1:-1] if h.startswith("[") and h.endswith("]") else h for h in bind_addresses
        ]
        if not self._hosts:
            raise ValueError("HealthCheckServers: at least one bind address is required")
        self._proxy_healthy = proxy_healthy or (lambda: True)
        self._lock = threading.Lock()
        self._ports: dict[int, _Port] = {}
        self._bind_errors: dict[tuple[int, str], str] = {}  # logged once per error text
        self._conflicts: set[str] = set()
        self._closed = False

    def sync(self, state: NodeState) -> None:
        """Serve exactly the healthCheckNodePorts of `state`: open new ports, close removed
        ones, update counts in place. A port that cannot be bound is logged with its
        Service and retried at the next sync. Never raises for a bind failure."""
        wanted, conflicts = health_checks(state)
        to_close: list[Server] = []
        with self._lock:
            if self._closed:
                return
            for message in conflicts:
                if message not in self._conflicts:
                    log.warning("%s; ignoring it", message)
            self._conflicts = set(conflicts)
            for port in [p for p in self._ports if p not in wanted]:
                gone = self._ports.pop(port)
                log.info(
                    "healthCheckNodePort %d of Service %s/%s: closing",
                    port, gone.health.namespace, gone.health.name,
                )  # fmt: skip
                to_close.extend(gone.listeners.values())
                for host in self._hosts:
                    self._bind_errors.pop((port, host), None)
            for port, health in wanted.items():
                entry = self._ports.get(port)
                if entry is None:
                    entry = self._ports[port] = _Port(health)
                elif entry.health != health:
                    entry.health = health  # one reference assignment: handlers see old or new
                for host in self._hosts:
                    if host not in entry.listeners:
                        self._open(port, host, entry)
        for server in to_close:
            server.close()

    def _open(self, port: int, host: str, entry: _Port) -> None:
        health = entry.health
        bind = format_host_port(host, port)
        try:
            server = serve(
                bind,
                {},
                default=lambda request: self._answer(entry, request),
                name=f"healthcheck {port}",
                workers=0,  # answered on the event loop: it only reads memory
            )
        except (OSError, ValueError) as err:
            message = str(err)
            level = (
                logging.DEBUG if self._bind_errors.get((port, host)) == message else logging.WARNING
            )
            self._bind_errors[(port, host)] = message
            log.log(
                level,
                "healthCheckNodePort %d of Service %s/%s: cannot listen on %s: %s; "
                "retrying at the next sync",
                port, health.namespace, health.name, bind, message,
            )  # fmt: skip
            return
        if self._bind_errors.pop((port, host), None) is not None:
            log.info("healthCheckNodePort %d: listening on %s after all", port, bind)
        entry.listeners[host] = server
        log.info(
            "healthCheckNodePort %d of Service %s/%s: listening on %s",
            port, health.namespace, health.name, server.address,
        )  # fmt: skip

    def _answer(self, entry: _Port, request: Request) -> Response:
        health = entry.health
        proxy_healthy = bool(self._proxy_healthy())
        body = {
            "service": {"namespace": health.namespace, "name": health.name},
            "localEndpoints": health.local_endpoints,
            "serviceProxyHealthy": proxy_healthy,
        }
        status = 200 if health.local_endpoints > 0 and proxy_healthy else 503
        headers = {"X-Load-Balancing-Endpoint-Weight": str(health.local_endpoints)}
        return json_response(status, body, headers)

    # --- introspection ------------------------------------------------------------------
    def services(self) -> dict[int, ServiceHealth]:
        """Every healthCheckNodePort of the last sync and what it reports."""
        with self._lock:
            return {port: entry.health for port, entry in self._ports.items()}

    def listening(self) -> dict[int, dict[str, Server]]:
        """Port → {bind host → its server}, for the listeners that are open."""
        with self._lock:
            return {p: dict(e.listeners) for p, e in self._ports.items() if e.listeners}

    def close(self) -> None:
        """Close every listener; later syncs do nothing. Idempotent."""
        with self._lock:
            self._closed = True
            servers = [s for entry in self._ports.values() for s in entry.listeners.values()]
            self._ports.clear()
        for server in servers:
            server.close()

    def __enter__(self) -> HealthCheckServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
