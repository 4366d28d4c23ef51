"""A two-node namespace lab for external traffic: two node namespaces (tests/lab/nodelab.py
nodes with their pods) and outside clients on one bridged segment, an agent per node, and
clients that run outside, in a pod, or as the node itself.

Address plan (everything lives in namespaces this lab made; the machine's own interfaces,
addresses and routes are never touched). NAME is kbp-lab-<pid>-ext<k>, so the leak check
`nodelab.lab_namespaces()` sees these namespaces too:

    bridge     NAME-bridge                  br0 (STP and multicast snooping off), with the
                                            bridge ends of every eth0 below; those of the
                                            nodes carry a native XDP_PASS program (see
                                            ExtLab._attach_xdp_pass)
    node-a     a tests/lab/nodelab.py node (node 1), plus
               eth0: 192.0.2.10/24, 2001:db8::10/64 (nodad)     its external interface
               10.244.2.0/24 via 192.0.2.11, fd00:244:2::/64 via 2001:db8::11
               203.0.113.0/24 dev kbpsink   (see below)
               pods 10.244.1.<n>, fd00:244:1::<n> on vethkbp<n>; pod CIDRs 10.244.1.0/24,
               fd00:244:1::/64
    node-b     the same as node 2: eth0 192.0.2.11/24, 2001:db8::11/64; the routes point
               at node-a's addresses; pods 10.244.2.<n>, fd00:244:2::<n>
    outside-1  NAME-outside-1                eth0: 192.0.2.100/24, 2001:db8::100/64
    outside-2  NAME-outside-2                eth0: 192.0.2.101/24, 2001:db8::101/64
               both: 203.0.113.9/32 (LoadBalancer VIP) and 203.0.113.7/32 (ExternalIP)
               via 192.0.2.10, as a router in front of the cluster would send them;
               tests add routes of their own with ExtLab.route_via (e.g. a VIP via
               node-b, as an upstream load balancer spreads flows over the nodes)

No node owns a VIP or an ExternalIP (no address is configured for them): the dataplane
must recognise them. A node routes 203.0.113.0/24 into the lab's `kbpsink`, as it does the
ClusterIP ranges, for the same reason: traffic for them that nothing translated reaches
the FORWARD hook (where the iptables dataplane DROPs what loadBalancerSourceRanges refuse)
and then vanishes, instead of earning an ICMP unreachable from a missing route. A real
node would forward it along its default route; the lab never lets it leave.

"The node itself" is a process in the node's network namespace inside the node's own
cgroup2 directory (kbp-test-<pid>-<n> under the cgroup2 mount), which the eBPF agent gets
as `--cgroup-root`: its socket hooks see exactly those processes.

Backends in this lab run agent/lab/podserver.py with --report-peer: each answer is
"<pod name> <peer address the pod saw>", so a client learns both which pod
served it and whether its source address was translated. agent/lab/podclient.py
counts those answers as they are.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.lab.toolkit import (
    BPFFS,
    FIXED_CLIENT_PORTS,
    NO_DAD,
    addresses,
    bridge,
    in_netns,
    ip_batch,
    run,
    sink_route,
    wire,
)
from tests.lab.kit import Built, cgroup2_mount, in_cgroup
from tests.lab.nodelab import NAMESPACE_PREFIX, Lab, Pod, Result, client_argv, client_result

from .agentproc import AgentProcess, run_argv
from .agentproc import cli as agent_cli

log = logging.getLogger(__name__)

EXTERNAL_IFNAME = "eth0"
EXTERNAL_IPV4_CIDR = "203.0.113.0/24"  # VIPs and ExternalIPs: routed into the sink on nodes
LB_VIP = "203.0.113.9"
EXTERNAL_IP = "203.0.113.7"
CLUSTER_CIDRS = ("10.244.0.0/16", "fd00:244::/32")  # --cluster-cidr of both agents
DATAPLANES = ("iptables", "nftables", "ebpf", "ebpf-noxdp")
MAGLEV_TABLE_SIZE = 251
NETFILTER = ("iptables", "nftables")  # the dataplanes that program netfilter
XDP_MODES = {"ebpf": "native", "ebpf-noxdp": "false"}  # --xdp of each eBPF dataplane
# The program on the bridge ends of the nodes' eth0s (ExtLab._attach_xdp_pass). Not kbp_:
# nothing of the agent's own may match it.
XDP_PASS_NAME = "lab_xdp_pass"
XDP_PASS_C = f"int {XDP_PASS_NAME}(struct xdp_md *ctx) {{ return XDP_PASS; }}"


@dataclass(frozen=True)
class NodePlan:
    """One node's place in the address plan."""

    name: str  # the Node object's name (--node)
    number: int  # tests/lab/nodelab.py node number: pods are 10.244.<number>.<n>
    ipv4: str
    ipv6: str


