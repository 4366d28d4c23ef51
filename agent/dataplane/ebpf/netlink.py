"""Netlink for the eBPF dataplane: attach tc programs to pod interfaces, as tcx links
(kernel 6.6+) or as clsact direct-action filters, and watch for new interfaces; the only
module in agent/ that imports pyroute2."""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fnmatch
import ipaddress
import logging
import os
import queue
import select
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink import (
    NLM_F_DUMP,
    NLM_F_DUMP_INTR,
    NLM_F_REQUEST,
    NLMSG_DONE,
    nla,
    nlmsg,
)
from pyroute2.netlink.exceptions import NetlinkError as KernelNetlinkError
from pyroute2.netlink.rtnl import (
    RTM_DELLINK,
    RTM_DELNEIGH,
    RTM_DELROUTE,
    RTM_DELRULE,
    RTM_GETLINK,
    RTM_GETNEIGH,
    RTM_NEWLINK,
    RTM_NEWNEIGH,
    RTM_NEWROUTE,
    RTM_NEWRULE,
    RTM_NEWTFILTER,
    RTMGRP_LINK,
)
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.marshal import MarshalRtnl
from pyroute2.netlink.rtnl.ndmsg import ndmsg
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from ..base import DataplaneError
from ..netns import netns_path, setns
from ..options import DEFAULT_POD_INTERFACES
from . import libbpf
from .options import TcAttach

log = logging.getLogger(__name__)

Direction = Literal["ingress", "egress"]

# clsact's two hook points, as tc parents: ffff:fff2 (packets the interface receives,
# i.e. leaving the pod) and ffff:fff3 (packets it transmits, i.e. towards the pod).
TC_PARENTS: dict[str, int] = {"ingress": 0xFFFF_FFF2, "egress": 0xFFFF_FFF3}
# Our filters' fixed place in each hook. Priority 1 runs first, so services are
# translated before any other classifier (a CNI's policy program) looks at the packet.
# The handle spells "kbp" so it is unlikely to be anyone else's, and attach refuses to
# replace a filter there that is not ours.
FILTER_PRIORITY = 1
FILTER_HANDLE = 0x6B6270
# Every filter we install carries a bpf name with this prefix; detach removes only those.
FILTER_NAME_PREFIX = "kbp_"

# How tc programs are attached (--tc-attach, env KBP_TC_ATTACH): tcx links where the
# kernel has them (6.6+) and the attacher has a bpffs directory to pin them in, else
# clsact; `tcx` insists, `clsact` forces the qdisc and filters.
TC_ATTACH_MODES = tuple(TcAttach)
TC_ATTACH_ENV = "KBP_TC_ATTACH"
TCX_ATTACH_TYPES: dict[str, int] = {
    "ingress": libbpf.BPF_TCX_INGRESS,
    "egress": libbpf.BPF_TCX_EGRESS,
}
# Our tcx links are pinned as <pin dir>/kbp_tcx_<ifindex>_<direction>: the pin keeps the
# link (and so the program) attached while no agent runs, and lets the next agent swap
# the program in place with BPF_LINK_UPDATE. One pin directory per network namespace.
TCX_PIN_PREFIX = "kbp_tcx_"
_LOOPBACK_IFINDEX = 1  # every network namespace's lo

_CLSACT_HANDLE = 0xFFFF_0000
_ETH_P_ALL = 0x0003
_START_TIMEOUT_S = 10.0

_T = TypeVar("_T")
_Call = tuple[Callable[[], Any], concurrent.futures.Future]


@dataclass(frozen=True, slots=True)
class Link:
    """A network interface in the attacher's namespace."""

    index: int
    name: str


@dataclass(frozen=True, slots=True)
class Attachment:
    """One of our filters as the kernel reports it."""

    index: int
    ifname: str
    direction: Direction
    name: str
    prog_id: int
    hook: str = "clsact"  # clsact (a cls_bpf filter) or tcx (a bpf_link)
    link_id: int = 0  # tcx: the link's id (bpftool link show id N)


def tcx_supported() -> bool:
    """Does the kernel attach tc programs as tcx links? Asked of the loopback interface
    of the calling thread's namespace with BPF_PROG_QUERY on BPF_TCX_INGRESS: kernels
    before 6.6 answer EINVAL (an attach type they do not know); no side effect."""
    try:
        libbpf.tcx_query(_LOOPBACK_IFINDEX, libbpf.BPF_TCX_INGRESS, capacity=1)
    except OSError as exc:
        log.debug("tcx is not available: %s", exc)
        return False
    return True


def _prog_is_ours(prog_id: int) -> bool:
    try:
        return libbpf.prog_name(prog_id).startswith(FILTER_NAME_PREFIX)
    except OSError:  # unloaded meanwhile
        return False


# XDP attach modes (IFLA_XDP_FLAGS, uapi/linux/if_link.h) and how the kernel reports them
# (IFLA_XDP_ATTACHED as pyroute2 decodes it).
XDP_FLAGS_UPDATE_IF_NOEXIST = 1
XDP_MODE_FLAGS = {"generic": 2, "native": 4}
XDP_ATTACHED_MODES = {"xdp": "native", "xdpgeneric": "generic", "xdpoffload": "offload"}


@dataclass(frozen=True, slots=True)
class XdpAttachment:
    """The XDP program on an interface as the kernel reports it."""

    index: int
    ifname: str
    mode: str  # native | generic | offload
    prog_id: int


