"""The kernel ABI as Python sees it: cffi parses bpf/include/kbp_abi.h itself, so struct
layouts and constants are derived from the one header the C programs include."""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from struct import Struct
from types import SimpleNamespace
from typing import Any

import cffi

from ...model.nodestate import FRONTEND_KINDS

BPF_DIR = Path(__file__).resolve().parents[3] / "bpf"
ABI_HEADER = BPF_DIR / "include" / "kbp_abi.h"

# The kernel's fixed-width types as cffi knows them; byte order is the reader's business
# (the header says __be* where it is network order).
_KERNEL_TYPES = """
typedef uint8_t __u8;
typedef uint16_t __u16;
typedef uint32_t __u32;
typedef uint64_t __u64;
typedef uint16_t __be16;
typedef uint32_t __be32;
"""

_DEFINE = re.compile(r"^#define\s+(KBP_\w+)\s+(\d+)\b", re.MULTILINE)
_GUARD = re.compile(r"^#(ifndef|define|endif)\b.*$", re.MULTILINE)


def _header_text() -> str:
    return ABI_HEADER.read_text(encoding="utf-8")


def _constants(text: str) -> dict[str, int]:
    return {name: int(value) for name, value in _DEFINE.findall(text)}


def _cdef_text(text: str) -> str:
    """The header without preprocessor lines; the integer #defines go in as constants."""
    without_comments = re.sub(r"/\*.*?\*/", "", text, flags=re.DOTALL)
    body = _GUARD.sub("", without_comments)
    if "#" in body:
        raise ValueError(f"{ABI_HEADER}: only include guards and integer #defines allowed")
    return body


def _build() -> tuple[cffi.FFI, SimpleNamespace]:
    text = _header_text()
    ffi = cffi.FFI()
    ffi.cdef(_KERNEL_TYPES + _cdef_text(text))
    return ffi, SimpleNamespace(**_constants(text))


ffi, const = _build()

# Every struct of the header, in header order.
STRUCTS: tuple[str, ...] = tuple(re.findall(r"^struct (kbp_\w+) \{", _header_text(), re.M))


def named(prefix: str, count: str) -> dict[int, str]:
    """value → name of each constant <prefix>X but `count` (KBP_DROP_NO_BACKEND → no-backend)."""
    return {
        value: name.removeprefix(prefix).lower().replace("_", "-")
        for name, value in vars(const).items()
        if name.startswith(prefix) and name != count
    }


# kbp_drops index → the reason label of /metrics' kbp_datapath_drops_total and `inspect`.
DROP_REASONS = named("KBP_DROP_", "KBP_DROP_REASONS")

# The NodeState's names → the ABI's numbers. Each frontend type has its KBP_FE_<TYPE> in
# kbp_abi.h, the type's name in upper snake case (ClusterIP → KBP_FE_CLUSTER_IP).
PROTOCOLS = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": socket.IPPROTO_SCTP}
FAMILIES = {"IPv4": const.KBP_FAMILY_IPV4, "IPv6": const.KBP_FAMILY_IPV6}
FRONTEND_TYPES = {
    name: getattr(const, "KBP_FE_" + re.sub("(?<=[a-z])(?=[A-Z])", "_", name).upper())
    for name in FRONTEND_KINDS
}
# What the programs learn of a frontend's type, by KBP_FE_* number: the KBP_SVC_F_* bits
# its row of the model's table gives every frontend of that type. (KBP_SVC_F_SOURCE_RANGES
# goes only on a frontend of a type with source ranges that has some: translate.py.)
FRONTEND_FLAGS = {
    FRONTEND_TYPES[name]: const.KBP_SVC_F_EXTERNAL if kind.external else 0
    for name, kind in FRONTEND_KINDS.items()
}
PROTOCOL_NAMES = {number: name for name, number in PROTOCOLS.items()}

MAPS_HEADER = BPF_DIR / "include" / "kbp_maps.h"


@dataclass(frozen=True)
class MapDecl:
    """One map as bpf/include/kbp_maps.h declares it (the only declaration)."""

    name: str
    type: str  # bcc's table type: hash, lru_hash, array, percpu_array, lpm_trie, ...
    key: str  # C type, e.g. "struct kbp_frontend_key"
    value: str
    size: str  # max_entries: a KBP_MAX_* setting (-D from MapSizes), a constant or a number


_MAP_DECL = re.compile(
    r'^BPF_TABLE_PINNED\(\s*"(\w+)",\s*([^,]+?),\s*([^,]+?),\s*(kbp_\w+),\s*(\w+)', re.M
)
MAPS: dict[str, MapDecl] = {
    m[3]: MapDecl(m[3], m[0], m[1], m[2], m[4])
    for m in _MAP_DECL.findall(MAPS_HEADER.read_text(encoding="utf-8"))
}
MAP_NAMES: tuple[str, ...] = tuple(MAPS)


# Maps of socket storage, read and written only through a socket: userspace cannot
# iterate them (the kernel answers a dump with ENOTSUPP).
SOCKET_STORAGE = frozenset({"kbp_sock_peer"})


