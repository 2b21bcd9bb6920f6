"""Chat messages as a session holds them: validation, identity and layout in the rendered token stream.

Pure functions of messages and token ids; the Session keeps the state (the messages, each message's span
of tokens, the tools it rendered with, the open reply) and decides what to append or cut.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from kvmemory.errors import ContextLengthError, InvalidMessageError
from kvmemory.runtime.chat import ChatRenderer
from kvmemory.runtime.segments import Segment

ROLES = ("system", "user", "assistant", "tool")
MessageSpan = tuple[str, int, int]  # (fingerprint, start, end) of one message in the session's tokens


def fingerprint(message: dict) -> str:
    return hashlib.sha1(json.dumps(message, sort_keys=True, default=str).encode()).hexdigest()


def same_messages(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(fingerprint(dict(x)) == fingerprint(y) for x, y in zip(a, b))


def tools_key(tools) -> str:
    """Identity of a tool list: a conversation renders differently under different tools."""
    return json.dumps(tools, sort_keys=True, default=str) if tools else ""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def message_kind(msg: dict) -> str:
    """The segment kind a message becomes (what memory policies match on)."""
    role = msg.get("role")
    if role == "tool":
        return "tool_output"
    if role == "assistant" and msg.get("tool_calls"):
        return "tool_call"
    return {"system": "system", "user": "user", "assistant": "assistant"}.get(role, "text")


def planned_segment(msg: dict, start: int, end: int) -> Segment:
    """The segment a message will occupy (for the memory manager's fit check before anything runs)."""
    kind = message_kind(msg)
    return Segment(
        -1, kind, start, end, msg.get("role"), msg.get("name"), tuple(msg.get("tags", ())), text=msg["content"]
    )


def validate_messages(messages, earlier: list[dict]) -> list[dict]:
    """Copies of ``messages``, checked: known role, text content, tool messages that name their tool (a
    ``tool_call_id`` of a call in ``earlier`` or in ``messages`` names it)."""
    if isinstance(messages, Mapping) or not isinstance(messages, (list, tuple)):
        raise InvalidMessageError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    calls = {c.get("id"): (c.get("function") or c).get("name") for m in earlier for c in m.get("tool_calls") or []}
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidMessageError(f"message {i} is a {type(message).__name__}, not a dict")
        msg = dict(message)
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidMessageError(f"message {i} has role {role!r}; roles are {', '.join(ROLES)}")
        content = msg.get("content")
        if content is None:
            msg["content"] = ""
        elif not isinstance(content, str):
            raise InvalidMessageError(f"message {i} content must be a string, got {type(content).__name__}")
        for call in msg.get("tool_calls") or []:
            if not isinstance(call, Mapping) or not isinstance((call.get("function") or call).get("name"), str):
                raise InvalidMessageError(f"message {i} has a tool call without a name: {call!r}")
            calls[call.get("id")] = (call.get("function") or call)["name"]
        if role == "tool" and not isinstance(msg.get("name"), str):
            name = calls.get(msg.get("tool_call_id")) if msg.get("tool_call_id") is not None else None
            if name is None:
                raise InvalidMessageError(
                    f"tool message {i} names no tool: give 'name', or a 'tool_call_id' of an earlier tool call"
                )
            msg["name"] = name
        out.append(msg)
    return out


def render_with_spans(
    renderer: ChatRenderer,
    messages: list[dict],
    tools,
    add_generation_prompt: bool,
    held: list[MessageSpan] | None = None,
    tokens: list[int] | None = None,
    limit: int | None = None,
    progress=None,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of the conversation and each message's [start, end) in them. ``held`` spans (rendered
    with the same tools) whose tokens are unchanged in ``tokens`` are reused instead of re-rendering. A
    conversation longer than ``limit`` tokens raises before its messages are located
    (``ChatRenderer.message_ends``; ``progress(0, total)`` runs before, so that a caller can stop there)."""
    full = renderer.render(messages, tools, add_generation_prompt)
    if limit is not None and len(full) > limit:
        raise ContextLengthError(f"conversation renders to {len(full)} tokens; the engine's position limit is {limit}")
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages if held is not None else []):
        if i < len(held) and held[i][0] == fingerprint(msg):
            s, e = held[i][1:]
            if (not spans or spans[-1][1] == s) and full[s:e] == tokens[s:e]:
                spans.append((s, e))
                continue
        break
    if progress is not None:
        progress(0, len(full))
    for end in renderer.message_ends(messages, tools, len(spans), full, progress):
        spans.append((spans[-1][1] if spans else 0, min(end, len(full))))
    return full, spans
