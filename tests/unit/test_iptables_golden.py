"""Golden iptables-restore documents of the example manifests for node-a, one per family.

A change to these files is a change to the rules the iptables dataplane writes: review
the diff. Regenerate with
`KBP_UPDATE_GOLDEN=1 make test PYTEST_ARGS=tests/unit/test_iptables_golden.py`.

Render options: pod CIDRs 10.244.0.0/16 and fd00:244::/32 (the examples put node-a's pods
in 10.244.1.0/24 and fd00:244:1::/64, node-b's in fd00:244:2::/64, so a /32 is the
smallest conventional IPv6 prefix holding them all) and the default pod interfaces.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from agent.dataplane.iptables.render import IPV4, IPV6, RenderOptions, interface_patterns, render
from agent.dataplane.iptables.tracer import load
from agent.dataplane.options import DEFAULT_POD_INTERFACES
from agent.model.compile import CompileOptions, compile
from agent.model.nodestate import CLUSTER_IP, Backend, Frontend, NodeState, ServiceEntry
from agent.sources.manifests import load_manifests

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
GOLDEN = ROOT / "tests" / "golden"
POD_CIDRS = {IPV4: "10.244.0.0/16", IPV6: "fd00:244::/32"}
NODE = "node-a"
NODE_IPS = ("192.0.2.10", "2001:db8::10")


def options(family: str) -> RenderOptions:
    return RenderOptions(family, (POD_CIDRS[family],), interface_patterns(DEFAULT_POD_INTERFACES))


def examples_state() -> NodeState:
    state, reports = load_manifests([EXAMPLES])
    assert reports == []
    return compile(
        state,
        NODE,
        CompileOptions(cluster_name="member1", cluster_cidrs=tuple(POD_CIDRS.values())),
    )


def golden_path(family: str) -> Path:
    return GOLDEN / f"iptables-examples-{NODE}-{family.lower()}.txt"


def examples_render(family: str) -> str:
    """The golden document of one family, as the test compares it (for kernel tests too)."""
    return render(examples_state().services, options(family))


@pytest.mark.parametrize("family", [IPV4, IPV6])
def test_examples_render_to_the_golden_restore_input(family: str) -> None:
    text = examples_render(family)
    golden = golden_path(family)
    if os.environ.get("KBP_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden} differs; see the module docstring"


@pytest.mark.parametrize("family", [IPV4, IPV6])
def test_every_golden_rule_is_understood_by_the_tracer(family: str) -> None:
    """The tracer raises on any match or target it does not model, and on a jump to a
    chain the document does not declare."""
    ruleset = load(golden_path(family).read_text(), NODE_IPS)
    assert any(chain.startswith("KBP-SEP-") for chain in ruleset.tables["nat"])


# Where packets to the examples go on node-a (examples/README.md has the address plan).
POD = ("10.244.1.250", "veth0")
OUTSIDE = ("198.51.100.7", "eth0")
STRANGER = ("100.64.0.7", "eth0")

SCENARIOS = [
    # name, family, client, destination, expected endpoints (or a verdict)
    ("web splits between its two ready endpoints", IPV4, POD, ("10.96.0.10", 80),
     {"10.244.1.5:8080": 0.5, "10.244.2.7:8080": 0.5}),
    ("node-cache (internalTrafficPolicy Local) answers from node-a's own pod", IPV4, POD,
     ("10.96.0.12", 53, "udp"), {"10.244.1.53:5353": 1.0}),
    ("shop's VIP takes an allowed outside client to node-a's endpoint only", IPV4, OUTSIDE,
     ("203.0.113.9", 443), {"10.244.1.44:8443": 1.0}),
    ("shop's VIP drops a client outside its source ranges", IPV4, STRANGER,
     ("203.0.113.9", 443), "DROP"),
    ("shop's Proxy-mode ingress is not a VIP this node answers for", IPV4, OUTSIDE,
     ("203.0.113.10", 443), "ACCEPT"),
    ("ingress's NodePort from a pod reaches both cluster endpoints", IPV4, POD,
     ("192.0.2.10", 30080), {"10.244.1.80:8080": 0.5, "10.244.3.80:8080": 0.5}),
    ("api over IPv6 splits between its two IPv6 endpoints", IPV6, ("fd00:244:1::250", "veth0"),
     ("fd00:96::17", 80), {"[fd00:244:1::17]:8080": 0.5, "[fd00:244:2::17]:8080": 0.5}),
]  # fmt: skip


@pytest.mark.parametrize(
    "family, client, destination, expected",
    [s[1:] for s in SCENARIOS],
    ids=[s[0] for s in SCENARIOS],
)
def test_packets_through_the_golden_rules(family, client, destination, expected) -> None:
    ruleset = load(golden_path(family).read_text(), NODE_IPS)
    ip, port, *proto = destination
    trace = ruleset.trace(client[0], ip, port, *proto, in_interface=client[1])
    if isinstance(expected, str):
        assert trace.verdict == expected
        assert trace.endpoints() == {}
    else:
        assert trace.verdict == "ACCEPT"
        assert trace.endpoints() == pytest.approx(expected, abs=1e-9)


def _expected(entry: ServiceEntry, frontend: Frontend, client: str) -> tuple[Backend, ...]:
    """docs/nodestate.md's table: which backend set a packet from `client` uses."""
    if frontend.type == CLUSTER_IP:
        local = entry.internal_traffic_policy == "Local"
    else:
        local = client == "outside" and entry.external_traffic_policy == "Local"
    return (entry.local_backends if local else entry.cluster_backends) or ()


def _clients(entry: ServiceEntry, frontend: Frontend) -> dict[str, tuple[str, str | None]]:
    v6 = entry.ip_family == IPV6
    outside = "2001:db8:100::7" if v6 else "198.51.100.7"
    if frontend.source_ranges:  # an outside client the ranges allow
        outside = str(ipaddress.ip_network(frontend.source_ranges[0])[7])
    return {
        "pod": ("fd00:244:1::250" if v6 else "10.244.1.250", "veth0"),
        "outside": (outside, "eth0"),
        "node": (NODE_IPS[1] if v6 else NODE_IPS[0], None),
    }


def _allowed(frontend: Frontend, ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return not frontend.source_ranges or any(
        address in ipaddress.ip_network(r) for r in frontend.source_ranges
    )


@pytest.mark.parametrize("family", [IPV4, IPV6])
def test_every_example_frontend_sends_every_client_to_the_set_design_section_3_names(
    family: str,
) -> None:
    ruleset = load(golden_path(family).read_text(), NODE_IPS)
    checked = 0
    for entry in examples_state().services:
        if entry.ip_family != family:
            continue
        for frontend in entry.frontends:
            for client, (ip, interface) in _clients(entry, frontend).items():
                what = f"{entry.namespace}/{entry.name} {frontend.type} from {client}"
                trace = ruleset.trace(ip, frontend.ip, frontend.port, entry.protocol,
                                      in_interface=interface)  # fmt: skip
                backends = _expected(entry, frontend, client)
                if not _allowed(frontend, ip):  # source ranges bind pods too, as in kube-proxy
                    assert trace.verdict == "DROP", what
                    continue
                if not backends:
                    assert trace.verdict == ("DROP" if entry.has_endpoints else "REJECT"), what
                    continue
                host = "[{}]:{}" if family == IPV6 else "{}:{}"
                share = 1 / len(backends)
                expected = {host.format(b.ip, b.port): share for b in backends}
                assert trace.verdict == "ACCEPT", what
                assert trace.endpoints() == pytest.approx(expected, abs=1e-9), what
                checked += 1
    assert checked > (10 if family == IPV4 else 2)
