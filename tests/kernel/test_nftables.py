"""The nftables dataplane against the real `nft`, each test in throw-away network
namespaces: partial syncs write only the changed entries' elements (and a pick chain when
an endpoint count comes or goes) and leave the table a fresh full write would; a restarted
agent adopts the table writing nothing; a full sync puts back a table someone deleted; a
refused transaction changes nothing; cleanup removes our tables and nobody else's. (Where
packets go is the scenario suites' part: tests/kernel/test_dataplane.py and
test_external.py run on nftables.)

Address plan (tests/builders.py): node-a 192.0.2.10 / 2001:db8::10, pods 10.244.<node>.<n>
and fd00:244:<node>::<n>, pod CIDRs 10.244.0.0/16 and fd00:244::/32. Services sNN get
ClusterIPs 10.96.1.NN (and fd00:96:1::NN when dual-stack) in "default".
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.dataplane.base import DataplaneError
from agent.dataplane.iptables.backend import run_command
from agent.dataplane.nftables.dataplane import NftablesDataplane, cleanup, kernel_marker
from agent.dataplane.nftables.libnft import LibNftRunner
from agent.dataplane.nftables.render import FAMILIES, STATE, TABLE
from agent.model.compile import CompileOptions, Compiler, compile
from agent.model.decode import decode_object
from agent.model.nodestate import NodeState

from ..builders import Obj, default_nodes, make_endpoint, make_service, make_slice, state_of
from ..conftest import require_nftables

pytestmark = pytest.mark.kernel

POD_INTERFACES = ("veth*",)
POD_CIDRS = ("10.244.0.0/16", "fd00:244::/32")


@pytest.fixture
def nft_ns(netns: Callable[[], str]) -> Iterator[str]:
    name = netns()
    require_nftables(name)
    try:
        yield name
    finally:
        cleanup(name)


class Recorder:
    """The dataplane's command runner, keeping every `nft -f` input it sends."""

    def __init__(self) -> None:
        self.inputs: list[str] = []

    def __call__(self, netns, argv, stdin=None):  # type: ignore[no-untyped-def]
        if list(argv[:3]) == ["nft", "-f", "-"] and stdin is not None:
            self.inputs.append(stdin)
        return run_command(netns, argv, stdin)

    def take(self) -> list[str]:
        out, self.inputs = self.inputs, []
        return out


def table_content(ns: str) -> dict[str, object]:
    """Both families' tables as comparable data: chains with their rules, sets and maps
    with their elements (sorted), without handles and without the marker."""
    out: dict[str, object] = {}
    for family in ("ip", "ip6"):
        proc = run_command(ns, ["nft", "-j", "list", "table", family, TABLE], None)
        assert proc.returncode == 0, proc.stderr
        chains: dict[str, list[str]] = {}
        for item in json.loads(proc.stdout)["nftables"]:
            kind, body = next(iter(item.items()))
            if kind == "chain":
                chains.setdefault(body["name"], [])
                out[f"{family} chain {body['name']}"] = {
                    k: v for k, v in body.items() if k not in ("handle",)
                }
            elif kind == "rule":
                chains.setdefault(body["chain"], []).append(json.dumps(body["expr"]))
            elif kind in ("set", "map") and body["name"] != STATE:
                elements = sorted(json.dumps(e, sort_keys=True) for e in body.pop("elem", []))
                body.pop("handle", None)
                out[f"{family} {kind} {body['name']}"] = (body, elements)
        for name, rules in chains.items():
            out[f"{family} rules {name}"] = rules
    return out


def service(n: int, endpoints: list[str], *, dual: bool = False, mutate=None) -> list[Obj]:  # type: ignore[no-untyped-def]
    name = f"s{n:02d}"
    ip, ip6 = f"10.96.1.{n}", f"fd00:96:1::{n:x}"

    def spec(obj: Obj) -> None:
        obj["spec"]["clusterIP"] = ip
        obj["spec"]["clusterIPs"] = [ip, ip6] if dual else [ip]
        if dual:
            obj["spec"]["ipFamilies"] = ["IPv4", "IPv6"]
            obj["spec"]["ipFamilyPolicy"] = "RequireDualStack"
        if mutate is not None:
            mutate(obj)

    v4 = [make_endpoint(e, "node-a" if e.startswith("10.244.1.") else "node-b")
          for e in endpoints]  # fmt: skip
    objects = [make_service(name=name, mutate=spec),
               make_slice(name=f"{name}-v4", service=name, endpoints=v4)]  # fmt: skip
    if dual:
        v6 = [make_endpoint("fd00:244:" + e.split(".")[2] + "::" + e.split(".")[3],
                            "node-b") for e in endpoints]  # fmt: skip
        objects.append(make_slice(name=f"{name}-v6", service=name, endpoints=v6,
                                  family="IPv6"))  # fmt: skip
    return objects


