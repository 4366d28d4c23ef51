"""A small model of iptables: loads `iptables-restore`/`iptables-save` text into tables and
answers "where does a packet from X to VIP:port go?" over the rules. `explain` traces
packets through the live rules with it (`live`); the tests through rendered documents.

It knows exactly the matches and targets the iptables renderer uses and raises on anything
else, so a rule it cannot read fails the test instead of being skipped. A `statistic` split
forks the walk into both branches with their probabilities; a `recent --rcheck` forks into
"the client is remembered" and "it is not". Restores follow `--noflush`: declaring a chain
flushes it, other chains stay, and a commit with a jump to a missing chain fails.
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from .backend import Backend

BUILTIN_CHAINS = {
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
}
VERDICTS = ("ACCEPT", "DROP", "REJECT")

# module or target → its options, each True when it takes a value
MATCH_OPTIONS: dict[str, dict[str, bool]] = {
    "tcp": {"--dport": True},
    "udp": {"--dport": True},
    "sctp": {"--dport": True},
    "comment": {"--comment": True},
    "statistic": {"--mode": True, "--probability": True},
    "recent": {
        "--name": True,
        "--mask": True,
        "--rsource": False,
        "--rcheck": False,
        "--set": False,
        "--seconds": True,
        "--reap": False,
    },
    "addrtype": {"--src-type": True},
    "mark": {"--mark": True},
    "conntrack": {"--ctstate": True},
}
TARGET_OPTIONS: dict[str, dict[str, bool]] = {
    "ACCEPT": {},
    "DROP": {},
    "RETURN": {},
    "REJECT": {"--reject-with": True},
    "DNAT": {"--to-destination": True},
    "MARK": {"--or-mark": True, "--xor-mark": True, "--set-xmark": True},
    "MASQUERADE": {"--random-fully": False},
}
GENERAL_OPTIONS = {"-s": "source", "-d": "destination", "-p": "protocol", "-i": "in_interface"}
# what iptables-save adds that the renderer leaves implicit
DEFAULT_REJECT = {"icmp-port-unreachable", "icmp6-port-unreachable"}


class UnknownRule(ValueError):
    """A rule, match, option or target this model does not understand."""


class RestoreError(ValueError):
    """What iptables-restore would refuse (missing chain, deleting a chain in use, ...)."""


@dataclass(frozen=True)
class Option:
    name: str  # "--dport"
    value: str | None  # None for a flag such as --rcheck
    negated: bool = False


@dataclass(frozen=True)
class Match:
    module: str  # "tcp", "recent", ...
    options: tuple[Option, ...]

    def get(self, name: str) -> str | None:
        return next((o.value for o in self.options if o.name == name), None)

    def has(self, name: str) -> bool:
        return any(o.name == name for o in self.options)


@dataclass(frozen=True)
class Rule:
    """One `-A` line, parsed. `text` is the line as written."""

    chain: str
    source: tuple[str, bool] | None  # (CIDR, negated)
    destination: tuple[str, bool] | None
    protocol: tuple[str, bool] | None
    in_interface: tuple[str, bool] | None
    matches: tuple[Match, ...]
    target: str | None
    target_options: tuple[Option, ...]
    text: str = field(compare=False)

    def match(self, module: str) -> Match | None:
        return next((m for m in self.matches if m.module == module), None)

    def canonical(self) -> tuple:
        """A form equal for equal rules however they are spelt (`iptables-save` reorders
        options, prints host masks, rewrites MARK and probabilities)."""

        def net(spec: tuple[str, bool] | None) -> tuple[str, bool] | None:
            if spec is None:
                return None
            return (str(ipaddress.ip_network(spec[0], strict=False)), spec[1])

        modules = []
        for m in self.matches:
            if m.module in ("tcp", "udp", "sctp") and not m.options:
                continue  # `-m tcp` alone adds nothing to `-p tcp`
            modules.append((m.module, tuple(sorted(_canonical_option(o) for o in m.options))))
        target_options = tuple(_canonical_target(self.target, self.target_options))
        return (
            net(self.source),
            net(self.destination),
            self.protocol,
            self.in_interface,
            tuple(sorted(modules)),
            self.target,
            target_options,
        )


def _canonical_option(option: Option) -> tuple[str, str | None, bool]:
    value = option.value
    if option.name == "--probability" and value is not None:
        value = str(round(float(value) * 0x80000000))  # what the kernel stores
    elif option.name == "--mask" and value is not None:
        value = str(ipaddress.ip_address(value))
    return (option.name, value, option.negated)


def _canonical_target(target: str | None, options: tuple[Option, ...]) -> Iterator[tuple]:
    for option in options:
        if target == "MARK":
            yield ("--set-xmark", _xmark(option))
        elif target == "REJECT" and option.value in DEFAULT_REJECT:
            continue
        else:
            yield (option.name, option.value)


def _xmark(option: Option) -> tuple[int, int]:
    """(value, mask) in --set-xmark terms: mark = (mark & ~mask) ^ value."""
    assert option.value is not None
    if option.name == "--or-mark":
        bits = int(option.value, 0)
        return (bits, bits)
    if option.name == "--xor-mark":
        return (int(option.value, 0), 0)
    value, _, mask = option.value.partition("/")
    return (int(value, 0), int(mask, 0) if mask else 0xFFFFFFFF)


def parse_rule(line: str) -> Rule:
    """Parse one `-A CHAIN ...` (or `-I CHAIN [n] ...`) line."""
    tokens = shlex.split(line)
    if len(tokens) < 2 or tokens[0] not in ("-A", "-I"):
        raise UnknownRule(f"not a rule: {line}")
    chain = tokens[1]
    i = 2
    if tokens[0] == "-I" and i < len(tokens) and tokens[i].isdigit():
        i += 1
    general: dict[str, tuple[str, bool]] = {}
    matches: list[Match] = []
    target: str | None = None
    target_options: tuple[Option, ...] = ()
    while i < len(tokens):
        negated = tokens[i] == "!"
        if negated:
            i += 1
        token = tokens[i]
        if token in GENERAL_OPTIONS and i + 1 < len(tokens):
            general[GENERAL_OPTIONS[token]] = (tokens[i + 1], negated)
            i += 2
        elif token == "-m" and not negated and i + 1 < len(tokens):
            module = tokens[i + 1]
            if module not in MATCH_OPTIONS:
                raise UnknownRule(f"unknown match -m {module} in: {line}")
            options, i = _options(tokens, i + 2, MATCH_OPTIONS[module], line)
            matches.append(Match(module, options))
        elif token == "-j" and not negated and i + 1 < len(tokens):
            target = tokens[i + 1]
            allowed = TARGET_OPTIONS.get(target, {})  # a user chain takes no options
            target_options, i = _options(tokens, i + 2, allowed, line)
            if i != len(tokens):
                raise UnknownRule(f"unexpected {tokens[i]!r} after the target in: {line}")
        else:
            raise UnknownRule(f"unknown option {'! ' if negated else ''}{token} in: {line}")
    if "protocol" in general:
        proto, negated = general["protocol"]
        general["protocol"] = (proto.lower(), negated)
    return Rule(
        chain=chain,
        source=general.get("source"),
        destination=general.get("destination"),
        protocol=general.get("protocol"),
        in_interface=general.get("in_interface"),
        matches=tuple(matches),
        target=target,
        target_options=target_options,
        text=line,
    )


def _options(
    tokens: list[str], i: int, allowed: dict[str, bool], line: str
) -> tuple[tuple[Option, ...], int]:
    """The `[!] --name [value]` options from tokens[i]; stops at the next `-x`."""
    options = []
    while i < len(tokens):
        negated = tokens[i] == "!" and i + 1 < len(tokens) and tokens[i + 1].startswith("--")
        name = tokens[i + 1] if negated else tokens[i]
        if not name.startswith("--"):
            break
        if name not in allowed:
            raise UnknownRule(f"unknown option {name} in: {line}")
        i += 2 if negated else 1
        value = None
        if allowed[name]:
            if i >= len(tokens):
                raise UnknownRule(f"{name} needs a value in: {line}")
            value = tokens[i]
            i += 1
        options.append(Option(name, value, negated))
    return tuple(options), i


# --- tables and restores ---------------------------------------------------------------


Tables = dict[str, dict[str, list[Rule]]]  # table → chain → rules


def _empty_tables() -> Tables:
    return {table: {chain: [] for chain in chains} for table, chains in BUILTIN_CHAINS.items()}


@dataclass(frozen=True)
class RecentCheck:
    """One `recent --rcheck` the walk assumed an answer for."""

    name: str
    seconds: int | None
    remembered: bool  # True: the client is in the list (the rule matched)


@dataclass(frozen=True)
class Outcome:
    """One way a packet can go. `probability` is conditional on `recent_checks`: the
    outcomes with no remembered client (`Trace.fresh`) sum to 1."""

    probability: float
    path: tuple[str, ...]  # "nat PREROUTING", "nat KBP-SERVICES", ..., "filter FORWARD"
    dnat: str | None  # "10.244.1.5:8080" or "[fd00::5]:8080"; None when untranslated
    masquerade: bool  # reached MASQUERADE in nat POSTROUTING
    verdict: str  # ACCEPT | DROP | REJECT, the filter table's decision
    recent_checks: tuple[RecentCheck, ...]
    recent_sets: tuple[str, ...]  # `recent --set` lists the client was added to


@dataclass(frozen=True)
class Trace:
    """Every outcome of one packet."""

    outcomes: tuple[Outcome, ...]

    def fresh(self) -> tuple[Outcome, ...]:
        """The outcomes of a client no `recent` list remembers (its first connection)."""
        return tuple(o for o in self.outcomes if not any(c.remembered for c in o.recent_checks))

    def endpoints(self) -> dict[str, float]:
        """DNAT target → probability, for a fresh client whose packet is accepted."""
        out: dict[str, float] = {}
        for o in self.fresh():
            if o.verdict == "ACCEPT" and o.dnat is not None:
                out[o.dnat] = out.get(o.dnat, 0.0) + o.probability
        return out

    @property
    def verdict(self) -> str:
        """The filter verdict of a fresh client; fails when branches disagree."""
        verdicts = {o.verdict for o in self.fresh()}
        assert len(verdicts) == 1, f"branches disagree on the verdict: {self.outcomes}"
        return verdicts.pop()

    @property
    def masquerade(self) -> bool:
        """Whether a fresh client is masqueraded; fails when branches disagree."""
        masq = {o.masquerade for o in self.fresh()}
        assert len(masq) == 1, f"branches disagree on masquerading: {self.outcomes}"
        return masq.pop()


@dataclass(frozen=True)
class Packet:
    src: str
    dst: str
    port: int
    protocol: str  # tcp | udp | sctp
    in_interface: str | None  # None: generated by the node itself
    src_local: bool  # the source is one of the node's own addresses (addrtype LOCAL)
    ctstate: str


@dataclass(frozen=True)
class _Walk:
    """The packet's state along one branch."""

    probability: float = 1.0
    path: tuple[str, ...] = ()
    dst: str = ""
    port: int = 0
    dnat: str | None = None
    mark: int = 0
    masquerade: bool = False
    recent_checks: tuple[RecentCheck, ...] = ()
    recent_sets: tuple[str, ...] = ()


