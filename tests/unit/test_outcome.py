"""The model's outcome oracle (agent/model/outcome.py), which explain, the lab and the tests
ask: the set a packet uses, whether it meets a backend, is refused or dropped, and why.

Address plan: tests/builders.py (node-a 192.0.2.10, pods 10.244.<node>.<n>); the
LoadBalancer VIP 203.0.113.9 admits 198.51.100.0/24 only.
"""

from __future__ import annotations

import pytest

from agent.model.compile import LOCAL_CLUSTER, PREFER_SAME_ZONE, compile
from agent.model.nodestate import Frontend, ServiceEntry
from agent.model.outcome import (
    BACKENDS,
    CLUSTER_BACKENDS,
    DROPPED,
    ENDPOINTS_ELSEWHERE,
    LOCAL_BACKENDS,
    NO_ENDPOINTS,
    REFUSED,
    SOURCE_NOT_ALLOWED,
    outcome,
    topology_tiers,
)

from ..builders import default_nodes, make_endpoint, make_service, make_slice, state_of

POD = "10.244.1.254"
ADMITTED = "198.51.100.7"
LOCAL = make_endpoint("10.244.1.5", "node-a")
REMOTE = make_endpoint("10.244.2.7", "node-b")


def entry_of(*endpoints, etp: str = "Cluster", itp: str = "Cluster") -> ServiceEntry:
    def mutate(obj) -> None:
        obj["spec"].update(
            type="LoadBalancer",
            externalTrafficPolicy=etp,
            internalTrafficPolicy=itp,
            loadBalancerSourceRanges=["198.51.100.0/24"],
            ports=[{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}],
        )
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}

    objects = [make_service(name="web", mutate=mutate)]
    if endpoints:
        objects.append(make_slice(service="web", endpoints=list(endpoints)))
    (entry,) = compile(state_of(*default_nodes(), *objects), "node-a").services
    return entry


def frontend(entry: ServiceEntry, kind: str) -> Frontend:
    return next(f for f in entry.frontends if f.type == kind)


def test_a_backend_answers_from_the_set_the_packet_uses() -> None:
    entry = entry_of(LOCAL, REMOTE, etp="Local")
    from_pod = outcome(entry, frontend(entry, "NodePort"), POD)
    assert (from_pod.kind, from_pod.set_name, from_pod.reason) == (BACKENDS, CLUSTER_BACKENDS, "")
    assert {b.ip for b in from_pod.backends} == {"10.244.1.5", "10.244.2.7"}
    from_outside = outcome(entry, frontend(entry, "NodePort"), ADMITTED, from_outside=True)
    assert (from_outside.kind, from_outside.set_name) == (BACKENDS, LOCAL_BACKENDS)
    assert [b.ip for b in from_outside.backends] == ["10.244.1.5"]


@pytest.mark.parametrize("from_outside", [False, True], ids=["from a pod", "from outside"])
def test_source_ranges_drop_before_the_set_but_the_set_is_still_named(from_outside) -> None:
    entry = entry_of(LOCAL)
    vip = frontend(entry, "LoadBalancer")
    result = outcome(entry, vip, POD, from_outside=from_outside)
    assert (result.kind, result.reason) == (DROPPED, SOURCE_NOT_ALLOWED)
    assert [b.ip for b in result.backends] == ["10.244.1.5"]
    assert outcome(entry, vip, ADMITTED, from_outside=from_outside).kind == BACKENDS
    # A NodePort of the same Service ignores the ranges.
    assert outcome(entry, frontend(entry, "NodePort"), POD, from_outside).kind == BACKENDS


def test_an_empty_set_is_refused_without_endpoints_and_dropped_with_endpoints_elsewhere() -> None:
    none = entry_of()
    result = outcome(none, frontend(none, "ClusterIP"), POD)
    assert (result.kind, result.reason, result.backends) == (REFUSED, NO_ENDPOINTS, ())
    elsewhere = entry_of(REMOTE, itp="Local")
    result = outcome(elsewhere, frontend(elsewhere, "ClusterIP"), POD)
    assert (result.kind, result.set_name, result.reason) == (
        DROPPED,
        LOCAL_BACKENDS,
        ENDPOINTS_ELSEWHERE,
    )


def test_topology_tiers_split_the_compilers_field() -> None:
    assert topology_tiers(entry_of(LOCAL).topology) == []
    assert topology_tiers(f"{LOCAL_CLUSTER}+{PREFER_SAME_ZONE}") == [
        LOCAL_CLUSTER,
        PREFER_SAME_ZONE,
    ]
