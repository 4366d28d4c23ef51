"""A frozen or silent API server is noticed, reported and reconnected to: every request
is bounded and tried once, a quiet watch gets a liveness probe, and a probe without an
answer reports the API unreachable and cuts the watches, which resume from their
resourceVersion when the server answers again.

The servers: kmock behind `FreezableRelay` (a relay that stops every byte while frozen,
as a stopped API server does) and `SilentServer` (accepts and never answers), both on
loopback. Thresholds are a fraction of a second here; the product's defaults (30 s
idle, 15 s per request) report a frozen server within 45 s.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import kmock
import pytest
import yaml
from kubernetes import client

from agent.config import Settings, settings_from
from agent.daemon import Agent
from agent.k8s import KubernetesSource, make_client
from agent.metrics import Metrics
from agent.sync.store import StateStore
from tests.builders import make_endpoint, make_node, make_service, make_slice

from .conftest import (
    NODE,
    NODES,
    SERVICES,
    SLICES,
    FreezableRelay,
    KmockApi,
    SilentServer,
    wait_for,
)

LIST = kmock.action.LIST
WATCH = kmock.action.WATCH
IDLE = 0.5  # seconds of silence before a probe
REQUEST = 0.5  # seconds a request or probe may take
# The bound a test waits for the report: the design's IDLE + REQUEST, with room for a
# loaded two-core machine.
REPORTED_WITHIN = 15.0


def seed(api: KmockApi) -> None:
    api.create(
        make_service(name="web"),
        make_slice(name="web-1", service="web", endpoints=[make_endpoint("10.244.1.5", NODE)]),
        make_node(NODE, {}, "192.0.2.10"),
    )


def client_for(url: str) -> client.ApiClient:
    configuration = client.Configuration()
    configuration.host = url
    return make_client(configuration)


@pytest.fixture
def relay(kmock_api: KmockApi) -> Iterator[FreezableRelay]:
    relay = FreezableRelay(kmock_api.port)  # type: ignore[arg-type]
    try:
        yield relay
    finally:
        relay.close()


def probes(api: KmockApi) -> int:
    return sum(1 for r in list(api.emulator) if r.url.path.rstrip("/") == "/version")


def test_a_frozen_server_is_reported_within_the_bound_and_watches_resume(
    kmock_api, relay, make_harness, caplog
):
    seed(kmock_api)
    reachability: list[bool] = []
    api = client_for(relay.url)
    harness = make_harness(
        api=api, idle_timeout=IDLE, request_timeout=REQUEST, on_reachability=reachability.append
    ).start()
    wait_for(lambda: reachability == [True], "the API to be reported reachable")
    lists = {r: len(kmock_api.requests(LIST, r)) for r in (SERVICES, SLICES, NODES)}

    relay.freeze()
    wait_for(lambda: reachability == [True, False], "the report", timeout=REPORTED_WITHIN)
    # Silence told it: the probe of the quiet watches (or, for a watch that happened to
    # be reconnecting, its request) got no answer.
    assert re.search(r"no answer to a (liveness probe|watch request) within 0\.5 s", caplog.text)
    for resource in (SERVICES, SLICES, NODES):
        wait_for(lambda r=resource: harness.api_up(r) == 0, f"{resource} down")
    # Missed while frozen: a kmock watch replays every object when it starts again.
    kmock_api.create(make_service(name="late"))
    # Reconnecting keeps trying, each attempt bounded, and keeps the state.
    wait_for(lambda: "no answer to a watch request within 0.5 s" in caplog.text, "a retry")
    assert harness.store.services() == {"default/web"}

    relay.thaw()
    wait_for(lambda: reachability == [True, False, True], "the recovery")
    wait_for(lambda: harness.store.services() == {"default/web", "default/late"}, "the change")
    # Resumed from the resourceVersion, not relisted.
    assert {r: len(kmock_api.requests(LIST, r)) for r in (SERVICES, SLICES, NODES)} == lists
    assert "resuming from resourceVersion" in caplog.text
    api.close()


def test_a_quiet_watch_that_the_server_still_answers_for_stays_open(kmock_api, make_harness):
    seed(kmock_api)
    harness = make_harness(idle_timeout=0.2, request_timeout=REQUEST).start()
    watches = {r: len(kmock_api.requests(WATCH, r)) for r in (SERVICES, SLICES, NODES)}
    wait_for(lambda: probes(kmock_api) >= 8, "eight probes (kmock answers 404: alive)")
    assert {r: len(kmock_api.requests(WATCH, r)) for r in (SERVICES, SLICES, NODES)} == watches
    assert harness.source.up == {"services": True, "endpointslices": True, "nodes": True}


def test_a_server_that_accepts_and_never_answers_then_comes_back(kmock_api, make_harness, caplog):
    """Requests end at their timeout and are tried again (the client library alone
    would have retried each three more times); the API is reported unreachable from the
    first timeout, and reachable only once a real server takes the port."""
    seed(kmock_api)
    silent = SilentServer()
    reachability: list[bool] = []
    api = client_for(f"http://127.0.0.1:{silent.port}")
    try:
        harness = make_harness(
            api=api,
            idle_timeout=IDLE,
            request_timeout=REQUEST,
            on_reachability=reachability.append,
        ).start(wait=False)
        wait_for(lambda: silent.accepted >= 6, "two bounded attempts per resource")
        wait_for(lambda: caplog.text.count("read timed out") >= 6, "six timeouts logged")
        assert not harness.store.synced
        assert reachability == [False]  # once, at the first failure, not per attempt
        assert harness.source.up == {"services": False, "endpointslices": False, "nodes": False}
    finally:
        silent.close()
    kmock_api.stop()
    kmock_api.port = silent.port
    kmock_api.start()  # the real server comes back where the silent one was
    wait_for(lambda: harness.store.synced, "the initial lists")
    wait_for(lambda: reachability == [False, True], "the API to be reported reachable")
    assert harness.store.services() == {"default/web"}
    api.close()


def test_the_client_must_not_retry_on_its_own(kmock_api):
    configuration = client.Configuration()
    configuration.host = kmock_api.url
    with (
        client.ApiClient(configuration) as api,
        pytest.raises(ValueError, match="make_client"),
    ):
        KubernetesSource(api, StateStore(), Metrics(), NODE, None)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_agent_reports_a_frozen_server_in_its_health_body(
    kmock_api, relay, tmp_path: Path, monkeypatch
):
    """The settings reach the source and the report reaches /healthz's `apiReachable`
    (and /state's): the agent as `run` starts it, with a kubeconfig, dataplane none."""
    seed(kmock_api)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": relay.url}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    health = f"127.0.0.1:{free_port()}"
    argv = {
        "kubeconfig": str(kubeconfig),
        "node": NODE,
        "dataplane": "none",
        "metrics_bind_address": "127.0.0.1:0",
        "healthz_bind_address": health,
        "api_idle_timeout": "1s",
        "api_request_timeout": "1s",
    }
    settings = settings_from(argparse.Namespace(**argv), list(argv), environ={})
    agent = Agent(settings)
    try:
        agent.start()

        def api_reachable() -> object:
            try:
                with urllib.request.urlopen(f"http://{health}/livez", timeout=2) as response:
                    return json.load(response).get("apiReachable")
            except urllib.error.HTTPError as err:
                return json.load(err).get("apiReachable")

        wait_for(lambda: api_reachable() is True, "reachable", timeout=REPORTED_WITHIN)
        relay.freeze()
        wait_for(lambda: api_reachable() is False, "the report", timeout=REPORTED_WITHIN)
        relay.thaw()
        wait_for(lambda: api_reachable() is True, "the recovery", timeout=REPORTED_WITHIN)
    finally:
        agent.stop()


def test_the_default_thresholds_report_a_frozen_server_within_a_minute():
    """Worst case: silence for the idle timeout, a probe that waits the request timeout,
    and the liveness thread's one-second tick; the same for a request in flight."""
    defaults = inspect.signature(KubernetesSource).parameters
    idle, request = defaults["idle_timeout"].default, defaults["request_timeout"].default
    assert idle + request + 1 <= 60
    settings = Settings()
    assert (settings.api_idle_timeout, settings.api_request_timeout) == (idle, request)
    assert defaults["read_timeout"].default > 60  # above the API server's bookmark interval
