"""The lab's pure parts: the cluster it plans from the example manifests (pods, clients,
the outside client, routes, what it cannot reach), what a client pod or the outside client
should see at each frontend (which set it uses, refused or dropped, unreachable backends
left out, the source address a backend sees), and the ✔/✘ judgement.

Address plan: tests/builders.py (node-a 192.0.2.10, pods 10.244.<node>.<n>, ClusterIPs
10.96.0.0/16, remote pods 10.245.0.0/16); the lab's client on node-a is 10.244.1.254, the
outside client 192.0.2.100 (admitted by source range 192.0.2.0/24, refused by
198.51.100.0/24), VIP 203.0.113.9, ExternalIP 203.0.113.7.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.lab.expect import (
    Expectation,
    coverage_required,
    coverage_sample,
    expect,
    expect_from_outside,
    judge,
    judge_sources,
    missing,
)
from agent.lab.plan import LabOutside, backend_pod, outside_routes, plan_lab, routes
from agent.model.compile import compile
from agent.model.nodestate import Backend, Frontend, NodeState, ServiceEntry
from agent.model.outcome import (
    BACKENDS,
    CLUSTER_BACKENDS,
    DROPPED,
    KEPT,
    LOCAL_BACKENDS,
    REFUSED,
    SNAT,
    used_set,
)
from agent.model.types import ClusterState
from agent.sources.manifests import load_manifests, manifest_files, read_objects

from ..builders import default_nodes, make_endpoint, make_service, make_slice, spec, state_of

EXAMPLES = Path(__file__).parents[2] / "examples"
CLIENT = "10.244.1.254"
OUTSIDE = "192.0.2.100"
NODE_A = "192.0.2.10"


def node_states(state: ClusterState) -> list[NodeState]:
    """Every Node's NodeState: where the lab takes the Service addresses from."""
    return [compile(state, name) for name in sorted(state.nodes)]


def entry_of(*objects, node: str = "node-a") -> ServiceEntry:
    (entry,) = compile(state_of(*default_nodes(), *objects), node).services
    return entry


def frontend(entry: ServiceEntry, kind: str) -> Frontend:
    return next(f for f in entry.frontends if f.type == kind)


def lab_pods(backend: Backend) -> tuple[str | None, str]:
    """Every 10.244.x address is a lab pod named after it; the rest are not in the lab."""
    if backend.ip.startswith("10.244."):
        return f"default/pod-{backend.ip.rsplit('.', 1)[1]}", ""
    return None, "in remote cluster member2"


def web(*endpoints, mutate=None) -> list:
    return [
        make_service(name="web", mutate=mutate),
        make_slice(service="web", endpoints=list(endpoints)),
    ]


# --- which set a packet from a pod uses ------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "kind", "expected_set"),
    [
        pytest.param(None, "ClusterIP", CLUSTER_BACKENDS, id="a ClusterIP uses clusterBackends"),
        pytest.param(
            spec(internalTrafficPolicy="Local"), "ClusterIP", LOCAL_BACKENDS,
            id="a ClusterIP under internalTrafficPolicy Local uses localBackends",
        ),
        pytest.param(
            spec(type="NodePort", externalTrafficPolicy="Local",
                 ports=[{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}]),
            "NodePort", CLUSTER_BACKENDS,
            id="a NodePort under externalTrafficPolicy Local still uses clusterBackends from a pod",
        ),
    ],
)  # fmt: skip
def test_the_set_a_pod_uses(mutate, kind, expected_set) -> None:
    entry = entry_of(*web(make_endpoint("10.244.1.5", "node-a"), mutate=mutate))
    name, _ = used_set(entry, frontend(entry, kind))
    assert name == expected_set


def test_a_node_port_under_etp_local_expects_remote_backends_too() -> None:
    node_port = spec(
        type="NodePort", externalTrafficPolicy="Local",
        ports=[{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}],
    )  # fmt: skip
    entry = entry_of(*web(make_endpoint("10.244.1.5", "node-a"),
                          make_endpoint("10.244.3.9", "node-c"), mutate=node_port))  # fmt: skip
    expectation = expect(entry, frontend(entry, "NodePort"), CLIENT, "ebpf", lab_pods)
    assert expectation.kind == BACKENDS
    assert expectation.backends == ("default/pod-5", "default/pod-9")


