"""Shared machinery of the eviction baselines: score each slot per head, keep the top of the budget."""

from __future__ import annotations

import torch

from kvmemory.compaction.base import CacheSpan, CompactionMethod, LayerResult, LayerSpan, protected_mask, topk_per_head
from kvmemory.compaction.position_scores import PositionScores, consensus, head_ranks


class ScoreEviction(CompactionMethod):
    """Keep, per KV head, the ``budget`` slots with the highest score. Kept slots keep their β and values."""

    def score(self, layer: LayerSpan, span: CacheSpan) -> torch.Tensor:
        """(H, n) importance of each span slot; higher is kept first."""
        raise NotImplementedError

    def position_scores(self, span: CacheSpan) -> PositionScores:
        """Each position's mean rank in the heads that hold it: the heads' consensus, scale-free."""
        return consensus(span, lambda layer: head_ranks(self.score(layer, span), layer.valid))

    def forced(self, layer: LayerSpan, budget: torch.Tensor) -> torch.Tensor | None:
        """(H, n) slots to keep regardless of score (sinks, recent windows), or None."""
        return None

    def compact(self, span: CacheSpan, budgets: torch.Tensor) -> list[LayerResult]:
        results = []
        for layer in span.each_layer():
            budget = budgets[layer.layer]
            forced = self.forced(layer, budget)
            prot = protected_mask(span, layer)
            if prot is not None:
                forced = prot if forced is None else forced | prot
            keep = topk_per_head(self.score(layer, span), layer.valid, budget, forced)
            results.append(LayerResult(keep=keep))
        return results
