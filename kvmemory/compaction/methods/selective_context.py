"""Selective context: keep the lines the model found hardest to predict.

Li, Dong, Guerin and Lin, "Compressing Context to Enhance Inference Efficiency of Large Language Models",
EMNLP 2023 (arXiv 2310.06201): a causal language model's self-information −log p(x | x<) says how much a
token tells that its context did not; lexical units are ranked by their mean self-information and the
least informative are dropped. Here the unit is a line of the span (a newline ends it, and so does
``max_unit_tokens``), the self-information is the session's own surprisal, recorded as tokens enter the
cache (no extra pass), and what is dropped is KV slots, not text.

Why it suits agent memory: a value read once (a port, a name, a bucket) was unpredictable when it was
read, and the rest of its line is the key a later question finds it by. Selectors that rank by the
attention of recent queries keep what the last turn looks at and lose such facts. Scores do not depend on
the queries or on the layer, so every head keeps the same tokens and a later compaction keeps a subset of
an earlier one's choice (nothing drifts over repeated compactions). Kept slots stay verbatim: fitting β to
the recent queries, as Attention Matching does, measured to push exactly these slots down.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, LayerResult, LayerSpan, MethodConfig
from kvmemory.compaction.eviction import ScoreEviction
from kvmemory.compaction.methods.counter_causal import PositionScores, span_positions
from kvmemory.compaction.registry import register
from kvmemory.errors import InvalidArgumentError


class SelectiveContextConfig(MethodConfig):
    max_unit_tokens: int = Field(64, ge=1, description="a line longer than this is ranked in pieces this long")
    evict_predictable_below: float | None = Field(
        None,
        ge=0,
        description="tokens the model predicted with less surprisal than this (nats) go before any line, "
        "newlines excepted: more lines keep their surprising tokens (None: lines stay whole)",
    )


def unit_scores(
    positions: torch.Tensor, surprisal: torch.Tensor, ends_line: torch.Tensor, max_unit_tokens: int
) -> torch.Tensor:
    """Mean surprisal of the unit each position belongs to.

    ``positions`` (n,) sorted logical positions; ``surprisal`` (n,) their surprisal, NaN where unknown (the
    mean skips them; a unit with none known scores the median of the others); ``ends_line`` (n,) True for a
    token whose text holds a newline (it ends its unit)."""
    n = positions.numel()
    unit = torch.zeros(n, dtype=torch.long)
    current, length = 0, 0
    for i, ends in enumerate(ends_line.tolist()):
        unit[i] = current
        length += 1
        if ends or length >= max_unit_tokens:
            current, length = current + 1, 0
    units = int(unit[-1]) + 1 if n else 0
    known = ~surprisal.isnan()
    total = torch.zeros(units).index_add_(0, unit[known], surprisal[known].float())
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


def line_surprisal(span: CacheSpan, max_unit_tokens: int, predictable_below: float | None = None) -> PositionScores:
    """Each span position ranked by the mean surprisal of its unit (higher is kept first; within a unit the
    earlier token first, so a partly kept line keeps its start). Raises if no surprisal was recorded."""
    positions = span_positions(span).cpu()
    recorded = span.surprisal if span.surprisal is not None else torch.empty(0)
    surprisal = torch.full(positions.shape, float("nan"))
    inside = positions < len(recorded)
    surprisal[inside] = recorded[positions[inside]].float()
    if bool(surprisal.isnan().all()):
        raise InvalidArgumentError(
            "selective_context ranks tokens by their recorded surprisal and none was recorded for this span: "
            "call session.record_surprisal() before appending (a memory manager whose policy uses the method "
            "switches it on when attached)"
        )
    texts = [span.text_of_token(span.token_of_position.get(p, -1)) for p in positions.tolist()]
    ends_line = torch.tensor(["\n" in text for text in texts], dtype=torch.bool)
    scores = unit_scores(positions, surprisal, ends_line, max_unit_tokens)
    rank = keep_order(scores, surprisal, ends_line, predictable_below)
    return PositionScores(positions, -rank.float())


@register
class SelectiveContext(ScoreEviction):
    """Selective context (Li et al., EMNLP 2023): keep the lines of highest mean surprisal, in every head."""

    name = "selective_context"
    Config = SelectiveContextConfig
    uses_queries = False
    global_scores = True

    @property
    def needs_surprisal(self) -> bool:
        return True

    def compact(self, span: CacheSpan, budgets: torch.Tensor) -> list[LayerResult]:
        self._scores = line_surprisal(span, self.config.max_unit_tokens, self.config.evict_predictable_below)
        return super().compact(span, budgets)

    def score(self, layer: LayerSpan, span: CacheSpan) -> torch.Tensor:
        return self._scores.score_slots(layer.positions.cpu()).to(layer.keys.device)
