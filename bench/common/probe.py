"""Probing the agent's HTTP server while something else loads it: one GET /healthz at a
time on loopback, each timed, and the figures of a run of them (http_load.py's hostile
clients, big_manifest.py's big load)."""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.api import AgentStatus
from agent.api.serving import Request, Response, json_response

from .report import fmt_s

Probe = tuple[float, str | None]  # (seconds, the error or None)


def healthz_handler() -> Callable[[Request], Response]:
    status = AgentStatus(dataplane="none")

    def healthz(request: Request) -> Response:
        report = status.health(60.0)
        return json_response(200 if report.healthy else 503, {"healthy": report.healthy})

    return healthz


def probe(port: int, timeout: float) -> Probe:
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


def probe_until(
    port: int, timeout: float, interval: float, done: Callable[[], bool], results: list[Probe]
) -> None:
    """Probe every `interval` seconds until done(), appending to results."""
    while not done():
        started = time.monotonic()
        results.append(probe(port, timeout))
        time.sleep(max(0.0, interval - (time.monotonic() - started)))


@dataclass
class ProbeFigures:
    """What a run of probes showed (seconds); over_target: errors or slower than target."""

    probes: int
    answered: int
    over_target: int
    median: float | None
    p99: float | None
    worst: float | None
    errors: list[str]


def probe_figures(results: list[Probe], target: float) -> dict[str, Any]:
    """ProbeFigures' fields from a run of probes."""
    ok = sorted(took for took, error in results if error is None)
    return {
        "probes": len(results),
        "answered": len(ok),
        "over_target": sum(1 for took, error in results if error or took > target),
        "median": ok[len(ok) // 2] if ok else None,
        "p99": ok[min(len(ok) - 1, int(len(ok) * 0.99))] if ok else None,
        "worst": max(took for took, _ in results) if results else None,
        "errors": sorted({error for _, error in results if error}),
    }


def cell(value: float | None) -> str:
    return fmt_s(value) if value is not None else "-"
