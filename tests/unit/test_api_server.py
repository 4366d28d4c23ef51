"""The local API over real HTTP: /metrics, /state, /proxyMode, /healthz, /livez, /readyz,
the AgentStatus health rules (with a fake clock) and the `serve` helper itself."""

from __future__ import annotations

import gzip
import json
import logging
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message

import pytest
import yaml

from agent.api import AgentStatus, HealthServer, MetricsServer, parse_bind, serve
from agent.api.serving import Request, Response, json_response
from agent.dataplane.fake import FakeDataplane
from agent.metrics import Metrics
from agent.model.compile import CompileOptions, compile
from agent.model.decode import decode_object
from agent.model.nodestate import NodeState
from agent.sync.loop import SyncLoop
from agent.sync.store import StateStore

from ..builders import Obj, default_nodes, make_endpoint, make_service, make_slice, state_of

SYNC_PERIOD = 30.0
T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


pytestmark = pytest.mark.usefixtures("no_thread_leak")  # tests/unit/conftest.py


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def status(clock: FakeClock) -> AgentStatus:
    return AgentStatus(dataplane="fake", clock=clock)


@pytest.fixture
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture
def metrics_server(status: AgentStatus, metrics: Metrics) -> Iterator[MetricsServer]:
    with MetricsServer("127.0.0.1:0", status, metrics) as server:
        yield server


@pytest.fixture
def health_server(status: AgentStatus) -> Iterator[HealthServer]:
    with HealthServer("127.0.0.1:0", status, SYNC_PERIOD) as server:
        yield server


def get(
    url: str, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, Message, bytes]:
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers, err.read()


def get_json(url: str) -> tuple[int, dict]:
    code, headers, body = get(url)
    assert headers["Content-Type"] == "application/json"
    return code, json.loads(body)


def web_state(*local_ips: str, remote: tuple[str, ...] = ("10.244.2.5",)) -> NodeState:
    """node-a's NodeState: Service default/web with endpoints on node-a and node-b."""
    endpoints = [make_endpoint(ip, "node-a") for ip in local_ips]
    endpoints += [make_endpoint(ip, "node-b") for ip in remote]
    cluster = state_of(
        *default_nodes(),
        make_service(name="web"),
        make_slice(name="web-1", service="web", endpoints=endpoints),
    )
    return compile(cluster, "node-a")


def synced(status: AgentStatus, clock: FakeClock, state: NodeState) -> None:
    """What the sync loop reports after applying `state` successfully."""
    status.set_node_state(state)
    status.record_sync(True, clock(), state.revision)


# --- /metrics ---------------------------------------------------------------------------

KUBE_PROXY_METRICS = [
    "kubeproxy_sync_proxy_rules_duration_seconds_bucket",
    "kubeproxy_sync_proxy_rules_duration_seconds_count",
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
    "kubeproxy_network_programming_duration_seconds_bucket",
    "kubeproxy_sync_proxy_rules_endpoint_changes_total",
    "kubeproxy_sync_proxy_rules_service_changes_total",
    'kubeproxy_sync_proxy_rules_no_local_endpoints_total{traffic_policy="internal"}',
]


def test_metrics_serves_kube_proxy_metric_names(
    metrics_server: MetricsServer, metrics: Metrics
) -> None:
    metrics.sync_duration.observe(0.004)
    metrics.sync_last_timestamp.set(T0)
    metrics.network_programming.observe(1.5)
    metrics.endpoint_changes.inc(3)
    metrics.no_local_endpoints.labels("internal").set(2)
    code, headers, body = get(metrics_server.url + "/metrics")
    assert code == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    text = body.decode()
    for name in KUBE_PROXY_METRICS:
        assert f"\n{name}" in text, name
    assert "kubeproxy_sync_proxy_rules_endpoint_changes_total 3.0" in text
    assert "kubeproxy_sync_proxy_rules_last_timestamp_seconds 1.8e+09" in text


def test_metrics_are_only_this_agents_registry(metrics_server: MetricsServer) -> None:
    _, _, body = get(metrics_server.url + "/metrics")
    assert b"python_gc_objects_collected_total" not in body  # the global default registry


