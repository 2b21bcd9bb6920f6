"""kvmemory on Ray Serve: engine replicas behind the OpenAI-compatible app, each session served by the
replica that holds its cache.

    kvmemory serve --ray --replicas 2 --sessions /shared/dir [--model default] [--port 8000]

Two deployments:

* ``SessionReplica`` (``--replicas`` of them): an Engine, a SessionStore on the shared sessions directory
  and the same ``Server`` the single-process app runs, saving every session after each turn.
* ``OpenAIIngress`` (one): the HTTP front door (``serve.ingress``). It reads the session id (the
  ``x-session-id`` header or the ``user`` field) and calls the replicas through a handle with that id as
  the *multiplexed model id*.

Session affinity: ``SessionAffinityRouter`` ranks the replicas for each session id by rendezvous hashing
of (session id, replica id), so every router sends a session to the same replica from its first request on,
without waiting for replicas to report what they hold (Ray's multiplex routing learns that asynchronously,
and a quick second turn could land elsewhere), and when a replica leaves only its sessions move, each to its
next-ranked replica. The session's life on a replica is Ray Serve's model multiplexing keyed by session id:
the replica loads the session on its first request there and evicts its least recently used ids, calling
the loaded object's ``__del__``, which spills the session to the shared directory.

When a replica dies or is drained, the ingress retries the request; the router picks a live replica,
which loads the session from its last saved turn (a shared directory here; object storage in production).
A missing or damaged file makes a fresh session, which the request rebuilds from its messages (an OpenAI
request carries the whole conversation). Nothing happens silently: each response names its replica
(``x-kvmemory-replica``) and, on a session's first request there, where the session came from
(``x-kvmemory-session``: ``loaded`` from its file, ``new``, or ``rebuilt`` when its file was unusable).
"""

import asyncio
import hashlib
import json
import logging
import os
from pathlib import Path

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica
from starlette.concurrency import iterate_in_threadpool

from integrations.server import APIError, ChatRequest, Server, error_body, error_response, error_status
from kvmemory import Engine, KVMemoryError, MemoryManager, SessionFileError, SessionStore, default_policy
from kvmemory.runtime.loading import DEFAULT_MODEL_NAME

log = logging.getLogger("kvmemory.ray")
RETRYABLE = (RayActorError, ActorUnavailableError)  # the replica died or is going away: another can serve
SESSIONS_PER_REPLICA = 64  # multiplexed ids a replica keeps; its store's byte budget bounds the memory


def error_payload(err: APIError | KVMemoryError | ValidationError) -> tuple[int, dict]:
    if isinstance(err, ValidationError):
        return 400, error_body(f"invalid request: {err.errors()}", "invalid_request_error")
    status, message, kind, code = error_status(err)
    return status, error_body(message, kind, code)


