"""The HTTP API, one suite against both deployments: the single-process server and Ray Serve on a real local
Ray cluster (loopback only, two replicas). Every route, the three dialects, the limits and the API keys
behave the same in both. A tiny random model with the default tokenizer keeps it fast; what the replies say
does not matter here, only the protocol and what the sessions hold.

The Ray half is marked ``ray`` (``-m "not ray"`` skips it)."""

from __future__ import annotations

import json
import random
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass

import anthropic
import httpx
import openai
import pytest

from kvmemory import Engine, SessionStore
from kvmemory.integrations.server import create_app, owner_of, serve_in_thread
from tests.conftest import wait_until
from tests.test_contract import tiny_chat_engine

pytestmark = pytest.mark.small_model  # the tiny model speaks through the default tokenizer

KEY, OTHER_KEY = "key-a", "key-b"
SETTINGS = {
    "api_keys": (KEY, OTHER_KEY),
    "max_sessions": 40,
    "sessions_per_key": 25,
    "responses_per_key": 8,
    "busy_timeout": 2.0,
    "max_request_mb": 1.0,
}


@dataclass
class Live:
    base: str
    kind: str
    model: str
    app: object  # the single-process app (None under Ray)

    def openai(self, session: str | None = None, key: str = KEY) -> openai.OpenAI:
        headers = {"x-session-id": session} if session else None
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, default_headers=headers, max_retries=0)

    def anthropic(self, key: str = KEY) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.base, api_key=key, max_retries=0)

    def get(self, path: str, key: str = KEY) -> httpx.Response:
        return httpx.get(self.base + path, headers={"authorization": f"Bearer {key}"}, timeout=60)

    def post(self, path: str, body=None, key: str = KEY, **kwargs) -> httpx.Response:
        return httpx.post(
            self.base + path,
            json=body,
            headers={"x-api-key": key, **kwargs.pop("headers", {})},
            timeout=kwargs.pop("timeout", 60),
            **kwargs,
        )

    def delete(self, path: str, key: str = KEY) -> httpx.Response:
        return httpx.delete(self.base + path, headers={"x-api-key": key}, timeout=60)

    def stats(self, session: str) -> dict:
        return self.get(f"/v1/sessions/{session}").json()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny chat model on disk, so that every replica (and the single process) loads the same weights."""
    path = tmp_path_factory.mktemp("tiny-chat")
    engine = tiny_chat_engine()
    engine.model.save_pretrained(path)
    engine.tokenizer.save_pretrained(path)
    return path


def free_port_outside_the_ephemeral_range() -> int:
    """A port Ray's proxy can bind: Ray takes a number, so it is probed first, but below the kernel's
    ephemeral range (32768 and up), where no outgoing connection or port-0 bind can be handed it meanwhile."""
    for port in random.Random().sample(range(20000, 32000), 200):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32000")


@contextmanager
def single_process(model_dir, sessions, settings: dict = SETTINGS):
    engine = Engine.from_pretrained(str(model_dir))
    app = create_app(
        engine,
        SessionStore(engine, sessions),
        max_request_mb=settings["max_request_mb"],
        save_after_turn=True,
        api_keys=settings["api_keys"],
        max_sessions=settings["max_sessions"],
        busy_timeout=settings["busy_timeout"],
        max_new_tokens=settings.get("max_new_tokens"),
        sessions_per_key=settings.get("sessions_per_key"),
        responses_per_key=settings.get("responses_per_key", 1000),
    )
    with serve_in_thread(app) as base:
        yield base, app


@contextmanager
def ray_cluster(model_dir, sessions, settings: dict = SETTINGS):
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from kvmemory.integrations.ray_serve import build_app

    port = free_port_outside_the_ephemeral_range()
    ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(str(model_dir), sessions, 2, settings), name="kvmemory", route_prefix="/")
        yield f"http://127.0.0.1:{port}", None
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module", params=["single-process", pytest.param("ray", marks=pytest.mark.ray)])
def live(request, model_dir, tmp_path_factory):
    sessions = tmp_path_factory.mktemp(f"sessions-{request.param}")
    start = single_process if request.param == "single-process" else ray_cluster
    with start(model_dir, sessions) as (base, app):
        model = httpx.get(f"{base}/v1/models", headers={"x-api-key": KEY}).json()["data"][0]["id"]
        yield Live(base, request.param, model, app)


def chat(live: Live, session: str | None, messages: list[dict], **kwargs):
    return live.openai(session).chat.completions.create(model=live.model, messages=messages, max_tokens=6, **kwargs)


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]


# ---- Chat Completions ----------------------------------------------------------------------------


def test_chat_turns_prefill_only_what_the_session_lacks_and_stream_the_same_reply(live):
    first = chat(live, "chat-a", user("Name a prime."))
    follow = user("Name a prime.") + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Another one?"},
    ]
    second = chat(live, "chat-a", follow)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    chunks = list(
        live.openai("chat-b").chat.completions.create(
            model=live.model, messages=follow, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
    )
    plain = chat(live, None, follow)  # the same conversation on a session of its own
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_cached_tokens_stay_between_zero_and_the_prompt_when_the_conversation_changes(live):
    for text in ("hello there", "hello world", "hello there"):
        usage = chat(live, "edited", user(text)).usage
        assert 0 <= usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


# ---- Responses -------------------------------------------------------------------------------------


def test_a_previous_response_id_chain_continues_the_session_without_prefilling_it_again(live):
    client = live.openai()
    previous, inputs = None, []
    for turn in range(5):
        response = client.responses.create(
            model=live.model,
            input=f"Question {turn}: a prime?",
            instructions="Be brief.",
            previous_response_id=previous,
            max_output_tokens=5,
        )
        usage = response.usage
        if previous is not None:  # everything but the new question (and the last reply's end) was cached
            assert usage.input_tokens - usage.input_tokens_details.cached_tokens < 25
        inputs.append(usage.input_tokens)
        previous = response.id
    assert inputs == sorted(inputs) and inputs[-1] > 4 * 20
    stored = client.responses.retrieve(previous)
    assert stored.id == previous and stored.usage.input_tokens == inputs[-1]
    client.responses.delete(previous)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(previous)
    with pytest.raises(openai.NotFoundError):  # another key cannot see (or continue) this key's responses
        live.openai(key=OTHER_KEY).responses.create(model=live.model, input="hi", previous_response_id=response.id)


def test_responses_take_function_call_outputs_and_stream_their_events(live):
    client = live.openai()
    tools = [{"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}]
    items = [
        {"role": "user", "content": "What port is configured?"},
        {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": '{"path": "a.py"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "PORT = 5433"},
    ]
    response = client.responses.create(model=live.model, input=items, tools=tools, max_output_tokens=5)
    assert response.status in ("completed", "incomplete") and response.output
    with client.responses.stream(model=live.model, input=items, tools=tools, max_output_tokens=5) as stream:
        kinds = [event.type for event in stream]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.done" in kinds
    with pytest.raises(openai.BadRequestError, match="unknown call_id"):
        client.responses.create(
            model=live.model, input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}]
        )


def test_a_client_resending_its_conversation_is_served_from_its_prompt_cache_key_session(live):
    """As Codex sends it: the whole conversation each turn, store false, a prompt_cache_key, hosted tools."""
    client = live.openai()
    tools = [{"type": "web_search"}, {"type": "function", "name": "exec_command", "parameters": {"type": "object"}}]
    items = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    ask = {"model": live.model, "tools": tools, "store": False, "prompt_cache_key": "codex-thread-1"}
    first = client.responses.create(input=items, max_output_tokens=4, **ask)
    items += [
        {"role": "assistant", "content": [{"type": "output_text", "text": first.output_text}]},
        {"role": "user", "content": "Another?"},
    ]
    second = client.responses.create(input=items, max_output_tokens=4, **ask)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    with pytest.raises(openai.NotFoundError):  # store false: nothing to retrieve
        client.responses.retrieve(second.id)


# ---- Anthropic Messages ----------------------------------------------------------------------------


def test_a_required_tool_choice_makes_the_reply_call_that_tool_in_every_dialect(live):
    """The reply opens with the model's tool-call format and names the tool (``RequiredToolCall``); the tiny
    random model's arguments are noise, so a short reply may stop inside them: the call is then text."""
    said = []
    chat = (
        live.openai()
        .chat.completions.create(
            model=live.model,
            messages=[{"role": "user", "content": "Read the settings."}],
            tools=[{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")],
            tool_choice={"type": "function", "function": {"name": "b"}},
            max_tokens=40,
        )
        .choices[0]
    )
    said.append(chat.message.tool_calls[0].function.name if chat.message.tool_calls else chat.message.content)
    message = live.anthropic().messages.create(
        model=live.model,
        max_tokens=40,
        messages=[{"role": "user", "content": "Read the settings."}],
        tools=[{"name": n, "input_schema": {"type": "object"}} for n in ("a", "b")],
        tool_choice={"type": "tool", "name": "b"},
    )
    said.append(" ".join(block.name if block.type == "tool_use" else block.text for block in message.content))
    for text in said:
        assert text == "b" or text.startswith('<tool_call>{"name": "b", "arguments":'), said


def test_allowed_tools_hold_the_call_to_a_subset_and_keep_the_cached_prefix(live):
    """OpenAI's ``allowed_tools`` choice in both OpenAI dialects: the reply calls one of the allowed tools, and
    the prompt shows every tool, so a turn that allows another subset reuses the whole prefix. Mode "auto" is a
    400 naming the field."""
    client = live.openai("allowed")
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    messages = [{"role": "user", "content": "Read the settings."}]

    def chat(name: str, **kwargs):
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [tools[name == "b"]]}}
        return client.chat.completions.create(
            model=live.model, messages=messages, tools=tools, tool_choice=choice, max_tokens=40, **kwargs
        )

    first, second = chat("b"), chat("a")
    for reply, name in ((first, "b"), (second, "a")):
        message = reply.choices[0].message
        said = message.tool_calls[0].function.name if message.tool_calls else message.content
        assert said == name or said.startswith(f'<tool_call>{{"name": "{name}", "arguments":'), said
    assert second.usage.prompt_tokens == first.usage.prompt_tokens  # the same prompt: every tool shown
    assert second.usage.prompt_tokens_details.cached_tokens >= 0.9 * second.usage.prompt_tokens
    response = live.openai().responses.create(
        model=live.model,
        input="Read the settings.",
        tools=[{"type": "function", "name": n, "parameters": {"type": "object"}} for n in ("a", "b")],
        tool_choice={"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "a"}]},
        max_output_tokens=40,
        store=False,
    )
    call = next((item for item in response.output if item.type == "function_call"), None)
    assert call.name == "a" if call is not None else response.output_text.startswith('<tool_call>{"name": "a"')
    with pytest.raises(openai.BadRequestError, match="mode 'required' only") as refused:
        chat("a", extra_body={"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto"}}})
    assert refused.value.body["param"] == "tool_choice"


