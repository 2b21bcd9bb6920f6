"""The OpenAI Responses API (``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``) ↔ the core.

``input`` is a string or a list of items (messages with text parts, ``function_call`` and
``function_call_output`` items); ``instructions`` become the system message of this turn only (as OpenAI
documents: they are not carried over by ``previous_response_id``). A stored response remembers the
conversation its session holds after it, so a request with ``previous_response_id`` continues that session and
prefills only its new input. Without ``previous_response_id`` (a client that resends the whole conversation,
as Codex does) the session is the one ``prompt_cache_key`` or the ``x-session-id`` header names, else the one
the conversation's first messages lead to. Only function tools reach the model: hosted tools (``web_search``,
namespaces) are left out of the prompt, since this server cannot run them. Streaming sends the Responses event
stream (``response.created`` … ``response.completed``).

Compaction is answered in latent space (``integrations/context_edits.py``): ``context_management`` entries of type
``compaction`` and ``POST /v1/responses/compact`` compact the session's cache and return a ``compaction`` item
that stands for the conversation so far; sent back in place of it, it costs no prefill.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvmemory.integrations.context_edits import (
    COMPACT_TRIGGER_TOKENS,
    AppliedEdit,
    CompactContext,
    EditsApplied,
    mark_content,
)
from kvmemory.integrations.dialects.common import (
    MAX_SEED,
    KVMemoryOptions,
    Open,
    allowed_tools,
    check_schema,
    check_tool_name,
    json_object,
    new_id,
    parse,
    sse,
    tool_choice,
    type_named,
    unsupported,
)
from kvmemory.integrations.dialects.openai_chat import sampling
from kvmemory.integrations.serving import BadRequest, Reply, Turn


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: str | Annotated[list[dict], Field(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    store: bool = True
    metadata: dict | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None
    reasoning: dict | None = None
    include: list[str] | None = None
    truncation: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    stream_options: dict | None = None
    client_metadata: dict | None = None
    context_management: list[dict] | None = None
    kvmemory: KVMemoryOptions | None = None


class CompactRequest(BaseModel):
    """``POST /v1/responses/compact``: the conversation to compact, as ``POST /v1/responses`` takes it."""

    model_config = ConfigDict(extra="forbid")
    model: str | None
    input: str | Annotated[list[dict], Field(min_length=1)] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    image: dict | None = None
    kvmemory: KVMemoryOptions | None = None


class Compaction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["compaction"]
    compact_threshold: int | None = Field(None, ge=0)


class CompactionItem(Open):
    type: Literal["compaction"]
    encrypted_content: str
    id: str | None = None


def compact_request(body) -> CompactRequest:
    return parse(CompactRequest, body)


def context_edits(req: Request) -> list[CompactContext]:
    """``context_management`` as the core's edits: ``compaction`` entries (another type is refused)."""
    edits = []
    for i, raw in enumerate(req.context_management or []):
        at = f"context_management[{i}]"
        if not isinstance(raw, dict) or raw.get("type") != "compaction":
            raise BadRequest(f"{at}.type {type_named(raw)!r} is not supported: only 'compaction'", param=f"{at}.type")
        entry = parse(Compaction, raw, at)
        threshold = entry.compact_threshold
        edits.append(CompactContext(threshold if threshold is not None else COMPACT_TRIGGER_TOKENS))
    return edits


def request(body) -> Request:
    req = parse(Request, body)
    context_edits(req)  # a bad entry fails before anything runs
    tool_choice(req.tool_choice, function_names(req))
    if (req.text or {}).get("format", {"type": "text"}) != {"type": "text"}:
        raise unsupported("text.format", "only text replies")
    if req.truncation not in (None, "disabled"):
        raise unsupported("truncation", "kvmemory compacts the session's cache instead (see its memory policy)")
    for i, tool in enumerate(req.tools or []):
        if tool.get("type") != "function":
            continue  # a hosted tool (web_search, a namespace): left out, as this server cannot run it
        spec = parse(FunctionTool, tool)
        check_tool_name(spec.name, f"tools[{i}].name")
        check_schema(spec.parameters, f"tools[{i}].parameters")
    return req


class TextPart(Open):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(Open):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict]


class FunctionCallItem(Open):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str | dict = "{}"


class FunctionCallOutputItem(Open):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict]


ITEMS = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "compaction": CompactionItem,
}


