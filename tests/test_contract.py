"""The Session contract: nothing appended or generated is lost; a failed call changes nothing (bit for bit,
every cache shape); cancellation keeps exactly what the caller received; calls are serialised."""

from __future__ import annotations

import asyncio
import functools
import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvmemory import (
    CompactionPlan,
    ContextLengthError,
    Engine,
    InvalidArgumentError,
    InvalidMessageError,
    InvalidPlanError,
    InvalidTokenError,
    KVMemoryError,
    LayerPlan,
    MemoryCapError,
    SamplingParams,
    SessionBusyError,
    SessionClosedError,
)
from kvmemory.memory import MemoryManager, MemoryPolicy
from tests.conftest import load_small_engine, random_tokens, tiny_model, until


def state_of(session) -> dict:
    """Everything a failed call must leave as it was, with the cache's live slots copied."""
    layers = []
    for layer in session.cache.layers:
        n = layer.length
        layers.append(
            None
            if layer.keys is None
            else (
                n,
                layer.keys[:, :, :n].clone(),
                layer.values[:, :, :n].clone(),
                layer.bias[:, :, :n].clone(),
                layer.positions[:, :n].clone(),
                layer.rope[:, :n].clone(),
                layer.segments[:, :n].clone(),
            )
        )
    return {
        "tokens": list(session.tokens),
        "pending": list(session._pending),
        "segments": [(s.id, s.kind, s.start, s.end, s.text, s.message_index, s.compactions) for s in session.segments],
        "messages": session.messages,
        "layers": layers,
        "counters": (session.cache.logical_length, session.cache.rope_length, session.cache.compactions),
        "log": len(session.compaction_log),
        "memory": session.memory.state() if session.memory is not None else None,
        "logits": None if session._last_logits is None else session._last_logits.clone(),
        "surprisal": None if session.surprisal_recorder is None else session.surprisal_recorder.values.clone(),
    }


def assert_same_state(a: dict, b: dict) -> None:
    for key in ("tokens", "pending", "segments", "messages", "counters", "log", "memory"):
        assert a[key] == b[key], key
    assert (a["logits"] is None) == (b["logits"] is None)
    if a["logits"] is not None:
        assert torch.equal(a["logits"], b["logits"])
    assert (a["surprisal"] is None) == (b["surprisal"] is None)
    if a["surprisal"] is not None:  # NaN marks unknown values: equal where known, unknown in the same places
        assert torch.equal(a["surprisal"].nan_to_num(-1.0), b["surprisal"].nan_to_num(-1.0))
    assert len(a["layers"]) == len(b["layers"])
    for la, lb in zip(a["layers"], b["layers"]):
        assert (la is None) == (lb is None)
        if la is not None:
            assert la[0] == lb[0]
            for ta, tb in zip(la[1:], lb[1:]):
                assert torch.equal(ta, tb)


def same_queries(a, b) -> bool:
    """Whether two query recorders' ``state()`` hold the same queries, bit for bit, however their lists of
    pieces are split (a saved recorder comes back with each list joined into one piece)."""
    (recent_a, context_a, segment_a), (recent_b, context_b, segment_b) = a, b

    def same(x: list, y: list) -> bool:
        return (not x and not y) or (bool(x) and bool(y) and torch.equal(torch.cat(x, dim=2), torch.cat(y, dim=2)))

    return (
        segment_a == segment_b
        and context_a.keys() == context_b.keys()
        and same(recent_a, recent_b)
        and all(same(context_a[k], context_b[k]) for k in context_a)
    )


