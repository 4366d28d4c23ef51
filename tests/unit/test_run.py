"""`kube-bpf-proxy run` end to end in a subprocess (the file source, the dry-run
dataplane, the local API over real HTTP, a clean stop on SIGTERM); how `--dataplane`
picks a dataplane and says why; `cleanup` running both dataplanes' parts.

Selection and cleanup run in-process against fakes: no test here touches the kernel
(the real probes and cleanup run in tests/kernel/test_probe.py)."""

from __future__ import annotations

import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.api.serving import OPEN_FILES_WANTED
from agent.cli import main
from agent.config import Settings
from agent.daemon import Agent
from agent.dataplane import probe, select
from agent.dataplane.base import DataplaneError
from agent.dataplane.fake import FakeDataplane
from agent.dataplane.iptables.backend import BackendError
from agent.nodelock import NodeLock

from ..builders import write_kubeconfig

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except OSError:
        return 0, b""


@pytest.fixture
def agent() -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    metrics, health = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable, "-m", "agent", "run",
            "--manifests", str(ROOT / "examples"),
            "--node", "node-a",
            "--dataplane", "none",
            "--metrics-bind-address", f"127.0.0.1:{metrics}",
            "--healthz-bind-address", f"127.0.0.1:{health}",
        ],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        yield process, f"http://127.0.0.1:{metrics}", f"http://127.0.0.1:{health}"
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


