"""The iptables dataplane against the real iptables-restore/ip6tables-restore, each test in
throw-away network namespaces: the golden documents load, partial syncs rewrite only the
changed Service's chains and leave the tables a fresh full render would, cleanup removes
every KBP- chain and jump, and other programs' rules survive all of it.

Address plan (tests/builders.py): node-a 192.0.2.10 / 2001:db8::10, pods 10.244.<node>.<n>
and fd00:244:<node>::<n>, pod CIDRs 10.244.0.0/16 and fd00:244::/32. Services "web"
(10.96.0.1, NodePort 30080), "api" (10.96.0.2, dual-stack fd00:96::2) and "dns" (UDP,
10.96.0.3), all in "default".
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator

import pytest

from agent.dataplane.iptables import dataplane as iptables_dataplane
from agent.dataplane.iptables.backend import Backend, find_backend
from agent.dataplane.iptables.dataplane import (
    IptablesDataplane,
    cleanup,
    kernel_marker,
)
from agent.dataplane.iptables.render import (
    FAMILIES,
    IPV4,
    IPV6,
    NAT_BASE_CHAINS,
    STATE,
    RenderOptions,
    interface_patterns,
    render,
    service_chain,
)
from agent.dataplane.iptables.tracer import Ruleset, jump_document
from agent.model.compile import CompileOptions, compile
from agent.model.nodestate import NodeState

from ..builders import (
    Obj,
    default_nodes,
    ep,
    make_endpoint,
    make_service,
    make_slice,
    spec,
    state_of,
)
from ..conftest import require_iptables
from ..unit.test_iptables_golden import examples_render

POD_INTERFACES = ("veth*",)
POD_CIDRS = ("10.244.0.0/16", "fd00:244::/32")
# The backend `auto` picks in a fresh namespace (no rules anywhere): nft, through the
# same tools the dataplane runs.
NFT = find_backend("nft") or Backend("nft", "-nft")
SAVE = {family: NFT.save(family) for family in FAMILIES}
RESTORE = {family: NFT.restore(family) for family in FAMILIES}
IPTABLES = {family: NFT.iptables(family) for family in FAMILIES}


def in_ns(ns: str, *argv: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["nsenter", f"--net=/run/netns/{ns}", "--", *argv],
        input=stdin, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def save(ns: str, family: str) -> str:
    proc = in_ns(ns, SAVE[family])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def iptables_ns(netns: Callable[[], str]) -> Iterator[str]:
    """A fresh namespace where iptables works; our rules removed afterwards even when the
    test failed (the namespace goes too, which would take them anyway)."""
    name = netns()
    require_iptables(name)
    try:
        yield name
    finally:
        cleanup(name)


# --- states ----------------------------------------------------------------------------


def service(name: str, ip: str, endpoints: list[Obj], *, proto: str = "TCP",
            node_port: int = 0, ip6: str | None = None,
            endpoints6: list[Obj] | None = None) -> list[Obj]:  # fmt: skip
    def mutate(obj: Obj) -> None:
        obj["spec"].update(clusterIP=ip, clusterIPs=[ip, ip6] if ip6 else [ip])
        port = obj["spec"]["ports"][0]
        port["protocol"] = proto
        if node_port:
            obj["spec"]["type"] = "NodePort"
            port["nodePort"] = node_port

    def slice_proto(obj: Obj) -> None:
        obj["ports"][0]["protocol"] = proto

    objects = [
        make_service(name=name, mutate=mutate),
        make_slice(name=f"{name}-1", service=name, endpoints=endpoints, mutate=slice_proto),
    ]
    if endpoints6 is not None:
        objects.append(make_slice(name=f"{name}-6", service=name, endpoints=endpoints6,
                                  mutate=slice_proto, family="IPv6"))  # fmt: skip
    return objects


def state(
    web: list[Obj],
    *,
    web_objects: list[Obj] | None = None,
    with_dns: bool = True,
    pod_cidrs: tuple[str, ...] = POD_CIDRS,
) -> NodeState:
    """web (a NodePort Service) with these endpoints, or these objects for web; api; dns."""
    api6 = [make_endpoint("fd00:244:2::2", "node-b")]
    objects = [
        *(web_objects or service("web", "10.96.0.1", web, node_port=30080)),
        *service("api", "10.96.0.2", [ep(2)], ip6="fd00:96::2", endpoints6=api6),
    ]
    if with_dns:
        objects += service("dns", "10.96.0.3", [ep(3), ep(4)], proto="UDP")
    return compile(
        state_of(*default_nodes(), *objects), "node-a", CompileOptions(cluster_cidrs=pod_cidrs)
    )


BEFORE = [ep(1, "node-a"), ep(5), ep(6)]
AFTER = [ep(1, "node-a"), ep(6), ep(7)]  # 10.244.2.5 left, 10.244.2.7 came


def expected_tables(node_state: NodeState, family: str) -> Ruleset:
    """What a fresh full render plus our jump rules leave in a namespace."""
    cidrs = tuple(c for c in node_state.node.cluster_cidrs if (":" in c) == (family == IPV6))
    options = RenderOptions(family, cidrs, interface_patterns(POD_INTERFACES))
    ruleset = Ruleset()
    ruleset.restore(render(node_state.services, options))
    ruleset.restore(jump_document())
    return ruleset


def assert_kernel_holds(ns: str, node_state: NodeState) -> None:
    markers = []
    for family in FAMILIES:
        kernel = Ruleset()
        kernel.restore(save(ns, family))
        expected = expected_tables(node_state, family)
        markers.append(kernel_marker(family, ns))
        assert markers[-1] is not None, f"{family}: no KBP-STATE marker"
        for table in ("nat", "filter"):
            held, wanted = kernel.chains(table), expected.chains(table)
            held.pop(STATE, None)  # the marker: checked above
            differing = sorted(
                c for c in held.keys() | wanted.keys() if held.get(c) != wanted.get(c)
            )
            assert not differing, f"{family} {table}: chains differ from a full render: {differing}"
    # A family that the last apply did not change keeps its older marker; the newest
    # names the revision.
    assert max(markers, key=lambda m: m[2])[0] == node_state.revision  # type: ignore[index]


class RecordingRestores:
    """Wraps the dataplane's command runner to keep every restore document it sends."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.documents: list[tuple[str, str]] = []  # (tool, text)
        real = iptables_dataplane._run

        def run(netns: str | None, argv: list[str], stdin: str | None = None):
            if argv[0] in RESTORE.values() and stdin is not None:
                self.documents.append((argv[0], stdin))
            return real(netns, argv, stdin)

        monkeypatch.setattr(iptables_dataplane, "_run", run)

    def take(self) -> dict[str, str]:
        out = dict(self.documents)
        self.documents.clear()
        return out


