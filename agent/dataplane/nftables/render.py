"""NodeState → `nft -f` input: one table of ours per IP family (`ip kube-bpf-proxy`,
`ip6 kube-bpf-proxy`), laid out so that a change of Services or endpoints writes only set
and map elements (issue 36).

Pure: no kernel, no subprocess. The dataplane (`dataplane.py`) decides what to write;
this module says what each Service entry contributes and assembles transactions.

Why elements only: nf_tables validates the whole table at the commit of any transaction
that adds a rule with a validating expression (a verdict, DNAT, a verdict-map lookup) or a
map element that jumps or goes to a chain; with a chain per Service and a verdict element
per frontend that walk grows with the table (≈ 95 ms of kernel time per change at 10k
Services, bench/notes/nftables_sync.md). Data elements (plain sets, maps to addresses)
are not validated. So every per-frontend fact is an element keyed by the frontend
(`daddr . l4proto . dport`, K below), read by a fixed set of rules:

    nat-prerouting, nat-output   base chains (nat, dstnat): jump services
    services                     K @ranged: K . saddr not in @allowed (its
                                   loadBalancerSourceRanges) → return, untranslated
                                 K @masq-all → mark for masquerade (external, policy Cluster)
                                 pods (by pod CIDR, else by pod interface) → pick-inside
                                 K @masq-non-pod → mark (ClusterIPs: whoever is not a pod)
                                 the node (`fib saddr type local`) → from-node
                                 everyone else → pick-outside
    from-node                    K @masq-node → mark (external, policy Local); → pick-inside
    pick-outside                 outsiders of external frontends with policy Local:
                                 K vmap @outside-affinity, K @pick-outside-<a>-<n> → that
                                 pick chain (their localBackends); K @ext-local → return (no
                                 local endpoint: untranslated); else → pick-inside
    pick-inside                  K vmap @affinity, K @pick-<a>-<n> → that pick chain
    pick-<a>-<n>                 one rule per protocol: DNAT to `K . slot` looked up in
    pick-outside-<a>-<n>           @<the pick chain>-<protocol>, the slot `jhash <5-tuple> mod
                                 n` (a = h: the flow hash; Maglev, which nftables cannot
                                 express, uses it too) or `numgen random mod n` (a = r)
    pick-…-tcp, -udp, -sctp      a pick chain's slots: K . slot → endpoint address . port (a
      (maps)                       map per protocol: the port of a DNAT map's data is a
                                   protocol's)
    masquerading (srcnat)        the `hairpin` set of (endpoint . endpoint) pairs marks a pod
                                 reaching itself; marked packets are masqueraded
    filter-input, -forward, -output  (filter, ct state new) jump endpoints-check:
                                 K @no-endpoints → reject (the Service has none);
                                 K @refused → drop (policy leaves none for this packet, or the
                                 source range refused it); what nat translated no longer has
                                 a frontend's address
    state (set)                  never matched: two elements whose comments name the NodeState
                                 revision and a digest of everything written with it

A pick chain exists for each (a, n) some frontend uses: made in the transaction of the
first change that needs it, removed by the one that leaves it unused (with pick-inside or
pick-outside rewritten: their rules are the only ones a change can write, and only then).
Every other change is elements: a frontend's pick-set membership and its n slots, its
policy sets, its filter set.

ClientIP sessionAffinity is the exception: it remembers each client in a timeout set per
endpoint (nft 1.0.6 cannot write a `client → endpoint` map from the packet path), so an
affinity entry keeps chains of its own (svc-h: clusterBackends, svl-h: localBackends),
each checking the sets and then picking by one rule per endpoint, reached by a verdict
element of `affinity`/`outside-affinity`. Those elements and chains are validated at
commit, but only affinity entries have them (a few per cent of Services). Chain names hash
the service port's identity (namespace/name:port/protocol), so they are stable across
restarts and unique per table; each carries the readable name as comment.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ...model.nodestate import (
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

# maps and sets keyed by the frontend
PROTOCOLS = ("tcp", "udp", "sctp")
AFFINITY_CLIENTS = "affinity-clients"
AFFINITY_CHAINS = "affinity-chains"  # IPv6: frontend → goto its entry's chain
OUTSIDE_AFFINITY_CHAINS = "outside-affinity-chains"
AFFINITY_PREFIX = "affinity-"  # affinity-<timeout>: the frontends remembering clients so long
RANGED = "ranged"
ALLOWED = "allowed"
MASQ_ALL = "masq-all"
MASQ_NON_POD = "masq-non-pod"
MASQ_NODE = "masq-node"
EXT_LOCAL = "ext-local"
NO_ENDPOINTS = "no-endpoints"
DROP = "refused"
HAIRPIN = "hairpin"
STATE = "state"
KEY_SETS = (RANGED, MASQ_ALL, MASQ_NON_POD, MASQ_NODE, EXT_LOCAL, NO_ENDPOINTS, DROP)
# chains
MARK_MASQ = "mark-for-masquerade"
PICK_INSIDE = "pick-inside"
PICK_OUTSIDE = "pick-outside"
FROM_NODE = "from-node"
REMEMBER = "affinity-remember"
PICK_PREFIX = "pick-"
OUTSIDE_PICK_PREFIX = "pick-outside-"
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

    @property
    def tells_pods(self) -> bool:
        return bool(self.pod_cidrs or self.pod_interface_patterns)


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
    """svc- or svl- plus the service port's hash (IPv6 affinity entries' chains)."""
    return f"{kind}-{_hash(_identity(entry))}"


def endpoint_affinity_set(entry: ServiceEntry, backend: Backend) -> str:
    """An endpoint's affinity set; its timeout is part of the name (a set's timeout is
    fixed when it is made: a new timeout makes a new set)."""
    where = f"{_identity(entry)}/{backend.ip}:{backend.port}/{entry.affinity_timeout}"
    return f"aff-{_hash(where)}"


def element_key(ip: str, protocol: str, port: int) -> str:
    return f"{ip} . {protocol.lower()} . {port}"


def pick_chain(outside: bool, algorithm: str, count: int) -> str:
    """The pick chain (and the set naming its frontends) for `count` endpoints: h, the flow
    hash; r, at random; outside: outsiders' (of external frontends with policy Local)."""
    return f"{OUTSIDE_PICK_PREFIX if outside else PICK_PREFIX}{algorithm}-{count}"


