"""Many agents on one engine: continuous batching against one session, no batching and transformers.

S concurrent agent sessions (S = 1, 2, 4, 8, 16) on the default model. Session i holds agent trace
i mod 4 (system prompt, task, tool calls and the real tool outputs of ``benchmarks/data/traces``) up to
about ``--context`` tokens, cut at a tool result and a little shorter for each later copy of a trace, so
no two sessions hold the same context. Each session runs under the default memory policy with a cap of
``--cap`` slots. Then, all sessions at once:

* decode: ``--tokens`` greedy tokens each (end-of-turn ignored), ``--repeats`` times: aggregate decode
  tokens/s over the wall time, per-session tokens/s over each session's own time (medians);
* turn: the trace's next tool call and result are appended and a reply is streamed: time to first token.

Side by side in one run, on the same contexts:

* ``kvmemory``: the engine batches the sessions' forwards (``ForwardBatcher``);
* ``kvmemory unbatched``: one session per forward (``max_batch_tokens=1``), as an engine without batching;
* ``transformers``: ``model.generate`` over the contexts left-padded into one batch (DynamicCache, sdpa,
  no compaction): decode tokens/s from a full run minus a prefill-only run.

KV bytes are what the caches hold after the decode phase. Writes ``concurrency.json`` and ``.png``.

    python -m benchmarks.concurrency [--sessions 1 2 4 8 16] [--context 1024] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import threading
import time

import torch

from benchmarks.agent_traces import load_traces
from benchmarks.common import RESULTS, save, table
from kvmemory import Engine, SamplingParams, run_on_compute
from kvmemory.memory import MemoryManager, default_policy
from kvmemory.runtime.weights import WEIGHT_FORMATS


def contexts(engine: Engine, count: int, context: int) -> list[tuple[list[dict], list[dict]]]:
    """Per session: (messages up to a tool result within the context, the next tool call and result)."""
    traces = load_traces()
    render = engine.render_chat
    chosen = []
    for i in range(count):
        messages = traces[i % len(traces)]["messages"]
        limit = context - 96 * (i // len(traces))
        ends = [k for k, m in enumerate(messages) if m["role"] == "tool" and k + 2 < len(messages)]
        fitting = [k for k in ends if len(render(messages[: k + 1], add_generation_prompt=True)) <= limit]
        end = fitting[-1] if fitting else ends[0]
        after = next(k for k in ends if k > end) if any(k > end for k in ends) else len(messages) - 1
        following = [m for m in messages[end + 1 : after + 1] if m["role"] != "assistant" or m.get("tool_calls")]
        chosen.append((messages[: end + 1], following))
    return chosen


def open_sessions(engine: Engine, chosen, cap: int) -> list:
    sessions = []
    for shown, _ in chosen:
        session = engine.session(memory=MemoryManager(default_policy(max_slots=cap)))
        session.append_messages(shown)
        sessions.append(session)
    return sessions


def all_at_once(sessions, work) -> tuple[float, list]:
    """Run ``work(session)`` on every session in its own thread, started together; (wall seconds, results)."""
    results = [None] * len(sessions)
    gate = threading.Barrier(len(sessions) + 1)

    def run(i):
        gate.wait()
        results[i] = work(sessions[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    gate.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - started, results


def decode(tokens: int):
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)

    def work(session):
        started = time.perf_counter()
        result = session.generate(params=params)
        return len(result.token_ids), time.perf_counter() - started

    return work


def turn(following: dict, tokens: int):
    def work(session):
        started = time.perf_counter()
        session.append_messages(following[session.id])
        generation = session.start_generation(max_new_tokens=tokens, ignore_eos=True)
        generation.step()
        first = time.perf_counter() - started
        generation.close()
        return first

    return work


def kvmemory_run(engine: Engine, chosen, cap: int, tokens: int, repeats: int) -> dict:
    sessions = open_sessions(engine, chosen, cap)
    before = engine.batcher.stats.passes, engine.batcher.stats.requests
    runs = [all_at_once(sessions, decode(tokens)) for _ in range(repeats)]
    passes = engine.batcher.stats.passes - before[0]
    requests = engine.batcher.stats.requests - before[1]
    kv = sum(s.cache.allocated_bytes() for s in sessions)
    following = {s.id: f for s, (_, f) in zip(sessions, chosen)}
    _, firsts = all_at_once(sessions, turn(following, tokens))
    for s in sessions:
        s.close()
    # the first token of a reply comes from the prompt's logits: the others each need a decode forward
    return {
        "decode_tok_s": statistics.median(sum(n - 1 for n, _ in results) / wall for wall, results in runs),
        "per_session_tok_s": statistics.median((n - 1) / t for _, results in runs for n, t in results),
        "ttft_median_s": statistics.median(firsts),
        "ttft_max_s": max(firsts),
        "kv_mb": kv / 2**20,
        "sessions_per_pass": requests / passes,
    }


def transformers_run(model, tokenizer, chosen_ids: list[list[int]], tokens: int, repeats: int) -> dict:
    """``generate`` over the same contexts, left-padded into one batch."""
    width = max(len(ids) for ids in chosen_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in chosen_ids])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chosen_ids])

    def run(n: int):
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
                return_dict_in_generate=True,
            )
        return time.perf_counter() - started, out

    speeds = []
    for _ in range(repeats):
        prefill, _ = run_on_compute(run, 1)  # where a Session's forwards run (kvmemory.runtime.compute)
        total, out = run_on_compute(run, tokens)
        speeds.append(len(chosen_ids) * (tokens - 1) / (total - prefill))
    cache = out.past_key_values
    kv = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return {"decode_tok_s": statistics.median(speeds), "kv_mb": kv / 2**20}


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    counts = [r["sessions"] for r in rows]
    for key, label in (
        ("kvmemory_tok_s", "kvmemory (batched)"),
        ("unbatched_tok_s", "kvmemory, one session per forward"),
        ("transformers_tok_s", "transformers generate, padded batch"),
    ):
        ax.plot(counts, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_xlabel("concurrent agent sessions")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title("Default model on CPU, equal contexts")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--cap", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="decode phases per run; tokens/s is their median")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, help="default: the engine's default")
    args = parser.parse_args()
    engine = Engine.from_pretrained("default", weights=args.weights)
    unbatched = Engine(engine.model, engine.tokenizer, name=engine.name, max_batch_tokens=1)
    reference = copy.deepcopy(engine.model)
    reference.set_attn_implementation("sdpa")
    rows = []
    for count in args.sessions:
        chosen = contexts(engine, count, args.context)
        render = engine.render_chat
        ids = [render(shown, add_generation_prompt=True) for shown, _ in chosen]
        batched = kvmemory_run(engine, chosen, args.cap, args.tokens, args.repeats)
        alone = kvmemory_run(unbatched, chosen, args.cap, args.tokens, args.repeats)
        plain = transformers_run(reference, engine.tokenizer, ids, args.tokens, args.repeats)
        rows.append(
            {
                "sessions": count,
                "context_tokens": statistics.median(len(i) for i in ids),
                "kvmemory_tok_s": batched["decode_tok_s"],
                "per_session_tok_s": batched["per_session_tok_s"],
                "sessions_per_pass": batched["sessions_per_pass"],
                "unbatched_tok_s": alone["decode_tok_s"],
                "transformers_tok_s": plain["decode_tok_s"],
                "ttft_median_s": batched["ttft_median_s"],
                "ttft_max_s": batched["ttft_max_s"],
                "unbatched_ttft_median_s": alone["ttft_median_s"],
                "kv_mb": batched["kv_mb"],
                "transformers_kv_mb": plain["kv_mb"],
            }
        )
        print(table(rows[-1:], list(rows[-1])), flush=True)
    one = rows[0]["kvmemory_tok_s"] if rows[0]["sessions"] == 1 else None
    for row in rows:
        row["speedup_vs_one"] = row["kvmemory_tok_s"] / one if one else None
    print(table(rows, list(rows[0])))
    plot(rows, RESULTS / "concurrency.png")
    settings = {"context": args.context, "tokens": args.tokens, "cap": args.cap, "repeats": args.repeats}
    settings["weights"] = engine.weights
    settings["default_method"] = default_policy().default.method
    out = save("concurrency", {**settings, "rows": rows})
    print(f"saved {out}")


if __name__ == "__main__":
    main()
