"""`--dataplane ebpf`: programs the NodeState into the pinned maps of the tc datapath and
keeps the programs attached to every pod interface, and to the node's external
interfaces (tc, plus XDP where it can be attached) for traffic from outside.

Start-up compiles the C programs (bcc), opens or creates the pins, reads what the maps
hold (a restarted agent adopts the previous agent's ids and sets, and reports the
revision kbp_meta names), attaches to the pod interfaces and watches netlink for new
ones. Each apply translates the NodeState to map contents (plan.py), diffs against the
kernel's, checks capacity, and writes only the differences, in the order that keeps
every intermediate state whole for packets.

Taking over from an earlier agent: where its programs are attached (tc, XDP, the
socket hooks' pinned links), they keep serving from their maps until this agent's first
apply has completed; only then are they replaced. Until then this agent may not have the
cluster's state (the API server unreachable at start), and after an ABI change its maps
start empty: replacing the programs at start-up would blank the node. Interfaces with no
program of ours are attached at once (nothing serves them either way).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily

from ...config import FLAG_MAP_SIZES
from ...metrics import Metrics
from ...model.nodestate import NodeInfo, NodeState
from ..base import DataplaneError
from . import codec, external, service_metrics, sockdiag
from .abi import DROP_REASONS, MAP_NAMES, addr_bytes, const, packer, port_bytes, versioned
from .cgroup import (
    CgroupAttachError,
    attach_socket_hooks,
    detach_socket_hooks,
    netns_cookie,
    socket_hooks_pinned,
)
from .conntrack import Collector, Timeouts, adopt_earlier_conntrack
from .ctgate import ReplyGate
from .external import DEFAULT_SNAT_PORTS, SourceRange
from .kernel import LoadedPrograms, LoadError, load_programs
from .libbpf import Map, prog_name
from .maps import CapacityError, KernelContent, MapSizes, Writes
from .netlink import Link, LinkWatcher, PodInterfaces, TcAttacher, run_in_netns
from .plan import plan_change
from .pods import PodNamespaces

log = logging.getLogger(__name__)

# Which program goes on which side of a pod's host interface, and of an external one.
HOOKS = (("ingress", "kbp_from_pod"), ("egress", "kbp_to_pod"))
EXTERNAL_HOOKS = (("ingress", "kbp_from_ext"), ("egress", "kbp_to_ext"))
XDP_PROGRAM = "kbp_xdp_ext"
_SOCK_KEY = packer("kbp_sock_key")
_SOCK_REV = packer("kbp_sock_rev")
# A program whose kernel name starts with this is ours (tc filters, XDP).
PROGRAM_PREFIX = "kbp_"


class EbpfDataplane:
    name = "ebpf"

    def __init__(
        self,
        pin_dir: str | Path,
        pod_interfaces: Sequence[str],
        sizes: MapSizes | None = None,
        *,
        maglev_table_size: int = 16381,
        netns: str | None = None,
        watch: bool = True,
        external_interfaces: Sequence[str] = (),
        xdp: str = "auto",
        snat_ports: tuple[int, int] = DEFAULT_SNAT_PORTS,
        cgroup: Path | None = None,
        socket_lb: str = "all",
        ct_timeouts: Timeouts | None = None,
        ct_sweep_interval: float = 0.0,
        tc_attach: str | None = None,
    ) -> None:
        """`external_interfaces`: globs of the node's external interfaces; empty means
        those that carry the node's NodePort addresses (the NodeState's
        node.nodePortAddresses), found at each apply that changes the node. `xdp`: auto
        (native, else generic), native, generic or off. `cgroup`: where the socket hooks
        serve (None: not attached); `socket_lb` (--socket-lb): whose sockets they
        translate, all (the node's and the pods'), host or off. `ct_sweep_interval`: seconds
        between conntrack sweeps by `ct_timeouts` (0: none, as for tests and tools).
        `tc_attach` (--tc-attach): auto, tcx or clsact, see netlink.TcAttacher."""
        self.pin_dir = Path(pin_dir)
        self.pod_interfaces = tuple(pod_interfaces)
        self._pods = PodInterfaces(self.pod_interfaces)
        self.external_globs = tuple(external_interfaces)
        self._external = PodInterfaces(self.external_globs) if self.external_globs else None
        self.xdp = external.xdp_mode(xdp)
        self.snat_ports = snat_ports
        if socket_lb not in external.SOCKET_LB_BITS:
            why = f"--socket-lb must be all, host or off; got {socket_lb!r}"
            raise DataplaneError("config", why)
        self.socket_lb = socket_lb
        self._external_attached: dict[int, str] = {}  # ifindex → name
        self.xdp_modes: dict[str, str] = {}  # interface → native | generic | failed: why
        self._node: NodeInfo | None = None  # the node the external state was made for
        self._config: bytes | None = None  # kbp_config as written
        self._ranges: set[SourceRange] = set()  # kbp_src_ranges as written
        self._range_index = external.SourceRangeIndex()  # the applied state's, wanted
        self._ports: dict[int, int] = {}  # kbp_ports bits this agent knows are set
        self.sizes = sizes or MapSizes()
        self.maglev_table_size = maglev_table_size
        self._lock = threading.Lock()
        self._held: str | None = None
        self._applied: NodeState | None = None  # the last state applied (metrics' labels)
        self._watcher: LinkWatcher | None = None
        started = time.perf_counter()
        try:
            self.programs: LoadedPrograms = load_programs(self.pin_dir, asdict(self.sizes))
        except LoadError as err:
            raise DataplaneError("load", str(err)) from err
        self._check_pinned_sizes()
        self.current = self._read_kernel()
        # The first apply (a full one: the sync loop's first is) compares with what was
        # just read rather than read the maps again: at 10k Services x 10 a read takes
        # ~1.5 s, more than the restarted agent's whole plan, and nothing else writes
        # them meanwhile (an earlier agent is gone before this one starts).
        self._just_read = True
        # The ports of the backends and frontends found (an earlier agent's): set again
        # where a bit is missing (a map new to this version), or their packets would skip
        # the lookups that find them.
        content = self.current
        backend_ports = (b.port for b in content.backends.values())
        _update(self.programs.map("kbp_ports"), [
            *self._port_writes(const.KBP_PORT_F_BACKEND, backend_ports),
            *self._port_writes(const.KBP_PORT_F_FRONTEND, (k.port for k in content.services)),
        ])  # fmt: skip
        self._ranges = self._read_ranges()
        self.conntrack = Collector(self.programs.map("kbp_ct"), self.programs.map("kbp_ct_stats"),
                                   ct_timeouts or Timeouts(), ct_sweep_interval,
                                   remap=self.programs.map("kbp_ct_remap"))  # fmt: skip
        # kbp_ct_gate is trusted only while every tc program is one that sets it: an
        # earlier agent's programs (maybe of a release without the gate) serve until our
        # first apply, so the gate reads "unbuilt" (every lookup made) until _take_over.
        self._gate = ReplyGate(self.programs.map("kbp_ct_gate"))
        self._gate.reset()
        self._config = self.programs.map("kbp_config").lookup(bytes(4))  # an earlier agent's
        # The revision an earlier agent's last complete apply left in the maps (None: none,
        # or that apply was cut short): reported as held until this agent applies.
        self._meta_revision = codec.meta_revision(self.programs.map("kbp_meta").lookup(bytes(4)))
        self._held = self._meta_revision
        try:
            self.attacher = TcAttacher(netns, self.pin_dir, tc_attach)
        except ValueError as err:
            raise DataplaneError("config", f"--tc-attach: {err}") from err
        self._netns_cookie = netns_cookie(netns)
        self.cgroup = cgroup
        # The pods' network namespaces, for the socket hooks (only when they serve pods).
        self.pod_netns: PodNamespaces | None = None
        self._sock_destroy_off = False  # set when the kernel has no SOCK_DESTROY
        if cgroup is not None and socket_lb == "all":
            self.pod_netns = PodNamespaces(self.attacher, self.programs.map("kbp_pods"))
        # Where an earlier agent's programs are attached, they serve until our first apply
        # completed (see the module doc): those interfaces wait in _deferred.
        self._serving = False
        self._takeover_lock = threading.Lock()
        self._deferred: dict[int, Link] = {}
        self._earlier = {a.index for a in self.attacher.attached()}
        self._earlier |= {x.index for x in self.attacher.xdp() if is_ours(x.prog_id)}
        self._cgroup_deferred = cgroup is not None and bool(socket_hooks_pinned(self.pin_dir))
        # What /state says of the socket hooks: attached, off, failed: why, or that the
        # earlier agent's serve until the first apply.
        self.socket_hooks = "off" if cgroup is None else "attached"
        if self._cgroup_deferred:
            self.socket_hooks = "the earlier agent's, until the first apply"
        elif cgroup is not None:
            self._attach_socket_hooks()
        self._attached: set[int] = set()
        watched = self.pod_interfaces + self.external_globs
        if watch:  # the watcher's start-up scan attaches to the existing interfaces
            self._watcher = LinkWatcher(self.attacher, watched, self._on_link,
                                        self._on_link_change, self._on_link_gone)  # fmt: skip
            self._watcher.start()
        else:
            for link in self.attacher.links():
                if PodInterfaces(watched).matches(link.name):
                    self._on_link(link)
        if self.pod_netns is not None:
            self.pod_netns.prune()  # pods removed while no agent ran
        attached = len(self._attached)
        if self._deferred or self._cgroup_deferred:
            log.info(
                "ebpf: an earlier agent's programs keep serving %s until the first apply "
                "(the maps hold revision %s)",
                ", ".join([*(link.name for link in self._deferred.values()),
                           *(["the socket hooks"] if self._cgroup_deferred else [])]),
                (self._meta_revision or "unknown")[:19],
            )  # fmt: skip
        log.info(
            "ebpf: datapath loaded in %.1f s (compile %.1f s), maps in %s hold %d frontends and "
            "%d backends, attached to %d pod interface(s) matching %s; external interfaces: %s, "
            "XDP %s",
            time.perf_counter() - started, self.programs.compile_seconds, self.pin_dir,
            len(self.current.services), len(self.current.backends), attached,
            ",".join(self.pod_interfaces),
            ",".join(self.external_globs) or "those with the node's NodePort addresses",
            self.xdp,
        )  # fmt: skip
        if cgroup is not None:
            pods = self.pod_netns.pods() if self.pod_netns is not None else []
            whose = {"all": f"the node and {len(pods)} pod(s) found so far",
                     "host": "the node (pods: tc)", "off": "nobody"}[socket_lb]  # fmt: skip
            log.info("ebpf: socket hooks on cgroup %s translate the sockets of %s", cgroup, whose)
        copied, skipped = adopt_earlier_conntrack(self.pin_dir, self.programs.map("kbp_ct"))
        if copied or skipped:
            log.info("ebpf: copied %d conntrack entries of an earlier ABI version%s", copied,
                     f"; not copied (another entry layout): {' '.join(skipped)}" if skipped
                     else "")  # fmt: skip
        stale = remove_stale_pins(self.pin_dir)
        if stale:
            log.info("ebpf: removed the pins of another ABI version: %s", " ".join(stale))
        self.conntrack.start()

    # --- Dataplane protocol ------------------------------------------------------------

    @property
    def held_revision(self) -> str | None:
        return self._held

    def apply(self, state: NodeState, full: bool = False) -> int:
        with self._lock:
            if full and not self._just_read:
                self.current = self._read_kernel()
            if full and self.pod_netns is not None:
                self.pod_netns.retry()
            self._just_read = False
            # Changes self.current in place (cost: what changed): every way out below
            # commits or rolls back.
            change = plan_change(
                state, self.current, maglev_table_size=self.maglev_table_size, sizes=self.sizes
            )
            ranges = self._range_index.update(state, rescan=full)
            w = change.writes
            try:
                change.check_capacity(self.sizes)
                self._check_range_capacity(ranges)
                busy = w.count
                self._add_external(w, state, ranges)
                # kbp_meta says "unknown" until every write is done
                meta_writes = self._write_meta(None) if busy else 0
                self._write(w)
                meta_writes += self._write_meta(state)
            except CapacityError as err:  # nothing was written
                self.current = change.rollback()
                raise DataplaneError("capacity", str(err)) from err
            except BaseException as err:
                # The kernel may hold something between the old and the new content: read
                # it back (the next apply then compares in full) rather than trust either.
                self.current = self._read_kernel_or(change.rollback())
                self._forget_external()
                if isinstance(err, OSError):
                    raise DataplaneError("map_write", str(err)) from err
                raise
            self.current = change.commit()
            self._held = state.revision
            self._applied = state
            writes = w.count + meta_writes
            backends_left = bool(change.writes.backends_to_delete)
        if backends_left:
            self._release_udp_sockets()
        if not self._serving:
            self._take_over()
        self._follow_node(state, full)
        return writes

    def cleanup(self) -> None:
        """Detach every kbp_ filter and XDP program from every interface and remove the
        pins."""
        self._stop_watching()
        cleanup(self.pin_dir, self.attacher)
        self.close()
        self._held = None

    def close(self) -> None:
        """Stop watching for interfaces; programs stay attached, maps stay pinned."""
        self._stop_watching()
        self.attacher.close()
        self.programs.close()

    def _stop_watching(self) -> None:
        self.conntrack.stop()
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    # --- metrics -------------------------------------------------------------------------

    def register_metrics(self, metrics: Metrics, service_metrics: str = "services") -> None:
        """Map fill ratios (from what the agent wrote), the datapath's drop counters and,
        unless service_metrics is none, per-Service traffic (read from the kernel at each
        scrape)."""

        def filled(count: Callable[[KernelContent], int], size: int) -> Callable[[], float]:
            def ratio() -> float:
                with self._lock:  # an apply in progress may hold a change it will roll back
                    return count(self.current) / size

            return ratio

        for name, count in (
            ("kbp_services", lambda c: len(c.services)),
            ("kbp_slots", lambda c: c.slot_count()),
            ("kbp_backends", lambda c: len(c.backends)),
        ):
            size = self.programs.map(name).info.max_entries
            metrics.map_fill.labels(versioned(name)).set_function(filled(count, size))
        metrics.registry.register(_DropCollector(self.programs.map("kbp_drops")))
        if service_metrics != "none":
            metrics.text_sections.append(self._service_traffic(service_metrics).render)
        metrics.registry.register(self.conntrack)
        if self.conntrack.interval > 0:  # counted by each sweep (a scan of the whole map)
            metrics.map_fill.labels(versioned("kbp_ct")).set_function(self.conntrack.fill_ratio)

    def _service_traffic(self, mode: str) -> service_metrics.ServiceTraffic:
        cache: dict[str, Any] = {}

        def labeller() -> dict[int, tuple[str, ...]]:
            with self._lock:
                state, content = self._applied, self.current
            if state is None:
                return {}
            if cache.get("revision") != state.revision:  # entries and ids change together
                cache["labels"] = service_metrics.labels_of(state.services, content.services,
                                                            mode)  # fmt: skip
                cache["revision"] = state.revision
            return cache["labels"]

        m = self.programs.map
        return service_metrics.ServiceTraffic(m("kbp_counters"), m("kbp_svc_drops"), labeller, mode)

    # --- writes --------------------------------------------------------------------------

    def _write(self, w: Writes) -> None:
        m = self.programs.map
        services, slots, backends = m("kbp_services"), m("kbp_slots"), m("kbp_backends")
        # 0. kbp_config and the ports lookups must know before packets reach new entries
        _update(m("kbp_config"), w.config)
        _update(m("kbp_ports"), w.ports)
        # 1. backends that new sets will name; 2. the new sets, complete, each slot with a
        # copy of its backend's entry (self.current is the new content here: plan_change)
        upserts = {i: codec.backend_value(v) for i, v in w.backends_to_upsert.items()}
        _update(backends, [(codec.backend_key(i), value) for i, value in upserts.items()])
        known = self.current.backends

        def copy_of(backend_id: int) -> bytes:
            value = upserts.get(backend_id)
            return value if value is not None else codec.backend_value(known[backend_id])

        _update(slots, [(codec.slot_key(set_id, index), codec.slot_value(backend_id,
                                                                         copy_of(backend_id)))
                        for set_id, members in w.sets_to_write.items()
                        for index, backend_id in enumerate(members)])  # fmt: skip
        # A live backend whose flags changed: the slots of live sets that name it get the
        # new copy (the set itself, its ids, is unchanged).
        changed = w.backends_changed
        if changed:  # rare (a fallback set's endpoint terminating): one pass over the sets
            _update(slots, [(codec.slot_key(set_id, index), codec.slot_value(b, upserts[b]))
                            for set_id, members in self.current.slots.items()
                            if set_id not in w.sets_to_write
                            for index, b in enumerate(members) if b in changed])  # fmt: skip
        # 3. the ranges new services need, zeroed counters for new service ids, then the
        # flip: services point at new sets
        _update(m("kbp_src_ranges"), w.ranges_to_add)
        if w.counters_reset:
            counters = m("kbp_counters")
            zero = bytes(counters.value_size)
            _update(counters, [(codec.backend_key(i), zero) for i in w.counters_reset])
            drops = m("kbp_svc_drops")  # and their drop counts, in one batch if any
            _delete(drops, service_metrics.keys_of_ids(drops.keys(), w.counters_reset))
        _update(services, [(codec.frontend_key(k), codec.service_value(v))
                           for k, v in w.services_to_upsert.items()])  # fmt: skip
        # 4. frontends gone; 5. sets nobody points at; 6. backends no set names
        _delete(services, [codec.frontend_key(k) for k in w.frontends_to_delete])
        _delete(slots, [codec.slot_key(set_id, index)
                        for set_id, size in w.sets_to_delete.items()
                        for index in range(size)])  # fmt: skip
        _delete(backends, [codec.backend_key(i) for i in w.backends_to_delete])
        # 9. ranges no service uses now (LPM tries have no batch delete)
        for key in w.ranges_to_delete:
            m("kbp_src_ranges").delete(key)

    # --- kernel state ----------------------------------------------------------------------

    def _read_kernel(self) -> KernelContent:
        m = self.programs.map
        return codec.read_content(m("kbp_services"), m("kbp_slots"), m("kbp_backends"))

    def _read_kernel_or(self, fallback: KernelContent) -> KernelContent:
        try:
            return self._read_kernel()
        except OSError:
            log.exception("ebpf: cannot read the maps back after a failed write")
            return fallback

    def _check_pinned_sizes(self) -> None:
        """Pinned maps keep the size they were created with: say so when the settings
        ask for another, and plan with what the kernel really has."""
        wanted = asdict(self.sizes)
        actual = {}
        for field in FLAG_MAP_SIZES:
            name = f"kbp_{field}"
            actual[field] = self.programs.map(name).info.max_entries
            if actual[field] != wanted[field]:
                log.warning(
                    "ebpf: pinned map %s has %d entries, --map-size-%s asks for %d; "
                    "keeping the pinned size (run `kube-bpf-proxy cleanup` to recreate it)",
                    versioned(name), actual[field], field, wanted[field],
                )  # fmt: skip
        self.sizes = MapSizes(**actual)

    # --- sockets -------------------------------------------------------------------------

    def _release_udp_sockets(self) -> None:
        """After an apply that removed backends: destroy the connected UDP sockets the
        socket hooks pointed at a backend that is no longer in their Service, in the
        node's namespace and every pod's (docs/ebpf.md, "A backend leaves"). TCP needs
        nothing (it learns from the backend); unconnected UDP picks again at sendmsg()."""
        if self.cgroup is None or self._sock_destroy_off:
            return
        reverse = self.programs.map("kbp_sock_rev")
        live: set[tuple[int, str, int]] | None = None

        def removed(sock: sockdiag.UdpSocket) -> bool:
            nonlocal live
            family = const.KBP_FAMILY_IPV6 if ":" in sock.peer else const.KBP_FAMILY_IPV4
            key = _SOCK_KEY.pack(sock.cookie, addr_bytes(sock.peer), port_bytes(sock.peer_port),
                                 family)  # fmt: skip
            raw = reverse.lookup(key)
            if raw is None:
                return False  # not translated by the hooks: none of ours
            if live is None:
                with self._lock:
                    live = {(b.service_id, b.addr, b.port) for b in self.current.backends.values()}
            service_id = _SOCK_REV.unpack(raw)[2]
            return (service_id, sock.peer, sock.peer_port) not in live

        namespaces: list[str | None] = [self.attacher.netns]
        if self.pod_netns is not None:
            namespaces += [pod.path for pod in self.pod_netns.pods()]
        destroyed = 0
        for netns in namespaces:
            try:
                if netns is None:
                    destroyed += sockdiag.destroy_matching(removed)
                else:
                    destroyed += run_in_netns(netns, lambda: sockdiag.destroy_matching(removed))
            except sockdiag.DestroyUnsupported as err:
                self._sock_destroy_off = True
                log.warning("ebpf: this kernel cannot destroy sockets (%s): connected UDP "
                            "sockets to removed backends stay until their application "
                            "reconnects", err)  # fmt: skip
                return
            except (OSError, DataplaneError) as err:  # a pod namespace that just went
                log.debug("ebpf: connected UDP sockets in %s: %s", netns, err)
        if destroyed:
            log.info("ebpf: destroyed %d connected UDP socket(s) to removed backends", destroyed)

    # --- interfaces ----------------------------------------------------------------------

    def _take_over(self) -> None:
        """After the first complete apply: replace the earlier agent's programs where they
        were left to serve. A failure here is logged; the earlier programs keep serving
        there and the maps are already this agent's."""
        with self._takeover_lock:
            self._serving = True
            deferred, self._deferred = list(self._deferred.values()), {}
        replaced = True
        for link in deferred:
            try:
                self._on_link(link)
            except DataplaneError as err:
                replaced = False
                log.error("ebpf: replacing the programs on %s: %s", link.name, err)
        if replaced:  # else an earlier program may write reply entries the gate misses
            self.conntrack.use_gate(self._gate)
        if self._cgroup_deferred:
            self._cgroup_deferred = False
            self._attach_socket_hooks()
        if deferred:
            names = ", ".join(link.name for link in deferred)
            log.info("ebpf: the first state is programmed: this agent's programs replaced "
                     "the earlier agent's on %s", names)  # fmt: skip

    def _attach_socket_hooks(self) -> None:
        """The socket hooks on --cgroup-root. A failure leaves the rest of the dataplane
        running (pods and outside clients do not use them) and says so."""
        assert self.cgroup is not None
        try:
            attach_socket_hooks(self.programs, self.cgroup, self.pin_dir)
        except CgroupAttachError as err:
            self.socket_hooks = f"failed: {err}"
            log.error("ebpf: the socket hooks are off, so the node's own processes reach "
                      "Services only through the routes: %s", err)  # fmt: skip
            return
        self.socket_hooks = "attached"

    def _on_link(self, link: Link) -> None:
        if self.pod_netns is not None and self._pods.matches(link.name):
            self.pod_netns.learn(link)
        with self._takeover_lock:
            if not self._serving and link.index in self._earlier:
                self._deferred[link.index] = link  # the earlier program serves until then
                return
        if self._pods.matches(link.name):
            hooks = HOOKS
        elif self._external is not None and self._external.matches(link.name):
            self._attach_external(link)
            return
        else:
            return
        for direction, program in hooks:
            if not self.attacher.attach(link.index, direction, self.programs.fd(program), program):
                log.debug("ebpf: %s vanished before it could be attached", link.name)
                return
        self._attached.add(link.index)
        log.debug("ebpf: attached to %s (ifindex %d)", link.name, link.index)

    def _on_link_change(self, link: Link) -> None:
        """A known interface changed (a pod's came up): a pod not found before may be
        complete now (its CNI plugin added the addresses)."""
        pods = self.pod_netns
        if pods is not None and self._pods.matches(link.name) and link.name in pods.pending():
            pods.learn(link)

    def _on_link_gone(self, link: Link) -> None:
        if self.pod_netns is not None and self._pods.matches(link.name):
            self.pod_netns.forget(link)
        self.attacher.forget(link.index)  # tcx: the pins of its defunct links

    def _attach_external(self, link: Link) -> None:
        """tc on both sides of an external interface, then XDP as --xdp asks."""
        for direction, program in EXTERNAL_HOOKS:
            if not self.attacher.attach(link.index, direction, self.programs.fd(program), program):
                log.debug("ebpf: %s vanished before it could be attached", link.name)
                return
        self._external_attached[link.index] = link.name
        mode = self._attach_xdp(link)
        log.info("ebpf: external interface %s (ifindex %d): tc attached, XDP %s",
                 link.name, link.index, mode)  # fmt: skip

    def _attach_xdp(self, link: Link) -> str:
        """Attach the XDP program in the first mode that works; returns the mode, `off`,
        or `failed: <why>` (tc still handles the interface then). An explicit native or
        generic that fails is an error."""
        if self.xdp == "off":
            self.xdp_modes.pop(link.name, None)
            return "off"
        fd = self.programs.fd(XDP_PROGRAM)
        replace = 0
        for attached in self.attacher.xdp():
            if attached.index == link.index and is_ours(attached.prog_id):
                replace = attached.prog_id
        modes = ("native", "generic") if self.xdp == "auto" else (self.xdp,)
        if self.xdp == "auto" and self.attacher.link_kind(link.index) == "veth":
            # A native XDP_TX on a veth lands in the peer's ring, which is read only if
            # the peer has an XDP program too (drivers/net/veth.c veth_xdp_flush): the
            # peer lies outside the node (a kind node's host side), so frames forwarded
            # back out would stall. Generic XDP has no such condition.
            modes = ("generic",)
            log.info("ebpf: XDP on veth %s runs generic (native XDP_TX needs an XDP program "
                     "on the peer; --xdp=native forces it)", link.name)  # fmt: skip
        errors = []
        for mode in modes:
            try:
                if not self.attacher.attach_xdp(link.index, fd, mode, replace):
                    return "vanished"
            except DataplaneError as err:
                errors.append(f"{mode}: {err}")
                continue
            self.xdp_modes[link.name] = mode
            return mode
        why = "; ".join(errors)
        self.xdp_modes[link.name] = f"failed: {why}"  # /state says so either way
        if self.xdp != "auto":
            raise DataplaneError("xdp", f"--xdp={self.xdp} on {link.name}: {why}")
        log.warning("ebpf: XDP could not be attached to %s (tc handles it alone): %s",
                    link.name, why)  # fmt: skip
        return self.xdp_modes[link.name]

    def _follow_node(self, state: NodeState, full: bool) -> None:
        """Without --external-interfaces, the external interfaces are those that carry
        the node's NodePort addresses: looked up again when the node changes and at full
        resyncs (an interface that gets the address later is found then)."""
        if self._external is not None or (state.node == self._node and not full):
            return
        self._node = state.node
        names = external.interfaces_with(self.attacher.addresses(), state.node.nodeport_ips())
        links = {link.name: link for link in self.attacher.links()}
        for index, name in list(self._external_attached.items()):
            if name not in names and links.get(name, Link(-1, name)).index == index:
                self.attacher.detach(index)
                self._detach_xdp(index, name)
                del self._external_attached[index]
                log.info("ebpf: %s no longer carries a NodePort address: detached", name)
        for name in sorted(names):
            link = links.get(name)
            if link is not None and link.index not in self._external_attached:
                if self._pods.matches(name):
                    continue  # a pod interface is never external
                self._attach_external(link)

    def _detach_xdp(self, index: int, name: str) -> None:
        for attached in self.attacher.xdp():
            if attached.index == index and is_ours(attached.prog_id):
                self.attacher.detach_xdp(index, attached.mode)
        self.xdp_modes.pop(name, None)

    # --- status ----------------------------------------------------------------------------

    def status_details(self) -> dict[str, object]:
        """What /state's status adds for this dataplane: the external interfaces and the
        XDP mode on each."""
        names = sorted(self._external_attached.values())
        return {
            "tcAttach": self.attacher.mode,
            "socketHooks": {
                "cgroup": str(self.cgroup) if self.cgroup is not None else None,
                "state": self.socket_hooks,
                "socketLb": self.socket_lb,
                "pods": len(self.pod_netns.pods()) if self.pod_netns is not None else 0,
                "podsPending": self.pod_netns.pending() if self.pod_netns is not None else [],
            },
            "externalInterfaces": names,
            "xdp": {
                "enabled": self.xdp != "off",
                "requested": self.xdp,
                "interfaces": {n: self.xdp_modes[n] for n in names if n in self.xdp_modes},
            },
        }

    # --- external maps -----------------------------------------------------------------------

    def _write_meta(self, state: NodeState | None) -> int:
        """kbp_meta: the revision the maps now hold wholly (None: an apply is under way).
        Returns the writes made (0 or 1)."""
        revision = state.revision if state is not None else None
        if revision == self._meta_revision:
            return 0
        if state is None:
            value = codec.NO_META
        else:
            value = codec.meta_value(state.revision, time.time_ns(), len(state.services),
                                     state.backend_count())  # fmt: skip
        self.programs.map("kbp_meta").update(bytes(4), value)
        self._meta_revision = revision
        return 1

    def _check_range_capacity(self, ranges: frozenset[SourceRange]) -> None:
        size = self.programs.map("kbp_src_ranges").info.max_entries
        if len(ranges) > size:
            raise CapacityError("src_ranges", len(ranges), size)

    def _add_external(self, w: Writes, state: NodeState, ranges: frozenset[SourceRange]) -> None:
        """The writes of kbp_config, kbp_ports and kbp_src_ranges into their phases of
        `w`, and what this agent then knows the maps hold (forgotten if a write fails)."""
        config = external.config_value(state.node.addresses, state.node.cluster_cidrs,
                                       self._netns_cookie, self.snat_ports, self.socket_lb,
                                       self.conntrack.timeouts.lifetimes())  # fmt: skip
        if config != self._config:
            w.config.append((bytes(4), config))
            self._config = config
        backend_ports = (b.port for b in w.backends_to_upsert.values())
        w.ports.extend(self._port_writes(const.KBP_PORT_F_BACKEND, backend_ports))
        frontend_ports = (k.port for k in w.services_to_upsert)
        w.ports.extend(self._port_writes(const.KBP_PORT_F_FRONTEND, frontend_ports))
        added, gone = ranges - self._ranges, self._ranges - ranges
        w.ranges_to_add.extend((r.key(), r.value()) for r in added)
        w.ranges_to_delete.extend(r.key() for r in gone)
        self._ranges = set(ranges)

    def _forget_external(self) -> None:
        """After a failed write: read kbp_src_ranges back; write kbp_config and look the
        ports up again at the next apply."""
        self._config = None
        self._ports = {}
        try:
            self._ranges = self._read_ranges()
        except OSError:
            log.exception("ebpf: cannot read kbp_src_ranges back after a failed write")
            self._ranges = set()

    def _port_writes(self, flag: int, ports: Iterable[int]) -> list[tuple[bytes, bytes]]:
        """The kbp_ports writes that set `flag` (KBP_PORT_F_*) for these ports, before
        backends or frontends with them are written: the programs look replies up only
        from backend ports and frontends only at frontend ports. Never cleared, so removed
        backends' flows drain; a stale bit costs a lookup. Only ports whose bits are not
        known are read (an earlier agent's bits stay unwritten)."""
        known = self._ports
        new = {port for port in ports if not known.get(port, 0) & flag}
        out: list[tuple[bytes, bytes]] = []
        if not new:
            return out
        table = self.programs.map("kbp_ports")
        for port in sorted(new):
            key = struct.pack("=I", port)
            if port in known:
                bits = known[port]
            else:
                raw = table.lookup(key)
                bits = raw[0] if raw else 0
            if not bits & flag:
                bits |= flag
                out.append((key, bytes([bits])))
            known[port] = bits
        return out

    def _read_ranges(self) -> set[SourceRange]:
        """What kbp_src_ranges holds (an earlier agent's writes), to diff against."""
        found = set()
        for key, _value in self.programs.map("kbp_src_ranges").items():
            found.add(codec.decode_src_range_key(key))
        return found


