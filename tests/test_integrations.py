"""LangChain / LangGraph integration on the default model (few tokens per call) and with a fake model."""

from __future__ import annotations

import asyncio

import pytest
from langchain.agents import create_agent
from langchain_core.exceptions import ContextOverflowError
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from kvmemory.integrations import ChatKVMemory, CompactionNode, KVMemoryMiddleware, KVMemoryState, kv_policy
from kvmemory.integrations.serving import Reply
from kvmemory.memory import CompactionRule, MemoryBudget, MemoryPolicy, default_policy
from tests.conftest import until


@tool
def lookup_port(service: str) -> str:
    """Look up the network port of a service."""
    return f"{service} listens on port 5433"


@kv_policy(ratio=10)
@tool
def run_tests() -> str:
    """Run the test suite."""
    return "FAILED tests/test_ledger.py::test_restock - assert 10 == 18\n1 failed, 8 passed"


@pytest.fixture
def chat(small_engine):
    return ChatKVMemory(engine=small_engine, max_new_tokens=6, policy=default_policy(max_slots=4096))


def config(thread):
    return {"configurable": {"thread_id": thread}}


def test_invoke_reports_usage_and_reuses_the_cache(chat):
    msgs = [SystemMessage("You are terse."), HumanMessage("Name a colour.")]
    first = chat.invoke(msgs, config=config("a"))
    assert isinstance(first, AIMessage) and first.usage_metadata["output_tokens"] > 0
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    second = chat.invoke(msgs + [first, HumanMessage("Another one.")], config=config("a"))
    reused = second.usage_metadata["input_token_details"]["cache_read"]
    assert reused >= first.usage_metadata["input_tokens"]  # the whole first turn came from the cache


def test_threads_are_isolated(chat):
    chat.invoke([HumanMessage("Say one word about cats.")], config=config("cats"))
    chat.invoke([HumanMessage("Say one word about the sea.")], config=config("sea"))
    cats = chat.session_for("cats")
    sea = chat.session_for("sea")
    assert cats is not sea
    assert "cats" in cats.messages[0]["content"] and "sea" in sea.messages[0]["content"]


def test_stream_yields_several_chunks(chat):
    chunks = list(chat.stream([HumanMessage("Count from one to five.")], config=config("s")))
    assert len(chunks) >= 3
    assert chunks[-1].usage_metadata["output_tokens"] > 0


async def test_astream_and_ainvoke(chat):
    chunks = [c async for c in chat.astream([HumanMessage("Count to three.")], config=config("as"))]
    assert len(chunks) >= 2
    msg = await chat.ainvoke([HumanMessage("Count to three.")], config=config("as2"))
    assert msg.content == "".join(c.content for c in chunks)


def test_tool_call_round_trip_reuses_the_cache(chat):
    bound = chat.bind_tools([lookup_port])
    history = [HumanMessage("Which port does the database use?")]
    call = AIMessage("", tool_calls=[{"name": "lookup_port", "args": {"service": "database"}, "id": "call_1"}])
    result = ToolMessage("database listens on port 5433", tool_call_id="call_1", name="lookup_port")
    bound.invoke(history, config=config("tools"))
    session = chat.session_for("tools")
    rendered = session.renderer.render(session.messages, [convert_to_openai_tool(lookup_port)])
    assert "lookup_port" in chat.engine.tokenizer.decode(rendered)  # the schema reached the prompt
    answer = bound.invoke(history + [call, result], config=config("tools"))
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0
    tool_segment = [s for s in session.segments if s.kind == "tool_output"]
    assert tool_segment and tool_segment[0].tool_name == "lookup_port" and "5433" in tool_segment[0].text


