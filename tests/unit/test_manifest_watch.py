"""The file source over time (agent/sources/watch.py): changed files are re-read and the
store gets the new full state; bad input never loses the last good state."""

from __future__ import annotations

import os
import time
from pathlib import Path

from agent.sources.watch import ManifestSource
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


def test_changed_added_and_removed_files_reach_the_store(tmp_path: Path) -> None:
    web = tmp_path / "web.yaml"
    write(web, SERVICE.format(name="web", ip="10.96.0.10", port=80))
    store = StateStore()
    source = ManifestSource([str(tmp_path)], store, interval=0.05)
    source.start()
    try:
        assert ports(store) == {"web": 80}
        write(web, SERVICE.format(name="web", ip="10.96.0.10", port=8080))
        wait_until(lambda: ports(store) == {"web": 8080})
        write(tmp_path / "api.yaml", SERVICE.format(name="api", ip="10.96.0.11", port=443))
        wait_until(lambda: ports(store) == {"web": 8080, "api": 443})
        (tmp_path / "api.yaml").unlink()
        wait_until(lambda: ports(store) == {"web": 8080})
    finally:
        source.stop()


def test_malformed_object_keeps_its_last_good_version(tmp_path: Path) -> None:
    web = tmp_path / "web.yaml"
    write(web, SERVICE.format(name="web", ip="10.96.0.10", port=80)
          + "---\n" + SERVICE.format(name="api", ip="10.96.0.11", port=443))  # fmt: skip
    store = StateStore()
    source = ManifestSource([str(tmp_path)], store, interval=0.05)
    source.start()
    try:
        loads = source.loads
        write(web, SERVICE.format(name="web", ip="10.96.0.10", port=70000)  # out of range
              + "---\n" + SERVICE.format(name="api", ip="10.96.0.11", port=444))  # fmt: skip
        wait_until(lambda: source.loads > loads)
        assert ports(store) == {"web": 80, "api": 444}
    finally:
        source.stop()


def test_unreadable_file_keeps_the_whole_previous_state(tmp_path: Path) -> None:
    web = tmp_path / "web.yaml"
    write(web, SERVICE.format(name="web", ip="10.96.0.10", port=80))
    store = StateStore()
    source = ManifestSource([str(tmp_path)], store, interval=0.05)
    source.start()
    try:
        write(web, "kind: Service\nmetadata: {name: [unclosed\n")
        time.sleep(0.3)
        assert ports(store) == {"web": 80}
        write(web, SERVICE.format(name="web", ip="10.96.0.10", port=81))
        wait_until(lambda: ports(store) == {"web": 81})
    finally:
        source.stop()
