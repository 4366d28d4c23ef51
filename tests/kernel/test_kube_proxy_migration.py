"""From kube-proxy to kube-bpf-proxy on a serving node, with nothing dropped (issue 32).

In a lab node namespace, kube-proxy's rules serve a ClusterIP as kube-proxy writes them
(iptables mode, in either iptables backend: KUBE-SERVICES jumped from PREROUTING and
OUTPUT, KUBE-SVC-* choosing with `statistic random`, KUBE-SEP-* DNATing to three pods,
KUBE-MARK-MASQ and KUBE-POSTROUTING; or nftables mode: table ip kube-proxy). A client pod
holds several connections open through those rules and opens a new one every 100 ms.
Then the agent starts with --remove-kube-proxy-rules, on either dataplane: not one new
connection may fail, every held connection must keep echoing, kube-proxy's chains or
table must be gone afterwards (kubelet's KUBE- chains kept) and /state must say
`removed`.

Address plan (tests/lab/nodelab.py): client 10.244.1.1, be1-be3 10.244.1.2-4 serving
TCP 8080; Service web 10.96.0.80:80.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.dataplane.iptables.backend import find_backend
from agent.lab.toolkit import in_netns
from tests.lab.nodelab import Lab, Stream

from ..conftest import BPFFS, skip_or_fail
from .agentproc import AgentProcess, cli, run_argv, service_manifest

CLUSTER_IP = "10.96.0.80"
BACKENDS = ("be1", "be2", "be3")
HELD = 4  # connections opened through kube-proxy's rules and held across the takeover
INTERVAL = 0.1  # seconds between new connections
SVC_CHAIN = "KUBE-SVC-NPX46M4PTMTKRN6Y"  # kube-proxy's hash-named chains, as it names them
SEP_CHAINS = ("KUBE-SEP-ZP3FB6NMPNCO4VBJ", "KUBE-SEP-XC6YQFYD4NMQSHVO",
              "KUBE-SEP-7SUTUEUF6ZTVNEB2")  # fmt: skip
# What kube-proxy --cleanup leaves: kubelet's own chains.
KUBELET_CHAINS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY", "KUBE-FIREWALL")


def kube_proxy_iptables(backends: list[str]) -> str:
    """kube-proxy's iptables-mode rules (iptables-save layout, as in Kubernetes 1.30) for
    Service default/web, plus kubelet's chains, for `iptables-restore --noflush`."""
    n = len(backends)
    sep_rules = []
    svc_rules = [
        f"-A {SVC_CHAIN} ! -s 10.244.0.0/16 -d {CLUSTER_IP}/32 -p tcp -m comment "
        f'--comment "default/web:http cluster IP" -m tcp --dport 80 -j KUBE-MARK-MASQ'
    ]
    for i, (ip, chain) in enumerate(zip(backends, SEP_CHAINS, strict=False)):
        left = n - i
        choose = (f"-m statistic --mode random --probability {1 / left:.11f} "
                  if left > 1 else "")  # fmt: skip
        svc_rules.append(
            f'-A {SVC_CHAIN} -m comment --comment "default/web:http -> {ip}:8080" '
            f"{choose}-j {chain}"
        )
        sep_rules += [
            f'-A {chain} -s {ip}/32 -m comment --comment "default/web:http" -j KUBE-MARK-MASQ',
            f'-A {chain} -p tcp -m comment --comment "default/web:http" -m tcp '
            f"-j DNAT --to-destination {ip}:8080",
        ]
    chains = [SVC_CHAIN, *SEP_CHAINS[:n]]
    return "\n".join([
        "*mangle",
        ":KUBE-IPTABLES-HINT - [0:0]",
        ":KUBE-KUBELET-CANARY - [0:0]",
        ":KUBE-PROXY-CANARY - [0:0]",
        "COMMIT",
        "*filter",
        ":KUBE-FIREWALL - [0:0]",
        ":KUBE-SERVICES - [0:0]",
        ":KUBE-FORWARD - [0:0]",
        ":KUBE-PROXY-FIREWALL - [0:0]",
        ":KUBE-PROXY-CANARY - [0:0]",
        "-A INPUT -j KUBE-FIREWALL",
        "-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes load "
        "balancer firewall\" -j KUBE-PROXY-FIREWALL",
        "-A FORWARD -m comment --comment \"kubernetes forwarding rules\" -j KUBE-FORWARD",
        "-A FORWARD -m conntrack --ctstate NEW -m comment --comment \"kubernetes service "
        "portals\" -j KUBE-SERVICES",
        "-A KUBE-FORWARD -m comment --comment \"kubernetes forwarding rules\" -m mark "
        "--mark 0x4000/0x4000 -j ACCEPT",
        "COMMIT",
        "*nat",
        ":KUBE-SERVICES - [0:0]",
        ":KUBE-NODEPORTS - [0:0]",
        ":KUBE-POSTROUTING - [0:0]",
        ":KUBE-MARK-MASQ - [0:0]",
        *(f":{chain} - [0:0]" for chain in chains),
        "-A PREROUTING -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
        "-A OUTPUT -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES",
        "-A POSTROUTING -m comment --comment \"kubernetes postrouting rules\" "
        "-j KUBE-POSTROUTING",
        "-A KUBE-MARK-MASQ -j MARK --set-xmark 0x4000/0x4000",
        "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN",
        "-A KUBE-POSTROUTING -j MARK --set-xmark 0x4000/0x0",
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring "
        "SNAT\" -j MASQUERADE --random-fully",
        f'-A KUBE-SERVICES -d {CLUSTER_IP}/32 -p tcp -m comment --comment "default/web:http '
        f'cluster IP" -m tcp --dport 80 -j {SVC_CHAIN}',
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports; NOTE: this "
        "must be the last rule in this chain\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS",
        *svc_rules,
        *sep_rules,
        "COMMIT",
        "",
    ])  # fmt: skip


