"""Socket-level load balancing for the node's own processes (bpf/sock_lb.c, attached by
agent/dataplane/ebpf/cgroup.py): real clients in the node's network namespace and in a
test cgroup connect to ClusterIPs and to the node's own NodePorts, and see the frontend
they asked for in getpeername() and recvfrom().

Address plan (tests/lab/nodelab.py, plus what this module adds inside the lab's node):
    node ns     this is node-a: lo 192.0.2.10/32, 2001:db8::10/128, the Node's addresses
                (tests/builders.py), so NodePorts are the node's own
    pods        be1 10.244.1.1, be2 10.244.1.2, be3 10.244.1.3 (fd00:244:1::N), each
                serving TCP and UDP on 8080 and answering with its pod name
    other ns    kbp-test-<pid>-sockother: eth0 10.250.0.2/30, default via 10.250.0.1
                (kbpother in the node ns): a namespace that is not the node's
    cgroup      <cgroup2 mount>/kbp-test-<pid>-<n>: the hooks are attached here only, and
                the clients run inside it (also the one in the other namespace)
    Services    ClusterIPs 10.96.0.x / fd00:96::x port 80 -> 8080, NodePorts 3008x;
                endpoints "elsewhere" (10.244.2.x on node-b) do not exist here
ClusterIP traffic that nothing translated goes into the lab's sink (a timeout); a
NodePort nothing translated reaches the node's own stack (connection refused).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from agent.dataplane.ebpf import cgroup as sockhooks
from agent.dataplane.ebpf import codec, libbpf
from agent.dataplane.ebpf.abi import (
    be16,
    const,
    ffi,
    from_be16,
    from_bytes,
    get_addr,
    set_addr,
    to_bytes,
)
from agent.dataplane.ebpf.dataplane import EbpfDataplane, remove_pins
from agent.dataplane.ebpf.kernel import load_programs
from agent.dataplane.ebpf.maps import FrontendKey, MapSizes
from agent.dataplane.ebpf.options import EbpfOptions, Xdp
from agent.lab.toolkit import LabError, in_netns
from agent.model.compile import compile
from tests.lab.kit import remove_cgroup
from tests.lab.nodelab import Lab

from ..builders import default_nodes, make_endpoint, make_service, make_slice, state_of

BACKENDS = ("be1", "be2", "be3")
NODE_IP4, NODE_IP6 = "192.0.2.10", "2001:db8::10"
PORT, TARGET_PORT = 80, 8080
HOOKS = sorted(sockhooks.HOOK_NAMES.values())

# The client every test runs: MODE IP PORT N TIMEOUT [BIND], prints one JSON document with
# the cgroup it ran in and one result per exchange (the answering pod, and the addresses
# the socket API showed), or the errno name of the failure ("timeout" for a timeout).
# BIND: the source address each socket binds to before connecting.
CLIENT = r"""
import errno, json, socket, sys

mode, ip, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
timeout = float(sys.argv[5])
bind = sys.argv[6] if len(sys.argv) > 6 else None
family = socket.AF_INET6 if ":" in ip else socket.AF_INET


def new_socket(kind):
    s = socket.socket(family, kind)
    s.settimeout(timeout)
    if bind:
        s.bind((bind, 0))
    return s


def failure(exc):
    if isinstance(exc, TimeoutError):
        return {"error": "timeout"}
    return {"error": errno.errorcode.get(exc.errno, str(exc)) if exc.errno else str(exc)}


def tcp():
    with new_socket(socket.SOCK_STREAM) as s:
        s.connect((ip, port))
        line = b""
        while not line.endswith(b"\n"):
            chunk = s.recv(100)
            if not chunk:
                break
            line += chunk
        return {"answer": line.decode().strip(), "peer": list(s.getpeername()[:2])}


def udp_connected():
    with new_socket(socket.SOCK_DGRAM) as s:
        s.connect((ip, port))
        s.send(b"ping")
        data, source = s.recvfrom(100)
        return {"answer": data.decode(), "source": list(source[:2]),
                "peer": list(s.getpeername()[:2])}


shared = None


def udp(fresh):
    global shared
    if shared is None or fresh:
        if shared is not None:
            shared.close()
        shared = new_socket(socket.SOCK_DGRAM)
    shared.sendto(b"ping", (ip, port))
    data, source = shared.recvfrom(100)
    return {"answer": data.decode(), "source": list(source[:2])}


results = []
for _ in range(n):
    try:
        if mode == "tcp":
            results.append(tcp())
        elif mode == "udp-connected":
            results.append(udp_connected())
        else:
            results.append(udp(fresh=(mode == "udp")))
    except OSError as exc:
        results.append(failure(exc))
own = [line[3:] for line in open("/proc/self/cgroup").read().splitlines() if line[:3] == "0::"]
print(json.dumps({"cgroup": own[0] if own else None, "results": results}))
"""

# A long-lived TCP connection: prints the first exchange, then one exchange (a line sent
# and its echo) per line read from stdin, each with getpeername().
STREAM = r"""
import json, socket, sys

