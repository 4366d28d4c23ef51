"""The eBPF dataplane's planner: a `Planner`, which the map writer owns, holds the content
the maps hold and, beside it, how it was built (its plans per entry, the ids to come), and
turns it into the content for a new NodeState in one pass over the entries that went and
came (`Changes.since`), translating only the changed ones (translate.py's per-entry
translation): one changed Service costs about the same at 1k as at 30k Services. The
content is changed in place, with journals to undo it. A resync (the planner does not
hold the base of the state's Changes) is the same pass over every entry, which keeps the
plans of the entries whose digest it knows.

A full plan is that pass from an empty content with every entry come (kube-proxy's one
loop, with nothing skipped): after a restart or a failed write (the content read from the
kernel, whose ids the entries adopt), when a change touches a frontend more than one
entry asks for (the winner then depends on the order of all entries), or when the table
or map sizes change. Pure Python: no kernel, bcc or netlink here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from itertools import compress
from operator import not_
from typing import Any

from ...gcpause import gc_paused
from ...model.nodestate import Changes, NodeState, ServiceEntry
from .maglev import DEFAULT_TABLE_SIZE, check_table_size
from .maps import (
    MAPS,
    BackendValue,
    CapacityError,
    FrontendKey,
    KernelContent,
    MapSizes,
    ServiceValue,
    SetContent,
    SortKey,
    Writes,
    capacity_needed,
    check_need,
    diff,
    required_capacity,
    reset_counters_of_new_ids,
    stage_writes,
    writes_for,
)
from .slots import Before
from .translate import (
    DIGEST,
    Adoption,
    ContentIndex,
    EntryBuilder,
    EntryPlan,
    Ids,
    entries_if_keyed,
    full_allocators,
)


class Planner:
    """The content the maps hold (`content`) and how it was built (`index`; None for a
    content decoded from the kernel, whose next plan is full). Only a `Change` this
    planner made changes either; `reset` replaces both."""

    __slots__ = ("content", "index", "maglev_table_size", "sizes")

    def __init__(
        self,
        content: KernelContent | None = None,
        *,
        maglev_table_size: int = DEFAULT_TABLE_SIZE,
        sizes: MapSizes | None = None,
    ) -> None:
        self.content = content if content is not None else KernelContent()
        self.index: ContentIndex | None = None
        self.maglev_table_size = maglev_table_size
        self.sizes = sizes or MapSizes()

    def reset(self, content: KernelContent) -> None:
        """Hold `content`, read from the kernel: how it was built is unknown."""
        self.content, self.index = content, None

    def plan(self, state: NodeState) -> Change:
        """The writes from `content` to the content for `state`, the capacity they need and
        that content, in a Change to commit (written) or roll back.

        Until then `content` may already hold the new content: use it for nothing else.
        Raises ValueError when the Maglev table size is not prime or too small for a
        Service's backends, with the planner unchanged.
        """
        check_table_size(self.maglev_table_size)
        index = self.index
        if (
            index is not None
            and index.maglev_table_size == self.maglev_table_size
            and index.sizes == self.sizes
        ):
            update = _Pass(self, state, index).run()
            if update is not None:
                return Change._in_place(self, update)
        with gc_paused():  # ~10^5 acyclic values: generation-2 passes would double the time
            update = _Pass(self, state, None).run()
            assert update is not None, "a full pass always plans"
            return Change._replacing(self, update)


class _Pass:
    """One pass of the planner: the plans that go (of the entries that went) and the
    entries that came, translated in NodeState order into dicts of their own beside the
    content (which is only read): an `_Update`. With `index` None a full pass: every
    entry came and every plan went, so the new content is those dicts alone. An
    incremental pass returns None (make a full one) when a changed entry touches a
    frontend that more than one entry wants."""

    def __init__(self, planner: Planner, state: NodeState, index: ContentIndex | None) -> None:
        self.planner = planner
        self.state = state
        self.index = index  # None: full
        self.built = planner.index  # whose plans give known ids (None: adopt from the maps)
        current = planner.content
        self.builder = EntryBuilder(current, planner.maglev_table_size, planner.sizes, {}, {}, {})
        self.adoption = Adoption(current) if self.built is None else None

    def run(self) -> _Update | None:
        state, index, builder = self.state, self.index, self.builder
        if index is None:
            changed, old_plans = list(state.services), []  # the new content is made afresh
            sealed = all(map(DIGEST, changed))
            full_allocators(builder, self.planner.content, self.built, self.planner.sizes)
            # Who answers each frontend: the first entry in NodeState order that asks.
            keys_of = [builder.owned(builder.frontend_keys(e)) for e in changed]
        else:
            changed, old_plans, sealed = self.changes(index)
            found = self.free_keys(index, changed, old_plans)
            if found is None:
                return None
            keys_of = found
            self.allocators(index)
        adopted = self.adoption.service_ids(keys_of) if self.adoption is not None else []
        new_plans = []
        for i, (entry, keys) in enumerate(zip(changed, keys_of, strict=True)):
            if not keys:
                new_plans.append(EntryPlan(entry, 0, (), (), ()))
                continue
            service_id, known_backends, known_sets = self.known(entry, keys, adopted, i)
            if not service_id:
                service_id = builder.service_id_alloc.take()
            new_plans.append(builder.translate(entry, keys, service_id, known_backends, known_sets))

        if index is not None and not new_plans and not old_plans:
            cursors, overflow = index.cursors, index.service_id_overflow
        else:
            cursors = (
                builder.service_id_alloc.cursor,
                builder.set_id_alloc.cursor,
                builder.backend_id_alloc.cursor,
            )
            overflow = builder.service_id_alloc.overflow
        return _Update(
            state.services,
            state.revision,
            sealed,
            old_plans,
            new_plans,
            builder.services,
            builder.slots,
            builder.backends,
            builder.service_ids,
            frozenset(builder.contested),
            builder.slot_total,
            cursors,
            overflow,
        )

    def free_keys(
        self, index: ContentIndex, changed: list[ServiceEntry], old_plans: list[EntryPlan]
    ) -> list[dict[FrontendKey, int]] | None:
        """Each changed entry's frontends, or None when one is contested: wanted by
        another changed entry, or by an entry that keeps its plan, or by more than one
        entry before."""
        contested = index.contested
        if contested and any(k in contested for p in old_plans for k in p.frontends):
            return None
        services = self.planner.content.services
        freed = {key for plan in old_plans for key in plan.frontends}  # the rest stay taken
        claimed: set[FrontendKey] = set()
        keys_of = []
        for entry in changed:
            keys = self.builder.frontend_keys(entry)
            for k in keys:
                if k in claimed or k in contested or (k in services and k not in freed):
                    return None
            claimed.update(keys)
            keys_of.append(keys)
        return keys_of

    def allocators(self, index: ContentIndex) -> None:
        """The id allocators of an incremental pass: they go on from the index's cursors
        and skip every id the content holds (the ids of the plans that go included: an
        id is not reused in the sync that frees it)."""
        builder, current, sizes = self.builder, self.planner.content, self.planner.sizes
        builder.service_id_alloc = Ids(
            sizes.services, index.cursors[0], (index.service_ids, builder.service_ids)
        )
        builder.set_id_alloc = Ids(sizes.slots, index.cursors[1], (current.slots, builder.slots))
        builder.backend_id_alloc = Ids(
            sizes.backends, index.cursors[2], (current.backends, builder.backends)
        )

    def known(
        self, entry: ServiceEntry, keys: dict[FrontendKey, int], adopted: list[int], i: int
    ) -> tuple[int, Mapping[tuple[str, int], int], Mapping[SetContent, int]]:
        """The service id `entry` keeps (0: a new one) and the backend and set ids it may
        keep, by content: from its plan (known by its sort key), else adopted from the
        maps (known by its frontends; `adopted[i]` its service id there)."""
        if self.built is not None:
            old = self.built.by_key.get(entry.sort_key)
            if old is None or not old.service_id:
                return 0, {}, {}
            return (old.service_id, *self.builder.known_from_plan(old))
        assert self.adoption is not None
        service_id = adopted[i]
        if not service_id:
            return 0, {}, {}
        adoption = self.adoption
        return service_id, adoption.backends_of(service_id), adoption.sets_of(keys, service_id)

    def changes(self, index: ContentIndex) -> tuple[list[ServiceEntry], list[EntryPlan], bool]:
        """The delta since the state the plans are for (`Changes.since`), applied to the
        plans: the entries to translate (new or changed, in NodeState order), the plans
        that go (of changed entries and of entries gone), and whether every entry that
        came is sealed."""
        delta = Changes.since(index.revision, index.entries, self.state)
        if delta.full:  # every entry came and every plan went: keep what is the same
            return self.changes_of_all(index)
        went, came = delta.went, delta.came
        by_digest, by_key = index.by_digest, index.by_key
        came_digests = list(map(DIGEST, came))
        changed = list(compress(came, map(not_, map(by_digest.__contains__, came_digests))))
        staying = set(came_digests)
        staying.discard(b"")
        old_plans = []
        # Usually only the went entries whose digest is not staying; an entry equal to the
        # one it was planned for may lack a digest, so the plan's own digest decides.
        for entry in compress(went, map(not_, map(staying.__contains__, map(DIGEST, went)))):
            plan = by_key[entry.sort_key]
            if plan.entry.digest not in staying:
                old_plans.append(plan)
        return changed, old_plans, all(came_digests)

    def changes_of_all(
        self, index: ContentIndex
    ) -> tuple[list[ServiceEntry], list[EntryPlan], bool]:
        """`changes` of a resync (every entry came, every plan went), keeping the plans of
        the entries that are the same: by digest, or by value for an entry without one."""
        state = self.state
        by_digest, by_key = index.by_digest, index.by_key
        changed: list[ServiceEntry] = []
        hits = 0
        for entry in state.services:
            digest = entry.digest
            if digest:
                if digest in by_digest:
                    hits += 1
                    continue
            else:
                old = by_key.get(entry.sort_key)
                if old is not None and old.entry == entry:
                    hits += 1
                    continue
            changed.append(entry)
        sealed = all(map(DIGEST, state.services))
        if not changed and hits == len(by_key):
            return [], [], sealed

        changed_keys = {e.sort_key: e for e in changed}
        old_plans = [p for p in map(by_key.get, changed_keys) if p is not None]
        if hits + len(old_plans) < len(by_key):
            live_digests = {e.digest for e in state.services if e.digest}
            live_keys = None
            for key, plan in by_key.items():
                if key in changed_keys:
                    continue
                digest = plan.entry.digest
                if digest and digest in live_digests and by_digest.get(digest) is plan:
                    continue
                if not digest:
                    if live_keys is None:
                        live_keys = {e.sort_key for e in state.services}
                    if key in live_keys:
                        continue
                old_plans.append(plan)
        return changed, old_plans, sealed


@dataclass(frozen=True, slots=True)
class _Update:
    """What a `_Pass` found: the plans that go, the plans that come with the entries they
    write, and the index figures after. `apply` makes an incremental pass's so on the
    planner's content in place; a full pass's dicts are the new content alone, and
    `index` is how it was built."""

    entries: tuple[ServiceEntry, ...]
    revision: str
    sealed: bool  # every entry that came has a digest
    old_plans: list[EntryPlan]
    new_plans: list[EntryPlan]
    services: dict[FrontendKey, ServiceValue]
    slots: dict[int, SetContent]
    backends: dict[int, BackendValue]
    service_ids: dict[int, SortKey]
    contested: frozenset[FrontendKey]  # frontends more than one new plan asked for
    slot_total: int  # slots of the new sets
    cursors: tuple[int, int, int]
    service_id_overflow: int

    def index(self, maglev_table_size: int, sizes: MapSizes) -> ContentIndex:
        """The index of a full pass's content."""
        by_key: dict[SortKey, EntryPlan] = {}
        by_digest: dict[bytes, EntryPlan] = {}
        for plan in self.new_plans:
            entry = plan.entry
            by_key[entry.sort_key] = plan
            if entry.digest:
                by_digest[entry.digest] = plan
        return ContentIndex(
            maglev_table_size,
            sizes,
            by_key,
            by_digest,
            self.service_ids,
            self.contested,
            self.cursors,
            self.slot_total,
            self.service_id_overflow,
            entries_if_keyed(self.entries, by_key, by_digest),
            self.revision,
        )

    def apply(self, journals: _Journals) -> ContentIndex:
        """Change the journals' content and index in place into the new ones; returns the
        new index."""
        index = journals.index
        services, slots, backends = journals.services, journals.slots, journals.backends
        by_key, by_digest, service_ids = journals.by_key, journals.by_digest, journals.service_ids
        slot_total = index.slot_total
        for plan in self.old_plans:
            for key in plan.frontends:
                services.delete(key)
            for set_id in plan.set_ids:
                slot_total -= len(slots.delete(set_id))
            for backend_id in plan.backend_ids:
                backends.delete(backend_id)
            entry = plan.entry
            by_key.delete(entry.sort_key)
            if entry.digest and by_digest.target.get(entry.digest) is plan:
                by_digest.delete(entry.digest)
            if plan.service_id in service_ids.target:
                service_ids.delete(plan.service_id)
        for key, value in self.services.items():
            services.set(key, value)
        for set_id, content in self.slots.items():
            slots.set(set_id, content)
            slot_total += len(content)
        for backend_id, backend in self.backends.items():
            backends.set(backend_id, backend)
        for plan in self.new_plans:
            by_key.set(plan.entry.sort_key, plan)
            if plan.entry.digest:
                by_digest.set(plan.entry.digest, plan)
        for service_id, sort_key in self.service_ids.items():
            service_ids.set(service_id, sort_key)
        entries = None
        if self.sealed:  # then by_digest holds the digests of the plans of `self.entries`
            entries = entries_if_keyed(self.entries, by_key.target, by_digest.target)
        new_index = replace(
            index,
            cursors=self.cursors,
            slot_total=slot_total,
            service_id_overflow=self.service_id_overflow,
            entries=entries,
            revision=self.revision,
        )
        journals.planner.index = new_index
        return new_index


