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

from kvmemory.compaction.base import CacheSpan, CompactionMethod, LayerResult, MethodConfig
from kvmemory.compaction.head_budgets import head_scores, headkv_budgets
from kvmemory.compaction.registry import get_method, register


class REALConfig(MethodConfig):
    profile: str | None = Field(None, description="path of a head profile JSON (None: the model's saved default)")
    score: Literal["infsc", "rasc", "lcsc", "r2"] = Field("infsc", description="which profiled head score to use")
    beta: float = Field(1.4, gt=1.0, description="pool divisor: each head keeps b − ⌊b/β⌋, the rest is pooled")
    temperature: float = Field(1.0, gt=0, description="exponent on normalised head scores")
    inner: str = Field("snapkv", description="selection method run with the REAL budgets")
    inner_params: dict = Field(default_factory=dict)
    scores: list[list[float]] | None = Field(None, description="(L, H) head scores given directly")


@register
class REAL(CompactionMethod):
    """REAL (Li et al., ACL 2026): per-head budgets from offline head profiles (HeadKV allocation), then an
    inner method selects within each head's budget: ``REAL(inner=SnapKV())`` or ``get_method("real",
    inner="attention_matching")``."""

    name = "real"
    Config = REALConfig

    def __init__(self, config: REALConfig | None = None, inner: CompactionMethod | str | None = None, **params):
        if isinstance(inner, CompactionMethod):  # composed by instance: the config names it and its params
            params.setdefault("inner_params", inner.config.model_dump())
            super().__init__(config, inner=inner.name, **params)
            self.inner = inner
        else:
            super().__init__(config, **({} if inner is None else {"inner": inner}), **params)
            self.inner = get_method(self.config.inner, **self.config.inner_params)

    @property
    def uses_queries(self) -> bool:
        return self.inner.uses_queries

    @property
    def global_scores(self) -> bool:  # REAL only moves budget between heads; the inner method's scores rank
        return self.inner.global_scores

    @property
    def needs_last_layer_inputs(self) -> bool:
        return self.inner.needs_last_layer_inputs

    @property
    def needs_surprisal(self) -> bool:
        return self.inner.needs_surprisal

    def compact(self, span: CacheSpan, budgets: torch.Tensor) -> list[LayerResult]:
        scores = head_scores(span, self.config.scores, self.config.profile, self.config.score)
        capacity = span.head_capacity()
        budgets = headkv_budgets(int(budgets.sum()), scores, capacity, self.config.beta, self.config.temperature)
        return self.inner.compact(span, budgets)
