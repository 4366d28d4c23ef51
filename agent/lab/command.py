"""`kube-bpf-proxy lab`: build the example cluster out of network namespaces, run the agent
on every node, make real requests from client pods and from a client outside the cluster,
print per Service what answered and whether that keeps the Service's promise, then remove
everything (unless --keep);
`kube-bpf-proxy lab down` removes what a kept run left."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from ..dataplane.ebpf.abi import versioned
from ..dataplane.nftables.render import PICK_INSIDE as NFT_PICK_INSIDE
from ..dataplane.nftables.render import TABLE as NFT_TABLE
from ..model.compile import ANY_CLUSTER, LOCAL_CLUSTER, NO_TOPOLOGY, CompileOptions, compile
from ..model.nodestate import CLUSTER_IP, Backend, Frontend, NodeState, ServiceEntry, is_external
from ..model.outcome import BACKENDS, KEPT, topology_tiers
from ..sources.manifests import load_manifests, manifest_files, read_objects
from .expect import (
    COVERAGE_MAX_SET,
    TIMES,
    Expectation,
    Verdict,
    coverage_required,
    expect,
    expect_from_outside,
    frontend_text,
    judge,
    judge_sources,
    missing,
)
from .netns import (
    BPFFS,
    POD_INTERFACES,
    Agent,
    Cluster,
    LabError,
    Run,
    existing_runs,
    in_netns,
    owner_running,
    python_for_children,
    remove_run,
    run_command,
)
from .plan import LabOutside, LabPlan, LabPod, backend_pod, plan_lab

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # holds agent/ (and examples/ in a checkout)
AGENT_READY_TIMEOUT = 240.0  # bcc builds the programs once per agent: seconds on a busy box
TCP_TIMEOUT = 1.5
UDP_TIMEOUT = 1.0
FAILURE_REQUESTS = 3  # requests to a frontend that should refuse or drop
GIVE_UP_AFTER = 4  # timeouts after which requests to a frontend expected to answer stop
COVERAGE_ROUNDS = 8  # at most this many extra rounds while a small set is not covered
COVERAGE_ROUND_REQUESTS = 10  # at least this many requests per probe in an extra round
SERVICES_MAP = versioned("kbp_services")  # with the ABI version suffix
DUMP_ENTRIES = 3
TOOLS = ("ip", "nsenter", "sysctl", "ethtool")
OK, FAIL = "✔", "✘"


class Interrupted(BaseException):
    """A signal asked the lab to stop: raised in the main thread, so `finally` cleans up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Probe:
    """Requests from one client to one frontend, what it expected and what it saw."""

    id: str
    client: LabPod | LabOutside
    node_dataplane: str
    entry: ServiceEntry
    frontend: Frontend
    expectation: Expectation
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    details: list[str] = field(default_factory=list)
    peers: dict[str, Counter[str]] = field(default_factory=dict)  # pod → source seen → n
    node_addresses: frozenset[str] = frozenset()  # the entry node's, for outside probes
    verdict: Verdict | None = None

    @property
    def outside(self) -> bool:
        """From the client outside the cluster (which also asks for the source seen)."""
        return isinstance(self.client, LabOutside)

    @property
    def proto(self) -> str:
        return self.entry.protocol.lower()

    def item(self, n: int) -> dict[str, Any]:
        failing = self.expectation.kind != BACKENDS
        return {
            "id": self.id,
            "proto": self.proto,
            "ip": self.frontend.ip,
            "port": self.frontend.port,
            "n": min(n, FAILURE_REQUESTS) if failing else n,
            "timeout": UDP_TIMEOUT if self.proto == "udp" or failing else TCP_TIMEOUT,
            # Unreachable backends time out by design; otherwise a broken frontend is
            # given up on after a few timeouts (it is a ✘ already).
            "give_up_after": 0 if failing or self.expectation.excluded else GIVE_UP_AFTER,
            "peer": self.outside,
        }

    def add(self, result: dict[str, Any]) -> None:
        self.counts.update(result.get("counts", {}))
        self.errors.update(result.get("errors", {}))
        for detail in result.get("details", []):
            if detail not in self.details:
                self.details.append(detail)
        for pod, seen in result.get("peers", {}).items():
            self.peers.setdefault(pod, Counter()).update(seen)