def test_messages_find_their_session_by_the_conversation_and_report_cache_reads(live):
    client = live.anthropic()
    tools = [{"name": "read_file", "description": "Read a file", "input_schema": {"type": "object"}}]
    messages = [{"role": "user", "content": "Which port does the service use?"}]
    first = client.messages.create(model=live.model, max_tokens=5, system="Be brief.", messages=messages, tools=tools)
    assert first.usage.cache_read_input_tokens == 0
    messages += [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "PORT = 5433"}]},
    ]
    second = client.messages.create(model=live.model, max_tokens=5, system="Be brief.", messages=messages, tools=tools)
    assert second.usage.cache_read_input_tokens > first.usage.input_tokens // 2
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use", "stop_sequence")
    with client.messages.stream(
        model=live.model, max_tokens=5, system="Be brief.", messages=messages, tools=tools
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens >= second.usage.cache_read_input_tokens
    counted = client.messages.count_tokens(model=live.model, system="Be brief.", messages=messages, tools=tools)
    assert counted.input_tokens == second.usage.input_tokens + second.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(
            model=live.model,
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
                    ],
                }
            ],
        )


# ---- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**70}, "seed", "less than or equal"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": "abc"}]}, "messages[0].tool_calls", ""),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", ""),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens", "greater than"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n", "not supported"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs", "not supported"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}},
            "response_format",
            "not supported",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "bad name!"}}],
            },
            "tools[0].function.name",
            "invalid tool name",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice", "no tools"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "read_file"}}],
                "tool_choice": {"type": "function", "function": {"name": "write_file"}},
            },
            "tool_choice",
            "name one of the request's tools (read_file)",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "function", "function": {"name": "read_file"}}],
                "tool_choice": {"type": "function", "function": "read_file"},
            },
            "tool_choice",
            "name one of the request's tools",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, "model", "not served here"),
        ({"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, "frobnicate", "unrecognized"),
    ],
)
def test_bad_chat_requests_get_a_typed_400_naming_the_parameter(live, body, param, match):
    answer = live.post("/v1/chat/completions", {"model": live.model, **body} if "model" not in body else body)
    error = answer.json()["error"]
    assert answer.status_code == (404 if param == "model" else 400), error
    assert error["param"] == param and match in error["message"]


