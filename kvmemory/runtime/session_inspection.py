"""What a Session holds, measured: ``SessionStats`` (tokens, slots, bytes, compactions) and slots per segment."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch

from kvmemory.errors import KVMemoryDeprecationWarning


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
        warnings.warn(
            "SessionStats.physical_slots is now slots_per_head_by_layer", KVMemoryDeprecationWarning, stacklevel=2
        )
        return self.slots_per_head_by_layer

    @property
    def compression(self) -> float:
        return self.uncompacted_kv_bytes / self.kv_bytes if self.kv_bytes else 1.0


PUBLISH_EVERY = 0.5  # seconds: how often a long prefill leaves its stats for readers that will not wait


class SessionInspection:
    """Part of ``Session`` (``runtime/session.py``): stats."""

    def segment_slots(self) -> dict[int, float]:
        """Physical slots each segment holds, per KV head (mean over layers and heads)."""
        if not self.cache.layers[0].is_initialized:
            return {}
        seg_ids = torch.cat([layer.segments[:, : layer.length].flatten() for layer in self.cache.layers])
        counts = torch.bincount(seg_ids[seg_ids >= 0].long(), minlength=self._next_segment_id).tolist()
        per_head = self.cache.layers[0].num_heads * len(self.cache.layers)
        return {seg.id: counts[seg.id] / per_head if seg.id < len(counts) else 0.0 for seg in self.segments}

    def slots_before(self) -> torch.Tensor:
        """(T + 1,) slots over every layer and head whose position is below each index: positions [a, b) hold
        ``held[b] - held[a]``. One count over the cache serves every segment."""
        counts = torch.zeros(len(self.tokens), dtype=torch.long)
        for layer in self.cache.layers:
            if not layer.is_initialized:  # nothing cached yet
                continue
            pos = layer.positions[:, : layer.length]
            counts += torch.bincount(pos[pos >= 0].cpu(), minlength=len(counts))[: len(counts)]
        return torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])

    def attention_shares(self, groups: list[torch.Tensor]) -> list[float]:
        """Share of the attention the recorded selector-window queries give each group of positions (summed
        over layers and heads; positions in no group count toward none). Equal shares without a window."""
        recorder = self.query_recorder
        if recorder is None or not recorder.has_window:
            return [1.0] * len(groups)
        scale = self.engine.head_dim**-0.5
        owner = torch.full((len(self.tokens) + 1,), len(groups), dtype=torch.long)  # last: no group
        for i, positions in enumerate(groups):
            owner[positions] = i
        mass = torch.zeros(len(groups) + 1, dtype=torch.float64)
        with torch.no_grad():
            for li, layer in enumerate(self.cache.layers):
                q = recorder.window_queries(li).float()
                keys = layer.keys[0, :, : layer.length].float()
                logits = torch.einsum("hmd,hsd->hms", q, keys) * scale + layer.bias[0, :, None, : layer.length]
                attn = torch.softmax(logits, -1).mean(1)  # (H, S)
                pos = layer.positions[:, : layer.length].cpu()
                index = torch.where(pos >= 0, owner[pos.clamp_min(0)], len(groups))
                mass.index_add_(0, index.flatten(), attn.cpu().double().flatten())
        mass = mass[:-1]
        return (mass / mass.sum().clamp_min(1e-12)).tolist()

    def stats(self, wait: float | None = None) -> SessionStats:
        """What the session holds now. ``wait``: the most seconds to wait for a call in progress (a prefill of
        thousands of tokens holds the session for seconds); past it, the stats as that call last published them
        (at its last chunk), so that a monitor never waits for compute."""
        if not self._lock.acquire(timeout=-1 if wait is None else wait):
            if self._published is not None:
                return self._published[1]
            self._lock.acquire()
        try:
            return self._measure()
        finally:
            self._lock.release()

    def _publish_stats(self, now: bool = False) -> None:
        """Leave the stats for readers that will not wait (``stats(wait=...)``): ``now`` (between the chunks of
        a long prefill), else at most every ``PUBLISH_EVERY`` seconds (a thousand short messages in a row)."""
        if now or self._published is None or time.monotonic() - self._published[0] > PUBLISH_EVERY:
            self._published = (time.monotonic(), self._measure())

    def _measure(self) -> SessionStats:
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
