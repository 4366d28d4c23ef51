"""Free large structures a batch at a time, off the thread that dropped them.

Dropping the last reference to a container of a few hundred thousand decoded objects
frees all of them in one call that never lets go of the interpreter lock: a reload of a
200 MB manifest freed millions of objects that way, and the health server's threads could
not answer meanwhile. `release(obj)` instead hands the reference to one background thread
that takes the container apart and drops its items a batch at a time; between batches the
interpreter can switch threads (each batch is one bytecode's work, a few milliseconds).

Only what the caller no longer uses may be handed over. Items that something else still
references are merely no longer referenced from here: nothing is freed twice or early.
"""

from __future__ import annotations

import collections
import logging
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

BATCH = 500  # items dropped at a time
SMALL = 2 * BATCH  # containers up to this size are dropped whole
DEPTH = 4  # levels taken apart (a dict of files, a file's load, its entries, an entry)
HANDOVER_WAIT = 5.0  # seconds the caller may take to drop its own references

_queue: collections.deque[Any] = collections.deque()
_wake = threading.Condition()
_thread: threading.Thread | None = None
_idle = threading.Event()
_idle.set()


def release(*objects: Any) -> None:
    """Hand `objects` over to be freed in batches; the caller keeps no reference."""
    global _thread
    with _wake:
        _queue.extend(objects)
        _idle.clear()
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="release", daemon=True)
            _thread.start()
        _wake.notify()


def wait_idle(timeout: float | None = None) -> bool:
    """True once everything handed over so far is freed (tests and benchmarks)."""
    return _idle.wait(timeout)


def _run() -> None:
    while True:
        with _wake:
            while not _queue:
                _idle.set()
                _wake.wait()
            obj = _queue.popleft()
        # The caller may still be dropping its own references: wait for them to go
        # (while another holder keeps it, the object is not ours to take apart).
        deadline = time.monotonic() + HANDOVER_WAIT
        while sys.getrefcount(obj) > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        held = [obj]
        del obj
        try:
            _take_apart(held.pop(), DEPTH)  # the only reference moves into the call
        except Exception:  # freeing must never stop: whatever is left goes at once
            log.exception("release: taking something apart failed")


def _take_apart(obj: Any, depth: int) -> None:
    """Drop `obj`'s items in batches, taking large items apart in turn. The caller hands
    over its reference (the argument is its last); a list or dict referenced beyond this
    frame belongs to someone else as well and is left as it is."""
    sole = sys.getrefcount(obj) <= 2  # this frame's, and getrefcount's argument
    items = _detach(obj, sole) if depth > 0 else None
    del obj
    if items is None:
        return
    # Objects are looked into only among a few items (a dict of files, a load's fields):
    # the items of a long list are the decoded objects themselves, each small.
    few = len(items) <= SMALL
    while items:
        batch = items[-BATCH:]
        del items[-BATCH:]
        while batch:
            if depth > 1 and _large(batch[-1], few):
                _take_apart(batch.pop(), depth - 1)
            else:
                batch.pop()
        # what the batch held alone is freed by now: a few milliseconds of work, after
        # which the interpreter may switch threads


def _large(item: Any, objects: bool) -> bool:
    if isinstance(item, list | dict | set | tuple | frozenset):
        return len(item) > SMALL
    return objects and (hasattr(item, "__slots__") or hasattr(item, "__dict__"))


def _detach(obj: Any, sole: bool) -> list[Any] | None:
    """`obj`'s items in a list, a list or dict of ours (`sole`) emptied (so freeing it
    frees no item); None when there is nothing worth taking apart."""
    if isinstance(obj, list | dict) and not sole:
        return None
    if isinstance(obj, list):
        items = obj[:]
        obj.clear()
        return items
    if isinstance(obj, dict):
        items = list(obj.values())
        obj.clear()  # the keys go now: strings and tuples of strings, cheap
        return items
    if isinstance(obj, tuple | set | frozenset):
        return list(obj) if len(obj) > SMALL else None
    slots = [name for cls in type(obj).__mro__ for name in getattr(cls, "__slots__", ())]
    fields = [getattr(obj, name, None) for name in slots]
    fields.extend(getattr(obj, "__dict__", {}).values())
    big = [value for value in fields if isinstance(value, list | dict | set | tuple | frozenset)
           and len(value) > SMALL]  # fmt: skip
    return big or None
