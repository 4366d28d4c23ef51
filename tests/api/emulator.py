"""kmock's Kubernetes emulator, completed with what the agent's API traffic depends on.

kmock 0.8 ignores `labelSelector`, `fieldSelector`, `resourceVersion` and the Accept
header: its lists and watches return every object, in full, and every watch replays all
objects as ADDED. `Emulator` keeps kmock's storage, write handling and reaction DSL, and
answers lists and watches itself, as the API server does:

* label selectors (`k`, `!k`, `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`) and
  field selectors on `metadata.name` and `metadata.namespace` (`=`, `==`, `!=`);
* resourceVersions: every write gets the next one; a list carries the current one; a
  watch from a resourceVersion replays the changes after it (`410 Gone` as an ERROR
  event when it is older than the history kept: see `compact`), a watch without one
  sends every matching object as ADDED first;
* a watch with a label selector sees an object that stops matching as DELETED and one
  that starts matching as ADDED (the API server compares the previous and the current
  object);
* `Accept: ...;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1` on lists (and
  `as=PartialObjectMetadata` on watches): only `metadata`, as `PartialObjectMetadata`.

It still ignores `limit` (lists come in one page; the paging tests answer with kmock's
reactions) and `timeoutSeconds`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import attrs
import kmock
from kmock._internal import aiobus, rendering  # the emulator's bus and request types
from kmock._internal.k8s import KubernetesResourceNotFoundError

Obj = dict[str, Any]
Entry = dict[str, Any]  # {"rv", "type", "object", "old"} on the bus and in the history

_REQUIREMENT = re.compile(
    r"\s*(?:(?P<not>!)\s*(?P<absent>[^\s,!=()]+)"
    r"|(?P<key>[^\s,!=()]+)\s*(?:(?P<op>==|!=|=)\s*(?P<value>[^\s,()]*)"
    r"|\s+(?P<set>in|notin)\s*\((?P<values>[^)]*)\))?)\s*(?:,|$)"
)


def label_matcher(selector: str | None) -> Callable[[Mapping[str, str]], bool]:
    """A Kubernetes label selector as a predicate over an object's labels."""
    tests: list[Callable[[Mapping[str, str]], bool]] = []
    text, position = (selector or "").strip(), 0
    while position < len(text):
        match = _REQUIREMENT.match(text, position)
        if match is None or match.end() == position:
            raise ValueError(f"unparsable label selector {selector!r}")
        position = match.end()
        if match["absent"]:
            tests.append(lambda labels, k=match["absent"]: k not in labels)
        elif match["op"] in ("=", "=="):
            tests.append(lambda labels, k=match["key"], v=match["value"]: labels.get(k) == v)
        elif match["op"] == "!=":
            tests.append(lambda labels, k=match["key"], v=match["value"]: labels.get(k) != v)
        elif match["set"]:
            values = {v.strip() for v in match["values"].split(",")}
            if match["set"] == "in":
                tests.append(lambda labels, k=match["key"], vs=values: labels.get(k) in vs)
            else:
                tests.append(lambda labels, k=match["key"], vs=values: labels.get(k) not in vs)
        else:
            tests.append(lambda labels, k=match["key"]: k in labels)
    return lambda labels: all(test(labels) for test in tests)


def field_matcher(selector: str | None) -> Callable[[Obj], bool]:
    """A field selector on metadata.name / metadata.namespace as a predicate."""
    tests: list[Callable[[Obj], bool]] = []
    for part in filter(None, (p.strip() for p in (selector or "").split(","))):
        match = re.fullmatch(r"(metadata\.name|metadata\.namespace)\s*(==|!=|=)\s*(\S*)", part)
        if match is None:
            raise ValueError(f"unsupported field selector {selector!r}")
        field, op, value = match.groups()
        name = field.split(".")[1]
        equal = op != "!="
        tests.append(lambda obj, n=name, v=value, e=equal: (_meta(obj).get(n) == v) == e)
    return lambda obj: all(test(obj) for test in tests)