ip, port = sys.argv[1], int(sys.argv[2])
s = socket.create_connection((ip, port), timeout=5)
reader = s.makefile("r")
print(json.dumps({"answer": reader.readline().strip(), "peer": list(s.getpeername()[:2])}),
      flush=True)
for number, _ in enumerate(sys.stdin):
    s.sendall(f"line {number}\n".encode())
    print(json.dumps({"echo": reader.readline().strip(), "peer": list(s.getpeername()[:2])}),
          flush=True)
"""


@dataclass
class Exchanges:
    """What a client saw: the cgroup it ran in and one dict per exchange."""

    cgroup: str
    results: list[dict]

    @property
    def answers(self) -> Counter[str]:
        return Counter(r["answer"] for r in self.results if "answer" in r)

    @property
    def errors(self) -> Counter[str]:
        return Counter(r["error"] for r in self.results if "error" in r)

    def all(self, key: str) -> set[tuple]:
        """The distinct values of `key` (peer, source) over the exchanges."""
        return {tuple(r[key]) for r in self.results if key in r}


class Stream:
    """The STREAM client: its first answer, then exchanges on demand."""

    def __init__(self, proc: subprocess.Popen) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self._stdin, self._stdout = proc.stdin, proc.stdout
        self.first: dict = self._read()

    def _read(self) -> dict:
        line = self._stdout.readline()
        assert line, "the stream client exited"
        return json.loads(line)

    def exchange(self) -> dict:
        self._stdin.write("more\n")
        self._stdin.flush()
        return self._read()


@dataclass
class Env:
    """One lab, one eBPF dataplane in its node namespace, and the hooks on a cgroup."""

    lab: Lab
    dataplane: EbpfDataplane
    pin_dir: Path
    cgroup: Path
    other_ns: str
    cluster_ips: Iterator[int] = field(default_factory=lambda: itertools.count(10))
    node_ports: Iterator[int] = field(default_factory=lambda: itertools.count(30080))

    def program(self, *objects: dict) -> None:
        state = compile(state_of(*default_nodes(), *objects), "node-a")
        self.dataplane.apply(state)

    def client(
        self, mode: str, ip: str, port: int, n: int = 1, *, timeout: float = 2.0,
        netns: str | None = None, in_cgroup: bool = True, bind: str | None = None,
    ) -> Exchanges:  # fmt: skip
        """Run CLIENT in the node namespace (or `netns`), inside the test cgroup unless
        in_cgroup is false: the shell joins the cgroup, then execs the client."""
        args = [mode, ip, str(port), str(n), str(timeout), *([bind] if bind else [])]
        argv = in_netns(netns or self.lab.node_ns, [sys.executable, "-c", CLIENT, *args])
        if in_cgroup:
            argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup / "cgroup.procs"),
                    *argv]  # fmt: skip
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=n * (timeout + 1) + 30)
        if proc.returncode != 0:
            raise LabError(f"client {mode} {ip}:{port} exited {proc.returncode}: {proc.stderr}")
        report = json.loads(proc.stdout)
        made = Exchanges(report["cgroup"], report["results"])
        if in_cgroup:  # the process really ran where the hooks are
            assert made.cgroup == "/" + self.cgroup.name, made.cgroup
        return made

    @contextlib.contextmanager
    def stream(self, ip: str, port: int) -> Iterator[Stream]:
        """A long-lived TCP connection from the node, in the cgroup; closed on exit."""
        client = in_netns(self.lab.node_ns, [sys.executable, "-c", STREAM, ip, str(port)])
        argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.cgroup / "cgroup.procs"),
                *client]  # fmt: skip
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            yield Stream(proc)
        finally:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.close()  # the client's loop ends, it closes the socket and exits
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()

    def service(
        self, name: str, endpoints: list[dict], *, protocol: str = "TCP",
        dual_stack: bool = False, mutate: Callable[[dict], None] | None = None,
    ) -> tuple[list[dict], str, str]:  # fmt: skip
        """A Service on port 80 -> 8080 with a fresh ClusterIP pair and one slice per
        family; (objects, IPv4 ClusterIP, IPv6 ClusterIP)."""
        number = next(self.cluster_ips)
        ip4, ip6 = f"10.96.0.{number}", f"fd00:96::{number:x}"

        def spec(obj: dict) -> None:
            obj["spec"]["clusterIP"] = ip4
            obj["spec"]["clusterIPs"] = [ip4, ip6] if dual_stack else [ip4]
            if dual_stack:
                obj["spec"]["ipFamilies"] = ["IPv4", "IPv6"]
                obj["spec"]["ipFamilyPolicy"] = "RequireDualStack"
            obj["spec"]["ports"][0]["protocol"] = protocol
            if mutate is not None:
                mutate(obj)

        def ports(obj: dict) -> None:
            obj["ports"][0]["protocol"] = protocol

        objects = [make_service(name=name, mutate=spec)]
        for family, wanted in (("IPv4", False), ("IPv6", True)):
            chosen = [e for e in endpoints if (":" in e["addresses"][0]) == wanted]
            if family == "IPv4" or dual_stack:
                slice_name = f"{name}-{family.lower()}"
                objects.append(make_slice(name=slice_name, service=name, endpoints=chosen,
                                          mutate=ports, family=family))  # fmt: skip
        return objects, ip4, ip6

    def backends(self, *names: str, family: int = 4) -> list[dict]:
        pods = [self.lab.pods[n] for n in names]
        return [make_endpoint(p.ipv4 if family == 4 else p.ipv6, "node-a") for p in pods]

    def all_backends(self) -> list[dict]:
        return self.backends(*BACKENDS) + self.backends(*BACKENDS, family=6)

    def service_counters(self, ip: str, proto: int) -> tuple[int, ...]:
        """(packets, bytes, new_flows, drops) of the service behind frontend ip:80."""
        family = const.KBP_FAMILY_IPV6 if ":" in ip else const.KBP_FAMILY_IPV4
        key = FrontendKey(ip, PORT, proto, family)
        service_id = self.dataplane.maps.current.services[key].service_id
        sums = codec.percpu_sums(self.dataplane.programs.map("kbp_counters"), "kbp_counters")
        return sums[service_id]

    def drops(self, reason: int) -> int:
        sums = codec.percpu_sums(self.dataplane.programs.map("kbp_drops"), "kbp_drop_counters")
        return sums[reason][0]


def _run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


def _node_additions(lab: Lab, other_ns: str) -> None:
    """The node's own addresses (on its loopback: this kernel has no dummy devices), and a
    namespace that is not the node's."""
    subprocess.run(["ip", "netns", "add", other_ns], check=True)
    batch = "\n".join([
        f"addr add {NODE_IP4}/32 dev lo",
        f"addr add {NODE_IP6}/128 dev lo",
        f"link add kbpother type veth peer name eth0 netns {other_ns}",
        "addr add 10.250.0.1/30 dev kbpother",
        "link set kbpother up",
    ]) + "\n"  # fmt: skip
    subprocess.run(["ip", "-n", lab.node_ns, "-batch", "-"], input=batch, text=True, check=True)
    batch = "link set lo up\naddr add 10.250.0.2/30 dev eth0\nlink set eth0 up\n"
    batch += "route add default via 10.250.0.1\n"
    subprocess.run(["ip", "-n", other_ns, "-batch", "-"], input=batch, text=True, check=True)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    from ..conftest import BPFFS, kernel_required, missing_kernel_prerequisites

    if missing_kernel_prerequisites():
        pytest.skip("kernel prerequisites missing")  # the per-test hook reports why
    mount = sockhooks.cgroup2_mount()
    if mount is None:
        reason = "no cgroup2 hierarchy is mounted (socket hooks attach to a cgroup2 directory)"
        if kernel_required():
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    pid = os.getpid()
    cgroup = mount / f"kbp-test-{pid}-{time.monotonic_ns()}"
    pin_dir = BPFFS / f"kbp-test-sock-{pid}-{time.monotonic_ns()}"
    other_ns = f"kbp-test-{pid}-sockother"
    with Lab() as lab:
        dataplane = None
        try:
            for name in BACKENDS:
                lab.add_pod(name).serve([TARGET_PORT])
            _node_additions(lab, other_ns)
            cgroup.mkdir()
            sizes = MapSizes(4096, 65536, 4096, 4096, 1024)
            # No external interfaces (the glob matches nothing): only the pods' veths and
            # the socket hooks carry programs here.
            # No keeper: these tests attach, move and detach the hooks themselves.
            dataplane = EbpfDataplane(EbpfOptions(
                pin_dir, ("vethkbp*",), sizes, netns=lab.node_ns, watch=False,
                external_interfaces=("kbp-none",), xdp=Xdp.OFF, check_period=0,
            ))  # fmt: skip
            hooks = sockhooks.attach_socket_hooks(dataplane.programs, cgroup, pin_dir)
            assert hooks == HOOKS
            made = Env(lab, dataplane, pin_dir, cgroup, other_ns)
            made.program()  # writes kbp_config: the node's addresses and netns cookie
            yield made
        finally:
            try:
                sockhooks.detach_socket_hooks(pin_dir)
                if cgroup.exists():
                    remove_cgroup(cgroup)
                if dataplane is not None:
                    dataplane.cleanup()
            finally:
                remove_pins(pin_dir)
                subprocess.run(["ip", "netns", "delete", other_ns], check=False,
                               capture_output=True)  # fmt: skip
    assert not cgroup.exists() and not pin_dir.exists()


