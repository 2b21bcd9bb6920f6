"""A CPU kernel for one decode step's attention over every session of a packed pass at once.

Decoding a token reads each session's cached keys and values once per layer: when sessions are batched
(``kvmemory.runtime.batching``) the weights are read once per pass but attention grows with every session.
torch's CPU ``scaled_dot_product_attention`` takes one session per call and on these shapes read the cache at
about 6 GB/s on a 2-core machine that streams 20; a cache stored in 16 bits (``Engine(kv_dtype=...)``) was
first copied to fp32. ``decode_attention.cpp`` runs all sessions' KV heads of a layer in one parallel loop:
each reads its keys once for its whole query group and its values once, in the stored dtype (fp32, fp16,
bf16), adds β, and sums in fp32. Same results as sdpa within float rounding (tests/test_decode_kernel.py);
``python -m benchmarks.concurrency`` measures what it buys. In a packed decode pass it also writes the step's
new key, value and metadata row of every session (``PackedCache``), a dozen small tensor operations per
session and layer fewer.

It lives in ``kvmemory/kernels/decode_attention.cpp``, built with kvmemory's other CPU kernels (``kvmemory.kernels``:
once per machine, x86-64 with AVX2); where they are unavailable attention stays on sdpa.
"""

from __future__ import annotations

import torch

from kvmemory.kernels import cpu_ops


def decode_op():
    """The kernel's op, built on first call; None where it is unavailable (see ``kvmemory.kernels``)."""
    ops = cpu_ops()
    return None if ops is None else ops.decode_attention


def usable(query: torch.Tensor) -> bool:
    """Whether a decode step with these queries (B, Hq, Q, D) can run on the kernel: fp32 on a CPU, head
    dims in whole vectors, and the kernel available (the caller checks that each session has one query)."""
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and query.shape[-1] % 8 == 0
        and decode_op() is not None
    )


def decode_attention(query: torch.Tensor, layers, scaling: float | None, new_rows=None) -> torch.Tensor:
    """One decode token per session: ``query`` (1, Hq, N, D) and ``layers`` the N sessions' cache layers
    (``CompactLayer``), read as stored: no view or copy is made per session. Their new token is appended
    already, or, with ``new_rows`` = (keys (1, H, N, D), values (1, H, N, Dv), metadata rows (N, 4)), its rows
    are counted (``CompactLayer.claim``) and the kernel writes them. The kernel reads the queries, keys and
    values as attention has them (views) and applies the scale itself: no copy is made per layer either.
    Returns (1, N, Hq, Dv), the layout transformers' attention functions return."""
    heads_q, count, dim = query.shape[1], query.shape[2], query.shape[3]
    spans = [n for layer in layers for head in zip(layer.starts, layer.lengths) for n in head]
    written = ()
    if new_rows is not None:
        keys, values, meta = new_rows
        written = (keys[0], values[0], meta)
    out = decode_op()(
        query[0],
        scaling if scaling is not None else dim**-0.5,
        [layer.slots.keys for layer in layers],
        [layer.slots.values for layer in layers],
        [layer.slots.meta for layer in layers],
        [layer.biased for layer in layers],
        spans,
        *written,
    )
    return out.view(1, count, heads_q, -1)
