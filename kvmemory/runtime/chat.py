"""Chat rendering and tool calls: messages (with tools) to token ids, model text back to tool calls.

Templates that know tools (Qwen, Hermes, Mistral) get them natively. Templates that do not (the default
SmolLM2 model's) get the tool schemas in the system message and the Hermes ``<tool_call>`` convention,
which the parser below reads back (a JSON object or a list of them per tag).
"""

from __future__ import annotations

import json
import re
import secrets
import uuid
import weakref

import torch

from kvmemory.errors import InvalidArgumentError, ToolCallParseError
from kvmemory.runtime.tool_arguments import ToolArguments

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

TOOLS_INSTRUCTION = (
    "You can call tools. Available tools (JSON schemas):\n{schemas}\n"
    'To call a tool, answer with <tool_call>{{"name": <tool name>, "arguments": <JSON object>}}</tool_call>.'
)


def _function_schema(tool: dict) -> dict:
    return tool.get("function", tool)


def _tool_call_text(call: dict) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", fn.get("args", {}))
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    return "<tool_call>" + json.dumps({"name": fn["name"], "arguments": args}) + "</tool_call>"


# ---- text from clients is text ------------------------------------------------------------------


class PlainText:
    """Tokenizes a client's text as text. A tokenizer matches its added tokens (``<|im_end|>``, ``<|im_start|>``,
    Qwen's ``<tool_call>``) anywhere in the string it is given, so a message that spells one could close its own
    turn and open a forged ``system`` or ``assistant`` one. Here a string that spells a control token comes out as
    the ordinary tokens of those characters (as llama.cpp tokenizes user text with ``parse_special`` off); only
    the chat template writes control tokens.

    Control tokens are the tokenizer's special added tokens and its added markup tokens (``<...>``, such as
    Qwen's ``<tool_call>``); text without any is tokenized exactly as before."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        added = tokenizer.added_tokens_decoder.values() if hasattr(tokenizer, "added_tokens_decoder") else ()
        controls = {t.content for t in added if t.content and (t.special or re.fullmatch(r"</?[^\s<>]+>", t.content))}
        self.controls = sorted(controls, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, self.controls))) if self.controls else None
        self._plain = None

    def spells_control(self, text: str) -> bool:
        return self.pattern is not None and self.pattern.search(text) is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with no special tokens added and none read from it."""
        if not self.spells_control(text):
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.plain(text)

    def plain(self, text: str) -> list[int]:
        """Token ids of ``text`` by the tokenizer's model alone (its added tokens left out)."""
        if self._plain is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None:  # a slow tokenizer: it splits its special tokens on request
                self._plain = lambda t: self.tokenizer.encode(t, add_special_tokens=False, split_special_tokens=True)
            else:
                from tokenizers import Tokenizer

                spec = json.loads(backend.to_str())
                spec["added_tokens"] = []
                model = Tokenizer.from_str(json.dumps(spec))
                self._plain = lambda t: model.encode(t, add_special_tokens=False).ids
        return self._plain(text)

    def escape(self, value, placeholders: dict[str, str]):
        """``value`` (messages, tools: any JSON value) with every control-token spelling in its strings, keys
        included, replaced by a placeholder that no client can guess; ``placeholders`` maps each back."""
        if isinstance(value, str):
            if not self.spells_control(value):
                return value

            def hide(match: re.Match) -> str:
                mark = f"kvmemory{secrets.token_hex(8)}x"
                placeholders[mark] = match.group(0)
                return mark

            return self.pattern.sub(hide, value)
        if isinstance(value, dict):
            return {self.escape(k, placeholders): self.escape(v, placeholders) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v, placeholders) for v in value]
        return value


_PLAIN_TEXT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plain_text(tokenizer) -> PlainText:
    """The tokenizer's ``PlainText`` (made once per tokenizer)."""
    try:
        return _PLAIN_TEXT[tokenizer]
    except KeyError:
        made = _PLAIN_TEXT[tokenizer] = PlainText(tokenizer)
        return made


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a client's ``text``: no special tokens added, none read from it (``PlainText``)."""
    return plain_text(tokenizer).encode(text)


# ---- rendering -------------------------------------------------------------------------------------


