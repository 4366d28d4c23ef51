"""A recording dataplane for tests of the sync loop (no root, no kernel).

It keeps every applied NodeState, counts the entries that differ from what it held
as its "kernel writes" (looking only at the Services a state's Changes name when they
start from the state it holds), and can be told to fail the next applies.
"""

from __future__ import annotations

import threading

from ..model.nodestate import NodeState
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
        held = self._held_digests
        changes, before = state.changes, self._held
        if changes is not None and before is not None and changes.base == before.revision:
            went, came = changes.between(before.services, state.services)
            wanted = {e.sort_key: e.digest for e in came}
            gone = [e.sort_key for e in went if e.sort_key not in wanted]
        else:  # the full path
            wanted = {e.sort_key: e.digest for e in state.services}
            gone = [k for k in held if k not in wanted]
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
