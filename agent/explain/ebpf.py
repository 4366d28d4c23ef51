"""The eBPF half of `explain`: what the pinned maps hold for the frontend (entry, set,
slots, live conntrack and affinity entries), and the backend the attached program picks
for this exact packet, by running it with BPF_PROG_TEST_RUN against the live maps.

A pod whose connect()s the socket hooks translate (--socket-lb all) never meets the tc
program: the hook picks its backend, by the flow hash of the 5-tuple when the socket has
a bound source port (the same rule as tc, so the dry run's choice is the hook's) and by
the socket's cookie otherwise. The report says which path the connection takes, and for a
bound source port whose translated tuple is taken (by a socket of the pod's namespace, or
a flow in tc's conntrack) that the hook leaves it to tc.

The run uses explain's build of the attached program (the same source compiled with
KBP_EXPLAIN, which the agent pins beside the maps after its first apply): it writes no
conntrack, affinity or counter entry (bpf/maps.c); what it would have written lands in
the per-CPU scratch map kbp_explain, which this module clears before and reads after.
Must run in the node's network namespace (the programs' FIB lookups and interfaces are
that namespace's).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..dataplane.ebpf import abi, codec, frames, libbpf
from ..dataplane.ebpf.abi import DROP_REASONS, PROTOCOLS, const, versioned
from ..dataplane.ebpf.inspect import (
    BACKEND_FLAGS,
    SERVICE_FLAGS,
    InspectError,
    PinnedMaps,
    flag_names,
)
from ..dataplane.ebpf.kernel import LoadError, explain_build_fd
from ..dataplane.ebpf.libbpf import Map
from ..dataplane.ebpf.maps import FrontendKey
from ..model.nodestate import CLUSTER_IP, Backend, NodeState
from .semantics import NODE, NOT_A_SERVICE, OUTSIDE, POD, Explanation, address

DEFAULT_SPORT = 40000  # the source port of the packet when --sport is not given
TC_ACT_OK, TC_ACT_SHOT, TC_ACT_REDIRECT = 0, 2, 7
MAPS = (
    "kbp_services",
    "kbp_slots",
    "kbp_backends",
    "kbp_ct",
    "kbp_affinity",
    "kbp_meta",
    "kbp_explain",
    "kbp_config",
    "kbp_pods",
)
# What a dry run leaves in kbp_explain, as the programs filled it.
SCRATCH = "kbp_explain"


class KernelError(RuntimeError):
    """The maps or programs cannot be read; the message says which and why."""


@dataclass(frozen=True, slots=True)
class RunResult:
    program: str  # which program ran, and where it is attached
    retval: int
    packet: frames.Packet
    scratch: Any  # struct kbp_explain of the CPU the run used


@contextmanager
def _maps(pin_dir: Path) -> Iterator[PinnedMaps]:
    """The pinned maps through inspect's reader, every one explain reads opened first."""
    try:
        with PinnedMaps(pin_dir) as pinned:
            yield pinned.open(*MAPS)
    except InspectError as err:
        raise KernelError(str(err)) from err


def _u32(value: int) -> bytes:
    return struct.pack("=I", value)