def wait_ready(health_url: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 20
    while get(f"{health_url}/readyz")[0] != 200:
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "agent never became ready"
        time.sleep(0.05)


def test_run_serves_the_compiled_state_and_stops_on_sigterm(
    agent: tuple[subprocess.Popen[str], str, str],
) -> None:
    process, metrics_url, health_url = agent
    wait_ready(health_url, process)
    compiled = subprocess.run(
        [sys.executable, "-m", "agent", "compile", "--manifests", "examples", "--node", "node-a",
         "-o", "json"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    status, body = get(f"{metrics_url}/state")
    document = json.loads(body)
    assert status == 200
    assert document["revision"] == json.loads(compiled.stdout)["revision"]
    assert document["heldRevision"] == document["revision"]
    assert get(f"{health_url}/healthz")[0] == 200
    status, body = get(f"{metrics_url}/metrics")
    assert status == 200
    assert b"kubeproxy_sync_proxy_rules_last_timestamp_seconds" in body
    assert b'kbp_dataplane_info{dataplane="none",reason="requested"} 1.0' in body
    assert document["status"]["dataplane"] == "none"
    assert document["status"]["dataplaneReason"] == "requested"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 0


def test_the_agent_raises_its_open_files_limit_at_start() -> None:
    """Started with `ulimit -n 1024`, it asks for 65,536 (or the hard limit): each HTTP
    connection it holds is an open file."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(OPEN_FILES_WANTED, hard)
    health = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--manifests", str(ROOT / "examples"),
         "--node", "node-a", "--dataplane", "none", "--metrics-bind-address", "127.0.0.1:0",
         "--healthz-bind-address", f"127.0.0.1:{health}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard)),
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{health}", process)
        limits = Path(f"/proc/{process.pid}/limits").read_text()
        (line,) = [line for line in limits.splitlines() if line.startswith("Max open files")]
        assert int(line.split()[3]) == max(wanted, min(1024, hard))
    finally:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=10)
    if wanted > 1024:
        assert f"open files limit raised from 1024 to {wanted}" in stderr


def test_no_kubeconfig_is_a_clear_startup_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--node", "node-a", "--dataplane", "none",
         "--kubeconfig", str(tmp_path / "missing"), "--metrics-bind-address", "127.0.0.1:0",
         "--healthz-bind-address", "127.0.0.1:0"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 1
    assert "cannot start" in result.stderr and "missing" in result.stderr


def test_a_busy_port_is_a_clear_startup_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "agent", "run", "--manifests", "examples", "--dataplane",
             "none", "--metrics-bind-address", f"127.0.0.1:{port}"],
            cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    assert result.returncode == 1
    assert f"--metrics-bind-address 127.0.0.1:{port}" in result.stderr


def test_a_missing_manifests_path_is_a_one_line_startup_error(tmp_path: Path) -> None:
    missing = tmp_path / "manifests"
    result = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--manifests", "examples", str(missing),
         "--dataplane", "none", "--metrics-bind-address", "127.0.0.1:0",
         "--healthz-bind-address", "127.0.0.1:0"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    # A bad setting (exit 2), said in one line before the node's lock is taken or the
    # datapath compiled.
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"kube-bpf-proxy run: error: --manifests {missing}: no such file or directory"
    ]


# --- `--dataplane`: which dataplane, and why ------------------------------------------------
#
# The fakes stand in for the kernel: each probe passes or fails with a given reason, the
# eBPF build (the bcc-compile probe) succeeds or raises, the iptables module is available
# or not. `calls` records, in order, what selection asked of them.

EPERM = "EPERM: Operation not permitted (no CAP_BPF?)"


@dataclass
class FakeKernel:
    bpf_syscall: str | None = None  # a probe's failure, or None: it passes
    clsact: str | None = None
    bpffs: str | None = None
    bcc_compile: str | None = None  # the eBPF build raises DataplaneError("load", this)
    iptables: str | None = None  # unavailable_reason()
    iptables_importable: bool = True
    nftables: str | None = None  # the nftables dataplane's unavailable_reason()
    leftovers_fail: bool = False  # removing the other dataplane's leftovers raises
    calls: list[str] = field(default_factory=list)


class FakeKernelDataplane(FakeDataplane):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> FakeKernel:
    fake = FakeKernel()

    def probe_result(name: str, failure: str | None) -> probe.ProbeResult:
        fake.calls.append(f"probe {name}")
        return probe.ProbeResult(name) if failure is None else probe.failed(name, failure)

    def build_ebpf(options: select.DataplaneOptions) -> FakeKernelDataplane:
        fake.calls.append("build ebpf")
        if fake.bcc_compile is not None:
            raise DataplaneError("load", fake.bcc_compile)
        return FakeKernelDataplane("ebpf")

    def iptables_dataplane(pod_interfaces: list[str], **backend: Any) -> FakeKernelDataplane:
        fake.calls.append(f"build iptables ({backend['backend'].name})")
        return FakeKernelDataplane("iptables")

    def choose_backend(requested: str, netns: str | None = None) -> tuple[Any, str]:
        name = "nft" if requested == "auto" else requested
        return SimpleNamespace(name=name), "requested" if requested != "auto" else "a tie"

    def iptables_cleanup(netns: str | None = None) -> list[str]:
        fake.calls.append("remove iptables leftovers")
        if fake.leftovers_fail:
            raise DataplaneError("iptables-restore", "iptables-restore: broken")
        return ["IPv4 nat KBP-SERVICES"]

    def iptables_module() -> SimpleNamespace:
        if not fake.iptables_importable:
            raise ImportError("No module named 'agent.dataplane.iptables'")
        return SimpleNamespace(
            IptablesDataplane=iptables_dataplane,
            unavailable_reason=lambda netns=None, backend=None: fake.iptables,
            cleanup=iptables_cleanup,
            choose_backend=choose_backend,
            BackendError=BackendError,
        )

    def nftables_cleanup(netns: str | None = None) -> list[str]:
        fake.calls.append("remove nftables leftovers")
        return ["table ip kube-bpf-proxy"]

    def nftables_dataplane(pod_interfaces: list[str]) -> FakeKernelDataplane:
        fake.calls.append("build nftables")
        return FakeKernelDataplane("nftables")

    def nftables_module() -> SimpleNamespace:
        return SimpleNamespace(
            NftablesDataplane=nftables_dataplane,
            unavailable_reason=lambda netns=None: fake.nftables,
            cleanup=nftables_cleanup,
        )

    def remove_ebpf_leftovers(pin_dir: Path) -> list[str]:
        fake.calls.append(f"remove ebpf leftovers under {pin_dir}")
        if fake.leftovers_fail:
            raise OSError(13, "Permission denied")
        return ["pin kbp_services_v1"]

    monkeypatch.setattr(probe, "probe_bpf_syscall",
                        lambda: probe_result(probe.BPF_SYSCALL, fake.bpf_syscall))  # fmt: skip
    monkeypatch.setattr(probe, "probe_clsact", lambda: probe_result(probe.CLSACT, fake.clsact))
    monkeypatch.setattr(probe, "probe_bpffs",
                        lambda pin_dir: probe_result(probe.BPFFS, fake.bpffs))  # fmt: skip
    monkeypatch.setattr(select, "build_ebpf", build_ebpf)
    monkeypatch.setattr(select, "iptables_module", iptables_module)
    monkeypatch.setattr(select, "nftables_module", nftables_module)
    monkeypatch.setattr(select, "remove_ebpf_leftovers", remove_ebpf_leftovers)
    return fake


EBPF_PROBES = ["probe bpf-syscall", "probe clsact", "probe bpffs", "build ebpf"]
PIN_DIR = "/sys/fs/bpf/kbp-unit-test"  # never touched: the leftover removal is faked


@dataclass(frozen=True)
class SelectionCase:
    requested: str
    kernel: dict[str, Any]
    chosen: str
    reason: str
    calls: list[str]


NO_NFT = "nft not found (install the nftables package)"
WITHOUT_EBPF = [f"remove ebpf leftovers under {PIN_DIR}"]
SELECTION_CASES = {
    "auto uses eBPF when every probe passes and removes nftables and iptables leftovers": (
        SelectionCase(
            "auto", {}, "ebpf", "eBPF probes passed",
            [*EBPF_PROBES, "remove nftables leftovers", "remove iptables leftovers"],
        )
    ),
    "auto falls back to nftables when the bpf syscall is refused, naming the probe": (
        SelectionCase(
            "auto", {"bpf_syscall": EPERM}, "nftables", f"eBPF unavailable: bpf-syscall: {EPERM}",
            ["probe bpf-syscall", "build nftables", *WITHOUT_EBPF, "remove iptables leftovers"],
        )
    ),
    "auto falls back to iptables when neither eBPF nor nftables works, naming both": (
        SelectionCase(
            "auto", {"bpf_syscall": EPERM, "nftables": NO_NFT}, "iptables",
            f"eBPF unavailable: bpf-syscall: {EPERM}; nftables unavailable: {NO_NFT}",
            ["probe bpf-syscall", "build iptables (nft)", *WITHOUT_EBPF,
             "remove nftables leftovers"],
        )
    ),
    "auto falls back to nftables when clsact cannot be created": SelectionCase(
        "auto", {"clsact": "cannot attach kbp_probe to ingress of interface lo: EOPNOTSUPP"},
        "nftables",
        "eBPF unavailable: clsact: cannot attach kbp_probe to ingress of interface lo: EOPNOTSUPP",
        ["probe bpf-syscall", "probe clsact", "build nftables", *WITHOUT_EBPF,
         "remove iptables leftovers"],
    ),
    "auto falls back to nftables when no bpffs is there and none can be mounted": (
        SelectionCase(
            "auto", {"bpffs": "/sys/fs/bpf is not a BPF filesystem (it is sysfs mounted at "
                              "/sys) and mounting one there failed with EPERM"},
            "nftables", "eBPF unavailable: bpffs: /sys/fs/bpf is not a BPF filesystem (it is "
                        "sysfs mounted at /sys) and mounting one there failed with EPERM",
            ["probe bpf-syscall", "probe clsact", "probe bpffs", "build nftables",
             *WITHOUT_EBPF, "remove iptables leftovers"],
        )
    ),
    "auto falls back to nftables when bcc cannot compile, with the first line of why": (
        SelectionCase(
            "auto", {"bcc_compile": "compiling tc_from_pod.c: error: no kernel headers\n"
                                    "  #include <linux/bpf.h>\n  ^"},
            "nftables", "eBPF unavailable: bcc-compile: load: compiling tc_from_pod.c: error: "
                        "no kernel headers",
            [*EBPF_PROBES, "build nftables", *WITHOUT_EBPF, "remove iptables leftovers"],
        )
    ),
    "ebpf when requested and the probes pass": SelectionCase(
        "ebpf", {}, "ebpf", "requested",
        [*EBPF_PROBES, "remove nftables leftovers", "remove iptables leftovers"],
    ),
    "iptables when requested and available, without probing eBPF": SelectionCase(
        "iptables", {}, "iptables", "requested",
        ["build iptables (nft)", *WITHOUT_EBPF, "remove nftables leftovers"],
    ),
    "nftables when requested and available, without probing eBPF": SelectionCase(
        "nftables", {}, "nftables", "requested",
        ["build nftables", *WITHOUT_EBPF, "remove iptables leftovers"],
    ),
    "none when requested: nothing probed, nothing removed": SelectionCase(
        "none", {"bpf_syscall": EPERM}, "none", "requested", [],
    ),
    "a leftover that cannot be removed does not stop the chosen dataplane": SelectionCase(
        "auto", {"leftovers_fail": True}, "ebpf", "eBPF probes passed",
        [*EBPF_PROBES, "remove nftables leftovers", "remove iptables leftovers"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", SELECTION_CASES.values(), ids=SELECTION_CASES.keys())
def test_dataplane_selection(kernel: FakeKernel, case: SelectionCase) -> None:
    for name, value in case.kernel.items():
        setattr(kernel, name, value)
    options = Settings(dataplane=case.requested, bpffs=PIN_DIR).dataplane_options()
    selection = select.select_dataplane(options)
    assert (selection.dataplane.name, selection.reason) == (case.chosen, case.reason)
    # The other dataplane's leftovers go only once the chosen one has applied.
    assert not any(call.startswith("remove") for call in kernel.calls)
    selection.take_over()
    selection.take_over()  # once
    assert kernel.calls == case.calls


def test_a_fallback_is_a_logged_warning_naming_the_failed_probe(
    kernel: FakeKernel, caplog: pytest.LogCaptureFixture
) -> None:
    kernel.clsact = "cannot add clsact: EPERM"
    with caplog.at_level(logging.WARNING, logger="agent.dataplane.select"):
        select.select_dataplane(Settings(dataplane="auto", bpffs=PIN_DIR).dataplane_options())
        kernel.nftables = NO_NFT
        select.select_dataplane(Settings(dataplane="auto", bpffs=PIN_DIR).dataplane_options())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "--dataplane auto: eBPF unavailable: clsact: cannot add clsact: EPERM; "
        "falling back to nftables",
        "--dataplane auto: eBPF unavailable: clsact: cannot add clsact: EPERM; "
        f"nftables unavailable: {NO_NFT}; falling back to iptables",
    ]


START_ERRORS = {
    "ebpf requested but the bpf syscall is refused": (
        "ebpf", {"bpf_syscall": EPERM}, f"--dataplane ebpf: bpf-syscall: {EPERM}",
        ["probe bpf-syscall"],
    ),
    "ebpf requested but bcc fails: the whole compiler message": (
        "ebpf", {"bcc_compile": "compiling: error\n  line 2"},
        "--dataplane ebpf: bcc-compile: load: compiling: error\n  line 2", EBPF_PROBES,
    ),
    "auto, when no dataplane can run: every reason, not a dry run that looks ready": (
        "auto", {"bpf_syscall": EPERM, "nftables": NO_NFT,
                 "iptables": "iptables-restore not found"},
        f"--dataplane auto: no dataplane can run here: eBPF unavailable: bpf-syscall: "
        f"{EPERM}; nftables unavailable: {NO_NFT}; iptables unavailable: iptables-restore "
        "not found",
        ["probe bpf-syscall"],
    ),
    "auto, when the iptables dataplane cannot even be imported": (
        "auto", {"clsact": "no clsact", "iptables_importable": False, "nftables": NO_NFT},
        "--dataplane auto: no dataplane can run here: eBPF unavailable: clsact: no "
        f"clsact; nftables unavailable: {NO_NFT}; iptables unavailable: cannot import the "
        "iptables dataplane: No module named 'agent.dataplane.iptables'",
        ["probe bpf-syscall", "probe clsact"],
    ),
    "nftables requested but unavailable": (
        "nftables", {"nftables": NO_NFT}, f"--dataplane nftables: {NO_NFT}", [],
    ),
    "iptables requested but unavailable": (
        "iptables", {"iptables": "iptables-restore not found (install the iptables package)"},
        "--dataplane iptables: iptables-restore not found (install the iptables package)", [],
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("requested", "overrides", "message", "calls"), START_ERRORS.values(), ids=START_ERRORS.keys()
)
def test_an_explicit_dataplane_that_cannot_start_is_a_start_error(
    kernel: FakeKernel, requested: str, overrides: dict[str, Any], message: str, calls: list[str]
) -> None:
    for name, value in overrides.items():
        setattr(kernel, name, value)
    with pytest.raises(select.DataplaneStartError) as raised:
        select.select_dataplane(Settings(dataplane=requested, bpffs=PIN_DIR).dataplane_options())
    assert str(raised.value) == message
    assert kernel.calls == calls  # no other dataplane tried, nothing removed


def test_the_agent_publishes_the_reason_in_the_metric_and_state(kernel: FakeKernel) -> None:
    kernel.bpf_syscall = EPERM
    agent = Agent(Settings(dataplane="auto", bpffs=PIN_DIR))
    try:
        reason = f"eBPF unavailable: bpf-syscall: {EPERM}"
        assert agent.status.snapshot().to_dict()["dataplaneReason"] == reason
        labels = {"dataplane": "nftables", "reason": reason}
        assert agent.metrics.registry.get_sample_value("kbp_dataplane_info", labels) == 1.0
    finally:
        agent.stop()


def test_an_agent_whose_api_server_does_not_answer_applies_nothing(tmp_path: Path) -> None:
    """Restarted during an API outage: the source is registered before the sync loop
    runs, so the loop never applies the empty store; /readyz stays 503 and the API is
    reported unreachable."""
    with socket.socket() as listener:  # accepts nothing: connections are refused
        listener.bind(("127.0.0.1", 0))
        server = f"https://127.0.0.1:{listener.getsockname()[1]}"
    config = write_kubeconfig(tmp_path / "kubeconfig", server)
    agent = Agent(Settings(dataplane="none", kubeconfig=config, node="node-a",
                           metrics_bind_address="127.0.0.1:0",
                           healthz_bind_address="127.0.0.1:0"))  # fmt: skip
    try:
        agent.start()
        deadline = time.monotonic() + 10
        while agent.status.snapshot().api_reachable is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the loop has run meanwhile (it runs once at start)
        snapshot = agent.status.snapshot()
        assert snapshot.api_reachable is False
        assert agent.loop.runner.runs >= 1
        assert agent.dataplane.held_revision is None  # nothing applied
        assert agent.loop.applied is None and snapshot.state is None
        assert snapshot.ready is False
    finally:
        agent.stop()


# --- `cleanup`: both dataplanes' parts, even when one fails ----------------------------------


@pytest.fixture
def cleanups(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Every dataplane's cleanup function faked; set "ebpf"/"nftables"/"iptables" to an
    exception to make that part fail."""
    outcome: dict[str, Any] = {"ebpf": None, "nftables": None, "iptables": None, "calls": []}

    def nftables_cleanup(netns: str | None = None) -> list[str]:
        outcome["calls"].append("nftables")
        if outcome["nftables"] is not None:
            raise outcome["nftables"]
        return ["table ip kube-bpf-proxy", "table ip6 kube-bpf-proxy"]

    def ebpf_cleanup(pin_dir: Path) -> tuple[list[str], list[str]]:
        outcome["calls"].append(f"ebpf {pin_dir}")
        if outcome["ebpf"] is not None:
            raise outcome["ebpf"]
        return ["vethkbp1"], ["kbp_services_v1", "kbp_backends_v1"]

    def iptables_cleanup(netns: str | None = None, backend: Any = None) -> list[str]:
        outcome["calls"].append(f"iptables {backend.name}")
        if backend.name == "legacy":
            return []
        if outcome["iptables"] is not None:
            raise outcome["iptables"]
        return ["IPv4 nat PREROUTING -j KBP-SERVICES", "IPv4 nat KBP-SERVICES"]

    def installed_backends(netns: str | None = None) -> list[Any]:
        return [SimpleNamespace(name="nft"), SimpleNamespace(name="legacy")]

    import agent.dataplane.ebpf.dataplane as ebpf_dataplane

    monkeypatch.setattr(ebpf_dataplane, "cleanup", ebpf_cleanup)
    monkeypatch.setitem(sys.modules, "agent.dataplane.iptables.dataplane",
                        SimpleNamespace(cleanup=iptables_cleanup,
                                        installed_backends=installed_backends))  # fmt: skip
    monkeypatch.setitem(sys.modules, "agent.dataplane.nftables.dataplane",
                        SimpleNamespace(cleanup=nftables_cleanup))  # fmt: skip
    return outcome


def test_cleanup_removes_what_either_dataplane_installed(
    cleanups: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["cleanup", "--bpffs", PIN_DIR]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [  # counts per kind: a node's cleanup removes thousands of chains
        f"ebpf: detached from 1 interface(s); removed 2 pin(s) under {PIN_DIR}",
        "nftables: removed table ip kube-bpf-proxy, table ip6 kube-bpf-proxy",
        "iptables (nft): removed IPv4 nat: 1 jump rule(s), 1 chain(s)",
        "iptables (legacy): removed nothing",
    ]
    assert main(["cleanup", "--bpffs", PIN_DIR, "-v"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"ebpf: detached from 1 interface(s); removed 2 pin(s) under {PIN_DIR}",
        "  interface vethkbp1",
        "  pin kbp_services_v1",
        "  pin kbp_backends_v1",
        "nftables: removed table ip kube-bpf-proxy, table ip6 kube-bpf-proxy",
        "iptables (nft): removed IPv4 nat: 1 jump rule(s), 1 chain(s)",
        "  IPv4 nat PREROUTING -j KBP-SERVICES",
        "  IPv4 nat KBP-SERVICES",
        "iptables (legacy): removed nothing",
    ]


@pytest.mark.parametrize("failing", ["ebpf", "nftables", "iptables"])
def test_cleanup_does_the_other_part_when_one_fails_and_exits_1(
    cleanups: dict[str, Any], capsys: pytest.CaptureFixture[str], failing: str
) -> None:
    cleanups[failing] = DataplaneError("broken", f"{failing} is broken")
    assert main(["cleanup", "--bpffs", PIN_DIR]) == 1
    calls = [f"ebpf {PIN_DIR}", "nftables", "iptables nft", "iptables legacy"]
    assert cleanups["calls"] == calls
    captured = capsys.readouterr()
    part = "iptables (nft)" if failing == "iptables" else failing
    assert captured.err == f"kube-bpf-proxy cleanup: {part}: {failing} is broken\n"
    # the rest still ran: the other dataplanes, and the other iptables backend
    parts = ["ebpf", "nftables", "iptables (nft)", "iptables (legacy)"]
    others = [p for p in parts if p != part]
    assert [line.split(":")[0] for line in captured.out.splitlines()] == others


# --- `cleanup` and the node's lock ------------------------------------------------------------


def test_cleanup_refuses_while_an_agent_holds_the_node_and_removes_nothing(
    cleanups: dict[str, Any], capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
) -> None:  # fmt: skip
    monkeypatch.setenv("KBP_LOCK_DIR", str(tmp_path))
    agent = NodeLock(tmp_path, PIN_DIR)  # a running agent's: an open file description
    assert agent.try_acquire() is None
    try:
        assert main(["cleanup", "--bpffs", PIN_DIR]) == 1
        assert cleanups["calls"] == []
        captured = capsys.readouterr()
        assert captured.out == ""
        [line] = captured.err.splitlines()
        assert line.startswith(f"kube-bpf-proxy cleanup: an agent runs on {PIN_DIR}: "
                               f"pid {os.getpid()} (started "), line  # fmt: skip
        assert line.endswith(f"holds {agent.path}; nothing removed (stop the agent first, "
                             "or --force)"), line  # fmt: skip

        assert main(["cleanup", "--bpffs", PIN_DIR, "--force"]) == 0
        assert cleanups["calls"] == [f"ebpf {PIN_DIR}", "nftables", "iptables nft",
                                     "iptables legacy"]  # fmt: skip
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("ebpf: detached from 1 interface(s)"), out
        assert out[-1] == (f"--force: removed while the agent (pid {os.getpid()}) still runs "
                           f"and holds {agent.path}; it puts back what it serves when it "
                           "next checks the dataplane")  # fmt: skip
        assert agent.held and agent.path.exists()  # the agent's lock is untouched
    finally:
        agent.release()


def test_cleanup_holds_the_lock_while_it_removes(
    cleanups: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KBP_LOCK_DIR", str(tmp_path))
    seen: list[object] = []
    import agent.dataplane.ebpf.dataplane as ebpf_dataplane

    faked = ebpf_dataplane.cleanup

    def ebpf_cleanup(pin_dir: Path) -> tuple[list[str], list[str]]:
        seen.append(NodeLock(tmp_path, PIN_DIR).try_acquire())  # an agent starting now
        return faked(pin_dir)

    monkeypatch.setattr(ebpf_dataplane, "cleanup", ebpf_cleanup)
    monkeypatch.setattr(sys, "argv", ["/usr/bin/kube-bpf-proxy", "cleanup", "--bpffs", PIN_DIR])
    assert main(sys.argv[1:]) == 0
    [holder] = seen
    assert holder is not None and holder.pid == os.getpid()
    assert "cleanup" in holder.fields["command"]
    assert not NodeLock(tmp_path, PIN_DIR).path.exists()  # let go: the next agent starts


def waiting_agent(lock_dir: Path) -> tuple[subprocess.Popen[str], list[str]]:
    """`run --dataplane none` on the default --bpffs, whose lock the caller holds: the
    process, and its stderr lines up to the one that says it waits."""
    process = subprocess.Popen(
        [sys.executable, "-m", "agent", "run", "--manifests", "examples", "--node", "node-a",
         "--dataplane", "none", "--metrics-bind-address", "127.0.0.1:0",
         "--healthz-bind-address", "127.0.0.1:0"],
        cwd=ROOT, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "KBP_LOCK_DIR": str(lock_dir)},
    )  # fmt: skip
    assert process.stderr is not None
    lines = []
    while "holds the node's lock" not in (lines[-1] if lines else ""):
        line = process.stderr.readline()
        assert line, f"the agent exited {process.wait()}: {lines}"
        lines.append(line.rstrip())
    return process, lines


def test_a_second_run_waits_for_the_lock_and_starts_when_the_holder_lets_go(
    tmp_path: Path,
) -> None:
    holder = NodeLock(tmp_path, Settings().bpffs)
    assert holder.try_acquire() is None
    process, lines = waiting_agent(tmp_path)
    try:
        assert f"pid {os.getpid()} (started " in lines[-1], lines
        assert "writes nothing to the node until it holds the lock" in lines[-1], lines
        time.sleep(0.5)
        assert process.poll() is None
        holder.release()
        assert process.stderr is not None
        rest = [process.stderr.readline().rstrip() for _ in range(3)]
        assert "now holding the node's lock" in rest[0], rest
        # /livez answers before the dataplane is chosen (and compiled, for eBPF)
        assert "health server listening" in rest[1], rest
        assert "dataplane: none (requested)" in rest[2], rest
    finally:
        holder.release()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0


def test_sigterm_while_waiting_for_the_lock_exits_0_at_once_having_started_nothing(
    tmp_path: Path,
) -> None:
    holder = NodeLock(tmp_path, Settings().bpffs)
    assert holder.try_acquire() is None
    try:
        process, lines = waiting_agent(tmp_path)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=2) == 0
        assert process.stderr is not None
        lines += process.stderr.read().splitlines()
    finally:
        holder.release()
    assert [line.split(" ", 4)[-1] for line in lines[1:]] == [
        "received SIGTERM, stopping",
        "stopped while waiting for the node's lock: wrote nothing",
    ], lines


def test_livez_answers_while_the_dataplane_is_still_being_chosen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The eBPF dataplane's choice includes bcc's compile (over a minute at a 100m CPU
    request): the health server is up before it, /livez alive and /readyz not ready."""
    from agent import daemon

    compiling, finish = threading.Event(), threading.Event()
    real = daemon.select_dataplane

    def slow_choice(options: select.DataplaneOptions) -> select.Selection:
        compiling.set()
        finish.wait(30)
        return real(options)

    monkeypatch.setattr(daemon, "select_dataplane", slow_choice)
    port = free_port()
    settings = Settings(dataplane="none", healthz_bind_address=f"127.0.0.1:{port}",
                        metrics_bind_address="127.0.0.1:0")  # fmt: skip
    made: list[Agent] = []
    thread = threading.Thread(target=lambda: made.append(Agent(settings)))
    thread.start()
    try:
        assert compiling.wait(10)
        assert get(f"http://127.0.0.1:{port}/livez")[0] == 200
        assert get(f"http://127.0.0.1:{port}/readyz")[0] == 503
    finally:
        finish.set()
        thread.join(10)
    assert made, "the agent did not start"
    made[0].stop()
