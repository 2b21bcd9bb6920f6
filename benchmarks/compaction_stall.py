"""Compaction beside decoding: how long one session's compaction holds up the sessions decoding meanwhile.

On a CPU every forward pass and compaction runs on one compute thread (``kvmemory.runtime.compute``), so a
method that ran start to end there would stop every other session for its whole length. A compaction
pauses between layers instead (``CacheSpan.each_layer``): once it has run for ``SLICE_SECONDS``, the passes
queued meanwhile run before its next layer.

``--decoders`` sessions (1 and 4) hold agent-trace contexts of about ``--context`` tokens (those of
``benchmarks.concurrency``, default memory policy, no compaction due) and stream greedy tokens; meanwhile
one more such session compacts everything but its first 4 and last 256 tokens at ``--ratio`` tokens per
slot with each method (by name, default parameters, reconstruction error measured as ``compact`` does by
default). Per method, decoder count and condition, ``--repeats`` runs (medians):

* ``gap_ms``: the decoders' median gap between tokens before the compaction starts (their pace);
* ``longest_gap_ms``: the longest gap of any decoder that overlaps the compaction;
* ``compaction_s``: the compaction's wall time beside the decoders; ``alone_s`` with nothing else running.

Conditions: ``pauses`` (the default) and ``no pauses`` (``SLICE_SECONDS`` infinite: the method holds the
compute thread to its end, as before pauses existed). Writes ``compaction_stall.json`` and ``.png``.

    python -m benchmarks.compaction_stall [--decoders 1 4] [--context 2048] [--ratio 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from benchmarks.concurrency import contexts, open_sessions
from kvmemory import Engine, SamplingParams
from kvmemory.runtime import compute

METHODS = ("selective_context", "snapkv", "real", "counter_causal", "attention_matching", "tam")
CONDITIONS = {"pauses": compute.SLICE_SECONDS, "no pauses": float("inf")}
SETTLE_SECONDS = 0.5  # decoding before the compaction starts: its pace is measured here


def compact(session, method: str, ratio: float) -> float:
    """Seconds one compaction of ``session`` takes; the session is put back as it was."""
    state = session.snapshot()
    started = time.perf_counter()
    session.compact(method, ratio=ratio)
    elapsed = time.perf_counter() - started
    session.restore(state)
    return elapsed


def beside(decoders, compacted, method: str, ratio: float) -> dict:
    """Compact ``compacted`` while every decoder streams: the decoders' pace and their longest gap."""
    states = [d.snapshot() for d in decoders]
    stamps = [[] for _ in decoders]
    stop = threading.Event()

    def stream(i):
        for _ in decoders[i].stream(params=SamplingParams(max_new_tokens=100_000, ignore_eos=True)):
            stamps[i].append(time.perf_counter())
            if stop.is_set():
                break

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(decoders))]
    for t in threads:
        t.start()
    time.sleep(SETTLE_SECONDS)
    started = time.perf_counter()
    seconds = compact(compacted, method, ratio)
    ended = started + seconds
    time.sleep(0.2)
    stop.set()
    for t in threads:
        t.join()
    for decoder, state in zip(decoders, states):
        decoder.restore(state)
    gaps = [(b - a, a, b) for times in stamps for a, b in zip(times, times[1:])]
    pace = [g for g, _, b in gaps if b < started]
    during = [g for g, a, b in gaps if b > started and a < ended]
    return {"gap": statistics.median(pace), "longest": max(during), "seconds": seconds}


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["decoders"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 4.2), squeeze=False)
    for ax, count in zip(axes[0], counts):
        width = 0.38
        for k, condition in enumerate(CONDITIONS):
            chosen = [r for r in rows if r["decoders"] == count and r["condition"] == condition]
            xs = [i + (k - 0.5) * width for i in range(len(chosen))]
            ax.bar(xs, [r["longest_gap_ms"] for r in chosen], width, label=condition)
        pace = statistics.median(r["gap_ms"] for r in rows if r["decoders"] == count)
        ax.axhline(pace, color="grey", linestyle="--", label="decoders' median gap")
        ax.set_xticks(range(len(METHODS)), METHODS, rotation=30, ha="right")
        ax.set_ylabel("decoders' longest gap during the compaction (ms)")
        ax.set_title(f"{count} session(s) decoding, one compacting")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--decoders", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--ratio", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = Engine.from_pretrained(BENCH_MODEL)
    sessions = open_sessions(engine, contexts(engine, 1 + max(args.decoders), args.context), cap=2 * args.context)
    compacted = sessions[0]
    alone = {m: statistics.median(compact(compacted, m, args.ratio) for _ in range(args.repeats)) for m in METHODS}
    runs = {}
    for _ in range(args.repeats):  # every condition in turn per round: the machine's drift hits all alike
        for count in args.decoders:
            for method in METHODS:
                for condition, slice_seconds in CONDITIONS.items():
                    compute.SLICE_SECONDS = slice_seconds
                    result = beside(sessions[1 : 1 + count], compacted, method, args.ratio)
                    runs.setdefault((count, method, condition), []).append(result)
    compute.SLICE_SECONDS = CONDITIONS["pauses"]
    rows = []
    for (count, method, condition), results in runs.items():
        rows.append(
            {
                "decoders": count,
                "method": method,
                "condition": condition,
                "gap_ms": 1e3 * statistics.median(r["gap"] for r in results),
                "longest_gap_ms": 1e3 * statistics.median(r["longest"] for r in results),
                "compaction_s": statistics.median(r["seconds"] for r in results),
                "alone_s": alone[method],
            }
        )
    print(table(rows, list(rows[0])))
    plot(rows, RESULTS / "compaction_stall.png")
    settings = {"context": args.context, "ratio": args.ratio, "repeats": args.repeats}
    settings["slice_seconds"] = CONDITIONS["pauses"]
    settings["compacted_tokens"] = len(compacted.tokens)
    out = save("compaction_stall", {**settings, "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
