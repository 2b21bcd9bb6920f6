"""Compaction quality on the default model: continuation NLL after compacting N-token contexts, retrieval
probes on planted facts, and milliseconds per compaction.

For every text kind and method, an N-token context is compacted to exactly N/ratio slots per head (the
first 4 tokens and the last 32 are kept verbatim by every method), then the next 256 tokens are scored
teacher-forced, and the KV bytes the compacted cache holds are reported beside the slots (``default`` is the
default policy's rule, selective context's lines under REAL's head budgets, its gaps closed afterwards as the
memory manager does; ``uniform_lines`` the same ranking with every head keeping the same count, the default
before; ``retrieval_lines`` that ranking in the heads REAL's profile scores highest and SnapKV's in the
others, under REAL's budgets, its gaps closed too); each kind is
measured on several disjoint windows of its text and the tables give means (with one window per kind,
single texts decided which method won). Retrieval: facts planted in long pytest
logs; after compaction the question is appended and the answer's log-probability and greedy exact match
are measured.

    python -m benchmarks.quality [--context 2048] [--segments 2] [--ratios 4 10 20 50]
        [--kinds source logs prose reasoning]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from benchmarks.texts import TEXT_KINDS, log_text, plant_facts
from kvmemory import Engine, get_method
from kvmemory.memory import default_policy

SINKS, RECENT, WINDOW, CONTINUATION = 4, 32, 128, 256
CONTEXT_QUERIES = 256  # context-prefill queries kept per segment (as the memory manager keeps them)
CONTEXT = ["window", "context"]  # selector window + the span's own prefill queries
DEFAULT_POLICY = default_policy()
DEFAULT_RULE = DEFAULT_POLICY.default  # "default": what the default policy compacts unprotected segments with
METHODS = {  # label: (registry name, params, reference-query sources)
    "streaming_llm": ("streaming_llm", {}, "window"),
    "h2o": ("h2o", {}, "window"),
    "tova": ("tova", {}, "window"),
    "snapkv": ("snapkv", {}, "window"),
    "key_norm": ("key_norm", {}, "window"),
    "random": ("random", {}, "window"),
    "counter_causal": ("counter_causal", {"fast": True}, "window"),
    "real": ("real", {}, "window"),
    "am": ("attention_matching", {}, "window"),
    "am_context": ("attention_matching", {}, CONTEXT),
    "am_repeat": ("attention_matching", {}, ["window", "repeat"]),
    "am_counter_causal": ("attention_matching", {"selector": "counter_causal"}, "window"),
    "am_real": ("real", {"inner": "attention_matching"}, "window"),
    "am_real_context": ("real", {"inner": "attention_matching"}, CONTEXT),
    "tam": ("tam", {"length_exponent": 1.0}, "window"),
    "tam_sqrt_wn": ("tam", {"length_exponent": 0.5}, "window"),
    "selective_context": ("selective_context", {}, "window"),
    "default": (DEFAULT_RULE.method, DEFAULT_RULE.params, "window"),
    "uniform_lines": ("selective_context", {"evict_predictable_below": 1.0}, "window"),
    "retrieval_lines": ("real", {"inner": "retrieval_lines"}, "window"),
}
# as the memory manager does under the default policy
CLOSES_GAPS = {"default", "uniform_lines", "retrieval_lines"} if DEFAULT_POLICY.budget.close_gaps else set()
EVICTION = (
    "streaming_llm",
    "h2o",
    "tova",
    "snapkv",
    "key_norm",
    "random",
    "counter_causal",
    "real",
    "selective_context",
    "default",
    "uniform_lines",
    "retrieval_lines",
)
PROBES = [
    (
        "NOTICE deploy: the rollback token for cluster east is 8841.",
        "What is the rollback token for cluster east?",
        " 8841",
    ),
    (
        "NOTICE config: the staging database password is tulip-42.",
        "What is the staging database password?",
        " tulip-42",
    ),
    ("NOTICE owner: the flaky test is owned by Ravi Okafor.", "Who owns the flaky test?", " Ravi Okafor"),
    ("NOTICE limits: the upload size limit is 37 megabytes.", "What is the upload size limit in megabytes?", " 37"),
]


def prepared_session(engine, ids: list[int]):
    session = engine.session()
    session.record_queries(WINDOW, context=CONTEXT_QUERIES)
    session.record_last_layer_inputs()
    session.record_surprisal()
    session.append_tokens(ids)
    return session


def compact_context(base, n_context: int, label: str, ratio: float):
    """Fork ``base`` and compact its context (sinks and recent kept) to n_context/ratio slots per head."""
    name, params, source = METHODS[label]
    session = base.fork()
    slots = max(1, round(n_context / ratio) - SINKS - RECENT)
    record = session.compact(
        get_method(name, **params),
        slots=slots,
        keep_first=SINKS,
        keep_last=RECENT,
        query_source=source,
        measure_error=False,
    )
    if label in CLOSES_GAPS:
        session.rebase_positions()
    return session, record


def quality(engine, kinds, n_context, ratios, labels, segments):
    """Per text kind, ``segments`` disjoint consecutive (context, continuation) windows of one text."""
    rows = []
    span = n_context + CONTINUATION
    for kind in kinds:
        ids = engine.tokenizer.encode(TEXT_KINDS[kind](n_context * 12 * segments), add_special_tokens=False)
        if len(ids) < segments * span:
            raise ValueError(f"{kind}: {len(ids)} tokens, {segments} segments need {segments * span}")
        for segment in range(segments):
            window = ids[segment * span : (segment + 1) * span]
            context, continuation = window[:n_context], window[n_context:]
            base = prepared_session(engine, context)
            full_nll = float(-base.logprobs(continuation).mean())
            rows.append(
                {
                    "kind": kind,
                    "segment": segment,
                    "method": "full",
                    "ratio": 1.0,
                    "nll": full_nll,
                    "delta": 0.0,
                    "kv_mb": base.stats().kv_bytes / 1e6,
                    "ms": 0.0,
                }
            )
            print(f"{kind} segment {segment}: full-cache NLL {full_nll:.4f}", flush=True)
            for ratio in ratios:
                for label in labels:
                    session, record = compact_context(base, n_context, label, ratio)
                    nll = float(-session.logprobs(continuation).mean())
                    rows.append(
                        {
                            "kind": kind,
                            "segment": segment,
                            "method": label,
                            "ratio": ratio,
                            "nll": nll,
                            "delta": nll - full_nll,
                            "kv_mb": session.stats().kv_bytes / 1e6,
                            "ms": record.milliseconds,
                        }
                    )
                    print(
                        f"  {ratio:>4}x {label:<18} NLL {nll:.4f} (+{nll - full_nll:.4f})  "
                        f"{rows[-1]['kv_mb']:6.2f} MB  {record.milliseconds:7.0f} ms",
                        flush=True,
                    )
                    session.close()
            base.close()
    return rows


FORMAT_METHODS = ("snapkv", "am_real", "tam")  # what another weight or cache format must rank alike


def scored_nll(engine) -> dict:
    """NLL per text kind (one 2,048-token window) of the full cache and of each of ``FORMAT_METHODS`` at 10×:
    what a weight or cache format is compared by."""
    scored = quality(engine, list(TEXT_KINDS), 2048, [10], list(FORMAT_METHODS), 1)
    return {f"{r['kind']}/{r['method']}": r["nll"] for r in scored}


def beside_the_first(rows: list[dict]) -> None:
    """Each row's largest full-cache NLL change from the first row's (``scored_nll`` in ``row["nll"]``), and
    whether ``FORMAT_METHODS`` rank alike on every kind."""
    reference = rows[0]["nll"]
    full = [k for k in reference if k.endswith("/full")]
    for row in rows:
        row["max_full_nll_change"] = max(abs(row["nll"][k] - reference[k]) for k in full)
        row["same_method_order"] = all(
            method_order(row["nll"], kind) == method_order(reference, kind) for kind in TEXT_KINDS
        )


def method_order(nll: dict, kind: str) -> list[str]:
    return sorted(FORMAT_METHODS, key=lambda m: nll[f"{kind}/{m}"])


def mean_over_segments(rows):
    """One row per (kind, method, ratio): the mean NLL, NLL increase and milliseconds over the segments."""
    groups = {}
    for r in rows:
        groups.setdefault((r["kind"], r["method"], r["ratio"]), []).append(r)
    return [
        {
            "kind": kind,
            "method": method,
            "ratio": ratio,
            "segments": len(g),
            **{key: sum(r[key] for r in g) / len(g) for key in ("nll", "delta", "kv_mb", "ms")},
        }
        for (kind, method, ratio), g in groups.items()
    ]


def retrieval(engine, n_context, ratios, labels):
    tok = engine.tokenizer
    text = plant_facts(log_text(n_context * 6), [p[0] for p in PROBES], seed=1)
    ids = tok.encode(text, add_special_tokens=False)[:n_context]
    base = prepared_session(engine, ids)
    rows = []
    for ratio in [1.0] + list(ratios):
        for label in ["full"] if ratio == 1.0 else labels:
            session = base.fork() if ratio == 1.0 else compact_context(base, n_context, label, ratio)[0]
            logp, hits = [], 0
            for _, question, answer in PROBES:
                probe = session.fork()
                probe.append_text(f"\nQuestion: {question}\nAnswer:")
                logp.append(float(probe.logprobs(tok.encode(answer, add_special_tokens=False)).sum()))
                hits += answer.strip() in probe.generate(max_new_tokens=8).text
                probe.close()
            rows.append(
                {
                    "method": label,
                    "ratio": ratio,
                    "answer_logprob": sum(logp) / len(logp),
                    "exact_match": hits / len(PROBES),
                }
            )
            print(
                f"  retrieval {ratio:>4}x {label:<18} logp {rows[-1]['answer_logprob']:.3f}  EM "
                f"{rows[-1]['exact_match']:.2f}",
                flush=True,
            )
            session.close()
    return rows


def median_of_3_ms(measure) -> float:
    """Median of three runs of ``measure()``, which returns milliseconds."""
    return sorted(measure() for _ in range(3))[1]


def latency(engine, sizes, labels, ratio=10):
    ids = engine.tokenizer.encode(TEXT_KINDS["source"](max(sizes) * 8), add_special_tokens=False)
    rows = []
    for n in sizes:
        base = prepared_session(engine, ids[:n])
        for label in labels:

            def compaction_ms():
                session, record = compact_context(base, n, label, ratio)
                session.close()
                return record.milliseconds

            rows.append({"slots": n, "method": label, "ms": median_of_3_ms(compaction_ms)})
            print(f"  latency {n} slots {label:<18} {rows[-1]['ms']:.0f} ms", flush=True)
        base.close()
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["kind"] for r in rows})
    colors = plt.get_cmap("tab20").colors
    fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4.8), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        full = next(r["nll"] for r in rows if r["kind"] == kind and r["method"] == "full")
        for i, label in enumerate(METHODS):
            pts = sorted((r["ratio"], r["nll"]) for r in rows if r["kind"] == kind and r["method"] == label)
            if pts:
                style = "-o" if label not in EVICTION else "--x"
                ax.plot(
                    [p[0] for p in pts], [p[1] for p in pts], style, label=label, markersize=4, color=colors[i % 20]
                )
        ax.axhline(full, color="black", linewidth=1, label="full cache")
        ax.set_xscale("log")
        ax.set_xticks(sorted({r["ratio"] for r in rows if r["method"] != "full"}), minor=False)
        ax.set_xticklabels([f"{x:g}×" for x in sorted({r["ratio"] for r in rows if r["method"] != "full"})])
        ax.minorticks_off()
        ax.set_xlabel("compression (context tokens / slots)")
        ax.set_ylabel("continuation NLL")
        ax.set_title(kind)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=8, fontsize=8)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)


def update_last_run(last: dict, out: dict, methods: list[str], skipped: list[str]) -> dict:
    """A partial run (some sections, or some methods) replaces only what it measured in the last full run:
    its sections, or within them the rows of its methods (and the full-cache reference it re-measured)."""
    remeasured = set(methods) | {"full"}
    merged = {**last, **out}
    for key in ("quality_segments", "retrieval"):
        if key in out and key in last and set(methods) != set(METHODS):
            merged[key] = [r for r in last[key] if r["method"] not in remeasured] + out[key]
    if "quality_segments" in out:
        merged["quality"] = mean_over_segments(merged["quality_segments"])
        plot(merged["quality"], RESULTS / "quality.png")
    merged["methods"] = {**last.get("methods", {}), **out["methods"]}  # the rows of a method new to the last run show
    merged["seconds"] = last.get("seconds", 0.0)
    rerun = {"methods": methods, "skip": skipped, "seconds": out["seconds"]}
    merged["partial_reruns"] = last.get("partial_reruns", []) + [rerun]
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--ratios", type=float, nargs="+", default=[4, 10, 20, 50])
    parser.add_argument(
        "--segments", type=int, default=2, help="disjoint context windows per text kind (results are means)"
    )
    parser.add_argument("--kinds", nargs="+", default=list(TEXT_KINDS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--latency-sizes", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--skip", nargs="*", default=[], choices=["quality", "retrieval", "latency"])
    parser.add_argument("--replot", action="store_true", help="only redraw quality.png from quality.json")
    args = parser.parse_args()
    if args.replot:  # redraw the PNG from the saved JSON, measuring nothing
        plot(json.loads((RESULTS / "quality.json").read_text())["quality"], RESULTS / "quality.png")
        return
    engine = Engine.from_pretrained(BENCH_MODEL, kv_dtype="float32")  # methods compared at full precision
    torch.manual_seed(0)
    out = {
        "context": args.context,
        "segments": args.segments,
        "continuation": CONTINUATION,
        "sinks": SINKS,
        "recent": RECENT,
        "window": WINDOW,
        "context_queries": CONTEXT_QUERIES,
        "methods": {k: [v[0], v[1], v[2]] for k, v in METHODS.items()},
    }
    started = time.perf_counter()
    if "quality" not in args.skip:
        out["quality_segments"] = quality(engine, args.kinds, args.context, args.ratios, args.methods, args.segments)
        out["quality"] = mean_over_segments(out["quality_segments"])
        plot(out["quality"], RESULTS / "quality.png")
        print(table(out["quality_segments"], ["kind", "segment", "method", "ratio", "nll", "delta", "kv_mb", "ms"]))
    if "retrieval" not in args.skip:
        out["retrieval"] = retrieval(engine, args.context, [10, 20], args.methods)
        print(table(out["retrieval"], ["method", "ratio", "answer_logprob", "exact_match"]))
    if "latency" not in args.skip:
        out["latency"] = latency(
            engine, args.latency_sizes, ["counter_causal", "am", "am_real_context", "tam", "snapkv", "h2o"]
        )
        print(table(out["latency"], ["slots", "method", "ms"]))
    out["seconds"] = time.perf_counter() - started
    previous = RESULTS / "quality.json"
    if (args.skip or set(args.methods) != set(METHODS)) and previous.is_file():
        out = update_last_run(json.loads(previous.read_text()), out, args.methods, args.skip)
    print(f"saved {save('quality', out)}")


if __name__ == "__main__":
    main()
