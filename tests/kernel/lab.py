"""The namespace lab for kernel tests: a node network namespace with pods on veth pairs,
wired like a Calico node, and helpers to serve and connect from inside the pods.

Address plan (everything lives in namespaces the lab made; the machine's own interfaces,
addresses and routes are never touched):

    node ns   kbp-lab-<pid>-<k>            ip_forward and IPv6 forwarding on, rp_filter off
              lo: 169.254.1.1/32           the pods' IPv4 gateway (see below)
              vethkbp<n>: fe80::1/64       the pods' IPv6 gateway (nodad), proxy_arp=1
              routes 10.244.<node>.<n>/32 and fd00:244:<node>::<n>/128 dev vethkbp<n>
              ClusterIP ranges routed into kbpsink (see below)
    pod n     kbp-lab-<pid>-<k>-<name>     eth0 (peer of vethkbp<n>)
              10.244.<node>.<n>/32, fd00:244:<node>::<n>/128 (nodad)
              default via 169.254.1.1 dev eth0 onlink; default via fe80::1 dev eth0
    cgroup    Lab(cgroup=True): <cgroup2 mount>/kbp-lab-<pid>-<k>, a cgroup v2 directory the
              lab makes and every pod process (servers, clients, Pod.run) joins, so that
              socket hooks attached there (and only there) see the pods' sockets; the
              machine's root cgroup is never attached to
    ClusterIPs 10.96.0.0/16, fd00:96::/112 reach the node through the pods' default
              routes. The node routes them into `kbpsink`, a veth whose peer stays
              down and which resolves no neighbours (arp off): what no program or rule
              translated vanishes there, so a client always sees "timeout", never a
              reply, and nothing leaves the lab. Like a real node's default route, and
              unlike a blackhole route, this lets untranslated Service traffic reach
              the FORWARD hook, where the iptables dataplane REJECTs or DROPs it (a
              blackhole drops it in the route lookup first). Without any route the
              node's ICMP unreachable would race with the client: IPv4 route errors
              are rate-limited host-wide, and TCP drops ICMP arriving while connect()
              still holds the socket lock ("timeout" or "unreachable" at random).
              Other unrouted addresses get ICMP unreachable.

A Calico host answers ARP for 169.254.1.1 by proxy_arp because it has a default route
to proxy for; this node deliberately has none, so 169.254.1.1 sits on its loopback
instead, which also gives the node an IPv4 source for ARP and ICMP errors.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import json
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
PODSERVER = HERE / "podserver.py"
PODCLIENT = HERE / "podclient.py"

NAMESPACE_PREFIX = "kbp-lab-"
HOST_VETH_PREFIX = "vethkbp"
POD_IFNAME = "eth0"
GATEWAY_IPV4 = "169.254.1.1"
GATEWAY_IPV6 = "fe80::1"
CLUSTER_IPV4_CIDR = "10.96.0.0/16"
CLUSTER_IPV6_CIDR = "fd00:96::/112"
SINK = "kbpsink"  # where Service traffic that nothing translated goes (see above)
MAX_PODS = 254

_labs = itertools.count()
_POD_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")


class LabError(Exception):
    """Building or using the lab failed; the message has the command and its stderr."""


def run(argv: Sequence[str], *, input: str | None = None, timeout: float = 30) -> str:
    """Run argv to completion (input on its stdin); its stdout, or LabError with the
    command and its stderr when it exits non-zero."""
    proc = subprocess.run(
        list(argv), input=input, capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise LabError(
            f"`{' '.join(argv)}` exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}"
        )
    return proc.stdout


def ip_batch(ns: str, commands: Iterable[str]) -> None:
    """Several `ip` commands in one process, inside namespace ns."""
    run(["ip", "-n", ns, "-batch", "-"], input="\n".join(commands) + "\n")


def in_netns(ns: str, argv: Sequence[str]) -> list[str]:
    """argv run in ns's network namespace only: unlike `ip netns exec`, nsenter keeps this
    mount namespace, so /sys/fs/bpf stays visible."""
    return ["nsenter", f"--net=/run/netns/{ns}", *argv]


def cgroup2_mount() -> Path:
    """Where cgroup2 is mounted (/sys/fs/cgroup on unified hosts, .../unified on hybrid)."""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, path, fstype, *_ = line.split()
            if fstype == "cgroup2":
                return Path(path)
    raise LabError("no cgroup2 mount in /proc/mounts")


def in_cgroup(cgroup: Path | None, argv: Sequence[str]) -> list[str]:
    """argv run inside `cgroup` (a cgroup2 directory; None: where we are): a shell joins
    it, then execs argv, so the process is born there."""
    if cgroup is None:
        return list(argv)
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *argv]


def remove_cgroup(path: Path) -> None:
    """Move any process still inside to the parent (only ours can be there), then rmdir."""
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # it exited meanwhile
                    (path.parent / "cgroup.procs").write_text(pid)
            time.sleep(0.1)
    path.rmdir()


def sysctl(ns: str, settings: dict[str, str | int]) -> None:
    """Set these sysctls (name → value) in namespace ns, in one process."""
    run(in_netns(ns, ["sysctl", "-q", "-w", *(f"{k}={v}" for k, v in settings.items())]))


def delete_namespaces(namespaces: list[str], owner: str) -> None:
    """Delete these namespaces, the last made first (their links and routes go with them),
    and empty the list; a failure is logged with `owner` (who made them), not raised, so
    a clean-up goes on with the rest."""
    for ns in reversed(namespaces):
        proc = subprocess.run(
            ["ip", "netns", "delete", ns], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0 and os.path.exists(f"/run/netns/{ns}"):
            log.warning("%s: deleting netns %s failed: %s", owner, ns, proc.stderr)
    namespaces.clear()


def stop_process(proc: subprocess.Popen, grace: float = 2.0) -> None:
    """SIGTERM proc if it still runs, SIGKILL it after `grace` seconds, and close its
    pipes."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pipe in (proc.stdout, proc.stderr, proc.stdin):
        if pipe is not None:
            pipe.close()


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One line of proc's stdout, waiting at most timeout seconds ("" on EOF)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise LabError(f"`{' '.join(proc.args)}` printed nothing within {timeout}s")
    return proc.stdout.readline()


