"""External traffic through `kube-bpf-proxy run` on two nodes (tests/kernel/extlab.py):
NodePort to local and remote backends, LoadBalancer VIP, ExternalIP, externalTrafficPolicy
Local with its health check, loadBalancerSourceRanges, NodePort from a pod and from the
node itself, Maglev agreeing across nodes, XDP and clean-up, each for the iptables and
the eBPF dataplane (XDP native, XDP off).

Address plan: extlab.py's, plus these pods and Services (every backend serves TCP and UDP
on 8080 and answers "<pod> <source address it saw>"):

    client-a  10.244.1.1, fd00:244:1::1   on node-a
    web-a     10.244.1.2, fd00:244:1::2   on node-a
    web-b     10.244.2.1, fd00:244:2::1   on node-b
    web-a2    10.244.1.3                  on node-a
    web-b2    10.244.2.2                  on node-b

    np-local   NodePort 30011, dual-stack (10.96.0.11, fd00:96::11 :80)   → web-a
    np-remote  NodePort 30012 TCP and UDP, dual-stack (10.96.0.12, fd00:96::12 :80) → web-b
    lb-open    LoadBalancer 203.0.113.9:80, ExternalIP 203.0.113.7:80, NodePort 30013 → web-b
    lb-ranged  LoadBalancer 203.0.113.9:81, sourceRanges [192.0.2.100/32], NodePort 30014
               → web-a
    lb-local   LoadBalancer 203.0.113.9:82, externalTrafficPolicy Local, NodePort 30015,
               healthCheckNodePort 32015 → web-a
    lb-maglev  LoadBalancer 203.0.113.11:80, lb-algorithm maglev, NodePort 30016
               → web-a, web-a2, web-b, web-b2 (outside-1 has no route to this VIP until
               a test gives it one with ExtLab.route_via)

The semantics are kube-proxy's, with the issue's eBPF choices where they differ: under
externalTrafficPolicy Cluster, kube-proxy masquerades all external traffic, while the eBPF
dataplane translates only the destination when the backend is on this node (the pod sees
the client) and also the source when it is on another node (replies must come back here).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest

from tests.lab.nodelab import Result

from .extlab import (
    DATAPLANES,
    EXTERNAL_IFNAME,
    EXTERNAL_IP,
    LB_VIP,
    NETFILTER,
    ExtLab,
    answers,
)
from .tchooks import our_tc_programs

# Slow (a two-node lab with agents, built per dataplane in the first test of each):
# `-m 'not slow'` leaves these out.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NODE_A = ("192.0.2.10", "2001:db8::10")
NODE_B = ("192.0.2.11", "2001:db8::11")
OUTSIDE_1 = ("192.0.2.100", "2001:db8::100")
OUTSIDE_2 = ("192.0.2.101", "2001:db8::101")
NP_LOCAL, NP_REMOTE, NP_OPEN, NP_RANGED, NP_ETP_LOCAL = 30011, 30012, 30013, 30014, 30015
NP_MAGLEV = 30016
MAGLEV_VIP = "203.0.113.11"
HEALTH_CHECK_PORT = 32015
CLUSTER_IP_LOCAL = "10.96.0.11"
DROP_TIMEOUT = 1.0  # an expected timeout waits this long; answers here take milliseconds


def node(name: str, ipv4: str, ipv6: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
        "status": {"addresses": [{"type": "InternalIP", "address": ipv4},
                                 {"type": "InternalIP", "address": ipv6}]},
    }  # fmt: skip


def service(name: str, cluster_ips: list[str], ports: list[dict], **spec: object) -> dict:
    """A Service of `spec["type"]` on these ClusterIPs (both families: dual-stack) and
    ports (each targets 8080); `vip` becomes its load balancer status."""
    vip = spec.pop("vip", None)
    families = ["IPv6" if ":" in ip else "IPv4" for ip in cluster_ips]
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "clusterIP": cluster_ips[0], "clusterIPs": cluster_ips, "ipFamilies": families,
            "ipFamilyPolicy": "RequireDualStack" if len(families) > 1 else "SingleStack",
            "ports": [{"targetPort": 8080, **port} for port in ports],
            **spec,
        },
        "status": {"loadBalancer": {"ingress": [{"ip": vip}] if vip else []}},
    }  # fmt: skip


def endpoint_slice(service_name: str, address: str, node_name: str, protos: list[str]) -> dict:
    """One ready endpoint on node_name, port 8080 for each protocol (port names tcp, udp)."""
    return endpoints_slice(service_name, [(address, node_name)], protos)


def endpoints_slice(service_name: str, endpoints: list[tuple[str, str]], protos: list[str]) -> dict:
    """Ready endpoints (address, node name) of one family, port 8080 for each protocol."""
    family = "IPv6" if ":" in endpoints[0][0] else "IPv4"
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{service_name}-{family.lower()}", "namespace": "default",
                     "labels": {"kubernetes.io/service-name": service_name}},
        "addressType": family,
        "ports": [{"name": p.lower(), "port": 8080, "protocol": p} for p in protos],
        "endpoints": [{"addresses": [address], "conditions": {"ready": True},
                       "nodeName": node_name} for address, node_name in endpoints],
    }  # fmt: skip


def annotated(obj: dict, annotations: dict[str, str]) -> dict:
    obj["metadata"]["annotations"] = annotations
    return obj


def port(proto: str, port: int, node_port: int) -> dict:
    return {"name": proto.lower(), "protocol": proto, "port": port, "nodePort": node_port}


WEB_A = ("10.244.1.2", "fd00:244:1::2")
WEB_B = ("10.244.2.1", "fd00:244:2::1")
WEB_A2, WEB_B2 = "10.244.1.3", "10.244.2.2"
# Where each backend pod runs: a backend on the node the traffic entered sees the client,
# one on the other node sees the entry node's address (SNAT).
POD_NODES = {"web-a": "node-a", "web-a2": "node-a", "web-b": "node-b", "web-b2": "node-b"}
DOCUMENTS = [
    node("node-a", *NODE_A),
    node("node-b", *NODE_B),
    service("np-local", [CLUSTER_IP_LOCAL, "fd00:96::11"], [port("TCP", 80, NP_LOCAL)],
            type="NodePort"),
    *(endpoint_slice("np-local", ip, "node-a", ["TCP"]) for ip in WEB_A),
    service("np-remote", ["10.96.0.12", "fd00:96::12"],
            [port("TCP", 80, NP_REMOTE), port("UDP", 80, NP_REMOTE)], type="NodePort"),
    *(endpoint_slice("np-remote", ip, "node-b", ["TCP", "UDP"]) for ip in WEB_B),
    service("lb-open", ["10.96.0.13"], [port("TCP", 80, NP_OPEN)], type="LoadBalancer",
            externalIPs=[EXTERNAL_IP], vip=LB_VIP),
    endpoint_slice("lb-open", WEB_B[0], "node-b", ["TCP"]),
    service("lb-ranged", ["10.96.0.14"], [port("TCP", 81, NP_RANGED)], type="LoadBalancer",
            loadBalancerSourceRanges=[f"{OUTSIDE_1[0]}/32"], vip=LB_VIP),
    endpoint_slice("lb-ranged", WEB_A[0], "node-a", ["TCP"]),
    service("lb-local", ["10.96.0.15"], [port("TCP", 82, NP_ETP_LOCAL)], type="LoadBalancer",
            externalTrafficPolicy="Local", healthCheckNodePort=HEALTH_CHECK_PORT, vip=LB_VIP),
    endpoint_slice("lb-local", WEB_A[0], "node-a", ["TCP"]),
    annotated(service("lb-maglev", ["10.96.0.16"], [port("TCP", 80, NP_MAGLEV)],
                      type="LoadBalancer", vip=MAGLEV_VIP),
              {"kube-bpf-proxy.io/lb-algorithm": "maglev"}),
    endpoints_slice("lb-maglev", [(WEB_A[0], "node-a"), (WEB_A2, "node-a"),
                                  (WEB_B[0], "node-b"), (WEB_B2, "node-b")], ["TCP"]),
]  # fmt: skip
MANIFESTS = "".join(f"---\n{json.dumps(doc)}\n" for doc in DOCUMENTS)  # JSON is YAML


@pytest.fixture(scope="module", params=DATAPLANES)
def ext(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[ExtLab]:  # fmt: skip
    """The lab with its pods, and an agent per node on `request.param`'s dataplane; shared
    by the module's tests for that dataplane (building it is the slow part)."""
    with ExtLab() as lab:
        pods = [lab.add_pod("node-a", "client-a"), lab.add_pod("node-a", "web-a"),
                lab.add_pod("node-b", "web-b"), lab.add_pod("node-a", "web-a2"),
                lab.add_pod("node-b", "web-b2")]  # fmt: skip
        # The manifests name these addresses.
        assert [p.ipv4 for p in pods] == ["10.244.1.1", WEB_A[0], WEB_B[0], WEB_A2, WEB_B2]
        for pod in pods[1:]:
            lab.serve(pod, [8080])
        manifests = tmp_path_factory.mktemp("external") / "services.yaml"
        manifests.write_text(MANIFESTS)
        try:
            lab.start_agents(manifests, request.param)
            yield lab
        finally:
            lab.stop_agents()
            for node in lab.nodes:
                lab.cleanup(node)


