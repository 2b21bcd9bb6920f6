"""SnapKV: observation-window attention, pooled over neighbouring slots, top-k per head.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024
(arXiv 2404.14469). The observation window is the last ``window`` tokens' reference queries.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, LayerSpan, MethodConfig
from kvmemory.compaction.eviction import ScoreEviction
from kvmemory.compaction.registry import register
from kvmemory.compaction.solvers import pool_scores


class SnapKVConfig(MethodConfig):
    window: int = Field(32, ge=1, description="observation window: last tokens whose queries vote")
    kernel: int = Field(7, ge=1, description="pooling kernel over neighbouring slots")
    pooling: str = Field("max", pattern="^(max|avg)$")


def window_queries(layer: LayerSpan, span: CacheSpan, window: int) -> torch.Tensor:
    return layer.queries[:, -window * span.query_group_size :]


@register
class SnapKV(ScoreEviction):
    """SnapKV (Li et al., NeurIPS 2024): observation-window attention, pooled, top-k per head."""

    name = "snapkv"
    Config = SnapKVConfig

    def score(self, layer: LayerSpan, span: CacheSpan) -> torch.Tensor:
        attn = layer.attention(window_queries(layer, span, self.config.window)).mean(dim=1)
        return pool_scores(attn, self.config.kernel, self.config.pooling)
