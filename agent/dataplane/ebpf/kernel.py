"""Compile and load the datapath with bcc: the only module that imports bcc.

bcc compiles the entry files of bpf/ as one text (one set of map definitions) and
creates or re-opens the pinned maps under the pin directory; the programs' fds are then
attached by netlink.py (tc, XDP) and cgroup.py (socket hooks). Everything after loading
(map reads and writes, test runs) goes through libbpf.py with plain fds.

Some compile errors end the process instead of raising: LLVM reports a program over the
BPF stack's 512 bytes as a fatal error and exits (status 1, no traceback), which would
take the whole agent down before `--dataplane auto` could fall back to iptables. So the
text is compiled once in a child process first (`trial_compile`), and only a text that
compiled there is compiled here; a text that compiled once is remembered by its digest
(in this process, and as a file under `KBP_COMPILE_CACHE_DIR`) so the trial is not
repeated at every start.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .abi import BPF_DIR, MAP_NAMES, MAPS, versioned
from .libbpf import Map, prog_id
from .libbpf import obj_get as libbpf_obj_get
from .pins import ForeignPinError, Moves, shape_of_pin

log = logging.getLogger(__name__)

# Entry files compiled together, in this order (maps.c first: see lib/maps.h).
ENTRY_FILES = ("maps.c", "tc_from_pod.c", "tc_to_pod.c", "tc_ext.c", "xdp_ext.c", "sock_lb.c")


@dataclass(frozen=True)
class ProgramSpec:
    """How a program of the text is loaded: bcc's program type, and for cgroup socket
    hooks the expected attach type (enum bpf_attach_type) the kernel checks at load."""

    prog_type: str  # the bcc.BPF attribute: SCHED_CLS, XDP, CGROUP_SOCK_ADDR
    attach_type: int = -1


# Every program the entry files define.
PROGRAMS: dict[str, ProgramSpec] = {
    "kbp_from_pod": ProgramSpec("SCHED_CLS"),
    "kbp_to_pod": ProgramSpec("SCHED_CLS"),
    "kbp_from_ext": ProgramSpec("SCHED_CLS"),
    "kbp_to_ext": ProgramSpec("SCHED_CLS"),
    "kbp_xdp_ext": ProgramSpec("XDP"),
    # cgroup socket hooks (sock_lb.c); attach types are enum bpf_attach_type values.
    "kbp_connect4": ProgramSpec("CGROUP_SOCK_ADDR", attach_type=10),  # INET4_CONNECT
    "kbp_connect6": ProgramSpec("CGROUP_SOCK_ADDR", attach_type=11),  # INET6_CONNECT
    "kbp_sendmsg4": ProgramSpec("CGROUP_SOCK_ADDR", attach_type=14),  # UDP4_SENDMSG
    "kbp_sendmsg6": ProgramSpec("CGROUP_SOCK_ADDR", attach_type=15),  # UDP6_SENDMSG
    "kbp_recvmsg4": ProgramSpec("CGROUP_SOCK_ADDR", attach_type=19),  # UDP4_RECVMSG
    "kbp_recvmsg6": ProgramSpec("CGROUP_SOCK_ADDR", attach_type=20),  # UDP6_RECVMSG
    "kbp_peername4": ProgramSpec("CGROUP_SOCK_ADDR", attach_type=29),  # INET4_GETPEERNAME
    "kbp_peername6": ProgramSpec("CGROUP_SOCK_ADDR", attach_type=30),  # INET6_GETPEERNAME
    "kbp_release": ProgramSpec("CGROUP_SOCK", attach_type=34),  # INET_SOCK_RELEASE
}


# Tests (and developers) may compile the programs from another copy of bpf/; the agent
# otherwise always uses the bpf/ beside its package.
SOURCE_DIR_ENV = "KBP_BPF_SOURCE_DIR"
CACHE_DIR_ENV = "KBP_COMPILE_CACHE_DIR"  # "" turns the file cache off
DEFAULT_CACHE_DIR = "/run/kube-bpf-proxy/compiled"
TRIAL_TIMEOUT = 600.0  # seconds: bcc takes tens of seconds on a loaded 2-core machine


class LoadError(Exception):
    """The programs did not compile or load (bcc's message, verifier log included)."""


def source_dir() -> Path:
    """The bpf/ directory compiled: the one beside the agent unless KBP_BPF_SOURCE_DIR."""
    return Path(os.environ.get(SOURCE_DIR_ENV) or BPF_DIR)


def cflags_for(pin_dir: Path, sizes: Mapping[str, int] | None = None) -> list[str]:
    bpf_dir = source_dir()
    flags = [
        f"-I{bpf_dir}",
        f"-I{bpf_dir / 'include'}",
        f'-DKBP_PIN_DIR="{pin_dir}"',
    ]
    for name, value in (sizes or {}).items():  # by MapSizes field: KBP_MAX_<FIELD>
        flags.append(f"-DKBP_MAX_{name.upper()}={int(value)}")
    return flags


class LoadedPrograms:
    """The compiled module: program fds by name, the pinned maps by short name."""

    def __init__(self, bpf: Any, pin_dir: Path, compile_seconds: float) -> None:
        self._bpf = bpf
        self.pin_dir = pin_dir
        self.compile_seconds = compile_seconds
        self._fds: dict[str, int] = {}
        self.maps: dict[str, Map] = {}
        # Maps moved to a new size whose old maps an earlier agent's programs still use.
        self.moves: Moves | None = None

    def fd(self, program: str) -> int:
        if program not in self._fds:
            from bcc import BPF

            spec = PROGRAMS[program]
            function = self._bpf.load_func(
                program.encode(), getattr(BPF, spec.prog_type), attach_type=spec.attach_type
            )
            self._fds[program] = function.fd
        return self._fds[program]

    def prog_id(self, program: str) -> int:
        """The kernel's id of a loaded program (what tc, XDP and cgroup queries report)."""
        return prog_id(self.fd(program))

    def map_fd(self, name: str) -> int:
        return self.map(name).fd

    def map(self, name: str) -> Map:
        """A map by short name (`kbp_services`); the fd belongs to the bcc module. Asked
        for its fd directly: bcc 0.26's Python side has no table class for socket storage
        (kbp_sock_peer), which only the programs use."""
        if name not in self.maps:
            from bcc.libbcc import lib as bcc_lib

            fd = bcc_lib.bpf_table_fd(self._bpf.module, name.encode())
            if fd < 0:
                raise KeyError(f"no map {name} in the compiled module")
            self.maps[name] = Map(fd, versioned(name))
        return self.maps[name]

    def finish_moves(self) -> None:
        """After this agent's programs replaced an earlier agent's: complete the moves of
        maps to a new size (pins.Moves.finish). Once; a failure is logged, not raised
        (the maps are this agent's either way; what is left is an aside pin)."""
        moves, self.moves = self.moves, None
        if moves is None:
            return
        try:
            moves.finish(self.map)
        except OSError as err:
            log.error("ebpf: completing the move of the maps to their new size: %s", err)

    def close(self) -> None:
        """Release the module; attached programs stay attached, pinned maps stay."""
        if self._bpf is not None:
            with contextlib.suppress(Exception):
                self._bpf.cleanup()
            self._bpf = None


def entry_text() -> str:
    """The entry files as one text. bcc only turns functions of the main file into
    programs (not those of included files), so the files are concatenated; `#line` keeps
    compiler messages pointing at the real file and line."""
    parts = []
    bpf_dir = source_dir()
    for name in ENTRY_FILES:
        path = bpf_dir / name
        parts.append(f'#line 1 "{path}"\n{path.read_text(encoding="utf-8")}\n')
    return "".join(parts)


# What the child runs: bcc compiles the text (stdin) with the flags (argv) and loads the
# maps; a Python exception exits with status 3 and its message; LLVM's fatal errors exit
# with their own status and write "error: ..." lines to stderr.
# The child dies with the thread that started it (PR_SET_PDEATHSIG): a trial that outlived
# a killed agent would go on opening and pinning maps in its pin directory behind the next
# agent's back (seen: a test that renames the pins after a SIGKILL found new ones).
_TRIAL = """import ctypes, os, sys
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != int(sys.argv.pop(1)):
    sys.exit(4)  # the parent is gone already
try:
    from bcc import BPF
    BPF(text=sys.stdin.buffer.read(), cflags=sys.argv[1:])
except Exception as err:
    print(f"{type(err).__name__}: {err}", file=sys.stderr)
    sys.exit(3)
"""
_compiled: set[str] = set()  # digests of texts that compiled in this process


def _digest(text: str, cflags: Sequence[str]) -> str:
    """What decides whether a compile succeeds: the text, the flags but the pin directory
    (a string the code never branches on), bcc's version, the kernel's and where bcc
    is told to find its headers."""
    import bcc

    kept = [flag for flag in cflags if not flag.startswith("-DKBP_PIN_DIR=")]
    where = [
        os.environ.get(name, "") for name in ("BCC_KERNEL_SOURCE", "BCC_KERNEL_MODULES_SUFFIX")
    ]
    key = "\0".join([text, *kept, getattr(bcc, "__version__", "?"), os.uname().release, *where])
    return hashlib.sha256(key.encode()).hexdigest()


def _cache_file(digest: str) -> Path | None:
    directory = os.environ.get(CACHE_DIR_ENV, DEFAULT_CACHE_DIR)
    return Path(directory) / digest if directory else None


@dataclass(frozen=True)
class Trial:
    """A trial compile that ran: how long it took, and whether the file cache now
    remembers it (`not_remembered`: why not, None when it does)."""

    seconds: float
    not_remembered: str | None = None


def trial_compile(text: str, cflags: Sequence[str]) -> Trial | None:
    """Compile `text` in a child process unless it compiled before; what the trial took
    and whether it was remembered (None when skipped). LoadError naming the compiler's
    complaint when it fails, however the child ended."""
    digest = _digest(text, cflags)
    cache = _cache_file(digest)
    if digest in _compiled or (cache is not None and cache.exists()):
        return None
    started = time.perf_counter()
    try:
        child = subprocess.run(
            [sys.executable, "-c", _TRIAL, str(os.getpid()), *cflags], input=text.encode(),
            capture_output=True, timeout=TRIAL_TIMEOUT, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LoadError(f"a trial compile in a child process failed to run: {err}") from err
    took = time.perf_counter() - started
    if child.returncode != 0:
        raise LoadError(f"bcc cannot compile the datapath: {_complaint(child)}")
    _compiled.add(digest)
    if cache is None:
        return Trial(took, f"{CACHE_DIR_ENV} is empty (no file cache)")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(f"compiled in a trial of {took:.1f} s\n")
    except OSError as err:  # a read-only /run: the trial runs at every start
        return Trial(took, f"cannot write {cache}: {err.strerror or err}")
    return Trial(took)


def _complaint(child: subprocess.CompletedProcess[bytes], what: str = "trial compile") -> str:
    """The child's errors on one line, and how it ended."""
    lines = [line.strip() for line in child.stderr.decode(errors="replace").splitlines()]
    errors = [line for line in lines if "error" in line.lower()][:3]
    last = next((line for line in reversed(lines) if line), "")
    if last and last not in errors:  # a Python exception's message (status 3)
        errors.append(last)
    text = "; ".join(_short(line) for line in errors)
    status = child.returncode
    how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
    return f"{text or 'no message'} ({what} in a child process: {how})"


_LOCATION = re.compile(r"^(?:error: )?(?P<path>/[^:]*):(?P<at>\d+:\d+): ")
_SIGNATURE = re.compile(r"(in function \S+) [^:]*\): ")  # LLVM's IR type of the function


def _short(line: str) -> str:
    """A compiler line without what makes it long: the directories of the file, and the
    IR signature LLVM adds to a function's name."""
    line = _LOCATION.sub(lambda m: f"{Path(m['path']).name}:{m['at']}: ", line)
    return _SIGNATURE.sub(r"\1: ", line)


def load_programs(
    pin_dir: Path, sizes: Mapping[str, int] | None = None, cflags: Sequence[str] = ()
) -> LoadedPrograms:
    """Compile the datapath; create (or re-open) the pinned maps; load every program."""
    try:
        import bcc  # noqa: F401  (here only to say what is missing before anything is done)
    except ImportError as err:
        raise LoadError(f"bcc is not importable ({err}); install python3-bpfcc") from err
    os.makedirs(pin_dir, exist_ok=True)
    text = entry_text()
    flags = [*cflags_for(pin_dir, sizes), *cflags]
    # Before bcc opens (or the trial creates) anything: someone else's map at one of our
    # pins is refused here, naming it; ours at another size is set aside to be moved.
    try:
        moves = Moves.prepare(pin_dir, sizes)
    except ForeignPinError as err:
        raise LoadError(str(err)) from err
    except OSError as err:
        raise LoadError(f"inspecting the pins under {pin_dir}: {err}") from err
    try:
        loaded = _compile_and_load(text, flags, pin_dir)
    except BaseException:
        moves.undo()
        raise
    if moves.moves:
        try:
            moves.copy(loaded.map, loaded.map("kbp_meta"))
        except OSError as err:
            loaded.close()
            moves.undo()
            raise LoadError(f"moving the pinned maps to their new size: {err}") from err
        loaded.moves = moves
    return loaded


def _compile_and_load(text: str, flags: list[str], pin_dir: Path) -> LoadedPrograms:
    from bcc import BPF

    trial = trial_compile(text, flags)  # LoadError rather than this process ending
    if trial is not None and trial.not_remembered is None:
        log.info("datapath compiled in a child process first (%.1f s); remembered", trial.seconds)
    elif trial is not None:
        log.info("datapath compiled in a child process first (%.1f s); not remembered (%s): "
                 "the next start compiles in a child again", trial.seconds,
                 trial.not_remembered)  # fmt: skip
    started = time.perf_counter()
    try:
        bpf = BPF(text=text.encode(), cflags=flags)
    except Exception as err:  # bcc raises bare Exception on compile/load failures
        raise LoadError(f"compiling {', '.join(ENTRY_FILES)}: {err}") from err
    loaded = LoadedPrograms(bpf, pin_dir, time.perf_counter() - started)
    try:
        for program in PROGRAMS:
            loaded.fd(program)
        for name in MAP_NAMES:
            loaded.map(name)
    except Exception as err:
        loaded.close()
        raise LoadError(f"loading the datapath: {err}") from err
    log.debug("datapath compiled and loaded in %.2fs", loaded.compile_seconds)
    return loaded


# explain's build (bpf/maps.c __explain_dry): these programs compiled once more with
# KBP_EXPLAIN, never attached, pinned beside the maps; `explain` (any process) and the
# keeper's self-test run them with BPF_PROG_TEST_RUN on the live maps.
EXPLAIN_PROGRAMS = ("kbp_from_pod", "kbp_from_ext")
EXPLAIN_FLAG = "-DKBP_EXPLAIN"


def explain_pin(pin_dir: Path, program: str) -> Path:
    """Where explain's build of `program` is pinned: kbp_from_pod_explain_v<ABI>."""
    return pin_dir / versioned(f"{program}_explain")


# What explain's build runs in: a child process that compiles the text (stdin) with the
# flags, loads EXPLAIN_PROGRAMS and pins each (replaced whole: a reader sees the old
# program or the new), then exits. Nothing of it is held by the agent, so the agent can
# stop it at any moment (kill) instead of waiting for a compile of seconds, and an LLVM
# error ends the child, not the agent. Dies with the thread that started it, as _TRIAL.
_EXPLAIN_CHILD = """import ctypes, json, os, sys
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != int(sys.argv.pop(1)):
    sys.exit(4)  # the parent is gone already
programs = json.loads(sys.argv.pop(1))
try:
    from bcc import BPF
    from bcc.libbcc import lib
    bpf = BPF(text=sys.stdin.buffer.read(), cflags=sys.argv[1:])
    for program, pin in programs:
        fd = bpf.load_func(program.encode(), BPF.SCHED_CLS).fd
        fresh = pin + "-new"
        if os.path.lexists(fresh):
            os.unlink(fresh)
        rc = lib.bpf_obj_pin(fd, fresh.encode())
        if rc < 0:
            raise OSError(-rc, f"pinning {program} at {fresh}: {os.strerror(-rc)}")
        os.replace(fresh, pin)
except Exception as err:
    print(f"{type(err).__name__}: {err}", file=sys.stderr)
    sys.exit(3)
"""


def pin_explain_build(
    pin_dir: Path,
    sizes: Mapping[str, int] | None = None,
    cflags: Sequence[str] = (),
    started: Callable[[subprocess.Popen[bytes]], None] | None = None,
) -> list[Path]:
    """Compile explain's build with the flags (map sizes) of the loaded programs, so it
    opens the same pinned maps, and pin its EXPLAIN_PROGRAMS, in a child process
    (_EXPLAIN_CHILD); `started` is told the child as soon as it runs (to stop it).
    Returns the pins; LoadError naming the compiler's complaint, however the child
    ended."""
    flags = [*cflags_for(pin_dir, sizes), *cflags, EXPLAIN_FLAG]
    programs = [(program, str(explain_pin(pin_dir, program))) for program in EXPLAIN_PROGRAMS]
    argv = [sys.executable, "-c", _EXPLAIN_CHILD, str(os.getpid()), json.dumps(programs)]
    try:
        child = subprocess.Popen(
            [*argv, *flags], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
    except OSError as err:
        raise LoadError(f"explain's build: the child process failed to run: {err}") from err
    if started is not None:
        started(child)
    try:
        _, errors = child.communicate(entry_text().encode(), timeout=TRIAL_TIMEOUT)
    except subprocess.TimeoutExpired as err:
        child.kill()
        child.wait()
        raise LoadError(f"explain's build took more than {TRIAL_TIMEOUT:g} s") from err
    if child.returncode != 0:
        ended = subprocess.CompletedProcess(argv, child.returncode, b"", errors)
        raise LoadError(f"compiling explain's build: {_complaint(ended, 'explain build')}")
    return [Path(pin) for _, pin in programs]


def sizes_of_pins(pin_dir: Path) -> dict[str, int]:
    """The sizes (by KBP_MAX_<NAME>, as cflags_for takes them) the pinned maps were made
    with: a build that opens them must be compiled with these."""
    sizes: dict[str, int] = {}
    for decl in MAPS.values():
        name = decl.size.removeprefix("KBP_MAX_").lower()
        if name == decl.size.lower() or name in sizes:
            continue
        with contextlib.suppress(OSError):
            shape = shape_of_pin(pin_dir / versioned(decl.name))
            if shape is not None:
                sizes[name] = shape.max_entries
    return sizes


def explain_build_fd(pin_dir: Path, program: str) -> int:
    """An fd of explain's build of `program`: the agent's pin, or, when there is none (no
    agent, or one that has not pinned it yet), a build compiled here for the pinned maps'
    sizes and pinned for the next explain."""
    pin = explain_pin(pin_dir, program)
    try:
        return libbpf_obj_get(str(pin))
    except FileNotFoundError:
        log.info("compiling explain's build of the programs for %s (no agent pinned one)",
                 pin_dir)  # fmt: skip
        pin_explain_build(pin_dir, sizes_of_pins(pin_dir))
        return libbpf_obj_get(str(pin))


class ExplainBuild:
    """explain's build, compiled and pinned by a child process that a thread waits for,
    once started (the agent starts it after its first apply: a second compile costs
    seconds of CPU that readiness need not wait for). `ready` is set when the pins are
    there; `error` says why they are not. stop() ends a compile under way at once."""

    def __init__(
        self, pin_dir: Path, sizes: Mapping[str, int] | None = None,
        on_ready: Callable[[], None] | None = None,
    ) -> None:  # fmt: skip
        self.pin_dir = pin_dir
        self.sizes = dict(sizes or {})
        self.on_ready = on_ready  # called in the thread once the pins are there
        self.ready = threading.Event()
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._stopped = False

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="kbp-explain-build",
                                                daemon=True)  # fmt: skip
                self._thread.start()

    def _started(self, child: subprocess.Popen[bytes]) -> None:
        with self._lock:
            self._child = child
            if self._stopped:
                child.kill()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            pin_explain_build(self.pin_dir, self.sizes, started=self._started)
        except (LoadError, OSError) as err:
            if self._stopped:
                return  # stop() ended it
            self.error = str(err)
            log.warning("ebpf: explain's build of the programs did not load, so `explain` "
                        "and the self-test cannot run: %s", err)  # fmt: skip
            return
        self.ready.set()
        log.info("ebpf: explain's build of the programs pinned in %.1f s",
                 time.perf_counter() - started)  # fmt: skip
        if self.on_ready is not None:
            self.on_ready()

    def stop(self) -> None:
        """End a compile under way (the child is killed: nothing of it outlives this
        call, so no pin of it outlives a cleanup) and wait for the thread."""
        with self._lock:
            self._stopped = True
            child = self._child
            if child is not None and child.poll() is None:
                child.kill()
        if self._thread is not None:
            self._thread.join()
        for program in EXPLAIN_PROGRAMS:  # a child killed between its pin and the rename
            pin = explain_pin(self.pin_dir, program)
            pin.with_name(pin.name + "-new").unlink(missing_ok=True)
