"""Saved sessions: ``session.save(path)`` then ``engine.load_session(path)`` gives the session back bit for
bit (every cache shape, recorders, memory manager), and a bad file fails with an error that names it."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from unittest import mock

import pytest
import torch
from langchain_core.messages import HumanMessage

from kvmemory import (
    Engine,
    InvalidArgumentError,
    MemoryManager,
    ModelMismatchError,
    SessionBusyError,
    SessionFileError,
    SessionStore,
    StoreFullError,
)
from kvmemory.integrations import ChatKVMemory
from kvmemory.memory import CompactionRule, MemoryBudget, MemoryPolicy
from kvmemory.runtime.persistence import FORMAT_VERSION, writer_tag
from tests.conftest import random_tokens, tiny_model, wait_until
from tests.test_contract import assert_same_state, state_of, uneven_plan


def capped_policy(method: str = "attention_matching", **params) -> MemoryPolicy:
    return MemoryPolicy(
        default=CompactionRule(method=method, params=params, ratio=3.0, query_source=["window", "context"]),
        budget=MemoryBudget(max_slots=96, recent_tokens=16, interval=None),
    )


def greedy(session, n: int = 12) -> list[int]:
    return session.fork(with_memory=True).generate(max_new_tokens=n).token_ids


@pytest.mark.parametrize("method", ["attention_matching", "real", "counter_causal", "selective_context"])
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


@pytest.mark.parametrize("stored, other", [("float16", "float32"), ("int8", "float16")])
def test_a_narrow_cache_round_trips_bit_identical_and_converts_to_and_from_another_dtype(tmp_path, stored, other):
    """A 16- or 8-bit cache saves and loads bit for bit; loaded by an engine that stores another dtype its
    slots are converted (decoded 8-bit rows, widened 16-bit ones), and back again within a level."""
    model = tiny_model("llama")
    engine, wider = Engine(model, kv_dtype=stored), Engine(model, kv_dtype=other)
    session = engine.session(memory=MemoryManager(capped_policy("attention_matching")))
    for i in range(6):
        session.append_tokens(random_tokens(40, seed=i))
    assert session.cache.compactions > 0
    path = session.save(tmp_path / "narrow.kvm")
    loaded = engine.load_session(path)
    assert_same_state(state_of(loaded), state_of(session))
    assert greedy(loaded) == greedy(session)
    converted = wider.load_session(path)
    back = engine.load_session(converted.save(tmp_path / "wider.kvm"))
    for a, b, c in zip(converted.cache.layers, session.cache.layers, back.cache.layers):
        n = b.length
        assert a.slots.keys.dtype == wider.kv_dtype and torch.equal(a.keys[:, :, :n], b.keys[:, :, :n].to(a.keys))
        level = b.keys.abs().max().item() / 127 if stored == "int8" else 0
        assert torch.allclose(c.keys[:, :, :n], b.keys[:, :, :n], atol=level, rtol=0)
    probe = random_tokens(20, seed=99)
    assert torch.allclose(converted.logprobs(probe), session.logprobs(probe), atol=0.02)
    assert torch.allclose(back.logprobs(probe), session.logprobs(probe), atol=0.02)


def test_a_chat_session_keeps_its_conversation(tmp_path, small_engine):
    session = small_engine.session()
    session.set_messages([{"role": "user", "content": "Name a colour."}], add_generation_prompt=True)
    session.generate(max_new_tokens=6)
    loaded = small_engine.load_session(session.save(tmp_path / "chat.kvm"), session_id="restored")
    assert loaded.id == "restored" and loaded.messages == session.messages
    follow = [{"role": "user", "content": "And another?"}]
    loaded.append_messages(follow, add_generation_prompt=True)
    session.append_messages(follow, add_generation_prompt=True)
    assert loaded.prefilled_tokens == session.prefilled_tokens  # the held turns were reused, not re-prefilled
    assert loaded.generate(max_new_tokens=8).text == session.generate(max_new_tokens=8).text


def test_an_empty_session_round_trips(tmp_path, tiny_engine):
    loaded = tiny_engine.load_session(tiny_engine.session().save(tmp_path / "empty.kvm"))
    assert loaded.tokens == [] and loaded.cache.slots_per_head == 0
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
    fine_tune = tiny_model("llama")  # the same weights but one, far into a tensor: another model all the same
    with torch.no_grad():
        fine_tune.get_input_embeddings().weight.view(-1)[-1] += 1.0
    with pytest.raises(ModelMismatchError, match="weights_sha256"):
        Engine(fine_tune).load_session(path)
    assert Engine(tiny_model("llama"), weights_digest="ab" * 32).identity["weights_sha256"] == "ab" * 32
    newer = blob.replace(f'\\"version\\": {FORMAT_VERSION}'.encode(), b'\\"version\\": 9')
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


# ---- the session store ---------------------------------------------------------------------------------
def test_the_store_spills_the_least_recently_used_and_loads_it_back_bit_identical(tmp_path, tiny_engine):
    store = SessionStore(tiny_engine, tmp_path, max_resident_bytes=int(1.5 * 60 * tiny_engine.kv_bytes_per_token))
    with store.use("a") as a:
        a.append_tokens(random_tokens(60))
        before = state_of(a)
    with store.use("b") as b:
        b.append_tokens(random_tokens(60, seed=2))
    assert store.stats()["resident"] == ["b"] and store.spills == 1 and "a" in store
    with store.use("a") as a:
        assert_same_state(state_of(a), before)
        a.append_tokens(random_tokens(5, seed=3))
    assert store.loads == 1 and store.stats()["resident"] == ["a"]
    assert store.resident_bytes() <= store.max_resident_bytes


def test_a_session_in_use_is_never_spilled(tmp_path, tiny_engine):
    store = SessionStore(tiny_engine, tmp_path, max_resident_bytes=tiny_engine.kv_bytes_per_token * 10)
    with store.use("a") as a, store.use("b") as b:  # both admitted while small
        a.append_tokens(random_tokens(40))
        b.append_tokens(random_tokens(40))
        assert store.stats()["resident"] == ["a", "b"]  # over the budget, but pinned
        with pytest.raises(SessionBusyError):
            store.spill("a")
    assert store.stats()["resident"] == [] and store.spills == 2  # both spilled once free


def test_the_store_lists_its_sessions_and_expires_the_idle_ones_with_their_files(tmp_path, tiny_engine):
    store = SessionStore(tiny_engine, tmp_path)
    for name in ("old", "new", "busy"):
        with store.use(name) as session:
            session.append_tokens(random_tokens(8))
        store.save(name)
    store.spill("old")
    assert store.ids() == ["new", "busy", "old"]  # resident first, then saved
    long_ago = os.stat(store.path("old")).st_mtime - 3600
    os.utime(store.path("old"), (long_ago, long_ago))
    with store.use("busy"):
        with mock.patch("kvmemory.runtime.store.time.time", return_value=os.stat(store.path("new")).st_mtime + 60):
            assert store.expire(1800) == ["old"]  # "new" was used a minute ago; "busy" is in use
            assert sorted(store.expire(30)) == ["new"]
    assert store.ids() == ["busy"] and sorted(p.suffix for p in tmp_path.iterdir()) == [".id", ".kvm"]


def test_opening_a_store_removes_what_crashed_saves_left(tmp_path, tiny_engine):
    crashed, fresh = tmp_path / ".a-1.kvm.x1.tmp", tmp_path / ".b-2.kvm.x2.tmp"
    crashed.write_bytes(b"half a file")
    fresh.write_bytes(b"another store is writing this one now")
    old = crashed.stat().st_mtime - 3600
    os.utime(crashed, (old, old))
    gone = subprocess.Popen(["true"])
    gone.wait()  # a process of this host that has exited: its save was interrupted, however recent
    host = writer_tag().split("~")[0]
    dead_writer = tmp_path / f".c-3.kvm.{host}~{gone.pid}~x3.tmp"
    live_writer = tmp_path / f".d-4.kvm.{writer_tag()}x4.tmp"
    other_host = tmp_path / f".e-5.kvm.elsewhere~{gone.pid}~x5.tmp"
    for path in (dead_writer, live_writer, other_host):
        path.write_bytes(b"part of a save")
    SessionStore(tiny_engine, tmp_path)
    assert not crashed.exists() and not dead_writer.exists()
    assert fresh.exists() and live_writer.exists() and other_host.exists()


def test_the_serving_core_hides_the_server_paths_in_its_errors(tmp_path, tiny_engine):
    from kvmemory.integrations.serving import APIError, ServingCore

    store = SessionStore(tiny_engine, tmp_path)
    core = ServingCore(store, MemoryPolicy.never())
    store.path("s").write_bytes(b"not a session")
    with pytest.raises(APIError) as err:
        core.restore("s")
    assert err.value.code == "session_file_unusable" and str(tmp_path) not in err.value.message


def test_the_serving_core_expires_idle_sessions_but_not_one_in_use(tmp_path, tiny_engine):
    from kvmemory.integrations.serving import ServingCore

    core = ServingCore(SessionStore(tiny_engine, tmp_path), MemoryPolicy.never(), session_ttl=0.0)
    for key in ("idle", "busy"):
        with core.hold(key) as session:
            session.append_tokens(random_tokens(4))
    with core.hold("busy"):
        assert core.expire() == ["idle"]
    assert core.store.ids() == ["busy"]


def test_an_api_key_past_its_share_of_sessions_or_bytes_is_refused_while_another_key_goes_on(tmp_path, tiny_engine):
    from kvmemory.integrations.serving import ServingCore, TooManySessions

    per_token = tiny_engine.kv_bytes_per_token
    core = ServingCore(
        SessionStore(tiny_engine, tmp_path), MemoryPolicy.never(), sessions_per_key=2, bytes_per_key=60 * per_token
    )
    for key in ("alice/a", "alice/b"):
        with core.hold(key) as session:
            session.append_tokens(random_tokens(20))
    with pytest.raises(TooManySessions) as refused, core.hold("alice/c"):
        pass
    assert refused.value.code == "key_session_limit" and "alice/c" not in core.store
    with core.hold("alice/a") as session:  # an existing session goes on while the key is under its bytes
        session.append_tokens(random_tokens(30, seed=2))
    core.store.save("alice/a")  # its file counts as well as its resident cache
    assert core.store.footprint("alice/a") > 50 * per_token
    with pytest.raises(TooManySessions) as refused, core.hold("alice/b"):
        pass
    assert refused.value.code == "key_storage_limit" and "MiB" in refused.value.message
    with core.hold("bob/a") as session:  # another key is not held back by alice's sessions
        session.append_tokens(random_tokens(20))
    core.delete("alice/a")
    with core.hold("alice/b") as session:
        session.append_tokens(random_tokens(1))


def test_a_newcomer_waits_while_every_resident_session_is_in_use(tmp_path, tiny_engine):
    budget = tiny_engine.kv_bytes_per_token * 50
    store = SessionStore(tiny_engine, tmp_path, max_resident_bytes=budget)
    admitted = threading.Event()

    def newcomer():
        with store.use("b") as b:
            b.append_tokens(random_tokens(10, seed=2))
            admitted.set()

    with store.use("a") as a:
        a.append_tokens(random_tokens(60))  # over the budget, and in use: "b" must wait
        waiting = threading.Thread(target=newcomer)
        waiting.start()
        wait_until(lambda: store.waits == 1, what="the newcomer to wait")
        assert not admitted.is_set()
    waiting.join(timeout=30)  # "a" released: spilled, and "b" comes in
    assert admitted.is_set() and store.spills == 1 and store.stats()["resident"] == ["b"]
    assert tiny_engine.stats()["kv_bytes"] >= store.resident_bytes()


def test_a_store_that_stays_full_refuses_in_time_and_changes_nothing(tmp_path, tiny_engine):
    store = SessionStore(tiny_engine, tmp_path, tiny_engine.kv_bytes_per_token * 50, admission_timeout=0.2)
    with store.use("a") as a:
        a.append_tokens(random_tokens(60))
        with pytest.raises(StoreFullError, match="in use"):
            with store.use("b"):
                pass
        assert store.stats()["resident"] == ["a"] and "b" not in store


def test_a_waiting_store_never_spills_by_itself(tmp_path, tiny_engine):
    store = SessionStore(
        tiny_engine, tmp_path, tiny_engine.kv_bytes_per_token * 50, when_full="wait", admission_timeout=30
    )
    with store.use("a") as a:
        a.append_tokens(random_tokens(60))
    assert store.stats()["resident"] == ["a"] and store.spills == 0  # over the budget, but never spilled
    operator = threading.Thread(target=lambda: wait_until(lambda: store.waits == 1) or store.spill("a"))
    operator.start()  # frees the room once "b" waits
    with store.use("b"):
        assert store.waits == 1 and store.stats()["resident"] == ["b"]
    operator.join()
    with pytest.raises(InvalidArgumentError, match="when_full"):
        SessionStore(tiny_engine, tmp_path, 10, when_full="drop")


def test_stores_sharing_a_directory_serve_and_keep_the_latest_save(tmp_path, tiny_engine):
    """Two replicas' stores on one directory: a turn served by the other store is what this one serves next,
    and spilling this one's stale copy never writes over it."""
    here, there = SessionStore(tiny_engine, tmp_path), SessionStore(tiny_engine, tmp_path)
    with here.use("a") as a:
        a.append_tokens(random_tokens(20))
    here.save("a")
    with there.use("a") as a:  # the session moved: the other store loads it and serves a turn
        a.append_tokens(random_tokens(10, seed=2))
        latest = state_of(a)
    there.save("a")
    with here.use("a") as a:  # back here: the stale resident copy gives way to the latest save
        assert_same_state(state_of(a), latest)
    assert here.loads == 1
    with there.use("a") as a:
        a.append_tokens(random_tokens(5, seed=3))
        latest = state_of(a)
    there.save("a")
    here.spill("a")  # stale here: closed without writing over the other store's save
    assert_same_state(state_of(tiny_engine.load_session(here.path("a"))), latest)
    assert here.stats()["resident"] == [] and there.stats()["resident"] == ["a"]


def test_a_byte_budget_needs_a_directory(tiny_engine):
    with pytest.raises(InvalidArgumentError, match="directory"):
        SessionStore(tiny_engine, max_resident_bytes=10)


def test_a_chat_thread_resumes_after_a_restart_from_its_saved_cache(tmp_path, small_engine):
    first = ChatKVMemory(engine=small_engine, store=SessionStore(small_engine, tmp_path / "a"), max_new_tokens=6)
    config = {"configurable": {"thread_id": "t"}}
    history = [HumanMessage("Name one colour.")]
    history.append(first.invoke(history, config=config))
    history.append(HumanMessage("And another?"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the saved files, as a restarted process finds them
    restarted = ChatKVMemory(engine=small_engine, store=SessionStore(small_engine, tmp_path / "b"), max_new_tokens=6)
    reply = restarted.invoke(history, config=config)
    assert restarted.store.loads == 1
    assert reply.usage_metadata["input_token_details"]["cache_read"] > 30  # the held turns came from the file
    continued = first.invoke(history, config=config)  # the same call without a restart
    assert (reply.content, reply.usage_metadata) == (continued.content, continued.usage_metadata)
