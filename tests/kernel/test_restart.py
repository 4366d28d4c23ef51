"""An agent restarted while the API server is unreachable, slow or failing never takes
the node's Services away, on either dataplane: an open connection keeps echoing and new
connections keep working throughout; the restarted agent reports the revision the kernel
holds and that the API is unreachable, and is not ready (/readyz 503) until it has
programmed the cluster's state, which, when the cluster did not change, writes nothing.

The API server is kmock, served from inside the lab's node namespace (the agent runs
there). Address plan as tests/kernel/test_agent_cli.py: client 10.244.1.1, be1 10.244.1.2,
be2 10.244.1.3 serving on 8080; Service web 10.96.0.80:80.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import kmock
import pytest

from agent.dataplane.ebpf import abi
from agent.dataplane.select import KERNEL_DATAPLANES
from tests.lab.nodelab import Lab, Stream

from ..api.conftest import SERVICES, KmockApi
from ..builders import make_endpoint, make_node, make_service, make_slice, write_kubeconfig
from ..conftest import BPFFS
from .agentproc import AgentProcess, run_argv
from .agentproc import cli as agent_cli
from .tchooks import our_tc_programs

# Slow (agents restarted against an API server that is down, slow or failing, up to
# 80 s a test here): `-m 'not slow'` leaves these out.
pytestmark = pytest.mark.slow

CLUSTER_IP = "10.96.0.80"
NEW_CONNECTIONS = 10  # per check, each a new flow through the Service
SLOW_LIST = 10.0  # seconds the slow API server takes to answer a list


class Node:
    """The lab, its kmock API server and the agents started on node-a."""

    def __init__(self, lab: Lab, api: KmockApi, kubeconfig: Path, pin_dir: Path) -> None:
        self.lab, self.api, self.kubeconfig, self.pin_dir = lab, api, kubeconfig, pin_dir
        self.agents: list[AgentProcess] = []
        self.client = lab.pods["client"]

    def start(self, dataplane: str) -> AgentProcess:
        argv = run_argv(None, "node-a", dataplane, "--kubeconfig", str(self.kubeconfig),
                        "--bpffs", str(self.pin_dir))  # fmt: skip
        agent = AgentProcess(self.lab.node_ns, argv, f"node-a #{len(self.agents) + 1}")
        self.agents.append(agent)
        return agent

    def serving(self, stream: Stream, during: float = 0.0) -> None:
        """The open connection echoes and every new connection is answered by a backend,
        checked once a second for `during` seconds (at least once)."""
        deadline = time.monotonic() + during
        while True:
            ok, error = stream.check()
            ok, error = stream.wait_for(ok + 5)
            assert error is None, f"the open connection broke: {error}"
            result = self.client.connect_many(CLUSTER_IP, 80, "tcp", NEW_CONNECTIONS)
            assert result.errors == {}, f"new connections failed: {result}"
            assert set(result.counts) <= {"be1", "be2"}, result
            if time.monotonic() >= deadline:
                return
            time.sleep(1.0)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    pin_dir = BPFFS / f"kbp-test-restart-{os.getpid()}-{time.monotonic_ns()}"
    with Lab() as lab:
        lab.add_pod("client")
        for name in ("be1", "be2"):
            lab.add_pod(name).serve([8080])
        api = KmockApi(netns=lab.node_ns)
        try:
            api.start()
            endpoints = [make_endpoint(lab.pods[n].ipv4, "node-a") for n in ("be1", "be2")]
            api.create(
                make_service(name="web", mutate=lambda s: s["spec"].update(
                    clusterIP=CLUSTER_IP, clusterIPs=[CLUSTER_IP])),
                make_slice(name="web-1", service="web", endpoints=endpoints),
                make_node("node-a"),
            )  # fmt: skip
            kubeconfig = Path(write_kubeconfig(tmp_path / "kubeconfig", api.url))
            here = Node(lab, api, kubeconfig, pin_dir)
            try:
                yield here
            finally:
                for agent in reversed(here.agents):
                    agent.stop(signal.SIGKILL)
                agent_cli(lab.node_ns, "cleanup", "--bpffs", str(pin_dir))
        finally:
            api.close()
    assert not pin_dir.exists()


def ready(agent: AgentProcess) -> tuple[int, dict]:
    return agent.ask("/readyz", "health server")


def slow_lists(api: KmockApi, condition: threading.Event) -> None:
    """Every list of Services waits SLOW_LIST seconds while `condition` is set, then is
    answered as usual (a payload that returns nothing falls through to the emulator)."""

    async def wait() -> None:
        await asyncio.sleep(SLOW_LIST)

    async def arm() -> None:
        api.emulator[kmock.action.LIST, kmock.resource(SERVICES)][condition] << wait

    api.call(arm())


@pytest.mark.parametrize("dataplane", ["ebpf", "iptables"])
def test_restarts_during_api_trouble_never_take_the_service_away(node: Node, dataplane: str):
    first = node.start(dataplane)
    first.wait_for_line("sync: applied revision")
    revision = first.state()["revision"]
    assert ready(first)[0] == 200
    stream = node.client.stream(CLUSTER_IP, 80)
    try:
        node.serving(stream)

        # 1. Killed, and restarted while the API server does not answer at all.
        first.stop(signal.SIGKILL)
        node.api.stop()
        second = node.start(dataplane)
        second.wait_for_line("keeping the last known state, retrying")
        second.wait_for_line("dataplane: ")
        node.serving(stream, during=4)
        code, body = ready(second)
        assert code == 503 and body["heldRevision"] == revision, body
        assert body["apiReachable"] is False, body
        code, state = second.ask("/state")
        assert code == 503 and state["heldRevision"] == revision, state
        assert state["status"]["apiReachable"] is False, state
        assert state["status"]["adoptedRevision"] == revision, state
        assert "sync: applied" not in second.log()
        node.api.start()  # back, unchanged: the restarted agent writes nothing
        second.wait_for_line("sync: the kernel already holds revision")
        assert ready(second)[0] == 200
        node.serving(stream)

        # 2. Restarted while the API server takes SLOW_LIST seconds to list Services.
        second.stop(signal.SIGKILL)
        slow = threading.Event()
        slow.set()
        slow_lists(node.api, slow)
        third = node.start(dataplane)
        third.wait_for_line("dataplane: ")
        started = time.monotonic()
        node.serving(stream, during=3)
        if time.monotonic() - started < SLOW_LIST - 2:  # the list is surely still pending
            assert ready(third)[0] == 503
        third.wait_for_line("sync: the kernel already holds revision")
        slow.clear()
        assert ready(third)[0] == 200
        node.serving(stream)

        # 3. Restarted while every list of Services fails with 500.
        third.stop(signal.SIGKILL)
        failing = threading.Event()
        failing.set()
        node.api.fail_while(kmock.action.LIST, SERVICES, failing, 500)
        fourth = node.start(dataplane)
        fourth.wait_for_line("services: ")  # the failure, logged with its retry
        node.serving(stream, during=3)
        assert ready(fourth)[0] == 503
        assert "sync: applied" not in fourth.log()
        failing.clear()
        fourth.wait_for_line("sync: the kernel already holds revision")
        assert ready(fourth)[0] == 200
        node.serving(stream)
    finally:
        _, error = stream.close()
    assert error is None, f"the open connection broke: {error}"


def new_connections_work(node: Node, during: float = 0.0) -> None:
    """Every new connection through the Service is answered, checked once a second for
    `during` seconds (at least once)."""
    deadline = time.monotonic() + during
    while True:
        result = node.client.connect_many(CLUSTER_IP, 80, "tcp", NEW_CONNECTIONS)
        assert result.errors == {} and set(result.counts) <= {"be1", "be2"}, result
        if time.monotonic() >= deadline:
            return
        time.sleep(1.0)


def test_an_abi_change_during_an_outage_keeps_the_old_programs_serving(node: Node):
    """The new agent's maps start empty (another layout version): the earlier agent's
    programs, still attached with their own maps, serve until the new agent has applied
    the cluster's state; only then are they replaced."""
    first = node.start("ebpf")
    first.wait_for_line("sync: applied revision")
    stream = node.client.stream(CLUSTER_IP, 80)
    try:
        first.stop(signal.SIGKILL)
        node.api.stop()
        # What an agent of the previous layout version left: the same maps under the
        # previous version's pin names (the programs hold the maps themselves).
        old = abi.const.KBP_ABI_VERSION - 1
        for name in abi.MAP_NAMES:
            pin = node.pin_dir / abi.versioned(name)
            pin.rename(node.pin_dir / f"{name}_v{old}")
        second = node.start("ebpf")
        second.wait_for_line("an earlier agent's programs keep serving")
        second.wait_for_line("removed the pins of another ABI version")
        second.wait_for_line("keeping the last known state, retrying")
        node.serving(stream, during=3)  # the old programs, the old conntrack
        assert not list(node.pin_dir.glob(f"kbp_*_v{old}"))
        assert ready(second)[0] == 503
        node.api.start()
        second.wait_for_line("sync: applied revision")  # into the new, empty maps
        second.wait_for_line("this agent's programs replaced the earlier agent's")
        assert ready(second)[0] == 200
        new_connections_work(node)
    finally:
        stream.close()  # established flows lose their old conntrack here (documented)


