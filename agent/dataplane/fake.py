"""A recording dataplane for tests of the sync loop (no root, no kernel).

It keeps every applied NodeState, counts the entries that differ from what it held
as its "kernel writes", and can be told to fail the next applies.
"""

from __future__ import annotations

import threading

from ..model.nodestate import NodeState
from .base import DataplaneError


class FakeDataplane:
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
        wanted = {e.sort_key: e.digest for e in state.services}
        writes = sum(1 for k, d in wanted.items() if held.get(k) != d)
        writes += sum(1 for k in held if k not in wanted)
        self._held, self._held_digests = state, wanted
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
