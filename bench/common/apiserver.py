"""kmock (the API server stand-in) in a process of its own, loaded with a generated
cluster: the control-plane and restart benchmarks talk to it over real HTTP and have it
publish bursts of changes on its watch streams.

    python bench/common/apiserver.py --services N [--endpoints M] [--nodes K] [--seed S]

runs the server side (serve_kmock); KmockProcess starts and drives it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

if not __package__:  # run as a script: the checkout is not on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.common.workload import Generator, Obj, Workload

# kmock resources: kind → (resource, collection path, namespaced)
COLLECTIONS = {
    "Service": ("v1/services", "/api/v1/namespaces/{ns}/services", True),
    "EndpointSlice": (
        "discovery.k8s.io/v1/endpointslices",
        "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
        True,
    ),
    "Node": ("v1/nodes", "/api/v1/nodes", False),
}


CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def workload_args(workload: Workload) -> list[str]:
    return [
        f"--services={workload.services}",
        f"--endpoints={workload.endpoints}",
        f"--nodes={workload.nodes}",
        f"--seed={workload.seed}",
    ]


def fingerprint(items: list[Obj]) -> str:
    """Identifies a generated cluster (both processes generate it from the same seed)."""
    return f"{len(items)}:{items[-1]['metadata']['uid']}"


def serve_kmock(workload: Workload) -> int:
    """The child process: kmock loaded with the workload, on a free port.

    Prints one JSON line (port, load time, fingerprint), then reads commands from stdin,
    one JSON line each, answering each with one JSON line: {"op": "burst", "changes":
    [[kind, namespace, name, merge patch], ...], "interval": seconds} applies the patches
    and puts their MODIFIED events on the watch streams, as kmock's PATCH handler does,
    one every `interval` (0: all at once); the reply says when each was put. Exits at end
    of input.
    """
    import kmock  # only this process runs the emulator

    class Emulator(kmock.KubernetesEmulator):
        """kmock keeps every request it served and matches each new one against all of
        them (`request in view` walks the history): each request costs O(requests so
        far), 50 ms per write after 2,000 writes. Forget a request once it is handled;
        open watches stay listed. Nothing here uses the history."""

        async def _handle(self, request: Any) -> Any:
            try:
                return await super()._handle(request)
            finally:
                requests = self._requests
                for i in range(len(requests) - 1, -1, -1):
                    if requests[i] is request:
                        del requests[i]
                        break

    items = Generator(workload).items(headless=False)

    async def main() -> None:
        emulator = Emulator()
        for resource, _, _ in COLLECTIONS.values():
            emulator.resources[resource] = {}
        await emulator.__aenter__()
        started = time.perf_counter()
        for obj in items:
            resource, _, namespaced = COLLECTIONS[obj["kind"]]
            meta = obj["metadata"]
            emulator.objects[resource, meta["namespace"] if namespaced else None, meta["name"]] = (
                obj
            )
        loaded = time.perf_counter() - started
        server = kmock.Server(emulator)
        await server.__aenter__()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        async def burst(changes: list[list[Any]], interval: float) -> list[float]:
            """Patch and publish as kmock's PATCH handler does, without its O(objects)
            lookups: every `interval` seconds, or all at once (0: nothing is streamed
            before the last event is on the bus). Returns when each event was put."""
            put_at: list[float] = []
            began = time.perf_counter()
            for n, (kind, namespace, name, patch) in enumerate(changes):
                delay = began + n * interval - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                async with emulator._lock:
                    resource, _, namespaced = COLLECTIONS[kind]
                    obj = emulator.objects[resource, namespace if namespaced else None, name]
                    obj.patch(patch)
                    event = {"type": "MODIFIED", "object": obj.raw}
                    await emulator._buses[kmock.resource(resource)].put(event)
                put_at.append(time.perf_counter())  # CLOCK_MONOTONIC: same in both processes
            return put_at

        def commands() -> None:
            for line in sys.stdin:
                command = json.loads(line)
                if command["op"] == "burst":
                    work = burst(command["changes"], command["interval"])
                    put_at = asyncio.run_coroutine_threadsafe(work, loop).result()
                    reply = {"ok": True, "put_at": put_at}
                else:
                    reply = {"ok": False, "error": f"unknown op {command['op']!r}"}
                print(json.dumps(reply), flush=True)
            loop.call_soon_threadsafe(done.set_result, None)

        print(
            json.dumps({"port": server.port, "load_s": loaded, "fingerprint": fingerprint(items)}),
            flush=True,
        )
        threading.Thread(target=commands, daemon=True).start()
        await done
        await server.__aexit__(None, None, None)
        await emulator.__aexit__(None, None, None)

    asyncio.run(main())
    return 0


class KmockProcess:
    """The serve_kmock child: start, talk to, measure and stop it."""

    def __init__(self, workload: Workload, log: IO[str], prefix: Sequence[str] = ()) -> None:
        """`prefix`: what the command runs under (e.g. nsenter into a namespace)."""
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, __file__, *workload_args(workload)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"kmock exited with {self.proc.wait()}; see {log.name}")
        hello = json.loads(line)
        self.port: int = hello["port"]
        self.load_s: float = hello["load_s"]
        self.fingerprint: str = hello["fingerprint"]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float:
        return process_cpu(self.proc.pid)

    def burst(self, changes: list[list[Any]], interval: float) -> list[float]:
        """Have kmock publish the changes (see `serve_kmock`); when each was put."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        command = {"op": "burst", "changes": changes, "interval": interval}
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line else {"error": "kmock exited"}
        if not reply.get("ok"):
            raise RuntimeError(f"kmock burst failed: {reply}")
        return [float(t) for t in reply["put_at"]]

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # the child this benchmark started, by its handle
            self.proc.wait()


def process_cpu(pid: int | str, task: int | None = None) -> float:
    """User + system CPU seconds of a process (or of one of its threads)."""
    path = f"/proc/{pid}/stat" if task is None else f"/proc/{pid}/task/{task}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK  # utime, stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=1000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    return serve_kmock(Workload(args.services, args.endpoints, 0, args.nodes, args.seed))


if __name__ == "__main__":
    sys.exit(main())
