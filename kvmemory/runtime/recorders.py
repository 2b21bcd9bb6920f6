"""Recorders the attention function and the model feed while a session runs.

* ``QueryRecorder`` keeps post-RoPE queries: a rolling window of the last R tokens (the selector window
  that online compaction uses) and, while capturing, every query of the forward passes (context-prefill,
  repeat-prefill and self-study reference queries).
* ``HiddenRecorder`` keeps the input of the last decoder layer per position, which the fast
  counter-causal score needs.
* ``SurprisalRecorder`` keeps each token's surprisal −log p(token | what came before), which the
  selective-context method ranks by.
Queries come back grouped by KV head: (H, tokens·G, D), rows token-major.

A forward pass hands each recorder its queries of every layer at once, after the pass has run (``store``,
from ``PackedCache.store_queries``): grouping, windowing and copying them layer by layer cost ~15 µs a layer
(0.5 ms of a ~15 ms decoded token on the default model), and slicing every session's queries out of every
layer of a packed pass costs as much again per session.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import torch

from kvmemory.runtime.logits import logsumexp_rows

QUERY_WINDOW = 64  # R: the selector-window queries a session records from its start


def group_queries(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """(L, Hq, T, D) → (L, H, T·G, D) with the G query heads of each KV head stacked per token."""
    layers, hq, t, d = queries.shape
    g = hq // num_kv_heads
    return queries.view(layers, num_kv_heads, g, t, d).transpose(2, 3).reshape(layers, num_kv_heads, t * g, d)


class QueryRecorder:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        window: int = 64,
        context: int = 0,
        dtype=torch.float32,
        stored_dtype=torch.bfloat16,
    ):
        self.num_layers, self.num_kv_heads, self.window, self.dtype = num_layers, num_kv_heads, window, dtype
        # the window and context queries are held for as long as the session lives, and only rank slots and
        # fit β and values: half precision halves what every session carries; they are handed out as ``dtype``
        self.stored_dtype = stored_dtype
        # the window as pieces (L, H, rows, D) for every layer at once, oldest first, joined only once they
        # hold 2R tokens: a decoded token costs one small copy, not a copy of the whole window. Never written
        # in place, so a tuple of them is a snapshot.
        self.recent: tuple[torch.Tensor, ...] = ()
        self._rows = 0  # rows the pieces hold
        self.captured: list[list[torch.Tensor]] | None = None
        self.frozen = False  # while True, the rolling window is left alone (scratch forwards)
        self.context_tokens = context  # per segment, keep about this many tokens' queries (0: off)
        self.context: dict[int, list[torch.Tensor | None]] = {}
        self.current_segment = -1
        self.groups: int | None = None  # G: query heads per KV head, known from the first recorded query

    @property
    def records(self) -> bool:
        """Whether forward passes should hand over their queries: for the window, a capture or the context."""
        return self.window > 0 or self.captured is not None or self.context_tokens > 0

    def set_window(self, window: int) -> None:
        """Keep the last ``window`` tokens' queries from now on (0: none, and the ones held go)."""
        self.window = window
        if window <= 0:
            self.recent, self._rows = (), 0

    def store(self, queries: torch.Tensor, segments: list[int] | None = None) -> None:
        """Keep the post-RoPE queries (L, Hq, T, D) of every layer for the tokens one forward ran: into the
        capture, the context (of ``current_segment``, or of each token's segment in ``segments``) and the
        window, grouped, cut and copied once for all layers."""
        groups = self.groups = queries.shape[1] // self.num_kv_heads
        keep_context = self.context_tokens and self.current_segment >= 0 and not self.frozen
        window = 0 if self.frozen else self.window
        if self.captured is None and not keep_context:
            if window <= 0:
                return
            queries = queries[:, :, -window:]  # only the tokens the window keeps
        grouped = group_queries(queries, self.num_kv_heads)
        if self.captured is not None:
            for layer, layer_queries in enumerate(grouped.to(self.dtype).unbind()):
                self.captured[layer].append(layer_queries)
        if keep_context:
            spans = segment_spans(segments) if segments is not None else [(self.current_segment, 0, queries.shape[2])]
            for layer, layer_queries in enumerate(grouped.to(self.stored_dtype).unbind()):
                for segment, first, end in spans:
                    self._keep_context(layer, layer_queries[:, first * groups : end * groups], groups, segment)
        if window <= 0:
            return
        keep_rows = window * groups
        piece = grouped[:, :, -keep_rows:].to(self.stored_dtype, copy=True)  # never a view of the pass's queries
        if piece.shape[2] == keep_rows:  # a whole window on its own (a prefill chunk)
            self.recent, self._rows = (piece,), keep_rows
        elif self._rows + piece.shape[2] >= 2 * keep_rows:
            self.recent, self._rows = (torch.cat((*self.recent, piece), dim=2)[:, :, -keep_rows:].clone(),), keep_rows
        else:
            self.recent, self._rows = (*self.recent, piece), self._rows + piece.shape[2]

    def _keep_context(self, layer: int, grouped: torch.Tensor, groups: int, segment: int) -> None:
        """Append to the segment's context queries; past 2N tokens, thin out to every other token."""
        store = self.context.setdefault(segment, [None] * self.num_layers)
        merged = grouped if store[layer] is None else torch.cat([store[layer], grouped], dim=1)
        tokens = merged.shape[1] // groups
        if tokens > 2 * self.context_tokens:
            h, _, d = merged.shape
            merged = merged.view(h, tokens, groups, d)[:, ::2].reshape(h, -1, d)
        store[layer] = merged

    def context_queries(self, segment_ids) -> list[torch.Tensor] | None:
        """Per layer (H, m, D) fp32 context queries of the given segments (None if none were kept)."""
        found = [self.context[i] for i in segment_ids if i in self.context and self.context[i][0] is not None]
        if not found:
            return None
        return [torch.cat([f[layer] for f in found], dim=1).to(self.dtype) for layer in range(self.num_layers)]

    def drop_context(self, segment_ids) -> None:
        """Forget the context queries of segments that are compacted (re-compaction uses the window)."""
        for i in segment_ids:
            self.context.pop(i, None)

    def nbytes(self) -> int:
        """Memory held by the recorded queries (window and context)."""
        tensors = list(self.recent)
        tensors += [q for store in self.context.values() for q in store if q is not None]
        return sum(q.numel() * q.element_size() for q in tensors)

    def shift(self, delta: int, inv_freq: torch.Tensor) -> None:
        """After a position rebase: re-rotate the window (its tokens all moved by ``delta``); context queries
        of older segments moved by different amounts and are dropped."""
        from kvmemory.cache.compact_layer import rotate, rotation_tables

        if self.recent:
            window = self.joined_window()
            moved = torch.full(window.shape[:3], delta, device=window.device)
            self.recent = (rotate(window, *rotation_tables(moved, inv_freq)),)
        self.context.clear()

    def window_queries(self, layer: int) -> torch.Tensor | None:
        """(H, ≤R·G, D) as ``dtype``: the queries of the last ``window`` tokens (fewer before that many have run)."""
        if not self.recent or self.groups is None or self.window <= 0:  # window 0: recording switched off
            return None
        return self.joined_window()[layer, :, -self.window * self.groups :].to(self.dtype)

    def joined_window(self) -> torch.Tensor:
        """The window's pieces as one (L, H, rows, D) tensor (joined once: the pieces become that one)."""
        if len(self.recent) > 1:
            self.recent = (torch.cat(self.recent, dim=2),)
        return self.recent[0]

    @property
    def has_window(self) -> bool:
        """Whether selector-window queries are there to use."""
        return bool(self.recent) and self.groups is not None and self.window > 0

    def start_capture(self) -> None:
        self.captured = [[] for _ in range(self.num_layers)]

    def stop_capture(self) -> list[torch.Tensor]:
        captured, self.captured = self.captured, None
        return [torch.cat(c, dim=1) if c else None for c in captured]

    def state(self):
        """What ``restore`` needs (tensors are never written in place, so references suffice)."""
        return self.recent, {k: list(v) for k, v in self.context.items()}, self.current_segment

    def restore(self, state) -> None:
        recent, context, self.current_segment = state
        self.recent, self.context = recent, {k: list(v) for k, v in context.items()}
        self._rows = sum(piece.shape[2] for piece in recent)


