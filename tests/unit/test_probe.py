"""The eBPF probes' reporting, without a kernel: a failure names its probe and says why in
one bounded line, the probes stop at the first failure, and each catches its own errors.
(The real probes run in tests/kernel/test_probe.py.)"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from agent.dataplane import probe
from agent.dataplane.base import DataplaneError

OS_ERRORS = {
    "a refused bpf syscall suggests the missing capability": (
        OSError(errno.EPERM, "loading"), "EPERM: Operation not permitted (no CAP_BPF?)",
    ),
    "a kernel without the syscall says so": (
        OSError(errno.ENOSYS, "loading"),
        "ENOSYS: Function not implemented (kernel built without CONFIG_BPF_SYSCALL?)",
    ),
    "an errno without a hint is named and explained": (
        OSError(errno.ENOMEM, "loading"), "ENOMEM: Cannot allocate memory",
    ),
    "an error without an errno (no libbpf.so.1) keeps its message": (
        OSError("cannot load library 'libbpf.so.1'"), "cannot load library 'libbpf.so.1'",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("error", "text"), OS_ERRORS.values(), ids=OS_ERRORS.keys())
def test_os_errors_are_described_by_name_and_meaning(error: OSError, text: str) -> None:
    assert probe.describe_os_error(error) == text


def test_a_failure_is_its_first_line_bounded_and_keeps_the_whole_text() -> None:
    long_line = "x" * 500
    result = probe.failed("bcc-compile", f"  {long_line}\nsecond line\n")
    assert not result.passed
    assert result.failure == "x" * (probe.MAX_REASON_CHARS - 3) + "..."
    assert result.detail == f"  {long_line}\nsecond line\n"
    assert str(result).startswith("bcc-compile: xxx")


def test_a_passed_probe_reads_ok() -> None:
    assert str(probe.ProbeResult("clsact")) == "clsact: ok"
    assert probe.ProbeResult("clsact").passed


def test_the_bpf_syscall_probe_reports_a_refused_load_with_its_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse() -> int:
        raise OSError(errno.EPERM, "loading a trivial tc program: Operation not permitted")

    monkeypatch.setattr(probe, "load_trivial_program", refuse)
    result = probe.probe_bpf_syscall()
    assert str(result) == "bpf-syscall: EPERM: Operation not permitted (no CAP_BPF?)"


def test_the_clsact_probe_needs_a_program_to_attach(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> int:
        raise OSError(errno.EACCES, "loading")

    monkeypatch.setattr(probe, "load_trivial_program", refuse)
    result = probe.probe_clsact()
    assert str(result) == (
        "clsact: no program to attach: EACCES: Permission denied "
        "(no CAP_BPF, or unprivileged BPF disabled?)"
    )


BUILD_ERRORS = {
    "a dataplane error keeps its short reason": (
        DataplaneError("load", "compiling tc_from_pod.c: error\nmore"),
        "bcc-compile: load: compiling tc_from_pod.c: error",
    ),
    "any other exception is caught and named": (
        RuntimeError("bcc exploded"), "bcc-compile: RuntimeError: bcc exploded",
    ),
}  # fmt: skip


@pytest.mark.parametrize(("error", "text"), BUILD_ERRORS.values(), ids=BUILD_ERRORS.keys())
def test_the_bcc_compile_probe_catches_what_the_build_raises(error: Exception, text: str) -> None:
    def build() -> object:
        raise error

    result, dataplane = probe.probe_bcc_compile(build)
    assert (str(result), dataplane) == (text, None)


def test_probes_run_in_order_and_stop_at_the_first_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran: list[str] = []

    def passing() -> probe.ProbeResult:
        ran.append("bpf-syscall")
        return probe.ProbeResult(probe.BPF_SYSCALL)

    def failing() -> probe.ProbeResult:
        ran.append("clsact")
        return probe.failed(probe.CLSACT, "no clsact here")

    def build() -> object:
        ran.append("build")
        return object()

    monkeypatch.setattr(probe, "probe_bpf_syscall", passing)
    monkeypatch.setattr(probe, "probe_clsact", failing)
    dataplane, results = probe.probe_ebpf(build)
    assert dataplane is None
    assert ran == ["bpf-syscall", "clsact"]
    assert [str(r) for r in results] == ["bpf-syscall: ok", "clsact: no clsact here"]


def test_all_probes_passing_hand_back_the_built_dataplane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = object()
    monkeypatch.setattr(probe, "probe_bpf_syscall", lambda: probe.ProbeResult(probe.BPF_SYSCALL))
    monkeypatch.setattr(probe, "probe_clsact", lambda: probe.ProbeResult(probe.CLSACT))
    checked: list[Path] = []

    def bpffs(pin_dir: Path) -> probe.ProbeResult:
        checked.append(pin_dir)
        return probe.ProbeResult(probe.BPFFS)

    monkeypatch.setattr(probe, "probe_bpffs", bpffs)
    dataplane, results = probe.probe_ebpf(lambda: built, Path("/sys/fs/bpf/kube-bpf-proxy"))
    assert dataplane is built
    assert [r.name for r in results] == list(probe.PROBE_NAMES)
    assert all(r.passed for r in results)
    assert checked == [Path("/sys/fs/bpf/kube-bpf-proxy")]


def test_a_namespace_that_cannot_be_made_is_reported_not_raised_as_an_os_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(probe, "_CLONE_NEWNET", 0x1)  # not an unshare flag: EINVAL
    with (
        pytest.raises(probe.NamespaceUnavailable) as raised,
        probe.throwaway_netns(),
    ):
        pytest.fail("entered a namespace that could not be made")
    assert str(raised.value) == (
        "cannot create a throw-away network namespace: EINVAL: Invalid argument"
    )