class _DropCollector:
    """kbp_datapath_drops_total{reason}: the per-CPU kbp_drops map, summed at scrape."""

    def __init__(self, drops: Map) -> None:
        self._drops = drops

    def describe(self) -> list[CounterMetricFamily]:
        return [self._family()]

    def collect(self) -> list[CounterMetricFamily]:
        family = self._family()
        try:
            sums = codec.percpu_sums(self._drops, "kbp_drop_counters")
        except OSError:
            log.exception("ebpf: reading kbp_drops for /metrics")
            return [family]
        for reason, (packets, _bytes) in sorted(sums.items()):
            family.add_metric([DROP_REASONS.get(reason, str(reason))], packets)
        return [family]

    @staticmethod
    def _family() -> CounterMetricFamily:
        return CounterMetricFamily(
            "kbp_datapath_drops",
            "Packets the eBPF datapath dropped or rejected, by reason.",
            labels=["reason"],
        )


def _update(target: Map, items: list[tuple[bytes, bytes]]) -> None:
    if items:
        target.update_batch(b"".join(k for k, _ in items), b"".join(v for _, v in items),
                            len(items))  # fmt: skip


def _delete(target: Map, keys: list[bytes]) -> None:
    if keys:
        target.delete_batch(b"".join(keys), len(keys))