class HiddenRecorder:
    """Input hidden state of the last decoder layer for every position (fast counter-causal score). The
    engine's batcher hands each forward's states to the recorder of the session they belong to."""

    def __init__(self, dtype=torch.float32):
        self.store: dict[int, torch.Tensor] = {}
        self.dtype = dtype

    def record(self, positions: range, hidden: torch.Tensor) -> None:
        """``hidden`` (T, hidden size): the last layer's input for the tokens at ``positions`` (T of them)."""
        for pos, h in zip(positions, hidden.detach().to(self.dtype)):
            self.store[pos] = h.clone()

    def drop_from(self, position: int) -> None:
        for pos in [p for p in self.store if p >= position]:
            del self.store[pos]


class SurprisalRecorder:
    """Surprisal −log p(x_i | x_<i) in nats of every token as it enters the session, by logical position
    (NaN where unknown: the session's first token, or tokens appended before recording began).

    The values live in an fp32 ``array`` with room to grow, as the cache's rows do: a decoded token writes one
    value past the end, in plain Python (a torch write costs several operator calls, and this runs on every
    session's every token, with caches cold from the forward pass). ``values`` and ``state`` are tensor views
    of it; rows a snapshot (``state``) can see are never written again (an append below the furthest end a
    snapshot saw moves the values to a new array first)."""

    def __init__(self):
        self._buffer = array("f")
        self._length = 0
        self._shared = 0  # the furthest end any snapshot has seen: rows below it are read-only

    @property
    def values(self) -> torch.Tensor:
        """(tokens,) fp32, a view of the buffer."""
        if self._length == 0:
            return torch.empty(0)
        return torch.frombuffer(self._buffer, dtype=torch.float32, count=self._length)

    def record(self, start: int, values: Sequence[float]) -> None:
        """Surprisal of the tokens at ``start``, ``start + 1``, …; a NaN never hides a known value."""
        end = start + len(values)
        if start == self._length and start >= self._shared and end <= len(self._buffer):  # every decoded token
            self._buffer[start:end] = array("f", values)
            self._length = end
            return
        old = self._buffer[: self._length]
        merged = array("f", values)
        for i, known in enumerate(old[start:end]):
            if math.isnan(merged[i]):
                merged[i] = known
        gap = array("f", [math.nan]) * max(0, start - self._length)
        values = old[:start] + gap + merged + old[end:]
        self._buffer = values + array("f", [math.nan]) * (len(values) // 4 + 64)  # room to grow into
        self._length, self._shared = len(values), 0

    def drop_from(self, position: int) -> None:
        self._length = min(self._length, position)

    def state(self) -> torch.Tensor:
        self._shared = max(self._shared, self._length)
        return self.values

    def restore(self, state: torch.Tensor) -> None:
        """Back to a ``state`` (or a saved tensor of values): into a fresh array, which nothing else sees."""
        self._buffer = array("f", state.tolist())
        self._length, self._shared = len(self._buffer), 0


def surprisal_of(ids: list[int], before: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """−log p of each of ``ids`` from the logits before it: ``before`` (V,) for the first (None: unknown, NaN),
    then the pass's own rows ``logits`` (T, V). log-sum-exp minus the token's logit: no (T, V) softmax."""
    if before is None:
        first = torch.full((1,), float("nan"), device=logits.device)
    else:
        before = before.float()
        first = logsumexp_rows(before[None]) - before[ids[0]]
    if len(ids) == 1:  # a decode step: half the small ops, on every session's every token
        return first
    logits = logits[:-1].float()
    targets = torch.tensor(ids[1:], device=logits.device)
    rest = logsumexp_rows(logits) - logits.gather(1, targets[:, None])[:, 0]
    return torch.cat([first, rest])


def segment_spans(segments: list[int]) -> list[tuple[int, int, int]]:
    """(segment, first token, end token) of each run of tokens of one segment, in order."""
    spans: list[tuple[int, int, int]] = []
    for i, segment in enumerate(segments):
        if spans and spans[-1][0] == segment:
            spans[-1] = (segment, spans[-1][1], i + 1)
        else:
            spans.append((segment, i, i + 1))
    return spans
