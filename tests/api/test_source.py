"""The Kubernetes source against kmock over real HTTP, with the real `kubernetes` client:
sync gating, changes flowing into the StateStore, no-op updates, 410 Gone, outages,
malformed objects and the server-side selections."""

from __future__ import annotations

import logging
import re
import threading
import time

import kmock
import pytest

from agent.model.types import Node, Service
from tests.builders import make_endpoint, make_node, make_service, make_slice

from .conftest import NODE, NODES, SERVICES, SLICES, KmockApi, status_event, wait_for

PROXY_LABEL = "service.kubernetes.io/service-proxy-name"
HEADLESS_LABEL = "service.kubernetes.io/headless"
LIST = kmock.action.LIST
WATCH = kmock.action.WATCH


def seed(api: KmockApi) -> None:
    """A Service with a slice, this node and another node."""
    api.create(
        make_service(name="web"),
        make_slice(name="web-1", service="web", endpoints=[make_endpoint("10.244.1.5", NODE)]),
        make_node(NODE, {"topology.kubernetes.io/zone": "zone-1"}, "192.0.2.10"),
        make_node("node-b", {"topology.kubernetes.io/zone": "zone-2"}, "192.0.2.11"),
    )


def test_nothing_is_synced_before_every_initial_list(kmock_api, make_harness):
    seed(kmock_api)
    gate = threading.Event()
    gate.set()
    kmock_api.fail_while(LIST, NODES, gate, 503)
    harness = make_harness()
    assert not harness.store.synced  # registered at construction, before start()
    harness.start(wait=False)

    wait_for(lambda: harness.store.services() == {"default/web"}, "the Services list")
    wait_for(lambda: harness.store.slices() == {"default/web-1"}, "the slices list")
    wait_for(lambda: len(kmock_api.requests(LIST, NODES)) >= 2, "a retried Node list")
    wait_for(lambda: harness.api_up(SERVICES) == 1, "the Services to be up")
    assert not harness.store.synced
    assert harness.api_up(NODES) == 0

    gate.clear()
    wait_for(lambda: harness.store.synced, "every initial list")
    assert harness.store.nodes() == {NODE}  # this node only: no Service uses other nodes
    wait_for(lambda: all(harness.source.up.values()), "every resource to be up")
    assert harness.api_up(NODES) == 1


def test_initial_state_is_decoded_once_into_the_model(kmock_api, make_harness):
    seed(kmock_api)
    harness = make_harness().start()
    state = harness.store.state
    assert state.services[("default", "web")].cluster_ips == ("10.96.0.1",)
    slice_ = state.slices[("default", "web-1")]
    assert [e.ip for e in slice_.endpoints] == ["10.244.1.5"]
    # This node in full, and no other node (no Service uses topology keys).
    assert state.nodes == {
        NODE: Node(NODE, {"topology.kubernetes.io/zone": "zone-1"}, ("192.0.2.10",))
    }
    # Each listed object counted once as a LIST event.
    assert harness.events(SERVICES, "LIST") == 1
    assert harness.events(NODES, "LIST") == 1
    assert harness.events(NODES, "ADDED") == 0  # the watch starts where the list ended
    # Server-side selection (kube-proxy's) and watch parameters.
    kube_proxy = f"!{PROXY_LABEL},!{HEADLESS_LABEL}"
    (services,) = kmock_api.requests(LIST, SERVICES)
    assert services.params["labelSelector"] == kube_proxy
    (listed,) = kmock_api.requests(LIST, SLICES)
    assert listed.params["labelSelector"] == kube_proxy
    (listed,) = kmock_api.requests(LIST, NODES)
    assert listed.params["fieldSelector"] == f"metadata.name={NODE}"
    assert "labelSelector" not in listed.params
    (watch,) = kmock_api.requests(WATCH, NODES)
    assert watch.params["fieldSelector"] == f"metadata.name={NODE}"
    (watch,) = kmock_api.requests(WATCH, SERVICES)
    assert watch.params["resourceVersion"] == "4"  # the list's: four objects written
    assert watch.params["labelSelector"] == kube_proxy
    assert watch.params["allowWatchBookmarks"] == "true"
    assert 60 <= int(watch.params["timeoutSeconds"]) <= 120
    # Every byte read is counted, per resource.
    for resource in ("services", "endpointslices", "nodes"):
        received = harness.metrics.registry.get_sample_value(
            "kbp_api_bytes_received_total", {"resource": resource}
        )
        assert received is not None and received > 50, resource


