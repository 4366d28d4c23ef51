"""PB-9: the iptables dataplane's full and partial (incremental) sync at 1k and 10k
Services x 10 endpoints, each beside the floor: an `iptables-restore --noflush` of the rules
kube-proxy's iptables mode would write for the same NodeState, in a fresh namespace.

Workload: the generated cluster of bench/common/workload.py (its generator: 5 % NodePort,
2 % LoadBalancer, some with externalTrafficPolicy Local, 4 % ClientIP affinity, 10 % with
a second port; nodePorts unique), compiled for `node-000` with the pod CIDR 10.128.0.0/9
(kube-proxy's `--cluster-cidr`, so both write the "masquerade off-cluster traffic" rule).

The floor is written by `kube_proxy_document` below, from the NodeState: filter
KUBE-SERVICES / KUBE-EXTERNAL-SERVICES / KUBE-NODEPORTS / KUBE-FORWARD /
KUBE-PROXY-FIREWALL, nat KUBE-SERVICES (ending in the KUBE-NODEPORTS jump),
KUBE-NODEPORTS, KUBE-SVC-*, KUBE-SVL-*, KUBE-EXT-*, KUBE-FW-*, KUBE-SEP-* (statistic,
recent, DNAT), KUBE-MARK-MASQ, KUBE-POSTROUTING. Its partial form is KEP-3453's: the
filter table and the nat top-level chains in full, plus the chains of changed Services
and deletes of chains that went away. The floor declares its chains in descending name
order, the fastest order for iptables-nft 1.8.9 (see `descending_declarations`); the same
rules in kube-proxy's own order are restored once as a reference (up to 2k Services: the
time grows with the square of the chains). kube-proxy's jump rules from the built-in
chains are added untimed after the floor's full restore. Only the restore process is timed
for the floor (kube-proxy's own Go rendering is not counted); for ours, `IptablesDataplane.apply` is
timed whole (render in Python, `iptables-save` of the kernel's chains on a full rewrite,
restores of both families, the jump rules), and its subprocesses are timed one by one by
wrapping the module's `_run`.

Steps per size and backend (nft = `iptables-nft-restore`, legacy = `iptables-legacy-restore`;
ours is given the backend as `--iptables-backend` would):

    full      into an empty fresh namespace, floor and ours in turn, repeated
    restart   a new IptablesDataplane over its own rules (reads them back, rewrites all);
              floor: the kube-proxy document restored again over its rules
    resync    `apply(state, full=True)` with nothing changed, inside the hour (jump checks)
    partial   single changes (bench.common.workload.make_changes: an endpoint not ready, an endpoint
              added, a Service added, a Service deleted), recompiled with
              `Compiler.update`, applied by ours and by the floor's partial restore, each
              in its namespace; rules written (`dp.last_writes`) and whether the restore
              input declared only the changed Services' chains (plus the dispatch chains)
    check     the kernel's KBP- chains and rules per chain equal a fresh render
    cleanup   the module's `cleanup()`: every KBP- chain and jump removed

`--profile` adds a cProfile of the Python side of one full sync (subprocesses stubbed) per
size: bench/results/iptables_sync-profile-<N>x10.txt and .prof.

    .venv/bin/python -m bench.iptables_sync [--quick] [--services N ...] [--backends nft legacy]
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import cProfile
import gc
import hashlib
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

if not __package__:  # run as a script: bench/ is on sys.path, the checkout is not
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.dataplane.iptables import backend as iptables_backend
from agent.dataplane.iptables import dataplane as iptables_module
from agent.dataplane.iptables import render as iptables_render
from agent.dataplane.iptables.backend import find_backend
from agent.dataplane.iptables.dataplane import IptablesDataplane
from agent.dataplane.options import DEFAULT_POD_INTERFACES
from agent.lab.toolkit import in_netns
from agent.model.compile import CompileOptions, Compiler
from agent.model.decode import decode_object
from agent.model.nodestate import (
    CLUSTER_IP,
    EXTERNAL_IP,
    LOAD_BALANCER,
    NODE_PORT,
    NodeState,
    ServiceEntry,
)
from agent.sources.manifests import load_manifests
from bench.common.kernel import bench_netns, leftovers
from bench.common.report import (
    RESULTS,
    Summary,
    fmt_s,
    header,
    machine,
    mark,
    results_path,
    terminate_as_interrupt,
    write_results,
)
from bench.common.workload import ENDPOINTS, THIS_NODE, Change, generate, make_changes

POD_CIDR = "10.128.0.0/9"  # the generator's pod addresses (bench/compile.py)
LOCK_WAIT = "5"
# Seconds one iptables tool may run, ours and the floor's alike: an nft restore at 10k x 10
# takes longer than the dataplane's own COMMAND_TIMEOUT (300 s), which would stop it.
TOOL_TIMEOUT = 3600.0

# Target and anchors (bench/README.md, PB-9, PB-4, PB-5).
TARGET_RATIO = 1.2  # ours ≤ 1.2 x the equivalent restore, full and partial
# iptables-nft 1.8.9's restore takes time growing with the square of the user chains
# (11 per Service here): 7 s at 1k x 10, minutes at 10k x 10. Above this, --nft-max.
NFT_MAX_DEFAULT = 2000
KP_ORDER_MAX = 2000  # the reference in kube-proxy's chain order is restored up to this N
REF_PB9 = (
    "iptables-restore of the equivalent kube-proxy ruleset here: 3.7-4.0 s (legacy), "
    "9.7-12.8 s (nft) full at 10k x 10; iptables partial sync 0.6-0.9 s"
)


# --- backends ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    """One `iptables` implementation: its tools per family (the dataplane's tables)."""

    name: str
    restore: dict[str, str]
    save: dict[str, str]
    iptables: dict[str, str]

    def version(self) -> str:
        try:
            proc = subprocess.run([self.iptables["IPv4"], "--version"], capture_output=True,
                                  text=True, timeout=10, check=False)  # fmt: skip
        except (OSError, subprocess.SubprocessError) as err:
            return f"unavailable: {err}"
        return (proc.stdout or proc.stderr).strip()

    @contextlib.contextmanager
    def for_dataplane(self) -> Iterator[None]:
        """Point agent/dataplane/iptables at this backend's tools while inside, with the
        bench's command timeout (the module's 300 s is shorter than an nft restore at 10k)."""
        tools = find_backend(self.name)
        assert tools is not None, f"iptables-{self.name} is not installed"
        with (
            mock.patch.object(iptables_module, "choose_backend",
                              lambda requested, netns=None: (tools, "the bench's")),
            mock.patch.object(iptables_backend, "COMMAND_TIMEOUT", TOOL_TIMEOUT),
        ):  # fmt: skip
            yield


BACKENDS = {
    "nft": Backend(
        "nft",
        {"IPv4": "iptables-nft-restore", "IPv6": "ip6tables-nft-restore"},
        {"IPv4": "iptables-nft-save", "IPv6": "ip6tables-nft-save"},
        {"IPv4": "iptables-nft", "IPv6": "ip6tables-nft"},
    ),
    "legacy": Backend(
        "legacy",
        {"IPv4": "iptables-legacy-restore", "IPv6": "ip6tables-legacy-restore"},
        {"IPv4": "iptables-legacy-save", "IPv6": "ip6tables-legacy-save"},
        {"IPv4": "iptables-legacy", "IPv6": "ip6tables-legacy"},
    ),
}


def run_tool(ns: str, argv: Sequence[str], stdin: str | None = None) -> tuple[float, str]:
    """(seconds, stdout) of one tool run in ns; raises on failure."""
    start = time.perf_counter()
    proc = subprocess.run(in_netns(ns, argv), input=stdin, capture_output=True, text=True,
                          timeout=TOOL_TIMEOUT, check=False)  # fmt: skip
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} in {ns}: {(proc.stderr or proc.stdout).strip()}")
    return took, proc.stdout


