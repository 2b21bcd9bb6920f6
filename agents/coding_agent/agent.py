"""The reference coding agent: ``create_agent`` with workspace tools, a recall tool and kvmemory middleware."""

from __future__ import annotations

from typing import Annotated

from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import StructuredTool
from pydantic import Field

from kvmemory.agents.coding_agent.workspace import Workspace, is_test_path
from kvmemory.integrations import ChatKVMemory, KVMemoryMiddleware

AGENT_PROMPT = (
    "You are a coding agent working in a Python repository. You act only by calling tools, one call per reply.\n"
    "How to fix a failing test:\n"
    "1. run_command with pytest to see which test fails and the assertion that fails;\n"
    "2. read_file the test file, then grep for the function under test and read_file the module that defines it;\n"
    "3. patch_file that module: old is the exact buggy line, new is the fixed line. Never edit the tests: "
    "the bug is in the code they test;\n"
    "4. run_command with pytest again. When every test passes, call finish with what you fixed.\n"
    "Never repeat a call you already made: its output is above. Remember what you read (settings, names, "
    "failing tests).\n"
    "A reply that calls a tool looks like this:\n{example}"
)


def agent_prompt(chat: ChatKVMemory) -> str:
    """The agent's system prompt, its example call written in the model's own tool-call format."""
    example = chat.engine.renderer.tool_call_text("run_command", {"command": "pytest -q"})
    return AGENT_PROMPT.format(example=example)


def recall_tool(chat: ChatKVMemory) -> StructuredTool:
    """A tool that re-reads an earlier tool output in full, however much its cache was compacted."""

    def recall(n: int | None = None, query: str | None = None) -> str:
        """Return the full text of an earlier tool output: the n-th of this conversation (1 = the first),
        or the one that best matches the keywords in query."""
        thread = chat.current_thread_id({})
        session = chat.session_for(thread)
        if query is not None:
            hits = session.search(query, kinds=["tool_output"], limit=1)
            return hits[0].text if hits else f"error: no tool output mentions any of the words in {query!r}"
        if n is None:
            return "error: give n (which tool output) or query (keywords to look for)"
        outputs = [s for s in session.segments if s.kind == "tool_output"]
        if not 1 <= n <= len(outputs):
            return f"error: there are {len(outputs)} tool outputs; pick n between 1 and {len(outputs)}"
        return outputs[n - 1].text

    return StructuredTool.from_function(recall, name="recall", description=recall.__doc__)


def finish_tool() -> StructuredTool:
    """The tool that ends the agent's run: every reply calls a tool (``ToolCallsOnly``), so finishing is one."""

    def finish(summary: Annotated[str, Field(max_length=400)]) -> str:
        """Call when the task is done (every test passes): summary says what you changed and why."""
        return summary

    return StructuredTool.from_function(finish, name="finish", description=finish.__doc__, return_direct=True)


class ToolCallsOnly(AgentMiddleware):
    """Every model call must call a tool (``tool_choice="required"``: ``ChatKVMemory`` then makes the reply open
    with the model's own tool-call format and name one of the tools). A small model left free drifts into
    prose plans or invented tool names and stops; the run ends through the ``finish`` tool instead. A call that
    still comes out malformed (cut at the reply's token limit) is shown to the model with its error, and the
    model asked again, up to ``retries`` times: an agent that stopped there would end the run unfinished."""

    def __init__(self, retries: int = 2):
        super().__init__()
        self.retries = retries

    def wrap_model_call(self, request, handler):
        request = request.override(tool_choice="required")
        response = handler(request)
        for _ in range(self.retries):
            reply = response.result[-1] if response.result else None
            if not isinstance(reply, AIMessage) or reply.tool_calls or not reply.invalid_tool_calls:
                break
            error = reply.invalid_tool_calls[0].get("error") or "it is not a complete tool call"
            hint = HumanMessage(f"That tool call is not valid: {error}. Reply with one complete, shorter tool call.")
            response = handler(request.override(messages=[*request.messages, reply, hint]))
        return response