def test_adds_updates_and_deletes_flow_into_the_store(kmock_api, make_harness):
    harness = make_harness().start()
    store, state = harness.store, harness.store.state

    kmock_api.create(make_service(name="api"))
    wait_for(lambda: ("default", "api") in state.services, "the new Service")
    kmock_api.patch(
        "Service",
        "default",
        "api",
        {"spec": {"clusterIP": "10.96.0.2", "clusterIPs": ["10.96.0.2"]}},
    )
    wait_for(
        lambda: state.services[("default", "api")].cluster_ips == ("10.96.0.2",),
        "the Service's new cluster IP",
    )

    kmock_api.create(
        make_slice(name="api-1", service="api", endpoints=[make_endpoint("10.244.1.7", NODE)])
    )
    wait_for(lambda: ("default", "api-1") in state.slices, "the new slice")
    kmock_api.patch(
        "EndpointSlice",
        "default",
        "api-1",
        {"endpoints": [make_endpoint("10.244.1.8", NODE, ready=False)]},
    )
    wait_for(
        lambda: not state.slices[("default", "api-1")].endpoints[0].ready,
        "the endpoint to become not ready",
    )

    kmock_api.create(make_node(NODE, {"rack": "r1"}, "192.0.2.10"))
    wait_for(lambda: NODE in state.nodes, "this Node")
    kmock_api.patch("Node", None, NODE, {"metadata": {"labels": {"rack": "r2"}}})
    wait_for(lambda: state.nodes[NODE].labels == {"rack": "r2"}, "the Node's new label")

    kmock_api.delete("EndpointSlice", "default", "api-1")
    kmock_api.delete("Service", "default", "api")
    kmock_api.delete("Node", None, NODE)
    wait_for(
        lambda: not state.services and not state.slices and not state.nodes,
        "every object to be deleted",
    )
    assert harness.events(SERVICES, "DELETED") == 1
    assert harness.events(SLICES, "MODIFIED") == 1
    assert all(call.result for call in store.calls if call.method in ("upsert", "delete"))


@pytest.mark.parametrize(
    "patch",
    [
        {"metadata": {"resourceVersion": "1234"}},
        {"metadata": {"annotations": {"example.com/owner": "team-a"}}},
        {"metadata": {"labels": {"app.kubernetes.io/version": "2"}}},
    ],
    ids=["resourceVersion", "annotation", "label"],
)
def test_noop_updates_report_no_change(kmock_api, make_harness, patch):
    seed(kmock_api)
    harness = make_harness().start()
    store = harness.store
    before = dict(store.counts.changes)
    notified: list[int] = []
    store.on_change(lambda: notified.append(1))

    objects = [("Service", "default", "web"), ("EndpointSlice", "default", "web-1")]
    if "labels" not in patch["metadata"]:  # Node labels are kept: a label is a change there
        objects += [("Node", None, NODE)]
    for kind, namespace, name in objects:
        kmock_api.patch(kind, namespace, name, patch)
    # Another node's churn (status, labels) is not even sent: no Service needs its labels.
    kmock_api.patch(
        "Node",
        None,
        "node-b",
        {
            "metadata": {"labels": {"rack": "r9"}},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.99"}]},
        },
    )
    nodes_modified = len(objects) - 2
    wait_for(lambda: harness.events(NODES, "MODIFIED") == nodes_modified, "the Node updates")
    wait_for(lambda: harness.events(SERVICES, "MODIFIED") == 1, "the Service update")
    wait_for(lambda: harness.events(SLICES, "MODIFIED") == 1, "the slice update")

    upserts = [call for call in store.calls if call.method == "upsert"]
    assert upserts and not any(call.result for call in upserts)
    assert store.counts.changes == before
    assert notified == []


