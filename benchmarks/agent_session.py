"""A long coding-agent session replayed under a 2,048-slot cap: kvmemory policies vs text-level baselines.

The scripted session (32 real tool calls over the sample project, their outputs recorded once by
``python -m benchmarks.agent_traces``; model-generated replies) is replayed
through a Session on the default model:
* uncompacted: every token stays in the cache (attention over the full history);
* kvmemory policies under the cap: the default policy (selective context's lines under REAL's head budgets,
  gaps closed), Attention Matching
  under REAL head budgets, SnapKV eviction (every compacted rule switched to that method, gaps kept);
* text baselines under the same token budget: drop the oldest messages; clear old tool outputs
  (placeholder, as LangChain's ContextEditingMiddleware does) and then drop the oldest if still over;
* the default policy on a cache stored in fp16 (``kvmemory-default-kv16``) under the bytes the cap costs
  in fp32, so about twice the slots.
Afterwards the session is asked about facts it read along the way: answer log-probability, its gain over the
same question asked with no session at all (the uncompacted run is no reference here: 25k tokens lie past the
model's 8,192 trained positions) and greedy exact match. Fluency: the share of degenerate replies (empty,
repetitive or off-topic, as ``benchmarks.agent_memory`` judges them) among the replies of the last eight steps
and among the answers. Reports peak KV bytes and wall time; writes a memory-map PNG of the default policy.

    python -m benchmarks.agent_session [--cap 2048] [--reply-tokens 12]
"""

from __future__ import annotations

import argparse
import json
import time

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

from benchmarks.agent_memory import degenerate, no_trace_logprobs
from benchmarks.agent_traces import trace_text
from benchmarks.common import BENCH_MODEL, RESULTS, save, table
from benchmarks.text_memory import DropOldest
from kvmemory import Engine
from kvmemory.agents.coding_agent.scripted_session import STEPS, SYSTEM_PROMPT, fact_questions, recorded_tools, replay
from kvmemory.integrations.chat_model import to_chat_dicts
from kvmemory.memory import MemoryManager, default_policy, plot_memory_map

PLACEHOLDER = "[old tool output cleared to save context]"
LATE_REPLIES = 8  # the replies judged for fluency: those of the last steps, after many compactions


def policy_with(method: str | None, cap: int, params: dict | None = None):
    """The default policy under ``cap``, its compacted rules switched to ``method`` (which keeps the gaps: a
    per-head selection would have each head's distances changed differently)."""
    policy = default_policy(max_slots=cap)
    if method is None:
        return policy
    policy.budget.close_gaps = False
    rules = [
        r if r.protected else r.model_copy(update={"method": method, "params": params or {}}) for r in policy.rules
    ]
    default = policy.default.model_copy(update={"method": method, "params": params or {}})
    return policy.model_copy(update={"rules": rules, "default": default})


def rendered_length(session, messages) -> int:
    return len(session.renderer.render(to_chat_dicts(messages), add_generation_prompt=True))


def drop_oldest(session, messages, budget: int):
    """Keep the system prompt and task, then the newest messages that fit; tool calls and results go together."""
    return DropOldest(lambda shown: rendered_length(session, shown), budget).fit(messages)


def clear_old_tool_outputs(session, messages, budget: int, keep_last: int = 2):
    tool_idx = [i for i, m in enumerate(messages) if isinstance(m, ToolMessage)]
    old = set(tool_idx[:-keep_last])
    cleared = [
        ToolMessage(PLACEHOLDER, tool_call_id=m.tool_call_id, name=m.name) if i in old else m
        for i, m in enumerate(messages)
    ]
    return drop_oldest(session, cleared, budget)


