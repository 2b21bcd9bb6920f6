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

It is built by ``torch.utils.cpp_extension`` with the C++ compiler torch's extensions use, once per machine
when the first CPU engine is made (about 25 s on 2 cores; then cached under ``TORCH_EXTENSIONS_DIR``), for
x86-64 CPUs with AVX2 and FMA. Where it cannot be built, or with ``KVMEMORY_DECODE_KERNEL=0``, attention
stays on sdpa.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_attention.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # x86-64-v3: every AVX2 machine runs it
ENV_SWITCH = "KVMEMORY_DECODE_KERNEL"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "op": the loaded op, or None once a build failed or it is switched off


def _build():
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch.utils.cpp_extension import load

    put_ninja_on_path()
    log.info("building kvmemory's CPU decode attention kernel (once per machine, about 25 s)")
    try:
        load(
            "kvmemory_decode_attention",
            [str(SOURCE)],
            extra_cflags=FLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as error:  # no compiler, missing headers: attention stays on sdpa, said once
        log.warning("kvmemory's CPU decode attention kernel could not be built (%s); using sdpa", error)
        return None
    return torch.ops.kvmemory.decode_attention


def put_ninja_on_path() -> None:
    """torch builds extensions with ninja, found on PATH: the ``ninja`` wheel's binary where none is there."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def decode_op():
    """The kernel's op, built on first call; None where it is unavailable (see the module docstring)."""
    if "op" not in _state:
        with _lock:
            if "op" not in _state:
                _state["op"] = _build()
    return _state["op"]


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
    are counted (``CompactLayer.claim``) and the kernel writes them. Returns (1, N, Hq, Dv), the layout
    transformers' attention functions return."""
    heads_q, count, dim = query.shape[1], query.shape[2], query.shape[3]
    kv_heads = layers[0].num_heads
    spans = [n for layer in layers for head in zip(layer.starts, layer.lengths) for n in head]
    scale = scaling if scaling is not None else dim**-0.5
    queries = (query[0].transpose(0, 1) * scale).reshape(count * kv_heads, heads_q // kv_heads, dim).contiguous()
    written = ()
    if new_rows is not None:
        keys, values, meta = new_rows
        written = (_per_item(keys), _per_item(values), meta)
    out = decode_op()(
        queries,
        [layer.slots.keys for layer in layers],
        [layer.slots.values for layer in layers],
        [layer.slots.meta for layer in layers],
        [layer.biased for layer in layers],
        spans,
        *written,
    )
    return out.view(1, count, heads_q, -1)


def _per_item(states: torch.Tensor) -> torch.Tensor:
    """(1, H, N, D) → (N·H, D) contiguous fp32: one row per session and KV head, the kernel's items."""
    return states[0].transpose(0, 1).reshape(-1, states.shape[-1]).float().contiguous()
