"""What a lab client pod, or the client outside the cluster, should see at each frontend of
a NodeState, and whether the answers it got keep that promise (pure).

The set a packet uses is docs/nodestate.md's. From a pod: to a ClusterIP, `localBackends` under
internalTrafficPolicy Local, else `clusterBackends`; to a NodePort, ExternalIP or
LoadBalancer frontend, `clusterBackends`. From outside the cluster (to those external
frontends): `localBackends` under externalTrafficPolicy Local, else `clusterBackends`.
loadBalancerSourceRanges that do not admit the client drop it at a LoadBalancer frontend,
never at a NodePort. An empty set answers like kube-proxy: refused (TCP RST, ICMP port
unreachable) when the Service has no endpoints at all, a silent drop (the client times
out) when endpoints exist elsewhere. Backends the lab has no pod for (other clusters,
unknown nodes) are left out of the promise and listed instead.

For the outside client the promise also says which source address each backend sees:
the client's own under externalTrafficPolicy Local; under Cluster, the entry node's (SNAT)
when the backend is on another node, so that replies come back through it to be
untranslated. For a backend on the entry node under Cluster the dataplanes differ on
purpose: eBPF translates only the destination (the pod sees the client), the iptables
dataplane masquerades all of it as kube-proxy does (the pod sees a node address).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from ..model.nodestate import FRONTEND_KINDS, Backend, Frontend, ServiceEntry, is_external

IPTABLES = "iptables"

CLUSTER_BACKENDS = "clusterBackends"
LOCAL_BACKENDS = "localBackends"

BACKENDS = "backends"  # answers come from the expected pods
REFUSED = "refused"  # every request is refused at once
DROPPED = "dropped"  # every request times out


# The source address a backend sees for an outside client's request.
KEPT = "client"  # the client's own address
SNAT = "node"  # an address of the node the request entered

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


def used_set(entry: ServiceEntry, frontend: Frontend) -> tuple[str, tuple[Backend, ...]]:
    """The backend set a packet from a pod to this frontend uses, and its name."""
    return _named(entry, frontend, from_outside=False)


def used_set_from_outside(
    entry: ServiceEntry, frontend: Frontend
) -> tuple[str, tuple[Backend, ...]]:
    """The backend set a packet from outside the cluster to this frontend uses, and its
    name. A ClusterIP has one set whoever sends (the ClusterIP rule)."""
    return _named(entry, frontend, from_outside=True)


def _named(
    entry: ServiceEntry, frontend: Frontend, from_outside: bool
) -> tuple[str, tuple[Backend, ...]]:
    name = LOCAL_BACKENDS if entry.uses_local(frontend.type, from_outside) else CLUSTER_BACKENDS
    return name, entry.backends_for(frontend.type, from_outside)


def source_seen(entry: ServiceEntry, backend: Backend, dataplane: str) -> str:
    """KEPT or SNAT: the source address backend sees for an outside client's request to
    an external frontend of entry (see the module docstring)."""
    if entry.external_traffic_policy == "Local":
        return KEPT
    if not backend.local or dataplane == IPTABLES:
        return SNAT
    return KEPT


def source_allowed(client_ip: str, frontend: Frontend) -> bool:
    """Whether the frontend's loadBalancerSourceRanges (if any) admit client_ip."""
    if not FRONTEND_KINDS[frontend.type].source_ranges or not frontend.source_ranges:
        return True
    address = ipaddress.ip_address(client_ip)  # never in a network of the other family
    return any(address in ipaddress.ip_network(cidr) for cidr in frontend.source_ranges)


def _without_backends(
    entry: ServiceEntry, frontend: Frontend, client_ip: str, set_name: str, empty: bool
) -> Expectation | None:
    """A drop or refusal that comes before any backend: loadBalancerSourceRanges that
    do not admit client_ip (both dataplanes apply them to pods at the VIP too, as
    kube-proxy: iptables in KBP-FW, eBPF in lb_source_admitted), or an empty set."""
    if not source_allowed(client_ip, frontend):
        return Expectation(
            DROPPED, "loadBalancerSourceRanges", note="source not allowed, as kube-proxy"
        )
    if not empty:
        return None
    if entry.has_endpoints:
        return Expectation(DROPPED, f"{set_name} (empty)", note="endpoints elsewhere")
    return Expectation(REFUSED, f"{set_name} (empty)", note="no endpoints")


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
    set_name, backends = used_set(entry, frontend)
    uses = f"{set_name} (from a pod)" if is_external(frontend.type) else set_name
    refused = _without_backends(entry, frontend, client_ip, set_name, not backends)
    if refused is not None:
        return refused
    pods, excluded = _located(backends, locate)
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
    set_name, backends = used_set_from_outside(entry, frontend)
    refused = _without_backends(entry, frontend, client_ip, set_name, not backends)
    if refused is not None:
        return refused
    pods, excluded = _located(backends, locate)
    return Expectation(
        BACKENDS,
        f"{set_name} (from outside)",
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