def compiled(*objects: Obj) -> NodeState:
    options = CompileOptions(cluster_cidrs=POD_CIDRS)
    return compile(state_of(*default_nodes(), *objects), "node-a", options)


def fresh_content(netns: Callable[[], str], state: NodeState) -> dict[str, object]:
    """What a new agent writes for `state` in a namespace of its own."""
    other = netns()
    try:
        NftablesDataplane(POD_INTERFACES, netns=other).apply(state)
        return table_content(other)
    finally:
        cleanup(other)


def random_objects(rng: random.Random, count: int) -> dict[int, list[Obj]]:
    """Services with random endpoint sets, some with affinity, NodePorts, an ExternalIP
    two of them share (the first in document order holds it), dual-stack."""
    out = {}
    for n in rng.sample(range(1, 40), count):
        pods = [f"10.244.{rng.choice((1, 2))}.{rng.randrange(2, 60)}"
                for _ in range(rng.randrange(0, 5))]  # fmt: skip
        kind = rng.choice(("plain", "affinity", "nodeport", "shared", "dual"))

        def mutate(obj: Obj, kind: str = kind, n: int = n) -> None:
            if kind == "affinity":
                obj["spec"]["sessionAffinity"] = "ClientIP"
                obj["spec"]["sessionAffinityConfig"] = {
                    "clientIP": {"timeoutSeconds": rng.choice((30, 60))}
                }
            elif kind == "nodeport":
                obj["spec"]["type"] = "NodePort"
                obj["spec"]["ports"][0]["nodePort"] = 30000 + n
                obj["spec"]["externalTrafficPolicy"] = rng.choice(("Cluster", "Local"))
            elif kind == "shared":
                obj["spec"]["externalIPs"] = ["203.0.113.50"]

        out[n] = service(n, sorted(set(pods)), dual=kind == "dual", mutate=mutate)
    return out


class Cluster:
    """The Services of a test, compiled like the agent compiles them: `incremental`, by
    the Compiler from a ClusterState changed object by object (each NodeState says which
    Services changed, and the dataplane looks only at those); else in full each time."""

    def __init__(self, services: dict[int, list[Obj]], incremental: bool) -> None:
        self.services = dict(services)
        self.incremental = incremental
        self.compiler = Compiler("node-a", CompileOptions(cluster_cidrs=POD_CIDRS))
        self.cluster = state_of(*default_nodes(), *self.objects())

    def objects(self) -> list[Obj]:
        return [o for objs in self.services.values() for o in objs]

    def state(self) -> NodeState:
        if self.incremental:
            return self.compiler.update(self.cluster)
        return compiled(*self.objects())

    def put(self, n: int, objects: list[Obj]) -> None:
        old = {o["metadata"]["name"] for o in self.services.get(n, ())}
        self.services[n] = objects
        for obj in objects:
            value = decode_object(obj).value
            if obj["kind"] == "Service":
                self.cluster.set_service(value)  # type: ignore[arg-type]
            else:
                self.cluster.set_slice(value)  # type: ignore[arg-type]
        for name in old - {o["metadata"]["name"] for o in objects}:
            self.cluster.delete_slice("default", name)

    def remove(self, n: int) -> None:
        for obj in self.services.pop(n):
            if obj["kind"] == "Service":
                self.cluster.delete_service("default", obj["metadata"]["name"])
            else:
                self.cluster.delete_slice("default", obj["metadata"]["name"])