def test_a_failed_request_leaves_the_session_as_it_was(live):
    chat(live, "intact", user("Hi"))
    before = live.stats("intact")["logical_tokens"]
    bad = [
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                }
            ]
        },
        {"messages": [{"role": "user", "content": "Hi"}], "kvmemory": {"policy": {"budget": {"max_slots": -1}}}},
        {"messages": [{"role": "user", "content": "x " * 5000}]},  # past the tiny model's 2,048 positions
    ]
    for body in bad:
        answer = live.post("/v1/chat/completions", {"model": live.model, **body}, headers={"x-session-id": "intact"})
        assert answer.status_code == 400, answer.text
    assert live.stats("intact")["logical_tokens"] == before


def test_session_ids_the_routes_cannot_address_are_refused(live):
    for bad in ("a/b", ".", "..", "x" * 200, "with space"):
        answer = live.post(
            "/v1/chat/completions", {"model": live.model, "messages": user("hi")}, headers={"x-session-id": bad}
        )
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_session_id"
    chat(live, "dotted.id@host", user("hi"))
    assert live.get("/v1/sessions/dotted.id@host").status_code == 200


def test_unknown_routes_and_bodies_over_the_limit_get_openai_shaped_errors(live):
    missing = live.get("/v1/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    big = json.dumps({"model": live.model, "messages": user("x" * 1_200_000)}).encode()
    declared = live.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
    chunked = live.post(
        "/v1/chat/completions",
        content=iter([big[:500_000], big[500_000:]]),
        headers={"content-type": "application/json"},
    )
    for answer in (declared, chunked):
        assert answer.status_code == 413 and answer.json()["error"]["code"] == "request_too_large"


# ---- keys, sessions, limits ---------------------------------------------------------------------------


def test_every_route_needs_a_key_and_a_key_sees_only_its_own_sessions(live):
    assert httpx.get(f"{live.base}/health").json()["status"] == "ok"  # for load balancers: no key
    assert httpx.head(f"{live.base}/health").status_code == 200
    for method, path in [
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/messages"),
        ("GET", "/v1/sessions"),
        ("GET", "/v1/sessions/x"),
        ("DELETE", "/v1/sessions/x"),
        ("GET", "/v1/nowhere"),
    ]:
        answer = httpx.request(method, live.base + path, json={}, headers={"x-api-key": "wrong"})
        assert answer.status_code == 401, (method, path)
    with pytest.raises(anthropic.AuthenticationError):
        live.anthropic(key="wrong").messages.create(model=live.model, max_tokens=2, messages=user("hi")[1:])
    chat(live, "mine", user("hello"))
    assert live.get("/v1/sessions/mine").status_code == 200
    assert live.get("/v1/sessions/mine", key=OTHER_KEY).status_code == 404
    assert live.delete("/v1/sessions/mine", key=OTHER_KEY).status_code == 404
    assert "mine" in [s["id"] for s in live.get("/v1/sessions").json()["data"]]
    assert "mine" not in [s["id"] for s in live.get("/v1/sessions", key=OTHER_KEY).json()["data"]]
    chat_b = live.openai("mine", key=OTHER_KEY).chat.completions.create(
        model=live.model, messages=user("other"), max_tokens=3
    )  # the same id under another key is another session
    assert chat_b.usage.prompt_tokens_details.cached_tokens == 0
    assert live.stats("mine")["logical_tokens"] < 40


def test_sessions_save_restore_and_delete_and_the_maximum_holds(live):
    chat(live, "kept", user("Tell me about the sea."))
    assert live.post("/v1/sessions/kept/save").json()["saved"]
    png = live.get("/v1/sessions/kept/memory_map.png")
    assert png.headers["content-type"] == "image/png" and png.content[:4] == b"\x89PNG"
    tokens = live.stats("kept")["logical_tokens"]
    assert live.post("/v1/sessions/kept/restore").json()["logical_tokens"] == tokens
    assert live.delete("/v1/sessions/kept").json()["deleted"]
    assert live.get("/v1/sessions/kept").status_code == 404
    made, refused = {KEY: [], OTHER_KEY: []}, {}
    try:
        for key in (KEY, OTHER_KEY):  # the first key fills its share, the second what is left
            for i in range(SETTINGS["max_sessions"] + 1):
                answer = live.post(
                    "/v1/chat/completions",
                    {"model": live.model, "messages": user("hi"), "max_tokens": 1},
                    key=key,
                    headers={"x-session-id": f"fill-{i}"},
                )
                if answer.status_code == 429:
                    refused[key] = answer.json()["error"]["code"]
                    break
                assert answer.status_code == 200, answer.text
                made[key].append(f"fill-{i}")
            else:
                pytest.fail("no 429 past the maximum number of sessions")
        assert refused[KEY] == "key_session_limit" and len(made[OTHER_KEY]) >= 1
        assert refused[OTHER_KEY] in ("session_limit_reached", "key_session_limit")
    finally:
        for key, sessions in made.items():
            for session in sessions:
                live.delete(f"/v1/sessions/{session}", key=key)


def test_each_key_keeps_only_its_newest_stored_responses(live):
    client, others = live.openai(), live.openai(key=OTHER_KEY)
    theirs = others.responses.create(model=live.model, input="Keep me.", max_output_tokens=1)
    made = [client.responses.create(model=live.model, input=f"n{i}", max_output_tokens=1).id for i in range(10)]
    kept = SETTINGS["responses_per_key"]
    for ident in made[-kept:]:
        assert client.responses.retrieve(ident).id == ident
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[0])
    assert others.responses.retrieve(theirs.id).id == theirs.id  # not pushed out by the first key's