def explain_ebpf(
    pin_dir: Path, state: NodeState, source: Any, target: Any, sport: int | None, ex: Explanation
) -> tuple[dict[str, Any], Backend | None, list[str]]:
    """(the report's kernel section, the backend the program chose if any, disagreements
    with the NodeState)."""
    bound = sport is not None
    sport = sport or DEFAULT_SPORT
    fe = ex.frontend
    dst_ip = fe.ip if fe else target.ip
    dst_port = fe.port if fe else target.port
    proto = PROTOCOLS[ex.protocol]
    lines: list[str] = []
    disagree: list[str] = []
    with _maps(pin_dir) as maps:
        held = maps.revision()
        if held is None:
            disagree.append(
                "the maps name no NodeState revision: no apply completed since "
                "they were created, or the last one was cut short"
            )
        elif held != state.revision:
            disagree.append(
                f"the maps hold revision {held[:19]}…, the NodeState is "
                f"{state.revision[:19]}…: the agent is behind or the pins are "
                "stale (another agent's, or left from an earlier run)"
            )
        svc = maps.service(FrontendKey(dst_ip, dst_port, proto, abi.family_of(dst_ip)))
        if svc is None:
            lines.append(
                f"frontend:  {address(dst_ip, dst_port)}/{ex.protocol} not in kbp_services"
            )
            if fe is not None:
                disagree.append(
                    f"the NodeState has frontend {address(dst_ip, dst_port)}/"
                    f"{ex.protocol} ({ex.service}) but kbp_services does not: "
                    "the agent is behind, the map is full, or the pin is stale"
                )
        else:
            if fe is None:
                disagree.append(
                    f"kbp_services has {address(dst_ip, dst_port)}/{ex.protocol} "
                    f"(service id {svc.service_id}) but the NodeState has no such "
                    "frontend: a stale entry"
                )
            lines += _service_lines(maps, svc, ex, source, disagree)
        lines += _live_lines(maps, source.ip, sport, dst_ip, dst_port, proto, svc)
        pod_netns = _translating_hook(maps, pin_dir, source.ip) if source.kind == POD else None
    section: dict[str, Any] = {"dataplane": "ebpf", "lines": lines}
    if source.kind == NODE:
        section["summary"] = (
            "the node's own connections are balanced at connect() by the "
            "socket hook, which BPF_PROG_TEST_RUN cannot run: the maps above are what it reads"
        )
        return section, None, disagree
    run = _dry_run(pin_dir, source, sport, dst_ip, dst_port, ex.protocol)
    chosen, summary, outcome = _decode(run, source.ip, sport, dst_ip, dst_port, ex)
    section["summary"] = summary
    section["program"] = run.program
    section["outcome"] = outcome
    section["lines"] = lines + _scratch_lines(run.scratch)
    section["path"] = "tc"
    if pod_netns is not None:
        with _maps(pin_dir) as maps:
            _through_the_hook(section, maps, pod_netns, source.ip, sport if bound else None,
                              chosen, ex.protocol)  # fmt: skip
    if outcome != ex.outcome:
        disagree.append(
            f"the NodeState says {ex.outcome}, the program answered {outcome} ({summary})"
        )
    if chosen is not None and ex.backends and chosen not in ex.backends:
        disagree.append(
            f"the program chose {address(chosen.ip, chosen.port)}, which the "
            f"NodeState's {ex.set_name} does not list"
        )
    summary = section["summary"]
    if outcome != ex.outcome:
        section["verdict"] = f"{outcome} by the kernel: {summary}"
    elif outcome == "backends" and section["path"] == "socket hook":
        section["note"] = (
            f"; the socket hook picks it at connect() for source port {sport} (bound)"
            if bound
            else f"; the socket hook picks by the socket's cookie ({sport} bound: this one)"
        )
    elif outcome == "backends":
        section["note"] = f"; the attached program picks it for source port {sport}"
    else:
        section["note"] = f" (the attached program: {summary})"
    return section, chosen, disagree


# --- the socket hooks ----------------------------------------------------------------------


def _translating_hook(maps: PinnedMaps, pin_dir: Path, ip: str) -> int | None:
    """The network namespace cookie of the pod with address `ip` when the socket hooks
    translate its connect()s: the connect hook of the address's family is attached (its
    link pinned), kbp_config says the pods' sockets are translated (--socket-lb all) and
    kbp_pods lists the pod. None: its connections go through tc."""
    from ..dataplane.ebpf.cgroup import socket_hooks_pinned  # pyroute2, through netlink

    family = abi.family_of(ip)
    hook = "connect4" if family == const.KBP_FAMILY_IPV4 else "connect6"
    if hook not in socket_hooks_pinned(pin_dir):
        return None
    config = maps.config()
    if config is None or not config.sock_lb & const.KBP_SOCK_LB_PODS:
        return None
    return maps.pod_cookie(ip)