def not_on(dataplane: str | tuple[str, ...], reason: str) -> pytest.MarkDecorator:
    """This scenario does not apply to `dataplane`(s): skipped there with `reason`, run on
    the others (the same module-scoped `ext` labs, chosen indirectly)."""
    kinds = (dataplane,) if isinstance(dataplane, str) else dataplane
    skip = pytest.mark.skip(reason=f"not on {' or '.join(kinds)}: {reason}")
    return pytest.mark.parametrize(
        "ext", [pytest.param(d, marks=skip) if d in kinds else d for d in DATAPLANES],
        indirect=True,
    )  # fmt: skip


def served(result: Result, pod: str, peer: str | set[str], n: int = 3) -> bool:
    """Whether all n exchanges were answered by `pod`, which saw `peer` (or one of them)."""
    seen = answers(result)
    peers = {peer} if isinstance(peer, str) else peer
    return (
        result.errors == {}
        and sum(seen.values()) == n
        and all(p == pod and address in peers for p, address in seen)
    )


def local_backend_sees(ext: ExtLab, client: str) -> str | set[str]:
    """The source a backend on node-a sees for an outside client's external traffic under
    externalTrafficPolicy Cluster. eBPF translates only the destination: the client's own
    address (the pod's replies pass node-a anyway, which untranslates them). kube-proxy's
    iptables masquerades: some address of node-a, never the client's. Which one is up to
    MASQUERADE: the outgoing device's primary address, else the first device's that has
    one; a pod veth has no IPv4 address, so in this lab that is 169.254.1.1 on lo (IPv6
    picks node-a's global 2001:db8::10)."""
    if ext.dataplane not in NETFILTER:
        return client
    addresses = ext.nodes["node-a"].addresses()
    assert client not in addresses
    return addresses


