"""Attention Matching: pick keys, then fit β and values so the compacted block reproduces the span's
attention output and attention mass for the reference queries.

Zweiger, Fu, Guo, Kim, "Fast KV Compaction via Attention Matching", arXiv 2602.16284 (2026).
Matching both output and mass makes the block mix correctly with every token appended later, because
attention over a concatenation is the mass-weighted mixture of the blocks' outputs.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from kvmemory.cache.plan import pad_selection
from kvmemory.compaction.base import (
    CacheSpan,
    CompactionMethod,
    LayerResult,
    LayerSpan,
    MethodConfig,
    protected_mask,
    topk_per_head,
)
from kvmemory.compaction.methods.counter_causal import surprise_scores
from kvmemory.compaction.position_scores import PositionScores, consensus, head_ranks
from kvmemory.compaction.registry import register
from kvmemory.compaction.solvers import fit_bias_and_values, gather_columns, nnls_box, pool_scores, reduce_attention


class AttentionMatchingConfig(MethodConfig):
    selector: Literal["highest_attention", "omp", "counter_causal"] = Field(
        "highest_attention", description="how keys are chosen; counter_causal uses the surprise score"
    )
    reduction: Literal["rms", "max", "mean"] = Field("rms", description="attention reduction over queries")
    pool_kernel: int = Field(0, ge=0, description="pooling of selection scores over neighbouring slots (0: off)")
    omp_keys_per_step: int = Field(4, ge=1, description="OMP: keys added per greedy step (1 = classic OMP)")
    omp_refit_every: int = Field(2, ge=1, description="OMP: steps between mass refits")
    beta_box: tuple[float, float] = Field((-3.0, 3.0), description="allowed range of log B (β shift)")
    ridge: float = Field(
        1.0,
        ge=0.0,
        description="ridge λ of the value fit, relative to the mean Gram diagonal; it pulls toward the kept "
        "values, and a strong pull stops overfitting when the slots outnumber the reference queries",
    )
    nnls_steps: int = Field(30, ge=0, description="projected-gradient steps after the clamped solve")
    fit_values: bool = Field(True, description="fit values by least squares (else keep the originals)")
    fit_bias: bool = Field(True, description="fit β by NNLS on attention mass (else β unchanged)")
    chunk_size: int = Field(2048, ge=0, description="compact spans longer than this chunk by chunk (0: never)")
    counter_causal_fast: bool = Field(True, description="with the counter_causal selector: single-layer score")
    adaptive_heads: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="AdaKV-style: share a layer's budget across its heads by joint top-k of the selection "
        "scores, each head keeping at least this fraction of its uniform budget (0: uniform per head)",
    )


@register
class AttentionMatching(CompactionMethod):
    """Attention Matching (Zweiger et al., arXiv 2602.16284): select keys, then fit β and values so the
    compacted span reproduces its attention output and mass on the reference queries."""

    name = "attention_matching"
    Config = AttentionMatchingConfig

    @property
    def needs_last_layer_inputs(self) -> bool:
        return self.config.selector == "counter_causal" and self.config.counter_causal_fast

    def compact(self, span: CacheSpan, budgets: torch.Tensor) -> list[LayerResult]:
        position_scores = None
        if self.config.selector == "counter_causal":
            position_scores = surprise_scores(span, fast=self.config.counter_causal_fast)
        results = []
        for layer in span.each_layer():
            forced = protected_mask(span, layer)
            results.append(self.compact_layer(layer, budgets[layer.layer], forced, position_scores))
        return results

    # ---- one layer -----------------------------------------------------------------------------
    def compact_layer(
        self, layer: LayerSpan, budget: torch.Tensor, forced: torch.Tensor | None, position_scores=None
    ) -> LayerResult:
        n_valid = layer.valid.sum(dim=1)
        if bool((budget >= n_valid).all()):
            return LayerResult(keep=[torch.nonzero(v).flatten() for v in layer.valid])
        chunk = self.config.chunk_size
        if chunk and layer.keys.shape[1] > chunk:
            return self._chunked(layer, budget, forced, position_scores)
        keep = self.select(layer, budget, forced, position_scores)
        return self.fit(layer, keep, forced)

    def select(self, layer: LayerSpan, budget, forced, position_scores) -> list[torch.Tensor]:
        if position_scores is not None:
            scores = position_scores.score_slots(layer.positions)
            return topk_per_head(scores, layer.valid, budget, forced)
        if self.config.selector == "omp":
            return self._omp(layer, budget, forced)
        scores = self.attention_scores(layer)
        if self.config.adaptive_heads > 0:
            budget = adaptive_head_budgets(scores, layer.valid, budget, self.config.adaptive_heads)
        return topk_per_head(scores, layer.valid, budget, forced)

    def attention_scores(self, layer: LayerSpan) -> torch.Tensor:
        """(H, n) how much the reference queries attend to each slot, reduced over them (and pooled)."""
        return pool_scores(reduce_attention(layer.attention(), self.config.reduction), self.config.pool_kernel)

    def position_scores(self, span: CacheSpan) -> PositionScores:
        """The counter-causal surprise with that selector, else each position's mean rank of attention in the
        heads that hold it (OMP has no score per slot: attention stands in)."""
        if self.config.selector == "counter_causal":
            return surprise_scores(span, fast=self.config.counter_causal_fast)
        return consensus(span, lambda layer: head_ranks(self.attention_scores(layer), layer.valid))

    def fit(self, layer: LayerSpan, keep: list[torch.Tensor], forced: torch.Tensor | None) -> LayerResult:
        index, sel_valid = pad_selection(keep, layer.keys.device)
        fixed = torch.zeros_like(sel_valid)
        if forced is not None:
            fixed = torch.gather(forced, 1, index) & sel_valid
        keeps_all = torch.tensor([k.numel() for k in keep], device=index.device) >= layer.valid.sum(1)
        fixed |= keeps_all[:, None] & sel_valid  # a head that keeps everything is left exactly as it was
        old_bias = torch.gather(layer.bias, 1, index)
        logits = layer.logits()
        shift, values = fit_bias_and_values(
            logits,
            layer.values,
            keep,
            fixed,
            self.config.beta_box,
            self.config.ridge,
            self.config.nnls_steps,
            mass_terms=layer.mass_terms(),
        )
        bias = (old_bias + shift).masked_fill(~sel_valid, float("-inf")) if self.config.fit_bias else None
        if not self.config.fit_values:
            values = None
        elif not self.config.fit_bias:  # values were fitted for the shifted β; refit for the unshifted one
            _, values = fit_bias_and_values(logits, layer.values, keep, fixed, (0.0, 0.0), self.config.ridge, 0)
        return LayerResult(keep=keep, values=values, bias=bias)

    # ---- OMP selection -------------------------------------------------------------------------
    def _omp(self, layer: LayerSpan, budget: torch.Tensor, forced: torch.Tensor | None) -> list[torch.Tensor]:
        """Greedy mass matching: add the keys most correlated with the residual mass, refit, repeat."""
        logits = layer.logits()
        phi = torch.exp(logits - logits.amax(-1, keepdim=True).clamp_min(-1e30))  # (H, m, n)
        target = phi.sum(-1)
        heads = phi.shape[0]
        chosen = forced.clone() if forced is not None else torch.zeros_like(layer.valid)
        limit = torch.minimum(budget.to(layer.valid.device), layer.valid.sum(1))
        lo, hi = (float(torch.exp(torch.tensor(b))) for b in (-27.6, 7.0))
        residual, step = target.clone(), 0
        while bool((chosen.sum(1) < limit).any()):
            corr = torch.einsum("hm,hmn->hn", residual, phi).masked_fill(chosen | ~layer.valid, float("-inf"))
            for h in range(heads):
                room = int(limit[h] - chosen[h].sum())
                if room > 0:
                    chosen[h, torch.topk(corr[h], min(room, self.config.omp_keys_per_step)).indices] = True
            step += 1
            if step % self.config.omp_refit_every == 0 or not bool((chosen.sum(1) < limit).any()):
                keep = [torch.nonzero(c).flatten() for c in chosen]
                index, sel_valid = pad_selection(keep, phi.device)
                phi_sel = gather_columns(phi, index) * sel_valid[:, None, :]
                b = nnls_box(phi_sel, target, sel_valid, lo, hi, steps=10)
                residual = target - (phi_sel @ b[..., None]).squeeze(-1)
        return [torch.nonzero(c).flatten() for c in chosen]

    # ---- chunking ------------------------------------------------------------------------------
    def _chunked(self, layer: LayerSpan, budget, forced, position_scores) -> LayerResult:
        """Compact consecutive chunks independently (valid: attention over blocks is a mass-weighted mixture)."""
        n = layer.keys.shape[1]
        bounds = list(range(0, n, self.config.chunk_size)) + [n]
        sizes = torch.stack([layer.valid[:, a:b].sum(1) for a, b in zip(bounds, bounds[1:])], dim=1)  # (H, C)
        chunk_budgets = proportional_split(budget, sizes)
        keeps = [[] for _ in range(layer.num_heads)]
        values, biases = [[] for _ in range(layer.num_heads)], [[] for _ in range(layer.num_heads)]
        for c, (a, b) in enumerate(zip(bounds, bounds[1:])):
            sub = LayerSpan(
                layer.layer,
                layer.keys[:, a:b],
                layer.values[:, a:b],
                layer.bias[:, a:b],
                layer.positions[:, a:b],
                layer.valid[:, a:b],
                layer.scale,
                layer.queries,
            )
            sub_forced = forced[:, a:b] if forced is not None else None
            cb = chunk_budgets[:, c]
            if bool((cb >= sub.valid.sum(1)).all()):
                res = LayerResult(keep=[torch.nonzero(v).flatten() for v in sub.valid])
            else:
                res = self.fit(sub, self.select(sub, cb.clamp_min(1), sub_forced, position_scores), sub_forced)
            for h in range(layer.num_heads):
                k = res.keep[h]
                keeps[h].append(k + a)
                values[h].append(res.values[h, : k.numel()] if res.values is not None else sub.values[h, k].float())
                biases[h].append(res.bias[h, : k.numel()] if res.bias is not None else sub.bias[h, k])
        keep = [torch.cat(k) for k in keeps]
        t_max = max(k.numel() for k in keep)
        v_out = layer.values.new_zeros(layer.num_heads, t_max, layer.values.shape[-1], dtype=torch.float32)
        b_out = torch.full((layer.num_heads, t_max), float("-inf"))
        for h in range(layer.num_heads):
            v_out[h, : keep[h].numel()] = torch.cat(values[h])
            b_out[h, : keep[h].numel()] = torch.cat(biases[h])
        return LayerResult(keep=keep, values=v_out, bias=b_out.to(layer.bias.device))


def adaptive_head_budgets(
    scores: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor, floor_fraction: float
) -> torch.Tensor:
    """Per-head budgets summing to ``budget.sum()``: a floor per head, the rest by joint top-k of the scores."""
    floor = (budget.float() * floor_fraction).floor().long()
    floor = torch.minimum(floor, valid.sum(1))
    extra = int(budget.sum() - floor.sum())
    flat = scores.float().masked_fill(~valid, float("-inf"))
    ranked = torch.sort(flat, dim=1, descending=True).values
    rank = torch.arange(flat.shape[1], device=flat.device).expand_as(flat)
    beyond_floor = ranked.masked_fill(rank < floor[:, None], float("-inf"))  # the floor slots are taken already
    winners = torch.topk(beyond_floor.flatten(), min(extra, int(torch.isfinite(beyond_floor).sum()))).indices
    return floor + torch.bincount(winners // flat.shape[1], minlength=flat.shape[0])


def proportional_split(total: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Split each head's ``total`` over chunks in proportion to ``sizes`` (H, C); sums exactly, ≤ size."""
    sizes = sizes.long()
    total = torch.minimum(total.long().to(sizes.device), sizes.sum(1))
    share = total[:, None].float() * sizes.float() / sizes.sum(1, keepdim=True).clamp_min(1).float()
    base = share.floor().long()
    for h in range(sizes.shape[0]):
        left = int(total[h] - base[h].sum())
        order = torch.argsort(share[h] - base[h].float(), descending=True)
        for c in order.tolist():
            if left == 0:
                break
            if base[h, c] < sizes[h, c]:
                base[h, c] += 1
                left -= 1
    return base