class WorkspacePaths(AgentMiddleware):
    """Before each model call, the tools that read an existing path name the workspace's paths as it is now in
    their schema (``Workspace.tools(paths_as_choices=True)``): the call is required (``ToolCallsOnly``) and its
    arguments held to the schema, so the model picks one of the real paths where a small model would invent
    ``/path/to/project``. A path whose output the model already has (read or listed since the last write) is
    not offered again, and neither is ``run_command`` once it ran since the last write (nothing it runs can
    have changed): under greedy decoding a small model otherwise asks for the same output over and over.
    ``patch_file`` is offered once a file other than a test was read since the last write (a file is patched as
    it was read; the tests are what the fix must pass, and a small model edits the failing assertion instead),
    and ``finish`` once the agent has written something and a command since its last write passed (a small
    model otherwise stops at once, or calls a failing fix done). A write that failed changed nothing and counts
    as none.
    What is offered goes in the call's ``allowed_tools`` choice, not its tool list: the prompt shows the same
    tools every call, so the session's cache keeps its prefix (a changed tool list re-renders the system prompt,
    and with it the whole conversation). The tools that run keep their plain schemas (a file written later is
    readable)."""

    READS = ("read_file", "list_files", "run_command")

    def __init__(self, workspace: Workspace):
        super().__init__()
        self.workspace = workspace

    def wrap_model_call(self, request, handler):
        seen = self.seen(request.messages)
        fresh = {t.name: t for t in self.workspace.tools(paths_as_choices=True, seen=seen)}
        tools = [fresh.get(getattr(t, "name", None), t) for t in request.tools]
        hidden = {"run_command"} if seen["run_command"] else set()
        if all(is_test_path(path) for path in seen["read_file"]):
            hidden.add("patch_file")  # a file is patched as it was read, and never a test
        if not (written(request.messages) and passed_since_last_write(request.messages)):
            hidden.add("finish")  # nothing changed yet, or the change is not shown to work: a fix is not done
        offered = [t for t in tools if getattr(t, "name", None) not in hidden]
        return handler(request.override(tool_choice={"type": "allowed_tools", "mode": "required", "tools": offered}))

    def seen(self, messages) -> dict[str, set[str]]:
        """Per read tool (and ``run_command``), the paths (commands) it was called on since the last write."""
        seen: dict[str, set[str]] = {name: set() for name in self.READS}
        for call in reversed(calls_made(messages)):
            if call["name"] in RepeatedCallGuard.WRITES:
                return seen
            if call["name"] in seen:
                seen[call["name"]].add(str(call["args"].get("path", call["args"].get("command", "."))))
        return seen


def calls_made(messages) -> list[dict]:
    """The tool calls of ``messages`` that ran, in order: a write whose tool answered with an error changed
    nothing, and is left out."""
    failed = {m.tool_call_id for m in messages if isinstance(m, ToolMessage) and str(m.content).startswith("error:")}
    calls = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
    return [c for c in calls if not (c["name"] in RepeatedCallGuard.WRITES and c["id"] in failed)]


def written(messages) -> bool:
    return any(c["name"] in RepeatedCallGuard.WRITES for c in calls_made(messages))


def passed_since_last_write(messages) -> bool:
    """Whether a command run since the last write exited 0 (the tests pass on what was written)."""
    outputs = {m.tool_call_id: str(m.content) for m in messages if isinstance(m, ToolMessage)}
    for call in reversed(calls_made(messages)):
        if call["name"] in RepeatedCallGuard.WRITES:
            return False
        if call["name"] == "run_command" and "[exit code 0]" in outputs.get(call["id"], ""):
            return True
    return False


class RepeatedCallGuard(AgentMiddleware):
    """Answers a tool call that repeats an earlier one exactly without running it: a read or a failed write with
    nothing written since (its output would be the same), or a write identical to the last write (the file holds
    it already).
    Small models under greedy decoding loop on such calls; the answer says so, which is what breaks the loop
    (SWE-agent tells its model the same about a repeated command)."""

    WRITES = ("write_file", "patch_file")

    def wrap_tool_call(self, request, handler):
        call = request.tool_call
        if self.repeats(request.state["messages"][:-1], call):
            done = "its output is above" if call["name"] not in self.WRITES else "the file holds it already"
            return ToolMessage(
                f"You already called {call['name']} with these arguments and nothing has changed since: {done}. "
                "Do not repeat it; take the next step (read the file the failure points to, patch it, or run the "
                "tests after a patch).",
                tool_call_id=call["id"],
                name=call["name"],
            )
        return handler(request)

    def repeats(self, messages, call) -> bool:
        """Whether ``call`` repeats a call made since the last write, or is the last write again. A write that
        failed changed nothing, so it counts as no write, and again it would fail the same way."""
        made = calls_made(messages)
        every = [c for m in messages if isinstance(m, AIMessage) for c in m.tool_calls]
        for earlier in reversed(every):
            same = (earlier["name"], earlier["args"]) == (call["name"], call["args"])
            if earlier["name"] in self.WRITES and earlier in made:
                return same and call["name"] in self.WRITES
            if same:
                return True
        return False


def agent_tools(chat: ChatKVMemory, workspace: Workspace) -> list:
    """The workspace's tools, recall and finish: what the agent may call."""
    return workspace.tools() + [recall_tool(chat), finish_tool()]


def build_coding_agent(chat: ChatKVMemory, workspace: Workspace, checkpointer=None, compact_every: int | None = None):
    return create_agent(
        chat,
        tools=agent_tools(chat, workspace),
        system_prompt=agent_prompt(chat),
        middleware=[
            ToolCallsOnly(),
            WorkspacePaths(workspace),
            RepeatedCallGuard(),
            KVMemoryMiddleware(compact_every=compact_every),
        ],
        checkpointer=checkpointer,
    )
