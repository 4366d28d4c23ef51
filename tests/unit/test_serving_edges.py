"""Edge cases of the serving layer's life cycle (agent/api/serving.py): a server closed
from the event loop's own thread (by a handler, or by a callback on the loop) or from a
worker thread, and an event loop that is slow or fails to start serving. Loopback only."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from agent.api import serving
from agent.api.serving import Request, Response, Server, json_response, serve

pytestmark = pytest.mark.usefixtures("no_thread_leak")  # tests/unit/conftest.py

PROMPT = 3.0  # seconds: far more than any of this takes, far less than a hang


def get(port: int, path: str) -> int | str:
    """The status of GET `path`, or the error's name when the connection was dropped."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=PROMPT)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException) as err:
        return type(err).__name__
    finally:
        conn.close()


def refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=PROMPT).close()
    except ConnectionRefusedError:
        return True
    return False


class Closer:
    """A handler that closes its own server, and what the close did."""

    def __init__(self) -> None:
        self.server: Server | None = None
        self.took: float | None = None
        self.error: BaseException | None = None
        self.thread = ""

    def __call__(self, request: Request) -> Response:
        assert self.server is not None
        started = time.monotonic()
        self.thread = threading.current_thread().name
        try:
            self.server.close()
        except BaseException as err:
            self.error = err
        self.took = time.monotonic() - started
        return json_response(200, {"closing": True})


@pytest.mark.parametrize("workers", [0, 2], ids=["on the loop", "on a worker"])
def test_a_handler_may_close_its_own_server(workers: int) -> None:
    closer = Closer()
    closer.server = serve("127.0.0.1:0", {"/quit": closer}, workers=workers)
    port = closer.server.port
    started = time.monotonic()
    answer = get(port, "/quit")
    while closer.took is None:  # the client may be dropped before the handler returns
        assert time.monotonic() - started < PROMPT, "close() in a handler did not return"
        time.sleep(0.01)
    assert closer.error is None, repr(closer.error)
    assert closer.took < PROMPT
    assert closer.thread == ("kbp-http loop" if workers == 0 else "kbp-http worker")
    # The connection is dropped with the others, or answered if that came first.
    assert answer in (200, "RemoteDisconnected", "ConnectionResetError", "BadStatusLine")
    assert closer.server.closed
    assert refused(port)


def test_close_from_a_callback_on_the_loop_thread() -> None:
    server = serve("127.0.0.1:0", {})
    loop = server.shared.loop
    done: list[BaseException | None] = []

    def close() -> None:
        try:
            server.close()
            done.append(None)
        except BaseException as err:
            done.append(err)

    loop.call_soon_threadsafe(close)
    deadline = time.monotonic() + PROMPT
    while not done:
        assert time.monotonic() < deadline, "close() on the loop thread did not return"
        time.sleep(0.01)
    assert done == [None]
    assert refused(server.port)


def test_one_server_closed_on_the_loop_leaves_the_others_serving() -> None:
    other = serve("127.0.0.1:0", {"/ok": lambda request: json_response(200, {})})
    try:
        closer = Closer()
        closer.server = serve("127.0.0.1:0", {"/quit": closer}, workers=0)
        get(closer.server.port, "/quit")
        assert closer.took is not None and closer.error is None, repr(closer.error)
        assert get(other.port, "/ok") == 200
    finally:
        other.close()


@pytest.fixture
def blocked_loop() -> Iterator[threading.Event]:
    """The shared event loop busy in a callback until the event is set (at the latest
    when the test ends), as a loop stuck in a slow handler would be."""
    keeper = serve("127.0.0.1:0", {})  # holds the loop thread for the test
    release = threading.Event()
    keeper.shared.loop.call_soon_threadsafe(release.wait, 30)
    try:
        yield release
    finally:
        release.set()
        keeper.close()


def test_a_loop_that_does_not_start_serving_in_time_is_a_clear_error(
    blocked_loop: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(serving, "START_TIMEOUT", 0.3)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not start serving 127\.0\.0\.1:\d+ within 0\.3 s"):
        serve("127.0.0.1:0", {}, name="health server")
    assert time.monotonic() - started < PROMPT
    blocked_loop.set()
    time.sleep(0.2)  # the loop runs what was queued for it meanwhile
    # nothing listens on what was bound for it: the socket was closed, the start cancelled
    with serve("127.0.0.1:0", {}) as after:
        assert get(after.port, "/") == 404


def test_a_failing_start_is_reported_and_releases_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def refuse(*args: object, **kwargs: object) -> asyncio.Server:
        raise OSError("no room for another server")

    monkeypatch.setattr(asyncio.BaseEventLoop, "create_server", refuse)
    with pytest.raises(OSError, match="no room for another server"):
        serve("127.0.0.1:0", {}, name="metrics server")
    assert serving._current is None  # the loop thread it started has stopped


def test_serve_on_the_loop_thread_is_refused_not_a_hang() -> None:
    started: list[BaseException | Server] = []

    def handler(request: Request) -> Response:
        try:
            started.append(serve("127.0.0.1:0", {}))
        except RuntimeError as err:
            started.append(err)
        return json_response(200, {})

    with serve("127.0.0.1:0", {"/serve": handler}, workers=0) as server:
        begun = time.monotonic()
        assert get(server.port, "/serve") == 200
        assert time.monotonic() - begun < PROMPT
    (error,) = started
    assert isinstance(error, RuntimeError)
    assert "called on the HTTP event loop's thread" in str(error)
