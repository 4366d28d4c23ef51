"""Maglev consistent hashing: the lookup table a Maglev backend set is written as.

Every node builds the same table from the same backend names (hashes are keyed BLAKE2b,
not Python's per-process `hash`), so a flow hashes to the same backend wherever it lands,
and removing one of N backends moves only about 1/N of the slots.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import lru_cache

DEFAULT_TABLE_SIZE = 16381  # prime; ~1600 slots per backend at 10 backends

# Two independent hashes of a name: where its preference list starts, and its stride.
_OFFSET_PERSON = b"kbp-maglev-off"
_SKIP_PERSON = b"kbp-maglev-skip"


def is_prime(n: int) -> bool:
    """True when n is a prime number (trial division: table sizes are small)."""
    if n < 2:
        return False
    if n < 4:
        return True
    if n % 2 == 0 or n % 3 == 0:
        return False
    i = 5
    while i * i <= n:
        if n % i == 0 or n % (i + 2) == 0:
            return False
        i += 6
    return True


def _hash(name: str, person: bytes) -> int:
    digest = hashlib.blake2b(name.encode(), digest_size=8, person=person).digest()
    return int.from_bytes(digest, "little")


def preference(name: str, size: int) -> tuple[int, int]:
    """(offset, skip) of `name`'s preference list: slot j of the list is
    (offset + j * skip) % size, a permutation of all slots because size is prime."""
    return _hash(name, _OFFSET_PERSON) % size, _hash(name, _SKIP_PERSON) % (size - 1) + 1


def check_table_size(size: int, backends: int = 0) -> None:
    """Raise ValueError unless `size` can hold a Maglev table for `backends` backends."""
    if not is_prime(size):
        raise ValueError(f"Maglev table size {size} is not a prime number")
    if backends >= size:
        raise ValueError(
            f"Maglev table size {size} is too small for {backends} backends "
            "(it must be larger than the number of backends)"
        )


def maglev_table(names: Sequence[str], size: int) -> list[int]:
    """The Maglev lookup table: for each of `size` slots, the index in `names` of its backend.

    `size` must be prime and larger than the number of names; names must be unique. The
    backends take turns claiming the next free slot of their own preference list, so each
    ends up with either floor(size/N) or ceil(size/N) slots.
    """
    if not names:
        return []
    if len(set(names)) != len(names):
        raise ValueError("Maglev backend names must be unique")
    check_table_size(size, len(names))
    return list(_table(tuple(names), size))


@lru_cache(maxsize=64)
def _table(names: tuple[str, ...], size: int) -> tuple[int, ...]:
    """maglev_table without the checks, memoised: a full resync rebuilds every Maglev set
    of the node, and a table costs ~10 ms of pure Python (size * ln(size) probes)."""
    n = len(names)
    prefs = [preference(name, size) for name in names]
    position = [offset for offset, _ in prefs]  # next slot each backend will try
    skips = [skip for _, skip in prefs]
    table = [-1] * size
    filled = 0
    while True:
        for i in range(n):
            slot = position[i]
            skip = skips[i]
            while table[slot] >= 0:
                slot += skip
                if slot >= size:
                    slot -= size
            table[slot] = i
            slot += skip
            position[i] = slot - size if slot >= size else slot
            filled += 1
            if filled == size:
                return tuple(table)
