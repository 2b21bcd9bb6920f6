"""The coding agent's sandbox, its scripted session, its recall tool, and the demo end to end."""

from __future__ import annotations

import fcntl
import os
import re
from functools import partial

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

from kvmemory.agents.coding_agent.agent import build_coding_agent, recall_tool
from kvmemory.agents.coding_agent.sample_project import FACTS, create_sample_project
from kvmemory.agents.coding_agent.scripted_session import STEPS, replay, run_tool
from kvmemory.agents.coding_agent.workspace import SandboxError, Workspace
from kvmemory.integrations import ChatKVMemory
from kvmemory.memory import default_policy
from tests.conftest import missing, wait_until


@pytest.fixture
def workspace(tmp_path):
    return Workspace(create_sample_project(tmp_path / "project"), command_timeout=60)


SECRET = "TOPSECRET-4242"


@pytest.fixture
def outside(tmp_path):
    """A directory next to the workspace holding a secret, and a link to it from inside the workspace."""
    path = tmp_path / "outside"
    path.mkdir()
    (path / "secret").write_text(SECRET + "\n")
    return path


@pytest.mark.sandbox
def test_file_tools_refuse_paths_out_of_the_workspace(workspace):
    for call in (
        lambda w: w.read_file("../outside.txt"),
        lambda w: w.read_file("/etc/passwd"),
        lambda w: w.write_file("../../evil.py", "x"),
        lambda w: w.list_files("/"),
        lambda w: w.grep("root", "/etc"),
        lambda w: w.run_command("rm -rf ."),
        lambda w: w.run_command("curl http://example.com"),
    ):
        with pytest.raises(SandboxError):
            call(workspace)


@pytest.mark.sandbox
@pytest.mark.parametrize(
    "command",
    [
        "python -Ic \"print(open('{secret}').read())\"",
        "cat {secret}",
        "diff --from-file={secret} README.md",
        "cat link/secret",
        "cat secret_link",
        "find . -name secret -exec cat {{}} ;",
        "find -L . -name secret -exec cat {{}} ;",
        "grep -r TOPSECRET .",
        "grep -R TOPSECRET .",
        "head -c 100 /etc/shadow",
        "python -c \"import os; print(os.listdir('/root'), os.listdir('/work'))\"",
    ],
)
def test_commands_cannot_read_outside_the_workspace(workspace, outside, command):
    os.symlink(outside, workspace.root / "link")
    os.symlink(outside / "secret", workspace.root / "secret_link")
    out = workspace.run_command(command.format(secret=outside / "secret"))
    assert SECRET not in out and "[exit code 0]\n[" not in out


@pytest.mark.sandbox
def test_commands_cannot_write_outside_the_workspace(workspace, outside):
    os.symlink(outside, workspace.root / "link")
    workspace.run_command(f"sort -o{outside / 'written'} README.md")
    workspace.run_command("sort -olink/written2 README.md")
    workspace.run_command(f"python -c \"open('{outside / 'written3'}', 'w').write('x')\"")
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]


@pytest.mark.sandbox
def test_commands_have_no_network(workspace):
    import socket

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        out = workspace.run_command(
            f"python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); "
            "print('CONN' + 'ECTED')\""
        )
    finally:
        server.close()
    assert "CONNECTED" not in out and "exit code 1" in out


@pytest.mark.sandbox
def test_file_tools_never_follow_a_link_out(workspace, outside):
    os.symlink(outside, workspace.root / "link")
    os.symlink(outside / "secret", workspace.root / "secret_link")
    with pytest.raises(SandboxError, match="outside the workspace"):
        workspace.read_file("secret_link")
    with pytest.raises(SandboxError, match="outside the workspace"):
        workspace.patch_file("link/secret", SECRET, "x")
    assert SECRET not in workspace.grep("TOPSECRET")
    assert "secret" not in workspace.list_files().replace("secret_link", "")


@pytest.mark.sandbox
def test_time_out_kills_every_process_the_command_started(tmp_path):
    """A grandchild in a session of its own holds a lock while it lives: once the command has timed out, the
    lock is free (it was killed), where it would otherwise be held for ten minutes."""
    ws = Workspace(create_sample_project(tmp_path / "p"), command_timeout=3, max_output_chars=300)
    (ws.root / "spawn.py").write_text(
        "import os, subprocess, sys, time\n"
        'holder = \'import fcntl, time; f = open("held", "w"); fcntl.flock(f, fcntl.LOCK_EX); '
        'open("started", "w").close(); time.sleep(600)\'\n'
        "subprocess.Popen([sys.executable, '-c', holder], start_new_session=True)\n"
        "while not os.path.exists('started'):\n"
        "    time.sleep(0.01)\n"
        "time.sleep(600)\n"
    )
    assert "timed out" in ws.run_command("python spawn.py")
    assert (ws.root / "started").exists()  # the grandchild ran and took the lock
    with open(ws.root / "held") as held:
        wait_until(lambda: _try_lock(held), timeout=30, what="the grandchild's lock to be released")


