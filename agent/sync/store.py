"""The ClusterState shared between sources (writers) and the sync loop (reader).

Sources call `upsert`/`delete`/`replace` from their own threads; every call takes the
lock, records only real changes (the model compares previous and current values) and
wakes the listeners when something changed. The sync loop reads under the same lock.
Nothing may be applied before a source has registered and every registered source has
finished its initial list (kpng's "never a partial state"): `synced` says when that is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..model.types import ClusterState, EndpointSlice, Node, Service

Value = Service | EndpointSlice | Node
Listener = Callable[[], None]

KINDS = ("Service", "EndpointSlice", "Node")


def kind_of(value: Value) -> str:
    if isinstance(value, Service):
        return "Service"
    if isinstance(value, EndpointSlice):
        return "EndpointSlice"
    return "Node"


def key_of(value: Value) -> tuple[str, str]:
    """(namespace, name); Nodes have namespace ""."""
    if isinstance(value, Node):
        return ("", value.name)
    return (value.namespace, value.name)


@dataclass
class ChangeCounts:
    """What sources told the store, for metrics (PB-7: events vs real changes)."""

    events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    changes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))


class StateStore:
    def __init__(self) -> None:
        self.state = ClusterState()
        self.lock = threading.RLock()
        self.counts = ChangeCounts()
        self._listeners: list[Listener] = []
        self._sources: dict[str, bool] = {}  # source name → initial list done
        # Trigger times of slice changes not yet programmed (the sync loop takes them).
        self.trigger_times: list[float] = []

    # --- sources --------------------------------------------------------------------
    def register_source(self, name: str) -> None:
        """A source that must finish its initial list before anything is applied."""
        with self.lock:
            self._sources.setdefault(name, False)

    def mark_synced(self, name: str) -> None:
        with self.lock:
            was = self.synced
            self._sources[name] = True
            now = self.synced
        if now and not was:
            self._notify()

    @property
    def synced(self) -> bool:
        """Every registered source has finished its initial list, and there is one: the
        sync loop starts before the sources register, and an empty store it took for
        synced was once programmed (0 services) over a restarted agent's kernel state."""
        with self.lock:
            return bool(self._sources) and all(self._sources.values())

    def upsert(self, value: Value) -> bool:
        with self.lock:
            changed = self._upsert(value)
        if changed:
            self._notify()
        return changed

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        with self.lock:
            changed = self._delete(kind, namespace, name)
        if changed:
            self._notify()
        return changed

    def replace(
        self, kind: str, values: Iterable[Value], keep: Callable[[Value], bool] | None = None
    ) -> bool:
        """Make the store's objects of `kind` exactly `values` (a relist): upsert each,
        delete the ones not listed. `keep` limits the deletion to the objects the
        source owns (e.g. one node's Node object). Wakes listeners once."""
        changed = False
        with self.lock:
            listed = set()
            for value in values:
                listed.add(key_of(value))
                changed |= self._upsert(value)
            for key, value in self._objects(kind).items():
                if key not in listed and (keep is None or keep(value)):
                    changed |= self._delete(kind, *key)
        if changed:
            self._notify()
        return changed

    def _upsert(self, value: Value) -> bool:
        kind = kind_of(value)
        self.counts.events[kind] += 1
        if isinstance(value, Service):
            changed = self.state.set_service(value)
        elif isinstance(value, EndpointSlice):
            changed = self.state.set_slice(value)
            if changed and value.trigger_time is not None:
                self.trigger_times.append(value.trigger_time)
        else:
            changed = self.state.set_node(value)
        self.counts.changes[kind] += changed
        return changed

    def _delete(self, kind: str, namespace: str, name: str) -> bool:
        self.counts.events[kind] += 1
        if kind == "Service":
            changed = self.state.delete_service(namespace, name)
        elif kind == "EndpointSlice":
            changed = self.state.delete_slice(namespace, name)
        else:
            changed = self.state.delete_node(name)
        self.counts.changes[kind] += changed
        return changed

    def _objects(self, kind: str) -> dict[tuple[str, str], Value]:
        if kind == "Service":
            return dict(self.state.services)
        if kind == "EndpointSlice":
            return dict(self.state.slices)
        return {("", name): node for name, node in self.state.nodes.items()}

    # --- readers --------------------------------------------------------------------
    def on_change(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _notify(self) -> None:
        for listener in list(self._listeners):
            listener()
