"""`--dataplane auto|ebpf|nftables|iptables|none`: probe the kernel, build the dataplane,
say why it was chosen, and remove what the other kernel dataplanes left on this node once
the chosen one has programmed its first state (until then the others keep serving: a
restart that switches dataplanes while the API server is unreachable must not blank the
node). `auto`: eBPF when every probe passes, else nftables where the kernel has nf_tables
(its transactions do not grow with the number of Services; iptables-nft's restore does),
else iptables."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType

from . import probe
from .base import Dataplane, DataplaneError
from .ebpf.options import EbpfOptions
from .iptables.options import IptablesOptions
from .mounts import cgroup_for_hooks
from .nftables.options import NftablesOptions
from .none import NoneDataplane
from .options import nested, option

log = logging.getLogger(__name__)

# `auto` chose eBPF: every probe passed.
EBPF_PROBES_PASSED = "eBPF probes passed"


# fmt: off
@dataclass(frozen=True)
class DataplaneOptions:
    """What `select_dataplane` is told: which dataplane, and each one's options
    (config.Settings.dataplane_options() composes them from the settings)."""

    dataplane: str = option("auto", "--dataplane",
        "what programs the NodeState: auto picks the best available (eBPF, else nftables "
        "where the kernel has nf_tables, else iptables) and says why; none compiles and "
        "serves it without programming anything (a dry run)",
        choices=("auto", "ebpf", "nftables", "iptables", "none"))
    cgroup_root: str = option("auto", "--cgroup-root",
        "cgroup (v2) whose processes the eBPF dataplane's socket hooks serve: connect() "
        "and sendmsg() of the node's own processes to a Service go straight to a "
        "backend; auto: the cgroup2 mount's root (every process); none: off",
        "DIR|auto|none", check=lambda path: _cgroup_root(path))
    ebpf: EbpfOptions = nested(EbpfOptions)  # its cgroup: from cgroup_root (build_ebpf)
    iptables: IptablesOptions = nested(IptablesOptions)
    nftables: NftablesOptions = nested(NftablesOptions)
# fmt: on


def _cgroup_root(path: str) -> None:
    if path not in ("auto", "none") and not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")


class DataplaneStartError(Exception):
    """The requested dataplane failed to start here; the message says why."""


@dataclass
class Selection:
    """The chosen dataplane, why, and what the other kernel dataplane left behind, to
    remove after the chosen one's first successful apply (`take_over`)."""

    dataplane: Dataplane
    reason: str
    other: str | None = None  # "ebpf and nftables", ...: whose leftovers take_over removes
    _remove: Callable[[], list[str]] | None = None

    def take_over(self) -> None:
        """Remove the other dataplane's leftovers (once; best effort, logged)."""
        remove, self._remove = self._remove, None
        if remove is not None and self.other is not None:
            remove_leftovers(self.other, remove)


def build_ebpf(options: DataplaneOptions) -> Dataplane:
    """The eBPF dataplane on this network namespace's pod interfaces."""
    try:
        from .ebpf.dataplane import EbpfDataplane
    except ImportError as err:  # bcc, cffi or pyroute2 missing
        raise DataplaneError("import", f"{err}; install python3-bpfcc and the agent") from err
    cgroup, why = cgroup_for_hooks(options.cgroup_root)
    if why:
        log.warning("ebpf: %s", why)
    return EbpfDataplane(replace(options.ebpf, cgroup=cgroup, explain_build=True))


def iptables_module() -> ModuleType:
    """agent.dataplane.iptables.dataplane, imported only when iptables is considered."""
    from .iptables import dataplane

    return dataplane


def build_iptables(options: DataplaneOptions) -> Dataplane:
    """The iptables dataplane in this network namespace; DataplaneError saying why not."""
    try:
        module = iptables_module()
    except ImportError as err:
        raise DataplaneError("import", f"cannot import the iptables dataplane: {err}") from err
    try:
        backend, why = module.choose_backend(options.iptables.backend)
    except module.BackendError as err:
        raise DataplaneError("unavailable", str(err)) from err
    reason = module.unavailable_reason(backend=backend)
    if reason is not None:
        raise DataplaneError("unavailable", reason)
    log.info("iptables backend: %s (%s)", backend.name, why)
    try:
        return module.IptablesDataplane(options.iptables.pod_interfaces, backend=backend,
                                        backend_reason=why)  # fmt: skip
    except OSError as err:
        raise DataplaneError("start", str(err)) from err


def nftables_module() -> ModuleType:
    """agent.dataplane.nftables.dataplane, imported only when nftables is considered."""
    from .nftables import dataplane

    return dataplane


def build_nftables(options: DataplaneOptions) -> Dataplane:
    """The nftables dataplane in this network namespace; DataplaneError saying why not."""
    try:
        module = nftables_module()
    except ImportError as err:
        raise DataplaneError("import", f"cannot import the nftables dataplane: {err}") from err
    reason = module.unavailable_reason()
    if reason is not None:
        raise DataplaneError("unavailable", reason)
    try:
        return module.NftablesDataplane(options.nftables.pod_interfaces)
    except (OSError, DataplaneError) as err:
        raise DataplaneError("start", str(err)) from err