def test_allowed_tools_narrow_a_required_call_and_keep_the_cached_prefix(chat):
    """``tool_choice`` allowed_tools: the reply calls one of the allowed tools, its arguments held to the narrower
    schema given with it, while the prompt shows every bound tool, so a turn that allows other tools still
    prefills only what is new."""
    narrowed = convert_to_openai_tool(lookup_port)
    narrowed["function"]["parameters"]["properties"]["service"]["enum"] = ["billing-db"]
    history = [HumanMessage("Which port does the database use?")]

    def allowing(*tools):
        choice = {"type": "allowed_tools", "mode": "required", "tools": list(tools)}
        return chat.bind_tools([lookup_port, run_tests], tool_choice=choice, max_new_tokens=64)

    first = allowing(narrowed).invoke(history, config=config("allowed"))
    assert first.tool_calls[0]["name"] == "lookup_port" and first.tool_calls[0]["args"] == {"service": "billing-db"}
    result = ToolMessage("billing-db listens on port 5433", tool_call_id=first.tool_calls[0]["id"])
    second = allowing("run_tests").invoke(history + [first, result], config=config("allowed"))
    assert second.tool_calls[0]["name"] == "run_tests"
    tools = [convert_to_openai_tool(t) for t in (lookup_port, run_tests)]
    held = len(chat.engine.render_chat([{"role": "user", "content": history[0].content}], tools, False))
    # (a changed tool list would re-render the system prompt and read nothing from the cache)
    assert second.usage_metadata["input_token_details"]["cache_read"] > 0.9 * held
    with pytest.raises(ValueError, match="mode 'auto' is not supported"):
        chat.bind_tools([lookup_port], tool_choice={"type": "allowed_tools", "mode": "auto", "tools": ["lookup_port"]})
    with pytest.raises(ValueError, match="none of the tools"):
        chat.bind_tools([lookup_port], tool_choice={"type": "allowed_tools", "tools": ["run_tests"]})


def test_tool_call_parsing_and_malformed_output(chat):
    def reply(text: str) -> Reply:
        return Reply.read(text, "stop", None, 10, 0, 5, [], None)

    ok = chat._final_message(
        reply('Checking.<tool_call>{"name": "lookup_port", "arguments": {"service": "db"}}</tool_call>'), chunk=False
    )
    assert ok.tool_calls[0]["name"] == "lookup_port" and ok.tool_calls[0]["args"] == {"service": "db"}
    assert ok.content == "Checking."
    malformed = '<tool_call>{"name": "lookup_port", "arguments": {service: db}}</tool_call>'
    bad = chat._final_message(reply(malformed), chunk=False)
    assert not bad.tool_calls and bad.invalid_tool_calls
    assert "not valid JSON" in bad.invalid_tool_calls[0]["error"]
    assert bad.invalid_tool_calls[0]["args"] == '{"name": "lookup_port", "arguments": {service: db}}'  # what it wrote


def test_context_overflow_is_a_langchain_error(small_engine):
    chat = ChatKVMemory(engine=small_engine, max_new_tokens=2)
    with pytest.raises(ContextOverflowError, match="cap of 2048|positions"):
        chat.invoke([HumanMessage("word " * 9000)], config=config("big"))
    assert chat.get_num_tokens_from_messages([HumanMessage("hello there")]) > 2


def test_stategraph_with_compaction_node_and_checkpointer(chat):
    graph = StateGraph(KVMemoryState)
    graph.add_node("model", lambda state: {"messages": [chat.invoke(state["messages"])]})
    graph.add_node("compact", CompactionNode(chat))
    graph.add_edge(START, "model")
    graph.add_edge("model", "compact")
    graph.add_edge("compact", END)
    app = graph.compile(checkpointer=InMemorySaver())
    out = app.invoke({"messages": [HumanMessage("Say hello.")]}, config=config("g"))
    assert out["kvmemory"]["logical_tokens"] > 0 and len(out["messages"]) == 2
    out = app.invoke({"messages": [HumanMessage("Again.")]}, config=config("g"))
    assert len(out["messages"]) == 4
    chat.drop_thread("g")  # a restart: the session is rebuilt from the checkpointed messages
    out = app.invoke({"messages": [HumanMessage("Once more.")]}, config=config("g"))
    session = chat.session_for("g")
    # the session's conversation holds the generated reply too (it is part of the transcript)
    assert len(out["messages"]) == 6 and len(session.messages) == 6
    assert session.messages[-1] == {"role": "assistant", "content": out["messages"][-1].content}


