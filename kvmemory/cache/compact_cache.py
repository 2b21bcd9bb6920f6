"""CompactCache: a transformers ``Cache`` whose layers can be compacted in place mid-session.

Per layer and KV head, every physical slot holds a key (RoPE-rotated at the token's original position),
a value, an additive attention bias β (fp32: 0 for verbatim tokens, fitted for compacted slots, −∞ for
padding), the token's original (logical) position and the id of the segment it came from.

The logical length (what new positions count from) is separate from the physical slot count, so tokens
appended after a compaction keep their true positions. Slots live in buffers with a little headroom so
decoding does not reallocate every step; a compaction allocates fresh, exactly-sized buffers and drops
the old ones, so the memory is really returned.

Snapshots are copy-on-write: ``snapshot()`` records each layer's buffers and length without copying, and
nothing ever writes below a length a snapshot still refers to (appends write past it, compactions and
rebases allocate new buffers, a truncation only lowers the length and the next append into the
truncated part copies the buffers first). ``restore()`` therefore gives back every layer's keys, values,
β and positions bit for bit, whatever the layers' lengths, at the cost of a few references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvmemory.cache.plan import CompactionPlan, LayerPlan, pad_selection
from kvmemory.errors import InvalidPlanError

PAD_POSITION = -1
NEG_INF = float("-inf")


def _headroom(slots: int) -> int:
    """Spare slots allocated beyond what is needed: bounded, so allocated bytes track used bytes."""
    return max(64, min(512, slots // 8))


def rotate(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Apply a RoPE rotation by ``delta`` positions (H, S) to keys (H, S, D) already rotated (HF half layout)."""
    angles = delta[..., None].float() * inv_freq.float().to(keys.device)
    emb = torch.cat([angles, angles], dim=-1)
    k = keys.float()
    half = k.shape[-1] // 2
    rotated_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return (k * emb.cos() + rotated_half * emb.sin()).to(keys.dtype)


