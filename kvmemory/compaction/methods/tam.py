"""TAM, Thought-Aware attention Matching: Attention Matching with budgets spread over reasoning segments.

Liu, Chong, Zhang, Zheng, Liang, Xu, "Thought-Aware Attention Matching", arXiv 2608.12331 (2026).
The span is cut into thought segments at blank lines (neighbours shorter than ℓ_min merged, or at jumps
in attention). Segment i gets t_i ∝ w_i^a · n_i^b of the budget left after pivotal tokens, where w_i
is the selector-window attention mass it receives and n_i its length. Pivotal tokens (attention above
c × mean) stay verbatim with their β; inside each segment the top-t_i keys by attention are chosen; β
and values are fitted over all chosen keys together. The two published rules are √w·n (a=½, b=1) and
√(w·n) (a=b=½).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from kvmemory.compaction.base import CacheSpan, CompactionMethod, LayerResult, LayerSpan, MethodConfig, protected_mask
from kvmemory.compaction.methods.attention_matching import AttentionMatching, AttentionMatchingConfig
from kvmemory.compaction.position_scores import PositionScores, consensus
from kvmemory.compaction.registry import register


class TAMConfig(MethodConfig):
    min_segment_tokens: int = Field(32, ge=1, description="ℓ_min: shorter neighbouring segments are merged")
    boundaries: Literal["blank_lines", "attention_jumps"] = "blank_lines"
    jump_factor: float = Field(2.0, gt=0, description="attention_jumps: boundary where the jump > factor × median")
    weight_exponent: float = Field(0.5, ge=0, description="a in t_i ∝ w_i^a · n_i^b")
    length_exponent: float = Field(1.0, ge=0, description="b in t_i ∝ w_i^a · n_i^b (1: √w·n, 0.5: √(w·n))")
    pivotal_factor: float = Field(3.0, gt=0, description="c: tokens with attention > c × mean stay verbatim")
    max_pivotal_fraction: float = Field(0.5, ge=0, le=1, description="cap on the budget pivotal tokens may take")
    matching: AttentionMatchingConfig = Field(default_factory=AttentionMatchingConfig)


def segment_ids_from_text(
    positions: torch.Tensor, valid: torch.Tensor, token_text, token_of_position: dict[int, int], min_len: int
) -> torch.Tensor:
    """(n,) segment index per slot of one head: new segment after a token holding a blank line; short ones merged."""
    pos = positions.tolist()
    seg, current, count = [], 0, 0
    lengths = []
    for i, p in enumerate(pos):
        seg.append(current)
        if not bool(valid[i]):
            continue
        count += 1
        text = token_text(token_of_position.get(p, -1)) if token_text else ""
        if "\n\n" in text or (
            text.endswith("\n")
            and i + 1 < len(pos)
            and token_text(token_of_position.get(pos[i + 1], -1)).startswith("\n")
        ):
            lengths.append(count)
            current, count = current + 1, 0
    lengths.append(count)
    return _merge_short(torch.tensor(seg), lengths, min_len)


def segment_ids_from_attention(attn: torch.Tensor, valid: torch.Tensor, factor: float, min_len: int) -> torch.Tensor:
    """(n,) segment index per slot: boundaries where mean attention jumps by more than ``factor`` × median jump."""
    jumps = (attn[1:] - attn[:-1]).abs()
    cut = (
        jumps > factor * jumps[valid[1:]].median().clamp_min(1e-12)
        if valid[1:].any()
        else torch.zeros_like(jumps, dtype=torch.bool)
    )
    seg = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(cut.long(), 0)])
    lengths = torch.bincount(seg[valid], minlength=int(seg.max()) + 1).tolist()
    return _merge_short(seg, lengths, min_len)


def _merge_short(seg: torch.Tensor, lengths: list[int], min_len: int) -> torch.Tensor:
    """Merge each segment shorter than ``min_len`` into its neighbour (the previous one when it exists)."""
    mapping, out, acc = {}, 0, 0
    for i, n in enumerate(lengths):
        mapping[i] = out
        acc += n
        if acc >= min_len:
            out, acc = out + 1, 0
    if acc and out > 0:  # a short tail joins the segment before it
        for i in mapping:
            if mapping[i] == out:
                mapping[i] = out - 1
    return torch.tensor([mapping[int(s)] for s in seg.tolist()], dtype=torch.long)


def allocate(budget: int, weights: torch.Tensor, lengths: torch.Tensor, a: float, b: float) -> torch.Tensor:
    """t_i ∝ w_i^a · n_i^b, each 1 ≤ t_i ≤ n_i, summing exactly to ``budget`` (largest remainders)."""
    k = lengths.numel()
    budget = int(min(budget, int(lengths.sum())))
    if budget <= k:  # not even one slot per segment: give them to the heaviest segments
        out = torch.zeros(k, dtype=torch.long)
        out[torch.topk(weights, budget).indices] = 1
        return out
    raw = weights.clamp_min(1e-12).pow(a) * lengths.float().pow(b)
    out = torch.ones(k, dtype=torch.long)
    cap = lengths.long()
    left = budget - k
    while left > 0:
        room = cap - out
        active = room > 0
        share = raw * active / (raw * active).sum() * left
        add = torch.minimum(share.floor().long(), room)
        if int(add.sum()) == 0:
            frac = (share - share.floor()).masked_fill(~active, -1)
            add = torch.zeros_like(out)
            add[torch.topk(frac, min(left, int(active.sum()))).indices] = 1
        out += add
        left = budget - int(out.sum())
    return out


def quota_scores(share: torch.Tensor, segment: torch.Tensor, a: float, b: float, pivotal_factor: float) -> torch.Tensor:
    """(n,) one ranking that spreads any budget over the segments by TAM's rule: each segment's most attended
    token first, then its (k+1)-th at −k / (w^a · n^b), so the top B of the ranking give each segment one slot
    and the rest by highest averages in proportion to w_i^a · n_i^b (``allocate`` rounds by largest
    remainders instead); pivotal tokens (share above ``pivotal_factor`` × the mean) rank before all."""
    count = int(segment.max()) + 1
    weights = torch.zeros(count).index_add_(0, segment, share)
    lengths = torch.bincount(segment, minlength=count).float()
    quota = (weights / weights.sum().clamp_min(1e-12)).clamp_min(1e-12).pow(a) * lengths.pow(b)
    order = torch.argsort(share, descending=True, stable=True)
    order = order[torch.argsort(segment[order], stable=True)]  # by segment, then by share within it
    starts = torch.cumsum(lengths, 0).long() - lengths.long()
    rank = torch.empty_like(segment)
    rank[order] = torch.arange(len(order)) - starts[segment[order]]
    scores = -rank.float() / quota[segment]
    pivotal = share > pivotal_factor * share.mean()
    return torch.where(pivotal, 1e6 + share, scores)


@register
class TAM(CompactionMethod):
    """TAM (Liu et al., arXiv 2608.12331): Attention Matching whose key budget is spread over the span's
    thought segments (t_i ∝ w_i^a · n_i^b), with pivotal tokens kept verbatim. The fit is done by an
    ``AttentionMatching`` it composes: ``TAM(matching=AttentionMatching(value_fit="ls"))``."""

    name = "tam"
    Config = TAMConfig

    def __init__(self, config: TAMConfig | None = None, matching: AttentionMatching | dict | None = None, **params):
        if isinstance(matching, AttentionMatching):
            matching = matching.config
        super().__init__(config, **({} if matching is None else {"matching": matching}), **params)
        self.matching = AttentionMatching(self.config.matching)

    def position_scores(self, span: CacheSpan) -> PositionScores:
        """TAM's budget rule as one ranking of positions (``quota_scores``) over the span's thought segments,
        the attention of each position its mean share in the heads that hold it."""
        cfg = self.config
        share = consensus(span, lambda layer: layer.attention().mean(dim=1))
        if cfg.boundaries == "blank_lines":
            everywhere = torch.ones_like(share.positions, dtype=torch.bool)
            segment = segment_ids_from_text(
                share.positions, everywhere, span.text_of_token, span.token_of_position, cfg.min_segment_tokens
            )
        else:
            everywhere = torch.ones_like(share.scores, dtype=torch.bool)
            segment = segment_ids_from_attention(share.scores, everywhere, cfg.jump_factor, cfg.min_segment_tokens)
        scores = quota_scores(share.scores, segment, cfg.weight_exponent, cfg.length_exponent, cfg.pivotal_factor)
        return PositionScores(share.positions, scores)

    def compact(self, span: CacheSpan, budgets: torch.Tensor) -> list[LayerResult]:
        results = []
        for layer in span.each_layer():
            results.append(self._compact_layer(span, layer, budgets[layer.layer]))
        return results

    def _compact_layer(self, span: CacheSpan, layer: LayerSpan, budget: torch.Tensor) -> LayerResult:
        cfg = self.config
        n_valid = layer.valid.sum(1)
        if bool((budget >= n_valid).all()):
            return LayerResult(keep=[torch.nonzero(v).flatten() for v in layer.valid])
        attn = layer.attention().mean(dim=1)  # (H, n) mean attention from the selector window
        forced = protected_mask(span, layer)
        keeps, pivotal_masks = [], torch.zeros_like(layer.valid)
        for h in range(layer.num_heads):
            valid = layer.valid[h]
            t = int(min(int(budget[h]), int(valid.sum())))
            mean = attn[h][valid].mean()
            pivotal = (attn[h] > cfg.pivotal_factor * mean) & valid
            if forced is not None:
                pivotal |= forced[h]
            max_piv = max(0, int(cfg.max_pivotal_fraction * t))
            if int(pivotal.sum()) > max_piv:  # keep only the strongest pivotal tokens
                strongest = torch.topk(attn[h].masked_fill(~pivotal, -1), max_piv).indices
                pivotal = torch.zeros_like(pivotal)
                pivotal[strongest] = True
            if cfg.boundaries == "blank_lines":
                seg = segment_ids_from_text(
                    layer.positions[h], valid, span.text_of_token, span.token_of_position, cfg.min_segment_tokens
                )
            else:
                seg = segment_ids_from_attention(attn[h], valid, cfg.jump_factor, cfg.min_segment_tokens)
            seg = seg.to(attn.device)
            candidates = valid & ~pivotal
            n_seg = int(seg.max()) + 1
            lengths = torch.bincount(seg[candidates], minlength=n_seg)
            weights = torch.zeros(n_seg, dtype=attn.dtype).index_add_(0, seg[valid], attn[h][valid])
            present = lengths > 0
            t_rest = t - int(pivotal.sum())
            chosen = pivotal.clone()
            if t_rest > 0 and bool(present.any()):
                per_seg = torch.zeros(n_seg, dtype=torch.long)
                per_seg[present] = allocate(
                    t_rest,
                    weights[present] / weights[present].sum().clamp_min(1e-12),
                    lengths[present],
                    cfg.weight_exponent,
                    cfg.length_exponent,
                )
                for s in torch.nonzero(per_seg).flatten().tolist():
                    members = torch.nonzero(candidates & (seg == s)).flatten()
                    top = torch.topk(attn[h][members], int(per_seg[s])).indices
                    chosen[members[top]] = True
            keeps.append(torch.nonzero(chosen).flatten())
            pivotal_masks[h] = pivotal
        return self.matching.fit(layer, keeps, pivotal_masks)
