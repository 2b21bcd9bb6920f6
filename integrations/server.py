"""The HTTP server: OpenAI Chat Completions, the OpenAI Responses API and the Anthropic Messages API over
sessions whose compacted KV cache stays resident between requests.

    kvmemory serve [--model default] [--port 8000] [--sessions DIR] [--api-key KEY ...]
    kvmemory serve --ray --replicas 2 --sessions DIR   (Ray Serve: see integrations/ray_serve.py)

Routes (each dialect is converted into the serving core, ``integrations/serving.py``):

* ``POST /v1/chat/completions``; ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``;
  ``POST /v1/messages``, ``POST /v1/messages/count_tokens``; ``GET /v1/models``.
* Sessions: ``GET /v1/sessions`` (yours), ``GET /v1/sessions/{id}`` (stats, readable during a turn),
  ``GET .../memory_map.png``, ``POST .../save``, ``POST .../restore``, ``DELETE /v1/sessions/{id}``.
* ``GET /health`` (no key needed: for load balancers).

With ``--api-key`` (repeatable; or ``KVMEMORY_API_KEYS``, comma-separated; or ``--api-key-file``, one per
line) every other route needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``, and each key sees only
the sessions and responses it made (another key gets 404). Request bodies over ``--max-request-mb`` get
413, chunked or not. A client that goes away cancels its turn at the next token: a non-streaming turn is
undone, a stream keeps exactly the text it sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import State
from starlette.exceptions import HTTPException

from kvmemory import MemoryPolicy, SessionStore, default_policy
from kvmemory.defaults import DEFAULT_MAX_SLOTS
from kvmemory.integrations.dialects import anthropic_messages, openai_chat, openai_responses
from kvmemory.integrations.response_log import Marks, ResponseLog
from kvmemory.integrations.serving import (
    APIError,
    AsyncCore,
    BadRequest,
    Cancelled,
    NotFound,
    Reply,
    ServerError,
    ServingCore,
    TooLarge,
    Turn,
    Unauthorized,
    session_key,
)
from kvmemory.integrations.strict_json import read_json

log = logging.getLogger("kvmemory.server")
MB = 2**20  # every "MB" of the command line is a mebibyte


def owner_of(key: str) -> str:
    """The owner an API key stands for (a digest: keys are never stored or logged)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


# ---- backends: where turns run (this process, or Ray replicas) --------------------------------


class LocalBackend:
    """Turns and session calls on a ServingCore in this process."""

    def __init__(self, core: ServingCore):
        self.core, self.worker = core, AsyncCore(core)

    def run(self, turn: Turn):
        return self.worker.run(turn)

    def stream(self, turn: Turn) -> AsyncIterator[str | Reply]:
        return self.worker.stream(turn)

    async def session(self, operation: str, key: str):
        """``operation`` (stats, memory_map, save, restore, delete) on the session ``key``."""
        return await self.worker.call(getattr(self.core, operation), key)

    async def sessions(self, owner: str | None) -> list[str]:
        return await self.worker.call(self.core.sessions, owner)

    async def count_tokens(self, turn: Turn) -> int:
        return await self.worker.call(self.core.count_tokens, turn)


# ---- the HTTP app --------------------------------------------------------------------------------


def dialect_error(path: str, err: APIError) -> dict:
    """The error body in the shape of the route's dialect."""
    if path.startswith("/v1/messages"):
        return anthropic_messages.error_body(err)
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


