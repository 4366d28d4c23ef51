"""The API source through the sync loop to a dataplane, against kmock over HTTP: what a
cluster does reaches the (fake) kernel, no-op updates write nothing, nothing is
applied before the initial lists, an outage keeps the programmed state."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import kmock
import pytest

from agent.dataplane.fake import FakeDataplane
from agent.model.compile import CompileOptions
from agent.sync.loop import SyncLoop
from tests.builders import make_endpoint, make_node, make_service, make_slice

from .conftest import NODE, NODES, SERVICES, Harness, wait_for

LIST = kmock.action.LIST


@pytest.fixture
def running(kmock_api, make_harness) -> Iterator[tuple[Harness, SyncLoop, FakeDataplane]]:
    kmock_api.create(
        make_service(name="web"),
        make_slice(name="web-1", service="web", endpoints=[make_endpoint("10.244.1.5", NODE)]),
        make_node(NODE, {"topology.kubernetes.io/zone": "zone-1"}, "192.0.2.10"),
    )
    harness = make_harness()
    dataplane = FakeDataplane()
    loop = SyncLoop(harness.store, NODE, CompileOptions(), dataplane, harness.metrics)
    loop.start()
    harness.start()
    try:
        yield harness, loop, dataplane
    finally:
        loop.stop()


def backends(dataplane: FakeDataplane, name: str) -> list[str] | None:
    held = dataplane.held
    if held is None:
        return None
    for entry in held.services:
        if entry.name == name:
            return [b.ip for b in entry.cluster_backends or ()]
    return None


def test_changes_in_the_cluster_reach_the_dataplane(kmock_api, running) -> None:
    _, _, dataplane = running
    wait_for(lambda: backends(dataplane, "web") == ["10.244.1.5"], "the initial state")
    kmock_api.create(
        make_slice(name="web-2", service="web", endpoints=[make_endpoint("10.244.2.5", "node-b")])
    )
    wait_for(lambda: backends(dataplane, "web") == ["10.244.1.5", "10.244.2.5"], "an added slice")
    kmock_api.patch(
        "EndpointSlice", "default", "web-2",
        {"endpoints": [make_endpoint("10.244.2.5", "node-b", ready=False)]},
    )  # fmt: skip
    wait_for(lambda: backends(dataplane, "web") == ["10.244.1.5"], "an endpoint turning unready")
    kmock_api.delete("Service", "default", "web")
    wait_for(lambda: backends(dataplane, "web") is None, "the Service's removal")


def test_no_op_updates_write_nothing(kmock_api, running) -> None:
    harness, _, dataplane = running
    wait_for(lambda: backends(dataplane, "web") == ["10.244.1.5"], "the initial state")
    applies, writes = len(dataplane.applied), dataplane.writes
    events = harness.events(SERVICES, "MODIFIED")
    for i in range(5):
        kmock_api.patch("Service", "default", "web", {"metadata": {"annotations": {"n": str(i)}}})
    wait_for(lambda: harness.events(SERVICES, "MODIFIED") >= events + 5, "the five events")
    # A real change afterwards: once it is applied, any sync the no-ops caused has run.
    kmock_api.patch(
        "EndpointSlice", "default", "web-1",
        {"endpoints": [make_endpoint("10.244.1.5", NODE), make_endpoint("10.244.1.6", NODE)]},
    )  # fmt: skip
    wait_for(lambda: backends(dataplane, "web") == ["10.244.1.5", "10.244.1.6"], "a real change")
    assert len(dataplane.applied) == applies + 1  # only the real change was applied
    assert dataplane.writes == writes + 1


def test_nothing_is_applied_before_every_initial_list(kmock_api, make_harness) -> None:
    kmock_api.create(make_service(name="web"), make_node(NODE, {}, "192.0.2.10"))
    gate = threading.Event()
    gate.set()
    kmock_api.fail_while(LIST, NODES, gate, 503)
    harness = make_harness()
    dataplane = FakeDataplane()
    loop = SyncLoop(harness.store, NODE, CompileOptions(), dataplane, harness.metrics)
    loop.start()
    harness.start(wait=False)
    try:
        wait_for(lambda: harness.store.services() == {"default/web"}, "the Services list")
        wait_for(lambda: len(kmock_api.requests(LIST, NODES)) >= 2, "a retried Node list")
        loop.runner.run()
        assert dataplane.attempts == 0
        gate.clear()
        wait_for(lambda: dataplane.held is not None, "the first apply after the Node list")
    finally:
        loop.stop()


def test_an_outage_keeps_the_programmed_state(kmock_api, running) -> None:
    harness, loop, dataplane = running
    wait_for(lambda: backends(dataplane, "web") == ["10.244.1.5"], "the initial state")
    held = dataplane.held_revision
    kmock_api.stop()
    wait_for(lambda: harness.api_up(SERVICES) == 0, "the outage")
    loop.sync(periodic=True)  # a resync during the outage keeps everything
    assert dataplane.held_revision == held
    kmock_api.start()
    wait_for(lambda: harness.api_up(SERVICES) == 1, "the reconnection")
    loop.sync(periodic=True)
    assert dataplane.held_revision == held  # nothing changed meanwhile: same revision
