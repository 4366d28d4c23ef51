"""A state that fits the maps is applied even when no Service keeps one endpoint (issue
30): the 903-of-1,024-slots case, on real maps through EbpfDataplane, with real
connections to every Service afterwards.

Address plan (tests/lab/nodelab.py): one node namespace (node-a) with pods client1
10.244.1.1 and be1..be3 10.244.1.2-4, each backend serving TCP on 8080-8086 and
answering with its pod name. Services s0..s42 get ClusterIPs 10.96.1.1-43 port 80.
Before: each Service has 21 endpoints "elsewhere" (10.244.2.1-21:8080 on node-b, which
the lab does not have). After: each has the three backend pods on seven target ports
(one EndpointSlice a port), 21 endpoints that answer. Both states hold 903 slots and
903 backends in maps of 1,024 (88 %); old beside new would need 1,806.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from itertools import pairwise

import pytest

from agent.dataplane.ebpf.dataplane import EbpfDataplane
from agent.dataplane.ebpf.maps import FrontendKey, KernelContent, MapSizes

from ..builders import make_endpoint, make_service, make_slice
from .test_dataplane import BACKENDS, Env, _ip, lab_env, local

pytestmark = pytest.mark.kernel

SERVICES = 43
TARGET_PORTS = range(8080, 8087)  # 3 pods x 7 ports: 21 endpoints a Service
SIZES = MapSizes(services=1024, slots=1024, backends=1024, ct=4096, affinity=1024)


@pytest.fixture(scope="module", params=["ebpf-off", "ebpf-all"])
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    """The lab programmed by eBPF (tc alone, and with the socket hooks) on small maps."""
    with lab_env(request.param, ["client1"], ["tcp"], "kbp-test-capacity", SIZES,
                 cgroup=True) as made:  # fmt: skip
        for name in BACKENDS:
            made.pod(name).serve(TARGET_PORTS[1:], ("tcp",))  # 8080 is served already
        yield made


def cluster_ip(i: int) -> str:
    return f"10.96.1.{i + 1}"


def fleet(env: Env, answering: bool) -> list[dict]:
    """Every Service with its 21 endpoints: elsewhere, or the backend pods."""
    objects = []
    for i in range(SERVICES):
        name = f"s{i}"
        objects.append(make_service(name=name, mutate=_ip(cluster_ip(i))))
        if answering:
            pods = [local(env.pod(n)) for n in BACKENDS]
            objects += [make_slice(name=f"{name}-{port}", service=name, endpoints=pods, port=port)
                        for port in TARGET_PORTS]  # fmt: skip
        else:
            away = [make_endpoint(f"10.244.2.{j}", "node-b") for j in range(1, 22)]
            objects.append(make_slice(name=f"{name}-away", service=name, endpoints=away))
    return objects


def served(content: KernelContent) -> dict[FrontendKey, tuple[object, ...]]:
    """Each frontend's entry but for its set ids, and its sets' backend ids: equal for the
    kernel's content (set ids: the sets' first slots) and the planner's (its own ids)."""
    return {
        key: (replace(v, set_id=0, internal_set_id=0), content.slots.get(v.set_id),
              content.slots.get(v.internal_set_id), content.backends)
        for key, v in content.services.items()
    }  # fmt: skip


def test_replacing_every_endpoint_at_88_percent_fill_is_applied_and_served(env: Env) -> None:
    dataplane = env.running()
    assert isinstance(dataplane, EbpfDataplane)
    writer = dataplane.maps
    env.program(*fleet(env, answering=False))
    assert writer.current.slot_count() == 903 and len(writer.current.backends) == 903

    after = fleet(env, answering=True)
    env.program(*after)  # used to be refused: "map kbp_slots needs 1806 entries"
    held = writer._read_kernel()  # its set ids are first slots of kbp_slots
    assert served(held) == served(writer.current)
    assert held.slot_count() == 903 and len(held.backends) == 903
    assert writer.needed["slots"] == 903
    client = env.pod("client1")
    for i in range(SERVICES):
        result = client.connect_many(cluster_ip(i), 80, "tcp", 3)
        assert result.errors == {}, (i, result.details)
        assert set(result.counts) <= set(BACKENDS), (i, result.counts)

    # The next apply, of an unrelated change, is an ordinary one.
    late = make_service(name="late", mutate=_ip("10.96.1.200"))
    late_slice = make_slice(name="late-1", service="late", endpoints=[local(env.pod("be1"))])
    env.program(*after, late, late_slice)
    result = client.connect_many("10.96.1.200", 80, "tcp", 3)
    assert result.errors == {} and set(result.counts) == {"be1"}, result.details
    # And back: every endpoint replaced again (elsewhere), applied.
    env.program(*fleet(env, answering=False))
    assert served(writer._read_kernel()) == served(writer.current)
    assert writer.current.slot_count() == 903


def test_a_set_finding_free_slots_only_scattered_moves_others_together_and_all_serve(
    env: Env,
) -> None:
    """48 Services of 21 slots fill kbp_slots (1,008 of 1,023); every other one goes and a
    Service of 50 slots comes: 519 slots are free but in runs of 21 (and 15 at the end),
    so Services that stay are moved down together (each written to a free run, its
    frontend flipped, its old run zeroed) until a run of 50 is there. The kernel then
    holds exactly the new state, some Services at new first slots, and each serves."""
    dataplane = env.running()
    assert isinstance(dataplane, EbpfDataplane)
    writer = dataplane.maps
    pods = [local(env.pod(n)) for n in BACKENDS]

    def service(i: int, endpoints: list[dict]) -> list[dict]:
        name = f"f{i}"
        return [make_service(name=name, mutate=_ip(f"10.96.2.{i + 1}")),
                *(make_slice(name=f"{name}-{port}", service=name, endpoints=endpoints, port=port)
                  for port in TARGET_PORTS)]  # fmt: skip

    full = [obj for i in range(48) for obj in service(i, pods)]
    env.program(*full)
    assert writer.current.slot_count() == 1008
    before = {k.addr: v.set_id for k, v in writer._read_kernel().services.items()}
    kept = [obj for i in range(1, 48, 2) for obj in service(i, pods)]
    away = [make_endpoint(f"10.244.2.{j}", "node-b") for j in range(1, 30)]
    big = [make_service(name="big", mutate=_ip("10.96.2.100")),
           *(make_slice(name=f"big-{port}", service="big", endpoints=pods, port=port)
             for port in TARGET_PORTS),
           make_slice(name="big-away", service="big", endpoints=away)]  # fmt: skip
    env.program(*kept, *big)
    held = writer._read_kernel()
    assert served(held) == served(writer.current)
    assert held.slot_count() == 24 * 21 + 50
    after = {k.addr: v.set_id for k, v in held.services.items()}
    assert any(after[addr] < before[addr] for addr in after if addr in before), (before, after)
    runs = sorted((v.set_id, v.count) for v in held.services.values())
    assert all(a + n <= b for (a, n), (b, _) in pairwise(runs)), runs
    client = env.pod("client1")
    for i in range(1, 48, 2):
        result = client.connect_many(f"10.96.2.{i + 1}", 80, "tcp", 3)
        assert result.errors == {}, (i, result.details)
        assert set(result.counts) <= set(BACKENDS), (i, result.counts)
