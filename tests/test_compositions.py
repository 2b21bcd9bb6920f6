"""Composing methods: position scores, ``Lines`` around any ranking, ``Fitted`` on any choice, TAM's rule as a
ranking; and the compositions run end to end under a memory manager on a real session."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmemory import Engine, MemoryManager
from kvmemory.compaction.base import CacheSpan, CompactionMethod, LayerResult, MethodConfig
from kvmemory.compaction.methods import REAL, AttentionMatching, CounterCausal, Fitted, Lines, SnapKV
from kvmemory.compaction.methods.tam import quota_scores
from kvmemory.compaction.position_scores import PositionScores, consensus, head_ranks
from kvmemory.compaction.registry import get_method
from kvmemory.errors import InvalidArgumentError
from kvmemory.runtime.session_compaction import compact_span
from tests.conftest import random_tokens, tiny_model
from tests.test_contract import assert_same_state, state_of
from tests.test_methods import synthetic_span


class Given(CompactionMethod):
    """A method whose position scores are given (the test's inner ranking)."""

    name = "given"
    Config = MethodConfig

    def __init__(self, scores: torch.Tensor):
        super().__init__()
        self.scores = scores

    def position_scores(self, span: CacheSpan) -> PositionScores:
        return PositionScores(torch.arange(len(self.scores)), self.scores)

    def compact(self, span, budgets):
        raise NotImplementedError


def text_span(lines: list[list[str]], heads: int = 2, layers: int = 2, surprisal=None) -> CacheSpan:
    """A span whose tokens are the given lines' pieces (the last piece of each line ends with a newline)."""
    texts = [piece for line in lines for piece in line]
    n = len(texts)
    layer_spans = []
    for layer in range(layers):
        span = synthetic_span(heads=heads, n=n, m=8, seed=layer)
        span.layer = layer
        layer_spans.append(span)
    return CacheSpan(
        layer_spans,
        token_of_position={p: p for p in range(n)},
        text_of_token=lambda t: texts[t] if 0 <= t < n else "",
        surprisal=surprisal,
    )


def kept_positions(span: CacheSpan, results: list[LayerResult]) -> set[tuple[int, ...]]:
    return {
        tuple(layer.positions[h, keep].tolist())
        for layer, r in zip(span.layers, results)
        for h, keep in enumerate(r.keep)
    }


def test_head_ranks_are_scale_free_and_skip_padding():
    scores = torch.tensor([[1.0, 5.0, 3.0, 0.0], [100.0, 300.0, 200.0, 0.0]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, False]])
    ranks = head_ranks(scores, valid)
    assert torch.equal(ranks[0], ranks[1]) and ranks[0].tolist() == [0.0, 1.0, 0.5, 0.0]


def test_consensus_is_the_mean_over_the_heads_that_hold_a_position():
    span = text_span([["a", "b", "c\n"]], heads=2, layers=1)
    span.layers[0].valid[1, 0] = False  # head 1 no longer holds position 0
    scores = consensus(span, lambda layer: torch.tensor([[1.0, 2.0, 3.0], [9.0, 4.0, 6.0]]))
    assert scores.positions.tolist() == [0, 1, 2] and scores.scores.tolist() == [1.0, 3.0, 4.5]


def test_lines_keeps_whole_lines_by_their_mean_score_in_every_head():
    # lines: [0,1,2] [3,4] [5,6,7]; one very high token makes line 2 the best; line 1 beats line 0 on the mean
    scores = torch.tensor([0.0, 0.0, 0.0, 2.0, 2.0, 9.0, -1.0, -1.0])
    span = text_span([["x", "=", "1\n"], ["y", "2\n"], ["port", " 8443", "\n"]])
    results = Lines(Given(scores), evict_predictable_below=None).compact(span, torch.full((2, 2), 5))
    assert kept_positions(span, results) == {(3, 4, 5, 6, 7)}


def test_lines_surprise_floor_evicts_predictable_tokens_first():
    scores = torch.zeros(6)
    surprisal = torch.tensor([5.0, 0.1, 5.0, 0.2, 5.0, 5.0])  # positions 1 and 3 were predictable
    span = text_span([["a", "b", "c\n"], ["d", "e", "f\n"]], surprisal=surprisal)
    results = Lines(Given(scores), evict_predictable_below=1.0).compact(span, torch.full((2, 2), 4))
    assert kept_positions(span, results) == {(0, 2, 4, 5)}


def test_lines_with_a_floor_and_no_recorded_surprisal_names_the_fix():
    span = text_span([["a", "b\n"]])
    with pytest.raises(InvalidArgumentError, match="record_surprisal"):
        Lines(Given(torch.zeros(2))).compact(span, torch.full((2, 2), 1))


class Unranked(CompactionMethod):
    name = "unranked"
    Config = MethodConfig

    def compact(self, span, budgets):
        raise NotImplementedError


def test_a_method_that_cannot_rank_positions_says_so():
    with pytest.raises(InvalidArgumentError, match="does not rank positions"):
        Lines(REAL(Unranked(), scores=[[1.0, 2.0], [3.0, 0.5]])).compact(
            text_span([["a", "b\n"]]), torch.full((2, 2), 1)
        )


def test_compositions_pass_their_needs_through():
    lines = Lines(CounterCausal())
    assert lines.needs_last_layer_inputs and lines.needs_surprisal and not lines.uses_queries and lines.global_scores
    assert not Lines(CounterCausal(), evict_predictable_below=None).needs_surprisal
    assert Lines(SnapKV()).uses_queries
    built = get_method("real", inner="fitted", inner_params={"inner": "lines", "inner_params": {"inner": "tam"}})
    assert built.global_scores and built.needs_surprisal and built.uses_queries
    assert isinstance(built.inner, Fitted) and isinstance(built.inner.inner, Lines)