# --- changing a content in place -------------------------------------------------------

_ABSENT: Any = object()  # in a journal: the key had no value before
_UNCHANGED: Any = object()  # not in a journal: the key kept its value


class _Journal:
    """Changes made in place to one dict, with each changed key's value from before the
    first change (`_ABSENT`: none): the keys that changed, and how to undo them."""

    __slots__ = ("before", "target")

    def __init__(self, target: dict[Any, Any]) -> None:
        self.target = target
        self.before: dict[Any, Any] = {}

    def set(self, key: Any, value: Any) -> None:
        if key not in self.before:
            self.before[key] = self.target.get(key, _ABSENT)
        self.target[key] = value

    def delete(self, key: Any) -> Any:
        value = self.target.pop(key)
        if key not in self.before:
            self.before[key] = value
        return value

    def had(self, key: Any) -> bool:
        """Whether `key` had a value before the changes."""
        if key in self.before:
            return self.before[key] is not _ABSENT
        return key in self.target

    def old_values(self) -> dict[Any, Any]:
        """The changed keys that had a value before, with that value."""
        return {k: v for k, v in self.before.items() if v is not _ABSENT}

    def undo(self) -> None:
        target = self.target
        for key, value in self.before.items():
            if value is _ABSENT:
                target.pop(key, None)
            else:
                target[key] = value
        self.before = {}


