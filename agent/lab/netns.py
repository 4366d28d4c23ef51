"""Building and removing the lab's network namespaces and processes (root only).

Everything lives in namespaces named `kbp-lab-<run>-…` (run: `r` and four hex digits, so
never the digits of the kernel tests' `kbp-lab-<pid>-…`); links are created inside them
and no command ever acts on the machine's own network namespace:

    kbp-lab-<run>-net       the node network: bridge br0, one port per node
    kbp-lab-<run>-node-a    a node: eth0 on the bridge with the Node's addresses (/32,
                            /128) and host routes to the other nodes' addresses; routes
                            to each other node's pod prefixes via that node; forwarding
                            on, rp_filter off; 169.254.1.1 on lo and fe80::1 on every
                            pod veth (the pods' gateways, Calico-style, with proxy_arp);
                            a route per pod into its veth (vethkbp<n>); every Service
                            address routed into `kbpsink`, a veth whose peer stays down,
                            so traffic nothing translated vanishes (a client times out)
    kbp-lab-<run>-web-a     a pod: eth0 with its /32 and /128, default routes via the
                            gateways; runs podserver.py (or nothing, for a client)
    kbp-lab-<run>-outside   a host outside the cluster: eth0 on the bridge with an address
                            in no cluster range (plan.LabOutside, e.g. 192.0.2.100/32 and
                            2001:db8::100/128), host routes to the nodes' addresses and
                            the ExternalIPs and LoadBalancer VIPs via the first node (a
                            router in front of the cluster); every node has a host route
                            back to it on its eth0

The "wire" veths (every eth0 on the bridge) have tx checksum offload off: see `_wire`.

The agents' pins go to /sys/fs/bpf/kube-bpf-proxy-lab-<run>-<node>; logs and the run's
record to /run/kube-bpf-proxy-lab/<run>/. `remove_run` takes all of it away: processes in
the namespaces (found with `ip netns pids`, so also those of a kept lab), namespaces,
pins, the record.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .plan import LabNode, LabOutside, LabPlan, LabPod, outside_routes, routes
from .toolkit import (
    BPFFS,
    HOST_VETH_PREFIX,
    NODE_SYSCTLS,
    POD_SYSCTLS,
    PODCLIENT,
    PODSERVER,
    UPLINK,
    LabError,
    addresses,
    alive,
    bridge,
    in_netns,
    ip_batch,
    namespaces_with,
    node_base,
    pids_in,
    plug_pod,
    sink_route,
    sysctl,
    wire,
)
from .toolkit import run as run_command

RUNS_DIR = Path("/run/kube-bpf-proxy-lab")
NAMESPACE_PREFIX = "kbp-lab-"
PIN_PREFIX = "kube-bpf-proxy-lab-"
RUN_ID = re.compile(r"^r[0-9a-f]{4}$")
_RUN_OF_NAMESPACE = re.compile(rf"^{NAMESPACE_PREFIX}(r[0-9a-f]{{4}})-")
_RUN_OF_PIN = re.compile(rf"^{PIN_PREFIX}(r[0-9a-f]{{4}})-")
POD_INTERFACES = f"{HOST_VETH_PREFIX}*"


@dataclass(frozen=True)
class Run:
    """The names of one lab run's namespaces, pins and files."""

    id: str

    @classmethod
    def new(cls) -> Run:
        """A run id no namespace, pin directory or record on this machine uses yet."""
        taken = {run.id for run in existing_runs()}
        while True:
            run = cls("r" + secrets.token_hex(2))
            if run.id not in taken:
                return run

    @property
    def prefix(self) -> str:
        return f"{NAMESPACE_PREFIX}{self.id}-"

    @property
    def net_ns(self) -> str:
        return f"{self.prefix}net"

    def node_ns(self, node: str) -> str:
        return f"{self.prefix}{node}"

    def pod_ns(self, pod: LabPod | LabOutside) -> str:
        """The namespace of a pod, or of the outside client."""
        return f"{self.prefix}{pod.name}"

    def pin_dir(self, node: str) -> Path:
        return BPFFS / f"{PIN_PREFIX}{self.id}-{node}"

    @property
    def workdir(self) -> Path:
        return RUNS_DIR / self.id

    @property
    def record(self) -> Path:
        return self.workdir / "lab.json"


