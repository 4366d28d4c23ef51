"""NodeState → the contents of the kernel maps, the ordered writes from one content to the
next, and the map capacity they need. Pure Python: no kernel, bcc or netlink here.

Ids are stable: a ServiceEntry keeps its service id, a (service, endpoint) its backend id
and an unchanged backend set its set id across syncs and agent restarts (adopted from
what the kernel holds). A set is never rewritten in place: changed content gets a new set
id, written in full before the services flip to it (docs/ebpf.md, "Ordered writes").

Two ways in: `translate` (the full path) + `diff` + `check_capacity` leave `current`
untouched; `plan_change` changes `current` in place and keeps an undo log, so one
changed Service costs about the same at 1k as at 30k Services (the agent's path). The
full path is the oracle the in-place one is property-tested against.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import chain, compress
from operator import attrgetter, not_
from typing import Any

from ...config import MAP_SIZES
from ...gcpause import gc_paused
from ...model.nodestate import (
    CLUSTER_IP,
    EXTERNAL_IP,
    LOAD_BALANCER,
    NODE_PORT,
    Backend,
    NodeState,
    ServiceEntry,
    uses_endpoints,
)
from ..base import DataplaneError
from .abi import const
from .maglev import DEFAULT_TABLE_SIZE, check_table_size, maglev_table

_FAMILY = {"IPv4": const.KBP_FAMILY_IPV4, "IPv6": const.KBP_FAMILY_IPV6}
_PROTO = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": socket.IPPROTO_SCTP}
_FRONTEND_TYPE = {
    CLUSTER_IP: const.KBP_FE_CLUSTER_IP,
    NODE_PORT: const.KBP_FE_NODE_PORT,
    EXTERNAL_IP: const.KBP_FE_EXTERNAL_IP,
    LOAD_BALANCER: const.KBP_FE_LOAD_BALANCER,
}
_CLUSTER_IP_TYPE = const.KBP_FE_CLUSTER_IP
_IPV6 = const.KBP_FAMILY_IPV6
_HAS_ENDPOINTS = const.KBP_SVC_F_HAS_ENDPOINTS
_AFFINITY = const.KBP_SVC_F_AFFINITY
_MAGLEV = const.KBP_SVC_F_MAGLEV
_RANDOM = const.KBP_SVC_F_RANDOM
_SOURCE_RANGES = const.KBP_SVC_F_SOURCE_RANGES
_LOCAL = const.KBP_BE_F_LOCAL
_TERMINATING = const.KBP_BE_F_TERMINATING

MAPS = ("services", "slots", "backends")  # the maps a plan fills, in capacity-check order

SortKey = tuple[str, str, str, str, str]
SetContent = tuple[int, ...]


# --- what the maps hold ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FrontendKey:
    """struct kbp_frontend_key: addr is canonical IP text (`ipaddress` compressed form)."""

    addr: str
    port: int
    proto: int  # IPPROTO_TCP 6 / IPPROTO_UDP 17 / IPPROTO_SCTP 132
    family: int  # KBP_FAMILY_IPV4 / KBP_FAMILY_IPV6


@dataclass(frozen=True, slots=True)
class ServiceValue:
    """struct kbp_service."""

    service_id: int
    flags: int  # KBP_SVC_F_*
    set_id: int  # 0 with count 0: the empty set
    count: int
    internal_set_id: int
    internal_count: int
    affinity_timeout: int  # seconds; 0 without KBP_SVC_F_AFFINITY
    type: int  # KBP_FE_*


@dataclass(frozen=True, slots=True)
class BackendValue:
    """struct kbp_backend."""

    addr: str
    port: int
    family: int
    flags: int  # KBP_BE_F_*
    service_id: int


@dataclass(frozen=True, slots=True)
class MapSizes:
    """max_entries of the sized maps (defaults: agent.config.MAP_SIZES, one field per
    entry); `services` also bounds service ids, which index the per-CPU counters array."""

    services: int = MAP_SIZES["services"].default
    slots: int = MAP_SIZES["slots"].default
    backends: int = MAP_SIZES["backends"].default
    ct: int = MAP_SIZES["ct"].default
    affinity: int = MAP_SIZES["affinity"].default
    src_ranges: int = MAP_SIZES["src_ranges"].default
    sock_rev: int = MAP_SIZES["sock_rev"].default


@dataclass(slots=True)
class KernelContent:
    """What the services, slots and backends maps hold (or should hold).

    Only this module changes it, through `plan_change`, which also keeps `_index`, how
    the content was built, current: the next sync then translates only the entries that
    changed. Content decoded from the kernel has no index and takes the full path. Not
    hashable (it holds dicts).
    """

    services: dict[FrontendKey, ServiceValue] = field(default_factory=dict)
    slots: dict[int, SetContent] = field(default_factory=dict)  # set id → backend ids
    backends: dict[int, BackendValue] = field(default_factory=dict)
    _index: _Index | None = field(default=None, init=False, compare=False, repr=False)

    def slot_count(self) -> int:
        """Slots over all sets (entries of the slots map)."""
        if self._index is not None:
            return self._index.slot_total
        return sum(map(len, self.slots.values()))


# --- errors ----------------------------------------------------------------------------


class CapacityError(DataplaneError):
    """A map is too small for the NodeState; nothing was written."""

    def __init__(self, map: str, needed: int, size: int) -> None:
        self.map = map
        self.needed = needed
        self.size = size
        super().__init__(
            "capacity",
            f"map kbp_{map} needs {needed} entries but holds {size} "
            f"({needed - size} short); raise it with --map-size-{map}",
        )


# --- how a content was built (kept beside it for the next sync) ------------------------


@dataclass(frozen=True, slots=True)
class _EntryPlan:
    """What one ServiceEntry owns in a content."""

    entry: ServiceEntry
    service_id: int  # 0: the entry programs nothing (no frontend of its own)
    frontends: tuple[FrontendKey, ...]
    set_ids: tuple[int, ...]
    backend_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class _Index:
    maglev_table_size: int
    sizes: MapSizes
    by_key: dict[SortKey, _EntryPlan]
    by_digest: dict[bytes, _EntryPlan]  # entries that carry a digest
    service_ids: dict[int, SortKey]  # live service ids and their entries
    contested: frozenset[FrontendKey]  # frontends more than one entry asked for
    cursors: tuple[int, int, int]  # next service, set and backend id to try
    slot_total: int
    service_id_overflow: int  # highest service id handed out past the map size, else 0
    # NodeState entries these plans are for, when each has a plan of its own under
    # its sort key and under its plan's digest (sealed, no repeats), and their revision:
    # the next sync then looks only at the entries of the Services its state's Changes
    # name from that revision. Else None: the next sync scans every entry.
    entries: tuple[ServiceEntry, ...] | None
    revision: str


# --- the writes from one content to the next -------------------------------------------


@dataclass(frozen=True, slots=True)
class Writes:
    """Map writes in apply order. Applied phase by phase, every intermediate kernel state
    is consistent for packets: a service only ever points at complete sets, a slot at
    an existing backend, and a ranged frontend has its source ranges.

    0. `config`, `ports`: kbp_config and the kbp_ports bits of new backend and frontend
       ports (the dataplane adds these, as raw (key, value) pairs, before writing);
    1. `backends_to_upsert`: new backends (and flag changes of live ones);
    2. `sets_to_write`: every slot of the new sets (never a live set: ids are fresh);
    3. `ranges_to_add`: kbp_src_ranges entries the new services need (dataplane);
    4. `counters_reset`: zero the per-CPU counters of newly used service ids;
    5. `services_to_upsert`: the flip, one atomic element per frontend;
    6. `frontends_to_delete`;
    7. `sets_to_delete`: set id → its slot count (keys (set_id, 0..count-1));
    8. `backends_to_delete`;
    9. `ranges_to_delete`: kbp_src_ranges entries no service uses any more (dataplane).
    """

    counters_reset: list[int] = field(default_factory=list)
    backends_to_upsert: dict[int, BackendValue] = field(default_factory=dict)
    sets_to_write: dict[int, SetContent] = field(default_factory=dict)
    services_to_upsert: dict[FrontendKey, ServiceValue] = field(default_factory=dict)
    frontends_to_delete: list[FrontendKey] = field(default_factory=list)
    sets_to_delete: dict[int, int] = field(default_factory=dict)
    backends_to_delete: list[int] = field(default_factory=list)
    # Of backends_to_upsert, the live backends whose value (flags) changed: the slots of
    # live sets carry a copy of each backend's value (struct kbp_slot) to rewrite.
    backends_changed: set[int] = field(default_factory=set)
    config: list[tuple[bytes, bytes]] = field(default_factory=list)
    ports: list[tuple[bytes, bytes]] = field(default_factory=list)
    ranges_to_add: list[tuple[bytes, bytes]] = field(default_factory=list)
    ranges_to_delete: list[bytes] = field(default_factory=list)

    @property
    def count(self) -> int:
        """Element writes in total (a set counts one per slot)."""
        return (
            len(self.counters_reset)
            + len(self.backends_to_upsert)
            + sum(map(len, self.sets_to_write.values()))
            + len(self.services_to_upsert)
            + len(self.frontends_to_delete)
            + sum(self.sets_to_delete.values())
            + len(self.backends_to_delete)
            + len(self.config)
            + len(self.ports)
            + len(self.ranges_to_add)
            + len(self.ranges_to_delete)
        )

    @property
    def empty(self) -> bool:
        return not (
            self.counters_reset
            or self.backends_to_upsert
            or self.sets_to_write
            or self.services_to_upsert
            or self.frontends_to_delete
            or self.sets_to_delete
            or self.backends_to_delete
            or self.config
            or self.ports
            or self.ranges_to_add
            or self.ranges_to_delete
        )

    def elements(self) -> Iterator[tuple[str, str, Any, Any]]:
        """Every element write in order: (map, "update" | "delete" | "reset", key, value);
        slot keys are (set_id, index). For tests and element-by-element fallbacks."""
        for service_id in self.counters_reset:
            yield "counters", "reset", service_id, None
        for backend_id, backend in self.backends_to_upsert.items():
            yield "backends", "update", backend_id, backend
        for set_id, content in self.sets_to_write.items():
            for index, backend_id in enumerate(content):
                yield "slots", "update", (set_id, index), backend_id
        for key, value in self.services_to_upsert.items():
            yield "services", "update", key, value
        for key in self.frontends_to_delete:
            yield "services", "delete", key, None
        for set_id, count in self.sets_to_delete.items():
            for index in range(count):
                yield "slots", "delete", (set_id, index), None
        for backend_id in self.backends_to_delete:
            yield "backends", "delete", backend_id, None


# --- desired content -------------------------------------------------------------------


def translate(
    state: NodeState,
    current: KernelContent,
    *,
    maglev_table_size: int = DEFAULT_TABLE_SIZE,
    sizes: MapSizes | None = None,
) -> KernelContent:
    """What the maps should hold for `state`, translating every entry and reusing the ids
    of `current` (the content the kernel holds now: decoded from the maps, or built here),
    which stays as it is: the full path.

    Raises ValueError when the Maglev table size is not prime or too small for a
    Service's backends. Ids never exceed the map sizes unless the maps are too small:
    `check_capacity` then reports it.
    """
    check_table_size(maglev_table_size)
    with gc_paused():  # ~10^5 acyclic values: generation-2 passes would double the time
        return _Full(state, current, maglev_table_size, sizes or MapSizes()).run()


def plan_change(
    state: NodeState,
    current: KernelContent,
    *,
    maglev_table_size: int = DEFAULT_TABLE_SIZE,
    sizes: MapSizes | None = None,
) -> Change:
    """`translate`, `diff` and `required_capacity` in one step that changes `current`
    in place when it came from this module (translate or plan_change): the cost follows
    the entries that changed, not the size of `current`.

    Until the returned Change is committed or rolled back, `current` may already hold the
    new content: use it for nothing else. Content decoded from the kernel (or a change of
    table or map sizes) is translated in full into a new content, leaving `current` as it
    is. Raises like translate, with `current` unchanged.
    """
    sizes = sizes or MapSizes()
    update = _update(state, current, maglev_table_size, sizes)
    if update is not None:
        return Change._in_place(current, update)
    desired = translate(state, current, maglev_table_size=maglev_table_size, sizes=sizes)
    writes = diff(current, desired)
    return Change(current, desired, writes, required_capacity(current, desired, writes), None)


def _update(
    state: NodeState, current: KernelContent, maglev_table_size: int, sizes: MapSizes
) -> _Update | None:
    """How to change `current` into the content for `state` by translating only what
    changed, or None: translate everything."""
    check_table_size(maglev_table_size)
    index = current._index
    if index is None or index.maglev_table_size != maglev_table_size or index.sizes != sizes:
        return None
    return _Incremental(state, current, index).run()


def _canonical(ip: str) -> str:
    """The model's canonical text (inet_ntop) except for IPv6 with an embedded IPv4 part,
    which `ipaddress` writes in hex: the kernel side decodes with `ipaddress`."""
    if "." in ip and ":" in ip:
        return str(ipaddress.IPv6Address(ip))
    return ip


def _maglev_name(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class _Ids:
    """Hands out ids upward from a cursor, wrapping below `bound`, skipping ids present in
    any of `taken`: ids freed by this sync are still in `current`, so they are not reused
    at once. Past a full space it goes on above `bound` (check_capacity reports that)."""

    __slots__ = ("bound", "cursor", "exhausted", "overflow", "taken")

    def __init__(self, bound: int, cursor: int, taken: tuple[Any, ...]) -> None:
        self.bound = bound
        self.cursor = cursor if 0 < cursor < bound else 1
        self.taken = taken
        self.overflow = 0
        self.exhausted = False  # a whole scan found no free id: go straight to overflow

    def take(self) -> int:
        i = self.cursor
        if self.exhausted:
            i = self.bound
        elif i < self.bound:  # usually the cursor itself is free
            for used in self.taken:
                if i in used:
                    break
            else:
                self.cursor = i + 1
                return i
        for _ in range(self.bound if not self.exhausted else 0):
            if i >= self.bound:
                i = 1
            for used in self.taken:
                if i in used:
                    break
            else:
                self.cursor = i + 1
                return i
            i += 1
        # Without this, every further id would rescan the full space: planning a state
        # far too big for its maps took minutes before check_capacity could say so.
        self.exhausted = True
        i = max(self.bound, self.overflow + 1)
        while any(i in used for used in self.taken):
            i += 1
        self.overflow = i
        return i


def _cursor_after(ids: Iterable[int], bound: int) -> int:
    highest = max(ids, default=0)
    return highest + 1 if highest + 1 < bound else 1


def source_ranged_keys(entry: ServiceEntry) -> dict[FrontendKey, tuple[str, ...]]:
    """The entry's LoadBalancer frontends that carry loadBalancerSourceRanges → their
    ranges as normalised networks (the compiler keeps the entry's family only)."""
    found: dict[FrontendKey, tuple[str, ...]] = {}
    for f in entry.frontends:
        if f.type != LOAD_BALANCER or not f.source_ranges:
            continue
        family = _FAMILY[entry.ip_family]
        key = FrontendKey(_canonical(f.ip), f.port, _PROTO[entry.protocol], family)
        found[key] = tuple(str(ipaddress.ip_network(r, strict=False)) for r in f.source_ranges)
    return found


class _Builder:
    """Shared by both paths: translates one entry into `services`/`slots`/`backends`."""

    def __init__(
        self,
        current: KernelContent,
        maglev_table_size: int,
        sizes: MapSizes,
        services: dict[FrontendKey, ServiceValue],
        slots: dict[int, SetContent],
        backends: dict[int, BackendValue],
    ) -> None:
        self.current = current
        self.maglev_table_size = maglev_table_size
        self.sizes = sizes
        self.services = services
        self.slots = slots
        self.backends = backends
        self.slot_total = 0  # slots added (the caller accounts for what it removed)
        self.service_ids: dict[int, SortKey] = {}
        self.claimed_keys: set[FrontendKey] = set()
        self.contested: set[FrontendKey] = set()
        # Set by the path before translating.
        self.service_id_alloc: _Ids
        self.set_id_alloc: _Ids
        self.backend_id_alloc: _Ids

    @staticmethod
    def frontend_keys(entry: ServiceEntry) -> dict[FrontendKey, int]:
        """The entry's frontends as keys → KBP_FE_* (the first type wins on a repeat)."""
        family = _FAMILY[entry.ip_family]
        proto = _PROTO[entry.protocol]
        keys: dict[FrontendKey, int] = {}
        for f in entry.frontends:
            key = FrontendKey(_canonical(f.ip), f.port, proto, family)
            if key not in keys:
                keys[key] = _FRONTEND_TYPE[f.type]
        return keys

    def owned(self, keys: dict[FrontendKey, int]) -> dict[FrontendKey, int]:
        """The keys no earlier entry asked for, now this entry's; the others are contested.
        Call in NodeState order."""
        claimed = self.claimed_keys
        free = {}
        for key, kind in keys.items():
            if key in claimed:
                self.contested.add(key)
            else:
                claimed.add(key)
                free[key] = kind
        return free

    def backend_ids(
        self,
        entry: ServiceEntry,
        members: tuple[Backend, ...] | None,
        service_id: int,
        ids: dict[tuple[str, int], int],
        known: Mapping[tuple[str, int], int],
    ) -> list[int]:
        """Backend ids of `members` in order, writing their values; `ids` collects the
        entry's backends (a local backend is in both of its sets under one id)."""
        if not members:
            return []
        family = _FAMILY[entry.ip_family]
        v6 = family == _IPV6
        backends = self.backends
        take = self.backend_id_alloc.take
        out = []
        if not known and not ids:  # a new service's first set: every backend is new
            for b in members:
                addr = _canonical(b.ip) if v6 and "." in b.ip else b.ip
                backend_id = take()
                flags = (_LOCAL if b.local else 0) | (_TERMINATING if b.terminating else 0)
                backends[backend_id] = BackendValue(addr, b.port, family, flags, service_id)
                ids[(addr, b.port)] = backend_id
                out.append(backend_id)
            return out
        previous = self.current.backends
        for b in members:
            addr = _canonical(b.ip) if v6 and "." in b.ip else b.ip
            port = b.port
            key = (addr, port)
            backend_id = ids.get(key)
            if backend_id is None:
                flags = (_LOCAL if b.local else 0) | (_TERMINATING if b.terminating else 0)
                backend_id = known.get(key)
                value = None
                if backend_id is None:
                    backend_id = take()
                else:  # same service, address and port: keep the value if flags agree
                    value = previous.get(backend_id)
                    if value is not None and value.flags != flags:
                        value = None
                if value is None:
                    value = BackendValue(addr, port, family, flags, service_id)
                backends[backend_id] = value
                ids[key] = backend_id
            out.append(backend_id)
        return out

    def translate(
        self,
        entry: ServiceEntry,
        keys: dict[FrontendKey, int],
        service_id: int,
        known_backends: Mapping[tuple[str, int], int],
        known_sets: Mapping[SetContent, int],
    ) -> _EntryPlan:
        """Write `entry` with `service_id` under `keys`; backend and set ids come from the
        known_* maps when their content matches, else are new."""
        # Only the sets some frontend uses (docs/nodestate.md): a ClusterIP uses one set whoever
        # sends; an external frontend uses its policy's set from outside and the cluster
        # set from pods. A set nobody points at could not be adopted after a restart.
        wants_cluster, wants_local = uses_endpoints(
            entry.internal_traffic_policy,
            entry.external_traffic_policy,
            _CLUSTER_IP_TYPE in keys.values(),
            any(kind != _CLUSTER_IP_TYPE for kind in keys.values()),
        )

        ids: dict[tuple[str, int], int] = {}  # (addr, port) → backend id, this entry
        set_ids: dict[SetContent, int] = {}  # content → set id, this entry
        cluster = local = (0, 0)
        if wants_cluster:
            members = entry.cluster_backends
            member_ids = self.backend_ids(entry, members, service_id, ids, known_backends)
            cluster = self.set_of(entry, members, member_ids, known_sets, set_ids)
        if wants_local:
            members = entry.local_backends
            member_ids = self.backend_ids(entry, members, service_id, ids, known_backends)
            local = self.set_of(entry, members, member_ids, known_sets, set_ids)
        internal = local if entry.uses_local(CLUSTER_IP) else cluster
        external = local if entry.uses_local(LOAD_BALANCER) else cluster  # from outside

        flags = _HAS_ENDPOINTS if entry.has_endpoints else 0
        timeout = entry.affinity_timeout
        if timeout is not None:
            flags |= _AFFINITY
        if entry.lb_algorithm == "maglev":
            flags |= _MAGLEV
        elif entry.lb_algorithm == "random":
            flags |= _RANDOM
        services = self.services
        ranged = source_ranged_keys(entry)
        for key, kind in keys.items():
            if kind == _CLUSTER_IP_TYPE:
                (set_id, count), (inner_id, inner_count) = internal, internal
            else:
                (set_id, count), (inner_id, inner_count) = external, cluster
            services[key] = ServiceValue(
                service_id,
                flags | _SOURCE_RANGES if ranged and key in ranged else flags,
                set_id, count, inner_id, inner_count, timeout or 0, kind,
            )  # fmt: skip
        self.service_ids[service_id] = entry.sort_key
        return _EntryPlan(
            entry, service_id, tuple(keys), tuple(set_ids.values()), tuple(ids.values())
        )

    def set_of(
        self,
        entry: ServiceEntry,
        members: tuple[Backend, ...] | None,
        member_ids: list[int],
        known_sets: Mapping[SetContent, int],
        set_ids: dict[SetContent, int],
    ) -> tuple[int, int]:
        """(set id, count) of a backend list: a Maglev table over it or the list itself;
        the same content within an entry is one set, known content keeps its id."""
        if not member_ids:
            return 0, 0
        if entry.lb_algorithm == "maglev":
            names = [_maglev_name(_canonical(b.ip), b.port) for b in members or ()]
            try:
                table = maglev_table(names, self.maglev_table_size)
            except ValueError as e:
                raise ValueError(
                    f"{entry.namespace}/{entry.name} port {entry.port!r}: {e}; "
                    "raise --maglev-table-size"
                ) from e
            content: SetContent = tuple(map(member_ids.__getitem__, table))
        else:
            content = tuple(member_ids)
        set_id = set_ids.get(content)
        if set_id is None:
            set_id = known_sets.get(content)
            if set_id is None or set_id in self.slots:
                set_id = self.set_id_alloc.take()
            set_ids[content] = set_id
            self.slots[set_id] = content
            self.slot_total += len(content)
        return set_id, len(content)

    def known_from_plan(
        self, plan: _EntryPlan
    ) -> tuple[dict[tuple[str, int], int], dict[SetContent, int]]:
        """The backend and set ids an entry owned in `current`, by content."""
        current = self.current
        known_backends = {}
        for backend_id in plan.backend_ids:
            b = current.backends[backend_id]
            known_backends[(b.addr, b.port)] = backend_id
        known_sets = {current.slots[s]: s for s in plan.set_ids}
        return known_backends, known_sets


class _Full:
    """Translate every entry, adopting ids from `current` (and from how it was built, when
    it was built here)."""

    def __init__(
        self, state: NodeState, current: KernelContent, maglev_table_size: int, sizes: MapSizes
    ) -> None:
        self.state = state
        self.current = current
        self.index = current._index
        self.maglev_table_size = maglev_table_size
        self.sizes = sizes
        self._by_service: dict[int, dict[tuple[str, int], int]] | None = None

    def backends_of(self, service_id: int) -> dict[tuple[str, int], int]:
        if self._by_service is None:
            by_service: dict[int, dict[tuple[str, int], int]] = {}
            for backend_id, b in self.current.backends.items():
                by_service.setdefault(b.service_id, {})[(b.addr, b.port)] = backend_id
            self._by_service = by_service
        return self._by_service.get(service_id, {})

    def run(self) -> KernelContent:
        current, sizes, index = self.current, self.sizes, self.index
        out = KernelContent()
        builder = _Builder(
            current, self.maglev_table_size, sizes, out.services, out.slots, out.backends
        )
        # Ids `current` uses in any way stay reserved until it is gone: a new id never
        # names something a packet or a conntrack entry may still find under it.
        live_services = {v.service_id for v in current.services.values()}
        live_services.update(b.service_id for b in current.backends.values())
        live_sets = set(current.slots)
        for v in current.services.values():
            live_sets.add(v.set_id)
            live_sets.add(v.internal_set_id)
        live_backends = set(current.backends)
        live_backends.update(chain.from_iterable(current.slots.values()))
        if index is not None and index.sizes == sizes:
            cursors = index.cursors
        else:
            cursors = (
                _cursor_after(live_services, sizes.services),
                _cursor_after(live_sets, sizes.slots),
                _cursor_after(live_backends, sizes.backends),
            )
        builder.service_id_alloc = _Ids(
            sizes.services, cursors[0], (live_services, builder.service_ids)
        )
        builder.set_id_alloc = _Ids(sizes.slots, cursors[1], (live_sets, out.slots))
        builder.backend_id_alloc = _Ids(sizes.backends, cursors[2], (live_backends, out.backends))

        entries = self.state.services
        # Who answers each frontend: the first entry in NodeState order that asks for it.
        owned = [builder.owned(builder.frontend_keys(e)) for e in entries]
        if index is not None:  # built here: entries are known by their sort keys
            service_ids = []
            for entry in entries:
                old = index.by_key.get(entry.sort_key)
                service_ids.append(old.service_id if old is not None else 0)
        else:  # decoded from the kernel: entries are known by their frontends
            service_ids = self.adopt_service_ids(owned)

        by_key: dict[SortKey, _EntryPlan] = {}
        by_digest: dict[bytes, _EntryPlan] = {}
        for entry, keys, service_id in zip(entries, owned, service_ids, strict=True):
            if not keys:
                plan = _EntryPlan(entry, 0, (), (), ())
            else:
                known_backends: Mapping[tuple[str, int], int] = {}
                known_sets: Mapping[SetContent, int] = {}
                if not service_id:
                    service_id = builder.service_id_alloc.take()
                elif index is not None:
                    known_backends, known_sets = builder.known_from_plan(
                        index.by_key[entry.sort_key]
                    )
                else:
                    known_backends = self.backends_of(service_id)
                    known_sets = self.sets_of(keys, service_id)
                plan = builder.translate(entry, keys, service_id, known_backends, known_sets)
            by_key[entry.sort_key] = plan
            if entry.digest:
                by_digest[entry.digest] = plan
        index = _Index(
            self.maglev_table_size,
            sizes,
            by_key,
            by_digest,
            builder.service_ids,
            frozenset(builder.contested),
            (
                builder.service_id_alloc.cursor,
                builder.set_id_alloc.cursor,
                builder.backend_id_alloc.cursor,
            ),
            builder.slot_total,
            builder.service_id_alloc.overflow,
            _entries_if_keyed(entries, by_key, by_digest),
            self.state.revision,
        )
        out._index = index
        return out

    def adopt_service_ids(self, owned: list[dict[FrontendKey, int]]) -> list[int]:
        """Per entry, the service id its frontends have in `current` (0: none). ClusterIPs
        are matched first: they are unique per Service, so a NodePort or ExternalIP that
        moved to another Service does not take the id of the Service it left."""
        services = self.current.services
        result = [0] * len(owned)
        taken: set[int] = set()
        for only_cluster_ips in (True, False):
            for i, keys in enumerate(owned):
                if result[i]:
                    continue
                for key, kind in keys.items():
                    if only_cluster_ips and kind != _CLUSTER_IP_TYPE:
                        continue
                    value = services.get(key)
                    if value is not None and value.service_id and value.service_id not in taken:
                        result[i] = value.service_id
                        taken.add(value.service_id)
                        break
        return result

    def sets_of(self, keys: Iterable[FrontendKey], service_id: int) -> dict[SetContent, int]:
        """Complete sets the entry's frontends point at in `current`, by content."""
        current = self.current
        found: dict[SetContent, int] = {}
        for key in keys:
            value = current.services.get(key)
            if value is None or value.service_id != service_id:
                continue
            for set_id, count in (
                (value.set_id, value.count),
                (value.internal_set_id, value.internal_count),
            ):
                content = current.slots.get(set_id) if set_id else None
                if content is not None and len(content) == count:
                    found[content] = set_id
        return found


_DIGEST = attrgetter("digest")


def _entries_if_keyed(
    entries: tuple[ServiceEntry, ...],
    by_key: Mapping[SortKey, _EntryPlan],
    by_digest: Mapping[bytes, _EntryPlan],
) -> tuple[ServiceEntry, ...] | None:
    """`entries` if each has a plan of its own (see `_Index.entries`); the caller knows
    that every entry is sealed and `by_digest` holds only the digests of their plans."""
    n = len(entries)
    return entries if len(by_key) == n and len(by_digest) == n else None


class _Incremental:
    """Translate only the entries whose digest changed, into dicts of their own beside
    `current` (which is only read): an `_Update`. Returns None (take the full path) when
    a changed entry touches a frontend that more than one entry wants, as the winner then
    depends on the order of all entries."""

    def __init__(self, state: NodeState, current: KernelContent, index: _Index) -> None:
        self.state = state
        self.current = current
        self.index = index

    def run(self) -> _Update | None:
        state, current, index = self.state, self.current, self.index
        changed, old_plans, sealed = self.changes()
        contested = index.contested
        if contested and any(k in contested for p in old_plans for k in p.frontends):
            return None

        sizes = index.sizes
        builder = _Builder(current, index.maglev_table_size, sizes, {}, {}, {})
        builder.service_id_alloc = _Ids(
            sizes.services, index.cursors[0], (index.service_ids, builder.service_ids)
        )
        builder.set_id_alloc = _Ids(sizes.slots, index.cursors[1], (current.slots, builder.slots))
        builder.backend_id_alloc = _Ids(
            sizes.backends, index.cursors[2], (current.backends, builder.backends)
        )
        # Frontends stay taken by the entries that keep their plans.
        services = current.services
        freed = {key for plan in old_plans for key in plan.frontends}
        by_key = index.by_key
        new_plans = []
        for entry in changed:
            keys = builder.frontend_keys(entry)
            if any(
                k in builder.services or k in contested or (k in services and k not in freed)
                for k in keys
            ):
                return None
            old = by_key.get(entry.sort_key)
            if not keys:
                plan = _EntryPlan(entry, 0, (), (), ())
            elif old is not None and old.service_id:
                known_backends, known_sets = builder.known_from_plan(old)
                plan = builder.translate(entry, keys, old.service_id, known_backends, known_sets)
            else:
                service_id = builder.service_id_alloc.take()
                plan = builder.translate(entry, keys, service_id, {}, {})
            new_plans.append(plan)

        if not new_plans and not old_plans:
            cursors, overflow = index.cursors, index.service_id_overflow
        else:
            cursors = (
                builder.service_id_alloc.cursor,
                builder.set_id_alloc.cursor,
                builder.backend_id_alloc.cursor,
            )
            overflow = builder.service_id_alloc.overflow
        return _Update(
            state.services,
            state.revision,
            sealed,
            old_plans,
            new_plans,
            builder.services,
            builder.slots,
            builder.backends,
            builder.service_ids,
            cursors,
            overflow,
        )

    def changes(self) -> tuple[list[ServiceEntry], list[_EntryPlan], bool]:
        """The entries to translate (new or changed, in NodeState order), the plans that go
        (of changed entries and of entries gone), and whether every entry that came (all
        when scanning) is sealed."""
        state, index = self.state, self.index
        previous, changes = index.entries, state.changes
        if previous is state.services:
            return [], [], True
        if previous is None or changes is None or changes.base != index.revision:
            return self.changes_by_scan()
        went, came = changes.between(previous, state.services)
        by_digest, by_key = index.by_digest, index.by_key
        came_digests = list(map(_DIGEST, came))
        changed = list(compress(came, map(not_, map(by_digest.__contains__, came_digests))))
        staying = set(came_digests)
        staying.discard(b"")
        old_plans = []
        # Usually only the went entries whose digest is not staying; an entry equal to the
        # one it was planned for may lack a digest, so the plan's own digest decides.
        for entry in compress(went, map(not_, map(staying.__contains__, map(_DIGEST, went)))):
            plan = by_key[entry.sort_key]
            if plan.entry.digest not in staying:
                old_plans.append(plan)
        return changed, old_plans, all(came_digests)

    def changes_by_scan(self) -> tuple[list[ServiceEntry], list[_EntryPlan], bool]:
        """`changes` looking at every entry (and every plan when some went)."""
        state, index = self.state, self.index
        by_digest, by_key = index.by_digest, index.by_key
        changed: list[ServiceEntry] = []
        hits = 0
        for entry in state.services:
            digest = entry.digest
            if digest:
                if digest in by_digest:
                    hits += 1
                    continue
            else:
                old = by_key.get(entry.sort_key)
                if old is not None and old.entry == entry:
                    hits += 1
                    continue
            changed.append(entry)
        sealed = all(map(_DIGEST, state.services))
        if not changed and hits == len(by_key):
            return [], [], sealed

        changed_keys = {e.sort_key: e for e in changed}
        old_plans = [p for p in map(by_key.get, changed_keys) if p is not None]
        if hits + len(old_plans) < len(by_key):
            live_digests = {e.digest for e in state.services if e.digest}
            live_keys = None
            for key, plan in by_key.items():
                if key in changed_keys:
                    continue
                digest = plan.entry.digest
                if digest and digest in live_digests and by_digest.get(digest) is plan:
                    continue
                if not digest:
                    if live_keys is None:
                        live_keys = {e.sort_key for e in state.services}
                    if key in live_keys:
                        continue
                old_plans.append(plan)
        return changed, old_plans, sealed


@dataclass(frozen=True, slots=True)
class _Update:
    """What `_Incremental` found: the plans that go, the plans that come with the entries
    they write, and the index figures after. `apply` makes it so on a content."""

    entries: tuple[ServiceEntry, ...]
    revision: str
    sealed: bool  # every entry that came has a digest
    old_plans: list[_EntryPlan]
    new_plans: list[_EntryPlan]
    services: dict[FrontendKey, ServiceValue]
    slots: dict[int, SetContent]
    backends: dict[int, BackendValue]
    service_ids: dict[int, SortKey]
    cursors: tuple[int, int, int]
    service_id_overflow: int

    @property
    def empty(self) -> bool:
        return not self.old_plans and not self.new_plans

    def apply(self, journals: _Journals) -> None:
        """Change the journals' content (and its index) in place into the new content."""
        index = journals.index
        services, slots, backends = journals.services, journals.slots, journals.backends
        by_key, by_digest, service_ids = journals.by_key, journals.by_digest, journals.service_ids
        slot_total = index.slot_total
        for plan in self.old_plans:
            for key in plan.frontends:
                services.delete(key)
            for set_id in plan.set_ids:
                slot_total -= len(slots.delete(set_id))
            for backend_id in plan.backend_ids:
                backends.delete(backend_id)
            entry = plan.entry
            by_key.delete(entry.sort_key)
            if entry.digest and by_digest.target.get(entry.digest) is plan:
                by_digest.delete(entry.digest)
            if plan.service_id in service_ids.target:
                service_ids.delete(plan.service_id)
        for key, value in self.services.items():
            services.set(key, value)
        for set_id, content in self.slots.items():
            slots.set(set_id, content)
            slot_total += len(content)
        for backend_id, backend in self.backends.items():
            backends.set(backend_id, backend)
        for plan in self.new_plans:
            by_key.set(plan.entry.sort_key, plan)
            if plan.entry.digest:
                by_digest.set(plan.entry.digest, plan)
        for service_id, sort_key in self.service_ids.items():
            service_ids.set(service_id, sort_key)
        entries = None
        if self.sealed:  # then by_digest holds the digests of the plans of `self.entries`
            entries = _entries_if_keyed(self.entries, by_key.target, by_digest.target)
        new_index = replace(
            index,
            cursors=self.cursors,
            slot_total=slot_total,
            service_id_overflow=self.service_id_overflow,
            entries=entries,
            revision=self.revision,
        )
        journals.content._index = new_index


# --- changing a content in place -------------------------------------------------------

_ABSENT: Any = object()  # in a journal: the key had no value before


class _Journal:
    """Changes made in place to one dict, with each changed key's value from before the
    first change (`_ABSENT`: none): the keys that changed, and how to undo them."""

    __slots__ = ("before", "target")

    def __init__(self, target: dict[Any, Any]) -> None:
        self.target = target
        self.before: dict[Any, Any] = {}

    def set(self, key: Any, value: Any) -> None:
        if key not in self.before:
            self.before[key] = self.target.get(key, _ABSENT)
        self.target[key] = value

    def delete(self, key: Any) -> Any:
        value = self.target.pop(key)
        if key not in self.before:
            self.before[key] = value
        return value

    def had(self, key: Any) -> bool:
        """Whether `key` had a value before the changes."""
        if key in self.before:
            return self.before[key] is not _ABSENT
        return key in self.target

    def old_values(self) -> dict[Any, Any]:
        """The changed keys that had a value before, with that value."""
        return {k: v for k, v in self.before.items() if v is not _ABSENT}

    def undo(self) -> None:
        target = self.target
        for key, value in self.before.items():
            if value is _ABSENT:
                target.pop(key, None)
            else:
                target[key] = value
        self.before = {}


class _Journals:
    """One in-place change of a content and of its index, and what it replaced."""

    __slots__ = (
        "backends",
        "by_digest",
        "by_key",
        "content",
        "index",
        "service_ids",
        "services",
        "slots",
    )

    def __init__(self, content: KernelContent) -> None:
        index = content._index
        assert index is not None, "only a content built here is changed in place"
        self.content = content
        self.index = index
        self.services = _Journal(content.services)
        self.slots = _Journal(content.slots)
        self.backends = _Journal(content.backends)
        self.by_key = _Journal(index.by_key)
        self.by_digest = _Journal(index.by_digest)
        self.service_ids = _Journal(index.service_ids)

    def writes(self) -> Writes:
        """`diff` from the content before to the content now, over the changed keys."""
        content = self.content
        services, slots, backends = self.services, self.slots, self.backends
        writes = _writes(
            (services.old_values(), content.services, services.before),
            (slots.old_values(), content.slots, slots.before),
            (backends.old_values(), content.backends, backends.before),
        )
        if writes.services_to_upsert:
            _reset_counters_of_new_ids(writes, self.service_ids.had)
        return writes

    def undo(self) -> None:
        for journal in (
            self.services,
            self.slots,
            self.backends,
            self.by_key,
            self.by_digest,
            self.service_ids,
        ):
            journal.undo()
        self.content._index = self.index


class Change:
    """One sync made by `plan_change`: the writes, the capacity they need and `content`,
    what the maps hold once the writes are in. Exactly one of `commit()` (written) or
    `rollback()` (refused, or a write failed) ends it; until then the `current` given to
    plan_change may already be the new content."""

    __slots__ = ("_journals", "_need", "_open", "_previous", "content", "writes")

    def __init__(
        self,
        previous: KernelContent,
        content: KernelContent,
        writes: Writes,
        need: dict[str, tuple[int, int]],
        journals: _Journals | None,
    ) -> None:
        self._previous = previous
        self.content = content
        self.writes = writes
        self._need = need
        self._journals = journals
        self._open = True

    @classmethod
    def _in_place(cls, current: KernelContent, update: _Update) -> Change:
        sizes_before = (len(current.services), current.slot_count(), len(current.backends))
        journals = _Journals(current)
        try:
            update.apply(journals)
            writes = journals.writes()
            need = _required(
                sizes_before, journals.services.had, journals.backends.had, current, writes
            )
        except BaseException:
            journals.undo()
            raise
        return cls(current, current, writes, need, journals)

    def required_capacity(self) -> dict[str, tuple[int, int]]:
        """As `required_capacity` of the content before, `content` and `writes`."""
        return dict(self._need)

    def check_capacity(self, sizes: MapSizes) -> None:
        """As `check_capacity`: raises CapacityError; call before writing anything."""
        _check(self._need, sizes)

    def commit(self) -> KernelContent:
        """The writes are in the kernel: returns `content`, the new current."""
        self._end()
        self._journals = None
        return self.content

    def rollback(self) -> KernelContent:
        """The writes were not made: returns the current given to plan_change, exactly as
        it was (when a write failed half-way, the kernel holds something in between)."""
        self._end()
        if self._journals is not None:
            self._journals.undo()
            self._journals = None
        return self._previous

    def _end(self) -> None:
        if not self._open:
            raise RuntimeError("this change was already committed or rolled back")
        self._open = False


# --- diff ------------------------------------------------------------------------------


def diff(current: KernelContent, desired: KernelContent) -> Writes:
    """The writes that turn `current` into `desired`, in the order of `Writes`. Raises
    ValueError if `desired` changes the content of a set id `current` holds (a live set
    is never rewritten in place; translate never does that)."""
    if desired is current:
        return Writes()
    frontends = chain(desired.services, (k for k in current.services if k not in desired.services))
    set_ids = chain(desired.slots, (s for s in current.slots if s not in desired.slots))
    backend_ids = chain(
        desired.backends, (b for b in current.backends if b not in desired.backends)
    )
    writes = _writes(
        (current.services, desired.services, frontends),
        (current.slots, desired.slots, set_ids),
        (current.backends, desired.backends, backend_ids),
    )
    if writes.services_to_upsert:
        if current._index is not None:
            live: Mapping[int, Any] | set[int] = current._index.service_ids
        else:
            live = {v.service_id for v in current.services.values()}
        _reset_counters_of_new_ids(writes, live.__contains__)
    return writes


# One map before and after, and the keys that may differ.
_MapChange = tuple[Mapping[Any, Any], Mapping[Any, Any], Iterable[Any]]


def _writes(services: _MapChange, slots: _MapChange, backends: _MapChange) -> Writes:
    """The writes for the keys given (counters_reset aside): shared by `diff` and the
    in-place changes, whose `before` maps hold only the keys that changed."""
    writes = Writes()
    cur, new, backend_ids = backends
    for backend_id in backend_ids:
        before, after = cur.get(backend_id), new.get(backend_id)
        if after is None:
            if before is not None:
                writes.backends_to_delete.append(backend_id)
        elif before is not after and before != after:
            writes.backends_to_upsert[backend_id] = after
            if before is not None:
                writes.backends_changed.add(backend_id)

    cur_slots, new_slots, set_ids = slots
    for set_id in set_ids:
        before_set, after_set = cur_slots.get(set_id), new_slots.get(set_id)
        if after_set is None:
            if before_set is not None:
                writes.sets_to_delete[set_id] = len(before_set)
        elif before_set is None:
            writes.sets_to_write[set_id] = after_set
        elif before_set is not after_set and before_set != after_set:
            raise ValueError(f"set {set_id} would be rewritten in place")

    cur_services, new_services, frontends = services
    for key in frontends:
        old_value, new_value = cur_services.get(key), new_services.get(key)
        if new_value is None:
            if old_value is not None:
                writes.frontends_to_delete.append(key)
        elif old_value is not new_value and old_value != new_value:
            writes.services_to_upsert[key] = new_value
    return writes


def _reset_counters_of_new_ids(writes: Writes, was_live: Callable[[int], bool]) -> None:
    fresh = {v.service_id for v in writes.services_to_upsert.values()}
    writes.counters_reset.extend(sorted(s for s in fresh if not was_live(s)))


# --- capacity --------------------------------------------------------------------------


def required_capacity(
    current: KernelContent, desired: KernelContent, writes: Writes
) -> dict[str, tuple[int, int]]:
    """Entries each map needs: (steady, peak). The peak is during the apply, when the new
    sets, backends and frontends are written before the old ones are deleted. For
    `services` it is also at least the highest service id + 1 (ids index the counters)."""
    sizes_before = (len(current.services), current.slot_count(), len(current.backends))
    return _required(
        sizes_before, current.services.__contains__, current.backends.__contains__, desired, writes
    )


def _required(
    sizes_before: tuple[int, int, int],
    had_frontend: Callable[[FrontendKey], bool],
    had_backend: Callable[[int], bool],
    desired: KernelContent,
    writes: Writes,
) -> dict[str, tuple[int, int]]:
    services_before, slots_before, backends_before = sizes_before
    new_frontends = sum(1 for k in writes.services_to_upsert if not had_frontend(k))
    new_backends = sum(1 for b in writes.backends_to_upsert if not had_backend(b))
    new_slots = sum(map(len, writes.sets_to_write.values()))
    services_peak = services_before + new_frontends
    index = desired._index
    if index is not None and index.service_id_overflow:
        services_peak = max(services_peak, index.service_id_overflow + 1)
    return {
        "services": (len(desired.services), services_peak),
        "slots": (desired.slot_count(), slots_before + new_slots),
        "backends": (len(desired.backends), backends_before + new_backends),
    }


def check_capacity(
    current: KernelContent, desired: KernelContent, writes: Writes, sizes: MapSizes
) -> None:
    """Raise CapacityError for the first map (services, slots, backends) whose peak need
    exceeds its size; call before writing anything."""
    _check(required_capacity(current, desired, writes), sizes)


def _check(need: dict[str, tuple[int, int]], sizes: MapSizes) -> None:
    for name in MAPS:
        peak = need[name][1]
        size = getattr(sizes, name)
        if peak > size:
            raise CapacityError(name, peak, size)
