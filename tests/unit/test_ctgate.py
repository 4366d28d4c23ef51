"""kbp_ct_gate's collector side (agent/dataplane/ebpf/ctgate.py) against an array kept in
a dict: which side a pass rebuilds, what it zeroes, when it makes it the side read. The
kernel tier checks the datapath's side and that both compute the same slots
(tests/kernel/test_dataplane.py)."""

from __future__ import annotations

import struct

from agent.dataplane.ebpf.abi import const, ffi
from agent.dataplane.ebpf.ctgate import SELECTOR, SLOTS, ReplyGate, slot_of

INDEX = struct.Struct("=I")


class ArrayMap:
    """The calls ReplyGate makes on an array of one-byte values."""

    def __init__(self) -> None:
        self.values: dict[int, int] = {}
        self.batches = 0

    def lookup(self, key: bytes) -> bytes:
        return bytes((self.values.get(INDEX.unpack(key)[0], 0),))

    def update(self, key: bytes, value: bytes) -> None:
        self.values[INDEX.unpack(key)[0]] = value[0]

    def update_batch(self, keys: bytes, values: bytes, count: int) -> None:
        self.batches += 1
        for i in range(count):
            self.values[INDEX.unpack_from(keys, i * INDEX.size)[0]] = values[i]


def reply_key(backend: bytes, port: int, client: bytes, client_port: int) -> bytes:
    key = ffi.new("struct kbp_ct_key *")
    ffi.memmove(key.saddr, backend.ljust(16, b"\0"), 16)
    ffi.memmove(key.daddr, client.ljust(16, b"\0"), 16)
    key.sport = struct.unpack("=H", port.to_bytes(2, "big"))[0]
    key.dport = struct.unpack("=H", client_port.to_bytes(2, "big"))[0]
    key.proto, key.family, key.dir = 6, const.KBP_FAMILY_IPV4, const.KBP_CT_REPLY
    return bytes(ffi.buffer(key))


def test_slots_depend_on_backend_port_and_client_not_on_the_client_port() -> None:
    a = reply_key(b"\x0a\xf4\x01\x05", 8080, b"\x0a\xf4\x01\x07", 40000)
    assert slot_of(a) == slot_of(reply_key(b"\x0a\xf4\x01\x05", 8080, b"\x0a\xf4\x01\x07", 1))
    others = {
        slot_of(reply_key(b"\x0a\xf4\x01\x05", 8081, b"\x0a\xf4\x01\x07", 40000)),
        slot_of(reply_key(b"\x0a\xf4\x01\x06", 8080, b"\x0a\xf4\x01\x07", 40000)),
        slot_of(reply_key(b"\x0a\xf4\x01\x05", 8080, b"\x0a\xf4\x01\x08", 40000)),
    }
    assert slot_of(a) not in others and all(0 <= s < SLOTS for s in others)


def test_a_pass_rebuilds_the_side_not_read_and_then_makes_it_current() -> None:
    table = ArrayMap()
    gate = ReplyGate(table)  # type: ignore[arg-type]
    assert gate.current_side() is None  # unbuilt: the datapath looks everything up
    live = reply_key(b"\x0a\x00\x00\x01", 80, b"\x0a\x00\x00\x02", 1234)
    gone = reply_key(b"\x0a\x00\x00\x03", 80, b"\x0a\x00\x00\x02", 1234)
    # the datapath set both sides of both entries' slots
    for key in (live, gone):
        table.values[slot_of(key)] = table.values[SLOTS + slot_of(key)] = 1
    side = gate.begin()
    assert side == 0 and table.values[slot_of(live)] == 0 and table.values[slot_of(gone)] == 0
    assert table.values[SLOTS + slot_of(gone)] == 1  # the other side is left as it was
    assert table.values.get(SELECTOR, 0) == const.KBP_CT_GATE_UNBUILT  # not yet read
    assert gate.commit(side, [live]) == 1
    assert gate.current_side() == 0
    assert table.values[slot_of(live)] == 1 and table.values[slot_of(gone)] == 0
    # The next pass rebuilds side 1, and side 0 stays what the datapath reads meanwhile.
    assert gate.begin() == 1
    assert table.values[SLOTS + slot_of(gone)] == 0 and table.values[slot_of(live)] == 1
    gate.commit(1, [])
    assert gate.current_side() == 1 and table.values[SLOTS + slot_of(live)] == 0
