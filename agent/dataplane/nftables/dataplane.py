"""`--dataplane nftables`: the NodeState applied as `nft -f` transactions, one table of ours
per family (`ip kube-bpf-proxy`, `ip6 kube-bpf-proxy`; see render.py for its structure).

Every apply is one transaction for both families: the kernel switches from the old rules
to the new ones at once, or refuses all of it. The first apply (and a rewrite after an
error or a table found changed) replaces each table whole: `delete table` and the new
content in the same transaction. After that a sync writes only what changed: the set and
map elements of the changed entries' frontends and the hairpin set's elements of
endpoints that came or went; besides, a pick chain (or an affinity timeout's set) when the
first frontend using it comes or the last goes. Nothing of it grows with the number of
Services that did not change, and no element of it makes the kernel validate the table
(render.py says why that matters). After the transaction, the clients the packet path
remembered for ClientIP affinity are forgotten where their endpoint left (read back from
the `affinity-clients` map: only then, and only that map).

Every transaction ends with the family's marker (the `state` set's comments): the
revision written and a digest of everything in the table. A restarted agent reports the
marker's revision as held until it applies, and its first apply writes nothing when the
state it would write has the digest the kernel's marker names. A periodic full sync
(`full`) reads the markers back: a table someone deleted or rewrote is written again.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ...model.ip import ip_family
from ...model.nodestate import Changes, NodeState, ServiceEntry
from ..base import DataplaneError, QuietDataplane
from ..iptables.backend import run_command
from ..options import DEFAULT_POD_INTERFACES
from .libnft import LibNftRunner
from .libnft import available as libnft_available
from .render import (
    AFFINITY_CLIENTS,
    FAMILIES,
    HAIRPIN,
    IPV6,
    NFT_FAMILY,
    PICK_PREFIX,
    PROTOCOLS,
    STATE,
    TABLE,
    Element,
    EntryNft,
    RenderOptions,
    base_digest,
    chain_commands,
    dispatch_commands,
    dynamic_set_commands,
    element_commands,
    entry_nft,
    full_table,
    grouped,
    hairpin_element,
    interface_patterns,
    is_dynamic,
    marker_commands,
    parse_affinity,
    parse_marker,
    parse_pick,
    remember_commands,
    set_command,
    slots_map,
)

log = logging.getLogger(__name__)

NFT = "nft"
Runner = Callable[[str | None, Sequence[str], str | None], subprocess.CompletedProcess[str]]


def _digest_value(digest: bytes) -> int:
    return int.from_bytes(digest, "big")


def family_digest(base: bytes, total: int) -> str:
    """What one family's table holds, as 32 hex digits, from the base chains' digest and
    the sum (mod 2^256) of its entries' digests: independent of the entries' order, so a
    partial sync keeps it up to date by adding the new digest and taking off the old."""
    import hashlib

    h = hashlib.sha256(base)
    h.update((total % (1 << 256)).to_bytes(32, "big"))
    return h.hexdigest()[:32]


def unavailable_reason(netns: str | None = None, run: Runner = run_command) -> str | None:
    """Why this dataplane cannot work here (None: it can): no `nft`, or a kernel without
    nf_tables or its nat support. Checked with `nft -c`, which the kernel validates and
    then aborts: nothing is created."""
    if shutil.which(NFT) is None:
        return "nft not found (install the nftables package)"
    probe = (f"add table ip {TABLE}-probe\n"
             f"add chain ip {TABLE}-probe p {{ type nat hook prerouting priority dstnat ; }}\n"
             f"add rule ip {TABLE}-probe p numgen random mod 2 0 meta l4proto tcp "
             "dnat to 127.0.0.1:1\n")  # fmt: skip
    try:
        proc = run(netns, [NFT, "-c", "-f", "-"], probe)
    except (OSError, subprocess.SubprocessError) as err:
        return f"nft: {err}"
    if proc.returncode != 0:
        message = " ".join((proc.stderr or proc.stdout).split())
        return f"the kernel refuses an nftables nat table: {message}"
    return None


def list_object(netns: str | None, run: Runner, *what: str) -> list[dict] | None:
    """`nft -j list ...` as its list of objects; None when nft says it does not exist."""
    proc = run(netns, [NFT, "-j", "list", *what], None)
    if proc.returncode != 0:
        return None
    try:
        return json.loads(proc.stdout)["nftables"]
    except (ValueError, KeyError) as err:
        raise DataplaneError("nft", f"nft -j list {' '.join(what)}: {err}") from err


def kernel_marker(
    family: str, netns: str | None = None, run: Runner = run_command
) -> tuple[str, str, int] | None:
    """(revision, digest, written at in Unix ns) of the marker in a family's table; None
    when there is no table or no marker."""
    found = list_object(netns, run, "set", NFT_FAMILY[family], TABLE, STATE)
    if found is None:
        return None
    comments: dict[str, str] = {}
    for item in found:
        for element in item.get("set", {}).get("elem", []):
            inner = element.get("elem", {}) if isinstance(element, dict) else {}
            if isinstance(inner.get("val"), str):
                comments[inner["val"]] = inner.get("comment", "")
    return parse_marker(comments)


def cleanup(netns: str | None = None, run: Runner = run_command) -> list[str]:
    """Delete our tables in this namespace; return which went. Safe when nothing is
    installed or nft is absent (nothing of ours can be there then). Each table is deleted
    by name: `nft list tables` reads every rule of every table first (seconds at 10k
    Services), a delete of a table that is not there only fails."""
    if shutil.which(NFT) is None:
        return []
    removed = []
    for family in FAMILIES:
        table = f"{NFT_FAMILY[family]} {TABLE}"
        proc = run(netns, [NFT, "delete", "table", *table.split()], None)
        message = proc.stderr or proc.stdout
        if proc.returncode == 0:
            removed.append(f"table {table}")
        elif "No such file or directory" in message or "not supported" in message:
            continue  # not there, or a kernel without nf_tables: nothing of ours can be
        else:
            raise DataplaneError("nft", f"nft delete table {table}: "
                                 f"{(proc.stderr or proc.stdout).strip()}")  # fmt: skip
    return removed


@dataclass
class _Held:
    """What one family's table holds, as far as this process wrote it."""

    options: RenderOptions
    entries: dict[tuple[str, ...], ServiceEntry]
    made: dict[tuple[str, ...], EntryNft]
    # frontend key → {entry sort key: its elements}: every entry that claims the frontend
    # (translating it, or refusing it untranslated); the first in document order (the
    # least sort key) holds it
    nat: dict[str, dict[tuple[str, ...], tuple[Element, ...]]] = field(default_factory=dict)
    filter: dict[str, dict[tuple[str, ...], tuple[Element, ...]]] = field(default_factory=dict)
    # pick chain's or affinity timeout's set → frontends using it
    picks: dict[str, int] = field(default_factory=dict)
    hairpin: dict[str, int] = field(default_factory=dict)  # endpoint → entries using it
    total: int = 0  # sum of the entries' digests
    digest: str = ""  # the marker's digest of this content


