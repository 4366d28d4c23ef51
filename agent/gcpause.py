"""Pause CPython's cycle collector around bulk work.

Decoding a large LIST creates millions of objects that never form reference cycles;
with the collector running, its generation-2 passes over them took over half of a
10k-Service load (bench/compile.py). Nothing here creates cycles that must be freed
promptly, so pausing is safe; the previous state is restored on exit.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
