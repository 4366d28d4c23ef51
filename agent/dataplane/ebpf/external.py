"""External traffic in the eBPF dataplane, the pure part: what the kbp_src_ranges and
kbp_config maps hold for a NodeState, and which interfaces are the node's external ones.

The programs on external interfaces (bpf/tc_ext.c, bpf/xdp_ext.c) read these maps;
writer.py writes them beside the service maps.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ...model.nodestate import Changes, NodeState, ServiceEntry
from .abi import addr_bytes, const, packer, port_bytes
from .maps import FrontendKey
from .options import DEFAULT_SNAT_PORTS, SocketLb
from .translate import source_ranged_keys

_SRC_RANGE_KEY = packer("kbp_src_range_key")
_SRC_RANGE = packer("kbp_src_range")
_CONFIG = packer("kbp_config")

# kbp_config.sock_lb of each --socket-lb.
SOCKET_LB_BITS = {
    SocketLb.ALL: const.KBP_SOCK_LB_HOST | const.KBP_SOCK_LB_PODS,
    SocketLb.HOST: const.KBP_SOCK_LB_HOST,
    SocketLb.OFF: 0,
}


@dataclass(frozen=True, slots=True)
class SourceRange:
    """One kbp_src_ranges entry: a LoadBalancer frontend and a client network it admits."""

    frontend: FrontendKey
    network: str  # normalised CIDR of the frontend's family

    def key(self) -> bytes:
        net = ipaddress.ip_network(self.network)
        f = self.frontend
        return _SRC_RANGE_KEY.pack(
            const.KBP_SRC_RANGE_FRONTEND_BITS + net.prefixlen,
            addr_bytes(f.addr),
            port_bytes(f.port),
            f.proto,
            f.family,
            addr_bytes(str(net.network_address)),
        )

    def value(self) -> bytes:
        return _SRC_RANGE.pack(ipaddress.ip_network(self.network).prefixlen)


def source_ranges(state: NodeState) -> set[SourceRange]:
    """Every (LoadBalancer frontend, admitted network) of the state. A frontend shared by
    two entries is programmed for the first (translate.py's rule), and so are its ranges."""
    found: set[SourceRange] = set()
    claimed: set[FrontendKey] = set()
    for entry in state.services:
        for key, networks in source_ranged_keys(entry).items():
            if key in claimed:
                continue
            claimed.add(key)
            found.update(SourceRange(key, n) for n in networks)
    return found


class SourceRangeIndex:
    """`source_ranges` of successive NodeStates at the cost of the entries that changed:
    the entries that went and came since the state looked at last (`Changes.since`) are
    applied; a resync, and a change to a frontend that more than one entry ranges (the
    first one wins, which depends on every entry's order), rescans."""

    # Above this share of changed entries a scan is as cheap as the bookkeeping.
    RESCAN_FRACTION = 0.25

    def __init__(self) -> None:
        self._entries: tuple[ServiceEntry, ...] = ()
        self._revision = ""  # of the state `_entries` came from
        self._ranges: set[SourceRange] = set()
        self._owners: dict[FrontendKey, int] = {}  # ranged frontend → entries ranging it

    def update(self, state: NodeState, rescan: bool = False) -> frozenset[SourceRange]:
        """The source ranges of `state` (a copy: later updates leave it alone)."""
        entries = state.services
        if rescan or not self._incremental(state):
            self._scan(entries)
        self._entries, self._revision = entries, state.revision
        return frozenset(self._ranges)

    def _scan(self, entries: tuple[ServiceEntry, ...]) -> None:
        self._ranges = set()
        self._owners = {}
        for entry in entries:
            for key, networks in source_ranged_keys(entry).items():
                self._owners[key] = self._owners.get(key, 0) + 1
                if self._owners[key] == 1:
                    self._ranges.update(SourceRange(key, n) for n in networks)

    def _incremental(self, state: NodeState) -> bool:
        """Apply the entries that went and came (`Changes.since`); False: rescan instead."""
        delta = Changes.since(self._revision, self._entries or None, state)
        if delta.full:
            return False
        if len(delta.went) + len(delta.came) > self.RESCAN_FRACTION * max(len(state.services), 1):
            return False
        went = [source_ranged_keys(e) for e in delta.went]
        came = [source_ranged_keys(e) for e in delta.came]
        owners = dict(self._owners)
        for ranged in went:
            for key in ranged:
                owners[key] -= 1
        for ranged in came:
            for key in ranged:
                owners[key] = owners.get(key, 0) + 1
        touched = {key for ranged in (*went, *came) for key in ranged}
        if any(owners[key] > 1 or self._owners.get(key, 0) > 1 for key in touched):
            return False
        for ranged in went:
            for key, networks in ranged.items():
                self._ranges.difference_update(SourceRange(key, n) for n in networks)
        for ranged in came:
            for key, networks in ranged.items():
                self._ranges.update(SourceRange(key, n) for n in networks)
        self._owners = {key: n for key, n in owners.items() if n}
        return True


def _first_of_family(addresses: Iterable[str], v6: bool) -> str | None:
    return next((a for a in addresses if (":" in a) == v6), None)


def _cidr_of_family(cidrs: Iterable[str], v6: bool) -> tuple[bytes, int]:
    for cidr in cidrs:
        if (":" in cidr) == v6:
            net = ipaddress.ip_network(cidr, strict=False)
            return addr_bytes(str(net.network_address)), net.prefixlen
    return bytes(16), 0


def config_value(
    node_addresses: Iterable[str],
    cluster_cidrs: Iterable[str],
    netns_cookie: int,
    snat_ports: tuple[int, int] = DEFAULT_SNAT_PORTS,
    socket_lb: SocketLb = SocketLb.ALL,
    ct_lifetimes: tuple[int, int, int, int, int, int] = (0, 0, 0, 0, 0, 0),
    handoff: bool = False,
) -> bytes:
    """struct kbp_config: the first (primary) node address of each family is the SNAT
    source; the first cluster CIDR of each family tells pods of the cluster apart;
    `socket_lb` (--socket-lb) says whose sockets the socket hooks translate.
    `ct_lifetimes`: seconds per conntrack state (conntrack.Timeouts.lifetimes(); 0: the
    datapath never judges that state expired). `handoff`: a takeover from netfilter is
    under way (handoff.py)."""
    addresses = list(node_addresses)
    cidrs = list(cluster_cidrs)
    v4 = _first_of_family(addresses, v6=False)
    v6 = _first_of_family(addresses, v6=True)
    pod4, pod4_len = _cidr_of_family(cidrs, v6=False)
    pod6, pod6_len = _cidr_of_family(cidrs, v6=True)
    return _CONFIG.pack(
        addr_bytes(v4) if v4 else bytes(16),
        addr_bytes(v6) if v6 else bytes(16),
        netns_cookie,
        snat_ports[0],
        snat_ports[1],
        pod4_len,
        pod6_len,
        SOCKET_LB_BITS[socket_lb],
        int(handoff),
        pod4,
        pod6,
        *ct_lifetimes,
    )


def interfaces_with(addresses: Mapping[str, Iterable[str]], wanted: Iterable[str]) -> set[str]:
    """Names of the interfaces that carry any of the `wanted` addresses (the default
    external interfaces: those holding the node's NodePort addresses)."""
    want = {str(ipaddress.ip_address(a)) for a in wanted}
    return {name for name, ips in addresses.items() if want.intersection(ips)}
