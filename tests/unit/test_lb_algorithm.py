"""The kube-bpf-proxy.io/lb-algorithm annotation reaches NodeState as `lbAlgorithm`."""

from __future__ import annotations

import pytest

from agent.model.compile import compile
from agent.model.decode import decode_object

from ..builders import make_endpoint, make_service, make_slice, state_of

ANNOTATION = "kube-bpf-proxy.io/lb-algorithm"


def annotated(value: str | None) -> dict:
    def mutate(obj: dict) -> None:
        if value is not None:
            obj["metadata"]["annotations"] = {ANNOTATION: value}

    return make_service(mutate=mutate)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, "hash"),
        ("hash", "hash"),
        ("maglev", "maglev"),
        (" Maglev ", "maglev"),
        ("random", "random"),
    ],
)
def test_annotation_selects_the_algorithm(value: str | None, expected: str) -> None:
    state = state_of(annotated(value), make_slice(endpoints=[make_endpoint("10.244.2.5")]))
    [entry] = compile(state, "node-a").services
    assert entry.lb_algorithm == expected
    assert entry.to_dict()["lbAlgorithm"] == expected


def test_unknown_algorithm_is_reported_and_hash_is_used() -> None:
    decoded = decode_object(annotated("round-robin"))
    assert decoded.value.lb_algorithm == "hash"
    assert any(ANNOTATION in w and "round-robin" in w for w in decoded.warnings), decoded
