"""What the dialects share: request checking with errors that name the field, server-sent events, ids."""

from __future__ import annotations

import json
import re
import uuid

from pydantic import BaseModel, ConfigDict, ValidationError

from kvmemory.integrations.serving import BadRequest

MAX_SEED = 2**63 - 1
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class Strict(BaseModel):
    """A request object whose unknown fields are refused by name (as the OpenAI and Anthropic APIs refuse them)."""

    model_config = ConfigDict(extra="forbid")


class Open(BaseModel):
    """A request object that may carry fields kvmemory does not use (``cache_control``, ``annotations``, ids)."""

    model_config = ConfigDict(extra="allow")


class KVMemoryOptions(Strict):
    """The ``kvmemory`` field every dialect takes: the session's memory policy (a ``MemoryPolicy`` dict)."""

    policy: dict | None = None


def parse(model: type[BaseModel], body, at: str = "") -> BaseModel:
    """``body`` (the request, or the part of it at ``at``) as ``model``, or a BadRequest naming the first bad
    field (``param``) and why."""
    if not isinstance(body, dict):
        raise BadRequest(f"{at or 'the request body'} must be a JSON object", param=at or None)
    try:
        return model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = field_path(first["loc"], at)
        if first["type"] == "extra_forbidden":
            raise BadRequest(f"unrecognized request argument: {where}", param=where) from None
        raise BadRequest(f"invalid '{where}': {first['msg']}", param=where) from None


def field_path(loc, at: str = "") -> str:
    out = at
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not (isinstance(part, str) and (part.startswith("function-") or part in ("str", "list", "dict"))):
            out += f".{part}" if out else str(part)
    return out or "body"


def type_named(value) -> str:
    """What the ``type`` field of a block or item (``value``) says, for an error: the text, or the JSON kind."""
    kind = value.get("type") if isinstance(value, dict) else value
    return kind if isinstance(kind, str) else type(kind).__name__


def unsupported(name: str, why: str = "kvmemory does not support it") -> BadRequest:
    return BadRequest(f"'{name}' is not supported: {why}", code="unsupported_parameter", param=name)


def check_tool_name(name: str, param: str) -> None:
    if not TOOL_NAME.fullmatch(name):
        raise BadRequest(f"invalid tool name {name!r}: use 1 to 64 letters, digits, _ or -", param=param)


def check_schema(schema, param: str) -> None:
    if schema is not None and (not isinstance(schema, dict) or schema.get("type", "object") != "object"):
        raise BadRequest("a tool's parameters must be a JSON schema of type 'object'", param=param)


def tool_choice(choice, names: list[str]) -> str | None:
    """A request's ``tool_choice`` as a ``Turn``'s: None (the model may answer in text), "required" (it must call
    one of the tools) or a tool's name. Takes every dialect's spelling: "auto", "none", "required", OpenAI's
    ``{"type": "function", "function": {"name": ...}}`` (Responses: ``{"type": "function", "name": ...}``), its
    ``allowed_tools`` (``allowed_tools``) and Anthropic's ``{"type": "auto" | "none" | "any" | "tool"}``."""
    if allowed_tools(choice, names) is not None:
        return "required"
    if isinstance(choice, dict):
        kind, function = choice.get("type"), choice.get("function")
        named = (function.get("name") if isinstance(function, dict) else None) or choice.get("name")
        choice = (named or choice) if kind in ("function", "tool") else {"any": "required"}.get(kind, kind)
    if choice in (None, "auto", "none"):
        return None
    if not isinstance(choice, str) or choice != "required" and choice not in names:
        raise BadRequest(
            f"tool_choice must be 'auto', 'none', 'required' or name one of the request's tools "
            f"({', '.join(names) or 'none given'}); got {json.dumps(choice)[:100]}",
            param="tool_choice",
        )
    if not names:
        raise BadRequest("tool_choice requires a tool call, but the request has no tools", param="tool_choice")
    return choice


def allowed_tools(choice, names: list[str]) -> list[dict] | None:
    """OpenAI's ``allowed_tools`` choice (Chat Completions: ``{"type": "allowed_tools", "allowed_tools": {"mode",
    "tools"}}``; Responses: ``{"type": "allowed_tools", "mode", "tools"}``) as a ``Turn``'s ``allowed_tools``; None
    for any other choice. The prompt keeps every tool (its cached prefix with it) and the call is held to these.
    Only ``mode: "required"`` is served: kvmemory constrains a call it requires, and cannot leave a reply free to
    answer in text yet bar some tools."""
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return None
    spec = choice.get("allowed_tools", choice)
    if not isinstance(spec, dict) or spec.get("mode") != "required":
        raise BadRequest("tool_choice allowed_tools is served with mode 'required' only", param="tool_choice")
    allowed = []
    for i, tool in enumerate(spec.get("tools") if isinstance(spec.get("tools"), list) else [None]):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise BadRequest(
                f"tool_choice allowed_tools names {json.dumps(name)[:100]}, which is none of the request's function "
                f"tools ({', '.join(names) or 'none given'})",
                param=f"tool_choice.tools[{i}]",
            )
        allowed.append({"type": "function", "function": {"name": name}})
    if not allowed:
        raise BadRequest("tool_choice allowed_tools names no tool", param="tool_choice.tools")
    return allowed


def json_object(text: str, param: str) -> dict:
    """Tool-call arguments given as a JSON string, parsed (they must be an object)."""
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError as err:
        raise BadRequest(f"tool call arguments are not JSON: {err.msg}", param=param) from None
    if not isinstance(value, dict):
        raise BadRequest("tool call arguments must be a JSON object", param=param)
    return value


def sse(data: dict, event: str | None = None) -> str:
    """One server-sent event (``event:`` line where the dialect names its events)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"
