"""The bpf(2) calls bcc does not wrap well, through Debian's libbpf.so.1 and cffi: map
operations by fd (batched where the kernel has them), pins, map info, and
BPF_PROG_TEST_RUN. Errors come back as OSError with the errno and what was attempted."""

from __future__ import annotations

import errno as errno_module
import functools
import os
import struct
from dataclasses import dataclass
from typing import Any

import cffi

_CDEF = """
typedef uint32_t __u32;
typedef uint64_t __u64;

struct bpf_map_batch_opts {
    size_t sz;
    __u64 elem_flags;
    __u64 flags;
};

struct bpf_test_run_opts {
    size_t sz;
    const void *data_in;
    void *data_out;
    __u32 data_size_in;
    __u32 data_size_out;
    const void *ctx_in;
    void *ctx_out;
    __u32 ctx_size_in;
    __u32 ctx_size_out;
    __u32 retval;
    int repeat;
    __u32 duration;
    __u32 flags;
    __u32 cpu;
    __u32 batch_size;
};

int bpf_obj_pin(int fd, const char *pathname);
int bpf_obj_get(const char *pathname);
int bpf_map_update_elem(int fd, const void *key, const void *value, __u64 flags);
int bpf_map_lookup_elem(int fd, const void *key, void *value);
int bpf_map_delete_elem(int fd, const void *key);
int bpf_map_get_next_key(int fd, const void *key, void *next_key);
int bpf_map_update_batch(int fd, const void *keys, const void *values, __u32 *count,
                         const struct bpf_map_batch_opts *opts);
int bpf_map_delete_batch(int fd, const void *keys, __u32 *count,
                         const struct bpf_map_batch_opts *opts);
int bpf_map_lookup_batch(int fd, void *in_batch, void *out_batch, void *keys,
                         void *values, __u32 *count, const struct bpf_map_batch_opts *opts);
int bpf_obj_get_info_by_fd(int bpf_fd, void *info, __u32 *info_len);
int bpf_prog_test_run_opts(int prog_fd, struct bpf_test_run_opts *opts);
"""

ffi = cffi.FFI()
ffi.cdef(_CDEF)

BPF_ANY = 0
BPF_NOEXIST = 1

# enum bpf_map_type values the agent cares about (include/uapi/linux/bpf.h).
PERCPU_TYPES = {5, 6, 10}  # percpu_hash, percpu_array, lru_percpu_hash


@functools.cache
def lib() -> Any:
    return ffi.dlopen("libbpf.so.1")


def _check(rc: int, what: str) -> int:
    """libbpf 1.x returns -errno (and sets errno); raise OSError naming the call."""
    if rc < 0:
        errno = -rc if rc != -1 else ffi.errno
        raise OSError(errno, f"{what}: {os.strerror(errno)}")
    return rc


@functools.cache
def possible_cpus() -> int:
    """Per-CPU map values hold one slot per *possible* CPU (e.g. "0-7")."""
    with open("/sys/devices/system/cpu/possible", encoding="ascii") as stream:
        text = stream.read().strip()
    count = 0
    for part in text.split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


def obj_pin(fd: int, path: str) -> None:
    _check(lib().bpf_obj_pin(fd, path.encode()), f"pin fd {fd} at {path}")


def obj_get(path: str) -> int:
    """An fd for a pinned object; the caller closes it."""
    return _check(lib().bpf_obj_get(path.encode()), f"open pin {path}")


@dataclass(frozen=True, slots=True)
class MapInfo:
    type: int
    id: int
    key_size: int
    value_size: int
    max_entries: int
    flags: int
    name: str

    @property
    def percpu(self) -> bool:
        return self.type in PERCPU_TYPES


def map_info(fd: int) -> MapInfo:
    # struct bpf_map_info starts with six __u32 and the 16-byte name; asking for a prefix
    # is allowed (the kernel copies min(len, sizeof)).
    buf = ffi.new("char[40]")
    size = ffi.new("__u32 *", 40)
    _check(lib().bpf_obj_get_info_by_fd(fd, buf, size), f"map info of fd {fd}")
    raw = bytes(ffi.buffer(buf, 40))
    words = [int.from_bytes(raw[i : i + 4], "little") for i in range(0, 24, 4)]
    name = raw[24:40].split(b"\0", 1)[0].decode(errors="replace")
    return MapInfo(*words, name=name)


