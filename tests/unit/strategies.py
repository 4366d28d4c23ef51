"""Hypothesis strategies for small Kubernetes clusters, as plain dicts the API would serve.

The pools are deliberately tiny so that generated objects collide: Services and slices
share names, the same ip:port shows up in several slices of a Service (with different
conditions, nodes and clusters), and upserts in a change sequence replace earlier objects.

Address plan:

    this node      node-a (the node compiled for); others node-b, node-c; unknown node-z
    node IPs       192.0.2.1<i> (InternalIP), 2001:db8::1<i>, 198.51.100.1<i> (ExternalIP)
    ClusterIPs     10.96.0.<n>, fd00:96::<n>
    external       203.0.113.0/24, 2001:db8:ff::/64 (ExternalIPs, LoadBalancer VIPs)
    pods           10.244.0.1-6, fd00:244::1-6 (IPv6 sometimes written non-canonically)
    clusters       this one: unnamed or member1; remote: member2, member3, "" and unknown
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from agent.model.compile import CompileOptions

Obj = dict[str, Any]

THIS_NODE = "node-a"
NODE_NAMES = ("node-a", "node-b", "node-c")
UNKNOWN_NODE = "node-z"
NAMESPACES = ("default", "default", "team")  # weighted towards one namespace
SERVICE_NAMES = ("web", "dns", "api", "lws-0")
SLICE_NAMES = tuple(f"sl-{i}" for i in range(1, 11))
ZONES = ("zone-1", "zone-2")
RACKS = ("r1", "r2")

LABEL_ZONE = "topology.kubernetes.io/zone"
LABEL_RACK = "example.com/rack"
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
LABEL_HEADLESS = "service.kubernetes.io/headless"
LABEL_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
LABEL_SOURCE_CLUSTER = "multicluster.kubernetes.io/source-cluster"
ANNOTATION_PROVISION_CLUSTER = "endpointslice.karmada.io/provision-cluster"
ANNOTATION_TOPOLOGY_KEYS = "kube-bpf-proxy.io/topology-keys"
ANNOTATION_MULTI_CLUSTER = "kube-bpf-proxy.io/multi-cluster"
ANNOTATION_CILIUM_AFFINITY = "service.cilium.io/affinity"
KARMADA_DISPATCH = "endpointslice-dispatch-controller.karmada.io"
KARMADA_OLD = "endpointslice-controller.karmada.io"
NATIVE_MANAGER = "endpointslice-controller.k8s.io"

THIS_CLUSTER = "member1"  # --cluster-name, when set
PROVISION_CLUSTERS = ("member2", "member3")  # never this cluster's name
SOURCE_CLUSTERS = ("member1", "member2")  # member1 is this cluster when named

# Multi-cluster policy annotations; "cilium" stands for service.cilium.io/affinity: local.
MULTI_CLUSTER = ("LocalFirst", "RemoteAndLocal", "cilium")
TRAFFIC_POLICIES = (
    (None, None),
    ("Local", "Local"),
    ("Local", None),
    (None, "Local"),
    ("Cluster", "Local"),
    ("Local", "Cluster"),
    ("Cluster", "Cluster"),
)
TOPOLOGY_KEYS = (
    LABEL_RACK,
    f"{LABEL_RACK},{LABEL_ZONE}",
    f"{LABEL_RACK},*",
    f"{LABEL_ZONE},*",
    "*",
    "kubernetes.io/hostname",  # no node carries it: never matches
)


def property_settings(*suppress: HealthCheck) -> settings:
    """Deterministic in CI: no example database, a fixed seed derived from each test. A
    deeper local run: KBP_PROPERTY_EXAMPLES=2000 (still deterministic, different examples)."""
    return settings(
        max_examples=int(os.environ.get("KBP_PROPERTY_EXAMPLES", "100")),
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=suppress,
    )


def ipv6(prefix: str, n: int, style: int) -> str:
    """`prefix::n` written canonically, expanded, or in upper case (all the same address)."""
    groups = prefix.split(":")
    if style == 1:
        return ":".join(groups + ["0"] * (7 - len(groups)) + [f"{n:x}"])
    if style == 2:
        return f"{prefix}::{n:X}".upper()
    return f"{prefix}::{n:x}"


def one_in(draw: st.DrawFn, n: int) -> bool:
    """True with a probability of about 1/n (hypothesis favours 0 and the bounds of a
    range, so the middle value is the rare one)."""
    return draw(st.integers(0, n - 1)) == n // 2


# --- Nodes -----------------------------------------------------------------------------


@st.composite
def nodes(draw: st.DrawFn, name: str | None = None) -> Obj:
    name = name or draw(st.sampled_from(NODE_NAMES))
    index = NODE_NAMES.index(name) if name in NODE_NAMES else 9
    labels: dict[str, str] = {}
    zone = draw(st.sampled_from((None, *ZONES)))
    if zone:
        labels[LABEL_ZONE] = zone
    rack = draw(st.sampled_from((None, *RACKS)))
    if rack:
        labels[LABEL_RACK] = rack
    addresses = []
    if draw(st.booleans()):
        addresses.append({"type": "InternalIP", "address": f"192.0.2.1{index}"})
    if draw(st.booleans()):
        addresses.append({"type": "InternalIP", "address": f"2001:db8::1{index}"})
    if draw(st.booleans()):
        addresses.append({"type": "ExternalIP", "address": f"198.51.100.1{index}"})
    addresses.append({"type": "Hostname", "address": name})
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {"addresses": addresses},
    }


# --- Services --------------------------------------------------------------------------


def _maybe(draw: st.DrawFn, target: Obj, key: str, values: tuple[Any, ...]) -> None:
    value = draw(st.sampled_from((None, *values)))
    if value is not None:
        target[key] = value


@st.composite
def services(draw: st.DrawFn, local_first: bool = False) -> Obj:
    """A Service of any kind; `local_first` always asks for the LocalFirst policy (and uses
    no topology key but "*", which would keep remote endpoints out anyway)."""
    namespace = draw(st.sampled_from(NAMESPACES))
    name = draw(st.sampled_from(SERVICE_NAMES))
    kind = draw(
        st.sampled_from(
            ("ClusterIP", "ClusterIP", "NodePort", "LoadBalancer", "Headless", "ExternalName")
        )
    )
    labels: dict[str, str] = {}
    proxy_name = draw(st.sampled_from((*(None,) * 6, "kbp", "other", "")))
    if proxy_name is not None:
        labels[LABEL_PROXY_NAME] = proxy_name
    annotations: dict[str, str] = {}
    keys = draw(st.sampled_from((None, "*") if local_first else (*(None,) * 6, *TOPOLOGY_KEYS)))
    if keys is not None:
        annotations[ANNOTATION_TOPOLOGY_KEYS] = keys
    policies = ("LocalFirst", "cilium") if local_first else (None, None, None, *MULTI_CLUSTER)
    policy = draw(st.sampled_from(policies))
    if policy == "cilium":
        annotations[ANNOTATION_CILIUM_AFFINITY] = "local"
    elif policy is not None:
        annotations[ANNOTATION_MULTI_CLUSTER] = policy
    obj: Obj = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "namespace": namespace,
            "name": name,
            "labels": labels,
            "annotations": annotations,
        },
    }
    if kind == "ExternalName":
        obj["spec"] = {"type": "ExternalName", "externalName": "db.example.com"}
        return obj

    spec: Obj = {"type": "ClusterIP" if kind == "Headless" else kind}
    obj["spec"] = spec
    n = draw(st.integers(1, 20))
    if kind == "Headless":
        spec["clusterIP"] = "None"
        spec["clusterIPs"] = ["None"]
    else:
        v4, v6 = f"10.96.0.{n}", ipv6("fd00:96", n, draw(st.integers(0, 2)))
        families = draw(st.sampled_from(((v4,), (v6,), (v4, v6), (v6, v4), (v4,))))
        spec["clusterIP"] = families[0]
        spec["clusterIPs"] = list(families)
        # (internal, external) traffic policy; None = unset (Cluster). Drawn as pairs so
        # that every combination is common.
        itp, etp = draw(st.sampled_from(TRAFFIC_POLICIES))
        if itp:
            spec["internalTrafficPolicy"] = itp
        if etp:
            spec["externalTrafficPolicy"] = etp
        spec["externalIPs"] = draw(
            st.lists(st.sampled_from(("203.0.113.7", "2001:db8:ff::7", "203.0.113.8")),
                     unique=True, max_size=2)
        )  # fmt: skip
        affinity = draw(st.sampled_from((None, "None", "ClientIP")))
        if affinity:
            spec["sessionAffinity"] = affinity
            timeout = draw(st.sampled_from((None, 1, 600, 86400)))
            if affinity == "ClientIP" and timeout is not None:
                spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": timeout}}
        if kind == "LoadBalancer":
            spec["loadBalancerSourceRanges"] = draw(
                st.lists(st.sampled_from(("198.51.100.0/24", " 10.1.2.3/8 ", "2001:db8:1::/48")),
                         unique=True, max_size=2)
            )  # fmt: skip
            ingress = draw(
                st.lists(
                    st.sampled_from(
                        (
                            {"ip": "203.0.113.9"},
                            {"ip": "203.0.113.10", "ipMode": "VIP"},
                            {"ip": "203.0.113.11", "ipMode": "Proxy"},
                            {"ip": "2001:db8:ff::9"},
                            {"hostname": "lb.example.com"},
                        )
                    ),
                    unique_by=lambda i: str(i),
                    max_size=3,
                )
            )
            obj["status"] = {"loadBalancer": {"ingress": ingress}}
            if spec.get("externalTrafficPolicy") == "Local" and draw(st.booleans()):
                spec["healthCheckNodePort"] = 32000
    port_names = draw(
        st.sampled_from((("",), ("http",), ("dns",), ("http", "dns"), ("http", "metrics")))
    )
    ports = []
    # Distinct ports and nodePorts: the API server rejects two with the same number and
    # protocol (the decoder keeps the first of such a pair, see test_bad_input.py).
    count = len(port_names)
    numbers = draw(
        st.lists(st.sampled_from((80, 53, 443)), min_size=count, max_size=count, unique=True)
    )
    node_ports = draw(
        st.lists(st.sampled_from((30080, 30053)), min_size=count, max_size=count, unique=True)
    )
    for port_name, number, node_port in zip(port_names, numbers, node_ports, strict=True):
        port: Obj = {"port": number}
        if port_name:
            port["name"] = port_name
        _maybe(draw, port, "protocol", ("TCP", "TCP", "UDP"))
        if kind in ("NodePort", "LoadBalancer") and draw(st.sampled_from((True, True, False))):
            port["nodePort"] = node_port
        port["targetPort"] = 8080
        ports.append(port)
    spec["ports"] = ports
    return obj


# --- EndpointSlices --------------------------------------------------------------------


@st.composite
def endpoints(draw: st.DrawFn, family: str, hints_mode: str = "random") -> Obj:
    """One endpoint. `hints_mode` "zone"/"node": hints as the EndpointSlice controller
    writes them for trafficDistribution (forZones = its zone; PreferSameNode adds forNodes
    = its node), so that every endpoint of the slice carries one; "random": any or none."""
    n = draw(st.integers(1, 6))
    ip = f"10.244.0.{n}" if family == "IPv4" else ipv6("fd00:244", n, draw(st.integers(0, 2)))
    addresses = [ip]
    if one_in(draw, 6):  # only the first address counts
        addresses.append("10.244.9.9" if family == "IPv4" else "fd00:244::99")
    endpoint: Obj = {"addresses": addresses}
    if not one_in(draw, 5):
        conditions: Obj = {}
        for key in ("ready", "serving", "terminating"):
            _maybe(draw, conditions, key, (True, False))
        endpoint["conditions"] = conditions
    node = draw(st.sampled_from((None, THIS_NODE, *NODE_NAMES, THIS_NODE, UNKNOWN_NODE)))
    if node is not None:
        endpoint["nodeName"] = node
    zone = draw(st.sampled_from((None, *ZONES, *ZONES)))
    if zone is not None:
        endpoint["zone"] = zone
    hints: Obj = {}
    if hints_mode in ("zone", "node"):
        hints["forZones"] = [{"name": zone or draw(st.sampled_from(ZONES))}]
        if hints_mode == "node":
            hints["forNodes"] = [{"name": node or draw(st.sampled_from(NODE_NAMES))}]
    elif one_in(draw, 3):
        zone_hints = draw(st.sampled_from((None, (), ("zone-1",), ("zone-2",), ZONES)))
        if zone_hints is not None:
            hints["forZones"] = [{"name": z} for z in zone_hints]
        node_hints = draw(st.sampled_from((None, (THIS_NODE,), ("node-b",), NODE_NAMES)))
        if node_hints is not None:
            hints["forNodes"] = [{"name": z} for z in node_hints]
    if hints or one_in(draw, 8):
        endpoint["hints"] = hints
    return endpoint


def _service_port_keys(service: Obj) -> list[tuple[str, str]]:
    return [(p.get("name", ""), p.get("protocol", "TCP")) for p in service["spec"].get("ports", [])]


def _service_families(service: Obj) -> list[str]:
    ips = service["spec"].get("clusterIPs") or []
    return ["IPv6" if ":" in ip else "IPv4" for ip in ips if ip != "None"]


@st.composite
def endpoint_slices(
    draw: st.DrawFn,
    service: Obj | None = None,
    name: str | None = None,
    hints: str | None = None,
    remote: bool | None = None,
) -> Obj:
    """A slice; with `service`, one aimed at it (its namespace, name, families, and mostly
    its port names and protocols), else one with every field drawn from the pools. The
    slice's own name is drawn from SLICE_NAMES unless given; `hints` as for `endpoints`;
    `remote` forces a slice of this cluster (False) or an imported one (True)."""
    if service is not None:
        namespace = service["metadata"]["namespace"]
        service_name = service["metadata"]["name"]
        families = _service_families(service) or ["IPv4", "IPv6"]
        family = draw(st.sampled_from([*families * 4, "IPv4", "IPv6"]))
        wanted = _service_port_keys(service)
    else:
        namespace = draw(st.sampled_from(NAMESPACES))
        service_name = draw(st.sampled_from((*SERVICE_NAMES, "ghost")))
        family = draw(st.sampled_from(("IPv4", "IPv6")))
        wanted = []
    name = name or draw(st.sampled_from(SLICE_NAMES))
    labels = {LABEL_SERVICE_NAME: service_name}
    annotations: dict[str, str] = {}
    # An empty source-cluster label is its own origin, so that it is not rare.
    origins = ("native", "provision", "mcs", "mcs-empty", "dispatch", "old")
    if remote is not None:
        origins = origins[1:] if remote else origins[:1]
    origin = draw(st.sampled_from(origins))
    manager = {"dispatch": KARMADA_DISPATCH, "old": KARMADA_OLD}.get(origin, NATIVE_MANAGER)
    if origin != "native" or draw(st.booleans()):
        labels[LABEL_MANAGED_BY] = manager
    if origin == "provision" or (origin == "dispatch" and draw(st.booleans())):
        annotations[ANNOTATION_PROVISION_CLUSTER] = draw(st.sampled_from(PROVISION_CLUSTERS))
    if origin == "mcs":
        labels[LABEL_SOURCE_CLUSTER] = draw(st.sampled_from(SOURCE_CLUSTERS))
    if origin == "mcs-empty":
        labels[LABEL_SOURCE_CLUSTER] = ""
    if one_in(draw, 16):
        labels[LABEL_HEADLESS] = ""

    # (name or None for no name key, protocol or None for the default), unique names.
    port_keys: dict[str | None, str | None] = {}
    for port_name, protocol in wanted:
        if not one_in(draw, 5):  # mostly the Service's ports, as the controller writes
            port_keys[port_name] = protocol if draw(st.booleans()) or protocol != "TCP" else None
    for port_name in draw(
        st.lists(st.sampled_from(("", "http", "dns", "metrics", None)), unique=True, max_size=2)
    ):
        if port_name not in port_keys and (not wanted or one_in(draw, 4)):
            port_keys[port_name] = draw(st.sampled_from((None, "TCP", "TCP", "UDP")))
    ports = []
    for port_name, protocol in port_keys.items():
        port: Obj = {"port": draw(st.sampled_from((8080, 8080, 8080, 8081, 8081, 5353, 5353, 0)))}
        if port_name is not None:  # a port without a name key is ignored
            port["name"] = port_name
        if protocol is not None:
            port["protocol"] = protocol
        ports.append(port)
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "namespace": namespace,
            "name": name,
            "labels": labels,
            "annotations": annotations,
        },
        "addressType": family,
        "ports": ports,
        "endpoints": draw(
            st.lists(
                endpoints(family, hints or draw(st.sampled_from(("random", "zone", "node")))),
                min_size=1 if wanted else 0,
                max_size=5,
            )
        ),
    }


# --- a whole cluster -------------------------------------------------------------------


def object_key(obj: Obj) -> tuple[str, str, str]:
    """(kind, namespace, name): the identity an upsert replaces."""
    meta = obj["metadata"]
    namespace = "" if obj["kind"] == "Node" else meta.get("namespace", "default")
    return obj["kind"], namespace, meta["name"]


def unique(objects: list[Obj]) -> list[Obj]:
    """One object per identity, the last one winning (as a sequence of upserts would)."""
    return list({object_key(o): o for o in objects}.values())


@st.composite
def compile_options(draw: st.DrawFn) -> CompileOptions:
    return CompileOptions(
        nodeport_addresses=draw(
            st.sampled_from(((), (), ("192.0.2.0/24",), ("primary",), ("2001:db8::/64",)))
        ),
        cluster_cidrs=("10.244.0.0/16",),
        cluster_name=draw(st.sampled_from((None, THIS_CLUSTER))),
        service_proxy_name=draw(st.sampled_from((None, None, "kbp"))),
        node_labels=draw(st.sampled_from(({}, {}, {LABEL_RACK: "r1"}))),
    )


@dataclass
class Cluster:
    """Generated objects (unique identities) and the options the node is compiled with."""

    nodes: list[Obj]
    services: list[Obj]
    slices: list[Obj]
    options: CompileOptions

    @property
    def objects(self) -> list[Obj]:
        return [*self.nodes, *self.services, *self.slices]


@st.composite
def clusters(draw: st.DrawFn, local_first: bool = False) -> Cluster:
    """Nodes, Services, slices (mostly aimed at the Services) and compile options;
    `local_first`: every Service asks for LocalFirst (multi-cluster focus)."""
    names = draw(st.lists(st.sampled_from(NODE_NAMES), unique=True, max_size=3))
    service_list = unique(draw(st.lists(services(local_first), min_size=1, max_size=5)))
    slice_list = []
    for service in service_list:
        # Named after their Service (as the controller does), so they rarely replace
        # each other; the random slices below reuse SLICE_NAMES.
        prefix = service["metadata"]["name"]
        count = draw(st.sampled_from((2, 1, 3, 0)))
        hints = draw(st.sampled_from(("random", "zone", "node")))  # one mode per Service
        # Either each slice picks its origin, or this cluster's and imported ones alternate.
        mixed = local_first or draw(st.booleans())
        slice_list += [
            draw(endpoint_slices(service, f"{prefix}-{i}", hints, i % 2 == 1 if mixed else None))
            for i in range(count)
        ]
    slice_list += draw(st.lists(endpoint_slices(), max_size=2))
    return Cluster(
        nodes=[draw(nodes(name)) for name in names],
        services=service_list,
        slices=unique(draw(st.permutations(slice_list))),
        options=draw(compile_options()),
    )


# A change to a cluster: ("upsert", object) or ("delete", (kind, namespace, name)); the
# identity deleted may not exist.
Change = tuple[str, Any]


@st.composite
def histories(draw: st.DrawFn, max_changes: int = 12) -> tuple[Cluster, list[tuple[Change, bool]]]:
    """A cluster and a sequence of changes to it, each with whether the agent syncs after it
    (consecutive changes without a sync are coalesced). Slices are mostly aimed at a
    Service known at that point, so upserts keep matching Service ports."""
    cluster = draw(clusters())
    known = list(cluster.services)
    steps: list[tuple[Change, bool]] = []
    for _ in range(draw(st.integers(0, max_changes))):
        kind = draw(st.sampled_from(("service", "slice", "slice", "slice", "node", "delete")))
        change: Change
        if kind == "service":
            known.append(draw(services()))
            change = ("upsert", known[-1])
        elif kind == "slice":
            target = draw(st.sampled_from((*known, None)))
            name = None
            if target is not None and draw(st.booleans()):
                name = f"{target['metadata']['name']}-{draw(st.integers(0, 2))}"
            change = ("upsert", draw(endpoint_slices(target, name)))
        elif kind == "node":
            change = ("upsert", draw(nodes()))
        else:
            change = (
                "delete",
                draw(
                    st.one_of(
                        st.tuples(st.just("Service"), st.sampled_from(NAMESPACES),
                                  st.sampled_from(SERVICE_NAMES)),
                        st.tuples(st.just("EndpointSlice"), st.sampled_from(NAMESPACES),
                                  st.sampled_from((*SLICE_NAMES, "web-0", "dns-1", "api-0"))),
                        st.tuples(st.just("Node"), st.just(""), st.sampled_from(NODE_NAMES)),
                    )
                ),
            )  # fmt: skip
        steps.append((change, draw(st.booleans())))
    return cluster, steps
