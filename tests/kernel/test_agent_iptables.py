"""`kube-bpf-proxy run --dataplane iptables` as a user runs it, in a lab's node namespace:
balancing, `/state` and `/proxyMode`, partial syncs on a file change, a restart under a
live connection, SIGTERM leaving the rules, `cleanup` removing them, and switching between
the two dataplanes leaving nothing of the other behind.

Address plan: as tests/kernel/test_agent_cli.py (client 10.244.1.1, be1 10.244.1.2,
be2 10.244.1.3 serving on 8080; Service web 10.96.0.80:80).
"""

from __future__ import annotations

import signal
import time

from tests.lab.nodelab import Lab

from .tchooks import our_tc_programs
from .test_agent_cli import CLUSTER_IP, Agent, cli, setup, write_manifest

__all__ = ["setup"]  # the fixture, shared with the eBPF agent tests


def iptables_save(lab: Lab, family: str = "4") -> str:
    return lab.run_in_node("iptables-save" if family == "4" else "ip6tables-save")


def kbp_lines(lab: Lab) -> list[str]:
    return [
        line
        for family in ("4", "6")
        for line in iptables_save(lab, family).splitlines()
        if "KBP-" in line
    ]


def test_iptables_agent_balances_and_says_which_dataplane_runs(setup) -> None:
    lab, manifests, pin_dir = setup
    agent = Agent(lab, manifests, pin_dir, dataplane="iptables")
    try:
        agent.wait_for_line("sync: applied revision")
        result = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 30)
        assert result.errors == {} and set(result.counts) == {"be1", "be2"}, result
        assert agent.get("/proxyMode").strip() == "iptables"
        state = agent.state()
        assert state["status"]["dataplane"] == "iptables"
        assert state["heldRevision"] == state["revision"]
        rules = iptables_save(lab)
        assert '-A PREROUTING -m comment --comment "kube-bpf-proxy service portals"' in rules
        assert f"-d {CLUSTER_IP}/32 -p tcp -m tcp --dport 80" in rules
    finally:
        assert agent.stop() == 0


def test_file_change_is_a_partial_sync_and_sigterm_leaves_the_rules(setup) -> None:
    lab, manifests, pin_dir = setup
    agent = Agent(lab, manifests, pin_dir, dataplane="iptables")
    try:
        first = agent.wait_for_line("sync: applied revision")
        full_writes = int(agent.lines[first].split(" writes")[0].rsplit(" ", 1)[-1])
        write_manifest(manifests, lab.pods["be2"].ipv4)
        second = agent.wait_for_line("sync: applied revision", after=first + 1)
        partial_writes = int(agent.lines[second].split(" writes")[0].rsplit(" ", 1)[-1])
        # the first sync also inserted the jump rules and the fixed chains
        assert 0 < partial_writes < full_writes, agent.lines[first : second + 1]
        result = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 20)
        assert result.counts == {"be2": 20}, result
    finally:
        assert agent.stop() == 0
    after = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 5)
    assert after.counts == {"be2": 5}, after  # the rules outlive the agent, as kube-proxy's

    done = cli(lab, "cleanup", "--bpffs", str(pin_dir))
    assert done.returncode == 0, done.stderr + done.stdout
    assert kbp_lines(lab) == []
    gone = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 1, timeout=0.5)
    assert gone.errors == {"timeout": 1}, gone  # untranslated: the lab blackholes it


def test_connection_survives_an_iptables_agent_restart(setup) -> None:
    lab, manifests, pin_dir = setup
    first = Agent(lab, manifests, pin_dir, dataplane="iptables")
    first.wait_for_line("sync: applied revision")
    rules_before = sorted(kbp_lines(lab))
    stream = lab.pods["client"].stream(CLUSTER_IP, 80)
    try:
        ok, _ = stream.check()
        first.stop(signal.SIGKILL)
        ok_dead, error = stream.wait_for(ok + 10)
        assert error is None, "the connection needs no agent"
        second = Agent(lab, manifests, pin_dir, dataplane="iptables")
        try:
            # the same cluster: the restart adopts the rules and writes nothing
            second.wait_for_line("sync: the kernel already holds revision")
            _, error = stream.wait_for(ok_dead + 10)
            assert error is None, f"the connection broke across the restart: {error}"
            # the restart rewrote the same rules: no duplicate jumps, nothing new or lost
            assert sorted(kbp_lines(lab)) == rules_before
            new = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 20)
            assert new.errors == {} and set(new.counts) == {"be1", "be2"}, new
        finally:
            assert second.stop() == 0
    finally:
        _, error = stream.close()
    assert error is None


