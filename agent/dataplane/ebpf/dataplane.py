"""`--dataplane ebpf`: programs the NodeState into the pinned maps of the tc datapath and
keeps the programs attached to every pod interface, and to the node's external
interfaces (tc, plus XDP where it can be attached) for traffic from outside.

A thin facade over the two halves: the map writer (writer.py: plan, writes, conntrack,
metrics) and the interface attacher (attach.py: which interfaces get which programs,
netlink, XDP, the socket hooks, taking over from an earlier agent's programs). Start-up
compiles the C programs (bcc), opens or creates the pins, lets the writer read what the
maps hold (a restarted agent adopts the previous agent's ids and sets, and reports the
revision kbp_meta names) and the attacher attach and watch netlink for new interfaces.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import asdict
from pathlib import Path

from ...explain.selftest import RESULTS, SelfTest, self_test
from ...metrics import Metrics
from ...model.nodestate import NodeState
from ..base import DataplaneError
from .abi import MAP_NAMES, versioned
from .attach import Attacher, detach_xdp
from .cgroup import detach_socket_hooks, netns_cookie
from .conntrack import adopt_earlier_conntrack
from .handoff import Handoff, describe, kernel_nat_flows, release_netfilter
from .hops import CAUSES, HopEpoch
from .keeper import CHECK_PERIOD, REPAIRS, Keeper
from .kernel import EXPLAIN_PROGRAMS, ExplainBuild, LoadError, load_programs
from .netlink import NetlinkError, TcAttacher
from .options import EbpfOptions, SocketLb
from .pins import not_ours
from .writer import MapWriter

log = logging.getLogger(__name__)


class EbpfDataplane:
    name = "ebpf"

    def __init__(self, options: EbpfOptions) -> None:
        """Load the programs, open or create the pins and attach, as `options` say
        (options.py: every field with its meaning, default and range).
        `options.check_period`: seconds between the keeper's checks that what this agent
        wrote is still in the kernel, and at every full resync (0: no checks, for tests
        and tools that rewire the kernel under the dataplane on purpose), see keeper.py."""
        self.options = options
        self.pin_dir = Path(options.pin_dir)
        started = time.perf_counter()
        try:
            self.programs = load_programs(self.pin_dir, asdict(options.sizes))
        except LoadError as err:
            raise DataplaneError("load", str(err)) from err
        self.maps = MapWriter(self.programs, options, netns_cookie(options.netns))
        self.conntrack = self.maps.conntrack
        self.links = Attacher(self.programs, options)
        links, current = self.links, self.maps.current
        if links.deferred or links.cgroup_deferred:
            log.info(
                "ebpf: an earlier agent's programs keep serving %s until the first apply "
                "(the maps hold revision %s)",
                ", ".join([*(link.name for link in links.deferred.values()),
                           *(["the socket hooks"] if links.cgroup_deferred else [])]),
                (self.maps.meta_revision or "unknown")[:19],
            )  # fmt: skip
        log.info(
            "ebpf: datapath loaded in %.1f s (compile %.1f s), maps in %s hold %d frontends and "
            "%d backends, attached to %d pod interface(s) matching %s; external interfaces: %s, "
            "XDP %s",
            time.perf_counter() - started, self.programs.compile_seconds, self.pin_dir,
            len(current.services), len(current.backends), len(links.attached),
            ",".join(links.pod_interfaces),
            ",".join(links.external_globs) or "those with the node's NodePort addresses",
            links.xdp,
        )  # fmt: skip
        if options.cgroup is not None:
            pods = links.pod_netns.pods() if links.pod_netns is not None else []
            whose = {SocketLb.ALL: f"the node and {len(pods)} pod(s) found so far",
                     SocketLb.HOST: "the node (pods: tc)",
                     SocketLb.OFF: "nobody"}[options.socket_lb]  # fmt: skip
            log.info("ebpf: socket hooks on cgroup %s translate the sockets of %s",
                     options.cgroup, whose)  # fmt: skip
        copied, skipped = adopt_earlier_conntrack(self.pin_dir, self.programs.map("kbp_ct"))
        if copied or skipped:
            log.info("ebpf: copied %d conntrack entries of an earlier ABI version%s", copied,
                     f"; not copied (another entry layout): {' '.join(skipped)}" if skipped
                     else "")  # fmt: skip
        stale = remove_stale_pins(self.pin_dir)
        if stale:
            log.info("ebpf: removed the pins of another ABI version: %s", " ".join(stale))
        self.conntrack.start()
        self.hops = HopEpoch(self.programs, options.netns)
        if not options.watch_routes:
            self.hops.unwatched()
        else:
            try:
                self.hops.start()
            except (NetlinkError, OSError) as err:
                log.warning("ebpf: cannot watch routes and neighbours (%s): the programs "
                            "keep a next hop 100 ms", err)  # fmt: skip
        # Flows netfilter translated (kube-proxy's) are left to it: handoff.py.
        self.handoff = Handoff(self.programs.map("kbp_ct"))
        self._handed_off = False
        # Applies and the keeper's repairs take turns: both attach and detach programs.
        self._lock = threading.RLock()
        period = CHECK_PERIOD if options.check_period is None else options.check_period
        self.keeper = Keeper(self.programs, self.links, self._lock, period)
        self.keeper.start()
        # explain's build, compiled once the first apply is done (kernel.ExplainBuild);
        # the self-test asks it from then on, first for the state applied last.
        self._applied: NodeState | None = None
        self.explain_build = ExplainBuild(self.pin_dir, asdict(options.sizes), self._test_applied)

    @property
    def held_revision(self) -> str | None:
        return self.maps.held

    def apply(self, state: NodeState, full: bool = False) -> int:
        with self._lock:
            if full and self.links.pod_netns is not None:
                self.links.pod_netns.retry()  # pods whose namespaces were not found
            if not self._handed_off:
                self.maps.set_handoff(True)  # before any frontend is written
            writes, backends_removed = self.maps.apply(state, full)
            if not self._handed_off:
                self._hand_off(state)
            elif full and self.handoff.seeded:
                gone = self.handoff.reconcile()
                if gone:
                    log.info("ebpf: %d flow(s) left to netfilter ended (%d still open)",
                             gone, len(self.handoff.seeded))  # fmt: skip
            if backends_removed:
                self.links.release_udp_sockets(self.maps.live_backends)
            if self.links.take_over():  # else an earlier program may write reply entries
                self.conntrack.use_gate(self.maps.gate)  # the gate misses
            self.programs.finish_moves()  # maps moved to a new size: their old users are gone
            self._applied = state
            if self.options.explain_build:
                self.explain_build.start()
            self._test_applied()
            self.links.follow_node(state.node, full)
            if full and self.keeper.period > 0:  # every resync checks the rest is there
                self.keeper.check()
            return writes

    def _test_applied(self) -> None:
        """The self-test of the state applied last, due at the keeper's next check."""
        if self._applied is not None:
            self.keeper.test_with(functools.partial(self._self_test, self._applied))

    def _self_test(self, state: NodeState, turn: int) -> SelfTest | None:
        """The keeper's self-test (explain/selftest.py) once explain's build is pinned;
        None (nothing asked) before."""
        if not self.explain_build.ready.is_set():
            return None
        return self_test(self.pin_dir, state, turn)

    def _hand_off(self, state: NodeState) -> None:
        """After the first apply: seed the flows netfilter translated, then clear
        kbp_config.handoff (handoff.py)."""
        flows = kernel_nat_flows()
        seeded = self.handoff.seed(state, flows)
        self.handoff.hold()
        self.maps.set_handoff(False)
        self._handed_off = True
        if seeded:
            log.info("ebpf: %d open flow(s) that netfilter translated (kube-proxy's rules) "
                     "are left to it until they end", seeded)  # fmt: skip
            log.debug("ebpf: left to netfilter: %s", describe(flows))

    def cleanup(self) -> None:
        """Detach every kbp_ filter and XDP program from every interface and remove the
        pins."""
        self.keeper.stop()
        self.conntrack.stop()
        self.links.stop()
        self.explain_build.stop()
        cleanup(self.pin_dir, self.links.tc)
        self.close()
        self.maps.held = None

    def close(self) -> None:
        """Stop watching for interfaces; programs stay attached, maps stay pinned."""
        self.keeper.stop()  # after its pass in flight: nothing writes through closed fds
        self.explain_build.stop()  # a compile under way is killed
        self.hops.stop()
        self.conntrack.stop()
        self.links.stop()
        self.links.tc.close()
        self.programs.close()

    def status_details(self) -> dict[str, object]:
        problems, unrepaired = self.integrity()
        tested = self.keeper.self_test
        return {
            **self.links.status(),
            "datapathIntact": {
                "checks": self.keeper.checks,
                "problems": problems,
                "unrepairedSeconds": round(unrepaired, 1) if unrepaired is not None else None,
                "selfTest": tested.to_dict() if tested is not None else None,
            },
            "nextHops": self.hops.status(),
        }

    def integrity(self) -> tuple[list[str], float | None]:
        """What the keeper found missing and could not put back, and for how many
        seconds; ([], None) while the datapath serves what was applied."""
        problems, since = self.keeper.problems()
        return problems, (time.monotonic() - since if since is not None else None)

    def register_metrics(self, metrics: Metrics, service_metrics: str = "services") -> None:
        self.maps.register_metrics(metrics, service_metrics)
        for what in REPAIRS:  # every series from the start, at 0
            metrics.dataplane_repairs.labels(what)
        for result in RESULTS:
            metrics.datapath_self_tests.labels(result)
        for cause in CAUSES:
            metrics.next_hop_epochs.labels(cause)
        self.hops.report_to(lambda cause: metrics.next_hop_epochs.labels(cause).inc())

        def tested(test: SelfTest) -> None:
            metrics.datapath_self_tests.labels(test.result).inc()

        self.keeper.report_to(lambda what, _detail: metrics.dataplane_repairs.labels(what).inc(),
                              tested)  # fmt: skip


