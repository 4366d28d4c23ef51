"""The iptables half of `explain`: the packet traced through the rules this network
namespace holds (ours: the KBP- chains and the jumps into them), every `statistic` branch
with its probability, compared with the NodeState. Runs in the node's network namespace."""

from __future__ import annotations

from typing import Any

from ..dataplane.iptables import dataplane as iptables
from ..dataplane.iptables.backend import backend_holding_ours
from ..dataplane.iptables.tracer import Trace, live
from ..model.ip import ip_family
from ..model.nodestate import Backend, NodeState
from .semantics import NODE, NOT_A_SERVICE, Explanation, address


def _interface(ip: str) -> str | None:
    """The interface this namespace routes ip through (the packet comes in there)."""
    from ..dataplane.ebpf.netlink import TcAttacher  # pyroute2

    with TcAttacher() as attacher:
        index = attacher.route_index(ip)
        names = {link.index: link.name for link in attacher.links()}
    return names.get(index) if index is not None else None


def explain_iptables(
    state: NodeState, source: Any, target: Any, sport: int | None, ex: Explanation
) -> tuple[dict[str, Any], Backend | None, list[str]]:
    fe = ex.frontend
    dst_ip = fe.ip if fe else target.ip
    dst_port = fe.port if fe else target.port
    family = ip_family(dst_ip)
    disagree: list[str] = []
    rules_in = backend_holding_ours()
    marker = iptables.kernel_marker(family, backend=rules_in) if rules_in else None
    if marker is None:
        disagree.append(
            f"no KBP-STATE marker for {family}: the agent never completed a "
            "restore here, or someone removed its chains"
        )
    elif marker[0] != state.revision:
        disagree.append(
            f"the rules hold revision {marker[0][:19]}…, the NodeState is "
            f"{state.revision[:19]}…: the agent is behind"
        )
    in_interface = None if source.kind == NODE else (_interface(source.ip) or "eth0")
    ruleset = live(family, tuple(a for a in state.node.addresses if ip_family(a) == family),
                   backend=rules_in)  # fmt: skip
    trace = ruleset.trace(
        source.ip, dst_ip, dst_port, ex.protocol.lower(), in_interface=in_interface
    )
    lines = [f"traced from {in_interface or 'the node itself'}: {len(trace.outcomes)} branch(es)"]
    for o in trace.fresh():
        where = o.dnat or "untranslated"
        lines.append(
            f"  p={o.probability:.3f} {o.verdict:<6} {where}"
            f"{' (masqueraded)' if o.masquerade else ''}: {' > '.join(o.path)}"
        )
    outcome, summary = _outcome(trace)
    endpoints = trace.endpoints()
    wanted = {address(b.ip, b.port) for b in ex.backends}
    if outcome == "backends" and ex.outcome == "backends" and set(endpoints) != wanted:
        missing = sorted(wanted - set(endpoints))
        extra = sorted(set(endpoints) - wanted)
        disagree.append(
            f"the rules' endpoints differ from the NodeState's {ex.set_name}: "
            + "; ".join(
                filter(
                    None,
                    [
                        f"missing {', '.join(missing)}" if missing else "",
                        f"extra {', '.join(extra)}" if extra else "",
                    ],
                )
            )
        )
    if outcome != ex.outcome:
        disagree.append(f"the NodeState says {ex.outcome}, the rules give {outcome} ({summary})")
    section: dict[str, Any] = {
        "dataplane": "iptables",
        "summary": summary,
        "outcome": outcome,
        "lines": lines,
        "endpoints": endpoints,
    }
    if outcome != ex.outcome:
        section["verdict"] = f"{outcome} by the rules: {summary}"
    elif outcome == "backends" and len(endpoints) > 1:
        section["note"] = "; the rules pick one at random per connection (statistic)"
    del sport  # iptables' choice does not depend on the source port
    return section, None, disagree


def _outcome(trace: Trace) -> tuple[str, str]:
    fresh = trace.fresh()
    verdicts = {o.verdict for o in fresh}
    if verdicts == {"REJECT"}:
        return "refused", "rejected (TCP RST / ICMP port unreachable)"
    if verdicts == {"DROP"}:
        return "dropped", "dropped by the filter rules"
    if verdicts == {"ACCEPT"} and all(o.dnat is None for o in fresh):
        return NOT_A_SERVICE, "passes untranslated"
    endpoints = trace.endpoints()
    if endpoints and verdicts == {"ACCEPT"}:
        shares = ", ".join(f"{e} ({p:.0%})" for e, p in sorted(endpoints.items()))
        return "backends", f"DNAT to {shares}"
    return "mixed", f"branches disagree: {sorted(verdicts)}"
