"""Per-Service traffic at /metrics from a running eBPF agent in the namespace lab: after N
real connections a Service's new-connection counter has risen by exactly N, its packets
and bytes with them, and refused and dropped connections show under their reasons.

Address plan and Services: tests/kernel/test_explain.py's (web 10.96.0.80 with three
backends, empty 10.96.0.81 without endpoints, away 10.96.0.82 with its only endpoint on
another node).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.lab.nodelab import Lab

from .agentproc import AgentProcess
from .test_explain import AWAY, EMPTY, WEB, agent_lab

pytestmark = pytest.mark.kernel

N = 25


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Lab, Path, Path, AgentProcess]]:
    with agent_lab(tmp_path, "ebpf") as found:
        yield found


def scrape(agent: AgentProcess) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value, for the kbp_service_* samples."""
    out = {}
    for family in text_string_to_metric_families(agent.get("/metrics")):
        for sample in family.samples:
            if sample.name.startswith("kbp_service_"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, service: str, **labels: str) -> float:
    key = (name, tuple(sorted({"namespace": "default", "service": service, **labels}.items())))
    return samples.get(key, 0.0)


def test_n_connections_raise_the_service_counters_by_n(setup) -> None:
    lab, _, _, agent = setup
    client = lab.pods["client"]
    before = scrape(agent)
    result = client.connect_many(WEB, 80, "tcp", N)
    assert result.answered == N, result
    after = scrape(agent)
    new = "kbp_service_new_connections_total"
    assert value(after, new, "web") - value(before, new, "web") == N
    packets = value(after, "kbp_service_packets_total", "web") - value(
        before, "kbp_service_packets_total", "web"
    )
    assert packets >= 4 * N, packets  # at least SYN, ACK, request, answer per connection
    assert value(after, "kbp_service_bytes_total", "web") > value(
        before, "kbp_service_bytes_total", "web"
    )
    assert value(after, new, "empty") == value(after, new, "away") == 0

    assert client.connect_many(EMPTY, 80, "tcp", 3).errors == {"refused": 3}
    assert client.connect_many(AWAY, 80, "tcp", 1, timeout=1).errors == {"timeout": 1}
    dropped = scrape(agent)
    drops = "kbp_service_drops_total"
    assert value(dropped, drops, "empty", reason="rejected") == 3
    assert value(dropped, drops, "away", reason="no-backend") >= 1  # SYN retransmits too
    assert value(dropped, drops, "web", reason="no-backend") == 0
