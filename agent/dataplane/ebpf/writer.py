"""The map writer of the eBPF dataplane: at each apply its planner (plan.py) turns the
NodeState into map contents; it checks capacity and writes only the differences, in the
order that keeps every intermediate state whole for packets; it owns the conntrack
collector and reports the maps' fill and the datapath's counters on /metrics.

It knows nothing of interfaces: which programs run where is attach.py's.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from typing import Any

from prometheus_client.core import CounterMetricFamily

from ...metrics import Metrics
from ...model.nodestate import NodeState
from ..base import DataplaneError
from . import codec, external, service_metrics
from .abi import DROP_REASONS, FRONTEND_FLAGS, const, layout, packer, versioned
from .conntrack import Collector
from .ctgate import ReplyGate
from .external import SourceRange
from .kernel import LoadedPrograms
from .libbpf import Map
from .maps import CapacityError, KernelContent, Writes
from .options import FLAG_MAP_SIZES, EbpfOptions, MapSizes
from .plan import Change, Planner
from .slots import SlotSpace

# kbp_config.handoff's offset, and the struct's size (set_handoff).
_HANDOFF = next(offset for name, offset, _ in layout("kbp_config") if name == "handoff")
_CONFIG_SIZE = packer("kbp_config").size

log = logging.getLogger(__name__)

# The sized maps (MapSizes fields) with a kbp_map_fill_ratio series; not kbp_ct_remap,
# kbp_svc_drops (LRU maps full by design: the most recent entries) nor kbp_pods.
FILL_RATIO_MAPS = ("services", "slots", "backends", "ct", "affinity", "src_ranges", "sock_rev")


class MapWriter:
    """The pinned maps as this agent last wrote (or read) them, and the one write path."""

    def __init__(self, programs: LoadedPrograms, options: EbpfOptions, netns_cookie: int) -> None:
        """`options`: the sizes, Maglev table size, conntrack timeouts and sweep, and what
        kbp_config says beside the node (SNAT ports, --socket-lb); `netns_cookie`: the
        node's network namespace (kbp_config too)."""
        self.programs = programs
        self.sizes = options.sizes
        self.options = options
        self.netns_cookie = netns_cookie
        self.lock = threading.Lock()
        self.applied: NodeState | None = None  # the last state applied (metrics' labels)
        self._range_index = external.SourceRangeIndex()  # the applied state's, wanted
        self._ports: dict[int, int] = {}  # kbp_ports bits this agent knows are set
        self._check_pinned_sizes()
        # What the maps hold and how it was built: the first plan adopts the ids of what
        # an earlier agent wrote. It plans for one slot fewer than kbp_slots has: index 0
        # names no set. `space`: where its sets are in kbp_slots (slots.py).
        held = self._read_kernel()
        self.space = SlotSpace.of_content(self.sizes.slots, held)
        self.planner = Planner(
            held, maglev_table_size=options.maglev_table_size, sizes=self._planned_sizes()
        )
        self._mark_frontend_types()
        self._target = self.current  # the content an apply writes towards (`_write`)
        self._change: Change | None = None  # the change an apply writes (`_write`)
        # The first apply (a full one: the sync loop's first is) compares with what was
        # just read rather than read the maps again: at 10k Services x 10 a read takes
        # ~1.5 s, more than the restarted agent's whole plan, and nothing else writes
        # them meanwhile (an earlier agent is gone before this one starts).
        self._just_read = True
        # The ports of the backends and frontends found (an earlier agent's): set again
        # where a bit is missing (a map new to this version), or their packets would skip
        # the lookups that find them.
        backends, frontends = self.current.backends.values(), self.current.services
        programs.map("kbp_ports").update_items([
            *self._port_writes(const.KBP_PORT_F_BACKEND, (b.port for b in backends)),
            *self._port_writes(const.KBP_PORT_F_FRONTEND, (k.port for k in frontends)),
        ])  # fmt: skip
        self._ranges = self._read_ranges()  # kbp_src_ranges as written
        # Entries the last state asked for, by MapSizes field (kbp_map_fill_ratio): until
        # the first apply, what the maps hold.
        self.needed: dict[str, int] = {
            "services": len(self.current.services),
            "slots": self.current.slot_count(),
            "backends": len(self.current.backends),
            "src_ranges": len(self._ranges),
        }
        self.conntrack = Collector(programs.map("kbp_ct"), programs.map("kbp_ct_stats"),
                                   options.ct_timeouts, options.ct_sweep_interval,
                                   remap=programs.map("kbp_ct_remap"))  # fmt: skip
        # kbp_ct_gate is trusted only while every tc program is one that sets it: an
        # earlier agent's programs (maybe of a release without the gate) serve until our
        # first apply, so the gate reads "unbuilt" (every lookup made) until the collector
        # is handed it (EbpfDataplane.apply).
        self.gate = ReplyGate(programs.map("kbp_ct_gate"))
        self.gate.reset()
        self._config = programs.map("kbp_config").lookup(bytes(4))  # an earlier agent's
        self.handoff = False  # kbp_config.handoff, see set_handoff
        # The revision an earlier agent's last complete apply left in the maps (None: none,
        # or that apply was cut short): reported as held until this agent applies.
        self.meta_revision = codec.meta_revision(programs.map("kbp_meta").lookup(bytes(4)))
        self.held = self.meta_revision

    @property
    def current(self) -> KernelContent:
        """What the maps hold, as this agent last wrote (or read) them."""
        return self.planner.content

    def apply(self, state: NodeState, full: bool = False) -> tuple[int, bool]:
        """Write what differs from `state`: (writes made, whether backends were removed)."""
        with self.lock:
            if full and not self._just_read:
                self._reset_from_kernel()
            self._just_read = False
            # Changes the planner's content in place (cost: what changed): every way out
            # below commits, rolls back or resets it.
            change = self.planner.plan(state)
            ranges = self._range_index.update(state, rescan=full)
            w = change.writes
            need = change.required_capacity()
            # What this state needs, whether it fits or not: the fill gauges' numerator.
            self.needed = {name: steady for name, (steady, _) in need.items()}
            self.needed["src_ranges"] = len(ranges)
            try:
                stages = change.stages(self.planner.sizes)
                busy = w.count
                self._add_external(w, state, ranges)
                if len(stages) > 1:
                    self._stage_external(w, stages, need)
                # The sets' places in kbp_slots, sets moved together if need be (slots.py)
                placed, space = self.space.place(stages, change.before())
                if len(placed) > len(stages):
                    log.info("ebpf: %s had free slots enough but scattered: %d writes of sets "
                             "moved together go first", versioned("kbp_slots"),
                             len(placed) - len(stages))  # fmt: skip
                # kbp_meta says "unknown" until every write is done
                meta_writes = self._write_meta(None) if busy else 0
                self._target = change.content
                self._change = change
                for stage in placed:
                    self._write(stage, space)
                space.keep()
                meta_writes += self._write_meta(state)
            except CapacityError as err:  # nothing was written
                change.rollback()
                raise DataplaneError("capacity", str(err)) from err
            except BaseException as err:
                # The kernel may hold something between the old and the new content: read
                # it back (the next apply then plans in full) rather than trust either.
                try:
                    self._reset_from_kernel()
                except OSError:
                    log.exception("ebpf: cannot read the maps back after a failed write")
                    change.rollback()
                    self.space.undo()
                self._forget_external()
                if isinstance(err, OSError):
                    raise DataplaneError("map_write", str(err)) from err
                raise
            finally:
                self._change = None
            change.commit()
            self.held = state.revision
            self.applied = state
            made = w.count if len(placed) == 1 else sum(s.count for s in placed)  # + interim
            return made + meta_writes, bool(w.backends_to_delete)

    def _stage_external(
        self, w: Writes, stages: list[Writes], need: dict[str, tuple[int, int]]
    ) -> None:
        """The writes beside the service maps in a staged apply: kbp_config, kbp_ports and
        the new source ranges before the first stage's flips, the ranges no frontend uses
        after the last one's."""
        first, last = stages[0], stages[-1]
        first.config.extend(w.config)
        first.ports.extend(w.ports)
        first.ranges_to_add.extend(w.ranges_to_add)
        last.ranges_to_delete.extend(w.ranges_to_delete)
        peaks = ", ".join(
            f"{versioned('kbp_' + name)} {peak} > {getattr(self.planner.sizes, name)}"
            for name, (_, peak) in need.items()
            if peak > getattr(self.planner.sizes, name)
        )
        log.info(
            "ebpf: old and new entries together would not fit (%s): applying in %d stages, "
            "each Service switching whole, the old entries of those switched freed first",
            peaks, len(stages),
        )  # fmt: skip

    def live_backends(self) -> set[tuple[int, str, int]]:
        """(service id, address, port) of every backend the maps hold."""
        with self.lock:
            return {(b.service_id, b.addr, b.port) for b in self.current.backends.values()}

    # --- metrics -------------------------------------------------------------------------

    def register_metrics(self, metrics: Metrics, service_metrics: str = "services") -> None:
        """Map fill ratios, the datapath's drop counters and, unless service_metrics is
        none, per-Service traffic (read from the kernel at each scrape)."""
        self.register_fill(metrics)
        metrics.registry.register(DropCollector(self.programs.map("kbp_drops")))
        if service_metrics != "none":
            metrics.text_sections.append(self._service_traffic(service_metrics).render)
        metrics.registry.register(self.conntrack)

    def register_fill(self, metrics: Metrics) -> None:
        """kbp_map_fill_ratio has one series per map of FILL_RATIO_MAPS. For the maps
        the agent fills (services, slots, backends, src_ranges) it is the entries the last
        NodeState asked for over the map's size, whether that state was written or refused
        for want of room: above 1.0 then, so an alert on > 0.9 fires when the state is
        larger than a map (after a successful apply it is also what the map holds). For the
        LRU maps the datapath fills (ct, affinity, sock_rev) it is what the map holds: ct
        as the last conntrack sweep counted it, else (and the others) counted at scrape,
        at most every COUNT_EVERY seconds."""

        def needed(name: str, size: int) -> Callable[[], float]:
            def ratio() -> float:
                return self.needed[name] / size  # one dict read: no lock needed

            return ratio

        for name in ("services", "slots", "backends", "src_ranges"):
            size = self.programs.map(f"kbp_{name}").info.max_entries
            metrics.map_fill.labels(versioned(f"kbp_{name}")).set_function(needed(name, size))
        lru = ["affinity", "sock_rev"]
        if self.conntrack.interval > 0:  # counted by each sweep (a scan of the whole map)
            metrics.map_fill.labels(versioned("kbp_ct")).set_function(self.conntrack.fill_ratio)
        else:
            lru.append("ct")
        for name in lru:
            counted = CountedFill(self.programs.map(f"kbp_{name}"))
            metrics.map_fill.labels(versioned(f"kbp_{name}")).set_function(counted.ratio)

    def _service_traffic(self, mode: str) -> service_metrics.ServiceTraffic:
        cache: dict[str, Any] = {}

        def labeller() -> dict[int, tuple[str, ...]]:
            with self.lock:
                state, content = self.applied, self.current
            if state is None:
                return {}
            if cache.get("revision") != state.revision:  # entries and ids change together
                cache["labels"] = service_metrics.labels_of(state.services, content.services,
                                                            mode)  # fmt: skip
                cache["revision"] = state.revision
            return cache["labels"]

        m = self.programs.map
        return service_metrics.ServiceTraffic(m("kbp_counters"), m("kbp_svc_drops"), labeller, mode)

    # --- writes --------------------------------------------------------------------------

    def _write(self, w: Writes, space: SlotSpace) -> None:
        """One stage, placed (slots.py): its sets by first slot; `space`, where every
        set of the new content is once all stages are written."""
        m = self.programs.map
        services, slots, backends = m("kbp_services"), m("kbp_slots"), m("kbp_backends")
        # 0. kbp_config and the ports lookups must know before packets reach new entries
        m("kbp_config").update_items(w.config)
        m("kbp_ports").update_items(w.ports)
        # 1. backends that new sets will name; 2. the new sets, complete, each slot with a
        # copy of its backend's entry (from the new content)
        upserts = {i: codec.backend_value(v) for i, v in w.backends_to_upsert.items()}
        backends.update_items([(codec.backend_key(i), value) for i, value in upserts.items()])
        target = self._target
        known = target.backends
        change = self._change

        def copy_of(backend_id: int) -> bytes:
            value = upserts.get(backend_id)
            if value is not None:
                return value
            backend = known.get(backend_id)
            if backend is None and change is not None:  # a set moved before its backend goes
                backend = change.backend_before(backend_id)
            assert backend is not None, f"a slot names backend id {backend_id}, unknown"
            return codec.backend_value(backend)

        slots.update_items([(codec.slot_key(base + index), codec.slot_value(backend_id,
                                                                          copy_of(backend_id)))
                            for base, members in w.sets_to_write.items()
                            for index, backend_id in enumerate(members)])  # fmt: skip
        # A live backend whose flags changed: the slots of live sets that name it get the
        # new copy (the set itself, its ids, is unchanged). A staged apply names them in its
        # last stage, when every set of the new content is in.
        changed = w.backends_changed
        if changed:  # rare (a fallback set's endpoint terminating): one pass over the sets
            bases = ((space.bases[set_id], members) for set_id, members in target.slots.items())
            slots.update_items([(codec.slot_key(base + index), codec.slot_value(b, upserts[b]))
                                for base, members in bases if base not in w.sets_to_write
                                for index, b in enumerate(members) if b in changed])  # fmt: skip
        # 3. the ranges new services need, zeroed counters for new service ids, then the
        # flip: services point at new sets
        m("kbp_src_ranges").update_items(w.ranges_to_add)
        if w.counters_reset:
            counters = m("kbp_counters")
            zero = bytes(counters.value_size)
            counters.update_items([(codec.backend_key(i), zero) for i in w.counters_reset])
            drops = m("kbp_svc_drops")  # and their drop counts, in one batch if any
            drops.delete_keys(service_metrics.keys_of_ids(drops.keys(), w.counters_reset))
        services.update_items([(codec.frontend_key(k), codec.service_value(v))
                               for k, v in w.services_to_upsert.items()])  # fmt: skip
        # 4. frontends gone; 5. sets nobody points at; 6. backends no set names
        services.delete_keys([codec.frontend_key(k) for k in w.frontends_to_delete])
        free = codec.FREE_SLOT  # an array's slots are zeroed, not deleted
        slots.update_items([(codec.slot_key(base + index), free)
                            for base, size in w.sets_to_delete.items()
                            for index in range(size)])  # fmt: skip
        backends.delete_keys([codec.backend_key(i) for i in w.backends_to_delete])
        # 9. ranges no service uses now (LPM tries have no batch delete)
        for key in w.ranges_to_delete:
            m("kbp_src_ranges").delete(key)

    def _read_kernel(self) -> KernelContent:
        """What the maps hold (its set ids: the sets' first slots)."""
        m = self.programs.map
        return codec.read_content(m("kbp_services"), m("kbp_slots"), m("kbp_backends"))

    def _reset_from_kernel(self) -> None:
        """The planner and the space hold what the maps hold (read now)."""
        content = self._read_kernel()
        self.space = SlotSpace.of_content(self.sizes.slots, content)
        self.planner.reset(content)

    def _planned_sizes(self) -> MapSizes:
        """The sizes the planner plans for: kbp_slots' less index 0, which names no set."""
        return replace(self.sizes, slots=max(self.sizes.slots - 1, 0))

    def _mark_frontend_types(self) -> None:
        """Give an earlier agent's frontends the flag bits their type gives
        (abi.FRONTEND_FLAGS; a release before KBP_SVC_F_EXTERNAL wrote none) before any
        program of ours reads them: the earlier programs, serving until the first apply,
        ignore a bit they do not know."""
        services = self.current.services
        marked = {}
        for key, value in services.items():
            flags = value.flags | FRONTEND_FLAGS.get(value.type, 0)
            if flags != value.flags:
                marked[key] = replace(value, flags=flags)
        if marked:
            self.programs.map("kbp_services").update_items(
                [(codec.frontend_key(k), codec.service_value(v)) for k, v in marked.items()]
            )
            services.update(marked)
            log.info("ebpf: marked %d frontends of an earlier agent with their type's flags",
                     len(marked))  # fmt: skip

    def _check_pinned_sizes(self) -> None:
        """Plan with the sizes the kernel really has. The loader moves a pinned map to a
        new --map-size-* (pins.py), so they differ only when that move did not happen:
        say so."""
        wanted = asdict(self.sizes)
        actual = {}
        for field in FLAG_MAP_SIZES:
            name = f"kbp_{field}"
            actual[field] = self.programs.map(name).info.max_entries
            if actual[field] != wanted[field]:
                log.warning(
                    "ebpf: pinned map %s has %d entries, --map-size-%s asks for %d and it "
                    "was not moved to the new size: planning with the pinned size",
                    versioned(name), actual[field], field, wanted[field],
                )  # fmt: skip
        self.sizes = replace(self.sizes, **actual)

    # --- the maps beside the service maps ----------------------------------------------------

    def _write_meta(self, state: NodeState | None) -> int:
        """kbp_meta: the revision the maps now hold wholly (None: an apply is under way).
        Returns the writes made (0 or 1)."""
        revision = state.revision if state is not None else None
        if revision == self.meta_revision:
            return 0
        value = codec.NO_META if state is None else codec.meta_value(
            state.revision, time.time_ns(), len(state.services), state.backend_count())  # fmt: skip
        self.programs.map("kbp_meta").update(bytes(4), value)
        self.meta_revision = revision
        return 1

    def _add_external(self, w: Writes, state: NodeState, ranges: frozenset[SourceRange]) -> None:
        """The writes of kbp_config, kbp_ports and kbp_src_ranges into their phases of
        `w`, and what this agent then knows the maps hold (forgotten if a write fails).
        CapacityError first if kbp_src_ranges cannot hold `ranges`."""
        size = self.programs.map("kbp_src_ranges").info.max_entries
        if len(ranges) > size:
            raise CapacityError("src_ranges", len(ranges), size)
        node, ct = state.node, self.conntrack.timeouts.lifetimes()
        options = self.options
        config = external.config_value(node.addresses, node.cluster_cidrs, self.netns_cookie,
                                       options.snat_ports, options.socket_lb, ct,
                                       handoff=self.handoff)  # fmt: skip
        if config != self._config:
            w.config.append((bytes(4), config))
            self._config = config
        backend_ports = (b.port for b in w.backends_to_upsert.values())
        w.ports.extend(self._port_writes(const.KBP_PORT_F_BACKEND, backend_ports))
        frontend_ports = (k.port for k in w.services_to_upsert)
        w.ports.extend(self._port_writes(const.KBP_PORT_F_FRONTEND, frontend_ports))
        added, gone = ranges - self._ranges, self._ranges - ranges
        w.ranges_to_add.extend((r.key(), r.value()) for r in added)
        w.ranges_to_delete.extend(r.key() for r in gone)
        self._ranges = set(ranges)

    def set_handoff(self, on: bool) -> None:
        """Set or clear kbp_config.handoff now (and in every kbp_config written later):
        while set, a lost TCP segment is left to netfilter (handoff.py)."""
        self.handoff = on
        table = self.programs.map("kbp_config")
        current = bytearray(table.lookup(bytes(4)) or bytes(_CONFIG_SIZE))
        current[_HANDOFF] = int(on)
        table.update(bytes(4), bytes(current))
        if self._config is not None:
            config = bytearray(self._config)
            config[_HANDOFF] = int(on)
            self._config = bytes(config)

    def _forget_external(self) -> None:
        """After a failed write: read kbp_src_ranges back; write kbp_config and look the
        ports up again at the next apply."""
        self._config = None
        self._ports = {}
        try:
            self._ranges = self._read_ranges()
        except OSError:
            log.exception("ebpf: cannot read kbp_src_ranges back after a failed write")
            self._ranges = set()

    def _port_writes(self, flag: int, ports: Iterable[int]) -> list[tuple[bytes, bytes]]:
        """The kbp_ports writes that set `flag` (KBP_PORT_F_*) for these ports, before
        backends or frontends with them are written: the programs look replies up only
        from backend ports and frontends only at frontend ports. Never cleared, so removed
        backends' flows drain; a stale bit costs a lookup. Only ports whose bits are not
        known are read (an earlier agent's bits stay unwritten)."""
        known = self._ports
        new = {port for port in ports if not known.get(port, 0) & flag}
        out: list[tuple[bytes, bytes]] = []
        table = self.programs.map("kbp_ports")
        for port in sorted(new):
            key = struct.pack("=I", port)
            if port in known:
                bits = known[port]
            else:
                raw = table.lookup(key)
                bits = raw[0] if raw else 0
            if not bits & flag:
                bits |= flag
                out.append((key, bytes([bits])))
            known[port] = bits
        return out

    def _read_ranges(self) -> set[SourceRange]:
        """What kbp_src_ranges holds (an earlier agent's writes), to diff against."""
        items = self.programs.map("kbp_src_ranges").items()
        return {codec.decode_src_range_key(key) for key, _ in items}


