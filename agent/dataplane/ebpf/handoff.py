"""Taking a node's open connections over from kube-proxy without breaking one.

A connection kube-proxy's rules translated is held by netfilter: its conntrack entry has
the NAT (client -> frontend became client -> backend), and netfilter consults the nat
table only for a connection's first packet. Once our tc program serves the frontend, the
connection's next packet from the pod has no entry of ours and would be translated like
a lost flow: tc ingress on the pod's host veth runs before netfilter, so netfilter would
see a new tuple (client -> backend) whose reply tuple is the old entry's, and nf_nat
would remap the source port; the backend would answer a connection it does not know.
Even the same backend breaks it, so such packets must reach netfilter untranslated.

How (design (b) of issue 32; bcc cannot call the conntrack kfuncs, see docs/migration.md):

1. Before the first apply writes a frontend, kbp_config.handoff is set: while it is, a
   lost TCP segment (no entry of ours, not a SYN) is left to netfilter (lib/conntrack.h
   ct_handoff). A new connection's SYN meets our program and is ours from then on.
2. After the apply, the kernel's conntrack is read (`conntrack -L --dst-nat`, the tool
   the iptables dataplane already uses) and every DNAT flow whose original destination
   is one of the NodeState's frontends gets a forward entry in kbp_ct with backend_id
   KBP_CT_NETFILTER: its packets pass untranslated for as long as it lives
   (ct_left_to_netfilter), touched by the program so the collector keeps it; a FIN or
   RST lets it expire like any closing flow.
3. Then handoff is cleared. Every pod flow netfilter translated now has its entry, and
   netfilter translates no new pod flow (our program takes their SYNs first).
4. At every full resync, seeded entries whose kernel flow is gone are deleted.

Netfilter must keep tracking and translating those flows after kube-proxy's rules are
gone: conntrack runs in a network namespace only while something uses it (a DNAT or
MASQUERADE target, a conntrack match, an nftables `ct` or `nat` expression), and NAT
bindings are applied only at hooks where a nat table or chain is registered. Removing
kube-proxy's rules can take the last of both away (then the flows' packets are no longer
tracked: they keep the Service address and go nowhere). So while seeded flows live, the
agent holds the nftables table HOLD_TABLE (ip and ip6): nat chains at the four hooks, one
`ct state` rule each; it matches and changes nothing, and goes with the last flow.

UDP flows are seeded too, but the handoff bit cannot tell a UDP datagram of a flow
netfilter holds from a new flow's first one: a UDP flow whose first datagram passed
kube-proxy during the first apply is translated anew (a DNS query retries).

The cost on the fast path: one comparison of the forward entry's backend_id on packets
that found an entry; the config lookup only on the lost path.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass

from ...model.nodestate import NodeState
from .abi import addr_bytes, const, packer, port_bytes
from .libbpf import BPF_NOEXIST, Map

log = logging.getLogger(__name__)

_KEY = packer("kbp_ct_key")
_ENTRY = packer("kbp_ct_entry")
_PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP, "sctp": 132}
_NAMES = {number: name.upper() for name, number in _PROTOCOLS.items()}
COMMAND_TIMEOUT = 60.0
_OVER = ("TIME_WAIT", "CLOSE")  # TCP states of netfilter's flows that are over


@dataclass(frozen=True)
class KernelFlow:
    """One DNAT flow of the kernel's conntrack: the tuple the client sent, and the
    backend netfilter chose (the reply's source)."""

    proto: int
    src: str
    dst: str
    sport: int
    dport: int
    backend: str
    backend_port: int

    def key(self) -> bytes:
        """Its kbp_ct forward key (the packet as the client sends it)."""
        family = const.KBP_FAMILY_IPV6 if ":" in self.src else const.KBP_FAMILY_IPV4
        return _KEY.pack(addr_bytes(self.src), addr_bytes(self.dst), port_bytes(self.sport),
                         port_bytes(self.dport), self.proto, family,
                         const.KBP_CT_FORWARD)  # fmt: skip

    def entry(self, now_ns: int) -> bytes:
        """Its KBP_CT_NETFILTER entry: the backend for `inspect`, a reply seen (the
        collector judges it an established flow, FIN/RST aside)."""
        return _ENTRY.pack(addr_bytes(self.backend), port_bytes(self.backend_port),
                           const.KBP_CT_F_SEEN_REPLY, const.KBP_CT_NETFILTER, 0, 0, now_ns,
                           bytes(16), bytes(2), bytes(6), bytes(6), 0)  # fmt: skip


def parse_conntrack(text: str) -> list[KernelFlow]:
    """The flows of `conntrack -L` output whose destination was rewritten (the first
    src/dst/sport/dport are the original direction, the second the reply's)."""
    flows = []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0] not in _PROTOCOLS:
            continue
        fields: dict[str, list[str]] = {}
        for word in words:
            name, eq, value = word.partition("=")
            if eq:
                fields.setdefault(name, []).append(value)
        try:
            (src, reply_src), (dst, _) = fields["src"][:2], fields["dst"][:2]
            (sport, reply_sport), (dport, _) = fields["sport"][:2], fields["dport"][:2]
        except (KeyError, ValueError):
            continue
        if reply_src == dst and reply_sport == dport:
            continue  # no DNAT
        if words[0] == "tcp" and len(words) > 3 and words[3] in _OVER:
            continue  # closed: nothing of it is left to pass
        flows.append(KernelFlow(_PROTOCOLS[words[0]], src, dst, int(sport), int(dport),
                                reply_src, int(reply_sport)))  # fmt: skip
    return flows


