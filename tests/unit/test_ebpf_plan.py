"""NodeState → kernel map contents, ids, ordered writes and capacity (ebpf/maps.py,
translate.py, plan.py).

Address plan (tests/builders.py): this node node-a 192.0.2.10 / 2001:db8::10; pods of
node-a 10.244.1.<n>, node-b 10.244.2.<n>, node-c 10.244.3.<n> (IPv6 fd00:244:<node>::<n>),
all on target port 8080. Service "svc" (and "other") in "default": ClusterIP 10.96.0.1:80
(and 10.96.0.2:80), NodePort 30080, ExternalIP / LoadBalancer VIP 203.0.113.7 / .9.
Maglev cases use a 13-slot table so expectations stay readable.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

from agent.dataplane.base import DataplaneError
from agent.dataplane.ebpf import external, plan
from agent.dataplane.ebpf.abi import const, versioned
from agent.dataplane.ebpf.maglev import maglev_table
from agent.dataplane.ebpf.maps import (
    BackendValue,
    CapacityError,
    FrontendKey,
    KernelContent,
    MapSizes,
    ServiceValue,
    Writes,
    check_capacity,
    diff,
    required_capacity,
)
from agent.dataplane.ebpf.plan import Planner
from agent.dataplane.ebpf.slots import Before, SlotSpace
from agent.dataplane.ebpf.translate import translate
from agent.dataplane.ebpf.writer import FILL_RATIO_MAPS, MapWriter
from agent.metrics import Metrics
from agent.model.compile import CompileOptions, Compiler, compile
from agent.model.conventions import ANNOTATION_LB_ALGORITHM
from agent.model.decode import decode_object
from agent.model.nodestate import Backend, Frontend, NodeInfo, NodeState, ServiceEntry
from agent.model.types import ClusterState

from ..builders import (
    Obj,
    both,
    default_nodes,
    ep,
    ep6,
    make_endpoint,
    make_service,
    make_slice,
    spec,
    state_of,
)
from .strategies import (
    THIS_NODE,
    clusters,
    endpoint_slices,
    histories,
    object_key,
    property_settings,
    services,
)

EMPTY = KernelContent()
MAGLEV_SIZE = 13

SETTINGS = property_settings(HealthCheck.too_slow, HealthCheck.data_too_large)


# --- building NodeStates ---------------------------------------------------------------


def node_port(etp: str = "Cluster", itp: str = "Cluster") -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        obj["spec"].update(type="NodePort", externalTrafficPolicy=etp, internalTrafficPolicy=itp)
        obj["spec"]["ports"][0]["nodePort"] = 30080

    return mutate


def maglev(obj: Obj) -> None:
    obj["metadata"].setdefault("annotations", {})[ANNOTATION_LB_ALGORITHM] = "maglev"


def svc(
    endpoints: list[Obj],
    mutate: Callable[[Obj], None] | None = None,
    name: str = "svc",
    cluster_ip: str = "10.96.0.1",
) -> list[Obj]:
    """A Service and one slice of its IPv4 endpoints."""

    def with_ip(obj: Obj) -> None:
        obj["spec"].update(clusterIP=cluster_ip, clusterIPs=[cluster_ip])
        if mutate:
            mutate(obj)

    return [
        make_service(name=name, mutate=with_ip),
        make_slice(name=f"{name}-1", service=name, endpoints=endpoints),
    ]


def node_state(*objects: Obj) -> NodeState:
    return compile(state_of(*default_nodes(), *objects), "node-a")


def web(endpoints: list[Obj], mutate: Callable[[Obj], None] | None = None) -> NodeState:
    return node_state(*svc(endpoints, mutate))


def bare(content: KernelContent) -> KernelContent:
    """The same content as the agent decodes it from the kernel after a restart."""
    return KernelContent(dict(content.services), dict(content.slots), dict(content.backends))


def follow(*states: NodeState, **kw: Any) -> list[KernelContent]:
    """What one planner holds after each of `states` in turn (copies: it changes its
    content in place)."""
    planner = Planner(**kw)
    return [bare(planner.plan(state).commit()) for state in states]


def planner_after(state: NodeState, **kw: Any) -> Planner:
    """A planner that has planned and committed `state` from empty maps."""
    planner = Planner(**kw)
    planner.plan(state).commit()
    return planner


# --- reading contents back as text ----------------------------------------------------

SERVICE_FLAGS = [
    (const.KBP_SVC_F_HAS_ENDPOINTS, "HAS_ENDPOINTS"),
    (const.KBP_SVC_F_AFFINITY, "AFFINITY"),
    (const.KBP_SVC_F_MAGLEV, "MAGLEV"),
]
BACKEND_FLAGS = [(const.KBP_BE_F_LOCAL, "LOCAL"), (const.KBP_BE_F_TERMINATING, "TERMINATING")]
TYPES = {
    const.KBP_FE_CLUSTER_IP: "ClusterIP",
    const.KBP_FE_NODE_PORT: "NodePort",
    const.KBP_FE_EXTERNAL_IP: "ExternalIP",
    const.KBP_FE_LOAD_BALANCER: "LoadBalancer",
}
PROTOCOLS = {6: "TCP", 17: "UDP", 132: "SCTP"}


def flag_names(value: int, names: list[tuple[int, str]]) -> str:
    return "|".join(name for bit, name in names if value & bit)


def address(addr: str, port: int) -> str:
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def members(content: KernelContent, set_id: int, count: int) -> list[str]:
    if count == 0:
        assert set_id == 0, "an empty set has id 0"
        return []
    ids = content.slots[set_id]
    assert len(ids) == count
    return [address(content.backends[i].addr, content.backends[i].port) for i in ids]


@dataclass(frozen=True)
class Seen:
    """One frontend as a packet sees it."""

    type: str
    flags: str
    outside: list[str]  # the set (for a ClusterIP: the one set)
    pods: list[str]  # the internal set
    affinity: int = 0


def view(content: KernelContent) -> dict[str, Seen]:
    out = {}
    for key, v in content.services.items():
        name = f"{address(key.addr, key.port)}/{PROTOCOLS[key.proto]}"
        out[name] = Seen(
            TYPES[v.type],
            flag_names(v.flags, SERVICE_FLAGS),
            members(content, v.set_id, v.count),
            members(content, v.internal_set_id, v.internal_count),
            v.affinity_timeout,
        )
    return out


def backend_view(content: KernelContent) -> dict[str, str]:
    return {
        address(b.addr, b.port): flag_names(b.flags, BACKEND_FLAGS)
        for b in content.backends.values()
    }


def counts(w: Writes) -> tuple[int, ...]:
    """(counters reset, backends upserted, slots written, services upserted, frontends
    deleted, slots deleted, backends deleted)."""
    return (
        len(w.counters_reset),
        len(w.backends_to_upsert),
        sum(map(len, w.sets_to_write.values())),
        len(w.services_to_upsert),
        len(w.frontends_to_delete),
        sum(w.sets_to_delete.values()),
        len(w.backends_to_delete),
    )


A5, A6 = "10.244.1.5:8080", "10.244.1.6:8080"
B5, C5 = "10.244.2.5:8080", "10.244.3.5:8080"
CIP = "10.96.0.1:80/TCP"
NP = "192.0.2.10:30080/TCP"
HAS = "HAS_ENDPOINTS"


# --- translation -----------------------------------------------------------------------


@dataclass
class Case:
    name: str
    objects: list[Obj]
    frontends: dict[str, Seen]
    backends: dict[str, str] = field(default_factory=dict)  # checked when given


CASES = [
    Case("a ClusterIP uses its cluster backends, from pods and from the node alike",
        svc([ep(5, "node-a"), ep(5, "node-b")]), {CIP: Seen("ClusterIP", HAS, [A5, B5], [A5, B5])},
        {A5: "LOCAL", B5: ""}),
    Case("internalTrafficPolicy Local: the ClusterIP uses only this node's backends",
        svc([ep(5, "node-a"), ep(5, "node-b")], spec(internalTrafficPolicy="Local")),
        {CIP: Seen("ClusterIP", HAS, [A5], [A5])}, {A5: "LOCAL"}),
    Case("internalTrafficPolicy Local without a local backend: an empty set that drops",
        svc([ep(5, "node-b")], spec(internalTrafficPolicy="Local")),
        {CIP: Seen("ClusterIP", HAS, [], [])}, {}),
    Case("no endpoints anywhere: an empty set that rejects", svc([]),
        {CIP: Seen("ClusterIP", "", [], [])}, {}),
    Case("only unready endpoints: an empty set that rejects", svc([ep(5, ready=False)]),
        {CIP: Seen("ClusterIP", "", [], [])}),
    Case("externalTrafficPolicy Cluster: the NodePort uses the cluster backends both ways",
        svc([ep(5, "node-a"), ep(5, "node-b")], node_port()),
        {
            CIP: Seen("ClusterIP", HAS, [A5, B5], [A5, B5]),
            NP: Seen("NodePort", HAS, [A5, B5], [A5, B5]),
        }),
    Case("externalTrafficPolicy Local: the NodePort uses local backends from outside and "
        "cluster backends from pods",
        svc([ep(5, "node-a"), ep(5, "node-b")], node_port(etp="Local")),
        {
            CIP: Seen("ClusterIP", HAS, [A5, B5], [A5, B5]),
            NP: Seen("NodePort", HAS, [A5], [A5, B5]),
        }),
    Case("externalTrafficPolicy Local without a local backend: outside traffic is dropped, "
        "pods still reach the cluster backends",
        svc([ep(5, "node-b")], node_port(etp="Local")),
        {CIP: Seen("ClusterIP", HAS, [B5], [B5]), NP: Seen("NodePort", HAS, [], [B5])}),
    Case("both policies Local: the ClusterIP and outside NodePort traffic stay local, pods "
        "reaching the NodePort use the cluster backends",
        svc([ep(5, "node-a"), ep(5, "node-b")], node_port(etp="Local", itp="Local")),
        {CIP: Seen("ClusterIP", HAS, [A5], [A5]), NP: Seen("NodePort", HAS, [A5], [A5, B5])}),
    Case("internalTrafficPolicy Local with a Cluster NodePort: only the ClusterIP is local",
        svc([ep(5, "node-a"), ep(5, "node-b")], node_port(itp="Local")),
        {CIP: Seen("ClusterIP", HAS, [A5], [A5]), NP: Seen("NodePort", HAS, [A5, B5], [A5, B5])}),
    Case("an ExternalIP and a LoadBalancer VIP follow externalTrafficPolicy like a NodePort",
        svc([ep(5, "node-a"), ep(5, "node-c")],
            both(node_port(etp="Local"), spec(type="LoadBalancer", externalIPs=["203.0.113.7"]),
                lambda o: o.update(status={"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}))),
        {
            CIP: Seen("ClusterIP", HAS, [A5, C5], [A5, C5]),
            NP: Seen("NodePort", HAS, [A5], [A5, C5]),
            "203.0.113.7:80/TCP": Seen("ExternalIP", HAS, [A5], [A5, C5]),
            "203.0.113.9:80/TCP": Seen("LoadBalancer", HAS, [A5], [A5, C5]),
        }),
    Case("sessionAffinity ClientIP sets AFFINITY and the timeout",
        svc([ep(5)],
            spec(sessionAffinity="ClientIP",
                sessionAffinityConfig={"clientIP": {"timeoutSeconds": 600}})),
        {CIP: Seen("ClusterIP", "HAS_ENDPOINTS|AFFINITY", [B5], [B5], 600)}),
    Case("serving terminating backends stand in when none is ready, flagged TERMINATING",
        svc([ep(5, ready=False, serving=True, terminating=True), ep(6, "node-a", ready=False)]),
        {CIP: Seen("ClusterIP", HAS, [B5], [B5])}, {B5: "TERMINATING"}),
    Case("a UDP port is keyed with protocol 17",
        [make_service(mutate=lambda o: o["spec"]["ports"][0].update(protocol="UDP")),
            make_slice(endpoints=[ep(5)], mutate=lambda o: o["ports"][0].update(protocol="UDP"))],
        {"10.96.0.1:80/UDP": Seen("ClusterIP", HAS, [B5], [B5])}),
    Case("a dual-stack Service has an IPv6 frontend over IPv6 backends",
        [make_service(mutate=spec(clusterIP="10.96.0.1", clusterIPs=["10.96.0.1", "fd00:96::1"])),
            make_slice(endpoints=[ep(5)]),
            make_slice(name="svc-6", endpoints=[ep6(5)], family="IPv6")],
        {
            CIP: Seen("ClusterIP", HAS, [B5], [B5]),
            "[fd00:96::1]:80/TCP": Seen(
                "ClusterIP", HAS, ["[fd00:244:2::5]:8080"], ["[fd00:244:2::5]:8080"]
            ),
        }, {B5: "", "[fd00:244:2::5]:8080": ""}),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_translation(case: Case) -> None:
    content = translate(node_state(*case.objects), EMPTY)
    assert view(content) == case.frontends
    if case.backends or not any(s.outside or s.pods for s in case.frontends.values()):
        assert backend_view(content) == case.backends


def test_frontends_of_one_entry_share_its_service_id_and_entries_get_their_own() -> None:
    content = translate(
        node_state(*svc([ep(5)], node_port()), *svc([ep(6)], name="other", cluster_ip="10.96.0.2")),
        EMPTY,
    )  # fmt: skip
    ids = {f"{k.addr}:{k.port}": v.service_id for k, v in content.services.items()}
    assert ids["10.96.0.1:80"] == ids["192.0.2.10:30080"] != ids["10.96.0.2:80"]
    assert 0 not in ids.values()
    backend_services = {address(b.addr, b.port): b.service_id for b in content.backends.values()}
    assert backend_services == {B5: ids["10.96.0.1:80"], "10.244.2.6:8080": ids["10.96.0.2:80"]}


def test_the_same_endpoint_in_two_services_has_one_backend_id_per_service() -> None:
    content = translate(
        node_state(*svc([ep(5)]), *svc([ep(5)], name="other", cluster_ip="10.96.0.2")), EMPTY
    )
    assert len(content.backends) == 2
    assert len({b.service_id for b in content.backends.values()}) == 2


def test_one_set_serves_every_frontend_that_uses_the_same_backends() -> None:
    content = translate(web([ep(5, "node-a"), ep(5)], node_port(etp="Local")), EMPTY)
    cluster_ip = content.services[FrontendKey("10.96.0.1", 80, 6, 4)]
    nodeport = content.services[FrontendKey("192.0.2.10", 30080, 6, 4)]
    assert nodeport.internal_set_id == cluster_ip.set_id == cluster_ip.internal_set_id
    assert nodeport.set_id != cluster_ip.set_id
    assert len(content.slots) == 2
    assert len(content.backends) == 2, "the local backend is in both sets under one id"


def test_an_ipv6_address_with_an_ipv4_tail_is_keyed_in_ipaddress_form() -> None:
    backend = Backend("::10.244.2.5", 8080, "node-b", None, None, False, True, True, False)
    entry = ServiceEntry(
        "default", "svc", "http", "TCP", "IPv6", (Frontend("ClusterIP", "::10.96.0.1", 80),),
        None, "Cluster", "Cluster", None, "None", True, (backend,), None,
    ).sealed()  # fmt: skip
    content = translate(NodeState(NodeInfo("node-a", None, {}, ()), "r", (entry,)), EMPTY)
    (key,) = content.services
    assert key == FrontendKey("::a60:1", 80, 6, 6)
    assert [b.addr for b in content.backends.values()] == ["::af4:205"]


# --- Maglev ----------------------------------------------------------------------------


def test_a_maglev_service_gets_a_full_table_over_its_backends() -> None:
    state = web([ep(5, "node-a"), ep(5), ep(5, "node-c")], maglev)
    content = translate(state, EMPTY, maglev_table_size=MAGLEV_SIZE)
    seen = view(content)[CIP]
    assert seen.flags == "HAS_ENDPOINTS|MAGLEV"
    names = [A5, B5, C5]  # NodeState order: by ip, then port
    expected = [names[i] for i in maglev_table(names, MAGLEV_SIZE)]
    assert seen.outside == seen.pods == expected
    assert len(expected) == MAGLEV_SIZE


def test_removing_a_maglev_backend_writes_a_whole_new_table_then_flips() -> None:
    before, after = follow(
        web([ep(5, "node-a"), ep(5), ep(5, "node-c")], maglev),
        web([ep(5, "node-a"), ep(5)], maglev),
        maglev_table_size=13,
    )
    assert counts(diff(before, after)) == (0, 0, 13, 1, 0, 13, 1)


def test_a_maglev_table_size_that_is_not_prime_is_refused() -> None:
    with pytest.raises(ValueError, match="16384 is not a prime"):
        translate(web([ep(5)], maglev), EMPTY, maglev_table_size=16384)


def test_a_maglev_table_smaller_than_the_backends_names_the_service() -> None:
    with pytest.raises(ValueError, match=r"default/svc port 'http'.*too small for 3"):
        translate(web([ep(5), ep(6), ep(7)], maglev), EMPTY, maglev_table_size=3)


def test_changing_the_maglev_table_size_rewrites_only_maglev_sets() -> None:
    state = node_state(
        *svc([ep(5), ep(6)], maglev), *svc([ep(7)], name="other", cluster_ip="10.96.0.2")
    )
    planner = planner_after(state, maglev_table_size=13)
    small = bare(planner.content)
    planner.maglev_table_size = 17
    large = planner.plan(state).commit()
    assert counts(diff(small, large)) == (0, 0, 17, 1, 0, 13, 0)


# --- stable ids and minimal writes -----------------------------------------------------


def test_the_same_state_again_writes_nothing() -> None:
    endpoints = [ep(5, "node-a"), ep(5), ep(6)]
    first, again = follow(web(endpoints, node_port(etp="Local")),
                          web(endpoints, node_port(etp="Local")))  # a new compile  # fmt: skip
    assert again == first
    assert diff(first, again).empty
    assert diff(first, again).count == 0


def test_a_restart_adopts_every_id_from_the_kernel_and_writes_nothing() -> None:
    objects = [
        *svc([ep(5, "node-a"), ep(5)], both(node_port(etp="Local"), maglev)),
        *svc([ep(6), ep(7)], name="other", cluster_ip="10.96.0.2"),
    ]
    (before,) = follow(node_state(*objects), maglev_table_size=13)
    kernel = bare(before)
    change = Planner(kernel, maglev_table_size=13).plan(node_state(*objects))
    assert change.content == before  # same ids everywhere
    assert change.writes.empty and diff(kernel, change.content).empty


@dataclass
class Change:
    name: str
    before: list[Obj]
    after: list[Obj]
    # (counters reset, backends upserted, slots written, services upserted,
    #  frontends deleted, slots deleted, backends deleted)
    counts: tuple[int, int, int, int, int, int, int]


CHANGES = [
    Change("nothing changed: nothing is written", [ep(1), ep(2)], [ep(1), ep(2)], (0,) * 7),
    Change(
        "an endpoint added: its backend, the new set, the flip, then the old set is deleted",
        [ep(1), ep(2), ep(3)], [ep(1), ep(2), ep(3), ep(4)], (0, 1, 4, 1, 0, 3, 0),
    ),
    Change(
        "an endpoint removed: the new set, the flip, then the old set and the backend go",
        [ep(1), ep(2), ep(3)], [ep(1), ep(3)], (0, 0, 2, 1, 0, 3, 1),
    ),
    Change(
        "an endpoint replaced by another: one backend each way and one set each way",
        [ep(1), ep(2)], [ep(1), ep(3)], (0, 1, 2, 1, 0, 2, 1),
    ),
    Change(
        "the last endpoint removed: the flip to the empty set that rejects",
        [ep(1)], [], (0, 0, 0, 1, 0, 1, 1),
    ),
    Change(
        "the first endpoint added: its backend, its set and the flip",
        [], [ep(1)], (0, 1, 1, 1, 0, 0, 0),
    ),
    Change(
        "an endpoint turning unready: the same as removing it",
        [ep(1), ep(2)], [ep(1), ep(2, ready=False)], (0, 0, 1, 1, 0, 2, 1),
    ),
    Change(
        "an endpoint moving to this node only updates its backend's flags",
        [ep(1), make_endpoint("10.244.2.9", "node-b")],
        [ep(1), make_endpoint("10.244.2.9", "node-a")],
        (0, 1, 0, 0, 0, 0, 0),
    ),
]  # fmt: skip


@pytest.mark.parametrize("restart", [False, True], ids=["same agent", "after a restart"])
@pytest.mark.parametrize("change", CHANGES, ids=lambda c: c.name)
def test_one_change_writes_only_what_it_needs(change: Change, restart: bool) -> None:
    planner = planner_after(web(change.before))
    if restart:
        planner = Planner(bare(planner.content))
    current = bare(planner.content)
    after = planner.plan(web(change.after)).commit()
    writes = diff(current, after)
    assert counts(writes) == change.counts
    assert writes.count == sum(change.counts)


def test_a_removed_backend_frees_its_id_and_a_new_one_does_not_take_it_at_once() -> None:
    first, second, third = follow(
        web([ep(1), ep(2), ep(3)]), web([ep(1), ep(3)]), web([ep(1), ep(3), ep(4)])
    )
    ids = {address(b.addr, b.port): i for i, b in first.backends.items()}
    assert diff(first, second).backends_to_delete == [ids["10.244.2.2:8080"]]
    assert ids["10.244.2.2:8080"] not in second.backends
    (new_id,) = diff(second, third).backends_to_upsert
    assert new_id not in ids.values()


def test_new_ids_wrap_within_the_map_size_and_skip_live_ones() -> None:
    sizes = MapSizes(services=4, slots=4, backends=5)  # backend ids 1..4
    planner = planner_after(web([ep(1), ep(2), ep(3)]), sizes=sizes)
    seen_ids = set(planner.content.backends)
    for n in range(4, 12):  # replace the oldest endpoint, one at a time
        endpoints = [ep(n - 2), ep(n - 1), ep(n)]
        content = planner.plan(web(endpoints)).commit()
        assert all(0 < i < 5 for i in content.backends)
        assert all(0 < s < 4 for s in content.slots)
        seen_ids |= set(content.backends)
    assert seen_ids == {1, 2, 3, 4}


def test_a_new_service_gets_a_fresh_id_whose_counters_are_reset() -> None:
    first, second = follow(
        web([ep(1)]),
        node_state(*svc([ep(1)]), *svc([ep(2)], name="other", cluster_ip="10.96.0.2")),
    )
    (old_id,) = {v.service_id for v in first.services.values()}
    writes = diff(first, second)
    new_id = second.services[FrontendKey("10.96.0.2", 80, 6, 4)].service_id
    assert new_id != old_id
    assert writes.counters_reset == [new_id]
    assert counts(writes) == (1, 1, 1, 1, 0, 0, 0)


def test_a_deleted_service_loses_its_frontends_sets_and_backends() -> None:
    first, second = follow(
        node_state(*svc([ep(1)], node_port()), *svc([ep(2)], name="other", cluster_ip="10.96.0.2")),
        node_state(*svc([ep(2)], name="other", cluster_ip="10.96.0.2")),
    )  # fmt: skip
    assert counts(diff(first, second)) == (0, 0, 0, 0, 2, 1, 1)


def test_a_service_flipping_policy_reuses_its_backends_and_points_at_a_new_set() -> None:
    first, second = follow(
        web([ep(5, "node-a"), ep(5)]),
        web([ep(5, "node-a"), ep(5)], spec(internalTrafficPolicy="Local")),
    )
    # The one-backend local set is new; the cluster set and the remote backend go.
    assert counts(diff(first, second)) == (0, 0, 1, 1, 0, 2, 1)
    assert set(second.backends) < set(first.backends)


def test_a_frontend_two_services_claim_goes_to_the_first_and_passes_on() -> None:
    """ExternalIPs are not unique across Services: the first in NodeState order (by
    namespace/name) answers; when it goes, the next one takes the frontend over."""
    shared = spec(externalIPs=["203.0.113.7"])
    a = svc([ep(1)], shared, name="a", cluster_ip="10.96.0.1")
    b = svc([ep(2)], shared, name="b", cluster_ip="10.96.0.2")
    key = FrontendKey("203.0.113.7", 80, 6, 4)
    first, second, third = follow(node_state(*a, *b), node_state(*b), node_state(*a, *b))
    a_id = first.services[FrontendKey("10.96.0.1", 80, 6, 4)].service_id
    b_id = first.services[FrontendKey("10.96.0.2", 80, 6, 4)].service_id
    assert first.services[key].service_id == a_id
    assert second.services[key].service_id == b_id
    # The oracle, given what the planner held, gives the same.
    planner = planner_after(node_state(*a, *b))
    assert second == translate(node_state(*b), planner.content, built=planner.index)
    assert third.services[key].service_id != b_id  # "a" is back (with a new id)


# --- diff ------------------------------------------------------------------------------


def test_diff_refuses_to_rewrite_a_live_set_in_place() -> None:
    current = translate(web([ep(1), ep(2)]), EMPTY)
    (set_id,) = current.slots
    tampered = KernelContent(
        dict(current.services), {set_id: current.slots[set_id][:1]}, dict(current.backends)
    )
    with pytest.raises(ValueError, match=f"set {set_id} would be rewritten in place"):
        diff(current, tampered)


def test_diff_between_contents_from_elsewhere_compares_everything() -> None:
    """A content not derived from `current` (e.g. decoded twice) is compared in full."""
    current = translate(web([ep(1), ep(2)]), EMPTY)
    changed = translate(web([ep(1)]), current)
    assert counts(diff(bare(current), bare(changed))) == counts(diff(current, changed))


def test_writes_list_every_element_in_phase_order() -> None:
    current = translate(web([ep(1), ep(2)]), EMPTY)
    desired = translate(web([ep(2), ep(3)]), current)
    writes = diff(current, desired)
    phases = [(m, op) for m, op, _, _ in writes.elements()]
    assert phases == [
        ("backends", "update"),
        ("slots", "update"), ("slots", "update"),
        ("services", "update"),
        ("slots", "delete"), ("slots", "delete"),
        ("backends", "delete"),
    ]  # fmt: skip
    assert len(phases) == writes.count


# --- capacity --------------------------------------------------------------------------


def test_required_capacity_counts_old_and_new_sets_at_the_peak() -> None:
    current = translate(web([ep(1), ep(2), ep(3)]), EMPTY)
    desired = translate(web([ep(1), ep(2), ep(4), ep(5)]), current)
    need = required_capacity(current, desired, diff(current, desired))
    assert need == {"services": (1, 1), "slots": (4, 7), "backends": (4, 5)}


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        pytest.param(
            MapSizes(slots=6),
            f"map {versioned('kbp_slots')} needs 7 entries but holds 6 (1 short); the previous "
            "state keeps serving; raise --map-size-slots (takes effect at the next start)",
            id="slots one short of the peak",
        ),
        pytest.param(
            MapSizes(backends=3),
            f"map {versioned('kbp_backends')} needs 5 entries but holds 3 (2 short); the "
            "previous state keeps serving; raise --map-size-backends (takes effect at the next "
            "start)",
            id="backends two short of the peak",
        ),
    ],
)
def test_check_capacity_says_which_map_how_many_and_which_setting(
    sizes: MapSizes, message: str
) -> None:
    current = translate(web([ep(1), ep(2), ep(3)]), EMPTY)
    desired = translate(web([ep(1), ep(2), ep(4), ep(5)]), current)
    with pytest.raises(CapacityError) as raised:
        check_capacity(current, desired, diff(current, desired), sizes)
    assert str(raised.value) == message
    assert raised.value.reason == "capacity"


def test_more_services_than_the_counters_array_holds_is_a_capacity_error() -> None:
    sizes = MapSizes(services=3)  # service ids 1 and 2
    objects = [
        *svc([ep(1)], name="a", cluster_ip="10.96.0.1"),
        *svc([ep(2)], name="b", cluster_ip="10.96.0.2"),
        *svc([ep(3)], name="c", cluster_ip="10.96.0.3"),
    ]
    desired = translate(node_state(*objects), EMPTY, sizes=sizes)
    with pytest.raises(CapacityError) as raised:
        check_capacity(EMPTY, desired, diff(EMPTY, desired), sizes)
    assert (raised.value.map, raised.value.needed, raised.value.size) == ("services", 4, 3)
    # No order of writes helps: the planner refuses it too, saying why.
    change = Planner(sizes=sizes).plan(node_state(*objects))
    with pytest.raises(CapacityError) as raised:
        change.stages(sizes)
    assert "counting the service ids in use" in str(raised.value)
    change.rollback()


def test_a_content_that_fits_passes_the_check() -> None:
    current = translate(web([ep(1), ep(2), ep(3)]), EMPTY)
    desired = translate(web([ep(1), ep(2), ep(4), ep(5)]), current)
    check_capacity(
        current, desired, diff(current, desired), MapSizes(services=2, slots=7, backends=5)
    )


# --- capacity: free before take ---------------------------------------------------------
#
# Fleets of Services s0..s<N-1> (ClusterIPs 10.96.<i // 250>.<i % 250 + 1>), each with its
# own endpoints on node-b numbered from `first`: endpoint n is 10.<128 + n // 65536>.
# <n // 256 % 256>.<n % 256>, so a fleet with another `first` replaces every endpoint.


def fleet_objects(sizes: list[int], first: int = 0, names: range | None = None) -> list[Obj]:
    objects: list[Obj] = []
    n = first
    for i, count in zip(names or range(len(sizes)), sizes, strict=True):
        endpoints = []
        for _ in range(count):
            endpoints.append(make_endpoint(f"10.{128 + n // 65536}.{n // 256 % 256}.{n % 256}",
                                           "node-b"))  # fmt: skip
            n += 1
        objects += svc(endpoints, name=f"s{i}", cluster_ip=f"10.96.{i // 250}.{i % 250 + 1}")
    return objects


def fleet(sizes: list[int], first: int = 0) -> NodeState:
    return node_state(*fleet_objects(sizes, first))


def apply_staged(
    kernel: Kernel, planner: Planner, state: NodeState
) -> tuple[KernelContent, list[Writes]]:
    """The planner's change and its stages written one element at a time into `kernel`
    (which checks, after every write, the datapath's invariants and that no map is past
    its size), then committed; also: each frontend flips once, every frontend of a
    Service in the same stage, and the kernel ends holding exactly the new content."""
    sizes = planner.sizes
    change = planner.plan(state)
    try:
        stages = change.stages(sizes)
    except CapacityError:
        change.rollback()
        raise
    by_service: dict[int, set[FrontendKey]] = {}
    for key, value in change.writes.services_to_upsert.items():
        by_service.setdefault(value.service_id, set()).add(key)
    array = kernel.array
    placed, space = array.space.place(stages, change.before())  # as the writer does
    for stage in stages:
        kernel.apply(stage)
        for value in stage.services_to_upsert.values():  # a Service's frontends flip together
            assert by_service[value.service_id] <= stage.services_to_upsert.keys()
    for stage in placed:
        array.apply(stage)
    array.space = space
    content = change.commit()
    assert kernel.content() == content
    assert view(array.content()) == view(content)
    oracle = translate(state, EMPTY, sizes=sizes, maglev_table_size=planner.maglev_table_size)
    assert view(content) == view(oracle)
    return content, stages


def frontends_flipped_once(stages: list[Writes]) -> bool:
    keys = [k for stage in stages for k in stage.services_to_upsert]
    return len(keys) == len(set(keys))


def test_every_endpoint_replaced_at_88_percent_fill_is_applied_in_stages() -> None:
    """The issue's case: 903 of 1,024 slots, a change that replaces every endpoint. The
    whole apply's peak (old beside new) is 1,806; no map may ever hold more than 1,024."""
    sizes = MapSizes(services=64, slots=1024, backends=1024)
    shape = [21] * 43  # 903 slots and backends
    before, after = fleet(shape), fleet(shape, first=10_000)
    planner = planner_after(before, sizes=sizes)
    kernel = Kernel(planner.content, sizes)
    change = planner.plan(after)
    need = change.required_capacity()
    assert need["slots"] == (903, 1806) and need["backends"] == (903, 1806)
    with pytest.raises(CapacityError):  # what used to refuse it forever
        change.check_capacity(sizes)
    change.rollback()
    _, stages = apply_staged(kernel, planner, after)
    assert len(stages) > 1 and frontends_flipped_once(stages)
    assert kernel.peak["slots"] <= 1024 and kernel.peak["backends"] <= 1024
    # The next change (one unrelated Service added) is an ordinary one-stage apply.
    late = svc([ep(1)], name="late", cluster_ip="10.96.9.9")
    nxt = node_state(*fleet_objects(shape, first=10_000), *late)
    _, stages = apply_staged(kernel, planner, nxt)
    assert len(stages) == 1


