"""CompactCache: a transformers ``Cache`` whose layers (``compact_layer.py``) can be compacted in place
mid-session.

The logical length (what new positions count from) is separate from the slot counts, so tokens appended
after a compaction keep their true positions. Appends write into headroom left past each head's length;
a compaction allocates fresh, exactly-sized storage and drops the old, so the memory is really returned.

Snapshots are copy-on-write: ``snapshot()`` records the storage and each head's length without copying,
and nothing ever writes below a length a snapshot still refers to (appends write past it, compactions
and rebases allocate new storage, a truncation only lowers lengths and the next append into the
truncated part copies the storage first). ``restore()`` therefore gives back every head's keys, values,
β and positions bit for bit, whatever its length, at the cost of a few references.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

import torch
from transformers.cache_utils import Cache

from kvmemory.cache.compact_layer import (
    CompactLayer,
    LayerState,
)
from kvmemory.cache.plan import CompactionPlan
from kvmemory.errors import InvalidPlanError, KVMemoryDeprecationWarning


class AppendRows(NamedTuple):
    """What a forward appends to every layer: the tokens' ``Slots.meta`` rows (q, 4), and the logical and
    RoPE lengths once they are in."""

    meta: torch.Tensor
    logical_length: int
    rope_length: int


@dataclass
class CacheSnapshot:
    """A CompactCache's state at one moment: each layer's (shared) buffers and length, and the counters."""

    layers: list[LayerState]
    logical_length: int
    rope_length: int
    compactions: int
    default_segment: int
    growth_room: int | None


class CompactCache(Cache):
    """A cache of CompactLayers with a logical length that survives compaction.

    Appends go through ``update`` (called by every attention layer); the positions and segment id of the
    tokens being appended are set once per forward with ``begin_append``. Without that call, positions
    continue from the logical length, so ``model.generate(cache=CompactCache(...))`` also works.
    """

    def __init__(self, num_layers: int, storage_dtype: torch.dtype | None = None):
        """``storage_dtype``: what keys and values are stored in (``Engine.kv_dtype``); None keeps the
        dtype the model hands over. Attention reads them back in the queries' dtype."""
        super().__init__(layers=[CompactLayer(storage_dtype) for _ in range(num_layers)])
        self.logical_length = 0
        self.rope_length = 0  # the RoPE position the next token gets (below logical_length after a rebase)
        self.compactions = 0
        self._pending: AppendRows | None = None  # see begin_append
        self.default_segment = 0
        # rows every head takes after the next append before it is compacted (a memory manager sets it from its
        # cap; None: no bound): appends reserve no storage past it, so a capped session's bytes stay its cap's
        self.growth_room: int | None = None

    def begin_append(self, start: int, count: int, segment_id: int | list[int], device=None) -> int:
        """Make the next forward's ``count`` tokens sit at transcript positions ``start``, ``start + 1``, … of
        segment ``segment_id`` (or of each token's segment, a list). Returns the RoPE position of the first
        (below ``start`` once gaps are closed)."""
        self._pending = self.append_rows(start, count, segment_id, device)
        return self._pending.rope_length - count

    def append_rows(self, start: int, count: int, segment_id: int | list[int], device=None) -> AppendRows:
        """The metadata rows (``Slots.meta``) of ``count`` tokens appended from transcript position ``start``
        (of one segment, or each of its own: ``segment_id`` a list): made once per forward, written by every
        layer."""
        shift = self.rope_length - self.logical_length  # what closing gaps took off every later position
        segments = segment_id if isinstance(segment_id, list) else [segment_id] * count
        rows = [[0, p, p + shift, s] for p, s in zip(range(start, start + count), segments)]  # β = 0.0: bits 0
        meta = torch.tensor(rows, dtype=torch.int32, device=device)
        return AppendRows(meta, start + count, start + count + shift)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        meta = self._pending_meta(key_states.shape[2], key_states.device)
        keys, values = self.layers[layer_idx].update(key_states, value_states, meta, self.growth_room)
        self._layer_done(layer_idx)
        return keys, values

    def claim(self, q: int) -> torch.Tensor:
        """``update`` of every layer at once, without the writes (``CompactLayer.claim``): returns the (q, 4)
        metadata rows the caller writes with each layer's keys and values. The layers must hold storage
        already. One call per decode step instead of one per layer: a packed pass claims for every session."""
        meta = self._pending_meta(q, self.layers[0].device)
        for layer in self.layers:
            layer.claim(q, self.growth_room)
        self._layer_done(len(self.layers) - 1)
        return meta

    def _pending_meta(self, q: int, device) -> torch.Tensor:
        if self._pending is None or self._pending.meta.shape[0] != q:
            self._pending = self.append_rows(self.logical_length, q, self.default_segment, device)
        return self._pending.meta

    def _layer_done(self, layer_idx: int) -> None:
        if layer_idx == len(self.layers) - 1:
            self.logical_length, self.rope_length = self._pending.logical_length, self._pending.rope_length
            self._pending = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.logical_length

    @property
    def slots_per_head(self) -> int:
        """Slots per head as memory counts them: the mean over every layer's heads, rounded up (layers and
        heads may hold different counts), so ``slots_per_head × bytes_per_token`` bounds the KV bytes held."""
        total = sum(map(attrgetter("slot_count"), self.layers))  # read on every decoded token
        heads = sum(map(attrgetter("num_heads"), self.layers))
        return -(-total // heads) if heads else 0

    @property
    def longest_head(self) -> int:
        """The most slots any head holds (what the model's attention window must cover)."""
        return max(map(attrgetter("length"), self.layers))

    @property
    def physical_length(self) -> int:
        """Deprecated: ``slots_per_head``."""
        warnings.warn("CompactCache.physical_length is now slots_per_head", KVMemoryDeprecationWarning, stacklevel=2)
        return self.slots_per_head

    @property
    def longest_layer(self) -> int:
        """Deprecated: ``longest_head`` (the most slots one head holds, which it always meant)."""
        warnings.warn("CompactCache.longest_layer is now longest_head", KVMemoryDeprecationWarning, stacklevel=2)
        return self.longest_head

    def snapshot(self) -> CacheSnapshot:
        """Everything ``restore`` needs to give this cache back bit for bit (copy-on-write, see the module doc)."""
        return CacheSnapshot(
            [layer.snapshot() for layer in self.layers],
            self.logical_length,
            self.rope_length,
            self.compactions,
            self.default_segment,
            self.growth_room,
        )

    def restore(self, snapshot: CacheSnapshot) -> None:
        for layer, state in zip(self.layers, snapshot.layers):
            layer.restore(state)
        self.logical_length, self.rope_length = snapshot.logical_length, snapshot.rope_length
        self.compactions, self.default_segment = snapshot.compactions, snapshot.default_segment
        self.growth_room = snapshot.growth_room
        self._pending = None

    def clone(self) -> CompactCache:
        """An independent copy (for forks): live slots copied, nothing shared."""
        twin = CompactCache(len(self.layers))
        twin.layers = [layer.clone(self.growth_room) for layer in self.layers]  # each keeps its storage dtype
        twin.logical_length, twin.rope_length = self.logical_length, self.rope_length
        twin.growth_room = self.growth_room
        twin.compactions, twin.default_segment = self.compactions, self.default_segment
        return twin

    def truncate_positions(self, position: int) -> int:
        """Drop every slot whose original position is ≥ ``position`` (a re-rendered prefix).

        Each head's positions increase along its rows (appends come last, plans keep slots in order), so
        what goes is a suffix of every head and only the lengths change.

        Returns the logical length left: ``position``, or 0 when some head would be left empty and the
        cache had to be cleared (the caller re-prefills from there).
        """
        kept = [tuple(int((p < position).sum()) for p in layer.head_views("positions")) for layer in self.layers]
        if any(n == 0 for counts in kept for n in counts):
            for layer in self.layers:
                layer.reset()
            position = 0
        else:
            for layer, counts in zip(self.layers, kept):
                layer.truncate(counts)
        self.logical_length = position
        self.rope_length = max(
            (int(r.max()) + 1 for layer in self.layers if layer.slots is not None for r in layer.head_views("rope")),
            default=0,
        )
        self._pending = None
        return position

    def rebase(self, inv_freq: torch.Tensor) -> int:
        """Close the position gaps compaction left, per KV head: each slot's key is re-rotated so that its
        distance to the next token is the number of slots its head keeps after it. Heads keep different
        tokens, so only per-head ranks bound every distance by the head's slot count (a shared ranking over
        the union of kept tokens leaves distances of up to the number of distinct tokens any head kept).
        The newest slot of every head lands on the same position, so the recent window moves uniformly.

        Returns the shift applied to the newest token (the recent window moves by the same amount).
        """
        if not self.layers[0].is_initialized or self.slots_per_head == 0:
            return 0
        span = self.longest_head
        shift = span - self.rope_length
        tables = None
        for layer in self.layers:
            tables = layer.rebase(span, inv_freq, tables)
        self.rope_length = span
        return shift

    def apply_plan(self, plan: CompactionPlan, count: bool = True) -> None:
        """Validate the whole plan, then apply it to every layer (all or nothing)."""
        if len(plan.layers) != len(self.layers):
            raise InvalidPlanError(f"plan has {len(plan.layers)} layers, the cache has {len(self.layers)}")
        if any(not layer.is_initialized for layer in self.layers):
            raise InvalidPlanError("the cache is empty: nothing to compact")
        keeps = [layer.validate(lp, i) for i, (layer, lp) in enumerate(zip(self.layers, plan.layers))]
        for layer, lp, keep in zip(self.layers, plan.layers, keeps):
            layer.apply(lp, keep)
        if count:
            self.compactions += 1

    # ---- accounting ----------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of the slots held (what a memory cap constrains): every head pays for its own slots only."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def allocated_bytes(self) -> int:
        """Bytes of the tensors actually allocated (slots held plus bounded headroom for appends)."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_slot() for layer in self.layers)
