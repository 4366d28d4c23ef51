"""Per-Service traffic at /metrics: the per-CPU kbp_counters (packets, bytes, new flows
per service id) and kbp_svc_drops (drops per service id and reason), summed over CPUs at
scrape time and labelled with the Service the id belongs to in the applied NodeState.

`--service-metrics` bounds the cardinality: `services` sums a Service's ports and
families into one series per Service, `ports` keeps one per (Service, port, protocol),
`none` renders nothing. Only the live prefix of the counters array is read, in one
batched read, so a scrape costs what the Services on this node cost, not the map size.
"""

from __future__ import annotations

import functools
import logging
import operator
import struct
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily

from ...gcpause import gc_paused
from .abi import DROP_REASONS, PROTOCOLS, family_of, packer
from .libbpf import Map, possible_cpus

log = logging.getLogger(__name__)

SERVICE_METRICS = ("none", "services", "ports")

# service id -> labels (namespace, service[, port, protocol]), from the applied state
Labeller = Callable[[], dict[int, tuple[str, ...]]]

_COUNTERS = packer("kbp_counters")
_DROP_KEY = packer("kbp_svc_drop_key")
_U64 = struct.Struct("=Q")


class ServiceTraffic:
    """Renders the per-Service series as exposition text at each scrape (see `render`).

    prometheus_client builds an object per sample and formats each in Python: about 35 µs
    a series on this machine, over a second for the 30k series of 10k Services. Here the
    label text of every id is built once per applied revision, the counters are decoded
    with one `iter_unpack` over the batched read, and each line is one f-string.
    """

    def __init__(self, counters: Map, drops: Map, labeller: Labeller, mode: str) -> None:
        if mode not in SERVICE_METRICS[1:]:
            raise ValueError(f"service metrics mode {mode!r}")
        self._counters = counters
        self._drops = drops
        self._labeller = labeller
        self.label_names = label_names(mode)
        self._stride = (_COUNTERS.size + 7) // 8 * 8
        self._cpus = possible_cpus()
        self._labels_of: dict[int, tuple[str, ...]] | None = None
        self._text: dict[tuple[str, ...], str] = {}  # labels -> `{namespace="…",…}`
        self._prefixes: list[dict[tuple[str, ...], str]] = [{}, {}, {}]  # `name{…} ` per family

    def _label_text(self, labels: dict[int, tuple[str, ...]]) -> dict[tuple[str, ...], str]:
        if labels is not self._labels_of:  # a new revision: rebuild once
            self._labels_of = labels
            self._text = {
                key: "{" + ",".join(f'{n}="{_escape(v)}"'
                                    for n, v in zip(self.label_names, key, strict=True)) + "}"
                for key in set(labels.values())
            }  # fmt: skip
            self._prefixes = [
                {key: f"{name}_total{text} " for key, text in self._text.items()}
                for name, _help, _reason in FAMILIES[:3]
            ]
        return self._text

    def render(self, openmetrics: bool = False) -> str:
        """The four families as exposition text (Prometheus text 0.0.4, or OpenMetrics).
        Tens of thousands of acyclic tuples and strings: the cycle collector is paused
        (agent/gcpause.py), so no collection pass starts in the middle of a scrape."""
        with gc_paused():
            return self._render(openmetrics)

    def _render(self, openmetrics: bool) -> str:
        try:
            labels = self._labeller()
            sums = self.traffic(labels)
            drops = self.drops(labels)
        except OSError:
            log.exception("ebpf: reading the service counters for /metrics")
            sums, drops, labels = {}, {}, {}
        text = self._label_text(labels)
        out: list[str] = []
        for column, (name, help_text, _reason) in enumerate(FAMILIES[:3]):
            prefix = self._prefixes[column]
            out += _head(name, help_text, openmetrics)
            out += [f"{prefix[key]}{values[column]}\n" for key, values in sums.items()]
        name, help_text, _reason = FAMILIES[3]
        out += _head(name, help_text, openmetrics)
        for (key, reason), count in drops.items():
            out.append(f'{name}_total{text[key][:-1]},reason="{reason}"}} {count}\n')
        return "".join(out)

    def traffic(self, labels: dict[int, tuple[str, ...]]) -> dict[tuple[str, ...], list[int]]:
        """labels -> [packets, bytes, new flows], summed over CPUs and over the ids that
        share labels."""
        out: dict[tuple[str, ...], list[int]] = {}
        if not labels:
            return out
        raw = self._counters.values_array(max(labels) + 1)
        cpus, width = self._cpus, self._stride // 8  # u64 words per CPU's value
        words = struct.unpack(f"={len(raw) // 8}Q", raw)  # id-major, then CPU, then field
        step = width * cpus
        # column f of every id, summed over CPUs: C-level slicing and map(add)
        columns = [
            functools.reduce(lambda x, y: list(map(operator.add, x, y)),
                             (words[cpu * width + f :: step] for cpu in range(cpus)))
            for f in range(3)
        ]  # fmt: skip
        packets, size, new = columns
        for service_id, key in labels.items():
            if service_id >= len(packets):
                continue
            sums = out.get(key)
            if sums is None:
                out[key] = [packets[service_id], size[service_id], new[service_id]]
            else:
                sums[0] += packets[service_id]
                sums[1] += size[service_id]
                sums[2] += new[service_id]
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


# (name without _total, help, whether it has the reason label), in rendering order
FAMILIES = (
    ("kbp_service_packets", "Packets translated for the Service, both directions (eBPF).",
     False),
    ("kbp_service_bytes", "Bytes of those packets, L2 included (eBPF).", False),
    ("kbp_service_new_connections", "Backend selections: new connections (flows) to the "
     "Service (eBPF).", False),
    ("kbp_service_drops", "Packets to the Service dropped or refused, by reason (eBPF).", True),
)  # fmt: skip


def families(names: list[str]) -> list[CounterMetricFamily]:
    """The metric families as prometheus_client describes them, empty (for docs checks)."""
    return [
        CounterMetricFamily(name, text, labels=[*names, "reason"] if reason else names)
        for name, text, reason in FAMILIES
    ]


def _head(name: str, help_text: str, openmetrics: bool) -> list[str]:
    """HELP and TYPE lines of a counter family, as prometheus_client writes them."""
    shown = name if openmetrics else f"{name}_total"
    return [f"# HELP {shown} {help_text}\n", f"# TYPE {shown} counter\n"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def labels_of(entries: Any, services: Any, mode: str) -> dict[int, tuple[str, ...]]:
    """service id -> labels, for NodeState entries whose ClusterIP frontend the kernel
    content (`services`: FrontendKey -> ServiceValue) holds."""
    from .maps import FrontendKey

    out: dict[int, tuple[str, ...]] = {}
    for entry in entries:
        fe = entry.frontends[0]
        value = services.get(
            FrontendKey(fe.ip, fe.port, PROTOCOLS[entry.protocol], family_of(fe.ip))
        )
        if value is None:
            continue
        key = (entry.namespace, entry.name)
        out[value.service_id] = key + ((entry.port, entry.protocol) if mode == "ports" else ())
    return out


def keys_of_ids(keys: Iterable[bytes], service_ids: Iterable[int]) -> list[bytes]:
    """The kbp_svc_drops keys (of those given) that belong to these service ids: what a
    reused id must not inherit."""
    wanted = set(service_ids)
    return [k for k in keys if _DROP_KEY.unpack(k)[0] in wanted]
