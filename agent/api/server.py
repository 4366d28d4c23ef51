"""The agent's local API: what the sync loop reports (AgentStatus) and the HTTP servers
that publish it — `/metrics`, `/state` and `/proxyMode` on the metrics address;
`/healthz`, `/livez` and `/readyz` on the health address, with kube-proxy's meaning.

Wiring (one AgentStatus per agent, shared by the sync loop and both servers)::

    status = AgentStatus(dataplane=dataplane.name)
    metrics_server = MetricsServer(settings.metrics_bind_address, status, metrics)
    health_server = HealthServer(settings.healthz_bind_address, status, settings.sync_period)
    hc_servers = HealthCheckServers(proxy_healthy=health_server.is_healthy)  # healthcheck.py
    loop = SyncLoop(..., sync_period=settings.sync_period, status=status,
                    followers=[hc_servers])
    ...
    loop.stop(); hc_servers.close(); health_server.close(); metrics_server.close()

Health (`/healthz`, `/livez`), with timeout = 2 * sync_period:

* Before the sync loop has computed any NodeState (sources still listing), healthy:
  kube-proxy answers 200 until its first update is queued. `/readyz` says not ready.
* Unhealthy when a NodeState revision the dataplane does not hold has been waiting
  longer than the timeout (kube-proxy's "oldest queued update" rule), or when the last
  successful sync is older than the timeout (syncs keep failing, or the loop stalled).
  A failed sync alone is not unhealthy: it is retried with backoff within the window.
* `/healthz` is also 503 while the node is not eligible (deleted, or tainted
  ToBeDeletedByClusterAutoscaler; `set_node_eligible`); `/livez` ignores that.
* An unreachable API server does not make the agent unhealthy (the last state keeps
  serving); it is reported as `apiReachable` in the bodies and in `/state`.

Readiness (`/readyz`): 200 once this agent has programmed the node from the cluster's
current state: a dataplane apply succeeded after every source finished its initial
list. Until then 503, also while what an earlier agent programmed keeps serving (the
adopted revision): a restarted agent that cannot reach the API server is not ready, so a
DaemonSet rollout (maxUnavailable 1) stops at this node instead of moving on. An API
outage later leaves the last state serving and is reported as `apiReachable: false`, as
kube-proxy does; the agent stays ready through it.

Readiness also means the datapath serves what was applied: 503 while the dataplane
reports that part of it is gone from the kernel and could not be put back yet (its
`integrity()`: programs detached, pins lost), and while the last apply was refused
because the state does not fit the maps (reason `capacity`). `/healthz` and `/livez`
turn 503 too once the datapath has gone unrepaired for REPAIR_LIMIT seconds: a node
that cannot be made to serve should be replaced or looked at, not trusted.
"""

from __future__ import annotations

import gzip
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ..metrics import Metrics
from ..model.nodestate import API_VERSION, KIND, NodeState
from ..render import dump_json, dump_yaml
from .serving import (
    WORKERS,
    Handler,
    Request,
    Response,
    Server,
    Stream,
    json_response,
    serve,
    serve_unix,
    text_response,
)
from .watch import StateHub

log = logging.getLogger(__name__)

# Seconds the datapath may go unserving and unrepaired before /healthz says unhealthy.
REPAIR_LIMIT = 60.0


