"""Continuous batching: concurrent sessions' forwards run as packed passes, and each session's output is
what it would have been alone, whatever its cache's shape; a failed pass is no one else's failure."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from kvmemory import Engine
from kvmemory.compaction.methods.attention_matching import AttentionMatching
from kvmemory.memory import MemoryManager, MemoryPolicy
from kvmemory.runtime import compute
from kvmemory.runtime.batching import ForwardRequest
from kvmemory.runtime.weights import store_linear_weights
from tests.conftest import random_tokens, tiny_model, wait_until
from tests.test_contract import assert_same_state, state_of, uneven_plan

CAP = 64


def capped_policy() -> MemoryPolicy:
    return MemoryPolicy.from_dict(
        {"default": {"method": "snapkv", "ratio": 2}, "budget": {"max_slots": CAP, "recent_tokens": 8}}
    )


def build(engine: Engine, kind: str):
    """A session whose cache has one of the shapes a batch must mix."""
    if kind == "plain":
        session = engine.session()
        session.append_tokens(random_tokens(23, seed=1))
    elif kind == "matched":  # Attention Matching: fitted values and non-zero β
        session = engine.session()
        session.append_tokens(random_tokens(90, seed=2))
        session.compact("attention_matching", slots=30, keep_last=16)
    elif kind == "uneven":  # every layer and head a different length, padding slots at −∞
        session = engine.session()
        session.append_tokens(random_tokens(70, seed=3))
        session.apply_plan(uneven_plan(session, seed=3))
    elif kind == "capped":  # a memory manager that compacts while the reply is generated
        session = engine.session(memory=MemoryManager(capped_policy()))
        session.append_tokens(random_tokens(60, seed=4))
    else:
        raise ValueError(kind)
    return session


KINDS = ("plain", "matched", "uneven", "capped")


def slow_passes(engine: Engine, seconds: float = 0.02) -> None:
    """Make each pass take a while, so that the other sessions' steps queue up behind it and batch."""
    forward = engine.batcher.forward

    def slow(*args):
        time.sleep(seconds)
        return forward(*args)

    engine.batcher.forward = slow


def run_together(sessions, call, batcher=None):
    """``call(session)`` on every session at once, one thread each; returns results (or raised errors).

    With ``batcher``, every thread is announced as decoding (``expecting``) before any of them starts, so the
    first pass waits for all of them (up to its ``max_gather_seconds``) however the threads are scheduled."""
    results = [None] * len(sessions)
    start = threading.Barrier(len(sessions))

    def work(i):
        with batcher.expecting() if batcher is not None else contextlib.nullcontext():
            start.wait()
            try:
                results[i] = call(sessions[i])
            except Exception as error:  # noqa: BLE001 - handed back to the test
                results[i] = error

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sessions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def quiet_setup(engine: Engine) -> None:
    """Passes run so far gather nobody afterwards (the engine is idle at once); later passes wait for every
    announced session (a bound only: a pass starts as soon as all are in)."""
    engine.batcher.max_gather_seconds = 0.0


def gather_everyone(engine: Engine) -> None:
    engine.batcher.max_gather_seconds = 5.0


def greedy(n: int):
    return lambda session: session.generate(max_new_tokens=n).token_ids


def test_concurrent_sessions_of_every_cache_shape_decode_as_they_would_alone():
    engine = Engine(tiny_model("llama", eos_token_id=None))
    quiet_setup(engine)
    alone = [greedy(24)(build(engine, kind)) for kind in KINDS]
    passes_alone = engine.batcher.stats.passes
    sessions = [build(engine, kind) for kind in KINDS]
    slow_passes(engine)
    gather_everyone(engine)
    stats = engine.batcher.stats  # counters that grow in place
    busy_before, passes_before, started = stats.busy_seconds, stats.passes, time.perf_counter()
    together = run_together(sessions, greedy(24), engine.batcher)
    wall = time.perf_counter() - started
    assert together == alone
    assert stats.largest == len(KINDS)  # at some step every session was in one pass
    assert stats.passes - passes_alone < len(KINDS) * 24  # fewer passes than steps: they were shared
    busy = stats.busy_seconds - busy_before  # every pass slept 0.02 s, one at a time, within the wall time
    assert 0.02 * (stats.passes - passes_before) <= busy <= wall
    capped = sessions[KINDS.index("capped")]
    assert capped.compaction_log and capped.memory.peak_slots <= CAP  # compacted mid-reply, under the cap


