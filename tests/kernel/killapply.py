"""SIGKILL in the middle of an apply: the trial behind tests/kernel/test_restart_kill.py and
bench/restart.py (issue 14: "afterwards the kernel holds, per Service, either the old or
the new state, never neither; the next agent converges").

Two NodeStates of the same cluster, A and B, compiled once by the runner from generated
Service and EndpointSlice objects: B moves most Services' backends (some keep a few, some
lose or gain some), removes every tenth Service, adds as many new ones, and leaves the
rest alone. A trial starts from a kernel that holds one of them wholly, starts an agent
process (`python -m tests.kernel.killapply apply`) that applies the other, and SIGKILLs
it at a random point of that apply. Then another agent process applies the new state,
and the kernel must hold exactly it. The next trial goes back the other way.

eBPF, reading the pins after the kill:
  * every frontend the maps hold resolves completely (each slot of its sets exists, each
    slot's backend exists) to what the old or the new state gives it;
  * a frontend of both states is there; one of a single state may be there or not;
  * nothing else is there;
  * kbp_meta names the old revision only if every frontend is old, the new one only if
    every frontend is new, or nothing (an apply was under way);
and after the next agent's apply: exactly the new state, no set or backend left over,
kbp_meta naming it.

iptables (one iptables-restore per family, committed table by table): each table of each
family is the old or the new one as a whole apply left it; the family's KBP-STATE marker
names the old state only if its tables are old, the new one only if they are new, or is
empty (an apply under way); after the next agent's apply, exactly the new tables. The
kill takes the agent's whole process group, its iptables-restore included, as a
container's end would.

The eBPF agent processes run the real EbpfDataplane (__init__ reads the maps and
kbp_meta as a restarted agent does; apply plans and writes through its own path) with one
difference: they open the pinned maps instead of compiling the programs with bcc, which
takes 2-10 s a time here (more under load) and would add two compiles to every trial; the
maps are what a crash can leave half written, and the programs attach nowhere here
(`--pod-interfaces` matches nothing, in a namespace the caller made). The runner compiles
once, to create the pins.

`run --pause S ARGS` is the real agent (`kube-bpf-proxy run ARGS`) with its first apply
paused S seconds after its first map write: tests/kernel/test_node_lock.py stops it
there with SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import random
import re
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.dataplane.ebpf.abi import versioned
from agent.dataplane.ebpf.inspect import PinnedMaps
from agent.dataplane.ebpf.libbpf import Map
from agent.dataplane.ebpf.maps import FrontendKey, KernelContent, MapSizes
from agent.dataplane.ebpf.options import EbpfOptions
from agent.dataplane.ebpf.translate import translate
from agent.dataplane.iptables.render import STATE
from agent.model.compile import compile
from agent.model.nodestate import NodeState

from ..builders import default_nodes, make_endpoint, make_service, make_slice, state_of

ROOT = Path(__file__).parents[2]
NO_INTERFACES = "kbpkill-none"  # a --pod-interfaces glob that matches nothing
NODE = "node-a"
TIMEOUT = 120.0  # seconds an agent process may take to open the maps or to apply


# --- the two states ----------------------------------------------------------------------


def _service(i: int, ports: int) -> dict:
    """Service i: ClusterIP 10.96.x.y (and fd00:96::i when i % 7 == 0: dual-stack gives
    an IPv6 entry too), every fifth a NodePort, every eleventh with session affinity."""
    ipv4 = f"10.96.{(i + 10) // 256 % 256}.{(i + 10) % 256}"
    v6 = i % 7 == 0

    def mutate(obj: dict) -> None:
        spec = obj["spec"]
        spec["clusterIP"] = ipv4
        spec["clusterIPs"] = [ipv4, f"fd00:96::{i + 10:x}"] if v6 else [ipv4]
        spec["ipFamilies"] = ["IPv4", "IPv6"] if v6 else ["IPv4"]
        spec["ipFamilyPolicy"] = "PreferDualStack" if v6 else "SingleStack"
        spec["ports"] = [
            {"name": f"p{p}", "port": 80 + p, "protocol": "TCP", "targetPort": 8080 + p}
            for p in range(ports)
        ]
        if i % 5 == 0:
            spec["type"] = "NodePort"
            for p, port in enumerate(spec["ports"]):
                port["nodePort"] = 30000 + (i * ports + p) % 2768
        if i % 11 == 0:
            spec["sessionAffinity"] = "ClientIP"
            spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": 600}}

    return make_service("kill", f"svc-{i:05d}", mutate)


def _slices(i: int, ports: int, endpoints: range) -> list[dict]:
    """Service i's EndpointSlices, endpoint j at 10.<128 + j // 256>... (unique per
    (i, j)); every third endpoint on this node."""
    out = []
    families = ("IPv4", "IPv6") if i % 7 == 0 else ("IPv4",)
    for family in families:
        members = []
        for j in endpoints:
            n = i * 64 + j
            ip = (
                f"10.{128 + n // 65536}.{n // 256 % 256}.{n % 256}"
                if family == "IPv4"
                else f"fd00:244::{n // 65536:x}:{n % 65536:x}"
            )
            node = NODE if j % 3 == 0 else "node-b"
            members.append(make_endpoint(ip, node))

        def mutate(obj: dict) -> None:
            obj["ports"] = [
                {"name": f"p{p}", "port": 8080 + p, "protocol": "TCP"} for p in range(ports)
            ]

        out.append(make_slice("kill", f"svc-{i:05d}-{family.lower()}", f"svc-{i:05d}",
                              members, mutate, family=family))  # fmt: skip
    return out


def _endpoints(i: int, which: str, services: int, endpoints: int) -> range | None:
    """Service i's endpoint numbers in state A or B; None: the Service is not there.
    Services numbered `services` and above exist only in B."""
    kind, added = i % 10, i >= services
    if which == "A":
        return None if added else range(endpoints)
    if kind == 0 and not added:
        return None  # removed in B
    if kind in (8, 9) or added:
        return range(endpoints)  # unchanged, or new in B
    if kind in (1, 2, 3, 4):
        return range(endpoints, 2 * endpoints)  # every backend moved
    if kind == 5:
        return range(3, endpoints + 3)  # some moved
    if kind == 6:
        return range(endpoints - 3)  # some removed
    return range(endpoints + 4)  # kind 7: some added


def cluster_objects(which: str, services: int, endpoints: int, ports: int = 1) -> list[dict]:
    """The Nodes, Services and EndpointSlices of state A or B (as manifests hold them)."""
    objects: list[dict] = [*default_nodes()]
    for i in range(services + services // 10):
        members = _endpoints(i, which, services, endpoints)
        if members is None:
            continue
        objects.append(_service(i, ports))
        objects.extend(_slices(i, ports, members))
    return objects


def nodestate(which: str, services: int, endpoints: int, ports: int = 1) -> NodeState:
    """State A or B of a cluster of `services` Services x `endpoints` endpoints (see the
    module doc); in B, Services services..services + services/10 - 1 are new."""
    return compile(state_of(*cluster_objects(which, services, endpoints, ports)), NODE)


# --- reading and judging the maps ----------------------------------------------------------

Member = tuple[str, int, int, int]  # a backend: address, port, family, flags
View = tuple[int, int, int, tuple[Member, ...], tuple[Member, ...]]  # flags, type, affinity,
# the external set's and the internal set's backends (sorted: a set is a multiset here)


@dataclass
class Resolved:
    """What a content serves: each frontend's view, and what does not resolve."""

    views: dict[FrontendKey, View]
    broken: list[str]  # frontends whose sets or backends are missing (must stay empty)
    unreferenced_sets: int  # sets and backends no frontend names (left by a cut apply)
    unreferenced_backends: int


