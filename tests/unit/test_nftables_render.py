"""The nftables renderer and the dataplane's partial sync, without a kernel: NodeStates
compiled from Kubernetes objects are rendered and the elements, chains and commands
checked against docs/nodestate.md's "which set a packet uses"; the dataplane runs with a
fake command runner that records what it would send to nft. (tests/kernel/test_nftables.py
and the scenario suites run the same against the real nft.)

Address plan (tests/builders.py): node-a 192.0.2.10; pods of node-a 10.244.1.<n>, node-b
10.244.2.<n>, on 8080; pod CIDR 10.244.0.0/16. Service "svc": ClusterIP 10.96.0.1:80,
NodePort 30080, ExternalIP 203.0.113.7, LoadBalancer VIP 203.0.113.9.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence

import pytest

from agent.dataplane.base import DataplaneError
from agent.dataplane.nftables.dataplane import NftablesDataplane
from agent.dataplane.nftables.render import (
    ALLOWED,
    DROP,
    EXT_LOCAL,
    HASH_SEED,
    IPV4,
    IPV6,
    MASQ_ALL,
    MASQ_NODE,
    MASQ_NON_POD,
    NO_ENDPOINTS,
    RANGED,
    RenderOptions,
    entry_nft,
    full_table,
    grouped,
    marker_commands,
    parse_marker,
    pick_commands,
    remember_commands,
    slots_map,
)
from agent.model.compile import CompileOptions, compile
from agent.model.nodestate import NodeState, ServiceEntry

from ..builders import Obj, default_nodes, ep, make_service, make_slice, spec, state_of

V4 = RenderOptions(IPV4, ("10.244.0.0/16",), ("veth*",))
V6 = RenderOptions(IPV6, ("fd00:244::/32",), ("veth*",))
Mutator = Callable[[Obj], None]


def compiled(*objects: Obj) -> NodeState:
    options = CompileOptions(cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"))
    return compile(state_of(*default_nodes(), *objects), "node-a", options)


def svc(endpoints: list[Obj], *mutators: Mutator, name: str = "svc", ip: str = "10.96.0.1"
        ) -> list[Obj]:  # fmt: skip
    def mutate(obj: Obj) -> None:
        obj["spec"].update(clusterIP=ip, clusterIPs=[ip])
        for m in mutators:
            m(obj)

    return [make_service(name=name, mutate=mutate),
            make_slice(name=f"{name}-1", service=name, endpoints=endpoints)]  # fmt: skip


def load_balancer(etp: str = "Cluster", ranges: tuple[str, ...] = ()) -> Mutator:
    def mutate(obj: Obj) -> None:
        obj["spec"].update(type="LoadBalancer", externalTrafficPolicy=etp,
                           externalIPs=["203.0.113.7"])  # fmt: skip
        obj["spec"]["ports"][0]["nodePort"] = 30080
        if ranges:
            obj["spec"]["loadBalancerSourceRanges"] = list(ranges)
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}

    return mutate


def entry(state: NodeState, name: str = "svc", family: str = IPV4) -> ServiceEntry:
    return next(e for e in state.services if e.name == name and e.ip_family == family)


def nat_of(made) -> dict[str, dict[str, list[str]]]:  # type: ignore[no-untyped-def]
    """frontend key → set or map → its elements."""
    return {key: grouped(elements) for key, elements in made.nat}


def test_a_service_without_endpoints_is_rejected_at_every_frontend() -> None:
    made = entry_nft(entry(compiled(*svc([], load_balancer()))), V4)
    assert made.nat == ()
    assert dict(made.filter) == {
        key: ((NO_ENDPOINTS, key),)
        for key in ("10.96.0.1 . tcp . 80", "192.0.2.10 . tcp . 30080",
                    "203.0.113.7 . tcp . 80", "203.0.113.9 . tcp . 80")
    }  # fmt: skip


def test_internal_policy_local_without_local_endpoints_drops() -> None:
    made = entry_nft(entry(compiled(*svc([ep(5)], spec(internalTrafficPolicy="Local")))), V4)
    assert made.nat == ()
    assert dict(made.filter) == {"10.96.0.1 . tcp . 80": ((DROP, "10.96.0.1 . tcp . 80"),)}


def test_external_policy_local_sends_outsiders_to_local_endpoints_and_the_rest_to_all() -> None:
    ranges = ("198.51.100.0/24", "198.51.100.128/25")
    state = compiled(*svc([ep(3, "node-a"), ep(5)], load_balancer("Local", ranges)))
    made = entry_nft(entry(state), V4)
    nat = nat_of(made)
    cluster_ip, node_port, lb = ("10.96.0.1 . tcp . 80", "192.0.2.10 . tcp . 30080",
                                 "203.0.113.9 . tcp . 80")  # fmt: skip
    assert nat[cluster_ip] == {  # everyone: clusterBackends; whoever is not a pod masqueraded
        "pick-h-2": [cluster_ip],
        "pick-h-2-tcp": [
            f"{cluster_ip} . 0 : 10.244.1.3 . 8080",
            f"{cluster_ip} . 1 : 10.244.2.5 . 8080",
        ],
        MASQ_NON_POD: [cluster_ip],
    }
    assert nat[node_port] == {
        EXT_LOCAL: [node_port],  # outsiders never fall back to clusterBackends
        MASQ_NODE: [node_port],  # the node is masqueraded, pods are not
        "pick-h-2": [node_port],  # pods and the node: clusterBackends
        "pick-h-2-tcp": [
            f"{node_port} . 0 : 10.244.1.3 . 8080",
            f"{node_port} . 1 : 10.244.2.5 . 8080",
        ],
        "pick-outside-h-1": [node_port],  # outsiders keep their address, local endpoints only
        "pick-outside-h-1-tcp": [f"{node_port} . 0 : 10.244.1.3 . 8080"],
    }
    assert nat[lb][RANGED] == [lb]
    assert nat[lb][ALLOWED] == [f"{lb} . 198.51.100.0/24"]  # overlapping ranges: one prefix
    assert dict(made.filter) == {lb: ((DROP, lb),)}  # what the source ranges leave
    assert made.endpoints == ("10.244.1.3", "10.244.2.5")


def test_external_policy_cluster_masquerades_and_uses_every_endpoint() -> None:
    made = entry_nft(entry(compiled(*svc([ep(5), ep(6)], load_balancer()))), V4)
    node_port = nat_of(made)["192.0.2.10 . tcp . 30080"]
    assert set(node_port) == {MASQ_ALL, "pick-h-2", slots_map("pick-h-2", "tcp")}


def test_the_split_is_a_flow_hash_by_default_and_numgen_for_random() -> None:
    hashed = nat_of(entry_nft(entry(compiled(*svc([ep(5), ep(6), ep(7)]))), V4))
    key = "10.96.0.1 . tcp . 80"
    assert hashed[key]["pick-h-3"] == [key]
    assert hashed[key]["pick-h-3-tcp"] == [
        f"{key} . {i} : 10.244.2.{5 + i} . 8080" for i in range(3)
    ]
    *maps, made_set, _, rule, udp, sctp = pick_commands(IPV4, "pick-h-3")  # a rule per protocol
    assert [m.split()[4] for m in maps] == ["pick-h-3-tcp", "pick-h-3-udp", "pick-h-3-sctp"]
    assert [r.split(" map @")[1] for r in (udp, sctp)] == ["pick-h-3-udp", "pick-h-3-sctp"]
    assert made_set.startswith("add set ip kube-bpf-proxy pick-h-3 {")
    assert rule == ("add rule ip kube-bpf-proxy pick-h-3 meta l4proto tcp dnat ip to ip daddr . "
                    "meta l4proto . tcp dport . jhash ip saddr . th sport . ip daddr . th dport "
                    f"mod 3 seed {HASH_SEED} map @pick-h-3-tcp")  # fmt: skip

    def random(obj: Obj) -> None:
        obj["metadata"]["annotations"] = {"kube-bpf-proxy.io/lb-algorithm": "random"}

    picked = nat_of(entry_nft(entry(compiled(*svc([ep(5), ep(6)], random))), V4))
    assert picked[key]["pick-r-2"] == [key]
    assert pick_commands(IPV6, "pick-outside-r-2")[6] == (
        "add rule ip6 kube-bpf-proxy pick-outside-r-2 meta l4proto udp dnat ip6 to ip6 daddr . "
        "meta l4proto . udp dport . numgen random mod 2 map @pick-outside-r-2-udp")  # fmt: skip


def test_affinity_is_the_frontends_membership_in_its_timeouts_set() -> None:
    affinity = spec(sessionAffinity="ClientIP",
                    sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}})  # fmt: skip
    made = entry_nft(entry(compiled(*svc([ep(5), ep(6)], affinity))), V4)
    key = "10.96.0.1 . tcp . 80"
    assert nat_of(made)[key]["affinity-60"] == [key]
    assert nat_of(made)[key]["pick-h-2"] == [key]  # a client not remembered: as any other
    rules = remember_commands(IPV4, ["affinity-60", "pick-h-2"], new=True)
    assert rules[0] == (
        "add rule ip kube-bpf-proxy affinity-remember meta l4proto tcp ct status dnat ct original "
        "ip daddr . meta l4proto . ct original proto-dst @affinity-60 update @affinity-clients "
        "{ ip saddr . ct original ip daddr . meta l4proto . ct original proto-dst timeout 60s : "
        "ip daddr . tcp dport }")  # fmt: skip
    assert len(rules) == 3  # a rule per protocol


def test_ipv6_slots() -> None:
    def dual(obj: Obj) -> None:
        obj["spec"].update(
            clusterIPs=["10.96.0.1", "fd00:96::1"], ipFamilyPolicy="RequireDualStack"
        )

    objects = [*svc([ep(5)], dual),
               make_slice(name="svc-6", service="svc", family="IPv6",
                          endpoints=[{"addresses": ["fd00:244:2::5"], "nodeName": "node-b",
                                      "conditions": {"ready": True}}])]  # fmt: skip
    made = entry_nft(entry(compiled(*objects), family=IPV6), V6)
    assert nat_of(made)["fd00:96::1 . tcp . 80"]["pick-h-1-tcp"] == [
        "fd00:96::1 . tcp . 80 . 0 : fd00:244:2::5 . 8080"]  # fmt: skip


def test_the_first_entry_claiming_a_frontend_holds_it() -> None:
    shared = spec(externalIPs=["203.0.113.50"])
    state = compiled(*svc([ep(5)], shared, name="a", ip="10.96.0.1"),
                     *svc([ep(6)], shared, name="b", ip="10.96.0.2"))  # fmt: skip
    text = "\n".join(full_table(V4, [entry_nft(e, V4) for e in state.services]))
    [line] = [
        x for x in text.splitlines() if x.startswith("add element ip kube-bpf-proxy pick-h-1-tcp")
    ]
    assert "203.0.113.50 . tcp . 80 . 0 : 10.244.2.5 . 8080" in line
    assert "203.0.113.50 . tcp . 80 . 0 : 10.244.2.6" not in line


def test_the_table_has_a_pick_chain_per_count_in_use_and_no_verdict_per_frontend() -> None:
    state = compiled(*svc([ep(5)], name="a", ip="10.96.0.1"),
                     *svc([ep(6), ep(7)], name="b", ip="10.96.0.2"),
                     *svc([ep(8), ep(9)], name="c", ip="10.96.0.3"))  # fmt: skip
    text = full_table(V4, [entry_nft(e, V4) for e in state.services])
    assert [c.split()[4] for c in text if c.startswith("add chain") and "pick-h" in c] == [
        "pick-h-1", "pick-h-2"]  # fmt: skip
    assert not [c for c in text if "goto" in c and c.startswith("add element")]
    assert not [c for c in text if c.startswith("add chain") and "svc-" in c]


def test_the_marker_says_revision_digest_and_time() -> None:
    flush, add = marker_commands(IPV4, "sha256:" + "a" * 64, "b" * 32, 1234)
    assert flush == "flush set ip kube-bpf-proxy state"
    comments = dict(part.split(" comment ") for part in
                    add.split("{ ", 1)[1].rstrip(" }").split(", "))  # fmt: skip
    parsed = parse_marker({k.strip('"'): v.strip('"') for k, v in comments.items()})
    assert parsed == ("sha256:" + "a" * 64, "b" * 32, 1234)
    assert parse_marker({"revision": "something else"}) is None


# --- the dataplane with a fake nft ------------------------------------------------------


class FakeNft:
    """Records `nft -f` inputs; the kernel holds no table of ours (no marker), and a
    transaction fails while `fail` is set."""

    def __init__(self) -> None:
        self.inputs: list[str] = []
        self.fail: str | None = None

    def __call__(self, netns: str | None, argv: Sequence[str], stdin: str | None = None
                 ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        if list(argv[:2]) == ["nft", "-j"]:
            return subprocess.CompletedProcess(list(argv), 1, "", "Error: No such file")
        if stdin is not None:
            self.inputs.append(stdin)
            if self.fail is not None:
                return subprocess.CompletedProcess(list(argv), 1, "", self.fail)
        return subprocess.CompletedProcess(list(argv), 0, "", "")

    def take(self) -> list[str]:
        out, self.inputs = self.inputs, []
        return out


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if " state" not in line]


def test_a_partial_sync_writes_only_what_changed() -> None:
    nft = FakeNft()
    dataplane = NftablesDataplane(("veth*",), run=nft)
    assert dataplane.held_revision is None
    before = compiled(*svc([ep(5), ep(6)]), *svc([ep(7)], name="other", ip="10.96.0.2"))
    dataplane.apply(before)
    [first] = nft.take()
    assert "delete table ip kube-bpf-proxy" in first and "delete table ip6 kube-bpf-proxy" in first
    assert dataplane.apply(before) == 0 and nft.take() == []

    after = compiled(*svc([ep(5), ep(8)]), *svc([ep(7)], name="other", ip="10.96.0.2"))
    dataplane.apply(after)
    [second] = nft.take()
    assert lines_of(second) == [  # elements only: the endpoint's slot and its hairpin pair
        "delete element ip kube-bpf-proxy pick-h-2-tcp { 10.96.0.1 . tcp . 80 . 1 }",
        "delete element ip kube-bpf-proxy hairpin { 10.244.2.6 . 10.244.2.6 }",
        "add element ip kube-bpf-proxy pick-h-2-tcp { 10.96.0.1 . tcp . 80 . 1 : "
        "10.244.2.8 . 8080 }",
        "add element ip kube-bpf-proxy hairpin { 10.244.2.8 . 10.244.2.8 }",
    ]
    assert "ip6" not in second  # the other family did not change: its marker stays

    gone = compiled(*svc([ep(5), ep(8)]))
    dataplane.apply(gone)
    [third] = nft.take()
    assert lines_of(third)[:2] == [
        "delete element ip kube-bpf-proxy masq-non-pod { 10.96.0.2 . tcp . 80 }",
        "delete element ip kube-bpf-proxy hairpin { 10.244.2.7 . 10.244.2.7 }",
    ]
    # the last frontend with one endpoint went: its pick chain goes with its set and slot
    # maps (their elements with them), and the dispatch chains are written again without it
    assert lines_of(third)[-6:] == ["flush chain ip kube-bpf-proxy pick-h-1",
                                    "delete chain ip kube-bpf-proxy pick-h-1",
                                    "delete set ip kube-bpf-proxy pick-h-1",
                                    "delete map ip kube-bpf-proxy pick-h-1-sctp",
                                    "delete map ip kube-bpf-proxy pick-h-1-tcp",
                                    "delete map ip kube-bpf-proxy pick-h-1-udp"]  # fmt: skip
    dispatch = "add rule ip kube-bpf-proxy pick-inside ip daddr . meta l4proto . th dport"
    assert f"{dispatch} @pick-h-2 goto pick-h-2" in third
    assert "@pick-h-1" not in third

    # a new count: its pick chain is made in the same transaction as its first frontend
    dataplane.apply(compiled(*svc([ep(5), ep(8), ep(9)])))
    [fourth] = nft.take()
    assert "add chain ip kube-bpf-proxy pick-h-3" in lines_of(fourth)
    assert "add element ip kube-bpf-proxy pick-h-3 { 10.96.0.1 . tcp . 80 }" in fourth
    assert "delete set ip kube-bpf-proxy pick-h-2" in fourth


def test_the_next_claimant_takes_a_frontend_its_holder_gives_up() -> None:
    nft = FakeNft()
    dataplane = NftablesDataplane(("veth*",), run=nft)
    shared = spec(externalIPs=["203.0.113.50"])
    both = compiled(*svc([ep(5)], shared, name="a", ip="10.96.0.1"),
                    *svc([ep(6), ep(7)], shared, name="b", ip="10.96.0.2"))  # fmt: skip
    dataplane.apply(both)
    nft.take()
    only_b = compiled(*svc([ep(6), ep(7)], shared, name="b", ip="10.96.0.2"))
    dataplane.apply(only_b)
    [written] = nft.take()
    assert "delete map ip kube-bpf-proxy pick-h-1-tcp" in written  # a's slots went with it
    assert "add element ip kube-bpf-proxy pick-h-2 { 203.0.113.50 . tcp . 80 }" in written
    key = "203.0.113.50 . tcp . 80"
    assert (f"add element ip kube-bpf-proxy pick-h-2-tcp {{ {key} . 0 : 10.244.2.6 . 8080, "
            f"{key} . 1 : 10.244.2.7 . 8080 }}") in written  # fmt: skip


def test_a_failed_transaction_raises_and_the_next_apply_rewrites_all() -> None:
    nft = FakeNft()
    dataplane = NftablesDataplane(("veth*",), run=nft)
    state = compiled(*svc([ep(5)]))
    dataplane.apply(state)
    nft.take()
    nft.fail = "/dev/stdin:3:1-10: Error: Could not process rule: No such file or directory"
    changed = compiled(*svc([ep(6)]))
    with pytest.raises(DataplaneError) as raised:
        dataplane.apply(changed)
    assert "Could not process rule" in str(raised.value) and "(line 3: " in str(raised.value)
    assert dataplane.held_revision == state.revision
    nft.fail = None
    nft.take()
    dataplane.apply(changed)
    [written] = nft.take()
    assert "delete table ip kube-bpf-proxy" in written
    assert dataplane.held_revision == changed.revision


NO_NF_TABLES = "Error: Could not process rule: Operation not supported"


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        ({"ip": (0, ""), "ip6": (0, "")}, ["table ip kube-bpf-proxy", "table ip6 kube-bpf-proxy"]),
        ({"ip": (1, "Error: No such file or directory"), "ip6": (0, "")},
         ["table ip6 kube-bpf-proxy"]),
        ({"ip": (1, NO_NF_TABLES), "ip6": (1, NO_NF_TABLES)}, []),
    ],
    ids=["both there", "one there", "no nf_tables in the kernel"],
)  # fmt: skip
def test_cleanup_deletes_each_table_by_name(
    monkeypatch: pytest.MonkeyPatch, answers: dict, expected: list[str]
) -> None:
    from agent.dataplane.nftables import dataplane as module

    monkeypatch.setattr(module.shutil, "which", lambda name: f"/usr/sbin/{name}")
    calls: list[list[str]] = []

    def run(netns, argv, stdin=None):  # type: ignore[no-untyped-def]
        calls.append(list(argv))
        code, err = answers[argv[3]]
        return subprocess.CompletedProcess(list(argv), code, "", err)

    assert module.cleanup(None, run) == expected
    assert calls == [["nft", "delete", "table", "ip", "kube-bpf-proxy"],
                     ["nft", "delete", "table", "ip6", "kube-bpf-proxy"]]  # fmt: skip


def test_cleanup_names_any_other_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.dataplane.nftables import dataplane as module

    monkeypatch.setattr(module.shutil, "which", lambda name: f"/usr/sbin/{name}")

    def run(netns, argv, stdin=None):  # type: ignore[no-untyped-def]
        return subprocess.CompletedProcess(list(argv), 1, "", "Error: Operation not permitted")

    with pytest.raises(DataplaneError, match="ip kube-bpf-proxy: Error: Operation not permitted"):
        module.cleanup(None, run)