class Gate:
    """ASGI middleware in front of every route: the API key (401), then the body size (413, counted as the
    body arrives, so a chunked body cannot pass the limit); the request's owner goes in ``request.state``."""

    def __init__(self, app: FastAPI, keys: tuple[str, ...], max_body: int):
        self.app, self.owners, self.max_body = app, {k: owner_of(k) for k in keys}, max_body

    @property
    def state(self):
        """The app's state (``core``, the serving core, in a single process)."""
        return self.app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            scope.setdefault("state", {})["owner"] = self.owner(scope)
            receive = await self.buffered(scope, receive)
        except APIError as err:
            return await JSONResponse(dialect_error(scope["path"], err), err.status)(scope, receive, send)
        await self.app(scope, receive, send)

    def owner(self, scope) -> str | None:
        if not self.owners or scope["path"] == "/health":
            return None
        headers = {k.decode().lower(): v.decode(errors="replace") for k, v in scope["headers"]}
        given = headers.get("x-api-key") or headers.get("authorization", "").removeprefix("Bearer ").strip()
        for key, owner in self.owners.items():
            if given and hmac.compare_digest(given.encode(), key.encode()):
                return owner
        raise Unauthorized("a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)")

    async def buffered(self, scope, receive):
        """The body read up to the limit, then handed on as one message (later reads see disconnects)."""
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        too_large = TooLarge(f"the request body is over the server's {self.max_body / MB:g} MB limit")
        if declared.isdigit() and int(declared) > self.max_body:
            raise too_large
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return receive
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                raise too_large
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        return replay


async def json_body(request: Request):
    return read_json(await request.body())


