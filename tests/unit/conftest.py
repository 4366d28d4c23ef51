"""Fixtures shared by the unit tests of the local HTTP servers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest


@pytest.fixture
def no_thread_leak() -> Iterator[None]:
    """The test must stop every thread it started (servers, their loop and workers)."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 2
    while (leaked := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not leaked, f"threads left running: {sorted(t.name for t in leaked)}"
