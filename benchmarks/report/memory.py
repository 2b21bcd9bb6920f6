"""Sections of ``benchmarks/README.md`` on memory: what compacted sessions keep (quality, agent traces, the seed
methods, long sessions)."""

from __future__ import annotations

from benchmarks.report.tables import md, on_cpu


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


def seed_methods_section(d: dict) -> str:
    columns = ["condition", "fact gain kept", "95% CI", "answers held", "ΔNLL last turn", "95% CI (traces)"]
    columns += ["degenerate"]
    columns += ["median pause s", "worst pause s", "s / 2,048 slots"]
    sets = ", ".join(f"{name}: {', '.join(traces)}" for name, traces in d["traces"].items() if traces)
    out = [
        "**Seed methods composed** (`python -m benchmarks.seed_methods`): counter-causal surprise, Attention "
        "Matching and TAM each give one ranking of positions (counter-causal: how little the later context "
        "predicts a token; AM: the heads' consensus on recent attention; TAM: that attention spread over thought "
        "segments by its budget rule), composed with what made the default win: *<seed>-lines* is "
        "`REAL(inner=Lines(<seed>))`, the ranking by whole lines, tokens under 1 nat of surprisal first to go, one "
        "selection for every head and segment, REAL's head budgets, gaps closed; *counter-causal* is the method "
        "alone (per token and head, gaps kept); *kvmemory-default* the default policy, *uniform-lines* its ranking "
        "with every head keeping the same count, *drop-oldest* the text baseline at the same token budget. All on "
        "the default 16-bit cache (equal slots are equal bytes), replayed step by step under a cap of 1/N of each "
        f"trace ({sets}; the held-out traces were written and frozen before any composition was measured and "
        "never tuned on), metrics as in *Agent memory* (*answers held*: the share of the fact gain whose answer the "
        "memory still holds at the end); *median pause*: the median over sessions of each "
        "session's median compaction pause; *worst pause*: the longest of any session; a table lists the traces "
        "every condition ran on at its cap (at 1/16, tilecache's 275 slots cannot hold its protected prompt, the "
        "recent window and one prefill chunk, so the memory refuses it with `MemoryCapError`)"
        f"{on_cpu(d)}.\n\n![seed methods](benchmarks/results/seed_methods.png)"
    ]
    for trace_set in dict.fromkeys(r["set"] for r in d["summary"]):
        for cap in dict.fromkeys(r["cap"] for r in d["summary"] if r["set"] == trace_set):
            body = [
                [
                    r["condition"],
                    f"{r['fact_gain_kept']:.2f}",
                    r["gain_ci"],
                    f"{r['answers_held']:.2f}",
                    f"{r['delta_nll_last_turn']:+.3f}",
                    r["nll_ci"],
                    f"{r['degenerate_replies']:.0%}",
                    f"{r['pause_median_s']:.2f}",
                    f"{r['pause_worst_s']:.2f}",
                    "–" if not r["pause_s_per_2048_slots"] else f"{r['pause_s_per_2048_slots']:.2f}",
                ]
                for r in d["summary"]
                if r["set"] == trace_set and r["cap"] == cap
            ]
            traces = next(r["traces"] for r in d["summary"] if r["set"] == trace_set and r["cap"] == cap)
            out.append(f"\n*{trace_set} traces ({', '.join(traces)}), cap {cap}*\n\n" + md(body, columns))
    return "\n".join(out)


def long_session_section(d: dict) -> str:
    labels = list(dict.fromkeys(r["label"] for r in d["summary"]))
    bins = list(dict.fromkeys(r["ages"] for r in d["summary"]))
    cell = {(r["label"], r["ages"]): r for r in d["summary"]}
    medians = {b: next(r["median_age"] for r in d["summary"] if r["ages"] == b) for b in bins}
    columns = ["condition and cap"] + [
        "all facts" if b == "all" else f"age {b} (median {medians[b] / 1000:.1f}k)" for b in bins
    ]
    body = [[c] + [f"{cell[(c, b)]['fact_gain_kept']:.2f} {cell[(c, b)]['gain_ci']}" for b in bins] for c in labels]
    return (
        "**A long agent session** (`python -m benchmarks.long_session`): every frozen agent trace in turn as one "
        f"session ({', '.join(d['traces'])}; {d['tokens']:,} tokens, {len(d['facts'])} facts each mentioned once), "
        "replayed step by step under a cap of 1/N of its tokens on the default 16-bit cache, every fact asked at "
        "the end; `context-window` is what an engine holding only the model's context keeps (the newest messages "
        "that fit its 8,192 positions, less 256 for the question). Each fact's reference is its own task's "
        "messages up to the one that mentions it, then the question (at most 6.3k tokens); *fact gain kept* is the "
        "share of that reference's gain over no trace, by quartile of the fact's age (the session's tokens after "
        "the message that mentions it), with 95% bootstrap intervals over facts"
        f"{on_cpu(d)}.\n\n![forgetting curve](benchmarks/results/long_session.png)\n\n" + md(body, columns)
    )


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