def versioned(name: str) -> str:
    """`kbp_services` → `kbp_services_v<N>`, N being KBP_ABI_VERSION: the map's name and
    pin file name."""
    return f"{name}_v{const.KBP_ABI_VERSION}"


def layout(struct: str) -> list[tuple[str, int, int]]:
    """(field, offset, size) of a struct, in declaration order."""
    ctype = ffi.typeof(f"struct {struct}")
    return [(name, f.offset, ffi.sizeof(f.type)) for name, f in ctype.fields]


def implicit_padding(struct: str) -> list[tuple[int, int]]:
    """(offset, size) of every hole the compiler would add, tail included; must be empty."""
    holes, end = [], 0
    for _name, offset, size in layout(struct):
        if offset > end:
            holes.append((end, offset - end))
        end = offset + size
    total = ffi.sizeof(f"struct {struct}")
    if total > end:
        holes.append((end, total - end))
    return holes


# Addresses: four __be32 words; cffi sees them as uint32 in host order, so each word holds
# the bytes of the address as they sit in memory (network order), read natively.


def family_of(ip: str) -> int:
    return const.KBP_FAMILY_IPV6 if ":" in ip else const.KBP_FAMILY_IPV4


def addr_bytes(ip: str) -> bytes:
    """16 bytes as the kernel stores them: IPv4 then 12 zero bytes, or IPv6.
    inet_pton, not ipaddress: this runs once per backend of a full sync (~20x faster)."""
    if ":" in ip:
        return socket.inet_pton(socket.AF_INET6, ip)
    return socket.inet_pton(socket.AF_INET, ip) + _V4_PAD


_V4_PAD = bytes(12)


def addr_text(raw: bytes, family: int) -> str:
    """The inverse of addr_bytes."""
    if family == const.KBP_FAMILY_IPV4:
        return str(ipaddress.IPv4Address(bytes(raw[:4])))
    return str(ipaddress.IPv6Address(bytes(raw[:16])))


def set_addr(field: Any, ip: str) -> None:
    """Write an address into a cffi `__be32[4]` field."""
    ffi.memmove(field, addr_bytes(ip), 16)


def get_addr(field: Any, family: int) -> str:
    return addr_text(bytes(ffi.buffer(field, 16)), family)


def be16(value: int) -> int:
    """A host-order port as a __be16 field holds it, read natively."""
    return int.from_bytes(value.to_bytes(2, "big"), sys.byteorder)


def from_be16(value: int) -> int:
    """The host-order port in a __be16 field."""
    return int.from_bytes(value.to_bytes(2, sys.byteorder), "big")


def new(struct: str, **fields: Any) -> Any:
    """A zeroed struct with the given fields set as cffi takes them (raw values)."""
    obj = ffi.new(f"struct {struct} *")
    for name, value in fields.items():
        setattr(obj, name, value)
    return obj


def to_bytes(obj: Any) -> bytes:
    return bytes(ffi.buffer(obj))


def from_bytes(struct: str, raw: bytes) -> Any:
    obj = ffi.new(f"struct {struct} *")
    ffi.memmove(obj, raw, ffi.sizeof(obj[0]))
    return obj


# Fast packing: a struct.Struct per ABI struct, derived from cffi's layout (not written by
# hand), for the hot paths that encode 100k+ elements per full sync. Fields in order;
# `pad*` fields are zero bytes; network-order fields (__be16, __be32 arrays) are raw
# bytes the caller supplies in network order (see addr_bytes, port_bytes).

_SCALAR = {"uint8_t": "B", "uint16_t": "H", "uint32_t": "I", "uint64_t": "Q"}


def _network_order_fields() -> dict[tuple[str, str], str]:
    """(struct, field) → declared __be* type, read from the header (cffi sees only the
    underlying integer type)."""
    found = {}
    text = _cdef_text(_header_text())
    for struct, body in re.findall(r"struct (kbp_\w+) \{(.*?)\};", text, re.DOTALL):
        for ctype, name in re.findall(r"(__be\d+)\s+(\w+)", body):
            found[(struct, name)] = ctype
    return found


def _field_format(struct: str, name: str, ctype: Any, network: dict) -> str:
    if name.startswith("pad"):
        return f"{ffi.sizeof(ctype)}x"
    if ctype.kind in ("array", "struct") or (struct, name) in network:
        return f"{ffi.sizeof(ctype)}s"
    return _SCALAR[ctype.cname]


@functools.cache
def packer(struct: str) -> Struct:
    """struct.Struct for `struct <struct>`; its fields are the non-pad fields in order."""
    ctype = ffi.typeof(f"struct {struct}")
    network = _network_order_fields()
    fmt = "=" + "".join(_field_format(struct, name, f.type, network) for name, f in ctype.fields)
    packed = Struct(fmt)
    if packed.size != ffi.sizeof(ctype):
        raise AssertionError(f"struct {struct}: packer size {packed.size} != {ffi.sizeof(ctype)}")
    return packed


def port_bytes(port: int) -> bytes:
    return port.to_bytes(2, "big")