class Printer:
    """Progress and tables on stdout, flushed as they come."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, text: str = "", end: str = "\n") -> None:
        self.stream.write(text + end)
        self.stream.flush()


def default_manifests() -> list[str]:
    """examples/ here if it exists, else the checkout's examples/ next to agent/."""
    for candidate in (Path("examples"), PACKAGE_ROOT / "examples"):
        if candidate.is_dir():
            return [str(candidate)]
    return ["examples"]


def lab(
    manifests: Sequence[str],
    dataplane: str = "auto",
    keep: bool = False,
    requests: int = 20,
    stream: TextIO = sys.stdout,
) -> int:
    """The whole `lab` command; its exit status (0 only if every check holds)."""
    previous = _trap_signals()
    try:
        return _lab(manifests, dataplane, keep, requests, Printer(stream))
    except Interrupted as stop:
        print(f"\ninterrupted ({stop})", file=sys.stderr)
        return 130
    finally:
        _restore_signals(previous)


def _lab(manifests: Sequence[str], dataplane: str, keep: bool, requests: int, say: Printer) -> int:
    problem = _prerequisites()
    if problem is not None:
        print(f"kube-bpf-proxy lab: {problem}", file=sys.stderr)
        return 2
    if requests < 1:
        print("kube-bpf-proxy lab: --requests must be at least 1", file=sys.stderr)
        return 2
    paths = [str(Path(p).resolve()) for p in (manifests or default_manifests())]
    state, reports = load_manifests(paths)
    errors = [r for r in reports if r.error]
    for problem in errors:
        print(f"error: {problem}", file=sys.stderr)
    slices = [
        obj
        for path in manifest_files(paths)
        for _, obj in read_objects(path, [])
        if isinstance(obj, dict) and obj.get("kind") == "EndpointSlice"
    ]
    # Every Node's NodeState: the lab's agents program those of its nodes, and their
    # frontends are the Service addresses the lab routes.
    states = {name: compile(state, name, CompileOptions()) for name in sorted(state.nodes)}
    plan = plan_lab(slices, state, states.values())
    if not plan.nodes:
        print(
            "kube-bpf-proxy lab: no endpoint of the manifests is on a Node they define: "
            "nothing to build", file=sys.stderr,
        )  # fmt: skip
        return 1

    run = Run.new()
    cluster = Cluster(plan, run, keep=keep)
    say(f"kube-bpf-proxy lab {run.id}: {len(plan.nodes)} nodes in network namespaces "
        f"{run.prefix}*, from {', '.join(_short_path(p) for p in paths)}")  # fmt: skip
    say(f"  {len(state.services)} Services, {len(slices)} EndpointSlices, "
        f"{len(state.nodes)} Nodes" + (f"; {len(errors)} input error(s) skipped (above)"
                                       if errors else ""))  # fmt: skip
    if plan.unreachable:
        say("  not reachable in the lab (left out of every expectation):")
        for item in plan.unreachable:
            say(f"    {item.ip:<15} {', '.join(item.services)}: {item.reason}")

    kept = False
    try:
        cluster.write_record()
        build(cluster, say)
        agents = start_agents(cluster, paths, dataplane, say)
        for agent in agents.values():
            ours = states[agent.node].revision
            if agent.revision and not ours.startswith(agent.revision):
                say(f"  warning: {agent.node}'s agent programmed {agent.revision}, the lab "
                    f"compiled {ours[:19]} (KBP_* settings or changed files?)")  # fmt: skip
        first = plan.nodes[0].name
        if any(a.dataplane == "none" for a in agents.values()):
            say("\nA node runs the dry-run dataplane (none): nothing is programmed, so there "
                "is nothing to request.")  # fmt: skip
            all_ok = dataplane == "none"
            probes = []
        else:
            probes = plan_probes(plan, states, agents, first)
            run_probes(cluster, probes, requests, say)
            all_ok = report(plan, probes, first, say)
            show_dataplane(cluster, agents[first], say)
            show_explains(cluster, agents[first], states[first], paths, say)
        if keep:
            explore(cluster, agents, probes, say)
            kept = True
        return 0 if all_ok else 1
    except Interrupted as stop:
        say(f"\ninterrupted ({stop})")
        return 130
    except LabError as err:
        say(f"\nkube-bpf-proxy lab: {err}")
        return 1
    finally:
        _ignore_signals()  # a second Ctrl-C must not leave half a lab behind
        if not kept:
            say("removing the lab … ", end="")
            problems = cluster.close()
            say("done" if not problems else "left behind:\n  " + "\n  ".join(problems))


