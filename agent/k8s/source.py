"""The Kubernetes API source: list and watch Services, EndpointSlices and Nodes into the
StateStore, one thread per resource, decoding each object once from raw JSON.

Per resource the loop is a reflector's: list (paged) and `replace` the store's objects of
that kind, mark the resource synced, then watch from the list's resourceVersion (tracked
through events and BOOKMARKs). A watch that ends normally (its `timeoutSeconds`, or the
client's read timeout, which is what ends watches on servers that ignore
`timeoutSeconds`) is resumed from the last resourceVersion. `410 Gone` — as HTTP status
or as an ERROR event — relists at once. Any other error (unreachable server, HTTP error,
broken stream) sets `kbp_api_up{resource}` to 0, waits a capped exponential backoff with
jitter (not reset by a list that works while the watch keeps failing) and resumes the
watch (see Resuming below); a relist `replace`s: it applies what was deleted meanwhile
and reports no change when nothing changed, so the dataplane does not flap. The store
is never cleared on errors: the last known state stays in force.

Liveness. Every request is tried once (urllib3 would retry a timed-out one three more
times) and bounded: `request_timeout` to connect, for each read of a list and for a
watch's response headers. An open watch may stay quiet for long (API servers send a
BOOKMARK about once a minute), so its silence is not an error by itself: when a watch
has heard nothing for `idle_timeout`, one probe (`GET /version`, on another connection,
at most one per `idle_timeout` for all watches) asks whether the server still answers,
as client-go's HTTP/2 ping does for kube-proxy. A probe without an answer within
`request_timeout` reports the API unreachable (`kbp_api_up` 0, `on_reachability`) and
cuts the silent watches; each resumes from its resourceVersion (a server that froze
and comes back replays what was missed, or says 410 and the resource is relisted). A
frozen server is thus reported within `idle_timeout + request_timeout` (45 s by
default); a dead connection to a live server ends at the watch's `read_timeout`.

Selection, as kube-proxy's informers: Services and EndpointSlices with
`!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless`; with
`--service-proxy-name NAME` Services with `service.kubernetes.io/service-proxy-name=NAME,
!service.kubernetes.io/headless` and slices with `!service.kubernetes.io/headless` only
(third-party slices need not copy the Service's label; the compiler drops slices whose
Service is not programmed). The selectors are sent to the server and applied again here
(cheap; servers or emulators that ignore them are handled, and an object that leaves
the selection is removed from the store).

Nodes. This node's Node object is watched alone (`fieldSelector=metadata.name=NODE`, as
kube-proxy). Other nodes matter only to Services with topology keys
(`kube-bpf-proxy.io/topology-keys`), and of them only one thing: whether a node shares
this node's value of a key. So for each key some programmed Service uses and this node
carries, one metadata-only list and watch (`PartialObjectMetadata` through the Accept
header) runs with the label selector `KEY=VALUE` (this node's value; `KEY` alone when the
value is empty), started when the first Service needs the key and stopped when the last
goes, or restarted when this node's value changes. Several keys make several watches;
a node is stored with the keys whose watch lists it, `{KEY: VALUE}` for each, and nothing
else: another node's other labels never reach the store. While such a watch has not
listed yet, its nodes have no label here, which the compiler treats as a node without
the label. At start-up the first apply waits for the label watches the initial lists
call for (a restart must not program less than the kernel holds); later ones do not
hold anything back.

Resuming. After a watch ends or breaks (a disconnect, an HTTP error, an unreachable
server), the watch is opened again from the last resourceVersion seen (events or
BOOKMARKs), so nothing is listed again unless the server answers `410 Gone`; a list
that failed, or a stream the agent could not read, is listed again.

Malformed objects are logged once per distinct problem, naming `Kind namespace/name`,
and skipped; the last good version stays in the store, also across relists.
`kbp_api_events{resource,type}` counts ADDED/MODIFIED/DELETED/BOOKMARK/ERROR watch events
and LIST for each object received in a list; `kbp_api_bytes_received{resource}` the
response bytes read (list bodies and watch streams; the client asks for no compression).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import OpenApiException

from ..metrics import Metrics
from ..model import conventions as c
from ..model.compile import is_programmed
from ..model.decode import decode_object
from ..model.types import EndpointSlice, Node, Service
from ..sync.store import StateStore, key_of

log = logging.getLogger(__name__)

Value = Service | EndpointSlice | Node
Key = tuple[str, str]  # (namespace, name); Nodes have namespace ""
ListFunction = Callable[..., Any]

GONE = 410
HEALTHY_WATCH = 10.0  # seconds a watch must last for its failure to restart the backoff
ALIVE_BELOW = 500  # a probe answered with a status below this: the server answers


@dataclass(frozen=True, slots=True)
class Resource:
    """One watched API resource."""

    name: str  # plural: the metric label and thread name
    kind: str  # the StateStore kind
    api_version: str

    @property
    def source(self) -> str:
        """The name registered with the StateStore."""
        return f"kubernetes/{self.name}"


SERVICES = Resource("services", "Service", "v1")
ENDPOINT_SLICES = Resource("endpointslices", "EndpointSlice", "discovery.k8s.io/v1")
NODES = Resource("nodes", "Node", "v1")  # this node's Node object only
NODE_LABELS = Resource("node-labels", "Node", "v1")  # other nodes' metadata, per label
RESOURCES = (SERVICES, ENDPOINT_SLICES, NODES)
# Asked for by the node-label watches: metadata only (the API server's PartialObjectMetadata
# conversion); a server without it answers with whole Nodes, from which the same is read.
METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
METADATA_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
NODE_LABELS_SOURCE = "kubernetes/node-labels"  # the first apply waits for these lists


class Gone(Exception):
    """The resourceVersion is too old (HTTP 410): relist."""


class WatchError(Exception):
    """The server reported an error in the watch stream, or sent something unreadable."""


class Silent(Exception):
    """The server did not answer in time (a watch's headers, or a liveness probe while a
    request was open): reconnect, resuming from `version`, the last resourceVersion seen
    ("" when none: relist)."""

    def __init__(self, message: str, version: str = "") -> None:
        super().__init__(message)
        self.version = version


def service_selector(service_proxy_name: str | None) -> str:
    """The label selector for the Services this proxy handles (docs/semantics.md):
    kube-proxy's, or the Services claimed for `service_proxy_name`."""
    if service_proxy_name:
        return f"{c.LABEL_SERVICE_PROXY_NAME}={service_proxy_name},!{c.LABEL_HEADLESS}"
    return f"!{c.LABEL_SERVICE_PROXY_NAME},!{c.LABEL_HEADLESS}"


