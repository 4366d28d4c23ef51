"""Other nodes' labels cost the API server only what topology keys need (issue 20): this
node's Node by a field selector; other nodes through metadata-only watches, one per
topology key in use, selected by this node's value, started with the first Service that
uses the key and stopped with the last. Against the emulator in tests/api/emulator.py,
which honours selectors, resourceVersions and PartialObjectMetadata as the API server.

Address plan: node-a (this node, rack r1, zone z1), node-b (r1, z2), node-c (r2, z1),
node-d (no rack). Endpoints 10.244.<node>.x: 1 on node-a, 2 on node-b, 3 on node-c.
"""

from __future__ import annotations

import sys
from typing import Any

import kmock
import pytest

from agent.model.compile import CompileOptions, Compiler, compile
from tests.builders import make_endpoint, make_node, make_service, make_slice

from .conftest import NODE, NODES, SERVICES, Harness, KmockApi, status_event, wait_for

compile_module = sys.modules["agent.model.compile"]  # (agent.model.compile is the function)
LIST = kmock.action.LIST
WATCH = kmock.action.WATCH
RACK = "example.com/rack"
ZONE = "topology.kubernetes.io/zone"
KEYS = "kube-bpf-proxy.io/topology-keys"


def cluster(api: KmockApi) -> None:
    api.create(
        make_node(NODE, {RACK: "r1", ZONE: "z1"}, "192.0.2.10"),
        make_node("node-b", {RACK: "r1", ZONE: "z2"}, "192.0.2.11"),
        make_node("node-c", {RACK: "r2", ZONE: "z1"}, "192.0.2.12"),
        make_node("node-d", {ZONE: "z3"}, "192.0.2.13"),
        make_service(name="plain"),
        make_slice(name="plain-1", service="plain", endpoints=endpoints()),
    )


def endpoints() -> list[dict[str, Any]]:
    return [
        make_endpoint("10.244.2.5", "node-b"),
        make_endpoint("10.244.3.5", "node-c"),
    ]


def keyed(name: str, keys: str, ip: str = "10.96.0.7") -> dict[str, Any]:
    def mutate(obj: dict[str, Any]) -> None:
        obj["metadata"]["annotations"] = {KEYS: keys}
        obj["spec"]["clusterIP"] = ip
        obj["spec"]["clusterIPs"] = [ip]

    return make_service(name=name, mutate=mutate)


def is_metadata(request: kmock.Request) -> bool:
    return "PartialObjectMetadata" in request.headers["Accept"]


def metadata_requests(api: KmockApi, action: kmock.action) -> list[kmock.Request]:
    return [r for r in api.requests(action, NODES) if is_metadata(r)]


def label_watches(harness: Harness) -> float:
    value = harness.metrics.registry.get_sample_value("kbp_node_label_watches")
    return value or 0.0


def backends(harness: Harness, name: str) -> tuple[list[str], str]:
    """The cluster backends (IPs) and topology of Service `name` as compiled now."""
    with harness.store.lock:
        state = compile(harness.store.state, NODE)
    (entry,) = [e for e in state.services if e.name == name]
    return [b.ip for b in entry.cluster_backends or ()], entry.topology


def other_nodes(harness: Harness) -> dict[str, dict[str, str]]:
    with harness.store.lock:
        return {n: dict(v.labels) for n, v in harness.store.state.nodes.items() if n != NODE}


def test_without_topology_keys_only_this_node_is_listed_and_watched(kmock_api, make_harness):
    cluster(kmock_api)
    harness = make_harness().start()
    # Churn on other nodes: status, labels, a new node.
    kmock_api.patch("Node", None, "node-b", {"status": {"conditions": [{"type": "Ready"}]}})
    kmock_api.patch("Node", None, "node-c", {"metadata": {"labels": {RACK: "r1"}}})
    kmock_api.create(make_node("node-e", {RACK: "r1"}, "192.0.2.14"))
    kmock_api.patch("Node", None, NODE, {"metadata": {"annotations": {"touched": "yes"}}})
    wait_for(lambda: harness.events(NODES, "MODIFIED") == 1, "this node's update")

    requests = kmock_api.requests(LIST, NODES) + kmock_api.requests(WATCH, NODES)
    assert len(requests) == 2
    assert all(r.params["fieldSelector"] == f"metadata.name={NODE}" for r in requests)
    assert metadata_requests(kmock_api, LIST) == []
    assert harness.store.nodes() == {NODE}
    assert harness.events(NODES, "LIST") == 1  # no other node crossed the wire
    assert harness.events(NODES, "ADDED") == 0
    assert label_watches(harness) == 0
    assert "node-labels" not in harness.source.up


