"""Continuous batching: the forward passes of concurrent sessions run as one packed pass.

Every forward a session needs (a decode step, a prefill chunk, a scratch forward for scoring) becomes a
``ForwardRequest`` queued on the engine's ``ForwardBatcher``. Whichever thread finds the engine idle runs
everything queued as one forward: the new tokens of all requests are packed into one sequence, so the
linear layers read the weights once for all of them, while attention runs per request over that
session's own compacted cache (its own length, β and per-head padding; nothing is copied or padded to a
common shape). Sessions join and leave between passes; a request that arrives while a pass runs goes
into the next one, so a lone session runs exactly as it would unbatched.

A pass that fails is undone for every request in it (each cache and recorder is put back) and, when it
held several requests, each is retried alone, so one session's failure never becomes another's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from kvmemory.attention import decode_kernel
from kvmemory.cache import CompactCache
from kvmemory.runtime import compute
from kvmemory.runtime.forward import forward_for
from kvmemory.runtime.recorders import HiddenRecorder, QueryRecorder


@dataclass(eq=False)
class ForwardRequest:
    """New tokens for one session's cache, at transcript positions ``start``, ``start + 1``, …"""

    cache: CompactCache
    ids: list[int]
    start: int
    segment_id: int  # the tokens' segment (the last one's, where ``segments`` gives each its own)
    all_logits: bool = False
    query_recorder: QueryRecorder | None = None
    hidden_recorder: HiddenRecorder | None = None
    # work on this request's logits that belongs where the model runs (surprisal, sampling): run right after
    # the pass, so a decoded token costs one hand-over to the compute thread, not three
    after: Callable[[torch.Tensor], Any] | None = None
    # prefill order: the tokens the engine will have run when this request's prefill (all its chunks) is done,
    # were it to run alone from when it began (``ForwardBatcher.due``); passes take the least first
    finish_by: int = 0
    segments: list[int] | None = None  # each token's segment, for a pass over several short segments at once
    logits: torch.Tensor | None = None  # (T, V) with all_logits, else (1, V)
    outcome: Any = None  # what ``after`` returned
    error: BaseException | None = None
    done: bool = False

    @property
    def positions(self) -> range:
        return range(self.start, self.start + len(self.ids))

    def checkpoint(self):
        """What ``rollback`` needs to undo this request's part of a failed pass (references, no copies).
        Last-layer inputs need no undo: a retry records the same states at the same positions."""
        queries = self.query_recorder.state() if self.query_recorder is not None else None
        return self.cache.snapshot(), queries

    def rollback(self, checkpoint) -> None:
        cache, queries = checkpoint
        self.cache.restore(cache)
        if queries is not None:
            self.query_recorder.restore(queries)