NODE_PLANS = (
    NodePlan("node-a", 1, "192.0.2.10", "2001:db8::10"),
    NodePlan("node-b", 2, "192.0.2.11", "2001:db8::11"),
)
OUTSIDE_PLANS = {"outside-1": ("192.0.2.100", "2001:db8::100"),
                 "outside-2": ("192.0.2.101", "2001:db8::101")}  # fmt: skip

_labs = itertools.count()
_cgroups = itertools.count()


def pod_cidrs(number: int) -> tuple[str, str]:
    return f"10.244.{number}.0/24", f"fd00:244:{number}::/64"


def answers(result: Result) -> Counter[tuple[str, str]]:
    """(serving pod, source address it saw) → answers, from `serve`'s replies."""
    seen: Counter[tuple[str, str]] = Counter()
    for reply, count in result.counts.items():
        pod, _, peer = reply.partition(" ")
        seen[pod, peer] += count
    return seen


@dataclass
class Node:
    """One node: a tests/lab/nodelab.py Lab whose namespace also has eth0 on the bridge."""

    plan: NodePlan
    lab: Lab
    pin_dir: Path  # --bpffs of this node's agent
    cgroup: Path  # the node's own processes (--cgroup-root of its eBPF agent)
    agent: AgentProcess | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def ns(self) -> str:
        return self.lab.node_ns

    def run(self, *argv: str, timeout: float = 30) -> str:
        return self.lab.run_in_node(*argv, timeout=timeout)

    def addresses(self) -> set[str]:
        """Every address configured in the node namespace (any interface, both families)."""
        return addresses(self.ns)

    def agent_flags(self, dataplane: str) -> list[str]:
        """The eBPF-specific and per-node settings of this node's agent."""
        flags = ["--bpffs", str(self.pin_dir)]
        if dataplane.startswith("ebpf"):
            flags += [
                "--external-interfaces", EXTERNAL_IFNAME,
                "--cgroup-root", str(self.cgroup),
                f"--xdp={XDP_MODES[dataplane]}",
            ]  # fmt: skip
        return flags

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        """`kube-bpf-proxy ARGS` in the node namespace (not in the node's cgroup)."""
        return agent_cli(self.ns, *args, timeout=timeout)


