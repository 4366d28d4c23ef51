"""An agent killed in the middle of an apply leaves, per Service, the old or the new state in
the kernel, never neither, and the next agent converges (issue 14; the trial is
tests/kernel/killapply.py, bench/restart.py runs it 100 times at a larger size).

eBPF: every boundary between two map writes of an apply is tried once (the agent kills
itself with SIGKILL right after its K-th write call, K = 1, 2, ... until one completes the
apply first), alternating the direction (A to B, then B to A), then two kills at random
points of the apply. iptables: four kills at random points of the apply.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from agent.dataplane.ebpf import abi, codec
from agent.dataplane.ebpf.dataplane import EbpfDataplane, remove_pins
from agent.dataplane.ebpf.kernel import load_programs
from agent.dataplane.ebpf.maps import MapSizes
from agent.dataplane.ebpf.options import EbpfOptions
from agent.dataplane.iptables import dataplane as iptables_dataplane
from agent.dataplane.iptables.dataplane import IptablesDataplane, cleanup
from agent.dataplane.iptables.render import IPV4

from ..conftest import BPFFS, require_iptables
from .killapply import (
    NO_INTERFACES,
    Cluster,
    Trial,
    apply_whole,
    exact,
    exact_tables,
    kill_delays,
    map_sizes,
    nodestate,
    read_maps,
    read_tables,
    trial,
)

# Slow (up to 40 agents killed and restarted in one test): `-m 'not slow'` leaves these out.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

SERVICES, ENDPOINTS = 300, 10
MAX_WRITE_CALLS = 40  # an apply between A and B makes about ten


@pytest.fixture
def pins() -> Iterator[Path]:
    """A pin directory of this test, removed afterwards (also on failure)."""
    pin_dir = BPFFS / f"kbp-test-kill-{os.getpid()}"
    try:
        yield pin_dir
    finally:
        remove_pins(pin_dir)


def _check(t: Trial) -> None:
    assert not t.verdict.violations, (t.old, t.cut, t.verdict.violations[:5])
    assert not t.converge_problems, (t.old, t.cut, t.converge_problems)


def _flip(which: str) -> str:
    return "B" if which == "A" else "A"


def test_killed_ebpf_apply_leaves_old_or_new_and_next_agent_converges(
    netns: Callable[[], str], pins: Path, tmp_path: Path
) -> None:
    ns = netns()
    cluster = Cluster(SERVICES, ENDPOINTS)
    sizes = map_sizes(cluster)
    cluster.build(sizes, tmp_path)
    load_programs(pins, asdict(sizes)).close()  # creates the pins; the agents open them
    apply_whole(cluster, "A", pins, ns)
    assert exact(*read_maps(pins), *cluster.side("A")) == []
    timing = apply_whole(cluster, "B", pins, ns)  # the kind of apply the trials cut
    assert timing["writes"] > 5000

    old, outcomes = "B", []
    for k in range(1, MAX_WRITE_CALLS + 1):
        t = trial(cluster, old, pins, ns, die_after_write=k)
        _check(t)
        outcomes.append(t.verdict.outcome)
        old = _flip(old)
        if t.finished:
            break
    else:
        pytest.fail(f"no apply completed within {MAX_WRITE_CALLS} write calls: {outcomes}")
    # The first write leaves the old state (kbp_meta "unknown" only); the last, the new.
    assert outcomes[0] == "old" and outcomes[-1] == "new", outcomes

    for delay in kill_delays(2, timing["apply_s"], seed=14):
        _check(trial(cluster, old, pins, ns, delay=delay))
        old = _flip(old)


def test_killed_iptables_apply_leaves_old_or_new_tables_and_next_agent_converges(
    netns: Callable[[], str], tmp_path: Path
) -> None:
    ns = netns()
    require_iptables(ns)
    try:
        cluster = Cluster(SERVICES // 2, ENDPOINTS, dataplane="iptables")
        cluster.build(map_sizes(cluster), tmp_path)
        nowhere = tmp_path / "no-pins"  # the iptables agents have none
        for which in ("A", "B"):
            timing = apply_whole(cluster, which, nowhere, ns)
            cluster.tables[which] = read_tables(ns)
        assert timing["writes"] > 3000
        old = "B"
        for delay in kill_delays(4, timing["apply_s"], seed=14):
            _check(trial(cluster, old, nowhere, ns, delay=delay))
            old = _flip(old)
    finally:
        cleanup(ns)


def test_iptables_agent_killed_between_table_commits_is_not_adopted(
    netns: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One iptables-restore commits the nat table, then the filter table that ends with
    the KBP-STATE marker. An agent killed between the two leaves new nat rules beside
    the old marker; the next agent must not take those tables for the old state (if the
    cluster went back to it, it would write nothing and keep the new nat rules)."""
    ns = netns()
    require_iptables(ns)
    old, new = nodestate("A", 20, 3), nodestate("B", 20, 3)
    try:
        IptablesDataplane([NO_INTERFACES], netns=ns).apply(old)
        old_tables = read_tables(ns)

        real_run = iptables_dataplane._run

        class Killed(BaseException):
            """The agent's end, right after its IPv4 restore committed the nat table."""

        def killed_after_first_commit(netns_, argv, stdin=None):
            if stdin is not None and "restore" in argv[0]:
                nat_committed = stdin.index("COMMIT\n", stdin.index("*nat\n")) + len("COMMIT\n")
                real_run(netns_, argv, stdin[:nat_committed])
                raise Killed
            return real_run(netns_, argv, stdin)

        monkeypatch.setattr(iptables_dataplane, "_run", killed_after_first_commit)
        with pytest.raises(Killed):
            IptablesDataplane([NO_INTERFACES], netns=ns).apply(new)
        monkeypatch.undo()
        assert read_tables(ns)[IPV4, "nat"] != old_tables[IPV4, "nat"]  # the cut took effect

        restarted = IptablesDataplane([NO_INTERFACES], netns=ns)
        assert restarted.held_revision is None  # IPv4's marker is gone: unknown
        writes = restarted.apply(old)
        assert writes > 0
        assert exact_tables(read_tables(ns), old_tables) == []
    finally:
        cleanup(ns)


