"""The server on the default model, live on localhost, driven by the clients a user would use: the ``openai``
client (chat, streaming, tool messages, a Responses chain), the ``anthropic`` SDK (a tool-using
conversation resent every turn, as Claude Code sends it) and ``langchain-openai`` inside a LangGraph agent.
The protocol suite for both deployments is ``tests/test_http_api.py``."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import anthropic
import httpx
import openai
import pytest

from kvmemory import SessionStore
from kvmemory.integrations.dialects.openai_chat import message as openai_message
from kvmemory.integrations.server import LoadingApp, create_app, serve_in_thread
from kvmemory.integrations.serving import Reply

pytestmark = pytest.mark.small_model


@contextmanager
def live_server(engine, sessions=None):
    """The app on a free localhost port, served by uvicorn in a thread; yields (base URL, app)."""
    app = create_app(engine, SessionStore(engine, sessions), max_request_mb=1)
    with serve_in_thread(app) as base:
        yield base, app


def client(base: str, session_id: str | None = None) -> openai.OpenAI:
    headers = {"x-session-id": session_id} if session_id else None
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", default_headers=headers, max_retries=0)


def ask(chat: openai.OpenAI, messages: list[dict], **kwargs):
    return chat.chat.completions.create(model="default", messages=messages, max_tokens=8, **kwargs)


def test_a_session_prefills_only_new_messages_across_requests(small_engine):
    with live_server(small_engine) as (base, _):
        chat = client(base, "agent-1")
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
        first = ask(chat, messages)
        assert first.choices[0].message.role == "assistant" and first.usage.prompt_tokens_details.cached_tokens == 0
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        messages += [{"role": "user", "content": "And a vegetable?"}]
        second = ask(chat, messages)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens  # the whole first turn came from the resident cache
        stateless = ask(client(base), messages)  # no session id: a fresh session re-prefills everything
        assert stateless.usage.prompt_tokens_details.cached_tokens == 0
        assert stateless.choices[0].message.content == second.choices[0].message.content
        models = chat.models.list()
        assert [m.id for m in models.data] == [small_engine.name]


def test_streaming_ends_with_a_usage_chunk_and_matches_the_plain_reply(small_engine):
    with live_server(small_engine) as (base, _):
        messages = [{"role": "user", "content": "Count to five."}]
        plain = ask(client(base), messages)
        chunks = list(ask(client(base), messages, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == plain.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_tool_messages_round_trip_and_tool_calls_come_back_in_the_openai_shape(small_engine):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "What port is configured?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "PORT = 5433"},
    ]
    with live_server(small_engine) as (base, _):
        reply = ask(client(base, "tools"), messages, tools=tools)
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    parsed = {"name": "read_file", "args": {"path": "b.py"}, "id": "call_1"}
    reply = Reply("", "", [parsed], "tool_calls", None, 1, 0, 1, [])
    assert openai_message(reply)["tool_calls"][0]["function"] == {"name": "read_file", "arguments": '{"path": "b.py"}'}


LOG = "\n".join(f"tests/test_mod{i}.py::test_case_{i} PASSED [{i}%]" for i in range(60))


def test_a_responses_chain_prefills_only_each_turns_new_input(small_engine):
    """Five turns chained by previous_response_id: turns 2 to 5 take all but their new input from the cache."""
    with live_server(small_engine) as (base, _):
        chat, previous, shares = client(base), None, []
        for turn in range(5):
            given = f"Here is the test log:\n{LOG}\nHow many tests passed?" if turn == 0 else f"And test {turn}?"
            response = chat.responses.create(
                model="default",
                input=given,
                instructions="Be brief.",
                previous_response_id=previous,
                max_output_tokens=8,
            )
            usage = response.usage
            shares.append(usage.input_tokens_details.cached_tokens / usage.input_tokens)
            previous = response.id
        assert shares[0] == 0 and min(shares[1:]) >= 0.9, shares


def test_an_anthropic_client_resending_its_conversation_reads_it_from_the_cache(small_engine):
    """Five turns of a tool-using conversation, resent whole each turn as Claude Code sends it: turns 2 to 5
    read all but their new blocks from the session's cache."""
    tools = [{"name": "run_tests", "description": "Run the tests", "input_schema": {"type": "object"}}]
    with live_server(small_engine) as (base, _):
        claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": f"Here is the last test log:\n{LOG}\nRun the tests again."}]
        shares = []
        for turn in range(5):
            ask = {"model": "default", "max_tokens": 8, "system": "Be brief.", "messages": messages, "tools": tools}
            if turn == 4:
                with claude.messages.stream(**ask) as stream:
                    reply = stream.get_final_message()
            else:
                reply = claude.messages.create(**ask)
            usage = reply.usage
            shares.append(usage.cache_read_input_tokens / (usage.cache_read_input_tokens + usage.input_tokens))
            call = {"type": "tool_use", "id": f"toolu_{turn}", "name": "run_tests", "input": {}}
            messages += [
                {"role": "assistant", "content": [*reply.content, call] if reply.content else [call]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": f"{turn} failed"}],
                },
            ]
        assert shares[0] == 0 and min(shares[1:]) >= 0.9, shares


