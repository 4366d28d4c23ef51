"""kbp_ct_gate: which (backend, backend port, client) triples may have a reply entry in
kbp_ct, so that the tc programs skip conntrack lookups for packets of flows they never
translated (bpf/include/kbp_maps.h has the layout, bpf/maps.c the datapath's side).

The datapath sets a triple's slot on both sides after it writes a reply entry. The
collector rebuilds the side that is not read: it zeroes it *before* it dumps kbp_ct
(`begin`), sets the slots of the reply entries it keeps (`commit`) and then makes that
side the one read. A reply entry written before the zeroing is in the dump; one written
after it set its slot on that side itself; so the side made current covers every entry
that exists, and a slot of a flow that ended reads 0 after the next pass. A fresh map
reads KBP_CT_GATE_UNBUILT until the first pass: every lookup is made, as before the gate.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from .abi import const, ffi
from .libbpf import Map

SLOTS = const.KBP_CT_GATE_SLOTS
SELECTOR = 2 * SLOTS
_MASK32 = 0xFFFFFFFF
_INDEX = struct.Struct("=I")
_KEY = ffi.typeof("struct kbp_ct_key")
_SADDR = ffi.offsetof(_KEY, "saddr")
_DADDR = ffi.offsetof(_KEY, "daddr")
_SPORT = ffi.offsetof(_KEY, "sport")
_WORDS = struct.Struct("=4I")
_PORT = struct.Struct("=H")


def slot_of(key: bytes) -> int:
    """bpf/maps.c __ct_gate_slot of a kbp_ct key (its words as the CPU loads them)."""
    s0, s1, s2, s3 = _WORDS.unpack_from(key, _SADDR)
    d0, d1, d2, d3 = _WORDS.unpack_from(key, _DADDR)
    h = s0 ^ s1 ^ s2 ^ s3
    h = ((h * 0x9E3779B1) & _MASK32) ^ (d0 ^ d1 ^ d2 ^ d3)
    h = ((h * 0x85EBCA6B) & _MASK32) ^ _PORT.unpack_from(key, _SPORT)[0]
    h ^= h >> 16
    h = (h * 0x7FEB352D) & _MASK32
    h ^= h >> 15
    return h & (SLOTS - 1)


class ReplyGate:
    """The collector's half of kbp_ct_gate (see the module doc)."""

    def __init__(self, table: Map) -> None:
        self.table = table
        self._side_keys: dict[int, bytes] = {}  # every index of a side, for `begin`

    def current_side(self) -> int | None:
        """0 or 1: the side the datapath reads; None before the first commit."""
        raw = self.table.lookup(_INDEX.pack(SELECTOR))
        selector = raw[0] if raw else const.KBP_CT_GATE_UNBUILT
        if selector == const.KBP_CT_GATE_SIDE0:
            return 0
        if selector == const.KBP_CT_GATE_SIDE1:
            return 1
        return None

    def reset(self) -> None:
        """Back to KBP_CT_GATE_UNBUILT: the datapath makes every lookup until a commit."""
        self.table.update(_INDEX.pack(SELECTOR), bytes((const.KBP_CT_GATE_UNBUILT,)))

    def begin(self) -> int:
        """Zero the side not read, before kbp_ct is dumped; returns it for `commit`."""
        side = 1 if self.current_side() == 0 else 0
        if side not in self._side_keys:
            base = side * SLOTS
            self._side_keys[side] = b"".join(_INDEX.pack(base + i) for i in range(SLOTS))
        self.table.update_batch(self._side_keys[side], bytes(SLOTS), SLOTS)
        return side

    def commit(self, side: int, reply_keys: Iterable[bytes]) -> int:
        """Set `side`'s slots of the reply entries kept, then make it the side read.
        Returns the slots set."""
        slots = sorted({slot_of(key) for key in reply_keys})
        self._write(side, slots, 1)
        selector = const.KBP_CT_GATE_SIDE1 if side else const.KBP_CT_GATE_SIDE0
        self.table.update(_INDEX.pack(SELECTOR), bytes((selector,)))
        return len(slots)

    def _write(self, side: int, slots: list[int], value: int) -> None:
        base = side * SLOTS
        keys = b"".join(_INDEX.pack(base + slot) for slot in slots)
        self.table.update_batch(keys, bytes((value,)) * len(slots), len(slots))
