"""What every benchmark prints and writes: the machine it ran on, figures as medians
with nearest-rank p99, timing with the cyclic GC's share, and the JSON result files in
bench/results/."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agent.sources.manifests import YamlLoader

ROOT = Path(__file__).resolve().parents[2]  # the checkout
RESULTS = ROOT / "bench" / "results"


class GcClock:
    """Time spent in CPython's cyclic garbage collector, from gc.callbacks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._started = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started
            self.collections[info["generation"]] += 1


GC = GcClock()


@dataclass
class Summary:
    """Samples in one unit (ns here, seconds or µs elsewhere): median, nearest-rank p99
    (the maximum below 100 samples), min-max, mean."""

    samples: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def p99(self) -> float:
        """Nearest-rank 99th percentile; the maximum when there are fewer than 100 samples."""
        ordered = sorted(self.samples)
        return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    def to_json(self) -> dict[str, float]:
        return {
            "median": self.median,
            "p99": self.p99,
            "min": min(self.samples),
            "max": max(self.samples),
            "mean": self.mean,
            "n": len(self.samples),
        }


@dataclass
class Stat(Summary):
    """Summary of timings in seconds, with the share spent in the cyclic GC."""

    gc: list[float] = field(default_factory=list)  # of which in the cyclic GC, per sample

    @property
    def gc_share(self) -> float | None:
        """Median share of the time spent in the cyclic GC."""
        if not self.gc:
            return None
        return statistics.median(g / t for g, t in zip(self.gc, self.samples, strict=True) if t)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in super().to_json().items() if k != "mean"}
        if self.gc:
            out["gc_median"] = statistics.median(self.gc)
            out["gc_share"] = self.gc_share
        return out


def mark(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def fmt_s(seconds: float) -> str:
    if seconds < 0:
        return "-" + fmt_s(-seconds)
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.{1 if seconds < 0.1 else 0}f} ms"
    return f"{seconds:.2f} s"


def fmt_b(size: float) -> str:
    return f"{size / 2**20:.1f} MiB"


VULNERABILITIES = Path("/sys/devices/system/cpu/vulnerabilities")


def cpu_mitigations(directory: Path = VULNERABILITIES) -> dict[str, str]:
    """The CPU vulnerabilities the kernel mitigates here, by name, with how: what a
    function return or an indirect call costs depends on them (on AMD Zen 3 the SRSO
    mitigation "Safe RET" makes every return in the kernel dearer), so figures of
    call-heavy paths (a hash map insert) differ between machines that differ only here."""
    out = {}
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return out
    for entry in entries:
        try:
            status = entry.read_text().strip()
        except OSError:
            continue
        if status.startswith("Mitigation"):
            out[entry.name] = status.removeprefix("Mitigation:").strip()
    return out


def machine() -> dict[str, Any]:
    first: dict[str, str] = {}  # the first processor's fields, up to its flags
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            first[key.strip()] = value.strip()
            if key.strip() == "flags":
                break
    except OSError:
        pass
    family = first.get("cpu family", "")
    return {
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "cpus": os.cpu_count(),
        "cpu_model": first.get("model name", ""),
        "cpu_family_model": f"{family}/{first.get('model', '')}" if family else "",
        "virtual_machine": "hypervisor" in first.get("flags", "").split(),
        "cpu_mitigations": cpu_mitigations(),
        "kernel": platform.release(),
        "yaml_libyaml": bool(getattr(yaml, "__with_libyaml__", False)),
        "yaml_loader": YamlLoader.__name__,
        "gc_threshold": list(gc.get_threshold()),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        "commit": git_commit(),
    }


def git_commit() -> str:
    """HEAD of the checkout being measured, with "+dirty" when agent/ has local changes."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "agent"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def header(name: str, info: dict[str, Any], extra: str = "") -> None:
    print(
        f"{name}: kernel {info['kernel']}, {info['cpus']} CPUs ({cpu_text(info)}), "
        f"Python {info['python']}, commit {info['commit']}, load average "
        f"{info['load_average_at_start'][0]}{extra}",
        flush=True,
    )


# The mitigations that change what a return or an indirect call costs in the kernel.
CALL_MITIGATIONS = ("spectre_v2", "retbleed", "spec_rstack_overflow", "indirect_target_selection")


def cpu_text(info: dict[str, Any]) -> str:
    """The CPU as the header names it: model, family/model, a VM's, and the mitigations
    that change what calls cost (CALL_MITIGATIONS, each by the first clause of its
    status), e.g. "AMD EPYC, family/model 25/1, virtual; spectre_v2: Retpolines,
    spec_rstack_overflow: Safe RET"."""
    text = info.get("cpu_model") or "unknown CPU"
    if info.get("cpu_family_model"):
        text += f", family/model {info['cpu_family_model']}"
    if info.get("virtual_machine"):
        text += ", virtual"
    mitigated = info.get("cpu_mitigations") or {}
    calls = [f"{k}: {mitigated[k].split(';')[0]}" for k in CALL_MITIGATIONS if k in mitigated]
    if calls:
        text += "; " + ", ".join(calls)
    return text


def results_path(args: Any, name: str) -> Path:
    """--json if given, else bench/results/NAME.json (NAME-quick.json for --quick)."""
    quick = getattr(args, "quick", False)
    return args.json or RESULTS / (f"{name}-quick.json" if quick else f"{name}.json")


def write_results(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def terminate_as_interrupt() -> None:
    """SIGTERM unwinds like Ctrl-C, so every `finally` removes what it made. bench.compile's
    GC clock (a gc.callbacks hook, registered on import) is removed: an exception raised
    while a gc callback runs is printed and dropped, so a signal landing there was lost."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    with contextlib.suppress(ValueError):
        gc.callbacks.remove(GC._callback)
    signal.signal(signal.SIGTERM, handler)


def baseline_tree(ref: str, into: Path) -> str:
    """Extract `ref`'s agent/ into `into`; return the commit."""
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", ref], check=True, capture_output=True, text=True
    ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "agent"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into)  # our own repository's archive
    return commit


def default_baseline() -> str:
    result = subprocess.run(
        ["git", "-C", str(ROOT), "merge-base", "HEAD", "main"], capture_output=True, text=True
    )
    return result.stdout.strip() or "HEAD~1"