def uneven_plan(session, seed: int = 0) -> CompactionPlan:
    """Every layer and head keeps a different number of slots (sinks and the last 8 always)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for li, layer in enumerate(session.cache.layers):
        n = layer.length
        keeps = []
        for h in range(layer.num_heads):
            middle = torch.arange(4, n - 8)
            count = max(1, int(len(middle) * (0.2 + 0.7 * ((li * 7 + h * 3) % 5) / 4)))
            chosen = middle[torch.randperm(len(middle), generator=g)[:count]].sort().values
            keeps.append(torch.cat([torch.arange(4), chosen, torch.arange(n - 8, n)]))
        layers.append(
            LayerPlan(
                keep=keeps,
                bias=torch.nn.utils.rnn.pad_sequence(
                    [torch.rand(len(k), generator=g) - 0.5 for k in keeps], batch_first=True
                ),
            )
        )
    return CompactionPlan(layers, method="uneven")


# ---- cache shapes ------------------------------------------------------------------------------------


def test_scratch_and_failed_appends_leave_uneven_layers_bit_identical():
    engine = Engine(tiny_model("llama", num_hidden_layers=3))
    session = engine.session()
    session.append_tokens(random_tokens(80, seed=2))
    session.apply_plan(uneven_plan(session))
    lengths = [layer.length for layer in session.cache.layers]
    assert len(set(lengths)) > 1
    before = state_of(session)
    cont = random_tokens(30, seed=3)
    first = session.logprobs(cont)
    assert_same_state(before, state_of(session))
    assert torch.equal(session.logprobs(cont), first)
    with pytest.raises(InvalidTokenError):
        session.append_tokens(random_tokens(5, seed=4) + [10**6])
    with pytest.raises(InvalidPlanError):
        session.apply_plan(
            CompactionPlan(
                [
                    LayerPlan(
                        keep=torch.zeros(lay.num_heads, 1, dtype=torch.long),
                        bias=torch.full((lay.num_heads, 1), float("inf")),
                    )
                    for lay in session.cache.layers
                ]
            )
        )
    assert_same_state(before, state_of(session))


def test_a_failed_append_after_mid_append_compactions_restores_the_cache_exactly(tiny_engine):
    policy = {"default": {"method": "snapkv", "ratio": 4}, "budget": {"max_slots": 96, "recent_tokens": 8}}
    session = tiny_engine.session(memory=MemoryManager(policy))
    session.append_tokens(random_tokens(150, seed=5))
    before = state_of(session)
    calls = []

    def fail_late(done, total):
        calls.append(done)
        if done >= 100:
            raise KeyboardInterrupt  # an interrupt after the manager compacted on the way

    with pytest.raises(KeyboardInterrupt):
        session.append_tokens(random_tokens(200, seed=6), progress=fail_late)
    assert len(calls) >= 2
    assert_same_state(before, state_of(session))


def test_a_step_whose_sampling_fails_inside_the_pass_leaves_the_session_bit_identical(tiny_engine, monkeypatch):
    session = tiny_engine.session()
    session.record_surprisal()  # the pass's after-work then records surprisal as well as picking the token
    session.append_tokens(random_tokens(30, seed=5))
    generation = session.start_generation(max_new_tokens=8, ignore_eos=True)
    generation.step()  # picked from the prompt's logits; the token waits to run with the next step's pass
    before = state_of(session)

    def fails(params, logits, generator, allowed=None, written=()):
        raise RuntimeError("sampler failed")

    monkeypatch.setattr(SamplingParams, "pick", fails)
    with pytest.raises(RuntimeError, match="sampler failed"):
        generation.step()  # the pending token's pass runs, then its after-work fails
    assert_same_state(before, state_of(session))


def test_a_fork_shares_no_buffers_with_its_parent(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(40, seed=7))
    child = session.fork()
    before = state_of(session)
    child.append_tokens(random_tokens(10, seed=8))
    child.generate(max_new_tokens=3)
    assert_same_state(before, state_of(session))
    session.append_tokens(random_tokens(10, seed=9))
    assert child.tokens[:40] == session.tokens[:40] and child.tokens[40:] != session.tokens[40:]


# ---- chat: nothing lost ------------------------------------------------------------------------------


@pytest.mark.small_model
def test_a_generated_reply_and_raw_text_survive_the_next_messages(small_engine):
    s = small_engine.session()
    s.append_messages([{"role": "user", "content": "Name three prime numbers."}], add_generation_prompt=True)
    reply = s.generate(max_new_tokens=8)
    s.append_messages([{"role": "user", "content": "And their sum?"}], add_generation_prompt=True)
    assert s.messages[1] == {"role": "assistant", "content": reply.text}
    s.generate(max_new_tokens=2)
    s.append_messages([])  # closes the reply
    s.append_text("NOTE: the database port is 5433.")
    s.append_messages([{"role": "user", "content": "Which port?"}], add_generation_prompt=True)
    text = small_engine.tokenizer.decode(s.tokens)
    assert text.count(reply.text) == 1 and "NOTE: the database port is 5433." in text
    assert text.index(reply.text) < text.index("And their sum?") < text.index("5433") < text.index("Which port?")
    assert s.search("database port")[0].text == "NOTE: the database port is 5433."
    fresh = small_engine.session()  # what is cached is what a fresh prefill of the transcript gives
    fresh.append_tokens(s.tokens)
    assert torch.allclose(fresh._last_logits, s._last_logits, atol=1e-4)


@pytest.mark.small_model
def test_a_snapshot_keeps_its_transcript_when_the_session_later_cuts_below_it(small_engine):
    """Snapshots share the transcript list instead of copying it on every decoded token: a cut below a
    snapshot's length (a rewritten history) must cut a copy, or restoring would bring back the new tokens."""
    s = small_engine.session()
    s.append_messages([{"role": "user", "content": "Name three prime numbers."}], add_generation_prompt=True)
    s.generate(max_new_tokens=4)
    before, snapshot = state_of(s), s.snapshot()
    s.set_messages([{"role": "user", "content": "Name three even numbers."}], add_generation_prompt=True)
    s.generate(max_new_tokens=4)
    assert s.tokens[: len(before["tokens"])] != before["tokens"]
    s.restore(snapshot)
    assert_same_state(before, state_of(s))
    s.generate(max_new_tokens=2)  # and the restored session goes on
    assert s.tokens[: len(before["tokens"])] == before["tokens"]


