"""The Session's forward and its undo: tokens run into the cache chunk by chunk (room made before each), and
cut back again (truncation, the transcript shared with snapshots, RoPE rebase, scratch forwards)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from kvmemory.errors import ContextLengthError, InvalidArgumentError
from kvmemory.runtime.batching import ForwardRequest
from kvmemory.runtime.recorders import surprisal_of
from kvmemory.runtime.segments import Segment
from kvmemory.runtime.session_state import exclusive

ProgressCallback = Callable[[int, int], None]


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


class SessionForward:
    """Part of ``Session`` (``runtime/session.py``): running tokens into the cache, and cutting them back."""

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
        return (self.cache.longest_head if self.cache.layers[0].is_initialized else 0) + len(self._pending) + n_new

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
            self._publish_stats(now=total > step)
            chunk = ids[done : done + step]
            self._make_room(len(chunk))
            self._forward(chunk, segment_id, positions_from=len(self.tokens), finish_by=finish_by)
            self.tokens.extend(chunk)
            self._replace_segment(segment_id, end=len(self.tokens))
            self._turn_prefilled += len(chunk)
            done += len(chunk)
            if progress is not None:
                progress(done, total)
        return self.segment(segment_id)

    def _prefill_messages(self, pieces: list[tuple[int, list[int]]], progress, make_segment) -> list[int]:
        """Prefill several short messages in one pass: a conversation of a thousand short messages would
        otherwise cost a thousand passes, each a whole read of the weights. ``pieces``: (the message's index,
        its token ids), together at most one prefill chunk; ``make_segment(index)`` opens each message's segment.
        The cache makes room for all of them first; then each token is written with its own segment. Returns
        the segments' ids, in order."""
        self._flush_pending()
        ids = [t for _, piece in pieces for t in piece]
        self._make_room(len(ids))
        self._publish_stats()
        start, made, segments = len(self.tokens), [], []
        for index, piece in pieces:
            segment = make_segment(index)
            self.tokens.extend(piece)
            self._replace_segment(segment.id, end=len(self.tokens))
            made.append(segment.id)
            segments += [segment.id] * len(piece)
        self._forward(ids, made[-1], positions_from=start, segments=segments)
        self._turn_prefilled += len(ids)
        if progress is not None:
            progress(len(ids), len(ids))
        return made

    def _make_room(self, n_new: int) -> None:
        """Let the memory compact so that ``n_new`` tokens fit its cap; the rows it says the cache may still
        reserve past them bound the cache's growth (so a grown buffer never passes the cap)."""
        if self.memory is not None:
            room = self.memory.make_room(n_new)
            if room is not None:
                self.cache.growth_room = room

    def _flush_pending(self, pick: Callable[[torch.Tensor], int] | None = None) -> int | None:
        """Run sampled-but-unprocessed tokens through the model (they belong to the last segment); with
        ``pick``, the next token picked from the last logits where the model runs (None when nothing ran)."""
        if not self._pending:
            return None
        ids, seg_id = self._pending, self.segments[-1].id
        self._make_room(len(ids))
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
        segments: list[int] | None = None,
    ) -> torch.Tensor:
        """Run ``ids`` through the model at ``positions_from`` into the cache (``finish_by``: the place of the
        prefill they belong to, ``ForwardRequest.finish_by``; by default a prefill of their own; ``segments``:
        each token's segment where they are several). Callers own the rollback (``_atomic`` or ``scratch``)."""
        logits, _ = self._forward_then(
            ids, segment_id, positions_from, all_logits, finish_by=finish_by, segments=segments
        )
        return logits

    def _forward_then(
        self,
        ids: list[int],
        segment_id: int,
        positions_from: int,
        all_logits: bool = False,
        pick: Callable[[torch.Tensor], int] | None = None,
        finish_by: int | None = None,
        segments: list[int] | None = None,
    ) -> tuple[torch.Tensor, int | None]:
        """``_forward``, and with ``pick`` the next token picked from the last logits. Both that and the
        tokens' surprisal run where the model runs, in the pass's own hand-over (``ForwardRequest.after``)."""
        engine = self.engine
        if (
            segment_id >= 0
            and engine.rebase_positions
            and self.cache.rope_length + len(ids) > engine.rebase_at
            and self.cache.rope_length > self.cache.slots_per_head + len(ids)
        ):  # only when there are gaps to close
            self._rebase()
        recording, before = self._records_surprisal(segment_id), self._last_logits
        queries = self.query_recorder if self.query_recorder is not None and self.query_recorder.records else None

        def after(logits: torch.Tensor) -> tuple[list[float] | None, int | None]:
            surprisal = surprisal_of(ids, before, logits).tolist() if recording else None
            return surprisal, None if pick is None else pick(logits[-1])

        request = ForwardRequest(
            self.cache,
            ids,
            positions_from,
            segment_id,
            all_logits or recording,
            queries,
            self.hidden_recorder,
            after if recording or pick is not None else None,
            finish_by=engine.batcher.due(len(ids)) if finish_by is None else finish_by,
            segments=segments,
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

    @exclusive
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

    @exclusive
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