def kernel_nat_flows() -> list[KernelFlow]:
    """The DNAT flows of this network namespace's conntrack, both families; none when
    the conntrack tool or the table is not there (then nothing was translated)."""
    flows = []
    for family in ("ipv4", "ipv6"):
        try:
            proc = subprocess.run(["conntrack", "-L", "-f", family, "--dst-nat"],
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                                  check=False)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as err:
            log.warning("handoff: cannot read the kernel's conntrack: %s", err)
            return flows
        flows.extend(parse_conntrack(proc.stdout))
    return flows


HOLD_TABLE = "kube-bpf-proxy-handoff"
_HOOKS = (("prerouting", "dstnat"), ("output", "-100"), ("input", "100"),
          ("postrouting", "srcnat"))  # fmt: skip


def _nft(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nft", *args], input=stdin, capture_output=True, text=True,
                          timeout=COMMAND_TIMEOUT, check=False)  # fmt: skip


def hold_netfilter() -> str | None:
    """Create HOLD_TABLE (see the module's docstring); the error, or None."""
    chains = "".join(
        f"  chain {hook} {{ type nat hook {hook} priority {priority}; policy accept; "
        f"ct state new counter; }}\n"
        for hook, priority in _HOOKS
    )
    text = "".join(f"table {family} {HOLD_TABLE} {{\n{chains}}}\n" for family in ("ip", "ip6"))
    try:
        proc = _nft("-f", "-", stdin=text)
    except (OSError, subprocess.SubprocessError) as err:
        return str(err)
    return proc.stderr.strip() or "nft failed" if proc.returncode != 0 else None


def release_netfilter() -> list[str]:
    """Delete HOLD_TABLE where it exists; the tables deleted ("ip kube-bpf-proxy-handoff")."""
    deleted = []
    for family in ("ip", "ip6"):
        try:
            proc = _nft("delete", "table", family, HOLD_TABLE)
        except (OSError, subprocess.SubprocessError):
            return deleted
        if proc.returncode == 0:
            deleted.append(f"{family} {HOLD_TABLE}")
    return deleted


def frontends_of(state: NodeState) -> set[tuple[int, str, int]]:
    """(protocol number, address, port) of every frontend of the NodeState."""
    out = set()
    for entry in state.services:
        proto = _PROTOCOLS.get(entry.protocol.lower())
        if proto is None:
            continue
        out.update((proto, frontend.ip, frontend.port) for frontend in entry.frontends)
    return out


class Handoff:
    """The seeded KBP_CT_NETFILTER entries of one dataplane (see the module's docstring)."""

    def __init__(self, ct: Map) -> None:
        self._ct = ct
        self.seeded: set[bytes] = set()

    def seed(self, state: NodeState, flows: Iterable[KernelFlow] | None = None) -> int:
        """Write an entry for every kernel DNAT flow to a frontend of `state` that has
        no entry yet (an entry of ours is never replaced); the number written."""
        frontends = frontends_of(state)
        now = time.monotonic_ns()
        written = 0
        for flow in kernel_nat_flows() if flows is None else flows:
            if (flow.proto, flow.dst, flow.dport) not in frontends:
                continue
            key = flow.key()
            if key in self.seeded:
                continue
            try:
                self._ct.update(key, flow.entry(now), BPF_NOEXIST)
            except OSError:
                continue  # an entry of ours (a new connection on a reused tuple)
            self.seeded.add(key)
            written += 1
        return written

    def reconcile(self, flows: Iterable[KernelFlow] | None = None) -> int:
        """Delete the seeded entries whose kernel flow is gone; the number deleted."""
        if not self.seeded:
            return 0
        live = {flow.key() for flow in (kernel_nat_flows() if flows is None else flows)}
        gone = self.seeded - live
        deleted = 0
        for key in gone:
            value = self._ct.lookup(key)
            backend_id = _ENTRY.unpack(value)[3] if value is not None else None
            if backend_id == const.KBP_CT_NETFILTER and self._ct.delete(key):
                deleted += 1
        self.seeded -= gone
        if not self.seeded:
            release_netfilter()
        return deleted

    def hold(self) -> None:
        """Keep netfilter tracking the seeded flows (hold_netfilter), when there are any."""
        if not self.seeded:
            return
        error = hold_netfilter()
        if error is not None:
            log.warning("handoff: cannot create nftables table %s (%s): if kube-proxy's rules "
                        "were the last to use conntrack here, the flows left to netfilter "
                        "lose their NAT when they go", HOLD_TABLE, error)  # fmt: skip


def describe(flows: Iterable[KernelFlow]) -> str:
    """`TCP 10.244.1.1:40000 -> 10.96.0.80:80 (10.244.1.2:8080)`, one per flow."""
    return ", ".join(f"{_NAMES.get(f.proto, f.proto)} {f.src}:{f.sport} -> {f.dst}:{f.dport} "
                     f"({f.backend}:{f.backend_port})" for f in flows)  # fmt: skip