@pytest.mark.small_model
def test_every_append_path_checks_length_and_cap_first(small_engine):
    s = small_engine.session()
    s.append_text("A short note.")
    before = state_of(s)
    with pytest.raises(ContextLengthError):
        s.append_messages([{"role": "user", "content": "word " * 8300}])
    assert_same_state(before, state_of(s))

    policy = {
        "rules": [{"match": {"role": "user"}, "protected": True}],
        "budget": {"max_slots": 64, "recent_tokens": 8},
    }
    s = small_engine.session(memory=MemoryManager(policy))
    s.append_messages([{"role": "user", "content": "Hi."}], add_generation_prompt=True)
    s.generate(max_new_tokens=4)
    before = state_of(s)
    with pytest.raises(MemoryCapError):
        s.append_messages([{"role": "user", "content": "a long question " * 12}], add_generation_prompt=True)
    assert_same_state(before, state_of(s))


@pytest.mark.small_model
def test_stop_strings_keep_only_the_text_returned(small_engine):
    s = small_engine.session()
    s.append_text("The cat sat on the mat. The dog sat on the log. The")
    start = len(s.tokens)
    result = s.generate(max_new_tokens=24, stop="sat")
    assert "sat" not in result.text and result.finish_reason == "stop"
    assert small_engine.tokenizer.decode(s.tokens[start:]) == result.text
    s.generate(max_new_tokens=2)  # the session goes on from the kept text


def test_penalties_lower_the_tokens_the_reply_wrote_by_their_count():
    from kvmemory.runtime.sampling import SamplingParams

    logits = torch.tensor([5.0, 4.5, 4.0, 0.0])
    greedy = SamplingParams()
    assert greedy.pick(logits, None, written=[0, 0, 0]) == 0  # no penalty: the written token still wins
    assert SamplingParams(frequency_penalty=0.2).pick(logits, None, written=[0, 0, 0]) == 1  # 5 - 0.6 < 4.5
    assert SamplingParams(frequency_penalty=0.2).pick(logits, None, written=[0]) == 0  # 5 - 0.2 > 4.5
    assert SamplingParams(presence_penalty=1.5).pick(logits, None, written=[0, 1]) == 2  # 3.5, 3 and 4
    assert SamplingParams(frequency_penalty=2).pick(logits, None, [0, 3], written=[0, 0]) == 0  # only what is allowed
    for bad in (dict(frequency_penalty=3), dict(presence_penalty=float("inf"))):
        with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
            SamplingParams(**bad)


