"""MemoryManager: the scheduler that keeps a session under its memory budget, segment by segment.

Triggers: every P new tokens (periodic), whenever an append or a generated token would push the cache past
its cap, and on demand (``session.memory.compact()``). When a trigger fires, each compactable segment gets
the budget its rule asks for; under cap pressure the remaining room is then shared across segments by
importance (the attention mass the selector window gives them, TAM-style: t_i ∝ √w_i · n_i × rule weight).
Each segment is compacted with its own rule's method. Protected segments, the session's first tokens and
the last τ tokens are never touched.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvmemory.compaction.jobs import CompactionRecord, SpanJob
from kvmemory.compaction.registry import get_method
from kvmemory.errors import InvalidArgumentError, MemoryCapError
from kvmemory.memory.policy import CompactionRule, MemoryPolicy, _as_list, default_policy
from kvmemory.runtime.memory_hooks import register_memory_loader
from kvmemory.runtime.segments import Segment


class MemoryManager:
    """Attach to a session with ``engine.session(memory=MemoryManager(policy))``."""

    def __init__(self, policy: MemoryPolicy | dict | str | None = None):
        if isinstance(policy, dict):
            policy = MemoryPolicy.from_dict(policy)
        elif isinstance(policy, str):
            policy = MemoryPolicy.from_file(policy)
        self.policy = policy or default_policy()
        self.timeline: list[dict] = []
        self.peak_slots = 0
        self.peak_kv_bytes = 0
        self._last_compaction_at = 0
        self._busy = False
        self._methods: dict[str, object] = {}
        self.session = None

    # ---- state (part of the session's snapshot, so a failed call leaves it as it was) ---------------
    def state(self) -> tuple:
        return len(self.timeline), self.peak_slots, self.peak_kv_bytes, self._last_compaction_at

    def restore(self, state: tuple) -> None:
        n, self.peak_slots, self.peak_kv_bytes, self._last_compaction_at = state
        del self.timeline[n:]

    def export(self) -> dict:
        """The policy and history, JSON-ready, for a saved session (``MemoryManager.from_export`` reads it)."""
        return {
            "kind": "memory_manager",
            "policy": self.policy.model_dump(mode="json"),
            "timeline": self.timeline,
            "state": list(self.state()),
        }

    @classmethod
    def from_export(cls, data: dict) -> MemoryManager:
        manager = cls(MemoryPolicy.model_validate(data["policy"]))
        manager.timeline = [
            {**event, "segments": {int(k): v for k, v in event["segments"].items()}} for event in data["timeline"]
        ]
        manager.restore(tuple(data["state"]))
        return manager

    # ---- session hooks ---------------------------------------------------------------------------
    def attach(self, session) -> None:
        """Bind to ``session`` (a manager serves one session) and switch on what its methods read."""
        if self.session is not None and self.session is not session:
            raise InvalidArgumentError("this MemoryManager already serves another session; give each session its own")
        self.session = session
        self._enable_recorders()

    def set_policy(self, policy: MemoryPolicy) -> None:
        """Serve the session with another policy from now on (what is compacted stays compacted)."""
        self.policy = policy
        if self.session is not None:
            self._enable_recorders()

    def fork(self, session) -> MemoryManager:
        """Same policy, a copy of the history, attached to ``session`` (the fork of this manager's session)."""
        twin = MemoryManager(self.policy)
        twin.timeline = [dict(event) for event in self.timeline]
        twin.restore(self.state())
        twin.attach(session)
        return twin

    def _enable_recorders(self) -> None:
        rules = [r for r in self.policy.rules + [self.policy.default] if not r.protected]
        sources = {s for r in rules for s in _as_list(r.query_source)}
        window = self.policy.budget.window if self._reads_window(rules) else 0
        self.session.record_queries(window, context=256 if "context" in sources else 0)
        if any(self._method(r).needs_last_layer_inputs for r in rules):
            self.session.record_last_layer_inputs()
        if any(self._method(r).needs_surprisal for r in rules):
            self.session.record_surprisal()

    def _reads_window(self, rules: list[CompactionRule]) -> bool:
        """Whether this policy's compactions read the selector-window queries: a method that ranks or fits by
        queries, the error measure, or room shared between spans by their attention (``_importance``), which
        needs two spans: one unprotected rule whose method scores on one scale always makes one. Where none
        does (the default policy), the session records none: 2–4 MB a session on the default model."""
        methods = [self._method(r) for r in rules]
        if self.policy.budget.measure_error or any(m.uses_queries for m in methods):
            return True
        return not (len(rules) == 1 and methods[0].global_scores)

    def slot_cap(self) -> int:
        """Physical slots the cache may hold: the policy's cap, and never more than the model's context (a
        policy without a cap compacts only when the session would outgrow what the model can attend to)."""
        budget = self.policy.budget
        caps = [self.session.engine.max_context]
        if budget.max_slots:
            caps.append(budget.max_slots)
        if budget.max_bytes:
            caps.append(budget.max_bytes // self.session.engine.kv_bytes_per_token)
        return min(caps)

    def max_head_ratio(self) -> float:
        """How many times a span's mean budget one head may keep (uneven head budgets, as REAL's).

        Appends grow every head alike, and the cap bounds the mean, so a head holding r × the mean m after a
        compaction holds r·m + (cap − m) at most before the next one. r = context / cap keeps that within
        the model's context for any m ≤ cap: no head ever attends over more positions than it was trained on."""
        return self.session.engine.max_context / self.slot_cap()

    def check_fits(self, n_new: int, new_segments: list[Segment]) -> None:
        """Raise MemoryCapError, before anything changes, if the append cannot fit even after compaction.

        ``new_segments`` describe what is about to be appended (their lengths sum to ``n_new``): protected
        ones must fit whole; the rest only needs room for one prefill chunk plus the recent window."""
        cap = self.slot_cap()
        floor = self._incompressible_slots(n_new)
        seen = list(self.session.segments)
        protected = 0
        for seg in new_segments:
            if self.policy.rule_for(seg, seen + [seg]).protected:
                protected += seg.length
            seen.append(seg)
        rest = n_new - protected
        need = protected + min(rest, self.chunk_size() + self.policy.budget.recent_tokens)
        if floor + need > cap:
            what = "protected content" if protected else "the recent window and one prefill chunk"
            raise MemoryCapError(
                f"cannot fit {n_new} new tokens under the cap of {cap} slots: {what} needs {need} slots on top of "
                f"{floor} that no compaction can free; raise the cap or protect less"
            )

    def chunk_size(self) -> int:
        """Prefill chunk under a cap: at most a quarter of it, so compaction always has room to work."""
        cap = self.slot_cap()
        return max(16, min(self.session.prefill_chunk_size, cap // 4))

    def make_room(self, n_new: int) -> int | None:
        """Before ``n_new`` tokens enter the cache: compact if they would exceed the cap. Returns what the cache
        may reserve past them: up to the cap, no more (None while a compaction of its own is running)."""
        cap = self.slot_cap()
        if self._busy:
            return None
        held = self.session.cache.slots_per_head  # summed over every layer: once per decoded token
        self.peak_slots = max(self.peak_slots, min(held + n_new, cap))
        if held + n_new > cap:
            goal = min(cap - n_new, int(cap * self.policy.budget.target_fraction))
            for _ in range(4):  # budgets are per-head means: later passes aim lower to absorb rounding
                self.compact(trigger="cap", goal_slots=max(goal, 1))
                over = self.session.cache.slots_per_head + n_new - cap
                if over <= 0:
                    break
                goal -= over + max(8, cap // 16)
            self.peak_slots = max(self.peak_slots, self.session.cache.slots_per_head + n_new)
            if self.session.cache.slots_per_head + n_new > cap:
                raise MemoryCapError(
                    f"compaction left {self.session.cache.slots_per_head} slots; {n_new} more would exceed "
                    f"the cap of {cap}"
                )
            held = self.session.cache.slots_per_head
        return cap - held - n_new

    def after_append(self) -> None:
        interval = self.policy.budget.interval
        if interval and len(self.session.tokens) - self._last_compaction_at >= interval and not self._busy:
            self.compact(trigger="periodic")
        self._record("append")

    # ---- compaction ------------------------------------------------------------------------------
    def rule_for(self, segment: Segment) -> CompactionRule:
        return self.policy.rule_for(segment, self.session.segments)

    def compact(self, trigger: str = "manual", goal_slots: int | None = None) -> list[CompactionRecord]:
        """Compact every segment above its rule's budget now; with ``goal_slots``, also share the room
        left by importance. One transaction on the session: if anything fails, nothing changed."""
        if self.session is None:
            raise InvalidArgumentError("this MemoryManager is not attached to a session")
        if self._busy:
            return []
        with self._pass() as edit:
            return self._run_budgets(edit, self._budgets(goal_slots), trigger)

    def clear(self, segment_ids: Iterable[int], at_least: float = 0.0, trigger: str = "client") -> dict[int, float]:
        """Compact these segments to their rules' floors now, each with its rule's method: what a client's
        "clear these old tool results" becomes in latent space (the text stays in the transcript; ``recall``
        brings it back). Protected segments, the sinks and the recent window stay as they are; a segment at its
        floor already is skipped, and nothing is done if that would free fewer than ``at_least`` slots a head.
        One transaction. Returns the slots per head each segment gave up."""
        if self.session is None:
            raise InvalidArgumentError("this MemoryManager is not attached to a session")
        wanted = set(segment_ids)
        spans = [s for s in self._spans() if s.segments[0].id in wanted and s.current > s.floor + 0.5]
        if self._busy or not spans or sum(s.current - s.floor for s in spans) < at_least:
            return {}
        before = self.session.segment_slots()
        with self._pass() as edit:
            self._run_budgets(edit, [(span, span.floor, False) for span in spans], trigger)
        after = self.session.segment_slots()
        return {s.segments[0].id: before[s.segments[0].id] - after.get(s.segments[0].id, 0.0) for s in spans}

    @contextmanager
    def _pass(self) -> Iterator:
        """One compaction pass: a session edit (undone whole if anything in it fails), during which the
        manager's own hooks stand aside (a compaction makes no room for itself)."""
        with self.session.edit() as edit:
            self._busy = True
            try:
                yield edit
            finally:
                self._busy = False

    def _run_budgets(self, edit, items: list[tuple[_Span, int, bool]], trigger: str) -> list[CompactionRecord]:
        """Compact each span to its slots per head, one cache rebuild for the pass."""
        started = time.perf_counter()
        jobs, head_ratio, frames = [], self.max_head_ratio(), self._recent_frames()
        for span, slots, _ in items:
            method = self._method(span.rule)
            source = span.rule.query_source if method.uses_queries else "window"
            jobs.append(
                SpanJob(span.positions, method, slots, source, protected_positions=frames, max_head_ratio=head_ratio)
            )
        # one cache rebuild for the whole pass
        records = edit.compact(jobs, trigger=trigger, measure_error=self.policy.budget.measure_error)
        session = edit.session
        if records and self.policy.budget.close_gaps and session.engine.rebase_positions:
            edit.rebase_positions()  # in the edit: undone with the compaction if anything later fails
        forced_on = {}  # segment id -> compactions below its rule's budget that the cap forced in this pass
        for span, _, forced in items:
            for segment in span.segments:
                forced_on[segment.id] = forced_on.get(segment.id, 0) + forced
            first, end = int(span.positions[0]), int(span.positions[-1]) + 1  # segments compacted to their end
            edit.release_context_queries([s.id for s in session.segments if first < s.end <= end])  # have used theirs
        edit.mark_cap_forced(forced_on)
        self._last_compaction_at = len(session.tokens)
        if records:
            self._record(trigger, seconds=time.perf_counter() - started)
        return records

    def _recent_frames(self) -> set[int]:
        """Positions of the chat frames of the last ``recent_frames`` messages (``MemoryBudget.recent_frames``)."""
        count = self.policy.budget.recent_frames
        messages = [s for s in self.session.segments if s.message_index is not None][-count:] if count else []
        positions = set()
        for segment in messages:
            head, tail = self.session.renderer.frame(segment.role)
            positions.update(range(segment.start, min(segment.start + head, segment.end)))
            positions.update(range(max(segment.end - tail, segment.start), segment.end))
        return positions

    def _method(self, rule: CompactionRule):
        key = rule.model_dump_json(include={"method", "params"})
        if key not in self._methods:
            self._methods[key] = get_method(rule.method, **rule.params)
        return self._methods[key]

    def _spans(self, recent_tokens: int | None = None) -> list[_Span]:
        """One span per unprotected segment: its part outside the sinks and the recent window."""
        budget = self.policy.budget
        limit = len(self.session.tokens) - (budget.recent_tokens if recent_tokens is None else recent_tokens)
        held_before = self.session.slots_before()
        heads = self.session.engine.num_layers * self.session.engine.num_kv_heads
        out = []
        for seg in self.session.segments:
            rule = self.rule_for(seg)
            start, end = max(seg.start, budget.sink_tokens), min(seg.end, limit)
            if rule.protected or end - start < 2:
                continue
            current = int(held_before[end] - held_before[start]) / heads  # slots per head, mean over heads
            out.append(
                _Span([seg], torch.arange(start, end), rule, current, min(current, rule.target_slots(end - start)))
            )
        return out

    def _incompressible_slots(self, n_new: int) -> int:
        """Slots no compaction can free once ``n_new`` tokens arrive (the recent window slides over them):
        everything outside the spans, plus one floor per run of adjacent spans (see ``_merge_oldest``)."""
        if not self.session.cache.slots_per_head:
            return 0
        still_recent = max(0, self.policy.budget.recent_tokens - n_new)
        runs = _merge_oldest(self._spans(recent_tokens=still_recent), room=0)
        return math.ceil(self.session.cache.slots_per_head - sum(max(0.0, r.current - r.floor) for r in runs))

    def _importance(self, spans: list[_Span]) -> list[float]:
        """Share of the attention the selector-window queries give each span's own positions."""
        if len(spans) < 2:
            return [1.0] * len(spans)  # a lone span takes all the room whatever its mass
        return self.session.attention_shares([span.positions for span in spans])

    def _budgets(self, goal_slots: int | None) -> list[tuple[_Span, int, bool]]:
        """[(span, slots per head, forced by the cap)] for the spans that must shrink.

        Each segment is its own span: compacting a union lets its selection starve one member to feed
        another, which breaks the members' rule ratios. Only when the cap leaves less room than one floor
        per segment do the oldest adjacent segments share one span (and one floor)."""
        spans = self._spans()
        if goal_slots is not None and spans:
            excess = self.session.cache.slots_per_head - sum(s.current - s.wanted for s in spans) - goal_slots
            if excess > 0:  # the rules' budgets are not enough: share what is left by importance
                room = max(sum(s.wanted for s in spans) - excess, 0)
                spans = _merge_oldest(self._join_global(spans), room)
                importance = self._importance(spans)
                shares = [s.rule.weight * math.sqrt(max(w, 1e-9)) * len(s.positions) for s, w in zip(spans, importance)]
                targets = _fill(room, shares, [s.wanted for s in spans], [s.floor for s in spans])
                return [(s, t, t < s.wanted) for s, t in zip(spans, targets) if t < s.current - 0.5]
        return [(s, int(s.wanted), False) for s in spans if s.wanted < s.current - 0.5]

    def _join_global(self, spans: list[_Span]) -> list[_Span]:
        """One span for all segments of a rule whose method scores slots on one scale across segments (its
        ``global_scores``): one selection then spends the room where the scores are highest, wherever that is."""
        out: list[_Span | list[_Span]] = []
        groups: dict[int, list[_Span]] = {}
        for span in spans:
            if not self._method(span.rule).global_scores:
                out.append(span)
                continue
            if id(span.rule) not in groups:
                groups[id(span.rule)] = []
                out.append(groups[id(span.rule)])
            groups[id(span.rule)].append(span)
        return [_joined(item) if isinstance(item, list) else item for item in out]

    # ---- telemetry -------------------------------------------------------------------------------
    def _record(self, event: str, seconds: float | None = None) -> None:
        """A timeline entry; a compaction's carries the ``seconds`` it held the session (selection, rebuild,
        closing gaps): the pause a user waits."""
        kv = self.session.cache.kv_bytes()
        self.peak_slots = max(self.peak_slots, self.session.cache.slots_per_head)
        self.peak_kv_bytes = max(self.peak_kv_bytes, kv)
        self.timeline.append(
            {
                "time": time.time(),
                "event": event,
                "logical": len(self.session.tokens),
                "physical": self.session.cache.slots_per_head,
                "kv_bytes": kv,
                "segments": self.session.segment_slots(),
                **({} if seconds is None else {"seconds": seconds}),
            }
        )


@dataclass
class _Span:
    """Compactable positions of one segment, or of adjacent segments that share one budget."""

    segments: list[Segment]
    positions: torch.Tensor
    rule: CompactionRule
    current: float  # slots per head now (mean over layers and heads)
    wanted: float  # what the rules ask for when they fire

    @property
    def floor(self) -> int:
        return min(self.rule.min_slots, len(self.positions))


def _fill(room: float, shares: list[float], caps: list[float], floors: list[int]) -> list[int]:
    """Split ``room`` slots in proportion to ``shares``, no span above its cap nor below its floor; the room
    a capped span cannot take goes to the others (water-filling), so the cap's budget is used, not wasted."""
    targets: list[float | None] = [None] * len(shares)
    open_spans = set(range(len(shares)))
    while open_spans:
        total = sum(shares[i] for i in open_spans) or 1e-12
        full = [i for i in open_spans if room * shares[i] / total >= caps[i]]
        if not full:
            break
        for i in full:
            targets[i] = caps[i]
            room -= caps[i]
            open_spans.remove(i)
    total = sum(shares[i] for i in open_spans) or 1e-12
    for i in open_spans:
        targets[i] = max(0.0, room) * (shares[i] / total)  # a lone span gets exactly the room
    return [int(max(floor, math.floor(t))) for t, floor in zip(targets, floors)]


def _joined(spans: list[_Span]) -> _Span:
    """The spans as one (positions in order; they need not be adjacent)."""
    if len(spans) == 1:
        return spans[0]
    return _Span(
        [seg for s in spans for seg in s.segments],
        torch.cat([s.positions for s in spans]),
        spans[0].rule,
        sum(s.current for s in spans),
        sum(s.wanted for s in spans),
    )


def _merge_oldest(spans: list[_Span], room: float) -> list[_Span]:
    """Merge the oldest adjacent spans until their floors fit in ``room``: a session of hundreds of segments
    cannot keep one slot per head for each under a small cap, so old segments come to share one floor. The
    merged span is compacted by the rule of its largest member."""
    spans = list(spans)
    i = 0
    while sum(s.floor for s in spans) > room and i + 1 < len(spans):
        a, b = spans[i], spans[i + 1]
        if int(a.positions[-1]) + 1 != int(b.positions[0]):  # something protected or recent lies between
            i += 1
            continue
        largest = max((a, b), key=lambda s: len(s.positions))
        spans[i : i + 2] = [
            _Span(
                a.segments + b.segments,
                torch.cat([a.positions, b.positions]),
                largest.rule,
                a.current + b.current,
                a.wanted + b.wanted,
            )
        ]
    return spans


register_memory_loader("memory_manager", MemoryManager.from_export)
