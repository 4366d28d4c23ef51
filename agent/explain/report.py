"""The `explain` report: the query, any disagreement between NodeState and kernel (first,
since it is the likeliest bug), the semantics, the kernel's answer and a one-line verdict;
as aligned text or as one JSON document."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .semantics import Explanation, address, conditions, where


@dataclass
class Report:
    query: dict[str, Any]
    state_from: str  # "agent URL" | "manifests"
    revision: str
    semantics: Explanation
    verdict: str
    disagreements: list[str] = field(default_factory=list)
    kernel: dict[str, Any] | None = None  # the dataplane's own answer (kernel.py / iptables)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "query": self.query,
            "nodeState": {"from": self.state_from, "revision": self.revision},
            "disagreements": self.disagreements,
            "semantics": self.semantics.to_dict(),
            "kernel": self.kernel,
            "verdict": self.verdict,
            "notes": self.notes,
        }

    def json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def table(self) -> str:
        lines: list[str] = []
        q = self.query
        sport = f", source port {q['sport']}" if q.get("sport") else ""
        lines.append(f"query:       from {q['from']} ({self.semantics.source.text}"
                     f"{'; ' + self.semantics.source.note if self.semantics.source.note else ''})"
                     f" to {q['to']}{sport} on node {q['node']}")  # fmt: skip
        lines.append(f"nodestate:   {self.state_from}, revision {self.revision[:19]}…")
        for text in self.disagreements:
            lines.append(f"DISAGREES:   {text}")
        lines += _semantics(self.semantics)
        if self.kernel is not None:
            lines += _kernel(self.kernel)
        for text in self.notes:
            lines.append(f"note:        {text}")
        lines.append(f"verdict:     {self.verdict}")
        return "\n".join(lines) + "\n"


def _semantics(ex: Explanation) -> list[str]:
    if ex.frontend is None:
        return [f"frontend:    none ({ex.note})"]
    fe = ex.frontend
    lines = [f"frontend:    {fe.type} {address(fe.ip, fe.port)}/{ex.protocol} of {ex.service}"]
    if ex.set_name:
        lines.append(f"set:         {ex.set_name} ({len(ex.backends)} backend"
                     f"{'s' if len(ex.backends) != 1 else ''})")  # fmt: skip
    lines += [f"  why:       {w}" for w in ex.why]
    for b in ex.backends:
        lines.append(f"  backend:   {address(b.ip, b.port):<24} {conditions(b):<24} {where(b)}")
    for b, reason in ex.left_out:
        lines.append(f"  left out:  {address(b.ip, b.port):<24} {reason}")
    if not ex.left_out_complete:
        lines.append("  left out:  (from the NodeState only: endpoints the compiler dropped "
                     "before it, e.g. by topology, show with --manifests)")  # fmt: skip
    return lines


def _kernel(k: dict[str, Any]) -> list[str]:
    lines = [f"kernel:      {k.get('dataplane', '?')}: {k.get('summary', '')}"]
    for line in k.get("lines", []):
        lines.append(f"  {line}")
    return lines