@pytest.mark.parametrize("how", ["ERROR event", "HTTP status"])
def test_gone_relists_and_applies_deletions_missed_meanwhile(kmock_api, make_harness, how):
    seed(kmock_api)
    kmock_api.create(make_service(name="gone"), make_slice(name="gone-1", service="gone"))
    if how == "ERROR event":
        gone: tuple[object, ...] = ((status_event(410, "Expired", "too old resource version"),),)
    else:
        gone = (410, status_event(410, "Expired", "too old resource version")["object"])

    # Deleted between the list and the watch, so no watch ever reports it.
    for resource, kind, name in (
        (SERVICES, "Service", "gone"),
        (SLICES, "EndpointSlice", "gone-1"),
    ):
        kmock_api.on_next(
            WATCH,
            resource,
            *gone,
            before=lambda k=kind, n=name: kmock_api.forget_now(k, "default", n),
        )
    harness = make_harness().start(wait=False)

    wait_for(lambda: len(kmock_api.requests(LIST, SERVICES)) == 2, "a relist of Services")
    wait_for(lambda: len(kmock_api.requests(LIST, SLICES)) == 2, "a relist of slices")
    wait_for(lambda: harness.store.services() == {"default/web"}, "the missed deletion")
    wait_for(lambda: harness.store.slices() == {"default/web-1"}, "the missed slice deletion")
    wait_for(lambda: kmock_api.watching(SERVICES), "a new watch")
    # every resource relisted (Nodes too): on a loaded machine that can trail the watch
    wait_for(lambda: harness.store.synced, "the store synced again")
    assert harness.api_up(SERVICES) == 1
    if how == "ERROR event":
        assert harness.events(SERVICES, "ERROR") == 1


@pytest.mark.parametrize("history", ["kept", "compacted"])
def test_outage_keeps_state_then_resumes(kmock_api, make_harness, caplog, history):
    """After an outage each watch resumes from its resourceVersion: the deletion made
    meanwhile arrives as an event and nothing is listed again; only a server that no
    longer has that resourceVersion (410) makes the source list again."""
    seed(kmock_api)
    kmock_api.create(make_service(name="doomed"))
    reachability: list[bool] = []
    harness = make_harness(on_reachability=reachability.append).start()
    wait_for(lambda: reachability == [True], "the API to be reported reachable")
    store = harness.store
    services, slices, nodes = store.services(), store.slices(), store.nodes()

    kmock_api.stop()
    for resource in (SERVICES, SLICES, NODES):
        wait_for(lambda r=resource: harness.api_up(r) == 0, f"{resource} to be down")
    # Retrying against a closed port while the state stays as it was.
    lists = {r: len(kmock_api.requests(LIST, r)) for r in (SERVICES, SLICES, NODES)}
    kmock_api.delete_unseen("Service", "default", "doomed")  # deleted while we were away
    if history == "compacted":
        kmock_api.compact()
    for name in ("services", "endpointslices", "nodes"):
        wait_for(
            lambda n=name: re.search(
                rf"{n}: .*keeping the last known state, retrying in .* \(resuming from "
                rf"resourceVersion \d+, attempt 3\)",
                caplog.text,
            ),
            f"{name}: three failed attempts",
        )
    assert (store.services(), store.slices(), store.nodes()) == (services, slices, nodes)
    assert reachability == [True, False]  # reported once, not per resource or attempt

    store.calls.clear()
    kmock_api.start()
    for resource in (SERVICES, SLICES, NODES):
        wait_for(lambda r=resource: harness.api_up(r) == 1, f"{resource} to be up again")
    wait_for(lambda: store.services() == services - {"default/doomed"}, "the missed deletion")
    relisted = {r: len(kmock_api.requests(LIST, r)) - lists[r] for r in lists}
    if history == "kept":
        assert relisted == {SERVICES: 0, SLICES: 0, NODES: 0}
        assert [c.method for c in store.calls] == ["delete"]
    else:
        wait_for(
            lambda: len([c for c in store.calls if c.method == "replace"]) == 3,
            "a relist of each resource after 410",
        )
        assert all(len(kmock_api.requests(LIST, r)) == lists[r] + 1 for r in lists)
        replaced = {c.args[0]: c.result for c in store.calls if c.method == "replace"}
        assert replaced == {"Service": True, "EndpointSlice": False, "Node": False}
    assert (store.slices(), store.nodes()) == (slices, nodes)
    assert reachability == [True, False, True]


