"""Sections of ``benchmarks/README.md`` on speed: decode and prefill, cache formats, kernels, concurrent sessions,
capacity and stalls."""

from __future__ import annotations

import statistics

from benchmarks.capacity import results_name
from benchmarks.common import BENCH_MODEL
from benchmarks.report.tables import NLL_COLUMN, beside_fp32, formats_of, md, on_cpu


def speed_section(d: dict) -> str:
    runners = [k.removesuffix(" decode tok/s") for k in d["contexts"][0] if k.endswith(" decode tok/s")]
    header = ["context"] + [f"{r} {what} tok/s" for r in runners for what in ("prefill", "decode")]
    rows = [
        [r["context"]] + [f"{r[f'{n} {what} tok/s']:.1f}" for n in runners for what in ("prefill", "decode")]
        for r in d["contexts"]
    ]
    if "llama.cpp" in runners:
        header += ["decode vs llama.cpp", "prefill vs llama.cpp"]
        for row, r in zip(rows, d["contexts"]):
            row += [f"{r['decode vs llama.cpp']:.2f}×", f"{r['prefill vs llama.cpp']:.2f}×"]
    c = d["compacted"]
    text = (
        f"**Speed** (`python -m benchmarks.speed`, {d['weights_default']} weights{on_cpu(d)}, medians of "
        f"{d['repeats']} runs, the runners taking turns after a warm-up each, {d['decode_tokens']} greedy tokens; "
        "llama.cpp through llama-cpp-python on the same GGUF file and thread count):\n\n"
        + md(rows, header)
        + f"\n\nAfter compacting {c['context']} tokens to {c['slots']} slots per head: decode "
        f"{c['compacted_decode_tok_s']:.1f} tok/s vs {c['uncompacted_decode_tok_s']:.1f} uncompacted "
        f"({c['speedup']:.2f}×), KV {c['compacted_kv_bytes'] / 2**20:.1f} MiB vs "
        f"{c['uncompacted_kv_bytes'] / 2**20:.1f} MiB; with uneven heads (0.5× to 1.5× the mean, the same "
        f"{c['uneven_kv_bytes'] / 2**20:.1f} MiB) {c['uneven_decode_tok_s']:.1f} tok/s ({c['uneven_vs_even']:.2f}× "
        "the even heads)"
        + (
            f"; llama.cpp, taking turns with these sessions, decodes the uncompacted {c['context']} tokens at "
            f"{c['llama_cpp_decode_tok_s']:.1f} tok/s ({c['compacted_vs_llama_cpp']:.2f}× for the compacted session; "
            f"medians of {c.get('repeats', d['repeats'])} runs)."
            if "llama_cpp_decode_tok_s" in c
            else "."
        )
    )
    if "callers" in d:
        callers = {k.removesuffix(" decode tok/s"): v for k, v in d["callers"].items() if k.endswith("tok/s")}
        text += (
            "\n\nDecode at 512 tokens by caller (every CPU forward runs on the compute thread, whoever calls): "
            + ", ".join(f"{name} {tok_s:.1f} tok/s" for name, tok_s in callers.items())
            + "."
        )
    if "recording" in d:
        r = d["recording"]
        text += (
            f"\n\nRecording each token's surprisal (what the default policy's selective context ranks by) at "
            f"{r['context']} tokens (medians of {r.get('repeats', d['repeats'])}): "
            f"prefill {r['surprisal recorded prefill tok/s']:.0f} tok/s vs "
            f"{r['plain prefill tok/s']:.0f} without ({r['prefill cost']:+.0%} time), decode "
            f"{r['surprisal recorded decode tok/s']:.1f} vs {r['plain decode tok/s']:.1f} tok/s."
        )
    if "kv_dtype" in d:  # runs before ``benchmarks.kv_dtype`` measured the cache formats
        k = d["kv_dtype"]
        text += (
            f"\n\nThe cache stored in 16 bits (`kv_dtype`) at {k['context']} tokens (medians of {k['repeats']}): "
            + ", ".join(
                f"{r['kv_dtype']} {r['kv_bytes_per_token'] / 1024:.1f} KiB per token, prefill "
                f"{r['prefill_tok_s']:.0f} tok/s, decode {r['decode_tok_s']:.1f} tok/s"
                for r in k["rows"]
            )
            + "."
        )
    if "weights" in d:
        weights = [
            [
                w["weights"],
                f"{w['decode_tok_s']:.1f}",
                f"{w['prefill_tok_s']:.0f}",
                f"{w['weight_mb']:.0f}",
                *beside_fp32(w),
            ]
            for w in d["weights"]
        ]
        text += (
            "\n\nWeight formats (`Engine.from_pretrained(weights=...)`; decode and prefill at 512 tokens; the NLL "
            "change is the largest over `benchmarks.quality`'s full-cache rows, one 2,048-token window per text "
            "kind; order: SnapKV, AM under REAL and TAM at 10× rank the same as with fp32 on every kind):\n\n"
            + md(weights, ["weights", "decode tok/s", "prefill tok/s", "weight MB", NLL_COLUMN, "order"])
        )
    if "kernels" in d:
        eight = "ms_8_rows" in d["kernels"][0]  # runs before it timed one row only
        kernels = [
            [k["kernel"], f"{k['ms_per_token']:.1f}"] + ([f"{k['ms_8_rows']:.1f}"] if eight else [])
            for k in d["kernels"]
        ]
        text += (
            "\n\nOne token through every linear weight of the default model's shapes (output head included), per "
            "CPU kernel"
            + (", and one pass of 8 rows (8 sessions decoding at once)" if eight else "")
            + " (torch's int8 and int4 weight-only kernels are vectorised for bf16 activations only):\n\n"
            + md(kernels, ["kernel", "ms per token"] + (["ms for 8 rows"] if eight else []))
        )
    text += "\n\n![speed](benchmarks/results/speed.png)"
    if "rows" in d:
        text += "\n\n" + engines_text(d)
    return text


