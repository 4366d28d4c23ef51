"""`GET /state?watch=true`: the node-local state as a stream of revisions, for programs
outside the agent (kpng's local API; docs/nodestate.md, "Watching the state").

Each line of the stream (`application/x-ndjson`) is one JSON document:

* a full one, `kind: NodeState`: what `GET /state` renders (node, revision,
  heldRevision, status, services), on one line, with `instance` added: this agent
  process's id, new at every start;
* with `changes=true`, after the first full one, `kind: NodeStateChanges`: the
  revision, the `base` revision it follows, the entries of every Service that changed
  since `base` (`services`, all of such a Service's entries) and the Services that have
  none any more (`removed`). A consumer that holds `base` replaces the entries of those
  Services and has the revision; the changes of several revisions a slow reader skipped
  come as one document. Where they cannot be composed (an agent that recompiled
  everything, more than HISTORY revisions back), a full document comes instead.

The first line comes at once, unless the client says it holds the current revision of
this instance (`revision=R&instance=I`); then one line per new revision (with
`changes=true`, a client that says it holds a revision gets changes from it at once). Nothing is
queued per watcher: a watcher is written to only while its client has taken what it was
sent (the socket's buffer drained, `StreamSink.writable`); when it can take more it gets
the latest revision, however many it missed. A line is handed to the socket a chunk at
a time, and only while it takes them, out of the one rendered copy every watcher shares:
a watcher's own memory is a chunk or two of socket buffer, whatever the size of the
state or the rate of revisions (a watcher behind keeps the revision it is in the middle
of alive, not a copy of it). Each line is
rendered once per revision for every watcher (on one thread of its own, never on the
HTTP event loop), and compressed once when clients ask for gzip: each line is then its
own gzip member (a gzip stream may be a sequence of members; `gzip.decompress` and
`curl --compressed` read them as one).
"""

from __future__ import annotations

import collections
import concurrent.futures
import gzip
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from ..model.nodestate import API_VERSION, KIND, NodeState, ServiceEntry, entries_of
from .serving import Request, Response, Stream, StreamSink, json_response

log = logging.getLogger(__name__)

CHANGES_KIND = "NodeStateChanges"
HISTORY = 256  # consecutive revisions whose changed Services are remembered
RENDERED = 16  # lines kept rendered (the latest full one, recent change documents)
CHUNK = 1 << 16  # bytes handed to a watcher's socket at a time
DEFAULT_MAX_WATCHERS = 128

_Status = Callable[[], tuple[str | None, dict[str, Any]]]  # (heldRevision, status)


def _compact(document: Any) -> str:
    return json.dumps(document, ensure_ascii=False, separators=(",", ":"))


