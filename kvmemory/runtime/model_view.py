"""What compaction methods may ask of the model, answered where the model is: ``SessionModelView``, the
``ModelView`` of ``compaction/base.py``. Methods never see the model, the cache or a session.

The counter-causal re-read (Gould & van den Hengel, arXiv 2607.27600): each cached token is read again
with the opposite mask, attending only to strictly later cached slots (their keys, values and β as the
cache holds them), and the LM head's logit of its own id says how well the future predicts it;
``compaction/methods/counter_causal.py`` ranks by it.

* full: every layer, starting from the token's embedding;
* fast: only the last layer, from the stored input of that layer (``Session.record_last_layer_inputs``).
Both skip the last layer's MLP, so on a one-layer model they are identical.

REAL's head profile: ``runtime/head_profiling.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmemory.hardware import cpu_has_native_bf16
from kvmemory.runtime.head_profiling import HeadProfile, profile_for
from kvmemory.runtime.weights import SixteenBitLinear

ROW_CHUNK = 192


@dataclass
class SessionModelView:
    """A session's engine, cache and transcript as the ``ModelView`` a method may ask (``compaction/base.py``)."""

    engine: object
    cache: object
    tokens: list[int]
    last_layer_inputs: dict[int, torch.Tensor] | None = None

    @classmethod
    def of(cls, session) -> SessionModelView:
        recorder = session.hidden_recorder
        inputs = recorder.store if recorder is not None else None
        return cls(session.engine, session.cache, session.tokens, inputs)

    @property
    def logical_length(self) -> int:
        return self.cache.logical_length

    def own_token_logits(
        self, positions: torch.Tensor, fast: bool, pause: Callable[[], None] = lambda: None
    ) -> torch.Tensor:
        return own_token_logits(self, positions, fast, pause)

    def head_profile(self, path: str | None = None) -> HeadProfile:
        return profile_for(self.engine, path)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def query_phases(cache_layer, positions: torch.Tensor) -> torch.Tensor:
    """(H, T) RoPE position at which each token's query meets this layer's keys, per KV head.

    After a per-head rebase a token's key sits at a different phase in each head; a query must use the
    same phase as its own key (or keep its original offset to the next slot the head kept)."""
    n = cache_layer.length
    slot_pos, rope = cache_layer.positions[:, :n].long(), cache_layer.rope[:, :n].long()
    slot_pos = torch.where(slot_pos >= 0, slot_pos, torch.iinfo(torch.long).max)  # padding sorts last
    order = torch.sort(slot_pos, dim=1)
    count = (cache_layer.positions[:, :n] >= 0).sum(1, keepdim=True)
    rows = positions.to(slot_pos.device).expand(slot_pos.shape[0], -1).contiguous()
    idx = torch.minimum(torch.searchsorted(order.values, rows), count - 1)
    anchor_pos = torch.gather(order.values, 1, idx)
    anchor_rope = torch.gather(torch.gather(rope, 1, order.indices), 1, idx)
    return anchor_rope + rows - anchor_pos