def _held_from(options: RenderOptions, entries: dict, made: dict) -> _Held:
    held = _Held(options, entries, made)
    for key, m in made.items():
        _claim(held, key, m, +1)
    for owners in held.nat.values():
        for where, _ in _winner(owners) or ():
            if is_dynamic(where):
                held.picks[where] = held.picks.get(where, 0) + 1
    held.digest = family_digest(base_digest(options), held.total)
    return held


def _claim(held: _Held, key: tuple[str, ...], made: EntryNft, sign: int) -> None:
    """Add (+1) or take off (-1) an entry's claims, hairpin uses and digest."""
    for claims, bundles in ((held.nat, made.nat), (held.filter, made.filter)):
        for frontend, elements in bundles:
            if sign > 0:
                claims.setdefault(frontend, {})[key] = elements
            else:
                owners = claims[frontend]
                del owners[key]
                if not owners:
                    del claims[frontend]
    for ip in made.endpoints:
        count = held.hairpin.get(ip, 0) + sign
        if count:
            held.hairpin[ip] = count
        else:
            del held.hairpin[ip]
    held.total += sign * _digest_value(made.digest)


def _winner(owners: dict[tuple[str, ...], tuple[Element, ...]] | None
            ) -> tuple[Element, ...] | None:  # fmt: skip
    return None if not owners else owners[min(owners)]