def test_decoders_that_leave_at_different_steps_all_finish_as_they_would_alone():
    """Sessions of a pass that never come back (their replies ended) are waited for only briefly, and the
    thread gathering the next pass hands over to the others when its own request has run: no step is lost
    or stuck however arrivals and departures interleave."""
    engine = Engine(tiny_model("llama", eos_token_id=None))
    quiet_setup(engine)
    lengths = [3, 5, 8, 11, 13, 17, 20, 26, 2, 7]
    alone = []
    for i, n in enumerate(lengths):
        session = engine.session()
        session.append_tokens(random_tokens(10 + i, seed=i))
        alone.append(session.generate(max_new_tokens=n).token_ids)
    sessions = []
    for i in range(len(lengths)):
        session = engine.session()
        session.append_tokens(random_tokens(10 + i, seed=i))
        sessions.append(session)
    slow_passes(engine, seconds=0.005)
    gather_everyone(engine)
    together = run_together(
        sessions, lambda s: s.generate(max_new_tokens=lengths[sessions.index(s)]).token_ids, engine.batcher
    )
    assert together == alone
    assert engine.batcher.stats.largest > 1


def test_sessions_starting_replies_together_share_their_first_pass():
    """A request that finds the engine idle waits for the sessions already inside a reply (``expecting``):
    otherwise the first to arrive runs alone and the group decodes one pass behind from then on."""
    engine = Engine(tiny_model("llama", eos_token_id=None))
    quiet_setup(engine)  # the engine is idle once the setup's passes have run
    sessions = []
    for i in range(4):
        session = engine.session()
        session.append_tokens(random_tokens(12 + i, seed=i))
        session.generate(max_new_tokens=1)  # a sampled token is pending: the next reply starts with a forward
        sessions.append(session)
    gather_everyone(engine)
    sizes, forward = [], engine.batcher.forward

    def counting(input_ids, rope, cache, *args):
        sizes.append(len(cache.requests))
        return forward(input_ids, rope, cache, *args)

    engine.batcher.forward = counting
    everyone_in = threading.Barrier(len(sessions))

    def reply(session):  # what generate announces, made certain before the first request (threads race)
        with engine.batcher.expecting():
            everyone_in.wait()
            return session.generate(max_new_tokens=6).token_ids

    run_together(sessions, reply)
    assert sizes[0] == len(sessions)


def test_the_shorter_of_prefills_begun_together_runs_first_and_whole():
    """Prefill chunks are taken by ``finish_by``, not arrival: of two prompts appended together, the shorter
    one's chunks all run before the longer one's first, so it gets its first token as if it were alone
    (taken in turn, both would finish near the end of the two)."""
    engine = Engine(tiny_model("llama", eos_token_id=None), prefill_chunk_size=16, max_batch_tokens=16)  # 1 chunk
    engine.batcher.max_gather_seconds = 5.0  # only a bound: the first pass waits until both are queued
    long, short = engine.session(), engine.session()
    slow_passes(engine, 0.05)  # the next pass waits half as long for the shorter one's next chunk
    served, forward = [], engine.batcher.forward

    def recording(input_ids, rope, cache, *args):
        served.append([r.cache for r in cache.requests])
        return forward(input_ids, rope, cache, *args)

    engine.batcher.forward = recording
    both_in = threading.Barrier(2)

    def append(session):  # announced as generate does, so neither request runs before the other is queued
        with engine.batcher.expecting():
            both_in.wait()
            session.append_tokens(random_tokens(96 if session is long else 32, seed=5))

    run_together([long, short], append)
    assert served == [[short.cache]] * 2 + [[long.cache]] * 6
    assert long.tokens[:32] == short.tokens  # the same prompt start: only the order of the passes differed


