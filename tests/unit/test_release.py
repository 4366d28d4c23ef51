"""agent/release.py: what is handed over is freed (by the background thread, in batches),
and what someone else still holds is left exactly as it was."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from agent import release


class Item:
    """A decoded object stand-in that a weak reference can watch."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.parts = (str(n), [n])


@dataclass(slots=True)
class Load:
    entries: list[Item] = field(default_factory=list)
    reports: list[str] = field(default_factory=list)


N = 5 * release.BATCH + 7  # several batches, and a short last one


def items(n: int = N) -> list[Item]:
    return [Item(i) for i in range(n)]


def test_a_dict_of_loads_of_long_lists_is_freed_whole() -> None:
    files = {"a.yaml": Load(items()), "b.yaml": Load(items(3), ["a report"])}
    watched = [weakref.ref(i) for load in files.values() for i in load.entries]
    release.release(files)
    del files
    assert release.wait_idle(30)
    assert not any(ref() for ref in watched)


def test_what_someone_else_still_holds_is_left_as_it_was() -> None:
    shared = items()
    other = Load(items())
    kept = other.entries
    release.release({"x": shared, "y": other})
    del other
    assert release.wait_idle(30)
    assert [i.n for i in shared] == list(range(N))  # not emptied, nothing freed
    assert [i.n for i in kept] == list(range(N))


def test_a_tuple_and_a_set_are_taken_apart_and_freed() -> None:
    values = items()
    watched = [weakref.ref(i) for i in values]
    release.release(tuple(values), {i.n for i in values})
    del values
    assert release.wait_idle(30)
    assert not any(ref() for ref in watched)


class Traced(Item):
    freed_by: list[str] = []

    def __del__(self) -> None:
        import threading

        Traced.freed_by.append(threading.current_thread().name)


def test_the_items_are_freed_by_the_release_thread_not_the_caller() -> None:
    Traced.freed_by.clear()
    release.release({"a.yaml": Load([Traced(i) for i in range(N)])})
    assert release.wait_idle(30)
    assert len(Traced.freed_by) == N
    assert set(Traced.freed_by) == {"release"}