def lab_down(run_id: str | None = None, stream: TextIO = sys.stdout) -> int:
    """`lab down [RUN]`: remove every lab run whose `lab` process is gone, or only run
    `run_id` (two kept labs, say of two test sessions, then leave each other alone);
    exit status."""
    say = Printer(stream)
    if os.geteuid() != 0:
        print("kube-bpf-proxy lab down: needs root (it deletes network namespaces)",
              file=sys.stderr)  # fmt: skip
        return 2
    runs = existing_runs()
    if run_id is not None:
        runs = [run for run in runs if run.id == run_id]
        if not runs:
            say(f"no lab {run_id} to remove")
            return 1
    if not runs:
        say("no lab to remove")
        return 0
    status = 0
    for run in runs:
        owner = owner_running(run)
        if owner is not None:
            say(f"lab {run.id}: still in use by `lab` (pid {owner}); not removed")
            continue
        removal = remove_run(run)
        say(
            f"lab {run.id}: stopped {removal.processes} process(es), deleted "
            f"{removal.namespaces} namespace(s), {removal.pin_dirs} pin directory(ies)"
        )
        for problem in removal.problems:
            say(f"  could not remove: {problem}")
            status = 1
    return status


# -- building --


def _prerequisites() -> str | None:
    if os.geteuid() != 0:
        return ("needs root (it creates network namespaces, loads BPF programs and writes "
                "iptables rules inside them); run it as root, e.g. `sudo make lab`")  # fmt: skip
    missing_tools = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing_tools:
        return f"missing {', '.join(missing_tools)} (Debian: iproute2, util-linux, procps)"
    if not os.path.ismount(BPFFS):
        try:
            run_command(["mount", "-t", "bpf", "bpf", str(BPFFS)])
        except LabError as err:
            return f"{BPFFS} is no bpffs and cannot be mounted: {err}"
    return None


def build(cluster: Cluster, say: Printer) -> None:
    plan = cluster.plan
    started = time.monotonic()
    cluster.build_network()
    for index, node in enumerate(plan.nodes):
        say(f"creating {node.name} ({', '.join(node.addresses)}; pods "
            f"{', '.join(node.pod_prefixes)}) … ", end="")  # fmt: skip
        cluster.build_node(node, index)
        pods = cluster.build_pods(node)
        servers = [p for p in pods if not p.client]
        clients = [p for p in pods if p.client]
        say(f"{len(servers)} pods" + "".join(f" + {c.name} ({', '.join(c.addresses)})"
                                            for c in clients))  # fmt: skip
    cluster.route_nodes()
    outside = cluster.build_outside()
    if outside is not None:
        say(
            f"creating {outside.name} ({', '.join(outside.addresses)}): a client outside the "
            f"cluster on the node network, external addresses routed via {outside.entry_node}"
        )
    say("starting the pods' HTTP and UDP servers … ", end="")
    count = cluster.start_servers(python_for_children())
    say(f"{count} ready ({time.monotonic() - started:.1f} s so far)")


def start_agents(
    cluster: Cluster, manifests: list[str], dataplane: str, say: Printer
) -> dict[str, Agent]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KBP_")}
    python = python_for_children()
    building = "; bcc builds the eBPF programs first" if dataplane in ("auto", "ebpf") else ""
    say(f"starting the agent on every node (--dataplane {dataplane}{building}) …")
    started = time.monotonic()
    for node in cluster.plan.nodes:
        argv = [
            python, "-m", "agent", "run", "--manifests", *manifests, "--node", node.name,
            "--dataplane", dataplane, "--bpffs", str(cluster.run.pin_dir(node.name)),
            "--pod-interfaces", POD_INTERFACES,
            "--metrics-bind-address", "127.0.0.1:0", "--healthz-bind-address", "127.0.0.1:0",
            # The lab's clients are pods and outside namespaces, never the node's own
            # processes: no socket hooks on the machine's cgroups.
            "--cgroup-root", "none",
        ]  # fmt: skip
        cluster.start_agent(node, argv, env, cwd=PACKAGE_ROOT)

    def ready(agent: Agent) -> None:
        say(f"  {agent.node}: agent ready after {time.monotonic() - started:.1f} s — "
            f"dataplane {agent.dataplane} ({agent.reason}); applied {agent.revision}"
            + (f": {agent.applied}" if agent.applied else ""))  # fmt: skip

    cluster.wait_for_agents(AGENT_READY_TIMEOUT, ready)
    return cluster.agents