@pytest.mark.parametrize("before, after", [("iptables", "ebpf"), ("ebpf", "iptables")])
def test_switching_dataplanes_during_an_outage_keeps_the_old_one_serving(
    node: Node, before: str, after: str
):
    """`--dataplane` changed across a restart while the API server is down: the old
    dataplane's rules or programs stay until the new one has applied."""
    first = node.start(before)
    first.wait_for_line("sync: applied revision")
    first.stop(signal.SIGKILL)
    node.api.stop()
    second = node.start(after)
    second.wait_for_line("keeping the last known state, retrying")
    second.wait_for_line("dataplane: ")
    new_connections_work(node, during=3)
    assert_left_behind(node, before, present=True)
    node.api.start()
    second.wait_for_line("sync: applied revision")
    # the new dataplane removes every other kernel dataplane's leftovers (the old one's)
    others = " and ".join(name for name in KERNEL_DATAPLANES if name != after)
    assert before in others
    second.wait_for_line(f"removed what the {others} dataplane left behind")
    assert_left_behind(node, before, present=False)
    new_connections_work(node)


def assert_left_behind(node: Node, dataplane: str, present: bool) -> None:
    """Whether `dataplane`'s kernel state is on the node: KBP- chains, or our tc programs
    (links or filters) on the client's host interface and our pins."""
    if dataplane == "iptables":
        found = "KBP-SERVICES" in node.lab.run_in_node("iptables-save", "-t", "nat")
    else:
        ifname = node.client.host_ifname
        found = bool(our_tc_programs(node.lab.node_ns, ifname, "ingress"))
        assert found == node.pin_dir.exists(), "the tc programs and the pins go together"
    assert found == present, f"{dataplane}'s state {'missing' if present else 'left behind'}"