# --- refused or dropped -------------------------------------------------------------------


def test_a_service_without_endpoints_is_refused() -> None:
    entry = entry_of(*web())
    expectation = expect(entry, frontend(entry, "ClusterIP"), CLIENT, "ebpf", lab_pods)
    assert (expectation.kind, expectation.describe) == (REFUSED, "refused (no endpoints)")


def test_internal_traffic_policy_local_without_a_local_endpoint_drops() -> None:
    entry = entry_of(*web(make_endpoint("10.244.3.9", "node-c"),
                          mutate=spec(internalTrafficPolicy="Local")))  # fmt: skip
    expectation = expect(entry, frontend(entry, "ClusterIP"), CLIENT, "iptables", lab_pods)
    assert expectation.kind == DROPPED
    assert expectation.uses == "localBackends (empty)"


def test_a_load_balancer_source_range_drops_pods_on_both_dataplanes() -> None:
    load_balancer = spec(
        type="LoadBalancer", loadBalancerSourceRanges=["198.51.100.0/24"],
        ports=[{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}],
    )  # fmt: skip

    def mutate(obj) -> None:
        load_balancer(obj)
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}

    entry = entry_of(*web(make_endpoint("10.244.1.5", "node-a"), mutate=mutate))
    vip = frontend(entry, "LoadBalancer")
    assert expect(entry, vip, CLIENT, "iptables", lab_pods).kind == DROPPED
    assert expect(entry, vip, CLIENT, "ebpf", lab_pods).kind == DROPPED
    allowed = expect(entry, vip, "198.51.100.7", "iptables", lab_pods)
    assert allowed.kind == BACKENDS


# --- from outside the cluster --------------------------------------------------------------

NODE_PORT = [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}]


def external(etp: str = "Cluster", ranges: list[str] | None = None):
    """A LoadBalancer Service (so NodePort, ExternalIP and VIP frontends) with this
    externalTrafficPolicy and these loadBalancerSourceRanges."""

    def mutate(obj) -> None:
        obj["spec"].update(type="LoadBalancer", externalTrafficPolicy=etp, ports=NODE_PORT,
                           externalIPs=["203.0.113.7"])  # fmt: skip
        if ranges is not None:
            obj["spec"]["loadBalancerSourceRanges"] = ranges
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}

    return mutate


LOCAL_AND_REMOTE = (make_endpoint("10.244.1.5", "node-a"), make_endpoint("10.244.2.7", "node-b"))
REMOTE_ONLY = (make_endpoint("10.244.2.7", "node-b"),)


@pytest.mark.parametrize(
    ("etp", "endpoints", "kind", "expected_set"),
    [
        pytest.param("Cluster", LOCAL_AND_REMOTE, "NodePort", CLUSTER_BACKENDS,
                     id="a NodePort under externalTrafficPolicy Cluster uses clusterBackends"),
        pytest.param("Local", LOCAL_AND_REMOTE, "NodePort", LOCAL_BACKENDS,
                     id="a NodePort under externalTrafficPolicy Local uses localBackends"),
        pytest.param("Local", LOCAL_AND_REMOTE, "ExternalIP", LOCAL_BACKENDS,
                     id="an ExternalIP under externalTrafficPolicy Local uses localBackends"),
        pytest.param("Local", LOCAL_AND_REMOTE, "LoadBalancer", LOCAL_BACKENDS,
                     id="a VIP under externalTrafficPolicy Local uses localBackends"),
        pytest.param("Local", LOCAL_AND_REMOTE, "ClusterIP", CLUSTER_BACKENDS,
                     id="a ClusterIP reached from outside keeps its one set"),
    ],
)  # fmt: skip
def test_the_set_an_outside_client_uses(etp, endpoints, kind, expected_set) -> None:
    entry = entry_of(*web(*endpoints, mutate=external(etp)))
    name, _ = used_set(entry, frontend(entry, kind), from_outside=True)
    assert name == expected_set