def timestamp(when: float | None) -> str | None:
    """Unix time → RFC 3339 UTC with milliseconds (`2026-01-02T03:04:05.678Z`)."""
    if when is None:
        return None
    text = datetime.fromtimestamp(when, UTC).isoformat(timespec="milliseconds")
    return text.replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    """A consistent copy of AgentStatus at one moment (all times are Unix seconds)."""

    dataplane: str | None
    dataplane_reason: str | None  # why it was chosen (`--dataplane auto`'s probes)
    state: NodeState | None  # the latest NodeState the sync loop computed
    revision_since: float | None  # when state.revision was first reported
    held_revision: str | None  # what the dataplane held after the last sync
    pending_since: float | None  # since when the dataplane lags state.revision
    last_sync: float | None  # last sync attempt (success or failure)
    last_sync_succeeded: bool | None
    last_success: float | None
    last_error: str | None  # reason of the last failed sync (cleared by a success)
    consecutive_failures: int
    first_programmed: float | None  # first successful apply: readiness
    api_reachable: bool | None  # None: no API source (manifests) or not known yet
    adopted_revision: str | None  # what the kernel held at start-up (an earlier agent's)
    node_eligible: bool
    details: Mapping[str, Any] = field(default_factory=dict)  # the dataplane's own fields
    # What of the applied state the kernel lost and the dataplane could not put back yet,
    # and for how many seconds (None: intact).
    datapath_problems: tuple[str, ...] = ()
    unrepaired_seconds: float | None = None
    refused: str | None = None  # the last apply's error when the state does not fit
    # kube-proxy's state in this namespace at the last look (agent.kubeproxy_rules): None
    # before the first look; else {"state": absent|present|removed, "found": ...}.
    kube_proxy: Mapping[str, Any] | None = None

    @property
    def current_revision(self) -> str | None:
        return self.state.revision if self.state is not None else None

    @property
    def programmed(self) -> bool:
        return self.first_programmed is not None

    @property
    def ready(self) -> bool:
        return self.programmed and not self.datapath_problems and self.refused is None

    def to_dict(self) -> dict[str, Any]:
        """The `status` field of `/state` (camelCase, RFC 3339 times)."""
        return {
            "dataplane": self.dataplane,
            "dataplaneReason": self.dataplane_reason,
            "ready": self.ready,
            "inSync": self.state is not None and self.held_revision == self.state.revision,
            "pendingSince": timestamp(self.pending_since),
            "lastSyncTime": timestamp(self.last_sync),
            "lastSyncSucceeded": self.last_sync_succeeded,
            "lastSuccessTime": timestamp(self.last_success),
            "consecutiveFailures": self.consecutive_failures,
            "lastError": self.last_error,
            "firstProgrammedTime": timestamp(self.first_programmed),
            "adoptedRevision": self.adopted_revision,
            "apiReachable": self.api_reachable,
            "nodeEligible": self.node_eligible,
            **({"kubeProxy": dict(self.kube_proxy)} if self.kube_proxy is not None else {}),
            **self.details,
        }


@dataclass(frozen=True, slots=True)
class HealthReport:
    healthy: bool  # the proxy's own health (/livez; healthCheckNodePort servers)
    node_eligible: bool  # /healthz is healthy and node_eligible
    reason: str | None  # why not healthy
    last_success: float | None
    current_time: float
    api_reachable: bool | None


