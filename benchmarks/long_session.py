"""A long agent session and its forgetting curve: how much of a fact a memory keeps, against the fact's age.

One session works through every frozen agent trace in turn (``benchmarks/agent_traces.py``: the tuning traces,
then the held-out ones), each task sent as the next user message: about 33k tokens of file reads, test runs,
logs and fixes, four times the model's 8,192 positions. It is replayed step by step, as an agent sends it,
under a cap of 1/16 of its tokens (the default 16-bit cache, so equal slots are equal bytes), and at the end
every fact of every task is asked.

The whole session cannot be the reference: the model has 8,192 positions. Each fact's reference is its own
task's messages up to and including the one that mentions it (at most 6.3k tokens), then the question: what the
model answers with the fact freshly read. *Fact gain kept* is ``(lp - lp_none) / (lp_ref - lp_none)`` over the
facts the reference helps (``lp_none``: the question after the system prompt alone), per bin of the fact's age
(the session's tokens after the message that mentions it), with 95% bootstrap intervals over facts.

``context-window`` is what an engine that holds the session verbatim remembers (llama.cpp, or an agent that trims
its history to fit): the newest messages that fit the model's 8,192 positions, less room for a question and its
answer. It needs no cap and no replay: that view depends on the history alone, so it is built once at the end.

    python -m benchmarks.long_session [--caps 16] [--conditions kvmemory-default uniform-lines context-window ...]
    python -m benchmarks.long_session --update --caps 32 --conditions kvmemory-default   # add to the saved runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.agent_memory import ask, bootstrap, gain_share, no_trace_logprobs, replay, setup
from benchmarks.agent_traces import TRACE_SETS, load_traces, trace_text
from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from benchmarks.text_memory import FullHistory
from kvmemory import Engine

CONDITIONS = ["kvmemory-default", "uniform-lines", "cc-lines", "am-lines", "tam-lines", "drop-oldest"]
CONTEXT_WINDOW = "context-window"
ANSWER_ROOM = 256  # of the model's positions, what the context window leaves for a question and its answer
AGE_BINS = 4  # quartiles of the facts' ages


def long_session(traces: list[dict]) -> tuple[dict, list[dict]]:
    """The traces as one session (each task the next user message; tool-call ids made unique), and its facts:
    those mentioned exactly once in the whole session, each with its task and the message that mentions it."""
    messages, facts = [traces[0]["messages"][0]], []
    for trace in traces:
        start = len(messages)
        messages += [with_call_ids(m, f"{trace['name']}_") for m in trace["messages"][1:]]
        for q, answer in trace["facts"]:
            at = next(i for i in range(start, len(messages)) if answer in trace_text([messages[i]]))
            facts.append({"trace": trace["name"], "question": q, "answer": answer, "task_start": start, "message": at})
    text = trace_text(messages)
    facts = [f for f in facts if text.count(f["answer"]) == 1]
    return {"name": "long", "messages": messages, "facts": [[f["question"], f["answer"]] for f in facts]}, facts


def with_call_ids(message: dict, prefix: str) -> dict:
    """A copy of ``message`` whose tool-call ids carry ``prefix`` (ids stay unique when tasks are joined)."""
    message = dict(message)
    if "tool_call_id" in message:
        message["tool_call_id"] = prefix + message["tool_call_id"]
    if message.get("tool_calls"):
        message["tool_calls"] = [{**c, "id": prefix + c["id"]} for c in message["tool_calls"]]
    return message


def reference_logprobs(engine, session: dict, facts: list[dict]) -> list[float]:
    """Each fact's answer log-probability after its task's messages up to the one mentioning it (one prefill per
    such message, the facts it mentions asked in forks)."""
    out = {}
    for at in dict.fromkeys(f["message"] for f in facts):
        mine = [f for f in facts if f["message"] == at]
        history = session["messages"][:1] + session["messages"][mine[0]["task_start"] : at + 1]
        probe = engine.session()
        probe.set_messages(history)
        asked = ask(probe, FullHistory(), history, [(f["question"], f["answer"]) for f in mine], engine.tokenizer)
        out.update({f["question"]: a["logprob"] for f, a in zip(mine, asked)})
        probe.close()
    return [out[f["question"]] for f in facts]


def ages(engine, session: dict, facts: list[dict]) -> list[int]:
    """Tokens the session holds after the message that mentions each fact."""
    render = engine.session().renderer.render
    total = len(render(session["messages"]))
    return [total - len(render(session["messages"][: f["message"] + 1])) for f in facts]


def context_window(engine, session: dict) -> dict:
    """The ``context-window`` condition's row: the newest messages that fit the model's positions (less
    ``ANSWER_ROOM``), each fact asked after them."""
    started = time.perf_counter()
    _, view, _, budget = setup(engine, "drop-oldest", engine.max_context - ANSWER_ROOM)
    shown = view.show(session["messages"])
    probe = engine.session()
    probe.set_messages(shown)
    facts = ask(probe, FullHistory(), shown, session["facts"], engine.tokenizer)
    row = {
        "trace": session["name"],
        "condition": CONTEXT_WINDOW,
        "cap": None,
        "cap_tokens": budget,
        "nll_last_turn": None,
        "peak_kv_bytes": probe.stats().kv_bytes,
        "messages_kept": len(shown),
        "facts": facts,
        "seconds": time.perf_counter() - started,
    }
    probe.close()
    return row


def label(row: dict) -> str:
    """A row's condition, with its cap when it has one (``kvmemory-default 1/16``)."""
    return row["condition"] if row["cap"] is None else f"{row['condition']} 1/{row['cap']}"


