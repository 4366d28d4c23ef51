"""The iptables renderer, tested by where packets go: NodeStates compiled from Kubernetes
objects are rendered, loaded into the tracer (agent/dataplane/iptables/tracer.py) together
with the dataplane's jump rules, and packets are traced through nat and filter.

Address plan (tests/builders.py): this node node-a 192.0.2.10 / 2001:db8::10; pods of
node-a 10.244.1.<n>, node-b 10.244.2.<n>, node-c 10.244.3.<n> (IPv6 fd00:244:<node>::<n>),
all serving on 8080. Pod CIDRs 10.244.0.0/16 and fd00:244::/32 (a /48 would not hold fd00:244:1::),
pod interfaces "veth+".
Service "svc" in "default": ClusterIP 10.96.0.1:80 (fd00:96::1), NodePort 30080,
ExternalIP 203.0.113.7, LoadBalancer VIP 203.0.113.9 (2001:db8:9::9), source range
198.51.100.0/24 (2001:db8:100::/64). Clients: a pod of this node 10.244.1.99 on veth1a2b,
an outside client 198.51.100.7 (inside the source range), a stranger 100.64.0.7 (outside
it), and the node itself (sending from 192.0.2.10).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from agent.dataplane.iptables.render import (
    IPV4,
    IPV6,
    RenderOptions,
    assemble,
    endpoint_chain,
    entry_rules,
    render,
    service_chain,
)
from agent.dataplane.iptables.tracer import Ruleset, Trace, UnknownRule, load, parse_rule
from agent.model.compile import compile
from agent.model.nodestate import LOAD_BALANCER, NodeState, ServiceEntry

from ..builders import (
    NODE_INDEX,
    Obj,
    both,
    default_nodes,
    ep,
    ep6,
    make_service,
    make_slice,
    spec,
    state_of,
)

NODE_IPS = ("192.0.2.10", "2001:db8::10")
V4 = RenderOptions(IPV4, ("10.244.0.0/16",), ("veth+",))
V6 = RenderOptions(IPV6, ("fd00:244::/32",), ("veth+",))
V4_NO_CIDR = RenderOptions(IPV4, (), ("veth+",))


@dataclass(frozen=True)
class Client:
    ip: str
    interface: str | None  # None: the node itself sends


POD = Client("10.244.1.99", "veth1a2b")
OUTSIDE = Client("198.51.100.7", "eth0")
STRANGER = Client("100.64.0.7", "eth0")
NODE = Client("192.0.2.10", None)
POD6 = Client("fd00:244:1::99", "veth1a2b")
OUTSIDE6 = Client("2001:db8:100::7", "eth0")
STRANGER6 = Client("2001:db8:200::7", "eth0")

CLUSTER_IP = ("10.96.0.1", 80)
NODE_PORT = ("192.0.2.10", 30080)
EXTERNAL_IP = ("203.0.113.7", 80)
LB_VIP = ("203.0.113.9", 80)


# --- building NodeStates ---------------------------------------------------------------


def at(n: int, node: str = "node-b") -> str:
    """The DNAT target of pod n of `node`."""
    return f"10.244.{NODE_INDEX[node]}.{n}:8080"


def at6(n: int, node: str = "node-b") -> str:
    return f"[fd00:244:{NODE_INDEX[node]}::{n}]:8080"


Mutator = Callable[[Obj], None]


def node_port(etp: str = "Cluster") -> Mutator:
    def mutate(obj: Obj) -> None:
        obj["spec"].update(type="NodePort", externalTrafficPolicy=etp)
        obj["spec"]["ports"][0]["nodePort"] = 30080

    return mutate


def load_balancer(etp: str = "Cluster", ranges: tuple[str, ...] = ()) -> Mutator:
    """A LoadBalancer (so also a NodePort) with VIP 203.0.113.9 and ExternalIP 203.0.113.7."""

    def mutate(obj: Obj) -> None:
        node_port(etp)(obj)
        obj["spec"].update(type="LoadBalancer", externalIPs=["203.0.113.7"])
        if ranges:
            obj["spec"]["loadBalancerSourceRanges"] = list(ranges)
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}

    return mutate


def affinity(timeout: int) -> Mutator:
    return spec(
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": timeout}},
    )


def protocol(name: str) -> Mutator:
    def mutate(obj: Obj) -> None:
        obj["spec"]["ports"][0]["protocol"] = name

    return mutate


def dual_stack(obj: Obj) -> None:
    obj["spec"].update(clusterIPs=["10.96.0.1", "fd00:96::1"], ipFamilyPolicy="RequireDualStack")


def svc(
    endpoints: list[Obj],
    mutate: Mutator | None = None,
    *,
    name: str = "svc",
    cluster_ip: str = "10.96.0.1",
    proto: str = "TCP",
    endpoints6: list[Obj] | None = None,
) -> list[Obj]:
    """A Service with one port 80 → 8080 and a slice of its endpoints (and one of its IPv6
    endpoints when given)."""

    def service_mutate(obj: Obj) -> None:
        obj["spec"].update(clusterIP=cluster_ip, clusterIPs=[cluster_ip])
        obj["spec"]["ports"][0]["protocol"] = proto
        if mutate:
            mutate(obj)

    def slice_protocol(obj: Obj) -> None:
        obj["ports"][0]["protocol"] = proto

    objects = [
        make_service(name=name, mutate=service_mutate),
        make_slice(name=f"{name}-1", service=name, endpoints=endpoints, mutate=slice_protocol),
    ]
    if endpoints6 is not None:
        objects.append(
            make_slice(
                name=f"{name}-6",
                service=name,
                endpoints=endpoints6,
                mutate=slice_protocol,
                family="IPv6",
            )
        )
    return objects


def node_state(*objects: Obj) -> NodeState:
    return compile(state_of(*default_nodes(), *objects), "node-a")


def rules_of(objects: list[Obj], options: RenderOptions = V4) -> Ruleset:
    return load(render(node_state(*objects).services, options), NODE_IPS)


def send(ruleset: Ruleset, client: Client, to: tuple[str, int], proto: str = "tcp") -> Trace:
    return ruleset.trace(client.ip, to[0], to[1], proto, in_interface=client.interface)


# --- where packets go: one table -------------------------------------------------------

THREE_REMOTE = [ep(1), ep(2), ep(3, "node-c")]
EVENLY_THREE = {at(1): 1 / 3, at(2): 1 / 3, at(3, "node-c"): 1 / 3}
MIXED = [ep(1, "node-a"), ep(2, "node-a"), ep(3)]  # two local endpoints, one on node-b
ALL_MIXED = {at(1, "node-a"): 1 / 3, at(2, "node-a"): 1 / 3, at(3): 1 / 3}
LOCAL_ONLY = {at(1, "node-a"): 1 / 2, at(2, "node-a"): 1 / 2}


@dataclass(frozen=True)
class Case:
    name: str
    objects: list[Obj]
    client: Client
    to: tuple[str, int]
    endpoints: dict[str, float]  # DNAT target → probability; {} when not translated
    verdict: str = "ACCEPT"
    masquerade: bool = False
    proto: str = "tcp"
    options: RenderOptions = V4
    chains: tuple[str, ...] = field(default=())  # nat chain kinds the packet passes, in order


CASES = [
    Case("a ClusterIP splits evenly over its cluster endpoints", svc(THREE_REMOTE), POD, CLUSTER_IP,
        EVENLY_THREE, chains=("SVC", "SEP")),
    Case("a client outside the pod CIDR reaching a ClusterIP is masqueraded", svc(THREE_REMOTE),
        OUTSIDE, CLUSTER_IP, EVENLY_THREE, masquerade=True),
    Case("the node reaching a ClusterIP is masqueraded", svc(THREE_REMOTE), NODE, CLUSTER_IP,
        EVENLY_THREE, masquerade=True),
    Case("a pod reaching itself through its ClusterIP is masqueraded (hairpin)",
        svc([ep(99, "node-a")]), POD, CLUSTER_IP, {at(99, "node-a"): 1.0}, masquerade=True),
    Case("internalTrafficPolicy Local uses only the endpoints on this node",
        svc(MIXED, spec(internalTrafficPolicy="Local")), POD, CLUSTER_IP, LOCAL_ONLY,
        chains=("SVL", "SEP")),
    Case("internalTrafficPolicy Local drops when endpoints exist but none is on this node",
        svc(THREE_REMOTE, spec(internalTrafficPolicy="Local")), POD, CLUSTER_IP, {},
        verdict="DROP"),
    Case("a ClusterIP with no endpoints at all is rejected", svc([], load_balancer()), POD,
        CLUSTER_IP, {}, verdict="REJECT"),
    Case("a NodePort with no endpoints at all is rejected", svc([], load_balancer()), OUTSIDE,
        NODE_PORT, {}, verdict="REJECT"),
    Case("an ExternalIP with no endpoints at all is rejected", svc([], load_balancer()), OUTSIDE,
        EXTERNAL_IP, {}, verdict="REJECT"),
    Case("a LoadBalancer VIP with no endpoints at all is rejected", svc([], load_balancer()),
        OUTSIDE, LB_VIP, {}, verdict="REJECT"),
    Case("a source-ranged LoadBalancer VIP with no endpoints at all is rejected, even for a "
        "client the ranges refuse",
        svc([], load_balancer(ranges=("198.51.100.0/24",))), STRANGER, LB_VIP, {},
        verdict="REJECT"),
    Case("only unready endpoints count as no endpoints: rejected", svc([ep(1, ready=False)]), POD,
        CLUSTER_IP, {}, verdict="REJECT"),
    Case("externalTrafficPolicy Cluster: an outside client on a NodePort is masqueraded and "
        "reaches every cluster endpoint",
        svc(MIXED, node_port()), OUTSIDE, NODE_PORT, ALL_MIXED, masquerade=True,
        chains=("EXT", "MARK-MASQ", "SVC", "SEP")),
    Case("externalTrafficPolicy Cluster: an outside client on an ExternalIP is masqueraded and "
        "reaches every cluster endpoint",
        svc(MIXED, load_balancer()), OUTSIDE, EXTERNAL_IP, ALL_MIXED, masquerade=True),
    Case("externalTrafficPolicy Cluster: a pod on a NodePort is masqueraded too",
        svc(MIXED, node_port()), POD, NODE_PORT, ALL_MIXED, masquerade=True),
    Case("externalTrafficPolicy Local: an outside client reaches only local endpoints and "
        "keeps its address",
        svc(MIXED, node_port("Local")), OUTSIDE, NODE_PORT, LOCAL_ONLY,
        chains=("EXT", "SVL", "SEP")),
    Case("externalTrafficPolicy Local: an outside client on a LoadBalancer VIP reaches only "
        "local endpoints",
        svc(MIXED, load_balancer("Local")), OUTSIDE, LB_VIP, LOCAL_ONLY),
    Case("externalTrafficPolicy Local: a pod in the pod CIDR reaches every cluster endpoint",
        svc(MIXED, node_port("Local")), POD, NODE_PORT, ALL_MIXED, chains=("EXT", "SVC", "SEP")),
    Case("externalTrafficPolicy Local without a pod CIDR: a pod on a pod interface reaches "
        "every cluster endpoint",
        svc(MIXED, node_port("Local")), POD, NODE_PORT, ALL_MIXED, options=V4_NO_CIDR),
    Case("externalTrafficPolicy Local without a pod CIDR: an outside client still reaches only "
        "local endpoints",
        svc(MIXED, node_port("Local")), OUTSIDE, NODE_PORT, LOCAL_ONLY, options=V4_NO_CIDR),
    Case("externalTrafficPolicy Local: the node itself reaches every cluster endpoint, "
        "masqueraded",
        svc(MIXED, node_port("Local")), NODE, NODE_PORT, ALL_MIXED, masquerade=True,
        chains=("EXT", "MARK-MASQ", "SVC", "SEP")),
    Case("externalTrafficPolicy Local with no local endpoint: an outside client is dropped",
        svc(THREE_REMOTE, node_port("Local")), OUTSIDE, NODE_PORT, {}, verdict="DROP"),
    Case("externalTrafficPolicy Local with no local endpoint: a pod still reaches the cluster "
        "endpoints",
        svc(THREE_REMOTE, node_port("Local")), POD, NODE_PORT, EVENLY_THREE),
    Case("externalTrafficPolicy Local with no local endpoint: the node still reaches the "
        "cluster endpoints",
        svc(THREE_REMOTE, node_port("Local")), NODE, NODE_PORT, EVENLY_THREE, masquerade=True),
    Case("externalTrafficPolicy Local with no local endpoint: the ClusterIP still works",
        svc(THREE_REMOTE, node_port("Local")), POD, CLUSTER_IP, EVENLY_THREE),
    Case("loadBalancerSourceRanges: an allowed client reaches the endpoints",
        svc(THREE_REMOTE, load_balancer(ranges=("198.51.100.0/24",))), OUTSIDE, LB_VIP,
        EVENLY_THREE, masquerade=True, chains=("FW", "EXT", "MARK-MASQ", "SVC", "SEP")),
    Case("loadBalancerSourceRanges: any other client is dropped",
        svc(THREE_REMOTE, load_balancer(ranges=("198.51.100.0/24",))), STRANGER, LB_VIP, {},
        verdict="DROP"),
    Case("loadBalancerSourceRanges do not restrict the NodePort",
        svc(THREE_REMOTE, load_balancer(ranges=("198.51.100.0/24",))), STRANGER, NODE_PORT,
        EVENLY_THREE, masquerade=True),
    Case("loadBalancerSourceRanges with externalTrafficPolicy Local: an allowed client reaches "
        "the local endpoints",
        svc(MIXED, load_balancer("Local", ("198.51.100.0/24",))), OUTSIDE, LB_VIP, LOCAL_ONLY,
        chains=("FW", "EXT", "SVL", "SEP")),
    Case("a UDP ClusterIP reaches its endpoints", svc(THREE_REMOTE, proto="UDP"), POD, CLUSTER_IP,
        EVENLY_THREE, proto="udp"),
    Case("TCP to a UDP-only service port is left alone", svc(THREE_REMOTE, proto="UDP"), POD,
        CLUSTER_IP, {}),
    Case("an SCTP ClusterIP reaches its endpoints", svc(THREE_REMOTE, proto="SCTP"), POD,
        CLUSTER_IP, EVENLY_THREE, proto="sctp"),
    Case("UDP to an SCTP-only service port is left alone", svc(THREE_REMOTE, proto="SCTP"), POD,
        CLUSTER_IP, {}, proto="udp"),
    Case("another port of the ClusterIP is left alone", svc(THREE_REMOTE), POD, ("10.96.0.1", 81),
        {}),
    Case("an IPv6 ClusterIP splits over the IPv6 endpoints",
        svc(THREE_REMOTE, dual_stack, endpoints6=[ep6(1), ep6(2)]), POD6, ("fd00:96::1", 80),
        {at6(1): 0.5, at6(2): 0.5}, options=V6),
    Case("an IPv6 client outside the pod CIDR reaching a ClusterIP is masqueraded",
        svc(THREE_REMOTE, dual_stack, endpoints6=[ep6(1)]), OUTSIDE6, ("fd00:96::1", 80),
        {at6(1): 1.0}, masquerade=True, options=V6),
    Case("an IPv6 NodePort with externalTrafficPolicy Local reaches only the local endpoint",
        svc([], both(dual_stack, node_port("Local")), endpoints6=[ep6(1, "node-a"), ep6(2)]),
        OUTSIDE6, ("2001:db8::10", 30080), {at6(1, "node-a"): 1.0}, options=V6),
    Case("an IPv6 ClusterIP with no endpoints is rejected",
        svc(THREE_REMOTE, dual_stack, endpoints6=[]), POD6, ("fd00:96::1", 80), {},
        verdict="REJECT", options=V6),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_a_packet_goes_where_design_section_3_says(case: Case) -> None:
    ruleset = rules_of(case.objects, case.options)
    trace = send(ruleset, case.client, case.to, case.proto)
    assert trace.verdict == case.verdict, trace
    assert trace.endpoints() == pytest.approx(case.endpoints, abs=1e-9), trace
    if case.endpoints:
        assert sum(trace.endpoints().values()) == pytest.approx(1.0, abs=1e-9)
        assert trace.masquerade == case.masquerade, trace
    else:
        assert not any(o.dnat for o in trace.outcomes), trace
    if case.chains:
        for outcome in trace.fresh():
            kinds = tuple(
                m.group(1)
                for step in outcome.path
                if (m := re.fullmatch(r"nat KBP-(SVC|SVL|EXT|FW|SEP|MARK-MASQ)(-\w+)?", step))
            )
            assert kinds == case.chains, outcome.path


# --- affinity --------------------------------------------------------------------------


def test_client_ip_affinity_checks_recent_lists_before_the_split_and_sets_one_per_endpoint():
    objects = svc(THREE_REMOTE, affinity(600))
    trace = send(rules_of(objects), POD, CLUSTER_IP)
    entry = node_state(*objects).services[0]
    seps = {f"{b.ip}:{b.port}": endpoint_chain(entry, b) for b in entry.cluster_backends or ()}
    assert list(seps) == [at(1), at(2), at(3, "node-c")]

    # a new client: every endpoint's list is checked, with the timeout, before the split;
    # then the chosen endpoint's list remembers the client
    assert trace.endpoints() == pytest.approx(EVENLY_THREE, abs=1e-9)
    for outcome in trace.fresh():
        assert [(c.name, c.seconds, c.remembered) for c in outcome.recent_checks] == [
            (sep, 600, False) for sep in seps.values()
        ]
        assert outcome.recent_sets == (seps[outcome.dnat],)

    # a remembered client goes straight back to its endpoint, whatever the split says
    remembered = [o for o in trace.outcomes if o not in trace.fresh()]
    assert {o.dnat: o.probability for o in remembered} == dict.fromkeys(seps, 1.0)
    for outcome in remembered:
        hit = outcome.recent_checks[-1]
        assert (hit.name, hit.seconds, hit.remembered) == (seps[outcome.dnat], 600, True)
        assert not any(c.remembered for c in outcome.recent_checks[:-1])


def test_ipv6_affinity_masks_the_whole_ipv6_address():
    objects = svc([], both(dual_stack, affinity(30)), endpoints6=[ep6(1), ep6(2)])
    text = render(node_state(*objects).services, V6)
    assert "--mask ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff" in text
    assert "255.255.255.255" not in text
    trace = send(load(text, NODE_IPS), POD6, ("fd00:96::1", 80))
    assert trace.endpoints() == pytest.approx({at6(1): 0.5, at6(2): 0.5})


# --- the split -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 10, 33])
def test_n_endpoints_each_get_one_nth(n: int):
    endpoints = [ep(i) for i in range(1, n + 1)]
    trace = send(rules_of(svc(endpoints)), POD, CLUSTER_IP)
    shares = trace.endpoints()
    assert len(shares) == n
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-9)
    assert max(shares.values()) - min(shares.values()) < 1e-8


# --- families and protocols in the text ------------------------------------------------


def test_ipv6_entries_render_host_prefixes_of_128_and_bracketed_dnat_targets():
    objects = svc(THREE_REMOTE, both(dual_stack, load_balancer()), endpoints6=[ep6(1)])
    text = render(node_state(*objects).services, V6)
    assert "-d fd00:96::1/128 " in text
    assert "-d 2001:db8::10/128 " in text
    assert "-s fd00:244:2::1/128 " in text  # hairpin
    assert "--to-destination [fd00:244:2::1]:8080" in text
    assert not re.search(r"\d+\.\d+\.\d+\.\d+/32", text)
    assert "10.96.0.1" not in text and "10.244." not in text  # nothing of the other family


def test_ipv4_text_holds_nothing_of_ipv6_entries():
    objects = svc(THREE_REMOTE, dual_stack, endpoints6=[ep6(1)])
    text = render(node_state(*objects).services, V4)
    assert "fd00:" not in text and "/128" not in text
    assert "-d 10.96.0.1/32 " in text


@pytest.mark.parametrize("proto", ["tcp", "udp", "sctp"])
def test_every_port_match_names_the_service_protocol(proto: str):
    text = render(node_state(*svc(THREE_REMOTE, load_balancer(), proto=proto.upper())).services,
                  V4)  # fmt: skip
    rules = [parse_rule(line) for line in text.splitlines() if line.startswith("-A")]
    ported = [r for r in rules if any(m.has("--dport") for m in r.matches)]
    assert ported
    for rule in ported:
        assert rule.protocol == (proto, False), rule.text
        assert [m.module for m in rule.matches if m.has("--dport")] == [proto], rule.text
    dnat = [r for r in rules if r.target == "DNAT"]
    assert dnat and all(r.protocol == (proto, False) for r in dnat)


def test_a_source_range_of_the_other_family_is_not_rendered_into_this_familys_table():
    ranges = ("198.51.100.0/24", "2001:db8:100::/64")
    objects = svc(THREE_REMOTE, both(dual_stack, load_balancer(ranges=ranges)), endpoints6=[ep6(1)])

    def add_v6_vip(obj: Obj) -> None:
        if obj["kind"] == "Service":
            obj["status"]["loadBalancer"]["ingress"].append({"ip": "2001:db8:9::9"})

    for obj in objects:
        add_v6_vip(obj)
    services = node_state(*objects).services
    v4 = render(services, V4)
    v6 = render(services, V6)
    assert "198.51.100.0/24" in v4 and "2001:db8:100::/64" not in v4
    assert "2001:db8:100::/64" in v6 and "198.51.100.0/24" not in v6
    trace6 = send(load(v6, NODE_IPS), OUTSIDE6, ("2001:db8:9::9", 80))
    assert trace6.endpoints() == pytest.approx({at6(1): 1.0})
    assert send(load(v6, NODE_IPS), STRANGER6, ("2001:db8:9::9", 80)).verdict == "DROP"


def test_the_compiler_alone_splits_source_ranges_by_family():
    """Each LoadBalancer frontend carries the ranges of its entry's family only: the
    renderer (and the eBPF plan) take them as they are."""
    ranges = ("198.51.100.0/24", "2001:db8:100::/64")
    objects = svc(THREE_REMOTE, both(dual_stack, load_balancer(ranges=ranges)), endpoints6=[ep6(1)])
    for obj in objects:
        if obj["kind"] == "Service":
            obj["status"]["loadBalancer"]["ingress"].append({"ip": "2001:db8:9::9"})
    ranged = {
        (e.ip_family, f.ip): f.source_ranges
        for e in node_state(*objects).services
        for f in e.frontends
        if f.type == LOAD_BALANCER
    }
    assert set(ranged.values()) == {("198.51.100.0/24",), ("2001:db8:100::/64",)}
    assert all((":" in r) == (family == "IPv6") for (family, _), rs in ranged.items() for r in rs)


# --- chain names -----------------------------------------------------------------------


def _declared_chains(text: str) -> dict[str, list[str]]:
    """table → the chains the document declares in it."""
    out: dict[str, list[str]] = {}
    table = ""
    for line in text.splitlines():
        if line.startswith("*"):
            table = line[1:]
            out[table] = []
        elif line.startswith(":"):
            out[table].append(line[1:].split()[0])
    return out


def test_chain_names_are_stable_short_and_unique_per_service_port():
    objects = [
        *svc(MIXED, load_balancer("Local", ("198.51.100.0/24",)), name="svc"),
        *svc(MIXED, load_balancer("Local", ("198.51.100.0/24",)), name="other",
             cluster_ip="10.96.0.2"),
    ]  # fmt: skip
    first = render(node_state(*objects).services, V4)
    again = render(node_state(*objects).services, V4)
    assert first == again
    declared = _declared_chains(first)
    for table_chains in declared.values():
        assert len(table_chains) == len(set(table_chains))
        assert all(len(c) <= 28 and c.startswith("KBP-") for c in table_chains), table_chains
    chains = declared["nat"]
    svc_entry, other_entry = sorted(node_state(*objects).services, key=lambda e: e.name != "svc")
    for kind in ("SVC", "SVL", "EXT", "FW"):
        assert service_chain(kind, svc_entry) != service_chain(kind, other_entry)
        assert service_chain(kind, svc_entry) in chains
    # the same endpoint behind two Services gets two endpoint chains
    backend = (svc_entry.cluster_backends or ())[0]
    assert endpoint_chain(svc_entry, backend) != endpoint_chain(other_entry, backend)


def test_chain_names_do_not_depend_on_the_endpoints_or_other_services():
    alone = node_state(*svc(THREE_REMOTE)).services[0]
    services = node_state(*svc([ep(9)]), *svc([], name="zz", cluster_ip="10.96.0.9")).services
    crowded = next(e for e in services if e.name == "svc")
    assert service_chain("SVC", alone) == service_chain("SVC", crowded)


# --- the tracer is strict --------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        "-A KBP-X -m multiport --dports 80,443 -j ACCEPT",
        "-A KBP-X -p tcp -m tcp --sport 80 -j ACCEPT",
        "-A KBP-X -o eth0 -j ACCEPT",
        "-A KBP-X -j SNAT --to-source 1.2.3.4",
    ],
)
def test_the_tracer_refuses_what_it_does_not_model(line: str):
    with pytest.raises(UnknownRule):
        ruleset = Ruleset()
        ruleset.restore(f"*nat\n:KBP-X - [0:0]\n{line}\nCOMMIT\n")
        ruleset.restore("*nat\n-A PREROUTING -j KBP-X\nCOMMIT\n")
        ruleset.trace("10.0.0.1", "10.0.0.2", 80)


# --- partial documents -----------------------------------------------------------------


def test_a_partial_document_over_the_full_one_leaves_what_a_fresh_full_render_would():
    """The `assemble` half of partial sync: dispatch chains plus the changed entry's chains,
    and the chains it no longer has deleted."""
    before = node_state(*svc(THREE_REMOTE), *svc([ep(7)], name="other", cluster_ip="10.96.0.2"))
    after = node_state(*svc([ep(1), ep(4)]), *svc([ep(7)], name="other", cluster_ip="10.96.0.2"))
    old = {e.sort_key: entry_rules(e, V4) for e in before.services}
    new = {e.sort_key: entry_rules(e, V4) for e in after.services}
    changed = [new[k] for k in new if new[k] != old[k]]
    assert len(changed) == 1
    stale = {c for k in new if new[k] != old[k] for c in old[k].chains} - {
        c for r in new.values() for c in r.chains
    }
    assert len(stale) == 2  # the endpoint chains of 10.244.2.2 and 10.244.3.3

    applied = Ruleset()
    applied.restore(render(before.services, V4))
    applied.restore(assemble(V4, new.values(), changed, stale).text)
    fresh = Ruleset()
    fresh.restore(render(after.services, V4))
    for table in ("nat", "filter"):
        assert applied.chains(table) == fresh.chains(table)


# --- masquerade of Service traffic that did not come from a pod -------------------------


def test_without_a_pod_cidr_an_outside_client_reaching_a_cluster_ip_is_masqueraded():
    trace = send(rules_of(svc(THREE_REMOTE), V4_NO_CIDR), OUTSIDE, CLUSTER_IP)
    assert trace.endpoints() == pytest.approx(EVENLY_THREE)
    assert trace.masquerade


def test_entries_of_another_family_are_ignored_by_render():
    """render() filters by family, so one call per family over all entries is safe."""
    entries: list[ServiceEntry] = list(
        node_state(*svc(THREE_REMOTE, dual_stack, endpoints6=[ep6(1)])).services
    )
    assert {e.ip_family for e in entries} == {IPV4, IPV6}
    assert render(entries, V4) == render([e for e in entries if e.ip_family == IPV4], V4)
