"""The kernel's run-time statistics of loaded BPF programs (bpf_enable_stats,
bpf_prog_info's run_time_ns and run_cnt), for the benchmarks that time a program by
itself (sock_hooks.py, tc_cost.py)."""

from __future__ import annotations

import ctypes

BPF_STATS_RUN_TIME = 0  # enum bpf_stats_type
PROG_INFO_SIZE = 224  # struct bpf_prog_info up to verified_insns
RUN_TIME_AT, RUN_CNT_AT, XLATED_LEN_AT, JITED_LEN_AT, VERIFIED_AT = 192, 200, 20, 16, 216


class ProgramStats:
    """Run time and count of one loaded program (by fd), while statistics are enabled."""

    def __init__(self, prog_fd: int) -> None:
        self._lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
        self._fd = prog_fd

    def info(self) -> bytes:
        buf = ctypes.create_string_buffer(PROG_INFO_SIZE)
        size = ctypes.c_uint32(PROG_INFO_SIZE)
        rc = self._lib.bpf_obj_get_info_by_fd(self._fd, buf, ctypes.byref(size))
        if rc < 0:
            raise OSError(-rc, "bpf_obj_get_info_by_fd")
        return buf.raw

    def sample(self) -> tuple[int, int]:
        raw = self.info()
        return (int.from_bytes(raw[RUN_TIME_AT : RUN_TIME_AT + 8], "little"),
                int.from_bytes(raw[RUN_CNT_AT : RUN_CNT_AT + 8], "little"))  # fmt: skip

    def sizes(self) -> dict[str, int]:
        raw = self.info()

        def u32(at: int) -> int:
            return int.from_bytes(raw[at : at + 4], "little")

        return {"xlated_insns": u32(XLATED_LEN_AT) // 8, "jited_bytes": u32(JITED_LEN_AT),
                "verified_insns": u32(VERIFIED_AT)}  # fmt: skip


def enable_stats() -> int:
    """An fd that keeps the kernel's program statistics on while it is open (refcounted:
    another user's sysctl or fd is not disturbed)."""
    fd = ctypes.CDLL("libbpf.so.1", use_errno=True).bpf_enable_stats(BPF_STATS_RUN_TIME)
    if fd < 0:
        raise OSError(-fd, "bpf_enable_stats")
    return fd
