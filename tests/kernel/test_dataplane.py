"""The eBPF dataplane end to end: NodeStates compiled from Kubernetes objects, programmed
into the real maps, and ordinary TCP/UDP clients in lab pods connecting to ClusterIPs.

Address plan (tests/kernel/lab.py): one node namespace (this is node-a) with pods
    client1 10.244.1.1   client2 10.244.1.2
    be1 10.244.1.3       be2 10.244.1.4       be3 10.244.1.5     (fd00:244:1::N too)
every backend serving TCP and UDP on 8080 and answering with its pod name.
Services get ClusterIPs 10.96.0.x and fd00:96::x; endpoints "elsewhere" are on node-b
(10.244.2.x), which does not exist in the lab: they must never receive traffic here.

One lab and one loaded datapath serve the whole module (compiling takes seconds); each
test programs its own Services, so a test's state replaces the previous one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.dataplane.base import DataplaneError
from agent.dataplane.ebpf.dataplane import EbpfDataplane, remove_pins
from agent.dataplane.ebpf.plan import MapSizes
from agent.model.compile import compile
from agent.model.nodestate import NodeState

from ..builders import default_nodes, make_endpoint, make_service, make_slice, state_of
from .lab import Lab, Pod

PORT = 8080
BACKENDS = ("be1", "be2", "be3")


class Env:
    def __init__(self, lab: Lab, dataplane: EbpfDataplane, pin_dir: Path) -> None:
        self.lab = lab
        self.dataplane = dataplane
        self.pin_dir = pin_dir
        self.pods = lab.pods
        self.next_ip = 10

    def pod(self, name: str) -> Pod:
        return self.pods[name]

    def program(self, *objects: dict) -> NodeState:
        state = compile(state_of(*default_nodes(), *objects), "node-a")
        self.dataplane.apply(state)
        return state

    def cluster_ip(self) -> tuple[str, str]:
        """A fresh ClusterIP pair per Service, so no test inherits another's flows."""
        self.next_ip += 1
        return f"10.96.0.{self.next_ip}", f"fd00:96::{self.next_ip:x}"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    from ..conftest import BPFFS, missing_kernel_prerequisites

    if missing_kernel_prerequisites():
        pytest.skip("kernel prerequisites missing")  # the per-test hook reports why
    pin_dir = BPFFS / f"kbp-test-dataplane-{time.monotonic_ns()}"
    with Lab() as lab:
        for name in ("client1", "client2", *BACKENDS):
            pod = lab.add_pod(name)
            if name in BACKENDS:
                pod.serve([PORT])
        try:
            dataplane = EbpfDataplane(
                pin_dir, ["vethkbp*"], MapSizes(4096, 65536, 4096, 4096, 1024), netns=lab.node_ns
            )
        except BaseException:
            remove_pins(pin_dir)  # the maps may be pinned before attaching failed
            raise
        try:
            yield Env(lab, dataplane, pin_dir)
        finally:
            dataplane.cleanup()
    assert not pin_dir.exists()


def service(
    env: Env,
    name: str,
    endpoints: list[dict],
    *,
    protocol: str = "TCP",
    dual_stack: bool = False,
    mutate: object = None,
) -> tuple[list[dict], str, str]:
    """A Service on port 80 → 8080 with one slice per family; (objects, v4 IP, v6 IP)."""
    ip4, ip6 = env.cluster_ip()

    def spec(obj: dict) -> None:
        obj["spec"]["clusterIP"] = ip4
        obj["spec"]["clusterIPs"] = [ip4, ip6] if dual_stack else [ip4]
        if dual_stack:
            obj["spec"]["ipFamilies"] = ["IPv4", "IPv6"]
            obj["spec"]["ipFamilyPolicy"] = "RequireDualStack"
        obj["spec"]["ports"][0]["protocol"] = protocol
        if callable(mutate):
            mutate(obj)

    def ports(obj: dict) -> None:
        obj["ports"][0]["protocol"] = protocol

    objects = [make_service(name=name, mutate=spec)]
    v4 = [e for e in endpoints if ":" not in e["addresses"][0]]
    v6 = [e for e in endpoints if ":" in e["addresses"][0]]
    objects.append(make_slice(name=f"{name}-v4", service=name, endpoints=v4, mutate=ports))
    if dual_stack:
        objects.append(
            make_slice(
                name=f"{name}-v6", service=name, endpoints=v6, mutate=ports, family="IPv6"
            )
        )
    return objects, ip4, ip6


def local(pod: Pod, family: int = 4, **conditions: bool) -> dict:
    return make_endpoint(pod.ipv4 if family == 4 else pod.ipv6, "node-a", **conditions)