# --- the contract with the dataplane -------------------------------------------------------


def test_dataplane_wrote_the_node_netns_cookie_and_addresses(env: Env) -> None:
    raw = env.dataplane.programs.map("kbp_config").lookup(bytes(4))
    assert raw is not None
    config = from_bytes("kbp_config", raw)
    assert config.host_netns_cookie == sockhooks.netns_cookie(env.lab.node_ns)
    assert config.host_netns_cookie != sockhooks.netns_cookie()  # not this test's namespace
    assert bytes(ffi.buffer(config.node_addr4, 4)) == bytes([192, 0, 2, 10])


# --- connect(): TCP ------------------------------------------------------------------------


@pytest.mark.parametrize("family", [4, 6])
def test_tcp_from_the_node_to_a_cluster_ip_reaches_every_backend(env: Env, family: int) -> None:
    objects, ip4, ip6 = env.service(f"web{family}", env.all_backends(), dual_stack=True)
    env.program(*objects)
    ip = ip4 if family == 4 else ip6
    seen = env.client("tcp", ip, PORT, 30)
    assert seen.errors == {}, seen.results[:3]
    assert set(seen.answers) == set(BACKENDS), seen.answers
    assert seen.all("peer") == {(ip, PORT)}  # getpeername: the ClusterIP, not a pod


