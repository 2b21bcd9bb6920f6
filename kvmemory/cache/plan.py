"""Compaction plans: which physical slots each KV head keeps, and optionally what they now hold.

A plan is the only way a cache's contents change other than by appending. Methods produce plans; the
cache validates a whole plan before touching any layer, so a bad plan leaves the cache as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmemory.errors import InvalidPlanError


def pad_selection(keep: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, t_max) indices (padding → 0) and (H, t_max) validity mask from per-head index lists."""
    lengths = torch.tensor([k.numel() for k in keep], device=device)
    index = torch.nn.utils.rnn.pad_sequence([k.to(device, torch.long) for k in keep], batch_first=True)
    return index, torch.arange(index.shape[1], device=device) < lengths[:, None]


@dataclass
class LayerPlan:
    """The new contents of one layer.

    keep: per KV head, the current physical slot indices to keep, strictly increasing. Either a list of
        1-D tensors (heads may keep different numbers of slots) or an (H, t) tensor.
    values: optional (H, t_max, D) replacement values, aligned with ``keep`` (padded rows ignored).
    bias: optional (H, t_max) replacement β (fp32), aligned with ``keep``.
    """

    keep: list[torch.Tensor] | torch.Tensor
    values: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def keep_per_head(self) -> list[torch.Tensor]:
        if isinstance(self.keep, torch.Tensor):
            if self.keep.dim() != 2:
                raise InvalidPlanError(f"keep must be (heads, slots), got shape {tuple(self.keep.shape)}")
            return list(self.keep.unbind(0))
        return list(self.keep)


@dataclass
class CompactionPlan:
    """One LayerPlan per model layer, plus free-form provenance for telemetry."""

    layers: list[LayerPlan]
    method: str = "custom"
    info: dict = field(default_factory=dict)

    @classmethod
    def keep_all(cls, cache) -> CompactionPlan:
        """The identity plan: every head keeps every slot as it is."""
        layers = []
        for layer in cache.layers:
            n = layer.length
            layers.append(LayerPlan(keep=torch.arange(n).expand(layer.num_heads, n).clone()))
        return cls(layers=layers, method="keep_all")
