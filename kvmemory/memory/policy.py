"""Memory policies: which segments are compacted, how, and under what memory budget.

A policy is a list of rules tried in order; the first rule whose ``match`` fits a segment decides how
that segment is compacted (or that it is protected). Policies load from Python, dicts, YAML, TOML or
JSON, and every mistake fails at load time with the field and the reason.

There is one default: every field a policy leaves out takes the default policy's choice (the method and
its parameters, the recent window, the kept chat frames, closed gaps, the cap pass's target), so a policy
written from scratch starts from what the agent benchmark measured best. ``default_policy()`` is
``MemoryPolicy`` plus its protected rules (the system prompt, tool schemas and the task), and a file that
says ``extends: default`` gets those rules too, each replaceable by a rule of the same name:

    extends: default
    rules:
      - {name: test-logs, match: {tool: run_tests}, ratio: 20}
    budget: {max_slots: 2048}

``MemoryPolicy.never()`` is the policy that never compacts (a session then fails with ``MemoryCapError``
where it would outgrow its cap or the model's context).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvmemory.compaction.queries import QUERY_SOURCES
from kvmemory.errors import PolicyError
from kvmemory.runtime.segments import SEGMENT_KINDS, Segment

StrOrList = str | list[str] | None


def _as_list(value: StrOrList) -> list[str] | None:
    return None if value is None else [value] if isinstance(value, str) else list(value)


class SegmentMatch(BaseModel):
    """Which segments a rule applies to. Every given field must match; lists mean any of."""

    model_config = ConfigDict(extra="forbid")

    role: StrOrList = None
    kind: StrOrList = None
    tool: StrOrList = Field(None, description="tool name, shell-style patterns allowed (run_*)")
    tag: StrOrList = None
    content: str | None = Field(None, description="regular expression searched in the segment's text")
    first: bool = Field(False, description="only the first segment that matches the other fields")

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, value):
        for kind in _as_list(value) or []:
            if kind not in SEGMENT_KINDS:
                raise ValueError(f"unknown segment kind {kind!r}; kinds are {', '.join(SEGMENT_KINDS)}")
        return value

    @field_validator("content")
    @classmethod
    def _valid_regex(cls, value):
        if value is not None:
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"invalid regular expression {value!r}: {err}") from err
        return value

    def matches(self, segment: Segment, earlier: list[Segment] | None = None) -> bool:
        if not self._fields_match(segment):
            return False
        if self.first and earlier is not None:
            return not any(self._fields_match(s) for s in earlier if s.start < segment.start)
        return True

    def _fields_match(self, segment: Segment) -> bool:
        if (roles := _as_list(self.role)) is not None and segment.role not in roles:
            return False
        if (kinds := _as_list(self.kind)) is not None and segment.kind not in kinds:
            return False
        if (tools := _as_list(self.tool)) is not None and not any(
            fnmatch.fnmatch(segment.tool_name or "", t) for t in tools
        ):
            return False
        if (tags := _as_list(self.tag)) is not None and not set(tags) & set(segment.tags):
            return False
        if self.content is not None and not re.search(self.content, segment.text or ""):
            return False
        return True


# the default policy's method: selective context's lines (tokens the model predicted at under 1 nat evicted
# first) under REAL's per-head budgets; what a rule that names no method (and no params) compacts with
DEFAULT_METHOD = "real"
DEFAULT_PARAMS: dict[str, Any] = {"inner": "selective_context", "inner_params": {"evict_predictable_below": 1.0}}


class CompactionRule(BaseModel):
    """How matching segments are compacted. A rule that names neither a method nor params compacts as the
    default policy does (``DEFAULT_METHOD`` with ``DEFAULT_PARAMS``); one that names a method gets that
    method's own defaults for the params it leaves out."""

    model_config = ConfigDict(extra="forbid")

    name: str = "rule"
    match: SegmentMatch = Field(default_factory=SegmentMatch)
    protected: bool = Field(False, description="never compacted")
    method: str = Field(DEFAULT_METHOD, description="a registered compaction method")
    params: dict[str, Any] = Field(default_factory=dict, description="the method's config fields")

    @model_validator(mode="before")
    @classmethod
    def _default_method(cls, data):
        if isinstance(data, dict) and "method" not in data and "params" not in data:
            return {**data, "params": copy.deepcopy(DEFAULT_PARAMS)}
        return data

    ratio: float | None = Field(None, ge=1.0, description="target tokens per slot when the rule fires")
    max_slots: int | None = Field(None, ge=1, description="never more slots than this per head")
    min_slots: int = Field(1, ge=1, description="never compact below this many slots per head")
    query_source: str | list[str] = Field("window", description=f"reference queries: {', '.join(QUERY_SOURCES)}")
    weight: float = Field(1.0, gt=0, description="multiplies the segment's importance under cap pressure")

    @field_validator("query_source")
    @classmethod
    def _known_source(cls, value):
        for source in _as_list(value):
            if source not in QUERY_SOURCES:
                raise ValueError(f"unknown query source {source!r}; use {', '.join(QUERY_SOURCES)}")
        return value

    @model_validator(mode="after")
    def _valid_method(self):
        if self.protected:
            return self
        from kvmemory.compaction.registry import available_methods, get_method

        if self.method not in available_methods():
            raise ValueError(f"unknown method {self.method!r}; methods are {', '.join(available_methods())}")
        get_method(self.method, **self.params)  # names the bad parameter (InvalidArgumentError is a ValueError)
        if self.max_slots is not None and self.max_slots < self.min_slots:
            raise ValueError(f"max_slots ({self.max_slots}) is below min_slots ({self.min_slots})")
        return self

    def target_slots(self, tokens: int) -> int:
        """Slots per head this rule wants for a segment of ``tokens`` tokens (when its trigger fires)."""
        target = max(1, round(tokens / self.ratio)) if self.ratio is not None else tokens
        if self.max_slots is not None:
            target = min(target, self.max_slots)
        return max(min(target, tokens), min(self.min_slots, tokens))


