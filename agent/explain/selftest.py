"""The agent's self-test of its eBPF datapath: `explain`'s question asked of one
programmed frontend at a time (a new connection from a pod to it), answered by the
attached programs' code (explain's build: the same source compiled with its dry run,
pinned beside the maps) run with BPF_PROG_TEST_RUN on the live maps (writing nothing), and
compared with the NodeState's answer. The keeper runs it, so that the agent checks what
it serves and not only what it wrote.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model.nodestate import NodeState
from .ebpf import KernelError, explain_ebpf
from .semantics import POD, Source, Target, address, explain

# The source of the test packet: a pod address no cluster hands out (RFC 2544's
# benchmarking range, RFC 3849's documentation prefix). The programs treat any source
# on a pod interface as a pod.
SOURCE_IPV4 = "198.18.255.254"
SOURCE_IPV6 = "2001:db8:ffff::fe"
SOURCE_PORT = 40001
RESULTS = ("pass", "fail", "error")


@dataclass(frozen=True, slots=True)
class SelfTest:
    when: float  # Unix time
    frontend: str  # what was asked: "10.96.0.10:80/TCP (default/web:http)"
    passed: bool | None  # None: it could not run (no program attached, no pin)
    detail: str  # the kernel's answer, or what disagreed, or why it could not run

    @property
    def result(self) -> str:
        """kbp_datapath_self_tests_total's label: one of RESULTS."""
        return {True: "pass", False: "fail", None: "error"}[self.passed]

    def to_dict(self) -> dict[str, Any]:
        return {"time": self.when, "frontend": self.frontend, "passed": self.passed,
                "detail": self.detail}  # fmt: skip


def frontends(state: NodeState) -> list[tuple[Any, Any]]:
    """(entry, frontend) the self-test can ask about: TCP and UDP, in the state's order."""
    return [
        (entry, fe)
        for entry in state.services
        if entry.protocol in ("TCP", "UDP")
        for fe in entry.frontends
    ]


def self_test(pin_dir: Path, state: NodeState, turn: int) -> SelfTest | None:
    """Ask about the `turn`-th frontend (modulo their number: successive turns walk
    through them all); None when the state has none to ask about."""
    candidates = frontends(state)
    if not candidates:
        return None
    entry, fe = candidates[turn % len(candidates)]
    what = f"{address(fe.ip, fe.port)}/{entry.protocol} ({entry.namespace}/{entry.name}" + (
        f":{entry.port})" if entry.port else ")"
    )
    source = Source(POD, SOURCE_IPV6 if ":" in fe.ip else SOURCE_IPV4, "the agent's self-test")
    target = Target(fe.ip, fe.port, entry.protocol)
    now = time.time()
    ex = explain(state, source, target)
    try:
        section, _chosen, disagree = explain_ebpf(pin_dir, state, source, target, SOURCE_PORT, ex)
    except (KernelError, OSError) as err:
        return SelfTest(now, what, None, f"could not run: {err}")
    if disagree:
        return SelfTest(now, what, False, "; ".join(disagree))
    return SelfTest(now, what, True, f"{section.get('outcome')}: {section.get('summary')}")
