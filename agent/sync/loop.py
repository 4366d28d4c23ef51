"""The sync loop: StateStore → Compiler → dataplane, with kube-proxy's guarantees.

Nothing is applied before every source finished its initial list. Each run compiles
what changed (one Service per change) and applies the new NodeState only when its
revision differs from what the dataplane holds, or on the periodic full resync. A
failed apply keeps the previous state in the kernel, is counted and logged with its
reason, and is retried with capped exponential backoff as a full resync.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from .. import gcpause
from ..dataplane.base import Dataplane, DataplaneError
from ..metrics import Metrics
from ..model.compile import CompileOptions, Compiler
from ..model.nodestate import NodeState, ServiceEntry
from .runner import BoundedFrequencyRunner
from .store import StateStore

log = logging.getLogger(__name__)

RETRY_MIN = 1.0  # seconds before the first retry of a failed apply


class StatusSink(Protocol):
    """Where the loop reports (the local API's AgentStatus implements this)."""

    def set_node_state(self, state: NodeState) -> None: ...

    def set_node_eligible(self, eligible: bool) -> None: ...

    def record_sync(
        self,
        success: bool,
        when: float,
        held_revision: str | None,
        error: str | None = None,
        reason: str | None = None,
    ) -> None: ...


class StateSink(Protocol):
    """Something that follows every applied NodeState (healthCheckNodePort servers)."""

    def sync(self, state: NodeState) -> None: ...


class SyncLoop:
    def __init__(
        self,
        store: StateStore,
        node: str,
        options: CompileOptions,
        dataplane: Dataplane,
        metrics: Metrics,
        *,
        min_sync_period: float = 0.0,
        sync_period: float = 30.0,
        status: StatusSink | None = None,
        followers: list[StateSink] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.compiler = Compiler(node, options)
        self.dataplane = dataplane
        self.metrics = metrics
        self.status = status
        self.followers = followers or []
        self.sync_period = sync_period
        self._wall = wall_clock
        self._clock = clock
        self._needs_full = True  # the first apply compares with the kernel
        self._failures = 0
        self._frozen = False
        self._last_counts: dict[str, int] = {}  # counts reported so far (all since start)
        self.state: NodeState | None = None
        self.applied: NodeState | None = None  # the last state the dataplane took
        # (revision, clock at its start) while dataplane.apply runs; stop() waits for it
        self._applying: tuple[str, float] | None = None
        self._register_state_gauges()
        self.runner = BoundedFrequencyRunner(
            "sync", self.sync, min_sync_period, sync_period, clock=clock
        )

    def start(self) -> None:
        self.store.on_change(self._queue)
        self.runner.start()
        self._queue()

    def _queue(self) -> None:
        """Ask for a sync (a change arrived); kube-proxy's queued timestamp says when."""
        self.metrics.sync_last_queued.set(self._wall())
        self.runner.run()

    def stop(self) -> None:
        """Start no sync, and wait for the apply in flight however long it takes: the
        dataplane closes its descriptors after this returns, and an apply cut there
        would write through closed (or reused) file descriptors. What bounds the wait
        is whoever sent SIGTERM (the kubelet's SIGKILL after the grace period)."""
        self.runner.halt()
        applying = self._applying
        if applying is not None:
            revision, since = applying
            log.info(
                "stopping: waiting for the apply of revision %s in flight (%.1f s so far) to "
                "finish; nothing is closed before it has",
                revision[:19], self._clock() - since,
            )  # fmt: skip
        self.runner.join()

    def sync(self, periodic: bool = False) -> bool:
        """One run: compile what changed, apply if needed. Returns True on success."""
        if not self.store.synced:
            log.debug("sync: waiting for every source's initial list")
            return False
        started = self._clock()
        with self.store.lock:
            state = self.compiler.update(self.store.state)
            triggers, self.store.trigger_times = self.store.trigger_times, []
            counts = dict(self.store.counts.changes)
            node = self.store.state.nodes.get(self.compiler.node_name)
        self._count_changes(counts)
        if self.state is None or state.revision != self.state.revision:
            self.metrics.revisions.inc()
        self.state = state
        if self.status is not None:
            self.status.set_node_state(state)
            self.status.set_node_eligible(node.eligible if node is not None else True)
        full = periodic or self._needs_full
        if not full and state.revision == self.dataplane.held_revision:
            self._succeeded(state, started, 0, triggers, full)
            return True
        self._applying = (state.revision, self._clock())
        try:
            writes = self.dataplane.apply(state, full=full)
        except DataplaneError as err:
            self._failed(err.reason, str(err), triggers)
            return False
        except Exception as err:  # a dataplane bug must not kill the agent
            log.exception("sync: dataplane %s raised", self.dataplane.name)
            self._failed("unexpected", f"{type(err).__name__}: {err}", triggers)
            return False
        finally:
            self._applying = None
        if self._needs_full and not self._frozen:
            # The first full state is programmed: move the millions of long-lived model
            # objects out of the cyclic GC's generations, so later collections do not
            # rescan them (a 10k-Service heap made each full collection take ~0.2 s).
            gcpause.enable(freeze=True)  # the daemon pauses it during the initial lists
            self._frozen = True
        self._needs_full = False
        self._succeeded(state, started, writes, triggers, full)
        return True

    def _register_state_gauges(self) -> None:
        """Gauges describing the applied state, computed when /metrics is read: walking
        every entry on each sync cost more than compiling at 10k Services."""
        m = self.metrics

        def entries() -> tuple[ServiceEntry, ...]:
            return self.applied.services if self.applied is not None else ()

        m.programmed_services.set_function(lambda: len(entries()))
        # Changes the store took that no sync has taken yet (a sync takes them all).
        for gauge, kind in (
            (m.service_changes_pending, "Service"),
            (m.endpoint_changes_pending, "EndpointSlice"),
        ):
            gauge.set_function(
                lambda k=kind: max(0, self.store.counts.changes[k] - self._last_counts.get(k, 0))
            )
        m.programmed_backends.set_function(
            lambda: self.applied.backend_count() if self.applied is not None else 0
        )
        for policy, attribute in (
            ("internal", "internal_traffic_policy"),
            ("external", "external_traffic_policy"),
        ):
            m.no_local_endpoints.labels(policy).set_function(
                lambda a=attribute: sum(
                    1
                    for e in entries()
                    if getattr(e, a) == "Local" and e.has_endpoints and not e.local_backends
                )
            )

    def _count_changes(self, counts: dict[str, int]) -> None:
        last, self._last_counts = self._last_counts, counts
        self.metrics.service_changes.inc(counts["Service"] - last.get("Service", 0))
        self.metrics.endpoint_changes.inc(counts["EndpointSlice"] - last.get("EndpointSlice", 0))

    def _succeeded(
        self, state: NodeState, started: float, writes: int, triggers: list[float], full: bool
    ) -> None:
        self._failures = 0
        first, self.applied = self.applied is None, state
        now = self._wall()
        m = self.metrics
        m.kernel_writes.labels(self.dataplane.name).inc(writes)
        took = self._clock() - started
        m.sync_duration.observe(took)
        (m.sync_full_duration if full else m.sync_partial_duration).observe(took)
        m.sync_last_timestamp.set(now)
        for trigger in triggers:
            m.network_programming.observe(max(0.0, now - trigger))
        if self.status is not None:
            self.status.record_sync(True, now, self.dataplane.held_revision)
        for follower in self.followers:
            try:
                follower.sync(state)
            except Exception:
                log.exception("sync: %s failed to follow the new state", type(follower).__name__)
        if not writes and first:
            log.info(
                "sync: the kernel already holds revision %s: %d services, %d backends, "
                "nothing to write (%.1f ms)",
                state.revision[:19],
                len(state.services),
                state.backend_count(),
                (self._clock() - started) * 1000,
            )  # fmt: skip
        elif writes:
            log.info(
                "sync: applied revision %s: %d services, %d backends, %d writes in %.1f ms",
                state.revision[:19],
                len(state.services),
                state.backend_count(),
                writes,
                (self._clock() - started) * 1000,
            )  # fmt: skip

    def _failed(self, reason: str, message: str, triggers: list[float]) -> None:
        # The slices' changes are still unprogrammed: keep their trigger times.
        with self.store.lock:
            self.store.trigger_times[:0] = triggers
        self._needs_full = True
        self._failures += 1
        delay = min(RETRY_MIN * 2 ** (self._failures - 1), self.sync_period)
        self.metrics.sync_errors.labels(reason).inc()
        log.error(
            "sync: dataplane %s failed (%s): %s; the previous state stays in the kernel, "
            "full resync in %.1f s",
            self.dataplane.name, reason, message, delay,
        )  # fmt: skip
        if self.status is not None:
            self.status.record_sync(False, self._wall(), self.dataplane.held_revision,
                                    error=f"{reason}: {message}", reason=reason)  # fmt: skip
        self.runner.retry_after(delay)
