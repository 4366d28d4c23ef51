"""The pins the datapath opens are checked before bcc opens them (agent/dataplane/ebpf/
pins.py): the shapes derived from the map declarations are the shapes bcc creates;
someone else's map pinned at one of our paths is named in one line and kept, by the
loader, `cleanup`, `--dataplane ebpf` (which does not start) and `--dataplane auto`
(which falls back to nftables); and a changed --map-size-* moves the maps' contents into
maps of the new size at the next start, with an established connection through tc
surviving it.

Address plan (tests/lab/nodelab.py): node namespace = node-a; pods client 10.244.1.1,
be1 10.244.1.2, be2 10.244.1.3 serving TCP 8080; Service web 10.96.0.80:80.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import pytest

from agent.dataplane.ebpf import pins
from agent.dataplane.ebpf.abi import versioned
from agent.dataplane.ebpf.dataplane import remove_pins
from agent.dataplane.ebpf.kernel import LoadError, load_programs
from agent.dataplane.ebpf.libbpf import Map
from agent.dataplane.ebpf.maps import MapSizes
from tests.lab.nodelab import Lab

from ..conftest import BPFFS, require_nftables
from .agentproc import AgentProcess, run_argv, service_manifest, web_lab
from .agentproc import cli as agent_cli

CLUSTER_IP = "10.96.0.80"
SMALL = MapSizes(services=1024, slots=4096, backends=1024, ct=4096, affinity=1024)
FOREIGN_KEY, FOREIGN_VALUE = (7).to_bytes(8, "little"), (42).to_bytes(8, "little")


def make_foreign_map(path: Path) -> None:
    """A hash of 8-byte keys and values pinned at `path`, with one entry: someone else's
    map under one of our names."""
    subprocess.run(["bpftool", "map", "create", str(path), "type", "hash", "key", "8",
                    "value", "8", "entries", "16", "name", "not_kbp"], check=True)  # fmt: skip
    with Map.pinned(str(path)) as other:
        other.update(FOREIGN_KEY, FOREIGN_VALUE)


def assert_foreign_map_intact(path: Path) -> None:
    assert path.exists(), f"{path} was removed"
    with Map.pinned(str(path)) as other:
        assert (other.info.key_size, other.info.value_size, other.info.name) == (8, 8, "not_kbp")
        assert other.items() == [(FOREIGN_KEY, FOREIGN_VALUE)]


@pytest.fixture
def pin_dir() -> Iterator[Path]:
    """A pin directory of this test; every pin in it removed afterwards (also the foreign
    ones the test made, which the agent never removes)."""
    path = BPFFS / f"kbp-test-pins-{os.getpid()}-{time.monotonic_ns()}"
    path.mkdir()
    try:
        yield path
    finally:
        if path.exists():  # `cleanup` removes it when it leaves it empty
            for entry in path.iterdir():
                entry.unlink()
            path.rmdir()


# --- the derivation is what bcc creates ---------------------------------------------------


def test_the_derived_shapes_are_those_of_the_maps_bcc_creates(pin_dir: Path) -> None:
    loaded = load_programs(pin_dir, asdict(SMALL))
    loaded.close()
    expected = pins.expected(asdict(SMALL))
    found = {name: pins.shape_of_pin(pin_dir / versioned(name)) for name in expected}
    assert found == expected
    assert pins.foreign_pins(pin_dir) == []


# --- someone else's map at one of our paths -----------------------------------------------


def test_a_foreign_pin_is_named_in_one_line_and_kept_by_the_loader_and_cleanup(
    pin_dir: Path,
) -> None:
    path = pin_dir / versioned("kbp_ct")
    make_foreign_map(path)
    with pytest.raises(LoadError) as caught:
        load_programs(pin_dir, asdict(SMALL))
    message = str(caught.value)
    assert message == (
        f"pin {path} is a hash of 8-byte keys and 8-byte values named not_kbp, ours is an "
        "LRU hash of 40-byte keys and 80-byte values named kbp_ct: not our map; it was left "
        "in place"
    )
    assert sorted(p.name for p in pin_dir.iterdir()) == [path.name]  # bcc never ran
    assert remove_pins(pin_dir) == []
    assert_foreign_map_intact(path)


@pytest.fixture
def lab_setup(tmp_path: Path, pin_dir: Path) -> Iterator[tuple[Lab, Path]]:
    with web_lab() as lab:
        manifests = tmp_path / "web.yaml"
        backends = [lab.pods["be1"].ipv4, lab.pods["be2"].ipv4]
        manifests.write_text(service_manifest("web", CLUSTER_IP, backends))
        try:
            yield lab, manifests
        finally:
            agent_cli(lab.node_ns, "cleanup", "--bpffs", str(pin_dir))


def test_dataplane_ebpf_does_not_start_and_names_the_foreign_pin(
    lab_setup: tuple[Lab, Path], pin_dir: Path
) -> None:
    lab, manifests = lab_setup
    path = pin_dir / versioned("kbp_services")
    make_foreign_map(path)
    argv = run_argv(manifests, "node-a", "ebpf", "--bpffs", str(pin_dir))
    agent = AgentProcess(lab.node_ns, argv, "node-a")
    try:
        assert agent.wait_exit() != 0, agent.log()
    finally:
        agent.stop(signal.SIGKILL)
    errors = [line for line in agent.lines if "cannot start" in line]
    assert len(errors) == 1, agent.log()
    assert f"--dataplane ebpf: pins: pin {path} is a hash" in errors[0], errors
    assert "not our map; it was left in place" in errors[0], errors
    assert "Traceback" not in agent.log() and len(agent.lines) < 20, agent.log()
    assert_foreign_map_intact(path)


def test_dataplane_auto_falls_back_to_nftables_and_leaves_the_foreign_pin(
    lab_setup: tuple[Lab, Path], pin_dir: Path
) -> None:
    lab, manifests = lab_setup
    require_nftables(lab.node_ns)
    path = pin_dir / versioned("kbp_ct")
    make_foreign_map(path)
    argv = run_argv(manifests, "node-a", "auto", "--bpffs", str(pin_dir))
    agent = AgentProcess(lab.node_ns, argv, "node-a")
    try:
        fallback = agent.lines[agent.wait_for_line("falling back to nftables")]
        assert f"pins: pin {path} is a hash" in fallback, fallback
        agent.wait_for_line("sync: applied revision")  # then the leftovers of eBPF go
        kept = agent.wait_for_line(f"pin {path} is a hash")  # and this one is said to stay
        assert "it was left in place" in agent.lines[kept]
        served = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 10)
        assert served.errors == {} and set(served.counts) <= {"be1", "be2"}, served
    finally:
        assert agent.stop() == 0, agent.log()
    assert_foreign_map_intact(path)
    done = agent_cli(lab.node_ns, "cleanup", "--bpffs", str(pin_dir))
    assert done.returncode == 0, done.stderr
    assert f"pin {path} is a hash" in done.stderr and "left in place" in done.stderr, done
    assert_foreign_map_intact(path)


# --- a changed --map-size-* at the next start ------------------------------------------------

BIGGER = ("--map-size-services", "2048", "--map-size-slots", "8192", "--map-size-backends",
          "2048", "--map-size-ct", "8192", "--map-size-affinity", "2048")  # fmt: skip


def ct_flows_to(pin_dir: Path, port: int) -> int:
    """Conntrack entries (both directions) of flows with a client port `port`."""
    with Map.pinned(str(pin_dir / versioned("kbp_ct"))) as ct:
        packed = port.to_bytes(2, "big")
        return sum(1 for key, _ in ct.items() if packed in key)


def test_a_changed_map_size_moves_the_maps_and_an_established_connection_survives(
    lab_setup: tuple[Lab, Path], pin_dir: Path
) -> None:
    lab, manifests = lab_setup
    common = ("--bpffs", str(pin_dir), "--socket-lb", "off")
    first = AgentProcess(lab.node_ns, run_argv(manifests, "node-a", "ebpf", *common), "#1")
    stream = None
    try:
        first.wait_for_line("sync: applied revision")
        stream = lab.pods["client"].stream(CLUSTER_IP, 80)
        assert stream.backend in ("be1", "be2")
        ok, error = stream.wait_for(5)
        assert error is None and ok >= 5, error
        assert first.stop() == 0, first.log()
        with Map.pinned(str(pin_dir / versioned("kbp_ct"))) as ct:
            held = len(ct.items())
            assert ct.info.max_entries == 4096 and held >= 2
        # The second agent serves only the backend the connection does not use: without
        # its conntrack entries, the connection's next segment would go there (and be
        # reset), so it echoes on only if they were moved into the new map.
        other = "be2" if stream.backend == "be1" else "be1"
        manifests.write_text(service_manifest("web", CLUSTER_IP, [lab.pods[other].ipv4]))
        argv = run_argv(manifests, "node-a", "ebpf", *common, *BIGGER)
        second = AgentProcess(lab.node_ns, argv, "#2")
        try:
            moved = second.lines[second.wait_for_line(f"moved pinned map {versioned('kbp_ct')}")]
            # (a flow older than a second gains a spare reply entry meanwhile: >= held)
            counts = re.search(r"from 4096 to 8192 entries: (\d+) of (\d+) entries moved$", moved)
            assert counts and counts[1] == counts[2] and int(counts[1]) >= held, moved
            for name, old, new in (("services", 1024, 2048), ("slots", 4096, 8192),
                                   ("backends", 1024, 2048), ("affinity", 1024, 2048)):  # fmt: skip
                second.wait_for_line(f"moved pinned map {versioned('kbp_' + name)} from "
                                     f"{old} to {new} entries")  # fmt: skip
            second.wait_for_line("sync: applied revision")
            second.wait_for_line(f"removed {versioned('kbp_ct')}{pins.ASIDE_SUFFIX}")
            echoed, _ = stream.check()  # from here on, only this agent's programs
            got, error = stream.wait_for(echoed + 40, timeout=10)
            assert error is None, f"the connection broke across the resize: {error}"
            assert got >= echoed + 40, f"the connection stalled: {got - echoed} echoes in 10 s"
            with Map.pinned(str(pin_dir / versioned("kbp_ct"))) as ct:
                assert ct.info.max_entries == 8192
            assert not list(pin_dir.glob(f"*{pins.ASIDE_SUFFIX}")), list(pin_dir.iterdir())
            assert "planning with the pinned size" not in second.log(), second.log()
            new = lab.pods["client"].connect_many(CLUSTER_IP, 80, "tcp", 10)
            assert new.errors == {} and set(new.counts) == {other}, new
        finally:
            assert second.stop() == 0, second.log()
    finally:
        first.stop(signal.SIGKILL)
        if stream is not None:
            _, error = stream.close()
            assert error is None, error