@pytest.mark.small_model
@pytest.mark.parametrize(
    "bad, error",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_k=-5), "top_k"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(stop=[""]), "stop"),
        (dict(max_new_tokens=1.5), "max_new_tokens"),
    ],
)
def test_bad_sampling_parameters_are_named(small_engine, bad, error):
    s = small_engine.session()
    s.append_text("Hello")
    before = state_of(s)
    with pytest.raises(InvalidArgumentError, match=error):
        s.generate(**bad)
    assert_same_state(before, state_of(s))


@pytest.mark.small_model
@pytest.mark.parametrize(
    "message, error",
    [
        ({"role": "robot", "content": "x"}, "role"),
        ({"role": "tool", "content": "x"}, "names no tool"),
        ({"role": "user", "content": ["x"]}, "string"),
        ("hello", "not a dict"),
    ],
)
def test_bad_messages_are_named(small_engine, message, error):
    s = small_engine.session()
    with pytest.raises(InvalidMessageError, match=error):
        s.append_messages([message])
    assert s.tokens == [] and s.messages == []


@pytest.mark.parametrize("tokens", [[1.5], torch.tensor([[1, 2]]), "abc", [True], []])
def test_bad_token_ids_are_named(tiny_engine, tokens):
    with pytest.raises(InvalidTokenError):
        tiny_engine.session().append_tokens(tokens)


def test_a_tool_message_takes_its_name_from_the_tool_call(small_engine):
    s = small_engine.session()
    call = {"id": "c1", "function": {"name": "run_tests", "arguments": {}}}
    s.append_messages(
        [
            {"role": "user", "content": "Run the tests."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "2 passed", "tool_call_id": "c1"},
        ]
    )
    assert s.segments[-1].tool_name == "run_tests"


# ---- cancellation and threads ------------------------------------------------------------------------


@pytest.mark.small_model
async def test_a_cancelled_task_keeps_exactly_the_text_received(small_engine):
    session = small_engine.async_session()
    await session.append_text("Once upon a time, in a small village by the sea,")
    start = len(session.sync.tokens)
    received: list[str] = []

    async def consume():
        async for piece in session.stream(max_new_tokens=200):
            received.append(piece)

    task = asyncio.create_task(consume())
    await until(lambda: len(received) >= 4 or task.done(), what="four pieces")
    assert len(received) >= 4
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert small_engine.tokenizer.decode(session.sync.tokens[start:]) == "".join(received)
    assert session.sync._stream is None
    start = len(session.sync.tokens)
    pieces = []
    stream = session.stream(max_new_tokens=50)
    async for piece in stream:
        pieces.append(piece)
        if len(pieces) == 2:
            break
    await stream.aclose()
    assert small_engine.tokenizer.decode(session.sync.tokens[start:]) == "".join(pieces)
    result = await session.generate(max_new_tokens=3)  # the session goes on
    assert len(result.token_ids) == 3
    await session.close()


@pytest.mark.small_model
def test_usage_counts_prompt_and_cached_tokens(small_engine):
    s = small_engine.session()
    s.append_messages([{"role": "user", "content": "Hi there."}], add_generation_prompt=True)
    first = s.generate(max_new_tokens=3)
    assert first.prompt_tokens == len(s.tokens) - len(first.token_ids) - (1 if first.finish_reason == "stop" else 0) > 0
    assert first.cached_tokens == 0
    held = len(s.tokens)
    s.append_messages([{"role": "user", "content": "And again?"}], add_generation_prompt=True)
    second = s.generate(max_new_tokens=3)
    assert second.prompt_tokens == len(s.tokens) - len(second.token_ids) - (1 if second.finish_reason == "stop" else 0)
    assert second.cached_tokens == held