# ---- clients that go away, and a turn in progress --------------------------------------------------------


def long_request(live: Live, session: str, stream: bool) -> dict:
    body = {"model": live.model, "messages": user("Write a long story."), "max_tokens": 1900, "stream": stream}
    body["stop"] = ["never-said-1"]  # (keeps the tiny model from ending early on an end-of-turn token)
    return body


def test_a_client_that_disconnects_mid_stream_frees_its_session_which_keeps_what_was_sent(live):
    chat(live, "gone", user("hi"))
    with httpx.stream(
        "POST",
        f"{live.base}/v1/chat/completions",
        json=long_request(live, "gone", True),
        headers={"x-api-key": KEY, "x-session-id": "gone"},
        timeout=60,
    ) as answer:
        lines = answer.iter_lines()
        received = [next(lines) for _ in range(12)]
        busy = live.stats("gone")
        assert busy["busy"] is True  # stats are readable while the turn runs
    assert any("content" in line for line in received)
    # at once: the session is free by the next token (a request still waiting after busy_timeout gets 409)
    assert chat(live, "gone", user("again")).choices
    held = live.stats("gone")["logical_tokens"]
    assert held < busy["logical_tokens"] + 400  # the generation stopped at the disconnect, not at 1,900 tokens


def test_a_client_that_gives_up_on_a_plain_request_cancels_its_turn(live):
    chat(live, "abandoned", user("hi"))
    before = live.stats("abandoned")["logical_tokens"]
    with pytest.raises(httpx.ReadTimeout):
        live.post(
            "/v1/chat/completions",
            long_request(live, "abandoned", False),
            headers={"x-session-id": "abandoned"},
            timeout=1.5,
        )
    wait_until(lambda: live.stats("abandoned")["busy"] is False, timeout=20, what="the turn to be cancelled")
    assert live.stats("abandoned")["logical_tokens"] == before  # undone: the client received nothing


