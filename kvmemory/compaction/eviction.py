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
        return self.keep_top(span, budgets, lambda layer: self.score(layer, span))

    def keep_top(self, span: CacheSpan, budgets: torch.Tensor, score) -> list[LayerResult]:
        """Per layer and head, the ``budgets`` slots with the highest ``score(layer)``, forced ones first."""
        results = []
        for layer in span.each_layer():
            budget = budgets[layer.layer]
            forced = self.forced(layer, budget)
            prot = protected_mask(span, layer)
            if prot is not None:
                forced = prot if forced is None else forced | prot
            keep = topk_per_head(score(layer), layer.valid, budget, forced)
            results.append(LayerResult(keep=keep))
        return results


class PositionEviction(ScoreEviction):
    """Keep the positions ``position_scores`` ranks highest, the same ones in every head (as many as each
    head's budget allows)."""

    def compact(self, span: CacheSpan, budgets: torch.Tensor) -> list[LayerResult]:
        ranking = self.position_scores(span)
        return self.keep_top(span, budgets, lambda layer: ranking.score_slots(layer.positions).to(layer.keys.device))
