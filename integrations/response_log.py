"""Stored Responses-API responses (what ``previous_response_id`` continues) and compaction marks (the
conversation a compaction block or item stands for: ``integrations/context_edits.py``), per API key, with a cap
and an age limit."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from kvmemory.integrations.context_edits import AppliedEdit, EditsApplied, mark_of
from kvmemory.integrations.serving import BadRequest, NotFound
from kvmemory.runtime.persistence import remove_interrupted_writes, writer_tag


class ResponseLog:
    """Stored Responses-API responses: the response body, its owner, its session and the conversation the
    session holds after it (what ``previous_response_id`` continues). In a directory when one is given
    (shared by Ray replicas; a folder per API key), else in memory. Each key keeps its newest ``per_owner``
    responses, and a response older than ``ttl`` seconds is gone: one key cannot fill the disk or memory with
    them, nor push out another key's."""

    def __init__(self, directory: Path | None = None, per_owner: int = 1000, ttl: float | None = None):
        self.directory = Path(directory) / "responses" if directory is not None else None
        self.per_owner, self.ttl, self._swept = per_owner, ttl, 0.0
        self._memory: dict[str | None, OrderedDict] = {}  # owner -> id -> (time stored, record)
        self._lock = threading.Lock()
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            remove_interrupted_writes(self.directory.glob("*/.*.tmp"))

    def folder(self, owner: str | None) -> Path:
        return self.directory / (owner or "open")

    def put(self, record: dict) -> None:
        if self.ttl is not None and time.monotonic() - self._swept > 60:
            self._swept = time.monotonic()
            self.expire(self.ttl)
        owner = record["owner"]
        if self.directory is None:
            with self._lock:
                mine = self._memory.setdefault(owner, OrderedDict())
                mine[record["id"]] = (time.time(), record)
                while len(mine) > self.per_owner:
                    mine.popitem(last=False)
            return
        folder = self.folder(owner)
        folder.mkdir(exist_ok=True)
        handle, tmp = tempfile.mkstemp(prefix=f".{record['id']}.{writer_tag()}", suffix=".tmp", dir=folder)
        with os.fdopen(handle, "w") as out:
            out.write(json.dumps(record))
        os.replace(tmp, folder / f"{record['id']}.json")
        with contextlib.suppress(FileNotFoundError):  # (another replica pruning at the same time)
            stored = sorted(folder.glob("*.json"), key=modified)
            for old in stored[: max(0, len(stored) - self.per_owner)]:
                old.unlink(missing_ok=True)

    def get(self, ident: str, owner: str | None) -> dict:
        record, stored = None, None
        if self.directory is None:
            with self._lock:
                stored, record = self._memory.get(owner, {}).get(ident, (None, None))
        elif stored_id(ident):
            path = self.folder(owner) / f"{ident}.json"
            with contextlib.suppress(FileNotFoundError):
                stored, record = modified(path), json.loads(path.read_text())
        expired = stored is not None and self.ttl is not None and time.time() - stored > self.ttl
        if record is None or record["owner"] != owner or expired:
            raise NotFound(f"no response {ident!r}", code="response_not_found", param="response_id")
        return record

    def delete(self, ident: str, owner: str | None) -> None:
        self.get(ident, owner)
        if self.directory is None:
            with self._lock:
                self._memory.get(owner, {}).pop(ident, None)
        else:
            (self.folder(owner) / f"{ident}.json").unlink(missing_ok=True)

    def expire(self, max_age: float) -> None:
        """Forget the stored responses older than ``max_age`` seconds."""
        now = time.time()
        if self.directory is None:
            with self._lock:
                for mine in self._memory.values():
                    for ident in [i for i, (stored, _) in mine.items() if now - stored > max_age]:
                        mine.pop(ident)
            return
        for path in self.directory.glob("*/*.json"):
            with contextlib.suppress(FileNotFoundError):
                if now - modified(path) > max_age:
                    path.unlink()


def modified(path: Path) -> float:
    return path.stat().st_mtime


def stored_id(ident: str) -> bool:
    """An id this log may have made (a response's ``resp_``, a mark's ``mark_``): safe as a file name."""
    return ident.startswith(("resp_", "mark_")) and ident[5:].isalnum()


class Marks:
    """What compactions stand for (``integrations/context_edits.py``): each compaction a client asked for leaves
    a mark in the response log, the conversation the session held when it ran, per API key; the compaction
    block or item the client sends back expands to it."""

    def __init__(self, log: ResponseLog):
        self.log = log

    def expander(self, owner: str | None) -> Callable[[str | None, str], list[dict] | None]:
        """What a compaction block or item a client sent back stands for: the conversation its mark holds (None
        for another server's compaction)."""

        def expand(content: str | None, where: str) -> list[dict] | None:
            mark = mark_of(content)
            if mark is None:
                return None
            try:
                return self.log.get(mark, owner)["conversation"]
            except NotFound:
                raise BadRequest(
                    f"{where} stands for a conversation this server no longer holds (mark {mark!r} expired, or was "
                    "made for another key): send the conversation itself",
                    param=where,
                ) from None

        return expand

    def store(self, edits: list[AppliedEdit], owner: str | None, session: str | None) -> None:
        """Keep the conversation each compaction stands for, under a new mark (what its block or item names)."""
        for edit in edits:
            if edit.kind == "compaction" and edit.mark is None:
                held = edit.conversation
                edit.mark = "mark_" + os.urandom(16).hex()
                record = {"id": edit.mark, "owner": owner, "session": session}
                self.log.put({**record, "conversation": held[1:] if held[:1] and held[0]["role"] == "system" else held})

    async def passing(self, items: AsyncIterator, owner: str | None, session: str | None) -> AsyncIterator:
        """A turn's stream with its compactions' marks stored as they pass (before the client sees them)."""
        async for item in items:
            if isinstance(item, EditsApplied):
                self.store(item.edits, owner, session)
            yield item