def run(
    engine,
    label: str,
    cap: int,
    reply_tokens: int,
    memory=None,
    transform=None,
    steps=STEPS,
    answer_tokens: int = 32,
    recall_tool: bool = False,
) -> list[dict]:
    """Replay the session as ``label``; with ``recall_tool`` also ask the facts a second time, each after the agent
    re-reads the tool output that best matches the question (``Session.search`` + ``Session.recall``)."""
    session = engine.session(memory=memory)
    peak = [0]

    def respond(messages):
        shown = transform(session, messages, cap) if transform else messages
        session.set_messages(to_chat_dicts(shown), add_generation_prompt=True)
        peak[0] = max(peak[0], session.cache.slots_per_head)
        text = session.generate(max_new_tokens=reply_tokens).text
        peak[0] = max(peak[0], session.cache.slots_per_head)  # the last sampled token is not in the cache yet
        return text

    def on_step(i, name, args, output, reply):
        print(
            f"  [{label}] step {i + 1:2d} {name:<11} logical {len(session.tokens):6d}  slots "
            f"{session.cache.slots_per_head:5d}",
            flush=True,
        )

    start = time.perf_counter()
    messages = replay(recorded_tools(), respond, steps, on_step)
    seconds = time.perf_counter() - start
    context = trace_text(to_chat_dicts(messages))
    late = [m.content for m in messages if isinstance(m, AIMessage) and not m.tool_calls][-LATE_REPLIES:]
    base = {
        "run": label,
        "tool_calls": len(steps),
        "history_tokens": rendered_length(session, messages),
        "compactions": session.cache.compactions,
        "seconds": seconds,
        "answer_tokens": answer_tokens,
        "late_replies": [{"text": t, "degenerate": degenerate(t, context)} for t in late],
    }
    rows = []
    for recall_first in [False, True] if recall_tool else [False]:
        recall = ask_facts(engine, session, messages, transform, cap, answer_tokens, recall_first)
        recall["answer_judgments"] = {k: degenerate(a, context) for k, a in recall["answers"].items()}
        peak_slots = max(peak[0], recall.pop("probe_peak_slots"), memory.peak_slots if memory is not None else 0)
        rows.append(
            {
                **base,
                "run": label + (" + recall tool" if recall_first else ""),
                "peak_slots": peak_slots,
                "peak_kv_bytes": peak_slots * engine.kv_bytes_per_token,
                **recall,
            }
        )
    if memory is not None and label == "kvmemory-default":
        plot_memory_map(
            memory.timeline,
            session.segments,
            RESULTS / "agent_session_memory_map.png",
            cap=cap,
            title=f"agent session under a {cap}-slot cap (default policy)",
        )
    session.close()
    return rows


def no_session_logprobs(engine) -> dict[str, float]:
    """Each answer's log-probability asked with only the system prompt: what no memory at all gives."""
    facts = fact_questions()
    alone = {"messages": to_chat_dicts([SystemMessage(SYSTEM_PROMPT)]), "facts": [(q, a) for _, q, a in facts]}
    return {key: lp for (key, _, _), lp in zip(facts, no_trace_logprobs(engine, alone))}


def fluency(row: dict) -> dict:
    """Shares of degenerate late replies and answers (rows saved before these were judged have none)."""
    if "answer_judgments" not in row:
        return {}
    replies = [r["degenerate"] for r in row["late_replies"]]
    answers = list(row["answer_judgments"].values())
    return {
        "degenerate_replies": sum(r is not None for r in replies) / len(replies),
        "degenerate_answers": sum(a is not None for a in answers) / len(answers),
    }


