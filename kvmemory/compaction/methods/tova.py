"""TOVA: keep the slots the current query attends to most, averaged over a layer's heads.

Oren et al., "Transformers are Multi-State RNNs", 2024 (arXiv 2401.06104). The current query is the last
token's queries among the reference queries; the decision is shared by all heads of a layer.
"""

from __future__ import annotations

import torch

from kvmemory.compaction.base import CacheSpan, LayerSpan, MethodConfig
from kvmemory.compaction.eviction import ScoreEviction
from kvmemory.compaction.registry import register


class TOVAConfig(MethodConfig):
    pass


@register
class TOVA(ScoreEviction):
    """TOVA (Oren et al., 2024): keep what the last token's queries attend to most, one choice per layer."""

    name = "tova"
    Config = TOVAConfig

    def score(self, layer: LayerSpan, span: CacheSpan) -> torch.Tensor:
        last = layer.queries[:, -span.query_group_size :]  # the last token's queries
        attn = layer.attention(last).mean(dim=1)  # (H, n)
        return attn.mean(dim=0, keepdim=True).expand_as(attn)
