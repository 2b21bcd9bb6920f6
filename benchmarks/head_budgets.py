"""Per-head budgets at equal bytes: what REAL's uneven head budgets cost and buy now that each KV head stores
only its own slots.

A 2,048-token window of Python source is compacted 4× (a mean of 512 slots per KV head; the first 4 and
last 32 tokens kept verbatim), by uniform SnapKV and Attention Matching and by both under REAL's per-head
budgets. For each: the slots per head (mean, min..max), the KV bytes the cache holds, the bytes the same
slots would take padded to each layer's longest head (the layout before ragged storage), and the
continuation NLL increase over the next 256 tokens (mean over windows). Then decode speed over the AM
under REAL cache vs the uniform AM cache (the same total slots, both with fitted β), interleaved and
warmed up, medians.

    python -m benchmarks.head_budgets [--windows 2] [--context 2048] [--ratio 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import BENCH_MODEL, RESULTS, decode_seconds, save, table
from benchmarks.quality import CONTINUATION, compact_context, prepared_session
from benchmarks.texts import TEXT_KINDS
from kvmemory import Engine

LABELS = {"snapkv": "SnapKV, uniform", "real": "REAL eviction", "am": "AM, uniform", "am_real": "AM under REAL"}


def layout_bytes(session) -> tuple[int, int, int, int]:
    """(bytes held, bytes if padded to each layer's longest head, fewest and most slots of any head)."""
    layers = session.cache.layers
    held = session.stats().kv_bytes
    padded = sum(layer.num_heads * layer.length * layer.head_slot_bytes() for layer in layers)
    counts = [n for layer in layers for n in layer.lengths]
    return held, padded, min(counts), max(counts)


def quality(engine, windows: int, n_context: int, ratio: float) -> list[dict]:
    ids = engine.tokenizer.encode(TEXT_KINDS["source"](n_context * 12 * windows), add_special_tokens=False)
    span = n_context + CONTINUATION
    per_label: dict[str, list[dict]] = {label: [] for label in LABELS}
    for w in range(windows):
        context, continuation = ids[w * span : w * span + n_context], ids[w * span + n_context : (w + 1) * span]
        base = prepared_session(engine, context)
        full_nll = float(-base.logprobs(continuation).mean())
        for label in LABELS:
            session, record = compact_context(base, n_context, label, ratio)
            held, padded, fewest, most = layout_bytes(session)
            nll = float(-session.logprobs(continuation).mean())
            per_label[label].append(
                {
                    "slots_per_head": session.cache.slots_per_head,
                    "fewest": fewest,
                    "most": most,
                    "kv_mb": held / 1e6,
                    "padded_mb": padded / 1e6,
                    "delta_nll": nll - full_nll,
                }
            )
            print(
                f"window {w} {label:<8} +{nll - full_nll:.4f} NLL  {held / 1e6:.1f} MB held, "
                f"{padded / 1e6:.1f} MB padded  ({record.milliseconds:.0f} ms)",
                flush=True,
            )
            session.close()
        base.close()
    rows = []
    for label, runs in per_label.items():
        row = {"method": LABELS[label], "label": label}
        row.update({key: statistics.mean(r[key] for r in runs) for key in runs[0]})
        row["fewest"], row["most"] = min(r["fewest"] for r in runs), max(r["most"] for r in runs)
        row["padding_saved"] = 1 - row["kv_mb"] / row["padded_mb"]
        rows.append(row)
    return rows


def decode_speed(engine, n_context: int, ratio: float, tokens: int, repeats: int) -> dict:
    """Decode tok/s over uneven (AM under REAL) and uniform (AM) caches of the same total slots and both
    with β, so the only difference is the heads' layout."""
    ids = engine.tokenizer.encode(TEXT_KINDS["source"](n_context * 12), add_special_tokens=False)[:n_context]
    base = prepared_session(engine, ids)
    caches = {label: compact_context(base, n_context, label, ratio)[0] for label in ("am", "am_real")}
    seconds = decode_seconds(caches, tokens, repeats)
    uniform, uneven = (tokens / seconds[k] for k in ("am", "am_real"))
    return {
        "uniform_kv_mb": caches["am"].stats().kv_bytes / 1e6,
        "uneven_kv_mb": caches["am_real"].stats().kv_bytes / 1e6,
        "uniform_decode_tok_s": uniform,
        "uneven_decode_tok_s": uneven,
        "uneven_vs_uniform": uneven / uniform,
    }


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(rows))
    left.bar([i - 0.2 for i in x], [r["padded_mb"] for r in rows], 0.4, label="padded to the longest head")
    left.bar([i + 0.2 for i in x], [r["kv_mb"] for r in rows], 0.4, label="ragged (held now)")
    left.set_ylabel("KV MB")
    left.legend(fontsize=8)
    right.bar(list(x), [r["delta_nll"] for r in rows], 0.5, color="tab:green")
    right.set_ylabel("continuation NLL increase")
    for ax in (left, right):
        ax.set_xticks(list(x))
        ax.set_xticklabels([r["method"] for r in rows], rotation=15, fontsize=8)
    fig.suptitle("4× compaction of 2,048 tokens of source, default model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--ratio", type=float, default=4.0)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engine = Engine.from_pretrained(BENCH_MODEL, kv_dtype="float32")  # bytes as the saved run counted them
    rows = quality(engine, args.windows, args.context, args.ratio)
    speed = decode_speed(engine, args.context, args.ratio, args.decode_tokens, args.repeats)
    columns = ["method", "slots_per_head", "fewest", "most", "kv_mb", "padded_mb", "padding_saved", "delta_nll"]
    print()
    print(table(rows, columns))
    print()
    print(table([speed], list(speed)))
    plot(rows, RESULTS / "head_budgets.png")
    path = save(
        "head_budgets",
        {"context": args.context, "ratio": args.ratio, "windows": args.windows, "rows": rows, "decode": speed},
    )
    print(f"\nsaved {path} and {RESULTS / 'head_budgets.png'}")


if __name__ == "__main__":
    main()
