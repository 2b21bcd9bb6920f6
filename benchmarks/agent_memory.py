"""Memory fidelity of agent sessions under a cap: does a compacted session keep what it read?

Four real coding-agent traces (``benchmarks/agent_traces.py``: real file reads, test runs, logs and
searches, 5-7k tokens each, so the uncompacted run stays inside the model's trained positions and is a
valid reference) are replayed step by step, as an agent would send them, under each condition:

* ``uncompacted``: the whole trace in the cache;
* text baselines at a token budget equal to the cap: ``drop-oldest`` (keep the system prompt and task,
  then the newest messages that fit, tool calls with their results); ``clear-tool-uses`` (LangChain's
  ``ClearToolUsesEdit(keep=3)``, then drop-oldest if still over); ``summarization`` (LangChain's
  ``SummarizationMiddleware`` with the same local model as the summariser);
* kvmemory under a cap of the same KV bytes (``MemoryBudget.max_bytes``), compacting online as the memory
  manager runs it: the default policy (selective context, its tokens of under 1 nat of surprisal evicted
  before any line, under REAL's head budgets, gaps closed); the same ranking with every head keeping the same
  count (``uniform-lines``, the default before) and that keeping whole lines (``whole-lines``); and its rules
  switched to Attention Matching, AM under REAL head budgets, TAM, counter-causal surprise or SnapKV;
* ``-kv16`` conditions (the default, uniform-lines, whole-lines, retrieval-lines, drop-oldest,
  clear-tool-uses): the same on a cache stored in fp16
  (``Engine(kv_dtype="float16")``) under the same bytes, so about twice the tokens fit (a text agent on a
  16-bit cache gets the same), against the same fp32 references; ``-kv8`` conditions (the default,
  drop-oldest): the same on 8-bit rows (``kv_dtype="int8"``, ``kvmemory.cache.int8_rows``), about 3.5 times
  the tokens.

Measured at the end of each trace, for each fact (a value the trace mentions exactly once, early): the
answer's log-probability after the question, as the share of the gain the whole trace gives over no trace,
``(lp - lp_none) / (lp_full - lp_none)`` summed over the facts the trace helps; greedy exact match. Also the
teacher-forced NLL of the trace's last turn given the (compacted) earlier part, and the share of degenerate
free replies (empty, repetitive or off-topic) among sampled answers to an open question. Intervals are 95%
bootstrap intervals: over facts for the fact metrics, over traces for the NLL (one value per trace, so with
four traces it shows how far one trace moves the mean, not a fine resolution).

    python -m benchmarks.agent_memory [--caps 8 4] [--conditions ...] [--traces ...] [--replies 4]
    python -m benchmarks.agent_memory --from-saved   # summarise what a stopped run saved
    python -m benchmarks.agent_memory --update --conditions am-real --caps 8   # remeasure some conditions
    python -m benchmarks.agent_memory --turns 4 --caps 8 --conditions uncompacted drop-oldest-kv16 ...
        # only the NLL of each of the last 4 step groups (finer than the last turn alone; no facts);
        # with --update, only those conditions run again
"""

from __future__ import annotations

import argparse
import bisect
import json
import random
import re
import statistics
import time

from benchmarks.agent_traces import load_traces, trace_text
from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from benchmarks.text_memory import ClearToolUses, DropOldest, FullHistory, Summarization
from kvmemory import Engine, MemoryManager, MemoryPolicy, default_policy
from kvmemory.integrations.chat_model import to_chat_dicts