def test_many_services_each_replaced_at_99_percent_fill() -> None:
    sizes = MapSizes(services=1024, slots=1024, backends=1024)
    shape = [3] * 338  # 1,014 of 1,024: ten free, three Services a stage
    planner = planner_after(fleet(shape), sizes=sizes)
    kernel = Kernel(planner.content, sizes)
    _, stages = apply_staged(kernel, planner, fleet(shape, first=5000))
    assert len(stages) >= 338 // 3 and frontends_flipped_once(stages)
    assert kernel.peak["slots"] == 1014 + 9  # three Services of three slots a stage


def test_a_removal_and_an_addition_in_one_apply_free_before_they_take() -> None:
    """Removing s0 (600 slots) and adding s2 (600) with 1,024 slots: s2 is written once
    s0's frontend and entries are gone; the unchanged s1 is not touched."""
    sizes = MapSizes(services=64, slots=1024, backends=1024)
    before = node_state(*fleet_objects([600, 300]))
    after = node_state(*fleet_objects([300], first=600, names=range(1, 2)),
                       *fleet_objects([600], first=2000, names=range(2, 3)))  # fmt: skip
    planner = planner_after(before, sizes=sizes)
    kernel = Kernel(planner.content, sizes)
    s1 = {k: v for k, v in planner.content.services.items() if k.addr == "10.96.0.2"}
    current, stages = apply_staged(kernel, planner, after)
    assert [bool(s.frontends_to_delete) for s in stages] == [True, False]
    assert all(current.services[k] == v for k, v in s1.items())
    assert kernel.peak["slots"] == 900