@pytest.mark.parametrize("incremental", [False, True], ids=["compiled", "incremental"])
def test_partial_syncs_leave_the_table_a_fresh_write_would(
    nft_ns: str, netns: Callable[[], str], incremental: bool
) -> None:
    rng = random.Random(36)
    recorder = Recorder()
    dataplane = NftablesDataplane(POD_INTERFACES, netns=nft_ns, run=recorder)
    cluster = Cluster(random_objects(rng, 20), incremental)
    state = cluster.state()
    dataplane.apply(state)
    assert "delete table ip kube-bpf-proxy" in recorder.take()[0]  # the first write is whole
    for step in range(12):
        # change, add or remove a few Services
        for _ in range(rng.randrange(1, 4)):
            if rng.random() < 0.25 and cluster.services:
                cluster.remove(rng.choice(sorted(cluster.services)))
            else:
                cluster.put(*next(iter(random_objects(rng, 1).items())))
        state = cluster.state()
        assert (state.changes is not None) == incremental
        dataplane.apply(state)
        [written] = recorder.take() or [""]
        assert "delete table" not in written, f"step {step}: a partial sync rewrote the table"
        assert table_content(nft_ns) == fresh_content(netns, state), f"step {step}"
        found = [kernel_marker(family, nft_ns) for family in FAMILIES]
        assert all(found), found
        assert max(found, key=lambda m: m[2])[0] == state.revision  # type: ignore[index]


def test_one_changed_service_writes_only_its_elements(nft_ns: str) -> None:
    objects = {n: service(n, [f"10.244.2.{n}", f"10.244.2.{n + 100}"]) for n in range(1, 30)}
    recorder = Recorder()
    dataplane = NftablesDataplane(POD_INTERFACES, netns=nft_ns, run=recorder)
    dataplane.apply(compiled(*(o for objs in objects.values() for o in objs)))
    recorder.take()
    objects[7] = service(7, ["10.244.2.7", "10.244.2.207"])  # 10.244.2.107 left, .207 came
    state = compiled(*(o for objs in objects.values() for o in objs))
    writes = dataplane.apply(state)
    [written] = recorder.take()
    lines = [line for line in written.splitlines() if line.split()[4] != STATE]
    assert lines == [
        "delete element ip kube-bpf-proxy pick-h-2-tcp { 10.96.1.7 . tcp . 80 . 1 }",
        "delete element ip kube-bpf-proxy hairpin { 10.244.2.107 . 10.244.2.107 }",
        "add element ip kube-bpf-proxy pick-h-2-tcp { 10.96.1.7 . tcp . 80 . 1 : "
        "10.244.2.207 . 8080 }",
        "add element ip kube-bpf-proxy hairpin { 10.244.2.207 . 10.244.2.207 }",
    ], written
    assert writes == 4 + 1  # four element writes, and the marker
    assert dataplane.apply(state) == 0 and recorder.take() == []


def test_a_restarted_agent_adopts_the_table_and_writes_nothing(nft_ns: str) -> None:
    objects = [o for n in range(1, 10) for o in service(n, [f"10.244.2.{n}"], dual=n % 2 == 0)]
    state = compiled(*objects)
    NftablesDataplane(POD_INTERFACES, netns=nft_ns).apply(state)
    recorder = Recorder()
    restarted = NftablesDataplane(POD_INTERFACES, netns=nft_ns, run=recorder)
    assert restarted.held_revision == state.revision
    assert restarted.apply(state) == 0
    assert recorder.take() == []
    # ... and then syncs partially from what it adopted
    changed = compiled(*objects, *service(20, ["10.244.2.20"]))
    assert 0 < restarted.apply(changed) < 20
    [written] = recorder.take()
    assert "delete table" not in written

    # A different state at restart: the table is written again, whole.
    again = NftablesDataplane(POD_INTERFACES, netns=nft_ns, run=recorder)
    assert again.held_revision == changed.revision
    again.apply(state)
    [written] = recorder.take()
    assert "delete table ip kube-bpf-proxy" in written


def test_a_full_sync_puts_back_a_table_someone_deleted(nft_ns: str) -> None:
    state = compiled(*service(1, ["10.244.2.1"]))
    dataplane = NftablesDataplane(POD_INTERFACES, netns=nft_ns)
    dataplane.apply(state)
    before = table_content(nft_ns)
    assert dataplane.apply(state, full=True) == 0  # intact: nothing written
    proc = run_command(nft_ns, ["nft", "delete", "table", "ip", TABLE], None)
    assert proc.returncode == 0, proc.stderr
    assert dataplane.apply(state) == 0  # a partial sync trusts what it wrote
    assert dataplane.apply(state, full=True) > 0
    assert table_content(nft_ns) == before