class _Journals:
    """One in-place change of a planner's content and index, and what it replaced."""

    __slots__ = (
        "backends",
        "by_digest",
        "by_key",
        "content",
        "index",
        "planner",
        "service_ids",
        "services",
        "sizes_before",
        "slots",
    )

    def __init__(self, planner: Planner) -> None:
        content, index = planner.content, planner.index
        assert index is not None, "only a content built by the planner is changed in place"
        self.sizes_before = (len(content.services), index.slot_total, len(content.backends))
        self.planner = planner
        self.content = content
        self.index = index
        self.services = _Journal(content.services)
        self.slots = _Journal(content.slots)
        self.backends = _Journal(content.backends)
        self.by_key = _Journal(index.by_key)
        self.by_digest = _Journal(index.by_digest)
        self.service_ids = _Journal(index.service_ids)

    def writes(self) -> Writes:
        """`diff` from the content before to the content now, over the changed keys."""
        content = self.content
        services, slots, backends = self.services, self.slots, self.backends
        writes = writes_for(
            (services.old_values(), content.services, services.before),
            (slots.old_values(), content.slots, slots.before),
            (backends.old_values(), content.backends, backends.before),
        )
        if writes.services_to_upsert:
            reset_counters_of_new_ids(writes, self.service_ids.had)
        return writes

    def undo(self) -> None:
        for journal in (
            self.services,
            self.slots,
            self.backends,
            self.by_key,
            self.by_digest,
            self.service_ids,
        ):
            journal.undo()
        self.planner.index = self.index


