"""One score per logical position, the same in every head: what wrappers that keep the same tokens in every
head (``Lines``) rank by, and how a method that scores per head (attention, key norms) gives one.

A method exposes it as ``CompactionMethod.position_scores(span)``. Scores per position make a selection that
every layer and head shares, so a later compaction keeps a subset of an earlier one's choice and the gaps it
leaves can be closed (``MemoryBudget.close_gaps``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmemory.compaction.base import CacheSpan, LayerSpan


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
        index = slot_positions.long().cpu().clamp(min=-1, max=len(self._dense) - 2)
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


def head_ranks(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(H, n) each valid slot's rank among its head's valid slots, scaled to [0, 1] (1: the head's best).
    Ranks put heads whose scores live on different scales (a sink head, a flat one) on one footing."""
    scores = scores.float().masked_fill(~valid, float("-inf"))
    rank = torch.argsort(torch.argsort(scores, dim=1, stable=True), dim=1).float()
    padding = (~valid).sum(1, keepdim=True).float()  # padding ranks lowest: shift it out
    count = valid.sum(1, keepdim=True).float()
    return ((rank - padding) / (count - 1).clamp_min(1)).masked_fill(~valid, 0.0)


def consensus(span: CacheSpan, head_scores: Callable[[LayerSpan], torch.Tensor]) -> PositionScores:
    """Per position, the mean over every layer and head that holds it of ``head_scores(layer)`` ((H, n),
    already on one scale across heads, e.g. ``head_ranks`` or attention shares)."""
    positions = span_positions(span).cpu()
    size = int(positions.max()) + 1
    total, count = torch.zeros(size), torch.zeros(size)
    for layer in span.each_layer():
        held = layer.positions[layer.valid].long().cpu()
        total.index_add_(0, held, head_scores(layer)[layer.valid].float().cpu())
        count.index_add_(0, held, torch.ones(held.numel()))
    return PositionScores(positions, total[positions] / count[positions].clamp_min(1))