class _ByFamily(dict[str, list[ServiceEntry]]):
    """Entries by IP family, sorted out when first asked for: a partial sync does not go
    through every entry of the state (at 10k Services, a millisecond per pass)."""

    def __init__(self, entries: Sequence[ServiceEntry]) -> None:
        super().__init__()
        self.entries = entries

    def __missing__(self, family: str) -> list[ServiceEntry]:
        for f in FAMILIES:
            self[f] = []
        for entry in self.entries:
            self[entry.ip_family].append(entry)
        return self[family]


class NftablesDataplane(QuietDataplane):
    name = "nftables"

    def __init__(
        self,
        pod_interfaces: Sequence[str] = DEFAULT_POD_INTERFACES,
        *,
        netns: str | None = None,
        run: Runner | None = None,
    ) -> None:
        """`run`: how nft (and the conntrack tool) run; by default nft's commands go
        through libnftables in-process (libnft.py), the command where it cannot load."""
        self.netns = netns
        self._libnft: LibNftRunner | None = None
        if run is None:
            if (why := libnft_available()) is None:
                run = self._libnft = LibNftRunner(run_command, NFT)
            else:
                log.info("nftables: libnftables not loaded (%s): each transaction runs nft", why)
                run = run_command
        self._run = run
        self._patterns = interface_patterns(pod_interfaces)
        self._held: dict[str, _Held] = {}
        self._revision: str | None = None
        self._services: tuple[ServiceEntry, ...] = ()
        self._needs_full = True
        self._conntrack = shutil.which("conntrack")
        self.last_writes = 0  # of the last apply (benchmarks, tests)
        self._found: dict[str, tuple[str, str, int]] = {}
        # per family: (frontend, endpoint or None: all) whose remembered affinity clients
        # go after the transaction
        self._forget: dict[str, list[tuple[str, str | None]]] = {}
        for family in FAMILIES:
            found = kernel_marker(family, netns, run)
            if found is not None:
                self._found[family] = found
        # Held: the newest marker's revision, but only when both families have one (a
        # family unchanged by later applies keeps an older marker that still describes it).
        if len(self._found) == len(FAMILIES):
            self._revision = max(self._found.values(), key=lambda f: f[2])[0]

    @property
    def held_revision(self) -> str | None:
        return self._revision

    def status_details(self) -> dict[str, object]:
        """/state's status.nftables: the tables the rules are in."""
        return {"nftables": {"tables": [f"{NFT_FAMILY[f]} {TABLE}" for f in FAMILIES]}}

    def cleanup(self) -> None:
        cleanup(self.netns, self._run)
        self._held.clear()
        self._revision = None
        self._needs_full = True

    def close(self) -> None:
        """The table stays; libnftables' socket closes."""
        if self._libnft is not None:
            self._libnft.close()

    def _options(self, state: NodeState, family: str) -> RenderOptions:
        cidrs = tuple(c for c in state.node.cluster_cidrs if ip_family(c.split("/")[0]) == family)
        return RenderOptions(family, cidrs, self._patterns)

    def apply(self, state: NodeState, full: bool = False) -> int:
        by_family = _ByFamily(state.services)  # (a partial sync reads only its delta)
        rendered: dict[str, _Held] | None = None
        if self._found:
            found, self._found = self._found, {}  # adopted once, at the first apply
            rendered = self._render(state, by_family)
            if all(found.get(f, ("", "", 0))[1] == h.digest for f, h in rendered.items()):
                self._held = rendered
                self._needs_full = False
                self._revision, self._services = state.revision, state.services
                self.last_writes = 0
                log.info("nftables: the tables already hold revision %s (written by an earlier "
                         "agent): nothing to write", state.revision[:19])  # fmt: skip
                return 0
        rewrite = self._needs_full
        if full and not rewrite and self._tables_changed():
            log.warning("nftables: a table of ours was changed or removed; rewriting all")
            rewrite = True
        changed, came = (None, by_family) if rewrite else self._changed_keys(state, by_family)
        commands: list[str] = []
        new_held: dict[str, _Held] = {}
        removed_udp: list[tuple[ServiceEntry, ServiceEntry | None]] = []
        stamp = time.time_ns()
        for family in FAMILIES:
            options = self._options(state, family)
            held = self._held.get(family)
            if rewrite or held is None or held.options != options:
                fresh = (rendered or {}).get(family)
                if fresh is None or fresh.options != options:
                    fresh = self._render_family(options, by_family[family])
                marker = marker_commands(family, state.revision, fresh.digest, stamp)
                commands += full_table(options, fresh.made.values(), marker)
                new_held[family] = fresh
                if held is not None:
                    removed_udp += self._udp_changes(held, fresh.entries, None)
                self._forget.pop(family, None)  # a new table remembers nobody
                continue
            family_commands, updated = self._partial(held, came[family], changed,
                                                     removed_udp)  # fmt: skip
            if family_commands:
                family_commands += marker_commands(family, state.revision, updated.digest, stamp)
                commands += family_commands
            new_held[family] = updated
        writes = sum(
            1 for c in commands if not c.startswith(("flush ", "add table", "delete table"))
        )
        if commands:
            proc = self._run(self.netns, [NFT, "-f", "-"], "\n".join(commands) + "\n")
            if proc.returncode != 0:
                self._needs_full = True
                self._forget.clear()
                raise DataplaneError("nft", _nft_error(proc, commands))
        self._held = new_held
        self._needs_full = False
        self._revision, self._services = state.revision, state.services
        self.last_writes = writes
        self._clear_udp_conntrack(removed_udp)
        try:
            self._forget_clients()
        except DataplaneError as err:  # the transaction is in: only affinity lingers
            log.warning("nftables: affinity clients of endpoints that left: %s", err)
        return writes

    def _tables_changed(self) -> bool:
        """Does a family's marker differ from what this agent wrote last (the table gone,
        or rewritten by another agent)?"""
        try:
            return any(
                (found := kernel_marker(family, self.netns, self._run)) is None
                or found[1] != held.digest
                for family, held in self._held.items()
            )
        except DataplaneError:
            return True

    def _changed_keys(
        self, state: NodeState, by_family: _ByFamily
    ) -> tuple[set[tuple[str, ...]] | None, _ByFamily]:
        """The sort keys of the entries that went or came since the state these tables
        hold (`Changes.since`), with the entries that came by family; on a resync None and
        every entry: compare every entry."""
        delta = Changes.since(self._revision, self._services if self._held else None, state)
        if delta.full:
            return None, by_family
        return {e.sort_key for e in (*delta.went, *delta.came)}, _ByFamily(delta.came)

    def _render(
        self, state: NodeState, by_family: dict[str, list[ServiceEntry]]
    ) -> dict[str, _Held]:
        return {f: self._render_family(self._options(state, f), by_family[f]) for f in FAMILIES}

    @staticmethod
    def _render_family(options: RenderOptions, entries: list[ServiceEntry]) -> _Held:
        by_key = {e.sort_key: e for e in entries}
        made = {key: entry_nft(e, options) for key, e in by_key.items()}
        return _held_from(options, by_key, made)

    def _partial(
        self,
        held: _Held,
        entries: list[ServiceEntry],
        changed: set[tuple[str, ...]] | None,
        removed_udp: list[tuple[ServiceEntry, ServiceEntry | None]],
    ) -> tuple[list[str], _Held]:
        """The commands that bring one family's table from `held` to `entries`; `held`
        is updated in place to what the table holds after them (a failed write makes the
        next apply rewrite everything, which does not read it)."""
        family, options = held.options.family, held.options
        if changed is None:
            new_entries = {e.sort_key: e for e in entries}
            keys: Iterable[tuple[str, ...]] = list(dict.fromkeys([*held.entries, *new_entries]))
        else:
            new_entries = {e.sort_key: e for e in entries if e.sort_key in changed}
            keys = sorted(changed)
        touched: list[tuple[tuple[str, ...], EntryNft | None, EntryNft | None]] = []
        for key in keys:
            old_entry, new_entry = held.entries.get(key), new_entries.get(key)
            if old_entry is new_entry or (
                old_entry is not None and new_entry is not None
                and old_entry.digest and old_entry.digest == new_entry.digest
            ):  # fmt: skip
                continue
            if old_entry is not None and old_entry.protocol == "UDP":
                removed_udp.append((old_entry, new_entry))
            old = held.made.pop(key, None)
            held.entries.pop(key, None)
            new = None
            if new_entry is not None:
                new = entry_nft(new_entry, options)
                held.entries[key], held.made[key] = new_entry, new
            if old is None or new is None or old.digest != new.digest:
                touched.append((key, old, new))
        if not touched:
            return [], held
        create_sets: list[str] = []
        create_chains: list[str] = []
        rewrite_chains: list[str] = []
        delete_chains: list[str] = []
        delete_sets: list[str] = []
        frontends: set[tuple[str, str]] = set()  # (nat|filter, key) whose holder may change
        for _key, old, new in touched:
            # IPv6 affinity entries' chains and sets
            old_chains = old.chains if old is not None else {}
            new_chains = new.chains if new is not None else {}
            old_sets = old.sets if old is not None else {}
            new_sets = new.sets if new is not None else {}
            create_sets += [set_command(family, name, timeout)
                            for name, timeout in new_sets.items()
                            if name not in old_sets]  # fmt: skip
            delete_sets += [name for name in old_sets if name not in new_sets]
            for name, (comment, rules) in new_chains.items():
                if name not in old_chains:
                    create_chains += chain_commands(family, name, comment, rules, new=True)
                elif old_chains[name] != (comment, rules):
                    rewrite_chains += chain_commands(family, name, comment, rules, new=False)
            delete_chains += [name for name in old_chains if name not in new_chains]
            for made in (old, new):
                if made is not None:
                    frontends.update(("nat", k) for k, _ in made.nat)
                    frontends.update(("filter", k) for k, _ in made.filter)
        claims = {"nat": held.nat, "filter": held.filter}
        holders_before = {(c, k): _winner(claims[c].get(k)) or () for c, k in frontends}
        ips = {ip for _, old, new in touched for m in (old, new) if m is not None
               for ip in m.endpoints}  # fmt: skip
        present_before = {ip for ip in ips if ip in held.hairpin}
        for key, old, new in touched:
            if old is not None:
                _claim(held, key, old, -1)
            if new is not None:
                _claim(held, key, new, +1)
        held.digest = family_digest(base_digest(options), held.total)
        went: list[Element] = []
        came: list[Element] = []
        forgotten: list[tuple[str, str | None]] = []
        for (c, k), was in sorted(holders_before.items()):
            now = _winner(claims[c].get(k)) or ()
            if now == was:
                continue
            went += [e for e in was if e not in now]
            came += [e for e in now if e not in was]
            if c == "nat":
                forgotten += _forgotten(k, was, now)
        picks_before = set(held.picks)
        for elements, sign in ((went, -1), (came, +1)):
            for where, _ in elements:
                if is_dynamic(where):
                    count = held.picks.get(where, 0) + sign
                    if count:
                        held.picks[where] = count
                    else:
                        del held.picks[where]
        new_picks = sorted(set(held.picks) - picks_before)
        gone_picks = sorted(picks_before - set(held.picks))
        present_after = {ip for ip in ips if ip in held.hairpin}
        gone_ips, came_ips = present_before - present_after, present_after - present_before
        went += [(HAIRPIN, hairpin_element(i)) for i in sorted(gone_ips)]
        came += [(HAIRPIN, hairpin_element(i)) for i in sorted(came_ips)]
        t = f"{NFT_FAMILY[family]} {TABLE}"
        commands: list[str] = [*create_sets, *create_chains]
        for name in new_picks:
            commands += dynamic_set_commands(family, name)
        gone_maps = {slots_map(n, p) for n in gone_picks if parse_pick(n) is not None
                     for p in PROTOCOLS}  # fmt: skip
        for where, items in grouped(went).items():
            if where not in gone_picks and where not in gone_maps:  # they go with the chain
                commands += element_commands("delete", family, where, items)
        changed_sets = {*new_picks, *gone_picks}
        if any(parse_pick(n) is not None for n in changed_sets):
            commands += dispatch_commands(family, held.picks, new=False)
        if any(parse_affinity(n) is not None for n in changed_sets):
            commands += remember_commands(family, held.picks, new=False)
        commands += rewrite_chains
        for where, items in grouped(came).items():
            commands += element_commands("add", family, where, items)
        # every chain that goes is emptied before any is deleted: they jump to each other
        gone_chains = [*delete_chains, *(n for n in gone_picks if parse_pick(n) is not None)]
        commands += [f"flush chain {t} {name}" for name in gone_chains]
        commands += [f"delete chain {t} {name}" for name in gone_chains]
        commands += [f"delete set {t} {name}" for name in (*delete_sets, *gone_picks)]
        commands += [f"delete map {t} {name}" for name in sorted(gone_maps)]
        self._forget[family] = self._forget.get(family, []) + forgotten
        return commands, held

    def _forget_clients(self) -> None:
        """Remove the remembered affinity clients of endpoints that left (or of frontends
        that no longer have affinity): the dynamic map is the packet path's, so its
        elements are read back; after the transaction, as from then on no new connection
        can be sent to an endpoint that left. An element that expired meanwhile fails the
        delete: read again and retry once."""
        forget, self._forget = self._forget, {}
        for family, pairs in forget.items():
            if not pairs:
                continue
            for _ in range(2):
                keys = _remembered(family, pairs, self.netns, self._run)
                if not keys:
                    break
                text = "\n".join(element_commands("delete", family, AFFINITY_CLIENTS, keys))
                proc = self._run(self.netns, [NFT, "-f", "-"], text + "\n")
                if proc.returncode == 0:
                    break
            else:
                log.warning("nftables: could not forget the affinity clients of %d "
                            "endpoints that left: they keep them until their timeout",
                            len(pairs))  # fmt: skip

    def _udp_changes(
        self, held: _Held, new_entries: dict, _: object
    ) -> list[tuple[ServiceEntry, ServiceEntry | None]]:
        """Every UDP entry held, with its successor: a rewrite may drop any endpoint."""
        return [(e, new_entries.get(k)) for k, e in held.entries.items() if e.protocol == "UDP"]

    def _clear_udp_conntrack(
        self, changes: Iterable[tuple[ServiceEntry, ServiceEntry | None]]
    ) -> None:
        """UDP has no end: conntrack keeps sending a flow to an endpoint that left until
        the entry times out. Delete the entries of endpoints that left (as kube-proxy
        does with conntrack -D)."""
        for old, new in changes:
            kept: set[tuple[str, int]] = set()
            if new is not None:
                kept = {(b.ip, b.port) for b in (*(new.cluster_backends or ()),
                                                 *(new.local_backends or ()))}  # fmt: skip
            left = {(b.ip, b.port) for b in (*(old.cluster_backends or ()),
                                             *(old.local_backends or ()))} - kept  # fmt: skip
            if not left:
                continue
            if self._conntrack is None:
                log.warning("conntrack not found: UDP flows to endpoints that left %s/%s keep "
                            "going there until they time out", old.namespace, old.name)  # fmt: skip
                return
            family = "ipv6" if old.ip_family == IPV6 else "ipv4"
            for frontend in old.frontends:
                for ip, port in sorted(left):
                    self._run(self.netns, ["conntrack", "-D", "-f", family, "-p", "udp",
                                           "--orig-dst", frontend.ip, "--orig-port-dst",
                                           str(frontend.port), "--reply-src", ip,
                                           "--reply-port-src", str(port)], None)  # fmt: skip