def test_one_service_too_big_to_sit_beside_its_old_self_switches_through_an_interim_set() -> None:
    """One Service of 700 endpoints, all replaced, in 1,024 slots: old and new cannot be
    there at once whatever the order. It switches first to a part of its new backends
    (324: what is free), which frees the old 700, then to all of them."""
    sizes = MapSizes(services=64, slots=1024, backends=1024)
    planner = planner_after(fleet([700]), sizes=sizes)
    kernel = Kernel(planner.content, sizes)
    _, stages = apply_staged(kernel, planner, fleet([700], first=3000))
    assert len(stages) == 2
    ((key, interim),) = stages[0].services_to_upsert.items()
    assert interim.count == 324 and stages[0].sets_to_delete  # the old set goes at once
    assert stages[1].services_to_upsert[key].count == 700
    assert set(stages[1].sets_to_delete) == {interim.set_id}
    assert kernel.peak["slots"] == 1024 and kernel.peak["backends"] == 1024


def test_a_maglev_service_too_big_for_two_tables_switches_through_an_interim_set() -> None:
    sizes = MapSizes(services=64, slots=40, backends=1024)
    before = node_state(*svc([ep(1), ep(2), ep(3)], maglev))
    after = node_state(*svc([ep(4), ep(5), ep(6)], maglev))
    planner = planner_after(before, sizes=sizes, maglev_table_size=31)
    kernel = Kernel(planner.content, sizes)
    _, stages = apply_staged(kernel, planner, after)
    assert len(stages) == 2 and kernel.peak["slots"] <= 40