class AgentStatus:
    """What the agent knows about its own progress; thread-safe.

    The sync loop calls, on every run (also the periodic full resyncs that write
    nothing):

    * `set_node_state(state)` once it has compiled the run's NodeState, before applying
      it (the same revision again is a no-op);
    * `record_sync(success, when, held_revision)` after the apply attempt (or after
      deciding no apply was needed), with `held_revision = dataplane.held_revision`.

    The Kubernetes source calls `set_api_reachable(bool)` when its watches connect or
    start retrying, and `set_node_eligible(bool)` from this node's Node object. Readers
    (the HTTP servers) use `snapshot()` and `health(timeout)`.
    """

    def __init__(
        self,
        dataplane: str | None = None,
        clock: Callable[[], float] = time.time,
        dataplane_reason: str | None = None,
        details: Callable[[], Mapping[str, Any]] | None = None,
        integrity: Callable[[], tuple[Sequence[str], float | None]] | None = None,
    ) -> None:
        """`clock` gives Unix time (injectable for tests); `record_sync`'s `when` must
        use the same clock. `details`: the dataplane's own status fields (e.g. the XDP
        mode per interface), asked at each snapshot. `integrity`: the dataplane's
        report of what it lost and could not put back, and for how many seconds."""
        self._clock = clock
        self._details = details
        self._integrity = integrity
        self._refused: str | None = None
        self._lock = threading.Lock()
        self._dataplane = dataplane
        self._dataplane_reason = dataplane_reason
        self._state: NodeState | None = None
        self._revision_since: float | None = None
        self._held: str | None = None
        self._pending_since: float | None = None
        self._last_sync: float | None = None
        self._last_sync_ok: bool | None = None
        self._last_success: float | None = None
        self._last_error: str | None = None
        self._failures = 0
        self._first_programmed: float | None = None
        self._api_reachable: bool | None = None
        self._node_eligible = True
        self._adopted: str | None = None
        self._kube_proxy: dict[str, Any] | None = None
        self._subscribers: list[Callable[[NodeState], None]] = []

    def subscribe(self, callback: Callable[[NodeState], None]) -> None:
        """Call `callback(state)` with every new NodeState revision (the watch hub)."""
        with self._lock:
            self._subscribers.append(callback)

    # --- writers (the sync loop, the sources) ----------------------------------------
    def set_dataplane(
        self,
        name: str,
        reason: str | None,
        details: Callable[[], Mapping[str, Any]] | None = None,
        integrity: Callable[[], tuple[Sequence[str], float | None]] | None = None,
    ) -> None:
        """The dataplane chosen (as the constructor's arguments): the agent serves its
        health while the dataplane is still being chosen and compiled."""
        with self._lock:
            self._dataplane, self._dataplane_reason = name, reason
            self._details, self._integrity = details, integrity

    def set_adopted(self, revision: str | None) -> None:
        """At start-up: the kernel holds what an earlier agent programmed (`revision`,
        None when unknown). Reported as held; not a sync, so not ready."""
        with self._lock:
            self._adopted = revision
            if self._last_sync is None:
                self._held = revision

    def set_node_state(self, state: NodeState) -> None:
        """The latest complete NodeState (what the dataplane should hold)."""
        with self._lock:
            now = self._clock()
            new = self._state is None or state.revision != self._state.revision
            if new:
                self._revision_since = now
            self._state = state
            self._update_pending(now, synced=False)
            subscribers = list(self._subscribers) if new else []
        for callback in subscribers:
            try:
                callback(state)
            except Exception:
                log.exception("a NodeState subscriber failed")

    def record_sync(
        self,
        success: bool,
        when: float | None,
        held_revision: str | None,
        error: str | None = None,
        reason: str | None = None,
    ) -> None:
        """One sync attempt ended at `when` (None: now); the dataplane now holds
        `held_revision` (unchanged by a failure). `error`: a short reason, optional;
        `reason`: the DataplaneError's label (`capacity`: the state does not fit)."""
        with self._lock:
            self._refused = error if not success and reason == "capacity" else None
            now = self._clock() if when is None else when
            self._held = held_revision
            self._last_sync = now
            self._last_sync_ok = success
            if success:
                self._last_success = now
                self._last_error = None
                self._failures = 0
                if self._first_programmed is None and held_revision is not None:
                    self._first_programmed = now
            else:
                self._failures += 1
                self._last_error = error or "sync failed"
            self._update_pending(now, synced=success)

    def set_kube_proxy(self, state: str, found: Mapping[str, Any]) -> None:
        """What the last look for kube-proxy's state saw (kubeproxy_rules.KubeProxyWatch):
        `state` absent, present or removed; `found` what is there now."""
        with self._lock:
            self._kube_proxy = {"state": state, "checkedTime": timestamp(self._clock()),
                                "found": dict(found)}  # fmt: skip

    def set_api_reachable(self, reachable: bool) -> None:
        with self._lock:
            self._api_reachable = reachable

    def set_node_eligible(self, eligible: bool) -> None:
        """False while this node is being deleted or drained by the cluster autoscaler
        (kube-proxy's nodeEligible): /healthz then answers 503 so load balancers leave."""
        with self._lock:
            self._node_eligible = eligible

    def _update_pending(self, now: float, synced: bool) -> None:
        """Keep `_pending_since` = since when the dataplane lags the current revision.

        Like kube-proxy's oldest queued update: a newer revision arriving while one is
        pending keeps the older time; a successful sync that leaves the dataplane behind
        (the state changed meanwhile) restarts the wait from the current revision's time.
        """
        pending = self._state is not None and self._state.revision != self._held
        if not pending:
            self._pending_since = None
        elif self._pending_since is None:
            self._pending_since = now
        elif synced and self._revision_since is not None:
            self._pending_since = max(self._pending_since, self._revision_since)

    # --- readers -------------------------------------------------------------------------
    def snapshot(self) -> StatusSnapshot:
        details = dict(self._details()) if self._details is not None else {}
        problems, unrepaired = self._integrity() if self._integrity is not None else ((), None)
        with self._lock:
            return StatusSnapshot(
                dataplane=self._dataplane,
                dataplane_reason=self._dataplane_reason,
                state=self._state,
                revision_since=self._revision_since,
                held_revision=self._held,
                pending_since=self._pending_since,
                last_sync=self._last_sync,
                last_sync_succeeded=self._last_sync_ok,
                last_success=self._last_success,
                last_error=self._last_error,
                consecutive_failures=self._failures,
                first_programmed=self._first_programmed,
                api_reachable=self._api_reachable,
                adopted_revision=self._adopted,
                node_eligible=self._node_eligible,
                details=details,
                datapath_problems=tuple(problems),
                unrepaired_seconds=unrepaired,
                refused=self._refused,
                kube_proxy=self._kube_proxy,
            )

    @property
    def current_revision(self) -> str | None:
        with self._lock:
            return self._state.revision if self._state is not None else None

    @property
    def held_revision(self) -> str | None:
        with self._lock:
            return self._held

    @property
    def last_success(self) -> float | None:
        with self._lock:
            return self._last_success

    @property
    def first_programmed(self) -> float | None:
        with self._lock:
            return self._first_programmed

    @property
    def ready(self) -> bool:
        return self.snapshot().ready

    def health(self, timeout: float) -> HealthReport:
        """kube-proxy's health with `timeout` (2 * sync period); see the module doc."""
        snap = self.snapshot()
        now = self._clock()
        reason = None
        if snap.pending_since is not None and now - snap.pending_since > timeout:
            reason = (
                f"revision {snap.current_revision} has waited {now - snap.pending_since:.1f}s "
                f"to be programmed (limit {timeout:g}s); the dataplane holds "
                f"{snap.held_revision or 'nothing'}"
            )
        elif snap.last_success is not None and now - snap.last_success > timeout:
            reason = f"last successful sync {now - snap.last_success:.1f}s ago (limit {timeout:g}s)"
            if snap.last_error:
                reason += f"; last error: {snap.last_error}"
        elif snap.unrepaired_seconds is not None and snap.unrepaired_seconds > REPAIR_LIMIT:
            reason = (
                f"the datapath has not served its state for {snap.unrepaired_seconds:.0f}s "
                f"and could not be repaired (limit {REPAIR_LIMIT:g}s): "
                + "; ".join(snap.datapath_problems)
            )
        return HealthReport(
            healthy=reason is None,
            node_eligible=snap.node_eligible,
            reason=reason,
            last_success=snap.last_success,
            current_time=now,
            api_reachable=snap.api_reachable,
        )

    def healthy(self, timeout: float) -> bool:
        return self.health(timeout).healthy


