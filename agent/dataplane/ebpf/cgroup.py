"""Socket-level load balancing for the node's own processes: attach the cgroup socket
hooks of bpf/sock_lb.c to a cgroup through pinned bpf_links, so that a restarted agent
swaps its programs in place and the hooks keep working while no agent runs.

Each hook is one link pinned as `<pin dir>/kbp_link_<hook>`. Links are always
multi-attach: other programs on the same cgroup (a CNI's, a security agent's) are never
replaced or detached, and ours are found by their pins, never by scanning.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import sys
from pathlib import Path

from ..mounts import MOUNTS, cgroup2_mounts, mount_table
from . import libbpf
from .kernel import PROGRAMS, LoadedPrograms
from .netlink import run_in_netns

log = logging.getLogger(__name__)

SO_NETNS_COOKIE = 71  # SOL_SOCKET option, kernel 5.14+
LINK_PIN_PREFIX = "kbp_link_"

# enum bpf_attach_type of the socket hooks -> the hook's name (as bpftool prints it).
HOOK_NAMES = {
    10: "connect4",
    11: "connect6",
    14: "sendmsg4",
    15: "sendmsg6",
    19: "recvmsg4",
    20: "recvmsg6",
    29: "getpeername4",
    30: "getpeername6",
    34: "sock_release",
}


class CgroupAttachError(Exception):
    """The socket hooks could not be attached to (or found in) a cgroup; the message
    names the cgroup, the hook and the errno."""


def socket_programs() -> dict[str, tuple[str, int]]:
    """hook name -> (program name, attach type), for every socket hook of the datapath."""
    hooks = {}
    for name, spec in PROGRAMS.items():
        if spec.prog_type in ("CGROUP_SOCK_ADDR", "CGROUP_SOCK"):
            hooks[HOOK_NAMES[spec.attach_type]] = (name, spec.attach_type)
    return hooks


def cgroup2_mount(mounts: Path = MOUNTS) -> Path | None:
    """Where the cgroup2 hierarchy is mounted (first mount listed), or None. On hybrid
    systems that is /sys/fs/cgroup/unified rather than /sys/fs/cgroup."""
    found = cgroup2_mounts(mount_table(mounts))
    return found[0] if found else None


def cookie_of_this_netns() -> int:
    """netns_cookie() of the calling thread's namespace (for run_in_netns callers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8)
        except OSError as err:
            raise OSError(
                err.errno, f"SO_NETNS_COOKIE: {os.strerror(err.errno or 0)} (needs kernel 5.14+)"
            ) from err
    return int.from_bytes(raw, sys.byteorder)


def netns_cookie(netns: str | None = None) -> int:
    """The network namespace cookie (what bpf_get_netns_cookie() returns in the kernel) of
    the calling thread's namespace, or of the named one (/run/netns/NAME, or a path),
    read from a socket made there by a short-lived thread."""
    if netns is None:
        return cookie_of_this_netns()
    return run_in_netns(netns, cookie_of_this_netns)


def link_pin(pin_dir: Path, hook: str) -> Path:
    """Where the link of one socket hook is pinned."""
    return pin_dir / f"{LINK_PIN_PREFIX}{hook}"


def _pinned_hooks(pin_dir: Path) -> list[str]:
    if not pin_dir.is_dir():
        return []
    return sorted(
        entry.name.removeprefix(LINK_PIN_PREFIX)
        for entry in pin_dir.iterdir()
        if entry.name.startswith(LINK_PIN_PREFIX)
    )


def socket_hooks_pinned(pin_dir: Path) -> list[str]:
    """The hooks whose links an agent pinned under `pin_dir` (attached, or left by one
    that died)."""
    return _pinned_hooks(pin_dir)


def _open_cgroup(cgroup: Path) -> tuple[int, int]:
    """(fd, cgroup id) of a cgroup2 directory; the id is its inode number."""
    try:
        fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise CgroupAttachError(
            f"cgroup {cgroup}: cannot open it ({os.strerror(err.errno or 0)}, errno "
            f"{err.errno}); give the cgroup2 mount point or a directory under it"
        ) from err
    return fd, os.fstat(fd).st_ino