def test_a_second_request_on_a_busy_session_waits_then_gets_409(live):
    if live.kind != "single-process":
        pytest.skip("holds the session through the core in this process (a turn cannot be held open over Ray)")
    core = live.app.state.core
    chat(live, "held", user("hi"))
    with core.hold(f"{owner_of(KEY)}/held"):  # another request holds the session
        started = time.monotonic()
        with pytest.raises(openai.ConflictError, match="busy"):
            chat(live, "held", user("me too"))
        assert time.monotonic() - started >= SETTINGS["busy_timeout"] * 0.9
        assert live.stats("held")["busy"] is True  # stats do not wait for the turn


# ---- Ray: sessions keep to their replica and survive it ---------------------------------------------------


def test_a_session_keeps_its_replica_unless_that_replica_leaves():
    from kvmemory.integrations.ray_serve import by_affinity

    replicas, sessions = ["r1", "r2", "r3"], [f"thread-{i}" for i in range(300)]
    home = {s: by_affinity(s, replicas)[0] for s in sessions}
    assert all(by_affinity(s, replicas[::-1])[0] == home[s] for s in sessions)  # whatever order they come in
    assert all(60 < list(home.values()).count(r) < 140 for r in replicas)  # spread evenly
    for s in sessions:  # r2 leaves: only its sessions move, each to its next-ranked replica
        assert by_affinity(s, ["r1", "r3"])[0] == (home[s] if home[s] != "r2" else by_affinity(s, replicas)[1])


