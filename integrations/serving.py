"""The serving core: one place that turns a request into a turn on a resident session.

Every front end is a thin adapter over it: the HTTP app (``integrations/server.py``) and its three API
dialects (``integrations/dialects/``), the Ray Serve replicas (``integrations/ray_serve.py``) and the
LangChain chat model. A dialect converts its request into a ``Turn`` (chat messages, tools, sampling, the
session's key, an optional policy); the core holds the session for the turn, brings it to the turn's
conversation (prefilling only what its cache lacks), generates, and answers with a ``Reply`` (text, tool
calls, finish reason, prompt and cached tokens, the conversation the session now holds).

Guarantees, whatever the front end:

* one request at a time per session (another waits up to ``busy_timeout``, then ``SessionBusy``);
* a failed or cancelled turn leaves its session as it was; a stream closed early keeps exactly the
  reply text it delivered, and frees the session at its next token;
* every error a request can cause is an ``APIError`` with its HTTP status, by type (``api_error``);
* sessions are bounded: at most ``max_sessions`` (resident and saved), and those idle longer than
  ``session_ttl`` seconds are deleted.

``AsyncCore`` runs the core's blocking work in threads for asyncio servers: cancelling the awaiting task
(a client that went away) cancels the turn.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field

from kvmemory import (
    ContextLengthError,
    KVMemoryError,
    MemoryCapError,
    MemoryManager,
    MemoryPolicy,
    PolicyError,
    SessionBusyError,
    SessionFileError,
    SessionStore,
    StoreFullError,
    ToolCallParseError,
)
from kvmemory.integrations.context_edits import AppliedEdit, ContextEdit, EditsApplied, apply_edits, paused
from kvmemory.runtime.chat import RequiredToolCall, parse_tool_calls, visible_content

log = logging.getLogger("kvmemory.server")
SESSION_ID = re.compile(r"[A-Za-z0-9_@:+=-][A-Za-z0-9_.@:+=-]{0,127}")  # what a URL path segment carries as is


# ---- errors ------------------------------------------------------------------------------------


class APIError(Exception):
    """An error a request caused, with what an HTTP answer needs: status, error type, code, the parameter."""

    status, kind, code = 400, "invalid_request_error", None

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param
        if code is not None:
            self.code = code

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "type": self.kind,
            "code": self.code,
            "message": self.message,
            "param": self.param,
        }

    @classmethod
    def from_dict(cls, data: dict) -> APIError:
        err = APIError(data["message"], code=data["code"], param=data["param"])
        err.status, err.kind = data["status"], data["type"]
        return err


class BadRequest(APIError):
    pass


class Unauthorized(APIError):
    status, kind, code = 401, "authentication_error", "invalid_api_key"


class NotFound(APIError):
    status, kind, code = 404, "not_found_error", "not_found"


class SessionBusy(APIError):
    status, kind, code = 409, "conflict_error", "session_busy"


class TooLarge(APIError):
    status, code = 413, "request_too_large"


class TooManySessions(APIError):
    status, kind, code = 429, "rate_limit_error", "session_limit_reached"


class Cancelled(APIError):
    """The client went away; nobody reads this answer (499, as nginx logs it)."""

    status, kind, code = 499, "cancelled", "client_closed_request"


class StoreFull(APIError):
    status, kind, code = 507, "server_error", "store_full"


class ServerError(APIError):
    status, kind, code = 500, "server_error", "internal_error"


def api_error(err: KVMemoryError, hide: str | None = None) -> APIError:
    """The APIError for a kvmemory error, chosen by its type; ``hide`` (a server path) is cut from the message."""
    message = str(err).replace(hide, "<sessions>") if hide else str(err)
    if isinstance(err, (ContextLengthError, MemoryCapError)):
        return BadRequest(message, code="context_length_exceeded", param="messages")
    if isinstance(err, PolicyError):
        return BadRequest(f"invalid kvmemory policy: {message}", code="invalid_policy", param="kvmemory.policy")
    if isinstance(err, SessionBusyError):
        return SessionBusy(message)
    if isinstance(err, StoreFullError):
        return StoreFull(message)
    if isinstance(err, SessionFileError):
        return APIError(message, code="session_file_unusable")
    if isinstance(err, ValueError):
        return BadRequest(message)
    return ServerError(message)


# ---- turns -------------------------------------------------------------------------------------


@dataclass
class Turn:
    """One generation request, as every dialect converts it. ``session`` is the store key (None: a session
    for this request only); ``policy`` a MemoryPolicy dict for the session; ``sampling`` the keywords of
    ``Session.start_generation``."""

    messages: list[dict]
    tools: list[dict] | None = None
    sampling: dict = field(default_factory=dict)
    session: str | None = None
    policy: dict | None = None
    tool_choice: str | None = None  # None or "auto"; "required": some tool must be called; else that tool's name
    context_edits: list[ContextEdit] = field(default_factory=list)  # the client's context management
    # Where set, the only tools a required call may name, each with the schema its arguments are held to
    # (narrower than the prompt's where it gives one). The prompt still renders every tool of ``tools``: a tool
    # set that changed from turn to turn would change the prompt's first tokens and re-prefill the conversation.
    allowed_tools: list[dict] | None = None

    def required_tools(self) -> list[str]:
        """The tools the reply must call one of (empty: the model may answer in text)."""
        if self.tool_choice in (None, "auto", "none") or not self.tools:
            return []
        names = [tool_name(tool) for tool in self.tools]
        if self.allowed_tools is not None:
            allowed = {tool_name(tool) for tool in self.allowed_tools}
            names = [n for n in names if n in allowed]
        return names if self.tool_choice in ("required", "any") else [n for n in names if n == self.tool_choice]

    def tool_schemas(self) -> dict[str, dict]:
        """Each tool's parameters schema, by name (what a required call's arguments are held to)."""
        narrowed = [t for t in self.allowed_tools or [] if tool_parameters(t) is not None]
        return {tool_name(tool): tool_parameters(tool) for tool in [*(self.tools or []), *narrowed]}


def tool_name(tool: dict) -> str | None:
    """A tool's name in either OpenAI spelling (``{"function": {"name"}}`` or Responses' flat ``{"name"}``)."""
    return tool.get("function", tool).get("name")


def tool_parameters(tool: dict) -> dict | None:
    return tool.get("function", tool).get("parameters")


@dataclass
class Reply:
    """What a turn produced. ``conversation`` is what the session now holds (the reply last), so a client that
    continues from it (``previous_response_id``) prefills only its new input."""

    text: str
    content: str
    tool_calls: list[dict]
    finish_reason: str  # "stop", "length", "tool_calls"
    stop_sequence: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    conversation: list[dict]
    tool_call_error: str | None = None  # why text in <tool_call> tags is no valid call (it stays in content)
    invalid_tool_call: str | None = None  # that text
    applied_edits: list[AppliedEdit] = field(default_factory=list)  # the turn's context edits that ran

    @classmethod
    def read(
        cls,
        text: str,
        finish_reason: str,
        stop_sequence: str | None,
        prompt: int,
        cached: int,
        completion: int,
        conversation: list[dict],
        tools: list[dict] | None,
    ) -> Reply:
        """The reply of the model's ``text``: its tool calls parsed (text that is no valid call stays text)."""
        error = None
        try:
            content, calls = parse_tool_calls(text, tools)
        except ToolCallParseError as err:
            content, calls, error = text, [], err
        finish = "tool_calls" if calls else finish_reason
        reply = cls(text, content, calls, finish, stop_sequence, prompt, cached, completion, conversation)
        if error is not None:
            reply.tool_call_error, reply.invalid_tool_call = str(error), error.call_text
        return reply