class NetlinkError(DataplaneError):
    """A netlink request failed; the message names the interface (or namespace) and errno."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__("netlink", message)
        self.code = code


@dataclass(frozen=True)
class PodInterfaces:
    """Which interface names are pod-facing, as fnmatch globs (case-sensitive)."""

    globs: tuple[str, ...] = DEFAULT_POD_INTERFACES

    def __init__(self, globs: Sequence[str] = DEFAULT_POD_INTERFACES) -> None:
        if isinstance(globs, str):
            raise TypeError("PodInterfaces takes a sequence of globs, not one string")
        cleaned = tuple(glob.strip() for glob in globs)
        if not cleaned or any(not glob for glob in cleaned):
            raise ValueError(f"pod interface globs must be non-empty strings, got {globs!r}")
        object.__setattr__(self, "globs", cleaned)

    @classmethod
    def from_text(cls, text: str) -> PodInterfaces:
        """Parse a comma-separated list, as given to --pod-interfaces."""
        return cls([part for part in text.split(",") if part.strip()])

    def matches(self, ifname: str) -> bool:
        return any(fnmatch.fnmatchcase(ifname, glob) for glob in self.globs)


def enter_netns(netns: str) -> None:
    """Move the calling thread (only) into a network namespace."""
    path = netns_path(netns)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        message = f"cannot open network namespace {path}: {exc.strerror}"
        raise NetlinkError(message, exc.errno) from exc
    try:
        setns(fd)
    except OSError as exc:
        raise NetlinkError(f"cannot enter network namespace {path}: {exc.strerror}",
                           exc.errno) from exc  # fmt: skip
    finally:
        os.close(fd)


_RTM_GETNSID, _RTM_NEWNSID = 90, 88  # uapi/linux/rtnetlink.h
_NETNSA_NSID, _NETNSA_FD = 1, 3  # uapi/linux/net_namespace.h
_NLMSG_ERROR = 2


def _netns_id(netns: str) -> int | None:
    """RTM_GETNSID for the namespace at path `netns`, asked from the calling thread's
    namespace (pyroute2 0.9 has no request for it)."""
    try:
        fd = os.open(netns, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                           socket.NETLINK_ROUTE) as sock:  # fmt: skip
            attr = struct.pack("=HHI", 8, _NETNSA_FD, fd)
            body = struct.pack("=B3x", socket.AF_UNSPEC) + attr
            header = struct.pack("=IHHII", 16 + len(body), _RTM_GETNSID, NLM_F_REQUEST, 1, 0)
            sock.settimeout(_START_TIMEOUT_S)
            sock.send(header + body)
            data = sock.recv(4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    _length, kind = struct.unpack_from("=IH", data)
    if kind != _RTM_NEWNSID:
        return None
    offset = 16 + 4
    while offset + 4 <= len(data):
        size, attr_type = struct.unpack_from("=HH", data, offset)
        if size < 4:
            break
        if attr_type == _NETNSA_NSID:
            (nsid,) = struct.unpack_from("=i", data, offset + 4)
            return nsid if nsid >= 0 else None
        offset += (size + 3) & ~3
    return None


def run_in_netns(netns: str, function: Callable[[], _T]) -> _T:
    """function() run on a short-lived thread that entered the network namespace at
    `netns` (a name under /run/netns or a path): setns() changes only that thread."""
    outcome: list[Any] = []

    def in_namespace() -> None:
        try:
            enter_netns(netns)
            outcome.append((True, function()))
        except BaseException as err:
            outcome.append((False, err))

    thread = threading.Thread(target=in_namespace, name=f"kbp-netns {netns}")
    thread.start()
    thread.join()
    ((ok, result),) = outcome
    if not ok:
        raise result
    return result


def interface_addresses(index: int) -> list[str]:
    """The global addresses of interface `index` of the calling thread's namespace (run
    it through run_in_netns), IPv4 first."""
    with IPRoute(groups=0) as ipr:
        found = [ipaddress.ip_address(msg.get_attr("IFA_ADDRESS"))
                 for msg in ipr.get_addr(index=index)
                 if msg["scope"] == 0 and msg.get_attr("IFA_ADDRESS")]  # fmt: skip
    return [str(a) for a in sorted(found, key=lambda a: (a.version, a))]


class _NamespaceThread:
    """One thread that lives in a network namespace and runs the calls given to it.

    Netlink sockets belong to the namespace they were created in; creating ours on a
    thread that setns()'d keeps the rest of the process where it is, and since threads
    share the fd table, BPF program fds of this process can go into the messages.
    pyroute2 0.9's synchronous IPRoute also wants to be used from the thread that made
    it, so every call for one attacher runs here, serialised.
    """

    def __init__(self, netns: str | None, name: str, setup: Callable[[], Any]) -> None:
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders put() against stop(): nothing after the end
        self._stopped = False
        self._state: Any = None
        self._netns = netns
        self._setup = setup
        self._started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        try:
            self._started.result(timeout=_START_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            self.stop(lambda: None)
            raise NetlinkError(f"netlink thread {name} did not start") from None

    @property
    def state(self) -> Any:
        return self._state

    def _main(self) -> None:
        try:
            if self._netns is not None:
                enter_netns(self._netns)
            self._state = self._setup()
        except BaseException as exc:
            self._started.set_exception(exc)
            return
        self._started.set_result(None)
        while (item := self._calls.get()) is not None:
            call, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:
                    future.set_exception(exc)

    def call(self, function: Callable[[], _T]) -> _T:
        if threading.current_thread() is self._thread:
            return function()
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        with self._lock:
            if self._stopped or not self._thread.is_alive():
                raise NetlinkError("the netlink thread has stopped (attacher closed)")
            self._calls.put((function, future))
        return future.result()

    def stop(self, finish: Callable[[], None]) -> None:
        """Run `finish` after every call already queued, then end the thread."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._calls.put((finish, concurrent.futures.Future()))
            self._calls.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()


class _BpfFilterOptions(nla):
    """cls_bpf's TCA_OPTIONS with the attributes pyroute2 0.9.7 does not decode
    (TCA_BPF_ID and friends); values follow include/uapi/linux/pkt_cls.h."""

    nla_map = (
        ("TCA_BPF_UNSPEC", "none"),
        ("TCA_BPF_ACT", "hex"),
        ("TCA_BPF_POLICE", "hex"),
        ("TCA_BPF_CLASSID", "uint32"),
        ("TCA_BPF_OPS_LEN", "uint32"),
        ("TCA_BPF_OPS", "hex"),
        ("TCA_BPF_FD", "uint32"),
        ("TCA_BPF_NAME", "asciiz"),
        ("TCA_BPF_FLAGS", "uint32"),
        ("TCA_BPF_FLAGS_GEN", "uint32"),
        ("TCA_BPF_TAG", "hex"),
        ("TCA_BPF_ID", "uint32"),
    )


class _OpaqueOptions(nla):
    """Options of other classifiers: kept undecoded, we only need their kind."""

    nla_map = (("TCA_OPAQUE_UNSPEC", "none"),)


