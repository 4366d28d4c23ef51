"""Per-Service traffic at /metrics: the per-CPU kbp_counters (packets, bytes, new flows
per service id) and kbp_svc_drops (drops per service id and reason), summed over CPUs at
scrape time and labelled with the Service the id belongs to in the applied NodeState.

`--service-metrics` bounds the cardinality: `services` sums a Service's ports and
families into one series per Service, `ports` keeps one per (Service, port, protocol),
`none` registers nothing. Only the live ids are read, out of one batched read of the
counters array, so a scrape costs what the Services on this node cost, not the map size.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from typing import Any

from prometheus_client.core import CounterMetricFamily

from .abi import DROP_REASONS, family_of, ffi, packer
from .libbpf import Map, possible_cpus

log = logging.getLogger(__name__)

SERVICE_METRICS = ("none", "services", "ports")
PROTO_NUMBERS = {"TCP": 6, "UDP": 17, "SCTP": 132}

# service id -> labels (namespace, service[, port, protocol]), from the applied state
Labeller = Callable[[], dict[int, tuple[str, ...]]]

_COUNTERS = packer("kbp_counters")
_DROP_KEY = packer("kbp_svc_drop_key")
_U64 = struct.Struct("=Q")


class ServiceTrafficCollector:
    def __init__(self, counters: Map, drops: Map, labeller: Labeller, mode: str) -> None:
        if mode not in SERVICE_METRICS[1:]:
            raise ValueError(f"service metrics mode {mode!r}")
        self._counters = counters
        self._drops = drops
        self._labeller = labeller
        self.label_names = label_names(mode)
        self._stride = (ffi.sizeof("struct kbp_counters") + 7) // 8 * 8
        self._cpus = possible_cpus()

    def describe(self) -> list[CounterMetricFamily]:
        return self._families()

    def _families(self) -> list[CounterMetricFamily]:
        return families(self.label_names)

    def collect(self) -> list[CounterMetricFamily]:
        families = self._families()
        try:
            labels = self._labeller()
            sums = self.traffic(labels)
            drops = self.drops(labels)
        except OSError:
            log.exception("ebpf: reading the service counters for /metrics")
            return families
        packets, size, new, dropped = families
        for key, (p, b, n) in sorted(sums.items()):
            packets.add_metric(list(key), p)
            size.add_metric(list(key), b)
            new.add_metric(list(key), n)
        for (key, reason), count in sorted(drops.items()):
            dropped.add_metric([*key, reason], count)
        return families

    def traffic(self, labels: dict[int, tuple[str, ...]]) -> dict[tuple[str, ...], list[int]]:
        """labels -> [packets, bytes, new flows], summed over CPUs and over the ids that
        share labels."""
        out: dict[tuple[str, ...], list[int]] = {}
        if not labels:
            return out
        raw = self._counters.values_array(max(labels) + 1)
        per_id = self._stride * self._cpus
        unpack = _COUNTERS.unpack_from
        for service_id, key in labels.items():
            base = service_id * per_id
            sums = out.setdefault(key, [0, 0, 0])
            for cpu in range(self._cpus):
                p, b, n, _drops = unpack(raw, base + cpu * self._stride)
                sums[0] += p
                sums[1] += b
                sums[2] += n
        return out

    def drops(self, labels: dict[int, tuple[str, ...]]) -> dict[tuple[tuple[str, ...], str], int]:
        out: dict[tuple[tuple[str, ...], str], int] = {}
        for k, v in self._drops.items():
            service_id, reason = _DROP_KEY.unpack(k)
            key = labels.get(service_id)
            if key is None:
                continue
            total = sum(_U64.unpack_from(v, i * 8)[0] for i in range(len(v) // 8))
            name = (key, DROP_REASONS.get(reason, str(reason)))
            out[name] = out.get(name, 0) + total
        return out


def label_names(mode: str) -> list[str]:
    return ["namespace", "service"] + (["port", "protocol"] if mode == "ports" else [])


def families(names: list[str]) -> list[CounterMetricFamily]:
    """The metric families, empty, with these label names (and `reason` for drops)."""
    return [
        CounterMetricFamily("kbp_service_packets", "Packets translated for the Service, "
                            "both directions (eBPF).", labels=names),
        CounterMetricFamily("kbp_service_bytes", "Bytes of those packets, L2 included "
                            "(eBPF).", labels=names),
        CounterMetricFamily("kbp_service_new_connections", "Backend selections: new "
                            "connections (flows) to the Service (eBPF).", labels=names),
        CounterMetricFamily("kbp_service_drops", "Packets to the Service dropped or "
                            "refused, by reason (eBPF).", labels=[*names, "reason"]),
    ]  # fmt: skip


def labels_of(entries: Any, services: Any, mode: str) -> dict[int, tuple[str, ...]]:
    """service id -> labels, for NodeState entries whose ClusterIP frontend the kernel
    content (`services`: FrontendKey -> ServiceValue) holds."""
    from .plan import FrontendKey

    out: dict[int, tuple[str, ...]] = {}
    for entry in entries:
        fe = entry.frontends[0]
        value = services.get(
            FrontendKey(fe.ip, fe.port, PROTO_NUMBERS[entry.protocol], family_of(fe.ip))
        )
        if value is None:
            continue
        key = (entry.namespace, entry.name)
        out[value.service_id] = key + ((entry.port, entry.protocol) if mode == "ports" else ())
    return out


def drop_keys(service_ids: list[int]) -> list[bytes]:
    """kbp_svc_drops keys of these ids, every reason: what a reused id must not inherit."""
    return [_DROP_KEY.pack(i, r) for i in service_ids for r in DROP_REASONS]