def parse_pick(name: str) -> tuple[bool, str, int] | None:
    """(outside, algorithm, count) of a pick chain's name; None for another name."""
    outside = name.startswith(OUTSIDE_PICK_PREFIX)
    rest = name[len(OUTSIDE_PICK_PREFIX if outside else PICK_PREFIX) :]
    if not name.startswith(PICK_PREFIX) or name in (PICK_INSIDE, PICK_OUTSIDE):
        return None
    algorithm, _, count = rest.partition("-")
    if algorithm not in ("h", "r") or not count.isdigit():
        return None
    return outside, algorithm, int(count)


def affinity_set(timeout: int) -> str:
    """The set of the frontends whose clients are remembered for `timeout` seconds."""
    return f"{AFFINITY_PREFIX}{timeout}"


def parse_affinity(name: str) -> int | None:
    """The timeout an affinity set's name says; None for another name."""
    rest = name[len(AFFINITY_PREFIX) :] if name.startswith(AFFINITY_PREFIX) else ""
    return int(rest) if rest.isdigit() else None


def _pick_order(name: str) -> tuple[bool, str, int]:
    parsed = parse_pick(name)
    assert parsed is not None, name
    return parsed


def slots_map(pick: str, protocol: str) -> str:
    """The map of a pick chain's endpoint slots for a protocol (`K . slot → address .
    port`), `<pick>-<protocol>`. A map per protocol, as the port in a DNAT map's data needs
    the protocol (`tcp dport`: nft 1.0.6 reads a map typed `th dport` back wrongly); a map
    per pick chain, as the kernel checks every element of a map when a rule comes to use it
    (a new pick chain using a shared map paid for all its elements: 18 ms at 10k)."""
    return f"{pick}-{protocol.lower()}"


def element_to_delete(element: str) -> str:
    """What `delete element` names of an element: a map element's key."""
    return element.split(" : ", 1)[0]