KERNEL_DATAPLANES = ("ebpf", "nftables", "iptables")


def _others(options: DataplaneOptions, chosen: str) -> tuple[str, Callable[[], list[str]]]:
    """Whose leftovers the `chosen` dataplane removes, and how."""
    removers: dict[str, Callable[[], list[str]]] = {
        "ebpf": lambda: remove_ebpf_leftovers(options.ebpf.pin_dir),
        "nftables": remove_nftables_leftovers,
        "iptables": remove_iptables_leftovers,
    }
    others = [name for name in KERNEL_DATAPLANES if name != chosen]

    def remove() -> list[str]:
        removed: list[str] = []
        for name in others:  # each even when another failed
            try:
                removed += removers[name]()
            except Exception as err:
                log.warning("could not remove what the %s dataplane left behind: %s", name, err)
        return removed

    return " and ".join(others), remove


def select_dataplane(options: DataplaneOptions) -> Selection:
    """The dataplane and the reason. `auto`: eBPF when every probe passes, else nftables
    where it works, else iptables, the reason naming what failed and why. Raises
    DataplaneStartError when an explicitly requested dataplane cannot start here, or with
    `auto` when none can."""
    requested = options.dataplane

    if requested == "none":
        return Selection(NoneDataplane(), "requested")
    if requested in ("iptables", "nftables"):
        build = build_iptables if requested == "iptables" else build_nftables
        try:
            dataplane = build(options)
        except DataplaneError as err:
            raise DataplaneStartError(f"--dataplane {requested}: {err}") from err
        return Selection(dataplane, "requested", *_others(options, requested))

    ebpf, results = probe.probe_ebpf(lambda: build_ebpf(options), options.ebpf.pin_dir)
    if ebpf is not None:
        reason = "requested" if requested == "ebpf" else EBPF_PROBES_PASSED
        return Selection(ebpf, reason, *_others(options, "ebpf"))
    failure = results[-1]
    if requested == "ebpf":
        raise DataplaneStartError(f"--dataplane ebpf: {failure.name}: {failure.detail}")

    ebpf_reason = f"eBPF unavailable: {failure}"
    # The log line says the whole reason (the selection's reason, a label, is bounded): a
    # pin of someone else's is named with its path there.
    detail = " ".join(failure.detail.split()) or failure.failure
    try:
        dataplane = build_nftables(options)
    except DataplaneError as nft_err:
        try:
            dataplane = build_iptables(options)
        except DataplaneError as err:
            # Running as a dry run would program nothing while looking healthy and ready:
            # refuse to start, so the node's state shows it (use --dataplane none on purpose).
            raise DataplaneStartError(
                f"--dataplane auto: no dataplane can run here: {ebpf_reason}; "
                f"nftables unavailable: {nft_err}; iptables unavailable: {err}"
            ) from err
        log.warning("--dataplane auto: eBPF unavailable: %s: %s; nftables unavailable: %s; "
                    "falling back to iptables", failure.name, detail, nft_err)  # fmt: skip
        return Selection(dataplane, f"{ebpf_reason}; nftables unavailable: {nft_err}",
                         *_others(options, "iptables"))  # fmt: skip
    log.warning("--dataplane auto: eBPF unavailable: %s: %s; falling back to nftables",
                failure.name, detail)  # fmt: skip
    return Selection(dataplane, ebpf_reason, *_others(options, "nftables"))


# Switching dataplanes leaves nothing of the other behind (as kube-proxy removes other
# modes' rules when it starts): left in place, stale eBPF filters would translate pod
# traffic before iptables saw it, and stale KBP- chains would keep answering for Services.
# It happens after the chosen dataplane's first apply, not at start: until then the other
# one's rules are what serves the node.


def remove_ebpf_leftovers(pin_dir: Path) -> list[str]:
    """Our tc filters in this namespace and our pins under --bpffs; what was removed."""
    from .ebpf.dataplane import cleanup

    interfaces, pins = cleanup(pin_dir)
    return [*(f"tc filters on {name}" for name in interfaces), *(f"pin {pin}" for pin in pins)]


def remove_nftables_leftovers() -> list[str]:
    """Our nftables tables in this namespace; nothing when nft is absent."""
    return list(nftables_module().cleanup())


def remove_iptables_leftovers() -> list[str]:
    """Our jump rules and KBP- chains in this namespace, from both iptables backends;
    nothing when iptables is absent (nothing of ours can be there then)."""
    return list(iptables_module().cleanup())


def remove_leftovers(dataplane: str, remove: Callable[[], list[str]]) -> None:
    """Best effort: a failure is logged, the chosen dataplane starts anyway."""
    try:
        removed = remove()
    except Exception as err:
        log.warning("could not remove what the %s dataplane left behind: %s", dataplane, err)
        return
    if removed:
        log.info("removed what the %s dataplane left behind: %s", dataplane, ", ".join(removed))
