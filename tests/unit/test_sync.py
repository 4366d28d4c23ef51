"""The sync loop with the fake dataplane: gating on initial lists, no-op updates write
nothing, failures keep the previous state and retry as full resyncs, bursts coalesce."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from agent.dataplane.fake import FakeDataplane
from agent.metrics import Metrics
from agent.model.compile import CompileOptions
from agent.model.decode import Value, decode_object
from agent.model.nodestate import NodeState
from agent.sync.loop import SyncLoop
from agent.sync.runner import BoundedFrequencyRunner
from agent.sync.store import StateStore

from ..builders import Obj, default_nodes, make_endpoint, make_service, make_slice


def value(obj: Obj) -> Value:
    decoded = decode_object(obj)
    assert decoded.value is not None, decoded.error
    return decoded.value


def web_slice(*ips: str, ready: bool = True, trigger: str | None = None) -> Value:
    def mutate(obj: Obj) -> None:
        if trigger:
            obj["metadata"]["annotations"] = {
                "endpoints.kubernetes.io/last-change-trigger-time": trigger
            }

    endpoints = [make_endpoint(ip, "node-b", ready=ready) for ip in ips]
    return value(make_slice(endpoints=endpoints, mutate=mutate))


class Status:
    def __init__(self) -> None:
        self.syncs: list[tuple[bool, str | None]] = []
        self.state: NodeState | None = None
        self.eligible: bool | None = None

    def set_node_state(self, state: NodeState) -> None:
        self.state = state

    def set_node_eligible(self, eligible: bool) -> None:
        self.eligible = eligible

    def record_sync(
        self,
        success: bool,
        when: float,
        held_revision: str | None,
        error: str | None = None,
        reason: str | None = None,
    ) -> None:
        self.syncs.append((success, held_revision))


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def loop() -> SyncLoop:
    store = StateStore()
    store.register_source("test")
    for obj in default_nodes():
        store.upsert(value(obj))
    store.upsert(value(make_service()))
    store.upsert(web_slice("10.244.2.5"))
    return SyncLoop(store, "node-a", CompileOptions(), FakeDataplane(), Metrics(), status=Status())


def fake(loop: SyncLoop) -> FakeDataplane:
    assert isinstance(loop.dataplane, FakeDataplane)
    return loop.dataplane


def test_nothing_is_applied_before_every_initial_list_completed(loop: SyncLoop) -> None:
    loop.store.register_source("another")
    loop.store.mark_synced("test")
    assert loop.sync() is False
    assert fake(loop).attempts == 0
    loop.store.mark_synced("another")
    assert loop.sync() is True
    assert fake(loop).held_revision == loop.state.revision  # type: ignore[union-attr]


def test_a_store_no_source_has_registered_with_applies_nothing() -> None:
    """A restarted agent's loop may run before its source has registered: the empty
    store it sees then is not the cluster's state, and applying it would blank the node."""
    store = StateStore()
    loop = SyncLoop(store, "node-a", CompileOptions(), FakeDataplane(), Metrics(), status=Status())
    assert store.synced is False
    assert loop.sync() is False
    assert loop.sync(periodic=True) is False
    assert fake(loop).attempts == 0
    store.register_source("kubernetes/services")
    assert loop.sync() is False  # registered, still listing
    store.mark_synced("kubernetes/services")
    assert loop.sync() is True  # the source said the cluster is empty: apply that
    assert fake(loop).held is not None and fake(loop).held.services == ()


def test_a_source_that_never_registered_cannot_mark_the_store_synced() -> None:
    store = StateStore()
    with pytest.raises(ValueError, match="never registered"):
        store.mark_synced("kubernetes/services")
    assert store.synced is False


def test_the_first_apply_is_a_full_one_then_changes_are_incremental(loop: SyncLoop) -> None:
    loop.store.mark_synced("test")
    loop.sync()
    loop.store.upsert(web_slice("10.244.2.5", "10.244.2.6"))
    loop.sync()
    assert [full for _, full in fake(loop).applied] == [True, False]
    assert fake(loop).writes == 2  # one entry programmed, then that entry changed