# An element of the table: (set or map, element as nft writes it in `add element`).
Element = tuple[str, str]


@dataclass(frozen=True, slots=True)
class EntryNft:
    """Everything one Service entry contributes to its family's table."""

    # per frontend key (first frontend of the entry with that key): the elements that
    # translate it (pick set, slots, policy and masquerade sets, source ranges), and the
    # elements that refuse it untranslated (no-endpoints or drop)
    nat: tuple[tuple[str, tuple[Element, ...]], ...]
    filter: tuple[tuple[str, tuple[Element, ...]], ...]
    endpoints: tuple[str, ...] = ()  # addresses of every endpoint it DNATs to (hairpin)
    digest: bytes = b""
    # IPv6 ClientIP affinity's own chains (name → (comment, rules)) and timeout sets (name →
    # seconds)
    chains: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict, hash=False)
    sets: dict[str, int] = field(default_factory=dict, hash=False)


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


def _target(backend: Backend) -> str:
    return f"{backend.ip} . {backend.port}"


def _source_ranges(cidrs: Iterable[str], family: str) -> list[str]:
    """A frontend's source ranges as non-overlapping prefixes of its family (an interval
    set refuses overlapping elements)."""
    version = 4 if family == IPV4 else 6
    nets = []
    for cidr in cidrs:
        try:
            net = ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            continue
        if net.version == version:
            nets.append(net)
    return [str(n) for n in ipaddress.collapse_addresses(nets)]  # type: ignore[arg-type]


def _pick(
    key: str, entry: ServiceEntry, backends: Sequence[Backend], outside: bool, local: bool
) -> list[Element]:
    """The elements that send a frontend's packets to one of `backends`: the pick set
    and the slots; for an IPv6 affinity entry the verdict element into its chain."""
    if entry.affinity_timeout is not None and entry.ip_family == IPV6:
        chain = service_chain("svl" if local else "svc", entry)
        return [(OUTSIDE_AFFINITY_CHAINS if outside else AFFINITY_CHAINS,
                 f"{key} : goto {chain}")]  # fmt: skip
    algorithm = "r" if entry.lb_algorithm == "random" else "h"
    pick = pick_chain(outside, algorithm, len(backends))
    slots = slots_map(pick, entry.protocol)
    out: list[Element] = [(pick, key)]
    out += [(slots, f"{key} . {i} : {_target(b)}") for i, b in enumerate(backends)]
    return out


def entry_nft(entry: ServiceEntry, options: RenderOptions) -> EntryNft:
    """What one Service entry contributes (its family must be options.family)."""
    proto = entry.protocol.lower()
    cluster = entry.cluster_backends or ()
    local = entry.local_backends or ()
    nat: dict[str, tuple[Element, ...]] = {}
    filtering: dict[str, tuple[Element, ...]] = {}
    for frontend in entry.frontends:
        key = element_key(frontend.ip, proto, frontend.port)
        if key in nat or key in filtering:
            continue  # the entry's first frontend with this key holds it
        used = entry.backends_for(frontend.type)  # from outside
        ranged = (is_external(frontend.type) and FRONTEND_KINDS[frontend.type].source_ranges
                  and bool(frontend.source_ranges))  # fmt: skip
        elements: list[Element] = []
        if not is_external(frontend.type):  # one set whoever sends
            if used:
                elements += _pick(key, entry, used, False, entry.uses_local(frontend.type))
                if options.tells_pods:
                    elements.append((MASQ_NON_POD, key))
        elif cluster or local:  # pods and the node use clusterBackends, outsiders `used`
            if ranged:
                elements.append((RANGED, key))
                cidrs = _source_ranges(frontend.source_ranges, options.family)
                elements += [(ALLOWED, f"{key} . {cidr}") for cidr in cidrs]
            if entry.external_traffic_policy != "Local":
                if cluster:
                    elements.append((MASQ_ALL, key))
                    elements += _pick(key, entry, cluster, False, False)
            else:
                elements.append((EXT_LOCAL, key))
                if cluster:
                    elements.append((MASQ_NODE, key))
                    elements += _pick(key, entry, cluster, False, False)
                else:
                    elements += _pick(key, entry, local, False, True)
                if local:
                    elements += _pick(key, entry, local, True, True)
        if elements and entry.affinity_timeout is not None and options.family == IPV4:
            elements.append((affinity_set(entry.affinity_timeout), key))
        if elements:
            nat[key] = tuple(elements)
        if not entry.has_endpoints:
            filtering[key] = ((NO_ENDPOINTS, key),)
        elif not used or ranged:
            filtering[key] = ((DROP, key),)

    chains: dict[str, tuple[str, tuple[str, ...]]] = {}
    sets: dict[str, int] = {}
    if entry.affinity_timeout is not None and options.family == IPV6:
        # nft 1.0.6 cannot write an IPv6 `client . frontend → endpoint` map from the packet
        # path (its registers hold 16 bytes of key): a chain per set, as kube-proxy writes
        name = service_port_name(entry)
        if cluster:
            chains[service_chain("svc", entry)] = (
                f"{name} cluster endpoints",
                _balance(entry, cluster, "ip6", sets),
            )
        if local:
            chains[service_chain("svl", entry)] = (
                f"{name} local endpoints",
                _balance(entry, local, "ip6", sets),
            )
    endpoints = tuple(sorted({b.ip for b in (*cluster, *local)}))
    made = EntryNft(tuple(nat.items()), tuple(filtering.items()), endpoints, b"", chains, sets)
    return EntryNft(made.nat, made.filter, endpoints, _entry_digest(made), chains, sets)


