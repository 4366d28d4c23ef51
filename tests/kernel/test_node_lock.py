"""One writer per node, and a clean stop, with real agent processes in a lab namespace:
`cleanup` refused while an agent serves (and `--force`), a second agent with another
view of the cluster waiting without writing while a client keeps connecting, and
SIGTERM during a slow apply waiting for it.

Address plan (tests/lab/nodelab.py): node namespace = node-a; pods client 10.244.1.1,
be1 10.244.1.2, be2 10.244.1.3 serving TCP 8080; Services web 10.96.0.80:80 (be1, be2)
and other 10.96.0.81:80 (be2), which only the first agent's manifests hold.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.dataplane.ebpf.maps import MapSizes
from agent.nodelock import lock_path
from tests.lab.nodelab import Lab

from ..conftest import BPFFS
from .agentproc import AgentProcess, run_argv, service_manifest, web_lab
from .agentproc import cli as agent_cli
from .killapply import FIRST_SLOW_WRITE, cluster_objects, exact, expected, nodestate, read_maps

WEB_IP, OTHER_IP = "10.96.0.80", "10.96.0.81"
SYNC_PERIOD = "3s"  # resyncs while the second agent waits: each would have overwritten
WAIT_S = 33.0  # how long the second agent waits: several resyncs and one "still waiting"
LOCK_DIR = os.environ["KBP_LOCK_DIR"]  # the agents' (tests/conftest.py)


@dataclass
class Node:
    lab: Lab
    pin_dir: Path
    tmp: Path
    agents: list[AgentProcess] = field(default_factory=list)

    def manifests(self, name: str, *, other: bool) -> Path:
        """web, and with `other` the Service only the first agent knows."""
        be1, be2 = self.lab.pods["be1"].ipv4, self.lab.pods["be2"].ipv4
        text = service_manifest("web", WEB_IP, [be1, be2])
        if other:
            text += service_manifest("other", OTHER_IP, [be2])
        path = self.tmp / name
        path.mkdir()
        (path / "services.yaml").write_text(text)
        return path

    def start(self, manifests: Path, *flags: str, argv: list[str] | None = None) -> AgentProcess:
        argv = argv or run_argv(manifests, "node-a", "ebpf", "--bpffs", str(self.pin_dir),
                                "--sync-period", SYNC_PERIOD, *flags)  # fmt: skip
        agent = AgentProcess(self.lab.node_ns, argv, f"node-a #{len(self.agents) + 1}")
        self.agents.append(agent)
        return agent

    def pins(self) -> list[str]:
        return sorted(p.name for p in self.pin_dir.iterdir()) if self.pin_dir.exists() else []


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    pin_dir = BPFFS / f"kbp-test-lock-{os.getpid()}-{time.monotonic_ns()}"
    with web_lab() as lab:
        here = Node(lab, pin_dir, tmp_path)
        try:
            yield here
        finally:
            for agent in reversed(here.agents):
                agent.stop(signal.SIGKILL)
            agent_cli(lab.node_ns, "cleanup", "--bpffs", str(pin_dir))
    assert not pin_dir.exists()


class Connecting:
    """A client connecting to ip:80 in a loop (new flows, batches of 10) until stopped:
    what it saw, summed."""

    def __init__(self, node: Node, ip: str) -> None:
        self.client, self.ip = node.lab.pods["client"], ip
        self.counts: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.details: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"connecting {ip}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            result = self.client.connect_many(self.ip, 80, "tcp", 10, timeout=1.0)
            self.counts.update(result.counts)
            self.errors.update(result.errors)
            self.details.extend(result.details[:3])

    def stop(self) -> tuple[int, Counter[str]]:
        """(connections answered, failures by class)."""
        self._stop.set()
        self._thread.join(60)
        return sum(self.counts.values()), self.errors


def test_cleanup_is_refused_while_an_agent_serves_and_force_says_what_it_did(node: Node):
    agent = node.start(node.manifests("a", other=False))
    agent.wait_for_line("sync: applied revision")
    pins = node.pins()
    assert pins, "the agent pinned nothing"
    lock = lock_path(LOCK_DIR, node.pin_dir)
    assert lock.read_text().startswith(f"pid: {agent.proc.pid}\n")
    client = node.lab.pods["client"]

    refused = agent_cli(node.lab.node_ns, "cleanup", "--bpffs", str(node.pin_dir))
    assert refused.returncode == 1, refused
    assert refused.stdout == ""
    [line] = refused.stderr.splitlines()
    assert f"an agent runs on {node.pin_dir}: pid {agent.proc.pid} (started " in line, line
    assert line.endswith("nothing removed (stop the agent first, or --force)"), line
    # Nothing was touched: every pin is there, the agent and its Service keep serving.
    assert node.pins() == pins
    result = client.connect_many(WEB_IP, 80, "tcp", 20)
    assert result.errors == {} and set(result.counts) == {"be1", "be2"}, result
    assert agent.proc.poll() is None

    forced = agent_cli(node.lab.node_ns, "cleanup", "--bpffs", str(node.pin_dir), "--force")
    assert forced.returncode == 0, forced
    out = forced.stdout.splitlines()
    assert f"removed {len(pins)} pin(s) under {node.pin_dir}" in out[0], out
    assert out[-1] == (f"--force: removed while the agent (pid {agent.proc.pid}) still runs "
                       f"and holds {lock}; it puts back what it serves when it next checks "
                       "the dataplane"), out  # fmt: skip
    assert agent.proc.poll() is None and lock.exists()  # the agent still runs and holds it
    assert agent.stop() == 0
    assert not lock.exists()  # let go on a clean stop


@pytest.mark.slow
def test_a_second_agent_with_another_view_waits_and_writes_nothing(node: Node):
    first = node.start(node.manifests("a", other=True))
    first.wait_for_line("sync: applied revision")
    revision = first.state()["revision"]
    other = Connecting(node, OTHER_IP)
    try:
        second = node.start(node.manifests("b", other=False))
        waiting = second.lines[second.wait_for_line("another process holds the node's lock")]
        assert f"pid {first.proc.pid} (started " in waiting, waiting
        assert "writes nothing to the node until it holds the lock" in waiting, waiting
        started = time.monotonic()
        second.wait_for_line("still waiting for the node's lock", timeout=WAIT_S + 10)
        time.sleep(max(0.0, WAIT_S - (time.monotonic() - started)))
        answered, failed = other.stop()
    finally:
        other.stop()
    # Over several of the first agent's resyncs, not one connection to the Service only
    # it serves failed, and the waiting agent did nothing but wait.
    assert failed == Counter(), (failed, other.details[:5])
    assert answered >= 50 and set(other.counts) == {"be2"}, other.counts
    assert second.proc.poll() is None
    did = [line for line in second.lines if " agent.nodelock: " not in line]
    assert did == [], did  # no probe, compile, pin, server or sync: only the lock's lines
    assert first.state()["heldRevision"] == revision

    # The first stops: the second takes the lock and programs its own view, without other.
    assert first.stop() == 0
    second.wait_for_line("now holding the node's lock")
    second.wait_for_line("sync: applied revision")
    assert second.state()["heldRevision"] != revision
    web = node.lab.pods["client"].connect_many(WEB_IP, 80, "tcp", 10)
    assert web.errors == {} and set(web.counts) == {"be1", "be2"}, web
    gone = node.lab.pods["client"].connect_many(OTHER_IP, 80, "tcp", 1, timeout=0.5)
    assert gone.counts == Counter(), gone  # untranslated now: the lab blackholes it
    assert second.stop() == 0


# The slow apply: the Services of tests/kernel/killapply.py's state A, the apply paused
# PAUSE s after its first map write, so it outlasts the 10 s the stop used to wait.
SERVICES, ENDPOINTS = 60, 4
PAUSE = 12.0
AGENT_SIZES = MapSizes(services=1024, slots=4096, backends=1024, ct=4096, affinity=1024)


@pytest.mark.slow
def test_sigterm_during_a_slow_apply_waits_for_it_and_exits_0(node: Node):
    manifests = node.tmp / "cluster.json"
    objects = cluster_objects("A", SERVICES, ENDPOINTS)
    manifests.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    state = nodestate("A", SERVICES, ENDPOINTS)
    argv = [sys.executable, "-m", "tests.kernel.killapply", "run",
            "--pause", str(PAUSE),
            *run_argv(manifests, "node-a", "ebpf", "--bpffs", str(node.pin_dir))[4:]]  # fmt: skip
    agent = node.start(manifests, argv=argv)
    agent.wait_for_line(FIRST_SLOW_WRITE)
    signalled = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    assert agent.wait_exit(timeout=300) == 0, agent.log()
    waited = time.monotonic() - signalled
    log = agent.lines
    stopping = agent.wait_for_line("stopping: waiting for the apply of revision")
    applied = agent.wait_for_line("sync: applied revision")
    assert agent.wait_for_line("received SIGTERM") < stopping < applied, "\n".join(log)
    assert state.revision[:19] in log[applied], (state.revision, log[applied])
    assert waited > 10, f"the apply took only {waited:.1f} s: make it slower"
    # The state is in the maps whole, kbp_meta naming it: the apply was not cut.
    content, meta = read_maps(node.pin_dir)
    assert exact(content, meta, state.revision, expected(state, AGENT_SIZES)) == []