def test_a_state_that_does_not_fit_is_still_refused_and_the_previous_stays() -> None:
    sizes = MapSizes(services=64, slots=1024, backends=1024)
    before, after = fleet([21] * 43), fleet([21] * 49, first=10_000)  # 1,029 slots
    planner = planner_after(before, sizes=sizes)
    current = planner.content
    kernel = Kernel(current, sizes)
    snapshot = Snapshot(planner)
    with pytest.raises(CapacityError) as raised:
        apply_staged(kernel, planner, after)
    assert (raised.value.map, raised.value.needed, raised.value.size) == ("slots", 1029, 1024)
    assert str(raised.value) == (
        f"map {versioned('kbp_slots')} needs 1029 entries but holds 1024 (5 short); the "
        "previous state keeps serving; raise --map-size-slots (takes effect at the next start)"
    )
    snapshot.check(planner)
    assert planner.content is current and kernel.content() == current


def test_the_map_writer_applies_a_full_replacement_in_stages_and_reports_the_need() -> None:
    sizes = MapSizes(services=64, slots=1024, backends=1024)
    writer = ModelWriter(sizes)
    writer.apply(fleet([21] * 43))
    assert writer.needed["slots"] == 903
    writes, removed = writer.apply(fleet([21] * 43, first=10_000))
    assert removed and writes == 4 * 903 + 43  # slots and backends twice, 43 flips
    # (the array model refuses a write past its 1,024 slots or over a live set's)
    assert view(writer.current) == view(writer.kernel.content())
    assert len(writer.kernel.slots) == 903
    with pytest.raises(DataplaneError) as raised:
        writer.apply(fleet([21] * 49))
    assert raised.value.reason == "capacity"
    assert writer.needed["slots"] == 1029  # what the refused state needs: fill 1.005
    assert view(writer.current) == view(writer.kernel.content())


# --- kbp_slots' array: where the sets go (slots.py) -------------------------------------


def frontend(n: int) -> FrontendKey:
    return FrontendKey(f"10.96.1.{n}", 80, 6, const.KBP_FAMILY_IPV4)


def sets_of(*lengths: int, first_backend: int = 1) -> tuple[KernelContent, int]:
    """A content of one frontend per set (set ids 1, 2, ...; frontend n names set n), the
    sets of `lengths` slots over backends of their own; and the next backend id."""
    content, b = KernelContent(), first_backend
    for n, length in enumerate(lengths, 1):
        members = tuple(range(b, b + length))
        for backend_id in members:
            content.backends[backend_id] = BackendValue(f"10.128.0.{backend_id}", 8080,
                                                        const.KBP_FAMILY_IPV4, 0, n)  # fmt: skip
        b += length
        content.slots[n] = members
        content.services[frontend(n)] = ServiceValue(n, 1, n, length, n, length, 0, 1)
    return content, b


def placed_after(
    array: ArrayKernel, current: KernelContent, desired: KernelContent
) -> list[Writes]:
    """`diff(current, desired)` placed into `array` and written (the array checks every
    write); the placed stages."""
    before = Before(current.services.get, current.slots.get, lambda: list(current.services))
    stages, array.space = array.space.place([diff(current, desired)], before)
    for stage in stages:
        array.apply(stage)
    assert view(array.content()) == view(desired)
    return stages


def test_a_set_goes_into_the_first_free_run_after_the_last_one_and_its_frontend_names_it():
    content, _ = sets_of(3, 2)
    array = ArrayKernel(content, 16)
    assert array.space.bases == {1: 1, 2: 4}  # index 0 names no set
    assert array.services[frontend(2)].set_id == 4 and array.slots[4] == content.slots[2][0]