def resolve(content: KernelContent) -> Resolved:
    views: dict[FrontendKey, View] = {}
    broken: list[str] = []
    sets_named: set[int] = set()
    backends_named: set[int] = set()

    def members(key: FrontendKey, set_id: int, count: int) -> tuple[Member, ...]:
        if count == 0:
            return ()
        sets_named.add(set_id)
        slots = content.slots.get(set_id)
        if slots is None or len(slots) != count or 0 in slots:
            broken.append(f"{key}: set {set_id} of {count} holds {slots}")
            return ()
        out = []
        for backend_id in slots:
            backends_named.add(backend_id)
            b = content.backends.get(backend_id)
            if b is None:
                broken.append(f"{key}: set {set_id} names backend {backend_id}, missing")
                continue
            out.append((b.addr, b.port, b.family, b.flags))
        return tuple(sorted(out))

    for key, v in content.services.items():
        views[key] = (v.flags, v.type, v.affinity_timeout, members(key, v.set_id, v.count),
                      members(key, v.internal_set_id, v.internal_count))  # fmt: skip
    return Resolved(
        views,
        broken,
        len(content.slots.keys() - sets_named),
        len(content.backends.keys() - backends_named),
    )


def expected(state: NodeState, sizes: MapSizes) -> dict[FrontendKey, View]:
    """The views the maps hold once `state` is applied."""
    resolved = resolve(translate(state, KernelContent(), sizes=sizes))
    assert not resolved.broken, resolved.broken
    return resolved.views


