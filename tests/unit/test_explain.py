"""`explain`'s semantic half over the example cluster: one named case per row of the
routing table (docs/nodestate.md), per topology mode, LocalFirst tier, the terminating
fallback, source ranges, refusals and drops. Each case checks its outcome and set; the
reports together are a golden file (tests/golden/explain-examples.txt): review its diff.
Regenerate with `KBP_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/test_explain.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import pytest

from agent.cli import main
from agent.explain.command import Inputs, run_explain, state_from_manifests
from agent.explain.semantics import (
    NOT_A_SERVICE,
    QueryError,
    Target,
    parse_target,
)
from agent.model.compile import CompileOptions
from agent.model.outcome import BACKENDS, DROPPED, REFUSED

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = [str(ROOT / "examples"), str(ROOT / "tests" / "data" / "explain")]
GOLDEN = ROOT / "tests" / "golden" / "explain-examples.txt"
OPTIONS = CompileOptions(cluster_name="member1", cluster_cidrs=("10.244.0.0/16", "fd00:244::/32"))
POD = "10.244.1.5"  # a client pod on node-a (the examples' address plan)


class Case(NamedTuple):
    name: str
    node: str
    source: str
    target: str
    outcome: str
    set_name: str | None  # None: no set (not a Service, or refused before one)
    backends: tuple[str, ...] = ()  # the set's addresses, when the case pins them
    left_out: tuple[str, ...] = ()


# fmt: off
CASES = [
    Case("ClusterIP, internalTrafficPolicy Cluster: clusterBackends, unready endpoint left out",
         "node-a", POD, "10.96.0.10:80/TCP", BACKENDS, "clusterBackends",
         ("10.244.1.5:8080", "10.244.2.7:8080"), ("10.244.3.9:8080",)),
    Case("ClusterIP, internalTrafficPolicy Local with a local endpoint", "node-a", POD,
         "kube-system/node-cache:dns/UDP", BACKENDS, "localBackends", ("10.244.1.53:5353",),
         ("10.244.3.53:5353",)),
    Case("ClusterIP, internalTrafficPolicy Local without a local endpoint: dropped", "node-b",
         POD, "kube-system/node-cache:dns/UDP", DROPPED, "localBackends", (),
         ("10.244.1.53:5353", "10.244.3.53:5353")),
    Case("NodePort from outside, externalTrafficPolicy Local, local endpoint", "node-a",
         "outside", "192.0.2.10:30080", BACKENDS, "localBackends", ("10.244.1.80:8080",),
         ("10.244.3.80:8080",)),
    Case("NodePort from outside, externalTrafficPolicy Local, no local endpoint: dropped",
         "node-b", "outside", "192.0.2.11:30080", DROPPED, "localBackends"),
    Case("NodePort from a pod, externalTrafficPolicy Local: clusterBackends anyway", "node-b",
         POD, "192.0.2.11:30080", BACKENDS, "clusterBackends",
         ("10.244.1.80:8080", "10.244.3.80:8080")),
    Case("NodePort from the node itself: clusterBackends", "node-b", "node", "edge/ingress:http",
         BACKENDS, "clusterBackends"),
    Case("NodePort from outside, externalTrafficPolicy Cluster", "node-a", "outside",
         "default/api:http", BACKENDS, "clusterBackends"),
    Case("LoadBalancer, source range admits the client, no local endpoint: dropped", "node-a",
         "outside:198.51.100.4", "203.0.113.20:80", DROPPED, "localBackends"),
    Case("LoadBalancer, source range does not admit the client: dropped before any set",
         "node-a", "outside", "203.0.113.20:80", DROPPED, "localBackends"),
    Case("LoadBalancer VIP from a pod outside the source ranges: dropped as kube-proxy",
         "node-b", POD, "203.0.113.20:80", DROPPED, "clusterBackends"),
    Case("ExternalIP from outside, externalTrafficPolicy Local", "node-a",
         "outside:198.51.100.4", "203.0.113.7:443", BACKENDS, "localBackends"),
    Case("topology PreferSameZone: zone-2's endpoint left out", "node-a", POD,
         "default/catalog:grpc", BACKENDS, "clusterBackends",
         ("10.244.1.90:9090", "10.244.2.90:9090"), ("10.244.3.90:9090",)),
    Case("topology PreferSameZone in the other zone", "node-c", POD, "default/catalog:grpc",
         BACKENDS, "clusterBackends", ("10.244.3.90:9090",)),
    Case("topology PreferSameNode", "node-a", POD, "modes/near:http", BACKENDS,
         "clusterBackends", ("10.244.1.101:8080",), ("10.244.2.101:8080",)),
    Case("topology keys: the node group matches", "node-a", POD, "default/kv:redis", BACKENDS,
         "clusterBackends", ("10.244.2.19:6379",), ("10.244.3.19:6379",)),
    Case("topology keys: the rack matches", "node-c", POD, "default/kv:redis", BACKENDS,
         "clusterBackends", ("10.244.3.19:6379",), ("10.244.2.19:6379",)),
    Case("topology keys: no key shared and no '*': dropped", "node-a", POD,
         "modes/rack-only:http", DROPPED, "clusterBackends", (), ("10.244.3.103:8080",)),
    Case("topology keys: '*' takes every endpoint", "node-a", POD, "modes/rack-or-any:http",
         BACKENDS, "clusterBackends", ("10.244.3.104:8080",)),
    Case("LocalFirst: ready endpoints here, other cluster left out", "node-a", POD,
         "default/search:http", BACKENDS, "clusterBackends", ("10.244.2.18:8080",),
         ("10.245.1.18:8080", "10.245.2.18:8080")),
    Case("LocalFirst: nothing ready here, every cluster", "node-a", POD, "modes/away:http",
         BACKENDS, "clusterBackends", ("10.245.1.102:8080",), ("10.244.2.102:8080",)),
    Case("terminating fallback: only serving-terminating endpoints", "node-b", POD,
         "default/checkout:http", BACKENDS, "clusterBackends", ("10.244.1.16:8080",)),
    Case("sessionAffinity ClientIP", "node-a", POD, "default/sticky:http", BACKENDS,
         "clusterBackends"),
    Case("Maglev over UDP", "node-a", POD, "default/dns-cache:dns/UDP", BACKENDS,
         "clusterBackends"),
    Case("dual-stack: the IPv6 ClusterIP", "node-a", "fd00:244:1::5", "default/api:http",
         BACKENDS, "clusterBackends", ("[fd00:244:1::17]:8080", "[fd00:244:2::17]:8080")),
    Case("no endpoints at all: refused", "node-a", POD, "modes/empty:http", REFUSED,
         "clusterBackends"),
    Case("not a frontend: passes untranslated", "node-a", POD, "10.96.9.9:80/TCP",
         NOT_A_SERVICE, None),
]
# fmt: on


@pytest.fixture(scope="module")
def inputs() -> dict[str, Inputs]:
    return {n: state_from_manifests(MANIFESTS, n, OPTIONS) for n in ("node-a", "node-b", "node-c")}


def _report(inputs: dict[str, Inputs], case: Case):
    return run_explain(inputs[case.node], case.source, case.target, None)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_explain_case(inputs: dict[str, Inputs], case: Case) -> None:
    ex = _report(inputs, case).semantics
    assert ex.outcome == case.outcome
    assert (ex.set_name or None) == case.set_name
    addresses = lambda bs: tuple(  # noqa: E731
        f"[{b.ip}]:{b.port}" if ":" in b.ip else f"{b.ip}:{b.port}" for b in bs
    )
    if case.backends:
        assert addresses(ex.backends) == case.backends
    if case.left_out:
        assert addresses(b for b, _ in ex.left_out) == case.left_out
        assert all(reason for _, reason in ex.left_out)


def test_reports_match_the_golden_file(inputs: dict[str, Inputs]) -> None:
    text = "".join(f"### {c.name}\n{_report(inputs, c).table()}\n" for c in CASES)
    if os.environ.get("KBP_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), f"{GOLDEN} differs; see the module docstring"


def test_json_report_carries_the_same_answer(inputs: dict[str, Inputs]) -> None:
    report = run_explain(inputs["node-a"], POD, "default/kv:redis", 40000)
    doc = json.loads(report.json())
    assert doc["semantics"]["outcome"] == BACKENDS
    assert [b["address"] for b in doc["semantics"]["backends"]] == ["10.244.2.19:6379"]
    assert doc["semantics"]["leftOut"][0]["reason"].startswith("topology key")
    assert doc["verdict"] == report.verdict and doc["query"]["sport"] == 40000


def test_from_the_nodestate_alone_left_out_lists_only_what_it_holds(
    inputs: dict[str, Inputs],
) -> None:
    """What /state gives: no candidates, so topology's drops are unseen and say so."""
    only_state = Inputs(inputs["node-b"].state, "agent", None, "ebpf", None, None)
    ex = run_explain(only_state, "outside", "192.0.2.11:30080", None).semantics
    assert ex.outcome == DROPPED and not ex.left_out_complete
    assert [b.ip for b, _ in ex.left_out] == ["10.244.1.80", "10.244.3.80"]
    assert "not this node" in ex.left_out[0][1]


