"""Property-based tests of the compiler over generated clusters (issue 2 §5).

Clusters are generated as Kubernetes-shaped dicts (tests/unit/strategies.py has the
address plan) and decoded with `decode_object`, so the decoder is exercised too. The
expectations are computed here from the raw dicts, independently of the compiler. The
invariants (properties 1-8) hold only as far as Kubernetes fixes the outcome: where
duplicates of one ip:port leave the winner open, they accept either copy. One property
compares with a small reference model of docs/semantics.md that also follows the tie-breaks
compile.py documents. Falsifying examples these properties found are pinned with
`@example`, so they run on every run whatever the generator draws.
"""

from __future__ import annotations

import copy
import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, example, given
from hypothesis import strategies as st

from agent.cli import render
from agent.model.compile import CompileOptions, Compiler, compile
from agent.model.decode import decode_object
from agent.model.nodestate import NodeState
from agent.model.types import ClusterState
from tests.builders import default_nodes, make_endpoint, make_service, make_slice
from tests.unit.strategies import (
    ANNOTATION_CILIUM_AFFINITY,
    ANNOTATION_MULTI_CLUSTER,
    ANNOTATION_PROVISION_CLUSTER,
    ANNOTATION_TOPOLOGY_KEYS,
    KARMADA_DISPATCH,
    KARMADA_OLD,
    LABEL_HEADLESS,
    LABEL_MANAGED_BY,
    LABEL_PROXY_NAME,
    LABEL_SERVICE_NAME,
    LABEL_SOURCE_CLUSTER,
    LABEL_ZONE,
    THIS_NODE,
    Change,
    Cluster,
    Obj,
    clusters,
    histories,
    object_key,
    property_settings,
)

SETTINGS = property_settings(HealthCheck.too_slow)

Entry = dict[str, Any]
Backend = dict[str, Any]
EndpointKey = tuple[str, int]  # (canonical ip, target port)


# --- building a ClusterState from dicts --------------------------------------------------


def apply(state: ClusterState, obj: Obj) -> None:
    """Upsert one object; an object the decoder skips (a headless slice) is not watched,
    so it deletes whatever was known under its identity, as a filtered informer would."""
    decoded = decode_object(obj)
    assert decoded.error is None, f"{decoded.ref}: {decoded.error}"
    if decoded.value is None:
        delete(state, object_key(obj))
        return
    setter = {
        "Service": state.set_service,
        "EndpointSlice": state.set_slice,
        "Node": state.set_node,
    }[decoded.kind]
    setter(decoded.value)  # type: ignore[operator]


def delete(state: ClusterState, key: tuple[str, str, str]) -> None:
    kind, namespace, name = key
    if kind == "Service":
        state.delete_service(namespace, name)
    elif kind == "EndpointSlice":
        state.delete_slice(namespace, name)
    else:
        state.delete_node(name)


def state_of(objects: Iterable[Obj]) -> ClusterState:
    state = ClusterState()
    for obj in objects:
        apply(state, obj)
    return state


def compile_objects(objects: Iterable[Obj], options: CompileOptions) -> NodeState:
    return compile(state_of(objects), THIS_NODE, options)


def entries_of(cluster: Cluster) -> list[Entry]:
    return compile_objects(cluster.objects, cluster.options).to_dict()["services"]


def backends(entry: Entry) -> list[Backend]:
    return [*(entry["clusterBackends"] or []), *(entry["localBackends"] or [])]


# --- what the raw objects say, independently of the compiler ------------------------------


def canonical(text: str) -> str:
    return str(ipaddress.ip_address(text))


def family(text: str) -> str:
    return f"IPv{ipaddress.ip_address(text.strip().split('/')[0]).version}"


def ip_order(backend: Backend) -> tuple[int, int, int]:
    address = ipaddress.ip_address(backend["ip"])
    return address.version, int(address), backend["port"]


