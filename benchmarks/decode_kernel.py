"""The CPU decode-attention kernel alone, per cache format: what one packed decode pass spends attending.

A packed decode pass of S sessions attends once per layer over every session's cache
(``kvmemory.attention.decode_kernel``). This times that kernel alone, for every layer of the default model's
shapes, over caches of ``--slots`` slots per KV head with β, stored as each ``kv_dtype`` stores them
(``kvmemory.cache.int8_rows`` for 8-bit rows):

* ``streamed``: every layer and session has its own cache, as in the model, so the caches come from memory;
* ``resident``: every layer reads the first layer's caches, which then stay in the CPU's caches: the
  difference is what reading the KV cache from memory costs, the rest is the kernel's arithmetic.

The formats take turns within each round (``--repeats`` rounds, medians). Writes ``decode_kernel.json`` and
``.png``.

    python -m benchmarks.decode_kernel [--sessions 1 8 16] [--slots 1024] [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import RESULTS, bench_model_config, save, table
from kvmemory import run_on_compute
from kvmemory.attention.decode_kernel import decode_op
from kvmemory.cache import int8_rows
from kvmemory.cache.compact_layer import META_BYTES

FORMATS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


def model_shapes() -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head dim) of the default model."""
    config = bench_model_config()
    dim = config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, dim


def kernel_calls(sessions: int, slots: int, dtype: torch.dtype, distinct_layers: bool, generator) -> list:
    """One pass's kernel calls, a closure per layer: each session's keys, values and metadata as a cache
    layer stores them (rows grouped by KV head, β in the metadata's first column)."""
    layers, q_heads, kv_heads, dim = model_shapes()
    query = torch.randn(q_heads, sessions, dim, generator=generator)
    spans = [n for _ in range(sessions) for head in range(kv_heads) for n in (head * slots, slots)]

    def layer_inputs():
        def rows():
            return int8_rows.store(torch.randn(kv_heads * slots, dim, generator=generator), dtype)

        metas = []
        for _ in range(sessions):
            meta = torch.zeros(kv_heads * slots, 4, dtype=torch.int32)
            meta[:, 0] = (0.1 * torch.randn(kv_heads * slots, generator=generator)).view(torch.int32)
            metas.append(meta)
        return [rows() for _ in range(sessions)], [rows() for _ in range(sessions)], metas

    first = layer_inputs()
    inputs = [layer_inputs() if distinct_layers and i else first for i in range(layers)]
    op, scale, biased = decode_op(), dim**-0.5, [True] * sessions
    return [lambda k=k, v=v, m=m: op(query, scale, k, v, m, biased, spans) for k, v, m in inputs]


def bytes_read(sessions: int, slots: int, dtype: torch.dtype) -> int:
    """KV bytes one pass reads: keys and values of every layer, session and KV head, and their metadata (what
    ``Engine.kv_bytes_per_token`` counts for a token, here without loading the model)."""
    layers, _, kv_heads, dim = model_shapes()
    return layers * sessions * kv_heads * slots * (2 * int8_rows.row_bytes(dim, dtype) + META_BYTES)


def measure(session_counts: list[int], slots: int, repeats: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    rows = []
    for sessions in session_counts:
        runs = {
            (name, placement): kernel_calls(sessions, slots, dtype, placement == "streamed", generator)
            for name, dtype in FORMATS.items()
            for placement in ("streamed", "resident")
        }
        seconds = {key: [] for key in runs}
        for _ in range(repeats + 1):  # the first round warms up
            for key, calls in runs.items():
                start = time.perf_counter()
                for call in calls:
                    call()
                seconds[key].append(time.perf_counter() - start)
        ms = {key: 1e3 * statistics.median(times[1:]) for key, times in seconds.items()}
        for name, dtype in FORMATS.items():
            streamed, resident = ms[(name, "streamed")], ms[(name, "resident")]
            row = {"sessions": sessions, "kv_dtype": name, "streamed_ms": streamed, "resident_ms": resident}
            row["reading_share"] = 1 - resident / streamed
            row["gb_per_s"] = bytes_read(sessions, slots, dtype) / streamed / 1e6
            row["vs_float16"] = streamed / ms[("float16", "streamed")]
            rows.append(row)
        print(table([r for r in rows if r["sessions"] == sessions], list(rows[0])), flush=True)
    return rows


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["sessions"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(4.2 * len(counts), 3.8), squeeze=False)
    for ax, count in zip(axes[0], counts):
        mine = [r for r in rows if r["sessions"] == count]
        names = [r["kv_dtype"] for r in mine]
        ax.bar(names, [r["resident_ms"] for r in mine], label="arithmetic (caches resident)")
        reading = [r["streamed_ms"] - r["resident_ms"] for r in mine]
        ax.bar(names, reading, bottom=[r["resident_ms"] for r in mine], label="reading the cache from memory")
        ax.set_title(f"{count} session{'s' if count > 1 else ''}")
        ax.set_ylabel("ms per decode pass (every layer)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("CPU decode-attention kernel by cache format, default model's shapes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--slots", type=int, default=1024, help="slots per KV head of every session")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if decode_op() is None:
        parser.error("needs kvmemory's CPU kernels (an x86-64 CPU with AVX2 and a C++ compiler)")
    rows = run_on_compute(measure, args.sessions, args.slots, args.repeats)  # where every CPU forward runs
    plot(rows, RESULTS / "decode_kernel.png")
    print(f"saved {save('decode_kernel', {'slots': args.slots, 'repeats': args.repeats, 'rows': rows})}")


if __name__ == "__main__":
    main()
