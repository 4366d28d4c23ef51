"""Network namespaces by name, for the dataplanes that open kernel sockets in one (the eBPF
dataplane's netlink, the nftables dataplane's libnftables context)."""

from __future__ import annotations

import ctypes
import os

_CLONE_NEWNET = 0x4000_0000
NETNS_RUN_DIR = "/run/netns"


def netns_path(netns: str) -> str:
    """A namespace name means /run/netns/NAME (as `ip netns`); a path is used as given."""
    return netns if "/" in netns else os.path.join(NETNS_RUN_DIR, netns)


def setns(fd: int) -> None:
    """Move the calling thread (only) into the network namespace `fd` refers to; OSError
    when the kernel refuses."""
    # Python 3.11 has no os.setns; libc's setns(2) changes only this thread's netns.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