def best_llama_cpp(rows: list[dict], model: str, phase: str, context: int) -> dict | None:
    """llama.cpp's fastest setting's row for a model, phase and context (its settings ran side by side)."""
    theirs = [
        r
        for r in rows
        if r["engine"] == "llama.cpp" and (r["model"], r["phase"], r["context_tokens"]) == (model, phase, context)
    ]
    return max(theirs, key=lambda r: r["tokens_per_s"], default=None)


def engine_pairs(rows: list[dict]):
    """(model, phase, context, kvmemory's row, llama.cpp's best row or None) for every kvmemory row."""
    for r in rows:
        if r["engine"] == "kvmemory":
            yield (
                r["model"],
                r["phase"],
                r["context_tokens"],
                r,
                best_llama_cpp(rows, r["model"], r["phase"], r["context_tokens"]),
            )


def decode_bound(bound: dict | None, engine: str, context: int) -> float | None:
    """The decode tok/s ``engine`` could reach at ``context`` if reading its weights and KV were all it did."""
    if bound is None:
        return None
    key = "kvmemory" if engine == "kvmemory" else "llama_cpp"
    per_token = bound[f"{key}_weight_bytes"] + context * bound[f"{key}_kv_bytes_per_token"]
    return bound["read_bytes_per_s"] / per_token


def prefill_bound(bound: dict | None, context: int) -> float | None:
    """The prefill tok/s no engine passes at ``context`` if multiply-adds at the machine's measured int8 rate
    were all it did: the linear layers' per token, and attention's over the context seen so far (half of it on
    average)."""
    if bound is None or "int8_multiply_adds_per_s" not in bound:
        return None
    per_token = bound["multiply_adds_per_token"] + context / 2 * bound["attention_multiply_adds_per_context_token"]
    return bound["int8_multiply_adds_per_s"] / per_token