# -- requests --


def plan_probes(
    plan: LabPlan, states: dict[str, NodeState], agents: dict[str, Agent], first: str
) -> list[Probe]:
    """Every frontend of the first node's NodeState from its client; from the other nodes'
    clients, the ClusterIPs whose expected answer differs from the first node's."""
    probes: list[Probe] = []
    baseline: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for node in plan.nodes:
        client = plan.client_of(node.name)
        dataplane = agents[node.name].dataplane or "none"
        for entry in states[node.name].services:
            if entry.ip_family == "IPv6" and not client.ipv6:
                continue
            if entry.ip_family == "IPv4" and not client.ipv4:
                continue
            for frontend in entry.frontends:
                if node.name != first and is_external(frontend.type):
                    continue
                expectation = expect(
                    entry,
                    frontend,
                    client.ipv6 if entry.ip_family == "IPv6" else client.ipv4 or "",
                    dataplane,
                    lambda b, c=client, e=entry: _locate(plan, c, e, b),
                )
                key = (entry.sort_key, frontend.type)
                summary = (expectation.kind, expectation.backends, expectation.affinity)
                if node.name == first:
                    baseline[key] = summary
                elif baseline.get(key) == summary:
                    continue
                probes.append(
                    Probe(f"p{len(probes)}", client, dataplane, entry, frontend, expectation)
                )
    return probes + outside_probes(plan, states, agents, len(probes))


def outside_probes(
    plan: LabPlan, states: dict[str, NodeState], agents: dict[str, Agent], numbered_from: int = 0
) -> list[Probe]:
    """Every external frontend of the outside client's entry node (NodePorts at the node's
    addresses, ExternalIPs, LoadBalancer VIPs), in the families the client has."""
    outside = plan.outside
    if outside is None:
        return []
    dataplane = agents[outside.entry_node].dataplane or "none"
    probes: list[Probe] = []
    for entry in states[outside.entry_node].services:
        for frontend in entry.frontends:
            client_ip = outside.ipv6 if ":" in frontend.ip else outside.ipv4
            if not is_external(frontend.type) or client_ip is None:
                continue
            expectation = expect_from_outside(
                entry, frontend, client_ip, dataplane,
                lambda b, e=entry: _locate(plan, outside, e, b),
            )  # fmt: skip
            number = numbered_from + len(probes)
            probes.append(Probe(f"p{number}", outside, dataplane, entry, frontend, expectation))
    return probes


def _locate(
    plan: LabPlan, client: LabPod | LabOutside, entry: ServiceEntry, backend: Backend
) -> tuple[str | None, str]:
    """The name of the pod answering client for backend, or (None, why none does)."""
    pod, reason = backend_pod(plan, client, backend.ip, entry.protocol, backend.port)
    return (pod.full_name, "") if pod is not None else (None, reason)


