"""kvmemory on Ray Serve: engine replicas behind the OpenAI-compatible app, each session served by the
replica that holds its cache.

    kvmemory serve --ray --replicas 2 --sessions /shared/dir [--model default] [--port 8000]

Two deployments:

* ``SessionReplica`` (``--replicas`` of them): an Engine, a SessionStore on the shared sessions directory
  and the serving core the single-process server runs (``integrations/serving.py``), saving every session
  after each turn.
* ``Ingress`` (one): the same HTTP app as the single-process server (``http_app``: every route, dialect,
  limit and the API keys), over a backend that calls the replicas through a handle with the session's key
  as the *multiplexed model id*. Stored responses live in the shared directory.

Session affinity: ``SessionAffinityRouter`` ranks the replicas for each session id by rendezvous hashing
of (session id, replica id), so every router sends a session to the same replica from its first request on,
without waiting for replicas to report what they hold (Ray's multiplex routing learns that asynchronously,
and a quick second turn could land elsewhere), and when a replica leaves only its sessions move, each to its
next-ranked replica. The session's life on a replica is Ray Serve's model multiplexing keyed by session id:
the replica loads the session on its first request there and evicts its least recently used ids, calling
the loaded object's ``__del__``, which spills the session to the shared directory.

When a replica dies or is drained, the ingress retries the request; the router picks a live replica,
which loads the session from its last saved turn (a shared directory here; object storage in production).
A missing or damaged file makes a fresh session, which the request rebuilds from its messages (a chat
request carries the whole conversation); a damaged file is set aside as ``.damaged`` and logged.
"""

import asyncio
import hashlib
import logging
import os
from pathlib import Path

from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from kvmemory import Engine, KVMemoryError, MemoryManager, SessionFileError, SessionStore
from kvmemory.integrations.response_log import ResponseLog
from kvmemory.integrations.server import MB, http_app, serving_policy
from kvmemory.integrations.serving import APIError, AsyncCore, ServingCore, Turn
from kvmemory.runtime.named_models import model_title

log = logging.getLogger("kvmemory.ray")
RETRYABLE = (RayActorError, ActorUnavailableError)  # the replica died or is going away: another can serve
SESSIONS_PER_REPLICA = 64  # multiplexed ids a replica keeps; its store's byte budget bounds the memory


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
    """What a replica's multiplexer holds for a session key; evicting it spills the session to its file."""

    def __init__(self, store: SessionStore, key: str):
        self.store, self.key = store, key

    def __del__(self):  # Ray Serve calls this when it unloads the id (and Python again at collection)
        store, self.store = getattr(self, "store", None), None
        if store is not None and self.key in store.stats()["resident"]:
            try:
                store.spill(self.key)
            except KVMemoryError as err:  # in use by a request: it stays resident until the store spills it
                log.info("session %s not spilled: %s", self.key, err)


def outcome(work):
    """Run ``work()`` and say how it went as plain data: an APIError crosses Ray as its dict."""

    async def run():
        try:
            return "ok", await work()
        except APIError as err:
            return "error", err.to_dict()

    return run()


@serve.deployment(
    max_ongoing_requests=16,
    ray_actor_options={"num_cpus": 1},
    request_router_config=RequestRouterConfig(request_router_class=SessionAffinityRouter),
)
class SessionReplica:
    """One engine, its resident sessions and the serving core (see the module docstring)."""

    def __init__(self, model: str, sessions: str, settings: dict):
        engine = Engine.from_pretrained(model, kv_dtype=settings.get("kv_dtype"))
        budget = int(settings["max_resident_mb"] * MB) if settings.get("max_resident_mb") else None
        store = SessionStore(engine, sessions, budget)
        self.core = ServingCore(
            store,
            serving_policy(settings),
            settings.get("busy_timeout", 30.0),
            True,
            settings.get("max_sessions"),
            settings.get("session_ttl"),
            settings.get("max_new_tokens"),
            sessions_per_key=settings.get("sessions_per_key"),
            bytes_per_key=settings.get("bytes_per_key"),
        )
        self.worker = AsyncCore(self.core)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    @serve.multiplexed(max_num_models_per_replica=SESSIONS_PER_REPLICA)
    async def resident(self, key: str) -> ResidentSession:
        await asyncio.to_thread(self._load, key)
        return ResidentSession(self.core.store, key)

    def _load(self, key: str) -> None:
        """Bring a saved session in; an unusable file is set aside (``.damaged``) and the session starts anew,
        to be rebuilt from the request's conversation."""
        store = self.core.store
        if key not in store:
            return
        try:
            store.get(key, lambda: MemoryManager(self.core.policy))
        except SessionFileError as err:
            path = store.path(key)
            path.replace(path.with_suffix(".damaged"))
            log.warning("session %s: saved file unusable (%s); rebuilding it from the request", key, err)

    async def _enter(self) -> None:
        key = serve.get_multiplexed_model_id()
        if key:
            await self.resident(key)

    async def run(self, turn: Turn):
        await self._enter()
        return await outcome(lambda: self.worker.run(turn))

    async def stream(self, turn: Turn):
        await self._enter()
        try:
            async for item in self.worker.stream(turn):
                yield "ok", item
        except APIError as err:
            yield "error", err.to_dict()

    async def session(self, operation: str, key: str):
        await self._enter()

        async def work():
            value = await self.worker.call(getattr(self.core, operation), key)
            return {**value, "replica": self.replica_id} if operation == "stats" else value  # stats name the replica

        return await outcome(work)

    async def sessions(self, owner):
        return await outcome(lambda: self.worker.call(self.core.sessions, owner))

    async def count_tokens(self, turn: Turn):
        return await outcome(lambda: self.worker.call(self.core.count_tokens, turn))