def _dnat_target(backend: Backend, family: str) -> str:
    return f"[{backend.ip}]:{backend.port}" if family == IPV6 else f"{backend.ip}:{backend.port}"


def _balance(
    entry: ServiceEntry, backends: Sequence[Backend], ip: str, sets: dict[str, int]
) -> tuple[str, ...]:
    """An IPv6 affinity entry's chain: the affinity checks (a timeout set per endpoint, as
    kube-proxy writes them), then one rule per endpoint: the
    random split takes 1/(n-i) of what reaches rule i; the flow hash takes the packets
    whose 5-tuple hashes to i (as the pick chains' slot)."""
    proto = entry.protocol.lower()
    family = entry.ip_family
    rules: list[str] = []
    timeout = entry.affinity_timeout
    remember: dict[Backend, str] = {}
    for backend in backends:
        aff = endpoint_affinity_set(entry, backend)
        sets[aff] = timeout or 0
        remember[backend] = f"update @{aff} {{ {ip} saddr }} "
        rules.append(f"{ip} saddr @{aff} {remember[backend]}"
                     f"meta l4proto {proto} dnat to {_dnat_target(backend, family)}")  # fmt: skip
    n = len(backends)
    hashed = f"{_flow_hash(ip)} mod {n} seed {HASH_SEED}"
    for i, backend in enumerate(backends):
        if i == n - 1:
            pick = ""
        elif entry.lb_algorithm == "random":
            pick = f"numgen random mod {n - i} 0 "
        else:  # hash, and maglev, which nftables cannot express: the flow hash
            pick = f"{hashed} {i} "
        rules.append(f"{pick}{remember[backend]}"
                     f"meta l4proto {proto} dnat to {_dnat_target(backend, family)}")  # fmt: skip
    return tuple(rules)


def _flow_hash(ip: str) -> str:
    return f"jhash {ip} saddr . th sport . {ip} daddr . th dport"


def pick_hash(family: str) -> str:
    """A pick chain's flow hash: of the 5-tuple for IPv4; of the client's address and port
    for IPv6 (the frontend is the lookup's key already, and nft has registers for 20 bytes
    of hash input beside an IPv6 key: the 40 of the IPv6 5-tuple make nft 1.0.6 abort)."""
    return _flow_hash("ip") if family == IPV4 else "jhash ip6 saddr . th sport"