@pytest.mark.parametrize("family", [0, 1], ids=["IPv4", "IPv6"])
def test_nodeport_to_a_backend_on_the_same_node(ext: ExtLab, family: int) -> None:
    result = ext.connect("outside-1", NODE_A[family], NP_LOCAL)
    expected = local_backend_sees(ext, OUTSIDE_1[family])
    assert served(result, "web-a", expected), (answers(result), result)


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("family", [0, 1], ids=["IPv4", "IPv6"])
def test_nodeport_to_a_backend_on_another_node_is_source_translated(
    ext: ExtLab, family: int, proto: str
) -> None:
    result = ext.connect("outside-1", NODE_A[family], NP_REMOTE, proto)
    # node-a's own address, so web-b's replies return through node-a to be untranslated
    assert served(result, "web-b", NODE_A[family]), (answers(result), result)


@pytest.mark.parametrize("frontend", [LB_VIP, EXTERNAL_IP], ids=["LoadBalancer", "ExternalIP"])
def test_loadbalancer_vip_and_external_ip_from_outside(ext: ExtLab, frontend: str) -> None:
    for client in ("outside-1", "outside-2"):
        result = ext.connect(client, frontend, 80)
        assert served(result, "web-b", NODE_A[0]), (client, answers(result), result)


def test_external_traffic_policy_local_keeps_the_client_address(ext: ExtLab) -> None:
    via_nodeport = ext.connect("outside-1", NODE_A[0], NP_ETP_LOCAL)
    assert served(via_nodeport, "web-a", OUTSIDE_1[0]), (answers(via_nodeport), via_nodeport)
    via_vip = ext.connect("outside-2", LB_VIP, 82)
    assert served(via_vip, "web-a", OUTSIDE_2[0]), (answers(via_vip), via_vip)


def test_external_traffic_policy_local_drops_on_a_node_without_a_local_backend(
    ext: ExtLab,
) -> None:
    result = ext.connect("outside-1", NODE_B[0], NP_ETP_LOCAL, n=1, timeout=DROP_TIMEOUT)
    # DROP, not REJECT: the Service has endpoints, just none on node-b
    assert result.errors == {"timeout": 1} and not result.counts, result
    # ... while node-b forwards the same Service's other traffic as usual: its NodePort
    # for a Cluster-policy Service reaches web-a on node-a
    other = ext.connect("outside-1", NODE_B[0], NP_LOCAL)
    assert served(other, "web-a", NODE_B[0]), (answers(other), other)


