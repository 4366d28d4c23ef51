"""The file source: ordinary Kubernetes YAML/JSON manifests into a ClusterState.

Accepts multi-document YAML, JSON, `kind: List` and typed lists (`ServiceList` from an
API LIST), and directories searched recursively. Every malformed object is reported once
with its file, kind and namespace/name, then skipped; the rest still loads.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..gcpause import gc_paused
from ..model.decode import decode_object
from ..model.types import ClusterState, EndpointSlice, Node, Service

log = logging.getLogger(__name__)

try:  # libyaml: an order of magnitude faster than the pure-Python loader
    YamlLoader: type = yaml.CSafeLoader
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    YamlLoader = yaml.SafeLoader

MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True, slots=True)
class Report:
    """A problem with the input. Errors mean the object was skipped."""

    where: str  # file, and the document or item within it
    ref: str  # "Kind namespace/name", or "" for file-level problems
    message: str
    error: bool = True

    def __str__(self) -> str:
        subject = f"{self.where}: {self.ref}" if self.ref else self.where
        outcome = "; skipped" if self.error and self.ref else ""
        return f"{subject}: {self.message}{outcome}"


def manifest_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The files named, and the manifest files under the directories named, in order."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(
                sorted(p for p in path.rglob("*") if p.suffix in MANIFEST_SUFFIXES and p.is_file())
            )
        else:
            files.append(path)
    return files


def read_objects(path: Path, reports: list[Report]) -> Iterator[tuple[str, Any]]:
    """(where, object) for every object of a file, lists flattened; problems reading the
    file become reports (objects before a syntax error are kept)."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # tolerate a byte-order mark
    except (OSError, UnicodeDecodeError) as err:
        reports.append(Report(str(path), "", f"cannot read: {err}"))
        return
    if path.suffix == ".json":
        try:
            yield from _json_objects(text, str(path))
        except (json.JSONDecodeError, _Syntax) as err:
            reports.append(Report(str(path), "", f"invalid JSON: {err}; rest of file skipped"))
        return
    index = 0
    try:
        for index, document in enumerate(yaml.load_all(text, Loader=YamlLoader), start=1):
            if document is not None:
                yield from iter_objects(document, f"{path} (document {index})")
    except yaml.YAMLError as err:
        reports.append(
            Report(
                str(path), "", f"invalid YAML after document {index}: {err}; rest of file skipped"
            )
        )