def read_maps(pin_dir: Path) -> tuple[KernelContent, str | None]:
    """What the pinned maps hold, and the revision kbp_meta names (inspect's reader)."""
    with PinnedMaps(pin_dir) as pinned:
        return pinned.content(), pinned.revision()


@dataclass
class Verdict:
    outcome: str  # old | mixed | new
    violations: list[str]
    frontends: int  # the maps hold
    old: int  # frontends as the old state has them (or absent as in the old state)
    new: int
    meta: str  # old | none | new


def judge(
    content: KernelContent,
    meta: str | None,
    old: tuple[str, dict[FrontendKey, View]],
    new: tuple[str, dict[FrontendKey, View]],
) -> Verdict:
    """Hold the maps against the old and the new state (revision, views)."""
    (old_rev, old_views), (new_rev, new_views) = old, new
    resolved = resolve(content)
    violations = list(resolved.broken)
    held = resolved.views
    as_old = as_new = 0
    for key in held.keys() | old_views.keys() | new_views.keys():
        k, o, n = held.get(key), old_views.get(key), new_views.get(key)
        if k is None and o is not None and n is not None:
            violations.append(f"{key}: in both states, not in the maps")
            continue
        if k != o and k != n:
            violations.append(f"{key}: the maps hold {k}, the old state {o}, the new {n}")
            continue
        as_old += k == o
        as_new += k == n
    total = len(held.keys() | old_views.keys() | new_views.keys())
    outcome = "new" if as_new == total else "old" if as_old == total else "mixed"
    meta_word = {old_rev: "old", new_rev: "new", None: "none"}.get(meta, f"other {meta}")
    if meta_word not in ("none", outcome):
        violations.append(f"kbp_meta names the {meta_word} revision, the maps are {outcome}")
    return Verdict(outcome, violations, len(held), as_old, as_new, meta_word)


def exact(content: KernelContent, meta: str | None, rev: str, views: dict) -> list[str]:
    """What differs from maps that hold exactly one state (nothing left over)."""
    resolved = resolve(content)
    problems = list(resolved.broken)
    if resolved.views != views:
        wrong = [k for k in resolved.views.keys() | views.keys()
                 if resolved.views.get(k) != views.get(k)]  # fmt: skip
        problems.append(f"{len(wrong)} frontends differ from the state, e.g. {wrong[:3]}")
    if resolved.unreferenced_sets or resolved.unreferenced_backends:
        problems.append(f"left over: {resolved.unreferenced_sets} sets, "
                        f"{resolved.unreferenced_backends} backends")  # fmt: skip
    if meta != rev:
        problems.append(f"kbp_meta names {meta}, not {rev}")
    return problems


# --- the same for the iptables dataplane -----------------------------------------------------

Tables = dict[tuple[str, str], dict[str, tuple[str, ...]]]  # (family, table) → chain → rules
_SAVE = {"IPv4": "iptables-save", "IPv6": "ip6tables-save"}
_WRITTEN_AT = re.compile(r" at \d+(\"? -j RETURN)$")


def read_tables(netns: str) -> Tables:
    """The nat and filter tables of both families, chain by chain, in rule order (the
    time in the KBP-STATE marker left out: it differs between two writes of a state)."""
    tables: Tables = {}
    for family, save in _SAVE.items():
        for table in ("nat", "filter"):
            argv = ["nsenter", f"--net=/run/netns/{netns}", "--", save, "-t", table]
            text = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
            chains: dict[str, list[str]] = {}
            for line in text.splitlines():
                if line.startswith(":"):
                    chains.setdefault(line[1:].split()[0], [])
                elif line.startswith("-A "):
                    chain, _, rule = line[3:].partition(" ")
                    chains.setdefault(chain, []).append(_WRITTEN_AT.sub(r"\1", rule))
            tables[family, table] = {c: tuple(r) for c, r in chains.items()}
    return tables