def test_free_slots_that_no_run_of_a_set_holds_are_joined_by_moving_a_set_down_whole():
    """Three sets of 3 in 11 slots; the first and last go; a set of 6 finds 3 + 5 free
    slots but no run: the middle set moves to index 1 first (written there, its frontend
    flipped, its old run zeroed), then the new set takes the run freed."""
    current, b = sets_of(3, 3, 3)
    array = ArrayKernel(current, 12)
    middle = dict(current.slots)[2]
    shrunk = KernelContent({frontend(2): current.services[frontend(2)]}, {2: middle},
                           {i: v for i, v in current.backends.items() if i in middle})  # fmt: skip
    placed_after(array, current, shrunk)
    grown, _ = sets_of(6, first_backend=b)
    grown.slots[4] = grown.slots.pop(1)
    grown.services[frontend(4)] = dataclasses.replace(grown.services.pop(frontend(1)),
                                                      set_id=4, internal_set_id=4)  # fmt: skip
    desired = KernelContent({**shrunk.services, **grown.services}, {**shrunk.slots, **grown.slots},
                            {**shrunk.backends, **grown.backends})  # fmt: skip
    stages = placed_after(array, shrunk, desired)
    move, last = stages
    assert move.sets_to_write == {1: middle} and move.sets_to_delete == {4: 3}
    assert move.services_to_upsert[frontend(2)].set_id == 1
    assert array.space.bases == {2: 1, 4: 4}
    assert last.sets_to_write == {4: grown.slots[4]}


def test_a_set_longer_than_the_hole_below_it_moves_down_through_a_part_of_itself():
    """11 slots: sets of 2, 4, 2, 2 and one free slot; the first goes and a set of 3 comes
    (3 free slots, no run of 3). The set of 4 cannot move into the hole of 2 whole: its
    frontend is pointed at its first slot written in the free slot at the top, the set is
    written from index 1 over its own old run, the frontend pointed back at all 4; then
    the sets of 2 move down whole and the new set takes the run at the top."""
    current, b = sets_of(2, 4, 2, 2)
    first = KernelContent({frontend(1): current.services[frontend(1)]}, {1: current.slots[1]},
                          {i: current.backends[i] for i in current.slots[1]})  # fmt: skip
    array = ArrayKernel(first, 12)
    placed_after(array, first, current)  # (the sets of one stage go in longest first)
    assert array.space.bases == {1: 1, 2: 3, 3: 7, 4: 9}
    rest = {n: current.slots[n] for n in (2, 3, 4)}
    kept = KernelContent({frontend(n): current.services[frontend(n)] for n in rest}, rest,
                         {i: v for i, v in current.backends.items() if i > 2})  # fmt: skip
    placed_after(array, current, kept)
    new, _ = sets_of(3, first_backend=b)
    new.slots[5] = new.slots.pop(1)
    new.services[frontend(5)] = dataclasses.replace(new.services.pop(frontend(1)), set_id=5,
                                                    internal_set_id=5)  # fmt: skip
    desired = KernelContent({**kept.services, **new.services}, {**kept.slots, **new.slots},
                            {**kept.backends, **new.backends})  # fmt: skip
    part, whole, *others, last = placed_after(array, kept, desired)
    four = current.slots[2]
    assert part.sets_to_write == {11: four[:1]} and part.sets_to_delete == {3: 4}
    assert (part.services_to_upsert[frontend(2)].set_id,
            part.services_to_upsert[frontend(2)].count) == (11, 1)  # fmt: skip
    assert whole.sets_to_write == {1: four} and whole.sets_to_delete == {11: 1}
    assert whole.services_to_upsert[frontend(2)].count == 4
    assert len(others) == 2  # the two sets of 2, each moved down whole
    assert last.sets_to_write == {9: new.slots[5]}
    assert array.space.bases == {2: 1, 3: 5, 4: 7, 5: 9}


def test_sets_more_than_the_free_slots_are_refused_before_anything_is_written():
    current, b = sets_of(5, 5)
    array = ArrayKernel(current, 12)
    more, _ = sets_of(2, first_backend=b)
    more.slots[3] = more.slots.pop(1)
    more.services[frontend(3)] = dataclasses.replace(more.services.pop(frontend(1)), set_id=3,
                                                     internal_set_id=3)  # fmt: skip
    desired = KernelContent({**current.services, **more.services},
                            {**current.slots, **more.slots},
                            {**current.backends, **more.backends})  # fmt: skip
    space = array.space
    with pytest.raises(CapacityError) as raised:
        placed_after(array, current, desired)
    assert (raised.value.map, raised.value.needed, raised.value.size) == ("slots", 12, 11)
    assert array.space is space and space.bases == {1: 1, 2: 6}  # left as it was
    assert space.starts == {1: 1, 6: 2} and space.taken == 10


def test_a_placement_whose_writes_were_not_made_is_undone_and_a_read_space_places_alike():
    current, b = sets_of(4, 3)
    read = ArrayKernel(current, 16).content()  # as codec.read_content: set ids first slots
    space = SlotSpace.of_content(16, read)
    before = ({1: 1, 5: 5}, {1: 1, 5: 5}, 8, 7)
    assert (space.bases, space.starts, space.cursor, space.taken) == before
    used = bytes(space.used)
    new = sets_of(5, first_backend=b)[0].slots[1]
    stage = Writes(sets_to_write={9: new}, sets_to_delete={5: 3})
    placed, same = space.place([stage], NOTHING_BEFORE)
    assert same is space and placed[0].sets_to_write == {8: new}
    assert placed[0].sets_to_delete == {5: 3} and space.bases == {1: 1, 9: 8}
    space.undo()
    assert (space.bases, space.starts, space.cursor, space.taken) == before
    assert bytes(space.used) == used


# --- properties over generated clusters ------------------------------------------------


class Kernel:
    """The three maps as a dict model, written one element at a time. `apply` checks,
    after every single write, that the write kept the datapath's invariants: every
    service's (set, count) names complete slots and every slot names an existing backend.
    Only the written element can break them, so checking what it touches after each write
    (and everything at each phase boundary) checks the whole state after every write.
    With `fail_after` set, the write after that many raises OSError, as a map write can."""

    def __init__(self, content: KernelContent, sizes: MapSizes | None = None) -> None:
        self.services = dict(content.services)
        self.slots = {(s, i): b for s, ids in content.slots.items() for i, b in enumerate(ids)}
        self.backends = dict(content.backends)
        self.fail_after: int | None = None
        self.sizes = sizes  # with sizes, no write may take a map past its size
        # The same writes placed in kbp_slots' array (apply_staged), index 0 beside sizes.
        self.array = ArrayKernel(content, sizes.slots + 1 if sizes else 1 << 16)
        self.peak = {"services": len(self.services), "slots": len(self.slots),
                     "backends": len(self.backends)}  # fmt: skip
        self.check_all()

    def sets_in_use(self, value: ServiceValue) -> list[tuple[int, int]]:
        return [(value.set_id, value.count), (value.internal_set_id, value.internal_count)]

    def check_service(self, value: ServiceValue) -> None:
        for set_id, count in self.sets_in_use(value):
            assert (set_id == 0) == (count == 0), value
            for index in range(count):
                assert (set_id, index) in self.slots, f"{value} names a missing slot {index}"

    def check_all(self) -> None:
        for value in self.services.values():
            self.check_service(value)
        for key, backend_id in self.slots.items():
            assert backend_id in self.backends, f"slot {key} names a missing backend"

    def apply(self, writes: Writes) -> None:
        phase = None
        for written, (map_name, op, key, value) in enumerate(writes.elements()):
            if written == self.fail_after:
                raise OSError(28, "No space left on device")
            if (map_name, op) != phase:
                self.check_all()
                phase = (map_name, op)
            if map_name == "counters":
                continue
            table = getattr(self, map_name)
            if op == "delete":
                del table[key]
            else:
                table[key] = value
                self.peak[map_name] = max(self.peak[map_name], len(table))
                if self.sizes is not None:
                    size = getattr(self.sizes, map_name)
                    assert len(table) <= size, f"{map_name} past its {size} entries at {key}"
            # What this write could have broken:
            if (map_name, op) == ("services", "update"):
                self.check_service(value)
            elif (map_name, op) == ("slots", "update"):
                assert value in self.backends, f"slot {key} written before backend {value}"
            elif (map_name, op) == ("slots", "delete"):
                set_id, index = key
                for v in self.services.values():
                    for s, count in self.sets_in_use(v):
                        assert s != set_id or index >= count, f"deleted slot {key} of live {v}"
            elif (map_name, op) == ("backends", "delete"):
                assert key not in self.slots.values(), f"deleted backend {key} still in a slot"
        self.check_all()

    def content(self) -> KernelContent:
        sets: dict[int, dict[int, int]] = {}
        for (set_id, index), backend_id in self.slots.items():
            sets.setdefault(set_id, {})[index] = backend_id
        slots = {s: tuple(ids[i] for i in range(len(ids))) for s, ids in sets.items()}
        return KernelContent(dict(self.services), slots, dict(self.backends))


class ArrayKernel:
    """The three maps as the programs read them: kbp_slots an array (slots.py places the
    planner's sets), frontends naming their sets' first slots. Written one element at a
    time; after each write every frontend's runs hold slots of existing backends, and no
    write touches a slot a frontend names (a reader sees a set whole, old or new, and
    never a slot of another). `space` is where the sets are, as the writer keeps it."""

    def __init__(self, content: KernelContent, size: int = 1 << 16) -> None:
        self.services: dict[FrontendKey, ServiceValue] = {}
        self.slots: dict[int, int] = {}  # index -> backend id; absent: free
        self.backends: dict[int, BackendValue] = {}
        self.size = size
        self.space = SlotSpace(size)
        self.fail_after: int | None = None
        placed, self.space = self.space.place([diff(EMPTY, content)], NOTHING_BEFORE)
        for stage in placed:
            self.apply(stage)

    def named(self) -> set[int]:
        return {base + i for v in self.services.values()
                for base, count in ((v.set_id, v.count), (v.internal_set_id, v.internal_count))
                for i in range(count)}  # fmt: skip

    def check_service(self, value: ServiceValue) -> None:
        for base, count in ((value.set_id, value.count),
                            (value.internal_set_id, value.internal_count)):  # fmt: skip
            assert (base == 0) == (count == 0), value
            assert base + count <= self.size, f"{value} past the array"
            for i in range(base, base + count):
                assert self.slots.get(i, 0) in self.backends, f"{value} names free slot {i}"

    def apply(self, writes: Writes) -> None:
        for written, (map_name, op, key, value) in enumerate(writes.elements()):
            if written == self.fail_after:
                raise OSError(28, "No space left on device")
            if map_name == "counters":
                continue
            if map_name == "slots":
                index = key[0] + key[1]
                assert 0 < index < self.size, f"slot {index} outside the array"
                assert index not in self.named(), f"slot {index} of a live set written"
                if op == "delete":
                    self.slots.pop(index, None)
                else:
                    assert value in self.backends, f"slot {index} before backend {value}"
                    self.slots[index] = value
            elif map_name == "services":
                if op == "delete":
                    del self.services[key]
                else:
                    self.check_service(value)
                    self.services[key] = value
            elif op == "delete":
                assert key not in self.slots.values(), f"deleted backend {key} in a slot"
                del self.backends[key]
            else:
                self.backends[key] = value

    def content(self) -> KernelContent:
        """As codec.read_content decodes it: each named run under its first slot."""
        sets = {base: tuple(self.slots.get(i, 0) for i in range(base, base + count))
                for v in self.services.values()
                for base, count in ((v.set_id, v.count), (v.internal_set_id, v.internal_count))
                if count}  # fmt: skip
        return KernelContent(dict(self.services), sets, dict(self.backends))