def declared_nat_chains(document: str) -> set[str]:
    nat = document.split("*nat", 1)[1].split("COMMIT", 1)[0]
    return {line[1:].split()[0] for line in nat.splitlines() if line.startswith(":")}


def deleted_chains(document: str) -> set[str]:
    return {line.split()[1] for line in document.splitlines() if line.startswith("-X ")}


# --- tests -----------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_the_golden_examples_render_is_accepted_by_the_real_restore(iptables_ns, family):
    proc = in_ns(iptables_ns, RESTORE[family], "-w", "5", "--noflush",
                 stdin=examples_render(family))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    kernel = Ruleset()
    kernel.restore(save(iptables_ns, family))
    rendered = Ruleset()
    rendered.restore(examples_render(family))
    for table in ("nat", "filter"):
        assert kernel.chains(table) == rendered.chains(table), table


def test_a_partial_sync_rewrites_only_the_changed_services_chains(iptables_ns, monkeypatch):
    restores = RecordingRestores(monkeypatch)
    dp = IptablesDataplane(POD_INTERFACES, netns=iptables_ns)
    first = state(BEFORE)
    dp.apply(first)
    full_writes = dict(dp.last_writes)
    assert set(restores.take()) == set(RESTORE.values())
    assert_kernel_holds(iptables_ns, first)

    second = state(AFTER)
    web = next(e for e in second.services if e.name == "web")
    web_chains = {service_chain(kind, web) for kind in ("SVC", "EXT")}
    dp.apply(second)
    documents = restores.take()
    assert list(documents) == [RESTORE[IPV4]], "IPv6 did not change: nothing to write"
    assert dp.last_writes[IPV6] == 0
    document = documents[RESTORE[IPV4]]
    written = declared_nat_chains(document) - set(NAT_BASE_CHAINS)
    assert web_chains <= written
    assert all(c in web_chains or c.startswith("KBP-SEP-") for c in written), written
    assert len(deleted_chains(document)) == 1  # the endpoint chain of 10.244.2.5
    assert "--to-destination 10.244.2.7:8080" in document
    assert "10.244.2.3:8080" not in document  # dns's endpoints were left alone
    assert 0 < dp.last_writes[IPV4] < full_writes[IPV4]
    assert_kernel_holds(iptables_ns, second)

    # a Service that goes away takes its chains with it
    third = state(AFTER, with_dns=False)
    dp.apply(third)
    document = restores.take()[RESTORE[IPV4]]
    dns = next(e for e in second.services if e.name == "dns")
    assert service_chain("SVC", dns) in deleted_chains(document)
    assert_kernel_holds(iptables_ns, third)

    # nothing changed: nothing written
    dp.apply(third)
    assert restores.take() == {}
    assert dp.last_writes == {IPV4: 0, IPV6: 0}

    # a restarted agent's first apply is a full rewrite and converges to the same tables
    IptablesDataplane(POD_INTERFACES, netns=iptables_ns).apply(first)
    assert_kernel_holds(iptables_ns, first)


