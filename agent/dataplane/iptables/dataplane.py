"""`--dataplane iptables`: the NodeState applied with `iptables-restore --noflush`, per family.

The first apply, and a full resync after an error, rewrite every KBP- chain and delete
the KBP- chains the kernel holds that the state no longer names. After that a sync writes
only the dispatch chains and the chains of the Service entries whose digest changed
(kube-proxy's partial sync, KEP-3453). Each family's document is one restore: the kernel
switches from the old rules to the new ones in one commit. Rules of other programs are
never flushed: only our chains are declared, and our jump rules are inserted once.

Every document ends with the KBP-STATE marker: the revision written and a digest of all
of the family's rules. A restarted agent reports the marker's revision as held until it
applies, and its first apply writes nothing when the rules it would write have the
digest the kernel's marker names and the jump rules are in place (kube-proxy rewrites
everything at start; at 10k Services that is seconds of iptables-restore for nothing).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ...model.ip import ip_family
from ...model.nodestate import Changes, NodeState, ServiceEntry
from ..base import DataplaneError, QuietDataplane
from ..options import DEFAULT_POD_INTERFACES
from .backend import (
    BACKENDS,
    Backend,
    BackendError,
    choose_backend,
    find_backend,
    other_backend,
    run_command,
)
from .render import (
    FAMILIES,
    FORWARD,
    IPV4,
    IPV6,
    NAT_BASE_CHAINS,
    POSTROUTING,
    PREFIX,
    SERVICES,
    STATE,
    EntryRules,
    RenderOptions,
    assemble,
    entry_digest,
    entry_rules,
    interface_patterns,
    marker,
    parse_marker,
    rules_digest,
)

log = logging.getLogger(__name__)

LOCK_WAIT = "5"  # seconds to wait for the xtables lock (`-w`)
# A periodic full resync rewrites everything at most this often (kube-proxy: hourly); in
# between it checks the jump rules and writes what changed.
FULL_REWRITE_INTERVAL = 3600.0

# (table, builtin chain, our chain, position, extra matches, comment): inserted first, so
# other programs' rules cannot pre-empt Service translation, except KBP-FORWARD, which is
# appended: it only rescues Service traffic that nothing else decided.
JUMPS: tuple[tuple[str, str, str, str, str, str], ...] = (
    ("nat", "PREROUTING", SERVICES, "insert", "", "kube-bpf-proxy service portals"),
    ("nat", "OUTPUT", SERVICES, "insert", "", "kube-bpf-proxy service portals"),
    ("nat", "POSTROUTING", POSTROUTING, "insert", "", "kube-bpf-proxy postrouting rules"),
    ("filter", "INPUT", SERVICES, "insert", "-m conntrack --ctstate NEW",
     "kube-bpf-proxy service rejects and drops"),
    ("filter", "FORWARD", SERVICES, "insert", "-m conntrack --ctstate NEW",
     "kube-bpf-proxy service rejects and drops"),
    ("filter", "OUTPUT", SERVICES, "insert", "-m conntrack --ctstate NEW",
     "kube-bpf-proxy service rejects and drops"),
    ("filter", "FORWARD", FORWARD, "append", "", "kube-bpf-proxy forwarding rules"),
)  # fmt: skip


def _run(
    netns: str | None, argv: Sequence[str], stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return run_command(netns, argv, stdin)


def backend_or_auto(backend: Backend | None, netns: str | None) -> Backend:
    """The backend given, else the one `--iptables-backend auto` picks in `netns`."""
    return backend if backend is not None else choose_backend("auto", netns)[0]


def unavailable_reason(netns: str | None = None, backend: Backend | None = None) -> str | None:
    """Why this dataplane cannot work here with `backend` (None: it can): the tools are
    missing, or the kernel refuses the nat table for a family."""
    try:
        backend = backend_or_auto(backend, netns)
    except BackendError as err:
        return str(err)
    for family in FAMILIES:
        for tool in (backend.restore(family), backend.save(family), backend.iptables(family)):
            if shutil.which(tool) is None:
                return f"{tool} not found (install the iptables package)"
        save = backend.save(family)
        try:
            proc = _run(netns, [save, "-t", "nat"])
        except (OSError, subprocess.SubprocessError) as err:
            return f"{save}: {err}"
        if proc.returncode != 0:
            return f"{save} -t nat: {(proc.stderr or proc.stdout).strip()}"
    return None


TABLES = ("nat", "filter")  # the tables our chains live in


def saved_tables(
    family: str, netns: str | None, backend: Backend, tables: Sequence[str] = TABLES
) -> dict[str, list[str]]:
    """`iptables-save -t TABLE` of `tables`, as lines per table."""
    out: dict[str, list[str]] = {}
    save = backend.save(family)
    for table in tables:
        proc = _run(netns, [save, "-t", table])
        if proc.returncode != 0:
            raise DataplaneError("iptables-save", f"{save} -t {table}: {proc.stderr.strip()}")
        out[table] = proc.stdout.splitlines()
    return out


def _existing(family: str, netns: str | None, backend: Backend) -> dict[str, list[str]]:
    """The lines of our tables as `iptables-save` without -t shows them: only the tables
    that exist. (Asking for a table by name makes the legacy backend create it, and a
    backend that holds tables while the node uses the other one confuses both.)"""
    save = backend.save(family)
    proc = _run(netns, [save])
    if proc.returncode != 0:
        raise DataplaneError("iptables-save", f"{save}: {proc.stderr.strip()}")
    out: dict[str, list[str]] = {}
    lines: list[str] | None = None
    for line in proc.stdout.splitlines():
        if line.startswith("*"):
            lines = out.setdefault(line[1:].strip(), []) if line[1:].strip() in TABLES else None
        elif lines is not None:
            lines.append(line)
    return out


_MARKER_RULE = re.compile(rf'^-A {STATE} -m comment --comment "?([^"]*)"? -j RETURN$')


def kernel_marker(
    family: str, netns: str | None = None, backend: Backend | None = None
) -> tuple[str, str, int] | None:
    """(revision, rules digest, written at, Unix ns) of the KBP-STATE marker the kernel
    holds for a family; None when there is none."""
    proc = _run(netns, [backend_or_auto(backend, netns).save(family), "-t", "filter"])
    if proc.returncode != 0:
        return None
    for line in proc.stdout.splitlines():
        match = _MARKER_RULE.match(line)
        if match:
            return parse_marker(match.group(1))
    return None


def kernel_chains(
    family: str,
    netns: str | None = None,
    backend: Backend | None = None,
    tables: Sequence[str] = TABLES,
) -> dict[str, set[str]]:
    """The KBP- chains the kernel holds, per table."""
    return {
        table: {line[1:].split(" ", 1)[0] for line in lines if line.startswith(":" + PREFIX)}
        for table, lines in saved_tables(
            family, netns, backend_or_auto(backend, netns), tables
        ).items()
    }


def installed_backends(netns: str | None = None) -> list[Backend]:
    """The iptables backends whose tools are here (nft first)."""
    return [b for name in BACKENDS if (b := find_backend(name, netns)) is not None]


def cleanup(netns: str | None = None, backend: Backend | None = None) -> list[str]:
    """Remove every KBP- chain and every rule of other chains that jumps to one (ours,
    or any left by hand or by an older version), both families, one restore per family;
    return what went ("IPv4 nat KBP-SERVICES", ...). `backend` None: from every backend
    whose tools are here. Safe when nothing is installed; creates no table."""
    if backend is None:
        return [item for b in installed_backends(netns) for item in cleanup(netns, b)]
    removed: list[str] = []
    for family in FAMILIES:
        restore = backend.restore(family)
        if shutil.which(restore) is None:
            continue
        lines: list[str] = []
        for table, saved in _existing(family, netns, backend).items():
            chains = sorted(line[1:].split(" ", 1)[0] for line in saved
                            if line.startswith(":" + PREFIX))  # fmt: skip
            jumps = [
                line for line in saved
                if line.startswith("-A ") and not line.startswith("-A " + PREFIX)
                and (f"-j {PREFIX}" in line or f"-g {PREFIX}" in line)
            ]  # fmt: skip
            if not chains and not jumps:
                continue
            lines.append(f"*{table}")
            lines.extend("-D" + line[2:] for line in jumps)
            lines.extend(f":{chain} - [0:0]" for chain in chains)
            lines.extend(f"-X {chain}" for chain in chains)
            lines.append("COMMIT")
            removed.extend(f"{family} {table} {line[3:]}" for line in jumps)
            removed.extend(f"{family} {table} {chain}" for chain in chains)
        if lines:
            proc = _run(netns, [restore, "-w", LOCK_WAIT, "--noflush"],
                        "\n".join(lines) + "\n")  # fmt: skip
            if proc.returncode != 0:
                raise DataplaneError("iptables-restore", f"{restore}: {proc.stderr.strip()}")
    return removed


@dataclass
class _Held:
    """What one family's tables hold, as far as this process wrote them."""

    options: RenderOptions
    entries: dict[tuple[str, ...], ServiceEntry]
    rules: dict[tuple[str, ...], EntryRules]
    digests: dict[tuple[str, ...], bytes]  # entry_digest of each entry's rules