def engines_text(d: dict) -> str:
    bounds = {b["model"]: b for b in d.get("bound", [])}
    table = []
    for model, phase, context, ours, theirs in engine_pairs(d["rows"]):
        compacted = "compacted" in ours["settings"]
        bound, ceilings = bounds.get(model), None  # the rate each engine could not pass: kvmemory's, llama.cpp's
        if phase == "decode" and not compacted and bound is not None:
            ceilings = decode_bound(bound, "kvmemory", context), decode_bound(bound, "llama.cpp", context)
        elif phase == "prefill" and (ceiling := prefill_bound(bound, context)) is not None:
            ceilings = ceiling, ceiling
        shares = ""
        if ceilings is not None:
            measured = [r["tokens_per_s"] / c for r, c in zip((ours, theirs), ceilings) if r is not None]
            shares = " / ".join(f"{share:.0%}" for share in measured)
        table.append(
            [
                model,
                phase + (" (compacted)" if compacted else ""),
                f"{context:,}",
                f"{ours['tokens_per_s']:.1f}",
                "" if theirs is None else f"{theirs['tokens_per_s']:.1f}",
                "" if theirs is None else f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}×",
                shares,
                ours["settings"],
                "" if theirs is None else theirs["settings"],
            ]
        )
    threads = {r["threads"] for r in d["rows"]}
    cpus = {r["cpu"] for r in d["rows"]}
    bound_text = "".join(
        f" {b['model']}: a decoded token reads {b['kvmemory_weight_bytes'] / 2**30:.2f} GiB of weights in "
        f"kvmemory, {b['llama_cpp_weight_bytes'] / 2**30:.2f} GiB in llama.cpp, and "
        f"{b['kvmemory_kv_bytes_per_token'] / 1024:.1f} / {b['llama_cpp_kv_bytes_per_token'] / 1024:.1f} KiB of "
        f"KV per context token; the machine reads {b['read_bytes_per_s'] / 1e9:.1f} GB/s"
        + (
            f"; a token costs {b['multiply_adds_per_token'] / 1e9:.2f} G multiply-adds in the linear layers and "
            f"{b['attention_multiply_adds_per_context_token'] / 1e3:.0f} k per context token in attention, and "
            f"the machine's matrix products reach {b['int8_multiply_adds_per_s'] / 1e9:.0f} G int8 and "
            f"{b['fp32_multiply_adds_per_s'] / 1e9:.0f} G fp32 multiply-adds/s"
            if "int8_multiply_adds_per_s" in b
            else ""
        )
        + " (`--only bound`)."
        for b in bounds.values()
    )
    return (
        "**kvmemory against llama.cpp on the coder models** (`python -m benchmarks.speed --only engines --model "
        f"MODEL --llama-bench PATH`; {', '.join(map(str, sorted(threads)))} threads of an {', '.join(sorted(cpus))}): "
        "the same GGUF file; prefill of the context from empty and decode of 32 greedy tokens after it; kvmemory "
        "through a Session (medians), llama.cpp through its own `llama-bench` (built from the tree vendored in the "
        "llama-cpp-python sdist), each of its settings run and the fastest shown per row. A compacted row decodes "
        "after the context was compacted to 1/8 of its slots, against llama.cpp at the full context. *Of bound*: "
        "each engine's decode as a share of the rate at which the machine could read what a token needs (its "
        "weights and KV); its prefill as a share of the rate at which int8 matrix products could do a token's "
        "multiply-adds (both engines multiply 4-bit weights by 8-bit activations)."
        + bound_text
        + "\n\n"
        + md(
            table,
            [
                "model",
                "phase",
                "context",
                "kvmemory tok/s",
                "llama.cpp tok/s",
                "ratio",
                "of bound (kvmemory / llama.cpp)",
                "kvmemory",
                "llama.cpp best",
            ],
        )
        + "\n\n![engines](benchmarks/results/speed_engines.png)"
        + "".join("\n\n" + pauses_text(p) for p in d.get("pauses", []))
    )


def pauses_text(p: dict) -> str:
    """One model's compaction pauses per condition beside its prefill of 2,048 tokens."""
    rows = [
        [
            r["condition"],
            r["compactions"],
            f"{r['pause_median_s']:.2f}",
            f"{r['pause_worst_s']:.2f}",
            f"{r['pause_s_per_2048_slots']:.2f}",
            f"{r['pause_s_per_2048_slots'] / p['prefill_s_per_2048_tokens']:.0%}",
        ]
        for r in p["rows"]
    ]
    return (
        f"**Compaction pauses on {p['model']}** (`python -m benchmarks.speed --only pauses --model MODEL`; "
        f"{p['cpu']}): the `{p['trace']}` agent trace ({p['trace_tokens']:,} tokens) sent step by step under a "
        f"cap of {p['cap_tokens']:,} slots (1/8), with the default policy and with each seed method composed "
        "as `benchmarks.seed_methods` composes it. A pause holds the session while its cache is compacted; "
        f"prefilling 2,048 tokens takes {p['prefill_s_per_2048_tokens']:.1f} s on the same engine.\n\n"
        + md(
            rows,
            ["condition", "compactions", "pause median s", "worst s", "s per 2,048 slots", "of a 2,048 prefill"],
        )
    )


