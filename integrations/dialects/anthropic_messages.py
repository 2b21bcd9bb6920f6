"""The Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) ↔ the core.

Messages is stateless: the client resends the whole conversation every turn (as Claude Code does). The
session is the one the conversation's first messages lead to (or the one the ``x-session-id`` header
names), so each turn prefills only what was added since the last; usage reports the reused prefix as
``cache_read_input_tokens`` and ``input_tokens`` as the rest, as Anthropic counts them. Text, ``tool_use`` and
``tool_result`` blocks are supported (``thinking`` blocks a client sends back are dropped; images and
documents are refused); errors come in Anthropic's shape (``{"type": "error", "error": {...}}``).

``context_management`` is answered in latent space (``integrations/context_edits.py``):
``clear_tool_uses_20250919`` compacts old tool results in the session's cache and reports them in
``context_management.applied_edits``; ``compact_20260112`` compacts the session and answers with a
``compaction`` block that stands for the conversation so far (sent back in place of it, it costs no prefill);
``clear_thinking_20251015`` has nothing to clear (the session keeps no thinking). Other edit types are refused.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from kvmemory.integrations.context_edits import (
    CLEAR_KEEP,
    CLEAR_TRIGGER_TOKENS,
    COMPACT_TRIGGER_TOKENS,
    AppliedEdit,
    ClearToolResults,
    CompactContext,
    ContextEdit,
    EditsApplied,
    mark_content,
)
from kvmemory.integrations.dialects.common import (
    KVMemoryOptions,
    Open,
    Strict,
    check_schema,
    check_tool_name,
    new_id,
    parse,
    sse,
    tool_choice,
    type_named,
    unsupported,
)
from kvmemory.integrations.dialects.openai_chat import sampling
from kvmemory.integrations.serving import APIError, BadRequest, Reply, Turn

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    499: "api_error",
    500: "api_error",
    503: "overloaded_error",
    507: "api_error",
}


class TextBlock(Open):
    type: Literal["text"]
    text: str


class ToolUseBlock(Open):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ToolResultBlock(Open):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict] = ""
    is_error: bool | None = None


class CompactionBlock(Open):
    type: Literal["compaction"]
    content: str | None = None
    encrypted_content: str | None = None


BLOCKS = {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "compaction": CompactionBlock}


def block(raw, where: str, allowed: tuple[str, ...]) -> BaseModel | None:
    """The content block at ``where`` as its typed model; None for a block kvmemory leaves out (``thinking``);
    a BadRequest for a malformed block or one of a type not ``allowed`` here."""
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind in ("thinking", "redacted_thinking") and "thinking" in allowed:
        return None
    if kind not in allowed:
        raise unsupported(where, f"blocks of type {type_named(raw)!r} here: only {', '.join(allowed)}")
    return parse(BLOCKS[kind], raw, where)


class Threshold(Strict):
    type: str
    value: int = Field(ge=0)


class ClearToolUsesEdit(Strict):
    type: Literal["clear_tool_uses_20250919"]
    trigger: Threshold | None = None
    keep: Threshold | None = None
    clear_at_least: Threshold | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class ClearThinkingEdit(Strict):
    type: Literal["clear_thinking_20251015"]
    keep: dict | str | None = None


class CompactEdit(Strict):
    type: Literal["compact_20260112"]
    trigger: Threshold | None = None
    instructions: str | None = None  # (for a summary: kvmemory compacts in latent space and writes none)
    pause_after_compaction: bool = False


class ContextManagement(Strict):
    edits: list[dict] = Field(default_factory=list)


EDITS = {
    "clear_tool_uses_20250919": ClearToolUsesEdit,
    "clear_thinking_20251015": ClearThinkingEdit,
    "compact_20260112": CompactEdit,
}


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant", "system"]  # Claude Code sends system reminders as messages too
    content: str | list[dict]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control and the like
    name: str
    description: str | None = None
    input_schema: dict
    type: str | None = None


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    stream: bool = False
    metadata: dict | None = None
    thinking: dict | None = None  # accepted and not used: this model keeps no hidden reasoning
    service_tier: str | None = None
    context_management: ContextManagement | None = None
    output_config: dict | None = None  # (reasoning effort: accepted, nothing to set on this model)
    kvmemory: KVMemoryOptions | None = None


class CountRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[dict] | None = None
    tools: list[Tool] | None = None
    tool_choice: dict | None = None
    thinking: dict | None = None
    context_management: ContextManagement | None = None
    output_config: dict | None = None


def request(body, model: type[BaseModel] = Request):
    req = parse(model, body)
    if getattr(req, "top_k", None):
        raise unsupported("top_k")
    tool_choice(req.tool_choice, [tool.name for tool in req.tools or []])
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise unsupported(f"tools[{i}]", f"server tools like {tool.type!r}; only client tools")
        check_tool_name(tool.name, f"tools[{i}].name")
        check_schema(tool.input_schema, f"tools[{i}].input_schema")
    context_edits(req)  # a bad edit fails before anything runs
    return req


def threshold(given: Threshold | None, kinds: tuple[str, ...], where: str) -> Threshold | None:
    if given is not None and given.type not in kinds:
        raise BadRequest(f"{where}.type must be {' or '.join(map(repr, kinds))}, got {given.type!r}", param=where)
    return given


def context_edits(req) -> list[ContextEdit]:
    """``context_management.edits`` as the core's context edits (a type kvmemory does not apply is refused)."""
    edits = []
    for i, raw in enumerate(req.context_management.edits if req.context_management else []):
        at = f"context_management.edits[{i}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind not in EDITS:
            known = ", ".join(EDITS)
            raise BadRequest(f"{at}.type {kind!r} is not an edit kvmemory applies (it applies {known})", param=at)
        edit = parse(EDITS[kind], raw, at)
        if isinstance(edit, ClearToolUsesEdit):
            trigger = threshold(edit.trigger, ("input_tokens", "tool_uses"), f"{at}.trigger")
            keep = threshold(edit.keep, ("tool_uses",), f"{at}.keep")
            least = threshold(edit.clear_at_least, ("input_tokens",), f"{at}.clear_at_least")
            if isinstance(edit.clear_tool_inputs, list):
                raise unsupported(f"{at}.clear_tool_inputs", "a list of tools (true clears every cleared use's input)")
            by_tokens = trigger is None or trigger.type == "input_tokens"
            edits.append(
                ClearToolResults(
                    trigger_tokens=(trigger.value if trigger else CLEAR_TRIGGER_TOKENS) if by_tokens else None,
                    trigger_tool_uses=None if by_tokens else trigger.value,
                    keep=keep.value if keep else CLEAR_KEEP,
                    exclude_tools=tuple(edit.exclude_tools or ()),
                    clear_at_least=least.value if least else 0,
                    clear_inputs=bool(edit.clear_tool_inputs),
                )
            )
        elif isinstance(edit, CompactEdit):
            trigger = threshold(edit.trigger, ("input_tokens",), f"{at}.trigger")
            edits.append(
                CompactContext(trigger.value if trigger else COMPACT_TRIGGER_TOKENS, edit.pause_after_compaction)
            )
    return edits