def _entry_digest(made: EntryNft) -> bytes:
    h = hashlib.sha256()
    for tag, bundles in (("n", made.nat), ("f", made.filter)):
        for key, elements in bundles:
            h.update(f"{tag} {key}\n".encode())
            for where, element in elements:
                h.update(f"  {where} {element}\n".encode())
    for chain, (comment, rules) in made.chains.items():
        h.update(f"c {chain} {comment}\n".encode())
        h.update("\n".join(rules).encode())
        h.update(b"\n")
    for name, timeout in made.sets.items():
        h.update(f"s {name} {timeout}\n".encode())
    h.update(" ".join(made.endpoints).encode())
    return h.digest()


def frontend_expr(family: str) -> str:
    ip = "ip" if family == IPV4 else "ip6"
    return f"{ip} daddr . meta l4proto . th dport"


def base_commands(options: RenderOptions) -> list[str]:
    """The fixed part of a family's table, as `nft -f` commands (for a new table)."""
    fam = NFT_FAMILY[options.family]
    ip = "ip" if options.family == IPV4 else "ip6"
    addr = ADDR_TYPE[options.family]
    t = f"{fam} {TABLE}"
    key = f"{addr} . inet_proto . inet_service"
    k = frontend_expr(options.family)
    out = [
        # client . frontend → the endpoint it was sent to, written from the packet path
        f"add map {t} {AFFINITY_CHAINS} {{ type {key} : verdict ; }}",
        f"add map {t} {OUTSIDE_AFFINITY_CHAINS} {{ type {key} : verdict ; }}",
        *(f"add set {t} {name} {{ type {key} ; }}" for name in KEY_SETS),
        f"add set {t} {ALLOWED} {{ type {key} . {addr} ; flags interval ; }}",
        f"add set {t} {HAIRPIN} {{ type {addr} . {addr} ; }}",
        f"add set {t} {STATE} {{ type ifname ; }}",
        f"add chain {t} {MARK_MASQ}",
        f"add rule {t} {MARK_MASQ} meta mark set meta mark | {MASQ_MARK}",
        f"add chain {t} {REMEMBER}",
        f"add chain {t} {PICK_INSIDE}",
        f"add chain {t} {PICK_OUTSIDE}",
        f"add chain {t} {FROM_NODE}",
        f"add rule {t} {FROM_NODE} {k} @{MASQ_NODE} jump {MARK_MASQ}",
        f"add rule {t} {FROM_NODE} goto {PICK_INSIDE}",
        f"add chain {t} services",
        f"add rule {t} services {k} @{RANGED} {k} . {ip} saddr != @{ALLOWED} return",
        f"add rule {t} services {k} @{MASQ_ALL} jump {MARK_MASQ}",
    ]
    if options.family == IPV4:  # (IPv6: affinity entries' chains)
        # client . frontend → the endpoint it was sent to, written from the packet path
        out.append(f"add map {t} {AFFINITY_CLIENTS} {{ type {addr} . {key} : {addr} . "
                   "inet_service ; flags dynamic,timeout ; size 1048576 ; }")  # fmt: skip
    if options.pod_cidrs:
        out += [f"add rule {t} services {ip} saddr {c} goto {PICK_INSIDE}"
                for c in options.pod_cidrs]  # fmt: skip
    else:
        out += [f"add rule {t} services iifname {_quote(p)} goto {PICK_INSIDE}"
                for p in options.pod_interface_patterns]  # fmt: skip
    out += [
        f"add rule {t} services {k} @{MASQ_NON_POD} jump {MARK_MASQ}",
        f"add rule {t} services fib saddr type local goto {FROM_NODE}",
        f"add rule {t} services goto {PICK_OUTSIDE}",
        f"add chain {t} endpoints-check",
        f"add rule {t} endpoints-check {k} @{NO_ENDPOINTS} reject",
        f"add rule {t} endpoints-check {k} @{DROP} drop",
        f"add chain {t} masquerading",
        f"add rule {t} masquerading jump {REMEMBER}",
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
    # an affinity client's endpoint on this node's own address is reached without postrouting
    ("nat-input", "input", "100", f"jump {REMEMBER}"),
    ("filter-input", "input", "filter", "ct state new jump endpoints-check"),
    ("filter-forward", "forward", "filter", "ct state new jump endpoints-check"),
    ("filter-output", "output", "filter", "ct state new jump endpoints-check"),
)


