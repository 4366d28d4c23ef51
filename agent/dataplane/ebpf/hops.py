"""The next-hop epoch (kbp_hop_epoch): what lets the programs keep a next hop they looked
up for as long as it is right, rather than for a fixed 100 ms.

The programs cache the FIB's answer per destination address (kbp_hops), each answer
stamped with the epoch it was found under (lib/ext.h ext_next_hop). The agent
sets a new epoch when it starts (it did not see what changed while it was away) and
whenever its RouteWatcher hears of a change that can change an answer (a route, a rule, a
link's state or MAC address, a neighbour's MAC address or resolution); every answer
stamped earlier is then stale at once and the next packet asks the FIB. A clean stop sets
the epoch to 0, with which the programs keep an answer 100 ms only, as nobody watches; a
killed agent leaves its epoch, and answers then hold at most KBP_HOP_WATCHED_NS (10 s).
"""

from __future__ import annotations

import logging
import struct
import threading
from collections.abc import Callable

from .kernel import LoadedPrograms
from .netlink import RouteWatcher

log = logging.getLogger(__name__)

# Why a new epoch was set (kbp_next_hop_epochs_total{cause}): the agent started, or what
# RouteWatcher heard of.
CAUSES = ("start", "route", "rule", "link", "neighbour", "lost")
_U32 = struct.Struct("=I")
_INDEX = bytes(4)


class HopEpoch:
    """kbp_hop_epoch's writer and the RouteWatcher that tells it when (`netns`: the
    node's network namespace, None: this thread's). `changes`: counts of epochs set, by
    cause (what RouteWatcher names, and "start")."""

    def __init__(self, programs: LoadedPrograms, netns: str | None) -> None:
        self.table = programs.map("kbp_hop_epoch")
        self.netns = netns
        self.changes: dict[str, int] = {}
        self._lock = threading.Lock()
        self._watcher: RouteWatcher | None = None
        self._report: Callable[[str], None] | None = None

    @property
    def value(self) -> int:
        raw = self.table.lookup(_INDEX)
        return _U32.unpack(raw)[0] if raw is not None else 0

    def status(self) -> dict[str, object]:
        """/state's view: whether routes are watched, the epoch, new epochs by cause."""
        return {"watching": self._watcher is not None, "epoch": self.value,
                "newEpochs": dict(sorted(self.changes.items()))}  # fmt: skip

    def start(self) -> None:
        """Watch, then set a new epoch: what an earlier agent's programs cached is not
        trusted (routes may have changed while no one watched). NetlinkError when the
        watcher cannot start; the epoch is then 0 (100 ms answers), whatever an earlier
        agent killed without a clean stop left in the pinned map."""
        watcher = RouteWatcher(self.netns, self.changed)
        try:
            watcher.start()
        except Exception:
            self.unwatched()
            raise
        self._watcher = watcher
        self.changed({"start"})

    def unwatched(self) -> None:
        """Epoch 0: nobody watches, cached answers hold 100 ms."""
        with self._lock:
            self.table.update(_INDEX, _U32.pack(0))

    def report_to(self, report: Callable[[str], None]) -> None:
        """`report(cause)` for every new epoch from now on (the metric)."""
        self._report = report

    def changed(self, causes: set[str]) -> None:
        """A new epoch (never 0) for `causes`."""
        with self._lock:
            epoch = self.value % 0xFFFFFFFF + 1
            self.table.update(_INDEX, _U32.pack(epoch))
            for cause in causes:
                self.changes[cause] = self.changes.get(cause, 0) + 1
                if self._report is not None:
                    self._report(cause)
        log.debug("ebpf: next-hop epoch %d (%s)", epoch, ",".join(sorted(causes)))

    def stop(self) -> None:
        """Stop watching and set the epoch to 0: answers then hold 100 ms, as nobody
        watches."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
            self.unwatched()
