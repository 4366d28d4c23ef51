"""Where the eBPF dataplane's filesystems are (agent/dataplane/mounts.py), from mount
tables as nodes have them: the bpffs for the pins, the cgroup2 mount for the socket hooks
on unified, hybrid and v1-only nodes, and what the agent says when one is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.dataplane import mounts
from agent.dataplane.mounts import Mount, cgroup_for_hooks, ensure_bpffs, filesystem_of

UNIFIED = [Mount(Path("/"), "ext4"), Mount(Path("/sys"), "sysfs"),
           Mount(Path("/sys/fs/cgroup"), "cgroup2"), Mount(Path("/sys/fs/bpf"), "bpf")]  # fmt: skip
HYBRID = [Mount(Path("/"), "ext4"), Mount(Path("/sys"), "sysfs"),
          Mount(Path("/sys/fs/cgroup"), "tmpfs"), Mount(Path("/sys/fs/cgroup/cpu"), "cgroup"),
          Mount(Path("/sys/fs/cgroup/unified"), "cgroup2")]  # fmt: skip
# The DaemonSet mounts the host's /sys/fs/cgroup at /run/kube-bpf-proxy/cgroupv2.
HYBRID_IN_POD = [*HYBRID, Mount(Path("/run/kube-bpf-proxy/cgroupv2"), "tmpfs"),
                 Mount(Path("/run/kube-bpf-proxy/cgroupv2/unified"), "cgroup2")]  # fmt: skip
V1_ONLY = [Mount(Path("/"), "ext4"), Mount(Path("/sys/fs/cgroup"), "tmpfs"),
           Mount(Path("/sys/fs/cgroup/cpu"), "cgroup")]  # fmt: skip


def test_a_path_lies_on_the_deepest_mount_above_it_the_last_mounted_winning() -> None:
    table = [*UNIFIED, Mount(Path("/sys/fs/bpf"), "tmpfs")]  # something mounted over it
    assert filesystem_of(Path("/sys/fs/bpf/kube-bpf-proxy"), UNIFIED) == UNIFIED[3]
    assert filesystem_of(Path("/sys/fs/bpf/kube-bpf-proxy"), table).fstype == "tmpfs"
    assert filesystem_of(Path("/sys/fs/bpfx"), UNIFIED).fstype == "sysfs"  # not a prefix
    assert filesystem_of(Path("/x"), []) is None


CGROUP_CASES = {
    "auto on a unified node: the cgroup2 root": (
        "auto", UNIFIED, Path("/sys/fs/cgroup"), ""),
    "auto on a hybrid node: the unified mount": (
        "auto", HYBRID, Path("/sys/fs/cgroup/unified"), ""),
    "auto on a v1-only node: no hooks, said so": (
        "auto", V1_ONLY, None, "no cgroup2 filesystem is mounted"),
    "a cgroup2 directory: itself": (
        "/sys/fs/cgroup/kubepods", UNIFIED, Path("/sys/fs/cgroup/kubepods"), ""),
    "the DaemonSet's path on a hybrid node: the cgroup2 mount below it": (
        "/run/kube-bpf-proxy/cgroupv2", HYBRID_IN_POD,
        Path("/run/kube-bpf-proxy/cgroupv2/unified"), "the socket hooks use the cgroup2 mount"),
    "a v1 directory with no cgroup2 below: no hooks, said so": (
        "/sys/fs/cgroup", V1_ONLY, None, "the socket hooks are off"),
    "none: no hooks, nothing to say": ("none", UNIFIED, None, ""),
}  # fmt: skip


@pytest.mark.parametrize(("configured", "table", "cgroup", "why"), CGROUP_CASES.values(),
                         ids=CGROUP_CASES.keys())  # fmt: skip
def test_where_the_socket_hooks_attach(
    configured: str, table: list[Mount], cgroup: Path | None, why: str
) -> None:
    found, said = cgroup_for_hooks(configured, table)
    assert found == cgroup
    assert (why in said) if why else said == ""


def test_a_pin_directory_on_a_bpffs_needs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mounts, "mount_bpffs", lambda target: pytest.fail("mounted"))
    assert ensure_bpffs(Path("/sys/fs/bpf/kube-bpf-proxy"), UNIFIED) is None


def test_without_a_bpffs_one_is_mounted_at_the_pin_directorys_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mounted: list[Path] = []
    monkeypatch.setattr(mounts, "mount_bpffs", mounted.append)
    done = ensure_bpffs(Path("/sys/fs/bpf/kube-bpf-proxy"), HYBRID)
    assert mounted == [Path("/sys/fs/bpf")]
    assert done == "mounted a bpffs at /sys/fs/bpf (it was sysfs mounted at /sys)"


def test_a_bpffs_that_cannot_be_mounted_is_one_sentence_saying_what_to_mount(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(target: Path) -> None:
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(mounts, "mount_bpffs", refuse)
    with pytest.raises(mounts.BpffsError) as raised:
        ensure_bpffs(Path("/sys/fs/bpf/kube-bpf-proxy"), HYBRID)
    assert str(raised.value) == (
        "/sys/fs/bpf is not a BPF filesystem (it is sysfs mounted at /sys) and mounting one "
        "there failed with EPERM (no CAP_SYS_ADMIN?): mount it on the node with "
        "`mount -t bpf bpf /sys/fs/bpf`"
    )


def test_no_bpffs_is_mounted_over_a_directory_that_holds_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A bpffs over a user's directory would hide what is in it (here: the manifests)."""
    monkeypatch.setattr(mounts, "mount_bpffs", lambda target: pytest.fail("mounted"))
    (tmp_path / "web.yaml").write_text("kind: List\n")
    table = [Mount(Path("/"), "ext4")]
    with pytest.raises(
        mounts.BpffsError, match="is not empty, so no bpffs is mounted over it"
    ) as e:
        ensure_bpffs(tmp_path / "pins", table)
    # The advice names the kernel's mount point, never the directory it called non-empty.
    assert f"mount -t bpf bpf {tmp_path}" not in str(e.value)
    assert "give --bpffs a directory on a bpffs, e.g. /sys/fs/bpf/kube-bpf-proxy" in str(e.value)
    assert "`mount -t bpf bpf /sys/fs/bpf`" in str(e.value)


def test_an_empty_directory_gets_a_bpffs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    mounted: list[Path] = []
    monkeypatch.setattr(mounts, "mount_bpffs", mounted.append)
    parent = tmp_path / "bpf"
    parent.mkdir()
    assert ensure_bpffs(parent / "pins", [Mount(Path("/"), "ext4")]) is not None
    assert mounted == [parent]
