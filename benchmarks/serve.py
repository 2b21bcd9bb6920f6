"""A multi-turn agent conversation over HTTP: kvmemory serve with a session vs a stateless server.

A frozen agent trace (``benchmarks/agent_traces.py``) is sent turn by turn, as an agent sends its growing
message list after each tool result, to a live ``kvmemory serve`` on localhost through the ``openai``
client: once with an ``x-session-id`` (the session's cache stays resident, so a turn prefills only its new
messages) and once without (every turn re-prefills the whole history, as a server without session affinity
does). Per turn: latency and prefilled tokens (prompt tokens minus ``cached_tokens``). Then the finished
session is saved, and restoring it is timed against re-prefilling its transcript.

    python -m benchmarks.serve [--trace billing] [--reply-tokens 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import httpx
import openai

from benchmarks.agent_traces import load_traces
from benchmarks.common import BENCH_MODEL, save, table
from kvmemory import Engine, SessionStore
from kvmemory.integrations.server import create_app, serve_in_thread


def turn_messages(messages: list[dict]) -> list[list[dict]]:
    """The message list an agent sends at each model call: the history up to each tool result."""
    ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "tool"]
    return [[_openai(m) for m in messages[:end]] for end in ends]


def _openai(message: dict) -> dict:
    """A stored trace message as an OpenAI client sends it (tool-call arguments as a JSON string)."""
    if not message.get("tool_calls"):
        return message
    calls = [
        {**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
        for c in message["tool_calls"]
    ]
    return {**message, "tool_calls": calls}


def run(base: str, turns: list[list[dict]], session_id: str | None, reply_tokens: int) -> list[dict]:
    headers = {"x-session-id": session_id} if session_id else None
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", default_headers=headers, max_retries=0, timeout=600)
    rows = []
    for i, messages in enumerate(turns):
        started = time.perf_counter()
        reply = client.chat.completions.create(model="default", messages=messages, max_tokens=reply_tokens)
        seconds = time.perf_counter() - started
        cached = reply.usage.prompt_tokens_details.cached_tokens
        rows.append(
            {
                "mode": "session" if session_id else "stateless",
                "turn": i + 1,
                "prompt_tokens": reply.usage.prompt_tokens,
                "prefilled_tokens": reply.usage.prompt_tokens - cached,
                "seconds": seconds,
            }
        )
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", default="billing")
    parser.add_argument("--reply-tokens", type=int, default=8)
    args = parser.parse_args()
    engine = Engine.from_pretrained(BENCH_MODEL)
    turns = turn_messages(load_traces([args.trace])[0]["messages"])
    with tempfile.TemporaryDirectory() as folder:
        app = create_app(engine, SessionStore(engine, folder))
        with serve_in_thread(app) as base:
            rows = run(base, turns, "bench", args.reply_tokens) + run(base, turns, None, args.reply_tokens)
            httpx.post(f"{base}/v1/sessions/bench/save", timeout=600).raise_for_status()
            started = time.perf_counter()
            httpx.post(f"{base}/v1/sessions/bench/restore", timeout=600).raise_for_status()
            restore_s = time.perf_counter() - started
            tokens = len(app.state.core.store.get("bench").tokens)
        started = time.perf_counter()
        engine.session().append_tokens(app.state.core.store.get("bench").tokens)
        reprefill_s = time.perf_counter() - started
    summary = [
        {
            "mode": mode,
            "turns": len(mine),
            "prefilled_tokens": sum(r["prefilled_tokens"] for r in mine),
            "median_turn_s": statistics.median(r["seconds"] for r in mine),
            "total_s": sum(r["seconds"] for r in mine),
        }
        for mode in ("session", "stateless")
        if (mine := [r for r in rows if r["mode"] == mode])
    ]
    print(table(summary, list(summary[0])))
    restore = {"logical_tokens": tokens, "restore_s": restore_s, "reprefill_s": reprefill_s}
    restore["speedup"] = reprefill_s / restore_s
    print(table([restore], list(restore)))
    print(f"saved {save('serve', {'trace': args.trace, 'summary': summary, 'turns': rows, 'restore': restore})}")


if __name__ == "__main__":
    main()