def _try_lock(file) -> bool:
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@pytest.mark.sandbox
def test_command_timeout_and_output_limit(tmp_path):
    project = create_sample_project(tmp_path / "p")
    quick = Workspace(project, command_timeout=1)
    (quick.root / "slow.py").write_text("import time\ntime.sleep(600)\n")
    assert "timed out" in quick.run_command("python slow.py")
    ws = Workspace(project, command_timeout=60, max_output_chars=300)  # room for a slow start under load
    (ws.root / "loud.py").write_text("print('x' * 5000)\n")
    out = ws.run_command("python loud.py")
    assert "characters cut" in out and len(out) < 600
    (ws.root / "hog.py").write_text("x = bytearray(8 << 30)\n")
    assert "MemoryError" in ws.run_command("python hog.py")


@pytest.mark.sandbox
def test_grep_has_a_time_limit_and_binary_files_get_a_clear_message(workspace):
    (workspace.root / "long.txt").write_text("a" * 30 + "!\n")
    out_or_error = None
    try:
        out_or_error = workspace.grep("(a+)+$", ".")
    except SandboxError as err:
        out_or_error = str(err)
    # finished: PCRE's backtracking limit, the time limit, or an answer; never hung
    assert re.search(r"backtracking limit|grep stopped after|long.txt|no matches", out_or_error), out_or_error
    (workspace.root / "blob.bin").write_bytes(b"\x00\xff\xfe binary")
    with pytest.raises(SandboxError, match="binary file"):
        workspace.read_file("blob.bin")
    with pytest.raises(SandboxError, match="binary file"):
        workspace.patch_file("blob.bin", "binary", "x")
    assert "blob.bin" not in workspace.grep("binary")


@pytest.mark.sandbox
def test_tools_do_real_work(workspace):
    assert "inventory/models.py" in workspace.list_files()
    assert "DATABASE_PORT = 5433" in workspace.read_file("inventory/settings.py")
    assert "models.py" in workspace.grep("def restock")
    assert "1 failed" in workspace.run_command(
        "pytest -q tests/test_ledger.py::test_restock"
    ) or "failed" in workspace.run_command("pytest -q")
    workspace.patch_file(
        "inventory/models.py",
        "item.quantity = amount  # BUG: should add to the existing quantity",
        "item.quantity += amount",
    )
    assert "[exit code 0]" in workspace.run_command("pytest -q")
    with pytest.raises(SandboxError, match="exactly one occurrence"):
        workspace.patch_file("inventory/models.py", "no such text", "x")
    with pytest.raises(SandboxError, match="the old text is in inventory/settings.py: patch that file"):
        workspace.patch_file("inventory/models.py", "DATABASE_PORT = 5433", "DATABASE_PORT = 1")


@pytest.mark.sandbox
def test_a_line_patched_without_its_indentation_keeps_it(workspace):
    old = 'raise ValueError("restock amount must be positive")'
    workspace.patch_file("inventory/models.py", old, '    log("refused")\n    raise ValueError("not positive")')
    text = (workspace.root / "inventory/models.py").read_text()
    assert '        if amount <= 0:\n            log("refused")\n            raise ValueError("not positive")\n' in text


@pytest.mark.sandbox
def test_the_agent_starts_from_a_real_run_of_the_tests(workspace):
    from kvmemory.agents.coding_agent.cli import first_step

    call, output = first_step(workspace, "pytest -q")
    assert call.tool_calls[0]["args"] == {"command": "pytest -q"} and output.tool_call_id == call.tool_calls[0]["id"]
    assert "2 failed, 7 passed" in output.content and "restocking WX-4471 by 10 from 8 gave 10" in output.content
    assert first_step(workspace, "") == []


@pytest.mark.sandbox
def test_scripted_session_runs_real_tools(workspace):
    seen = []

    def on_step(i, name, args, out, reply):
        seen.append((name, out))

    messages = replay(partial(run_tool, workspace), lambda msgs: "ok", STEPS, on_step)
    assert len(STEPS) >= 30 and len(seen) == len(STEPS)
    outputs = "\n".join(out for _, out in seen)
    for _, answer in FACTS.values():
        assert answer in outputs  # every fact the questions ask about was really read
    assert any("[exit code 0]" in out for name, out in seen[21:] if name == "run_command")  # the patch fixed the bug
    assert isinstance(messages[2], AIMessage) and isinstance(messages[3], ToolMessage)