def test_a_no_op_update_neither_recompiles_nor_writes(loop: SyncLoop) -> None:
    loop.store.mark_synced("test")
    loop.sync()
    assert loop.store.upsert(web_slice("10.244.2.5")) is False  # same content
    loop.sync()
    assert fake(loop).attempts == 1
    assert sample(loop.metrics, "kbp_nodestate_revisions_total") == 1


def test_a_periodic_resync_applies_in_full_and_writes_nothing_when_the_kernel_matches(
    loop: SyncLoop,
) -> None:
    loop.store.mark_synced("test")
    loop.sync()
    loop.sync(periodic=True)
    assert [full for _, full in fake(loop).applied] == [True, True]
    assert fake(loop).writes == 1
    assert sample(loop.metrics, "kbp_kernel_writes_total", dataplane="fake") == 1


def test_a_failed_apply_keeps_the_previous_state_and_retries_in_full(loop: SyncLoop) -> None:
    loop.store.mark_synced("test")
    loop.sync()
    held = fake(loop).held_revision
    fake(loop).fail_next = 1
    loop.store.upsert(web_slice("10.244.2.5", "10.244.2.6"))
    assert loop.sync() is False
    assert fake(loop).held_revision == held
    assert sample(loop.metrics, "kbp_sync_errors_total", reason="injected") == 1
    assert loop.status.syncs[-1] == (False, held)  # type: ignore[union-attr]
    assert loop.sync() is True
    assert fake(loop).applied[-1][1] is True  # the retry is a full resync
    assert fake(loop).held_revision == loop.state.revision  # type: ignore[union-attr]


def test_a_dataplane_bug_is_an_error_not_a_crash(loop: SyncLoop) -> None:
    loop.store.mark_synced("test")

    def explode(state: NodeState, full: bool = False) -> int:
        raise RuntimeError("boom")

    loop.dataplane.apply = explode  # type: ignore[method-assign]
    assert loop.sync() is False
    assert sample(loop.metrics, "kbp_sync_errors_total", reason="unexpected") == 1


def test_network_programming_latency_is_measured_from_the_trigger_time(loop: SyncLoop) -> None:
    loop.store.mark_synced("test")
    loop.sync()
    loop._wall = lambda: 1_000_000_010.0  # type: ignore[method-assign]
    fake(loop).fail_next = 1
    loop.store.upsert(web_slice("10.244.2.7", trigger="2001-09-09T01:46:40Z"))  # 1e9
    loop.sync()  # fails: the trigger time must survive for the retry
    loop.sync()
    assert sample(loop.metrics, "kubeproxy_network_programming_duration_seconds_count") == 1
    assert sample(loop.metrics, "kubeproxy_network_programming_duration_seconds_sum") == 10.0