def pick_commands(family: str, name: str) -> list[str]:
    """A pick chain, the set naming its frontends and its slot maps (for a new one)."""
    parsed = parse_pick(name)
    assert parsed is not None, name
    _, algorithm, count = parsed
    t = f"{NFT_FAMILY[family]} {TABLE}"
    ip = "ip" if family == IPV4 else "ip6"
    slot = (f"{pick_hash(family)} mod {count} seed {HASH_SEED}" if algorithm == "h"
            else f"numgen random mod {count}")  # fmt: skip
    key = f"{ADDR_TYPE[family]} . inet_proto . inet_service"
    return [
        *(
            f"add map {t} {slots_map(name, proto)} {{ typeof {ip} daddr . meta l4proto . "
            f"{proto} dport . numgen random mod 2 : {ip} daddr . {proto} dport ; }}"
            for proto in PROTOCOLS
        ),
        f"add set {t} {name} {{ type {key} ; }}",
        f"add chain {t} {name}",
        *(
            f"add rule {t} {name} meta l4proto {proto} dnat {ip} to {ip} daddr . meta l4proto "
            f". {proto} dport . {slot} map @{slots_map(name, proto)}"
            for proto in PROTOCOLS
        ),
    ]


def dispatch_commands(family: str, picks: Iterable[str], new: bool) -> list[str]:
    """pick-inside's and pick-outside's rules for the pick chains in use (`new`: the
    chains are empty, else they are flushed first)."""
    t = f"{NFT_FAMILY[family]} {TABLE}"
    k = frontend_expr(family)
    ip = "ip" if family == IPV4 else "ip6"
    ordered = sorted((p for p in picks if parse_pick(p) is not None), key=_pick_order)
    out = [] if new else [f"flush chain {t} {PICK_INSIDE}", f"flush chain {t} {PICK_OUTSIDE}"]
    # an affinity client remembered for this frontend goes where it went before
    remembered = [f"meta l4proto {p} dnat {ip} to {ip} saddr . {ip} daddr . meta l4proto . "
                  f"{p} dport map @{AFFINITY_CLIENTS}" for p in PROTOCOLS
                  if family == IPV4]  # fmt: skip
    out += [f"add rule {t} {PICK_OUTSIDE} {r}" for r in remembered]
    out.append(f"add rule {t} {PICK_OUTSIDE} {k} vmap @{OUTSIDE_AFFINITY_CHAINS}")
    out += [f"add rule {t} {PICK_OUTSIDE} {k} @{p} goto {p}"
            for p in ordered if _pick_order(p)[0]]  # fmt: skip
    out += [f"add rule {t} {PICK_OUTSIDE} {k} @{EXT_LOCAL} return",
            f"add rule {t} {PICK_OUTSIDE} goto {PICK_INSIDE}"]  # fmt: skip
    out += [f"add rule {t} {PICK_INSIDE} {r}" for r in remembered]
    out.append(f"add rule {t} {PICK_INSIDE} {k} vmap @{AFFINITY_CHAINS}")
    out += [f"add rule {t} {PICK_INSIDE} {k} @{p} goto {p}"
            for p in ordered if not _pick_order(p)[0]]  # fmt: skip
    return out


def remember_commands(family: str, sets: Iterable[str], new: bool) -> list[str]:
    """affinity-remember's rules for the affinity sets in use (`new`: the chain is empty,
    else it is flushed first): a new connection DNATed to a frontend of affinity-<T> writes
    (client . frontend → endpoint) for T seconds, and so refreshes it. (In postrouting and
    input, where the endpoint is the packet's destination: conntrack has the frontend; nft
    1.0.6 can neither remember per endpoint without a set per endpoint, as kube-proxy does
    (thousands of sets, which every transaction pays for), nor take a constant endpoint in
    a lookup.)"""
    t = f"{NFT_FAMILY[family]} {TABLE}"
    ip = "ip" if family == IPV4 else "ip6"
    timeouts = sorted(v for name in sets if (v := parse_affinity(name)) is not None)
    out = [] if new else [f"flush chain {t} {REMEMBER}"]
    frontend = f"ct original {ip} daddr . meta l4proto . ct original proto-dst"
    for timeout in timeouts:
        out += [f"add rule {t} {REMEMBER} meta l4proto {p} ct status dnat {frontend} "
                f"@{affinity_set(timeout)} update @{AFFINITY_CLIENTS} {{ {ip} saddr . {frontend} "
                f"timeout {timeout}s : {ip} daddr . {p} dport }}" for p in PROTOCOLS]  # fmt: skip
    return out