def kv_dtype_section(d: dict) -> str:
    rows = [
        [
            r["kv_dtype"],
            f"{r['kv_bytes_per_token'] / 1024:.1f}",
            f"{r['prefill_tok_s']:.0f}",
            f"{r['decode_tok_s']:.1f}",
            *beside_fp32(r),
        ]
        for r in d["rows"]
    ]
    return (
        f"**KV cache formats** (`python -m benchmarks.kv_dtype`, {d['weights']} weights{on_cpu(d)}): the cache "
        "stored in fp32, fp16, bf16 and 8-bit rows (`Engine(kv_dtype=...)`); bytes per token over every layer and "
        f"KV head (β and positions included); prefill of {d['context']} tokens and {d['decode_tokens']} greedy "
        f"tokens after it, the formats taking turns (medians of {d['repeats']}); the NLL change is the largest "
        "over `benchmarks.quality`'s full-cache rows against the fp32 cache (one 2,048-token window per text "
        "kind); order: SnapKV, AM under REAL and TAM at 10× rank as on the fp32 cache on every kind.\n\n"
        + md(rows, ["kv_dtype", "KiB per token", "prefill tok/s", "decode tok/s", NLL_COLUMN, "order"])
        + "\n\n![kv_dtype](benchmarks/results/kv_dtype.png)"
    )


def capacity_command(model: str) -> str:
    return "python -m benchmarks.capacity" + ("" if model == BENCH_MODEL else f" --model {model}")