NOTHING_BEFORE = Before(lambda key: None, lambda set_id: None, list)


def cluster_state(objects: dict[tuple[str, str, str], Obj]) -> ClusterState:
    state = ClusterState()
    for obj in objects.values():
        decoded = decode_object(obj)
        assert decoded.error is None
        if decoded.value is not None:
            {"Service": state.set_service, "EndpointSlice": state.set_slice,
             "Node": state.set_node}[decoded.kind](decoded.value)  # fmt: skip
    return state


def with_maglev_for_dns(obj: Obj) -> Obj:
    """Services named "dns" ask for Maglev, so generated clusters mix both algorithms."""
    if obj["kind"] == "Service" and obj["metadata"]["name"] == "dns":
        obj = {**obj, "metadata": {**obj["metadata"]}}
        obj["metadata"]["annotations"] = {
            **obj["metadata"].get("annotations", {}),
            ANNOTATION_LB_ALGORITHM: "maglev",
        }
    return obj


def owners(state: NodeState) -> dict[FrontendKey, tuple[str, ...]]:
    """Frontend key → the entry that answers it (the first in NodeState order)."""
    out: dict[FrontendKey, tuple[str, ...]] = {}
    for entry in state.services:
        content = translate(NodeState(state.node, "", (entry,)), EMPTY, maglev_table_size=31)
        for key in content.services:
            out.setdefault(key, entry.sort_key)
    return out


def check_ids(content: KernelContent, sizes: MapSizes) -> None:
    for value in content.services.values():
        assert 0 < value.service_id < sizes.services
    assert all(0 < s < sizes.slots for s in content.slots)
    assert all(0 < b < sizes.backends for b in content.backends)
    for backend in content.backends.values():
        assert backend.service_id in {v.service_id for v in content.services.values()}


def check_stable(
    before: KernelContent,
    old: NodeState,
    after: KernelContent,
    new: NodeState,
    restarted: bool = False,
) -> None:
    """A frontend answered by the same entry keeps its service id; a (service, endpoint)
    present before and after keeps its backend id. A restarted agent only knows entries
    by their frontends: there an entry answering the very same frontends keeps its id."""
    old_owners, new_owners = owners(old), owners(new)
    if restarted:
        for entry in {*old_owners.values()} & {*new_owners.values()}:
            keys = {k for k, owner in old_owners.items() if owner == entry}
            if keys == {k for k, owner in new_owners.items() if owner == entry}:
                assert {after.services[k].service_id for k in keys} == {
                    before.services[k].service_id for k in keys
                }, entry
    else:
        for key, value in after.services.items():
            if key in before.services and old_owners.get(key) == new_owners.get(key):
                assert before.services[key].service_id == value.service_id, key
    old_ids = {(b.service_id, b.addr, b.port): i for i, b in before.backends.items()}
    for backend_id, b in after.backends.items():
        old_id = old_ids.get((b.service_id, b.addr, b.port))
        assert old_id is None or old_id == backend_id


def sync(kernel: Kernel, planner: Planner, old: NodeState | None, state: NodeState) -> None:
    """One sync from the planner's content (what `kernel` holds) to `state`, checked on
    the way."""
    sizes = MapSizes()
    current = planner.content
    desired = translate(state, current, built=planner.index, maglev_table_size=31)
    check_ids(desired, sizes)
    # A restarted agent, adopting from the decoded maps, gets there consistently too...
    restarted = Kernel(current)
    decoded = bare(current)
    adopted = translate(state, decoded, maglev_table_size=31)
    restarted.apply(diff(decoded, adopted))
    assert restarted.content() == adopted
    check_ids(adopted, sizes)
    if old is not None:
        # ... and writes nothing when nothing changed.
        assert diff(decoded, translate(old, decoded, maglev_table_size=31)).empty
        check_stable(current, old, adopted, state, restarted=True)
    writes = diff(current, desired)
    check_capacity(current, desired, writes, sizes)
    need = required_capacity(current, desired, writes)
    kernel.apply(writes)
    assert kernel.content() == desired
    if old is not None:
        check_stable(current, old, desired, state)
    # Applied: the same state again is a no-op, also adopting from the maps.
    assert diff(desired, translate(state, desired, maglev_table_size=31)).empty
    in_place(planner, state, desired, writes, need)


def in_place(
    planner: Planner,
    state: NodeState,
    desired: KernelContent,
    writes: Writes,
    need: dict[str, tuple[int, int]],
) -> None:
    """The planner (incremental when it can) plans what the oracle (`translate`, every
    entry) did: the property that keeps the two equal; rolled back, the planner is
    exactly as before (contents, ids to come, how it was built); committed, it holds the
    next content (so a history goes on from contents changed in place)."""
    before = Snapshot(planner)
    current = planner.content
    change = planner.plan(state)
    assert change.content == desired
    # The same writes, phase by phase (within a phase the order carries no meaning: the
    # in-place path lists deletions in the order the plans that go name them).
    assert in_any_order(change.writes) == in_any_order(writes)
    assert change.writes.backends_changed == writes.backends_changed
    assert change.writes.count == writes.count
    assert change.required_capacity() == need
    assert change.rollback() is current
    before.check(planner)
    change = planner.plan(state)
    result = change.commit()
    assert result == desired and planner.content is result
    with pytest.raises(RuntimeError):
        change.rollback()
    again = planner.plan(state)
    assert again.writes.empty
    assert again.commit() is result


class Snapshot:
    """Everything about a planner that a rollback must restore."""

    def __init__(self, planner: Planner) -> None:
        self.content = bare(planner.content)
        self.index = planner.index
        self.index_maps = None
        if self.index is not None:
            self.index_maps = (
                dict(self.index.by_key),
                dict(self.index.by_digest),
                dict(self.index.service_ids),
            )

    def check(self, planner: Planner) -> None:
        assert planner.content == self.content
        assert planner.index is self.index
        if self.index is not None:
            maps = (self.index.by_key, self.index.by_digest, self.index.service_ids)
            assert maps == self.index_maps


@SETTINGS
@given(history=histories())
def test_every_sync_keeps_every_intermediate_kernel_state_consistent(history) -> None:
    """Over generated clusters and change sequences: applying each sync's writes one by
    one never leaves a service pointing at missing slots nor a slot at a missing backend;
    the result is the desired content; a restarted agent (adopting from the decoded maps)
    gets there too; and ids stay put for what did not change."""
    cluster, steps = history
    objects = {object_key(o): with_maglev_for_dns(o) for o in cluster.objects}
    kernel, planner, old = Kernel(EMPTY), Planner(maglev_table_size=31), None
    # Beside the full compile, the agent's incremental one: its NodeStates share the
    # entries of unchanged Services, which the in-place path skips by identity.
    agent_state = cluster_state(objects)
    compiler = Compiler(THIS_NODE, cluster.options)
    for change, synced in [(None, True), *steps]:
        if change is not None:
            step(agent_state, objects, change, with_maglev_for_dns)
        if synced:
            state = compile(cluster_state(objects), THIS_NODE, cluster.options)
            incremental = compiler.update(agent_state)
            assert incremental == state
            sync(kernel, planner, old, incremental)
            old = incremental


def feed(state: ClusterState, obj: Obj) -> None:
    decoded = decode_object(obj)
    assert decoded.error is None
    if decoded.value is None:
        forget(state, object_key(obj))
    else:
        {"Service": state.set_service, "EndpointSlice": state.set_slice,
         "Node": state.set_node}[decoded.kind](decoded.value)  # fmt: skip


def forget(state: ClusterState, key: tuple[str, str, str]) -> None:
    kind, namespace, name = key
    if kind == "Node":
        state.delete_node(name)
    else:
        {"Service": state.delete_service, "EndpointSlice": state.delete_slice}[kind](
            namespace, name
        )


def step(
    agent_state: ClusterState,
    objects: dict[tuple[str, str, str], Obj],
    change: tuple[str, object],
    edit: Callable[[Obj], Obj] = lambda obj: obj,
) -> None:
    """One step of a history, ("upsert", object) (the object after `edit`) or ("delete",
    key), applied to both the agent's state and the objects by key."""
    action, payload = change
    if action == "upsert":
        objects[object_key(payload)] = edit(payload)
        feed(agent_state, objects[object_key(payload)])
    else:
        objects.pop(payload, None)
        forget(agent_state, payload)


@st.composite
def state_pairs(draw: st.DrawFn) -> tuple[NodeState, NodeState]:
    """Two NodeStates of one node: a generated cluster, and the same cluster with some
    Services and slices gone, some slices replaced and some added."""
    cluster = draw(clusters())
    first = {object_key(o): with_maglev_for_dns(o) for o in cluster.objects}
    second = dict(first)
    for key in list(second):
        if key[0] != "Node" and draw(st.integers(0, 3)) == 0:
            del second[key]
    for service in cluster.services:
        for i in range(draw(st.integers(0, 2))):
            name = f"{service['metadata']['name']}-{i}"
            replacement = draw(endpoint_slices(service, name))
            second[object_key(replacement)] = replacement
    for service in draw(st.lists(services(), max_size=2)):
        second[object_key(service)] = with_maglev_for_dns(service)
    return (
        compile(cluster_state(first), THIS_NODE, cluster.options),
        compile(cluster_state(second), THIS_NODE, cluster.options),
    )


