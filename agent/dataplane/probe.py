"""Kernel probes for the eBPF dataplane, run before `--dataplane auto|ebpf` commits to it:
each says, under a short stable name, whether one thing eBPF needs works here and why not.

In order: `bpf-syscall` (the bpf(2) syscall loads a two-instruction tc program),
`clsact` (a clsact qdisc with a bpf filter on `lo` of a throw-away network namespace),
`bpffs` (the pin directory is on a BPF filesystem, mounted at its parent if it was not),
`pins` (no pin at one of our map paths holds someone else's map: those are never opened,
replaced or removed), `bcc-compile` (bcc compiles and loads our programs: building the
eBPF dataplane itself).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .base import DataplaneError
from .mounts import BpffsError, ensure_bpffs

log = logging.getLogger(__name__)

_T = TypeVar("_T")

BPF_SYSCALL = "bpf-syscall"
CLSACT = "clsact"
BPFFS = "bpffs"
PINS = "pins"
BCC_COMPILE = "bcc-compile"
PROBE_NAMES = (BPF_SYSCALL, CLSACT, BPFFS, PINS, BCC_COMPILE)

# A failure's reason goes into a metric label and /state: one line, bounded.
MAX_REASON_CHARS = 200

# enum bpf_prog_type: BPF_PROG_TYPE_SCHED_CLS, the type of our tc programs.
_PROG_TYPE_SCHED_CLS = 3
# `r0 = 0; exit` as struct bpf_insn (code, regs, off, imm; little-endian):
# BPF_ALU64|BPF_MOV|BPF_K into r0, then BPF_JMP|BPF_EXIT.
_TRIVIAL_PROGRAM = bytes.fromhex("b7 00 0000 00000000  95 00 0000 00000000")
_PROBE_PROGRAM_NAME = "kbp_probe"  # tc filter names must carry our kbp_ prefix
_CLONE_NEWNET = 0x4000_0000
_NAMESPACE_TIMEOUT_S = 10.0

# libbpf 1.x's program loader; libbpf.py declares only what the running dataplane needs.
_PROG_LOAD_CDEF = (
    "int bpf_prog_load(int prog_type, const char *prog_name, const char *license, "
    "const void *insns, size_t insn_cnt, const void *opts);"
)

# What an errno usually means when the bpf syscall or a tc request refuses.
_HINTS = {
    errno.EPERM: "no CAP_BPF?",
    errno.EACCES: "no CAP_BPF, or unprivileged BPF disabled?",
    errno.ENOSYS: "kernel built without CONFIG_BPF_SYSCALL?",
    errno.EINVAL: "kernel too old for this program type?",
    errno.ENOENT: "a kernel module missing?",
    errno.EOPNOTSUPP: "not supported by this kernel?",
}


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """One probe's outcome: `failure` is None when it passed, else one line saying why;
    `detail` keeps the whole message (compiler output, verifier log) for the log."""

    name: str
    failure: str | None = None
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.failure is None

    def __str__(self) -> str:
        return f"{self.name}: {self.failure}" if self.failure is not None else f"{self.name}: ok"


def failed(name: str, why: str) -> ProbeResult:
    """A failed probe; `why` is shortened to its first line for labels and /state."""
    lines = why.strip().splitlines()
    first = lines[0].strip() if lines else "failed"
    if len(first) > MAX_REASON_CHARS:
        first = first[: MAX_REASON_CHARS - 3] + "..."
    return ProbeResult(name, first, why)


def describe_os_error(err: OSError) -> str:
    """`EPERM: Operation not permitted (no CAP_BPF?)` or, without an errno, the message."""
    code = err.errno
    if code is None:
        return str(err)
    hint = _HINTS.get(code)
    text = f"{errno.errorcode.get(code, str(code))}: {os.strerror(code)}"
    return f"{text} ({hint})" if hint else text


# --- the bpf syscall ---------------------------------------------------------------------


@functools.cache
def _libbpf() -> Any:
    """Our cffi layer for libbpf.so.1, with bpf_prog_load declared on its ffi (once)."""
    import cffi

    from .ebpf import libbpf

    with contextlib.suppress(cffi.FFIError):  # already declared: this module was reloaded
        libbpf.ffi.cdef(_PROG_LOAD_CDEF)
    return libbpf


def load_trivial_program() -> int:
    """Load `r0 = 0; exit` as a tc program; the caller closes the fd. OSError on refusal."""
    libbpf = _libbpf()
    lib = libbpf.lib()
    rc = lib.bpf_prog_load(
        _PROG_TYPE_SCHED_CLS,
        _PROBE_PROGRAM_NAME.encode(),
        b"GPL",
        _TRIVIAL_PROGRAM,
        len(_TRIVIAL_PROGRAM) // 8,
        libbpf.ffi.NULL,
    )
    if rc < 0:  # libbpf 1.x returns -errno and sets errno; -1 could be either convention
        code = libbpf.ffi.errno if rc == -1 and libbpf.ffi.errno else -rc
        raise OSError(code, f"loading a trivial tc program: {os.strerror(code)}")
    return int(rc)


def probe_bpf_syscall() -> ProbeResult:
    """The bpf syscall works and the kernel accepts a trivial tc program."""
    try:
        fd = load_trivial_program()
    except ImportError as err:
        return failed(BPF_SYSCALL, f"cffi is not importable ({err})")
    except OSError as err:  # also a missing libbpf.so.1 (cffi's dlopen)
        return failed(BPF_SYSCALL, describe_os_error(err))
    except Exception as err:
        return failed(BPF_SYSCALL, f"{type(err).__name__}: {err}")
    os.close(fd)
    return ProbeResult(BPF_SYSCALL)


# --- clsact ------------------------------------------------------------------------------


class NamespaceUnavailable(Exception):
    """No throw-away network namespace could be made; the message says why."""


def _current_netns_inode() -> int:
    return os.stat(f"/proc/self/task/{threading.get_native_id()}/ns/net").st_ino


@contextlib.contextmanager
def throwaway_netns() -> Iterator[str]:
    """A fresh, empty network namespace for the duration of the block, as a path.

    A helper thread unshares its own network namespace (only that thread moves) and
    waits; the path names that thread's namespace. When the block ends the thread exits
    and the kernel deletes the namespace with everything in it, even if this process
    dies meanwhile: nothing to name, nothing left under /run/netns.
    """
    ready, done = threading.Event(), threading.Event()
    box: dict[str, Any] = {}

    def hold() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.unshare(_CLONE_NEWNET) != 0:
                code = ctypes.get_errno()
                hint = " (no CAP_SYS_ADMIN?)" if code == errno.EPERM else ""
                name = errno.errorcode.get(code, str(code))
                raise NamespaceUnavailable(
                    f"cannot create a throw-away network namespace: {name}: "
                    f"{os.strerror(code)}{hint}"
                )
            box["path"] = f"/proc/{os.getpid()}/task/{threading.get_native_id()}/ns/net"
            box["inode"] = _current_netns_inode()
        except BaseException as err:
            box["error"] = err
            return
        finally:
            ready.set()
        done.wait()

    thread = threading.Thread(target=hold, name="kbp-probe-netns", daemon=True)
    thread.start()
    try:
        if not ready.wait(_NAMESPACE_TIMEOUT_S):
            raise NamespaceUnavailable("the throw-away namespace thread did not start")
        if "error" in box:
            raise box["error"]
        # Never touch the machine's own interfaces: the namespace must really be new.
        if box["inode"] == _current_netns_inode():
            raise NamespaceUnavailable(
                "unshare left the probe in this process's namespace; refusing to touch it"
            )
        yield box["path"]
    finally:
        done.set()
        thread.join(_NAMESPACE_TIMEOUT_S)


def probe_clsact() -> ProbeResult:
    """A clsact qdisc can be added and a tc bpf filter attached to it (and removed),
    on `lo` of a throw-away namespace: the host's interfaces are never touched."""
    try:
        from .ebpf.netlink import TcAttacher
    except ImportError as err:
        return failed(CLSACT, f"pyroute2 is not importable ({err})")
    try:
        fd = load_trivial_program()
    except Exception as err:
        why = describe_os_error(err) if isinstance(err, OSError) else str(err)
        return failed(CLSACT, f"no program to attach: {why}")
    try:
        with throwaway_netns() as path, TcAttacher(path) as attacher:
            (lo,) = [link for link in attacher.links() if link.name == "lo"]
            attacher.attach(lo.index, "ingress", fd, _PROBE_PROGRAM_NAME)
            attacher.detach(lo.index)
    except DataplaneError as err:  # NetlinkError: names the interface and errno
        code = getattr(err, "code", None)
        hint = f" ({_HINTS[code]})" if code in _HINTS else ""
        return failed(CLSACT, f"{err}{hint}")
    except NamespaceUnavailable as err:
        return failed(CLSACT, str(err))
    except OSError as err:
        return failed(CLSACT, describe_os_error(err))
    except Exception as err:
        return failed(CLSACT, f"{type(err).__name__}: {err}")
    finally:
        os.close(fd)
    return ProbeResult(CLSACT)


