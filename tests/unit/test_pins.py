"""The comparison of a pin with the map our text creates (agent/dataplane/ebpf/pins.py):
which differences make a pin someone else's, how the one line names them, and the shapes
derived from the map declarations and the ABI header. No kernel: shapes are values."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from agent.dataplane.ebpf import pins
from agent.dataplane.ebpf.abi import ffi, versioned
from agent.dataplane.ebpf.options import MapSizes

OURS_CT = pins.Shape(type=9, key_size=40, value_size=80, max_entries=4096, flags=0,
                     name="kbp_ct", key_type="kbp_ct_key", value_type="kbp_ct_entry")  # fmt: skip
PATH = Path("/sys/fs/bpf/x") / versioned("kbp_ct")


@pytest.mark.parametrize(
    ("case", "theirs", "differ"),
    [
        ("the same map", OURS_CT, []),
        ("only another size: ours, to move", replace(OURS_CT, max_entries=8192), []),
        ("another type", replace(OURS_CT, type=1), ["type"]),
        ("another key size", replace(OURS_CT, key_size=8), ["key_size"]),
        ("another value size", replace(OURS_CT, value_size=72), ["value_size"]),
        ("other flags", replace(OURS_CT, flags=1), ["flags"]),
        ("another kernel name", replace(OURS_CT, name="ct"), ["name"]),
        ("another BTF key type", replace(OURS_CT, key_type="flow"), ["key_type"]),
        ("no BTF: shape only", replace(OURS_CT, key_type=None, value_type=None), []),
    ],
)
def test_what_makes_a_pin_another_map(case: str, theirs: pins.Shape, differ: list) -> None:
    assert pins.differences(OURS_CT, theirs) == differ, case


def test_the_line_names_the_pin_and_what_differs() -> None:
    theirs = pins.Shape(1, 8, 8, 16, 0, "kbp_ct")  # as bpftool makes one: no BTF
    assert pins.foreign_message(PATH, OURS_CT, theirs) == (
        f"pin {PATH} is a hash of 8-byte keys and 8-byte values, ours is an LRU hash of "
        "40-byte keys and 80-byte values: not our map; it was left in place"
    )
    btf = replace(OURS_CT, key_type="flow", value_type="state")
    assert pins.foreign_message(PATH, OURS_CT, btf) == (
        f"pin {PATH} is an LRU hash with BTF types flow -> state, ours is an LRU hash with "
        "BTF types kbp_ct_key -> kbp_ct_entry: not our map; it was left in place"
    )
    assert pins.foreign_message(PATH, OURS_CT, None) == (
        f"pin {PATH} is not a map: not our map; it was left in place"
    )


def test_the_shapes_follow_the_declarations_the_abi_and_the_sizes() -> None:
    default = pins.expected()
    assert set(default) == set(pins.declarations())
    ct = pins.expected({"ct": 8192})["kbp_ct"]
    assert ct == replace(
        OURS_CT, key_size=ffi.sizeof("struct kbp_ct_key"),
        value_size=ffi.sizeof("struct kbp_ct_entry"), max_entries=8192,
    )  # fmt: skip
    assert default["kbp_ct"].max_entries == MapSizes().ct
    # sized by an expression of ABI constants, and with flags
    assert default["kbp_ct_gate"].max_entries == 2 * 65536 + 1
    assert (default["kbp_src_ranges"].type, default["kbp_src_ranges"].flags) == (11, 1)
    peer = ffi.sizeof("struct kbp_sock_peer")
    assert default["kbp_sock_peer"] == pins.Shape(24, 4, peer, 0, 1, "kbp_sock_peer", "int",
                                                  "kbp_sock_peer")  # fmt: skip
    # the counters are sized by the services setting
    assert pins.expected({"services": 2048})["kbp_counters"].max_entries == 2048


@pytest.mark.parametrize("expression", ["KBP_NOT_A_NAME", "f(1)", "1 / 2", "'x'"])
def test_an_expression_the_loader_cannot_evaluate_is_an_error(expression: str) -> None:
    with pytest.raises(ValueError, match=r"cannot evaluate|unknown name"):
        pins._evaluate(expression, {"KBP_X": 1})


def test_the_aside_name_is_no_version_and_no_dot() -> None:
    aside = PATH.name + pins.ASIDE_SUFFIX
    assert "." not in aside  # bpffs refuses dotted names
    assert not aside.rpartition("_v")[2].isdigit()  # never taken for another ABI version