def _batch_opts() -> Any:
    return ffi.new("struct bpf_map_batch_opts *", {"sz": ffi.sizeof("struct bpf_map_batch_opts")})


class Map:
    """A BPF map by fd, with its sizes; keys and values are bytes of the ABI structs.

    Per-CPU maps: values are value_size rounded up to 8, once per possible CPU.
    """

    def __init__(self, fd: int, name: str = "", *, owned: bool = False) -> None:
        self.fd = fd
        self.info = map_info(fd)
        self.name = name or self.info.name
        self.key_size = self.info.key_size
        if self.info.percpu:
            self.value_size = ((self.info.value_size + 7) // 8 * 8) * possible_cpus()
        else:
            self.value_size = self.info.value_size
        self._owned = owned
        self._batch_ok = True

    @classmethod
    def pinned(cls, path: str) -> Map:
        return cls(obj_get(path), os.path.basename(path), owned=True)

    def close(self) -> None:
        if self._owned and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Map:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # single elements

    def update(self, key: bytes, value: bytes, flags: int = BPF_ANY) -> None:
        self._sizes(key, value)
        _check(lib().bpf_map_update_elem(self.fd, key, value, flags), f"update {self.name}")

    def lookup(self, key: bytes) -> bytes | None:
        self._sizes(key)
        out = ffi.new("char[]", self.value_size)
        rc = lib().bpf_map_lookup_elem(self.fd, key, out)
        if rc < 0 and (-rc if rc != -1 else ffi.errno) == 2:  # ENOENT
            return None
        _check(rc, f"lookup {self.name}")
        return bytes(ffi.buffer(out, self.value_size))

    def delete(self, key: bytes) -> bool:
        """False when the key was not there."""
        self._sizes(key)
        rc = lib().bpf_map_delete_elem(self.fd, key)
        if rc < 0 and (-rc if rc != -1 else ffi.errno) == 2:
            return False
        _check(rc, f"delete from {self.name}")
        return True

    def keys(self) -> list[bytes]:
        out, key = [], ffi.NULL
        nxt = ffi.new("char[]", self.key_size)
        while True:
            rc = lib().bpf_map_get_next_key(self.fd, key, nxt)
            if rc < 0:
                if (-rc if rc != -1 else ffi.errno) == 2:
                    return out
                _check(rc, f"iterate {self.name}")
            current = bytes(ffi.buffer(nxt, self.key_size))
            out.append(current)
            key = current

    # batches: one syscall per chunk; the kernel has them for hash and array maps

    def update_batch(self, keys: bytes, values: bytes, count: int) -> None:
        """Write `count` elements; keys/values are the concatenated structs."""
        if count == 0:
            return
        if len(keys) != count * self.key_size or len(values) != count * self.value_size:
            raise ValueError(f"{self.name}: batch of {count} with wrong byte lengths")
        if not self._batch_ok:
            self._update_each(keys, values, count)
            return
        opts = _batch_opts()
        done = 0
        while done < count:
            n = ffi.new("__u32 *", count - done)
            rc = lib().bpf_map_update_batch(
                self.fd,
                ffi.from_buffer(keys[done * self.key_size :]),
                ffi.from_buffer(values[done * self.value_size :]),
                n,
                opts,
            )
            if rc < 0:
                errno = -rc if rc != -1 else ffi.errno
                if errno in (22, 95) and done == 0 and n[0] == 0:  # EINVAL/EOPNOTSUPP
                    self._batch_ok = False
                    self._update_each(keys, values, count)
                    return
                _check(rc, f"batch update of {count} in {self.name} (written {done + n[0]})")
            done += n[0]

    def update_items(self, items: list[tuple[bytes, bytes]]) -> None:
        """update_batch of (key, value) pairs; no call at all for none."""
        if items:
            keys, values = b"".join(k for k, _ in items), b"".join(v for _, v in items)
            self.update_batch(keys, values, len(items))

    def delete_keys(self, keys: list[bytes]) -> None:
        if keys:
            self.delete_batch(b"".join(keys), len(keys))

    def _update_each(self, keys: bytes, values: bytes, count: int) -> None:
        ks, vs = self.key_size, self.value_size
        for i in range(count):
            self.update(keys[i * ks : (i + 1) * ks], values[i * vs : (i + 1) * vs])

    def delete_batch(self, keys: bytes, count: int) -> None:
        """Delete `count` keys; a missing key is an error (ENOENT) as for single deletes."""
        if count == 0:
            return
        if len(keys) != count * self.key_size:
            raise ValueError(f"{self.name}: delete batch of {count} with wrong byte length")
        opts = _batch_opts()
        done = 0
        while done < count:
            n = ffi.new("__u32 *", count - done)
            rc = lib().bpf_map_delete_batch(
                self.fd, ffi.from_buffer(keys[done * self.key_size :]), n, opts
            )
            if rc < 0:
                errno = -rc if rc != -1 else ffi.errno
                if errno == 2:  # ENOENT: skip the missing key and go on
                    done += n[0] + 1
                    continue
                _check(rc, f"batch delete of {count} from {self.name}")
            done += n[0]

    def items(self, chunk: int = 4096) -> list[tuple[bytes, bytes]]:
        """Every (key, value), by lookup batches (falls back to iterating keys)."""
        try:
            return self._items_batched(chunk)
        except OSError as err:
            if err.errno not in (22, 95):  # EINVAL / EOPNOTSUPP: not batchable here
                raise
        out = []
        for key in self.keys():
            value = self.lookup(key)
            if value is not None:
                out.append((key, value))
        return out

    def _items_batched(self, chunk: int) -> list[tuple[bytes, bytes]]:
        ks, vs = self.key_size, self.value_size
        keys = ffi.new("char[]", ks * chunk)
        values = ffi.new("char[]", vs * chunk)
        token_size = max(ks, 8)
        in_batch, out_batch = ffi.NULL, ffi.new("char[]", token_size)
        opts = _batch_opts()
        out: list[tuple[bytes, bytes]] = []
        while True:
            n = ffi.new("__u32 *", chunk)
            rc = lib().bpf_map_lookup_batch(self.fd, in_batch, out_batch, keys, values, n, opts)
            errno = (-rc if rc != -1 else ffi.errno) if rc < 0 else 0
            if rc < 0 and errno != 2:
                _check(rc, f"dump {self.name}")
            kb, vb = ffi.buffer(keys, ks * n[0]), ffi.buffer(values, vs * n[0])
            out.extend((kb[i * ks : (i + 1) * ks], vb[i * vs : (i + 1) * vs]) for i in range(n[0]))
            if errno == 2:  # ENOENT: that was the last chunk
                return out
            if in_batch == ffi.NULL:
                in_batch = ffi.new("char[]", token_size)
            ffi.memmove(in_batch, out_batch, token_size)

    def values_array(self, count: int) -> bytes:
        """The values of array indexes 0 .. count-1, back to back (per-CPU maps: every
        CPU's, as `lookup` gives them), read in as few batches as the kernel allows: a
        scrape reads the live prefix of a large per-CPU array without a tuple per entry."""
        count = min(count, self.info.max_entries)
        vs, token_size = self.value_size, max(self.key_size, 8)
        keys = ffi.new("char[]", self.key_size * count)
        values = ffi.new("char[]", vs * count)
        in_batch, out_batch = ffi.NULL, ffi.new("char[]", token_size)
        opts, done = _batch_opts(), 0
        while done < count:
            n = ffi.new("__u32 *", count - done)
            rc = lib().bpf_map_lookup_batch(self.fd, in_batch, out_batch, keys + done * 4,
                                            values + done * vs, n, opts)  # fmt: skip
            errno = (-rc if rc != -1 else ffi.errno) if rc < 0 else 0
            if rc < 0 and errno != 2:
                _check(rc, f"read {self.name}")
            done += n[0]
            if errno == 2 or n[0] == 0:
                break
            if in_batch == ffi.NULL:
                in_batch = ffi.new("char[]", token_size)
            ffi.memmove(in_batch, out_batch, token_size)
        return bytes(ffi.buffer(values, vs * done))

    def _sizes(self, key: bytes, value: bytes | None = None) -> None:
        if len(key) != self.key_size or (value is not None and len(value) != self.value_size):
            raise ValueError(
                f"{self.name}: key/value of {len(key)}/{len(value or b'')} bytes, map has "
                f"{self.key_size}/{self.value_size}"
            )


@dataclass(frozen=True, slots=True)
class TestRun:
    __test__ = False  # not a pytest class

    retval: int
    data_out: bytes
    duration_ns: int


# bpf_test_run_opts.flags: XDP frames really sent (XDP_TX, XDP_REDIRECT), kernel 5.18+.
BPF_F_TEST_XDP_LIVE_FRAMES = 1 << 1


def _test_run_opts(data: bytes, repeat: int, ctx: bytes, **fields: Any) -> Any:
    opts: dict[str, Any] = {
        "sz": ffi.sizeof("struct bpf_test_run_opts"),
        "data_in": ffi.from_buffer(data),
        "data_size_in": len(data),
        "repeat": repeat,
    }
    if ctx:  # struct __sk_buff / xdp_md: interface indexes and the like the program reads
        opts.update(ctx_in=ffi.from_buffer(ctx), ctx_size_in=len(ctx))
    return ffi.new("struct bpf_test_run_opts *", {**opts, **fields})


def prog_test_run(
    prog_fd: int, data: bytes, repeat: int = 1, out_size: int = 0, ctx: bytes = b""
) -> TestRun:
    """BPF_PROG_TEST_RUN: run the program on `data` (a whole frame) `repeat` times, with
    `ctx` as its context if given; duration is the kernel's average per run."""
    size = out_size or max(len(data) + 256, 2048)
    data_out = ffi.new("char[]", size)
    opts = _test_run_opts(data, repeat, ctx, data_out=data_out, data_size_out=size)
    _check(lib().bpf_prog_test_run_opts(prog_fd, opts), f"test run of prog fd {prog_fd}")
    return TestRun(opts.retval, bytes(ffi.buffer(data_out, opts.data_size_out)), opts.duration)


def prog_test_run_live(prog_fd: int, data: bytes, repeat: int, ctx: bytes, batch_size: int) -> None:
    """BPF_PROG_TEST_RUN of an XDP program in live-frames mode: `repeat` runs over copies
    of `data`, as if received on ctx's ingress_ifindex; what the program transmits is sent
    for real, in batches of batch_size. No output frame (the kernel allows none)."""
    opts = _test_run_opts(
        data, repeat, ctx, flags=BPF_F_TEST_XDP_LIVE_FRAMES, batch_size=batch_size
    )
    _check(lib().bpf_prog_test_run_opts(prog_fd, opts), f"live-frames test run of {prog_fd}")


# --- links and cgroup attachments (cgroup.py) ------------------------------------------
# bpf_link_create/update/detach, BPF_PROG_QUERY and the ids of programs. Enum arguments
# (enum bpf_attach_type) are passed as int, which is their size in the C ABI.

ffi.cdef("""
int bpf_link_create(int prog_fd, int target_fd, int attach_type, const void *opts);
int bpf_link_update(int link_fd, int new_prog_fd, const void *opts);
int bpf_link_detach(int link_fd);
int bpf_prog_query(int target_fd, int type, __u32 query_flags, __u32 *attach_flags,
                   __u32 *prog_ids, __u32 *prog_cnt);
int bpf_prog_get_fd_by_id(__u32 id);
""")


def link_create(prog_fd: int, target_fd: int, attach_type: int) -> int:
    """A bpf_link attaching the program to the target (a cgroup fd for cgroup hooks); the
    caller owns the fd: the attachment lasts while the fd or a pin of it exists."""
    return _check(
        lib().bpf_link_create(prog_fd, target_fd, attach_type, ffi.NULL),
        f"link prog fd {prog_fd} to fd {target_fd} (attach type {attach_type})",
    )


def link_update(link_fd: int, prog_fd: int) -> None:
    """Swap the link's program in place (same type and attach type); no gap in which the
    hook runs nothing."""
    _check(lib().bpf_link_update(link_fd, prog_fd, ffi.NULL), f"update link fd {link_fd}")


def link_update_and_pin(link_fd: int, prog_fd: int, pin: str) -> bool:
    """Swap the program of a link we hold an fd of, and pin it at `pin` again if that
    pin was removed. False when the link is defunct (its target went: ENOLINK)."""
    try:
        link_update(link_fd, prog_fd)
    except OSError as err:
        if err.errno != errno_module.ENOLINK:
            raise
        return False
    if not os.path.exists(pin):
        os.makedirs(os.path.dirname(pin), exist_ok=True)
        obj_pin(link_fd, pin)
    return True


def link_detach(link_fd: int) -> None:
    """Detach the link from its hook now, whoever else holds an fd or pin of it."""
    _check(lib().bpf_link_detach(link_fd), f"detach link fd {link_fd}")


@dataclass(frozen=True, slots=True)
class LinkInfo:
    type: int  # enum bpf_link_type (BPF_LINK_TYPE_CGROUP is 3)
    id: int
    prog_id: int
    cgroup_id: int  # cgroup links: the cgroup's id (its inode number on cgroup2), 0 if gone
    attach_type: int  # cgroup links: enum bpf_attach_type
    tcx_ifindex: int = 0  # tcx links: the interface's index, 0 once it is gone
    tcx_attach_type: int = 0  # tcx links: BPF_TCX_INGRESS or BPF_TCX_EGRESS


def link_info(fd: int) -> LinkInfo:
    # struct bpf_link_info: type, id, prog_id (__u32 each), then a union aligned to 8
    # whose cgroup member is {__u64 cgroup_id; __u32 attach_type;} and whose tcx member
    # is {__u32 ifindex; __u32 attach_type;}.
    buf = ffi.new("char[32]")
    size = ffi.new("__u32 *", 32)
    _check(lib().bpf_obj_get_info_by_fd(fd, buf, size), f"link info of fd {fd}")
    raw = bytes(ffi.buffer(buf, 32))
    word = functools.partial(int.from_bytes, byteorder="little")
    return LinkInfo(word(raw[0:4]), word(raw[4:8]), word(raw[8:12]), word(raw[16:24]),
                    word(raw[24:28]), word(raw[16:20]), word(raw[20:24]))  # fmt: skip


def prog_query(target_fd: int, attach_type: int, capacity: int = 64) -> list[int]:
    """Ids of the programs attached to the target at this hook (any owner, links too)."""
    ids = ffi.new("__u32[]", capacity)
    count = ffi.new("__u32 *", capacity)
    flags = ffi.new("__u32 *")
    _check(
        lib().bpf_prog_query(target_fd, attach_type, 0, flags, ids, count),
        f"query programs of fd {target_fd} (attach type {attach_type})",
    )
    return [ids[i] for i in range(count[0])]


def prog_name(prog_id: int) -> str:
    """The name of a loaded program by id (at most 15 characters)."""
    fd = _check(lib().bpf_prog_get_fd_by_id(prog_id), f"open program id {prog_id}")
    try:
        # struct bpf_prog_info: the 16-byte name sits at offset 64.
        buf = ffi.new("char[80]")
        size = ffi.new("__u32 *", 80)
        _check(lib().bpf_obj_get_info_by_fd(fd, buf, size), f"info of program id {prog_id}")
        return bytes(ffi.buffer(buf, 80))[64:80].split(b"\0", 1)[0].decode(errors="replace")
    finally:
        os.close(fd)


def prog_fd_by_id(prog_id: int) -> int:
    """An fd for the loaded program with this id (the caller closes it)."""
    return _check(lib().bpf_prog_get_fd_by_id(prog_id), f"open program id {prog_id}")


def prog_id(prog_fd: int) -> int:
    """The id of a program by fd (struct bpf_prog_info: type, then id)."""
    buf = ffi.new("char[8]")
    size = ffi.new("__u32 *", 8)
    _check(lib().bpf_obj_get_info_by_fd(prog_fd, buf, size), f"info of prog fd {prog_fd}")
    return int.from_bytes(bytes(ffi.buffer(buf, 8))[4:8], "little")


# --- tcx (netlink.py) --------------------------------------------------------------------
# tc programs attached as bpf_links without the clsact qdisc (kernel 6.6+). Debian's
# libbpf 1.1 and its uapi headers predate tcx, so these calls build union bpf_attr
# themselves and go through the bpf(2) system call; the values below are the kernel's
# (include/uapi/linux/bpf.h of 6.6).

BPF_PROG_QUERY = 16  # enum bpf_cmd
BPF_LINK_CREATE = 28
BPF_LINK_GET_FD_BY_ID = 30
BPF_LINK_GET_NEXT_ID = 31
BPF_TCX_INGRESS = 46  # enum bpf_attach_type
BPF_TCX_EGRESS = 47
BPF_LINK_TYPE_CGROUP = 3  # enum bpf_link_type
BPF_LINK_TYPE_TCX = 11
BPF_F_BEFORE = 1 << 3  # mprog placement: first (no relative program given)
BPF_F_AFTER = 1 << 4  # mprog placement: last

# bpf(2)'s number per machine (arch/*/entry/syscalls); libc's syscall() takes it.
_SYS_BPF = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351, "riscv64": 280}

