"""Run the reference coding agent on a workspace, streaming its steps and its memory use.

kvmemory-agent --workspace ./myproject --task "make the tests pass" --max-slots 2048
kvmemory-agent --sample                 # on a fresh copy of the bundled sample project
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from kvmemory.agents.coding_agent.sample_project import TASK
from kvmemory.defaults import DEFAULT_MAX_SLOTS
from kvmemory.extras import MissingExtraError, require

# (LangChain, the engine and torch are imported once the command runs: ``--help`` and a missing extra answer
# at once)


def short(text: str, n: int = 160) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def protected_prompt_tokens(chat, workspace, task: str) -> int:
    """Tokens of what the default policy never compacts: system prompt with the tool schemas, and the task."""
    from langchain_core.messages import HumanMessage, SystemMessage

    from kvmemory.agents.coding_agent.agent import agent_prompt, agent_tools

    tools = agent_tools(chat, workspace)
    return chat.get_num_tokens_from_messages([SystemMessage(agent_prompt(chat)), HumanMessage(task)], tools=tools)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workspace", help="directory the agent may read, write and run commands in")
    parser.add_argument("--sample", action="store_true", help="use a fresh copy of the bundled sample project")
    parser.add_argument("--task", default=TASK)
    parser.add_argument("--model", default="default", help="HF id, local directory, .gguf file or 'default'")
    parser.add_argument("--max-slots", type=int, default=DEFAULT_MAX_SLOTS, help="KV memory cap (slots per head)")
    parser.add_argument("--max-steps", type=int, default=12, help="model calls before the agent is stopped")
    parser.add_argument("--max-new-tokens", type=int, default=384, help="the longest reply (a patch is a long call)")
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.5,
        help="lower each token a reply wrote by this times its count (greedy small models loop on a phrase)",
    )
    parser.add_argument(
        "--start-with",
        default="pytest -q",
        help="a command run before the model's first call, its output the first thing the model reads (the tests' "
        "failures ground a small model); '' to start from the task alone",
    )
    parser.add_argument("--record", default=None, help="write the run (every call and output, the tests after) as JSON")
    args = parser.parse_args(argv)
    try:
        require("agent", "kvmemory-agent")
    except MissingExtraError as err:
        parser.error(str(err))
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langgraph.checkpoint.memory import InMemorySaver

    from kvmemory import KVMemoryError
    from kvmemory.agents.coding_agent.agent import build_coding_agent
    from kvmemory.agents.coding_agent.sample_project import create_sample_project
    from kvmemory.agents.coding_agent.workspace import SandboxError, Workspace
    from kvmemory.integrations import ChatKVMemory
    from kvmemory.memory import default_policy

    if not args.workspace and not args.sample:
        parser.error("give --workspace DIR or --sample")
    if args.workspace and not Path(args.workspace).is_dir():
        parser.error(f"--workspace {args.workspace}: no such directory")
    for name in ("max_slots", "max_steps", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    root = args.workspace or create_sample_project(tempfile.mkdtemp(prefix="kvmemory-sample-"))
    try:
        workspace = Workspace(root)
    except SandboxError as err:
        parser.error(str(err))
    print(f"workspace: {root}")
    try:
        chat = ChatKVMemory.from_pretrained(
            args.model,
            policy=default_policy(max_slots=args.max_slots),
            max_new_tokens=args.max_new_tokens,
            frequency_penalty=args.frequency_penalty,
        )
    except KVMemoryError as err:
        parser.error(f"--model {args.model}: {err}")
    agent = build_coding_agent(chat, workspace, checkpointer=InMemorySaver())
    prompt = protected_prompt_tokens(chat, workspace, args.task)
    if prompt + args.max_new_tokens + 256 > args.max_slots:  # 256: the policy's recent window
        parser.error(
            f"--max-slots {args.max_slots} cannot hold the agent's protected prompt: the system prompt, the "
            f"tool schemas and the task take {prompt} tokens, plus {args.max_new_tokens} for a reply and 256 "
            f"recent tokens; use --max-slots {prompt + args.max_new_tokens + 256} or more"
        )
    # (the graph's own limit counts its nodes, middleware hooks included: the loop below counts model calls)
    config = {"configurable": {"thread_id": "cli"}, "recursion_limit": 10 * args.max_steps + 10}
    started, steps, ended = time.perf_counter(), [], "finished"
    opening = [HumanMessage(args.task)] + first_step(workspace, args.start_with)
    for msg in opening[1:]:  # (the first call is the harness's, not the model's: recorded as "start")
        kind = "start" if msg.type == "ai" else msg.type
        steps.append({"type": kind, "content": str(msg.content), **call_fields(msg)})
        print(
            f"→ {short(msg.tool_calls[0]['args'], 100)} (run before the model's first call)"
            if msg.type == "ai"
            else f"← {short(msg.content)}"
        )
    try:
        for update in agent.stream({"messages": opening}, config=config, stream_mode="updates"):
            for delta in update.values():
                for msg in (delta or {}).get("messages", []):
                    steps.append({"type": msg.type, "content": str(msg.content), **call_fields(msg)})
                    if isinstance(msg, AIMessage):
                        for call in msg.tool_calls:
                            print(f"→ {call['name']}({short(call['args'], 100)})")
                        if msg.content:
                            print(f"model: {short(msg.content)}")
                        for bad in msg.invalid_tool_calls:
                            print(f"model wrote a malformed tool call: {short(bad['error'])}")
                    elif isinstance(msg, ToolMessage):
                        print(f"← {msg.name}: {short(msg.content)}")
                        if model_calls(steps) >= args.max_steps:
                            raise StepLimit
                stats = (delta or {}).get("kvmemory")
                if stats:
                    print(
                        f"   memory: {stats['logical_tokens']} tokens in {stats['slots_per_head']} slots a head "
                        f"({stats['kv_bytes'] / 2**20:.1f} MiB, {stats['compression']:.1f}x), compactions "
                        f"{stats['compactions']}"
                    )
    except StepLimit:
        ended = "step limit"
        print(f"stopped at the step limit, after {model_calls(steps)} model calls")
    last = next((step for step in reversed(steps) if step["type"] == "ai"), None)
    if ended == "finished" and last is not None and not last.get("tool_calls"):
        ended = "no valid tool call"  # the model's last reply called nothing (a malformed call, after retries)
    tests = workspace.run_command("pytest -q")
    print(f"after the agent, pytest -q: {tests.splitlines()[-1] if tests.strip() else '(no output)'}")
    if args.record:
        session = chat.session_for("cli")
        run = {
            "model": chat.engine.name,
            "weights": chat.engine.weights,
            "max_slots": args.max_slots,
            "task": args.task,
            "ended": ended,
            "model_calls": model_calls(steps),
            "seconds": round(time.perf_counter() - started, 1),
            "tokens": session.stats().logical_tokens,
            "peak_kv_bytes": session.memory.peak_slots * chat.engine.kv_bytes_per_token,
            "tests_after": tests,
            "tests_pass": "[exit code 0]" in tests,
            "steps": steps,
        }
        Path(args.record).write_text(json.dumps(run, indent=1, ensure_ascii=False))


class StepLimit(Exception):
    """The run made ``--max-steps`` model calls (and ran the last one's tools)."""


def first_step(workspace, command: str) -> list:
    """The run of ``command`` as the conversation's first tool call and its output ([] for no command)."""
    from langchain_core.messages import AIMessage, ToolMessage

    if not command:
        return []
    call = {"name": "run_command", "args": {"command": command}, "id": "call_start", "type": "tool_call"}
    output = workspace.run_command(command)
    return [AIMessage("", tool_calls=[call]), ToolMessage(output, tool_call_id="call_start", name="run_command")]


def model_calls(steps: list[dict]) -> int:
    return sum(step["type"] == "ai" for step in steps)


def call_fields(msg) -> dict:
    """A recorded step's tool calls (model) or tool name (tool output)."""
    if msg.type == "ai":
        return {"tool_calls": [{"name": c["name"], "args": c["args"]} for c in msg.tool_calls]}
    return {"name": msg.name} if msg.type == "tool" else {}


if __name__ == "__main__":
    main()