@pytest.mark.parametrize(
    ("etp", "endpoints", "ranges", "kind", "dataplane", "expected"),
    [
        pytest.param("Cluster", LOCAL_AND_REMOTE, None, "NodePort", "ebpf",
                     (BACKENDS, ("default/pod-5", "default/pod-7")),
                     id="Cluster policy answers from every endpoint"),
        pytest.param("Local", LOCAL_AND_REMOTE, None, "NodePort", "iptables",
                     (BACKENDS, ("default/pod-5",)),
                     id="Local policy answers from the local endpoint only"),
        pytest.param("Local", REMOTE_ONLY, None, "NodePort", "ebpf", (DROPPED, ()),
                     id="Local policy without a local endpoint drops"),
        pytest.param("Local", REMOTE_ONLY, None, "LoadBalancer", "iptables", (DROPPED, ()),
                     id="Local policy without a local endpoint drops at the VIP too"),
        pytest.param("Cluster", (), None, "ExternalIP", "ebpf", (REFUSED, ()),
                     id="a Service without endpoints refuses outside clients"),
        pytest.param("Local", (), None, "NodePort", "ebpf", (REFUSED, ()),
                     id="a Service without endpoints refuses under Local policy too"),
        pytest.param("Cluster", LOCAL_AND_REMOTE, ["198.51.100.0/24"], "LoadBalancer", "ebpf",
                     (DROPPED, ()), id="a source range that does not admit the client drops"),
        pytest.param("Cluster", LOCAL_AND_REMOTE, ["192.0.2.0/24"], "LoadBalancer", "iptables",
                     (BACKENDS, ("default/pod-5", "default/pod-7")),
                     id="a source range that admits the client answers"),
        pytest.param("Cluster", LOCAL_AND_REMOTE, ["198.51.100.0/24"], "NodePort", "ebpf",
                     (BACKENDS, ("default/pod-5", "default/pod-7")),
                     id="source ranges never apply to NodePorts"),
        pytest.param("Cluster", LOCAL_AND_REMOTE, ["198.51.100.0/24"], "ExternalIP", "iptables",
                     (BACKENDS, ("default/pod-5", "default/pod-7")),
                     id="source ranges never apply to ExternalIPs"),
    ],
)  # fmt: skip
def test_what_an_outside_client_sees(etp, endpoints, ranges, kind, dataplane, expected) -> None:
    entry = entry_of(*web(*endpoints, mutate=external(etp, ranges)))
    expectation = expect_from_outside(entry, frontend(entry, kind), OUTSIDE, dataplane,
                                      lab_pods)  # fmt: skip
    assert (expectation.kind, expectation.backends) == expected
    if expectation.kind == BACKENDS:
        assert expectation.uses.endswith("(from outside)")


@pytest.mark.parametrize(
    ("etp", "dataplane", "sources"),
    [
        pytest.param("Local", "ebpf", {"default/pod-5": KEPT},
                     id="Local policy keeps the client address (eBPF)"),
        pytest.param("Local", "iptables", {"default/pod-5": KEPT},
                     id="Local policy keeps the client address (iptables)"),
        pytest.param("Cluster", "ebpf", {"default/pod-5": KEPT, "default/pod-7": SNAT},
                     id="eBPF under Cluster policy translates the source for other nodes only"),
        pytest.param("Cluster", "iptables", {"default/pod-5": SNAT, "default/pod-7": SNAT},
                     id="iptables under Cluster policy masquerades every backend's traffic"),
    ],
)  # fmt: skip
def test_the_source_address_a_backend_sees(etp, dataplane, sources) -> None:
    entry = entry_of(*web(*LOCAL_AND_REMOTE, mutate=external(etp)))
    expectation = expect_from_outside(entry, frontend(entry, "NodePort"), OUTSIDE, dataplane,
                                      lab_pods)  # fmt: skip
    assert dict(expectation.sources) == sources


MIXED = Expectation(BACKENDS, "clusterBackends (from outside)", ("default/a", "default/b"),
                    sources=(("default/a", KEPT), ("default/b", SNAT)))  # fmt: skip
NODE_ADDRESSES = {NODE_A, "2001:db8::10", "169.254.1.1"}