@dataclass
class Agent:
    """`kube-bpf-proxy run` in a node namespace, its log in a file."""

    node: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    dataplane: str | None = None
    reason: str | None = None
    revision: str | None = None
    applied: str | None = None  # the "sync: applied revision …" line's figures
    _offset: int = 0
    _pending: str = ""
    lines: list[str] = field(default_factory=list)

    _DATAPLANE = re.compile(r"dataplane: (\S+) \((.*)\)$")
    _APPLIED = re.compile(r"sync: applied revision (\S+): (.*)$")

    def poll(self) -> bool:
        """Read new log lines; True once the first state is programmed."""
        with contextlib.suppress(FileNotFoundError), open(self.log_path, "rb") as log:
            log.seek(self._offset)
            chunk = log.read()
            self._offset += len(chunk)
        text = self._pending + chunk.decode(errors="replace") if chunk else self._pending
        *complete, self._pending = text.split("\n")
        for line in complete:
            self.lines.append(line)
            if self.dataplane is None and (m := self._DATAPLANE.search(line)):
                self.dataplane, self.reason = m.group(1), m.group(2)
            elif self.revision is None and (m := self._APPLIED.search(line)):
                self.revision, self.applied = m.group(1), m.group(2)
        if self.dataplane == "none" and any("serving metrics" in line for line in self.lines):
            return True  # a dry run programs nothing, so it never logs an applied revision
        return self.revision is not None

    def tail(self, n: int = 12) -> str:
        return "\n".join(f"    {line}" for line in self.lines[-n:])


