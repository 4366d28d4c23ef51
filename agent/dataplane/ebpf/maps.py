"""The Python face of the maps a plan fills: their key and value types, `MapSizes`,
`KernelContent`, the ordered `Writes` from one content to the next, `diff` and the
capacity checks. Pure Python: no kernel, bcc or netlink here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

from ...config import MAP_SIZES
from ..base import DataplaneError

if TYPE_CHECKING:
    from .translate import ContentIndex

MAPS = ("services", "slots", "backends")  # the maps a plan fills, in capacity-check order

SortKey = tuple[str, str, str, str, str]
SetContent = tuple[int, ...]


# --- what the maps hold ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FrontendKey:
    """struct kbp_frontend_key: addr is canonical IP text (`ipaddress` compressed form)."""

    addr: str
    port: int
    proto: int  # IPPROTO_TCP 6 / IPPROTO_UDP 17 / IPPROTO_SCTP 132
    family: int  # KBP_FAMILY_IPV4 / KBP_FAMILY_IPV6


@dataclass(frozen=True, slots=True)
class ServiceValue:
    """struct kbp_service."""

    service_id: int
    flags: int  # KBP_SVC_F_*
    set_id: int  # 0 with count 0: the empty set
    count: int
    internal_set_id: int
    internal_count: int
    affinity_timeout: int  # seconds; 0 without KBP_SVC_F_AFFINITY
    type: int  # KBP_FE_*


@dataclass(frozen=True, slots=True)
class BackendValue:
    """struct kbp_backend."""

    addr: str
    port: int
    family: int
    flags: int  # KBP_BE_F_*
    service_id: int


@dataclass(frozen=True, slots=True)
class MapSizes:
    """max_entries of the sized maps (defaults: agent.config.MAP_SIZES, one field per
    entry); `services` also bounds service ids, which index the per-CPU counters array."""

    services: int = MAP_SIZES["services"].default
    slots: int = MAP_SIZES["slots"].default
    backends: int = MAP_SIZES["backends"].default
    ct: int = MAP_SIZES["ct"].default
    affinity: int = MAP_SIZES["affinity"].default
    src_ranges: int = MAP_SIZES["src_ranges"].default
    sock_rev: int = MAP_SIZES["sock_rev"].default


@dataclass(slots=True)
class KernelContent:
    """What the services, slots and backends maps hold (or should hold).

    Only this module changes it, through `plan_change`, which also keeps `_index`, how
    the content was built, current: the next sync then translates only the entries that
    changed. Content decoded from the kernel has no index and takes the full path. Not
    hashable (it holds dicts).
    """

    services: dict[FrontendKey, ServiceValue] = field(default_factory=dict)
    slots: dict[int, SetContent] = field(default_factory=dict)  # set id → backend ids
    backends: dict[int, BackendValue] = field(default_factory=dict)
    _index: ContentIndex | None = field(default=None, init=False, compare=False, repr=False)

    def slot_count(self) -> int:
        """Slots over all sets (entries of the slots map)."""
        if self._index is not None:
            return self._index.slot_total
        return sum(map(len, self.slots.values()))


# --- errors ----------------------------------------------------------------------------


class CapacityError(DataplaneError):
    """A map is too small for the NodeState; nothing was written."""

    def __init__(self, map: str, needed: int, size: int) -> None:
        self.map = map
        self.needed = needed
        self.size = size
        super().__init__(
            "capacity",
            f"map kbp_{map} needs {needed} entries but holds {size} "
            f"({needed - size} short); raise it with --map-size-{map}",
        )


# --- the writes from one content to the next -------------------------------------------


@dataclass(frozen=True, slots=True)
class Writes:
    """Map writes in apply order. Applied phase by phase, every intermediate kernel state
    is consistent for packets: a service only ever points at complete sets, a slot at
    an existing backend, and a ranged frontend has its source ranges.

    0. `config`, `ports`: kbp_config and the kbp_ports bits of new backend and frontend
       ports (the dataplane adds these, as raw (key, value) pairs, before writing);
    1. `backends_to_upsert`: new backends (and flag changes of live ones);
    2. `sets_to_write`: every slot of the new sets (never a live set: ids are fresh);
    3. `ranges_to_add`: kbp_src_ranges entries the new services need (dataplane);
    4. `counters_reset`: zero the per-CPU counters of newly used service ids;
    5. `services_to_upsert`: the flip, one atomic element per frontend;
    6. `frontends_to_delete`;
    7. `sets_to_delete`: set id → its slot count (keys (set_id, 0..count-1));
    8. `backends_to_delete`;
    9. `ranges_to_delete`: kbp_src_ranges entries no service uses any more (dataplane).
    """

    counters_reset: list[int] = field(default_factory=list)
    backends_to_upsert: dict[int, BackendValue] = field(default_factory=dict)
    sets_to_write: dict[int, SetContent] = field(default_factory=dict)
    services_to_upsert: dict[FrontendKey, ServiceValue] = field(default_factory=dict)
    frontends_to_delete: list[FrontendKey] = field(default_factory=list)
    sets_to_delete: dict[int, int] = field(default_factory=dict)
    backends_to_delete: list[int] = field(default_factory=list)
    # Of backends_to_upsert, the live backends whose value (flags) changed: the slots of
    # live sets carry a copy of each backend's value (struct kbp_slot) to rewrite.
    backends_changed: set[int] = field(default_factory=set)
    config: list[tuple[bytes, bytes]] = field(default_factory=list)
    ports: list[tuple[bytes, bytes]] = field(default_factory=list)
    ranges_to_add: list[tuple[bytes, bytes]] = field(default_factory=list)
    ranges_to_delete: list[bytes] = field(default_factory=list)

    @property
    def count(self) -> int:
        """Element writes in total (a set counts one per slot)."""
        return (
            len(self.counters_reset)
            + len(self.backends_to_upsert)
            + sum(map(len, self.sets_to_write.values()))
            + len(self.services_to_upsert)
            + len(self.frontends_to_delete)
            + sum(self.sets_to_delete.values())
            + len(self.backends_to_delete)
            + len(self.config)
            + len(self.ports)
            + len(self.ranges_to_add)
            + len(self.ranges_to_delete)
        )

    @property
    def empty(self) -> bool:
        return self.count == 0

    def elements(self) -> Iterator[tuple[str, str, Any, Any]]:
        """Every element write in order: (map, "update" | "delete" | "reset", key, value);
        slot keys are (set_id, index). For tests and element-by-element fallbacks."""
        for service_id in self.counters_reset:
            yield "counters", "reset", service_id, None
        for backend_id, backend in self.backends_to_upsert.items():
            yield "backends", "update", backend_id, backend
        for set_id, content in self.sets_to_write.items():
            for index, backend_id in enumerate(content):
                yield "slots", "update", (set_id, index), backend_id
        for key, value in self.services_to_upsert.items():
            yield "services", "update", key, value
        for key in self.frontends_to_delete:
            yield "services", "delete", key, None
        for set_id, count in self.sets_to_delete.items():
            for index in range(count):
                yield "slots", "delete", (set_id, index), None
        for backend_id in self.backends_to_delete:
            yield "backends", "delete", backend_id, None


# --- diff ------------------------------------------------------------------------------


def diff(current: KernelContent, desired: KernelContent) -> Writes:
    """The writes that turn `current` into `desired`, in the order of `Writes`. Raises
    ValueError if `desired` changes the content of a set id `current` holds (a live set
    is never rewritten in place; translate never does that)."""
    if desired is current:
        return Writes()
    frontends = chain(desired.services, (k for k in current.services if k not in desired.services))
    set_ids = chain(desired.slots, (s for s in current.slots if s not in desired.slots))
    backend_ids = chain(
        desired.backends, (b for b in current.backends if b not in desired.backends)
    )
    writes = writes_for(
        (current.services, desired.services, frontends),
        (current.slots, desired.slots, set_ids),
        (current.backends, desired.backends, backend_ids),
    )
    if writes.services_to_upsert:
        if current._index is not None:
            live: Mapping[int, Any] | set[int] = current._index.service_ids
        else:
            live = {v.service_id for v in current.services.values()}
        reset_counters_of_new_ids(writes, live.__contains__)
    return writes


# One map before and after, and the keys that may differ.
_MapChange = tuple[Mapping[Any, Any], Mapping[Any, Any], Iterable[Any]]


def writes_for(services: _MapChange, slots: _MapChange, backends: _MapChange) -> Writes:
    """The writes for the keys given (counters_reset aside): shared by `diff` and the
    in-place changes, whose `before` maps hold only the keys that changed."""
    writes = Writes()
    cur, new, backend_ids = backends
    for backend_id in backend_ids:
        before, after = cur.get(backend_id), new.get(backend_id)
        if after is None:
            if before is not None:
                writes.backends_to_delete.append(backend_id)
        elif before is not after and before != after:
            writes.backends_to_upsert[backend_id] = after
            if before is not None:
                writes.backends_changed.add(backend_id)

    cur_slots, new_slots, set_ids = slots
    for set_id in set_ids:
        before_set, after_set = cur_slots.get(set_id), new_slots.get(set_id)
        if after_set is None:
            if before_set is not None:
                writes.sets_to_delete[set_id] = len(before_set)
        elif before_set is None:
            writes.sets_to_write[set_id] = after_set
        elif before_set is not after_set and before_set != after_set:
            raise ValueError(f"set {set_id} would be rewritten in place")

    cur_services, new_services, frontends = services
    for key in frontends:
        old_value, new_value = cur_services.get(key), new_services.get(key)
        if new_value is None:
            if old_value is not None:
                writes.frontends_to_delete.append(key)
        elif old_value is not new_value and old_value != new_value:
            writes.services_to_upsert[key] = new_value
    return writes


def reset_counters_of_new_ids(writes: Writes, was_live: Callable[[int], bool]) -> None:
    fresh = {v.service_id for v in writes.services_to_upsert.values()}
    writes.counters_reset.extend(sorted(s for s in fresh if not was_live(s)))


# --- capacity --------------------------------------------------------------------------


def required_capacity(
    current: KernelContent, desired: KernelContent, writes: Writes
) -> dict[str, tuple[int, int]]:
    """Entries each map needs: (steady, peak). The peak is during the apply, when the new
    sets, backends and frontends are written before the old ones are deleted. For
    `services` it is also at least the highest service id + 1 (ids index the counters)."""
    sizes_before = (len(current.services), current.slot_count(), len(current.backends))
    return capacity_needed(
        sizes_before, current.services.__contains__, current.backends.__contains__, desired, writes
    )


def capacity_needed(
    sizes_before: tuple[int, int, int],
    had_frontend: Callable[[FrontendKey], bool],
    had_backend: Callable[[int], bool],
    desired: KernelContent,
    writes: Writes,
) -> dict[str, tuple[int, int]]:
    services_before, slots_before, backends_before = sizes_before
    new_frontends = sum(1 for k in writes.services_to_upsert if not had_frontend(k))
    new_backends = sum(1 for b in writes.backends_to_upsert if not had_backend(b))
    new_slots = sum(map(len, writes.sets_to_write.values()))
    services_peak = services_before + new_frontends
    index = desired._index
    if index is not None and index.service_id_overflow:
        services_peak = max(services_peak, index.service_id_overflow + 1)
    return {
        "services": (len(desired.services), services_peak),
        "slots": (desired.slot_count(), slots_before + new_slots),
        "backends": (len(desired.backends), backends_before + new_backends),
    }


def check_capacity(
    current: KernelContent, desired: KernelContent, writes: Writes, sizes: MapSizes
) -> None:
    """Raise CapacityError for the first map (services, slots, backends) whose peak need
    exceeds its size; call before writing anything."""
    check_need(required_capacity(current, desired, writes), sizes)


def check_need(need: dict[str, tuple[int, int]], sizes: MapSizes) -> None:
    for name in MAPS:
        peak = need[name][1]
        size = getattr(sizes, name)
        if peak > size:
            raise CapacityError(name, peak, size)
