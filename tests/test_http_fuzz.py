"""Hostile and careless requests against the real server, in every dialect: valid requests mutated at random by
hypothesis (wrong types, missing and extra fields, huge numbers, control-token text, deep nesting) and bodies
no JSON library writes (lone surrogates, 5,000-digit numbers, 5,000-deep nesting, bad UTF-8).

Each answer must be below 500, an error in the dialect's own shape naming what was wrong, and a rejected request
must leave its session's tokens and transcript as they were. The fast slice runs ``FUZZ_EXAMPLES`` (default 60)
requests per route; the long run is

    KVMEMORY_FUZZ_EXAMPLES=10000 python -m pytest tests/test_http_fuzz.py -k mutated --timeout 0

(the Ray half is marked ``ray``)."""

from __future__ import annotations

import copy
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_http_api import KEY, free_port_outside_the_ephemeral_range, model_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.small_model
FUZZ_EXAMPLES = int(os.environ.get("KVMEMORY_FUZZ_EXAMPLES", "60"))
SETTINGS = {"api_keys": (KEY,), "max_sessions": 64, "busy_timeout": 5.0, "max_request_mb": 1.0, "max_new_tokens": 3}
SESSION = "fuzzed"

TOOL_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
SEEDS = {
    "/v1/chat/completions": {
        "model": "default",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Read a.py"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "PORT = 5433"},
        ],
        "tools": [{"type": "function", "function": {"name": "read", "description": "Read", "parameters": TOOL_SCHEMA}}],
        "tool_choice": "auto",
        "max_tokens": 3,
        "temperature": 0.5,
        "stop": ["\n\n"],
        "kvmemory": {"policy": {"extends": "default", "budget": {"max_slots": 1024}}},
    },
    "/v1/responses": {
        "model": "default",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Read a.py"}]},
            {"type": "function_call", "call_id": "c1", "name": "read", "arguments": '{"path": "a.py"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "PORT = 5433"},
        ],
        "tools": [{"type": "function", "name": "read", "parameters": TOOL_SCHEMA}],
        "max_output_tokens": 3,
        "store": False,
    },
    "/v1/messages": {
        "model": "default",
        "max_tokens": 3,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": "Read a.py"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.py"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "PORT = 5433"}]},
        ],
        "tools": [{"name": "read", "description": "Read", "input_schema": TOOL_SCHEMA}],
        "stop_sequences": ["\n\n"],
    },
}
SEEDS["/v1/messages/count_tokens"] = {
    k: v for k, v in SEEDS["/v1/messages"].items() if k not in ("max_tokens", "stop_sequences")
}
NAMES = sorted(
    {
        "type",
        "role",
        "content",
        "text",
        "id",
        "name",
        "arguments",
        "input",
        "output",
        "call_id",
        "tool_use_id",
        "tool_call_id",
        "policy",
        "function",
        "parameters",
        "max_slots",
        "rules",
        "messages",
    }
)
WORDS = [
    "user",
    "assistant",
    "system",
    "tool",
    "developer",
    "text",
    "input_text",
    "tool_use",
    "tool_result",
    "image",
    "function",
    "function_call",
    "function_call_output",
    "message",
    "required",
    "auto",
    "any",
    "none",
    "read",
    "c1",
    "t1",
    "{}",
    "[1]",
    '{"a": [',
    "<|im_end|>\n<|im_start|>system\n",
    "\ud800",
    "default",
]

LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=16)
    | st.sampled_from(WORDS)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


def places(value, path=()) -> list[tuple]:
    """Every path into ``value`` (dict keys and list indexes), the root included."""
    out = [path]
    if isinstance(value, dict):
        for key, inner in value.items():
            out += places(inner, path + (key,))
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            out += places(inner, path + (i,))
    return out


@st.composite
def mutated(draw, seed: dict):
    """``seed`` with one to three random edits: a value replaced, a key dropped or a key added."""
    body = copy.deepcopy(seed)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(places(body)))
        if not path:
            continue
        parent = body
        for step in path[:-1]:
            parent = parent[step]
        edit = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if edit == "drop" and isinstance(parent, dict):
            parent.pop(path[-1])
        elif edit == "add" and isinstance(parent, dict):
            parent[draw(st.sampled_from(NAMES) | st.text(max_size=8))] = draw(VALUES)
        else:
            parent[path[-1]] = draw(VALUES)
    return body


RAW_BODIES = {
    "lone surrogate": '{"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    "5,000-digit number": '{"model": "default", "max_tokens": 3' + "0" * 5000 + ', "messages": []}',
    "5,000-deep nesting": '{"metadata": ' + "[" * 5000 + "]" * 5000 + "}",
    "5,000-deep top level": "[" * 5000 + "]" * 5000,
    "200-deep arguments": '{"model": "default", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}],'
    ' "tools": [{"name": "a", "input_schema": {"type": "object", "properties": '
    + '{"a": ' * 200
    + "1"
    + "}" * 200
    + "}}]}",
    "bad UTF-8": b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
    "NaN": '{"model": "default", "max_tokens": 3, "temperature": NaN, "messages": [{"role": "user", "content": "x"}]}',
    "empty": b"",
    "null": "null",
    "a list": "[]",
}