@dataclass(frozen=True)
class Copy:
    """One endpoint of one slice, for one target port, as the API describes it."""

    node_name: str | None
    zone: str | None
    clusters: frozenset[str] | None  # names the slice's origin may go by; None = this cluster
    ready: bool
    serving: bool
    terminating: bool
    hinted: bool

    @property
    def local(self) -> bool:
        return self.clusters is None and self.node_name == THIS_NODE

    @property
    def serving_terminating(self) -> bool:
        return self.serving and self.terminating

    @property
    def usable(self) -> bool:
        return self.ready or self.serving_terminating

    def matches(self, backend: Backend) -> bool:
        cluster = backend["cluster"]
        return (
            (self.node_name, self.zone, self.ready, self.serving, self.terminating)
            == (
                backend["nodeName"],
                backend["zone"],
                backend["ready"],
                backend["serving"],
                backend["terminating"],
            )
            and (cluster is None) == (self.clusters is None)
            and (cluster is None or cluster in (self.clusters or ()))
        )


def slice_origin(obj: Obj, cluster_name: str | None) -> frozenset[str] | None:
    """docs/semantics.md: remote if Karmada's provision-cluster annotation, a *.karmada.io
    manager, or an MCS source-cluster other than ours. None for this cluster."""
    meta = obj["metadata"]
    names = set()
    provision = meta.get("annotations", {}).get(ANNOTATION_PROVISION_CLUSTER)
    source = meta.get("labels", {}).get(LABEL_SOURCE_CLUSTER)
    # An empty marker names no cluster and counts as absent.
    if provision and provision != cluster_name:
        names.add(provision)
    if source and source != cluster_name:
        names.add(source)
    if not provision and meta.get("labels", {}).get(LABEL_MANAGED_BY) in (
        KARMADA_DISPATCH,
        KARMADA_OLD,
    ):
        names.add("unknown")  # the name, when the slice gives none
    return frozenset(names) if names else None


def endpoint_copies(cluster: Cluster, entry: Entry) -> dict[EndpointKey, list[Copy]]:
    """Every copy of every ip:port the entry's Service port may use, over all its slices."""
    out: dict[EndpointKey, list[Copy]] = {}
    for obj, port, ep in entry_endpoints(cluster.slices, entry):
        conditions = ep.get("conditions") or {}
        hints = ep.get("hints") or {}
        out.setdefault((canonical(ep["addresses"][0]), port["port"]), []).append(
            Copy(
                node_name=ep.get("nodeName"),
                zone=ep.get("zone"),
                clusters=slice_origin(obj, cluster.options.cluster_name),
                ready=conditions.get("ready") is not False,
                serving=conditions.get("serving") is not False,
                terminating=conditions.get("terminating") is True,
                hinted=bool(hints.get("forZones") or hints.get("forNodes")),
            )
        )
    return out


def entry_endpoints(slices: Iterable[Obj], entry: Entry) -> Iterable[tuple[Obj, Obj, Obj]]:
    """(slice, slice port, endpoint) for every endpoint the entry's Service port may use."""
    for obj in slices:
        meta = obj["metadata"]
        if (
            meta["namespace"] != entry["namespace"]
            or meta.get("labels", {}).get(LABEL_SERVICE_NAME) != entry["name"]
            or LABEL_HEADLESS in meta.get("labels", {})
            or obj["addressType"] != entry["ipFamily"]
        ):
            continue
        for port in obj["ports"]:
            if (
                "name" not in port
                or not port.get("port")
                or port["name"] != entry["port"]
                or port.get("protocol", "TCP") != entry["protocol"]
            ):
                continue
            for ep in obj["endpoints"]:
                yield obj, port, ep


def winners(copies: list[Copy]) -> list[Copy]:
    """The copies one of which the merge must keep: a non-terminating copy wins."""
    return [c for c in copies if not c.terminating] or copies


def sure(copies: dict[EndpointKey, list[Copy]], test: Any) -> set[EndpointKey]:
    """Endpoints whose merged copy passes `test`, whichever candidate the merge keeps."""
    return {k for k, cs in copies.items() if all(test(c) for c in winners(cs))}


