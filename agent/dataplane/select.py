"""`--dataplane auto|ebpf|iptables|none`: build the dataplane and say why it was chosen."""

from __future__ import annotations

import logging

from ..config import Settings
from .base import Dataplane, DataplaneError
from .none import NoneDataplane

log = logging.getLogger(__name__)

# The iptables fallback arrives with issue #5; until then `auto` falls back to the dry run
# when eBPF cannot work here, and says why.
NOT_BUILT = "not part of this build yet"


class DataplaneUnavailable(ValueError):
    """An explicitly requested dataplane cannot be used as asked (a usage error)."""


class DataplaneStartError(Exception):
    """The requested dataplane failed to start here; the message says why."""


def build_ebpf(settings: Settings) -> Dataplane:
    """The eBPF dataplane on this network namespace's pod interfaces."""
    try:
        from .ebpf.dataplane import EbpfDataplane
        from .ebpf.plan import MapSizes
    except ImportError as err:  # bcc, cffi or pyroute2 missing
        raise DataplaneError("import", f"{err}; install python3-bpfcc and the agent") from err
    return EbpfDataplane(
        settings.bpffs,
        settings.pod_interfaces,
        MapSizes(**settings.map_sizes()),
        maglev_table_size=settings.maglev_table_size,
    )


def select_dataplane(settings: Settings) -> tuple[Dataplane, str]:
    """(dataplane, reason). Raises DataplaneUnavailable for a choice that cannot be built,
    DataplaneStartError when the requested dataplane failed to start."""
    requested = settings.dataplane
    if requested == "none":
        return NoneDataplane(), "requested"
    if requested == "iptables":
        raise DataplaneUnavailable(f"--dataplane iptables: {NOT_BUILT}; use ebpf or none")
    try:
        return build_ebpf(settings), "requested" if requested == "ebpf" else "eBPF works here"
    except DataplaneError as err:
        if requested == "ebpf":
            raise DataplaneStartError(f"--dataplane ebpf: {err}") from err
        reason = f"eBPF unavailable ({err.reason}: {err}); iptables is {NOT_BUILT}"
    log.warning("--dataplane auto: %s; running as a dry run (none): nothing is programmed", reason)
    return NoneDataplane(), reason
