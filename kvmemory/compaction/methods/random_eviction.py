"""Random eviction: the floor every method must beat (seeded, so runs are repeatable)."""

from __future__ import annotations

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, LayerSpan, MethodConfig
from kvmemory.compaction.eviction import ScoreEviction
from kvmemory.compaction.registry import register


class RandomEvictionConfig(MethodConfig):
    seed: int = Field(0, description="random seed")


@register
class RandomEviction(ScoreEviction):
    """Seeded random eviction: the floor every method must beat."""

    name = "random"
    Config = RandomEvictionConfig
    uses_queries = False

    def score(self, layer: LayerSpan, span: CacheSpan) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.config.seed + layer.layer)
        return torch.rand(layer.keys.shape[:2], generator=g).to(layer.keys.device)