def kube_proxy_nftables(backends: list[str]) -> str:
    """kube-proxy's nftables-mode table for Service default/web (its layout: a verdict map
    of service IPs, a chain per service port choosing with numgen, a chain per endpoint)."""
    svc = "service-NPX46M4P-default-web-tcp-http"
    endpoints = [f"endpoint-{chain[9:17]}-default-web-tcp-http" for chain in SEP_CHAINS]
    endpoints = endpoints[: len(backends)]
    vmap = ", ".join(f"{i} : goto {name}" for i, name in enumerate(endpoints))
    chains = {
        "mark-for-masquerade": ["mark set mark or 0x4000"],
        "masquerading": ["type nat hook postrouting priority srcnat; policy accept;",
                         "mark and 0x4000 == 0 return", "mark set mark xor 0x4000",
                         "masquerade fully-random"],
        "services": ["ip daddr . meta l4proto . th dport vmap @service-ips"],
        "nat-prerouting": ["type nat hook prerouting priority dstnat; policy accept;",
                           "jump services"],
        "nat-output": ["type nat hook output priority -100; policy accept;", "jump services"],
        svc: [f"ip daddr {CLUSTER_IP} tcp dport 80 ip saddr != 10.244.0.0/16 "
              "jump mark-for-masquerade",
              f"numgen random mod {len(endpoints)} vmap {{ {vmap} }}"],
        **{name: [f"ip saddr {ip} jump mark-for-masquerade",
                  f"meta l4proto tcp dnat to {ip}:8080"]
           for name, ip in zip(endpoints, backends, strict=True)},
    }  # fmt: skip
    lines = [
        "table ip kube-proxy {",
        '\tcomment "rules for kube-proxy"',
        "\tmap service-ips {",
        "\t\ttype ipv4_addr . inet_proto . inet_service : verdict",
        f"\t\telements = {{ {CLUSTER_IP} . tcp . 80 : goto {svc} }}",
        "\t}",
    ]
    for name, body in chains.items():
        lines += [f"\tchain {name} {{", *(f"\t\t{line}" for line in body), "\t}"]
    return "\n".join([*lines, "}", ""])


