"""Retrieval lines: the heads that retrieve keep the most surprising lines, the others what recent queries attend to.

A few attention heads fetch from far back in the context while most attend locally (RazorAttention, Tang et
al., ICLR 2025; DuoAttention, Xiao et al., ICLR 2025). kvmemory's two selectors each serve one side: selective
context (``selective_context``) keeps an agent's single-mention facts in every head but continues text worse
than per-head eviction, and SnapKV under REAL's head budgets continues best but loses those facts
(``benchmarks/agent_memory.py``, ``benchmarks/quality.py``). Here the head profile that REAL allocates by
(needle-retrieval scores, ``kvmemory.runtime.head_profiling``) names the retrieval heads: the top
``line_heads`` share of KV heads keep selective context's lines (every one of them the same lines), the others
SnapKV's choice. Run it under REAL's budgets, ``get_method("real", inner="retrieval_lines")``, so the retrieval
heads also get the larger budgets; it sits between the two selectors, keeping fewer facts than selective
context and continuing text about as well as REAL eviction.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, LayerResult, LayerSpan, MethodConfig
from kvmemory.compaction.eviction import ScoreEviction
from kvmemory.compaction.head_budgets import head_scores
from kvmemory.compaction.methods.selective_context import line_surprisal
from kvmemory.compaction.methods.snapkv import SnapKV
from kvmemory.compaction.registry import register


class RetrievalLinesConfig(MethodConfig):
    line_heads: float = Field(1 / 3, gt=0, le=1, description="share of KV heads (highest score first) keeping lines")
    profile: str | None = Field(None, description="path of a head profile JSON (None: the model's saved default)")
    score: Literal["infsc", "rasc", "lcsc", "r2"] = Field("infsc", description="profiled score ranking the heads")
    max_unit_tokens: int = Field(64, ge=1, description="a line longer than this is ranked in pieces this long")
    evict_predictable_below: float | None = Field(
        1.0, ge=0, description="tokens predicted under this surprisal (nats) go before any line (selective context's)"
    )
    scores: list[list[float]] | None = Field(None, description="(L, H) head scores given directly")
    window: int = Field(32, ge=1, description="SnapKV's observation window: last tokens whose queries vote")
    kernel: int = Field(7, ge=1, description="SnapKV's pooling kernel over neighbouring slots")


def top_heads(scores: torch.Tensor, share: float) -> torch.Tensor:
    """(L, H) True for the ``share`` of heads with the highest scores (at least one; ties by index)."""
    count = max(1, round(share * scores.numel()))
    chosen = torch.zeros(scores.numel(), dtype=torch.bool)
    chosen[torch.topk(scores.flatten().float(), count).indices] = True
    return chosen.view(scores.shape)


@register
class RetrievalLines(ScoreEviction):
    """Retrieval heads keep the most surprising lines, the other heads SnapKV's choice (see the module
    docstring); meant as REAL's inner method."""

    name = "retrieval_lines"
    Config = RetrievalLinesConfig

    def __init__(self, config: RetrievalLinesConfig | None = None, **params):
        super().__init__(config, **params)
        self.attended = SnapKV(window=self.config.window, kernel=self.config.kernel)

    @property
    def needs_surprisal(self) -> bool:
        return True

    def compact(self, span: CacheSpan, budgets: torch.Tensor) -> list[LayerResult]:
        scores = head_scores(span, self.config.scores, self.config.profile, self.config.score)
        self._line_heads = top_heads(scores, self.config.line_heads)
        self._lines = line_surprisal(span, self.config.max_unit_tokens, self.config.evict_predictable_below)
        return super().compact(span, budgets)

    def score(self, layer: LayerSpan, span: CacheSpan) -> torch.Tensor:
        attended = self.attended.score(layer, span).float()
        lines = self._lines.score_slots(layer.positions.cpu()).to(attended)
        keeps_lines = self._line_heads[layer.layer].to(attended.device)
        return torch.where(keeps_lines[:, None], lines, attended)
