"""A client's context management, answered in latent space, through the real ``anthropic`` and ``openai``
clients against the server (both deployments, as ``tests/test_http_api.py``): Anthropic's
``clear_tool_uses_20250919`` compacts old tool results in the session's cache and reports them;
``compact_20260112``, the Responses API's ``compaction`` entry and ``POST /v1/responses/compact`` compact the
session and answer with a compaction that stands for the conversation, which, sent back in its place, costs no
prefill. The tiny random model's words do not matter here, only what the sessions hold."""

from __future__ import annotations

import random

import pytest

from tests.test_http_api import KEY, OTHER_KEY, live, model_dir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.small_model

BETA = ["context-management-2025-06-27", "compact-2026-01-12"]


def words(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "port", "5433", "error", "line"]) for _ in range(n))


def tool_conversation(uses: int, tools=("read_file",)) -> list[dict]:
    """A user's task, then ``uses`` tool calls each answered by a ~150-word result."""
    messages = [{"role": "user", "content": "Find the bug and tell me what you read."}]
    for i in range(uses):
        name = tools[i % len(tools)]
        call = {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {"path": f"f{i}.py"}}
        messages.append({"role": "assistant", "content": [call]})
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": words(150, i)}
        messages.append({"role": "user", "content": [result]})
    return messages


TOOLS = [
    {
        "name": name,
        "description": "a tool",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for name in ("read_file", "keep_me")
]


def request(live, messages: list[dict], session: str, management: dict | None = None) -> dict:
    """The keywords of an Anthropic beta Messages call on ``session``."""
    extra = {"context_management": management} if management else {}
    return dict(
        model=live.model,
        max_tokens=4,
        messages=messages,
        tools=TOOLS,
        betas=BETA,
        extra_headers={"x-session-id": session},
        **extra,
    )


def clear_edit(**fields) -> dict:
    edit = {"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 100}}
    return {"edits": [{**edit, **fields}]}


def test_clearing_old_tool_results_compacts_them_in_the_cache_and_reports_it(live):
    client, session = live.anthropic(), f"clear-{live.kind}"
    messages = tool_conversation(5, tools=("read_file", "keep_me"))

    def send(history: list[dict], management: dict):
        return client.beta.messages.create(**request(live, history, session, management))

    before = live.stats(session) if live.get(f"/v1/sessions/{session}").status_code == 200 else None
    assert before is None
    first = send(messages, clear_edit(keep={"type": "tool_uses", "value": 1}, exclude_tools=["keep_me"]))
    applied = first.context_management.applied_edits
    # five results: three read_file results are older than the newest use; keep_me's two are never cleared
    assert [(e.type, e.cleared_tool_uses) for e in applied] == [("clear_tool_uses_20250919", 2)]
    assert applied[0].cleared_input_tokens > 100
    stats = live.stats(session)
    assert stats["slots_per_head"] < stats["logical_tokens"] - 100  # the results' slots are gone from the cache

    # the client's history is unchanged, so the next turn reuses the whole prefix; nothing is cleared twice
    history = messages + [{"role": "assistant", "content": first.content}, {"role": "user", "content": "Go on."}]
    second = send(history, clear_edit(keep={"type": "tool_uses", "value": 1}, exclude_tools=["keep_me"]))
    assert second.context_management.applied_edits == []
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens

    # below its trigger, or freeing less than clear_at_least, an edit does nothing
    quiet = send(
        tool_conversation(2),
        clear_edit(trigger={"type": "input_tokens", "value": 10**6}, keep={"type": "tool_uses", "value": 0}),
    )
    assert quiet.context_management.applied_edits == []


def test_compaction_answers_with_a_block_that_stands_for_the_conversation(live):
    client, session = live.anthropic(), f"compact-{live.kind}"
    messages = tool_conversation(3)
    edit = {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 100}}]}
    first = client.beta.messages.create(**request(live, messages, session, edit))
    assert first.content[0].type == "compaction" and first.content[0].encrypted_content.startswith("kvmemory-mark:")
    prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens

    # the client drops everything before the block: the server expands it, the session's cache still holds it
    then = [{"role": "assistant", "content": first.content}, {"role": "user", "content": "And now?"}]
    second = client.beta.messages.create(**request(live, then, session))
    assert second.usage.cache_read_input_tokens >= prompt
    assert second.usage.input_tokens < 40  # only the reply and the new question were prefilled

    pause = {"edits": [{**edit["edits"][0], "pause_after_compaction": True}]}
    paused = client.beta.messages.create(**request(live, messages, f"{session}-paused", pause))
    assert paused.stop_reason == "compaction" and [b.type for b in paused.content] == ["compaction"]

    with client.beta.messages.stream(**request(live, messages, f"{session}-streamed", edit)) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].type == "compaction" and streamed.content[0].encrypted_content.startswith("kvmemory")

    # a mark belongs to its API key: another key's request cannot expand it
    other = live.post(
        "/v1/messages",
        {
            "model": live.model,
            "max_tokens": 4,
            "messages": [{"role": "assistant", "content": [first.content[0].model_dump()]}],
        },
        key=OTHER_KEY,
    )
    assert other.status_code == 400 and "no longer holds" in other.json()["error"]["message"]


