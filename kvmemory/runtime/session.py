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
  and cancelled generation steps). Bad input raises a ``KVMemoryError`` naming the problem before
  anything runs.
* A stream that stops early (``break``, ``close()``, ``aclose()``, a cancelled task) leaves exactly the
  tokens of the text the caller received.
* Calls on one Session from several threads are serialised (each waits for the one before). While a
  stream is open, any other call on the session raises ``SessionBusyError`` instead of waiting, since a
  stream may stay open indefinitely.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path

import torch

from kvmemory.cache import CompactCache, CompactionPlan
from kvmemory.compaction.base import CompactionMethod
from kvmemory.compaction.compactor import CompactionRecord, SpanJob, compact_spans
from kvmemory.compaction.queries import QUERY_SOURCES
from kvmemory.compaction.registry import get_method
from kvmemory.errors import (
    ContextLengthError,
    InvalidArgumentError,
    InvalidTokenError,
    SessionBusyError,
    SessionClosedError,
)
from kvmemory.runtime import compute
from kvmemory.runtime.batching import ForwardRequest
from kvmemory.runtime.chat import ChatRenderer
from kvmemory.runtime.conversation import (
    common_prefix,
    fingerprint,
    message_kind,
    planned_segment,
    render_with_spans,
    same_messages,
    tools_key,
    validate_messages,
)
from kvmemory.runtime.generation import Generation, GenerationResult, SamplingParams
from kvmemory.runtime.memory_hooks import SessionMemory
from kvmemory.runtime.persistence import save_session
from kvmemory.runtime.recorders import HiddenRecorder, QueryRecorder, SurprisalRecorder, surprisal_of
from kvmemory.runtime.search import rank_segments
from kvmemory.runtime.segments import SEGMENT_KINDS, Segment
from kvmemory.runtime.state import SessionState

QUERY_WINDOW = 64  # selector-window queries every session records (R)
ProgressCallback = Callable[[int, int], None]


@dataclass
class SessionStats:
    logical_tokens: int
    physical_slots: list[int]  # per layer: slots per KV head (mean over its heads, rounded up)
    slots_per_head: int  # over the whole cache, as a slot cap counts them (layers may hold different counts)
    kv_bytes: int  # bytes of the slots held: every head pays for its own slots only
    allocated_bytes: int  # those plus the bounded headroom left for appends
    uncompacted_kv_bytes: int
    compactions: int
    segments: list[dict] = field(default_factory=list)
    query_bytes: int = 0  # reference queries held for compaction (selector window + context queries)

    @property
    def compression(self) -> float:
        return self.uncompacted_kv_bytes / self.kv_bytes if self.kv_bytes else 1.0


def _tqdm_progress(total: int, inner: ProgressCallback | None) -> ProgressCallback:
    from tqdm.auto import tqdm

    bar = tqdm(total=total, desc="prefill", unit="tok", leave=False)

    def update(done: int, _total: int) -> None:
        bar.update(done - bar.n)
        if inner is not None:
            inner(done, _total)
        if done >= _total:
            bar.close()

    return update