def _marker(tables: Tables, family: str) -> tuple[str, ...]:
    return tables.get((family, "filter"), {}).get(STATE, ())


def _unmarked(tables: Tables, key: tuple[str, str]) -> dict[str, tuple[str, ...]] | None:
    table = tables.get(key)
    return None if table is None else {c: r for c, r in table.items() if c != STATE}


def judge_tables(held: Tables, old: Tables, new: Tables) -> Verdict:
    """Each table of each family must be the old or the new one, whole (one
    iptables-restore per family commits table by table); the family's KBP-STATE marker
    may name the old state only if its tables are old, the new one only if they are
    new, or be empty (an apply was under way)."""
    violations, words = [], []
    keys = sorted(held.keys() | old.keys() | new.keys())
    for key in keys:
        h, o, n = _unmarked(held, key), _unmarked(old, key), _unmarked(new, key)
        if h == o:
            words.append("old" if h != n else "both")
        elif h == n:
            words.append("new")
        else:
            differ = [c for c in (h or {}) if (h or {}).get(c) not in (
                (o or {}).get(c), (n or {}).get(c))]  # fmt: skip
            violations.append(f"{' '.join(key)}: neither the old nor the new table; chains "
                              f"unlike both: {differ[:3]}")  # fmt: skip
            words.append("neither")
    markers = []
    for family in sorted({f for f, _ in keys}):
        said = {w for (f, _), w in zip(keys, words, strict=True) if f == family}
        m = _marker(held, family)
        word = ("none" if not m else "old" if m == _marker(old, family) else
                "new" if m == _marker(new, family) else "other")  # fmt: skip
        markers.append(f"{family[-1]}:{'-' if word == 'none' else word[0]}")
        if word != "none" and not said <= {word, "both"}:
            violations.append(f"{family}: the KBP-STATE marker names the {word} state, the "
                              f"tables are {sorted(said)}")  # fmt: skip
    outcome = ("new" if set(words) <= {"new", "both"} else
               "old" if set(words) <= {"old", "both"} else "mixed")  # fmt: skip
    tables = " ".join(f"{f[-1]}{t[0]}:{w[0]}" for (f, t), w in zip(keys, words, strict=True))
    return Verdict(outcome, violations, sum(len(c) for c in held.values()),
                   words.count("old"), words.count("new"),
                   f"{tables}; markers {' '.join(markers)}")  # fmt: skip


def exact_tables(held: Tables, state: Tables) -> list[str]:
    keys = sorted(held.keys() | state.keys())
    return [f"{' '.join(k)} differs from the state's" for k in keys if held.get(k) != state.get(k)]


# --- the agent process -----------------------------------------------------------------------


class _PinnedPrograms:
    """LoadedPrograms' map side on the pins alone (see the module doc): no program fds."""

    compile_seconds = 0.0

    def __init__(self, pin_dir: Path, sizes: object = None) -> None:
        self.pin_dir = pin_dir
        self.maps: dict[str, Map] = {}

    def map(self, name: str) -> Map:
        if name not in self.maps:
            self.maps[name] = Map.pinned(str(self.pin_dir / versioned(name)))
        return self.maps[name]

    def fd(self, program: str) -> int:
        raise AssertionError(f"the trial attaches nothing, yet {program} was asked for")

    def finish_moves(self) -> None:
        """Nothing to finish: the trial opens the pins as they are, moving none."""

    def close(self) -> None:
        for m in self.maps.values():
            m.close()


WRITE_CALLS = ("update", "delete", "update_batch", "delete_batch")  # Map's writing methods


def agent_main(args: argparse.Namespace) -> int:
    """`apply`: open the pins as a restarted agent, say `ready`, apply state A or B, say
    `done` with the writes and times (seconds: construction, apply, first and last map
    write). With --die-after-write K, the process SIGKILLs itself as soon as the K-th
    call that writes a map (one syscall, or one batch of them) has returned."""
    from agent.dataplane.ebpf import dataplane as module

    state = pickle.loads(args.state_file.read_bytes())
    module.load_programs = _PinnedPrograms  # type: ignore[assignment]
    began = time.perf_counter()
    dp: Any
    if args.dataplane == "iptables":
        from agent.dataplane.iptables.dataplane import IptablesDataplane

        dp = IptablesDataplane([NO_INTERFACES], netns=args.netns)
    else:
        dp = module.EbpfDataplane(EbpfOptions(
            args.pin_dir, (NO_INTERFACES,), netns=args.netns, watch=False, check_period=0
        ))  # attaches nothing: nothing to keep
    opened = time.perf_counter()
    writes_at: list[float] = []
    for name in WRITE_CALLS:
        setattr(Map, name, _counted(getattr(Map, name), writes_at, args.die_after_write))
    print("ready", flush=True)
    writes = dp.apply(state)
    done = time.perf_counter()
    report = {
        "writes": writes,
        "write_calls": len(writes_at),
        "open_s": opened - began,
        "apply_s": done - opened,
        "first_write_s": writes_at[0] - opened if writes_at else None,
        "last_write_s": writes_at[-1] - opened if writes_at else None,
    }
    print("done " + json.dumps(report), flush=True)
    return 0