def reply_of(generation, prompt: int, cached: int, conversation: list[dict], tools: list[dict] | None) -> Reply:
    """The Reply for a finished generation."""
    result = generation.result
    return Reply.read(
        result.text,
        result.finish_reason,
        generation.stop_string,
        prompt,
        cached,
        len(result.token_ids),
        conversation,
        tools,
    )


def prefill(session, turn: Turn, cancel: threading.Event | None = None) -> tuple[int, int]:
    """Bring ``session`` to the turn's conversation, prefilling only what its cache lacks (a cancel checked
    between chunks undoes it all). Returns (prompt tokens, of those already in the cache)."""

    def check(_done, _total):
        if cancel is not None and cancel.is_set():
            raise Cancelled("the client went away")

    before = session.prefilled_tokens
    session.set_messages(turn.messages, tools=turn.tools, add_generation_prompt=True, progress=check)
    prompt = len(session.tokens)
    return prompt, min(prompt, max(0, prompt - (session.prefilled_tokens - before)))


# ---- the core ----------------------------------------------------------------------------------


class ServingCore:
    """Sessions by key in a ``SessionStore``, served one turn at a time (see the module docstring)."""

    def __init__(
        self,
        store: SessionStore,
        policy: MemoryPolicy,
        busy_timeout: float = 30.0,
        save_after_turn: bool = False,
        max_sessions: int | None = None,
        session_ttl: float | None = None,
        max_new_tokens: int | None = None,
        *,
        sessions_per_key: int | None = None,
        bytes_per_key: int | None = None,
    ):
        if save_after_turn and store.directory is None:
            raise BadRequest("save_after_turn needs a store with a directory")
        self.store, self.engine, self.policy = store, store.engine, policy
        self.busy_timeout, self.save_after_turn = busy_timeout, save_after_turn
        self.max_sessions, self.session_ttl = max_sessions, session_ttl
        self.max_new_tokens = max_new_tokens  # a server-wide bound on a reply (clients ask for 64,000)
        self.sessions_per_key, self.bytes_per_key = sessions_per_key, bytes_per_key  # one API key's share
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self._swept = 0.0
        self._hide = str(store.directory) if store.directory is not None else None

    # -- holding a session --
    @contextlib.contextmanager
    def hold(self, key: str | None, policy: dict | None = None) -> Iterator:
        """The session for ``key`` (made if new), held against other requests for the block. ``key`` None: a
        session for this block only. kvmemory errors pass through as they are (``errors()`` maps them)."""
        memory_policy = self._policy(policy)
        if key is None:
            session = self.engine.session(memory=MemoryManager(memory_policy))
            try:
                yield session
            finally:
                session.close()
            return
        self._admit(key)
        with self._locked(key), self.store.use(key, lambda: MemoryManager(memory_policy)) as session:
            if policy is not None:
                session.memory.set_policy(memory_policy)
            yield session

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        """kvmemory errors raised in the block come out as the APIErrors they map to."""
        try:
            yield
        except KVMemoryError as err:
            raise api_error(err, self._hide) from err

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        if not lock.acquire(timeout=-1 if self.busy_timeout is None else self.busy_timeout):
            raise SessionBusy(f"session {visible_key(key)!r} is busy with another request")
        try:
            yield
        finally:
            lock.release()

    def _admit(self, key: str) -> None:
        """Expire idle sessions (at most once a minute), then refuse a new session past ``max_sessions``, or past
        its API key's share: ``sessions_per_key`` sessions, ``bytes_per_key`` bytes (resident KV and saved files)."""
        if self.session_ttl is not None and time.monotonic() - self._swept > 60:
            self._swept = time.monotonic()
            self.expire()
        limited = self.max_sessions is not None or self.sessions_per_key is not None or self.bytes_per_key is not None
        if not limited or key in self.store and self.bytes_per_key is None:
            return
        ids, new = self.store.ids(), key not in self.store
        if new and self.max_sessions is not None and len(ids) >= self.max_sessions:
            raise TooManySessions(
                f"the server holds its maximum of {self.max_sessions} sessions; delete one "
                "(DELETE /v1/sessions/{id}) or wait for idle ones to expire"
            )
        owner = key.split("/", 1)[0] + "/" if "/" in key else None
        mine = [k for k in ids if owner is not None and k.startswith(owner)]
        if new and self.sessions_per_key is not None and owner and len(mine) >= self.sessions_per_key:
            raise TooManySessions(
                f"this API key holds its maximum of {self.sessions_per_key} sessions; delete one "
                "(DELETE /v1/sessions/{id}) or wait for idle ones to expire",
                code="key_session_limit",
            )
        if self.bytes_per_key is not None and owner:
            held = sum(self.store.footprint(k) for k in mine)
            if held >= self.bytes_per_key:
                raise TooManySessions(
                    f"this API key's sessions hold {held / 2**20:.1f} MiB, its limit is "
                    f"{self.bytes_per_key / 2**20:.1f} MiB; delete sessions (DELETE /v1/sessions/{{id}}) to go on",
                    code="key_storage_limit",
                )

    def expire(self) -> list[str]:
        """Delete the sessions idle longer than ``session_ttl`` (files too); returns their keys."""
        expired = []
        for key in [k for k in self.store.ids() if self.store.idle_seconds(k) > self.session_ttl]:
            with self._guard:
                lock = self._locks.setdefault(key, threading.Lock())
            if not lock.acquire(blocking=False):
                continue  # a request has it
            try:
                with contextlib.suppress(KVMemoryError):  # in use all the same: it stays
                    self.store.drop(key)
                    expired.append(key)
            finally:
                with self._guard:
                    self._locks.pop(key, None)
                lock.release()
        return expired

    def _policy(self, requested: dict | None) -> MemoryPolicy:
        if requested is None:
            return self.policy
        try:
            return MemoryPolicy.from_dict(requested)
        except PolicyError as err:
            raise api_error(err) from err

    def save_all(self) -> list[str]:
        """Save every resident session (at shutdown; a store without a directory has nowhere to save). A session
        still busy after ``busy_timeout`` is left as its last save had it. Returns the keys saved."""
        if self.store.directory is None:
            return []
        saved = []
        for key in self.store.stats()["resident"]:
            try:
                with self._locked(key):
                    self.store.save(key)
                saved.append(key)
            except (SessionBusy, KVMemoryError, KeyError) as err:
                log.warning("session %s not saved at shutdown: %s", visible_key(key), err)
        return saved

    def after_turn(self, key: str | None) -> None:
        """Save the session when the core saves after every turn (what a restart or a failover resumes)."""
        if self.save_after_turn and key is not None:
            self.store.save(key)

    # -- turns --
    def run(self, turn: Turn, cancel: threading.Event | None = None) -> Reply:
        """The turn's whole reply. A failure, or a cancel (nobody will read the reply), leaves the session as
        it was."""
        with self.errors(), self.hold(turn.session, turn.policy) as session, self.engine.batcher.expecting():
            before = session.snapshot()
            with contextlib.closing(self._turn(session, turn, cancel, before)) as items:
                for item in items:
                    if isinstance(item, Reply):
                        return item
            session.restore(before)  # cancelled: the partial reply was never sent
            raise Cancelled("the client went away")

    def stream(self, turn: Turn, cancel: threading.Event | None = None) -> Iterator[str | Reply]:
        """The reply's visible text as it grows (tool calls held back), then the Reply. A failure leaves the
        session as it was; a cancel, or closing the iterator early, keeps exactly the text it yielded."""
        with self.errors():
            yield from self.turn(turn, cancel)

    def turn(self, turn: Turn, cancel: threading.Event | None = None) -> Iterator[str | Reply]:
        """``stream`` with kvmemory's own errors (for in-process front ends such as the LangChain model)."""
        with self.hold(turn.session, turn.policy) as session:
            yield from self._turn(session, turn, cancel, session.snapshot())

    def _turn(self, session, turn: Turn, cancel: threading.Event | None, before) -> Iterator[str | Reply]:
        try:
            prompt, cached = prefill(session, turn, cancel)
            applied = apply_edits(session, turn.context_edits, prompt)
            if applied:
                yield EditsApplied(applied)
            if paused(turn.context_edits, applied):
                self.after_turn(turn.session)  # paused after compacting: the mark is the answer
                yield Reply("", "", [], "compaction", None, prompt, cached, 0, session.messages, applied_edits=applied)
                return
            sampling = dict(turn.sampling)
            if required := turn.required_tools():
                end = session.engine.eos_token_ids
                sampling["allowed"] = RequiredToolCall(session.renderer, required, end, turn.tool_schemas())
            sampling["max_new_tokens"] = self.reply_limit(sampling.get("max_new_tokens", 512))
            generation = session.start_generation(**sampling)
            shown = 0
            with contextlib.closing(generation):
                for _, result in generation:
                    visible = visible_content(result.text)
                    if len(visible) > shown:
                        yield visible[shown:]
                        shown = len(visible)
                    if cancel is not None and cancel.is_set():
                        return
        except Exception:
            session.restore(before)
            raise
        self.after_turn(turn.session)
        reply = reply_of(generation, prompt, cached, session.messages, turn.tools)
        reply.applied_edits = applied
        yield reply

    def reply_limit(self, asked: int) -> int:
        """The longest reply a turn may write: what the client asked, at most the server's ``max_new_tokens`` and
        never more than the model's context window (a capped session's positions run on far past it, so without
        this bound a client asking for 2**70 tokens would hold its session for hours). A reply cut here ends
        with ``finish_reason`` "length", as the OpenAI and Anthropic APIs end one at the client's limit."""
        return min(asked, self.max_new_tokens or self.engine.max_context, self.engine.max_context)

    def count_tokens(self, turn: Turn) -> int:
        with self.errors():
            return len(self.engine.render_chat(turn.messages, turn.tools))

    # -- sessions --
    def known(self, key: str) -> None:
        if key not in self.store:
            raise NotFound(f"no session {visible_key(key)!r}", code="session_not_found")

    def stats(self, key: str) -> dict:
        """The session's stats; readable while a turn runs on it (they wait 0.1 s at most: past that, a long
        prefill's last published stats)."""
        self.known(key)
        with self.errors():
            session = self.store.get(key)
            stats = session.stats(wait=0.1)
            busy = self._locks.get(key)
        return {**asdict(stats), "compression": stats.compression, "busy": bool(busy and busy.locked())}

    def memory_map(self, key: str) -> bytes:
        import io

        from kvmemory.memory import plot_memory_map

        self.known(key)
        with self.errors():
            session = self.store.get(key)
            buffer = io.BytesIO()
            plot_memory_map(session.memory.timeline, session.segments, buffer, title=f"session {visible_key(key)}")
        return buffer.getvalue()

    def save(self, key: str) -> int:
        self.known(key)
        if self.store.directory is None:
            raise BadRequest("the server was started without --sessions DIR: nowhere to save")
        with self.errors(), self.hold(key):
            return self.store.save(key).stat().st_size

    def restore(self, key: str) -> int:
        path = self.store.path(key)
        if path is None or not path.is_file():
            raise NotFound(f"no saved session {visible_key(key)!r}", code="session_not_found")
        with self._locked(key), self.errors():
            return len(self.store.reload(key).tokens)

    def delete(self, key: str) -> None:
        self.known(key)
        with self._locked(key), self.errors():
            self.store.drop(key)
        with self._guard:
            self._locks.pop(key, None)

    def sessions(self, owner: str | None) -> list[str]:
        """The session ids ``owner`` can address (its own, under their public ids)."""
        return [public for key in self.store.ids() if (public := public_id(key, owner)) is not None]


