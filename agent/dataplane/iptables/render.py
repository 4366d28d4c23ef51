"""NodeState → `iptables-restore` input, one per IP family, in kube-proxy's chain structure.

Pure: no kernel, no subprocess. The dataplane (`dataplane.py`) decides what to rewrite;
this module says what each Service entry's rules are and assembles a restore document.

Structure (nat table unless noted; every name starts with `KBP-`):

    PREROUTING, OUTPUT   -j KBP-SERVICES           (jump rules: dataplane.JUMPS)
    KBP-SERVICES         one rule per frontend: -d VIP -p P --dport N
                           ClusterIP → KBP-SVC-h (or KBP-SVL-h for internalTrafficPolicy Local)
                           NodePort/ExternalIP/LoadBalancer → KBP-EXT-h
                           LoadBalancer with sourceRanges → KBP-FW-h → (allowed) KBP-EXT-h
    KBP-EXT-h            external frontends: Cluster policy marks for masquerade and goes
                         to KBP-SVC-h; Local policy sends pods and the node itself to
                         KBP-SVC-h (the node masqueraded) and everyone else to KBP-SVL-h
    KBP-SVC-h, KBP-SVL-h clusterBackends / localBackends: `recent` checks for ClientIP
                         affinity, then `statistic --mode random` over the endpoints
    KBP-SEP-h            one endpoint: hairpin mark, `recent --set`, DNAT
    KBP-MARK-MASQ        sets MASQ_MARK; KBP-POSTROUTING masquerades marked packets
    KBP-MASQ-NON-POD     marks ClusterIP traffic that did not come from a pod (by pod CIDR,
                         else by pod interface), so replies from other nodes return here
    filter KBP-SERVICES  (ctstate NEW, from INPUT/FORWARD/OUTPUT) what nat left untranslated:
                         REJECT when the Service has no endpoints at all, DROP when policy
                         leaves none for this node or the source range refuses the client
    filter KBP-FORWARD   accepts marked and established Service traffic under a DROP policy
    filter KBP-STATE     never jumped to: one rule whose comment names the NodeState revision
                         and a digest of every rule written with it (`marker`), committed
                         last, so a restarted agent knows what the tables hold

A frontend that nat does not translate keeps its Service address, so the filter table can
decide it; translated packets no longer match those rules (kube-proxy's split).
Chain names hash the service port's identity (namespace/name:port/protocol, plus the
endpoint for KBP-SEP), so they are stable across restarts and unique per table.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ...model.nodestate import (
    CLUSTER_IP,
    FRONTEND_KINDS,
    FRONTEND_TYPES,
    Backend,
    Frontend,
    ServiceEntry,
    is_external,
)

IPV4 = "IPv4"
IPV6 = "IPv6"
FAMILIES = (IPV4, IPV6)

PREFIX = "KBP-"
SERVICES = "KBP-SERVICES"
POSTROUTING = "KBP-POSTROUTING"
MARK_MASQ = "KBP-MARK-MASQ"
MASQ_NON_POD = "KBP-MASQ-NON-POD"
FORWARD = "KBP-FORWARD"
NAT_BASE_CHAINS = (SERVICES, MARK_MASQ, MASQ_NON_POD, POSTROUTING)
FILTER_BASE_CHAINS = (SERVICES, FORWARD)
STATE = "KBP-STATE"
MARKER_PREFIX = "kube-bpf-proxy holds"

# Bit 14, as kube-proxy's default --iptables-masquerade-bit: a node that ran kube-proxy
# before keeps meaning the same thing by it.
MASQ_MARK = "0x4000"

_HOST_PREFIX = {IPV4: "/32", IPV6: "/128"}
_FULL_MASK = {IPV4: "255.255.255.255", IPV6: "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff"}


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """What besides the entries shapes the rules of one family."""

    family: str  # IPv4 | IPv6
    pod_cidrs: tuple[str, ...] = ()  # this family's --cluster-cidr
    # Pod-facing interface prefixes in iptables form ("veth+"), used to recognise pod
    # traffic when no pod CIDR is configured (kube-proxy's InterfaceNamePrefix mode).
    pod_interface_patterns: tuple[str, ...] = ()


def interface_patterns(globs: Iterable[str]) -> tuple[str, ...]:
    """`--pod-interfaces` globs that iptables can express: "veth*" → "veth+"; an exact
    name stays; a glob with other wildcards cannot be matched by `-i` and is left out."""
    patterns = []
    for glob in globs:
        stem = glob[:-1] if glob.endswith("*") else glob
        if any(c in stem for c in "*?[]"):
            continue
        patterns.append(stem + "+" if glob.endswith("*") else stem)
    return tuple(patterns)


def _hash(identity: str) -> str:
    digest = hashlib.sha256(identity.encode()).digest()
    return base64.b32encode(digest)[:16].decode()


def service_port_name(entry: ServiceEntry) -> str:
    """How comments name a service port: ns/name:port, or ns/name when unnamed."""
    base = f"{entry.namespace}/{entry.name}"
    return f"{base}:{entry.port}" if entry.port else base


def _identity(entry: ServiceEntry) -> str:
    return f"{entry.namespace}/{entry.name}:{entry.port}/{entry.protocol}"


def service_chain(kind: str, entry: ServiceEntry) -> str:
    """KBP-SVC-, KBP-SVL-, KBP-EXT- or KBP-FW- plus the service port's hash."""
    return f"{PREFIX}{kind}-{_hash(_identity(entry))}"


