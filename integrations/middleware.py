"""KVMemoryMiddleware: per-tool compaction policies and compaction triggers for ``create_agent``.

    @kv_policy(ratio=20)          # squeeze this tool's output hard
    @tool
    def run_tests() -> str: ...

    agent = create_agent(ChatKVMemory.from_pretrained(), tools=[run_tests, read_file],
                         middleware=[KVMemoryMiddleware(tool_policies={"read_file": {"ratio": 4}})])

Rules are built from the agent's tools when a thread first calls the model and placed ahead of the chat
model's policy rules in a new policy for that thread, so each tool's output is compacted its own way.
After every model call the middleware writes the thread's memory stats into the agent state (key ``kvmemory``) and, with
``compact_every``, compacts every N model calls on top of the policy's own triggers.
"""

from __future__ import annotations

from typing import Annotated, Any, NotRequired

from langchain.agents.middleware import AgentMiddleware, AgentState
from langgraph.runtime import Runtime

from kvmemory.integrations.langgraph_node import _replace, memory_stats
from kvmemory.memory import CompactionRule, SegmentMatch

POLICY_KEY = "kvmemory_policy"


def kv_policy(**rule):
    """Decorator for a LangChain tool: how kvmemory should compact that tool's outputs (CompactionRule fields)."""

    def attach(tool):
        CompactionRule(**rule)  # fail at decoration time, not mid-run
        tool.metadata = {**(tool.metadata or {}), POLICY_KEY: rule}
        return tool

    return attach


class KVMemoryAgentState(AgentState):
    kvmemory: NotRequired[Annotated[dict, _replace]]


class KVMemoryMiddleware(AgentMiddleware):
    state_schema = KVMemoryAgentState

    def __init__(
        self,
        tool_policies: dict[str, dict | CompactionRule] | None = None,
        compact_every: int | None = None,
        chat_model=None,
    ):
        super().__init__()
        self.tool_policies = {
            k: v if isinstance(v, CompactionRule) else CompactionRule(**v) for k, v in (tool_policies or {}).items()
        }
        self.compact_every = compact_every
        self.chat_model = chat_model
        self._served: set[tuple[int, str]] = set()  # (chat model, thread) pairs given the tools' rules
        self._calls: dict[str, int] = {}

    # ---- per-tool rules ------------------------------------------------------------------------
    def _rules_for_tools(self, tools) -> list[CompactionRule]:
        rules = []
        for tool in tools or []:
            name = getattr(tool, "name", None) or (tool.get("name") if isinstance(tool, dict) else None)
            if name is None:
                continue
            rule = self.tool_policies.get(name)
            if rule is None and getattr(tool, "metadata", None) and POLICY_KEY in tool.metadata:
                rule = CompactionRule(**tool.metadata[POLICY_KEY])
            if rule is not None:
                rules.append(
                    rule.model_copy(
                        update={"name": f"tool:{name}", "match": SegmentMatch(kind="tool_output", tool=name)}
                    )
                )
        return rules

    def _install(self, model, tools) -> None:
        """Serve this call's thread with the chat model's policy plus the tools' rules (a new policy for
        the threads this middleware serves; the chat model's own policy is left as it is)."""
        if not hasattr(model, "set_thread_policy"):
            return
        self.chat_model = model
        thread = model.current_thread_id({})
        if (id(model), thread) in self._served:
            return
        rules = self._rules_for_tools(tools)
        if rules:
            model.set_thread_policy(thread, model.policy.model_copy(update={"rules": rules + model.policy.rules}))
        self._served.add((id(model), thread))

    def wrap_model_call(self, request, handler):
        self._install(request.model, request.tools)
        return handler(request)

    async def awrap_model_call(self, request, handler):
        self._install(request.model, request.tools)
        return await handler(request)

    # ---- after each model call -----------------------------------------------------------------
    def after_model(self, state: AgentState, runtime: Runtime) -> dict[str, Any] | None:
        if self.chat_model is None:
            return None
        thread = self.chat_model.current_thread_id({})
        with self.chat_model.thread(thread) as session:
            self._calls[thread] = self._calls.get(thread, 0) + 1
            if self.compact_every and self._calls[thread] % self.compact_every == 0:
                session.memory.compact(trigger="middleware")
            return {"kvmemory": memory_stats(session)}

    async def aafter_model(self, state: AgentState, runtime: Runtime) -> dict[str, Any] | None:
        import asyncio

        return await asyncio.to_thread(self.after_model, state, runtime)
