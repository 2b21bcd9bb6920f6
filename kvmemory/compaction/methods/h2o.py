"""H2O: heavy hitters (accumulated attention) plus a recent window, budget split between them.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs", NeurIPS 2023
(arXiv 2306.14048). Accumulated attention is summed over the reference queries.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, LayerSpan, MethodConfig, edge_mask
from kvmemory.compaction.eviction import ScoreEviction
from kvmemory.compaction.registry import register


class H2OConfig(MethodConfig):
    recent_fraction: float = Field(0.5, ge=0.0, le=1.0, description="share of the budget for the recent window")


@register
class H2O(ScoreEviction):
    """H2O (Zhang et al., NeurIPS 2023): keep the heavy hitters of accumulated attention plus a recent window."""

    name = "h2o"
    Config = H2OConfig

    def score(self, layer: LayerSpan, span: CacheSpan) -> torch.Tensor:
        return layer.attention().sum(dim=1)

    def forced(self, layer: LayerSpan, budget: torch.Tensor) -> torch.Tensor:
        recent = int(float(budget.float().mean()) * self.config.recent_fraction)
        return edge_mask(layer, 0, recent)