def ask_facts(engine, session, messages, transform, cap, answer_tokens: int, recall_first: bool = False):
    """Ask each fact question in a fork of the finished session (under the same memory manager and cap).

    ``recall_first``: before the question, re-insert the tool output whose transcript text best matches it,
    as an agent calling the recall tool would."""
    tok = engine.tokenizer
    logps, hits, answers, peak = {}, 0, {}, 0
    for key, question, answer in fact_questions():
        probe = session.fork(with_memory=True)
        asked = messages + [HumanMessage(f"{question} Answer with the value only.")]
        if recall_first:
            probe.set_messages(to_chat_dicts(messages))
            found = probe.search(question, kinds=["tool_output"], limit=1)
            if found:
                probe.recall(found[0].id)
            probe.append_messages(to_chat_dicts(asked[-1:]), add_generation_prompt=True)
        else:
            shown = transform(probe, asked, cap) if transform else asked
            probe.set_messages(to_chat_dicts(shown), add_generation_prompt=True)
        logps[key] = float(probe.logprobs(tok.encode(answer, add_special_tokens=False)).sum())
        text = probe.generate(max_new_tokens=answer_tokens).text
        peak = max(peak, probe.cache.slots_per_head, probe.memory.peak_slots if probe.memory is not None else 0)
        answers[key] = text.strip()
        hits += answer.lower() in text.lower()
        probe.close()
    return {
        "answer_logprob": sum(logps.values()) / len(logps),
        "answer_logprobs": logps,
        "exact_match": hits / len(logps),
        "answers": answers,
        "probe_peak_slots": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cap", type=int, default=2048)
    parser.add_argument("--reply-tokens", type=int, default=12)
    parser.add_argument(
        "--answer-tokens",
        type=int,
        default=32,
        help="greedy tokens per fact answer (the model answers in a sentence, the value comes late)",
    )
    parser.add_argument("--steps", type=int, default=len(STEPS), help="replay only the first N tool calls")
    parser.add_argument(
        "--runs",
        nargs="+",
        default=[
            "uncompacted",
            "kvmemory-default",
            "kvmemory-am-real",
            "kvmemory-snapkv",
            "text-drop-oldest",
            "text-clear-tool-outputs",
            "kvmemory-default-kv16",
        ],
    )
    args = parser.parse_args()
    base = Engine.from_pretrained(BENCH_MODEL, kv_dtype="float32")  # the cap's bytes; kvmemory-default-kv16: fp16
    unbounded = Engine(base.model, base.tokenizer, name=base.name, max_context=4 * base.config.max_position_embeddings)
    kv16 = Engine(base.model, base.tokenizer, name=base.name, kv_dtype="float16")
    kv16_cap = args.cap * base.kv_bytes_per_token // kv16.kv_bytes_per_token  # the slots the same bytes hold
    configs = {
        "uncompacted": (unbounded, None, None),
        "kvmemory-default": (base, lambda: MemoryManager(policy_with(None, args.cap)), None),
        "kvmemory-am-real": (
            base,
            lambda: MemoryManager(policy_with("real", args.cap, {"inner": "attention_matching"})),
            None,
        ),
        "kvmemory-snapkv": (base, lambda: MemoryManager(policy_with("snapkv", args.cap)), None),
        "text-drop-oldest": (base, None, drop_oldest),
        "text-clear-tool-outputs": (base, None, clear_old_tool_outputs),
        "kvmemory-default-kv16": (kv16, lambda: MemoryManager(policy_with(None, kv16_cap)), None),
    }
    no_session = no_session_logprobs(base)
    print(f"no session: answer log-probability {sum(no_session.values()) / len(no_session):.2f}", flush=True)
    for label in args.runs:
        engine, memory, transform = configs[label]
        print(f"run {label}", flush=True)
        mine = run(
            engine,
            label,
            args.cap,
            args.reply_tokens,
            memory() if memory else None,
            transform,
            STEPS[: args.steps],
            args.answer_tokens,
            recall_tool=label == "kvmemory-default",
        )
        print(
            table(mine, ["run", "peak_slots", "peak_kv_bytes", "answer_logprob", "exact_match", "seconds"]), flush=True
        )
        result = save_rows(mine, label, list(configs), args, no_session)  # after every run: a later crash keeps it
    print()
    print(table(result["rows"], COLUMNS))
    print(f"saved {RESULTS / 'agent_session.json'}")


COLUMNS = [
    "run",
    "history_tokens",
    "peak_slots",
    "peak_kv_bytes",
    "peak_kv_vs_uncompacted",
    "compactions",
    "answer_logprob",
    "gain_over_no_session",
    "exact_match",
    "degenerate_replies",
    "degenerate_answers",
    "seconds",
]


def config_of(row: dict) -> str:
    """The run a row comes from ("kvmemory-default + recall tool" from "kvmemory-default")."""
    return row["run"].split(" + ")[0]


def save_rows(rows: list[dict], label: str, configs: list[str], args, no_session: dict) -> dict:
    """Save the rows of run ``label`` in place of its saved ones, beside the saved rows of every other run of
    the same cap and steps."""
    previous = RESULTS / "agent_session.json"
    if previous.is_file():
        old = json.loads(previous.read_text())
        if old.get("cap") == args.cap and old.get("steps") == args.steps:
            rows = [r for r in old["rows"] if config_of(r) != label and config_of(r) in configs] + rows
    rows.sort(key=lambda r: configs.index(config_of(r)))  # stable: a recall row stays after its run
    full = next((r for r in rows if r["run"] == "uncompacted"), None)
    none = sum(no_session.values()) / len(no_session)
    for r in rows:
        r["gain_over_no_session"] = r["answer_logprob"] - none
        r.update(fluency(r))
        if full:
            r["peak_kv_vs_uncompacted"] = r["peak_kv_bytes"] / full["peak_kv_bytes"]
    result = {
        "cap": args.cap,
        "reply_tokens": args.reply_tokens,
        "steps": args.steps,
        "late_replies": LATE_REPLIES,
        "no_session_logprobs": no_session,
        "rows": rows,
    }
    save("agent_session", result)
    return result


if __name__ == "__main__":
    main()
