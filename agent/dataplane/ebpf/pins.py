"""The pins under the pin directory, looked at before bcc opens them: which are our maps
as the text about to load defines them (reused), which are ours at another size (moved
into maps of the new size), and which are someone else's (reported, never touched).

bcc's BPF_TABLE_PINNED opens whatever is pinned at a map's path and uses it as it is: a
map of another shape there makes the verifier reject the programs with a dump that never
names the pin, and one of another size keeps that size for ever. So the shapes the text
will create are derived here, from the one declaration of every map (BPF_TABLE_PINNED in
bpf/include/kbp_maps.h) and the struct sizes cffi reads from the ABI header (abi.py):
no list of shapes is kept by hand, and a kernel test checks the derivation against the
maps bcc really creates. The pins are read with BPF_OBJ_GET and BPF_OBJ_GET_INFO_BY_FD,
their key and value type names from the map's BTF (libbpf's btf__ functions).

A move (`Moves`): the old pin is renamed aside (bpffs renames within a directory), bcc
creates the map of the new size at the name, the entries are copied, and the aside pin
is removed once this agent's programs have replaced the earlier agent's, which keep
using the old maps until then (attach.py): conntrack entries the old programs create
meanwhile are copied again at that point.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import operator
import os
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cffi

from . import libbpf
from .abi import MAPS_HEADER, const, versioned
from .abi import ffi as abi_ffi
from .libbpf import BPF_NOEXIST, Map
from .options import FLAG_MAP_SIZES

log = logging.getLogger(__name__)

# Where a pin being moved waits (kbp_ct_v4 -> kbp_ct_v4-resizing) until the move is done.
# Not a version suffix: remove_stale_pins and adopt_earlier_conntrack never take it for
# another ABI version's map, and `cleanup` removes it with the other kbp_ pins. (Not a
# dot: bpffs refuses names with dots, EPERM, keeping them for its own files.)
ASIDE_SUFFIX = "-resizing"

# enum bpf_map_type (include/uapi/linux/bpf.h) by bcc's table type name, and how a line
# names each.
MAP_TYPES = {
    "hash": 1, "array": 2, "percpu_hash": 5, "percpu_array": 6, "lru_hash": 9,
    "lru_percpu_hash": 10, "lpm_trie": 11, "sk_storage": 24,
}  # fmt: skip
_TYPE_WORDS = {
    1: "a hash", 2: "an array", 5: "a per-CPU hash", 6: "a per-CPU array", 9: "an LRU hash",
    10: "a per-CPU LRU hash", 11: "an LPM trie", 24: "a socket storage map",
}  # fmt: skip
_ARRAYS = frozenset({2, 6})
_LRU = frozenset({9, 10})
# Map flags a declaration may name (include/uapi/linux/bpf.h).
_FLAGS = {"BPF_F_NO_PREALLOC": 1, "BPF_F_NO_COMMON_LRU": 2}
_C_SIZES = {"int": 4}  # C types the declarations use that the ABI header does not define
_SERVICE_MAPS = ("kbp_services", "kbp_slots", "kbp_backends")  # one content: the writer's
# bcc names a map after its C name, cut to BPF_OBJ_NAME_LEN - 1 characters.
NAME_LEN = 15


class ForeignPinError(Exception):
    """A pin with one of our names holds a map that is not ours; nothing was touched.
    The message has one clause per such pin, each naming its path."""


# --- what the text will create ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """What makes a map ours: what BPF_OBJ_GET_INFO_BY_FD and its BTF say of it."""

    type: int  # enum bpf_map_type
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str  # the kernel's name of the map (bcc: its C name, cut to NAME_LEN)
    key_type: str | None = None  # BTF type names; None: the map has no BTF
    value_type: str | None = None


@dataclass(frozen=True, slots=True)
class Declaration:
    """A BPF_TABLE_PINNED(type, key, value, name, max_entries, pin[, flags]) of the header,
    its arguments as C text."""

    type: str
    key: str
    value: str
    name: str
    max_entries: str
    flags: str = "0"


def _arguments(text: str, start: int) -> list[str]:
    """The top-level arguments of the macro call whose "(" is at text[start]."""
    depth, args, current = 0, [], []
    for char in text[start:]:
        if char == "(":
            depth += 1
            if depth == 1:
                continue
        elif char == ")":
            depth -= 1
            if depth == 0:
                args.append("".join(current).strip())
                return args
        elif char == "," and depth == 1:
            args.append("".join(current).strip())
            current = []
            continue
        current.append(char)
    raise ValueError(f"{MAPS_HEADER}: unterminated BPF_TABLE_PINNED")


@functools.cache
def declarations() -> dict[str, Declaration]:
    """Every pinned map of bpf/include/kbp_maps.h by C name, in header order."""
    text = re.sub(r"/\*.*?\*/", "", MAPS_HEADER.read_text(encoding="utf-8"), flags=re.DOTALL)
    found: dict[str, Declaration] = {}
    for match in re.finditer(r"^BPF_TABLE_PINNED\s*\(", text, re.M):
        args = _arguments(text, match.end() - 1)
        kind, key, value, name, size = args[:5]
        flags = args[6] if len(args) > 6 else "0"
        found[name] = Declaration(kind.strip('"'), key, value, name, size, flags)
    return found


@functools.cache
def _header_defaults() -> dict[str, int]:
    """The header's own KBP_MAX_* defaults (those the loader does not pass with -D)."""
    text = MAPS_HEADER.read_text(encoding="utf-8")
    return {name: int(value) for name, value in re.findall(r"#define (KBP_\w+) (\d+)\b", text)}


