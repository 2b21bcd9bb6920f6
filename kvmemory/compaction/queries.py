"""Reference queries: what the model will ask of a span, as post-RoPE queries grouped by KV head.

This file names the sources and holds the pure helpers; ``runtime/reference_queries.py`` gathers the
queries from a live session.

Sources (selectable per call, combinable):
* ``window``: the last R tokens' queries, recorded as the session runs (free; what online compaction has);
* ``context``: queries recorded while the span itself was prefilled (free, subsampled per segment, kept in
  bf16 until the segment is first compacted; later re-compactions, and spans prefilled before recording
  was switched on, fall back to the window);
* ``repeat``: the model is told to repeat the context and the span is teacher-forced as its answer;
* ``self_study``: the model writes a summary of the span and the questions it raises; its queries count.
The scratch sources run past the end of the session and are rolled back: the session is unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch

QuerySource = Literal["window", "context", "repeat", "self_study"]
QUERY_SOURCES = ("window", "context", "repeat", "self_study")
MAX_SOURCE_TOKENS = 2048  # tokens' queries one source may give a compaction (bounds the fit's memory)
REPEAT_INSTRUCTION = "\n\nRepeat the previous context verbatim.\n\n"
SELF_STUDY_INSTRUCTION = (
    "\n\nSummarize the text above: list every name, number, file, error and fact it contains, "
    "then write three questions it answers.\n\n"
)


def evenly_spaced(queries: torch.Tensor | None, tokens: int, group: int) -> torch.Tensor | None:
    """At most ``tokens`` evenly spaced tokens' queries of (H, T·G, D), whole GQA groups."""
    if queries is None or queries.shape[1] <= tokens * group:
        return queries
    heads, rows, dim = queries.shape
    chosen = torch.linspace(0, rows // group - 1, tokens, device=queries.device).round().long()
    return queries.view(heads, rows // group, group, dim)[:, chosen].reshape(heads, tokens * group, dim)