def curve(rows: list[dict], facts: list[dict]) -> list[dict]:
    """Per condition and cap, and per age bin (quartiles of the ages), the fact gain kept with its interval."""
    ordered = sorted(facts, key=lambda f: f["age"])
    size = len(ordered) / AGE_BINS
    bins = [ordered[round(i * size) : round((i + 1) * size)] for i in range(AGE_BINS)]
    out = []
    for row in rows:
        lp = {f["question"]: f["logprob"] for f in row["facts"]}
        for members in [ordered, *bins]:
            triples = [(lp[f["question"]], f["none"], f["reference"]) for f in members]
            low, high = bootstrap(triples, gain_share)
            out.append(
                {
                    "condition": row["condition"],
                    "cap": row["cap"],
                    "label": label(row),
                    "ages": "all" if members is ordered else f"{members[0]['age']}-{members[-1]['age']}",
                    "median_age": statistics.median(f["age"] for f in members),
                    "facts": len(members),
                    "fact_gain_kept": gain_share(triples),
                    "gain_ci": f"[{low:.2f}, {high:.2f}]",
                }
            )
    return out


def plot(summary: list[dict], tokens: int, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for name in dict.fromkeys(r["label"] for r in summary):
        mine = [r for r in summary if r["label"] == name and r["ages"] != "all"]
        style = "--" if mine[0]["cap"] is None else "-"
        ages, kept = [r["median_age"] / 1000 for r in mine], [r["fact_gain_kept"] for r in mine]
        ax.plot(ages, kept, style, marker="o", label=name)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xlabel("fact age: session tokens after the message that mentions it (thousands)")
    ax.set_ylabel("fact gain kept (1 = as freshly read)")
    ax.set_title(f"forgetting curve: a {tokens:,}-token agent session under a cap of 1/N of its tokens", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caps", type=int, nargs="+", default=[16], help="caps as session tokens / N")
    parser.add_argument("--conditions", nargs="+", default=[*CONDITIONS, CONTEXT_WINDOW])
    parser.add_argument("--update", action="store_true", help="add to the saved rows, replacing the same runs")
    args = parser.parse_args()
    unknown = set(args.conditions) - {*CONDITIONS, CONTEXT_WINDOW}
    if unknown:
        parser.error(f"unknown conditions {sorted(unknown)}: choose from {[*CONDITIONS, CONTEXT_WINDOW]}")
    engine = Engine.from_pretrained(BENCH_MODEL)  # the default 16-bit cache: equal slots are equal bytes
    traces = [t for name in TRACE_SETS for t in load_traces(trace_set=name)]
    session, facts = long_session(traces)
    tokens = len(engine.session().renderer.render(session["messages"]))
    saved = json.loads((RESULTS / "long_session.json").read_text()) if args.update else None
    if saved:
        facts, rows = saved["facts"], saved["rows"]
    else:
        none = {(t["name"], q): lp for t in traces for (q, _), lp in zip(t["facts"], no_trace_logprobs(engine, t))}
        for f, reference, age in zip(facts, reference_logprobs(engine, session, facts), ages(engine, session, facts)):
            f.update(none=none[(f["trace"], f["question"])], reference=reference, age=age)
        rows = []
    print(f"{len(session['messages'])} messages, {tokens:,} tokens, {len(facts)} facts, caps {args.caps}")
    out = {"tokens": tokens, "traces": [t["name"] for t in traces], "facts": facts}
    runs = [(c, None) for c in args.conditions if c == CONTEXT_WINDOW]
    runs += [(c, cap) for cap in args.caps for c in args.conditions if c != CONTEXT_WINDOW]
    for condition, cap in runs:  # saved after each: a stopped run keeps the conditions it finished
        if cap is None:
            row = context_window(engine, session)
        else:
            row = {**replay(engine, session, condition, tokens // cap, replies=0), "cap": cap}
        nll = "–" if row["nll_last_turn"] is None else f"{row['nll_last_turn']:.3f}"
        print(f"{label(row):<24} NLL {nll}  {row['seconds']:.0f} s", flush=True)
        rows = [r for r in rows if (r["condition"], r["cap"]) != (condition, cap)] + [row]
        summary = curve(rows, facts)
        plot(summary, tokens, RESULTS / "long_session.png")
        save("long_session", {**out, "summary": summary, "rows": rows})
    print(table(summary, list(summary[0])))


if __name__ == "__main__":
    main()
