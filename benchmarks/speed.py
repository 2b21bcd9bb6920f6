"""Prefill and decode speed: a kvmemory Session vs plain ``model.generate`` (sdpa, DynamicCache).

Both run the same default-model weights side by side in one process; medians of several runs.
Also decode speed after compacting a 4k-token context to 400 slots per KV head, evenly and with uneven
per-head budgets of the same total (0.5× to 1.5× the mean), against the same session uncompacted: each
warmed up, then interleaved run by run.

    python -m benchmarks.speed [--repeats 3] [--decode-tokens 32]
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import DynamicCache

from benchmarks.common import decode_seconds, median_time, save, table
from benchmarks.texts import source_text
from kvmemory import CompactionPlan, Engine, LayerPlan


def plain_generate(model, ids, new_tokens):
    with torch.no_grad():
        model.generate(
            ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            past_key_values=DynamicCache(config=model.config),
            pad_token_id=0,
        )


def evenly_spaced_plan(session, slots: int, uneven: bool = False) -> CompactionPlan:
    """``slots`` evenly spaced slots per head; ``uneven``: head h of H keeps slots × (0.5 + h/(H−1)) instead
    (the same total per layer), rotated across layers."""
    n = session.cache.physical_length
    plans = []
    for li, layer in enumerate(session.cache.layers):
        heads = layer.num_heads
        shares = [0.5 + ((h + li) % heads) / max(heads - 1, 1) if uneven else 1.0 for h in range(heads)]
        keep = [torch.linspace(0, n - 1, round(slots * share)).round().long().unique() for share in shares]
        plans.append(LayerPlan(keep=keep))
    return CompactionPlan(plans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    args = parser.parse_args()

    engine = Engine.from_pretrained("default")
    plain = copy.deepcopy(engine.model)
    plain.set_attn_implementation("sdpa")
    text_ids = engine.tokenizer.encode(source_text(200_000), add_special_tokens=False)
    n_dec = args.decode_tokens
    rows = []
    for ctx in args.contexts:
        ids = text_ids[:ctx]
        tensor = torch.tensor([ids])
        plain_prefill = median_time(lambda: plain_generate(plain, tensor, 1), args.repeats)
        plain_total = median_time(lambda: plain_generate(plain, tensor, n_dec + 1), args.repeats)

        def session_prefill():
            engine.session().append_tokens(ids)

        def session_total():
            s = engine.session()
            s.append_tokens(ids)
            s.generate(max_new_tokens=n_dec)

        ours_prefill = median_time(session_prefill, args.repeats)
        ours_total = median_time(session_total, args.repeats)
        row = {
            "context": ctx,
            "plain_prefill_tok_s": ctx / plain_prefill,
            "session_prefill_tok_s": ctx / ours_prefill,
            "plain_decode_tok_s": n_dec / (plain_total - plain_prefill),
            "session_decode_tok_s": n_dec / (ours_total - ours_prefill),
        }
        row["prefill_ratio"] = row["session_prefill_tok_s"] / row["plain_prefill_tok_s"]
        row["decode_ratio"] = row["session_decode_tok_s"] / row["plain_decode_tok_s"]
        rows.append(row)
        print(table([row], list(row)), flush=True)

    # decode after compaction: 4k tokens -> 400 slots per head (even and uneven heads) vs uncompacted
    ctx = args.contexts[-1]
    full, small, uneven = engine.session(), engine.session(), engine.session()
    for s in (full, small, uneven):
        s.append_tokens(text_ids[:ctx])
    small.apply_plan(evenly_spaced_plan(small, 400))
    uneven.apply_plan(evenly_spaced_plan(uneven, 400, uneven=True))

    sessions = {"uncompacted": full, "compacted": small, "uneven": uneven}
    t_full, t_small, t_uneven = decode_seconds(sessions, n_dec, args.repeats).values()
    compacted = {
        "context": ctx,
        "slots": small.cache.physical_length,
        "uncompacted_decode_tok_s": n_dec / t_full,
        "compacted_decode_tok_s": n_dec / t_small,
        "uneven_decode_tok_s": n_dec / t_uneven,
        "speedup": t_full / t_small,
        "uneven_vs_even": t_small / t_uneven,
        "uncompacted_kv_bytes": full.stats().kv_bytes,
        "compacted_kv_bytes": small.stats().kv_bytes,
        "uneven_kv_bytes": uneven.stats().kv_bytes,
    }
    print()
    print(table(rows, list(rows[0])))
    print()
    print(table([compacted], list(compacted)))
    path = save("speed", {"decode_tokens": n_dec, "repeats": args.repeats, "rows": rows, "compacted": compacted})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