def text_blocks(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise BadRequest("must be a string or a list of text blocks", param=where)
    return "".join(block(raw, f"{where}[{j}]", ("text",)).text for j, raw in enumerate(blocks))


def chat_messages(req, expand=None) -> list[dict]:
    """System and messages as the dicts a Session renders: ``tool_use`` blocks become the assistant's tool
    calls, ``tool_result`` blocks tool messages (before the user's text of the same message). A ``compaction``
    block stands for everything before it: ``expand(its opaque content, where)`` gives the conversation it marks
    (without its system prompt), or None for another server's compaction, whose summary then stands in."""
    system = [{"role": "system", "content": text_blocks(req.system, "system")}] if req.system else []
    out = list(system)
    names: dict[str, str] = {}
    allowed = {
        "assistant": ("text", "tool_use", "thinking", "compaction"),
        "user": ("text", "tool_result"),
        "system": ("text",),
    }
    for i, message in enumerate(req.messages):
        raws = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        text, calls, results = [], [], []
        for j, raw in enumerate(raws):
            where = f"messages[{i}].content[{j}]"
            part = block(raw, where, allowed[message.role])
            if isinstance(part, TextBlock):
                text.append(part.text)
            elif isinstance(part, ToolUseBlock):
                names[part.id] = part.name
                calls.append(
                    {"id": part.id, "type": "function", "function": {"name": part.name, "arguments": part.input}}
                )
            elif isinstance(part, CompactionBlock):
                marked = expand(part.encrypted_content, where) if expand is not None else None
                if marked is None and part.content is None:
                    continue  # a compaction that failed: nothing stands in for anything
                if marked is None:
                    marked = [{"role": "user", "content": f"Summary of the conversation so far: {part.content}"}]
                out, text, calls, results = system + list(marked), [], [], []
                for message_ in marked:
                    for call in message_.get("tool_calls", []):
                        names[call["id"]] = call["function"]["name"]
            elif isinstance(part, ToolResultBlock):
                name = names.get(part.tool_use_id)
                if name is None:
                    raise BadRequest(f"tool_result for unknown tool_use_id {part.tool_use_id!r}", param=where)
                content = text_blocks(part.content, f"{where}.content")
                if part.is_error:
                    content = f"Error: {content}"
                results.append({"role": "tool", "content": content, "name": name, "tool_call_id": part.tool_use_id})
        out.extend(results)
        if message.role == "assistant":
            out.append({"role": "assistant", "content": "".join(text), **({"tool_calls": calls} if calls else {})})
        elif text or not results:
            out.append({"role": message.role, "content": "".join(text)})
    return out


def tools(req) -> list[dict] | None:
    if not req.tools or (req.tool_choice or {}).get("type") == "none":
        return None
    return [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description or "", "parameters": t.input_schema},
        }
        for t in req.tools
    ]


