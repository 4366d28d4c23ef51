"""Which endpoints each kind of traffic uses: kube-proxy's CategorizeEndpoints, topology
hints, traffic policies, topology keys and multi-cluster preference (docs/semantics.md).

Each case compiles one Service "svc" (ClusterIP 10.96.0.1, port http 80) on node-a and
compares its backend sets, written as "ip:port". Address plan: tests/builders.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from agent.model.compile import CompileOptions, compile

from ..builders import Obj, default_nodes, make_endpoint, make_service, make_slice, spec, state_of

ep = make_endpoint
KARMADA = {"endpointslice.karmada.io/provision-cluster": "member2"}


def remote_slice(name: str, endpoints: list[Obj], **labels: str) -> Obj:
    """A slice dispatched by Karmada from cluster member2."""

    def mutate(obj: Obj) -> None:
        obj["metadata"]["annotations"] = dict(KARMADA)
        obj["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"] = (
            "endpointslice-dispatch-controller.karmada.io"
        )
        obj["metadata"]["labels"].update(labels)

    return make_slice(name=name, endpoints=endpoints, mutate=mutate)


def annotate(annotations: dict[str, str]) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        obj["metadata"]["annotations"] = dict(annotations)

    return mutate


def nodeport(etp: str = "Cluster", itp: str = "Cluster") -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        obj["spec"].update(type="NodePort", externalTrafficPolicy=etp, internalTrafficPolicy=itp)
        obj["spec"]["ports"][0]["nodePort"] = 30080

    return mutate


def topology_keys(keys: str) -> Callable[[Obj], None]:
    return annotate({"kube-bpf-proxy.io/topology-keys": keys})


local_first = annotate({"kube-bpf-proxy.io/multi-cluster": "LocalFirst"})


@dataclass
class Case:
    name: str
    slices: list[Obj]
    cluster: list[str] | None  # expected clusterBackends ("ip:port"), None = null
    local: list[str] | None = None  # expected localBackends
    has_endpoints: bool = True
    topology: str = "None"
    service: Obj = field(default_factory=make_service)
    options: CompileOptions = field(default_factory=CompileOptions)
    nodes: list[Obj] = field(default_factory=default_nodes)


CASES = [
    # --- readiness (kube-proxy: ready, else serving-terminating) ---------------------------
    Case("ready endpoints are used and unready ones are not",
        [make_slice(
            endpoints=[ep("10.244.1.5", "node-a"), ep("10.244.2.5", "node-b", ready=False)])],
        ["10.244.1.5:8080"]),
    Case("nil ready and serving conditions mean ready",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b", ready=None)])], ["10.244.2.5:8080"]),
    Case("with no ready endpoint the serving terminating ones are used",
        [make_slice(endpoints=[
            ep("10.244.1.5", "node-a", ready=False, serving=True, terminating=True),
            ep("10.244.2.5", "node-b", ready=False, serving=False, terminating=False)])],
        ["10.244.1.5:8080"]),
    Case("terminating endpoints are not used while a ready one exists",
        [make_slice(endpoints=[
            ep("10.244.1.5", "node-a", ready=False, serving=True, terminating=True),
            ep("10.244.2.5", "node-b")])], ["10.244.2.5:8080"]),
    Case("terminating endpoints that stopped serving are never used",
        [make_slice(
            endpoints=[ep("10.244.1.5", "node-a", ready=False, serving=False, terminating=True)])],
        [], has_endpoints=False),
    Case("a Service without slices has no endpoints", [], [], has_endpoints=False),
    # --- merging slices -----------------------------------------------------------------
    Case("a duplicate ip:port across slices appears once",
        [make_slice(name="svc-1", endpoints=[ep("10.244.1.5", "node-a")]),
            make_slice(name="svc-2",
                endpoints=[ep("10.244.1.5", "node-a"), ep("10.244.2.5", "node-b")])],
        ["10.244.1.5:8080", "10.244.2.5:8080"]),
    Case("the same port name maps to different target ports in different slices",
        [make_slice(name="svc-1", endpoints=[ep("10.244.1.5", "node-a")], port=8080),
            make_slice(name="svc-2", endpoints=[ep("10.244.2.5", "node-b")], port=9090)],
        ["10.244.1.5:8080", "10.244.2.5:9090"]),
    Case("slice ports of another name are not used",
        [make_slice(endpoints=[ep("10.244.1.5", "node-a")], port_name="metrics")], [],
        has_endpoints=False),
    Case("only the first address of an endpoint is used",
        [make_slice(endpoints=[{"addresses": ["10.244.1.5", "10.244.1.6"], "nodeName": "node-a"}])],
        ["10.244.1.5:8080"]),
    Case("backends are sorted numerically by ip, then by port",
        [make_slice(name="a", endpoints=[ep("10.244.1.10", "node-a"), ep("10.244.1.9", "node-a")]),
            make_slice(name="b", endpoints=[ep("10.244.1.9", "node-a")], port=80)],
        ["10.244.1.9:80", "10.244.1.9:8080", "10.244.1.10:8080"]),
    # --- topology hints -----------------------------------------------------------------
    Case("zone hints select same-zone endpoints when every ready endpoint has one",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b", zone_hints=["zone-1"]),
            ep("10.244.3.5", "node-c", zone_hints=["zone-2"])])], ["10.244.2.5:8080"],
        topology="PreferSameZone"),
    Case("zone hints are ignored when one ready endpoint has none",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b", zone_hints=["zone-1"]),
            ep("10.244.3.5", "node-c")])], ["10.244.2.5:8080", "10.244.3.5:8080"]),
    Case("an unready endpoint without hints does not disable zone hints",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b", zone_hints=["zone-1"]),
            ep("10.244.3.5", "node-c", zone_hints=["zone-2"]),
            ep("10.244.3.6", "node-c", ready=False)])], ["10.244.2.5:8080"],
        topology="PreferSameZone"),
    Case("zone hints are ignored when none names this node's zone",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b", zone_hints=["zone-3"]),
            ep("10.244.3.5", "node-c", zone_hints=["zone-2"])])],
        ["10.244.2.5:8080", "10.244.3.5:8080"]),
    Case("a node without a zone label ignores zone hints",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b", zone_hints=["zone-1"]),
            ep("10.244.3.5", "node-c", zone_hints=["zone-2"])])],
        ["10.244.2.5:8080", "10.244.3.5:8080"], nodes=[]),
    Case("node hints win over zone hints",
        [make_slice(endpoints=[
            ep("10.244.1.5", "node-a", zone_hints=["zone-1"], node_hints=["node-a"]),
            ep("10.244.2.5", "node-b", zone_hints=["zone-1"], node_hints=["node-b"])])],
        ["10.244.1.5:8080"], topology="PreferSameNode"),
    Case("node hints naming no endpoint for this node fall back to zone hints",
        [make_slice(endpoints=[
            ep("10.244.2.5", "node-b", zone_hints=["zone-1"], node_hints=["node-b"]),
            ep("10.244.3.5", "node-c", zone_hints=["zone-2"], node_hints=["node-c"])])],
        ["10.244.2.5:8080"], topology="PreferSameZone"),
    Case("the serving terminating fallback ignores hints",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b", ready=False, serving=True,
            terminating=True, zone_hints=["zone-1"]),
            ep("10.244.3.5", "node-c", ready=False, serving=True, terminating=True,
                zone_hints=["zone-2"])])], ["10.244.2.5:8080", "10.244.3.5:8080"]),
    # --- traffic policies ---------------------------------------------------------------
    Case("internalTrafficPolicy Local uses only this node's endpoints and no cluster set",
        [make_slice(endpoints=[ep("10.244.1.5", "node-a"), ep("10.244.2.5", "node-b")])], None,
        local=["10.244.1.5:8080"],
        service=make_service(mutate=spec(internalTrafficPolicy="Local"))),
    Case("internalTrafficPolicy Local without a local endpoint leaves an empty set (drop)",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b")])], None, local=[], has_endpoints=True,
        service=make_service(mutate=spec(internalTrafficPolicy="Local"))),
    Case("internalTrafficPolicy Local falls back to local serving terminating endpoints",
        [make_slice(endpoints=[
            ep("10.244.1.5", "node-a", ready=False, serving=True, terminating=True),
            ep("10.244.2.5", "node-b")])], None, local=["10.244.1.5:8080"],
        service=make_service(mutate=spec(internalTrafficPolicy="Local"))),
    Case("internalTrafficPolicy Local ignores topology hints",
        [make_slice(endpoints=[ep("10.244.1.5", "node-a", zone_hints=["zone-2"]),
            ep("10.244.3.5", "node-c", zone_hints=["zone-1"])])], None, local=["10.244.1.5:8080"],
        service=make_service(mutate=spec(internalTrafficPolicy="Local"))),
    Case("externalTrafficPolicy Local keeps cluster backends for pods and adds local ones",
        [make_slice(endpoints=[ep("10.244.1.5", "node-a"), ep("10.244.2.5", "node-b")])],
        ["10.244.1.5:8080", "10.244.2.5:8080"], local=["10.244.1.5:8080"],
        service=make_service(mutate=nodeport(etp="Local"))),
    Case("externalTrafficPolicy Local on a Service without external frontends has no effect",
        [make_slice(endpoints=[ep("10.244.1.5", "node-a"), ep("10.244.2.5", "node-b")])],
        ["10.244.1.5:8080", "10.244.2.5:8080"],
        service=make_service(mutate=spec(externalTrafficPolicy="Local"))),
    Case("both policies Local: pods still reach the external frontends through cluster backends",
        [make_slice(endpoints=[ep("10.244.1.5", "node-a"), ep("10.244.2.5", "node-b")])],
        ["10.244.1.5:8080", "10.244.2.5:8080"], local=["10.244.1.5:8080"],
        service=make_service(mutate=nodeport(etp="Local", itp="Local"))),
    Case("internalTrafficPolicy Local with a Cluster NodePort still has cluster backends",
        [make_slice(endpoints=[ep("10.244.1.5", "node-a"), ep("10.244.2.5", "node-b")])],
        ["10.244.1.5:8080", "10.244.2.5:8080"], local=["10.244.1.5:8080"],
        service=make_service(mutate=nodeport(itp="Local"))),
    # --- multi-cluster ------------------------------------------------------------------
    Case("remote endpoints join one pool with local ones by default (RemoteAndLocal)",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b")]),
            remote_slice("member2-svc-1", [ep("10.245.1.5", "node-x")])],
        ["10.244.2.5:8080", "10.245.1.5:8080"]),
    Case("a remote endpoint on a node named like this one is never local",
        [remote_slice("member2-svc-1", [ep("10.245.1.5", "node-a")])], None, local=[],
        service=make_service(mutate=spec(internalTrafficPolicy="Local"))),
    Case("LocalFirst ignores remote endpoints while a local one is ready",
        [make_slice(
            endpoints=[ep("10.244.2.5", "node-b"), ep("10.244.3.5", "node-c", ready=False)]),
            remote_slice("member2-svc-1", [ep("10.245.1.5", "node-x")])], ["10.244.2.5:8080"],
        topology="LocalCluster", service=make_service(mutate=local_first)),
    Case("LocalFirst uses remote endpoints when no local endpoint is ready",
        [make_slice(
            endpoints=[ep("10.244.2.5", "node-b", ready=False, serving=True, terminating=True)]),
            remote_slice("member2-svc-1", [ep("10.245.1.5", "node-x")])], ["10.245.1.5:8080"],
        topology="AnyCluster", service=make_service(mutate=local_first)),
    Case("LocalFirst with only terminating endpoints everywhere uses all of them",
        [make_slice(
            endpoints=[ep("10.244.2.5", "node-b", ready=False, serving=True, terminating=True)]),
            remote_slice("member2-svc-1",
                [ep("10.245.1.5", "node-x", ready=False, serving=True, terminating=True)])],
        ["10.244.2.5:8080", "10.245.1.5:8080"], topology="AnyCluster",
        service=make_service(mutate=local_first)),
    Case("Cilium's affinity local annotation means LocalFirst",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b")]),
            remote_slice("member2-svc-1", [ep("10.245.1.5", "node-x")])], ["10.244.2.5:8080"],
        topology="LocalCluster",
        service=make_service(mutate=annotate({"service.cilium.io/affinity": "local"}))),
    Case("LocalFirst keeps zone hints working inside this cluster",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b", zone_hints=["zone-1"]),
            ep("10.244.3.5", "node-c", zone_hints=["zone-2"])]),
            remote_slice("member2-svc-1", [ep("10.245.1.5", "node-x", zone_hints=["zone-1"])])],
        ["10.244.2.5:8080"], topology="LocalCluster+PreferSameZone",
        service=make_service(mutate=local_first)),
    Case("remote endpoints' hints name another cluster's zones, so a mixed pool ignores hints",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b", zone_hints=["zone-1"])]),
            remote_slice("member2-svc-1", [ep("10.245.1.5", "node-x", zone_hints=["zone-1"])])],
        ["10.244.2.5:8080", "10.245.1.5:8080"]),
    Case("an MCS slice from this cluster (source-cluster = --cluster-name) is local",
        [make_slice(endpoints=[ep("10.244.1.5", "node-a")],
            mutate=lambda o: o["metadata"]["labels"].update(
                    {"multicluster.kubernetes.io/source-cluster": "member1"}
                ))], None, local=["10.244.1.5:8080"],
        service=make_service(mutate=spec(internalTrafficPolicy="Local")),
        options=CompileOptions(cluster_name="member1")),
    Case("an MCS slice from another cluster is remote",
        [make_slice(endpoints=[ep("10.244.1.5", "node-a")],
            mutate=lambda o: o["metadata"]["labels"].update(
                    {"multicluster.kubernetes.io/source-cluster": "member2"}
                ))], None, local=[],
        service=make_service(mutate=spec(internalTrafficPolicy="Local")),
        options=CompileOptions(cluster_name="member1")),
    # --- topology keys (kube-bpf-proxy.io/topology-keys, KEP-536 semantics) ----------------
    Case("the first topology key shared with a ready endpoint wins",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b"), ep("10.244.3.5", "node-c")])],
        ["10.244.3.5:8080"], topology="example.com/rack",
        service=make_service(
            mutate=topology_keys("example.com/rack,topology.kubernetes.io/zone,*"))),
    Case("a topology key no ready endpoint shares falls through to the next",
        [make_slice(
            endpoints=[ep("10.244.2.5", "node-b"), ep("10.244.3.5", "node-c", ready=False)])],
        ["10.244.2.5:8080"], topology="topology.kubernetes.io/zone",
        service=make_service(
            mutate=topology_keys("example.com/rack,topology.kubernetes.io/zone,*"))),
    Case("the wildcard topology key takes every ready endpoint",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b"), ep("10.245.9.9", "node-z")])],
        ["10.244.2.5:8080", "10.245.9.9:8080"], topology="*",
        service=make_service(mutate=topology_keys("example.com/rack,*"))),
    Case("no topology key matches and no wildcard: no backend for this node (drop)",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b")])], [], has_endpoints=True,
        topology="NoMatch", service=make_service(mutate=topology_keys("example.com/rack"))),
    Case("a topology key this node lacks is skipped",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b")])], ["10.244.2.5:8080"],
        topology="topology.kubernetes.io/zone",
        service=make_service(mutate=topology_keys("example.com/gpu,topology.kubernetes.io/zone"))),
    Case("remote endpoints match only the wildcard topology key",
        [remote_slice("member2-svc-1", [ep("10.245.1.5", "node-c")])], ["10.245.1.5:8080"],
        topology="*", service=make_service(mutate=topology_keys("example.com/rack,*"))),
    Case("topology keys take precedence over hints",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b", zone_hints=["zone-1"]),
            ep("10.244.3.5", "node-c", zone_hints=["zone-2"])])], ["10.244.3.5:8080"],
        topology="example.com/rack",
        service=make_service(mutate=topology_keys("example.com/rack"))),
    Case("--node-label overrides the Node object's label for topology keys",
        [make_slice(endpoints=[ep("10.244.2.5", "node-b"), ep("10.244.3.5", "node-c")])],
        ["10.244.2.5:8080"], topology="example.com/rack",
        service=make_service(mutate=topology_keys("example.com/rack")),
        options=CompileOptions(node_labels={"example.com/rack": "r2"})),
]  # fmt: skip


def addresses(backends: list[dict] | None) -> list[str] | None:
    return None if backends is None else [f"{b['ip']}:{b['port']}" for b in backends]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_selection(case: Case) -> None:
    state = state_of(*case.nodes, case.service, *case.slices)
    (entry,) = compile(state, "node-a", case.options).to_dict()["services"]
    assert addresses(entry["clusterBackends"]) == case.cluster
    assert addresses(entry["localBackends"]) == case.local
    assert entry["hasEndpoints"] is case.has_endpoints
    assert entry["topology"] == case.topology


def test_duplicate_endpoint_prefers_the_copy_that_is_not_terminating() -> None:
    state = state_of(
        make_service(),
        make_slice(
            name="a",
            endpoints=[ep("10.244.1.5", "node-a", ready=False, serving=True, terminating=True)],
        ),
        make_slice(name="b", endpoints=[ep("10.244.1.5", "node-a")]),
    )
    (entry,) = compile(state, "node-a").services
    (backend,) = entry.cluster_backends or ()
    assert (backend.ready, backend.terminating) == (True, False)


def test_remote_backends_name_their_cluster_and_are_never_local() -> None:
    state = state_of(
        *default_nodes(),
        make_service(),
        remote_slice("member2-svc-1", [ep("10.245.1.5", "node-a")]),
        make_slice(
            name="old-flow",
            endpoints=[ep("10.245.2.5", "node-a")],
            mutate=lambda o: o["metadata"]["labels"].update(
                {"endpointslice.kubernetes.io/managed-by": "endpointslice-controller.karmada.io"}
            ),
        ),
    )
    (entry,) = compile(state, "node-a").services
    assert [(b.ip, b.cluster, b.local) for b in entry.cluster_backends or ()] == [
        ("10.245.1.5", "member2", False),
        ("10.245.2.5", "unknown", False),
    ]