def test_health_check_node_port_reports_local_endpoints(ext: ExtLab) -> None:
    status, body = ext.http_get("outside-1", f"http://{NODE_A[0]}:{HEALTH_CHECK_PORT}/")
    assert status == 200, (status, body)
    report = json.loads(body)
    assert report["service"] == {"namespace": "default", "name": "lb-local"}
    assert report["localEndpoints"] == 1 and report["serviceProxyHealthy"] is True, report

    status, body = ext.http_get("outside-1", f"http://{NODE_B[0]}:{HEALTH_CHECK_PORT}/")
    assert status == 503, (status, body)
    assert json.loads(body)["localEndpoints"] == 0, body


def test_load_balancer_source_ranges_apply_to_the_vip_only(ext: ExtLab) -> None:
    allowed = ext.connect("outside-1", LB_VIP, 81)
    expected = local_backend_sees(ext, OUTSIDE_1[0])
    assert served(allowed, "web-a", expected), (answers(allowed), allowed)
    refused = ext.connect("outside-2", LB_VIP, 81, n=1, timeout=DROP_TIMEOUT)
    assert refused.errors == {"timeout": 1} and not refused.counts, refused
    # loadBalancerSourceRanges do not apply to the same Service's NodePort (kube-proxy)
    nodeport = ext.connect("outside-2", NODE_A[0], NP_RANGED)
    expected = local_backend_sees(ext, OUTSIDE_2[0])
    assert served(nodeport, "web-a", expected), (answers(nodeport), nodeport)


MAGLEV_SOURCE_PORTS = range(40001, 40009)  # eight flows of outside-1, one per port


@not_on(
    NETFILTER,
    "no Maglev: iptables picks at random, nftables by a flow hash, and both "
    "masquerade external traffic",
)
def test_maglev_picks_the_same_backend_for_a_flow_on_either_node(ext: ExtLab) -> None:
    """An upstream load balancer may send one flow to any node (and to another one after
    a node fails): with Maglev, each node must hash it to the same backend. The same
    flows (outside-1, fixed source ports, each a TCP connection closed before the next)
    enter once via node-a and once via node-b. Only frontends every node shares (VIPs,
    ExternalIPs) can agree: a NodePort flow's destination is each node's own address,
    which the flow hash includes."""
    picked: dict[str, list[str]] = {}
    for entry, entry_ip in (("node-a", NODE_A[0]), ("node-b", NODE_B[0])):
        ext.route_via("outside-1", f"{MAGLEV_VIP}/32", entry)
        picked[entry] = []
        for source_port in MAGLEV_SOURCE_PORTS:
            result = ext.connect("outside-1", MAGLEV_VIP, 80, n=1, source_port=source_port)
            assert result.errors == {} and result.answered == 1, (entry, source_port, result)
            [(pod, peer)] = answers(result)
            # The backend's view proves which node forwarded the flow: the entry node
            # translates only the destination to its own pods, the source too to others.
            expected = OUTSIDE_1[0] if POD_NODES.get(pod) == entry else entry_ip
            assert peer == expected, (entry, source_port, pod, peer, result)
            picked[entry].append(pod)
    assert picked["node-a"] == picked["node-b"], picked
    # ... and that is not one backend for everyone: the flows spread (four backends, eight
    # flows). A per-node random pick would agree on all eight with odds of 4**-8.
    assert len(set(picked["node-a"])) > 1, picked


@pytest.mark.parametrize("nodeport", [NP_LOCAL, NP_REMOTE], ids=["local", "remote"])
def test_nodeport_from_a_pod_to_its_own_node(ext: ExtLab, nodeport: int) -> None:
    client = ext.nodes["node-a"].lab.pods["client-a"]
    backend = "web-a" if nodeport == NP_LOCAL else "web-b"
    for family in (0, 1):
        result = ext.connect(client, NODE_A[family], nodeport)
        assert result.errors == {} and {p for p, _ in answers(result)} == {backend}, (
            family, result,
        )  # fmt: skip


