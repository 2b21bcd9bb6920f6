"""Many agents on one engine: continuous batching against one session, no batching and transformers.

S concurrent agent sessions (S = 1, 2, 4, 8, 16) on the default model. Session i holds agent trace
i mod 4 (system prompt, task, tool calls and the real tool outputs of ``benchmarks/data/traces``) up to
about ``--context`` tokens, cut at a tool result and a little shorter for each later copy of a trace, so
no two sessions hold the same context. Each session runs under the default memory policy with a cap of
``--cap`` slots. Then, all sessions at once:

* decode: ``--tokens`` greedy tokens each (end-of-turn ignored): aggregate decode tokens/s over the wall
  time, per-session tokens/s over each session's own time; the engine's time per pass (``Engine.stats()``'s
  ``busy_seconds`` over its passes, sampling included) and the share of the wall time it waited for the
  sessions between passes (their bookkeeping between two tokens);
* turn: the trace's next tool call and result are appended and a reply is streamed: time to first token.

Side by side in one run, on the same contexts, the decode phases of every session count and condition
taking turns, ``--repeats`` rounds of them (medians; each phase after an untimed ``WARM_UP_TOKENS``-token reply that
warms the caches the condition before it left cold; a session's context grows by that and ``--tokens`` a round):

* ``kvmemory``: the engine batches the sessions' forwards (``ForwardBatcher``); on a CPU its decode steps
  attend in kvmemory's decode kernel (``kvmemory.attention.decode_kernel``), which also writes their rows.
  Its cache is the engine's default: fp16 under the default fp16 or int4 weights (the kernel reads it in
  place);
* ``kvmemory fp32 cache``: the same with keys and values stored in fp32 (``kv_dtype="float32"``), under the
  same slot cap, so twice the bytes; ``kvmemory 8-bit cache``: stored as 8-bit rows (``kv_dtype="int8"``),
  0.56× the bytes;
* ``kvmemory sdpa``: the same with attention on torch's sdpa, one call per session (``attention_path="mask"``);
* ``kvmemory unbatched``: one session per forward (``max_batch_tokens=1``), as an engine without batching;
* ``transformers``: ``model.generate`` over the contexts left-padded into one batch (DynamicCache, sdpa,
  no compaction): decode tokens/s from the first generated token to the last (a streamer stamps each).

Then, for each count S > 1, ``--pairs`` pairs of ``kvmemory`` decode phases back to back, one session's and S
sessions', which goes first alternating: the *paired speedup* is the median of the pairs' ratios of aggregate
tokens/s (``paired_speedups`` says why the ratio of the rounds' medians is not enough here).

KV bytes are what the caches hold after the decode phases. Writes ``concurrency.json`` and ``.png`` (with
``--weights W``: ``concurrency_W.json`` and ``.png``, beside the default weights' run).

    python -m benchmarks.concurrency [--sessions 1 2 4 8 16] [--context 1024] [--tokens 32] [--repeats 3] [--pairs 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import threading
import time

import torch
from transformers.generation.streamers import BaseStreamer

from benchmarks.agent_traces import load_traces
from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from kvmemory import Engine, SamplingParams, run_on_compute
from kvmemory.memory import MemoryManager, default_policy
from kvmemory.runtime.weights import WEIGHT_FORMATS

WARM_UP_TOKENS = 4


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


def decode_phase(engine: Engine, sessions, tokens: int) -> dict:
    """All sessions decode ``tokens`` greedy tokens at once: aggregate and per-session tokens/s, passes.

    An untimed reply of ``WARM_UP_TOKENS`` comes first: every condition follows another's run (the one before
    it, transformers' padded batch, churns hundreds of MB), and a phase of a second or less would otherwise
    pay for the caches it finds cold, the shorter phases of fewer sessions most."""
    all_at_once(sessions, decode(WARM_UP_TOKENS))
    stats = engine.batcher.stats
    before = stats.passes, stats.requests, stats.busy_seconds
    wall, results = all_at_once(sessions, decode(tokens))
    # n − 1 tokens a session: its first step may need no forward (a fresh prompt's logits are at hand); after
    # the warm-up it forwards the token that reply left pending. Alike for every condition, so ratios hold
    return {
        "tok_s": sum(n - 1 for n, _ in results) / wall,
        "per_session": [(n - 1) / t for n, t in results],
        "passes": stats.passes - before[0],
        "requests": stats.requests - before[1],
        "busy_s": stats.busy_seconds - before[2],
        "wall_s": wall,
    }


def turn_phase(sessions, chosen, tokens: int) -> list[float]:
    """Every session appends its next tool call and result and starts a reply: times to first token."""
    following = {s.id: f for s, (_, f) in zip(sessions, chosen)}
    return all_at_once(sessions, turn(following, tokens))[1]


def paired_speedups(engine: Engine, one: list, many: list, tokens: int, pairs: int) -> list[float]:
    """``many`` sessions' aggregate decode tokens/s over ``one`` session's, each from two decode phases run
    back to back, which goes first alternating. This machine's speed drifts by tens of percent within a
    minute, and a round puts a minute of other conditions between the two counts' phases, so their medians
    alone come from different machines; a pair's two phases are seconds apart. Each phase runs on forks of
    the sessions (their memory managers copied), so every pair starts from the same contexts."""
    ratios = []
    for i in range(pairs):
        forks = {"one": [s.fork(with_memory=True) for s in one], "many": [s.fork(with_memory=True) for s in many]}
        order = ("one", "many") if i % 2 == 0 else ("many", "one")
        speed = {name: decode_phase(engine, forks[name], tokens)["tok_s"] for name in order}
        for sessions in forks.values():
            for session in sessions:
                session.close()
        ratios.append(speed["many"] / speed["one"])
    return ratios


def summary(phases: list[dict], firsts: list[float]) -> dict:
    return {
        "decode_tok_s": statistics.median(p["tok_s"] for p in phases),
        "per_session_tok_s": statistics.median(x for p in phases for x in p["per_session"]),
        "sessions_per_pass": sum(p["requests"] for p in phases) / sum(p["passes"] for p in phases),
        "pass_ms": 1e3 * statistics.median(p["busy_s"] / p["passes"] for p in phases),
        "engine_idle": statistics.median(1 - p["busy_s"] / p["wall_s"] for p in phases),
        "ttft_median_s": statistics.median(firsts),
        "ttft_max_s": max(firsts),
    }


class TokenTimes(BaseStreamer):
    """When ``generate`` handed out each step's tokens (its first ``put`` is the prompt)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class PaddedGenerate:
    """transformers ``generate`` over the same contexts, left-padded into one batch; decode tokens/s from the
    first generated token to the last."""

    def __init__(self, model, tokenizer, chosen_ids: list[list[int]], tokens: int):
        width = max(len(ids) for ids in chosen_ids)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.input_ids = torch.tensor([[self.pad] * (width - len(ids)) + ids for ids in chosen_ids])
        self.mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in chosen_ids])
        self.model, self.tokens, self.kv_bytes = model, tokens, 0

    def _run(self, n: int, streamer: TokenTimes):
        with torch.no_grad():
            out = self.model.generate(
                input_ids=self.input_ids,
                attention_mask=self.mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=self.pad,
                return_dict_in_generate=True,
                streamer=streamer,
            )
        return out

    def decode_tok_s(self) -> float:
        stamps = TokenTimes()
        out = run_on_compute(self._run, self.tokens, stamps)  # where a Session's forwards run
        layers = out.past_key_values.layers
        self.kv_bytes = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
        first, last = stamps.times[1], stamps.times[-1]  # the first generated token comes with the prefill
        return len(self.input_ids) * (self.tokens - 1) / (last - first)


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    counts = [r["sessions"] for r in rows]
    for key, label in (
        ("kvmemory_tok_s", "kvmemory (batched)"),
        ("kv32_tok_s", "kvmemory, fp32 cache"),
        ("kv8_tok_s", "kvmemory, 8-bit cache"),
        ("sdpa_tok_s", "kvmemory, attention on sdpa"),
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
    parser.add_argument("--pairs", type=int, default=7, help="back-to-back pairs per count for the paired speedup")
    args = parser.parse_args()
    engine = Engine.from_pretrained(BENCH_MODEL, weights=args.weights)
    same = dict(model=engine.model, tokenizer=engine.tokenizer, name=engine.name)
    engines = {
        "kvmemory": engine,
        "kv32": Engine(**same, kv_dtype="float32"),
        "kv8": Engine(**same, kv_dtype="int8"),
        "sdpa": Engine(**same, attention_path="mask"),
        "unbatched": Engine(**same, max_batch_tokens=1),
    }
    reference = copy.deepcopy(engine.model)
    reference.set_attn_implementation("sdpa")
    # every condition of every session count opens first; then each round runs all their decode phases in
    # turn, so the machine's drift over minutes moves every count and condition alike (ratios are side by side)
    setups = []
    for count in args.sessions:
        chosen = contexts(engine, count, args.context)
        ids = [engine.render_chat(shown, add_generation_prompt=True) for shown, _ in chosen]
        opened = {name: open_sessions(e, chosen, args.cap) for name, e in engines.items()}
        setups.append((count, chosen, ids, opened, PaddedGenerate(reference, engine.tokenizer, ids, args.tokens)))
    phases = {(count, name): [] for count, *_ in setups for name in engines}
    padded = {count: [] for count, *_ in setups}
    for _ in range(args.repeats):
        for count, _, _, opened, generate in setups:
            for name, sessions in opened.items():
                phases[count, name].append(decode_phase(engines[name], sessions, args.tokens))
            padded[count].append(generate.decode_tok_s())
    alone = next((opened["kvmemory"] for count, _, _, opened, _ in setups if count == 1), None)
    paired = {  # after the rounds, count by count: each pair against the same one session
        count: paired_speedups(engine, alone, opened["kvmemory"], args.tokens, args.pairs)
        for count, _, _, opened, _ in setups
        if alone is not None and count > 1
    }
    rows = []
    for count, chosen, ids, opened, generate in setups:
        kv = {
            name: sum(s.cache.allocated_bytes() for s in opened[name]) / 2**20 for name in ("kvmemory", "kv32", "kv8")
        }
        result = {name: summary(phases[count, name], turn_phase(opened[name], chosen, args.tokens)) for name in engines}
        for sessions in opened.values():
            for s in sessions:
                s.close()
        batched, alone = result["kvmemory"], result["unbatched"]
        rows.append(
            {
                "sessions": count,
                "context_tokens": statistics.median(len(i) for i in ids),
                "kvmemory_tok_s": batched["decode_tok_s"],
                "per_session_tok_s": batched["per_session_tok_s"],
                "sessions_per_pass": batched["sessions_per_pass"],
                "pass_ms": batched["pass_ms"],
                "engine_idle": batched["engine_idle"],
                "kv32_tok_s": result["kv32"]["decode_tok_s"],
                "kv8_tok_s": result["kv8"]["decode_tok_s"],
                "sdpa_tok_s": result["sdpa"]["decode_tok_s"],
                "unbatched_tok_s": alone["decode_tok_s"],
                "transformers_tok_s": statistics.median(padded[count]),
                "ttft_median_s": batched["ttft_median_s"],
                "ttft_max_s": batched["ttft_max_s"],
                "unbatched_ttft_median_s": alone["ttft_median_s"],
                "kv_mb": kv["kvmemory"],
                "kv32_kv_mb": kv["kv32"],
                "kv8_kv_mb": kv["kv8"],
                "transformers_kv_mb": generate.kv_bytes / 2**20,
            }
        )
    one = rows[0]["kvmemory_tok_s"] if rows[0]["sessions"] == 1 else None
    for row in rows:
        row["speedup_vs_one"] = row["kvmemory_tok_s"] / one if one else None
        row["paired_speedups"] = paired.get(row["sessions"], [])
    print(table(rows, list(rows[0])))
    name = "concurrency" if args.weights is None else f"concurrency_{args.weights}"  # the default's, or a format's
    plot(rows, RESULTS / f"{name}.png")
    settings = {"context": args.context, "tokens": args.tokens, "cap": args.cap, "repeats": args.repeats}
    settings["pairs"] = args.pairs
    settings["warm_up_tokens"] = WARM_UP_TOKENS
    settings["weights"], settings["kv_dtype"] = engine.weights, str(engine.kv_dtype).removeprefix("torch.")
    settings["default_method"] = default_policy().default.method
    out = save(name, {**settings, "rows": rows})
    print(f"saved {out}")


if __name__ == "__main__":
    main()
