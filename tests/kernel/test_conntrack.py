"""Conntrack under pressure, on both dataplanes, with real sockets: idle connections that
outlive a conntrack map far too small for the traffic around them, one client port used
for two Services that share their only backend, and a flow whose entries were deleted.

Address plan (tests/lab/nodelab.py, as tests/kernel/test_dataplane.py): one node namespace
with pods client1 10.244.1.1, be1 10.244.1.2, be2 10.244.1.3, be3 10.244.1.4, every
backend serving TCP on 8080 (the greeting is its pod name, then it echoes lines).
Services get fresh ClusterIPs 10.96.0.x on port 80. The eBPF dataplane's conntrack map
holds 2048 entries (1024 flows); the iptables dataplane uses the kernel's conntrack.
"""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from agent.dataplane.ebpf.abi import const
from agent.dataplane.ebpf.maps import MapSizes
from agent.lab.toolkit import PODCLIENT, in_netns
from tests.lab.kit import read_line, stop_process

from .test_dataplane import (
    BACKENDS,
    DATAPLANES,
    NETFILTER,
    Env,
    backends,
    lab_env,
    not_on,
    service,
)

pytestmark = pytest.mark.kernel

CT_ENTRIES = 2048


@pytest.fixture(scope="module", params=DATAPLANES)
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    sizes = MapSizes(4096, 65536, 4096, CT_ENTRIES, 1024)
    with lab_env(request.param, ("client1",), ("tcp",), "kbp-test-ct", sizes) as made:
        yield made


class IdleClient:
    """podclient.py idle: n connections that answered once and then sit idle until
    resume() has each send a line."""

    def __init__(self, env: Env, ip: str, n: int) -> None:
        client = [sys.executable, str(PODCLIENT), "idle", ip, "80", "-n", str(n)]
        argv = in_netns(env.pod("client1").ns, client)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            line = read_line(self.proc, timeout=30)
            opened = json.loads(line)
            self.backends: list[str] = opened["backends"]
            self.ports: list[int] = opened["ports"]
        except Exception:
            stop_process(self.proc)
            raise

    def resume(self) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(read_line(self.proc, timeout=60))

    def close(self) -> None:
        stop_process(self.proc)


def held_flows(env: Env, ports: list[int]) -> int:
    """How many of the flows from these client ports still have their forward entry."""
    table = env.dataplane.programs.map("kbp_ct")  # type: ignore[union-attr]
    stored = table.keys()
    forward = [key for key in stored if key[38] == 0]
    return sum(int.from_bytes(key[32:34], "big") in ports for key in forward)