def restore(ns: str, backend: Backend, text: str) -> float:
    """The floor's operation: one `iptables-restore --noflush` of `text`, as ours runs it."""
    took, _ = run_tool(ns, [backend.restore["IPv4"], "-w", LOCK_WAIT, "--noflush"], text)
    return took


def flush_tables(ns: str, backend: Backend) -> None:
    """Empty nat and filter of both families synchronously, so the namespace's deletion
    (asynchronous in the kernel) does not tear down 100k rules behind the next figure."""
    for family in ("IPv4", "IPv6"):
        for table in ("nat", "filter"):
            for flag in ("-F", "-X"):
                subprocess.run(in_netns(ns, [backend.iptables[family], "-w", LOCK_WAIT, "-t",
                                          table, flag]),
                               capture_output=True, timeout=TOOL_TIMEOUT, check=False)  # fmt: skip


@contextlib.contextmanager
def scratch_netns(backend: Backend) -> Iterator[str]:
    """A fresh namespace (bench.datapath's, deleted on exit), emptied before deletion."""
    with bench_netns() as ns:
        try:
            yield ns
        finally:
            flush_tables(ns, backend)


# --- the floor: what kube-proxy's iptables mode writes for the same NodeState ------------

KP_SERVICES = "KUBE-SERVICES"
KP_EXTERNAL = "KUBE-EXTERNAL-SERVICES"
KP_NODEPORTS = "KUBE-NODEPORTS"
KP_FORWARD = "KUBE-FORWARD"
KP_FIREWALL = "KUBE-PROXY-FIREWALL"
KP_MARK_MASQ = "KUBE-MARK-MASQ"
KP_POSTROUTING = "KUBE-POSTROUTING"
KP_NAT_TOP = (KP_SERVICES, KP_NODEPORTS, KP_MARK_MASQ, KP_POSTROUTING)
KP_FILTER_TOP = (KP_SERVICES, KP_EXTERNAL, KP_NODEPORTS, KP_FORWARD, KP_FIREWALL)
KP_MASQ_BIT = "0x4000"


def kp_chain(kind: str, identity: str) -> str:
    """KUBE-<kind>-<16 base32 characters of a SHA-256 of the identity>, kube-proxy's form."""
    digest = base64.b32encode(hashlib.sha256(identity.encode()).digest())
    return f"KUBE-{kind}-{digest[:16].decode()}"


# kube-proxy's jump rules from the built-in chains: (table, chain, conntrack NEW only,
# target). It makes them with `iptables -C`/`-I` outside its restore, so the floor's figure
# excludes them; they are installed (untimed) because a table whose built-in chains jump to
# ours makes every later nft restore slower, ours and the floor's alike.
KP_JUMPS = (
    ("nat", "PREROUTING", False, KP_SERVICES),
    ("nat", "OUTPUT", False, KP_SERVICES),
    ("nat", "POSTROUTING", False, KP_POSTROUTING),
    ("filter", "INPUT", True, KP_EXTERNAL),
    ("filter", "INPUT", False, KP_NODEPORTS),
    ("filter", "INPUT", True, KP_FIREWALL),
    ("filter", "FORWARD", True, KP_SERVICES),
    ("filter", "FORWARD", True, KP_EXTERNAL),
    ("filter", "FORWARD", False, KP_FORWARD),
    ("filter", "FORWARD", True, KP_FIREWALL),
    ("filter", "OUTPUT", True, KP_SERVICES),
    ("filter", "OUTPUT", True, KP_FIREWALL),
)


def add_kube_proxy_jumps(ns: str, backend: Backend) -> None:
    for table, chain, new_only, target in KP_JUMPS:
        state = ["-m", "conntrack", "--ctstate", "NEW"] if new_only else []
        run_tool(ns, [backend.iptables["IPv4"], "-w", LOCK_WAIT, "-t", table, "-I", chain, "1",
                      *state, "-m", "comment", "--comment", f"kubernetes {target}",
                      "-j", target])  # fmt: skip


@dataclass(frozen=True)
class KubeProxyEntry:
    """One Service entry's part of kube-proxy's tables."""

    nat_services: tuple[str, ...]
    nat_nodeports: tuple[str, ...]
    filter_services: tuple[str, ...]
    filter_external: tuple[str, ...]
    filter_nodeports: tuple[str, ...]
    filter_firewall: tuple[str, ...]
    chains: dict[str, tuple[str, ...]]  # per-Service nat chains


