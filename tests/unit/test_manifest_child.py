"""Large manifest files are parsed in a child process (agent/sources/parse.py) that
streams the objects back: the result is the one parsing in the agent gives, a failing
child is a file that cannot be read (its last good objects are kept), and the items of a
YAML list are handed on one at a time."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pickle
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from agent.sources import manifests
from agent.sources.manifests import (
    FileLoad,
    ParseCount,
    Report,
    load_file,
    manifest_files,
    read_objects,
)
from agent.sources.parse import DEEP, recursion
from agent.sources.watch import ManifestSource
from agent.sync.store import StateStore
from tests.bigmanifest import NODE, write_list

from .test_fuzz_input import FUZZ, file_texts, mutated
from .test_run import free_port

ROOT = Path(__file__).resolve().parents[2]
CORPUS = manifest_files([ROOT / "tests" / "data", ROOT / "examples"])


def summary(load: FileLoad) -> tuple[Any, ...]:
    return (
        load.entries,
        [str(r) for r in load.reports],
        load.documents,
        load.broken,
        [str(r) for r in load.unnamed],
    )


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_corpus_file_reads_the_same_through_the_parser_child(path: Path) -> None:
    assert summary(load_file(path, child_from=0)) == summary(load_file(path, child_from=None))


def same(a: Any, b: Any) -> bool:
    """Deep equality where NaN equals NaN; iterative (values nest thousands deep)."""
    pending = [(a, b)]
    while pending:
        x, y = pending.pop()
        if isinstance(x, dict) and isinstance(y, dict):
            if list(x) != list(y):
                return False
            pending.extend((x[k], y[k]) for k in x)
        elif isinstance(x, list) and isinstance(y, list):
            if len(x) != len(y):
                return False
            pending.extend(zip(x, y, strict=True))
        elif isinstance(x, float) and isinstance(y, float) and math.isnan(x):
            if not math.isnan(y):
                return False
        elif type(x) is not type(y) or x != y:
            return False
    return True


def read(path: Path, stream: bool) -> tuple[list[tuple[str, Any]], list[str], int]:
    reports: list[Report] = []
    count = ParseCount()
    with recursion(DEEP if stream else 0):  # as the parser child allows
        objects = list(read_objects(path, reports, count, stream=stream))
    return objects, [str(r) for r in reports], count.documents


@st.composite
def list_texts(draw: st.DrawFn) -> str:
    """A `kind: List` or typed list in YAML with its keys in any order (kubectl writes
    `items` before `kind`), whole or cut short."""
    items = draw(st.lists(mutated(), max_size=4))
    kind = draw(st.sampled_from(["List", "ServiceList", "Service"]))
    header = [("apiVersion", "v1"), ("kind", kind), ("items", items), ("metadata", {})]
    order = draw(st.permutations(header))
    try:
        text = yaml.dump(dict(order), Dumper=yaml.CSafeDumper, sort_keys=False)
    except (RecursionError, ValueError, yaml.YAMLError):
        text = "[" * 5000
    if draw(st.booleans()):
        text = text[: draw(st.integers(0, len(text)))]
    return text


@FUZZ
@given(text=st.one_of(list_texts(), file_texts(as_json=False)))
def test_streamed_yaml_gives_what_whole_documents_give(text: str | bytes, tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "m.yaml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8", errors="surrogateescape")
    whole, whole_reports, whole_documents = read(path, stream=False)
    streamed, streamed_reports, streamed_documents = read(path, stream=True)
    assert streamed_reports == whole_reports
    assert streamed_documents == whole_documents
    # Items of a list read before a syntax error are handed on, as a JSON list's are;
    # everything of the documents read whole is the same.
    assert len(streamed) >= len(whole)
    assert all(w[0] == s[0] and same(w[1], s[1]) for w, s in zip(whole, streamed, strict=False)), (
        whole,
        streamed,
    )
    if not whole_reports:
        assert len(streamed) == len(whole)


LIST_CUT = """\
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Service
  metadata: {name: first, namespace: default}
  spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