def test_a_topology_keyed_service_starts_a_metadata_watch_of_its_group(kmock_api, make_harness):
    cluster(kmock_api)
    harness = make_harness().start()
    kmock_api.create(
        keyed("racked", f"{RACK},*"),
        make_slice(name="racked-1", service="racked", endpoints=endpoints()),
    )
    wait_for(lambda: other_nodes(harness) == {"node-b": {RACK: "r1"}}, "node-b's rack")
    # The NodeState is right once the labels (and the slice, on its own watch) are in:
    # node-b shares rack r1, node-c not.
    wait_for(lambda: backends(harness, "racked") == (["10.244.2.5"], RACK), "racked's set")
    assert backends(harness, "plain") == (["10.244.2.5", "10.244.3.5"], "None")

    (listed,) = metadata_requests(kmock_api, LIST)
    assert listed.params["labelSelector"] == f"{RACK}=r1"  # this node's rack, nothing else
    assert "fieldSelector" not in listed.params
    assert listed.headers["Accept"].startswith(
        "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
    )
    wait_for(lambda: len(metadata_requests(kmock_api, WATCH)) == 1, "the metadata watch")
    (watch,) = metadata_requests(kmock_api, WATCH)
    assert watch.params["labelSelector"] == f"{RACK}=r1"
    assert watch.params["resourceVersion"].isdigit()  # from where the list ended
    assert "as=PartialObjectMetadata;" in watch.headers["Accept"]
    assert label_watches(harness) == 1
    wait_for(lambda: harness.source.up.get("node-labels") is True, "the label watch up")
    received = harness.metrics.registry.get_sample_value(
        "kbp_api_bytes_received_total", {"resource": "node-labels"}
    )
    assert received is not None and received > 0

    # Nodes joining and leaving the group arrive through the watch; other labels never do.
    kmock_api.patch("Node", None, "node-c", {"metadata": {"labels": {RACK: "r1"}}})
    wait_for(lambda: "node-c" in other_nodes(harness), "node-c joining rack r1")
    assert backends(harness, "racked") == (["10.244.2.5", "10.244.3.5"], RACK)
    kmock_api.patch("Node", None, "node-b", {"metadata": {"labels": {RACK: "r7"}}})
    wait_for(lambda: other_nodes(harness) == {"node-c": {RACK: "r1"}}, "node-b leaving")
    assert backends(harness, "racked") == (["10.244.3.5"], RACK)
    kmock_api.patch("Node", None, "node-c", {"metadata": {"labels": {ZONE: "z9"}}})
    kmock_api.patch("Node", None, "node-c", {"status": {"conditions": [{"type": "Ready"}]}})
    wait_for(lambda: harness.events("node-labels", "MODIFIED") == 2, "the two updates")
    assert other_nodes(harness) == {"node-c": {RACK: "r1"}}


def test_removing_the_last_keyed_service_stops_the_watch(kmock_api, make_harness):
    cluster(kmock_api)
    kmock_api.create(keyed("racked", RACK), keyed("racked-too", f"{RACK},*", "10.96.0.8"))
    harness = make_harness().start()
    assert other_nodes(harness) == {"node-b": {RACK: "r1"}}  # listed before the first sync
    wait_for(
        lambda: kmock_api.emulator._buses[kmock.resource(NODES)].consumer_count == 2,
        "the own-node and the metadata watch",
    )

    kmock_api.delete("Service", "default", "racked")
    wait_for(lambda: harness.events(SERVICES, "DELETED") == 1, "the first deletion")
    assert label_watches(harness) == 1  # one Service still uses the key
    kmock_api.patch("Service", "default", "racked-too", {"metadata": {"annotations": {KEYS: "*"}}})
    wait_for(lambda: label_watches(harness) == 0, "the watch to stop")
    wait_for(
        lambda: kmock_api.emulator._buses[kmock.resource(NODES)].consumer_count == 1,
        "the metadata watch to close",
    )
    assert other_nodes(harness) == {}  # what it vouched for is gone with it
    assert "node-labels" not in harness.source.up
    assert len(metadata_requests(kmock_api, LIST)) == 1


@pytest.mark.parametrize("key", [ZONE, RACK])
def test_several_keys_make_one_watch_each(kmock_api, make_harness, key):
    cluster(kmock_api)
    kmock_api.create(keyed("both", f"{key},{ZONE if key == RACK else RACK}"))
    harness = make_harness().start()
    selectors = sorted(r.params["labelSelector"] for r in metadata_requests(kmock_api, LIST))
    assert selectors == [f"{RACK}=r1", f"{ZONE}=z1"]
    assert other_nodes(harness) == {"node-b": {RACK: "r1"}, "node-c": {ZONE: "z1"}}
    assert label_watches(harness) == 2


