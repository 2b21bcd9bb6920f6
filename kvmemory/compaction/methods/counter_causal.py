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

from dataclasses import dataclass

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, LayerSpan, MethodConfig
from kvmemory.compaction.eviction import ScoreEviction
from kvmemory.compaction.registry import register


class CounterCausalConfig(MethodConfig):
    fast: bool = Field(True, description="single-layer score from stored last-layer inputs (7-9x faster)")


@dataclass
class PositionScores:
    """A score per logical position, mapped onto any layer's slots."""

    positions: torch.Tensor  # (N,) sorted
    scores: torch.Tensor  # (N,)

    def score_slots(self, slot_positions: torch.Tensor) -> torch.Tensor:
        """(H, n) scores of the slots at these positions; −∞ for positions without a score (padding)."""
        if not hasattr(self, "_dense"):
            self._dense = torch.full((int(self.positions.max()) + 2,), float("-inf"))
            self._dense[self.positions] = self.scores.float()
        index = slot_positions.long().clamp(min=-1, max=len(self._dense) - 2)
        return self._dense[torch.where(index < 0, len(self._dense) - 1, index)]


def span_positions(span: CacheSpan) -> torch.Tensor:
    """Sorted logical positions held by any head of any layer (a max-scatter per layer: no sort of L·H·n)."""
    size = 1 + max(int(layer.positions.max()) for layer in span.layers)
    present = torch.zeros(size, dtype=torch.uint8, device=span.layers[0].positions.device)
    for layer in span.layers:
        present.scatter_reduce_(
            0, layer.positions.clamp_min(0).flatten(), layer.valid.flatten().to(torch.uint8), "amax"
        )
    return torch.nonzero(present).flatten()


def surprise_scores(span: CacheSpan, fast: bool) -> PositionScores:
    """Surprise (−z) per span position; the cache's last token, which has no future, scores +∞."""
    positions = span_positions(span)
    scores = -span.model.own_token_logits(positions, fast, span.pause).cpu()
    last = span.model.logical_length - 1
    scores = torch.where(positions.cpu() == last, torch.full_like(scores, float("inf")), scores)
    return PositionScores(positions.cpu(), scores)


@register
class CounterCausal(ScoreEviction):
    """Counter-causal surprise (Gould & van den Hengel, arXiv 2607.27600): keep the tokens the later
    context cannot predict, scored by re-reading each token with the opposite mask."""

    name = "counter_causal"
    Config = CounterCausalConfig
    uses_queries = False

    @property
    def needs_last_layer_inputs(self) -> bool:
        return self.config.fast

    def compact(self, span: CacheSpan, budgets: torch.Tensor):
        self._scores = surprise_scores(span, self.config.fast)
        return super().compact(span, budgets)

    def score(self, layer: LayerSpan, span: CacheSpan) -> torch.Tensor:
        return self._scores.score_slots(layer.positions.cpu()).to(layer.keys.device)
