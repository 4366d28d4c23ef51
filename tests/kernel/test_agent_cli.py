"""`kube-bpf-proxy run --dataplane ebpf` as a user runs it: inside a lab's node namespace,
on manifest files, then `inspect`, `bpftool`, a restart under a live connection, a file
change, SIGTERM leaving the dataplane in place, and `cleanup` removing it.

Address plan (tests/lab/nodelab.py): node namespace = node-a; pods client 10.244.1.1,
be1 10.244.1.2, be2 10.244.1.3 serving TCP/UDP 8080; Service web 10.96.0.80:80.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.dataplane.ebpf import abi
from tests.lab.nodelab import Lab

from ..conftest import BPFFS
from .agentproc import AgentProcess, run_argv, service_manifest
from .agentproc import cli as agent_cli
from .tchooks import our_tc_programs

CLUSTER_IP = "10.96.0.80"

def write_manifest(path: Path, *ips: str) -> None:
    path.write_text(service_manifest("web", CLUSTER_IP, ips))


class Agent(AgentProcess):
    """`kube-bpf-proxy run` as node-a in the lab's node namespace. Every agent started is
    remembered, so the fixture kills those a failing test left."""

    started: list[Agent] = []

    def __init__(self, lab: Lab, manifests: Path, pin_dir: Path, dataplane: str = "ebpf") -> None:
        # Closed test flows stay in conntrack for inspect to show (the collector would
        # remove them after the default 10 s).
        argv = run_argv(manifests, "node-a", dataplane, "--bpffs", str(pin_dir),
                        "--conntrack-tcp-timeout-time-wait", "5m")  # fmt: skip
        super().__init__(lab.node_ns, argv, "node-a")
        Agent.started.append(self)


def cli(lab: Lab, *args: str) -> subprocess.CompletedProcess:
    """`kube-bpf-proxy ARGS` in the lab's node namespace."""
    return agent_cli(lab.node_ns, *args)


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Lab, Path, Path]]:
    pin_dir = BPFFS / f"kbp-test-cli-{os.getpid()}-{time.monotonic_ns()}"
    with Lab() as lab:
        lab.add_pod("client")
        for name in ("be1", "be2"):
            lab.add_pod(name).serve([8080])
        manifests = tmp_path / "web.yaml"
        write_manifest(manifests, lab.pods["be1"].ipv4, lab.pods["be2"].ipv4)
        try:
            yield lab, manifests, pin_dir
        finally:
            while Agent.started:
                Agent.started.pop().stop(signal.SIGKILL)
            cli(lab, "cleanup", "--bpffs", str(pin_dir))
    assert not pin_dir.exists()


