"""The file source followed over time: re-read a manifest file when it is added, removed or
changed, and hand the store the full new state.

Polling the files' status once per interval is enough for a lab or a node-local
directory and needs no inotify plumbing. Only files whose status changed are read again;
each file keeps what it contributes, so one bad file never holds back, or loses, a
change made in another. What a careful user expects of each fault, with one log line:

* an object that fails to decode keeps its last good version;
* a file that cannot be read as a whole (invalid YAML or JSON, not UTF-8, a symlink
  loop, a dangling symlink, a directory, a FIFO) keeps its last good objects until it
  can be read;
* a file whose documents name no object (valid YAML that is not an object, a document
  without a name) keeps the objects it no longer defines, since any of them may be the
  broken one;
* an object that a file no longer defines (an edit, a file cut at a document boundary,
  a file emptied) is removed once the file has stayed unchanged for one more interval,
  so a file caught half-written loses nothing; the line names what was removed, and
  says so when the file is empty;
* a file deleted from a directory removes its objects at once (a deliberate act);
  while a path given on the command line is missing, its objects are kept.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..model.types import ClusterState
from ..release import release
from ..sync.store import StateStore, Value
from .manifests import CHILD_FROM, Entry, FileLoad, load_file, manifest_files, merge, unreadable

log = logging.getLogger(__name__)

SOURCE = "manifests"
NAMES_SHOWN = 5  # objects named in one line; the rest are counted

StatKey = tuple[object, ...]


class ManifestPathError(Exception):
    """A path given to --manifests does not exist: the agent must not start empty."""


def _stat_key(path: str) -> StatKey:
    """What identifies a file's current contents cheaply (never opens it)."""
    try:
        st = os.stat(path)
        return (st.st_mode, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
    except OSError as err:
        try:
            link = os.lstat(path)
        except OSError:
            return ("missing", err.errno)
        return ("unreadable", err.errno, link.st_ino, link.st_mtime_ns)


def snapshot(paths: Sequence[str]) -> tuple[tuple[str, StatKey], ...]:
    """Every manifest file under `paths` with its status."""
    return tuple((str(path), _stat_key(str(path))) for path in manifest_files(paths))


def _names(entries: Sequence[Entry]) -> str:
    refs = [e.ref for e in entries]
    shown = ", ".join(refs[:NAMES_SHOWN])
    return shown + (f" and {len(refs) - NAMES_SHOWN} more" if len(refs) > NAMES_SHOWN else "")


def _objects(count: int) -> str:
    return f"{count} object{'' if count == 1 else 's'}"


@dataclass(slots=True)
class _File:
    key: StatKey  # the status it was read at
    load: FileLoad  # the latest read
    entries: list[Entry]  # what it contributes: the latest read, or its last good objects
    pending: bool = False  # removals wait until the file stays unchanged one interval
    kept: str | None = None  # why it is kept while absent from the listing (logged once)


class ManifestSource:
    """Loads `paths` into the store now, and again whenever they change."""

    def __init__(self, paths: Sequence[str], store: StateStore, interval: float = 1.0) -> None:
        self.paths = list(paths)
        self.store = store
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: tuple[tuple[str, StatKey], ...] = ()
        self._files: dict[str, _File] = {}
        self._values: dict[str, Value] = {}  # ref → value, as last handed to the store
        self._missing: set[str] = set()  # named directories found missing (logged once)
        self.loads = 0
        self.child_from: int | None = CHILD_FROM  # larger files are parsed in a child process
        # A path named that does not exist is an error now: starting empty would look
        # healthy and program nothing.
        for path in self.paths:
            if not os.path.exists(path):
                raise ManifestPathError(f"--manifests {path}: {unreadable(Path(path))}")
        # Registered now, not at start(): the store must know of this source before a
        # sync loop can run, or it would apply the empty state it holds until then.
        store.register_source(SOURCE)

    def start(self) -> None:
        """Load the paths and start following them."""
        self.load()
        self.store.mark_synced(SOURCE)
        self._thread = threading.Thread(target=self._run, name="manifest-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def load(self) -> bool:
        """Read the files that changed and hand the store the full state; True when
        the store changed."""
        self._seen = snapshot(self.paths)
        first = not self.loads
        files: dict[str, _File] = {}
        fresh_paths: set[str] = set()
        missing = {str(Path(p)) for p in self.paths if not os.path.lexists(p)}
        for path, key in self._seen:
            old = self._files.get(path)
            if old is None and path in missing and self.loads:
                continue  # a named directory that went away: its files are kept below
            if old is not None and old.key == key:
                # unchanged: a pending removal is now due (the file stayed as it was)
                files[path] = self._settle(path, key, old, old.load, True) if old.pending else old
                continue
            load = self._reuse(load_file(Path(path), self.child_from))
            fresh_paths.add(path)
            files[path] = self._settle(path, key, old, load, stable=first)
        gone_roots: dict[str, list[Entry]] = {}
        for path, old in self._files.items():
            if path in files:
                continue
            root = next((p for p in missing if Path(path).is_relative_to(p)), None)
            if root is not None:  # not deleted on purpose: the whole path went away
                gone_roots.setdefault(root, []).extend(old.entries)
                files[path] = _File(old.key, old.load, old.entries, kept=root)
                continue
            kept = self._vanished(path, old)
            if kept is not None:
                files[path] = kept
        for root, entries in gone_roots.items():
            if root not in self._missing:
                log.warning(
                    "--manifests %s: no such file or directory; keeping the %s of its files "
                    "until it is back", root, _objects(len(entries)),
                )  # fmt: skip
        self._missing = set(gone_roots)
        # What the last read held goes in batches, off this thread (agent/release.py):
        # dropped here, a 200 MB file's objects were freed in one stretch that kept the
        # health server from answering. What the new state shares stays.
        old_files, self._files = self._files, files
        state = ClusterState()
        duplicates = merge((f.entries for f in files.values()), state)
        for report in duplicates:  # logged when a file involved was read again
            if any(report.where == p or report.where.startswith(f"{p} ") for p in fresh_paths):
                log.warning("%s", report)
        old_values, self._values = (
            self._values,
            {e.ref: e.value for f in files.values() for e in f.entries},
        )
        release(old_files, old_values)
        del old_files, old_values
        self.loads += 1
        changed = False
        for kind, values in (
            ("Node", state.nodes.values()),
            ("Service", state.services.values()),
            ("EndpointSlice", state.slices.values()),
        ):
            changed |= self.store.replace(kind, list(values))
        release(state)
        del state
        return changed

    def _reuse(self, load: FileLoad) -> FileLoad:
        """`load` with each value equal to the one last handed to the store replaced by
        that one: the copy just decoded is freed now, one object at a time, instead of
        being held beside the store's (twice the memory) and freed all at once later."""
        values = self._values
        entries = load.entries
        for index, entry in enumerate(entries):
            old = values.get(entry.ref)
            if old is not None and old is not entry.value and old == entry.value:
                entries[index] = Entry(entry.where, entry.ref, old)
        return load

    @property
    def pending(self) -> bool:
        return any(f.pending for f in self._files.values())

    def _settle(
        self, path: str, key: StatKey, old: _File | None, load: FileLoad, stable: bool
    ) -> _File:
        """What the file contributes after this read (see the module doc)."""
        previous = old.entries if old is not None else []
        fresh = old is None or load is not old.load
        problem = load.problem
        if problem is not None and previous:
            if fresh:
                for report in load.reports:
                    if report is problem:
                        log.warning(
                            "%s; keeping its %s last good %s until it can be read",
                            report, len(previous), "object" if len(previous) == 1 else "objects",
                        )  # fmt: skip
                    else:
                        log.warning("%s", report)
            return _File(key, load, previous)
        entries = list(load.entries)
        defined = {e.ref for e in entries}
        for ref in sorted(load.broken - defined):  # a malformed object keeps its last version
            last = next((e for e in previous if e.ref == ref), None)
            if last is not None:
                entries.append(last)
            elif ref in self._values:
                entries.append(Entry(path, ref, self._values[ref]))
            defined.add(ref)
        gone = [e for e in previous if e.ref not in defined]
        keep = bool(gone and load.unnamed)  # any object gone may be a broken document
        if fresh:
            for report in load.reports:
                if not (keep and report in load.unnamed):
                    log.warning("%s", report)
            if keep:
                more = len(load.unnamed) - 1
                log.warning(
                    "%s%s; keeping the %s the file no longer defines (%s) until it is fixed",
                    load.unnamed[0],
                    f" (and {more} more document(s) naming no object)" if more else "",
                    _objects(len(gone)), _names(gone),
                )  # fmt: skip
        if not gone:
            return _File(key, load, entries)
        if keep:
            return _File(key, load, entries + gone)
        if not stable:
            log.debug("%s: %s gone; removing them if it stays so", path, _objects(len(gone)))
            return _File(key, load, entries + gone, pending=True)
        if load.empty:
            log.warning(
                "%s is empty: removing its %s (%s)", path, _objects(len(gone)), _names(gone)
            )
        else:
            log.warning(
                "%s no longer defines %s: removing %s", path, _objects(len(gone)), _names(gone)
            )
        return _File(key, load, entries)

    def _vanished(self, path: str, old: _File) -> _File | None:
        """A file no longer listed: None when it was deleted (its objects go), else the
        file kept with its last objects."""
        why = None
        if os.path.lexists(path):  # still there, as something else (e.g. a directory)
            why = unreadable(Path(path)) or "no longer a manifest file"
        if why is None:
            if old.entries:
                log.warning(
                    "%s was removed: removing its %s (%s)",
                    path, _objects(len(old.entries)), _names(old.entries),
                )  # fmt: skip
            return None
        if why != old.kept and old.entries:
            log.warning(
                "%s: %s; keeping its %s until it is back",
                path, why, _objects(len(old.entries)),
            )  # fmt: skip
        return _File(old.key, old.load, old.entries, kept=why)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if snapshot(self.paths) != self._seen:
                    log.info("manifests: files changed, reloading")
                    self.load()
                elif self.pending:
                    self.load()
            except Exception:  # never let the watcher die on odd input
                log.exception("manifests: reloading failed; keeping the previous state")