def test_a_label_change_recompiles_only_the_services_on_that_node(
    kmock_api, make_harness, monkeypatch
):
    cluster(kmock_api)
    kmock_api.create(
        keyed("on-b", RACK, "10.96.0.7"),
        make_slice(
            name="on-b-1", service="on-b", endpoints=[make_endpoint("10.244.2.6", "node-b")]
        ),
        keyed("on-c", RACK, "10.96.0.8"),
        make_slice(
            name="on-c-1", service="on-c", endpoints=[make_endpoint("10.244.3.6", "node-c")]
        ),
    )
    harness = make_harness().start()
    compiler = Compiler(NODE, CompileOptions())
    with harness.store.lock:
        compiler.full(harness.store.state)
        harness.store.state.take_changes()
    compiled: list[str] = []
    original = compile_module.compile_service

    def recording(service, slices, ctx):
        compiled.append(service.name)
        return original(service, slices, ctx)

    monkeypatch.setattr(compile_module, "compile_service", recording)
    kmock_api.patch("Node", None, "node-c", {"metadata": {"labels": {RACK: "r1"}}})
    wait_for(lambda: "node-c" in other_nodes(harness), "node-c joining rack r1")
    with harness.store.lock:
        state = compiler.update(harness.store.state)
    assert compiled == ["on-c"]
    (entry,) = [e for e in state.services if e.name == "on-c"]
    assert [b.ip for b in entry.cluster_backends or ()] == ["10.244.3.6"]


@pytest.mark.parametrize("outage", ["resumed", "410"])
def test_the_metadata_watch_survives_outages_and_410(kmock_api, make_harness, outage):
    cluster(kmock_api)
    kmock_api.create(keyed("racked", RACK))
    harness = make_harness().start()
    wait_for(lambda: len(metadata_requests(kmock_api, WATCH)) == 1, "the metadata watch")

    kmock_api.stop()
    wait_for(lambda: harness.source.up.get("node-labels") is False, "the label watch down")
    assert harness.metrics.registry.get_sample_value("kbp_api_up", {"resource": "node-labels"}) == 0
    # Meanwhile node-c joins the rack and node-b leaves it.
    kmock_api.call(_relabel(kmock_api, "node-c", "r1"))
    kmock_api.call(_relabel(kmock_api, "node-b", "r5"))
    if outage == "410":
        kmock_api.compact()
    kmock_api.start()
    wait_for(lambda: other_nodes(harness) == {"node-c": {RACK: "r1"}}, "the changes missed")
    wait_for(lambda: harness.source.up.get("node-labels") is True, "the label watch up again")
    assert harness.metrics.registry.get_sample_value("kbp_api_up", {"resource": "node-labels"}) == 1
    lists = len(metadata_requests(kmock_api, LIST))
    assert lists == (1 if outage == "resumed" else 2)


def test_a_gone_error_event_relists_the_metadata_watch(kmock_api, make_harness):
    cluster(kmock_api)
    kmock_api.create(keyed("racked", RACK))
    harness = make_harness().start()
    wait_for(lambda: len(metadata_requests(kmock_api, WATCH)) == 1, "the metadata watch")
    gone = status_event(410, "Expired", "too old resource version")
    # The next metadata watch of Nodes gets the 410 (not the own Node's watch, should it
    # reconnect meanwhile): cut the metadata watch so that one is opened.
    kmock_api.on_next(WATCH, NODES, (gone,), before=lambda: None, where=is_metadata)
    (watcher,) = harness.source.node_labels.watchers()
    watcher.cut("test")
    wait_for(lambda: len(metadata_requests(kmock_api, LIST)) == 2, "the relist after 410")
    wait_for(lambda: harness.source.up.get("node-labels") is True, "the label watch up again")
    assert harness.events("node-labels", "ERROR") == 1
    assert other_nodes(harness) == {"node-b": {RACK: "r1"}}


async def _relabel_now(api: KmockApi, name: str, rack: str) -> None:
    obj = api.emulator.objects[NODES, None, name]
    obj.patch({"metadata": {"labels": {RACK: rack}}})
    await api.emulator._buses[kmock.resource(NODES)].put({"type": "MODIFIED", "object": obj.raw})


def _relabel(api: KmockApi, name: str, rack: str) -> Any:
    """Change a node's rack while the server is stopped (kept in the watch history)."""
    return _relabel_now(api, name, rack)
