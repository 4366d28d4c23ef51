"""The node lock (agent/nodelock.py): one holder per pin directory, across processes and
within one (flock conflicts between two open file descriptions even in one process), a
waiter that names the holder and proceeds when it exits, and a removed lock file never
letting two holders in."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent import nodelock
from agent.nodelock import LockError, NodeLock, escape_path, lock_path

ROOT = Path(__file__).parents[2]
BPFFS = "/sys/fs/bpf/kube-bpf-proxy"

ESCAPES = {
    "the default pin directory": (BPFFS, "sys-fs-bpf-kube\\x2dbpf\\x2dproxy"),
    "slashes doubled and trailing": ("//sys//fs/bpf/x/", "sys-fs-bpf-x"),
    "the root": ("/", "-"),
    "a leading dot": ("/.hidden/a.b", "\\x2ehidden-a.b"),
    "a space and a non-ASCII letter": ("/a b/é", "a\\x20b-\\xc3\\xa9"),
}  # fmt: skip


@pytest.mark.parametrize(("path", "name"), ESCAPES.values(), ids=ESCAPES.keys())
def test_the_lock_file_name_is_the_paths_systemd_escape(path: str, name: str) -> None:
    assert escape_path(path) == name


def test_distinct_pin_directories_get_distinct_lock_files(tmp_path: Path) -> None:
    names = {lock_path(tmp_path, p).name for p in ("/a-b", "/a/b", "/a_b", "/a.b", "/ab")}
    assert len(names) == 5, names


def test_another_spelling_of_the_same_directory_is_the_same_lock(tmp_path: Path) -> None:
    real = tmp_path / "pins"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    same = {lock_path("/run/x", p) for p in (real, f"{real}/", tmp_path / "link", f"{real}/.")}
    assert same == {Path("/run/x") / f"{escape_path(str(real))}.lock"}


def test_a_very_long_path_gets_a_short_distinct_name() -> None:
    first = lock_path("/run/x", "/" + "d" * 300 + "/one")
    second = lock_path("/run/x", "/" + "d" * 300 + "/two")
    assert first != second
    assert len(first.name) <= 255 and len(second.name) <= 255


def test_two_locks_in_one_process_conflict_and_name_the_holder(tmp_path: Path) -> None:
    first, second = NodeLock(tmp_path, BPFFS), NodeLock(tmp_path, BPFFS)
    assert first.try_acquire() is None and first.held
    holder = second.try_acquire()
    assert holder is not None and not second.held
    assert holder.pid == os.getpid()
    assert holder.fields["command"].startswith("kube-bpf-proxy")
    assert f"pid {os.getpid()} (started " in holder.describe()
    # another pin directory is another lock
    other = NodeLock(tmp_path, "/sys/fs/bpf/other")
    assert other.try_acquire() is None
    other.release()
    first.release()
    assert not first.path.exists()  # the holder removes the file as it lets go
    assert second.try_acquire() is None
    assert first.path.read_text().startswith(f"pid: {os.getpid()}\n")
    second.release()
    second.release()  # idempotent


def test_a_lock_held_by_another_process_is_free_once_it_is_killed(tmp_path: Path) -> None:
    code = (
        "import sys; from agent.nodelock import NodeLock; "
        f"lock = NodeLock({str(tmp_path)!r}, {BPFFS!r}); "
        "assert lock.try_acquire() is None; print('held', flush=True); sys.stdin.read()"
    )
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        lock = NodeLock(tmp_path, BPFFS)
        holder = lock.try_acquire()
        assert holder is not None and holder.pid == child.pid, holder
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # SIGKILL: the file stays with the dead holder's line; the kernel freed the lock
    assert lock.path.exists()
    assert lock.try_acquire() is None
    assert lock.path.read_text().startswith(f"pid: {os.getpid()}\n")
    lock.release()


def test_a_waiter_names_the_holder_and_proceeds_when_it_lets_go(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nodelock, "WAIT_REPORT_PERIOD", 0.3)
    holder, waiter = NodeLock(tmp_path, BPFFS), NodeLock(tmp_path, BPFFS)
    assert holder.try_acquire() is None
    timer = threading.Timer(1.0, holder.release)
    timer.start()
    caplog.set_level(logging.INFO, logger="agent.nodelock")
    started = time.monotonic()
    try:
        assert waiter.acquire(threading.Event()) is True
    finally:
        timer.cancel()
    assert 0.9 <= time.monotonic() - started < 5
    assert waiter.held
    messages = [r.getMessage() for r in caplog.records]
    assert f"pid {os.getpid()} (started" in messages[0], messages
    assert "writes nothing to the node until it holds the lock" in messages[0], messages
    assert any(m.startswith("still waiting") and f"pid {os.getpid()}" in m for m in messages)
    assert messages[-1].startswith(f"now holding the node's lock {waiter.path}"), messages
    waiter.release()


def test_a_waiter_told_to_stop_takes_nothing(tmp_path: Path) -> None:
    holder, waiter = NodeLock(tmp_path, BPFFS), NodeLock(tmp_path, BPFFS)
    assert holder.try_acquire() is None
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    assert waiter.acquire(stop) is False
    assert not waiter.held and holder.held
    holder.release()


def test_a_waiter_left_with_a_removed_file_takes_the_new_one_not_a_second_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B opened the file before A let go (and removed it); C made a new one and holds it.
    B's flock on the removed file succeeds, but B must see it is stale and find C."""
    a, b, c = (NodeLock(tmp_path, BPFFS) for _ in range(3))
    assert a.try_acquire() is None
    stale = os.open(a.path, os.O_RDWR | os.O_CLOEXEC)
    a.release()
    assert c.try_acquire() is None
    opened = iter([stale])
    real_open = b._open
    monkeypatch.setattr(b, "_open", lambda: next(opened, None) or real_open())
    holder = b.try_acquire()
    assert holder is not None and not b.held
    c.release()


def test_a_lock_dir_that_cannot_be_made_is_one_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    lock = NodeLock(blocker / "locks", BPFFS)
    with pytest.raises(LockError) as raised:
        lock.try_acquire()
    assert str(raised.value).startswith(f"cannot open the node's lock file {lock.path}: ")
    assert "--lock-dir" in str(raised.value)