def test_an_agent_behind_is_reported_first(inputs: dict[str, Inputs]) -> None:
    behind = Inputs(inputs["node-a"].state, "agent", "sha256:" + "0" * 64, "ebpf", None, None)
    report = run_explain(behind, POD, "10.96.0.10:80/TCP", None)
    assert report.disagreements and "agent is behind" in report.disagreements[0]
    assert report.table().splitlines()[2].startswith("DISAGREES:")


@pytest.mark.parametrize(
    ("text", "target"),
    [
        ("10.96.0.10:80/TCP", Target(ip="10.96.0.10", port=80)),
        ("10.96.0.10:53/udp", Target(ip="10.96.0.10", port=53, protocol="UDP")),
        ("[fd00:96::10]:80", Target(ip="fd00:96::10", port=80)),
        ("default/web:http", Target(namespace="default", name="web", port_name="http")),
        ("default/web:80/TCP", Target(namespace="default", name="web", port=80)),
    ],
)
def test_targets_parse(text: str, target: Target) -> None:
    assert parse_target(text) == target


@pytest.mark.parametrize("text", ["10.96.0.10", "web:80", "default/web", "10.96.0.10:0/TCP"])
def test_bad_targets_are_one_clear_error(text: str) -> None:
    with pytest.raises(QueryError, match="--to"):
        parse_target(text)


def test_cli_explains_from_manifests(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", "--manifests", *MANIFESTS, "--node", "node-a", "--cluster-cidr",
            "10.244.0.0/16", "--from", POD, "--to", "default/catalog:grpc", "--no-kernel",
            "-o", "json"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["semantics"]["set"] == "clusterBackends" and doc["kernel"] is None


def test_cli_reports_an_unknown_service_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["explain", "--manifests", *MANIFESTS, "--node", "node-a", "--from", POD,
            "--to", "default/nope:http", "--no-kernel"]  # fmt: skip
    assert main(argv) == 1
    assert "default/nope" in capsys.readouterr().err