@pytest.mark.parametrize(
    ("peers", "ok"),
    [
        pytest.param({"default/a": {OUTSIDE: 3}, "default/b": {NODE_A: 4}}, True,
                     id="the client's address kept and the node's where promised hold"),
        pytest.param({"default/a": {OUTSIDE: 3}, "default/b": {"169.254.1.1": 4}}, True,
                     id="SNAT to any address of the node holds"),
        pytest.param({"default/a": {NODE_A: 3}}, False,
                     id="a translated source where the client's was promised fails"),
        pytest.param({"default/b": {OUTSIDE: 2}}, False,
                     id="the client's address where SNAT was promised fails"),
        pytest.param({"default/b": {"192.0.2.11": 2}}, False,
                     id="another node's address where this node's was promised fails"),
        pytest.param({"default/a": {OUTSIDE: 1, "?": 1}}, False,
                     id="an answer without the source seen fails"),
        pytest.param({}, True, id="nothing to judge without answers"),
    ],
)  # fmt: skip
def test_judge_sources(peers, ok) -> None:
    verdict = judge_sources(MIXED, peers, (OUTSIDE, "2001:db8::100"), NODE_ADDRESSES)
    assert verdict.ok is ok, verdict.note


# --- reachability ---------------------------------------------------------------------------


def test_backends_the_lab_cannot_reach_are_left_out_and_listed() -> None:
    entry = entry_of(*web(make_endpoint("10.244.2.7", "node-b"),
                          make_endpoint("10.245.1.18", "node-a")))  # fmt: skip
    expectation = expect(entry, frontend(entry, "ClusterIP"), CLIENT, "ebpf", lab_pods)
    assert expectation.backends == ("default/pod-7",)
    assert expectation.excluded == ("10.245.1.18:8080 (in remote cluster member2)",)


def examples_plan():
    state, _ = load_manifests([EXAMPLES])
    slices = [
        obj for path in manifest_files([EXAMPLES]) for _, obj in read_objects(path, [])
        if obj.get("kind") == "EndpointSlice"
    ]  # fmt: skip
    return plan_lab(slices, state, node_states(state)), state


def test_the_examples_plan_three_nodes_with_pods_and_leaves_out_the_remote_cluster() -> None:
    plan, _ = examples_plan()
    assert [(n.name, n.ipv4, n.ipv6, n.pod_prefixes) for n in plan.nodes] == [
        ("node-a", "192.0.2.10", "2001:db8::10", ("10.244.1.0/24", "fd00:244:1::/64")),
        ("node-b", "192.0.2.11", "2001:db8::11", ("10.244.2.0/24", "fd00:244:2::/64")),
        ("node-c", "192.0.2.12", None, ("10.244.3.0/24",)),
    ]
    assert {(u.ip, u.reason) for u in plan.unreachable} == {
        ("10.245.1.18", "in remote cluster member2"),
        ("10.245.2.18", "in remote cluster member2"),
    }
    assert plan.pod_at("10.245.1.18") is None  # names node-a, but lives in member2


def test_a_dual_stack_pod_is_one_pod_and_hostnames_name_pods() -> None:
    plan, _ = examples_plan()
    api = plan.pod_at("fd00:244:2::17")
    assert api is not None and (api.full_name, api.ipv4) == ("default/api-b", "10.244.2.17")
    leader = plan.pod_at("10.244.1.100")  # listed by the headless LWS slice with a hostname
    assert leader is not None and (leader.full_name, leader.tcp_ports) == ("ml/llm-0", (8000,))
    shared = plan.pod_at("10.244.1.53")  # one address in two Services' slices: one pod
    assert shared is not None and shared.udp_ports == (5353,)


def test_each_node_gets_a_client_on_a_free_address() -> None:
    plan, _ = examples_plan()
    clients = {p.node: (p.name, p.ipv4, p.ipv6) for p in plan.pods if p.client}
    assert clients == {
        "node-a": ("client-a", "10.244.1.254", "fd00:244:1::254"),
        "node-b": ("client-b", "10.244.2.254", "fd00:244:2::254"),
        "node-c": ("client-c", "10.244.3.254", None),
    }


def test_nodes_route_the_other_nodes_pod_prefixes_in_the_families_they_have() -> None:
    plan, _ = examples_plan()
    assert routes(plan, "node-c") == [
        ("10.244.1.0/24", "192.0.2.10"),
        ("10.244.2.0/24", "192.0.2.11"),
    ]
    assert ("10.244.3.0/24", "192.0.2.12") in routes(plan, "node-a")