def test_reconnect_without_changes_changes_nothing(kmock_api, make_harness):
    seed(kmock_api)
    harness = make_harness().start()
    store = harness.store
    notified: list[int] = []
    store.on_change(lambda: notified.append(1))
    before = dict(store.counts.changes)
    store.calls.clear()

    kmock_api.stop()
    wait_for(lambda: harness.api_up(SERVICES) == 0, "the outage to be noticed")
    kmock_api.compact()  # the resourceVersions are too old now: every resource relists
    kmock_api.start()
    for resource in (SERVICES, SLICES, NODES):
        wait_for(lambda r=resource: harness.api_up(r) == 1, f"{resource} to be up again")
    wait_for(lambda: len([c for c in store.calls if c.method == "replace"]) == 3, "the relists")

    assert not any(call.result for call in store.calls)
    assert store.counts.changes == before
    assert notified == []


def test_malformed_objects_are_skipped_with_a_log_line(kmock_api, make_harness, caplog):
    caplog.set_level(logging.WARNING, logger="agent.k8s")
    seed(kmock_api)

    def bad_port(obj: dict) -> None:
        obj["spec"]["ports"][0]["port"] = "eighty"

    kmock_api.create(make_service(name="bad", mutate=bad_port))
    harness = make_harness().start()
    state = harness.store.state
    assert harness.store.services() == {"default/web"}
    assert "Service default/bad: spec.ports[0].port" in caplog.text

    # A good object turning bad keeps its last good version.
    good = state.services[("default", "web")]
    caplog.clear()
    kmock_api.patch("EndpointSlice", "default", "web-1", {"addressType": "IPv5"})
    kmock_api.patch("Service", "default", "web", {"spec": {"clusterIP": "not-an-ip"}})
    wait_for(lambda: "Service default/web: spec.clusterIP" in caplog.text, "the log line")
    wait_for(lambda: "EndpointSlice default/web-1: addressType" in caplog.text, "the log line")
    assert state.services[("default", "web")] is good
    assert ("default", "web-1") in state.slices

    # A relist keeps it too (it is not deleted for being unlisted).
    harness.store.calls.clear()
    kmock_api.stop()
    kmock_api.compact()  # 410: relist
    kmock_api.start()
    wait_for(
        lambda: any(c.method == "replace" and c.args[0] == "Service" for c in harness.store.calls),
        "the relist",
    )
    assert state.services[("default", "web")] is good
    assert ("default", "web-1") in state.slices

    # Fixed, it is taken again; the problem is logged once per object, not per replay.
    kmock_api.patch(
        "Service",
        "default",
        "web",
        {"spec": {"clusterIP": "10.96.0.9", "clusterIPs": ["10.96.0.9"]}},
    )
    wait_for(
        lambda: state.services[("default", "web")].cluster_ips == ("10.96.0.9",),
        "the fixed Service",
    )
    assert caplog.text.count("Service default/web: spec.clusterIP") == 1