class MemoryBudget(BaseModel):
    """When to compact: a cap on slots per head or on bytes, a period, and what stays verbatim; what a
    compaction does besides (closing gaps, measuring its error)."""

    model_config = ConfigDict(extra="forbid")

    max_slots: int | None = Field(
        None,
        ge=1,
        description="cap on slots per head: the mean over every layer's KV heads (heads may hold different "
        "counts), so the cap bounds bytes",
    )
    max_bytes: int | None = Field(None, ge=1, description="cap on KV bytes of the whole cache")
    interval: int | None = Field(None, ge=1, description="P: compact every P new tokens")
    recent_tokens: int = Field(128, ge=0, description="τ: the last τ tokens are never compacted")
    sink_tokens: int = Field(4, ge=0, description="the session's first tokens are never compacted")
    recent_frames: int = Field(
        4,
        ge=0,
        description="the chat template's frame of each of the last N messages (its role header and end of "
        "turn, ChatRenderer.frame) is never compacted: the model still reads who said what, and whose turn is "
        "next (their headers are predictable, so a ranking by surprise would drop them first)",
    )
    target_fraction: float = Field(
        0.95,
        gt=0,
        le=1,
        description="a cap-triggered compaction aims this far below the cap (each frees little, so the memory "
        "holds as much of what it read as the cap allows)",
    )
    window: int = Field(64, ge=1, description="R: selector-window queries recorded for compaction")
    measure_error: bool = Field(
        False,
        description="after each compaction, record in the compaction log how far the span's attention output on "
        "the selector-window queries moved (reconstruction_error): telemetry that costs several times what a "
        "fast method's compaction does, so off unless asked for",
    )
    close_gaps: bool = Field(
        True,
        description="after each compaction, re-rotate the kept slots to consecutive RoPE positions "
        "(Session.rebase_positions): the model reads its memory as one shorter text, as text agents' trimmed "
        "prompts read, and a fact sits as near the question as in a trimmed prompt",
    )


