"""The eBPF dataplane's options, declared beside the code that uses them: the map sizes,
the conntrack timeouts and the attach, XDP, socket hook and SNAT choices, each with its
default, range and the setting that sets it (agent/dataplane/options.py says how;
agent/config.py composes them into flags). `EbpfOptions` is what EbpfDataplane takes.

Pure Python: no kernel, cffi or bcc here (the CLI imports it for its flags).
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

from ..options import (
    between,
    duration,
    interface_globs,
    nested,
    option,
    pod_interfaces_option,
)
from .maglev import DEFAULT_TABLE_SIZE

# --- map sizes: one row each ------------------------------------------------------------

# The floor is Cilium's smallest table (1024); the ceilings keep a map's memory within
# what a node can give (a hash map preallocates every entry: 2^24 conntrack entries took
# 3.1 GB here; the per-CPU counters hold one entry per service id on every CPU). BPF's
# own limit, 2^32, is far beyond them.


@dataclass(frozen=True, slots=True)
class MapSizes:
    """max_entries of the sized maps, by map name without `kbp_`: the one table of their
    defaults and ranges. `services` also bounds service ids, which index the per-CPU
    counters array. Positional order is kept for callers that pass sizes in order."""

    services: int = option(65536, "--map-size-services", "frontend entries (and service ids)",
                           "N", check=between(1024, 1 << 20))  # fmt: skip
    slots: int = option(262144, "--map-size-slots", "backend slots over all Services, Maglev "
                        "tables included", "N", check=between(1024, 1 << 24))  # fmt: skip
    backends: int = option(262144, "--map-size-backends", "(Service port, endpoint) pairs",
                           "N", check=between(1024, 1 << 24))  # fmt: skip
    ct: int = option(262144, "--map-size-ct", "conntrack entries (two per connection, "
                     "three with a reply entry's spare; LRU)", "N",
                     check=between(1024, 1 << 24))  # fmt: skip
    affinity: int = option(65536, "--map-size-affinity", "sessionAffinity ClientIP entries "
                           "(LRU)", "N", check=between(1024, 1 << 24))  # fmt: skip
    src_ranges: int = 16384  # loadBalancerSourceRanges prefixes over all Services
    sock_rev: int = 65536  # kbp_sock_rev: the socket hooks' records without a slot
    ct_remap: int = 16384  # kbp_ct_remap: remapped flows' ports (rare, so small)
    svc_drops: int = 16384  # kbp_svc_drops: the most recently dropping (Service, reason)
    pods: int = 4096  # kbp_pods: pod network namespaces on this node


# The sizes a flag sets, in flag order.
FLAG_MAP_SIZES: tuple[str, ...] = tuple(f.name for f in fields(MapSizes) if "flag" in f.metadata)


def size_range(name: str) -> tuple[int, int]:
    """The range --map-size-<name> accepts."""
    check = next(f for f in fields(MapSizes) if f.name == name).metadata["check"]
    return check.low, check.high


# --- conntrack ---------------------------------------------------------------------------

# Flow states (conntrack.flow_state), each with its timeout below.
TCP_SYN = "syn-sent"  # TCP: no reply yet
TCP_ESTABLISHED = "established"  # TCP: a reply seen, no FIN/RST
TCP_CLOSE_WAIT = "close-wait"  # TCP: FIN seen in one direction (half closed)
TCP_TIME_WAIT = "time-wait"  # TCP: FIN seen both ways, or a RST
UDP_UNREPLIED = "unreplied"  # UDP: one way so far
UDP_ASSURED = "assured"  # UDP: a reply seen
STATES = (TCP_SYN, TCP_ESTABLISHED, TCP_CLOSE_WAIT, TCP_TIME_WAIT, UDP_UNREPLIED, UDP_ASSURED)


# fmt: off
@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds a flow may stay idle in each state (the --conntrack-* settings)."""

    tcp_syn: float = option(120.0, "--conntrack-tcp-timeout-syn",
        "eBPF conntrack: idle timeout of a TCP flow whose SYN got no answer yet "
        "(netfilter's SYN_SENT)",
        "DURATION", check=duration(1.0, 3600.0))
    tcp_established: float = option(86400.0, "--conntrack-tcp-timeout-established",
        "eBPF conntrack: idle timeout of an established TCP flow (kube-proxy's flag "
        "and default)",
        "DURATION", check=duration(60.0, 7 * 86400.0))
    tcp_close_wait: float = option(3600.0, "--conntrack-tcp-timeout-close-wait",
        "eBPF conntrack: idle timeout of a TCP flow with a FIN seen one way (half "
        "closed; kube-proxy's flag and default)",
        "DURATION", check=duration(1.0, 86400.0))
    tcp_time_wait: float = option(10.0, "--conntrack-tcp-timeout-time-wait",
        "eBPF conntrack: how long a TCP flow stays after FINs both ways or a RST "
        "(the entries only translate: a late segment still reaches its backend by the "
        "flow hash)",
        "DURATION", check=duration(1.0, 3600.0))
    udp: float = option(30.0, "--conntrack-udp-timeout",
        "eBPF conntrack: idle timeout of a UDP flow that got no reply yet (kube-proxy's "
        "flag; the kernel's default)",
        "DURATION", check=duration(1.0, 3600.0))
    udp_stream: float = option(120.0, "--conntrack-udp-timeout-stream",
        "eBPF conntrack: idle timeout of a UDP flow that got a reply (kube-proxy's "
        "flag; the kernel's default)",
        "DURATION", check=duration(1.0, 86400.0))
    # fmt: on

    def lifetimes(self) -> tuple[int, int, int, int, int, int]:
        """Whole seconds (rounded up) in kbp_config's order (ct_tcp_syn .. ct_udp_stream),
        for the datapath's take-over of tuples held by expired flows."""
        return tuple(  # type: ignore[return-value]
            min(math.ceil(v), 0xFFFFFFFF)
            for v in (self.tcp_syn, self.tcp_established, self.tcp_close_wait,
                      self.tcp_time_wait, self.udp, self.udp_stream)
        )  # fmt: skip

    def of(self, state: str) -> float:
        return {
            TCP_SYN: self.tcp_syn,
            TCP_ESTABLISHED: self.tcp_established,
            TCP_CLOSE_WAIT: self.tcp_close_wait,
            TCP_TIME_WAIT: self.tcp_time_wait,
            UDP_UNREPLIED: self.udp,
            UDP_ASSURED: self.udp_stream,
        }[state]