async def unless_disconnected(request: Request, work):
    """Await ``work``; if the client goes away first, cancel it (the core undoes the turn) and raise
    ``Cancelled`` (answered with a 499 nobody reads)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise Cancelled("the client went away")
    finally:
        task.cancel()  # (a no-op once done) also when this handler is cancelled, as Ray Serve does


async def first_then_rest(request: Request, items: AsyncIterator) -> AsyncIterator:
    """Run a stream to its first item before answering, so that an error found while prefilling gets its
    own HTTP status; then the whole stream."""
    first = await unless_disconnected(request, anext(items))

    async def chained():
        yield first
        async for item in items:
            yield item

    return chained()


def event_stream(events: AsyncIterator[str], error_event: Callable[[APIError], str]) -> StreamingResponse:
    async def guarded():
        try:
            async for event in events:
                yield event
        except APIError as err:
            yield error_event(err)

    return StreamingResponse(guarded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def error_response(status: int, message: str, kind: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": code}}, status)


def openai_error_event(err: APIError) -> str:
    return f"data: {json.dumps(dialect_error('', err))}\n\ndata: [DONE]\n\n"


def conversation_key(owner: str | None, messages: list[dict]) -> str:
    """The session a stateless client's conversation belongs to: found by its messages up to the first user
    message (a client that resends the conversation every turn keeps landing on the same session)."""
    head = []
    for message in messages:
        head.append({k: message.get(k) for k in ("role", "content")})
        if message["role"] == "user":
            break
    return session_key(owner, "conv-" + hashlib.sha256(json.dumps(head).encode()).hexdigest()[:32])


class Served:
    """What every route reads: the backend (a LocalBackend, or the Ray ingress's replicas), the names the model
    answers to, the stored responses; and how a request names its session."""

    def __init__(self, backend, model: str, model_aliases: tuple[str, ...], responses: ResponseLog):
        self.backend, self.model, self.responses = backend, model, responses
        self.marks = Marks(responses)
        self.names = (model, "default", *model_aliases)  # "default": whatever model the server was started with

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.names and "*" not in self.names:
            served = ", ".join(repr(n) for n in self.names)
            raise NotFound(
                f"model {name!r} is not served here; this server serves {served} (start it with --model-alias NAME "
                "to accept another name, or --model-alias '*' for any)",
                code="model_not_found",
                param="model",
            )

    @staticmethod
    def owner(request: Request) -> str | None:
        return request.state.owner

    def key(self, request: Request, body_id: str | None = None, param: str = "x-session-id") -> str | None:
        given = request.headers.get("x-session-id") or body_id
        if given is None:
            return None
        where = "x-session-id" if request.headers.get("x-session-id") else param
        return session_key(self.owner(request), given, where)


def http_app(
    backend,
    model: str,
    api_keys: tuple[str, ...] = (),
    model_aliases: tuple[str, ...] = (),
    max_request_mb: float = 32.0,
    responses: ResponseLog | None = None,
) -> Gate:
    """The routes over ``backend`` (a LocalBackend, or the Ray ingress's replicas), behind the key and size
    gate: one router per dialect, each converting its requests into the serving core's turns."""
    app = FastAPI(title="kvmemory", description=__doc__)
    served = Served(backend, model, tuple(model_aliases), responses or ResponseLog())
    add_error_handlers(app)
    for router in (general_routes, openai_chat_routes, openai_responses_routes, anthropic_routes, session_routes):
        app.include_router(router(served))
    return Gate(app, tuple(api_keys), int(max_request_mb * MB))


def add_error_handlers(app: FastAPI) -> None:
    """Every error in the shape of the dialect its route speaks; a crash a 500 that names only its type."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(dialect_error(request.url.path, err), err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException):
        kind = NotFound if err.status_code == 404 else BadRequest
        error = kind(f"{request.method} {request.url.path}: {err.detail}", code="unknown_route")
        error.status = err.status_code
        return JSONResponse(dialect_error(request.url.path, error), err.status_code)

    @app.exception_handler(Exception)
    async def crash(request: Request, err: Exception):
        log.exception("unexpected error on %s", request.url.path)
        error = ServerError(f"internal error ({type(err).__name__}); the server log has the details")
        return JSONResponse(dialect_error(request.url.path, error), 500)


def general_routes(served: Served) -> APIRouter:
    router = APIRouter()

    @router.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return {"status": "ok", "model": served.model}

    @router.get("/v1/models")
    async def models():
        entry = {"id": served.model, "object": "model", "owned_by": "kvmemory", "created": 0}
        return {"object": "list", "data": [entry]}

    return router


def openai_chat_routes(served: Served) -> APIRouter:
    router, backend, model = APIRouter(), served.backend, served.model

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = openai_chat.request(await json_body(request))
        served.check_model(req.model)
        turn = openai_chat.turn(req, served.key(request, req.user, "user"))
        if req.stream:
            items = await first_then_rest(request, backend.stream(turn))
            return event_stream(openai_chat.events(req, items, model), openai_error_event)
        return openai_chat.answer(await unless_disconnected(request, backend.run(turn)), model)

    return router


def responses_turn(served: Served, request: Request, req) -> tuple[Turn, dict[str, str]]:
    """A Responses request's turn (create or compact) and the tool calls its conversation made so far: it
    continues ``previous_response_id``'s conversation and session, else the one its key or first messages name."""
    who = served.owner(request)
    earlier, calls, session = [], {}, served.key(request, req.prompt_cache_key, "prompt_cache_key")
    if req.previous_response_id is not None:
        previous = served.responses.get(req.previous_response_id, who)
        earlier, calls = previous["conversation"], previous["calls"]
        session = session or previous["session"]
    turn = openai_responses.turn(req, session, earlier, calls, served.marks.expander(who))
    if turn.session is None:
        turn.session = conversation_key(who, turn.messages)
    return turn, calls


def openai_responses_routes(served: Served) -> APIRouter:
    router, backend, model, log_ = APIRouter(), served.backend, served.model, served.responses

    @router.post("/v1/responses")
    async def create_response(request: Request):
        req = openai_responses.request(await json_body(request))
        served.check_model(req.model)
        who = served.owner(request)
        turn, calls = responses_turn(served, request, req)
        ident = "resp_" + os.urandom(16).hex()

        def store(reply: Reply, body: dict) -> None:
            if req.store:
                held = reply.conversation[1:] if req.instructions else reply.conversation
                made = {c["id"]: c["name"] for c in reply.tool_calls}
                record = {
                    "id": ident,
                    "owner": who,
                    "session": turn.session,
                    "conversation": held,
                    "calls": {**calls, **made},
                    "response": body,
                }
                log_.put(record)

        if req.stream:
            items = await first_then_rest(request, served.marks.passing(backend.stream(turn), who, turn.session))
            events = openai_responses.events(req, ident, model, items, store)
            return event_stream(events, lambda err: responses_error_event(ident, err))
        reply = await unless_disconnected(request, backend.run(turn))
        served.marks.store(reply.applied_edits, who, turn.session)
        body = openai_responses.response(req, ident, model, reply)
        store(reply, body)
        return body

    @router.post("/v1/responses/compact")
    async def compact(request: Request):
        """Compact the conversation's session now (latent: nothing is summarised or prefilled again) and answer
        with its user messages and a compaction item that stands for the conversation."""
        req = openai_responses.compact_request(await json_body(request))
        served.check_model(req.model)
        who = served.owner(request)
        turn, _ = responses_turn(served, request, req)
        reply = await unless_disconnected(request, backend.run(turn))
        served.marks.store(reply.applied_edits, who, turn.session)
        return openai_responses.compacted("resp_" + os.urandom(16).hex(), turn.messages, reply)

    @router.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str):
        return log_.get(response_id, served.owner(request))["response"]

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str):
        log_.delete(response_id, served.owner(request))
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def anthropic_routes(served: Served) -> APIRouter:
    router, backend, model = APIRouter(), served.backend, served.model

    @router.post("/v1/messages")
    async def messages(request: Request):
        req = anthropic_messages.request(await json_body(request))
        served.check_model(req.model)
        who, managed = served.owner(request), req.context_management is not None
        turn = anthropic_messages.turn(req, served.key(request), served.marks.expander(who))
        if turn.session is None:
            turn.session = conversation_key(who, turn.messages)
        if req.stream:
            items = await first_then_rest(request, served.marks.passing(backend.stream(turn), who, turn.session))
            return event_stream(anthropic_messages.events(model, items, managed), anthropic_messages.error_event)
        reply = await unless_disconnected(request, backend.run(turn))
        served.marks.store(reply.applied_edits, who, turn.session)
        return anthropic_messages.answer(reply, model, managed)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        req = anthropic_messages.request(await json_body(request), anthropic_messages.CountRequest)
        served.check_model(req.model)
        turn = Turn(anthropic_messages.chat_messages(req), anthropic_messages.tools(req))
        return {"input_tokens": await backend.count_tokens(turn)}

    return router


