"""Map contents as bytes and back: the values of maps.py packed with the layouts
abi.py derives from bpf/include/kbp_abi.h, and the kernel's maps decoded into a
KernelContent."""

from __future__ import annotations

import functools
from struct import Struct

from .abi import addr_bytes, addr_text, const, packer, port_bytes
from .external import SourceRange
from .libbpf import Map
from .maps import BackendValue, FrontendKey, KernelContent, ServiceValue

_FRONTEND_KEY = packer("kbp_frontend_key")
_SERVICE = packer("kbp_service")
_BACKEND = packer("kbp_backend")
_SRC_RANGE_KEY = packer("kbp_src_range_key")
_U32 = Struct("=I")  # a backend id key, a service id index
_SLOT_ID = Struct("=I")  # the backend id after the slot's copy of the backend
_SLOT_COPY = packer("kbp_backend").size  # bytes of that copy at the start of a slot
_BROKEN = 0  # backend id 0 is never allocated: marks a set no wanted set can equal


_addr = addr_bytes  # inet_pton: cheaper than a cache that 100k backend addresses thrash


_port = functools.lru_cache(maxsize=1 << 16)(port_bytes)  # 65536 ports: never thrashes


def frontend_key(key: FrontendKey) -> bytes:
    return _FRONTEND_KEY.pack(_addr(key.addr), _port(key.port), key.proto, key.family)


def service_value(v: ServiceValue) -> bytes:
    return _SERVICE.pack(
        v.service_id,
        v.flags,
        v.set_id,
        v.count,
        v.internal_set_id,
        v.internal_count,
        v.affinity_timeout,
        v.type,
    )


def slot_key(index: int) -> bytes:
    """The kbp_slots key of a slot: its index in the array (a set's first slot + i)."""
    return _U32.pack(index)


def slot_value(backend_id: int, backend: bytes) -> bytes:
    """A slot: `backend`, the backend's kbp_backends value (backend_value), then its id."""
    return backend + _SLOT_ID.pack(backend_id)


def slot_backend_id(raw: bytes) -> int:
    """The backend id a kbp_slots value names."""
    return _SLOT_ID.unpack_from(raw, _SLOT_COPY)[0]


def slot_backend_copy(raw: bytes) -> bytes:
    """The copy of the backend's kbp_backends value a kbp_slots value starts with (what
    the programs read for a new flow)."""
    return bytes(raw[:_SLOT_COPY])


SLOT_SIZE = _SLOT_COPY + _SLOT_ID.size  # bytes of a kbp_slots value
NO_COPY = bytes(_SLOT_COPY)  # a slot copy of nothing, for synthetic slots (bench/maps.py)
FREE_SLOT = bytes(SLOT_SIZE)  # a free slot (no set's): service id 0, backend id 0


def backend_key(backend_id: int) -> bytes:
    return _U32.pack(backend_id)


def backend_value(v: BackendValue) -> bytes:
    return _BACKEND.pack(_addr(v.addr), _port(v.port), v.family, v.flags, v.service_id)


def decode_frontend_key(raw: bytes) -> FrontendKey:
    addr, port, proto, family = _FRONTEND_KEY.unpack(raw)
    return FrontendKey(addr_text(addr, family), int.from_bytes(port, "big"), proto, family)


def decode_service(raw: bytes) -> ServiceValue:
    return ServiceValue(*_SERVICE.unpack(raw))


def decode_backend(raw: bytes) -> BackendValue:
    addr, port, family, flags, service_id = _BACKEND.unpack(raw)
    return BackendValue(addr_text(addr, family), int.from_bytes(port, "big"), family, flags,
                        service_id)  # fmt: skip


def decode_src_range_key(raw: bytes) -> SourceRange:
    """A kbp_src_ranges key back into the entry external.py made it from."""
    prefixlen, fe_addr, fe_port, proto, family, addr = _SRC_RANGE_KEY.unpack(raw)
    frontend = FrontendKey(addr_text(fe_addr, family), int.from_bytes(fe_port, "big"), proto,
                           family)  # fmt: skip
    network = f"{addr_text(addr, family)}/{prefixlen - const.KBP_SRC_RANGE_FRONTEND_BITS}"
    return SourceRange(frontend, network)