class ChatRenderer:
    """Renders message dicts ({role, content, tool_calls?, name?, tool_call_id?}) with the tokenizer's template.
    What the messages and tools say is text: a string in them that spells a control token is tokenized as the
    characters it is (``PlainText``), so only the template decides where a turn starts and who speaks."""

    def __init__(self, tokenizer):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidArgumentError("this model's tokenizer has no chat template; use append_text / append_tokens")
        self.tokenizer = tokenizer
        self.text = plain_text(tokenizer)
        self.native_tools = "tools" in tokenizer.chat_template
        self._frames: dict[str, tuple[list[int], list[int]]] = {}

    def prepare(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """Normalise messages so the template can render them (tools folded in when it cannot)."""
        out = []
        for msg in messages:
            msg = dict(msg)
            msg["content"] = msg.get("content") or ""
            if not self.native_tools:
                calls = msg.pop("tool_calls", None) or []
                if calls:
                    text = "\n".join(_tool_call_text(c) for c in calls)
                    msg["content"] = (msg["content"] + "\n" + text).strip()
                msg.pop("tool_call_id", None)
                msg.pop("name", None)
            out.append(msg)
        if tools and not self.native_tools:
            schemas = "\n".join(json.dumps(_function_schema(t)) for t in tools)
            instruction = TOOLS_INSTRUCTION.format(schemas=schemas)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + instruction}
            else:
                out.insert(0, {"role": "system", "content": instruction})
        return out

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False
    ) -> list[int]:
        placeholders: dict[str, str] = {}
        messages, tools = self.text.escape(messages, placeholders), self.text.escape(tools, placeholders)
        kwargs = {"tools": tools} if tools and self.native_tools else {}
        prepared = self.prepare(messages, tools)
        if not placeholders:
            ids = self.tokenizer.apply_chat_template(
                prepared, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
            )
            return list(ids if isinstance(ids, list) else ids["input_ids"])
        text = self.tokenizer.apply_chat_template(
            prepared, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )
        ids = []  # the template's text read with its control tokens, each client spelling of one as plain text
        for i, piece in enumerate(re.split(f"({'|'.join(placeholders)})", text)):
            if i % 2:
                ids += self.text.plain(placeholders[piece])
            elif piece:
                ids += self.tokenizer.encode(piece, add_special_tokens=False)
        return ids

    def message_ends(self, messages: list[dict], tools, first: int, full: list[int], progress=None) -> list[int]:
        """Where each of ``messages[first:]`` ends in ``full`` (their rendering, with or without the generation
        prompt): ``len(render(messages[:i + 1]))`` for each i. Read from one tokenization of the whole text where
        the template renders each message on its own, as ChatML does (time linear in the messages); otherwise
        every prefix is rendered (quadratic: 1,000 messages take minutes), ``progress(0, len(full))`` before
        each so that a caller can stop there."""
        ends = self._ends_in_one_pass(messages, tools, first, full)
        if ends is not None:
            return ends
        out = []
        for i in range(first, len(messages)):
            if progress is not None:
                progress(0, len(full))
            out.append(len(self.render(messages[: i + 1], tools)))
        return out

    def _ends_in_one_pass(self, messages, tools, first: int, full: list[int]) -> list[int] | None:
        """``message_ends`` from the text of each message rendered after the first and the previous message only,
        each piece checked against the whole text and ending on a token boundary of it; None where any is not
        (a template whose rendering of a message depends on more than that, or text that spells control tokens)."""
        placeholders: dict[str, str] = {}
        self.text.escape([messages, tools], placeholders)
        if placeholders or not hasattr(self.tokenizer, "backend_tokenizer"):
            return None
        kwargs = {"tools": tools} if tools and self.native_tools else {}

        def text(part: list[dict]) -> str:
            return (
                self.tokenizer.apply_chat_template(self.prepare(part, tools), tokenize=False, **kwargs) if part else ""
            )

        try:
            whole = text(messages)
            encoded = self.tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(encoded["input_ids"])
            if list(full[: len(ids)]) != ids:  # (``full`` may go on with the generation prompt)
                return None
            tokens_before = {end: k + 1 for k, (_, end) in enumerate(encoded["offset_mapping"])}
            at, ends = len(text(messages[:first])), []
            for i in range(first, len(messages)):
                context = messages[: min(i, 1)] + messages[max(1, i - 1) : i]
                lead, with_message = text(context), text(context + [messages[i]])
                piece = with_message[len(lead) :]
                if not with_message.startswith(lead) or whole[at : at + len(piece)] != piece:
                    return None
                at += len(piece)
                if at not in tokens_before:
                    return None
                ends.append(tokens_before[at])
            return ends
        except Exception:  # the template's own error on a shortened conversation (strict role alternation)
            return None

    def tool_call_text(self, name: str, arguments: dict) -> str:
        """How this model's template writes an assistant's call of tool ``name``: the model's own tool-call
        format (Qwen's ``<tool_call>`` block, or the Hermes tags folded in for templates without tools), to
        show the model in a prompt. Small models follow an example far better than a description."""
        lead = [{"role": "user", "content": "x"}]
        function = {"name": name, "arguments": arguments}
        call = {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "id": "call_0", "function": function}],
        }
        before = self.tokenizer.apply_chat_template(
            self.prepare(lead, None), add_generation_prompt=True, tokenize=False
        )
        text = self.tokenizer.apply_chat_template(self.prepare(lead + [call], None), tokenize=False)
        if not text.startswith(before):  # a template that rewrites earlier turns: the Hermes tags we parse
            return _tool_call_text(call["tool_calls"][0])
        body, tail = text[len(before) :], self.tokenizer.decode(self.turn_end())
        return (body[: -len(tail)] if tail and body.endswith(tail) else body).strip()

    def turn_end(self) -> list[int]:
        """The tokens the template writes after an assistant message's content (ChatML: ``<|im_end|>`` and a
        newline): what closes a generated reply before the next message."""
        return list(self._frame("assistant")[1])

    def frame(self, role: str) -> tuple[int, int]:
        """How many tokens the template writes before and after the content of a message of ``role`` (ChatML:
        ``<|im_start|>role`` and a newline; ``<|im_end|>`` and a newline): the scaffolding that tells the model
        who speaks, which a memory keeps for recent messages (``MemoryBudget.recent_frames``). (0, 0) where the
        template will not render such a message after a user's (strict role alternation)."""
        try:
            head, tail = self._frame(role)
        except Exception:  # the template's own error (jinja2's, or one it raises): no frame to keep
            self._frames[role] = ([], [])
            return 0, 0
        return len(head), len(tail)

    def _frame(self, role: str) -> tuple[list[int], list[int]]:
        """(head, tail) token ids around a message's content, found by rendering a sentinel after a user
        message; either is empty where the template renders that message in a way this cannot split."""
        if role not in self._frames:
            sentinel = "\u2063kvmemory\u2063"
            lead = [{"role": "user", "content": "x"}]
            message = {"role": role, "content": sentinel, **({"name": "tool"} if role == "tool" else {})}
            before = self.tokenizer.apply_chat_template(self.prepare(lead, None), tokenize=False)
            text = self.tokenizer.apply_chat_template(self.prepare(lead + [message], None), tokenize=False)
            at = text.find(sentinel)
            head = text[len(before) : at] if at >= 0 and text.startswith(before) else ""
            tail = text[at + len(sentinel) :] if at >= 0 else ""
            self._frames[role] = tuple(
                self.tokenizer.encode(part, add_special_tokens=False) if part else [] for part in (head, tail)
            )
        return self._frames[role]


