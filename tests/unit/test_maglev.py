"""Maglev tables (agent/dataplane/ebpf/maglev.py): balance, minimal disruption, stability.

Backend names are "ip:port" as plan.py writes them: pods 10.244.0.<n>:8080 (and
[fd00:244::<n>]:8080), table size 16381 unless a case says otherwise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.dataplane.ebpf.maglev import DEFAULT_TABLE_SIZE, is_prime, maglev_table

from .strategies import property_settings

SIZE = DEFAULT_TABLE_SIZE
ROOT = Path(__file__).resolve().parents[2]

SETTINGS = property_settings()


def pods(n: int, first: int = 1) -> list[str]:
    return [f"10.244.0.{i}:8080" for i in range(first, first + n)]


def moved(before: list[str], after: list[str]) -> int:
    """Slots whose backend differs between two tables given as names per slot."""
    return sum(1 for a, b in zip(before, after, strict=True) if a != b)


def resolved(names: list[str], size: int = SIZE) -> list[str]:
    return [names[i] for i in maglev_table(names, size)]


# --- is_prime --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "prime"),
    [
        pytest.param(0, False, id="zero is not prime"),
        pytest.param(1, False, id="one is not prime"),
        pytest.param(2, True, id="two is the smallest prime"),
        pytest.param(3, True, id="three is prime"),
        pytest.param(4, False, id="four is even"),
        pytest.param(25, False, id="a square of a prime is not prime"),
        pytest.param(16381, True, id="the default table size is prime"),
        pytest.param(65537, True, id="a Fermat prime is prime"),
        pytest.param(16383, False, id="a Mersenne number with a composite exponent is not"),
        pytest.param(-7, False, id="negative numbers are not prime"),
    ],
)
def test_is_prime(n: int, prime: bool) -> None:
    assert is_prime(n) is prime


def test_is_prime_agrees_with_a_sieve_up_to_two_thousand() -> None:
    limit = 2000
    sieve = [True] * limit
    sieve[0] = sieve[1] = False
    for i in range(2, limit):
        if sieve[i]:
            for j in range(i * i, limit, i):
                sieve[j] = False
    assert [n for n in range(limit) if is_prime(n)] == [n for n in range(limit) if sieve[n]]


# --- errors ----------------------------------------------------------------------------


@dataclass
class BadCase:
    name: str
    names: list[str]
    size: int
    message: str


BAD_CASES = [
    BadCase("a table size that is not prime is refused", pods(3), 16384, "16384 is not a prime"),
    BadCase("a table no larger than the backends is refused", pods(13), 13, "too small for 13"),
    BadCase("a table smaller than the backends is refused", pods(20), 17, "too small for 20"),
    BadCase("repeated backend names are refused", ["a:1", "b:1", "a:1"], 13, "must be unique"),
]


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.name)
def test_bad_input_raises_value_error_naming_the_problem(case: BadCase) -> None:
    with pytest.raises(ValueError, match=case.message):
        maglev_table(case.names, case.size)


def test_no_backends_give_an_empty_table_whatever_the_size() -> None:
    assert maglev_table([], SIZE) == []
    assert maglev_table([], 4) == []


# --- shape and balance -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("backends", "size"),
    [
        pytest.param(1, 13, id="one backend fills every slot"),
        pytest.param(3, 13, id="three backends in a tiny table"),
        pytest.param(10, SIZE, id="ten backends in the default table"),
        pytest.param(100, SIZE, id="a hundred backends in the default table"),
        pytest.param(1000, SIZE, id="a thousand backends in the default table"),
    ],
)
def test_every_backend_gets_its_share_within_one_slot(backends: int, size: int) -> None:
    table = maglev_table(pods(backends), size)
    assert len(table) == size
    counts = Counter(table)
    assert set(counts) == set(range(backends)), "every backend is present"
    low, high = size // backends, -(-size // backends)
    assert all(low <= c <= high for c in counts.values()), counts.most_common(3)


@SETTINGS
@given(
    names=st.lists(
        st.integers(1, 250).map(lambda n: f"10.244.0.{n}:8080"), min_size=1, max_size=30,
        unique=True,
    ),
    size=st.sampled_from([31, 61, 251, 1021]),
)  # fmt: skip
def test_any_table_is_full_and_balanced(names: list[str], size: int) -> None:
    table = maglev_table(names, size)
    counts = Counter(table)
    assert len(table) == size
    assert set(counts) == set(range(len(names)))
    assert max(counts.values()) - min(counts.values()) <= 1


# --- disruption ------------------------------------------------------------------------


@pytest.mark.parametrize("removed", [0, 4, 9], ids=lambda i: f"removing backend {i} of 10")
def test_removing_one_of_ten_backends_moves_under_two_tenths_of_the_slots(removed: int) -> None:
    names = pods(10)
    before = resolved(names)
    after = resolved(names[:removed] + names[removed + 1 :])
    gone = before.count(names[removed])
    assert moved(before, after) < 2 * SIZE / 10
    # The removed backend's own slots are the bulk of the change.
    assert moved(before, after) >= gone
    assert names[removed] not in after


def test_adding_an_eleventh_backend_moves_under_two_elevenths_of_the_slots() -> None:
    before = resolved(pods(10))
    after = resolved(pods(11))
    assert moved(before, after) < 2 * SIZE / 11


def test_order_of_the_names_does_not_change_which_backend_a_slot_names() -> None:
    """Every node lists the same backends, but agreement must not depend on list order."""
    names = pods(10)
    shuffled = names[5:] + names[:5]
    # Turn-taking follows the list order, so a few contested slots may differ; the
    # preferences come from the names alone, so nearly all agree.
    assert moved(resolved(names), resolved(shuffled)) < SIZE / 20


# --- stability -------------------------------------------------------------------------


def test_a_known_input_gives_a_fixed_table() -> None:
    """Pinned: changing the hashes would make old and new agents disagree on flows."""
    names = ["10.244.1.5:8080", "10.244.2.5:8080", "[fd00:244:1::5]:8080"]
    assert maglev_table(names, 13) == [0, 1, 2, 2, 2, 1, 0, 1, 0, 0, 0, 2, 1]
    assert maglev_table(pods(10), SIZE)[:24] == [
        0, 8, 7, 5, 0, 1, 1, 9, 0, 8, 6, 3, 0, 3, 7, 8, 0, 1, 3, 0, 5, 8, 1, 2,
    ]  # fmt: skip


def test_another_process_with_another_hash_seed_builds_the_same_table() -> None:
    script = (
        "import json; from agent.dataplane.ebpf.maglev import maglev_table; "
        f"print(json.dumps(maglev_table({pods(10)!r}, 1021)))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    assert json.loads(out.stdout) == maglev_table(pods(10), 1021)


def test_the_result_is_a_fresh_list_each_time() -> None:
    table = maglev_table(pods(3), 13)
    table[0] = 99
    assert maglev_table(pods(3), 13)[0] != 99