def test_threads_are_serialised_and_an_open_stream_refuses_other_calls(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(20, seed=10))
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(session.generate(max_new_tokens=6).token_ids)) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert session.tokens[20:] == results[0] + results[1]  # one reply after the other, never interleaved
    generation = session.start_generation(max_new_tokens=5)
    generation.step()
    with pytest.raises(SessionBusyError):
        session.append_tokens([1, 2])
    errors = []
    other = threading.Thread(target=lambda: errors.append(pytest.raises(SessionBusyError, session.generate)))
    other.start()
    other.join()
    assert errors
    generation.close()
    session.append_tokens([1, 2])


@pytest.mark.small_model
def test_a_dropped_stream_is_settled_at_the_next_call(small_engine):
    s = small_engine.session()
    s.append_text("Once upon a time")
    start = len(s.tokens)
    s.stream(max_new_tokens=5)  # never iterated
    generation = s.start_generation(max_new_tokens=30, stop="zzzz")
    received = "".join(piece for piece, _ in (generation.step() for _ in range(6)))
    del generation  # dropped open, possibly holding back text
    s.append_text(" The end.")
    assert small_engine.tokenizer.decode(s.tokens[start:]) == received + " The end."


def test_a_closed_session_refuses_calls(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens([1, 2, 3])
    session.close()
    for call in (lambda: session.append_tokens([1]), session.generate, lambda: session.logprobs([1]), session.fork):
        with pytest.raises(SessionClosedError):
            call()
    assert session.transcript()  # still readable


# ---- the stateful property-based test ------------------------------------------------------------------

SENTENCES = [
    "The database port is 5433.",
    "Tests: 3 passed, 1 failed in test_restock.",
    "def f(x):\n    return x * 2",
    "Traceback (most recent call last): KeyError: 'sku'",
    "The codename is blue-heron.",
    "ok",
]
TOOLS = ["run_tests", "read_file", "grep"]


@functools.cache
def tiny_chat_engine() -> Engine:
    """A tiny random model (3 layers) with the default model's tokenizer and chat template: the chat paths at
    a thousandth of the cost, so hundreds of call sequences run in CI."""
    tokenizer = load_small_engine().tokenizer
    model = tiny_model("llama", vocab_size=len(tokenizer), num_hidden_layers=3, max_position_embeddings=2048)
    return Engine(model, tokenizer)


@functools.cache
def tiny_qwen_chat_engine() -> Engine:
    """Qwen2.5-Coder-0.5B's layout at tiny size (7 query heads per KV head, q/k/v biases, a tied head) with its
    tokenizer and chat template, which renders tools and tool calls natively."""
    from transformers import AutoTokenizer

    from kvmemory.runtime.gguf_files import prepared
    from kvmemory.runtime.named_models import DEFAULT_NAMED_MODEL, model_file

    tokenizer = AutoTokenizer.from_pretrained(str(prepared(model_file(DEFAULT_NAMED_MODEL))))
    model = tiny_model("qwen2-7to1", vocab_size=len(tokenizer), num_hidden_layers=3, max_position_embeddings=2048)
    return Engine(model, tokenizer)


@functools.cache
def tiny_chat_engine_storing(kv_dtype: str) -> Engine:
    """The tiny chat engine's model with its cache stored in ``kv_dtype`` (``Engine(kv_dtype=...)``)."""
    base = tiny_chat_engine()
    return Engine(base.model, base.tokenizer, kv_dtype=kv_dtype)


CAP = 320


def contract_policy(engine: Engine) -> MemoryPolicy:
    """A small cap with uneven per-layer and per-head budgets (REAL) on tool outputs, user messages ranked by
    surprisal across segments, uniform elsewhere."""
    shape = (engine.num_layers, engine.num_kv_heads)
    scores = (torch.arange(shape[0] * shape[1]).reshape(shape).float() % 5 + 0.5).tolist()
    return MemoryPolicy.from_dict(
        {
            "rules": [
                {"name": "system", "match": {"kind": "system"}, "protected": True},
                {
                    "name": "tools",
                    "match": {"kind": "tool_output"},
                    "method": "real",
                    "ratio": 3,
                    "params": {"scores": scores},
                },
                {"name": "user", "match": {"role": "user"}, "method": "selective_context"},
            ],
            "default": {"method": "snapkv", "ratio": 2},
            "budget": {"max_slots": CAP, "recent_tokens": 16, "sink_tokens": 4, "close_gaps": True},
        }
    )


class SessionContract(RuleBasedStateMachine):
    """Random call sequences over the public API, good and bad, checked against a reference of what went in."""

    with_memory = False
    make_engine = staticmethod(tiny_chat_engine)

    @initialize()
    def start(self):
        self.engine = self.make_engine()
        self.memory = MemoryManager(contract_policy(self.engine)) if self.with_memory else None
        self.s = self.engine.session(memory=self.memory)
        self.s.record_queries(32)
        self.s.record_surprisal()
        self.expected: list[str] = []  # every text appended or received, in order
        self.closed = False

    # -- helpers
    def attempt(self, call, *errors):
        """Run a call that may fail; if it fails, nothing may have changed."""
        before, expected = state_of(self.s), errors or (KVMemoryError,)
        try:
            return call(), True
        except expected:
            assert_same_state(before, state_of(self.s))
            return None, False

    def fits(self, text: str) -> bool:
        return len(self.s.tokens) + 3 * len(text) + 64 < self.engine.max_context - 100

    # -- appends
    @precondition(lambda self: not self.closed)
    @rule(text=st.sampled_from(SENTENCES))
    def append_text(self, text):
        if self.fits(text):
            _, ok = self.attempt(lambda: self.s.append_text(text))
            if ok:
                self.expected.append(text)

    @precondition(lambda self: not self.closed)
    @rule(
        ids=st.one_of(
            st.lists(st.integers(0, 49151), min_size=1, max_size=12),
            st.lists(st.integers(-5, 60000), min_size=0, max_size=4),
            st.just([1.5]),
        )
    )
    def append_tokens(self, ids):
        if len(self.s.tokens) + len(ids) < self.engine.max_context - 100:
            _, ok = self.attempt(lambda: self.s.append_tokens(ids))
            if ok:
                self.expected.append(self.engine.tokenizer.decode(ids))

    @precondition(lambda self: not self.closed)
    @rule(
        role=st.sampled_from(["user", "tool", "robot", "system"]),
        text=st.sampled_from(SENTENCES),
        tool=st.sampled_from(TOOLS + [None]),
        prompt=st.booleans(),
        via_set=st.booleans(),
    )
    def append_message(self, role, text, tool, prompt, via_set):
        if not self.fits(text):
            return
        message = {"role": role, "content": text} | ({"name": tool} if tool else {})
        if via_set:
            call = lambda: self.s.set_messages(self.s.messages + [message], add_generation_prompt=prompt)  # noqa: E731
        else:
            call = lambda: self.s.append_messages([message], add_generation_prompt=prompt)  # noqa: E731
        _, ok = self.attempt(call)
        if ok:
            self.expected.append(text)

    # -- generation
    @precondition(lambda self: not self.closed)
    @rule(
        n=st.integers(1, 5),
        stop=st.sampled_from([None, "e", ".", [""], -1]),
        temperature=st.sampled_from([0.0, 0.8, -1.0]),
    )
    def generate(self, n, stop, temperature):
        if stop == -1:
            stop = None
            n = -n
        result, ok = self.attempt(lambda: self.s.generate(max_new_tokens=n, stop=stop, temperature=temperature, seed=0))
        if ok and result.text:
            self.expected.append(result.text)

    @precondition(lambda self: not self.closed)
    @rule(k=st.integers(0, 3))
    def stream_then_break(self, k):
        if not self.s.tokens:
            return
        received = []
        for piece in self.s.stream(max_new_tokens=6, seed=1, temperature=0.7):
            received.append(piece)
            if len(received) >= k:
                break
        text = "".join(received)
        if text:
            self.expected.append(text)
        assert self.s._stream is None

    # -- memory
    @precondition(lambda self: not self.closed)
    @rule(method=st.sampled_from(["real", "snapkv", "uneven"]), bad=st.booleans())
    def compact(self, method, bad):
        s = self.s
        if not s.cache.layers[0].is_initialized or len(s.tokens) < 40:
            return
        if bad:
            plan = CompactionPlan(
                [LayerPlan(keep=torch.full((lay.num_heads, 1), lay.length, dtype=torch.long)) for lay in s.cache.layers]
            )
            self.attempt(lambda: s.apply_plan(plan))
            self.attempt(lambda: s.compact(method, slots=0))
            self.attempt(lambda: s.compact("no-such-method", ratio=2))
        elif method == "uneven":
            self.attempt(lambda: s.apply_plan(uneven_plan(s, seed=len(s.tokens))))
        elif self.memory is not None:
            self.attempt(lambda: self.memory.compact())
        else:
            self.attempt(lambda: s.compact(method, slots=24, keep_last=16))

    @precondition(lambda self: not self.closed)
    @rule(index=st.integers(-1, 40))
    def recall(self, index):
        ids = [seg.id for seg in self.s.segments if seg.text]
        segment_id = ids[index % len(ids)] if ids and index >= 0 else 10**6
        text = self.s.segment(segment_id).text if segment_id in ids else ""
        if not self.fits(text):
            return
        _, ok = self.attempt(lambda: self.s.recall(segment_id))
        if ok:
            self.expected.append(text)

    @precondition(lambda self: not self.closed)
    @rule(query=st.sampled_from(["database port", "codename", "KeyError", "zzz"]))
    def search(self, query):
        hits = self.s.search(query)  # every hit shares a term with the query ("zzz": none does)
        assert all(any(term in h.text.lower() for term in query.lower().split()) for h in hits)

    @precondition(lambda self: not self.closed)
    @rule(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=8))
    def logprobs_leave_everything_bit_identical(self, ids):
        if not self.s.tokens:
            return
        before = state_of(self.s)
        first = self.s.logprobs(ids)
        after = state_of(self.s)
        # the first call may compute missing next-token logits; from then on nothing changes
        assert_same_state(after, state_of(self.s))
        assert torch.equal(self.s.logprobs(ids), first)
        assert_same_state(after, state_of(self.s))
        assert before["tokens"] == after["tokens"]

    @precondition(lambda self: not self.closed)
    @rule()
    def fork(self):
        if not self.s.tokens:
            return
        before = state_of(self.s)
        child = self.s.fork(with_memory=True)
        assert child.tokens == self.s.tokens and child.messages == self.s.messages
        child.append_text("fork only")
        assert_same_state(before, state_of(self.s))
        child.close()

    @precondition(lambda self: not self.closed)
    @rule()
    def save_and_load(self):
        """Saving changes nothing, and the loaded session is the saved one bit for bit (cache, transcript,
        recorders, memory manager): the run goes on with it, so whatever follows checks it behaves the same."""
        before = state_of(self.s)
        with tempfile.TemporaryDirectory() as folder:
            loaded = self.engine.load_session(self.s.save(Path(folder) / "session"))
        assert_same_state(before, state_of(self.s))
        assert_same_state(before, state_of(loaded))
        assert same_queries(loaded.query_recorder.state(), self.s.query_recorder.state())
        self.s.close()
        self.s, self.memory = loaded, loaded.memory

    @precondition(lambda self: not self.closed)
    @rule()
    def rebase(self):
        """Closing the gaps moves RoPE phases only: every head keeps its slots, values, β, positions and segments,
        at consecutive phases that end where the next token's begins."""
        if not self.s.tokens:
            return
        before = state_of(self.s)
        self.s.rebase_positions()
        after = state_of(self.s)
        for key in ("tokens", "pending", "segments", "messages", "log", "memory"):
            assert after[key] == before[key], key
        assert after["counters"][0] == before["counters"][0]  # the logical length: new tokens count on from it
        for was, now in zip(before["layers"], after["layers"]):
            if was is None:
                continue
            assert now[0] == was[0] and all(torch.equal(now[i], was[i]) for i in (2, 3, 4, 6))
            for positions, phases in zip(now[4], now[5]):
                kept = phases[positions >= 0]
                assert torch.equal(kept, torch.arange(after["counters"][1] - len(kept), after["counters"][1]))

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self):
        self.s.close()
        self.closed = True
        with pytest.raises(SessionClosedError):
            self.s.append_text("late")

    @precondition(lambda self: self.closed)
    @rule(text=st.sampled_from(SENTENCES))
    def calls_on_a_closed_session_fail(self, text):
        for call in (lambda: self.s.append_text(text), self.s.generate, self.s.fork):
            with pytest.raises(SessionClosedError):
                call()
        hits = self.s.search(text, limit=len(self.s.segments))  # the transcript stays searchable once closed
        if text in self.expected:
            assert any(text in segment.text for segment in hits), text

    # -- invariants
    @invariant()
    def nothing_lost(self):
        if not hasattr(self, "s"):
            return
        text = "".join(seg["text"] for seg in self.s.transcript())
        position = 0
        for item in self.expected:
            found = text.find(item, position)
            assert found >= 0, f"lost {item!r}"
            position = found + len(item)

    @invariant()
    def transcript_is_contiguous(self):
        if not hasattr(self, "s"):
            return
        end = 0
        for seg in self.s.segments:
            assert seg.start == end and seg.end >= seg.start
            end = seg.end
        assert end == len(self.s.tokens)

    @invariant()
    def cap_held(self):
        if hasattr(self, "s") and self.memory is not None and not self.closed:
            assert self.s.cache.slots_per_head <= CAP

    @invariant()
    def uncompacted_cache_equals_a_fresh_prefill(self):
        s = getattr(self, "s", None)
        if s is None or self.closed or not s.tokens or s.cache.compactions or s._last_logits is None or s._pending:
            return
        fresh = self.engine.session()
        fresh.append_tokens(s.tokens)
        assert torch.allclose(fresh._last_logits, s._last_logits, atol=2e-3)


