"""NodeState → `nft -f` input: one table of ours per IP family (`ip kube-bpf-proxy`,
`ip6 kube-bpf-proxy`), in the structure of kube-proxy's nftables mode (KEP-3866).

Pure: no kernel, no subprocess. The dataplane (`dataplane.py`) decides what to write;
this module says what each Service entry contributes and assembles transactions.

Structure of one family's table:

    nat-prerouting, nat-output   base chains (nat, dstnat): jump services
    services                     `daddr . l4proto . dport vmap @service-ips`
    service-ips (map)            one element per frontend whose traffic is translated:
                                   ClusterIP → svc-h (svl-h for internalTrafficPolicy Local)
                                   NodePort/ExternalIP/LoadBalancer → ext-h
                                   LoadBalancer with sourceRanges → fw-h → (allowed) ext-h
    ext-h                        external frontends: Cluster policy marks for masquerade and
                                 goes to svc-h; Local policy sends pods and the node itself
                                 to svc-h (the node masqueraded), everyone else to svl-h
    svc-h, svl-h                 clusterBackends / localBackends: affinity checks (a timeout
                                 set per endpoint, aff-h), then one rule per endpoint that
                                 picks it (numgen for the random split, jhash of the 5-tuple
                                 for the flow hash) and DNATs to it
    masq-non-pod                 ClusterIP traffic that did not come from a pod (by pod CIDR,
                                 else by pod interface) is marked for masquerade
    nat-postrouting              (srcnat) jump masquerading: a DNATed packet whose source is
                                 its new destination (a pod reaching itself: the `hairpin`
                                 set of endpoint pairs) is marked; marked packets have the
                                 mark cleared and are masqueraded
    filter-input, -forward, -output  (filter, ct state new) jump endpoints-check:
                                 `daddr . l4proto . dport vmap @filter-ips`, what nat left
                                 untranslated: `goto reject-chain` when the Service has no
                                 endpoints at all, `drop` when policy leaves none for this
                                 packet or the source range refuses the client
    state (set)                  never matched: two elements whose comments name the NodeState
                                 revision and a digest of everything written with it, rewritten
                                 in every transaction (a restarted agent knows what it holds;
                                 nft lists one set without reading the rest of the table, as
                                 it does not for a chain or a table)

Unlike the iptables rendering there are no per-endpoint chains (hairpin is one set
lookup in postrouting) and no anonymous sets (the kernel names each one by scanning
every set of the table, quadratic at 10k Services): an endpoint is one rule.
Chain names hash the service port's identity (namespace/name:port/protocol), so they are
stable across restarts and unique per table; each carries the readable name as comment.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ...model.nodestate import (
    CLUSTER_IP,
    FRONTEND_KINDS,
    Backend,
    ServiceEntry,
    is_external,
)

IPV4 = "IPv4"
IPV6 = "IPv6"
FAMILIES = (IPV4, IPV6)
TABLE = "kube-bpf-proxy"
NFT_FAMILY = {IPV4: "ip", IPV6: "ip6"}
ADDR_TYPE = {IPV4: "ipv4_addr", IPV6: "ipv6_addr"}

SERVICE_IPS = "service-ips"
FILTER_IPS = "filter-ips"
HAIRPIN = "hairpin"
STATE = "state"
MARK_MASQ = "mark-for-masquerade"
MASQ_NON_POD = "masq-non-pod"
REJECT = "reject-chain"
MARKER_PREFIX = "kube-bpf-proxy holds"
DIGEST_PREFIX = "rules"

# Bit 14, as kube-proxy's default masquerade bit (and the iptables dataplane's).
MASQ_MARK = "0x00004000"
# The flow hash's seed: fixed, so a restarted agent's rules pick the same endpoints.
HASH_SEED = "0x6b627031"


@dataclass(frozen=True, slots=True)
class RenderOptions:
    """What besides the entries shapes one family's table."""

    family: str  # IPv4 | IPv6
    pod_cidrs: tuple[str, ...] = ()  # this family's --cluster-cidr
    # Pod-facing interface names as nft matches them ("veth*"): how pod traffic is told
    # apart when no pod CIDR is configured.
    pod_interface_patterns: tuple[str, ...] = ()


