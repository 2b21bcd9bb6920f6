"""Engine: owns the model and tokenizer; the forward passes of its sessions run batched (``ForwardBatcher``)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import asdict

import torch

from kvmemory.attention import ATTENTION_NAME, ATTENTION_PATHS, decode_kernel
from kvmemory.cache import int8_rows
from kvmemory.cache.compact_layer import META_BYTES
from kvmemory.errors import InvalidArgumentError
from kvmemory.runtime import compute
from kvmemory.runtime.batching import ForwardBatcher
from kvmemory.runtime.chat import ChatRenderer
from kvmemory.runtime.dtypes import KV_DTYPE_NAMES
from kvmemory.runtime.loading import (
    check_architecture,
    is_gguf_source,
    keep_every_token,
    load_model_and_tokenizer,
    pick_device_and_dtype,
)
from kvmemory.runtime.named_models import DEFAULT_MODEL, model_title
from kvmemory.runtime.persistence import load_session
from kvmemory.runtime.session import Session
from kvmemory.runtime.weights import (
    check_weights,
    default_weights,
    store_linear_weights,
    weight_format,
    weights_digest,
)

MAX_LOGICAL_POSITIONS = 2**31 - 1  # the cache stores positions as int32
KV_DTYPES = {name: getattr(torch, name) for name in KV_DTYPE_NAMES}
# A session's default prefill chunk, and the tokens a packed pass holds beside one chunk on CPU (decode steps,
# short messages). A decode step waits for the chunk in its pass: on CPU, 256-token chunks halve that wait against
# 512-token ones for 5-9% of the prefill's speed (``benchmarks.prefill_stall``, two runs); 128-token chunks halve
# it again for 3-14% (and 7-20% against 256 in a third measurement): 256 is the middle.
CPU_PREFILL_CHUNK, DEVICE_PREFILL_CHUNK = 256, 512
CPU_PASS_HEADROOM, DEVICE_PASS_TOKENS = 128, 2048


def kv_storage_dtype(kv_dtype: torch.dtype | str | None, model_dtype: torch.dtype, weights: str) -> torch.dtype:
    """The dtype the KV cache stores keys and values in (``kv_dtype``; None for the default).

    The default is the model's dtype, except under fp32 activations with linear weights stored in fewer bits
    (the CPU default: fp16 or int4), where it is fp16, as llama.cpp's cache is: the keys and values are
    products of weights rounded to 16 bits or fewer already, a token costs 52% of its fp32 bytes on the
    default model, so a byte cap holds 1.94× the tokens, and the CPU decode kernel reads half the bytes per
    step. fp16 keeps three more mantissa bits than bf16 at the range keys and values have; ``"float32"`` keeps
    full precision (the exactness reference of the tests, with ``weights="fp32"``); ``"int8"`` stores each row
    as 8-bit levels and a scale (``kvmemory.cache.int8_rows``): 0.56× fp16's bytes on the default model."""
    if kv_dtype is None:
        return torch.float16 if model_dtype == torch.float32 and weights != "fp32" else model_dtype
    dtype = KV_DTYPES.get(kv_dtype) if isinstance(kv_dtype, str) else kv_dtype
    if dtype not in KV_DTYPES.values():
        raise InvalidArgumentError(f"kv_dtype must be one of {sorted(KV_DTYPES)} (or None), got {kv_dtype!r}")
    return dtype