def test_fitted_is_attention_matchings_fit_on_the_inner_choice():
    span = text_span([["a", "b", "c\n"], ["d", "e\n"], ["f", "g", "h", "i\n"]])
    for layer in span.layers:
        layer.queries = torch.randn(2, 16, layer.keys.shape[-1], generator=torch.Generator().manual_seed(7))
    budgets = torch.full((2, 2), 4)
    inner = Lines(Given(torch.arange(9).float()), evict_predictable_below=None)
    fitted = Fitted(inner).compact(span, budgets)
    chosen = inner.compact(span, budgets)
    matching = AttentionMatching()
    for layer, got, keep in zip(span.layers, fitted, chosen):
        want = matching.fit(layer, keep.keep, None)
        assert all(torch.equal(a, b) for a, b in zip(got.keep, keep.keep))
        assert torch.allclose(got.values, want.values) and torch.allclose(got.bias, want.bias)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(1, 12), min_size=1, max_size=6),
    st.integers(0, 2**31 - 1),
    st.sampled_from([(0.5, 1.0), (0.5, 0.5), (1.0, 0.0)]),
    st.data(),
)
def test_tam_quota_ranking_apportions_any_budget_by_tams_rule(lengths, seed, exponents, data):
    """The top B of ``quota_scores`` give every segment one slot, then the rest by highest averages in
    proportion to q = w^a · n^b: no segment's last kept token is worth less than another's first evicted one,
    ((t_i − 1) / q_i ≤ t_j / q_j), and within a segment the most attended go first."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    share = torch.rand(len(segment), generator=torch.Generator().manual_seed(seed)) + 0.01
    share = share / share.sum()
    budget = data.draw(st.integers(len(lengths), len(segment)))
    a, b = exponents
    top = torch.topk(quota_scores(share, segment, a, b, pivotal_factor=float("inf")), budget).indices
    got = torch.bincount(segment[top], minlength=len(lengths))
    weights = torch.zeros(len(lengths)).index_add_(0, segment, share)
    quota = (weights / weights.sum()).pow(a) * torch.tensor(lengths).float().pow(b)
    assert bool((got >= 1).all())
    for i in range(len(lengths)):
        for j in range(len(lengths)):
            if got[j] < lengths[j]:
                assert (got[i] - 1) / quota[i] <= got[j] / quota[j] * (1 + 1e-5)
    for s in range(len(lengths)):
        members = torch.nonzero(segment == s).flatten()
        taken = set(top.tolist()) & set(members.tolist())
        best = members[torch.argsort(share[members], descending=True)][: len(taken)]
        assert taken == set(best.tolist())


def seeded_session(engine):
    session = engine.session()
    session.record_queries(16, context=32)
    session.record_last_layer_inputs()
    session.record_surprisal()
    session.append_tokens(random_tokens(150))
    return session


@pytest.mark.parametrize("inner", ["counter_causal", "attention_matching", "tam", "snapkv"])
def test_seed_lines_keep_the_same_positions_in_every_head(inner):
    engine = Engine(tiny_model("llama"))
    session = seeded_session(engine)
    end = len(session.tokens) - 8
    compact_span(session, torch.arange(4, end), get_method("lines", inner=inner), 20)
    kept = {tuple(p[p >= 0].tolist()) for layer in session.cache.layers for p in layer.head_views("positions")}
    assert len(kept) == 1 and len(next(iter(kept))) == 4 + 20 + len(session.tokens) - end
    session.generate(max_new_tokens=3)
    assert torch.isfinite(session._last_logits).all()


@pytest.mark.parametrize("inner", ["counter_causal", "tam"])
def test_a_composition_failing_midway_leaves_the_session_bit_identical(inner, monkeypatch):
    engine = Engine(tiny_model("llama"))
    session = seeded_session(engine)
    before = state_of(session)
    fit, calls = AttentionMatching.fit, []

    def fit_then_fail(self, *args):  # the first layer's fit succeeds, the second's raises
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("injected")
        return fit(self, *args)

    monkeypatch.setattr(AttentionMatching, "fit", fit_then_fail)
    method = REAL(inner=Fitted(Lines(get_method(inner))), scores=[[1, 2], [3, 1]])
    with pytest.raises(RuntimeError, match="injected"):
        compact_span(session, torch.arange(4, len(session.tokens) - 8), method, 20)
    assert_same_state(state_of(session), before)


@pytest.mark.parametrize("condition", ["cc-lines", "tam-lines", "am-mass-default"])
def test_benchmarked_compositions_hold_a_cap_under_the_memory_manager(condition):
    from benchmarks.agent_memory import KV_METHODS, capped_policy

    engine = Engine(tiny_model("llama"))
    method, params = KV_METHODS[condition]
    policy = capped_policy(320 * engine.kv_bytes_per_token, method, {**params, "scores": [[1, 2], [3, 1]]})
    session = engine.session(memory=MemoryManager(policy))
    for seed in range(10):
        session.append_tokens(random_tokens(60, seed=seed))
    assert session.cache.slots_per_head <= 320 and session.cache.compactions > 0
    session.generate(max_new_tokens=3)
    assert session.cache.slots_per_head <= 320 and len(session.tokens) == 603