def endpoint_chain(entry: ServiceEntry, backend: Backend) -> str:
    return f"{PREFIX}SEP-{_hash(f'{_identity(entry)}/{backend.ip}:{backend.port}')}"


@dataclass(frozen=True, slots=True)
class EntryRules:
    """Everything one Service entry contributes to its family's tables."""

    dispatch: tuple[str, ...]  # nat KBP-SERVICES rules
    filter: tuple[str, ...]  # filter KBP-SERVICES rules
    chains: dict[str, tuple[str, ...]] = field(hash=False)  # nat chain → its rules


def _quote(comment: str) -> str:
    return f'"{comment}"'


def _dest(frontend: Frontend, entry: ServiceEntry, family: str) -> str:
    proto = entry.protocol.lower()
    return f"-d {frontend.ip}{_HOST_PREFIX[family]} -p {proto} -m {proto} --dport {frontend.port}"


def _backend_set(entry: ServiceEntry, local: bool) -> tuple[Backend, ...]:
    return (entry.local_backends if local else entry.cluster_backends) or ()


def entry_rules(entry: ServiceEntry, options: RenderOptions) -> EntryRules:
    """The rules of one Service entry (its family must be options.family)."""
    family = options.family
    name = service_port_name(entry)
    svc = service_chain("SVC", entry)
    svl = service_chain("SVL", entry)
    ext = service_chain("EXT", entry)
    fw = service_chain("FW", entry)
    cluster = _backend_set(entry, local=False)
    local = _backend_set(entry, local=True)
    chains: dict[str, tuple[str, ...]] = {}
    dispatch: list[str] = []
    filter_rules: list[str] = []
    externals = [f for f in entry.frontends if is_external(f.type)]
    source_ranged = [
        f for f in externals if FRONTEND_KINDS[f.type].source_ranges and f.source_ranges
    ]

    for frontend in entry.frontends:
        dest = _dest(frontend, entry, family)
        label = _quote(f"{name} {FRONTEND_TYPES[frontend.type]}")
        used = entry.backends_for(frontend.type)  # from outside
        if not is_external(frontend.type):  # one set whoever sends
            if used:
                target = svl if entry.uses_local(frontend.type) else svc
                dispatch.append(f"-A {SERVICES} {dest} -m comment --comment {label} -j {target}")
        elif cluster or local:  # pods and the node use clusterBackends, outsiders `used`
            target = fw if frontend in source_ranged else ext
            dispatch.append(f"-A {SERVICES} {dest} -m comment --comment {label} -j {target}")
        if not entry.has_endpoints:
            reason = _quote(f"{name} has no endpoints")
            filter_rules.append(f"-A {SERVICES} {dest} -m comment --comment {reason} -j REJECT")
        elif not used:
            reason = _quote(f"{name} has no local endpoints")
            filter_rules.append(f"-A {SERVICES} {dest} -m comment --comment {reason} -j DROP")
        elif frontend in source_ranged:
            reason = _quote(f"{name} source not in loadBalancerSourceRanges")
            filter_rules.append(f"-A {SERVICES} {dest} -m comment --comment {reason} -j DROP")

    endpoint_chains: dict[str, tuple[str, ...]] = {}
    # kube-proxy's "masquerade off-cluster traffic to the cluster IP", in the chain the
    # ClusterIP uses; only when pods can be told apart from everything else.
    internal = svl if entry.uses_local(CLUSTER_IP) else svc
    outsiders = tuple(
        f"-A {internal} {_dest(f, entry, family)} "
        f"-m comment --comment {_quote(f'{name} {FRONTEND_TYPES[f.type]}')} -j {MASQ_NON_POD}"
        for f in entry.frontends
        if not is_external(f.type) and (options.pod_cidrs or options.pod_interface_patterns)
    )
    if cluster:
        chains[svc] = (outsiders if internal == svc else ()) + _balance(svc, entry, cluster, name)
        _add_endpoints(endpoint_chains, entry, cluster, name, family)
    if local:
        chains[svl] = (outsiders if internal == svl else ()) + _balance(svl, entry, local, name)
        _add_endpoints(endpoint_chains, entry, local, name, family)
    if externals and (cluster or local):
        chains[ext] = _external(ext, svc, svl, entry, options, cluster, local, name)
    if source_ranged and (cluster or local):
        chains[fw] = tuple(
            f"-A {fw} {_dest(f, entry, family)} -s {cidr} "
            f"-m comment --comment {_quote(f'{name} loadbalancer IP')} -j {ext}"
            for f in source_ranged
            for cidr in f.source_ranges
        )
    chains.update(endpoint_chains)
    return EntryRules(tuple(dispatch), tuple(filter_rules), chains)


