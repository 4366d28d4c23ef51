"""The namespace toolkit every lab is built with: the `lab` command (netns.py), and under
it the kernel tests' and the benchmarks' labs (tests/lab/: their cleanup list, cgroups and
process helpers live there, outside the shipped package).

It wires network namespaces, veths, addresses and routes and runs commands inside a
namespace. Nothing here acts on the machine's own network namespace: every `ip` command
names a namespace the caller made, and every command run "in" a namespace is wrapped in
nsenter.

The wiring shared by the labs (a Calico-style node and its pods):

    node ns   forwarding on, rp_filter off, no DAD (node_sysctls)
              lo: 169.254.1.1/32          the pods' IPv4 gateway
              kbpsink                     a veth whose peer stays down and which resolves
                                          no neighbours: what is routed there vanishes
    pod ns    eth0, peer of the node's host veth (born inside the pod namespace, so no
              other `eth0` exists in the node); /32 and /128 on it, default routes via
              169.254.1.1 (onlink) and fe80::1; the host veth has fe80::1/64 and
              proxy_arp, and the node a route per pod address into it
    wire      a veth from a bridge port to eth0 in another namespace, tx checksum
              offload off (see `wire`)
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

HERE = Path(__file__).parent
PODSERVER = HERE / "podserver.py"
PODCLIENT = HERE / "podclient.py"
BPFFS = Path("/sys/fs/bpf")

BRIDGE = "br0"
UPLINK = "eth0"
POD_IFNAME = "eth0"
HOST_VETH_PREFIX = "vethkbp"
SINK = "kbpsink"
GATEWAY_IPV4 = "169.254.1.1"
GATEWAY_IPV6 = "fe80::1"

NO_DAD = {"net.ipv6.conf.all.accept_dad": 0, "net.ipv6.conf.default.accept_dad": 0}
NO_RP_FILTER = {"net.ipv4.conf.all.rp_filter": 0, "net.ipv4.conf.default.rp_filter": 0}
# Source ports that tests and benchmarks bind on purpose (a fixed 5-tuple) are reserved, so
# no ephemeral connect() made earlier in the namespace (nor its TIME_WAIT) holds one when
# the fixed-port client binds it (which would fail with EADDRINUSE).
FIXED_CLIENT_PORTS = {"net.ipv4.ip_local_reserved_ports": "40000-41999"}
POD_SYSCTLS: dict[str, str | int] = {**NO_RP_FILTER, **NO_DAD, **FIXED_CLIENT_PORTS}
NODE_SYSCTLS: dict[str, str | int] = {
    "net.ipv4.ip_forward": 1,
    "net.ipv6.conf.all.forwarding": 1,
    **POD_SYSCTLS,
}


class LabError(Exception):
    """Building or using a lab failed; the message has the command and its stderr."""


# -- commands --


def run(argv: Sequence[str], *, input: str | None = None, timeout: float = 60) -> str:
    """Run argv to completion (input on its stdin); its stdout, or LabError with the
    command and its stderr when it fails."""
    try:
        proc = subprocess.run(
            list(argv), input=input, capture_output=True, text=True, timeout=timeout,
            check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LabError(f"`{' '.join(argv)}`: {err}") from err
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip()
        raise LabError(f"`{' '.join(argv)}` exited {proc.returncode}: {detail}")
    return proc.stdout


def in_netns(ns: str, argv: Sequence[str]) -> list[str]:
    """argv in ns's network namespace only: unlike `ip netns exec`, nsenter keeps this
    mount namespace, so /sys/fs/bpf stays visible."""
    return ["nsenter", f"--net=/run/netns/{ns}", "--", *argv]


def ip_batch(ns: str, commands: Iterable[str]) -> None:
    """Several `ip` commands in one process, inside namespace ns."""
    lines = list(commands)
    if lines:
        run(["ip", "-n", ns, "-batch", "-"], input="\n".join(lines) + "\n")


def sysctl(ns: str, settings: dict[str, str | int]) -> None:
    """Set these sysctls (name → value) in namespace ns, in one process."""
    if settings:
        run(in_netns(ns, ["sysctl", "-q", "-w", *(f"{k}={v}" for k, v in settings.items())]))


def addresses(ns: str) -> set[str]:
    """Every address configured in ns (any interface, both families)."""
    links = json.loads(run(["ip", "-n", ns, "-j", "addr"]))
    return {a["local"] for link in links for a in link.get("addr_info", ()) if "local" in a}


def namespaces_with(prefix: str) -> list[str]:
    """The network namespaces whose name starts with prefix."""
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix))


# -- processes --


def alive(pid: int) -> bool:
    """Whether pid still runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().split(b") ", 1)[1][:1] != b"Z"
    except (OSError, IndexError):
        return False


