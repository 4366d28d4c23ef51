"""`kube-bpf-proxy inspect nftables`: what the nftables dataplane's tables hold, read with
`nft -j`: per family the marker (revision written, when) and every frontend with how it
is translated (its pick chain and the endpoints of its slots, ClientIP affinity's timeout;
`outside:` what clients outside the node get where that differs) and what the
filter hooks do with it untranslated (reject, drop). Only the sets and maps are listed,
not the chains; `nft list table ip kube-bpf-proxy` shows everything."""

from __future__ import annotations

import time
from typing import Any

from ..iptables.backend import run_command
from .dataplane import Runner, kernel_marker, list_object
from .render import (
    AFFINITY_CHAINS,
    DROP,
    FAMILIES,
    NFT_FAMILY,
    NO_ENDPOINTS,
    OUTSIDE_AFFINITY_CHAINS,
    PICK_INSIDE,
    PICK_OUTSIDE,
    PROTOCOLS,
    REMEMBER,
    TABLE,
    parse_affinity,
    parse_pick,
    slots_map,
)

Frontend = tuple[str, str, int]


def _frontend(key: Any) -> Frontend | None:
    parts = key.get("concat", []) if isinstance(key, dict) else []
    if len(parts) < 3:
        return None
    return str(parts[0]), str(parts[1]), int(parts[2])


def _address(value: Any) -> str:
    parts = value.get("concat", []) if isinstance(value, dict) else []
    if len(parts) != 2:
        return str(value)
    ip, port = str(parts[0]), int(parts[1])
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _verdict(value: Any) -> str:
    """A verdict as nft writes it: `goto svc-…`."""
    if isinstance(value, dict) and value:
        kind, body = next(iter(value.items()))
        return f"{kind} {body['target']}" if isinstance(body, dict) else kind
    return str(value)


def _listed(family: str, kind: str, where: str, netns: str | None, run: Runner) -> list[Any]:
    found = list_object(netns, run, kind, NFT_FAMILY[family], TABLE, where) or []
    return [e for item in found for e in item.get(kind, {}).get("elem", [])]


def _members(family: str, where: str, netns: str | None, run: Runner) -> list[Frontend]:
    return [f for e in _listed(family, "set", where, netns, run) if (f := _frontend(e))]


def _map(family: str, where: str, netns: str | None, run: Runner) -> dict[Frontend, Any]:
    out = {}
    for key, value in _listed(family, "map", where, netns, run):
        if (frontend := _frontend(key)) is not None:
            out[frontend] = value
    return out


def _slots(family: str, where: str, netns: str | None, run: Runner) -> dict[Frontend, dict]:
    out: dict[Frontend, dict[int, str]] = {}
    for key, value in _listed(family, "map", where, netns, run):
        frontend = _frontend(key)
        if frontend is not None:
            out.setdefault(frontend, {})[int(key["concat"][3])] = _address(value)
    return out


def _picks(family: str, netns: str | None, run: Runner) -> list[str]:
    """The sets the rules of pick-inside, pick-outside and affinity-remember look up:
    the pick chains' and the affinity timeouts'."""
    names = []
    for chain in (PICK_INSIDE, PICK_OUTSIDE, REMEMBER):
        for item in list_object(netns, run, "chain", NFT_FAMILY[family], TABLE, chain) or []:
            for expr in item.get("rule", {}).get("expr", []):
                right = expr.get("match", {}).get("right") if isinstance(expr, dict) else None
                if isinstance(right, str) and right.startswith("@"):
                    name = right[1:]
                    if parse_pick(name) is not None or parse_affinity(name) is not None:
                        names.append(name)
    return list(dict.fromkeys(names))


def tables(netns: str | None = None, run: Runner = run_command) -> list[dict[str, Any]]:
    """One row per frontend of each family's table (none: the table is not there)."""
    rows: list[dict[str, Any]] = []
    for family in FAMILIES:
        marker = kernel_marker(family, netns, run)
        if marker is None and list_object(netns, run, "set", NFT_FAMILY[family], TABLE,
                                          NO_ENDPOINTS) is None:  # fmt: skip
            continue  # no table
        translate: dict[bool, dict[Frontend, str]] = {False: {}, True: {}}
        affinity: dict[Frontend, int] = {}
        for name in _picks(family, netns, run):
            timeout = parse_affinity(name)
            if timeout is not None:
                affinity.update(dict.fromkeys(_members(family, name, netns, run), timeout))
                continue
            outside, _, count = parse_pick(name)  # type: ignore[misc]
            slots: dict[Frontend, dict] = {}
            for proto in PROTOCOLS:
                slots.update(_slots(family, slots_map(name, proto), netns, run))
            for frontend in _members(family, name, netns, run):
                held = slots.get(frontend, {})
                endpoints = ", ".join(held.get(i, "?") for i in range(count))
                translate[outside][frontend] = f"{name}: {endpoints}"
        for outside, where in ((False, AFFINITY_CHAINS), (True, OUTSIDE_AFFINITY_CHAINS)):
            for frontend, value in _map(family, where, netns, run).items():  # IPv6 affinity
                translate[outside][frontend] = f"ClientIP affinity: {_verdict(value)}"
        for frontend, timeout in affinity.items():
            translate[False][frontend] = (f"{translate[False].get(frontend, '')} (ClientIP "
                                          f"affinity {timeout}s)")  # fmt: skip
        untranslated = {f: "reject" for f in _members(family, NO_ENDPOINTS, netns, run)}
        untranslated.update({f: "drop" for f in _members(family, DROP, netns, run)})
        keys = {*translate[False], *translate[True], *untranslated}
        for key in sorted(keys):
            inside, outside = translate[False].get(key, ""), translate[True].get(key)
            text = inside + (f" | outside: {outside}" if outside else "")
            rows.append({
                "family": family, "frontend": f"{key[0]}:{key[2]}/{key[1].upper()}",
                "translate": text, "untranslated": untranslated.get(key, ""),
                "revision": marker[0] if marker else None,
                "written": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(marker[2] / 1e9))
                if marker else None,
            })  # fmt: skip
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return f"no nftables table {TABLE} here\n"
    lines = []
    for family in FAMILIES:
        mine = [r for r in rows if r["family"] == family]
        if not mine:
            continue
        head = mine[0]
        lines.append(f"{NFT_FAMILY[family]} {TABLE}: revision {(head['revision'] or '?')[:19]}… "
                     f"written {head['written'] or '?'}")  # fmt: skip
        width = max(len(r["frontend"]) for r in mine)
        lines.append(f"  {'FRONTEND':<{width}}  {'UNTRANSLATED':<12}  TRANSLATE")
        lines += [f"  {r['frontend']:<{width}}  {r['untranslated'] or '-':<12}  "
                  f"{r['translate'] or '-'}" for r in mine]  # fmt: skip
    return "\n".join(lines) + "\n"