class Agent(AgentProcess):
    """`kube-bpf-proxy run` as node-a in the lab's node namespace; every one started is
    stopped by the fixture."""

    started: list[Agent] = []

    def __init__(self, lab: Lab, manifests: Path, pin_dir: Path, dataplane: str,
                 *flags: str) -> None:  # fmt: skip
        argv = run_argv(manifests, "node-a", dataplane, "--bpffs", str(pin_dir), *flags)
        super().__init__(lab.node_ns, argv, "node-a")
        Agent.started.append(self)


@contextmanager
def node_lab(tmp_path: Path, cgroup: bool) -> Iterator[tuple[Lab, Path, Path]]:
    """The lab (client, be1-be3 serving TCP 8080; `cgroup`: the pods' processes in a
    cgroup of the lab's), the Service's manifest and a pin dir; every agent started is
    stopped and cleanup run afterwards, also when the test failed."""
    pin_dir = BPFFS / f"kbp-test-kp-{os.getpid()}-{time.monotonic_ns()}"
    with Lab(cgroup=cgroup) as lab:
        lab.add_pod("client")
        for name in BACKENDS:
            lab.add_pod(name).serve([8080], protos=("tcp",))
        manifests = tmp_path / "web.yaml"
        manifests.write_text(service_manifest(
            "web", CLUSTER_IP, [lab.pods[name].ipv4 for name in BACKENDS]))  # fmt: skip
        try:
            yield lab, manifests, pin_dir
        finally:
            while Agent.started:
                Agent.started.pop().stop(signal.SIGKILL)
            cli(lab.node_ns, "cleanup", "--bpffs", str(pin_dir))
    assert not pin_dir.exists()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Lab, Path, Path]]:
    with node_lab(tmp_path, cgroup=False) as made:
        yield made


def saved(lab: Lab, backend: str) -> str:
    """Both families' rules of one iptables backend in the node namespace."""
    tools = find_backend(backend)
    assert tools is not None
    return lab.run_in_node(tools.save("IPv4")) + lab.run_in_node(tools.save("IPv6"))


def kube_proxy_lines(text: str) -> list[str]:
    """Lines of iptables-save output that are kube-proxy's (not kubelet's, not ours)."""
    return [line for line in text.splitlines()
            if "KUBE-" in line and not any(c in line for c in KUBELET_CHAINS)]  # fmt: skip


def hold(lab: Lab) -> list[Stream]:
    streams = [lab.pods["client"].stream(CLUSTER_IP, 80) for _ in range(HELD)]
    for stream in streams:
        ok, error = stream.wait_for(3)
        assert error is None and ok >= 3, f"a connection through kube-proxy's rules: {error}"
    return streams


def take_over(lab: Lab, manifests: Path, pin_dir: Path, dataplane: str) -> Agent:
    """Connections held and made every 100 ms while the agent starts and removes
    kube-proxy's rules: asserts none failed; returns the agent, still running."""
    client = lab.pods["client"]
    before = client.connect_many(CLUSTER_IP, 80, "tcp", 20)
    assert before.errors == {} and set(before.counts) == set(BACKENDS), before
    streams = hold(lab)
    stop_new = client.connect_every(CLUSTER_IP, 80, INTERVAL)
    agent = Agent(lab, manifests, pin_dir, dataplane, "--remove-kube-proxy-rules")
    try:
        agent.wait_for_line("kube-proxy's rules are present")
        agent.wait_for_line("kube-proxy's rules removed")
        time.sleep(3.0)  # connections go on with only the agent's dataplane serving
    finally:
        new = stop_new()
        finals = []
        for stream in streams:
            ok, _ = stream.check()
            finals.append(stream.wait_for(ok + 10))
    assert new.errors == {}, f"new connections failed during the takeover: {new}\n{agent.log()}"
    assert new.answered >= 30 and set(new.counts) == set(BACKENDS), new
    broken = [
        (stream.backend, ok, error)
        for stream, (ok, error) in zip(streams, finals, strict=True)
        if error
    ]
    if broken:
        debug = (
            lab.run_in_node("conntrack", "-L")
            + cli(lab.node_ns, "inspect", "conntrack", "--bpffs", str(pin_dir)).stdout
        )
    assert not broken, f"held connection(s) broke: {broken} of {finals}\n{agent.log()}\n{debug}"
    return agent


