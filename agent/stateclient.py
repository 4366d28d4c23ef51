"""Follow a running agent's node-local state revision by revision: the client of
`/state?watch=true` (agent/api/watch.py, docs/nodestate.md "Watching the state").

Standard library only, so a consumer may copy this one file. `follow()` yields a
`Revision` for every revision the agent publishes: the full NodeState document, kept
whole when the stream sends only changes (`changes=True`). It reconnects after an
error or a closed stream (waiting `retry` seconds, doubling up to `max_retry`), asking
for the revision it holds so that nothing is sent twice; an agent that restarted (a new
`instance`) sends its full state again, and the Revision says `restarted`.

    from agent.stateclient import follow
    for rev in follow("http://127.0.0.1:10249"):
        print(rev.revision, len(rev.document["services"]))

or over the agent's unix socket (`--state-socket`): `follow(socket_path="/run/kbp.sock")`.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

CHANGES_KIND = "NodeStateChanges"

log = logging.getLogger(__name__)


@dataclass
class Revision:
    instance: str  # the agent process that published it
    revision: str
    document: dict[str, Any]  # the whole NodeState document at this revision (a new one
    # per Revision; with changes=True the unchanged entries are shared with the last)
    restarted: bool = False  # a new instance since the previous Revision
    changed: list[tuple[str, str]] = field(default_factory=list)  # (ns, name) when a delta


class WatchError(Exception):
    """The agent refused the watch (the message says why), or answered nonsense."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def _entry_key(entry: dict[str, Any]) -> tuple[str, str, str, str, str]:
    """The NodeState's order of entries (namespace, name, port, protocol, IP family)."""
    return (entry["namespace"], entry["name"], entry["port"], entry["protocol"],
            entry.get("ipFamily", ""))  # fmt: skip


def apply_changes(
    document: dict[str, Any], delta: dict[str, Any]
) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """(the NodeState document at delta["revision"], the Services that changed), from
    `document`, the one at delta["base"] (left as it was)."""
    if document.get("revision") != delta.get("base"):
        raise WatchError(
            f"changes from {delta.get('base')} for a state at {document.get('revision')}"
        )
    came = delta["services"]
    changed = {(e["namespace"], e["name"]) for e in came}
    changed |= {(r["namespace"], r["name"]) for r in delta.get("removed", [])}
    kept = [e for e in document["services"] if (e["namespace"], e["name"]) not in changed]
    result = dict(document)
    result["services"] = sorted(kept + came, key=_entry_key)
    for name in ("instance", "revision", "node", "heldRevision", "status"):
        if name in delta:
            result[name] = delta[name]
    return result, sorted(changed)


def _open(
    url: str | None, socket_path: str | None, query: dict[str, str], timeout: float | None
) -> http.client.HTTPResponse:
    target = "/state?" + urllib.parse.urlencode(query)
    if socket_path is not None:
        conn: http.client.HTTPConnection = _UnixConnection(socket_path, timeout)
    else:
        assert url is not None
        parts = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
        conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 10249,
                                          timeout=timeout)  # fmt: skip
    conn.request("GET", target)
    response = conn.getresponse()
    if response.status != 200:
        body = response.read(4096).decode(errors="replace")
        conn.close()
        try:
            reason = json.loads(body).get("error", body)
        except ValueError:
            reason = body
        raise WatchError(f"HTTP {response.status}: {reason}".strip())
    return response


def follow(
    url: str | None = None,
    *,
    socket_path: str | None = None,
    changes: bool = False,
    retry: float = 0.5,
    max_retry: float = 30.0,
    timeout: float | None = None,
    reconnect: bool = True,
    stop: threading.Event | None = None,
) -> Iterator[Revision]:
    """Every revision the agent at `url` (its metrics address) or `socket_path` publishes,
    from the current one on. `timeout`: seconds a read may wait (None: forever; with a
    timeout, a quiet agent counts as a broken stream and is reconnected to).
    `reconnect=False` ends after the first broken stream instead. A refused watch (429:
    too many watchers) is retried like a broken stream. `stop`: ends the iteration once
    set, at the latest after `timeout` (or the wait before reconnecting)."""
    if (url is None) == (socket_path is None):
        raise ValueError("give the agent's url or its socket_path")
    held: dict[str, Any] | None = None
    instance: str | None = None
    wait = retry
    while not (stop is not None and stop.is_set()):
        query = {"watch": "true"}
        if changes:
            query["changes"] = "true"
        if held is not None and instance is not None:
            query["revision"], query["instance"] = held["revision"], instance
        try:
            with _open(url, socket_path, query, timeout) as response:
                while line := response.readline():
                    wait = retry
                    doc = json.loads(line)
                    restarted = instance is not None and doc["instance"] != instance
                    changed: list[tuple[str, str]] = []
                    if doc.get("kind") == CHANGES_KIND:
                        if held is None or restarted:
                            raise WatchError("a change document without the state it changes")
                        held, changed = apply_changes(held, doc)
                    else:
                        held = doc
                    instance = doc["instance"]
                    yield Revision(doc["instance"], held["revision"], held, restarted, changed)
        except (OSError, http.client.HTTPException, ValueError, KeyError, WatchError) as err:
            if not reconnect:
                raise
            log.debug("watch of %s broke (%s); again in %.1f s", url or socket_path, err, wait)
        else:
            if not reconnect:
                return
        if stop is not None:
            stop.wait(wait)
        else:
            time.sleep(wait)
        wait = min(max_retry, wait * 2)