@pytest.mark.parametrize("family", [4, 6])
def test_tcp_from_the_node_to_its_own_node_port(env: Env, family: int) -> None:
    node_port = next(env.node_ports)

    def node_port_type(obj: dict) -> None:
        obj["spec"]["type"] = "NodePort"
        obj["spec"]["ports"][0]["nodePort"] = node_port

    objects, _, _ = env.service(f"np{family}", env.all_backends(), dual_stack=True,
                                mutate=node_port_type)  # fmt: skip
    env.program(*objects)
    ip = NODE_IP4 if family == 4 else NODE_IP6
    seen = env.client("tcp", ip, node_port, 20)
    assert seen.errors == {}, seen.results[:3]
    assert set(seen.answers) <= set(BACKENDS) and len(seen.answers) > 1, seen.answers
    assert seen.all("peer") == {(ip, node_port)}


@pytest.mark.parametrize(("mode", "key"), [("tcp", "peer"), ("udp", "source")])
def test_v4_mapped_cluster_ip_on_a_dual_stack_socket(env: Env, mode: str, key: str) -> None:
    """An IPv6 socket naming ::ffff:<ClusterIP>: the kernel runs only the IPv6 hooks."""
    protocol = "TCP" if mode == "tcp" else "UDP"
    objects, ip4, _ = env.service(f"mapped-{mode}", env.backends(*BACKENDS), protocol=protocol)
    env.program(*objects)
    mapped = f"::ffff:{ip4}"
    seen = env.client(mode, mapped, PORT, 20)
    assert seen.errors == {}, seen.results[:3]
    assert set(seen.answers) <= set(BACKENDS) and len(seen.answers) > 1, seen.answers
    assert seen.all(key) == {(mapped, PORT)}


