"""Which network namespace is which pod's, for the socket hooks (kbp_pods): the kernel's
own answer, found from the node's side of each pod interface.

A pod interface is the host end of a veth pair. The kernel names the namespace of its
peer (IFLA_LINK_NETNSID, an id this node namespace gives it) and the peer's ifindex
(IFLA_LINK). The agent finds that namespace among the ones it can open (the bind mounts
under /run/netns, where CNI runtimes and `ip netns` keep pod namespaces, then
/proc/PID/ns/net), asks the kernel which of them has that id (RTM_GETNSID), enters it,
and reads there its cookie (SO_NETNS_COOKIE, what bpf_get_netns_cookie() returns) and
the global addresses of the peer interface: the pod's addresses, as its own namespace
holds them. Nothing is guessed from names or from the API server.

A pod interface whose namespace or addresses are not found yet (a CNI plugin adds the
addresses after it made the veth) is tried again when the kernel announces a change of
the interface (it comes up once the plugin is done) and at each full resync; meanwhile
its pod's sockets are left to tc, which serves them as before.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .abi import addr_bytes, packer
from .cgroup import cookie_of_this_netns
from .libbpf import Map
from .netlink import Link, NetlinkError, TcAttacher, interface_addresses, run_in_netns

log = logging.getLogger(__name__)

_POD = packer("kbp_pod")
NETNS_RUN_DIRS = (Path("/run/netns"), Path("/var/run/netns"))
PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class PodNetns:
    """A pod's network namespace as the socket hooks know it."""

    cookie: int
    path: str  # where the agent opened it (a bind mount, or /proc/PID/ns/net)
    ipv4: str | None
    ipv6: str | None
    ifname: str  # the pod interface on the node's side

    def value(self) -> bytes:
        """struct kbp_pod."""
        return _POD.pack(
            addr_bytes(self.ipv4) if self.ipv4 else bytes(16),
            addr_bytes(self.ipv6) if self.ipv6 else bytes(16),
        )


def cookie_key(cookie: int) -> bytes:
    """A kbp_pods key: the __u64 cookie in host order."""
    return cookie.to_bytes(8, sys.byteorder)


def _candidates() -> Iterator[str]:
    """Paths of network namespaces this process may open: bind mounts first (cheap, and
    where pod namespaces live), then every process's; each namespace once."""
    seen: set[tuple[int, int]] = set()
    for path in _namespace_paths():
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                yield path


def _namespace_paths() -> Iterator[str]:
    for directory in NETNS_RUN_DIRS:
        with contextlib.suppress(OSError):
            yield from [str(directory / entry) for entry in sorted(os.listdir(directory))]
    with contextlib.suppress(OSError):
        yield from [f"{PROC}/{entry}/ns/net" for entry in os.listdir(PROC) if entry.isdigit()]


def netns_path_of(cookie: int) -> str | None:
    """A path to the network namespace with this cookie (kbp_pods' key), or None: every
    namespace this process can open is asked (for one-off readers such as `explain`)."""
    for path in _candidates():
        with contextlib.suppress(OSError):
            if run_in_netns(path, cookie_of_this_netns) == cookie:
                return path
    return None


def _read_pod(path: str, peer_index: int) -> tuple[int, list[str]]:
    """(cookie, addresses of interface peer_index) of the namespace at `path`."""
    return run_in_netns(path, lambda: (cookie_of_this_netns(), interface_addresses(peer_index)))


class PodNamespaces:
    """kbp_pods kept in step with the pod interfaces: `learn` a new or changed one,
    `forget` a removed one. Thread-safe (the link watcher and the sync loop call it)."""

    def __init__(self, attacher: TcAttacher, table: Map) -> None:
        self._attacher = attacher
        self._table = table
        self._lock = threading.Lock()
        self._known: dict[int, PodNetns] = {}  # host ifindex -> its pod
        self._pending: dict[int, Link] = {}  # pod interfaces not resolved yet
        self._paths: dict[int, str] = {}  # nsid -> path, as last found

    def pods(self) -> list[PodNetns]:
        with self._lock:
            return list(self._known.values())

    def pending(self) -> list[str]:
        with self._lock:
            return sorted(link.name for link in self._pending.values())

    def learn(self, link: Link) -> PodNetns | None:
        """Find the pod behind `link` and write its kbp_pods entry; None (and the link
        kept for a later try) when its namespace or an address is not there yet."""
        found = self._resolve(link)
        with self._lock:
            old = self._known.get(link.index)
            if found is None:
                self._pending[link.index] = link
                if old is not None:  # the same interface, another pod now: forget the old
                    self._drop(link.index)
                return None
            self._pending.pop(link.index, None)
            if old == found:
                return found
            if old is not None and old.cookie != found.cookie:
                self._drop(link.index)
            self._table.update(cookie_key(found.cookie), found.value())
            self._known[link.index] = found
        log.debug("ebpf: pod interface %s: netns cookie %d, %s", link.name, found.cookie,
                  " ".join(a for a in (found.ipv4, found.ipv6) if a))  # fmt: skip
        return found

    def retry(self) -> None:
        """Try the pending interfaces again."""
        with self._lock:
            pending = list(self._pending.values())
        for link in pending:
            self.learn(link)

    def forget(self, link: Link) -> None:
        """The pod interface is gone: so is its pod's entry."""
        with self._lock:
            self._pending.pop(link.index, None)
            self._drop(link.index)

    def prune(self) -> list[int]:
        """Delete kbp_pods entries no known pod interface leads to (an earlier agent's, of
        pods removed while no agent ran). Returns their cookies."""
        with self._lock:
            wanted = {cookie_key(pod.cookie) for pod in self._known.values()}
            stale = [key for key, _ in self._table.items() if key not in wanted]
            for key in stale:
                with contextlib.suppress(KeyError, OSError):
                    self._table.delete(key)
        return [int.from_bytes(key, sys.byteorder) for key in stale]

    def _drop(self, index: int) -> None:
        old = self._known.pop(index, None)
        if old is not None and old.cookie not in {p.cookie for p in self._known.values()}:
            with contextlib.suppress(KeyError, OSError):
                self._table.delete(cookie_key(old.cookie))

    def _resolve(self, link: Link) -> PodNetns | None:
        peer = self._attacher.veth_peer(link.index)
        if peer is None:
            return None
        peer_index, nsid = peer
        path = self._path_of(nsid)
        if path is None:
            return None
        try:
            cookie, addresses = _read_pod(path, peer_index)
        except (NetlinkError, OSError) as err:
            log.debug("ebpf: pod interface %s: reading %s failed: %s", link.name, path, err)
            self._paths.pop(nsid, None)
            return None
        ipv4 = next((a for a in addresses if ipaddress.ip_address(a).version == 4), None)
        ipv6 = next((a for a in addresses if ipaddress.ip_address(a).version == 6), None)
        if ipv4 is None and ipv6 is None:
            return None
        return PodNetns(cookie, path, ipv4, ipv6, link.name)

    def _path_of(self, nsid: int) -> str | None:
        """A path to the namespace with id `nsid`: the one found before when it still has
        that id, else the first candidate that does."""
        known = self._paths.get(nsid)
        if known is not None and self._attacher.netns_id(known) == nsid:
            return known
        for path in _candidates():
            if self._attacher.netns_id(path) == nsid:
                self._paths[nsid] = path
                return path
        return None