def test_a_restarted_agent_adopts_what_it_would_write_and_writes_nothing(
    iptables_ns, monkeypatch
):
    restores = RecordingRestores(monkeypatch)
    first = state(BEFORE)
    IptablesDataplane(POD_INTERFACES, netns=iptables_ns).apply(first)
    restores.take()

    restarted = IptablesDataplane(POD_INTERFACES, netns=iptables_ns)
    assert restarted.held_revision == first.revision  # read from the kernel's marker
    assert restarted.apply(first, full=True) == 0
    assert restores.take() == {}, "the kernel holds what this state renders"
    assert restarted.held_revision == first.revision
    assert_kernel_holds(iptables_ns, first)

    # the next change is a partial sync over the adopted rules
    second = state(AFTER)
    assert restarted.apply(second) > 0
    assert list(restores.take()) == [RESTORE[IPV4]]
    assert_kernel_holds(iptables_ns, second)

    # a restart onto a changed cluster rewrites, and a marker from other rules (here:
    # other pod CIDRs, which change every EXT chain) is not adopted either
    again = IptablesDataplane(POD_INTERFACES, netns=iptables_ns)
    assert again.held_revision == second.revision
    other = state(AFTER, pod_cidrs=("10.240.0.0/12",))
    assert other.revision == second.revision  # node settings are not in the revision
    assert again.apply(other) > 0
    assert set(restores.take()) == set(RESTORE.values())
    assert_kernel_holds(iptables_ns, other)


def test_without_its_jump_rules_a_restart_rewrites_even_when_the_marker_matches(iptables_ns):
    first = state(BEFORE)
    IptablesDataplane(POD_INTERFACES, netns=iptables_ns).apply(first)
    jump = ["-m", "comment", "--comment", "kube-bpf-proxy service portals", "-j", "KBP-SERVICES"]
    subprocess.run(["nsenter", f"--net=/run/netns/{iptables_ns}", IPTABLES[IPV4], "-t", "nat",
                    "-D", "PREROUTING", *jump], check=True)  # fmt: skip
    assert IptablesDataplane(POD_INTERFACES, netns=iptables_ns).apply(first) > 0
    assert "-A PREROUTING" in save(iptables_ns, IPV4)
    assert_kernel_holds(iptables_ns, first)


def changed_web(mutate: Callable[[Obj], None], proto: str = "TCP") -> NodeState:
    """The state with web's Service object changed by `mutate` (endpoints BEFORE)."""
    objects = service("web", "10.96.0.1", BEFORE, node_port=30080, proto=proto)
    mutate(objects[0])
    return state(BEFORE, web_objects=objects)


def load_balancer_with_source_ranges(obj: Obj) -> None:
    obj["spec"].update(type="LoadBalancer", loadBalancerSourceRanges=["198.51.100.0/24"])
    obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}


UNREADY_LOCAL = [make_endpoint("10.244.1.1", "node-a", ready=False), ep(5), ep(6)]
TRANSITIONS = [
    ("every endpoint of web goes away", state(BEFORE), state([])),
    ("web's endpoints come back", state([]), state(BEFORE)),
    ("web's only local endpoint becomes unready", state(BEFORE), state(UNREADY_LOCAL)),
    ("web switches to externalTrafficPolicy Local", state(BEFORE),
     changed_web(spec(externalTrafficPolicy="Local"))),
    ("web switches ClientIP affinity on", state(BEFORE),
     changed_web(spec(sessionAffinity="ClientIP"))),
    ("web becomes a LoadBalancer with source ranges", state(BEFORE),
     changed_web(load_balancer_with_source_ranges)),
    ("web's port changes from TCP to UDP", state(BEFORE), changed_web(spec(), proto="UDP")),
    ("the pod CIDRs change", state(BEFORE), state(BEFORE, pod_cidrs=("10.240.0.0/12",))),
]  # fmt: skip