# --- the choices -------------------------------------------------------------------------


class SocketLb(enum.StrEnum):
    """--socket-lb: whose sockets the connect/sendmsg hooks translate (external.py gives
    each its kbp_config.sock_lb bits)."""

    ALL = "all"  # the node's and every pod's
    HOST = "host"  # the node's only; pods go through tc
    OFF = "off"  # nobody's


class Xdp(enum.StrEnum):
    """What --xdp asks for on the external interfaces: native then generic, one of them,
    or none. The flag spells AUTO `true` and OFF `false` (`XDP_WORDS`)."""

    AUTO = "auto"
    NATIVE = "native"
    GENERIC = "generic"
    OFF = "off"

    @classmethod
    def parse(cls, text: str) -> Xdp:
        """A flag's word (or a mode's own name) → the mode; ValueError naming the words."""
        word = str(text).strip().lower()
        mode = XDP_WORDS.get(word, word)
        try:
            return cls(mode)
        except ValueError:
            accepted = ", ".join([*XDP_WORDS, *(m.value for m in cls)])
            raise ValueError(f"--xdp must be one of {accepted}; got {text!r}") from None


# The flag's words (the first four, in help order) beside the modes' own names.
XDP_WORDS = {"true": Xdp.AUTO, "false": Xdp.OFF, "on": Xdp.AUTO}
XDP_FLAG_CHOICES = ("true", "false", Xdp.NATIVE.value, Xdp.GENERIC.value)


class TcAttach(enum.StrEnum):
    """--tc-attach: tcx links (kernel 6.6+), cls_bpf filters under clsact, or tcx where
    the kernel has it (netlink.TcAttacher)."""

    AUTO = "auto"
    TCX = "tcx"
    CLSACT = "clsact"


