"""The nftables half of `explain`: the packet followed through the table this network
namespace holds (`ip`/`ip6 kube-bpf-proxy`), as the kernel's lookups would: the frontend's
element in `service-ips`, the chains it leads to (source ranges, traffic policy, the
endpoints each picks) or, untranslated, its element in `filter-ips`; compared with the
NodeState. Reads only what it needs (two elements, a few chains), never the whole table.
Runs in the node's network namespace."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from ..dataplane.iptables.backend import run_command
from ..dataplane.nftables.dataplane import NFT, kernel_marker
from ..dataplane.nftables.render import (
    FILTER_IPS,
    MARK_MASQ,
    MASQ_NON_POD,
    NFT_FAMILY,
    REJECT,
    SERVICE_IPS,
    TABLE,
    element_key,
)
from ..model.ip import ip_family
from ..model.nodestate import Backend, NodeState
from .semantics import NODE, NOT_A_SERVICE, POD, Explanation, address

_DNAT = re.compile(r"dnat (?:ip6? )?to (\[[^\]]+\]|[0-9.]+):(\d+)")
_GOTO = re.compile(r"(?:goto|jump) (\S+)$")
_SADDR = re.compile(r"ip6? saddr (\S+) ")
_DADDR = re.compile(r"ip6? daddr (\S+) ")
_IIFNAME = re.compile(r'iifname "([^"]+)"')
# A flow-hash rule as nft lists it: `jhash ip saddr . th sport . ip daddr . th dport mod 3
# seed 0x6b627031 0 ...` (the last endpoint's rule has no condition)
_JHASH = re.compile(r"jhash ip6? saddr \. \S+ sport \. ip6? daddr \. \S+ dport "
                    r"mod (\d+) seed (0x[0-9a-f]+) (\d+) ")  # fmt: skip
MAX_HOPS = 8
U32 = 0xFFFFFFFF


def _nft(*argv: str) -> str | None:
    proc = run_command(None, [NFT, *argv], None)
    return proc.stdout if proc.returncode == 0 else None


def element(family: str, where: str, key: str) -> str | None:
    """The verdict an element of our map holds (`goto svc-…`, `drop`), None when absent."""
    out = _nft("get", "element", NFT_FAMILY[family], TABLE, where, f"{{ {key} }}")
    if out is None:
        return None
    match = re.search(r"elements = \{ [^:]+ : ([^}]+?)\s*\}", out)
    return match.group(1).strip() if match else None


def chain_rules(family: str, chain: str) -> list[str]:
    """A chain's rules as nft prints them (comment line left out)."""
    out = _nft("list", "chain", NFT_FAMILY[family], TABLE, chain) or ""
    body = out.split("{", 2)[-1] if out.count("{") >= 2 else ""
    return [
        line.strip()
        for line in body.splitlines()
        if line.strip() and line.strip() != "}" and not line.strip().startswith("comment ")
    ]


def _in(ip: str, cidr: str) -> bool:
    try:
        return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr, strict=False)
    except ValueError:
        return False


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


def flow_slot(src: str, sport: int, dst: str, dport: int, modulus: int, seed: int) -> int:
    """What `jhash ip saddr . th sport . ip daddr . th dport mod <modulus> seed <seed>`
    gives for a packet: the concatenation is 4-byte registers (a port in network order,
    then two zero bytes), 16 bytes for IPv4 and 40 for IPv6; the hash is scaled to the
    modulus as reciprocal_scale does."""

    def port(p: int) -> bytes:
        return p.to_bytes(2, "big") + b"\0\0"

    data = ipaddress.ip_address(src).packed + port(sport) + ipaddress.ip_address(dst).packed
    return (jhash(data + port(dport), seed) * modulus) >> 32


def follow(
    family: str, start: str, source: Any, dst_ip: str, picks: list[tuple[str, str]] | None = None
) -> tuple[list[str], dict[str, float], bool, str]:
    """(chains passed, endpoints with their shares, masqueraded, how the last chain
    chose) from `start`, evaluating the rule forms our renderer writes. `picks`, when
    given, receives the last chain's endpoint rules in order: (endpoint, rule)."""
    path: list[str] = []
    masquerade = False
    chain: str | None = start
    while chain is not None and len(path) < MAX_HOPS:
        path.append(chain)
        rules, chain = chain_rules(family, chain), None
        targets: list[str] = []
        if picks is not None:
            picks.clear()
        how = "the flow hash (jhash of the 5-tuple)"
        for rule in rules:
            if (dnat := _DNAT.search(rule)) is not None:
                if (
                    "@aff-" in rule
                    and "update" in rule
                    and rule.startswith(("ip saddr @", "ip6 saddr @"))
                ):
                    continue  # affinity: only a client seen before takes it
                targets.append(address(dnat.group(1).strip("[]"), int(dnat.group(2))))
                if picks is not None:
                    picks.append((targets[-1], rule))
                if "numgen random" in rule:
                    how = "at random (numgen)"
                continue
            goto = _GOTO.search(rule)
            if goto is None:
                continue
            if (saddr := _SADDR.search(rule)) and not _in(source.ip, saddr.group(1)):
                continue
            if (daddr := _DADDR.search(rule)) and daddr.group(1) != dst_ip:
                continue
            if _IIFNAME.search(rule) and source.kind != POD:
                continue
            if "fib saddr type local" in rule and source.kind != NODE:
                continue
            if goto.group(1) == MARK_MASQ:
                masquerade = True
            elif goto.group(1) == MASQ_NON_POD:
                masquerade = masquerade or source.kind != POD
            elif rule.split()[-2] == "goto" or rule.startswith("goto"):
                chain = goto.group(1)
                break
        if targets:
            share = 1.0 / len(targets)
            return path, dict.fromkeys(targets, share), masquerade, how
    return path, {}, masquerade, ""


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
    dispatch = element(family, SERVICE_IPS, key)
    filtered = element(family, FILTER_IPS, key)
    lines = [f"{SERVICE_IPS} {{ {key} }}: {dispatch or 'no element'}"]
    endpoints: dict[str, float] = {}
    masquerade = False
    picks: list[tuple[str, str]] = []
    chosen: str | None = None
    if dispatch is not None and dispatch.startswith("goto "):
        path, endpoints, masquerade, how = follow(family, dispatch.split()[1], source, dst_ip,
                                                  picks)  # fmt: skip
        lines.append(f"  {' > '.join(path)}" + (f": DNAT, picked by {how}" if endpoints else
                                                ": falls through untranslated"))  # fmt: skip
        if endpoints and sport is not None and "flow hash" in how:
            chosen, line = _hash_pick(picks, source.ip, sport, dst_ip, dst_port)
            lines.append(line)
    if not endpoints:
        lines.append(f"{FILTER_IPS} {{ {key} }}: {filtered or 'no element'}")
    if endpoints:
        outcome = "backends"
        shares = ", ".join(f"{e} ({p:.0%})" for e, p in sorted(endpoints.items()))
        summary = f"DNAT to {shares}" + (" (masqueraded)" if masquerade else "")
    elif filtered == f"goto {REJECT}":
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
