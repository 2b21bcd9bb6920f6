"""Lines: any method's ranking, applied to whole lines and shared by every head, with a surprise floor.

What made the default policy keep an agent's single-mention facts (``benchmarks/agent_memory.py``) is not
its score alone but three structural choices, here as one wrapper around any method that ranks positions
(``CompactionMethod.position_scores``):

* **line granularity**: a unit is a line of the span (a newline ends it, so does ``max_unit_tokens``),
  scored by the mean of the inner method's scores over its tokens, so a value is kept with the key a later
  question finds it by (``port = 8443``, not ``8443`` alone);
* **a surprise floor**: tokens the model predicted at under ``evict_predictable_below`` nats (the session's
  own recorded surprisal; newlines excepted) go before any line, so more lines keep their surprising parts;
* **one ranking for every head and segment**: the same tokens in every head (so a later compaction keeps a
  subset of an earlier one's choice and the gaps can be closed) and one selection across segments.

``Lines(CounterCausal())`` is counter-causal surprise by line; ``Lines(SnapKV())`` ranks lines by the heads'
consensus on recent attention; ``selective_context`` is lines over the recorded surprisal. Run it under
REAL's head budgets (``REAL(inner=Lines(...))``) and fit β and values on its choice with ``Fitted``.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, MethodConfig
from kvmemory.compaction.eviction import PositionEviction
from kvmemory.compaction.position_scores import PositionScores
from kvmemory.compaction.registry import register
from kvmemory.compaction.wrapper import Wrapper
from kvmemory.errors import InvalidArgumentError


class LinesConfig(MethodConfig):
    inner: str = Field("counter_causal", description="the method whose position scores rank the lines")
    inner_params: dict = Field(default_factory=dict)
    max_unit_tokens: int = Field(64, ge=1, description="a line longer than this is ranked in pieces this long")
    evict_predictable_below: float | None = Field(
        1.0,
        ge=0,
        description="tokens the model predicted with less surprisal than this (nats) go before any line, "
        "newlines excepted (None: lines stay whole)",
    )


def unit_scores(
    positions: torch.Tensor, scores: torch.Tensor, ends_line: torch.Tensor, max_unit_tokens: int
) -> torch.Tensor:
    """Mean score of the unit each position belongs to.

    ``positions`` (n,) sorted logical positions; ``scores`` (n,) their scores, NaN where unknown (the mean
    skips them; a unit with none known scores the median of the others); ``ends_line`` (n,) True for a token
    whose text holds a newline (it ends its unit)."""
    n = positions.numel()
    unit = torch.zeros(n, dtype=torch.long)
    current, length = 0, 0
    for i, ends in enumerate(ends_line.tolist()):
        unit[i] = current
        length += 1
        if ends or length >= max_unit_tokens:
            current, length = current + 1, 0
    units = int(unit[-1]) + 1 if n else 0
    known = ~scores.isnan()
    total = torch.zeros(units).index_add_(0, unit[known], scores[known].float())
    count = torch.zeros(units).index_add_(0, unit[known], torch.ones(int(known.sum())))
    mean = total / count.clamp_min(1)
    if bool((count == 0).any()):
        mean[count == 0] = mean[count > 0].median()
    return mean[unit]


def keep_order(
    scores: torch.Tensor, surprisal: torch.Tensor, ends_line: torch.Tensor, predictable_below: float | None
) -> torch.Tensor:
    """Rank of each position in the order of keeping (0 is kept first): by unit score, within a tie the
    earlier position first; with ``predictable_below``, the predictable tokens (not newlines) rank last."""
    order = torch.argsort(-scores, stable=True)  # positions ascend: within a tie the earlier token comes first
    if predictable_below is not None:
        predictable = (surprisal < predictable_below) & ~ends_line  # NaN (unknown) is never predictable
        order = order[torch.argsort(predictable[order].int(), stable=True)]
    rank = torch.empty_like(order)
    rank[order] = torch.arange(len(order))
    return rank


def recorded_surprisal(span: CacheSpan, positions: torch.Tensor, needed_by: str) -> torch.Tensor:
    """(n,) the session's recorded surprisal of each position (NaN where unknown); raises if none was recorded."""
    recorded = span.surprisal if span.surprisal is not None else torch.empty(0)
    surprisal = torch.full(positions.shape, float("nan"))
    inside = positions < len(recorded)
    surprisal[inside] = recorded[positions[inside]].float()
    if bool(surprisal.isnan().all()):
        raise InvalidArgumentError(
            f"{needed_by} uses each token's recorded surprisal and none was recorded for this span: call "
            "session.record_surprisal() before appending (a memory manager whose policy uses the method switches "
            "it on when attached)"
        )
    return surprisal


def line_ranking(
    span: CacheSpan, tokens: PositionScores, max_unit_tokens: int, predictable_below: float | None, needed_by: str
) -> PositionScores:
    """Each position ranked by the mean of ``tokens``' scores over its unit (higher is kept first; within a unit
    the earlier token first, so a partly kept line keeps its start); with ``predictable_below``, the tokens
    the model predicted at under that surprisal last."""
    positions = tokens.positions.cpu()
    texts = [span.text_of_token(span.token_of_position.get(p, -1)) for p in positions.tolist()]
    ends_line = torch.tensor(["\n" in text for text in texts], dtype=torch.bool)
    scores = unit_scores(positions, tokens.scores.float().cpu(), ends_line, max_unit_tokens)
    surprisal = torch.full(positions.shape, float("nan"))
    if predictable_below is not None:
        surprisal = recorded_surprisal(span, positions, needed_by)
    rank = keep_order(scores, surprisal, ends_line, predictable_below)
    return PositionScores(positions, -rank.float())


@register
class Lines(Wrapper, PositionEviction):
    """Any method's position ranking by whole lines, with a surprise floor, the same in every head (see the
    module docstring): ``Lines(CounterCausal())`` or ``get_method("lines", inner="tam")``."""

    name = "lines"
    Config = LinesConfig
    global_scores = True  # one ranking of the span's positions: a selection may span many segments

    @property
    def needs_surprisal(self) -> bool:
        return self.config.evict_predictable_below is not None or self.inner.needs_surprisal

    def position_scores(self, span: CacheSpan) -> PositionScores:
        cfg = self.config
        tokens = self.inner.position_scores(span)
        return line_ranking(span, tokens, cfg.max_unit_tokens, cfg.evict_predictable_below, f"lines({cfg.inner})")