def test_run_balances_and_inspect_and_bpftool_show_the_maps(setup) -> None:
    lab, manifests, pin_dir = setup
    agent = Agent(lab, manifests, pin_dir)
    try:
        agent.wait_for_line("sync: applied revision")
        result = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 30)
        assert result.errors == {} and set(result.counts) == {"be1", "be2"}, result

        table = cli(lab, "inspect", "--bpffs", str(pin_dir))
        assert table.returncode == 0, table.stderr
        assert f"{CLUSTER_IP}:80/TCP" in table.stdout and "ClusterIP" in table.stdout
        for pod in ("be1", "be2"):
            assert f"{lab.pods[pod].ipv4}:8080" in table.stdout, table.stdout

        rows = json.loads(cli(lab, "inspect", "conntrack", "-o", "json", "--bpffs",
                              str(pin_dir)).stdout)  # fmt: skip
        assert any(r["destination"] == f"{CLUSTER_IP}:80" for r in rows), rows
        # closed connections, with the time they have left under inspect's own timeouts
        closed = [r for r in rows if r["state"] == "time-wait"]
        assert closed and all(0 <= r["secondsLeft"] <= 10 for r in closed), rows
        longer = json.loads(cli(lab, "inspect", "conntrack", "-o", "json", "--bpffs", str(pin_dir),
                                "--conntrack-tcp-timeout-time-wait", "5m").stdout)  # fmt: skip
        assert all(r["secondsLeft"] > 200 for r in longer if r["state"] == "time-wait"), longer
        counters = json.loads(cli(lab, "inspect", "counters", "-o", "json", "--bpffs",
                                  str(pin_dir)).stdout)  # fmt: skip
        assert any(r.get("newFlows", 0) >= 30 for r in counters), counters

        dump = subprocess.run(
            ["bpftool", "--json", "map", "dump", "pinned",
             str(pin_dir / abi.versioned("kbp_services"))],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        [entry] = json.loads(dump.stdout)
        assert {"service_id", "set_id", "count", "flags"} <= set(entry["formatted"]["value"])
    finally:
        assert agent.stop() == 0


def test_connection_survives_an_agent_restart(setup) -> None:
    lab, manifests, pin_dir = setup
    first = Agent(lab, manifests, pin_dir)
    first.wait_for_line("sync: applied revision")
    stream = lab.pods["client"].stream(CLUSTER_IP, 80)
    try:
        assert stream.backend in ("be1", "be2")
        ok, _ = stream.check()
        first.stop(signal.SIGKILL)  # no goodbye: the kernel keeps everything
        ok_dead, error = stream.wait_for(ok + 10)
        assert error is None and ok_dead >= ok + 10, "the connection needs no agent"

        second = Agent(lab, manifests, pin_dir)
        try:
            second.wait_for_line("serving metrics")
            time.sleep(1.0)  # the restarted agent has synced and replaced the programs
            _, error = stream.wait_for(ok_dead + 10)
            assert error is None, f"the connection broke across the restart: {error}"
            assert not any("applied revision" in line for line in second.lines), (
                "the restarted agent rewrote maps that already matched:\n" + second.log()
            )
            new = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 20)
            assert new.errors == {} and set(new.counts) == {"be1", "be2"}, new
        finally:
            assert second.stop() == 0
    finally:
        _, error = stream.close()
    assert error is None


def test_file_changes_are_applied_and_sigterm_leaves_the_dataplane(setup) -> None:
    lab, manifests, pin_dir = setup
    agent = Agent(lab, manifests, pin_dir)
    try:
        first = agent.wait_for_line("sync: applied revision")
        write_manifest(manifests, lab.pods["be2"].ipv4)
        agent.wait_for_line("sync: applied revision", after=first + 1)
        result = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 20)
        assert result.counts == {"be2": 20}, result
        # explain's build, compiled after the first apply (a stop would end the compile)
        agent.wait_for_line("explain's build of the programs pinned")
    finally:
        assert agent.stop() == 0
    # Stopped: Services keep working, as with kube-proxy's rules.
    after = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 5)
    assert after.counts == {"be2": 5}, after
    hooks = our_tc_programs(lab.node_ns, lab.pods["client"].host_ifname, "ingress")
    assert [hook.rpartition(":")[2] for hook in hooks] == ["kbp_from_pod"], hooks

    # The maps' pins, explain's build of two programs (the agent pinned it after its
    # first apply), and with tcx one per tc link (each pod interface's two hooks).
    links = [pin for pin in pin_dir.iterdir() if pin.name.startswith("kbp_tcx_")]
    assert len(links) == (2 * len(lab.pods) if "tcx" in hooks[0] else 0), links
    explained = [pin_dir / abi.versioned(f"{p}_explain") for p in ("kbp_from_pod", "kbp_from_ext")]
    assert all(pin.exists() for pin in explained), sorted(pin_dir.iterdir())
    done = cli(lab, "cleanup", "--bpffs", str(pin_dir))
    assert done.returncode == 0, done.stderr
    pins = len(abi.MAP_NAMES) + len(explained) + len(links)
    assert f"removed {pins} pin(s)" in done.stdout, done.stdout
    assert not pin_dir.exists()
    assert our_tc_programs(lab.node_ns, lab.pods["client"].host_ifname) == []
    gone = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 1, timeout=0.5)
    assert gone.errors == {"timeout": 1}, gone  # untranslated: the lab blackholes it


def test_ebpf_dataplane_that_cannot_start_is_a_clear_error(setup, tmp_path: Path) -> None:
    lab, manifests, _ = setup
    not_bpffs = tmp_path / "plain-dir"  # tmpfs, not bpffs: pinning fails
    agent = Agent(lab, manifests, not_bpffs)
    assert agent.wait_exit() == 1
    text = agent.log()
    assert "cannot start" in text and "--dataplane ebpf" in text, text
