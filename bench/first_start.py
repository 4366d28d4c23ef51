"""A first start's datapath compile at a CPU limit (issue 33 item 4): how long the agent
takes from its process start to the eBPF datapath compiled and loaded, at the DaemonSet's
CPU request enforced as a hard quota, cold (no compile cache: the trial compile in a child,
then the compile in the process) and warm (the cache remembers the trial); and how the
agent's health server answers `/livez` meanwhile, probed as kubelet probes it (every
second here, 5 s timeout). The DaemonSet's startup probe is sized on these figures
(bench/README.md).

Each run is a fresh Python process in a cgroup of its own (cgroup v2 `cpu.max`, else the
v1 `cpu` controller's CFS quota) that opens the agent's HealthServer on 127.0.0.1, then
compiles into a temporary pin directory under /sys/fs/bpf and removes it. It attaches
nothing anywhere. Needs root and a bpffs at /sys/fs/bpf. Not a test: it prints figures.

    .venv/bin/python bench/first_start.py [--millicores 100] [--runs 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE_PERIOD, PROBE_TIMEOUT = 1.0, 5.0  # seconds; the DaemonSet's timeoutSeconds is 5
# What one run does: the agent's imports, its health server (as `run` opens it before the
# dataplane is chosen), load_programs; timed from process start.
CHILD = """
import os, shutil, sys, tempfile, time
started = time.perf_counter()
sys.path.insert(0, sys.argv[1])
from agent.api import AgentStatus, HealthServer
from agent.dataplane.ebpf.kernel import load_programs
imported = time.perf_counter()
server = HealthServer("127.0.0.1:0", AgentStatus(), 30.0)
print(f"port {server.port}", flush=True)
pins = tempfile.mkdtemp(prefix="kbp-bench-first-start-", dir="/sys/fs/bpf")
try:
    load_programs(__import__("pathlib").Path(pins)).close()
finally:
    shutil.rmtree(pins)
print(f"{imported - started:.2f} {time.perf_counter() - started:.2f}", flush=True)
server.close()
"""


@dataclass
class Start:
    imports: float = 0.0
    total: float = 0.0
    probes: list[float] = field(default_factory=list)  # seconds each /livez took
    failures: list[str] = field(default_factory=list)


def cgroup_with_quota(millicores: int) -> tuple[Path, Path]:
    """A new cgroup limited to `millicores`; (its directory, its procs file)."""
    period = 100_000
    quota = period * millicores // 1000
    v2 = Path("/sys/fs/cgroup")
    if (v2 / "cgroup.controllers").exists() and "cpu" in (v2 / "cgroup.controllers").read_text():
        directory = Path(tempfile.mkdtemp(prefix="kbp-bench-", dir=v2))
        (directory / "cpu.max").write_text(f"{quota} {period}\n")
        return directory, directory / "cgroup.procs"
    v1 = Path("/sys/fs/cgroup/cpu")
    directory = Path(tempfile.mkdtemp(prefix="kbp-bench-", dir=v1))
    (directory / "cpu.cfs_period_us").write_text(f"{period}\n")
    (directory / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    return directory, directory / "cgroup.procs"


def probe(port: int, start: Start, done: threading.Event) -> None:
    """GET /livez every PROBE_PERIOD until `done` (from outside the cgroup, as kubelet)."""
    while not done.is_set():
        began = time.perf_counter()
        try:
            url = f"http://127.0.0.1:{port}/livez"
            with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT) as response:
                response.read()
            start.probes.append(time.perf_counter() - began)
        except urllib.error.HTTPError as err:
            start.failures.append(f"HTTP {err.code}")
        except OSError as err:
            if done.is_set():
                return  # the process finished meanwhile
            start.failures.append(f"{type(err).__name__}: {err}")
        done.wait(max(0.0, PROBE_PERIOD - (time.perf_counter() - began)))


def one_start(millicores: int, cache: str) -> Start:
    directory, procs = cgroup_with_quota(millicores)
    env = dict(os.environ, KBP_COMPILE_CACHE_DIR=cache)
    start, done = Start(), threading.Event()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(ROOT)],
            preexec_fn=lambda: procs.write_text(f"{os.getpid()}\n"),
            env=env, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdout is not None
        port = int(child.stdout.readline().split()[1])
        prober = threading.Thread(target=probe, args=(port, start, done))
        prober.start()
        figures = child.stdout.readline()
        done.set()
        prober.join()
        if child.wait() != 0:
            raise SystemExit(f"first_start.py: the measured process exited {child.returncode}")
    finally:
        directory.rmdir()
    start.imports, start.total = (float(x) for x in figures.split())
    return start


def describe(start: Start) -> str:
    probes = sorted(start.probes)
    slowest = f"{probes[-1] * 1000:.0f} ms" if probes else "-"
    median = f"{probes[len(probes) // 2] * 1000:.0f} ms" if probes else "-"
    failed = f", {len(start.failures)} failed: {start.failures[:3]}" if start.failures else ""
    return (f"{start.total:.1f} s (imports {start.imports:.1f} s); /livez {len(probes)} "
            f"answers, median {median}, slowest {slowest}{failed}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--millicores", type=int, default=100)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    if os.geteuid() != 0 or not Path("/sys/fs/bpf").is_dir():
        sys.exit("first_start.py: needs root and /sys/fs/bpf")
    print(f"first start at {args.millicores}m (hard quota), load average "
          f"{os.getloadavg()[0]:.1f}")  # fmt: skip
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kbp-bench-cache-") as cache:
            cold = one_start(args.millicores, cache)
            warm = one_start(args.millicores, cache)
        print(f"run {run + 1}: cold {describe(cold)}")
        print(f"run {run + 1}: warm {describe(warm)}")


if __name__ == "__main__":
    main()