# --- servers ------------------------------------------------------------------------------


class _RoutedServer:
    """One `serve`d HTTP server; `close()` stops it (idempotent; also as a context)."""

    server: Server

    def _start(self, bind: str, routes: dict[str, Handler], name: str, workers: int) -> None:
        self.server = serve(bind, routes, name=name, workers=workers)
        log.info("%s listening on %s", name, self.server.address)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return self.server.url

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> _RoutedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MetricsServer(_RoutedServer):
    """`--metrics-bind-address`: `/metrics`, `/state` and `/proxyMode`.

    * `/metrics`: the agent's Prometheus registry (text format, or OpenMetrics when the
      scraper asks for it; gzip when accepted).
    * `/state` (`?output=json|yaml`, default json): the current NodeState document
      (docs/nodestate.md) with two more top-level fields before `services`:
      `heldRevision` (what the dataplane holds; equals `revision` when in sync) and
      `status` (`StatusSnapshot.to_dict`). 503 with `status` before the first NodeState.
      gzip when accepted. `?watch=true`: the stream of revisions (watch.py), when the
      server has a `hub`.
    * `/proxyMode`: the dataplane's name as plain text (kube-proxy serves its mode there).
    """

    def __init__(
        self, bind: str, status: AgentStatus, metrics: Metrics, hub: StateHub | None = None
    ) -> None:
        self.status = status
        self.metrics = metrics
        self._state = _StateRoute(status, hub)
        self._start(
            bind,
            {"/metrics": self._metrics, "/state": self._state, "/proxyMode": self._proxy_mode},
            "metrics server",
            workers=WORKERS,  # rendering /state or /metrics may take a while
        )

    def _metrics(self, request: Request) -> Response:
        body, content_type = self.metrics.exposition(request.header("Accept"))
        headers = {}
        if "gzip" in request.header("Accept-Encoding"):
            body = gzip.compress(body, compresslevel=6)
            headers["Content-Encoding"] = "gzip"
        return Response(200, body, content_type, headers)

    def _proxy_mode(self, request: Request) -> Response:
        return text_response(200, self.status.snapshot().dataplane or "")


