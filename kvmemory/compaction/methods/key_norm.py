"""Key norm: keep the keys with the smallest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression", EMNLP 2024
(arXiv 2406.11430).
"""

from __future__ import annotations

import torch

from kvmemory.compaction.base import CacheSpan, LayerSpan, MethodConfig
from kvmemory.compaction.eviction import ScoreEviction
from kvmemory.compaction.registry import register


class KeyNormConfig(MethodConfig):
    pass


@register
class KeyNorm(ScoreEviction):
    """Key norm (Devoto et al., EMNLP 2024): keep the keys with the smallest L2 norm; needs no queries."""

    name = "key_norm"
    Config = KeyNormConfig
    uses_queries = False

    def score(self, layer: LayerSpan, span: CacheSpan) -> torch.Tensor:
        return -layer.keys.float().norm(dim=-1)
