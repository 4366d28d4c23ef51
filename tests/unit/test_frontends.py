"""Which Services are programmed and which frontends (address:port) this node answers.

Address plan: tests/builders.py (node-a 192.0.2.10 and 2001:db8::10).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from agent.model.compile import CompileOptions, compile

from ..builders import Obj, default_nodes, make_endpoint, make_service, make_slice, spec, state_of


def node_port(
    port: int = 30080, svc_type: str = "NodePort", **fields: object
) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        obj["spec"].update(type=svc_type, **fields)
        obj["spec"]["ports"][0]["nodePort"] = port

    return mutate


def load_balancer(*ingress: dict, **fields: object) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        node_port(30443, "LoadBalancer", **fields)(obj)
        obj["status"] = {"loadBalancer": {"ingress": list(ingress)}}

    return mutate


def dual_stack(obj: Obj) -> None:
    obj["spec"].update(clusterIP="10.96.0.1", clusterIPs=["10.96.0.1", "fd00:96::1"])


def proxy_name(value: str) -> Callable[[Obj], None]:
    def mutate(obj: Obj) -> None:
        obj["metadata"]["labels"] = {"service.kubernetes.io/service-proxy-name": value}

    return mutate


@dataclass
class Case:
    name: str
    service: Obj
    frontends: list[str]  # "Type ip:port" of every entry, in document order
    options: CompileOptions = field(default_factory=CompileOptions)


def fe(*items: str) -> list[str]:
    return list(items)


CASES = [
    Case("a ClusterIP Service answers on its cluster IP", make_service(),
        fe("ClusterIP 10.96.0.1:80")),
    Case("a NodePort Service answers on every node address of the ClusterIP's family",
        make_service(mutate=node_port()),
        fe("ClusterIP 10.96.0.1:80", "NodePort 192.0.2.10:30080")),
    Case("--nodeport-addresses limits NodePorts to node addresses inside the CIDRs",
        make_service(mutate=node_port()), fe("ClusterIP 10.96.0.1:80"),
        CompileOptions(nodeport_addresses=("198.51.100.0/24",))),
    Case("--nodeport-addresses=primary uses the node's primary address",
        make_service(mutate=node_port()), fe("ClusterIP 10.96.0.1:80", "NodePort 192.0.2.10:30080"),
        CompileOptions(nodeport_addresses=("primary",), node_ips=("192.0.2.10", "192.0.2.99"))),
    Case("--node-ip replaces the Node object's addresses", make_service(mutate=node_port()),
        fe("ClusterIP 10.96.0.1:80", "NodePort 192.0.2.20:30080", "NodePort 192.0.2.21:30080"),
        CompileOptions(node_ips=("192.0.2.21", "192.0.2.20"))),
    Case("a ClusterIP Service with a stray nodePort has no NodePort frontend",
        make_service(mutate=node_port(svc_type="ClusterIP")), fe("ClusterIP 10.96.0.1:80")),
    Case("ExternalIPs are frontends on the Service port, of the matching family only",
        make_service(
            mutate=spec(externalIPs=["203.0.113.7", "2001:db8:ff::7", "203.0.113.7"])),
        fe("ClusterIP 10.96.0.1:80", "ExternalIP 203.0.113.7:80")),
    Case("LoadBalancer VIPs come from status ingress IPs in VIP mode, not Proxy mode or hostnames",
        make_service(mutate=load_balancer({"ip": "203.0.113.9"},
            {"ip": "203.0.113.10", "ipMode": "Proxy"}, {"hostname": "lb.example.com"},
            {"ip": "203.0.113.11", "ipMode": "VIP"}, loadBalancerIP="203.0.113.250")),
        fe("ClusterIP 10.96.0.1:80", "NodePort 192.0.2.10:30443", "LoadBalancer 203.0.113.9:80",
            "LoadBalancer 203.0.113.11:80")),
    Case("a LoadBalancer without allocated node ports has no NodePort frontend",
        make_service(mutate=lambda o: (load_balancer({"ip": "203.0.113.9"})(o),
                                       o["spec"]["ports"][0].pop("nodePort"))),
        fe("ClusterIP 10.96.0.1:80", "LoadBalancer 203.0.113.9:80")),
    Case("a dual-stack Service has one entry per family with that family's frontends",
        make_service(mutate=lambda o: (dual_stack(o), node_port()(o))),
        fe("ClusterIP 10.96.0.1:80", "NodePort 192.0.2.10:30080", "ClusterIP fd00:96::1:80",
            "NodePort 2001:db8::10:30080")),
    Case("a Service with two ports has one entry per port, sorted by port name",
        make_service(mutate=spec(ports=[{"name": "https", "port": 443},
            {"name": "dns", "port": 53, "protocol": "UDP"}])),
        fe("ClusterIP 10.96.0.1:53", "ClusterIP 10.96.0.1:443")),
    # --- Services that are not programmed ------------------------------------------------
    Case("a headless Service is not programmed",
        make_service(mutate=spec(clusterIP="None", clusterIPs=["None"])), fe()),
    Case("an ExternalName Service is not programmed",
        make_service(mutate=spec(type="ExternalName", externalName="db.example.com",
            clusterIP="", clusterIPs=[])), fe()),
    Case("a Service without an allocated cluster IP is not programmed",
        make_service(mutate=lambda o: (o["spec"].pop("clusterIP"), o["spec"].pop("clusterIPs"))),
        fe()),
    Case("a Service claimed by another proxy is not programmed",
        make_service(mutate=proxy_name("other")), fe()),
    Case("an empty service-proxy-name label still claims the Service for another proxy",
        make_service(mutate=proxy_name("")), fe()),
    Case("with --service-proxy-name only Services with that label value are programmed",
        make_service(mutate=proxy_name("kbp")), fe("ClusterIP 10.96.0.1:80"),
        CompileOptions(service_proxy_name="kbp")),
    Case("with --service-proxy-name unlabelled Services are left to kube-proxy", make_service(),
        fe(), CompileOptions(service_proxy_name="kbp")),
]  # fmt: skip


def render(entries: list[dict]) -> list[str]:
    return [f"{f['type']} {f['ip']}:{f['port']}" for e in entries for f in e["frontends"]]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_frontends(case: Case) -> None:
    state = state_of(*default_nodes(), case.service)
    entries = compile(state, "node-a", case.options).to_dict()["services"]
    assert render(entries) == case.frontends


def entries_of(*objects: Obj, options: CompileOptions | None = None) -> list[dict]:
    return compile(state_of(*default_nodes(), *objects), "node-a", options).to_dict()["services"]


def test_client_ip_affinity_defaults_to_three_hours() -> None:
    (entry,) = entries_of(make_service(mutate=spec(sessionAffinity="ClientIP")))
    assert entry["sessionAffinity"] == {"type": "ClientIP", "timeoutSeconds": 10800}


def test_affinity_none_is_null() -> None:
    (entry,) = entries_of(make_service(mutate=spec(sessionAffinity="None")))
    assert entry["sessionAffinity"] is None


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            load_balancer(
                {"ip": "203.0.113.9"}, externalTrafficPolicy="Local", healthCheckNodePort=32000
            ),
            32000,
        ),
        (
            load_balancer(
                {"ip": "203.0.113.9"}, externalTrafficPolicy="Cluster", healthCheckNodePort=32000
            ),
            None,
        ),
        (node_port(externalTrafficPolicy="Local", healthCheckNodePort=32000), None),
    ],
    ids=[
        "a LoadBalancer with externalTrafficPolicy Local has a health check node port",
        "a LoadBalancer with externalTrafficPolicy Cluster has none",
        "a NodePort Service has none",
    ],
)
def test_health_check_node_port(mutate: Callable[[Obj], None], expected: int | None) -> None:
    (entry,) = entries_of(make_service(mutate=mutate))
    assert entry["healthCheckNodePort"] == expected


def test_source_ranges_are_trimmed_normalised_and_split_by_family() -> None:
    service = make_service(
        mutate=lambda o: (
            dual_stack(o),
            load_balancer(
                {"ip": "203.0.113.9"},
                {"ip": "2001:db8:ff::9"},
                loadBalancerSourceRanges=[" 198.51.100.7/24 ", "10.0.0.0/8", "2001:db8:aa::1/48"],
            )(o),
        )
    )
    v4, v6 = entries_of(service)
    (lb4,) = [f for f in v4["frontends"] if f["type"] == "LoadBalancer"]
    (lb6,) = [f for f in v6["frontends"] if f["type"] == "LoadBalancer"]
    assert lb4["sourceRanges"] == ["10.0.0.0/8", "198.51.100.0/24"]
    assert lb6["sourceRanges"] == ["2001:db8:aa::/48"]
    assert all("sourceRanges" not in f for f in v4["frontends"] if f["type"] != "LoadBalancer")


def test_dual_stack_entries_use_only_their_family_of_endpoints() -> None:
    v4, v6 = entries_of(
        make_service(mutate=dual_stack),
        make_slice(name="v4", endpoints=[make_endpoint("10.244.1.5", "node-a")]),
        make_slice(
            name="v6", family="IPv6", endpoints=[make_endpoint("FD00:244:1:0::5", "node-a")]
        ),
    )
    assert (v4["ipFamily"], [b["ip"] for b in v4["clusterBackends"]]) == ("IPv4", ["10.244.1.5"])
    assert (v6["ipFamily"], [b["ip"] for b in v6["clusterBackends"]]) == ("IPv6", ["fd00:244:1::5"])


def test_single_stack_ipv6_service_ignores_ipv4_slices() -> None:
    (entry,) = entries_of(
        make_service(mutate=spec(clusterIP="fd00:96::1", clusterIPs=["fd00:96::1"])),
        make_slice(name="v4", endpoints=[make_endpoint("10.244.1.5", "node-a")]),
    )
    assert entry["ipFamily"] == "IPv6"
    assert entry["clusterBackends"] == [] and entry["hasEndpoints"] is False


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o["metadata"]["labels"].update({"service.kubernetes.io/headless": ""}),
        lambda o: o.update(addressType="FQDN", endpoints=[{"addresses": ["db.example.com"]}]),
    ],
    ids=["slices labelled headless are not used", "FQDN slices are not used"],
)
def test_slices_that_are_not_proxied(mutate: Callable[[Obj], None]) -> None:
    (entry,) = entries_of(
        make_service(), make_slice(endpoints=[make_endpoint("10.244.1.5", "node-a")], mutate=mutate)
    )
    assert entry["clusterBackends"] == [] and entry["hasEndpoints"] is False
