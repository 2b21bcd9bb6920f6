"""Request bodies read as strict JSON: whatever is not JSON text a tokenizer can read is a BadRequest that says
what is wrong, before any work starts."""

from __future__ import annotations

import json

from kvmemory.integrations.serving import BadRequest

MAX_JSON_DEPTH = 64  # deeper than any request a dialect defines; 5,000 deep would overflow the parser's stack


def read_json(raw: bytes):
    """A request body as JSON, or a BadRequest saying what is wrong with it: not UTF-8, not JSON, nested past
    ``MAX_JSON_DEPTH``, a number too long to convert, NaN or Infinity (not JSON), a lone UTF-16 surrogate (not
    text: no tokenizer can read it)."""

    def no_constant(name: str):
        raise BadRequest(f"the body is not JSON: {name} is not a JSON value")

    try:
        value = json.loads(raw or b"null", parse_constant=no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"the body is not JSON: {err}") from None
    except RecursionError:
        raise BadRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as err:  # Python's limit on the digits of an integer
        raise BadRequest(f"the body holds a number kvmemory will not read: {err}") from None
    check_json_text(value)
    return value


def check_json_text(value) -> None:
    """Walk ``value`` (without recursion): at most ``MAX_JSON_DEPTH`` deep, every string and key valid text."""
    pending = [(value, "body", 0)]
    while pending:
        item, where, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise BadRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels (at {where})", param=where)
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    raise BadRequest(f"{where} holds a lone UTF-16 surrogate, which is not text", param=where) from None
        elif isinstance(item, dict):
            for key, inner in item.items():
                pending += [(key, where, depth + 1), (inner, f"{where}.{key}" if where != "body" else key, depth + 1)]
        elif isinstance(item, list):
            pending += [(inner, f"{where}[{i}]", depth + 1) for i, inner in enumerate(item)]
