"""A client's compaction, answered in latent space against the text summary agents write today.

An agent near its context limit compacts: Codex and Claude Code send the whole history with a "summarise
this" prompt, then start a new conversation from the summary (a full prefill of it, and the facts the summary
dropped are gone). kvmemory answers ``POST /v1/responses/compact`` on the resident session instead: it compacts
the session's KV cache and returns a compaction item that stands for the conversation; the client's next
request sends that item in place of the history, which costs no prefill.

Each frozen agent trace (``benchmarks/agent_traces.py``) is sent to a live ``kvmemory serve`` through the real
``openai`` client (the Responses API, as Codex speaks it), then compacted four ways, and every fact the trace
read once, early, is asked afterwards (greedy, exact match):

* ``full``: no compaction (the session is never compacted: ``MemoryPolicy.never()``), the upper bound;
* ``latent``: ``responses.compact`` on the session under the server's default policy (2,048 slots a head);
* ``latent-equal-bytes``: the same with the cap set to the text summary's tokens (the same KV bytes);
* ``text-summary``: the history plus a summarise prompt (the model writes the summary), then a new
  conversation that starts from it.

Per condition: the compaction turn's wall time and tokens prefilled (for the summary: writing it, then
prefilling the new conversation with it), what the session holds afterwards (slots a head), and the facts
answered. A full re-prefill of the history (a fresh session) is the yardstick for the compaction's cost.

    python -m benchmarks.context_management [--traces billing ingest] [--model default] [--summary-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import openai

from benchmarks.agent_traces import load_traces
from benchmarks.common import RESULTS, save, table
from kvmemory import Engine, MemoryPolicy, SessionStore, default_policy
from kvmemory.integrations.server import create_app, serve_in_thread

SUMMARY_PROMPT = (
    "Your context is nearly full. Write a summary of the conversation so far that lets you continue the task "
    "without it: the task, what you found, what you changed, and every name, value, setting, version, path and "
    "error you read. Be specific and complete."
)
RESTART = "This session continues an earlier one that ran out of context. Its summary:\n\n{summary}"
PROBE = "Answer from what you read, in a few words: {question}"


def input_items(messages: list[dict]) -> tuple[str, list[dict]]:
    """A trace's messages as the Responses API takes them: (instructions, input items)."""
    instructions, items = "", []
    for message in messages:
        if message["role"] == "system":
            instructions = message["content"]
        elif message["role"] == "tool":
            items.append(
                {"type": "function_call_output", "call_id": message["tool_call_id"], "output": message["content"]}
            )
        else:
            if message["content"] or not message.get("tool_calls"):
                items.append({"role": message["role"], "content": message["content"]})
            for call in message.get("tool_calls", []):
                arguments = json.dumps(call["function"]["arguments"])
                items.append(
                    {
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": arguments,
                    }
                )
    return instructions, items


class Client:
    """The ``openai`` client against the live server, timing each request and reading its usage."""

    def __init__(self, base: str):
        self.openai = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=1800)

    def create(self, key: str, items: list[dict], instructions: str, tokens: int, policy: dict | None = None):
        started = time.perf_counter()
        extra = {"kvmemory": {"policy": policy}} if policy else None
        reply = self.openai.responses.create(
            model="default",
            input=items,
            instructions=instructions or None,
            max_output_tokens=tokens,
            temperature=0,
            prompt_cache_key=key,
            extra_body=extra,
        )
        return reply, time.perf_counter() - started

    def compact(self, key: str, items: list[dict], instructions: str, policy: dict | None = None):
        started = time.perf_counter()
        extra = {"kvmemory": {"policy": policy}} if policy else None
        compacted = self.openai.responses.compact(
            model="default", input=items, instructions=instructions or None, prompt_cache_key=key, extra_body=extra
        )
        return compacted, time.perf_counter() - started


def prefilled(usage) -> int:
    return usage.input_tokens - usage.input_tokens_details.cached_tokens


def answered(reply_text: str, expected: str) -> bool:
    return expected.lower() in reply_text.lower()


def probes(client: Client, key: str, before: list[dict], instructions: str, facts, policy=None) -> list[dict]:
    """Ask each fact after ``before`` (what stands for the history), each question on its own."""
    rows = []
    for question, expected in facts:
        ask = before + [{"role": "user", "content": PROBE.format(question=question)}]
        reply, seconds = client.create(key, ask, instructions, 16, policy)
        rows.append(
            {
                "question": question,
                "expected": expected,
                "answer": reply.output_text,
                "correct": answered(reply.output_text, expected),
            }
        )
    return rows


def slots(base: str, key: str) -> int:
    import httpx

    return httpx.get(f"{base}/v1/sessions/{key}", timeout=60).json()["slots_per_head"]