def test_other_proxies_services_and_headless_slices_never_reach_the_store(kmock_api, make_harness):
    seed(kmock_api)

    def claimed(obj: dict) -> None:
        obj["metadata"]["labels"] = {PROXY_LABEL: "other-proxy"}

    def claimed_empty(obj: dict) -> None:
        obj["metadata"]["labels"] = {PROXY_LABEL: ""}

    def headless(obj: dict) -> None:
        obj["metadata"]["labels"][HEADLESS_LABEL] = ""

    kmock_api.create(
        make_service(name="theirs", mutate=claimed),
        make_service(name="theirs-too", mutate=claimed_empty),
        make_slice(name="hl-1", service="hl", mutate=headless),
    )
    harness = make_harness().start()
    kmock_api.create(
        make_service(name="late", mutate=claimed),
        make_slice(name="hl-2", service="hl", mutate=headless),
        make_slice(name="theirs-1", service="theirs", mutate=claimed),  # kube-proxy skips it too
        make_slice(name="web-2", service="web"),
    )
    # A Service claimed by another proxy later leaves the store (the server says DELETED).
    kmock_api.patch("Service", "default", "web", {"metadata": {"labels": {PROXY_LABEL: "other"}}})
    wait_for(lambda: not harness.store.services(), "the claimed Service to leave")
    wait_for(lambda: "default/web-2" in harness.store.slices(), "the slice created last")

    assert harness.store.offered("Service") == {"default/web"}
    assert harness.store.offered("EndpointSlice") == {"default/web-1", "default/web-2"}
    assert harness.events(SERVICES, "DELETED") == 1
    # Filtered by the server: neither listed nor sent.
    assert harness.events(SLICES, "LIST") == 1 and harness.events(SLICES, "ADDED") == 1


def test_service_proxy_name_selects_only_its_services(kmock_api, make_harness):
    def ours(obj: dict) -> None:
        obj["metadata"]["labels"] = {PROXY_LABEL: "kbp"}

    def theirs(obj: dict) -> None:
        obj["metadata"]["labels"] = {PROXY_LABEL: "other"}

    kmock_api.create(
        make_service(name="ours", mutate=ours),
        make_service(name="theirs", mutate=theirs),
        make_service(name="default-proxy"),
    )
    harness = make_harness(service_proxy_name="kbp").start()
    assert harness.store.services() == {"default/ours"}
    assert isinstance(harness.store.state.services[("default", "ours")], Service)
    (listed,) = kmock_api.requests(LIST, SERVICES)
    assert listed.params["labelSelector"] == f"{PROXY_LABEL}=kbp,!{HEADLESS_LABEL}"
    (listed,) = kmock_api.requests(LIST, SLICES)
    assert listed.params["labelSelector"] == f"!{HEADLESS_LABEL}"

    kmock_api.patch(
        "Service", "default", "default-proxy", {"metadata": {"labels": {PROXY_LABEL: "kbp"}}}
    )
    wait_for(
        lambda: harness.store.services() == {"default/ours", "default/default-proxy"},
        "the newly labelled Service",
    )
    kmock_api.patch("Service", "default", "ours", {"metadata": {"labels": {PROXY_LABEL: None}}})
    wait_for(lambda: harness.store.services() == {"default/default-proxy"}, "the unlabelled one")


def test_watch_resumes_from_its_resource_version(kmock_api, make_harness):
    seed(kmock_api)
    bookmark = {
        "type": "BOOKMARK",
        "object": {"kind": "Service", "apiVersion": "v1", "metadata": {"resourceVersion": "42"}},
    }
    kmock_api.on_next(WATCH, SERVICES, (bookmark,))  # then the stream ends
    harness = make_harness().start()
    wait_for(lambda: len(kmock_api.requests(WATCH, SERVICES)) == 2, "the resumed watch")
    assert kmock_api.requests(WATCH, SERVICES)[1].params["resourceVersion"] == "42"
    assert len(kmock_api.requests(LIST, SERVICES)) == 1  # resumed, not relisted
    assert harness.events(SERVICES, "BOOKMARK") == 1
    assert harness.api_up(SERVICES) == 1


def test_silent_watch_is_resumed_after_the_read_timeout(kmock_api, make_harness):
    """kmock ignores timeoutSeconds: the client's read timeout ends the watch."""
    seed(kmock_api)
    harness = make_harness(read_timeout=0.2).start()
    wait_for(lambda: len(kmock_api.requests(WATCH, SLICES)) >= 3, "resumed watches")
    assert len(kmock_api.requests(LIST, SLICES)) == 1
    assert harness.api_up(SLICES) == 1
    assert harness.store.slices() == {"default/web-1"}


