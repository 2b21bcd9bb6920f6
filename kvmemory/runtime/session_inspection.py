"""What a Session holds, measured: ``SessionStats`` (tokens, slots, bytes, compactions) and slots per segment."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch


@dataclass
class SessionStats:
    """What a session holds (the words are those of docs/architecture.md, "Words")."""

    logical_tokens: int  # tokens consumed: the transcript's length
    slots_per_head_by_layer: list[int]  # per layer: the mean slots of its KV heads, rounded up
    slots_per_head: int  # over the whole cache, as a slot cap counts them (layers may hold different counts)
    kv_bytes: int  # bytes of the slots held: every head pays for its own slots only
    allocated_bytes: int  # those plus the bounded headroom left for appends
    uncompacted_kv_bytes: int
    compactions: int
    segments: list[dict] = field(default_factory=list)
    query_bytes: int = 0  # reference queries held for compaction (selector window + context queries)

    @property
    def physical_slots(self) -> list[int]:
        """Deprecated: ``slots_per_head_by_layer``."""
        warnings.warn("SessionStats.physical_slots is now slots_per_head_by_layer", DeprecationWarning, stacklevel=2)
        return self.slots_per_head_by_layer

    @property
    def compression(self) -> float:
        return self.uncompacted_kv_bytes / self.kv_bytes if self.kv_bytes else 1.0


class SessionInspection:
    """Part of ``Session`` (``runtime/session.py``): stats."""

    def segment_slots(self) -> dict[int, float]:
        """Physical slots each segment holds, per KV head (mean over layers and heads)."""
        if not self.cache.layers[0].is_initialized:
            return {}
        seg_ids = torch.cat([layer.segments[:, : layer.length].flatten() for layer in self.cache.layers])
        counts = torch.bincount(seg_ids[seg_ids >= 0].long(), minlength=self._next_segment_id)
        per_head = self.cache.layers[0].num_heads * len(self.cache.layers)
        return {seg.id: float(counts[seg.id]) / per_head if seg.id < counts.numel() else 0.0 for seg in self.segments}

    def stats(self) -> SessionStats:
        with self._lock:
            slots = self.segment_slots()
            per_token = self.cache.bytes_per_token()
            per_segment = [
                {
                    "id": seg.id,
                    "kind": seg.kind,
                    "role": seg.role,
                    "tool_name": seg.tool_name,
                    "tokens": seg.length,
                    "slots": slots.get(seg.id, 0.0),
                    "bytes": int(slots.get(seg.id, 0.0) * per_token),
                    "ratio": seg.length / slots[seg.id] if slots.get(seg.id) else float("inf"),
                    "compactions": seg.compactions,
                    "cap_forced": seg.cap_forced,
                }
                for seg in self.segments
            ]
            return SessionStats(
                logical_tokens=len(self.tokens),
                slots_per_head_by_layer=[
                    -(-layer.slot_count // max(layer.num_heads, 1)) for layer in self.cache.layers
                ],
                slots_per_head=self.cache.slots_per_head,
                kv_bytes=self.cache.kv_bytes(),
                allocated_bytes=self.cache.allocated_bytes(),
                uncompacted_kv_bytes=self.cache.logical_length * per_token,
                compactions=self.cache.compactions,
                segments=per_segment,
                query_bytes=self.query_recorder.nbytes() if self.query_recorder is not None else 0,
            )