# ---- session keys: a session belongs to the API key that made it -------------------------------


def session_key(owner: str | None, session_id: str, param: str = "x-session-id") -> str:
    """The store key of ``owner``'s session ``session_id`` (owners never see each other's sessions)."""
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise BadRequest(
            f"session id {session_id!r} is not valid: use 1 to 128 letters, digits or _ . @ : + = - "
            "(not starting with a dot), so that /v1/sessions/{id} can address it",
            code="invalid_session_id",
            param=param,
        )
    return session_id if owner is None else f"{owner}/{session_id}"


def public_id(key: str, owner: str | None) -> str | None:
    """The id ``owner`` knows the session ``key`` by, or None if it is not ``owner``'s."""
    if owner is None:
        return key if "/" not in key else None
    prefix = f"{owner}/"
    return key[len(prefix) :] if key.startswith(prefix) else None


def visible_key(key: str) -> str:
    return key.split("/", 1)[-1]


# ---- asyncio -----------------------------------------------------------------------------------

_END = object()


class AsyncCore:
    """The core for asyncio servers: blocking work runs in worker threads; a cancelled task (a client that
    went away) cancels its turn, which frees the session at its next token without the task waiting."""

    def __init__(self, core: ServingCore, workers: int = 64):
        self.core = core
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="kvmemory-serve")

    async def call(self, method: Callable, *args):
        return await asyncio.wrap_future(self._pool.submit(method, *args))

    async def run(self, turn: Turn) -> Reply:
        cancel = threading.Event()
        work = asyncio.wrap_future(self._pool.submit(self.core.run, turn, cancel))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            cancel.set()  # the worker undoes the turn and frees the session on its own
            work.add_done_callback(unread)
            raise

    def stream(self, turn: Turn) -> AsyncIterator[str | Reply]:
        return self.iterate(functools.partial(self.core.stream, turn))

    async def iterate(self, start: Callable[[threading.Event], Iterator]) -> AsyncIterator:
        """The items of ``start(cancel)``, a blocking iterator, one worker-thread step each. The task awaiting
        them may be cancelled at any step: the worker finishes that step, ``cancel`` is set and the iterator
        closed (a turn then keeps exactly the text it yielded)."""
        cancel = threading.Event()
        iterator = start(cancel)
        future = None
        try:
            while True:
                future = asyncio.wrap_future(self._pool.submit(next, iterator, _END))
                item = await asyncio.shield(future)
                if item is _END:
                    return
                yield item
        finally:  # no awaiting here (a cancelled task cannot): the worker closes the iterator after its step
            cancel.set()
            if future is None:
                self._pool.submit(iterator.close)
            else:
                future.add_done_callback(unread)
                future.add_done_callback(lambda _: self._pool.submit(iterator.close))


def unread(work: asyncio.Future) -> None:
    """Take the outcome of work nobody awaits any more (a cancelled turn's ``Cancelled``), so that asyncio does
    not log it as never retrieved."""
    if not work.cancelled():
        work.exception()
