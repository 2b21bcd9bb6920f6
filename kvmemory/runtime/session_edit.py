"""SessionEdit: the one way code outside the Session's own files changes a Session.

The memory manager and the compactor change a live session (apply a plan, close position gaps, count what
was compacted, log it). They do it through an edit, which ``Session.edit()`` opens: the block holds the
session's lock and an undo snapshot, so whatever it does is undone bit for bit if anything in it raises.
Reads go through ``edit.session`` as usual; every write is a method here.
"""

from __future__ import annotations

from kvmemory.cache import CompactionPlan
from kvmemory.compaction.jobs import CompactionRecord, SpanJob
from kvmemory.runtime.session_compaction import run_jobs


class SessionEdit:
    """Changes to one session inside its ``edit()`` block (see the module docstring)."""

    def __init__(self, session):
        self.session = session

    def apply_plan(self, plan: CompactionPlan) -> None:
        """Rebuild the cache to hold exactly the plan's slots (validated first: a bad plan raises)."""
        session = self.session
        session.engine.batcher.execute(session.cache.apply_plan, plan)  # heavy: where the passes run

    def compact(
        self, jobs: list[SpanJob], trigger: str = "manual", measure_error: bool = True
    ) -> list[CompactionRecord]:
        """Compact several disjoint spans with one cache rebuild (``runtime/session_compaction.py``)."""
        return run_jobs(self, jobs, trigger, measure_error)

    def rebase_positions(self) -> int:
        """Re-rotate each head's keys to the ranks of its slots, closing the gaps compaction left."""
        return self.session._rebase()

    def mark_compacted(self, segment_ids: list[int], record: CompactionRecord) -> None:
        """Count one more compaction on these segments, release their context queries (a later compaction
        uses the window) and log what was done."""
        session, compacted = self.session, set(segment_ids)
        session.segments = [
            s.replaced(compactions=s.compactions + 1) if s.id in compacted else s for s in session.segments
        ]
        self.release_context_queries(segment_ids)
        session.compaction_log.append(record.to_dict())

    def mark_cap_forced(self, forced: dict[int, int]) -> None:
        """Add, per segment id, the compactions the cap forced below its rule's budget."""
        session = self.session
        session.segments = [
            s.replaced(cap_forced=s.cap_forced + forced[s.id]) if forced.get(s.id) else s for s in session.segments
        ]

    def release_context_queries(self, segment_ids: list[int]) -> None:
        """Forget the queries recorded while these segments were prefilled (they have served their compaction)."""
        if self.session.query_recorder is not None:
            self.session.query_recorder.drop_context(segment_ids)