def run_trace(base: str, trace: dict, summary_tokens: int) -> list[dict]:
    client, name = Client(base), trace["name"]
    instructions, items = input_items(trace["messages"])
    facts, rows = [tuple(f) for f in trace["facts"]], []
    never = MemoryPolicy.never().model_dump(mode="json")

    # the yardstick: the whole history prefilled by a fresh session
    reply, reprefill_s = client.create(f"{name}-fresh", items, instructions, 1, never)
    history_tokens = reply.usage.input_tokens

    # full: the history as it is, never compacted
    answers = probes(client, f"{name}-full", items, instructions, facts, never)
    rows.append(
        {
            "condition": "full",
            "compaction_s": 0.0,
            "compaction_prefill": 0,
            "held_slots": slots(base, f"{name}-full"),
            "answers": answers,
        }
    )

    # text summary: the model writes it from the resident history; a new conversation starts from it
    client.create(f"{name}-text", items, instructions, 1)
    ask = items + [{"role": "user", "content": SUMMARY_PROMPT}]
    summary, summary_s = client.create(f"{name}-text", ask, instructions, summary_tokens)
    restart = [{"role": "user", "content": RESTART.format(summary=summary.output_text)}]
    primed, restart_s = client.create(f"{name}-restarted", restart, instructions, 1, never)
    answers = probes(client, f"{name}-restarted", restart, instructions, facts, never)
    summary_slots = slots(base, f"{name}-restarted")
    rows.append(
        {
            "condition": "text-summary",
            "compaction_s": summary_s + restart_s,
            "compaction_prefill": prefilled(summary.usage) + prefilled(primed.usage),
            "summary_tokens": summary.usage.output_tokens,
            "held_slots": summary_slots,
            "answers": answers,
        }
    )

    # latent: the session compacts; its compaction item stands for the history
    for condition, policy in (
        ("latent", None),
        ("latent-equal-bytes", default_policy(max_slots=summary_slots, recent_tokens=32).model_dump(mode="json")),
    ):
        key = f"{name}-{condition}"
        try:
            client.create(key, items, instructions, 1, policy)
        except openai.APIStatusError as err:  # a cap the protected prompt cannot fit
            rows.append({"condition": condition, "refused": str(err)[:300]})
            print(f"{name} {condition}: refused: {err}")
            continue
        compacted, compact_s = client.compact(key, items, instructions, policy)
        mark = [item.model_dump(exclude_none=True) for item in compacted.output if item.type == "compaction"]
        answers = probes(client, key, mark, instructions, facts, policy)
        rows.append(
            {
                "condition": condition,
                "compaction_s": compact_s,
                "compaction_prefill": prefilled(compacted.usage),
                "held_slots": slots(base, key),
                "answers": answers,
            }
        )
    for row in rows:
        row.update(trace=name, history_tokens=history_tokens, reprefill_s=reprefill_s)
        if "answers" in row:
            row["correct"] = sum(a["correct"] for a in row["answers"])
            row["facts"] = len(row["answers"])
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    for condition in ("full", "text-summary", "latent", "latent-equal-bytes"):
        mine = [r for r in rows if r["condition"] == condition and "answers" in r]
        if not mine:
            continue
        out.append(
            {
                "condition": condition,
                "traces": len(mine),
                "facts_answered": sum(r["correct"] for r in mine),
                "facts": sum(r["facts"] for r in mine),
                "compaction_s": round(sum(r["compaction_s"] for r in mine), 1),
                "compaction_prefill": sum(r["compaction_prefill"] for r in mine),
                "reprefill_s": round(sum(r["reprefill_s"] for r in mine), 1),
                "cost_vs_reprefill": round(
                    sum(r["compaction_s"] for r in mine) / sum(r["reprefill_s"] for r in mine), 3
                ),
                "held_slots": round(sum(r["held_slots"] for r in mine) / len(mine)),
            }
        )
    return out


def plot(summary: list[dict], path, model: str) -> None:
    """Facts answered after the compaction, and the compaction's cost as a share of a full re-prefill."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["condition"] for s in summary]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    left.bar(names, [s["facts_answered"] / s["facts"] for s in summary], color="#4c72b0")
    left.set_ylabel("facts answered after compaction")
    left.set_ylim(0, 1)
    right.bar(names, [s["cost_vs_reprefill"] for s in summary], color="#c44e52")
    right.set_ylabel("compaction turn / full re-prefill (time)")
    for ax in (left, right):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(f"A client's compaction on {model}: latent vs text summary")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", nargs="*", default=["billing", "ingest"])
    parser.add_argument("--model", default="default")
    parser.add_argument("--summary-tokens", type=int, default=256)
    args = parser.parse_args()
    engine = Engine.from_pretrained(args.model)
    app = create_app(engine, SessionStore(engine, tempfile.mkdtemp(prefix="kvmemory-cm-")))
    rows = []
    with serve_in_thread(app) as base:
        for trace in load_traces(args.traces):
            rows += run_trace(base, trace, args.summary_tokens)
            mine = [r for r in rows if r["trace"] == trace["name"]]
            print(
                table(
                    mine, ["trace", "condition", "correct", "facts", "compaction_s", "compaction_prefill", "held_slots"]
                )
            )
    summary = summarise(rows)
    print(table(summary, list(summary[0])))
    payload = {"model": engine.name, "weights": engine.weights, "summary_tokens": args.summary_tokens}
    save("context_management", {**payload, "summary": summary, "rows": rows})
    plot(summary, RESULTS / "context_management.png", engine.name)


if __name__ == "__main__":
    main()
