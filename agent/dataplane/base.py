"""The interface every dataplane implements, and its error type."""

from __future__ import annotations

from typing import Protocol

from ..model.nodestate import NodeState


class DataplaneError(Exception):
    """An apply failed; `reason` is a short, stable label for metrics."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Dataplane(Protocol):
    name: str

    def apply(self, state: NodeState, full: bool = False) -> int:
        """Make the kernel match `state`; return the number of kernel writes made.

        `full` asks for a full resync: compare with what the kernel really holds rather
        than with the last applied state (after an error, or periodically). Must leave
        the previous state in place when it raises DataplaneError.
        """
        ...

    @property
    def held_revision(self) -> str | None:
        """The revision the kernel holds now (None before the first apply)."""
        ...

    def cleanup(self) -> None:
        """Remove everything this dataplane installed."""
        ...
