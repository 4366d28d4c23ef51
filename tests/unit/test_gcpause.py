"""agent/gcpause.py: the cyclic collector comes back only when no pause is active, and
when something asked for it (it ran before, or `enable` was called meanwhile)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from agent import gcpause


@pytest.fixture(autouse=True)
def collector_restored() -> Iterator[None]:
    was = gc.isenabled()
    yield
    gcpause.enable() if was else gcpause.disable()


def test_a_pause_restores_a_running_collector() -> None:
    gcpause.enable()
    with gcpause.gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_enable_during_a_pause_waits_for_its_end() -> None:
    """The daemon's safety timer may fire in the middle of a large load."""
    gcpause.disable()
    with gcpause.gc_paused():
        gcpause.enable(freeze=True)
        assert not gc.isenabled()
    assert gc.isenabled()


def test_overlapping_pauses_in_two_threads_keep_it_off_until_the_last_ends() -> None:
    gcpause.enable()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with gcpause.gc_paused():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    with gcpause.gc_paused():
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's pause is still on
    leave.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_pause_keeps_a_collector_turned_off_off() -> None:
    gcpause.disable()
    with gcpause.gc_paused():
        pass
    assert not gc.isenabled()
