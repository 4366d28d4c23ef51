"""Golden NodeStates of the example manifests, one per node of the example cluster.

A change to these files is a change to what the dataplanes program: review the diff.
Regenerate with `KBP_UPDATE_GOLDEN=1 make test PYTEST_ARGS=tests/unit/test_golden.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from agent.cli import render
from agent.model.compile import CompileOptions, compile
from agent.sources.manifests import load_manifests

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GOLDEN = ROOT / "tests" / "golden"
OPTIONS = CompileOptions(cluster_name="member1", cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"))


@pytest.mark.parametrize("node", ["node-a", "node-b", "node-c"])
def test_examples_compile_to_the_golden_node_state(node: str) -> None:
    state, reports = load_manifests([EXAMPLES])
    assert reports == []
    text = render(compile(state, node, OPTIONS), "yaml")
    golden = GOLDEN / f"examples-{node}.yaml"
    if os.environ.get("KBP_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs; see the module docstring"


def test_json_and_yaml_outputs_are_the_same_document() -> None:
    state, _ = load_manifests([EXAMPLES])
    node_state = compile(state, "node-a", OPTIONS)
    assert json.loads(render(node_state, "json")) == yaml.safe_load(render(node_state, "yaml"))


def test_every_example_service_is_in_some_golden_or_deliberately_absent() -> None:
    """The LWS headless per-replica Services must be absent; everything else present."""
    programmed = {
        (e["namespace"], e["name"])
        for node in ("node-a", "node-b", "node-c")
        for e in yaml.safe_load((GOLDEN / f"examples-{node}.yaml").read_text())["services"]
    }
    state, _ = load_manifests([EXAMPLES])
    headless = {("ml", "llm-0"), ("ml", "llm-1")}
    assert programmed == set(state.services) - headless
