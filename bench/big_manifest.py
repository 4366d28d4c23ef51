"""Health-probe latency while the file source reads one very large manifest (issue 21).

    .venv/bin/python bench/big_manifest.py              # a 200 MB `kind: List`, ~2 min
    .venv/bin/python bench/big_manifest.py --size 50    # 50 MB

The file (tests/bigmanifest.py: one YAML document, a `kind: List` of Services with an
EndpointSlice of ten endpoints each) is read by `load_file` in a worker process that also
serves `/healthz` on 127.0.0.1 with the agent's serving layer, as the agent does, once
parsing in the worker itself (as before: `child_from=None`) and once through the parser
child process (`parse_in_child`, what files above `CHILD_FROM` get), side by side. This
process probes `/healthz` every `--interval` seconds, each on a new connection, from
before the load starts until it ends. Printed per way: the load time, the objects
decoded, the worker's peak RSS and the parser child's, and the probes' median, p99 and
worst latency with how many took over 1 s (the target: none).

    .venv/bin/python bench/big_manifest.py --agent                # ~40 min here at 200 MB
    .venv/bin/python bench/big_manifest.py --agent --baseline main --size 20

`--agent`: the whole agent (`run --manifests DIR --dataplane none`), once with this
checkout's agent/ and once with `--baseline`'s (default: the merge base with main), both
at once so they share the machine's load. Each loads the file, and when it is ready the
file is replaced by one holding one more Service (the whole file changes, so it is read
and decoded again and the old objects are freed); this process probes `/healthz`,
`/readyz` and `/metrics` in turn every `--interval` seconds on new connections, from the
start; once the new revision is in, the first file comes back (what the first reload
decoded is freed then), and probing goes on until 30 s after that revision. Printed per
agent and phase (load, reload, reload 2, after): the phase's time, the probes, median,
p99, worst and how many over 1 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common.probe import (
    Probe,
    ProbeFigures,
    cell,
    healthz_handler,
    probe_figures,
    probe_until,
)
from bench.common.report import (
    RESULTS,
    ROOT,
    baseline_tree,
    default_baseline,
    fmt_s,
    machine,
    mark,
    results_path,
    write_results,
)
from tests.bigmanifest import ENDPOINTS, write_list

TARGET = 1.0  # seconds: every probe answered within this
WAYS = {"in the agent's process": "inline", "parser child process": "child"}


@dataclass
class Figures(ProbeFigures):
    way: str
    load_seconds: float
    objects: int
    reports: int
    worker_peak_rss_mib: float
    child_peak_rss_mib: float


def worker(mode: str, path: Path) -> None:
    """Serve /healthz, then load `path`; print the port, then one JSON line of figures."""
    from agent.api.serving import serve
    from agent.sources.manifests import CHILD_FROM, load_file

    server = serve("127.0.0.1:0", {"/healthz": healthz_handler()}, name="bench")
    print(json.dumps({"port": server.port}), flush=True)
    sys.stdin.readline()  # the prober is running
    started = time.monotonic()
    assert path.stat().st_size > CHILD_FROM
    load = load_file(path, child_from=None if mode == "inline" else CHILD_FROM)
    seconds = time.monotonic() - started
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(
        json.dumps(
            {
                "seconds": seconds,
                "objects": len(load.entries),
                "reports": [str(r) for r in load.reports[:5]],
                "report_count": len(load.reports),
                "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                "child_peak_rss_kib": children,
            }
        ),
        flush=True,
    )
    sys.stdin.readline()
    server.close()


def measure(way: str, mode: str, path: Path, args: argparse.Namespace) -> Figures:
    process = subprocess.Popen(
        [sys.executable, __file__, "--worker", mode, str(path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert process.stdin is not None and process.stdout is not None
    port = json.loads(process.stdout.readline())["port"]
    results: list[Probe] = []
    done = threading.Event()
    thread = threading.Thread(
        target=probe_until, args=(port, args.probe_timeout, args.interval, done.is_set, results)
    )
    thread.start()
    time.sleep(0.5)
    process.stdin.write("go\n")
    process.stdin.flush()
    line = process.stdout.readline()
    done.set()
    thread.join()
    process.stdin.write("stop\n")
    process.stdin.close()
    process.wait(timeout=60)
    figures = json.loads(line)
    for report in figures["reports"]:
        print(f"  report: {report}")
    return Figures(
        way=way,
        load_seconds=figures["seconds"],
        objects=figures["objects"],
        reports=figures["report_count"],
        worker_peak_rss_mib=figures["peak_rss_kib"] / 1024,
        child_peak_rss_mib=figures["child_peak_rss_kib"] / 1024,
        **probe_figures(results, TARGET),
    )


PATHS = ("/healthz", "/readyz", "/metrics")
AFTER = 30.0  # seconds probed after the reload's revision is in


def get(port: int, path: str, timeout: float) -> tuple[float, str | None, bytes]:
    """(seconds, error or None, body) of one GET on a new connection."""
    import http.client

    started = time.monotonic()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
    except (OSError, http.client.HTTPException) as err:
        return time.monotonic() - started, type(err).__name__, b""
    error = None if response.status == 200 else f"HTTP {response.status}"
    return time.monotonic() - started, error, body


def clock(monotonic: float) -> str:
    """A time.monotonic() value as the wall-clock time the agents' logs show."""
    wall = time.time() - (time.monotonic() - monotonic)
    return time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall % 1 * 10)}"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def metric(body: bytes, name: str) -> float:
    """A metric without labels from /metrics (0 when absent)."""
    for line in body.decode(errors="replace").splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return 0.0