def possible(copies: dict[EndpointKey, list[Copy]], test: Any) -> set[EndpointKey]:
    """Endpoints whose merged copy may pass `test`."""
    return {k for k, cs in copies.items() if any(test(c) for c in winners(cs))}


def keys(backend_list: list[Backend] | None) -> set[EndpointKey]:
    return {(b["ip"], b["port"]) for b in backend_list or []}


def service_of(cluster: Cluster, entry: Entry) -> Obj:
    for obj in cluster.services:
        meta = obj["metadata"]
        if (meta["namespace"], meta["name"]) == (entry["namespace"], entry["name"]):
            return obj
    raise AssertionError(f"entry without a Service: {entry['namespace']}/{entry['name']}")


def is_programmed(obj: Obj, options: CompileOptions) -> bool:
    """kube-proxy's ShouldSkipService and the service-proxy-name claim (docs/semantics.md)."""
    spec = obj["spec"]
    if spec.get("type") == "ExternalName" or spec.get("clusterIP") in (None, "", "None"):
        return False
    claim = obj["metadata"].get("labels", {}).get(LABEL_PROXY_NAME)
    if options.service_proxy_name:
        return claim == options.service_proxy_name
    return claim is None


def externally_accessible(obj: Obj, entry: Entry) -> bool:
    """kube-proxy's ServicePort.ExternallyAccessible, for the entry's IP family."""
    spec = obj["spec"]
    port = next(p for p in spec["ports"] if p.get("name", "") == entry["port"])
    if spec.get("type") in ("NodePort", "LoadBalancer") and port.get("nodePort"):
        return True
    if any(family(ip) == entry["ipFamily"] for ip in spec.get("externalIPs", [])):
        return True
    ingress = obj.get("status", {}).get("loadBalancer", {}).get("ingress", [])
    return spec.get("type") == "LoadBalancer" and any(
        "ip" in i and i.get("ipMode") != "Proxy" and family(i["ip"]) == entry["ipFamily"]
        for i in ingress
    )


def local_first(obj: Obj) -> bool:
    annotations = obj["metadata"].get("annotations", {})
    if ANNOTATION_MULTI_CLUSTER in annotations:
        return annotations[ANNOTATION_MULTI_CLUSTER] == "LocalFirst"
    return annotations.get(ANNOTATION_CILIUM_AFFINITY) == "local"


def topology_keys(obj: Obj) -> list[str]:
    raw = obj["metadata"].get("annotations", {}).get(ANNOTATION_TOPOLOGY_KEYS)
    return raw.split(",") if raw else []


# --- a reference model of docs/semantics.md, written from that page ------------------------


@dataclass(frozen=True)
class Merged:
    """One ip:port of an entry after merging its slices."""

    ip: str
    port: int
    node_name: str | None
    zone: str | None
    cluster: str | None
    ready: bool
    serving: bool
    terminating: bool
    zone_hints: frozenset[str]
    node_hints: frozenset[str]

    @property
    def local(self) -> bool:
        return self.cluster is None and self.node_name == THIS_NODE

    def to_dict(self) -> Backend:
        return {
            "ip": self.ip,
            "port": self.port,
            "nodeName": self.node_name,
            "zone": self.zone,
            "cluster": self.cluster,
            "local": self.local,
            "ready": self.ready,
            "serving": self.serving,
            "terminating": self.terminating,
        }


def origin_name(obj: Obj, cluster_name: str | None) -> str | None:
    """The cluster named by a slice (provision-cluster, then source-cluster, else
    "unknown" for a Karmada manager); None for this cluster."""
    meta = obj["metadata"]
    for marker in (
        meta.get("annotations", {}).get(ANNOTATION_PROVISION_CLUSTER),
        meta.get("labels", {}).get(LABEL_SOURCE_CLUSTER),
    ):
        if marker and marker != cluster_name:  # an empty marker names no cluster
            return marker
    if not meta.get("annotations", {}).get(ANNOTATION_PROVISION_CLUSTER) and meta.get(
        "labels", {}
    ).get(LABEL_MANAGED_BY) in (KARMADA_DISPATCH, KARMADA_OLD):
        return "unknown"
    return None


