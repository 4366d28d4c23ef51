"""kube-proxy's state in this network namespace: found, reported, and removed on request.

Nobody starts this agent on an empty node: kube-proxy served it before. What kube-proxy
leaves in the kernel keeps translating beside our dataplane until it is removed:

* iptables (its iptables and ipvs modes), in either backend (iptables-legacy,
  iptables-nft) and both families: the chains named in KUBE_PROXY_CHAINS and those
  starting with one of SERVICE_CHAIN_PREFIXES, and the rules of other chains that jump
  to them (PREROUTING/OUTPUT -> KUBE-SERVICES, POSTROUTING -> KUBE-POSTROUTING, ...);
* nftables (its nftables mode): the tables `ip kube-proxy` and `ip6 kube-proxy`;
* IPVS (its ipvs mode): virtual servers (/proc/net/ip_vs) and the dummy link
  `kube-ipvs0` holding the Service addresses.

`remove` takes them away as `kube-proxy --cleanup` does. Chains kubelet owns
(KUBE-FIREWALL, KUBE-KUBELET-CANARY, KUBE-IPTABLES-HINT, KUBE-MARK-DROP) and this agent's
own KBP- chains are never touched, nor the kernel's conntrack entries: a connection
kube-proxy's rules translated keeps its NAT, since netfilter consults the nat table only
for a connection's first packet.

Everything runs in this process's network namespace (as the agent does), or in `netns`.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .dataplane.iptables.backend import Backend, run_command
from .dataplane.iptables.dataplane import installed_backends
from .dataplane.iptables.render import FAMILIES

log = logging.getLogger("kube-bpf-proxy")

ABSENT, PRESENT, REMOVED = "absent", "present", "removed"
# The chains kube-proxy creates under fixed names (iptables and ipvs modes).
KUBE_PROXY_CHAINS = frozenset({
    "KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING",
    "KUBE-FORWARD", "KUBE-PROXY-FIREWALL", "KUBE-PROXY-CANARY", "KUBE-MARK-MASQ",
    "KUBE-LOAD-BALANCER", "KUBE-NODE-PORT", "KUBE-IPVS-FILTER", "KUBE-IPVS-OUT-FILTER",
})  # fmt: skip
# Per Service port and endpoint: KUBE-SVC-, KUBE-SEP-, KUBE-EXT-, KUBE-FW-, KUBE-SVL-, and
# KUBE-XLB- of older releases.
SERVICE_CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SEP-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SVL-",
                          "KUBE-XLB-")  # fmt: skip
NFT_TABLE = "kube-proxy"
NFT_FAMILIES = ("ip", "ip6")
IPVS_LINK = "kube-ipvs0"
IPVS_PROC = Path("/proc/net/ip_vs")  # /proc/net follows the reader's network namespace
LOCK_WAIT = "5"
# The metric's kinds (kbp_kube_proxy_rules{kind}).
KINDS = ("iptables-legacy", "iptables-nft", "nftables", "ipvs")


def kube_proxy_chain(name: str) -> bool:
    """A chain kube-proxy owns (not kubelet's KUBE- chains, not ours)."""
    return name in KUBE_PROXY_CHAINS or name.startswith(SERVICE_CHAIN_PREFIXES)


@dataclass
class Found:
    """What of kube-proxy's state one look found. `chains`: per iptables backend
    ("iptables-nft", "iptables-legacy"), the "IPv4 nat KUBE-SERVICES"-style names;
    `nft_tables`: "ip kube-proxy"; `ipvs_services`: virtual servers; `ipvs_link`: whether
    kube-ipvs0 exists. `errors`: what could not be read (then counted as absent)."""

    chains: dict[str, list[str]] = field(default_factory=dict)
    nft_tables: list[str] = field(default_factory=list)
    ipvs_services: int = 0
    ipvs_link: bool = False
    errors: list[str] = field(default_factory=list)

    @property
    def present(self) -> bool:
        return bool(any(self.chains.values()) or self.nft_tables or self.ipvs_services
                    or self.ipvs_link)  # fmt: skip

    def counts(self) -> dict[str, int]:
        """Per metric kind: iptables chains per backend, nftables tables, IPVS virtual
        servers plus the kube-ipvs0 link."""
        counts = dict.fromkeys(KINDS, 0)
        for kind, chains in self.chains.items():
            counts[kind] = len(chains)
        counts["nftables"] = len(self.nft_tables)
        counts["ipvs"] = self.ipvs_services + int(self.ipvs_link)
        return counts

    def summary(self) -> str:
        """One line: what was found, per kind."""
        parts = [f"{kind}: {len(chains)} chain(s)" for kind, chains in self.chains.items()
                 if chains]  # fmt: skip
        if self.nft_tables:
            parts.append("nftables: table(s) " + ", ".join(self.nft_tables))
        if self.ipvs_services or self.ipvs_link:
            link = f", link {IPVS_LINK}" if self.ipvs_link else ""
            parts.append(f"ipvs: {self.ipvs_services} virtual server(s){link}")
        return "; ".join(parts) or "nothing"

    def to_dict(self) -> dict[str, object]:
        return {
            "iptables": {kind: len(chains) for kind, chains in self.chains.items() if chains},
            "nftables": list(self.nft_tables),
            "ipvsVirtualServers": self.ipvs_services,
            "ipvsLink": self.ipvs_link,
            **({"errors": list(self.errors)} if self.errors else {}),
        }


Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def _runner(netns: str | None) -> Runner:
    return lambda argv, stdin=None: run_command(netns, argv, stdin)  # type: ignore[misc]


def _kind(backend: Backend) -> str:
    return f"iptables-{backend.name}"


def _saved(run: Runner, backend: Backend, family: str) -> dict[str, list[str]]:
    """`iptables-save` (no -t: it creates no table) of one backend and family, by table."""
    save = backend.save(family)
    proc = run([save])
    if proc.returncode != 0:
        raise OSError(f"{save}: {proc.stderr.strip()}")
    tables: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in proc.stdout.splitlines():
        if line.startswith("*"):
            lines = tables.setdefault(line[1:].strip(), [])
        elif line and not line.startswith("#") and line != "COMMIT":
            lines.append(line)
    return tables


def _chains(lines: list[str]) -> list[str]:
    return [line[1:].split(" ", 1)[0] for line in lines if line.startswith(":")
            and kube_proxy_chain(line[1:].split(" ", 1)[0])]  # fmt: skip


def _jumps(lines: list[str]) -> list[str]:
    """Rules of chains not kube-proxy's that jump (or go) to one of kube-proxy's."""
    out = []
    for line in lines:
        if not line.startswith("-A "):
            continue
        words = line.split()
        if kube_proxy_chain(words[1]):
            continue
        targets = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("-j", "-g")]
        if any(kube_proxy_chain(t) for t in targets):
            out.append(line)
    return out


