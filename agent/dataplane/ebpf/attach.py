"""The interface attacher of the eBPF dataplane: which interfaces get which programs (tc on
the pods' host interfaces and on the node's external ones, XDP on the external ones),
the socket hooks on the cgroup, and the pods' network namespaces they serve. It follows
netlink for new interfaces and the node for its external ones.

Taking over from an earlier agent: where its programs are attached (tc, XDP, the
socket hooks' pinned links), they keep serving from their maps until this agent's first
apply has completed; only then are they replaced. Until then this agent may not have the
cluster's state (the API server unreachable at start), and after an ABI change its maps
start empty: replacing the programs at start-up would blank the node. Interfaces with no
program of ours are attached at once (nothing serves them either way).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ...model.nodestate import NodeInfo
from ..base import DataplaneError
from . import codec, external, sockdiag
from .abi import addr_bytes, family_of, packer, port_bytes
from .cgroup import (
    CgroupAttachError,
    attach_socket_hooks,
    detach_foreign_cgroup_links,
    kbp_cgroup_links,
    release_links,
    socket_hooks_pinned,
    socket_programs,
)
from .kernel import LoadedPrograms
from .libbpf import prog_name
from .netlink import Link, LinkWatcher, PodInterfaces, TcAttacher, run_in_netns
from .options import EbpfOptions, SocketLb, Xdp
from .pods import PodNamespaces

log = logging.getLogger(__name__)

# Which program goes on which side of a pod's host interface, and of an external one.
HOOKS = (("ingress", "kbp_from_pod"), ("egress", "kbp_to_pod"))
EXTERNAL_HOOKS = (("ingress", "kbp_from_ext"), ("egress", "kbp_to_ext"))
XDP_PROGRAM = "kbp_xdp_ext"
_SOCK_KEY = packer("kbp_sock_key")
_SOCK_REV = packer("kbp_sock_rev")


def is_ours(prog_id: int) -> bool:
    """Is the loaded program with this id one of ours (kbp_ name)? False once it is gone."""
    try:
        return prog_name(prog_id).startswith("kbp_")
    except OSError:
        return False


def detach_xdp(tc: TcAttacher, index: int | None = None) -> set[str]:
    """Detach our XDP programs from the interface `index` (None: every one); returns
    the interfaces' names."""
    names = set()
    for xdp in tc.xdp():
        if (index is None or xdp.index == index) and is_ours(xdp.prog_id):
            tc.detach_xdp(xdp.index, xdp.mode)
            names.add(xdp.ifname)
    return names


def _other_agents_hooks(cgroup: Path) -> list[tuple[int, int, str]]:
    """Socket hooks of ours on `cgroup` that another agent attached (at start-up, any);
    none when the cgroup cannot be read (attaching will say why)."""
    try:
        return kbp_cgroup_links(os.stat(cgroup).st_ino)
    except OSError:
        return []