@pytest.mark.parametrize(
    "before, after", [t[1:] for t in TRANSITIONS], ids=[t[0] for t in TRANSITIONS]
)
def test_after_a_partial_sync_the_kernel_holds_what_a_full_render_would(iptables_ns, before, after):
    assert before != after
    dp = IptablesDataplane(POD_INTERFACES, netns=iptables_ns)
    dp.apply(before)
    assert_kernel_holds(iptables_ns, before)
    dp.apply(after)
    assert_kernel_holds(iptables_ns, after)


def test_cleanup_removes_every_kbp_chain_and_jump(iptables_ns):
    dp = IptablesDataplane(POD_INTERFACES, netns=iptables_ns)
    dp.apply(state(BEFORE))
    assert all("KBP-" in save(iptables_ns, family) for family in FAMILIES)
    removed = cleanup(iptables_ns)
    assert any(
        r.startswith("IPv4 nat PREROUTING") and r.endswith("KBP-SERVICES") for r in removed
    ), removed
    assert "IPv6 nat KBP-SERVICES" in removed, removed
    for family in FAMILIES:
        assert "KBP-" not in save(iptables_ns, family), family
    assert cleanup(iptables_ns) == []  # nothing left: a second run is a no-op


FOREIGN = {
    IPV4: [
        ("nat", "-A PREROUTING -s 203.0.113.50/32 -p tcp -m tcp --dport 8443 "
                "-j DNAT --to-destination 10.9.9.9:443"),
        ("filter", "-A FORWARD -s 10.9.9.0/24 -j ACCEPT"),
    ],
    IPV6: [
        ("nat", "-A PREROUTING -s 2001:db8:50::/64 -p tcp -m tcp --dport 8443 "
                "-j DNAT --to-destination [fd00:9::9]:443"),
        ("filter", "-A FORWARD -s fd00:9::/64 -j ACCEPT"),
    ],
}  # fmt: skip


def _install_foreign(ns: str, family: str) -> None:
    for table, rule in FOREIGN[family]:
        proc = in_ns(ns, IPTABLES[family], "-w", "5", "-t", table, *rule.split())
        assert proc.returncode == 0, proc.stderr
    for argv in (["-N", "FOREIGN-CHAIN"], ["-A", "FOREIGN-CHAIN", "-p", "udp", "-j", "RETURN"],
                 ["-A", "OUTPUT", "-j", "FOREIGN-CHAIN"]):  # fmt: skip
        proc = in_ns(ns, IPTABLES[family], "-w", "5", "-t", "nat", *argv)
        assert proc.returncode == 0, proc.stderr


def _assert_foreign_intact(ns: str, stage: str) -> None:
    for family in FAMILIES:
        dump = save(ns, family)
        for _, rule in FOREIGN[family]:
            assert rule in dump, f"{family} after {stage}: lost {rule}"
        assert ":FOREIGN-CHAIN - [0:0]" in dump, f"{family} after {stage}"
        assert "-A FOREIGN-CHAIN -p udp -j RETURN" in dump, f"{family} after {stage}"
        assert "-A OUTPUT -j FOREIGN-CHAIN" in dump, f"{family} after {stage}"


def test_other_programs_rules_and_chains_survive_apply_partial_apply_and_cleanup(iptables_ns):
    for family in FAMILIES:
        _install_foreign(iptables_ns, family)
    dp = IptablesDataplane(POD_INTERFACES, netns=iptables_ns)
    dp.apply(state(BEFORE))
    _assert_foreign_intact(iptables_ns, "the first apply")
    dump = save(iptables_ns, IPV4)
    prerouting = [line for line in dump.splitlines() if line.startswith("-A PREROUTING")]
    assert "KBP-SERVICES" in prerouting[0], "our jump must come before others' rules"
    dp.apply(state(AFTER))
    _assert_foreign_intact(iptables_ns, "a partial apply")
    dp.apply(state(AFTER), full=True)
    _assert_foreign_intact(iptables_ns, "a resync")
    dp.cleanup()
    _assert_foreign_intact(iptables_ns, "cleanup")
    for family in FAMILIES:
        assert "KBP-" not in save(iptables_ns, family)


