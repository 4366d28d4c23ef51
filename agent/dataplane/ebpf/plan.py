"""The agent's planning path: `plan_change` turns the content the maps hold into the
content for a new NodeState in place, translating only the entries that changed
(translate.py's per-entry translation), and keeps journals to undo it, so one changed
Service costs about the same at 1k as at 30k Services. Content without an index (decoded
from the kernel), or a change of table or map sizes, takes the full path
(`translate`). Pure Python: no kernel, bcc or netlink here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import compress
from operator import not_
from typing import Any

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
from .translate import (
    DIGEST,
    ContentIndex,
    EntryBuilder,
    EntryPlan,
    Ids,
    entries_if_keyed,
    translate,
)


def plan_change(
    state: NodeState,
    current: KernelContent,
    *,
    maglev_table_size: int = DEFAULT_TABLE_SIZE,
    sizes: MapSizes | None = None,
) -> Change:
    """`translate`, `diff` and `required_capacity` in one step that changes `current`
    in place when it came from this module (translate or plan_change): the cost follows
    the entries that changed, not the size of `current`.

    Until the returned Change is committed or rolled back, `current` may already hold the
    new content: use it for nothing else. Content decoded from the kernel (or a change of
    table or map sizes) is translated in full into a new content, leaving `current` as it
    is. Raises like translate, with `current` unchanged.
    """
    sizes = sizes or MapSizes()
    update = _update(state, current, maglev_table_size, sizes)
    if update is not None:
        return Change._in_place(current, update)
    desired = translate(state, current, maglev_table_size=maglev_table_size, sizes=sizes)
    writes = diff(current, desired)
    return Change(current, desired, writes, required_capacity(current, desired, writes), None)


def _update(
    state: NodeState, current: KernelContent, maglev_table_size: int, sizes: MapSizes
) -> _Update | None:
    """How to change `current` into the content for `state` by translating only what
    changed, or None: translate everything."""
    check_table_size(maglev_table_size)
    index = current._index
    if index is None or index.maglev_table_size != maglev_table_size or index.sizes != sizes:
        return None
    return _Incremental(state, current, index).run()


class _Incremental:
    """Translate only the entries whose digest changed, into dicts of their own beside
    `current` (which is only read): an `_Update`. Returns None (take the full path) when
    a changed entry touches a frontend that more than one entry wants, as the winner then
    depends on the order of all entries."""

    def __init__(self, state: NodeState, current: KernelContent, index: ContentIndex) -> None:
        self.state = state
        self.current = current
        self.index = index

    def run(self) -> _Update | None:
        state, current, index = self.state, self.current, self.index
        changed, old_plans, sealed = self.changes()
        contested = index.contested
        if contested and any(k in contested for p in old_plans for k in p.frontends):
            return None

        sizes = index.sizes
        builder = EntryBuilder(current, index.maglev_table_size, sizes, {}, {}, {})
        builder.service_id_alloc = Ids(
            sizes.services, index.cursors[0], (index.service_ids, builder.service_ids)
        )
        builder.set_id_alloc = Ids(sizes.slots, index.cursors[1], (current.slots, builder.slots))
        builder.backend_id_alloc = Ids(
            sizes.backends, index.cursors[2], (current.backends, builder.backends)
        )
        # Frontends stay taken by the entries that keep their plans.
        services = current.services
        freed = {key for plan in old_plans for key in plan.frontends}
        by_key = index.by_key
        new_plans = []
        for entry in changed:
            keys = builder.frontend_keys(entry)
            if any(
                k in builder.services or k in contested or (k in services and k not in freed)
                for k in keys
            ):
                return None
            old = by_key.get(entry.sort_key)
            if not keys:
                plan = EntryPlan(entry, 0, (), (), ())
            elif old is not None and old.service_id:
                known_backends, known_sets = builder.known_from_plan(old)
                plan = builder.translate(entry, keys, old.service_id, known_backends, known_sets)
            else:
                service_id = builder.service_id_alloc.take()
                plan = builder.translate(entry, keys, service_id, {}, {})
            new_plans.append(plan)

        if not new_plans and not old_plans:
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
            cursors,
            overflow,
        )

    def changes(self) -> tuple[list[ServiceEntry], list[EntryPlan], bool]:
        """The entries to translate (new or changed, in NodeState order), the plans that go
        (of changed entries and of entries gone), and whether every entry that came (all
        when scanning) is sealed."""
        state, index = self.state, self.index
        delta = Changes.since(index.revision, index.entries, state)
        if delta.full:
            return self.changes_by_scan()
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

    def changes_by_scan(self) -> tuple[list[ServiceEntry], list[EntryPlan], bool]:
        """`changes` looking at every entry (and every plan when some went)."""
        state, index = self.state, self.index
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
    """What `_Incremental` found: the plans that go, the plans that come with the entries
    they write, and the index figures after. `apply` makes it so on a content."""

    entries: tuple[ServiceEntry, ...]
    revision: str
    sealed: bool  # every entry that came has a digest
    old_plans: list[EntryPlan]
    new_plans: list[EntryPlan]
    services: dict[FrontendKey, ServiceValue]
    slots: dict[int, SetContent]
    backends: dict[int, BackendValue]
    service_ids: dict[int, SortKey]
    cursors: tuple[int, int, int]
    service_id_overflow: int

    @property
    def empty(self) -> bool:
        return not self.old_plans and not self.new_plans

    def apply(self, journals: _Journals) -> None:
        """Change the journals' content (and its index) in place into the new content."""
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
        journals.content._index = new_index


