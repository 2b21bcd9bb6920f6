"""``kvmemory serve`` as users run it (a process started by the command line, not the app object in a thread):
a client that goes away mid-turn, in every dialect, streaming or not, stops its turn at once and leaves its
session usable; SIGTERM stops the server within seconds, a turn in progress undone and every session saved."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import pytest

from kvmemory import Engine
from tests.conftest import wait_until
from tests.test_http_api import model_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.small_model
KEY = "serve-key"
LONG = 1900  # reply tokens a turn would run to if nothing stopped it
ROUTES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": LONG},
    "/v1/responses": {"input": "Write a long story.", "max_output_tokens": LONG},
    "/v1/messages": {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": LONG},
}


@contextmanager
def kvmemory_serve(model, sessions, *options: str):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "kvmemory.integrations.cli", "serve", "--model", str(model), "--port", str(port)]
    command += ["--api-key", KEY, "--sessions", str(sessions), *options]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"kvmemory serve exited: {process.stderr.read()[-2000:]}")
        try:
            return httpx.get(f"{base}/v1/models", headers={"x-api-key": KEY}).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(ready, timeout=120, what="kvmemory serve to load its model")
        yield base, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    with kvmemory_serve(model_dir, tmp_path_factory.mktemp("serve-sessions")) as (base, _):
        yield base


def stats(base: str, session: str) -> dict:
    return httpx.get(f"{base}/v1/sessions/{session}", headers={"x-api-key": KEY}, timeout=10).json()


def post(base: str, route: str, session: str, body: dict, timeout: float = 60) -> httpx.Response:
    headers = {"x-api-key": KEY, "x-session-id": session}
    return httpx.post(base + route, json={"model": "default", **body}, headers=headers, timeout=timeout)


def raw_request(base: str, route: str, session: str, body: dict) -> socket.socket:
    """A request written on a plain socket (closed by the caller whenever it likes, as a crashed client is)."""
    host, port = base.removeprefix("http://").split(":")
    payload = json.dumps(
        {"model": "default", **body, "stop": ["never-said"]} if "chat" in route else {"model": "default", **body}
    ).encode()
    head = (
        f"POST {route} HTTP/1.1\r\nHost: {host}\r\nx-api-key: {KEY}\r\nx-session-id: {session}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    connection = socket.create_connection((host, int(port)))
    connection.sendall(head.encode() + payload)
    return connection


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_client_that_goes_away_stops_its_turn_at_once_under_kvmemory_serve(served, route, stream):
    session = f"gone-{route.rsplit('/', 1)[-1]}-{stream}"
    assert post(served, route, session, {**ROUTES[route], **short(route)}).status_code == 200
    before = stats(served, session)["logical_tokens"]
    connection = raw_request(served, route, session, {**ROUTES[route], "stream": stream})
    wait_until(lambda: stats(served, session)["logical_tokens"] > before + 20, timeout=30, what="the reply to grow")
    if stream:
        assert connection.recv(65536)  # part of the reply reached the client
    connection.close()
    closed = time.monotonic()
    wait_until(lambda: not stats(served, session)["busy"], timeout=10, what="the turn to stop")
    stopped_after = time.monotonic() - closed
    held = stats(served, session)["logical_tokens"]
    if stream:  # the session keeps what was sent; the turn stopped long before its 1,900 tokens
        assert before < held < before + LONG // 2
    else:  # nothing was sent: the turn is undone
        assert held == before
    assert stopped_after < 2.0
    assert post(served, route, session, {**ROUTES[route], **short(route)}, timeout=10).status_code == 200  # usable


def test_the_command_serves_no_route_without_a_key_but_health(served):
    assert httpx.head(f"{served}/health").status_code == 200
    for path in ("/docs", "/openapi.json", "/v1/models"):
        assert httpx.get(served + path).status_code == 401, path


def short(route: str) -> dict:
    return {"max_output_tokens": 2} if route == "/v1/responses" else {"max_tokens": 2}


def test_sigterm_stops_the_server_within_seconds_with_the_turn_undone_and_sessions_saved(model_dir, tmp_path):  # noqa: F811
    with kvmemory_serve(model_dir, tmp_path, "--shutdown-grace", "0.2") as (base, process):
        route = "/v1/chat/completions"
        assert post(base, route, "kept", {**ROUTES[route], "max_tokens": 3}).status_code == 200
        before = stats(base, "kept")["logical_tokens"]
        connection = raw_request(base, route, "kept", ROUTES[route])  # a long turn, still running at SIGTERM
        wait_until(lambda: stats(base, "kept")["busy"], timeout=30, what="the long turn to start")
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=15)
        assert time.monotonic() - signalled < 10 and process.returncode in (0, -signal.SIGTERM)
        connection.close()
    saved = list(tmp_path.glob("*.kvm"))
    assert len(saved) == 1 and not list(tmp_path.glob(".*.tmp"))
    assert len(Engine.from_pretrained(str(model_dir)).load_session(saved[0]).tokens) == before
