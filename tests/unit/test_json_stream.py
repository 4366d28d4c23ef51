"""The streaming JSON reader yields exactly what `json.loads` + list flattening would,
whatever the key order of a LIST, and rejects what `json.loads` rejects."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.sources.manifests import _json_objects, _Syntax, iter_objects

scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=5)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
items = st.lists(
    st.dictionaries(st.sampled_from(["kind", "apiVersion", "metadata", "spec"]), values, max_size=4)
    | values,
    max_size=4,
)
lists = st.fixed_dictionaries(
    {"items": items | st.none()},
    optional={
        "kind": st.sampled_from(["List", "ServiceList", "EndpointSliceList", "Other"]),
        "apiVersion": st.sampled_from(["v1", "discovery.k8s.io/v1"]),
        "metadata": values,
    },
)


def expected(text: str) -> list[tuple[str, Any]]:
    return list(iter_objects(json.loads(text), "f.json"))


def streamed(text: str) -> list[tuple[str, Any]]:
    return sorted(_json_objects(text, "f.json"), key=lambda pair: pair[0]) if text else []


@settings(max_examples=500, derandomize=True, database=None)
@given(document=lists | values, data=st.data())
def test_streaming_equals_loading_whole(document: Any, data: st.DataObject) -> None:
    if isinstance(document, dict):  # any key order, as kubectl (sorted) or the API writes it
        keys = data.draw(st.permutations(list(document)))
        document = {k: document[k] for k in keys}
    text = json.dumps(document, indent=data.draw(st.sampled_from([None, 1])))
    want = sorted(expected(text), key=lambda pair: pair[0])
    assert streamed(text) == want


def test_kind_less_items_before_the_list_kind_get_it() -> None:
    text = '{"apiVersion": "v1", "items": [{"metadata": {"name": "a"}}], "kind": "ServiceList"}'
    ((where, item),) = _json_objects(text, "f.json")
    assert (where, item["kind"], item["apiVersion"]) == ("f.json items[0]", "Service", "v1")


def test_kind_less_items_before_the_list_api_version_get_it() -> None:
    text = (
        '{"kind": "ServiceList", "items": [{"metadata": {}}, {"kind": "Node"}], "apiVersion": "v"}'
    )
    assert sorted(_json_objects(text, "f.json"), key=lambda pair: pair[0]) == [
        ("f.json items[0]", {"kind": "Service", "apiVersion": "v", "metadata": {}}),
        ("f.json items[1]", {"kind": "Node"}),
    ]


@pytest.mark.parametrize(
    "text",
    [
        '{"items": [{"a": 1},]}',
        '{"items": [{"a": 1}], }',
        '{"items": [{"a": 1}]} x',
        '{"items" [1]}',
        '{"items": [1 2]}',
        '{"items": [1',
        "{1: [1]}",
    ],
    ids=[
        "a trailing comma in items",
        "a trailing comma in the object",
        "data after the document",
        "a missing colon",
        "a missing comma",
        "a truncated file",
        "a property name that is not a string",
    ],
)
def test_invalid_json_is_rejected(text: str) -> None:
    with pytest.raises((json.JSONDecodeError, _Syntax)):
        json.loads(text)
    with pytest.raises((json.JSONDecodeError, _Syntax)):
        list(_json_objects(text, "f.json"))