def capacity_section(d: dict) -> str:
    model = d.get("model", BENCH_MODEL)  # runs before the file named its model ran on the benchmark model
    parallel = [r for r in d["rows"] if r["part"] == "parallel"]
    label = lambda r: (r["engine"], r.get("settings"), r.get("cap_slots") or 0)  # noqa: E731
    labels = sorted(dict.fromkeys(map(label, parallel)), key=lambda x: (x[0] != "llama.cpp", x[2], x[1] or ""))
    counts = sorted({r["sessions"] for r in parallel})
    speed = {(*label(r), r["sessions"]): r for r in parallel}
    cell = lambda r: f"{r['aggregate_decode_tps']:.1f} ({r['ratio_to_one']:.2f}×)"  # noqa: E731
    rows = [
        [engine + (f" ({settings})" if settings else "") + (f", each under {cap} slots" if cap else ", uncompacted")]
        + [cell(speed[(engine, settings, cap, n)]) for n in counts]
        for engine, settings, cap in labels
    ]
    check, settings = d["prompt_check"], d["settings"]
    budget = [r for r in d["rows"] if r["part"] == "budget"]
    parallel_text = (
        f"**Capacity against llama.cpp, {model}** (`{capacity_command(model)}`{on_cpu(d)}). llama.cpp's "
        "`llama-batched-bench`, built from the llama.cpp that the llama-cpp-python source distribution vendors, "
        f"runs on the same GGUF file and {settings['threads']} threads. Aggregate decode tokens/s of sessions "
        f"with {settings['context']}-token contexts each, {settings['tokens']} tokens each (in brackets, the ratio "
        "to one session):\n\n"
        + md(rows, ["engine"] + [f"{n} sessions" for n in counts])
        + "\n\nllama.cpp computes each prompt once and copies it into every sequence's own cache stream (`-pps "
        f"-no-kvu`). At 4 sequences ({check.get('settings', 'flash attention auto, f16 KV')}) that decodes at "
        f"{check['shared_prompt_copied']['decode']:.1f} tokens/s, and at {check['separate_prompts']['decode']:.1f} "
        f"with separate prompts. Its prefill runs at {check['separate_prompts']['prefill']:.0f} tokens/s."
    )
    if not budget:
        return parallel_text
    theirs = {r["kv_budget_bytes"]: r for r in budget if r["engine"] == "llama.cpp"}
    session_tokens = next(r.get("session_tokens", r["context_tokens"]) for r in budget if r["engine"] == "kvmemory")
    facts = any(r.get("facts_asked") for r in budget)
    gains = any(r.get("fact_gain_kept") is not None for r in budget)

    def held(r: dict) -> str:
        kv = f", {r['kv_type']}" if "kv_type" in r else ""  # runs before rows named it: fp16 in llama.cpp
        if r["engine"] == "kvmemory":
            return f"all {r['context_tokens']:,}, in {r['cap_slots']:,} slots a head ({r['cap']}{kv})"
        whole = r["context_tokens"] >= session_tokens
        return f"{'all' if whole else 'its last'} {min(r['context_tokens'], session_tokens):,} ({kv or 'f16'})"

    budget_rows = [
        [
            f"{r['kv_budget_bytes'] / 2**30:g} GiB",
            r["engine"],
            held(r),
            f"{r['session_bytes'] / 2**20:.1f}",
            f"{r['sessions_held']}"
            + (
                f" ({r['sessions_held'] / theirs[r['kv_budget_bytes']]['sessions_held']:.1f}×)"
                if r["engine"] == "kvmemory" and theirs[r["kv_budget_bytes"]]["sessions_held"]
                else ""
            ),
            f"{r['aggregate_decode_tps']:.1f}",
            f"{r['prefill_tps']:.0f}",
            f"{r['ttft_median_s']:.1f} / {r['ttft_max_s']:.1f}" if "ttft_median_s" in r else "",
        ]
        + ([f"{r['facts_answered']} / {r['facts_asked']}"] if facts else [])
        + (
            [f"{r['fact_gain_kept']:.2f} {r['fact_gain_ci']}" if r.get("fact_gain_kept") is not None else "not run"]
            if gains
            else []
        )
        for r in sorted(budget, key=lambda r: (r["kv_budget_bytes"], r["engine"] != "llama.cpp"))
    ]
    columns = [
        "KV budget",
        "engine",
        "tokens the cache holds",
        "MiB a session",
        "sessions (× llama.cpp)",
        "decode tok/s",
        "prefill tok/s",
        "first token s (median / max)",
    ]
    columns += ["facts answered"] if facts else []
    columns += ["fact gain kept [95% CI]"] if gains else []
    llama = next(iter(theirs.values()))
    window = (
        f"the whole session and the reply fit its {llama['context_tokens']:,} cells"
        if llama["context_tokens"] >= session_tokens
        else f"its {llama['context_tokens']:,}-position context, the most of such a session it can hold"
    )
    remembered = []
    if facts:
        remembered.append(
            "*Facts answered*: each of the session's facts asked at its end, answered by greedy generation (exact "
            "match) from the capped session (kvmemory) and from what llama.cpp's context holds (on the same "
            "weights, in kvmemory's engine)."
        )
    if gains:
        remembered.append(
            "The fact gain kept is the long-session benchmark's, over the session's 69 facts: kvmemory at that "
            "cap, llama.cpp as the newest messages that fit its context (`context-window`, on the same weights)."
        )
    flags = llama.get("settings", "flash attention auto, f16 KV")
    return (
        parallel_text + "\n\n"
        "Then each session is the long-session benchmark's: six agent tasks in turn, "
        f"{session_tokens:,} tokens of file reads, test runs and logs, held under a KV budget:\n\n"
        "- kvmemory: the default policy, capped at 1/N of the session's tokens. A session's bytes are its KV "
        "storage as allocated plus the queries it records for compaction. Prefill is measured while every "
        "session appends a tool output at once, with the time to its first token.\n"
        f"- llama.cpp: {window} (`{flags}`). A session's bytes are those cells; prefill is at its full context.\n\n"
        + " ".join(remembered)
        + "\n\n"
        + md(budget_rows, columns)
        + f"\n\n![capacity](benchmarks/results/{results_name(model)}.png)"
    )


def fp16_linear_section(d: dict) -> str:
    narrow = "kvmemory_256_ms" in d["rows"][0]  # the run also timed the kernel held to 8-float vectors
    rows = [
        [
            r["rows"],
            f"{r['kvmemory_ms']:.1f}",
            *([f"{r['kvmemory_256_ms']:.1f}"] if narrow else []),
            f"{r['fbgemm_ms']:.1f}",
            f"{r['speedup']:.2f}×",
            f"{r['kvmemory_vs_one_row']:.2f}×",
            *([f"{r['kvmemory_256_vs_one_row']:.2f}×"] if narrow else []),
            f"{r['fbgemm_vs_one_row']:.2f}×",
        ]
        for r in d["rows"]
    ]
    columns = [
        "rows",
        "kvmemory ms",
        *(["kvmemory 8-float ms"] if narrow else []),
        "fbgemm ms",
        "fbgemm / kvmemory",
        "kvmemory vs 1 row",
        *(["8-float vs 1 row"] if narrow else []),
        "fbgemm vs 1 row",
    ]
    widths = (
        " On this CPU the kernel runs on 16-float (AVX-512) vectors; *8-float* holds it to its AVX2 path, which "
        "gives the same bits."
        if narrow
        else ""
    )
    return (
        f"**fp16 weights on CPU** (`python -m benchmarks.fp16_linear`{on_cpu(d)}): one pass of R rows (R sessions "
        "decoding at once; 48 and more: a prefill chunk) through every linear weight of the default model's shapes, "
        "each layer's weights distinct so they stream from memory as in the model: kvmemory's kernel "
        "(`kvmemory/kernels/linear_fp16.cpp`, weights in panels, q/k/v and gate/up fused) against fbgemm's fp16 "
        f"GEMM (one call per projection); fp32 activations, the kernels taking turns, medians of {d['repeats']} "
        "rounds." + widths + "\n\n" + md(rows, columns)
    )


