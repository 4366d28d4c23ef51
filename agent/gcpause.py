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
from collections.abc import Iterator
from contextlib import contextmanager

FREEZE_SURVIVORS = 200_000  # net new tracked objects above which a pause freezes them


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_count()[0] > FREEZE_SURVIVORS:
                gc.freeze()
            gc.enable()