def test_context_management_the_server_does_not_apply_is_refused_by_name(live):
    base = {"model": live.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for edits, named in [
        ([{"type": "clear_everything_20990101"}], "context_management.edits[0].type"),
        ([{"type": "clear_tool_uses_20250919", "keep": {"type": "input_tokens", "value": 3}}], "edits[0].keep.type"),
        ([{"type": "clear_tool_uses_20250919", "clear_tool_inputs": ["read_file"]}], "clear_tool_inputs"),
        ([{"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": -1}}], "edits[0].trigger.value"),
    ]:
        done = live.post("/v1/messages", {**base, "context_management": {"edits": edits}})
        assert done.status_code == 400, done.text
        assert done.json()["type"] == "error" and named in done.json()["error"]["message"], done.json()
    done = live.post("/v1/responses", {"model": live.model, "input": "hi", "context_management": [{"type": "trim"}]})
    assert done.status_code == 400 and "context_management[0].type" in done.json()["error"]["message"]


def test_responses_compact_returns_an_item_the_next_request_continues_from(live):
    client = live.openai()
    conversation = [
        {"role": "user", "content": "Read the log. " + words(200, 1)},
        {"role": "assistant", "content": "I read it."},
        {"role": "user", "content": "And the config: " + words(200, 2)},
    ]
    compacted = client.responses.compact(model=live.model, input=conversation, prompt_cache_key=f"rc-{live.kind}")
    assert compacted.object == "response.compaction"
    assert [item.type for item in compacted.output] == ["message", "message", "compaction"]
    prompt = compacted.usage.input_tokens

    follow = [item.model_dump(exclude_none=True) for item in compacted.output[-1:]]
    follow.append({"role": "user", "content": "What did you read?"})
    reply = client.responses.create(
        model=live.model, input=follow, max_output_tokens=4, prompt_cache_key=f"rc-{live.kind}"
    )
    assert reply.usage.input_tokens_details.cached_tokens >= prompt - 8  # all but the assistant header it held
    assert reply.usage.input_tokens - reply.usage.input_tokens_details.cached_tokens < 40

    created = client.responses.create(
        model=live.model,
        input=conversation,
        max_output_tokens=4,
        context_management=[{"type": "compaction", "compact_threshold": 100}],
    )
    assert created.output[0].type == "compaction" and created.output[-1].type == "message"
    events = client.responses.create(
        model=live.model,
        input=conversation,
        max_output_tokens=4,  # (the tiny model always reaches it: the stream ends with response.incomplete)
        context_management=[{"type": "compaction", "compact_threshold": 100}],
        extra_headers={"x-session-id": f"rs-{live.kind}"},
        stream=True,
    )
    final = [event for event in events][-1].response
    assert final.output[0].type == "compaction" and final.output[0].encrypted_content.startswith("kvmemory-mark:")

    foreign = client.responses.create
    with pytest.raises(Exception, match="another server"):
        foreign(
            model=live.model, input=[{"type": "compaction", "encrypted_content": "gAAAA-opaque"}], max_output_tokens=4
        )