SEEDS = [("cc", "counter_causal"), ("am", "attention_matching"), ("tam", "tam")]  # condition prefix, method
DEFAULT_LINES = {"inner": "selective_context", "inner_params": {"evict_predictable_below": 1.0}}
MASS_ONLY = {"fit_values": False, "beta_box": (0.0, 3.0)}
KV_METHODS = {  # condition: (registry name, params) every compacted rule of the default policy switches to
    # the default's ranking with every head keeping the same count (so the same tokens): the default before
    "uniform-lines": ("selective_context", {"evict_predictable_below": 1.0}),
    "whole-lines": ("selective_context", {}),  # the same without evicting predictable tokens first
    # retrieval heads keep the default's lines, the others SnapKV's choice, under REAL's head budgets
    "retrieval-lines": ("real", {"inner": "retrieval_lines"}),
    "am": ("attention_matching", {}),
    "am-real": ("real", {"inner": "attention_matching"}),
    "tam": ("tam", {}),
    "counter-causal": ("counter_causal", {}),
    "snapkv": ("snapkv", {}),
    # the seed methods composed with what made the default win (``benchmarks/seed_methods.py``): their
    # ranking by whole lines with the surprise floor, one selection, REAL's head budgets, gaps closed
    **{f"{seed}-lines": ("real", {"inner": "lines", "inner_params": {"inner": method}}) for seed, method in SEEDS},
    # and Attention Matching's β and value fit on that choice
    **{
        f"{seed}-lines-fit": ("real", {"inner": "fitted", "inner_params": {"inner_params": {"inner": method}}})
        for seed, method in SEEDS
    },
    # Attention Matching's fit on the default's choice: β and values, or only β raised (the mass the evicted
    # tokens held, given back to the kept ones; never pushed down)
    "am-fit-default": ("real", {"inner": "fitted", "inner_params": DEFAULT_LINES}),
    "am-mass-default": ("real", {"inner": "fitted", "inner_params": {**DEFAULT_LINES, "matching": MASS_ONLY}}),
    # the default with less of each head's budget pooled by REAL (β = 2: half, β = 4: a quarter; the default
    # pools ⌊b/1.4⌋): between the default and uniform-lines
    "default-pool50": ("real", {**DEFAULT_LINES, "beta": 2.0}),
    "default-pool25": ("real", {**DEFAULT_LINES, "beta": 4.0}),
}
CONDITIONS = [
    "uncompacted",
    "drop-oldest",
    "clear-tool-uses",
    "summarization",
    "kvmemory-default",
    *KV_METHODS,
]
# suffix: the condition on a cache stored in this ``kv_dtype``, under the same bytes
STORED = {"-kv16": "float16", "-kv8": "int8"}
CONDITIONS += [
    c + "-kv16"
    for c in ("drop-oldest", "clear-tool-uses", "kvmemory-default", "uniform-lines", "whole-lines", "retrieval-lines")
]
CONDITIONS += [c + "-kv8" for c in ("drop-oldest", "kvmemory-default")]
OPEN_QUESTION = "In two sentences: what was wrong in this task, and what did you change?"
ANSWER_TOKENS, REPLY_TOKENS, BOOTSTRAP = 16, 48, 2000


# the default's ranking, alone or in some heads; the others keep their gaps
CLOSE_GAPS = {"kvmemory-default", "uniform-lines", "whole-lines", "retrieval-lines"} | {
    c for c in KV_METHODS if "-lines" in c or "default" in c
}


def capped_policy(
    max_bytes: int, method: str | None = None, params: dict | None = None, close_gaps: bool = True
) -> MemoryPolicy:
    """The default policy under a byte cap; with ``method``, every compacted rule switched to it; gaps closed
    as the default closes them unless ``close_gaps`` is False (the per-head selectors were measured with
    their gaps kept)."""
    policy = default_policy()
    close_gaps = policy.budget.close_gaps and close_gaps
    budget = policy.budget.model_copy(update={"max_bytes": max_bytes, "close_gaps": close_gaps})
    policy = policy.model_copy(update={"budget": budget})
    if method is None:
        return policy
    switch = {"method": method, "params": params or {}}
    rules = [r if r.protected else r.model_copy(update=switch) for r in policy.rules]
    return policy.model_copy(update={"rules": rules, "default": policy.default.model_copy(update=switch)})


