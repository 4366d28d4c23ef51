"""`kube-bpf-proxy inspect nftables`: what the nftables dataplane's tables hold, read with
`nft -j`: per family the marker (revision written, when) and every frontend with where
`service-ips` sends it and what `filter-ips` does with it untranslated. Only the maps and
the marker set are listed (cheap at 10k Services); `nft list table ip kube-bpf-proxy`
shows the chains."""

from __future__ import annotations

import time
from typing import Any

from ..iptables.backend import run_command
from .dataplane import Runner, kernel_marker, list_object
from .render import FAMILIES, FILTER_IPS, NFT_FAMILY, SERVICE_IPS, TABLE


def _verdict(value: Any) -> str:
    """A verdict as nft writes it: `goto svc-…`, `drop`."""
    if isinstance(value, dict) and value:
        kind, body = next(iter(value.items()))
        return f"{kind} {body['target']}" if isinstance(body, dict) else kind
    return str(value)


def _elements(family: str, where: str, netns: str | None, run: Runner) -> dict[tuple, str]:
    found = list_object(netns, run, "map", NFT_FAMILY[family], TABLE, where) or []
    out: dict[tuple, str] = {}
    for item in found:
        for key, value in item.get("map", {}).get("elem", []):
            parts = key.get("concat", []) if isinstance(key, dict) else []
            if len(parts) == 3:
                out[(str(parts[0]), str(parts[1]), int(parts[2]))] = _verdict(value)
    return out


def tables(netns: str | None = None, run: Runner = run_command) -> list[dict[str, Any]]:
    """One row per frontend of each family's table (none: the table is not there)."""
    rows: list[dict[str, Any]] = []
    for family in FAMILIES:
        marker = kernel_marker(family, netns, run)
        dispatch = _elements(family, SERVICE_IPS, netns, run)
        filtering = _elements(family, FILTER_IPS, netns, run)
        for key in sorted({*dispatch, *filtering}):
            rows.append({
                "family": family, "frontend": f"{key[0]}:{key[2]}/{key[1].upper()}",
                "translate": dispatch.get(key, ""), "untranslated": filtering.get(key, ""),
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
        lines.append(f"  {'FRONTEND':<{width}}  {'TRANSLATE':<26}  UNTRANSLATED")
        lines += [f"  {r['frontend']:<{width}}  {r['translate'] or '-':<26}  "
                  f"{r['untranslated'] or '-'}" for r in mine]  # fmt: skip
    return "\n".join(lines) + "\n"
