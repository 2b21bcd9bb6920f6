"""The model's forward pass as the engine runs it: every decoder layer called straight from its weights.

Decoding one token of a small model on a CPU spends more time in Python than in its kernels when the pass
goes through transformers' module tree: ~400 module calls per token, each through ``nn.Module``'s hook
dispatch, keyword plumbing and deprecation wrappers (the default model at 512 tokens: 17.7 ms per token in
the model's forward, of which 7 ms are matrix products). ``DirectForward`` computes the same thing for the
architectures kvmemory supports (Llama, Mistral, Qwen2, Qwen3) as one loop over the layers: q, k and v come
from one matrix product and so do gate and up (``fuse_linears``: the modules' weights become views of the
fused one; projections that cannot fuse run ``SideBySide``), each projection's own ``forward`` runs (so
16-bit weights keep their kernels), RMSNorm is one call (``rms_norm``) and so is RoPE (``rotate``), and
attention goes through ``kvmemory_attention`` exactly as on the transformers path (β, ragged heads, packed
sessions, query recording). A Session now decodes faster than transformers' own decode on the same weights
(``python -m benchmarks.speed``).

A model laid out any other way (another layer class, or modules with hooks or a replaced ``forward``, as
accelerate's offloading attaches) runs through transformers' own forward with kvmemory's attention registered
(``TransformersForward``). Both return the same logits (tests/test_forward.py, every architecture).

Either forward is called as ``forward(input_ids, rope, cache, keep, attention_path, recording)``:
``input_ids`` and ``rope`` (1, T); ``cache`` the pass's ``PackedCache``; ``keep`` what transformers calls
``logits_to_keep`` (an int: the last rows, 0 for all; or a tensor of row indices); ``recording``: (request,
start, end) of the requests whose hidden recorder keeps their tokens' input to the last layer. Returns the
logits (rows, vocabulary).
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from transformers.activations import SiLUActivation

from kvmemory.attention import kvmemory_attention
from kvmemory.kernels import cpu_ops
from kvmemory.runtime.loading import SUPPORTED_ARCHITECTURES
from kvmemory.runtime.weights import fuse_linears


def forward_for(model):
    """The fastest forward that computes ``model`` exactly: ``DirectForward`` when its layout is known."""
    return DirectForward.of(model) or TransformersForward(model)


def record_last_layer_inputs(recording, hidden: torch.Tensor) -> None:
    """Hand each recording request its tokens' input to the last decoder layer (fast counter-causal)."""
    for request, start, end in recording:
        request.hidden_recorder.record(request.positions, hidden[0, start:end])


def rows_to_keep(hidden: torch.Tensor, keep) -> torch.Tensor:
    """transformers' ``logits_to_keep``: an int keeps the last rows (0 all of them), a tensor those rows."""
    return hidden[:, -keep:] if isinstance(keep, int) else hidden[:, keep]


class TransformersForward:
    """The model's own forward with kvmemory's attention registered (any layout transformers runs)."""

    def __init__(self, model):
        self.model = model
        self._recording = threading.local()
        last_layer = model.model.layers[-1]
        last_layer.register_forward_pre_hook(self._last_layer_hook, with_kwargs=True)

    def __call__(self, input_ids, rope, cache, keep, attention_path, recording=()):
        self._recording.now = recording
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=rope,
                cache=cache,
                use_cache=True,
                logits_to_keep=keep,
                packed_cache=cache,
                attention_path=attention_path,
            )
        finally:
            self._recording.now = ()
        return out.logits[0]

    def _last_layer_hook(self, module, args, kwargs):
        recording = getattr(self._recording, "now", ())
        if recording:
            record_last_layer_inputs(recording, args[0] if args else kwargs["hidden_states"])


def rms_norm(norm):
    """transformers' RMSNorm (normalise in fp32, scale in the model's dtype) as one ``rms_norm`` call.

    torch's CPU ``rms_norm`` runs as half a dozen operators (square, mean, add, rsqrt, two products): 21 µs
    for one row of the default model on a 2-core AVX2 EPYC, 61 of them a decoded token. With fp32
    activations on a CPU it is kvmemory's one-pass kernel instead (``kvmemory/kernels/rms_norm.cpp``)."""
    weight, eps = norm.weight, norm.variance_epsilon
    ops = cpu_ops() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None

    def apply(x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            if ops is not None:
                return ops.rms_norm(x, weight, eps)
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)

    return apply


