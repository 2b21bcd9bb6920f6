"""Session: one conversation's resident, compactable KV cache plus its lossless transcript.

Appends prefill only tokens the cache does not hold yet; generation continues from the cache; a
compaction plan rewrites the cache in place. Every public call either completes or leaves the cache,
the transcript and the segments exactly as they were.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvmemory.cache import CompactCache, CompactionPlan
from kvmemory.errors import ContextLengthError, InvalidTokenError, SessionClosedError
from kvmemory.memory.segments import Segment
from kvmemory.memory.search import rank_segments
from kvmemory.runtime.chat import ChatRenderer
from kvmemory.runtime.recorders import HiddenRecorder, QueryRecorder

ProgressCallback = Callable[[int, int], None]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (stop token or string), "length" (max tokens or context end)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the cache instead of prefilled


@dataclass
class SessionStats:
    logical_tokens: int
    physical_slots: list[int]
    kv_bytes: int
    allocated_bytes: int
    uncompacted_kv_bytes: int
    padding_overhead: float
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


def _fingerprint(message: dict) -> str:
    return hashlib.sha1(json.dumps(message, sort_keys=True, default=str).encode()).hexdigest()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Session:
    """A conversation on an Engine. Create with ``engine.session()``.

    ``memory`` is an optional manager (see ``kvmemory.memory``) that decides when and how to compact;
    without one the cache is only compacted by explicit ``compact(plan)`` calls.
    """

    def __init__(self, engine, session_id: str | None = None, memory=None, prefill_chunk_size: int = 512,
                 show_progress: bool = False):
        self.engine = engine
        self.id = session_id or f"session-{id(self):x}"
        self.cache = CompactCache(engine.num_layers)
        self.tokens: list[int] = []  # the logical transcript: tokens[i] sits at position i
        self.segments: list[Segment] = []
        self.messages: list[dict] = []
        self.prefill_chunk_size = prefill_chunk_size
        self.show_progress = show_progress  # tqdm bars for long prefills (quiet by default in library use)
        self.memory = memory
        self.closed = False
        self._pending: list[int] = []  # sampled tokens not yet run through the model
        self._last_logits: torch.Tensor | None = None
        self._message_spans: list[tuple[str, int, int]] = []  # (fingerprint, start, end) per message
        self._tools_key: str | None = None
        self._renderer: ChatRenderer | None = None
        self._next_segment_id = 0
        self.query_recorder: QueryRecorder | None = None
        self.hidden_recorder: HiddenRecorder | None = None
        self.compaction_log: list[dict] = []
        self.prefilled_tokens = 0  # tokens run through the model by appends (cache reuse shows here)
        if memory is not None:
            memory.attach(self)

    # ---- context managers ------------------------------------------------------------------------
    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def __aenter__(self):
        from kvmemory.runtime.async_session import AsyncSession

        return AsyncSession(self)

    async def __aexit__(self, *exc) -> None:
        self.close()

    def record_queries(self, window: int = 64, context: int = 0) -> QueryRecorder:
        """Keep post-RoPE queries: of the last ``window`` tokens (the selector window for compaction) and,
        with ``context`` > 0, about that many tokens' queries of each segment as it is prefilled."""
        rec = self.query_recorder
        if rec is None:
            self.query_recorder = QueryRecorder(self.engine.num_layers, self.engine.num_kv_heads, window, context)
        else:
            rec.window, rec.context_tokens = max(rec.window, window), max(rec.context_tokens, context)
        return self.query_recorder

    def record_last_layer_inputs(self) -> HiddenRecorder:
        """Keep each position's input to the last decoder layer (for the fast counter-causal score)."""
        if self.hidden_recorder is None:
            self.hidden_recorder = HiddenRecorder(self.engine.model)
        return self.hidden_recorder

    def rebase_positions(self) -> int:
        """Re-rotate the cache so that each head's RoPE positions are the ranks of its cached slots (closing
        the gaps compaction left). Runs by itself when the next token would pass ``engine.rebase_at`` (the
        trained positions by default), so a compacted session never asks the model for distances it was not
        trained on."""
        with self.engine.lock, torch.no_grad():
            shift = self.cache.rebase(self.engine.rope_inv_freq)
            if self.query_recorder is not None:
                self.query_recorder.shift(shift, self.engine.rope_inv_freq)
        return shift

    def fork(self, session_id: str | None = None, with_memory: bool = False) -> "Session":
        """An independent copy of this session (cache, transcript, recorders), e.g. to try a compaction.

        ``with_memory`` gives the copy its own copy of the memory manager (same policy and cap, separate
        history), so what is appended to it is compacted as the original would be."""
        self._check_open()
        child = Session(self.engine, session_id, memory=None, prefill_chunk_size=self.prefill_chunk_size)
        if with_memory and self.memory is not None:
            child.memory = copy.deepcopy(self.memory)
        child.cache = copy.deepcopy(self.cache)
        child.tokens, child.messages = list(self.tokens), copy.deepcopy(self.messages)
        child.segments = [dataclasses.replace(s, meta=dict(s.meta)) for s in self.segments]
        child._pending, child._last_logits = list(self._pending), self._last_logits
        child._message_spans, child._tools_key = list(self._message_spans), self._tools_key
        child._next_segment_id = self._next_segment_id
        child.compaction_log = list(self.compaction_log)
        if self.query_recorder is not None:
            child.query_recorder = copy.deepcopy(self.query_recorder)
        if self.hidden_recorder is not None:
            child.record_last_layer_inputs().store = dict(self.hidden_recorder.store)
        return child

    def close(self) -> None:
        """Free the cache. The transcript stays readable."""
        self.closed = True
        if self.hidden_recorder is not None:
            self.hidden_recorder.close()
            self.hidden_recorder = None
        self.cache = CompactCache(self.engine.num_layers)
        self._last_logits = None

    # ---- properties ----------------------------------------------------------------------------
    @property
    def renderer(self) -> ChatRenderer:
        if self._renderer is None:
            self._renderer = ChatRenderer(self.engine.tokenizer)
        return self._renderer

    @property
    def logical_length(self) -> int:
        """Positions consumed: cached tokens plus sampled tokens still pending."""
        return len(self.tokens)

    def segment(self, segment_id: int) -> Segment:
        for seg in self.segments:
            if seg.id == segment_id:
                return seg
        raise KeyError(f"no segment {segment_id} in session {self.id}")

    def transcript(self) -> list[dict]:
        """The full text of every segment, compacted or not."""
        self._refresh_open_segment_text()
        return [seg.to_dict() for seg in self.segments]

    # ---- appends ---------------------------------------------------------------------------------
    def append_text(self, text: str, kind: str = "text", role: str | None = None, progress: ProgressCallback | None = None, **meta) -> Segment:
        """Tokenize ``text`` (no special tokens added) and append it as one segment."""
        self._check_open()
        if self.engine.tokenizer is None:
            raise ValueError("this engine has no tokenizer: use append_tokens")
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return self.append_tokens(ids, kind=kind, role=role, progress=progress, text=text, **meta)

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
        """Append token ids as a new segment; they are prefilled in chunks."""
        self._check_open()
        ids = self._validate_tokens(token_ids)
        probe = Segment(-1, kind, len(self.tokens), len(self.tokens) + len(ids), role, tool_name, tuple(tags),
                        text=text if text is not None else self._decode(ids))
        self._check_room(len(ids), [probe])
        segment = self._new_segment(kind, role=role, tool_name=tool_name, tags=tuple(tags), meta=meta)
        self._extend_segment(segment, ids, progress)
        segment.text = text if text is not None else self._decode(ids)
        self._after_append()
        return segment

    def append_messages(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False, progress: ProgressCallback | None = None) -> list[Segment]:
        """Append chat messages after the ones already in the session."""
        return self.set_messages(self.messages + list(messages), tools, add_generation_prompt, progress)

    def set_messages(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False, progress: ProgressCallback | None = None) -> list[Segment]:
        """Make the session hold exactly this conversation, prefilling only what the cache lacks.

        The rendered tokens are diffed against the cached ones; when a template re-renders an earlier
        turn, the cache is cut back to the start of the first message that differs and re-prefilled
        from there. Returns the segments created or extended.
        """
        self._check_open()
        messages = [dict(m) for m in messages]
        target, spans = self._render_with_spans(messages, tools, add_generation_prompt)
        if len(target) > self.engine.position_limit:
            raise ContextLengthError(
                f"conversation renders to {len(target)} tokens; the engine's position limit is {self.engine.position_limit}"
            )
        self._flush_pending()
        keep = _common_prefix(self.tokens, target)
        cut = self._cut_point(keep)
        added = len(target) - cut
        if cut == len(self.tokens):
            probes = [
                Segment(-1, self._message_kind(m), max(s, cut), e, m.get("role"), m.get("name"), tuple(m.get("tags", ())),
                        text=str(m.get("content") or ""))
                for m, (s, e) in zip(messages, spans) if e > cut
            ]
            self._check_room(added, probes)
        touched = []
        state = self._save_state()
        try:
            if cut < len(self.tokens):
                self._truncate(cut)
            cut = len(self.tokens)  # truncation may have had to go further back
            for index, (start, end) in enumerate(spans + ([(spans[-1][1] if spans else 0, len(target))] if add_generation_prompt else [])):
                if end <= cut:
                    continue
                is_prompt = index == len(messages)
                msg = None if is_prompt else messages[index]
                seg = self._segment_starting_at(start)
                if seg is None:
                    seg = self._new_segment(
                        "assistant" if is_prompt else self._message_kind(msg),
                        role="assistant" if is_prompt else msg["role"],
                        tool_name=None if is_prompt else msg.get("name"),
                        tags=() if is_prompt else tuple(msg.get("tags", ())),
                        message_index=None if is_prompt else index,
                    )
                elif not is_prompt:
                    seg.message_index = index
                self._extend_segment(seg, target[max(start, cut) : end], progress)
                seg.text = self._decode(self.tokens[seg.start : seg.end])
                touched.append(seg)
                self._after_append()
        except BaseException:
            self._restore_state(state)
            raise
        self.messages = messages
        self._message_spans = [(_fingerprint(m), s, e) for m, (s, e) in zip(messages, spans)]
        return touched

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, stop: list[str] | None = None, seed: int | None = None) -> GenerationResult:
        """Generate a continuation of the session (greedy when temperature is 0)."""
        pieces = list(self._generate(max_new_tokens, temperature, top_p, top_k, stop, seed))
        return pieces[-1][1] if pieces else GenerationResult("", [], "length")

    def stream(self, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, stop: list[str] | None = None, seed: int | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are generated. Stopping early leaves the session consistent."""
        for piece, _ in self._generate(max_new_tokens, temperature, top_p, top_k, stop, seed):
            if piece:
                yield piece

    def _generate(self, max_new_tokens, temperature, top_p, top_k, stop, seed):
        """Yields (new text piece, result so far). Each step is atomic, so a consumer may stop anywhere."""
        self._check_open()
        if not self.tokens:
            raise ValueError("the session is empty: append a prompt before generating")
        self._ensure_logits()
        generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
        segment = self.segments[-1] if self.segments and self.segments[-1].kind == "assistant" and self.segments[-1].end == len(self.tokens) else None
        if segment is None:
            segment = self._new_segment("assistant", role="assistant")
        generated: list[int] = []
        emitted = ""
        finish = "length"
        eos = self.engine.eos_token_ids
        try:
            for _ in range(max_new_tokens):
                if len(self.tokens) >= self.engine.position_limit or self._physical_after(1) > self.engine.max_context:
                    break
                if self._pending:
                    self._flush_pending()
                token = self._pick(self._last_logits, temperature, top_p, top_k, generator)
                self.tokens.append(token)
                self._pending.append(token)
                segment.end = len(self.tokens)
                if token in eos:
                    finish = "stop"
                    break
                generated.append(token)
                text = self._decode(generated)
                hit = min((i for i in (text.find(s) for s in stop or []) if i >= 0), default=-1)
                if hit >= 0:
                    text, finish = text[:hit], "stop"
                if not text.endswith("\ufffd") or finish == "stop":
                    piece, emitted = text[len(emitted):], text
                    yield piece, GenerationResult(emitted, list(generated), finish)
                if finish == "stop":
                    return
        finally:
            segment.text = self._decode(self.tokens[segment.start : segment.end])
        yield "", GenerationResult(emitted if finish != "length" else self._decode(generated), list(generated), finish)

    def _pick(self, logits, temperature, top_p, top_k, generator) -> int:
        if temperature <= 0:
            return int(torch.argmax(logits))
        logits = logits.float() / temperature
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            drop = sorted_probs.cumsum(0) - sorted_probs > top_p
            sorted_probs[drop] = 0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))

    # ---- scoring ---------------------------------------------------------------------------------
    def logprobs(self, token_ids) -> torch.Tensor:
        """Teacher-forced log-probabilities of ``token_ids`` as the continuation; the session is unchanged.

        The first token is scored from the logits of the session's last token, computed when that token
        was appended.
        """
        self._check_open()
        ids = self._validate_tokens(token_ids)
        if self._physical_after(len(ids) - 1) > self.engine.max_context:
            raise ContextLengthError(f"continuation runs past the model's {self.engine.max_context} positions")
        if not self.tokens:
            raise ValueError("the session is empty: nothing to condition on")
        self._ensure_logits()
        first = torch.log_softmax(self._last_logits.float(), -1)[ids[0]].reshape(1).cpu()
        if len(ids) == 1:
            return first
        with self.scratch():
            logits = self._forward(ids[:-1], segment_id=-1, positions_from=len(self.tokens), all_logits=True)
        rest = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(ids[1:], device=logits.device)[:, None])
        return torch.cat([first, rest.squeeze(1).cpu()])

    @contextlib.contextmanager
    def scratch(self):
        """Run forwards past the end of the session, then forget them (cache, logits, recorders)."""
        snapshot = self.cache.snapshot_lengths()
        last_logits = self._last_logits
        recorder_state = self.query_recorder.state() if self.query_recorder is not None else None
        hidden, self.hidden_recorder = self.hidden_recorder, None
        try:
            yield
        finally:
            self.cache.rollback(snapshot)
            self._last_logits = last_logits
            self.hidden_recorder = hidden
            if recorder_state is not None:
                self.query_recorder.restore(recorder_state)

    # ---- compaction ------------------------------------------------------------------------------
    def compact(self, plan: CompactionPlan) -> None:
        """Apply a compaction plan to the cache (validated first: a bad plan changes nothing)."""
        self._check_open()
        with self.engine.lock:
            self.cache.apply_plan(plan)

    def segment_slots(self) -> dict[int, float]:
        """Physical slots each segment holds, per KV head (mean over layers and heads)."""
        if not self.cache.layers[0].is_initialized:
            return {}
        seg_ids = torch.cat([layer.segments[:, : layer.length].flatten() for layer in self.cache.layers])
        counts = torch.bincount(seg_ids[seg_ids >= 0].long(), minlength=self._next_segment_id)
        per_head = self.cache.layers[0].num_heads * len(self.cache.layers)
        return {seg.id: float(counts[seg.id]) / per_head if seg.id < counts.numel() else 0.0 for seg in self.segments}

    def stats(self) -> SessionStats:
        slots = self.segment_slots()
        per_token = self.cache.bytes_per_token()
        per_segment = [
            {"id": seg.id, "kind": seg.kind, "role": seg.role, "tool_name": seg.tool_name, "tokens": seg.length,
             "slots": slots.get(seg.id, 0.0), "bytes": int(slots.get(seg.id, 0.0) * per_token),
             "ratio": seg.length / slots[seg.id] if slots.get(seg.id) else float("inf"), "compactions": seg.compactions}
            for seg in self.segments
        ]
        return SessionStats(
            logical_tokens=len(self.tokens),
            physical_slots=[layer.length for layer in self.cache.layers],
            kv_bytes=self.cache.kv_bytes(),
            allocated_bytes=self.cache.allocated_bytes(),
            uncompacted_kv_bytes=self.cache.logical_length * per_token,
            padding_overhead=self.cache.padding_overhead(),
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
        self._refresh_open_segment_text()
        pool = [s for s in self.segments if s.kind != "recall" and (kinds is None or s.kind in kinds)]
        return [seg for _, seg in rank_segments(query, pool)[:limit]]

    def recall(self, segment_id: int) -> Segment:
        """Re-insert a segment's full text verbatim at the end of the context, saying what it is.

        In a chat session it arrives as a user message (so later ``set_messages`` calls stay in sync);
        otherwise as a text segment of kind ``recall``.
        """
        seg = self.segment(segment_id)
        label = seg.kind + (f" from tool {seg.tool_name}" if seg.tool_name else "")
        header, footer = f"[recalled segment {seg.id}: {label}, verbatim]\n", f"\n[end of recalled segment {seg.id}]"
        if self.messages:
            message = {"role": "user", "content": header + seg.text + footer, "recall_of": seg.id}
            return self.append_messages([message])[-1]
        ids = self.tokens[seg.start : seg.end]  # the exact tokens, whatever the cache kept of them
        if self.engine.tokenizer is not None:
            encode = self.engine.tokenizer.encode
            ids = encode(header, add_special_tokens=False) + ids + encode(footer, add_special_tokens=False)
            text = header + seg.text + footer
        else:
            text = seg.text
        return self.append_tokens(ids, kind="recall", role="user", text=text, recall_of=seg.id)

    # ---- internals -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed")

    def _validate_tokens(self, token_ids) -> list[int]:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.flatten().tolist()
        ids = [int(t) for t in token_ids]
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
        capped = self.memory is not None and self.memory.slot_cap(self) is not None
        if not capped and self._physical_after(n_new) > self.engine.max_context:
            raise ContextLengthError(
                f"appending {n_new} tokens to a cache of {self._physical_after(0)} would exceed the model's "
                f"{self.engine.max_context} positions (attach a MemoryManager with a cap to compact instead)"
            )
        if self.memory is not None:
            self.memory.check_fits(self, n_new, list(new_segments))

    def _physical_after(self, n_new: int) -> int:
        """Physical slots once ``n_new`` more tokens (and any pending ones) are in the cache."""
        return self.cache.physical_length + len(self._pending) + n_new

    def _new_segment(self, kind: str, role=None, tool_name=None, tags=(), message_index=None, meta=None) -> Segment:
        seg = Segment(
            id=self._next_segment_id, kind=kind, start=len(self.tokens), end=len(self.tokens), role=role,
            tool_name=tool_name, tags=tuple(tags), message_index=message_index, meta=dict(meta or {}),
        )
        self._next_segment_id += 1
        self.segments.append(seg)
        return seg

    def _extend_segment(self, segment: Segment, ids: list[int], progress: ProgressCallback | None) -> None:
        """Prefill ``ids`` into ``segment`` chunk by chunk, giving the memory manager room before each chunk."""
        state = self._save_state()
        try:
            self._flush_pending()
            done, total = 0, len(ids)
            step = self.memory.chunk_size(self) if self.memory is not None else self.prefill_chunk_size
            if self.show_progress and total > step:
                progress = _tqdm_progress(total, progress)
            while done < total:
                chunk = ids[done : done + step]
                if self.memory is not None:
                    self.memory.make_room(self, len(chunk))
                self._forward(chunk, segment.id, positions_from=len(self.tokens))
                self.tokens.extend(chunk)
                segment.end = len(self.tokens)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
        except BaseException:
            self._restore_state(state)
            raise

    def _flush_pending(self) -> None:
        """Run sampled-but-unprocessed tokens through the model (they belong to the last segment)."""
        if not self._pending:
            return
        ids, seg_id = self._pending, self.segments[-1].id
        if self.memory is not None:
            self.memory.make_room(self, len(ids))
        self._forward(ids, seg_id, positions_from=len(self.tokens) - len(ids))
        self._pending = []

    def _forward(self, ids: list[int], segment_id: int, positions_from: int, all_logits: bool = False) -> torch.Tensor:
        engine = self.engine
        input_ids = torch.tensor([ids], device=engine.device)
        positions = torch.arange(positions_from, positions_from + len(ids), device=engine.device)
        if (segment_id >= 0 and engine.rebase_positions and self.cache.rope_length + len(ids) > engine.rebase_at
                and self.cache.rope_length > self.cache.physical_length + len(ids)):  # only when there are gaps to close
            self.rebase_positions()
        rope = self.cache.rope_positions(positions)
        snapshot = self.cache.snapshot_lengths()
        extra = {"query_recorder": self.query_recorder} if self.query_recorder is not None else {}
        with engine.lock, torch.no_grad():
            try:
                self.cache.begin_append(positions, segment_id)
                if self.hidden_recorder is not None:
                    self.hidden_recorder.expect(positions)
                if self.query_recorder is not None:
                    self.query_recorder.current_segment = segment_id
                out = engine.model(
                    input_ids=input_ids,
                    position_ids=rope[None],
                    cache=self.cache,
                    use_cache=True,
                    logits_to_keep=0 if all_logits else 1,
                    compact_cache=self.cache,
                    **extra,
                )
            except BaseException:
                self.cache.rollback(snapshot)
                raise
        logits = out.logits[0]
        if segment_id >= 0:
            self.prefilled_tokens += len(ids)
        if not all_logits:
            self._last_logits = logits[-1]
        return logits

    def _save_state(self):
        return (
            len(self.tokens), list(self._pending), self._last_logits, self.cache.snapshot_lengths(),
            [(s.id, s.end, s.text, s.message_index) for s in self.segments], self._next_segment_id,
        )

    def _restore_state(self, state) -> None:
        n_tokens, pending, last_logits, snapshot, segs, next_id = state
        if self.cache.compactions == snapshot[2]:
            self.cache.rollback(snapshot)
        else:  # compactions ran mid-append (they stay: older segments are legitimately smaller now)
            self.cache.truncate_positions(n_tokens - len(pending))
            last_logits = None  # recomputed from the last token on the next generate
            if self.hidden_recorder is not None:
                self.hidden_recorder.drop_from(n_tokens - len(pending))
        del self.tokens[n_tokens:]
        self._pending, self._last_logits = pending, last_logits
        by_id = {s.id: s for s in self.segments}
        self.segments = [by_id[i] for i, *_ in segs]
        for (i, end, text, mi) in segs:
            by_id[i].end, by_id[i].text, by_id[i].message_index = end, text, mi
        self._next_segment_id = next_id

    def _after_append(self) -> None:
        if self.memory is not None:
            self.memory.after_append(self)

    def _decode(self, ids: list[int]) -> str:
        tok = self.engine.tokenizer
        return tok.decode(ids) if tok is not None else ""

    def _refresh_open_segment_text(self) -> None:
        if self.segments:
            seg = self.segments[-1]
            seg.text = self._decode(self.tokens[seg.start : seg.end])

    # ---- chat internals --------------------------------------------------------------------------
    def _render_with_spans(self, messages, tools, add_generation_prompt):
        """Token ids of the conversation and each message's [start, end) span in them."""
        renderer = self.renderer
        tools_key = json.dumps(tools, sort_keys=True, default=str) if tools else ""
        full = renderer.render(messages, tools, add_generation_prompt)
        spans: list[tuple[int, int]] = []
        reusable = self._tools_key == tools_key
        for i, msg in enumerate(messages):
            if reusable and i < len(self._message_spans) and self._message_spans[i][0] == _fingerprint(msg):
                s, e = self._message_spans[i][1:]
                if full[s:e] == self.tokens[s:e]:
                    spans.append((s, e))
                    continue
            reusable = False
            end = len(renderer.render(messages[: i + 1], tools, False))
            spans.append((spans[-1][1] if spans else 0, min(end, len(full))))
        self._tools_key = tools_key
        return full, spans

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
        left = self.cache.truncate_positions(position)
        if self.hidden_recorder is not None:
            self.hidden_recorder.drop_from(position)
        del self.tokens[position:]
        self._pending = []
        self._last_logits = None
        self.segments = [s for s in self.segments if s.start < position]
        for seg in self.segments:
            seg.end = min(seg.end, position)
        if left < position:  # a compacted head lost every slot: rebuild the prefix from the transcript
            for seg in self.segments:
                for i in range(seg.start, seg.end, self.prefill_chunk_size):
                    self._forward(self.tokens[i : min(i + self.prefill_chunk_size, seg.end)], seg.id, positions_from=i)

    def _ensure_logits(self) -> None:
        """Next-token logits for the session's end: run pending tokens, or re-run the last token."""
        self._flush_pending()
        if self._last_logits is None and self.tokens:
            last = len(self.tokens) - 1
            self.cache.truncate_positions(last)
            seg = next(s for s in reversed(self.segments) if s.start <= last < s.end)
            self._forward([self.tokens[last]], seg.id, positions_from=last)

    @staticmethod
    def _message_kind(msg: dict) -> str:
        role = msg.get("role")
        if role == "tool":
            return "tool_output"
        if role == "assistant" and msg.get("tool_calls"):
            return "tool_call"
        return {"system": "system", "user": "user", "assistant": "assistant"}.get(role, "text")