def backends(env: Env, *names: str, family: int = 4) -> list[dict]:
    return [local(env.pod(n), family) for n in names]


# --- balancing --------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["TCP", "UDP"])
def test_connections_to_a_cluster_ip_reach_every_backend(env: Env, protocol: str) -> None:
    objects, ip4, _ = service(env, f"web-{protocol.lower()}", backends(env, *BACKENDS),
                              protocol=protocol)  # fmt: skip
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, protocol.lower(), 60)
    assert result.errors == {}, result.details
    assert set(result.counts) == set(BACKENDS), result.counts


@pytest.mark.parametrize("protocol", ["TCP", "UDP"])
def test_ipv6_connections_to_a_cluster_ip_reach_every_backend(env: Env, protocol: str) -> None:
    endpoints = backends(env, *BACKENDS) + backends(env, *BACKENDS, family=6)
    objects, _, ip6 = service(env, f"web6-{protocol.lower()}", endpoints, protocol=protocol,
                              dual_stack=True)  # fmt: skip
    env.program(*objects)
    result = env.pod("client1").connect_many(ip6, 80, protocol.lower(), 60)
    assert result.errors == {}, result.details
    assert set(result.counts) == set(BACKENDS), result.counts


def test_client_ip_affinity_keeps_each_client_on_one_backend(env: Env) -> None:
    def affinity(obj: dict) -> None:
        obj["spec"]["sessionAffinity"] = "ClientIP"
        obj["spec"]["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 60}}

    objects, ip4, _ = service(env, "sticky", backends(env, *BACKENDS), mutate=affinity)
    env.program(*objects)
    for client in ("client1", "client2"):
        result = env.pod(client).connect_many(ip4, 80, "tcp", 20)
        assert result.errors == {}, result.details
        assert len(result.counts) == 1, f"{client} spread over {result.counts}"


def test_maglev_service_reaches_every_backend(env: Env) -> None:
    def maglev(obj: dict) -> None:
        obj["metadata"]["annotations"] = {"kube-bpf-proxy.io/lb-algorithm": "maglev"}

    objects, ip4, _ = service(env, "hashed", backends(env, *BACKENDS), protocol="UDP",
                              mutate=maglev)  # fmt: skip
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, "udp", 60)
    assert result.errors == {}, result.details
    assert set(result.counts) == set(BACKENDS), result.counts


# --- changes ----------------------------------------------------------------------------


def test_removed_backend_gets_no_new_connections_and_others_keep_theirs(env: Env) -> None:
    objects, ip4, _ = service(env, "shrink", backends(env, *BACKENDS))
    env.program(*objects)
    streams = [env.pod("client1").stream(ip4, 80) for _ in range(6)]
    try:
        by_backend = {s.backend for s in streams}
        assert by_backend <= set(BACKENDS)
        gone = "be1"
        objects, _, _ = _same_service(env, "shrink", ip4, backends(env, "be2", "be3"))
        env.program(*objects)
        result = env.pod("client2").connect_many(ip4, 80, "tcp", 40)
        assert result.errors == {}, result.details
        assert set(result.counts) == {"be2", "be3"}, result.counts
        for stream in streams:
            if stream.backend != gone:
                ok_before, _ = stream.check()
                _, error = stream.wait_for(ok_before + 5)
                assert error is None, f"stream to surviving {stream.backend}: {error}"
        # and an added backend gets traffic
        objects, _, _ = _same_service(env, "shrink", ip4, backends(env, *BACKENDS))
        env.program(*objects)
        result = env.pod("client2").connect_many(ip4, 80, "tcp", 60)
        assert set(result.counts) == set(BACKENDS), result.counts
    finally:
        for stream in streams:
            stream.close()


def _same_service(env: Env, name: str, ip4: str, endpoints: list[dict]) -> tuple:
    def keep_ip(obj: dict) -> None:
        obj["spec"]["clusterIP"] = ip4
        obj["spec"]["clusterIPs"] = [ip4]

    objects = [
        make_service(name=name, mutate=keep_ip),
        make_slice(name=f"{name}-v4", service=name, endpoints=endpoints),
    ]
    return objects, ip4, None


# --- empty sets -------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["tcp", "udp"])
def test_service_without_endpoints_refuses_promptly(env: Env, protocol: str) -> None:
    objects, ip4, _ = service(env, f"empty-{protocol}", [], protocol=protocol.upper())
    env.program(*objects)
    started = time.monotonic()
    result = env.pod("client1").connect_many(ip4, 80, protocol, 3, timeout=2.0)
    assert result.errors == {"refused": 3}, result.details
    assert time.monotonic() - started < 3.0  # three attempts, none waited for a timeout


