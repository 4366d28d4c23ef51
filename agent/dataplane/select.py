"""`--dataplane auto|ebpf|iptables|none`: build the dataplane and say why it was chosen."""

from __future__ import annotations

import logging

from .base import Dataplane
from .none import NoneDataplane

log = logging.getLogger(__name__)

# Kernel dataplanes arrive with their issues (eBPF: #3, iptables: #5); until then `auto`
# can only fall back to the dry run, and says so.
NOT_BUILT = "not part of this build yet"


class DataplaneUnavailable(ValueError):
    pass


def select_dataplane(requested: str) -> tuple[Dataplane, str]:
    """(dataplane, reason). Raises DataplaneUnavailable when an explicit choice cannot work."""
    if requested == "none":
        return NoneDataplane(), "requested"
    if requested in ("ebpf", "iptables"):
        raise DataplaneUnavailable(f"--dataplane {requested}: {NOT_BUILT}; use --dataplane none")
    reason = f"no kernel dataplane: ebpf and iptables are {NOT_BUILT}"
    log.warning("--dataplane auto: %s; running as a dry run (none): nothing is programmed", reason)
    return NoneDataplane(), reason