def run_probes(cluster: Cluster, probes: list[Probe], requests: int, say: Printer) -> None:
    """All requests, the clients in parallel: per client and round one process for the
    frontends expected to answer, and one per frontend expected to refuse or drop (each
    of those waits out its timeouts, so they must not queue behind one another); extra
    rounds while a small expected set has not been covered."""
    python = python_for_children()
    clients = {p.client.name: p.client for p in probes}
    total = sum(p.item(requests)["n"] for p in probes)
    say(f"\nsending {total} requests ({requests} per frontend; {FAILURE_REQUESTS} where a "
        f"refusal or drop is expected) from {', '.join(sorted(clients))} …")  # fmt: skip
    pending = probes
    n = requests
    for round_number in range(1 + COVERAGE_ROUNDS):
        batches: dict[tuple[str, str], list[Probe]] = {}
        for probe in pending:
            alone = probe.id if probe.expectation.kind != BACKENDS else ""
            batches.setdefault((probe.client.name, alone), []).append(probe)
        # Not `with`: interrupted, the lab must not wait for the clients to finish (the
        # clean-up stops them, which ends these threads).
        pool = ThreadPoolExecutor(max_workers=max(1, len(batches)))
        try:
            futures = {
                key: pool.submit(
                    cluster.requests, clients[key[0]], python, [p.item(n) for p in batch]
                )
                for key, batch in batches.items()
            }
            for key, future in futures.items():
                results = future.result()
                for probe in batches[key]:
                    probe.add(results.get(probe.id, {}))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        # Small sets not covered yet get more requests until coverage can be judged.
        pending = [
            p for p in probes
            if missing(p.expectation, p.counts)
            and len(p.expectation.backends) <= COVERAGE_MAX_SET
            and not coverage_required(p.expectation, sum(p.counts.values()))
            and not p.errors  # a failing frontend is failing: no reason to insist
        ]  # fmt: skip
        if not pending or round_number == COVERAGE_ROUNDS:
            break
        n = max(requests, COVERAGE_ROUND_REQUESTS)
        names = ", ".join(sorted({_service(p.entry) for p in pending}))
        say(f"  not every backend answered yet ({names}): {n} more requests each")
    addresses: dict[str, frozenset[str]] = {}
    for probe in probes:
        probe.verdict = judge(probe.expectation, probe.counts, probe.errors)
        if isinstance(probe.client, LabOutside):
            node = probe.client.entry_node
            if node not in addresses:
                addresses[node] = frozenset(cluster.node_addresses(node))
            probe.node_addresses = addresses[node]
            if probe.verdict.ok and probe.expectation.sources:
                probe.verdict = judge_sources(
                    probe.expectation, probe.peers, probe.client.addresses, addresses[node]
                )


# -- output --


def _service(entry: ServiceEntry) -> str:
    return f"{entry.namespace}/{entry.name}"


def _pod_label(name: str, namespace: str) -> str:
    """A pod's name without its namespace when that is the Service's."""
    pod_namespace, _, short = name.partition("/")
    return short if pod_namespace == namespace else name


def _notes(entry: ServiceEntry) -> list[str]:
    notes = []
    if entry.affinity_timeout is not None:
        notes.append(f"sessionAffinity ClientIP {entry.affinity_timeout} s")
    if entry.internal_traffic_policy == "Local":
        notes.append("internalTrafficPolicy Local")
    if entry.external_traffic_policy == "Local":
        notes.append("externalTrafficPolicy Local")
    if entry.topology != "None":
        notes.append(f"topology {entry.topology}")
    if entry.lb_algorithm != "hash":
        notes.append(f"lbAlgorithm {entry.lb_algorithm}")
    backends = (entry.cluster_backends or ()) + (entry.local_backends or ())
    if backends and all(b.terminating for b in backends):
        notes.append("serving-terminating endpoints only")
    return notes


def _sources_seen(probe: Probe) -> str:
    """`api-a:client api-b:node-a`: whose address each backend saw (the client's own, its
    entry node's, or another, shown as it is)."""
    assert isinstance(probe.client, LabOutside)
    namespace = probe.entry.namespace
    cells = []
    for pod, seen in sorted(probe.peers.items()):
        for address in sorted(seen):
            if address in probe.client.addresses:
                who = KEPT
            elif address in probe.node_addresses:
                who = probe.client.entry_node
            else:
                who = address
            cells.append(f"{_pod_label(pod, namespace)}:{who}")
    return " ".join(cells) or "—"


def _row(probe: Probe) -> list[str]:
    namespace = probe.entry.namespace
    exp = probe.expectation
    expected = exp.describe
    if exp.kind == BACKENDS and exp.backends:
        expected = " ".join(_pod_label(n, namespace) for n in exp.backends)
    answered = " ".join(
        f"{_pod_label(name, namespace)}{TIMES}{n}" for name, n in sorted(probe.counts.items())
    )
    failures = " ".join(f"{kind}{TIMES}{n}" for kind, n in sorted(probe.errors.items()))
    answered = " ".join(x for x in (answered, failures) if x) or "—"
    mark = OK if probe.verdict and probe.verdict.ok else FAIL
    seen = [_sources_seen(probe)] if probe.outside else []
    return [frontend_text(probe.frontend, probe.entry.protocol), exp.uses, expected, answered,
            *seen, mark]  # fmt: skip


