"""Fixtures for kernel tests: the namespace lab (tests/lab/nodelab.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.lab.nodelab import Lab


@pytest.fixture
def lab() -> Iterator[Lab]:
    """A fresh node namespace (add pods with `lab.add_pod(name)`); removed afterwards,
    pods, processes and all, also when the test failed."""
    with Lab() as made:
        yield made