def interface_patterns(globs: Iterable[str]) -> tuple[str, ...]:
    """`--pod-interfaces` globs that nft's `iifname` can match: a trailing `*` or an
    exact name; a glob with other wildcards is left out."""
    patterns = []
    for glob in globs:
        stem = glob[:-1] if glob.endswith("*") else glob
        if any(c in stem for c in '*?[]\\"'):
            continue
        patterns.append(glob)
    return tuple(patterns)


def _hash(identity: str) -> str:
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


def service_port_name(entry: ServiceEntry) -> str:
    base = f"{entry.namespace}/{entry.name}"
    return f"{base}:{entry.port}" if entry.port else base


def _identity(entry: ServiceEntry) -> str:
    return f"{entry.namespace}/{entry.name}:{entry.port}/{entry.protocol}"


def service_chain(kind: str, entry: ServiceEntry) -> str:
    """svc-, svl-, ext- or fw- plus the service port's hash."""
    return f"{kind}-{_hash(_identity(entry))}"


def affinity_set(entry: ServiceEntry, backend: Backend) -> str:
    """An endpoint's affinity set; its timeout is part of the name (a set's timeout is
    fixed when it is made: a new timeout makes a new set)."""
    where = f"{_identity(entry)}/{backend.ip}:{backend.port}/{entry.affinity_timeout}"
    return f"aff-{_hash(where)}"


def element_key(ip: str, protocol: str, port: int) -> str:
    return f"{ip} . {protocol.lower()} . {port}"


@dataclass(frozen=True, slots=True)
class EntryNft:
    """Everything one Service entry contributes to its family's table."""

    dispatch: tuple[tuple[str, str], ...]  # service-ips elements: (key, verdict)
    filter: tuple[tuple[str, str], ...]  # filter-ips elements: (key, verdict)
    chains: dict[str, tuple[str, tuple[str, ...]]] = field(hash=False)  # name → (comment, rules)
    sets: dict[str, int] = field(hash=False)  # affinity set → timeout seconds
    endpoints: tuple[str, ...] = ()  # addresses of every endpoint it DNATs to (hairpin)
    digest: bytes = b""


COMMENT_MAX = 127  # bytes nft keeps of a comment (NFTNL_UDATA_COMMENT_MAXLEN, 128 with NUL)


def _quote(text: str) -> str:
    return '"' + text.replace('"', "'") + '"'


def _comment(text: str) -> str:
    """A comment nft accepts: quoted, at most COMMENT_MAX bytes (a Service's namespace and
    name may each be 63 characters: the end of the text goes)."""
    data = text.replace('"', "'").encode()
    if len(data) > COMMENT_MAX:
        data = data[: COMMENT_MAX - 3].decode(errors="ignore").encode() + b"..."
    return '"' + data.decode() + '"'


def entry_nft(entry: ServiceEntry, options: RenderOptions) -> EntryNft:
    """What one Service entry contributes (its family must be options.family)."""
    family = options.family
    ip = "ip" if family == IPV4 else "ip6"
    name = service_port_name(entry)
    proto = entry.protocol.lower()
    h = _hash(_identity(entry))
    svc, svl, ext, fw = f"svc-{h}", f"svl-{h}", f"ext-{h}", f"fw-{h}"
    cluster = entry.cluster_backends or ()
    local = entry.local_backends or ()
    dispatch: list[tuple[str, str]] = []
    filtering: list[tuple[str, str]] = []
    externals = [f for f in entry.frontends if is_external(f.type)]
    ranged = [f for f in externals if FRONTEND_KINDS[f.type].source_ranges and f.source_ranges]

    for frontend in entry.frontends:
        key = element_key(frontend.ip, proto, frontend.port)
        used = entry.backends_for(frontend.type)  # from outside
        if not is_external(frontend.type):  # one set whoever sends
            if used:
                target = svl if entry.uses_local(frontend.type) else svc
                dispatch.append((key, f"goto {target}"))
        elif cluster or local:  # pods and the node use clusterBackends, outsiders `used`
            dispatch.append((key, f"goto {fw if frontend in ranged else ext}"))
        if not entry.has_endpoints:
            filtering.append((key, f"goto {REJECT}"))
        elif not used or frontend in ranged:
            filtering.append((key, "drop"))

    chains: dict[str, tuple[str, tuple[str, ...]]] = {}
    sets: dict[str, int] = {}
    internal = svl if entry.uses_local(CLUSTER_IP) else svc
    outsiders = tuple(
        f"{ip} daddr {f.ip} th dport {f.port} jump {MASQ_NON_POD}"
        for f in entry.frontends
        if not is_external(f.type) and (options.pod_cidrs or options.pod_interface_patterns)
    )
    if cluster:
        rules = (outsiders if internal == svc else ()) + _balance(entry, cluster, ip, sets)
        chains[svc] = (f"{name} cluster endpoints", rules)
    if local:
        rules = (outsiders if internal == svl else ()) + _balance(entry, local, ip, sets)
        chains[svl] = (f"{name} local endpoints", rules)
    if externals and (cluster or local):
        chains[ext] = (f"{name} external destinations",
                       _external(svc, svl, entry, options, cluster, local, ip))  # fmt: skip
    if ranged and (cluster or local):
        chains[fw] = (f"{name} loadBalancerSourceRanges", tuple(
            f"{ip} daddr {f.ip} {ip} saddr {cidr} goto {ext}"
            for f in ranged
            for cidr in f.source_ranges
        ))  # fmt: skip
    endpoints = tuple(sorted({b.ip for b in (*cluster, *local)}))
    made = EntryNft(tuple(dispatch), tuple(filtering), chains, sets, endpoints)
    return EntryNft(made.dispatch, made.filter, chains, sets, endpoints, _entry_digest(made))