class RayBackend:
    """The HTTP app's backend under Ray: each call goes to the replica of its session (retried on another
    when that replica is gone); an APIError a replica answers is raised here as it was raised there."""

    def __init__(self, replicas, retries: int = 3):
        self.replicas, self.retries = replicas, retries

    async def _call(self, method: str, key: str | None, *args):
        handle = self.replicas.options(multiplexed_model_id=key or "")
        for attempt in range(self.retries + 1):
            try:
                status, value = await getattr(handle, method).remote(*args)
                break
            except RETRYABLE as err:
                log.warning("replica gone (%s); retrying session %r elsewhere", type(err).__name__, key)
                if attempt == self.retries:
                    raise APIError.from_dict(unavailable()) from err
                await asyncio.sleep(0.5 * (attempt + 1))
        if status == "error":
            raise APIError.from_dict(value)
        return value

    def run(self, turn: Turn):
        return self._call("run", turn.session, turn)

    async def stream(self, turn: Turn):
        """The replica's items; a replica lost before the first one is retried on another."""
        handle = self.replicas.options(multiplexed_model_id=turn.session or "", stream=True)
        for attempt in range(self.retries + 1):
            sent = False
            try:
                async for status, item in handle.stream.remote(turn):
                    if status == "error":
                        raise APIError.from_dict(item)
                    sent = True
                    yield item
                return
            except RETRYABLE as err:
                if sent or attempt == self.retries:
                    raise APIError.from_dict(unavailable()) from err
                await asyncio.sleep(0.5 * (attempt + 1))

    def session(self, operation: str, key: str):
        return self._call("session", key, operation, key)

    def sessions(self, owner):
        return self._call("sessions", None, owner)

    def count_tokens(self, turn: Turn):
        return self._call("count_tokens", None, turn)


def unavailable() -> dict:
    return {
        "status": 503,
        "type": "server_error",
        "code": "replica_unavailable",
        "param": None,
        "message": "no replica could serve the request; retry shortly",
    }


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class Ingress:
    """The HTTP front door: the single-process server's app over the replicas."""

    def __init__(self, replicas, model_name: str, sessions: str, settings: dict):
        self.replicas, self.model_name, self.sessions, self.settings = replicas, model_name, sessions, settings

    def __serve_build_asgi_app__(self):
        settings = self.settings
        return http_app(
            RayBackend(self.replicas),
            self.model_name,
            settings.get("api_keys", ()),
            settings.get("model_aliases", ()),
            settings.get("max_request_mb", 32.0),
            ResponseLog(self.sessions, settings.get("responses_per_key", 1000), settings.get("session_ttl")),
        )


def build_app(model: str, sessions, replicas: int = 2, settings: dict | None = None, replica_cpus: float = 1.0):
    """The Serve application: ``replicas`` engine replicas sharing the ``sessions`` directory, behind the
    ingress; ``settings`` are the command line's (keys, aliases, limits; see ``integrations/server.py``)."""
    settings = dict(settings or {})
    Path(sessions).mkdir(parents=True, exist_ok=True)
    engines = SessionReplica.options(num_replicas=replicas, ray_actor_options={"num_cpus": replica_cpus}).bind(
        model, os.fspath(sessions), settings
    )
    name = model_title(model)
    return Ingress.bind(engines, name, os.fspath(sessions), settings)


def run(model: str, sessions, replicas: int, host: str, port: int, settings: dict) -> None:
    """Start a local Ray cluster (or join the one in ``RAY_ADDRESS``) and serve until interrupted."""
    import ray

    ray.init(ignore_reinit_error=True)
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(model, sessions, replicas, settings), name="kvmemory", route_prefix="/", blocking=True)