class _FilterMessage(nlmsg):
    """RTM_NEWTFILTER as dumped, decoding cls_bpf's program id.

    Deliberately not a tcmsg subclass: pyroute2 caches a compiled attribute table per
    class hierarchy, so a subclass would silently keep tcmsg's decoders.
    """

    prefix = "TCA_"
    fields = tcmsg.fields
    nla_map = (
        ("TCA_UNSPEC", "none"),
        ("TCA_KIND", "asciiz"),
        ("TCA_OPTIONS", "get_options"),
    )

    @staticmethod
    def get_options(self: nlmsg, *argv: Any, **kwarg: Any) -> type[nla]:
        return _BpfFilterOptions if self.get_attr("TCA_KIND") == "bpf" else _OpaqueOptions


@dataclass(frozen=True, slots=True)
class _Filter:
    """A tc filter on one clsact hook, reduced to what attach/detach decide on."""

    priority: int
    handle: int
    kind: str
    name: str | None
    prog_id: int | None

    @property
    def ours(self) -> bool:
        return self.kind == "bpf" and (self.name or "").startswith(FILTER_NAME_PREFIX)


class TcAttacher:
    """Attaches our tc programs to interfaces of one network namespace.

    `netns` None means the namespace this process is in; otherwise a name under
    /run/netns (or a path such as /proc/PID/ns/net). Safe to use from several threads.

    `pin_dir` (a bpffs directory, one per namespace) and `mode` (auto, tcx or clsact;
    None: $KBP_TC_ATTACH, else auto) choose how programs attach: tcx links pinned there
    when the kernel has tcx and the mode allows it, else clsact filters (also always
    without a pin directory: an unpinned link would end with this process, so only an
    explicit mode tcx is refused there, not one from the environment). Whatever
    the mode, detach, attached and attach's clean-up handle both kinds, so an agent
    moves an interface from one to the other without a gap.
    """

    def __init__(
        self, netns: str | None = None, pin_dir: str | Path | None = None,
        mode: str | None = None,
    ) -> None:  # fmt: skip
        self.netns = netns
        where = "the current namespace" if netns is None else f"netns {netns}"
        self._where = where
        requested = mode or os.environ.get(TC_ATTACH_ENV) or "auto"
        if requested not in TC_ATTACH_MODES:
            raise ValueError(f"tc attach mode must be one of {', '.join(TC_ATTACH_MODES)}; "
                             f"got {requested!r}")  # fmt: skip
        if mode == "tcx" and pin_dir is None:  # ($KBP_TC_ATTACH may say tcx to tools)
            raise ValueError("tc attach mode tcx needs a bpffs directory to pin the links in")
        self.pin_dir = Path(pin_dir) if pin_dir is not None else None
        # tcx links this attacher made or updated, by (ifindex, direction): their fds are
        # held as well as pinned, so that a pin removed under a running agent (rm -r of
        # the pin directory) detaches nothing; the keeper pins them again. Used on the
        # namespace thread only.
        self._held: dict[tuple[int, str], int] = {}
        self._worker = _NamespaceThread(netns, f"kbp-netlink-{netns or 'self'}", self._open)
        self.tcx_available = self._worker.call(tcx_supported)
        if requested == "tcx" and self.pin_dir is not None and not self.tcx_available:
            self.close()
            raise NetlinkError("tc attach mode tcx: this kernel has no tcx (BPF_PROG_QUERY on "
                               "BPF_TCX_INGRESS fails; tcx needs Linux 6.6+)")  # fmt: skip
        use_tcx = requested != "clsact" and self.tcx_available and self.pin_dir is not None
        self.mode: Literal["tcx", "clsact"] = "tcx" if use_tcx else "clsact"
        if self.mode == "tcx":
            self._worker.call(self._sweep_pins)

    @staticmethod
    def _open() -> IPRoute:
        # groups=0: this socket only asks; events are the LinkWatcher's job.
        ipr = IPRoute(groups=0)
        # The marshal is per socket: decode filter dumps with the program id.
        ipr.asyncore.marshal.msg_map[RTM_NEWTFILTER] = _FilterMessage
        return ipr

    @property
    def _ipr(self) -> IPRoute:
        return self._worker.state

    def close(self) -> None:
        """Close the netlink socket; what is attached stays attached."""

        def finish() -> None:
            for fd in self._held.values():
                os.close(fd)  # the pins hold the links from here on
            self._held.clear()
            self._ipr.close()

        self._worker.stop(finish)

    def __enter__(self) -> TcAttacher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- public API: every call runs on the namespace thread --

    def links(self) -> list[Link]:
        """Every interface in the namespace."""
        return self._worker.call(self._links)

    def link_kind(self, index: int) -> str | None:
        """The interface's link kind (veth, bridge, vxlan, ...); None for a plain device
        such as a NIC, or when the interface is gone."""
        return self._worker.call(lambda: self._link_kind(index))

    def attach(self, index: int, direction: Direction, prog_fd: int, name: str) -> bool:
        """Install (or atomically replace) our program on one hook of an interface.

        tcx: swaps the program of our pinned link in place (BPF_LINK_UPDATE), else makes
        a link placed before every other tcx program and pins it. clsact: adds the qdisc
        when missing, then replaces the bpf filter at our fixed priority and handle. Only
        then goes our program of the other kind on that hook (an earlier agent's): tcx
        runs before clsact and our programs end the hook with their verdict, so while
        both are attached only the tcx one runs, and the hook is never without one.
        Returns False when the interface vanished meanwhile.
        """
        if direction not in TC_PARENTS:
            raise ValueError(f"direction must be 'ingress' or 'egress', not {direction!r}")
        if not name.startswith(FILTER_NAME_PREFIX):
            raise ValueError(f"filter name {name!r} must start with {FILTER_NAME_PREFIX!r}")
        if self.mode == "tcx":
            return self._worker.call(lambda: self._attach_tcx(index, direction, prog_fd, name))
        return self._worker.call(lambda: self._attach(index, direction, prog_fd, name))

    def detach(self, index: int) -> int:
        """Remove our programs from an interface: tcx links running a kbp_ program (and
        our pins of links to it, also once it is gone), filters named kbp_, and its clsact
        qdisc when no other filter remains. Returns how many programs went."""
        return self._worker.call(lambda: self._detach(index))

    def attached(self) -> list[Attachment]:
        """Our programs on every interface of the namespace, tcx links and filters."""
        return self._worker.call(self._attached)

    def forget(self, index: int) -> list[str]:
        """An interface went away: unpin our tcx links to it (the kernel detached them
        with the interface; filters go with it by themselves). Returns the pins removed."""
        if self.pin_dir is None:
            return []
        pins = [self._pin(index, direction) for direction in ("ingress", "egress")]

        def forget() -> list[str]:
            for direction in ("ingress", "egress"):
                self._release(index, direction)
            return self._sweep_pins(pins)

        return self._worker.call(forget)

    def pinned(self, index: int, direction: Direction) -> bool:
        """Is our tcx link on this hook pinned where it should be? Always True with
        clsact filters (nothing to pin)."""
        if self.mode != "tcx" or self.pin_dir is None:
            return True
        return self._pin(index, direction).exists()

    def route_index(self, ip: str) -> int | None:
        """The interface index this namespace routes `ip` through; None without a route."""
        return self._worker.call(lambda: self._route_index(ip))

    def _route_index(self, ip: str) -> int | None:
        try:
            routes = self._ipr.route("get", dst=ip)
        except KernelNetlinkError:
            return None
        for route in routes:
            oif = route.get_attr("RTA_OIF")
            if oif:
                return int(oif)
        return None

    def addresses(self) -> dict[str, set[str]]:
        """Interface name → its IP addresses (canonical text), every interface."""
        return self._worker.call(self._addresses)

    def veth_peer(self, index: int) -> tuple[int, int] | None:
        """(the peer's ifindex, the peer namespace's id as this namespace numbers it) of
        a veth whose peer lives in another namespace; None otherwise or when gone."""
        return self._worker.call(lambda: self._veth_peer(index))

    def netns_id(self, netns: str) -> int | None:
        """The id this namespace gives the network namespace at `netns` (a path), as
        IFLA_LINK_NETNSID reports it; None when it has none or cannot be opened."""
        return self._worker.call(lambda: _netns_id(netns))

    def attach_xdp(self, index: int, prog_fd: int, mode: str, replace_id: int = 0) -> bool:
        """Attach an XDP program in `mode` (native or generic). `replace_id`: the id of
        the program now attached that may be replaced (ours, from an earlier agent); any
        other program already there is refused (the kernel checks, atomically). Returns
        False when the interface vanished meanwhile."""
        return self._worker.call(lambda: self._attach_xdp(index, prog_fd, mode, replace_id))

    def detach_xdp(self, index: int, mode: str) -> None:
        return self._worker.call(lambda: self._set_xdp(index, -1, XDP_MODE_FLAGS[mode]))

    def xdp(self) -> list[XdpAttachment]:
        """The XDP program of every interface that has one (anyone's)."""
        return self._worker.call(self._xdp)

    # -- implementation, on the namespace thread --

    def _addresses(self) -> dict[str, set[str]]:
        names = {link.index: link.name for link in self._links()}
        found: dict[str, set[str]] = {}
        for msg in self._ipr.get_addr():
            address = msg.get_attr("IFA_ADDRESS")
            name = names.get(msg["index"])
            if address and name:
                found.setdefault(name, set()).add(str(ipaddress.ip_address(address)))
        return found

    def _veth_peer(self, index: int) -> tuple[int, int] | None:
        try:
            (msg,) = self._ipr.link("get", index=index)
        except KernelNetlinkError:
            return None
        peer, nsid = msg.get_attr("IFLA_LINK"), msg.get_attr("IFLA_LINK_NETNSID")
        if not peer or nsid is None or nsid < 0:
            return None
        return peer, nsid

    def _set_xdp(self, index: int, prog_fd: int, flags: int) -> None:
        attrs = [("IFLA_XDP_FD", prog_fd), ("IFLA_XDP_FLAGS", flags)]
        self._ipr.link("set", index=index, xdp={"attrs": attrs})

    def _attach_xdp(self, index: int, prog_fd: int, mode: str, replace_id: int) -> bool:
        current = next((x for x in self._xdp() if x.index == index), None)
        flags = XDP_MODE_FLAGS[mode]
        try:
            if current is not None and current.prog_id != replace_id:
                raise NetlinkError(
                    f"cannot attach XDP to {self._describe(index)}: program id "
                    f"{current.prog_id} not installed by kube-bpf-proxy holds it; left it alone"
                )
            if current is not None and current.mode != mode:
                # Another mode's program must go first: the kernel refuses a second mode.
                self._set_xdp(index, -1, XDP_MODE_FLAGS.get(current.mode, 0))
                current = None
            if current is None:
                flags |= XDP_FLAGS_UPDATE_IF_NOEXIST
            self._set_xdp(index, prog_fd, flags)
        except KernelNetlinkError as exc:
            if self._vanished(index, "attach XDP", exc):
                return False
            raise NetlinkError(
                f"cannot attach XDP ({mode}) to {self._describe(index)}: {os.strerror(exc.code)}",
                exc.code,
            ) from exc
        return True

    def _xdp(self) -> list[XdpAttachment]:
        found = []
        for msg in self._ipr.link("dump"):
            xdp = msg.get_attr("IFLA_XDP")
            if xdp is None:
                continue
            mode = XDP_ATTACHED_MODES.get(xdp.get_attr("IFLA_XDP_ATTACHED"))
            prog_id = xdp.get_attr("IFLA_XDP_PROG_ID")
            if mode and prog_id:
                found.append(
                    XdpAttachment(msg["index"], msg.get_attr("IFLA_IFNAME") or "", mode, prog_id)
                )
        return found

    def _links(self) -> list[Link]:
        return [
            Link(msg["index"], msg.get_attr("IFLA_IFNAME"))
            for msg in self._ipr.link("dump")
            if msg.get_attr("IFLA_IFNAME") is not None
        ]

    def _link_kind(self, index: int) -> str | None:
        try:
            (msg,) = self._ipr.link("get", index=index)
        except KernelNetlinkError:
            return None
        info = msg.get_attr("IFLA_LINKINFO")
        return info.get_attr("IFLA_INFO_KIND") if info is not None else None

    def _ifname(self, index: int) -> str | None:
        try:
            (msg,) = self._ipr.link("get", index=index)
        except KernelNetlinkError:
            return None
        return msg.get_attr("IFLA_IFNAME")

    def _describe(self, index: int) -> str:
        ifname = self._ifname(index)
        who = f"interface {ifname} (index {index})" if ifname else f"interface index {index}"
        return f"{who} in {self._where}"

    def _filters(self, index: int, direction: Direction) -> list[_Filter]:
        """Filters on one hook; empty when the interface has no clsact qdisc."""
        try:
            messages = self._ipr.get_filters(index=index, parent=TC_PARENTS[direction])
        except KernelNetlinkError as exc:
            # No clsact (no ingress/egress block) answers EINVAL or ENOENT: no filters.
            if exc.code in (errno.EINVAL, errno.ENOENT):
                return []
            raise
        found = []
        for msg in messages:
            options = msg.get_attr("TCA_OPTIONS")
            if options is None:
                continue  # the per-priority header entry, not a filter
            found.append(
                _Filter(
                    priority=msg["info"] >> 16,
                    handle=msg["handle"],
                    kind=msg.get_attr("TCA_KIND"),
                    name=options.get_attr("TCA_BPF_NAME"),
                    prog_id=options.get_attr("TCA_BPF_ID"),
                )
            )
        return found

    def _vanished(self, index: int, action: str, exc: KernelNetlinkError) -> bool:
        """True (logged at debug) when a failure is explained by the interface being gone."""
        if self._ifname(index) is not None:
            return False
        log.debug("%s: interface index %d in %s vanished (%s)", action, index, self._where, exc)
        return True

    def _attach(self, index: int, direction: Direction, prog_fd: int, name: str) -> bool:
        parent = TC_PARENTS[direction]
        try:
            try:
                self._ipr.tc("add", "clsact", index)
            except KernelNetlinkError as exc:
                if exc.code != errno.EEXIST:
                    raise
            self._refuse_foreign_filters(index, direction)
            self._ipr.tc(
                "replace-filter",
                "bpf",
                index,
                FILTER_HANDLE,
                parent=parent,
                prio=FILTER_PRIORITY,
                protocol=_ETH_P_ALL,
                fd=prog_fd,
                name=name,
                direct_action=True,
            )
        except KernelNetlinkError as exc:
            if self._vanished(index, f"attach {name}", exc):
                return False
            hint = ""
            if exc.code == errno.EINVAL:
                hint = " (not a tc program fd, or another qdisc in clsact's place?)"
            raise NetlinkError(
                f"cannot attach {name} to {direction} of {self._describe(index)}: "
                f"{os.strerror(exc.code)}{hint}",
                exc.code,
            ) from exc
        self._remove_tcx(index, direction)  # an agent that used tcx before (--tc-attach)
        return True

    # -- tcx --

    def _pin(self, index: int, direction: Direction) -> Path:
        assert self.pin_dir is not None
        return self.pin_dir / f"{TCX_PIN_PREFIX}{index}_{direction}"

    def _pins(self) -> list[Path]:
        if self.pin_dir is None or not self.pin_dir.is_dir():
            return []
        return sorted(p for p in self.pin_dir.iterdir() if p.name.startswith(TCX_PIN_PREFIX))

    def _sweep_pins(self, pins: Sequence[Path] | None = None) -> list[str]:
        """Unpin our links (all, or those pinned at `pins`) whose interface is gone: the
        kernel detached them then and the pin only kept the defunct link. Returns the
        pins removed."""
        removed = []
        for pin in self._pins() if pins is None else pins:
            try:
                link_fd = libbpf.obj_get(str(pin))
            except OSError:
                continue
            try:
                info = libbpf.link_info(link_fd)
            finally:
                os.close(link_fd)
            if info.type == libbpf.BPF_LINK_TYPE_TCX and info.tcx_ifindex == 0:
                pin.unlink(missing_ok=True)
                removed.append(pin.name)
        if removed:
            log.debug("tcx: unpinned the links of removed interfaces: %s", " ".join(removed))
        return removed

    def _hold(self, index: int, direction: Direction, link_fd: int) -> None:
        previous = self._held.pop((index, direction), None)
        if previous is not None and previous != link_fd:
            os.close(previous)
        self._held[(index, direction)] = link_fd

    def _release(self, index: int, direction: str) -> None:
        held = self._held.pop((index, direction), None)
        if held is not None:
            os.close(held)

    def _update_held(self, pin: Path, index: int, direction: Direction, prog_fd: int) -> int:
        """Swap the program of the link we hold on this hook, pinning it again if its pin
        was removed; its link id, or 0 when we hold none that is still attached there."""
        link_fd = self._held.get((index, direction))
        if link_fd is None:
            return 0
        info = libbpf.link_info(link_fd)
        where = (info.tcx_ifindex, info.tcx_attach_type)
        if where != (index, TCX_ATTACH_TYPES[direction]) or not libbpf.link_update_and_pin(
            link_fd, prog_fd, str(pin)
        ):
            self._release(index, direction)  # defunct: its interface went
            return 0
        return info.id

    def _update_pinned(
        self, pin: Path, index: int, direction: Direction, prog_fd: int
    ) -> int:  # fmt: skip
        """Swap the program of our pinned link in place (and hold it); returns its link
        id, or 0 when there is no usable link there (none, or a defunct one: unpinned)."""
        if not pin.exists():
            return 0
        attach_type = TCX_ATTACH_TYPES[direction]
        link_fd = libbpf.obj_get(str(pin))
        try:
            info = libbpf.link_info(link_fd)
            if (info.type, info.tcx_ifindex, info.tcx_attach_type) == (
                libbpf.BPF_LINK_TYPE_TCX, index, attach_type,
            ):  # fmt: skip
                try:
                    libbpf.link_update(link_fd, prog_fd)
                    self._hold(index, direction, link_fd)
                    link_fd = -1
                    return info.id
                except OSError as exc:
                    if exc.errno != errno.ENOLINK:  # ENOLINK: the interface just went
                        raise
            with contextlib.suppress(OSError):  # defunct already
                libbpf.link_detach(link_fd)
        finally:
            if link_fd >= 0:
                os.close(link_fd)
        pin.unlink(missing_ok=True)
        return 0

    def _attach_tcx(self, index: int, direction: Direction, prog_fd: int, name: str) -> bool:
        pin = self._pin(index, direction)
        attach_type = TCX_ATTACH_TYPES[direction]
        try:
            link_id = self._update_held(pin, index, direction, prog_fd) or self._update_pinned(
                pin, index, direction, prog_fd
            )
            if not link_id:
                # First among the hook's tcx programs, as priority 1 is under clsact:
                # services are translated before another program (a CNI's) sees packets.
                link_fd = libbpf.tcx_link_create(prog_fd, index, attach_type, libbpf.BPF_F_BEFORE)
                try:
                    link_id = libbpf.link_info(link_fd).id
                    pin.parent.mkdir(parents=True, exist_ok=True)
                    libbpf.obj_pin(link_fd, str(pin))
                except BaseException:
                    os.close(link_fd)
                    raise
                self._hold(index, direction, link_fd)  # beside the pin, see _held
        except OSError as exc:
            if exc.errno in (errno.ENODEV, errno.ENOLINK) or self._ifname(index) is None:
                log.debug("attach %s: interface index %d in %s vanished (%s)", name, index,
                          self._where, exc)  # fmt: skip
                pin.unlink(missing_ok=True)
                return False
            raise NetlinkError(
                f"cannot attach {name} to tcx {direction} of {self._describe(index)}: "
                f"{exc.strerror}",
                exc.errno,
            ) from exc
        # Now the hook runs the new program: an earlier agent's copy of ours may go.
        self._remove_tcx(index, direction, keep=link_id)
        try:
            self._detach_filters(index, (direction,))
        except KernelNetlinkError as exc:
            if self._vanished(index, "detach the clsact filter", exc):
                return False
            raise NetlinkError(
                f"attached {name} to tcx {direction} of {self._describe(index)} but cannot "
                f"remove our clsact filter there: {os.strerror(exc.code)}",
                exc.code,
            ) from exc
        return True

    def _tcx_programs(self, index: int, direction: Direction) -> list[tuple[int, int]]:
        """(program id, link id) of the hook's tcx programs; none without tcx or once the
        interface is gone."""
        if not self.tcx_available:
            return []
        try:
            return libbpf.tcx_query(index, TCX_ATTACH_TYPES[direction])
        except OSError as exc:
            if exc.errno in (errno.ENODEV, errno.EINVAL):
                return []
            raise

    def _remove_tcx(self, index: int, direction: Direction, keep: int = 0) -> int:
        """Detach our tcx links from one hook (a kbp_ program, whoever pinned it) but the
        link `keep`, and unpin ours. Returns how many links went."""
        removed = 0
        for prog_id, link_id in self._tcx_programs(index, direction):
            if not link_id or link_id == keep or not _prog_is_ours(prog_id):
                continue
            try:
                link_fd = libbpf.link_fd_by_id(link_id)
            except OSError:
                continue  # released meanwhile
            try:
                libbpf.link_detach(link_fd)
                removed += 1
            except OSError as exc:
                if exc.errno != errno.ENOLINK:
                    raise
            finally:
                os.close(link_fd)
        if not keep:
            self._release(index, direction)
            if self.pin_dir is not None:
                self._pin(index, direction).unlink(missing_ok=True)
        return removed

    def _refuse_foreign_filters(self, index: int, direction: Direction) -> None:
        """Our priority must hold only our kind of filter, and our handle only ours."""
        for existing in self._filters(index, direction):
            if existing.priority != FILTER_PRIORITY:
                continue
            if existing.kind != "bpf" or (existing.handle == FILTER_HANDLE and not existing.ours):
                what = f"a {existing.kind} filter"
                if existing.name:
                    what += f" named {existing.name!r}"
                raise NetlinkError(
                    f"cannot attach to {direction} of {self._describe(index)}: {what} "
                    f"not installed by kube-bpf-proxy holds priority {FILTER_PRIORITY} "
                    f"handle {existing.handle:#x}; left it alone"
                )

    def _detach_filters(self, index: int, directions: Sequence[Direction]) -> int:
        """Delete our filters from these clsact hooks, then the qdisc when no filter is
        left on either. Returns how many went; KernelNetlinkError on failure."""
        removed = 0
        for direction in directions:
            for existing in self._filters(index, direction):
                if existing.ours:
                    self._ipr.tc("del-filter", "bpf", index, existing.handle,
                                 parent=TC_PARENTS[direction], prio=existing.priority,
                                 protocol=_ETH_P_ALL)  # fmt: skip
                    removed += 1
        if removed and not any(self._filters(index, d) for d in ("ingress", "egress")):
            try:
                self._ipr.tc("del", "clsact", index)
            except KernelNetlinkError as exc:
                if exc.code not in (errno.EINVAL, errno.ENOENT):
                    raise
        return removed

    def _detach(self, index: int) -> int:
        removed = 0
        try:
            for direction in ("ingress", "egress"):
                removed += self._remove_tcx(index, direction)
        except OSError as exc:
            raise NetlinkError(
                f"cannot detach the tcx links of {self._describe(index)}: {exc.strerror}",
                exc.errno,
            ) from exc
        try:
            removed += self._detach_filters(index, ("ingress", "egress"))
        except KernelNetlinkError as exc:
            if self._vanished(index, "detach", exc):
                return removed
            raise NetlinkError(
                f"cannot detach from {self._describe(index)}: {os.strerror(exc.code)}",
                exc.code,
            ) from exc
        return removed

    def _attached(self) -> list[Attachment]:
        names = {link.index: link.name for link in self._links()}
        with_clsact = sorted(
            {
                msg["index"]
                for msg in self._ipr.get_qdiscs()
                if msg.get_attr("TCA_KIND") == "clsact" and msg["handle"] == _CLSACT_HANDLE
            }
        )
        found = []
        for index in with_clsact:
            for direction in TC_PARENTS:
                try:
                    filters = self._filters(index, direction)  # type: ignore[arg-type]
                except KernelNetlinkError as exc:
                    if self._vanished(index, "list filters", exc):
                        break
                    raise NetlinkError(
                        f"cannot list filters of {self._describe(index)}: {os.strerror(exc.code)}",
                        exc.code,
                    ) from exc
                found.extend(
                    Attachment(
                        index=index,
                        ifname=names.get(index, f"if{index}"),
                        direction=direction,  # type: ignore[arg-type]
                        name=existing.name or "",
                        prog_id=existing.prog_id or 0,
                    )
                    for existing in filters
                    if existing.ours
                )
        for index, ifname in sorted(names.items()):
            for direction in ("ingress", "egress"):
                for prog_id, link_id in self._tcx_programs(index, direction):
                    if link_id and _prog_is_ours(prog_id):
                        found.append(Attachment(index, ifname, direction,
                                                libbpf.prog_name(prog_id), prog_id, "tcx",
                                                link_id))  # fmt: skip
        return found


