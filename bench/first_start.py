"""A first start's datapath compile at a CPU limit (issue 33 item 4): how long the agent
takes from its process start to the eBPF datapath compiled and loaded, at the DaemonSet's
CPU request enforced as a hard quota, cold (no compile cache: the trial compile in a child,
then the compile in the process) and warm (the cache remembers the trial). The DaemonSet's
startup probe is sized on these figures (bench/README.md).

Each run is a fresh Python process in a cgroup of its own (cgroup v2 `cpu.max`, else the
v1 `cpu` controller's CFS quota) that compiles into a temporary pin directory under
/sys/fs/bpf and removes it. It attaches nothing anywhere. Needs root and a bpffs at
/sys/fs/bpf. Not a test: it prints figures.

    .venv/bin/python bench/first_start.py [--millicores 100] [--runs 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# What one run does: the agent's imports and load_programs, timed from process start.
CHILD = """
import os, shutil, sys, tempfile, time
started = time.perf_counter()
sys.path.insert(0, sys.argv[1])
from agent.dataplane.ebpf.kernel import load_programs
imported = time.perf_counter()
pins = tempfile.mkdtemp(prefix="kbp-bench-first-start-", dir="/sys/fs/bpf")
try:
    load_programs(__import__("pathlib").Path(pins)).close()
finally:
    shutil.rmtree(pins)
print(f"{imported - started:.2f} {time.perf_counter() - started:.2f}")
"""


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


def one_start(millicores: int, cache: str) -> tuple[float, float]:
    """(imports, total) seconds of one start in a fresh cgroup."""
    directory, procs = cgroup_with_quota(millicores)
    env = dict(os.environ, KBP_COMPILE_CACHE_DIR=cache)
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(ROOT)],
            preexec_fn=lambda: procs.write_text(f"{os.getpid()}\n"),
            env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
    finally:
        directory.rmdir()
    imports, total = (float(x) for x in done.stdout.split())
    return imports, total


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
        print(f"run {run + 1}: cold {cold[1]:.1f} s (imports {cold[0]:.1f} s), "
              f"warm {warm[1]:.1f} s (imports {warm[0]:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