class IptablesDataplane(QuietDataplane):
    name = "iptables"

    def __init__(
        self,
        pod_interfaces: Sequence[str] = DEFAULT_POD_INTERFACES,
        *,
        netns: str | None = None,
        clock: object = time.monotonic,
        backend: Backend | None = None,
        backend_reason: str = "requested",
    ) -> None:
        """`backend` None: the one `--iptables-backend auto` picks (BackendError when
        neither is installed)."""
        self.netns = netns
        if backend is None:
            backend, backend_reason = choose_backend("auto", netns)
        self.backend = backend
        self.backend_reason = backend_reason
        # Our chains in the other backend (an agent that chose differently before) go
        # once this one has applied: until then they are what serves the node.
        self._other_backend_checked = False
        self._patterns = interface_patterns(pod_interfaces)
        self._clock = clock
        self._held: dict[str, _Held] = {}
        self._revision: str | None = None
        self._services: tuple[ServiceEntry, ...] = ()  # of the state at _revision, if applied
        self._needs_full = True  # the first apply reads the kernel and rewrites it all
        self._last_full = 0.0
        self._conntrack = shutil.which("conntrack")
        self.last_writes: dict[str, int] = {}  # per family, of the last apply (benchmarks)
        # What an earlier agent left (per family: revision, rules digest, written at):
        # reported as held, and adopted by the first apply if it is what it would write.
        self._found: dict[str, tuple[str, str, int]] = {}
        for family in FAMILIES:
            found = kernel_marker(family, netns, backend)
            if found is not None:
                self._found[family] = found
        # Held: the newest marker's revision (a family unchanged by later applies keeps
        # an older marker that still describes its rules), but only when every family
        # has one: an apply cut short leaves its family's marker empty, and what the
        # tables then hold is unknown.
        if len(self._found) == len(FAMILIES):
            self._revision = max(self._found.values(), key=lambda f: f[2])[0]

    @property
    def held_revision(self) -> str | None:
        return self._revision

    def status_details(self) -> dict[str, object]:
        """/state's status.iptablesBackend: which iptables the rules are in, and why."""
        return {"iptablesBackend": {"name": self.backend.name, "reason": self.backend_reason,
                                    "save": self.backend.save(IPV4)}}  # fmt: skip

    def close(self) -> None:
        """Nothing runs in the background; the rules stay for the next agent."""

    def cleanup(self) -> None:
        cleanup(self.netns)
        self._held.clear()
        self._revision = None
        self._needs_full = True

    def apply(self, state: NodeState, full: bool = False) -> int:
        now = self._clock()  # type: ignore[operator]
        rewrite_all = self._needs_full or (full and now - self._last_full >= FULL_REWRITE_INTERVAL)
        by_family: dict[str, list[ServiceEntry]] = {family: [] for family in FAMILIES}
        for entry in state.services:
            by_family[entry.ip_family].append(entry)
        rendered: dict[str, _Held] = {}  # what _adopt rendered, for the rewrite to reuse
        if self._found:
            found, self._found = self._found, {}  # adopted once, at the first apply
            rendered = self._render(state, by_family)
            if self._adopt(state, rendered, found):
                self._last_full = now
                self._clear_other_backend()
                return 0
        writes = 0
        removed_udp: list[tuple[ServiceEntry, ServiceEntry | None]] = []
        changed = self._changed_keys(state)
        try:
            if full and not rewrite_all and self._missing_jumps():
                # Someone removed our rules since the last full write (a flush, another
                # tool's cleanup): what the kernel holds is unknown, so write it all.
                log.warning("iptables: jump rules into KBP- chains are missing; rewriting all")
                rewrite_all = True
            for family in FAMILIES:
                options = self._options(state, family)
                writes += self._apply_family(
                    family, options, by_family[family], rewrite_all, removed_udp, state.revision,
                    rendered.get(family), changed,
                )  # fmt: skip
            if rewrite_all or full:
                writes += self._ensure_jumps()
        except DataplaneError:
            self._needs_full = True
            raise
        if rewrite_all:
            self._last_full = now
        self._needs_full = False
        self._revision, self._services = state.revision, state.services
        self._clear_udp_conntrack(removed_udp)
        self._clear_other_backend()
        return writes

    def _changed_keys(self, state: NodeState) -> dict[tuple[str, ...], None] | None:
        """The sort keys of the entries that went or came since the state these tables
        hold (`Changes.since`); None on a resync: compare every entry."""
        delta = Changes.since(self._revision, self._services if self._held else None, state)
        if delta.full:
            return None
        return dict.fromkeys(e.sort_key for e in (*delta.went, *delta.came))

    def _clear_other_backend(self) -> None:
        """Once, after the first apply: remove our chains and jumps from the backend this
        agent does not use (an earlier agent's choice, or a node that changed backend);
        both backends act on every packet, so stale rules there would still translate.
        Best effort: a failure is logged."""
        if self._other_backend_checked:
            return
        self._other_backend_checked = True
        other = other_backend(self.backend, self.netns)
        if other is None:
            return
        try:
            removed = cleanup(self.netns, other)
        except (DataplaneError, OSError, subprocess.SubprocessError) as err:
            log.warning("iptables: could not remove kube-bpf-proxy's rules from the %s "
                        "backend: %s", other.name, err)  # fmt: skip
            return
        if removed:
            log.info("iptables: removed %d jump rules and chains of an earlier agent from the "
                     "%s backend (this agent uses %s)", len(removed), other.name,
                     self.backend.name)  # fmt: skip

    def _render(
        self, state: NodeState, by_family: dict[str, list[ServiceEntry]]
    ) -> dict[str, _Held]:
        """Every entry's rules and digest, per family."""
        rendered: dict[str, _Held] = {}
        for family in FAMILIES:
            options = self._options(state, family)
            entries = {e.sort_key: e for e in by_family[family]}
            rules = {key: entry_rules(e, options) for key, e in entries.items()}
            digests = {key: entry_digest(r) for key, r in rules.items()}
            rendered[family] = _Held(options, entries, rules, digests)
        return rendered

    def _adopt(
        self,
        state: NodeState,
        rendered: dict[str, _Held],
        found: dict[str, tuple[str, str, int]],
    ) -> bool:
        """Take what an earlier agent wrote as held, writing nothing, when every family's
        marker names the digest of the rules this state renders (`rendered`, which a
        rewrite reuses when this says no) and no jump rule is missing."""
        for family, held in rendered.items():
            marker_found = found.get(family)
            digest = rules_digest(held.options, held.digests.values())
            if marker_found is None or marker_found[1] != digest:
                return False
        try:
            if self._missing_jumps():
                return False
        except DataplaneError:
            return False
        self._held = dict(rendered)
        self._needs_full = False
        self._revision, self._services = state.revision, state.services
        self.last_writes = dict.fromkeys(FAMILIES, 0)
        log.info("iptables: the tables already hold revision %s (written by an earlier agent): "
                 "nothing to write", state.revision[:19])  # fmt: skip
        return True

    def _options(self, state: NodeState, family: str) -> RenderOptions:
        cidrs = tuple(c for c in state.node.cluster_cidrs if ip_family(c.split("/")[0]) == family)
        return RenderOptions(family, cidrs, self._patterns)

    def _apply_family(
        self,
        family: str,
        options: RenderOptions,
        entries: list[ServiceEntry],
        rewrite_all: bool,
        removed_udp: list[tuple[ServiceEntry, ServiceEntry | None]],
        revision: str = "",
        rendered: _Held | None = None,
        changed: dict[tuple[str, ...], None] | None = None,
    ) -> int:
        """Write one family's changes (all of it with `rewrite_all`); `rendered`: rules
        this apply already rendered for these entries and options, reused; `changed`:
        the only keys whose entries may differ from what is held (None: any)."""
        held = self._held.get(family)
        if rendered is not None and rendered.options != options:
            rendered = None
        if held is not None and held.options != options:
            rewrite_all = True  # the pod CIDRs changed: every EXT chain may differ
        new_entries = {e.sort_key: e for e in entries}
        old_entries = held.entries if held is not None else {}
        old_rules = held.rules if held is not None else {}
        old_digests = held.digests if held is not None else {}
        rules: dict[tuple[str, ...], EntryRules] = {}
        digests: dict[tuple[str, ...], bytes] = {}
        rewritten: list[EntryRules] = []
        for key, entry in new_entries.items():
            old = old_entries.get(key)
            if (
                not rewrite_all
                and old is not None
                and ((changed is not None and key not in changed) or old.digest == entry.digest)
            ):
                rules[key] = old_rules[key]
                digests[key] = old_digests[key]
                continue
            if rendered is not None and rendered.entries.get(key) is entry:
                rules[key], digests[key] = rendered.rules[key], rendered.digests[key]
            else:
                rules[key] = entry_rules(entry, options)
                digests[key] = entry_digest(rules[key])
            rewritten.append(rules[key])
            if old is not None and old.protocol == "UDP":
                removed_udp.append((old, entry))
        maybe_gone = old_entries if changed is None else changed
        gone = [key for key in maybe_gone if key in old_entries and key not in new_entries]
        for key in gone:
            if old_entries[key].protocol == "UDP":
                removed_udp.append((old_entries[key], None))
        if not rewrite_all and not rewritten and not gone:
            self.last_writes[family] = 0
            return 0
        desired = {chain for r in rules.values() for chain in r.chains}
        if rewrite_all:
            existing = kernel_chains(family, self.netns, self.backend, ("nat",))["nat"]
            stale = {c for c in existing if c not in desired and c.startswith(PREFIX)}
            stale -= set(NAT_BASE_CHAINS)
        else:
            previous: set[str] = set()
            for key in old_entries if changed is None else changed:
                if key not in old_entries:
                    continue
                if key in new_entries and rules[key] is old_rules.get(key):
                    continue
                previous.update(old_rules[key].chains)
            stale = previous - desired
        state_marker = marker(revision, rules_digest(options, digests.values()), time.time_ns())
        document = assemble(options, rules.values(), rewritten, stale, state_marker)
        restore = self.backend.restore(family)
        proc = _run(self.netns, [restore, "-w", LOCK_WAIT, "--noflush"], document.text)
        if proc.returncode != 0:
            raise DataplaneError("iptables-restore", _restore_error(restore, proc, document.text))
        self._held[family] = _Held(options, new_entries, rules, digests)
        self.last_writes[family] = document.rules + document.chains_deleted
        log.debug(
            "iptables %s: %d rules in %d chains written, %d chains deleted%s",
            family, document.rules, document.chains_written, document.chains_deleted,
            " (full)" if rewrite_all else "",
        )  # fmt: skip
        return document.rules + document.chains_deleted

    def _missing_jumps(self) -> dict[str, list[tuple[str, str]]]:
        """Our jump rules the kernel lacks: family → [(table, restore line)]. The legacy
        backend loads a whole table for any query (at 10k Services 14 `iptables -C` took
        11 s), so it is read with one iptables-save per table; nf_tables lists a single
        chain without the rest (`-S PREROUTING`: 20 ms where saving the nat table took
        1 s at 500 Services and 27 s at 2k under load), so only the built-in chains our
        jumps live in are listed."""
        missing: dict[str, list[tuple[str, str]]] = {}
        for family in FAMILIES:
            saved = self._builtin_rules(family)
            for table, builtin, chain, position, extra, comment in JUMPS:
                spec = f'{extra + " " if extra else ""}-m comment --comment "{comment}" -j {chain}'
                if f"-A {builtin} {spec}" in saved[table]:
                    continue
                verb = f"-I {builtin} 1" if position == "insert" else f"-A {builtin}"
                missing.setdefault(family, []).append((table, f"{verb} {spec}"))
        return missing

    def _builtin_rules(self, family: str) -> dict[str, set[str]]:
        """The rules of the tables our jumps live in, as restore lines per table: only
        the built-in chains' on nf_tables, the whole tables' otherwise."""
        if not self.backend.nf_tables:
            saved = saved_tables(family, self.netns, self.backend)
            return {table: set(lines) for table, lines in saved.items()}
        rules: dict[str, set[str]] = {"nat": set(), "filter": set()}
        for table, builtin in sorted({(j[0], j[1]) for j in JUMPS}):
            iptables = self.backend.iptables(family)
            proc = _run(self.netns, [iptables, "-w", LOCK_WAIT, "-t", table, "-S", builtin])
            if proc.returncode != 0:
                raise DataplaneError(
                    "iptables", f"{iptables} -t {table} -S {builtin}: {proc.stderr.strip()}"
                )
            rules[table].update(proc.stdout.splitlines())
        return rules

    def _ensure_jumps(self) -> int:
        """Insert our missing jump rules, one restore per family."""
        added = 0
        for family, jumps in self._missing_jumps().items():
            lines: list[str] = []
            for table in ("nat", "filter"):
                rules = [line for t, line in jumps if t == table]
                if rules:
                    lines += [f"*{table}", *rules, "COMMIT"]
            restore = self.backend.restore(family)
            proc = _run(self.netns, [restore, "-w", LOCK_WAIT, "--noflush"],
                        "\n".join(lines) + "\n")  # fmt: skip
            if proc.returncode != 0:
                error = _restore_error(restore, proc, "\n".join(lines))
                raise DataplaneError("iptables-restore", error)
            added += len(jumps)
        return added

    def _clear_udp_conntrack(
        self, changes: Iterable[tuple[ServiceEntry, ServiceEntry | None]]
    ) -> None:
        """UDP has no end: conntrack keeps sending a flow to an endpoint that left until
        the entry times out. Delete the entries of endpoints that left (kube-proxy does
        the same with conntrack -D)."""
        for old, new in changes:
            kept = set()
            if new is not None:
                kept = {(b.ip, b.port) for b in (new.cluster_backends or ())}
                kept |= {(b.ip, b.port) for b in (new.local_backends or ())}
            left = {(b.ip, b.port) for b in (old.cluster_backends or ())}
            left |= {(b.ip, b.port) for b in (old.local_backends or ())}
            left -= kept
            if not left:
                continue
            if self._conntrack is None:
                log.warning(
                    "conntrack not found: UDP flows to endpoints that left %s/%s "
                    "keep going there until they time out",
                    old.namespace,
                    old.name,
                )
                return
            family = "ipv6" if old.ip_family == IPV6 else "ipv4"
            for frontend in old.frontends:
                for ip, port in sorted(left):
                    _run(self.netns, ["conntrack", "-D", "-f", family, "-p", "udp",
                                      "--orig-dst", frontend.ip, "--orig-port-dst",
                                      str(frontend.port), "--reply-src", ip,
                                      "--reply-port-src", str(port)])  # fmt: skip


def _restore_error(restore: str, proc: subprocess.CompletedProcess[str], text: str) -> str:
    """The tool's message, with the offending input line when it names one."""
    message = (proc.stderr or proc.stdout).strip()
    lines = text.splitlines()
    for word in message.replace(":", " ").split():
        if word.isdigit() and "line" in message and 0 < int(word) <= len(lines):
            return f"{restore}: {message} (line {word}: {lines[int(word) - 1]})"
    return f"{restore}: {message}"