COUNT_EVERY = 10.0  # seconds a CountedFill figure is reused (a count reads the whole map)


class CountedFill:
    """The fill ratio of a map the datapath fills, counted by reading its keys in batches
    (reused for COUNT_EVERY seconds: scrapes may come more often than that is worth)."""

    def __init__(self, table: Map) -> None:
        self._table = table
        self._size = table.info.max_entries
        self._lock = threading.Lock()
        self._at = -COUNT_EVERY
        self._ratio = 0.0

    def ratio(self) -> float:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= COUNT_EVERY:
                try:
                    self._ratio = len(self._table.items()) / self._size
                except OSError:
                    log.exception("ebpf: counting the entries of %s for /metrics",
                                  self._table.name)  # fmt: skip
                self._at = now
            return self._ratio


class DropCollector:
    """kbp_datapath_drops_total{reason}: the per-CPU kbp_drops map, summed at scrape."""

    def __init__(self, drops: Map) -> None:
        self._drops = drops

    def describe(self) -> list[CounterMetricFamily]:
        return [self.family()]

    def collect(self) -> list[CounterMetricFamily]:
        family = self.family()
        try:
            sums = codec.percpu_sums(self._drops, "kbp_drop_counters")
        except OSError:
            log.exception("ebpf: reading kbp_drops for /metrics")
            return [family]
        for reason, (packets, _bytes) in sorted(sums.items()):
            family.add_metric([DROP_REASONS.get(reason, str(reason))], packets)
        return [family]

    @staticmethod
    def family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "kbp_datapath_drops",
            "Packets the eBPF datapath dropped or rejected, by reason.",
            labels=["reason"],
        )
