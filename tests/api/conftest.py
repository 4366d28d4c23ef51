"""Fixtures for the Kubernetes source against kmock, a Kubernetes API emulator, over HTTP.

kmock runs in a background thread with its own event loop (the source is threaded and
synchronous); tests talk to it through `KmockApi`, which creates, patches and deletes
objects over HTTP, injects failures with kmock's reaction DSL, and stops and restarts the
server on the same port. The source under test uses the real `kubernetes` client.

kmock 0.8 ignores label and field selectors, `resourceVersion` and the Accept header
(every watch replays all objects as ADDED, in full). The emulator served here is
`tests/api/emulator.py`'s subclass, which answers lists and watches as the API server
does: selectors, resourceVersions with a history (410 once `compact`ed), objects leaving
a label selection as DELETED, PartialObjectMetadata. kmock still ignores `limit` and
`timeoutSeconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp.test_utils
import aiohttp.web_runner
import aiohttp.web_server
import kmock
import pytest
from kubernetes import client

from agent.k8s import KubernetesSource, make_client
from agent.metrics import Metrics
from agent.sync.store import StateStore, Value, key_of, kind_of

from .emulator import Emulator

NODE = "node-a"
SERVICES = "v1/services"
SLICES = "discovery.k8s.io/v1/endpointslices"
NODES = "v1/nodes"
RESOURCES = (SERVICES, SLICES, NODES)
COLLECTIONS = {  # kind → (resource, path of the collection, namespaced)
    "Service": (SERVICES, "/api/v1/namespaces/{ns}/services", True),
    "EndpointSlice": (SLICES, "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", True),
    "Node": (NODES, "/api/v1/nodes", False),
}
RESOURCE_NAMES = {
    SERVICES: "services",
    SLICES: "endpointslices",
    NODES: "nodes",
    "node-labels": "node-labels",  # the metadata-only watches of other nodes
}
DEADLINE = 15.0  # seconds a test waits for something before failing (4 s ran out under load)


def wait_for(predicate: Callable[[], object], what: str, timeout: float = DEADLINE) -> None:
    """Poll until `predicate()` is true; fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


class _QuickStopServer(aiohttp.test_utils.RawTestServer):
    """aiohttp waits up to 60 s for open handlers (our watches) at shutdown; cut them."""

    async def _make_runner(
        self, debug: bool = True, **kwargs: Any
    ) -> aiohttp.web_runner.ServerRunner:
        server = aiohttp.web_server.Server(self._handler, loop=self._loop, debug=debug, **kwargs)
        return aiohttp.web_runner.ServerRunner(server, debug=debug, shutdown_timeout=0.05, **kwargs)


