"""NodeState documents as text: one YAML style and one JSON style for every output
(`compile`, `/state`), so the same state always reads the same."""

from __future__ import annotations

import json
from typing import Any

import yaml

from .model.nodestate import NodeState

try:  # libyaml's emitter where available
    YamlDumper: type = yaml.CSafeDumper
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    YamlDumper = yaml.SafeDumper


def dump_yaml(document: dict[str, Any]) -> str:
    """Key order kept; leaf mappings (backends, frontends) on one line each."""
    return yaml.dump(
        document, Dumper=YamlDumper, sort_keys=False, default_flow_style=None, width=200
    )


def dump_json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False)


def render(state: NodeState, output: str) -> str:
    """The NodeState document as YAML or JSON text (deterministic)."""
    document = state.to_dict()
    if output == "json":
        return dump_json(document) + "\n"
    return dump_yaml(document)