def merge(cluster: Cluster, entry: Entry) -> list[Merged]:
    """Issue 2 §3: one copy per ip:port; a non-terminating copy wins, then one of this
    cluster, then the first in slice-name order (compile.py documents the last two)."""
    chosen: dict[EndpointKey, tuple[tuple[bool, bool], Merged]] = {}
    by_name = sorted(cluster.slices, key=lambda o: o["metadata"]["name"])
    for obj, port, ep in entry_endpoints(by_name, entry):
        origin = origin_name(obj, cluster.options.cluster_name)
        conditions = ep.get("conditions") or {}
        hints = ep.get("hints") or {}
        candidate = Merged(
            ip=canonical(ep["addresses"][0]),
            port=port["port"],
            node_name=ep.get("nodeName"),
            zone=ep.get("zone"),
            cluster=origin,
            ready=conditions.get("ready") is not False,
            serving=conditions.get("serving") is not False,
            terminating=conditions.get("terminating") is True,
            zone_hints=frozenset(h["name"] for h in hints.get("forZones", [])),
            node_hints=frozenset(h["name"] for h in hints.get("forNodes", [])),
        )
        rank = (candidate.terminating, origin is not None)
        key = (candidate.ip, candidate.port)
        if key not in chosen or rank < chosen[key][0]:
            chosen[key] = (rank, candidate)
    return sorted(
        (c for _, c in chosen.values()),
        key=lambda c: (ipaddress.ip_address(c.ip).version, int(ipaddress.ip_address(c.ip)), c.port),
    )


def this_node_labels(cluster: Cluster) -> dict[str, str]:
    labels: dict[str, str] = {}
    for node in cluster.nodes:
        if node["metadata"]["name"] == THIS_NODE:
            labels.update(node["metadata"].get("labels", {}))
    labels.update(cluster.options.node_labels)
    return labels


def node_label(cluster: Cluster, node_name: str | None, key: str) -> str | None:
    if node_name == THIS_NODE:
        return this_node_labels(cluster).get(key)
    for node in cluster.nodes:
        if node["metadata"]["name"] == node_name:
            return node["metadata"].get("labels", {}).get(key)
    return None


def by_hints(cluster: Cluster, ready: list[Merged]) -> list[Merged]:
    """kube-proxy topologyModeFromHints over ready endpoints; a remote endpoint's hints
    name another cluster's nodes and zones and count as absent (docs/semantics.md)."""
    if all(c.cluster is None and c.node_hints for c in ready) and any(
        THIS_NODE in c.node_hints for c in ready
    ):
        return [c for c in ready if THIS_NODE in c.node_hints]
    zone = this_node_labels(cluster).get(LABEL_ZONE)
    if (
        zone
        and all(c.cluster is None and c.zone_hints for c in ready)
        and any(zone in c.zone_hints for c in ready)
    ):
        return [c for c in ready if zone in c.zone_hints]
    return ready


def by_topology_keys(cluster: Cluster, ready: list[Merged], keys: list[str]) -> list[Merged]:
    """KEP-536: the first key whose value this node shares with a ready endpoint's node;
    "*" takes all; no match, no endpoint. Remote endpoints match only "*"."""
    mine = this_node_labels(cluster)
    for key in keys:
        if key == "*":
            return ready
        if key not in mine:
            continue
        chosen = [
            c
            for c in ready
            if c.cluster is None and node_label(cluster, c.node_name, key) == mine[key]
        ]
        if chosen:
            return chosen
    return []


def reference_cluster_backends(
    cluster: Cluster, service: Obj, merged: list[Merged]
) -> list[Merged]:
    pool = merged
    if (
        local_first(service)
        and any(c.cluster is not None for c in merged)
        and any(c.cluster is None and c.ready for c in merged)
    ):  # LocalFirst: remote endpoints only when none of this cluster is ready
        pool = [c for c in merged if c.cluster is None]
    ready = [c for c in pool if c.ready]
    if not ready:  # serving-terminating fallback ignores topology
        return [c for c in pool if c.serving and c.terminating]
    keys_ = topology_keys(service)
    return by_topology_keys(cluster, ready, keys_) if keys_ else by_hints(cluster, ready)


