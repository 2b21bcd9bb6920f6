"""Prefill and decode speed: a kvmemory Session vs plain ``model.generate`` (sdpa, DynamicCache).

Both run the same default-model weights side by side in one process; medians of several runs.
Also decode speed after compacting a 4k-token context to 400 slots.

    python -m benchmarks.speed [--repeats 3] [--decode-tokens 32]
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import DynamicCache

from benchmarks.common import median_time, save, table
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


def evenly_spaced_plan(session, slots: int) -> CompactionPlan:
    n = session.cache.physical_length
    keep = torch.linspace(0, n - 1, slots).round().long().unique()
    return CompactionPlan([LayerPlan(keep=keep.expand(layer.num_heads, -1).clone()) for layer in session.cache.layers])


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

    # decode after compaction: 4k tokens -> 400 slots, vs the same session uncompacted
    ctx = args.contexts[-1]
    full, small = engine.session(), engine.session()
    for s in (full, small):
        s.append_tokens(text_ids[:ctx])
    small.apply_plan(evenly_spaced_plan(small, 400))

    def decode(session):
        state = session.snapshot()
        session.generate(max_new_tokens=n_dec)
        session.restore(state)

    t_full = median_time(lambda: decode(full), args.repeats)
    t_small = median_time(lambda: decode(small), args.repeats)
    compacted = {
        "context": ctx,
        "slots": small.cache.physical_length,
        "uncompacted_decode_tok_s": n_dec / t_full,
        "compacted_decode_tok_s": n_dec / t_small,
        "speedup": t_full / t_small,
        "uncompacted_kv_bytes": full.stats().kv_bytes,
        "compacted_kv_bytes": small.stats().kv_bytes,
    }
    print()
    print(table(rows, list(rows[0])))
    print()
    print(table([compacted], list(compacted)))
    path = save("speed", {"decode_tokens": n_dec, "repeats": args.repeats, "rows": rows, "compacted": compacted})
    print(f"\nsaved {path}")


if __name__ == "__main__":
    main()