class Cluster:
    """The lab's namespaces and processes for one plan; `close` removes all of it, also
    after a build that failed half-way."""

    def __init__(self, plan: LabPlan, run: Run, *, keep: bool = False) -> None:
        self.plan = plan
        self.run = run
        self.keep = keep
        self.host_veths: dict[str, str] = {}  # pod name -> its host veth in the node
        self.servers: dict[str, subprocess.Popen[bytes]] = {}
        self.agents: dict[str, Agent] = {}

    # -- the record `lab down` reads --

    def write_record(self) -> None:
        self.run.workdir.mkdir(parents=True, exist_ok=True)
        record = {
            "run": self.run.id,
            "pid": os.getpid(),
            "keep": self.keep,
            "started": time.time(),
            "nodes": [n.name for n in self.plan.nodes],
        }
        self.run.record.write_text(json.dumps(record) + "\n")

    # -- namespaces --

    def _add_namespace(self, ns: str, settings: dict[str, str | int] | None = None) -> None:
        run_command(["ip", "netns", "add", ns])
        sysctl(ns, settings or {})

    def build_network(self) -> None:
        """The bridge namespace for the node network."""
        self._add_namespace(self.run.net_ns)
        bridge(self.run.net_ns)

    def build_node(self, node: LabNode, index: int) -> None:
        ns = self.run.node_ns(node.name)
        self._add_namespace(ns, NODE_SYSCTLS)  # before any link exists: links inherit them
        port = node.name if len(node.name) <= 15 else f"node{index}"  # IFNAMSIZ
        wire(self.run.net_ns, port, ns)
        commands = [*node_base(ns), f"link set {UPLINK} up"]
        if node.ipv4:
            commands.append(f"addr add {node.ipv4}/32 dev {UPLINK}")
        if node.ipv6:
            commands.append(f"addr add {node.ipv6}/128 dev {UPLINK} nodad")
        for other in self.plan.nodes:  # the other nodes are on-link on the bridge
            if other.name == node.name:
                continue
            if node.ipv4 and other.ipv4:
                commands.append(f"route add {other.ipv4}/32 dev {UPLINK} src {node.ipv4}")
            if node.ipv6 and other.ipv6:
                commands.append(f"route add {other.ipv6}/128 dev {UPLINK}")
        outside = self.plan.outside  # on-link as well: replies to it leave by eth0
        if outside is not None and node.ipv4 and outside.ipv4:
            commands.append(f"route add {outside.ipv4}/32 dev {UPLINK} src {node.ipv4}")
        if outside is not None and node.ipv6 and outside.ipv6:
            commands.append(f"route add {outside.ipv6}/128 dev {UPLINK}")
        commands += [sink_route(address) for address in self.plan.service_addresses]
        ip_batch(ns, commands)

    def build_outside(self) -> LabOutside | None:
        """The outside client's namespace on the bridge, its traffic for external
        addresses routed via its entry node; None when the plan has no outside client."""
        outside = self.plan.outside
        if outside is None:
            return None
        ns = self.run.pod_ns(outside)
        self._add_namespace(ns, POD_SYSCTLS)
        wire(self.run.net_ns, outside.name, ns)  # its port on the bridge: no node has this name
        commands = ["link set lo up", f"link set {UPLINK} up"]
        if outside.ipv4:
            commands.append(f"addr add {outside.ipv4}/32 dev {UPLINK}")
        if outside.ipv6:
            commands.append(f"addr add {outside.ipv6}/128 dev {UPLINK} nodad")
        for dest, via in outside_routes(self.plan):
            src = outside.ipv6 if ":" in dest else outside.ipv4
            if via is None:
                commands.append(f"route add {dest} dev {UPLINK} src {src}")
            else:
                commands.append(f"route add {dest} via {via} dev {UPLINK} src {src}")
        ip_batch(ns, commands)
        return outside

    def route_nodes(self) -> None:
        """Every node's routes to the other nodes' pods (once all uplinks are up)."""
        for node in self.plan.nodes:
            ip_batch(
                self.run.node_ns(node.name),
                [f"route add {dest} via {via} dev {UPLINK}" for dest, via in routes(
                    self.plan, node.name)],
            )  # fmt: skip

    def build_pods(self, node: LabNode) -> list[LabPod]:
        pods = self.plan.pods_on(node.name)
        for number, pod in enumerate(pods, start=1):
            ns = self.run.pod_ns(pod)
            self._add_namespace(ns)
            self.host_veths[pod.name] = f"{HOST_VETH_PREFIX}{number}"
            plug_pod(self.run.node_ns(node.name), self.host_veths[pod.name], ns, pod.ipv4,
                     pod.ipv6)  # fmt: skip
        return list(pods)

    # -- processes --

    def start_servers(self, python: str, timeout: float = 60) -> int:
        """podserver.py in every pod that serves something; returns once all are bound."""
        for pod in self.plan.pods:
            if pod.client or not (pod.tcp_ports or pod.udp_ports):
                continue
            argv = in_netns(self.run.pod_ns(pod), [
                python, str(PODSERVER), "--name", pod.full_name, "--http",
                "--tcp", ",".join(map(str, pod.tcp_ports)),
                "--udp", ",".join(map(str, pod.udp_ports)),
            ])  # fmt: skip
            log_path = self.run.workdir / f"pod-{pod.name}.log"
            with open(log_path, "wb") as log:
                self.servers[pod.name] = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                    start_new_session=True,  # Ctrl-C reaches the lab, which stops them
                )  # fmt: skip
        waiting = {proc.stdout: name for name, proc in self.servers.items() if proc.stdout}
        deadline = time.monotonic() + timeout
        while waiting:
            remaining = deadline - time.monotonic()
            ready, _, _ = select.select(list(waiting), [], [], max(0.0, remaining))
            if not ready:
                raise LabError(f"pod servers not ready within {timeout:.0f} s: "
                               + ", ".join(sorted(waiting.values())))  # fmt: skip
            for pipe in ready:
                name = waiting.pop(pipe)
                line = pipe.readline().decode(errors="replace").strip()
                pipe.close()
                if line != "ready":
                    log = (self.run.workdir / f"pod-{name}.log").read_text(errors="replace")
                    raise LabError(f"the server of pod {name} did not start: {log.strip()}")
        return len(self.servers)

    def start_agent(
        self, node: LabNode, argv: list[str], env: dict[str, str], cwd: Path | None = None
    ) -> Agent:
        log_path = self.run.workdir / f"agent-{node.name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                in_netns(self.run.node_ns(node.name), argv),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env,
                cwd=cwd, start_new_session=True,
            )  # fmt: skip
        agent = Agent(node.name, proc, log_path)
        self.agents[node.name] = agent
        return agent

    def wait_for_agents(self, timeout: float, on_ready: Callable[[Agent], None]) -> None:
        """Until every agent programmed its first state; on_ready as each gets there."""
        pending = dict(self.agents)
        deadline = time.monotonic() + timeout
        while pending:
            for name, agent in list(pending.items()):
                if agent.poll():
                    del pending[name]
                    on_ready(agent)
                elif agent.proc.poll() is not None:
                    agent.poll()
                    raise LabError(
                        f"the agent on {name} exited {agent.proc.returncode} before it "
                        f"programmed anything; its log ({agent.log_path}):\n{agent.tail()}"
                    )
            if pending and time.monotonic() > deadline:
                name, agent = next(iter(pending.items()))
                raise LabError(
                    f"the agent on {name} programmed nothing within {timeout:.0f} s; its log "
                    f"({agent.log_path}):\n{agent.tail()}"
                )
            time.sleep(0.1)

    def requests(
        self, client: LabPod | LabOutside, python: str, items: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Run podclient.py in client's namespace (a pod's or the outside client's) with
        these items; its results by id."""
        if not items:
            return {}
        budget = sum(
            int(i["n"]) * (float(i["timeout"]) + 0.5) for i in items
        ) + 30  # fmt: skip
        out = run_command(
            in_netns(self.run.pod_ns(client), [python, str(PODCLIENT), "items"]),
            input=json.dumps({"items": items}), timeout=budget,
        )  # fmt: skip
        return json.loads(out.strip().splitlines()[-1])

    def node_addresses(self, node: str) -> set[str]:
        """Every address configured in node's namespace (any interface, both families):
        what a backend may see as the source of traffic the node translated."""
        return addresses(self.run.node_ns(node))

    def close(self) -> list[str]:
        """Stop what this process started, then remove the whole run; what went wrong."""
        for proc in [*self.servers.values(), *(a.proc for a in self.agents.values())]:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in [*self.servers.values(), *(a.proc for a in self.agents.values())]:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.servers.clear()
        self.agents.clear()
        return remove_run(self.run).problems


# -- finding and removing runs (also `lab down`) --


@dataclass
class Removal:
    """What remove_run took away, and what it could not."""

    processes: int = 0
    namespaces: int = 0
    pin_dirs: int = 0
    problems: list[str] = field(default_factory=list)


def namespaces_of(run: Run) -> list[str]:
    return namespaces_with(run.prefix)


def pin_dirs_of(run: Run) -> list[Path]:
    try:
        return sorted(p for p in BPFFS.iterdir() if p.name.startswith(f"{PIN_PREFIX}{run.id}-"))
    except OSError:
        return []


def remove_run(run: Run) -> Removal:
    """Stop every process in the run's namespaces, delete them, its pins and record."""
    removal = Removal()
    namespaces = namespaces_of(run)
    pids = {pid for ns in namespaces for pid in pids_in(ns)}
    removal.processes = len(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if alive(pid)}
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for ns in namespaces:
        try:
            run_command(["ip", "netns", "delete", ns])
            removal.namespaces += 1
        except LabError as err:
            removal.problems.append(str(err))
    for pin_dir in pin_dirs_of(run):
        try:
            shutil.rmtree(pin_dir)
            removal.pin_dirs += 1
        except OSError as err:
            removal.problems.append(f"removing {pin_dir}: {err}")
    shutil.rmtree(run.workdir, ignore_errors=True)
    return removal


def existing_runs() -> list[Run]:
    """Every run with a namespace, a pin directory or a record on this machine."""
    ids: set[str] = set()
    with contextlib.suppress(FileNotFoundError):
        names = os.listdir("/run/netns")
        ids.update(m.group(1) for n in names if (m := _RUN_OF_NAMESPACE.match(n)))
    with contextlib.suppress(OSError):
        ids.update(m.group(1) for p in BPFFS.iterdir() if (m := _RUN_OF_PIN.match(p.name)))
    with contextlib.suppress(FileNotFoundError):
        ids.update(p.name for p in RUNS_DIR.iterdir() if RUN_ID.match(p.name))
    return [Run(i) for i in sorted(ids)]


def owner_running(run: Run) -> int | None:
    """The pid of the `lab` process that is still building or using run, if any (a kept
    run's lab process has exited)."""
    try:
        record = json.loads(run.record.read_text())
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid == os.getpid() or not alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return pid if b"lab" in cmdline else None


def python_for_children() -> str:
    """The interpreter the agents, servers and clients run with: this one."""
    return sys.executable
