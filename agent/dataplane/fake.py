"""A recording dataplane for tests of the sync loop (no root, no kernel).

It keeps every applied NodeState, counts the entries that differ from what it held
as its "kernel writes" (applying `Changes.since` the state it holds: the entries that went
and came), and can be told to fail the next applies.
"""

from __future__ import annotations

import threading

from ..model.nodestate import Changes, NodeState
from .base import DataplaneError, QuietDataplane


class FakeDataplane(QuietDataplane):
    name = "fake"

    def __init__(self) -> None:
        self.applied: list[tuple[NodeState, bool]] = []  # (state, full) per successful apply
        self.writes = 0
        self.fail_next = 0  # the next N applies raise DataplaneError
        self.attempts = 0
        self._held: NodeState | None = None
        self._held_digests: dict[tuple[str, ...], bytes] = {}
        self.applied_event = threading.Event()

    def apply(self, state: NodeState, full: bool = False) -> int:
        self.attempts += 1
        if self.fail_next > 0:
            self.fail_next -= 1
            raise DataplaneError("injected", "fake dataplane told to fail")
        held, before = self._held_digests, self._held
        if before is None:
            delta = Changes.since(None, None, state)
        else:
            delta = Changes.since(before.revision, before.services, state)
        wanted = {e.sort_key: e.digest for e in delta.came}
        gone = [e.sort_key for e in delta.went if e.sort_key not in wanted]
        writes = sum(1 for k, d in wanted.items() if held.get(k) != d) + len(gone)
        for key in gone:
            del held[key]
        held.update(wanted)
        self._held = state
        self.writes += writes
        self.applied.append((state, full))
        self.applied_event.set()
        return writes

    @property
    def held_revision(self) -> str | None:
        return self._held.revision if self._held else None

    @property
    def held(self) -> NodeState | None:
        return self._held

    def cleanup(self) -> None:
        self._held, self._held_digests = None, {}