@pytest.mark.parametrize(
    ("ip", "port", "backend"),
    [(NODE_A[0], NP_LOCAL, "web-a"), (NODE_A[0], NP_REMOTE, "web-b"),
     (CLUSTER_IP_LOCAL, 80, "web-a")],
    ids=["nodeport-local", "nodeport-remote", "clusterip"],
)  # fmt: skip
def test_the_node_itself_reaches_nodeports_and_cluster_ips(
    ext: ExtLab, ip: str, port: int, backend: str
) -> None:
    result = ext.connect("node-a", ip, port)
    assert result.errors == {} and {p for p, _ in answers(result)} == {backend}, result


def xdp_mode(ext: ExtLab, node: str) -> str | None:
    """What `ip -j link` says is attached to eth0: "native", "generic" or None."""
    (link,) = json.loads(ext.nodes[node].run("ip", "-j", "link", "show", EXTERNAL_IFNAME))
    xdp = link.get("xdp")
    if xdp is None:
        return None
    return {1: "native", 2: "generic"}.get(xdp["mode"], f"mode {xdp['mode']}")


def xdp_report(ext: ExtLab, node: str) -> dict:
    done = ext.nodes[node].cli(
        "inspect", "xdp", "-o", "json", "--bpffs", str(ext.nodes[node].pin_dir)
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return json.loads(done.stdout)


def grown(before: dict, after: dict, *verdicts: str) -> int:
    """How many packets these verdicts counted between two `inspect xdp` reports."""
    return sum(after["verdicts"][v]["packets"] - before["verdicts"][v]["packets"]
               for v in verdicts)  # fmt: skip


def test_xdp_is_attached_as_reported_and_counts_its_verdicts(ext: ExtLab) -> None:
    node = ext.nodes["node-a"]
    if ext.dataplane in NETFILTER:
        # The netfilter dataplanes attach nothing to the external interface.
        assert xdp_mode(ext, "node-a") is None
        assert our_tc_programs(node.ns, EXTERNAL_IFNAME) == []
        return
    assert node.agent is not None
    status = node.agent.state()["status"]["xdp"]
    if ext.dataplane == "ebpf-noxdp":
        # --xdp=false: no XDP anywhere; every other test of the module gets the same
        # answers as with XDP on, from tc alone.
        assert xdp_mode(ext, "node-a") is None and xdp_mode(ext, "node-b") is None
        assert status["enabled"] is False, status
        return

    # Native, as on a NIC with an XDP driver: veth has one, and the lab gives the bridge
    # ends the XDP program that veth's XDP_TX needs on the other side (extlab.py).
    mode = xdp_mode(ext, "node-a")
    assert mode == "native" and xdp_mode(ext, "node-b") == "native", mode
    assert status["enabled"] is True, status
    assert status["interfaces"] == {EXTERNAL_IFNAME: mode}, status
    before = xdp_report(ext, "node-a")
    [interface] = before["interfaces"]
    assert interface["name"] == EXTERNAL_IFNAME and interface["mode"] == mode, before
    (link,) = json.loads(node.run("ip", "-j", "link", "show", EXTERNAL_IFNAME))
    assert interface["ifindex"] == link["ifindex"], (before, link)
    assert set(before["verdicts"]) >= {
        "pass", "drop-range", "drop-no-backend", "tx", "redirect", "drop-other",
    }, before  # fmt: skip

    # One exchange first, so node-a has resolved node-b's address: until then XDP's
    # bpf_fib_lookup finds no neighbour and must leave the packet to the stack.
    warm_up = ext.connect("outside-1", NODE_A[0], NP_REMOTE, n=1)
    assert served(warm_up, "web-b", NODE_A[0], n=1), warm_up
    before = xdp_report(ext, "node-a")
    before_b = xdp_report(ext, "node-b")
    remote = ext.connect("outside-1", NODE_A[0], NP_REMOTE)
    assert served(remote, "web-b", NODE_A[0]), (answers(remote), remote)
    refused = ext.connect("outside-2", LB_VIP, 81, n=1, timeout=DROP_TIMEOUT)
    assert refused.errors == {"timeout": 1}, refused
    no_backend = ext.connect("outside-1", NODE_B[0], NP_ETP_LOCAL, n=1, timeout=DROP_TIMEOUT)
    assert no_backend.errors == {"timeout": 1}, no_backend
    after = xdp_report(ext, "node-a")
    after_b = xdp_report(ext, "node-b")

    # The split: XDP forwards to other nodes itself and drops what source
    # ranges refuse (node-a), and what externalTrafficPolicy Local leaves no backend
    # for (node-b); at least one packet per connection each.
    assert grown(before, after, "tx", "redirect") >= 3, (before, after)
    assert grown(before, after, "drop-range") >= 1, (before, after)
    assert grown(before_b, after_b, "drop-no-backend") >= 1, (before_b, after_b)


def next_hop_epochs(ext: ExtLab, node: str, cause: str) -> float:
    """kbp_next_hop_epochs_total{cause} of a node's agent."""
    agent = ext.nodes[node].agent
    assert agent is not None
    found = re.search(rf'^kbp_next_hop_epochs_total\{{cause="{cause}"\}} (\S+)$',
                      agent.get("/metrics"), re.M)  # fmt: skip
    assert found is not None
    return float(found[1])


def wait_for_epoch(ext: ExtLab, node: str, cause: str, above: float) -> None:
    deadline = time.monotonic() + 10
    while next_hop_epochs(ext, node, cause) <= above:
        assert time.monotonic() < deadline, f"no new {cause} epoch on {node}"
        time.sleep(0.1)


@not_on(NETFILTER, "the eBPF programs' next-hop cache: netfilter asks the FIB per packet")
def test_a_neighbours_new_mac_address_reaches_new_flows_at_once(ext: ExtLab) -> None:
    """The eBPF programs keep a backend's next hop until the agent hears of a change
    (hops.py): node-b's MAC address in node-a's neighbour table turns wrong, and new flows
    to web-b through node-a fail; right again, and the first new flows after the agent
    heard of it are served, well before the 10 s an unwatched answer may live."""
    node = ext.nodes["node-a"]
    warm_up = ext.connect("outside-1", NODE_A[0], NP_REMOTE, n=1)
    assert served(warm_up, "web-b", NODE_A[0], n=1), warm_up
    (neighbour,) = json.loads(node.run("ip", "-j", "neigh", "show", NODE_B[0], "dev",
                                       EXTERNAL_IFNAME))  # fmt: skip
    right = neighbour["lladdr"]

    def set_mac(mac: str) -> None:
        before = next_hop_epochs(ext, "node-a", "neighbour")
        node.run("ip", "neigh", "replace", NODE_B[0], "lladdr", mac, "nud", "reachable",
                 "dev", EXTERNAL_IFNAME)  # fmt: skip
        wait_for_epoch(ext, "node-a", "neighbour", before)

    try:
        set_mac("02:00:5e:00:53:01")  # nobody's
        lost = ext.connect("outside-1", NODE_A[0], NP_REMOTE, n=1, timeout=DROP_TIMEOUT)
        assert lost.errors == {"timeout": 1}, lost
        set_mac(right)
        again = ext.connect("outside-1", NODE_A[0], NP_REMOTE)
        assert served(again, "web-b", NODE_A[0]), (answers(again), again)
        assert node.agent is not None
        hops = node.agent.state()["status"]["nextHops"]
        assert hops["watching"] and hops["epoch"] > 0, hops
        assert hops["newEpochs"]["start"] == 1 and hops["newEpochs"]["neighbour"] >= 2, hops
    finally:
        node.run("ip", "neigh", "replace", NODE_B[0], "lladdr", right, "nud", "reachable",
                 "dev", EXTERNAL_IFNAME)  # fmt: skip


def test_cleanup_leaves_nothing_behind(ext: ExtLab) -> None:
    """Last in the module: it stops the agents of this dataplane's lab."""
    statuses = ext.stop_agents()
    assert statuses == {"node-a": 0, "node-b": 0}, statuses
    for name, node in ext.nodes.items():
        done = ext.cleanup(name)
        assert done.returncode == 0, (name, done.stderr + done.stdout)
        assert not node.pin_dir.exists(), f"{name}: pins left in {node.pin_dir}"
        assert xdp_mode(ext, name) is None
        interfaces = [EXTERNAL_IFNAME, *(pod.host_ifname for pod in node.lab.pods.values())]
        for ifname in interfaces:
            hooks = our_tc_programs(node.ns, ifname)
            assert hooks == [], (name, ifname, hooks)
        for save in ("iptables-save", "ip6tables-save"):
            rules = node.run(save)
            assert "KBP-" not in rules, (name, save, rules)
        assert "kube-bpf-proxy" not in node.run("nft", "list", "tables"), name
        shown = node.run("bpftool", "--json", "cgroup", "show", str(node.cgroup)).strip()
        attached = json.loads(shown or "[]")
        assert attached == [], (name, attached)
    # With nothing programmed, external traffic to a Service no longer gets an answer.
    gone = ext.connect("outside-1", NODE_A[0], NP_REMOTE, n=1, timeout=DROP_TIMEOUT)
    assert not gone.counts, gone
