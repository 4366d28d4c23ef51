"""The half of the namespace toolkit only the kernel tests and the benchmarks use (the
`lab` command ships agent/lab/toolkit.py, these do not ship): a `Cleanup` list recording
how to undo each step, which takes everything away in reverse order, also when a later
step failed; `Built` labs on it; cgroups; and helpers for the processes a test starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

from agent.lab.toolkit import LabError, run, sysctl

log = logging.getLogger(__name__)


# -- namespaces --


def link_index(ns: str, name: str) -> int:
    (link,) = json.loads(run(["ip", "-n", ns, "-j", "link", "show", name]))
    return int(link["ifindex"])


def delete_namespace(ns: str) -> None:
    """`ip netns delete ns`; a namespace already gone is no error."""
    try:
        run(["ip", "netns", "delete", ns])
    except LabError:
        if os.path.exists(f"/run/netns/{ns}"):
            raise


def stop_process(proc: subprocess.Popen, grace: float = 2.0) -> None:
    """SIGTERM proc if it still runs, SIGKILL it after `grace` seconds, and close its
    pipes."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pipe in (proc.stdout, proc.stderr, proc.stdin):
        if pipe is not None:
            pipe.close()


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """One line of proc's stdout, waiting at most timeout seconds ("" on EOF)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise LabError(f"`{' '.join(proc.args)}` printed nothing within {timeout}s")
    return proc.stdout.readline()


# -- cgroups --


def cgroup2_mount() -> Path:
    """Where cgroup2 is mounted (/sys/fs/cgroup on unified hosts, .../unified on hybrid)."""
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, path, fstype, *_ = line.split()
            if fstype == "cgroup2":
                return Path(path)
    raise LabError("no cgroup2 mount in /proc/mounts")


def in_cgroup(cgroup: Path | None, argv: Sequence[str]) -> list[str]:
    """argv run inside `cgroup` (a cgroup2 directory; None: where we are): a shell joins
    it, then execs argv, so the process is born there."""
    if cgroup is None:
        return list(argv)
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup / "cgroup.procs"), *argv]


def remove_cgroup(path: Path) -> None:
    """Move any process still inside to the parent (only ours can be there), then rmdir."""
    for _ in range(50):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            with contextlib.suppress(FileNotFoundError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):  # it exited meanwhile
                        (path.parent / "cgroup.procs").write_text(pid)
            time.sleep(0.1)
    path.rmdir()


# -- the cleanup list --


class Cleanup:
    """What to undo, in the order it was done: `close` undoes it last first, goes on past
    a step that fails (logged with `owner`), and returns what went wrong."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._steps: list[tuple[str, Callable[[], object]]] = []

    def push(self, what: str, undo: Callable[[], object]) -> None:
        self._steps.append((what, undo))

    def undo_now(self, what: str) -> None:
        """Undo the step named `what` at once and forget it (raises what it raises)."""
        for i in reversed(range(len(self._steps))):
            if self._steps[i][0] == what:
                _, undo = self._steps.pop(i)
                undo()
                return
        raise KeyError(what)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> list[str]:
        problems = []
        while self._steps:
            what, undo = self._steps.pop()
            try:
                undo()
            except Exception as err:
                log.warning("%s: %s failed: %s", self.owner, what, err)
                problems.append(f"{what}: {err}")
        return problems

    # The steps a lab takes, each with its undo.

    def namespace(self, ns: str, settings: dict[str, str | int] | None = None) -> str:
        """A new network namespace (deleted with everything in it), these sysctls set."""
        run(["ip", "netns", "add", ns])
        self.push(f"deleting netns {ns}", lambda: delete_namespace(ns))
        sysctl(ns, settings or {})
        return ns

    def cgroup(self, path: Path) -> Path:
        path.mkdir()
        self.push(f"removing cgroup {path}", lambda: remove_cgroup(path))
        return path

    def pin_dir(self, path: Path) -> Path:
        """A directory on bpffs, removed with whatever is pinned in it (made by its user)."""
        self.push(f"removing {path}", lambda: shutil.rmtree(path, ignore_errors=True))
        return path

    def process(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.push(f"stopping {proc.args!r}", lambda: stop_process(proc))
        return proc


class Built:
    """A context manager that builds on entry (`_build`) and closes on exit, also when
    building failed half-way; `close` runs the cleanup list."""

    def __init__(self, owner: str) -> None:
        self.undo = Cleanup(owner)

    def __enter__(self) -> Self:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _build(self) -> None:
        raise NotImplementedError

    def close(self) -> list[str]:
        return self.undo.close()
