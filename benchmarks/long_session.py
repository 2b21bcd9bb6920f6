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

    python -m benchmarks.long_session [--cap 16] [--conditions kvmemory-default uniform-lines cc-lines drop-oldest]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.agent_memory import FullHistory, ask, bootstrap, gain_share, no_trace_logprobs, replay
from benchmarks.agent_traces import TRACE_SETS, load_traces, trace_text
from benchmarks.common import RESULTS, save, table
from kvmemory import Engine

CONDITIONS = ["kvmemory-default", "uniform-lines", "cc-lines", "am-lines", "tam-lines", "drop-oldest"]
AGE_BINS = 4  # quartiles of the facts' ages


def long_session(traces: list[dict]) -> tuple[dict, list[dict]]:
    """The traces as one session (each task the next user message; tool-call ids made unique), and its facts:
    those mentioned exactly once in the whole session, each with its task and the message that mentions it."""
    messages, facts = [traces[0]["messages"][0]], []
    for trace in traces:
        start = len(messages)
        for m in trace["messages"][1:]:
            m = dict(m)
            if "tool_call_id" in m:
                m["tool_call_id"] = f"{trace['name']}_{m['tool_call_id']}"
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "id": f"{trace['name']}_{c['id']}"} for c in m["tool_calls"]]
            messages.append(m)
        for q, answer in trace["facts"]:
            at = next(i for i in range(start, len(messages)) if answer in trace_text([messages[i]]))
            facts.append({"trace": trace["name"], "question": q, "answer": answer, "task_start": start, "message": at})
    text = trace_text(messages)
    facts = [f for f in facts if text.count(f["answer"]) == 1]
    return {"name": "long", "messages": messages, "facts": [[f["question"], f["answer"]] for f in facts]}, facts


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


def curve(rows: list[dict], facts: list[dict]) -> list[dict]:
    """Per condition and age bin (quartiles of the ages), the fact gain kept with its interval."""
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
                    "ages": "all" if members is ordered else f"{members[0]['age']}-{members[-1]['age']}",
                    "median_age": statistics.median(f["age"] for f in members),
                    "facts": len(members),
                    "fact_gain_kept": gain_share(triples),
                    "gain_ci": f"[{low:.2f}, {high:.2f}]",
                }
            )
    return out


def plot(summary: list[dict], tokens: int, cap: int, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for condition in dict.fromkeys(r["condition"] for r in summary):
        mine = [r for r in summary if r["condition"] == condition and r["ages"] != "all"]
        ax.plot(
            [r["median_age"] / 1000 for r in mine], [r["fact_gain_kept"] for r in mine], marker="o", label=condition
        )
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.set_xlabel("fact age: session tokens after the message that mentions it (thousands)")
    ax.set_ylabel("fact gain kept (1 = as freshly read)")
    ax.set_title(f"forgetting curve: a {tokens:,}-token agent session under a 1/{cap} cap", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cap", type=int, default=16, help="cap = session tokens / N")
    parser.add_argument("--conditions", nargs="+", default=CONDITIONS, choices=CONDITIONS)
    args = parser.parse_args()
    engine = Engine.from_pretrained("default")  # the default 16-bit cache: equal slots are equal bytes
    traces = [t for name in TRACE_SETS for t in load_traces(trace_set=name)]
    session, facts = long_session(traces)
    none = {(t["name"], q): lp for t in traces for (q, _), lp in zip(t["facts"], no_trace_logprobs(engine, t))}
    for f, reference, age in zip(facts, reference_logprobs(engine, session, facts), ages(engine, session, facts)):
        f.update(none=none[(f["trace"], f["question"])], reference=reference, age=age)
    tokens = len(engine.session().renderer.render(session["messages"]))
    print(f"{len(session['messages'])} messages, {tokens:,} tokens, {len(facts)} facts, cap {tokens // args.cap}")
    rows, out = [], {"cap": args.cap, "tokens": tokens, "traces": [t["name"] for t in traces], "facts": facts}
    for condition in args.conditions:  # saved after each: a stopped run keeps the conditions it finished
        row = replay(engine, session, condition, tokens // args.cap, replies=0)
        print(f"{condition:<16} NLL {row['nll_last_turn']:.3f}  {row['seconds']:.0f} s", flush=True)
        rows.append(row)
        summary = curve(rows, facts)
        plot(summary, tokens, args.cap, RESULTS / "long_session.png")
        save("long_session", {**out, "summary": summary, "rows": rows})
    print(table(summary, list(summary[0])))


if __name__ == "__main__":
    main()
