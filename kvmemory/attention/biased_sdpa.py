"""The attention function kvmemory registers with transformers: sdpa plus the per-slot bias β.

Logits to a compacted slot get +β (Attention Matching's mass correction); padding slots carry β = −∞.
New tokens attend causally to each other (bottom-right aligned: the cache's S slots end with the Q new
ones). GQA is never expanded in memory (``enable_gqa``).

With no path chosen, a decode step on the CPU (one new token per session) runs on ``decode_kernel`` where
it is available: every session of a packed pass in one call, the cache read in its stored dtype. Otherwise,
two sdpa paths:

* ``mask`` (default, CPU): β and the causal part become one additive float mask. With no compaction
  yet and a single query this is plain sdpa with no mask at all.
* ``folded`` (default on CUDA): a float mask pushes CUDA's sdpa off the flash kernel. β is folded into
  one extra head dimension instead, q′ = [q, c], k′ = [k, β/(scale·c)], v′ = [v, 0] (padded to a
  multiple of 8), so scale·q′·k′ = scale·q·k + β and decoding runs a mask-free fast kernel.
  −∞ padding becomes a large negative finite number. Numerically equal to ``mask`` (tested on CPU).

A layer whose KV heads hold different numbers of slots (ragged storage, see ``kvmemory.cache``) hands
attention one key and value tensor per KV head; each runs through the same path over its own slots only,
with its GQA group of query heads, so no padding is ever built or read. ``attention_path="flex"`` reads
such a layer in one FlexAttention call instead (``flex_ragged``: compiled on CUDA, so the heads cost one
kernel rather than one launch each; eager elsewhere, where it serves to test it).
"""

from __future__ import annotations

from functools import cache, lru_cache

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from kvmemory.attention import decode_kernel

ATTENTION_NAME = "kvmemory"
ATTENTION_PATHS = (None, "mask", "folded", "flex")  # None: "folded" on CUDA, "mask" elsewhere
FOLD_PAD = 8  # extra head dims for the folded bias: keeps head_dim a multiple of 8 for fast kernels
FOLD_CONSTANT = 1.0
FOLD_NEG = -1e4  # stands in for −∞ in the folded path (exp underflows to 0 all the same)


@lru_cache(maxsize=8)
def causal_mask(q_len: int, kv_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(Q, S) additive mask: query i sees every past slot and new tokens up to itself."""
    mask = torch.zeros(q_len, kv_len, dtype=dtype, device=device)
    new = torch.full((q_len, q_len), float("-inf"), dtype=dtype, device=device).triu(1)
    mask[:, kv_len - q_len :] = new
    return mask


def mask_sdpa(query, key, value, bias, scaling):
    """β and causality as one additive mask. query (B, Hq, Q, D); key/value (B, H, S, D); bias (1, H, S)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    mask = causal_mask(q_len, kv_len, query.dtype, query.device)[None, None] if q_len > 1 else None
    if bias is not None:
        head_bias = bias.to(query.dtype)
        if head_bias.shape[1] > 1:  # one row per KV head: repeat it for each query head of its group
            head_bias = head_bias.repeat_interleave(groups, dim=1)
        head_bias = head_bias[:, :, None, :]
        mask = head_bias if mask is None else head_bias + mask
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=groups > 1)


def folded_sdpa(query, key, value, bias, scaling):
    """β folded into an extra head dimension so that a decode step needs no mask (flash-capable on CUDA)."""
    q_len = query.shape[2]
    if bias is None or q_len > 1:
        # Without β there is nothing to fold; prefill needs the causal mask anyway.
        return mask_sdpa(query, key, value, bias, scaling)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    b, hq, _, d = query.shape
    h, s = key.shape[1], key.shape[2]
    q_extra = query.new_zeros(b, hq, q_len, FOLD_PAD)
    q_extra[..., 0] = FOLD_CONSTANT
    k_extra = key.new_zeros(b, h, s, FOLD_PAD)
    k_extra[..., 0] = (bias.clamp(min=FOLD_NEG) / (scale * FOLD_CONSTANT)).to(key.dtype)
    q2 = torch.cat([query, q_extra], dim=-1)
    k2 = torch.cat([key, k_extra], dim=-1)
    v2 = torch.cat([value, value.new_zeros(b, h, s, FOLD_PAD)], dim=-1)
    out = F.scaled_dot_product_attention(q2, k2, v2, scale=scale, enable_gqa=hq != h)
    return out[..., : value.shape[-1]]


