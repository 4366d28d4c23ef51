"""Which iptables the iptables dataplane runs: the nf_tables variant (`iptables-nft`) or
the legacy one (`iptables-legacy`), the two sets of tools Debian's iptables package ships.

The two keep separate rule sets in the kernel, and both act on every packet: rules must
land in the backend kubelet and the CNI write to, or the node ends up with half its rules
in each (kube-proxy's image picks the backend the same way: whichever already holds
rules wins). `auto` decides, per network namespace, in this order:

1. kubelet's own marker: the chain KUBE-IPTABLES-HINT (or the older KUBE-KUBELET-CANARY),
   which kubelet creates in the mangle table of the backend it uses; if exactly one
   backend holds it, that one;
2. else the rules each backend holds, counted as `-A` lines of `iptables-save` and
   `ip6tables-save` over all tables, leaving out kube-bpf-proxy's own (rules in KBP-
   chains and jumps to them: an earlier agent's choice must not decide for the node);
   more rules wins;
3. a tie (typically none on either side) is nft, the default of current distributions.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from .render import FAMILIES, IPV4, PREFIX

NFT = "nft"
LEGACY = "legacy"
BACKENDS = (NFT, LEGACY)  # options.BACKEND_CHOICES: auto and these
# What `iptables -V` prints after the version for each variant: "(nf_tables)", "(legacy)".
VARIANT = {NFT: "nf_tables", LEGACY: "legacy"}
# Chains kubelet creates in the mangle table of the iptables backend it uses, for
# components that must find that backend (KUBE-IPTABLES-HINT since Kubernetes 1.24).
KUBELET_HINTS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY")
COMMAND_TIMEOUT = 300.0


def command(netns: str | None, argv: Sequence[str]) -> list[str]:
    """argv run in the named network namespace (None: this process's)."""
    if netns is None:
        return list(argv)
    return ["nsenter", f"--net=/run/netns/{netns}", "--", *argv]


def run_command(
    netns: str | None, argv: Sequence[str], stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command(netns, argv),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )


@dataclass(frozen=True)
class Backend:
    """One iptables backend's tools. `suffix` is "-nft" or "-legacy" where Debian's
    suffixed tools exist, "" where only the plain ones do and they are this variant."""

    name: str  # nft | legacy
    suffix: str

    def iptables(self, family: str) -> str:
        return ("iptables" if family == IPV4 else "ip6tables") + self.suffix

    def save(self, family: str) -> str:
        return self.iptables(family) + "-save"

    def restore(self, family: str) -> str:
        return self.iptables(family) + "-restore"

    def tools(self) -> list[str]:
        return [t for f in FAMILIES for t in (self.iptables(f), self.save(f), self.restore(f))]

    @property
    def nf_tables(self) -> bool:
        return self.name == NFT


def find_backend(name: str, netns: str | None = None) -> Backend | None:
    """The tools of backend `name` on this host: Debian's suffixed ones (iptables-nft,
    iptables-legacy), else the plain `iptables` when `iptables -V` says it is that
    variant; None when neither is here."""
    suffixed = Backend(name, f"-{name}")
    if all(shutil.which(tool) for tool in suffixed.tools()):
        return suffixed
    plain = Backend(name, "")
    if not all(shutil.which(tool) for tool in plain.tools()):
        return None
    try:
        version = run_command(netns, ["iptables", "-V"]).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return plain if f"({VARIANT[name]})" in version else None


@dataclass(frozen=True)
class Census:
    """What one backend holds in a network namespace, for `auto`."""

    rules: int  # -A lines of other programs, both families, all tables
    hint: bool  # kubelet's hint chain is there
    error: str | None = None  # why it could not be read (it then counts as empty)


def census(backend: Backend, netns: str | None = None) -> Census:
    """Count the rules `backend` holds that are not ours, and look for kubelet's hint.
    `iptables-save` without -t only reads: it loads no table into the kernel."""
    rules, hint = 0, False
    for family in FAMILIES:
        try:
            proc = run_command(netns, [backend.save(family)])
        except (OSError, subprocess.SubprocessError) as err:
            return Census(rules, hint, f"{backend.save(family)}: {err}")
        if proc.returncode != 0:
            return Census(rules, hint, f"{backend.save(family)}: {proc.stderr.strip()}")
        for line in proc.stdout.splitlines():
            if line.startswith(":") and line[1:].split(" ", 1)[0] in KUBELET_HINTS:
                hint = True
            elif line.startswith("-A ") and not _ours(line):
                rules += 1
    return Census(rules, hint)


def _ours(line: str) -> bool:
    """A rule of a KBP- chain, or a jump into one."""
    return line.startswith(f"-A {PREFIX}") or f"-j {PREFIX}" in line or f"-g {PREFIX}" in line


def decide(found: dict[str, Census]) -> tuple[str, str]:
    """(backend name, the reason in one sentence) from each available backend's census;
    the rules of the module docstring."""
    if len(found) == 1:
        (name,) = found
        other = next(b for b in BACKENDS if b != name)
        return name, f"only the {name} tools are installed (no iptables-{other})"
    hinted = [name for name in BACKENDS if found[name].hint]
    if len(hinted) == 1:
        return hinted[0], f"kubelet's {KUBELET_HINTS[0]} chain is in the {hinted[0]} tables"
    counts = {name: found[name].rules for name in BACKENDS}
    unread = "".join(
        f" ({name} could not be read: {found[name].error})"
        for name in BACKENDS
        if found[name].error
    )
    tally = f"{counts[LEGACY]} rules in iptables-legacy, {counts[NFT]} in iptables-nft"
    if counts[LEGACY] > counts[NFT]:
        return LEGACY, f"{tally}, not counting kube-bpf-proxy's own{unread}"
    if counts[NFT] > counts[LEGACY]:
        return NFT, f"{tally}, not counting kube-bpf-proxy's own{unread}"
    return NFT, f"{tally} (a tie: nft, the default of current distributions){unread}"


class BackendError(Exception):
    """The requested backend's tools are missing; the message says which."""


def choose_backend(requested: str, netns: str | None = None) -> tuple[Backend, str]:
    """The backend for `--iptables-backend requested` and why (`requested`, or auto's
    reason). BackendError when the requested one, or with auto either one, is missing."""
    if requested != "auto":
        backend = find_backend(requested, netns)
        if backend is None:
            raise BackendError(
                f"iptables-{requested}-restore not found (install the iptables package)"
            )
        return backend, "requested"
    available = {name: b for name in BACKENDS if (b := find_backend(name, netns)) is not None}
    if not available:
        raise BackendError("neither iptables-nft nor iptables-legacy is installed "
                           "(install the iptables package)")  # fmt: skip
    name, reason = decide({name: census(b, netns) for name, b in available.items()})
    return available[name], reason


def backend_holding_ours(netns: str | None = None) -> Backend | None:
    """The backend whose tables hold kube-bpf-proxy's chains, for a reader with no agent to
    ask (explain): the one with a KBP-STATE marker (a completed restore) first, else one
    with any KBP- chain; nft before legacy on a tie; None when neither holds any. Reads
    with `iptables-save` without -t, which creates no table."""
    found: list[tuple[bool, Backend]] = []
    for name in BACKENDS:
        backend = find_backend(name, netns)
        if backend is None:
            continue
        chains: set[str] = set()
        for family in FAMILIES:
            try:
                proc = run_command(netns, [backend.save(family)])
            except (OSError, subprocess.SubprocessError):
                continue
            chains |= {
                line[1:].split(" ", 1)[0]
                for line in proc.stdout.splitlines()
                if line.startswith(":" + PREFIX)
            }
        if chains:
            found.append((f"{PREFIX}STATE" in chains, backend))
    marked = [backend for has_marker, backend in found if has_marker]
    return (marked or [backend for _, backend in found] or [None])[0]


def other_backend(backend: Backend, netns: str | None = None) -> Backend | None:
    """The backend `backend` is not, when its tools are here."""
    other = next(name for name in BACKENDS if name != backend.name)
    return find_backend(other, netns)
