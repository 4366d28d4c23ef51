"""`--dataplane none`: a dry run. Compiles and serves the NodeState, programs nothing."""

from __future__ import annotations

from ..model.nodestate import NodeState
from .base import QuietDataplane


class NoneDataplane(QuietDataplane):
    name = "none"

    def __init__(self) -> None:
        self._revision: str | None = None

    def apply(self, state: NodeState, full: bool = False) -> int:
        self._revision = state.revision
        return 0

    @property
    def held_revision(self) -> str | None:
        return self._revision

    def cleanup(self) -> None:
        self._revision = None
