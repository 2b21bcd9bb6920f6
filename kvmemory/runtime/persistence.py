"""Saving a session to one file and loading it back, bit for bit: ``session.save(path)``,
``engine.load_session(path)``.

The file is a safetensors file. Its tensors are each layer's live slots (keys, values, β, positions, RoPE
positions, segment ids; each KV head's slots back to back, their counts in the metadata), the last logits
and the recorded reference queries; its metadata holds one JSON
document: a manifest (format name and version, library version, the model's identity — architecture,
shapes, dtype and a fingerprint of the weights — and a SHA-256 of every tensor's bytes) and the session's
state (transcript, segments, chat state, cache counters, recorders, and the memory manager's policy and
history). Writing goes to a temporary file in the same folder that replaces the old one only once complete,
so a crash mid-save leaves the previous file intact. Loading checks everything before building anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import tempfile
import time
from dataclasses import asdict
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from kvmemory.cache import int8_rows
from kvmemory.cache.compact_cache import CacheSnapshot
from kvmemory.cache.compact_layer import EMPTY_LAYER, FIELDS, LayerState, Slots
from kvmemory.errors import ModelMismatchError, SessionFileError
from kvmemory.runtime.memory_hooks import memory_loader
from kvmemory.runtime.segments import Segment
from kvmemory.runtime.session_state import SessionState

FORMAT, FORMAT_VERSION = "kvmemory-session", 2
READABLE_VERSIONS = (1, 2)  # version 1 stored each layer padded to its longest head


def library_version() -> str:
    try:
        return version("kvmemory")
    except PackageNotFoundError:
        return "unknown"


def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# ---- saving ------------------------------------------------------------------------------------------
def save_session(session, path) -> Path:
    """Write ``session`` to ``path`` atomically (see the module docstring); returns the path."""
    path = Path(path)
    tensors, state = _payload(session, session.snapshot())
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "library": library_version(),
        "model": session.engine.identity,
        "tensors_sha256": _tensor_digest(tensors),
    }
    blob = save_tensors(tensors, metadata={"kvmemory": json.dumps({"manifest": manifest, "state": state})})
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.{writer_tag()}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(blob)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def writer_tag() -> str:
    """Who writes a temporary file (``host~pid~``, in its name): what tells a later process on this host that
    the file's writer is gone, so that the file is an interrupted save and not one still being written."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40]
    return f"{host}~{os.getpid()}~"


INTERRUPTED_SAVE_AGE = 600.0  # seconds: a temporary file older than this belongs to a crashed write


def remove_interrupted_writes(temporary_files) -> None:
    """Remove the temporary files a crash left mid-write (never read again): at once where their writer, a
    process on this host, is gone; otherwise once older than any write takes (another process sharing the
    directory, on this host or another, may be writing a newer one)."""
    for tmp in temporary_files:
        with contextlib.suppress(FileNotFoundError):
            if abandoned(tmp) or time.time() - tmp.stat().st_mtime > INTERRUPTED_SAVE_AGE:
                tmp.unlink()