HEADER = ["FRONTEND", "USES", "EXPECTED", "ANSWERED", ""]
OUTSIDE_HEADER = ["FRONTEND", "USES", "EXPECTED", "ANSWERED", "SOURCE SEEN", ""]
ROW_INDENT = "    "


def report(plan: LabPlan, probes: list[Probe], first: str, say: Printer) -> bool:
    """The tables, one section per client; True when every check holds."""
    rows = {p.id: _row(p) for p in probes}
    widths = [max(len(r[i]) for r in [HEADER, *rows.values()]) for i in range(4)]
    outside_rows = [rows[p.id] for p in probes if p.outside]
    outside_widths = [*widths, max(len(r[4]) for r in [OUTSIDE_HEADER, *outside_rows])]
    by_client: dict[str, list[Probe]] = {}
    for probe in probes:
        by_client.setdefault(probe.client.name, []).append(probe)
    for node in plan.nodes:
        client = plan.client_of(node.name)
        group = by_client.get(client.name, [])
        if node.name == first:
            scope = "every frontend of its NodeState"
        elif group:
            scope = f"the ClusterIPs where the answer differs from {first}'s"
        else:
            continue
        dataplane = group[0].node_dataplane if group else "?"
        say(f"\nfrom {client.name} ({', '.join(client.addresses)}) on {node.name} "
            f"(dataplane {dataplane}), {scope}:")  # fmt: skip
        _table(group, rows, HEADER, widths, say)
    outside = plan.outside
    group = by_client.get(outside.name, []) if outside is not None else []
    if outside is not None and group:
        entry = outside.entry_node
        say(
            f"\nfrom outside ({', '.join(outside.addresses)} → {entry}; dataplane "
            f"{group[0].node_dataplane}), every external frontend of {entry}'s NodeState:"
        )
        say(f"  (SOURCE SEEN: the address each backend saw: {KEPT} = the outside client's "
            f"own, {entry} = one of {entry}'s (SNAT))")  # fmt: skip
        _table(group, rows, OUTSIDE_HEADER, outside_widths, say)
    if plan.not_proxied:
        say("\nnot proxied (nothing to request):")
        for name, why in plan.not_proxied:
            say(f"  {name:<24} {why}")
    failed = [p for p in probes if not (p.verdict and p.verdict.ok)]
    say(f"\n{len(probes)} checks: "
        + (f"all {OK}" if not failed else f"{len(probes) - len(failed)} {OK}, "
           f"{len(failed)} {FAIL}"))  # fmt: skip
    return not failed


def _table(
    group: list[Probe],
    rows: dict[str, list[str]],
    header: list[str],
    widths: list[int],
    say: Printer,
) -> None:
    """One client's rows under header, grouped by Service with the Service's notes."""
    _line(header, widths, say)
    by_service: dict[str, list[Probe]] = {}
    for probe in group:
        by_service.setdefault(_service(probe.entry), []).append(probe)
    for service, service_probes in by_service.items():
        notes: list[str] = []
        for probe in service_probes:
            notes += [n for n in _notes(probe.entry) if n not in notes]
        say(f"  {service}" + (f"  ({'; '.join(notes)})" if notes else ""))
        for probe in service_probes:
            _line(rows[probe.id], widths, say)
            _explain(probe, say)


def _line(row: list[str], widths: list[int], say: Printer) -> None:
    cells = [cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=False)]
    say((ROW_INDENT + "  ".join(cells) + "  " + row[-1]).rstrip())


def _explain(probe: Probe, say: Printer) -> None:
    indent = ROW_INDENT + "  "
    if probe.expectation.note and probe.expectation.kind == BACKENDS:
        say(f"{indent}({probe.expectation.note})")
    for excluded in probe.expectation.excluded:
        say(f"{indent}(not in the lab: {excluded})")
    if probe.verdict is not None and not probe.verdict.ok:
        say(f"{indent}{FAIL} {probe.verdict.note}")
        for detail in probe.details:
            say(f"{indent}  {detail}")