class PackedCache(Cache):
    """The caches of one packed pass: each request's slice of the new keys and values goes to its own
    cache, and attention gets one (keys, values) pair per request (see ``kvmemory_attention``).

    A decode step of sessions whose attention runs on the CPU decode kernel (``attention_path`` None, one
    token each, storage already held) writes nothing here: each cache only counts its new row
    (``CompactCache.claim``), and ``new_rows`` hands the keys, values and metadata to the kernel, which
    writes them as it attends. That saves a dozen small tensor operations per session and layer."""

    is_compileable = False

    def __init__(self, requests: list[ForwardRequest], attention_path: str | None = None):
        super().__init__(layers=requests[0].cache.layers)  # transformers only asks these for their kind
        self.requests = requests
        bounds = [0]
        for request in requests:
            bounds.append(bounds[-1] + len(request.ids))
        self.bounds = list(zip(bounds[:-1], bounds[1:]))
        self.kernel_writes = attention_path is None and all(
            len(r.ids) == 1 and r.cache.layers[0].is_initialized for r in requests
        )
        self.new_rows = None  # (layer index, keys, values, metadata rows) the kernel is to write
        self._new_meta = None
        self.recording = any(r.query_recorder is not None for r in requests)
        self.queries: list[torch.Tensor] = []  # per layer, the pass's queries (record_queries)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if self.kernel_writes and decode_kernel.usable(key_states) and value_states.shape[-1] % 8 == 0:
            if self._new_meta is None:  # the first layer claims a row in every layer; the rows are the same
                self._new_meta = torch.cat([request.cache.claim(1) for request in self.requests])
            self.new_rows = (layer_idx, key_states, value_states, self._new_meta)
            return None, None
        keys, values = [], []
        for request, (start, end) in zip(self.requests, self.bounds):
            k, v = request.cache.update(key_states[:, :, start:end], value_states[:, :, start:end], layer_idx)
            keys.append(k)
            values.append(v)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly; there is no one length for a packed pass

    def attention_parts(self, layer_idx: int):
        """Per request: its span of the packed queries and its cache layer (for β)."""
        return [(start, end, r.cache.layers[layer_idx]) for r, (start, end) in zip(self.requests, self.bounds)]

    def record_queries(self, query: torch.Tensor) -> None:
        """Keep a layer's post-RoPE queries (1, Hq, T, D) of the whole pass, for the requests' query recorders
        (``store_queries``, once the pass has run). Every layer calls it, in order."""
        if self.recording:
            self.queries.append(query.detach())

    def store_queries(self) -> None:
        """Hand each request's query recorder its tokens' queries of every layer: one (L, Hq, T, D) slice each."""
        if not self.queries:
            return
        stacked = torch.cat(self.queries)
        for request, (start, end) in zip(self.requests, self.bounds):
            if request.query_recorder is not None:
                request.query_recorder.store(stacked[:, :, start:end], request.segments)


@dataclass
class BatchStats:
    """Counters of the passes run so far (what ``Engine.stats()`` reports)."""

    passes: int = 0
    requests: int = 0
    tokens: int = 0
    largest: int = 0  # most requests in one pass
    retried: int = 0  # failed passes retried request by request
    sizes: dict[int, int] = field(default_factory=dict)  # requests per pass -> passes
    # seconds spent running passes, each from its hand-over to where the model runs to its end (the sampling
    # after it included): over a stretch of wall time, the rest is the engine waiting for its sessions
    busy_seconds: float = 0.0

    def count(self, batch: list[ForwardRequest]) -> None:
        self.passes += 1
        self.requests += len(batch)
        self.tokens += sum(len(r.ids) for r in batch)
        self.largest = max(self.largest, len(batch))
        self.sizes[len(batch)] = self.sizes.get(len(batch), 0) + 1


