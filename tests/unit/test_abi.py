"""The ABI as cffi derives it from bpf/include/kbp_abi.h: no implicit padding anywhere,
layouts equal to the golden file (a layout change must bump KBP_ABI_VERSION and the
golden together), and the fast packers agree with cffi field for field.

Regenerate the golden with KBP_UPDATE_GOLDEN=1 (and bump KBP_ABI_VERSION).
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path

import pytest

from agent.dataplane.ebpf import abi
from agent.dataplane.ebpf.dataplane import remove_stale_pins
from agent.dataplane.ebpf.maps import MapSizes

GOLDEN = Path(__file__).parents[1] / "golden" / "abi-layout.txt"


def render_layouts() -> str:
    lines = [f"KBP_ABI_VERSION {abi.const.KBP_ABI_VERSION}"]
    for struct in abi.STRUCTS:
        lines.append(f"struct {struct} size {abi.ffi.sizeof('struct ' + struct)}")
        lines.extend(f"  {offset:3d} {size:3d} {name}" for name, offset, size in abi.layout(struct))
    return "\n".join(lines) + "\n"


def test_layouts_match_the_golden_file() -> None:
    text = render_layouts()
    if os.environ.get("KBP_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), (
        f"{GOLDEN} differs: a layout changed; bump KBP_ABI_VERSION and regenerate"
    )


@pytest.mark.parametrize("struct", abi.STRUCTS)
def test_struct_has_no_implicit_padding(struct: str) -> None:
    assert abi.implicit_padding(struct) == [], f"struct {struct} needs explicit pad fields"


@pytest.mark.parametrize("struct", abi.STRUCTS)
def test_packer_puts_every_field_at_cffi_offset(struct: str) -> None:
    packer = abi.packer(struct)
    assert packer.size == abi.ffi.sizeof(f"struct {struct}")
    # Pack a value where each field holds a distinct byte pattern, read back with cffi.
    fields = [(name, offset, size) for name, offset, size in abi.layout(struct)
              if not name.startswith("pad")]  # fmt: skip
    values = [bytes([n]) * size for n, (_name, _offset, size) in enumerate(fields, start=1)]
    raw = bytearray(packer.size)
    for (_name, offset, size), value in zip(fields, values, strict=True):
        raw[offset : offset + size] = value
    unpacked = packer.unpack(bytes(raw))
    for (name, _offset, _size), value, got in zip(fields, values, unpacked, strict=True):
        expected = value if isinstance(got, bytes) else int.from_bytes(value, sys.byteorder)
        assert got == expected, f"struct {struct}.{name}"


def test_every_define_is_a_constant() -> None:
    assert abi.const.KBP_ABI_VERSION >= 1
    assert 1 + max(
        value for name, value in vars(abi.const).items()
        if name.startswith("KBP_DROP_") and name != "KBP_DROP_REASONS"
    ) == abi.const.KBP_DROP_REASONS  # fmt: skip


def test_map_names_fit_the_kernel_name_limit() -> None:
    # BPF_OBJ_NAME_LEN is 16 including the NUL: longer names are cut by the kernel.
    assert all(len(name) <= 15 for name in abi.MAP_NAMES)
    assert abi.versioned("kbp_ct") == f"kbp_ct_v{abi.const.KBP_ABI_VERSION}"


def test_maps_are_read_from_their_one_declaration() -> None:
    assert abi.MAP_NAMES[:3] == ("kbp_services", "kbp_slots", "kbp_backends")
    assert abi.MAPS["kbp_services"] == abi.MapDecl(
        "kbp_services", "hash", "struct kbp_frontend_key", "struct kbp_service",
        "KBP_MAX_SERVICES",
    )  # fmt: skip
    assert {"kbp_ct", "kbp_src_ranges", "kbp_config", "kbp_ports", "kbp_meta"} <= set(abi.MAPS)


def test_every_map_size_is_one_row_of_map_sizes_with_the_c_default() -> None:
    """Every KBP_MAX_<NAME> of kbp_maps.h sizes the map kbp_<name> and is a MapSizes field
    (the one table, agent/dataplane/ebpf/options.py: the loader passes each with -D),
    whose default is the header's (used only when the loader passes none)."""
    text = abi.MAPS_HEADER.read_text(encoding="utf-8")
    defaults = dict(re.findall(r"^#define KBP_MAX_(\w+) (\d+)$", text, re.M))
    sizes = MapSizes()
    assert sorted(defaults) == sorted(f.name.upper() for f in dataclasses.fields(MapSizes))
    for f in dataclasses.fields(MapSizes):
        assert abi.MAPS[f"kbp_{f.name}"].size == f"KBP_MAX_{f.name.upper()}"
        assert int(defaults[f.name.upper()]) == getattr(sizes, f.name), f.name
    sized = {d.size for d in abi.MAPS.values() if d.size.startswith("KBP_MAX_")}
    assert sized == {f"KBP_MAX_{name}" for name in defaults}


@pytest.mark.parametrize("ip", ["10.96.0.1", "0.0.0.0", "fd00:96::1", "2001:db8::10", "::"])
def test_addresses_round_trip(ip: str) -> None:
    raw = abi.addr_bytes(ip)
    assert len(raw) == 16
    assert abi.addr_text(raw, abi.family_of(ip)) == ip


def test_an_upgrade_removes_only_the_pins_of_other_abi_versions(tmp_path: Path) -> None:
    current = abi.const.KBP_ABI_VERSION
    names = [
        f"kbp_ct_v{current - 1}",  # the old layout's maps: removed
        f"kbp_services_v{current - 1}",
        f"kbp_ct_v{current}",  # ours: kept
        f"kbp_services_v{current}",
        "kbp_link_connect4",  # socket links carry no version: kept
        "kbp_ct_vx",  # not a version: kept
        "other_v1",  # not ours: kept
    ]
    for name in names:
        (tmp_path / name).touch()
    assert remove_stale_pins(tmp_path) == [f"kbp_ct_v{current - 1}", f"kbp_services_v{current - 1}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