def gated_activation(mlp, split: tuple[int, int], device: torch.device):
    """``act(gate) · up`` of the gate and up halves of one fused projection's output. With SiLU on fp32
    activations on a CPU it is kvmemory's one-pass kernel instead of torch's split, silu and product
    (``kvmemory/kernels/gated_mlp.cpp``; the default model's forward on a 2-core AVX2 EPYC: 17.7 → 16.9 ms
    for one session, 32.9 → 31.7 ms for eight)."""
    act = mlp.act_fn.forward
    silu = isinstance(mlp.act_fn, (torch.nn.SiLU, SiLUActivation))
    ops = cpu_ops() if silu and split[0] == split[1] and device.type == "cpu" else None

    def apply(gate_up: torch.Tensor) -> torch.Tensor:
        if ops is not None and gate_up.dtype == torch.float32:
            return ops.silu_mul(gate_up)
        gate, up = gate_up.split(split, dim=-1)
        return act(gate) * up

    return apply


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin with its first half negated), each (T, D): ``rotate`` then needs no concatenation (``sin``'s
    halves are equal, so this is transformers' ``rotate_half`` product exactly)."""
    half = sin.shape[-1] // 2
    return cos[0].contiguous(), torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE in transformers' half layout on the heads ``x`` (1, T, H, D): x·cos + rotate_half(x)·sin.

    As torch operators it is four per layer (two products, a roll for rotate_half, a sum): 0.86 ms of a
    decoded token of the default model on a 2-core AVX-512 Xeon. On fp32 activations on a CPU it is
    kvmemory's kernel instead (``kvmemory/kernels/rope.cpp``: the same products and sum, so the same bits;
    0.45-0.52 ms), which rotates ``x`` in place: the caller hands over heads that nothing else reads.
    Returns the rotated heads (``x`` itself where rotated in place)."""
    in_place = x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1 and not x.requires_grad
    ops = cpu_ops() if in_place else None
    if ops is not None:
        ops.rope_(x[0], cos, signed_sin, x.shape[2])
        return x
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin[:, None]


def hooked(module) -> bool:
    """Whether something wraps this module's call: nn.Module hooks, or a ``forward`` replaced on the instance
    (how accelerate attaches its offloading and device hooks)."""
    return bool(module._forward_hooks or module._forward_pre_hooks) or "forward" in vars(module)


_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module → its fused projections


class SideBySide:
    """Projections of one input that do not fuse (different kinds, fbgemm-packed fp16, fp16 parts that do not
    fill whole panels), run one after another with their outputs concatenated: what a fused projection
    computes, at a few more calls."""

    def __init__(self, parts: list):
        self.parts = [part.forward for part in parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def fused(module, names: tuple[str, ...]):
    """The fused projection (``fuse_linears``) of ``module``'s ``names``, made once per module (engines may
    share a model); the parts side by side when they cannot be fused."""
    made = _FUSED.setdefault(module, {})
    if names not in made:
        parts = [getattr(module, name) for name in names]
        fusion = fuse_linears(parts)
        made[names] = SideBySide(parts) if fusion is None else fusion
    return made[names]


class DecoderLayer:
    """One decoder layer's computation, reading the weights of transformers' modules; q, k and v come from
    one matrix product, as do gate and up."""

    def __init__(self, layer, qkv, gate_up):
        attn, mlp = layer.self_attn, layer.mlp
        self.attention = attn  # kvmemory_attention reads its layer index
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        q_rows, kv_rows = attn.q_proj.out_features, attn.k_proj.out_features
        self.heads, self.kv_heads = q_rows // self.head_dim, kv_rows // self.head_dim
        self.input_norm, self.post_norm = rms_norm(layer.input_layernorm), rms_norm(layer.post_attention_layernorm)
        self.qkv, self.o = qkv.forward, attn.o_proj.forward
        qk_norms = (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None))  # Qwen3
        self.q_norm, self.k_norm = (rms_norm(n) for n in qk_norms) if qk_norms[0] is not None else (None, None)
        self.gate_up, self.down = gate_up.forward, mlp.down_proj.forward
        split = (mlp.gate_proj.out_features, mlp.up_proj.out_features)
        self.activation = gated_activation(mlp, split, layer.post_attention_layernorm.weight.device)

    def __call__(self, x, cos, sin, cache, attention_path):
        qkv = self.qkv(self.input_norm(x)).view(*x.shape[:-1], -1, self.head_dim)
        heads, kv_heads = self.heads, self.kv_heads
        qk, v = qkv[:, :, : heads + kv_heads], qkv[:, :, heads + kv_heads :].transpose(1, 2)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :, :heads]), self.k_norm(qk[:, :, heads:])), dim=2)
        # q and k rotated at once, in place where the kernel runs: qk is this layer's own projection output
        q, k = rotate(qk, cos, sin).transpose(1, 2).split((heads, kv_heads), dim=1)
        keys, values = cache.update(k, v, self.attention.layer_idx)
        out, _ = kvmemory_attention(
            self.attention, q, keys, values, None, self.scaling, packed_cache=cache, attention_path=attention_path
        )
        x = x + self.o(out.reshape(*x.shape[:-1], -1))
        return x + self.down(self.activation(self.gate_up(self.post_norm(x))))


class DirectForward:
    """The decoder stack as one loop over its layers (see the module docstring). It reads the modules as
    they are when it is made; a module replaced later is not seen."""

    def __init__(self, model, layers: list[DecoderLayer]):
        inner = model.model
        self.embed, self.rotary = inner.embed_tokens.forward, inner.rotary_emb
        self.layers = layers
        self.norm = rms_norm(inner.norm)
        self.head = model.get_output_embeddings().forward

    @classmethod
    def of(cls, model) -> DirectForward | None:
        """A DirectForward for ``model``, or None when its layout is not one this class reproduces exactly
        (another architecture, a module with hooks)."""
        layers = getattr(getattr(model, "model", None), "layers", None)
        if not layers or getattr(model.config, "model_type", None) not in SUPPORTED_ARCHITECTURES:
            return None
        arch = type(model).__name__.removesuffix("ForCausalLM")  # transformers' own classes: Llama..., Qwen3...
        known = {"DecoderLayer", "Attention", "MLP", "RMSNorm", "RotaryEmbedding", "ForCausalLM", "Model"}
        if type(layers[0]).__name__ != f"{arch}DecoderLayer":
            return None
        for module in model.modules():
            name = type(module).__name__
            if hooked(module) or name.startswith(arch) and name.removeprefix(arch) not in known:
                return None
        built = [
            DecoderLayer(
                layer,
                fused(layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                fused(layer.mlp, ("gate_proj", "up_proj")),
            )
            for layer in layers
        ]
        return cls(model, built)

    def __call__(self, input_ids, rope, cache, keep, attention_path, recording=()):
        x = self.embed(input_ids)
        cos, sin = rope_tables(*self.rotary(x, rope))
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == last and recording:
                record_last_layer_inputs(recording, x)
            x = layer(x, cos, sin, cache, attention_path)
        return self.head(self.norm(rows_to_keep(x, keep)))[0]
