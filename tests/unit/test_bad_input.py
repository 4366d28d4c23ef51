"""The bad-input corpus (tests/data/bad): every malformed object is reported once, with
its file, kind, namespace/name, field and what is wrong, and skipped; everything around
it still loads, compiles and comes out of `kube-bpf-proxy compile` (issue 2 §2 and §5).

Address plan: tests/data/bad/README.md (the plan of tests/builders.py). Malformed objects
are named bad-*; valid neighbours good-*, or warn-* when they only earn a warning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.model.compile import compile
from agent.model.nodestate import NodeState, ServiceEntry
from agent.model.quote import LINE_CHARS
from agent.model.types import ClusterState
from agent.sources.manifests import Report, load_manifests

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "tests" / "data" / "bad"
NODE = "node-a"
NS = "corpus"


@dataclass(frozen=True)
class Bad:
    """One malformed object (or unreadable file) and what its report must say."""

    id: str  # the case name, a sentence
    file: str  # relative to CORPUS
    ref: str  # the object as the report names it: "Kind namespace/name"; "" for a file
    field: str  # the message starts with "<field>: "; "" when no field is to blame
    problem: str  # what is wrong: a substring of the message
    at: str = ""  # position in the file, for objects without a name: "(document 2)"

    @property
    def where(self) -> str:
        path = str(CORPUS / self.file)
        return f"{path} {self.at}" if self.at else path

    def matches(self, report: Report) -> bool:
        if report.ref != self.ref:
            return False
        if self.at or not self.ref:
            return report.where == self.where
        return report.where == self.where or report.where.startswith(self.where + " ")


ADDR = "services-addresses.yaml"
PORTS = "services-ports.yaml"
SPEC = "services-spec.yaml"
DOCS = "documents.yaml"
SLICES = "endpointslices.yaml"
NODES = "nodes.yaml"


def svc(name: str) -> str:
    return f"Service {NS}/{name}"


def eps(name: str) -> str:
    return f"EndpointSlice {NS}/{name}"


BAD: list[Bad] = [
    # --- Service addresses ---------------------------------------------------------------
    Bad("a clusterIP that is not an address is blamed on spec.clusterIP, the field written",
        ADDR, svc("bad-cluster-ip-only"), "spec.clusterIP", "'10.96.2.300' is not a valid IP"),
    Bad("a second clusterIPs entry that is not an address is reported at its index",
        ADDR, svc("bad-cluster-ips-second"), "spec.clusterIPs[1]", "'fd00:96::zz' is not a valid"),
    Bad("an IPv4 clusterIP with leading zeros is not a valid address",
        ADDR, svc("bad-cluster-ip-leading-zeros"), "spec.clusterIPs[0]", "'010.96.2.3' is not a"),
    Bad("an IPv4-mapped IPv6 clusterIP is rejected in favour of the IPv4 form",
        ADDR, svc("bad-cluster-ip-mapped"), "spec.clusterIPs[0]", "IPv4-mapped IPv6 address"),
    Bad("an externalIP with an octet above 255 is not a valid address",
        ADDR, svc("bad-external-ip"), "spec.externalIPs[1]", "'203.0.113.256' is not a valid IP"),
    Bad("an externalIP written as a number is not a string",
        ADDR, svc("bad-external-ip-number"), "spec.externalIPs[0]", "expected a string"),
    Bad("a clusterIP that differs from clusterIPs[0] is a contradiction",
        ADDR, svc("bad-cluster-ip-mismatch"), "spec.clusterIP", "differs from spec.clusterIPs[0]"),
    Bad("clusterIP None with an address in clusterIPs is a contradiction",
        ADDR, svc("bad-cluster-ip-none-but-ips"), "spec.clusterIP",
        "differs from spec.clusterIPs[0]"),
    Bad("an address in clusterIP with None in clusterIPs is a contradiction",
        ADDR, svc("bad-cluster-ips-none-but-ip"), "spec.clusterIP",
        "differs from spec.clusterIPs[0]"),
    Bad("two IPv4 addresses in clusterIPs are one family too many",
        ADDR, svc("bad-cluster-ips-two-ipv4"), "spec.clusterIPs", "more than one IPv4 address"),
    # --- Service ports -------------------------------------------------------------------
    Bad("a Service port without its port number is missing a port",
        PORTS, svc("bad-port-missing"), "spec.ports[0].port", "is missing"),
    Bad("a Service port of 0 is out of range",
        PORTS, svc("bad-port-zero"), "spec.ports[0].port", "0 is out of range 1..65535"),
    Bad("a Service port of 70000 is out of range",
        PORTS, svc("bad-port-too-large"), "spec.ports[0].port", "70000 is out of range"),
    Bad("a Service port given as a string is not an integer",
        PORTS, svc("bad-port-string"), "spec.ports[0].port", "expected an integer, got str '80'"),
    Bad("a nodePort of 70000 is out of range",
        PORTS, svc("bad-node-port-too-large"), "spec.ports[0].nodePort", "70000 is out of range"),
    Bad("protocol HTTP is not a transport protocol",
        PORTS, svc("bad-protocol"), "spec.ports[0].protocol", "'HTTP' is not one of TCP, UDP"),
    Bad("a lower-case protocol on the second port is rejected",
        PORTS, svc("bad-protocol-lowercase"), "spec.ports[1].protocol", "'udp' is not one of"),
    Bad("two Service ports with the same name are reported at the second",
        PORTS, svc("bad-duplicate-port-names"), "spec.ports[1].name", "duplicate port name 'http'"),
    Bad("an unnamed port among several needs a name",
        PORTS, svc("bad-unnamed-port"), "spec.ports[1].name", "required when a Service has more"),
    Bad("a Service with a cluster IP and no ports at all",
        PORTS, svc("bad-no-ports"), "spec.ports", "needs at least one port"),
    Bad("ports written as a map instead of a list",
        PORTS, svc("bad-ports-dict"), "spec.ports", "expected a list, got dict"),
    Bad("a port written as the string 80/TCP instead of an object",
        PORTS, svc("bad-port-item-string"), "spec.ports[0]", "expected an object, got str"),
    Bad("a healthCheckNodePort of 99999 is out of range",
        PORTS, svc("bad-health-check-node-port"), "spec.healthCheckNodePort", "out of range"),
    # --- other Service fields ------------------------------------------------------------
    Bad("a spec that is a list instead of an object",
        SPEC, svc("bad-spec-list"), "spec", "expected an object, got list"),
    Bad("a Service type that does not exist",
        SPEC, svc("bad-type"), "spec.type", "'Ingress' is not one of ClusterIP, NodePort"),
    Bad("sessionAffinity Sticky is neither None nor ClientIP",
        SPEC, svc("bad-session-affinity"), "spec.sessionAffinity", "'Sticky' is not one of None"),
    Bad("an affinity timeout of 0 seconds is out of range", SPEC, svc("bad-affinity-timeout-zero"),
        "spec.sessionAffinityConfig.clientIP.timeoutSeconds", "0 is out of range 1..86400"),
    Bad("an affinity timeout above one day is out of range",
        SPEC, svc("bad-affinity-timeout-too-long"),
        "spec.sessionAffinityConfig.clientIP.timeoutSeconds", "86401 is out of range"),
    Bad("externalTrafficPolicy Lokal is neither Cluster nor Local",
        SPEC, svc("bad-external-traffic-policy"), "spec.externalTrafficPolicy", "'Lokal' is not"),
    Bad("internalTrafficPolicy PreferLocal is neither Cluster nor Local",
        SPEC, svc("bad-internal-traffic-policy"), "spec.internalTrafficPolicy", "'PreferLocal'"),
    Bad("a source range with a /33 prefix is not a CIDR",
        SPEC, svc("bad-source-range-prefix"), "spec.loadBalancerSourceRanges[1]",
        "'198.51.100.0/33' is not a valid CIDR"),
    Bad("a source range without a prefix length is not a CIDR",
        SPEC, svc("bad-source-range-no-prefix"), "spec.loadBalancerSourceRanges[0]",
        "no prefix length"),
    Bad("a load-balancer ingress IP that is not an address",
        SPEC, svc("bad-lb-ingress-ip"), "status.loadBalancer.ingress[0].ip",
        "'203.0.113.999' is not a valid IP address"),
    Bad("a load-balancer ingress ipMode Direct is neither VIP nor Proxy",
        SPEC, svc("bad-lb-ingress-mode"), "status.loadBalancer.ingress[0].ipMode",
        "'Direct' is not one of VIP, Proxy"),
    Bad("a Service label with an integer value",
        SPEC, svc("bad-labels-not-strings"), "metadata.labels", "must be strings, got int"),
    Bad("a Service annotation with a boolean value",
        SPEC, svc("bad-annotations-not-strings"), "metadata.annotations", "must be strings"),
    # --- documents and metadata ----------------------------------------------------------
    Bad("a Service without metadata is found by its document number",
        DOCS, "Service <unnamed>", "metadata", "is missing", at="(document 2)"),
    Bad("a Service whose metadata has no name",
        DOCS, f"Service {NS}/<unnamed>", "metadata.name", "is missing", at="(document 3)"),
    Bad("a document that is a scalar is not an object",
        DOCS, "<unknown> <unnamed>", "", "expected an object, got str", at="(document 4)"),
    Bad("a document that is a list is not an object",
        DOCS, "<unknown> <unnamed>", "", "expected an object, got list", at="(document 5)"),
    Bad("an object without a kind", DOCS, f"<unknown> {NS}/bad-no-kind", "", "kind is missing"),
    Bad("metadata that is a string instead of an object",
        DOCS, "Service <unnamed>", "metadata", "expected an object, got str", at="(document 8)"),
    # --- EndpointSlices --------------------------------------------------------------------
    Bad("a slice without the kubernetes.io/service-name label belongs to no Service",
        SLICES, eps("bad-slice-no-service-name"), "metadata.labels",
        "kubernetes.io/service-name is missing"),
    Bad("a slice without any labels belongs to no Service",
        SLICES, eps("bad-slice-no-labels"), "metadata.labels",
        "kubernetes.io/service-name is missing"),
    Bad("a slice with addressType IPv5",
        SLICES, eps("bad-slice-address-type"), "addressType", "'IPv5' is not one of IPv4, IPv6"),
    Bad("an IPv6 endpoint address in an IPv4 slice is of the wrong family",
        SLICES, eps("bad-slice-ipv6-in-ipv4"), "endpoints[0].addresses[0]",
        "'2001:db8::5' is not a valid IPv4 address"),
    Bad("an IPv4 endpoint address in an IPv6 slice is of the wrong family",
        SLICES, eps("bad-slice-ipv4-in-ipv6"), "endpoints[0].addresses[0]",
        "'10.244.1.73' is not a valid IPv6 address"),
    Bad("an endpoint address with leading zeros is reported at its endpoint",
        SLICES, eps("bad-slice-leading-zeros"), "endpoints[1].addresses[0]",
        "'10.244.01.75' is not a valid IPv4 address"),
    Bad("an IPv4-mapped IPv6 endpoint address is rejected",
        SLICES, eps("bad-slice-ipv4-mapped"), "endpoints[0].addresses[0]", "IPv4-mapped IPv6"),
    Bad("an endpoint with an empty address list",
        SLICES, eps("bad-slice-empty-addresses"), "endpoints[0].addresses", "non-empty list"),
    Bad("conditions.ready given as the string 'true'",
        SLICES, eps("bad-slice-ready-string"), "endpoints[0].conditions.ready",
        "expected true, false or null, got str"),
    Bad("zone hints given as a string instead of a list",
        SLICES, eps("bad-slice-hints-not-list"), "endpoints[0].hints.forZones",
        "expected a list, got str"),
    Bad("a node hint without a name",
        SLICES, eps("bad-slice-hint-without-name"), "endpoints[0].hints.forNodes[0].name",
        "expected a non-empty string"),
    Bad("a slice port with protocol ICMP",
        SLICES, eps("bad-slice-port-protocol"), "ports[0].protocol", "'ICMP' is not one of"),
    Bad("a slice port of 80800 is out of range",
        SLICES, eps("bad-slice-port-too-large"), "ports[0].port", "80800 is out of range"),
    Bad("a slice label with an integer value",
        SLICES, eps("bad-slice-labels-not-strings"), "metadata.labels", "must be strings"),
    Bad("slice ports written as a map, in a nested .yml file",
        "nested/more-slices.yml", eps("bad-nested-slice-ports-map"), "ports",
        "expected a list, got dict"),
    # --- Nodes -----------------------------------------------------------------------------
    Bad("a Node address that is not an address",
        NODES, "Node bad-node-address", "status.addresses[0].address",
        "'192.0.2.300' is not a valid IP address"),
    Bad("a Node label with an integer value",
        NODES, "Node bad-node-labels", "metadata.labels", "must be strings, got int"),
    Bad("a Node without a name",
        NODES, "Node <unnamed>", "metadata.name", "is missing", at="(document 5)"),
    Bad("Node addresses written as a map instead of a list",
        NODES, "Node bad-node-addresses-map", "status.addresses", "expected a list, got dict"),
    # --- JSON and lists --------------------------------------------------------------------
    Bad("an externalIP with an interface zone, inside a JSON kind List",
        "list.json", svc("bad-list-external-ip-zone"), "spec.externalIPs[0]",
        "'fe80::1%eth0' is not a valid IP address"),
    Bad("a string item inside a JSON kind List",
        "list.json", "<unknown> <unnamed>", "", "expected an object, got str", at="items[2]"),
    Bad("ports given as a string in a typed ServiceList item without a kind",
        "service-list.json", svc("bad-service-list-ports-string"), "spec.ports",
        "expected a list, got str"),
    # --- unreadable files ------------------------------------------------------------------
    Bad("a truncated JSON file is invalid JSON", "truncated-json.json", "", "", "invalid JSON"),
    Bad("a YAML document with broken indentation ends the file after the documents before it",
        "truncated.yaml", "", "", "invalid YAML after document 2"),
    # --- input that raised tracebacks (issue 21) -------------------------------------------
    Bad("apiVersion written as a list is reported, not a TypeError",
        "api-version.yaml", svc("bad-api-version-list"), "apiVersion",
        "expected a string, got list ['v1']"),
    Bad("apiVersion written as a map is reported",
        "api-version.yaml", svc("bad-api-version-map"), "apiVersion", "expected a string, got dict",
    ),
    Bad("kind written as a list is reported",
        "api-version.yaml", f"<unknown> {NS}/bad-kind-list", "kind",
        "expected a string, got list ['Service']"),
    Bad("JSON nested 3000 levels deep is invalid JSON, not a RecursionError",
        "deep-nesting.json", "", "", "invalid JSON: RecursionError"),
    Bad("YAML nested past libyaml's limit is reported on one line",
        "deep-nesting.yaml", "", "", "exceeded maximum nesting depth; in"),
    Bad("a value nested 900 levels deep in a quoted field is cut in the message",
        "deep-field.json", svc("bad-deep-field"), "spec.type", "expected a string, got list [[["),
    Bad("a lone surrogate in a name is reported naming the object, escaped",
        "surrogates.json", svc("bad-surrogate-name-\\udc80"), "metadata.name",
        "is not valid Unicode text (a lone surrogate)"),
    Bad("a lone surrogate in a label value is reported at the label",
        "surrogates.json", svc("bad-surrogate-label"), "metadata.labels['team']",
        "'caf\\udce9' is not valid Unicode text"),
    Bad("a lone surrogate in a port name is reported at the port",
        "surrogates.json", svc("bad-surrogate-port-name"), "spec.ports[0].name",
        "is not valid Unicode text"),
    Bad("a megabyte value is quoted cut to a few dozen characters",
        "huge-values.yaml", svc("bad-huge-type"), "spec.type", "'xxxxxxxx"),
    Bad("a value running over several lines is quoted on one line",
        "huge-values.yaml", svc("bad-multiline-type"), "spec.type",
        "'Cluster\\nIP\\n\\nand more' is not one of"),
    Bad("an integer of 5000 digits stops the YAML file, with no traceback",
        "huge-integer.yaml", "", "", "ValueError: Exceeds the limit (4300 digits)"),
]  # fmt: skip

OBJECTS = [b for b in BAD if b.ref]  # malformed objects, as opposed to unreadable files

GOOD_SERVICES = [
    "good-web", "good-dual", "good-external", "good-api", "good-metrics", "good-lb",
    "good-affinity", "good-frontend", "good-backend", "good-from-list", "good-from-service-list",
    "good-before-broken-yaml", "good-topology-rack", "warn-topology-any-not-last",
    "warn-topology-repeated-key", "warn-topology-empty-key", "good-multi-cluster-local-first",
    "warn-multi-cluster-unknown", "warn-duplicate-port", "warn-duplicate-node-port",
    "warn-duplicate-slice-port-name",
]  # fmt: skip
GOOD_SLICES = [
    "good-web-abcde", "good-dual-v4", "good-dual-v6", "good-metrics-fghij", "good-api-xyz12",
    "good-from-list-12345", "good-before-broken-yaml-1", "good-topology-rack-1",
    "warn-topology-any-not-last-1", "warn-topology-repeated-key-1", "warn-topology-empty-key-1",
    "good-multi-cluster-local-first-1", "imported-member2-good-multi-cluster-local-first",
    "warn-multi-cluster-unknown-1", "imported-member2-warn-multi-cluster-unknown",
]  # fmt: skip
GOOD_NODES = ["node-a", "node-b", "node-c"]


@pytest.fixture(scope="module")
def corpus() -> tuple[ClusterState, list[Report]]:
    """The whole corpus directory, loaded once; loading must not raise."""
    return load_manifests([CORPUS])


@pytest.fixture(scope="module")
def node_state(corpus: tuple[ClusterState, list[Report]]) -> NodeState:
    return compile(corpus[0], NODE)


def listing(reports: list[Report]) -> str:
    return "\n".join(f"  {'error' if r.error else 'warning'}: {r}" for r in reports)


# --- every malformed object is reported once ---------------------------------------------


def test_the_corpus_holds_at_least_35_malformed_objects() -> None:
    assert len(OBJECTS) >= 35
    assert len({(b.file, b.ref, b.at) for b in BAD}) == len(BAD), "two cases name one object"


@pytest.mark.parametrize("bad", BAD, ids=[b.id for b in BAD])
def test_each_malformed_object_is_reported_once_naming_file_object_field_and_problem(
    bad: Bad, corpus: tuple[ClusterState, list[Report]]
) -> None:
    _, reports = corpus
    found = [r for r in reports if bad.matches(r)]
    in_file = [r for r in reports if r.where.startswith(str(CORPUS / bad.file))]
    assert len(found) == 1, f"{len(found)} reports for {bad.ref or bad.file}; the file's:\n" + (
        listing(in_file)
    )
    report = found[0]
    assert report.error, f"reported as a warning, not an error: {report}"
    if bad.field:
        assert report.message.startswith(f"{bad.field}: "), report.message
    assert bad.problem in report.message
    text = str(report)
    assert str(CORPUS / bad.file) in text
    if bad.ref:
        assert bad.ref in text
        assert text.endswith("; skipped")


def test_every_report_is_one_printable_line_of_bounded_length(
    corpus: tuple[ClusterState, list[Report]],
) -> None:
    _, reports = corpus
    for report in reports:
        text = str(report)
        assert text.isprintable(), text[:200]
        assert len(text) <= LINE_CHARS + 40, f"{len(text)} characters: {text[:200]}"
        text.encode("utf-8")  # no lone surrogate reaches a log or a terminal


def test_no_error_is_reported_that_the_table_does_not_expect(
    corpus: tuple[ClusterState, list[Report]],
) -> None:
    _, reports = corpus
    unexpected = [r for r in reports if r.error and not any(b.matches(r) for b in BAD)]
    assert not unexpected, "unexpected errors:\n" + listing(unexpected)
    assert not [r for r in reports if "good-" in r.ref and r.error]


FILES = sorted(
    p.relative_to(CORPUS).as_posix()
    for p in CORPUS.rglob("*")
    if p.suffix in (".yaml", ".yml", ".json")
)


@pytest.mark.parametrize(
    "name", FILES, ids=[f"{name} says the same when loaded alone" for name in FILES]
)
def test_each_file_loaded_alone_raises_nothing_and_reports_the_same(
    name: str, corpus: tuple[ClusterState, list[Report]]
) -> None:
    path = CORPUS / name
    _, alone = load_manifests([path])
    _, together = corpus
    mine = [r for r in together if r.where == str(path) or r.where.startswith(f"{path} ")]
    assert [str(r) for r in alone] == [str(r) for r in mine]


# --- everything else still loads and compiles --------------------------------------------


def test_every_valid_neighbour_reaches_the_cluster_state(
    corpus: tuple[ClusterState, list[Report]],
) -> None:
    state, _ = corpus
    assert {(NS, n) for n in GOOD_SERVICES} <= set(state.services)
    assert {(NS, n) for n in GOOD_SLICES} <= set(state.slices)
    assert set(GOOD_NODES) <= set(state.nodes)


def test_malformed_objects_reach_neither_the_cluster_state_nor_the_node_state(
    corpus: tuple[ClusterState, list[Report]], node_state: NodeState
) -> None:
    state, _ = corpus
    leaked = sorted(
        f"{kind} {name}"
        for kind, names in (
            ("Service", [n for _, n in state.services]),
            ("EndpointSlice", [n for _, n in state.slices]),
            ("Node", list(state.nodes)),
            ("NodeState entry", [e.name for e in node_state.services]),
        )
        for name in names
        if name.startswith("bad-")
    )
    assert not leaked, f"malformed objects were kept: {leaked}"
    frontends = {f.ip for e in node_state.services for f in e.frontends}
    assert not {ip for ip in frontends if ip.startswith("10.96.2.")}, "a bad ClusterIP is served"


def test_the_compiled_node_state_programs_every_valid_service(node_state: NodeState) -> None:
    assert node_state.node.name == NODE
    assert {e.name for e in node_state.services} >= set(GOOD_SERVICES)
    json.dumps(node_state.to_dict())  # a complete, serialisable document


def endpoint(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def describe(entry: ServiceEntry) -> tuple[list[str], list[str]]:
    frontends = [
        f"{f.type} {endpoint(f.ip, f.port)}"
        + (f" from {','.join(f.source_ranges)}" if f.source_ranges else "")
        for f in entry.frontends
    ]
    backends = [endpoint(b.ip, b.port) for b in entry.cluster_backends or ()]
    return frontends, backends


@dataclass(frozen=True)
class Neighbour:
    id: str
    service: str
    port: str
    family: str
    frontends: list[str]
    backends: list[str]


NEIGHBOURS = [
    Neighbour("good-web keeps its two backends and gains none from the bad slices that claim it",
        "good-web", "http", "IPv4",
        ["ClusterIP 10.96.1.1:80"], ["10.244.1.5:8080", "10.244.2.5:8080"]),
    Neighbour("good-dual is served over IPv4 despite a bad IPv6-in-IPv4 slice",
        "good-dual", "http", "IPv4", ["ClusterIP 10.96.1.4:80"], ["10.244.1.6:8080"]),
    Neighbour("good-dual is served over IPv6 despite bad IPv4-in-IPv6 and mapped slices",
        "good-dual", "http", "IPv6", ["ClusterIP [fd00:96::4]:80"], ["[fd00:244:1::6]:8080"]),
    Neighbour("good-api gets its NodePort and the backends of a slice in a nested directory",
        "good-api", "http", "IPv4", ["ClusterIP 10.96.1.2:80", "NodePort 192.0.2.10:30080"],
        ["10.244.1.20:8080", "10.244.3.20:8080"]),
    Neighbour("good-lb gets its VIP with the trimmed source range", "good-lb", "http", "IPv4", [
            "ClusterIP 10.96.1.3:80", "NodePort 192.0.2.10:30081",
            "LoadBalancer 203.0.113.9:80 from 198.51.100.0/24", ], []),
    Neighbour("good-external gets its external IP", "good-external", "http", "IPv4",
        ["ClusterIP 10.96.1.5:80", "ExternalIP 203.0.113.5:80"], []),
    Neighbour("good-metrics keeps its second named port",
        "good-metrics", "metrics", "IPv4", ["ClusterIP 10.96.1.8:9090"], ["10.244.2.8:9090"]),
    Neighbour("a valid Service in a JSON kind List is served with the slice from the same List",
        "good-from-list", "http", "IPv4", ["ClusterIP 10.96.1.10:80"], ["10.244.3.10:8080"]),
    Neighbour("a valid item of a typed ServiceList is served",
        "good-from-service-list", "http", "IPv4", ["ClusterIP 10.96.1.11:80"], []),
    Neighbour("documents before invalid YAML are served", "good-before-broken-yaml", "http", "IPv4",
        ["ClusterIP 10.96.1.12:80"], ["10.244.2.12:8080"]),
]  # fmt: skip


def entry_of(state: NodeState, service: str, port: str, family: str) -> ServiceEntry:
    found = [
        e
        for e in state.services
        if (e.namespace, e.name, e.port, e.ip_family) == (NS, service, port, family)
    ]
    assert len(found) == 1, f"{service} {port} {family}: {len(found)} entries"
    return found[0]


@pytest.mark.parametrize("case", NEIGHBOURS, ids=[n.id for n in NEIGHBOURS])
def test_valid_neighbours_compile_as_if_the_bad_input_were_absent(
    case: Neighbour, node_state: NodeState
) -> None:
    frontends, backends = describe(entry_of(node_state, case.service, case.port, case.family))
    assert frontends == case.frontends
    assert backends == case.backends


# --- annotations the agent defines: warnings and documented fallbacks ---------------------


@dataclass(frozen=True)
class Fallback:
    id: str
    service: str
    warning: list[str]  # substrings of the one warning; [] for a valid control
    topology: str
    backends: list[str]


FALLBACKS = [
    Fallback("control: valid topology-keys keep traffic on this node's rack",
        "good-topology-rack", [], "example.com/rack", ["10.244.3.30:8080"]),
    Fallback("topology-keys with * before the last key are ignored with a warning",
        "warn-topology-any-not-last",
        ["kube-bpf-proxy.io/topology-keys", "'*' may only be the last key", "ignored"],
        "None", ["10.244.2.31:8080", "10.244.3.31:8080"]),
    Fallback(
        "topology-keys that repeat a key are ignored with a warning", "warn-topology-repeated-key",
        ["kube-bpf-proxy.io/topology-keys", "repeats a key", "ignored"],
        "None", ["10.244.2.32:8080", "10.244.3.32:8080"]),
    Fallback(
        "topology-keys with an empty key are ignored with a warning", "warn-topology-empty-key",
        ["kube-bpf-proxy.io/topology-keys", "empty key", "ignored"],
        "None", ["10.244.2.33:8080", "10.244.3.33:8080"]),
    Fallback("control: multi-cluster LocalFirst keeps traffic in this cluster",
        "good-multi-cluster-local-first", [], "LocalCluster",
        ["10.244.2.34:8080", "10.244.3.34:8080"]),
    Fallback("an unknown multi-cluster policy falls back to RemoteAndLocal with a warning",
        "warn-multi-cluster-unknown",
        ["kube-bpf-proxy.io/multi-cluster", "'LocalOnly'", "using RemoteAndLocal"],
        "None", ["10.244.2.35:8080", "10.244.3.35:8080", "10.245.0.35:8080"]),
]  # fmt: skip


@pytest.mark.parametrize("case", FALLBACKS, ids=[f.id for f in FALLBACKS])
def test_invalid_agent_annotations_warn_and_the_service_compiles_with_the_fallback(
    case: Fallback, corpus: tuple[ClusterState, list[Report]], node_state: NodeState
) -> None:
    _, reports = corpus
    mine = [r for r in reports if r.ref == svc(case.service)]
    if not case.warning:
        assert not mine, listing(mine)
    else:
        assert len(mine) == 1, listing(mine)
        assert not mine[0].error
        for part in case.warning:
            assert part in mine[0].message
        assert not str(mine[0]).endswith("; skipped")
    entry = entry_of(node_state, case.service, "http", "IPv4")
    assert entry.topology == case.topology
    assert describe(entry)[1] == case.backends


# --- duplicates the API server rejects: a warning saying what is done ---------------------


@dataclass(frozen=True)
class Duplicate:
    id: str
    ref: str
    field: str  # the warning starts with "<field>: "
    says: str  # what is done: a substring of the warning
    entries: list[str]  # the Service's entries then: "port-name frontends -> backends"


DUPLICATES = [
    Duplicate(
        "a second Service port with the same port and protocol is left out; the first keeps it",
        svc("warn-duplicate-port"), "spec.ports[1]",
        "port 80/TCP is also spec.ports[0]'s (the API server rejects this); spec.ports[0] keeps "
        "it and this port is ignored",
        ["http ClusterIP 10.96.1.40:80 ->", "metrics ClusterIP 10.96.1.40:9100 ->"]),
    Duplicate("a nodePort used twice stays with the first port; the second gets none",
        svc("warn-duplicate-node-port"), "spec.ports[1].nodePort",
        "30090/TCP is also spec.ports[0]'s (the API server rejects this); spec.ports[0] keeps "
        "it and this port gets no NodePort", ["alt ClusterIP 10.96.1.41:8080 ->",
         "http ClusterIP 10.96.1.41:80,NodePort 192.0.2.10:30090 ->"]),
    Duplicate(
        "a slice port name given twice serves the Service port on both target ports, as kube-proxy",
        eps("warn-duplicate-slice-port-name-1"), "ports[1].name",
        "'http'/TCP is also ports[0]'s name (the API server rejects this); as kube-proxy, both "
        "target ports serve that port name",
        ["http ClusterIP 10.96.1.42:80 -> 10.244.2.42:8080,10.244.2.42:8081"]),
]  # fmt: skip


@pytest.mark.parametrize("case", DUPLICATES, ids=[d.id for d in DUPLICATES])
def test_duplicates_get_one_warning_saying_what_is_done(
    case: Duplicate, corpus: tuple[ClusterState, list[Report]], node_state: NodeState
) -> None:
    _, reports = corpus
    mine = [r for r in reports if r.ref == case.ref]
    assert len(mine) == 1, listing(mine)
    assert not mine[0].error
    assert mine[0].message == f"{case.field}: {case.says}"
    service = case.ref.split("/")[1].removesuffix("-1")
    entries = sorted(
        f"{e.port} {','.join(describe(e)[0])} -> {','.join(describe(e)[1])}".strip()
        for e in node_state.services
        if (e.namespace, e.name) == (NS, service)
    )
    assert entries == case.entries


# --- the CLI -----------------------------------------------------------------------------


def run_cli(*extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBP_")}
    return subprocess.run(
        [sys.executable, "-m", "agent", "compile", "--manifests", str(CORPUS), "--node", NODE,
         *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def parse_document(stdout: str, output: str) -> dict[str, Any]:
    document = json.loads(stdout) if output == "json" else yaml.safe_load(stdout)
    assert isinstance(document, dict)
    return document


@pytest.fixture(scope="module", params=["yaml", "json"])
def cli(request: pytest.FixtureRequest) -> tuple[str, subprocess.CompletedProcess[str]]:
    """`kube-bpf-proxy compile` over the corpus, with -o yaml and with -o json."""
    return request.param, run_cli("-o", request.param)


def test_the_cli_prints_a_node_state_despite_the_bad_input(
    cli: tuple[str, subprocess.CompletedProcess[str]],
) -> None:
    output, proc = cli
    assert proc.returncode == 0, proc.stderr
    document = parse_document(proc.stdout, output)
    assert document["kind"] == "NodeState"
    assert document["node"]["name"] == NODE
    assert {s["name"] for s in document["services"]} >= set(GOOD_SERVICES)


def test_the_cli_reports_every_problem_on_stderr_once(
    cli: tuple[str, subprocess.CompletedProcess[str]],
    corpus: tuple[ClusterState, list[Report]],
) -> None:
    _, proc = cli
    _, reports = corpus
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    for report in reports:
        expected = f"{'error' if report.error else 'warning'}: {str(report).splitlines()[0]}"
        assert lines.count(expected) == 1, f"not on stderr once: {expected}"
    assert len([line for line in lines if line.startswith("error: ")]) == len(
        [r for r in reports if r.error]
    )
    assert len([line for line in lines if line.startswith("warning: ")]) == len(
        [f for f in FALLBACKS if f.warning]
    ) + len(DUPLICATES)


def test_strict_cli_exits_1_when_anything_was_reported() -> None:
    proc = run_cli("--strict")
    assert proc.returncode == 1
    assert "error: " in proc.stderr
    assert "--strict" in proc.stderr