def iter_objects(document: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Flatten `kind: List` and typed lists (`ServiceList`, whose items carry no kind)."""
    kind = document.get("kind") if isinstance(document, Mapping) else None
    if _is_list_kind(kind) and "items" in document:
        items = document.get("items") or []
        for i, item in enumerate(items if isinstance(items, list) else [items]):
            yield f"{where} items[{i}]", _with_kind(item, document)
    else:
        yield where, document


def _with_kind(item: Any, header: Mapping[str, Any]) -> Any:
    """An item of a typed list (`ServiceList`) with the kind and apiVersion it lacks."""
    kind = header.get("kind")
    if isinstance(item, dict) and "kind" not in item and isinstance(kind, str) and kind != "List":
        return {"kind": kind[: -len("List")], "apiVersion": header.get("apiVersion"), **item}
    return item


class _Syntax(ValueError):
    pass


_JSON = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _json_objects(text: str, where: str) -> Iterator[tuple[str, Any]]:
    """Like `iter_objects(json.loads(text))`, but once a top-level object's kind is known
    to be a list (`"kind"` written before `"items"`, as the API server does), its items
    are decoded and handed on one at a time, so a 10k-Service LIST is never held whole
    (its dicts dominated memory and garbage-collection time). Items met before the
    kind (kubectl sorts keys) wait for it, as `json.loads` would have made them."""
    space = _SPACE.match
    pos = space(text, 0).end()
    if not text.startswith("{", pos):
        value, pos = _JSON.raw_decode(text, pos)
        _expect_end(text, space(text, pos).end())
        yield from iter_objects(value, where)
        return
    header: dict[str, Any] = {}
    streamed = False
    late: list[tuple[int, Any]] = []
    pos = space(text, pos + 1).end()
    while not text.startswith("}", pos):
        if not text.startswith('"', pos):
            raise _Syntax(f"expected a property name at character {pos}")
        key, pos = _JSON.raw_decode(text, pos)
        pos = space(text, pos).end()
        if not text.startswith(":", pos):
            raise _Syntax(f"expected ':' at character {pos}")
        pos = space(text, pos + 1).end()
        if key == "items" and text.startswith("[", pos):
            streamed = _is_list_kind(header.get("kind"))
            pending: list[Any] = []  # items read before the kind said "list"
            pos = space(text, pos + 1).end()
            count = 0
            while not text.startswith("]", pos):
                item, pos = _JSON.raw_decode(text, pos)
                if not streamed:
                    pending.append(item)
                elif isinstance(item, dict) and "kind" not in item and "apiVersion" not in header:
                    late.append((count, item))  # needs the list's apiVersion, still unread
                else:
                    yield f"{where} items[{count}]", _with_kind(item, header)
                count += 1
                pos = _after_comma(text, space(text, pos).end(), "]")
            header[key] = None if streamed else pending
            pos += 1
        else:
            header[key], pos = _JSON.raw_decode(text, pos)
        pos = _after_comma(text, space(text, pos).end(), "}")
    _expect_end(text, space(text, pos + 1).end())
    if not streamed:  # exactly what json.loads would have given
        yield from iter_objects(header, where)
    for index, item in late:
        yield f"{where} items[{index}]", _with_kind(item, header)


def _is_list_kind(kind: object) -> bool:
    return isinstance(kind, str) and kind.endswith("List")


def _after_comma(text: str, pos: int, closing: str) -> int:
    if text.startswith(",", pos):
        pos = _SPACE.match(text, pos + 1).end()  # type: ignore[union-attr]
        if text.startswith(closing, pos):
            raise _Syntax(f"trailing comma before character {pos}")
        return pos
    if not text.startswith(closing, pos):
        raise _Syntax(f"expected ',' or {closing!r} at character {pos}")
    return pos


def _expect_end(text: str, pos: int) -> None:
    if pos != len(text):
        raise _Syntax(f"extra data at character {pos}")


def load_manifests(
    paths: Iterable[str | os.PathLike[str]], state: ClusterState | None = None
) -> tuple[ClusterState, list[Report]]:
    """Load every Service, EndpointSlice and Node found under `paths` into `state`."""
    state = state if state is not None else ClusterState()
    reports: list[Report] = []
    paths = list(paths)
    files = manifest_files(paths)
    if not files:
        reports.append(Report(", ".join(map(str, paths)), "", "no manifest files found"))
    seen: dict[tuple[str, str | None, str], str] = {}
    with gc_paused():
        for path in files:
            if not path.exists():
                reports.append(Report(str(path), "", "no such file or directory"))
                continue
            for where, obj in read_objects(path, reports):
                _load_object(state, obj, where, reports, seen)
    return state, reports


def _load_object(
    state: ClusterState,
    obj: Any,
    where: str,
    reports: list[Report],
    seen: dict[tuple[str, str | None, str], str],
) -> None:
    decoded = decode_object(obj)
    for warning in decoded.warnings:
        reports.append(Report(where, decoded.ref, warning, error=False))
    if decoded.error is not None:
        reports.append(Report(where, decoded.ref, decoded.error))
        return
    if decoded.skipped is not None:
        log.debug("%s: %s: %s; ignored", where, decoded.ref, decoded.skipped)
        return
    identity = (decoded.kind, decoded.namespace, decoded.name or "")
    if identity in seen:
        message = f"also defined at {seen[identity]}; this later definition wins"
        reports.append(Report(where, decoded.ref, message, error=False))
    seen[identity] = where
    value = decoded.value
    if isinstance(value, Service):
        state.set_service(value)
    elif isinstance(value, EndpointSlice):
        state.set_slice(value)
    elif isinstance(value, Node):
        state.set_node(value)