def _target(backend: Backend, family: str) -> str:
    return f"[{backend.ip}]:{backend.port}" if family == IPV6 else f"{backend.ip}:{backend.port}"


def _balance(
    entry: ServiceEntry, backends: Sequence[Backend], ip: str, sets: dict[str, int]
) -> tuple[str, ...]:
    """Affinity checks, then one rule per endpoint: the random split takes 1/(n-i) of
    what reaches rule i; the flow hash takes the packets whose 5-tuple hashes to i."""
    proto = entry.protocol.lower()
    family = entry.ip_family
    rules: list[str] = []
    timeout = entry.affinity_timeout
    remember: dict[Backend, str] = {}
    if timeout is not None:
        for backend in backends:
            aff = affinity_set(entry, backend)
            sets[aff] = timeout
            remember[backend] = f"update @{aff} {{ {ip} saddr }} "
            rules.append(f"{ip} saddr @{aff} {remember[backend]}"
                         f"meta l4proto {proto} dnat to {_target(backend, family)}")  # fmt: skip
    n = len(backends)
    hashed = f"jhash {ip} saddr . th sport . {ip} daddr . th dport mod {n} seed {HASH_SEED}"
    for i, backend in enumerate(backends):
        if i == n - 1:
            pick = ""
        elif entry.lb_algorithm == "random":
            pick = f"numgen random mod {n - i} 0 "
        else:  # hash, and maglev, which nftables cannot express: the flow hash
            pick = f"{hashed} {i} "
        rules.append(f"{pick}{remember.get(backend, '')}"
                     f"meta l4proto {proto} dnat to {_target(backend, family)}")  # fmt: skip
    return tuple(rules)


def _external(
    svc: str,
    svl: str,
    entry: ServiceEntry,
    options: RenderOptions,
    cluster: Sequence[Backend],
    local: Sequence[Backend],
    ip: str,
) -> tuple[str, ...]:
    if entry.external_traffic_policy != "Local":
        return (f"jump {MARK_MASQ}",) + ((f"goto {svc}",) if cluster else ())
    rules: list[str] = []
    if cluster:
        for cidr in options.pod_cidrs:
            rules.append(f"{ip} saddr {cidr} goto {svc}")
        if not options.pod_cidrs:
            for pattern in options.pod_interface_patterns:
                rules.append(f"iifname {_quote(pattern)} goto {svc}")
        rules.append(f"fib saddr type local jump {MARK_MASQ}")
        rules.append(f"fib saddr type local goto {svc}")
    if local:
        rules.append(f"goto {svl}")
    return tuple(rules)


def _entry_digest(made: EntryNft) -> bytes:
    h = hashlib.sha256()
    for key, verdict in made.dispatch:
        h.update(f"d {key} {verdict}\n".encode())
    for key, verdict in made.filter:
        h.update(f"f {key} {verdict}\n".encode())
    for chain, (comment, rules) in made.chains.items():
        h.update(f"c {chain} {comment}\n".encode())
        h.update("\n".join(rules).encode())
        h.update(b"\n")
    for name, timeout in made.sets.items():
        h.update(f"s {name} {timeout}\n".encode())
    h.update(" ".join(made.endpoints).encode())
    return h.digest()


