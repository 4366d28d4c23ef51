"""nft's commands run in-process through libnftables (the library the `nft` command is
built on), over one netlink socket that stays open for the dataplane's lifetime.

Why not the `nft` command: each run is a process (2-3 ms of start-up here), and a process
that deleted anything pays again when it exits. nf_tables frees what a transaction
deleted after an RCU grace period, in a worker, and the release of the netlink socket
that sent the transaction waits for that worker: measured on this kernel (6.18, idle), an
`nft -f` that deletes one set element takes 18 ms where one that adds takes 4.5 ms, 13 ms
of it in close(). Nearly every change of the dataplane deletes something (the marker's
old revision, a frontend's slots when its endpoint count changes), so PB-9's one change
read 16-19 ms p50 and 28-32 ms p99 with 4.3 ms of CPU. The same transactions through one
open context take 0.1-0.2 ms; the grace period then passes in the background.

`LibNftRunner` is a dataplane Runner: argv of the nft command (`nft -f -`, `nft -j list
...`, `nft -c -f -`, `nft delete table ...`) runs in the context, anything else (the
conntrack tool) in `fallback`. The context's socket is opened in the dataplane's network
namespace (the thread enters it only for nft_ctx_new: a socket stays in the namespace it
was made in), and calls are serialised (a context is not thread-safe).
"""

from __future__ import annotations

import os
import subprocess
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import cffi

from ..netns import netns_path, setns

_CDEF = """
struct nft_ctx;
struct nft_ctx *nft_ctx_new(uint32_t flags);
void nft_ctx_free(struct nft_ctx *ctx);
bool nft_ctx_get_dry_run(struct nft_ctx *ctx);
void nft_ctx_set_dry_run(struct nft_ctx *ctx, bool dry);
unsigned int nft_ctx_output_get_flags(struct nft_ctx *ctx);
void nft_ctx_output_set_flags(struct nft_ctx *ctx, unsigned int flags);
int nft_ctx_buffer_output(struct nft_ctx *ctx);
int nft_ctx_buffer_error(struct nft_ctx *ctx);
const char *nft_ctx_get_output_buffer(struct nft_ctx *ctx);
const char *nft_ctx_get_error_buffer(struct nft_ctx *ctx);
int nft_run_cmd_from_buffer(struct nft_ctx *nft, const char *buf);
"""
_LIBRARY = "libnftables.so.1"
_OUTPUT_JSON = 1 << 4  # NFT_CTX_OUTPUT_JSON (libnftables.h)

_ffi = cffi.FFI()
_ffi.cdef(_CDEF)

Run = Callable[[str | None, Sequence[str], str | None], subprocess.CompletedProcess[str]]


class LibNft:
    """One libnftables context, its socket in `netns` (a name under /run/netns or a path;
    None: this thread's). OSError when the library or the namespace cannot be had."""

    def __init__(self, netns: str | None = None) -> None:
        self._lib: Any = _ffi.dlopen(_LIBRARY)
        self._lock = threading.Lock()
        if netns is None:
            self._ctx = self._lib.nft_ctx_new(0)
        else:
            own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                target = os.open(netns_path(netns), os.O_RDONLY | os.O_CLOEXEC)
                try:
                    setns(target)
                    try:
                        self._ctx = self._lib.nft_ctx_new(0)
                    finally:
                        setns(own)
                finally:
                    os.close(target)
            finally:
                os.close(own)
        if self._ctx == _ffi.NULL:
            raise OSError("nft_ctx_new failed")
        # freed (its socket closed) by close(), or when this object goes
        self._free = weakref.finalize(self, self._lib.nft_ctx_free, self._ctx)
        self._lib.nft_ctx_buffer_output(self._ctx)
        self._lib.nft_ctx_buffer_error(self._ctx)

    def run(self, args: Sequence[str], stdin: str | None) -> subprocess.CompletedProcess[str]:
        """What `nft ARGS` (stdin for `-f -`) would do and print."""
        json = check = False
        rest: list[str] = []
        text: str | None = None
        items = iter(args)
        for arg in items:
            if arg in ("-j", "--json"):
                json = True
            elif arg in ("-c", "--check"):
                check = True
            elif arg in ("-f", "--file"):
                if next(items, None) != "-":
                    raise ValueError(f"nft {' '.join(args)}: only -f - (stdin) runs in-process")
                text = stdin or ""
            else:
                rest.append(arg)
        if text is None:
            text = " ".join(rest) + "\n"
        with self._lock:
            if not self._free.alive:
                raise OSError("the nft context is closed")
            flags = self._lib.nft_ctx_output_get_flags(self._ctx)
            self._lib.nft_ctx_output_set_flags(
                self._ctx, (flags | _OUTPUT_JSON) if json else (flags & ~_OUTPUT_JSON)
            )
            self._lib.nft_ctx_set_dry_run(self._ctx, check)
            try:
                rc = self._lib.nft_run_cmd_from_buffer(self._ctx, text.encode())
                out = _ffi.string(self._lib.nft_ctx_get_output_buffer(self._ctx))
                err = _ffi.string(self._lib.nft_ctx_get_error_buffer(self._ctx))
            finally:
                self._lib.nft_ctx_output_set_flags(self._ctx, flags)
                self._lib.nft_ctx_set_dry_run(self._ctx, False)
        return subprocess.CompletedProcess(
            ["nft", *args], 0 if rc == 0 else 1, out.decode(errors="replace"),
            err.decode(errors="replace"),
        )  # fmt: skip

    def close(self) -> None:
        with self._lock:
            self._free()  # once: later calls do nothing


class LibNftRunner:
    """A Runner: nft's argv through a LibNft of the netns it names (made on first use,
    one per netns), everything else through `fallback`."""

    def __init__(self, fallback: Run, nft: str = "nft") -> None:
        self.fallback = fallback
        self.nft = nft
        self._contexts: dict[str | None, LibNft] = {}
        self._lock = threading.Lock()

    def __call__(
        self, netns: str | None, argv: Sequence[str], stdin: str | None
    ) -> subprocess.CompletedProcess[str]:
        if not argv or argv[0] != self.nft:
            return self.fallback(netns, argv, stdin)
        with self._lock:
            context = self._contexts.get(netns)
            if context is None:
                context = self._contexts[netns] = LibNft(netns)
        return context.run(argv[1:], stdin)

    def close(self) -> None:
        with self._lock:
            for context in self._contexts.values():
                context.close()
            self._contexts.clear()


def available() -> str | None:
    """None when libnftables loads here, else why not."""
    try:
        _ffi.dlopen(_LIBRARY)
    except OSError as err:
        return str(err)
    return None
