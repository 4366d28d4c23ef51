"""The file source: ordinary Kubernetes YAML/JSON manifests into a ClusterState.

Accepts multi-document YAML, JSON, `kind: List` and typed lists (`ServiceList` from an
API LIST), and directories searched recursively. Every malformed object is reported once
with its file, kind and namespace/name, then skipped; the rest still loads.
"""

from __future__ import annotations

import codecs
import datetime
import errno
import json
import logging
import os
import pickle
import re
import stat
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import ConstructorError

from ..gcpause import gc_paused
from ..model.decode import Value, decode_object
from ..model.quote import LINE_CHARS, one_line
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
        """One line of bounded length, whatever the input quoted."""
        subject = f"{self.where}: {self.ref}" if self.ref else self.where
        outcome = "; skipped" if self.error and self.ref else ""
        return one_line(f"{subject}: {one_line(self.message, LINE_CHARS // 2)}{outcome}")


def manifest_files(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The paths named that are not directories, and the manifest entries under the
    directories named (searched recursively, each in sorted order).

    Under a directory every entry with a manifest suffix that is not itself a directory
    is listed, whatever it is (a FIFO, a dangling symlink, a symlink loop), so that
    reading it can say what is wrong with it; a symlinked directory is searched once
    (a loop of directory links is not followed round)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(_manifests_under(path))
        else:
            files.append(path)
    return files


def _manifests_under(root: Path) -> list[Path]:
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()
    pending = [root]
    while pending:
        directory = pending.pop()
        try:
            stat = os.stat(directory)
            if (stat.st_dev, stat.st_ino) in seen:
                continue
            seen.add((stat.st_dev, stat.st_ino))
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                is_dir = entry.is_dir()  # follows a symlink
            except OSError:
                is_dir = False
            if is_dir:
                pending.append(Path(entry.path))
            elif os.path.splitext(entry.name)[1] in MANIFEST_SUFFIXES:
                found.append(Path(entry.path))
    return sorted(found)


def unreadable(path: Path) -> str | None:
    """Why `path` cannot be read as a manifest file, or None when it is a regular file
    (never opened here: opening a FIFO would block)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        if os.path.islink(path):
            if err.errno == errno.ELOOP:
                return "cannot read: a symlink loop"
            return f"cannot read: a dangling symlink (to {os.readlink(path)})"
        if err.errno == errno.ENOENT:
            return "no such file or directory"
        return f"cannot read: {err.strerror or err}"
    if stat.S_ISREG(mode):
        return None
    what = (
        "a directory" if stat.S_ISDIR(mode)
        else "a FIFO" if stat.S_ISFIFO(mode)
        else "a socket" if stat.S_ISSOCK(mode)
        else "a device"
    )  # fmt: skip
    return f"cannot read: is {what}, not a regular file"


UTF8_CHUNK = 1 << 22  # bytes checked (or decoded) at a time


def _utf8(data: bytes, want_text: bool) -> str:
    """`data` decoded as UTF-8 (a leading byte-order mark dropped), or only checked when
    the text is not wanted; UnicodeDecodeError when it is not UTF-8. Done in 4 MiB
    steps, since each step holds the GIL: one step for a 200 MB file stalled every other
    thread (the health server's) for 0.4 s on a busy machine."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    view = memoryview(data)
    parts = []
    for start in range(0, len(data), UTF8_CHUNK):
        part = decoder.decode(view[start : start + UTF8_CHUNK], start + UTF8_CHUNK >= len(data))
        if want_text:
            parts.append(part)
    return "".join(parts)


class ParseCount:
    """How many documents (YAML) or values (JSON) a file held."""

    documents = 0


CHILD_FROM = 4 << 20  # bytes: larger files are parsed in a child process (see parse.py)


def read_objects(
    path: Path,
    reports: list[Report],
    count: ParseCount | None = None,
    child_from: int | None = None,
    stream: bool = False,
) -> Iterator[tuple[str, Any]]:
    """(where, object) for every object of a file, lists flattened; problems reading the
    file become reports (objects before a syntax error are kept). A file larger than
    `child_from` bytes is parsed by `parse_in_child`, with the same result. `stream`
    (the parser child's way) hands on the items of a YAML list as they are parsed."""
    count = count if count is not None else ParseCount()
    problem = unreadable(path)
    if problem is not None:
        reports.append(Report(str(path), "", problem))
        return
    if child_from is not None:
        try:
            large = path.stat().st_size > child_from
        except OSError as err:
            reports.append(Report(str(path), "", f"cannot read: {err}"))
            return
        if large:
            yield from parse_in_child(path, reports, count)
            return
    is_json = path.suffix == ".json"
    try:
        data = path.read_bytes()
        text = _utf8(data, want_text=is_json)
    except (OSError, UnicodeDecodeError) as err:
        reports.append(Report(str(path), "", f"cannot read: {err}"))
        return
    if not data.strip():
        return
    if is_json:
        count.documents = 1
        try:
            yield from _json_objects(text, str(path))
        except (ValueError, RecursionError) as err:  # JSONDecodeError, _Syntax, huge ints
            reports.append(
                Report(str(path), "", f"invalid JSON: {_why(err)}; rest of file skipped")
            )
        return
    done = 0  # documents read to their end
    documents = _streamed_yaml if stream else _yaml_documents
    try:
        for index, objects in documents(data, str(path)):
            if objects is not None:
                yield from objects
                count.documents += 1
            done = index
    except (yaml.YAMLError, ValueError, RecursionError) as err:  # ValueError: huge ints, dates
        reports.append(
            Report(
                str(path),
                "",
                f"invalid YAML after document {done}: {_why(err)}; rest of file skipped",
            )
        )


_Documents = Iterator[tuple[int, Iterator[tuple[str, Any]] | None]]


def _yaml_documents(data: bytes, path: str) -> _Documents:
    """(index, its objects) for each document, None for an empty one; each document
    parsed whole."""
    # libyaml reads the bytes as they are (and skips a byte-order mark): handing it a
    # str made it encode the whole file again, holding the GIL.
    for index, document in enumerate(yaml.load_all(data, Loader=YamlLoader), start=1):
        yield (
            index,
            None if document is None else iter_objects(document, f"{path} (document {index})"),
        )


class _EventLoader(YamlLoader, Composer):  # type: ignore[misc, valid-type]
    """libyaml's events, composed into nodes one value at a time (PyYAML's composer)."""


def _streamed_yaml(data: bytes, path: str) -> _Documents:
    """Like `_yaml_documents`, but a document that is a mapping is read key by key and
    the items of its `items` sequence one at a time, so a 200 MB `kind: List` is never
    held whole: as nodes and values it took about 55 times its size. The composer
    recurses about twice per level of nesting, so the caller (the parser child) allows
    that much: libyaml stops at 1,000 levels."""
    loader = _EventLoader(data)
    loader.anchors = {}
    try:
        loader.get_event()  # stream start
        index = 0
        while not loader.check_event(yaml.StreamEndEvent):
            index += 1
            loader.get_event()  # document start
            where = f"{path} (document {index})"
            start = loader.peek_event()
            if isinstance(start, yaml.MappingStartEvent) and start.anchor is start.tag is None:
                yield index, _streamed_mapping(loader, where)
            else:
                document = loader.construct_document(loader.compose_node(None, None))
                yield index, None if document is None else iter_objects(document, where)
            loader.get_event()  # document end
            loader.anchors = {}
    finally:
        loader.dispose()


def _streamed_mapping(loader: Any, where: str) -> Iterator[tuple[str, Any]]:
    """The objects of one top-level mapping, as `iter_objects` would give them. Items
    are handed on as soon as the kind says the mapping is a list (and the apiVersion
    an item without a kind needs is known); until then (kubectl writes `items` before
    `kind`) they wait pickled, in order, a fraction of their size as values."""
    loader.get_event()  # mapping start
    header: dict[Any, Any] = {}
    waiting: list[bytes] = []
    count = 0  # items read
    streamed = False  # the first `items` sequence is being, or was, read
    while not loader.check_event(yaml.MappingEndEvent):
        key_node = loader.compose_node(None, None)
        if key_node.tag == "tag:yaml.org,2002:merge":
            raise ConstructorError(None, None, "a merge key (<<) at the top of a large document",
                                   key_node.start_mark)  # fmt: skip
        key = loader.construct_document(key_node)
        start = loader.peek_event()
        if (
            key == "items"
            and not streamed
            and isinstance(start, yaml.SequenceStartEvent)
            and start.anchor is start.tag is None
        ):
            streamed = True
            loader.get_event()  # sequence start
            while not loader.check_event(yaml.SequenceEndEvent):
                item = loader.construct_document(loader.compose_node(None, None))
                ready = _is_list_kind(header.get("kind")) and (
                    "apiVersion" in header or not isinstance(item, dict) or "kind" in item
                )
                if ready and not waiting:
                    yield f"{where} items[{count}]", _with_kind(item, header)
                else:
                    waiting.append(pickle.dumps(item, pickle.HIGHEST_PROTOCOL))
                count += 1
            loader.get_event()  # sequence end
            value: Any = None  # a place in the key order; filled below when not a list
        else:
            value = loader.construct_document(loader.compose_node(None, None))
        try:
            header[key] = value
        except TypeError:
            raise ConstructorError("while constructing a mapping", None, "found unhashable key",
                                   key_node.start_mark) from None  # fmt: skip
    loader.get_event()  # mapping end
    if not streamed:
        yield from iter_objects(header, where)
    elif _is_list_kind(header.get("kind")):
        for index, blob in enumerate(waiting, start=count - len(waiting)):
            yield f"{where} items[{index}]", _with_kind(pickle.loads(blob), header)
    else:  # an object that has an `items` field
        header["items"] = [pickle.loads(blob) for blob in waiting]
        yield from iter_objects(header, where)


class _Values(pickle.Unpickler):
    """Reads the parser's messages: the builtin types and the datetime values YAML
    makes, nothing else (the child only writes those; anything more is refused)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "datetime" and name in _DATETIME:
            return getattr(datetime, name)
        raise pickle.UnpicklingError(f"unexpected {module}.{name} from the parser")


_DATETIME = frozenset({"date", "datetime", "time", "timedelta", "timezone"})
_AGENT_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding agent/


def parse_in_child(
    path: Path, reports: list[Report], count: ParseCount
) -> Iterator[tuple[str, Any]]:
    """`read_objects` run by a child process (`python -m agent.sources.parse`): parsing
    a large document holds the interpreter lock in long stretches (a 200 MB `kind: List`
    kept the health server from answering for seconds); here this process only
    unpickles one object at a time. Memory stays bounded: the child writes into a pipe,
    so it waits while the caller decodes, and its parse tree goes when it exits. A child
    that fails is a problem reading the file, and the objects it sent before are kept."""
    where = str(path)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_AGENT_ROOT, env.get("PYTHONPATH")]))
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "agent.sources.parse", where],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, bufsize=1 << 16,
        )  # fmt: skip
    except OSError as err:  # no interpreter to run (an embedding): parse it here
        log.warning("%s: cannot start the parser process (%s); parsing it here", where, err)
        yield from read_objects(path, reports, count)
        return
    assert child.stdout is not None
    ended = False
    failure = ""
    try:
        while not ended:
            try:  # an unpickler per message: each pickle numbers its memo from 0
                message = _Values(child.stdout).load()
            except EOFError:
                break
            except (pickle.UnpicklingError, ValueError, TypeError) as err:
                failure = f": unreadable output ({type(err).__name__}: {err})"
                break
            if message[0] == "object":
                yield message[1], message[2]
            elif message[0] == "report":
                reports.append(Report(*message[1:]))
            else:
                count.documents = message[1]
                ended = True
    finally:
        child.stdout.close()
        if not ended:
            child.kill()
        status = child.wait()
    if not ended:
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        text = f"the parser process {how}{failure}; rest of file skipped"
        reports.append(Report(where, "", text))


def _why(err: BaseException) -> str:
    """A parser's complaint on one line (YAML's span several)."""
    text = str(err)
    if not isinstance(err, yaml.YAMLError | json.JSONDecodeError | _Syntax):
        text = f"{type(err).__name__}: {text}"
    return one_line(text, LINE_CHARS // 2)


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


@dataclass(frozen=True, slots=True)
class Entry:
    """One decoded object of a file."""

    where: str  # the file, and the document or item within it
    ref: str  # "Kind namespace/name", as reports name it
    value: Value


@dataclass(slots=True)
class FileLoad:
    """What one file held: its decoded objects in order, and what was wrong."""

    path: Path
    entries: list[Entry] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)
    documents: int = 0  # non-empty YAML documents (or JSON values) found
    broken: set[str] = field(default_factory=set)  # refs of named objects that failed
    unnamed: list[Report] = field(default_factory=list)  # errors naming no object

    @property
    def problem(self) -> Report | None:
        """Why the file could not be read as a whole (then `entries` are those before)."""
        return next((r for r in self.reports if r.error and not r.ref), None)

    @property
    def empty(self) -> bool:
        """Read, and holding no document at all (only space or comments)."""
        return self.documents == 0 and self.problem is None


def load_file(path: Path, child_from: int | None = CHILD_FROM) -> FileLoad:
    """Read and decode one file; never raises for bad input. A file larger than
    `child_from` bytes is parsed in a child process (None: never)."""
    load = FileLoad(path)
    count = ParseCount()
    with gc_paused():
        for where, obj in read_objects(path, load.reports, count, child_from):
            decoded = decode_object(obj)
            for warning in decoded.warnings:
                load.reports.append(Report(where, decoded.ref, warning, error=False))
            if decoded.error is not None:
                report = Report(where, decoded.ref, decoded.error)
                load.reports.append(report)
                if decoded.name is None or decoded.kind == "<unknown>":
                    load.unnamed.append(report)
                else:
                    load.broken.add(decoded.ref)
            elif decoded.skipped is not None:
                log.debug("%s: %s: %s; ignored", where, decoded.ref, decoded.skipped)
            elif decoded.value is not None:
                load.entries.append(Entry(where, decoded.ref, decoded.value))
    load.documents = count.documents
    return load


def merge(files: Iterable[Iterable[Entry]], state: ClusterState) -> list[Report]:
    """Put the entries into `state` in order (a later definition of an object wins) and
    return a warning for each object defined more than once."""
    reports: list[Report] = []
    seen: dict[tuple[str, str | None, str], str] = {}
    with gc_paused():
        for entries in files:
            for entry in entries:
                value = entry.value
                identity = (type(value).__name__, *key_of(value))
                if identity in seen:
                    message = f"also defined at {seen[identity]}; this later definition wins"
                    reports.append(Report(entry.where, entry.ref, message, error=False))
                seen[identity] = entry.where
                if isinstance(value, Service):
                    state.set_service(value)
                elif isinstance(value, EndpointSlice):
                    state.set_slice(value)
                else:
                    state.set_node(value)
    return reports


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
    loads = [load_file(path) for path in files]
    for load in loads:
        reports.extend(load.reports)
    reports.extend(merge((load.entries for load in loads), state))
    return state, reports


def key_of(value: Value) -> tuple[str, str]:
    """(namespace, name); "" namespace for a Node."""
    if isinstance(value, Node):
        return ("", value.name)
    return (value.namespace, value.name)
