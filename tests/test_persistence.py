"""Saved sessions: ``session.save(path)`` then ``engine.load_session(path)`` gives the session back bit for
bit (every cache shape, recorders, memory manager), and a bad file fails with an error that names it."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from kvmemory import Engine, MemoryManager, ModelMismatchError, SessionFileError
from kvmemory.memory import CompactionRule, MemoryBudget, MemoryPolicy
from tests.conftest import random_tokens, tiny_model
from tests.test_contract import assert_same_state, state_of, uneven_plan


def capped_policy(method: str = "attention_matching", **params) -> MemoryPolicy:
    return MemoryPolicy(
        default=CompactionRule(method=method, params=params, ratio=3.0, query_source=["window", "context"]),
        budget=MemoryBudget(max_slots=96, recent_tokens=16, interval=None),
    )


def greedy(session, n: int = 12) -> list[int]:
    return session.fork(with_memory=True).generate(max_new_tokens=n).token_ids


@pytest.mark.parametrize("method", ["attention_matching", "real", "counter_causal"])
def test_a_compacted_session_loads_bit_identical_and_goes_on_the_same_way(tmp_path, method):
    engine = Engine(tiny_model("llama"))
    params = {"inner": "attention_matching", "scores": [[1.0, 4.0], [2.5, 0.5]]} if method == "real" else {}
    session = engine.session(memory=MemoryManager(capped_policy(method, **params)))
    for i in range(6):
        session.append_tokens(random_tokens(40, seed=i))
    assert session.cache.compactions > 0
    saved = state_of(session)
    path = session.save(tmp_path / "s.kvm")

    loaded = engine.load_session(path)
    assert_same_state(state_of(loaded), saved)
    assert loaded.memory.timeline == session.memory.timeline
    assert torch.equal(loaded.logprobs(random_tokens(20, seed=99)), session.logprobs(random_tokens(20, seed=99)))
    assert greedy(loaded) == greedy(session)
    for s in (session, loaded):  # both keep compacting under the same cap, the same way
        s.append_tokens(random_tokens(120, seed=7))
    assert_same_state(state_of(loaded), state_of(session))


def test_uneven_layers_and_heads_with_bias_round_trip(tmp_path):
    engine = Engine(tiny_model("qwen3"))
    session = engine.session()
    session.append_tokens(random_tokens(90))
    session.apply_plan(uneven_plan(session))
    assert len({layer.length for layer in session.cache.layers}) > 1
    loaded = engine.load_session(session.save(tmp_path / "uneven.kvm"))
    assert_same_state(state_of(loaded), state_of(session))
    assert greedy(loaded) == greedy(session)


def test_a_chat_session_keeps_its_conversation(tmp_path, default_engine):
    session = default_engine.session()
    session.set_messages([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True)
    session.generate(max_new_tokens=6)
    loaded = default_engine.load_session(session.save(tmp_path / "chat.kvm"), session_id="restored")
    assert loaded.id == "restored" and loaded.messages == session.messages
    follow = [{"role": "user", "content": "And another?"}]
    loaded.append_messages(follow, add_generation_prompt=True)
    session.append_messages(follow, add_generation_prompt=True)
    assert loaded.prefilled_tokens == session.prefilled_tokens  # the held turns were reused, not re-prefilled
    assert loaded.generate(max_new_tokens=8).text == session.generate(max_new_tokens=8).text


def test_an_empty_session_round_trips(tmp_path, tiny_engine):
    loaded = tiny_engine.load_session(tiny_engine.session().save(tmp_path / "empty.kvm"))
    assert loaded.tokens == [] and loaded.cache.physical_length == 0
    loaded.append_tokens(random_tokens(10))


def test_bad_files_raise_errors_that_name_the_problem(tmp_path, tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(30))
    path = session.save(tmp_path / "good.kvm")
    blob = path.read_bytes()

    with pytest.raises(SessionFileError, match="no session file"):
        tiny_engine.load_session(tmp_path / "missing.kvm")
    (tmp_path / "truncated.kvm").write_bytes(blob[: len(blob) - 100])
    with pytest.raises(SessionFileError, match="truncated or damaged"):
        tiny_engine.load_session(tmp_path / "truncated.kvm")
    flipped = bytearray(blob)
    flipped[-10] ^= 0xFF
    (tmp_path / "flipped.kvm").write_bytes(bytes(flipped))
    with pytest.raises(SessionFileError, match="checksum"):
        tiny_engine.load_session(tmp_path / "flipped.kvm")
    (tmp_path / "junk.kvm").write_bytes(b"not a session at all")
    with pytest.raises(SessionFileError, match="not a kvmemory session file"):
        tiny_engine.load_session(tmp_path / "junk.kvm")
    other = Engine(tiny_model("llama", seed=1))  # same shapes, other weights
    with pytest.raises(ModelMismatchError, match="weights_sha256"):
        other.load_session(path)
    with pytest.raises(ModelMismatchError, match="layers"):
        Engine(tiny_model("llama", num_hidden_layers=3)).load_session(path)
    newer = blob.replace(b'\\"version\\": 1', b'\\"version\\": 9')
    assert newer != blob
    (tmp_path / "newer.kvm").write_bytes(newer)
    with pytest.raises(SessionFileError, match="version 9;"):
        tiny_engine.load_session(tmp_path / "newer.kvm")


def test_a_crash_mid_save_leaves_the_previous_file(tmp_path, tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(20))
    path = session.save(tmp_path / "s.kvm")
    before = path.read_bytes()
    session.append_tokens(random_tokens(20, seed=2))
    with mock.patch("kvmemory.runtime.persistence.os.replace", side_effect=OSError("disk full")):
        with pytest.raises(OSError, match="disk full"):
            session.save(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["s.kvm"]  # no temporary file left behind
    assert tiny_engine.load_session(path).tokens == session.tokens[:20]
