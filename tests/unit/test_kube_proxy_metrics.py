"""kube-proxy's metric families, with its names, types and labels, so its operators'
dashboards (the kube-proxy mixins, netdata, metricbeat) keep working; no `_created`."""

from __future__ import annotations

import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from agent.api import AgentStatus, HealthServer
from agent.dataplane.fake import FakeDataplane
from agent.metrics import Metrics
from agent.model.compile import CompileOptions
from agent.sync.loop import SyncLoop
from agent.sync.store import StateStore

from ..builders import default_nodes, make_service
from .test_sync import value, web_slice

# The families kube-proxy exports from its start whatever the proxy mode, as its
# documentation lists them (Kubernetes' metrics reference, component kube-proxy; client-go's
# rest_client_* and the Go client library's process_* collector): name -> (type, labels).
KUBE_PROXY_FAMILIES: dict[str, tuple[str, set[str]]] = {
    "kubeproxy_sync_proxy_rules_duration_seconds": ("histogram", set()),
    "kubeproxy_sync_full_proxy_rules_duration_seconds": ("histogram", set()),
    "kubeproxy_sync_partial_proxy_rules_duration_seconds": ("histogram", set()),
    "kubeproxy_sync_proxy_rules_last_timestamp_seconds": ("gauge", set()),
    "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds": ("gauge", set()),
    "kubeproxy_network_programming_duration_seconds": ("histogram", set()),
    "kubeproxy_sync_proxy_rules_endpoint_changes": ("counter", set()),
    "kubeproxy_sync_proxy_rules_service_changes": ("counter", set()),
    "kubeproxy_sync_proxy_rules_endpoint_changes_pending": ("gauge", set()),
    "kubeproxy_sync_proxy_rules_service_changes_pending": ("gauge", set()),
    "kubeproxy_sync_proxy_rules_no_local_endpoints_total": ("gauge", {"traffic_policy"}),
    "kubeproxy_proxy_healthz": ("counter", {"code"}),
    "kubeproxy_proxy_livez": ("counter", {"code"}),
    "rest_client_requests": ("counter", {"code", "method", "host"}),
    "rest_client_request_duration_seconds": ("histogram", {"verb", "host"}),
    "process_cpu_seconds": ("counter", set()),
    "process_resident_memory_bytes": ("gauge", set()),
    "process_virtual_memory_bytes": ("gauge", set()),
    "process_open_fds": ("gauge", set()),
    "process_max_fds": ("gauge", set()),
    "process_start_time_seconds": ("gauge", set()),
}


def families(metrics: Metrics) -> dict[str, object]:
    body, _ = metrics.exposition()
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def used(metrics: Metrics) -> None:
    """Give every labelled family a series, as a running agent does."""
    metrics.healthz_requests.labels("200").inc()
    metrics.livez_requests.labels("200").inc()
    metrics.rest_client_requests.labels("200", "GET", "192.0.2.1:6443").inc()
    metrics.rest_client_duration.labels("GET", "192.0.2.1:6443").observe(0.01)
    metrics.no_local_endpoints.labels("internal").set(0)
    metrics.endpoint_changes.inc()


def test_every_family_kube_proxy_always_exports_is_here_with_its_type_and_labels() -> None:
    metrics = Metrics()
    used(metrics)
    found = families(metrics)
    missing = sorted(set(KUBE_PROXY_FAMILIES) - set(found))
    assert missing == []
    for name, (kind, labels) in KUBE_PROXY_FAMILIES.items():
        family = found[name]
        assert family.type == kind, name  # type: ignore[attr-defined]
        sample_labels = {
            label
            for sample in family.samples  # type: ignore[attr-defined]
            for label in sample.labels
            if label not in ("le",)
        }
        assert sample_labels == labels, name


def test_no_created_series() -> None:
    metrics = Metrics()
    used(metrics)
    body, _ = metrics.exposition()
    assert "_created" not in body.decode()
    body, _ = metrics.exposition("application/openmetrics-text")
    assert "_created" not in body.decode()


def test_healthz_and_livez_answers_are_counted_by_code() -> None:
    metrics = Metrics()
    status = AgentStatus(dataplane="none")
    server = HealthServer("127.0.0.1:0", status, 30.0, metrics)
    try:
        for path in ("/healthz", "/healthz", "/livez"):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.port}{path}", timeout=5) as r:
                json.load(r)
    finally:
        server.close()
    get = metrics.registry.get_sample_value
    assert get("kubeproxy_proxy_healthz_total", {"code": "200"}) == 2
    assert get("kubeproxy_proxy_livez_total", {"code": "200"}) == 1


def test_pending_changes_and_the_queued_time_follow_the_sync_loop() -> None:
    store = StateStore()
    store.register_source("test")
    for obj in default_nodes():
        store.upsert(value(obj))
    metrics = Metrics()
    loop = SyncLoop(store, "node-a", CompileOptions(), FakeDataplane(), metrics,
                    wall_clock=lambda: 1234.5)  # fmt: skip
    get = metrics.registry.get_sample_value
    store.upsert(value(make_service()))
    store.upsert(web_slice("10.244.2.5"))
    store.upsert(web_slice("10.244.2.5", "10.244.2.6"))
    assert get("kubeproxy_sync_proxy_rules_service_changes_pending") == 1
    assert get("kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 2
    store.mark_synced("test")
    assert loop.sync()
    assert get("kubeproxy_sync_proxy_rules_service_changes_pending") == 0
    assert get("kubeproxy_sync_proxy_rules_endpoint_changes_pending") == 0
    assert get("kubeproxy_sync_full_proxy_rules_duration_seconds_count") == 1
    assert get("kubeproxy_sync_partial_proxy_rules_duration_seconds_count") == 0
    loop._queue()  # what a change calls (the runner is not started: nothing runs)
    assert get("kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds") == 1234.5
    store.upsert(web_slice("10.244.2.7"))
    assert loop.sync()
    assert get("kubeproxy_sync_partial_proxy_rules_duration_seconds_count") == 1