class _Watcher:
    """A thread reading an rtnetlink socket subscribed to some groups (`_subscribe`), in
    namespace `netns` (None: this thread's), until stop(); `_loop` reads it and sets
    `_scanned` once its first dump was read, which start() waits for."""

    what = "watcher"  # in the errors and the log
    thread_name = "kbp-watch"  # the thread's, with the namespace's name after it

    def __init__(self, netns: str | None) -> None:
        self.netns = netns
        self._wake_read = self._wake_write = -1  # stop() writes to wake the thread up
        self._stopping = threading.Event()
        self._scanned = threading.Event()
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._sequence = 0  # of the last dump asked for

    def start(self, timeout: float = _START_TIMEOUT_S) -> None:
        """Subscribe, dump, and return once the dump was read."""
        if self._thread is not None:
            raise RuntimeError(f"a {type(self).__name__} starts once")
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(
            target=self._main, name=f"{self.thread_name}-{self.netns or 'self'}", daemon=True
        )
        self._thread.start()
        if not self._scanned.wait(timeout):
            self.stop()
            raise NetlinkError(f"{self.what}: no initial dump within {timeout}s")
        if self._failure is not None:
            failure = self._failure
            self.stop()
            raise failure

    def stop(self, timeout: float = _START_TIMEOUT_S) -> None:
        """Stop watching and join the thread; idempotent."""
        self._stopping.set()
        if self._thread is threading.current_thread():
            return  # called from a callback: the loop ends when the callback returns
        if self._thread is not None:
            with contextlib.suppress(OSError):
                os.write(self._wake_write, b"x")
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s thread did not stop within %.1fs", self.what, timeout)
                return
        for fd in (self._wake_read, self._wake_write):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_read = self._wake_write = -1

    @property
    def failure(self) -> BaseException | None:
        """Why the watcher thread ended on its own; None while all is well."""
        return self._failure

    def _main(self) -> None:
        try:
            if self.netns is not None:
                enter_netns(self.netns)
            sock = socket.socket(
                socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE
            )
        except BaseException as exc:
            self._failure = exc
            self._scanned.set()
            return
        try:
            # Bursts (a node starting dozens of pods) must not overflow the queue;
            # FORCE ignores rmem_max, which only root may do, else fall back.
            try:
                sock.setsockopt(socket.SOL_SOCKET, 33, 4 << 20)  # SO_RCVBUFFORCE
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            self._subscribe(sock)  # before the dump, so nothing falls in between
            self._loop(sock)
        except BaseException as exc:
            log.exception("%s for %s failed", self.what, self.netns or "this namespace")
            self._failure = exc
            self._scanned.set()
        finally:
            sock.close()

    def _dump(self, sock: socket.socket, kind: int) -> int:
        """Ask for a dump of every link (RTM_GETLINK) or neighbour (RTM_GETNEIGH); the
        sequence number its answers carry."""
        self._sequence += 1
        msg = ifinfmsg() if kind == RTM_GETLINK else ndmsg()
        msg["family"] = socket.AF_UNSPEC
        msg["header"]["type"] = kind
        msg["header"]["flags"] = NLM_F_REQUEST | NLM_F_DUMP
        msg["header"]["sequence_number"] = self._sequence
        msg.encode()
        sock.send(msg.data)
        return self._sequence

    def _subscribe(self, sock: socket.socket) -> None:
        raise NotImplementedError

    def _loop(self, sock: socket.socket) -> None:
        raise NotImplementedError