class Ruleset:
    """The nat and filter tables of one IP family, as restores leave them."""

    def __init__(self, local_addresses: tuple[str, ...] = ()) -> None:
        self.tables: Tables = _empty_tables()
        # the node's addresses: untranslated packets to them go through filter INPUT
        self.local_addresses = set(local_addresses)

    # restore ---------------------------------------------------------------------------

    def restore(self, text: str) -> None:
        """Apply one `iptables-restore --noflush` input (or an `iptables-save` dump)."""
        table: str | None = None
        staged: dict[str, list[Rule]] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            try:
                if line.startswith("*"):
                    table = line[1:]
                    if table not in BUILTIN_CHAINS:
                        raise UnknownRule(f"unknown table {table}")
                    staged = {chain: list(rules) for chain, rules in self.tables[table].items()}
                elif table is None:
                    raise RestoreError("rule outside a table")
                elif line == "COMMIT":
                    _check_jumps(table, staged)
                    self.tables[table] = staged
                    table = None
                else:
                    _apply_line(table, staged, line)
            except (UnknownRule, RestoreError) as err:
                raise type(err)(f"line {number}: {err}") from None
        if table is not None:
            raise RestoreError(f"*{table} has no COMMIT")

    def chains(self, table: str) -> dict[str, tuple[tuple, ...]]:
        """chain → its rules in canonical form (for comparing with iptables-save)."""
        return {
            chain: tuple(rule.canonical() for rule in rules)
            for chain, rules in self.tables[table].items()
        }

    # tracing ---------------------------------------------------------------------------

    def trace(
        self,
        src: str,
        dst: str,
        port: int,
        protocol: str = "tcp",
        *,
        in_interface: str | None = "eth0",
        src_local: bool | None = None,
        ctstate: str = "NEW",
    ) -> Trace:
        """Every way the first packet of a connection from `src` to `dst:port` can go.
        `in_interface=None` means the node sends it itself (nat and filter OUTPUT);
        `src_local` (addrtype LOCAL) defaults to that."""
        packet = Packet(
            src, dst, port, protocol.lower(), in_interface,
            in_interface is None if src_local is None else src_local, ctstate,
        )  # fmt: skip
        local = in_interface is None
        start = _Walk(dst=dst, port=port)
        outcomes = []
        for nat, _ in self._hook("nat", "OUTPUT" if local else "PREROUTING", packet, start):
            if local:
                filter_hook = "OUTPUT"
            elif nat.dst in self.local_addresses:
                filter_hook = "INPUT"
            else:
                filter_hook = "FORWARD"
            for filtered, verdict in self._hook("filter", filter_hook, packet, nat):
                if verdict != "ACCEPT":
                    outcomes.append(_outcome(filtered, verdict))
                    continue
                for post, _ in self._hook("nat", "POSTROUTING", packet, filtered):
                    outcomes.append(_outcome(post, verdict))
        return Trace(tuple(outcomes))

    def _hook(
        self, table: str, chain: str, packet: Packet, walk: _Walk
    ) -> Iterator[tuple[_Walk, str]]:
        """Run a builtin chain; a chain that ends without a verdict takes its policy."""
        entered = replace(walk, path=(*walk.path, f"{table} {chain}"))
        for after, verdict in self._walk(table, chain, 0, packet, entered):
            yield after, "ACCEPT" if verdict in (None, "DNAT", "MASQUERADE") else verdict

    def _walk(
        self, table: str, chain: str, index: int, packet: Packet, walk: _Walk
    ) -> Iterator[tuple[_Walk, str | None]]:
        """From rule `index` of `chain`: (state, verdict) per branch; verdict None when the
        chain returned (fell off its end or hit RETURN)."""
        rules = self.tables[table][chain]
        if index == len(rules):
            yield walk, None
            return
        rule = rules[index]
        for branch, matched in _matches(rule, packet, walk):
            if not matched:
                yield from self._walk(table, chain, index + 1, packet, branch)
            else:
                yield from self._target(table, chain, index, rule, packet, branch)

    def _target(
        self, table: str, chain: str, index: int, rule: Rule, packet: Packet, walk: _Walk
    ) -> Iterator[tuple[_Walk, str | None]]:
        target = rule.target
        if target is None:
            yield from self._walk(table, chain, index + 1, packet, walk)
        elif target in self.tables[table]:
            entered = replace(walk, path=(*walk.path, f"{table} {target}"))
            for after, verdict in self._walk(table, target, 0, packet, entered):
                if verdict is None:
                    yield from self._walk(table, chain, index + 1, packet, after)
                else:
                    yield after, verdict
        elif target == "RETURN":
            yield walk, None
        elif target in VERDICTS:
            yield walk, target
        elif target == "MARK":
            value, mask = _xmark(rule.target_options[0])
            marked = replace(walk, mark=(walk.mark & ~mask) ^ value)
            yield from self._walk(table, chain, index + 1, packet, marked)
        elif target == "DNAT" and table == "nat":
            to = dict((o.name, o.value) for o in rule.target_options)["--to-destination"]
            assert to is not None
            ip, port = _split_address(to, walk.port)
            yield replace(walk, dnat=to, dst=ip, port=port), "DNAT"
        elif target == "MASQUERADE" and table == "nat":
            yield replace(walk, masquerade=True), "MASQUERADE"
        else:
            raise UnknownRule(f"unknown target {target} in {table}: {rule.text}")


