"""Hostile HTTP clients for the agent's local servers: many connections that never finish
a request, from a separate process (its own descriptors and interpreter lock), on
loopback only.

    python -m tests.httpload 127.0.0.1:10256 --clients 2000 --mode slow --sources 40

* `idle`: connect and send nothing; when the server closes, connect again.
* `slow`: send a request head that never ends, one byte a second per connection
  (`GET /healthz HTTP/1.1`, then a header whose value goes on forever); reconnect
  when closed.

Clients spread evenly over `--sources` loopback addresses 127.0.0.10, .11, … (every
127/8 address is loopback on Linux), or all use `--source`. Twice a second the process
prints one JSON line: {"open", "connects", "closed", "failed"}: connections open now,
connects so far, connections the server closed, failed connects. It stops when its
standard input closes, so it never outlives the test or benchmark that started it.

`HostileClients` runs it from Python and waits until the connections are up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType

SLOW_HEAD = b"GET /healthz HTTP/1.1\r\nHost: kbp\r\nX-Slow: "
FIRST_SOURCE = 10  # 127.0.0.10 is the first --sources address


def source_addresses(count: int) -> list[str]:
    return [f"127.0.0.{FIRST_SOURCE + i}" for i in range(count)]


class _Counts:
    def __init__(self) -> None:
        self.open = self.connects = self.closed = self.failed = 0

    def line(self) -> str:
        return json.dumps(
            {"open": self.open, "connects": self.connects, "closed": self.closed,
             "failed": self.failed}
        )  # fmt: skip


async def _client(host: str, port: int, source: str, mode: str, counts: _Counts) -> None:
    await asyncio.sleep(random.random() * 0.5)  # not every SYN in the same instant
    while True:
        try:
            reader, writer = await asyncio.open_connection(host, port, local_addr=(source, 0))
        except OSError:
            counts.failed += 1
            await asyncio.sleep(0.2)
            continue
        counts.open += 1
        counts.connects += 1
        # Close with a reset, not a FIN: a client that closes first leaves its port in
        # TIME_WAIT for a minute, and thousands of those block other tests' binds.
        writer.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
        )
        try:
            if mode == "idle":
                while await reader.read(4096):
                    pass
            else:
                await asyncio.sleep(random.random())  # spread the bytes over the second
                for byte in itertools.chain(SLOW_HEAD, itertools.repeat(ord("a"))):
                    writer.write(bytes([byte]))
                    try:
                        data = await asyncio.wait_for(reader.read(4096), 1.0)
                    except TimeoutError:
                        continue
                    if not data:  # closed by the server
                        break
                    while await reader.read(4096):  # an answer (408): read to the end
                        pass
                    break
        except OSError:
            pass
        finally:
            counts.open -= 1
            counts.closed += 1
            writer.close()
        await asyncio.sleep(0.05)


async def _main(args: argparse.Namespace) -> None:
    host, _, port_text = args.target.rpartition(":")
    sources = [args.source] if args.source else source_addresses(args.sources)
    counts = _Counts()
    clients = [
        asyncio.create_task(
            _client(host, int(port_text), sources[i % len(sources)], args.mode, counts)
        )
        for i in range(args.clients)
    ]
    loop = asyncio.get_running_loop()
    stdin_closed = loop.run_in_executor(None, sys.stdin.buffer.read)
    while not stdin_closed.done():
        print(counts.line(), flush=True)
        await asyncio.wait([stdin_closed], timeout=0.5)
    for task in clients:
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help="HOST:PORT (IPv4 loopback)")
    parser.add_argument("--clients", type=int, default=2000)
    parser.add_argument("--mode", choices=("idle", "slow"), default="idle")
    parser.add_argument("--sources", type=int, default=40, help="loopback source addresses")
    parser.add_argument("--source", help="one source address for every client")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = args.clients + 256
    if soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(wanted, hard), hard))
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        asyncio.run(_main(args))


class HostileClients:
    """`python -m tests.httpload` in a subprocess, as a context manager.

    Entering starts it and waits until `wait_open` connections are open (default: all
    of them) or `timeout` passes; leaving stops it and waits for it to exit."""

    def __init__(
        self,
        target: str,
        clients: int,
        mode: str,
        *,
        sources: int = 40,
        source: str | None = None,
        wait_open: int | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.argv = [
            sys.executable, "-m", "tests.httpload", target, "--clients", str(clients),
            "--mode", mode, "--sources", str(sources),
        ]  # fmt: skip
        if source:
            self.argv += ["--source", source]
        self.wait_open = clients if wait_open is None else wait_open
        self.timeout = timeout
        self.last: dict[str, int] = {}
        self._changed = threading.Condition()
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def __enter__(self) -> HostileClients:
        self._process = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).parents[1],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
        )
        self._reader = threading.Thread(target=self._read, name="httpload reader", daemon=True)
        self._reader.start()
        try:
            if not self.wait(lambda c: c.get("open", 0) >= self.wait_open, self.timeout):
                raise TimeoutError(
                    f"{self.wait_open} hostile connections not open after {self.timeout}s: "
                    f"{self.last}"
                )
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            with self._changed:
                self.last = json.loads(line)
                self._changed.notify_all()

    def wait(self, condition: object, timeout: float) -> bool:
        """Wait until `condition(counts)` holds for the latest counts line."""
        assert callable(condition)
        deadline = time.monotonic() + timeout
        with self._changed:
            while not condition(self.last):
                left = deadline - time.monotonic()
                if left <= 0 or (self._process is not None and self._process.poll() is not None):
                    return False
                self._changed.wait(left)
        return True

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        process = self._process
        if process is None:
            return
        with contextlib.suppress(OSError):
            assert process.stdin is not None
            process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if self._reader is not None:
            self._reader.join(5)
        self._process = None


if __name__ == "__main__":
    main()
