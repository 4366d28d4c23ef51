"""Health-probe latency of the agent's HTTP serving layer under hostile clients (issue 21).

    .venv/bin/python bench/http_load.py                     # this tree's serving layer
    .venv/bin/python bench/http_load.py --baseline 8ba9f51  # and the one at that commit

A `/healthz` handler (kube-proxy's health rule over a real AgentStatus) is served on
127.0.0.1 by `agent.api.serving.serve`, and by the `serve` of `agent/api/serving.py` at
`--baseline` (read with `git show`) side by side. For each load, hostile clients from
`tests.httpload` (another process; from 40 loopback addresses unless said) connect first; then one
normal probe every `--interval` seconds for `--seconds` opens a connection, asks
`GET /healthz` and waits up to `--probe-timeout`. Printed per load: probes answered,
the median, p99 and worst latency, and how many took longer than 1 s (the issue's
target: none, with 2,000 slow or idle clients).

Loads: none; 300 slow clients (one byte a second, never finishing); 2,000 idle clients
(connect, send nothing); 2,000 slow clients; 2,000 idle clients all from one address
(the per-address limit keeps 64 and the rest keep reconnecting). Hostile clients whom
the server closes connect again at once. `--seconds` defaults to 12, longer than the
10 s request deadline, so that the slow clients' reconnections are measured too.
"hostile open" is what the clients see as open when probing starts, "held" what the
server holds (this tree only).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.api import serving as current
from bench.common.probe import (
    Probe,
    ProbeFigures,
    cell,
    healthz_handler,
    probe_figures,
    probe_until,
)
from bench.common.report import (
    ROOT,
    machine,
    mark,
    results_path,
    write_results,
)
from tests.httpload import HostileClients

# name, hostile clients, mode, loopback source addresses they come from
LOADS = [
    ("none", 0, "idle", 0),
    ("300 slow", 300, "slow", 40),
    ("2000 idle", 2000, "idle", 40),
    ("2000 slow", 2000, "slow", 40),
    ("2000 idle, one address", 2000, "idle", 1),
]
TARGET = 1.0  # seconds: every probe answered within this


@dataclass
class Figures(ProbeFigures):
    server: str
    load: str
    hostile_open: int  # hostile connections open when probing began, as the clients see it
    held: int | None  # connections the server held then (this tree's server only)


def load_baseline(revision: str) -> ModuleType:
    """`agent/api/serving.py` as it was at `revision`, imported under another name."""
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:agent/api/serving.py"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    directory = Path(tempfile.mkdtemp(prefix="kbp-bench-serving-"))
    path = directory / "baseline_serving.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("baseline_serving", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    path.unlink()
    directory.rmdir()
    return module


@contextlib.contextmanager
def served(module: ModuleType) -> Iterator[Any]:
    routes = {"/healthz": healthz_handler()}
    if module is current:
        server = module.serve("127.0.0.1:0", routes, name="bench", workers=0)
    else:
        server = module.serve("127.0.0.1:0", routes, name="bench")
    try:
        yield server
    finally:
        server.close()


def measure(
    label: str, module: ModuleType, load: tuple[str, int, str, int], args: argparse.Namespace
) -> Figures:
    name, clients, mode, sources = load
    results: list[Probe] = []
    with served(module) as server:
        hostile = (
            HostileClients(
                f"127.0.0.1:{server.port}",
                clients,
                mode,
                sources=sources,
                wait_open=min(clients, 50),
                timeout=30,
            )
            if clients
            else contextlib.nullcontext()
        )
        with hostile as load_process:
            time.sleep(2.0 if clients else 0.0)  # let every client try to connect
            opened = load_process.last.get("open", 0) if load_process else 0
            held = getattr(server, "open_connections", None)
            end = time.monotonic() + args.seconds
            probe_until(server.port, args.probe_timeout, args.interval,
                        lambda: time.monotonic() >= end, results)  # fmt: skip
    return Figures(server=label, load=name, hostile_open=opened, held=held,
                   **probe_figures(results, TARGET))  # fmt: skip


def show(figures: Figures) -> None:
    print(
        f"| {figures.server} | {figures.load} | {figures.hostile_open} "
        f"| {'-' if figures.held is None else figures.held} "
        f"| {figures.answered}/{figures.probes} | {cell(figures.median)} | {cell(figures.p99)} "
        f"| {cell(figures.worst)} | {figures.over_target} {mark(figures.over_target == 0)} "
        f"| {', '.join(figures.errors)} |",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="git revision whose serving layer to measure too")
    parser.add_argument("--seconds", type=float, default=12.0, help="probing time per load")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between probes")
    parser.add_argument("--probe-timeout", type=float, default=5.0)
    parser.add_argument(
        "--loads", help="comma-separated subset of: " + ", ".join(name for name, *_ in LOADS)
    )
    parser.add_argument("--json", type=Path, help="results file (default bench/results/)")
    args = parser.parse_args()
    before, after = current.raise_open_files_limit()
    loads = LOADS
    if args.loads:
        wanted = {name.strip() for name in args.loads.split(",")}
        loads = [load for load in LOADS if load[0] in wanted]
    servers: list[tuple[str, ModuleType]] = [("this tree", current)]
    if args.baseline:
        servers.append((f"baseline {args.baseline}", load_baseline(args.baseline)))
    print(
        f"open files: {before} -> {after}; probes every {args.interval:g}s for "
        f"{args.seconds:g}s per load, {args.probe_timeout:g}s probe timeout"
    )
    columns = ["server", "load", "hostile open", "held", "answered", "median", "p99", "worst",
               "> 1 s", "errors"]  # fmt: skip
    print("\n| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    results = []
    for load in loads:
        for label, module in servers:
            figures = measure(label, module, load, args)
            show(figures)
            results.append(asdict(figures))
    out = results_path(args, "http_load")
    write_results(out, {
        "machine": machine(),
        "settings": {"seconds": args.seconds, "interval": args.interval,
                     "probe_timeout": args.probe_timeout},
        "results": results,
    })  # fmt: skip
    print(f"\nresults written to {out}")


if __name__ == "__main__":
    main()