def conversation(turns: int, replies: list[str]) -> list[dict]:
    messages = [{"role": "system", "content": "Be brief."}]
    for i in range(turns):
        messages.append({"role": "user", "content": f"Question {i}: name a prime number above {10 * i}."})
        if i < len(replies):
            messages.append({"role": "assistant", "content": replies[i]})
    return messages


def test_a_session_sticks_to_one_replica_and_survives_that_replica_dying(live, model_dir):
    """Last in the module: it kills a replica."""
    if live.kind != "ray":
        pytest.skip("replicas exist only under Ray")
    ray = pytest.importorskip("ray")
    engine = Engine.from_pretrained(str(model_dir))
    with serve_in_thread(create_app(engine)) as reference:  # what one process answers on the same thread
        expected = []
        for turn in range(4):
            single = Live(reference, "reference", live.model, None)
            expected.append(chat(single, "t", conversation(turn + 1, expected)).choices[0].message.content)
    replies, replicas = [], []
    for turn in range(3):
        reply = chat(live, "thread-a", conversation(turn + 1, replies))
        replies.append(reply.choices[0].message.content)
        replicas.append(live.stats("thread-a")["replica"])
        if turn:
            assert reply.usage.prompt_tokens_details.cached_tokens > 0  # the cache stayed on the replica
    assert replies == expected[:3] and len(set(replicas)) == 1

    holder = next(a for a in ray.util.list_named_actors(all_namespaces=True) if replicas[0] in a["name"])
    ray.kill(ray.get_actor(holder["name"], namespace=holder["namespace"]), no_restart=True)

    reply = chat(live, "thread-a", conversation(4, replies))
    assert live.stats("thread-a")["replica"] != replicas[0]
    assert reply.usage.prompt_tokens_details.cached_tokens > 0  # loaded from the saved turn, not rebuilt
    assert reply.choices[0].message.content == expected[3]