def is_ours(prog_id: int) -> bool:
    """Is the loaded program with this id one of ours (kbp_ name)? False once it is gone."""
    try:
        return prog_name(prog_id).startswith(PROGRAM_PREFIX)
    except OSError:
        return False


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
        for xdp in attacher.xdp():
            if is_ours(xdp.prog_id):
                attacher.detach_xdp(xdp.index, xdp.mode)
                interfaces.add(xdp.ifname)
        interfaces = sorted(interfaces)
    finally:
        if own:
            attacher.close()
    # Links first: unpinning alone leaves a link attached while anyone holds its fd.
    detach_socket_hooks(pin_dir)
    return interfaces, remove_pins(pin_dir)


def remove_stale_pins(pin_dir: Path) -> list[str]:
    """Unlink the maps another ABI version pinned here (kbp_<map>_v<N>, N not ours): an
    upgrade across a layout change leaves them behind. Safe at any time: a program of the
    old version still attached somewhere keeps its maps alive by reference; the pins
    only held them for inspection and reuse, which a new layout rules out."""
    removed: list[str] = []
    if not pin_dir.is_dir():
        return removed
    ours = {versioned(name) for name in MAP_NAMES}
    for entry in sorted(pin_dir.iterdir()):
        base, _, version = entry.name.rpartition("_v")
        if base in MAP_NAMES and version.isdigit() and entry.name not in ours:
            entry.unlink()
            removed.append(entry.name)
    return removed


def remove_pins(pin_dir: Path) -> list[str]:
    """Unlink our pins (kbp_*) and the directory when that leaves it empty."""
    removed: list[str] = []
    if not pin_dir.is_dir():
        return removed
    for entry in sorted(pin_dir.iterdir()):
        if entry.name.startswith("kbp_"):
            entry.unlink()
            removed.append(entry.name)
    with contextlib.suppress(OSError):
        pin_dir.rmdir()
    return removed
