"""The file source over time (agent/sources/watch.py): changed files are re-read and the
store gets the new full state; bad input never loses the last good state."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.sources import watch
from agent.sources.watch import ManifestPathError, ManifestSource
from agent.sync.store import StateStore

SERVICE = """\
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  clusterIP: {ip}
  clusterIPs: [{ip}]
  ports: [{{name: http, port: {port}, protocol: TCP}}]
"""


def write(path: Path, text: str) -> None:
    path.write_text(text)
    # mtime granularity: make sure the watcher sees a different (mtime, size)
    stamp = time.time_ns() + 1_000_000_000
    os.utime(path, ns=(stamp, stamp))


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def ports(store: StateStore) -> dict[str, int]:
    with store.lock:
        return {s.name: s.ports[0].port for s in store.state.services.values()}


@contextlib.contextmanager
def watching(web: Path, text: str) -> Iterator[tuple[StateStore, ManifestSource]]:
    """`text` written to `web`, and a source watching its directory every 50 ms."""
    write(web, text)
    store = StateStore()
    source = ManifestSource([str(web.parent)], store, interval=0.05)
    source.start()
    try:
        yield store, source
    finally:
        source.stop()


def test_changed_added_and_removed_files_reach_the_store(tmp_path: Path) -> None:
    web = tmp_path / "web.yaml"
    with watching(web, SERVICE.format(name="web", ip="10.96.0.10", port=80)) as (store, _):
        assert ports(store) == {"web": 80}
        write(web, SERVICE.format(name="web", ip="10.96.0.10", port=8080))
        wait_until(lambda: ports(store) == {"web": 8080})
        write(tmp_path / "api.yaml", SERVICE.format(name="api", ip="10.96.0.11", port=443))
        wait_until(lambda: ports(store) == {"web": 8080, "api": 443})
        (tmp_path / "api.yaml").unlink()
        wait_until(lambda: ports(store) == {"web": 8080})


def test_malformed_object_keeps_its_last_good_version(tmp_path: Path) -> None:
    web = tmp_path / "web.yaml"
    with watching(web, TWO) as (store, source):  # web port 80, api port 443
        loads = source.loads
        write(web, SERVICE.format(name="web", ip="10.96.0.10", port=70000)  # out of range
              + "---\n" + SERVICE.format(name="api", ip="10.96.0.11", port=444))  # fmt: skip
        wait_until(lambda: source.loads > loads)
        assert ports(store) == {"web": 80, "api": 444}


def test_unreadable_file_keeps_the_whole_previous_state(tmp_path: Path) -> None:
    web = tmp_path / "web.yaml"
    with watching(web, SERVICE.format(name="web", ip="10.96.0.10", port=80)) as (store, _):
        write(web, "kind: Service\nmetadata: {name: [unclosed\n")
        time.sleep(0.3)
        assert ports(store) == {"web": 80}
        write(web, SERVICE.format(name="web", ip="10.96.0.10", port=81))
        wait_until(lambda: ports(store) == {"web": 81})


# --- faults in the file source: one line each, last good objects kept, nothing lost --------
#
# a.yaml defines Services web and api; b.yaml defines Service other. Each case breaks
# a.yaml in one way while b.yaml changes in the same reload: the change to b.yaml must
# always arrive, and a.yaml's objects stay or go as the case says, with exactly one log
# line naming a.yaml.

TWO = (
    SERVICE.format(name="web", ip="10.96.0.10", port=80)
    + "---\n"
    + SERVICE.format(name="api", ip="10.96.0.11", port=443)
)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        path.rmdir()
    elif path.is_symlink() or path.exists():
        path.unlink()


def symlink_loop(path: Path) -> None:
    remove(path)
    partner = path.with_name("partner.link")
    partner.symlink_to(path.name)
    path.symlink_to(partner.name)


def dangling(path: Path) -> None:
    remove(path)
    path.symlink_to("gone.txt")


def directory(path: Path) -> None:
    remove(path)
    path.mkdir()


def fifo(path: Path) -> None:
    remove(path)
    os.mkfifo(path)


def content(text: str | bytes):
    def act(path: Path) -> None:
        remove(path)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            write(path, text)

    return act


@dataclass(frozen=True)
class Fault:
    id: str
    act: Callable[[Path], None]
    kept: bool  # a.yaml's objects stay (else: removed)
    line: str  # a substring of the one line naming a.yaml


FAULTS = [
    Fault("a manifest that becomes a symlink loop keeps its objects",
          symlink_loop, True, "cannot read: a symlink loop; keeping its 2 last good objects"),
    Fault("a manifest that becomes a dangling symlink keeps its objects",
          dangling, True, "a dangling symlink (to gone.txt); keeping its 2 last good objects"),
    Fault("a manifest that becomes a directory keeps its objects",
          directory, True, "is a directory, not a regular file; keeping its 2 objects"),
    Fault("a manifest that becomes a FIFO keeps its objects and is never opened",
          fifo, True, "is a FIFO, not a regular file; keeping its 2 last good objects"),
    Fault("a manifest replaced by a YAML list keeps its objects",
          content("- just\n- a list\n"), True,
          "expected an object, got list; skipped; keeping the 2 objects the file no longer"),
    Fault("a manifest replaced by a YAML scalar keeps its objects",
          content("hello\n"), True, "expected an object, got str; skipped; keeping the 2 objects"),
    Fault("a manifest replaced by invalid YAML keeps its objects",
          content("kind: Service\nmetadata: {name: [unclosed\n"), True,
          "keeping its 2 last good objects until it can be read"),
    Fault("a manifest that is no longer UTF-8 keeps its objects",
          content(b"# caf\xe9\n" + TWO.encode()), True, "cannot read: 'utf-8' codec"),
    Fault("an emptied manifest removes its objects and says so",
          content(""), False,
          "a.yaml is empty: removing its 2 objects (Service default/web, Service default/api)"),
    Fault("a manifest cut at a document boundary removes what it lost and names it",
          content(SERVICE.format(name="web", ip="10.96.0.10", port=80)), False,
          "a.yaml no longer defines 1 object: removing Service default/api"),
    Fault("a deleted manifest removes its objects and says so",
          remove, False, "a.yaml was removed: removing its 2 objects"),
]  # fmt: skip


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_a_broken_manifest_gets_one_line_and_loses_no_other_change(
    fault: Fault, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    write(a, TWO)
    write(b, SERVICE.format(name="other", ip="10.96.0.12", port=8080))
    store = StateStore()
    source = ManifestSource([str(tmp_path)], store)
    source.start()  # the thread's interval (1 s) is longer than this test's loads
    try:
        assert ports(store) == {"web": 80, "api": 443, "other": 8080}
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="agent.sources.watch"):
            fault.act(a)
            write(b, SERVICE.format(name="other", ip="10.96.0.12", port=9090))
            source.load()
            assert ports(store)["other"] == 9090, "the change to b.yaml was lost"
            # Nothing is removed from a file that may be half written ...
            if not fault.id.startswith("a deleted"):
                assert {"web", "api"} <= set(ports(store))
            source.load()  # ... one interval later, with the file unchanged, it is.
        expected = {"other": 9090} if not fault.kept else {"web": 80, "api": 443, "other": 9090}
        if "cut at" in fault.id:
            expected = {"web": 80, "other": 9090}
        assert ports(store) == expected
        lines = [r.getMessage() for r in caplog.records if "a.yaml" in r.getMessage()]
        assert len(lines) == 1, lines
        assert fault.line in lines[0]
        assert "\n" not in lines[0]
    finally:
        source.stop()
        remove(a)


def test_a_missing_manifests_path_fails_to_start(tmp_path: Path) -> None:
    store = StateStore()
    with pytest.raises(ManifestPathError, match=r"--manifests .*nowhere: no such file"):
        ManifestSource([str(tmp_path / "nowhere")], store)  # before the sync loop runs
    assert not store.synced  # never registered: nothing can be applied


def test_only_changed_files_are_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    write(tmp_path / "a.yaml", TWO)
    write(tmp_path / "b.yaml", SERVICE.format(name="other", ip="10.96.0.12", port=8080))
    source = ManifestSource([str(tmp_path)], StateStore())
    source.load()
    read: list[str] = []
    real = watch.load_file
    monkeypatch.setattr(
        watch, "load_file", lambda path, *rest: read.append(path.name) or real(path, *rest)
    )
    write(tmp_path / "b.yaml", SERVICE.format(name="other", ip="10.96.0.12", port=9090))
    source.load()
    assert read == ["b.yaml"]


def test_a_named_directory_that_disappears_keeps_its_objects(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    named = tmp_path / "manifests"
    named.mkdir()
    write(named / "a.yaml", TWO)
    store = StateStore()
    source = ManifestSource([f"{named}/"], store)  # the trailing slash as a shell adds it
    source.load()
    (named / "a.yaml").unlink()
    named.rmdir()
    with caplog.at_level(logging.WARNING, logger="agent.sources.watch"):
        source.load()
        source.load()
    assert ports(store) == {"web": 80, "api": 443}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert (
        "no such file or directory; keeping the 2 objects of its files until it is back"
        in (lines[0])
    )
