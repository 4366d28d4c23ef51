"""The interface every dataplane implements, and its error type."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ..model.nodestate import NodeState

if TYPE_CHECKING:
    from ..metrics import Metrics


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

    def close(self) -> None:
        """Stop what runs in the background; the kernel state stays for the next agent."""
        ...

    def status_details(self) -> dict[str, object]:
        """The dataplane's own fields of /state's status ({} for none)."""
        ...

    def register_metrics(self, metrics: Metrics, service_metrics: str = "services") -> None:
        """Add the dataplane's own gauges and counters to `metrics` (if it has any)."""
        ...

    def integrity(self) -> tuple[list[str], float | None]:
        """What of the applied state the kernel no longer holds and the dataplane could
        not put back, and for how many seconds; ([], None) when intact."""
        ...


class QuietDataplane:
    """The optional part of the protocol for a dataplane with nothing running in the
    background, no status fields and no metrics of its own."""

    def close(self) -> None:
        """Nothing to stop."""

    def status_details(self) -> dict[str, object]:
        return {}

    def register_metrics(self, metrics: Metrics, service_metrics: str = "services") -> None:
        """No metrics of its own."""

    def integrity(self) -> tuple[list[str], float | None]:
        """Nothing checked in the background: intact as far as it knows."""
        return [], None