def dynamic_set_commands(family: str, name: str) -> list[str]:
    """A pick chain with its set, or an affinity set (for a new one)."""
    if parse_pick(name) is not None:
        return pick_commands(family, name)
    key = f"{ADDR_TYPE[family]} . inet_proto . inet_service"
    return [f"add set {NFT_FAMILY[family]} {TABLE} {name} {{ type {key} ; }}"]


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
    if verb == "delete":
        items = [element_to_delete(i) for i in items]
    return [
        f"{verb} element {t} {where} {{ {', '.join(items[i : i + ELEMENTS_PER_LINE])} }}"
        for i in range(0, len(items), ELEMENTS_PER_LINE)
    ]


def grouped(elements: Iterable[Element]) -> dict[str, list[str]]:
    """Elements by set or map, in order."""
    out: dict[str, list[str]] = {}
    for where, element in elements:
        out.setdefault(where, []).append(element)
    return out


def hairpin_element(ip: str) -> str:
    return f"{ip} . {ip}"


def winners(entries: Iterable[EntryNft]) -> tuple[dict[str, tuple[Element, ...]], ...]:
    """(nat, filter): per frontend key the elements of the first entry in document order
    that claims it (as the first iptables rule would)."""
    nat: dict[str, tuple[Element, ...]] = {}
    filtering: dict[str, tuple[Element, ...]] = {}
    for made in entries:
        for key, elements in made.nat:
            nat.setdefault(key, elements)
        for key, elements in made.filter:
            filtering.setdefault(key, elements)
    return nat, filtering


def is_dynamic(name: str) -> bool:
    """Whether a set exists only while a frontend uses it: a pick chain's, an affinity
    timeout's."""
    return parse_pick(name) is not None or parse_affinity(name) is not None


def picks_of(elements: Iterable[Element]) -> set[str]:
    """The pick chains' and affinity timeouts' sets these elements use."""
    return {where for where, _ in elements if is_dynamic(where)}


def full_table(
    options: RenderOptions, entries: Iterable[EntryNft], marker: Sequence[str] = ()
) -> list[str]:
    """The commands that replace a family's table by one holding `entries` (in document
    order: the first entry claiming a frontend wins)."""
    fam = NFT_FAMILY[options.family]
    family = options.family
    entries = list(entries)
    out = [f"add table {fam} {TABLE}", f"delete table {fam} {TABLE}", f"add table {fam} {TABLE}"]
    out += base_commands(options)
    hairpin: set[str] = set()
    chains: list[str] = []
    for made in entries:
        for name, timeout in made.sets.items():
            out.append(set_command(family, name, timeout))
        for name, (comment, rules) in made.chains.items():
            chains += chain_commands(family, name, comment, rules, new=True)
        hairpin.update(made.endpoints)
    nat, filtering = winners(entries)
    elements = [e for bundle in (*nat.values(), *filtering.values()) for e in bundle]
    picks = picks_of(elements)
    for name in sorted(picks):
        out += dynamic_set_commands(family, name)
    out += dispatch_commands(family, picks, new=True)
    out += remember_commands(family, picks, new=True)
    out += chains
    for where, items in grouped(elements).items():
        out += element_commands("add", family, where, items)
    out += element_commands("add", family, HAIRPIN, [hairpin_element(i) for i in sorted(hairpin)])
    out += marker
    return out


def render(entries: Iterable[ServiceEntry], options: RenderOptions) -> str:
    """The complete `nft -f` input for one family (tests, benchmarks, dry runs)."""
    made = [entry_nft(e, options) for e in entries if e.ip_family == options.family]
    return "\n".join(full_table(options, made)) + "\n"