def _balance(
    chain: str, entry: ServiceEntry, backends: Sequence[Backend], name: str
) -> tuple[str, ...]:
    """Affinity checks, then a random split: rule i takes 1/(n-i) of what reaches it."""
    comment = f"-m comment --comment {_quote(name)}"
    rules = []
    if entry.affinity_timeout is not None:
        mask = _FULL_MASK[entry.ip_family]
        for backend in backends:
            sep = endpoint_chain(entry, backend)
            rules.append(
                f"-A {chain} {comment} -m recent --name {sep} --mask {mask} --rsource "
                f"--rcheck --seconds {entry.affinity_timeout} --reap -j {sep}"
            )
    n = len(backends)
    for i, backend in enumerate(backends):
        sep = endpoint_chain(entry, backend)
        if i < n - 1:
            split = f"-m statistic --mode random --probability {1.0 / (n - i):0.10f} "
        else:
            split = ""
        rules.append(f"-A {chain} {comment} {split}-j {sep}")
    return tuple(rules)


def _add_endpoints(
    out: dict[str, tuple[str, ...]],
    entry: ServiceEntry,
    backends: Sequence[Backend],
    name: str,
    family: str,
) -> None:
    proto = entry.protocol.lower()
    comment = f"-m comment --comment {_quote(name)}"
    for backend in backends:
        sep = endpoint_chain(entry, backend)
        if sep in out:
            continue
        host = _HOST_PREFIX[family]
        target = (
            f"[{backend.ip}]:{backend.port}" if family == IPV6 else (f"{backend.ip}:{backend.port}")
        )
        affinity = ""
        if entry.affinity_timeout is not None:
            affinity = f"-m recent --name {sep} --mask {_FULL_MASK[family]} --rsource --set "
        out[sep] = (
            # hairpin: a pod reaching itself through the Service must see the reply come
            # from the Service, so its source is masqueraded to the node
            f"-A {sep} -s {backend.ip}{host} {comment} -j {MARK_MASQ}",
            f"-A {sep} -p {proto} {comment} {affinity}-m {proto} -j DNAT --to-destination {target}",
        )


