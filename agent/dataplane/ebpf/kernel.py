"""Compile and load the datapath with bcc: the only module that imports bcc.

bcc compiles the entry files of bpf/ as one text (one set of map definitions) and
creates or re-opens the pinned maps under the pin directory; the programs' fds are then
attached by netlink.py (tc, XDP) and cgroup.py (socket hooks). Everything after loading
(map reads and writes, test runs) goes through libbpf.py with plain fds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .abi import BPF_DIR, MAP_NAMES, versioned
from .libbpf import Map

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


class LoadError(Exception):
    """The programs did not compile or load (bcc's message, verifier log included)."""


def cflags_for(pin_dir: Path, sizes: Mapping[str, int] | None = None) -> list[str]:
    flags = [
        f"-I{BPF_DIR}",
        f"-I{BPF_DIR / 'include'}",
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

    def fd(self, program: str) -> int:
        if program not in self._fds:
            from bcc import BPF

            spec = PROGRAMS[program]
            function = self._bpf.load_func(
                program.encode(), getattr(BPF, spec.prog_type), attach_type=spec.attach_type
            )
            self._fds[program] = function.fd
        return self._fds[program]

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
    for name in ENTRY_FILES:
        path = BPF_DIR / name
        parts.append(f'#line 1 "{path}"\n{path.read_text(encoding="utf-8")}\n')
    return "".join(parts)


def load_programs(
    pin_dir: Path, sizes: Mapping[str, int] | None = None, cflags: Sequence[str] = ()
) -> LoadedPrograms:
    """Compile the datapath; create (or re-open) the pinned maps; load every program."""
    try:
        from bcc import BPF
    except ImportError as err:
        raise LoadError(f"bcc is not importable ({err}); install python3-bpfcc") from err
    os.makedirs(pin_dir, exist_ok=True)
    text = entry_text()
    started = time.perf_counter()
    try:
        bpf = BPF(text=text.encode(), cflags=[*cflags_for(pin_dir, sizes), *cflags])
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
