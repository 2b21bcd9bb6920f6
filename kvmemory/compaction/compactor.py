"""Compact part of a live session with a method: span → reference queries → method → plan → cache.

This is the one place that connects the runtime (session, cache, model) to the pure methods.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, dataclass

import torch

from kvmemory.cache.plan import pad_selection
from kvmemory.compaction.base import CompactionMethod, ModelAccess
from kvmemory.compaction.head_budgets import uniform_budgets
from kvmemory.compaction.planner import extract_span, span_slots, to_plan
from kvmemory.compaction.queries import reference_queries
from kvmemory.compaction.registry import get_method
from kvmemory.compaction.solvers import attention_output_error


@dataclass
class CompactionRecord:
    """What one compaction did (kept in ``session.compaction_log``)."""

    method: str
    trigger: str
    segments: list[int]
    tokens: int
    slots_before: int  # physical slots of the span per head (mean over layers and heads)
    slots_after: int
    milliseconds: float
    reconstruction_error: float | None  # relative error of span output·mass on the reference queries

    def to_dict(self) -> dict:
        return asdict(self)


def token_texts(tokenizer):
    """token id → its text, each id decoded once per span (text-aware methods ask per head and layer)."""
    if tokenizer is None:
        return lambda token: ""
    return functools.cache(lambda token: tokenizer.decode([token]) if token >= 0 else "")


@dataclass
class SpanJob:
    """One span to compact: its logical positions, the method, and slots per head (int) or an (L, H) budget."""

    positions: torch.Tensor
    method: CompactionMethod | str
    slots: int | torch.Tensor
    query_source: str | list[str] = "window"
    protected_positions: set[int] | None = None
    # uneven head budgets: no head keeps more than this many times the span's mean budget (None: no bound)
    max_head_ratio: float | None = None


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
    """Compact several disjoint spans in one plan: each span is selected and fitted against the cache as it
    is, then the cache is rebuilt once (a pass over many segments costs one rebuild, not one per segment)."""
    session.check_open()
    cache = session.cache
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
        plan = session.engine.batcher.execute(to_plan, cache, spans, "+".join(sorted({d[0] for d in drafts})))
    session.apply_plan(plan)
    shared = (time.perf_counter() - started) / len(jobs)  # the one rebuild, shared among the spans
    records = []
    for name, positions, before, after, error, seconds in drafts:
        ordered = torch.unique(positions)
        seg_ids = [
            s.id
            for s in session.segments
            if int(torch.searchsorted(ordered, s.end)) > int(torch.searchsorted(ordered, s.start))
        ]
        compacted = set(seg_ids)
        session.segments = [
            s.replaced(compactions=s.compactions + 1) if s.id in compacted else s for s in session.segments
        ]
        if session.query_recorder is not None:
            for i in seg_ids:
                session.query_recorder.context.pop(i, None)
        record = CompactionRecord(
            name, trigger, seg_ids, int(positions.numel()), round(before), round(after), (seconds + shared) * 1e3, error
        )
        session.compaction_log.append(record.to_dict())
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
    span.model = ModelAccess.from_session(session)
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
