"""The filesystems the eBPF dataplane stands on: where the bpffs for its pins is (and
mounting one when there is none, as Cilium does), and where the cgroup v2 hierarchy its
socket hooks attach to is mounted (on hybrid nodes not at /sys/fs/cgroup).

Read from /proc/self/mounts, so the answers are this process's mount namespace's: under
`ip netns exec`, which remounts /sys, the bpffs of the host is not there.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass
from pathlib import Path

MOUNTS = Path("/proc/self/mounts")
BPFFS = "bpf"
CGROUP2 = "cgroup2"


@dataclass(frozen=True, slots=True)
class Mount:
    point: Path
    fstype: str


def _unescape(field: str) -> str:
    """/proc/self/mounts writes space, tab, newline and backslash as octal escapes."""
    for code in ("040", "011", "012", "134"):
        field = field.replace(f"\\{code}", chr(int(code, 8)))
    return field


def mount_table(mounts: Path = MOUNTS) -> list[Mount]:
    """Every mount, in the order the kernel lists them (a later mount on the same point
    hides an earlier one); empty when the table cannot be read."""
    try:
        text = mounts.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    table = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            table.append(Mount(Path(_unescape(fields[1])), fields[2]))
    return table


def filesystem_of(path: Path, table: list[Mount] | None = None) -> Mount | None:
    """The mount `path` lies on (or would, once created): the deepest mount point above
    it, the last mounted there winning; None when no mount table is readable."""
    table = mount_table() if table is None else table
    target = Path(os.path.abspath(path))
    best: Mount | None = None
    for mount in table:
        above = target == mount.point or mount.point in target.parents
        if above and (best is None or len(mount.point.parts) >= len(best.point.parts)):
            best = mount
    return best


def cgroup2_mounts(table: list[Mount] | None = None) -> list[Path]:
    """Where cgroup2 is mounted, in mount order."""
    table = mount_table() if table is None else table
    return [mount.point for mount in table if mount.fstype == CGROUP2]


def mount_bpffs(target: Path) -> None:
    """Mount a new bpffs at `target` (created if missing); OSError when refused."""
    target.mkdir(parents=True, exist_ok=True)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = (ctypes.c_char_p,) * 3 + (ctypes.c_ulong, ctypes.c_void_p)
    if libc.mount(b"bpf", os.fsencode(target), b"bpf", 0, None) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount -t bpf bpf {target}: {os.strerror(code)}")


# Where the kernel offers a bpffs mount point (an empty sysfs directory made for it).
BPFFS_MOUNT_POINT = Path("/sys/fs/bpf")


def ensure_bpffs(pin_dir: Path, table: list[Mount] | None = None) -> str | None:
    """Make sure `pin_dir` will be on a bpffs: when its parent is not on one, mount a
    bpffs at the parent, but only where that hides nothing: /sys/fs/bpf (the kernel's own
    mount point for it) or an empty directory. Returns what was done (None: nothing was
    needed); raises BpffsError with a sentence saying what to mount otherwise."""
    found = filesystem_of(pin_dir, table)
    if found is not None and found.fstype == BPFFS:
        return None
    parent = Path(os.path.abspath(pin_dir)).parent
    where = f"{found.fstype} mounted at {found.point}" if found is not None else "unknown"
    advice = f"mount it on the node with `mount -t bpf bpf {parent}`"
    if parent != BPFFS_MOUNT_POINT and not _empty_or_missing(parent):
        # Not "mount it at the parent": that would hide what the parent holds.
        raise BpffsError(
            f"{parent} is not a BPF filesystem (it is {where}) and is not empty, so no bpffs "
            f"is mounted over it: give --bpffs a directory on a bpffs, e.g. "
            f"{BPFFS_MOUNT_POINT}/kube-bpf-proxy (mounted on the node with "
            f"`mount -t bpf bpf {BPFFS_MOUNT_POINT}` if it is not yet)"
        )
    try:
        mount_bpffs(parent)
    except OSError as err:
        hint = " (no CAP_SYS_ADMIN?)" if err.errno in (errno.EPERM, errno.EACCES) else ""
        name = errno.errorcode.get(err.errno or 0, str(err.errno))
        raise BpffsError(
            f"{parent} is not a BPF filesystem (it is {where}) and mounting one there "
            f"failed with {name}{hint}: {advice}"
        ) from err
    return f"mounted a bpffs at {parent} (it was {where})"


def _empty_or_missing(directory: Path) -> bool:
    try:
        return not any(directory.iterdir())
    except FileNotFoundError:
        return True
    except OSError:
        return False


class BpffsError(Exception):
    """No bpffs for the pins and none could be mounted; the message says what to do."""


def cgroup_for_hooks(configured: str, table: list[Mount] | None = None) -> tuple[Path | None, str]:
    """Where the socket hooks attach, from `--cgroup-root` (auto, none or a directory),
    and a sentence saying why when it is not what was asked (empty when it is).

    auto: the first cgroup2 mount. A directory on a cgroup2 filesystem: itself. A
    directory that is not (a hybrid node's /sys/fs/cgroup, a tmpfs of v1 controllers):
    the cgroup2 mount below it (often `unified/`). None when there is none: the eBPF
    dataplane then runs without its socket hooks, and the sentence says so."""
    if configured == "none":
        return None, ""
    table = mount_table() if table is None else table
    mounts = cgroup2_mounts(table)
    if configured == "auto":
        if mounts:
            return mounts[0], ""
        return None, ("no cgroup2 filesystem is mounted (a cgroup v1 node): the socket hooks "
                      "are off, so the node's own processes reach Services only through "
                      "the routes")  # fmt: skip
    path = Path(os.path.abspath(configured))
    found = filesystem_of(path, table)
    if found is not None and found.fstype == CGROUP2:
        return path, ""
    below = [mount for mount in mounts if path in mount.parents]
    what = f"{found.fstype} at {found.point}" if found is not None else "on no known mount"
    if below:
        return below[0], (f"--cgroup-root {path} is not a cgroup2 filesystem ({what}); the "
                          f"socket hooks use the cgroup2 mount below it, {below[0]}")  # fmt: skip
    return None, (f"--cgroup-root {path} is not a cgroup2 filesystem ({what}) and none is "
                  "mounted below it (a cgroup v1 or hybrid node?): the socket hooks are off, "
                  "so the node's own processes reach Services only through the routes; give "
                  "the cgroup2 mount, e.g. /sys/fs/cgroup/unified")  # fmt: skip
