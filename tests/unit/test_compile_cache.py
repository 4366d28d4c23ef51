"""The trial compile's file cache (agent/dataplane/ebpf/kernel.py) says "remembered" only
when it wrote the file, and otherwise why not. The child compile is replaced by a process
that succeeds at once: what is tested is the bookkeeping around it."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent.dataplane.ebpf import kernel


@pytest.fixture
def quick_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "_digest", lambda text, cflags: "d1g35t")
    monkeypatch.setattr(kernel, "_compiled", set())
    monkeypatch.setattr(
        subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, b"", b"")
    )


def test_a_written_cache_file_is_remembered(
    quick_trial: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(kernel.CACHE_DIR_ENV, str(tmp_path / "cache"))
    trial = kernel.trial_compile("text", [])
    assert trial is not None and trial.not_remembered is None
    assert (tmp_path / "cache" / "d1g35t").exists()


def test_a_cache_that_cannot_be_written_says_why_it_is_not_remembered(
    quick_trial: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(kernel.CACHE_DIR_ENV, str(blocker / "cache"))  # under a file
    trial = kernel.trial_compile("text", [])
    assert trial is not None and trial.not_remembered is not None
    assert trial.not_remembered.startswith(f"cannot write {blocker / 'cache' / 'd1g35t'}: ")


def test_no_file_cache_is_not_remembered_either(
    quick_trial: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(kernel.CACHE_DIR_ENV, "")
    trial = kernel.trial_compile("text", [])
    assert (
        trial is not None
        and trial.not_remembered == f"{kernel.CACHE_DIR_ENV} is empty (no file cache)"
    )


def test_the_log_line_says_remembered_only_when_it_was(
    quick_trial: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Stop(Exception):
        pass

    def no_bcc(*args: object, **kwargs: object) -> None:
        raise Stop

    monkeypatch.setitem(sys.modules, "bcc", SimpleNamespace(BPF=no_bcc))  # no compile
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(kernel.CACHE_DIR_ENV, str(blocker / "cache"))
    with caplog.at_level(logging.INFO, logger=kernel.__name__), pytest.raises(kernel.LoadError):
        kernel._compile_and_load("text", [], tmp_path)
    [line] = [r.getMessage() for r in caplog.records if "child process first" in r.getMessage()]
    assert "; not remembered (cannot write " in line and "; remembered" not in line, line
