"""Ragged per-head storage: a head costs exactly the slots it keeps, and attention over it equals attention
over the same slots padded to the longest head with β = −∞ (the layout it replaced)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmemory import CompactionPlan, Engine, InvalidArgumentError, InvalidTokenError, LayerPlan
from kvmemory.cache.compact_layer import LayerState, Slots
from kvmemory.compaction.registry import available_methods, get_method
from kvmemory.runtime.session_compaction import compact_span
from tests.conftest import random_tokens, tiny_model
from tests.test_contract import assert_same_state, state_of, uneven_plan


def padded_twin(session):
    """A fork whose every layer holds the padded layout: each head padded to its layer's longest head with
    β = −∞ and position −1, new tokens appended after the padding (what the cache did before)."""
    twin = session.fork()
    for layer in twin.cache.layers:
        heads, width = layer.num_heads, layer.length
        keys, values = (t[0, :, :width].reshape(heads * width, -1) for t in (layer.keys, layer.values))
        fields = (layer.bias[0], layer.positions, layer.rope, layer.segments)
        meta = (t[:, :width].reshape(-1) for t in fields)
        flat = Slots.of(keys, values, *meta)
        starts = tuple(h * width for h in range(heads))
        layer.restore(LayerState(flat, starts, (width,) * heads, (width,) * heads, (width,) * heads, True))
    return twin


def test_stats_count_slots_per_head_as_the_cap_does(tiny_engine):
    """Under uneven layer and head budgets (REAL's) the longest layer sits far above what a slot cap counts:
    ``slots_per_head`` is the mean over every head of the cache, the count that bounds its bytes."""
    session = tiny_engine.session()
    session.append_tokens(random_tokens(300, seed=11))
    keeps = ([torch.arange(0, 300, 3), torch.arange(0, 300, 10)], [torch.arange(0, 300, 15), torch.arange(0, 300, 30)])
    session.apply_plan(CompactionPlan([LayerPlan(keep=list(k)) for k in keeps]))  # 100 + 30 and 20 + 10 slots
    stats = session.stats()
    assert stats.slots_per_head_by_layer == [65, 15] and stats.slots_per_head == 40 == session.cache.slots_per_head
    assert stats.kv_bytes == 160 * session.cache.layers[0].head_slot_bytes()
    assert session.cache.longest_head == 100  # the most slots one head holds


def test_the_old_names_of_slot_counts_still_answer_and_warn(tiny_engine):
    """``physical_length``, ``longest_layer`` and ``physical_slots`` were renamed to the words of the glossary
    (docs/architecture.md); code that reads them keeps working, told the new name."""
    session = tiny_engine.session()
    session.append_tokens(random_tokens(50, seed=2))
    session.apply_plan(CompactionPlan([LayerPlan(keep=[torch.arange(0, 50, 2), torch.arange(0, 50, 5)])] * 2))
    cache, stats = session.cache, session.stats()
    for old, new, value in (
        ("physical_length", "slots_per_head", cache.slots_per_head),
        ("longest_layer", "longest_head", cache.longest_head),
    ):
        with pytest.warns(DeprecationWarning, match=new):
            assert getattr(cache, old) == value
    with pytest.warns(DeprecationWarning, match="slots_per_head_by_layer"):
        assert stats.physical_slots == stats.slots_per_head_by_layer == [18, 18]


def test_uneven_heads_cost_only_their_slots(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(300, seed=11))
    before = session.stats()
    plans = [LayerPlan(keep=[torch.arange(0, 300, 3), torch.arange(0, 300, 10)]) for _ in session.cache.layers]
    session.apply_plan(CompactionPlan(plans))  # 100 and 30 slots
    after = session.stats()
    layer = session.cache.layers[0]
    assert layer.lengths == (100, 30) and after.slots_per_head_by_layer == [65, 65]
    assert after.kv_bytes == 2 * 130 * layer.head_slot_bytes() == 130 * session.cache.bytes_per_token() // 2
    assert after.allocated_bytes == after.kv_bytes  # exactly the kept slots: no padding, no headroom
    assert after.allocated_bytes < before.allocated_bytes / 4
    # whole-layer views for compaction code: the shorter head's tail reads as padding
    assert torch.isinf(layer.bias[0, 1, 30:100]).all() and (layer.positions[1, 30:100] == -1).all()
    assert layer.positions[1, :30].tolist() == list(range(0, 300, 10))
    result = session.generate(max_new_tokens=5)
    assert len(result.token_ids) == 5 and torch.isfinite(session._last_logits).all()
    assert layer.lengths == (104, 34)  # the last sampled token is appended with the next call
    grown = session.stats()
    assert grown.kv_bytes == 2 * 138 * layer.head_slot_bytes()
    assert grown.allocated_bytes <= grown.kv_bytes + 2 * 2 * 64 * layer.head_slot_bytes()  # ≤ 64 spare per head


def test_padded_views_cost_nothing_for_even_heads(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(50, seed=1))
    layer = session.cache.layers[0]
    assert layer.uniform and layer.keys.data_ptr() == layer.slots.keys.data_ptr()  # a view, not a copy


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_ragged_attention_equals_padded_attention(arch):
    engine = Engine(tiny_model(arch, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    session = engine.session()
    session.append_tokens(random_tokens(90, seed=5))
    session.apply_plan(uneven_plan(session, seed=1))
    assert any(not layer.uniform for layer in session.cache.layers)
    twin = padded_twin(session)
    cont = random_tokens(12, seed=6)
    assert torch.allclose(session.logprobs(cont), twin.logprobs(cont), atol=1e-5)
    session.append_tokens(cont)  # prefill chunk: causal among new tokens, per head over its own slots
    twin.append_tokens(cont)
    assert torch.allclose(session._last_logits, twin._last_logits, atol=1e-5)
    assert session.generate(max_new_tokens=6).token_ids == twin.generate(max_new_tokens=6).token_ids


def _decode_step(engine, cache, path: str) -> torch.Tensor:
    """One token through the model outside the batcher (the ``compact_cache`` entry), then undone."""
    snap, position = cache.snapshot(), cache.logical_length
    rope = cache.begin_append(position, 1, 0)
    with torch.no_grad():
        out = engine.model(
            input_ids=torch.tensor([[5]]),
            position_ids=torch.tensor([[rope]]),
            cache=cache,
            compact_cache=cache,
            attention_path=path,
        )
    cache.restore(snap)
    return out.logits[0, -1]


def test_mask_and_folded_paths_read_ragged_heads(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(80, seed=2))
    session.apply_plan(uneven_plan(session, seed=3))
    reference = _decode_step(tiny_engine, padded_twin(session).cache, "mask")
    for path in ("mask", "folded"):
        assert torch.allclose(_decode_step(tiny_engine, session.cache, path), reference, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_flex_path_equals_per_head_path(tiny_engine, kv_dtype):
    """The one-call FlexAttention path (CUDA's choice for uneven heads) over the flat storage, headroom rows
    and all (8-bit rows decoded), equals per-head sdpa, for decode steps and prefill chunks (run eagerly on
    CPU)."""
    per_head = Engine(tiny_engine.model, attention_path="mask", kv_dtype=kv_dtype)
    flex = Engine(tiny_engine.model, attention_path="flex", kv_dtype=kv_dtype)
    prompt, cont = random_tokens(80, seed=2), random_tokens(7, seed=3)
    sessions = []
    for engine in (per_head, flex):
        session = engine.session()
        session.append_tokens(prompt)
        session.apply_plan(uneven_plan(session, seed=3))
        session.append_tokens(cont)  # a prefill chunk over uneven heads, into headroom
        sessions.append(session)
    per_head, one_call = sessions
    assert torch.allclose(per_head._last_logits, one_call._last_logits, atol=1e-5)
    assert torch.allclose(per_head.logprobs(cont), one_call.logprobs(cont), atol=1e-5)
    assert per_head.generate(max_new_tokens=4).token_ids == one_call.generate(max_new_tokens=4).token_ids


def test_an_unknown_attention_path_is_named(tiny_engine):
    with pytest.raises(InvalidArgumentError, match="attention_path"):
        Engine(tiny_engine.model, attention_path="fast")


def test_truncating_uneven_heads_cuts_each_head_in_place(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(70, seed=4))
    session.apply_plan(uneven_plan(session, seed=5))
    session.append_tokens(random_tokens(10, seed=6))
    before = [layer.snapshot() for layer in session.cache.layers]
    assert session.cache.truncate_positions(75) == 75
    for layer, old in zip(session.cache.layers, before):
        assert layer.slots is old.slots  # a suffix of every head: only the lengths changed
        for h, positions in enumerate(layer.head_views("positions")):
            old_positions = old.slots.positions[old.starts[h] : old.starts[h] + old.lengths[h]]
            assert torch.equal(positions, old_positions[old_positions < 75])


def test_uniform_budgets_keep_the_dense_layout_bit_for_bit(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(120, seed=7))
    keep = torch.cat([torch.arange(4), torch.arange(10, 120, 2)])
    plan = CompactionPlan([LayerPlan(keep=keep.expand(2, -1).clone()) for _ in session.cache.layers])
    session.apply_plan(plan)
    assert all(layer.uniform for layer in session.cache.layers)
    cont = random_tokens(10, seed=8)
    assert torch.equal(session.logprobs(cont), padded_twin(session).logprobs(cont))


@pytest.mark.parametrize("method_name", available_methods() + ["am_counter_causal"])
def test_every_method_compacts_a_cache_whose_heads_are_already_uneven(method_name):
    engine = Engine(tiny_model("llama", num_hidden_layers=3))
    session = engine.session()
    session.record_queries(16, context=32)
    session.record_last_layer_inputs()
    session.record_surprisal()
    session.append_tokens(random_tokens(150, seed=3))
    session.apply_plan(uneven_plan(session, seed=4))
    params = {
        "am_counter_causal": ("attention_matching", {"selector": "counter_causal"}),
        "real": ("real", {"scores": [[1.0, 2.0], [3.0, 0.5], [0.7, 1.4]]}),
        "retrieval_lines": ("retrieval_lines", {"scores": [[1.0, 2.0], [3.0, 0.5], [0.7, 1.4]]}),
    }
    name, kwargs = params.get(method_name, (method_name, {}))
    record = compact_span(session, torch.arange(4, 120), get_method(name, **kwargs), 12)
    assert record.slots_after <= record.slots_before
    stats = session.stats()
    assert stats.allocated_bytes == stats.kv_bytes
    for layer in session.cache.layers:  # each head: its positions still strictly increasing, nothing lost after
        for positions in layer.head_views("positions"):
            assert bool((positions[1:] > positions[:-1]).all()) and int(positions[-1]) == 149
    result = session.generate(max_new_tokens=4)
    assert len(result.token_ids) == 4 and torch.isfinite(session._last_logits).all()


def test_a_v1_file_layout_converts_without_its_padding(tiny_engine):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(60, seed=9))
    session.apply_plan(uneven_plan(session, seed=2))
    for layer in session.cache.layers:
        padded = Slots.of(layer.keys[0], layer.values[0], layer.bias[0], layer.positions, layer.rope, layer.segments)
        state = LayerState.from_padded(padded)
        assert state.lengths == layer.lengths and state.biased == layer.biased
        for a, b in zip(state.live(), layer.snapshot().live()):
            assert torch.equal(a, b)


_ENGINE = Engine(tiny_model("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=3))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    budgets=st.lists(st.lists(st.integers(1, 40), min_size=3, max_size=3), min_size=2, max_size=2),
    ops=st.lists(st.sampled_from(["append", "scratch", "fail", "fork", "rebase", "recompact"]), max_size=6),
    seed=st.integers(0, 1000),
)
def test_random_head_budgets_keep_the_session_contract(budgets, ops, seed):
    """Any per-head budgets, then any sequence of operations: the ragged cache answers as the padded layout
    would, holds exactly its slots' bytes after every compaction, and failed or scratch calls change nothing."""
    session = _ENGINE.session()
    session.append_tokens(random_tokens(48, seed=seed))
    g = torch.Generator().manual_seed(seed)

    def compact(seed_offset: int) -> None:
        layers = []
        for layer, per_head in zip(session.cache.layers, budgets):
            keeps = []
            for h, budget in enumerate(per_head):
                n = layer.lengths[h]
                keeps.append(torch.randperm(n, generator=g)[: min(budget, n)].sort().values)
            bias = [torch.rand(len(k), generator=g) - 0.5 for k in keeps]
            layers.append(LayerPlan(keep=keeps, bias=torch.nn.utils.rnn.pad_sequence(bias, batch_first=True)))
        session.apply_plan(CompactionPlan(layers, method=f"random-{seed_offset}"))
        stats = session.stats()
        assert stats.allocated_bytes == stats.kv_bytes
        assert stats.kv_bytes == sum(layer.slot_count * layer.head_slot_bytes() for layer in session.cache.layers)

    compact(0)
    for i, op in enumerate(ops):
        if op == "append":
            session.append_tokens(random_tokens(1 + i * 3, seed=seed + i))
        elif op == "scratch":
            before = state_of(session)
            session.logprobs(random_tokens(5, seed=i))
            assert_same_state(before, state_of(session))
        elif op == "fail":
            before = state_of(session)
            with pytest.raises(InvalidTokenError):
                session.append_tokens(random_tokens(3, seed=i) + [10**6])
            assert_same_state(before, state_of(session))
        elif op == "fork":
            child = session.fork()
            child.append_tokens(random_tokens(4, seed=i))
            session.append_tokens(random_tokens(4, seed=i))
            assert torch.equal(child._last_logits, session._last_logits)
        elif op == "rebase":
            session.rebase_positions()
        else:
            compact(i + 1)
    cont = random_tokens(6, seed=seed + 99)
    if session.cache.rope_length == session.cache.logical_length:  # a rebased cache has no padded reference
        assert torch.allclose(session.logprobs(cont), padded_twin(session).logprobs(cont), atol=1e-5)
    else:
        assert torch.isfinite(session.logprobs(cont)).all()


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_gathering_slots_from_ragged_storage_reads_what_the_padded_views_show(kv_dtype):
    """``CompactLayer.gather`` reads each head's slots straight from its rows (what a compaction's span is
    cut from): the same numbers as the padded whole-layer views."""
    engine = Engine(tiny_model("llama", num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    if kv_dtype:
        engine = Engine(engine.model, kv_dtype=kv_dtype)
    session = engine.session()
    session.append_tokens(random_tokens(60, seed=4))
    session.apply_plan(CompactionPlan([LayerPlan(keep=[torch.arange(0, 60, 2), torch.arange(0, 60, 7)])]))
    layer = session.cache.layers[0]
    index = torch.tensor([[0, 5, 29, 3], [0, 8, 2, 1]])
    for name in ("keys", "values", "bias", "positions"):
        whole = getattr(layer, name)
        whole = whole[0] if name in ("keys", "values", "bias") else whole
        expected = torch.stack([whole[h, index[h]] for h in range(2)])
        assert torch.equal(layer.gather(name, index), expected)
