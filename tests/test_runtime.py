"""Runtime correctness: sessions equal plain transformers, compaction plans do exactly what they say."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from kvmemory import (
    AsyncSession,
    CompactionPlan,
    ContextLengthError,
    Engine,
    InvalidArgumentError,
    InvalidPlanError,
    InvalidTokenError,
    LayerPlan,
    ModelLoadError,
    SessionClosedError,
    UnsupportedArchitectureError,
)
from kvmemory.attention import folded_sdpa, mask_sdpa
from kvmemory.cache import int8_rows
from kvmemory.cache.compact_layer import rotation_tables
from kvmemory.runtime.named_models import SMALL_MODEL, model_file, named_model
from kvmemory.runtime.recorders import SurprisalRecorder
from kvmemory.runtime.sampling import ReplyText
from tests.conftest import random_tokens, reference_copy, tiny_model


def reference_next_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(input_ids=torch.tensor([ids])).logits[0, -1]


def session_state(session):
    layer = session.cache.layers[0]
    return (
        list(session.tokens),
        [s.to_dict() for s in session.segments],
        session.cache.logical_length,
        layer.length,
        layer.keys[:, :, : layer.length].clone(),
        layer.bias[:, :, : layer.length].clone(),
    )


def assert_same_state(a, b):
    assert a[:4] == b[:4]
    assert torch.equal(a[4], b[4]) and torch.equal(a[5], b[5])


def test_greedy_generation_matches_transformers(tiny_pair):
    engine, ref = tiny_pair
    prompt = random_tokens(48)
    session = engine.session()
    session.append_tokens(prompt)
    assert torch.allclose(session._last_logits, reference_next_logits(ref, prompt), atol=1e-5)
    ours = session.generate(max_new_tokens=12).token_ids
    theirs = ref.generate(
        torch.tensor([prompt]),
        max_new_tokens=12,
        do_sample=False,
        past_key_values=DynamicCache(config=ref.config),
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert ours == theirs


def test_teacher_forced_logprobs_match_transformers(tiny_pair):
    engine, ref = tiny_pair
    prompt, continuation = random_tokens(30, seed=2), random_tokens(10, seed=3)
    session = engine.session()
    session.append_tokens(prompt)
    before = session_state(session)
    ours = session.logprobs(continuation)
    with torch.no_grad():
        logits = ref(input_ids=torch.tensor([prompt + continuation])).logits[0]
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    theirs = lp.gather(1, torch.tensor(continuation)[:, None]).squeeze(1)
    assert torch.allclose(ours, theirs, atol=1e-5)
    assert_same_state(before, session_state(session))


def test_multi_turn_appends_equal_one_shot_prefill(arch):
    engine = Engine(tiny_model(arch))
    tokens = random_tokens(90, seed=4)
    one = engine.session()
    one.append_tokens(tokens)
    many = engine.session(prefill_chunk_size=7)
    for part in (tokens[:25], tokens[25:26], tokens[26:90]):
        many.append_tokens(part)
    assert torch.allclose(one._last_logits, many._last_logits, atol=1e-5)
    assert one.generate(max_new_tokens=8).token_ids == many.generate(max_new_tokens=8).token_ids


def test_keep_everything_plan_is_identity(tiny_engine):
    prompt = random_tokens(40, seed=5)
    plain, compacted = tiny_engine.session(), tiny_engine.session()
    for s in (plain, compacted):
        s.append_tokens(prompt)
    compacted.apply_plan(CompactionPlan.keep_all(compacted.cache))
    assert compacted.stats().compactions == 1
    cont = random_tokens(6, seed=6)
    assert torch.equal(plain.logprobs(cont), compacted.logprobs(cont))
    assert plain.generate(max_new_tokens=10).token_ids == compacted.generate(max_new_tokens=10).token_ids


def test_bias_log2_equals_duplicated_slot(tiny_engine):
    prompt, cont = random_tokens(20, seed=7), random_tokens(5, seed=8)
    biased, duplicated = tiny_engine.session(), tiny_engine.session()
    for s in (biased, duplicated):
        s.append_tokens(prompt)
    j = 6
    plan_layers = []
    for layer in biased.cache.layers:
        n, h = layer.length, layer.num_heads
        bias = torch.zeros(h, n)
        bias[:, j] = math.log(2.0)
        plan_layers.append(LayerPlan(keep=torch.arange(n).expand(h, n).clone(), bias=bias))
    biased.apply_plan(CompactionPlan(plan_layers))
    for layer in duplicated.cache.layers:  # store slot j twice (bypassing validation, which forbids repeats)
        n, h = layer.length, layer.num_heads
        keep = torch.cat([torch.arange(j + 1), torch.arange(j, n)])
        layer.apply(LayerPlan(keep=keep.expand(h, -1).clone()), list(keep.expand(h, -1)))
    assert torch.allclose(biased.logprobs(cont), duplicated.logprobs(cont), atol=1e-5)


def test_appends_after_compaction_keep_true_positions(tiny_pair):
    """Dropping slots equals masking those tokens in plain transformers with the true position ids."""
    engine, ref = tiny_pair
    prompt, new = random_tokens(32, seed=9), random_tokens(3, seed=10)
    session = engine.session()
    session.append_tokens(prompt)
    dropped = [3, 4, 5, 10, 20]
    keep = torch.tensor([i for i in range(32) if i not in dropped])
    session.apply_plan(
        CompactionPlan([LayerPlan(keep=keep.expand(lay.num_heads, -1).clone()) for lay in session.cache.layers])
    )
    seg = session.append_tokens(new)
    layer = session.cache.layers[0]
    assert layer.length == 32 - len(dropped) + len(new)
    assert layer.positions[0, layer.length - 3 : layer.length].tolist() == [32, 33, 34]
    assert (seg.start, seg.end) == (32, 35)
    with torch.no_grad():
        cache = DynamicCache(config=ref.config)
        ref(input_ids=torch.tensor([prompt]), past_key_values=cache)
        mask = torch.ones(1, 35, dtype=torch.long)
        mask[0, dropped] = 0
        out = ref(
            input_ids=torch.tensor([new]),
            past_key_values=cache,
            attention_mask=mask,
            position_ids=torch.arange(32, 35)[None],
        )
    assert torch.allclose(session._last_logits, out.logits[0, -1], atol=1e-5)


def test_folded_bias_path_equals_mask_path():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 6, 1, 16), torch.randn(1, 2, 50, 16), torch.randn(1, 2, 50, 16)
    bias = torch.randn(1, 2, 50) * 2
    bias[0, 1, 40:] = float("-inf")
    assert torch.allclose(folded_sdpa(q, k, v, bias, 0.25), mask_sdpa(q, k, v, bias, 0.25), atol=1e-5)
    q4 = torch.randn(1, 6, 4, 16)  # several queries: the folded path defers to the masked one
    assert torch.allclose(folded_sdpa(q4, k, v, bias, 0.25), mask_sdpa(q4, k, v, bias, 0.25))


def test_folded_path_in_a_session_matches(tiny_engine):
    prompt = random_tokens(30, seed=12)
    session = tiny_engine.session()
    session.append_tokens(prompt)
    plans = []
    for layer in session.cache.layers:
        n, h = layer.length, layer.num_heads
        plans.append(LayerPlan(keep=torch.arange(n).expand(h, n).clone(), bias=torch.randn(h, n)))
    session.apply_plan(CompactionPlan(plans))
    ids = torch.tensor([[5]])
    outs = []
    for path in ("mask", "folded"):
        snap = session.cache.snapshot()
        session.cache.begin_append(30, 1, 0)
        with torch.no_grad():
            outs.append(
                tiny_engine.model(
                    input_ids=ids,
                    position_ids=torch.tensor([[30]]),
                    cache=session.cache,
                    compact_cache=session.cache,
                    attention_path=path,
                ).logits
            )
        session.cache.restore(snap)
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
def test_a_16_bit_cache_costs_half_the_bytes_and_is_read_back_as_the_activations(kv_dtype):
    model = tiny_model("qwen3")
    full, half = Engine(model), Engine(model, kv_dtype=kv_dtype)
    ids = random_tokens(120, seed=4)
    a, b = full.session(), half.session()
    a.append_tokens(ids)
    b.append_tokens(ids)
    dtype = getattr(torch, kv_dtype)
    assert all(layer.slots.keys.dtype == layer.slots.values.dtype == dtype for layer in b.cache.layers)
    # the first layer's keys depend on the embeddings alone: stored, they are the fp32 keys rounded
    assert torch.equal(b.cache.layers[0].keys, a.cache.layers[0].keys.to(dtype))
    heads, dim = half.num_kv_heads, half.head_dim
    assert half.kv_bytes_per_token == half.num_layers * heads * (2 * dim * 2 + 16)
    assert b.cache.kv_bytes() == 120 * half.kv_bytes_per_token < 0.6 * a.cache.kv_bytes()
    assert torch.allclose(a._last_logits, b._last_logits, atol=0.05)
    twin = b.fork()  # a fork stores in the same dtype and goes on the same way
    assert twin.cache.layers[0].slots.keys.dtype == dtype
    assert b.generate(max_new_tokens=4).token_ids == twin.generate(max_new_tokens=4).token_ids


def test_an_8_bit_cache_stores_each_row_as_levels_and_a_scale_and_decodes_within_half_a_level():
    model = tiny_model("qwen3")
    full, eight = Engine(model), Engine(model, kv_dtype="int8")
    ids = random_tokens(120, seed=4)
    a, b = full.session(), eight.session()
    a.append_tokens(ids)
    b.append_tokens(ids)
    heads, dim = eight.num_kv_heads, eight.head_dim
    stored = b.cache.layers[0].slots.keys
    assert stored.dtype == torch.int8 and stored.shape[-1] == dim + int8_rows.SCALE_BYTES
    # the first layer's keys depend on the embeddings alone: decoded, each is within half a level of fp32's
    exact, decoded = a.cache.layers[0].keys, b.cache.layers[0].keys
    level = exact.abs().amax(-1, keepdim=True) / int8_rows.LEVELS
    assert decoded.dtype == torch.float32 and bool(((decoded - exact).abs() <= level / 2 + 1e-6).all())
    assert eight.kv_bytes_per_token == eight.num_layers * heads * (2 * (dim + 4) + 16)
    assert b.cache.kv_bytes() == 120 * eight.kv_bytes_per_token < 0.4 * a.cache.kv_bytes()
    assert torch.allclose(a._last_logits, b._last_logits, atol=0.05)
    twin = b.fork()
    assert twin.cache.layers[0].slots.keys.dtype == torch.int8
    assert b.generate(max_new_tokens=4).token_ids == twin.generate(max_new_tokens=4).token_ids


def test_8_bit_rows_encode_signs_symmetrically_and_zero_rows_exactly():
    rows = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, -3.0, 1.5, -0.01]])
    stored = int8_rows.encode(rows)
    assert torch.equal(int8_rows.encode(-rows)[:, :4], -stored[:, :4])
    assert torch.equal(int8_rows.decode(stored)[1], rows[1])
    assert stored[0, :4].tolist() == [64, -127, 32, 0]  # 63.5 rounds to even; the largest is ±127
    assert torch.equal(int8_rows.convert(stored, torch.int8), stored)
    assert torch.allclose(int8_rows.convert(stored, torch.float32), rows, atol=3 / 254)


@pytest.mark.parametrize("bad", ["uint8", torch.uint8, "fp8", torch.float64])
def test_a_bad_kv_dtype_is_named(bad):
    with pytest.raises(InvalidArgumentError, match="kv_dtype"):
        Engine(tiny_model("llama"), kv_dtype=bad)


@pytest.mark.parametrize("bad", [0, -512])
def test_a_pass_bound_or_prefill_chunk_below_one_token_is_named(bad, tiny_engine):
    with pytest.raises(InvalidArgumentError, match="max_batch_tokens"):
        Engine(tiny_model("llama"), max_batch_tokens=bad)
    with pytest.raises(InvalidArgumentError, match="prefill_chunk_size"):
        Engine(tiny_model("llama"), prefill_chunk_size=bad)
    with pytest.raises(InvalidArgumentError, match="prefill_chunk_size"):
        tiny_engine.session(prefill_chunk_size=bad)


@pytest.mark.parametrize(
    "weights, kv_dtype, stored",
    [("fp32", None, torch.float32), ("fp16", None, torch.float16), ("bf16", None, torch.float16),
     ("fp16", "float32", torch.float32), ("fp16", "bfloat16", torch.bfloat16)],
)  # fmt: skip
def test_the_cache_is_fp16_by_default_under_narrower_weights_and_kv_dtype_overrides_it(weights, kv_dtype, stored):
    from kvmemory.runtime.weights import store_linear_weights

    model = tiny_model("llama")
    engine = Engine(model if weights == "fp32" else store_linear_weights(model, weights), kv_dtype=kv_dtype)
    session = engine.session()
    session.append_tokens(random_tokens(20, seed=1))
    assert engine.kv_dtype == stored and session.cache.layers[0].slots.keys.dtype == stored


def test_mistral_sliding_window_does_not_drop_tokens():
    model = tiny_model("mistral", sliding_window=16)
    ref = reference_copy(model)
    ref.config.sliding_window = None
    engine = Engine(model)
    prompt = random_tokens(40, seed=13)
    session = engine.session()
    session.append_tokens(prompt)
    assert session.cache.layers[0].length == 40
    assert torch.allclose(session._last_logits, reference_next_logits(ref, prompt), atol=1e-5)


async def test_async_matches_sync(tiny_engine):
    prompt = random_tokens(25, seed=14)
    sync = tiny_engine.session()
    sync.append_tokens(prompt)
    expected = sync.generate(max_new_tokens=8).token_ids
    async with tiny_engine.async_session() as session:
        await session.append_tokens(prompt)
        result = await session.generate(max_new_tokens=8)
    assert result.token_ids == expected


async def test_concurrent_async_sessions_do_not_cross_talk(tiny_engine):
    prompts = [random_tokens(20 + 5 * i, seed=20 + i) for i in range(3)]
    expected = []
    for p in prompts:
        s = tiny_engine.session()
        s.append_tokens(p)
        expected.append(s.generate(max_new_tokens=6).token_ids)

    async def run(p):
        s = tiny_engine.async_session()
        await s.append_tokens(p)
        return (await s.generate(max_new_tokens=6)).token_ids

    assert await asyncio.gather(*(run(p) for p in prompts)) == expected


# ---- bad input ------------------------------------------------------------------------------------


def test_invalid_tokens_leave_session_unchanged(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(10))
    before = session_state(session)
    with pytest.raises(InvalidTokenError, match="outside the vocabulary"):
        session.append_tokens([1, 2, 99999])
    with pytest.raises(InvalidTokenError):
        session.append_tokens([])
    assert_same_state(before, session_state(session))


def test_context_overflow_leaves_session_unchanged():
    engine = Engine(tiny_model("llama", max_position_embeddings=64))
    session = engine.session()
    session.append_tokens(random_tokens(50))
    before = session_state(session)
    with pytest.raises(ContextLengthError, match="64 positions"):
        session.append_tokens(random_tokens(20))
    assert_same_state(before, session_state(session))
    result = session.generate(max_new_tokens=100)
    assert result.finish_reason == "length" and len(session.tokens) == 64


@pytest.mark.parametrize(
    "make_plan, message",
    [
        (lambda c: CompactionPlan([LayerPlan(keep=torch.arange(5).expand(2, 5).clone())]), "plan has 1 layers"),
        (lambda c: CompactionPlan([LayerPlan(keep=torch.arange(5).expand(3, 5).clone())] * 2), "3 KV heads"),
        (lambda c: CompactionPlan([LayerPlan(keep=torch.tensor([[0, 999], [0, 1]]))] * 2), "out of range"),
        (lambda c: CompactionPlan([LayerPlan(keep=torch.tensor([[3, 1], [0, 1]]))] * 2), "strictly increasing"),
        (
            lambda c: CompactionPlan(
                [LayerPlan(keep=torch.tensor([[0, 1], [0, 1]]), values=torch.zeros(2, 3, 16))] * 2
            ),
            "values must be",
        ),
        (
            lambda c: CompactionPlan([LayerPlan(keep=torch.tensor([[0, 1], [0, 1]]), bias=torch.zeros(2, 5))] * 2),
            "bias must be",
        ),
    ],
)
def test_bad_plans_raise_and_change_nothing(tiny_engine, make_plan, message):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(12))
    before = session_state(session)
    with pytest.raises(InvalidPlanError, match=message):
        session.apply_plan(make_plan(session.cache))
    assert_same_state(before, session_state(session))
    assert session.cache.compactions == 0


def test_a_bad_layer_late_in_the_plan_changes_no_layer(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(12))
    before = session_state(session)
    good = LayerPlan(keep=torch.arange(6).expand(2, 6).clone())
    with pytest.raises(InvalidPlanError):
        session.apply_plan(CompactionPlan([good, LayerPlan(keep=torch.tensor([[0, 50], [0, 1]]))]))
    assert_same_state(before, session_state(session))


def test_closed_session_refuses_work(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(5))
    session.close()
    with pytest.raises(SessionClosedError):
        session.append_tokens([1, 2])
    with pytest.raises(SessionClosedError):
        session.generate(max_new_tokens=2)
    assert session.tokens == random_tokens(5)  # the transcript survives


def test_unknown_architecture_is_named():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        Engine(model)


def test_unknown_model_path_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="no-such-model"):
        Engine.from_pretrained(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        Engine.from_pretrained(str(tmp_path / "missing.gguf"))


# ---- the default model -----------------------------------------------------------------------------


def test_default_model_greedy_matches_transformers(small_engine):
    ids = small_engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=True
    )
    ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
    session = small_engine.session()
    session.append_tokens(ids)
    ours = session.generate(max_new_tokens=10).token_ids
    ref = reference_copy(small_engine.model)
    theirs = ref.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0)[
        0, len(ids) :
    ].tolist()
    eos = small_engine.eos_token_ids
    assert ours == [t for t in theirs if t not in eos][: len(ours)]


def test_messages_prefill_only_what_is_new(small_engine):
    session = small_engine.session()
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    session.set_messages(convo, add_generation_prompt=True)
    reply = session.generate(max_new_tokens=6)
    before = session.prefilled_tokens
    convo += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "Now say bye."}]
    session.set_messages(convo, add_generation_prompt=True)
    full = session.renderer.render(convo, add_generation_prompt=True)
    assert session.tokens == full
    assert session.prefilled_tokens - before < 20  # only the new turn (and the sampled tail), not the history


def test_rerendered_earlier_turn_equals_a_fresh_session(small_engine):
    convo = [
        {"role": "user", "content": "First question?"},
        {"role": "assistant", "content": "First answer."},
        {"role": "user", "content": "Second question?"},
    ]
    session = small_engine.session()
    session.set_messages(convo, add_generation_prompt=True)
    edited = [dict(m) for m in convo]
    edited[1]["content"] = "An edited first answer."  # a template that rewrites an earlier turn looks like this
    session.set_messages(edited, add_generation_prompt=True)
    fresh = small_engine.session()
    fresh.set_messages(edited, add_generation_prompt=True)
    assert session.tokens == fresh.tokens
    assert [s.message_index for s in session.segments[:3]] == [0, 1, 2]
    assert torch.allclose(session._last_logits, fresh._last_logits, atol=1e-4)


def test_a_cut_that_would_empty_a_head_rebuilds_the_prefix_as_a_fresh_session_holds_it(small_engine):
    """A re-rendered turn cuts every head back to its start; a head that kept only slots past the cut would be
    left empty, so the prefix is prefilled again from the transcript (as one prefill, shortest-first order)."""
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "First question?"}]
    session = small_engine.session(prefill_chunk_size=4)  # the rebuild runs in several chunks
    session.set_messages(convo, add_generation_prompt=True)
    n = session.cache.layers[0].length
    plan = CompactionPlan.keep_all(session.cache)
    plan.layers[0].keep = [torch.arange(n - 3, n)] + list(plan.layers[0].keep[1:])  # head 0 keeps the end only
    session.apply_plan(plan)
    edited = [convo[0], {"role": "user", "content": "Another question?"}]
    session.set_messages(edited, add_generation_prompt=True)
    fresh = small_engine.session(prefill_chunk_size=4)
    fresh.set_messages(edited, add_generation_prompt=True)
    assert session.tokens == fresh.tokens
    assert session.cache.layers[0].lengths == fresh.cache.layers[0].lengths  # nothing compacted is left
    assert torch.allclose(session._last_logits, fresh._last_logits, atol=1e-4)


async def test_cancelled_stream_leaves_the_session_consistent(small_engine):
    session = small_engine.async_session()
    prompt = await session.append_text("Once upon a time, in a small village by the sea,")
    pieces = 0
    async for _ in session.stream(max_new_tokens=50):
        pieces += 1
        if pieces == 3:
            break
    n = len(session.sync.tokens)
    assert prompt.end + 3 <= n <= prompt.end + 8 and session.sync.segments[-1].end == n
    result = await session.generate(max_new_tokens=4)
    assert len(result.token_ids) == 4 and len(session.sync.tokens) == n + 4


def test_rebase_without_gaps_is_the_identity_and_a_uniform_shift_changes_nothing():
    engine = Engine(tiny_model("llama", max_position_embeddings=256))
    session = engine.session()
    session.append_tokens(random_tokens(60, seed=30))
    keys = session.cache.layers[0].keys[:, :, :60].clone()
    assert session.rebase_positions() == 0
    assert torch.allclose(session.cache.layers[0].keys[:, :, :60], keys, atol=1e-5)
    # dropping the first 20 tokens leaves one gap at the start: closing it shifts everything uniformly,
    # and RoPE attention depends only on relative positions
    keep = torch.arange(20, 60)
    session.apply_plan(
        CompactionPlan([LayerPlan(keep=keep.expand(lay.num_heads, -1).clone()) for lay in session.cache.layers])
    )
    cont = random_tokens(8, seed=31)
    before = session.logprobs(cont)
    assert session.rebase_positions() == -20
    assert session.cache.rope_length == 40 and session.cache.layers[0].rope[0, :40].tolist() == list(range(40))
    assert torch.allclose(session.logprobs(cont), before, atol=1e-4)


def test_rebase_bounds_each_heads_distances_by_its_own_slot_count():
    """Heads that keep different tokens: after a rebase every head's newest slot sits just before the next
    token and its oldest at most (its slot count) positions back, whatever the union of kept tokens."""
    engine = Engine(tiny_model("llama", max_position_embeddings=256))
    session = engine.session()
    session.append_tokens(random_tokens(120, seed=34))
    g = torch.Generator().manual_seed(0)
    plans = [
        [
            torch.sort(torch.cat([torch.randperm(100, generator=g)[: 10 + 15 * h], torch.arange(100, 120)])).values
            for h in range(layer.num_heads)
        ]
        for layer in session.cache.layers
    ]
    width = max(k.numel() for keeps in plans for k in keeps)
    session.apply_plan(CompactionPlan([LayerPlan(keep=keeps) for keeps in plans]))
    shift = session.rebase_positions()
    assert session.cache.rope_length == width and shift == width - 120
    for layer, keeps in zip(session.cache.layers, plans):
        for h, k in enumerate(keeps):
            valid = layer.positions[h, : layer.length] >= 0
            rope = layer.rope[h, : layer.length][valid]
            assert rope.tolist() == list(range(width - k.numel(), width))
    assert len(session.generate(max_new_tokens=4).token_ids) == 4


@pytest.mark.parametrize("same_slots_in_every_layer", [True, False])
def test_rebase_rotates_every_layers_keys_by_its_own_offsets(same_slots_in_every_layer):
    """A rebase computes its rotation tables once for layers whose slots sit alike and anew for a layer whose
    slots differ: each key ends rotated by its own new position minus its old one."""
    engine = Engine(tiny_model("llama", max_position_embeddings=256))
    session = engine.session()
    session.append_tokens(random_tokens(90, seed=35))
    g = torch.Generator().manual_seed(1)
    keep, other = (torch.sort(torch.randperm(90, generator=g)[:40]).values for _ in range(2))  # as many, elsewhere
    keeps = [keep if same_slots_in_every_layer or i == 0 else other for i in range(len(session.cache.layers))]
    session.apply_plan(
        CompactionPlan(
            [LayerPlan(keep=k.expand(lay.num_heads, -1).clone()) for k, lay in zip(keeps, session.cache.layers)]
        )
    )
    before = [(layer.keys[0].clone(), layer.rope[:, : layer.length].clone()) for layer in session.cache.layers]
    session.rebase_positions()
    for layer, (keys, rope) in zip(session.cache.layers, before):
        delta = layer.rope[:, : layer.length].long() - rope.long()
        cos, sin = rotation_tables(delta, engine.rope_inv_freq)
        half = keys.shape[-1] // 2
        expected = keys * cos + torch.cat([-keys[..., half:], keys[..., :half]], dim=-1) * sin
        assert torch.equal(layer.keys[0], expected) and bool((delta != 0).any())


def test_rebase_runs_by_itself_past_the_trained_positions():
    engine = Engine(tiny_model("llama", max_position_embeddings=128))
    session = engine.session()
    session.append_tokens(random_tokens(100, seed=32))
    keep = torch.cat([torch.arange(4), torch.arange(70, 100)])
    session.apply_plan(
        CompactionPlan([LayerPlan(keep=keep.expand(lay.num_heads, -1).clone()) for lay in session.cache.layers])
    )
    seg = session.append_tokens(random_tokens(60, seed=33))
    layer = session.cache.layers[0]
    assert seg.end == 160 and session.cache.logical_length == 160
    assert session.cache.rope_length == 94 and int(layer.rope[0, : layer.length].max()) == 93
    assert layer.positions[0, layer.length - 1] == 159  # the transcript position is still the true one
    assert len(session.generate(max_new_tokens=5).token_ids) == 5


@st.composite
def recorder_calls(draw):
    """Calls on a surprisal recorder: records at or before the end (decode steps, re-prefills, gaps, NaNs),
    truncations, snapshots and restores of any earlier snapshot."""
    calls = []
    for _ in range(draw(st.integers(1, 40))):
        kind = draw(st.sampled_from(["append", "append", "append", "record", "drop", "state", "restore"]))
        if kind in ("append", "record"):
            values = draw(
                st.lists(st.one_of(st.floats(0, 20, width=32), st.just(float("nan"))), min_size=1, max_size=6)
            )
            calls.append((kind, draw(st.integers(0, 80)), values))
        else:
            calls.append((kind, draw(st.integers(0, 80)), None))
    return calls


def same(values: torch.Tensor, expected: list[float]) -> bool:
    """Equal values, NaN where NaN (surprisal is never negative, so -1 stands for NaN)."""
    return torch.equal(values.nan_to_num(-1.0), torch.tensor(expected, dtype=torch.float32).nan_to_num(-1.0))


@settings(max_examples=200, deadline=None)
@given(recorder_calls())
def test_the_surprisal_recorder_matches_a_plain_list_and_its_snapshots_never_change(calls):
    """Growing in place is invisible: every call leaves the values a plain list would hold, and every snapshot
    taken keeps its values whatever follows (appends past it, truncations, restores of other snapshots)."""
    recorder, model, snapshots = SurprisalRecorder(), [], []
    for kind, number, values in calls:
        if kind in ("append", "record"):
            start = len(model) if kind == "append" else number
            model.extend([math.nan] * (start - len(model)))
            for i, value in enumerate(values):
                at = start + i
                if at < len(model):
                    model[at] = model[at] if math.isnan(value) else value
                else:
                    model.append(value)
            recorder.record(start, values)
        elif kind == "drop":
            del model[number:]
            recorder.drop_from(number)
        elif kind == "state":
            snapshots.append((recorder.state(), list(model)))
        elif snapshots:
            state, expected = snapshots[number % len(snapshots)]
            recorder.restore(state)
            model = list(expected)
        assert same(recorder.values, model)
        assert all(same(state, expected) for state, expected in snapshots)


@st.composite
def reply_edits(draw, pool: list[int]):
    """Tokens appended one at a time (from ``pool``: characters of several bytes, spaces, punctuation, and
    any id at all), now and then a cut back (an undone step)."""
    edits = []
    for _ in range(draw(st.integers(20, 150))):
        kind = draw(st.integers(0, 9))
        if kind == 0:
            edits.append(("cut", draw(st.integers(0, 40))))
        else:
            edits.append(("add", draw(st.integers(0, 49151) if kind == 1 else st.sampled_from(pool))))
    return edits


@pytest.mark.small_model
def test_a_replys_text_decoded_a_few_tokens_at_a_time_is_the_whole_decoded(small_engine):
    decode = small_engine.detokenize
    text = "naïve café — 東京タワー 🙂🚀 x = {'a': 1}\n\tdef f():  return \"ü\"  . , ! ?   end"
    pool = small_engine.tokenizer.encode(text, add_special_tokens=False)

    class SettlingOften(ReplyText):  # a seam after every few tokens: more seams inside characters
        SETTLE_EVERY = 2

    @settings(max_examples=100, deadline=None)
    @given(reply_edits(pool), st.sampled_from([ReplyText, SettlingOften]))
    def check(edits, kind):
        reply, tokens = kind(decode), []
        for kind, value in edits:
            if kind == "add":
                tokens.append(value)
            else:
                del tokens[value:]
            assert reply(tokens) == decode(tokens)

    check()


@pytest.mark.small_model
def test_a_gguf_file_is_prepared_once_and_loads_as_transformers_reads_it(tmp_path, monkeypatch):
    """Preparing a GGUF file keeps its config, tokenizer (chat template included) and tensor table, and no
    weights; a second load reads them. Dequantized (``weights="fp32"``), the model is transformers' own reading
    of the file bit for bit, Llama's q and k rows unpermuted as transformers does."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvmemory.runtime import gguf_files

    monkeypatch.setattr(gguf_files, "CACHE_DIR", tmp_path)
    gguf = model_file(SMALL_MODEL)
    prepared = gguf_files.prepared(gguf)
    assert prepared.parent == tmp_path / "models" and gguf_files.prepared(gguf) == prepared
    assert sum(f.stat().st_size for f in prepared.iterdir()) < 0.1 * gguf.stat().st_size  # no weights
    # the model's identity (which weights a saved session needs) is the file's sha256, taken when preparing
    assert gguf_files.source_digest(prepared) == named_model(SMALL_MODEL).sha256
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ours = Engine.from_pretrained(str(gguf), weights="fp32").model
    expected, got = direct.state_dict(), ours.state_dict()
    assert set(expected) <= set(got)
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit, café."}]
    tokenizers = [AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)]
    tokenizers.append(AutoTokenizer.from_pretrained(str(prepared)))
    rendered = [t.apply_chat_template(messages, add_generation_prompt=True) for t in tokenizers]
    assert rendered[0] == rendered[1] and tokenizers[0].eos_token_id == tokenizers[1].eos_token_id