class ExtLab(Built):
    """Both nodes, the bridge and the outside clients; a context manager that stops the
    agents and removes everything (namespaces, pins, cgroups) on exit, also when building
    it failed half-way."""

    def __init__(self) -> None:
        self.name = f"{NAMESPACE_PREFIX}{os.getpid()}-ext{next(_labs)}"
        super().__init__(f"ext lab {self.name}")
        self.bridge_ns = f"{self.name}-bridge"
        self.outside = {name: f"{self.name}-{name}" for name in OUTSIDE_PLANS}
        self.nodes: dict[str, Node] = {}
        self.dataplane: str | None = None

    # -- lifecycle --

    def _plug(self, ns: str, bridge_end: str, *, xdp_tx_peer: bool = False) -> None:
        """A wire from the bridge to ns, named eth0 there. `xdp_tx_peer`: eth0 runs the
        agent's XDP program, whose XDP_TX sends frames back into bridge_end (the XDP
        rewrite that needs complete checksums: bpf/lib/nat.h nat_rewrite_frame)."""
        wire(self.bridge_ns, bridge_end, ns, EXTERNAL_IFNAME)
        if xdp_tx_peer:
            self._attach_xdp_pass(bridge_end)

    def _attach_xdp_pass(self, bridge_end: str) -> None:
        """Attach a native XDP program that passes everything to the bridge end of a node's
        eth0, so that frames the node's native XDP program sends back out (XDP_TX) reach
        the bridge at once.

        Why: a native XDP_TX on a veth puts the frame in the peer's xdp_ring, and the
        flush that follows (drivers/net/veth.c veth_xdp_flush) schedules the peer's NAPI
        only when the peer has an XDP program of its own. With just NAPI (GRO on) the
        frame waits in the ring until the next ordinary packet from the node's stack
        (veth_xmit) schedules that NAPI: the client times out although kbp_xdp_stats
        counted `tx` and ethtool counted xdp_tx with no xdp_tx_errors. (XDP_REDIRECT goes
        through ndo_xdp_xmit, which flushes without that condition.) A NIC's XDP_TX has
        no such peer; in the lab this program stands in for the wire taking the frame."""
        path = self._xdp_pass_pin()
        run(in_netns(self.bridge_ns, ["ip", "link", "set", "dev", bridge_end, "xdpdrv",
                                      "pinned", str(path)]))  # fmt: skip

    def _xdp_pass_pin(self) -> Path:
        """The XDP_PASS program, loaded once per lab and pinned in the lab's own bpffs
        directory (the attachments keep it loaded; the pin goes with the lab)."""
        pin_dir = BPFFS / f"kbp-test-ext-{self.name.removeprefix(NAMESPACE_PREFIX)}-wire"
        path = pin_dir / "xdp_pass"
        if path.exists():
            return path
        # Imported late, as the agent's loader does: collecting tests must not need bcc
        # (a kernel-test prerequisite, checked by tests/conftest.py).
        from bcc import BPF

        from agent.dataplane.ebpf import libbpf

        pin_dir.mkdir()
        self.undo.pin_dir(pin_dir)
        module = BPF(text=XDP_PASS_C.encode())
        try:
            function = module.load_func(XDP_PASS_NAME.encode(), BPF.XDP)
            libbpf.obj_pin(function.fd, str(path))
        finally:
            module.cleanup()
        return path

    def _build(self) -> None:
        mount = cgroup2_mount()
        self.undo.namespace(self.bridge_ns, NO_DAD)
        bridge(self.bridge_ns, "stp_state 0 mcast_snooping 0")
        for plan in NODE_PLANS:
            lab = Lab(plan.number)
            self.undo.push(f"closing node {plan.name}", lab.close)
            lab.__enter__()  # lab.py's node: sysctls, lo gateway, kbpsink, ClusterIP routes
            self._plug(lab.node_ns, f"{plan.name[-1]}-{EXTERNAL_IFNAME}", xdp_tx_peer=True)
            (peer,) = [p for p in NODE_PLANS if p is not plan]
            peer_v4, peer_v6 = pod_cidrs(peer.number)
            ip_batch(lab.node_ns, [
                f"addr add {plan.ipv4}/24 dev {EXTERNAL_IFNAME}",
                f"addr add {plan.ipv6}/64 dev {EXTERNAL_IFNAME} nodad",
                f"link set {EXTERNAL_IFNAME} up",
                f"route add {peer_v4} via {peer.ipv4} dev {EXTERNAL_IFNAME}",
                f"route add {peer_v6} via {peer.ipv6} dev {EXTERNAL_IFNAME}",
                sink_route(EXTERNAL_IPV4_CIDR),
            ])  # fmt: skip
            cgroup = self.undo.cgroup(mount / f"kbp-test-{os.getpid()}-{next(_cgroups)}")
            pin_dir = self.undo.pin_dir(
                BPFFS / f"kbp-test-ext-{os.getpid()}-{time.monotonic_ns()}-{plan.name}"
            )
            self.nodes[plan.name] = Node(plan, lab, pin_dir, cgroup)
        for number, (name, (ipv4, ipv6)) in enumerate(OUTSIDE_PLANS.items(), start=1):
            ns = self.undo.namespace(self.outside[name],
                                        {**NO_DAD, **FIXED_CLIENT_PORTS,
                                         "net.ipv4.conf.all.rp_filter": 0})  # fmt: skip
            self._plug(ns, f"o{number}-{EXTERNAL_IFNAME}")
            via = NODE_PLANS[0].ipv4
            ip_batch(ns, [
                "link set lo up",
                f"addr add {ipv4}/24 dev {EXTERNAL_IFNAME}",
                f"addr add {ipv6}/64 dev {EXTERNAL_IFNAME} nodad",
                f"link set {EXTERNAL_IFNAME} up",
                f"route add {LB_VIP}/32 via {via} dev {EXTERNAL_IFNAME}",
                f"route add {EXTERNAL_IP}/32 via {via} dev {EXTERNAL_IFNAME}",
            ])  # fmt: skip

    def close(self) -> list[str]:
        """Stop agents, then undo the build: pins, cgroups, namespaces (links and routes
        go with them), the nodes' labs."""
        for node in self.nodes.values():
            if node.agent is not None:
                try:
                    node.agent.stop(signal.SIGKILL)
                except Exception:
                    log.exception("ext lab %s: stopping the agent of %s failed", self.name,
                                  node.name)  # fmt: skip
                node.agent = None
        return super().close()

    # -- pods and servers --

    def add_pod(self, node: str, name: str) -> Pod:
        return self.nodes[node].lab.add_pod(name)

    def serve(self, pod: Pod, ports: Sequence[int]) -> None:
        """podserver.py in the pod (TCP and UDP, both families), answering "<pod name>
        <peer address>"; returns once bound. The pod's lab stops it with the pod."""
        pod.serve(ports, report_peer=True)

    # -- agents --

    def start_agents(self, manifests: Path, dataplane: str) -> None:
        """`kube-bpf-proxy run` on both nodes; returns once each applied a first state."""
        if dataplane not in DATAPLANES:
            raise ValueError(f"dataplane must be one of {DATAPLANES}, not {dataplane!r}")
        self.dataplane = dataplane
        for node in self.nodes.values():
            argv = run_argv(
                manifests, node.name, dataplane if dataplane in NETFILTER else "ebpf",
                "--cluster-cidr", ",".join(CLUSTER_CIDRS),
                # A Maglev Service's table is this many slots per backend set: small, to
                # fit --map-size-slots, and still prime and far above the backend count.
                "--maglev-table-size", str(MAGLEV_TABLE_SIZE),
                *node.agent_flags(dataplane),
            )  # fmt: skip
            node.agent = AgentProcess(node.ns, argv, node.name)
        for node in self.nodes.values():
            assert node.agent is not None
            node.agent.wait_for_line("sync: applied revision")

    def stop_agents(self) -> dict[str, int]:
        """SIGTERM both agents; their exit statuses by node name."""
        statuses = {}
        for node in self.nodes.values():
            if node.agent is not None:
                statuses[node.name] = node.agent.stop()
                node.agent = None
        return statuses

    def cleanup(self, node: str) -> subprocess.CompletedProcess:
        """`kube-bpf-proxy cleanup` in the node namespace. It takes only --bpffs: it finds
        tc filters and XDP programs on every interface of the namespace by itself."""
        return self.nodes[node].cli("cleanup", "--bpffs", str(self.nodes[node].pin_dir))

    # -- clients --

    def connect(
        self, source: str | Pod, ip: str, port: int, proto: str = "tcp", n: int = 3,
        timeout: float = 2.0, source_port: int | None = None,
    ) -> Result:  # fmt: skip
        """n exchanges with ip:port, each a new flow, from `source`: "outside-1",
        "outside-2", a pod, or a node's name for the node itself (a process in the node's
        namespace and cgroup). `source_port` pins the client's port: every exchange is
        then the same 5-tuple (TCP closes each with a RST, leaving no TIME_WAIT)."""
        if isinstance(source, Pod):
            return source.connect_many(ip, port, proto, n, timeout, source_port=source_port)
        client = client_argv(ip, port, proto, n, timeout, source_port=source_port)
        if source in self.outside:
            return client_result(in_netns(self.outside[source], client), n, timeout)
        node = self.nodes[source]
        # Join the cgroup first, then become the client: everything it does is the node's.
        return client_result(in_cgroup(node.cgroup, in_netns(node.ns, client)), n, timeout)

    def route_via(self, source: str, prefix: str, node: str) -> None:
        """Route `prefix` from an outside namespace via a node's IPv4 address (replacing
        the route it had): which node an upstream router sends that traffic to."""
        via = self.nodes[node].plan.ipv4
        ip_batch(self.outside[source],
                 [f"route replace {prefix} via {via} dev {EXTERNAL_IFNAME}"])  # fmt: skip

    def http_get(self, source: str, url: str, timeout: float = 2.0) -> tuple[int, str]:
        """(status, body) of GET url from an outside namespace; status 0 when no answer."""
        proc = subprocess.run(
            in_netns(self.outside[source],
                     ["curl", "-s", "-m", str(timeout), "-w", "\n%{http_code}", url]),
            capture_output=True, text=True, timeout=timeout + 10, check=False,
        )  # fmt: skip
        body, _, status = proc.stdout.rpartition("\n")
        return int(status or 0), body