def reference_local_backends(merged: list[Merged]) -> list[Merged]:
    mine = [c for c in merged if c.local]
    return [c for c in mine if c.ready] or [c for c in mine if c.serving and c.terminating]


# --- falsifying examples found by these properties, always run (hypothesis @example) -------


def _local_first(obj: Obj) -> None:
    obj["metadata"]["annotations"] = {ANNOTATION_MULTI_CLUSTER: "LocalFirst"}


def _empty_source_cluster(obj: Obj) -> None:
    obj["metadata"]["labels"][LABEL_SOURCE_CLUSTER] = ""


def _node_port_both_policies_local(obj: Obj) -> None:
    obj["spec"].update(
        type="NodePort", internalTrafficPolicy="Local", externalTrafficPolicy="Local"
    )
    obj["spec"]["ports"][0]["nodePort"] = 30080


# A LocalFirst Service with a ready endpoint in this cluster and an MCS slice whose
# source-cluster label is empty (an allowed label value that names no cluster, so the
# slice counts as this cluster's: it once leaked past LocalFirst as cluster "").
LOCAL_FIRST_EMPTY_SOURCE_CLUSTER = Cluster(
    nodes=default_nodes(),
    services=[make_service(mutate=_local_first)],
    slices=[
        make_slice(name="svc-here", endpoints=[make_endpoint("10.244.2.1", "node-b")]),
        make_slice(
            name="svc-imported",
            endpoints=[make_endpoint("10.245.0.1")],
            mutate=_empty_source_cluster,
        ),
    ],
    options=CompileOptions(),
)

# A NodePort Service with internalTrafficPolicy and externalTrafficPolicy both Local: pods
# and the node reach its NodePort through clusterBackends (docs/nodestate.md's table).
NODE_PORT_BOTH_POLICIES_LOCAL = Cluster(
    nodes=default_nodes(),
    services=[make_service(mutate=_node_port_both_policies_local)],
    slices=[make_slice(endpoints=[make_endpoint("10.244.2.1", "node-b")])],
    options=CompileOptions(),
)


# --- 1. determinism ------------------------------------------------------------------------


@SETTINGS
@given(cluster=clusters(), data=st.data())
def test_equal_objects_in_any_order_give_byte_identical_output(
    cluster: Cluster, data: st.DataObject
) -> None:
    objects = cluster.objects
    shuffled = data.draw(st.permutations(objects), label="shuffled")
    first = compile_objects(objects, cluster.options)
    second = compile_objects(shuffled, cluster.options)

    assert first.to_dict() == second.to_dict()
    assert render(first, "json").encode() == render(second, "json").encode()
    assert first.revision == second.revision
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", first.revision)


@SETTINGS
@given(cluster=clusters(), data=st.data())
def test_changing_a_service_entry_changes_the_revision(
    cluster: Cluster, data: st.DataObject
) -> None:
    before = compile_objects(cluster.objects, cluster.options)
    programmed = [s for s in cluster.services if is_programmed(s, cluster.options)]
    if not programmed:
        return
    target = data.draw(st.sampled_from(programmed), label="changed Service")
    changed = copy.deepcopy(target)
    changed["spec"]["ports"][0]["port"] += 1000  # a ClusterIP frontend moves
    after = compile_objects(
        [changed if obj is target else obj for obj in cluster.objects], cluster.options
    )

    assert after.to_dict()["services"] != before.to_dict()["services"]
    assert after.revision != before.revision


# --- 2. backends ⊆ endpoints ---------------------------------------------------------------