def test_error_during_watch_backs_off_and_resumes(kmock_api, make_harness, caplog):
    seed(kmock_api)
    kmock_api.on_next(WATCH, NODES, 500, {"kind": "Status", "code": 500, "message": "boom"})
    harness = make_harness().start(wait=False)
    wait_for(lambda: len(kmock_api.requests(WATCH, NODES)) == 2, "a second watch of Nodes")
    wait_for(lambda: kmock_api.watching(NODES), "a new watch of Nodes")
    wait_for(lambda: harness.api_up(NODES) == 1, "Nodes reported up again")
    assert "nodes: HTTP 500" in caplog.text
    assert len(kmock_api.requests(LIST, NODES)) == 1  # resumed, not listed again
    first, second = kmock_api.requests(WATCH, NODES)
    assert first.params["resourceVersion"] == second.params["resourceVersion"] == "4"


def test_stop_is_prompt(kmock_api, make_harness):
    seed(kmock_api)
    harness = make_harness().start()
    started = time.monotonic()
    harness.source.stop()
    harness.started = False
    assert time.monotonic() - started < 1.0
    assert not any(t.name.startswith("kbp-k8s-") for t in threading.enumerate())
    assert harness.source.up == {"services": False, "endpointslices": False, "nodes": False}


def service_list(name: str, *, cont: str | None = None) -> dict:
    """A ServiceList page at resourceVersion 7 holding Service `name`; `cont`: the
    continue token of a next page."""
    metadata = {"resourceVersion": "7", **({"continue": cont} if cont else {})}
    items = [make_service(name=name)]
    return {"kind": "ServiceList", "apiVersion": "v1", "metadata": metadata, "items": items}


def test_lists_are_paged(kmock_api, make_harness):
    kmock_api.on_next(LIST, SERVICES, service_list("one", cont="page-2"))
    kmock_api.on_next(LIST, SERVICES, service_list("two"), skip=1)
    harness = make_harness(page_size=1).start()
    assert harness.store.services() == {"default/one", "default/two"}
    first, second = kmock_api.requests(LIST, SERVICES)
    assert (first.params["limit"], "continue" in first.params) == ("1", False)
    assert (second.params["limit"], second.params["continue"]) == ("1", "page-2")
    (watch,) = kmock_api.requests(WATCH, SERVICES)
    assert watch.params["resourceVersion"] == "7"


def test_expired_list_continuation_lists_again_in_one_piece(kmock_api, make_harness):
    seed(kmock_api)
    kmock_api.on_next(LIST, SERVICES, service_list("stale", cont="page-2"))
    kmock_api.on_next(LIST, SERVICES, 410, status_event(410, "Expired")["object"], skip=1)
    harness = make_harness(page_size=1).start()
    assert harness.store.services() == {"default/web"}  # kmock's own, complete list
    requests = kmock_api.requests(LIST, SERVICES)
    assert len(requests) == 3
    assert "limit" not in requests[2].params and "continue" not in requests[2].params
    assert harness.api_up(SERVICES) == 1


def test_missing_own_node_is_reported_once(kmock_api, make_harness, caplog):
    kmock_api.create(make_node("node-b", {}, "192.0.2.11"))
    harness = make_harness().start()
    assert harness.store.nodes() == set()
    assert caplog.text.count(f"Node {NODE} is not in the API server's node list") == 1


def test_watch_failing_after_good_lists_keeps_backing_off(kmock_api, make_harness, caplog):
    """A watch that keeps failing backs off (no request storm against the API server)
    and resumes each time, without listing again."""
    seed(kmock_api)
    gate = threading.Event()
    gate.set()
    kmock_api.fail_while(WATCH, NODES, gate, 403)
    harness = make_harness().start(wait=False)
    wait_for(lambda: "attempt 3)" in caplog.text, "a third consecutive failure")
    assert "nodes: HTTP 403" in caplog.text
    assert len(kmock_api.requests(WATCH, NODES)) >= 3
    assert len(kmock_api.requests(LIST, NODES)) == 1  # each attempt resumes the watch
    gate.clear()
    wait_for(lambda: kmock_api.watching(NODES), "a watch of Nodes")
    # The server sees the request before the source has its answer and says it is up.
    wait_for(lambda: harness.api_up(NODES) == 1, "Nodes reported up again")
    assert harness.store.nodes() == {NODE}