class SessionContractUnderCap(SessionContract):
    with_memory = True


class SessionContractKV16UnderCap(SessionContract):
    with_memory = True
    make_engine = staticmethod(functools.partial(tiny_chat_engine_storing, "float16"))


class SessionContractKV8UnderCap(SessionContract):
    with_memory = True
    make_engine = staticmethod(functools.partial(tiny_chat_engine_storing, "int8"))


class QwenLayoutContractUnderCap(SessionContract):
    with_memory = True
    make_engine = staticmethod(tiny_qwen_chat_engine)


class DefaultModelContractUnderCap(SessionContract):
    with_memory = True
    make_engine = staticmethod(load_small_engine)


def _settings(examples: str, steps: str = "12"):
    return settings(
        max_examples=int(os.environ.get("KVMEMORY_CONTRACT_EXAMPLES", examples)),
        stateful_step_count=int(os.environ.get("KVMEMORY_CONTRACT_STEPS", steps)),
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


TestSessionContract = pytest.mark.small_model(SessionContract.TestCase)
TestSessionContract.settings = _settings("300")
TestSessionContractUnderCap = pytest.mark.small_model(SessionContractUnderCap.TestCase)
TestSessionContractUnderCap.settings = _settings("300")
TestSessionContractKV16UnderCap = pytest.mark.small_model(SessionContractKV16UnderCap.TestCase)
TestSessionContractKV16UnderCap.settings = _settings("100")
TestSessionContractKV8UnderCap = pytest.mark.small_model(SessionContractKV8UnderCap.TestCase)
TestSessionContractKV8UnderCap.settings = _settings("60")
TestQwenLayoutContractUnderCap = pytest.mark.coder_model(QwenLayoutContractUnderCap.TestCase)
TestQwenLayoutContractUnderCap.settings = _settings("60")
TestDefaultModelContractUnderCap = pytest.mark.small_model(DefaultModelContractUnderCap.TestCase)
TestDefaultModelContractUnderCap.settings = _settings("20")