def kube_proxy_entry(entry: ServiceEntry, cluster_cidr: str | None) -> KubeProxyEntry:
    """The rules kube-proxy's iptables proxier writes for one service port (one family),
    with local traffic detected by `--cluster-cidr`."""
    name = f"{entry.namespace}/{entry.name}" + (f":{entry.port}" if entry.port else "")
    identity = name + entry.protocol
    proto = entry.protocol.lower()
    match = f"-m {proto} -p {proto}"
    svc, svl = kp_chain("SVC", identity), kp_chain("SVL", identity)
    ext, fw = kp_chain("EXT", identity), kp_chain("FW", identity)
    cluster = entry.cluster_backends or ()
    local = entry.local_backends or ()
    affinity = entry.affinity_timeout
    mask = "255.255.255.255" if entry.ip_family == "IPv4" else "ffff:" * 7 + "ffff"

    def sep(backend: Any) -> str:
        return kp_chain("SEP", f"{identity}{backend.ip}:{backend.port}")

    def endpoint_address(backend: Any) -> str:
        return (
            f"[{backend.ip}]:{backend.port}"
            if ":" in backend.ip
            else (f"{backend.ip}:{backend.port}")
        )

    chains: dict[str, tuple[str, ...]] = {}
    nat_services: list[str] = []
    nodeports: list[str] = []
    filter_services: list[str] = []
    filter_external: list[str] = []
    filter_nodeports: list[str] = []
    firewall: list[str] = []
    node_ports_seen: set[int] = set()

    def balance(chain: str, backends: Sequence[Any], first: list[str]) -> None:
        rules = list(first)
        if affinity is not None:
            for b in backends:
                rules.append(f'-A {chain} -m comment --comment "{name} -> {endpoint_address(b)}" '
                             f"-m recent --name {sep(b)} --mask {mask} --rsource --rcheck "
                             f"--seconds {affinity} --reap -j {sep(b)}")  # fmt: skip
        for i, b in enumerate(backends):
            split = ""
            if i < len(backends) - 1:
                share = 1.0 / (len(backends) - i)
                split = f"-m statistic --mode random --probability {share:.10f} "
            rules.append(f'-A {chain} -m comment --comment "{name} -> {endpoint_address(b)}" '
                         f"{split}-j {sep(b)}")  # fmt: skip
        chains[chain] = tuple(rules)
        for b in backends:
            if sep(b) in chains:
                continue
            host = b.ip
            recent = f"-m recent --name {sep(b)} --mask {mask} --rsource --set " if affinity else ""
            chains[sep(b)] = (
                f"-A {sep(b)} -m comment --comment {name} -s {host} -j {KP_MARK_MASQ}",
                f"-A {sep(b)} -m comment --comment {name} {recent}{match} -j DNAT "
                f"--to-destination {endpoint_address(b)}",
            )

    externals = [f for f in entry.frontends if f.type != CLUSTER_IP]
    external_local = entry.external_traffic_policy == "Local"
    external_backends = local if external_local else cluster
    for frontend in entry.frontends:
        dest = f"-d {frontend.ip} --dport {frontend.port}"
        if frontend.type == CLUSTER_IP:
            internal_local = entry.internal_traffic_policy == "Local"
            usable = local if internal_local else cluster
            comment = f'-m comment --comment "{name} cluster IP"'
            if usable:
                target = svl if internal_local else svc
                nat_services.append(f"-A {KP_SERVICES} {comment} {match} {dest} -j {target}")
            elif not entry.has_endpoints:
                filter_services.append(f'-A {KP_SERVICES} -m comment --comment "{name} has no '
                                       f'endpoints" {match} {dest} -j REJECT')  # fmt: skip
            else:
                filter_services.append(f'-A {KP_SERVICES} -m comment --comment "{name} has no '
                                       f'local endpoints" {match} {dest} -j DROP')  # fmt: skip
            continue
        if frontend.type == NODE_PORT:
            # kube-proxy matches the port on any local address: one rule per port, where
            # NodeState lists a frontend per node address
            if frontend.port in node_ports_seen:
                continue
            node_ports_seen.add(frontend.port)
            rule = f"-m comment --comment {name} {match} --dport {frontend.port}"
            if cluster or local:
                nodeports.append(f"-A {KP_NODEPORTS} {rule} -j {ext}")
            if not entry.has_endpoints:
                filter_external.append(f"-A {KP_EXTERNAL} -m comment --comment \"{name} has no "
                                       f"endpoints\" -m addrtype --dst-type LOCAL {match} "
                                       f"--dport {frontend.port} -j REJECT")  # fmt: skip
            elif not external_backends:
                filter_external.append(f"-A {KP_EXTERNAL} -m comment --comment \"{name} has no "
                                       f"local endpoints\" -m addrtype --dst-type LOCAL {match} "
                                       f"--dport {frontend.port} -j DROP")  # fmt: skip
            continue
        label = "external IP" if frontend.type == EXTERNAL_IP else "loadbalancer IP"
        comment = f'-m comment --comment "{name} {label}"'
        ranged = frontend.type == LOAD_BALANCER and bool(frontend.source_ranges)
        if cluster or local:
            nat_services.append(f"-A {KP_SERVICES} {comment} {match} {dest} "
                                f"-j {fw if ranged else ext}")  # fmt: skip
        if not entry.has_endpoints:
            filter_external.append(f'-A {KP_EXTERNAL} -m comment --comment "{name} has no '
                                   f'endpoints" {match} {dest} -j REJECT')  # fmt: skip
        elif not external_backends:
            filter_external.append(f'-A {KP_EXTERNAL} -m comment --comment "{name} has no '
                                   f'local endpoints" {match} {dest} -j DROP')  # fmt: skip
        if ranged:
            firewall.append(f"-A {KP_FIREWALL} {comment} {match} {dest} -j DROP")
            if cluster or local:
                # what no range allows leaves untranslated: KUBE-PROXY-FIREWALL drops it
                chains[fw] = tuple(
                    f"-A {fw} {comment} -s {cidr} -j {ext}" for cidr in frontend.source_ranges
                )
    if entry.health_check_node_port:
        filter_nodeports.append(f'-A {KP_NODEPORTS} -m comment --comment "{name} health check '
                                f'node port" -m tcp -p tcp --dport {entry.health_check_node_port} '
                                "-j ACCEPT")  # fmt: skip

    if cluster:
        masq = []
        if cluster_cidr:
            for f in entry.frontends:
                if f.type == CLUSTER_IP:
                    masq.append(
                        f'-A {svc} -m comment --comment "{name} cluster IP" {match} '
                        f"-d {f.ip} --dport {f.port} ! -s {cluster_cidr} -j {KP_MARK_MASQ}"
                    )
        balance(svc, cluster, masq)
    if local:
        balance(svl, local, [])
    if externals and (cluster or local):
        rules = []
        if not external_local:
            rules.append(f'-A {ext} -m comment --comment "masquerade traffic for {name} '
                         f'external destinations" -j {KP_MARK_MASQ}')  # fmt: skip
            rules.append(f"-A {ext} -j {svc}")
        else:
            if cluster_cidr and cluster:
                rules.append(f'-A {ext} -m comment --comment "pod traffic for {name} external '
                             f'destinations" -s {cluster_cidr} -j {svc}')  # fmt: skip
            if cluster:
                rules.append(f'-A {ext} -m comment --comment "masquerade LOCAL traffic for '
                             f'{name} external destinations" -m addrtype --src-type LOCAL '
                             f"-j {KP_MARK_MASQ}")  # fmt: skip
                rules.append(
                    f'-A {ext} -m comment --comment "route LOCAL traffic for {name} '
                    f'external destinations" -m addrtype --src-type LOCAL -j {svc}'
                )
            if local:
                rules.append(f"-A {ext} -j {svl}")
        chains[ext] = tuple(rules)
    return KubeProxyEntry(tuple(nat_services), tuple(nodeports), tuple(filter_services),
                          tuple(filter_external), tuple(filter_nodeports), tuple(firewall),
                          chains)  # fmt: skip


