"""Session: one conversation's resident, compactable KV cache plus its lossless transcript.

The Session contract:

* Nothing appended or generated is lost. Every appended text, token list or message and every generated
  reply is in the transcript (``transcript()``, ``search``, ``recall``) and, until compacted, in the cache,
  in order. A generated chat reply becomes the assistant message of the conversation, so the next
  ``append_messages`` keeps it. ``append_messages`` appends after everything the session holds (raw text
  included); only ``set_messages`` with a conversation that differs from the held one rewrites history,
  from the first message that differs.
* Every call either completes or raises and leaves the transcript, segments, cache (every layer's keys,
  values, β and positions, whatever its length) and memory-manager state bit-identical: each mutating
  call runs on a copy-on-write snapshot (``snapshot``/``restore``, also used by scratch forwards, forks
  and cancelled generation steps). Other modules change a session only through ``edit()``, in the same
  scope. Bad input raises a ``KVMemoryError`` naming the problem before anything runs.
* A stream that stops early (``break``, ``close()``, ``aclose()``, a cancelled task) leaves exactly the
  tokens of the text the caller received.
* Calls on one Session from several threads are serialised (each waits for the one before). While a
  stream is open, any other call on the session raises ``SessionBusyError`` instead of waiting, since a
  stream may stay open indefinitely.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Iterator
from numbers import Integral
from pathlib import Path

import torch

from kvmemory.cache import CompactCache
from kvmemory.errors import InvalidArgumentError, InvalidTokenError, SessionBusyError, SessionClosedError
from kvmemory.runtime import compute
from kvmemory.runtime.chat import ChatRenderer
from kvmemory.runtime.memory_hooks import SessionMemory
from kvmemory.runtime.persistence import save_session
from kvmemory.runtime.recorders import QUERY_WINDOW, HiddenRecorder, QueryRecorder, SurprisalRecorder
from kvmemory.runtime.segments import Segment
from kvmemory.runtime.session_chat import SessionChat
from kvmemory.runtime.session_compaction import SessionCompaction
from kvmemory.runtime.session_edit import SessionEdit
from kvmemory.runtime.session_forward import SessionForward
from kvmemory.runtime.session_generation import SessionGeneration
from kvmemory.runtime.session_inspection import SessionInspection, SessionStats
from kvmemory.runtime.session_state import SessionState, exclusive

__all__ = ["Session", "SessionStats"]


class Session(SessionChat, SessionGeneration, SessionForward, SessionCompaction, SessionInspection):
    """A conversation on an Engine. Create with ``engine.session()``; see the module docstring for the
    contract every call keeps.

    ``memory`` is an optional manager (see ``kvmemory.memory``) that decides when and how to compact;
    without one the cache is only compacted by explicit ``compact(plan)`` calls.

    The class is split by job, one file each: ``session_chat.py`` (messages, transcript, recall),
    ``session_generation.py`` (replies), ``session_forward.py`` (running tokens into the cache, and cutting
    them back), ``session_compaction.py`` (compacting on request), ``session_inspection.py`` (stats); this
    file holds the state, its snapshots and the call discipline (``session_state.exclusive``), and
    ``session_edit.py`` the one way other modules change a session.
    """

    def __init__(
        self,
        engine,
        session_id: str | None = None,
        memory: SessionMemory | None = None,
        prefill_chunk_size: int | None = None,
        show_progress: bool = False,
    ):
        if prefill_chunk_size is not None and prefill_chunk_size < 1:
            raise InvalidArgumentError(f"prefill_chunk_size must be at least 1 (or None), got {prefill_chunk_size}")
        self.engine = engine
        self.id = session_id or f"session-{id(self):x}"
        self.cache = CompactCache(engine.num_layers, engine.kv_dtype)
        self.tokens: list[int] = []  # the logical transcript: tokens[i] sits at position i
        self._tokens_shared = 0  # snapshots hold ``tokens`` itself up to this length (``_cut_tokens``)
        self.segments: list[Segment] = []
        self._messages: list[dict] = []
        self.prefill_chunk_size = prefill_chunk_size or engine.prefill_chunk_size  # None: the engine's default
        self.show_progress = show_progress  # tqdm bars for long prefills (quiet by default in library use)
        self.memory = memory
        self.closed = False
        self._pending: list[int] = []  # sampled tokens not yet run through the model
        self._last_logits: torch.Tensor | None = None
        self._message_spans: list[tuple[str, int, int]] = []  # (fingerprint, start, end) per message
        self._tools_key: str | None = None
        self._reply: tuple[int, int] | None = None  # open chat reply: (prompt start, content start)
        self._next_segment_id = 0
        self.query_recorder: QueryRecorder | None = None
        self.hidden_recorder: HiddenRecorder | None = None
        self.surprisal_recorder: SurprisalRecorder | None = None
        self.compaction_log: list[dict] = []
        self.prefilled_tokens = 0  # tokens run through the model by appends (cache reuse shows here)
        self._turn_prefilled = 0  # of those, since the last reply (what a reply's prompt did not find cached)
        self._lock = threading.RLock()
        self._published: tuple[float, SessionStats] | None = None  # stats as a long prefill last left them
        self._stream: tuple[weakref.ref, object] | None = None  # the open generation and its progress
        # what query-based compaction needs, recorded from the first token (a memory manager whose policy never
        # reads them switches this off)
        self.record_queries(QUERY_WINDOW)
        if memory is not None:
            memory.attach(self)
        engine.sessions.add(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def snapshot(self) -> SessionState:
        """The session's whole state, for ``restore``: O(segments) Python objects, no tensor copies."""
        rec, hidden = self.query_recorder, self.hidden_recorder
        self._tokens_shared = max(self._tokens_shared, len(self.tokens))
        return SessionState(
            self.cache.snapshot(),
            self.tokens,
            len(self.tokens),
            list(self._pending),
            self._last_logits,
            list(self.segments),  # segments are never changed in place
            self._next_segment_id,
            list(self._messages),
            list(self._message_spans),
            self._tools_key,
            self._reply,
            len(self.compaction_log),
            self.prefilled_tokens,
            self._turn_prefilled,
            rec.state() if rec is not None else None,
            dict(hidden.store) if hidden is not None else None,
            self.memory.state() if self.memory is not None else None,
            self.surprisal_recorder.state() if self.surprisal_recorder is not None else None,
        )

    def restore(self, state: SessionState) -> None:
        """Put the session back exactly as it was when ``state`` was taken."""
        self.cache.restore(state.cache)
        self.tokens, self._tokens_shared = state.tokens, 0
        self._pending, self._last_logits = list(state.pending), state.last_logits
        self.segments = list(state.segments)
        self._next_segment_id = state.next_segment_id
        self._messages, self._message_spans = list(state.messages), list(state.message_spans)
        self._tools_key, self._reply = state.tools_key, state.reply
        if state.records is not None:
            self.compaction_log = list(state.records)
        del self.compaction_log[state.compaction_log :]
        self.prefilled_tokens, self._turn_prefilled = state.prefilled_tokens, state.turn_prefilled
        if self.query_recorder is not None and state.queries is not None:
            self.query_recorder.restore(state.queries)
        if self.hidden_recorder is not None and state.hidden is not None:
            self.hidden_recorder.store = dict(state.hidden)
        if self.surprisal_recorder is not None and state.surprisal is not None:
            self.surprisal_recorder.restore(state.surprisal)
        if self.memory is not None and state.memory is not None:
            self.memory.restore(state.memory)

    @exclusive
    def save(self, path) -> Path:
        """Write the whole session (compacted cache, transcript, recorders, memory manager) to one file,
        atomically; ``engine.load_session(path)`` gives it back bit for bit. See ``runtime/persistence.py``."""
        return save_session(self, path)

    @contextlib.contextmanager
    def edit(self) -> Iterator[SessionEdit]:
        """Several changes as one call, through the ``SessionEdit`` it yields (the one way other modules
        change a session): serialised with other threads' calls, and all undone if one raises. Allowed while
        a stream is open, as the memory manager compacts mid-reply through it."""
        with self._lock:
            self.check_open()
            with self._atomic():
                yield SessionEdit(self)

    def set_memory(self, memory: SessionMemory | None) -> None:
        """Give the session a memory manager (or none) from now on; it may compact at the next append."""
        with self._lock:
            self.check_open()
            self._check_no_stream()
            if memory is not None:
                memory.attach(self)
            self.memory = memory

    @contextlib.contextmanager
    def _atomic(self):
        compute.leave_the_cores(self.engine.batcher.device)  # before the snapshot's copies could grow a team
        state = self.snapshot()
        try:
            yield
        except BaseException:
            self.restore(state)
            raise

    def record_queries(self, window: int = 64, context: int = 0) -> QueryRecorder:
        """Keep post-RoPE queries: of the last ``window`` tokens (the selector window for compaction; every
        session records the last 64 from its start, and a memory manager sets its policy's window, 0 where
        the policy never reads them) and, with ``context`` > 0, about that many tokens' queries of each
        segment as it is prefilled."""
        rec = self.query_recorder
        if rec is None:
            self.query_recorder = QueryRecorder(self.engine.num_layers, self.engine.num_kv_heads, window, context)
        else:
            rec.set_window(window)
            rec.context_tokens = max(rec.context_tokens, context)
        return self.query_recorder

    def record_last_layer_inputs(self) -> HiddenRecorder:
        """Keep each position's input to the last decoder layer (for the fast counter-causal score)."""
        if self.hidden_recorder is None:
            self.hidden_recorder = HiddenRecorder()
        return self.hidden_recorder

    def record_surprisal(self) -> SurprisalRecorder:
        """Keep each appended token's surprisal (for the selective-context method). Every prefilled token's
        logits are then computed: the LM head runs on every row (+24% prefill time on the default model at
        2,048 tokens, ``python -m benchmarks.speed --only recording``; decode is unchanged)."""
        if self.surprisal_recorder is None:
            self.surprisal_recorder = SurprisalRecorder()
        return self.surprisal_recorder

    def fork(self, session_id: str | None = None, with_memory: bool = False) -> Session:
        """An independent copy of this session (cache, transcript, recorders), e.g. to try a compaction.

        ``with_memory`` gives the copy its own copy of the memory manager (same policy and cap, separate
        history), so what is appended to it is compacted as the original would be."""
        with self._lock:
            self.check_open()
            self._check_no_stream()
            child = Session(self.engine, session_id, memory=None, prefill_chunk_size=self.prefill_chunk_size)
            if with_memory and self.memory is not None:
                child.memory = self.memory.fork(child)
            if self.query_recorder is not None:
                child.query_recorder = copy.deepcopy(self.query_recorder)
            if self.hidden_recorder is not None:
                child.record_last_layer_inputs()
            if self.surprisal_recorder is not None:
                child.record_surprisal()
            child.restore(self.snapshot())
            child.cache = self.cache.clone()  # nothing shared: both sessions append into their own buffers
            child.compaction_log = list(self.compaction_log)
            return child

    def close(self) -> None:
        """Free the cache. The transcript stays readable."""
        with self._lock:
            self.closed = True
            self.hidden_recorder = self.surprisal_recorder = None
            self.cache = CompactCache(self.engine.num_layers, self.engine.kv_dtype)
            self._last_logits = None

    @property
    def renderer(self) -> ChatRenderer:
        return self.engine.renderer

    @property
    def logical_length(self) -> int:
        """Positions consumed: cached tokens plus sampled tokens still pending."""
        return len(self.tokens)

    def segment(self, segment_id: int) -> Segment:
        """The segment with this id as it stands now. Segments are values: the one an append returned is the
        segment as it was then, and compaction or a longer reply puts a changed copy in ``segments``."""
        return self.segments[self._segment_index(segment_id)]

    def _segment_index(self, segment_id: int) -> int:
        for i in range(len(self.segments) - 1, -1, -1):  # the one asked for is nearly always among the last
            if self.segments[i].id == segment_id:
                return i
        raise InvalidArgumentError(f"no segment {segment_id} in session {self.id}")

    def check_open(self) -> None:
        """Raise SessionClosedError if the session is closed."""
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed")

    def _check_no_stream(self) -> None:
        if self._stream is None:
            return
        generation, progress = self._stream[0](), self._stream[1]
        if generation is None:  # dropped without being closed: settle it now
            self._end_generation(progress)
        elif not generation.closed:
            raise SessionBusyError(f"session {self.id} has an open stream: finish or close it first")

    def _validate_tokens(self, token_ids) -> list[int]:
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() > 1 or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
                raise InvalidTokenError(
                    f"token ids must be a 1-D integer tensor, got {token_ids.dim()}-D {token_ids.dtype}"
                )
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
            raise InvalidTokenError(f"token ids must be a list of integers, got {type(token_ids).__name__}")
        ids = list(token_ids)
        wrong = [t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)]
        if wrong:
            raise InvalidTokenError(f"token ids must be integers, got {wrong[:5]}")
        ids = [int(t) for t in ids]
        if not ids:
            raise InvalidTokenError("no tokens given")
        bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise InvalidTokenError(f"token ids outside the vocabulary [0, {self.engine.vocab_size}): {bad[:5]}")
        return ids

    def _new_segment(self, kind: str, role=None, tool_name=None, tags=(), message_index=None, meta=None) -> Segment:
        seg = Segment(
            id=self._next_segment_id,
            kind=kind,
            start=len(self.tokens),
            end=len(self.tokens),
            role=role,
            tool_name=tool_name,
            tags=tuple(tags),
            message_index=message_index,
            meta=dict(meta or {}),
        )
        self._next_segment_id += 1
        self.segments.append(seg)
        return seg

    def _replace_segment(self, segment_id: int, **changes) -> Segment:
        """Put a copy of the segment with ``changes`` in its place (segments are never changed in place)."""
        i = self._segment_index(segment_id)
        self.segments[i] = self.segments[i].replaced(**changes)
        return self.segments[i]

    def _decode(self, ids: list[int]) -> str:
        return self.engine.detokenize(ids)
