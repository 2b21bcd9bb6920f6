"""Per-(layer, KV head) budgets: uniform, or REAL/HeadKV-style from a head-score profile.

Any method takes a (L, H) budget tensor, so head-aware budgets work with every selector. Budgets always
sum exactly to the requested total and never exceed what a head holds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvmemory.errors import InvalidArgumentError


def uniform_budgets(total: int, capacity: torch.Tensor) -> torch.Tensor:
    """Spread ``total`` evenly over (L, H) heads, capped by each head's ``capacity`` (slots it holds)."""
    return fill_to_total(torch.full(capacity.shape, float(total) / capacity.numel()), total, capacity)


def fill_to_total(share: torch.Tensor, total: int, capacity: torch.Tensor) -> torch.Tensor:
    """Round real-valued shares to integers in [1, capacity] that sum exactly to min(total, Σ capacity)."""
    capacity = capacity.long()
    total = int(min(total, int(capacity.sum())))
    out = torch.minimum(share.floor().long().clamp_min(1), capacity)
    flat_share, flat_out, flat_cap = share.flatten(), out.flatten(), capacity.flatten()
    while int(flat_out.sum()) != total:
        left = total - int(flat_out.sum())
        if left > 0:
            room = flat_cap - flat_out
            movable = room > 0
            if _shift_all(flat_out, movable, room, left, 1):
                continue
            frac = (flat_share - flat_out.float()).masked_fill(~movable, float("-inf"))
            flat_out[torch.topk(frac, left).indices] += 1
        else:
            movable = flat_out > 1
            if _shift_all(flat_out, movable, flat_out - 1, -left, -1):
                continue
            over = (flat_out.float() - flat_share).masked_fill(~movable, float("-inf"))
            flat_out[torch.topk(over, -left).indices] -= 1
    return flat_out.view(capacity.shape)


def _shift_all(out: torch.Tensor, movable: torch.Tensor, slack: torch.Tensor, left: int, sign: int) -> bool:
    """While ``left`` covers every movable head, each round of rounding moves all of them by one: take as many
    of those rounds at once as leave every head within its ``slack`` (the loop's result, in one step; a head
    holding far less than its share, as uneven capacities make, otherwise costs a round per slot)."""
    count = int(movable.sum())
    if left < count:
        return False
    step = min(left // count, int(slack[movable].min()))
    out[movable] += sign * step
    return True


def headkv_budgets(
    total: int, scores: torch.Tensor, capacity: torch.Tensor, beta: float = 1.4, temperature: float = 1.0
) -> torch.Tensor:
    """HeadKV/REAL allocation: each head keeps a floor b − ⌊b/β⌋; a shared pool of ⌊b/β⌋·L·H slots
    is split by normalised head score ŝ (raised to ``temperature``). b = total / (L·H)."""
    heads = scores.numel()
    b = total / heads
    pool = float(int(b / beta) * heads)
    floor = b - int(b / beta)
    s = scores.float().clamp_min(0).pow(temperature)
    s = s / s.sum() if float(s.sum()) > 0 else torch.full_like(s, 1.0 / heads)
    return fill_to_total(floor + s * pool, total, capacity)


def head_scores(span, given: list[list[float]] | None, path: str | Path | None, which: str) -> torch.Tensor:
    """(L, H) head scores for ``span``'s model: ``given`` directly, else ``which`` score of its head profile
    (``ModelView.head_profile``). Scores of another shape than the model's (layers, KV heads) are refused,
    naming both."""
    scores = torch.tensor(given) if given is not None else span.model.head_profile(path).scores(which)
    expected = tuple(span.head_capacity().shape)
    if tuple(scores.shape) != expected:
        raise InvalidArgumentError(
            f"head scores have shape {tuple(scores.shape)}, the model has {expected} (layers, KV heads)"
        )
    return scores