def turn(req: Request, session: str | None, expand=None) -> Turn:
    params = sampling(req.max_tokens, req.temperature, req.top_p, req.stop_sequences, None)
    policy = req.kvmemory.policy if req.kvmemory else None
    choice = tool_choice(req.tool_choice, [t.name for t in req.tools or []])
    return Turn(chat_messages(req, expand), tools(req), params, session, policy, choice, context_edits(req))


def compaction_blocks(edits: list[AppliedEdit]) -> list[dict]:
    """A compaction block for each compaction the turn ran: its opaque content names the mark the server
    keeps, and its summary says what happened (kvmemory writes no text summary)."""
    return [
        {
            "type": "compaction",
            "content": f"[kvmemory: the conversation before this point is held in the session's compacted KV "
            f"cache; {e.cleared_tokens} slots per head were freed. Send this block back in place of it.]",
            "encrypted_content": mark_content(e.mark),
        }
        for e in edits
        if e.kind == "compaction" and e.mark is not None
    ]


def applied_edits(edits: list[AppliedEdit]) -> dict:
    cleared = [e for e in edits if e.kind == "clear_tool_uses"]
    return {
        "applied_edits": [
            {
                "type": "clear_tool_uses_20250919",
                "cleared_tool_uses": e.cleared_tool_uses,
                "cleared_input_tokens": e.cleared_tokens,
            }
            for e in cleared
        ]
    }


def content(reply: Reply) -> list[dict]:
    blocks = compaction_blocks(reply.applied_edits)
    if reply.finish_reason == "compaction":
        return blocks
    blocks += [{"type": "text", "text": reply.content}] if reply.content or not reply.tool_calls else []
    blocks += [
        {"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"), "name": c["name"], "input": c["args"]}
        for c in reply.tool_calls
    ]
    return blocks


def stop_reason(reply: Reply) -> str:
    if reply.finish_reason == "compaction":
        return "compaction"
    if reply.tool_calls:
        return "tool_use"
    if reply.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if reply.stop_sequence else "end_turn"


def usage(reply: Reply | None, prompt: int = 0, cached: int = 0) -> dict:
    if reply is not None:
        prompt, cached = reply.prompt_tokens, reply.cached_tokens
    return {
        "input_tokens": prompt - cached,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
        "output_tokens": reply.completion_tokens if reply is not None else 0,
    }


def answer(reply: Reply, model: str, managed: bool = False) -> dict:
    """The response body; ``managed``: the request asked for context management (reported even if none ran)."""
    body = {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content(reply),
        "stop_reason": stop_reason(reply),
        "stop_sequence": reply.stop_sequence,
        "usage": usage(reply),
    }
    if managed:
        body["context_management"] = applied_edits(reply.applied_edits)
    return body


async def events(model: str, items: AsyncIterator, managed: bool = False) -> AsyncIterator[str]:
    """The Messages event stream: message_start; a compaction block for each compaction the turn ran (its
    edits come before the reply's text); the text block's deltas, tool_use blocks; message_delta with the
    stop reason, usage and (``managed``) the applied edits; message_stop."""
    start = {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(None),
    }
    yield sse({"type": "message_start", "message": start}, "message_start")
    text, index, reply = "", 0, None
    async for item in items:
        if isinstance(item, Reply):
            reply = item
            break
        if isinstance(item, EditsApplied):
            for block in compaction_blocks(item.edits):
                opened = {"type": "compaction", "content": None, "encrypted_content": None}
                yield sse(
                    {"type": "content_block_start", "index": index, "content_block": opened}, "content_block_start"
                )
                delta = {"type": "compaction_delta", **{k: block[k] for k in ("content", "encrypted_content")}}
                yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
                yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                index += 1
            continue
        if not text:
            yield sse(
                {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
                "content_block_start",
            )
        text += item
        yield sse(
            {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": item}},
            "content_block_delta",
        )
    text_index = index
    blocks = [block for block in content(reply) if block["type"] != "compaction"]  # (streamed already)
    for block in blocks:
        if block["type"] == "text":
            rest = block["text"][len(text) :] if block["text"].startswith(text) else ""
            if not text:
                yield sse(
                    {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
                    "content_block_start",
                )
            if rest:
                yield sse(
                    {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": rest}},
                    "content_block_delta",
                )
        else:
            if text and index == text_index and blocks[0]["type"] != "text":  # streamed text the parse did not keep
                yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
                index += 1
            yield sse(
                {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                "content_block_start",
            )
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            yield sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
        yield sse({"type": "content_block_stop", "index": index}, "content_block_stop")
        index += 1
    delta = {"stop_reason": stop_reason(reply), "stop_sequence": reply.stop_sequence}
    end = {"type": "message_delta", "delta": delta, "usage": usage(reply)}
    if managed:
        end["context_management"] = applied_edits(reply.applied_edits)
    yield sse(end, "message_delta")
    yield sse({"type": "message_stop"}, "message_stop")


def error_body(err: APIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}


def error_event(err: APIError) -> str:
    return sse(error_body(err), "error")