def test_metrics_negotiates_openmetrics_and_gzip(metrics_server: MetricsServer) -> None:
    code, headers, body = get(
        metrics_server.url + "/metrics",
        {"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"},
    )
    assert code == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body).rstrip().endswith(b"# EOF")


# --- /state ------------------------------------------------------------------------------


def test_state_before_the_first_nodestate_is_503_with_the_status(
    metrics_server: MetricsServer,
) -> None:
    code, body = get_json(metrics_server.url + "/state")
    assert code == 503
    assert "waiting for the initial lists" in body["error"]
    assert body["status"]["ready"] is False


def test_state_is_the_nodestate_document_plus_held_revision_and_status(
    metrics_server: MetricsServer, status: AgentStatus, clock: FakeClock
) -> None:
    state = web_state("10.244.1.5")
    synced(status, clock, state)
    code, body = get_json(metrics_server.url + "/state")
    assert code == 200
    assert body["heldRevision"] == state.revision
    status_field = body.pop("status")
    assert body.pop("heldRevision") == state.revision
    assert body == state.to_dict()  # the NodeState document, as `compile -o json` prints it
    assert list(body) == ["apiVersion", "kind", "node", "revision", "services"]
    assert status_field["ready"] is True
    assert status_field["inSync"] is True
    assert status_field["dataplane"] == "fake"
    assert status_field["lastSuccessTime"] == "2027-01-15T08:00:00.000Z"
    assert status_field["pendingSince"] is None


def test_state_shows_a_revision_the_dataplane_does_not_hold_yet(
    metrics_server: MetricsServer, status: AgentStatus, clock: FakeClock
) -> None:
    old, new = web_state("10.244.1.5"), web_state("10.244.1.5", "10.244.1.6")
    synced(status, clock, old)
    _, first = get_json(metrics_server.url + "/state")
    clock.advance(5)
    status.set_node_state(new)
    _, body = get_json(metrics_server.url + "/state")
    assert body["revision"] == new.revision != body["heldRevision"] == old.revision
    assert body["services"] == new.to_dict()["services"] != first["services"]
    assert body["status"]["inSync"] is False
    assert body["status"]["pendingSince"] == "2027-01-15T08:00:05.000Z"


def test_state_as_yaml(
    metrics_server: MetricsServer, status: AgentStatus, clock: FakeClock
) -> None:
    state = web_state("10.244.1.5")
    synced(status, clock, state)
    code, headers, body = get(metrics_server.url + "/state?output=yaml")
    assert code == 200
    assert headers["Content-Type"].startswith("application/yaml")
    document = yaml.safe_load(body)
    assert document.pop("heldRevision") == state.revision
    assert document.pop("status")["inSync"] is True
    assert document == state.to_dict()


def test_state_rejects_an_unknown_output(
    metrics_server: MetricsServer, status: AgentStatus, clock: FakeClock
) -> None:
    synced(status, clock, web_state())
    code, body = get_json(metrics_server.url + "/state?output=table")
    assert code == 400
    assert "json or yaml" in body["error"]


def test_proxy_mode_names_the_dataplane(metrics_server: MetricsServer) -> None:
    assert get(metrics_server.url + "/proxyMode")[::2] == (200, b"fake")


# --- /healthz, /livez, /readyz -----------------------------------------------------------


def health(server: HealthServer, path: str = "/healthz") -> tuple[int, dict]:
    return get_json(server.url + path)


def test_healthy_and_not_ready_before_the_first_nodestate(health_server: HealthServer) -> None:
    """kube-proxy answers 200 until its first update is queued; not ready until programmed."""
    code, body = health(health_server)
    assert code == 200
    assert body["nodeEligible"] is True
    assert body["lastSuccessfulSync"] is None
    assert health(health_server, "/livez")[0] == 200
    code, body = health(health_server, "/readyz")
    assert code == 503
    assert body == {
        "ready": False,
        "firstProgrammedTime": None,
        "heldRevision": None,
        "apiReachable": None,
        "reason": "not yet programmed from the cluster's state: waiting for the initial lists",
    }