def decode_kernel_section(d: dict) -> str:
    rows = [
        [
            r["sessions"],
            r["kv_dtype"],
            f"{r['streamed_ms']:.2f}",
            f"{r['resident_ms']:.2f}",
            f"{r['reading_share']:.0%}",
            f"{r['gb_per_s']:.1f}",
            f"{r['vs_float16']:.2f}×",
        ]
        for r in d["rows"]
    ]
    columns = ["sessions", "cache", "ms per pass", "caches resident ms", "reading share", "GB/s read", "vs fp16"]
    return (
        f"**Decode kernel** (`python -m benchmarks.decode_kernel`{on_cpu(d)}): the CPU decode-attention kernel "
        "alone (`kvmemory/kernels/decode_attention.cpp`), one decode pass of S sessions through every layer of the "
        f"default model's shapes, {d['slots']:,} slots per KV head with β, each cache format as the engine stores "
        "it; *ms per pass* with every layer's caches distinct (read from memory, as in the model), *caches "
        "resident* with every layer reading the first layer's (they stay in the CPU's caches), *reading share* "
        "the part of the time reading from memory adds; the formats taking turns, medians of "
        f"{d['repeats']} rounds.\n\n" + md(rows, columns)
    )


def paired_speedup(row: dict, measured: bool) -> str:
    """The median of a count's back-to-back ratios against one session, and their range; one session is the
    reference ("–" for runs saved before pairs were measured)."""
    ratios = row.get("paired_speedups")
    if ratios:
        return f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}-{max(ratios):.2f})"
    return "1.0×" if measured and row["sessions"] == 1 else "–"


def concurrency_section(d: dict, options: str = "") -> str:
    rows = [
        [
            r["sessions"],
            f"{r['kvmemory_tok_s']:.1f}",
            f"{r['speedup_vs_one']:.1f}×",
            paired_speedup(r, "pairs" in d),
            f"{r['sessions_per_pass']:.1f}",
            f"{r['pass_ms']:.1f} / {100 * r['engine_idle']:.0f}%" if "pass_ms" in r else "–",
            f"{r['per_session_tok_s']:.1f}",
            f"{r['kv32_tok_s']:.1f}",
            f"{r['kv8_tok_s']:.1f}" if "kv8_tok_s" in r else "–",
            f"{r['sdpa_tok_s']:.1f}",
            f"{r['unbatched_tok_s']:.1f}",
            f"{r['transformers_tok_s']:.1f}",
            f"{r['ttft_median_s']:.2f} ({r['ttft_max_s']:.2f}) / {r['unbatched_ttft_median_s']:.2f}",
            f"{r['kv_mb']:.0f} / {r['kv32_kv_mb']:.0f} / {r.get('kv8_kv_mb', float('nan')):.0f} / "
            f"{r['transformers_kv_mb']:.0f}",
        ]
        for r in d["rows"]
    ]
    columns = [
        "sessions",
        "kvmemory tok/s",
        "vs 1 session",
        "paired vs 1 session (range)",
        "sessions per pass",
        "ms per pass / engine waiting",
        "per session tok/s",
        "fp32 cache tok/s",
        "8-bit cache tok/s",
        "sdpa tok/s",
        "unbatched tok/s",
        "transformers tok/s",
        "TTFT s batched median (longest) / unbatched median",
        "KV MiB kvmemory / fp32 cache / 8-bit cache / transformers",
    ]
    warmed = f"; each after an untimed {d['warm_up_tokens']}-token reply" if "warm_up_tokens" in d else ""
    return (
        f"**Many agents at once** (`python -m benchmarks.concurrency{options}`{formats_of(d)}{on_cpu(d)}): concurrent "
        f"agent sessions on the default model, each holding an agent trace (up to {d['context']} tokens of real tool "
        f"calls and outputs) under the default policy with a cap of {d['cap']} slots (its method then: "
        f"`{d['default_method']}`), decode {d['tokens']} greedy tokens at once (aggregate decode "
        f"tokens/s, median of {d['repeats']}{warmed}), then append their "
        "next tool result and stream a reply (time to first token). Side by side: the engine batching the sessions' "
        "forwards (on CPU attending in kvmemory's decode kernel), the same with the cache stored in fp32 (twice "
        'the bytes) and in 8-bit rows (`kv_dtype="int8"`, 0.56× the bytes), the same with attention on '
        "torch's sdpa, the same engine one session per forward, and "
        "transformers `generate` over the same contexts left-padded into one batch (its decode timed from the "
        "first generated token to the last). *ms per pass*: the batched engine's time per pass (sampling included; "
        "`Engine.stats()`'s `busy_seconds` over its passes), *engine waiting*: the share of the decode phase's wall "
        "time between passes, while the sessions do their bookkeeping between two tokens (– for runs saved before "
        "they were measured)." + paired_note(d) + "\n\n" + md(rows, columns)
    )


