"""PB-15: the node-local state's watch (`/state?watch=true`, issue 37): from a change's
event to the line in a watcher's hands, what watchers cost the agent, and how many bytes
a revision is, full and as changes.

The agent's side runs in this process, as the daemon wires it: AgentStatus, StateHub and
MetricsServer on loopback, fed by the real Compiler from a generated cluster of N
Services x 10 endpoints (bench/common/workload.py). The watchers are ordinary sockets in
a child process (so this process's CPU and RSS are the agent's alone), W of them, all
`changes=true` or all full; they note when each revision's line is complete
(CLOCK_MONOTONIC is one clock for both processes) and its size.

Changes come one at a time, a pause apart (steady changes: PB-5's shape), in turn by kind
(an endpoint not ready, an endpoint added, a Service added, one deleted). Per change:

    event → published   decode the event's objects, update the ClusterState,
                        Compiler.update, AgentStatus.set_node_state (the sync loop's part
                        before the dataplane; the daemon applies after it)
    published → line    the watch's own part: render once, write to every watcher, the
                        child reads it (the target: p99 ≤ 10 ms beyond PB-5)
    event → line        both, over every watcher's line

Also the agent's CPU seconds per revision and its RSS (VmRSS after the changes, VmHWM)
with 1 and with 100 watchers, in the same run. Not a test: it always exits 0.

    .venv/bin/python -m bench.watch [--services 1000,10000] [--watchers 1,100] [--changes N]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.api import AgentStatus, MetricsServer
from agent.api.watch import StateHub
from agent.metrics import Metrics
from agent.model.compile import CompileOptions, Compiler
from agent.model.decode import decode_object
from agent.sources.manifests import load_manifests
from bench.common.report import Summary, fmt_s, git_commit, machine, write_results
from bench.common.workload import THIS_NODE, generate, make_changes

TARGET_WATCH_P99 = 0.010  # published → line, beyond PB-5's event → kernel write
REVISION = re.compile(rb'"revision":"(sha256:[0-9a-f]{64})"')


# --- the watchers' process ------------------------------------------------------------------


def watchers_main(url: str, count: int, changes: bool) -> int:
    """W watches of url; prints {"ready": W} once all answered their head and first line,
    then on stdin EOF one JSON line: per revision, [receive times], [line sizes]."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    selector = selectors.DefaultSelector()
    buffers: dict[socket.socket, bytearray] = {}
    heads: set[socket.socket] = set()
    seen: dict[str, list[float]] = {}
    sizes: dict[str, list[int]] = {}
    query = "watch=true" + ("&changes=true" if changes else "")
    for _ in range(count):
        # One after the other, each past its head: a connection counts toward its
        # address's limit (64) until it is a watch.
        sock = socket.create_connection((host, int(port)))
        sock.sendall(f"GET /state?{query} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)
            if not chunk:
                raise SystemExit("a watch was refused")
            head += chunk
        heads.add(sock)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        buffers[sock] = bytearray()
    selector.register(sys.stdin, selectors.EVENT_READ)
    firsts = 0
    announced = False
    while True:
        for key, _ in selector.select():
            if key.fileobj is sys.stdin:
                if not sys.stdin.readline():
                    print(json.dumps({"seen": seen, "sizes": sizes}), flush=True)
                    return 0
                continue
            sock = key.fileobj  # type: ignore[assignment]
            data = sock.recv(1 << 20)  # type: ignore[union-attr]
            if not data:
                raise SystemExit("a watch ended")
            buf = buffers[sock]  # type: ignore[index]
            buf += data
            now = time.monotonic()
            if sock not in heads:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    continue
                del buf[: end + 4]
                heads.add(sock)  # type: ignore[arg-type]
            while (newline := buf.find(b"\n")) >= 0:
                line = bytes(buf[: newline + 1])
                del buf[: newline + 1]
                found = REVISION.search(line)
                revision = found.group(1).decode() if found else "?"
                if revision not in seen:
                    firsts += 1
                seen.setdefault(revision, []).append(now)
                sizes.setdefault(revision, []).append(len(line))
        if (
            not announced
            and len(heads) == count
            and firsts >= 1
            and all(len(v) == count for v in seen.values())
        ):
            announced = True
            print(json.dumps({"ready": count}), flush=True)


# --- the agent's side -----------------------------------------------------------------------


def rss() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process, bytes."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def one_run(cluster: Any, watchers: int, changes: bool, count: int, pause: float) -> dict:
    state, _ = load_manifests([cluster.path])
    state.take_changes()
    compiler = Compiler(THIS_NODE, CompileOptions())
    status = AgentStatus(dataplane="none")

    def held_and_status() -> tuple[str | None, dict]:
        snap = status.snapshot()
        return snap.held_revision, snap.to_dict()

    hub = StateHub(held_and_status, max_watchers=max(watchers, 1))
    status.subscribe(hub.publish)
    status.set_node_state(compiler.full(state))
    # As the daemon does after its first sync: the long-lived heap leaves the cyclic GC.
    gc.collect()
    gc.freeze()
    loaded_rss = rss()[0]
    published: dict[str, tuple[float, float]] = {}
    with MetricsServer("127.0.0.1:0", status, Metrics(), hub) as server:
        child = subprocess.Popen(
            [sys.executable, "-m", "bench.watch", "--watchers-child", server.url,
             str(watchers), "1" if changes else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            cwd=Path(__file__).resolve().parents[1],
        )  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        json.loads(child.stdout.readline())  # every watcher holds the first revision
        changes_made = list(itertools.islice(make_changes(cluster, count), count))
        cpu0 = time.process_time()
        for change in changes_made:
            event = time.monotonic()
            values = [decode_object(json.loads(t)).value for t in change.texts]
            change.apply_to_state(state, values)
            node_state = compiler.update(state)
            status.set_node_state(node_state)
            published[node_state.revision] = (event, time.monotonic())
            time.sleep(pause)
        time.sleep(max(1.0, pause))  # the last lines land
        cpu = time.process_time() - cpu0
        now_rss, peak_rss = rss()
        child.stdin.close()
        report = json.loads(child.stdout.readline())
        child.wait(30)
    hub.close()
    gc.unfreeze()
    to_line, watch_part, full_bytes, change_bytes = [], [], [], []
    missed = 0
    for revision, (event, at) in published.items():
        times = report["seen"].get(revision)
        if not times:
            missed += 1  # skipped for a newer one (a reader behind): not delivered
            continue
        to_line += [t - event for t in times]
        watch_part += [t - at for t in times]
        sizes = report["sizes"][revision]
        (change_bytes if changes else full_bytes).extend(sizes)
    return {
        "services": cluster.workload.services,
        "watchers": watchers,
        "mode": "changes" if changes else "full",
        "revisions": len(published),
        "not_delivered": missed,
        "event_to_published": Summary([at - ev for ev, at in published.values()]).to_json(),
        "published_to_line": Summary(watch_part).to_json() if watch_part else None,
        "event_to_line": Summary(to_line).to_json() if to_line else None,
        "bytes_per_line": Summary([float(b) for b in (change_bytes or full_bytes)]).to_json()
        if (change_bytes or full_bytes) else None,
        "cpu_per_revision": cpu / max(1, len(published)),
        "rss_loaded": loaded_rss,  # the cluster state and the compiler, before any watch
        "rss": now_rss,
        "rss_peak": peak_rss,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--watchers-child":
        return watchers_main(argv[1], int(argv[2]), argv[3] == "1")
    if argv and argv[0] == "--one":  # one configuration, in a process of its own
        n, watchers, mode, count, pause = argv[1:6]
        with tempfile.TemporaryDirectory() as tmp:
            cluster = generate(int(n), Path(tmp))
            run = one_run(cluster, int(watchers), mode == "changes", int(count), float(pause))
        print(json.dumps(run), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", default="1000,10000", help="comma-separated N")
    parser.add_argument("--watchers", default="1,100", help="comma-separated W")
    parser.add_argument("--changes", type=int, default=40, help="changes per run")
    parser.add_argument("--full-changes", type=int, default=8,
                        help="changes per run of full-document watchers at 10k and up")  # fmt: skip
    parser.add_argument("--pause", type=float, default=0.2, help="seconds between changes")
    args = parser.parse_args(argv)
    info = machine()
    print(f"# PB-15: the state watch, commit {git_commit()}, load {os.getloadavg()[0]:.2f}")
    runs = []
    for n in (int(x) for x in args.services.split(",")):
        for watchers in (int(x) for x in args.watchers.split(",")):
            for mode in ("changes", "full"):
                count = args.changes if mode == "changes" or n < 10_000 else args.full_changes
                pause = args.pause if mode == "changes" or n < 10_000 else max(args.pause, 2.0)
                # each in a fresh process: RSS and the allocator's state are its own
                out = subprocess.run(
                    [sys.executable, "-m", "bench.watch", "--one", str(n), str(watchers), mode,
                     str(count), str(pause)],
                    cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                    check=True,
                ).stdout  # fmt: skip
                run = json.loads(out.strip().splitlines()[-1])
                runs.append(run)
                show(run)
    print(f"load at the end {os.getloadavg()[0]:.2f}")
    write_results(Path(__file__).parent / "results" / "watch.json",
                  {"machine": info, "commit": git_commit(), "runs": runs})  # fmt: skip
    return 0


def show(run: dict) -> None:
    def p(key: str) -> str:
        s = run[key]
        return f"{fmt_s(s['median'])} / {fmt_s(s['p99'])}" if s else "-"

    watch = run["published_to_line"]
    mark = ""
    if watch:
        mark = "PASS" if watch["p99"] <= TARGET_WATCH_P99 else "MISS"
    size = run["bytes_per_line"]
    print(
        f"{run['services']:>6} Services, {run['watchers']:>3} watchers, {run['mode']:<7}: "
        f"event→published {p('event_to_published')}, published→line {p('published_to_line')} "
        f"[{mark} ≤ 10 ms p99], event→line {p('event_to_line')}; "
        + (f"{size['median'] / 1024:.1f} KiB/line; " if size else "")
        + f"CPU {run['cpu_per_revision'] * 1e3:.1f} ms/revision, RSS {run['rss'] / 2**20:.0f} "
        f"MiB (peak {run['rss_peak'] / 2**20:.0f}, {run['rss_loaded'] / 2**20:.0f} before any "
        f"watch); {run['not_delivered']} of "
        f"{run['revisions']} revisions skipped for a newer one",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