_libc_ffi = cffi.FFI()
_libc_ffi.cdef("long syscall(long number, ...);")


@functools.cache
def _libc() -> Any:
    return _libc_ffi.dlopen(None)


def _sys_bpf(cmd: int, attr: bytearray, what: str) -> int:
    """bpf(cmd, attr): the result, or OSError naming `what`. `attr` is written back."""
    number = _SYS_BPF.get(os.uname().machine)
    if number is None:
        raise OSError(errno_module.ENOSYS, f"{what}: bpf(2) number unknown on "
                      f"{os.uname().machine}")  # fmt: skip
    buf = _libc_ffi.new("char[]", bytes(attr))
    rc = _libc().syscall(_libc_ffi.cast("long", number), _libc_ffi.cast("int", cmd),
                         buf, _libc_ffi.cast("unsigned int", len(attr)))  # fmt: skip
    if rc < 0:
        code = _libc_ffi.errno
        raise OSError(code, f"{what}: {os.strerror(code)}")
    attr[:] = bytes(_libc_ffi.buffer(buf, len(attr)))
    return int(rc)


def tcx_link_create(prog_fd: int, ifindex: int, attach_type: int, flags: int = 0) -> int:
    """A tcx bpf_link of the program on the interface (in the calling thread's network
    namespace); `flags` BPF_F_BEFORE puts it first among the hook's programs. The caller
    owns the fd: the program stays attached while the fd or a pin of it exists."""
    # link_create: prog_fd, target_ifindex, attach_type, flags, then tcx's relative
    # fd/id and expected_revision (0: none).
    attr = bytearray(struct.pack("=IIII I4x Q", prog_fd, ifindex, attach_type, flags, 0, 0))
    return _sys_bpf(
        BPF_LINK_CREATE,
        attr,
        f"tcx link of prog fd {prog_fd} to ifindex {ifindex} (type {attach_type})",
    )


