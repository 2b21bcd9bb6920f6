"""An OpenAI-compatible HTTP server whose sessions keep their compacted KV cache between requests.

    kvmemory serve [--model default] [--port 8000] [--sessions DIR [--save-after-turn]] [--max-slots 2048]
    kvmemory serve --ray --replicas 2 --sessions DIR   (Ray Serve: see integrations/ray_serve.py)

``POST /v1/chat/completions`` takes the OpenAI request (messages, tools, temperature, top_p, max_tokens,
stop, seed, ``stream`` with ``stream_options.include_usage``). The ``x-session-id`` header (or the ``user``
field) names the session: its cache stays resident (compacted under the policy's cap), so each request
prefills only the messages the session has not seen (``usage.prompt_tokens_details.cached_tokens``). A
request without a session id runs on a fresh session, like a stateless server. ``extra_body={"kvmemory":
{"policy": {...}}}`` gives a session its memory policy. Sessions: ``GET /v1/sessions/{id}`` (stats),
``GET .../memory_map.png``, ``POST .../save``, ``POST .../restore``, ``DELETE /v1/sessions/{id}``.

Requests on one session are served one at a time (a request that waits longer than ``busy_timeout`` gets
409); a failed request leaves its session as it was. A client that disconnects mid-stream leaves the
session holding the part of the reply that was sent (the rest is never added).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict

from kvmemory import (
    ContextLengthError,
    Engine,
    InvalidArgumentError,
    KVMemoryError,
    MemoryCapError,
    MemoryManager,
    MemoryPolicy,
    PolicyError,
    SessionFileError,
    SessionStore,
    StoreFullError,
    ToolCallParseError,
    default_policy,
)
from kvmemory.memory import plot_memory_map
from kvmemory.runtime.chat import parse_tool_calls, visible_content
from kvmemory.runtime.engine import KV_DTYPES


class ChatRequest(BaseModel):
    """The OpenAI chat-completions request (fields kvmemory does not use are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")

    messages: list[dict]
    model: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    kvmemory: dict | None = None


class APIError(Exception):
    """An error answered as OpenAI answers it: ``{"error": {"message", "type", "code"}}`` with a status."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code = status, message, kind, code


def error_body(message: str, kind: str, code: str | None = None) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def error_response(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code), status)


def error_status(err: APIError | KVMemoryError) -> tuple[int, str, str, str | None]:
    """(HTTP status, message, OpenAI error type, code) for an error a request caused."""
    if isinstance(err, APIError):
        return err.status, err.message, err.kind, err.code
    if isinstance(err, (ContextLengthError, MemoryCapError)):
        return 400, str(err), "invalid_request_error", "context_length_exceeded"
    if isinstance(err, StoreFullError):
        return 503, str(err), "server_error", "store_full"
    if isinstance(err, SessionFileError):
        return 404 if "no session file" in str(err) else 400, str(err), "invalid_request_error", None
    if isinstance(err, ValueError):
        return 400, str(err), "invalid_request_error", None
    return 500, str(err), "server_error", None


def chat_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages → the dicts a Session renders (text parts joined, tool-call arguments parsed)."""
    out = []
    for i, message in enumerate(messages):
        msg = dict(message)
        if isinstance(msg.get("content"), list):
            msg["content"] = "".join(p.get("text", "") for p in msg["content"] if isinstance(p, dict))
        calls = []
        for call in msg.get("tool_calls") or []:
            function = dict(call.get("function") or {})
            if isinstance(function.get("arguments"), str):
                try:
                    function["arguments"] = json.loads(function["arguments"] or "{}")
                except json.JSONDecodeError as err:
                    raise APIError(400, f"messages[{i}]: tool call arguments are not JSON: {err.msg}") from err
            calls.append({**call, "function": function})
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


class Server:
    """The engine, the session store and the per-session locks behind the HTTP app."""

    def __init__(
        self,
        engine,
        store: SessionStore,
        policy: MemoryPolicy,
        busy_timeout: float = 30.0,
        save_after_turn: bool = False,
    ):
        if save_after_turn and store.directory is None:
            raise InvalidArgumentError("save_after_turn needs a store with a directory")
        self.engine, self.store, self.policy, self.busy_timeout = engine, store, policy, busy_timeout
        self.save_after_turn = save_after_turn
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    @contextmanager
    def lock(self, session_id: str):
        """Hold the session against other requests; 409 if it stays busy longer than ``busy_timeout``."""
        with self._guard:
            lock = self._locks.setdefault(session_id, threading.Lock())
        if not lock.acquire(timeout=self.busy_timeout):
            raise APIError(409, f"session {session_id!r} is busy with another request", "conflict", "session_busy")
        try:
            yield
        finally:
            lock.release()

    @contextmanager
    def session(self, session_id: str | None, policy: dict | None):
        """The named session (or a fresh one for a request without an id), held for the request."""
        memory_policy = self._policy(policy)
        if session_id is None:
            session = self.engine.session(memory=MemoryManager(memory_policy))
            try:
                yield session
            finally:
                session.close()
            return
        with self.lock(session_id), self.store.use(session_id, lambda: MemoryManager(memory_policy)) as session:
            if policy is not None:
                session.memory.set_policy(memory_policy)
            yield session

    def complete(self, session_id: str | None, request: ChatRequest) -> dict:
        """The chat completion for ``request`` on the session (a failure leaves it as it was)."""
        with self.session(session_id, (request.kvmemory or {}).get("policy")) as session:
            with session.transaction():
                prompt, cached = prefill(session, request)
                result = session.generate(**sampling(request))
            self._after_turn(session_id)
        message, finish = reply_message(result.text)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.engine.name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish or result.finish_reason}],
            "usage": usage(prompt, cached, len(result.token_ids)),
        }

    def stream(self, session_id: str | None, request: ChatRequest) -> Iterator[str]:
        """The completion as server-sent events, ending with a usage chunk when asked and ``[DONE]``; errors
        come as an error event (the status line is sent before the first token)."""
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta: dict, finish: str | None = None, **extra) -> str:
            body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.engine.name}
            body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}] if delta is not None else []
            return f"data: {json.dumps({**body, **extra})}\n\n"

        try:
            with self.session(session_id, (request.kvmemory or {}).get("policy")) as session:
                before = session.snapshot()  # a failure (not a disconnect) puts the session back as it was
                try:
                    prompt, cached = prefill(session, request)
                    yield chunk({"role": "assistant", "content": ""})
                    shown, result = 0, None
                    for _, result in session.start_generation(**sampling(request)):
                        visible = visible_content(result.text)
                        if len(visible) > shown:
                            yield chunk({"content": visible[shown:]})
                            shown = len(visible)
                except Exception:
                    session.restore(before)
                    raise
                self._after_turn(session_id)
                message, finish = reply_message(result.text)
                if message.get("tool_calls"):
                    calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
                    yield chunk({"tool_calls": calls})
                elif (message["content"] or "")[shown:]:
                    yield chunk({"content": message["content"][shown:]})
                yield chunk({}, finish or result.finish_reason)
                if (request.stream_options or {}).get("include_usage"):
                    yield chunk(None, usage=usage(prompt, cached, len(result.token_ids)))
        except (APIError, KVMemoryError) as err:
            _, message, kind, code = error_status(err)
            yield f"data: {json.dumps({'error': {'message': message, 'type': kind, 'code': code}})}\n\n"
        yield "data: [DONE]\n\n"

    def _after_turn(self, session_id: str | None) -> None:
        """Save the session after each turn when asked to (what a restarted or failed-over server resumes)."""
        if self.save_after_turn and session_id is not None:
            self.store.save(session_id)

    def _policy(self, requested: dict | None) -> MemoryPolicy:
        if requested is None:
            return self.policy
        try:
            return MemoryPolicy.from_dict(requested)
        except PolicyError as err:
            raise APIError(422, f"invalid kvmemory policy: {err}", "invalid_request_error", "invalid_policy") from err