def every_feature() -> NodeState:
    """Dual-stack Services using every rule shape the renderer has: affinity, SCTP, UDP,
    Local policies, source ranges of both families, no endpoints, no local endpoints."""

    def dual(obj: Obj, cluster_ip6: str) -> None:
        obj["spec"]["clusterIPs"].append(cluster_ip6)

    def lb(obj: Obj) -> None:
        obj["spec"].update(
            type="LoadBalancer",
            externalTrafficPolicy="Local",
            externalIPs=["203.0.113.7", "2001:db8:7::7"],
            loadBalancerSourceRanges=["198.51.100.0/24", "2001:db8:100::/64"],
            sessionAffinity="ClientIP",
        )
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"},
                                                      {"ip": "2001:db8:9::9"}]}}  # fmt: skip

    ep6 = [make_endpoint("fd00:244:1::5", "node-a"), make_endpoint("fd00:244:2::5", "node-b")]
    shop = service("shop", "10.96.0.5", [ep(5, "node-a"), ep(5)], node_port=30443,
                   ip6="fd00:96::5", endpoints6=ep6)  # fmt: skip
    lb(shop[0])
    sctp = service("sctp", "10.96.0.6", [ep(6)], proto="SCTP", ip6="fd00:96::6",
                   endpoints6=[make_endpoint("fd00:244:2::6", "node-b")])  # fmt: skip
    empty = service("empty", "10.96.0.7", [], proto="UDP", node_port=30007, ip6="fd00:96::7",
                    endpoints6=[])  # fmt: skip
    remote = service("remote", "10.96.0.8", [ep(8)], node_port=30008, ip6="fd00:96::8",
                     endpoints6=[make_endpoint("fd00:244:2::8", "node-b")])  # fmt: skip
    remote[0]["spec"].update(externalTrafficPolicy="Local", internalTrafficPolicy="Local")
    objects = [*shop, *sctp, *empty, *remote]
    return compile(state_of(*default_nodes(), *objects), "node-a")  # no pod CIDR: -i veth+


def test_every_rule_shape_is_accepted_by_the_real_restore_in_both_families(iptables_ns):
    node_state = every_feature()
    rendered = {f: render(node_state.services, RenderOptions(f, (), ("veth+",))) for f in FAMILIES}
    assert "-i veth+" in rendered[IPV6] and "--rcheck" in rendered[IPV6]
    assert "-p sctp" in rendered[IPV6] and "REJECT" in rendered[IPV6]
    assert "2001:db8:100::/64" in rendered[IPV6] and "DROP" in rendered[IPV6]
    for family in FAMILIES:
        proc = in_ns(iptables_ns, RESTORE[family], "-w", "5", "--noflush",
                     stdin=rendered[family])  # fmt: skip
        assert proc.returncode == 0, f"{family}: {proc.stderr}"
    dp = IptablesDataplane(("veth*",), netns=iptables_ns)
    dp.apply(node_state)
    assert_kernel_holds(iptables_ns, node_state)


def test_a_periodic_resync_after_our_rules_were_removed_rewrites_them_at_once(iptables_ns):
    dp = IptablesDataplane(POD_INTERFACES, netns=iptables_ns)
    dp.apply(state(BEFORE))
    expected = {family: save(iptables_ns, family) for family in FAMILIES}
    cleanup(iptables_ns)  # as if someone flushed our rules behind the agent's back
    assert dp.apply(state(BEFORE), full=True) > 0  # no failed attempt first
    for family in FAMILIES:
        kernel, wanted = Ruleset(), Ruleset()
        kernel.restore(save(iptables_ns, family))
        wanted.restore(expected[family])
        for table in ("nat", "filter"):
            held, expected_chains = kernel.chains(table), wanted.chains(table)
            assert held.pop(STATE, None) is not None or table == "nat"  # rewritten with
            expected_chains.pop(STATE, None)  # the rules, its time differs
            assert held == expected_chains, (family, table)
    assert dp.apply(state(BEFORE), full=True) == 0  # rules in place: nothing to write


def test_a_restart_that_cannot_adopt_renders_each_entry_once(iptables_ns, monkeypatch):
    """The adoption check renders every entry to compare digests; the rewrite that follows
    a mismatch reuses those rules instead of rendering them again."""
    IptablesDataplane(POD_INTERFACES, netns=iptables_ns).apply(state(BEFORE))
    rendered: list[str] = []
    real = iptables_dataplane.entry_rules

    def counting(entry, options):
        rendered.append(entry.name)
        return real(entry, options)

    monkeypatch.setattr(iptables_dataplane, "entry_rules", counting)
    restarted = IptablesDataplane(POD_INTERFACES, netns=iptables_ns)
    assert restarted.held_revision is not None  # a marker to compare with
    changed = state(AFTER)
    assert restarted.apply(changed) > 0  # the marker's digest differs: a full rewrite
    assert sorted(rendered) == sorted(e.name for e in changed.services)
    assert_kernel_holds(iptables_ns, changed)
