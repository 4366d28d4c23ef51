"""The Python face of the maps a plan fills: their key and value types, `MapSizes`,
`KernelContent`, the ordered `Writes` from one content to the next, `diff`, the capacity
checks and the staging of writes that do not fit at once. Values and functions of values
only: how a content was built is the planner's (plan.py), not this module's. Pure Python:
no kernel, bcc or netlink here."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

from ..base import DataplaneError
from .options import FLAG_MAP_SIZES, MapSizes

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


@dataclass(slots=True)
class KernelContent:
    """What the services, slots and backends maps hold (or should hold): a value. The
    planner that owns one (plan.py's `Planner`) changes it in place and keeps, beside
    it, how it was built. Not hashable (it holds dicts).
    """

    services: dict[FrontendKey, ServiceValue] = field(default_factory=dict)
    slots: dict[int, SetContent] = field(default_factory=dict)  # set id → backend ids
    backends: dict[int, BackendValue] = field(default_factory=dict)

    def slot_count(self) -> int:
        """Slots over all sets (entries of the slots map)."""
        return sum(map(len, self.slots.values()))

    def service_ids(self) -> set[int]:
        """The service ids the frontends use."""
        return {v.service_id for v in self.services.values()}


# --- errors ----------------------------------------------------------------------------


class CapacityError(DataplaneError):
    """A map is too small for the NodeState; nothing was written, the previous state keeps
    serving. `map` is the MapSizes field (`slots`), `needed` the entries asked for."""

    def __init__(self, map: str, needed: int, size: int, why: str = "") -> None:
        from .abi import versioned  # cffi: only when there is something to say

        self.map = map
        self.needed = needed
        self.size = size
        self.pinned = versioned(f"kbp_{map}")
        if map in FLAG_MAP_SIZES:
            advice = f"raise --map-size-{map} (takes effect at the next start)"
        else:  # kbp_src_ranges: a size of its own, no flag
            advice = "this map's size is fixed: the state must ask for fewer"
        if needed > size:
            what = f"needs {needed} entries but holds {size} ({needed - size} short{why})"
        else:  # kbp_slots: enough free slots, scattered (slots.py)
            what = f"holds {size} entries, {needed} of them needed{why}"
        super().__init__(
            "capacity", f"map {self.pinned} {what}; the previous state keeps serving; {advice}"
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
        reset_counters_of_new_ids(writes, current.service_ids().__contains__)
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


def sizes_of(content: KernelContent) -> tuple[int, int, int]:
    """Entries of the services, slots and backends maps."""
    return len(content.services), content.slot_count(), len(content.backends)


def required_capacity(
    current: KernelContent, desired: KernelContent, writes: Writes, service_id_overflow: int = 0
) -> dict[str, tuple[int, int]]:
    """Entries each map needs: (steady, peak). The peak is during the apply, when the new
    sets, backends and frontends are written before the old ones are deleted. For
    `services` it is also at least `service_id_overflow` + 1, the highest service id
    handed out past the map's size (ids index the counters; 0: none)."""
    return capacity_needed(
        sizes_of(current), current.services.__contains__, current.backends.__contains__,
        sizes_of(desired), writes, service_id_overflow,
    )  # fmt: skip


def capacity_needed(
    sizes_before: tuple[int, int, int],
    had_frontend: Callable[[FrontendKey], bool],
    had_backend: Callable[[int], bool],
    sizes_after: tuple[int, int, int],
    writes: Writes,
    service_id_overflow: int = 0,
) -> dict[str, tuple[int, int]]:
    """`required_capacity` from what it needs to know: the sizes before and after, and
    whether a frontend or backend was there before."""
    services_before, slots_before, backends_before = sizes_before
    new_frontends = sum(1 for k in writes.services_to_upsert if not had_frontend(k))
    new_backends = sum(1 for b in writes.backends_to_upsert if not had_backend(b))
    new_slots = sum(map(len, writes.sets_to_write.values()))
    services_peak = services_before + new_frontends
    if service_id_overflow:
        services_peak = max(services_peak, service_id_overflow + 1)
    return {
        "services": (sizes_after[0], services_peak),
        "slots": (sizes_after[1], slots_before + new_slots),
        "backends": (sizes_after[2], backends_before + new_backends),
    }


def check_capacity(
    current: KernelContent, desired: KernelContent, writes: Writes, sizes: MapSizes
) -> None:
    """Raise CapacityError for the first map (services, slots, backends) whose peak need
    exceeds its size, counting a service id past the services map's size as an entry
    that map lacks; call before writing anything."""
    highest = max(desired.service_ids(), default=0)
    overflow = highest if highest >= sizes.services else 0
    check_need(required_capacity(current, desired, writes, overflow), sizes)


def check_need(need: dict[str, tuple[int, int]], sizes: MapSizes) -> None:
    for name in MAPS:
        peak = need[name][1]
        size = getattr(sizes, name)
        if peak > size:
            raise CapacityError(name, peak, size)


# --- staging: free before take ---------------------------------------------------------


@dataclass(slots=True)
class _Unit:
    """What one Service's switch writes (or, for the removals and the entries no frontend
    names, what they write): its frontends flip together, in one stage, after its new
    sets and backends."""

    upserts: list[FrontendKey] = field(default_factory=list)
    deletes: list[FrontendKey] = field(default_factory=list)
    sets: list[int] = field(default_factory=list)  # new sets it is the first to name
    backends: list[int] = field(default_factory=list)  # new backends its sets name first
    take: list[int] = field(default_factory=lambda: [0, 0, 0])  # services, slots, backends
    interim: bool = False  # switched through interim sets already


class _Stager:
    """`stage_writes`' state: what the maps hold, and what still holds each old set and
    backend (a set goes in the stage its last frontend flips away from it or goes, a
    backend in the stage its last set goes)."""

    def __init__(
        self,
        writes: Writes,
        sizes_before: tuple[int, int, int],
        old_service: Callable[[FrontendKey], ServiceValue | None],
        old_set: Callable[[int], SetContent],
        sets_in_use: Callable[[int], bool],
        sizes: MapSizes,
    ) -> None:
        self.writes = writes
        self.old_service = old_service
        self.sets_in_use = sets_in_use
        self.sizes = sizes
        self.caps = (sizes.services, sizes.slots, sizes.backends)
        self.occupied = list(sizes_before)
        self.replaced: dict[FrontendKey, ServiceValue] = {}  # flipped to an interim value
        self.reset: set[int] = set()  # service ids whose counters a stage zeroed
        self.first = True  # no stage has freed anything yet
        self.regrow = True  # a Service's growth may have changed since it was computed
        self.fresh = set(writes.counters_reset)
        self.to_delete: dict[int, int] = dict(writes.sets_to_delete)  # set id → slots
        self.set_refs: dict[int, int] = dict.fromkeys(self.to_delete, 0)
        for key in chain(writes.services_to_upsert, writes.frontends_to_delete):
            for set_id in self.sets_of(self.old_service(key)):
                if set_id in self.set_refs:
                    self.set_refs[set_id] += 1
        deleted_backends = set(writes.backends_to_delete)
        self.backend_refs: dict[int, int] = dict.fromkeys(deleted_backends, 0)
        self.members: dict[int, set[int]] = {}
        for set_id in self.to_delete:
            members = self.members[set_id] = set(old_set(set_id)) & deleted_backends
            for b in members:
                self.backend_refs[b] += 1

    @staticmethod
    def sets_of(value: ServiceValue | None) -> set[int]:
        return set() if value is None else {value.set_id, value.internal_set_id}

    def before(self, key: FrontendKey) -> ServiceValue | None:
        """The value `key` has in the kernel now (before this stage's flip)."""
        value = self.replaced.get(key)
        return value if value is not None else self.old_service(key)

    def over(self, took: list[int], take: list[int]) -> int:
        """How far the fullest map would be over its size (<= 0: within every size)."""
        return max(o + t + u - c for o, t, u, c in
                   zip(self.occupied, took, take, self.caps, strict=True))  # fmt: skip

    def add(self, stage: Writes, unit: _Unit) -> None:
        writes = self.writes
        for b in unit.backends:
            stage.backends_to_upsert[b] = writes.backends_to_upsert[b]
        for set_id in unit.sets:
            stage.sets_to_write[set_id] = writes.sets_to_write[set_id]
        for key in unit.upserts:
            value = writes.services_to_upsert[key]
            stage.services_to_upsert[key] = value
            self.reset_counters(stage, value.service_id)
        stage.frontends_to_delete.extend(unit.deletes)

    def reset_counters(self, stage: Writes, service_id: int) -> None:
        if service_id in self.fresh and service_id not in self.reset:
            self.reset.add(service_id)
            stage.counters_reset.append(service_id)

    def free(self, stage: Writes, took: list[int]) -> None:
        """The deletes `stage`'s flips and removals allow (in the first stage also what
        nothing named), and what the maps hold after it."""
        set_refs, backend_refs = self.set_refs, self.backend_refs
        first, self.first = self.first, False
        for key in chain(stage.services_to_upsert, stage.frontends_to_delete):
            for set_id in self.sets_of(self.before(key)):
                if set_id in set_refs:
                    set_refs[set_id] -= 1
                    if set_refs[set_id] == 0:
                        stage.sets_to_delete[set_id] = self.to_delete[set_id]
                    else:  # named by another Service too: its growth changed
                        self.regrow = True
        if first:
            for set_id, refs in set_refs.items():
                if refs == 0 and set_id not in stage.sets_to_delete:
                    stage.sets_to_delete[set_id] = self.to_delete[set_id]
        gone = set()
        for set_id in stage.sets_to_delete:
            for b in self.members.get(set_id, ()):
                backend_refs[b] -= 1
                if backend_refs[b] == 0:
                    gone.add(b)
        if first:
            gone.update(b for b, refs in backend_refs.items() if refs == 0)
        stage.backends_to_delete.extend(sorted(gone))
        freed = (
            len(stage.frontends_to_delete),
            sum(stage.sets_to_delete.values()),
            len(stage.backends_to_delete),
        )
        self.occupied = [o + t - f for o, t, f in zip(self.occupied, took, freed, strict=True)]

    def frees(self, unit: _Unit) -> tuple[int, int]:
        """The slots and backends `unit`'s flip would free: old sets only its frontends
        name, and the backends only those sets name."""
        refs: dict[int, int] = {}
        for key in unit.upserts:
            for set_id in self.sets_of(self.before(key)):
                if set_id in self.set_refs:
                    refs[set_id] = refs.get(set_id, 0) + 1
        sets = [s for s, n in refs.items() if n == self.set_refs[s]]
        backend_refs: dict[int, int] = {}
        for set_id in sets:
            for b in self.members.get(set_id, ()):
                backend_refs[b] = backend_refs.get(b, 0) + 1
        backends = sum(n == self.backend_refs[b] for b, n in backend_refs.items())
        return sum(self.to_delete[s] for s in sets), backends

    def growth(self, unit: _Unit) -> int:
        """What `unit` adds to the fuller of the slots and backends maps once done."""
        slots, backends = self.frees(unit)
        return max(unit.take[1] - slots, unit.take[2] - backends)

    def interim(self, unit: _Unit) -> tuple[Writes, list[int]] | None:
        """For a Service whose old and new entries do not fit at once: a stage that
        switches it to interim sets, each a part of one of its new sets that fits beside
        what the maps hold, so that its old sets and backends go; the Service's own later
        stage then switches it to its whole new sets and frees the interim ones. None if
        even one entry per set does not fit, or its new frontends do not."""
        writes, caps, occupied = self.writes, self.caps, self.occupied
        if occupied[0] + unit.take[0] > caps[0] or unit.interim:
            return None
        unit.interim = True  # once: a second would only replace the first
        # The interim slots are an extra the Service's last stage must find room beside:
        # as many as leave that room (so nothing else need go first), at least one a set.
        # Interim backends are new ones the last stage would write anyway.
        room = caps[1] - occupied[1] + self.frees(unit)[0] - unit.take[1]
        free_slots = min(caps[1] - occupied[1], max(len(unit.sets), room))
        free_backends = caps[2] - occupied[2]
        new_backends = set(unit.backends)
        written: list[int] = []
        interim: dict[int, tuple[int, SetContent]] = {}
        next_id = 1
        # The smaller set first (a Local policy's set is part of the cluster set), and in
        # each the backends already there or already written first: two sets can then
        # share one new backend.
        sets = sorted(unit.sets, key=lambda s: len(set(writes.sets_to_write[s])))
        for number, set_id in enumerate(sets):
            members: list[int] = []
            reserved = len(sets) - number - 1  # a slot for each set after this one
            distinct = list(dict.fromkeys(writes.sets_to_write[set_id]))
            cheap = [b for b in distinct if b not in new_backends or b in written]
            for b in cheap + [b for b in distinct if b in new_backends and b not in written]:
                if free_slots <= reserved:
                    break
                if b in new_backends and b not in written:
                    if free_backends == 0:
                        continue
                    written.append(b)
                    free_backends -= 1
                members.append(b)
                free_slots -= 1
            if not members:
                return None
            # An id neither content has (a key of the hash map; the bound of the ids
            # translate hands out does not matter to the datapath).
            while self.sets_in_use(next_id) or next_id in self.to_delete:
                next_id += 1
            interim[set_id] = (next_id, tuple(members))
            next_id += 1
        stage = Writes()
        for b in written:
            stage.backends_to_upsert[b] = writes.backends_to_upsert[b]
        for interim_id, members_ in interim.values():
            stage.sets_to_write[interim_id] = members_
        values = {}
        for key in unit.upserts:
            value = writes.services_to_upsert[key]
            outer = interim.get(value.set_id, (value.set_id, ()))
            inner = interim.get(value.internal_set_id, (value.internal_set_id, ()))
            values[key] = replace(
                value,
                set_id=outer[0],
                count=len(outer[1]) if value.set_id in interim else value.count,
                internal_set_id=inner[0],
                internal_count=len(inner[1]) if value.internal_set_id in interim
                else value.internal_count,
            )  # fmt: skip
            stage.services_to_upsert[key] = values[key]
            self.reset_counters(stage, value.service_id)
        took = [unit.take[0], sum(map(len, stage.sets_to_write.values())), len(written)]
        self.free(stage, took)
        # From here on the interim sets are old sets of this Service, freed by its flip.
        self.replaced.update(values)
        for interim_id, members_ in interim.values():
            self.to_delete[interim_id] = len(members_)
            self.set_refs[interim_id] = sum(interim_id in self.sets_of(v) for v in values.values())
            self.members[interim_id] = set()  # its backends are the new content's
        self.regrow = True
        unit.backends = [b for b in unit.backends if b not in written]
        unit.take = [0, unit.take[1], unit.take[2] - len(written)]
        return stage, took


def stage_writes(
    writes: Writes,
    sizes_before: tuple[int, int, int],
    old_service: Callable[[FrontendKey], ServiceValue | None],
    old_set: Callable[[int], SetContent],
    had_frontend: Callable[[FrontendKey], bool],
    had_backend: Callable[[int], bool],
    sets_in_use: Callable[[int], bool],
    sizes: MapSizes,
) -> list[Writes]:
    """`writes` cut into stages, each in the order of `Writes`, so that no map ever holds
    more than its size: a stage's new entries are written while the maps hold what the
    stages before left, their old sets and backends already deleted ("free before take").
    Each Service's frontends flip in one stage, after its complete new sets, and its old
    sets and backends go at the end of that stage: per Service, the order of one apply.

    The first stage deletes the frontends gone; then, stage by stage, every Service
    whose new entries fit beside what the maps hold switches, in NodeState order. When
    none fits (each one's old and new entries together exceed what is free), the one
    closest to fitting switches first to interim sets, parts of its new sets that fit
    (`_Stager.interim`), which frees its old entries; its later stage completes it.
    Raises CapacityError when not even that fits.

    `old_service` / `old_set`: the values before of the frontends `writes` changes and of
    the sets it deletes; `sizes_before`: what the three maps held; `sets_in_use`: whether
    the new content has a set id (with the deleted ones: the ids an interim set must not
    take)."""
    stager = _Stager(writes, sizes_before, old_service, old_set, sets_in_use, sizes)
    removal, orphans = _Unit(), _Unit()
    units: dict[int, _Unit] = {}
    for key, value in writes.services_to_upsert.items():
        unit = units.get(value.service_id)
        if unit is None:
            unit = units[value.service_id] = _Unit()
        unit.upserts.append(key)
        if not had_frontend(key):
            unit.take[0] += 1
    removal.deletes.extend(writes.frontends_to_delete)
    # New sets and backends go with the first Service that names them.
    new_sets = writes.sets_to_write
    set_owner: dict[int, _Unit] = {}
    for unit in units.values():
        for key in unit.upserts:
            value = writes.services_to_upsert[key]
            for set_id in (value.set_id, value.internal_set_id):
                if set_id in new_sets and set_id not in set_owner:
                    set_owner[set_id] = unit
                    unit.sets.append(set_id)
    changed = writes.backends_changed
    new_backends = {b for b in writes.backends_to_upsert if b not in changed}
    owned_backends: set[int] = set()
    for set_id, content in new_sets.items():
        unit = set_owner.get(set_id)
        if unit is None:
            unit = set_owner[set_id] = orphans
            orphans.sets.append(set_id)
        unit.take[1] += len(content)
        for b in content:
            if b in new_backends and b not in owned_backends:
                owned_backends.add(b)
                unit.backends.append(b)
                unit.take[2] += not had_backend(b)
    for b in sorted(new_backends - owned_backends):
        orphans.backends.append(b)
        orphans.take[2] += not had_backend(b)

    # Services that shrink the maps before those that grow them, and a stage ends at the
    # first Service that does not fit: skipping ahead would let growing Services take
    # the room a blocked one needs for its interim switch (and the room left at the end,
    # at least two entries beside the new state, is what guarantees that interim).
    # Growth is looked at again before each stage: a flip or removal may leave another
    # Service the last to name an old set. A Service on interim sets goes first: its
    # interim left just the room for its last stage.
    growth: dict[int, int] = {}

    def order(unit: _Unit) -> tuple[bool, int]:
        return not unit.interim, growth[id(unit)]

    # First the frontends gone and what nothing names (sets, backends); then the Services.
    stages: list[Writes] = [Writes()]
    if stager.over([0, 0, 0], orphans.take) > 0:
        _refuse(stager, [0, 0, 0], orphans, "")
    stager.add(stages[0], removal)
    stager.add(stages[0], orphans)
    stager.free(stages[0], orphans.take)
    pending = list(units.values())
    while pending:
        if stager.regrow:  # else the order stands (re-reading every Service's frees
            # before each of hundreds of stages would cost seconds at 10k Services)
            growth = {id(unit): stager.growth(unit) for unit in pending}
            stager.regrow = False
        pending.sort(key=order)
        stage = Writes()
        took = [0, 0, 0]
        done = 0
        rest: list[_Unit] = []
        for unit in pending:
            if stager.over(took, unit.take) > 0:
                rest.append(unit)
                if not unit.interim:  # (one on interim sets may wait for others' frees)
                    break
            else:
                took = [t + u for t, u in zip(took, unit.take, strict=True)]
                stager.add(stage, unit)
                done += 1
        rest += pending[done + len(rest) :]
        if done == 0:
            blocked = next((u for u in rest if not u.interim), None)
            made = stager.interim(blocked) if blocked is not None else None
            if made is None:
                _refuse(stager, [0, 0, 0], blocked or rest[0], ", one Service's old and new "
                        "entries at once, even with an interim part of the new")  # fmt: skip
            else:
                stages.append(made[0])
            continue
        stager.free(stage, took)
        stages.append(stage)
        pending = rest
    # A live backend whose flags changed, and (by the writer) the copies in the slots of
    # the sets that name it: last, when every new set is in.
    last = stages[-1]
    for b in sorted(changed):
        last.backends_to_upsert[b] = writes.backends_to_upsert[b]
    last.backends_changed.update(changed)
    return [s for s in stages if not s.empty] or [Writes()]


def _refuse(stager: _Stager, took: list[int], unit: _Unit, why: str) -> None:
    for name, o, t, u, c in zip(MAPS, stager.occupied, took, unit.take, stager.caps,
                                strict=True):  # fmt: skip
        if o + t + u > c:
            raise CapacityError(name, o + t + u, c, why)
    raise AssertionError("refused what fits")