@SETTINGS
@given(pair=state_pairs())
def test_any_change_between_two_states_keeps_every_kernel_state_consistent(pair) -> None:
    """As above, for two states further apart than one change: there and back again."""
    first, second = pair
    kernel, planner = Kernel(EMPTY), Planner(maglev_table_size=31)
    sync(kernel, planner, None, first)
    sync(kernel, planner, first, second)
    sync(kernel, planner, second, first)


@SETTINGS
@given(pair=state_pairs(), slack=st.integers(2, 6))
def test_any_change_between_states_that_fit_their_maps_is_applied_within_them(
    pair, slack: int
) -> None:
    """Maps sized to the larger of two states plus `slack` (two entries: one per set of an
    interim switch) are never refused and never overfilled, there and back again, and
    every write keeps the datapath's invariants."""
    first, second = pair
    a, b = (translate(s, EMPTY, maglev_table_size=31) for s in pair)
    sizes = MapSizes(
        services=1024,
        slots=max(a.slot_count(), b.slot_count()) + slack,
        backends=max(len(a.backends), len(b.backends)) + slack,
    )
    kernel = Kernel(EMPTY, sizes)
    planner = Planner(sizes=sizes, maglev_table_size=31)
    apply_staged(kernel, planner, first)
    apply_staged(kernel, planner, second)
    current, _ = apply_staged(kernel, planner, first)
    # After a restart (content decoded from the kernel: a full plan) too.
    apply_staged(kernel, Planner(bare(current), sizes=sizes, maglev_table_size=31), second)


@st.composite
def tight_fleets(draw: st.DrawFn) -> tuple[NodeState, NodeState]:
    """Two states of up to ten Services (plain, Maglev, or NodePort with
    externalTrafficPolicy Local: two sets) whose endpoints are kept, replaced, added or
    removed in any mix, and Services removed and added: the planner's harder cases."""
    objects: tuple[list[Obj], list[Obj]] = ([], [])
    n = 0
    for i in range(draw(st.integers(1, 10))):
        # A NodePort of its own: the API server never gives two Services one.
        kind = [None, maglev, spec(type="NodePort", externalTrafficPolicy="Local", ports=[
            {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP",
             "nodePort": 30080 + i}
        ])][draw(st.integers(0, 2))]  # fmt: skip
        in_a, in_b = draw(st.sampled_from([(True, True), (True, True), (True, False),
                                           (False, True)]))  # fmt: skip
        count_a, count_b = draw(st.integers(1, 24)), draw(st.integers(1, 24))
        kept = draw(st.integers(0, min(count_a, count_b)))
        pool = []
        for _ in range(count_a + count_b - kept):
            node = "node-a" if draw(st.integers(0, 3)) == 0 else "node-b"
            pool.append(make_endpoint(f"10.{128 + n // 65536}.{n // 256 % 256}.{n % 256}", node))
            n += 1
        members = (pool[:count_a], pool[count_a - kept : count_a - kept + count_b])
        for side, present in enumerate((in_a, in_b)):
            if present:
                objects[side].extend(svc(members[side], kind, f"s{i}", f"10.96.0.{i + 1}"))
    return node_state(*objects[0]), node_state(*objects[1])


@SETTINGS
@given(pair=tight_fleets(), slack=st.integers(2, 4))
def test_fleets_replaced_in_maps_just_big_enough_are_applied_within_them(pair, slack: int) -> None:
    test_any_change_between_states_that_fit_their_maps_is_applied_within_them.hypothesis.inner_test(
        pair, slack
    )


# --- changes in place: refused, failed, committed ---------------------------------------

FIRST = web([ep(1), ep(2)])
# Four Services: one more than service ids 1..3 of MapSizes(services=4) allow.
TOO_BIG = node_state(
    *svc([ep(1), ep(2)]),
    *svc([ep(3)], name="b", cluster_ip="10.96.0.2"),
    *svc([ep(4)], name="c", cluster_ip="10.96.0.3"),
    *svc([ep(5)], name="d", cluster_ip="10.96.0.4"),
)
# From FIRST: ep 2 replaced by ep 3 and a second Service; 11 writes.
FITS = node_state(*svc([ep(1), ep(3)]), *svc([ep(4)], name="b", cluster_ip="10.96.0.2"))


def test_a_change_refused_for_capacity_rolls_back_and_the_next_is_as_if_it_never_was() -> None:
    sizes = MapSizes(services=4)
    planner = planner_after(FIRST, sizes=sizes)
    never_refused = planner_after(FIRST, sizes=sizes)
    current = planner.content
    before = Snapshot(planner)
    change = planner.plan(TOO_BIG)
    assert change.content is current and len(current.services) == 4  # changed in place
    with pytest.raises(CapacityError) as raised:
        change.check_capacity(sizes)
    assert (raised.value.map, raised.value.needed) == ("services", 5)
    assert change.rollback() is current
    before.check(planner)  # contents, the ids to hand out next, how it was built
    expected = never_refused.plan(FITS)
    change = planner.plan(FITS)
    change.check_capacity(sizes)
    assert change.writes == expected.writes
    assert change.commit() == expected.commit()


@pytest.mark.parametrize("fail_after", [0, 1, 3, 5, 8, 10])
def test_a_write_failing_half_way_rolls_back_and_a_sync_from_the_kernel_completes(
    fail_after: int,
) -> None:
    planner = planner_after(FIRST)
    current = planner.content
    kernel = Kernel(current)
    before = Snapshot(planner)
    change = planner.plan(FITS)
    assert change.writes.count == 11
    kernel.fail_after = fail_after
    with pytest.raises(OSError):
        kernel.apply(change.writes)
    assert change.rollback() is current
    before.check(planner)
    # The kernel holds something in between: the dataplane reads it back and goes on.
    planner.reset(kernel.content())
    kernel.fail_after = None
    change = planner.plan(FITS)
    kernel.apply(change.writes)
    result = change.commit()
    assert kernel.content() == result
    assert view(result) == view(translate(FITS, EMPTY))
    assert planner.plan(FITS).writes.empty


class ModelWriter(MapWriter):
    """MapWriter.apply over the Kernel model: no programs or pinned maps (so none of the
    external interfaces' maps either)."""

    def __init__(self, sizes: MapSizes) -> None:
        self.sizes = sizes
        self.lock = threading.Lock()
        self.held = None
        self._range_index = external.SourceRangeIndex()
        self._change = None
        self.kernel = ArrayKernel(EMPTY, sizes.slots)
        self.space = SlotSpace(sizes.slots)
        self.planner = Planner(self._read_kernel(), maglev_table_size=31,
                               sizes=self._planned_sizes())  # fmt: skip
        self.needed = dict.fromkeys(("services", "slots", "backends", "src_ranges"), 0)

    def _write(self, w: Writes, space: SlotSpace) -> None:
        self.kernel.apply(w)

    def _add_external(self, w: Writes, state: object, ranges: object) -> None:
        pass

    def _write_meta(self, state: object) -> int:
        return 0

    def _forget_external(self) -> None:
        pass

    def _read_kernel(self) -> KernelContent:
        return self.kernel.content()


def test_the_map_writer_holds_what_the_kernel_holds_after_a_refused_and_a_failed_apply() -> None:
    writer = ModelWriter(MapSizes(services=4))
    assert writer.apply(FIRST) == (6, False)  # counters, 2 backends, 2 slots, 1 frontend
    held = writer.kernel.content()  # its set ids are first slots, the planner's its own
    assert view(writer.current) == view(held)
    with pytest.raises(DataplaneError) as raised:
        writer.apply(TOO_BIG)
    assert raised.value.reason == "capacity"
    assert view(writer.current) == view(writer.kernel.content()) == view(held)
    assert writer.kernel.content() == held
    writer.kernel.fail_after = 3  # the counters reset and both new backends
    with pytest.raises(DataplaneError) as raised:
        writer.apply(FITS)
    assert raised.value.reason == "map_write"
    assert writer.current == writer.kernel.content() != held  # read back
    assert writer.held == FIRST.revision
    writer.kernel.fail_after = None
    assert writer.apply(FITS)[0] > 0
    assert view(writer.current) == view(writer.kernel.content())
    assert view(writer.current) == view(translate(FITS, EMPTY))
    assert writer.held == FITS.revision
    assert writer.apply(FITS) == (0, False)
    assert writer.apply(FITS, full=True) == (0, False)


class SizedMap:
    """What the fill gauges read of a pinned map: its size and (LRU maps) its entries."""

    def __init__(self, name: str, max_entries: int, entries: int = 0) -> None:
        self.name = name
        self.info = SimpleNamespace(max_entries=max_entries)
        self.entries = entries

    def items(self) -> list[tuple[bytes, bytes]]:
        return [(b"", b"")] * self.entries


def fill_ratios(metrics: Metrics) -> dict[str, float]:
    return {
        sample.labels["map"]: sample.value
        for family in metrics.registry.collect()
        if family.name == "kbp_map_fill_ratio"
        for sample in family.samples
    }


