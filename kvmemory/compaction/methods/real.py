"""REAL: per-head budgets from attention-behaviour profiling, then per-head selection.

Li, Feng, Xie, Song, "REAL", ACL 2026; allocation follows HeadKV (Fu et al., ICLR 2025). Heads are
profiled offline on needle tasks (``kvmemory.runtime.head_profiling``); the budget the scheduler asks
for is redistributed from a shared pool by head score, and an inner method (SnapKV by default, as in the
paper; Attention Matching works too) selects within each head's budget.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, LayerResult, MethodConfig
from kvmemory.compaction.head_budgets import head_scores, headkv_budgets
from kvmemory.compaction.registry import register
from kvmemory.compaction.wrapper import Wrapper


class REALConfig(MethodConfig):
    profile: str | None = Field(None, description="path of a head profile JSON (None: the model's saved default)")
    score: Literal["infsc", "rasc", "lcsc", "r2"] = Field("infsc", description="which profiled head score to use")
    beta: float = Field(1.4, gt=1.0, description="pool divisor: each head keeps b − ⌊b/β⌋, the rest is pooled")
    temperature: float = Field(1.0, gt=0, description="exponent on normalised head scores")
    inner: str = Field("snapkv", description="selection method run with the REAL budgets")
    inner_params: dict = Field(default_factory=dict)
    scores: list[list[float]] | None = Field(None, description="(L, H) head scores given directly")


@register
class REAL(Wrapper):
    """REAL (Li et al., ACL 2026): per-head budgets from offline head profiles (HeadKV allocation), then an
    inner method selects within each head's budget: ``REAL(inner=SnapKV())`` or ``get_method("real",
    inner="attention_matching")``."""

    name = "real"
    Config = REALConfig

    def compact(self, span: CacheSpan, budgets: torch.Tensor) -> list[LayerResult]:
        scores = head_scores(span, self.config.scores, self.config.profile, self.config.score)
        capacity = span.head_capacity()
        budgets = headkv_budgets(int(budgets.sum()), scores, capacity, self.config.beta, self.config.temperature)
        return self.inner.compact(span, budgets)
