"""StreamingLLM: attention sinks plus the most recent tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks", ICLR 2024 (arXiv 2309.17453).
"""

from __future__ import annotations

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, LayerSpan, MethodConfig
from kvmemory.compaction.eviction import ScoreEviction
from kvmemory.compaction.registry import register


class StreamingLLMConfig(MethodConfig):
    sink_tokens: int = Field(4, ge=0, description="first slots of the span always kept")


@register
class StreamingLLM(ScoreEviction):
    """StreamingLLM (Xiao et al., ICLR 2024): keep the attention sinks and the most recent slots."""

    name = "streaming_llm"
    Config = StreamingLLMConfig
    uses_queries = False

    def score(self, layer: LayerSpan, span: CacheSpan) -> torch.Tensor:
        order = torch.cumsum(layer.valid.long(), dim=1).float()  # later slots score higher
        return torch.where(order <= self.config.sink_tokens, torch.full_like(order, float("inf")), order)
