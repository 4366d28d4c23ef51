"""The iptables dataplane's options, declared beside its code (agent/dataplane/options.py
says how; agent/config.py composes them into flags): the pod interfaces and which
iptables backend it writes to. Pure Python: the CLI imports it for its flags."""

from __future__ import annotations

from dataclasses import dataclass

from ..options import option, pod_interfaces_option

# --iptables-backend: auto, or one of backend.BACKENDS (nft, legacy).
BACKEND_CHOICES = ("auto", "nft", "legacy")


# fmt: off
@dataclass(frozen=True)
class IptablesOptions:
    pod_interfaces: tuple[str, ...] = pod_interfaces_option()
    backend: str = option("auto", "--iptables-backend",
        "which iptables the iptables dataplane writes to: auto uses the backend that "
        "already holds the node's rules (kubelet's, the CNI's), nft when neither does",
        choices=BACKEND_CHOICES)
# fmt: on
