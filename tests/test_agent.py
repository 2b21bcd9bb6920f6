"""The coding agent's sandbox, its scripted session, its recall tool, and the demo end to end."""

from __future__ import annotations

import os

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from agents.coding_agent.agent import build_coding_agent, recall_tool
from agents.coding_agent.sample_project import FACTS, create_sample_project
from agents.coding_agent.scripted_session import STEPS, replay
from agents.coding_agent.workspace import SandboxError, Workspace
from integrations import ChatKVMemory
from kvmemory.memory import default_policy


@pytest.fixture
def workspace(tmp_path):
    return Workspace(create_sample_project(tmp_path / "project"), command_timeout=60)


@pytest.mark.parametrize(
    "call",
    [
        lambda w: w.read_file("../outside.txt"),
        lambda w: w.read_file("/etc/passwd"),
        lambda w: w.write_file("../../evil.py", "x"),
        lambda w: w.list_files("/"),
        lambda w: w.grep("root", "/etc"),
        lambda w: w.run_command("cat /etc/passwd"),
        lambda w: w.run_command("cat ../../etc/hostname"),
        lambda w: w.run_command("rm -rf ."),
        lambda w: w.run_command("python -c 'import os; os.system(\"ls /\")'"),
        lambda w: w.run_command("curl http://example.com"),
    ],
)
def test_sandbox_escapes_are_refused(workspace, call):
    with pytest.raises(SandboxError):
        call(workspace)


def test_symlink_out_of_the_workspace_is_refused(workspace, tmp_path):
    (tmp_path / "secret.txt").write_text("secret")
    os.symlink(tmp_path / "secret.txt", workspace.root / "link.txt")
    with pytest.raises(SandboxError, match="outside the workspace"):
        workspace.read_file("link.txt")


def test_command_timeout_and_output_limit(tmp_path):
    ws = Workspace(create_sample_project(tmp_path / "p"), command_timeout=1, max_output_chars=300)
    (ws.root / "slow.py").write_text("import time\ntime.sleep(5)\n")
    assert "timed out" in ws.run_command("python slow.py")
    (ws.root / "loud.py").write_text("print('x' * 5000)\n")
    out = ws.run_command("python loud.py")
    assert "characters cut" in out and len(out) < 600


def test_tools_do_real_work(workspace):
    assert "inventory/models.py" in workspace.list_files()
    assert "DATABASE_PORT = 5433" in workspace.read_file("inventory/settings.py")
    assert "models.py" in workspace.grep("def restock")
    assert "1 failed" in workspace.run_command("pytest -q tests/test_ledger.py::test_restock") or "failed" in workspace.run_command("pytest -q")
    workspace.patch_file("inventory/models.py", "item.quantity = amount  # BUG: should add to the existing quantity", "item.quantity += amount")
    assert "[exit code 0]" in workspace.run_command("pytest -q")
    with pytest.raises(SandboxError, match="exactly one occurrence"):
        workspace.patch_file("inventory/models.py", "no such text", "x")


def test_scripted_session_runs_real_tools(workspace):
    seen = []
    messages = replay(workspace, lambda msgs: "ok", STEPS, lambda i, name, args, out, reply: seen.append((name, out)))
    assert len(STEPS) >= 30 and len(seen) == len(STEPS)
    outputs = "\n".join(out for _, out in seen)
    for _, answer in FACTS.values():
        assert answer in outputs  # every fact the questions ask about was really read
    assert any("[exit code 0]" in out for name, out in seen[21:] if name == "run_command")  # the patch fixed the bug
    assert isinstance(messages[2], AIMessage) and isinstance(messages[3], ToolMessage)


def test_recall_tool_and_agent_graph(default_engine, workspace):
    chat = ChatKVMemory(engine=default_engine, max_new_tokens=8, policy=default_policy(max_slots=4096))
    session = chat.session_for("recall")
    session.set_messages([{"role": "user", "content": "read it"},
                          {"role": "tool", "name": "read_file", "content": workspace.read_file("inventory/settings.py")},
                          {"role": "tool", "name": "read_file", "content": workspace.read_file("README.md")}])
    tool, config = recall_tool(chat), {"configurable": {"thread_id": "recall"}}
    assert "DATABASE_PORT = 5433" in tool.invoke({"n": 1}, config=config)
    assert "pick n between" in tool.invoke({"n": 5}, config=config)
    assert "Ilse Marchetti" in tool.invoke({"query": "who is the maintainer named in the README?"}, config=config)
    assert "DATABASE_PORT = 5433" in tool.invoke({"query": "database port"}, config=config)
    assert "no tool output mentions" in tool.invoke({"query": "zebra"}, config=config)
    assert "give n" in tool.invoke({}, config=config)
    agent = build_coding_agent(chat, workspace)
    out = agent.invoke({"messages": [HumanMessage("List the files.")]}, config={"configurable": {"thread_id": "agent"}, "recursion_limit": 6})
    assert out["messages"][-1].type in ("ai", "tool")


def test_demo_runs_end_to_end(default_engine, tmp_path, capsys):
    from examples.demo import main

    main(["--steps", "3", "--cap", "512", "--reply-tokens", "4", "--map", str(tmp_path / "map.png")], engine=default_engine)
    printed = capsys.readouterr().out
    assert "peak KV bytes" in printed and "answered from the compacted cache" in printed and "after recall(query=question)" in printed
    assert (tmp_path / "map.png").stat().st_size > 5000
