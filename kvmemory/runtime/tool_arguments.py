"""A tool call's arguments held to the tool's JSON schema while they are generated, token by token.

A small model asked for a tool call writes arguments of its own invention: the schema's own words
(``"type": "object"``, ``"required": [...]``), keys the tool does not take, a string where a number goes. Where a
call is required (``RequiredToolCall``), the arguments object is written under this grammar instead, as
llama.cpp's JSON-schema grammars and vLLM's guided decoding do: only the schema's property names as keys,
each at most once, every required one before the object closes; strings (text that needs no escape, at most
``maxLength`` characters where the schema sets one: a small model's string otherwise runs on to the reply's
token limit and the call is lost), integers,
numbers, booleans and enumerated strings where the schema says so. A property of another type (an array, an
object) leaves the rest of the object to the model.

``ToolArguments.allowed(text)`` reads the arguments generated so far and names the tokens that may come next.
Each named token's text goes on along the grammar, so the text is always a prefix of a valid object and
nothing is ever taken back."""

from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Vocabulary:
    """Token ids by what their text may stand for inside a JSON value (found once per tokenizer)."""

    in_string: torch.Tensor  # text that fits in a string as it is: no quote, backslash or control character
    in_string_lengths: torch.Tensor  # the characters of each of those tokens' text
    digits: torch.Tensor  # ASCII digits only
    leading_digits: torch.Tensor  # digits not starting with 0 (JSON numbers have no leading zeros)


_VOCABULARIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary(tokenizer) -> Vocabulary:
    if tokenizer not in _VOCABULARIES:
        special = set(getattr(tokenizer, "all_special_ids", ()))
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        in_string, digits, leading = [], [], []
        for i, text in enumerate(texts):
            if not text or i in special or "\ufffd" in text:
                continue
            if '"' not in text and "\\" not in text and text.isprintable():
                in_string.append(i)
            if text.isascii() and text.isdigit():
                digits.append(i)
                if text[0] != "0":
                    leading.append(i)
        lengths = [len(texts[i]) for i in in_string]
        made = Vocabulary(*(torch.tensor(ids, dtype=torch.long) for ids in (in_string, lengths, digits, leading)))
        _VOCABULARIES[tokenizer] = made
    return _VOCABULARIES[tokenizer]


NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?")  # a JSON number without an exponent (all a tool needs)


class ToolArguments:
    """The grammar of one tool's arguments object (see the module docstring)."""

    def __init__(self, schema: dict | None, tokenizer):
        schema = schema if isinstance(schema, dict) else {}
        properties = schema.get("properties")
        self.properties: dict = properties if isinstance(properties, dict) else {}
        self.required = [k for k in schema.get("required") or [] if k in self.properties]
        self.tokenizer = tokenizer
        self._first: dict[str, int] = {}

    def first_token(self, literal: str) -> int:
        if literal not in self._first:
            self._first[literal] = self.tokenizer.encode(literal, add_special_tokens=False)[0]
        return self._first[literal]

    def allowed(self, text: str) -> torch.Tensor | None:
        """The tokens that may follow ``text`` (the arguments written so far, from just after the tool's name);
        None where the rest is the model's own: the object is complete, or the schema leaves it free."""
        if not self.properties:
            return None
        return _Reader(self, text).next_tokens()


class _Free(Exception):
    """The text reached a value the grammar leaves to the model (or, defensively, left the grammar)."""


class _Reader:
    """Walks the text generated so far through the grammar; where the text ends, names what may come next."""

    def __init__(self, grammar: ToolArguments, text: str):
        self.grammar, self.text, self.at = grammar, text, 0
        self.done: list[str] = []
        self.taken = ""  # the option ``literal`` took last

    def next_tokens(self) -> torch.Tensor | None:
        try:
            return self._object()
        except _Free:
            return None

    def _object(self) -> torch.Tensor | None:
        if (need := self.literal(["{", " {"])) is not None:
            return need
        while True:
            keys = [k for k in self.grammar.properties if k not in self.done]
            lead = ", " if self.done else ""
            options = [f'{lead}"{k}": ' for k in keys] + (["}"] if self.may_close() else [])
            if (need := self.literal(options)) is not None:
                return need
            if self.taken == "}":
                return None  # complete: the caller closes the call
            self.done.append(keys[options.index(self.taken)])
            if (need := self.value(self.grammar.properties[self.done[-1]] or {})) is not None:
                return need

    def may_close(self) -> bool:
        return all(k in self.done for k in self.grammar.required)

    def literal(self, options: list[str]) -> torch.Tensor | None:
        """Take whichever of ``options`` the text holds here (``taken``) and return None; where the text ends
        on the way to some of them, the tokens that go on towards each."""
        rest = self.text[self.at :]
        for option in options:
            if rest.startswith(option):
                self.at += len(option)
                self.taken = option
                return None
        going = [option[len(rest) :] for option in options if option.startswith(rest)]
        if not going:
            raise _Free
        return self.tokens(going)

    def tokens(self, literals: list[str], *sets: torch.Tensor) -> torch.Tensor:
        first = torch.tensor(sorted({self.grammar.first_token(t) for t in literals}), dtype=torch.long)
        return torch.cat([first, *sets]) if sets else first

    def value(self, schema: dict) -> torch.Tensor | None:
        """Take one value of ``schema``: None once it is whole, else the tokens that may come next."""
        kind = schema.get("type")
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return self.literal([json.dumps(v) for v in enum])
        if kind == "boolean":
            return self.literal(["true", "false"])
        if kind == "string":
            return self.string(schema.get("maxLength"))
        if kind in ("integer", "number"):
            return self.number(kind)
        raise _Free

    def string(self, max_length: int | None = None) -> torch.Tensor | None:
        if (need := self.literal(['"'])) is not None:
            return need
        end = self.text.find('"', self.at)
        if end < 0:  # inside: any text that needs no escape (within maxLength), or the closing quote
            words = vocabulary(self.grammar.tokenizer)
            if not isinstance(max_length, int):
                return self.tokens(['"'], words.in_string)
            room = max_length - (len(self.text) - self.at)
            return self.tokens(['"'], words.in_string[words.in_string_lengths <= room])
        self.at = end + 1
        return None

    def number(self, kind: str) -> torch.Tensor | None:
        """An integer, or a number with an optional fraction: ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?``."""
        rest = self.text[self.at :]
        run = len(rest) - len(rest.lstrip("0123456789-."))
        written = rest[:run] if kind == "number" else rest[:run].split(".")[0]
        whole = NUMBER.fullmatch(written) is not None and (kind == "number" or "." not in written)
        if len(written) < len(rest):  # the text goes on past the number
            if not whole:
                raise _Free
            self.at += len(written)
            return None
        words = vocabulary(self.grammar.tokenizer)
        keys_left = any(k not in self.done for k in self.grammar.properties)
        after = [", "] * keys_left + (["}"] if self.may_close() else [])
        if written in ("", "-"):
            return self.tokens(["0"] + (["-"] if not written else []), words.leading_digits)
        if written.endswith("."):
            return words.digits
        if written.lstrip("-") == "0":
            return self.tokens(after + (["."] if kind == "number" else []))
        fraction = "." in written
        return self.tokens(after + (["."] if kind == "number" and not fraction else []), words.digits)