# ---- measuring --------------------------------------------------------------------------------------
def question(text: str) -> dict:
    return {"role": "user", "content": text}


def continuation_ids(renderer, shown: list[dict], turn: list[dict], limit: int = 384) -> list[int]:
    """The tokens ``turn`` adds after ``shown`` (the chat template renders each message on its own)."""
    before = renderer.render(shown)
    after = renderer.render(shown + turn)
    if after[: len(before)] != before:
        raise RuntimeError("the chat template rendered the prefix differently once the turn was added")
    return after[len(before) :][:limit]


def ask(session, view, history, facts, tokenizer) -> list[dict]:
    """Each fact question in a fork of the finished session: answer log-probability and greedy exact match."""
    out = []
    for q, answer in facts:
        probe = session.fork(with_memory=True)
        probe.set_messages(
            view.probe(history, [question(f"{q} Answer with the value only.")]), add_generation_prompt=True
        )
        lp = float(probe.logprobs(tokenizer.encode(answer, add_special_tokens=False)).sum())
        text = probe.generate(max_new_tokens=ANSWER_TOKENS).text
        out.append({"question": q, "answer": answer, "logprob": lp, "reply": text, "exact": answer in text})
        probe.close()
    return out


def held_in_cache(session, answers: list[str]) -> list[float]:
    """Per answer, the share of the cache's KV heads that still hold the first token of its first mention in the
    session's transcript (0 when what the session was shown no longer mentions it): whether the memory kept the
    fact at all, apart from whether the model can use what it kept."""
    tokenizer, offsets, text = session.engine.tokenizer, [], ""
    for token in session.tokens:  # the transcript's text once, with where each token starts
        offsets.append(len(text))
        text += tokenizer.decode([token])
    layers = session.cache.layers
    heads = sum(layer.num_heads for layer in layers)
    out = []
    for answer in answers:
        at = text.find(answer)
        if at < 0:
            out.append(0.0)
            continue
        position = bisect.bisect_right(offsets, at) - 1
        out.append(sum(int((p == position).sum()) for layer in layers for p in layer.head_views("positions")) / heads)
    return out


def free_replies(session, view, history, n: int) -> list[str]:
    replies = []
    for seed in range(n):
        probe = session.fork(with_memory=True)
        probe.set_messages(view.probe(history, [question(OPEN_QUESTION)]), add_generation_prompt=True)
        replies.append(probe.generate(max_new_tokens=REPLY_TOKENS, temperature=0.8, top_p=0.95, seed=seed).text)
        probe.close()
    return replies


WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]{3,}")


def degenerate(reply: str, context: str) -> str | None:
    """Why a free reply is degenerate: ``empty``, ``repetitive`` (a word 4-gram three times, or under a third of
    its words distinct) or ``off-topic`` (no word of four letters or more that the trace contains)."""
    words = reply.lower().split()
    if len(WORD.findall(reply)) < 2:
        return "empty"
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    if (grams and max(grams.count(g) for g in set(grams)) >= 3) or len(set(words)) < len(words) / 3:
        return "repetitive"
    known = set(WORD.findall(context.lower()))
    if not any(w in known for w in WORD.findall(reply.lower())):
        return "off-topic"
    return None


def on_cache_of(engine, condition: str, cap_tokens: int) -> tuple:
    """(engine, condition, token budget) a condition runs with: a ``-kv16`` or ``-kv8`` one on a cache of the
    same model stored in that dtype, its budget the tokens that fit in the bytes ``cap_tokens`` cost in the
    model's own dtype."""
    suffix = stored_suffix(condition)
    if suffix is None:
        return engine, condition, cap_tokens
    stored = Engine(engine.model, engine.tokenizer, name=engine.name, kv_dtype=STORED[suffix])
    return stored, condition.removesuffix(suffix), cap_tokens * engine.kv_bytes_per_token // stored.kv_bytes_per_token


