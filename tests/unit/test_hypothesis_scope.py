"""Hypothesis mines constants only from this project's code, never from Debian's
packages that the venv sees (tests/conftest.py): parsing bcc's source warned."""

from __future__ import annotations

import pytest
from hypothesis.internal.constants_ast import is_local_module_file

import agent.sources.manifests


def test_system_packages_are_not_taken_for_local_code() -> None:
    bcc = pytest.importorskip("bcc")
    assert not is_local_module_file(bcc.__file__)
    assert is_local_module_file(agent.sources.manifests.__file__)