@pytest.mark.sandbox
def test_a_repeated_call_is_answered_without_running_it():
    """A read repeated with nothing written since, or the last write again, gets a message instead of running;
    a read after a write, or a different write, runs."""
    from langchain.agents.middleware import ToolCallRequest

    from kvmemory.agents.coding_agent.agent import RepeatedCallGuard

    def call(name: str, **args) -> dict:
        return {"name": name, "args": args, "id": f"c{len(args)}", "type": "tool_call"}

    def outcome(history: list, made: dict) -> str:
        messages = [AIMessage("", tool_calls=[c]) for c in history] + [AIMessage("", tool_calls=[made])]
        request = ToolCallRequest(tool_call=made, tool=None, state={"messages": messages}, runtime=None)
        answer = RepeatedCallGuard().wrap_tool_call(request, lambda _: ToolMessage("ran", tool_call_id="x"))
        return "ran" if answer.content == "ran" else "refused"

    read, write = call("read_file", path="a.py"), call("write_file", path="a.py", content="x = 1")
    assert outcome([read], read) == "refused"
    assert outcome([read, write], read) == "ran"  # the file may have changed
    assert outcome([write], write) == "refused"  # the file holds it already
    assert outcome([write, read], write) == "refused"
    assert outcome([write], call("write_file", path="a.py", content="x = 2")) == "ran"
    assert outcome([write, call("patch_file", path="a.py", old="1", new="2")], write) == "ran"
    patch = call("patch_file", path="a.py", old="absent", new="2")
    failed = ToolMessage("error: expected exactly one occurrence", tool_call_id=patch["id"])
    history = [AIMessage("", tool_calls=[patch]), failed, AIMessage("", tool_calls=[patch])]
    request = ToolCallRequest(tool_call=patch, tool=None, state={"messages": history}, runtime=None)
    again = RepeatedCallGuard().wrap_tool_call(request, lambda _: ToolMessage("ran", tool_call_id="x"))
    assert again.content.startswith("You already called patch_file")  # it would fail the same way


def test_a_read_whose_output_the_model_has_is_not_offered_again(workspace):
    from langchain.agents.middleware import ModelRequest

    from kvmemory.agents.coding_agent.agent import WorkspacePaths, finish_tool

    def call(name: str, id: str = "c", **args) -> AIMessage:
        return AIMessage("", tool_calls=[{"name": name, "args": args, "id": id, "type": "tool_call"}])

    def tools_offered(messages) -> dict:
        seen = WorkspacePaths(workspace).seen(messages)
        return {t.name: t for t in workspace.tools(paths_as_choices=True, seen=seen)}

    def read_choices(messages) -> list[str]:
        return tools_offered(messages)["read_file"].args["path"]["enum"]

    assert "inventory/models.py" in read_choices([])
    assert list(tools_offered([])["read_file"].args) == ["path"]  # whole files
    read = call("read_file", path="inventory/models.py")
    assert "inventory/models.py" not in read_choices([read]) and "README.md" in read_choices([read])
    tools = tools_offered([read])
    assert tools["patch_file"].args["path"]["enum"] == ["inventory/models.py"]  # patched as it was read
    lines = tools["patch_file"].args["old"]["enum"]  # its old text: a line of the file, copied
    assert "item.quantity = amount  # BUG: should add to the existing quantity" in lines
    assert "return item" not in lines  # it recurs: a patch of it would be refused
    patched = call("patch_file", path="inventory/models.py", old="a", new="b")
    assert "inventory/models.py" in read_choices([read, patched])  # written since: worth reading again
    everything = [call("read_file", path=p) for p in workspace.files()]
    assert read_choices(everything) == workspace.files()  # all read: every path is offered again

    every = [*workspace.tools(), finish_tool()]

    def offered(messages) -> list[str]:
        seen = []

        def model(request):
            assert request.tools == every  # the prompt's tools stay the same: the cached prefix is kept
            assert request.tool_choice["type"] == "allowed_tools" and request.tool_choice["mode"] == "required"
            seen.extend(t.name for t in request.tool_choice["tools"])

        WorkspacePaths(workspace).wrap_model_call(
            ModelRequest(model=None, messages=messages, tools=every, state={}, tool_choice="required"), model
        )
        return seen

    tests = call("run_command", command="pytest -q")
    assert "run_command" in offered([]) and "run_command" not in offered([tests])  # nothing can have changed
    assert "run_command" in offered([tests, patched])  # a patch since: worth running again
    rerun = call("run_command", id="r", command="pytest -q")
    passed, failing = (ToolMessage(f"$ pytest -q\n[exit code {code}]", tool_call_id="r") for code in (0, 1))
    assert "finish" not in offered([tests]) and "finish" not in offered([tests, patched])  # not shown to work
    assert "finish" not in offered([tests, patched, rerun, failing])
    assert "finish" in offered([tests, patched, rerun, passed])  # done once the tests pass on the change
    assert "patch_file" not in offered([tests]) and "patch_file" in offered([tests, read])  # patched as read
    assert "patch_file" not in offered([tests, call("read_file", path="tests/test_ledger.py")])  # never a test
    failed = ToolMessage("error: expected exactly one occurrence", tool_call_id="c")  # (the calls' id)
    assert "run_command" not in offered([tests, patched, failed])  # a failed patch changed nothing