def test_the_fill_ratio_of_every_sized_map_counts_what_the_last_state_needs() -> None:
    """kbp_map_fill_ratio, through the metrics registry: a series for every map of
    FILL_RATIO_MAPS (sized maps, each a MapSizes field); for the maps the agent fills,
    the entries the last state needed over the size, above 1.0 (an alert on > 0.9
    fires) while that state is refused for want of room; for the LRU maps, what they
    hold."""
    sizes = MapSizes(services=64, slots=1024, backends=1024, ct=2048, affinity=1024)
    writer = ModelWriter(sizes)
    held = {"ct": 512, "affinity": 256, "sock_rev": 0}
    maps = {f"kbp_{name}": SizedMap(f"kbp_{name}", size, held.get(name, 0))
            for name, size in dataclasses.asdict(sizes).items()}  # fmt: skip
    writer.programs = SimpleNamespace(map=maps.__getitem__)  # type: ignore[assignment]
    writer.conntrack = SimpleNamespace(interval=0.0)  # type: ignore[assignment]
    metrics = Metrics()
    writer.register_fill(metrics)
    assert set(FILL_RATIO_MAPS) <= set(dataclasses.asdict(sizes))
    every_map = {versioned(f"kbp_{name}") for name in FILL_RATIO_MAPS}
    assert fill_ratios(metrics).keys() == every_map

    writer.apply(fleet([21] * 43))  # 903 slots and backends, 43 frontends
    ratios = fill_ratios(metrics)
    assert ratios[versioned("kbp_slots")] == ratios[versioned("kbp_backends")] == 903 / 1024
    assert ratios[versioned("kbp_services")] == 43 / 64
    assert ratios[versioned("kbp_src_ranges")] == 0.0
    assert ratios[versioned("kbp_ct")] == 512 / 2048
    assert ratios[versioned("kbp_affinity")] == 256 / 1024
    assert ratios[versioned("kbp_sock_rev")] == 0.0

    with pytest.raises(DataplaneError):
        writer.apply(fleet([21] * 49))  # 1,029 slots: refused
    ratios = fill_ratios(metrics)
    assert ratios[versioned("kbp_slots")] == 1029 / 1024 > 0.9
    firing = sorted(name for name, ratio in ratios.items() if ratio > 0.9)
    assert firing == [versioned("kbp_backends"), versioned("kbp_slots")]

    writer.apply(fleet([21] * 43, first=10_000))  # fits again (in stages)
    assert fill_ratios(metrics)[versioned("kbp_slots")] == 903 / 1024


def test_a_change_that_cannot_be_translated_leaves_current_as_it_was() -> None:
    planner = planner_after(web([ep(5)], maglev), maglev_table_size=3)
    before = Snapshot(planner)
    with pytest.raises(ValueError, match="too small for 3"):
        planner.plan(web([ep(5), ep(6), ep(7)], maglev))
    before.check(planner)
    change = planner.plan(web([ep(6)], maglev))
    assert counts(change.writes) == (0, 1, 3, 1, 0, 3, 1)


def test_content_decoded_from_the_kernel_is_planned_afresh_and_not_changed() -> None:
    decoded = bare(translate(FIRST, EMPTY))
    planner = Planner(decoded)
    before = Snapshot(planner)
    change = planner.plan(FITS)
    assert change.content is not decoded
    before.check(planner)
    assert change.writes == diff(decoded, change.content)
    assert change.rollback() is decoded
    before.check(planner)
    change = planner.plan(FITS)
    assert change.commit() is planner.content is not decoded
    assert planner.index is not None  # the next plan follows the changes


def test_a_change_ends_once() -> None:
    change = Planner().plan(FIRST)
    change.commit()
    with pytest.raises(RuntimeError, match="already committed or rolled back"):
        change.commit()


def in_any_order(w: Writes) -> tuple[object, ...]:
    """The writes with each phase as a set: the order within a phase carries no meaning."""
    return (
        set(w.counters_reset),
        w.backends_to_upsert,
        w.sets_to_write,
        w.services_to_upsert,
        set(w.frontends_to_delete),
        w.sets_to_delete,
        set(w.backends_to_delete),
    )


def unsealed(state: NodeState) -> NodeState:
    """The same entries without their digests (hand-built ones may lack them)."""
    entries = tuple(dataclasses.replace(e, digest=b"") for e in state.services)
    return NodeState(state.node, state.revision, entries)


def test_entries_without_digests_are_compared_by_value_and_change_in_place_alike() -> None:
    sealed = planner_after(FIRST)
    planner = planner_after(unsealed(FIRST))
    assert planner.plan(unsealed(FIRST)).writes.empty
    for state in (FITS, FIRST, web([ep(7)])):
        expected = sealed.plan(state)
        change = planner.plan(unsealed(state))
        assert in_any_order(change.writes) == in_any_order(expected.writes)
        assert change.commit() == expected.commit()
    # Sealed again: back on the path that skips the entries both states share.
    change = planner.plan(FITS)
    assert change.commit() == sealed.plan(FITS).commit()
    assert planner.index is not None and planner.index.entries is FITS.services


def test_an_entry_swapped_for_an_equal_one_without_a_digest_still_goes_when_it_changes() -> None:
    """Shared head and tail, and between them an equal entry lacking a digest: nothing to
    write, and when that entry later changes its frontend the old one still goes."""
    a = svc([ep(1)], name="a", cluster_ip="10.96.0.1")
    c = svc([ep(3)], name="c", cluster_ip="10.96.0.3")
    first = node_state(*a, *svc([ep(2)], name="b", cluster_ip="10.96.0.2"), *c)
    head, b, tail = first.services
    planner = planner_after(first)
    current = planner.content
    twin = NodeState(first.node, first.revision, (head, dataclasses.replace(b, digest=b""), tail))
    assert planner.plan(twin).commit() is current
    moved = node_state(*a, *svc([ep(2)], name="b", cluster_ip="10.96.0.12"), *c)
    moved_b = dataclasses.replace(moved.services[1], digest=b"")  # lacks one too
    change = planner.plan(NodeState(moved.node, moved.revision, (head, moved_b, tail)))
    assert FrontendKey("10.96.0.2", 80, 6, 4) in change.writes.frontends_to_delete
    assert change.commit() == planner_after(first).plan(moved).commit()


def test_a_state_compiled_afresh_with_equal_entries_writes_nothing() -> None:
    planner = planner_after(FITS)
    again = node_state(*svc([ep(1), ep(3)]), *svc([ep(4)], name="b", cluster_ip="10.96.0.2"))
    assert again.services[0] is not FITS.services[0]
    change = planner.plan(again)
    assert change.writes.empty
    change.commit()
    assert planner.index is not None and planner.index.entries is again.services


def test_one_changed_service_among_many_is_the_only_one_translated(monkeypatch) -> None:
    objects = {}
    for n in range(40):
        for obj in svc([ep(n + 1)], name=f"s{n:02d}", cluster_ip=f"10.96.1.{n + 1}"):
            objects[object_key(obj)] = obj
    cluster, compiler = cluster_state(objects), Compiler("node-a", CompileOptions())
    first = compiler.update(cluster)
    changed = make_slice(name="s07-1", service="s07", endpoints=[ep(8), ep(99)])
    feed(cluster, changed)
    second = compiler.update(cluster)
    planner = planner_after(first)

    translated = []
    original = plan.EntryBuilder.translate

    def translate(self, entry, *args):
        translated.append(entry.name)
        return original(self, entry, *args)

    monkeypatch.setattr(plan.EntryBuilder, "translate", translate)
    change = planner.plan(second)
    assert translated == ["s07"]
    assert counts(change.writes) == (0, 1, 2, 1, 0, 1, 0)


def test_values_are_hashable_and_frozen() -> None:
    key = FrontendKey("10.96.0.1", 80, 6, 4)
    value = ServiceValue(1, 0, 0, 0, 0, 0, 0, 1)
    backend = BackendValue("10.244.2.1", 8080, 4, 0, 1)
    assert len({key, value, backend, MapSizes()}) == 4
    with pytest.raises(AttributeError):
        key.port = 81  # type: ignore[misc]


@SETTINGS
@given(history=histories())
def test_the_source_range_index_follows_every_sync_as_a_full_scan_would(history) -> None:
    """SourceRangeIndex looks only at the entries of the Services a state's Changes name;
    over generated change sequences (the incremental compiler's states) it must give
    what scanning every entry gives."""
    cluster, steps = history
    objects = {object_key(o): o for o in cluster.objects}
    agent_state = cluster_state(objects)
    compiler = Compiler(THIS_NODE, cluster.options)
    index = external.SourceRangeIndex()
    index.RESCAN_FRACTION = 2.0  # small clusters: never rescan for the share of changes
    for change, synced in [(None, True), *steps]:
        if change is not None:
            step(agent_state, objects, change)
        if synced:
            state = compiler.update(agent_state)
            assert index.update(state) == external.source_ranges(state)


def test_the_source_range_index_rescans_a_frontend_two_entries_range() -> None:
    """Two Services ranging one VIP: the first in NodeState order wins. Adding the
    first beside the second, and removing it again, must switch the VIP's ranges."""

    def balancer(cluster_ip: str, ranges: list[str]) -> Callable[[Obj], None]:
        def mutate(svc: Obj) -> None:
            spec = svc["spec"]
            spec.update(type="LoadBalancer", clusterIP=cluster_ip, clusterIPs=[cluster_ip])
            spec["loadBalancerSourceRanges"] = ranges
            svc["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.50"}]}}

        return mutate

    first = make_service("default", "a-first", balancer("10.96.0.31", ["198.51.100.0/24"]))
    second = make_service("default", "b-second", balancer("10.96.0.32", ["192.0.2.0/24"]))
    cluster = state_of(*default_nodes(), second)
    compiler, index = Compiler("node-a", CompileOptions()), external.SourceRangeIndex()
    index.RESCAN_FRACTION = 2.0  # only the contested frontend may make it rescan

    def networks() -> set[str]:
        state = compiler.update(cluster)
        ranges = index.update(state)
        assert ranges == external.source_ranges(state)
        return {r.network for r in ranges}

    assert networks() == {"192.0.2.0/24"}
    feed(cluster, first)
    assert networks() == {"198.51.100.0/24"}  # a-first sorts first: its ranges win
    forget(cluster, object_key(first))
    assert networks() == {"192.0.2.0/24"}


def test_a_live_backends_flag_change_is_named_for_its_slot_copies() -> None:
    # Slots carry a copy of their backend (struct kbp_slot): a live backend whose flags
    # change is listed, so the dataplane rewrites the copies in the sets that name it.
    moving = make_endpoint("10.244.2.9", "node-b")
    before = translate(web([ep(1), moving]), EMPTY)
    after = translate(web([ep(1), make_endpoint("10.244.2.9", "node-a")]), before)
    writes = diff(before, after)
    assert writes.backends_changed == set(writes.backends_to_upsert)
    assert len(writes.backends_changed) == 1
    added = diff(after, translate(web([ep(1), ep(3)]), after))
    assert added.backends_to_upsert and not added.backends_changed  # new ones: no copies yet