def _outcome(walk: _Walk, verdict: str) -> Outcome:
    return Outcome(
        probability=walk.probability,
        path=walk.path,
        dnat=walk.dnat,
        masquerade=walk.masquerade,
        verdict=verdict,
        recent_checks=walk.recent_checks,
        recent_sets=walk.recent_sets,
    )


def _split_address(to: str, port: int) -> tuple[str, int]:
    if to.startswith("["):
        host, _, rest = to[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else port
    if to.count(":") == 1:
        host, _, number = to.partition(":")
        return host, int(number)
    return to, port


def _apply_line(table: str, chains: dict[str, list[Rule]], line: str) -> None:
    if line.startswith(":"):
        name, policy = [*line[1:].split(), "-"][:2]
        if name in BUILTIN_CHAINS[table]:
            if policy not in ("ACCEPT", "DROP"):
                raise RestoreError(f"bad policy {policy} for {name}")
            if policy != "ACCEPT":
                raise UnknownRule(f"policy {policy} of {name} is not modelled")
            return  # --noflush keeps a builtin chain's rules
        chains[name] = []  # created, or flushed when it exists
        return
    words = line.split()
    if words[0] == "-X":
        name = words[1]
        if name not in chains or name in BUILTIN_CHAINS[table]:
            raise RestoreError(f"-X {name}: no such user chain")
        if chains[name]:
            raise RestoreError(f"-X {name}: chain is not empty")
        users = [r.text for rules in chains.values() for r in rules if r.target == name]
        if users:
            raise RestoreError(f"-X {name}: still referenced by {users[0]}")
        del chains[name]
        return
    rule = parse_rule(line)
    if rule.chain not in chains:
        raise RestoreError(f"{words[0]} {rule.chain}: no such chain")
    if words[0] == "-A":
        chains[rule.chain].append(rule)
    else:
        position = int(words[2]) if words[2].isdigit() else 1
        chains[rule.chain].insert(position - 1, rule)


def _check_jumps(table: str, chains: dict[str, list[Rule]]) -> None:
    for rules in chains.values():
        for rule in rules:
            target = rule.target
            if target is None or target in chains or target in TARGET_OPTIONS:
                continue
            raise RestoreError(f"jump to missing chain {target}: {rule.text}")


# --- matching --------------------------------------------------------------------------


def _matches(rule: Rule, packet: Packet, walk: _Walk) -> list[tuple[_Walk, bool]]:
    """Evaluate the rule's matches in order: [(state, matched)], more than one when a
    `statistic` or `recent --rcheck` forks the walk."""
    if not _general(rule, packet, walk):
        return [(walk, False)]
    branches = [(walk, True)]
    for match in rule.matches:
        out: list[tuple[_Walk, bool]] = []
        for state, ok in branches:
            out.extend(_module(match, rule, packet, state) if ok else [(state, False)])
        branches = [(s, ok) for s, ok in out if s.probability > 0]
    return branches


def _general(rule: Rule, packet: Packet, walk: _Walk) -> bool:
    def check(spec: tuple[str, bool] | None, test: bool) -> bool:
        return spec is None or test != spec[1]

    def inside(address: str, spec: tuple[str, bool] | None) -> bool:
        if spec is None:
            return True
        network = ipaddress.ip_network(spec[0], strict=False)
        ip = ipaddress.ip_address(address)
        return ip.version == network.version and ip in network

    interface = rule.in_interface
    return (
        check(rule.source, inside(packet.src, rule.source))
        and check(rule.destination, inside(walk.dst, rule.destination))
        and check(rule.protocol, rule.protocol is not None and rule.protocol[0] == packet.protocol)
        and check(interface, interface is not None and _interface(interface[0], packet))
    )


def _interface(pattern: str, packet: Packet) -> bool:
    if packet.in_interface is None:
        return False
    if pattern.endswith("+"):
        return packet.in_interface.startswith(pattern[:-1])
    return packet.in_interface == pattern


def _module(match: Match, rule: Rule, packet: Packet, walk: _Walk) -> list[tuple[_Walk, bool]]:
    module = match.module
    if module == "comment":
        return [(walk, True)]
    if module == "statistic":
        if match.get("--mode") != "random" or any(o.negated for o in match.options):
            raise UnknownRule(f"only `statistic --mode random` is modelled: {rule.text}")
        p = float(match.get("--probability") or "nan")
        return [
            (replace(walk, probability=walk.probability * p), True),
            (replace(walk, probability=walk.probability * (1 - p)), False),
        ]
    if module == "recent":
        return _recent(match, rule, walk)
    ok = True
    for option in match.options:
        if module in ("tcp", "udp", "sctp"):
            if ":" in (option.value or "") or "," in (option.value or ""):
                raise UnknownRule(f"port ranges are not modelled: {rule.text}")
            test = module == packet.protocol and int(option.value or "0") == walk.port
        elif module == "addrtype":
            if option.value != "LOCAL":
                raise UnknownRule(f"only --src-type LOCAL is modelled: {rule.text}")
            test = packet.src_local
        elif module == "mark":
            value, _, mask = (option.value or "").partition("/")
            test = walk.mark & int(mask or "0xffffffff", 0) == int(value, 0)
        elif module == "conntrack":
            test = packet.ctstate in (option.value or "").split(",")
        else:
            raise UnknownRule(f"unknown match {module}: {rule.text}")
        ok = ok and test != option.negated
    return [(walk, ok)]


def _recent(match: Match, rule: Rule, walk: _Walk) -> list[tuple[_Walk, bool]]:
    name = match.get("--name") or "DEFAULT"
    if any(o.negated for o in match.options) or not match.has("--rsource"):
        raise UnknownRule(f"only `recent --rsource` without negation is modelled: {rule.text}")
    if match.has("--set"):
        return [(replace(walk, recent_sets=(*walk.recent_sets, name)), True)]
    if match.has("--rcheck"):
        seconds = match.get("--seconds")
        timeout = int(seconds) if seconds is not None else None

        def assumed(remembered: bool) -> _Walk:
            check = RecentCheck(name, timeout, remembered)
            return replace(walk, recent_checks=(*walk.recent_checks, check))

        return [(assumed(True), True), (assumed(False), False)]
    raise UnknownRule(f"only recent --set and --rcheck are modelled: {rule.text}")


# --- convenience -----------------------------------------------------------------------


def jump_document() -> str:
    """Our jump rules from the builtin chains (dataplane.JUMPS) as a restore input, so a
    trace starts where the kernel starts: PREROUTING, OUTPUT, INPUT, FORWARD."""
    from .dataplane import JUMPS

    sections: dict[str, list[str]] = {"nat": [], "filter": []}
    for table, builtin, chain, position, extra, comment in JUMPS:
        verb = f"-I {builtin} 1" if position == "insert" else f"-A {builtin}"
        sections[table].append(f"{verb} {extra} -m comment --comment {shlex.quote(comment)} "
                               f"-j {chain}".replace("  ", " "))  # fmt: skip
    lines = []
    for table, rules in sections.items():
        lines += [f"*{table}", *rules, "COMMIT"]
    return "\n".join(lines) + "\n"


def load(text: str, local_addresses: tuple[str, ...] = (), *, jumps: bool = True) -> Ruleset:
    """A Ruleset holding a rendered document (plus our jump rules unless told not to)."""
    ruleset = Ruleset(local_addresses)
    ruleset.restore(text)
    if jumps:
        ruleset.restore(jump_document())
    return ruleset


def ours(saved: dict[str, list[str]]) -> str:
    """The part of an `iptables-save` dump (lines per table, nat and filter) this model
    reads: our KBP- chains with their rules and the builtin chains' jumps into them.
    Other rules are not modelled (they may use any match), so a trace follows ours."""
    lines = []
    for table in ("nat", "filter"):
        lines.append(f"*{table}")
        for line in saved.get(table, []):
            chain_of_ours = line.startswith((":KBP-", "-A KBP-"))
            jump = line.startswith("-A ") and (" -j KBP-" in line or " -g KBP-" in line)
            if chain_of_ours or jump:
                lines.append(line)
        lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def live(
    family: str,
    local_addresses: tuple[str, ...],
    netns: str | None = None,
    backend: Backend | None = None,
) -> Ruleset:
    """The rules this network namespace holds for a family (IPv4 | IPv6), ours only, in
    `backend` (None: the one `--iptables-backend auto` picks)."""
    from .dataplane import backend_or_auto, saved_tables

    ruleset = Ruleset(local_addresses)
    ruleset.restore(ours(saved_tables(family, netns, backend_or_auto(backend, netns))))
    return ruleset