def _update_held(
    held: dict[str, int], hook: str, pin: Path, prog_fd: int, attach_type: int, cgroup_id: int
) -> bool:  # fmt: skip
    """Point the link we hold for `hook` at the new program and pin it again if its pin
    was removed. False when we hold none that is still on the cgroup (then released)."""
    link_fd = held.get(hook)
    if link_fd is None:
        return False
    info = libbpf.link_info(link_fd)
    if (info.cgroup_id, info.attach_type) == (cgroup_id, attach_type) and (
        libbpf.link_update_and_pin(link_fd, prog_fd, str(pin))
    ):
        return True
    os.close(held.pop(hook))  # detached by someone else, or its cgroup went
    return False


def _replace_in_place(
    pin: Path, prog_fd: int, attach_type: int, cgroup_id: int
) -> int | None:  # fmt: skip
    """Point our pinned link at the new program; its fd (the caller's to close). None
    when there is no usable link (no pin, or a link to another cgroup or to a removed
    one: that one is detached and unpinned, so the caller makes a new link)."""
    if not pin.exists():
        return None
    link_fd = libbpf.obj_get(str(pin))
    try:
        info = libbpf.link_info(link_fd)
        if info.cgroup_id == cgroup_id and info.attach_type == attach_type:
            try:
                libbpf.link_update(link_fd, prog_fd)
                kept, link_fd = link_fd, -1
                return kept
            except OSError as err:
                if err.errno != errno.ENOLINK:  # ENOLINK: its cgroup went away meanwhile
                    raise
        with contextlib.suppress(OSError):  # already defunct when its cgroup was removed
            libbpf.link_detach(link_fd)
    finally:
        if link_fd >= 0:
            os.close(link_fd)
    pin.unlink()
    return None


def _attach_one(
    hook: str, program: str, prog_fd: int, attach_type: int, cgroup: Path, cgroup_fd: int,
    cgroup_id: int, pin_dir: Path, held: dict[str, int],
) -> None:  # fmt: skip
    pin = link_pin(pin_dir, hook)
    try:
        if _update_held(held, hook, pin, prog_fd, attach_type, cgroup_id):
            return
        link_fd = _replace_in_place(pin, prog_fd, attach_type, cgroup_id)
        if link_fd is not None:
            held[hook] = link_fd
            log.debug("ebpf: %s on cgroup %s now runs the new %s", hook, cgroup, program)
            return
        link_fd = libbpf.link_create(prog_fd, cgroup_fd, attach_type)
        try:
            libbpf.obj_pin(link_fd, str(pin))
        except BaseException:
            os.close(link_fd)
            raise
        held[hook] = link_fd  # beside the pin: a removed pin detaches nothing
    except OSError as err:
        code = errno.errorcode.get(err.errno or 0, str(err.errno))
        raise CgroupAttachError(
            f"attaching {program} to cgroup {cgroup} at {hook} failed with {code}: {err.strerror}"
        ) from err
    log.debug("ebpf: attached %s to cgroup %s at %s", program, cgroup, hook)


def attach_socket_hooks(
    programs: LoadedPrograms, cgroup: Path, pin_dir: Path, held: dict[str, int] | None = None
) -> list[str]:  # fmt: skip
    """Attach every socket hook to `cgroup` (the cgroup2 root covers every process of the
    node); on an agent restart, swap the programs of our pinned links in place. Pins of
    hooks this datapath no longer has are removed. On failure nothing of ours stays
    attached (a half set would rewrite connect() but not recvmsg()), and
    CgroupAttachError says why. Returns the hooks attached.

    `held` (hook → link fd): the caller keeps each link's fd as well as its pin, so that
    a pin removed under it detaches nothing; links it already holds are updated and
    pinned again. None: the pins alone hold the links."""
    keep = held is not None
    held = held if held is not None else {}
    hooks = socket_programs()
    pin_dir.mkdir(parents=True, exist_ok=True)
    for stale in sorted(set(_pinned_hooks(pin_dir)) - set(hooks)):
        _remove_link(link_pin(pin_dir, stale))
    cgroup_fd, cgroup_id = _open_cgroup(cgroup)
    try:
        for hook, (program, attach_type) in sorted(hooks.items()):
            _attach_one(hook, program, programs.fd(program), attach_type, cgroup, cgroup_fd,
                        cgroup_id, pin_dir, held)  # fmt: skip
    except BaseException:
        detach_socket_hooks(pin_dir)
        release_links(held)
        raise
    finally:
        os.close(cgroup_fd)
        if not keep:
            release_links(held)
    return sorted(hooks)