_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.BitOr: operator.or_, ast.LShift: operator.lshift,
}  # fmt: skip


def _evaluate(expression: str, names: Mapping[str, int]) -> int:
    """A max_entries or flags argument: integers and names joined by + - * | <<."""

    def value(node: ast.expr) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name) and node.id in names:
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"{MAPS_HEADER}: cannot evaluate {expression!r}")

    return value(ast.parse(expression, mode="eval").body)


def _c_size(c_type: str) -> int:
    return _C_SIZES.get(c_type) or abi_ffi.sizeof(c_type)


def _type_name(c_type: str) -> str:
    """The BTF name of a C type: `struct kbp_ct_key` -> kbp_ct_key, `__u32` -> __u32."""
    return c_type.removeprefix("struct ").strip()


def expected(sizes: Mapping[str, int] | None = None) -> dict[str, Shape]:
    """The shape of every pinned map (by C name) that the text compiled with `sizes` (by
    MapSizes field: KBP_MAX_<FIELD>) creates."""
    names = {**vars(const), **_header_defaults(), **_FLAGS}
    names.update({f"KBP_MAX_{k.upper()}": int(v) for k, v in (sizes or {}).items()})
    shapes = {}
    for name, decl in declarations().items():
        shapes[name] = Shape(
            type=MAP_TYPES[decl.type],
            key_size=_c_size(decl.key),
            value_size=_c_size(decl.value),
            max_entries=_evaluate(decl.max_entries, names),
            flags=_evaluate(decl.flags, names),
            name=name[:NAME_LEN],
            key_type=_type_name(decl.key),
            value_type=_type_name(decl.value),
        )
    return shapes


# --- what a pin holds ---------------------------------------------------------------------

_BTF_CDEF = """
struct btf;
struct btf_type { uint32_t name_off; uint32_t info; uint32_t size_or_type; };
struct btf *btf__load_from_kernel_by_id(uint32_t id);
const struct btf_type *btf__type_by_id(const struct btf *btf, uint32_t type_id);
const char *btf__name_by_offset(const struct btf *btf, uint32_t offset);
void btf__free(struct btf *btf);
"""
_btf_ffi = cffi.FFI()
_btf_ffi.cdef(_BTF_CDEF)
# struct bpf_map_info up to btf_value_type_id (include/uapi/linux/bpf.h): six __u32, the
# 16-byte name, ifindex, btf_vmlinux_value_type_id, netns_dev, netns_ino, btf_id,
# btf_key_type_id, btf_value_type_id.
_INFO = struct.Struct("<6I16s2I2Q3I")


@functools.cache
def _btf_lib() -> Any:
    return _btf_ffi.dlopen("libbpf.so.1")


def _object_kind(fd: int) -> str:
    """map, prog or link: what the fd is, from the first `*_type:` line of its fdinfo."""
    with open(f"/proc/self/fdinfo/{fd}", encoding="ascii") as stream:
        for line in stream:
            kind, _, _ = line.partition("_type:")
            if kind in ("map", "prog", "link"):
                return kind
    return "object"


