"""The nftables dataplane's options, declared beside its code (agent/dataplane/options.py
says how; agent/config.py composes them into flags). Pure Python."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import pod_interfaces_option


@dataclass(frozen=True)
class NftablesOptions:
    pod_interfaces: tuple[str, ...] = pod_interfaces_option()
