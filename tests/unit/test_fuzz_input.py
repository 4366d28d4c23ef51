"""Fuzzing the decoder and the file source with hostile input (issue 21).

The property: every input gives either a decoded value or one reported error naming the
object, never an exception; every message is one printable line of bounded length; a
decoded value can be compiled and written out; and a reload never loses an unrelated
change, whatever happens to the file beside it.

Objects start as the valid ones of tests/unit/strategies.py; a few of their values are
then replaced with hostile ones (the wrong type, nesting a thousand levels deep, lone
surrogates, a megabyte string, integers past the interpreter's digit limit, NaN).
Files are written with such objects, with raw bytes, cut short, or turned into FIFOs,
symlink loops, dangling symlinks and directories.

Bounded for `make test` (KBP_FUZZ_EXAMPLES, default 60 per test, 30 reload sequences:
a few seconds);
`make fuzz` runs thousands.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.model.compile import CompileOptions, compile
from agent.model.decode import decode_object
from agent.model.quote import LINE_CHARS
from agent.model.quote import name as printable
from agent.model.types import ClusterState, EndpointSlice, Node, Service
from agent.sources.manifests import load_manifests
from agent.sources.watch import ManifestSource
from agent.sync.store import StateStore

from .strategies import endpoint_slices, nodes, services

EXAMPLES = int(os.environ.get("KBP_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    derandomize=EXAMPLES <= 100,  # the bounded run in `make test` is the same every time
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def nested(depth: int, leaf: Any = "x", as_dict: bool = False) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"k": value} if as_dict else [value]
    return value


HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.just(10**5000),  # repr() refuses integers past 4300 digits
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.sampled_from(["\udc80", "a\ud800b", "line\nbreak", "tab\there", "\x00", "", "None"]),
    st.sampled_from(["x" * (1 << 20), "é" * 100_000]),
    st.builds(nested, st.integers(1, 2000), st.sampled_from(["x", 1, None]), st.booleans()),
    st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
FIELDS = ("apiVersion", "kind", "name", "namespace", "labels", "type", "ports", "port",
          "nodePort", "protocol", "clusterIP", "clusterIPs", "addresses", "conditions",
          "ready", "hints", "forZones", "endpoints", "addressType", "annotations",
          "kubernetes.io/service-name", "status", "spec", "metadata")  # fmt: skip


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON-like value (dict keys and list indexes), 12 levels deep."""
    out = [prefix]
    if len(prefix) >= 12:
        return out
    if isinstance(value, dict):
        for key, item in value.items():
            out += paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += paths(item, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn) -> Any:
    """A valid Service, EndpointSlice or Node with one to three places made hostile."""
    obj = draw(st.one_of(services(), endpoint_slices(), nodes()))
    obj = json.loads(json.dumps(obj))  # a private copy
    for _ in range(draw(st.integers(1, 3))):
        place = draw(st.sampled_from(paths(obj)))
        value = draw(HOSTILE)
        if not place:
            return value
        parent = obj
        for step in place[:-1]:
            parent = parent[step]
        if isinstance(parent, dict) and draw(st.booleans()):
            parent[draw(st.sampled_from(FIELDS))] = value  # set (or add) a field by name
        else:
            parent[place[-1]] = value
    return obj


def assert_one_line(text: str) -> None:
    assert text.isprintable(), text[:200]
    assert len(text) <= LINE_CHARS + 40, f"{len(text)} characters: {text[:200]}"
    text.encode("utf-8")


def name_of(obj: Any) -> str | None:
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) and name else None


@FUZZ
@given(obj=mutated())
def test_every_object_decodes_or_is_reported_naming_it_never_raises(obj: Any) -> None:
    decoded = decode_object(obj)
    outcomes = [decoded.value, decoded.error, decoded.skipped]
    assert sum(o is not None for o in outcomes) == 1, decoded
    for text in (decoded.ref, decoded.error or "", *decoded.warnings):
        assert_one_line(text)
    if decoded.error is not None:
        assert "a bug" not in decoded.error, decoded.error
        name = name_of(obj)
        if name is not None and decoded.kind != "<unknown>":
            assert printable(name) in decoded.ref
    if decoded.value is not None:
        state = ClusterState()
        value = decoded.value
        if isinstance(value, Service):
            state.set_service(value)
        elif isinstance(value, EndpointSlice):
            state.set_slice(value)
        else:
            assert isinstance(value, Node)
            state.set_node(value)
        document = compile(state, "node-a", CompileOptions()).to_dict()
        json.dumps(document, ensure_ascii=False).encode("utf-8")  # writable as output