class PortRange(NamedTuple):
    """An inclusive range of ports, as (low, high)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> PortRange:
        """LOW-HIGH (or one port) within 1024-65535."""
        low, sep, high = str(text).strip().partition("-")
        if not _INTEGER.fullmatch(low) or (sep and not _INTEGER.fullmatch(high)):
            raise ValueError(f"{text!r} is not LOW-HIGH")
        first, last = int(low), int(high if sep else low)
        if not 1024 <= first <= last <= 65535:
            raise ValueError(f"{text!r} must lie within 1024-65535, low <= high")
        return cls(first, last)

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


_INTEGER = re.compile(r"[+-]?[0-9]+")

# SNAT source ports of external flows to other nodes: above Linux's default
# ip_local_port_range (32768-60999), so the node's own connections never take them, and
# away from the NodePort range (30000-32767). 4536 concurrent flows per backend and node
# address; --snat-port-range widens it.
DEFAULT_SNAT_PORTS = PortRange(61000, 65535)

# Cilium's choice of Maglev table sizes spans these primes (its default is ours, 16381).
MAGLEV_TABLE_SIZE_RANGE = (251, 131071)


def check_maglev_table_size(size: int) -> None:
    low, high = MAGLEV_TABLE_SIZE_RANGE
    if not low <= size <= high:  # first: a large prime would take long to test
        raise ValueError(f"{size} is out of range: {low} to {high}")
    if any(size % d == 0 for d in range(2, int(size**0.5) + 1)):
        raise ValueError(f"{size} is not a prime")


def _absolute(path: str) -> None:
    if not str(path).startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")


# --- what EbpfDataplane takes ----------------------------------------------------------


# fmt: off
@dataclass(frozen=True)
class EbpfOptions:
    """Everything EbpfDataplane is told. The fields a setting sets carry it; the others
    (`netns`, `watch`, `check_period`, `cgroup`, `explain_build`) are for the caller: the
    agent resolves --cgroup-root into `cgroup` and asks for explain's build (select.py),
    tests and tools set the rest."""

    pin_dir: Path = option(Path("/sys/fs/bpf/kube-bpf-proxy"), "--bpffs",
        "directory on a bpffs where the eBPF dataplane pins its maps (kbp_*_v<N>)",
        "DIR", written="/sys/fs/bpf/kube-bpf-proxy", parse=Path, check=_absolute)
    pod_interfaces: tuple[str, ...] = pod_interfaces_option()
    sizes: MapSizes = nested(MapSizes)
    maglev_table_size: int = option(DEFAULT_TABLE_SIZE, "--maglev-table-size",
        "slots of each Maglev table (a prime larger than a Service's backend count; "
        "more slots spread load more evenly and cost more map entries)",
        "PRIME", check=check_maglev_table_size)
    external_interfaces: tuple[str, ...] = option((), "--external-interfaces",
        "globs of the node's external interfaces, where the eBPF dataplane serves "
        "NodePort, LoadBalancer and ExternalIP traffic from outside (tc, and XDP); "
        "default: the interfaces that carry the node's --nodeport-addresses",
        "GLOB,...", parse=tuple, check=lambda globs: interface_globs(globs, required=False),
        comma=True)
    xdp: Xdp = option(Xdp.AUTO, "--xdp",
        "XDP on the external interfaces: true tries native mode, then generic; native "
        "or generic insist on one; false leaves external traffic to tc alone",
        written="true", parse=Xdp.parse, choices=XDP_FLAG_CHOICES)
    socket_lb: SocketLb = option(SocketLb.ALL, "--socket-lb",
        "whose sockets the eBPF dataplane's socket hooks translate at connect()/sendmsg(): "
        "all: the node's and every pod's (no per-packet NAT, no conntrack entry); host: "
        "the node's only, pods go through tc (for service meshes whose sidecars must see "
        "the ClusterIP); off: nobody's, pods go through tc and the node's own processes "
        "reach no Service",
        written=SocketLb.ALL.value, parse=SocketLb, choices=tuple(SocketLb))
    tc_attach: TcAttach | None = option(None, "--tc-attach",
        "how the eBPF dataplane attaches its tc programs: tcx, bpf_links pinned under "
        "--bpffs that run without the clsact qdisc (kernel 6.6+); clsact, cls_bpf "
        "filters; auto: tcx where the kernel has it, else clsact. Changing it moves "
        "every interface at the next start without a gap",  # None: $KBP_TC_ATTACH, else auto
        written=TcAttach.AUTO.value, parse=TcAttach, choices=tuple(TcAttach))
    snat_ports: PortRange = option(DEFAULT_SNAT_PORTS, "--snat-port-range",
        "source ports for external flows the eBPF dataplane forwards to backends on "
        "other nodes (SNAT to this node's address); keep it outside the node's "
        "net.ipv4.ip_local_port_range and the NodePort range",
        "LOW-HIGH", written=str(DEFAULT_SNAT_PORTS), parse=PortRange.parse)
    ct_timeouts: Timeouts = nested(Timeouts)
    ct_sweep_interval: float = option(0.0, "--conntrack-sweep-interval",
        "eBPF conntrack: how often the agent removes expired and closed flows from "
        "kbp_ct (0: never; the LRU alone then makes room)",
        "DURATION", written=10.0, check=duration(0.0, 3600.0))  # tools: 0, no sweeps
    cgroup: Path | None = None  # where the socket hooks serve; None: not attached
    netns: str | None = None  # the network namespace to attach in; None: this thread's
    watch: bool = True  # follow netlink for new interfaces
    # follow netlink for route, rule, link and neighbour changes (hops.HopEpoch), so the
    # programs keep a next hop until one; False: they keep it 100 ms
    watch_routes: bool = True
    check_period: float | None = None  # keeper.CHECK_PERIOD when None; 0: no checks
    # compile and pin explain's build after the first apply (kernel.ExplainBuild): the
    # agent does; tests and tools that build a dataplane of their own need no second
    # compile (explain compiles the build itself where none is pinned)
    explain_build: bool = False
    # fmt: on