def lone_and_packed_logprobs(engine: Engine, scored: int = 6) -> tuple[list, list]:
    """Three sessions' log-probabilities of ``scored`` tokens after prompts of 5, 17 and 40 tokens: each run
    alone, then all three prefilling and scoring at once in packed passes."""
    prompts = [random_tokens(n, seed=n) for n in (5, 17, 40)]
    alone = []
    for prompt in prompts:
        session = engine.session()
        session.append_tokens(prompt)
        alone.append(session.logprobs(random_tokens(scored, seed=9)))
    sessions = [engine.session() for _ in prompts]
    slow_passes(engine)
    run_together(list(zip(sessions, prompts)), lambda pair: pair[0].append_tokens(pair[1]))
    together = run_together(sessions, lambda s: s.logprobs(random_tokens(scored, seed=9)))
    assert engine.batcher.stats.largest > 1
    return alone, together


def test_packed_logits_match_lone_logits_on_every_architecture(arch):
    alone, together = lone_and_packed_logprobs(Engine(tiny_model(arch)))
    for a, b in zip(alone, together):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_pass_that_fails_with_several_sessions_is_undone_and_each_retried_alone():
    engine = Engine(tiny_model("llama", eos_token_id=None))
    alone = [greedy(12)(build(engine, kind)) for kind in ("matched", "uneven")]
    sessions = [build(engine, kind) for kind in ("matched", "uneven")]
    forward, failed = engine.batcher.forward, []

    def fails_when_shared(input_ids, rope, cache, *rest):  # as a pass too large for the device would, once
        time.sleep(0.02)
        logits = forward(input_ids, rope, cache, *rest)  # every cache of the pass has taken its tokens
        if len(cache.requests) > 1 and not failed:
            failed.append(True)
            raise RuntimeError("out of memory")
        return logits

    engine.batcher.forward = fails_when_shared
    assert run_together(sessions, greedy(12)) == alone  # the half-applied pass left no trace
    assert failed and engine.batcher.stats.retried == 1


def test_one_sessions_failure_leaves_it_unchanged_and_the_others_running():
    engine = Engine(tiny_model("llama", eos_token_id=None))
    expected = greedy(12)(build(engine, "plain"))
    healthy, broken = build(engine, "plain"), build(engine, "uneven")
    before = state_of(broken)

    def store(queries, segments=None):
        raise RuntimeError("recorder failed")

    broken.query_recorder.store = store
    slow_passes(engine)
    results = run_together([healthy, broken], greedy(12))
    assert results[0] == expected
    assert isinstance(results[1], RuntimeError)
    assert_same_state(state_of(broken), before)


def test_work_after_a_pass_runs_per_request_and_fails_only_its_own_request():
    engine = Engine(tiny_model("llama"))
    sessions = [build(engine, "plain"), build(engine, "uneven")]

    def fails(logits):
        raise RuntimeError("sampler failed")

    def request(session, after):
        return ForwardRequest(session.cache, [5], len(session.tokens), 0, after=after)

    batch = [request(sessions[0], lambda logits: int(logits[-1].argmax())), request(sessions[1], fails)]
    engine.batcher.execute(engine.batcher._run, batch)  # one packed pass of both
    assert engine.batcher.stats.largest == 2 and all(r.done for r in batch)
    assert batch[0].error is None and batch[0].outcome == int(batch[0].logits[-1].argmax())
    assert isinstance(batch[1].error, RuntimeError) and batch[1].outcome is None


def test_decode_steps_beside_a_prefill_chunk_give_their_lone_logits_bit_for_bit():
    # fp16 weights: each row's products are the same bits whatever rows share the pass (the fp16 kernel);
    # a one-token part attends in the decode kernel, as a lone step does, even beside a prefill chunk
    engine = Engine(store_linear_weights(tiny_model("qwen2", hidden_size=512, intermediate_size=1024), "fp16"))
    sessions = [build(engine, kind) for kind in KINDS] + [engine.session()]
    sessions[-1].append_tokens(random_tokens(12, seed=7))
    new = [[5]] * len(KINDS) + [random_tokens(20, seed=8)]  # decode steps, then a prefill chunk

    def request(session, ids):
        return ForwardRequest(session.cache, ids, len(session.tokens), 0, all_logits=len(ids) > 1)

    alone = []
    for session, ids in zip(sessions, new):
        lone = [request(session.fork(), ids)]
        engine.batcher.execute(engine.batcher._run, lone)
        alone.append(lone[0].logits)
    batch = [request(session, ids) for session, ids in zip(sessions, new)]
    engine.batcher.execute(engine.batcher._run, batch)  # one packed pass of all five
    assert engine.batcher.stats.largest == len(batch) and all(r.error is None for r in batch)
    for r, expected in zip(batch, alone):
        assert torch.equal(r.logits, expected)


