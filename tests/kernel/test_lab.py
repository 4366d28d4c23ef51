"""The namespace lab itself, without any eBPF: pods reach each other over IPv4 and IPv6,
TCP and UDP, through the node namespace; ClusterIP traffic nobody translates never gets
an answer; streams and the client modes work; teardown removes everything."""

from __future__ import annotations

import json
import re

import pytest

from agent.lab.toolkit import LabError
from tests.lab.nodelab import Lab, lab_namespaces

PORT = 8080
CONNECTIONS = 10
CLUSTER_IPS = ("10.96.0.10", "fd00:96::10")


def forwarded(lab: Lab) -> int:
    """Packets the node namespace forwarded so far, both families."""
    snmp = lab.run_in_node("cat", "/proc/net/snmp")
    names, values = (line.split() for line in snmp.splitlines() if line.startswith("Ip:"))
    ipv4 = int(values[names.index("ForwDatagrams")])
    snmp6 = lab.run_in_node("cat", "/proc/net/snmp6")
    ipv6 = int(re.search(r"^Ip6OutForwDatagrams\s+(\d+)", snmp6, re.M).group(1))
    return ipv4 + ipv6


@pytest.fixture
def pods(lab: Lab):
    client, server = lab.add_pod("client"), lab.add_pod("server")
    server.serve([PORT])
    return client, server


def test_pods_follow_the_address_plan(lab):
    first, second = lab.add_pod("first"), lab.add_pod("second")
    assert (second.ipv4, second.ipv6, second.host_ifname) == (
        "10.244.1.2", "fd00:244:1::2", "vethkbp2",
    )  # fmt: skip
    assert second.ns.startswith(lab.node_ns) and lab.node_ns.startswith("kbp-lab-")
    links = json.loads(lab.run_in_node("ip", "-j", "link", "show"))
    assert {(link["ifname"], link["ifindex"]) for link in links} >= {
        (first.host_ifname, first.host_ifindex),
        (second.host_ifname, second.host_ifindex),
    }
    routes = second.run("ip", "-j", "route", "show")
    assert json.loads(routes)[0]["gateway"] == "169.254.1.1"
    assert '"gateway":"fe80::1"' in second.run("ip", "-6", "-j", "route", "show", "default")


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_pods_reach_each_other_through_the_node(lab, pods, family, proto):
    client, server = pods
    before = forwarded(lab)

    result = client.connect_many(getattr(server, family), PORT, proto, CONNECTIONS)

    assert result.counts == {"server": CONNECTIONS}, result
    assert not result.errors
    assert forwarded(lab) - before >= 2 * CONNECTIONS  # requests and answers, routed


@pytest.mark.parametrize("proto", ["tcp", "udp"])
@pytest.mark.parametrize("cluster_ip", CLUSTER_IPS)
def test_cluster_ip_without_a_program_gets_no_answer(lab, pods, cluster_ip, proto):
    client, _ = pods
    result = client.connect_many(cluster_ip, PORT, proto, 2, timeout=0.5)
    assert result.answered == 0
    assert result.errors == {"timeout": 2}, result


def test_udp_from_one_socket_and_tcp_from_one_source_port(lab, pods):
    client, server = pods
    same = client.connect_many(server.ipv4, PORT, "udp", CONNECTIONS, same_socket=True)
    assert same.counts == {"server": CONNECTIONS}
    pinned = client.connect_many(server.ipv6, PORT, "tcp", 3, source_port=40000)
    assert pinned.counts == {"server": 3}, pinned


def test_refused_and_unreachable_are_told_apart(lab, pods):
    client, server = pods
    closed_port = client.connect_many(server.ipv4, PORT + 1, "tcp", 2)
    assert closed_port.errors == {"refused": 2}, closed_port
    udp_closed_port = client.connect_many(server.ipv6, PORT + 1, "udp", 2)
    assert udp_closed_port.errors == {"refused": 2}, udp_closed_port
    nowhere = client.connect_many("192.0.2.1", PORT, "tcp", 1)  # no route in the node
    assert nowhere.errors == {"unreachable": 1}, nowhere


def test_stream_echoes_until_closed(lab, pods):
    client, server = pods
    stream = client.stream(server.ipv6, PORT)
    assert stream.backend == "server"
    assert stream.wait_for(10) >= (10, None)
    ok, error = stream.close()
    assert error is None and ok >= 10


def test_stream_reports_a_broken_connection(lab, pods):
    client, server = pods
    stream = client.stream(server.ipv4, PORT)
    assert stream.wait_for(3)[1] is None
    server.stop_processes()  # the server closes its end
    stream.wait_for(10**6, timeout=5)
    ok, error = stream.check()
    assert ok >= 3 and error is not None
    stream.close()


def test_teardown_removes_namespaces_and_processes_even_on_failure():
    with pytest.raises(RuntimeError, match="test body failed"), Lab() as lab:
        client, server = lab.add_pod("client"), lab.add_pod("server")
        server.serve([PORT])
        stream = client.stream(server.ipv4, PORT)
        processes = [*server.processes, *client.processes]
        assert len(lab_namespaces()) >= 3
        raise RuntimeError("test body failed")
    assert lab_namespaces() == []
    assert all(proc.poll() is not None for proc in processes)
    assert stream.check()[0] > 0
    assert not lab.workdir.exists()


def test_bad_pod_names_and_duplicates_are_refused(lab):
    lab.add_pod("web-1")
    with pytest.raises(ValueError, match="already exists"):
        lab.add_pod("web-1")
    with pytest.raises(ValueError, match="lowercase"):
        lab.add_pod("Web_1")


def test_server_start_failure_is_reported(lab):
    pod = lab.add_pod("busy")
    pod.serve([PORT])
    with pytest.raises(LabError, match="did not start"):
        pod.serve([PORT])  # the port is taken
