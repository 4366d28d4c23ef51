"""`kube-bpf-proxy explain` against a running eBPF agent in the namespace lab: the backend
it names for a fixed source port is the one that answers a real connection from that
port; the dry runs leave every map byte for byte as they were; a refused and a dropped
Service are reported as such; stale maps are reported as a disagreement first.

Address plan (tests/lab/nodelab.py): node namespace = node-a; pods client 10.244.1.1 and
be1..be3 10.244.1.2-4 serving TCP 8080. Services: web 10.96.0.80:80 (be1..be3), empty
10.96.0.81:80 (no endpoints: refused), away 10.96.0.82:80 (internalTrafficPolicy Local,
its one endpoint on node-b: dropped).
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.dataplane.ebpf import abi
from agent.dataplane.ebpf.libbpf import Map
from agent.dataplane.ebpf.netlink import TcAttacher, run_in_netns
from tests.lab.nodelab import Lab

from ..conftest import BPFFS
from .agentproc import AgentProcess, cli, run_argv, service_manifest

pytestmark = pytest.mark.kernel

WEB, EMPTY, AWAY = "10.96.0.80", "10.96.0.81", "10.96.0.82"
SOURCE_PORTS = range(41001, 41013)
SCRATCH = "kbp_explain"  # explain's own scratch map: the only one a dry run writes


@contextmanager
def agent_lab(
    tmp_path: Path, dataplane: str, socket_hooks: bool = False
) -> Iterator[tuple[Lab, Path, Path, AgentProcess]]:
    """`socket_hooks`: the pods' processes in a cgroup of the lab's, where the agent
    attaches its socket hooks (--socket-lb all translates the pods' connect()s)."""
    pin_dir = BPFFS / f"kbp-test-explain-{os.getpid()}-{time.monotonic_ns()}"
    with Lab(cgroup=socket_hooks) as lab:
        lab.add_pod("client")
        backends = [lab.add_pod(name) for name in ("be1", "be2", "be3")]
        for pod in backends:
            pod.serve([8080], protos=("tcp",))
        manifests = tmp_path / "services.yaml"
        manifests.write_text(
            service_manifest("web", WEB, [p.ipv4 for p in backends])
            + service_manifest("empty", EMPTY, [])
            + service_manifest("away", AWAY, ["10.244.2.9"], node="node-b", itp="Local")
        )
        argv = run_argv(manifests, "node-a", dataplane, "--bpffs", str(pin_dir),
                        "--conntrack-tcp-timeout-time-wait", "5m")  # fmt: skip
        if socket_hooks:
            argv += ["--cgroup-root", str(lab.cgroup), "--socket-lb", "all"]
        agent = AgentProcess(lab.node_ns, argv, "node-a")
        try:
            agent.wait_for_line("sync: applied revision")
            yield lab, manifests, pin_dir, agent
        finally:
            agent.stop(signal.SIGKILL)
            cli(lab.node_ns, "cleanup", "--bpffs", str(pin_dir))
    assert not pin_dir.exists()


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[Lab, Path, Path, AgentProcess]]:
    with agent_lab(tmp_path, "ebpf") as found:
        yield found


@pytest.fixture
def setup_socket_hooks(tmp_path: Path) -> Iterator[tuple[Lab, Path, Path, AgentProcess]]:
    with agent_lab(tmp_path, "ebpf", socket_hooks=True) as found:
        yield found


@pytest.fixture
def setup_iptables(tmp_path: Path) -> Iterator[tuple[Lab, Path, Path, AgentProcess]]:
    with agent_lab(tmp_path, "iptables") as found:
        yield found


@pytest.fixture
def setup_nftables(tmp_path: Path) -> Iterator[tuple[Lab, Path, Path, AgentProcess]]:
    with agent_lab(tmp_path, "nftables") as found:
        yield found