def _through_the_hook(
    section: dict[str, Any],
    maps: PinnedMaps,
    netns_cookie: int,
    src: str,
    sport: int | None,
    chosen: Backend | None,
    protocol: str,
) -> None:
    """Rewrite the dry run's summary for a connection the socket hook translates at
    connect() (lib/sock.h): where tc would refuse or drop, connect() fails; a backend is
    the hook's (the flow hash for a bound port, the cookie otherwise); a bound port whose
    translated tuple is taken falls to tc."""
    tc = section["summary"]
    outcome = section["outcome"]
    section["path"] = "socket hook"
    if outcome == "refused":
        section["summary"] = f"connect() fails with ECONNREFUSED at the socket hook (tc: {tc})"
        return
    if outcome == "dropped":
        section["summary"] = f"connect() fails with EHOSTUNREACH at the socket hook (tc: {tc})"
        return
    if outcome != "backends" or chosen is None:
        return
    target = address(chosen.ip, chosen.port)
    if sport is None:
        section["summary"] = (
            f"translated at connect() by the socket hook, never seen by tc: a socket "
            f"without a bound port gets a backend by its cookie, evenly over the set; "
            f"bound to source port {DEFAULT_SPORT}, {target} (the flow hash, tc's rule)"
        )
        return
    holders = _tuple_holders(maps, netns_cookie, src, sport, chosen, protocol)
    if holders:
        section["path"] = "tc"
        section["summary"] = (
            f"falls to tc: {' and '.join(holders)} already holds {address(src, sport)} -> "
            f"{target}, so the socket hook leaves this connect() untranslated and tc "
            f"translates it per packet, the source port remapped into --snat-port-range "
            f"(tc: {tc})"
        )
        return
    section["summary"] = (
        f"translated at connect() by the socket hook to {target} (a bound source port: "
        f"the flow hash of its 5-tuple, tc's rule); no conntrack entry is written"
    )


def _tuple_holders(
    maps: PinnedMaps, netns_cookie: int, src: str, sport: int, chosen: Backend, protocol: str
) -> list[str]:
    """Who holds src:sport -> chosen as its tuple, as the hook asks (sock_tuple_taken): a
    socket of the pod's namespace (by sock_diag in it), a flow in tc's conntrack (a reply
    entry under the same tuple)."""
    from ..dataplane.ebpf import sockdiag
    from ..dataplane.ebpf.netlink import run_in_netns  # pyroute2
    from ..dataplane.ebpf.pods import netns_path_of

    found = []
    proto = PROTOCOLS[protocol]
    path = netns_path_of(netns_cookie)
    states = (
        run_in_netns(
            path, lambda: sockdiag.tuple_holders(proto, src, sport, chosen.ip, chosen.port)
        )
        if path is not None
        else []
    )
    if states:
        kind = "TCP" if proto == socket.IPPROTO_TCP else "connected UDP"
        found.append(f"a {kind} socket of the pod ({', '.join(sorted(set(states)))})")
    if maps.flow(chosen.ip, src, chosen.port, sport, proto, const.KBP_CT_REPLY) is not None:
        found.append("a flow in tc's conntrack")
    return found


def _service_lines(
    maps: PinnedMaps, svc: Any, ex: Explanation, source: Any, disagree: list[str]
) -> list[str]:
    lines = [
        f"frontend:  service id {svc.service_id}, flags "
        f"{flag_names(svc.flags, SERVICE_FLAGS)}"
        + (f", affinity {svc.affinity_timeout} s" if svc.affinity_timeout else "")
    ]
    outside = source.kind == OUTSIDE and (ex.frontend is None or ex.frontend.type != CLUSTER_IP)
    set_id, count = (
        (svc.set_id, svc.count) if outside else (svc.internal_set_id, svc.internal_count)
    )
    which = "external set" if outside else "internal set (pods and the node)"
    members: list[int] = []
    copies: dict[int, set[bytes]] = {}  # backend id -> the copies its slots carry
    for index in range(count if set_id else 0):
        slot = maps.slot(set_id, index)
        if slot is None:
            disagree.append(f"set {set_id} lacks slot {index} of {count}: a half-written set")
            break
        backend_id, copy = slot
        members.append(backend_id)
        copies.setdefault(backend_id, set()).add(copy)
    where = f" at kbp_slots {set_id}..{set_id + count - 1}" if count else ""
    lines.append(f"set:       {which}{where}, {count} slot{'s' if count != 1 else ''}")
    shares: dict[int, int] = {}
    for backend_id in members:
        shares[backend_id] = shares.get(backend_id, 0) + 1
    seen: set[tuple[str, int]] = set()
    for backend_id, held in shares.items():
        raw = maps.backend(backend_id)
        if raw is None:
            lines.append(f"  slot -> backend id {backend_id}: missing from kbp_backends")
            disagree.append(
                f"set {set_id} names backend id {backend_id}, which kbp_backends "
                "lacks (packets picking it are dropped: backend-gone)"
            )
            continue
        if copies.get(backend_id, set()) - {bytes(raw)}:
            disagree.append(
                f"slots of set {set_id} carry a copy of backend id {backend_id} that differs "
                "from kbp_backends (new flows use the slot's copy): a rewrite of the set "
                "is missing"
            )
        b = codec.decode_backend(raw)
        seen.add((b.addr, b.port))
        lines.append(
            f"  backend id {backend_id}: {address(b.addr, b.port)} ({held} slot"
            f"{'s' if held != 1 else ''}, {flag_names(b.flags, BACKEND_FLAGS)})"
        )
    wanted = {(b.ip, b.port) for b in ex.backends}
    if ex.frontend is not None and ex.outcome != NOT_A_SERVICE and seen != wanted:
        missing = sorted(address(*a) for a in wanted - seen)
        extra = sorted(address(*a) for a in seen - wanted)
        disagree.append(
            f"the kernel's set differs from the NodeState's {ex.set_name}: "
            + "; ".join(
                filter(
                    None,
                    [
                        f"missing {', '.join(missing)}" if missing else "",
                        f"extra {', '.join(extra)}" if extra else "",
                    ],
                )
            )
        )
    return lines


