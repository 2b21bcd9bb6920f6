"""OpenAI Chat Completions (``POST /v1/chat/completions``) ↔ the serving core.

The session is named by the ``x-session-id`` header or the ``user`` field; without either the request runs
on a session of its own, as on a stateless server. ``kvmemory: {"policy": {...}}`` (``extra_body`` in the
openai client) gives the session its memory policy. Parameters kvmemory cannot honour (``n`` > 1,
``logprobs``, a JSON ``response_format``, penalties, forced tool choice) are refused with a 400 naming them.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvmemory.integrations.dialects.common import (
    MAX_SEED,
    KVMemoryOptions,
    allowed_tools,
    check_schema,
    check_tool_name,
    json_object,
    new_id,
    parse,
    sse,
    tool_choice,
    unsupported,
)
from kvmemory.integrations.serving import BadRequest, Reply, Turn


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Function(Strict):
    name: str
    arguments: str | dict = "{}"


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: Function


class Part(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class FunctionSpec(Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionSpec


class Request(Strict):
    messages: list[Message] = Field(min_length=1)
    model: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: dict | None = None
    user: str | None = None
    kvmemory: KVMemoryOptions | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    parallel_tool_calls: bool | None = None  # accepted: the model may call several tools in one reply
    metadata: dict | None = None  # accepted: kept by OpenAI for its dashboard, meaningless here
    store: bool | None = None


def request(body) -> Request:
    req = parse(Request, body)
    if req.n not in (None, 1):
        raise unsupported("n", "one choice per request")
    if req.logprobs or req.top_logprobs:
        raise unsupported("logprobs")
    if req.response_format not in (None, {"type": "text"}):
        raise unsupported("response_format", "only text replies")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) is not None and not -2 <= getattr(req, name) <= 2:
            raise BadRequest(f"{name} must be between -2 and 2, got {getattr(req, name)}", param=name)
    if req.logit_bias:
        raise unsupported("logit_bias")
    tool_choice(req.tool_choice, [tool.function.name for tool in req.tools or []])
    if isinstance(req.stop, list) and len(req.stop) > 4:
        raise BadRequest("at most 4 stop sequences", param="stop")
    for i, tool in enumerate(req.tools or []):
        check_tool_name(tool.function.name, f"tools[{i}].function.name")
        check_schema(tool.function.parameters, f"tools[{i}].function.parameters")
    return req


def sampling(max_tokens: int | None, temperature, top_p, stop, seed) -> dict:
    """The keywords of ``Session.start_generation`` (the defaults OpenAI documents: greedy here)."""
    return {
        "max_new_tokens": max_tokens or 512,
        "temperature": temperature if temperature is not None else 0.0,
        "top_p": top_p if top_p is not None else 1.0,
        "stop": [stop] if isinstance(stop, str) else stop or None,
        "seed": seed,
    }


def chat_messages(messages: list[Message]) -> list[dict]:
    """OpenAI messages → the dicts a Session renders (text parts joined, tool-call arguments parsed)."""
    out = []
    for i, message in enumerate(messages):
        msg = {"role": "system" if message.role == "developer" else message.role}
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type not in ("text", "input_text", "output_text") or part.text is None:
                    raise BadRequest(
                        f"content part of type {part.type!r}: only text", param=f"messages[{i}].content[{j}]"
                    )
            content = "".join(part.text for part in content)
        msg["content"] = content or ""
        if message.name is not None:
            msg["name"] = message.name
        if message.tool_call_id is not None:
            msg["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": call.function.arguments
                        if isinstance(call.function.arguments, dict)
                        else json_object(call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"),
                    },
                }
                for j, call in enumerate(message.tool_calls)
            ]
        out.append(msg)
    return out


def turn(req: Request, session: str | None) -> Turn:
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools or []] if req.tool_choice != "none" else None
    return Turn(
        chat_messages(req.messages),
        tools or None,
        {
            **sampling(req.max_completion_tokens or req.max_tokens, req.temperature, req.top_p, req.stop, req.seed),
            "frequency_penalty": req.frequency_penalty,
            "presence_penalty": req.presence_penalty,
        },
        session,
        req.kvmemory.policy if req.kvmemory else None,
        tool_choice(req.tool_choice, [tool.function.name for tool in req.tools or []]),
        allowed_tools=allowed_tools(req.tool_choice, [tool.function.name for tool in req.tools or []]),
    )


def message(reply: Reply) -> dict:
    if not reply.tool_calls:
        return {"role": "assistant", "content": reply.content}
    calls = [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": json.dumps(c["args"])}}
        for c in reply.tool_calls
    ]
    return {"role": "assistant", "content": reply.content or None, "tool_calls": calls}


def usage(reply: Reply) -> dict:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
    }


def finish_reason(reply: Reply) -> str:
    return reply.finish_reason if reply.finish_reason in ("stop", "length", "tool_calls") else "stop"


def answer(reply: Reply, model: str) -> dict:
    return {
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": message(reply), "finish_reason": finish_reason(reply)}],
        "usage": usage(reply),
    }


async def events(req: Request, items: AsyncIterator[str | Reply], model: str) -> AsyncIterator[str]:
    """Chunks as OpenAI streams them: the role, text deltas, tool calls at the end, the finish reason, a
    usage chunk when ``stream_options.include_usage``, then ``[DONE]``."""
    ident, created = new_id("chatcmpl-"), int(time.time())

    def chunk(delta: dict | None, finish: str | None = None, **extra) -> str:
        body = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model}
        body["choices"] = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return sse({**body, **extra})

    yield chunk({"role": "assistant", "content": ""})
    shown = ""
    async for item in items:
        if isinstance(item, str):
            shown += item
            yield chunk({"content": item})
            continue
        reply = item
        if reply.tool_calls:
            calls = [{"index": i, **call} for i, call in enumerate(message(reply)["tool_calls"])]
            yield chunk({"tool_calls": calls})
        elif reply.content.startswith(shown) and len(reply.content) > len(shown):
            yield chunk({"content": reply.content[len(shown) :]})
        yield chunk({}, finish_reason(reply))
        if (req.stream_options or {}).get("include_usage"):
            yield chunk(None, usage=usage(reply))
    yield "data: [DONE]\n\n"
