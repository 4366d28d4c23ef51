"""The incremental compiler: one change recompiles one Service; no-ops change nothing;
the result always equals a full compile."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from hypothesis import given

from agent.dataplane.fake import FakeDataplane
from agent.model.compile import CompileOptions, Compiler, compile
from agent.model.decode import Value, decode_object
from agent.model.nodestate import Changes, NodeState, ServiceEntry
from agent.model.types import ClusterState

from ..builders import (
    Obj,
    default_nodes,
    make_endpoint,
    make_node,
    make_service,
    make_slice,
    state_of,
)
from .strategies import THIS_NODE, histories, object_key
from .test_ebpf_plan import SETTINGS, cluster_state, step


def decoded(obj: Obj) -> Value:
    result = decode_object(obj)
    assert result.value is not None, result.error
    return result.value


def two_services() -> ClusterState:
    return state_of(
        *default_nodes(),
        make_service(name="a"),
        make_slice(name="a-1", service="a", endpoints=[make_endpoint("10.244.1.5", "node-a")]),
        make_service(
            name="b",
            mutate=lambda o: o["spec"].update(clusterIP="10.96.0.2", clusterIPs=["10.96.0.2"]),
        ),
        make_slice(name="b-1", service="b", endpoints=[make_endpoint("10.244.2.5", "node-b")]),
    )


def entry_of(node_state: NodeState, name: str) -> ServiceEntry:
    return next(e for e in node_state.services if e.name == name)


def started() -> tuple[ClusterState, Compiler, NodeState]:
    """two_services(), a compiler for node-a and its first NodeState."""
    state = two_services()
    compiler = Compiler("node-a", CompileOptions())
    return state, compiler, compiler.update(state)


def slice_of(name: str, service: str, ip: str, node: str, **conditions: bool) -> Value:
    """Slice `name` of `service` holding one endpoint, decoded."""
    endpoint = make_endpoint(ip, node, **conditions)
    return decoded(make_slice(name=name, service=service, endpoints=[endpoint]))


def test_a_slice_change_recompiles_only_its_service() -> None:
    state, compiler, before = started()
    state.set_slice(slice_of("a-1", "a", "10.244.1.5", "node-a", ready=False))
    after = compiler.update(state)
    assert after.revision != before.revision
    assert entry_of(after, "b") is entry_of(before, "b")  # untouched, not rebuilt
    assert entry_of(after, "a").cluster_backends == ()
    assert after == compile(state, "node-a")


def test_changes_since_gives_what_went_and_came_or_a_resync() -> None:
    """The one change follower: a consumer holding the base of a state's Changes gets the
    entries of the Services they name; holding the state itself, nothing; holding any
    other revision, nothing it can name or a state without Changes, everything went and
    came."""
    state, compiler, before = started()
    state.set_slice(slice_of("a-1", "a", "10.244.1.6", "node-a"))
    after = compiler.update(state)
    delta = Changes.since(before.revision, before.services, after)
    assert not delta.full
    assert list(delta.went) == [entry_of(before, "a")]
    assert list(delta.came) == [entry_of(after, "a")]
    assert Changes.since(after.revision, after.services, after).empty
    for revision, services, state_ in (
        ("sha256:other", before.services, after),  # not the base: a resync
        (before.revision, None, after),  # holds nothing it can name
        (before.revision, before.services, dataclasses.replace(after, changes=None)),
    ):
        delta = Changes.since(revision, services, state_)
        assert delta.full and delta.came is state_.services
        assert tuple(delta.went) == (services or ())
    first = Changes.since(None, None, before)  # the first compile has no Changes
    assert first.full and first.went == () and first.came is before.services


def test_a_no_op_update_keeps_the_revision_and_the_object() -> None:
    state, compiler, before = started()
    assert not state.set_slice(slice_of("a-1", "a", "10.244.1.5", "node-a"))
    assert compiler.update(state) is before


def test_an_unrelated_change_that_compiles_the_same_keeps_the_revision() -> None:
    state, compiler, before = started()
    # A label the compiler does not use changes the object but not the result.
    state.set_service(
        decoded(
            make_service(
                name="a", mutate=lambda o: o["metadata"].update(annotations={"team": "payments"})
            )
        )
    )
    assert compiler.update(state).revision == before.revision


def test_deleting_and_re_adding_a_service() -> None:
    state, compiler, full = started()
    state.delete_service("default", "a")
    without = compiler.update(state)
    assert [e.name for e in without.services] == ["b"]
    state.set_service(decoded(make_service(name="a")))
    assert compiler.update(state) == full


def test_moving_a_slice_to_another_service_updates_both() -> None:
    state, compiler, _ = started()
    state.set_slice(slice_of("a-1", "b", "10.244.1.5", "node-a"))
    after = compiler.update(state)
    assert entry_of(after, "a").has_endpoints is False
    assert [b.ip for b in entry_of(after, "b").cluster_backends] == ["10.244.1.5", "10.244.2.5"]
    assert after == compile(state, "node-a")


def test_this_nodes_labels_changing_recompiles_everything() -> None:
    state = state_of(
        *default_nodes(),
        make_service(),
        make_slice(
            endpoints=[
                make_endpoint("10.244.2.5", "node-b", zone_hints=["zone-1"]),
                make_endpoint("10.244.3.5", "node-c", zone_hints=["zone-2"]),
            ]
        ),
    )
    compiler = Compiler("node-a", CompileOptions())
    assert [b.ip for b in compiler.update(state).services[0].cluster_backends] == ["10.244.2.5"]
    state.set_node(
        decoded(make_node("node-a", {"topology.kubernetes.io/zone": "zone-2"}, "192.0.2.10"))
    )
    assert [b.ip for b in compiler.update(state).services[0].cluster_backends] == ["10.244.3.5"]


def test_another_nodes_labels_matter_to_services_with_topology_keys() -> None:
    keys = {"kube-bpf-proxy.io/topology-keys": "example.com/rack"}
    state = state_of(
        *default_nodes(),
        make_service(mutate=lambda o: o["metadata"].update(annotations=keys)),
        make_slice(
            endpoints=[make_endpoint("10.244.2.5", "node-b"), make_endpoint("10.244.3.5", "node-c")]
        ),
    )
    compiler = Compiler("node-a", CompileOptions())
    assert [b.ip for b in compiler.update(state).services[0].cluster_backends] == ["10.244.3.5"]
    state.set_node(decoded(make_node("node-b", {"example.com/rack": "r1"}, "192.0.2.11")))
    after = compiler.update(state)
    assert [b.ip for b in after.services[0].cluster_backends] == ["10.244.2.5", "10.244.3.5"]
    assert after == compile(state, "node-a")


def test_another_nodes_change_recompiles_only_the_keyed_services_on_it(monkeypatch) -> None:
    """The node index follows slices and annotations: a Service is recompiled for a node
    while it has topology keys and an endpoint there, and only then."""
    keys = {"kube-bpf-proxy.io/topology-keys": "example.com/rack"}

    def keyed(name: str, ip: str):
        def mutate(obj: Obj) -> None:
            obj["metadata"]["annotations"] = dict(keys)
            obj["spec"].update(clusterIP=ip, clusterIPs=[ip])

        return make_service(name=name, mutate=mutate)

    def on(node: str, ip: str) -> list[Obj]:
        return [make_endpoint(ip, node)]

    state = state_of(
        *default_nodes(),
        keyed("on-b", "10.96.0.7"),
        make_slice(name="on-b-1", service="on-b", endpoints=on("node-b", "10.244.2.5")),
        keyed("on-c", "10.96.0.8"),
        make_slice(name="on-c-1", service="on-c", endpoints=on("node-c", "10.244.3.5")),
        make_service(name="plain", mutate=lambda o: o["spec"].update(clusterIP="10.96.0.9",
                                                                      clusterIPs=["10.96.0.9"])),
        make_slice(name="plain-1", service="plain", endpoints=on("node-b", "10.244.2.6")),
    )  # fmt: skip
    compile_module = sys.modules[Compiler.__module__]
    compiler = Compiler("node-a", CompileOptions())
    compiler.update(state)
    compiled: list[str] = []
    original = compile_module.compile_service

    def recording(service, slices, ctx):  # type: ignore[no-untyped-def]
        compiled.append(service.name)
        return original(service, slices, ctx)

    monkeypatch.setattr(compile_module, "compile_service", recording)

    def relabel(node: str, rack: str) -> list[str]:
        compiled.clear()
        state.set_node(decoded(make_node(node, {"example.com/rack": rack}, "192.0.2.99")))
        after = compiler.update(state)
        recompiled = sorted(compiled)
        assert after == compile(state, "node-a")
        return recompiled

    assert relabel("node-b", "r7") == ["on-b"]
    assert relabel("node-c", "r1") == ["on-c"]
    # on-b's endpoint moves to node-c: now node-c's changes concern both.
    state.set_slice(decoded(make_slice(name="on-b-1", service="on-b",
                                       endpoints=on("node-c", "10.244.3.6"))))  # fmt: skip
    compiler.update(state)
    assert relabel("node-b", "r1") == []
    assert relabel("node-c", "r2") == ["on-b", "on-c"]
    # on-c drops its keys: no longer recompiled for nodes.
    state.set_service(decoded(make_service(name="on-c", mutate=lambda o: o["spec"].update(
        clusterIP="10.96.0.8", clusterIPs=["10.96.0.8"]))))  # fmt: skip
    compiler.update(state)
    assert relabel("node-c", "r1") == ["on-b"]


def test_compile_does_not_consume_the_change_log() -> None:
    state = two_services()
    compile(state, "node-a")
    services, _ = state.take_changes()
    assert services == {("default", "a"), ("default", "b")}


def test_the_compilers_backend_count_follows_every_change() -> None:
    """NodeState.counted_backends (kept per change for logs and gauges) equals a recount."""
    from agent.model.compile import CompileOptions, Compiler

    from ..builders import make_endpoint, make_service, make_slice, state_of

    state = state_of(make_slice(endpoints=[make_endpoint("10.244.1.5", "node-a")]), make_service())
    compiler = Compiler("node-a", CompileOptions())
    first = compiler.full(state)
    assert first.counted_backends == 1
    state.set_slice(state_of(make_slice(endpoints=[
        make_endpoint("10.244.1.5", "node-a"), make_endpoint("10.244.2.5", "node-b"),
    ])).slices[("default", "svc-1")])  # fmt: skip
    second = compiler.update(state)
    recount = sum(len(e.cluster_backends or ()) + len(e.local_backends or ())
                  for e in second.services)  # fmt: skip
    assert second.counted_backends == recount == 2
    state.delete_service("default", "svc")
    assert compiler.update(state).counted_backends == 0


def test_an_update_that_raises_loses_no_other_change_of_its_batch(monkeypatch) -> None:
    """A Service that cannot be compiled (a lone surrogate once made the digest raise)
    must not cost the other changes of the same batch: the next update compiles all."""
    compile_module = sys.modules[Compiler.__module__]
    state, compiler, _ = started()
    state.set_slice(slice_of("b-1", "b", "10.244.2.6", "node-b"))
    state.set_slice(slice_of("a-1", "a", "10.244.1.6", "node-a"))
    real = compile_module.compile_service

    def failing(service, slices, ctx):
        if service.name == "a":
            raise UnicodeEncodeError("utf-8", "\udc80", 0, 1, "surrogates not allowed")
        return real(service, slices, ctx)

    monkeypatch.setattr(compile_module, "compile_service", failing)
    with pytest.raises(UnicodeEncodeError):
        compiler.update(state)
    monkeypatch.setattr(compile_module, "compile_service", real)
    after = compiler.update(state)  # no change recorded since: yet both arrive
    assert after.revision == compile(state, "node-a").revision
    assert [b.ip for b in entry_of(after, "b").cluster_backends or ()] == ["10.244.2.6"]
    assert [b.ip for b in entry_of(after, "a").cluster_backends or ()] == ["10.244.1.6"]


@SETTINGS
@given(history=histories())
def test_the_changes_an_update_hands_over_cover_every_entry_that_differs(history) -> None:
    """Outside the Services an update's Changes name, the state before and after hold
    the same entry objects; a consumer that follows the Changes (the fake dataplane)
    counts what a resync counts."""
    cluster, steps = history
    objects = {object_key(o): o for o in cluster.objects}
    agent_state = cluster_state(objects)
    compiler = Compiler(THIS_NODE, cluster.options)
    following, scanning = FakeDataplane(), FakeDataplane()
    before = compiler.update(agent_state)
    assert before.changes is None  # the first compile is a full one
    following.apply(before)
    scanning.apply(before)
    for change, synced in steps:
        step(agent_state, objects, change)
        if not synced:
            continue
        after = compiler.update(agent_state)
        if after is not before and after.changes is not None:
            assert after.changes.base == before.revision
            named = after.changes.services
            kept_before = [e for e in before.services if (e.namespace, e.name) not in named]
            kept_after = [e for e in after.services if (e.namespace, e.name) not in named]
            assert len(kept_before) == len(kept_after)
            assert all(a is b for a, b in zip(kept_before, kept_after, strict=True))
            went, came = after.changes.between(before.services, after.services)
            assert [e for e in before.services if (e.namespace, e.name) in named] == went
            assert [e for e in after.services if (e.namespace, e.name) in named] == came
        assert following.apply(after) == scanning.apply(dataclasses.replace(after, changes=None))
        before = after
