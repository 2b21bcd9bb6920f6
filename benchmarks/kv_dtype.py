"""What storing the KV cache in fewer bits costs and saves: bytes, speed and NLL per ``kv_dtype``.

The default model with the engine's default weights, its cache stored in fp32, fp16, bf16 and 8-bit rows
(``Engine(kv_dtype=...)``, ``kvmemory.cache.int8_rows``), the same model under each:

* the KV bytes one token costs (keys, values, β, positions, segment id; every layer and KV head);
* prefill of 2,048 tokens and ``--decode-tokens`` greedy tokens after it, the formats taking turns after a
  warm-up each (medians of ``--repeats``);
* ``benchmarks.quality``'s teacher-forced NLL per text kind (one 2,048-token window) of the full cache and
  of SnapKV, AM under REAL and TAM at 10×: the largest full-cache change from the fp32 cache, and whether
  the three methods rank alike on every kind (as the *Weight formats* table of ``benchmarks.speed`` asks of
  weights).

Writes ``kv_dtype.json`` and ``.png``.

    python -m benchmarks.kv_dtype [--repeats 5] [--decode-tokens 32]
"""

from __future__ import annotations

import argparse

from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from benchmarks.quality import beside_the_first, scored_nll
from benchmarks.speed import alternate, session_runner
from benchmarks.texts import source_text
from kvmemory import Engine

FORMATS = ("float32", "float16", "bfloat16", "int8")
CONTEXT = 2048


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    names = [r["kv_dtype"] for r in rows]
    panels = (
        ("kv_bytes_per_token", "KiB per token", 1 / 1024),
        ("decode_tok_s", f"decode tok/s at {CONTEXT} tokens", 1),
        ("max_full_nll_change", "max |Δ NLL| vs fp32 (full cache)", 1),
    )
    for ax, (key, label, scale) in zip(axes, panels):
        ax.bar(names, [r[key] * scale for r in rows], color=["tab:gray", "tab:blue", "tab:cyan", "tab:orange"])
        ax.set_title(label, fontsize=10)
    fig.suptitle("The KV cache stored in fewer bits (default model, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=32)
    args = parser.parse_args()
    base = Engine.from_pretrained(BENCH_MODEL)
    engines = {kv: Engine(base.model, base.tokenizer, name=base.name, kv_dtype=kv) for kv in FORMATS}
    ids = base.tokenizer.encode(source_text(40_000), add_special_tokens=False)[:CONTEXT]
    timed = alternate({kv: session_runner(e) for kv, e in engines.items()}, ids, args.decode_tokens, args.repeats)
    rows = [
        {
            "kv_dtype": kv,
            "kv_bytes_per_token": engines[kv].kv_bytes_per_token,
            "prefill_tok_s": CONTEXT / prefill,
            "decode_tok_s": args.decode_tokens / decode,
            "nll": scored_nll(engines[kv]),
        }
        for kv, (prefill, decode) in timed.items()
    ]
    beside_the_first(rows)
    columns = ["kv_dtype", "kv_bytes_per_token", "prefill_tok_s", "decode_tok_s", "max_full_nll_change"]
    print(table(rows, columns + ["same_method_order"]))
    plot(rows, RESULTS / "kv_dtype.png")
    settings = {"context": CONTEXT, "decode_tokens": args.decode_tokens, "repeats": args.repeats}
    out = save("kv_dtype", {**settings, "weights": base.weights, "rows": rows})
    print(f"saved {out}")


if __name__ == "__main__":
    main()
