"""The one-node lab of the kernel tests and the benchmarks: a node network namespace with
pods on veth pairs, wired like a Calico node (toolkit.py), and helpers to serve and connect
from inside the pods.

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

import ipaddress
import itertools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.lab.toolkit import (
    NODE_SYSCTLS,
    POD_SYSCTLS,
    PODCLIENT,
    PODSERVER,
    LabError,
    in_netns,
    ip_batch,
    namespaces_with,
    node_base,
    plug_pod,
    run,
    sink_route,
)

from .kit import Built, cgroup2_mount, in_cgroup, link_index, read_line, stop_process

log = logging.getLogger(__name__)

NAMESPACE_PREFIX = "kbp-lab-"
HOST_VETH_PREFIX = "vethkbp"
CLUSTER_IPV4_CIDR = "10.96.0.0/16"
CLUSTER_IPV6_CIDR = "fd00:96::/112"
MAX_PODS = 254

_labs = itertools.count()
_POD_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")


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
    interval: float = 0.0,
) -> list[str]:
    """`podclient.py many` for n exchanges with ip:port (see Pod.connect_many); run it in
    a namespace with in_netns and read it with client_result. `interval`: seconds between
    exchanges; n 0: until SIGTERM (Pod.connect_every)."""
    argv = [sys.executable, str(PODCLIENT), "many", ip, str(port),
            "--proto", proto, "-n", str(n), "--timeout", str(timeout)]  # fmt: skip
    if source_port is not None:
        argv += ["--source-port", str(source_port)]
    if same_socket:
        argv.append("--same-socket")
    if interval:
        argv += ["--interval", str(interval)]
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
             *(["--tcp", ",".join(map(str, ports))] if "tcp" in protos else []),
             *(["--udp", ",".join(map(str, ports))] if "udp" in protos else []),
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

    def connect_every(
        self, ip: str, port: int, interval: float, timeout: float = 2.0
    ) -> Callable[[], Result]:
        """New TCP connections to ip:port, one every `interval` seconds, in the background
        until the returned function is called; it stops them and returns what they saw."""
        argv = self.argv(client_argv(ip, port, "tcp", 0, timeout, interval=interval))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.processes.append(proc)

        def stop() -> Result:
            proc.terminate()
            out, _ = proc.communicate(timeout=timeout + 10)
            self.processes.remove(proc)
            report = json.loads(out.strip().splitlines()[-1])
            return Result(Counter(report["counts"]), Counter(report["errors"]),
                          report["details"])  # fmt: skip

        return stop

    def stream(self, ip: str, port: int, timeout: float = 2.0) -> Stream:
        """A long-lived TCP connection to ip:port, checked line by line; returns once the
        first answer (the serving pod's name) arrived. An echo that takes longer than
        `timeout` seconds is an error."""
        argv = self.argv([sys.executable, str(PODCLIENT), "stream", ip, str(port),
                          "--timeout", str(timeout)])  # fmt: skip
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.processes.append(proc)
        handle = Stream(proc, f"{ip}:{port}")
        handle.wait_for(1, timeout=10)
        return handle

    def stop_processes(self) -> None:
        for proc in reversed(self.processes):
            stop_process(proc)
        self.processes.clear()


class Lab(Built):
    """A node namespace and its pods; a context manager that removes all of it on exit,
    also when building it failed half-way."""

    def __init__(self, node: int = 1, *, cgroup: bool = False) -> None:
        """`cgroup`: make a cgroup for the pods' processes (see the plan above)."""
        if not 1 <= node <= 254:
            raise ValueError(f"node number must be 1..254, not {node}")
        self.name = f"{NAMESPACE_PREFIX}{os.getpid()}-{next(_labs)}"
        super().__init__(f"lab {self.name}")
        self.node = node
        self._want_cgroup = cgroup
        self.cgroup: Path | None = None
        self.node_ns = self.name
        self.pods: dict[str, Pod] = {}
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
        self.undo.push("removing the workdir", lambda: shutil.rmtree(self.workdir, True))
        self._numbers = itertools.count(1)

    # -- lifecycle --

    def _build(self) -> None:
        if self._want_cgroup:
            self.cgroup = self.undo.cgroup(cgroup2_mount() / self.name)
        self.undo.namespace(self.node_ns, NODE_SYSCTLS)
        ip_batch(self.node_ns, [
            *node_base(self.node_ns),
            sink_route(CLUSTER_IPV4_CIDR),
            sink_route(CLUSTER_IPV6_CIDR),
        ])  # fmt: skip

    def close(self) -> list[str]:
        """Stop pod processes, delete every namespace (links and routes go with them),
        the cgroup and the workdir."""
        for pod in self.pods.values():
            try:
                pod.stop_processes()
            except Exception:
                log.exception("lab %s: stopping processes of pod %s failed", self.name, pod.name)
        self.pods.clear()
        problems = super().close()
        self.cgroup = None
        return problems

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

        self.undo.namespace(ns, POD_SYSCTLS)
        plug_pod(self.node_ns, host, ns, ipv4, ipv6)
        pod = Pod(self, name, number, ns, host, link_index(self.node_ns, host), ipv4, ipv6)
        self.pods[name] = pod
        return pod

    def remove_pod(self, name: str) -> None:
        """Stop the pod's processes, delete its veth pair and its namespace."""
        pod = self.pods.pop(name)
        pod.stop_processes()
        # Deleting the link is synchronous; a namespace is torn down later by a kernel
        # worker, so its veth would linger for a moment after `ip netns delete`.
        run(["ip", "-n", self.node_ns, "link", "delete", pod.host_ifname])
        self.undo.undo_now(f"deleting netns {pod.ns}")

    def run_in_node(self, *argv: str, timeout: float = 30) -> str:
        """Run a command in the node namespace (bpffs stays visible); its stdout."""
        return run(in_netns(self.node_ns, argv), timeout=timeout)


def lab_namespaces(pid: int | None = None) -> list[str]:
    """Lab namespaces that exist now (of this process by default): for leak checks."""
    return namespaces_with(f"{NAMESPACE_PREFIX}{os.getpid() if pid is None else pid}-")