def stored_suffix(condition: str) -> str | None:
    return next((suffix for suffix in STORED if condition.endswith(suffix)), None)


def setup(engine, condition: str, cap_tokens: int) -> tuple:
    """(engine, view, memory manager, token budget) a condition runs with (see ``on_cache_of``)."""
    engine, condition, cap_tokens = on_cache_of(engine, condition, cap_tokens)
    renderer = engine.session().renderer

    def count_tokens(lc_messages) -> int:
        return len(renderer.render(to_chat_dicts(lc_messages)))

    memory, view = None, FullHistory()
    if condition == "drop-oldest":
        view = DropOldest(count_tokens, cap_tokens)
    elif condition == "clear-tool-uses":
        view = ClearToolUses(count_tokens, cap_tokens)
    elif condition == "summarization":
        view = Summarization(count_tokens, cap_tokens, engine)
    elif condition != "uncompacted":
        method, params = KV_METHODS.get(condition, (None, None))
        memory = MemoryManager(
            capped_policy(cap_tokens * engine.kv_bytes_per_token, method, params, condition in CLOSE_GAPS)
        )
    return engine, view, memory, cap_tokens


def step_through(session, view, messages: list[dict], scored: int) -> tuple[list[float], int]:
    """Send the trace step by step as ``view`` shows it (after each tool call, tool output and note); return the
    teacher-forced NLL of each of the last ``scored`` step groups, each given the state the session had just
    before it (the last group runs to the trace's end), and the peak KV bytes along the way."""
    ends = list(range(5, len(messages) + 1, 3))
    nlls, peak = [], 0
    for i, end in enumerate(ends[:-1]):
        shown = view.show(messages[:end])
        session.set_messages(shown)
        peak = max(peak, session.stats().kv_bytes)
        if i >= len(ends) - 1 - scored:
            stop = ends[i + 1] if i + 2 < len(ends) else len(messages)
            turn = continuation_ids(session.renderer, shown, messages[end:stop])
            nlls.append(float(-session.logprobs(turn).mean()))
    return nlls, peak


def pauses_of(memory) -> list[float]:
    """The seconds each compaction held the session for (selection, rebuild, closing gaps)."""
    return [e["seconds"] for e in memory.timeline if "seconds" in e] if memory else []


def replay(engine, trace: dict, condition: str, cap_tokens: int, replies: int) -> dict:
    """Send the trace step by step as ``condition``; measure the last turn's NLL, the facts and free replies."""
    named, (engine, view, memory, cap_tokens) = condition, setup(engine, condition, cap_tokens)
    messages = trace["messages"]
    session = engine.session(memory=memory)
    started = time.perf_counter()
    (nll,), peak = step_through(session, view, messages, scored=1)
    session.set_messages(view.show(messages))
    peak = max(peak, session.stats().kv_bytes, memory.peak_slots * engine.kv_bytes_per_token if memory else 0)
    held = held_in_cache(session, [answer for _, answer in trace["facts"]])
    asked = ask(session, view, messages, trace["facts"], engine.tokenizer)
    facts = [{**fact, "held": h} for fact, h in zip(asked, held)]
    texts = free_replies(session, view, messages, replies)
    context = trace_text(messages)
    row = {
        "trace": trace["name"],
        "condition": named,
        "cap_tokens": cap_tokens,
        "nll_last_turn": nll,
        "peak_kv_bytes": peak,
        "compactions": session.cache.compactions,
        "compaction_ms": 1e3 * sum(pauses_of(memory)),
        "slots_compacted": sum(r["slots_before"] for r in session.compaction_log),
        "pauses_s": pauses_of(memory),
        "summaries": getattr(view, "summaries", 0),
        "facts": facts,
        "replies": [{"text": t, "degenerate": degenerate(t, context)} for t in texts],
        "seconds": time.perf_counter() - started,
    }
    session.close()
    return row


