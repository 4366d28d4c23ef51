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
import http.client
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agent.api import AgentStatus  # noqa: E402
from agent.api import serving as current  # noqa: E402
from agent.api.serving import Request, Response, json_response  # noqa: E402
from bench.compile import RESULTS, fmt_s, git_commit, mark  # noqa: E402
from tests.httpload import HostileClients  # noqa: E402

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
class Figures:
    server: str
    load: str
    hostile_open: int  # hostile connections open when probing began, as the clients see it
    held: int | None  # connections the server held then (this tree's server only)
    probes: int
    answered: int
    over_target: int
    median: float | None
    p99: float | None
    worst: float | None
    errors: list[str]


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


def healthz_handler() -> Callable[[Request], Response]:
    status = AgentStatus(dataplane="none")

    def healthz(request: Request) -> Response:
        report = status.health(60.0)
        return json_response(200 if report.healthy else 503, {"healthy": report.healthy})

    return healthz


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


def probe(port: int, timeout: float) -> tuple[float, str | None]:
    started = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            conn.request("GET", "/healthz")
            response = conn.getresponse()
            response.read()
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as err:
        return time.monotonic() - started, type(err).__name__
    if response.status != 200:
        return time.monotonic() - started, f"HTTP {response.status}"
    return time.monotonic() - started, None


def measure(
    label: str, module: ModuleType, load: tuple[str, int, str, int], args: argparse.Namespace
) -> Figures:
    name, clients, mode, sources = load
    results: list[tuple[float, str | None]] = []
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
            while time.monotonic() < end:
                started = time.monotonic()
                results.append(probe(server.port, args.probe_timeout))
                time.sleep(max(0.0, args.interval - (time.monotonic() - started)))
    ok = sorted(took for took, error in results if error is None)
    return Figures(
        server=label,
        load=name,
        hostile_open=opened,
        held=held,
        probes=len(results),
        answered=len(ok),
        over_target=sum(1 for took, error in results if error or took > TARGET),
        median=ok[len(ok) // 2] if ok else None,
        p99=ok[min(len(ok) - 1, int(len(ok) * 0.99))] if ok else None,
        worst=max(took for took, _ in results) if results else None,
        errors=sorted({error for _, error in results if error}),
    )


def show(figures: Figures) -> None:
    def cell(value: float | None) -> str:
        return fmt_s(value) if value is not None else "-"

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
    out = args.json or RESULTS / "http_load.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "machine": {
                    "python": sys.version.split()[0],
                    "cpus": os.cpu_count(),
                    "kernel": platform.release(),
                    "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
                    "commit": git_commit(),
                },
                "settings": {
                    "seconds": args.seconds,
                    "interval": args.interval,
                    "probe_timeout": args.probe_timeout,
                },
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"\nresults written to {out}")


if __name__ == "__main__":
    main()
