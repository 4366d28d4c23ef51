"""A datapath that LLVM refuses with a fatal error (a program over the BPF stack's 512
bytes ends the compiling process: exit 1, no traceback) must not take the agent down:
the trial compile in a child process (agent/dataplane/ebpf/kernel.py) turns it into a
bcc-compile probe failure, so `--dataplane auto` falls back (to nftables here) and serves, and
`--dataplane ebpf` exits with one line naming the compile failure.

The broken datapath is a copy of bpf/ with one more program whose stack is 640 bytes,
compiled through KBP_BPF_SOURCE_DIR; each agent runs in a namespace of its own with its
own pin directory.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.dataplane.ebpf import kernel
from agent.lab.toolkit import in_netns

from .agentproc import AgentProcess, run_argv

ROOT = Path(__file__).parents[2]
STACK_HOG = """
int kbp_stack_hog(struct __sk_buff *skb)
{
	volatile char buf[640];
	for (int i = 0; i < 640; i += 64)
		buf[i] = skb->len + i;
	return buf[skb->len & 511];
}
"""
CAUSE = "stack limit of 512 bytes"
READY_TIMEOUT = 120.0  # seconds; a loaded 2-core machine compiles slowly


@pytest.fixture
def broken_bpf(tmp_path: Path) -> Path:
    """A copy of bpf/ whose tc_ext.c also defines a program over the stack limit."""
    copy = tmp_path / "bpf"
    shutil.copytree(kernel.BPF_DIR, copy)
    with (copy / "tc_ext.c").open("a", encoding="utf-8") as out:
        out.write(STACK_HOG)
    return copy


def agent_argv(ns_manifests: Path, dataplane: str, pin_dir: Path, bpf: Path) -> list[str]:
    argv = run_argv(ns_manifests, "node-a", dataplane, "--bpffs", str(pin_dir))
    return ["env", f"{kernel.SOURCE_DIR_ENV}={bpf}", *argv]


def lo_up(ns: str) -> None:
    done = subprocess.run(in_netns(ns, ["ip", "link", "set", "lo", "up"]), check=False)
    assert done.returncode == 0


def test_auto_falls_back_to_nftables_naming_the_compile_failure_and_serves(
    netns: Callable[[], str], bpf_pin_dir: Path, broken_bpf: Path
) -> None:
    ns = netns()
    lo_up(ns)
    agent = AgentProcess(ns, agent_argv(ROOT / "examples", "auto", bpf_pin_dir, broken_bpf),
                         "auto")  # fmt: skip
    try:
        line = agent.lines[agent.wait_for_line("falling back to nftables", timeout=READY_TIMEOUT)]
        assert "bcc-compile" in line and CAUSE in line and "kbp_stack_hog" in line, line
        agent.wait_for_line("dataplane: nftables")
        deadline = time.monotonic() + READY_TIMEOUT
        while agent.ask("/readyz", "health server")[0] != 200:
            assert agent.proc.poll() is None, agent.log()
            assert time.monotonic() < deadline, f"never ready:\n{agent.log()}"
            time.sleep(0.5)
        status = agent.state()["status"]
        assert status["dataplane"] == "nftables", status
        assert CAUSE in status["dataplaneReason"], status
        rules = subprocess.run(in_netns(ns, ["nft", "list", "table", "ip", "kube-bpf-proxy"]),
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert "goto pick-inside" in rules, rules
        assert "Traceback" not in agent.log(), agent.log()
    finally:
        agent.stop()


def test_ebpf_exits_with_one_line_naming_the_compile_failure(
    netns: Callable[[], str], bpf_pin_dir: Path, broken_bpf: Path
) -> None:
    ns = netns()
    lo_up(ns)
    agent = AgentProcess(ns, agent_argv(ROOT / "examples", "ebpf", bpf_pin_dir, broken_bpf),
                         "ebpf")  # fmt: skip
    try:
        assert agent.wait_exit(timeout=READY_TIMEOUT + 60) == 1, agent.log()
        errors = [line for line in agent.lines if "cannot start" in line]
        assert len(errors) == 1, agent.log()
        assert "--dataplane ebpf: bcc-compile" in errors[0] and CAUSE in errors[0], errors
        assert "Traceback" not in agent.log(), agent.log()
    finally:
        agent.stop()


def test_a_text_that_compiled_once_is_not_compiled_again_in_a_child(
    tmp_path: Path, bpf_pin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trial's cost is paid once per text (and flags, bcc and kernel): remembered in
    the process and as a file, so a restarted agent skips it."""
    monkeypatch.setenv(kernel.CACHE_DIR_ENV, str(tmp_path / "cache"))
    text = kernel.entry_text()
    flags = kernel.cflags_for(bpf_pin_dir, {"services": 1024, "slots": 4096, "backends": 1024,
                                            "ct": 4096, "affinity": 1024})  # fmt: skip
    first = kernel.trial_compile(text, flags)
    assert first is not None and first.seconds > 0 and first.not_remembered is None
    assert len(list((tmp_path / "cache").iterdir())) == 1
    assert kernel.trial_compile(text, flags) is None  # remembered in this process
    kernel._compiled.clear()
    assert kernel.trial_compile(text, flags) is None  # remembered as a file
