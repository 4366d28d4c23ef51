"""The watchable node-local state (`/state?watch=true`, agent/api/watch.py) and its client
(agent/stateclient.py), over real HTTP on loopback and a real unix socket: revisions in
order, slow readers, restarts, limits, changes, gzip."""

from __future__ import annotations

import gzip
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.api import AgentStatus, MetricsServer
from agent.api.server import StateSocketServer
from agent.api.watch import HISTORY, RENDERED, StateHub
from agent.metrics import Metrics
from agent.model.compile import CompileOptions, Compiler
from agent.model.decode import decode_object
from agent.model.types import ClusterState
from agent.stateclient import Revision, follow

from ..builders import default_nodes, make_endpoint, make_service, make_slice, state_of

pytestmark = pytest.mark.usefixtures("no_thread_leak")  # tests/unit/conftest.py


class Cluster:
    """A ClusterState with `services` Services that `step(i)` changes (Service s-0's
    endpoint), compiled incrementally as the agent does, so each NodeState carries the
    compiler's Changes."""

    def __init__(self, services: int = 2) -> None:
        objects = [*default_nodes()]
        for n in range(services):
            objects.append(make_service(name=f"s-{n}", mutate=_cluster_ip(n)))
            objects.append(make_slice(name=f"s-{n}-1", service=f"s-{n}",
                                      endpoints=[make_endpoint(f"10.244.9.{n % 250 + 1}",
                                                               "node-a")]))  # fmt: skip
        self.state: ClusterState = state_of(*objects)
        self.compiler = Compiler("node-a", CompileOptions())
        self.node_state = self.compiler.update(self.state)

    def step(self, i: int) -> None:
        ip = f"10.244.{100 + i // 250}.{i % 250 + 1}"
        obj = make_slice(name="s-0-1", service="s-0", endpoints=[make_endpoint(ip, "node-a")])
        self.state.set_slice(decode_object(obj).value)  # type: ignore[arg-type]
        self.node_state = self.compiler.update(self.state)

    def drop(self, name: str) -> None:
        self.state.delete_service("default", name)
        self.node_state = self.compiler.update(self.state)


def _cluster_ip(n: int):
    def mutate(obj: dict) -> None:
        ip = f"10.96.{n // 250}.{n % 250 + 1}"
        obj["spec"].update(clusterIP=ip, clusterIPs=[ip])

    return mutate


@pytest.fixture
def status() -> AgentStatus:
    return AgentStatus(dataplane="none")


@pytest.fixture
def hub(status: AgentStatus) -> Iterator[StateHub]:
    def held_and_status() -> tuple[str | None, dict]:
        snap = status.snapshot()
        return snap.held_revision, snap.to_dict()

    made = StateHub(held_and_status, max_watchers=110)
    status.subscribe(made.publish)
    yield made
    made.close()


@pytest.fixture
def server(status: AgentStatus, hub: StateHub) -> Iterator[MetricsServer]:
    with MetricsServer("127.0.0.1:0", status, Metrics(), hub) as made:
        yield made


class Follower:
    """follow() on a thread, its revisions collected; `wait_for(revision)`."""

    def __init__(self, **kwargs) -> None:
        self.revisions: list[Revision] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, kwargs=kwargs, daemon=True)
        self._thread.start()

    def _run(self, **kwargs) -> None:
        for rev in follow(timeout=0.5, retry=0.05, max_retry=0.2, stop=self._stop, **kwargs):
            with self._cond:
                self.revisions.append(rev)
                self._cond.notify_all()

    def wait_for(self, revision: str, timeout: float = 10.0) -> Revision:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: bool(self.revisions) and self.revisions[-1].revision == revision, timeout
            )
            last = [r.revision[:19] for r in self.revisions[-3:]]
            assert ok, f"never saw {revision[:19]}; last {last}"
            return self.revisions[-1]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()


def raw_watch(
    url: str, query: str = "", headers: str = "", rcvbuf: int | None = None
) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(5)
    sock.connect((host, int(port)))
    sock.sendall(f"GET /state?watch=true{query} HTTP/1.1\r\nHost: x\r\n{headers}\r\n".encode())
    return sock


def read_head(sock: socket.socket) -> tuple[str, bytes]:
    """(the response head, what came after it)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head.decode(), rest


class Lines:
    """The stream's lines after its head (`rest`: what read_head read past it)."""

    def __init__(self, sock: socket.socket, rest: bytes) -> None:
        self.pending = rest
        self.file = sock.makefile("rb")

    def readline(self) -> bytes:
        if b"\n" not in self.pending:
            self.pending += self.file.readline()
        line, _, self.pending = self.pending.partition(b"\n")
        return line + b"\n"