def explain(lab: Lab, *args: str) -> dict:
    done = cli(lab.node_ns, "explain", *args, "-o", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def from_agent(agent: AgentProcess, pin_dir: Path) -> list[str]:
    address = agent.url("").removeprefix("http://")
    return ["--metrics-bind-address", address, "--bpffs", str(pin_dir)]


def snapshot(pin_dir: Path) -> dict[str, dict[bytes, bytes]]:
    """Every map's every entry (per-CPU values for all CPUs), but explain's scratch,
    socket storage (no dump; the dry runs never meet a socket hook) and kbp_ct_gate,
    which the agent's conntrack collector rewrites at every pass (a dry run's conntrack
    writes, which would set it, are counted instead of made: lib/maps.h)."""
    out = {}
    for name in abi.MAP_NAMES:
        if name in (SCRATCH, "kbp_ct_gate") or name in abi.SOCKET_STORAGE:
            continue
        with Map.pinned(str(pin_dir / abi.versioned(name))) as table:
            out[name] = dict(table.items())
    return out


def chosen_address(doc: dict) -> str:
    summary = doc["kernel"]["summary"]
    assert summary.startswith("to "), doc
    return summary.removeprefix("to ").split(" ", 1)[0]


def test_the_backend_named_is_the_one_that_answers_and_nothing_changes(setup) -> None:
    lab, _, pin_dir, agent = setup
    client = lab.pods["client"]
    before = snapshot(pin_dir)
    named = {}
    for port in SOURCE_PORTS:
        doc = explain(lab, *from_agent(agent, pin_dir), "--from", client.ipv4,
                      "--to", f"{WEB}:80/TCP", "--sport", str(port))  # fmt: skip
        assert doc["disagreements"] == [], doc
        assert doc["kernel"]["outcome"] == "backends", doc
        named[port] = chosen_address(doc)
        assert f"picks it for source port {port}" in doc["verdict"], doc
    after = snapshot(pin_dir)
    for name in before:
        assert after[name] == before[name], f"{name} changed under explain's dry runs"
    assert len(set(named.values())) > 1, f"every source port hashed alike: {named}"

    by_ip = {lab.pods[n].ipv4: n for n in ("be1", "be2", "be3")}
    for port, address in named.items():
        result = client.connect_many(WEB, 80, "tcp", 1, source_port=port)
        assert result.counts == {by_ip[address.split(":")[0]]: 1}, (port, address, result)


def _prog(*argv: str) -> dict:
    done = subprocess.run(["bpftool", "-j", "prog", "show", *argv], capture_output=True,
                          text=True, check=True)  # fmt: skip
    return json.loads(done.stdout)


def test_explain_runs_its_own_build_and_the_attached_programs_carry_no_dry_run(setup) -> None:
    lab, _, pin_dir, agent = setup
    pins = {p: pin_dir / abi.versioned(f"{p}_explain") for p in ("kbp_from_pod", "kbp_from_ext")}
    deadline = time.monotonic() + 90
    while not all(pin.exists() for pin in pins.values()):
        assert time.monotonic() < deadline, agent.log()
        time.sleep(0.2)
    with Map.pinned(str(pin_dir / abi.versioned(SCRATCH))) as scratch:
        scratch_id = scratch.info.id
    def attached() -> list:
        with TcAttacher() as tc:
            return tc.attached()

    ids = {a.prog_id for a in run_in_netns(lab.node_ns, attached)
           if a.name.startswith("kbp_from_pod")}  # fmt: skip
    assert ids
    for prog_id in ids:  # the programs that carry packets never touch explain's scratch
        assert scratch_id not in _prog("id", str(prog_id)).get("map_ids", [])
    for program, pin in pins.items():
        built = _prog("pinned", str(pin))
        assert built["name"] == program[:15] and built["id"] not in ids, built
        assert scratch_id in built["map_ids"], built
    # The dry run asks that build and changes nothing (the first test checks the maps).
    doc = explain(lab, *from_agent(agent, pin_dir), "--from", lab.pods["client"].ipv4,
                  "--to", f"{WEB}:80/TCP")  # fmt: skip
    assert doc["kernel"]["outcome"] == "backends" and doc["disagreements"] == [], doc


def test_an_agent_stopped_while_building_explains_programs_ends_the_compile(setup) -> None:
    """explain's build compiles in a child process after the first apply; an agent stopped
    meanwhile kills it rather than wait for the compile (a stop that waited for two
    compiles passed the 30 s the tests give a clean stop), leaves neither the child nor
    a half-pinned build behind, and explain then compiles the build itself."""
    lab, manifests, pin_dir, agent = setup
    assert agent.stop() == 0, agent.log()
    assert "explain's build of the programs pinned" not in agent.log()
    # The compile's flags name the pin directory: no process of ours still compiles for it.
    left = subprocess.run(["pgrep", "-f", f"KBP_PIN_DIR=.*{pin_dir.name}"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert left.stdout == "", left.stdout
    builds = [abi.versioned(f"{program}_explain") for program in ("kbp_from_pod", "kbp_from_ext")]
    built = [p.name for p in pin_dir.iterdir() if p.name.startswith(tuple(builds))]
    assert built == [], built
    doc = explain(lab, "--manifests", str(manifests), "--node", "node-a", "--bpffs", str(pin_dir),
                  "--from", lab.pods["client"].ipv4, "--to", f"{WEB}:80/TCP")  # fmt: skip
    assert doc["kernel"]["outcome"] == "backends" and doc["disagreements"] == [], doc


def test_refused_and_dropped_services_are_reported_as_the_kernel_does(setup) -> None:
    lab, _, pin_dir, agent = setup
    client = lab.pods["client"]
    refused = explain(lab, *from_agent(agent, pin_dir), "--from", client.ipv4,
                      "--to", f"{EMPTY}:80/TCP")  # fmt: skip
    assert refused["semantics"]["outcome"] == refused["kernel"]["outcome"] == "refused"
    assert refused["verdict"].startswith("refused: no endpoints"), refused
    assert "TCP RST" in refused["kernel"]["summary"]
    assert client.connect_many(EMPTY, 80, "tcp", 1).errors == {"refused": 1}

    dropped = explain(lab, *from_agent(agent, pin_dir), "--from", client.ipv4,
                      "--to", "default/away:http")  # fmt: skip
    assert dropped["semantics"]["outcome"] == dropped["kernel"]["outcome"] == "dropped"
    assert dropped["verdict"].startswith("dropped: internalTrafficPolicy Local"), dropped
    assert "no-backend" in dropped["kernel"]["summary"]
    assert dropped["disagreements"] == []
    assert client.connect_many(AWAY, 80, "tcp", 1, timeout=1).errors == {"timeout": 1}


def test_stale_maps_are_reported_first(setup) -> None:
    """The agent gone and the pins left behind, then changed under the NodeState: explain
    from the manifests says the maps disagree before anything else."""
    lab, manifests, pin_dir, agent = setup
    agent.stop(signal.SIGKILL)
    with Map.pinned(str(pin_dir / abi.versioned("kbp_meta"))) as meta:
        meta.update(struct.pack("=I", 0), bytes.fromhex("ab" * 32) + bytes(16))
    be1 = lab.pods["be1"].ipv4
    with Map.pinned(str(pin_dir / abi.versioned("kbp_backends"))) as backends:
        for key, value in backends.items():
            fields = abi.from_bytes("kbp_backend", value)
            if abi.get_addr(fields.addr, abi.const.KBP_FAMILY_IPV4) == be1:
                abi.set_addr(fields.addr, "10.244.1.250")
                backends.update(key, abi.to_bytes(fields))
    query = ["--manifests", str(manifests), "--node", "node-a", "--bpffs", str(pin_dir),
             "--from", lab.pods["client"].ipv4, "--to", f"{WEB}:80/TCP"]  # fmt: skip
    doc = explain(lab, *query)
    text = " | ".join(doc["disagreements"])
    assert "the maps hold revision sha256:abababab" in text, doc
    assert f"missing {be1}:8080" in text and "extra 10.244.1.250:8080" in text, doc
    assert doc["verdict"].endswith("[NodeState and kernel disagree: see above]")
    table = cli(lab.node_ns, "explain", *query).stdout
    assert table.splitlines()[2].startswith("DISAGREES:"), table


def test_iptables_explain_traces_the_live_rules(setup_iptables) -> None:
    lab, _, pin_dir, agent = setup_iptables
    client = lab.pods["client"]
    web = explain(lab, *from_agent(agent, pin_dir), "--from", client.ipv4,
                  "--to", f"{WEB}:80/TCP")  # fmt: skip
    assert web["disagreements"] == [], web
    assert web["kernel"]["dataplane"] == "iptables" and web["kernel"]["outcome"] == "backends"
    shares = web["kernel"]["endpoints"]
    assert set(shares) == {f"{lab.pods[n].ipv4}:8080" for n in ("be1", "be2", "be3")}, web
    assert all(abs(p - 1 / 3) < 0.01 for p in shares.values()), shares
    assert "at random per connection" in web["verdict"]
    for address, outcome in ((EMPTY, "refused"), (AWAY, "dropped")):
        doc = explain(lab, *from_agent(agent, pin_dir), "--from", client.ipv4,
                      "--to", f"{address}:80/TCP")  # fmt: skip
        assert doc["kernel"]["outcome"] == doc["semantics"]["outcome"] == outcome, doc
        assert doc["disagreements"] == [], doc


def test_nftables_explain_follows_the_live_table(setup_nftables) -> None:
    lab, _, pin_dir, agent = setup_nftables
    client = lab.pods["client"]
    web = explain(lab, *from_agent(agent, pin_dir), "--from", client.ipv4,
                  "--to", f"{WEB}:80/TCP")  # fmt: skip
    assert web["disagreements"] == [], web
    assert web["kernel"]["dataplane"] == "nftables" and web["kernel"]["outcome"] == "backends"
    shares = web["kernel"]["endpoints"]
    assert set(shares) == {f"{lab.pods[n].ipv4}:8080" for n in ("be1", "be2", "be3")}, web
    assert "flow hash" in web["kernel"]["lines"][1], web
    for address, outcome in ((EMPTY, "refused"), (AWAY, "dropped")):
        doc = explain(lab, *from_agent(agent, pin_dir), "--from", client.ipv4,
                      "--to", f"{address}:80/TCP")  # fmt: skip
        assert doc["kernel"]["outcome"] == doc["semantics"]["outcome"] == outcome, doc
        assert doc["disagreements"] == [], doc


def test_nftables_explain_names_the_endpoint_the_flow_hash_picks(setup_nftables) -> None:
    """With --sport, explain computes the rules' jhash for the 5-tuple: a real connection
    from that source port reaches the endpoint it names."""
    lab, _, pin_dir, agent = setup_nftables
    client = lab.pods["client"]
    by_ip = {lab.pods[n].ipv4: n for n in ("be1", "be2", "be3")}
    reached = set()
    for port in SOURCE_PORTS:
        bound = explain(lab, *from_agent(agent, pin_dir), "--from", client.ipv4,
                        "--to", f"{WEB}:80/TCP", "--sport", str(port))  # fmt: skip
        assert bound["disagreements"] == [], bound
        chosen = bound["kernel"]["chosen"]
        assert bound["verdict"].startswith(f"goes to {chosen} "), bound
        assert f"the flow hash picks it for source port {port}" in bound["verdict"], bound
        done = client.connect_many(WEB, 80, "tcp", 1, source_port=port)
        assert done.counts == {by_ip[chosen.split(":")[0]]: 1}, (port, bound, done)
        reached.add(chosen)
    assert len(reached) > 1, reached  # the ports spread over the endpoints


# Holds one TCP connection from a bound source port to a Service open until stdin closes;
# prints the backend's greeting (its pod name).
HOLD = """
import socket, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("0.0.0.0", {port}))
sock.connect(("{ip}", 80))
print(sock.recv(100).decode().strip(), flush=True)
sys.stdin.read()
"""


def test_a_pods_connect_is_explained_as_the_socket_hook_translates_it(setup_socket_hooks) -> None:
    """With the pods' sockets translated at connect(), explain says so: an unbound socket
    is balanced by its cookie; a bound port gets the flow hash's backend, which is the one
    a real connection from that port reaches; while a connection from that port holds the
    translated tuple, explain says a second one falls to tc, and a second one does work."""
    lab, _, pin_dir, agent = setup_socket_hooks
    client = lab.pods["client"]
    by_ip = {lab.pods[n].ipv4: n for n in ("be1", "be2", "be3")}
    query = [*from_agent(agent, pin_dir), "--from", client.ipv4, "--to", f"{WEB}:80/TCP"]
    unbound = explain(lab, *query)
    assert unbound["kernel"]["path"] == "socket hook", unbound
    assert "by its cookie" in unbound["kernel"]["summary"], unbound
    refused = explain(lab, *from_agent(agent, pin_dir), "--from", client.ipv4,
                      "--to", f"{EMPTY}:80/TCP")  # fmt: skip
    assert refused["kernel"]["outcome"] == "refused", refused
    assert "ECONNREFUSED" in refused["kernel"]["summary"], refused
    assert client.connect_many(EMPTY, 80, "tcp", 1).errors == {"refused": 1}

    port = SOURCE_PORTS[0]
    bound = explain(lab, *query, "--sport", str(port))
    assert bound["kernel"]["path"] == "socket hook", bound
    assert bound["disagreements"] == [], bound
    chosen = bound["kernel"]["summary"].split(" to ", 1)[1].split(" ", 1)[0]
    assert "picks it at connect() for source port" in bound["verdict"], bound

    holder = subprocess.Popen(client.argv([sys.executable, "-c", HOLD.format(port=port, ip=WEB)]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout is not None
        assert by_ip[chosen.split(":")[0]] == holder.stdout.readline().strip()
        taken = explain(lab, *query, "--sport", str(port))
        assert taken["kernel"]["path"] == "tc", taken
        assert taken["kernel"]["summary"].startswith("falls to tc: a TCP socket of the pod "
                                                     "(ESTABLISHED)"), taken  # fmt: skip
        second = client.connect_many(WEB, 80, "tcp", 1, source_port=port)
        assert second.counts == {by_ip[chosen.split(":")[0]]: 1}, second
    finally:
        holder.communicate(timeout=10)