class RequiredToolCall:
    """A reply that must call a tool (``tool_choice`` "required", or one tool by name), as a token constraint
    (``SamplingParams.allowed``: given the reply's tokens so far, the tokens the next one may be).

    The call is framed as the model's own template writes one (``ChatRenderer.tool_call_text``): its opening,
    one of the tool names, the arguments object (held to the tool's JSON schema where ``schemas`` gives one:
    ``ToolArguments``), then the template's closing and the end of the turn. Among the names the model's
    logits choose, as llama.cpp's tool-call grammar and vLLM's guided decoding do: a small model that would
    drift into a prose plan, invent a tool name or its arguments, or run on into a second call still makes
    exactly one call of a real tool."""

    def __init__(
        self,
        renderer: ChatRenderer,
        names: list[str],
        end_of_turn: frozenset[int],
        schemas: dict[str, dict] | None = None,
    ):
        if not names:
            raise InvalidArgumentError("a required tool call needs at least one tool")
        marker, arguments = "kvmemory_tool_name", '{"a": 1}'
        example = renderer.tool_call_text(marker, {"a": 1})
        at, args = example.find(marker), example.find(arguments)
        if at < 0 or args < at:
            raise InvalidArgumentError("this model's template writes tool calls in a form kvmemory cannot require")
        opening, between = example[:at], example[at + len(marker) : args].rstrip()  # the model spaces its "{"
        self.closing = example[args + len(arguments) :]
        self.encode = lambda text: renderer.tokenizer.encode(text, add_special_tokens=False)
        self.decode = renderer.tokenizer.decode
        self.heads = [self.encode(opening + name + between) for name in names]
        self.arguments = [ToolArguments((schemas or {}).get(name), renderer.tokenizer) for name in names]
        self.end_of_turn = sorted(end_of_turn)

    def __call__(self, generated: list[int]) -> list[int] | torch.Tensor | None:
        k = len(generated)
        options = {head[k] for head in self.heads if len(head) > k and head[:k] == generated}
        if options:
            return sorted(options)
        tool = next(i for i, head in enumerate(self.heads) if generated[: len(head)] == head)
        after = self.decode(generated[len(self.heads[tool]) :])  # the arguments object, then what closes the call
        held = self.arguments[tool].allowed(after)
        if held is not None:
            return held  # the arguments are still being written, under the tool's schema
        end = object_end(after)
        if end is None:
            return None  # the model is still writing its arguments
        written = after[end:]
        if not self.closing.startswith(written):
            return self.end_of_turn  # it ran past the call: end the turn there
        rest = self.closing[len(written) :]
        return self.encode(rest)[:1] if rest else self.end_of_turn