# --- changing a content in place -------------------------------------------------------

_ABSENT: Any = object()  # in a journal: the key had no value before


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
    """One in-place change of a content and of its index, and what it replaced."""

    __slots__ = (
        "backends",
        "by_digest",
        "by_key",
        "content",
        "index",
        "service_ids",
        "services",
        "sizes_before",
        "slots",
    )

    def __init__(self, content: KernelContent) -> None:
        index = content._index
        assert index is not None, "only a content built here is changed in place"
        self.sizes_before = (len(content.services), content.slot_count(), len(content.backends))
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
        self.content._index = self.index


class Change:
    """One sync made by `plan_change`: the writes, the capacity they need and `content`,
    what the maps hold once the writes are in. Exactly one of `commit()` (written) or
    `rollback()` (refused, or a write failed) ends it; until then the `current` given to
    plan_change may already be the new content."""

    __slots__ = ("_journals", "_need", "_open", "_previous", "_sizes_before", "content", "writes")

    def __init__(
        self,
        previous: KernelContent,
        content: KernelContent,
        writes: Writes,
        need: dict[str, tuple[int, int]],
        journals: _Journals | None,
    ) -> None:
        self._previous = previous
        self.content = content
        self.writes = writes
        self._need = need
        self._journals = journals
        self._open = True
        self._sizes_before = (
            (len(previous.services), previous.slot_count(), len(previous.backends))
            if journals is None
            else journals.sizes_before
        )

    @classmethod
    def _in_place(cls, current: KernelContent, update: _Update) -> Change:
        journals = _Journals(current)
        try:
            update.apply(journals)
            writes = journals.writes()
            need = capacity_needed(
                journals.sizes_before, journals.services.had, journals.backends.had, current, writes
            )
        except BaseException:
            journals.undo()
            raise
        return cls(current, current, writes, need, journals)

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
        index = self.content._index
        if index is not None and index.service_id_overflow:
            raise CapacityError(
                "services", index.service_id_overflow + 1, sizes.services,
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

    def commit(self) -> KernelContent:
        """The writes are in the kernel: returns `content`, the new current."""
        self._end()
        self._journals = None
        return self.content

    def rollback(self) -> KernelContent:
        """The writes were not made: returns the current given to plan_change, exactly as
        it was (when a write failed half-way, the kernel holds something in between)."""
        self._end()
        if self._journals is not None:
            self._journals.undo()
            self._journals = None
        return self._previous

    def _end(self) -> None:
        if not self._open:
            raise RuntimeError("this change was already committed or rolled back")
        self._open = False