def _btf_names(btf_id: int, key_id: int, value_id: int) -> tuple[str | None, str | None]:
    if btf_id == 0 or key_id == 0 or value_id == 0:
        return None, None
    lib = _btf_lib()
    btf = lib.btf__load_from_kernel_by_id(btf_id)
    if btf == _btf_ffi.NULL:
        return None, None
    try:
        names = []
        for type_id in (key_id, value_id):
            entry = lib.btf__type_by_id(btf, type_id)
            text = lib.btf__name_by_offset(btf, entry.name_off) if entry else _btf_ffi.NULL
            names.append(_btf_ffi.string(text).decode() if text != _btf_ffi.NULL else "")
        return names[0], names[1]
    finally:
        lib.btf__free(btf)


def shape_of_fd(fd: int) -> Shape | None:
    """The shape of the map behind `fd`; None when it is not a map (a program, a link)."""
    if _object_kind(fd) != "map":
        return None
    buf = libbpf.ffi.new(f"char[{_INFO.size}]")
    size = libbpf.ffi.new("__u32 *", _INFO.size)
    rc = libbpf.lib().bpf_obj_get_info_by_fd(fd, buf, size)
    if rc < 0:  # libbpf 1.x: -errno
        code = -rc if rc != -1 else libbpf.ffi.errno
        raise OSError(code, f"map info of fd {fd}: {os.strerror(code)}")
    raw = bytes(libbpf.ffi.buffer(buf, _INFO.size))
    (kind, _id, key, value, entries, flags, name, _ifindex, _vmlinux, _dev, _ino, btf_id,
     key_id, value_id) = _INFO.unpack(raw)  # fmt: skip
    key_type, value_type = _btf_names(btf_id, key_id, value_id)
    text = name.split(b"\0", 1)[0].decode(errors="replace")
    return Shape(kind, key, value, entries, flags, text, key_type, value_type)


def shape_of_pin(path: Path) -> Shape | None:
    """The shape of the map pinned at `path` (None: the pin is not a map). OSError when
    it cannot be opened."""
    fd = libbpf.obj_get(str(path))
    try:
        return shape_of_fd(fd)
    finally:
        os.close(fd)


# --- comparing ----------------------------------------------------------------------------


def differences(ours: Shape, theirs: Shape) -> list[str]:
    """What makes `theirs` another map than `ours`, max_entries aside (a size is a setting,
    not an identity): the Shape fields that differ. BTF names count only when both maps
    have BTF: bcc creates maps without it where the kernel or clang cannot give it."""
    fields = ["type", "key_size", "value_size", "flags", "name"]
    if ours.key_type is not None and theirs.key_type is not None:
        fields += ["key_type", "value_type"]
    return [f for f in fields if getattr(ours, f) != getattr(theirs, f)]


def describe(shape: Shape, fields: Iterable[str]) -> str:
    """`an LRU hash of 40-byte keys and 80-byte values`: the type, then the fields given."""
    fields = set(fields)
    words = [_TYPE_WORDS.get(shape.type, f"a map of type {shape.type}")]
    sizes = []
    if "key_size" in fields:
        sizes.append(f"{shape.key_size}-byte keys")
    if "value_size" in fields:
        sizes.append(f"{shape.value_size}-byte values")
    if sizes:
        words.append("of " + " and ".join(sizes))
    if "flags" in fields:
        words.append(f"with flags {shape.flags:#x}")
    if "name" in fields:
        words.append(f"named {shape.name or '(no name)'}")
    if fields & {"key_type", "value_type"}:
        words.append(f"with BTF types {shape.key_type} -> {shape.value_type}")
    return " ".join(words)


def foreign_message(path: Path, ours: Shape | None, theirs: Shape | None) -> str:
    """One clause naming the pin and what differs."""
    if theirs is None:
        return f"pin {path} is not a map: not our map; it was left in place"
    if ours is None:  # another ABI version's name: only the kernel name is known
        ours_named = path.name.rpartition("_v")[0][:NAME_LEN]
        return (f"pin {path} is {describe(theirs, ['name'])}, ours are named {ours_named}: "
                "not our map; it was left in place")  # fmt: skip
    differ = differences(ours, theirs)
    return (f"pin {path} is {describe(theirs, differ)}, ours is {describe(ours, differ)}: "
            "not our map; it was left in place")  # fmt: skip