class AgentRun:
    """One agent on its own copy of the manifest, and the prober that follows it."""

    def __init__(self, label: str, agent_path: Path, directory: Path, args: argparse.Namespace):
        self.label, self.args = label, args
        self.manifest = directory / "big.yaml"
        self.log = (directory / "agent.log").open("w+")
        env = dict(os.environ, PYTHONPATH=str(agent_path))
        # Ports chosen here: the agent logs its own only after the first load.
        self.ports = {"metrics": free_port(), "health": free_port()}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--manifests", str(directory),
             "--dataplane", "none", "--node", "node-a",
             "--healthz-bind-address", f"127.0.0.1:{self.ports['health']}",
             "--metrics-bind-address", f"127.0.0.1:{self.ports['metrics']}"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=directory,
        )  # fmt: skip
        self.phase = "start"
        self.phases: dict[str, float] = {}
        # phase, path, seconds taken, error, time.monotonic() at the start
        self.samples: list[tuple[str, str, float, str | None, float]] = []
        self.revisions = 0.0
        self.backends = 0.0  # in the applied state: says which file's state is in
        self.ready = False
        self.done = threading.Event()

    def wait_listening(self) -> None:
        deadline = time.monotonic() + 120
        while get(self.ports["health"], "/livez", 5)[1] is not None:
            self.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label}: the agent's health server never answered")
            time.sleep(0.05)

    def probe_loop(self) -> None:
        turn = 0
        while not self.done.is_set():
            started = time.monotonic()
            path = PATHS[turn % len(PATHS)]
            turn += 1
            port = self.ports["metrics" if path == "/metrics" else "health"]
            took, error, body = get(port, path, self.args.probe_timeout)
            if path == "/readyz":
                self.ready = error is None
                error = None if error in (None, "HTTP 503") else error  # not ready yet is an answer
            elif path == "/metrics" and error is None:
                self.revisions = metric(body, "kbp_nodestate_revisions_total")
                self.backends = metric(body, "kbp_programmed_backends")
            self.samples.append((self.phase, path, took, error, started))
            time.sleep(max(0.0, self.args.interval - (time.monotonic() - started)))

    def run(self, changed: Path, original: Path) -> None:
        self.wait_listening()
        prober = threading.Thread(target=self.probe_loop, daemon=True)
        prober.start()
        try:
            started = time.monotonic()
            self.phase = "load"
            while not (self.ready and self.revisions >= 1):
                self.check_alive()
                time.sleep(0.2)
            self.phases["load"] = time.monotonic() - started
            time.sleep(5)  # past the first freeze and the sync loop's follow-ups
            self.phase = "reload"
            backends = self.backends
            started = time.monotonic()
            os.replace(changed, self.manifest)
            # A Service and its slice may come in as two revisions: wait for both.
            while self.backends != backends + ENDPOINTS:
                self.check_alive()
                time.sleep(0.2)
            self.phases["reload"] = time.monotonic() - started
            time.sleep(5)
            # Back to the first file: what the first reload decoded is freed now.
            self.phase = "reload 2"
            started = time.monotonic()
            back = self.manifest.with_suffix(".back")
            os.link(original, back)
            os.replace(back, self.manifest)
            while self.backends != backends:
                self.check_alive()
                time.sleep(0.2)
            self.phases["reload 2"] = time.monotonic() - started
            self.phase = "after"
            time.sleep(AFTER)
            self.phases["after"] = AFTER
        finally:
            self.done.set()
            prober.join()
            self.process.terminate()
            self.process.wait(timeout=60)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"{self.label}: the agent exited:\n{Path(self.log.name).read_text()[-3000:]}"
            )

    def figures(self) -> list[dict[str, object]]:
        rows = []
        for phase in ("load", "reload", "reload 2", "after"):
            samples = [s for s in self.samples if s[0] == phase]
            ok = sorted(took for _, _, took, error, _ in samples if error is None)
            over = [(path, took, error, when) for _, path, took, error, when in samples
                    if error or took > TARGET]  # fmt: skip
            rows.append({
                "agent": self.label, "phase": phase, "seconds": self.phases.get(phase),
                "probes": len(samples), "over_target": len(over),
                "over_detail": [f"{p} {fmt_s(t)}{' ' + e if e else ''} at {clock(w)}"
                                for p, t, e, w in over[:10]],
                "median": ok[len(ok) // 2] if ok else None,
                "p99": ok[min(len(ok) - 1, int(len(ok) * 0.99))] if ok else None,
                "worst": max((s[2] for s in samples), default=None),
            })  # fmt: skip
        return rows


def agent_main(args: argparse.Namespace) -> None:
    import tempfile as _tempfile

    baseline_ref = args.baseline or default_baseline()
    with _tempfile.TemporaryDirectory(prefix="kbp-bench-big-agent-") as tmp:
        top = Path(tmp)
        baseline = baseline_tree(baseline_ref, top / "baseline")
        source = top / "big.yaml"
        services = write_list(source, int(args.size * 1e6))
        runs = []
        for label, agent_path in (
            ("this checkout", ROOT),
            (f"baseline {baseline[:10]}", top / "baseline"),
        ):
            directory = top / ("run-" + label.split()[0])
            directory.mkdir()
            os.link(source, directory / "big.yaml")
            changed = top / f"changed-{directory.name}.yaml"
            write_list(changed, source.stat().st_size + 1)  # one more Service
            runs.append((AgentRun(label, agent_path, directory, args), changed))
        load_start = [round(x, 2) for x in os.getloadavg()]
        print(
            f"big.yaml: {source.stat().st_size / 1e6:.0f} MB, {services} Services and as many "
            f"EndpointSlices; baseline {baseline[:10]}; load average {load_start} at start",
            flush=True,
        )
        threads = [
            threading.Thread(target=run.run, args=(changed, source)) for run, changed in runs
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        load_end = [round(x, 2) for x in os.getloadavg()]
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            for run, _ in runs:
                shutil.copy(run.log.name, args.logs / f"{run.label.split()[0]}.log")
        rows = [row for run, _ in runs for row in run.figures()]
    columns = ["agent", "phase", "time", "probes", "median", "p99", "worst", "> 1 s"]
    print(f"load average at the end {load_end}\n\n| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))

    def cell(value: object) -> str:
        return fmt_s(value) if isinstance(value, float) else "-"

    for r in rows:
        print(
            f"| {r['agent']} | {r['phase']} | {cell(r['seconds'])} | {r['probes']} "
            f"| {cell(r['median'])} | {cell(r['p99'])} | {cell(r['worst'])} "
            f"| {r['over_target']} {mark(r['over_target'] == 0)} |"
        )
        for detail in r["over_detail"]:
            print(f"    over: {detail}")
    out = args.json or RESULTS / "big_manifest_agent.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    document = {
        "machine": machine(),
        "settings": {"size_mb": args.size, "services": services, "interval": args.interval,
                     "baseline": baseline, "load_average": [load_start, load_end]},
        "results": rows,
    }  # fmt: skip
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nresults written to {out}")


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=200.0, help="manifest size in MB")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between probes")
    parser.add_argument("--probe-timeout", type=float, default=30.0)
    parser.add_argument("--json", type=Path, help="results file (default bench/results/)")
    parser.add_argument("--agent", action="store_true", help="whole agents: load, then reload")
    parser.add_argument("--baseline", help="git ref of the other agent (default: merge base)")
    parser.add_argument("--logs", type=Path, help="--agent: copy the agents' logs here")
    args = parser.parse_args()
    if args.agent:
        agent_main(args)
        return
    load_average = [round(x, 2) for x in os.getloadavg()]
    results = []
    with tempfile.TemporaryDirectory(prefix="kbp-bench-big-") as directory:
        path = Path(directory) / "big.yaml"
        services = write_list(path, int(args.size * 1e6))
        size = path.stat().st_size
        print(
            f"{path.name}: {size / 1e6:.0f} MB, one kind: List of {services} Services and "
            f"{services} EndpointSlices; load average {load_average}"
        )
        columns = ["way", "load", "objects", "worker peak RSS", "child peak RSS", "probes",
                   "median", "p99", "worst", "> 1 s"]  # fmt: skip
        print("\n| " + " | ".join(columns) + " |")
        print("|" + " --- |" * len(columns))
        for way, mode in WAYS.items():
            f = measure(way, mode, path, args)
            results.append(asdict(f))

            print(
                f"| {f.way} | {fmt_s(f.load_seconds)} | {f.objects} "
                f"| {f.worker_peak_rss_mib:.0f} MiB | {f.child_peak_rss_mib:.0f} MiB "
                f"| {f.probes} | {cell(f.median)} | {cell(f.p99)} | {cell(f.worst)} "
                f"| {f.over_target} {mark(f.over_target == 0)} |",
                flush=True,
            )
    inline, child = results
    if inline["worst"] and child["worst"]:
        print(
            f"\nworst probe: {inline['worst'] / child['worst']:.1f}x lower through the child; "
            f"load time ratio child/inline {child['load_seconds'] / inline['load_seconds']:.2f}"
        )
    out = results_path(args, "big_manifest")
    write_results(out, {
        "machine": machine(),
        "settings": {"size_bytes": size, "services": services, "interval": args.interval},
        "results": results,
    })  # fmt: skip
    print(f"\nresults written to {out}")


if __name__ == "__main__":
    main()