def test_a_restarted_agent_serves_what_the_kernel_holds_and_is_not_ready_until_it_synced(
    health_server: HealthServer, metrics_server: MetricsServer, status: AgentStatus,
    clock: FakeClock,
) -> None:  # fmt: skip
    """The kernel holds an earlier agent's revision and the API server is unreachable:
    /state and /readyz say both; ready only once this agent applied the cluster's state."""
    held = web_state()
    status.set_adopted(held.revision)
    status.set_api_reachable(False)
    code, body = health(health_server, "/readyz")
    assert code == 503
    assert body["heldRevision"] == held.revision
    assert body["apiReachable"] is False
    assert f"the kernel keeps serving revision {held.revision}" in body["reason"]
    assert health(health_server, "/livez")[0] == 200  # not a reason to restart the agent
    code, body = get_json(metrics_server.url + "/state")
    assert code == 503
    assert body["heldRevision"] == held.revision
    assert body["status"]["adoptedRevision"] == held.revision
    assert body["status"]["apiReachable"] is False
    assert body["status"]["ready"] is False
    status.set_api_reachable(True)
    synced(status, clock, held)  # the cluster did not change: the same revision, applied
    assert health(health_server, "/readyz")[0] == 200


def test_healthy_after_a_recent_sync_with_the_current_revision_held(
    health_server: HealthServer, status: AgentStatus, clock: FakeClock
) -> None:
    synced(status, clock, web_state())
    clock.advance(2 * SYNC_PERIOD)  # still within the limit
    code, body = health(health_server)
    assert code == 200
    # kube-proxy's fields: lastUpdated is "now" while healthy (kube-proxy's compatibility)
    assert body["lastUpdated"] == body["currentTime"] == "2027-01-15T08:01:00.000Z"
    assert body["nodeEligible"] is True
    assert body["lastSuccessfulSync"] == "2027-01-15T08:00:00.000Z"
    assert "reason" not in body
    code, body = health(health_server, "/livez")
    assert code == 200
    assert "nodeEligible" not in body  # kube-proxy's /livez body has no nodeEligible


def test_unhealthy_when_the_last_success_is_older_than_twice_the_sync_period(
    health_server: HealthServer, status: AgentStatus, clock: FakeClock
) -> None:
    synced(status, clock, web_state())
    clock.advance(2 * SYNC_PERIOD + 1)
    for path in ("/healthz", "/livez"):
        code, body = health(health_server, path)
        assert code == 503, path
        assert body["lastUpdated"] == "2027-01-15T08:00:00.000Z"  # the real last update
        assert "last successful sync 61.0s ago (limit 60s)" in body["reason"]
    assert health(health_server, "/readyz")[0] == 200  # readiness stays once programmed


def test_unhealthy_when_a_new_revision_waits_too_long_to_be_programmed(
    health_server: HealthServer, status: AgentStatus, clock: FakeClock
) -> None:
    old, new = web_state(), web_state("10.244.1.5")
    synced(status, clock, old)
    clock.advance(10)
    status.set_node_state(new)  # computed, not applied yet
    clock.advance(SYNC_PERIOD)
    status.record_sync(False, clock(), old.revision)  # a failed apply keeps the old state
    assert health(health_server)[0] == 200  # pending, but not late yet
    clock.advance(SYNC_PERIOD + 1)
    code, body = health(health_server)
    assert code == 503
    assert f"revision {new.revision} has waited 61.0s" in body["reason"]
    assert f"the dataplane holds {old.revision}" in body["reason"]
    status.record_sync(True, clock(), new.revision)
    assert health(health_server)[0] == 200