class StateHub:
    """The latest NodeState, the changes between recent revisions and the watchers; the
    sync loop publishes (any thread), the watchers read on the HTTP loop. Thread-safe."""

    def __init__(self, status: _Status, max_watchers: int = DEFAULT_MAX_WATCHERS) -> None:
        """`status`: the `heldRevision` and `status` fields of `/state` as of now."""
        self.instance = uuid.uuid4().hex
        self.max_watchers = max_watchers
        self._status = status
        self._lock = threading.Lock()
        self._state: NodeState | None = None
        # (base, revision, changed Service keys) of consecutive published revisions
        self._links: collections.deque[tuple[str, str, frozenset[tuple[str, str]]]] = (
            collections.deque(maxlen=HISTORY)
        )
        self._watchers: set[_Watcher] = set()
        self._reserved = 0
        self._lines: collections.OrderedDict[
            tuple[str | None, str, bool], concurrent.futures.Future[bytes]
        ] = collections.OrderedDict()
        self._renderer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kbp-watch render"
        )

    # --- the publisher ---------------------------------------------------------------
    def publish(self, state: NodeState) -> None:
        """A new NodeState (the same revision again changes nothing)."""
        with self._lock:
            previous = self._state
            if previous is not None and previous.revision == state.revision:
                return
            changes = state.changes
            if previous is not None and changes is not None and changes.base == previous.revision:
                self._links.append((previous.revision, state.revision, changes.services))
            else:
                self._links.clear()  # nothing before this revision composes with it
            self._state = state
            watchers = list(self._watchers)
        for watcher in watchers:
            watcher.sink.call_soon(watcher.kick)

    @property
    def revision(self) -> str | None:
        with self._lock:
            return self._state.revision if self._state is not None else None

    @property
    def watchers(self) -> int:
        with self._lock:
            return len(self._watchers)

    def held(self) -> tuple[int, int]:
        """(lines kept rendered, revisions whose changes are remembered): what the hub
        holds besides the latest state, bounded by RENDERED and HISTORY."""
        with self._lock:
            return len(self._lines), len(self._links)

    def close(self) -> None:
        """Stop the render thread (after the servers that use the hub closed)."""
        self._renderer.shutdown(wait=True, cancel_futures=True)

    # --- the HTTP handler ---------------------------------------------------------------
    def handle(self, request: Request) -> Response | Stream:
        """`/state?watch=true[&revision=R&instance=I][&changes=true]`."""
        held, instance = request.param("revision"), request.param("instance")
        changes = request.param("changes", "false") == "true"
        with self._lock:
            if len(self._watchers) + self._reserved >= self.max_watchers:
                return json_response(
                    429,
                    {"error": f"{self.max_watchers} watchers already (--state-watchers)"},
                    {"Retry-After": "5"},
                )
            self._reserved += 1
        gzipped = "gzip" in request.header("Accept-Encoding")
        sent = held if held and instance == self.instance else None
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                with self._lock:
                    self._reserved -= 1

        def start(sink: StreamSink) -> Callable[[], None]:
            watcher = _Watcher(self, sink, sent, changes, gzipped)
            with self._lock:
                self._watchers.add(watcher)
            release()
            watcher.kick()
            return lambda: self._forget(watcher)

        headers = {"X-Kbp-Instance": self.instance}
        if gzipped:
            headers["Content-Encoding"] = "gzip"
        return Stream(200, start, "application/x-ndjson", headers, abandoned=release)

    def _forget(self, watcher: _Watcher) -> None:
        watcher.closed = True
        with self._lock:
            self._watchers.discard(watcher)

    # --- rendering ---------------------------------------------------------------------
    def line(self, base: str | None, gzipped: bool) -> tuple[str, concurrent.futures.Future[bytes]]:
        """(revision, the line to send a watcher that holds `base`: the changes since it,
        or the full document when `base` is None or cannot be composed from)."""
        with self._lock:
            state = self._state
            assert state is not None
            keys = self._changed_since(base, state.revision) if base is not None else None
            key = (base if keys is not None else None, state.revision, gzipped)
            future = self._lines.get(key)
            if future is None:
                future = self._renderer.submit(self._render, state, base, keys, gzipped)
                self._lines[key] = future
                while len(self._lines) > RENDERED:
                    self._lines.popitem(last=False)
            else:
                self._lines.move_to_end(key)
            return state.revision, future

    def _changed_since(self, base: str, revision: str) -> set[tuple[str, str]] | None:
        keys: set[tuple[str, str]] = set()
        at = revision
        for link_base, link_revision, changed in reversed(self._links):
            if link_revision != at:
                return None
            keys |= changed
            at = link_base
            if at == base:
                return keys
        return None

    def _render(
        self,
        state: NodeState,
        base: str | None,
        keys: set[tuple[str, str]] | None,
        gzipped: bool,
    ) -> bytes:
        held, status = self._status()
        head: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": KIND if keys is None else CHANGES_KIND,
            "instance": self.instance,
            "node": state.node.to_dict(),
            "revision": state.revision,
        }
        if keys is None:
            entries: Iterable[ServiceEntry] = state.services
        else:
            head["base"] = base
            entries = entries_of(state.services, sorted(keys))
        head["heldRevision"] = held
        head["status"] = status
        services = [e.to_dict() for e in entries]
        head["services"] = services
        if keys is not None:
            present = {(e["namespace"], e["name"]) for e in services}
            head["removed"] = [{"namespace": ns, "name": name}
                               for ns, name in sorted(keys - present)]  # fmt: skip
        data = (_compact(head) + "\n").encode()
        return gzip.compress(data, compresslevel=6, mtime=0) if gzipped else data


class _Watcher:
    """One watching connection; every method runs on the HTTP event loop."""

    def __init__(
        self, hub: StateHub, sink: StreamSink, sent: str | None, changes: bool, gzipped: bool
    ) -> None:
        self.hub = hub
        self.sink = sink
        self.sent = sent  # the revision the client holds (None: nothing of this instance)
        self.changes = changes
        self.gzipped = gzipped
        self.full_sent = sent is not None  # a client that holds a revision holds it whole
        self.closed = False
        self.waiting = False  # a render is under way for it
        self.sending: memoryview | None = None  # the rest of the line being sent
        sink.on_writable = self.kick

    def kick(self) -> None:
        """Send the latest revision if the client does not hold it and can take it."""
        if self.closed or self.waiting or not self.sink.writable:
            return
        if self.sending is not None and not self._send():
            return
        latest = self.hub.revision
        if latest is None or latest == self.sent:
            return
        base = self.sent if self.changes and self.full_sent else None
        revision, future = self.hub.line(base, self.gzipped)
        if not future.done():
            self.waiting = True
            future.add_done_callback(lambda _done: self.sink.call_soon(self._rendered))
            return
        try:
            data = future.result()
        except Exception:
            log.exception("rendering revision %s for a watcher failed", revision[:19])
            self.sink.close()
            return
        self.sent, self.full_sent = revision, True
        self.sending = memoryview(data)
        if self._send() and self.hub.revision != revision:
            self.sink.call_soon(self.kick)

    def _send(self) -> bool:
        """Hand the line being sent to the socket while it takes it; True once all of it
        is (the socket's own buffer then holds at most a chunk more than it takes)."""
        assert self.sending is not None
        while self.sending and self.sink.writable:
            self.sink.write(self.sending[:CHUNK])
            self.sending = self.sending[CHUNK:]
        if self.sending:
            return False  # on_writable calls kick, which goes on
        self.sending = None
        return True

    def _rendered(self) -> None:
        self.waiting = False
        self.kick()
