"""What the runtime is asked to compact (``SpanJob``) and what one compaction did (``CompactionRecord``).

Plain values: the memory manager writes jobs, the runtime's compactor (``runtime/session_compaction.py``)
runs them through a method and answers with records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvmemory.compaction.base import CompactionMethod


@dataclass
class SpanJob:
    """One span to compact: its logical positions, the method, and slots per head (int) or an (L, H) budget."""

    positions: torch.Tensor
    method: CompactionMethod | str
    slots: int | torch.Tensor
    query_source: str | list[str] = "window"
    protected_positions: set[int] | None = None
    # uneven head budgets: no head keeps more than this many times the span's mean budget (None: no bound)
    max_head_ratio: float | None = None


@dataclass
class CompactionRecord:
    """What one compaction did (kept in ``session.compaction_log``)."""

    method: str
    trigger: str
    segments: list[int]
    tokens: int
    slots_before: int  # the span's slots per head before (mean over layers and heads)
    slots_after: int
    milliseconds: float
    reconstruction_error: float | None  # relative error of span output·mass on the reference queries

    def to_dict(self) -> dict:
        return asdict(self)