def test_local_policy_with_endpoints_only_elsewhere_drops(env: Env) -> None:
    def itp_local(obj: dict) -> None:
        obj["spec"]["internalTrafficPolicy"] = "Local"

    elsewhere = [make_endpoint("10.244.2.7", "node-b")]
    objects, ip4, _ = service(env, "local-only", elsewhere, mutate=itp_local)
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, "tcp", 2, timeout=0.5)
    assert result.errors == {"timeout": 2}, result.details


def test_internal_traffic_policy_local_uses_only_this_nodes_endpoints(env: Env) -> None:
    def itp_local(obj: dict) -> None:
        obj["spec"]["internalTrafficPolicy"] = "Local"

    endpoints = [*backends(env, "be2"), make_endpoint("10.244.2.7", "node-b")]
    objects, ip4, _ = service(env, "itp-local", endpoints, mutate=itp_local)
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, "tcp", 20)
    assert result.errors == {}, result.details
    assert result.counts == {"be2": 20}


def test_terminating_endpoints_serve_when_none_is_ready(env: Env) -> None:
    endpoints = [
        local(env.pod("be3"), ready=False, serving=True, terminating=True),
        local(env.pod("be1"), ready=False, serving=False, terminating=True),
    ]
    objects, ip4, _ = service(env, "draining", endpoints)
    env.program(*objects)
    result = env.pod("client1").connect_many(ip4, 80, "tcp", 10)
    assert result.errors == {}, result.details
    assert result.counts == {"be3": 10}


@pytest.mark.parametrize("protocol", ["tcp", "udp"])
def test_pod_reaching_its_own_service_is_served_by_itself(env: Env, protocol: str) -> None:
    objects, ip4, _ = service(env, f"hairpin-{protocol}", backends(env, "be1"),
                              protocol=protocol.upper())  # fmt: skip
    env.program(*objects)
    result = env.pod("be1").connect_many(ip4, 80, protocol, 10)
    assert result.errors == {}, result.details
    assert result.counts == {"be1": 10}


# --- operations -------------------------------------------------------------------------


def test_new_pod_interface_is_attached_within_a_second(env: Env) -> None:
    objects, ip4, _ = service(env, "late", backends(env, "be2"))
    env.program(*objects)
    pod = env.lab.add_pod("latecomer")
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if pod.host_ifindex in env.dataplane._attached:
            break
        time.sleep(0.02)
    result = pod.connect_many(ip4, 80, "tcp", 5)
    assert result.counts == {"be2": 5}, (result.counts, result.details)


def test_unchanged_state_writes_nothing(env: Env) -> None:
    objects, _, _ = service(env, "steady", backends(env, *BACKENDS))
    state = env.program(*objects)
    assert env.dataplane.apply(state) == 0
    assert env.dataplane.apply(state, full=True) == 0  # compared with the kernel's maps


def test_state_that_does_not_fit_is_refused_and_the_previous_stays(env: Env) -> None:
    objects, ip4, _ = service(env, "before", backends(env, *BACKENDS))
    env.program(*objects)
    many = []
    for n in range(5000):  # more frontends than the 4096-entry services map
        many += [make_service(name=f"s{n}", mutate=_ip(f"10.97.{n // 250}.{n % 250 + 1}"))]
    with pytest.raises(DataplaneError) as caught:
        env.program(*objects, *many)
    assert caught.value.reason == "capacity"
    assert "services" in str(caught.value)
    result = env.pod("client1").connect_many(ip4, 80, "tcp", 20)
    assert result.errors == {} and set(result.counts) == set(BACKENDS)


def _ip(ip: str) -> object:
    def mutate(obj: dict) -> None:
        obj["spec"]["clusterIP"] = ip
        obj["spec"]["clusterIPs"] = [ip]

    return mutate


def test_metrics_show_map_fill_and_datapath_drops(env: Env) -> None:
    from prometheus_client import generate_latest

    from agent.metrics import Metrics

    metrics = Metrics()
    env.dataplane.register_metrics(metrics)
    objects, ip4, _ = service(env, "metered", [])
    env.program(*objects)
    env.pod("client1").connect_many(ip4, 80, "tcp", 2, timeout=1.0)
    text = generate_latest(metrics.registry).decode()
    rejected = [
        line for line in text.splitlines()
        if line.startswith('kbp_datapath_drops_total{reason="rejected"}')
    ]  # fmt: skip
    assert rejected and float(rejected[0].split()[-1]) >= 2, text
    assert 'kbp_map_fill_ratio{map="kbp_services_v1"} 0.0002' in text, text
