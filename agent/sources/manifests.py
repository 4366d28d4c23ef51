"""The file source: ordinary Kubernetes YAML/JSON manifests into a ClusterState.

Accepts multi-document YAML, JSON, `kind: List` and typed lists (`ServiceList` from an
API LIST), and directories searched recursively. Every malformed object is reported once
with its file, kind and namespace/name, then skipped; the rest still loads.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

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


def read_documents(path: Path, reports: list[Report]) -> Iterator[tuple[str, Any]]:
    """(where, document) for each document of a file; read errors become reports."""
    try:
        text = path.read_text(encoding="utf-8-sig")  # tolerate a byte-order mark
    except (OSError, UnicodeDecodeError) as err:
        reports.append(Report(str(path), "", f"cannot read: {err}"))
        return
    if path.suffix == ".json":
        try:
            yield str(path), json.loads(text)
        except json.JSONDecodeError as err:
            reports.append(Report(str(path), "", f"invalid JSON: {err}"))
        return
    index = 0
    try:
        for index, document in enumerate(yaml.load_all(text, Loader=YamlLoader), start=1):
            if document is not None:
                yield f"{path} (document {index})", document
    except yaml.YAMLError as err:
        reports.append(
            Report(
                str(path), "", f"invalid YAML after document {index}: {err}; rest of file skipped"
            )
        )


def iter_objects(document: Any, where: str) -> Iterator[tuple[str, Any]]:
    """Flatten `kind: List` and typed lists (`ServiceList`, whose items carry no kind)."""
    kind = document.get("kind") if isinstance(document, Mapping) else None
    if isinstance(kind, str) and kind.endswith("List") and "items" in document:
        items = document.get("items") or []
        item_kind = kind[: -len("List")]
        for i, item in enumerate(items if isinstance(items, list) else [items]):
            if item_kind and isinstance(item, dict) and "kind" not in item:
                item = {"kind": item_kind, "apiVersion": document.get("apiVersion"), **item}
            yield f"{where} items[{i}]", item
    else:
        yield where, document


def load_manifests(
    paths: Iterable[str | os.PathLike[str]], state: ClusterState | None = None
) -> tuple[ClusterState, list[Report]]:
    """Load every Service, EndpointSlice and Node found under `paths` into `state`."""
    state = state if state is not None else ClusterState()
    reports: list[Report] = []
    seen: dict[tuple[str, str | None, str], str] = {}
    files = manifest_files(paths)
    if not files:
        reports.append(Report(", ".join(map(str, paths)), "", "no manifest files found"))
    for path in files:
        if not path.exists():
            reports.append(Report(str(path), "", "no such file or directory"))
            continue
        for where, document in read_documents(path, reports):
            for item_where, obj in iter_objects(document, where):
                decoded = decode_object(obj)
                for warning in decoded.warnings:
                    reports.append(Report(item_where, decoded.ref, warning, error=False))
                if decoded.error is not None:
                    reports.append(Report(item_where, decoded.ref, decoded.error))
                    continue
                if decoded.skipped is not None:
                    log.debug("%s: %s: %s; ignored", item_where, decoded.ref, decoded.skipped)
                    continue
                identity = (decoded.kind, decoded.namespace, decoded.name or "")
                if identity in seen:
                    reports.append(
                        Report(
                            item_where,
                            decoded.ref,
                            f"also defined at {seen[identity]}; this later definition wins",
                            error=False,
                        )
                    )
                seen[identity] = item_where
                value = decoded.value
                if isinstance(value, Service):
                    state.set_service(value)
                elif isinstance(value, EndpointSlice):
                    state.set_slice(value)
                elif isinstance(value, Node):
                    state.set_node(value)
    return state, reports