def cleanup(pin_dir: Path, attacher: TcAttacher | None = None) -> tuple[list[str], list[str]]:
    """Remove what the eBPF dataplane installed in this network namespace and on bpffs:
    our tc filters (clsact too when nothing else uses it), our XDP programs and our pins.
    Works without compiling anything, so it also clears up after an agent that cannot
    start.
    Returns (interfaces detached, pins removed)."""
    own = attacher is None
    attacher = attacher or TcAttacher()
    try:
        interfaces = {a.ifname for a in attacher.attached()}
        for link in attacher.links():
            if link.name in interfaces:
                attacher.detach(link.index)
        interfaces = sorted(interfaces | detach_xdp(attacher))
    finally:
        if own:
            attacher.close()
    # Links first: unpinning alone leaves a link attached while anyone holds its fd.
    detach_socket_hooks(pin_dir)
    for table in release_netfilter():  # kube-proxy's rules, back, hold conntrack again
        log.info("ebpf: deleted nftables table %s (held conntrack for flows left to "
                 "netfilter)", table)  # fmt: skip
    return interfaces, remove_pins(pin_dir)


def remove_stale_pins(pin_dir: Path) -> list[str]:
    """Unlink the maps (and explain's programs) another ABI version pinned here
    (kbp_<map>_v<N>, N not ours): an upgrade across a layout change leaves them behind.
    Safe at any time: a program of the old version still attached somewhere keeps its
    maps alive by reference; the pins only held them for inspection and reuse, which a new
    layout rules out."""
    removed: list[str] = []
    if not pin_dir.is_dir():
        return removed
    bases = {*MAP_NAMES, *(f"{program}_explain" for program in EXPLAIN_PROGRAMS)}
    ours = {versioned(name) for name in bases}
    for entry in sorted(pin_dir.iterdir()):
        base, _, version = entry.name.rpartition("_v")
        stale = base in bases and version.isdigit() and entry.name not in ours
        if stale and not _keep_foreign(entry):
            entry.unlink()
            removed.append(entry.name)
    return removed


def _keep_foreign(pin: Path) -> bool:
    """A pin with one of our names holding someone else's map is never removed: say so."""
    why = not_ours(pin)
    if why is not None:
        log.warning("ebpf: %s", why)
    return why is not None


def remove_pins(pin_dir: Path) -> list[str]:
    """Unlink our pins (kbp_*) and the directory when that leaves it empty; a pin with one
    of our map names that holds someone else's map stays, and a warning names it."""
    removed: list[str] = []
    if not pin_dir.is_dir():
        return removed
    for entry in sorted(pin_dir.iterdir()):
        if entry.name.startswith("kbp_") and not _keep_foreign(entry):
            entry.unlink()
            removed.append(entry.name)
    with contextlib.suppress(OSError):
        pin_dir.rmdir()
    return removed