def test_a_malformed_call_is_shown_to_the_model_and_asked_again():
    from langchain.agents.middleware import ModelRequest, ModelResponse

    from kvmemory.agents.coding_agent.agent import ToolCallsOnly

    cut = AIMessage(
        "",
        invalid_tool_calls=[
            {"type": "invalid_tool_call", "name": None, "args": '{"na', "id": None, "error": "not valid JSON"}
        ],
    )
    good = AIMessage("", tool_calls=[{"name": "finish", "args": {"summary": "done"}, "id": "c1", "type": "tool_call"}])
    seen = []

    def handler(request):
        seen.append(request)
        return ModelResponse(result=[cut if len(seen) == 1 else good])

    request = ModelRequest(model=None, messages=[HumanMessage("fix it")], tool_choice=None, tools=[], state={})
    assert ToolCallsOnly().wrap_model_call(request, handler).result == [good]
    assert [r.tool_choice for r in seen] == ["required", "required"]
    assert seen[1].messages[1] is cut and "not valid JSON" in seen[1].messages[2].content
    always_cut = ToolCallsOnly(retries=2).wrap_model_call(request, lambda r: ModelResponse(result=[cut]))
    assert always_cut.result == [cut]  # after its retries the malformed reply stands (the run then ends)


def test_recall_tool_and_agent_graph(small_engine, workspace):
    chat = ChatKVMemory(engine=small_engine, max_new_tokens=8, policy=default_policy(max_slots=4096))
    session = chat.session_for("recall")
    session.set_messages(
        [
            {"role": "user", "content": "read it"},
            {"role": "tool", "name": "read_file", "content": workspace.read_file("inventory/settings.py")},
            {"role": "tool", "name": "read_file", "content": workspace.read_file("README.md")},
        ]
    )
    tool, config = recall_tool(chat), {"configurable": {"thread_id": "recall"}}
    assert "DATABASE_PORT = 5433" in tool.invoke({"n": 1}, config=config)
    assert "pick n between" in tool.invoke({"n": 5}, config=config)
    assert "Ilse Marchetti" in tool.invoke({"query": "who is the maintainer named in the README?"}, config=config)
    assert "DATABASE_PORT = 5433" in tool.invoke({"query": "database port"}, config=config)
    assert "no tool output mentions" in tool.invoke({"query": "zebra"}, config=config)
    assert "give n" in tool.invoke({}, config=config)
    agent = build_coding_agent(chat, workspace)
    out = agent.invoke(
        {"messages": [HumanMessage("List the files.")]},
        config={"configurable": {"thread_id": "agent"}, "recursion_limit": 6},
    )
    messages = out["messages"]
    assert messages[0].content == "List the files." and isinstance(messages[-1], AIMessage)
    for i, message in enumerate(messages):  # every tool result answers a call of the AI message before it
        if isinstance(message, ToolMessage):
            calls = next(m for m in reversed(messages[:i]) if isinstance(m, AIMessage)).tool_calls
            assert message.tool_call_id in {c["id"] for c in calls}
    held = chat.session_for("agent").messages
    assert any(m["role"] == "user" and m["content"] == "List the files." for m in held)
    assert held[-1]["role"] == "assistant" and messages[-1].content.strip() in held[-1]["content"]


@pytest.mark.parametrize("sandbox", ["bubblewrap", "missing"])
def test_demo_runs_end_to_end(small_engine, tmp_path, capsys, monkeypatch, sandbox):
    from examples.demo import main

    if sandbox == "missing":  # no bwrap on PATH: the demo says so and replays recorded outputs
        monkeypatch.setenv("PATH", str(tmp_path))
    elif missing("sandbox"):
        pytest.skip(missing("sandbox"))
    main(
        ["--steps", "3", "--cap", "512", "--reply-tokens", "4", "--map", str(tmp_path / "map.png")],
        engine=small_engine,
    )
    printed = capsys.readouterr().out
    assert (
        "peak KV bytes" in printed
        and "answered from the compacted cache" in printed
        and "after recall(query=question)" in printed
    )
    assert ("replays the tool outputs of a sandboxed run" in printed) == (sandbox == "missing")
    assert (tmp_path / "map.png").stat().st_size > 5000
