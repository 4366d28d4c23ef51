"""The nftables half of `explain`: the packet followed through the table this network
namespace holds (`ip`/`ip6 kube-bpf-proxy`), as the kernel's lookups would: the frontend's
source ranges, masquerade and policy sets, the client's remembered endpoint (ClientIP
affinity), the pick set that holds it (then its slots, and with --sport the slot the flow
hash gives), or, untranslated, the filter sets; compared with the NodeState. Reads only
what it needs (elements by key, the two dispatch chains), never the whole table. Runs in
the node's network namespace."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from ..dataplane.iptables.backend import run_command
from ..dataplane.nftables.dataplane import NFT, kernel_marker
from ..dataplane.nftables.render import (
    AFFINITY_CHAINS,
    AFFINITY_CLIENTS,
    ALLOWED,
    DROP,
    EXT_LOCAL,
    HASH_SEED,
    IPV6,
    MASQ_ALL,
    MASQ_NODE,
    MASQ_NON_POD,
    NFT_FAMILY,
    NO_ENDPOINTS,
    OUTSIDE_AFFINITY_CHAINS,
    PICK_INSIDE,
    PICK_OUTSIDE,
    RANGED,
    TABLE,
    element_key,
    parse_pick,
    slots_map,
)
from ..model.ip import ip_family
from ..model.nodestate import Backend, NodeState
from .semantics import NODE, NOT_A_SERVICE, POD, Explanation, address

_PICK = re.compile(r"@(\S+) goto (\S+)$")
_DNAT = re.compile(r"dnat (?:ip6? )?to (\[[^\]]+\]|[0-9.]+):(\d+)")
# A flow-hash rule of an IPv6 affinity entry's chain as nft lists it: `jhash ip6 saddr . th
# sport . ip6 daddr . th dport mod 3 seed 0x6b627031 0 ...` (the last rule has no condition)
_JHASH = re.compile(r"jhash ip6? saddr \. \S+ sport \. ip6? daddr \. \S+ dport "
                    r"mod (\d+) seed (0x[0-9a-f]+) (\d+) ")  # fmt: skip
U32 = 0xFFFFFFFF


def _nft(*argv: str) -> str | None:
    proc = run_command(None, [NFT, *argv], None)
    return proc.stdout if proc.returncode == 0 else None


def elements(family: str, where: str, keys: list[str]) -> dict[str, str] | None:
    """key → value (a map's) or key (a set's) of the elements of our set or map with these
    keys (an interval set answers with the element holding the key); None when one is
    absent."""
    out = _nft("get", "element", NFT_FAMILY[family], TABLE, where, f"{{ {', '.join(keys)} }}")
    if out is None:
        return None
    match = re.search(r"elements = \{(.*?)\}", out, re.S)
    found: dict[str, str] = {}
    for item in (match.group(1) if match else "").split(","):
        key, _, value = (part.strip() for part in item.strip().partition(" : "))
        if key:
            found[key] = value or key
    return found


def member(family: str, where: str, key: str) -> bool:
    return elements(family, where, [key]) is not None


def element(family: str, where: str, key: str) -> str | None:
    """The value an element of our map holds (`goto svc-…`), None when absent."""
    found = elements(family, where, [key])
    return next(iter(found.values()), None) if found else None


def chain_rules(family: str, chain: str) -> list[str]:
    """A chain's rules as nft prints them (comment line left out)."""
    out = _nft("list", "chain", NFT_FAMILY[family], TABLE, chain) or ""
    body = out.split("{", 2)[-1] if out.count("{") >= 2 else ""
    return [
        line.strip()
        for line in body.splitlines()
        if line.strip() and line.strip() != "}" and not line.strip().startswith("comment ")
    ]