def not_ours(path: Path) -> str | None:
    """Why the pin at `path` is not one of our maps (one clause naming it), or None when it
    is ours, at whatever size and of whatever ABI version, or not a map pin of our names
    at all (links, programs and the aside pins of a move are somebody else's business).
    Used before anything of ours unlinks a pin: `cleanup`, the auto fallback's leftover
    removal, the removal of another ABI version's pins."""
    base, _, version = path.name.partition(ASIDE_SUFFIX)[0].rpartition("_v")
    if base not in declarations() or not version.isdigit():
        return None
    try:
        theirs = shape_of_pin(path)
    except OSError:
        return None  # gone meanwhile, or not a BPF object: nothing to protect
    if theirs is None:
        return foreign_message(path, None, None)
    if path.name.partition(ASIDE_SUFFIX)[0] == versioned(base):
        ours = expected()[base]
        return foreign_message(path, ours, theirs) if differences(ours, theirs) else None
    # Another ABI version: its layouts are unknown here; its maps carry our C names.
    if theirs.name != base[:NAME_LEN]:
        return foreign_message(path, None, theirs)
    return None


def foreign_pins(pin_dir: Path) -> list[str]:
    """A clause for every pin at one of this version's map paths that is not ours (the
    probe's question: may bcc open these?)."""
    if not pin_dir.is_dir():
        return []
    found = []
    for name in declarations():
        path = pin_dir / versioned(name)
        if path.exists():
            why = not_ours(path)
            if why is not None:
                found.append(why)
    return found


# --- moving maps to a new size -------------------------------------------------------------


@dataclass
class Move:
    """One map being moved: its pin, where the old map waits, both sizes."""

    name: str  # C name, kbp_ct
    pin: Path
    aside: Path
    old_entries: int
    new_entries: int
    source: Map | None = None  # the old map, open from the first copy to `finish`
    moved: int = 0


@dataclass
class Moves:
    """The maps of one load whose size changed: `prepare` before bcc runs, `undo` if the
    load failed, `copy` once the new maps exist, `finish` after the first apply."""

    pin_dir: Path
    moves: list[Move] = field(default_factory=list)

    @classmethod
    def prepare(cls, pin_dir: Path, sizes: Mapping[str, int] | None) -> Moves:
        """Check every pin the text will open; set aside those of another size.
        ForeignPinError (nothing renamed) when any is not ours."""
        plan = cls(pin_dir)
        if not pin_dir.is_dir():
            return plan
        _finish_interrupted(pin_dir)
        shapes = expected(sizes)
        foreign, resized = [], []
        for name, ours in shapes.items():
            path = pin_dir / versioned(name)
            if not path.exists():
                continue
            theirs = shape_of_pin(path)
            if theirs is None or differences(ours, theirs):
                foreign.append(foreign_message(path, ours, theirs))
            elif theirs.max_entries != ours.max_entries:
                resized.append(Move(name, path, _aside(path), theirs.max_entries,
                                    ours.max_entries))  # fmt: skip
        if foreign:
            raise ForeignPinError("; ".join(foreign))
        try:
            for move in resized:
                os.rename(move.pin, move.aside)
                plan.moves.append(move)
        except OSError:
            plan.undo()
            raise
        return plan

    def undo(self) -> None:
        """The load failed: put the old maps back at their names (a map bcc created at a
        name meanwhile is empty and goes)."""
        for move in self.moves:
            if move.source is not None:
                move.source.close()
            if move.aside.exists():
                move.pin.unlink(missing_ok=True)
                os.rename(move.aside, move.pin)
        self.moves = []

    def copy(self, target: Callable[[str], Map], meta: Map) -> None:
        """Copy every moved map's entries into the new map of its name, one log line per
        map. The old maps stay pinned aside (and open) until `finish`."""
        incomplete = False
        for move in self.moves:
            move.source = Map.pinned(str(move.aside))
            held, move.moved = copy_entries(move.source, target(move.name))
            log.info("ebpf: %s", _moved_line(move, held))
            if move.name in _SERVICE_MAPS and move.moved < held:
                incomplete = True
        if incomplete:
            # The maps no longer hold a whole revision: say "unknown" until the first apply
            # rewrites them from the state.
            from .codec import NO_META

            meta.update(bytes(4), NO_META)

    def finish(self, target: Callable[[str], Map]) -> None:
        """This agent's programs replaced the earlier agent's, the only users of the old
        maps: copy the cache entries they created since `copy`, and remove the aside pins
        (the old maps go with the last reference)."""
        for move in self.moves:
            more = 0
            if move.source is not None:
                if move.source.info.type in _LRU:
                    more = _copy_new(move.source, target(move.name))
                move.source.close()
            move.aside.unlink(missing_ok=True)
            log.info("ebpf: moved %s to %d entries: done, %d more entries the earlier "
                     "agent's programs created meanwhile; removed %s",
                     versioned(move.name), move.new_entries, more, move.aside.name)  # fmt: skip
        self.moves = []


