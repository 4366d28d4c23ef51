"""The file source: which files it reads, which document shapes it understands, and what
it reports, ignores or warns about (issue 2 §2, docs/nodestate.md).

Address plan: tests/builders.py. Generated files live in tmp_path; tests/data/manifests
holds one Service with its slices and Node written by hand as YAML and as JSON.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.model.compile import compile
from agent.model.types import ClusterState
from agent.sources.manifests import Report, load_manifests

from ..builders import Obj, make_endpoint, make_node, make_service, make_slice, state_of

DATA = Path(__file__).resolve().parents[1] / "data" / "manifests"

SERVICE = make_service("shop", "web")
SLICE = make_slice("shop", "web-1", "web", [make_endpoint("10.244.1.5", "node-a")])
NODE = make_node("node-a", {"topology.kubernetes.io/zone": "zone-1"}, "192.0.2.10")
ALL = ["EndpointSlice shop/web-1", "Node node-a", "Service shop/web"]  # as `loaded` sorts
WEB = ["Service shop/web"]


def loaded(state: ClusterState) -> list[str]:
    """Every object in the state as "Kind namespace/name", sorted."""
    return sorted(
        [f"Service {ns}/{name}" for ns, name in state.services]
        + [f"EndpointSlice {ns}/{name}" for ns, name in state.slices]
        + [f"Node {name}" for name in state.nodes]
    )


def as_yaml(*objects: Any) -> str:
    return "---\n".join(yaml.safe_dump(o, sort_keys=False) for o in objects)


def as_json(obj: Any) -> str:
    return json.dumps(obj, indent=2)


def without_kind(obj: Obj) -> Obj:
    """An item of a typed API list (`ServiceList`): no kind, no apiVersion."""
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def messages(reports: list[Report]) -> list[str]:
    return [f"{'error' if r.error else 'warning'}: {r}" for r in reports]


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


# --- document shapes ---------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    id: str
    file: str
    text: str
    objects: list[str]


SHAPES = [
    Shape("multi-document YAML with empty and comment-only documents", "all.yaml",
          "---\n---\n" + as_yaml(SERVICE) + "---\n# only a comment\n---\n"
          + as_yaml(SLICE, NODE) + "---\n...\n", ALL),
    Shape("a YAML file holding one object", "web.yml", as_yaml(SERVICE), WEB),
    Shape("a JSON file holding one object", "web.json", as_json(SERVICE), WEB),
    Shape("a YAML kind List", "list.yaml",
          as_yaml({"apiVersion": "v1", "kind": "List", "items": [SERVICE, SLICE, NODE]}), ALL),
    Shape("a JSON kind List as kubectl get -o json prints it", "list.json",
          as_json({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": ""},
                   "items": [SERVICE, SLICE, NODE]}), ALL),
    Shape("a JSON ServiceList from an API LIST whose items carry no kind", "services.json",
          as_json({"kind": "ServiceList", "apiVersion": "v1",
                   "metadata": {"resourceVersion": "4711"}, "items": [without_kind(SERVICE)]}),
          WEB),
    Shape("typed Service, EndpointSlice and Node lists in one YAML file", "typed.yaml",
          as_yaml({"kind": "ServiceList", "apiVersion": "v1", "items": [without_kind(SERVICE)]},
                  {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                   "items": [without_kind(SLICE)]},
                  {"kind": "NodeList", "apiVersion": "v1", "items": [without_kind(NODE)]}), ALL),
    Shape("an empty kind List", "empty-list.yaml",
          as_yaml({"apiVersion": "v1", "kind": "List", "items": []}), []),
    Shape("a YAML file of comments only", "comments.yaml", "# nothing here yet\n", []),
]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=[s.id for s in SHAPES])
def test_every_document_shape_loads_its_objects_without_reports(
    shape: Shape, tmp_path: Path
) -> None:
    state, reports = load_manifests([write(tmp_path, shape.file, shape.text)])
    assert messages(reports) == []
    assert loaded(state) == shape.objects
    reference = state_of(SERVICE, SLICE, NODE)
    for key, service in state.services.items():
        assert service == reference.services[key]
    for key, endpoint_slice in state.slices.items():
        assert endpoint_slice == reference.slices[key]
    for name, node in state.nodes.items():
        assert node == reference.nodes[name]


def test_a_malformed_item_of_a_typed_list_is_reported_with_its_index_and_kind(
    tmp_path: Path,
) -> None:
    bad = without_kind(make_service("shop", "broken"))
    bad["spec"]["ports"][0]["port"] = 0
    path = write(
        tmp_path,
        "services.json",
        as_json({"kind": "ServiceList", "apiVersion": "v1", "items": [without_kind(SERVICE), bad]}),
    )
    state, reports = load_manifests([path])
    assert messages(reports) == [
        f"error: {path} items[1]: Service shop/broken: "
        "spec.ports[0].port: 0 is out of range 1..65535; skipped"
    ]
    assert loaded(state) == ["Service shop/web"]


# --- files and directories ---------------------------------------------------------------


def test_directories_are_searched_recursively_for_yaml_yml_and_json_only(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    write(tree, "services.yaml", as_yaml(SERVICE))
    write(tree, "deeper/slices.yml", as_yaml(SLICE))
    write(tree, "deeper/still/nodes.json", as_json(NODE))
    for name, other in (
        ("notes.txt", "readme"),
        ("README.md", "markdown"),
        ("services.yaml.bak", "backup"),
        ("deeper/kustomization.yaml.orig", "orig"),
    ):
        write(tree, name, as_yaml(make_service("shop", other)))
    state, reports = load_manifests([tree])
    assert messages(reports) == []
    assert loaded(state) == ALL


def with_cluster_ip(ip: str) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        obj["spec"].update(clusterIP=ip, clusterIPs=[ip])

    return mutate


def test_files_of_a_directory_are_read_in_sorted_order_so_the_last_one_wins(
    tmp_path: Path,
) -> None:
    names = ["10-base.yaml", "20-team/overlay.yml", "20-team/zz.json", "30-final.yaml"]
    for i, name in reversed(list(enumerate(names, start=1))):  # created in reverse order
        text = (as_json if name.endswith(".json") else as_yaml)(
            make_service("shop", "web", with_cluster_ip(f"10.96.0.{i}"))
        )
        write(tmp_path, name, text)
    state, reports = load_manifests([tmp_path])
    assert state.services[("shop", "web")].cluster_ips == ("10.96.0.4",)
    where = [r.where for r in reports]
    assert where == [
        f"{tmp_path / '20-team/overlay.yml'} (document 1)",
        str(tmp_path / "20-team/zz.json"),
        f"{tmp_path / '30-final.yaml'} (document 1)",
    ]
    assert all(not r.error for r in reports)


def test_files_named_on_the_command_line_are_read_in_the_order_given(tmp_path: Path) -> None:
    first = write(
        tmp_path, "a.yaml", as_yaml(make_service("shop", "web", with_cluster_ip("10.96.0.1")))
    )
    second = write(
        tmp_path, "b.yaml", as_yaml(make_service("shop", "web", with_cluster_ip("10.96.0.2")))
    )
    state, _ = load_manifests([second, first])
    assert state.services[("shop", "web")].cluster_ips == ("10.96.0.1",)


def test_a_path_that_does_not_exist_is_reported_and_the_others_still_load(
    tmp_path: Path,
) -> None:
    missing = tmp_path / "no-such-dir" / "services.yaml"
    present = write(tmp_path, "services.yaml", as_yaml(SERVICE))
    state, reports = load_manifests([missing, present])
    assert messages(reports) == [f"error: {missing}: no such file or directory"]
    assert loaded(state) == ["Service shop/web"]


@pytest.mark.parametrize(
    "files",
    [[], ["README.md", "notes.txt", "sub/ignored.yaml.bak"]],
    ids=["an empty directory is reported", "a directory without manifest files is reported"],
)
def test_a_directory_without_manifests_is_reported(files: list[str], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for name in files:
        write(empty, name, as_yaml(SERVICE))
    state, reports = load_manifests([empty])
    assert len(reports) == 1
    assert reports[0].error
    assert str(empty) in str(reports[0])
    assert "no manifest files found" in reports[0].message
    assert loaded(state) == []


# --- what is ignored without a report ----------------------------------------------------


@dataclass(frozen=True)
class Ignored:
    id: str
    obj: Obj
    kind: str  # as the debug note names it


def endpoint_slice_v1beta1() -> Obj:
    obj = make_slice("shop", "web-beta", "web", [make_endpoint("10.244.2.5", "node-b")])
    obj["apiVersion"] = "discovery.k8s.io/v1beta1"
    obj["endpoints"][0]["topology"] = {"kubernetes.io/hostname": "node-b"}
    return obj


def headless_slice() -> Obj:
    obj = make_slice("shop", "web-headless", "web", [make_endpoint("10.244.2.6", "node-b")])
    obj["metadata"]["labels"]["service.kubernetes.io/headless"] = ""
    return obj


def fqdn_slice() -> Obj:
    obj = make_slice("shop", "web-fqdn", "web", [make_endpoint("db.example.com")])
    obj["addressType"] = "FQDN"
    return obj


SHOP_WEB = {"namespace": "shop", "name": "web"}
IGNORED = [
    Ignored("a Deployment is an unknown kind",
            {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": SHOP_WEB,
             "spec": {"replicas": 3, "template": {"spec": {"containers": [{"name": "web"}]}}}},
            "Deployment"),
    Ignored("a ConfigMap is an unknown kind",
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": SHOP_WEB,
             "data": {"port": "80"}}, "ConfigMap"),
    Ignored("an Endpoints object is not read (slices are)",
            {"apiVersion": "v1", "kind": "Endpoints", "metadata": SHOP_WEB,
             "subsets": [{"addresses": [{"ip": "10.244.2.7"}], "ports": [{"port": 8080}]}]},
            "Endpoints"),
    Ignored("a discovery.k8s.io/v1beta1 EndpointSlice is an unknown version",
            endpoint_slice_v1beta1(), "EndpointSlice"),
    Ignored("an MCS ServiceExport is not a kind the agent reads",
            {"apiVersion": "multicluster.x-k8s.io/v1alpha1", "kind": "ServiceExport",
             "metadata": SHOP_WEB}, "ServiceExport"),
    Ignored("a slice of a headless Service is skipped", headless_slice(), "EndpointSlice"),
    Ignored("an FQDN slice is skipped", fqdn_slice(), "EndpointSlice"),
]  # fmt: skip


@pytest.mark.parametrize("case", IGNORED, ids=[c.id for c in IGNORED])
def test_objects_of_no_interest_are_ignored_with_only_a_debug_note(
    case: Ignored, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, "mixed.yaml", as_yaml(SERVICE, case.obj, SLICE))
    caplog.set_level(logging.DEBUG, logger="agent.sources.manifests")
    state, reports = load_manifests([path])
    assert messages(reports) == []
    assert loaded(state) == ["EndpointSlice shop/web-1", "Service shop/web"]
    notes = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert [n for n in notes if case.kind in n and "(document 2)" in n], notes
    node_state = compile(state, "node-a")
    assert [b.ip for e in node_state.services for b in e.cluster_backends or ()] == ["10.244.1.5"]


def test_unknown_kinds_inside_a_list_are_ignored_too(tmp_path: Path) -> None:
    items = [IGNORED[0].obj, SERVICE, IGNORED[1].obj, SLICE, fqdn_slice()]
    path = write(
        tmp_path, "list.json", as_json({"apiVersion": "v1", "kind": "List", "items": items})
    )
    state, reports = load_manifests([path])
    assert messages(reports) == []
    assert loaded(state) == ["EndpointSlice shop/web-1", "Service shop/web"]


# --- objects defined more than once ------------------------------------------------------


@dataclass(frozen=True)
class Twice:
    id: str
    first: Obj
    second: Obj
    ref: str
    check: Callable[[ClusterState], bool]  # the later definition is the one kept


TWICE = [
    Twice(
        "a Service defined twice keeps the later definition",
        make_service("shop", "web", with_cluster_ip("10.96.0.1")),
        make_service("shop", "web", with_cluster_ip("10.96.0.2")),
        "Service shop/web",
        lambda s: s.services[("shop", "web")].cluster_ips == ("10.96.0.2",),
    ),
    Twice(
        "an EndpointSlice defined twice keeps the later definition",
        make_slice("shop", "web-1", "web", [make_endpoint("10.244.1.5", "node-a")]),
        make_slice("shop", "web-1", "web", [make_endpoint("10.244.2.5", "node-b")]),
        "EndpointSlice shop/web-1",
        lambda s: [e.ip for e in s.slices[("shop", "web-1")].endpoints] == ["10.244.2.5"],
    ),
    Twice(
        "a Node defined twice keeps the later definition",
        make_node("node-a", {}, "192.0.2.10"),
        make_node("node-a", {}, "192.0.2.20"),
        "Node node-a",
        lambda s: s.nodes["node-a"].addresses == ("192.0.2.20",),
    ),
]


@pytest.mark.parametrize("case", TWICE, ids=[c.id for c in TWICE])
@pytest.mark.parametrize("layout", ["in one file", "in two files"])
def test_an_object_defined_twice_gives_a_warning_and_the_later_wins(
    case: Twice, layout: str, tmp_path: Path
) -> None:
    if layout == "in one file":
        path = write(tmp_path, "all.yaml", as_yaml(case.first, case.second))
        first, second = f"{path} (document 1)", f"{path} (document 2)"
    else:
        write(tmp_path, "a.yaml", as_yaml(case.first))
        write(tmp_path, "b.json", as_json(case.second))
        first, second = f"{tmp_path / 'a.yaml'} (document 1)", str(tmp_path / "b.json")
    state, reports = load_manifests([tmp_path])
    assert messages(reports) == [
        f"warning: {second}: {case.ref}: also defined at {first}; this later definition wins"
    ]
    assert case.check(state)


def test_the_same_name_in_another_namespace_or_of_another_kind_is_no_duplicate(
    tmp_path: Path,
) -> None:
    objects = [
        make_service("shop", "web"),
        make_service("staging", "web"),
        make_slice("shop", "web", "web"),
        make_node("web"),
    ]
    state, reports = load_manifests([write(tmp_path, "all.yaml", as_yaml(*objects))])
    assert messages(reports) == []
    assert loaded(state) == [
        "EndpointSlice shop/web",
        "Node web",
        "Service shop/web",
        "Service staging/web",
    ]


# --- JSON and YAML mean the same ---------------------------------------------------------


def test_the_same_objects_as_json_and_as_yaml_decode_to_equal_values() -> None:
    from_yaml, yaml_reports = load_manifests([DATA / "shop.yaml"])
    from_json, json_reports = load_manifests([DATA / "shop.json"])
    assert messages(yaml_reports) == messages(json_reports) == []
    assert loaded(from_yaml) == [
        "EndpointSlice shop/checkout-member2",
        "EndpointSlice shop/checkout-v4",
        "EndpointSlice shop/checkout-v6",
        "Node node-a",
        "Service shop/checkout",
    ]
    assert from_yaml.services == from_json.services
    assert from_yaml.slices == from_json.slices
    assert from_yaml.nodes == from_json.nodes
    # What the hand-written YAML means, so that equality is not equality of two mistakes.
    service = from_yaml.services[("shop", "checkout")]
    assert service.cluster_ips == ("10.96.0.20", "fd00:96::20")
    assert service.external_ips == ("203.0.113.20",)
    assert service.load_balancer_ips == ("203.0.113.21",)
    assert service.load_balancer_source_ranges == ("198.51.100.0/24", "2001:db8:100::/48")
    assert service.topology_keys == ("example.com/rack", "topology.kubernetes.io/zone", "*")
    assert service.multi_cluster == "LocalFirst"
    assert service.affinity_timeout == 300
    assert [e.ip for e in from_yaml.slices[("shop", "checkout-v6")].endpoints] == ["fd00:244:1::20"]
    assert from_yaml.nodes["node-a"].addresses == ("192.0.2.10", "2001:db8::10")
    yaml_state = compile(from_yaml, "node-a").to_dict()
    assert yaml_state == compile(from_json, "node-a").to_dict()


GENERATED: list[tuple[str, Obj]] = [
    ("a Service", make_service("shop", "web")),
    ("an EndpointSlice with hints", make_slice("shop", "web-1", "web", [
        make_endpoint("10.244.1.5", "node-a", zone="zone-1", zone_hints=["zone-1"]),
        make_endpoint("10.244.2.5", "node-b", ready=False, serving=True, terminating=True),
    ])),
    ("an IPv6 EndpointSlice", make_slice("shop", "web-6", "web", [
        make_endpoint("fd00:244:1::5", "node-a")
    ], family="IPv6")),
    ("a Node", make_node("node-a", {"example.com/rack": "r1"}, "192.0.2.10", "2001:db8::10")),
]  # fmt: skip


@pytest.mark.parametrize("obj", [o for _, o in GENERATED], ids=[i for i, _ in GENERATED])
@pytest.mark.parametrize("style", ["block", "flow"])
def test_a_generated_object_written_as_json_and_as_yaml_loads_equal(
    obj: Obj, style: str, tmp_path: Path
) -> None:
    text = yaml.safe_dump(obj, default_flow_style=style == "flow")
    from_yaml, yaml_reports = load_manifests([write(tmp_path, "obj.yaml", text)])
    from_json, json_reports = load_manifests([write(tmp_path, "obj.json", as_json(obj))])
    assert yaml_reports == json_reports == []
    assert loaded(from_yaml) == loaded(from_json) != []
    assert from_yaml.services == from_json.services
    assert from_yaml.slices == from_json.slices
    assert from_yaml.nodes == from_json.nodes


# --- encodings ---------------------------------------------------------------------------

BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize(
    "name, data",
    [
        ("web.yaml", BOM + as_yaml(SERVICE).encode()),
        ("web.json", BOM + as_json(SERVICE).encode()),
    ],
    ids=[
        "a YAML file saved with a UTF-8 byte-order mark loads",
        "a JSON file saved with a UTF-8 byte-order mark loads as the YAML one does",
    ],
)
def test_a_byte_order_mark_does_not_stop_a_file_loading(
    name: str, data: bytes, tmp_path: Path
) -> None:
    path = tmp_path / name
    path.write_bytes(data)
    state, reports = load_manifests([path])
    assert messages(reports) == []
    assert loaded(state) == WEB


def test_a_file_that_is_not_utf8_is_reported_and_the_others_still_load(tmp_path: Path) -> None:
    latin1 = tmp_path / "a-latin1.yaml"
    latin1.write_bytes(
        ("# Caf\xe9 team\n" + as_yaml(make_service("shop", "cafe"))).encode("latin-1")
    )
    write(tmp_path, "b.yaml", as_yaml(SERVICE))
    state, reports = load_manifests([tmp_path])
    assert len(reports) == 1
    assert reports[0].error
    assert reports[0].where == str(latin1)
    assert "cannot read" in reports[0].message
    assert loaded(state) == WEB