def test_stats_that_will_not_wait_read_what_a_long_prefill_last_published(tiny_engine):
    import threading

    session = tiny_engine.session(prefill_chunk_size=16)
    session.append_tokens(random_tokens(8))
    held, release = threading.Event(), threading.Event()

    def stall(done: int, _total: int) -> None:
        if done >= 32:  # two chunks in: the prefill holds the session until released
            held.set()
            release.wait(timeout=30)

    worker = threading.Thread(
        target=session.append_tokens, args=(random_tokens(64, seed=2),), kwargs={"progress": stall}
    )
    worker.start()
    try:
        assert held.wait(timeout=30)
        stats = session.stats(wait=0.05)  # answers while the prefill holds the session
        assert 8 <= stats.logical_tokens < 8 + 64 and stats.kv_bytes > 0
    finally:
        release.set()
        worker.join()
    assert session.stats(wait=0.05).logical_tokens == 72  # free again: measured now


@pytest.mark.small_model
def test_many_short_messages_prefilled_together_hold_what_one_by_one_holds():
    """A conversation of short messages runs as few passes (``runs_of_one_chunk``): the same tokens, segments,
    message spans and per-slot segments as appending them one at a time, the same keys up to rounding, and
    the context queries each segment keeps."""
    from tests.test_contract import tiny_chat_engine

    engine = tiny_chat_engine()
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"note {i}: {'x' * (i % 7)}"} for i in range(40)]
    together, apart = engine.session(), engine.session()
    passes = engine.stats()["batching"]["passes"]
    together.set_messages(messages)
    assert engine.stats()["batching"]["passes"] - passes < 5
    for k in range(len(messages)):
        apart.set_messages(messages[: k + 1])
    assert together.tokens == apart.tokens and together.messages == apart.messages
    assert [s.to_dict() for s in together.segments] == [s.to_dict() for s in apart.segments]
    assert together._message_spans == apart._message_spans
    for a, b in zip(together.cache.layers, apart.cache.layers):
        n = a.length
        assert n == b.length and torch.equal(a.segments[:, :n], b.segments[:, :n])
        torch.testing.assert_close(a.keys[:, :, :n].float(), b.keys[:, :, :n].float(), atol=2e-2, rtol=1e-2)
    kept = together.query_recorder.context, apart.query_recorder.context
    assert kept[0].keys() == kept[1].keys()
    for segment in kept[0]:
        assert kept[0][segment][0].shape == kept[1][segment][0].shape


def test_every_public_session_method_has_an_async_twin_with_its_signature():
    import inspect

    from kvmemory.runtime.async_session import NOT_ASYNC, public_methods
    from kvmemory.runtime.session import Session

    for name in public_methods(Session):
        if name in NOT_ASYNC:
            continue
        twin = inspect.getattr_static(AsyncSession, name)
        assert inspect.iscoroutinefunction(twin) or inspect.isasyncgenfunction(twin), name
        assert inspect.signature(twin).parameters == inspect.signature(getattr(Session, name)).parameters, name


async def test_the_async_compact_takes_the_sync_ones_arguments(tiny_engine):
    async with tiny_engine.async_session() as session:
        await session.append_tokens(random_tokens(64, seed=5))
        record = await session.compact("snapkv", ratio=4, keep_last=8)
        assert record.slots_after < record.slots_before and (await session.stats()).compactions == 1
        assert await session.run(lambda s: len(s.tokens)) == 64
        async for piece in session.stream(4, temperature=0.0):
            assert isinstance(piece, str)
