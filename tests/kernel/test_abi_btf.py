"""cffi's layouts (from bpf/include/kbp_abi.h) equal the compiled programs' types: the BTF
bcc attaches to the pinned maps, read back with bpftool, has every ABI struct with the
same size and the same member names at the same offsets."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from agent.dataplane.ebpf import abi
from agent.dataplane.ebpf.kernel import load_programs


def btf_structs(pin: Path) -> dict[str, dict]:
    dump = subprocess.run(
        ["bpftool", "--json", "btf", "dump", "map", "pinned", str(pin)],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return {
        t["name"]: t
        for t in json.loads(dump.stdout)["types"]
        if t.get("kind") == "STRUCT" and t.get("name", "").startswith("kbp_")
    }


def test_cffi_layouts_equal_the_compiled_btf(bpf_pin_dir: Path) -> None:
    loaded = load_programs(bpf_pin_dir, {"services": 64, "slots": 64, "backends": 64,
                                         "ct": 64, "affinity": 64})  # fmt: skip
    try:
        found: dict[str, dict] = {}
        for name in abi.MAP_NAMES:
            found.update(btf_structs(bpf_pin_dir / abi.versioned(name)))
    finally:
        loaded.close()
    for struct in abi.STRUCTS:
        assert struct in found, f"struct {struct} is in no pinned map's BTF"
        btf = found[struct]
        assert btf["size"] == abi.ffi.sizeof(f"struct {struct}"), struct
        members = [(m["name"], m["bits_offset"] // 8) for m in btf["members"]]
        ours = [(name, offset) for name, offset, _size in abi.layout(struct)]
        assert members == ours, f"struct {struct}: BTF {members} != cffi {ours}"