def tcx_query(ifindex: int, attach_type: int, capacity: int = 64) -> list[tuple[int, int]]:
    """(program id, link id) of every program on a tcx hook, in the order they run (link
    id 0: attached without a link). EINVAL from a kernel without tcx."""
    ids = ffi.new("__u32[]", capacity)
    links = ffi.new("__u32[]", capacity)
    # query: target_ifindex, attach_type, query_flags, attach_flags, prog_ids, count,
    # (pad), prog_attach_flags, link_ids, link_attach_flags, revision.
    attr = bytearray(struct.pack(
        "=IIII Q I4x Q Q Q Q", ifindex, attach_type, 0, 0, int(ffi.cast("uintptr_t", ids)),
        capacity, 0, int(ffi.cast("uintptr_t", links)), 0, 0,
    ))  # fmt: skip
    _sys_bpf(BPF_PROG_QUERY, attr, f"query tcx programs of ifindex {ifindex}")
    count = struct.unpack_from("=I", attr, 24)[0]
    return [(ids[i], links[i]) for i in range(min(count, capacity))]


def link_fd_by_id(link_id: int) -> int:
    """An fd for the bpf_link with this id (the caller closes it)."""
    attr = bytearray(struct.pack("=III", link_id, 0, 0))
    return _sys_bpf(BPF_LINK_GET_FD_BY_ID, attr, f"open link id {link_id}")


def link_ids() -> list[int]:
    """The ids of every bpf_link on the machine, in id order (BPF_LINK_GET_NEXT_ID)."""
    ids: list[int] = []
    start = 0
    while True:
        attr = bytearray(struct.pack("=III", start, 0, 0))
        try:
            _sys_bpf(BPF_LINK_GET_NEXT_ID, attr, "list links")
        except OSError as err:
            if err.errno == errno_module.ENOENT:  # past the last one
                return ids
            raise
        start = struct.unpack_from("=I", attr, 4)[0]
        ids.append(start)
