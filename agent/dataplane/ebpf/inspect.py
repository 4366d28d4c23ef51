"""`kube-bpf-proxy inspect`: the pinned maps decoded into readable rows (frontends with
their backends, backends, conntrack, affinity, counters), read straight from bpffs so it
works beside a running agent, after it stopped, and without compiling anything.

`PinnedMaps` is the one reader of the pinned maps: these views and `explain`'s kernel
half (agent/explain/ebpf.py) open and look up through it."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from . import codec
from .abi import (
    DROP_REASONS,
    FRONTEND_TYPES,
    PROTOCOL_NAMES,
    addr_bytes,
    addr_text,
    const,
    family_of,
    from_bytes,
    named,
    packer,
    port_bytes,
    versioned,
)
from .conntrack import Timeouts, seconds_left
from .conntrack import flows_of as conntrack_flows
from .libbpf import Map
from .maps import FrontendKey, KernelContent, ServiceValue

Row = dict[str, Any]

FRONTEND_TYPE_NAMES = {number: name for name, number in FRONTEND_TYPES.items()}


class InspectError(Exception):
    """A map is not there or not readable; the message names it."""


class PinnedMaps:
    """The pinned maps of one --bpffs directory, each opened on first use (or by `open`)
    and all closed with the reader; lookups decode keys and values the way the programs
    write them."""

    def __init__(self, pin_dir: Path) -> None:
        self.pin_dir = pin_dir
        self._maps: dict[str, Map] = {}

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        while self._maps:
            self._maps.popitem()[1].close()

    def open(self, *names: str) -> Self:
        """Open these maps now (InspectError naming the first that is not there)."""
        for name in names:
            self.map(name)
        return self

    def map(self, name: str) -> Map:
        """The pinned map `name` (unversioned: kbp_services); InspectError when it is not
        there or not readable."""
        found = self._maps.get(name)
        if found is not None:
            return found
        path = self.pin_dir / versioned(name)
        try:
            found = Map.pinned(str(path))
        except OSError as err:
            raise InspectError(
                f"{path}: {os.strerror(err.errno or 0)}; is the eBPF dataplane running with "
                f"--bpffs {self.pin_dir}?"
            ) from err
        self._maps[name] = found
        return found

    def revision(self) -> str | None:
        """The NodeState revision kbp_meta names; None when it names none."""
        return codec.meta_revision(self.map("kbp_meta").lookup(_u32(0)))

    def content(self) -> KernelContent:
        """Frontends, sets and backends as the planner reads them (codec.read_content)."""
        return codec.read_content(
            self.map("kbp_services"), self.map("kbp_slots"), self.map("kbp_backends")
        )

    def service(self, key: FrontendKey) -> ServiceValue | None:
        raw = self.map("kbp_services").lookup(codec.frontend_key(key))
        return codec.decode_service(raw) if raw else None

    def slot(self, set_id: int, index: int) -> tuple[int, bytes] | None:
        """(backend id, the copy of its kbp_backends value) of slot `index` of the set whose
        first slot is `set_id`; None if that slot is free or past the array."""
        raw = self.map("kbp_slots").lookup(codec.slot_key(set_id + index))
        if raw is None or not codec.slot_backend_id(raw):
            return None
        return codec.slot_backend_id(raw), codec.slot_backend_copy(raw)

    def backend(self, backend_id: int) -> bytes | None:
        """The raw kbp_backends value (codec.decode_backend reads it); None if absent."""
        return self.map("kbp_backends").lookup(_u32(backend_id))

    def flow(
        self, src: str, dst: str, sport: int, dport: int, proto: int, direction: int
    ) -> Any | None:
        """The kbp_ct entry (struct kbp_ct_entry) of this tuple and direction, if any."""
        key = packer("kbp_ct_key").pack(
            addr_bytes(src), addr_bytes(dst), port_bytes(sport), port_bytes(dport), proto,
            family_of(src), direction,
        )  # fmt: skip
        raw = self.map("kbp_ct").lookup(key)
        return None if raw is None else from_bytes("kbp_ct_entry", raw)

    def affinity(self, client: str, service_id: int) -> int | None:
        """The backend id client's affinity entry for the service names, if any."""
        key = packer("kbp_affinity_key").pack(addr_bytes(client), service_id, family_of(client))
        raw = self.map("kbp_affinity").lookup(key)
        return None if raw is None else packer("kbp_affinity").unpack(raw)[1]

    def config(self) -> Any | None:
        """struct kbp_config as the agent wrote it; None before it did."""
        raw = self.map("kbp_config").lookup(_u32(0))
        return None if raw is None else from_bytes("kbp_config", raw)

    def pod_cookie(self, ip: str) -> int | None:
        """The network namespace cookie kbp_pods lists for a pod address, if any."""
        want = addr_bytes(ip)
        at = 0 if family_of(ip) == const.KBP_FAMILY_IPV4 else 16
        for key, value in self.map("kbp_pods").items():
            if value[at : at + 16] == want:
                return int.from_bytes(key, sys.byteorder)
        return None