FIRST_SLOW_WRITE = "killapply: the apply's first map write"  # logged by `run --pause`


def slow_run_main(args: argparse.Namespace, agent_args: list[str]) -> int:
    """`run`: the real agent (`kube-bpf-proxy run ARGS`) whose first apply pauses --pause
    seconds after its first map write (made by the sync loop's thread) and logs
    FIRST_SLOW_WRITE then, so a caller can signal the agent while an apply is half
    written, whatever the number of writes it makes."""
    from agent.cli import main as cli_main

    paused: list[bool] = []
    for name in WRITE_CALLS:
        setattr(Map, name, _paused(getattr(Map, name), args.pause, paused))
    return cli_main(["run", *agent_args])


def _paused(method: Any, pause: float, paused: list[bool]) -> Any:
    def write(self: Map, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        if not paused and threading.current_thread().name == "sync":  # the runner's: an apply
            paused.append(True)
            sys.stderr.write(FIRST_SLOW_WRITE + "\n")  # one write: log lines interleave
            sys.stderr.flush()
            time.sleep(pause)
        return result

    return write


def _counted(method: Any, writes_at: list[float], die_after: int) -> Any:
    def write(self: Map, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        writes_at.append(time.perf_counter())
        if len(writes_at) == die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return write


# --- the trial runner --------------------------------------------------------------------------


@dataclass
class Cluster:
    services: int
    endpoints: int
    ports: int = 1
    dataplane: str = "ebpf"
    states: dict[str, NodeState] = field(default_factory=dict)
    views: dict[str, dict[FrontendKey, View]] = field(default_factory=dict)
    tables: dict[str, Tables] = field(default_factory=dict)  # iptables: as a whole apply left them

    files: dict[str, Path] = field(default_factory=dict)  # the states, pickled for the agents

    def build(self, sizes: MapSizes, directory: Path) -> None:
        """Compile both states, once: the agent processes unpickle them from `directory`
        (five times faster than compiling them again at 5k Services)."""
        for which in ("A", "B"):
            state = nodestate(which, self.services, self.endpoints, self.ports)
            self.states[which] = state
            self.views[which] = expected(state, sizes)
            self.files[which] = directory / f"nodestate-{which}.pickle"
            self.files[which].write_bytes(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL))

    def side(self, which: str) -> tuple[str, dict[FrontendKey, View]]:
        return self.states[which].revision, self.views[which]


class AgentRun:
    """One `apply` agent process in namespace netns."""

    def __init__(
        self, cluster: Cluster, which: str, pin_dir: Path, netns: str, die_after_write: int = 0
    ) -> None:
        argv = [sys.executable, "-m", "tests.kernel.killapply", "apply",
                "--state-file", str(cluster.files[which]), "--pin-dir", str(pin_dir),
                "--netns", netns,
                "--die-after-write", str(die_after_write),
                "--dataplane", cluster.dataplane]  # fmt: skip
        # A session of its own: the kill takes its iptables-restore too, as a container's
        # end takes every process in it.
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip

    def line(self, timeout: float = TIMEOUT) -> str:
        """The next line it prints ("" once it exited)."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise RuntimeError(f"the agent process said nothing in {timeout} s")
        return self.proc.stdout.readline().strip()

    def wait_ready(self) -> float:
        """Wait for `ready`; the time it was read."""
        line = self.line()
        if line != "ready":
            raise RuntimeError(f"the agent process said {line!r}: {self.errors()}")
        return time.perf_counter()

    def report(self) -> dict[str, Any]:
        """Its `done` report, once it exited 0."""
        word, _, rest = self.line().partition(" ")
        status = self.proc.wait(TIMEOUT)
        if word != "done" or status != 0:
            raise RuntimeError(f"the agent process exited {status}: {self.errors()}")
        return json.loads(rest)

    def finished(self) -> bool:
        """Once it exited: did it report the apply done (before any signal came)?"""
        self.proc.wait(TIMEOUT)
        return any(line.startswith("done") for line in iter(self.line, ""))

    def kill(self) -> None:
        """SIGKILL it and what it runs (its process group: the session it leads, which
        this runner started), if it has not exited yet."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def errors(self) -> str:
        self.kill()
        assert self.proc.stderr is not None
        return self.proc.stderr.read()[-3000:]

    def close(self) -> None:
        self.kill()
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


def apply_whole(cluster: Cluster, which: str, pin_dir: Path, netns: str) -> dict[str, Any]:
    """An agent process applies `which` to the end; its report."""
    run = AgentRun(cluster, which, pin_dir, netns)
    try:
        run.wait_ready()
        return run.report()
    finally:
        run.close()


@dataclass
class Trial:
    old: str  # the state the maps held: A or B
    cut: str  # where the agent died: "after 0.123 s" or "after write call K"
    finished: bool  # the agent had completed the apply before it died
    verdict: Verdict
    converge: dict[str, Any]  # the next agent's report
    converge_problems: list[str]


def trial(
    cluster: Cluster,
    old: str,
    pin_dir: Path,
    netns: str,
    *,
    delay: float = 0.0,
    die_after_write: int = 0,
) -> Trial:
    """Maps holding `old` wholly: an agent process applying the other state is killed
    `delay` s after it is ready (or kills itself after its write call `die_after_write`);
    the maps are judged; then a new agent converges and the maps must hold the new state
    exactly."""
    new = "B" if old == "A" else "A"
    run = AgentRun(cluster, new, pin_dir, netns, die_after_write)
    try:
        ready = run.wait_ready()
        if not die_after_write:
            pause = ready + delay - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            run.kill()
        finished = run.finished()
    finally:
        run.close()
    if cluster.dataplane == "iptables":
        verdict = judge_tables(read_tables(netns), cluster.tables[old], cluster.tables[new])
        report = apply_whole(cluster, new, pin_dir, netns)
        problems = exact_tables(read_tables(netns), cluster.tables[new])
    else:
        content, meta = read_maps(pin_dir)
        verdict = judge(content, meta, cluster.side(old), cluster.side(new))
        report = apply_whole(cluster, new, pin_dir, netns)
        content, meta = read_maps(pin_dir)
        problems = exact(content, meta, *cluster.side(new))
    cut = f"after write call {die_after_write}" if die_after_write else f"after {delay:.3f} s"
    return Trial(old, cut, finished, verdict, report, problems)


def kill_delays(count: int, apply_s: float, seed: int) -> list[float]:
    """Uniformly random points of an apply that takes `apply_s`."""
    rng = random.Random(seed)
    return [rng.uniform(0.0, apply_s) for _ in range(count)]


def map_sizes(cluster: Cluster) -> MapSizes:
    """Room for both states and what a cut apply leaves over (powers of two)."""
    frontends = cluster.services * cluster.ports * 4
    slots = cluster.services * cluster.ports * cluster.endpoints * 6
    return MapSizes(
        services=1 << max(10, frontends.bit_length()),
        slots=1 << max(12, slots.bit_length()),
        backends=1 << max(12, slots.bit_length()),
        ct=4096,
        affinity=1024,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.kernel.killapply")
    sub = parser.add_subparsers(dest="command", required=True)
    apply = sub.add_parser("apply", help="an agent process of the trial (see the module doc)")
    apply.add_argument("--state-file", type=Path, required=True, help="a pickled NodeState")
    apply.add_argument("--pin-dir", type=Path, required=True)
    apply.add_argument("--netns", required=True)
    apply.add_argument("--die-after-write", type=int, default=0, metavar="K")
    apply.add_argument("--dataplane", choices=("ebpf", "iptables"), default="ebpf")
    slow = sub.add_parser("run", help="the real agent with slow applies (slow_run_main); "
                          "the other arguments are `kube-bpf-proxy run`'s")  # fmt: skip
    slow.add_argument("--pause", type=float, required=True, metavar="SECONDS")
    args, rest = parser.parse_known_args(argv)
    if args.command == "run":
        return slow_run_main(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return agent_main(args)


if __name__ == "__main__":
    sys.exit(main())