@SETTINGS
@given(cluster=clusters())
def test_every_backend_is_an_endpoint_of_the_service_port_and_family(cluster: Cluster) -> None:
    for entry in entries_of(cluster):
        copies = endpoint_copies(cluster, entry)
        for backend in backends(entry):
            key = (backend["ip"], backend["port"])
            assert key in copies, (
                f"{entry['namespace']}/{entry['name']} {entry['port']!r}/{entry['protocol']} "
                f"{entry['ipFamily']}: backend {key} is in no slice of that port and family"
            )
            assert any(c.matches(backend) for c in copies[key]), (
                f"backend {backend} matches no copy of {key}: {copies[key]}"
            )


# --- 3. duplicates merged, sorted ----------------------------------------------------------


@SETTINGS
@given(cluster=clusters())
def test_backends_are_unique_sorted_and_the_non_terminating_copy_wins(cluster: Cluster) -> None:
    for entry in entries_of(cluster):
        copies = endpoint_copies(cluster, entry)
        for field in ("clusterBackends", "localBackends"):
            found = entry[field] or []
            pairs = [(b["ip"], b["port"]) for b in found]
            assert len(pairs) == len(set(pairs)), f"{field} repeats an ip:port: {pairs}"
            assert found == sorted(found, key=ip_order), f"{field} not sorted: {pairs}"
            for backend in found:
                if any(not c.terminating for c in copies[(backend["ip"], backend["port"])]):
                    assert not backend["terminating"], (
                        f"{field}: a terminating copy of {backend['ip']}:{backend['port']} "
                        "won over a non-terminating one"
                    )


# --- 4. local means this node, this cluster ------------------------------------------------


@SETTINGS
@given(cluster=clusters())
def test_local_backends_are_on_this_node_in_this_cluster_and_remote_ones_never_local(
    cluster: Cluster,
) -> None:
    for entry in entries_of(cluster):
        for backend in entry["localBackends"] or []:
            assert backend["nodeName"] == THIS_NODE
            assert backend["cluster"] is None
            assert backend["local"] is True
        for backend in backends(entry):
            if backend["cluster"] is not None:
                assert backend["local"] is False, f"remote backend marked local: {backend}"
            expected = backend["cluster"] is None and backend["nodeName"] == THIS_NODE
            assert backend["local"] is expected, backend


# --- 5. families never mix -----------------------------------------------------------------


@SETTINGS
@given(cluster=clusters())
def test_frontends_and_backends_of_an_entry_share_its_ip_family(cluster: Cluster) -> None:
    for entry in entries_of(cluster):
        wanted = entry["ipFamily"]
        for frontend in entry["frontends"]:
            assert family(frontend["ip"]) == wanted, (entry["name"], frontend)
            for cidr in frontend.get("sourceRanges", []):
                assert family(cidr) == wanted, (entry["name"], frontend)
        for backend in backends(entry):
            assert family(backend["ip"]) == wanted, (entry["name"], backend)
        cluster_ips = [f for f in entry["frontends"] if f["type"] == "ClusterIP"]
        assert len(cluster_ips) == 1, entry["frontends"]


# --- 6. incremental == full ----------------------------------------------------------------


@SETTINGS
@given(history=histories())
def test_incremental_updates_equal_a_full_compile(
    history: tuple[Cluster, list[tuple[Change, bool]]],
) -> None:
    cluster, steps = history
    state = state_of(cluster.objects)
    compiler = Compiler(THIS_NODE, cluster.options)
    compiler.update(state)
    for i, ((action, what), sync) in enumerate(steps):
        if action == "upsert":
            apply(state, what)
        else:
            delete(state, what)
        if not sync and i != len(steps) - 1:
            continue  # coalesce: several changes before one update
        incremental = compiler.update(state)
        full = compile(state, THIS_NODE, cluster.options)
        assert incremental.to_dict() == full.to_dict(), f"after step {i}: {action} {what}"
        assert incremental.revision == full.revision
        assert incremental.counted_backends == full.counted_backends == sum(
            len(e.cluster_backends or ()) + len(e.local_backends or ()) for e in full.services
        )


# --- 7. kube-proxy invariants --------------------------------------------------------------


