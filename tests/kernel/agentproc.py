"""`kube-bpf-proxy` as the kernel tests run it inside a lab's namespace: one runner for an
agent process (start, wait for a log line, ask /state, stop) and for one-shot commands, so
that every agent-level test starts, watches and reports a failing agent the same way.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from agent.lab.toolkit import LabError, in_netns, run
from tests.lab.nodelab import Lab

ROOT = Path(__file__).parents[2]
POD_INTERFACES = "vethkbp*"  # the lab's host veths (tests/lab/nodelab.py HOST_VETH_PREFIX)
# Small maps: the labs hold a handful of Services, and every map is allocated in full.
MAP_SIZES = (
    "--map-size-services", "1024", "--map-size-slots", "4096",
    "--map-size-backends", "1024", "--map-size-ct", "4096",
    "--map-size-affinity", "1024",
)  # fmt: skip
# How long an agent may take to log what a test waits for: the eBPF agent compiles its
# programs with bcc first, which takes tens of seconds on a loaded 2-core machine.
LOG_TIMEOUT = 90.0
# An agent that exited has flushed its stderr; its last lines reach the reader within
# this, so a wait that sees the exit still finds a line printed just before it.
EXIT_GRACE = 2.0


SERVICE_MANIFEST = """\
apiVersion: v1
kind: Service
metadata: {{name: {name}, namespace: default}}
spec:
  clusterIP: {ip}
  internalTrafficPolicy: {itp}
  ports:
  - {{name: http, port: 80, protocol: TCP, targetPort: 8080}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: {name}-1
  namespace: default
  labels: {{kubernetes.io/service-name: {name}}}
addressType: IPv4
ports:
- {{name: http, port: 8080, protocol: TCP}}
endpoints:{endpoints}
---
"""


def service_manifest(
    name: str, ip: str, backends: Sequence[str], node: str = "node-a", itp: str = "Cluster"
) -> str:
    """A ClusterIP Service `name` at ip:80 (TCP, to 8080) and one EndpointSlice with the
    backends' IPv4 addresses, ready, on `node`: the manifest of the agent-level tests."""
    endpoints = "".join(
        f"\n- addresses: [{address}]\n  conditions: {{ready: true}}\n  nodeName: {node}"
        for address in backends
    )
    return SERVICE_MANIFEST.format(name=name, ip=ip, itp=itp, endpoints=endpoints or " []")


@contextmanager
def web_lab(cgroup: bool = False) -> Iterator[Lab]:
    """The node of the agent-level tests: pods client, be1 and be2 (be1 and be2 serving
    TCP 8080; `cgroup`: the pods' processes in a cgroup of the lab's)."""
    with Lab(cgroup=cgroup) as lab:
        lab.add_pod("client")
        for name in ("be1", "be2"):
            lab.add_pod(name).serve([8080])
        yield lab


def run_argv(manifests: Path | None, node: str, dataplane: str, *flags: str) -> list[str]:
    """`kube-bpf-proxy run` on manifest files (None: give --kubeconfig in `flags`) as
    `node`, with the settings every lab agent shares (its pods' interfaces, servers on
    ephemeral loopback ports, small maps) and then `flags` (later flags win)."""
    source = ["--manifests", str(manifests)] if manifests is not None else []
    return [
        sys.executable, "-m", "agent", "run", *source,
        "--node", node, "--dataplane", dataplane, "--pod-interfaces", POD_INTERFACES,
        "--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "127.0.0.1:0",
        *MAP_SIZES, *flags,
    ]  # fmt: skip


def cli(ns: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`kube-bpf-proxy ARGS` run to completion in namespace ns; its output, whatever the
    exit status (tests assert on both)."""
    return subprocess.run(
        in_netns(ns, [sys.executable, "-m", "agent", *args]),
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


class AgentProcess:
    """An agent (argv, usually from run_argv) running in namespace ns, its log (stderr)
    collected line by line as it comes. `name` says which agent in error messages, and
    every error about it carries its whole log."""

    def __init__(self, ns: str, argv: Sequence[str], name: str) -> None:
        self.ns = ns
        self.name = name
        self.argv = list(argv)
        self.proc = subprocess.Popen(
            in_netns(ns, self.argv), cwd=ROOT,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self._eof = False
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name=f"agent {name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip())
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def log(self) -> str:
        """Everything the agent logged so far."""
        with self._cond:
            return "\n".join(self.lines)

    def wait_for_line(self, text: str, after: int = 0, timeout: float = LOG_TIMEOUT) -> int:
        """Index of the first log line from `after` on that contains `text`; LabError with
        the log when the agent exits or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for n in range(after, len(self.lines)):
                    if text in self.lines[n]:
                        return n
                status = self.proc.poll()
                if status is not None and not self._eof:
                    deadline = min(deadline, time.monotonic() + EXIT_GRACE)
                if self._eof or time.monotonic() > deadline:
                    if self._eof and status is None:
                        # stderr closes as the agent exits, a moment before it is reaped
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            status = self.proc.wait(EXIT_GRACE)
                    state = "still running" if status is None else f"exited {status}"
                    raise LabError(
                        f"agent on {self.name} never logged {text!r} ({state}):\n"
                        + "\n".join(self.lines)
                    )
                self._cond.wait(0.2)

    def url(self, path: str, server: str = "metrics server") -> str:
        """http://ADDRESS/path on the agent's metrics (or health) server (it logs where it
        listens)."""
        line = self.lines[self.wait_for_line(f"{server} listening on")]
        return f"http://{line.rsplit(' ', 1)[-1]}{path}"

    def get(self, path: str) -> str:
        """GET path from the agent's metrics server, fetched inside its namespace."""
        return run(in_netns(self.ns, ["curl", "-sf", "-m", "5", self.url(path)]))

    def ask(self, path: str, server: str = "metrics server") -> tuple[int, dict]:
        """GET path (JSON) whatever the status, from inside the agent's namespace:
        (HTTP status, decoded body)."""
        argv = ["curl", "-s", "-m", "5", "-w", "\n%{http_code}", self.url(path, server)]
        body, _, code = run(in_netns(self.ns, argv)).rstrip("\n").rpartition("\n")
        return int(code), json.loads(body)

    def state(self) -> dict:
        """GET /state, decoded."""
        return json.loads(self.get("/state"))

    def wait_exit(self, timeout: float = 60) -> int:
        """The exit status once the agent exits by itself, with its whole log read."""
        status = self.proc.wait(timeout=timeout)
        self._reader.join(5)
        return status

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send sig (SIGTERM: a clean stop) and wait; SIGKILL after 30 s. Its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            status = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = self.proc.wait()
        self._reader.join(5)
        return status