class ForwardBatcher:
    """Runs queued forward requests as packed passes, one pass at a time (see the module docstring).

    ``max_tokens`` bounds the new tokens of one pass (a request is never split: a longer one runs alone). An
    engine on a CPU sets it to one prefill chunk and 128 more tokens (decode steps, short messages): prefill
    there is multiply-add bound, so chunks packed together run no faster than one by one, and each would finish
    with the last (see ``_take``); elsewhere 2048, where wider passes use the device better.
    After a pass, the next one waits briefly for the sessions that were in it, which are sampling their
    next token, so that concurrent decoders stay in step instead of splitting into groups that alternate:
    at most ``max_gather_seconds`` and half the last pass's time, and not at all once they are all back.
    A request that finds the engine idle waits likewise (at most ``max_gather_seconds``) for the sessions
    that are inside a decode step (``expecting``) and about to queue theirs, so that sessions starting a
    reply together share their first pass instead of one of them running it alone.
    """

    def __init__(self, model, max_tokens: int = 2048, max_gather_seconds: float = 0.1, attention_path=None):
        self.device = next(model.parameters()).device  # read once: execute() runs on every decode step
        self.attention_path = attention_path
        self.max_tokens = max_tokens
        self.max_gather_seconds = max_gather_seconds
        self.stats = BatchStats()
        self._queue: list[ForwardRequest] = []
        self._busy = False
        self._returning: set[int] = set()  # caches of the last pass that have not queued again
        self._gather_until = 0.0
        self._gathering = False  # one waiting thread gathers the next pass; the others wait for passes to end
        self._expected = 0  # threads inside ``expecting`` without a request queued
        self._starting = False  # the pass being gathered starts on an idle engine: it waits for the expected
        self._decoders = threading.local()  # per thread: how deep in ``expecting`` blocks
        lock = threading.Lock()
        self._pass_ended = threading.Condition(lock)
        self._arrived = threading.Condition(lock)  # the gatherer's: a request was queued
        self.forward = forward_for(model)

    def run(self, request: ForwardRequest) -> torch.Tensor:
        """Queue ``request``, take part in passes until it has run (``after`` too), and return its logits.

        Waking a thread costs a hand-over of the GIL, and eight sessions between two passes would otherwise
        wake each other dozens of times: an arrival wakes only the thread gathering the next pass, and the
        end of a pass wakes the threads waiting on it."""
        decoding = getattr(self._decoders, "depth", 0) > 0
        with self._pass_ended:
            self._queue.append(request)
            self._returning.discard(id(request.cache))
            self._expected -= decoding
            self._arrived.notify()
            try:
                self._take_part(request)
            finally:
                self._expected += decoding
        if request.error is not None:
            raise request.error
        return request.logits

    def _take_part(self, request: ForwardRequest) -> None:
        """Under the lock: wait, gather or run passes until ``request`` is done."""
        now = time.perf_counter()
        if not self._busy and not self._starting and self._expected and now > self._gather_until:  # idle engine
            self._starting, self._returning = True, set()  # the last pass's sessions are gone or back
            self._gather_until = now + self.max_gather_seconds
        while not request.done:
            if self._busy:
                self._pass_ended.wait()
                continue
            wait = self._gather_until - time.perf_counter()
            if (self._returning or self._starting and self._expected) and wait > 0:
                if self._gathering:
                    self._pass_ended.wait(wait)  # bounded: however the gathering ends, the pass starts by then
                else:
                    self._gather(wait)
                    if request.done:  # it ran in another thread's pass meanwhile: whoever waited on this
                        self._pass_ended.notify()  # thread's gathering takes it over (this one leaves)
                continue
            batch = self._take()
            self._busy, self._starting = True, False
            self._pass_ended.release()
            started = time.perf_counter()
            try:
                self.execute(self._run, batch)
            finally:
                self._pass_ended.acquire()
                self._busy = False
                now = time.perf_counter()
                self.stats.busy_seconds += now - started
                self._returning = {id(r.cache) for r in batch}
                self._gather_until = now + min(self.max_gather_seconds, (now - started) / 2)
                self._pass_ended.notify_all()

    @contextmanager
    def expecting(self) -> Iterator[None]:
        """Within the block this thread is decoding: whenever it has no request queued, one is on its way,
        and a pass that starts on an idle engine waits for it (see the class docstring). Blocks nest."""
        depth = getattr(self._decoders, "depth", 0)
        if depth == 0:
            with self._pass_ended:
                self._expected += 1
        self._decoders.depth = depth + 1
        try:
            yield
        finally:
            self._decoders.depth = depth
            if depth == 0:
                with self._pass_ended:
                    self._expected -= 1
                    self._arrived.notify()

    def _gather(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the next arrival, as the one thread gathering the next pass (whoever
        then finds the pass ready runs it). Interrupted, it hands the gathering to a thread still waiting."""
        self._gathering = True
        try:
            self._arrived.wait(seconds)
        except BaseException:
            self._pass_ended.notify()
            raise
        finally:
            self._gathering = False

    def execute(self, fn, *args):
        """``fn(*args)`` where this model's kernels run best: the compute thread on CPU (see
        ``kvmemory.runtime.compute``), the calling thread on an accelerator."""
        return compute.run_on(self.device, fn, *args)

    def pause(self) -> None:
        """Called between the pieces of a long job given to ``execute`` (a compaction, layer by layer): the
        passes queued meanwhile run now, so the other sessions wait for one piece, not the whole job."""
        compute.pause()

    def due(self, tokens: int) -> int:
        """``ForwardRequest.finish_by`` for a prefill of ``tokens`` beginning now."""
        return self.stats.tokens + tokens

    def _take(self) -> list[ForwardRequest]:
        """The oldest queued requests whose tokens fit in one pass (at least one), the prefill chunks among
        them in order of ``finish_by`` instead of arrival.

        Prefill is multiply-add bound: packing several sessions' chunks into a pass runs no faster than
        running them one after another, but every one of them finishes when the last does. Taken in order of
        ``finish_by``, the prefills that began together finish shortest first (what lowers the mean time to
        first token most), and one that began earlier is overtaken only by prefills shorter than what it had
        left (none waits forever)."""
        prefills = [i for i, r in enumerate(self._queue) if len(r.ids) > 1]
        ordered = sorted((self._queue[i] for i in prefills), key=lambda r: r.finish_by)  # stable: ties by arrival
        for i, request in zip(prefills, ordered):
            self._queue[i] = request
        batch, tokens = [], 0
        while self._queue and (not batch or tokens + len(self._queue[0].ids) <= self.max_tokens):
            tokens += len(self._queue[0].ids)
            batch.append(self._queue.pop(0))
        return batch

    def _run(self, batch: list[ForwardRequest]) -> None:
        """Run one pass; on failure undo it and retry each request alone (a lone request's own session
        undoes what it began)."""
        checkpoints = [r.checkpoint() for r in batch] if len(batch) > 1 else []
        try:
            self._forward(batch)
        except BaseException as error:
            for request, checkpoint in zip(batch, checkpoints):
                request.rollback(checkpoint)
            if len(batch) > 1 and isinstance(error, Exception):
                self.stats.retried += 1
                for request in batch:
                    self._run([request])
                return
            for request in batch:
                request.error, request.done = error, True
            if not isinstance(error, Exception):  # an interrupt: every waiter gets it, and so does this thread
                raise
            return
        interrupt = None
        for request in batch:
            try:
                if request.after is not None:
                    request.outcome = request.after(request.logits)
            except Exception as error:  # this request's own: the others in the pass are unaffected
                request.error = error
            except BaseException as error:  # an interrupt (where the caller's thread runs passes): raised once
                request.error = interrupt = error  # every request is done, so no waiter is left behind
            request.done = True
        if interrupt is not None:
            raise interrupt

    def _forward(self, batch: list[ForwardRequest]) -> None:
        cache = PackedCache(batch, self.attention_path)
        device = self.device
        input_ids = torch.tensor([[t for r in batch for t in r.ids]], device=device)
        if len(batch) == 1:
            keep = 0 if batch[0].all_logits else 1
        else:
            rows = [range(start if r.all_logits else end - 1, end) for r, (start, end) in zip(batch, cache.bounds)]
            keep = torch.tensor([i for span in rows for i in span], device=device)
        ropes = []  # each token's RoPE position, which its cache knows (below its position once gaps are closed)
        for request in batch:
            segments = request.segment_id if request.segments is None else request.segments
            first = request.cache.begin_append(request.start, len(request.ids), segments, device)
            ropes.extend(range(first, first + len(request.ids)))
            if request.query_recorder is not None:
                request.query_recorder.current_segment = request.segment_id
        recording = [(r, s, e) for r, (s, e) in zip(batch, cache.bounds) if r.hidden_recorder is not None]
        rope = torch.tensor([ropes], device=device)
        with torch.no_grad():
            logits = self.forward(input_ids, rope, cache, keep, self.attention_path, recording)
        cache.store_queries()  # only once the pass has run: a failed pass records nothing
        start = 0
        for request in batch:
            rows = len(request.ids) if request.all_logits else 1
            request.logits = logits[start : start + rows]
            start += rows
        self.stats.count(batch)