class LinkWatcher(_Watcher):
    """Calls `on_link` for every interface matching the globs: once per existing one at
    start, then for each new one (and each rename into a match) as the kernel announces
    it on RTNLGRP_LINK. No polling; callbacks run on the watcher's own thread.
    `on_change` (optional) hears of every later announcement of a known matching
    interface (its state or carrier changed, say), `on_gone` of its removal."""

    what = "link watcher"
    thread_name = "kbp-linkwatch"

    def __init__(
        self,
        attacher_or_netns: TcAttacher | str | None,
        globs: Sequence[str] | PodInterfaces,
        on_link: Callable[[Link], None],
        on_change: Callable[[Link], None] | None = None,
        on_gone: Callable[[Link], None] | None = None,
    ) -> None:
        super().__init__(
            attacher_or_netns.netns
            if isinstance(attacher_or_netns, TcAttacher)
            else attacher_or_netns
        )
        self.interfaces = globs if isinstance(globs, PodInterfaces) else PodInterfaces(globs)
        self._on_link = on_link
        self._on_change = on_change
        self._on_gone = on_gone
        self._known: dict[int, str] = {}  # every interface seen: index -> name
        self._dump_sequence = 0

    def __enter__(self) -> LinkWatcher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- the watcher thread --

    def _subscribe(self, sock: socket.socket) -> None:
        sock.bind((0, RTMGRP_LINK))

    def _request_dump(self, sock: socket.socket) -> None:
        self._dump_sequence = self._dump(sock, RTM_GETLINK)

    def _loop(self, sock: socket.socket) -> None:
        marshal = MarshalRtnl()
        self._request_dump(sock)
        dumping = True
        dump_again = False
        seen_in_dump: set[int] = set()
        while not self._stopping.is_set():
            readable, _, _ = select.select([sock, self._wake_read], [], [])
            if self._wake_read in readable:
                return
            try:
                data = sock.recv(1 << 20)
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                # Events were lost: list everything again once the current dump ends.
                log.warning("link watcher: netlink queue overflowed, rescanning interfaces")
                dump_again = True
                if not dumping:
                    self._request_dump(sock)
                    dumping, dump_again, seen_in_dump = True, False, set()
                continue
            for msg in marshal.parse(data):
                header = msg["header"]
                kind = header["type"]
                from_dump = dumping and header["sequence_number"] == self._dump_sequence
                if kind == RTM_NEWLINK and msg["family"] == socket.AF_UNSPEC:
                    if from_dump:
                        seen_in_dump.add(msg["index"])
                        if header["flags"] & NLM_F_DUMP_INTR:
                            dump_again = True
                    self._saw_link(msg["index"], msg.get_attr("IFLA_IFNAME"))
                elif kind == RTM_DELLINK and msg["family"] == socket.AF_UNSPEC:
                    self._gone(msg["index"])
                elif from_dump and header.get("error") is not None:
                    raise header["error"]
                elif from_dump and kind == NLMSG_DONE:
                    # Interfaces gone while events were lost are forgotten now.
                    for index in set(self._known) - seen_in_dump:
                        self._gone(index)
                    dumping = False
                    self._scanned.set()
                    if dump_again:
                        self._request_dump(sock)
                        dumping, dump_again, seen_in_dump = True, False, set()

    def _saw_link(self, index: int, name: str | None) -> None:
        if name is None:
            return
        previous = self._known.get(index)
        self._known[index] = name
        if not self.interfaces.matches(name):
            return
        callback = self._on_link if previous != name else self._on_change
        self._call(callback, Link(index, name))

    def _gone(self, index: int) -> None:
        name = self._known.pop(index, None)
        if name is not None and self.interfaces.matches(name):
            self._call(self._on_gone, Link(index, name))

    @staticmethod
    def _call(callback: Callable[[Link], None] | None, link: Link) -> None:
        if callback is None:
            return
        try:
            callback(link)
        except Exception:
            log.exception("link watcher: callback for %s (index %d) failed", link.name, link.index)