class KmockApi:
    """A kmock KubernetesEmulator served over HTTP from its own event-loop thread."""

    def __init__(self, netns: str | None = None) -> None:
        """`netns`: serve from inside that network namespace (its loopback), for an agent
        that runs there (the kernel tests); the event-loop thread enters it first."""
        self.loop = asyncio.new_event_loop()

        def serve() -> None:
            if netns is not None:
                from agent.dataplane.ebpf.netlink import enter_netns

                enter_netns(netns)  # this thread only: its sockets live in netns
            self.loop.run_forever()

        self.netns = netns
        self.thread = threading.Thread(target=serve, name="kmock", daemon=True)
        self.thread.start()
        self.emulator: Emulator = self.call(self._make_emulator())
        self.server: kmock.Server | None = None
        self.port: int | None = None

    def call(self, coro: Any, timeout: float = DEADLINE) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _make_emulator(self) -> Emulator:
        emulator = Emulator()
        for resource in RESOURCES:
            emulator.resources[resource] = {}
        await emulator.__aenter__()
        return emulator

    # --- server ---------------------------------------------------------------------
    def start(self) -> None:
        async def start() -> kmock.Server:
            server = kmock.Server(self.emulator, port=self.port, server_cls=_QuickStopServer)
            await server.__aenter__()
            return server

        first = self.port is None
        self.server = self.call(start())
        self.port = self.server.port
        if first and self.netns is not None:
            self.call(self._reserve_port())

    async def _reserve_port(self) -> None:
        """Keep the server's port from being a source port in its namespace (ours), so it
        is free again at a restart: while the server is down, a client retrying
        127.0.0.1:port may be handed that very port as its source and connect to itself
        (TCP's simultaneous open), holding the port (seen in CI: EADDRINUSE at restart).
        Runs on the loop's thread, whose network namespace /proc/sys/net is read in."""
        path = "/proc/sys/net/ipv4/ip_local_reserved_ports"
        with open(path, encoding="ascii") as f:
            reserved = f.read().strip()
        with open(path, "w", encoding="ascii") as f:
            f.write(f"{reserved},{self.port}" if reserved else str(self.port))

    def stop(self) -> None:
        if self.server is not None:
            self.call(self.server.__aexit__(None, None, None))
            self.server = None

    def close(self) -> None:
        self.stop()
        self.call(self.emulator.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(DEADLINE)
        self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- objects over HTTP ----------------------------------------------------------
    def _path(self, kind: str, namespace: str | None, name: str | None = None) -> str:
        _, collection, namespaced = COLLECTIONS[kind]
        path = collection.format(ns=namespace or "default") if namespaced else collection
        return f"{path}/{name}" if name else path

    def _http(self, method: str, path: str, body: Any = None) -> Any:
        async def go() -> Any:
            async with self.emulator.request(method, path, json=body) as response:
                text = await response.text()
                assert response.status < 300, f"{method} {path}: {response.status} {text}"
                return await response.json(content_type=None)

        return self.call(go())

    def create(self, *objects: dict[str, Any]) -> None:
        for obj in objects:
            meta = obj["metadata"]
            self._http("POST", self._path(obj["kind"], meta.get("namespace")), obj)

    def patch(self, kind: str, namespace: str | None, name: str, patch: dict[str, Any]) -> None:
        """A merge patch (kmock merges dicts recursively; None removes a key)."""
        self._http("PATCH", self._path(kind, namespace, name), patch)

    def delete(self, kind: str, namespace: str | None, name: str) -> None:
        self._http("DELETE", self._path(kind, namespace, name))

    def forget(self, kind: str, namespace: str | None, name: str) -> None:
        """Delete an object without a watch event: what a client misses while it is
        disconnected (kmock, unlike the API server, does not replay missed deletions)."""

        async def go() -> None:
            self.forget_now(kind, namespace, name)

        self.call(go())

    def forget_now(self, kind: str, namespace: str | None, name: str) -> None:
        """`forget`, from code already running in kmock's loop (an `on_next` hook)."""
        resource, _, namespaced = COLLECTIONS[kind]
        namespace = namespace if namespaced else None
        self.emulator.objects[resource, namespace, name].delete()
        self.emulator.current.pop((kmock.resource(resource), namespace, name), None)

    def delete_unseen(self, kind: str, namespace: str | None, name: str) -> None:
        """Delete an object while the server is stopped: the watch history keeps the
        deletion, so a watch resumed from before it sees it, as from the API server."""

        async def go() -> None:
            resource, _, namespaced = COLLECTIONS[kind]
            ns = namespace if namespaced else None
            obj = self.emulator.objects[resource, ns, name]
            raw = obj.raw
            obj.delete()
            await self.emulator._buses[kmock.resource(resource)].put(
                {"type": "DELETED", "object": raw}
            )

        self.call(go())

    def compact(self) -> None:
        """Forget the watch history: a watch from an older resourceVersion gets 410."""

        async def go() -> None:
            self.emulator.compact()

        self.call(go())

    # --- observing and injecting ------------------------------------------------------
    def requests(self, action: kmock.action, resource: str) -> list[kmock.Request]:
        wanted = kmock.resource(resource)
        return [r for r in list(self.emulator) if r.action == action and r.resource == wanted]

    def watching(self, resource: str) -> bool:
        """A watch of `resource` is streaming live changes (subscribed to kmock's bus)."""
        buses = self.emulator._buses  # kmock internals: one bus per resource
        bus = buses.get(kmock.resource(resource))
        return bus is not None and bus.consumer_count > 0

    def on_next(
        self,
        action: kmock.action,
        resource: str,
        *payload: Any,
        before: Callable[[], None] | None = None,
        skip: int = 0,
        where: Callable[[kmock.Request], bool] | None = None,
    ) -> None:
        """Answer the next `action` request on `resource` (one request only; the one
        after `skip` others; only requests `where` accepts, when given) with `payload`
        (kmock's DSL: a status code, a dict as JSON, a tuple as a stream); `before` runs
        in kmock's loop first, e.g. to change objects unseen."""

        def effect() -> None:
            if before is not None:
                before()

        async def arm() -> None:  # in kmock's loop, which reads the reactions
            first = len(list(self.emulator))  # request ids count from 0
            view = self.emulator[action, kmock.resource(resource)][
                lambda r: r.id >= first and (where is None or where(r))
            ]
            reaction = view[skip : skip + 1] >> effect
            for item in payload:
                reaction = reaction << item

        self.call(arm())

    def fail_while(
        self, action: kmock.action, resource: str, condition: threading.Event, status: int
    ) -> None:
        """Answer `action` requests on `resource` with `status` while `condition` is set."""
        body = status_event(status, "InjectedFailure")["object"]

        async def arm() -> None:
            self.emulator[action, kmock.resource(resource)][condition] << status << body

        self.call(arm())


class SilentServer:
    """A TCP server on loopback that accepts connections and never answers: it reads
    nothing and sends nothing, as a hung API server whose kernel still accepts."""

    def __init__(self, port: int = 0) -> None:
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port: int = self.listener.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, name="silent-server", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # closed
                return
            self.held.append(connection)

    @property
    def accepted(self) -> int:
        return len(self.held)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(DEADLINE)
        for connection in self.held:
            connection.close()


class FreezableRelay:
    """A TCP relay on loopback in front of a server. `freeze()` makes the server look
    frozen (a stopped or deadlocked API server): connections are still accepted and
    requests still sent, but no byte goes through, either way, until `thaw()`, which
    lets everything held go on."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = False
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self._start(self._accept, "relay-accept")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def freeze(self) -> None:
        self.flowing.clear()

    def thaw(self) -> None:
        self.flowing.set()

    def _start(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client_side, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                server_side = socket.create_connection(("127.0.0.1", self.target_port), DEADLINE)
            except OSError:
                client_side.close()
                continue
            server_side.settimeout(None)
            self.sockets += [client_side, server_side]
            self._start(self._pump, "relay-up", client_side, server_side)
            self._start(self._pump, "relay-down", server_side, client_side)

    def _pump(self, source: socket.socket, destination: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self.flowing.wait()
                if self.closed:
                    return
                destination.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, destination):  # one side gone: end the other
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for end in self.sockets:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
        self.flowing.set()
        for thread in self.threads:
            thread.join(DEADLINE)
        for end in self.sockets:
            end.close()


def status_event(code: int, reason: str, message: str = "injected by the test") -> dict[str, Any]:
    """A watch ERROR event carrying a Status, as the API server sends it."""
    return {
        "type": "ERROR",
        "object": {
            "apiVersion": "v1",
            "kind": "Status",
            "status": "Failure",
            "code": code,
            "reason": reason,
            "message": message,
        },
    }


@dataclass
class Call:
    method: str
    args: tuple[Any, ...]
    result: bool


class RecordingStore(StateStore):
    """A StateStore that remembers what each upsert/delete/replace returned."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def upsert(self, value: Value) -> bool:
        result = super().upsert(value)
        self.calls.append(Call("upsert", (value,), result))
        return result

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        result = super().delete(kind, namespace, name)
        self.calls.append(Call("delete", (kind, namespace, name), result))
        return result

    def replace(self, kind: str, values: Any, keep: Any = None) -> bool:
        values = list(values)
        result = super().replace(kind, values, keep)
        self.calls.append(Call("replace", (kind, values), result))
        return result

    def offered(self, kind: str) -> set[str]:
        """`namespace/name` of every object of `kind` the source ever tried to store."""
        values = [v for call in self.calls if call.method == "upsert" for v in call.args]
        values += [v for call in self.calls if call.method == "replace" for v in call.args[1]]
        return {f"{key_of(v)[0]}/{key_of(v)[1]}" for v in values if kind_of(v) == kind}

    # Readers for tests (under the store's lock).
    def services(self) -> set[str]:
        with self.lock:
            return {f"{ns}/{name}" for ns, name in self.state.services}

    def slices(self) -> set[str]:
        with self.lock:
            return {f"{ns}/{name}" for ns, name in self.state.slices}

    def nodes(self) -> set[str]:
        with self.lock:
            return set(self.state.nodes)


@dataclass
class Harness:
    """One source under test, with its store, metrics and kmock server."""

    api: KmockApi
    store: RecordingStore
    metrics: Metrics
    source: KubernetesSource
    started: bool = field(default=False)

    def start(self, wait: bool = True) -> Harness:
        """Start the source; by default wait until it is synced and every watch streams."""
        self.source.start()
        self.started = True
        if wait:
            wait_for(lambda: self.store.synced, "the initial lists")
            for resource in RESOURCES:
                wait_for(lambda r=resource: self.api.watching(r), f"a watch of {resource}")
        return self

    def api_up(self, resource: str) -> float | None:
        return self.metrics.registry.get_sample_value(
            "kbp_api_up", {"resource": RESOURCE_NAMES[resource]}
        )

    def events(self, resource: str, kind: str) -> float:
        value = self.metrics.registry.get_sample_value(
            "kbp_api_events_total", {"resource": RESOURCE_NAMES[resource], "type": kind}
        )
        return value or 0.0


@pytest.fixture
def kmock_api() -> Iterator[KmockApi]:
    api = KmockApi()
    api.start()
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def api_client(kmock_api: KmockApi) -> Iterator[client.ApiClient]:
    configuration = client.Configuration()
    configuration.host = kmock_api.url
    api = make_client(configuration)
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def make_harness(
    kmock_api: KmockApi, api_client: client.ApiClient
) -> Iterator[Callable[..., Harness]]:
    """Factory for a source with test timings: long watches (kmock never ends them, and
    a resumed kmock watch would miss deletions), a fast backoff."""
    made: list[Harness] = []

    def make(
        service_proxy_name: str | None = None, api: client.ApiClient | None = None, **kwargs: Any
    ) -> Harness:
        """A source on `api` (default: the kmock server's client) with test timings,
        overridden by `kwargs`."""
        store = RecordingStore()
        metrics = Metrics()
        options: dict[str, Any] = {
            "watch_timeout": 60,
            "read_timeout": 30,
            "request_timeout": 2,
            "backoff_base": 0.02,
            "backoff_max": 0.1,
        }
        options.update(kwargs)
        source = KubernetesSource(
            api or api_client, store, metrics, NODE, service_proxy_name, **options
        )
        harness = Harness(kmock_api, store, metrics, source)
        made.append(harness)
        return harness

    yield make
    for harness in made:
        if harness.started:
            harness.source.stop()