def input_messages(req, expand=None) -> tuple[list[dict], bool]:
    """The request's input items as chat dicts (``function_call`` items become the assistant's tool calls),
    and whether a ``compaction`` item stood in for everything before it (``expand(its content, where)``: the
    conversation its mark holds, or None for another server's compaction, which this server cannot read)."""
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input or []
    out: list[dict] = []
    expanded = False
    for i, raw in enumerate(items):
        where = f"input[{i}]"
        kind = raw.get("type", "message")
        if kind == "reasoning":
            continue  # a reasoning model's item sent back; this model keeps no hidden reasoning
        if not isinstance(kind, str) or kind not in ITEMS:
            raise unsupported(f"{where}.type", f"input items of type {type_named(raw)!r}")
        item = parse(ITEMS[kind], raw, where)
        if isinstance(item, CompactionItem):
            marked = expand(item.encrypted_content, where) if expand is not None else None
            if marked is None:
                raise BadRequest(
                    f"{where} was made by another server: its encrypted content is not readable here", param=where
                )
            out, expanded = list(marked), True
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": text_of(item.content, f"{where}.content")})
        elif isinstance(item, FunctionCallItem):
            arguments = item.arguments
            if isinstance(arguments, str):
                arguments = json_object(arguments, f"{where}.arguments")
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
            if out and out[-1]["role"] == "assistant" and not out[-1]["content"] or out and out[-1].get("tool_calls"):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            output = text_of(item.output, f"{where}.output")
            out.append({"role": "tool", "content": output, "tool_call_id": item.call_id})
    return out, expanded


def text_of(content: str | list[dict], where: str) -> str:
    """A message's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind not in ("input_text", "output_text", "text"):
            raise unsupported(f"{where}[{j}]", f"content of type {type_named(part)!r}: only text")
        texts.append(parse(TextPart, part, f"{where}[{j}]").text)
    return "".join(texts)


def name_tool_outputs(messages: list[dict], calls: dict[str, str]) -> None:
    """Give each tool message the name of its call (from this request's calls, or ``calls`` of earlier turns)."""
    for msg in messages:
        for call in msg.get("tool_calls") or []:
            calls.setdefault(call["id"], call["function"]["name"])
    for msg in messages:
        if msg["role"] == "tool":
            name = calls.get(msg["tool_call_id"])
            if name is None:
                raise BadRequest(f"function_call_output for unknown call_id {msg['tool_call_id']!r}", param="input")
            msg["name"] = name


def turn(req, session: str | None, earlier: list[dict], calls: dict[str, str], expand=None) -> Turn:
    """The turn: ``earlier`` is the conversation a stored previous response left (empty without one; a
    compaction item in the input stands in for it)."""
    new, expanded = input_messages(req, expand)
    if expanded:
        earlier = []
    name_tool_outputs(earlier + new, dict(calls))
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req, CompactRequest):  # compact now, write nothing
        policy = req.kvmemory.policy if req.kvmemory else None
        return Turn(system + earlier + new, None, {}, session, policy, None, [CompactContext(0, pause=True)])
    tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k not in ("type", "strict")}}
        for t in req.tools or []
        if t.get("type") == "function"
    ]
    params = sampling(req.max_output_tokens, req.temperature, req.top_p, None, req.seed)
    return Turn(
        system + earlier + new,
        tools if tools and req.tool_choice != "none" else None,
        params,
        session,
        req.kvmemory.policy if req.kvmemory else None,
        tool_choice(req.tool_choice, function_names(req)),
        context_edits(req),
        allowed_tools(req.tool_choice, function_names(req)),
    )


def function_names(req) -> list[str]:
    return [t.get("name") for t in req.tools or [] if t.get("type") == "function"]


def compaction_items(edits: list[AppliedEdit]) -> list[dict]:
    """A compaction item for each compaction the turn ran, naming the mark the server keeps."""
    return [
        {
            "type": "compaction",
            "id": new_id("cmp_"),
            "encrypted_content": mark_content(e.mark),
            "created_by": "kvmemory",
        }
        for e in edits
        if e.kind == "compaction" and e.mark is not None
    ]


def compacted(ident: str, messages: list[dict], reply: Reply) -> dict:
    """``POST /v1/responses/compact``'s answer: the conversation's user messages, then one compaction item."""
    users = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": m["content"]}]}
        for m in messages
        if m["role"] == "user"
    ]
    return {
        "id": ident,
        "object": "response.compaction",
        "created_at": int(time.time()),
        "output": users + compaction_items(reply.applied_edits),
        "usage": usage(reply),
    }


