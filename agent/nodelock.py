"""One writer per node: the lock `run` holds on its pin directory for its whole life and
`cleanup` takes while it removes.

The lock is a file under --lock-dir (/run/kube-bpf-proxy), one per resolved --bpffs path,
held with flock(LOCK_EX). It is not a flock on the pin directory itself: a pin directory
removed under a running agent (`rm -r`) would let a second agent make and lock a new one
while the first still writes, whereas the file under /run stays. Every dataplane takes
the same key (an iptables or `none` agent too): a node has one agent, and `auto` may
switch. The holder writes its PID, start time, host and command into the file, so a
waiting agent or a refused `cleanup` can name it, and removes the file as it lets go
(a waiter that then holds a removed file notices and takes the new one).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shlex
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

log = logging.getLogger(__name__)

WAIT_REPORT_PERIOD = 30.0  # seconds between the "still waiting" lines
POLL_INTERVAL = 0.1  # seconds between two tries of a waiting agent (LOCK_NB: SIGTERM stays prompt)
HOLDER_READ_TRIES = 10  # a holder writes its line just after it took the lock
MAX_NAME = 200  # longer escaped names are cut and end in a digest (NAME_MAX is 255)
COMMAND_SHOWN = 300  # characters of the holder's command line written to the file


class LockError(Exception):
    """The lock file cannot be made or opened; the message names it and the setting."""


@dataclass(frozen=True)
class Holder:
    """Who holds a lock, as its file says (pid None: the file said nothing usable)."""

    pid: int | None
    fields: dict[str, str]

    def describe(self) -> str:
        """`pid 1234 (started …, host …, command …)`, or what is known of it."""
        rest = ", ".join(f"{key} {value}" for key, value in self.fields.items() if key != "pid")
        who = f"pid {self.pid}" if self.pid is not None else "a process that wrote no pid yet"
        return f"{who} ({rest})" if rest else who


def escape_path(path: str) -> str:
    """`path` as systemd-escape --path writes it (/sys/fs/bpf/kube-bpf-proxy ->
    sys-fs-bpf-kube\\x2dbpf\\x2dproxy): readable, and distinct paths never collide."""
    parts = [p for p in path.split("/") if p]
    if not parts:
        return "-"
    out = []
    for i, char in enumerate("/".join(parts)):
        if char == "/":
            out.append("-")
        elif (char.isascii() and (char.isalnum() or char in ":_.")) and not (
            i == 0 and char == "."
        ):
            out.append(char)
        else:
            out.extend(f"\\x{byte:02x}" for byte in char.encode())
    return "".join(out)


def lock_path(lock_dir: str | Path, bpffs: str | Path) -> Path:
    """The lock file of pin directory `bpffs` (resolved: another spelling of the same
    directory is the same lock)."""
    name = escape_path(os.path.realpath(bpffs))
    if len(name) > MAX_NAME:
        digest = hashlib.sha256(name.encode()).hexdigest()[:16]
        name = f"{name[: MAX_NAME - 17]}-{digest}"
    return Path(lock_dir) / f"{name}.lock"


def command_line() -> str:
    """This process's command, as the operator would type it (shortened)."""
    text = shlex.join(["kube-bpf-proxy", *sys.argv[1:]])
    return text if len(text) <= COMMAND_SHOWN else text[: COMMAND_SHOWN - 3] + "..."


class NodeLock:
    """The lock of one pin directory. `try_acquire` once (cleanup) or `acquire`, waiting
    (run); `release` when everything that writes has stopped."""

    def __init__(self, lock_dir: str | Path, bpffs: str | Path) -> None:
        self.bpffs = str(bpffs)
        self.path = lock_path(lock_dir, bpffs)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _open(self) -> int:
        try:
            self.path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise LockError(
                f"cannot open the node's lock file {self.path}: {err.strerror} "
                "(--lock-dir, KBP_LOCK_DIR)"
            ) from err

    def try_acquire(self) -> Holder | None:
        """Take the lock if nobody holds it (None), else who holds it. LockError when the
        file cannot be made."""
        if self._fd is not None:
            return None
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    raise LockError(f"cannot lock {self.path}: {err.strerror}") from err
                holder = _read_holder(fd)
                os.close(fd)
                return holder
            if self._is_current(fd):
                self._fd = fd
                self._write_holder(fd)
                return None
            os.close(fd)  # the holder removed this file as it let go: take the new one

    def acquire(self, stop: threading.Event, what: str = "this agent") -> bool:
        """Take the lock, waiting while another process holds it: one line at once naming
        the holder, a shorter one every WAIT_REPORT_PERIOD, one when it is ours. False
        when `stop` was set first (nothing was taken)."""
        holder = self.try_acquire()
        if holder is None:
            log.info("holding the node's lock %s for %s", self.path, self.bpffs)
            return True
        log.warning(
            "another process holds the node's lock %s for %s: %s; %s writes nothing to the "
            "node until it holds the lock, waiting",
            self.path, self.bpffs, holder.describe(), what,
        )  # fmt: skip
        started = last_report = time.monotonic()
        while not stop.wait(POLL_INTERVAL):
            holder = self.try_acquire()
            if holder is None:
                log.info("now holding the node's lock %s (waited %.1f s)", self.path,
                         time.monotonic() - started)  # fmt: skip
                return True
            if time.monotonic() - last_report >= WAIT_REPORT_PERIOD:
                last_report = time.monotonic()
                log.info("still waiting for the node's lock %s, held by pid %s (%.0f s)",
                         self.path, holder.pid, last_report - started)  # fmt: skip
        return False

    def release(self) -> None:
        """Remove the file (while still holding it: a waiter holding the removed file
        notices) and let go. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._is_current(fd):
                with contextlib.suppress(OSError):
                    self.path.unlink()
        finally:
            os.close(fd)

    def _is_current(self, fd: int) -> bool:
        """Is `fd` still the file at self.path (not one a former holder removed)?"""
        try:
            at_path = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (mine.st_dev, mine.st_ino) == (at_path.st_dev, at_path.st_ino)

    def _write_holder(self, fd: int) -> None:
        started = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        text = (f"pid: {os.getpid()}\nstarted: {started}\nhost: {socket.gethostname()}\n"
                f"command: {command_line()}\n")  # fmt: skip
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, text.encode(), 0)
        except OSError as err:  # the lock holds without it; only the name is missing
            log.warning("could not write this process's pid into %s: %s", self.path, err)


def _read_holder(fd: int) -> Holder:
    """What the holder wrote; it writes just after taking the lock, so an empty file is
    read again a few times."""
    text = ""
    for _ in range(HOLDER_READ_TRIES):
        try:
            text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
        except OSError:
            text = ""
        if text.strip():
            break
        time.sleep(0.02)
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip():
            fields[key.strip()] = value.strip()
    pid_text = fields.get("pid", "")
    return Holder(int(pid_text) if pid_text.isdigit() else None, fields)
