"""Compaction methods: exactness of Attention Matching, budget arithmetic, every method on every architecture."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmemory import Engine, InvalidArgumentError, KVMemoryError
from kvmemory.cache import CompactionPlan, LayerPlan
from kvmemory.compaction.base import LayerSpan
from kvmemory.compaction.head_budgets import fill_to_total, headkv_budgets, uniform_budgets
from kvmemory.compaction.methods import TAM, AttentionMatching
from kvmemory.compaction.methods.attention_matching import proportional_split
from kvmemory.compaction.methods.tam import allocate
from kvmemory.compaction.registry import available_methods, get_method
from kvmemory.compaction.solvers import attention_output_error, fit_bias_and_values, nnls_box
from kvmemory.runtime import head_profiling
from kvmemory.runtime.model_view import SessionModelView, own_token_logits, query_phases
from kvmemory.runtime.session_compaction import compact_span
from tests.conftest import ARCHITECTURES, random_tokens, tiny_model


def synthetic_span(heads=2, n=96, m=256, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(heads, n, d, generator=g)
    values = torch.randn(heads, n, d, generator=g)
    queries = torch.randn(heads, m, d, generator=g) * 1.5
    positions = torch.arange(n).expand(heads, n).clone()
    valid = torch.ones(heads, n, dtype=torch.bool)
    return LayerSpan(0, keys, values, torch.zeros(heads, n), positions, valid, d**-0.5, queries)


def outputs_and_mass(span: LayerSpan, keep, bias, values, queries):
    """Block output O and mass M for ``queries`` over the kept slots with their (new) β and values."""
    k = torch.stack([span.keys[h, keep[h]] for h in range(span.num_heads)])
    logits = torch.einsum("hmd,hnd->hmn", queries, k) * span.scale + bias[:, None, :]
    mass = torch.logsumexp(logits, -1)
    return torch.softmax(logits, -1) @ values, mass


def test_am_with_every_slot_kept_reproduces_output_and_mass_exactly():
    span = synthetic_span()
    keep = [torch.arange(96), torch.arange(96)]
    shift, values = fit_bias_and_values(span.logits(), span.values, keep, ridge=1e-9)
    out, mass = outputs_and_mass(span, keep, shift, values, span.queries)
    ref_out, ref_mass = outputs_and_mass(span, keep, torch.zeros(2, 96), span.values, span.queries)
    assert torch.allclose(mass, ref_mass, atol=1e-4)
    assert torch.allclose(out, ref_out, atol=1e-4)
    assert attention_output_error(span.logits(), span.values, keep, shift, values) < 1e-4


@pytest.mark.parametrize("rows", [200, 40])  # more rows than columns (primal), fewer (dual)
def test_nnls_ridge_solve_is_the_same_on_either_side(rows):
    """Before the gradient steps, both forms return the clamped ridge solution (aᵀa + λI)⁻¹aᵀy."""
    gen = torch.Generator().manual_seed(3)
    a = torch.rand(2, rows, 64, generator=gen, dtype=torch.float64)
    y = a @ (0.5 + torch.rand(2, 64, 1, generator=gen, dtype=torch.float64))
    valid = torch.ones(2, 64, dtype=torch.bool)
    valid[1, 50:] = False  # a shorter head: its padded columns must come back 0
    b = nnls_box(a, y[..., 0], valid, 1e-3, 1e3, steps=0, ridge=1e-4)
    a_valid = a * valid[:, None, :]
    lam = 1e-4 * a_valid.square().sum(dim=(1, 2)) / 64
    gram = a_valid.transpose(1, 2) @ a_valid + lam[:, None, None] * torch.eye(64, dtype=torch.float64)
    gram = gram + (~valid)[:, None, :] * torch.eye(64, dtype=torch.float64)
    expected = torch.linalg.solve(gram, a_valid.transpose(1, 2) @ y).squeeze(-1).clamp(1e-3, 1e3) * valid
    assert torch.allclose(b, expected, rtol=1e-6, atol=1e-9)
    refined = nnls_box(a, y[..., 0], valid, 1e-3, 1e3, steps=30, ridge=1e-4)

    def residual(x):
        return (a_valid @ x[..., None] - y).norm()

    assert residual(refined) <= residual(b) + 1e-9 and bool((refined[1, 50:] == 0).all())


def test_am_beats_eviction_of_the_same_keys_on_held_out_queries():
    span = synthetic_span(n=128, m=512)
    held_out = synthetic_span(n=128, m=256, seed=1).queries
    method = AttentionMatching(ridge=1e-3)
    keep = method.select(span, torch.tensor([24, 24]), None, None)
    fitted = method.fit(span, keep, None)
    full_out, full_mass = outputs_and_mass(span, [torch.arange(128)] * 2, torch.zeros(2, 128), span.values, held_out)

    def errors(bias, values):
        out, mass = outputs_and_mass(span, keep, bias, values, held_out)
        return float((out - full_out).norm() / full_out.norm()), float((mass - full_mass).abs().mean())

    evicted_values = torch.stack([span.values[h, keep[h]] for h in range(2)])
    am_out, am_mass = errors(fitted.bias, fitted.values)
    ev_out, ev_mass = errors(torch.zeros(2, 24), evicted_values)
    assert am_out < 0.6 * ev_out and am_mass < 0.5 * ev_mass


def test_am_reuses_existing_beta_when_recompacting():
    span = synthetic_span()
    span.bias = torch.rand(2, 96, generator=torch.Generator().manual_seed(7)) * 2  # compacted before: a β each
    keep = [torch.arange(96)] * 2
    shift, values = fit_bias_and_values(span.logits(), span.values, keep, ridge=1e-9)
    # the existing β already matches (ignoring it would shift by −β, about −1 on average)
    assert torch.allclose(shift, torch.zeros_like(shift), atol=5e-3)


@pytest.mark.parametrize("selector", ["highest_attention", "omp"])
def test_am_selectors_keep_exact_budgets(selector):
    span = synthetic_span(n=80)
    result = AttentionMatching(selector=selector).compact_layer(span, torch.tensor([10, 17]), None)
    assert [k.numel() for k in result.keep] == [10, 17]
    assert all(bool((k[1:] > k[:-1]).all()) for k in result.keep)
    assert torch.isinf(result.bias[0, 10:]).all() and torch.isfinite(result.bias[1]).all()


def test_am_chunked_compaction_keeps_the_budget():
    span = synthetic_span(n=300)
    result = AttentionMatching(chunk_size=64).compact_layer(span, torch.tensor([30, 45]), None)
    assert [k.numel() for k in result.keep] == [30, 45]
    assert result.values.shape == (2, 45, 16)


def test_am_chunked_compaction_of_heads_with_unequal_lengths():
    """After per-head budgets, one head's slots can end chunks before the padded length: its later chunks
    are empty and must stay empty (regression: an empty chunk once selected a padding slot)."""
    span = synthetic_span(n=300)
    span.valid[0, 120:] = False
    span.positions[0, 120:] = -1
    span.bias[0, 120:] = float("-inf")
    result = AttentionMatching(chunk_size=64).compact_layer(span, torch.tensor([20, 45]), None)
    assert [k.numel() for k in result.keep] == [20, 45]
    assert int(result.keep[0].max()) < 120 and torch.isfinite(result.values).all()


def test_budgets_sum_exactly():
    capacity = torch.tensor([[50, 10, 40], [5, 60, 60]])
    for total in (6, 31, 100, 225, 10_000):
        b = uniform_budgets(total, capacity)
        assert int(b.sum()) == min(total, 225) and bool((b <= capacity).all()) and bool((b >= 1).all())
        scores = torch.rand(2, 3)
        r = headkv_budgets(total, scores, capacity)
        assert int(r.sum()) == min(total, 225) and bool((r <= capacity).all())
    split = proportional_split(torch.tensor([17, 3]), torch.tensor([[10, 20, 5], [1, 1, 9]]))
    assert split.sum(1).tolist() == [17, 3]
    for a, b in ((0.5, 1.0), (0.5, 0.5)):
        t = allocate(40, torch.tensor([0.5, 0.3, 0.1, 0.1]), torch.tensor([30, 20, 10, 40]), a, b)
        assert int(t.sum()) == 40 and bool((t >= 1).all()) and bool((t <= torch.tensor([30, 20, 10, 40])).all())


def one_slot_a_round(share: torch.Tensor, total: int, capacity: torch.Tensor) -> torch.Tensor:
    """The rounding ``fill_to_total`` specifies, one slot a head a round: floor the shares into [1, capacity],
    then give a slot to the heads furthest below their share (or take one from those furthest above)."""
    total = int(min(total, int(capacity.sum())))
    out = torch.minimum(share.floor().long().clamp_min(1), capacity).flatten()
    share, capacity = share.flatten(), capacity.flatten()
    while int(out.sum()) != total:
        left = total - int(out.sum())
        if left > 0:
            gap = (share - out.float()).masked_fill(capacity - out <= 0, float("-inf"))
            out[torch.topk(gap, min(left, int((capacity - out > 0).sum()))).indices] += 1
        else:
            gap = (out.float() - share).masked_fill(out <= 1, float("-inf"))
            out[torch.topk(gap, min(-left, int((out > 1).sum()))).indices] -= 1
    return out.view(-1, 3)


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.lists(st.tuples(*[st.integers(1, 600)] * 3), min_size=2, max_size=20),
    shares=st.lists(st.floats(0, 400), min_size=60, max_size=60),
    fraction=st.floats(0, 1.2),
)
def test_budgets_round_as_one_slot_a_round_at_once(capacity, shares, fraction):
    """Heads far below their share (the uneven capacities REAL's budgets leave) take many rounds of one slot
    each; ``fill_to_total`` takes them at once, to the same budgets."""
    capacity = torch.tensor(capacity)
    share = torch.tensor(shares[: capacity.numel()]).view(-1, 3)
    total = max(capacity.numel(), int(fraction * int(capacity.sum())))
    assert torch.equal(fill_to_total(share, total, capacity), one_slot_a_round(share, total, capacity))


def test_headkv_budgets_follow_head_scores():
    capacity = torch.full((1, 4), 1000)
    budgets = headkv_budgets(400, torch.tensor([[0.7, 0.1, 0.1, 0.1]]), capacity, beta=1.5)
    assert budgets[0, 0] > budgets[0, 1] and int(budgets.sum()) == 400


def test_the_default_model_reads_its_shipped_head_profile(small_engine, tmp_path, monkeypatch):
    """The default policy's REAL budgets come from the profile shipped for the default model, found by the
    engine's model name (an engine once named itself after a constructor argument, so every model missed its
    shipped profile and was profiled again at its first compaction)."""
    monkeypatch.setattr(head_profiling, "PROFILE_DIR", tmp_path)  # no cached profile to fall back on
    monkeypatch.setattr(head_profiling, "profile_heads", None)  # profiling would fail loudly
    assert small_engine.name == "SmolLM2-135M-Instruct"
    profile = head_profiling.profile_for(small_engine)
    assert profile.model == small_engine.name and profile.cases > 0
    assert Engine(tiny_model("llama")).name == "llama" and Engine(tiny_model("llama"), name="mine").name == "mine"


def test_a_model_without_a_profile_is_never_profiled_inside_a_turn(tmp_path, monkeypatch):
    """Profiling runs the model for a minute, so a compaction never starts it: a model with no shipped or
    cached profile gets the same score for every head (so the same budget) and a warning naming the command
    that profiles it, and nothing is cached in place of a real profile."""
    from tests.test_contract import tiny_chat_engine

    monkeypatch.setattr(head_profiling, "PROFILE_DIR", tmp_path)
    monkeypatch.setattr(head_profiling, "profile_heads", None)  # profiling would fail loudly
    engine = tiny_chat_engine()
    with pytest.warns(UserWarning, match="kvmemory models profile"):
        profile = head_profiling.profile_for(engine)
    scores = profile.scores()
    assert scores.shape == (engine.num_layers, engine.num_kv_heads) and bool((scores == 1).all())
    capacity = torch.full(tuple(scores.shape), 1000)
    assert bool((headkv_budgets(64 * scores.numel(), scores, capacity) == 64).all())
    assert not any(tmp_path.iterdir())


def test_preparing_a_model_profiles_it_once_and_compactions_read_that_profile(tmp_path, monkeypatch, tiny_engine):
    from tests.test_contract import tiny_chat_engine

    monkeypatch.setattr(head_profiling, "PROFILE_DIR", tmp_path)
    engine = tiny_chat_engine()
    made, saved = head_profiling.prepare_profile(engine)
    assert saved == tmp_path / f"{engine.name}.json" and made.cases > 0
    assert len(made.infsc) == engine.num_layers and len(made.infsc[0]) == engine.num_kv_heads
    assert head_profiling.prepare_profile(engine) == (made, None)  # prepared already: nothing runs again
    assert head_profiling.profile_for(engine) == made
    with pytest.raises(KVMemoryError, match="no tokenizer"):  # the needle tasks are text
        head_profiling.prepare_profile(tiny_engine)


def test_tam_keeps_pivotal_tokens_verbatim():
    span = synthetic_span(n=120)
    span.keys[:, 7] *= 6  # make slot 7 draw far more attention than the mean
    span.queries = span.queries.abs()
    span.keys[:, 7] = span.keys[:, 7].abs()
    from kvmemory.compaction.base import CacheSpan

    result = TAM(pivotal_factor=3.0, min_segment_tokens=16).compact(
        CacheSpan([span], token_of_position={}, text_of_token=lambda t: ""), torch.tensor([[20, 20]])
    )[0]
    for h in range(2):
        row = int(torch.nonzero(result.keep[h] == 7))
        assert torch.allclose(result.values[h, row], span.values[h, 7])
        assert float(result.bias[h, row]) == 0.0


def test_fast_counter_causal_equals_full_on_one_layer_model():
    engine = Engine(tiny_model("llama", num_hidden_layers=1))
    session = engine.session()
    session.record_last_layer_inputs()
    session.append_tokens(random_tokens(40))
    access = SessionModelView.of(session)
    positions = torch.arange(40)
    full = own_token_logits(access, positions, fast=False)
    fast = own_token_logits(access, positions, fast=True)
    assert torch.allclose(full, fast, atol=1e-5)


def test_counter_causal_score_matches_a_dense_reference():
    """The blocked, reduced-precision counter-causal pass against the definition written out densely in
    fp32: each token re-read by the last layer, attending only to strictly later cached slots."""
    model = tiny_model("llama", num_hidden_layers=1)
    engine = Engine(model)
    session = engine.session()
    session.record_last_layer_inputs()
    tokens = random_tokens(300, seed=3)  # longer than one row block, so the blocking is exercised
    session.append_tokens(tokens)
    positions = torch.arange(300)
    got = own_token_logits(SessionModelView.of(session), positions, fast=True)

    layer, attn, base = model.model.layers[0], model.model.layers[0].self_attn, model.model
    with torch.no_grad():
        hidden = base.embed_tokens(torch.tensor(tokens))
        q = attn.q_proj(layer.input_layernorm(hidden)).view(300, -1, attn.head_dim).transpose(0, 1)
        cos, sin = base.rotary_emb(hidden[None], positions[None])
        half = attn.head_dim // 2
        q = q * cos + torch.cat([-q[..., half:], q[..., :half]], dim=-1) * sin
        cache = session.cache.layers[0]
        groups = q.shape[0] // cache.num_heads
        keys = cache.keys[0, :, :300].repeat_interleave(groups, 0)
        values = cache.values[0, :, :300].repeat_interleave(groups, 0)
        scores = (q @ keys.transpose(1, 2)) * attn.scaling
        scores = scores.masked_fill(~torch.ones(300, 300, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ values  # the last token has no future: 0
        hidden = hidden + attn.o_proj(out.transpose(0, 1).reshape(300, -1))
        want = (base.norm(hidden) * model.lm_head.weight[torch.tensor(tokens)]).sum(-1)

    assert torch.allclose(got, want, atol=0.03 * float(want.abs().max()))

    def rank(x):
        return torch.argsort(torch.argsort(x)).float()

    assert float(torch.corrcoef(torch.stack([rank(got), rank(want)]))[0, 1]) > 0.999


def test_span_positions_cover_every_head_and_layer():
    from kvmemory.compaction.planner import extract_span, span_slots
    from kvmemory.compaction.position_scores import span_positions

    session = Engine(tiny_model("llama")).session()
    session.append_tokens(random_tokens(60))
    per_head = [torch.arange(0, 40, 2), torch.arange(1, 40, 3)]  # heads keep different positions
    session.apply_plan(CompactionPlan([LayerPlan(keep=per_head) for _ in session.cache.layers]))
    span = extract_span(session.cache, span_slots(session.cache, torch.arange(0, 60)), None, 1.0)
    want = torch.unique(torch.cat([layer.positions[layer.valid] for layer in span.layers]))
    assert torch.equal(span_positions(span), want)
    assert set(want.tolist()) == set(range(0, 40, 2)) | set(range(1, 40, 3))  # the union over heads


def test_counter_causal_score_survives_a_rebase():
    """Closing a uniform gap shifts every key alike: the surprise scores must not move. After a per-head
    rebase each kept token's query meets its own key's phase in every head."""
    engine = Engine(tiny_model("llama", max_position_embeddings=256))
    session = engine.session()
    session.append_tokens(random_tokens(80, seed=5))
    drop_front = torch.arange(20, 80)
    session.apply_plan(
        CompactionPlan([LayerPlan(keep=drop_front.expand(lay.num_heads, -1).clone()) for lay in session.cache.layers])
    )
    access = SessionModelView.of(session)
    before = own_token_logits(access, drop_front, fast=False)
    session.rebase_positions()
    assert torch.allclose(own_token_logits(access, drop_front, fast=False), before, atol=2e-3)  # bf16 matmuls on CPU

    per_head = [torch.arange(0, 60, 2), torch.arange(1, 60, 3)]  # slots of the 60 cached ones, per head
    session.apply_plan(CompactionPlan([LayerPlan(keep=per_head) for _ in session.cache.layers]))
    session.rebase_positions()
    layer = session.cache.layers[0]
    for h in range(layer.num_heads):
        kept = layer.positions[h, : layer.length]
        valid = kept >= 0
        phases = query_phases(layer, kept[valid].long())
        assert torch.equal(phases[h], layer.rope[h, : layer.length][valid].long())


@pytest.mark.parametrize("arch_name", list(ARCHITECTURES))
@pytest.mark.parametrize("method_name", available_methods() + ["am_counter_causal", "am_omp"])
def test_every_method_runs_on_every_architecture(arch_name, method_name):
    engine = Engine(tiny_model(arch_name))
    session = engine.session()
    session.record_queries(16, context=32)
    session.record_last_layer_inputs()
    session.record_surprisal()
    session.append_tokens(random_tokens(150))
    params = {
        "am_counter_causal": ("attention_matching", {"selector": "counter_causal"}),
        "am_omp": ("attention_matching", {"selector": "omp"}),
        "real": ("real", {"scores": [[1.0, 2.0], [3.0, 0.5]]}),
        "retrieval_lines": ("retrieval_lines", {"scores": [[1.0, 2.0], [3.0, 0.5]]}),
    }
    name, kwargs = params.get(method_name, (method_name, {}))
    record = compact_span(session, torch.arange(4, 130), get_method(name, **kwargs), 24)
    assert record.slots_before == 126 and record.slots_after == 24
    kept = sum(int((layer.positions[:, : layer.length] >= 0).sum()) for layer in session.cache.layers)
    assert kept == 2 * 2 * (24 + 150 - 126)  # the budget holds exactly (REAL moves it between layers)
    result = session.generate(max_new_tokens=5)
    assert len(result.token_ids) == 5 and torch.isfinite(session._last_logits).all()
    seg = session.append_tokens(random_tokens(4, seed=9))
    assert all(int(p[-1]) == seg.end - 1 for layer in session.cache.layers for p in layer.head_views("positions"))


@pytest.mark.parametrize("kv_dtype", ["float16", "int8"])
@pytest.mark.parametrize("method_name", available_methods())
def test_every_method_compacts_a_16_or_8_bit_cache(method_name, kv_dtype):
    engine = Engine(tiny_model("llama"), kv_dtype=kv_dtype)
    session = engine.session()
    session.record_queries(16, context=32)
    session.record_last_layer_inputs()
    session.record_surprisal()
    session.append_tokens(random_tokens(150))
    kwargs = {"scores": [[1.0, 2.0], [3.0, 0.5]]} if method_name in ("real", "retrieval_lines") else {}
    compact_span(session, torch.arange(4, 130), get_method(method_name, **kwargs), 24)
    assert all(layer.slots.values.dtype == engine.kv_dtype for layer in session.cache.layers)
    assert all(bool(torch.isfinite(layer.values).all()) for layer in session.cache.layers)  # decoded 8-bit rows
    session.generate(max_new_tokens=3)
    assert torch.isfinite(session._last_logits).all()


def test_reference_query_sources(tiny_engine):
    session = tiny_engine.session()
    session.record_queries(8, context=16)
    session.append_tokens(random_tokens(60))
    before = (list(session.tokens), session.cache.slots_per_head, session._last_logits.clone())
    from kvmemory.runtime.reference_queries import reference_queries

    g = tiny_engine.config.num_attention_heads // tiny_engine.num_kv_heads
    positions = torch.arange(10, 50)
    window = reference_queries(session, "window", positions)
    assert window[0].shape == (2, 8 * g, 16)
    context = reference_queries(session, "context", positions)
    assert 16 * g <= context[0].shape[1] <= 32 * g
    both = reference_queries(session, ["window", "context"], positions)
    assert both[0].shape[1] == window[0].shape[1] + context[0].shape[1]
    assert (list(session.tokens), session.cache.slots_per_head) == before[:2]
    assert torch.equal(session._last_logits, before[2])


def test_a_source_gives_at_most_a_bounded_number_of_tokens_queries(tiny_engine):
    """A span of many segments must not hand a method an unbounded query matrix (its fit holds H·m·n)."""
    from kvmemory.runtime.reference_queries import reference_queries

    session = tiny_engine.session()
    session.record_queries(8, context=16)
    for i in range(10):
        session.append_tokens(random_tokens(20, seed=i))
    g = tiny_engine.config.num_attention_heads // tiny_engine.num_kv_heads
    positions = torch.arange(4, 190)
    every = reference_queries(session, "context", positions)
    assert every[0].shape[1] > 40 * g
    capped = reference_queries(session, ["window", "context"], positions, max_tokens_per_source=40)
    assert capped[0].shape[1] == 8 * g + 40 * g  # the window whole, then 40 evenly spaced context tokens
    tokens = every[0].view(2, -1, g, 16)
    first, last = capped[0][:, 8 * g : 9 * g], capped[0][:, -g:]
    assert torch.equal(first, tokens[:, 0]) and torch.equal(last, tokens[:, -1])  # whole GQA groups, both ends


def test_scratch_query_sources_leave_the_session_unchanged(small_engine):
    from kvmemory.runtime.reference_queries import reference_queries

    session = small_engine.session()
    session.record_queries(8)
    session.append_text("The build failed: ImportError: cannot import name 'parse' from 'configlib'.\n" * 3)
    before = (
        list(session.tokens),
        session.cache.slots_per_head,
        session._last_logits.clone(),
        [session.query_recorder.window_queries(i).clone() for i in range(small_engine.num_layers)],
    )
    positions = torch.arange(0, len(session.tokens))
    repeat = reference_queries(session, "repeat", positions)
    study = reference_queries(session, "self_study", positions, self_study_tokens=8)
    assert repeat[0].shape[1] >= len(session.tokens) * 3 and study[0].shape[1] > 0
    assert (list(session.tokens), session.cache.slots_per_head) == before[:2]
    assert torch.equal(session._last_logits, before[2])
    windows = [session.query_recorder.window_queries(i) for i in range(small_engine.num_layers)]
    assert all(torch.equal(a, b) for a, b in zip(windows, before[3]))


def test_registering_a_method_keeps_the_builtins_and_bad_names_are_named():
    from kvmemory import InvalidArgumentError
    from kvmemory.compaction.methods.snapkv import SnapKV
    from kvmemory.compaction.registry import METHODS, get_method, register

    class Mine(SnapKV):
        name = "mine"

    try:
        register(Mine)
        assert type(get_method("tam")).__name__ == "TAM" and isinstance(get_method("mine"), Mine)
    finally:
        METHODS.pop("mine", None)
    with pytest.raises(InvalidArgumentError, match="unknown compaction method 'nope'"):
        get_method("nope")
    with pytest.raises(InvalidArgumentError, match="snapkv"):
        get_method("snapkv", window=0)


@pytest.mark.parametrize("name", ["snapkv", "attention_matching", "tam"])
def test_one_plan_for_several_spans_equals_compacting_them_one_by_one(tiny_engine, name):
    from kvmemory.compaction.jobs import SpanJob
    from kvmemory.runtime.session_compaction import compact_spans

    one_by_one, batched = tiny_engine.session(), tiny_engine.session()
    for session in (one_by_one, batched):
        session.record_queries(16)
        session.append_tokens(random_tokens(200, seed=3))
    spans = [torch.arange(4, 60), torch.arange(60, 130), torch.arange(130, 180)]
    for positions in spans:
        compact_span(one_by_one, positions, get_method(name), 10)
    compact_spans(batched, [SpanJob(positions, get_method(name), 10) for positions in spans])
    assert batched.cache.compactions == 1
    for a, b in zip(one_by_one.cache.layers, batched.cache.layers):
        assert a.length == b.length and torch.equal(a.positions[:, : a.length], b.positions[:, : b.length])
        assert torch.allclose(a.values[:, :, : a.length], b.values[:, :, : b.length], atol=1e-5)
        assert torch.allclose(a.bias[:, :, : a.length], b.bias[:, :, : b.length], atol=1e-5)


# ---- the public verb -----------------------------------------------------------------------------
def cache_state(session):
    return [
        (
            lay.length,
            lay.positions[:, : lay.length].clone(),
            lay.keys[:, :, : lay.length].clone(),
            lay.values[:, :, : lay.length].clone(),
            lay.bias[:, :, : lay.length].clone(),
        )
        for lay in session.cache.layers
    ]


def same_cache(a, b) -> bool:
    return all(x[0] == y[0] and all(torch.equal(p, q) for p, q in zip(x[1:], y[1:])) for x, y in zip(a, b))


def test_the_compact_verb_equals_compacting_the_span_by_hand(tiny_engine):
    by_verb, by_hand = tiny_engine.session(), tiny_engine.session()
    for session in (by_verb, by_hand):
        session.append_tokens(random_tokens(200, seed=4))
    record = by_verb.compact("attention_matching", slots=30, keep_last=16)
    compact_span(by_hand, torch.arange(4, 184), get_method("attention_matching"), 30)
    assert (record.method, record.tokens, record.slots_before, record.slots_after) == (
        "attention_matching",
        180,
        180,
        30,
    )
    assert record.reconstruction_error is not None and same_cache(cache_state(by_verb), cache_state(by_hand))
    assert by_verb.cache.slots_per_head == 4 + 30 + 16


@pytest.mark.parametrize("name", ["random", "streaming_llm", "key_norm", "counter_causal", "snapkv", "tam"])
def test_every_method_compacts_with_no_setup(tiny_engine, name):
    session = tiny_engine.session()
    session.append_tokens(random_tokens(120, seed=5))
    segment = session.append_tokens(random_tokens(60, seed=6))
    record = session.compact(name, ratio=4, segments=[segment.id], keep_last=8)
    assert record.segments == [segment.id] and record.slots_after == round(52 / 4)
    assert session.segment_slots()[0] == 120  # the other segment is untouched


def test_the_compact_verb_rejects_bad_input_before_changing_anything(tiny_engine):
    from kvmemory import InvalidArgumentError
    from kvmemory.compaction.methods import SnapKV

    session = tiny_engine.session()
    session.append_tokens(random_tokens(100, seed=7))
    before = cache_state(session)
    bad_calls = {
        "exactly one of slots": dict(method="snapkv"),
        "exactly one of slots ": dict(method="snapkv", slots=4, ratio=2),
        "slots must be a positive integer": dict(method="snapkv", slots=0),
        "ratio must be a number": dict(method="snapkv", ratio=0.5),
        "unknown compaction method 'nope'": dict(method="nope", ratio=2),
        "invalid parameters for compaction method 'snapkv'": dict(method="snapkv", ratio=2, window=0),
        "given with a method instance": dict(method=SnapKV(), ratio=2, window=4),
        "no segment 99": dict(method="snapkv", ratio=2, segments=[99]),
        "positions outside": dict(method="snapkv", ratio=2, positions=[5, 100]),
        "nothing to compact": dict(method="snapkv", ratio=2),  # 100 tokens, the last 256 are kept
        "query_source must be among": dict(method="snapkv", ratio=2, keep_last=8, query_source="future"),
    }
    for message, kwargs in bad_calls.items():
        with pytest.raises(InvalidArgumentError, match=message.strip()):
            session.compact(**kwargs)
    assert same_cache(cache_state(session), before) and session.compaction_log == []


def test_recorded_surprisal_is_the_models_own(tiny_engine):
    """Each token's recorded surprisal is −log p(token | before) of one uncached forward, across prefill
    chunks and generated tokens; the first token has none."""
    session = tiny_engine.session(prefill_chunk_size=7)
    session.record_surprisal()
    session.append_tokens(random_tokens(30, seed=1))
    session.append_tokens(random_tokens(5, seed=2))
    session.generate(max_new_tokens=4)
    session.append_tokens(random_tokens(3, seed=3))
    ids = torch.tensor([session.tokens])
    with torch.no_grad():
        logits = tiny_engine.model(ids).logits[0, :-1].float()
    expected = -torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    values = session.surprisal_recorder.values
    assert len(values) == len(session.tokens) and bool(values[0].isnan())
    assert torch.allclose(values[1:], expected, atol=1e-4)


def test_selective_context_keeps_the_lines_of_highest_mean_surprisal():
    from kvmemory.compaction.methods.lines import unit_scores

    positions = torch.arange(8)
    surprisal = torch.tensor([1.0, 3.0, 2.0, float("nan"), 6.0, 0.0, 4.0, float("nan")])
    ends_line = torch.tensor([False, True, False, False, True, False, False, False])
    scores = unit_scores(positions, surprisal, ends_line, max_unit_tokens=64)
    assert scores.tolist() == [2.0, 2.0, 4.0, 4.0, 4.0, 2.0, 2.0, 2.0]  # lines [0,1] [2..4] [5..7]; NaN skipped
    pieces = unit_scores(positions, surprisal, torch.zeros(8, dtype=torch.bool), max_unit_tokens=3)
    assert pieces.tolist() == [2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 4.0, 4.0]  # a long line ranks in pieces
    unknown = unit_scores(positions, torch.tensor([1.0, 3.0] + [float("nan")] * 6), ends_line, max_unit_tokens=64)
    assert unknown[2:].tolist() == [2.0] * 6  # a unit with nothing recorded scores the median of the others


def test_selective_context_can_evict_predictable_tokens_before_any_line():
    from kvmemory.compaction.methods.lines import keep_order

    scores = torch.tensor([2.0, 2.0, 4.0, 4.0, 4.0, 2.0, 2.0])  # lines [0,1] [2..4] [5,6]
    surprisal = torch.tensor([1.0, 3.0, 0.1, float("nan"), 0.2, 3.0, 0.3])
    ends_line = torch.tensor([False, True, False, False, True, False, False])
    assert keep_order(scores, surprisal, ends_line, None).tolist() == [3, 4, 0, 1, 2, 5, 6]
    # below 0.5 nats: positions 2 and 6 go last (in line order); the newline at 4 and the unknown at 3 stay
    assert keep_order(scores, surprisal, ends_line, 0.5).tolist() == [2, 3, 5, 0, 1, 4, 6]


def test_selective_context_without_recorded_surprisal_names_the_fix(tiny_engine):
    from tests.test_contract import assert_same_state, state_of

    session = tiny_engine.session()
    session.append_tokens(random_tokens(80))
    before = state_of(session)
    with pytest.raises(InvalidArgumentError, match="record_surprisal"):
        session.compact("selective_context", ratio=4, keep_last=8)
    assert_same_state(state_of(session), before)


def test_retrieval_lines_keeps_lines_in_the_top_scored_heads_and_snapkv_in_the_others(tiny_engine):
    """The heads of the top half of scores keep exactly selective context's slots, the others SnapKV's."""
    session = tiny_engine.session()
    session.record_queries(16, context=32)
    session.record_surprisal()
    session.append_tokens(random_tokens(150, seed=4))
    kept = {}
    for name, params in {
        "retrieval_lines": {"scores": [[0.1, 2.0], [3.0, 0.5]], "line_heads": 0.5},
        "selective_context": {"evict_predictable_below": 1.0},
        "snapkv": {},
    }.items():
        fork = session.fork()
        compact_span(fork, torch.arange(4, 130), get_method(name, **params), 24)
        kept[name] = [[p.tolist() for p in layer.head_views("positions")] for layer in fork.cache.layers]
    assert kept["selective_context"] != kept["snapkv"]  # else the test could not tell them apart
    for layer, heads in enumerate(kept["retrieval_lines"]):
        for head, positions in enumerate(heads):
            like = "selective_context" if (layer, head) in {(0, 1), (1, 0)} else "snapkv"
            assert positions == kept[like][layer][head], (layer, head, like)


def test_retrieval_lines_refuses_head_scores_of_another_shape_before_changing_anything(tiny_engine):
    from tests.test_contract import assert_same_state, state_of

    session = tiny_engine.session()
    session.record_queries(16, context=32)
    session.record_surprisal()
    session.append_tokens(random_tokens(80))
    before = state_of(session)
    with pytest.raises(InvalidArgumentError, match="shape"):
        session.compact("retrieval_lines", ratio=4, keep_last=8, scores=[[1.0, 2.0, 3.0]])
    assert_same_state(state_of(session), before)


def test_queries_stored_per_pass_are_the_window_the_capture_and_the_context():
    """The batcher hands a recorder each pass's queries of all layers at once (``store``): the window holds
    the last R tokens' queries, grouped by KV head, token-major (held in bf16); a capture every query; and the
    context the same whether a segment's tokens come in one pass or several."""
    from kvmemory.runtime.recorders import QueryRecorder, group_queries

    layers, kv_heads, groups, dim, window = 3, 2, 2, 4, 5
    g = torch.Generator().manual_seed(0)
    passes = [torch.randn(layers, kv_heads * groups, t, dim, generator=g) for t in (7, 1, 1, 3, 1, 1, 1, 1, 1, 1)]
    stepwise, at_once = (QueryRecorder(layers, kv_heads, window, context=40) for _ in range(2))
    for recorder in (stepwise, at_once):
        recorder.current_segment = 0
        recorder.start_capture()
    for queries in passes:
        stepwise.store(queries)
    everything = torch.cat(passes, dim=2)  # (L, Hq, T, D)
    at_once.store(everything)
    for layer in range(layers):
        expected = everything[layer, :, -window:].view(kv_heads, groups, window, dim).transpose(1, 2)
        held = expected.reshape(kv_heads, window * groups, dim).to(torch.bfloat16)  # held in half precision
        assert stepwise.window_queries(layer).dtype == torch.float32  # handed out in full
        assert torch.equal(stepwise.window_queries(layer), held.float())
    for a, b in zip(stepwise.context_queries([0]), at_once.context_queries([0])):
        assert torch.equal(a, b)
    for layer, captured in enumerate(stepwise.stop_capture()):
        assert torch.equal(captured, group_queries(everything, kv_heads)[layer])