def percpu_sums(table: Map, struct: str) -> dict[int, tuple[int, ...]]:
    """A per-CPU array of `struct kbp_<...>` (e.g. kbp_counters): index → each field summed
    over the CPUs (one value per possible CPU, each padded to 8 bytes)."""
    fmt = packer(struct)
    stride = (fmt.size + 7) // 8 * 8
    out = {}
    for key, value in table.items():
        per_cpu = [fmt.unpack_from(value, cpu * stride) for cpu in range(len(value) // stride)]
        out[_U32.unpack(key)[0]] = tuple(sum(column) for column in zip(*per_cpu, strict=True))
    return out


def read_content(services: Map, slots: Map, backends: Map) -> KernelContent:
    """What the kernel holds now. The sets are the runs of kbp_slots the frontends name,
    each under its first index (its set id); slots no frontend names are free (a set an
    interrupted writer wrote and never pointed at is garbage nobody reads). A set with a
    free slot (a writer interrupted between slots), a copy that disagrees with its
    backend, or a count that disagrees with another frontend's is kept (so the diff
    deletes it) but never equals a wanted set, so services get a freshly written one."""
    frontends = {decode_frontend_key(k): decode_service(v) for k, v in services.items()}
    raw_backends = dict(backends.items())
    named: dict[int, int] = {}  # first index -> the most slots a frontend says it has
    for value in frontends.values():
        for set_id, count in ((value.set_id, value.count),
                              (value.internal_set_id, value.internal_count)):  # fmt: skip
            if set_id and count:
                named[set_id] = max(named.get(set_id, 0), count)
    size = slots.info.max_entries
    raw = slots.values_array(size) if named else b""
    sets: dict[int, tuple[int, ...]] = {}
    for set_id, count in named.items():
        members = []
        whole = set_id + count <= size
        for index in range(set_id, min(set_id + count, size)):
            v = raw[index * SLOT_SIZE : (index + 1) * SLOT_SIZE]
            backend_id = _SLOT_ID.unpack_from(v, _SLOT_COPY)[0]
            members.append(backend_id)
            # An agent stopped between a backend's flag change and the rewrite of its
            # slots' copies leaves them disagreeing: the set is rewritten.
            if not backend_id or v[:_SLOT_COPY] != raw_backends.get(_U32.pack(backend_id)):
                whole = False
        sets[set_id] = tuple(members) if whole else (_BROKEN, *members)
    for value in frontends.values():
        for set_id, count in ((value.set_id, value.count),
                              (value.internal_set_id, value.internal_count)):  # fmt: skip
            if set_id in sets and count and len(sets[set_id]) != count:
                sets[set_id] = (_BROKEN, *sets[set_id])
    ends = {_U32.unpack(k)[0]: decode_backend(v) for k, v in raw_backends.items()}
    return KernelContent(services=frontends, slots=sets, backends=ends)


# --- kbp_meta: which NodeState the maps hold -------------------------------------------

_SOCK_SLOT = packer("kbp_sock_slot")  # cookie, then struct kbp_sock_peer as bytes
_SOCK_PEER = packer("kbp_sock_peer")  # backend, frontend, ports, service id, family


def sock_slot_service(slots: Map, cookie: int, peer: bytes, peer_port: bytes) -> int | None:
    """The service id in the record of the socket with this cookie, if it holds its slot
    of kbp_sock_slots (bpf/lib/sock.h, "Records") and that record names its peer (address
    as addr_bytes gives it, port as port_bytes); None otherwise."""
    raw = slots.lookup(_U32.pack(cookie % const.KBP_SOCK_SLOTS))
    if raw is None:
        return None
    holder, record = _SOCK_SLOT.unpack(raw)
    backend, _frontend, backend_port, _port, service_id, _family = _SOCK_PEER.unpack(record)
    if holder != cookie or backend != peer or backend_port != peer_port:
        return None
    return service_id


_META = packer("kbp_meta")
REVISION_PREFIX = "sha256:"
NO_META = bytes(_META.size)  # "unknown": nothing applied, or an apply did not complete


def meta_value(revision: str, applied_ns: int, services: int, backends: int) -> bytes:
    """kbp_meta for a NodeState revision (`sha256:<64 hex>`)."""
    digest = bytes.fromhex(revision.removeprefix(REVISION_PREFIX))
    return _META.pack(digest, applied_ns, services, backends)


def meta_revision(raw: bytes | None) -> str | None:
    """The revision a kbp_meta value names; None when it names none."""
    if not raw or raw[:32] == bytes(32):
        return None
    digest, _applied, _services, _backends = _META.unpack(raw[: _META.size])
    return REVISION_PREFIX + digest.hex()
