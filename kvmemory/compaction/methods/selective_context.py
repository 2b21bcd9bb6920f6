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

from pydantic import Field

from kvmemory.compaction.base import CacheSpan, MethodConfig
from kvmemory.compaction.eviction import PositionEviction
from kvmemory.compaction.methods.lines import line_ranking, recorded_surprisal
from kvmemory.compaction.position_scores import PositionScores, span_positions
from kvmemory.compaction.registry import register


class SelectiveContextConfig(MethodConfig):
    max_unit_tokens: int = Field(64, ge=1, description="a line longer than this is ranked in pieces this long")
    evict_predictable_below: float | None = Field(
        None,
        ge=0,
        description="tokens the model predicted with less surprisal than this (nats) go before any line, "
        "newlines excepted: more lines keep their surprising tokens (None: lines stay whole)",
    )


def recorded_scores(span: CacheSpan) -> PositionScores:
    """Each span position's recorded surprisal (NaN where unknown); raises if none was recorded."""
    positions = span_positions(span).cpu()
    return PositionScores(positions, recorded_surprisal(span, positions, "selective_context"))


def line_surprisal(span: CacheSpan, max_unit_tokens: int, predictable_below: float | None = None) -> PositionScores:
    """Each span position ranked by the mean surprisal of its unit (higher is kept first; within a unit the
    earlier token first, so a partly kept line keeps its start). Raises if no surprisal was recorded."""
    return line_ranking(span, recorded_scores(span), max_unit_tokens, predictable_below, "selective_context")


@register
class SelectiveContext(PositionEviction):
    """Selective context (Li et al., EMNLP 2023): keep the lines of highest mean surprisal, in every head."""

    name = "selective_context"
    Config = SelectiveContextConfig
    uses_queries = False
    global_scores = True

    @property
    def needs_surprisal(self) -> bool:
        return True

    def position_scores(self, span: CacheSpan) -> PositionScores:
        return line_surprisal(span, self.config.max_unit_tokens, self.config.evict_predictable_below)