def _meta(obj: Obj | None) -> Mapping[str, Any]:
    meta = (obj or {}).get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def metadata_only(obj: Obj) -> Obj:
    return {
        "apiVersion": "meta.k8s.io/v1",
        "kind": "PartialObjectMetadata",
        "metadata": obj["metadata"],
    }


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """See the module's docstring."""

    version: int = attrs.field(default=0, init=False)
    history: dict[Any, list[Entry]] = attrs.field(factory=dict, init=False)
    oldest: dict[Any, int] = attrs.field(factory=dict, init=False)  # compacted below this
    current: dict[tuple[Any, str | None, str], Obj] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        emulator = self

        class Buses(dict):  # type: ignore[type-arg]
            def __missing__(self, resource: Any) -> aiobus.Bus[Any]:
                bus = _StampingBus(emulator=emulator, resource=resource)
                self[resource] = bus
                return bus

        self._buses = Buses()

    # --- writes -------------------------------------------------------------------------
    def record(self, resource: Any, event: Obj) -> Entry:
        """Give a write its resourceVersion and keep it in the history."""
        self.version += 1
        obj = dict(event["object"])
        obj["metadata"] = {**_meta(obj), "resourceVersion": str(self.version)}
        key = (resource, _meta(obj).get("namespace"), _meta(obj).get("name"))
        old = self.current.get(key)
        if event["type"] == "DELETED":
            self.current.pop(key, None)
        else:
            self.current[key] = obj
        entry = {"rv": self.version, "type": event["type"], "object": obj, "old": old}
        self.history.setdefault(resource, []).append(entry)
        return entry

    def compact(self) -> None:
        """Forget the history (etcd's compaction), as if writes elsewhere in the cluster
        had moved the resourceVersion on: every earlier resourceVersion answers 410."""
        self.version += 1
        for resource in list(self.history):
            self.history[resource] = []
            self.oldest[resource] = self.version

    # --- reads --------------------------------------------------------------------------
    def _selected(self, request: rendering.Request) -> Callable[[Obj | None], bool]:
        labels = label_matcher(request.params.get("labelSelector"))
        fields = field_matcher(request.params.get("fieldSelector"))
        namespace = request.namespace

        def selected(obj: Obj | None) -> bool:
            if obj is None:
                return False
            meta = _meta(obj)
            if namespace is not None and meta.get("namespace") != namespace:
                return False
            return fields(obj) and labels(meta.get("labels") or {})

        return selected

    def _objects_of(self, resource: Any) -> list[Obj]:
        return [obj for (r, _, _), obj in self.current.items() if r == resource]

    async def _serve_list(self, request: rendering.Request) -> rendering.Payload:
        if request.resource not in self._get_resources():
            raise KubernetesResourceNotFoundError()
        selected = self._selected(request)
        items = [obj for obj in self._objects_of(request.resource) if selected(obj)]
        body: Obj = {"metadata": {"resourceVersion": str(self.version)}, "items": items}
        if "as=PartialObjectMetadataList" in request.headers.get("Accept", ""):
            body = {
                "apiVersion": "meta.k8s.io/v1",
                "kind": "PartialObjectMetadataList",
                "metadata": body["metadata"],
                "items": [metadata_only(obj) for obj in items],
            }
        return body

    async def _serve_watch(self, request: rendering.Request) -> AsyncIterator[rendering.Payload]:
        yield b""  # the headers go out at once
        resource = request.resource
        selected = self._selected(request)
        partial = "as=PartialObjectMetadata" in request.headers.get("Accept", "")
        bus = self._buses[resource]
        marker = await bus.mark()  # before the replay: nothing falls in between
        try:
            since = request.params.get("resourceVersion") or ""
            if since.isdigit():
                if int(since) < self.oldest.get(resource, 0):
                    yield {"type": "ERROR", "object": _gone(since)}
                    return
                replay = [e for e in self.history.get(resource, []) if e["rv"] > int(since)]
                last = int(since)
            else:  # no resourceVersion ("..." from kmock's reactions too): state, then changes
                replay = [
                    {"rv": 0, "type": "ADDED", "object": obj, "old": None}
                    for obj in self._objects_of(resource)
                ]
                last = self.version
            for entry in replay:
                event = _event(entry, selected, partial)
                if event is not None:
                    yield event
            async for entry in bus.stream(since=marker):
                if entry["rv"] <= last:
                    continue
                event = _event(entry, selected, partial)
                if event is not None:
                    yield event
        finally:
            await bus.unmark(marker)


def _event(entry: Entry, selected: Callable[[Obj | None], bool], partial: bool) -> Obj | None:
    """What a watch with this selection sees of a change, if anything."""
    now, before = entry["object"], entry["old"]
    if entry["type"] == "DELETED":
        kind = "DELETED" if selected(before if before is not None else now) else None
    elif selected(now):
        kind = "MODIFIED" if selected(before) else "ADDED"
    else:
        kind = "DELETED" if selected(before) else None
    if kind is None:
        return None
    return {"type": kind, "object": metadata_only(now) if partial else now}


def _gone(since: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "code": 410,
        "reason": "Expired",
        "message": f"too old resource version: {since}",
    }


@attrs.define(kw_only=True, eq=False)
class _StampingBus(aiobus.Bus[Any]):
    """kmock's event bus for one resource: each event kmock publishes gets its
    resourceVersion and goes into the history before it reaches the watches."""

    emulator: Emulator
    resource: Any

    async def put(self, *items: Any) -> None:
        stamped = [
            self.emulator.record(self.resource, item)
            if isinstance(item, dict) and "object" in item and "rv" not in item
            else item
            for item in items
        ]
        await super().put(*stamped)