class StateSocketServer(_RoutedServer):
    """`--state-socket PATH`: `/state` (and its watch) on a unix socket only the agent's
    user may open (mode 0600), for node-local consumers that should not use TCP."""

    def __init__(self, path: str, status: AgentStatus, hub: StateHub | None) -> None:
        self.server = serve_unix(path, {"/state": _StateRoute(status, hub)},
                                 name="state socket", workers=WORKERS)  # fmt: skip
        log.info("state socket listening on %s", self.server.address)


class _StateRoute:
    """The `/state` handler (MetricsServer, StateSocketServer)."""

    def __init__(self, status: AgentStatus, hub: StateHub | None) -> None:
        self.status = status
        self.hub = hub
        self._documents = _StateDocuments()

    def __call__(self, request: Request) -> Response | Stream:
        if request.param("watch", "false") == "true":
            if self.hub is None:
                return json_response(404, {"error": "this server has no watch"})
            return self.hub.handle(request)
        output = request.param("output", "json")
        if output not in ("json", "yaml"):
            return json_response(400, {"error": f"output must be json or yaml, not {output!r}"})
        snap = self.status.snapshot()
        if snap.state is None:
            held = snap.held_revision
            return json_response(
                503,
                {
                    "error": "no NodeState yet: waiting for the initial lists"
                    + (f"; the kernel keeps serving revision {held}" if held else ""),
                    "heldRevision": held,
                    "status": snap.to_dict(),
                },
            )
        response = self._documents.render(snap, output)
        if "gzip" in request.header("Accept-Encoding"):
            body = gzip.compress(response.body, compresslevel=6)
            return Response(200, body, response.content_type, {"Content-Encoding": "gzip"})
        return response


