"""healthCheckNodePort servers over real HTTP: kube-proxy's body, status and headers;
ports opened, updated in place and closed as the NodeState changes; busy ports."""

from __future__ import annotations

import json
import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from agent.api import HealthCheckServers, ServiceHealth, health_checks
from agent.model.compile import compile
from agent.model.nodestate import NodeState

from ..builders import Obj, default_nodes, make_endpoint, make_service, make_slice, state_of

LOCAL = ["127.0.0.1"]


pytestmark = pytest.mark.usefixtures("no_thread_leak")  # tests/unit/conftest.py


@pytest.fixture
def servers() -> Iterator[HealthCheckServers]:
    with HealthCheckServers(LOCAL) as hc:
        yield hc


def free_ports(count: int) -> list[int]:
    """Ports free on every address right now (held open together so they differ). Bound
    on the wildcard: a port free on 127.0.0.1 alone may still be held elsewhere, e.g. by a
    client's TIME_WAIT on another loopback address, and then `[::]:port` fails."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("0.0.0.0", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def lb_service(
    name: str, hc_port: int | None, *, policy: str = "Local", two_ports: bool = False
) -> Obj:
    def mutate(obj: Obj) -> None:
        spec = obj["spec"]
        spec.update(type="LoadBalancer", externalTrafficPolicy=policy)
        if hc_port is not None:
            spec["healthCheckNodePort"] = hc_port
        spec["ports"][0]["nodePort"] = 30080
        if two_ports:
            spec["ports"].append(
                {"name": "https", "port": 443, "protocol": "TCP", "targetPort": 8443,
                 "nodePort": 30443}
            )  # fmt: skip
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.9"}]}}

    return make_service(name=name, mutate=mutate)


def endpoints_of(service: str, *endpoints: Obj, port_name: str = "http") -> Obj:
    return make_slice(
        name=f"{service}-{port_name}", service=service, endpoints=list(endpoints),
        port_name=port_name,
    )  # fmt: skip


def node_state(*objects: Obj) -> NodeState:
    return compile(state_of(*default_nodes(), *objects), "node-a")


def probe(port: int, path: str = "/healthz") -> tuple[int, dict[str, str], dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, dict(err.headers), json.loads(err.read())


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


# --- what is served ---------------------------------------------------------------------


def test_health_checks_count_distinct_ready_local_ips_per_service() -> None:
    state = node_state(
        lb_service("web", 32000, two_ports=True),
        endpoints_of(
            "web",
            make_endpoint("10.244.1.5", "node-a"),
            make_endpoint("10.244.1.6", "node-a"),
            make_endpoint("10.244.1.7", "node-a", ready=False, serving=True, terminating=True),
            make_endpoint("10.244.2.5", "node-b"),
        ),
        endpoints_of("web", make_endpoint("10.244.1.5", "node-a"), port_name="https"),
        lb_service("cluster-policy", 32001, policy="Cluster"),
        make_service(name="plain"),
    )
    ports, conflicts = health_checks(state)
    # web's two ServicePorts share the endpoint IPs; the terminating one does not count
    assert ports == {32000: ServiceHealth("default", "web", 2)}
    assert conflicts == []


def test_two_services_claiming_one_port_keep_the_first() -> None:
    state = node_state(lb_service("a", 32000), lb_service("b", 32000))
    ports, conflicts = health_checks(state)
    assert ports == {32000: ServiceHealth("default", "a", 0)}
    assert conflicts == [
        "healthCheckNodePort 32000 of Service default/b is already used by Service default/a"
    ]


# --- over HTTP -------------------------------------------------------------------------------


def test_200_with_the_local_endpoint_count(servers: HealthCheckServers) -> None:
    (port,) = free_ports(1)
    servers.sync(
        node_state(
            lb_service("web", port),
            endpoints_of(
                "web",
                make_endpoint("10.244.1.5", "node-a"),
                make_endpoint("10.244.1.6", "node-a"),
                make_endpoint("10.244.2.5", "node-b"),
            ),
        )
    )
    code, headers, body = probe(port)
    assert code == 200
    assert body == {
        "service": {"namespace": "default", "name": "web"},
        "localEndpoints": 2,
        "serviceProxyHealthy": True,
    }
    assert headers["Content-Type"] == "application/json"
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "2"
    assert probe(port, "/")[0] == 200  # any path, as kube-proxy


def test_503_without_local_endpoints(servers: HealthCheckServers) -> None:
    (port,) = free_ports(1)
    servers.sync(
        node_state(
            lb_service("web", port),
            endpoints_of(
                "web",
                make_endpoint("10.244.2.5", "node-b"),
                make_endpoint("10.244.1.7", "node-a", ready=False, serving=True, terminating=True),
            ),
        )
    )
    code, headers, body = probe(port)
    assert code == 503
    assert body["localEndpoints"] == 0
    assert body["serviceProxyHealthy"] is True
    assert headers["X-Load-Balancing-Endpoint-Weight"] == "0"


def test_503_while_the_proxy_is_unhealthy() -> None:
    healthy = False
    (port,) = free_ports(1)
    with HealthCheckServers(LOCAL, proxy_healthy=lambda: healthy) as servers:
        servers.sync(
            node_state(
                lb_service("web", port), endpoints_of("web", make_endpoint("10.244.1.5", "node-a"))
            )
        )
        code, _, body = probe(port)
        assert (code, body["localEndpoints"], body["serviceProxyHealthy"]) == (503, 1, False)
        healthy = True
        assert probe(port)[0] == 200


def test_ports_follow_services_and_counts_update_in_place(servers: HealthCheckServers) -> None:
    web_port, api_port = free_ports(2)
    web = lb_service("web", web_port)
    api = lb_service("api", api_port)
    one = endpoints_of("web", make_endpoint("10.244.1.5", "node-a"))
    two = endpoints_of(
        "web", make_endpoint("10.244.1.5", "node-a"), make_endpoint("10.244.1.6", "node-a")
    )

    servers.sync(node_state(web, one))
    assert set(servers.listening()) == {web_port}
    listener = servers.listening()[web_port]["127.0.0.1"]
    assert refused(api_port)

    servers.sync(node_state(web, two, api))  # web's count changes, api comes
    assert set(servers.listening()) == {web_port, api_port}
    assert servers.listening()[web_port]["127.0.0.1"] is listener  # not reopened
    assert probe(web_port)[2]["localEndpoints"] == 2
    assert probe(api_port)[0] == 503

    servers.sync(node_state(api))  # web goes away
    assert set(servers.listening()) == {api_port}
    assert listener.closed
    assert refused(web_port)
    assert servers.services() == {api_port: ServiceHealth("default", "api", 0)}


def test_a_port_moving_to_another_service_is_relabelled_in_place(
    servers: HealthCheckServers,
) -> None:
    (port,) = free_ports(1)
    servers.sync(node_state(lb_service("old", port)))
    listener = servers.listening()[port]["127.0.0.1"]
    servers.sync(node_state(lb_service("new", port)))
    assert servers.listening()[port]["127.0.0.1"] is listener
    assert probe(port)[2]["service"] == {"namespace": "default", "name": "new"}


def test_a_busy_port_is_logged_not_fatal_and_retried(
    servers: HealthCheckServers, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="agent.api")
    busy_port, other_port = free_ports(2)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", busy_port))
    blocker.listen()
    state = node_state(
        lb_service("busy", busy_port),
        endpoints_of("busy", make_endpoint("10.244.1.5", "node-a")),
        lb_service("fine", other_port),
    )
    try:
        servers.sync(state)  # must not raise
        assert set(servers.listening()) == {other_port}  # the other port still opens
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        message = warnings[0].getMessage()
        assert f"healthCheckNodePort {busy_port} of Service default/busy" in message
        assert "retrying at the next sync" in message
        servers.sync(state)  # the same failure again: not another warning
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    finally:
        blocker.close()
    servers.sync(state)
    assert set(servers.listening()) == {busy_port, other_port}
    assert probe(busy_port)[0] == 200


def test_conflicting_services_are_logged_once(
    servers: HealthCheckServers, caplog: pytest.LogCaptureFixture
) -> None:
    (port,) = free_ports(1)
    state = node_state(lb_service("a", port), lb_service("b", port))
    servers.sync(state)
    servers.sync(state)
    conflicts = [r for r in caplog.records if "already used by Service default/a" in r.getMessage()]
    assert len(conflicts) == 1
    assert probe(port)[2]["service"]["name"] == "a"


def test_close_stops_every_listener_and_later_syncs_do_nothing() -> None:
    ports = free_ports(2)
    state = node_state(*(lb_service(f"svc{i}", port) for i, port in enumerate(ports)))
    servers = HealthCheckServers(LOCAL)
    servers.sync(state)
    assert set(servers.listening()) == set(ports)
    servers.close()
    servers.close()
    assert all(refused(port) for port in ports)
    servers.sync(state)
    assert servers.listening() == {}


def test_the_default_bind_serves_every_address() -> None:
    (port,) = free_ports(1)
    with HealthCheckServers() as servers:
        servers.sync(node_state(lb_service("web", port)))
        assert list(servers.listening()[port]) == [""]
        assert probe(port)[0] == 503