def test_idle_connections_survive_thousands_of_short_ones(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    # 20 idle connections, then 3,000 short ones through a 2048-entry map: every idle
    # connection's entries are evicted on eBPF, and its next segment must still reach
    # its backend (the flow hash picks it again); iptables keeps them in its conntrack.
    # On eBPF the next sweep says that live flows lost their entries, and the fill ratio
    # it reports is what the map holds.
    objects, ip4, _ = service(env, "idle", backends(env, *BACKENDS))
    env.program(*objects)
    idle = IdleClient(env, ip4, 20)
    try:
        assert set(idle.backends) <= set(BACKENDS)
        short = env.pod("client1").connect_many(ip4, 80, "tcp", 3000, timeout=5.0)
        assert short.errors == {}, short.details
        assert short.answered == 3000
        evicted_kept = held_flows(env, idle.ports) if env.kind == "ebpf" else 0
        after = idle.resume()
    finally:
        idle.close()
    assert after["echoed"] == 20, after
    if env.kind == "ebpf":
        collector = env.dataplane.conntrack  # type: ignore[union-attr]
        with caplog.at_level(logging.WARNING, logger="agent.dataplane.ebpf.conntrack"):
            report = collector.run_once()
        # every idle flow whose entries were gone sent a segment that found none
        lost = collector.lost_total()
        assert lost >= 20 - evicted_kept, (lost, evicted_kept)
        warned = any("evicted live flows" in r.getMessage() for r in caplog.records)
        assert warned == (lost > 0)
        held = len(collector.table.keys())
        assert collector.fill_ratio() == pytest.approx(held / CT_ENTRIES, abs=0.01)
        assert 0 < report.entries <= CT_ENTRIES


def test_one_client_port_for_two_services_sharing_their_only_backend(env: Env) -> None:
    # Linux hands one ephemeral port to connections with different destinations; both
    # Services translate to be1:8080, so without a remapped port the two flows would be
    # one tuple at the backend.
    first, ip_a, _ = service(env, "pair-a", backends(env, "be1"))
    second, ip_b, _ = service(env, "pair-b", backends(env, "be1"))
    env.program(*first, *second)
    out = env.pod("client1").run(sys.executable, str(PODCLIENT), "pair", ip_a, ip_b, "80",
                                 "-n", "20", timeout=120)  # fmt: skip
    report = json.loads(out.strip().splitlines()[-1])
    assert report["pairs"] == 20, report


@not_on(NETFILTER, "deletes eBPF conntrack entries by hand (kbp_ct)")
def test_a_connection_whose_entries_were_deleted_keeps_its_backend(env: Env) -> None:
    objects, ip4, _ = service(env, "recover", backends(env, *BACKENDS))
    env.program(*objects)
    table = env.dataplane.programs.map("kbp_ct")  # type: ignore[union-attr]
    # The module's earlier tests leave reply entries of closed flows to other frontends
    # (no collector runs here); a new connection whose port meets one is remapped as a
    # clash, and a remapped flow cannot be re-created by the hash alone (its backend
    # knows the remapped port). That happened to 1-2 of 12 connections in full runs.
    stale = table.keys()  # a list read from the kernel
    for key in stale:
        table.delete(key)
    idle = IdleClient(env, ip4, 12)
    try:
        assert len(set(idle.backends)) > 1, idle.backends  # spread, so moving would show
        time.sleep(1.0)  # let the client's delayed ACKs land: only its next segment counts
        stored = table.keys()
        for key in stored:
            table.delete(key)
        assert table.keys() == []
        after = idle.resume()
    finally:
        idle.close()
    assert after["echoed"] == 12, after


def test_a_closed_flows_tuple_is_taken_over_not_remapped(env: Env) -> None:
    # One client port: a connection to one Service closed with FINs both ways, then a
    # connection to the other Service, which shares the only backend, so both flows have
    # the same tuple at the backend. The first flow's entries are still there (no sweep
    # runs here), but it is closed: the second takes its tuple over with the client's own
    # port, as netfilter lets a SYN take over a TIME_WAIT tuple. Remapping it would work
    # too, but needlessly, and a port range full of closed flows would refuse it.
    first, ip_a, _ = service(env, "reuse-a", backends(env, "be1"))
    second, ip_b, _ = service(env, "reuse-b", backends(env, "be1"))
    env.program(*first, *second)
    before = env.dataplane.conntrack.remapped_total() if env.kind == "ebpf" else 0  # type: ignore[union-attr]
    out = env.pod("client1").run(sys.executable, str(PODCLIENT), "reuse", ip_a, ip_b, "80",
                                 "-n", "10", timeout=120)  # fmt: skip
    report = json.loads(out.strip().splitlines()[-1])
    assert report["reused"] == 10, report
    if env.kind == "ebpf":
        assert env.dataplane.conntrack.remapped_total() == before  # type: ignore[union-attr]


@not_on(NETFILTER, "deletes eBPF conntrack entries by hand (kbp_ct)")
@pytest.mark.parametrize("order", ["remapped-first", "remapped-last"])
def test_a_remapped_connection_whose_entries_were_deleted_keeps_its_port(
    env: Env, order: str
) -> None:
    # A pair of connections from one client port to two Services sharing their only
    # backend: the second is remapped. Then every kbp_ct entry goes (both flows lost, as
    # under LRU pressure). Whichever flow sends first, each must be written again with
    # the port its backend knows it by: the client's own for the first, the remapped one
    # (kept in kbp_ct_remap) for the second, even once no clash is left to detect.
    first, ip_a, _ = service(env, f"lost-a-{order}", backends(env, "be1"))
    second, ip_b, _ = service(env, f"lost-b-{order}", backends(env, "be1"))
    env.program(*first, *second)
    collector = env.dataplane.conntrack  # type: ignore[union-attr]
    table = collector.table
    remapped, lost = collector.remapped_total(), collector.lost_total()
    pairs = 3
    argv = [
        sys.executable,
        str(PODCLIENT),
        "pair",
        ip_a,
        ip_b,
        "80",
        "-n",
        str(pairs),
        "--pause",
        "--first-port",
        "22000" if order == "remapped-first" else "22100",
    ]
    if order == "remapped-first":
        argv.append("--second-first")
    proc = subprocess.Popen(in_netns(env.pod("client1").ns, argv), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for _ in range(pairs):
            json.loads(read_line(proc, timeout=30))  # {"opened": port}
            time.sleep(1.0)  # let the client's delayed ACKs land: only the echo counts
            stored = table.keys()  # a list read from the kernel
            for key in stored:
                table.delete(key)
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        report = json.loads(read_line(proc, timeout=60))
    finally:
        stop_process(proc)
    assert report["pairs"] == pairs, report
    assert collector.remapped_total() - remapped >= pairs
    assert collector.lost_total() - lost >= 2 * pairs  # every flow found no entry


# A server and a client that the test drives line by line over their stdin, so that the
# server can speak first. The server (port SPARE_PORT) greets each connection, echoes what
# it reads, and sends "pushed" on its i-th connection when told "push i". The client
# opens one connection per address, all from one source port (Linux lets a bound port
# connect to different destinations), and prints what its i-th connection reads
# ("read i") or the echo of what it sends ("send i <text>").
SPARE_PORT = 9090
PUSH_SERVER = f"""
import socket, sys, threading
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("0.0.0.0", {SPARE_PORT}))
listener.listen(8)
print("ready", flush=True)
conns = []
def echo(conn):
    while data := conn.recv(65536):
        conn.sendall(data)
def accept():
    while True:
        conn, _ = listener.accept()
        conns.append(conn)
        conn.sendall(b"hello\\n")
        threading.Thread(target=echo, args=(conn,), daemon=True).start()
threading.Thread(target=accept, daemon=True).start()
for line in sys.stdin:
    conns[int(line.split()[1])].sendall(b"pushed\\n")
    print("pushed", flush=True)
"""
PUSH_CLIENT = """
import socket, sys
socks, files = [], []
for ip in sys.argv[2:]:
    sock = socket.socket()
    sock.settimeout(10)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("0.0.0.0", int(sys.argv[1])))
    sock.connect((ip, 80))
    socks.append(sock)
    files.append(sock.makefile("rb"))
    assert files[-1].readline() == b"hello\\n"
print("connected", flush=True)
for line in sys.stdin:
    words = line.split(" ", 2)
    i = int(words[1])
    try:
        if words[0] == "send":
            socks[i].sendall(words[2].encode())
        print(files[i].readline().decode().strip() or "eof", flush=True)
    except OSError as exc:
        print("error", exc, flush=True)
"""


@not_on(NETFILTER, "deletes eBPF conntrack entries by hand (kbp_ct)")
@pytest.mark.parametrize("remapped", [False, True], ids=["plain", "remapped"])
def test_a_connection_whose_reply_entry_alone_was_deleted_still_works(
    env: Env, remapped: bool
) -> None:
    # Without its reply entry a flow's answers would reach the client from be1's address
    # and the client would reset be1's connection. A flow older than a second keeps a
    # spare of the entry (KBP_CT_SPARE), which a reply that finds none writes back.
    # `remapped`: two Services share be1, one client port connects to both, and the
    # flow checked is the second one, whose port was remapped (the clash).
    ips = []
    objects = []
    for n in range(2 if remapped else 1):
        made, ip4, _ = service(env, f"spare-{int(remapped)}-{n}", backends(env, "be1"))
        made[0]["spec"]["ports"][0]["targetPort"] = SPARE_PORT
        made[1]["ports"][0]["port"] = SPARE_PORT
        objects += made
        ips.append(ip4)
    env.program(*objects)
    table = env.dataplane.programs.map("kbp_ct")  # type: ignore[union-attr]
    stale = table.keys()  # the module's earlier flows (no collector runs here)
    for key in stale:
        table.delete(key)
    port, checked = (23000 if remapped else 23100), len(ips) - 1
    python = [sys.executable, "-c"]
    server = subprocess.Popen(in_netns(env.pod("be1").ns, [*python, PUSH_SERVER]),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    client = None

    def tell(proc: subprocess.Popen, line: str) -> str:
        assert proc.stdin is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return read_line(proc, timeout=30).strip()

    def replies(direction: int) -> list[bytes]:
        """The checked flow's reply entries (or spares) in kbp_ct: from be1's SPARE_PORT
        to the client's port, or (remapped) to another port (struct kbp_ct_key: sport
        and dport at bytes 32-35, dir at 38)."""
        stored = table.keys()  # a list read from the kernel
        found = [
            k for k in stored if k[38] == direction and k[32:34] == struct.pack(">H", SPARE_PORT)
        ]
        return [k for k in found if (k[34:36] == struct.pack(">H", port)) != remapped]

    try:
        assert read_line(server, timeout=30).strip() == "ready"
        argv = [*python, PUSH_CLIENT, str(port), *ips]
        argv = in_netns(env.pod("client1").ns, argv)
        client = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert read_line(client, timeout=30).strip() == "connected"
        # The coarse clock: a forward packet more than a second after the flow began
        # writes the spare.
        time.sleep(2.5)
        for i in range(len(ips)):
            assert tell(client, f"send {i} one") == "one"
        time.sleep(0.5)  # the client's delayed ACKs
        assert len(replies(const.KBP_CT_SPARE)) == 1
        for first in ("server", "client"):
            (reply,) = replies(const.KBP_CT_REPLY)
            table.delete(reply)
            assert replies(const.KBP_CT_REPLY) == []
            # A collector pass rebuilds kbp_ct_gate from what is left: the spare must keep
            # the triple's slot, or tc would skip the reply lookup and never reach it.
            env.running().conntrack.run_once()  # type: ignore[attr-defined]
            if first == "server":
                assert tell(server, f"push {checked}") == "pushed"
                assert tell(client, f"read {checked}") == "pushed"
            assert tell(client, f"send {checked} after {first}") == f"after {first}"
            assert replies(const.KBP_CT_REPLY) == [reply]  # written back from the spare
        for i in range(len(ips)):  # the other flow untouched
            assert tell(client, f"send {i} last") == "last"
    finally:
        if client is not None:
            stop_process(client)
        stop_process(server)
