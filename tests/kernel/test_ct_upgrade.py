"""An upgrade that renames the maps (a new ABI version) keeps the conntrack entries of a
version with the same entry layout: adopt_earlier_conntrack copies them from the old
pinned kbp_ct into the new one, and leaves other layouts alone."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.dataplane.ebpf import abi
from agent.dataplane.ebpf.conntrack import adopt_earlier_conntrack
from agent.dataplane.ebpf.libbpf import Map

pytestmark = pytest.mark.kernel

# Two pinned LRU maps with kbp_ct's key and value, as an earlier version's agent and this
# one's would have made them, and a third with another value size (another layout).
MAPS_C = """
#include "kbp_abi.h"
#define CT(name, value, pin) \\
    BPF_TABLE_PINNED("lru_hash", struct kbp_ct_key, value, name, 1024, pin)
CT(old_ct, struct kbp_ct_entry, "{dir}/kbp_ct_v3");
CT(new_ct, struct kbp_ct_entry, "{dir}/{ours}");
CT(odd_ct, struct kbp_ct_key, "{dir}/kbp_ct_v2");
int kbp_test_nothing(void *ctx) {{ return 0; }}
"""


@pytest.fixture
def pins() -> Iterator[Path]:
    from ..conftest import BPFFS, missing_kernel_prerequisites

    if missing_kernel_prerequisites():
        pytest.skip("kernel prerequisites missing")  # the per-test hook reports why
    from bcc import BPF

    pin_dir = BPFFS / f"kbp-test-ct-upgrade-{time.monotonic_ns()}"
    pin_dir.mkdir()
    include = Path(__file__).resolve().parents[2] / "bpf" / "include"
    text = MAPS_C.format(dir=pin_dir, ours=abi.versioned("kbp_ct"))
    module = None
    try:
        module = BPF(text=text.encode(), cflags=[f"-I{include}"])
        yield pin_dir
    finally:
        if module is not None:
            module.cleanup()
        shutil.rmtree(pin_dir, ignore_errors=True)
    assert not pin_dir.exists()


def test_an_earlier_versions_entries_are_copied_and_another_layouts_are_not(pins: Path) -> None:
    old = Map.pinned(str(pins / "kbp_ct_v3"))
    new = Map.pinned(str(pins / abi.versioned("kbp_ct")))
    odd = Map.pinned(str(pins / "kbp_ct_v2"))
    try:
        entries = {bytes([n]) * old.key_size: bytes([n + 1]) * old.value_size for n in range(5)}
        for key, value in entries.items():
            old.update(key, value)
        odd.update(bytes([9]) * odd.key_size, bytes([9]) * odd.value_size)
        kept = bytes([0]) * new.key_size  # one key the new programs already wrote
        new.update(kept, bytes([7]) * new.value_size)
        copied, skipped = adopt_earlier_conntrack(pins, new)
        assert copied == 4 and skipped == ["kbp_ct_v2"]
        held = dict(new.items())
        assert held[kept] == bytes([7]) * new.value_size  # not overwritten
        assert {k: v for k, v in held.items() if k != kept} == {
            k: v for k, v in entries.items() if k != kept
        }
    finally:
        for m in (old, new, odd):
            m.close()