class CompactLayer(CacheLayerMixin):
    """One layer's compactable KV storage (batch size 1: a session is one sequence)."""

    is_compileable = False
    is_sliding = False

    def __init__(self):
        super().__init__()
        self.bias: torch.Tensor | None = None  # (1, H, cap) fp32
        self.positions: torch.Tensor | None = None  # (H, cap) int32: the token's index in the transcript
        self.rope: torch.Tensor | None = None  # (H, cap) int32: the position its key is rotated at
        self.segments: torch.Tensor | None = None  # (H, cap) int32
        self.length = 0
        self.biased = False  # True once any slot has a non-zero β (then attention must add it)
        self.shared_length = 0  # slots [0, shared_length) of these buffers belong to a snapshot too

    # ---- transformers' layer interface ---------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        _, heads, _, head_dim = key_states.shape
        self._allocate(heads, head_dim, value_states.shape[-1], 0)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, positions=None, segment_ids=None, rope=None, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        if self.length < self.shared_length:  # writing over slots a snapshot still holds: copy first
            self._reallocate(self.length + q)
        self._ensure_capacity(self.length + q)
        end = self.length + q
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.bias[:, :, self.length : end] = 0.0
        self.positions[:, self.length : end] = positions.to(self.positions)
        self.rope[:, self.length : end] = (positions if rope is None else rope).to(self.rope)
        self.segments[:, self.length : end] = segment_ids.to(self.segments)
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("CompactCache holds one sequence; beam search is not supported")

    # ---- kvmemory ------------------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def attention_bias(self) -> torch.Tensor | None:
        """(1, H, S) fp32 β of the live slots, or None when every β is 0 (the fast path)."""
        return self.bias[:, :, : self.length] if self.biased else None

    def _allocate(self, heads: int, key_dim: int, value_dim: int, capacity: int) -> None:
        kw = dict(dtype=self.dtype, device=self.device)
        # slots past ``length`` are never read, so keys and values need no initialisation
        self.keys = torch.empty(1, heads, capacity, key_dim, **kw)
        self.values = torch.empty(1, heads, capacity, value_dim, **kw)
        self.bias = torch.zeros(1, heads, capacity, dtype=torch.float32, device=self.device)
        self.positions = torch.full((heads, capacity), PAD_POSITION, dtype=torch.int32, device=self.device)
        self.rope = torch.full((heads, capacity), PAD_POSITION, dtype=torch.int32, device=self.device)
        self.segments = torch.full((heads, capacity), -1, dtype=torch.int32, device=self.device)
        self.shared_length = 0

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.capacity:
            self._reallocate(needed)

    def _reallocate(self, needed: int) -> None:
        """Move the live slots into fresh buffers with room for ``needed`` slots."""
        old = (self.keys, self.values, self.bias, self.positions, self.segments, self.rope)
        self._allocate(self.num_heads, self.keys.shape[-1], self.values.shape[-1], needed + _headroom(needed))
        n = self.length
        self.keys[:, :, :n] = old[0][:, :, :n]
        self.values[:, :, :n] = old[1][:, :, :n]
        for new, prev in zip((self.bias, self.positions, self.segments, self.rope), old[2:]):
            new[..., :n] = prev[..., :n]

    def truncate(self, length: int) -> None:
        """Forget the slots from ``length`` on. Only the length changes (slots past it are never read), so
        a snapshot sharing these buffers stays intact."""
        self.length = min(self.length, length)
        if self.keys is not None:
            self.biased = bool((self.bias[..., : self.length] != 0).any())

    STATE = ("keys", "values", "bias", "positions", "rope", "segments", "length", "biased", "is_initialized")

    def snapshot(self) -> tuple:
        """This layer's buffers and length, shared, not copied (see the module docstring)."""
        self.shared_length = max(self.shared_length, self.length)
        return tuple(getattr(self, name, None) for name in self.STATE) + (self.shared_length,)

    def restore(self, state: tuple) -> None:
        for name, value in zip(self.STATE + ("shared_length",), state):
            setattr(self, name, value)
        if self.keys is not None:
            self.dtype, self.device = self.keys.dtype, self.keys.device

    def clone(self) -> CompactLayer:
        """An independent copy holding only the live slots (plus headroom)."""
        twin = CompactLayer()
        if self.keys is not None:
            twin.dtype, twin.device, twin.is_initialized = self.dtype, self.device, self.is_initialized
            twin._allocate(
                self.num_heads, self.keys.shape[-1], self.values.shape[-1], self.length + _headroom(self.length)
            )
            n = twin.length = self.length
            twin.keys[:, :, :n], twin.values[:, :, :n] = self.keys[:, :, :n], self.values[:, :, :n]
            for name in ("bias", "positions", "rope", "segments"):
                getattr(twin, name)[..., :n] = getattr(self, name)[..., :n]
            twin.biased = self.biased
        return twin

    def validate(self, plan: LayerPlan, layer_idx: int) -> list[torch.Tensor]:
        keep = plan.keep_per_head()
        where = f"layer {layer_idx}"
        if len(keep) != self.num_heads:
            raise InvalidPlanError(f"{where}: plan has {len(keep)} KV heads, the cache has {self.num_heads}")
        t_max = max((k.numel() for k in keep), default=0)
        if t_max == 0:
            raise InvalidPlanError(f"{where}: every head would keep zero slots")
        for h, idx in enumerate(keep):
            if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32):
                raise InvalidPlanError(f"{where} head {h}: keep must be a 1-D integer tensor")
            if idx.numel() == 0:
                raise InvalidPlanError(f"{where} head {h}: keeps zero slots (a head needs at least one)")
        if not self._keep_is_valid(keep):  # one batched check; the per-head pass below names the problem
            self._check_keep_per_head(keep, where)
        if plan.values is not None and tuple(plan.values.shape) != (self.num_heads, t_max, self.values.shape[-1]):
            raise InvalidPlanError(
                f"{where}: values must be {(self.num_heads, t_max, self.values.shape[-1])}, got "
                f"{tuple(plan.values.shape)}"
            )
        if plan.bias is not None and tuple(plan.bias.shape) != (self.num_heads, t_max):
            raise InvalidPlanError(f"{where}: bias must be {(self.num_heads, t_max)}, got {tuple(plan.bias.shape)}")
        if plan.bias is not None and bool((torch.isnan(plan.bias) | (plan.bias == float("inf"))).any()):
            raise InvalidPlanError(f"{where}: bias contains NaN or +infinity (β must be finite or −∞)")
        if plan.values is not None and not bool(torch.isfinite(plan.values).all()):
            raise InvalidPlanError(f"{where}: values contain NaN or infinity")
        return keep

    def _keep_is_valid(self, keep: list[torch.Tensor]) -> bool:
        """In range, strictly increasing, no padding kept: every head at once, one sync."""
        index, valid = pad_selection(keep, self.device)
        in_range = ((index >= 0) & (index < self.length)) | ~valid
        increasing = (index[:, 1:] > index[:, :-1]) | ~valid[:, 1:]
        padding = (self.positions.gather(1, index.clamp(0, max(self.length - 1, 0))) == PAD_POSITION) & valid
        return bool(in_range.all() & increasing.all() & ~padding.any())

    def _check_keep_per_head(self, keep: list[torch.Tensor], where: str) -> None:
        for h, idx in enumerate(keep):
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.length:
                raise InvalidPlanError(f"{where} head {h}: slot index out of range [0, {self.length}): {lo}..{hi}")
            if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
                raise InvalidPlanError(f"{where} head {h}: kept slot indices must be strictly increasing")
            if bool((self.positions[h, idx.to(self.positions.device)] == PAD_POSITION).any()):
                raise InvalidPlanError(f"{where} head {h}: a kept slot is padding")

    def apply(self, plan: LayerPlan, keep: list[torch.Tensor]) -> None:
        """Rebuild this layer from a validated plan into fresh, exactly-sized buffers."""
        heads, t_max = self.num_heads, max(k.numel() for k in keep)
        dev = self.device
        index, valid = pad_selection(keep, dev)

        def gather(t: torch.Tensor) -> torch.Tensor:  # (H, cap, ...) -> (H, t_max, ...)
            ix = index.view(heads, t_max, *([1] * (t.dim() - 2))).expand(heads, t_max, *t.shape[2:])
            return torch.gather(t, 1, ix)

        keys = gather(self.keys[0])
        values = plan.values.to(self.values) if plan.values is not None else gather(self.values[0])
        bias = plan.bias.to(dev, torch.float32) if plan.bias is not None else gather(self.bias[0])
        positions, segments, rope = gather(self.positions), gather(self.segments), gather(self.rope)
        if not bool(valid.all()):  # heads keep different counts: mark the shorter heads' tails as padding
            values = torch.where(valid[..., None], values, torch.zeros((), dtype=values.dtype, device=dev))
            bias = torch.where(valid, bias, torch.full((), NEG_INF, device=dev))
            positions = torch.where(valid, positions, torch.full((), PAD_POSITION, dtype=positions.dtype, device=dev))
            segments = torch.where(valid, segments, torch.full((), -1, dtype=segments.dtype, device=dev))
            rope = torch.where(valid, rope, torch.full((), PAD_POSITION, dtype=rope.dtype, device=dev))

        self._allocate(heads, keys.shape[-1], values.shape[-1], t_max + _headroom(t_max))
        self.keys[0, :, :t_max] = keys
        self.values[0, :, :t_max] = values
        self.bias[0, :, :t_max] = bias
        self.positions[:, :t_max] = positions
        self.segments[:, :t_max] = segments
        self.rope[:, :t_max] = rope
        self.length = t_max
        self.biased = bool((bias != 0).any())

    def padding_slots(self) -> int:
        return int((self.positions[:, : self.length] == PAD_POSITION).sum()) if self.keys is not None else 0

    def bytes_per_slot(self) -> int:
        """Bytes one physical slot costs across this layer's heads (keys, values, β, position, segment, rope)."""
        if self.keys is None:
            return 0
        kv = (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()
        return self.num_heads * (kv + 4 + 4 + 4 + 4)

    def allocated_bytes(self) -> int:
        if self.keys is None:
            return 0
        tensors = (self.keys, self.values, self.bias, self.positions, self.segments, self.rope)
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class CacheSnapshot:
    """A CompactCache's state at one moment: each layer's (shared) buffers and length, and the counters."""

    layers: list[tuple]
    logical_length: int
    rope_length: int
    compactions: int
    default_segment: int


class CompactCache(Cache):
    """A cache of CompactLayers with a logical length that survives compaction.

    Appends go through ``update`` (called by every attention layer); the positions and segment id of the
    tokens being appended are set once per forward with ``begin_append``. Without that call, positions
    continue from the logical length, so ``model.generate(cache=CompactCache(...))`` also works.
    """

    def __init__(self, num_layers: int):
        super().__init__(layers=[CompactLayer() for _ in range(num_layers)])
        self.logical_length = 0
        self.rope_length = 0  # the RoPE position the next token gets (below logical_length after a rebase)
        self.compactions = 0
        self._pending_positions: torch.Tensor | None = None
        self._pending_segment = 0
        self.default_segment = 0

    def begin_append(self, positions: torch.Tensor, segment_id: int) -> None:
        self._pending_positions = positions
        self._pending_segment = segment_id

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        q = key_states.shape[2]
        positions = self._pending_positions
        if positions is None or positions.numel() != q:
            positions = torch.arange(self.logical_length, self.logical_length + q, device=key_states.device)
            self._pending_positions = positions
            self._pending_segment = self.default_segment
        segment_ids = torch.full((q,), self._pending_segment, dtype=torch.int32)
        rope = positions - self.logical_length + self.rope_length
        keys, values = self.layers[layer_idx].update(
            key_states, value_states, positions=positions, segment_ids=segment_ids, rope=rope
        )
        if layer_idx == len(self.layers) - 1:
            self.logical_length = int(positions.max()) + 1
            self.rope_length = int(rope.max()) + 1
            self._pending_positions = None
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.logical_length

    @property
    def physical_length(self) -> int:
        """Slots per layer as memory counts them: the mean over layers, rounded up (layers may differ after a
        per-layer budget), so ``physical_length × bytes_per_token`` bounds the KV bytes held."""
        total = sum(layer.length for layer in self.layers)
        return -(-total // len(self.layers))

    @property
    def longest_layer(self) -> int:
        """The most slots any layer holds (what the model's attention window must cover)."""
        return max(layer.length for layer in self.layers)

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """RoPE positions for tokens appended at transcript ``positions`` (≥ the logical length)."""
        return positions - self.logical_length + self.rope_length

    def snapshot(self) -> CacheSnapshot:
        """Everything ``restore`` needs to give this cache back bit for bit (copy-on-write, see the module doc)."""
        return CacheSnapshot(
            [layer.snapshot() for layer in self.layers],
            self.logical_length,
            self.rope_length,
            self.compactions,
            self.default_segment,
        )

    def restore(self, snapshot: CacheSnapshot) -> None:
        for layer, state in zip(self.layers, snapshot.layers):
            layer.restore(state)
        self.logical_length, self.rope_length = snapshot.logical_length, snapshot.rope_length
        self.compactions, self.default_segment = snapshot.compactions, snapshot.default_segment
        self._pending_positions = None

    def clone(self) -> CompactCache:
        """An independent copy (for forks): live slots copied, nothing shared."""
        twin = CompactCache(len(self.layers))
        twin.layers = [layer.clone() for layer in self.layers]
        twin.logical_length, twin.rope_length = self.logical_length, self.rope_length
        twin.compactions, twin.default_segment = self.compactions, self.default_segment
        return twin

    def truncate_positions(self, position: int) -> int:
        """Drop every slot whose original position is ≥ ``position`` (a re-rendered prefix).

        Returns the logical length left: ``position``, or 0 when some head would be left empty and the
        cache had to be cleared (the caller re-prefills from there).
        """
        keeps = [
            [
                torch.nonzero((p[: layer.length] >= 0) & (p[: layer.length] < position)).flatten()
                for p in layer.positions
            ]
            for layer in self.layers
        ]
        if any(k.numel() == 0 for keep in keeps for k in keep):
            for layer in self.layers:
                layer.reset()
            position = 0
        elif all(int(k[-1]) == k.numel() - 1 and k.numel() == keep[0].numel() for keep in keeps for k in keep):
            for layer, keep in zip(self.layers, keeps):  # a plain suffix: cut it off in place
                layer.truncate(keep[0].numel())
        else:
            self.apply_plan(CompactionPlan([LayerPlan(keep=k) for k in keeps], method="truncate"), count=False)
        self.logical_length = position
        self.rope_length = max(
            (int(layer.rope[:, : layer.length].max()) + 1 for layer in self.layers if layer.length), default=0
        )
        self._pending_positions = None
        return position

    def rebase(self, inv_freq: torch.Tensor) -> int:
        """Close the position gaps compaction left, per KV head: each slot's key is re-rotated so that its
        distance to the next token is the number of slots its head keeps after it. Heads keep different
        tokens, so only per-head ranks bound every distance by the head's slot count (a shared ranking over
        the union of kept tokens leaves distances of up to the number of distinct tokens any head kept).
        The newest slot of every head lands on the same position, so the recent window moves uniformly.

        Returns the shift applied to the newest token (the recent window moves by the same amount).
        """
        if not self.layers[0].is_initialized or self.physical_length == 0:
            return 0
        counts = [(layer.positions[:, : layer.length] >= 0).sum(1) for layer in self.layers]
        span = max(int(c.max()) for c in counts)
        shift = span - self.rope_length
        for layer, count in zip(self.layers, counts):
            n = layer.length
            old = layer.rope[:, :n].long()
            valid = layer.positions[:, :n] >= 0
            new = span - count[:, None] + torch.cumsum(valid.long(), dim=1) - 1  # right-aligned rank per head
            delta = torch.where(valid, new - old, torch.zeros_like(old))
            layer._reallocate(n)  # new buffers: a snapshot keeps the unrotated keys
            layer.keys[0, :, :n] = rotate(layer.keys[0, :, :n], delta, inv_freq)
            layer.rope[:, :n] = torch.where(valid, new, old).to(layer.rope)
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
        """Bytes of the live physical slots (what a memory cap constrains)."""
        return sum(layer.length * layer.bytes_per_slot() for layer in self.layers)

    def allocated_bytes(self) -> int:
        """Bytes of the tensors actually allocated (live slots plus bounded headroom)."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_slot() for layer in self.layers)

    def padding_overhead(self) -> float:
        """Fraction of physical slots that are padding (heads with smaller budgets than their layer's longest)."""
        total = sum(layer.length * layer.num_heads for layer in self.layers)
        return sum(layer.padding_slots() for layer in self.layers) / total if total else 0.0
