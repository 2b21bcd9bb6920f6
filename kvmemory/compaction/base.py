"""The interface every compaction method implements: (a span of the cache, reference queries, budgets) → result.

Methods are pure tensor code. They see a ``CacheSpan``: for each layer, the span's slots per KV head
(padded to the longest head, with a validity mask), the reference queries grouped by KV head, and the
span's token ids. They return, per layer, which span slots each head keeps and optionally new values
and β for them. The runtime turns that into a ``CompactionPlan`` for the whole cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from kvmemory.errors import InvalidArgumentError

NEG_INF = float("-inf")


class MethodConfig(BaseModel):
    """Base of every method's config (validated: unknown or out-of-range fields fail at construction)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class LayerSpan:
    """One layer's view of the span. H = KV heads, n = longest head's span slots, m = reference queries."""

    layer: int
    keys: torch.Tensor  # (H, n, D) post-RoPE
    values: torch.Tensor  # (H, n, Dv)
    bias: torch.Tensor  # (H, n) fp32, existing β (0 for verbatim slots, −∞ for padding)
    positions: torch.Tensor  # (H, n) logical positions (−1 for padding)
    valid: torch.Tensor  # (H, n) bool
    scale: float
    queries: torch.Tensor | None = None  # (H, m, D) post-RoPE, GQA group members stacked
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_heads(self) -> int:
        return self.keys.shape[0]

    def logits(self, queries: torch.Tensor | None = None) -> torch.Tensor:
        """(H, m, n) fp32 attention logits of the queries to the span slots, β included, padding at −∞.

        For the span's own reference queries the result is computed once and reused."""
        if queries is None and "logits" in self._cache:
            return self._cache["logits"]
        q = self.queries if queries is None else queries
        s = torch.einsum("hmd,hnd->hmn", q.float(), self.keys.float()).mul_(self.scale)
        if bool(self.bias.ne(0).any()):  # β of compacted slots, −∞ of padding
            s.add_(self.bias[:, None, :])
        if queries is None:
            self._cache["logits"] = s
        return s

    def mass_terms(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(Φ = exp(S − rowmax), rowmax, Σ_j Φ) for the reference queries, computed once."""
        if "phi" not in self._cache:
            logits = self.logits()
            row_max = logits.amax(dim=-1, keepdim=True).clamp_min(-1e30)
            phi = torch.exp(logits - row_max)
            self._cache.update(phi=phi, row_max=row_max, row_mass=phi.sum(-1))
        return self._cache["phi"], self._cache["row_max"], self._cache["row_mass"]

    def release(self) -> None:
        """Drop the logits and masses cached for the reference queries: a method that is done with this
        layer calls it, so the span never holds one (H, m, n) matrix per layer at once."""
        self._cache.clear()

    def attention(self, queries: torch.Tensor | None = None) -> torch.Tensor:
        """(H, m, n) attention of each query over the span alone."""
        if queries is not None:
            return torch.softmax(self.logits(queries), dim=-1).nan_to_num(0.0)
        phi, _, row_mass = self.mass_terms()
        return phi / row_mass.clamp_min(1e-30)[..., None]


class ModelView(Protocol):
    """What a method may ask of the model (the counter-causal score, REAL's head profile), answered by the
    runtime, which owns the model and the cache: methods never see a live session, a model or a cache."""

    logical_length: int  # positions the session has consumed (its last token is ``logical_length - 1``)

    def own_token_logits(
        self, positions: torch.Tensor, fast: bool, pause: Callable[[], None] = lambda: None
    ) -> torch.Tensor:
        """(N,) each position's LM-head logit of its own token when it is re-read attending only to strictly
        later cached slots; ``fast``: from the stored last-layer inputs where every position has one."""

    def head_profile(self, path: str | None = None):
        """The model's REAL head profile (a ``HeadProfile``: ``.scores(which)`` gives (L, H) scores): the
        file at ``path``, else the one shipped or cached for the model, else one made now."""


@dataclass
class CacheSpan:
    """The part of a session's cache to compact, across all layers."""

    layers: list[LayerSpan]
    token_of_position: dict[int, int] = field(default_factory=dict)  # logical position → token id
    text_of_token: callable = None  # token id → its text (for text-aware methods like TAM)
    model: ModelView | None = None  # for methods that score with the model (counter-causal)
    protected_positions: set[int] = field(default_factory=set)  # positions a method must keep verbatim
    surprisal: torch.Tensor | None = None  # each token's surprisal by logical position (NaN unknown), if recorded
    query_group_size: int = 1  # G: reference query rows per token and KV head
    head_limit: int | None = None  # the most slots one head may keep of the span (methods that move budgets)
    # called between the pieces of a method's work: the runtime lets other sessions' passes run there
    pause: Callable[[], None] = lambda: None

    def each_layer(self) -> Iterator[LayerSpan]:
        """The layers in order, as a method works through them: once the method is done with a layer its
        cached logits are dropped and the runtime may run other sessions' passes (``pause``), so a long
        compaction holds the model for one layer's work at a time."""
        for layer in self.layers:
            yield layer
            layer.release()
            self.pause()

    def head_capacity(self) -> torch.Tensor:
        """(L, H) slots each head may keep: what it holds of the span, within ``head_limit``."""
        capacity = torch.stack([layer.valid.sum(1) for layer in self.layers])
        return capacity if self.head_limit is None else capacity.clamp_max(self.head_limit)


@dataclass
class LayerResult:
    """Per head, the kept span-local slot indices (sorted), plus optional new values / β aligned with them."""

    keep: list[torch.Tensor]
    values: torch.Tensor | None = None  # (H, t_max, Dv)
    bias: torch.Tensor | None = None  # (H, t_max)


class CompactionMethod(ABC):
    """A compaction method: turns a span and per-(layer, head) budgets into per-layer results."""

    name: ClassVar[str]
    Config: ClassVar[type[MethodConfig]]
    uses_queries: ClassVar[bool] = True
    global_scores: ClassVar[bool] = False  # slot scores mean the same in every segment (one selection may span many)

    def __init__(self, config: MethodConfig | None = None, **params):
        self.config = config if config is not None else self.Config(**params)

    @property
    def needs_last_layer_inputs(self) -> bool:
        """Whether the method reads each position's input to the last decoder layer (the session records
        them once a method that needs them is attached)."""
        return False

    @property
    def needs_surprisal(self) -> bool:
        """Whether the method ranks by each token's surprisal (the session records it once a method that
        needs it is attached)."""
        return False

    @abstractmethod
    def compact(self, span: CacheSpan, budgets: torch.Tensor) -> list[LayerResult]:
        """``budgets``: (L, H) slots each head may keep of the span."""

    def position_scores(self, span: CacheSpan):
        """One score per logical position of the span, the same in every head (higher is kept first): a
        ``PositionScores`` (``compaction/position_scores.py``). Wrappers that keep the same tokens in every
        head rank by it (``Lines``); a method that can rank positions overrides this."""
        raise InvalidArgumentError(
            f"{self.name} does not rank positions, so it cannot be wrapped by a method that keeps the same tokens "
            "in every head (such as lines)"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"


def topk_per_head(
    scores: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor, forced: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Sorted indices of the top-``budget[h]`` valid slots per head; ``forced`` slots are taken first."""
    scores = scores.float().masked_fill(~valid, NEG_INF)
    if forced is not None:
        scores = torch.where(forced & valid, torch.full_like(scores, float("inf")), scores)
    keep = []
    for h in range(scores.shape[0]):
        k = min(max(int(budget[h]), 1), int(valid[h].sum()))  # at least one slot of a head that has any
        idx = torch.topk(scores[h], k).indices
        keep.append(torch.sort(idx).values)
    return keep


def edge_mask(span: LayerSpan, first: int, last: int) -> torch.Tensor:
    """(H, n) True for each head's first ``first`` and last ``last`` valid slots (sinks / recent window)."""
    order = torch.cumsum(span.valid.long(), dim=1)
    count = order[:, -1:]
    return span.valid & ((order <= first) | (order > count - last))


def protected_mask(span: CacheSpan, layer: LayerSpan) -> torch.Tensor | None:
    if not span.protected_positions:
        return None
    prot = torch.tensor(sorted(span.protected_positions), device=layer.positions.device)
    return torch.isin(layer.positions, prot) & layer.valid