def _live_lines(
    maps: PinnedMaps, src: str, sport: int, dst: str, dport: int, proto: int, svc: Any
) -> list[str]:
    """The live conntrack entry of this very tuple and the client's affinity entry."""
    lines = []
    entry = maps.flow(src, dst, sport, dport, proto, const.KBP_CT_FORWARD)
    if entry is None:
        lines.append(f"conntrack: no entry for {address(src, sport)} -> {address(dst, dport)}")
    else:
        target = _ct_target(entry, abi.family_of(src))
        lines.append(f"conntrack: live flow to {target} (backend id {entry.backend_id})")
    if svc is not None and svc.flags & const.KBP_SVC_F_AFFINITY:
        backend_id = maps.affinity(src, svc.service_id)
        if backend_id is None:
            lines.append(f"affinity:  none for {src}")
        else:
            lines.append(f"affinity:  {src} -> backend id {backend_id}")
    return lines


def _ct_target(entry: Any, family: int) -> str:
    return address(abi.get_addr(entry.addr, family), abi.from_be16(entry.port))


# --- the dry run -------------------------------------------------------------------------


def _program(source: Any) -> tuple[str, int, str]:
    """(program name, interface index, description) of the attached program that sees the
    source's packets: kbp_from_pod on the pod's host veth, kbp_from_ext on the external
    interface toward an outside client. Another interface's copy of the same program when
    the route points at none (it decides alike)."""
    from ..dataplane.ebpf.netlink import TcAttacher  # pyroute2

    wanted = "kbp_from_ext" if source.kind == OUTSIDE else "kbp_from_pod"
    with TcAttacher() as attacher:
        attached = [
            a for a in attacher.attached() if a.direction == "ingress" and a.name.startswith(wanted)
        ]
        route = attacher.route_index(source.ip)
    if not attached:
        raise KernelError(
            f"no {wanted} program is attached in this network namespace; "
            "run explain on the node (its network namespace) with the agent up"
        )
    on_route = [a for a in attached if a.index == route]
    chosen = (on_route or attached)[0]
    where = f"{wanted} on {chosen.ifname} ingress (program id {chosen.prog_id})"
    if not on_route:
        where += f"; {source.ip} is not routed through an interface with it"
    return wanted, chosen.index, where


def _frame(src: str, sport: int, dst: str, dport: int, protocol: str) -> bytes:
    if protocol == "TCP":
        return frames.tcp_frame(src, dst, sport, dport, flags="S")
    if protocol == "UDP":
        return frames.udp_frame(src, dst, sport, dport, b"explain")
    raise KernelError(f"{protocol}: explain builds TCP and UDP packets only")


