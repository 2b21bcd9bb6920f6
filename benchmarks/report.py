"""Print the README's "Measured" section as markdown from the JSON files in benchmarks/results/.

python -m benchmarks.report
"""

from __future__ import annotations

import json
import statistics

from benchmarks.common import RESULTS


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def md(rows: list[list], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def on_cpu(d: dict) -> str:
    """ ", on <CPU> (<its vector extensions>)" when the file names them."""
    m = d.get("machine", {})
    if not m.get("cpu_model"):
        return ""
    return f", on {m['threads']} threads of an {m['cpu_model']} ({', '.join(m['cpu_flags'])})"


def formats_of(d: dict) -> str:
    """ ", <weights> weights, <dtype> cache" when the file records them (runs before they were recorded: fp32)."""
    return f", {d['weights']} weights, {d['kv_dtype']} cache" if "kv_dtype" in d else ""


NLL_COLUMN = "max Δ NLL (full cache)"


def beside_fp32(row: dict) -> list[str]:
    """A weight or cache format's NLL change and method order cells (``benchmarks.quality.beside_the_first``)."""
    return [f"{row['max_full_nll_change']:.4f}", "yes" if row["same_method_order"] else "no"]


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
    return text + "\n\n![speed](benchmarks/results/speed.png)"


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


def quality_section(d: dict) -> str:
    windows = (
        f"mean over {d['segments']} disjoint windows of each text"
        if d.get("segments", 1) > 1
        else "one window per text"
    )
    out = [
        "**Quality** (`python -m benchmarks.quality`): increase of the teacher-forced NLL of the "
        f"{d['continuation']} tokens "
        f"that follow a {d['context']}-token context ({windows}), after compacting the context to "
        "context/ratio slots per head "
        f"(first {d['sinks']} and last {d['recent']} tokens verbatim for every method; reference queries: the last "
        f"{d['window']} tokens; `*_context` add {d.get('context_queries', 256)} tokens' context-prefill "
        "queries, `am_repeat` "
        f"repeat-prefill; `am_real*` is Attention Matching under REAL's profiled head budgets"
        + (
            f"; `default` is the default policy's rule (`{d['methods']['default'][0]}` with "
            + ", ".join(f"`{k}={v}`" for k, v in d["methods"]["default"][1].items())
            + ") followed, as the memory manager runs it, by closing the gaps it leaves, "
            "and `uniform_lines` the same ranking with every head keeping the same count (the default before)"
            + (
                "; `retrieval_lines` is REAL with `retrieval_lines` inside: the default's ranking in the third "
                "of KV heads REAL's profile scores highest, SnapKV's in the others, gaps closed too"
                if "retrieval_lines" in d["methods"]
                else ""
            )
            if "default" in d["methods"]
            else ""
        )
        + "). Lower is better; the best per column in bold."
        + "".join(
            f" Rows of {', '.join(f'`{m}`' for m in run['methods'])} were remeasured later "
            f"(`python -m benchmarks.quality --methods {' '.join(run['methods'])} "
            f"--skip {' '.join(run.get('skip', ['retrieval', 'latency']))}`)."
            for run in d.get("partial_reruns", [])
        )
    ]
    rows = d["quality"]
    ratios = sorted({r["ratio"] for r in rows if r["method"] != "full"})
    for kind in sorted({r["kind"] for r in rows}):
        full = next(r["nll"] for r in rows if r["kind"] == kind and r["method"] == "full")
        methods = [m for m in d["methods"] if any(r["method"] == m and r["kind"] == kind for r in rows)]
        table = {m: {r["ratio"]: r["delta"] for r in rows if r["kind"] == kind and r["method"] == m} for m in methods}
        best = {x: min(table[m][x] for m in methods) for x in ratios}
        body = [
            [m] + [f"**{table[m][x]:.3f}**" if table[m][x] == best[x] else f"{table[m][x]:.3f}" for x in ratios]
            for m in methods
        ]
        out.append(f"\n*{kind}* (full-cache NLL {full:.3f})\n\n" + md(body, ["method"] + [f"{x:g}×" for x in ratios]))
    if all("kv_mb" in r for r in rows):
        kind = sorted({r["kind"] for r in rows})[0]
        full = next(r["kv_mb"] for r in rows if r["kind"] == kind and r["method"] == "full")
        body = [
            [m]
            + [
                f"{next(r['kv_mb'] for r in rows if r['kind'] == kind and r['method'] == m and r['ratio'] == x):.1f}"
                for x in ratios
            ]
            for m in d["methods"]
            if any(r["method"] == m and r["kind"] == kind for r in rows)
        ]
        equal = all(len({row[i + 1] for row in body}) == 1 for i in range(len(ratios)))
        note = (
            "Every method holds the same bytes at a ratio: each KV head stores only its own slots, so REAL's "
            "uneven head budgets cost what uniform ones do."
            if equal
            else "Some methods hold more bytes than others at the same mean slots per head."
        )
        out.append(
            f"\n*KV bytes held* after compaction (MB; full cache {full:.1f} MB; the same for every text kind). "
            f"{note}\n\n" + md(body, ["method"] + [f"{x:g}×" for x in ratios])
        )
    if "retrieval" in d:
        rr = d["retrieval"]
        full = next(r for r in rr if r["method"] == "full")
        ratios = sorted({r["ratio"] for r in rr if r["method"] != "full"})
        body = [
            [m]
            + [f"{next(r['answer_logprob'] for r in rr if r['method'] == m and r['ratio'] == x):.2f}" for x in ratios]
            for m in d["methods"]
            if any(r["method"] == m for r in rr)
        ]
        out.append(
            f"\n*Retrieval probes*: facts planted in {d['context']} tokens of pytest logs, question asked "
            "after compaction; "
            f"mean answer log-probability (full cache {full['answer_logprob']:.2f}; greedy exact match is "
            f"{full['exact_match']:.0%} even with the full cache on this 135M model).\n\n"
            + md(body, ["method"] + [f"{x:g}×" for x in ratios])
        )
    if "latency" in d:
        lat = d["latency"]
        sizes = sorted({r["slots"] for r in lat})
        methods = list(dict.fromkeys(r["method"] for r in lat))
        body = [
            [m] + [f"{next(r['ms'] for r in lat if r['method'] == m and r['slots'] == s):.0f}" for s in sizes]
            for m in methods
        ]
        out.append(
            "\n*Latency*: milliseconds per compaction to 10× (median of 3), without measuring the reconstruction "
            "error\n\n" + md(body, ["method"] + [f"{s} slots" for s in sizes])
        )
    return "\n".join(out)


def head_budgets_section(d: dict) -> str:
    rows = [
        [
            r["method"],
            f"{r['slots_per_head']:.0f} ({r['fewest']}…{r['most']})",
            f"{r['kv_mb']:.1f}",
            f"{r['padded_mb']:.1f}",
            f"{r['delta_nll']:+.3f}",
        ]
        for r in d["rows"]
    ]
    s = d["decode"]
    return (
        f"**Head budgets at equal bytes** (`python -m benchmarks.head_budgets`): {d['context']} tokens of Python "
        f"source compacted {d['ratio']:g}× (mean over {d['windows']} windows), NLL increase of the next 256 "
        "tokens; *padded* is what the same slots took when each layer was padded to its longest head.\n\n"
        + md(rows, ["method", "slots per head (fewest…most)", "KV MB held", "KV MB padded", "ΔNLL"])
        + f"\n\nDecode over the uneven (AM under REAL) cache: {s['uneven_decode_tok_s']:.1f} tok/s vs "
        f"{s['uniform_decode_tok_s']:.1f} over the uniform AM cache (β too) of the same "
        f"{s['uniform_kv_mb']:.1f} MB ({s['uneven_vs_uniform']:.2f}×; warmed up, interleaved, medians).\n\n"
        "![head budgets](benchmarks/results/head_budgets.png)"
    )


def agent_section(d: dict) -> str:
    none = sum(d["no_session_logprobs"].values()) / len(d["no_session_logprobs"])

    def share(row, key):  # rows saved before fluency was judged have none
        return f"{row[key]:.0%}" if key in row else "—"

    rows = [
        [
            r["run"],
            r["history_tokens"],
            r["peak_slots"],
            f"{r['peak_kv_bytes'] / 2**20:.0f} MiB",
            f"{r.get('peak_kv_vs_uncompacted', 1):.0%}",
            r["compactions"],
            f"{r['answer_logprob']:.2f}",
            f"{r['answer_logprob'] - none:+.2f}",
            f"{r['exact_match']:.0%}",
            share(r, "degenerate_replies"),
            share(r, "degenerate_answers"),
            f"{r['seconds']:.0f}",
        ]
        for r in d["rows"]
    ]
    return (
        f"**Agent session** (`python -m benchmarks.agent_session`): {d['steps']} real tool calls on the "
        "sample project, "
        f"cap {d['cap']} slots, then five questions about facts read along the way, each asked in a fork of the "
        f"finished session under the same cap. `+ recall tool`: the same replay, but before each question the agent "
        f"re-reads the tool output whose transcript text best matches it (`Session.search`, BM25, then "
        f"`Session.recall`). The text baselines trim what they send, so what they dropped is out of the model's view; "
        f"a text agent that kept its whole message list could run the same search. `kvmemory-default-kv16`: the "
        f"default policy on a cache stored in fp16, capped at the bytes the cap costs in fp32. *Gain*: the mean "
        f"answer log-probability minus the {none:.2f} the same questions get with no session at all (the uncompacted "
        f"run is no reference: it runs past the model's 8,192 trained positions). *Degenerate*: empty, repetitive "
        f"or off-topic (as *Agent memory* judges them) among the replies of the last {d['late_replies']} steps and "
        f"among the answers; — for a run saved before they were judged.\n\n"
        + md(
            rows,
            [
                "run",
                "history tokens",
                "peak slots",
                "peak KV",
                "vs uncompacted",
                "compactions",
                "answer log-prob",
                "gain",
                "exact match",
                "degenerate replies",
                "degenerate answers",
                "seconds",
            ],
        )
    )


def agent_memory_section(d: dict) -> str:
    columns = [
        "condition",
        "fact gain kept",
        "95% CI",
        "answers held",
        "exact match",
        "ΔNLL last turn",
        "95% CI (traces)",
        "degenerate",
        "peak KV MB",
        "compaction s / 2,048 slots",
    ]
    full = [r for r in d["rows"] if r["condition"] == "uncompacted"]
    tokens = [r["cap_tokens"] / 1000 for r in full]
    facts = [len(r["facts"]) for r in full]
    fact_range = f"{min(facts)}" if min(facts) == max(facts) else f"{min(facts)}-{max(facts)}"
    out = [
        "**Agent memory** (`python -m benchmarks.agent_memory`): real coding-agent traces "
        f"({', '.join(d['traces'])}; {min(tokens):.1f}k-{max(tokens):.1f}k tokens, "
        f"{fact_range} single-mention facts each, asked at the end; {d.get('weights', 'fp32')} weights), "
        "replayed step by step under a cap of 1/N of each trace; kvmemory conditions at equal KV bytes, text "
        "baselines at the same token budget; the default policy keeps the lines of highest surprisal under "
        'REAL\'s head budgets (`real` with `inner="selective_context"`), evicts the tokens it predicted at under '
        "1 nat before any line (`evict_predictable_below=1.0`), closes each head's gaps after a compaction "
        "(`close_gaps`), keeps the chat frames of the last 4 messages (`recent_frames`) and, when the cap forces a "
        "compaction, aims at 95% of it (`target_fraction`), *uniform-lines* is the same ranking with every head "
        "keeping the same count (the default before; its rows are the former default's), *whole-lines* that "
        "keeping whole lines, *retrieval-lines* the "
        "ranking in the third of KV heads REAL's profile scores highest and SnapKV's in the others, under REAL's "
        'budgets (`real` with `inner="retrieval_lines"`, gaps closed per head); the other kvmemory rows '
        "switch its rules to that method and keep the gaps (their heads keep different tokens), under the "
        "default's budget otherwise (95%, frames kept); *-kv16* rows run on a cache "
        'stored in fp16 (`Engine(kv_dtype="float16")`) under the same bytes, so about twice the tokens fit, the '
        'text baselines included, against the same fp32 references, and *-kv8* rows on 8-bit rows (`kv_dtype="int8"`), '
        "3.47 times the tokens. *Fact gain kept*: "
        "the share of the answer log-probability gain that the whole trace gives over no trace (1 = as good as "
        "uncompacted); *answers held*: the share of that gain whose answer the memory still holds at the end "
        "(its first token, in the KV heads that keep it; – where not measured); *degenerate*: empty, repetitive or "
        "off-topic free replies; *95% CI (traces)*: the ΔNLL's interval resampling the traces (one value each); "
        "*compaction s*: seconds the memory manager held the session compacting (choosing, rebuilding the "
        "cache, closing gaps) per 2,048 slots it compacted (– where it compacted nothing); rows measured before "
        "the manager timed its pauses (all but the default, uniform-lines and retrieval-lines-kv16 ones) count "
        "the choosing and rebuilding alone, with each compaction's error measured as the manager then did."
    ]
    for cap in dict.fromkeys(r["cap"] for r in d["summary"]):
        body = [
            [
                r["condition"],
                f"{r['fact_gain_kept']:.2f}",
                r["gain_ci"],
                "–" if r.get("answers_held") is None else f"{r['answers_held']:.2f}",
                f"{r['exact_match']:.0%}",
                f"{r['delta_nll_last_turn']:+.3f}",
                r["nll_ci"],
                f"{r['degenerate_replies']:.0%}",
                f"{r['peak_kv_mb']:.0f}",
                "–" if not r.get("pause_s_per_2048_slots") else f"{r['pause_s_per_2048_slots']:.2f}",
            ]
            for r in d["summary"]
            if r["cap"] == cap
        ]
        out.append(f"\n*cap {cap}*\n\n" + md(body, columns))
    return "\n".join(out)


def agent_turns_section(d: dict) -> str:
    traces = list(d["summary"][0]["per_trace"])
    out = [
        f"**Agent memory, last {d['turns']} turns** (`python -m benchmarks.agent_memory --turns {d['turns']}`): the "
        f"same replays, scoring the teacher-forced NLL of each of the last {d['turns']} step groups (tool call, tool "
        "output, note) given the state the session had just before it, against the uncompacted run; "
        f"{len(traces) * d['turns']} values a condition instead of {len(traces)}. *95% CI*: resampling those values."
    ]
    columns = ["condition", f"ΔNLL last {d['turns']} turns", "95% CI", *traces]
    for cap in dict.fromkeys(r["cap"] for r in d["summary"]):
        body = [
            [r["condition"], f"{r['delta_nll_turns']:+.3f}", r["ci"], *(f"{r['per_trace'][t]:+.3f}" for t in traces)]
            for r in d["summary"]
            if r["cap"] == cap
        ]
        out.append(f"\n*cap {cap}*\n\n" + md(body, columns))
    return "\n".join(out)


def persistence_section(d: dict) -> str:
    rows = [
        [
            f"{r['logical_tokens']:,}",
            r["slots"],
            f"{r['file_mb']:.0f}",
            f"{r['save_s']:.2f}",
            f"{r['load_s']:.2f}",
            f"{r['rebuild_s']:.1f}",
            f"{r['load_vs_rebuild']:.0f}×",
            "yes" if r["identical_logits"] else "no",
        ]
        for r in d["rows"]
    ]
    columns = ["logical tokens", "slots", "file MB", "save s", "load s", "re-prefill s", "load speed-up", "same logits"]
    return (
        f"**Saved sessions** (`python -m benchmarks.persistence`{formats_of(d)}{on_cpu(d)}): a session under a "
        f"{d['cap']}-slot cap, saved with `session.save`, loaded with `engine.load_session` (medians of 3), "
        "against rebuilding it by re-prefilling its transcript under the same policy.\n\n" + md(rows, columns)
    )


def serve_section(d: dict) -> str:
    rows = [
        [r["mode"], r["turns"], f"{r['prefilled_tokens']:,}", f"{r['median_turn_s']:.2f}", f"{r['total_s']:.1f}"]
        for r in d["summary"]
    ]
    restore = d["restore"]
    return (
        f"**Serving** (`python -m benchmarks.serve`): the `{d['trace']}` agent trace sent turn by turn to a live "
        "`kvmemory serve` through the `openai` client, with an `x-session-id` (the cache stays resident) and "
        "without (every turn re-prefills the history, as a server without session affinity does).\n\n"
        + md(rows, ["mode", "turns", "prefilled tokens", "median turn s", "total s"])
        + f"\n\nRestoring the finished session ({restore['logical_tokens']:,} tokens) from its file over HTTP: "
        f"{restore['restore_s']:.2f} s, against {restore['reprefill_s']:.1f} s to re-prefill it "
        f"({restore['speedup']:.0f}×)."
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


def main() -> None:
    parts = []
    sections = (
        ("speed", speed_section),
        ("kv_dtype", kv_dtype_section),
        ("quality", quality_section),
        ("head_budgets", head_budgets_section),
        ("agent_memory", agent_memory_section),
        ("agent_memory_turns", agent_turns_section),
        ("agent_session", agent_section),
        ("persistence", persistence_section),
        ("serve", serve_section),
        ("fp16_linear", fp16_linear_section),
        ("decode_kernel", decode_kernel_section),
        ("concurrency", concurrency_section),
        ("concurrency_fp16", lambda d: concurrency_section(d, " --weights fp16")),
        ("compaction_stall", compaction_stall_section),
        ("prefill_stall", prefill_stall_section),
    )
    for name, fn in sections:
        data = load(name)
        if data and not data.get("partial"):  # a benchmark still running (or stopped) has no summary yet
            parts.append(fn(data))
    print("\n\n".join(parts))


if __name__ == "__main__":
    main()