def _external(
    ext: str,
    svc: str,
    svl: str,
    entry: ServiceEntry,
    options: RenderOptions,
    cluster: Sequence[Backend],
    local: Sequence[Backend],
    name: str,
) -> tuple[str, ...]:
    rules: list[str] = []
    if entry.external_traffic_policy != "Local":
        masq = _quote(f"masquerade traffic for {name} external destinations")
        rules.append(f"-A {ext} -m comment --comment {masq} -j {MARK_MASQ}")
        if cluster:
            rules.append(f"-A {ext} -j {svc}")
        return tuple(rules)
    if cluster:
        pods = _quote(f"pod traffic for {name} external destinations")
        for cidr in options.pod_cidrs:
            rules.append(f"-A {ext} -s {cidr} -m comment --comment {pods} -j {svc}")
        if not options.pod_cidrs:
            for pattern in options.pod_interface_patterns:
                rules.append(f"-A {ext} -i {pattern} -m comment --comment {pods} -j {svc}")
        node = _quote(f"masquerade LOCAL traffic for {name} external destinations")
        rules.append(f"-A {ext} -m comment --comment {node} -m addrtype --src-type LOCAL "
                     f"-j {MARK_MASQ}")  # fmt: skip
        node = _quote(f"route LOCAL traffic for {name} external destinations")
        rules.append(f"-A {ext} -m comment --comment {node} -m addrtype --src-type LOCAL "
                     f"-j {svc}")  # fmt: skip
    if local:
        rules.append(f"-A {ext} -j {svl}")
    return tuple(rules)


def base_rules(options: RenderOptions) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(nat, filter) rules of the fixed chains."""
    if options.pod_cidrs:
        pods = tuple(f"-A {MASQ_NON_POD} -s {cidr} -j RETURN" for cidr in options.pod_cidrs)
    else:
        pods = tuple(f"-A {MASQ_NON_POD} -i {p} -j RETURN" for p in options.pod_interface_patterns)
    nat = (
        *pods,
        f"-A {MASQ_NON_POD} -j {MARK_MASQ}",
        f"-A {MARK_MASQ} -j MARK --or-mark {MASQ_MARK}",
        f"-A {POSTROUTING} -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN",
        # clear the bit so a packet re-entering the stack is not masqueraded twice
        f"-A {POSTROUTING} -j MARK --xor-mark {MASQ_MARK}",
        f"-A {POSTROUTING} -m comment --comment {_quote('kube-bpf-proxy service traffic requiring SNAT')} "  # noqa: E501
        "-j MASQUERADE --random-fully",
    )
    filt = (
        f"-A {FORWARD} -m comment --comment {_quote('kube-bpf-proxy forwarding rules')} "
        f"-m mark --mark {MASQ_MARK}/{MASQ_MARK} -j ACCEPT",
        f"-A {FORWARD} -m comment --comment {_quote('kube-bpf-proxy established traffic')} "
        "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    )
    return nat, filt


@dataclass
class Document:
    """One family's restore input and what it does."""

    text: str
    rules: int  # -A lines written
    chains_written: int  # chains declared (created or flushed), base chains included
    chains_deleted: int


def entry_digest(rules: EntryRules) -> bytes:
    """A digest of every rule an entry contributes (what `rules_digest` combines)."""
    h = hashlib.sha256()
    for line in (*rules.dispatch, *rules.filter):
        h.update(line.encode())
        h.update(b"\n")
    for chain, lines in rules.chains.items():
        h.update(chain.encode())
        h.update(b"\n".join(line.encode() for line in lines))
        h.update(b"\n")
    return h.digest()


