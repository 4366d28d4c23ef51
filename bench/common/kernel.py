"""The eBPF benchmarks' kernel side: a network namespace of the run (nothing is attached
to the machine's own), routes in it for XDP's FIB lookups, the real EbpfDataplane on a
fresh pin directory, the floor programs, and removing what a dead run left behind. Every
name carries BENCH_PREFIX and the pid, so orphans of dead runs can be found."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import os
import re
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from agent.dataplane.ebpf.dataplane import EbpfDataplane
from agent.dataplane.ebpf.maps import MapSizes
from agent.dataplane.ebpf.options import EbpfOptions, TcAttach
from agent.lab.toolkit import BPFFS, LabError, alive, ip_batch, namespaces_with, sysctl
from tests.lab.kit import Cleanup, delete_namespace

BENCH_PREFIX = "kbp-bench-"
NO_INTERFACES = "kbpbench-none"  # a --pod-interfaces glob that matches nothing
NEXT_HOP, NEXT_HOP_MAC = "198.51.100.1", "02:00:00:00:00:01"
FIB_LINK = "kbpbench0"  # the link in the bench namespace the routes point at
CLONE_NEWNET = 0x40000000
_names = itertools.count()


def _pow2_at_least(n: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1.0, n))))


def map_sizes_for(
    services: int, endpoints: int, ct: int = 262144, frontends: int | None = None
) -> MapSizes:
    """Maps sized for N Services x E endpoints with a little headroom (powers of two):
    100k x 10 gets 131,072 frontends and 1,048,576 slots and backends. `frontends`: when
    Services have more than their ClusterIP."""
    return MapSizes(
        services=_pow2_at_least(max(1024, (frontends or services) * 1.2 + 16)),
        slots=_pow2_at_least(max(4096, services * endpoints * 1.02 + 64)),
        backends=_pow2_at_least(max(4096, services * endpoints * 1.02 + 64)),
        ct=ct,
        affinity=1024,
    )


def remove_orphans() -> list[str]:
    """Remove the namespaces and pin directories of bench runs whose process is gone.
    `finally` cannot run when a process dies outright: LLVM ends the process when bcc's
    compile fails a backend check (the BPF stack limit, say), and so does SIGKILL."""
    pattern = re.compile(rf"^{re.escape(BENCH_PREFIX)}(?:pb3-)?(\d+)-")
    removed = []
    for name in namespaces_with(BENCH_PREFIX):
        m = pattern.match(name)
        if m and not alive(int(m.group(1))):
            with contextlib.suppress(LabError):
                delete_namespace(name)
                removed.append(name)
    for path in BPFFS.iterdir():
        m = pattern.match(path.name)
        if m and not alive(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path.name)
    return removed


@contextlib.contextmanager
def bench_netns() -> Iterator[str]:
    """An empty network namespace of this run, for the dataplane's netlink side: nothing
    is attached to any interface of the machine's own namespace. Orphans of dead runs
    go first (remove_orphans)."""
    for name in remove_orphans():
        print(f"  removed {name}, left by a bench run that died", file=sys.stderr)
    with Cleanup("bench") as undo:
        yield undo.namespace(f"{BENCH_PREFIX}{os.getpid()}-{next(_names)}")


def route_external_ranges(netns: str) -> None:
    """In the bench namespace only: forwarding on, and the backend and outside-client ranges
    routed via a permanent neighbour on a link of its own, so that the XDP program's FIB lookups
    succeed as on a node. The link has no address, so the dataplane never takes it for an
    external interface; it goes away with the namespace."""

    ip_batch(netns, [
        "link set lo up",
        # A veth pair with both ends here (this kernel has no dummy driver): up, a carrier.
        f"link add {FIB_LINK} type veth peer name {FIB_LINK}p",
        f"link set {FIB_LINK}p up",
        f"link set {FIB_LINK} address 02:00:00:00:00:02 up",
        f"neigh add {NEXT_HOP} lladdr {NEXT_HOP_MAC} dev {FIB_LINK} nud permanent",
        *(f"route add {net} via {NEXT_HOP} dev {FIB_LINK} onlink"
          for net in ("10.128.0.0/9", "203.0.113.0/24")),
    ])  # fmt: skip
    sysctl(netns, {"net.ipv4.conf.all.forwarding": 1})


@contextlib.contextmanager
def inside_netns(netns: str) -> Iterator[None]:
    """This thread (only) in the bench namespace, and back on exit: test runs use the
    loopback device of the caller's namespace, and XDP's FIB lookups its routes."""
    libc = ctypes.CDLL(None, use_errno=True)

    def enter(fd: int, where: str) -> None:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"setns into {where}: {os.strerror(code)}")

    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            enter(target, netns)
        finally:
            os.close(target)
        try:
            yield
        finally:
            enter(home, "the original network namespace")
    finally:
        os.close(home)


@contextlib.contextmanager
def bench_dataplane(
    sizes: MapSizes,
    netns: str,
    pod_interfaces: Sequence[str] = (NO_INTERFACES,),
    cgroup: Path | None = None,
    tc_attach: str | None = None,
) -> Iterator[EbpfDataplane]:
    """The real EbpfDataplane (compiled with bcc) on a fresh pin directory, its socket
    hooks on `cgroup` when one is given (--socket-lb all), its tc programs attached as
    `tc_attach` (--tc-attach; None: auto); detached, unpinned and removed
    on exit."""
    pin_dir = BPFFS / f"{BENCH_PREFIX}{os.getpid()}-{next(_names)}"
    dataplane: EbpfDataplane | None = None
    try:
        dataplane = EbpfDataplane(EbpfOptions(
            pin_dir, tuple(pod_interfaces), sizes, netns=netns, watch=False, cgroup=cgroup,
            tc_attach=TcAttach(tc_attach) if tc_attach is not None else None,
        ))  # fmt: skip
        yield dataplane
    finally:
        if dataplane is not None:
            dataplane.cleanup()
        shutil.rmtree(pin_dir, ignore_errors=True)


def leftovers(prefix: str = BENCH_PREFIX) -> list[str]:
    """Namespaces and pin directories of this process (names prefix<pid>-…) still present
    (should be none)."""
    mine = f"{prefix}{os.getpid()}-"
    return [p.name for p in BPFFS.iterdir() if p.name.startswith(mine)] + namespaces_with(mine)


# The floor and two calibration programs, compiled by bcc like ours: an empty classifier,
# and one lookup / one update of a 40-byte key (the size of struct kbp_ct_key) taken from
# the frame, in an LRU hash of the conntrack's size: what one map operation costs here.
CALIBRATION_C = """
struct kbp_bench_key { u32 word[10]; };
BPF_TABLE("lru_hash", struct kbp_bench_key, struct kbp_bench_key, kbp_bench_lru, KBP_BENCH_SIZE);

