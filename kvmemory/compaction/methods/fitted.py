"""Fitted: Attention Matching's β and value fit on the keys another method chose.

Zweiger et al., "Fast KV Compaction via Attention Matching", arXiv 2602.16284: once keys are chosen, a
per-key bias β (fitted by non-negative least squares on the attention mass) and new values (ridge least
squares on the attention output) make the kept slots reproduce the span's attention for the reference
queries. The fit does not care how the keys were chosen, so it composes with any selector:
``Fitted(Lines(CounterCausal()))`` fits on counter-causal lines, ``Fitted(REAL(inner=Lines(TAM())))`` on
TAM-ranked lines under REAL's head budgets. Slots the span protects, and heads that keep every slot, stay
exactly as they were.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, CompactionMethod, LayerResult, MethodConfig, protected_mask
from kvmemory.compaction.methods.attention_matching import AttentionMatching, AttentionMatchingConfig
from kvmemory.compaction.registry import register
from kvmemory.compaction.wrapper import Wrapper


class FittedConfig(MethodConfig):
    inner: str = Field("lines", description="the method that chooses the keys")
    inner_params: dict = Field(default_factory=dict)
    matching: AttentionMatchingConfig = Field(
        default_factory=AttentionMatchingConfig, description="the fit's settings (β box, ridge, NNLS steps)"
    )


@register
class Fitted(Wrapper):
    """Attention Matching's β and value fit on another method's choice of keys: ``Fitted(Lines(...))``."""

    name = "fitted"
    Config = FittedConfig

    def __init__(self, inner: CompactionMethod | str | None = None, config: FittedConfig | None = None, **params):
        super().__init__(inner, config, **params)
        self.matching = AttentionMatching(self.config.matching)

    @property
    def uses_queries(self) -> bool:  # the fit matches the span's attention for its reference queries
        return True

    def compact(self, span: CacheSpan, budgets: torch.Tensor) -> list[LayerResult]:
        chosen = self.inner.compact(span, budgets)
        return [
            self.matching.fit(layer, result.keep, protected_mask(span, layer))
            for layer, result in zip(span.each_layer(), chosen)
        ]
