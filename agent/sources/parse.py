"""The child side of parsing a large manifest file off the agent's process.

    python -m agent.sources.parse PATH

Parses PATH as `read_objects` does in the agent and writes to standard output one pickle
per message, in order: ("object", where, object) for each object (lists flattened), then
("report", where, ref, message, error) for each problem, then ("end", documents). The
agent reads them with `manifests.parse_in_child`. Parsing a 200 MB document holds the
interpreter lock for seconds in stretches the health server cannot interrupt; here it
holds only this process's, and the agent unpickles one object at a time.
"""

from __future__ import annotations

import gc
import os
import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .manifests import ParseCount, Report, read_objects

PROTOCOL = 5
DEEP = 20_000  # recursion allowed to compose YAML (about two levels per level of nesting,
# and libyaml stops at 1,000) and to pickle a value as deep as a parser accepted


def messages(path: Path) -> Iterator[tuple[Any, ...]]:
    reports: list[Report] = []
    count = ParseCount()
    for where, obj in read_objects(path, reports, count, stream=True):
        yield ("object", where, obj)
    for report in reports:
        yield ("report", report.where, report.ref, report.message, report.error)
    yield ("end", count.documents)


@contextmanager
def recursion(limit: int) -> Iterator[None]:
    before = sys.getrecursionlimit()
    sys.setrecursionlimit(max(before, limit))
    try:
        yield
    finally:
        sys.setrecursionlimit(before)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m agent.sources.parse PATH", file=sys.stderr)
        return 2
    gc.disable()  # short-lived, and its values are acyclic
    # The messages get a descriptor of their own; anything printed goes to stderr.
    out = os.fdopen(os.dup(1), "wb", buffering=1 << 16)
    os.dup2(2, 1)
    try:
        path = Path(argv[0])
        # JSON keeps the agent's limit: its C decoder recurses on the C stack.
        with recursion(DEEP if path.suffix != ".json" else 0):
            for message in messages(path):
                with recursion(DEEP):
                    pickle.dump(message, out, protocol=PROTOCOL)
        out.flush()
    except BrokenPipeError:  # the agent stopped reading (it is stopping)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