@dataclass
class KubeProxyDocument:
    text: str
    rules: int  # -A lines
    chains: int  # chains declared (flushed or created)
    deleted: int


def kube_proxy_document(
    everything: Iterable[KubeProxyEntry],
    rewritten: Iterable[KubeProxyEntry],
    deleted_chains: Iterable[str] = (),
) -> KubeProxyDocument:
    """kube-proxy's restore input: the filter table and the nat top-level chains from every
    entry, the per-Service chains of `rewritten` (all of them on a full sync), deletes."""
    f_services: list[str] = []
    f_external: list[str] = []
    f_nodeports: list[str] = []
    f_firewall: list[str] = []
    n_services: list[str] = []
    n_nodeports: list[str] = []
    for e in everything:
        f_services += e.filter_services
        f_external += e.filter_external
        f_nodeports += e.filter_nodeports
        f_firewall += e.filter_firewall
        n_services += e.nat_services
        n_nodeports += e.nat_nodeports
    n_services.append(f'-A {KP_SERVICES} -m comment --comment "kubernetes service nodeports; '
                      'NOTE: this must be the last rule in this chain" -m addrtype --dst-type '
                      f"LOCAL -j {KP_NODEPORTS}")  # fmt: skip
    forward = (
        f'-A {KP_FORWARD} -m comment --comment "kubernetes forwarding rules" -m mark --mark '
        f"{KP_MASQ_BIT}/{KP_MASQ_BIT} -j ACCEPT",
        f'-A {KP_FORWARD} -m comment --comment "kubernetes forwarding conntrack rule" '
        "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    )
    nat_top = (
        f"-A {KP_POSTROUTING} -m mark ! --mark {KP_MASQ_BIT}/{KP_MASQ_BIT} -j RETURN",
        f"-A {KP_POSTROUTING} -j MARK --xor-mark {KP_MASQ_BIT}",
        f'-A {KP_POSTROUTING} -m comment --comment "kubernetes service traffic requiring SNAT" '
        "-j MASQUERADE --random-fully",
        f"-A {KP_MARK_MASQ} -j MARK --or-mark {KP_MASQ_BIT}",
    )
    declared = list(KP_NAT_TOP)
    body: list[str] = []
    for e in rewritten:
        for chain, rules in e.chains.items():
            declared.append(chain)
            body += rules
    deleted = sorted(set(deleted_chains))
    filter_rules = [*f_services, *f_external, *f_nodeports, *forward, *f_firewall]
    lines = ["*filter", *(f":{c} - [0:0]" for c in KP_FILTER_TOP), *filter_rules, "COMMIT",
             "*nat", *(f":{c} - [0:0]" for c in declared), *(f":{c} - [0:0]" for c in deleted),
             *nat_top, *n_services, *n_nodeports, *body, *(f"-X {c}" for c in deleted),
             "COMMIT", ""]  # fmt: skip
    rules = len(filter_rules) + len(nat_top) + len(n_services) + len(n_nodeports) + len(body)
    return KubeProxyDocument("\n".join(lines), rules, len(declared) + len(KP_FILTER_TOP),
                             len(deleted))  # fmt: skip


class KubeProxyFloor:
    """kube-proxy's view of a NodeState, kept across changes like its partial sync."""

    def __init__(self, cluster_cidr: str | None) -> None:
        self.cidr = cluster_cidr
        self.entries: dict[tuple[str, ...], ServiceEntry] = {}
        self.rules: dict[tuple[str, ...], KubeProxyEntry] = {}

    def full(self, state: NodeState) -> KubeProxyDocument:
        self.entries = {e.sort_key: e for e in state.services if e.ip_family == "IPv4"}
        self.rules = {k: kube_proxy_entry(e, self.cidr) for k, e in self.entries.items()}
        return kube_proxy_document(self.rules.values(), self.rules.values())

    def partial(self, state: NodeState) -> KubeProxyDocument:
        entries = {e.sort_key: e for e in state.services if e.ip_family == "IPv4"}
        rules: dict[tuple[str, ...], KubeProxyEntry] = {}
        rewritten: list[KubeProxyEntry] = []
        before: set[str] = set()
        for key, entry in entries.items():
            old = self.entries.get(key)
            if old is not None and old.digest == entry.digest:
                rules[key] = self.rules[key]
                continue
            rules[key] = kube_proxy_entry(entry, self.cidr)
            rewritten.append(rules[key])
            if old is not None:
                before.update(self.rules[key].chains)
        for key in self.entries.keys() - entries.keys():
            before.update(self.rules[key].chains)
        after = {c for r in rewritten for c in r.chains}
        self.entries, self.rules = entries, rules
        return kube_proxy_document(rules.values(), rewritten, before - after)


# --- our dataplane, its subprocesses timed ------------------------------------------------


@dataclass
class Call:
    tool: str
    seconds: float
    stdin: str | None


class Calls:
    """Every subprocess the iptables dataplane runs, timed (wraps the module's `_run`)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[Calls]:
        original = iptables_module._run

        def timed(netns: str | None, argv: Sequence[str], stdin: str | None = None) -> Any:
            start = time.perf_counter()
            try:
                return original(netns, argv, stdin)
            finally:
                self.calls.append(Call(argv[0], time.perf_counter() - start, stdin))

        self.calls = []
        with mock.patch.object(iptables_module, "_run", timed):
            yield self

    def seconds(self, kind: str) -> float:
        return sum(c.seconds for c in self.calls if tool_kind(c.tool) == kind)

    def count(self, kind: str) -> int:
        return sum(1 for c in self.calls if tool_kind(c.tool) == kind)

    def restore_inputs(self, family: str = "IPv4") -> list[str]:
        tool = iptables_module.choose_backend("auto")[0].restore(family)  # while patched in
        return [c.stdin for c in self.calls if c.tool == tool and c.stdin is not None]


def tool_kind(tool: str) -> str:
    if tool.endswith("-restore"):
        return "restore"
    if tool.endswith("-save"):
        return "save"
    return "other"  # iptables -C/-I (jump rules), conntrack


def timed_apply(dp: IptablesDataplane, state: NodeState, full: bool = False) -> tuple[float, Calls]:
    calls = Calls()
    gc.collect()
    with calls.recording():
        start = time.perf_counter()
        dp.apply(state, full=full)
        took = time.perf_counter() - start
    return took, calls


def declared_chains(document: str) -> tuple[set[str], set[str]]:
    """(chains declared in *nat, chains deleted with -X) of a restore input."""
    declared: set[str] = set()
    deleted: set[str] = set()
    table = ""
    for line in document.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif table == "nat" and line.startswith(":"):
            declared.add(line[1:].split(" ", 1)[0])
        elif table == "nat" and line.startswith("-X "):
            deleted.add(line[3:].strip())
    return declared, deleted


def expected_chains(
    old: NodeState, new: NodeState, options: iptables_render.RenderOptions
) -> tuple[set[str], set[str]]:
    """The nat chains a partial sync from `old` to `new` must declare (the top-level ones,
    the changed entries' chains, the stale ones) and delete (the stale ones)."""
    before = {e.sort_key: e for e in old.services if e.ip_family == options.family}
    after = {e.sort_key: e for e in new.services if e.ip_family == options.family}
    written: set[str] = set()
    previous: set[str] = set()
    for key, entry in after.items():
        was = before.get(key)
        if was is None or was.digest != entry.digest:
            written.update(iptables_render.entry_rules(entry, options).chains)
            if was is not None:
                previous.update(iptables_render.entry_rules(was, options).chains)
    for key in before.keys() - after.keys():
        previous.update(iptables_render.entry_rules(before[key], options).chains)
    stale = previous - written
    return set(iptables_render.NAT_BASE_CHAINS) | written | stale, stale


def rules_per_chain(text: str, prefix: str = "") -> dict[str, dict[str, int]]:
    """table → chain → its rule count, of a restore input or `iptables-save` output
    (chains starting with `prefix` only; empty chains included)."""
    out: dict[str, dict[str, int]] = {}
    table: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("*"):
            table = out.setdefault(line[1:], {})
        elif line.startswith(":" + prefix):
            table.setdefault(line[1:].split(" ", 1)[0], 0)
        elif line.startswith("-A " + prefix):
            chain = line.split(" ", 2)[1]
            table[chain] = table.get(chain, 0) + 1
    return out


def kernel_rules_per_chain(ns: str, backend: Backend) -> dict[str, dict[str, int]]:
    """table → KBP- chain → its rule count, as the kernel reports them (iptables-save)."""
    out: dict[str, dict[str, int]] = {}
    for table in ("nat", "filter"):
        _, text = run_tool(ns, [backend.save["IPv4"], "-t", table])
        out[table] = rules_per_chain(text, "KBP-").get(table, {})
    return out


# --- one size, one backend ----------------------------------------------------------------


@dataclass
class Workload:
    services: int
    cluster: Any  # bench.common.workload.Cluster
    state: Any  # ClusterState, advanced by each change
    compiler: Compiler
    nodestate: NodeState
    options: iptables_render.RenderOptions


def workload(services: int, directory: Path) -> Workload:
    cluster = generate(services, directory)
    state, _ = load_manifests([cluster.path])
    state.take_changes()
    compiler = Compiler(THIS_NODE, CompileOptions(cluster_cidrs=(POD_CIDR,)))
    nodestate = compiler.full(state)
    # What the dataplane derives for IPv4 from the NodeState and its default interfaces.
    options = iptables_render.RenderOptions(
        "IPv4", (POD_CIDR,), iptables_render.interface_patterns(DEFAULT_POD_INTERFACES)
    )
    return Workload(services, cluster, state, compiler, nodestate, options)


@dataclass
class PartialTimes:
    ours: list[float] = field(default_factory=list)
    ours_restore: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)
    ours_rules: list[int] = field(default_factory=list)
    floor_rules: list[int] = field(default_factory=list)
    only_changed: list[bool] = field(default_factory=list)
    chains_declared: list[int] = field(default_factory=list)
    compile: list[float] = field(default_factory=list)


@dataclass
class Result:
    services: int
    backend: str
    entries: int
    sizes: dict[str, Any]
    full: dict[str, Summary]
    restart: dict[str, Summary]
    resync: dict[str, Summary]
    partial: dict[str, PartialTimes]
    full_rules: dict[str, int]
    consistent: bool | None
    save_seconds: float | None
    kube_proxy_order: Summary | None  # reference: the floor's rules in kube-proxy's order
    cleanup_seconds: float | None


STEPS = ("full", "restart", "partial", "cleanup")


def descending_declarations(document: str) -> str:
    """The same restore input with each table's chain declarations in descending name
    order: iptables-nft 1.8.9 keeps user chains in a list sorted by name and inserts each
    new one by walking it from the head, so this order is the fastest restore of the same
    rules (the floor); kube-proxy's own order (its Service map's) costs O(chains²)."""
    out: list[str] = []
    declarations: list[str] = []
    for line in document.split("\n"):
        if line.startswith(":"):
            declarations.append(line)
            continue
        if declarations:
            out.extend(sorted(declarations, reverse=True))
            declarations = []
        out.append(line)
    return "\n".join(out)


def measure(w: Workload, backend: Backend, repeat: int, per_kind: int,
            steps: Sequence[str]) -> Result:  # fmt: skip
    """Full, restart, resync and partial syncs of one workload with one backend."""
    print(f"\n# {w.services} Services x {ENDPOINTS}, {backend.name}: {repeat} full syncs each, "
          f"{per_kind} changes per kind; steps {', '.join(steps)}", flush=True)  # fmt: skip
    floor = KubeProxyFloor(POD_CIDR)
    kp_full = floor.full(w.nodestate)
    floor_text = descending_declarations(kp_full.text)
    ours_text = iptables_render.render(w.nodestate.services, w.options)
    ours_doc_rules = sum(1 for line in ours_text.splitlines() if line.startswith("-A "))
    sizes = {
        "ours_rules": ours_doc_rules,
        "ours_chains": ours_text.count("\n:"),
        "ours_bytes": len(ours_text.encode()),
        "floor_rules": kp_full.rules,
        "floor_chains": kp_full.chains,
        "floor_bytes": len(kp_full.text.encode()),
    }
    print(f"  restore input: ours {ours_doc_rules:,} rules in {sizes['ours_chains']:,} chains, "
          f"{sizes['ours_bytes'] / 2**20:.1f} MiB; kube-proxy equivalent {kp_full.rules:,} rules "
          f"in {kp_full.chains:,} chains, {sizes['floor_bytes'] / 2**20:.1f} MiB",
          flush=True)  # fmt: skip
    samples: dict[str, list[float]] = {k: [] for k in (
        "floor", "ours", "render", "restore", "save", "other", "python")}  # fmt: skip
    restart: dict[str, list[float]] = {"floor": [], "ours": [], "save": [], "restore": []}
    resync: dict[str, list[float]] = {"ours": [], "save": [], "other": []}
    partial: dict[str, PartialTimes] = {}
    full_rules: dict[str, int] = {}
    consistent: bool | None = None
    save_seconds: float | None = None
    kube_proxy_order: Summary | None = None
    cleanup_seconds: float | None = None
    with backend.for_dataplane(), contextlib.ExitStack() as keep:
        floor_ns = ours_ns = ""
        dp: IptablesDataplane | None = None
        for r in range(repeat):
            last = r == repeat - 1
            # The floor and ours alternate; the last pair of namespaces stays for the rest.
            with contextlib.ExitStack() as scope:
                owner = keep if last else scope
                floor_ns = owner.enter_context(scratch_netns(backend))
                gc.collect()
                samples["floor"].append(restore(floor_ns, backend, floor_text))
                add_kube_proxy_jumps(floor_ns, backend)
                ours_ns = owner.enter_context(scratch_netns(backend))
                gc.collect()
                start = time.perf_counter()
                iptables_render.render(w.nodestate.services, w.options)
                samples["render"].append(time.perf_counter() - start)
                dp = IptablesDataplane(netns=ours_ns)
                took, calls = timed_apply(dp, w.nodestate)
                samples["ours"].append(took)
                for kind in ("restore", "save", "other"):
                    samples[kind].append(calls.seconds(kind))
                samples["python"].append(took - sum(c.seconds for c in calls.calls))
                full_rules = dict(dp.last_writes)
            print(f"  full {r + 1}/{repeat}: floor {fmt_s(samples['floor'][-1])}, ours "
                  f"{fmt_s(samples['ours'][-1])} (restore {fmt_s(samples['restore'][-1])}, "
                  f"save {fmt_s(samples['save'][-1])}, {calls.count('restore')} restores, "
                  f"{calls.count('other')} iptables calls {fmt_s(samples['other'][-1])})",
                  flush=True)  # fmt: skip
        assert dp is not None
        if w.services <= KP_ORDER_MAX:  # the reference: kube-proxy's order, once
            with scratch_netns(backend) as ns:
                gc.collect()
                kube_proxy_order = Summary([restore(ns, backend, kp_full.text)])
            print(f"  reference, the floor's rules in kube-proxy's order: "
                  f"{fmt_s(kube_proxy_order.median)}", flush=True)  # fmt: skip
        del ours_text

        if "restart" in steps:  # restart and periodic resync, over the rules already there
            for _ in range(max(1, repeat - 1)):
                gc.collect()
                restart["floor"].append(restore(floor_ns, backend, floor_text))
                again = IptablesDataplane(netns=ours_ns)
                took, calls = timed_apply(again, w.nodestate)
                restart["ours"].append(took)
                restart["save"].append(calls.seconds("save"))
                restart["restore"].append(calls.seconds("restore"))
                took, calls = timed_apply(again, w.nodestate, full=True)
                resync["ours"].append(took)
                resync["save"].append(calls.seconds("save"))
                resync["other"].append(calls.seconds("other"))
                dp = again
            save_seconds, _ = run_tool(floor_ns, [backend.save["IPv4"], "-t", "nat"])
            print(f"  restart: floor {fmt_s(restart['floor'][-1])}, ours "
                  f"{fmt_s(restart['ours'][-1])} (iptables-save {fmt_s(restart['save'][-1])}); "
                  f"resync with nothing changed {fmt_s(resync['ours'][-1])}",
                  flush=True)  # fmt: skip

        current = w.nodestate
        if "partial" in steps:  # one change at a time, ours and the floor in their namespaces
            for change in make_changes(w.cluster, per_kind):
                times = partial.setdefault(change.kind, PartialTimes())
                new, compile_s = recompile(w, change)
                expected, expected_deleted = expected_chains(current, new, w.options)
                took, calls = timed_apply(dp, new)
                times.ours.append(took)
                times.ours_restore.append(calls.seconds("restore"))
                times.ours_rules.append(sum(dp.last_writes.values()))
                documents = calls.restore_inputs()
                declared, deleted = declared_chains(documents[0]) if documents else (set(), set())
                times.only_changed.append(declared == expected and deleted == expected_deleted)
                times.chains_declared.append(len(declared))
                times.compile.append(compile_s)
                kp_partial = floor.partial(new)
                gc.collect()
                times.floor.append(
                    restore(floor_ns, backend, descending_declarations(kp_partial.text))
                )
                times.floor_rules.append(kp_partial.rules)
                current = new
                print(f"  {change.kind}: ours {fmt_s(took)}, floor {fmt_s(times.floor[-1])}",
                      flush=True)  # fmt: skip
            w.nodestate = current

        # The kernel holds what a fresh render of the final state says, chain by chain.
        kernel = kernel_rules_per_chain(ours_ns, backend)
        rendered = rules_per_chain(iptables_render.render(current.services, w.options))
        consistent = all(kernel[t] == rendered.get(t) for t in ("nat", "filter"))
        if "cleanup" in steps:  # `kube-bpf-proxy cleanup` on this node: every KBP- chain
            gc.collect()
            start = time.perf_counter()
            iptables_module.cleanup(ours_ns)
            cleanup_seconds = time.perf_counter() - start
            print(f"  cleanup(): {fmt_s(cleanup_seconds)}", flush=True)
    return Result(
        w.services, backend.name, len(w.nodestate.services), sizes,
        {k: Summary(v) for k, v in samples.items()},
        {k: Summary(v) for k, v in restart.items() if v},
        {k: Summary(v) for k, v in resync.items() if v},
        partial, full_rules, consistent, save_seconds, kube_proxy_order, cleanup_seconds,
    )  # fmt: skip


def recompile(w: Workload, change: Change) -> tuple[NodeState, float]:
    start = time.perf_counter()
    values = [decode_object(json.loads(text)).value for text in change.texts]
    change.apply_to_state(w.state, values)
    new = w.compiler.update(w.state)
    return new, time.perf_counter() - start


def profile_full(w: Workload, out: Path) -> None:
    """cProfile of the Python side of one full sync: `apply` into nothing, its
    subprocesses replaced by instant successes (the kernel's share is in the figures)."""

    def instant(netns: str | None, argv: Sequence[str], stdin: str | None = None) -> Any:
        return subprocess.CompletedProcess(list(argv), 0, "", "")

    dp = IptablesDataplane(netns="kbp-bench-nowhere")
    profiler = cProfile.Profile()
    gc.collect()
    with mock.patch.object(iptables_module, "_run", instant):
        start = time.perf_counter()
        profiler.enable()
        dp.apply(w.nodestate)
        profiler.disable()
        took = time.perf_counter() - start
    text = io.StringIO()
    text.write(f"IptablesDataplane.apply, full sync of {w.services} Services x {ENDPOINTS}, "
               f"subprocesses stubbed: {took:.2f} s under the profiler\n")  # fmt: skip
    for order in ("tottime", "cumulative"):
        stats = pstats.Stats(profiler, stream=text)
        text.write(f"\n=== top 25 by {order} ===\n")
        stats.sort_stats(order).print_stats(25)
    path = out / f"iptables_sync-profile-{w.services}x{ENDPOINTS}.txt"
    path.write_text(text.getvalue())
    profiler.dump_stats(path.with_suffix(".prof"))
    print(f"  profile of the Python side ({took:.2f} s under cProfile): {path}", flush=True)


# --- report --------------------------------------------------------------------------------


def ratio_text(ours: float, floor: float) -> str:
    r = ours / floor
    return f"{r:.2f}x ≤ {TARGET_RATIO}x {mark(r <= TARGET_RATIO)}"


def row(label: str, s: Summary, extra: str = "", width: int = 50) -> str:
    spread = f"{fmt_s(min(s.samples))}-{fmt_s(max(s.samples))}"
    return (f"{label:<{width}} {fmt_s(s.median):>9} {fmt_s(s.p99):>9} {spread:>21} "
            f"{len(s.samples):>3}  {extra}")  # fmt: skip


def print_result(r: Result) -> dict[str, Any]:
    print(f"\n## {r.services} Services x {ENDPOINTS} endpoints ({r.entries} NodeState entries), "
          f"backend {r.backend}")  # fmt: skip
    head = f"{'':<50} {'median':>9} {'p99/max':>9} {'min-max':>21} {'n':>3}  ours / floor"
    print(head)
    print("-" * len(head))
    f = r.full
    full_ratio = f["ours"].median / f["floor"].median
    print(row("floor: kube-proxy-equivalent restore, fresh ns", f["floor"]))
    print(row("ours: IptablesDataplane.apply, fresh ns", f["ours"],
              ratio_text(f["ours"].median, f["floor"].median)))  # fmt: skip
    print(row("  render alone (Python, render.render IPv4)", f["render"],
              f"{f['render'].median / f['ours'].median:.0%} of ours"))  # fmt: skip
    print(row("  iptables-restore processes (all)", f["restore"],
              f"{f['restore'].median / f['floor'].median:.2f}x the floor's restore"))  # fmt: skip
    print(row("  iptables-save processes", f["save"]))
    print(row("  other processes (iptables -C/-I)", f["other"]))
    print(row("  Python (apply minus subprocesses)", f["python"]))
    if r.kube_proxy_order is not None:
        order = r.kube_proxy_order
        print(row("reference: the floor's rules, kube-proxy's order", order,
                  f"ours is {f['ours'].median / order.median:.2f}x this"))  # fmt: skip
    report: dict[str, Any] = {
        "services": r.services, "backend": r.backend, "entries": r.entries,
        "restore_input": r.sizes,
        "full": {k: s.to_json() for k, s in r.full.items()},
        "full_ratio": full_ratio, "full_mark": mark(full_ratio <= TARGET_RATIO),
        "full_rules_written": r.full_rules,
        "kube_proxy_order": r.kube_proxy_order.to_json() if r.kube_proxy_order else None,
        "consistent": r.consistent,
        "cleanup_s": r.cleanup_seconds,
    }  # fmt: skip
    rs = r.restart
    if rs:
        print(row("restart floor: the same restore over its rules", rs["floor"]))
        print(row("restart ours: new dataplane over its rules", rs["ours"],
                  ratio_text(rs["ours"].median, rs["floor"].median)))  # fmt: skip
        print(row("  of which iptables-save", rs["save"]))
        print(row("  of which restore", rs["restore"]))
        print(row("resync, nothing changed (full=True, < 1 h)", r.resync["ours"],
                  f"jump checks: iptables-save {fmt_s(r.resync['save'].median)}, "
                  f"iptables {fmt_s(r.resync['other'].median)}"))  # fmt: skip
        label = "(reference: iptables-save -t nat of the floor's rules)"
        print(f"{label:<50} {fmt_s(r.save_seconds or 0.0):>9}")
        report.update({
            "restart": {k: s.to_json() for k, s in rs.items()},
            "restart_ratio": rs["ours"].median / rs["floor"].median,
            "resync_nothing_changed": {k: s.to_json() for k, s in r.resync.items()},
            "iptables_save_nat_s": r.save_seconds,
        })  # fmt: skip
    if r.cleanup_seconds is not None:
        label = "cleanup(): every KBP- chain removed"
        print(f"{label:<50} {fmt_s(r.cleanup_seconds):>9}")
    if r.partial:
        report.update(print_partial(r))
    print(f"kernel chains and rules per chain equal a fresh render of the final state: "
          f"{'yes' if r.consistent else 'NO'}")  # fmt: skip
    return report


def print_partial(r: Result) -> dict[str, Any]:
    full_written = sum(r.full_rules.values())
    print(f"\npartial syncs (one change each; ours = apply, floor = KEP-3453 partial restore); "
          f"full sync wrote {full_written:,} rules")  # fmt: skip
    head = (f"{'change':<18} {'ours p50':>9} {'p99/max':>9} {'min-max':>21} {'floor p50':>9} "
            f"{'p99/max':>9}  {'ratio':<18} {'rules ours/floor':>17} {'of full':>8} "
            f"{'chains':>6}  only changed")  # fmt: skip
    print(head)
    print("-" * len(head))
    partial_report: dict[str, Any] = {}
    all_ours: list[float] = []
    all_floor: list[float] = []
    for kind, t in r.partial.items():
        ours, floor = Summary(t.ours), Summary(t.floor)
        all_ours += t.ours
        all_floor += t.floor
        rules = sorted(t.ours_rules)[len(t.ours_rules) // 2]
        floor_rules = sorted(t.floor_rules)[len(t.floor_rules) // 2]
        chains = sorted(t.chains_declared)[len(t.chains_declared) // 2]
        only = all(t.only_changed)
        spread = f"{fmt_s(min(ours.samples))}-{fmt_s(max(ours.samples))}"
        print(
            f"{kind:<18} {fmt_s(ours.median):>9} {fmt_s(ours.p99):>9} {spread:>21} "
            f"{fmt_s(floor.median):>9} {fmt_s(floor.p99):>9}  "
            f"{ratio_text(ours.median, floor.median):<18} {rules:>8,}/{floor_rules:<8,} "
            f"{rules / max(1, full_written):>7.1%} {chains:>6}  "
            f"{'yes' if only else 'NO'} ({sum(t.only_changed)}/{len(t.only_changed)})"
        )
        partial_report[kind] = {
            "ours": ours.to_json(), "floor": floor.to_json(),
            "ours_restore": Summary(t.ours_restore).to_json(),
            "compile": Summary(t.compile).to_json(),
            "ratio": ours.median / floor.median,
            "mark": mark(ours.median / floor.median <= TARGET_RATIO),
            "rules_written_median": rules, "floor_rules_median": floor_rules,
            "nat_chains_declared_median": chains, "only_changed_chains": only,
        }  # fmt: skip
    ours_all, floor_all = Summary(all_ours), Summary(all_floor)
    print(f"{'all changes':<18} {fmt_s(ours_all.median):>9} {fmt_s(ours_all.p99):>9} "
          f"{'':>21} {fmt_s(floor_all.median):>9} {fmt_s(floor_all.p99):>9}  "
          f"{ratio_text(ours_all.median, floor_all.median)}")  # fmt: skip
    return {
        "partial": partial_report,
        "partial_all": {"ours": ours_all.to_json(), "floor": floor_all.to_json(),
                        "ratio": ours_all.median / floor_all.median,
                        "mark": mark(ours_all.median / floor_all.median <= TARGET_RATIO)},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="PB-9: the iptables dataplane's full and partial sync vs a "
        "kube-proxy-equivalent iptables-restore (not a test; always exits 0)."
    )
    parser.add_argument("--quick", action="store_true", help="1k Services only, < 1 minute")
    parser.add_argument("--services", type=int, nargs="+", metavar="N",
                        help="sizes (default 1000 10000; quick: 1000)")  # fmt: skip
    parser.add_argument("--backends", nargs="+", choices=sorted(BACKENDS),
                        default=["nft", "legacy"])  # fmt: skip
    parser.add_argument(
        "--nft-max",
        type=int,
        default=NFT_MAX_DEFAULT,
        metavar="N",
        help="skip the nft backend above N Services: its restore time grows "
        f"with the square of the chain count (default {NFT_MAX_DEFAULT})",
    )
    parser.add_argument(
        "--steps",
        nargs="+",
        choices=STEPS,
        default=list(STEPS),
        help="what to measure after the full syncs (default all)",
    )
    parser.add_argument("--repeat", type=int, help="full syncs per size (default 5 at 1k, 3 "
                        "at 10k; quick 2)")  # fmt: skip
    parser.add_argument("--changes", type=int, help="changes per kind (default 10, 5 from "
                        "10k; quick 3)")  # fmt: skip
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also cProfile the Python side of a full sync per size",
    )
    parser.add_argument("--json", type=Path, help="results file (default bench/results/...)")
    args = parser.parse_args(argv)
    sizes = args.services or ([1000] if args.quick else [1000, 10_000])

    terminate_as_interrupt()
    info = machine()
    info["iptables"] = {name: BACKENDS[name].version() for name in args.backends}
    header("bench/iptables_sync.py (PB-9)", info,
           "; " + "; ".join(f"{k}: {v}" for k, v in info["iptables"].items()))  # fmt: skip
    print(f"reference: {REF_PB9}")
    began = time.perf_counter()
    report: list[dict[str, Any]] = []
    skipped: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="kbp-bench-") as tmp:
            for n in sizes:
                started = time.perf_counter()
                w = workload(n, Path(tmp))
                print(f"\n# {n} Services x {ENDPOINTS}: generated and compiled in "
                      f"{time.perf_counter() - started:.1f} s", flush=True)  # fmt: skip
                if args.profile:
                    profile_full(w, RESULTS)
                first = w.nodestate
                for name in args.backends:
                    if name == "nft" and n > args.nft_max:
                        skipped.append(f"nft at {n} (--nft-max {args.nft_max})")
                        continue
                    w.nodestate = first  # every backend starts from the same state
                    w.state, _ = load_manifests([w.cluster.path])
                    w.state.take_changes()
                    w.compiler.full(w.state)
                    repeat = args.repeat or (2 if args.quick else 3 if n >= 10_000 else 5)
                    per_kind = args.changes or (3 if args.quick else 5 if n >= 10_000 else 10)
                    result = measure(w, BACKENDS[name], repeat, per_kind, args.steps)
                    report.append(print_result(result))
                w.cluster.path.unlink()
    except KeyboardInterrupt:
        print(f"\ninterrupted; cleaned up (left over: {leftovers() or 'nothing'})")
        return 130

    print(f"\n## targets (bench/README.md PB-9: ≤ {TARGET_RATIO}x the equivalent restore; partial "
          f"updates write only changed chains); anchors: {REF_PB9}")  # fmt: skip
    for e in report:
        text = f"{e['services']:>6} Services, {e['backend']:<6}: full {e['full_ratio']:.2f}x "
        text += e["full_mark"]
        if "partial" in e:
            only = all(k["only_changed_chains"] for k in e["partial"].values())
            text += (f"; partial (all changes) {e['partial_all']['ratio']:.2f}x "
                     f"{e['partial_all']['mark']}; only changed chains: "
                     f"{'yes' if only else 'NO'}")  # fmt: skip
        if "restart_ratio" in e:
            text += f"; restart {e['restart_ratio']:.2f}x"
        print(f"{text}; consistent: {'yes' if e['consistent'] else 'NO'}")
    for what in skipped:
        print(f"skipped: {what}")
    seconds = time.perf_counter() - began
    out = results_path(args, "iptables_sync")
    write_results(out, {
        "benchmark": "bench/iptables_sync.py",
        "id": "PB-9",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": args.quick,
        "machine": info,
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        "endpoints_per_service": ENDPOINTS,
        "pod_cidr": POD_CIDR,
        "target_ratio": TARGET_RATIO,
        "steps": args.steps,
        "sizes": report,
        "skipped": skipped,
        "reference": REF_PB9,
        "duration_s": seconds,
    })  # fmt: skip
    print(f"\nran in {seconds:.0f} s (load average now {os.getloadavg()[0]:.2f}); results in "
          f"{out}; left over: {leftovers() or 'nothing'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
