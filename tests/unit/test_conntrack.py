"""The conntrack collector's reading of kbp_ct entries (agent/dataplane/ebpf/conntrack.py):
flow states from the flags of both entries, and the reply key of each kind of forward
entry (as bpf/lib/conntrack.h builds it)."""

from __future__ import annotations

import pytest

from agent.dataplane.ebpf import abi
from agent.dataplane.ebpf.conntrack import TCP_ESTABLISHED, flow_state, flows_of, reply_key_of

C = abi.const
F = {"reply": C.KBP_CT_F_SEEN_REPLY, "fin": C.KBP_CT_F_CLOSING,
     "rst": C.KBP_CT_F_CLOSING | C.KBP_CT_F_RST}  # fmt: skip


# (protocol, forward entry's flags, reply entry's flags) -> state
STATES = {
    "TCP SYN, nothing back": (6, 0, 0, "syn-sent"),
    "TCP answered": (6, 0, F["reply"], "established"),
    "TCP FIN from the client only": (6, F["fin"], F["reply"], "close-wait"),
    "TCP FIN from the backend only": (6, 0, F["reply"] | F["fin"], "close-wait"),
    "TCP FINs both ways": (6, F["fin"], F["reply"] | F["fin"], "time-wait"),
    "TCP RST either way": (6, F["rst"], F["reply"], "time-wait"),
    "UDP one way": (17, 0, 0, "unreplied"),
    "UDP answered": (17, 0, F["reply"], "assured"),
    "SCTP answered": (132, 0, F["reply"], "established"),
}


@pytest.mark.parametrize(("proto", "forward", "reply", "state"), STATES.values(),
                         ids=STATES.keys())  # fmt: skip
def test_flow_state(proto: int, forward: int, reply: int, state: str) -> None:
    assert flow_state(proto, forward, reply) == state


def _key(src: str, dst: str, sport: int, dport: int, direction: int) -> bytes:
    return abi.packer("kbp_ct_key").pack(abi.addr_bytes(src), abi.addr_bytes(dst),
                                         abi.port_bytes(sport), abi.port_bytes(dport), 6, 4,
                                         direction)  # fmt: skip


def _entry(addr: str, port: int, flags: int, nat: str = "0.0.0.0", nat_port: int = 0) -> bytes:
    return abi.packer("kbp_ct_entry").pack(abi.addr_bytes(addr), abi.port_bytes(port), flags, 1,
                                           1, 0, 0, abi.addr_bytes(nat), abi.port_bytes(nat_port),
                                           bytes(6), bytes(6), 0)  # fmt: skip


FORWARD = _key("10.244.0.2", "10.96.0.10", 40000, 80, C.KBP_CT_FORWARD)
# forward entry -> the key its reply entry has (lib/conntrack.h)
REPLY_KEYS = {
    "plain": (_entry("10.244.1.5", 8080, 0),
              _key("10.244.1.5", "10.244.0.2", 8080, 40000, C.KBP_CT_REPLY)),
    "hairpin": (_entry("10.244.0.2", 8080, C.KBP_CT_F_HAIRPIN),
                _key("10.244.0.2", "10.96.0.10", 8080, 40000, C.KBP_CT_REPLY)),
    "snat": (_entry("10.244.2.5", 8080, C.KBP_CT_F_SNAT, "192.168.0.1", 61234),
             _key("10.244.2.5", "192.168.0.1", 8080, 61234, C.KBP_CT_REPLY)),
    "remapped port": (_entry("10.244.1.5", 8080, C.KBP_CT_F_SPORT, "10.244.0.2", 62000),
                      _key("10.244.1.5", "10.244.0.2", 8080, 62000, C.KBP_CT_REPLY)),
}  # fmt: skip


@pytest.mark.parametrize(("entry", "expected"), REPLY_KEYS.values(), ids=REPLY_KEYS.keys())
def test_reply_key_of_a_forward_entry(entry: bytes, expected: bytes) -> None:
    assert reply_key_of(FORWARD, entry) == expected


def test_a_reply_entrys_spare_belongs_to_its_flow() -> None:
    # The spare (KBP_CT_SPARE) is collected with its flow, and alone it is a flow of its
    # own, as a reply entry whose forward entry is gone.
    entry, reply_key = REPLY_KEYS["plain"]
    spare_key = reply_key[:-2] + bytes((C.KBP_CT_SPARE, 0))
    reply = _entry("10.96.0.10", 80, C.KBP_CT_F_SEEN_REPLY)
    (flow,) = flows_of([(FORWARD, entry), (reply_key, reply), (spare_key, reply)])
    assert flow.keys == [FORWARD, reply_key, spare_key]
    assert flow.state == TCP_ESTABLISHED
    (flow,) = flows_of([(spare_key, reply)])
    assert flow.keys == [spare_key]
    (flow,) = flows_of([(FORWARD, entry), (spare_key, reply)])  # the reply entry lost
    assert flow.keys == [FORWARD, spare_key]
    assert flow.state == TCP_ESTABLISHED