@cache
def _flex_attention(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


def flex_ragged(query, layer, scaling):
    """One FlexAttention call over a ragged layer's flat storage: query head h sees only the rows of its KV
    head's region (new tokens only up to themselves), and β enters as a score modification."""
    from torch.nn.attention.flex_attention import create_block_mask

    q_len, groups = query.shape[2], query.shape[1] // layer.num_heads
    starts = torch.tensor(layer.starts, device=query.device)
    ends = starts + torch.tensor(layer.lengths, device=query.device)

    def visible(b, h, q, kv):
        head = h // groups
        return (kv >= starts[head]) & (kv < ends[head] - q_len + q + 1)

    bias = layer.slots.bias.to(query.dtype)
    rows = layer.slots.keys.shape[0]
    block_mask = create_block_mask(visible, 1, query.shape[1], q_len, rows, device=query.device)
    return _flex_attention(query.device.type)(
        query,
        layer.flat("keys", query.dtype)[None, None],
        layer.flat("values", query.dtype)[None, None],
        score_mod=(lambda score, b, h, q, kv: score + bias[kv]) if layer.biased else None,
        block_mask=block_mask,
        scale=scaling,
        enable_gqa=groups > 1,
    )


def read_as(tensors, dtype: torch.dtype):
    """Cached keys or values (a tensor, or one per KV head) in the queries' dtype: a cache stored in fewer
    bits than the activations (``Engine.kv_dtype``) is read back as the activations' dtype."""
    if isinstance(tensors, list):
        return [t.to(dtype) for t in tensors]
    return tensors.to(dtype)


def attend(path: str, query, key, value, layer, scaling):
    """One cache layer: even heads in one call, uneven heads (``key`` a list) per KV head or with ``flex``."""
    if path == "flex" and isinstance(key, list):
        return flex_ragged(query, layer, scaling)
    key, value = read_as(key, query.dtype), read_as(value, query.dtype)
    fn = folded_sdpa if path == "folded" or (path == "flex" and query.is_cuda) else mask_sdpa
    bias = None if layer is None else layer.attention_bias()
    if not isinstance(key, list):
        return fn(query, key, value, bias, scaling)
    groups = query.shape[1] // len(key)
    return torch.cat(
        [
            fn(query[:, h * groups : (h + 1) * groups], k, v, None if bias is None else bias[h][None, None], scaling)
            for h, (k, v) in enumerate(zip(key, value))
        ],
        dim=1,
    )


def kvmemory_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Registered as ``attn_implementation="kvmemory"``; transformers calls it from every attention layer.

    Two ways in: one sequence whose cache is passed as ``compact_cache`` (its β is added), or a packed pass
    of several sessions (``packed_cache``, see ``kvmemory.runtime.batching``): then ``key`` and ``value``
    are lists, one per session, and each session's queries attend to its own cache only. With no path
    chosen, a decode step on the CPU (one query per session) runs every session in one call of
    ``kvmemory.attention.decode_kernel`` where it is available, also beside prefill chunks (``mixed_pass``).
    """
    chosen = kwargs.get("attention_path")
    path = chosen or ("folded" if query.is_cuda else "mask")
    packed = kwargs.get("packed_cache")
    if packed is None:
        cache = kwargs.get("compact_cache")
        layer = None if cache is None else cache.layers[module.layer_idx]
        if chosen is None and layer is not None and query.shape[2] == 1 and decode_kernel.usable(query):
            return decode_kernel.decode_attention(query, [layer], scaling), None
        out = attend(path, query, key, value, layer, scaling)
        return out.transpose(1, 2).contiguous(), None
    packed.record_queries(query)
    parts = packed.attention_parts(module.layer_idx)
    layers = [layer for _, _, layer in parts]
    if packed.new_rows is not None:  # the kernel writes this decode step's rows (``PackedCache``)
        layer_idx, *new_rows = packed.new_rows
        assert layer_idx == module.layer_idx, "attention must follow its own layer's cache update"
        packed.new_rows = None
        return decode_kernel.decode_attention(query, layers, scaling, new_rows), None
    if chosen is None and decode_kernel.usable(query):
        if query.shape[2] == len(parts):  # a token per session: decode steps only
            return decode_kernel.decode_attention(query, layers, scaling), None
        if any(e - s == 1 for s, e, _ in parts):
            return mixed_pass(path, query, key, value, parts, scaling), None
    pieces = [attend(path, query[:, :, s:e], k, v, layer, scaling) for (s, e, layer), k, v in zip(parts, key, value)]
    out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    return out.transpose(1, 2).contiguous(), None


def mixed_pass(path, query, key, value, parts, scaling) -> torch.Tensor:
    """A packed pass holding prefill chunks beside decode steps: the one-token parts attend in one call of the
    decode kernel, as in a pass of decode steps only (so a step's result does not depend on what shares its
    pass), the others through ``attend``. Returns (1, T, Hq, Dv)."""
    steps = [i for i, (s, e, _) in enumerate(parts) if e - s == 1]
    rows = torch.tensor([parts[i][0] for i in steps])
    decoded = decode_kernel.decode_attention(query[:, :, rows], [parts[i][2] for i in steps], scaling)
    decoded = decoded.transpose(1, 2).unbind(2)  # per step (1, Hq, Dv)
    by_part = dict(zip(steps, decoded))
    pieces = [
        by_part[i].unsqueeze(2) if i in by_part else attend(path, query[:, :, s:e], k, v, layer, scaling)
        for i, ((s, e, layer), k, v) in enumerate(zip(parts, key, value))
    ]
    return torch.cat(pieces, dim=2).transpose(1, 2).contiguous()


def register() -> str:
    AttentionInterface.register(ATTENTION_NAME, kvmemory_attention)
    return ATTENTION_NAME


register()
