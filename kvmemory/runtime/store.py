"""Many sessions on one engine: resident up to a byte budget, the rest saved on disk.

``SessionStore(engine, directory, max_resident_bytes)`` keeps sessions by id. ``with store.use(id) as s``
gives the session (resident, else loaded from its saved file, else new) and pins it for the block; when
the KV bytes of the resident sessions pass the budget, the least recently used unpinned ones are saved and
closed (spilled), to come back from their files, bit for bit, on their next use. Nothing is dropped
silently: a spill is a save, and ``stats()`` counts spills and loads. With a directory, ``save(id)`` after a
turn makes a session survive a process restart; without one the store only holds sessions in memory.

Admission: a session that would take the resident bytes past the budget (a returning one counts its saved
size) waits while every resident session is in use, and comes in when one is released (and spilled).
With ``when_full="wait"`` the store never spills by itself: newcomers wait until ``spill`` or ``drop``
frees room. A wait longer than ``admission_timeout`` raises ``StoreFullError``; ``stats()`` counts waits.

Bounds: ``ids()`` lists every session (resident and saved: each save leaves a small ``.id`` file naming
its session), ``expire(max_idle)`` deletes the saved sessions idle longer than that, and a store opened on a
directory removes the temporary files of saves a crash interrupted.

A directory shared by several stores (engine replicas, one per process): the latest save of a session wins.
A store remembers which version of the file each resident session was loaded from or saved to; when another
store has saved the session since, its next use here reloads that file instead of serving the stale copy,
and spilling the stale copy closes it without writing over the newer file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

from kvmemory.errors import InvalidArgumentError, SessionBusyError, StoreFullError
from kvmemory.runtime.memory_hooks import SessionMemory
from kvmemory.runtime.persistence import remove_interrupted_writes
from kvmemory.runtime.session import Session

log = logging.getLogger("kvmemory.store")


class SessionStore:
    """Sessions by id (see the module docstring)."""

    def __init__(
        self,
        engine,
        directory=None,
        max_resident_bytes: int | None = None,
        when_full: str = "spill",
        admission_timeout: float | None = 60.0,
    ):
        if max_resident_bytes is not None and directory is None:
            raise InvalidArgumentError("max_resident_bytes needs a directory to spill sessions to")
        if max_resident_bytes is not None and max_resident_bytes < 1:
            raise InvalidArgumentError(f"max_resident_bytes must be positive, got {max_resident_bytes}")
        if when_full not in ("spill", "wait"):
            raise InvalidArgumentError(f"when_full must be 'spill' or 'wait', got {when_full!r}")
        self.engine = engine
        self.directory = Path(directory) if directory is not None else None
        self.max_resident_bytes = max_resident_bytes
        self.when_full, self.admission_timeout = when_full, admission_timeout
        self._resident: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._pins: Counter[str] = Counter()
        self._versions: dict[str, tuple | None] = {}  # the file version each resident session matches, if any
        self._lock = threading.Condition(threading.RLock())  # notified when a session is released or leaves
        self._last_used: dict[str, float] = {}  # resident sessions: when a use of each last ended
        self.loads = self.spills = self.waits = 0
        if self.directory is not None:
            self._remove_interrupted_saves()

    def path(self, session_id: str) -> Path | None:
        """Where ``session_id`` is saved: a readable prefix of the id plus a hash (ids may hold any text)."""
        if self.directory is None:
            return None
        readable = re.sub(r"[^A-Za-z0-9_.-]", "_", session_id)[:40]
        return self.directory / f"{readable}-{hashlib.sha256(session_id.encode()).hexdigest()[:12]}.kvm"

    def __contains__(self, session_id: str) -> bool:
        path = self.path(session_id)
        return session_id in self._resident or (path is not None and path.is_file())

    @contextlib.contextmanager
    def use(self, session_id: str, new_memory: Callable[[], SessionMemory | None] | None = None) -> Iterator[Session]:
        """The session, pinned (never spilled) for the block; ``new_memory()`` serves a session made new.
        Waits while admitting it would pass the budget (see the module docstring)."""
        with self._lock:
            self._admit(session_id)
            session = self.get(session_id, new_memory)
            self._pins[session_id] += 1
        try:
            yield session
        finally:
            with self._lock:
                self._pins[session_id] -= 1
                self._last_used[session_id] = time.time()
                if self.when_full == "spill":
                    self._fit()
                self._lock.notify_all()

    def get(self, session_id: str, new_memory: Callable[[], SessionMemory | None] | None = None) -> Session:
        """The session (resident, loaded from its file, or new), without pinning it."""
        with self._lock:
            if session_id in self._resident:
                if self._pins[session_id] or not self._saved_elsewhere(session_id):  # in use: reloaded once free
                    self._resident.move_to_end(session_id)
                    return self._resident[session_id]
                log.info("session %r was saved by another store since; loading that save", session_id)
                return self.reload(session_id)
            path = self.path(session_id)
            if path is not None and path.is_file():
                session = self._load(session_id)
            else:
                session = self.engine.session(session_id, memory=new_memory() if new_memory else None)
            self._resident[session_id] = session
            if self.when_full == "spill":
                self._fit(keep=session_id)
            return session

    def save(self, session_id: str) -> Path:
        """Write a resident session to its file (what a restart or a spill brings back)."""
        with self._lock:
            if self.directory is None:
                raise InvalidArgumentError("this store has no directory to save to")
            path = self._resident[session_id].save(self.path(session_id))
            self._versions[session_id] = file_version(path)
            label = path.with_suffix(".id")
            if not label.is_file():
                label.write_text(session_id)
            return path

    def spill(self, session_id: str) -> None:
        """Save a resident, unpinned session and free its memory; its next use loads it back."""
        with self._lock:
            if self._pins[session_id]:
                raise SessionBusyError(f"session {session_id!r} is in use and cannot be spilled")
            if self._saved_elsewhere(session_id):
                log.info("session %r was saved by another store since; its stale copy here is closed", session_id)
            else:
                self.save(session_id)
            self._resident.pop(session_id).close()
            self._versions.pop(session_id, None)
            self.spills += 1
            self._lock.notify_all()

    def reload(self, session_id: str) -> Session:
        """Replace the resident session with its saved file (an explicit restore: what was not saved is
        discarded). A missing or bad file raises before the resident session is touched."""
        with self._lock:
            if self._pins[session_id]:
                raise SessionBusyError(f"session {session_id!r} is in use and cannot be restored")
            path = self.path(session_id)
            if path is None:
                raise InvalidArgumentError("this store has no directory to restore from")
            session = self._load(session_id)
            old = self._resident.pop(session_id, None)
            if old is not None:
                old.close()
            self._resident[session_id] = session
            if self.when_full == "spill":
                self._fit(keep=session_id)
            return session

    def drop(self, session_id: str) -> None:
        """Forget a session: close it and delete its file."""
        with self._lock:
            if self._pins[session_id]:
                raise SessionBusyError(f"session {session_id!r} is in use and cannot be dropped")
            session = self._resident.pop(session_id, None)
            if session is not None:
                session.close()
            self._versions.pop(session_id, None)
            self._last_used.pop(session_id, None)
            path = self.path(session_id)
            if path is not None:
                path.unlink(missing_ok=True)
                path.with_suffix(".id").unlink(missing_ok=True)
            self._lock.notify_all()

    def ids(self) -> list[str]:
        """Every session this store can serve: the resident ones, then the saved ones."""
        with self._lock:
            found = dict.fromkeys(self._resident)
            if self.directory is not None:
                for label in sorted(self.directory.glob("*.id")):
                    if label.with_suffix(".kvm").is_file():
                        found.setdefault(label.read_text(), None)
            return list(found)

    def idle_seconds(self, session_id: str) -> float:
        """Seconds since the session was last used (resident) or saved (on disk only)."""
        with self._lock:
            if session_id in self._resident:
                return 0.0 if self._pins[session_id] else time.time() - self._last_used.get(session_id, time.time())
            path = self.path(session_id)
            return time.time() - path.stat().st_mtime if path is not None and path.is_file() else 0.0

    def expire(self, max_idle_seconds: float) -> list[str]:
        """Drop every session not in use and idle longer than ``max_idle_seconds`` (its file too); returns their ids."""
        with self._lock:
            expired = [i for i in self.ids() if not self._pins[i] and self.idle_seconds(i) > max_idle_seconds]
            for session_id in expired:
                self.drop(session_id)
            return expired

    def _remove_interrupted_saves(self) -> None:
        """Temporary files a crash left mid-save (``.NAME.kvm.WRITER.XXXX.tmp``): ``remove_interrupted_writes``."""
        remove_interrupted_writes(self.directory.glob(".*.kvm.*.tmp"))

    def footprint(self, session_id: str) -> int:
        """Bytes the session holds here: its KV cache while resident, plus its saved file."""
        with self._lock:
            session = self._resident.get(session_id)
            path = self.path(session_id)
            saved = 0
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    saved = path.stat().st_size
            return (session.cache.kv_bytes() if session is not None else 0) + saved

    def resident_bytes(self) -> int:
        with self._lock:
            return sum(s.cache.kv_bytes() for s in self._resident.values())

    def stats(self) -> dict:
        with self._lock:
            return {
                "resident": list(self._resident),
                "resident_bytes": self.resident_bytes(),
                "max_resident_bytes": self.max_resident_bytes,
                "loads": self.loads,
                "spills": self.spills,
                "waits": self.waits,
            }

    def _load(self, session_id: str) -> Session:
        """The session from its file, remembering which version of the file it is (read before loading: a
        save landing meanwhile only makes the next use reload)."""
        path = self.path(session_id)
        version = file_version(path)
        session = self.engine.load_session(path, session_id)
        self._versions[session_id] = version
        self.loads += 1
        return session

    def _saved_elsewhere(self, session_id: str) -> bool:
        """Whether another store has saved this resident session since this one loaded or saved it."""
        if self.directory is None:
            return False
        current = file_version(self.path(session_id))
        return current is not None and current != self._versions.get(session_id)

    def _admit(self, session_id: str) -> None:
        """Return once ``session_id`` fits under the budget (spilling idle sessions when allowed), or raise
        ``StoreFullError`` after ``admission_timeout`` seconds. Holds the store's lock (released while waiting)."""
        if self.max_resident_bytes is None or session_id in self._resident:
            return
        path = self.path(session_id)
        incoming = path.stat().st_size if path.is_file() else 0  # a saved session's size bounds its KV bytes
        deadline = None if self.admission_timeout is None else time.monotonic() + self.admission_timeout
        waited = False
        while True:
            if self.when_full == "spill":
                self._fit(room=incoming)
            if self.resident_bytes() + incoming <= self.max_resident_bytes or not self._resident:
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise StoreFullError(
                    f"session {session_id!r} needs {incoming:,} bytes; the store holds {self.resident_bytes():,} of "
                    f"its {self.max_resident_bytes:,} in sessions that stay in use"
                )
            if not waited:
                self.waits, waited = self.waits + 1, True
            self._lock.wait(left)

    def _fit(self, keep: str | None = None, room: int = 0) -> None:
        """Spill the least recently used unpinned sessions (never ``keep``) while over the budget (less ``room``)."""
        if self.max_resident_bytes is None:
            return
        for session_id in list(self._resident):
            if self.resident_bytes() + room <= self.max_resident_bytes:
                return
            if session_id != keep and not self._pins[session_id]:
                self.spill(session_id)


def file_version(path: Path) -> tuple | None:
    """What tells one save of a file from another: a save replaces the file (a new inode), so inode, size
    and modification time change together; None when there is no file."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns
