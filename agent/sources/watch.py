"""The file source followed over time: re-read the manifests when a file under the given
paths is added, removed or changed, and hand the store the full new state.

Polling the files' (path, mtime, size) once per interval is enough for a lab or a
node-local directory and needs no inotify plumbing. Bad input never loses state: an
object that fails to decode keeps its last good version, and a file that cannot be
parsed at all keeps the whole previous state until it is fixed.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

from ..model.decode import object_ref
from ..model.types import Node
from ..sync.store import StateStore, Value, key_of, kind_of
from .manifests import load_manifests, manifest_files

log = logging.getLogger(__name__)

SOURCE = "manifests"


def _ref(value: Value) -> str:
    """The name load_manifests' reports give this object (decode.object_ref)."""
    namespace, name = key_of(value)
    return object_ref(kind_of(value), None if isinstance(value, Node) else namespace, name)


def snapshot(paths: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    """What identifies the files' current contents cheaply."""
    out = []
    for path in manifest_files(paths):
        try:
            stat = os.stat(path)
        except OSError:
            continue
        out.append((str(path), stat.st_mtime_ns, stat.st_size))
    return tuple(out)


class ManifestSource:
    """Loads `paths` into the store now, and again whenever they change."""

    def __init__(self, paths: Sequence[str], store: StateStore, interval: float = 1.0) -> None:
        self.paths = list(paths)
        self.store = store
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: tuple[tuple[str, int, int], ...] = ()
        self.loads = 0
        # Registered now, not at start(): the store must know of this source before a
        # sync loop can run, or it would apply the empty state it holds until then.
        store.register_source(SOURCE)

    def start(self) -> None:
        self.load()
        self.store.mark_synced(SOURCE)
        self._thread = threading.Thread(target=self._run, name="manifest-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def load(self) -> bool:
        """Read every file and replace the store's state; False when nothing was applied
        because a file could not be read as a whole."""
        self._seen = snapshot(self.paths)
        state, reports = load_manifests(self.paths)
        for report in reports:
            log.warning("%s", report)
        if any(r.error and not r.ref for r in reports) and self.loads:
            log.error(
                "manifests: a file could not be read; keeping the previous state until it is fixed"
            )
            return False
        broken = {r.ref for r in reports if r.error and r.ref}
        self.loads += 1
        for kind, values in (
            ("Node", state.nodes.values()),
            ("Service", state.services.values()),
            ("EndpointSlice", state.slices.values()),
        ):
            # An object that failed to decode this time keeps its last good version.
            self.store.replace(kind, list(values), keep=lambda v: _ref(v) not in broken)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if snapshot(self.paths) != self._seen:
                    log.info("manifests: files changed, reloading")
                    self.load()
            except Exception:  # never let the watcher die on odd input
                log.exception("manifests: reloading failed; keeping the previous state")