def base_commands(options: RenderOptions) -> list[str]:
    """The fixed part of a family's table, as `nft -f` commands (for a new table)."""
    fam = NFT_FAMILY[options.family]
    ip = "ip" if options.family == IPV4 else "ip6"
    addr = ADDR_TYPE[options.family]
    t = f"{fam} {TABLE}"
    key = f"{addr} . inet_proto . inet_service"
    out = [
        f"add map {t} {SERVICE_IPS} {{ type {key} : verdict ; }}",
        f"add map {t} {FILTER_IPS} {{ type {key} : verdict ; }}",
        f"add set {t} {HAIRPIN} {{ type {addr} . {addr} ; }}",
        f"add set {t} {STATE} {{ type ifname ; }}",
        f"add chain {t} {MARK_MASQ}",
        f"add rule {t} {MARK_MASQ} meta mark set meta mark | {MASQ_MARK}",
        f"add chain {t} {MASQ_NON_POD}",
    ]
    if options.pod_cidrs:
        out += [f"add rule {t} {MASQ_NON_POD} {ip} saddr {c} return" for c in options.pod_cidrs]
    else:
        out += [f"add rule {t} {MASQ_NON_POD} iifname {_quote(p)} return"
                for p in options.pod_interface_patterns]  # fmt: skip
    out += [
        f"add rule {t} {MASQ_NON_POD} jump {MARK_MASQ}",
        f"add chain {t} {REJECT}",
        f"add rule {t} {REJECT} reject",
        f"add chain {t} services",
        f"add rule {t} services {ip} daddr . meta l4proto . th dport vmap @{SERVICE_IPS}",
        f"add chain {t} endpoints-check",
        f"add rule {t} endpoints-check {ip} daddr . meta l4proto . th dport vmap @{FILTER_IPS}",
        f"add chain {t} masquerading",
        # a pod reaching itself through a Service must see the reply come from the
        # Service: its source is masqueraded to the node
        f"add rule {t} masquerading ct status dnat {ip} saddr . {ip} daddr @{HAIRPIN} "
        f"jump {MARK_MASQ}",
        f"add rule {t} masquerading meta mark & {MASQ_MARK} == 0 return",
        # clear the bit so a packet re-entering the stack is not masqueraded twice
        f"add rule {t} masquerading meta mark set meta mark ^ {MASQ_MARK}",
        f"add rule {t} masquerading masquerade fully-random",
    ]
    for chain, hook, priority, rule in BASE_CHAINS:
        out.append(f"add chain {t} {chain} {{ type {'filter' if 'filter' in chain else 'nat'} "
                   f"hook {hook} priority {priority} ; }}")  # fmt: skip
        out.append(f"add rule {t} {chain} {rule}")
    return out


# (chain, hook, priority, its rule): the base chains, hooked where kube-proxy's are.
BASE_CHAINS = (
    ("nat-prerouting", "prerouting", "dstnat", "jump services"),
    ("nat-output", "output", "-100", "jump services"),
    ("nat-postrouting", "postrouting", "srcnat", "jump masquerading"),
    ("filter-input", "input", "filter", "ct state new jump endpoints-check"),
    ("filter-forward", "forward", "filter", "ct state new jump endpoints-check"),
    ("filter-output", "output", "filter", "ct state new jump endpoints-check"),
)


def base_digest(options: RenderOptions) -> bytes:
    return hashlib.sha256("\n".join(base_commands(options)).encode()).digest()


def rules_digest(options: RenderOptions, entry_digests: Iterable[bytes]) -> str:
    """What one family's table holds when written from these entries, as 32 hex digits."""
    h = hashlib.sha256(base_digest(options))
    for digest in entry_digests:
        h.update(digest)
    return h.hexdigest()[:32]


MARKER_ELEMENTS = ("revision", "rules")  # the state set's elements, in this order