class FakeToolModel(GenericFakeChatModel):
    def bind_tools(self, tools, **kwargs):
        return self


def test_stategraph_with_a_fake_model_and_tools(chat):
    fake = FakeToolModel(
        messages=iter(
            [
                AIMessage("", tool_calls=[{"name": "run_tests", "args": {}, "id": "c1"}]),
                AIMessage("The restock test fails."),
            ]
        )
    )
    graph = StateGraph(KVMemoryState)
    graph.add_node("agent", lambda state: {"messages": [fake.invoke(state["messages"])]})
    graph.add_node("tools", ToolNode([run_tests]))
    graph.add_node("compact", CompactionNode(chat))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition, {"tools": "tools", END: "compact"})
    graph.add_edge("tools", "agent")
    graph.add_edge("compact", END)
    out = graph.compile().invoke({"messages": [HumanMessage("Run the tests.")]}, config=config("fake"))
    assert out["messages"][-1].content == "The restock test fails."
    assert isinstance(out["messages"][2], ToolMessage) and "1 failed" in out["messages"][2].content
    assert out["kvmemory"]["logical_tokens"] == 0  # the fake model never touched the KV session


def tool_rules(session) -> dict[str, float]:
    return {r.name: r.ratio for r in session.memory.policy.rules if r.name.startswith("tool:")}


def test_middleware_gives_its_threads_the_tools_rules_and_leaves_the_model_policy_alone(chat):
    shared = chat.policy.model_dump()
    middleware = KVMemoryMiddleware(tool_policies={"lookup_port": {"ratio": 4}})
    agent = create_agent(chat, tools=[lookup_port, run_tests], middleware=[middleware], checkpointer=InMemorySaver())
    out = agent.invoke({"messages": [HumanMessage("Hi")]}, config=config("mw"))
    assert out["kvmemory"]["logical_tokens"] > 0
    # the decorator's ratio for run_tests, the middleware's own for lookup_port
    assert tool_rules(chat.session_for("mw")) == {"tool:lookup_port": 4, "tool:run_tests": 10}
    assert chat.policy.model_dump() == shared and tool_rules(chat.session_for("elsewhere")) == {}


async def test_middleware_async_compacts_every_call(small_engine):
    rules = MemoryPolicy(default=CompactionRule(ratio=4.0), budget=MemoryBudget(max_slots=4096, recent_tokens=16))
    chat = ChatKVMemory(engine=small_engine, max_new_tokens=4, policy=rules)  # rules with something to compact
    agent = create_agent(chat, tools=[lookup_port], middleware=[KVMemoryMiddleware(compact_every=1)])
    history = [HumanMessage("Hi"), AIMessage("Here is what I found so far. " * 30), HumanMessage("Go on.")]
    out = await agent.ainvoke({"messages": history}, config=config("amw"))
    session = chat.session_for("amw")
    assert tool_rules(session) == {}  # no per-tool rules given
    assert out["kvmemory"]["logical_tokens"] > 0
    triggers = [e["trigger"] for e in session.compaction_log]
    assert triggers and set(triggers) == {"middleware"}  # only the middleware compacted (no cap was reached)
    assert session.cache.slots_per_head < len(session.tokens)


async def test_a_cancelled_astream_leaves_the_thread_usable(small_engine):
    chat = ChatKVMemory(engine=small_engine, max_new_tokens=40)
    chunks = []

    async def consume():
        async for chunk in chat.astream([HumanMessage("Tell me a long story.")], config=config("cancel")):
            chunks.append(chunk)

    task = asyncio.create_task(consume())
    await until(lambda: len(chunks) >= 3 or task.done(), what="three chunks")
    assert len(chunks) >= 3
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    reply = await chat.ainvoke([HumanMessage("Say hi.")], config=config("cancel"))
    assert reply.usage_metadata["output_tokens"] > 0
