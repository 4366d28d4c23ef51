"""The DaemonSet's init container script (deploy/daemonset.yaml, `mount-bpffs`) run in a
private mount namespace of its own: it mounts a bpffs where /sys/fs/bpf has none, and
leaves an existing one alone. The host's mounts are never touched (the namespace's
changes die with it)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def init_script() -> str:
    documents = yaml.safe_load_all((ROOT / "deploy" / "daemonset.yaml").read_text())
    (daemonset,) = [d for d in documents if d and d["kind"] == "DaemonSet"]
    (init,) = daemonset["spec"]["template"]["spec"]["initContainers"]
    shell, flag, script = init["command"]
    assert (shell, flag) == ("/bin/sh", "-c")
    return script


def in_private_mounts(setup: str) -> tuple[str, str, int]:
    """Run `setup`, then the init script, in a new private mount namespace: (the script's
    output, the filesystem type at /sys/fs/bpf after it, mounts at /sys/fs/bpf after it)."""
    script = (
        f"{setup} || exit 97\n"
        f"sh -c {quote(init_script())} || exit $?\n"
        'echo "$(stat -f -c %T /sys/fs/bpf)"\n'
        "grep -c ' /sys/fs/bpf ' /proc/mounts\n"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    said, fstype, count = done.stdout.strip().splitlines()
    return said, fstype, int(count)


def quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def test_without_a_bpffs_the_init_script_mounts_one() -> None:
    """A host whose /sys/fs/bpf is no bpffs (a tmpfs over it stands for one): the script
    mounts a bpffs there, on top."""
    said, fstype, mounts = in_private_mounts("mount -t tmpfs kbp-test /sys/fs/bpf")
    assert said == "mounted bpffs at /sys/fs/bpf"
    assert fstype == "bpf_fs"
    assert mounts == 3  # the host's bpffs, the tmpfs hiding it, the new bpffs


def mounts_at_bpffs_after(setup: str) -> int:
    """How many mounts /sys/fs/bpf has after `setup` alone, in a private mount namespace."""
    script = f"{setup} && grep -c ' /sys/fs/bpf ' /proc/mounts"
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return int(done.stdout)


def test_an_existing_bpffs_is_left_alone() -> None:
    """A fresh bpffs at /sys/fs/bpf (as on most hosts): nothing is mounted over it."""
    setup = "mount -t bpf bpf /sys/fs/bpf"
    said, fstype, mounts = in_private_mounts(setup)
    assert said == "bpffs is mounted at /sys/fs/bpf"
    assert fstype == "bpf_fs"
    assert mounts == mounts_at_bpffs_after(setup)  # the script added none
