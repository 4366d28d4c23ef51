"""`kube-bpf-proxy run` end to end in a subprocess: the file source, the dry-run
dataplane, the local API over real HTTP, and a clean stop on SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

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
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=10) == 0


def test_an_unavailable_dataplane_is_a_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--manifests", "examples", "--dataplane",
         "iptables"],
        cwd=ROOT, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--dataplane iptables" in result.stderr


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
