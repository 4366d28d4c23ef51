"""Pause CPython's cycle collector around bulk work.

Decoding a large LIST creates millions of objects that never form reference cycles;
with the collector running, its generation-2 passes over them took over half of a
10k-Service load (bench/compile.py). Nothing here creates cycles that must be freed
promptly, so pausing is safe; the previous state is restored on exit.

Objects that survive a pause are counted towards the youngest generation, so the first
collection after a large load would walk all of them at once, holding the GIL: a
200 MB manifest stalled every other thread (the health server's) for about a second,
then again at each older generation's turn. Survivors of a large pause are therefore
moved to the permanent generation (gc.freeze), as the sync loop does with the first
programmed state: they are long-lived model values, and acyclic ones are still freed
by reference counting when replaced.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

FREEZE_SURVIVORS = 200_000  # net new tracked objects above which a pause freezes them

# Pauses nest and overlap across threads (the file source decodes while the sync loop
# compiles): the collector runs again only when the last one ends, and only if it ran
# before the first began or was turned on meanwhile (`enable`). Turning it on in the
# middle of a pause would let a full collection walk the millions of objects the pause
# is there for: the daemon's safety timer did so during a 200 MB manifest's first load
# (over 300 s), stalling every thread for seconds at a time.
_lock = threading.Lock()
_pauses = 0
_wanted = False  # run the collector once no pause is active


@contextmanager
def gc_paused() -> Iterator[None]:
    global _pauses, _wanted
    with _lock:
        if _pauses == 0:
            _wanted = gc.isenabled()
        _pauses += 1
        gc.disable()
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if _pauses == 0 and _wanted:
                if gc.get_count()[0] > FREEZE_SURVIVORS:
                    gc.freeze()
                gc.enable()


def enable(freeze: bool = False) -> None:
    """Turn the collector on: now, or when the pauses in progress end. `freeze` first
    moves every object now alive to the permanent generation (see the module doc)."""
    global _wanted
    with _lock:
        _wanted = True
        if freeze:
            gc.freeze()
        if _pauses == 0:
            gc.enable()


def disable() -> None:
    """Turn the collector off until `enable` (pauses that end meanwhile keep it off)."""
    global _wanted
    with _lock:
        _wanted = False
        gc.disable()