def test_a_refused_transaction_changes_nothing_and_the_next_apply_rewrites(nft_ns: str) -> None:
    state = compiled(*service(1, ["10.244.2.1"]))
    dataplane = NftablesDataplane(POD_INTERFACES, netns=nft_ns)
    dataplane.apply(state)
    before = table_content(nft_ns)
    changed = compiled(*service(1, ["10.244.2.1", "10.244.2.2"]), *service(2, ["10.244.2.3"]))

    def refusing(netns, argv, stdin=None):  # type: ignore[no-untyped-def]
        if stdin is not None:  # the transaction, with one command the kernel refuses
            # (in place of the first rule: nft's line numbers stay the dataplane's)
            stdin = stdin.replace(f"add rule ip {TABLE} ", "add rule ip nonexistent-table ", 1)
        return run_command(netns, argv, stdin)

    dataplane._run = refusing
    with pytest.raises(DataplaneError) as raised:
        dataplane.apply(changed)
    assert "No such file or directory" in str(raised.value) and "(line " in str(raised.value)
    assert table_content(nft_ns) == before
    assert dataplane.held_revision == state.revision
    recorder = Recorder()
    dataplane._run = recorder
    dataplane.apply(changed)
    [written] = recorder.take()
    assert "delete table ip kube-bpf-proxy" in written  # after an error: whole


def test_cleanup_removes_our_tables_and_leaves_others(nft_ns: str) -> None:
    other = "add table ip other-program\nadd chain ip other-program c\n"
    assert run_command(nft_ns, ["nft", "-f", "-"], other).returncode == 0
    NftablesDataplane(POD_INTERFACES, netns=nft_ns).apply(compiled(*service(1, ["10.244.2.1"])))
    assert cleanup(nft_ns) == [f"table ip {TABLE}", f"table ip6 {TABLE}"]
    argv = ["nsenter", f"--net=/run/netns/{nft_ns}", "--", "nft", "list", "tables"]
    tables = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert tables.split("\n") == ["table ip other-program", ""]
    assert cleanup(nft_ns) == []  # nothing left: nothing to do