def test_a_pending_revision_is_late_even_while_syncs_succeed(
    health_server: HealthServer, status: AgentStatus, clock: FakeClock
) -> None:
    """The held revision must catch up: recent successes that leave it behind don't count."""
    old, new = web_state(), web_state("10.244.1.5")
    synced(status, clock, old)
    status.set_node_state(new)
    clock.advance(25)
    status.record_sync(True, clock(), old.revision)  # e.g. the dataplane lost the change
    clock.advance(25)
    assert health(health_server)[0] == 200
    clock.advance(11)
    status.record_sync(True, clock(), old.revision)
    code, body = health(health_server)
    assert code == 503
    assert f"revision {new.revision} has waited 61.0s" in body["reason"]


def test_a_newer_revision_waits_from_when_it_arrived(
    health_server: HealthServer, status: AgentStatus, clock: FakeClock
) -> None:
    """A sync that programs revision B while C arrives restarts the wait at C's arrival."""
    a, b, c = web_state(), web_state("10.244.1.5"), web_state("10.244.1.5", "10.244.1.6")
    synced(status, clock, a)
    status.set_node_state(b)
    clock.advance(50)
    status.set_node_state(c)  # arrives while B is being applied
    clock.advance(1)
    status.record_sync(True, clock(), b.revision)
    clock.advance(2 * SYNC_PERIOD - 1)
    assert health(health_server)[0] == 200  # C has waited 60 s
    assert status.snapshot().pending_since == T0 + 50
    clock.advance(1)
    assert health(health_server)[0] == 503


def test_a_failed_sync_is_tolerated_until_the_limit(
    health_server: HealthServer, status: AgentStatus, clock: FakeClock
) -> None:
    state = web_state()
    synced(status, clock, state)
    clock.advance(5)
    status.record_sync(False, clock(), state.revision, error="injected")
    assert health(health_server)[0] == 200
    clock.advance(2 * SYNC_PERIOD)
    status.record_sync(False, clock(), state.revision, error="injected")
    code, body = health(health_server)
    assert code == 503
    assert body["reason"].endswith("last error: injected")


def test_before_the_first_success_a_computed_state_has_the_same_deadline(
    health_server: HealthServer, status: AgentStatus, clock: FakeClock
) -> None:
    status.set_node_state(web_state())
    clock.advance(2 * SYNC_PERIOD)
    assert health(health_server)[0] == 200
    clock.advance(1)
    assert health(health_server)[0] == 503
    assert health(health_server, "/readyz")[0] == 503


def test_healthz_fails_while_the_node_is_not_eligible_and_livez_does_not(
    health_server: HealthServer, status: AgentStatus, clock: FakeClock
) -> None:
    synced(status, clock, web_state())
    status.set_node_eligible(False)
    code, body = health(health_server)
    assert code == 503
    assert body["nodeEligible"] is False
    assert "not eligible" in body["reason"]
    assert health(health_server, "/livez")[0] == 200
    assert health_server.is_healthy()  # what healthCheckNodePort servers report


def test_an_unreachable_api_server_is_reported_not_fatal(
    health_server: HealthServer, metrics_server: MetricsServer, status: AgentStatus,
    clock: FakeClock,
) -> None:  # fmt: skip
    synced(status, clock, web_state())
    status.set_api_reachable(False)
    code, body = health(health_server)
    assert code == 200
    assert body["apiReachable"] is False
    assert get_json(metrics_server.url + "/state")[1]["status"]["apiReachable"] is False


def test_readyz_turns_200_when_the_first_full_state_is_programmed(
    health_server: HealthServer, status: AgentStatus, clock: FakeClock
) -> None:
    state = web_state()
    status.set_node_state(state)
    status.record_sync(False, clock(), None, error="injected")
    assert health(health_server, "/readyz")[0] == 503
    clock.advance(1)
    status.record_sync(True, clock(), state.revision)
    code, body = health(health_server, "/readyz")
    assert code == 200
    assert body == {
        "ready": True,
        "firstProgrammedTime": "2027-01-15T08:00:01.000Z",
        "heldRevision": state.revision,
        "apiReachable": None,
    }


def test_health_server_rejects_a_non_positive_sync_period(status: AgentStatus) -> None:
    with pytest.raises(ValueError, match="sync_period"):
        HealthServer("127.0.0.1:0", status, 0)


