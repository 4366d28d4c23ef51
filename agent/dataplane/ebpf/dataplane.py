"""`--dataplane ebpf`: programs the NodeState into the pinned maps of the tc datapath and
keeps the programs attached to every pod interface.

Start-up compiles the C programs (bcc), opens or creates the pins, reads what the maps
hold (a restarted agent adopts the previous agent's ids and sets), attaches to the pod
interfaces and watches netlink for new ones. Each apply translates the NodeState to map
contents (plan.py), diffs against the kernel's, checks capacity, and writes only the
differences, in the order that keeps every intermediate state whole for packets.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

from ...metrics import Metrics
from ...model.nodestate import NodeState
from ..base import DataplaneError
from . import codec
from .abi import DROP_REASONS, versioned
from .kernel import LoadedPrograms, LoadError, load_programs
from .libbpf import Map
from .netlink import Link, LinkWatcher, PodInterfaces, TcAttacher
from .plan import CapacityError, KernelContent, MapSizes, Writes, plan_change

log = logging.getLogger(__name__)

# Which program goes on which side of a pod's host interface.
HOOKS = (("ingress", "kbp_from_pod"), ("egress", "kbp_to_pod"))


class EbpfDataplane:
    name = "ebpf"

    def __init__(
        self,
        pin_dir: str | Path,
        pod_interfaces: Sequence[str],
        sizes: MapSizes | None = None,
        *,
        maglev_table_size: int = 16381,
        netns: str | None = None,
        watch: bool = True,
    ) -> None:
        self.pin_dir = Path(pin_dir)
        self.pod_interfaces = tuple(pod_interfaces)
        self._pods = PodInterfaces(self.pod_interfaces)
        self.sizes = sizes or MapSizes()
        self.maglev_table_size = maglev_table_size
        self._lock = threading.Lock()
        self._held: str | None = None
        self._watcher: LinkWatcher | None = None
        started = time.perf_counter()
        try:
            self.programs: LoadedPrograms = load_programs(self.pin_dir, asdict(self.sizes))
        except LoadError as err:
            raise DataplaneError("load", str(err)) from err
        self._check_pinned_sizes()
        self.current = self._read_kernel()
        self.attacher = TcAttacher(netns)
        self._attached: set[int] = set()
        if watch:  # the watcher's start-up scan attaches to the existing interfaces
            self._watcher = LinkWatcher(self.attacher, self.pod_interfaces, self._on_link)
            self._watcher.start()
        else:
            for link in self.attacher.links():
                if self._pods.matches(link.name):
                    self._on_link(link)
        attached = len(self._attached)
        log.info(
            "ebpf: datapath loaded in %.1f s (compile %.1f s), maps in %s hold %d frontends and "
            "%d backends, attached to %d pod interface(s) matching %s",
            time.perf_counter() - started, self.programs.compile_seconds, self.pin_dir,
            len(self.current.services), len(self.current.backends), attached,
            ",".join(self.pod_interfaces),
        )  # fmt: skip

    # --- Dataplane protocol ------------------------------------------------------------

    @property
    def held_revision(self) -> str | None:
        return self._held

    def apply(self, state: NodeState, full: bool = False) -> int:
        with self._lock:
            if full:
                self.current = self._read_kernel()
            # Changes self.current in place (cost: what changed): every way out below
            # commits or rolls back.
            change = plan_change(
                state, self.current, maglev_table_size=self.maglev_table_size, sizes=self.sizes
            )
            try:
                change.check_capacity(self.sizes)
                self._write(change.writes)
            except CapacityError as err:  # nothing was written
                self.current = change.rollback()
                raise DataplaneError("capacity", str(err)) from err
            except BaseException as err:
                # The kernel may hold something between the old and the new content: read
                # it back (the next apply then compares in full) rather than trust either.
                self.current = self._read_kernel_or(change.rollback())
                if isinstance(err, OSError):
                    raise DataplaneError("map_write", str(err)) from err
                raise
            self.current = change.commit()
            self._held = state.revision
            return change.writes.count

    def cleanup(self) -> None:
        """Detach every kbp_ filter from every interface and remove the pins."""
        self._stop_watching()
        cleanup(self.pin_dir, self.attacher)
        self.close()
        self._held = None

    def close(self) -> None:
        """Stop watching for interfaces; programs stay attached, maps stay pinned."""
        self._stop_watching()
        self.attacher.close()
        self.programs.close()

    def _stop_watching(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    # --- metrics -------------------------------------------------------------------------

    def register_metrics(self, metrics: Metrics) -> None:
        """Map fill ratios (from what the agent wrote) and the datapath's drop counters
        (read from the kernel at each scrape)."""
        def filled(count: Callable[[KernelContent], int], size: int) -> Callable[[], float]:
            def ratio() -> float:
                with self._lock:  # an apply in progress may hold a change it will roll back
                    return count(self.current) / size

            return ratio

        for name, count in (
            ("kbp_services", lambda c: len(c.services)),
            ("kbp_slots", lambda c: c.slot_count()),
            ("kbp_backends", lambda c: len(c.backends)),
        ):
            size = self.programs.map(name).info.max_entries
            metrics.map_fill.labels(versioned(name)).set_function(filled(count, size))
        metrics.registry.register(_DropCollector(self.programs.map("kbp_drops")))

    # --- writes --------------------------------------------------------------------------

    def _write(self, w: Writes) -> None:
        m = self.programs.map
        services, slots, backends = m("kbp_services"), m("kbp_slots"), m("kbp_backends")
        # 1. backends that new sets will name; 2. the new sets, complete
        _update(backends, [(codec.backend_key(i), codec.backend_value(v))
                           for i, v in w.backends_to_upsert.items()])  # fmt: skip
        _update(slots, [(codec.slot_key(set_id, index), codec.slot_value(backend_id))
                        for set_id, members in w.sets_to_write.items()
                        for index, backend_id in enumerate(members)])  # fmt: skip
        # 3. zeroed counters for new service ids, then the flip: services point at new sets
        if w.counters_reset:
            counters = m("kbp_counters")
            zero = bytes(counters.value_size)
            _update(counters, [(codec.backend_key(i), zero) for i in w.counters_reset])
        _update(services, [(codec.frontend_key(k), codec.service_value(v))
                           for k, v in w.services_to_upsert.items()])  # fmt: skip
        # 4. frontends gone; 5. sets nobody points at; 6. backends no set names
        _delete(services, [codec.frontend_key(k) for k in w.frontends_to_delete])
        _delete(slots, [codec.slot_key(set_id, index)
                        for set_id, size in w.sets_to_delete.items()
                        for index in range(size)])  # fmt: skip
        _delete(backends, [codec.backend_key(i) for i in w.backends_to_delete])

    # --- kernel state ----------------------------------------------------------------------

    def _read_kernel(self) -> KernelContent:
        m = self.programs.map
        return codec.read_content(m("kbp_services"), m("kbp_slots"), m("kbp_backends"))

    def _read_kernel_or(self, fallback: KernelContent) -> KernelContent:
        try:
            return self._read_kernel()
        except OSError:
            log.exception("ebpf: cannot read the maps back after a failed write")
            return fallback

    def _check_pinned_sizes(self) -> None:
        """Pinned maps keep the size they were created with: say so when the settings
        ask for another, and plan with what the kernel really has."""
        wanted = asdict(self.sizes)
        actual = {}
        for field, name in (("services", "kbp_services"), ("slots", "kbp_slots"),
                            ("backends", "kbp_backends"), ("ct", "kbp_ct"),
                            ("affinity", "kbp_affinity")):  # fmt: skip
            actual[field] = self.programs.map(name).info.max_entries
            if actual[field] != wanted[field]:
                log.warning(
                    "ebpf: pinned map %s has %d entries, --map-size-%s asks for %d; "
                    "keeping the pinned size (run `kube-bpf-proxy cleanup` to recreate it)",
                    versioned(name), actual[field], field, wanted[field],
                )  # fmt: skip
        self.sizes = MapSizes(**actual)

    # --- interfaces ----------------------------------------------------------------------

    def _on_link(self, link: Link) -> None:
        for direction, program in HOOKS:
            if not self.attacher.attach(link.index, direction, self.programs.fd(program), program):
                log.debug("ebpf: %s vanished before it could be attached", link.name)
                return
        self._attached.add(link.index)
        log.debug("ebpf: attached to %s (ifindex %d)", link.name, link.index)


class _DropCollector:
    """kbp_datapath_drops_total{reason}: the per-CPU kbp_drops map, summed at scrape."""

    def __init__(self, drops: Map) -> None:
        self._drops = drops

    def describe(self) -> list[CounterMetricFamily]:
        return [self._family()]

    def collect(self) -> list[CounterMetricFamily]:
        family = self._family()
        try:
            sums = codec.percpu_sums(self._drops, "kbp_drop_counters")
        except OSError:
            log.exception("ebpf: reading kbp_drops for /metrics")
            return [family]
        for reason, (packets, _bytes) in sorted(sums.items()):
            family.add_metric([DROP_REASONS.get(reason, str(reason))], packets)
        return [family]

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "kbp_datapath_drops",
            "Packets the eBPF datapath dropped or rejected, by reason.",
            labels=["reason"],
        )


def _update(target: Map, items: list[tuple[bytes, bytes]]) -> None:
    if items:
        target.update_batch(b"".join(k for k, _ in items), b"".join(v for _, v in items),
                            len(items))  # fmt: skip


def _delete(target: Map, keys: list[bytes]) -> None:
    if keys:
        target.delete_batch(b"".join(keys), len(keys))


def cleanup(pin_dir: Path, attacher: TcAttacher | None = None) -> tuple[list[str], list[str]]:
    """Remove what the eBPF dataplane installed in this network namespace and on bpffs:
    our tc filters (clsact too when nothing else uses it) and our pins. Works without
    compiling anything, so it also clears up after an agent that cannot start.
    Returns (interfaces detached, pins removed)."""
    own = attacher is None
    attacher = attacher or TcAttacher()
    try:
        interfaces = sorted({a.ifname for a in attacher.attached()})
        for link in attacher.links():
            if link.name in interfaces:
                attacher.detach(link.index)
    finally:
        if own:
            attacher.close()
    return interfaces, remove_pins(pin_dir)


def remove_pins(pin_dir: Path) -> list[str]:
    """Unlink our pins (kbp_*) and the directory when that leaves it empty."""
    removed: list[str] = []
    if not pin_dir.is_dir():
        return removed
    for entry in sorted(pin_dir.iterdir()):
        if entry.name.startswith("kbp_"):
            entry.unlink()
            removed.append(entry.name)
    with contextlib.suppress(OSError):
        pin_dir.rmdir()
    return removed