def show_dataplane(cluster: Cluster, agent: Agent, say: Printer) -> None:
    """What the first node's kernel holds: `inspect` and a map dump, or its KBP- rules."""
    node_ns = cluster.run.node_ns(agent.node)
    pin_dir = cluster.run.pin_dir(agent.node)
    if agent.dataplane == "ebpf":
        # The frontends, then the XDP program on eth0 with its verdicts (the outside
        # client's requests moved them).
        for view in ((), ("xdp",)):
            shown = " ".join(("inspect", *view))
            say(f"\n$ nsenter --net=/run/netns/{node_ns} kube-bpf-proxy {shown} --bpffs {pin_dir}")
            try:
                say(run_command(in_netns(node_ns, [python_for_children(), "-m", "agent",
                                                   "inspect", *view, "--bpffs", str(pin_dir)])
                                ).rstrip())  # fmt: skip
            except LabError as err:
                say(f"  {err}")
        _dump_map(pin_dir / SERVICES_MAP, say)
    elif agent.dataplane == "iptables":
        say(f"\n$ nsenter --net=/run/netns/{node_ns} iptables-save -t nat | grep KBP-SERVICES")
        try:
            lines = run_command(in_netns(node_ns, ["iptables-save", "-t", "nat"])).splitlines()
            say("\n".join(line for line in lines if "KBP-SERVICES" in line))
        except LabError as err:
            say(f"  {err}")
    elif agent.dataplane == "nftables":
        # The frontends and the marker, then the pick chains in use.
        shown = [("kube-bpf-proxy inspect nftables",
                  [python_for_children(), "-m", "agent", "inspect", "nftables"]),
                 (f"nft list chain ip {NFT_TABLE} {NFT_PICK_INSIDE}",
                  ["nft", "list", "chain", "ip", NFT_TABLE, NFT_PICK_INSIDE])]  # fmt: skip
        for text, argv in shown:
            say(f"\n$ nsenter --net=/run/netns/{node_ns} {text}")
            try:
                say(run_command(in_netns(node_ns, argv)).rstrip())
            except LabError as err:
                say(f"  {err}")


# `explain` once per policy kind, for the entry of the first node's NodeState that shows
# it (docs/operations.md "Where does this connection go?").
EXPLAIN_KINDS = (
    ("Cluster", lambda e: e.internal_traffic_policy == "Cluster" and e.topology == NO_TOPOLOGY
     and len(e.cluster_backends or ()) > 1),
    ("Local", lambda e: e.internal_traffic_policy == "Local"),
    ("topology", lambda e: not {*topology_tiers(e.topology)} <= {LOCAL_CLUSTER, ANY_CLUSTER}),
    ("LocalFirst", lambda e: bool({*topology_tiers(e.topology)} & {LOCAL_CLUSTER, ANY_CLUSTER})),
)  # fmt: skip


def show_explains(
    cluster: Cluster, agent: Agent, state: NodeState, manifests: Sequence[str], say: Printer
) -> None:
    """`kube-bpf-proxy explain` from the first node's client to one Service per policy
    kind: compiled from the lab's manifests (so the endpoints left out are listed too) and
    checked against the node's kernel."""
    if agent.dataplane not in ("ebpf", "iptables", "nftables"):
        return
    node_ns = cluster.run.node_ns(agent.node)
    client = cluster.plan.client_of(agent.node)
    for kind, wanted in EXPLAIN_KINDS:
        entry = next((e for e in state.services if e.ip_family == "IPv4" and wanted(e)), None)
        if entry is None or not client.ipv4:
            continue
        target = f"{entry.namespace}/{entry.name}:{entry.port or entry.frontends[0].port}" \
            f"/{entry.protocol}"  # fmt: skip
        argv = ["explain", "--manifests", *manifests, "--node", agent.node,
                "--bpffs", str(cluster.run.pin_dir(agent.node)),
                "--from", client.ipv4, "--to", target]  # fmt: skip
        shown = " ".join(_short_path(a) for a in argv)
        say(f"\n{kind}: $ nsenter --net=/run/netns/{node_ns} kube-bpf-proxy {shown}")
        try:
            say(run_command(in_netns(node_ns, [python_for_children(), "-m", "agent", *argv]))
                .rstrip())  # fmt: skip
        except LabError as err:
            say(f"  {err}")