def value(obj: Obj):
    decoded = decode_object(obj)
    assert decoded.value is not None, decoded.error
    return decoded.value


def test_the_sync_loop_reports_through_agent_status(
    health_server: HealthServer, metrics_server: MetricsServer, status: AgentStatus,
    clock: FakeClock, metrics: Metrics,
) -> None:  # fmt: skip
    """The real SyncLoop (run by hand, no thread) with AgentStatus as its status sink."""
    store = StateStore()
    store.register_source("test")
    for obj in [*default_nodes(), make_service(name="web")]:
        store.upsert(value(obj))
    dataplane = FakeDataplane()
    loop = SyncLoop(
        store, "node-a", CompileOptions(), dataplane, metrics, status=status, wall_clock=clock
    )
    assert loop.sync() is False  # the initial list is not complete
    assert health(health_server, "/readyz")[0] == 503
    store.mark_synced("test")
    assert loop.sync() is True
    assert health(health_server, "/readyz")[0] == 200
    assert health(health_server)[0] == 200
    code, body = get_json(metrics_server.url + "/state")
    assert body["revision"] == body["heldRevision"] == dataplane.held_revision
    dataplane.fail_next = 10
    store.upsert(
        value(
            make_slice(
                name="web-1", service="web", endpoints=[make_endpoint("10.244.2.9", "node-b")]
            )
        )
    )
    assert loop.sync() is False
    clock.advance(2 * SYNC_PERIOD + 1)
    code, body = health(health_server)
    assert code == 503
    assert "to be programmed" in body["reason"]
    _, _, text = get(metrics_server.url + "/metrics")
    assert b'kbp_sync_errors_total{reason="injected"} 1.0' in text


# --- serve() -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bind", "expected"),
    [
        ("127.0.0.1:10249", ("127.0.0.1", 10249)),
        ("0.0.0.0:0", ("0.0.0.0", 0)),
        ("[::1]:10249", ("::1", 10249)),
        ("[::]:10256", ("::", 10256)),
        (":10256", ("", 10256)),
        ("localhost:8080", ("localhost", 8080)),
    ],
)
def test_parse_bind(bind: str, expected: tuple[str, int]) -> None:
    assert parse_bind(bind) == expected


