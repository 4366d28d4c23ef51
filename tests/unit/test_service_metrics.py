"""Per-Service metric labels and sums (agent/dataplane/ebpf/service_metrics.py) without a
kernel: service ids labelled from the applied NodeState, per mode, and the per-CPU values
of ids that share labels summed into one series."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from agent.dataplane.ebpf import abi, service_metrics
from agent.dataplane.ebpf.maps import FrontendKey, ServiceValue
from agent.metrics import Metrics
from agent.model.compile import CompileOptions, compile
from agent.sources.manifests import load_manifests

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def api_entries():
    state, _ = load_manifests([ROOT / "examples"])
    node_state = compile(state, "node-a", CompileOptions())
    return [e for e in node_state.services if e.name == "api"]  # IPv4 and IPv6 entries


def _kernel_services(entries, ids):
    out = {}
    for entry, service_id in zip(entries, ids, strict=True):
        fe = entry.frontends[0]
        key = FrontendKey(fe.ip, fe.port, 6, abi.family_of(fe.ip))
        out[key] = ServiceValue(service_id, 0, 0, 0, 0, 0, 0, 1)
    return out


@pytest.mark.parametrize(
    ("mode", "labels"),
    [("services", ("default", "api")), ("ports", ("default", "api", "http", "TCP"))],
)
def test_both_families_of_a_service_port_share_its_labels(api_entries, mode, labels) -> None:
    kernel = _kernel_services(api_entries, [3, 7])
    assert service_metrics.labels_of(api_entries, kernel, mode) == {3: labels, 7: labels}


def test_entries_the_kernel_does_not_hold_have_no_series(api_entries) -> None:
    assert service_metrics.labels_of(api_entries, {}, "services") == {}


class FakeCounters:
    """kbp_counters as values_array returns it: per id, every CPU's struct, 8-aligned."""

    def __init__(self, per_id: dict[int, list[tuple[int, int, int, int]]], cpus: int) -> None:
        self.per_id, self.cpus = per_id, cpus

    def values_array(self, count: int) -> bytes:
        out = b""
        for service_id in range(count):
            rows = self.per_id.get(service_id, [(0, 0, 0, 0)] * self.cpus)
            out += b"".join(struct.pack("=4Q", *row) for row in rows)
        return out


class FakeDrops:
    def __init__(self, items: list[tuple[bytes, bytes]]) -> None:
        self._items = items

    def items(self) -> list[tuple[bytes, bytes]]:
        return self._items


def test_ids_that_share_labels_are_summed_over_cpus_and_families() -> None:
    counters = FakeCounters(
        {3: [(1, 100, 1, 0), (2, 200, 1, 0)], 7: [(4, 400, 2, 0), (0, 0, 0, 0)]}, 2
    )
    drop = abi.packer("kbp_svc_drop_key").pack(7, abi.const.KBP_DROP_REJECTED)
    drops = FakeDrops([(drop, struct.pack("=2Q", 2, 3))])
    labels = {3: ("default", "api"), 7: ("default", "api")}
    traffic = service_metrics.ServiceTraffic(counters, drops, lambda: labels, "services")
    traffic._cpus = 2  # the fake's CPUs, not this machine's
    metrics = Metrics()
    metrics.text_sections.append(traffic.render)
    body, _ = metrics.exposition("")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
        if s.name.startswith("kbp_service_")
    }
    api = (("namespace", "default"), ("service", "api"))
    assert samples == {
        ("kbp_service_packets_total", api): 7,
        ("kbp_service_bytes_total", api): 700,
        ("kbp_service_new_connections_total", api): 4,
        ("kbp_service_drops_total", tuple(sorted((*api, ("reason", "rejected"))))): 5,
    }


def test_openmetrics_keeps_eof_last_and_label_values_are_escaped() -> None:
    labels = {0: ("default", 'we"ird\\name')}
    traffic = service_metrics.ServiceTraffic(
        FakeCounters({0: [(1, 2, 3, 0)]}, 1), FakeDrops([]), lambda: labels, "services"
    )
    traffic._cpus = 1
    metrics = Metrics()
    metrics.text_sections.append(traffic.render)
    body, content_type = metrics.exposition("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n") and body.count(b"# EOF") == 1
    [family] = [f for f in openmetrics_families(body.decode()) if f.name == "kbp_service_packets"]
    assert [(s.name, s.labels["service"], s.value) for s in family.samples] == [
        ("kbp_service_packets_total", 'we"ird\\name', 1)
    ]


def test_a_reused_id_loses_only_its_own_drop_counts() -> None:
    key = abi.packer("kbp_svc_drop_key").pack
    keys = [key(3, 0), key(3, 1), key(4, 0), key(7, 7)]
    assert service_metrics.keys_of_ids(keys, [3, 7]) == [key(3, 0), key(3, 1), key(7, 7)]
    assert service_metrics.keys_of_ids(keys, []) == []