def _nft_tables(run: Runner) -> list[str]:
    proc = run(["nft", "-j", "list", "tables"])
    if proc.returncode != 0:
        raise OSError(f"nft list tables: {proc.stderr.strip()}")
    items = json.loads(proc.stdout or "{}").get("nftables", [])
    return [f"{t['family']} {t['name']}" for item in items if (t := item.get("table"))
            and t.get("name") == NFT_TABLE and t.get("family") in NFT_FAMILIES]  # fmt: skip


def _ipvs_services(run: Runner, netns: str | None) -> int:
    """Virtual servers in /proc/net/ip_vs (absent: the ip_vs module is not loaded)."""
    proc = run(["cat", str(IPVS_PROC)]) if netns else None
    if proc is not None:
        text = proc.stdout if proc.returncode == 0 else ""
    else:
        try:
            text = IPVS_PROC.read_text()
        except OSError:
            text = ""
    return sum(1 for line in text.splitlines() if line.startswith(("TCP ", "UDP ", "SCTP ",
                                                                    "FWM ")))  # fmt: skip


def _ipvs_link(run: Runner) -> bool:
    proc = run(["ip", "-o", "link", "show", "dev", IPVS_LINK])
    return proc.returncode == 0 and IPVS_LINK in proc.stdout


def detect(netns: str | None = None) -> Found:
    """Look for kube-proxy's state (see the module's docstring); reads only."""
    run = _runner(netns)
    found = Found()
    for backend in installed_backends(netns):
        chains = found.chains.setdefault(_kind(backend), [])
        for family in FAMILIES:
            try:
                tables = _saved(run, backend, family)
            except (OSError, subprocess.SubprocessError) as err:
                found.errors.append(str(err))
                continue
            for table, lines in tables.items():
                chains.extend(f"{family} {table} {chain}" for chain in _chains(lines))
    if shutil.which("nft"):
        try:
            found.nft_tables = _nft_tables(run)
        except (OSError, subprocess.SubprocessError, ValueError) as err:
            found.errors.append(str(err))
    found.ipvs_services = _ipvs_services(run, netns)
    found.ipvs_link = _ipvs_link(run)
    return found


class RemoveError(Exception):
    """Part of kube-proxy's state could not be removed; the message says which."""