class Change:
    """One sync planned by `Planner.plan`: the writes, the capacity they need and
    `content`, what the maps hold once the writes are in. Exactly one of `commit()`
    (written), `rollback()` (refused, or a write failed) or the planner's `reset` (the
    maps read back after a failed write) ends it; until then the planner's content may
    already be the new content."""

    __slots__ = (
        "_index",
        "_journals",
        "_need",
        "_open",
        "_planner",
        "_previous",
        "_sizes_before",
        "content",
        "writes",
    )

    def __init__(
        self,
        planner: Planner,
        content: KernelContent,
        index: ContentIndex,
        writes: Writes,
        need: dict[str, tuple[int, int]],
        journals: _Journals | None,
        sizes_before: tuple[int, int, int],
    ) -> None:
        self._planner = planner
        self._previous = planner.content
        self.content = content
        self._index = index  # the planner's index once committed
        self.writes = writes
        self._need = need
        self._journals = journals
        self._open = True
        self._sizes_before = sizes_before

    @classmethod
    def _in_place(cls, planner: Planner, update: _Update) -> Change:
        journals = _Journals(planner)
        current = planner.content
        try:
            index = update.apply(journals)
            writes = journals.writes()
            sizes_after = (len(current.services), index.slot_total, len(current.backends))
            need = capacity_needed(
                journals.sizes_before, journals.services.had, journals.backends.had,
                sizes_after, writes, index.service_id_overflow,
            )  # fmt: skip
        except BaseException:
            journals.undo()
            raise
        return cls(planner, current, index, writes, need, journals, journals.sizes_before)

    @classmethod
    def _replacing(cls, planner: Planner, update: _Update) -> Change:
        """A full pass: the new content is the pass's own, the planner's stays as it is
        until the commit."""
        current = planner.content
        content = KernelContent(update.services, update.slots, update.backends)
        index = update.index(planner.maglev_table_size, planner.sizes)
        writes = diff(current, content)
        need = required_capacity(current, content, writes, index.service_id_overflow)
        sizes_before = (len(current.services), current.slot_count(), len(current.backends))
        return cls(planner, content, index, writes, need, None, sizes_before)

    def required_capacity(self) -> dict[str, tuple[int, int]]:
        """As `required_capacity` of the content before, `content` and `writes`."""
        return dict(self._need)

    def check_capacity(self, sizes: MapSizes) -> None:
        """As `check_capacity`: raises CapacityError; call before writing anything."""
        check_need(self._need, sizes)

    def stages(self, sizes: MapSizes) -> list[Writes]:
        """`writes` in stages that never hold more than `sizes` (`maps.stage_writes`):
        `[writes]` itself when the whole apply's peak fits, as it usually does. Raises
        CapacityError, before anything is written, when the new state itself does not
        fit (entries, or service ids: the new ones never reuse an id this apply frees), or
        when one Service's old and new entries together exceed what its maps have free
        with every other change made first."""
        need = self._need
        for name in MAPS:
            steady = need[name][0]
            size = getattr(sizes, name)
            if steady > size:
                raise CapacityError(name, steady, size)
        if all(need[name][1] <= getattr(sizes, name) for name in MAPS):
            return [self.writes]
        overflow = self._index.service_id_overflow
        if overflow:
            raise CapacityError(
                "services", overflow + 1, sizes.services,
                ", counting the service ids in use: new Services never take the id of one "
                "removed in the same apply",
            )  # fmt: skip
        journals = self._journals
        if journals is None:
            previous = self._previous
            return stage_writes(
                self.writes, self._sizes_before, previous.services.get,
                previous.slots.__getitem__, previous.services.__contains__,
                previous.backends.__contains__, self.content.slots.__contains__, sizes,
            )  # fmt: skip
        services_before, slots_before = journals.services.before, journals.slots.before

        def old_service(key: FrontendKey) -> ServiceValue | None:
            value = services_before.get(key, _ABSENT)  # every key of `writes` changed
            return None if value is _ABSENT else value  # _ABSENT: new

        return stage_writes(
            self.writes, self._sizes_before, old_service, slots_before.__getitem__,
            journals.services.had, journals.backends.had, self.content.slots.__contains__,
            sizes,
        )  # fmt: skip

    def before(self) -> Before:
        """What the maps held before this change, for slots.py's placement (valid until
        the change ends)."""
        journals = self._journals
        if journals is None:
            previous = self._previous
            return Before(previous.services.get, previous.slots.get,
                          lambda: list(previous.services))  # fmt: skip
        content = self.content

        def of(journal: _Journal, now: dict[Any, Any]) -> Callable[[Any], Any]:
            def lookup(key: Any) -> Any:
                value = journal.before.get(key, _UNCHANGED)
                if value is _UNCHANGED:
                    return now.get(key)
                return None if value is _ABSENT else value

            return lookup

        services = journals.services

        def frontends() -> list[FrontendKey]:
            changed = services.before
            return [k for k in content.services if k not in changed] + [
                k for k, v in changed.items() if v is not _ABSENT
            ]

        return Before(of(services, content.services), of(journals.slots, content.slots),
                      frontends)  # fmt: skip

    def backend_before(self, backend_id: int) -> BackendValue | None:
        """A backend's value before this change (None: it was not there)."""
        journals = self._journals
        if journals is None:
            return self._previous.backends.get(backend_id)
        value = journals.backends.before.get(backend_id, _UNCHANGED)
        if value is _UNCHANGED:
            return self.content.backends.get(backend_id)
        return None if value is _ABSENT else value

    def commit(self) -> KernelContent:
        """The writes are in the kernel: the planner holds `content` (returned) and how it
        was built."""
        self._end()
        self._journals = None
        planner = self._planner
        planner.content, planner.index = self.content, self._index
        return self.content

    def rollback(self) -> KernelContent:
        """The writes were not made: the planner holds its content exactly as it was
        (returned; when a write failed half-way, the kernel holds something in between:
        read it back and `reset` the planner instead)."""
        self._end()
        if self._journals is not None:
            self._journals.undo()
            self._journals = None
        return self._previous

    def _end(self) -> None:
        if not self._open:
            raise RuntimeError("this change was already committed or rolled back")
        self._open = False