@pytest.mark.parametrize("changes", [False, True], ids=["full", "changes"])
def test_a_client_follows_a_thousand_revisions_in_order(
    status: AgentStatus, hub: StateHub, server: MetricsServer, changes: bool
) -> None:
    cluster = Cluster(services=20)
    status.set_node_state(cluster.node_state)
    follower = Follower(url=server.url, changes=changes)
    expected = [cluster.node_state.revision]
    follower.wait_for(expected[-1])
    for i in range(1000):
        cluster.step(i)
        status.set_node_state(cluster.node_state)
        expected.append(cluster.node_state.revision)
        last = follower.wait_for(expected[-1])
    assert [r.revision for r in follower.revisions] == expected
    assert not any(r.restarted for r in follower.revisions)
    # the document the client keeps is the NodeState's, whether it came whole or in changes
    assert last.document["services"] == [e.to_dict() for e in cluster.node_state.services]
    if changes:
        assert all(r.changed == [("default", "s-0")] for r in follower.revisions[1:])
    # nothing grows with the number of revisions
    lines, links = hub.held()
    assert lines <= RENDERED and links <= HISTORY
    follower.stop()


def test_a_reader_that_sleeps_gets_the_latest_revision_not_a_backlog(
    status: AgentStatus, hub: StateHub, server: MetricsServer
) -> None:
    # Documents of ~300 KB, a reader with a 4 KB receive buffer: after the first lines fill
    # the buffers, the server writes nothing more until the reader takes them.
    cluster = Cluster(services=400)
    status.set_node_state(cluster.node_state)
    sock = raw_watch(server.url, rcvbuf=4096)
    with sock:
        reader = Lines(sock, read_head(sock)[1])
        first = json.loads(reader.readline())
        assert first["revision"] == cluster.node_state.revision
        for i in range(100):  # the reader sleeps through 100 revisions
            cluster.step(i)
            status.set_node_state(cluster.node_state)
        time.sleep(0.5)
        got = []
        while True:
            doc = json.loads(reader.readline())
            got.append(doc["revision"])
            if doc["revision"] == cluster.node_state.revision:
                break
    assert len(got) < 10, f"{len(got)} documents queued for a slow reader"


def test_the_first_line_waits_when_the_client_holds_the_current_revision(
    status: AgentStatus, hub: StateHub, server: MetricsServer
) -> None:
    cluster = Cluster()
    status.set_node_state(cluster.node_state)
    current = cluster.node_state.revision
    with raw_watch(server.url, f"&revision={current}&instance={hub.instance}") as sock:
        head, rest = read_head(sock)
        assert "200 OK" in head and "application/x-ndjson" in head and rest == b""
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):
            sock.recv(100)
        cluster.step(1)
        status.set_node_state(cluster.node_state)
        sock.settimeout(5)
        line = Lines(sock, b"").readline()
    assert json.loads(line)["revision"] == cluster.node_state.revision
    # another instance's revision, even the same one, gets the full state at once
    with raw_watch(server.url, f"&revision={cluster.node_state.revision}&instance=old") as sock:
        doc = json.loads(Lines(sock, read_head(sock)[1]).readline())
    assert doc["kind"] == "NodeState" and doc["instance"] == hub.instance


def test_changes_name_what_changed_and_what_went(
    status: AgentStatus, hub: StateHub, server: MetricsServer
) -> None:
    cluster = Cluster(services=3)
    status.set_node_state(cluster.node_state)
    with raw_watch(server.url, "&changes=true") as sock:
        reader = Lines(sock, read_head(sock)[1])
        full = json.loads(reader.readline())
        assert full["kind"] == "NodeState" and len(full["services"]) == 3
        base = cluster.node_state.revision
        cluster.drop("s-2")
        status.set_node_state(cluster.node_state)
        delta = json.loads(reader.readline())
    assert delta["kind"] == "NodeStateChanges"
    assert (delta["base"], delta["revision"]) == (base, cluster.node_state.revision)
    assert delta["services"] == [] and delta["removed"] == [{"namespace": "default", "name": "s-2"}]
    assert delta["instance"] == hub.instance and "status" in delta


def test_a_restarted_agent_is_a_new_instance(tmp_path: Path) -> None:
    """Two agents' hubs one after the other behind one unix socket path (a restart): the
    client reconnects by itself and says the state comes from a new instance."""
    path = str(tmp_path / "state.sock")
    cluster = Cluster()
    first = AgentStatus(dataplane="none")
    hub1 = StateHub(lambda: (None, {}))
    first.subscribe(hub1.publish)
    first.set_node_state(cluster.node_state)
    server1 = StateSocketServer(path, first, hub1)
    follower = Follower(socket_path=path)
    try:
        assert follower.wait_for(cluster.node_state.revision).instance == hub1.instance
        server1.close()
        hub1.close()
        second = AgentStatus(dataplane="none")
        hub2 = StateHub(lambda: (None, {}))
        second.subscribe(hub2.publish)
        second.set_node_state(cluster.node_state)  # the same revision, another instance
        with StateSocketServer(path, second, hub2):
            deadline = time.monotonic() + 10
            while len(follower.revisions) < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            again = follower.revisions[-1]
            assert again.instance == hub2.instance and again.restarted
            assert again.revision == cluster.node_state.revision
            follower.stop()
        hub2.close()
    finally:
        server1.close()
        hub1.close()