@pytest.fixture(scope="module", params=["single-process", pytest.param("ray", marks=pytest.mark.ray)])
def server(request, model_dir, tmp_path_factory):  # noqa: F811 (the fixture imported above)
    from tests.test_http_api import ray_cluster, single_process

    start = single_process if request.param == "single-process" else ray_cluster
    with start(model_dir, tmp_path_factory.mktemp(f"fuzz-{request.param}"), SETTINGS) as (base, app):
        with httpx.Client(base_url=base, headers={"x-api-key": KEY, "x-session-id": SESSION}, timeout=60) as client:
            for route, seed in SEEDS.items():
                answer = client.post(route, json=seed)
                assert answer.status_code == 200, (route, answer.text)  # every seed is a valid request
            yield client, app.state.core if app is not None else None


def session_state(client: httpx.Client, core) -> tuple:
    """What a rejected request must leave as it was: the session's tokens, transcript and KV bytes (in this
    process), or its stats over HTTP (under Ray, where the session lives in a replica)."""
    if core is None:
        stats = client.get(f"/v1/sessions/{SESSION}").json()
        return stats["logical_tokens"], stats["kv_bytes"], stats["segments"]
    session = core.store.get(next(k for k in core.store.ids() if k.endswith(SESSION)))
    return list(session.tokens), session.transcript(), session.stats().kv_bytes


def check_answer(route: str, answer: httpx.Response) -> None:
    assert answer.status_code < 500, (route, answer.status_code, answer.text[:500])
    if answer.status_code >= 400:
        body = answer.json()
        if route.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"], body
        else:
            assert body["error"]["message"] and body["error"]["type"], body


@pytest.mark.parametrize("route", list(SEEDS))
def test_mutated_requests_get_a_4xx_in_the_dialects_shape_and_leave_the_session_as_it_was(server, route):
    client, core = server

    known = [session_state(client, core)]  # the state after the last request: read once per request, not twice

    @settings(max_examples=FUZZ_EXAMPLES, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(body=mutated(SEEDS[route]))
    def check(body):
        answer = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
        check_answer(route, answer)
        after = session_state(client, core)
        if answer.status_code >= 400:
            assert after == known[0], body
        known[0] = after

    check()


@pytest.mark.parametrize("kind", list(RAW_BODIES))
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_bodies_no_json_library_writes_get_a_4xx(server, route, kind):
    client, core = server
    before = session_state(client, core)
    raw = RAW_BODIES[kind]
    answer = client.post(route, content=raw if isinstance(raw, bytes) else raw.encode())
    check_answer(route, answer)
    assert answer.status_code in (400, 413), answer.text
    assert session_state(client, core) == before


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_request_for_2_to_the_70_tokens_stops_at_the_servers_bound_with_finish_reason_length(server, route):
    client, core = server
    field = {"/v1/chat/completions": "max_tokens", "/v1/responses": "max_output_tokens"}.get(route, "max_tokens")
    body = {key: value for key, value in SEEDS[route].items() if key not in ("stop", "stop_sequences")}
    body[field] = 2**70
    answer = client.post(route, json=body, headers={"x-session-id": "bounded"})
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    usage = reply["usage"]
    written = usage.get("completion_tokens", usage.get("output_tokens"))
    assert written <= SETTINGS["max_new_tokens"]
    if written == SETTINGS["max_new_tokens"]:  # cut at the bound, in the dialect's words (not a stop token)
        finish = reply.get("stop_reason") or reply.get("status") or reply["choices"][0]["finish_reason"]
        assert finish in ("length", "max_tokens", "incomplete", "tool_calls", "tool_use")
    if core is not None:  # (in this process: the bound without --max-new-tokens is the model's window)
        without_a_server_bound = type(core)(core.store, core.policy)
        assert without_a_server_bound.reply_limit(2**70) == core.engine.max_context


@pytest.mark.parametrize(
    ("route", "field"),
    [
        ("/v1/chat/completions", "max_token"),
        ("/v1/responses", "previous_respons_id"),
        ("/v1/messages", "stop_sequence"),
        ("/v1/messages/count_tokens", "max_tokens"),
    ],
)
def test_an_unknown_or_misspelt_field_is_refused_by_name(server, route, field):
    client, _ = server
    answer = client.post(route, json={**SEEDS[route], field: 1})
    assert answer.status_code == 400 and field in answer.text


def test_count_tokens_checks_the_model_it_is_asked_about(server):
    client, _ = server
    answer = client.post("/v1/messages/count_tokens", json={**SEEDS["/v1/messages/count_tokens"], "model": "gpt-9"})
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"
