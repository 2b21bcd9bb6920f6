"""A model read from a GGUF file: its config, tokenizer and tensor table prepared once, its tensors read from
the file at every load.

transformers reads a GGUF file's metadata field by field in Python (12 s for Qwen2.5-Coder-1.5B's config,
13 s for its tokenizer, 9 s for ``gguf``'s tensor table on 2 cores) and dequantizes every block to fp32.
``prepared`` does the first three once and keeps them in a small directory under ``CACHE_DIR`` (no weights:
the GGUF file stays the one copy). ``gguf_model`` then maps the file, builds the transformers model without
allocating its weights (accelerate's ``init_empty_weights``) and gives each module its tensor: a linear
layer or the embedding whose blocks the CPU kernel multiplies keeps them (``GgufLinear``, ``GgufEmbedding``)
where ``keep_blocks``; any other weight is dequantized (``gguf.quants``) to the model's dtype.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvmemory.errors import ModelLoadError
from kvmemory.notices import one_time_work, warn
from kvmemory.runtime.gguf_weights import GgufEmbedding, GgufLinear, kept
from kvmemory.runtime.named_models import CACHE_DIR

PREPARED_FORMAT = "gguf-blocks"  # in the cache key: a directory of another layout is prepared again
SOURCE_DIGEST = "source.sha256"  # the sha256 of the GGUF file, taken once when preparing
TENSOR_TABLE = "tensors.json"  # name, GGML type, shape and byte range of every tensor in the file
DENSE_TYPES = {0: np.float32, 1: np.float16}  # GGML F32, F16: read as they are

# GGUF tensor names → transformers module paths (Llama, Mistral, Qwen2, Qwen3)
GLOBAL_MODULES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_MODULES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
IGNORED = {"rope_freqs"}  # transformers computes these from the config


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def source_digest(prepared: Path) -> str | None:
    """The sha256 of the GGUF file ``prepared`` was made from (taken once, when preparing)."""
    path = prepared / SOURCE_DIGEST
    return path.read_text().strip() if path.is_file() else None


def prepared(gguf: Path) -> Path:
    """The directory of ``gguf``'s config, tokenizer and tensor table, made once under ``CACHE_DIR`` (in a
    temporary directory where the cache cannot be written). The key holds the file's path, size and
    modification time, the transformers version and ``PREPARED_FORMAT``; a directory of the same file under
    another key (an earlier kvmemory's conversion among them) is removed once the new one is in place."""
    import transformers

    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{PREPARED_FORMAT}"
    target = CACHE_DIR / "models" / f"{gguf.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (target / TENSOR_TABLE).is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    except OSError as err:
        warn("cannot cache %s's config and tokenizer (%s): reading them from the file on every load", gguf.name, err)
        staging, target = Path(tempfile.mkdtemp(prefix="kvmemory-gguf-")), None
    try:
        with one_time_work(f"reading {gguf.name}'s config and tokenizer", "30 s"):
            _prepare(gguf, staging)
        if target is None:
            return staging
        with contextlib.suppress(OSError):
            os.replace(staging, target)  # whole or not at all: a second process may have won the race
    finally:
        if target is not None:
            shutil.rmtree(staging, ignore_errors=True)
    for stale in target.parent.glob(f"{gguf.stem}-*"):  # another key's directory of this file
        if stale != target and len(stale.name) == len(target.name) and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return target


def _prepare(gguf: Path, into: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    source = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name)
    AutoTokenizer.from_pretrained(**source).save_pretrained(into)
    config = AutoConfig.from_pretrained(**source)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(into)
    reader = GGUFReader(gguf)
    table = [
        dict(
            name=t.name,
            type=int(t.tensor_type),
            shape=[int(n) for n in t.shape],
            offset=int(t.data_offset),
            bytes=int(t.n_bytes),
        )
        for t in reader.tensors
    ]
    architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    (into / TENSOR_TABLE).write_text(json.dumps({"architecture": architecture, "tensors": table}))
    (into / SOURCE_DIGEST).write_text(file_sha256(gguf))  # the model's identity, hashed once


@dataclass
class Tensor:
    """One tensor of the file: its GGML type, its rows (the outer dimensions joined) and the file's bytes of it,
    (rows, bytes per row) for blocks, (rows, columns) for F32 and F16."""

    name: str
    ggml_type: int
    rows: int
    columns: int  # the inner dimension: a linear layer's inputs
    data: np.ndarray

    def dense(self) -> torch.Tensor:
        """The values in fp32, dequantized where they are blocks."""
        if self.ggml_type in DENSE_TYPES:
            values = self.data.astype(np.float32)
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            values = dequantize(self.data, GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(values)).reshape(self.rows, self.columns).squeeze(0)

    def blocks(self) -> torch.Tensor:
        return torch.from_numpy(np.array(self.data))  # a copy in memory: the map stays read-only


def tensors(gguf: Path, table: dict) -> dict[str, Tensor]:
    mapped = np.memmap(gguf, dtype=np.uint8, mode="r")
    out = {}
    for entry in table["tensors"]:
        shape, kind = entry["shape"], entry["type"]
        columns, rows = shape[0], int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        data = mapped[entry["offset"] : entry["offset"] + entry["bytes"]]
        if kind in DENSE_TYPES:
            data = data.view(DENSE_TYPES[kind]).reshape(rows, columns)
        else:
            data = data.reshape(rows, -1)
        out[entry["name"]] = Tensor(entry["name"], kind, rows, columns, data)
    return out


def module_path(name: str) -> tuple[str, str]:
    """(transformers module path, "weight" or "bias") of a GGUF tensor name; ("", "") for ignored ones."""
    stem, _, kind = name.rpartition(".")
    parts = stem.split(".")
    if stem in IGNORED:
        return "", ""
    if stem in GLOBAL_MODULES:
        return GLOBAL_MODULES[stem], kind
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in LAYER_MODULES:
        return f"model.layers.{parts[1]}.{LAYER_MODULES[parts[2]]}", kind
    raise ModelLoadError(f"tensor {name!r} of the GGUF file has no place in a Llama, Mistral, Qwen2 or Qwen3 model")


def unpermuted_rows(count: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's conversion permutation of a Llama q or k projection (each head's rows
    interleaved in pairs for its RoPE layout), as transformers' GGUF loader undoes it."""
    return np.arange(count).reshape(heads, count // heads // 2, 2).swapaxes(2, 1).reshape(count)


def gguf_model(gguf: Path, prepared_dir: Path, config, dtype: torch.dtype, keep_blocks: bool, attn_implementation: str):
    """The transformers model of ``gguf`` (see the module docstring)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    table = json.loads((prepared_dir / TENSOR_TABLE).read_text())
    by_module: dict[str, dict[str, Tensor]] = {}
    for name, tensor in tensors(gguf, table).items():
        path, kind = module_path(name)
        if path:
            by_module.setdefault(path, {})[kind] = tensor
    with init_empty_weights():  # parameters on the meta device; buffers (RoPE's) made for real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    permuted = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    for path, parts in by_module.items():
        heads = next((n for suffix, n in permuted.items() if path.endswith(suffix)), None)
        order = unpermuted_rows(parts["weight"].rows, heads) if table["architecture"] == "llama" and heads else None
        _place(model, path, parts, dtype, keep_blocks, order)
    if "lm_head" not in by_module:  # the head is the embedding
        embedding = model.get_input_embeddings()
        if isinstance(embedding, GgufEmbedding):
            model.lm_head = embedding.as_head()
        else:
            model.lm_head.weight = embedding.weight
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if missing:
        raise ModelLoadError(f"{gguf.name} has no tensor for {', '.join(missing[:5])}")
    model.config.tie_word_embeddings = False  # each module holds its own weights (or the same blocks)
    return model.eval()


def _place(model, path: str, parts: dict[str, Tensor], dtype, keep_blocks: bool, order) -> None:
    parent_path, _, child_name = path.rpartition(".")
    parent, child = model.get_submodule(parent_path), model.get_submodule(path)
    weight, bias = parts["weight"], parts.get("bias")
    blocks = keep_blocks and kept(weight.ggml_type, weight.columns)
    if blocks and isinstance(child, nn.Embedding):
        setattr(parent, child_name, GgufEmbedding(weight.blocks(), weight.ggml_type, weight.columns))
        return
    bias_values = None if bias is None else bias.dense()
    if order is not None:
        bias_values = None if bias_values is None else bias_values[order]
    if blocks and isinstance(child, nn.Linear):
        data = weight.blocks() if order is None else weight.blocks()[order]
        setattr(parent, child_name, GgufLinear(data.contiguous(), weight.ggml_type, weight.columns, bias_values))
        return
    values = weight.dense()
    if order is not None:
        values = values[order]
    child.weight = nn.Parameter(values.to(dtype).contiguous(), requires_grad=False)
    if bias_values is not None:
        child.bias = nn.Parameter(bias_values.to(dtype), requires_grad=False)