def test_client_ip_affinity_keeps_the_node_on_one_backend(env: Env) -> None:
    def affinity(obj: dict) -> None:
        obj["spec"]["sessionAffinity"] = "ClientIP"
        obj["spec"]["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 60}}

    objects, ip4, _ = env.service("sticky", env.backends(*BACKENDS), mutate=affinity)
    env.program(*objects)
    seen = env.client("tcp", ip4, PORT, 20)
    assert seen.errors == {}, seen.results[:3]
    assert len(seen.answers) == 1, seen.answers


def test_each_new_connection_refreshes_the_affinity_entry(env: Env) -> None:
    """kube-proxy's `recent --set`: the timeout counts from the client's last new
    connection. The hook refreshes the entry it found in place: still one entry, the
    same backend, a later last_used."""

    def affinity(obj: dict) -> None:
        obj["spec"]["sessionAffinity"] = "ClientIP"
        obj["spec"]["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 60}}

    objects, ip4, _ = env.service("sticky-refresh", env.backends(*BACKENDS), mutate=affinity)
    env.program(*objects)
    key = FrontendKey(ip4, PORT, 6, const.KBP_FAMILY_IPV4)
    service_id = env.dataplane.maps.current.services[key].service_id

    def entries() -> list[tuple[int, int]]:
        found = []
        for raw_key, raw in env.dataplane.programs.map("kbp_affinity").items():
            if from_bytes("kbp_affinity_key", raw_key).service_id == service_id:
                value = from_bytes("kbp_affinity", raw)
                found.append((value.last_used, value.backend_id))
        return found

    assert env.client("tcp", ip4, PORT).errors == {}
    [(first, backend_id)] = entries()
    time.sleep(0.05)  # a few ticks of the coarse clock
    seen = env.client("tcp", ip4, PORT, 3)
    assert seen.errors == {} and len(seen.answers) == 1, seen.results
    [(last, again)] = entries()
    assert again == backend_id and last > first, (first, last)


def test_internal_traffic_policy_local_uses_only_this_nodes_endpoints(env: Env) -> None:
    def itp_local(obj: dict) -> None:
        obj["spec"]["internalTrafficPolicy"] = "Local"

    endpoints = [*env.backends("be2"), make_endpoint("10.244.2.7", "node-b")]
    objects, ip4, _ = env.service("itp-local", endpoints, mutate=itp_local)
    env.program(*objects)
    seen = env.client("tcp", ip4, PORT, 20)
    assert seen.answers == {"be2": 20}, seen.results[:3]


def _load_balancer(vip: str, ranges: list[str], node_port: int) -> Callable[[dict], None]:
    def mutate(obj: dict) -> None:
        obj["spec"]["type"] = "LoadBalancer"
        obj["spec"]["ports"][0]["nodePort"] = node_port
        obj["spec"]["loadBalancerSourceRanges"] = ranges
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": vip}]}}

    return mutate


@pytest.mark.parametrize(
    ("ranges", "bind", "expected"),
    [
        pytest.param(["192.0.2.0/24"], None, "served", id="node address inside the ranges"),
        pytest.param(["198.51.100.0/24"], None, "EHOSTUNREACH", id="node address outside"),
        pytest.param(
            ["169.254.1.1/32"],
            "169.254.1.1",
            "served",
            id="bound to an address inside, node address outside",
        ),
        pytest.param(
            ["192.0.2.0/24"],
            "169.254.1.1",
            "EHOSTUNREACH",
            id="bound to an address outside, node address inside",
        ),
    ],
)
def test_load_balancer_source_ranges_apply_to_the_node(
    env: Env, ranges: list[str], bind: str | None, expected: str
) -> None:
    vip = "203.0.113.9"
    mutate = _load_balancer(vip, ranges, next(env.node_ports))
    objects, _, _ = env.service("ranged", env.backends(*BACKENDS), mutate=mutate)
    env.program(*objects)
    refused = env.drops(const.KBP_DROP_SOURCE_RANGE)
    seen = env.client("tcp", vip, PORT, 3, bind=bind)
    if expected == "served":
        assert seen.errors == {} and set(seen.answers) <= set(BACKENDS), seen.results
        assert seen.all("peer") == {(vip, PORT)}
        assert env.drops(const.KBP_DROP_SOURCE_RANGE) == refused
    else:
        assert seen.errors == {expected: 3}, seen.results
        assert env.drops(const.KBP_DROP_SOURCE_RANGE) - refused == 3


# --- UDP: sendmsg(), recvmsg() ------------------------------------------------------------


@pytest.mark.parametrize("family", [4, 6])
def test_udp_answers_come_from_the_cluster_ip(env: Env, family: int) -> None:
    """A DNS-like exchange: sendto() the ClusterIP, recvfrom() must show the ClusterIP as
    the source (resolvers drop answers from anyone else)."""
    objects, ip4, ip6 = env.service(f"dns{family}", env.all_backends(), protocol="UDP",
                                    dual_stack=True)  # fmt: skip
    env.program(*objects)
    ip = ip4 if family == 4 else ip6
    seen = env.client("udp", ip, PORT, 30)  # a new socket per query
    assert seen.errors == {}, seen.results[:3]
    assert set(seen.answers) == set(BACKENDS), seen.answers
    assert seen.all("source") == {(ip, PORT)}


def test_one_unconnected_udp_socket_keeps_its_backend_and_is_one_flow(env: Env) -> None:
    objects, ip4, _ = env.service("udp-flow", env.backends(*BACKENDS), protocol="UDP")
    env.program(*objects)
    before = env.service_counters(ip4, 17)
    seen = env.client("udp-same", ip4, PORT, 10)
    assert seen.errors == {}, seen.results[:3]
    assert len(seen.answers) == 1 and seen.answers.total() == 10, seen.answers
    assert seen.all("source") == {(ip4, PORT)}
    after = env.service_counters(ip4, 17)
    assert after[2] - before[2] == 1  # new_flows: one socket, one backend, one flow


@pytest.mark.parametrize("family", [4, 6])
def test_connected_udp_shows_the_cluster_ip_as_peer_and_source(env: Env, family: int) -> None:
    objects, ip4, ip6 = env.service(f"udpc{family}", env.all_backends(), protocol="UDP",
                                    dual_stack=True)  # fmt: skip
    env.program(*objects)
    ip = ip4 if family == 4 else ip6
    seen = env.client("udp-connected", ip, PORT, 20)
    assert seen.errors == {}, seen.results[:3]
    assert set(seen.answers) <= set(BACKENDS) and len(seen.answers) > 1, seen.answers
    assert seen.all("source") == {(ip, PORT)}
    assert seen.all("peer") == {(ip, PORT)}


# --- empty sets -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["tcp", "udp", "udp-connected"])
def test_service_without_endpoints_refuses_at_once(env: Env, mode: str) -> None:
    objects, ip4, _ = env.service(f"empty-{mode}", [], protocol="TCP" if mode == "tcp" else "UDP")
    env.program(*objects)
    rejected = env.drops(const.KBP_DROP_REJECTED)
    started = time.monotonic()
    seen = env.client(mode, ip4, PORT, 3)
    assert seen.errors == {"ECONNREFUSED": 3}, seen.results
    assert time.monotonic() - started < 2.0  # no attempt waited for a timeout
    assert env.drops(const.KBP_DROP_REJECTED) - rejected == 3


def test_local_policy_with_endpoints_only_elsewhere_fails_as_unreachable(env: Env) -> None:
    def itp_local(obj: dict) -> None:
        obj["spec"]["internalTrafficPolicy"] = "Local"

    elsewhere = [make_endpoint("10.244.2.7", "node-b")]
    objects, ip4, _ = env.service("local-only", elsewhere, mutate=itp_local)
    env.program(*objects)
    dropped = env.drops(const.KBP_DROP_NO_BACKEND)
    seen = env.client("tcp", ip4, PORT, 2)
    assert seen.errors == {"EHOSTUNREACH": 2}, seen.results
    assert env.drops(const.KBP_DROP_NO_BACKEND) - dropped == 2


# --- who is touched -------------------------------------------------------------------------


def test_a_process_of_another_netns_in_the_same_cgroup_is_untouched(env: Env) -> None:
    objects, ip4, _ = env.service("scoped", env.backends(*BACKENDS))
    env.program(*objects)
    assert env.client("tcp", ip4, PORT).errors == {}  # the node's own process: served
    # The same cgroup, another namespace: its connect() is left alone, the node routes
    # the ClusterIP into the sink, and the client times out.
    seen = env.client("tcp", ip4, PORT, 2, timeout=0.5, netns=env.other_ns)
    assert seen.errors == {"timeout": 2}, seen.results


def test_a_process_outside_the_cgroup_is_untouched(env: Env) -> None:
    objects, ip4, _ = env.service("outside", env.backends(*BACKENDS))
    env.program(*objects)
    seen = env.client("tcp", ip4, PORT, 2, timeout=0.5, in_cgroup=False)
    assert seen.errors == {"timeout": 2}, seen.results


def test_no_netns_cookie_in_the_config_means_no_translation(env: Env) -> None:
    objects, ip4, _ = env.service("no-cookie", env.backends(*BACKENDS))
    env.program(*objects)
    config_map = env.dataplane.programs.map("kbp_config")
    written = config_map.lookup(bytes(4))
    assert written is not None
    config = from_bytes("kbp_config", written)
    config.host_netns_cookie = 0
    config_map.update(bytes(4), to_bytes(config))
    try:
        seen = env.client("tcp", ip4, PORT, 2, timeout=0.5)
        assert seen.errors == {"timeout": 2}, seen.results
    finally:
        config_map.update(bytes(4), written)
    assert env.client("tcp", ip4, PORT).errors == {}


def _reverse_entries(env: Env) -> dict[bytes, tuple[str, int]]:
    """kbp_sock_rev: key -> the frontend (ip, port) it restores."""
    entries = {}
    for key, value in env.dataplane.programs.map("kbp_sock_rev").items():
        family = from_bytes("kbp_sock_key", key).family
        rev = from_bytes("kbp_sock_rev", value)
        entries[key] = (get_addr(rev.addr, family), from_be16(rev.port))
    return entries


def test_closed_sockets_leave_no_reverse_entries(env: Env) -> None:
    """A TCP socket keeps its frontend in its own storage (kbp_sock_peer), not in the
    kbp_sock_rev LRU: getpeername() shows the ClusterIP and no entry is written; the
    LRU holds UDP sockets' entries."""
    objects, ip4, _ = env.service("release", env.backends(*BACKENDS))
    env.program(*objects)
    before = _reverse_entries(env)
    with env.stream(ip4, PORT) as stream:
        assert stream.first["peer"] == [ip4, PORT]
        assert _reverse_entries(env) == before
    assert _reverse_entries(env) == before
    assert env.client("tcp", ip4, PORT, 10).errors == {}
    assert env.client("tcp", f"::ffff:{ip4}", PORT, 10).errors == {}
    assert _reverse_entries(env) == before
    # Connected UDP sockets have kbp_sock_rev entries; sock_release removes them.
    objects, udp4, _ = env.service("release-udp", env.backends(*BACKENDS), protocol="UDP")
    env.program(*objects)
    seen = env.client("udp-connected", udp4, PORT, 10)
    assert seen.errors == {} and seen.all("peer") == {(udp4, PORT)}, seen.results[:3]
    assert _reverse_entries(env) == before


# The slots of kbp_sock_slots (lib/sock.h, "Records"): struct kbp_sock_slot, 64 bytes.
SLOT_SIZE = 64


def _held_slots(env: Env) -> dict[int, tuple[int, tuple[str, int]]]:
    """kbp_sock_slots: index -> (holder's cookie, the frontend it restores), held ones."""
    table = env.dataplane.programs.map("kbp_sock_slots")
    raw = table.values_array(table.info.max_entries)
    held = {}
    for index in range(len(raw) // SLOT_SIZE):
        value = raw[index * SLOT_SIZE : (index + 1) * SLOT_SIZE]
        slot = from_bytes("kbp_sock_slot", value)
        if slot.cookie:
            peer = slot.peer
            held[index] = (slot.cookie, (get_addr(peer.frontend, peer.family),
                                         from_be16(peer.frontend_port)))  # fmt: skip
    return held


# A TCP client that connects, reads the greeting, shows getpeername(), then disconnects
# with connect(AF_UNSPEC), which clears the socket's destination port, before closing.
DISCONNECT = r"""
import ctypes, json, socket, sys

s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
peer = list(s.getpeername()[:2])
s.recv(100)
unspec = (ctypes.c_ushort * 8)()  # struct sockaddr with sa_family AF_UNSPEC (0)
rc = ctypes.CDLL(None, use_errno=True).connect(s.fileno(), unspec, ctypes.sizeof(unspec))
try:
    s.getpeername()
    disconnected = False
except OSError:
    disconnected = True
s.close()
print(json.dumps({"peer": peer, "rc": rc, "disconnected": disconnected}))
"""


def test_connected_socket_record_takes_a_slot_and_release_frees_it(env: Env) -> None:
    """A TCP socket's record sits in the slot of kbp_sock_slots its cookie names while it
    lives; sock_release frees it, also after connect(AF_UNSPEC) cleared its peer. So does
    a connected UDP socket's."""
    objects, ip4, _ = env.service("slots", env.backends(*BACKENDS))
    env.program(*objects)
    before = _held_slots(env)
    with env.stream(ip4, PORT) as stream:
        assert stream.first["peer"] == [ip4, PORT]
        mine = {i: held for i, held in _held_slots(env).items() if i not in before}
        assert [frontend for _, frontend in mine.values()] == [(ip4, PORT)], mine
        assert stream.exchange()["peer"] == [ip4, PORT]
    assert _held_slots(env) == before
    argv = in_netns(env.lab.node_ns, [sys.executable, "-c", DISCONNECT, ip4, str(PORT)])
    argv = ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(env.cgroup / "cgroup.procs"), *argv]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(done.stdout) == {"peer": [ip4, PORT], "rc": 0, "disconnected": True}
    assert _held_slots(env) == before
    # A connected UDP socket's record takes a slot too (none is in the LRU), freed at close.
    objects, udp4, _ = env.service("slots-udp", env.backends(*BACKENDS), protocol="UDP")
    env.program(*objects)
    reverse = _reverse_entries(env)
    seen = env.client("udp-connected", udp4, PORT, 4)
    assert seen.errors == {} and seen.all("peer") == {(udp4, PORT)}, seen.results[:3]
    assert seen.all("source") == {(udp4, PORT)}
    assert _held_slots(env) == before and _reverse_entries(env) == reverse


def test_tcp_record_falls_back_to_socket_storage_when_its_slot_is_held(env: Env) -> None:
    """Every slot held by sockets that do not exist, each claiming to restore another
    address for the same backends: a new TCP socket records in its own storage, a
    connected UDP socket in kbp_sock_rev; getpeername() and recvfrom() still show the
    ClusterIP (a reader trusts only its own cookie), and neither the sockets nor their
    release touch a slot they do not hold."""
    objects, ip4, _ = env.service("slots-held", env.backends(*BACKENDS))
    udp_objects, udp4, _ = env.service("slots-held-udp", env.backends(*BACKENDS), protocol="UDP")
    env.program(*objects, *udp_objects)
    table = env.dataplane.programs.map("kbp_sock_slots")
    count = table.info.max_entries
    saved = table.values_array(count)
    decoys = bytearray()
    for index in range(count):
        slot = ffi.new("struct kbp_sock_slot *")
        slot.cookie = (1 << 62) + index  # cookies the kernel has not handed out
        slot.peer.family = const.KBP_FAMILY_IPV4
        set_addr(slot.peer.backend, env.lab.pods[BACKENDS[index % 3]].ipv4)
        slot.peer.backend_port = be16(TARGET_PORT)
        set_addr(slot.peer.frontend, "10.99.99.99")
        slot.peer.frontend_port = be16(PORT)
        decoys += bytes(ffi.buffer(slot))
    keys = b"".join(index.to_bytes(4, "little") for index in range(count))
    table.update_batch(keys, bytes(decoys), count)
    try:
        seen = env.client("tcp", ip4, PORT, 6)
        assert seen.errors == {} and seen.all("peer") == {(ip4, PORT)}, seen.results[:3]
        assert table.values_array(count) == bytes(decoys)
        # A connected UDP socket falls back to the LRU, which its release empties again.
        reverse = _reverse_entries(env)
        seen = env.client("udp-connected", udp4, PORT, 4)
        assert seen.errors == {} and seen.all("peer") == {(udp4, PORT)}, seen.results[:3]
        assert seen.all("source") == {(udp4, PORT)}
        assert table.values_array(count) == bytes(decoys)
        assert _reverse_entries(env) == reverse
    finally:
        table.update_batch(keys, saved, count)


# --- attachments --------------------------------------------------------------------------


def _attached(env: Env) -> dict[str, list[str]]:
    return {hook: sockhooks.attached_programs(env.cgroup, hook) for hook in HOOKS}


def _attached_ids(env: Env, hook: str) -> list[int]:
    attach_type = {name: kind for kind, name in sockhooks.HOOK_NAMES.items()}[hook]
    fd = os.open(env.cgroup, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return libbpf.prog_query(fd, attach_type)
    finally:
        os.close(fd)


def test_a_restarted_agent_replaces_the_programs_in_place(env: Env) -> None:
    """A second agent generation attaches its own programs: still one program per hook,
    now the new one. A connection made before keeps working and keeps showing the
    ClusterIP (the reverse map is pinned), and once that agent is gone too (its program
    fds closed) the pinned links keep the hooks working."""
    objects, ip4, _ = env.service("restart", env.backends(*BACKENDS))
    env.program(*objects)
    expected = {hook: [program] for hook, (program, _) in sockhooks.socket_programs().items()}
    assert _attached(env) == expected
    restarted = load_programs(env.pin_dir, asdict(env.dataplane.maps.sizes))
    try:
        with env.stream(ip4, PORT) as stream:
            assert stream.first["answer"] in BACKENDS and stream.first["peer"] == [ip4, PORT]
            assert sockhooks.attach_socket_hooks(restarted, env.cgroup, env.pin_dir) == HOOKS
            assert _attached(env) == expected
            ids = {hook: libbpf.prog_id(restarted.fd(program))
                   for hook, (program, _) in sockhooks.socket_programs().items()}  # fmt: skip
            assert {hook: _attached_ids(env, hook) for hook in HOOKS} == {
                hook: [prog] for hook, prog in ids.items()
            }
            restarted.close()  # that agent exits: no process holds its programs any more
            assert {hook: _attached_ids(env, hook) for hook in HOOKS} == {
                hook: [prog] for hook, prog in ids.items()
            }
            assert stream.exchange() == {"echo": "line 0", "peer": [ip4, PORT]}
            seen = env.client("tcp", ip4, PORT, 5)
            assert seen.errors == {} and seen.all("peer") == {(ip4, PORT)}, seen.results
    finally:
        # Back to the dataplane's own programs: a third generation, as far as the links
        # know.
        sockhooks.attach_socket_hooks(env.dataplane.programs, env.cgroup, env.pin_dir)
        restarted.close()
    for hook, (program, _) in sockhooks.socket_programs().items():
        assert _attached_ids(env, hook) == [libbpf.prog_id(env.dataplane.programs.fd(program))]


def test_detach_leaves_nothing_and_attach_restores(env: Env) -> None:
    node_port = next(env.node_ports)

    def node_port_type(obj: dict) -> None:
        obj["spec"]["type"] = "NodePort"
        obj["spec"]["ports"][0]["nodePort"] = node_port

    objects, ip4, _ = env.service("detach", env.backends(*BACKENDS), mutate=node_port_type)
    env.program(*objects)
    try:
        assert sockhooks.detach_socket_hooks(env.pin_dir) == HOOKS
        assert _run("bpftool", "cgroup", "show", str(env.cgroup)).strip() == ""
        assert not [p for p in env.pin_dir.iterdir() if p.name.startswith("kbp_link_")]
        assert sockhooks.detach_socket_hooks(env.pin_dir) == []  # nothing left to remove
        # Without the hooks the node's traffic is its own again: the ClusterIP goes into
        # the sink, and the node's own stack has nothing on the NodePort.
        assert env.client("tcp", ip4, PORT, timeout=0.5).errors == {"timeout": 1}
        assert env.client("tcp", NODE_IP4, node_port).errors == {"ECONNREFUSED": 1}
    finally:
        assert sockhooks.attach_socket_hooks(env.dataplane.programs, env.cgroup, env.pin_dir)
    shown = _run("bpftool", "cgroup", "show", str(env.cgroup))
    assert len([line for line in shown.splitlines() if " kbp_" in line]) == len(HOOKS), shown
    assert env.client("tcp", NODE_IP4, node_port).errors == {}


def test_attach_errors_name_the_cgroup_and_leave_nothing(env: Env, tmp_path: Path) -> None:
    missing = env.cgroup.parent / f"{env.cgroup.name}-missing"
    pin_dir = env.pin_dir.parent / f"{env.pin_dir.name}-errors"
    try:
        with pytest.raises(sockhooks.CgroupAttachError, match=str(missing)):
            sockhooks.attach_socket_hooks(env.dataplane.programs, missing, pin_dir)
        # A directory that is not a cgroup: the kernel refuses the first link (EBADF).
        where = re.escape(str(tmp_path))
        with pytest.raises(sockhooks.CgroupAttachError, match=rf"{where}.*E[A-Z]+"):
            sockhooks.attach_socket_hooks(env.dataplane.programs, tmp_path, pin_dir)
        assert sorted(p.name for p in pin_dir.iterdir()) == []
    finally:
        remove_pins(pin_dir)


def test_pinned_link_of_another_cgroup_is_moved(env: Env) -> None:
    """An agent restarted with another --cgroup-root: the links leave the old cgroup and
    attach to the new one (a link cannot change its cgroup in place)."""
    other = env.cgroup.parent / f"{env.cgroup.name}-moved"
    other.mkdir()
    try:
        sockhooks.attach_socket_hooks(env.dataplane.programs, other, env.pin_dir)
        assert all(sockhooks.attached_programs(other, hook) for hook in HOOKS)
        assert not any(sockhooks.attached_programs(env.cgroup, hook) for hook in HOOKS)
    finally:
        sockhooks.attach_socket_hooks(env.dataplane.programs, env.cgroup, env.pin_dir)
        remove_cgroup(other)
    assert all(sockhooks.attached_programs(env.cgroup, hook) for hook in HOOKS)