def assert_removed(agent: Agent) -> None:
    status = agent.state()["status"]["kubeProxy"]
    assert status["state"] == "removed", status
    metrics = agent.get("/metrics")
    for kind in ("iptables-legacy", "iptables-nft", "nftables", "ipvs"):
        assert f'kbp_kube_proxy_rules{{kind="{kind}"}} 0.0' in metrics, metrics


@pytest.mark.parametrize("dataplane", ["ebpf", "iptables"])
@pytest.mark.parametrize("backend", ["legacy", "nft"])
def test_takeover_from_kube_proxy_iptables_drops_nothing(node, dataplane, backend) -> None:
    lab, manifests, pin_dir = node
    tools = find_backend(backend)
    if tools is None:
        skip_or_fail(f"iptables-{backend} is not installed")
    rules = kube_proxy_iptables([lab.pods[name].ipv4 for name in BACKENDS])
    _restore(lab, tools.restore("IPv4"), rules)
    agent = take_over(lab, manifests, pin_dir, dataplane)
    try:
        assert_removed(agent)
        left = saved(lab, backend)
        assert kube_proxy_lines(left) == [], left
        for chain in KUBELET_CHAINS:
            assert f":{chain} " in left, f"kubelet's {chain} was removed:\n{left}"
        if dataplane == "ebpf":
            agent.wait_for_line("open flow(s) that netfilter translated")
        after = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 20)
        assert after.errors == {} and set(after.counts) == set(BACKENDS), after
    finally:
        assert agent.stop() == 0


@pytest.mark.parametrize("dataplane", ["ebpf", "iptables"])
def test_takeover_from_kube_proxy_nftables_drops_nothing(node, dataplane) -> None:
    lab, manifests, pin_dir = node
    if shutil.which("nft") is None:
        skip_or_fail("nft is not installed (Debian package nftables)")
    table = kube_proxy_nftables([lab.pods[name].ipv4 for name in BACKENDS])
    _run_stdin(lab, ["nft", "-f", "-"], table)
    agent = take_over(lab, manifests, pin_dir, dataplane)
    try:
        assert_removed(agent)
        tables = json.loads(lab.run_in_node("nft", "-j", "list", "tables"))["nftables"]
        assert not [t for t in tables if t.get("table", {}).get("name") == "kube-proxy"], tables
    finally:
        assert agent.stop() == 0


def test_cleanup_kube_proxy_removes_only_kube_proxy_state(node) -> None:
    """`cleanup --kube-proxy` on demand, without an agent: it finds and removes kube-proxy's
    iptables chains, its nftables table (where nft is installed) and the IPVS mode's
    kube-ipvs0 link, and leaves kubelet's chains. (IPVS virtual servers need the ip_vs
    module, which the lab does not load.)"""
    lab, _, _ = node
    tools = find_backend("legacy")
    if tools is None:
        skip_or_fail("iptables-legacy is not installed")
    _restore(lab, tools.restore("IPv4"), kube_proxy_iptables([lab.pods["be1"].ipv4]))
    nft = shutil.which("nft") is not None
    if nft:
        _run_stdin(lab, ["nft", "-f", "-"], kube_proxy_nftables([lab.pods["be1"].ipv4]))
    # kube-proxy makes kube-ipvs0 a dummy link; this kernel has no dummy driver, and what
    # is looked for is the name: a veth pair stands in (deleting one end deletes both).
    lab.run_in_node("ip", "link", "add", "kube-ipvs0", "type", "veth", "peer", "name", "kbpipvs")
    lab.run_in_node("ip", "address", "add", f"{CLUSTER_IP}/32", "dev", "kube-ipvs0")
    done = cli(lab.node_ns, "cleanup", "--kube-proxy", "-v")
    assert done.returncode == 0, done.stderr
    assert "iptables-legacy: 11 chain(s)" in done.stdout, done.stdout
    assert "iptables-legacy IPv4 nat KUBE-SERVICES" in done.stdout, done.stdout
    assert "ipvs: 0 virtual server(s), link kube-ipvs0" in done.stdout, done.stdout
    assert ("nftables: table(s) ip kube-proxy" in done.stdout) is nft, done.stdout
    left = saved(lab, "legacy")
    assert kube_proxy_lines(left) == [], left
    assert all(f":{chain} " in left for chain in KUBELET_CHAINS), left
    links = lab.run_in_node("ip", "-o", "link")
    assert "kube-ipvs0" not in links and "kbpipvs" not in links, links
    if nft:
        assert "kube-proxy" not in lab.run_in_node("nft", "list", "tables")
    again = cli(lab.node_ns, "cleanup", "--kube-proxy")
    assert again.returncode == 0 and "nothing (none found)" in again.stdout, again.stdout


