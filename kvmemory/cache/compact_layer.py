"""CompactLayer: one layer of a ``CompactCache``, its slots stored ragged per KV head.

Per layer and KV head, every slot holds a key (RoPE-rotated at the token's original position), a value,
an additive attention bias β (fp32: 0 for verbatim tokens, fitted for compacted slots), the token's
original (logical) position, the RoPE position its key is rotated at and the id of the segment it came
from.

Storage is ragged per KV head, so a head costs exactly the slots it keeps. Keys, values and the four small
fields (one int32 row per slot) are flat tensors whose rows are grouped by head: head h owns rows ``[start[h],
start[h] + capacity[h])`` and uses the first ``length[h]`` of them (``Slots`` and ``CompactLayer``). When
every head has the same capacity the flat tensors are exactly the usual (heads, slots, dim) layout, read
through views with no copy; heads with different budgets (REAL, AdaKV-style sharing, TAM's per-head budgets)
each keep only their own slots, and attention reads each head's rows directly (``kvmemory.attention``).
Nothing is padded, so a cache's bytes are its kept slots' bytes. Compaction code that wants whole-layer
tensors reads ``keys``/``values``/``bias``/``positions``/``rope``/``segments``: (heads, longest head, ...)
views, or for uneven heads a padded copy (keys and values 0, β −∞, positions −1 on each shorter head's tail).
Keys and values are stored in the engine's ``kv_dtype``; 8-bit rows carry their own scale
(``kvmemory.cache.int8_rows``), and those views, and what ``update`` hands attention, decode them to fp32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import CacheLayerMixin

from kvmemory.cache import int8_rows
from kvmemory.cache.plan import LayerPlan, pad_selection
from kvmemory.errors import InvalidPlanError

PAD_POSITION = -1
NEG_INF = float("-inf")
META_BYTES = 4 + 4 + 4 + 4  # β, position, RoPE position and segment id of one slot of one head


def _headroom(slots: int, room: int | None = None) -> int:
    """Spare slots allocated beyond what is needed: bounded, so allocated bytes track used bytes, and never past
    ``room``, the rows a head will still take before it is compacted (``CompactCache.growth_room``)."""
    spare = max(64, min(512, slots // 8))
    return spare if room is None else max(0, min(spare, room))


def rotation_tables(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (..., D) of a RoPE rotation by ``delta`` positions (...), in the HF half layout."""
    angles = delta[..., None].float() * inv_freq.float().to(delta.device)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def rotate(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply a further RoPE rotation to keys (..., D) already rotated (HF half layout); ``cos`` and ``sin`` are
    ``rotation_tables`` of how many positions each key moves."""
    k = keys.float()
    half = k.shape[-1] // 2
    rotated_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return (k * cos + rotated_half * sin).to(keys.dtype)


FIELDS = ("keys", "values", "bias", "positions", "rope", "segments")  # what a slot holds (module docstring)


class Slots(NamedTuple):
    """One layer's storage, rows grouped by KV head (never mutated as a tuple, so a snapshot can hold it).

    A slot's four small fields share one int32 row of ``meta``: β's fp32 bits, position, RoPE position and
    segment id. Appending a token then writes three rows per layer instead of six, and each write costs a
    few µs of a decoded token; ``bias``, ``positions``, ``rope`` and ``segments`` are views of its columns."""

    keys: torch.Tensor  # (N, D)
    values: torch.Tensor  # (N, Dv)
    meta: torch.Tensor  # (N, 4) int32

    @classmethod
    def of(cls, keys, values, bias, positions, rope, segments) -> Slots:
        """Storage from separate fields (shaped alike but for the key and value dimension)."""
        columns = (bias.to(torch.float32).view(torch.int32), positions, rope, segments)
        return cls(keys, values, torch.stack([c.to(torch.int32) for c in columns], dim=-1))

    bias = property(lambda self: self.meta[..., 0].view(torch.float32))  # β (fp32)
    positions = property(lambda self: self.meta[..., 1])  # the token's index in the transcript
    rope = property(lambda self: self.meta[..., 2])  # the position its key is rotated at
    segments = property(lambda self: self.meta[..., 3])

    def fields(self) -> list[torch.Tensor]:
        """The six fields in ``FIELDS`` order (views, no copy)."""
        return [getattr(self, name) for name in FIELDS]

    def take(self, rows: torch.Tensor) -> Slots:
        """Fresh, exactly-sized storage holding ``rows`` of this one, in that order."""
        return Slots(*(t.index_select(0, rows) for t in self))


# what the whole-layer views show past a shorter head's length
PADDING = {"keys": 0.0, "values": 0.0, "bias": NEG_INF, "positions": PAD_POSITION, "rope": PAD_POSITION, "segments": -1}


class LayerState(NamedTuple):
    """A layer at one moment (what ``snapshot`` returns and ``restore`` takes): storage shared, not copied."""

    slots: Slots | None
    starts: tuple[int, ...]
    capacities: tuple[int, ...]
    lengths: tuple[int, ...]
    shared: tuple[int, ...]  # per head: rows [0, shared) belong to a snapshot too
    biased: bool

    @classmethod
    def packed(cls, slots: Slots, lengths: tuple[int, ...], biased: bool) -> LayerState:
        """Storage holding exactly each head's live rows, back to back (a compaction's result, a loaded file)."""
        starts = tuple(sum(lengths[:h]) for h in range(len(lengths)))
        return cls(slots, starts, lengths, lengths, (0,) * len(lengths), biased)

    def live(self) -> Slots:
        """Each head's live rows, back to back (what a saved file holds)."""
        return self.slots.take(_rows(self.starts, self.lengths, self.slots.keys.device))

    @classmethod
    def from_padded(cls, padded: Slots) -> LayerState:
        """From (H, S, ...) tensors in which positions −1 mark padding (the layout before ragged storage)."""
        valid = padded.positions >= 0
        lengths = tuple(int(n) for n in valid.sum(1))
        slots = Slots(*(t[valid] for t in padded))
        return cls.packed(slots, lengths, bool((slots.bias != 0).any()))