def _forgotten(
    key: str, was: tuple[Element, ...], now: tuple[Element, ...]
) -> list[tuple[str, str | None]]:
    """What a frontend's remembered affinity clients lose when its elements go from `was`
    to `now`: all of them (None) when it no longer remembers, else the endpoints that
    left its slots."""
    if not any(parse_affinity(where) is not None for where, _ in was):
        return []
    if not any(parse_affinity(where) is not None for where, _ in now):
        return [(key, None)]

    def endpoints(elements: tuple[Element, ...]) -> set[str]:
        return {e.split(" : ", 1)[1] for w, e in elements
                if " : " in e and w.startswith(PICK_PREFIX)}  # fmt: skip

    return [(key, endpoint) for endpoint in sorted(endpoints(was) - endpoints(now))]


def _remembered(
    family: str, pairs: Sequence[tuple[str, str | None]], netns: str | None, run: Runner
) -> list[str]:
    """The keys (client . frontend) of affinity-clients' elements that `pairs` name."""
    wanted: dict[str, set[str] | None] = {}
    for key, endpoint in pairs:
        if endpoint is None:
            wanted[key] = None
        elif key not in wanted:
            wanted[key] = {endpoint}
        elif (held := wanted[key]) is not None:
            held.add(endpoint)
    found = list_object(netns, run, "map", NFT_FAMILY[family], TABLE, AFFINITY_CLIENTS) or []
    keys = []
    for item in found:
        for element in item.get("map", {}).get("elem", []):
            key, value = element if isinstance(element, list) else (None, None)
            if isinstance(key, dict) and "elem" in key:  # with its timeout and expiry
                key = key["elem"].get("val")
            parts = key.get("concat", []) if isinstance(key, dict) else []
            target = value.get("concat", []) if isinstance(value, dict) else []
            if len(parts) != 4 or len(target) != 2:
                continue
            frontend = f"{parts[1]} . {parts[2]} . {parts[3]}"
            if frontend not in wanted:
                continue
            endpoints = wanted[frontend]
            if endpoints is None or f"{target[0]} . {target[1]}" in endpoints:
                keys.append(f"{parts[0]} . {frontend}")
    return keys


def _nft_error(proc: subprocess.CompletedProcess[str], commands: Sequence[str]) -> str:
    """nft's first errors, each with the input line it names."""
    found = []
    for line in (proc.stderr or proc.stdout).strip().splitlines():
        if "Error:" not in line:
            continue
        where = line.split(":")
        number = int(where[1]) if len(where) > 2 and where[1].isdigit() else 0
        quoted = (
            f" (line {number}: {commands[number - 1][:200]})" if 0 < number <= len(commands) else ""
        )
        found.append(line.split("Error:", 1)[1].strip() + quoted)
        if len(found) == 3:
            break
    return "nft -f: " + ("; ".join(found) or f"exit {proc.returncode}")