def test_metrics_count_changes_and_local_policy_gaps(loop: SyncLoop) -> None:
    loop.store.upsert(
        value(make_service(name="cache", mutate=lambda o: o["spec"].update(
            clusterIP="10.96.0.2", clusterIPs=["10.96.0.2"], internalTrafficPolicy="Local"
        )))
    )  # fmt: skip
    loop.store.upsert(
        value(
            make_slice(
                name="cache-1", service="cache", endpoints=[make_endpoint("10.244.2.9", "node-b")]
            )
        )
    )
    loop.store.mark_synced("test")
    loop.sync()
    m = loop.metrics
    assert sample(m, "kubeproxy_sync_proxy_rules_service_changes_total") == 2
    assert sample(m, "kubeproxy_sync_proxy_rules_endpoint_changes_total") == 2
    assert (
        sample(m, "kubeproxy_sync_proxy_rules_no_local_endpoints_total", traffic_policy="internal")
        == 1
    )
    assert sample(m, "kbp_programmed_services") == 2
    assert sample(m, "kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 0


# --- the runner, with real threads ---------------------------------------------------------


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_burst_of_changes_is_coalesced_while_a_sync_runs(loop: SyncLoop) -> None:
    gate = threading.Event()
    real_apply = fake(loop).apply

    def slow_apply(state: NodeState, full: bool = False) -> int:
        gate.wait(5)
        return real_apply(state, full)

    loop.dataplane.apply = slow_apply  # type: ignore[method-assign]
    loop.store.mark_synced("test")
    loop.start()
    try:
        wait_for(lambda: fake(loop).attempts == 0 and loop.runner.runs == 0)
        for i in range(100):  # arrives while the first apply is blocked
            loop.store.upsert(web_slice("10.244.2.5", f"10.244.3.{i + 1}"))
        gate.set()
        wait_for(
            lambda: fake(loop).held_revision == loop.compiler.update(loop.store.state).revision
        )
        assert len(fake(loop).applied) <= 3
    finally:
        gate.set()
        loop.stop()


def test_stop_waits_for_the_apply_in_flight_and_starts_no_other(
    loop: SyncLoop, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM during an apply: the dataplane closes its descriptors after stop returns,
    so stop must return only once the apply did, however long it takes."""
    applying, finished = threading.Event(), threading.Event()
    real_apply = fake(loop).apply
    calls_after_stop: list[str] = []
    stopped = threading.Event()

    def slow_apply(state: NodeState, full: bool = False) -> int:
        if stopped.is_set():
            calls_after_stop.append(state.revision)
        applying.set()
        time.sleep(1.5)
        writes = real_apply(state, full)
        finished.set()
        return writes

    loop.dataplane.apply = slow_apply  # type: ignore[method-assign]
    loop.store.mark_synced("test")
    loop.start()
    assert applying.wait(5)
    loop.store.upsert(web_slice("10.244.2.5", "10.244.3.1"))  # a change waits meanwhile
    caplog.set_level("INFO", logger="agent.sync.loop")
    started = time.monotonic()
    loop.stop()
    stopped.set()
    assert finished.is_set(), "stop returned while the apply was still writing"
    assert time.monotonic() - started >= 1.0
    [line] = [r.getMessage() for r in caplog.records if "in flight" in r.getMessage()]
    assert line.startswith("stopping: waiting for the apply of revision sha256:"), line
    time.sleep(0.2)
    assert calls_after_stop == [] and len(fake(loop).applied) == 1


def test_the_runner_respects_the_minimum_interval() -> None:
    times: list[float] = []
    runner = BoundedFrequencyRunner("t", lambda periodic: times.append(time.monotonic()), 0.2, 60)
    runner.start()
    try:
        for _ in range(5):
            runner.run()
            time.sleep(0.05)
        wait_for(lambda: len(times) >= 2)
        assert times[1] - times[0] >= 0.19
    finally:
        runner.stop()


def test_the_runner_runs_periodically_without_requests() -> None:
    calls: list[bool] = []
    runner = BoundedFrequencyRunner("t", calls.append, 0, 0.1)
    runner.start()
    try:
        wait_for(lambda: len(calls) >= 2)
        assert calls[:2] == [True, True]
    finally:
        runner.stop()


def test_the_runner_survives_an_exception_and_retries() -> None:
    calls: list[bool] = []

    def flaky(periodic: bool) -> None:
        calls.append(periodic)
        if len(calls) == 1:
            raise RuntimeError("first run fails")

    runner = BoundedFrequencyRunner("t", flaky, 0, 60)
    runner.start()
    try:
        runner.run()
        wait_for(lambda: len(calls) >= 2, timeout=5)
    finally:
        runner.stop()


@pytest.mark.parametrize(
    ("mutate", "eligible"),
    [
        (lambda o: None, True),
        (lambda o: o["metadata"].update(deletionTimestamp="2026-11-21T10:00:00Z"), False),
        (
            lambda o: o.update(
                spec={"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}
            ),
            False,
        ),
    ],
    ids=[
        "a plain node is eligible",
        "a node being deleted is not",
        "a node the autoscaler drains is not",
    ],
)
def test_node_eligibility_reaches_the_status(
    loop: SyncLoop, mutate: Callable[[Obj], None], eligible: bool
) -> None:
    node = default_nodes()[0]
    mutate(node)
    loop.store.upsert(value(node))
    loop.store.mark_synced("test")
    loop.sync()
    assert loop.status.eligible is eligible  # type: ignore[union-attr]