class Attacher:
    """The programs on the interfaces and the cgroup, and what /state says of them."""

    def __init__(self, programs: LoadedPrograms, options: EbpfOptions) -> None:
        """Attach as `options` say: the pod and external interface globs, --xdp, the
        socket hooks' cgroup and --socket-lb, --tc-attach (netlink.TcAttacher), the
        network namespace and whether to watch netlink."""
        self.programs = programs
        self.pod_interfaces = tuple(options.pod_interfaces)
        self._pods = PodInterfaces(self.pod_interfaces)
        self.external_globs = tuple(options.external_interfaces)
        self._external = PodInterfaces(self.external_globs) if self.external_globs else None
        self.xdp = options.xdp
        self.socket_lb = options.socket_lb
        netns, cgroup, watch = options.netns, options.cgroup, options.watch
        self._external_attached: dict[int, str] = {}  # ifindex → name
        self.xdp_modes: dict[str, str] = {}  # interface → native | generic | failed: why
        self._node: NodeInfo | None = None  # the node the external interfaces were found for
        try:
            self.tc = TcAttacher(netns, programs.pin_dir, options.tc_attach)
        except ValueError as err:
            raise DataplaneError("config", f"--tc-attach: {err}") from err
        self.cgroup = cgroup
        self._hook_links: dict[str, int] = {}  # hook → link fd, held beside the pins
        # The pods' network namespaces, for the socket hooks (only when they serve pods).
        self.pod_netns: PodNamespaces | None = None
        self._sock_destroy_off = False  # set when the kernel has no SOCK_DESTROY
        if cgroup is not None and self.socket_lb is SocketLb.ALL:
            self.pod_netns = PodNamespaces(self.tc, programs.map("kbp_pods"))
        # Where an earlier agent's programs are attached, they serve until our first apply
        # completed (see the module doc): those interfaces wait in deferred.
        self._serving = False
        self._takeover_lock = threading.Lock()
        self.deferred: dict[int, Link] = {}
        self._earlier = {a.index for a in self.tc.attached()}
        self._earlier |= {x.index for x in self.tc.xdp() if is_ours(x.prog_id)}
        # The socket hooks wait too where an earlier agent's serve: pinned here, or on the
        # cgroup from another pin directory (an earlier --bpffs), replaced at take_over.
        self.cgroup_deferred = cgroup is not None and bool(
            socket_hooks_pinned(programs.pin_dir) or _other_agents_hooks(cgroup)
        )
        # What /state says of the socket hooks: attached, off, failed: why, or that the
        # earlier agent's serve until the first apply.
        self.socket_hooks = "off" if cgroup is None else "attached"
        if self.cgroup_deferred:
            self.socket_hooks = "the earlier agent's, until the first apply"
        elif cgroup is not None:
            self._attach_socket_hooks()
        self.attached: set[int] = set()  # the pod interfaces
        self._watcher: LinkWatcher | None = None
        watched = self.pod_interfaces + self.external_globs
        if watch:  # the watcher's start-up scan attaches to the existing interfaces
            self._watcher = LinkWatcher(self.tc, watched, self._on_link,
                                        self._on_link_change, self._on_link_gone)  # fmt: skip
            self._watcher.start()
        else:
            for link in self.tc.links():
                if PodInterfaces(watched).matches(link.name):
                    self._on_link(link)
        if self.pod_netns is not None:
            self.pod_netns.prune()  # pods removed while no agent ran

    @property
    def serving(self) -> bool:
        """True once the first apply completed and this agent's programs serve."""
        with self._takeover_lock:
            return self._serving

    def external_attached(self) -> dict[int, str]:
        """The external interfaces this agent attached to: ifindex → name."""
        return dict(self._external_attached)

    def attach_tc(self, link: Link, hooks: tuple[tuple[str, str], ...]) -> bool:
        """Attach (or replace) our tc programs on both sides of `link` (the keeper's
        repair); False when the interface vanished. The reply side goes first: with only
        the forward side back, a held connection's retransmit would be translated and
        its answer reach the client untranslated, which answers it with a reset."""
        attached = self._attach_tc(link, tuple(reversed(hooks)))
        if attached and hooks == HOOKS:
            self.attached.add(link.index)
        return attached

    def attach_xdp(self, link: Link) -> str:
        """Attach our XDP program to an external interface again; the mode, or why not."""
        return self._attach_xdp(link)

    def stop(self) -> None:
        """Stop watching for interfaces; the pins alone hold our links from now on."""
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        release_links(self._hook_links)

    def attach_socket_hooks_again(self) -> None:
        """The keeper's repair: our links on the cgroup again (those still attached
        are pinned again, missing ones made); CgroupAttachError when that fails."""
        assert self.cgroup is not None
        attach_socket_hooks(self.programs, self.cgroup, self.programs.pin_dir,
                            self._hook_links)  # fmt: skip

    def take_over(self) -> bool:
        """After the first complete apply: replace the earlier agent's programs where they
        were left to serve. A failure here is logged; the earlier programs keep serving
        there and the maps are already this agent's. True when every tc program is this
        agent's from now on (at the first call only)."""
        with self._takeover_lock:
            if self._serving:
                return False
            self._serving = True
            deferred, self.deferred = list(self.deferred.values()), {}
        replaced = True
        for link in deferred:
            try:
                self._on_link(link)
            except DataplaneError as err:
                replaced = False
                log.error("ebpf: replacing the programs on %s: %s", link.name, err)
        if self.cgroup_deferred:
            self.cgroup_deferred = False
            self._attach_socket_hooks()
        if deferred:
            names = ", ".join(link.name for link in deferred)
            log.info("ebpf: the first state is programmed: this agent's programs replaced "
                     "the earlier agent's on %s", names)  # fmt: skip
        return replaced

    def _attach_socket_hooks(self) -> None:
        """The socket hooks on --cgroup-root. A failure leaves the rest of the dataplane
        running (pods and outside clients do not use them) and says so."""
        assert self.cgroup is not None
        try:
            attach_socket_hooks(self.programs, self.cgroup, self.programs.pin_dir,
                                self._hook_links)  # fmt: skip
        except CgroupAttachError as err:
            self.socket_hooks = f"failed: {err}"
            log.error("ebpf: the socket hooks are off, so the node's own processes reach "
                      "Services only through the routes: %s", err)  # fmt: skip
            return
        self.socket_hooks = "attached"
        try:
            detached = self.detach_other_agents_hooks()
        except OSError as err:
            log.warning("ebpf: cannot look for other agents' socket hooks on %s: %s",
                        self.cgroup, err)  # fmt: skip
            return
        if detached:
            log.info("ebpf: detached another agent's socket hooks from cgroup %s (an earlier "
                     "--bpffs?): %s", self.cgroup, " ".join(detached))  # fmt: skip

    def detach_other_agents_hooks(self) -> list[str]:
        """Detach the kbp_ programs on our cgroup that are not this agent's (another
        agent's, e.g. of an earlier --bpffs); what went, as name(link id)."""
        assert self.cgroup is not None
        ours = {self.programs.prog_id(program) for program, _type in socket_programs().values()}
        return detach_foreign_cgroup_links(os.stat(self.cgroup).st_ino, ours)

    def release_udp_sockets(self, live_backends: Callable[[], set[tuple[int, str, int]]]) -> None:
        """After an apply that removed backends: destroy the connected UDP sockets the
        socket hooks pointed at a backend that is no longer in their Service (not among
        `live_backends()`), in the node's namespace and every pod's (docs/ebpf.md, "A
        backend leaves"). TCP needs nothing (it learns from the backend); unconnected UDP
        picks again at sendmsg()."""
        if self.cgroup is None or self._sock_destroy_off:
            return
        reverse, slots = self.programs.map("kbp_sock_rev"), self.programs.map("kbp_sock_slots")
        live: set[tuple[int, str, int]] | None = None

        def removed(sock: sockdiag.UdpSocket) -> bool:
            nonlocal live
            peer, peer_port = addr_bytes(sock.peer), port_bytes(sock.peer_port)
            service_id = codec.sock_slot_service(slots, sock.cookie, peer, peer_port)
            if service_id is None:  # no slot: its record is in the LRU, if anywhere
                raw = reverse.lookup(_SOCK_KEY.pack(sock.cookie, peer, peer_port,
                                                    family_of(sock.peer)))  # fmt: skip
                if raw is None:
                    return False  # not translated by the hooks: none of ours
                service_id = _SOCK_REV.unpack(raw)[2]
            if live is None:
                live = live_backends()
            return (service_id, sock.peer, sock.peer_port) not in live

        namespaces: list[str | None] = [self.tc.netns]
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

    def _on_link(self, link: Link) -> None:
        pod = self._pods.matches(link.name)
        if self.pod_netns is not None and pod:
            self.pod_netns.learn(link)
        with self._takeover_lock:
            if not self._serving and link.index in self._earlier:
                self.deferred[link.index] = link  # the earlier program serves until then
                return
        if pod:
            if self._attach_tc(link, HOOKS):
                self.attached.add(link.index)
        elif self._external is not None and self._external.matches(link.name):
            self._attach_external(link)

    def _attach_tc(self, link: Link, hooks: tuple[tuple[str, str], ...]) -> bool:
        for direction, program in hooks:
            if not self.tc.attach(link.index, direction, self.programs.fd(program), program):
                log.debug("ebpf: %s vanished before it could be attached", link.name)
                return False
        log.debug("ebpf: attached to %s (ifindex %d)", link.name, link.index)
        return True

    def _on_link_change(self, link: Link) -> None:
        """A known interface changed (a pod's came up): a pod not found before may be
        complete now (its CNI plugin added the addresses)."""
        pods = self.pod_netns
        if pods is not None and self._pods.matches(link.name) and link.name in pods.pending():
            pods.learn(link)

    def _on_link_gone(self, link: Link) -> None:
        if self.pod_netns is not None and self._pods.matches(link.name):
            self.pod_netns.forget(link)
        self.tc.forget(link.index)  # tcx: the pins of its defunct links

    def _attach_external(self, link: Link) -> None:
        """tc on both sides of an external interface, then XDP as --xdp asks."""
        if not self._attach_tc(link, EXTERNAL_HOOKS):
            return
        self._external_attached[link.index] = link.name
        mode = self._attach_xdp(link)
        log.info("ebpf: external interface %s (ifindex %d): tc attached, XDP %s",
                 link.name, link.index, mode)  # fmt: skip

    def _attach_xdp(self, link: Link) -> str:
        """Attach the XDP program in the first mode that works; returns the mode, `off`,
        or `failed: <why>` (tc still handles the interface then). An explicit native or
        generic that fails is an error."""
        if self.xdp is Xdp.OFF:
            self.xdp_modes.pop(link.name, None)
            return "off"
        fd = self.programs.fd(XDP_PROGRAM)
        replace = 0
        for attached in self.tc.xdp():
            if attached.index == link.index and is_ours(attached.prog_id):
                replace = attached.prog_id
        modes = ("native", "generic") if self.xdp is Xdp.AUTO else (self.xdp.value,)
        if self.xdp is Xdp.AUTO and self.tc.link_kind(link.index) == "veth":
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
                if not self.tc.attach_xdp(link.index, fd, mode, replace):
                    return "vanished"
            except DataplaneError as err:
                errors.append(f"{mode}: {err}")
                continue
            self.xdp_modes[link.name] = mode
            return mode
        why = "; ".join(errors)
        self.xdp_modes[link.name] = f"failed: {why}"  # /state says so either way
        if self.xdp is not Xdp.AUTO:
            raise DataplaneError("xdp", f"--xdp={self.xdp} on {link.name}: {why}")
        log.warning("ebpf: XDP could not be attached to %s (tc handles it alone): %s",
                    link.name, why)  # fmt: skip
        return self.xdp_modes[link.name]

    def follow_node(self, node: NodeInfo, full: bool) -> None:
        """Without --external-interfaces, the external interfaces are those that carry
        the node's NodePort addresses: looked up again when the node changes and at full
        resyncs (an interface that gets the address later is found then)."""
        if self._external is not None or (node == self._node and not full):
            return
        self._node = node
        names = external.interfaces_with(self.tc.addresses(), node.nodeport_ips())
        links = {link.name: link for link in self.tc.links()}
        for index, name in list(self._external_attached.items()):
            if name not in names and links.get(name, Link(-1, name)).index == index:
                self.tc.detach(index)
                detach_xdp(self.tc, index)
                self.xdp_modes.pop(name, None)
                del self._external_attached[index]
                log.info("ebpf: %s no longer carries a NodePort address: detached", name)
        for name in sorted(names):
            link = links.get(name)
            if link is not None and link.index not in self._external_attached:
                if self._pods.matches(name):
                    continue  # a pod interface is never external
                self._attach_external(link)

    def status(self) -> dict[str, object]:
        """What /state's status adds for this dataplane: the socket hooks, the external
        interfaces and the XDP mode on each."""
        names = sorted(self._external_attached.values())
        return {
            "tcAttach": self.tc.mode,
            "socketHooks": {
                "cgroup": str(self.cgroup) if self.cgroup is not None else None,
                "state": self.socket_hooks,
                "socketLb": self.socket_lb.value,
                "pods": len(self.pod_netns.pods()) if self.pod_netns is not None else 0,
                "podsPending": self.pod_netns.pending() if self.pod_netns is not None else [],
            },
            "externalInterfaces": names,
            "xdp": {
                "enabled": self.xdp is not Xdp.OFF,
                "requested": self.xdp.value,
                "interfaces": {n: self.xdp_modes[n] for n in names if n in self.xdp_modes},
            },
        }