def session_routes(served: Served) -> APIRouter:
    """kvmemory's own routes: a session's stats and memory map; save, restore and delete it."""
    router, backend = APIRouter(), served.backend

    def key(request: Request, session_id: str) -> str | None:
        return served.key(request, session_id, "session_id")

    @router.get("/v1/sessions")
    async def sessions(request: Request):
        ids = await backend.sessions(served.owner(request))
        return {"object": "list", "data": [{"id": i, "object": "session"} for i in ids]}

    @router.get("/v1/sessions/{session_id}")
    async def session_stats(request: Request, session_id: str):
        stats = await backend.session("stats", key(request, session_id))
        return finite({"id": session_id, **stats})

    @router.get("/v1/sessions/{session_id}/memory_map.png")
    async def memory_map(request: Request, session_id: str):
        png = await backend.session("memory_map", key(request, session_id))
        return Response(png, media_type="image/png")

    @router.post("/v1/sessions/{session_id}/save")
    async def save(request: Request, session_id: str):
        size = await backend.session("save", key(request, session_id))
        return {"id": session_id, "saved": True, "bytes": size}

    @router.post("/v1/sessions/{session_id}/restore")
    async def restore(request: Request, session_id: str):
        """Load the session from its saved file (replacing the resident one)."""
        tokens = await backend.session("restore", key(request, session_id))
        return {"id": session_id, "restored": True, "logical_tokens": tokens}

    @router.delete("/v1/sessions/{session_id}")
    async def delete(request: Request, session_id: str):
        await backend.session("delete", key(request, session_id))
        return {"id": session_id, "deleted": True}

    return router