def _rol(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & U32


def jhash(data: bytes, initval: int) -> int:
    """The kernel's jhash() (Bob Jenkins' lookup3 as include/linux/jhash.h has it) of
    data, read as little-endian 32-bit words as on x86 and arm64."""
    a = b = c = (0xDEADBEEF + len(data) + initval) & U32
    rest = data
    while len(rest) > 12:
        a = (a + int.from_bytes(rest[0:4], "little")) & U32
        b = (b + int.from_bytes(rest[4:8], "little")) & U32
        c = (c + int.from_bytes(rest[8:12], "little")) & U32
        a = ((a - c) & U32) ^ _rol(c, 4)
        c = (c + b) & U32
        b = ((b - a) & U32) ^ _rol(a, 6)
        a = (a + c) & U32
        c = ((c - b) & U32) ^ _rol(b, 8)
        b = (b + a) & U32
        a = ((a - c) & U32) ^ _rol(c, 16)
        c = (c + b) & U32
        b = ((b - a) & U32) ^ _rol(a, 19)
        a = (a + c) & U32
        c = ((c - b) & U32) ^ _rol(b, 4)
        b = (b + a) & U32
        rest = rest[12:]
    if not rest:
        return c
    tail = rest + bytes(12 - len(rest))  # the missing bytes add nothing
    a = (a + int.from_bytes(tail[0:4], "little")) & U32
    b = (b + int.from_bytes(tail[4:8], "little")) & U32
    c = (c + int.from_bytes(tail[8:12], "little")) & U32
    for x, y, k in ((2, 1, 14), (0, 2, 11), (1, 0, 25), (2, 1, 16), (0, 2, 4), (1, 0, 14),
                    (2, 1, 24)):  # fmt: skip
        v = [a, b, c]
        v[x] = ((v[x] ^ v[y]) - _rol(v[y], k)) & U32
        a, b, c = v
    return c


def flow_slot(
    src: str, sport: int, dst: str, dport: int, modulus: int, seed: int, source_only: bool = False
) -> int:
    """What `jhash ip saddr . th sport . ip daddr . th dport mod <modulus> seed <seed>`
    (`source_only`: `jhash ip6 saddr . th sport ...`, an IPv6 pick chain's) gives for a
    packet: the concatenation is 4-byte registers (a port in network order, then two zero
    bytes), 16 bytes for IPv4 and 40 for IPv6 (20 source only); the hash is scaled to the
    modulus as reciprocal_scale does."""

    def port(p: int) -> bytes:
        return p.to_bytes(2, "big") + b"\0\0"

    data = ipaddress.ip_address(src).packed + port(sport)
    if not source_only:
        data += ipaddress.ip_address(dst).packed + port(dport)
    return (jhash(data, seed) * modulus) >> 32


def affinity_chain(family: str, chain: str) -> tuple[dict[str, float], list[tuple[str, str]], str]:
    """An IPv6 affinity entry's chain: (endpoints with their shares, its endpoint rules in
    order after the affinity checks: (endpoint, rule), how it picks)."""
    picks: list[tuple[str, str]] = []
    how = "the flow hash (jhash of the 5-tuple)"
    for rule in chain_rules(family, chain):
        dnat = _DNAT.search(rule)
        if dnat is None:
            continue
        if "@aff-" in rule and rule.startswith(("ip saddr @", "ip6 saddr @")):
            continue  # affinity: only a client seen before takes it
        picks.append((address(dnat.group(1).strip("[]"), int(dnat.group(2))), rule))
        if "numgen random" in rule:
            how = "at random (numgen)"
    targets = [endpoint for endpoint, _ in picks]
    return dict.fromkeys(targets, 1.0 / len(targets)) if targets else {}, picks, how


def _slot_endpoint(value: str) -> str:
    ip, _, port = value.rpartition(" . ")
    return address(ip, int(port))


def translate(
    family: str, key: str, source: Any, lines: list[str]
) -> tuple[dict[str, float], bool, str, Any]:
    """(endpoints with their shares, masqueraded, how picked, the pick: (slots in order,
    modulus), an IPv6 affinity chain's endpoint rules, None for a remembered affinity
    client) for a packet from `source` to the
    frontend `key`, following the services chain's rules; a line per step into `lines`."""
    if member(family, RANGED, key) and not member(family, ALLOWED, f"{key} . {source.ip}"):
        lines.append(f"{RANGED} {{ {key} }}: the source is outside its "
                     "loadBalancerSourceRanges: untranslated")  # fmt: skip
        return {}, False, "", None
    masquerade = member(family, MASQ_ALL, key)
    if source.kind != POD:
        masquerade = masquerade or member(family, MASQ_NON_POD, key)
    if source.kind == NODE:
        masquerade = masquerade or member(family, MASQ_NODE, key)
    dispatch = [PICK_INSIDE] if source.kind in (POD, NODE) else [PICK_OUTSIDE, PICK_INSIDE]
    for chain in dispatch:
        outside = chain == PICK_OUTSIDE
        remembered = None
        if family != IPV6:
            remembered = element(family, AFFINITY_CLIENTS, f"{source.ip} . {key}")
        if remembered is not None:  # ClientIP affinity: the client's endpoint until timeout
            endpoint = _slot_endpoint(remembered)
            lines.append(f"  {chain}: {AFFINITY_CLIENTS} {{ {source.ip} . {key} }}: "
                         f"{endpoint}: the client keeps the endpoint it had")  # fmt: skip
            return {endpoint: 1.0}, masquerade, "ClientIP affinity (a remembered client)", None
        verdict = element(family, OUTSIDE_AFFINITY_CHAINS if outside else AFFINITY_CHAINS, key)
        if verdict is not None and verdict.startswith(("goto ", "jump ")):
            target = verdict.split()[1]
            endpoints, rules, how = affinity_chain(family, target)
            done = f": DNAT, picked by {how}" if endpoints else ": no endpoint"
            lines.append(f"  {chain} > {target} (ClientIP affinity){done}")
            return endpoints, masquerade, how, rules
        for rule in chain_rules(family, chain):
            found = _PICK.search(rule)
            parsed = parse_pick(found.group(2)) if found else None
            if found is None or parsed is None or not member(family, found.group(1), key):
                continue
            _, algorithm, count = parsed
            where = slots_map(found.group(2), key.split(" . ")[1])
            keys = [f"{key} . {i}" for i in range(count)]
            slots = elements(family, where, keys) or {}
            ordered = [_slot_endpoint(slots[k]) for k in keys if k in slots]
            how = "the flow hash (jhash of the 5-tuple)" if algorithm == "h" else (
                "at random (numgen)")  # fmt: skip
            lines.append(f"  {chain} > {found.group(2)}: DNAT to {where} {{ {key} . slot }}"
                         f", the slot picked by {how}")  # fmt: skip
            if len(ordered) != count:
                lines.append(f"  {where}: {count - len(ordered)} of {count} slots missing")
            share = 1.0 / len(ordered) if ordered else 0.0
            return dict.fromkeys(ordered, share), masquerade, how, (ordered, count)
        if outside and member(family, EXT_LOCAL, key):
            lines.append(f"  {PICK_OUTSIDE}: {EXT_LOCAL} {{ {key} }}: no local endpoint for "
                         "an outside client: untranslated")  # fmt: skip
            return {}, False, "", None
    return {}, False, "", None


def explain_nftables(
    state: NodeState, source: Any, target: Any, sport: int | None, ex: Explanation
) -> tuple[dict[str, Any], Backend | None, list[str]]:
    fe = ex.frontend
    dst_ip = fe.ip if fe else target.ip
    dst_port = fe.port if fe else target.port
    family = ip_family(dst_ip)
    disagree: list[str] = []
    marker = kernel_marker(family)
    if marker is None:
        disagree.append(f"no state marker in {NFT_FAMILY[family]} {TABLE}: the agent never "
                        "completed a transaction here, or someone removed the table")  # fmt: skip
    elif marker[0] != state.revision:
        disagree.append(f"the table holds revision {marker[0][:19]}…, the NodeState is "
                        f"{state.revision[:19]}…: the agent is behind")  # fmt: skip
    key = element_key(dst_ip, ex.protocol, dst_port)
    who = {POD: "a pod", NODE: "the node"}.get(source.kind, "outside the node")
    lines = [f"frontend {{ {key} }} from {who} ({source.ip})"]
    endpoints, masquerade, how, pick = translate(family, key, source, lines)
    chosen: str | None = None
    if endpoints and sport is not None and "flow hash" in how and isinstance(pick, list):
        chosen, line = _hash_pick(pick, source.ip, sport, dst_ip, dst_port)
        lines.append(line)
    elif endpoints and sport is not None and "flow hash" in how and pick is not None:
        ordered, count = pick  # the slot the packet's flow hash gives (as pick_hash)
        seed = int(HASH_SEED, 16)
        slot = flow_slot(source.ip, sport, dst_ip, dst_port, count, seed, family == IPV6)
        chosen = ordered[slot] if slot < len(ordered) else None
        hashed = "jhash(client address, port)" if family == IPV6 else "jhash(5-tuple)"
        lines.append(f"  source port {sport}: {hashed} mod {count} = {slot}: "
                     f"{chosen or 'no slot'}")  # fmt: skip
    filtered = None
    if not endpoints:
        if member(family, NO_ENDPOINTS, key):
            filtered = "reject"
        elif member(family, DROP, key):
            filtered = "drop"
        lines.append(f"{NO_ENDPOINTS} / {DROP} {{ {key} }}: {filtered or 'neither'}")
    if endpoints:
        outcome = "backends"
        shares = ", ".join(f"{e} ({p:.0%})" for e, p in sorted(endpoints.items()))
        summary = f"DNAT to {shares}" + (" (masqueraded)" if masquerade else "")
    elif filtered == "reject":
        outcome, summary = "refused", "rejected (TCP RST / ICMP port unreachable)"
    elif filtered == "drop":
        outcome, summary = "dropped", "dropped by the filter hook"
    else:
        outcome, summary = NOT_A_SERVICE, "passes untranslated"
    wanted = {address(b.ip, b.port) for b in ex.backends}
    if outcome == "backends" and ex.outcome == "backends" and set(endpoints) != wanted:
        missing, extra = sorted(wanted - set(endpoints)), sorted(set(endpoints) - wanted)
        parts = [f"missing {', '.join(missing)}" if missing else "",
                 f"extra {', '.join(extra)}" if extra else ""]  # fmt: skip
        disagree.append(f"the table's endpoints differ from the NodeState's {ex.set_name}: "
                        + "; ".join(p for p in parts if p))  # fmt: skip
    if outcome != ex.outcome:
        disagree.append(f"the NodeState says {ex.outcome}, the table gives {outcome} ({summary})")
    section: dict[str, Any] = {
        "dataplane": "nftables",
        "summary": summary,
        "outcome": outcome,
        "lines": lines,
        "endpoints": endpoints,
    }
    picked: Backend | None = None
    if outcome != ex.outcome:
        section["verdict"] = f"{outcome} by the table: {summary}"
    elif chosen is not None:
        picked = next((b for b in ex.backends if address(b.ip, b.port) == chosen), None)
        section["chosen"] = chosen
        section["note"] = f"; the flow hash picks it for source port {sport}"
    return section, picked, disagree


def _hash_pick(
    picks: list[tuple[str, str]], src: str, sport: int, dst_ip: str, dst_port: int
) -> tuple[str | None, str]:
    """The endpoint whose rule the packet's flow hash matches (the first rule whose
    `jhash ... mod n seed s i` equals i, else the last, unconditional one), and a line
    saying so; affinity rules came first (a client they remember keeps its endpoint)."""
    for endpoint, rule in picks:
        found = _JHASH.search(rule)
        if found is None:
            return endpoint, f"  source port {sport}: the last rule takes it: {endpoint}"
        modulus, seed, index = int(found.group(1)), int(found.group(2), 16), int(found.group(3))
        slot = flow_slot(src, sport, dst_ip, dst_port, modulus, seed)
        if slot == index:
            return endpoint, (f"  source port {sport}: jhash(5-tuple) mod {modulus} = {slot}: "
                              f"{endpoint}")  # fmt: skip
    return None, f"  source port {sport}: no endpoint rule matches the flow hash"
