"""`kube-bpf-proxy explain`: gathers the NodeState (a running agent's `/state`, or
`compile` of --manifests), explains the query against it, then asks the dataplane on this
node (the pinned eBPF maps and programs, or the live iptables rules) for its own answer."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..dataplane.base import DataplaneError
from ..model.compile import CompileOptions, compile, endpoint_candidates, node_label
from ..model.nodestate import NodeState, node_state_from_dict
from ..model.types import ClusterState
from ..sources.manifests import load_manifests
from .report import Report
from .semantics import (
    Candidates,
    Explanation,
    QueryError,
    Source,
    Target,
    explain,
    find_frontend,
    parse_source,
    parse_target,
    verdict,
)

# What a kernel reader returns: its section of the report, the backend it saw chosen (or
# None), and disagreements with the NodeState.
KernelAnswer = tuple[dict[str, Any], Any, list[str]]
KernelReader = Callable[[NodeState, "Query", Explanation, str | None], KernelAnswer | None]


@dataclass(frozen=True)
class Query:
    source: Source
    target: Target
    sport: int | None
    text_from: str
    text_to: str


@dataclass
class Inputs:
    state: NodeState
    state_from: str
    held_revision: str | None  # what the agent says its dataplane holds
    dataplane: str | None  # the agent's dataplane, when an agent answered
    cluster: ClusterState | None  # with --manifests: every endpoint the compiler saw
    options: CompileOptions | None


def state_from_agent(url: str, timeout: float = 5.0) -> Inputs:
    """The agent's `/state` at url (its --metrics-bind-address)."""
    base = url.rstrip("/")
    if not base.startswith("http"):
        base = "http://" + base
    try:
        with urllib.request.urlopen(f"{base}/state?output=json", timeout=timeout) as answer:
            doc = json.load(answer)
    except urllib.error.HTTPError as err:
        raise QueryError(f"{base}/state answered {err.code}: {err.read()[:200]!r}") from None
    except (OSError, ValueError) as err:
        raise QueryError(f"no agent state at {base}/state ({err}); is `kube-bpf-proxy run` "
                         "serving there (--metrics-bind-address), or pass --manifests?"
                         ) from None  # fmt: skip
    status = doc.get("status") or {}
    return Inputs(node_state_from_dict(doc), f"agent {base}", doc.get("heldRevision"),
                  status.get("dataplane"), None, None)  # fmt: skip


def state_from_manifests(paths: list[str], node: str, options: CompileOptions) -> Inputs:
    cluster, _reports = load_manifests(paths)
    state = compile(cluster, node, options)
    return Inputs(state, "compiled from --manifests", None, None, cluster, options)


def run_explain(
    inputs: Inputs, text_from: str, text_to: str, sport: int | None,
    kernel: KernelReader | None = None,
) -> Report:  # fmt: skip
    """The whole report; `kernel` reads the dataplane (None: semantics only)."""
    state = inputs.state
    source = parse_source(text_from, state)
    target = parse_target(text_to)
    query = Query(source, target, sport, text_from, text_to)
    candidates, labels = _candidates(inputs, source, target)
    ex = explain(state, source, target, candidates, labels)
    disagreements: list[str] = []
    if inputs.held_revision is not None and inputs.held_revision != state.revision:
        disagreements.append(
            f"the agent is behind: its dataplane holds revision {inputs.held_revision[:19]}…, "
            f"the NodeState is {state.revision[:19]}… (see /state status.lastError)"
        )
    section, chosen, kernel_disagreements = None, None, []
    answer = kernel(state, query, ex, inputs.dataplane) if kernel else None
    if answer is not None:
        section, chosen, kernel_disagreements = answer
    disagreements += kernel_disagreements
    line = verdict(ex, chosen, section.get("note", "") if section else "")
    if section is not None and section.get("verdict"):
        line = section["verdict"]
    if disagreements:
        line += " [NodeState and kernel disagree: see above]"
    return Report(
        {"from": text_from, "to": text_to, "sport": sport, "node": state.node.name},
        inputs.state_from, state.revision, ex, line, disagreements, section,
    )  # fmt: skip


def _candidates(
    inputs: Inputs, source: Source, target: Target
) -> tuple[Candidates | None, Callable[[str | None, str], str | None] | None]:
    if inputs.cluster is None or inputs.options is None:
        return None, None
    try:
        found = _entry_for(inputs.state, source, target)
    except QueryError:
        return None, None
    if found is None:
        return None, None
    cluster, state = inputs.cluster, inputs.state
    by_port = endpoint_candidates(cluster, state.node.name, inputs.options,
                                  (found.namespace, found.name), found.ip_family)  # fmt: skip
    return (
        by_port.get((found.port, found.protocol), []),
        lambda other, key: node_label(cluster, state.node, other, key),
    )


def _entry_for(state: NodeState, source: Source, target: Target) -> Any:
    found = find_frontend(state, target, source)
    return None if found is None else found[0]


def kernel_reader(pin_dir: Path) -> KernelReader:
    """The reader of this node's dataplane: the one the agent names, else eBPF when its
    pins are under pin_dir, else iptables when its chains exist."""

    def read(
        state: NodeState, query: Query, ex: Explanation, dataplane: str | None
    ) -> KernelAnswer | None:
        chosen = dataplane or _installed(pin_dir)
        try:
            if chosen == "ebpf":
                from .ebpf import explain_ebpf

                return explain_ebpf(pin_dir, state, query.source, query.target, query.sport, ex)
            if chosen == "nftables":
                from .nftables import explain_nftables

                return explain_nftables(state, query.source, query.target, query.sport, ex)
            if chosen == "iptables":
                from .iptables import explain_iptables

                return explain_iptables(state, query.source, query.target, query.sport, ex)
        except (OSError, ValueError, RuntimeError, DataplaneError) as err:
            return {"dataplane": chosen, "summary": f"could not be read: {err}"}, None, []
        reason = "the agent programs nothing (--dataplane none)" if chosen == "none" else \
            f"no eBPF pins under {pin_dir}, nor a table or chains of ours found"  # fmt: skip
        return {"dataplane": chosen or "none", "summary": reason}, None, []

    return read


def _installed(pin_dir: Path) -> str | None:
    from ..dataplane.ebpf.abi import versioned

    if (pin_dir / versioned("kbp_services")).exists():
        return "ebpf"
    from ..dataplane.nftables.dataplane import kernel_marker

    if any(kernel_marker(family) is not None for family in ("IPv4", "IPv6")):
        return "nftables"
    from ..dataplane.iptables.backend import backend_holding_ours

    return "iptables" if backend_holding_ours() is not None else None