class MemoryPolicy(BaseModel):
    """Rules in order (first match wins; the default rule catches the rest) plus a budget. The default rule
    compacts as the default policy does, and only when the cap (or the model's context) requires it."""

    model_config = ConfigDict(extra="forbid")

    rules: list[CompactionRule] = Field(default_factory=list)
    default: CompactionRule = Field(default_factory=lambda: CompactionRule(name="context"))
    budget: MemoryBudget = Field(default_factory=MemoryBudget)

    @classmethod
    def never(cls) -> MemoryPolicy:
        """A policy that never compacts: every segment is protected."""
        return cls(default=CompactionRule(name="never", protected=True))

    def rule_for(self, segment: Segment, segments: list[Segment]) -> CompactionRule:
        for rule in self.rules:
            if rule.match.matches(segment, segments):
                return rule
        return self.default

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict) -> MemoryPolicy:
        """A policy from plain data; ``extends: default`` adds the default policy's protected rules."""
        data = dict(data)
        extends = data.pop("extends", None)
        if extends not in (None, "default"):
            raise PolicyError(f"invalid memory policy: extends: {extends!r}; only 'default' can be extended")
        try:
            if extends == "default":
                data["rules"] = _over_default_rules([CompactionRule.model_validate(r) for r in data.get("rules", [])])
            return cls.model_validate(data)
        except ValidationError as err:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'policy'}: {e['msg']}" for e in err.errors())
            raise PolicyError(f"invalid memory policy: {problems}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> MemoryPolicy:
        path = Path(path)
        if not path.is_file():
            raise PolicyError(f"policy file not found: {path}")
        text = path.read_text()
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            elif path.suffix == ".toml":
                import tomllib

                data = tomllib.loads(text)
            elif path.suffix == ".json":
                data = json.loads(text)
            else:
                raise PolicyError(f"policy file {path} must be .yaml, .yml, .toml or .json")
        except PolicyError:
            raise
        except Exception as err:  # the parsers' own errors say where the syntax breaks
            raise PolicyError(f"cannot parse policy file {path}: {err}") from err
        if not isinstance(data, dict):
            raise PolicyError(f"policy file {path} must hold a mapping at the top level")
        return cls.from_dict(data)


def protected_rules() -> list[CompactionRule]:
    """The default policy's rules: the system prompt, tool schemas and the task (the first user message)."""
    return [
        CompactionRule(name="system", match=SegmentMatch(kind=["system", "tool_schema"]), protected=True),
        CompactionRule(name="task", match=SegmentMatch(role="user", first=True), protected=True),
    ]


def _over_default_rules(rules: list[CompactionRule]) -> list[CompactionRule]:
    """The default policy's rules, each replaced by the given rule of its name, then the other given rules."""
    given = {rule.name: rule for rule in rules}
    defaults = protected_rules()
    names = {rule.name for rule in defaults}
    return [given.get(rule.name, rule) for rule in defaults] + [r for r in rules if r.name not in names]


def default_policy(max_slots: int | None = None, recent_tokens: int = 128) -> MemoryPolicy:
    """Good out of the box for agents: protect the system prompt, the task and tool schemas; compact nothing
    until the cap requires it, then keep the lines of highest surprisal across everything else
    (``selective_context``, the tokens the model predicted at under 1 nat evicted first, so more lines keep
    their surprising values), as many as the cap allows, each KV head as many as REAL's head profile gives
    it (``real``: heads that retrieve keep more, local heads fewer, the bytes the same). On real agent traces
    (``benchmarks/agent_memory.py``) the lines keep single-mention facts (names, ports, buckets) that
    selectors ranking by the attention of recent queries (SnapKV, TAM, Attention Matching) lose, and REAL's
    budgets continue the session's text better than giving every head the same count. The ranking is one
    scale for the whole cache, so one selection spans every segment, and each head's gaps are closed after
    it (``close_gaps``): a fact then sits as near the question as in a trimmed prompt, which this model
    answers from far better than across thousands of positions. The chat frames of the last four messages
    stay (``recent_frames``): their role headers are predictable, so they would go first, and without them
    the model loses track of whose turn is next. A compaction the cap forces aims at 95% of it
    (``target_fraction``): each frees little, so the memory holds as much of what it read as the cap allows.
    Without ``max_slots`` the cap is the model's context. The named models ship REAL's head profiles; another
    model is profiled by ``kvmemory models profile MODEL`` (never inside a turn; until then every head is
    scored alike, ``kvmemory.runtime.head_profiling``).
    Every choice but the protected rules is a field default of ``MemoryPolicy``, ``CompactionRule`` and
    ``MemoryBudget``."""
    return MemoryPolicy(rules=protected_rules(), budget=MemoryBudget(max_slots=max_slots, recent_tokens=recent_tokens))