def _aside(path: Path) -> Path:
    return path.with_name(path.name + ASIDE_SUFFIX)


def _finish_interrupted(pin_dir: Path) -> None:
    """An agent stopped in the middle of a move left an aside pin: with no map at its name
    it goes back there (the move starts again), else its entries are copied into the map
    at the name (whichever entries that one lacks) and it is removed."""
    for aside in sorted(pin_dir.glob(f"kbp_*{ASIDE_SUFFIX}")):
        pin = aside.with_name(aside.name.removesuffix(ASIDE_SUFFIX))
        if not_ours(aside) is not None:
            continue  # not ours to move or remove
        if not pin.exists():
            os.rename(aside, pin)
            continue
        if not_ours(pin) is not None:
            continue
        with Map.pinned(str(aside)) as old, Map.pinned(str(pin)) as new:
            if (old.key_size, old.value_size) == (new.key_size, new.value_size):
                copied = _copy_new(old, new)
                log.info("ebpf: finished an interrupted move of %s: %d entries copied",
                         pin.name, copied)  # fmt: skip
        aside.unlink()


def _recency(source: Map) -> Callable[[tuple[bytes, bytes]], int] | None:
    """How recently a cache entry was used, where the entry says (conntrack's last_seen,
    affinity's last_used): a smaller LRU map keeps the most recent ones."""
    name = source.name.partition(ASIDE_SUFFIX)[0].rpartition("_v")[0]
    where = {"kbp_ct": ("kbp_ct_entry", "last_seen"),
             "kbp_affinity": ("kbp_affinity", "last_used")}.get(name)  # fmt: skip
    if where is None:
        return None
    offset = abi_ffi.offsetof(f"struct {where[0]}", where[1])
    return lambda item: int.from_bytes(item[1][offset : offset + 8], "little")


def copy_entries(source: Map, target: Map) -> tuple[int, int]:
    """Copy what fits of `source` into `target` (a fresh map of the same key and value);
    (entries held, entries the target holds after). Arrays: the indexes both have. Hash
    maps: in the source's order, until the target is full. LRU maps: the most recently
    used ones where the entry says when, older first (the newest are the last evicted)."""
    if source.info.type == MAP_TYPES["sk_storage"]:
        return 0, 0
    items = source.items()
    if source.info.type in _ARRAYS:
        keep = [(k, v) for k, v in items if int.from_bytes(k, "little") < target.info.max_entries]
        target.update_items(keep)
        return len(items), len(keep)
    held, limit = len(items), target.info.max_entries
    if source.info.type in _LRU:
        recency = _recency(source)
        if recency is not None:
            items.sort(key=recency)
            items = items[-limit:]
        else:
            items = items[:limit]
        for key, value in items:
            with contextlib.suppress(OSError):  # taken meanwhile by a new program
                target.update(key, value, BPF_NOEXIST)
        return held, len(target.items())  # an LRU map may evict before it is full
    copied = 0
    for key, value in items[:limit]:
        try:
            target.update(key, value, BPF_NOEXIST)
        except OSError:
            continue
        copied += 1
    return held, copied


def _copy_new(source: Map, target: Map) -> int:
    """Copy the entries of `source` that `target` lacks; how many went in."""
    copied = 0
    for key, value in source.items():
        try:
            target.update(key, value, BPF_NOEXIST)
        except OSError:  # there already, or the map is full
            continue
        copied += 1
    return copied


def _moved_line(move: Move, held: int) -> str:
    pin = versioned(move.name)
    line = (f"moved pinned map {pin} from {move.old_entries} to {move.new_entries} entries: "
            f"{move.moved} of {held} entries moved")  # fmt: skip
    if move.moved >= held:
        return line
    field_name = move.name.removeprefix("kbp_")
    flag = f" (raise --map-size-{field_name})" if field_name in FLAG_MAP_SIZES else ""
    if move.name in _SERVICE_MAPS:
        return (f"{line}; the rest did not fit: the first apply rewrites the map from the "
                f"state, and refuses if the state does not fit{flag}")  # fmt: skip
    if move.source is not None and move.source.info.type in _LRU:
        return f"{line}; the least recently used did not fit and are gone (a cache){flag}"
    return f"{line}; the rest did not fit{flag}"