class SessionAffinityRouter(RequestRouter):
    """Each session's replicas in a fixed order, its own first (see the module docstring); a request without
    a session may go to any replica. The router tries the ranks in turn, so a busy or gone replica's
    sessions overflow to their next replica, which loads them from the shared directory."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        session_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # wait between rounds when all are busy
        if not session_id:
            return [candidate_replicas]
        return [[replica] for replica in by_affinity(session_id, candidate_replicas, lambda r: r.replica_id.unique_id)]


def by_affinity(session_id: str, replicas: list, replica_id=str) -> list:
    """The replicas in the session's order, by rendezvous hashing of (session id, ``replica_id(replica)``):
    the order of the others stays the same when one leaves or joins."""

    def weight(replica) -> int:
        key = f"{session_id}\0{replica_id(replica)}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")

    return sorted(replicas, key=weight, reverse=True)


class ResidentSession:
    """What a replica's multiplexer holds for a session id; evicting it spills the session to its file.
    ``origin`` says how it arrived (reported with the first response, then "resident")."""

    def __init__(self, store: SessionStore, session_id: str, origin: str):
        self.store, self.session_id, self.origin = store, session_id, origin

    def report(self) -> str:
        origin, self.origin = self.origin, "resident"
        return origin

    def __del__(self):  # Ray Serve calls this when it unloads the id (and Python again at collection)
        store, self.store = getattr(self, "store", None), None
        if store is not None and self.session_id in store.stats()["resident"]:
            try:
                store.spill(self.session_id)
            except KVMemoryError as err:  # in use by a request: it stays resident until the store spills it
                log.info("session %s not spilled: %s", self.session_id, err)


@serve.deployment(
    max_ongoing_requests=16,
    ray_actor_options={"num_cpus": 1},
    request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter),
)
class SessionReplica:
    """One engine and its resident sessions (see the module docstring)."""

    def __init__(
        self,
        model: str,
        sessions: str,
        max_slots: int = 2048,
        max_resident_mb: float | None = None,
        kv_dtype: str | None = None,
    ):
        engine = Engine.from_pretrained(model, kv_dtype=kv_dtype)
        budget = int(max_resident_mb * 2**20) if max_resident_mb else None
        store = SessionStore(engine, sessions, budget)
        self.server = Server(engine, store, default_policy(max_slots=max_slots), save_after_turn=True)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    @serve.multiplexed(max_num_models_per_replica=SESSIONS_PER_REPLICA)
    async def resident(self, session_id: str) -> ResidentSession:
        origin = await asyncio.to_thread(self._load, session_id)
        return ResidentSession(self.server.store, session_id, origin)

    def _load(self, session_id: str) -> str:
        """Bring the session in from its saved file; an unusable file is set aside and the session rebuilt."""
        store, new = self.server.store, lambda: MemoryManager(self.server.policy)
        saved = session_id in store
        try:
            store.get(session_id, new)
        except SessionFileError as err:
            path = store.path(session_id)
            path.replace(path.with_suffix(".damaged"))
            log.warning("session %s: saved file unusable (%s); rebuilding it from the request", session_id, err)
            store.get(session_id, new)
            return "rebuilt"
        return "loaded" if saved else "new"

    async def complete(self, body: dict) -> tuple[int, dict, dict]:
        """(status, OpenAI response or error body, headers naming this replica and the session's origin)."""
        session_id, headers = await self._enter()
        status, payload = await asyncio.to_thread(self._complete, session_id, body)
        return status, payload, headers

    def _complete(self, session_id: str | None, body: dict) -> tuple[int, dict]:
        try:
            return 200, self.server.complete(session_id, ChatRequest.model_validate(body))
        except (APIError, KVMemoryError, ValidationError) as err:
            return error_payload(err)

    async def stream(self, body: dict):
        """The completion's server-sent events (as the single-process server sends them)."""
        session_id, _ = await self._enter()
        try:
            request = ChatRequest.model_validate(body)
        except ValidationError as err:
            yield f"data: {json.dumps(error_payload(err)[1])}\n\ndata: [DONE]\n\n"
            return
        async for event in iterate_in_threadpool(self.server.stream(session_id, request)):
            yield event

    async def _enter(self) -> tuple[str | None, dict]:
        """The request's session id, its session made resident here, and the headers that report it."""
        headers = {"x-kvmemory-replica": self.replica_id}
        session_id = serve.get_multiplexed_model_id() or None
        if session_id is not None:
            headers["x-kvmemory-session"] = (await self.resident(session_id)).report()
        return session_id, headers


app = FastAPI(title="kvmemory on Ray Serve")  # (no postponed annotations here: serve.ingress reads them live)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    """The OpenAI-compatible front door: routes each request to its session's replica, retrying on another
    when that one is gone."""

    def __init__(self, replicas, model_name: str, retries: int = 3):
        self.replicas, self.model_name, self.retries = replicas, model_name, retries

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "kvmemory"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request, x_session_id: str | None = Header(None)):
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object", "invalid_request_error")
        session_id = x_session_id or body.get("user") or ""
        handle = self.replicas.options(multiplexed_model_id=session_id)
        if body.get("stream"):
            return StreamingResponse(self._stream(handle, body), media_type="text/event-stream")
        for attempt in range(self.retries + 1):
            try:
                status, payload, headers = await handle.complete.remote(body)
                return JSONResponse(payload, status, headers=headers)
            except RETRYABLE as err:
                log.warning("replica gone (%s); retrying session %r elsewhere", type(err).__name__, session_id)
                if attempt == self.retries:
                    return error_response(503, "no replica could serve the request; retry shortly", "server_error")
                await asyncio.sleep(0.5 * (attempt + 1))

    async def _stream(self, handle, body: dict):
        """Relay the replica's events; a replica lost before the first event is retried on another."""
        for attempt in range(self.retries + 1):
            sent = False
            try:
                async for event in handle.options(stream=True).stream.remote(body):
                    sent = True
                    yield event
                return
            except RETRYABLE:
                if sent or attempt == self.retries:
                    error = error_body("the replica serving this stream was lost", "server_error")
                    yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n"
                    return
                await asyncio.sleep(0.5 * (attempt + 1))


def build_app(
    model: str,
    sessions,
    replicas: int = 2,
    max_slots: int = 2048,
    replica_cpus: float = 1.0,
    kv_dtype: str | None = None,
):
    """The Serve application: ``replicas`` engine replicas sharing the ``sessions`` directory, behind the ingress."""
    Path(sessions).mkdir(parents=True, exist_ok=True)
    engines = SessionReplica.options(num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus}).bind(
        model, os.fspath(sessions), max_slots, None, kv_dtype
    )
    return OpenAIIngress.bind(engines, DEFAULT_MODEL_NAME if model == "default" else str(model))


def run(model: str, sessions, replicas: int, host: str, port: int, max_slots: int, kv_dtype: str | None = None) -> None:
    """Start a local Ray cluster (or join the one in ``RAY_ADDRESS``) and serve until interrupted."""
    import ray

    ray.init(ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    app = build_app(model, sessions, replicas, max_slots, kv_dtype=kv_dtype)
    serve.run(app, name="kvmemory", route_prefix="/", blocking=True)