def _restore(lab: Lab, restore: str, text: str) -> None:
    _run_stdin(lab, [restore, "--noflush"], text)


def _run_stdin(lab: Lab, argv: list[str], text: str) -> None:
    proc = subprocess.run(in_netns(lab.node_ns, argv), input=text, capture_output=True,
                          text=True, timeout=30, check=False)  # fmt: skip
    assert proc.returncode == 0, f"{' '.join(argv)}: {proc.stderr}\n{text}"


@pytest.fixture
def cgroup_node(tmp_path: Path) -> Iterator[tuple[Lab, Path, Path]]:
    """As `node`, with the pods' processes in a cgroup of the lab's (--cgroup-root)."""
    with node_lab(tmp_path, cgroup=True) as made:
        yield made


@pytest.mark.parametrize("dataplane", ["ebpf", "iptables"])
def test_the_way_back_to_kube_proxy_drops_nothing(cgroup_node, dataplane) -> None:
    """The agent serves (eBPF: the pods' connections translated at connect() by the socket
    hooks, the default `--socket-lb all`), kube-proxy's rules are back, the agent stops
    and `cleanup` removes its dataplane: held connections keep echoing and no new one
    fails. (Connections tc translated mid-path cannot be handed back: docs/migration.md.)"""
    lab, manifests, pin_dir = cgroup_node
    tools = find_backend("nft") or find_backend("legacy")
    if tools is None:
        skip_or_fail("no iptables backend is installed")
    assert lab.cgroup is not None
    hooks = ("--cgroup-root", str(lab.cgroup), "--socket-lb", "all") if dataplane == "ebpf" else ()
    agent = Agent(lab, manifests, pin_dir, dataplane, *hooks)
    agent.wait_for_line("sync: applied revision")
    client = lab.pods["client"]
    streams = hold(lab)
    stop_new = client.connect_every(CLUSTER_IP, 80, INTERVAL)
    try:
        time.sleep(1.0)
        _restore(lab, tools.restore("IPv4"), kube_proxy_iptables(
            [lab.pods[name].ipv4 for name in BACKENDS]))  # fmt: skip
        time.sleep(1.0)
        assert agent.stop() == 0
        done = cli(lab.node_ns, "cleanup", "--bpffs", str(pin_dir))
        assert done.returncode == 0, done.stderr + done.stdout
        time.sleep(3.0)  # only kube-proxy's rules serve now
    finally:
        new = stop_new()
        finals = []
        for stream in streams:
            ok, _ = stream.check()
            finals.append(stream.wait_for(ok + 10))
    assert new.errors == {}, f"new connections failed on the way back: {new}\n{agent.log()}"
    assert new.answered >= 30 and set(new.counts) == set(BACKENDS), new
    broken = [error for _, error in finals if error]
    assert not broken, f"held connection(s) broke on the way back: {broken}\n{agent.log()}"
    assert "KBP-" not in saved(lab, tools.name)
    assert not pin_dir.exists()
