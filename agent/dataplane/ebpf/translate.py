"""NodeState → the contents of the kernel maps: the per-entry translation the planner
(plan.py) runs on the entries that changed, the adoption of ids from a content decoded
from the kernel, and `translate`, every entry translated in one pass: the oracle the
planner is tested against (the agent itself plans only through plan.py). Pure Python: no
kernel, bcc or netlink here.

Ids are stable: a ServiceEntry keeps its service id, a (service, endpoint) its backend id
and an unchanged backend set its set id across syncs and agent restarts (adopted from
what the kernel holds). A set is never rewritten in place: changed content gets a new set
id, written in full before the services flip to it (docs/ebpf.md, "Ordered writes").
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any

from ...gcpause import gc_paused
from ...model.nodestate import (
    FRONTEND_KINDS,
    Backend,
    NodeState,
    ServiceEntry,
    uses_endpoints,
)
from .abi import FAMILIES, FRONTEND_FLAGS, FRONTEND_TYPES, PROTOCOLS, const
from .maglev import DEFAULT_TABLE_SIZE, check_table_size, maglev_table
from .maps import (
    BackendValue,
    FrontendKey,
    KernelContent,
    MapSizes,
    ServiceValue,
    SetContent,
    SortKey,
)

# KBP_FE_* number → its frontend type (the model's table).
_KINDS = {FRONTEND_TYPES[name]: kind for name, kind in FRONTEND_KINDS.items()}
_IPV6 = const.KBP_FAMILY_IPV6
_HAS_ENDPOINTS = const.KBP_SVC_F_HAS_ENDPOINTS
_AFFINITY = const.KBP_SVC_F_AFFINITY
_MAGLEV = const.KBP_SVC_F_MAGLEV
_RANDOM = const.KBP_SVC_F_RANDOM
_SOURCE_RANGES = const.KBP_SVC_F_SOURCE_RANGES
_LOCAL = const.KBP_BE_F_LOCAL
_TERMINATING = const.KBP_BE_F_TERMINATING


# --- how a content was built (the planner keeps it beside the content) ----------------


@dataclass(frozen=True, slots=True)
class EntryPlan:
    """What one ServiceEntry owns in a content."""

    entry: ServiceEntry
    service_id: int  # 0: the entry programs nothing (no frontend of its own)
    frontends: tuple[FrontendKey, ...]
    set_ids: tuple[int, ...]
    backend_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ContentIndex:
    """How a planner built its content: its plans and the figures its next sync needs."""

    maglev_table_size: int
    sizes: MapSizes
    by_key: dict[SortKey, EntryPlan]
    by_digest: dict[bytes, EntryPlan]  # entries that carry a digest
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


# --- the oracle ------------------------------------------------------------------------


def translate(
    state: NodeState,
    current: KernelContent,
    *,
    built: ContentIndex | None = None,
    maglev_table_size: int = DEFAULT_TABLE_SIZE,
    sizes: MapSizes | None = None,
) -> KernelContent:
    """What the maps should hold for `state`, translating every entry and reusing the ids
    of `current` (the content the kernel holds now: decoded from the maps, or a planner's
    content, with `built` its planner's index), which stays as it is. The tests' oracle:
    a `Planner` given the same must plan exactly this.

    Raises ValueError when the Maglev table size is not prime or too small for a
    Service's backends. Ids never exceed the map sizes unless the maps are too small:
    `check_capacity` then reports it.
    """
    check_table_size(maglev_table_size)
    with gc_paused():  # ~10^5 acyclic values: generation-2 passes would double the time
        return _Full(state, current, built, maglev_table_size, sizes or MapSizes()).run()


def _canonical(ip: str) -> str:
    """The model's canonical text (inet_ntop) except for IPv6 with an embedded IPv4 part,
    which `ipaddress` writes in hex: the kernel side decodes with `ipaddress`."""
    if "." in ip and ":" in ip:
        return str(ipaddress.IPv6Address(ip))
    return ip


def _maglev_name(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Ids:
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
        if not FRONTEND_KINDS[f.type].source_ranges or not f.source_ranges:
            continue
        family = FAMILIES[entry.ip_family]
        key = FrontendKey(_canonical(f.ip), f.port, PROTOCOLS[entry.protocol], family)
        found[key] = tuple(str(ipaddress.ip_network(r, strict=False)) for r in f.source_ranges)
    return found


class EntryBuilder:
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
        self.service_id_alloc: Ids
        self.set_id_alloc: Ids
        self.backend_id_alloc: Ids

    @staticmethod
    def frontend_keys(entry: ServiceEntry) -> dict[FrontendKey, int]:
        """The entry's frontends as keys → KBP_FE_* (the first type wins on a repeat)."""
        family = FAMILIES[entry.ip_family]
        proto = PROTOCOLS[entry.protocol]
        keys: dict[FrontendKey, int] = {}
        for f in entry.frontends:
            key = FrontendKey(_canonical(f.ip), f.port, proto, family)
            if key not in keys:
                keys[key] = FRONTEND_TYPES[f.type]
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
        family = FAMILIES[entry.ip_family]
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
    ) -> EntryPlan:
        """Write `entry` with `service_id` under `keys`; backend and set ids come from the
        known_* maps when their content matches, else are new."""
        # Only the sets some frontend uses (docs/nodestate.md): a ClusterIP uses one set whoever
        # sends; an external frontend uses its policy's set from outside and the cluster
        # set from pods. A set nobody points at could not be adopted after a restart.
        kinds = {number: _KINDS[number] for number in keys.values()}
        wants_cluster, wants_local = uses_endpoints(
            entry.internal_traffic_policy,
            entry.external_traffic_policy,
            (kind.name for kind in kinds.values()),
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
        # Per type: (the set from outside, the set for pods and the node).
        sets = {
            number: (local if entry.uses_local(kind.name) else cluster,
                     local if entry.uses_local(kind.name, from_outside=False) else cluster)
            for number, kind in kinds.items()
        }  # fmt: skip

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
            (set_id, count), (inner_id, inner_count) = sets[kind]
            key_flags = flags | FRONTEND_FLAGS[kind]
            if ranged and key in ranged and kinds[kind].source_ranges:
                key_flags |= _SOURCE_RANGES
            services[key] = ServiceValue(
                service_id, key_flags, set_id, count, inner_id, inner_count, timeout or 0, kind,
            )  # fmt: skip
        self.service_ids[service_id] = entry.sort_key
        return EntryPlan(
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
        self, plan: EntryPlan
    ) -> tuple[dict[tuple[str, int], int], dict[SetContent, int]]:
        """The backend and set ids an entry owned in `current`, by content."""
        current = self.current
        known_backends = {}
        for backend_id in plan.backend_ids:
            b = current.backends[backend_id]
            known_backends[(b.addr, b.port)] = backend_id
        known_sets = {current.slots[s]: s for s in plan.set_ids}
        return known_backends, known_sets


def live_ids(current: KernelContent) -> tuple[set[int], set[int], set[int]]:
    """The service, set and backend ids `current` uses in any way: they stay reserved
    until it is gone, so a new id never names something a packet or a conntrack entry
    may still find under it."""
    live_services = current.service_ids()
    live_services.update(b.service_id for b in current.backends.values())
    live_sets = set(current.slots)
    for v in current.services.values():
        live_sets.add(v.set_id)
        live_sets.add(v.internal_set_id)
    live_backends = set(current.backends)
    live_backends.update(chain.from_iterable(current.slots.values()))
    return live_services, live_sets, live_backends


def full_allocators(
    builder: EntryBuilder, current: KernelContent, built: ContentIndex | None, sizes: MapSizes
) -> None:
    """The id allocators of a pass over every entry into `builder`'s (empty) maps: ids
    `current` uses are taken; the cursors go on from `built`'s, else from the highest
    live id."""
    live_services, live_sets, live_backends = live_ids(current)
    if built is not None and built.sizes == sizes:
        cursors = built.cursors
    else:
        cursors = (
            _cursor_after(live_services, sizes.services),
            _cursor_after(live_sets, sizes.slots),
            _cursor_after(live_backends, sizes.backends),
        )
    builder.service_id_alloc = Ids(sizes.services, cursors[0], (live_services, builder.service_ids))
    builder.set_id_alloc = Ids(sizes.slots, cursors[1], (live_sets, builder.slots))
    builder.backend_id_alloc = Ids(sizes.backends, cursors[2], (live_backends, builder.backends))


class Adoption:
    """The ids a content decoded from the kernel gives the entries, known there only by
    their frontends: a restarted agent keeps every id an earlier one handed out."""

    def __init__(self, current: KernelContent) -> None:
        self.current = current
        self._by_service: dict[int, dict[tuple[str, int], int]] | None = None

    def service_ids(self, owned: list[dict[FrontendKey, int]]) -> list[int]:
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
                    if only_cluster_ips and not _KINDS[kind].unique:
                        continue
                    value = services.get(key)
                    if value is not None and value.service_id and value.service_id not in taken:
                        result[i] = value.service_id
                        taken.add(value.service_id)
                        break
        return result

    def backends_of(self, service_id: int) -> dict[tuple[str, int], int]:
        if self._by_service is None:
            by_service: dict[int, dict[tuple[str, int], int]] = {}
            for backend_id, b in self.current.backends.items():
                by_service.setdefault(b.service_id, {})[(b.addr, b.port)] = backend_id
            self._by_service = by_service
        return self._by_service.get(service_id, {})

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


class _Full:
    """Translate every entry, adopting ids from `current` (and from how it was built, when
    `built` says)."""

    def __init__(
        self,
        state: NodeState,
        current: KernelContent,
        built: ContentIndex | None,
        maglev_table_size: int,
        sizes: MapSizes,
    ) -> None:
        self.state = state
        self.current = current
        self.index = built
        self.maglev_table_size = maglev_table_size
        self.sizes = sizes

    def run(self) -> KernelContent:
        current, sizes, index = self.current, self.sizes, self.index
        out = KernelContent()
        builder = EntryBuilder(
            current, self.maglev_table_size, sizes, out.services, out.slots, out.backends
        )
        full_allocators(builder, current, index, sizes)
        entries = self.state.services
        # Who answers each frontend: the first entry in NodeState order that asks for it.
        owned = [builder.owned(builder.frontend_keys(e)) for e in entries]
        adoption = Adoption(current)
        if index is not None:  # built by a planner: entries are known by their sort keys
            service_ids = []
            for entry in entries:
                old = index.by_key.get(entry.sort_key)
                service_ids.append(old.service_id if old is not None else 0)
        else:  # decoded from the kernel: entries are known by their frontends
            service_ids = adoption.service_ids(owned)

        for entry, keys, service_id in zip(entries, owned, service_ids, strict=True):
            if not keys:
                continue
            known_backends: Mapping[tuple[str, int], int] = {}
            known_sets: Mapping[SetContent, int] = {}
            if not service_id:
                service_id = builder.service_id_alloc.take()
            elif index is not None:
                known_backends, known_sets = builder.known_from_plan(index.by_key[entry.sort_key])
            else:
                known_backends = adoption.backends_of(service_id)
                known_sets = adoption.sets_of(keys, service_id)
            builder.translate(entry, keys, service_id, known_backends, known_sets)
        return out


DIGEST = attrgetter("digest")


def entries_if_keyed(
    entries: tuple[ServiceEntry, ...],
    by_key: Mapping[SortKey, EntryPlan],
    by_digest: Mapping[bytes, EntryPlan],
) -> tuple[ServiceEntry, ...] | None:
    """`entries` if each has a plan of its own (see `ContentIndex.entries`); the caller knows
    that every entry is sealed and `by_digest` holds only the digests of their plans."""
    n = len(entries)
    return entries if len(by_key) == n and len(by_digest) == n else None