def release_links(held: dict[str, int]) -> None:
    """Close the link fds of `held` (their pins, if any, keep the links)."""
    for fd in held.values():
        os.close(fd)
    held.clear()


def _remove_link(pin: Path) -> None:
    """Detach the pinned link from its hook, then unpin it."""
    try:
        link_fd = libbpf.obj_get(str(pin))
    except OSError:
        link_fd = -1  # not a link we can open: just remove the name
    if link_fd >= 0:
        try:
            with contextlib.suppress(OSError):  # defunct already (its cgroup is gone)
                libbpf.link_detach(link_fd)
        finally:
            os.close(link_fd)
    with contextlib.suppress(FileNotFoundError):
        pin.unlink()


def detach_socket_hooks(pin_dir: Path) -> list[str]:
    """Detach and unpin every socket hook link of ours under `pin_dir` (found by their
    pins, whatever cgroup they are on). Returns the hooks removed."""
    removed = _pinned_hooks(pin_dir)
    for hook in removed:
        _remove_link(link_pin(pin_dir, hook))
    return removed


def attached_programs(cgroup: Path, hook: str) -> list[str]:
    """Names of the programs attached to `cgroup` at `hook` directly (not inherited),
    whoever attached them: for tests and `inspect`."""
    attach_type = {name: kind for kind, name in HOOK_NAMES.items()}[hook]
    cgroup_fd, _ = _open_cgroup(cgroup)
    try:
        ids = libbpf.prog_query(cgroup_fd, attach_type)
    finally:
        os.close(cgroup_fd)
    return [libbpf.prog_name(prog_id) for prog_id in ids]


def kbp_cgroup_links(cgroup_id: int) -> list[tuple[int, int, str]]:
    """(link id, program id, program name) of every cgroup bpf_link on the cgroup
    `cgroup_id` that runs a kbp_ program, whoever made and pinned it."""
    found = []
    for link_id in libbpf.link_ids():
        try:
            fd = libbpf.link_fd_by_id(link_id)
        except OSError:
            continue  # released meanwhile
        try:
            info = libbpf.link_info(fd)
        finally:
            os.close(fd)
        if info.type != libbpf.BPF_LINK_TYPE_CGROUP or info.cgroup_id != cgroup_id:
            continue
        try:
            name = libbpf.prog_name(info.prog_id)
        except OSError:
            continue
        if name.startswith("kbp_"):
            found.append((link_id, info.prog_id, name))
    return found


def detach_foreign_cgroup_links(cgroup_id: int, ours: set[int]) -> list[str]:
    """Detach the links on the cgroup `cgroup_id` that run a kbp_ program whose id is not
    among `ours` (another agent's: an earlier --bpffs, whose pins this agent never
    opens); other projects' programs are never touched. Returns what went, as
    name(link id)."""
    detached = []
    for link_id, prog_id, name in kbp_cgroup_links(cgroup_id):
        if prog_id in ours:
            continue
        try:
            fd = libbpf.link_fd_by_id(link_id)
        except OSError:
            continue
        try:
            libbpf.link_detach(fd)
        except OSError as err:
            if err.errno != errno.ENOLINK:  # ENOLINK: defunct already
                raise
        finally:
            os.close(fd)
        detached.append(f"{name}(link {link_id})")
    return detached