static __always_inline int kbp_bench_key_of(struct __sk_buff *skb, struct kbp_bench_key *key)
{
        void *data = (void *)(long)skb->data, *end = (void *)(long)skb->data_end;

        if (data + 14 + sizeof(*key) > end)
                return -1;
        __builtin_memcpy(key, data + 14, sizeof(*key));
        return 0;
}

int kbp_bench_empty(struct __sk_buff *skb) { return 0; }

int kbp_bench_xdp_empty(struct xdp_md *ctx) { return XDP_PASS; }

int kbp_bench_lookup(struct __sk_buff *skb)
{
        struct kbp_bench_key key = {};

        if (kbp_bench_key_of(skb, &key) == 0 && kbp_bench_lru.lookup(&key))
                return 0;
        return 0;
}

int kbp_bench_update(struct __sk_buff *skb)
{
        struct kbp_bench_key key = {};

        if (kbp_bench_key_of(skb, &key) == 0)
                kbp_bench_lru.update(&key, &key);
        return 0;
}
"""


CALIBRATION_PROGRAMS = ("kbp_bench_empty", "kbp_bench_lookup", "kbp_bench_update")


@contextlib.contextmanager
def calibration_programs(map_size: int) -> Iterator[dict[str, int]]:
    """fds of the floor and calibration programs (the bench's own, so agent/ keeps its one
    bcc import in kernel.py)."""
    from bcc import BPF

    module = BPF(text=CALIBRATION_C.encode(), cflags=[f"-DKBP_BENCH_SIZE={map_size}"])
    try:
        fds = {name: module.load_func(name.encode(), BPF.SCHED_CLS).fd
               for name in CALIBRATION_PROGRAMS}  # fmt: skip
        fds["kbp_bench_xdp_empty"] = module.load_func(b"kbp_bench_xdp_empty", BPF.XDP).fd
        yield fds
    finally:
        module.cleanup()