def _exclusive(method):
    """A public call: serialised with other threads' calls, refused while a stream is open, atomic."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            self.check_open()
            self._check_no_stream()
            with self._atomic():
                return method(self, *args, **kwargs)

    return call


class Session:
    """A conversation on an Engine. Create with ``engine.session()``; see the module docstring for the
    contract every call keeps.

    ``memory`` is an optional manager (see ``kvmemory.memory``) that decides when and how to compact;
    without one the cache is only compacted by explicit ``compact(plan)`` calls.
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
        self._stream: tuple[weakref.ref, object] | None = None  # the open generation and its progress
        self.record_queries(QUERY_WINDOW)  # what query-based compaction needs, recorded from the first token
        if memory is not None:
            memory.attach(self)
        engine.sessions.add(self)

    # ---- context managers ------------------------------------------------------------------------
    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- state -----------------------------------------------------------------------------------
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

    @_exclusive
    def save(self, path) -> Path:
        """Write the whole session (compacted cache, transcript, recorders, memory manager) to one file,
        atomically; ``engine.load_session(path)`` gives it back bit for bit. See ``runtime/persistence.py``."""
        return save_session(self, path)

    @contextlib.contextmanager
    def transaction(self):
        """Several steps as one call: serialised with other threads' calls, and all undone if one raises
        (the memory manager compacts through it; allowed while a stream is open, as compaction is)."""
        with self._lock:
            self.check_open()
            with self._atomic():
                yield self

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
        session records the last 64 from its start, and a memory manager sets its policy's window) and,
        with ``context`` > 0, about that many tokens' queries of each segment as it is prefilled."""
        rec = self.query_recorder
        if rec is None:
            self.query_recorder = QueryRecorder(self.engine.num_layers, self.engine.num_kv_heads, window, context)
        else:
            rec.window, rec.context_tokens = window, max(rec.context_tokens, context)
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

    @_exclusive
    def rebase_positions(self) -> int:
        """Re-rotate the cache so that each head's RoPE positions are the ranks of its cached slots (closing
        the gaps compaction left). Runs by itself when the next token would pass ``engine.rebase_at`` (the
        trained positions by default), so a compacted session never asks the model for distances it was not
        trained on."""
        return self._rebase()

    def _rebase(self) -> int:
        return self.engine.batcher.execute(self._rotate_to_ranks)  # every key re-rotated: where the passes run

    def _rotate_to_ranks(self) -> int:
        with torch.no_grad():
            shift = self.cache.rebase(self.engine.rope_inv_freq)
            if self.query_recorder is not None:
                self.query_recorder.shift(shift, self.engine.rope_inv_freq)
        return shift

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

    # ---- properties ----------------------------------------------------------------------------
    @property
    def renderer(self) -> ChatRenderer:
        return self.engine.renderer

    @property
    def logical_length(self) -> int:
        """Positions consumed: cached tokens plus sampled tokens still pending."""
        return len(self.tokens)

    @property
    def messages(self) -> list[dict]:
        """The conversation so far, the reply being generated (or last generated) included."""
        with self._lock:
            reply = self._reply_message()
            return [dict(m) for m in self._messages] + ([reply] if reply is not None else [])

    def segment(self, segment_id: int) -> Segment:
        """The segment with this id as it stands now. Segments are values: the one an append returned is the
        segment as it was then, and compaction or a longer reply puts a changed copy in ``segments``."""
        return self.segments[self._segment_index(segment_id)]

    def _segment_index(self, segment_id: int) -> int:
        for i in range(len(self.segments) - 1, -1, -1):  # the one asked for is nearly always among the last
            if self.segments[i].id == segment_id:
                return i
        raise InvalidArgumentError(f"no segment {segment_id} in session {self.id}")

    def transcript(self) -> list[dict]:
        """The full text of every segment, compacted or not."""
        with self._lock:
            self._refresh_open_segment_text()
            return [seg.to_dict() for seg in self.segments]

    # ---- appends ---------------------------------------------------------------------------------
    @_exclusive
    def append_text(
        self, text: str, kind: str = "text", role: str | None = None, progress: ProgressCallback | None = None, **meta
    ) -> Segment:
        """Tokenize ``text`` (no special tokens added) and append it as one segment, after everything held."""
        if not isinstance(text, str):
            raise InvalidArgumentError(f"append_text takes a string, got {type(text).__name__}")
        if self.engine.tokenizer is None:
            raise InvalidArgumentError("this engine has no tokenizer: use append_tokens")
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return self._append_tokens(ids, kind=kind, role=role, progress=progress, text=text, **meta)

    @_exclusive
    def append_tokens(
        self,
        token_ids,
        kind: str = "text",
        role: str | None = None,
        progress: ProgressCallback | None = None,
        text: str | None = None,
        tool_name: str | None = None,
        tags: tuple[str, ...] = (),
        **meta,
    ) -> Segment:
        """Append token ids as a new segment, after everything held; they are prefilled in chunks."""
        return self._append_tokens(token_ids, kind, role, progress, text, tool_name, tags, **meta)

    def _append_tokens(
        self, token_ids, kind="text", role=None, progress=None, text=None, tool_name=None, tags=(), **meta
    ):
        if kind not in SEGMENT_KINDS:
            raise InvalidArgumentError(f"unknown segment kind {kind!r}; kinds are {', '.join(SEGMENT_KINDS)}")
        ids = self._validate_tokens(token_ids)
        text = text if text is not None else self._decode(ids)
        probe = Segment(
            -1, kind, len(self.tokens), len(self.tokens) + len(ids), role, tool_name, tuple(tags), text=text
        )
        self._check_room(len(ids), [probe])
        segment = self._new_segment(kind, role=role, tool_name=tool_name, tags=tuple(tags), meta=meta)
        self._extend_segment(segment.id, ids, progress)
        self._replace_segment(segment.id, text=text)
        self._after_append()
        return self.segment(segment.id)

    @_exclusive
    def append_messages(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        progress: ProgressCallback | None = None,
    ) -> list[Segment]:
        """Append chat messages after everything the session holds (earlier messages, generated replies, raw
        text): only the new messages are rendered and prefilled. Returns the segments created.

        Changing ``tools`` changes how the conversation's start renders, so it re-renders the conversation
        like ``set_messages``."""
        held = self._close_reply()
        new = validate_messages(messages, held)
        if held and tools_key(tools) != self._tools_key:
            return self._set_messages(held + new, tools, add_generation_prompt, progress)
        return self._append_rendered(held, new, tools, add_generation_prompt, progress)

    @_exclusive
    def set_messages(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = False,
        progress: ProgressCallback | None = None,
    ) -> list[Segment]:
        """Make the session hold exactly this conversation, prefilling only what the cache lacks.

        A conversation that extends the held one is appended (as ``append_messages``). Otherwise the
        rendered tokens are diffed against the held ones and the session is cut back to the start of the
        first segment that differs, then re-prefilled from there: this is how history is edited, and what
        followed the cut (messages, replies, raw text) is replaced. Returns the segments created or extended.
        """
        if (
            add_generation_prompt
            and self._reply is not None
            and self._reply[1] == len(self.tokens)
            and self._tools_key == tools_key(tools)
            and same_messages(messages, self._messages)
        ):
            return []  # already holds exactly this conversation and its generation prompt
        held = self._close_reply()
        messages = validate_messages(messages, [])
        same_tools = not held or tools_key(tools) == self._tools_key
        if same_tools and len(messages) >= len(held) and same_messages(messages[: len(held)], held):
            return self._append_rendered(held, messages[len(held) :], tools, add_generation_prompt, progress)
        return self._set_messages(messages, tools, add_generation_prompt, progress)

    def _append_rendered(self, held, new, tools, add_generation_prompt, progress) -> list[Segment]:
        """Render ``new`` in the context of ``held`` and append only their tokens after the session's end."""
        renderer = self.renderer
        base = renderer.render(held, tools) if held else []
        full = renderer.render(held + new, tools, add_generation_prompt)
        if full[: len(base)] != base:  # a template that re-renders earlier turns: fall back to diffing
            return self._set_messages(held + new, tools, add_generation_prompt, progress)
        if self.memory is None or len(self.tokens) + len(full) - len(base) > self.engine.position_limit:
            self._check_room(len(full) - len(base))  # what cannot fit fails before each message is located
        ends = []
        for i in range(len(new)):  # (progress runs per message too: a caller can stop a long conversation here)
            if progress is not None:
                progress(0, len(full) - len(base))
            ends.append(len(renderer.render(held + new[: i + 1], tools)))
        starts = [len(base)] + ends[:-1]
        delta = len(full) - len(base)
        base_at = len(self.tokens) - len(base)
        probes = [planned_segment(m, base_at + s, base_at + e) for m, s, e in zip(new, starts, ends)]
        self._check_room(delta, probes)
        touched = []
        for i, (msg, s, e) in enumerate(zip(new, starts, ends)):
            seg = self._new_segment(
                message_kind(msg),
                role=msg["role"],
                tool_name=msg.get("name"),
                tags=tuple(msg.get("tags", ())),
                message_index=len(held) + i,
            )
            start = len(self.tokens)
            if e > s:
                self._extend_segment(seg.id, full[s:e], progress)
            self._replace_segment(seg.id, text=msg["content"])
            self._messages.append(msg)
            self._message_spans.append((fingerprint(msg), start, len(self.tokens)))
            self._after_append()
            touched.append(self.segment(seg.id))
        if add_generation_prompt:
            touched.append(self._open_prompt(full[ends[-1] if ends else len(base) :], progress))
        self._tools_key = tools_key(tools)
        return touched

    def _open_prompt(self, ids: list[int], progress) -> Segment:
        """Append the template's generation prompt as the start of an assistant segment."""
        seg = self._new_segment("assistant", role="assistant")
        start = len(self.tokens)
        if ids:
            self._extend_segment(seg.id, ids, progress)
        self._replace_segment(seg.id, text=self._decode(ids))
        self._reply = (start, len(self.tokens))
        self._after_append()
        return self.segment(seg.id)

    def _set_messages(self, messages, tools, add_generation_prompt, progress) -> list[Segment]:
        same_tools = self._tools_key == tools_key(tools)
        held = self._message_spans if same_tools else None
        limit = self.engine.position_limit
        target, spans = render_with_spans(
            self.renderer, messages, tools, add_generation_prompt, held, self.tokens, limit, progress
        )
        self._tools_key = tools_key(tools)
        self._flush_pending()
        keep = common_prefix(self.tokens, target)
        cut = self._cut_point(keep)
        if cut == len(self.tokens):
            probes = [planned_segment(m, max(s, cut), e) for m, (s, e) in zip(messages, spans) if e > cut]
            self._check_room(len(target) - cut, probes)
        elif cut < len(self.tokens):
            self._truncate(cut)
        cut = len(self.tokens)  # truncation may have had to go further back
        touched = []
        prompt = [(spans[-1][1] if spans else 0, len(target))] if add_generation_prompt else []
        for index, (start, end) in enumerate(spans + prompt):
            if end <= cut:
                continue
            is_prompt = index == len(messages)
            msg = None if is_prompt else messages[index]
            seg = self._segment_starting_at(start)
            if seg is None:
                seg = self._new_segment(
                    "assistant" if is_prompt else message_kind(msg),
                    role="assistant" if is_prompt else msg["role"],
                    tool_name=None if is_prompt else msg.get("name"),
                    tags=() if is_prompt else tuple(msg.get("tags", ())),
                    message_index=None if is_prompt else index,
                )
            elif not is_prompt:
                seg = self._replace_segment(seg.id, message_index=index)
            seg = self._extend_segment(seg.id, target[max(start, cut) : end], progress)
            self._replace_segment(seg.id, text=self._decode(self.tokens[seg.start : seg.end]))
            self._after_append()
            touched.append(self.segment(seg.id))
        self._messages = messages
        self._message_spans = [(fingerprint(m), s, e) for m, (s, e) in zip(messages, spans)]
        self._reply = (spans[-1][1] if spans else 0, len(target)) if add_generation_prompt else None
        return touched

    # ---- chat replies ----------------------------------------------------------------------------
    def _reply_message(self) -> dict | None:
        """The open reply (text after the generation prompt) as an assistant message, if it has any."""
        if self._reply is None or self._reply[1] >= len(self.tokens):
            return None
        ids = self.tokens[self._reply[1] :]
        if ids and ids[-1] in self.engine.eos_token_ids:
            ids = ids[:-1]
        return {"role": "assistant", "content": self._decode(ids)}

    def _close_reply(self) -> list[dict]:
        """Before new messages: the open reply becomes the conversation's assistant message (with the
        template's end-of-turn tokens), or an unused generation prompt is taken back. Returns the messages."""
        if self._reply is None:
            return self._messages
        prompt_start, content_start = self._reply
        message = self._reply_message()
        self._reply = None
        if message is None:
            if prompt_start < len(self.tokens):
                self._truncate(prompt_start)
            return self._messages
        ended = self.tokens[-1] in self.engine.eos_token_ids
        closing = self.renderer.turn_end()
        if ended and closing[:1] == self.tokens[-1:]:
            closing = closing[1:]
        if closing:
            self._check_room(len(closing))
            self._extend_segment(self._reply_segment().id, closing, None)
        self._refresh_open_segment_text()
        self._messages.append(message)
        self._message_spans.append((fingerprint(message), prompt_start, len(self.tokens)))
        return self._messages

    # ---- generation -----------------------------------------------------------------------------
    def generate(
        self,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: list[str] | str | None = None,
        seed: int | None = None,
        params: SamplingParams | None = None,
    ) -> GenerationResult:
        """Generate a continuation of the session (greedy unless ``temperature`` > 0). If it fails, the
        caller received nothing and the session is left as it was before the call."""
        with self._lock, self._atomic(), self.engine.batcher.expecting():
            generation = self.start_generation(
                params,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                stop=stop,
                seed=seed,
            )
            for _ in generation:
                pass
            return generation.result

    def stream(
        self,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        stop: list[str] | str | None = None,
        seed: int | None = None,
        params: SamplingParams | None = None,
    ) -> Iterator[str]:
        """Yield text pieces as tokens are generated. Stopping early keeps exactly the text received."""
        generation = self.start_generation(
            params,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop,
            seed=seed,
        )
        return (piece for piece, _ in generation if piece)

    def start_generation(self, params: SamplingParams | None = None, **overrides) -> Generation:
        """A reply to drive step by step (``Generation.step``) or by iteration; the session is busy until it
        closes. Parameters are checked here, before anything runs."""
        return Generation(self, SamplingParams.of(params, **overrides))

    def _begin_generation(self, generation: Generation) -> tuple[int, int]:
        with self._lock:
            self.check_open()
            self._check_no_stream()
            if not self.tokens:
                raise InvalidArgumentError("the session is empty: append a prompt before generating")
            with self._atomic():
                self._ensure_logits()
            self._stream = (weakref.ref(generation), generation.progress)
            return len(self.tokens), max(0, len(self.tokens) - self._turn_prefilled)

    def _room_for_one_more(self) -> bool:
        return len(self.tokens) < self.engine.position_limit and self._longest_after(1) <= self.engine.max_context

    def _reply_segment(self) -> Segment:
        last = self.segments[-1] if self.segments else None
        if last is not None and last.kind == "assistant" and last.end == len(self.tokens):
            return last
        return self._new_segment("assistant", role="assistant")

    def _sample_next(self, params: SamplingParams, generator, generation: Generation) -> int:
        """Run pending tokens, sample the next one and append it (pending until the next step runs it)."""
        token = self._flush_pending(lambda logits: params.pick(logits, generator))
        if token is None:  # nothing was pending: the prompt's logits are at hand
            token = self.engine.batcher.execute(params.pick, self._last_logits, generator)
        segment = self._reply_segment()
        self.tokens.append(token)
        self._pending.append(token)
        self._replace_segment(segment.id, end=len(self.tokens))
        return token

    def _end_generation(self, progress) -> None:
        """Keep exactly the tokens of the text the caller received; free the session for other calls."""
        try:
            if not self.closed:
                self._settle(progress.generated, progress.emitted)
                self._refresh_open_segment_text()
        finally:
            if self._stream is not None and self._stream[1] is progress:
                self._stream = None
            self._turn_prefilled = 0

    def _settle(self, generated: list[int], text: str) -> None:
        """Make the reply's last ``len(generated)`` tokens decode to ``text`` (a prefix of their text)."""
        if self._decode(generated) == text:
            return
        k = len(generated)
        while k > 0 and not text.startswith(self._decode(generated[:k])):
            k -= 1
        rest = text[len(self._decode(generated[:k])) :]
        self._drop_tail(len(generated) - k)
        ids = self.engine.tokenizer.encode(rest, add_special_tokens=False) if rest else []
        if ids:
            segment = self._reply_segment()
            self.tokens.extend(ids)
            self._pending.extend(ids)
            self._replace_segment(segment.id, end=len(self.tokens))

    def _drop_tail(self, n: int) -> None:
        """Forget the session's last ``n`` tokens (the end of a reply)."""
        if n <= 0:
            return
        keep = len(self.tokens) - n
        if n <= len(self._pending):  # never run through the model: nothing to undo in the cache
            del self._pending[len(self._pending) - n :]
            self._cut_tokens(keep)
            self.segments = [s if s.end <= keep else s.replaced(end=keep) for s in self.segments if s.start < keep]
        else:
            self._truncate(keep)

    # ---- scoring ---------------------------------------------------------------------------------
    @_exclusive
    def logprobs(self, token_ids) -> torch.Tensor:
        """Teacher-forced log-probabilities of ``token_ids`` as the continuation; the session is unchanged
        (the cache bit for bit, whatever its shape).

        The first token is scored from the logits of the session's last token, computed when that token
        was appended.
        """
        ids = self._validate_tokens(token_ids)
        if not self.tokens:
            raise InvalidArgumentError("the session is empty: nothing to condition on")
        if self._longest_after(len(ids) - 1) > self.engine.max_context:
            raise ContextLengthError(f"continuation runs past the model's {self.engine.max_context} positions")
        if len(self.tokens) + len(ids) > self.engine.position_limit:
            raise ContextLengthError(
                f"continuation runs past the engine's position limit of {self.engine.position_limit}"
            )
        self._ensure_logits()
        first = torch.log_softmax(self._last_logits.float(), -1)[ids[0]].reshape(1).cpu()
        if len(ids) == 1:
            return first
        with self.scratch() as run:
            logits = run(ids[:-1], all_logits=True)
        rest = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:], device=logits.device)[:, None])
        return torch.cat([first, rest.squeeze(1).cpu()])

    @contextlib.contextmanager
    def scratch(self):
        """Run forwards past the end of the session, then forget them: the whole session state is restored
        (every layer's slots bit for bit), and the last-layer recorder sees none of them.

        Yields ``run``: ``run(ids)`` forwards ``ids`` after everything run so far in the block and returns
        the last token's logits (all of them with ``all_logits=True``)."""
        with self._lock:
            state = self.snapshot()
            hidden, self.hidden_recorder = self.hidden_recorder, None
            position = len(self.tokens)

            def run(ids, all_logits: bool = False) -> torch.Tensor:
                nonlocal position
                logits = self._forward(list(ids), segment_id=-1, positions_from=position, all_logits=all_logits)
                position += len(ids)
                return logits

            try:
                yield run
            finally:
                self.hidden_recorder = hidden
                self.restore(state)

    # ---- compaction ------------------------------------------------------------------------------
    def apply_plan(self, plan: CompactionPlan) -> None:
        """Apply a compaction plan to the cache (validated first: a bad plan changes nothing). Allowed while
        a stream is open: this is how the memory manager makes room mid-reply."""
        with self._lock:
            self.check_open()
            with self._atomic():
                self.engine.batcher.execute(self.cache.apply_plan, plan)  # heavy: where the passes run

    @_exclusive
    def compact(
        self,
        method: str | CompactionMethod,
        *,
        slots: int | None = None,
        ratio: float | None = None,
        segments: Iterable[int] | None = None,
        positions: Iterable[int] | None = None,
        query_source: str | list[str] = "window",
        keep_first: int = 4,
        keep_last: int = 256,
        measure_error: bool = True,
        **params,
    ) -> CompactionRecord:
        """Compact part of the cache with one method, now: ``session.compact("snapkv", ratio=4)``.

        ``method``: a registered name (built with ``params``) or a method instance. Size: ``slots`` per KV
        head for the whole span, or ``ratio`` tokens per slot. What: the given ``segments`` (ids) or
        logical ``positions``, by default everything; the first ``keep_first`` and the last ``keep_last``
        tokens always stay verbatim (sinks and recent window, as the memory manager keeps them).
        ``query_source``: reference queries for methods that use them (see ``kvmemory.compaction.queries``).
        ``measure_error``: report the attention-output error on the recorded window queries in the record
        (one extra attention pass over the span; off for timing the method alone).
        """
        method = self._method_of(method, params)
        if (slots is None) == (ratio is None):
            raise InvalidArgumentError("give exactly one of slots (per KV head) or ratio (tokens per slot)")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, Integral) or slots < 1):
            raise InvalidArgumentError(f"slots must be a positive integer, got {slots!r}")
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio >= 1):
            raise InvalidArgumentError(f"ratio must be a number ≥ 1 (tokens per slot), got {ratio!r}")
        sources = [query_source] if isinstance(query_source, str) else list(query_source)
        if not sources or any(src not in QUERY_SOURCES for src in sources):
            raise InvalidArgumentError(f"query_source must be among {', '.join(QUERY_SOURCES)}, got {query_source!r}")
        span = self._compaction_span(segments, positions, keep_first, keep_last)
        budget = int(slots) if slots is not None else max(1, round(span.numel() / ratio))
        measure = measure_error and self.query_recorder is not None and self.query_recorder.has_window
        job = SpanJob(span, method, budget, query_source if method.uses_queries else "window")
        record = compact_spans(self, [job], trigger="manual", measure_error=measure)[0]
        self._enable_recorders_for(method)  # for the next call: this one's positions were appended without
        return record

    def _method_of(self, method, params: dict) -> CompactionMethod:
        if isinstance(method, CompactionMethod):
            if params:
                raise InvalidArgumentError(
                    f"parameters {sorted(params)} given with a method instance; set them on the instance"
                )
            return method
        if not isinstance(method, str):
            raise InvalidArgumentError(
                f"method must be a registered name or a CompactionMethod, got {type(method).__name__}"
            )
        return get_method(method, **params)

    def _compaction_span(self, segments, positions, keep_first: int, keep_last: int) -> torch.Tensor:
        """Sorted logical positions to compact: the selection minus the sinks and the recent window."""
        for name, value in (("keep_first", keep_first), ("keep_last", keep_last)):
            if isinstance(value, bool) or not isinstance(value, Integral) or value < 0:
                raise InvalidArgumentError(f"{name} must be a non-negative integer, got {value!r}")
        n = len(self.tokens)
        if segments is not None and positions is not None:
            raise InvalidArgumentError("give segments or positions, not both")
        if segments is not None:
            chosen = [self.segment(i) for i in segments]  # names an unknown id
            wanted = (
                torch.cat([torch.arange(s.start, s.end) for s in chosen])
                if chosen
                else torch.empty(0, dtype=torch.long)
            )
        elif positions is not None:
            wanted = torch.as_tensor(positions if isinstance(positions, torch.Tensor) else list(positions))
            if wanted.dtype.is_floating_point or wanted.dtype == torch.bool or wanted.dim() != 1:
                raise InvalidArgumentError("positions must be a 1-D list of integers")
            outside = wanted[(wanted < 0) | (wanted >= n)]
            if outside.numel():
                raise InvalidArgumentError(f"positions outside the session's {n} tokens: {outside[:5].tolist()}")
        else:
            wanted = torch.arange(n)
        wanted = torch.unique(wanted.long())
        span = wanted[(wanted >= keep_first) & (wanted < n - max(keep_last, len(self._pending)))]
        if span.numel() < 2:
            raise InvalidArgumentError(
                f"nothing to compact: of {wanted.numel()} selected positions, {span.numel()} lie outside the first "
                f"{keep_first} (keep_first) and the last {keep_last} (keep_last) of the session's {n} tokens"
            )
        return span

    def _enable_recorders_for(self, method: CompactionMethod) -> None:
        """Switch on what ``method`` reads from now on (positions already appended are scored without it)."""
        if method.needs_last_layer_inputs:
            self.record_last_layer_inputs()
        if method.needs_surprisal:
            self.record_surprisal()

    def segment_slots(self) -> dict[int, float]:
        """Physical slots each segment holds, per KV head (mean over layers and heads)."""
        if not self.cache.layers[0].is_initialized:
            return {}
        seg_ids = torch.cat([layer.segments[:, : layer.length].flatten() for layer in self.cache.layers])
        counts = torch.bincount(seg_ids[seg_ids >= 0].long(), minlength=self._next_segment_id)
        per_head = self.cache.layers[0].num_heads * len(self.cache.layers)
        return {seg.id: float(counts[seg.id]) / per_head if seg.id < counts.numel() else 0.0 for seg in self.segments}

    def stats(self) -> SessionStats:
        with self._lock:
            slots = self.segment_slots()
            per_token = self.cache.bytes_per_token()
            per_segment = [
                {
                    "id": seg.id,
                    "kind": seg.kind,
                    "role": seg.role,
                    "tool_name": seg.tool_name,
                    "tokens": seg.length,
                    "slots": slots.get(seg.id, 0.0),
                    "bytes": int(slots.get(seg.id, 0.0) * per_token),
                    "ratio": seg.length / slots[seg.id] if slots.get(seg.id) else float("inf"),
                    "compactions": seg.compactions,
                    "cap_forced": seg.cap_forced,
                }
                for seg in self.segments
            ]
            return SessionStats(
                logical_tokens=len(self.tokens),
                physical_slots=[-(-layer.slot_count // max(layer.num_heads, 1)) for layer in self.cache.layers],
                slots_per_head=self.cache.physical_length,
                kv_bytes=self.cache.kv_bytes(),
                allocated_bytes=self.cache.allocated_bytes(),
                uncompacted_kv_bytes=self.cache.logical_length * per_token,
                compactions=self.cache.compactions,
                segments=per_segment,
                query_bytes=self.query_recorder.nbytes() if self.query_recorder is not None else 0,
            )

    # ---- transcript and recall -------------------------------------------------------------------
    def export_transcript(self, path=None) -> list[dict]:
        """Every segment with its full text (compacted or not); written as JSON when ``path`` is given."""
        data = self.transcript()
        if path is not None:
            from pathlib import Path

            Path(path).write_text(json.dumps({"session": self.id, "segments": data}, indent=1))
        return data

    def search(self, query: str, kinds: list[str] | None = None, limit: int = 3) -> list[Segment]:
        """Segments whose full text best matches ``query`` (BM25 over the transcript), best first.

        ``kinds`` narrows the search (e.g. ``["tool_output"]``); earlier recalls are never returned, so
        recalling a search hit does not make it its own best match."""
        if not isinstance(query, str):
            raise InvalidArgumentError(f"search takes a string query, got {type(query).__name__}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise InvalidArgumentError(f"limit must be an integer ≥ 0, got {limit!r}")
        with self._lock:
            self._refresh_open_segment_text()
            pool = [s for s in self.segments if s.kind != "recall" and (kinds is None or s.kind in kinds)]
            return [seg for _, seg in rank_segments(query, pool)[:limit]]

    @_exclusive
    def recall(self, segment_id: int) -> Segment:
        """Re-insert a segment's full text verbatim at the end of the context, saying what it is.

        In a chat session it arrives as a user message (so later ``set_messages`` calls stay in sync);
        otherwise as a text segment of kind ``recall``.
        """
        seg = self.segment(segment_id)
        self._refresh_open_segment_text()
        label = seg.kind + (f" from tool {seg.tool_name}" if seg.tool_name else "")
        header, footer = f"[recalled segment {seg.id}: {label}, verbatim]\n", f"\n[end of recalled segment {seg.id}]"
        if self._messages or self._reply is not None:
            message = {"role": "user", "content": header + seg.text + footer, "recall_of": seg.id}
            held = self._close_reply()
            return self._append_rendered(
                held, [message], None if not self._tools_key else json.loads(self._tools_key), False, None
            )[-1]
        ids = self.tokens[seg.start : seg.end]  # the exact tokens, whatever the cache kept of them
        if self.engine.tokenizer is not None:
            encode = self.engine.tokenizer.encode
            ids = encode(header, add_special_tokens=False) + ids + encode(footer, add_special_tokens=False)
            text = header + seg.text + footer
        else:
            text = seg.text
        return self._append_tokens(ids, kind="recall", role="user", text=text, recall_of=seg.id)

    # ---- internals -------------------------------------------------------------------------------
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

    def _check_room(self, n_new: int, new_segments: list[Segment] = ()) -> None:
        if len(self.tokens) + n_new > self.engine.position_limit:
            raise ContextLengthError(
                f"appending {n_new} tokens at position {len(self.tokens)} would pass the engine's position "
                f"limit of {self.engine.position_limit}"
            )
        if self.memory is None and self._longest_after(n_new) > self.engine.max_context:
            raise ContextLengthError(
                f"appending {n_new} tokens to a cache of {self._longest_after(0)} slots would exceed the model's "
                f"{self.engine.max_context} positions (attach a MemoryManager to compact instead)"
            )
        if self.memory is not None:
            self.memory.check_fits(n_new, list(new_segments))

    def _longest_after(self, n_new: int) -> int:
        """Slots of the longest layer once ``n_new`` more tokens (and any pending ones) are in the cache."""
        return (self.cache.longest_layer if self.cache.layers[0].is_initialized else 0) + len(self._pending) + n_new

    def _replace_segment(self, segment_id: int, **changes) -> Segment:
        """Put a copy of the segment with ``changes`` in its place (segments are never changed in place)."""
        i = self._segment_index(segment_id)
        self.segments[i] = self.segments[i].replaced(**changes)
        return self.segments[i]

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

    def _extend_segment(self, segment_id: int, ids: list[int], progress: ProgressCallback | None) -> Segment:
        """Prefill ``ids`` into the segment chunk by chunk, giving the memory manager room before each chunk;
        returns the segment as it then stands."""
        self._flush_pending()
        done, total = 0, len(ids)
        step = self.memory.chunk_size() if self.memory is not None else self.prefill_chunk_size
        finish_by = self.engine.batcher.due(total)  # every chunk keeps the prefill's place (see ForwardBatcher)
        if self.show_progress and total > step:
            progress = _tqdm_progress(total, progress)
        while done < total:
            chunk = ids[done : done + step]
            if self.memory is not None:
                self.memory.make_room(len(chunk))
            self._forward(chunk, segment_id, positions_from=len(self.tokens), finish_by=finish_by)
            self.tokens.extend(chunk)
            self._replace_segment(segment_id, end=len(self.tokens))
            self._turn_prefilled += len(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
        return self.segment(segment_id)

    def _flush_pending(self, pick: Callable[[torch.Tensor], int] | None = None) -> int | None:
        """Run sampled-but-unprocessed tokens through the model (they belong to the last segment); with
        ``pick``, the next token picked from the last logits where the model runs (None when nothing ran)."""
        if not self._pending:
            return None
        ids, seg_id = self._pending, self.segments[-1].id
        if self.memory is not None:
            self.memory.make_room(len(ids))
        _, token = self._forward_then(ids, seg_id, len(self.tokens) - len(ids), pick=pick)
        self._pending = []
        return token

    def _forward(
        self,
        ids: list[int],
        segment_id: int,
        positions_from: int,
        all_logits: bool = False,
        finish_by: int | None = None,
    ) -> torch.Tensor:
        """Run ``ids`` through the model at ``positions_from`` into the cache (``finish_by``: the place of the
        prefill they belong to, ``ForwardRequest.finish_by``; by default a prefill of their own). Callers own
        the rollback (``_atomic`` or ``scratch``)."""
        return self._forward_then(ids, segment_id, positions_from, all_logits, finish_by=finish_by)[0]

    def _forward_then(
        self,
        ids: list[int],
        segment_id: int,
        positions_from: int,
        all_logits: bool = False,
        pick: Callable[[torch.Tensor], int] | None = None,
        finish_by: int | None = None,
    ) -> tuple[torch.Tensor, int | None]:
        """``_forward``, and with ``pick`` the next token picked from the last logits. Both that and the
        tokens' surprisal run where the model runs, in the pass's own hand-over (``ForwardRequest.after``)."""
        engine = self.engine
        if (
            segment_id >= 0
            and engine.rebase_positions
            and self.cache.rope_length + len(ids) > engine.rebase_at
            and self.cache.rope_length > self.cache.physical_length + len(ids)
        ):  # only when there are gaps to close
            self._rebase()
        recording, before = self._records_surprisal(segment_id), self._last_logits

        def after(logits: torch.Tensor) -> tuple[list[float] | None, int | None]:
            surprisal = surprisal_of(ids, before, logits).tolist() if recording else None
            return surprisal, None if pick is None else pick(logits[-1])

        request = ForwardRequest(
            self.cache,
            ids,
            positions_from,
            segment_id,
            all_logits or recording,
            self.query_recorder,
            self.hidden_recorder,
            after if recording or pick is not None else None,
            finish_by=engine.batcher.due(len(ids)) if finish_by is None else finish_by,
        )
        logits = engine.batcher.run(request)
        surprisal, token = request.outcome or (None, None)
        if recording:
            self.surprisal_recorder.record(positions_from, surprisal)
            logits = logits if all_logits or len(ids) == 1 else logits[-1:]
        if segment_id >= 0:
            self.prefilled_tokens += len(ids)
        if not all_logits:
            self._last_logits = logits[-1]
        return logits, token

    def _records_surprisal(self, segment_id: int) -> bool:
        return self.surprisal_recorder is not None and segment_id >= 0  # scratch forwards are not the session's

    def _after_append(self) -> None:
        if self.memory is not None:
            self.memory.after_append()

    def _decode(self, ids: list[int]) -> str:
        return self.engine.detokenize(ids)

    def _refresh_open_segment_text(self) -> None:
        if self.segments:
            seg = self.segments[-1]
            if seg.kind == "assistant" or not seg.text:
                self.segments[-1] = seg.replaced(text=self._decode(self.tokens[seg.start : seg.end]))

    # ---- chat internals --------------------------------------------------------------------------
    def _cut_point(self, keep: int) -> int:
        """Where to cut the cache so that whole segments are re-prefilled: the start of the segment holding ``keep``."""
        if keep >= len(self.tokens):
            return len(self.tokens)
        for seg in self.segments:
            if seg.start <= keep < seg.end:
                return seg.start
        return keep

    def _segment_starting_at(self, start: int) -> Segment | None:
        for seg in reversed(self.segments):
            if seg.start == start and seg.end >= start:
                return seg
        return None

    def _truncate(self, position: int) -> None:
        """Cut the session back to ``position`` (cache, transcript and segments)."""
        self._pending = []
        left = self.cache.truncate_positions(position)
        for recorder in (self.hidden_recorder, self.surprisal_recorder):
            if recorder is not None:
                recorder.drop_from(position)
        self._cut_tokens(position)
        self._last_logits = None
        self.segments = [
            s if s.end <= position else s.replaced(end=position) for s in self.segments if s.start < position
        ]
        last = self.segments[-1] if self.segments else None
        if last is not None and last.kind == "assistant":
            self.segments[-1] = last.replaced(text=self._decode(self.tokens[last.start : last.end]))
        self._message_spans = [span for span in self._message_spans if span[2] <= position]
        self._messages = self._messages[: len(self._message_spans)]
        if self._reply is not None and self._reply[1] > position:
            self._reply = None
        if left < position:  # a compacted head lost every slot: rebuild the prefix from the transcript
            finish_by = self.engine.batcher.due(position)  # one prefill, whatever its chunks and segments
            for seg in self.segments:
                for i in range(seg.start, seg.end, self.prefill_chunk_size):
                    chunk = self.tokens[i : min(i + self.prefill_chunk_size, seg.end)]
                    self._forward(chunk, seg.id, positions_from=i, finish_by=finish_by)

    def _cut_tokens(self, position: int) -> None:
        """Drop the transcript from ``position`` on. Snapshots hold the list itself up to ``_tokens_shared``
        (``SessionState.tokens``): a cut below that cuts a copy, so theirs stays intact."""
        if position < self._tokens_shared:
            self.tokens, self._tokens_shared = self.tokens[:position], 0
        else:
            del self.tokens[position:]

    def _ensure_logits(self) -> None:
        """Next-token logits for the session's end: run pending tokens, or re-run the last token."""
        self._flush_pending()
        if self._last_logits is None and self.tokens:
            last = len(self.tokens) - 1
            self.cache.truncate_positions(last)
            seg = next(s for s in reversed(self.segments) if s.start <= last < s.end)
            self._forward([self.tokens[last]], seg.id, positions_from=last)