def test_a_saved_session_survives_a_server_restart(tmp_path, small_engine):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    with live_server(small_engine, tmp_path) as (base, _):
        first = ask(client(base, "keep"), messages)
        assert httpx.post(f"{base}/v1/sessions/keep/save").json()["saved"]
        stats = httpx.get(f"{base}/v1/sessions/keep").json()
        png = httpx.get(f"{base}/v1/sessions/keep/memory_map.png")
        assert png.headers["content-type"] == "image/png" and png.content[:4] == b"\x89PNG"
    follow = messages + [{"role": "assistant", "content": first.choices[0].message.content}]
    follow += [{"role": "user", "content": "And the mountains?"}]
    with live_server(small_engine, tmp_path) as (base, _):
        restored = httpx.post(f"{base}/v1/sessions/keep/restore").json()
        assert restored["logical_tokens"] == stats["logical_tokens"]
        again = ask(client(base, "keep"), follow)
        assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        reference = ask(client(base), follow)  # the same conversation, prefilled from scratch
        assert again.choices[0].message.content == reference.choices[0].message.content
        assert httpx.delete(f"{base}/v1/sessions/keep").json()["deleted"]
        assert httpx.get(f"{base}/v1/sessions/keep").status_code == 404


def test_langchain_openai_drives_a_langgraph_agent_through_the_server(small_engine):
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI

    def lookup_port(service: str) -> str:
        """Look up the port a service listens on."""
        return "5433"

    with live_server(small_engine) as (base, app):
        thread = {"x-session-id": "lg"}  # the agent thread's session on the server
        model = ChatOpenAI(base_url=f"{base}/v1", api_key="-", model="default", max_tokens=12, default_headers=thread)
        agent = create_agent(model, tools=[lookup_port], system_prompt="You are a helpful assistant.")
        state = agent.invoke({"messages": [{"role": "user", "content": "Which port does the db use?"}]})
        assert state["messages"][-1].type == "ai"
        state["messages"].append({"role": "user", "content": "Thanks. Anything else?"})
        state = agent.invoke(state)
        usage = state["messages"][-1].usage_metadata
        assert usage["input_token_details"]["cache_read"] > 0  # the thread's cache stayed resident
        assert "lg" in app.state.core.store.stats()["resident"]


def test_the_server_answers_503_while_the_model_loads(tiny_engine):
    loaded = threading.Event()

    def load():
        loaded.wait(timeout=60)
        return create_app(tiny_engine)

    app = LoadingApp(load)
    with serve_in_thread(app) as base:
        early = httpx.get(f"{base}/v1/models")
        assert early.status_code == 503 and early.headers["retry-after"] == "5"
        assert early.json()["error"]["code"] == "loading"
        loaded.set()
        app.state.ready.wait(timeout=60)
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["object"] == "model"
