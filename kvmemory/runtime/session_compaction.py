"""Compaction on a live session: gather a span's tensors, run a method on them, apply its plan.

This is where the runtime meets the pure methods (``kvmemory/compaction``): they see a ``CacheSpan`` of
tensors and a ``ModelView``, never the session. ``SessionCompaction`` is the Session's part that users
call (``compact``, ``apply_plan``); the memory manager runs jobs through ``SessionEdit.compact``.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable
from numbers import Integral

import torch

from kvmemory.cache import CompactionPlan
from kvmemory.cache.plan import pad_selection
from kvmemory.compaction.base import CompactionMethod
from kvmemory.compaction.head_budgets import uniform_budgets
from kvmemory.compaction.jobs import CompactionRecord, SpanJob
from kvmemory.compaction.planner import extract_span, span_slots, to_plan
from kvmemory.compaction.queries import QUERY_SOURCES
from kvmemory.compaction.registry import get_method
from kvmemory.compaction.solvers import attention_output_error
from kvmemory.errors import InvalidArgumentError
from kvmemory.runtime.model_view import SessionModelView
from kvmemory.runtime.recorders import QUERY_WINDOW
from kvmemory.runtime.reference_queries import reference_queries
from kvmemory.runtime.session_state import exclusive


class SessionCompaction:
    """Part of ``Session`` (``runtime/session.py``): compacting on request."""

    def apply_plan(self, plan: CompactionPlan) -> None:
        """Apply a compaction plan to the cache (validated first: a bad plan changes nothing). Allowed while
        a stream is open: this is how the memory manager makes room mid-reply."""
        with self.edit() as edit:
            edit.apply_plan(plan)

    @exclusive
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
        if method.uses_queries and not (self.query_recorder and self.query_recorder.window > 0):
            self.record_queries(QUERY_WINDOW)
        if method.needs_last_layer_inputs:
            self.record_last_layer_inputs()
        if method.needs_surprisal:
            self.record_surprisal()


def token_texts(tokenizer):
    """token id → its text, each id decoded once per span (text-aware methods ask per head and layer)."""
    if tokenizer is None:
        return lambda token: ""
    return functools.cache(lambda token: tokenizer.decode([token]) if token >= 0 else "")


def compact_span(
    session,
    positions: torch.Tensor,
    method: CompactionMethod | str,
    slots: int | torch.Tensor,
    query_source: str | list[str] = "window",
    protected_positions: set[int] | None = None,
    trigger: str = "manual",
    measure_error: bool = True,
) -> CompactionRecord:
    """Compact the slots holding ``positions`` to ``slots`` per head (int) or to an (L, H) budget tensor."""
    job = SpanJob(positions, method, slots, query_source, protected_positions)
    return compact_spans(session, [job], trigger, measure_error)[0]


def compact_spans(
    session, jobs: list[SpanJob], trigger: str = "manual", measure_error: bool = True
) -> list[CompactionRecord]:
    """Compact several disjoint spans in one plan, as one edit of the session (``SessionEdit.compact``)."""
    with session.edit() as edit:
        return edit.compact(jobs, trigger, measure_error)


def run_jobs(edit, jobs: list[SpanJob], trigger: str, measure_error: bool) -> list[CompactionRecord]:
    """Each span is selected and fitted against the cache as it is, then the cache is rebuilt once (a pass
    over many segments costs one rebuild, not one per segment)."""
    session = edit.session
    spans, drafts = [], []
    with torch.no_grad():
        for job in jobs:
            started = time.perf_counter()
            method = get_method(job.method) if isinstance(job.method, str) else job.method
            positions = torch.as_tensor(job.positions, dtype=torch.long)
            per_head, results, error, before, after = _select(session, positions, method, job, measure_error)
            spans.append((per_head, results))
            drafts.append((method.name, positions, before, after, error, time.perf_counter() - started))
        if not jobs:
            return []
        started = time.perf_counter()
        plan = session.engine.batcher.execute(to_plan, session.cache, spans, "+".join(sorted({d[0] for d in drafts})))
    edit.apply_plan(plan)
    shared = (time.perf_counter() - started) / len(jobs)  # the one rebuild, shared among the spans
    records = []
    for name, positions, before, after, error, seconds in drafts:
        ordered = torch.unique(positions)
        seg_ids = [
            s.id
            for s in session.segments
            if int(torch.searchsorted(ordered, s.end)) > int(torch.searchsorted(ordered, s.start))
        ]
        record = CompactionRecord(
            name, trigger, seg_ids, int(positions.numel()), round(before), round(after), (seconds + shared) * 1e3, error
        )
        edit.mark_compacted(seg_ids, record)
        records.append(record)
    return records


def _select(session, positions, method, job: SpanJob, measure_error: bool):
    """Run ``method`` on the span: (span slots, results, reconstruction error, slots before, slots after)."""
    engine, cache = session.engine, session.cache
    per_head = span_slots(cache, positions)
    capacity = torch.tensor([[s.numel() for s in layer] for layer in per_head])
    if isinstance(job.slots, int):
        budgets = uniform_budgets(job.slots * capacity.numel(), capacity)
    else:
        budgets = torch.minimum(job.slots.long(), capacity)
    head_limit = None
    if job.max_head_ratio is not None:
        head_limit = max(1, math.floor(job.max_head_ratio * float(budgets.float().mean())))
        budgets = budgets.clamp_max(head_limit)
    queries = reference_queries(session, job.query_source, positions) if method.uses_queries or measure_error else None
    span = extract_span(cache, per_head, queries, engine.head_dim**-0.5)
    span.token_of_position = {p: session.tokens[p] for p in positions.tolist()}
    span.text_of_token = token_texts(engine.tokenizer)
    span.model = SessionModelView.of(session)
    span.protected_positions = set(job.protected_positions or ())
    span.head_limit = head_limit
    if session.surprisal_recorder is not None:
        span.surprisal = session.surprisal_recorder.values
    span.query_group_size = engine.config.num_attention_heads // engine.num_kv_heads
    span.pause = engine.batcher.pause  # other sessions' passes run between the method's layers
    measure = measure_error and queries is not None
    # on the compute thread on CPU, the error too: heavy work here would take a core from the passes
    results, error = engine.batcher.execute(_compact_and_measure, method, span, budgets, measure)
    before = float(capacity.float().mean())
    after = float(torch.tensor([[k.numel() for k in r.keep] for r in results]).float().mean())
    return per_head, results, error, before, after


def _compact_and_measure(method: CompactionMethod, span, budgets: torch.Tensor, measure_error: bool):
    """The method's results, and the mean relative error of the span's attention output·mass on its
    reference queries after compaction (None unless ``measure_error``)."""
    results = method.compact(span, budgets)
    if not measure_error:
        return results, None
    errors = []
    for layer, res in zip(span.each_layer(), results):
        shift = None
        if res.bias is not None:
            index, _ = pad_selection(res.keep, layer.bias.device)
            shift = res.bias - torch.gather(layer.bias, 1, index)
        errors.append(attention_output_error(layer.logits(), layer.values, res.keep, shift, res.values))
    return results, float(sum(errors) / len(errors))