def skb_context(ifindex: int) -> bytes:
    """struct __sk_buff up to `cb`: the fields up to priority zero, then ingress_ifindex
    and ifindex."""
    words = [0] * 12
    words[9] = words[10] = ifindex
    return struct.pack("=12I", *words)


def _dry_run(
    pin_dir: Path, source: Any, sport: int, dst: str, dport: int, protocol: str
) -> RunResult:
    program, ifindex, where = _program(source)
    try:
        fd = explain_build_fd(pin_dir, program)
    except (LoadError, OSError) as err:
        raise KernelError(f"explain's build of {program}: {err}") from err
    try:
        with Map.pinned(str(pin_dir / versioned(SCRATCH))) as scratch:
            zero = _u32(0)
            scratch.update(zero, bytes(scratch.value_size))
            frame = _frame(source.ip, sport, dst, dport, protocol)
            run = libbpf.prog_test_run(fd, frame, ctx=skb_context(ifindex))
            raw = scratch.lookup(zero) or b""
    finally:
        os.close(fd)
    return RunResult(where, run.retval, frames.parse(run.data_out), _scratch_of(raw))


def _scratch_of(raw: bytes) -> Any:
    """The CPU's kbp_explain the run filled (the others stay zero)."""
    size = abi.ffi.sizeof("struct kbp_explain")
    stride = (size + 7) // 8 * 8
    chunks = [raw[i : i + size] for i in range(0, len(raw), stride)]
    used = [c for c in chunks if any(c)]
    return abi.from_bytes("kbp_explain", used[0] if used else bytes(size))


def _decode(
    run: RunResult, src: str, sport: int, dst: str, dport: int, ex: Explanation
) -> tuple[Backend | None, str, str]:
    """(chosen backend, summary, outcome) of a dry run."""
    pkt, x = run.packet, run.scratch
    if run.retval == TC_ACT_SHOT:
        reasons = [DROP_REASONS.get(i, str(i)) for i in range(len(x.drops)) if x.drops[i].packets]
        reason = ", ".join(reasons) or "no reason counted"
        return None, f"dropped ({reason})", "dropped"
    if run.retval == TC_ACT_REDIRECT and (
        (pkt.proto == frames.PROTO_TCP and pkt.flags & frames.TCP_RST)
        or pkt.proto in (frames.PROTO_ICMP, frames.PROTO_ICMPV6)
    ):
        what = "TCP RST" if pkt.proto == frames.PROTO_TCP else "ICMP unreachable"
        return None, f"refused: answered with a {what} from {pkt.src}", "refused"
    if (pkt.dst, pkt.dport) == (dst, dport):
        if run.retval == TC_ACT_OK:
            return None, "passes untranslated", NOT_A_SERVICE
        return None, f"unexpected verdict {run.retval} with the packet unchanged", "unknown"
    chosen = _backend(ex, pkt.dst, pkt.dport)
    how = []
    if x.service.new_flows:
        how.append(
            f"new flow: would write {x.ct_writes} conntrack entr"
            f"{'y' if x.ct_writes == 1 else 'ies'}"
            + (f" and {x.affinity_writes} affinity entry" if x.affinity_writes else "")
        )
    else:
        how.append("an existing flow: conntrack or affinity kept its backend")
    if (pkt.src, pkt.sport) != (src, sport):
        how.append(f"source rewritten to {address(pkt.src, pkt.sport)}")
    if run.retval == TC_ACT_REDIRECT:
        how.append(
            "hairpin: sent back to the client's interface"
            if pkt.dst == src
            else "forwarded toward another node"
        )
    return chosen, f"to {address(pkt.dst, pkt.dport)} ({'; '.join(how)})", "backends"


def _backend(ex: Explanation, ip: str, port: int) -> Backend:
    for b in ex.backends:
        if (b.ip, b.port) == (ip, port):
            return b
    return Backend(ip, port, None, None, None, False, False, False, False)


def _scratch_lines(x: Any) -> list[str]:
    lines = []
    if x.forward.backend_id:
        lines.append(f"would record: a flow to backend id {x.forward.backend_id}")
    counted = x.service
    lines.append(
        f"would count: {counted.packets} packet(s), {counted.new_flows} new flow(s), "
        f"{counted.drops} drop(s) for the service; nothing was written"
    )
    return lines