def test_the_outside_client_is_outside_every_range_and_routes_external_addresses_via_node_a(
) -> None:  # fmt: skip
    plan, _ = examples_plan()
    assert plan.outside == LabOutside("outside", "192.0.2.100", "2001:db8::100", "node-a")
    # not shop's second ingress, 203.0.113.10 (Proxy mode: no VIP a node answers for)
    assert plan.external_addresses == ("203.0.113.7", "203.0.113.9", "203.0.113.20")
    assert outside_routes(plan) == [
        ("192.0.2.10/32", None), ("2001:db8::10/128", None),
        ("192.0.2.11/32", None), ("2001:db8::11/128", None),
        ("192.0.2.12/32", None),  # node-c has no IPv6 address
        ("203.0.113.7/32", "192.0.2.10"), ("203.0.113.9/32", "192.0.2.10"),
        ("203.0.113.20/32", "192.0.2.10"),
    ]  # fmt: skip


def test_the_outside_client_skips_service_addresses_and_pod_prefixes() -> None:
    pods = [make_endpoint("10.244.1.5", "node-a")]
    in_use = spec(externalIPs=["192.0.2.100", "192.0.2.101"])
    state = state_of(*default_nodes(), *web(*pods, mutate=in_use))
    plan = plan_lab([make_slice(service="web", endpoints=pods)], state, node_states(state))
    assert plan.outside is not None and plan.outside.ipv4 == "192.0.2.102"

    # Pods in 192.0.2.0/24 would make any address there pass for a pod: none is taken.
    pods = [make_endpoint("192.0.2.50", "node-a")]
    state = state_of(*default_nodes(), *web(*pods))
    plan = plan_lab([make_slice(service="web", endpoints=pods)], state, node_states(state))
    assert plan.outside is not None and plan.outside.ipv4 is None
    assert plan.outside.ipv6 == "2001:db8::100"  # node-a has IPv6, no pod prefix holds it


def test_the_service_addresses_are_the_frontends_the_agents_program() -> None:
    """The lab routes the addresses of the NodeStates' frontends: an ExternalIP of a family
    the Service has no ClusterIP in is no frontend, so neither a Service address nor
    taken from the outside client."""
    pods = [make_endpoint("10.244.1.5", "node-a")]
    other_family = spec(externalIPs=["192.0.2.100", "2001:db8::100"])
    state = state_of(*default_nodes(), *web(*pods, mutate=other_family))
    plan = plan_lab([make_slice(service="web", endpoints=pods)], state, node_states(state))
    frontends = {
        fe.ip
        for node_state in node_states(state)
        for entry in node_state.services
        for fe in entry.frontends
        if fe.type != "NodePort"
    }
    assert set(plan.service_addresses) == frontends
    assert "2001:db8::100" not in plan.service_addresses
    assert plan.external_addresses == ("192.0.2.100",)
    assert plan.outside is not None
    assert (plan.outside.ipv4, plan.outside.ipv6) == ("192.0.2.101", "2001:db8::100")


def test_the_outside_client_reaches_backends_through_its_entry_node() -> None:
    plan, _ = examples_plan()
    assert plan.outside is not None
    pod, _ = backend_pod(plan, plan.outside, "10.244.2.17", "TCP", 8080)  # api-b, on node-b
    assert pod is not None and pod.full_name == "default/api-b"


def test_headless_services_are_listed_as_not_proxied() -> None:
    plan, _ = examples_plan()
    assert plan.not_proxied == (
        ("ml/llm-0", "headless: not proxied (as kube-proxy)"),
        ("ml/llm-1", "headless: not proxied (as kube-proxy)"),
    )


def test_a_backend_pod_that_does_not_serve_the_port_is_unreachable() -> None:
    plan, _ = examples_plan()
    client = plan.client_of("node-a")
    pod, _ = backend_pod(plan, client, "10.244.2.7", "TCP", 8080)
    assert pod is not None and pod.full_name == "default/web-b"
    pod, reason = backend_pod(plan, client, "10.244.2.7", "UDP", 8080)
    assert pod is None and "serves no 8080/UDP" in reason