def output_items(reply: Reply, compactions: list[dict] | None = None) -> list[dict]:
    """The reply as output items, after the compactions it ran (``compactions``: as already streamed)."""
    items = compaction_items(reply.applied_edits) if compactions is None else list(compactions)
    if reply.finish_reason == "compaction":
        return items
    if reply.content or not reply.tool_calls:
        text = {"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}
        items.append(
            {"type": "message", "id": new_id("msg_"), "status": "completed", "role": "assistant", "content": [text]}
        )
    for call in reply.tool_calls:
        items.append(
            {
                "type": "function_call",
                "id": new_id("fc_"),
                "call_id": call["id"],
                "name": call["name"],
                "arguments": json.dumps(call["args"]),
                "status": "completed",
            }
        )
    return items


def usage(reply: Reply) -> dict:
    return {
        "input_tokens": reply.prompt_tokens,
        "input_tokens_details": {"cached_tokens": reply.cached_tokens},
        "output_tokens": reply.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def response(
    req: Request, ident: str, model: str, reply: Reply | None, created: int | None = None, compactions=None
) -> dict:
    """The response object (``reply`` None: one still in progress; ``compactions``: as already streamed)."""
    incomplete = reply is not None and reply.finish_reason == "length"
    return {
        "id": ident,
        "object": "response",
        "created_at": created or int(time.time()),
        "status": "in_progress" if reply is None else "incomplete" if incomplete else "completed",
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": model,
        "output": [] if reply is None else output_items(reply, compactions),
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "store": req.store,
        "temperature": req.temperature if req.temperature is not None else 0.0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "metadata": req.metadata or {},
        "usage": None if reply is None else usage(reply),
        "user": req.user,
    }


async def events(req: Request, ident: str, model: str, items: AsyncIterator, done=None) -> AsyncIterator[str]:
    """The Responses event stream; a compaction item first for each compaction the turn ran (its edits come
    before the reply's text); ``done(reply, body)`` runs before ``response.completed`` (to store it)."""
    created, number = int(time.time()), 0

    def event(kind: str, **fields) -> str:
        nonlocal number
        number += 1
        return sse({"type": kind, "sequence_number": number - 1, **fields}, kind)

    yield event("response.created", response=response(req, ident, model, None, created))
    yield event("response.in_progress", response=response(req, ident, model, None, created))
    message_id, text, opened, compactions = new_id("msg_"), "", False, []
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    reply = None
    async for item in items:
        if isinstance(item, Reply):
            reply = item
            break
        if isinstance(item, EditsApplied):
            for compaction in compaction_items(item.edits):
                yield event("response.output_item.added", output_index=len(compactions), item=compaction)
                yield event("response.output_item.done", output_index=len(compactions), item=compaction)
                compactions.append(compaction)
            continue
        at = len(compactions)
        if not opened:
            opened = True
            yield event("response.output_item.added", output_index=at, item=message_item(message_id, [], "in_progress"))
            yield event("response.content_part.added", item_id=message_id, output_index=at, content_index=0, part=part)
        text += item
        yield event(
            "response.output_text.delta", item_id=message_id, output_index=at, content_index=0, delta=item, logprobs=[]
        )
    final = response(req, ident, model, reply, created, compactions)
    output, at = final["output"], len(compactions)
    if len(output) > at and output[at]["type"] == "message":
        output[at]["id"] = message_id
        if not opened:
            yield event("response.output_item.added", output_index=at, item=message_item(message_id, [], "in_progress"))
            yield event("response.content_part.added", item_id=message_id, output_index=at, content_index=0, part=part)
        rest = reply.content[len(text) :] if reply.content.startswith(text) else ""
        if rest:
            yield event(
                "response.output_text.delta",
                item_id=message_id,
                output_index=at,
                content_index=0,
                delta=rest,
                logprobs=[],
            )
        done_part = output[at]["content"][0]
        yield event(
            "response.output_text.done",
            item_id=message_id,
            output_index=at,
            content_index=0,
            text=done_part["text"],
            logprobs=[],
        )
        yield event("response.content_part.done", item_id=message_id, output_index=at, content_index=0, part=done_part)
        yield event("response.output_item.done", output_index=at, item=output[at])
    for index, item in enumerate(output):
        if item["type"] != "function_call":
            continue
        yield event(
            "response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}
        )
        yield event(
            "response.function_call_arguments.delta", item_id=item["id"], output_index=index, delta=item["arguments"]
        )
        yield event(
            "response.function_call_arguments.done", item_id=item["id"], output_index=index, arguments=item["arguments"]
        )
        yield event("response.output_item.done", output_index=index, item=item)
    if done is not None:
        done(reply, final)
    kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
    yield event(kind, response=final)


def message_item(ident: str, content: list, status: str) -> dict:
    return {"type": "message", "id": ident, "status": status, "role": "assistant", "content": content}
