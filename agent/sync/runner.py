"""A bounded-frequency runner (kube-proxy's BoundedFrequencyRunner, simplified).

`run()` asks for a sync. The function runs at most once per `min_interval` and at
least once per `max_interval`; requests that arrive while it runs, or too soon after,
coalesce into one later run. `retry_after(delay)` schedules a run even without a
request (used after a failed apply).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class BoundedFrequencyRunner:
    def __init__(
        self,
        name: str,
        fn: Callable[[bool], None],
        min_interval: float,
        max_interval: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`fn(periodic)` is called with periodic=True when no request caused the run."""
        self.name = name
        self._fn = fn
        self._min = min_interval
        self._max = max_interval
        self._clock = clock
        self._cond = threading.Condition()
        self._requested = False
        self._retry_at: float | None = None
        self._stopped = False
        self._last_run: float | None = None
        self._started = clock()
        self._thread: threading.Thread | None = None
        self.runs = 0  # completed runs, for tests and metrics

    def run(self) -> None:
        """Request a run as soon as the minimum interval allows."""
        with self._cond:
            self._requested = True
            self._cond.notify()

    def retry_after(self, delay: float) -> None:
        with self._cond:
            at = self._clock() + delay
            self._retry_at = at if self._retry_at is None else min(self._retry_at, at)
            self._cond.notify()

    def start(self) -> None:
        self._started = self._clock()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def halt(self) -> None:
        """No run starts from now on; one under way goes on to its end."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the run under way, if any (by default however long it takes)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """halt, then join: a run under way is never cut, whatever it writes."""
        self.halt()
        self.join(timeout)

    def _next_due(self, now: float) -> tuple[float, bool]:
        """(when the next run is due, whether it is periodic). Holds the lock."""
        periodic_at = (self._last_run if self._last_run is not None else self._started) + self._max
        due, periodic = periodic_at, True
        if self._retry_at is not None and self._retry_at < due:
            due, periodic = self._retry_at, False
        if self._requested:
            earliest = (self._last_run + self._min) if self._last_run is not None else now
            if earliest < due:
                due, periodic = earliest, False
        return due, periodic

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    now = self._clock()
                    due, periodic = self._next_due(now)
                    if due <= now:
                        break
                    self._cond.wait(min(due - now, 1.0))
                self._requested = False
                if self._retry_at is not None and self._retry_at <= now:
                    self._retry_at = None
                self._last_run = now
            try:
                self._fn(periodic)
            except Exception:  # the loop must survive anything fn does
                log.exception("%s: sync raised; will retry", self.name)
                self.retry_after(max(self._min, 1.0))
            self.runs += 1