def test_inspect_shows_the_frontends_and_the_revision(nft_ns: str) -> None:
    def empty_with_nodeport(obj: Obj) -> None:
        obj["spec"]["type"] = "NodePort"
        obj["spec"]["ports"][0]["nodePort"] = 30002

    state = compiled(*service(1, ["10.244.2.1"]), *service(2, [], mutate=empty_with_nodeport))
    NftablesDataplane(POD_INTERFACES, netns=nft_ns).apply(state)
    argv = ["nsenter", f"--net=/run/netns/{nft_ns}", "--", sys.executable, "-m", "agent",
            "inspect", "nftables", "-o", "json"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False,
                          cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = {(r["family"], r["frontend"]): r for r in json.loads(done.stdout)}
    assert set(rows) == {("IPv4", "10.96.1.1:80/TCP"), ("IPv4", "10.96.1.2:80/TCP"),
                         ("IPv4", "192.0.2.10:30002/TCP")}, rows  # fmt: skip
    assert rows[("IPv4", "10.96.1.1:80/TCP")]["translate"] == "pick-h-1: 10.244.2.1:8080"
    assert rows[("IPv4", "10.96.1.1:80/TCP")]["untranslated"] == ""
    for frontend in ("10.96.1.2:80/TCP", "192.0.2.10:30002/TCP"):  # no endpoints: rejected
        assert rows[("IPv4", frontend)]["translate"] == ""
        assert rows[("IPv4", frontend)]["untranslated"] == "reject"
    assert {r["revision"] for r in rows.values()} == {state.revision}


def test_long_names_fit_nfts_comments(nft_ns: str) -> None:
    """A namespace and a name of 63 characters each, and a port name of 15: the chains'
    comments (nft keeps 127 bytes; IPv6 ClientIP affinity entries have chains of their own)
    are cut, the transaction goes through."""
    namespace, name = "n" * 63, "s" * 63

    def long_names(obj: Obj) -> None:
        obj["metadata"]["namespace"] = namespace
        obj["metadata"]["name"] = name
        obj["spec"]["ports"][0]["name"] = "p" * 15
        obj["spec"]["sessionAffinity"] = "ClientIP"

    objects = service(1, ["10.244.2.1"], dual=True, mutate=long_names)
    for endpoints in objects[1:]:
        endpoints["metadata"].update(namespace=namespace)
        endpoints["metadata"]["labels"]["kubernetes.io/service-name"] = name
        endpoints["ports"][0]["name"] = "p" * 15
    state = compiled(*objects)
    assert [e.name for e in state.services] == [name, name]
    NftablesDataplane(POD_INTERFACES, netns=nft_ns).apply(state)
    listed = run_command(nft_ns, ["nft", "list", "table", "ip6", TABLE], None).stdout
    comments = [line.strip() for line in listed.splitlines() if line.strip().startswith("comment")]
    assert comments, listed  # (nft -j leaves chain comments out)
    assert all(len(c.encode()) <= len('comment ""') + 127 for c in comments), comments
    assert any(c.startswith(f'comment "{namespace}/s') and c.endswith('..."')
               for c in comments), comments  # fmt: skip


def test_affinity_clients_of_an_endpoint_that_left_are_forgotten(nft_ns: str) -> None:
    """The packet path remembers each ClientIP-affinity client's endpoint in the map
    affinity-clients (client . frontend → endpoint); when an endpoint leaves, the clients it
    had are forgotten, the others' kept."""

    def affinity(obj: Obj) -> None:
        obj["spec"]["sessionAffinity"] = "ClientIP"
        obj["spec"]["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 600}}

    dataplane = NftablesDataplane(POD_INTERFACES, netns=nft_ns)
    dataplane.apply(compiled(*service(1, ["10.244.2.1", "10.244.2.2"], mutate=affinity)))
    # as the affinity-remember rules write them for two clients' first connections
    key = "10.96.1.1 . tcp . 80 timeout 600s"
    remembered = (f"add element ip {TABLE} affinity-clients {{ 10.244.1.50 . {key} : "
                  f"10.244.2.1 . 8080, 10.244.1.51 . {key} : 10.244.2.2 . 8080 }}\n")  # fmt: skip
    done = run_command(nft_ns, ["nft", "-f", "-"], remembered)
    assert done.returncode == 0, done.stderr
    dataplane.apply(compiled(*service(1, ["10.244.2.1"], mutate=affinity)))
    listed = run_command(nft_ns, ["nft", "list", "map", "ip", TABLE, "affinity-clients"], None)
    assert "10.244.1.50 . 10.96.1.1 . tcp . 80" in listed.stdout, listed.stdout
    assert "10.244.1.51" not in listed.stdout, listed.stdout
    # without affinity, nobody is remembered
    dataplane.apply(compiled(*service(1, ["10.244.2.1"])))
    listed = run_command(nft_ns, ["nft", "list", "map", "ip", TABLE, "affinity-clients"], None)
    assert "10.244.1.50" not in listed.stdout, listed.stdout


def test_changed_source_ranges_and_policies_leave_the_table_a_fresh_write_would(
    nft_ns: str, netns: Callable[[], str]
) -> None:
    """A LoadBalancer's loadBalancerSourceRanges (an interval set of frontend . prefix) and
    its traffic policy changed by partial syncs."""

    def balancer(ranges: list[str], policy: str) -> Callable[[Obj], None]:
        def mutate(obj: Obj) -> None:
            obj["spec"]["type"] = "LoadBalancer"
            obj["spec"]["ports"][0]["nodePort"] = 30001
            obj["spec"]["externalTrafficPolicy"] = policy
            obj["spec"]["loadBalancerSourceRanges"] = ranges
            obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}

        return mutate

    dataplane = NftablesDataplane(POD_INTERFACES, netns=nft_ns)
    pods = ["10.244.1.5", "10.244.2.6"]
    for ranges, policy in ((["198.51.100.0/24"], "Cluster"),
                           (["198.51.100.0/25", "192.0.2.0/24"], "Local"),
                           ([], "Local"), (["198.51.100.128/25"], "Cluster")):  # fmt: skip
        state = compiled(*service(1, pods, mutate=balancer(ranges, policy)))
        dataplane.apply(state)
        assert table_content(nft_ns) == fresh_content(netns, state), (ranges, policy)


# Sends one UDP datagram from [src]:sport to [dst]:9999 (the namespace's loopback).
SEND = """
import socket, sys
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
sock = socket.socket(family, socket.SOCK_DGRAM)
sock.bind((sys.argv[1], int(sys.argv[3])))
sock.sendto(b"x", (sys.argv[2], 9999))
"""


@pytest.mark.parametrize("family", ["ip", "ip6"])
def test_explains_flow_slot_is_the_kernels_pick_hash(nft_ns: str, family: str) -> None:
    """The pick chains' `jhash` (render.pick_hash: the 5-tuple for IPv4, the client's
    address and port for IPv6) gives, for real datagrams, the slot explain computes."""
    from agent.dataplane.nftables.render import HASH_SEED, IPV4, IPV6, pick_hash
    from agent.explain.nftables import flow_slot

    address = "127.0.0.1" if family == "ip" else "::1"
    expr = pick_hash(IPV4 if family == "ip" else IPV6)
    modulus = 5
    assert run_command(nft_ns, ["ip", "link", "set", "lo", "up"], None).returncode == 0
    rules = (
        f"add table {family} hash-probe\n"
        f"add chain {family} hash-probe out {{ type filter hook output priority 0 ; }}\n"
    )
    rules += "".join(f"add rule {family} hash-probe out udp dport 9999 {expr} mod {modulus} "
                     f"seed {HASH_SEED} {i} counter\n" for i in range(modulus))  # fmt: skip
    done = run_command(nft_ns, ["nft", "-f", "-"], rules)
    assert done.returncode == 0, done.stderr

    def counts() -> list[int]:
        listed = run_command(nft_ns, ["nft", "-j", "list", "chain", family, "hash-probe", "out"],
                             None)  # fmt: skip
        items = json.loads(listed.stdout)["nftables"]
        return [sum(e.get("counter", {}).get("packets", 0) for e in item["rule"]["expr"])
                for item in items if "rule" in item]  # fmt: skip

    seen = set()
    for sport in (40000, 40001, 40123, 51515, 60001, 33333, 12345, 23456):
        before = counts()
        sent = run_command(nft_ns, [sys.executable, "-c", SEND, address, address, str(sport)],
                           None)  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        hit = [i for i, (a, b) in enumerate(zip(before, counts(), strict=True)) if b > a]
        slot = flow_slot(address, sport, address, 9999, modulus, int(HASH_SEED, 16),
                         source_only=family == "ip6")  # fmt: skip
        assert hit == [slot], (sport, hit, slot)
        seen.add(slot)
    assert len(seen) > 1, seen  # the ports spread over the slots


def test_libnftables_runs_nfts_commands_in_the_namespace_it_was_opened_in(nft_ns: str) -> None:
    """The dataplane's nft runs in-process (libnft.py): what `nft -f -`, `nft -j list`,
    `nft -c -f -` and `nft delete table` would do, in the dataplane's namespace (its
    socket was opened there, whatever namespace the caller is in), errors as nft prints
    them; other commands go to the fallback."""
    fallback_calls: list[list[str]] = []

    def fallback(netns, argv, stdin):  # type: ignore[no-untyped-def]
        fallback_calls.append(list(argv))
        return run_command(netns, argv, stdin)

    runner = LibNftRunner(fallback, "nft")
    try:
        made = runner(nft_ns, ["nft", "-f", "-"], "add table ip kbp-libnft-test\n")
        assert made.returncode == 0, made.stderr
        seen = run_command(nft_ns, ["nft", "list", "tables"], None).stdout
        assert "table ip kbp-libnft-test" in seen, seen
        # Checked, not applied.
        checked = runner(nft_ns, ["nft", "-c", "-f", "-"], "add table ip kbp-libnft-other\n")
        assert checked.returncode == 0, checked.stderr
        listed = runner(nft_ns, ["nft", "-j", "list", "tables"], None)
        names = [t["table"]["name"] for t in json.loads(listed.stdout)["nftables"] if "table" in t]
        assert names == ["kbp-libnft-test"], listed.stdout
        wrong = runner(nft_ns, ["nft", "-f", "-"], "add table ip kbp-libnft-test\nadd chain x\n")
        assert wrong.returncode == 1 and "Error:" in wrong.stderr, wrong
        deleted = runner(nft_ns, ["nft", "delete", "table", "ip", "kbp-libnft-test"], None)
        assert deleted.returncode == 0, deleted.stderr
        assert "kbp-libnft" not in run_command(nft_ns, ["nft", "list", "tables"], None).stdout
        assert runner(nft_ns, ["true"], None).returncode == 0
        assert fallback_calls == [["true"]]
    finally:
        runner.close()