# --- bpffs -------------------------------------------------------------------------------


def probe_bpffs(pin_dir: Path) -> ProbeResult:
    """The pins will be on a bpffs: when `pin_dir`'s parent is on none (no systemd to
    mount it, or `ip netns exec`, which remounts /sys), one is mounted there. Pins in a
    bpffs this process mounted outlive it only if the mount is shared with the host."""
    try:
        done = ensure_bpffs(pin_dir)
    except BpffsError as err:
        return failed(BPFFS, str(err))
    if done:
        log.warning("probe bpffs: %s; pins outlive this agent only if that mount is the "
                    "node's (shared mount propagation)", done)  # fmt: skip
    return ProbeResult(BPFFS)


# --- pins ----------------------------------------------------------------------------------


def probe_pins(pin_dir: Path) -> ProbeResult:
    """Every pin at one of our map paths is one of our maps (any size: a changed size is
    moved at load). A pin of someone else's there would make bcc use that map: it is
    named, one clause each, and left in place."""
    try:
        from .ebpf.pins import foreign_pins
    except ImportError:  # cffi or libbpf missing: bcc-compile says what
        return ProbeResult(PINS)
    try:
        found = foreign_pins(pin_dir)
    except OSError as err:
        return failed(PINS, f"cannot inspect the pins under {pin_dir}: {describe_os_error(err)}")
    return failed(PINS, "; ".join(found)) if found else ProbeResult(PINS)