EMPTY_LAYER = LayerState(None, (), (), (), (), False)


def _rows(starts, lengths, device) -> torch.Tensor:
    """Flat row indices of each head's first ``lengths[h]`` rows, head after head."""
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, lengths)])


class CompactLayer(CacheLayerMixin):
    """One layer's compactable KV storage, ragged per KV head (batch size 1: a session is one sequence)."""

    is_compileable = False
    is_sliding = False

    def __init__(self, storage_dtype: torch.dtype | None = None):  # the mixin's keys/values are views here
        self.is_initialized = False
        self.storage_dtype = storage_dtype  # None: the dtype of the first keys appended
        self._set(EMPTY_LAYER)

    # ---- layout ----------------------------------------------------------------------------------
    def _set(self, state: LayerState) -> None:
        self.slots, self.starts, self.capacities, lengths, self.shared, self.biased = state
        self._set_lengths(lengths)
        heads = len(self.starts)
        # every head has the same capacity and length: the flat tensors are (H, C, ...) views as they stand
        # (starts are always the running sum of the capacities); appends keep it so
        self.uniform = heads > 0 and len(set(self.capacities)) == 1 and len(set(self.lengths)) == 1
        self._views = Slots(*(self._dense_view(name) for name in Slots._fields)) if self.uniform else None

    @property
    def num_heads(self) -> int:
        return len(self.starts)

    def _set_lengths(self, lengths: tuple[int, ...]) -> None:
        """Each head's live slot count, and what the memory cap and the attention window read of them on every
        decoded token: ``length``, the longest head's count (the width of the whole-layer views), and
        ``slot_count``, the sum over heads (what memory pays for)."""
        self.lengths, self.length, self.slot_count = lengths, max(lengths, default=0), sum(lengths)

    def head_views(self, name: str) -> list[torch.Tensor]:
        """Each head's live rows of one field (views, no copy)."""
        t = getattr(self.slots, name)
        return [t[s : s + n] for s, n in zip(self.starts, self.lengths)]

    def _dense_view(self, name: str) -> torch.Tensor:
        t = getattr(self.slots, name)
        return t.view(self.num_heads, self.capacities[0], *t.shape[1:])

    def _whole(self, name: str) -> torch.Tensor | None:
        """(H, S, ...) of one field: a view when the heads are even, else a padded copy (module docstring);
        8-bit keys and values are decoded (fp32)."""
        if self.slots is None:
            return None
        if self.uniform:
            out = getattr(self._views, name)
        else:
            t = getattr(self.slots, name)
            out = t.new_full((self.num_heads, self.length, *t.shape[1:]), PADDING[name])
            for h, rows in enumerate(self.head_views(name)):
                out[h, : rows.shape[0]] = rows
        return int8_rows.decode(out) if self.quantized and name in ("keys", "values") else out

    @property
    def quantized(self) -> bool:
        """Whether keys and values are stored as 8-bit rows (``kvmemory.cache.int8_rows``)."""
        return self.slots is not None and int8_rows.is_int8(self.slots.keys.dtype)

    def gather(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """(H, n, ...) of one field at each head's own slot indices ``index`` (H, n), read straight from the
        ragged storage (no padded whole-layer copy); 8-bit keys and values are decoded (fp32)."""
        out = getattr(self.slots, name)[torch.tensor(self.starts, device=index.device)[:, None] + index]
        return int8_rows.decode(out) if self.quantized and name in ("keys", "values") else out

    def flat(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The whole flat storage of ``keys`` or ``values`` as ``dtype`` numbers (rows past a head's length
        included, as the one-call attention paths read it)."""
        return int8_rows.read(getattr(self.slots, name), dtype)

    keys = property(lambda self: None if self.slots is None else self._whole("keys")[None])
    values = property(lambda self: None if self.slots is None else self._whole("values")[None])
    bias = property(lambda self: None if self.slots is None else self._whole("bias")[None])
    positions = property(lambda self: self._whole("positions"))
    rope = property(lambda self: self._whole("rope"))
    segments = property(lambda self: self._whole("segments"))

    def _allocate(self, capacities: tuple[int, ...], key_width: int, value_width: int) -> Slots:
        """Fresh storage; the widths are stored row widths (``int8_rows.stored_width``)."""
        n = sum(capacities)
        kw = dict(dtype=self.dtype, device=self.device)
        meta = torch.full((n, 4), PAD_POSITION, dtype=torch.int32, device=self.device)  # segment −1 too
        meta[:, 0] = 0  # β = 0.0
        # zeros, not garbage: rows past a head's length are masked, but a masked row still meets a zero
        # attention weight in one-call kernels (flex), and 0 × NaN would not be 0
        return Slots(torch.zeros(n, key_width, **kw), torch.zeros(n, value_width, **kw), meta)

    def _relayout(self, capacities: tuple[int, ...]) -> None:
        """Move the live rows into fresh storage with these per-head capacities."""
        fresh = self._allocate(capacities, self.slots.keys.shape[-1], self.slots.values.shape[-1])
        starts = tuple(sum(capacities[:h]) for h in range(len(capacities)))
        for old_start, new_start, n in zip(self.starts, starts, self.lengths):
            for new, old in zip(fresh, self.slots):
                new[new_start : new_start + n] = old[old_start : old_start + n]
        self._set(LayerState(fresh, starts, capacities, self.lengths, (0,) * len(starts), self.biased))

    # ---- transformers' layer interface ---------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = self.storage_dtype or key_states.dtype, key_states.device
        heads = key_states.shape[1]
        widths = (int8_rows.stored_width(t.shape[-1], self.dtype) for t in (key_states, value_states))
        slots = self._allocate((0,) * heads, *widths)
        self._set(LayerState(slots, (0,) * heads, (0,) * heads, (0,) * heads, (0,) * heads, False))
        self.is_initialized = True

    def update(self, key_states, value_states, meta: torch.Tensor, room: int | None = None):
        """Append ``q`` new tokens to every head: keys and values (1, H, q, D), ``meta`` their (q, 4) rows
        (``CompactCache.append_rows``); ``room``: rows each head takes after these before it is compacted
        (None: unknown), which bounds the storage reserved past them. Returns the keys and values attention
        reads: (1, H, S, D) views when the heads are even, else one (1, 1, S_h, D) view per head."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[2]
        self._make_room(q, room)
        if self.quantized:  # encoded once; attention reads the cache decoded (fp32) below
            key_states, value_states = int8_rows.encode(key_states), int8_rows.encode(value_states)
        if self.uniform:
            views, n = self._views, self.lengths[0]
            end = n + q
            views.keys[:, n:end] = key_states[0]
            views.values[:, n:end] = value_states[0]
            views.meta[:, n:end] = meta
            self._set_lengths((end,) * self.num_heads)
            return self._readable(views.keys[None, :, :end]), self._readable(views.values[None, :, :end])
        slots = self.slots
        for h, (start, n) in enumerate(zip(self.starts, self.lengths)):  # a few heads: slice copies are cheapest
            slots.keys[start + n : start + n + q] = key_states[0, h]
            slots.values[start + n : start + n + q] = value_states[0, h]
            slots.meta[start + n : start + n + q] = meta
        self._set_lengths(tuple(n + q for n in self.lengths))
        return (
            [self._readable(k[None, None]) for k in self.head_views("keys")],
            [self._readable(v[None, None]) for v in self.head_views("values")],
        )

    def _readable(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows as attention reads them: views as stored (16- or 32-bit), decoded 8-bit rows."""
        return int8_rows.decode(rows) if self.quantized else rows

    def claim(self, q: int, room: int | None = None) -> None:
        """Count ``q`` more rows per head as live without writing them: the caller writes each head's new rows
        (the CPU decode kernel writes a decoded token's key, value and metadata as it attends)."""
        self._make_room(q, room)
        even = self.uniform  # every layer of every decoded token: no loop over the heads
        self._set_lengths((self.length + q,) * len(self.lengths) if even else tuple(n + q for n in self.lengths))

    def _make_room(self, q: int, room: int | None) -> None:
        if not self._room_for(q):
            spare = _headroom(max(self.lengths) + q, room)
            self._relayout(tuple(max(c, n + q + spare) for c, n in zip(self.capacities, self.lengths)))

    def _room_for(self, q: int) -> bool:
        """Whether every head can take ``q`` more rows in place: within its capacity, and past every row a
        snapshot still refers to (checked per decoded token and layer, so even heads take one comparison)."""
        if self.uniform:
            n = self.lengths[0]
            return n >= max(self.shared) and n + q <= self.capacities[0]
        return all(s <= n and n + q <= c for n, s, c in zip(self.lengths, self.shared, self.capacities))

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.storage_dtype)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("CompactCache holds one sequence; beam search is not supported")

    # ---- kvmemory ------------------------------------------------------------------------------
    def attention_bias(self) -> torch.Tensor | list[torch.Tensor] | None:
        """β of the live slots: (1, H, S) fp32 for even heads, one (S_h,) tensor per head otherwise; None
        when every β is 0 (the fast path)."""
        if not self.biased:
            return None
        if self.uniform:
            return self._views.bias[None, :, : self.lengths[0]]
        return self.head_views("bias")

    def _state(self) -> LayerState:
        return LayerState(self.slots, self.starts, self.capacities, self.lengths, self.shared, self.biased)

    def truncate(self, lengths: tuple[int, ...]) -> None:
        """Forget each head's slots from ``lengths[h]`` on. Only lengths change (rows past them are never
        read), so a snapshot sharing this storage stays intact."""
        self._set(self._state()._replace(lengths=tuple(min(n, cut) for n, cut in zip(self.lengths, lengths))))
        self.biased = any(bool((b != 0).any()) for b in self.head_views("bias"))

    def snapshot(self) -> LayerState:
        """This layer's storage and lengths, shared, not copied (see the module docstring)."""
        if self.shared != self.lengths:  # taken before every decoded token: the common case costs nothing
            self.shared = tuple(map(max, self.shared, self.lengths))
        return self._state()

    def restore(self, state: LayerState) -> None:
        self._set(state)
        self.is_initialized = state.slots is not None
        if self.is_initialized:
            self.dtype, self.device = state.slots.keys.dtype, state.slots.keys.device

    def clone(self, room: int | None = None) -> CompactLayer:
        """An independent copy holding only the live slots (plus headroom, at most ``room``: see ``update``)."""
        twin = CompactLayer(self.storage_dtype)
        if self.is_initialized:
            twin.restore(self._state())
            spare = _headroom(max(self.lengths), room)
            twin._relayout(tuple(n + spare for n in self.lengths))
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
        value_dim = self.slots.values.shape[-1] - (int8_rows.SCALE_BYTES if self.quantized else 0)
        if plan.values is not None and tuple(plan.values.shape) != (self.num_heads, t_max, value_dim):
            raise InvalidPlanError(
                f"{where}: values must be {(self.num_heads, t_max, value_dim)}, got {tuple(plan.values.shape)}"
            )
        if plan.bias is not None and tuple(plan.bias.shape) != (self.num_heads, t_max):
            raise InvalidPlanError(f"{where}: bias must be {(self.num_heads, t_max)}, got {tuple(plan.bias.shape)}")
        if plan.bias is not None and bool((torch.isnan(plan.bias) | (plan.bias == float("inf"))).any()):
            raise InvalidPlanError(f"{where}: bias contains NaN or +infinity (β must be finite or −∞)")
        if plan.values is not None and not bool(torch.isfinite(plan.values).all()):
            raise InvalidPlanError(f"{where}: values contain NaN or infinity")
        return keep

    def _keep_is_valid(self, keep: list[torch.Tensor]) -> bool:
        """In range of each head's length and strictly increasing: every head at once, one sync."""
        index, valid = pad_selection(keep, self.device)
        lengths = torch.tensor(self.lengths, device=self.device)[:, None]
        in_range = ((index >= 0) & (index < lengths)) | ~valid
        increasing = (index[:, 1:] > index[:, :-1]) | ~valid[:, 1:]
        return bool(in_range.all() & increasing.all())

    def _check_keep_per_head(self, keep: list[torch.Tensor], where: str) -> None:
        for h, idx in enumerate(keep):
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= self.lengths[h]:
                raise InvalidPlanError(f"{where} head {h}: slot index out of range [0, {self.lengths[h]}): {lo}..{hi}")
            if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
                raise InvalidPlanError(f"{where} head {h}: kept slot indices must be strictly increasing")

    def apply(self, plan: LayerPlan, keep: list[torch.Tensor]) -> None:
        """Rebuild this layer from a validated plan into fresh storage holding exactly the kept slots."""
        index, valid = pad_selection(keep, self.device)
        starts = torch.tensor(self.starts, device=self.device)[:, None]
        slots = self.slots.take((starts + index)[valid])
        if plan.values is not None:
            values = int8_rows.store(plan.values.to(self.device), slots.values.dtype)
            slots = slots._replace(values=values[valid])
        if plan.bias is not None:
            slots.bias.copy_(plan.bias.to(self.device, torch.float32)[valid])  # fresh storage: written in place
        lengths = tuple(k.numel() for k in keep)
        self._set(LayerState.packed(slots, lengths, bool((slots.bias != 0).any())))

    def rebase(self, span: int, inv_freq: torch.Tensor, previous: tuple | None = None) -> tuple:
        """Re-rotate each head's keys so its newest slot sits at ``span − 1`` and the ones before it at
        consecutive positions (see ``CompactCache.rebase``). ``previous``: what the layer before returned,
        (rotations, cos, sin); layers whose slots sit where its did (every layer, when every head keeps the
        same tokens) reuse its tables. Returns this layer's."""
        self._relayout(self.capacities)  # new storage: a snapshot keeps the unrotated keys
        rows = _rows(self.starts, self.lengths, self.device)
        new = torch.cat([torch.arange(span - n, span, device=self.device) for n in self.lengths])
        delta = new - self.slots.rope[rows].long()
        if previous is None or not torch.equal(previous[0], delta):
            previous = (delta, *rotation_tables(delta, inv_freq))
        keys = int8_rows.read(self.slots.keys[rows], torch.float32)
        self.slots.keys[rows] = int8_rows.store(rotate(keys, *previous[1:]), self.slots.keys.dtype)
        self.slots.rope[rows] = new.to(self.slots.rope)
        return previous

    def head_slot_bytes(self) -> int:
        """Bytes one slot of one head costs (key, value, β, position, RoPE position, segment id)."""
        return (self.slots.keys.shape[-1] + self.slots.values.shape[-1]) * self.slots.keys.element_size() + META_BYTES

    def bytes_per_slot(self) -> int:
        """Bytes one slot costs across this layer's heads (what one more token costs)."""
        return 0 if self.slots is None else self.num_heads * self.head_slot_bytes()

    def kv_bytes(self) -> int:
        """Bytes of the slots held (every head its own count)."""
        return 0 if self.slots is None else self.slot_count * self.head_slot_bytes()

    def allocated_bytes(self) -> int:
        return 0 if self.slots is None else sum(t.numel() * t.element_size() for t in self.slots)