@pytest.mark.parametrize(
    ("bind", "message"),
    [
        ("127.0.0.1", "HOST:PORT"),
        ("::1:10249", r"\[ADDRESS\]:PORT"),
        ("[::1]10249", r"\[IPv6\]:PORT"),
        ("[127.0.0.1]:80", "not an IPv6 address"),
        ("127.0.0.1:65536", "0 to 65535"),
        ("127.0.0.1:http", "0 to 65535"),
        ("127.0.0.1:", "0 to 65535"),
    ],
)
def test_parse_bind_rejects(bind: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_bind(bind)


def echo(request: Request) -> Response:
    return json_response(200, {"path": request.path, "q": request.param("q")})


def test_serve_routes_404_405_head_and_quiet_logging(
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    caplog.set_level(logging.DEBUG, logger="agent.api")
    with serve("127.0.0.1:0", {"/echo": echo}) as server:
        assert server.port != 0
        assert server.address == f"127.0.0.1:{server.port}"
        assert get_json(server.url + "/echo?q=1") == (200, {"path": "/echo", "q": "1"})
        code, body = get_json(server.url + "/nope")
        assert (code, body["paths"]) == (404, ["/echo"])
        code, headers, _ = get(server.url + "/echo", method="POST")
        assert (code, headers["Allow"]) == (405, "GET, HEAD")
        code, headers, body = get(server.url + "/echo", method="HEAD")
        assert (code, body) == (200, b"")
        assert int(headers["Content-Length"]) > 0
        assert headers["X-Content-Type-Options"] == "nosniff"
    assert capsys.readouterr().err == ""
    logged = [r for r in caplog.records if '"GET /echo?q=1 HTTP/1.1" 200' in r.getMessage()]
    assert logged and logged[0].levelno == logging.DEBUG


def test_a_failing_handler_answers_500_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    def broken(request: Request) -> Response:
        raise RuntimeError("boom")

    with serve("127.0.0.1:0", {"/broken": broken}) as server:
        code, body = get_json(server.url + "/broken")
    assert (code, body) == (500, {"error": "RuntimeError: boom"})
    assert any("/broken failed" in r.getMessage() for r in caplog.records)


def test_serve_on_ipv6_loopback() -> None:
    try:
        server = serve("[::1]:0", {"/echo": echo})
    except OSError as err:
        pytest.skip(f"no IPv6 loopback here: {err}")
    with server:
        assert server.url == f"http://[::1]:{server.port}"
        assert get_json(server.url + "/echo")[0] == 200


def test_an_empty_host_serves_both_families() -> None:
    with serve(":0", {"/echo": echo}) as server:
        assert get_json(f"http://127.0.0.1:{server.port}/echo")[0] == 200
        if server.host == "::":
            try:
                code = get_json(f"http://[::1]:{server.port}/echo")[0]
            except urllib.error.URLError:
                code = None  # no IPv6 loopback address configured
            assert code in (200, None)


def test_a_busy_address_raises_oserror() -> None:
    with serve("127.0.0.1:0", {}) as server, pytest.raises(OSError):
        serve(f"127.0.0.1:{server.port}", {})


def test_close_is_prompt_idempotent_and_frees_the_port() -> None:
    server = serve("127.0.0.1:0", {"/echo": echo})
    silent = socket.create_connection(("127.0.0.1", server.port))  # connects, never asks
    try:
        time.sleep(0.05)  # let the server accept it and start waiting for a request
        started = time.monotonic()
        server.close()
        assert time.monotonic() - started < 1.0
        server.close()
        assert server.closed
    finally:
        silent.close()
    with serve(f"127.0.0.1:{server.port}", {}):  # the port can be bound again at once
        pass


class Integrity:
    """What a dataplane's keeper reports: problems it could not repair, and for how long."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.seconds: float | None = None

    def __call__(self) -> tuple[list[str], float | None]:
        return self.problems, self.seconds


def test_readyz_is_503_while_the_datapath_cannot_be_repaired_and_healthz_after_a_minute(
    clock: FakeClock,
) -> None:
    integrity = Integrity()
    status = AgentStatus(dataplane="fake", clock=clock, integrity=integrity)
    with HealthServer("127.0.0.1:0", status, SYNC_PERIOD) as server:
        state = web_state()
        synced(status, clock, state)
        assert health(server, "/readyz")[0] == 200
        integrity.problems, integrity.seconds = ["vethkbp1: kbp_from_pod missing on ingress"], 0.0
        code, body = health(server, "/readyz")
        assert code == 503 and "kbp_from_pod missing" in body["reason"], body
        assert health(server)[0] == 200  # kube-proxy's health: within the limit
        integrity.seconds = 60.5  # the keeper has failed to repair for a minute
        for path in ("/healthz", "/livez"):
            code, body = health(server, path)
            assert code == 503 and "could not be repaired" in body["reason"], body
        integrity.problems, integrity.seconds = [], None  # repaired
        assert health(server, "/readyz")[0] == 200
        assert health(server)[0] == 200


def test_readyz_is_503_while_the_state_does_not_fit_the_maps(
    health_server: HealthServer, status: AgentStatus, clock: FakeClock
) -> None:
    old, new = web_state(), web_state("10.244.1.9")
    synced(status, clock, old)
    status.set_node_state(new)
    status.record_sync(False, clock(), old.revision, error="capacity: kbp_slots_v4 is full",
                       reason="capacity")  # fmt: skip
    code, body = health(health_server, "/readyz")
    assert code == 503 and "kbp_slots_v4 is full" in body["reason"], body
    status.record_sync(False, clock(), old.revision, error="map_write: EIO", reason="map_write")
    assert health(health_server, "/readyz")[0] == 200  # retried: not a refusal of the state
    status.record_sync(False, clock(), old.revision, error="capacity: full", reason="capacity")
    status.record_sync(True, clock(), new.revision)
    assert health(health_server, "/readyz")[0] == 200