@dataclass
class Result:
    """What connect_many saw: answers per serving pod name, failures per class."""

    counts: Counter[str]
    errors: Counter[str]
    details: list[str] = field(default_factory=list)  # a few failure messages, for asserts

    @property
    def answered(self) -> int:
        return sum(self.counts.values())


def client_argv(
    ip: str,
    port: int,
    proto: str,
    n: int,
    timeout: float,
    *,
    source_port: int | None = None,
    same_socket: bool = False,
) -> list[str]:
    """`podclient.py many` for n exchanges with ip:port (see Pod.connect_many); run it in
    a namespace with in_netns and read it with client_result."""
    argv = [sys.executable, str(PODCLIENT), "many", ip, str(port),
            "--proto", proto, "-n", str(n), "--timeout", str(timeout)]  # fmt: skip
    if source_port is not None:
        argv += ["--source-port", str(source_port)]
    if same_socket:
        argv.append("--same-socket")
    return argv


def client_result(argv: Sequence[str], n: int, timeout: float) -> Result:
    """Run a client_argv command (wrapped to run where the client should) and return its
    report, allowing each of the n exchanges its timeout."""
    out = run(argv, timeout=n * (timeout + 1) + 30)
    report = json.loads(out.strip().splitlines()[-1])
    return Result(Counter(report["counts"]), Counter(report["errors"]), report["details"])