def test_the_examples_expectations_from_node_a() -> None:
    plan, state = examples_plan()
    client = plan.client_of("node-a")

    def locate(backend: Backend) -> tuple[str | None, str]:
        pod, reason = backend_pod(plan, client, backend.ip, "TCP", backend.port)
        if pod is None:
            pod, reason = backend_pod(plan, client, backend.ip, "UDP", backend.port)
        return (pod.full_name if pod else None), reason

    node_state = compile(state, "node-a")
    found = {
        (e.name, f.type): expect(e, f, client.ipv4 or "", "ebpf", locate)
        for e in node_state.services
        if e.ip_family == "IPv4"
        for f in e.frontends
    }
    assert found["web", "ClusterIP"].backends == ("default/web-a", "default/web-b")  # not web-c
    assert found["sticky", "ClusterIP"].affinity
    assert found["node-cache", "ClusterIP"].backends == ("default/dns-cache-a",)
    assert found["search", "ClusterIP"].backends == ("default/search-b",)  # LocalFirst
    assert found["checkout", "ClusterIP"].backends == ("default/checkout-a",)  # terminating


# --- judging --------------------------------------------------------------------------------

TWO = Expectation(BACKENDS, "clusterBackends", ("default/a", "default/b"))


@pytest.mark.parametrize(
    ("expectation", "counts", "errors", "ok"),
    [
        pytest.param(TWO, {"default/a": 9, "default/b": 11}, {}, True,
                     id="answers from every expected backend hold"),
        pytest.param(TWO, {"default/a": 19, "default/c": 1}, {}, False,
                     id="an answer from outside the set fails"),
        pytest.param(TWO, {"default/a": 30}, {}, False,
                     id="a small set that is not covered after enough answers fails"),
        pytest.param(TWO, {"default/a": 8}, {}, True,
                     id="too few answers to judge coverage hold"),
        pytest.param(TWO, {"default/a": 10, "default/b": 5}, {"timeout": 5}, False,
                     id="timeouts fail when every backend is reachable"),
        pytest.param(
            Expectation(BACKENDS, "clusterBackends", ("default/a",), ("10.245.1.18:8080 (x)",)),
            {"default/a": 10}, {"timeout": 10}, True,
            id="timeouts hold when some backends are outside the lab",
        ),
        pytest.param(
            Expectation(BACKENDS, "clusterBackends", ("default/a", "default/b"), affinity=True),
            {"default/b": 20}, {}, True, id="affinity holds with one backend for one client",
        ),
        pytest.param(
            Expectation(BACKENDS, "clusterBackends", ("default/a", "default/b"), affinity=True),
            {"default/a": 10, "default/b": 10}, {}, False,
            id="affinity fails when one client reaches two backends",
        ),
        pytest.param(Expectation(DROPPED, "localBackends (empty)"), {}, {"timeout": 3}, True,
                     id="a drop holds when every request times out"),
        pytest.param(Expectation(DROPPED, "localBackends (empty)"), {}, {"refused": 3}, False,
                     id="a drop fails when the requests are refused"),
        pytest.param(Expectation(REFUSED, "clusterBackends (empty)"), {}, {"refused": 3}, True,
                     id="a refusal holds when every request is refused"),
        pytest.param(Expectation(REFUSED, "clusterBackends (empty)"), {}, {"timeout": 3}, False,
                     id="a refusal fails when the requests time out"),
        pytest.param(Expectation(REFUSED, "clusterBackends (empty)"), {"default/a": 1}, {}, False,
                     id="a refusal fails when anything answers"),
    ],
)  # fmt: skip
def test_judge(expectation, counts, errors, ok) -> None:
    verdict = judge(expectation, counts, errors)
    assert verdict.ok is ok, verdict.note


def test_coverage_is_judged_for_small_sets_without_affinity_after_enough_answers() -> None:
    six = Expectation(BACKENDS, "clusterBackends", tuple(f"default/p{i}" for i in range(6)))
    sticky = Expectation(BACKENDS, "clusterBackends", TWO.backends, affinity=True)
    assert (coverage_sample(1), coverage_sample(2), coverage_sample(3)) == (1, 21, 37)
    assert coverage_required(TWO, 21) and not coverage_required(TWO, 20)
    assert not coverage_required(six, 1000) and not coverage_required(sticky, 1000)
    assert missing(TWO, {"default/a": 3}) == ["default/b"]