def remove(netns: str | None = None) -> list[str]:
    """Remove kube-proxy's state as `kube-proxy --cleanup` would: per iptables backend and
    family one `iptables-restore --noflush` that deletes the jumps into its chains and
    flushes and deletes them; its nftables tables; the IPVS virtual servers (with
    ipvsadm, when installed) and kube-ipvs0. Conntrack entries stay. Returns what went
    ("iptables-nft IPv4 nat KUBE-SERVICES", "nftables ip kube-proxy", ...); RemoveError
    after trying everything when something failed."""
    run = _runner(netns)
    removed: list[str] = []
    errors: list[str] = []
    for backend in installed_backends(netns):
        for family in FAMILIES:
            try:
                removed.extend(_remove_iptables(run, backend, family))
            except (OSError, subprocess.SubprocessError) as err:
                errors.append(str(err))
    if shutil.which("nft"):
        try:
            tables = _nft_tables(run)
        except (OSError, subprocess.SubprocessError, ValueError) as err:
            errors.append(str(err))
            tables = []
        for table in tables:
            proc = run(["nft", "delete", "table", *table.split()])
            if proc.returncode != 0:
                errors.append(f"nft delete table {table}: {proc.stderr.strip()}")
            else:
                removed.append(f"nftables {table}")
    if _ipvs_services(run, netns):
        if shutil.which("ipvsadm"):
            proc = run(["ipvsadm", "-C"])
            if proc.returncode != 0:
                errors.append(f"ipvsadm -C: {proc.stderr.strip()}")
            else:
                removed.append("ipvs virtual servers")
        else:
            errors.append("IPVS virtual servers remain: ipvsadm is not installed (run "
                          "`ipvsadm -C` on the node)")  # fmt: skip
    if _ipvs_link(run):
        proc = run(["ip", "link", "delete", "dev", IPVS_LINK])
        if proc.returncode != 0:
            errors.append(f"ip link delete {IPVS_LINK}: {proc.stderr.strip()}")
        else:
            removed.append(f"link {IPVS_LINK}")
    if errors:
        raise RemoveError("; ".join(errors))
    return removed


def _remove_iptables(run: Runner, backend: Backend, family: str) -> list[str]:
    tables = _saved(run, backend, family)
    lines: list[str] = []
    removed: list[str] = []
    kind = _kind(backend)
    for table, saved in tables.items():
        chains = _chains(saved)
        jumps = _jumps(saved)
        if not chains and not jumps:
            continue
        lines.append(f"*{table}")
        lines.extend("-D" + line[2:] for line in jumps)
        lines.extend(f":{chain} - [0:0]" for chain in chains)  # flushes it (--noflush)
        lines.extend(f"-X {chain}" for chain in chains)
        lines.append("COMMIT")
        removed.extend(f"{kind} {family} {table} {chain}" for chain in chains)
    if lines:
        restore = backend.restore(family)
        proc = run([restore, "-w", LOCK_WAIT, "--noflush"], "\n".join(lines) + "\n")
        if proc.returncode != 0:
            raise OSError(f"{restore}: {proc.stderr.strip()}")
    return removed


class KubeProxyWatch:
    """The agent's view of kube-proxy's state: looked at when the agent starts and on
    every full resync (at most once per `period`), reported through `report(state,
    found)`, and removed after the first complete apply when `remove_rules`."""

    def __init__(
        self,
        remove_rules: bool,
        report: Callable[[str, Found], None],
        period: float,
        clock: Callable[[], float],
        netns: str | None = None,
    ) -> None:
        self.remove_rules = remove_rules
        self._report = report
        self._period = period
        self._clock = clock
        self._netns = netns
        self._last: float | None = None
        self._applied = False
        self._removed = False
        self.state = ABSENT

    def check(self) -> None:
        """Look (and, after the first apply with remove_rules, remove); report."""
        self._last = self._clock()
        found = detect(self._netns)
        if found.present and self.remove_rules and self._applied:
            again = " again (is kube-proxy still running on this node?)" if self._removed else ""
            try:
                removed = remove(self._netns)
            except RemoveError as err:
                log.error("kube-proxy's rules: removing them%s failed: %s", again, err)
            else:
                log.info("kube-proxy's rules removed%s (%d item(s): %s); open connections "
                         "keep their conntrack entries", again, len(removed),
                         found.summary())  # fmt: skip
                self._removed = True
            found = detect(self._netns)
        if found.present:
            self.state = PRESENT
            if self.remove_rules and not self._applied:
                advice = ("they are removed once this agent has programmed the cluster's "
                          "state (--remove-kube-proxy-rules)")  # fmt: skip
            elif self.remove_rules:
                advice = "removing them failed; see the error above"
            else:
                advice = ("stop kube-proxy on this node (see docs/migration.md), then run "
                          "`kube-bpf-proxy cleanup --kube-proxy` or start the agent with "
                          "--remove-kube-proxy-rules")  # fmt: skip
            log.warning("kube-proxy's rules are present (%s): %s", found.summary(), advice)
        elif self._removed:
            self.state = REMOVED
        else:
            self.state = ABSENT
            if self._last is not None and not self._applied:
                log.info("kube-proxy's rules: none in this network namespace")
        for error in found.errors:
            log.warning("kube-proxy's rules: could not read: %s", error)
        self._report(self.state, found)

    def sync(self, state: object) -> None:
        """A sync-loop follower: after each successful apply; checks after the first one
        and then at most once per period (the periodic full resync)."""
        first = not self._applied
        self._applied = True
        if first or self._last is None or self._clock() - self._last >= self._period:
            self.check()
