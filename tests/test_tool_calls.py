"""Tool calls in each model's own format: written (``ChatRenderer.tool_call_text``), read back
(``parse_tool_calls``, tags or a bare object) and required (``RequiredToolCall``: the reply must call one of
the tools), on the small model's template (no native tools: Hermes tags folded in) and Qwen2.5-Coder's."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmemory import ToolCallParseError
from kvmemory.runtime.chat import RequiredToolCall, object_end, parse_tool_calls
from kvmemory.runtime.tool_arguments import ToolArguments
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


READ_FILE = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "start_line": {"type": "integer"},
        "ratio": {"type": "number"},
        "mode": {"type": "string", "enum": ["text", "bytes"]},
        "follow": {"type": "boolean"},
    },
    "required": ["path"],
}


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_arguments_written_under_the_schema_are_a_valid_object_whatever_the_model_picks(renderer, seed):
    """Any path through what ``ToolArguments`` allows (here random picks among the allowed tokens, of which a
    string's free text is most) ends in an object of the schema's keys, each value of its type."""
    grammar, rng = ToolArguments(READ_FILE, renderer.tokenizer), random.Random(seed)
    ends = torch.tensor([renderer.tokenizer.encode(t, add_special_tokens=False)[0] for t in ('"', "}", ", ")])
    text, steps = "", 0
    while (allowed := grammar.allowed(text)) is not None:
        closing = allowed[torch.isin(allowed, ends)]  # (a walk that only ever picks free text never ends)
        choices = closing if len(closing) and (steps > 6 or rng.random() < 0.3) else allowed
        text += renderer.tokenizer.decode([int(choices[rng.randrange(len(choices))])])
        steps += 1
        assert steps < 400, text
    arguments = json.loads(text)
    assert set(arguments) <= set(READ_FILE["properties"]) and "path" in arguments
    kinds = {"string": str, "integer": int, "number": (int, float), "boolean": bool}
    for key, value in arguments.items():
        schema = READ_FILE["properties"][key]
        assert isinstance(value, kinds[schema["type"]]) and value in schema.get("enum", [value])


@settings(max_examples=10, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_a_string_with_a_max_length_closes_within_it(renderer, seed):
    """A walk that never chooses to close a ``maxLength`` string still ends: past the room left only shorter
    tokens are allowed, then only the quote (a small model's command otherwise runs to the token limit)."""
    schema = {"type": "object", "properties": {"command": {"type": "string", "maxLength": 24}}, "required": ["command"]}
    grammar, rng = ToolArguments(schema, renderer.tokenizer), random.Random(seed)
    quote = renderer.tokenizer.encode('"', add_special_tokens=False)[0]
    text, steps = "", 0
    while (allowed := grammar.allowed(text)) is not None:
        free = allowed[allowed != quote]
        choices = free if len(free) and text.count('"') == 3 else allowed  # inside the string: never close
        text += renderer.tokenizer.decode([int(choices[rng.randrange(len(choices))])])
        steps += 1
        assert steps < 200, text
    assert len(json.loads(text)["command"]) <= 24


def test_a_required_call_holds_its_arguments_to_the_tools_schema(renderer):
    """Greedy on noise: the one call the reply makes names a real tool, and its arguments are that tool's."""
    schemas = {"read_file": READ_FILE, "run_command": {"type": "object", "properties": {"command": {"type": "string"}}}}
    required = RequiredToolCall(renderer, list(schemas), frozenset({0}), schemas)
    reply: list[int] = []
    generator = torch.Generator().manual_seed(3)
    for _ in range(300):
        allowed = required(reply)
        if allowed is None:
            allowed = list(range(len(renderer.tokenizer)))
        allowed = torch.as_tensor(allowed)
        if allowed.tolist() == [0]:
            break
        logits = torch.randn(len(renderer.tokenizer), generator=generator)
        logits[renderer.tokenizer.encode('"', add_special_tokens=False)[0]] += 4  # strings end in a while
        reply.append(int(allowed[logits[allowed].argmax()]))
    content, calls = parse_tool_calls(renderer.tokenizer.decode(reply))
    assert len(calls) == 1 and calls[0]["name"] in schemas
    assert set(calls[0]["args"]) <= set(schemas[calls[0]["name"]]["properties"])