def object_end(text: str) -> int | None:
    """Where the JSON object that ``text`` starts (after any whitespace) ends, or None if it has not yet."""
    depth, quoted, escaped = 0, False, False
    for i, char in enumerate(text):
        if quoted:
            escaped, quoted = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            quoted = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and not char.isspace():
            return i  # not an object: nothing more to wait for
    return None


def parse_tool_calls(text: str, tools: list[dict] | None = None) -> tuple[str, list[dict]]:
    """Split model output into (plain content, tool calls [{name, args, id}]).

    Calls are read from ``<tool_call>`` tags (the Hermes / Qwen format). Small models often drop the tags and
    answer with the bare object, or with it in a code fence, as the template's instruction shows it; when
    ``tools`` (the turn's schemas) are given, a reply that starts with such an object naming one of them is
    read as that call (the first, where the model repeats it), as llama.cpp's and vLLM's Hermes parsers do.
    Raises ToolCallParseError naming what is wrong, so a caller can show the model its mistake.
    """
    calls = []
    for match in TOOL_CALL_RE.finditer(text):
        body = match.group(1).strip()
        try:
            calls += _calls(_tag_json(body))
        except ToolCallParseError as err:
            raise ToolCallParseError(str(err), call_text=body) from err
    if calls:
        return TOOL_CALL_RE.sub("", text).strip(), calls
    bare = _bare_call(text, {_function_schema(t).get("name") for t in tools or ()})
    return ("", [bare]) if bare is not None else (text, [])


def _tag_json(body: str) -> object:
    try:
        return json.loads(body)
    except json.JSONDecodeError as err:
        raise ToolCallParseError(f"tool call is not valid JSON ({err.msg} at char {err.pos}): {body[:200]!r}") from err


def _calls(parsed: object) -> list[dict]:
    """The calls in one tag's JSON: an object, or a list of them."""
    calls = []
    for item in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ToolCallParseError(f"tool call needs a string 'name': {json.dumps(item)[:200]}")
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as err:
                raise ToolCallParseError(
                    f"arguments of tool call {item['name']!r} are not JSON: {args[:200]!r}"
                ) from err
        if not isinstance(args, dict):
            raise ToolCallParseError(f"arguments of tool call {item['name']!r} must be a JSON object")
        calls.append({"name": item["name"], "args": args, "id": f"call_{uuid.uuid4().hex[:12]}"})
    return calls


FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _bare_call(text: str, names: set[str]) -> dict | None:
    """The call a reply that starts with a bare object makes (``{"name": ..., "arguments": {...}}``, fenced
    or not), when it names one of ``names``; None for any other text."""
    body = text.strip()
    fenced = FENCE_RE.match(body)
    body = fenced.group(1) if fenced else body
    if not names or not body.startswith("{"):
        return None
    try:  # the first object: a small model often repeats its call, and the agent makes one call per reply
        parsed, _ = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(parsed, dict) or parsed.get("name") not in names or set(parsed) - {"name", "arguments"}:
        return None
    try:
        return _calls(parsed)[0]
    except ToolCallParseError:
        return None


def visible_content(text: str) -> str:
    """Text before any tool call, for streaming (a partial '<tool_call' prefix at the end is held back)."""
    cut = text.find("<tool_call>")
    if cut >= 0:
        return text[:cut]
    for k in range(len("<tool_call>") - 1, 0, -1):
        if text.endswith("<tool_call>"[:k]):
            return text[:-k]
    return text