class Engine:
    """A local causal LM ready to serve kvmemory sessions.

    Use ``Engine.from_pretrained("default")`` for the default model (Qwen2.5-Coder-0.5B-Instruct), another
    named model (``kvmemory models list``; pulled on first use), any HF id or directory, or a ``.gguf`` file;
    ``Engine(model, tokenizer)`` wraps a model already in memory. ``kv_dtype``
    ("float32", "float16", "bfloat16", "int8") is what every session's keys and values are stored in; by default
    fp16 under 16-bit or int4 weights on fp32 activations, else the model's dtype (``kv_storage_dtype``).
    ``prefill_chunk_size`` is the most tokens a session prefills in one forward (256 on a CPU, 512 elsewhere; a
    session may set its own) and ``max_batch_tokens`` bounds the tokens of one packed pass (``ForwardBatcher``;
    on a CPU one chunk and 128 more, elsewhere 2048; 1 runs one session a pass). ``weights_digest``: the sha256
    of the file the weights come from, if known (``identity``).
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        name: str | None = None,
        max_context: int | None = None,
        position_limit: int | None = None,
        rebase_positions: bool = True,
        rebase_at: int | None = None,
        max_batch_tokens: int | None = None,
        attention_path: str | None = None,
        kv_dtype: torch.dtype | str | None = None,
        prefill_chunk_size: int | None = None,
        weights_digest: str | None = None,
    ):
        for limit, value in (("max_batch_tokens", max_batch_tokens), ("prefill_chunk_size", prefill_chunk_size)):
            if value is not None and value < 1:
                raise InvalidArgumentError(f"{limit} must be at least 1 (or None), got {value}")
        if attention_path not in ATTENTION_PATHS:
            raise InvalidArgumentError(f"attention_path must be one of {ATTENTION_PATHS}, got {attention_path!r}")
        self.kv_dtype = kv_storage_dtype(kv_dtype, next(model.parameters()).dtype, weight_format(model))
        check_architecture(model.config)
        keep_every_token(model.config)
        model.set_attn_implementation(ATTENTION_NAME)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = model.config
        self.name = name or getattr(model.config, "name_or_path", None) or model.config.model_type
        self._weights_digest = weights_digest  # the source file's sha256, kept since the model was prepared
        # The attention window (slots of the longest head) defaults to the trained context. Logical positions keep
        # counting the true token index after compaction. Once RoPE positions would pass ``rebase_at``
        # (default: the trained positions), the cache is re-rotated to close compaction's gaps (see
        # Session.rebase_positions), so RoPE positions stay bounded and a capped session may run for as
        # many tokens as the cache's int32 positions count. Without rebasing, RoPE positions are the
        # logical ones and ``position_limit`` bounds how far RoPE extrapolates (4× the trained length).
        self.max_context = max_context or model.config.max_position_embeddings
        self.rebase_positions = rebase_positions
        self.rebase_at = rebase_at or model.config.max_position_embeddings
        unbounded = MAX_LOGICAL_POSITIONS if rebase_positions else 4 * model.config.max_position_embeddings
        self.position_limit = position_limit or unbounded
        # Concurrent sessions' forwards run as packed passes over their own caches, one pass at a time.
        # ``attention_path``: None picks per device (kvmemory.attention); "flex" reads uneven heads in one call.
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.prefill_chunk_size = prefill_chunk_size or (CPU_PREFILL_CHUNK if on_cpu else DEVICE_PREFILL_CHUNK)
        if max_batch_tokens is None:
            max_batch_tokens = self.prefill_chunk_size + CPU_PASS_HEADROOM if on_cpu else DEVICE_PASS_TOKENS
        self.batcher = ForwardBatcher(self.model, max_tokens=max_batch_tokens, attention_path=attention_path)
        if attention_path is None and on_cpu:
            decode_kernel.decode_op()  # built here, once per machine, rather than in a session's first step
        self._renderer: ChatRenderer | None = None
        self.sessions: weakref.WeakSet[Session] = weakref.WeakSet()  # every session made on this engine

    @classmethod
    def from_pretrained(
        cls, name_or_path: str = DEFAULT_MODEL, device=None, dtype=None, weights: str | None = None, **limits
    ) -> Engine:
        """``dtype``: activations (fp32 on CPU, bf16 on CUDA); ``kv_dtype``: the KV cache's (see the class);
        ``weights``: how the linear layers' weights are stored ("gguf": a GGUF file's own blocks, the CPU default
        for one; "fp32", "bf16", "fp16", "int4", or "auto": int4 for weights that are 4-bit already, fp16 for the
        rest; see ``kvmemory.runtime.weights``)."""
        device, dtype = pick_device_and_dtype(device, dtype)
        gguf = is_gguf_source(name_or_path)
        weights = weights or default_weights(device, dtype, gguf)
        if weights is not None:
            check_weights(weights, gguf, device, dtype)  # a bad choice fails before anything loads

        def load():
            model, tokenizer, digest = load_model_and_tokenizer(
                name_or_path, device, dtype, ATTENTION_NAME, keep_blocks=weights == "gguf"
            )
            return model if weights is None else store_linear_weights(model, weights), tokenizer, digest

        model, tokenizer, digest = compute.run_on(device, load)  # see kvmemory.runtime.compute
        return cls(model, tokenizer, name=model_title(name_or_path), weights_digest=digest, **limits)

    # ---- model facts ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.batcher.device  # read once (the model stays where it was loaded)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def weights(self) -> str:
        """How the decoder's linear layers store their weights ("int4", "fp16", ...)."""
        return weight_format(self.model)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.config, "head_dim", None) or self.config.hidden_size // self.config.num_attention_heads

    @property
    def rope_inv_freq(self) -> torch.Tensor:
        return self.model.model.rotary_emb.inv_freq

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes one token costs across all layers and KV heads (keys, values, β, position, segment)."""
        row = int8_rows.row_bytes(self.head_dim, self.kv_dtype)
        return self.num_layers * self.num_kv_heads * (2 * row + META_BYTES)

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    @property
    def max_positions(self) -> int:
        return self.config.max_position_embeddings

    @functools.cached_property
    def identity(self) -> dict:
        """What a saved session is valid for: the architecture, its shapes, the weights' storage and which
        weights. Which weights is the sha256 of the file the model was prepared from (``weights_digest``, kept
        since then), or else of every weight tensor, taken once here (a second or two a GB)."""
        config = self.config
        return {
            "architecture": config.model_type,
            "layers": self.num_layers,
            "kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": config.vocab_size,
            "dtype": str(self.model.dtype),
            "weights": self.weights,
            "weights_sha256": self._weights_digest or weights_digest(self.model),
        }

    @functools.cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """Every token that ends a reply (read once: it is asked after every decoded token)."""
        ids = set()
        for source in (getattr(self.model, "generation_config", None), self.config, self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update(value if isinstance(value, (list, tuple, set)) else [value] if value is not None else [])
        return frozenset(ids)

    @functools.cached_property
    def detokenize(self) -> Callable[[list[int]], str]:
        """Token ids → text, exactly as ``tokenizer.decode`` gives it. A reply's text is decoded after every
        token, and transformers' ``decode`` first walks every id in Python: a fast tokenizer that cleans up
        nothing decodes in its Rust backend directly (64 ids: 9 µs against 18)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return lambda ids: ""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
            return functools.partial(backend.decode, skip_special_tokens=False)
        return tokenizer.decode

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True):
        """The token ids a session holds for ``messages`` (the chat template, tools folded in where the
        template has no place for them): what a conversation costs in tokens before it is appended."""
        return self.renderer.render(messages, tools, add_generation_prompt=add_generation_prompt)

    @property
    def renderer(self) -> ChatRenderer:
        """The chat template renderer every session of this engine shares (made on first use)."""
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tokenizer)
        return self._renderer

    def stats(self) -> dict:
        """The open sessions and the KV bytes they hold (live slots, and allocated with headroom), and the
        batcher's counters: what admission control and monitoring read."""
        live = [s for s in list(self.sessions) if not s.closed]
        return {
            "sessions": len(live),
            "kv_bytes": sum(s.cache.kv_bytes() for s in live),
            "allocated_bytes": sum(s.cache.allocated_bytes() for s in live),
            "batching": asdict(self.batcher.stats),
        }

    # ---- sessions ------------------------------------------------------------------------------
    def session(
        self,
        session_id: str | None = None,
        memory=None,
        prefill_chunk_size: int | None = None,
        show_progress: bool = False,
    ) -> Session:
        """A new session (``with engine.session() as s``); for asyncio use ``engine.async_session()``.
        ``prefill_chunk_size``: tokens a forward prefills at most (None: the engine's ``prefill_chunk_size``)."""
        return Session(
            self,
            session_id=session_id,
            memory=memory,
            prefill_chunk_size=prefill_chunk_size,
            show_progress=show_progress,
        )

    def load_session(self, path, session_id: str | None = None) -> Session:
        """A session saved with ``session.save(path)``, exactly as it was (same next-token logits, same
        greedy continuation, same memory manager under the same cap). A missing, truncated or damaged file,
        another format version or another model raises ``SessionFileError`` / ``ModelMismatchError``."""
        return load_session(self, path, session_id)

    def async_session(
        self,
        session_id: str | None = None,
        memory=None,
        prefill_chunk_size: int | None = None,
        show_progress: bool = False,
    ):
        """A new session for asyncio (``async with engine.async_session() as s``): every blocking call is
        awaited in the session's worker thread."""
        from kvmemory.runtime.async_session import AsyncSession

        return AsyncSession(self.session(session_id, memory, prefill_chunk_size, show_progress))
