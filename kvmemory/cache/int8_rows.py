"""Keys and values stored as 8-bit integers, one scale per row (``Engine(kv_dtype="int8")``).

Each cached key or value row of one KV head (``D`` numbers) is stored as ``D`` int8 levels followed by the fp32
scale they are multiplied by (its 4 bytes, in the same row): ``x ≈ level × scale`` with ``scale = max|x| / 127``
and levels rounded to nearest (ties to even). That is llama.cpp's ``q8_0`` cache layout with one scale per
head row instead of per 32 numbers: each token's row keeps its own range, so a token with a large key does not
coarsen the others' rows. On the default model a 64-dim row costs 68 bytes against 128 in fp16, and the
teacher-forced NLL of ``benchmarks.quality``'s texts moves by at most 0.0063 nats (``benchmarks.kv_dtype``).

Rows are encoded once, when they enter the cache (or when compaction writes fitted values or re-rotated
keys); attention reads them as they are stored on the CPU decode kernel, which applies the scales itself,
and everywhere else reads them decoded (``decode``)."""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # the fp32 scale at the end of each row
LEVELS = 127  # levels run over [−127, 127]: symmetric, so −x encodes as the negation of x


def is_int8(dtype: torch.dtype) -> bool:
    return dtype == torch.int8


def stored_width(dim: int, dtype: torch.dtype) -> int:
    """Elements one row of ``dim`` numbers takes in storage of ``dtype``."""
    return dim + SCALE_BYTES if is_int8(dtype) else dim


def row_bytes(dim: int, dtype: torch.dtype) -> int:
    """Bytes one row of ``dim`` numbers costs in storage of ``dtype``."""
    return stored_width(dim, dtype) * torch.empty((), dtype=dtype).element_size()


def encode(rows: torch.Tensor) -> torch.Tensor:
    """(..., D) floats → (..., D + 4) int8: each row's levels, then its fp32 scale's bytes."""
    rows = rows.float()
    scale = rows.abs().amax(-1, keepdim=True) / LEVELS
    levels = torch.where(scale > 0, rows / scale, 0.0).round_().clamp_(-LEVELS, LEVELS).to(torch.int8)
    return torch.cat([levels, scale.view(torch.int8)], dim=-1)


def decode(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., D + 4) int8 → (..., D) in ``dtype``."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)


def read(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows (of any storage dtype) as ``dtype`` numbers: decoded 8-bit rows, a cast of float ones."""
    return decode(rows, dtype) if is_int8(rows.dtype) else rows.to(dtype)


def store(rows: torch.Tensor, storage_dtype: torch.dtype) -> torch.Tensor:
    """Numbers as rows of ``storage_dtype`` (what ``read`` reads back)."""
    return encode(rows) if is_int8(storage_dtype) else rows.to(storage_dtype)


def convert(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows in another storage dtype (a saved cache loaded by an engine that stores another): as they
    are when the dtype is the same, so a file loads bit for bit."""
    if rows.dtype == dtype:
        return rows
    return store(read(rows, torch.float32), dtype)