@SETTINGS
@given(cluster=clusters())
def test_kube_proxy_endpoint_selection_invariants(cluster: Cluster) -> None:
    """pkg/proxy/topology.go CategorizeEndpoints: ready first, else serving-terminating;
    hasEndpoints; local endpoints on this node only."""
    for entry in entries_of(cluster):
        service = service_of(cluster, entry)
        copies = endpoint_copies(cluster, entry)
        where = f"{entry['namespace']}/{entry['name']} {entry['port']!r} {entry['ipFamily']}"
        cluster_set, local_set = entry["clusterBackends"], entry["localBackends"]

        def ready(c: Copy) -> bool:
            return c.ready

        def usable(c: Copy) -> bool:
            return c.usable

        # hasEndpoints: a usable endpoint exists anywhere in the cluster.
        if sure(copies, usable):
            assert entry["hasEndpoints"] is True, where
        if not possible(copies, usable):
            assert entry["hasEndpoints"] is False, where
        if not entry["hasEndpoints"]:
            assert not cluster_set, where
            assert not local_set, where

        if cluster_set is not None:
            # All ready, or (no ready endpoint in the pool) all serving-terminating.
            all_ready = all(b["ready"] for b in cluster_set)
            all_fallback = all(
                not b["ready"] and b["serving"] and b["terminating"] for b in cluster_set
            )
            assert all_ready or all_fallback, f"{where}: mixed clusterBackends {cluster_set}"
            if sure(copies, ready):
                assert all_ready, f"{where}: fallback used although endpoints are ready"
                keys_ = topology_keys(service)
                if not keys_ or "*" in keys_:
                    assert cluster_set, f"{where}: ready endpoints exist, no clusterBackends"
            if not possible(copies, ready):
                found = keys(cluster_set)
                assert sure(copies, lambda c: c.serving_terminating) <= found, where
                assert found <= possible(copies, lambda c: c.serving_terminating), where
            no_preference = (
                not topology_keys(service)
                and not local_first(service)
                and not any(c.hinted for cs in copies.values() for c in cs)
            )
            if no_preference and sure(copies, ready):
                found = keys(cluster_set)
                assert sure(copies, ready) <= found, f"{where}: a ready endpoint is missing"
                assert found <= possible(copies, ready), f"{where}: an unready endpoint is used"

        if local_set is not None:
            all_ready = all(b["ready"] for b in local_set)
            all_fallback = all(
                not b["ready"] and b["serving"] and b["terminating"] for b in local_set
            )
            assert all_ready or all_fallback, f"{where}: mixed localBackends {local_set}"
            found = keys(local_set)
            assert found <= possible(copies, lambda c: c.local), where
            if sure(copies, lambda c: c.local and c.ready):
                assert all_ready, f"{where}: local fallback used although local ones are ready"
                assert sure(copies, lambda c: c.local and c.ready) <= found, where
                assert found <= possible(copies, lambda c: c.local and c.ready), where
            elif not possible(copies, lambda c: c.local and c.ready):
                assert sure(copies, lambda c: c.local and c.serving_terminating) <= found, where
                assert found <= possible(copies, lambda c: c.local and c.serving_terminating), where


@SETTINGS
@given(cluster=clusters())
def test_backends_equal_a_reference_model_of_the_design(cluster: Cluster) -> None:
    """The exact clusterBackends and localBackends (where the entry has them) of a
    straightforward model of docs/semantics.md: merge, LocalFirst, ready else
    serving-terminating, then topology keys or hints; local = this node, this cluster."""
    for entry in entries_of(cluster):
        service = service_of(cluster, entry)
        merged = merge(cluster, entry)
        where = f"{entry['namespace']}/{entry['name']} {entry['port']!r} {entry['ipFamily']}"
        if entry["clusterBackends"] is not None:
            expected = [c.to_dict() for c in reference_cluster_backends(cluster, service, merged)]
            assert entry["clusterBackends"] == expected, f"{where}: clusterBackends"
        if entry["localBackends"] is not None:
            expected = [c.to_dict() for c in reference_local_backends(merged)]
            assert entry["localBackends"] == expected, f"{where}: localBackends"
        assert entry["hasEndpoints"] == any(
            c.ready or (c.serving and c.terminating) for c in merged
        )


