"""Tool calls in each model's own format: written (``ChatRenderer.tool_call_text``), read back
(``parse_tool_calls``, tags or a bare object) and required (``RequiredToolCall``: the reply must call one of
the tools), on the small model's template (no native tools: Hermes tags folded in) and Qwen2.5-Coder's."""

from __future__ import annotations

import pytest

from kvmemory import ToolCallParseError
from kvmemory.runtime.chat import RequiredToolCall, object_end, parse_tool_calls
from tests.conftest import load_small_engine

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("read_file", "run_command")]


def qwen_renderer():
    from tests.test_contract import tiny_qwen_chat_engine

    return tiny_qwen_chat_engine().renderer


@pytest.fixture(params=["small", "qwen"])
def renderer(request):
    if request.param == "small":
        request.applymarker(pytest.mark.small_model)
        return load_small_engine().renderer
    request.applymarker(pytest.mark.coder_model)
    return qwen_renderer()


def test_a_call_written_in_the_models_format_reads_back(renderer):
    text = renderer.tool_call_text("read_file", {"path": "a.py"})
    assert "<tool_call>" in text and "read_file" in text
    content, calls = parse_tool_calls(text)
    assert content == "" and [(c["name"], c["args"]) for c in calls] == [("read_file", {"path": "a.py"})]


def test_a_bare_or_fenced_object_is_a_call_only_when_it_names_a_tool():
    bare = '{"name": "run_command", "arguments": {"command": "pytest -q"}} {"name": "run_command"}'
    assert parse_tool_calls(bare, TOOLS)[1][0]["args"] == {"command": "pytest -q"}  # the first of repeats
    fenced = '```json\n{"name": "read_file", "arguments": {"path": "x"}}\n```'
    assert parse_tool_calls(fenced, TOOLS)[1][0]["name"] == "read_file"
    for text in ('{"name": "restock_test", "arguments": {}}', '{"port": 5433}', "The port is 5433."):
        assert parse_tool_calls(text, TOOLS) == (text, [])  # no such tool, or no call: text stays text
    assert parse_tool_calls(bare) == (bare, [])  # no tools bound: nothing is read as a call
    with pytest.raises(ToolCallParseError, match="not valid JSON"):
        parse_tool_calls("<tool_call>{oops</tool_call>", TOOLS)


def test_a_required_call_opens_names_a_tool_lets_the_arguments_be_and_closes(renderer):
    required = RequiredToolCall(renderer, ["read_file", "run_command"], frozenset({0}))
    encode = lambda text: renderer.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    reply: list[int] = []
    while (allowed := required(reply)) is not None:  # the frame up to the arguments: one way, bar the name
        reply.append(max(allowed) if len(allowed) > 1 else allowed[0])
    head = renderer.tokenizer.decode(reply)
    name = "run_command" if "run_command" in head else "read_file"
    assert head.startswith("<tool_call>") and name in head
    reply += encode(' {"command": "pytest -q", "note": "a } in a string"}')
    while (allowed := required(reply)) != [0]:  # the template's closing, then the end of the turn
        assert len(allowed) == 1
        reply.append(allowed[0])
    content, calls = parse_tool_calls(renderer.tokenizer.decode(reply))
    assert [c["name"] for c in calls] == [name] and calls[0]["args"]["note"] == "a } in a string"
    assert required(encode(head) + encode(' {"a": 1}} and then some prose')) == [0]  # ran past: end the turn


def test_the_end_of_a_json_object_is_found_through_strings_and_nesting():
    assert object_end(' {"a": {"b": [1, "]}"]}} tail') == len(' {"a": {"b": [1, "]}"]}}')
    assert object_end(' {"a": "\\" }') is None and object_end("not json") == 0