def pids_in(ns: str) -> list[int]:
    try:
        out = run(["ip", "netns", "pids", ns], timeout=10)
    except LabError:
        return []
    return [int(pid) for pid in out.split()]


# -- wiring --


def bridge(ns: str, options: str = "") -> None:
    """lo and a bridge br0 in ns, both up."""
    ip_batch(ns, ["link set lo up", f"link add {BRIDGE} type bridge {options}".strip(),
                  f"link set {BRIDGE} up"])  # fmt: skip


def wire(bridge_ns: str, port: str, ns: str, ifname: str = UPLINK) -> None:
    """A veth from the bridge (port, up) to ns, where it is born as `ifname` (so no other
    interface of that name ever exists there), standing in for a wire to a switch.

    A wire carries complete checksums; a veth with tx checksum offload on hands
    CHECKSUM_PARTIAL packets on, whose L4 field holds only the pseudo-header sum. An XDP
    program on the receiving side sees no skb to ask about that and updates checksums as
    complete ones, so every sender on the bridge computes them in software, as a NIC's
    receive path would get them."""
    run(["ip", "-n", bridge_ns, "link", "add", port, "type", "veth",
         "peer", "name", ifname, "netns", ns])  # fmt: skip
    ip_batch(bridge_ns, [f"link set {port} master {BRIDGE} up"])
    run(in_netns(ns, ["ethtool", "-K", ifname, "tx", "off"]))


def node_base(ns: str) -> list[str]:
    """The `ip` commands of a node's own wiring: lo up with the pods' IPv4 gateway, and
    the sink. Run them after sysctl(ns, NODE_SYSCTLS), before any other link exists, so
    every link inherits those defaults."""
    return [
        "link set lo up",
        f"addr add {GATEWAY_IPV4}/32 dev lo",
        f"link add {SINK} type veth peer name {SINK}-peer",
        f"link set {SINK} arp off up",
    ]


def sink_route(address_or_prefix: str) -> str:
    """The `ip` command routing an address (or a prefix) into the node's sink."""
    if "/" not in address_or_prefix:
        address_or_prefix += "/128" if ":" in address_or_prefix else "/32"
    return f"route add {address_or_prefix} dev {SINK}"


def plug_pod(node_ns: str, host: str, pod_ns: str, ipv4: str | None, ipv6: str | None) -> None:
    """The pod namespace's eth0 as the peer of `host` in the node, addressed and routed
    as the module docstring says (pod_ns exists already)."""
    run(["ip", "-n", node_ns, "link", "add", host, "type", "veth",
         "peer", "name", POD_IFNAME, "netns", pod_ns])  # fmt: skip
    sysctl(node_ns, {f"net.ipv4.conf.{host}.proxy_arp": 1})
    node = [f"addr add {GATEWAY_IPV6}/64 dev {host} nodad", f"link set {host} up"]
    pod = ["link set lo up", f"link set {POD_IFNAME} up"]
    if ipv4:
        node.append(f"route add {ipv4}/32 dev {host}")
        pod += [f"addr add {ipv4}/32 dev {POD_IFNAME}",
                f"route add default via {GATEWAY_IPV4} dev {POD_IFNAME} onlink"]  # fmt: skip
    if ipv6:
        node.append(f"route add {ipv6}/128 dev {host}")
        pod += [f"addr add {ipv6}/128 dev {POD_IFNAME} nodad",
                f"route add default via {GATEWAY_IPV6} dev {POD_IFNAME}"]  # fmt: skip
    ip_batch(node_ns, node)
    ip_batch(pod_ns, pod)
