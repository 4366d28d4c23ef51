"""The keeper of the eBPF dataplane: checks, every few seconds and at every full resync,
that what the agent wrote is still in the kernel as it wrote it, and puts back what is
not, from the file descriptors the agent holds.

What an operator's mistake can take away while the agent runs, and what comes back:

* the map pins (`rm -r` of the pin directory, `cleanup`): re-pinned from our map fds.
  The maps themselves never went away (our programs and fds hold them), so conntrack,
  affinity and every Service entry are the ones they were;
* tc programs on pod and external interfaces (tcx links die with their pins; `cleanup`
  detaches clsact filters), XDP on external interfaces, the cgroup socket hooks (links
  that die with their pins): attached again;
* programs of ours that another agent loaded (an earlier `--bpffs`, whose pins we never
  open) on our interfaces or our cgroup: replaced by ours or detached, so stale maps
  never serve beside ours.

What it cannot put back stays in `problems()`: /readyz answers 503 while there are any,
and /healthz once they last longer than a minute (agent/api/server.py). A pin of ours
that now names another object is reported and left alone: it is not ours to remove.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..base import DataplaneError
from . import libbpf
from .abi import MAP_NAMES, versioned
from .attach import EXTERNAL_HOOKS, HOOKS, XDP_PROGRAM, Attacher
from .cgroup import (
    CgroupAttachError,
    kbp_cgroup_links,
    link_pin,
    socket_programs,
)
from .kernel import LoadedPrograms
from .netlink import Link, PodInterfaces, run_in_netns

log = logging.getLogger(__name__)

CHECK_PERIOD = 5.0  # seconds between checks: the longest a removal goes unnoticed
# A pin removed (`cleanup`, `rm -r`) wakes the keeper at once through inotify (bpffs
# reports unlinks like any file system); it waits this long for the remover to finish,
# so that one pass puts back the whole of what was taken.
SETTLE = 0.2
# Seconds between self-tests (one frontend each: successive ones walk through them all),
# and at the first check after each apply of a new revision.
SELF_TEST_PERIOD = 30.0
# What kbp_dataplane_repairs_total{what} counts.
REPAIRS = ("pin", "tc", "xdp", "socket_hooks", "foreign_program")


class Keeper:
    """One check-and-repair pass at a time (`check`), run by a thread every
    CHECK_PERIOD seconds once `start`ed; `lock` is the dataplane's, held by its applies
    too, so a repair never interleaves with an apply's attach and detach."""

    def __init__(
        self, programs: LoadedPrograms, links: Attacher, lock: threading.RLock,
        period: float = CHECK_PERIOD,
    ) -> None:  # fmt: skip
        self.programs = programs
        self.links = links
        self.pin_dir = programs.pin_dir
        self.period = period
        self._lock = lock
        # What ours are, by kernel id: asked at the first check (a keeper that never
        # checks, period 0, asks nothing of the programs).
        self._prog_ids: dict[str, int] = {}
        self._map_ids: dict[str, int] = {}
        # What the last pass could not put back, and since when (monotonic): replaced
        # whole, so that readers never wait for the lock.
        self._report: tuple[list[str], float | None] = ([], None)
        self._left: set[str] = set()  # pins of other objects already reported
        self._repaired: Callable[[str, str], None] = lambda what, detail: None
        # The self-test of the applied state (agent/explain/selftest.py), set by the
        # dataplane after each apply: test(turn) -> result or None; its last result.
        self._test: Callable[[int], Any] | None = None
        self._test_due = False
        self._tested_at = 0.0  # monotonic
        self._turn = 0
        self.self_test: Any = None  # the last SelfTest
        self._tested: Callable[[Any], None] = lambda result: None
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._pins = PinWatch(self.pin_dir)
        self._thread: threading.Thread | None = None
        self.checks = 0  # passes completed

    def report_to(
        self, repaired: Callable[[str, str], None], tested: Callable[[Any], None]
    ) -> None:  # fmt: skip
        """`repaired(what, detail)` for each repair, `tested(result)` for each
        self-test (the metrics)."""
        self._repaired, self._tested = repaired, tested

    def start(self) -> None:
        """Check every `period` seconds (and when a pin goes) in a thread."""
        if self._thread is None and self.period > 0:
            self._thread = threading.Thread(target=self._main, name="kbp-keeper", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread, after the pass in flight if there is one."""
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_w, b"x")
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        self._pins.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def test_with(self, test: Callable[[int], Any]) -> None:
        """After an apply: the self-test of the state now applied, due at the next check."""
        with self._lock:
            self._test, self._test_due = test, True

    def problems(self) -> tuple[list[str], float | None]:
        """What the last pass found and could not put back, and since when (monotonic).
        Never waits for an apply: the health endpoints ask it on their event loop."""
        problems, since = self._report
        return list(problems), since

    def _main(self) -> None:
        while not self._stop.is_set():
            self._wait()
            if self._stop.is_set():
                return
            try:
                self.check()
            except Exception:  # a bug here must not end the checks
                log.exception("ebpf: checking the datapath failed; trying again in %.0f s",
                              self.period)  # fmt: skip

    def _wait(self) -> None:
        """Until the period passed, or a pin went (then until removals settle)."""
        self._pins.watch()  # again after the directory itself was removed and made again
        watched = [self._wake_r] + ([self._pins.fd] if self._pins.fd >= 0 else [])
        ready, _, _ = select.select(watched, [], [], self.period)
        if self._pins.fd in ready:
            while self._pins.drain() and not self._stop.is_set():
                select.select([self._wake_r], [], [], SETTLE)  # until a quiet SETTLE

    def check(self) -> list[str]:
        """One pass: find what is missing, put it back; returns what could not be."""
        with self._lock:
            if self._stop.is_set() or not self.links.serving:
                return self.problems()[0]  # before the first apply the earlier state serves
            if not self._prog_ids:
                programs = self.programs
                self._prog_ids = {name: programs.prog_id(name) for name in _kept_programs()}
                self._map_ids = {n: libbpf.map_info(programs.map(n).fd).id for n in MAP_NAMES}
            problems: list[str] = []
            for part in (self._check_pins, self._check_tc, self._check_xdp,
                         self._check_socket_hooks):  # fmt: skip
                try:
                    problems += part()
                except (OSError, DataplaneError) as err:
                    problems.append(f"{part.__name__.removeprefix('_check_')}: {err}")
            since = self._report[1]
            if problems and since is None:
                since = time.monotonic()
                log.error("ebpf: the datapath does not serve its state and could not be "
                          "repaired: %s", "; ".join(problems))  # fmt: skip
            elif not problems and since is not None:
                log.info("ebpf: the datapath serves its state again")
                since = None
            self._report = (problems, since)
            self.checks += 1
            if not problems:
                self._run_self_test()
            return list(problems)

    def _run_self_test(self) -> None:
        """Ask the attached program about one frontend when due (see SELF_TEST_PERIOD)."""
        now = time.monotonic()
        if self._test is None or not (self._test_due or now - self._tested_at >= SELF_TEST_PERIOD):
            return
        if not self.links.attached:
            return  # no pod interface yet: no kbp_from_pod to ask
        self._test_due, self._tested_at = False, now
        test, turn = self._test, self._turn
        self._turn += 1
        netns = self.links.tc.netns
        result = test(turn) if netns is None else run_in_netns(netns, lambda: test(turn))
        if result is None:
            return
        previous, self.self_test = self.self_test, result
        if result.passed is not True and (previous is None or previous.passed is True or
                                          previous.detail != result.detail):  # fmt: skip
            log.error("ebpf: self-test of %s: %s", result.frontend, result.detail)
        elif result.passed and previous is not None and previous.passed is not True:
            log.info("ebpf: self-test of %s passed again: %s", result.frontend, result.detail)
        self._tested(result)

    def _repair(self, what: str, detail: str) -> None:
        log.warning("ebpf: repaired: %s", detail)
        self._repaired(what, detail)

    # --- pins --------------------------------------------------------------------------

    def _check_pins(self) -> list[str]:
        """Every map pin names the map our programs use; a missing one is pinned again
        from our fd (the directory made again first)."""
        problems = []
        missing = []
        for name, map_id in self._map_ids.items():
            path = self.pin_dir / versioned(name)
            held = _pinned_map_id(path)
            if held == map_id:
                continue
            if held is not None:
                if str(path) not in self._left:
                    self._left.add(str(path))
                    log.error("ebpf: pin %s holds another object (id %d; our map is id %d): "
                              "left alone; the datapath still uses ours", path, held,
                              map_id)  # fmt: skip
                continue
            try:
                self.pin_dir.mkdir(parents=True, exist_ok=True)
                libbpf.obj_pin(self.programs.map(name).fd, str(path))
            except OSError as err:
                problems.append(f"cannot pin {path} again: {err.strerror or err}")
                continue
            missing.append(path.name)
        if missing:
            self._repair("pin", f"pinned {len(missing)} map(s) again in {self.pin_dir} "
                         f"(entries kept): {' '.join(missing)}")  # fmt: skip
        return problems

    # --- tc and XDP ----------------------------------------------------------------------

    def _check_tc(self) -> list[str]:
        """Our tc programs on both sides of every pod interface and of every external
        interface we attached, and no other copy of ours (another agent's) there."""
        tc = self.links.tc
        found: dict[tuple[int, str], set[int]] = {}
        for attachment in tc.attached():
            found.setdefault((attachment.index, attachment.direction), set()).add(
                attachment.prog_id
            )
        pods = PodInterfaces(self.links.pod_interfaces)
        externals = self.links.external_attached()
        problems = []
        for link in tc.links():
            if pods.matches(link.name):
                hooks = HOOKS
            elif link.index in externals:
                hooks = EXTERNAL_HOOKS
            else:
                continue
            wrong: list[tuple[str, str]] = []  # (what kbp_dataplane_repairs counts, why)
            for direction, program in hooks:
                ids = found.get((link.index, direction), set())
                if self._prog_ids[program] not in ids:
                    wrong.append(("tc", f"{program} missing on {direction}"))
                elif len(ids) > 1:
                    wrong.append(("foreign_program", f"another agent's kbp_ program beside "
                                  f"{program} on {direction}"))  # fmt: skip
                elif not tc.pinned(link.index, direction):  # type: ignore[arg-type]
                    wrong.append(("pin", f"the pin of {program}'s link on {direction} removed"))
            if not wrong:
                continue
            why = ", ".join(text for _what, text in wrong)
            try:
                attached = self.links.attach_tc(link, hooks)
            except DataplaneError as err:
                problems.append(f"{link.name}: {why}; cannot attach: {err}")
                continue
            if attached:  # the worst of what was wrong: a detached program counts as tc
                kinds = {what for what, _text in wrong}
                what = next(k for k in ("tc", "foreign_program", "pin") if k in kinds)
                self._repair(what, f"tc on {link.name}: {why}: attached ours")
        return problems

    def _check_xdp(self) -> list[str]:
        tc = self.links.tc
        xdp = {attachment.index: attachment.prog_id for attachment in tc.xdp()}
        ours = self._prog_ids[XDP_PROGRAM]
        problems = []
        for index, name in self.links.external_attached().items():
            if self.links.xdp_modes.get(name) not in ("native", "generic"):
                continue  # off, or it could not be attached (tc serves alone, as reported)
            if xdp.get(index) == ours:
                continue
            mode = self.links.attach_xdp(Link(index, name))
            if mode in ("native", "generic"):
                self._repair("xdp", f"XDP on {name}: attached ours again ({mode})")
            elif mode != "vanished":
                problems.append(f"XDP on {name}: {mode}")
        return problems

    # --- socket hooks --------------------------------------------------------------------

    def _check_socket_hooks(self) -> list[str]:
        """Each hook's pinned link runs our program on our cgroup; no kbp_ program of
        another agent is attached to our cgroup."""
        cgroup = self.links.cgroup
        if cgroup is None or self.links.socket_hooks != "attached":
            return []
        cgroup_id = os.stat(cgroup).st_ino
        hooks = socket_programs()
        wrong = []
        for hook, (program, attach_type) in hooks.items():
            link = _pinned_link(link_pin(self.pin_dir, hook))
            if link is None or (link.cgroup_id, link.attach_type, link.prog_id) != (
                cgroup_id, attach_type, self._prog_ids[program],
            ):  # fmt: skip
                wrong.append(hook)
        problems = []
        if wrong:
            # Still attached (the agent holds each link's fd) when only the pin went.
            running = {prog_id for _link, prog_id, _name in kbp_cgroup_links(cgroup_id)}
            detached = [h for h in wrong if self._prog_ids[hooks[h][0]] not in running]
            try:
                self.links.attach_socket_hooks_again()
            except CgroupAttachError as err:
                return [f"socket hooks on cgroup {cgroup}: {' '.join(wrong)} missing; {err}"]
            if detached:
                self._repair("socket_hooks", f"socket hooks on cgroup {cgroup}: attached "
                             f"{' '.join(sorted(detached))} again")  # fmt: skip
            if set(wrong) - set(detached):
                self._repair("pin", f"socket hooks on cgroup {cgroup}: pinned the links of "
                             f"{' '.join(sorted(set(wrong) - set(detached)))} again")  # fmt: skip
        detached = self.links.detach_other_agents_hooks()
        if detached:
            self._repair("foreign_program", f"cgroup {cgroup}: detached {len(detached)} kbp_ "
                         f"program(s) another agent attached: {' '.join(detached)}")  # fmt: skip
        return problems


def _kept_programs() -> list[str]:
    hooks = {program for _direction, program in (*HOOKS, *EXTERNAL_HOOKS)}
    return sorted({*hooks, XDP_PROGRAM, *(p for p, _t in socket_programs().values())})


@contextmanager
def _opened(path: Path) -> Iterator[int | None]:
    """An fd of the object pinned at `path`, None when there is none."""
    try:
        fd = libbpf.obj_get(str(path))
    except OSError as err:
        if err.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise
        yield None
        return
    try:
        yield fd
    finally:
        os.close(fd)


def _pinned_map_id(path: Path) -> int | None:
    """The id of the map pinned at `path`; None when nothing is pinned there, -1 when
    something that is not a map is."""
    with _opened(path) as fd:
        if fd is None:
            return None
        try:
            return libbpf.map_info(fd).id
        except OSError:
            return -1


def _pinned_link(path: Path) -> libbpf.LinkInfo | None:
    with _opened(path) as fd:
        if fd is None:
            return None
        try:
            return libbpf.link_info(fd)
        except OSError:
            return None


class PinWatch:
    """inotify on the pin directory: readable when a pin is removed or renamed away, or
    the directory itself goes. While there is no directory to watch (it went and is not
    made again yet), or without inotify (fd -1), the keeper relies on its period."""

    _MASK = 0x200 | 0x40 | 0x400 | 0x800  # IN_DELETE, IN_MOVED_FROM, IN_DELETE_SELF, IN_MOVE_SELF

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        self._watching = False

    def watch(self) -> None:
        if self.fd < 0 or self._watching:
            return
        wd = self._libc.inotify_add_watch(self.fd, os.fsencode(self.directory), self._MASK)
        self._watching = wd >= 0

    def drain(self) -> bool:
        """Read what is queued; True if anything was. Forgets the watch when the kernel
        dropped it (IN_IGNORED: the directory is gone), so `watch` adds it again."""
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return False
        offset = 0
        while offset + 16 <= len(data):
            _wd, mask, _cookie, size = struct.unpack_from("iIII", data, offset)
            if mask & 0x8000:  # IN_IGNORED
                self._watching = False
            offset += 16 + size
        return bool(data)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