def abandoned(tmp: Path) -> bool:
    """Whether ``tmp`` was left by a writer on this host that is no longer running (files of other hosts, or of
    no known writer, cannot be judged this way)."""
    found = re.search(r"\.([A-Za-z0-9-]+)~(\d+)~", tmp.name)
    if found is None or found.group(1) != writer_tag().split("~")[0]:
        return False
    try:
        os.kill(int(found.group(2)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False


def _payload(session, snap: SessionState) -> tuple[dict[str, torch.Tensor], dict]:
    """The snapshot's tensors (live slots only) by name, and everything else as JSON-ready values."""
    tensors: dict[str, torch.Tensor] = {}
    layers = []
    for i, layer_state in enumerate(snap.cache.layers):
        initialized = layer_state.slots is not None
        layers.append({"lengths": list(layer_state.lengths), "biased": layer_state.biased, "initialized": initialized})
        if initialized:
            for name, live in zip(FIELDS, layer_state.live().fields()):
                tensors[f"layer.{i}.{name}"] = live.detach().cpu().contiguous()
    if snap.last_logits is not None:
        tensors["last_logits"] = snap.last_logits.detach().cpu().contiguous()
    rec, queries = session.query_recorder, None
    if rec is not None and snap.queries is not None:
        recent, context, current_segment = snap.queries
        if recent:  # one window per layer in the file
            window = torch.cat(recent, dim=2)
            tensors.update({f"queries.recent.{i}": q.cpu().contiguous() for i, q in enumerate(window)})
        for seg_id, per_layer in context.items():
            for i, q in enumerate(per_layer):
                if q is not None:
                    tensors[f"queries.context.{seg_id}.{i}"] = q.cpu().contiguous()
        queries = {
            "window": rec.window,
            "context_tokens": rec.context_tokens,
            "groups": rec.groups,
            "current_segment": current_segment,
            "context_segments": sorted(context),
        }
    hidden = None
    if snap.hidden is not None:
        hidden = sorted(snap.hidden)
        if hidden:
            tensors["hidden"] = torch.stack([snap.hidden[p] for p in hidden]).cpu().contiguous()
    if snap.surprisal is not None:
        tensors["surprisal"] = snap.surprisal.contiguous()
    cache = snap.cache
    state = {
        "id": session.id,
        "prefill_chunk_size": session.prefill_chunk_size,
        "tokens": snap.tokens,
        "pending": snap.pending,
        "segments": [asdict(s) for s in snap.segments],
        "next_segment_id": snap.next_segment_id,
        "messages": snap.messages,
        "message_spans": snap.message_spans,
        "tools_key": snap.tools_key,
        "reply": snap.reply,
        "compaction_log": session.compaction_log[: snap.compaction_log],
        "prefilled_tokens": snap.prefilled_tokens,
        "turn_prefilled": snap.turn_prefilled,
        "cache": {
            "logical_length": cache.logical_length,
            "rope_length": cache.rope_length,
            "compactions": cache.compactions,
            "default_segment": cache.default_segment,
            "layers": layers,
        },
        "queries": queries,
        "hidden_positions": hidden,
        "surprisal": snap.surprisal is not None,
        "memory": session.memory.export() if session.memory is not None else None,
    }
    return tensors, state


# ---- loading -----------------------------------------------------------------------------------------
def read_session_file(path, engine) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, state) of a session file, after every check; raises SessionFileError naming the problem."""
    path = Path(path)
    if not path.is_file():
        raise SessionFileError(f"no session file at {path}")
    blob = path.read_bytes()
    try:
        header_size = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + header_size])
        document = json.loads(header["__metadata__"]["kvmemory"])
        manifest, state = document["manifest"], document["state"]
    except (ValueError, KeyError, TypeError) as err:
        raise SessionFileError(f"{path} is not a kvmemory session file (or its header is damaged): {err}") from err
    if manifest.get("format") != FORMAT:
        raise SessionFileError(f"{path} is a {manifest.get('format')!r} file, not a {FORMAT!r} file")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise SessionFileError(
            f"{path} has session format version {manifest.get('version')}; this kvmemory "
            f"({library_version()}) reads version {FORMAT_VERSION}"
        )
    expected = engine.identity
    differs = {k: (manifest["model"].get(k), v) for k, v in expected.items() if manifest["model"].get(k) != v}
    if differs:
        what = ", ".join(f"{k}: file {a!r}, engine {b!r}" for k, (a, b) in differs.items())
        raise ModelMismatchError(f"{path} was saved from another model ({what})")
    try:
        tensors = load_tensors(blob)
    except (SafetensorError, ValueError, RuntimeError) as err:
        raise SessionFileError(f"{path} is truncated or damaged: {err}") from err
    if _tensor_digest(tensors) != manifest["tensors_sha256"]:
        raise SessionFileError(f"{path} is damaged: its tensors do not match the checksum written with them")
    return tensors, state


def load_session(engine, path, session_id: str | None = None):
    """A new session on ``engine`` exactly as ``path`` holds it (compacted cache, transcript, recorders and
    memory manager); it continues as the saved one would."""
    tensors, state = read_session_file(path, engine)
    device = engine.device

    def tensor(name: str):
        return tensors[name].to(device) if name in tensors else None

    memory = memory_loader(state["memory"]["kind"])(state["memory"]) if state["memory"] is not None else None
    session = engine.session(session_id or state["id"], prefill_chunk_size=state["prefill_chunk_size"])
    if state["hidden_positions"] is not None:
        session.record_last_layer_inputs()
    if state.get("surprisal"):  # files written before surprisal was recorded have none
        session.record_surprisal()
    if memory is not None:
        session.set_memory(memory)  # switches on the recorders its methods read; their contents follow
    queries = state["queries"]
    if queries is not None:
        session.record_queries(queries["window"], context=queries["context_tokens"]).groups = queries["groups"]
    layers = [_layer_state(meta, i, tensor, engine.kv_dtype) for i, meta in enumerate(state["cache"]["layers"])]
    saved_cache = state["cache"]
    session.restore(
        SessionState(
            cache=CacheSnapshot(
                layers,
                saved_cache["logical_length"],
                saved_cache["rope_length"],
                saved_cache["compactions"],
                saved_cache["default_segment"],
                growth_room=None,  # a memory manager sets it again before the next append
            ),
            transcript=state["tokens"],
            token_count=len(state["tokens"]),
            pending=state["pending"],
            last_logits=tensor("last_logits"),
            segments=[Segment(**{**s, "tags": tuple(s["tags"])}) for s in state["segments"]],
            next_segment_id=state["next_segment_id"],
            messages=state["messages"],
            message_spans=[tuple(span) for span in state["message_spans"]],
            tools_key=state["tools_key"],
            reply=tuple(state["reply"]) if state["reply"] is not None else None,
            compaction_log=len(state["compaction_log"]),
            prefilled_tokens=state["prefilled_tokens"],
            turn_prefilled=state["turn_prefilled"],
            queries=_query_state(queries, tensor, engine.num_layers),
            hidden=_hidden_state(state["hidden_positions"], tensor),
            memory=memory.state() if memory is not None else None,
            surprisal=tensor("surprisal").cpu() if state.get("surprisal") else None,
            records=state["compaction_log"],
        )
    )
    return session


def _layer_state(meta: dict, i: int, tensor, kv_dtype: torch.dtype) -> LayerState:
    """One layer of a saved cache, its keys and values in the engine's ``kv_dtype`` (bit for bit when the
    file holds that dtype, converted otherwise; version 1 files held the layer padded to the longest head:
    the padding goes)."""
    if not meta["initialized"]:
        return EMPTY_LAYER
    keys, values, bias, positions, rope, segments = (tensor(f"layer.{i}.{name}") for name in FIELDS)
    keys, values = int8_rows.convert(keys, kv_dtype), int8_rows.convert(values, kv_dtype)
    if "lengths" not in meta:
        return LayerState.from_padded(Slots.of(keys[0], values[0], bias[0], positions, rope, segments))
    slots = Slots.of(keys, values, bias, positions, rope, segments)
    return LayerState.packed(slots, tuple(meta["lengths"]), meta["biased"])


def _query_state(saved: dict | None, tensor, num_layers: int):
    """The query recorder's ``state()`` tuple from a saved session."""
    if saved is None:
        return None
    windows = [tensor(f"queries.recent.{i}") for i in range(num_layers)]
    recent = () if windows[0] is None else (torch.stack(windows),)
    context = {s: [tensor(f"queries.context.{s}.{i}") for i in range(num_layers)] for s in saved["context_segments"]}
    return recent, context, saved["current_segment"]


def _hidden_state(positions: list[int] | None, tensor) -> dict | None:
    """The last-layer input recorder's store from a saved session."""
    if positions is None:
        return None
    stacked = tensor("hidden")
    return {p: stacked[k] for k, p in enumerate(positions)}
