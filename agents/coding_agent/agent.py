"""The reference coding agent: ``create_agent`` with workspace tools, a recall tool and kvmemory middleware."""

from __future__ import annotations

from langchain.agents import create_agent
from langchain_core.tools import StructuredTool

from agents.coding_agent.scripted_session import SYSTEM_PROMPT
from agents.coding_agent.workspace import Workspace
from integrations import ChatKVMemory, KVMemoryMiddleware


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


def build_coding_agent(chat: ChatKVMemory, workspace: Workspace, checkpointer=None, compact_every: int | None = None):
    tools = workspace.tools() + [recall_tool(chat)]
    return create_agent(
        chat,
        tools=tools,
        system_prompt=SYSTEM_PROMPT,
        middleware=[KVMemoryMiddleware(compact_every=compact_every)],
        checkpointer=checkpointer,
    )