class Stream:
    """A long-lived TCP connection from a pod that sends a line every 50 ms and checks
    each echo (podclient.py stream). Tests ask `check()` whether it is still intact."""

    def __init__(self, proc: subprocess.Popen, target: str) -> None:
        self._proc = proc
        self.target = target
        self.backend: str | None = None
        self._ok = 0
        self._error: str | None = None
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"stream {target}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            word, _, rest = line.strip().partition(" ")
            with self._changed:
                if word == "backend":
                    self.backend = rest
                elif word == "ok":
                    self._ok = int(rest)
                elif word == "error":
                    self._error = rest
                self._changed.notify_all()
        with self._changed:
            if self._error is None and self._proc.wait() != 0:
                self._error = f"other client exited {self._proc.returncode}"
            self._changed.notify_all()

    def check(self) -> tuple[int, str | None]:
        """(messages echoed correctly so far, the first error or None)."""
        with self._changed:
            return self._ok, self._error

    def wait_for(self, messages: int, timeout: float = 5.0) -> tuple[int, str | None]:
        """Wait until `messages` were echoed (or an error); returns check()."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._ok < messages and self._error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._changed.wait(remaining)
            return self._ok, self._error

    def close(self) -> tuple[int, str | None]:
        """Close the connection cleanly; returns the final check()."""
        stop_process(self._proc)
        self._reader.join(5)
        return self.check()


@dataclass
class Pod:
    """One pod: a namespace whose eth0 is the peer of the node's host veth."""

    lab: Lab = field(repr=False)
    name: str
    number: int
    ns: str
    host_ifname: str
    host_ifindex: int
    ipv4: str
    ipv6: str
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """argv as it runs in this pod: its network namespace, the lab's cgroup if any."""
        return in_cgroup(self.lab.cgroup, in_netns(self.ns, argv))

    def run(self, *argv: str, timeout: float = 30) -> str:
        """Run an ordinary command in the pod (network namespace, cgroup); its stdout."""
        return run(self.argv(argv), timeout=timeout)

    def serve(
        self,
        ports: Iterable[int],
        protos: Sequence[str] = ("tcp", "udp"),
        *,
        report_peer: bool = False,
    ) -> None:
        """Start podserver.py here on these ports (IPv4 and IPv6); returns once bound.
        `report_peer`: answers name the peer address the pod saw too."""
        ports = list(ports)
        argv = self.argv(
            [sys.executable, str(PODSERVER), "--name", self.name,
             "--ports", ",".join(map(str, ports)), "--protos", ",".join(protos),
             *(["--report-peer"] if report_peer else [])],
        )  # fmt: skip
        log_path = self.lab.workdir / f"{self.name}-server-{len(self.processes)}.log"
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log_file, text=True)
        self.processes.append(proc)
        line = read_line(proc, timeout=10).strip()
        if line != "ready":
            stop_process(proc)
            raise LabError(
                f"podserver in {self.name} did not start ({line!r}): {log_path.read_text()}"
            )

    def connect_many(
        self,
        ip: str,
        port: int,
        proto: str,
        n: int,
        timeout: float = 2.0,
        *,
        source_port: int | None = None,
        same_socket: bool = False,
    ) -> Result:
        """n exchanges with ip:port, each on a new socket (a new flow) unless same_socket
        (UDP: one socket, one flow); source_port pins the client port (same 5-tuple)."""
        argv = client_argv(ip, port, proto, n, timeout,
                           source_port=source_port, same_socket=same_socket)  # fmt: skip
        return client_result(self.argv(argv), n, timeout)

    def stream(self, ip: str, port: int) -> Stream:
        """A long-lived TCP connection to ip:port, checked line by line; returns once the
        first answer (the serving pod's name) arrived."""
        argv = self.argv([sys.executable, str(PODCLIENT), "stream", ip, str(port)])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.processes.append(proc)
        handle = Stream(proc, f"{ip}:{port}")
        handle.wait_for(1, timeout=10)
        return handle

    def stop_processes(self) -> None:
        for proc in reversed(self.processes):
            stop_process(proc)
        self.processes.clear()


