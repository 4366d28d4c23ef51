"""kbp_slots is an array: each backend set lives in a run of consecutive slots, and a
frontend names a set by the index of its first slot, so the programs read a new flow's
backend at that index + hash % count (one array read after the frontend's hash lookup).
This module places the planner's sets in the array: `SlotSpace` knows where each live set
is and which slots are free, and `SlotSpace.place` turns the planner's writes (set ids
the planner chose, stages as maps.stage_writes cut them) into writes by index.

The rule of every write holds: a reader sees the old set or the new, never a mix. A set
is never rewritten in place (the planner gives changed content a new set id); a new set
goes into slots free at the time its stage writes it, the frontends flip to its first
index after it is complete, and its old slots are zeroed after the flip. When the free
slots are enough in number but no run is long enough, sets are moved together towards
index 1 the same way (written to a free run, their frontends pointed at it, the old run
zeroed; a set longer than the hole below it through an interim part of itself) until the
run is there: that always ends with every free slot in one run, so only sets more than
the free slots (or a set an interrupted writer left broken, which does not move) make
the apply refused, before anything is written (CapacityError), the previous state
serving on.

Index 0 is never a set's: a frontend's 0 names no set (as the planner's set id 0).
Pure Python: no kernel, bcc or netlink here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import NoReturn

from .maps import CapacityError, FrontendKey, KernelContent, ServiceValue, SetContent, Writes

_TAKEN = 1


@dataclass(frozen=True, slots=True)
class Before:
    """What the maps hold before an apply, as the planner's Change knows it: the value of
    a frontend (None: absent), the content of a set (None: unknown), and every frontend
    (called only when sets must be moved)."""

    service: Callable[[FrontendKey], ServiceValue | None]
    set: Callable[[int], SetContent | None]
    frontends: Callable[[], Iterable[FrontendKey]]


class SlotSpace:
    """Where the live sets are in kbp_slots (`size` slots): each set id's first slot
    and length, and which slots are taken (1) or free (0)."""

    __slots__ = ("_journal", "bases", "cursor", "lengths", "size", "starts", "taken", "used")

    def __init__(self, size: int) -> None:
        self.size = size
        self.used = bytearray(size)
        if size:
            self.used[0] = _TAKEN  # names no set
        self.bases: dict[int, int] = {}  # set id -> its first slot
        self.lengths: dict[int, int] = {}  # set id -> its slots
        self.starts: dict[int, int] = {}  # first slot -> set id (sets of a slot or more)
        self.taken = 0  # slots of sets
        self.cursor = 1  # where the next search starts (next fit)
        self._journal: _Journal | None = None  # what `place` changed, to undo it

    @classmethod
    def of_content(cls, size: int, content: KernelContent) -> SlotSpace:
        """The space of a content decoded from the kernel (codec.read_content), whose set
        ids are their first slots: each set's run is the most slots a frontend says it
        has (a broken set's too, so that it is zeroed when it goes)."""
        space = cls(size)
        named: dict[int, int] = {}
        for value in content.services.values():
            for set_id, count in ((value.set_id, value.count),
                                  (value.internal_set_id, value.internal_count)):  # fmt: skip
                if set_id and count:
                    named[set_id] = max(named.get(set_id, 0), count)
        for set_id in content.slots:
            length = max(0, min(named.get(set_id, 0), size - set_id))
            space.bases[set_id], space.lengths[set_id] = set_id, length
            if length:
                space.starts[set_id] = set_id
            space.used[set_id : set_id + length] = b"\x01" * length
            space.taken += length
        end = max((b + n for b, n in zip(space.bases.values(), space.lengths.values(),
                                         strict=True)), default=1)  # fmt: skip
        space.cursor = end if end < size else 1
        return space

    def base(self, set_id: int) -> int:
        """The first slot of a live set (0 for the planner's 0: no set)."""
        return self.bases[set_id] if set_id else 0

    def based(self, value: ServiceValue) -> ServiceValue:
        """A frontend's value as written: its sets named by their first slots."""
        set_id, inner = self.base(value.set_id), self.base(value.internal_set_id)
        if set_id == value.set_id and inner == value.internal_set_id:
            return value
        return replace(value, set_id=set_id, internal_set_id=inner)

    def find(self, n: int, below: int | None = None) -> int | None:
        """The first slot of a free run of `n`: from the cursor on, then from index 1
        (next fit); with `below`, the lowest run that ends at or before it."""
        zeros = bytes(n)
        if below is not None:
            i = self.used.find(zeros, 1, below)
            return i if i >= 0 else None
        i = self.used.find(zeros, self.cursor)
        if i < 0 and self.cursor > 1:
            i = self.used.find(zeros, 1, min(self.size, self.cursor + n - 1))
        return i if i >= 0 else None

    def take(self, set_id: int, base: int, n: int) -> None:
        if self._journal is not None:
            self._journal.note(self, set_id, base, n)
        self.used[base : base + n] = b"\x01" * n
        self.bases[set_id], self.lengths[set_id] = base, n
        if n:
            self.starts[base] = set_id
        self.taken += n
        self.cursor = base + n if base + n < self.size else 1

    def release(self, set_id: int) -> tuple[int, int]:
        """Free a set's run: (its first slot, its length); (0, 0) for a set not placed."""
        base, n = self.bases.get(set_id, 0), self.lengths.get(set_id, 0)
        if self._journal is not None:
            self._journal.note(self, set_id, base, n)
        self.bases.pop(set_id, None)
        self.lengths.pop(set_id, None)
        if self.starts.get(base) == set_id:
            del self.starts[base]
        self.used[base : base + n] = bytes(n)
        self.taken -= n
        return base, n

    def keep(self) -> None:
        """The writes of the last `place` were made: forget how to undo it."""
        self._journal = None

    def undo(self) -> None:
        """Put the space back as it was before the last `place` (its writes were not
        made)."""
        journal, self._journal = self._journal, None
        if journal is not None:
            journal.undo(self)

    def place(self, stages: list[Writes], before: Before) -> tuple[list[Writes], SlotSpace]:
        """`stages` (each in the order of Writes, written one after the other) as writes by
        slot index: sets_to_write and sets_to_delete keyed by first slot, frontends'
        values naming first slots, stages that move sets together inserted where a set
        finds no free run; and the space after them all: this space itself, changed (`undo`
        puts it back when the writes are not made). Raises CapacityError, the space as it
        was, when a set finds no run even after the moves."""
        self._journal = _Journal(self)
        try:
            return self._place(stages, before), self
        except BaseException:
            self.undo()
            raise

    def _place(self, stages: list[Writes], before: Before) -> list[Writes]:
        space = self
        out: list[Writes] = []
        frontends = _Frontends(before)  # as the stages so far left them
        written: dict[int, SetContent] = {}  # sets the stages wrote, by set id
        for stage in stages:
            if space.taken + sum(map(len, stage.sets_to_write.values())) >= space.size:
                space.refuse(stage.sets_to_write)
            sets = space.place_sets(stage.sets_to_write)
            while sets is None:
                moves = space.move_one(frontends, before, written)
                if moves is None:
                    space.refuse(stage.sets_to_write)
                out.extend(moves or ())  # (moves change no frontend's set id nor count)
                sets = space.place_sets(stage.sets_to_write)
            written.update(stage.sets_to_write)
            services = {k: space.based(v) for k, v in stage.services_to_upsert.items()}
            deletes = {}
            for set_id in stage.sets_to_delete:
                base, n = space.release(set_id)
                if n:
                    deletes[base] = n
            out.append(replace(stage, sets_to_write=sets, services_to_upsert=services,
                               sets_to_delete=deletes))  # fmt: skip
            frontends.update(stage)
        return out

    def place_sets(self, sets: dict[int, SetContent]) -> dict[int, SetContent] | None:
        """Take a free run for each set (largest first): their contents by first slot, or
        None (with nothing taken) when one finds no run."""
        placed: list[int] = []
        out: dict[int, SetContent] = {}
        for set_id, content in sorted(sets.items(), key=lambda item: -len(item[1])):
            base = self.find(len(content))
            if base is None:
                for taken in placed:
                    self.release(taken)
                return None
            self.take(set_id, base, len(content))
            placed.append(set_id)
            out[base] = content
        return out

    def move_one(
        self,
        frontends: _Frontends,
        before: Before,
        written: dict[int, SetContent],
    ) -> list[Writes] | None:
        """Move the set just above the lowest free slot down onto it, closing that hole:
        the stages of the move, or None when no set can move (then every free slot is
        above every set, the free slots are one run, and a set that finds none does not
        fit at all). A set the hole can hold is moved in one stage (written there, its
        frontends flipped to it, its old run zeroed). A longer one is moved through an
        interim set, the longest part of it that a free run elsewhere holds: its
        frontends are pointed at the part, the set is written from the hole on (over its
        own old run, free by then) and they are pointed back; meanwhile new flows pick
        among the part's backends, each a backend of the set (as the interim sets of
        maps.stage_writes)."""
        at = self.starts
        hole = self.used.find(0, 1)
        while hole >= 0:
            top = self.used.find(_TAKEN, hole)
            if top < 0:
                return None  # the free slots are one run at the top
            set_id = at.get(top)
            n = self.lengths.get(set_id, 0) if set_id is not None else 0
            content = written.get(set_id) if set_id is not None else None
            if content is None and set_id is not None:
                content = before.set(set_id)
            if n and content is not None and len(content) == n and 0 not in content:
                if top - hole >= n:
                    return [self._moved(set_id, content, hole, frontends)]
                return self._moved_through_part(set_id, content, hole, frontends)
            # a broken set (it goes when its frontends leave it) or index 0: the next hole
            end = self.used.find(0, top)
            hole = end
        return None

    def _moved(
        self,
        set_id: int,
        content: SetContent,
        target: int,
        frontends: _Frontends,
        count: int | None = None,
    ) -> Writes:
        """The stage that moves `set_id` (all of `content`, or its first `count` slots)
        to `target`, a free run."""
        n = len(content) if count is None else count
        base, old = self.release(set_id)
        self.take(set_id, target, n)
        flips = {}
        for key in frontends.naming(set_id):
            value = self.based(frontends.value(key))
            if value.set_id == target:
                value = replace(value, count=n)
            if value.internal_set_id == target:
                value = replace(value, internal_count=n)
            flips[key] = value
        return Writes(sets_to_write={target: content[:n]}, services_to_upsert=flips,
                      sets_to_delete={base: old})  # fmt: skip

    def _moved_through_part(
        self,
        set_id: int,
        content: SetContent,
        target: int,
        frontends: _Frontends,
    ) -> list[Writes]:
        """`_moved` for a set longer than the hole at `target`: through the longest part
        of it that a free run outside the hole holds (at least one slot: the slots free
        are more than the hole, or the set that asked would have fitted in it)."""
        n = len(content)
        longest, where = 0, 0
        i = self.used.find(0, 1)
        while i >= 0:
            end = self.used.find(_TAKEN, i)
            end = self.size if end < 0 else end
            if i != target and end - i > longest:
                longest, where = end - i, i
            i = self.used.find(0, end)
        if not longest:
            raise AssertionError("a set to move and no free slot beside its hole")
        part = self._moved(set_id, content, where, frontends, count=min(longest, n - 1))
        whole = self._moved(set_id, content, target, frontends)
        return [part, whole]

    def refuse(self, sets: dict[int, SetContent]) -> NoReturn:
        """Raise the CapacityError of sets that find no free run even after the moves."""
        need = sum(map(len, sets.values()))
        capacity = self.size - 1  # index 0 names no set
        longest = max(map(len, sets.values()), default=0)
        raise CapacityError(
            "slots", self.taken + need, capacity,
            f": no run of {longest} free slots for a set is left even after moving sets "
            "together",
        )  # fmt: skip


class _Frontends:
    """The frontends' values as the stages placed so far leave them (over `before`), and,
    from the first move on, which frontends name each set (kept up to date stage by
    stage, so that a move does not look at every frontend)."""

    __slots__ = ("before", "refs", "view")

    def __init__(self, before: Before) -> None:
        self.before = before
        self.view: dict[FrontendKey, ServiceValue | None] = {}
        self.refs: dict[int, set[FrontendKey]] | None = None

    def value(self, key: FrontendKey) -> ServiceValue | None:
        return self.view[key] if key in self.view else self.before.service(key)

    def naming(self, set_id: int) -> list[FrontendKey]:
        if self.refs is None:
            self.refs = {}
            keys = set(self.view)
            keys.update(self.before.frontends())
            for key in keys:
                self._refer(key, self.value(key), True)
        return [k for k in self.refs.get(set_id, ()) if self.value(k) is not None]

    def update(self, stage: Writes) -> None:
        changes: dict[FrontendKey, ServiceValue | None] = dict(stage.services_to_upsert)
        changes.update(dict.fromkeys(stage.frontends_to_delete))
        if self.refs is not None:
            for key, value in changes.items():
                self._refer(key, self.value(key), False)
                self._refer(key, value, True)
        self.view.update(changes)

    def _refer(self, key: FrontendKey, value: ServiceValue | None, named: bool) -> None:
        assert self.refs is not None
        if value is None:
            return
        for set_id in {value.set_id, value.internal_set_id} - {0}:
            if named:
                self.refs.setdefault(set_id, set()).add(key)
            else:
                self.refs.get(set_id, set()).discard(key)


class _Journal:
    """What a `place` changed in a space: each set's place before its first change, each
    run of `used` before it was marked, and the counters."""

    __slots__ = ("cursor", "runs", "sets", "taken")

    def __init__(self, space: SlotSpace) -> None:
        self.cursor, self.taken = space.cursor, space.taken
        self.sets: dict[int, tuple[int, int] | None] = {}
        self.runs: list[tuple[int, bytes]] = []

    def note(self, space: SlotSpace, set_id: int, base: int, n: int) -> None:
        if set_id not in self.sets:
            where = space.bases.get(set_id)
            self.sets[set_id] = None if where is None else (where, space.lengths[set_id])
        self.runs.append((base, bytes(space.used[base : base + n])))

    def undo(self, space: SlotSpace) -> None:
        for base, old in reversed(self.runs):
            space.used[base : base + len(old)] = old
        starts = space.starts
        for set_id in self.sets:
            base = space.bases.pop(set_id, None)
            space.lengths.pop(set_id, None)
            if base is not None and starts.get(base) == set_id:
                del starts[base]
        for set_id, where in self.sets.items():
            if where is not None:
                space.bases[set_id], space.lengths[set_id] = where
                if where[1]:
                    starts[where[0]] = set_id
        space.cursor, space.taken = self.cursor, self.taken
