"""`kube-bpf-proxy run`: wire a source, the sync loop, a dataplane and the local API."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Protocol

from . import gcpause
from .api.healthcheck import HealthCheckServers
from .api.server import AgentStatus, HealthServer, MetricsServer, StateSocketServer
from .api.serving import raise_open_files_limit
from .api.watch import StateHub
from .config import Settings
from .dataplane.select import DataplaneStartError, select_dataplane
from .kubeproxy_rules import Found, KubeProxyWatch
from .metrics import Metrics
from .nodelock import LockError, NodeLock
from .sources.watch import ManifestPathError, ManifestSource
from .sync.loop import SyncLoop
from .sync.store import StateStore

log = logging.getLogger("kube-bpf-proxy")

GC_PAUSE_LIMIT = 300.0  # seconds the cyclic GC may stay paused waiting for the first apply
# How long a thread that wants the interpreter lock waits for a busy one to let go
# (CPython's default: 5 ms). Answering one health probe takes the lock several times
# (accept, read, handle, write, on the event loop and a worker), so while the source
# decodes a large manifest each probe waited that long several times over; 1 ms keeps
# probes short, at the cost of more frequent switches between busy threads.
SWITCH_INTERVAL = 0.001


class Source(Protocol):
    """A source of cluster state: registered with the store when made, then started."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


class StartupError(Exception):
    """The agent cannot start as configured; the message says what to change."""


class Agent:
    """Everything `run` starts, in start order; `stop` undoes it in reverse.

    The dataplane's kernel state is left in place on stop (as kube-proxy does): the
    next agent adopts it, and `cleanup` removes it on purpose.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.store = StateStore()
        self.status = AgentStatus()
        self._stoppers: list[Callable[[], None]] = []
        # The health server first: /livez answers while the dataplane is chosen and bcc
        # compiles the datapath (over a minute at a 100m CPU request), so a liveness
        # probe never kills an agent that is still starting; /readyz waits for the first
        # programmed state as before.
        raise_open_files_limit()  # every connection the HTTP servers hold is an open file
        try:
            self.health_server = HealthServer(
                settings.healthz_bind_address, self.status, settings.sync_period, self.metrics
            )
        except (OSError, ValueError) as err:
            raise StartupError(
                f"--healthz-bind-address {settings.healthz_bind_address}: {err}"
            ) from err
        self._stoppers.append(self.health_server.close)
        try:
            self._choose_dataplane()
        except BaseException:
            self.stop()
            raise

    def _choose_dataplane(self) -> None:
        settings = self.settings
        try:
            self.selection = select_dataplane(settings.dataplane_options())
        except DataplaneStartError as err:
            raise StartupError(str(err)) from err
        self.dataplane, reason = self.selection.dataplane, self.selection.reason
        self.metrics.dataplane_info.labels(self.dataplane.name, reason).set(1)
        log.info("dataplane: %s (%s)", self.dataplane.name, reason)
        self.status.set_dataplane(
            self.dataplane.name,
            reason,
            details=self.dataplane.status_details,
            integrity=self.dataplane.integrity,
        )
        # What the kernel holds now (an earlier agent's last apply) serves until this
        # agent has the cluster's state and has applied it; /state and /readyz say so.
        adopted = self.dataplane.held_revision
        self.status.set_adopted(adopted)
        if adopted is not None:
            log.info("the kernel holds revision %s (an earlier agent's): it serves until "
                     "this agent has the cluster's state", adopted[:19])  # fmt: skip
        # kube-proxy's rules keep serving beside ours until removed: looked for now, after
        # the first apply (removed then with --remove-kube-proxy-rules) and on resyncs.
        self.kube_proxy = KubeProxyWatch(
            settings.remove_kube_proxy_rules, self._report_kube_proxy,
            period=settings.sync_period, clock=time.monotonic,
        )  # fmt: skip
        self.kube_proxy.check()
        self.dataplane.register_metrics(self.metrics, settings.service_metrics)
        self._stoppers.append(self.dataplane.close)  # the kernel state stays

    def start(self) -> None:
        s = self.settings
        # The initial lists allocate millions of acyclic objects; the cyclic GC rescanning
        # them took over a third of the time to the first apply at 10k Services. The sync
        # loop re-enables it after freezing the first programmed state; the timer makes
        # sure it comes back even if that never happens.
        gcpause.disable()
        gc_timer = threading.Timer(GC_PAUSE_LIMIT, gcpause.enable, kwargs={"freeze": True})
        gc_timer.daemon = True
        gc_timer.start()
        self._stoppers.append(gc_timer.cancel)
        self._stoppers.append(gcpause.enable)
        sys.setswitchinterval(SWITCH_INTERVAL)
        hub = StateHub(self._held_and_status, s.state_watchers)
        self.metrics.state_watchers.set_function(lambda: hub.watchers)
        self._stoppers.append(hub.close)
        self.status.subscribe(hub.publish)
        try:
            metrics_server = MetricsServer(s.metrics_bind_address, self.status, self.metrics, hub)
            self._stoppers.append(metrics_server.close)
        except (OSError, ValueError) as err:
            raise StartupError(f"--metrics-bind-address {s.metrics_bind_address}: {err}") from err
        if s.state_socket:
            try:
                state_socket = StateSocketServer(s.state_socket, self.status, hub)
                self._stoppers.append(state_socket.close)
            except OSError as err:
                raise StartupError(f"--state-socket {s.state_socket}: {err}") from err
        health_server = self.health_server
        health_checks = HealthCheckServers(proxy_healthy=health_server.is_healthy)
        self._stoppers.append(health_checks.close)
        self.loop = SyncLoop(
            self.store,
            s.node,
            s.compile_options(),
            self.dataplane,
            self.metrics,
            min_sync_period=s.min_sync_period,
            sync_period=s.sync_period,
            status=self.status,
            followers=[health_checks, _AfterFirstApply(self.selection.take_over), self.kube_proxy],
        )
        # The source registers with the store when it is made, before the loop can run:
        # the store is not synced until every source it knows of has listed, so nothing
        # (above all not the empty state of a store nobody has filled yet) is applied
        # before the cluster's state is known. What the kernel holds keeps serving.
        source = self._manifest_source() if s.manifests else self._kubernetes_source()
        self.loop.start()
        self._stoppers.append(self.loop.stop)
        source.start()
        self._stoppers.append(source.stop)
        log.info(
            "serving metrics and /state on %s, health on %s",
            metrics_server.url, health_server.url,
        )  # fmt: skip

    def _held_and_status(self) -> tuple[str | None, dict]:
        """`/state`'s heldRevision and status now (for the watch's documents)."""
        snap = self.status.snapshot()
        return snap.held_revision, snap.to_dict()

    def _report_kube_proxy(self, state: str, found: Found) -> None:
        self.status.set_kube_proxy(state, found.to_dict())
        for kind, count in found.counts().items():
            self.metrics.kube_proxy_rules.labels(kind).set(count)

    def _manifest_source(self) -> ManifestSource:
        """The file source: the files' full state now, and again when they change."""
        try:
            return ManifestSource(self.settings.manifests, self.store)
        except ManifestPathError as err:
            raise StartupError(str(err)) from err

    def _kubernetes_source(self) -> Source:
        from .k8s import ConfigError, KubernetesSource, load_config  # the only kubernetes user

        try:
            api_client = load_config(self.settings.kubeconfig)
        except ConfigError as err:
            raise StartupError(str(err)) from err
        return KubernetesSource(
            api_client,
            self.store,
            self.metrics,
            self.settings.node,
            self.settings.service_proxy_name,
            idle_timeout=self.settings.api_idle_timeout,
            request_timeout=self.settings.api_request_timeout,
            on_reachability=self.status.set_api_reachable,
            node_labels=self.settings.compile_options().node_labels,
        )

    def stop(self) -> None:
        for stop in reversed(self._stoppers):
            try:
                stop()
            except Exception:
                log.exception("stopping %s", getattr(stop, "__qualname__", stop))
        self._stoppers.clear()