- apiVersion: v1
  kind: Service
  metadata: {name: second, namespace: default
"""


def test_the_items_of_a_list_are_handed_on_before_the_document_ends(tmp_path: Path) -> None:
    path = tmp_path / "cut.yaml"
    path.write_text(LIST_CUT)
    load = load_file(path, child_from=0)
    assert [e.ref for e in load.entries] == ["Service default/first"]
    (problem,) = load.reports
    assert problem.message.startswith("invalid YAML after document 0: ")
    assert problem.message.endswith("; rest of file skipped")
    assert load.problem is problem  # a reload keeps the file's last good objects


KUBECTL_ORDER = """\
apiVersion: v1
items:
- metadata: {name: web, namespace: default}
  spec: {clusterIP: 10.96.0.10, ports: [{port: 80}]}
kind: ServiceList
metadata: {resourceVersion: "7"}
"""


def test_items_written_before_the_kind_wait_for_it(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text(KUBECTL_ORDER)
    ((where, obj),) = read(path, stream=True)[0]
    assert where == f"{path} (document 1) items[0]"
    assert obj["kind"] == "Service"
    assert obj["apiVersion"] == "v1"


def test_a_parser_child_that_fails_keeps_the_last_good_objects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(LIST_CUT.split("- apiVersion: v1\n  kind: Service\n  metadata: {name: sec")[0])
    store = StateStore()
    source = ManifestSource([str(path)], store)
    source.child_from = 0
    source.load()
    assert [s.name for s in store.state.services.values()] == ["first"]
    monkeypatch.setattr(sys, "executable", "/bin/false")
    path.write_text(path.read_text() + "# changed\n")
    with caplog.at_level(logging.WARNING):
        source.load()
    assert [s.name for s in store.state.services.values()] == ["first"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"{path}: the parser process exited with status 1; ")
    assert line.endswith("keeping its 1 last good object until it can be read")


def test_without_an_interpreter_to_start_the_file_is_parsed_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "list.yaml"
    path.write_text(KUBECTL_ORDER)
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with caplog.at_level(logging.WARNING):
        load = load_file(path, child_from=0)
    assert [e.ref for e in load.entries] == ["Service default/web"]
    assert not load.reports
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"{path}: cannot start the parser process (")
    assert line.endswith("); parsing it here")


def test_the_agent_unpickles_plain_values_and_dates_only() -> None:
    plain = ("object", "f.yaml", {"a": [1, 2.5, None, True, b"x", {1, 2}]})
    assert manifests._Values(io.BytesIO(pickle.dumps(plain))).load() == plain
    dated = yaml.safe_load("t: 2026-01-15T10:00:00Z\nd: 2026-01-15")
    assert manifests._Values(io.BytesIO(pickle.dumps(dated))).load() == dated
    with pytest.raises(pickle.UnpicklingError, match="unexpected pathlib"):
        manifests._Values(io.BytesIO(pickle.dumps(Path("x")))).load()


# --- the agent stays live while it loads a large file -------------------------------------

LARGE = 8_000_000  # bytes: ~5k Services with a slice each; parsed in a child process
PROBE_EVERY = 0.1  # seconds
ANSWERED_WITHIN = 1.0  # seconds: the target for every health probe
AFTER_RELOAD = 5.0  # seconds probed after the reload's revision is in


def probe(url: str) -> tuple[float, int | str]:
    """(seconds, status or error) of one GET on a new connection."""
    started = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            status: int | str = response.status
    except urllib.error.HTTPError as err:
        status = err.code
    except OSError as err:
        status = type(err).__name__
    return time.monotonic() - started, status


def revisions(metrics: str) -> float:
    """kbp_nodestate_revisions_total from /metrics."""
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=30) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("kbp_nodestate_revisions_total "):
                return float(line.split()[1])
    return 0.0


@pytest.mark.slow
def test_every_probe_is_answered_within_1s_while_a_large_manifest_loads_and_reloads(
    tmp_path: Path,
) -> None:
    """/healthz and /readyz while the file loads; then the file is replaced by one with
    one more Service (read, decoded and handed over again, the old objects freed) and
    /healthz, /readyz and /metrics are probed until the new revision is in, and a while
    after (the old state is freed then)."""
    path = tmp_path / "manifests" / "large.yaml"
    path.parent.mkdir()
    services = write_list(path, LARGE)
    changed = tmp_path / "changed.yaml"
    assert write_list(changed, path.stat().st_size + 1) == services + 1
    assert path.stat().st_size > manifests.CHILD_FROM
    health, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    agent = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--manifests", str(path.parent), "--node", NODE,
         "--dataplane", "none", "--metrics-bind-address", metrics,
         "--healthz-bind-address", health],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    probes: list[tuple[float, int | str]] = []
    try:
        deadline = time.monotonic() + 20
        while probe(f"http://{health}/healthz")[1] == "URLError":  # not listening yet
            assert agent.poll() is None, agent.communicate()[1]
            assert time.monotonic() < deadline, "the health server never started"
            time.sleep(0.05)
        deadline = time.monotonic() + 300  # the load itself: a bound, not a target
        while True:
            probes.append(probe(f"http://{health}/healthz"))
            took, ready = probe(f"http://{health}/readyz")
            probes.append((took, ready))
            if ready == 200:
                with urllib.request.urlopen(f"http://{metrics}/state", timeout=60) as response:
                    state = json.load(response)
                break
            assert agent.poll() is None, agent.communicate()[1]
            assert time.monotonic() < deadline, "the agent never became ready"
            time.sleep(PROBE_EVERY)
        assert len(state["services"]) == services
        loaded = len(probes)
        before = revisions(metrics)
        os.replace(changed, path)
        deadline = time.monotonic() + 300  # the reload: a bound, not a target
        after: float | None = None  # when the new revision was seen
        while after is None or time.monotonic() < after + AFTER_RELOAD:
            for url in (f"http://{health}/healthz", f"http://{health}/readyz",
                        f"http://{metrics}/metrics"):  # fmt: skip
                probes.append(probe(url))
            if after is None and revisions(metrics) > before:
                after = time.monotonic()
            assert agent.poll() is None, agent.communicate()[1]
            assert time.monotonic() < deadline, "the reload never came through"
            time.sleep(PROBE_EVERY)
    finally:
        agent.terminate()
        _, errors = agent.communicate(timeout=30)
    late = [(round(took, 2), status) for took, status in probes if took > ANSWERED_WITHIN]
    assert not late, f"{len(late)} of {len(probes)} probes over {ANSWERED_WITHIN} s: {late}"
    assert all(status == 200 for _, status in probes[loaded:]), probes[loaded:]
    assert all(isinstance(status, int) for _, status in probes), probes
    assert loaded >= 10, "the load was over before it could be probed"
    assert "Traceback" not in errors, errors[-2000:]