def _matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """bf16 for the projections and attention matmuls of an fp32 model on a CPU with native bf16 dot
    products (2-3× faster there; the score only ranks tokens, and bf16 leaves the ranking intact)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and cpu_has_native_bf16():
        return torch.bfloat16
    return x.dtype


def _counter_causal_attention(attn_module, hidden, rotary_emb, cache_layer, positions):
    """Attention of each token to strictly-later cached slots only (β included).

    Explicit batched matmuls over row blocks of ROW_CHUNK tokens: each block skips the leading slots
    that lie at or before all of its rows, so the work is the upper triangle only (on CPU this is ~2-3×
    faster than SDPA with a dense float mask)."""
    t = hidden.shape[0]
    head_dim = attn_module.head_dim
    mm_dtype = _matmul_dtype(hidden)
    q = _linear(attn_module.q_proj, hidden, mm_dtype).float().view(t, -1, head_dim)
    if hasattr(attn_module, "q_norm"):
        q = attn_module.q_norm(q)
    q = q.transpose(0, 1)  # (Hq, T, D)
    n = cache_layer.length
    keys, values = cache_layer.keys[0, :, :n], cache_layer.values[0, :, :n]
    slot_pos = cache_layer.positions[:, :n].long()
    heads = keys.shape[0]
    groups = q.shape[0] // heads
    cos, sin = rotary_emb(hidden[None], query_phases(cache_layer, positions))  # (H, T, D)
    cos, sin = cos.repeat_interleave(groups, dim=0), sin.repeat_interleave(groups, dim=0)
    q = ((q * cos + _rotate_half(q) * sin) * attn_module.scaling).view(heads, groups, t, head_dim)
    q, keys, values = q.to(mm_dtype), keys.to(mm_dtype), values.to(mm_dtype)
    # β, and −∞ on padding (so only real slots need the causal mask); a cache never compacted has neither
    bias = cache_layer.bias[0, :, :n].to(mm_dtype) if cache_layer.biased else None
    no_future_from = int(slot_pos.max(1).values.min())  # rows from here on may have no later slot in some head
    out = torch.empty(t, heads, groups, values.shape[-1], dtype=mm_dtype, device=hidden.device)  # o_proj's layout
    for a in range(0, t, ROW_CHUNK):
        rows = positions[a : a + ROW_CHUNK]
        # slots at or before every row of this block are skipped; slots after all of them need no mask
        start = int(torch.cumprod((slot_pos <= rows.min()).all(0), 0).sum())
        masked = ((slot_pos[:, start:] <= rows.max()) & (slot_pos[:, start:] >= 0)).any(0)
        end = start + (int(torch.nonzero(masked).max()) + 1 if bool(masked.any()) else 0)
        scores = torch.matmul(q[:, :, a : a + ROW_CHUNK], keys[:, None, start:].transpose(-1, -2))
        if bias is not None:
            scores.add_(bias[:, None, None, start:])
        later = slot_pos[:, None, start:end] > rows[None, :, None]  # (H, t, ·): strictly later slots only
        scores[..., : end - start].masked_fill_(~later[:, None], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        if int(rows.max()) >= no_future_from:
            weights.nan_to_num_(0.0)  # a row with no later slot attends to nothing
        out[a : a + ROW_CHUNK] = torch.matmul(weights, values[:, None, start:]).permute(2, 0, 1, 3)
    return _linear(attn_module.o_proj, out.view(t, -1), mm_dtype).to(hidden.dtype)


def _linear(proj: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``proj(x)`` computed in ``dtype`` (the projections are as costly as the attention itself); a layer
    whose weight is packed for its own kernel (int4, packed fp16) runs that kernel."""
    if type(proj) not in (torch.nn.Linear, SixteenBitLinear) or dtype == proj.weight.dtype:
        return proj(x.to(dtype))
    bias = proj.bias.to(dtype) if proj.bias is not None else None
    return torch.nn.functional.linear(x.to(dtype), proj.weight.to(dtype), bias)


def _decoder_layer(layer, hidden, rotary_emb, cache_layer, positions, with_mlp: bool):
    residual = hidden
    h = _counter_causal_attention(layer.self_attn, layer.input_layernorm(hidden), rotary_emb, cache_layer, positions)
    hidden = residual + h
    if with_mlp:
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return hidden


@torch.no_grad()
def own_token_logits(
    access: SessionModelView, positions: torch.Tensor, fast: bool, pause: Callable[[], None] = lambda: None
) -> torch.Tensor:
    """z_i[x_i] for each position: the LM-head logit of the token's own id under the counter-causal mask.
    ``pause`` runs between layers (``CacheSpan.pause``)."""
    model = access.engine.model
    base = model.model
    device = next(model.parameters()).device
    positions = positions.to(device)
    token_ids = torch.tensor([access.tokens[p] for p in positions.tolist()], device=device)
    layers = base.layers
    stored = access.last_layer_inputs or {}
    if fast and all(p in stored for p in positions.tolist()):
        hidden = torch.stack([stored[p] for p in positions.tolist()]).to(device, next(model.parameters()).dtype)
        start = len(layers) - 1
    else:
        hidden = base.embed_tokens(token_ids)
        start = 0
    for li in range(start, len(layers)):
        last = li == len(layers) - 1
        hidden = _decoder_layer(
            layers[li], hidden, base.rotary_emb, access.cache.layers[li], positions, with_mlp=not last
        )
        pause()
    hidden = base.norm(hidden)
    weight = model.lm_head.weight[token_ids]
    logits = (hidden * weight).sum(-1)
    if getattr(model.lm_head, "bias", None) is not None:
        logits = logits + model.lm_head.bias[token_ids]
    return logits.float()