def sampling(request: ChatRequest) -> dict:
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    return {
        "max_new_tokens": request.max_completion_tokens or request.max_tokens or 512,
        "temperature": request.temperature if request.temperature is not None else 0.0,
        "top_p": request.top_p if request.top_p is not None else 1.0,
        "stop": stop or None,
        "seed": request.seed,
    }


def prefill(session, request: ChatRequest) -> tuple[int, int]:
    """Bring the session to the request's conversation; (prompt tokens, of those already cached)."""
    tools = request.tools if request.tool_choice != "none" else None
    before = session.prefilled_tokens
    session.set_messages(chat_messages(request.messages), tools=tools, add_generation_prompt=True)
    prompt = len(session.tokens)
    return prompt, prompt - (session.prefilled_tokens - before)


def reply_message(text: str) -> tuple[dict, str | None]:
    """The assistant message in the OpenAI shape, and "tool_calls" as finish reason when it calls tools."""
    try:
        content, calls = parse_tool_calls(text)
    except ToolCallParseError:
        return {"role": "assistant", "content": text}, None
    if not calls:
        return {"role": "assistant", "content": content}, None
    tool_calls = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["args"])}}
        for c in calls
    ]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, "tool_calls"


def finite(value):
    """JSON without NaN or infinity (a segment never compacted has an infinite ratio): those become None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def usage(prompt: int, cached: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def create_app(
    engine,
    store: SessionStore | None = None,
    policy: MemoryPolicy | None = None,
    max_request_mb: float = 32.0,
    save_after_turn: bool = False,
) -> FastAPI:
    """The FastAPI app serving ``engine``; sessions live in ``store`` (in memory by default), saved to its
    directory after every turn with ``save_after_turn``; request bodies over ``max_request_mb`` get 413."""
    store = store or SessionStore(engine)
    server = Server(engine, store, policy or default_policy(max_slots=2048), save_after_turn=save_after_turn)
    app = FastAPI(title="kvmemory", description=__doc__)
    app.state.server = server

    @app.middleware("http")
    async def limit_size(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > max_request_mb * 1e6:
            message = f"request body of {int(size):,} bytes is over the server's {max_request_mb:g} MB limit"
            return error_response(413, message, "invalid_request_error", "request_too_large")
        return await call_next(request)

    @app.exception_handler(APIError)
    @app.exception_handler(KVMemoryError)
    async def request_error(_: Request, err: Exception):
        return error_response(*error_status(err))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError):
        return error_response(400, f"invalid request: {err.errors()}", "invalid_request_error")

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": engine.name, "object": "model", "owned_by": "kvmemory"}]}

    @app.post("/v1/chat/completions")
    def chat_completions(request: ChatRequest, x_session_id: str | None = Header(None)):
        session_id = x_session_id or request.user
        if request.stream:
            return StreamingResponse(server.stream(session_id, request), media_type="text/event-stream")
        return server.complete(session_id, request)

    @app.get("/v1/sessions/{session_id}")
    def session_stats(session_id: str):
        known(session_id)
        with server.session(session_id, None) as session:
            stats = session.stats()
        return finite({"id": session_id, **asdict(stats), "compression": stats.compression})

    @app.get("/v1/sessions/{session_id}/memory_map.png")
    def memory_map(session_id: str):
        known(session_id)
        with server.session(session_id, None) as session:
            buffer = io.BytesIO()
            plot_memory_map(session.memory.timeline, session.segments, buffer, title=f"session {session_id}")
        return Response(buffer.getvalue(), media_type="image/png")

    @app.post("/v1/sessions/{session_id}/save")
    def save(session_id: str):
        known(session_id)
        if server.store.directory is None:
            raise APIError(400, "the server was started without --sessions DIR: nowhere to save")
        with server.session(session_id, None):
            path = server.store.save(session_id)
        return {"id": session_id, "saved": True, "bytes": path.stat().st_size}

    @app.post("/v1/sessions/{session_id}/restore")
    def restore(session_id: str):
        """Load the session from its saved file (replacing the resident one)."""
        path = server.store.path(session_id)
        if path is None or not path.is_file():
            raise APIError(404, f"no saved session {session_id!r}", "not_found_error", "session_not_found")
        with server.lock(session_id):
            session = server.store.reload(session_id)
        return {"id": session_id, "restored": True, "logical_tokens": len(session.tokens)}

    @app.delete("/v1/sessions/{session_id}")
    def delete(session_id: str):
        known(session_id)
        server.store.drop(session_id)
        return {"id": session_id, "deleted": True}

    def known(session_id: str) -> None:
        if session_id not in server.store:
            raise APIError(404, f"no session {session_id!r}", "not_found_error", "session_not_found")

    return app


def loading_app(load: Callable[[], FastAPI]) -> FastAPI:
    """An app that answers 503 (OpenAI-style, with Retry-After) while ``load()`` builds the real app in a
    background thread, then serves it: the port is open from the start, as a server loading a model should."""
    outer = FastAPI(title="kvmemory")
    ready = threading.Event()
    failed: list[BaseException] = []

    def build():
        try:
            outer.mount("/", load())
        except BaseException as err:  # reported to every request instead of dying silently in a thread
            failed.append(err)
        finally:
            ready.set()

    @outer.middleware("http")
    async def while_loading(request: Request, call_next):
        if not ready.is_set():
            response = error_response(503, "the model is still loading; retry shortly", "server_error", "loading")
            response.headers["Retry-After"] = "5"
            return response
        if failed:
            return error_response(500, f"the server failed to load: {failed[0]}", "server_error", "load_failed")
        return await call_next(request)

    threading.Thread(target=build, daemon=True).start()
    outer.state.ready = ready
    return outer


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """Serve ``app`` with uvicorn in a background thread (port 0: a free one); yields the base URL.

    The socket is bound here and handed to uvicorn, so the port is held from the start (a free port probed
    and then bound by the server could be taken in between)."""
    import uvicorn

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        if not server.started:
            raise RuntimeError(f"the server on {host}:{port} did not start")
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listener.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="kvmemory", description="kvmemory command line")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="an OpenAI-compatible server (see integrations/server.py)")
    serve.add_argument("--model", default="default", help="a model name, HF id, local directory or .gguf file")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--sessions", default=None, help="directory where sessions are saved (and spilled)")
    serve.add_argument("--max-resident-mb", type=float, default=None, help="KV of resident sessions, then spill")
    serve.add_argument("--max-slots", type=int, default=2048, help="the default policy's cap per session")
    serve.add_argument(
        "--kv-dtype",
        choices=sorted(KV_DTYPES),
        default=None,
        help="KV cache storage (default: float16 under 16-bit or int4 weights on CPU, else the model's dtype)",
    )
    serve.add_argument("--max-request-mb", type=float, default=32.0, help="larger request bodies get 413")
    serve.add_argument("--save-after-turn", action="store_true", help="save each session after every turn")
    serve.add_argument("--ray", action="store_true", help="serve on Ray Serve (see integrations/ray_serve.py)")
    serve.add_argument("--replicas", type=int, default=2, help="with --ray: engine replicas")
    args = parser.parse_args(argv)
    if args.ray:
        if args.sessions is None:
            parser.error("--ray needs --sessions DIR: a directory every replica can read (sessions fail over)")
        from integrations.ray_serve import run

        run(args.model, args.sessions, args.replicas, args.host, args.port, args.max_slots, args.kv_dtype)
        return
    if args.save_after_turn and args.sessions is None:
        parser.error("--save-after-turn needs --sessions DIR")
    import uvicorn

    def load() -> FastAPI:
        engine = Engine.from_pretrained(args.model, kv_dtype=args.kv_dtype)
        budget = int(args.max_resident_mb * 1e6) if args.max_resident_mb else None
        store = SessionStore(engine, args.sessions, budget)
        policy = default_policy(max_slots=args.max_slots)
        return create_app(engine, store, policy, args.max_request_mb, args.save_after_turn)

    uvicorn.run(loading_app(load), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