# --- bcc compile -------------------------------------------------------------------------


def probe_bcc_compile(build: Callable[[], _T]) -> tuple[ProbeResult, _T | None]:
    """bcc compiles and loads our programs: `build` makes the eBPF dataplane itself (its
    constructor compiles), so passing this probe leaves the dataplane ready to use."""
    try:
        dataplane = build()
    except DataplaneError as err:
        return failed(BCC_COMPILE, f"{err.reason}: {err}"), None
    except OSError as err:  # a path of ours: say which and what the kernel answered
        where = f"{err.filename}: " if err.filename else ""
        return failed(BCC_COMPILE, f"{where}{describe_os_error(err)}"), None
    except Exception as err:
        return failed(BCC_COMPILE, f"{type(err).__name__}: {err}"), None
    return ProbeResult(BCC_COMPILE), dataplane


# --- all of them ---------------------------------------------------------------------------


def probe_ebpf(
    build: Callable[[], _T], pin_dir: Path | None = None
) -> tuple[_T | None, tuple[ProbeResult, ...]]:
    """Run the probes in order, stopping at the first failure. Returns the dataplane
    `build` made (None when a probe failed) and the results so far: the last one is the
    failure, if any. `pin_dir`: where the maps will be pinned (the bpffs probe)."""
    results: list[ProbeResult] = []
    # Looked up at call time, so tests can replace a probe.
    probes: list[Callable[[], ProbeResult]] = [probe_bpf_syscall, probe_clsact]
    if pin_dir is not None:
        probes.append(lambda: probe_bpffs(pin_dir))
        probes.append(lambda: probe_pins(pin_dir))
    for probe in probes:
        started = time.perf_counter()
        result = probe()
        _log(result, started)
        results.append(result)
        if not result.passed:
            return None, tuple(results)
    started = time.perf_counter()
    result, dataplane = probe_bcc_compile(build)
    _log(result, started)
    results.append(result)
    return dataplane, tuple(results)


def _log(result: ProbeResult, started: float) -> None:
    took = (time.perf_counter() - started) * 1000
    if result.passed:
        log.debug("probe %s passed (%.0f ms)", result.name, took)
    else:
        log.info("probe %s failed (%.0f ms): %s", result.name, took, result.detail)
