"""What a lab client pod, or the client outside the cluster, should see at each frontend of
a NodeState, and whether the answers it got keep that promise (pure).

Which set a packet uses, whether it is refused or dropped and which source address a
backend sees are the model's answer (agent/model/outcome.py); here they become a promise
about lab pods: backends the lab has no pod for (other clusters, unknown nodes) are left
out of the promise and listed instead, and the answers are judged against it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from ..model.nodestate import Backend, Frontend, ServiceEntry, is_external
from ..model.outcome import (
    BACKENDS,
    DROPPED,
    KEPT,
    REFUSED,
    SOURCE_NOT_ALLOWED,
    Outcome,
    outcome,
    source_seen,
)

TIMES = "\N{MULTIPLICATION SIGN}"  # between a pod and its count of answers

# Sets up to this size must be covered: every expected backend answers at least once,
# judged after so many answers that uniform selection misses one by chance with a
# probability below COVERAGE_FALSE_ALARM.
COVERAGE_MAX_SET = 5
COVERAGE_FALSE_ALARM = 1e-6


@dataclass(frozen=True, slots=True)
class Expectation:
    kind: str  # BACKENDS | REFUSED | DROPPED
    uses: str  # the set the packet uses, and why, for the table
    backends: tuple[str, ...] = ()  # pod names (namespace/name) expected to answer
    excluded: tuple[str, ...] = ()  # "ip:port (reason)" of backends the lab cannot reach
    affinity: bool = False  # sessionAffinity ClientIP: one client, one backend
    note: str = ""  # why it refuses or drops; or a remark on the rule
    # (pod name, KEPT | SNAT): the source each backend sees; outside clients only
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def describe(self) -> str:
        if self.kind in (REFUSED, DROPPED):
            return f"{self.kind} ({self.note})" if self.note else self.kind
        if not self.backends:
            return "nothing reachable (timeout)"
        return " ".join(self.backends)


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    note: str = ""


def _without_backends(result: Outcome) -> Expectation | None:
    """The promise of a packet that meets no backend: dropped by loadBalancerSourceRanges,
    or an empty set (refused without endpoints, dropped with endpoints elsewhere)."""
    if result.kind == BACKENDS:
        return None
    if result.reason == SOURCE_NOT_ALLOWED:
        return Expectation(
            DROPPED, "loadBalancerSourceRanges", note="source not allowed, as kube-proxy"
        )
    return Expectation(result.kind, f"{result.set_name} (empty)", note=result.reason)


def _located(
    backends: Sequence[Backend], locate: Callable[[Backend], tuple[str | None, str]]
) -> tuple[dict[str, Backend], list[str]]:
    """The lab pods answering for backends (pod name → its backend), and the backends
    the lab cannot reach, as "ip:port (why)"."""
    pods: dict[str, Backend] = {}
    excluded: list[str] = []
    for backend in backends:
        name, reason = locate(backend)
        if name is None:
            excluded.append(f"{_address(backend.ip, backend.port)} ({reason})")
        else:
            pods[name] = backend
    return pods, excluded


def expect(
    entry: ServiceEntry,
    frontend: Frontend,
    client_ip: str,
    dataplane: str,
    locate: Callable[[Backend], tuple[str | None, str]],
) -> Expectation:
    """What client_ip (a pod) should see at frontend. locate(backend) gives the name of
    the lab pod answering for a backend, or (None, why the lab cannot reach it)."""
    result = outcome(entry, frontend, client_ip)
    name = result.set_name
    uses = f"{name} (from a pod)" if is_external(frontend.type) else name
    refused = _without_backends(result)
    if refused is not None:
        return refused
    pods, excluded = _located(result.backends, locate)
    return Expectation(
        BACKENDS,
        uses,
        tuple(sorted(pods)),
        tuple(excluded),
        affinity=entry.affinity_timeout is not None,
    )


def expect_from_outside(
    entry: ServiceEntry,
    frontend: Frontend,
    client_ip: str,
    dataplane: str,
    locate: Callable[[Backend], tuple[str | None, str]],
) -> Expectation:
    """What client_ip, a host outside the cluster, should see at an external frontend,
    the source address each backend sees included. locate as for `expect`."""
    result = outcome(entry, frontend, client_ip, from_outside=True)
    refused = _without_backends(result)
    if refused is not None:
        return refused
    pods, excluded = _located(result.backends, locate)
    return Expectation(
        BACKENDS,
        f"{result.set_name} (from outside)",
        tuple(sorted(pods)),
        tuple(excluded),
        affinity=entry.affinity_timeout is not None,
        sources=tuple(sorted((name, source_seen(entry, b, dataplane)) for name, b in pods.items())),
    )


def judge_sources(
    expectation: Expectation,
    peers: Mapping[str, Mapping[str, int]],
    client_addresses: Collection[str],
    node_addresses: Collection[str],
) -> Verdict:
    """✔ or ✘ for the source addresses the backends saw (peers: pod → address → answers):
    KEPT wants one of the client's addresses, SNAT one of the entry node's (never the
    client's). Nothing to judge without answers or an expectation of sources."""
    wanted = dict(expectation.sources)
    wrong: list[str] = []
    for pod, seen in sorted(peers.items()):
        rule = wanted.get(pod)
        if rule is None:
            continue  # a stranger: judge() fails it already
        for address in sorted(seen):
            ok = (
                address in client_addresses
                if rule == KEPT
                else address in node_addresses and address not in client_addresses
            )
            if not ok:
                want = "the client's address" if rule == KEPT else "the node's address (SNAT)"
                wrong.append(f"{pod} saw {address}, expected {want}")
    if wrong:
        return Verdict(False, "; ".join(wrong))
    return Verdict(True)


def coverage_sample(backends: int) -> int:
    """Answers after which a backend that never answered is a failure, not bad luck:
    n (1 - 1/n)^answers < COVERAGE_FALSE_ALARM (21 for two backends, 37 for three)."""
    if backends <= 1:
        return 1
    return math.ceil(math.log(backends / COVERAGE_FALSE_ALARM) / -math.log(1 - 1 / backends))


def coverage_required(expectation: Expectation, answered: int) -> bool:
    """Whether every expected backend must have answered: small sets without affinity,
    once enough answers were collected (coverage_sample)."""
    n = len(expectation.backends)
    return (
        expectation.kind == BACKENDS
        and not expectation.affinity
        and 0 < n <= COVERAGE_MAX_SET
        and answered >= coverage_sample(n)
    )


def missing(expectation: Expectation, counts: Mapping[str, int]) -> list[str]:
    """Expected backends that have not answered (yet)."""
    if expectation.kind != BACKENDS or expectation.affinity:
        return []
    return [name for name in expectation.backends if not counts.get(name)]


def judge(
    expectation: Expectation, counts: Mapping[str, int], errors: Mapping[str, int]
) -> Verdict:
    """✔ or ✘ for what one client saw at one frontend, with the reason for a ✘."""
    answered = sum(counts.values())
    failures = {k: v for k, v in errors.items() if v}
    if expectation.kind in (REFUSED, DROPPED):
        wanted = "refused" if expectation.kind == REFUSED else "timeout"
        if answered:
            return Verdict(False, f"expected {wanted}, but {_counts(counts)} answered")
        other = {k: v for k, v in failures.items() if k != wanted}
        if other or not failures:
            return Verdict(False, f"expected {wanted}, got {_counts(failures) or 'nothing'}")
        return Verdict(True)

    strangers = {k: v for k, v in counts.items() if k not in expectation.backends}
    if strangers:
        return Verdict(False, f"answered by {_counts(strangers)}, not in the expected set")
    # Requests routed to backends the lab cannot reach time out; nothing else may fail.
    allowed = {"timeout"} if expectation.excluded else set()
    bad = {k: v for k, v in failures.items() if k not in allowed}
    if bad:
        absent = missing(expectation, counts)
        silent = f"; never answered: {' '.join(absent)}" if absent and counts else ""
        return Verdict(False, f"failed: {_counts(bad)}{silent}")
    if not expectation.backends:
        return Verdict(True)
    if not answered:
        return Verdict(False, "no answer")
    if expectation.affinity and len(counts) > 1:
        return Verdict(False, "sessionAffinity broken: one client reached several backends")
    if coverage_required(expectation, answered):
        absent = missing(expectation, counts)
        if absent:
            return Verdict(False, f"{' '.join(absent)} never answered")
    return Verdict(True)


def _counts(counts: Mapping[str, int]) -> str:
    return " ".join(f"{k}{TIMES}{v}" for k, v in sorted(counts.items()))


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def frontend_text(frontend: Frontend, protocol: str) -> str:
    """`ClusterIP 10.96.0.10:80/TCP`."""
    return f"{frontend.type} {_address(frontend.ip, frontend.port)}/{protocol}"
