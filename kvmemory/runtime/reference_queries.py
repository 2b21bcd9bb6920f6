"""Reference queries gathered from a live session, per source (``compaction/queries.py`` names them).

``window`` and ``context`` read the session's query recorder; ``repeat`` and ``self_study`` run past the
end of the session in a scratch block, which is rolled back: the session is unchanged.
"""

from __future__ import annotations

import torch

from kvmemory.compaction.queries import (
    MAX_SOURCE_TOKENS,
    QUERY_SOURCES,
    REPEAT_INSTRUCTION,
    SELF_STUDY_INSTRUCTION,
    evenly_spaced,
)
from kvmemory.errors import InvalidArgumentError
from kvmemory.runtime.recorders import QUERY_WINDOW


def reference_queries(
    session,
    sources: str | list[str],
    positions: torch.Tensor,
    self_study_tokens: int = 64,
    max_tokens_per_source: int = MAX_SOURCE_TOKENS,
) -> list[torch.Tensor]:
    """Per layer (H, m, D) reference queries for the span at ``positions`` from the given sources; a source
    other than the window gives at most ``max_tokens_per_source`` tokens' queries, evenly spaced (a method's
    fit holds an (H, m, span) attention matrix per layer, so m must stay bounded whatever the span)."""
    sources = [sources] if isinstance(sources, str) else list(sources)
    group = session.engine.config.num_attention_heads // session.engine.num_kv_heads
    per_source = []
    for source in sources:
        if source == "window":
            per_source.append(_window(session))
            continue
        if source == "context":
            found = _context(session, positions)
            if found is None:  # not recorded, or compacted before and released: the window stands in
                if "window" not in sources:
                    per_source.append(_window(session))
                continue
        elif source == "repeat":
            found = _repeat(session, positions)
        elif source == "self_study":
            found = _self_study(session, self_study_tokens)
        else:
            raise ValueError(f"unknown reference-query source {source!r}; use one of {QUERY_SOURCES}")
        per_source.append([evenly_spaced(q, max_tokens_per_source, group) for q in found])
    return [torch.cat([qs[layer] for qs in per_source], dim=1) for layer in range(session.engine.num_layers)]


def _window(session) -> list[torch.Tensor]:
    """The selector-window queries; a session that records none (its memory policy reads none) reads its
    last R tokens again in a scratch pass and uses their queries instead."""
    recorder = session.query_recorder
    if recorder is None or not recorder.has_window:
        if not session.tokens:
            raise InvalidArgumentError("no selector-window queries: the session holds no tokens yet")
        return _capture(session, [session.tokens[-QUERY_WINDOW:]])
    return [recorder.window_queries(layer) for layer in range(session.engine.num_layers)]


def _context(session, positions: torch.Tensor) -> list[torch.Tensor] | None:
    recorder = session.query_recorder
    if recorder is None or not recorder.context_tokens:
        return None  # not recorded (``record_queries(context=N)``, which a policy using them switches on)
    lo, hi = int(positions.min()), int(positions.max()) + 1
    return recorder.context_queries([s.id for s in session.segments if s.start < hi and s.end > lo])


def _capture(session, token_batches: list[list[int]]) -> list[torch.Tensor]:
    recorder = session.record_queries(session.query_recorder.window if session.query_recorder else 0)
    with session.scratch() as run:
        recorder.frozen = True
        recorder.start_capture()
        try:
            for ids in token_batches:
                for a in range(0, len(ids), session.prefill_chunk_size):
                    run(ids[a : a + session.prefill_chunk_size])
        finally:
            captured = recorder.stop_capture()
            recorder.frozen = False
    return captured


def _repeat(session, positions: torch.Tensor) -> list[torch.Tensor]:
    tokenizer = session.engine.tokenizer
    instruction = tokenizer.encode(REPEAT_INSTRUCTION, add_special_tokens=False)
    span_tokens = [session.tokens[p] for p in positions.tolist()]
    return _capture(session, [instruction + span_tokens])


def _self_study(session, max_tokens: int) -> list[torch.Tensor]:
    tokenizer = session.engine.tokenizer
    instruction = tokenizer.encode(SELF_STUDY_INSTRUCTION, add_special_tokens=False)
    recorder = session.record_queries(session.query_recorder.window if session.query_recorder else 0)
    eos = session.engine.eos_token_ids
    with session.scratch() as run:
        recorder.frozen = True
        recorder.start_capture()
        try:
            logits = run(instruction)[-1]
            position = len(session.tokens) + len(instruction)
            for _ in range(max_tokens):
                token = int(torch.argmax(logits))
                if token in eos or position >= session.engine.position_limit:
                    break
                logits = run([token])[-1]
                position += 1
        finally:
            captured = recorder.stop_capture()
            recorder.frozen = False
    return captured