def _u32(value: int) -> bytes:
    return value.to_bytes(4, sys.byteorder)


def flag_names(value: int, names: dict[int, str]) -> str:
    return ",".join(name for bit, name in names.items() if value & bit) or "-"


def _endpoint(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


SERVICE_FLAGS = {
    const.KBP_SVC_F_HAS_ENDPOINTS: "has-endpoints",
    const.KBP_SVC_F_AFFINITY: "affinity",
    const.KBP_SVC_F_MAGLEV: "maglev",
    const.KBP_SVC_F_SOURCE_RANGES: "source-ranges",
}
BACKEND_FLAGS = {const.KBP_BE_F_LOCAL: "local", const.KBP_BE_F_TERMINATING: "terminating"}
CT_FLAGS = {
    const.KBP_CT_F_HAIRPIN: "hairpin",
    const.KBP_CT_F_SEEN_REPLY: "seen-reply",
    const.KBP_CT_F_CLOSING: "closing",
    const.KBP_CT_F_REPLY_AT_CLIENT: "reply-at-client",
    const.KBP_CT_F_SNAT: "snat",
    const.KBP_CT_F_SPORT: "remapped-port",
    const.KBP_CT_F_RST: "rst",
    const.KBP_CT_F_SPARE: "spare",
}
# kbp_xdp_stats index → the verdict's name (KBP_XDP_DROP_RANGE → drop-range).
XDP_VERDICTS = named("KBP_XDP_", "KBP_XDP_VERDICTS")


def frontends(pin_dir: Path) -> list[Row]:
    with PinnedMaps(pin_dir) as pinned:
        content = pinned.content()
    rows = []
    for key, value in sorted(content.services.items(), key=lambda kv: _frontend_order(kv[0])):
        members = content.slots.get(value.set_id, ()) if value.count else ()
        # Maglev tables repeat each backend many times: list each once, with its share.
        shares: dict[int, int] = {}
        for backend_id in members:
            shares[backend_id] = shares.get(backend_id, 0) + 1
        listed = []
        for backend_id, slots_held in shares.items():
            b = content.backends.get(backend_id)
            listed.append(
                {
                    "id": backend_id,
                    "address": _endpoint(b.addr, b.port) if b else "?",
                    "slots": slots_held,
                    "flags": flag_names(b.flags, BACKEND_FLAGS) if b else "missing",
                }
            )
        rows.append(
            {
                "frontend": _endpoint(key.addr, key.port),
                "protocol": PROTOCOL_NAMES.get(key.proto, str(key.proto)),
                "type": FRONTEND_TYPE_NAMES.get(value.type, str(value.type)),
                "serviceId": value.service_id,
                "flags": flag_names(value.flags, SERVICE_FLAGS),
                "affinitySeconds": value.affinity_timeout or None,
                "set": value.set_id,
                "slots": value.count,
                "internalSet": value.internal_set_id,
                "internalSlots": value.internal_count,
                "backends": listed,
            }
        )
    return rows


def _frontend_order(key: FrontendKey) -> tuple[int, bytes, int, int]:
    return (key.family, addr_bytes(key.addr), key.port, key.proto)


def backends(pin_dir: Path) -> list[Row]:
    with PinnedMaps(pin_dir) as pinned:
        table = pinned.map("kbp_backends")
        items = [
            (int.from_bytes(k, sys.byteorder), codec.decode_backend(v)) for k, v in table.items()
        ]
    return [
        {
            "id": backend_id,
            "address": _endpoint(b.addr, b.port),
            "serviceId": b.service_id,
            "flags": flag_names(b.flags, BACKEND_FLAGS),
        }
        for backend_id, b in sorted(items)
    ]


_DIRECTIONS = {const.KBP_CT_FORWARD: "forward", const.KBP_CT_REPLY: "reply",
               const.KBP_CT_SPARE: "spare"}  # fmt: skip


def conntrack(pin_dir: Path, timeouts: Timeouts | None = None) -> list[Row]:
    """Every entry with its flow's state and the time it has left under `timeouts` (the
    agent's --conntrack-* settings, which inspect takes too)."""
    key_format, entry_format = packer("kbp_ct_key"), packer("kbp_ct_entry")
    timeouts = timeouts or Timeouts()
    now = time.monotonic_ns()  # bpf_ktime_get_ns() is CLOCK_MONOTONIC
    rows = []
    with PinnedMaps(pin_dir) as pinned:
        items = pinned.map("kbp_ct").items()
        flow_of = {key: flow for flow in conntrack_flows(items) for key in flow.keys}
        for k, v in items:
            saddr, daddr, sport, dport, proto, family, direction = key_format.unpack(k)
            (addr, port, flags, backend_id, service_id, hop_ifindex, last_seen, nat_addr,
             nat_port, hop_dmac, _hop_smac, hop_time) = entry_format.unpack(v)  # fmt: skip
            forward = direction == const.KBP_CT_FORWARD
            translation = ("destination → " if forward else "source → ") + _endpoint(
                addr_text(addr, family), int.from_bytes(port, "big")
            )
            if flags & (const.KBP_CT_F_SNAT | const.KBP_CT_F_SPORT):  # and the client's side
                translation += (", source → " if forward else ", destination → ") + _endpoint(
                    addr_text(nat_addr, family), int.from_bytes(nat_port, "big")
                )
            rows.append(
                {
                    # spare: the copy of a reply entry kept for when it alone is lost
                    "direction": _DIRECTIONS.get(direction, str(direction)),
                    "protocol": PROTOCOL_NAMES.get(proto, str(proto)),
                    "source": _endpoint(addr_text(saddr, family), int.from_bytes(sport, "big")),
                    "destination": _endpoint(
                        addr_text(daddr, family), int.from_bytes(dport, "big")
                    ),
                    # forward: the destination becomes the backend (SNAT: the source the
                    # node's address and port); reply: the source becomes the frontend
                    # again (SNAT: the destination the client again)
                    "translation": translation,
                    "backendId": backend_id,
                    "serviceId": service_id,
                    "flags": flag_names(flags, CT_FLAGS),
                    "state": flow_of[k].state,
                    "idleSeconds": round(max(0, now - last_seen) / 1e9, 1),
                    # until the collector removes the flow (both entries together)
                    "secondsLeft": round(max(0.0, seconds_left(flow_of[k], timeouts, now)), 1),
                    # forwarded flows: the next hop the programs reuse (lib/ext.h
                    # KBP_HOP_CACHE_NS) and how long ago the FIB gave it
                    "nextHop": _next_hop(hop_ifindex, hop_dmac, hop_time, now),
                }
            )
    rows.sort(key=lambda r: (r["serviceId"], r["direction"], r["source"], r["destination"]))
    return rows


def _next_hop(ifindex: int, mac: bytes, looked_up: int, now: int) -> str | None:
    if not looked_up:
        return None
    try:
        device = socket.if_indextoname(ifindex)
    except OSError:  # gone, or not in this namespace
        device = f"ifindex {ifindex}"
    age = max(0, now - looked_up) / 1e9
    return f"{device} {mac.hex(':')} ({age:.1f} s ago)"


def affinity(pin_dir: Path) -> list[Row]:
    key_format, value_format = packer("kbp_affinity_key"), packer("kbp_affinity")
    now = time.monotonic_ns()
    rows = []
    with PinnedMaps(pin_dir) as pinned:
        for k, v in pinned.map("kbp_affinity").items():
            client, service_id, family = key_format.unpack(k)
            last_used, backend_id = value_format.unpack(v)
            rows.append(
                {
                    "client": addr_text(client, family),
                    "serviceId": service_id,
                    "backendId": backend_id,
                    "idleSeconds": round(max(0, now - last_used) / 1e9, 1),
                }
            )
    rows.sort(key=lambda r: (r["serviceId"], r["client"]))
    return rows


def _percpu_sums(table: Map, struct: str) -> list[tuple[int, tuple[int, ...]]]:
    """(index, field sums over CPUs) for every index with a non-zero sum."""
    return sorted((i, sums) for i, sums in codec.percpu_sums(table, struct).items() if any(sums))


def counters(pin_dir: Path) -> list[Row]:
    with PinnedMaps(pin_dir) as pinned:
        counted = _percpu_sums(pinned.map("kbp_counters"), "kbp_counters")
        dropped = _percpu_sums(pinned.map("kbp_drops"), "kbp_drop_counters")
    rows: list[Row] = [
        {"serviceId": service_id, "packets": packets, "bytes": size, "newFlows": new_flows,
         "drops": drops}
        for service_id, (packets, size, new_flows, drops) in counted
    ]  # fmt: skip
    rows += [
        {"dropReason": DROP_REASONS.get(reason, str(reason)), "packets": packets, "bytes": size}
        for reason, (packets, size) in dropped
    ]
    return rows


def xdp(pin_dir: Path) -> dict[str, Any]:
    """Where our XDP program is attached (this network namespace) and in which mode, and
    the per-verdict counters of kbp_xdp_stats."""
    from .attach import is_ours
    from .netlink import TcAttacher  # pyroute2, no compiler

    interfaces = []
    with TcAttacher() as attacher:
        for attached in attacher.xdp():
            if is_ours(attached.prog_id):
                interfaces.append(
                    {"name": attached.ifname, "ifindex": attached.index, "mode": attached.mode}
                )
    verdicts = {name: {"packets": 0, "bytes": 0} for name in XDP_VERDICTS.values()}
    with PinnedMaps(pin_dir) as pinned:
        sums = codec.percpu_sums(pinned.map("kbp_xdp_stats"), "kbp_drop_counters")
        for index, (packets, size) in sums.items():
            name = XDP_VERDICTS.get(index, str(index))
            verdicts[name] = {"packets": packets, "bytes": size}
    return {"interfaces": sorted(interfaces, key=lambda i: i["name"]), "verdicts": verdicts}


def tc(pin_dir: Path) -> list[dict[str, Any]]:
    """Our tc programs on every interface of this network namespace: tcx links (with the
    pin that holds each, under `pin_dir`) and clsact filters."""
    from .netlink import TCX_PIN_PREFIX, TcAttacher  # pyroute2, no compiler

    with TcAttacher(mode="clsact") as attacher:  # no pin directory: reads, sweeps nothing
        found = attacher.attached()
    rows = []
    for a in sorted(found, key=lambda a: (a.ifname, a.direction)):
        pin = pin_dir / f"{TCX_PIN_PREFIX}{a.index}_{a.direction}"
        rows.append({
            "interface": a.ifname, "ifindex": a.index, "direction": a.direction,
            "hook": a.hook, "program": a.name, "progId": a.prog_id,
            "linkId": a.link_id or None,
            "pin": str(pin) if a.hook == "tcx" and pin.exists() else None,
        })  # fmt: skip
    return rows


VIEWS: dict[str, Callable[[Path], Any]] = {
    "frontends": frontends,
    "backends": backends,
    "conntrack": conntrack,
    "affinity": affinity,
    "counters": counters,
    "xdp": xdp,
    "tc": tc,
}


def render_table(view: str, rows: Any) -> str:
    """Aligned columns; a frontend's backends are listed under it, one per line."""
    if view == "xdp":
        attached = [{"INTERFACE": i["name"], "IFINDEX": i["ifindex"], "MODE": i["mode"]}
                    for i in rows["interfaces"]]  # fmt: skip
        counted = [{"VERDICT": name, "PACKETS": c["packets"], "BYTES": c["bytes"]}
                   for name, c in rows["verdicts"].items()]  # fmt: skip
        head = _columns(attached) if attached else "XDP is not attached in this namespace\n"
        return head + "\n" + _columns(counted)
    if not rows:
        return f"no {view} entries\n"
    if view == "frontends":
        flat = []
        for row in rows:
            backends_of = row.pop("backends")
            head = {
                "FRONTEND": f"{row['frontend']}/{row['protocol']}",
                "TYPE": row["type"],
                "SERVICE": row["serviceId"],
                "FLAGS": row["flags"],
                "SLOTS": row["slots"],
                "BACKEND": "",
            }
            if not backends_of:
                head["BACKEND"] = "(none)"
                flat.append(head)
            for n, b in enumerate(backends_of):
                line = dict.fromkeys(head, "") if n else head
                slots = f"{b['slots']} slot{'s' if b['slots'] != 1 else ''}"
                line["BACKEND"] = f"{b['address']} (id {b['id']}, {slots}, {b['flags']})"
                flat.append(line)
        return _columns(flat)
    header_rows = [{_title(k): v for k, v in row.items()} for row in rows]
    return _columns(header_rows)


def _title(key: str) -> str:
    out = "".join(f"-{c}" if c.isupper() else c for c in key)
    return out.upper()


def _columns(rows: list[Row]) -> str:
    headers: list[str] = []
    for row in rows:
        for key in row:
            if key not in headers:
                headers.append(key)
    cells = [[str("" if row.get(h) is None else row.get(h)) for h in headers] for row in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for c in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=True)).rstrip())
    return "\n".join(lines) + "\n"
