"""What the iptables and nftables sync benchmarks (iptables_sync.py, nftables_sync.py,
PB-9) share: the iptables implementations and their tools, a scratch namespace emptied
before it goes, and the generated workload a change at a time."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from agent.dataplane.iptables import backend as iptables_backend
from agent.dataplane.iptables import dataplane as iptables_module
from agent.dataplane.iptables import render as iptables_render
from agent.dataplane.iptables.backend import find_backend
from agent.dataplane.options import DEFAULT_POD_INTERFACES
from agent.lab.toolkit import in_netns
from agent.model.compile import CompileOptions, Compiler
from agent.model.decode import decode_object
from agent.model.nodestate import NodeState
from agent.sources.manifests import load_manifests
from bench.common.kernel import bench_netns
from bench.common.workload import THIS_NODE, Change, generate

POD_CIDR = "10.128.0.0/9"  # the generator's pod addresses (bench/compile.py)
LOCK_WAIT = "5"
# Seconds one iptables tool may run, ours and the floor's alike: an nft restore at 10k x 10
# takes longer than the dataplane's own COMMAND_TIMEOUT (300 s), which would stop it.
TOOL_TIMEOUT = 3600.0


@dataclass(frozen=True)
class Backend:
    """One `iptables` implementation: its tools per family (the dataplane's tables)."""

    name: str
    restore: dict[str, str]
    save: dict[str, str]
    iptables: dict[str, str]

    def version(self) -> str:
        try:
            proc = subprocess.run([self.iptables["IPv4"], "--version"], capture_output=True,
                                  text=True, timeout=10, check=False)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as err:
            return f"unavailable: {err}"
        return (proc.stdout or proc.stderr).strip()

    @contextlib.contextmanager
    def for_dataplane(self) -> Iterator[None]:
        """Point agent/dataplane/iptables at this backend's tools while inside, with the
        bench's command timeout (the module's 300 s is shorter than an nft restore at 10k)."""
        tools = find_backend(self.name)
        assert tools is not None, f"iptables-{self.name} is not installed"
        with (
            mock.patch.object(iptables_module, "choose_backend",
                              lambda requested, netns=None: (tools, "the bench's")),
            mock.patch.object(iptables_backend, "COMMAND_TIMEOUT", TOOL_TIMEOUT),
        ):  # fmt: skip
            yield


BACKENDS = {
    "nft": Backend(
        "nft",
        {"IPv4": "iptables-nft-restore", "IPv6": "ip6tables-nft-restore"},
        {"IPv4": "iptables-nft-save", "IPv6": "ip6tables-nft-save"},
        {"IPv4": "iptables-nft", "IPv6": "ip6tables-nft"},
    ),
    "legacy": Backend(
        "legacy",
        {"IPv4": "iptables-legacy-restore", "IPv6": "ip6tables-legacy-restore"},
        {"IPv4": "iptables-legacy-save", "IPv6": "ip6tables-legacy-save"},
        {"IPv4": "iptables-legacy", "IPv6": "ip6tables-legacy"},
    ),
}


def flush_tables(ns: str, backend: Backend) -> None:
    """Empty nat and filter of both families synchronously, so the namespace's deletion
    (asynchronous in the kernel) does not tear down 100k rules behind the next figure."""
    for family in ("IPv4", "IPv6"):
        for table in ("nat", "filter"):
            for flag in ("-F", "-X"):
                subprocess.run(in_netns(ns, [backend.iptables[family], "-w", LOCK_WAIT, "-t",
                                          table, flag]),
                               capture_output=True, timeout=TOOL_TIMEOUT, check=False)  # fmt: skip


@contextlib.contextmanager
def scratch_netns(backend: Backend) -> Iterator[str]:
    """A fresh namespace (bench.datapath's, deleted on exit), emptied before deletion."""
    with bench_netns() as ns:
        try:
            yield ns
        finally:
            flush_tables(ns, backend)


@dataclass
class Workload:
    services: int
    cluster: Any  # bench.common.workload.Cluster
    state: Any  # ClusterState, advanced by each change
    compiler: Compiler
    nodestate: NodeState
    options: iptables_render.RenderOptions


def workload(services: int, directory: Path) -> Workload:
    cluster = generate(services, directory)
    state, _ = load_manifests([cluster.path])
    state.take_changes()
    compiler = Compiler(THIS_NODE, CompileOptions(cluster_cidrs=(POD_CIDR,)))
    nodestate = compiler.full(state)
    # What the dataplane derives for IPv4 from the NodeState and its default interfaces.
    options = iptables_render.RenderOptions(
        "IPv4", (POD_CIDR,), iptables_render.interface_patterns(DEFAULT_POD_INTERFACES)
    )
    return Workload(services, cluster, state, compiler, nodestate, options)


def recompile(w: Workload, change: Change) -> tuple[NodeState, float]:
    start = time.perf_counter()
    values = [decode_object(json.loads(text)).value for text in change.texts]
    change.apply_to_state(w.state, values)
    new = w.compiler.update(w.state)
    return new, time.perf_counter() - start