# What RouteWatcher listens to (rtnetlink multicast groups) and the kernel's flag values
# it reads (include/uapi/linux/rtnetlink.h, neighbour.h, if.h).
_ROUTE_GROUPS = (1, 3, 7, 8, 11, 19)  # LINK, NEIGH, IPV4_ROUTE, IPV4_RULE, IPV6_ROUTE, IPV6_RULE
_SOL_NETLINK, _NETLINK_ADD_MEMBERSHIP = 270, 1
_RTM_F_CLONED = 0x200  # a route the kernel cloned into its cache, not a table's
_NUD_VALID = 0x02 | 0x04 | 0x08 | 0x10 | 0x40 | 0x80  # what bpf_fib_lookup resolves with
_LINK_STATE = 0x1 | 0x40 | 0x10000  # IFF_UP, IFF_RUNNING, IFF_LOWER_UP


class RouteWatcher(_Watcher):
    """Calls `on_change(causes)` when the kernel announces, in `netns`, a change that can
    change a FIB lookup's answer: a route or routing rule added or removed (not the
    route cache's clones), a link removed or changing its state (up, running, carrier) or
    MAC address, a neighbour's MAC address changing or the neighbour going away or no
    longer resolving. Neighbour entries go through states all the time (reachable,
    stale, probe) with the same address: those are not changes. `causes` is the set of
    kinds ("route", "rule", "link", "neighbour", "lost": events were dropped) seen in one
    read, so a burst calls once. Starts with a dump of links and neighbours, to know the
    addresses they have; callbacks run on the watcher's own thread."""

    what = "route watcher"
    thread_name = "kbp-routewatch"

    def __init__(self, netns: str | None, on_change: Callable[[set[str]], None]) -> None:
        super().__init__(netns)
        self._on_change = on_change
        self._links: dict[int, tuple[int, str | None]] = {}  # index -> (state bits, MAC)
        self._neighbours: dict[tuple[int, int, str], str | None] = {}  # -> MAC, None: unresolved

    def _subscribe(self, sock: socket.socket) -> None:
        sock.bind((0, 0))
        for group in _ROUTE_GROUPS:
            sock.setsockopt(_SOL_NETLINK, _NETLINK_ADD_MEMBERSHIP, group)

    def _loop(self, sock: socket.socket) -> None:
        marshal = MarshalRtnl()
        dumps = [RTM_GETLINK, RTM_GETNEIGH]  # one dump at a time on a socket
        dumping = self._dump(sock, dumps.pop(0))
        while not self._stopping.is_set():
            readable, _, _ = select.select([sock, self._wake_read], [], [])
            if self._wake_read in readable:
                return
            causes: set[str] = set()
            try:
                data = sock.recv(1 << 20)
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                log.warning("route watcher: netlink queue overflowed; every next hop is "
                            "looked up again")  # fmt: skip
                causes.add("lost")
                if not dumping:  # learn the addresses again
                    dumps = [RTM_GETLINK, RTM_GETNEIGH]
                    dumping = self._dump(sock, dumps.pop(0))
                self._call(causes)
                continue
            for msg in marshal.parse(data):
                header = msg["header"]
                in_dump = bool(dumping) and header["sequence_number"] == dumping
                if in_dump and header.get("error") is not None:
                    raise header["error"]
                if in_dump and header["type"] == NLMSG_DONE:
                    dumping = self._dump(sock, dumps.pop(0)) if dumps else 0
                    if not dumping:
                        self._scanned.set()
                    continue
                cause = self._saw(msg, header["type"])
                if cause and not in_dump:
                    causes.add(cause)
            self._call(causes)

    def _saw(self, msg: Any, kind: int) -> str | None:
        """What `msg` changed ("route", "rule", "link", "neighbour"), None when nothing a
        next hop depends on; the links' and neighbours' addresses learnt meanwhile."""
        if kind in (RTM_NEWROUTE, RTM_DELROUTE):
            return None if msg["flags"] & _RTM_F_CLONED else "route"
        if kind in (RTM_NEWRULE, RTM_DELRULE):
            return "rule"
        if kind in (RTM_NEWLINK, RTM_DELLINK):
            index = msg["index"]
            before = self._links.pop(index, None)
            if kind == RTM_DELLINK:
                return "link" if before is not None else None
            now = (msg["flags"] & _LINK_STATE, msg.get_attr("IFLA_ADDRESS"))
            self._links[index] = now
            return "link" if before is not None and before != now else None
        if kind in (RTM_NEWNEIGH, RTM_DELNEIGH):
            key = (msg["family"], msg["ifindex"], str(msg.get_attr("NDA_DST")))
            before = self._neighbours.pop(key, None)
            if kind == RTM_DELNEIGH:
                return "neighbour" if before is not None else None
            mac = msg.get_attr("NDA_LLADDR") if msg["state"] & _NUD_VALID else None
            self._neighbours[key] = mac
            return "neighbour" if before is not None and before != mac else None
        return None

    def _call(self, causes: set[str]) -> None:
        if not causes:
            return
        try:
            self._on_change(causes)
        except Exception:
            log.exception("route watcher: callback for %s failed", ",".join(sorted(causes)))