def _dump_map(path: Path, say: Printer) -> None:
    if shutil.which("bpftool") is None:
        say("\n(bpftool is not installed: no map dump)")
        return
    try:
        entries = json.loads(run_command(["bpftool", "map", "dump", "pinned", str(path)]))
    except (LabError, ValueError) as err:
        say(f"\n$ bpftool map dump pinned {path}\n  {err}")
        return
    shown = entries[:DUMP_ENTRIES]
    say(f"\n$ bpftool map dump pinned {path}   (the first {len(shown)} of {len(entries)} "
        "entries, one per line; # the key decoded)")  # fmt: skip
    for entry in shown:
        say(json.dumps(entry, separators=(", ", ": ")) + _decoded_key(entry.get("key")))


def _decoded_key(key: Any) -> str:
    """`  # 10.96.0.10:80/TCP` for a kbp_services key as bpftool prints it (the address
    and port are network-order bytes shown as host-order integers)."""
    try:
        raw = b"".join(int(word).to_bytes(4, sys.byteorder) for word in key["addr"])
        family = int(key["family"])
        address = ipaddress.ip_address(raw[:4] if family == 4 else raw)
        port = int.from_bytes(int(key["port"]).to_bytes(2, sys.byteorder), "big")
        proto = {6: "TCP", 17: "UDP", 132: "SCTP"}.get(int(key["proto"]), str(key["proto"]))
    except (KeyError, TypeError, ValueError, OverflowError):
        return ""
    host = f"[{address}]" if family == 6 else str(address)
    return f"   # {host}:{port}/{proto}"


def explore(cluster: Cluster, agents: dict[str, Agent], probes: list[Probe], say: Printer) -> None:
    run = cluster.run
    cli = _cli()
    first = cluster.plan.nodes[0]
    client = cluster.plan.client_of(first.name)
    node_ns = run.node_ns(first.name)
    pin_dir = run.pin_dir(first.name)
    say("\nThe lab stays up (--keep). Explore it:")
    say(f"  ip netns list | grep {run.prefix}")
    example = next(
        (p for p in probes
         if p.client == client and p.proto == "tcp" and p.frontend.type == CLUSTER_IP
         and p.expectation.backends and ":" not in p.frontend.ip),
        None,
    )  # fmt: skip
    if example is not None:
        url = f"http://{example.frontend.ip}:{example.frontend.port}/"
        say(f"  ip netns exec {run.pod_ns(client)} curl -s {url}   "
            f"# {_service(example.entry)} from {client.name}")  # fmt: skip
    outside = next(
        (p for p in probes
         if p.outside and p.proto == "tcp" and p.expectation.backends
         and ":" not in p.frontend.ip),
        None,
    )  # fmt: skip
    if outside is not None:
        url = f"http://{outside.frontend.ip}:{outside.frontend.port}/"
        say(f"  ip netns exec {run.pod_ns(outside.client)} curl -si {url}   "
            f"# {_service(outside.entry)} from outside (X-Peer: the source it saw)")  # fmt: skip
    if agents[first.name].dataplane == "ebpf":
        say(f"  nsenter --net=/run/netns/{node_ns} {cli} inspect --bpffs {pin_dir}")
        say(f"  nsenter --net=/run/netns/{node_ns} {cli} inspect conntrack --bpffs {pin_dir}")
        say(f"  bpftool map dump pinned {pin_dir / SERVICES_MAP}")
    elif agents[first.name].dataplane == "nftables":
        say(f"  nsenter --net=/run/netns/{node_ns} {cli} inspect nftables")
        say(f"  nsenter --net=/run/netns/{node_ns} nft list table ip {NFT_TABLE}")
    else:
        say(f"  nsenter --net=/run/netns/{node_ns} iptables-save -t nat | grep KBP-")
    say(f"  less {run.workdir}/agent-{first.name}.log   # the agent's log")
    say(f"  {cli} lab down   # remove the lab")


def _cli() -> str:
    script = Path(sys.executable).parent / "kube-bpf-proxy"
    return str(script) if script.exists() else f"{sys.executable} -m agent"


def _short_path(path: str) -> str:
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(Path.cwd())) + "/"
    return path


# -- signals --

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def _trap_signals() -> dict[int, Any]:
    previous = {}
    for signum in _SIGNALS:
        previous[signum] = signal.signal(signum, _raise_interrupted)
    return previous


def _ignore_signals() -> None:
    for signum in _SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def _restore_signals(previous: dict[int, Any]) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
