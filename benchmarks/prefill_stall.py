"""Prefill beside decoding: how long one session's prefill holds up a session decoding meanwhile, by chunk size.

A pass runs a prefill chunk and the decode steps queued with it together (``ForwardBatcher``), so a session
decoding beside another session's long prefill gets one token per chunk: the chunk size bounds its wait. On a
CPU prefill is bound by multiply-adds from a few hundred tokens on, so smaller chunks cost little prefill speed,
down to a point; that point sets the engine's CPU default (``Engine.prefill_chunk_size``).

One session decodes greedy tokens (an agent-trace context of about ``--context`` tokens, as in
``benchmarks.concurrency``) while another, holding ``--context`` tokens of the logs text under the default
memory policy (no compaction due), appends the next ``--prefill`` tokens of it, with each chunk size in turn
(``Engine(prefill_chunk_size=...)``, whose pass bound on a CPU is the chunk plus 128 tokens); ``--repeats``
rounds, every chunk size once a round (medians):

* ``prefill_tok_s``: the appended tokens over the append's wall time;
* ``gap_ms``: the decoder's median gap between tokens before the prefill starts (its pace);
* ``median_gap_ms`` / ``longest_gap_ms``: its gaps that overlap the prefill.

Writes ``prefill_stall.json`` and ``.png``.

    python -m benchmarks.prefill_stall [--chunks 128 256 512] [--context 1024] [--prefill 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from benchmarks.concurrency import contexts, open_sessions
from benchmarks.texts import TEXT_KINDS
from kvmemory import Engine, SamplingParams
from kvmemory.memory import MemoryManager, default_policy

SETTLE_SECONDS = 0.5  # decoding before the prefill starts: its pace is measured here


def beside(decoder, prefilling, ids: list[int]) -> dict:
    """Append ``ids`` to ``prefilling`` while ``decoder`` streams; both are put back as they were."""
    states = decoder.snapshot(), prefilling.snapshot()
    stamps, stop = [], threading.Event()

    def stream():
        for _ in decoder.stream(params=SamplingParams(max_new_tokens=100_000, ignore_eos=True)):
            stamps.append(time.perf_counter())
            if stop.is_set():
                break

    thread = threading.Thread(target=stream)
    thread.start()
    time.sleep(SETTLE_SECONDS)
    started = time.perf_counter()
    prefilling.append_tokens(ids)
    ended = time.perf_counter()
    stop.set()
    thread.join()
    decoder.restore(states[0])
    prefilling.restore(states[1])
    gaps = [(b - a, a, b) for a, b in zip(stamps, stamps[1:])]
    during = [g for g, a, b in gaps if b > started and a < ended]
    return {
        "seconds": ended - started,
        "gap": statistics.median(g for g, _, b in gaps if b < started),
        "median": statistics.median(during),
        "longest": max(during),
    }


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    chunks = [r["chunk"] for r in rows]
    left.plot(chunks, [r["median_gap_ms"] for r in rows], marker="o", label="median")
    left.plot(chunks, [r["longest_gap_ms"] for r in rows], marker="o", label="longest")
    left.set_ylabel("decoder's gap between tokens (ms)")
    left.set_title("the decoder, during the prefill")
    right.plot(chunks, [r["prefill_tok_s"] for r in rows], marker="o")
    right.set_ylim(0, 1.15 * max(r["prefill_tok_s"] for r in rows))
    right.set_ylabel("tokens/s")
    right.set_title("the prefill, beside the decoder")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(chunks, [str(c) for c in chunks])
        ax.set_xlabel("prefill chunk (tokens)")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = Engine.from_pretrained(BENCH_MODEL)
    same = dict(model=base.model, tokenizer=base.tokenizer, name=base.name)
    ids = base.tokenizer.encode(TEXT_KINDS["logs"](12 * (args.context + args.prefill)), add_special_tokens=False)
    start, appended = ids[: args.context], ids[args.context : args.context + args.prefill]
    chosen = contexts(base, 1, args.context)
    setups = {}
    for chunk in args.chunks:
        engine = Engine(**same, prefill_chunk_size=chunk)  # and the pass bound that goes with it
        decoder = open_sessions(engine, chosen, cap=4 * args.context)[0]
        policy = default_policy(max_slots=4 * args.context)  # as an agent's session: surprisal recorded, no compaction
        prefilling = engine.session(memory=MemoryManager(policy))
        prefilling.append_tokens(start)
        setups[chunk] = decoder, prefilling
    runs = {}
    for _ in range(args.repeats):  # every chunk size in turn per round: the machine's drift hits all alike
        for chunk, (decoder, prefilling) in setups.items():
            runs.setdefault(chunk, []).append(beside(decoder, prefilling, appended))
    rows = [
        {
            "chunk": chunk,
            "pass_tokens": setups[chunk][0].engine.batcher.max_tokens,
            "prefill_tok_s": len(appended) / statistics.median(r["seconds"] for r in results),
            "gap_ms": 1e3 * statistics.median(r["gap"] for r in results),
            "median_gap_ms": 1e3 * statistics.median(r["median"] for r in results),
            "longest_gap_ms": 1e3 * statistics.median(r["longest"] for r in results),
        }
        for chunk, results in runs.items()
    ]
    print(table(rows, list(rows[0])))
    plot(rows, RESULTS / "prefill_stall.png")
    settings = {"context": args.context, "prefill": len(appended), "repeats": args.repeats}
    settings["default_chunk"] = base.prefill_chunk_size
    out = save("prefill_stall", {**settings, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