def no_trace_logprobs(engine, trace: dict) -> list[float]:
    """Each answer's log-probability with only the system prompt and the question: what no memory gives."""
    out = []
    for q, answer in trace["facts"]:
        session = engine.session()
        session.set_messages(
            [trace["messages"][0], question(f"{q} Answer with the value only.")], add_generation_prompt=True
        )
        out.append(float(session.logprobs(engine.tokenizer.encode(answer, add_special_tokens=False)).sum()))
        session.close()
    return out


# ---- summarising ------------------------------------------------------------------------------------
def gain_share(facts: list[tuple[float, float, float]]) -> float:
    """Σ(lp - lp_none) / Σ(lp_full - lp_none) over (lp, lp_none, lp_full) of facts the full trace helps."""
    helped = [(lp, none, full) for lp, none, full in facts if full > none]
    total = sum(full - none for _, none, full in helped)
    return sum(lp - none for lp, none, _ in helped) / total if total else float("nan")


def bootstrap(values: list, statistic, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    samples = [statistic([rng.choice(values) for _ in values]) for _ in range(BOOTSTRAP)]
    samples = sorted(x for x in samples if x == x)  # a resample with no fact the trace helps has no share
    return samples[int(0.025 * len(samples))], samples[int(0.975 * len(samples)) - 1]


def summarise(rows: list[dict], none: dict, divisor: int) -> list[dict]:
    full = {
        (r["trace"], f["question"]): f["logprob"] for r in rows if r["condition"] == "uncompacted" for f in r["facts"]
    }
    full_nll = {r["trace"]: r["nll_last_turn"] for r in rows if r["condition"] == "uncompacted"}
    out = []
    for condition in sorted({r["condition"] for r in rows}, key=CONDITIONS.index):  # one order in every table
        mine = [r for r in rows if r["condition"] == condition]
        triples = [
            (f["logprob"], none[(r["trace"], f["question"])], full[(r["trace"], f["question"])])
            for r in mine
            for f in r["facts"]
        ]
        exact = [float(f["exact"]) for r in mine for f in r["facts"]]
        replies = [p for r in mine for p in r["replies"]]
        deltas = [r["nll_last_turn"] - full_nll[r["trace"]] for r in mine]
        share_lo, share_hi = bootstrap(triples, gain_share)
        exact_lo, exact_hi = bootstrap(exact, statistics.fmean)
        nll_lo, nll_hi = bootstrap(deltas, statistics.fmean)
        out.append(
            {
                "cap": f"1/{divisor}",
                "condition": condition,
                "fact_gain_kept": gain_share(triples),
                "answers_held": answers_held(mine, none, full),
                "gain_ci": f"[{share_lo:.2f}, {share_hi:.2f}]",
                "exact_match": statistics.fmean(exact),
                "exact_ci": f"[{exact_lo:.2f}, {exact_hi:.2f}]",
                "delta_nll_last_turn": statistics.fmean(deltas),
                "nll_ci": f"[{nll_lo:+.3f}, {nll_hi:+.3f}]",
                "degenerate_replies": sum(p["degenerate"] is not None for p in replies) / len(replies),
                "peak_kv_mb": max(r["peak_kv_bytes"] for r in mine) / 1e6,
                "seconds": sum(r["seconds"] for r in mine),
                "pause_s_per_2048_slots": pause_per_2048(mine),
            }
        )
    return out


def answers_held(rows: list[dict], none: dict, full: dict) -> float | None:
    """Share of the fact gain whose answer the memory still holds at the end, weighted like the gain (rows
    saved before this was measured have none)."""
    facts = [
        (f, full[(r["trace"], f["question"])] - none[(r["trace"], f["question"])]) for r in rows for f in r["facts"]
    ]
    if any("held" not in f for f, _ in facts):
        return None
    helped = [(f["held"], gain) for f, gain in facts if gain > 0]
    return sum(h * gain for h, gain in helped) / sum(gain for _, gain in helped)


def pause_per_2048(rows: list[dict]) -> float | None:
    """Seconds of compaction per 2,048 slots compacted (rows saved before this was measured have none)."""
    if any("compaction_ms" not in r for r in rows):
        return None
    slots = sum(r["slots_compacted"] for r in rows)
    return sum(r["compaction_ms"] for r in rows) / 1e3 / slots * 2048 if slots else 0.0


def interval(text: str) -> tuple[float, float]:
    """The bounds of a ``[low, high]`` interval as the summaries store it."""
    low, high = text[1:-1].split(",")
    return float(low), float(high)


def condition_color(condition: str) -> str:
    """Blue for kvmemory, gray for text baselines; lighter on a cache stored in fewer bits."""
    stored = stored_suffix(condition) is not None
    if condition.startswith(("kvmemory", *KV_METHODS)):
        return "tab:cyan" if stored else "tab:blue"
    return "silver" if stored else "tab:gray"


def bars(ax, mine: list[dict], values: list[float], bounds: list[tuple[float, float]]) -> None:
    """One bar per summary row with its 95% interval, labelled by condition."""
    ax.bar(range(len(mine)), values, color=[condition_color(r["condition"]) for r in mine])
    below = [max(v - low, 0.0) for v, (low, _) in zip(values, bounds)]  # the bounds are rounded, the values not
    above = [max(high - v, 0.0) for v, (_, high) in zip(values, bounds)]
    ax.errorbar(range(len(mine)), values, yerr=[below, above], fmt="none", color="black", capsize=3)
    ax.set_xticks(range(len(mine)), [r["condition"] for r in mine], rotation=35, ha="right", fontsize=8)


def plot(summary: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = list(dict.fromkeys(r["cap"] for r in summary))
    fig, axes = plt.subplots(1, len(caps), figsize=(6 * len(caps), 4.5), squeeze=False)
    for ax, cap in zip(axes[0], caps):
        mine = [r for r in summary if r["cap"] == cap and r["condition"] != "uncompacted"]
        bars(ax, mine, [r["fact_gain_kept"] for r in mine], [interval(r["gain_ci"]) for r in mine])
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="uncompacted")
        ax.axhline(0.0, color="black", linewidth=0.5)
        ax.set_ylabel("share of the full trace's fact gain kept")
        ax.set_title(f"cap = {cap} of the trace (equal KV bytes / tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def finish(rows: list[dict], none: dict, caps: list[int], replies: int, weights: str) -> None:
    """Summary tables, PNG and JSON over the traces every condition ran on (a stopped run's complete ones)."""
    wanted = {(r["condition"], r["divisor"]) for r in rows} | {("uncompacted", 1)}
    have = {(r["trace"], r["condition"], r["divisor"]) for r in rows}
    complete = [t for t in dict.fromkeys(r["trace"] for r in rows) if all((t, *w) in have for w in wanted)]
    rows = [r for r in rows if r["trace"] in complete]
    full = [r for r in rows if r["condition"] == "uncompacted"]
    summary = []
    for divisor in caps:
        capped = [r for r in rows if r["divisor"] == divisor and r["condition"] != "uncompacted"]
        summary += summarise(full + capped, none, divisor)
        print(table([r for r in summary if r["cap"] == f"1/{divisor}"], list(summary[0])), flush=True)
    plot(summary, RESULTS / "agent_memory.png")
    out = {"caps": caps, "replies": replies, "weights": weights, "traces": complete, "summary": summary, "rows": rows}
    out["no_trace"] = [list(k) + [v] for k, v in none.items()]
    print(f"saved {save('agent_memory', out)}")


def update_saved(conditions: list[str], caps: list[int], replies: int) -> None:
    """Remeasure some conditions of the saved run on its traces and summarise everything again."""
    saved = json.loads((RESULTS / "agent_memory.json").read_text())
    weights = saved.get("weights", "fp32")  # runs before weight formats existed measured fp32
    engine = Engine.from_pretrained(BENCH_MODEL, weights=weights, kv_dtype="float32")  # as the saved run measured
    traces = load_traces(saved["traces"])
    redo = {(c, d) for c in conditions for d in caps if c != "uncompacted"}
    fresh = {}
    for trace in traces:
        length = len(engine.session().renderer.render(trace["messages"]))
        for condition, divisor in sorted(redo):
            row = replay(engine, trace, condition, length // divisor, replies)
            print(f"1/{divisor} {trace['name']:<10} {condition:<17} NLL {row['nll_last_turn']:.3f}", flush=True)
            fresh[(trace["name"], condition, divisor)] = {**row, "divisor": divisor}
    rows = [fresh.pop((r["trace"], r["condition"], r["divisor"]), r) for r in saved["rows"]] + list(fresh.values())
    caps = sorted(set(saved["caps"]) | set(caps), reverse=True)  # tightest first, as a full run orders them
    finish(rows, {(t, q): lp for t, q, lp in saved["no_trace"]}, caps, saved["replies"], weights)


def last_turns(conditions: list[str], caps: list[int], scored: int, names: list[str] | None, update: bool) -> None:
    """``--turns K``: only the NLL of each of the last K step groups of every trace, each given the state the
    session had just before it, against the uncompacted run (no facts, no replies). The last turn alone gives one
    value a trace, and a test name kept or lost moves it by tenths of a nat; K groups a trace resolve finer.
    With ``update``, only ``conditions`` at ``caps`` run again; the saved run's other rows stay."""
    engine = Engine.from_pretrained(BENCH_MODEL, kv_dtype="float32")
    rows, redo = [], {(c, d) for c in conditions for d in caps}
    if update:
        saved = json.loads((RESULTS / "agent_memory_turns.json").read_text())
        if saved["turns"] != scored:
            raise SystemExit(f"the saved run scored {saved['turns']} turns, not {scored}")
        rows = [r for r in saved["rows"] if (r["condition"], r["divisor"]) not in redo]
        names = list(dict.fromkeys(r["trace"] for r in rows))
        caps = sorted(set(saved["caps"]) | set(caps), reverse=True)
        conditions = list(dict.fromkeys([r["condition"] for r in rows] + conditions))
    for trace in load_traces(names):
        length = len(engine.session().renderer.render(trace["messages"]))
        runs = [("uncompacted", 1)] if not update else []
        runs += [(c, d) for d in caps for c in conditions if c != "uncompacted" and (c, d) in redo]
        for condition, divisor in runs:
            stored, view, memory, _ = setup(engine, condition, length // divisor)
            session = stored.session(memory=memory)
            nlls, _ = step_through(session, view, trace["messages"], scored)
            session.close()
            rows.append({"trace": trace["name"], "condition": condition, "divisor": divisor, "nll_turns": nlls})
            shown = " ".join(f"{x:.3f}" for x in nlls)
            print(f"1/{divisor} {trace['name']:<10} {condition:<22} NLL {shown}", flush=True)
    full = {r["trace"]: r["nll_turns"] for r in rows if r["condition"] == "uncompacted"}
    summary = []
    for divisor in caps:
        for condition in (c for c in CONDITIONS if c in conditions and c != "uncompacted"):
            mine = [r for r in rows if r["condition"] == condition and r["divisor"] == divisor]
            if not mine:
                continue
            per_trace = {r["trace"]: [x - y for x, y in zip(r["nll_turns"], full[r["trace"]])] for r in mine}
            deltas = [d for values in per_trace.values() for d in values]
            low, high = bootstrap(deltas, statistics.fmean)
            summary.append(
                {
                    "cap": f"1/{divisor}",
                    "condition": condition,
                    "delta_nll_turns": statistics.fmean(deltas),
                    "ci": f"[{low:+.3f}, {high:+.3f}]",
                    "per_trace": {trace: statistics.fmean(values) for trace, values in per_trace.items()},
                }
            )
    flat = [{**{k: v for k, v in r.items() if k != "per_trace"}, **r["per_trace"]} for r in summary]
    print(table(flat, list(flat[0])), flush=True)
    plot_turns(summary, RESULTS / "agent_memory_turns.png")
    print(f"saved {save('agent_memory_turns', {'caps': caps, 'turns': scored, 'summary': summary, 'rows': rows})}")


def plot_turns(summary: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = list(dict.fromkeys(r["cap"] for r in summary))
    fig, axes = plt.subplots(1, len(caps), figsize=(5 * len(caps), 4), squeeze=False)
    for ax, cap in zip(axes[0], caps):
        mine = [r for r in summary if r["cap"] == cap]
        bars(ax, mine, [r["delta_nll_turns"] for r in mine], [interval(r["ci"]) for r in mine])
        ax.set_ylabel("ΔNLL vs uncompacted (nats/token)")
        ax.set_title(f"last step groups, cap = {cap} of the trace")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--caps", type=int, nargs="+", default=[8, 4], help="cap = trace tokens / N")
    parser.add_argument("--conditions", nargs="+", default=CONDITIONS, choices=CONDITIONS)
    parser.add_argument("--traces", nargs="+", default=None)
    parser.add_argument("--replies", type=int, default=4, help="free replies per trace and condition")
    parser.add_argument("--from-saved", action="store_true", help="only summarise the rows a stopped run saved")
    parser.add_argument(
        "--update",
        action="store_true",
        help="rerun only --conditions at --caps and replace their rows in the saved results (keeping its "
        "uncompacted references and no-trace log-probabilities; with --turns, in the saved turns run)",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=None,
        metavar="K",
        help="measure only the NLL of each of the last K step groups (agent_memory_turns.json), not the facts",
    )
    args = parser.parse_args()
    if args.turns is not None and args.turns < 1:
        parser.error(f"--turns must be at least 1, got {args.turns}")
    if args.turns:
        last_turns(args.conditions, args.caps, args.turns, args.traces, args.update)
        return
    if args.update:
        update_saved(args.conditions, args.caps, args.replies)
        return
    if args.from_saved:
        saved = json.loads((RESULTS / "agent_memory.json").read_text())
        none = {(t, q): lp for t, q, lp in saved["no_trace"]}
        finish(saved["rows"], none, saved["caps"], saved["replies"], saved.get("weights", "fp32"))
        return
    engine = Engine.from_pretrained(BENCH_MODEL, kv_dtype="float32")  # the references; -kv16 / -kv8 rows: same bytes
    traces = load_traces(args.traces)
    none = {(t["name"], q): lp for t in traces for (q, _), lp in zip(t["facts"], no_trace_logprobs(engine, t))}
    lengths = {t["name"]: len(engine.session().renderer.render(t["messages"])) for t in traces}
    rows = []
    for trace in traces:  # trace by trace: a stopped run still compares every condition on the traces it did
        runs = [("uncompacted", 1)] + [(c, d) for d in args.caps for c in args.conditions if c != "uncompacted"]
        for condition, divisor in runs:
            row = replay(engine, trace, condition, lengths[trace["name"]] // divisor, args.replies)
            hits = sum(f["exact"] for f in row["facts"])
            print(
                f"1/{divisor} {trace['name']:<10} {condition:<17} NLL {row['nll_last_turn']:.3f}  "
                f"exact {hits}/{len(row['facts'])}  peak {row['peak_kv_bytes'] / 1e6:.1f} MB  {row['seconds']:.0f} s",
                flush=True,
            )
            rows.append({**row, "divisor": divisor})
            partial = {"caps": args.caps, "replies": args.replies, "rows": rows, "partial": True}
            save("agent_memory", {**partial, "no_trace": [list(k) + [v] for k, v in none.items()]})
    finish(rows, none, args.caps, args.replies, engine.weights)


if __name__ == "__main__":
    main()