def dump(obj: Any, as_json: bool) -> str:
    try:
        if as_json:
            return json.dumps(obj)
        return yaml.dump(obj, Dumper=yaml.CSafeDumper)
    except (RecursionError, ValueError, yaml.YAMLError):  # too deep or too big to write
        return "[" * 5000


@st.composite
def file_texts(draw: st.DrawFn, as_json: bool) -> str | bytes:
    """What a manifest file may hold: hostile objects, garbage, or a valid text cut short."""
    objects = draw(st.lists(mutated(), min_size=1, max_size=3))
    if as_json:
        text = dump({"apiVersion": "v1", "kind": "List", "items": objects}, True)
    else:
        text = "---\n".join(dump(o, False) for o in objects)
    kind = draw(st.sampled_from(("whole", "cut", "bytes", "garbage")))
    if kind == "cut":
        return text[: draw(st.integers(0, len(text)))]
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "garbage":
        return draw(st.text(max_size=64))
    return text


@FUZZ
@given(data=st.data())
def test_every_file_loads_or_is_reported_never_raises(data: st.DataObject, tmp_path_factory):
    directory = tmp_path_factory.mktemp("fuzz")
    for i in range(data.draw(st.integers(1, 3))):
        as_json = data.draw(st.booleans())
        content = data.draw(file_texts(as_json))
        path = directory / f"m{i}.{'json' if as_json else 'yaml'}"
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding="utf-8", errors="surrogateescape")
    state, reports = load_manifests([directory])
    for report in reports:
        assert_one_line(str(report))
        assert "a bug" not in report.message
    json.dumps(compile(state, "node-a", CompileOptions()).to_dict()).encode("utf-8")


# --- a reload never loses an unrelated change ---------------------------------------------

OTHER = """\
apiVersion: v1
kind: Service
metadata: {{name: other, namespace: default}}
spec:
  clusterIP: 10.96.0.99
  ports: [{{name: http, port: {port}}}]
"""
GOOD = """\
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  clusterIP: 10.96.0.10
  ports: [{name: http, port: 80}]
"""


def clear(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.is_symlink() or path.exists():
        path.unlink()
    path.with_name("partner.link").unlink(missing_ok=True)


def apply_fault(path: Path, fault: str, content: str | bytes) -> None:
    clear(path)
    if fault == "fifo":
        os.mkfifo(path)
    elif fault == "directory":
        path.mkdir()
        (path / "inner.yaml").write_text(GOOD)
    elif fault == "loop":
        path.with_name("partner.link").symlink_to(path.name)
        path.symlink_to("partner.link")
    elif fault == "dangling":
        path.symlink_to("gone.txt")
    elif fault == "deleted":
        pass
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", errors="surrogateescape")


FAULTS = ("content", "content", "content", "fifo", "directory", "loop", "dangling", "deleted")


@settings(FUZZ, max_examples=max(1, EXAMPLES // 2))  # each example is up to four reloads
@given(data=st.data())
def test_a_reload_never_loses_an_unrelated_change(data: st.DataObject, tmp_path_factory) -> None:
    directory = tmp_path_factory.mktemp("reload")
    target, other = directory / "a.yaml", directory / "b.yaml"
    target.write_text(GOOD)
    store = StateStore()
    source = ManifestSource([str(directory)], store)
    logging.getLogger("agent.sources.watch").setLevel(logging.CRITICAL)  # no flood in -v runs
    try:
        for step in range(data.draw(st.integers(1, 4))):
            port = 8000 + step
            other.write_text(OTHER.format(port=port))
            stamp = 1_700_000_000_000_000_000 + step * 1_000_000_000
            os.utime(other, ns=(stamp, stamp))  # a new status even within one clock tick
            fault = data.draw(st.sampled_from(FAULTS))
            apply_fault(target, fault, data.draw(file_texts(False)))
            source.load()
            with store.lock:
                service = store.state.services.get(("default", "other"))
            assert service is not None and service.ports[0].port == port, (
                f"step {step}: the change to b.yaml was lost (fault on a.yaml: {fault})"
            )
    finally:
        logging.getLogger("agent.sources.watch").setLevel(logging.NOTSET)
        clear(target)


@pytest.mark.parametrize("depth", [990, 1200, 5000])
def test_deep_json_at_and_past_the_recursion_limit_never_raises(depth: int, tmp_path: Path):
    path = tmp_path / "deep.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "Service",
                                "metadata": {"name": "deep"}, "spec": "SPEC"})
                    .replace('"SPEC"', "[" * depth + "]" * depth))  # fmt: skip
    _, reports = load_manifests([path])
    assert len(reports) == 1
    assert_one_line(str(reports[0]))