def marker_commands(family: str, revision: str, digest: str, written_ns: int) -> list[str]:
    """The state set's two elements (nft comments hold at most 128 bytes: one says the
    revision, the other the digest and when)."""
    t = f"{NFT_FAMILY[family]} {TABLE}"
    first = _comment(f"{MARKER_PREFIX} {revision}")
    second = _comment(f"{DIGEST_PREFIX} {digest} at {written_ns}")
    return [
        f"flush set {t} {STATE}",
        f'add element {t} {STATE} {{ "{MARKER_ELEMENTS[0]}" comment {first}, '
        f'"{MARKER_ELEMENTS[1]}" comment {second} }}',
    ]


def parse_marker(comments: dict[str, str]) -> tuple[str, str, int] | None:
    """(revision, rules digest, written at in Unix ns) from the state set's elements'
    comments (element → comment); None when they are not a marker."""
    if set(comments) != set(MARKER_ELEMENTS):
        return None
    first = comments[MARKER_ELEMENTS[0]].split()
    second = comments[MARKER_ELEMENTS[1]].split()
    if len(first) != 3 or " ".join(first[:2]) != MARKER_PREFIX:
        return None
    if len(second) != 4 or second[0] != DIGEST_PREFIX or second[2] != "at":
        return None
    if not second[3].isdigit():
        return None
    return first[2], second[1], int(second[3])


def chain_commands(
    family: str, name: str, comment: str, rules: Sequence[str], new: bool
) -> list[str]:
    """A chain's commands: created (`new`) or flushed, then its rules."""
    t = f"{NFT_FAMILY[family]} {TABLE}"
    head = (f"add chain {t} {name} {{ comment {_comment(comment)} ; }}" if new
            else f"flush chain {t} {name}")  # fmt: skip
    return [head, *(f"add rule {t} {name} {rule}" for rule in rules)]


def set_command(family: str, name: str, timeout: int) -> str:
    t = f"{NFT_FAMILY[family]} {TABLE}"
    return (f"add set {t} {name} {{ type {ADDR_TYPE[family]} ; flags dynamic,timeout ; "
            f"timeout {timeout}s ; }}")  # fmt: skip


ELEMENTS_PER_LINE = 2000


def element_commands(verb: str, family: str, where: str, items: Sequence[str]) -> list[str]:
    """`add element`/`delete element` lines, in batches (one huge line parses slowly)."""
    t = f"{NFT_FAMILY[family]} {TABLE}"
    return [
        f"{verb} element {t} {where} {{ {', '.join(items[i : i + ELEMENTS_PER_LINE])} }}"
        for i in range(0, len(items), ELEMENTS_PER_LINE)
    ]


def hairpin_element(ip: str) -> str:
    return f"{ip} . {ip}"


def full_table(
    options: RenderOptions, entries: Iterable[EntryNft], marker: Sequence[str] = ()
) -> list[str]:
    """The commands that replace a family's table by one holding `entries` (in document
    order: the first entry claiming a frontend wins, as the first iptables rule would)."""
    fam = NFT_FAMILY[options.family]
    family = options.family
    out = [f"add table {fam} {TABLE}", f"delete table {fam} {TABLE}", f"add table {fam} {TABLE}"]
    out += base_commands(options)
    dispatch: dict[str, str] = {}
    filtering: dict[str, str] = {}
    hairpin: set[str] = set()
    chains: list[str] = []
    for made in entries:
        for name, timeout in made.sets.items():
            out.append(set_command(family, name, timeout))
        for name, (comment, rules) in made.chains.items():
            chains += chain_commands(family, name, comment, rules, new=True)
        for key, verdict in made.dispatch:
            dispatch.setdefault(key, verdict)
        for key, verdict in made.filter:
            filtering.setdefault(key, verdict)
        hairpin.update(made.endpoints)
    out += chains
    out += element_commands("add", family, SERVICE_IPS, [f"{k} : {v}" for k, v in dispatch.items()])
    out += element_commands("add", family, FILTER_IPS, [f"{k} : {v}" for k, v in filtering.items()])
    out += element_commands("add", family, HAIRPIN, [hairpin_element(i) for i in sorted(hairpin)])
    out += marker
    return out


def render(entries: Iterable[ServiceEntry], options: RenderOptions) -> str:
    """The complete `nft -f` input for one family (tests, benchmarks, dry runs)."""
    made = [entry_nft(e, options) for e in entries if e.ip_family == options.family]
    return "\n".join(full_table(options, made)) + "\n"