class _StateDocuments:
    """Renders `/state`. The `services` part, nearly all of the document, is rendered once
    per revision and reused until it changes; the head is rendered per request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._services: dict[str, tuple[str, str]] = {}  # output → (revision, text)

    def render(self, snap: StatusSnapshot, output: str) -> Response:
        state = snap.state
        assert state is not None
        head: dict[str, Any] = {  # NodeState.to_dict's order, extras before `services`
            "apiVersion": API_VERSION,
            "kind": KIND,
            "node": state.node.to_dict(),
            "revision": state.revision,
            "heldRevision": snap.held_revision,
            "status": snap.to_dict(),
        }
        services = self._services_text(state, output)
        if output == "yaml":
            text = dump_yaml(head) + services
            return Response(200, text.encode(), "application/yaml; charset=utf-8")
        head_text = dump_json(head)
        text = head_text[:-2] + ",\n" + services + "\n}\n"  # head without its closing "\n}"
        return Response(200, text.encode(), "application/json")

    def _services_text(self, state: NodeState, output: str) -> str:
        with self._lock:
            cached = self._services.get(output)
        if cached is not None and cached[0] == state.revision:  # the hash of `services`
            return cached[1]
        services = {"services": [entry.to_dict() for entry in state.services]}
        # JSON: '  "services": [...]', indented as a member of the top-level object.
        text = dump_yaml(services) if output == "yaml" else dump_json(services)[2:-2]
        with self._lock:
            self._services[output] = (state.revision, text)
        return text


class HealthServer(_RoutedServer):
    """`--healthz-bind-address`: `/healthz`, `/livez` and `/readyz` (see the module doc).

    Bodies: `{"lastUpdated", "currentTime", "nodeEligible"}` as kube-proxy sends them
    (`lastUpdated` is the current time while healthy, for compatibility, as in
    kube-proxy), plus `lastSuccessfulSync`, `apiReachable` and, when unhealthy, `reason`.
    """

    def __init__(
        self, bind: str, status: AgentStatus, sync_period: float, metrics: Metrics | None = None
    ) -> None:
        """`metrics`: where /healthz and /livez answers are counted by status code."""
        if sync_period <= 0:
            raise ValueError(f"sync_period must be positive, not {sync_period}")
        self.status = status
        self.timeout = 2 * sync_period
        self.metrics = metrics
        self._start(
            bind,
            {"/healthz": self._healthz, "/livez": self._livez, "/readyz": self._readyz},
            "health server",
            workers=0,  # answered on the event loop: they only read AgentStatus
        )

    def is_healthy(self) -> bool:
        """The proxy's own health, ignoring node eligibility (kube-proxy's IsHealthy):
        what the healthCheckNodePort servers report as serviceProxyHealthy."""
        return self.status.healthy(self.timeout)

    def _body(self, report: HealthReport, with_node: bool) -> dict[str, Any]:
        healthy = report.healthy and (report.node_eligible or not with_node)
        last = report.current_time if healthy else report.last_success
        body: dict[str, Any] = {
            "lastUpdated": timestamp(last),
            "currentTime": timestamp(report.current_time),
        }
        if with_node:
            body["nodeEligible"] = report.node_eligible
        body["lastSuccessfulSync"] = timestamp(report.last_success)
        body["apiReachable"] = report.api_reachable
        if report.reason:
            body["reason"] = report.reason
        elif not healthy:
            body["reason"] = (
                "this node is not eligible (being deleted, or drained by the autoscaler)"
            )
        return body

    def _healthz(self, request: Request) -> Response:
        report = self.status.health(self.timeout)
        healthy = report.healthy and report.node_eligible
        code = 200 if healthy else 503
        if self.metrics is not None:
            self.metrics.healthz_requests.labels(str(code)).inc()
        return json_response(code, self._body(report, with_node=True))

    def _livez(self, request: Request) -> Response:
        report = self.status.health(self.timeout)
        code = 200 if report.healthy else 503
        if self.metrics is not None:
            self.metrics.livez_requests.labels(str(code)).inc()
        return json_response(code, self._body(report, with_node=False))

    def _readyz(self, request: Request) -> Response:
        snap = self.status.snapshot()
        body: dict[str, Any] = {
            "ready": snap.ready,
            "firstProgrammedTime": timestamp(snap.first_programmed),
            "heldRevision": snap.held_revision,
            "apiReachable": snap.api_reachable,
        }
        if not snap.programmed:
            body["reason"] = (
                "not yet programmed from the cluster's state: "
                + ("waiting for the initial lists" if snap.state is None
                   else f"applying revision {snap.current_revision}")
                + (f"; the kernel keeps serving revision {snap.held_revision}"
                   if snap.held_revision else "")
            )  # fmt: skip
        elif snap.datapath_problems:
            body["reason"] = (
                "the datapath does not serve the applied state and could not be repaired "
                f"yet: {'; '.join(snap.datapath_problems)}"
            )
        elif snap.refused is not None:
            body["reason"] = f"the current state was refused: {snap.refused}"
        return json_response(200 if snap.ready else 503, body)


__all__ = [
    "AgentStatus",
    "HealthReport",
    "HealthServer",
    "MetricsServer",
    "Server",
    "StatusSnapshot",
    "serve",
    "timestamp",
]
