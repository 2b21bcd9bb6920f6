"""Between the cache and the methods: cut a span out of a CompactCache, and turn results into a plan.

A span is a set of logical positions (one or more segments). Per layer and head it is the slots whose
position falls in the set; every other slot is kept exactly as it is, so compacting one segment never
touches another segment's slots.
"""

from __future__ import annotations

import torch

from kvmemory.cache import CompactCache, CompactionPlan, LayerPlan
from kvmemory.cache.plan import pad_selection
from kvmemory.compaction.base import CacheSpan, LayerResult, LayerSpan


def span_slots(cache: CompactCache, positions: torch.Tensor) -> list[list[torch.Tensor]]:
    """Per layer, per head: physical slot indices whose position is in ``positions`` (sorted)."""
    out = []
    lo, hi = (int(positions.min()), int(positions.max())) if positions.numel() else (0, -1)
    contiguous = positions.numel() == hi - lo + 1 and positions.unique().numel() == positions.numel()
    for layer in cache.layers:
        pos = layer.positions[:, : layer.length]
        if contiguous:  # the usual span (whole segments): a range test instead of a set lookup
            member = (pos >= lo) & (pos <= hi)
        else:
            member = torch.isin(pos, positions.to(pos.device)) & (pos >= 0)
        out.append([torch.nonzero(m).flatten() for m in member])
    return out


def extract_span(
    cache: CompactCache, slots: list[list[torch.Tensor]], queries: list[torch.Tensor | None], scale: float
) -> CacheSpan:
    """Gather the span's keys, values, β and positions per layer into padded (H, n, ·) tensors."""
    layers = []
    for li, (layer, per_head) in enumerate(zip(cache.layers, slots)):
        heads = layer.num_heads
        n = max(1, max(s.numel() for s in per_head))
        first = int(per_head[0][0]) if per_head[0].numel() else -1
        if first >= 0 and all(s.numel() == n and int(s[0]) == first and int(s[-1]) == first + n - 1 for s in per_head):
            # the common case (a span no head has compacted yet): the same contiguous slots in every
            # head, so views replace the gathers; methods never write to their inputs
            window = slice(first, first + n)
            valid = torch.ones(heads, n, dtype=torch.bool, device=layer.device)
            layers.append(
                LayerSpan(
                    li,
                    layer.keys[0, :, window],
                    layer.values[0, :, window],
                    layer.bias[0, :, window],
                    layer.positions[:, window].long(),
                    valid,
                    scale,
                    queries[li] if queries else None,
                )
            )
            continue
        index, valid = pad_selection(per_head, layer.device)  # padding reads each head's first slot, masked
        if index.shape[1] < n:  # no head holds any of the span: one masked column
            index, valid = index.new_zeros(heads, n), valid.new_zeros(heads, n)
        k, v = layer.gather("keys", index), layer.gather("values", index)
        b = layer.gather("bias", index).masked_fill(~valid, float("-inf"))
        p = layer.gather("positions", index).masked_fill(~valid, -1)
        layers.append(LayerSpan(li, k, v, b, p.long(), valid, scale, queries[li] if queries else None))
    return CacheSpan(layers=layers)


def to_plan(
    cache: CompactCache, spans: list[tuple[list[list[torch.Tensor]], list[LayerResult]]], method: str
) -> CompactionPlan:
    """Keep every slot outside the spans; inside each (disjoint) span, keep its method's choice with its new
    values and β. ``spans``: (span slots per layer and head, the method's results) for each span.

    Per layer, whole-head tensor ops (a keep mask, its running count for the rows the chosen slots land
    on): a compaction touches every layer, so per-head Python loops would cost more than small methods.
    Several spans make one plan, so the cache is rebuilt once however many segments a pass compacts."""
    plans = []
    for li, layer in enumerate(cache.layers):
        heads, length, dev = layer.num_heads, layer.length, layer.device
        keep_mask = layer.positions[:, :length] >= 0  # padding never survives
        chosen_per_span = []
        for slots, results in spans:
            span, span_valid = pad_selection(slots[li], dev)
            local, chosen_valid = pad_selection(results[li].keep, dev)
            chosen = torch.gather(span, 1, local) if span.shape[1] else local
            keep_mask &= ~_mark(span, span_valid, length)  # the span's slots survive only if chosen
            chosen_per_span.append((chosen, chosen_valid, results[li]))
        for chosen, chosen_valid, _ in chosen_per_span:
            keep_mask |= _mark(chosen, chosen_valid, length)
        keeps = list(torch.nonzero(keep_mask)[:, 1].split(keep_mask.sum(1).tolist()))
        values = bias = None
        if any(r.values is not None or r.bias is not None for _, _, r in chosen_per_span):
            index, _ = pad_selection(keeps, dev)
            values = torch.gather(layer.values[0], 1, index[..., None].expand(-1, -1, layer.values.shape[-1]))
            bias = torch.gather(layer.bias[0], 1, index).float()
            rank = keep_mask.cumsum(1) - 1  # where each kept slot lands in its head's kept slots
            for chosen, chosen_valid, result in chosen_per_span:
                heads_chosen = torch.arange(heads, device=dev)[:, None].expand_as(chosen)[chosen_valid]
                rows = torch.gather(rank, 1, chosen)[chosen_valid]
                if result.values is not None:
                    values[heads_chosen, rows] = result.values[:, : chosen.shape[1]][chosen_valid].to(values.dtype)
                if result.bias is not None:
                    bias[heads_chosen, rows] = result.bias[:, : chosen.shape[1]][chosen_valid].float()
        plans.append(LayerPlan(keep=keeps, values=values, bias=bias))
    return CompactionPlan(plans, method=method)


def _mark(index: torch.Tensor, valid: torch.Tensor, length: int) -> torch.Tensor:
    """(H, length) True at each head's valid indices. A max-scatter, so the padding entries (index 0,
    valid False) can never clear a real mark on the same slot; boolean-mask indexing costs 10× more."""
    marks = torch.zeros(index.shape[0], length, dtype=torch.uint8, device=index.device)
    return marks.scatter_reduce_(1, index, valid.to(torch.uint8), "amax").bool()
