"""The agent keeps what it wrote (agent/dataplane/ebpf/keeper.py): a running agent whose
programs are detached or whose pins are removed under it puts them back within seconds,
from the fds it holds, so the maps (conntrack included) are the ones they were; what it
cannot put back makes /readyz 503; programs of an earlier agent with another pin
directory do not keep serving beside the new agent's; the self-test asks the attached
program what it does with a new connection and compares it with the NodeState.

Address plan (tests/lab/nodelab.py): node namespace = the lab's; pods client 10.244.1.1,
be1 10.244.1.2, be2 10.244.1.3 serving TCP 8080; Service web 10.96.0.80:80 → both.
Each test pins under its own /sys/fs/bpf/kbp-test-keeper-* directories, removed at the
end with `cleanup`, also when it failed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.dataplane.ebpf import abi
from agent.dataplane.ebpf import cgroup as sockhooks
from agent.dataplane.ebpf.netlink import FILTER_PRIORITY, run_in_netns
from agent.explain.selftest import self_test
from agent.lab.toolkit import in_netns
from agent.model.compile import CompileOptions, compile
from agent.sources.manifests import load_manifests
from tests.lab.nodelab import Lab, Stream

from ..conftest import BPFFS
from .agentproc import AgentProcess, run_argv, service_manifest, web_lab
from .agentproc import cli as agent_cli
from .tchooks import our_tc_programs

CLUSTER_IP = "10.96.0.80"
REPAIR_WITHIN = 10.0  # seconds: the keeper checks every 5


class Agent(AgentProcess):
    started: list[Agent] = []

    def __init__(self, lab: Lab, manifests: Path, pin_dir: Path, *flags: str) -> None:
        argv = run_argv(manifests, "node-a", "ebpf", "--bpffs", str(pin_dir), *flags)
        super().__init__(lab.node_ns, argv, "node-a")
        Agent.started.append(self)

    def repairs(self) -> dict[str, float]:
        """kbp_dataplane_repairs_total by `what`."""
        found = re.findall(r'^kbp_dataplane_repairs_total\{what="(\w+)"\} (\S+)$',
                           self.get("/metrics"), re.M)  # fmt: skip
        return {what: float(value) for what, value in found}


class Node:
    def __init__(self, lab: Lab, manifests: Path) -> None:
        self.lab = lab
        self.manifests = manifests
        self.pin_dirs: list[Path] = []

    def pin_dir(self) -> Path:
        made = BPFFS / f"kbp-test-keeper-{os.getpid()}-{time.monotonic_ns()}"
        self.pin_dirs.append(made)
        return made

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return agent_cli(self.lab.node_ns, *args)

    def new_connections(self, n: int = 10, timeout: float = 1.0) -> dict:
        result = self.lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", n, timeout=timeout)
        return {"errors": result.errors, "counts": result.counts}

    def serves_again(self, within: float = REPAIR_WITHIN) -> float:
        """Seconds until a new connection to the Service works again (AssertionError
        after `within`)."""
        started = time.monotonic()
        while time.monotonic() - started < within:
            result = self.new_connections(1, timeout=0.3)
            if not result["errors"]:
                return time.monotonic() - started
        raise AssertionError(f"the Service did not come back within {within:g} s")

    def conntrack_to_service(self, pin_dir: Path) -> list[dict]:
        shown = self.cli("inspect", "conntrack", "-o", "json", "--bpffs", str(pin_dir))
        assert shown.returncode == 0, shown.stderr
        return [r for r in json.loads(shown.stdout) if r["destination"] == f"{CLUSTER_IP}:80"]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with web_lab(cgroup=True) as lab:
        manifests = tmp_path / "web.yaml"
        manifests.write_text(service_manifest(
            "web", CLUSTER_IP, [lab.pods["be1"].ipv4, lab.pods["be2"].ipv4]))  # fmt: skip
        made = Node(lab, manifests)
        try:
            yield made
        finally:
            while Agent.started:
                Agent.started.pop().stop(signal.SIGKILL)
            for pin_dir in made.pin_dirs:
                agent_cli(lab.node_ns, "cleanup", "--force", "--bpffs", str(pin_dir))
    for pin_dir in made.pin_dirs:
        assert not pin_dir.exists(), f"{pin_dir} left behind"


def _held_stream(node: Node) -> tuple[Stream, int]:
    # Echoes wait out the seconds before the repair: TCP retransmits meanwhile.
    stream = node.lab.pods["client"].stream(CLUSTER_IP, 80, timeout=30.0)
    ok, error = stream.check()
    assert error is None and ok >= 1, error
    return stream, ok


def _survived(stream: Stream, ok: int) -> None:
    after, error = stream.wait_for(ok + 10, timeout=30.0)
    assert error is None and after >= ok + 10, f"the held connection broke: {error}"


@pytest.mark.parametrize("tc_attach", ["tcx", "clsact"])
def test_cleanup_under_a_running_agent_is_undone_within_seconds_with_its_conntrack(
    node: Node, tc_attach: str
) -> None:
    pin_dir = node.pin_dir()
    agent = Agent(node.lab, node.manifests, pin_dir, "--tc-attach", tc_attach,
                  "--socket-lb", "off")  # fmt: skip
    agent.wait_for_line("sync: applied revision")
    assert node.new_connections()["errors"] == {}
    stream, ok = _held_stream(node)
    try:
        held = node.conntrack_to_service(pin_dir)
        assert held, "the held connection has conntrack entries"
        pins = sorted(p.name for p in pin_dir.iterdir())
        done = node.cli("cleanup", "--force", "--bpffs", str(pin_dir))
        assert done.returncode == 0 and "still runs" in done.stdout + done.stderr, done

        took = node.serves_again()
        agent.wait_for_line("ebpf: repaired")
        _survived(stream, ok)
        assert node.new_connections(20)["errors"] == {}
        _same_pins(pin_dir, pins, agent)
        # The maps never went: the held connection's entries are the ones it had.
        kept = {(r["source"], r["translation"]) for r in node.conntrack_to_service(pin_dir)}
        assert {(r["source"], r["translation"]) for r in held} <= kept
        repairs = agent.repairs()
        assert repairs["pin"] >= 1 and repairs["tc"] >= 1, repairs
        assert agent.ask("/readyz", "health server")[0] == 200
        print(f"{tc_attach}: serving again {took:.1f} s after cleanup --force")
    finally:
        stream.close()
        assert agent.stop() == 0


def test_removing_the_pin_directory_under_a_running_agent_detaches_nothing(node: Node) -> None:
    """tcx links and the socket hooks' cgroup links end with their last reference: the
    agent holds an fd of each beside the pin, so `rm -r` costs no connection."""
    cgroup = node.lab.cgroup
    assert cgroup is not None
    pin_dir = node.pin_dir()
    agent = Agent(node.lab, node.manifests, pin_dir, "--tc-attach", "tcx",
                  "--cgroup-root", str(cgroup), "--socket-lb", "all")  # fmt: skip
    agent.wait_for_line("sync: applied revision")
    assert node.new_connections()["errors"] == {}
    pins = sorted(p.name for p in pin_dir.iterdir())
    assert any(p.startswith("kbp_tcx_") for p in pins) and any(
        p.startswith(sockhooks.LINK_PIN_PREFIX) for p in pins), pins  # fmt: skip
    for pin in pin_dir.iterdir():
        pin.unlink()
    pin_dir.rmdir()

    # Translated at connect() and by tc alike, before the agent has noticed anything.
    assert node.new_connections(20)["errors"] == {}
    assert sockhooks.attached_programs(cgroup, "connect4") == ["kbp_connect4"]
    agent.wait_for_line("ebpf: repaired")
    _same_pins(pin_dir, pins, agent)
    repairs = agent.repairs()
    assert repairs["pin"] >= 1, repairs
    assert repairs["tc"] == repairs["socket_hooks"] == 0, repairs  # nothing was detached
    assert node.new_connections(20)["errors"] == {}
    assert agent.stop() == 0


def _same_pins(pin_dir: Path, pins: list[str], agent: Agent) -> None:
    deadline = time.monotonic() + REPAIR_WITHIN
    while not pin_dir.is_dir() or sorted(p.name for p in pin_dir.iterdir()) != pins:
        assert time.monotonic() < deadline, (pins, agent.log())
        time.sleep(0.2)


def test_readyz_is_503_while_a_program_cannot_be_put_back(node: Node) -> None:
    pin_dir = node.pin_dir()
    agent = Agent(node.lab, node.manifests, pin_dir, "--tc-attach", "clsact",
                  "--socket-lb", "off")  # fmt: skip
    agent.wait_for_line("sync: applied revision")
    veth = node.lab.pods["client"].host_ifname
    ns = node.lab.node_ns

    def tc(*args: str) -> None:
        subprocess.run(in_netns(ns, ["tc", *args]), check=True, capture_output=True)

    try:
        assert agent.ask("/readyz", "health server")[0] == 200
        # Someone else's filter takes our priority on the client's interface: the agent
        # may not remove it, so it cannot attach there.
        tc("filter", "del", "dev", veth, "ingress")
        tc("filter", "add", "dev", veth, "ingress", "prio", str(FILTER_PRIORITY),
           "u32", "match", "u32", "0", "0")  # fmt: skip
        deadline = time.monotonic() + REPAIR_WITHIN
        while (answer := agent.ask("/readyz", "health server"))[0] == 200:
            assert time.monotonic() < deadline, "/readyz stayed 200 with the client detached"
            time.sleep(0.2)
        code, body = answer
        assert code == 503 and veth in body["reason"], body
        assert "kbp_from_pod missing on ingress" in body["reason"], body
        # Not yet a minute: the proxy itself is still healthy by kube-proxy's rule.
        assert agent.ask("/healthz", "health server")[0] == 200
        state = agent.state()["status"]["datapathIntact"]
        assert state["problems"] and state["unrepairedSeconds"] is not None, state

        tc("filter", "del", "dev", veth, "ingress", "prio", str(FILTER_PRIORITY))
        deadline = time.monotonic() + REPAIR_WITHIN
        while agent.ask("/readyz", "health server")[0] != 200:
            assert time.monotonic() < deadline, agent.log()
            time.sleep(0.2)
        assert node.new_connections()["errors"] == {}
        assert our_tc_programs(ns, veth, "ingress")[0].endswith(":kbp_from_pod")
    finally:
        assert agent.stop() == 0


def test_an_earlier_pin_directorys_programs_do_not_serve_beside_the_new_agents(
    node: Node,
) -> None:
    cgroup = node.lab.cgroup
    assert cgroup is not None
    first_dir, second_dir = node.pin_dir(), node.pin_dir()
    hooks = ("--cgroup-root", str(cgroup), "--tc-attach", "tcx")
    first = Agent(node.lab, node.manifests, first_dir, *hooks)
    first.wait_for_line("sync: applied revision")
    assert first.stop() == 0  # its programs stay, pinned in first_dir
    assert sockhooks.attached_programs(cgroup, "connect4") == ["kbp_connect4"]

    second = Agent(node.lab, node.manifests, second_dir, *hooks)
    try:
        second.wait_for_line("sync: applied revision")
        deadline = time.monotonic() + REPAIR_WITHIN
        while (names := sockhooks.attached_programs(cgroup, "connect4")) != ["kbp_connect4"]:
            assert time.monotonic() < deadline, (names, second.log())
            time.sleep(0.2)
        for hook in sockhooks.socket_programs():
            assert len(sockhooks.attached_programs(cgroup, hook)) == 1, hook
        # Every program on the cgroup and the interfaces is the second agent's.
        pinned = {
            hook: sockhooks.link_pin(second_dir, hook) for hook in sockhooks.socket_programs()
        }
        assert all(pin.exists() for pin in pinned.values()), sorted(second_dir.iterdir())
        veth = node.lab.pods["client"].host_ifname
        assert our_tc_programs(node.lab.node_ns, veth) == [
            "egress:tcx:kbp_to_pod", "ingress:tcx:kbp_from_pod"]  # fmt: skip
        assert node.new_connections()["errors"] == {}
        assert any(name.startswith(abi.versioned("kbp_services")) for name in
                   os.listdir(second_dir))  # fmt: skip
    finally:
        assert second.stop() == 0


def test_the_self_test_asks_the_attached_program_and_tells_a_disagreement(
    node: Node, tmp_path: Path
) -> None:
    pin_dir = node.pin_dir()
    agent = Agent(node.lab, node.manifests, pin_dir, "--socket-lb", "off")
    agent.wait_for_line("sync: applied revision")
    # The self-test asks explain's build, which the agent compiles after its first apply
    # (a child process's compile: about 10 s on a slow machine), so the keeper's period
    # counts from there.
    agent.wait_for_line("explain's build of the programs pinned")
    deadline = time.monotonic() + REPAIR_WITHIN
    while (tested := agent.state()["status"]["datapathIntact"]["selfTest"]) is None:
        assert time.monotonic() < deadline, agent.log()
        time.sleep(0.2)
    assert tested["passed"] is True, tested
    assert tested["frontend"] == f"{CLUSTER_IP}:80/TCP (default/web:http)", tested
    assert tested["detail"].startswith("backends: to 10.244.1."), tested
    assert re.search(r'^kbp_datapath_self_tests_total\{result="pass"\} [1-9]',
                     agent.get("/metrics"), re.M)  # fmt: skip

    # The same question about a NodeState the kernel does not hold (web without be1):
    # the comparison names what differs.
    other = tmp_path / "other.yaml"
    other.write_text(service_manifest("web", CLUSTER_IP, [node.lab.pods["be2"].ipv4]))
    state = compile(load_manifests([str(other)])[0], "node-a", CompileOptions())
    result = run_in_netns(node.lab.node_ns, lambda: self_test(pin_dir, state, 0))
    assert result is not None and result.passed is False, result
    assert "the maps hold revision" in result.detail, result
    assert agent.stop() == 0