@SETTINGS
@given(cluster=clusters())
@example(cluster=NODE_PORT_BOTH_POLICIES_LOCAL)
def test_backend_sets_exist_exactly_when_some_traffic_uses_them(cluster: Cluster) -> None:
    """kube-proxy's UsesLocalEndpoints / UsesClusterEndpoints (pkg/proxy/serviceport.go):
    local endpoints for ITP Local or (ETP Local and externally accessible); cluster
    endpoints for ITP Cluster *or any external frontend* — pods and the node itself reach
    external frontends through clusterBackends even with ETP Local (docs/nodestate.md's table,
    kube-proxy's "short circuiting")."""
    for entry in entries_of(cluster):
        service = service_of(cluster, entry)
        spec = service["spec"]
        where = f"{entry['namespace']}/{entry['name']} {entry['port']!r} {entry['ipFamily']}"
        external = externally_accessible(service, entry)
        itp_local = spec.get("internalTrafficPolicy") == "Local"
        etp_local = external and spec.get("externalTrafficPolicy") == "Local"

        assert entry["internalTrafficPolicy"] == ("Local" if itp_local else "Cluster"), where
        assert entry["externalTrafficPolicy"] == ("Local" if etp_local else "Cluster"), where
        assert (entry["localBackends"] is not None) == (itp_local or etp_local), where
        assert (entry["clusterBackends"] is not None) == (not itp_local or external), (
            f"{where}: ITP={spec.get('internalTrafficPolicy')} "
            f"ETP={spec.get('externalTrafficPolicy')} external={external}, "
            f"clusterBackends={entry['clusterBackends']}"
        )


# --- 8. Services that are never programmed -------------------------------------------------


@SETTINGS
@given(cluster=clusters())
def test_only_programmed_services_have_entries_one_per_port_and_family(
    cluster: Cluster,
) -> None:
    expected = set()
    for obj in cluster.services:
        if not is_programmed(obj, cluster.options):
            continue
        meta, spec = obj["metadata"], obj["spec"]
        for ip in spec["clusterIPs"]:
            for port in spec["ports"]:
                expected.add(
                    (
                        meta["namespace"],
                        meta["name"],
                        port.get("name", ""),
                        port.get("protocol", "TCP"),
                        family(ip),
                    )
                )
    found = [
        (e["namespace"], e["name"], e["port"], e["protocol"], e["ipFamily"])
        for e in entries_of(cluster)
    ]
    skipped = {
        (o["metadata"]["namespace"], o["metadata"]["name"])
        for o in cluster.services
        if not is_programmed(o, cluster.options)
    }
    programmed_anyway = [f for f in found if f[:2] in skipped]
    assert not programmed_anyway, f"headless/ExternalName/claimed, yet: {programmed_anyway}"
    assert len(found) == len(set(found)), found
    assert set(found) == expected
    assert found == sorted(found)


# --- multi-cluster LocalFirst (docs/semantics.md) ------------------------------------------


@SETTINGS
@given(cluster=clusters(local_first=True))
@example(cluster=LOCAL_FIRST_EMPTY_SOURCE_CLUSTER)
def test_local_first_uses_remote_endpoints_only_when_none_here_is_ready(
    cluster: Cluster,
) -> None:
    for entry in entries_of(cluster):
        service = service_of(cluster, entry)
        if not local_first(service) or entry["clusterBackends"] is None:
            continue
        copies = endpoint_copies(cluster, entry)
        if sure(copies, lambda c: c.clusters is None and c.ready):
            remote = [b for b in entry["clusterBackends"] if b["cluster"] is not None]
            assert not remote, (
                f"{entry['namespace']}/{entry['name']}: LocalFirst with ready endpoints in "
                f"this cluster, yet remote backends {remote}"
            )