class LayerByLayer(AttentionMatching):
    """Attention Matching that notes, per layer, how many passes the engine had run by then. With
    ``decoder_queued``, a layer waits (on the compute thread) until another session's pass is queued, so
    the pause after it has that pass to run."""

    def __init__(self, engine: Engine, decoder_queued: bool = False):
        super().__init__()
        self.engine, self.passes_seen, self.decoder_queued = engine, [], decoder_queued
        self.began = threading.Event()

    def compact_layer(self, *args, **kwargs):
        self.passes_seen.append(self.engine.batcher.stats.passes)
        self.began.set()
        if self.decoder_queued:
            wait_until(lambda: compute._waiting.qsize() > 0, what="the decoder's next pass to be queued")
        return super().compact_layer(*args, **kwargs)


def test_other_sessions_decode_between_the_layers_of_a_compaction(monkeypatch):
    """A compaction pauses between layers for the passes queued meanwhile (``CacheSpan.each_layer``): the
    other sessions keep decoding through it, and both sessions end exactly as they would have alone. The
    decoder steps its reply by hand and holds after three tokens until the compaction has begun, so the
    compaction always meets a decoder under way."""
    monkeypatch.setattr(compute, "SLICE_SECONDS", 0.0)  # every pause runs what waits
    engine = Engine(tiny_model("llama", eos_token_id=None, num_hidden_layers=4))

    def sessions():
        compacted, decoder = engine.session(), engine.session()
        compacted.append_tokens(random_tokens(90, seed=2))
        decoder.append_tokens(random_tokens(23, seed=1))
        return compacted, decoder

    compacted, decoder = sessions()
    compacted.compact(LayerByLayer(engine), slots=30, keep_last=16)
    alone = state_of(compacted), decoder.generate(max_new_tokens=60).token_ids
    compacted, decoder = sessions()
    method = LayerByLayer(engine, decoder_queued=True)
    tokens, three_steps = [], threading.Event()

    def decode():
        generation = decoder.start_generation(max_new_tokens=60)
        while (step := generation.step()) is not None:
            if len(step[1].token_ids) == 3:
                three_steps.set()
                assert method.began.wait(60)
        generation.close()
        tokens.extend(generation.result.token_ids)

    worker = threading.Thread(target=decode)
    worker.start()
    assert three_steps.wait(60)
    compacted.compact(method, slots=30, keep_last=16)
    worker.join()
    assert method.passes_seen[-1] > method.passes_seen[0]  # its passes ran while the compaction did
    assert_same_state(state_of(compacted), alone[0])
    assert tokens == alone[1]


def test_compactions_of_two_sessions_at_once_each_end_as_alone(monkeypatch):
    """One compaction's pause may run another session's whole compaction (it was queued meanwhile): each
    cache ends exactly as when compacted alone."""
    monkeypatch.setattr(compute, "SLICE_SECONDS", 0.0)
    engine = Engine(tiny_model("llama", eos_token_id=None, num_hidden_layers=4))

    def session(seed):
        s = engine.session()
        s.append_tokens(random_tokens(90, seed=seed))
        return s

    alone = []
    for seed in (5, 6):
        s = session(seed)
        s.compact(LayerByLayer(engine), slots=30, keep_last=16)
        alone.append(state_of(s))
    sessions = [session(5), session(6)]
    run_together(sessions, lambda s: s.compact(LayerByLayer(engine), slots=30, keep_last=16))
    for s, expected in zip(sessions, alone):
        assert_same_state(state_of(s), expected)


@pytest.mark.small_model
def test_concurrent_chats_on_the_default_model_match_their_lone_replies(small_engine):
    prompts = ["Name three primary colours.", "What is 12 times 12?", "Write a haiku about rain."]

    def chat(prompt, memory=None):
        session = small_engine.session(memory=memory)
        session.append_messages([{"role": "user", "content": prompt}])
        return session

    alone = [chat(p).generate(max_new_tokens=16).token_ids for p in prompts]
    sessions = [chat(p) for p in prompts]
    largest = small_engine.batcher.stats.largest
    together = run_together(sessions, greedy(16))
    assert together == alone
    assert small_engine.batcher.stats.largest >= max(largest, 2)
