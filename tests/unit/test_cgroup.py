"""The pure parts of the socket hooks' attachment (agent/dataplane/ebpf/cgroup.py): finding
the cgroup2 mount, and the table of hooks against the programs bpf/sock_lb.c defines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.dataplane.ebpf import cgroup
from agent.dataplane.ebpf.abi import BPF_DIR
from agent.dataplane.ebpf.kernel import ENTRY_FILES, PROGRAMS

HYBRID = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
bpf /sys/fs/bpf bpf rw,relatime 0 0
"""


@pytest.mark.parametrize(
    ("mounts", "expected"),
    [
        pytest.param(HYBRID, Path("/sys/fs/cgroup/unified"), id="hybrid v1+v2: the unified one"),
        pytest.param(
            "cgroup2 /sys/fs/cgroup cgroup2 rw,nsdelegate 0 0\ncgroup2 /run/other cgroup2 rw 0 0\n",
            Path("/sys/fs/cgroup"),
            id="pure v2, mounted twice: the first",
        ),
        pytest.param(
            "none /run/my\\040cgroups cgroup2 rw 0 0\n",
            Path("/run/my cgroups"),
            id="octal escapes in the mount point are decoded",
        ),
        pytest.param("cgroup /sys/fs/cgroup/cpu cgroup rw,cpu 0 0\n", None, id="v1 only: none"),
        pytest.param("", None, id="empty mount table: none"),
    ],
)
def test_cgroup2_mount(tmp_path: Path, mounts: str, expected: Path | None) -> None:
    table = tmp_path / "mounts"
    table.write_text(mounts)
    assert cgroup.cgroup2_mount(table) == expected


def test_cgroup2_mount_without_a_mount_table_is_none(tmp_path: Path) -> None:
    assert cgroup.cgroup2_mount(tmp_path / "missing") is None


def _sock_lb_functions() -> set[str]:
    text = (BPF_DIR / "sock_lb.c").read_text(encoding="utf-8")
    return set(re.findall(r"^int (kbp_\w+)\(", text, re.MULTILINE))


def test_every_socket_hook_program_is_compiled_and_attached() -> None:
    assert "sock_lb.c" in ENTRY_FILES
    hooks = cgroup.socket_programs()
    assert sorted(hooks) == sorted(cgroup.HOOK_NAMES.values())
    assert {program for program, _ in hooks.values()} == _sock_lb_functions()
    for hook, (program, attach_type) in hooks.items():
        assert PROGRAMS[program].attach_type == attach_type, hook
        # The kernel keeps 15 characters of a program name (BPF_OBJ_NAME_LEN 16), and
        # `bpftool cgroup show` and attached_programs() report that name.
        assert len(program) <= 15, program


def test_hook_pins_are_removed_with_the_other_pins() -> None:
    # dataplane.remove_pins() unlinks every kbp_* entry: link pins must be among them.
    assert cgroup.LINK_PIN_PREFIX.startswith("kbp_")