class NamespaceLab:
    """What every lab shares: a context manager that builds the lab on entry and removes
    all of it (close) on exit, also when building it failed half-way, and the list of
    namespaces it made, for close to delete."""

    def __init__(self) -> None:
        self._namespaces: list[str] = []

    def __enter__(self) -> Self:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _build(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _add_namespace(self, ns: str) -> None:
        run(["ip", "netns", "add", ns])
        self._namespaces.append(ns)


class Lab(NamespaceLab):
    """A node namespace and its pods; a context manager that removes all of it on exit,
    also when building it failed half-way."""

    def __init__(self, node: int = 1, *, cgroup: bool = False) -> None:
        """`cgroup`: make a cgroup for the pods' processes (see the plan above)."""
        if not 1 <= node <= 254:
            raise ValueError(f"node number must be 1..254, not {node}")
        super().__init__()
        self.node = node
        self._want_cgroup = cgroup
        self.cgroup: Path | None = None
        self.name = f"{NAMESPACE_PREFIX}{os.getpid()}-{next(_labs)}"
        self.node_ns = self.name
        self.pods: dict[str, Pod] = {}
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self._numbers = itertools.count(1)

    # -- lifecycle --

    def _build(self) -> None:
        if self._want_cgroup:
            cgroup = cgroup2_mount() / self.name
            cgroup.mkdir()
            self.cgroup = cgroup
        self._add_namespace(self.node_ns)
        # Defaults before any link exists, so host veths inherit them.
        sysctl(self.node_ns, {
            "net.ipv4.ip_forward": 1,
            "net.ipv6.conf.all.forwarding": 1,
            "net.ipv4.conf.all.rp_filter": 0,
            "net.ipv4.conf.default.rp_filter": 0,
            "net.ipv6.conf.all.accept_dad": 0,
            "net.ipv6.conf.default.accept_dad": 0,
        })  # fmt: skip
        ip_batch(self.node_ns, [
            "link set lo up",
            f"addr add {GATEWAY_IPV4}/32 dev lo",
            f"link add {SINK} type veth peer name {SINK}-peer",
            f"link set {SINK} arp off up",
            f"route add {CLUSTER_IPV4_CIDR} dev {SINK}",
            f"route add {CLUSTER_IPV6_CIDR} dev {SINK}",
        ])  # fmt: skip

    def close(self) -> None:
        """Stop pod processes, delete every namespace (links and routes go with them)."""
        for pod in self.pods.values():
            try:
                pod.stop_processes()
            except Exception:
                log.exception("lab %s: stopping processes of pod %s failed", self.name, pod.name)
        delete_namespaces(self._namespaces, f"lab {self.name}")
        self.pods.clear()
        if self.cgroup is not None:
            try:
                remove_cgroup(self.cgroup)
            except OSError:
                log.exception("lab %s: removing cgroup %s failed", self.name, self.cgroup)
            self.cgroup = None
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- pods --

    def add_pod(self, name: str) -> Pod:
        """A pod namespace on a new veth pair, addressed and routed per the plan above."""
        if not _POD_NAME.match(name):
            raise ValueError(f"pod name {name!r}: lowercase letters, digits and '-', <= 32")
        if name in self.pods:
            raise ValueError(f"pod {name!r} already exists in lab {self.name}")
        number = next(self._numbers)
        if number > MAX_PODS:
            raise LabError(f"lab {self.name} has no addresses left ({MAX_PODS} pods)")
        ns = f"{self.name}-{name}"
        host = f"{HOST_VETH_PREFIX}{number}"
        ipv4 = f"10.244.{self.node}.{number}"
        # The IPv6 groups repeat the IPv4 digits (pod 10 on node 1: fd00:244:1::10).
        ipv6 = str(ipaddress.IPv6Address(f"fd00:244:{self.node}::{number}"))

        self._add_namespace(ns)
        sysctl(ns, {
            "net.ipv4.conf.all.rp_filter": 0,
            "net.ipv4.conf.default.rp_filter": 0,
            "net.ipv6.conf.all.accept_dad": 0,
            "net.ipv6.conf.default.accept_dad": 0,
        })  # fmt: skip
        # The pod end is born inside the pod namespace: no `eth0` ever exists in the node.
        run(["ip", "-n", self.node_ns, "link", "add", host, "type", "veth",
             "peer", "name", POD_IFNAME, "netns", ns])  # fmt: skip
        sysctl(self.node_ns, {f"net.ipv4.conf.{host}.proxy_arp": 1})
        ip_batch(self.node_ns, [
            f"addr add {GATEWAY_IPV6}/64 dev {host} nodad",
            f"link set {host} up",
            f"route add {ipv4}/32 dev {host}",
            f"route add {ipv6}/128 dev {host}",
        ])  # fmt: skip
        ip_batch(ns, [
            "link set lo up",
            f"addr add {ipv4}/32 dev {POD_IFNAME}",
            f"addr add {ipv6}/128 dev {POD_IFNAME} nodad",
            f"link set {POD_IFNAME} up",
            f"route add default via {GATEWAY_IPV4} dev {POD_IFNAME} onlink",
            f"route add default via {GATEWAY_IPV6} dev {POD_IFNAME}",
        ])  # fmt: skip
        (link,) = json.loads(run(["ip", "-n", self.node_ns, "-j", "link", "show", host]))
        pod = Pod(self, name, number, ns, host, link["ifindex"], ipv4, ipv6)
        self.pods[name] = pod
        return pod

    def remove_pod(self, name: str) -> None:
        """Stop the pod's processes, delete its veth pair and its namespace."""
        pod = self.pods.pop(name)
        pod.stop_processes()
        # Deleting the link is synchronous; a namespace is torn down later by a kernel
        # worker, so its veth would linger for a moment after `ip netns delete`.
        run(["ip", "-n", self.node_ns, "link", "delete", pod.host_ifname])
        run(["ip", "netns", "delete", pod.ns])
        self._namespaces.remove(pod.ns)

    def run_in_node(self, *argv: str, timeout: float = 30) -> str:
        """Run a command in the node namespace (bpffs stays visible); its stdout."""
        return run(in_netns(self.node_ns, argv), timeout=timeout)


def lab_namespaces(pid: int | None = None) -> list[str]:
    """Lab namespaces that exist now (of this process by default): for leak checks."""
    prefix = f"{NAMESPACE_PREFIX}{os.getpid() if pid is None else pid}-"
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return []
    return sorted(name for name in names if name.startswith(prefix))