def paired_note(d: dict) -> str:
    if "pairs" not in d:
        return ""
    return (
        f" *Paired*: the median over {d['pairs']} pairs of batched decode phases run back to back, one session's "
        "and the count's, of the ratio of their aggregate tokens/s (this machine's speed drifts by tens of percent "
        "within a minute, and a round puts a minute between two counts' phases)."
    )


def compaction_stall_section(d: dict) -> str:
    paired = {}
    for r in d["rows"]:
        paired.setdefault((r["decoders"], r["method"]), {})[r["condition"]] = r
    rows = [
        [
            decoders,
            f"`{method}`",
            f"{runs['pauses']['gap_ms']:.0f}",
            f"{runs['pauses']['longest_gap_ms']:.0f}",
            f"{runs['no pauses']['longest_gap_ms']:.0f}",
            f"{runs['pauses']['compaction_s']:.2f} / {runs['no pauses']['compaction_s']:.2f}",
            f"{runs['pauses']['alone_s']:.2f}",
        ]
        for (decoders, method), runs in paired.items()
    ]
    columns = [
        "decoding sessions",
        "method",
        "their median gap ms",
        "longest gap ms, pauses",
        "longest gap ms, no pauses",
        "compaction s, pauses / no pauses",
        "compaction s alone",
    ]
    return (
        f"**Compaction beside decoding** (`python -m benchmarks.compaction_stall`{on_cpu(d)}): sessions holding "
        f"agent traces of up to {d['context']} tokens stream greedy tokens while one more, holding "
        f"{d['compacted_tokens']}, compacts all but its first 4 and last 256 at {d['ratio']:g} tokens per slot; the "
        "decoders' longest gap between tokens overlapping the compaction, with the compaction pausing between "
        f"layers for the queued passes once it has run {1e3 * d['slice_seconds']:.0f} ms (`pauses`, the default) "
        f"and running start to end (`no pauses`); medians of {d['repeats']} rounds.\n\n" + md(rows, columns)
    )


def prefill_stall_section(d: dict) -> str:
    rows = [
        [
            r["chunk"] if r["chunk"] != d["default_chunk"] else f"{r['chunk']} (the default)",
            r["pass_tokens"],
            f"{r['prefill_tok_s']:.0f}",
            f"{r['gap_ms']:.0f}",
            f"{r['median_gap_ms']:.0f} / {r['longest_gap_ms']:.0f}",
        ]
        for r in d["rows"]
    ]
    columns = ["prefill chunk", "pass bound", "prefill tok/s", "decoder's gap ms alone", "during: median / longest"]
    return (
        f"**Prefill beside decoding** (`python -m benchmarks.prefill_stall`{on_cpu(d)}): one session decodes (an "
        f"agent trace of up to {d['context']} tokens) while another appends {d['prefill']} tokens of log text with "
        "each prefill chunk size (the engine's pass bound the chunk plus 128 tokens, as its CPU default is): the "
        "prefill's speed and the decoder's gaps between tokens while it runs (one token per pass, and a pass "
        f"holds one chunk); medians of {d['repeats']} rounds.\n\n" + md(rows, columns)
    )