def slice_selector(service_proxy_name: str | None) -> str:
    """The label selector for EndpointSlices: kube-proxy's (the same as for Services)
    without a proxy name; with one, only headless slices are left out, since slices of
    other controllers need not carry their Service's labels."""
    if service_proxy_name:
        return f"!{c.LABEL_HEADLESS}"
    return service_selector(None)


def node_label_selector(key: str, value: str) -> str:
    """The label selector of the node-label watch for `key` on a node where it is
    `value`: the nodes that share it (an empty value: the nodes that carry the key)."""
    return f"{key}={value}" if value else key


def _node_field_selector(node_name: str) -> str:
    return f"metadata.name={node_name}"


class KubernetesSource:
    """Follows the API server into `store`; `start()` runs it, `stop()` ends it.

    Every resource is registered with the store at construction, so the store reports
    `synced` only once all three initial lists have completed (and the node-label lists
    they call for: see the module's docstring).
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        store: StateStore,
        metrics: Metrics,
        node_name: str,
        service_proxy_name: str | None,
        *,
        watch_timeout: float = 300,
        read_timeout: float = 90,
        idle_timeout: float = 30,
        request_timeout: float = 15,
        page_size: int = 500,
        backoff_base: float = 0.5,
        backoff_max: float = 30,
        rng: random.Random | None = None,
        on_reachability: Callable[[bool], None] | None = None,
        node_labels: Mapping[str, str] | None = None,
    ) -> None:
        """`on_reachability(all_up)` is called whenever the API server becomes reachable
        for every resource or stops being reachable for one (the local API reports it).
        `watch_timeout` is the server-side watch duration (`timeoutSeconds`, spread over
        1 to 2 times it, as client-go does). `read_timeout` is the longest silence accepted
        on a watch's connection: API servers send a BOOKMARK about once a minute, so a
        longer silence means a dead connection (or a server that ignores
        `timeoutSeconds`) and the watch is resumed from its resourceVersion.
        `idle_timeout` is the silence after which the server is probed, and
        `request_timeout` bounds connecting, each read of a list, a watch's response
        headers and the probe (see the module's docstring). The client must make one
        attempt per request (`make_client` builds it so). Backoff after an error starts
        at `backoff_base` seconds and doubles up to `backoff_max`, with jitter (each wait
        is 50 to 100 % of the nominal one). `page_size` is the list `limit` (0: unpaged).
        `node_labels` are added to this node's labels (`--node-label`), as the compiler
        does, when choosing the node-label watches."""
        if api_client.configuration.retries is not False:
            raise ValueError(
                "the ApiClient retries requests (a frozen API server would go unnoticed "
                "four times as long): build it with agent.k8s.make_client"
            )
        self.store = store
        self.metrics = metrics
        self.node_name = node_name
        self.service_proxy_name = service_proxy_name or None
        self.watch_timeout = watch_timeout
        self.read_timeout = read_timeout
        self.idle_timeout = idle_timeout
        self.request_timeout = request_timeout
        self.page_size = page_size
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self._rng = rng or random.Random()
        self._on_reachability = on_reachability
        # None until first known: a server that never answers at start-up is reported
        # unreachable at the first failure, not left unknown.
        self._reachable: bool | None = None
        self._reachability_lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        # client-go's `host` label: the API server's host:port.
        self._host = urllib.parse.urlsplit(api_client.configuration.host or "").netloc
        core = client.CoreV1Api(api_client)
        discovery = client.DiscoveryV1Api(api_client)
        self._core = core
        self._version_api = client.VersionApi(api_client)
        proxy_label = c.LABEL_SERVICE_PROXY_NAME
        proxy_name = self.service_proxy_name
        self._watchers = [
            _Watcher(
                self,
                SERVICES,
                core.list_service_for_all_namespaces,
                service_selector(proxy_name),
                lambda labels: (
                    labels.get(proxy_label) == proxy_name and c.LABEL_HEADLESS not in labels
                ),
            ),
            _Watcher(
                self,
                ENDPOINT_SLICES,
                discovery.list_endpoint_slice_for_all_namespaces,
                slice_selector(proxy_name),
                lambda labels: (
                    c.LABEL_HEADLESS not in labels
                    and (proxy_name is not None or proxy_label not in labels)
                ),
            ),
            _Watcher(
                self,
                NODES,
                core.list_node,
                None,
                lambda labels: True,
                field_selector=_node_field_selector(node_name),
            ),
        ]
        for watcher in self._watchers:
            store.register_source(watcher.resource.source)
            metrics.api_up.labels(watcher.resource.name).set(0)
        store.register_source(NODE_LABELS_SOURCE)
        self.node_labels = _NodeLabels(self, dict(node_labels or {}))

    def _report_reachability(self, failed: bool = False) -> None:
        """Reachable once every resource is up; unreachable when one fails (`failed`), or
        stops after having been up. Resources still listing at start-up report nothing."""
        if self._on_reachability is None:
            return
        with self._reachability_lock:
            reachable = all(w.up for w in self._all_watchers())
            if reachable == self._reachable or (not reachable and self._reachable is None
                                                 and not failed):  # fmt: skip
                return
            self._reachable = reachable
        self._on_reachability(reachable)

    # --- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start one daemon thread per resource."""
        if self._threads:
            raise RuntimeError("KubernetesSource already started")
        self._stopping.clear()
        for watcher in self._watchers:
            thread = threading.Thread(
                target=watcher.run, name=f"kbp-k8s-{watcher.resource.name}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        monitor = threading.Thread(
            target=self._check_liveness, name="kbp-k8s-liveness", daemon=True
        )
        self._threads.append(monitor)
        monitor.start()
        self.node_labels.start_all()  # any chosen before start (none: nothing listed yet)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop promptly: wake the backoff waits, cut the open streams, join the threads."""
        self._stopping.set()
        threads = self._threads + self.node_labels.stop_all()
        for watcher in self._watchers:
            watcher.interrupt()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("%s did not stop within %.1f s", thread.name, timeout)
        self._threads = []

    def __enter__(self) -> KubernetesSource:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- status ---------------------------------------------------------------------
    @property
    def up(self) -> dict[str, bool]:
        """Per resource: listed and watching (False while retrying after an error);
        `node-labels` only while a node-label watch runs (True when all are up)."""
        up = {w.resource.name: w.up for w in self._watchers}
        labels = self.node_labels.watchers()
        if labels:
            up[NODE_LABELS.name] = all(w.up for w in labels)
        return up

    def _all_watchers(self) -> list[_Watcher]:
        return self._watchers + self.node_labels.watchers()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def _wait(self, seconds: float) -> bool:
        """Sleep unless stopped; True when stopping."""
        return self._stopping.wait(seconds)

    def _backoff(self, failures: int) -> float:
        nominal = min(self.backoff_max, self.backoff_base * 2 ** max(0, failures - 1))
        return nominal * self._rng.uniform(0.5, 1.0)

    # --- liveness -------------------------------------------------------------------
    def _check_liveness(self) -> None:
        """Probe the server when a watch has been silent for `idle_timeout`; cut the
        silent watches when the probe gets no answer (the kbp-k8s-liveness thread)."""
        tick = min(1.0, self.idle_timeout / 4)
        answered = time.monotonic()  # the start of the last probe the server answered
        while not self._wait(tick):
            now = time.monotonic()
            watchers = self._all_watchers()
            silent = [w for w in watchers if now - max(w.heard(), answered) >= self.idle_timeout]
            if not silent:
                continue
            problem = self._probe()
            if self.stopping:
                return
            if problem is None:
                answered = now
                continue
            # Every watch silent since before the probe is suspect, not only the one
            # whose idle time ran out first; one that spoke meanwhile is not.
            silent = [w for w in watchers if w.heard() <= now]
            if not silent:
                continue
            names = ", ".join(w.resource.name for w in silent)
            log.warning(
                "API server: no answer to a liveness probe within %g s (%s) after %g s "
                "without a word on the watches of %s; reporting it unreachable and reconnecting",
                self.request_timeout,
                problem,
                self.idle_timeout,
                names,
            )
            for watcher in silent:
                watcher.cut("the API server did not answer a liveness probe")

    def record_request(self, started: float, status: object) -> None:
        """client-go's rest_client_* for one request sent at `started` (monotonic);
        `status` is the HTTP status, or None when no response came back."""
        code = str(status) if isinstance(status, int) and status > 0 else "<error>"
        self.metrics.rest_client_requests.labels(code, "GET", self._host).inc()
        self.metrics.rest_client_duration.labels("GET", self._host).observe(
            time.monotonic() - started
        )

    def _probe(self) -> str | None:
        """None when the API server answers `GET /version` (any status below 500) within
        `request_timeout`; else why not."""
        started = time.monotonic()
        try:
            response = self._version_api.get_code(
                _preload_content=False, _request_timeout=self.request_timeout
            )
            self.record_request(started, response.status)
        except OpenApiException as err:
            status = getattr(err, "status", None)
            self.record_request(started, status)
            if isinstance(status, int) and 0 < status < ALIVE_BELOW:
                return None
            return _describe(err)
        except Exception as err:  # timeouts, refused or reset connections
            self.record_request(started, None)
            return _describe(err)
        try:
            response.read()
        except Exception as err:
            return _describe(err)
        finally:
            response.release_conn()
        return None


class _Watcher:
    """List + watch of one resource, run in its own thread."""

    def __init__(
        self,
        source: KubernetesSource,
        resource: Resource,
        list_function: ListFunction,
        label_selector: str | None,
        selected: Callable[[Mapping[str, Any]], bool],
        *,
        field_selector: str | None = None,
        accept: tuple[str, str] | None = None,
    ) -> None:
        """`accept`: the Accept headers of lists and of watches (default: the client's)."""
        self.source = source
        self.resource = resource
        self.list_function = list_function
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.accept = accept
        self.selected = selected  # the label selector, applied to an object's labels
        self.up = False
        self.listed = False  # a list has completed (the first one: the source may be synced)
        self._events = {
            kind: source.metrics.api_events.labels(resource.name, kind)
            for kind in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR", "LIST")
        }
        self._bytes = source.metrics.api_bytes.labels(resource.name)
        self._up_gauge = source.metrics.api_up.labels(resource.name)
        self._reported: dict[Key, str] = {}  # last problem logged per object
        self._response_lock = threading.Lock()
        self._response: urllib3.BaseHTTPResponse | None = None
        self._heard = math.inf  # when the open response last said something (inf: none open)
        self._cut_reason: str | None = None  # set by cut(), taken by the watcher thread
        self._node_missing_reported = False

    # --- main loop ------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self.source.stopping

    def _wait(self, seconds: float) -> bool:
        return self.source._wait(seconds)

    def run(self) -> None:
        source = self.source
        name = self.resource.name
        failures = 0  # consecutive errors (a list that works but a watch that fails is one)
        quick = 0  # consecutive relists or resumes that brought nothing
        relist = True
        version = ""
        while not self.stopping:
            started: float | None = None
            try:
                if relist:
                    version = self._list()
                    relist = False
                    if not self.up:
                        if failures:
                            log.info("%s: listed again after %d failures", name, failures)
                        self._set_up(True)
                started = time.monotonic()
                version, received = self._watch(version)
                failures = 0
                # A watch that ends at once and empty, again and again, must not spin.
                quick = quick + 1 if not received and time.monotonic() - started < 1 else 0
                if quick > 1 and self._wait(source._backoff(quick - 1)):
                    break
            except Gone as err:
                log.info("%s: %s; relisting", name, err)
                relist = True
                quick += 1
                if quick > 1 and self._wait(source._backoff(quick - 1)):
                    break
            except Exception as err:
                if self.stopping:
                    break
                if started is not None and time.monotonic() - started >= HEALTHY_WATCH:
                    failures = 0  # a watch that worked for a while: a fresh failure
                failures += 1
                if isinstance(err, Silent):
                    version = err.version or version
                # A failed list, or a stream we could not read (an event may be lost), is
                # listed again; a watch that broke is resumed where it was.
                if started is None or not version or isinstance(err, WatchError | ValueError):
                    relist = True
                self._set_up(False, failed=True)
                delay = source._backoff(failures)
                what = "relisting" if relist else f"resuming from resourceVersion {version}"
                if isinstance(err, Silent):
                    log.warning(
                        "%s: %s; keeping the last known state, %s in %.1f s (attempt %d)",
                        name,
                        err,
                        what,
                        delay,
                        failures,
                    )
                elif isinstance(err, OpenApiException | urllib3.exceptions.HTTPError | OSError):
                    log.warning(
                        "%s: %s; keeping the last known state, retrying in %.1f s (%s, attempt %d)",
                        name,
                        _describe(err),
                        delay,
                        what,
                        failures,
                    )
                elif isinstance(err, WatchError | ValueError):
                    log.warning("%s: %s; relisting in %.1f s", name, err, delay)
                else:  # a bug: say so loudly, but keep the agent following the cluster
                    log.error(
                        "%s: unexpected error; retrying in %.1f s", name, delay, exc_info=True
                    )
                if self._wait(delay):
                    break
        self._set_up(False)

    def heard(self) -> float:
        """When the open request or watch last said something; inf when none is open."""
        return self._heard

    def cut(self, reason: str) -> None:
        """End the open request or watch because the server is silent (from the liveness
        thread); the watcher reports it and resumes."""
        with self._response_lock:
            if self._response is None:
                return
            self._cut_reason = reason
        self.interrupt()

    def _silenced(self, what: str, version: str = "") -> Silent | None:
        """A Silent error when cut() ended the request, else None."""
        with self._response_lock:
            reason, self._cut_reason = self._cut_reason, None
        return None if reason is None else Silent(f"{what} cut: {reason}", version)

    def interrupt(self) -> None:
        """Unblock a read in progress (called from `stop()` on another thread)."""
        with self._response_lock:
            response = self._response
        if response is None:
            return
        connection = getattr(response, "connection", None)
        sock = getattr(connection, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _set_up(self, up: bool, failed: bool = False) -> None:
        self.up = up
        self._up_gauge.set(1 if up else 0)
        self.source._report_reachability(failed)

    # --- list -----------------------------------------------------------------------
    def _list(self) -> str:
        """List everything, make the store's objects of this kind exactly that; return
        the list's resourceVersion."""
        items, version = self._list_pages()
        values: list[Value] = []
        bad: set[Key] = set()
        keys: set[Key] = set()
        listed = self._events["LIST"]
        for obj in items:
            listed.inc()
            outcome, key, value = self._convert(obj)
            if key is not None:
                keys.add(key)
            if value is not None:
                values.append(value)
            elif outcome == "bad" and key is not None:
                bad.add(key)
        # Forget the problems of objects that are gone.
        self._reported = {k: v for k, v in self._reported.items() if k in keys}
        changed = self._replace(values, bad)
        self.listed = True
        log.debug(
            "%s: listed %d objects at resourceVersion %s (%s)",
            self.resource.name,
            len(items),
            version,
            "changed" if changed else "no change",
        )
        if self.resource is NODES:
            self._check_own_node(values)
        self.source.node_labels.reconcile()
        return version

    # --- into the store (the node-label watches override these) -----------------------
    def _replace(self, values: list[Value], bad: set[Key]) -> bool:
        """A list's outcome into the store: exactly `values`, but keeping the last good
        version of the malformed objects (`bad`)."""
        resource, store = self.resource, self.source.store
        own: Callable[[Value], bool] | None = None
        if resource is NODES:  # only this node's object is ours (the label watches own the rest)
            node_name = self.source.node_name

            def own(value: Value) -> bool:
                return key_of(value) == ("", node_name)

        keep: Callable[[Value], bool] | None = own
        if bad:

            def keep(value: Value) -> bool:  # delete unlisted objects, not malformed ones
                return key_of(value) not in bad and (own is None or own(value))

        with store.lock:  # the Services' topology keys follow the store's Services exactly
            changed = store.replace(resource.kind, values, keep)
            if resource is SERVICES:
                self.source.node_labels.set_services(store.state.services.values())
        store.mark_synced(resource.source)
        return changed

    def _upsert(self, value: Value) -> None:
        store = self.source.store
        with store.lock:
            store.upsert(value)
            self._changed(value, key_of(value))

    def _delete(self, key: Key) -> None:
        store = self.source.store
        with store.lock:
            store.delete(self.resource.kind, *key)
            self._changed(None, key)

    def _changed(self, value: Value | None, key: Key) -> None:
        if self.resource is SERVICES:
            service = value if isinstance(value, Service) else None
            self.source.node_labels.set_service(key, service)
        elif self.resource is NODES:
            self.source.node_labels.reconcile()

    def _list_pages(self) -> tuple[list[Any], str]:
        items: list[Any] = []
        token: str | None = None
        limit: int | None = self.source.page_size or None
        while True:
            kwargs: dict[str, Any] = {}
            if limit:
                kwargs["limit"] = limit
            if token:
                kwargs["_continue"] = token
            try:
                body = self._request(**kwargs)
            except OpenApiException as err:
                if getattr(err, "status", None) == GONE and token:
                    # The continue token expired mid-list: start again, in one piece.
                    log.info("%s: list continuation expired; listing again", self.resource.name)
                    items, token, limit = [], None, None
                    continue
                raise
            if not isinstance(body, Mapping) or not isinstance(body.get("items", []), list):
                raise WatchError(f"list response is not a {self.resource.kind}List")
            items.extend(body.get("items") or ())
            meta = body.get("metadata") if isinstance(body.get("metadata"), Mapping) else {}
            token = meta.get("continue") or None
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    def _request(self, **kwargs: Any) -> Any:
        response = self._call(**kwargs)
        complete = False
        try:
            data = response.data
            complete = True
            self._bytes.inc(len(data))
        except Exception:
            silent = self._silenced("list")
            if silent is not None:
                raise silent from None
            raise
        finally:
            self._finish(response, complete)
        return json.loads(data)

    def _call(self, **kwargs: Any) -> urllib3.BaseHTTPResponse:
        """Send a list or watch request; return the response once its headers are in.
        Connecting and each read are bounded by `request_timeout`."""
        timeout = self.source.request_timeout
        if self.field_selector is not None:
            kwargs["field_selector"] = self.field_selector
        if self.accept is not None:
            kwargs["_headers"] = {"Accept": self.accept[1 if kwargs.get("watch") else 0]}
        started = time.monotonic()
        try:
            response = self.list_function(
                label_selector=self.label_selector,
                _preload_content=False,
                _request_timeout=(timeout, timeout),
                **kwargs,
            )
        except Exception as err:
            self.source.record_request(started, getattr(err, "status", None))
            raise
        self.source.record_request(started, response.status)
        with self._response_lock:
            self._response = response
            self._heard = time.monotonic()
            self._cut_reason = None
        if self.stopping:  # stop() ran before the response was registered
            self.interrupt()
        return response

    def _hear(self, size: int) -> None:
        self._heard = time.monotonic()
        self._bytes.inc(size)

    def _finish(self, response: urllib3.BaseHTTPResponse, complete: bool) -> None:
        """Unregister a response; a connection with unread data is closed, not reused."""
        with self._response_lock:
            if self._response is response:
                self._response = None
                self._heard = math.inf
        if not complete:
            response.close()
        response.release_conn()

    def _check_own_node(self, values: Iterable[Value]) -> None:
        if any(isinstance(v, Node) and v.name == self.source.node_name for v in values):
            self._node_missing_reported = False
        elif not self._node_missing_reported:
            self._node_missing_reported = True
            log.warning(
                "Node %s is not in the API server's node list; this node has no addresses "
                "for NodePorts (check --node, or set --node-ip)",
                self.source.node_name,
            )

    # --- watch ----------------------------------------------------------------------
    def _watch(self, version: str) -> tuple[str, int]:
        """Watch from `version` until the stream ends; return the last resourceVersion
        seen and how many events arrived. Raises Gone on 410."""
        source = self.source
        timeout_seconds = max(1, math.ceil(source.watch_timeout * source._rng.uniform(1.0, 2.0)))
        kwargs: dict[str, Any] = {
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": timeout_seconds,
        }
        if version:
            kwargs["resource_version"] = version
        try:
            response = self._call(**kwargs)
        except OpenApiException as err:
            if getattr(err, "status", None) == GONE:
                raise Gone(f"watch from resourceVersion {version}: 410 Gone") from None
            raise
        except urllib3.exceptions.ReadTimeoutError:
            raise Silent(
                f"no answer to a watch request within {source.request_timeout:g} s", version
            ) from None
        if not self.up:
            log.info("%s: watching again from resourceVersion %s", self.resource.name, version)
            self._set_up(True)
        _set_read_timeout(response, source.read_timeout)  # a watch may be quiet for long
        received = 0
        try:
            for line in _lines(response, self._hear):
                if self.stopping:
                    break
                try:
                    event = json.loads(line)
                except ValueError as err:
                    raise WatchError(f"unreadable watch event: {err}") from None
                version = self._handle(event, version)
                received += 1
        except urllib3.exceptions.ReadTimeoutError:
            # Silent for read_timeout: the server ignored timeoutSeconds, or the connection
            # died quietly. Resume; if the server is gone, the next request fails.
            log.debug("%s: watch read timeout; resuming", self.resource.name)
        except Exception:
            silent = self._silenced("watch", version)
            if silent is not None:
                raise silent from None
            raise
        finally:
            self._finish(response, complete=False)  # watches are long-lived: never reused
        silent = self._silenced("watch", version)  # a cut stream may also just end
        if silent is not None and not self.stopping:
            raise silent
        return version, received

    def _handle(self, event: Any, version: str) -> str:
        if not isinstance(event, Mapping):
            raise WatchError(f"watch event is not an object: {event!r:.100}")
        kind = event.get("type")
        obj = event.get("object")
        counter = self._events.get(kind) if isinstance(kind, str) else None
        if counter is None or kind == "LIST":
            log.warning("%s: ignoring a watch event of type %r", self.resource.name, kind)
            return version
        counter.inc()
        if kind == "ERROR":
            status = obj if isinstance(obj, Mapping) else {}
            if status.get("code") == GONE:
                raise Gone(f"watch: {status.get('reason') or 'Gone'}: {status.get('message')}")
            raise WatchError(
                f"watch error {status.get('code')} {status.get('reason')}: {status.get('message')}"
            )
        if not isinstance(obj, dict):
            raise WatchError(f"{kind} event without an object")
        meta = obj.get("metadata")
        if isinstance(meta, Mapping) and meta.get("resourceVersion"):
            version = str(meta["resourceVersion"])
        if kind == "BOOKMARK":
            return version
        if kind == "DELETED":
            key = _key(self.resource, meta)
            if key is None:
                log.warning("%s: DELETED event without metadata.name; ignored", self.resource.kind)
            else:
                self._reported.pop(key, None)
                self._delete(key)
            return version
        outcome, key, value = self._convert(obj)
        if value is not None:
            self._upsert(value)
        elif outcome == "skip" and key is not None:
            self._delete(key)  # left our selection
        return version

    # --- decoding -------------------------------------------------------------------
    def _convert(self, obj: Any) -> tuple[str, Key | None, Value | None]:
        """Decode one object: ("ok", key, value), ("skip", key, None) for an object that
        is not ours (selector, headless, FQDN), ("bad", key, None) for a malformed one."""
        resource = self.resource
        if not isinstance(obj, dict):
            self._report(None, f"{resource.kind} <unknown>: expected an object")
            return "bad", None, None
        # List items carry no kind/apiVersion, and the endpoint tells us what they are.
        obj["kind"] = resource.kind
        obj["apiVersion"] = resource.api_version
        meta = obj.get("metadata")
        key = _key(resource, meta)
        labels = meta.get("labels") if isinstance(meta, Mapping) else None
        # (Labels of the wrong type are the decoder's to report.)
        if (labels is None or isinstance(labels, Mapping)) and not self.selected(labels or {}):
            if key is not None:
                self._reported.pop(key, None)
            return "skip", key, None
        decoded = decode_object(obj)
        if decoded.error is not None:
            self._report(
                key, f"{decoded.ref}: {decoded.error}; skipped, keeping its last good version"
            )
            return "bad", key, None
        if decoded.warnings:
            self._report(key, f"{decoded.ref}: " + "; ".join(decoded.warnings))
        elif key is not None:
            self._reported.pop(key, None)
        if decoded.value is None:
            log.debug("%s: %s", decoded.ref, decoded.skipped)
            return "skip", key, None
        value = decoded.value
        if isinstance(value, Node) and value.name != self.source.node_name:
            # Not this node: a server that ignored the field selector sent it.
            return "skip", None, None
        return "ok", key, value

    def _report(self, key: Key | None, message: str) -> None:
        """Log a problem with an object once, not at every relist or replayed event."""
        if key is not None:
            if self._reported.get(key) == message:
                return
            self._reported[key] = message
        log.warning("%s", message)


class _NodeLabels:
    """The node-label watches: which ones the programmed Services need, starting and
    stopping them, and the labels they vouch for in the store (see the module's
    docstring). Everything runs under the store's lock, which the watchers' threads
    already hold when they call in, so there is one lock order."""

    def __init__(self, source: KubernetesSource, overrides: dict[str, str]) -> None:
        self.source = source
        self.lock = source.store.lock
        self.overrides = overrides  # --node-label: added to this node's labels
        self._keys: dict[Key, tuple[str, ...]] = {}  # Service → the node label keys it uses
        self._in_use: dict[str, int] = {}  # key → how many Services use it
        self._watchers: dict[tuple[str, str], _LabelWatcher] = {}
        self._members: dict[tuple[str, str], set[str]] = {}  # (key, value) → node names
        self._stopped: list[threading.Thread] = []  # stopped watchers' threads, to join
        self._synced = False
        self._gauge = source.metrics.node_label_watches
        self._gauge.set(0)

    # --- what is needed ------------------------------------------------------------------
    def _uses(self, service: Service | None) -> tuple[str, ...]:
        if service is None or not service.topology_keys:
            return ()
        if not is_programmed(service, self.source.service_proxy_name):
            return ()
        return tuple(k for k in service.topology_keys if k != c.TOPOLOGY_KEY_ANY)

    def set_service(self, key: Key, service: Service | None) -> None:
        """A Service was stored or deleted."""
        with self.lock:
            keys = self._uses(service)
            if self._keys.get(key, ()) == keys:
                return
            self._count(self._keys.pop(key, ()), -1)
            if keys:
                self._keys[key] = keys
                self._count(keys, 1)
            self.reconcile()

    def set_services(self, services: Iterable[Service]) -> None:
        """The Services were listed: these are all of them."""
        with self.lock:
            self._keys = {s.key: keys for s in services if (keys := self._uses(s))}
            self._in_use = {}
            for keys in self._keys.values():
                self._count(keys, 1)
            self.reconcile()

    def _count(self, keys: tuple[str, ...], delta: int) -> None:
        for key in set(keys):
            left = self._in_use.get(key, 0) + delta
            if left > 0:
                self._in_use[key] = left
            else:
                self._in_use.pop(key, None)

    def wanted(self) -> dict[tuple[str, str], str]:
        """(key, this node's value) → label selector, for every key in use this node has."""
        store = self.source.store
        with self.lock:
            node = store.state.nodes.get(self.source.node_name)
            if node is None:
                return {}
            labels = {**node.labels, **self.overrides}
            return {
                (key, labels[key]): node_label_selector(key, labels[key])
                for key in sorted(self._in_use)
                if key in labels
            }

    # --- starting and stopping -----------------------------------------------------------
    def reconcile(self) -> None:
        """Start the watches now needed, stop the others; once the initial lists are in,
        mark the node labels synced."""
        source = self.source
        with self.lock:
            if source.stopping:
                return
            wanted = self.wanted()
            for pair in [p for p in self._watchers if p not in wanted]:
                self._stop(pair)
            for pair, selector in wanted.items():
                if pair not in self._watchers:
                    self._start(pair, selector)
            self._gauge.set(len(self._watchers))
            self._report_up()
            if not self._synced and self._initial_lists_done():
                self._synced = True
                source.store.mark_synced(NODE_LABELS_SOURCE)

    def _initial_lists_done(self) -> bool:
        static = {w.resource.name: w.listed for w in self.source._watchers}
        return (
            static[SERVICES.name]
            and static[NODES.name]
            and all(w.listed for w in self._watchers.values())
        )

    def _start(self, pair: tuple[str, str], selector: str) -> None:
        key = pair[0]
        log.info(
            "node-labels: a programmed Service uses the topology key %s: watching the "
            "metadata of the nodes labelled %s",
            key,
            selector,
        )
        watcher = _LabelWatcher(self, pair, selector)
        self._watchers[pair] = watcher
        self._members[pair] = set()
        if self.source._threads:  # started: run it now (else start() runs it)
            watcher.start()

    def _stop(self, pair: tuple[str, str]) -> None:
        watcher = self._watchers.pop(pair)
        log.info(
            "node-labels: no programmed Service uses the topology key %s now: "
            "stopping the watch of %s",
            pair[0],
            watcher.label_selector,
        )
        watcher.halt()
        if watcher.thread is not None:
            self._stopped.append(watcher.thread)
        for name in self._members.pop(pair, set()):
            self._store_node(name)

    def start_all(self) -> list[threading.Thread]:
        """Start the watchers chosen before the source started; their threads."""
        with self.lock:
            for watcher in self._watchers.values():
                if watcher.thread is None:
                    watcher.start()
            return [w.thread for w in self._watchers.values() if w.thread is not None]

    def stop_all(self) -> list[threading.Thread]:
        """Halt every watcher (the store keeps their labels); the threads to join."""
        with self.lock:
            threads, self._stopped = self._stopped, []
            for watcher in self._watchers.values():
                watcher.halt()
                if watcher.thread is not None:
                    threads.append(watcher.thread)
            return threads

    def watchers(self) -> list[_LabelWatcher]:
        with self.lock:
            self._stopped = [t for t in self._stopped if t.is_alive()]
            return list(self._watchers.values())

    def _report_up(self) -> None:
        """`kbp_api_up{resource="node-labels"}`: 1 when every label watch is up, absent
        while none runs."""
        up = self.source.metrics.api_up
        if self._watchers:
            up.labels(NODE_LABELS.name).set(all(w.up for w in self._watchers.values()))
        else:
            with contextlib.suppress(KeyError):
                up.remove(NODE_LABELS.name)

    # --- what the watches saw --------------------------------------------------------
    def members_set(self, watcher: _LabelWatcher, names: set[str]) -> bool:
        """A watch listed exactly these nodes; whether the store changed."""
        with self.lock:
            if self._watchers.get(watcher.pair) is not watcher:
                return False  # stopped meanwhile: its labels are already gone
            old = self._members[watcher.pair]
            self._members[watcher.pair] = set(names)
            return any([self._store_node(name) for name in old ^ names])

    def member(self, watcher: _LabelWatcher, name: str, present: bool) -> None:
        """A node entered (or stayed in) or left a watch's selection."""
        with self.lock:
            if self._watchers.get(watcher.pair) is not watcher:
                return
            members = self._members[watcher.pair]
            if present == (name in members):
                return
            if present:
                members.add(name)
            else:
                members.discard(name)
            self._store_node(name)

    def _store_node(self, name: str) -> bool:
        """Store another node with the labels the running watches vouch for."""
        labels = {key: value for (key, value), names in self._members.items() if name in names}
        store = self.source.store
        if labels:
            return store.upsert(Node(name, labels))
        return store.delete("Node", "", name)


class _LabelWatcher(_Watcher):
    """The metadata-only list and watch of the nodes that carry one label value."""

    def __init__(self, labels: _NodeLabels, pair: tuple[str, str], selector: str) -> None:
        key, value = pair
        super().__init__(
            labels.source,
            NODE_LABELS,
            labels.source._core.list_node,
            selector,
            lambda node_labels: node_labels.get(key) == value,
            accept=(METADATA_LIST, METADATA_WATCH),
        )
        self.labels = labels
        self.pair = pair
        self.thread: threading.Thread | None = None
        self._halted = threading.Event()

    def start(self) -> None:
        self.thread = threading.Thread(
            target=self.run, name=f"kbp-k8s-node-labels-{self.pair[0]}", daemon=True
        )
        self.thread.start()

    def halt(self) -> None:
        self._halted.set()
        self.interrupt()

    @property
    def stopping(self) -> bool:
        return self._halted.is_set() or self.source.stopping

    def _wait(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._halted.wait(min(left, 0.25))
        return True

    def _set_up(self, up: bool, failed: bool = False) -> None:
        self.up = up
        with self.labels.lock:
            if self.labels._watchers.get(self.pair) is self:
                self.labels._report_up()
        self.source._report_reachability(failed)

    def _convert(self, obj: Any) -> tuple[str, Key | None, Value | None]:
        """Name and labels of a PartialObjectMetadata (or of a whole Node)."""
        meta = obj.get("metadata") if isinstance(obj, Mapping) else None
        key = _key(NODES, meta)
        if key is None:
            self._report(None, "Node <unknown>: metadata.name is missing")
            return "bad", None, None
        labels = meta.get("labels") or {}  # type: ignore[union-attr]
        if not isinstance(labels, Mapping) or not all(isinstance(v, str) for v in labels.values()):
            self._report(key, f"Node {key[1]}: metadata.labels is not a map of strings")
            return "bad", key, None
        if key[1] == self.source.node_name or not self.selected(labels):
            return "skip", key, None  # this node comes from its own watch
        key_name, value = self.pair
        return "ok", key, Node(key[1], {key_name: value})

    def _replace(self, values: list[Value], bad: set[Key]) -> bool:
        with self.labels.lock:
            names = {v.name for v in values if isinstance(v, Node)}
            names |= {name for _, name in bad} & self.labels._members.get(self.pair, set())
            return self.labels.members_set(self, names)

    def _upsert(self, value: Value) -> None:
        with self.labels.lock:
            self.labels.member(self, key_of(value)[1], True)

    def _delete(self, key: Key) -> None:
        with self.labels.lock:
            self.labels.member(self, key[1], False)


def _key(resource: Resource, meta: object) -> Key | None:
    if not isinstance(meta, Mapping):
        return None
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        return None
    if resource is NODES:
        return ("", name)
    namespace = meta.get("namespace")
    return (namespace if isinstance(namespace, str) and namespace else "default", name)


def _set_read_timeout(response: urllib3.BaseHTTPResponse, seconds: float) -> None:
    """Change the read timeout of a response's connection (urllib3 applies one timeout
    to the headers and the body alike)."""
    sock = getattr(getattr(response, "connection", None), "sock", None)
    if sock is not None:
        sock.settimeout(seconds)


def _lines(response: urllib3.BaseHTTPResponse, heard: Callable[[int], None]) -> Iterator[bytes]:
    """The non-empty lines of a streamed (chunked) response, as they arrive; `heard(n)`
    is called for each chunk received, with its size."""
    buffer = bytearray()
    for chunk in response.stream(amt=None, decode_content=True):
        heard(len(chunk))
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", start)) != -1:
            line = bytes(buffer[start:end]).strip()
            start = end + 1
            if line:
                yield line
        del buffer[:start]
    tail = bytes(buffer).strip()
    if tail:
        yield tail


def _describe(err: Exception) -> str:
    """A one-line reason for an API or connection error."""
    status = getattr(err, "status", None)
    if isinstance(err, OpenApiException) and status is not None:
        reason = getattr(err, "reason", None) or ""
        body = getattr(err, "body", None)
        message = ""
        if body:
            try:
                message = json.loads(body).get("message", "")
            except (ValueError, AttributeError):
                message = ""
        return f"HTTP {status} {reason}".strip() + (f": {message}" if message else "")
    if isinstance(err, urllib3.exceptions.ReadTimeoutError):
        return "read timed out"  # (urllib3's text names the pool and a float of seconds)
    reason = getattr(err, "reason", None)
    text = str(reason if reason is not None else err) or type(err).__name__
    return text.splitlines()[0]