def rules_digest(options: RenderOptions, entry_digests: Iterable[bytes]) -> str:
    """What one family's tables hold when written from these entries, as 32 hex digits:
    equal digests mean equal rules (the base chains' included)."""
    nat, filt = base_rules(options)
    h = hashlib.sha256("\n".join((*nat, *filt)).encode())
    for digest in entry_digests:
        h.update(digest)
    return h.hexdigest()[:32]


def marker(revision: str, digest: str, written_ns: int) -> str:
    """The comment of the KBP-STATE rule (well under iptables' 256-character limit)."""
    return f"{MARKER_PREFIX} {revision} rules {digest} at {written_ns}"


def parse_marker(comment: str) -> tuple[str, str, int] | None:
    """(revision, rules digest, when written in Unix ns) from a KBP-STATE comment; None
    when it is not one."""
    words = comment.split()
    if (len(words) != 7 or " ".join(words[:2]) != MARKER_PREFIX or words[3] != "rules"
            or words[5] != "at" or not words[6].isdigit()):  # fmt: skip
        return None
    return words[2], words[4], int(words[6])


def assemble(
    options: RenderOptions,
    all_rules: Iterable[EntryRules],
    rewritten: Iterable[EntryRules],
    stale_chains: Iterable[str],
    state_marker: str | None = None,
) -> Document:
    """The restore input (for `--noflush`): the dispatch and filter chains from every
    entry, the nat chains of the `rewritten` entries, and deletes of `stale_chains`.
    `state_marker` (see `marker`) goes into KBP-STATE at the end of the filter table, the
    last table committed, so it is in the kernel only if everything before it is. The
    restore commits table by table, so KBP-STATE is first emptied in a commit of its own:
    an agent killed after the nat commit leaves no marker naming the old rules beside
    new nat rules (the next agent would take them for the old state and write nothing)."""
    nat_base, filter_base = base_rules(options)
    dispatch: list[str] = []
    filtering: list[str] = []
    for rules in all_rules:
        dispatch.extend(rules.dispatch)
        filtering.extend(rules.filter)
    declared: list[str] = list(NAT_BASE_CHAINS)
    body: list[str] = []
    for rules in rewritten:
        for chain, lines in rules.chains.items():
            declared.append(chain)
            body.extend(lines)
    stale = sorted(set(stale_chains))
    lines = ["*filter", f":{STATE} - [0:0]", "COMMIT"] if state_marker is not None else []
    lines.append("*nat")
    # Declared (created, or flushed: stale ones, so they can go) in descending name order:
    # iptables-nft 1.8.9 keeps user chains in a name-sorted list and walks it from the
    # head to insert each new one, so ascending input costs O(chains²): 110k chains at
    # 10k Services x 10 took minutes; descending input makes each insert one step.
    lines.extend(f":{chain} - [0:0]" for chain in sorted({*declared, *stale}, reverse=True))
    lines.extend(nat_base)
    lines.extend(dispatch)
    lines.extend(body)
    lines.extend(f"-X {chain}" for chain in stale)
    lines.append("COMMIT")
    lines.append("*filter")
    lines.extend(f":{chain} - [0:0]" for chain in FILTER_BASE_CHAINS)
    lines.extend(filter_base)
    lines.extend(filtering)
    if state_marker is not None:
        lines.append(f":{STATE} - [0:0]")
        lines.append(f"-A {STATE} -m comment --comment {_quote(state_marker)} -j RETURN")
    lines.append("COMMIT")
    lines.append("")
    rule_count = len(nat_base) + len(dispatch) + len(body) + len(filter_base) + len(filtering)
    extra = 1 if state_marker is not None else 0
    return Document(
        "\n".join(lines),
        rules=rule_count + extra,
        chains_written=len(declared) + len(FILTER_BASE_CHAINS) + extra,
        chains_deleted=len(stale),
    )


def render(entries: Iterable[ServiceEntry], options: RenderOptions) -> str:
    """The complete restore input for one family (golden files, benchmarks, dry runs)."""
    rules = [entry_rules(e, options) for e in entries if e.ip_family == options.family]
    return assemble(options, rules, rules, ()).text