def test_switching_dataplanes_leaves_nothing_of_the_other(setup) -> None:
    lab, manifests, pin_dir = setup
    client = lab.pods["client"]
    ebpf = Agent(lab, manifests, pin_dir, dataplane="ebpf")
    ebpf.wait_for_line("sync: applied revision")
    assert ebpf.stop() == 0
    assert pin_dir.exists()

    iptables = Agent(lab, manifests, pin_dir, dataplane="iptables")
    try:
        iptables.wait_for_line("sync: applied revision")
        assert not pin_dir.exists(), "the eBPF maps were left pinned"
        hooks = our_tc_programs(lab.node_ns, client.host_ifname)
        assert hooks == [], hooks
        result = client.connect_many(CLUSTER_IP, 80, "tcp", 20)
        assert result.errors == {} and set(result.counts) == {"be1", "be2"}, result
    finally:
        assert iptables.stop() == 0

    ebpf = Agent(lab, manifests, pin_dir, dataplane="ebpf")
    try:
        ebpf.wait_for_line("sync: applied revision")
        deadline = time.monotonic() + 5
        while kbp_lines(lab) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert kbp_lines(lab) == [], "the iptables rules were left behind"
        result = client.connect_many(CLUSTER_IP, 80, "tcp", 20)
        assert result.errors == {} and set(result.counts) == {"be1", "be2"}, result
    finally:
        assert ebpf.stop() == 0


def test_on_a_legacy_iptables_node_the_agent_writes_to_legacy_and_says_why(setup) -> None:
    lab, manifests, pin_dir = setup
    # What a CNI running iptables-legacy leaves on the node (matches none of the lab's
    # traffic: 198.51.100.0/24 is a documentation prefix).
    for table, rule in (("nat", "-A POSTROUTING -s 10.244.0.0/16 ! -d 10.244.0.0/16 -j MASQUERADE"),
                        ("filter", "-A INPUT -s 198.51.100.0/24 -j DROP")):  # fmt: skip
        lab.run_in_node("iptables-legacy", "-w", "5", "-t", table, *rule.split())
    agent = Agent(lab, manifests, pin_dir, dataplane="iptables")
    try:
        line = agent.lines[agent.wait_for_line("iptables backend: legacy")]
        assert "2 rules in iptables-legacy, 0 in iptables-nft" in line, line
        agent.wait_for_line("sync: applied revision")
        result = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 30)
        assert result.errors == {} and set(result.counts) == {"be1", "be2"}, result
        backend = agent.state()["status"]["iptablesBackend"]
        assert backend["name"] == "legacy" and backend["save"] == "iptables-legacy-save"
        assert backend["reason"].startswith("2 rules in iptables-legacy"), backend
        assert f"-d {CLUSTER_IP}/32 -p tcp -m tcp --dport 80" in lab.run_in_node(
            "iptables-legacy-save", "-t", "nat"
        )
        assert kbp_lines(lab) == [], "nothing of ours in the nft backend"
    finally:
        assert agent.stop() == 0

    done = cli(lab, "cleanup", "--bpffs", str(pin_dir))
    assert done.returncode == 0, done.stderr + done.stdout
    assert "iptables (nft): removed nothing" in done.stdout, done.stdout
    (legacy_line,) = [line for line in done.stdout.splitlines() if "(legacy)" in line]
    assert "IPv4 nat: 3 jump rule(s)" in legacy_line, done.stdout
    legacy = lab.run_in_node("iptables-legacy-save") + lab.run_in_node("ip6tables-legacy-save")
    assert "KBP-" not in legacy and "-A INPUT -s 198.51.100.0/24 -j DROP" in legacy
