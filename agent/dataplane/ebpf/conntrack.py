"""Conntrack lifetimes: the agent-side collector that removes expired and closed flows from
kbp_ct before the LRU has to evict live ones, and the states and timeouts it judges by.

The datapath only records: each entry's last packet time (coarse clock) and flags (a
reply seen, FIN or RST seen, on the entry of the direction that carried it). A flow is
its two entries; its state is read from both, its age from the younger one. Every
`interval` the collector reads the whole map in batches, deletes the flows past their
state's timeout in one batch, and keeps the counts the metrics report. Why here and not
in the kernel: see docs/operations.md ("Conntrack").
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .abi import PROTOCOL_NAMES, const, layout, versioned
from .ctgate import ReplyGate
from .libbpf import BPF_NOEXIST, Map
from .options import (  # the states (as `inspect conntrack` and metrics name them), timeouts
    TCP_CLOSE_WAIT,
    TCP_ESTABLISHED,
    TCP_SYN,
    TCP_TIME_WAIT,
    UDP_ASSURED,
    UDP_UNREPLIED,
    Timeouts,
)

log = logging.getLogger(__name__)

_FORWARD, _REPLY, _SPARE = const.KBP_CT_FORWARD, const.KBP_CT_REPLY, const.KBP_CT_SPARE
_HAIRPIN = const.KBP_CT_F_HAIRPIN
_SEEN_REPLY = const.KBP_CT_F_SEEN_REPLY
_CLOSING = const.KBP_CT_F_CLOSING
_RST = const.KBP_CT_F_RST
_SPORT = const.KBP_CT_F_SPORT
_SOURCE_REWRITTEN = const.KBP_CT_F_SNAT | _SPORT


def _field(struct_name: str, name: str) -> slice:
    """Where a field of an ABI struct sits in its bytes (from cffi's layout of the header)."""
    offset, size = next((o, n) for f, o, n in layout(struct_name) if f == name)
    return slice(offset, offset + size)


# Fields of struct kbp_ct_key / kbp_ct_entry the collector reads.
_K_SADDR, _K_DADDR = _field("kbp_ct_key", "saddr"), _field("kbp_ct_key", "daddr")
_K_SPORT = _field("kbp_ct_key", "sport")
_K_PROTO_FAMILY = slice(_field("kbp_ct_key", "proto").start, _field("kbp_ct_key", "family").stop)
_KEY_PROTO, _KEY_DIR = _field("kbp_ct_key", "proto").start, _field("kbp_ct_key", "dir").start
_E_ADDR, _E_PORT = _field("kbp_ct_entry", "addr"), _field("kbp_ct_entry", "port")
_E_NAT_ADDR, _E_NAT_PORT = _field("kbp_ct_entry", "nat_addr"), _field("kbp_ct_entry", "nat_port")
_ENTRY_FLAGS = _field("kbp_ct_entry", "flags").start
_ENTRY_LAST_SEEN = _field("kbp_ct_entry", "last_seen").start
_LAST_SEEN = struct.Struct("=Q")


def flow_state(proto: int, forward_flags: int, reply_flags: int) -> str:
    """The state of a flow from the flags of its two entries (0 for a missing one).
    SCTP is judged like TCP without its closing handshake (the datapath reads no SCTP
    chunk types): established once a reply was seen."""
    flags = forward_flags | reply_flags
    if proto == 17:
        return UDP_ASSURED if flags & _SEEN_REPLY else UDP_UNREPLIED
    if flags & _RST or (forward_flags & _CLOSING and reply_flags & _CLOSING):
        return TCP_TIME_WAIT
    if flags & _CLOSING:
        return TCP_CLOSE_WAIT
    return TCP_ESTABLISHED if flags & _SEEN_REPLY else TCP_SYN


def reply_key_of(key: bytes, entry: bytes) -> bytes:
    """The reply entry's key of a forward entry (lib/conntrack.h __ct_reply_key): the
    backend answering the client, the frontend (hairpin), or the rewritten source (SNAT,
    remapped port)."""
    flags = entry[_ENTRY_FLAGS]
    if flags & _SOURCE_REWRITTEN:
        daddr, dport = entry[_E_NAT_ADDR], entry[_E_NAT_PORT]
    elif flags & _HAIRPIN:
        daddr, dport = key[_K_DADDR], key[_K_SPORT]
    else:
        daddr, dport = key[_K_SADDR], key[_K_SPORT]
    return (entry[_E_ADDR] + daddr + entry[_E_PORT] + dport + key[_K_PROTO_FAMILY]
            + bytes((_REPLY, 0)))  # fmt: skip


@dataclass
class Flow:
    """One flow as the collector saw it: its entries' keys and what they say."""

    keys: list[bytes]
    proto: int
    state: str
    last_seen: int  # ns, CLOCK_MONOTONIC
    remapped: bool = False  # its forward entry (keys[0]) has a kbp_ct_remap record


def flows_of(items: Iterable[tuple[bytes, bytes]]) -> list[Flow]:
    """Pair every forward entry with its reply entry and the reply entry's spare (a copy
    under dir KBP_CT_SPARE, see lib/conntrack.h); an entry whose partners are gone (the
    LRU took them) is a flow of its own."""
    by_key = dict(items)
    flows = []
    paired: set[bytes] = set()
    for key, entry in by_key.items():
        if key[_KEY_DIR] != _FORWARD:
            continue
        reply_key = reply_key_of(key, entry)
        keys, last = [key], _LAST_SEEN.unpack_from(entry, _ENTRY_LAST_SEEN)[0]
        reply_flags = 0
        for partner in (reply_key, reply_key[:-2] + bytes((_SPARE, 0))):
            value = by_key.get(partner)
            if value is None:
                continue
            paired.add(partner)
            keys.append(partner)
            reply_flags |= value[_ENTRY_FLAGS]
            last = max(last, _LAST_SEEN.unpack_from(value, _ENTRY_LAST_SEEN)[0])
        proto = key[_KEY_PROTO]
        state = flow_state(proto, entry[_ENTRY_FLAGS], reply_flags)
        flows.append(Flow(keys, proto, state, last, bool(entry[_ENTRY_FLAGS] & _SPORT)))
    for key, entry in by_key.items():
        if key[_KEY_DIR] != _FORWARD and key not in paired:
            proto = key[_KEY_PROTO]
            last = _LAST_SEEN.unpack_from(entry, _ENTRY_LAST_SEEN)[0]
            flows.append(Flow([key], proto, flow_state(proto, 0, entry[_ENTRY_FLAGS]), last))
    return flows


def seconds_left(flow: Flow, timeouts: Timeouts, now: int) -> float:
    """Time until the flow expires (negative: expired)."""
    idle = max(0, now - flow.last_seen) / 1e9
    return timeouts.of(flow.state) - idle


@dataclass
class SweepReport:
    """What one pass found and did."""

    entries: int  # entries in the map when read
    collected: int  # entries deleted (expired flows)
    by_state: Counter[tuple[str, str]] = field(default_factory=Counter)  # (proto, state)
    seconds: float = 0.0  # wall time of the pass
    cpu_seconds: float = 0.0  # CPU time of the sweeping thread
    gate_slots: int | None = None  # kbp_ct_gate slots set by the pass (None: no gate)


def sweep(
    table: Map, timeouts: Timeouts, now: int | None = None, remap: Map | None = None,
    gate: ReplyGate | None = None,
) -> SweepReport:  # fmt: skip
    """Read kbp_ct, delete the flows past their timeout, count the rest by state. A flow
    is read again just before its deletion, so one a packet refreshed meanwhile stays.
    A deleted remapped flow's port record goes too (`remap`: kbp_ct_remap), or a new
    connection on the same tuple would later be recovered with the old flow's port.
    `gate` (kbp_ct_gate) is rebuilt from the reply entries and spares kept (ctgate.py)."""
    started, cpu_started = time.perf_counter(), time.thread_time()
    side = gate.begin() if gate is not None else 0  # before the dump: see ctgate.py
    items = table.items()
    now = time.monotonic_ns() if now is None else now
    report = SweepReport(entries=len(items), collected=0)
    expired: list[bytes] = []
    records: list[bytes] = []
    for flow in flows_of(items):
        if seconds_left(flow, timeouts, now) >= 0 or not _still_expired(table, flow):
            for _ in flow.keys:
                report.by_state[(PROTOCOL_NAMES.get(flow.proto, str(flow.proto)), flow.state)] += 1
            continue
        expired.extend(flow.keys)
        if flow.remapped:
            records.append(flow.keys[0])
    table.delete_keys(expired)
    if records and remap is not None:
        for key in records:  # few: only clashing flows are remapped
            remap.delete(key)
    report.collected = len(expired)
    if gate is not None:
        gone = set(expired)
        kept = (key for key, _ in items if key[_KEY_DIR] in (_REPLY, _SPARE) and key not in gone)
        report.gate_slots = gate.commit(side, kept)
    report.seconds = time.perf_counter() - started
    report.cpu_seconds = time.thread_time() - cpu_started
    return report


def _still_expired(table: Map, flow: Flow) -> bool:
    """Re-read an expired flow's entries: a packet may have refreshed one since the dump."""
    for key in flow.keys:
        value = table.lookup(key)
        if value is not None and _LAST_SEEN.unpack_from(value, _ENTRY_LAST_SEEN)[0] > (
            flow.last_seen
        ):
            return False
    return True


# Fill ratio after a sweep above which the LRU is taken to be evicting (it starts before
# the map is full: each CPU keeps a share of the free elements).
FULL = 0.9


class Collector:
    """The periodic sweep of kbp_ct in a thread, its figures for /metrics, and the warning
    when established flows lost their entries (LRU evictions)."""

    def __init__(
        self, table: Map, stats: Map, timeouts: Timeouts, interval: float,
        capacity: int | None = None, remap: Map | None = None,
    ) -> None:  # fmt: skip
        self.table = table
        self.stats = stats
        self.remap = remap
        self.gate: ReplyGate | None = None  # kbp_ct_gate, rebuilt once use_gate gave it
        self.timeouts = timeouts
        self.interval = interval
        self.capacity = capacity or table.info.max_entries
        self.last: SweepReport | None = None
        self.collected_total = 0
        self._lost_seen = self.lost_total()
        self._full_warned = 0.0  # time.monotonic() of the last "nearly full" warning
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def use_gate(self, gate: ReplyGate) -> None:
        """Rebuild kbp_ct_gate at every pass from now on (ctgate.py)."""
        with self._lock:
            self.gate = gate

    def start(self) -> None:
        if self._thread is None and self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="kbp-ct-collector",
                                            daemon=True)  # fmt: skip
            self._thread.start()

    def stop(self) -> None:
        """No sweep starts from now on; one under way finishes first (it writes kbp_ct,
        whose descriptor the dataplane closes next)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.run_once()
            except OSError:
                log.exception("ebpf: conntrack sweep failed; trying again in %.0f s",
                              self.interval)  # fmt: skip

    def run_once(self, now: int | None = None) -> SweepReport:
        with self._lock:
            report = sweep(self.table, self.timeouts, now, self.remap, self.gate)
            self.last = report
            self.collected_total += report.collected
        log.debug("ebpf: conntrack sweep: %d entries, %d collected in %.3f s", report.entries,
                  report.collected, report.seconds)  # fmt: skip
        lost = self.lost_total()
        if lost > self._lost_seen:
            log.warning(
                "ebpf: %d TCP segment(s) of established flows found no conntrack entry since "
                "the last sweep: the LRU evicted live flows (kbp_ct held %d of %d entries "
                "after collecting %d), or they outlived their timeout. The flow hash sent "
                "them to the backend they had; raise --map-size-ct if this repeats.",
                lost - self._lost_seen, report.entries - report.collected, self.capacity,
                report.collected,
            )  # fmt: skip
        self._lost_seen = lost
        held = report.entries - report.collected
        if held >= FULL * self.capacity and time.monotonic() - self._full_warned > 60:
            self._full_warned = time.monotonic()
            log.warning(
                "ebpf: kbp_ct holds %d of %d entries after collecting %d: the LRU is making "
                "room by evicting the least recently used flows (idle TCP connections find "
                "their backend again by the flow hash; idle UDP flows may move if their "
                "Service's backends change). Raise --map-size-ct.",
                held, self.capacity, report.collected,
            )  # fmt: skip
        return report

    def _stat(self, index: int) -> int:
        raw = self.stats.lookup(struct.pack("=I", index))
        return sum(struct.unpack(f"={len(raw) // 8}Q", raw)) if raw else 0

    def lost_total(self) -> int:
        return self._stat(const.KBP_CT_STAT_LOST)

    def remapped_total(self) -> int:
        return self._stat(const.KBP_CT_STAT_REMAPPED)

    def fill_ratio(self) -> float:
        """Entries held after the last sweep / capacity (0 before the first)."""
        last = self.last
        return 0.0 if last is None else (last.entries - last.collected) / self.capacity

    # prometheus_client custom collector

    def describe(self) -> list:
        return self.collect()

    def collect(self) -> list:
        entries = GaugeMetricFamily(
            "kbp_conntrack_entries",
            "eBPF conntrack entries by protocol and flow state at the last sweep (two per "
            "flow while both directions are held).",
            labels=["protocol", "state"],
        )
        last = self.last
        if last is not None:
            for (proto, state), n in sorted(last.by_state.items()):
                entries.add_metric([proto, state], n)
        collected = CounterMetricFamily(
            "kbp_conntrack_collected", "eBPF conntrack entries removed by the collector "
            "because their flow had expired or closed.", value=self.collected_total,
        )  # fmt: skip
        try:
            lost, remapped = self.lost_total(), self.remapped_total()
        except OSError:
            lost = remapped = 0
        lost_family = CounterMetricFamily(
            "kbp_conntrack_lost", "TCP segments of flows whose conntrack entries had been "
            "evicted or expired (sent to their backend again by the flow hash).", value=lost,
        )  # fmt: skip
        remapped_family = CounterMetricFamily(
            "kbp_conntrack_remapped", "New flows whose source port was remapped because "
            "another frontend's flow held their tuple at the backend.", value=remapped,
        )  # fmt: skip
        return [entries, collected, lost_family, remapped_family]


# ABI versions whose kbp_ct key and entry have the layout of this one (struct kbp_ct_key,
# struct kbp_ct_entry): their entries are copied as they are at an upgrade. Version 4
# changed kbp_config and added kbp_ct_remap, not the conntrack entries. A release that
# changes the entry layout lists none here until it carries a translation.
SAME_CT_LAYOUT = frozenset({3})


def adopt_earlier_conntrack(pin_dir: Path, table: Map) -> tuple[int, list[str]]:
    """Copy an earlier ABI version's pinned kbp_ct (kbp_ct_v<N>) into `table`, this
    version's, at start-up, so established connections keep their translation across an
    upgrade that renamed the maps. Only versions in SAME_CT_LAYOUT whose sizes agree are
    copied; entries already in `table` stay. Returns (entries copied, versions skipped)."""
    ours = versioned("kbp_ct")
    copied, skipped = 0, []
    for path in sorted(pin_dir.glob("kbp_ct_v*")):
        version = path.name.removeprefix("kbp_ct_v")
        if path.name == ours or not version.isdigit():
            continue
        with Map.pinned(str(path)) as old:
            same = (int(version) in SAME_CT_LAYOUT and old.key_size == table.key_size
                    and old.value_size == table.value_size)  # fmt: skip
            if not same:
                skipped.append(path.name)
                continue
            items = old.items()
        for key, value in items:
            try:
                table.update(key, value, BPF_NOEXIST)
            except OSError:  # taken meanwhile by the new programs, or the map is full
                continue
            copied += 1
    return copied, skipped
