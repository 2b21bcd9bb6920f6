"""Keyword search over a session's lossless transcript, so an agent can find what to ``recall``.

Compaction keeps what attention needed so far; a question that arrives hours later may need a tool output
the cache squeezed hard. The transcript still holds every segment verbatim: rank segments against the
question with BM25 (Robertson & Zaragoza, 2009) and re-insert the best one with ``Session.recall``.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from kvmemory.runtime.segments import Segment

TERM = re.compile(r"[a-z0-9_]+")


def terms(text: str) -> list[str]:
    """Lower-case word terms; an identifier counts whole and by its parts (``database_port``, ``database``,
    ``port``), so a question in words finds a setting by name and the other way round."""
    found = []
    for word in TERM.findall(text.lower()):
        found.append(word)
        if "_" in word.strip("_"):
            found += [part for part in word.split("_") if part]
    return found


def rank_segments(query: str, segments: list[Segment], k1: float = 1.2, b: float = 0.75) -> list[tuple[float, Segment]]:
    """Segments sharing terms with ``query``, best first, as (BM25 score, segment); the rest are left out."""
    wanted = set(terms(query))
    if not wanted or not segments:
        return []
    counts = [Counter(terms(seg.text)) for seg in segments]
    mean_length = sum(sum(c.values()) for c in counts) / len(counts) or 1.0
    documents_with = Counter(term for c in counts for term in wanted if term in c)
    idf = {term: math.log(1 + (len(segments) - df + 0.5) / (df + 0.5)) for term, df in documents_with.items()}
    ranked = []
    for seg, count in zip(segments, counts):
        norm = k1 * (1 - b + b * sum(count.values()) / mean_length)
        score = sum(idf[t] * count[t] * (k1 + 1) / (count[t] + norm) for t in wanted if count[t])
        if score > 0:
            ranked.append((score, seg))
    ranked.sort(key=lambda pair: -pair[0])
    return ranked