class _AfterFirstApply:
    """A sync-loop follower that runs `action` once, after the first successful apply."""

    def __init__(self, action: Callable[[], None]) -> None:
        self._action: Callable[[], None] | None = action

    def sync(self, state: object) -> None:
        action, self._action = self._action, None
        if action is not None:
            action()


def run(settings: Settings, stop: threading.Event | None = None) -> int:
    """Hold the node's lock (waiting for it while another agent holds it), then run until
    SIGTERM/SIGINT (or `stop` is set). SIGTERM waits for an apply in flight."""
    stop = stop or threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    # One writer per node: before anything touches the kernel (the probes, the compile,
    # the pins, a dataplane's leftovers), and released only after everything stopped.
    lock = NodeLock(settings.lock_dir, settings.bpffs)
    try:
        if not lock.acquire(stop):
            log.info("stopped while waiting for the node's lock: wrote nothing")
            return 0
    except LockError as err:
        log.error("cannot start: %s", err)
        return 1
    try:
        return _run_holding_the_lock(settings, stop)
    finally:
        lock.release()


def _run_holding_the_lock(settings: Settings, stop: threading.Event) -> int:
    try:
        agent = Agent(settings)
    except StartupError as err:
        log.error("cannot start: %s", err)
        return 1
    try:
        agent.start()
        stop.wait()
    except StartupError as err:
        log.error("cannot start: %s", err)
        return 1
    finally:
        agent.stop()
    return 0
