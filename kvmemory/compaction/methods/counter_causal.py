"""Counter-causal surprise: keep the tokens the future cannot predict.

Gould & van den Hengel, "Back from the Future: Key-Value Cache Management by Counter-Causal Surprise",
arXiv 2607.27600 (2026). Each cached token is re-read with the opposite mask — it may attend only to
strictly later slots, whose keys and values are the cached ones — and the LM head's logit of its own
id, z_i[x_i], says how predictable it is from the future. Low logit = surprising = kept. One keep-set
for all layers and heads.

The method ranks; the re-read itself runs where the model is, in the runtime
(``runtime/model_view.py``), and reaches the method as ``CacheSpan.model.own_token_logits``.
``fast`` scores with the last layer only, from its stored inputs (``Session.record_last_layer_inputs``,
switched on when a method that needs it is attached); a span with positions appended before that gets
the full score.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, MethodConfig
from kvmemory.compaction.eviction import PositionEviction
from kvmemory.compaction.position_scores import PositionScores, span_positions
from kvmemory.compaction.registry import register


class CounterCausalConfig(MethodConfig):
    fast: bool = Field(True, description="single-layer score from stored last-layer inputs (7-9x faster)")


def surprise_scores(span: CacheSpan, fast: bool) -> PositionScores:
    """Surprise (−z) per span position; the cache's last token, which has no future, scores +∞."""
    positions = span_positions(span)
    scores = -span.model.own_token_logits(positions, fast, span.pause).cpu()
    last = span.model.logical_length - 1
    scores = torch.where(positions.cpu() == last, torch.full_like(scores, float("inf")), scores)
    return PositionScores(positions.cpu(), scores)


@register
class CounterCausal(PositionEviction):
    """Counter-causal surprise (Gould & van den Hengel, arXiv 2607.27600): keep the tokens the later
    context cannot predict, scored by re-reading each token with the opposite mask."""

    name = "counter_causal"
    Config = CounterCausalConfig
    uses_queries = False

    @property
    def needs_last_layer_inputs(self) -> bool:
        return self.config.fast

    def position_scores(self, span: CacheSpan) -> PositionScores:
        return surprise_scores(span, self.config.fast)