def test_restarted_ebpf_agent_reads_the_maps_once_before_its_first_apply(
    netns: Callable[[], str], pins: Path
) -> None:
    """Its first apply is a full one (the sync loop's first is), yet it compares with the
    content read at start-up instead of reading the maps a second time; later full
    applies (the periodic resync) read them again."""
    ns = netns()
    state = nodestate("A", 50, 3)
    sizes = MapSizes(1024, 4096, 4096, 4096, 1024)
    options = EbpfOptions(pins, (NO_INTERFACES,), sizes, netns=ns, watch=False)
    first = EbpfDataplane(options)
    try:
        assert first.apply(state) > 0
    finally:
        first.close()
    restarted = EbpfDataplane(options)
    try:
        reads = []
        read = restarted.maps._read_kernel
        restarted.maps._read_kernel = lambda: reads.append(1) or read()  # type: ignore[method-assign]
        assert restarted.apply(state, full=True) == 0
        assert reads == []
        assert restarted.apply(state, full=True) == 0
        assert reads == [1]
    finally:
        restarted.cleanup()


def test_restarted_ebpf_agent_marks_an_earlier_agents_frontends_with_their_types_flags(
    netns: Callable[[], str], pins: Path
) -> None:
    """The programs learn what a frontend's type means from flag bits (KBP_SVC_F_EXTERNAL:
    its replies are translated at the client); an agent of a release before the bit left
    frontends without it. A restarted agent sets the bits at start, before its first
    apply, and that apply then has nothing left to write."""
    ns = netns()
    state = nodestate("A", 50, 3)
    options = EbpfOptions(pins, (NO_INTERFACES,), MapSizes(1024, 4096, 4096, 4096, 1024),
                          netns=ns, watch=False)  # fmt: skip
    first = EbpfDataplane(options)
    try:
        assert first.apply(state) > 0
        services = first.programs.map("kbp_services")
        written = {k: codec.decode_service(v) for k, v in services.items()}
        external = {k for k, v in written.items() if v.type != abi.const.KBP_FE_CLUSTER_IP}
        assert external and len(external) < len(written)  # NodePorts beside ClusterIPs
        assert all(bool(v.flags & abi.const.KBP_SVC_F_EXTERNAL) == (k in external)
                   for k, v in written.items())  # fmt: skip
        without = ~abi.const.KBP_SVC_F_EXTERNAL
        earlier = [(k, codec.service_value(replace(v, flags=v.flags & without)))
                   for k, v in written.items()]  # fmt: skip
        services.update_items(earlier)  # as a release without the bit wrote them
    finally:
        first.close()
    restarted = EbpfDataplane(options)
    try:
        services = restarted.programs.map("kbp_services")
        assert {k: codec.decode_service(v) for k, v in services.items()} == written
        assert restarted.apply(state, full=True) == 0
    finally:
        restarted.cleanup()