def test_the_state_socket_is_for_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "state.sock"
    path.write_text("not a socket")
    status = AgentStatus(dataplane="none")
    with pytest.raises(FileExistsError):
        StateSocketServer(str(path), status, None)
    path.unlink()
    with StateSocketServer(str(path), status, None):
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600


def test_a_hundred_watchers_and_no_more_than_the_limit(
    status: AgentStatus, hub: StateHub, server: MetricsServer
) -> None:
    cluster = Cluster()
    status.set_node_state(cluster.node_state)
    socks = []
    try:
        for _ in range(hub.max_watchers):
            sock = raw_watch(server.url)
            socks.append((sock, Lines(sock, read_head(sock)[1])))
        with raw_watch(server.url) as refused:
            head, _ = read_head(refused)
            assert head.startswith("HTTP/1.1 429"), head
        cluster.step(1)
        status.set_node_state(cluster.node_state)
        for _sock, reader in socks[:100]:  # every one of them gets the new revision
            while (doc := json.loads(reader.readline()))["revision"] != cluster.node_state.revision:
                pass
            assert doc["instance"] == hub.instance
    finally:
        for sock, reader in socks:
            reader.file.close()  # the socket's file object holds it open too
            sock.close()
    deadline = time.monotonic() + 5
    while hub.watchers and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hub.watchers == 0


def test_a_gzip_watch_sends_one_member_per_revision(
    status: AgentStatus, hub: StateHub, server: MetricsServer
) -> None:
    cluster = Cluster()
    status.set_node_state(cluster.node_state)
    with raw_watch(server.url, headers="Accept-Encoding: gzip\r\n") as sock:
        head, data = read_head(sock)
        assert "Content-Encoding: gzip" in head
        while not complete(data, 1):
            data += sock.recv(65536)
        cluster.step(1)
        status.set_node_state(cluster.node_state)
        while not complete(data, 2):
            data += sock.recv(65536)
    first, second = (json.loads(line) for line in gzip.decompress(data).splitlines())
    assert second["revision"] == cluster.node_state.revision != first["revision"]


def complete(data: bytes, lines: int) -> bool:
    """Does `data` hold `lines` whole gzip members (lines)?"""
    try:
        return len(gzip.decompress(data).splitlines()) >= lines
    except (EOFError, OSError):  # a member cut short, or not even its header yet
        return False


# --- a real agent process ---------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def write_manifests(path: Path, services: int) -> None:
    objects = [*default_nodes()]
    for n in range(services):
        objects.append(make_service(name=f"web-{n}", mutate=_cluster_ip(n)))
        objects.append(make_slice(name=f"web-{n}-1", service=f"web-{n}",
                                  endpoints=[make_endpoint("10.244.1.5", "node-a")]))  # fmt: skip
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    tmp.replace(path)


def start_agent(manifests: Path, sock: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "agent", "run", "--manifests", str(manifests),
            "--node", "node-a", "--dataplane", "none", "--state-socket", str(sock),
            "--metrics-bind-address", "127.0.0.1:0",
            "--healthz-bind-address", "127.0.0.1:0"]  # fmt: skip
    process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 30
    while not sock.exists():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "the agent made no state socket in 30 s"
        time.sleep(0.05)
    return process


def stop_agent(process: subprocess.Popen[str]) -> None:
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_an_agent_serves_follow_and_the_hosts_example_and_a_restart_is_seen(
    tmp_path: Path,
) -> None:
    manifests, sock, hosts = tmp_path / "cluster.json", tmp_path / "state.sock", tmp_path / "hosts"
    write_manifests(manifests, 2)
    agent = start_agent(manifests, sock)
    follower = None
    try:
        printed = subprocess.run(
            [sys.executable, "-m", "agent", "follow", "--state-socket", str(sock), "--count", "1"],
            cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        assert printed.startswith("revision sha256:") and "services 2 entries 2" in printed
        subprocess.run(
            [sys.executable, str(ROOT / "examples/consumers/hosts.py"), "--socket", str(sock),
             "--out", str(hosts), "--count", "1"],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        lines = [line.split() for line in hosts.read_text().splitlines()[1:]]
        assert lines == [["10.96.0.1", "web-0.default.svc.cluster.local"],
                         ["10.96.0.2", "web-1.default.svc.cluster.local"]]  # fmt: skip

        follower = Follower(socket_path=str(sock), changes=True)
        deadline = time.monotonic() + 30
        while not follower.revisions and time.monotonic() < deadline:
            time.sleep(0.05)
        first = follower.revisions[0]
        write_manifests(manifests, 3)  # the agent sees the file change: a new revision
        while len(follower.revisions) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        second = follower.revisions[1]
        assert second.changed == [("default", "web-2")] and not second.restarted
        assert len(second.document["services"]) == 3
        stop_agent(agent)
        sock.unlink(missing_ok=True)
        agent = start_agent(manifests, sock)
        while len(follower.revisions) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        third = follower.revisions[2]
        assert third.restarted and third.instance != first.instance
        assert third.revision == second.revision  # the same state, from a new agent
    finally:
        if follower is not None:
            follower.stop()
        stop_agent(agent)