def responses_error_event(ident: str, err: APIError) -> str:
    failed = {
        "id": ident,
        "object": "response",
        "status": "failed",
        "error": {"code": err.code or err.kind, "message": err.message},
    }
    return f"event: response.failed\ndata: {json.dumps({'type': 'response.failed', 'response': failed})}\n\n"


def finite(value):
    """JSON without NaN or infinity (a segment never compacted has an infinite ratio): those become None."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def create_app(
    engine,
    store: SessionStore | None = None,
    policy: MemoryPolicy | None = None,
    max_request_mb: float = 32.0,
    save_after_turn: bool = False,
    *,
    api_keys: tuple[str, ...] = (),
    model_aliases: tuple[str, ...] = (),
    max_sessions: int | None = None,
    session_ttl: float | None = None,
    busy_timeout: float = 30.0,
    max_new_tokens: int | None = None,
    sessions_per_key: int | None = None,
    bytes_per_key: int | None = None,
    responses_per_key: int = 1000,
):
    """The app serving ``engine`` in this process; sessions live in ``store`` (in memory by default), saved
    to its directory after every turn with ``save_after_turn``; at most ``max_sessions``, and per API key
    ``sessions_per_key`` sessions of ``bytes_per_key`` bytes and ``responses_per_key`` stored responses; those
    idle for ``session_ttl`` seconds deleted."""
    store = store or SessionStore(engine)
    policy = policy or default_policy(max_slots=DEFAULT_MAX_SLOTS)
    core = ServingCore(
        store,
        policy,
        busy_timeout,
        save_after_turn,
        max_sessions,
        session_ttl,
        max_new_tokens,
        sessions_per_key=sessions_per_key,
        bytes_per_key=bytes_per_key,
    )
    responses = ResponseLog(store.directory, responses_per_key, session_ttl)
    app = http_app(LocalBackend(core), engine.name, api_keys, model_aliases, max_request_mb, responses)
    app.state.core = core
    return app


class LoadingApp:
    """The ASGI app ``kvmemory serve`` runs: 503 (OpenAI-style, with Retry-After) while ``load()`` builds the real
    app in a background thread, then every request goes straight to it, with its own ``receive`` and ``send``, so
    that a client going away reaches the route as it would without this wrapper (and cancels its turn). On
    shutdown every resident session is saved to ``--sessions`` when the server has one."""

    def __init__(self, load: Callable[[], Gate]):
        self.state = State()
        self.state.ready = threading.Event()
        self.app: Gate | None = None
        self.failed: BaseException | None = None
        threading.Thread(target=self._build, args=(load,), daemon=True).start()

    def _build(self, load) -> None:
        try:
            self.app = load()
        except BaseException as err:  # reported to every request instead of dying silently in a thread
            self.failed = err
        finally:
            self.state.ready.set()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if self.failed is not None:
            message = f"the server failed to load: {self.failed}"
            return await error_response(500, message, "server_error", "load_failed")(scope, receive, send)
        if self.app is None:
            response = error_response(503, "the model is still loading; retry shortly", "server_error", "loading")
            response.headers["Retry-After"] = "5"
            return await response(scope, receive, send)
        await self.app(scope, receive, send)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                core = getattr(self.app.state, "core", None) if self.app is not None else None
                if core is not None:
                    await asyncio.to_thread(core.save_all)
                await send({"type": "lifespan.shutdown.complete"})
                return


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


def serving_policy(settings: dict) -> MemoryPolicy:
    """``--policy FILE`` when given, else the default policy under ``--max-slots``."""
    if settings.get("policy"):
        return MemoryPolicy.from_file(settings["policy"])
    return default_policy(max_slots=settings.get("max_slots", DEFAULT_MAX_SLOTS))
