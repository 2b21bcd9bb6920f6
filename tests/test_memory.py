"""Memory manager: policy matching and validation, the cap invariant, protection, recall, telemetry."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmemory import ContextLengthError, Engine, MemoryCapError, PolicyError
from kvmemory.compaction.registry import get_method
from kvmemory.memory import (
    MemoryBudget,
    MemoryManager,
    MemoryPolicy,
    Segment,
    SegmentMatch,
    default_policy,
    plot_memory_map,
)
from kvmemory.memory.manager import _joined
from kvmemory.memory.policy import CompactionRule
from kvmemory.runtime.chat import ChatRenderer
from tests.conftest import random_tokens, tiny_model
from tests.test_contract import assert_same_state, state_of


def seg(kind, role=None, tool=None, tags=(), text="", start=0):
    return Segment(id=start, kind=kind, start=start, end=start + 1, role=role, tool_name=tool, tags=tags, text=text)


def small_policy(max_slots=160, interval=None, recent=16, **default):
    """Attention Matching per segment under a small cap, with the budget these tests were written for: a cap
    pass aims at 3/4 of the cap, and no chat frames or closed gaps (the default's choices for its lines)."""
    return MemoryPolicy.from_dict(
        {
            "rules": [
                {"name": "system", "match": {"kind": "system"}, "protected": True},
                {"name": "logs", "match": {"tool": "run_*"}, "method": "attention_matching", "ratio": 8},
            ],
            "default": {"method": "attention_matching", "ratio": 3, **default},
            "budget": {
                "max_slots": max_slots,
                "interval": interval,
                "recent_tokens": recent,
                "window": 8,
                "sink_tokens": 2,
                "target_fraction": 0.75,
                "recent_frames": 0,
                "close_gaps": False,
            },
        }
    )


def test_rules_match_by_role_kind_tool_tag_content_and_first():
    m = SegmentMatch(kind="tool_output", tool="run_*", content=r"FAILED")
    assert m.matches(seg("tool_output", tool="run_tests", text="1 FAILED"))
    assert not m.matches(seg("tool_output", tool="read_file", text="FAILED"))
    assert not m.matches(seg("tool_output", tool="run_tests", text="all passed"))
    assert SegmentMatch(tag=["keep", "x"]).matches(seg("text", tags=("keep",)))
    assert SegmentMatch(role=["user", "system"]).matches(seg("user", role="user"))
    first = SegmentMatch(role="user", first=True)
    a, b = seg("user", role="user", start=0), seg("user", role="user", start=5)
    assert first.matches(a, [a, b]) and not first.matches(b, [a, b])


def test_default_policy_protects_system_and_task_and_ranks_the_rest_by_surprisal_under_real_budgets():
    policy = default_policy()
    system, task, later = (
        seg("system", role="system", start=0),
        seg("user", role="user", start=10),
        seg("user", role="user", start=50),
    )
    log = seg("tool_output", role="tool", tool="run_tests", text="2 failed, 7 passed", start=80)
    segments = [system, task, later, log]
    assert policy.rule_for(system, segments).protected
    assert policy.rule_for(task, segments).protected
    for segment in (later, log):  # nothing is compacted before the cap requires it, then only as far
        rule = policy.rule_for(segment, segments)
        assert rule.target_slots(100) == 100
        assert rule.method == "real" and rule.params["inner"] == "selective_context"
    assert policy.budget.interval is None


@pytest.mark.parametrize(
    "data, field",
    [
        ({"default": {"method": "no_such_method"}}, "unknown method"),
        (
            {"default": {"method": "snapkv", "params": {"window": 0}}},
            "invalid parameters for compaction method .snapkv.",
        ),
        ({"default": {"ratio": 0.5}}, "default.ratio"),
        ({"rules": [{"match": {"kind": "banana"}}]}, "unknown segment kind"),
        ({"rules": [{"match": {"content": "(unclosed"}}]}, "invalid regular expression"),
        ({"default": {"query_source": "telepathy"}}, "unknown query source"),
        ({"default": {"max_slots": 2, "min_slots": 5}}, "below min_slots"),
        ({"budget": {"max_slots": -3}}, "budget.max_slots"),
        ({"budget": {"colour": "blue"}}, "budget.colour"),
    ],
)
def test_invalid_policies_fail_at_load_with_field_and_reason(data, field):
    with pytest.raises(PolicyError, match=field):
        MemoryPolicy.from_dict(data)


def test_policy_files_yaml_toml_json(tmp_path):
    yaml_file = tmp_path / "p.yaml"
    yaml_file.write_text(
        "rules:\n  - name: task\n    match: {role: user, first: true}\n    protected: true\nbudget:\n  max_slots: 512\n"
    )
    toml_file = tmp_path / "p.toml"
    toml_file.write_text(
        '[budget]\nmax_slots = 512\n[[rules]]\nname = "logs"\nratio = 10\n[rules.match]\ntool = "pytest"\n'
    )
    json_file = tmp_path / "p.json"
    json_file.write_text(json.dumps({"budget": {"max_slots": 512}}))
    for f in (yaml_file, toml_file, json_file):
        assert MemoryPolicy.from_file(f).budget.max_slots == 512
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules: [unclosed")
    with pytest.raises(PolicyError, match="cannot parse"):
        MemoryPolicy.from_file(bad)
    with pytest.raises(PolicyError, match="not found"):
        MemoryPolicy.from_file(tmp_path / "missing.yaml")


def protected_slots(session, segment_id):
    out = []
    for layer in session.cache.layers:
        mask = layer.segments[0, : layer.length] == segment_id
        out.append(
            (
                layer.keys[0, :, : layer.length][:, mask].clone(),
                layer.values[0, :, : layer.length][:, mask].clone(),
                layer.bias[0, :, : layer.length][:, mask].clone(),
                layer.positions[:, : layer.length][:, mask].clone(),
            )
        )
    return out


def test_cap_protection_and_recall_in_a_long_session():
    engine = Engine(tiny_model("llama"))
    manager = MemoryManager(small_policy(max_slots=160))
    session = engine.session(memory=manager, prefill_chunk_size=32)
    system = session.append_tokens(random_tokens(20), kind="system", role="system")
    before = protected_slots(session, system.id)
    outputs = []
    for i in range(10):
        outputs.append(
            session.append_tokens(random_tokens(40 + 9 * i, seed=i), kind="tool_output", tool_name="run_tests")
        )
        assert session.cache.slots_per_head <= 160
        session.generate(max_new_tokens=4)
        assert session.cache.slots_per_head <= 160
    assert manager.peak_slots <= 160 and session.cache.compactions > 0
    after = protected_slots(session, system.id)
    assert all(torch.equal(a, b) for x, y in zip(before, after) for a, b in zip(x, y))
    assert session.segment(outputs[0].id).compactions > 0
    assert sum(1 for e in session.compaction_log if e["trigger"] == "cap") > 0
    # other segments' slots are never moved by a segment's compaction: positions stay sorted per head
    for layer in session.cache.layers:
        pos = layer.positions[:, : layer.length]
        real = pos >= 0
        for h in range(pos.shape[0]):
            p = pos[h][real[h]]
            assert bool((p[1:] > p[:-1]).all())


def test_a_fork_with_memory_keeps_the_cap_and_leaves_the_original_alone(tiny_engine):
    session = tiny_engine.session(memory=MemoryManager(small_policy(max_slots=160)), prefill_chunk_size=32)
    session.append_tokens(random_tokens(20), kind="system")
    session.append_tokens(random_tokens(130, seed=1), kind="tool_output", tool_name="run_tests")
    tokens, slots, timeline = list(session.tokens), session.cache.slots_per_head, len(session.memory.timeline)
    capped, free = session.fork(with_memory=True), session.fork()
    for fork in (capped, free):
        fork.append_tokens(random_tokens(120, seed=2), kind="tool_output", tool_name="run_tests")
    assert capped.cache.slots_per_head <= 160 and capped.memory is not session.memory
    assert free.memory is None and free.cache.slots_per_head == slots + 120
    assert (
        session.tokens == tokens and session.cache.slots_per_head == slots and len(session.memory.timeline) == timeline
    )


def test_recall_restores_the_exact_text(tiny_engine):
    session = tiny_engine.session(memory=MemoryManager(small_policy(max_slots=400)))
    session.append_tokens(random_tokens(10), kind="system")
    out = session.append_tokens(
        random_tokens(200, seed=3), kind="tool_output", tool_name="run_tests", text="ORIGINAL LOG TEXT 42"
    )
    session.append_tokens(random_tokens(30, seed=4))
    session.memory.compact()
    assert session.segment(out.id).compactions == 1 and session.segment_slots()[out.id] < 200
    recalled = session.recall(out.id)
    assert recalled.kind == "recall" and "ORIGINAL LOG TEXT 42" in recalled.text
    assert session.export_transcript()[out.id]["text"] == "ORIGINAL LOG TEXT 42"


def test_search_ranks_segments_by_the_terms_they_share_with_the_query(tiny_engine):
    session = tiny_engine.session(memory=MemoryManager(small_policy(max_slots=400)))
    texts = [
        "DATABASE_PORT = 5433\nAPI_TIMEOUT_SECONDS = 17",
        "3 passed, 1 failed in 0.2s: test_restock",
        "Maintainer: Ilse Marchetti. Run the tests with pytest.",
    ]
    outs = [
        session.append_tokens(random_tokens(40, seed=i), kind="tool_output", tool_name="read_file", text=t)
        for i, t in enumerate(texts)
    ]
    session.append_tokens(random_tokens(40, seed=9), kind="assistant", text="the restock test failed")
    session.memory.compact()
    assert [s.id for s in session.search("Which test failed? test_restock", kinds=["tool_output"])] == [outs[1].id]
    assert session.search("who is the maintainer")[0].id == outs[2].id
    assert session.search("what is api_timeout_seconds")[0].id == outs[0].id
    assert session.search("zebra crossing") == []
    session.recall(outs[0].id)  # a recall repeats the text but is never a hit itself
    assert [s.id for s in session.search("DATABASE_PORT", limit=5)] == [outs[0].id]


def test_context_queries_are_released_once_their_segment_is_compacted(tiny_engine):
    session = tiny_engine.session(
        memory=MemoryManager(small_policy(max_slots=None, query_source=["window", "context"]))
    )
    recorder = session.query_recorder
    old = session.append_tokens(random_tokens(120, seed=1), kind="tool_output", tool_name="read_file")
    assert old.id in recorder.context and recorder.context[old.id][0].dtype == torch.bfloat16
    held = session.stats().query_bytes
    assert held > 0
    session.append_tokens(random_tokens(40, seed=2))
    session.memory.compact()
    assert session.segment(old.id).compactions == 1 and old.id not in recorder.context
    assert session.stats().query_bytes < held
    session.memory.compact(goal_slots=60)  # re-compaction falls back to the selector window
    assert session.segment(old.id).compactions == 2 and session.cache.slots_per_head <= 60


def test_a_cap_below_the_protected_content_raises_before_any_change(tiny_engine):
    session = tiny_engine.session(memory=MemoryManager(small_policy(max_slots=60)))
    session.append_tokens(random_tokens(30), kind="system")
    state = (list(session.tokens), len(session.segments), session.cache.slots_per_head)
    with pytest.raises(MemoryCapError, match="cap of 60"):
        session.append_tokens(random_tokens(40, seed=2), kind="system")
    assert state == (list(session.tokens), len(session.segments), session.cache.slots_per_head)


def test_periodic_trigger_compacts_every_interval(tiny_engine):
    manager = MemoryManager(small_policy(max_slots=None, interval=100))
    session = tiny_engine.session(memory=manager)
    for i in range(5):
        session.append_tokens(random_tokens(60, seed=i), kind="tool_output", tool_name="run_x")
    periodic = [e for e in session.compaction_log if e["trigger"] == "periodic"]
    assert periodic and session.cache.slots_per_head < len(session.tokens)


def test_memory_map_plot(tmp_path, tiny_engine):
    manager = MemoryManager(small_policy(max_slots=120))
    session = tiny_engine.session(memory=manager)
    for i in range(4):
        session.append_tokens(random_tokens(50, seed=i), kind="tool_output", tool_name="run_x")
    assert any(event["event"] == "cap" for event in manager.timeline)
    for event in manager.timeline:  # the map stacks each segment's slots: together they are the cache
        assert sum(event["segments"].values()) == pytest.approx(event["physical"], abs=1)
        assert event["physical"] <= 120
    path = plot_memory_map(manager.timeline, session.segments, tmp_path / "map.png", cap=120)
    import matplotlib.image

    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (495, 1100) and float(image[..., :3].std()) > 0.05  # drawn, not blank


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["tool", "user", "gen", "recall"]), st.integers(5, 90)), min_size=4, max_size=12
    ),
    cap=st.integers(120, 260),
)
def test_cap_is_never_exceeded_in_random_sessions(ops, cap):
    engine = _ENGINE
    manager = MemoryManager(small_policy(max_slots=cap))
    session = engine.session(memory=manager, prefill_chunk_size=24)
    session.append_tokens(random_tokens(12), kind="system")
    for i, (op, n) in enumerate(ops):
        if op == "tool":
            session.append_tokens(random_tokens(n, seed=i), kind="tool_output", tool_name="run_tests")
        elif op == "user":
            session.append_tokens(random_tokens(n, seed=100 + i), kind="user", role="user")
        elif op == "gen":
            session.generate(max_new_tokens=min(n, 12))
        elif len(session.segments) > 1:
            session.recall(session.segments[1].id)
        assert session.cache.slots_per_head <= cap
        # nor is storage reserved past it: appends reserve no headroom beyond the room the cap leaves
        assert session.stats().allocated_bytes <= cap * session.cache.bytes_per_token()
    assert manager.peak_slots <= cap
    fork = session.fork(with_memory=True)
    assert fork.stats().allocated_bytes <= cap * fork.cache.bytes_per_token()


_ENGINE = Engine(tiny_model("llama", max_position_embeddings=4096))


def test_rule_target_slots():
    rule = CompactionRule(ratio=8, max_slots=50, min_slots=3)
    assert rule.target_slots(80) == 10 and rule.target_slots(1000) == 50 and rule.target_slots(8) == 3


def test_recompaction_keeps_each_segments_rule_ratio_unless_the_cap_forces_more():
    engine = Engine(tiny_model("llama", max_position_embeddings=4096))
    rules = {
        "rules": [{"match": {"kind": "tool_output"}, "method": "snapkv", "ratio": 20}],
        "default": {"method": "snapkv", "ratio": 4},
    }
    session = engine.session(memory=MemoryManager({**rules, "budget": {"interval": 200, "recent_tokens": 32}}))
    for i in range(10):
        session.append_tokens(random_tokens(150, seed=i), kind="tool_output" if i % 2 else "text")
        session.generate(max_new_tokens=5)
    segments = [s for s in session.stats().segments if s["compactions"]]
    assert len(segments) > 10
    for seg in segments:  # periodic passes never go below a rule's budget (one slot of rounding)
        limit = 20 if seg["kind"] == "tool_output" else 4
        assert seg["slots"] >= min(seg["tokens"], seg["tokens"] / limit) - 1 and seg["cap_forced"] == 0
    capped = engine.session(memory=MemoryManager({**rules, "budget": {"max_slots": 160, "recent_tokens": 16}}))
    for i in range(6):
        capped.append_tokens(random_tokens(150, seed=i), kind="tool_output" if i % 2 else "text")
    assert capped.cache.slots_per_head <= 160
    assert any(seg["cap_forced"] for seg in capped.stats().segments)


def test_hundreds_of_segments_share_floors_when_one_floor_each_no_longer_fits():
    engine = Engine(tiny_model("llama", max_position_embeddings=4096))
    policy = small_policy(max_slots=120, recent=16, min_slots=2)
    session = engine.session(memory=MemoryManager(policy))
    session.append_tokens(random_tokens(12), kind="system")
    appended = list(session.tokens)
    for i in range(90):  # 90 segments × 2-slot floors = 180 slots per head: more than the cap holds
        tokens = random_tokens(6, seed=i)
        session.append_tokens(tokens, kind="text")
        appended += tokens
        assert session.cache.slots_per_head <= 120
    assert session.tokens == appended
    old = [s for s in session.stats().segments[1:60]]
    assert all(s["cap_forced"] for s in old) and sum(s["slots"] for s in old) < 2 * len(old)


def test_a_capped_session_runs_far_past_the_trained_positions():
    """Logical positions are only indices: rebasing keeps RoPE positions bounded, so a capped session is
    not stopped at a multiple of the trained length."""
    engine = Engine(tiny_model("llama", max_position_embeddings=64))
    session = engine.session(memory=MemoryManager(small_policy(max_slots=48, recent=8)), prefill_chunk_size=8)
    for i in range(30):  # 600 tokens: over 9× the 64 trained positions
        session.append_tokens(random_tokens(20, seed=i), kind="text")
        assert session.cache.rope_length <= 64 + 8 and session.cache.slots_per_head <= 48
    assert len(session.tokens) == 600 and torch.isfinite(session.logprobs(random_tokens(3, seed=99))).all()
    fixed = Engine(tiny_model("llama", max_position_embeddings=64), rebase_positions=False)
    assert fixed.position_limit == 4 * 64
    unrotated = fixed.session(memory=MemoryManager(small_policy(max_slots=48, recent=8)), prefill_chunk_size=8)
    with pytest.raises(ContextLengthError, match="position limit of 256"):
        for i in range(30):
            unrotated.append_tokens(random_tokens(20, seed=i), kind="text")


def test_the_room_a_span_cannot_take_goes_to_the_others():
    """Under cap pressure the room is split by share, but a span already below its share keeps what it has
    and the rest goes to the others: the cap's budget is used, not wasted."""
    from kvmemory.memory.manager import _fill

    assert _fill(100, [1, 1, 1], [10, 100, 100], [1, 1, 1]) == [10, 45, 45]
    assert _fill(100, [1, 3], [100, 100], [1, 1]) == [25, 75]
    assert _fill(10, [1, 1], [100, 100], [8, 8]) == [8, 8]  # floors hold even past the room


@pytest.mark.filterwarnings("ignore:no head profile")  # a tiny model without a tokenizer: heads scored alike
def test_a_policy_without_a_cap_compacts_at_the_models_context():
    """The model's context is every manager's cap: a session under the default policy (no cap given) runs
    past it instead of stopping, and the cache never holds more than the model can attend to."""
    engine = Engine(tiny_model("llama", max_position_embeddings=96))
    session = engine.session(memory=MemoryManager(default_policy(recent_tokens=8)), prefill_chunk_size=8)
    for i in range(10):
        session.append_tokens(random_tokens(20, seed=i), kind="text")
        assert session.cache.slots_per_head <= 96
    assert len(session.tokens) == 200 and session.cache.compactions > 0


LINES = {"max_unit_tokens": 1}
HEAD_SCORES = [[0.1, 2.0], [3.0, 0.5]]


@pytest.mark.parametrize(
    "method, params",
    [
        ("selective_context", LINES),
        ("real", {"scores": HEAD_SCORES, "inner": "selective_context", "inner_params": LINES}),
    ],
)
def test_a_cap_pass_ranks_every_segment_on_one_scale(method, params):
    """Selective-context scores mean the same in every segment, so a cap-triggered pass gives all segments of
    the rule one selection: what stays is the highest-surprisal tokens wherever they are, in every head. REAL
    only moves budget between heads, so it ranks on its inner method's scale (the default policy's rule): each
    head then keeps its own count of the same ranking's top."""
    engine = Engine(tiny_model("llama"))
    policy = MemoryPolicy(
        default=CompactionRule(method=method, params=params),
        budget={"max_slots": 1000, "recent_tokens": 8, "sink_tokens": 4},
    )
    assert get_method(method, **params).global_scores and not get_method("real").global_scores  # SnapKV: per span
    session = engine.session(memory=MemoryManager(policy))
    for i in range(4):
        session.append_tokens(random_tokens(40, seed=i), kind="text")
    session.memory.compact(trigger="cap", goal_slots=80)
    (record,) = session.compaction_log
    assert record["segments"] == [0, 1, 2, 3]  # one selection over every segment
    compactable = range(4, len(session.tokens) - 8)
    surprisal = session.surprisal_recorder.values
    ranked = sorted(compactable, key=lambda p: -float(surprisal[p]))
    counts = []
    for layer in session.cache.layers:
        for positions in layer.head_views("positions"):
            held = sorted(p for p in positions.tolist() if p in compactable)
            assert held == sorted(ranked[: len(held)])
            counts.append(len(held))
    if method == "real":
        assert len(set(counts)) > 1  # the heads' budgets differ
    else:
        assert set(counts) == {80 - 12}  # every head of every layer keeps the same tokens


@pytest.mark.filterwarnings("ignore:no head profile")  # a tiny model without a tokenizer: heads scored alike
@pytest.mark.parametrize("close_gaps", [True, False])
def test_the_default_policy_closes_the_gaps_its_compactions_leave(tiny_engine, close_gaps):
    policy = default_policy(max_slots=64, recent_tokens=8)
    policy.budget.close_gaps = close_gaps
    session = tiny_engine.session(memory=MemoryManager(policy))
    for i in range(6):
        session.append_tokens(random_tokens(40, seed=i), kind="text")
    assert session.cache.compactions > 0 and session.cache.slots_per_head <= 64
    for layer in session.cache.layers:
        for rope, positions in zip(layer.head_views("rope"), layer.head_views("positions")):
            consecutive = torch.equal(rope.long(), torch.arange(len(rope)))
            assert consecutive == close_gaps  # the kept slots sit side by side, or at their original distances
            assert positions[-1] == 239 and bool((positions[1:] > positions[:-1]).all())  # true positions stay
    assert torch.isfinite(session.logprobs(random_tokens(5, seed=99))).all()


def test_the_default_policy_runs_retrieval_lines_under_real_within_its_byte_cap(tiny_engine):
    """The swap the README offers: the default policy's rule on REAL with ``retrieval_lines`` inside. The
    memory manager switches on the surprisal it reads, holds the byte cap and closes each head's gaps."""
    scores = [[0.1, 2.0], [3.0, 0.5]]
    rule = CompactionRule(
        name="context",
        method="real",
        params={"scores": scores, "inner": "retrieval_lines", "inner_params": {"scores": scores}},
    )
    policy = default_policy(recent_tokens=8)
    policy = policy.model_copy(update={"default": rule})
    policy.budget.max_bytes = 64 * tiny_engine.kv_bytes_per_token
    session = tiny_engine.session(memory=MemoryManager(policy))
    for i in range(6):
        session.append_tokens(random_tokens(40, seed=i), kind="text")
        assert session.stats().kv_bytes <= policy.budget.max_bytes
    assert session.cache.compactions > 0 and session.surprisal_recorder is not None
    ropes = [rope.long() for layer in session.cache.layers for rope in layer.head_views("rope")]
    assert len({len(rope) for rope in ropes}) > 1  # REAL's budgets: heads of different lengths
    for rope in ropes:  # each head's gaps closed: consecutive, its newest slot where every head's is
        assert torch.equal(rope, torch.arange(len(rope)) + int(ropes[0][-1]) + 1 - len(rope))
    assert torch.isfinite(session.logprobs(random_tokens(5, seed=99))).all()


@pytest.mark.parametrize("cap", [40, 64, 96])
def test_uneven_head_budgets_never_grow_a_head_past_the_models_context(cap):
    """REAL gives its pool to the heads its profile scores high; compacted again and again, such a head kept
    everything it held until it attended over more positions than the model was trained on (a 25k-token
    agent session ended in ContextLengthError). The manager bounds each head at context/cap × a span's mean
    budget, which keeps every head within the context however the cap's mean moves (at a cap of the whole
    context, no head may keep more than the mean)."""
    engine = Engine(tiny_model("llama", max_position_embeddings=96))
    skewed = [[1.0, 0.0], [0.0, 0.0]]  # one of the four KV heads gets the whole pool
    policy = small_policy(max_slots=cap, recent=8)
    policy = policy.model_copy(
        update={"default": policy.default.model_copy(update={"method": "real", "params": {"scores": skewed}})}
    )
    session = engine.session(memory=MemoryManager(policy), prefill_chunk_size=8)
    for i in range(40):  # 800 tokens, over 8× the context
        session.append_tokens(random_tokens(20, seed=i), kind="text")
        assert session.cache.longest_head <= engine.max_context
        assert session.cache.slots_per_head <= cap
    uneven = session.cache.longest_head > session.cache.slots_per_head
    assert uneven == (cap < engine.max_context)  # a cap at the context leaves no head room above the mean
    assert torch.isfinite(session.logprobs(random_tokens(8, seed=99))).all()


def test_the_default_policy_keeps_the_chat_frames_of_the_last_messages(small_engine):
    """The role header and end of turn of each of the last ``recent_frames`` messages survive compaction, while
    their content is compacted around them: the model still reads whose turn is next."""
    renderer = small_engine.renderer
    assert renderer.frame("assistant") == (4, 2) and renderer.frame("tool") == (3, 2)  # ChatML, SmolLM2's tokens
    policy = default_policy(max_slots=192, recent_tokens=16)
    assert policy.budget.recent_frames == 4
    session = small_engine.session(memory=MemoryManager(policy))
    messages = [{"role": "system", "content": "You maintain the billing service."}]
    for i in range(8):
        lines = [f"line {j} of file {i}: value {(i * 37 + j * 11) % 97} at port {8000 + i * 13 + j}" for j in range(5)]
        messages.append({"role": "assistant", "content": f"Reading file {i}."})
        messages.append({"role": "tool", "name": "read_file", "content": "\n".join(lines)})
        if i % 2:
            session.append_messages(messages)
    assert session.cache.compactions > 0
    heads = [set(p.tolist()) for layer in session.cache.layers for p in layer.head_views("positions")]
    assert len({len(held) for held in heads}) > 1  # REAL's profile gives the heads different counts
    last = [s for s in session.segments if s.message_index is not None][-4:]
    for segment in last:
        head, tail = renderer.frame(segment.role)
        frame = list(range(segment.start, segment.start + head)) + list(range(segment.end - tail, segment.end))
        assert all(set(frame) <= held for held in heads)  # in every head, however few slots it keeps
        text = small_engine.tokenizer.decode(session.tokens[segment.start : segment.start + head])
        assert text == f"<|im_start|>{segment.role}\n"
    content = set().union(*(range(s.start, s.end) for s in last))
    assert all(not content <= held for held in heads)  # their content was compacted around them


def test_a_template_that_will_not_render_a_role_after_a_user_gives_it_no_frame(small_engine):
    tokenizer = copy.copy(small_engine.tokenizer)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    renderer = ChatRenderer(tokenizer)
    assert renderer.frame("tool") == (0, 0) and renderer.frame("assistant") == (4, 2)
    assert renderer.turn_end() == small_engine.renderer.turn_end()


@pytest.mark.parametrize("measure", [False, True])
def test_a_compaction_times_its_pause_and_measures_its_error_only_when_asked(tiny_engine, measure):
    """Each compaction's timeline entry carries the seconds it held the session (what a user waits); the
    attention-output error, which costs more than a fast method's compaction, is measured only on request."""
    policy = small_policy(max_slots=160)
    policy.budget.measure_error = measure
    session = tiny_engine.session(memory=MemoryManager(policy), prefill_chunk_size=32)
    started = time.perf_counter()
    for i in range(6):
        session.append_tokens(random_tokens(60, seed=i), kind="tool_output", tool_name="run_tests")
    wall = time.perf_counter() - started
    compactions = [e for e in session.memory.timeline if e["event"] != "append"]
    assert compactions and all(e["seconds"] > 0 for e in compactions)
    assert sum(e["seconds"] for e in compactions) < wall
    assert all("seconds" not in e for e in session.memory.timeline if e["event"] == "append")
    errors = [record["reconstruction_error"] for record in session.compaction_log]
    assert errors and all((error is not None) == measure for error in errors)


def test_compacting_a_session_with_nothing_cached_changes_nothing(tiny_engine):
    session = tiny_engine.session(memory=MemoryManager(small_policy()))
    assert session.memory.compact() == [] and session.memory.compact(trigger="cap", goal_slots=1) == []
    assert session.memory.timeline == [] and session.compaction_log == []


def test_spans_count_the_slots_and_attention_of_exactly_their_positions():
    """After compactions under uneven head budgets, each segment's span holds the mean slots per head whose
    positions lie in it, and the room a cap pass shares follows the attention the window queries give exactly
    those positions (a joined span's gaps, which hold other segments, count for those)."""
    engine = Engine(tiny_model("llama", max_position_embeddings=4096))
    skewed = [[1.0, 0.2], [0.1, 0.5]]
    policy = MemoryPolicy.from_dict(
        {
            "rules": [{"match": {"kind": "tool_output"}, "method": "real", "params": {"scores": skewed}, "ratio": 4}],
            "default": {"method": "snapkv", "ratio": 3},
            "budget": {"max_slots": 1024, "interval": 150, "recent_tokens": 16, "window": 8},
        }
    )
    session = engine.session(memory=MemoryManager(policy))
    for i in range(5):
        session.append_tokens(random_tokens(80, seed=i), kind="tool_output" if i % 2 else "text")
    layers = session.cache.layers
    assert len({len(p) for layer in layers for p in layer.head_views("positions")}) > 1  # uneven heads
    spans = session.memory._spans()
    heads = len(layers) * layers[0].num_heads
    for span in spans:
        held = sum(int(torch.isin(layer.positions[:, : layer.length], span.positions).sum()) for layer in layers)
        assert span.current == held / heads
    joined = [spans[0], _joined([spans[1], spans[3]]), spans[2]]
    mass = torch.zeros(len(joined), dtype=torch.float64)
    recorder = session.query_recorder
    for li, layer in enumerate(layers):
        keys = layer.keys[0, :, : layer.length]
        logits = torch.einsum("hmd,hsd->hms", recorder.window_queries(li), keys) * engine.head_dim**-0.5
        attn = torch.softmax(logits + layer.bias[0, :, None, : layer.length], -1).mean(1)
        for i, span in enumerate(joined):
            mass[i] += float(attn[torch.isin(layer.positions[:, : layer.length], span.positions)].sum())
    expected = (mass / mass.sum()).tolist()
    assert session.memory._importance(joined) == pytest.approx(expected, rel=1e-5)
    assert session.memory._importance(joined[:1]) == [1.0]


# ---- one default ---------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:no head profile")  # a tiny model without a tokenizer: heads scored alike
def test_a_policy_written_from_scratch_compacts_as_the_default_policy_does():
    """Every field default is the default policy's choice: with no protected segment in the session, a bare
    ``MemoryPolicy`` under the same cap, and one naming each of the default's choices, leave the same cache,
    bit for bit."""

    engine = Engine(tiny_model("llama", max_position_embeddings=4096))
    sessions = []
    lines = {"inner": "selective_context", "inner_params": {"evict_predictable_below": 1.0}}
    spelled_out = MemoryPolicy(
        default=CompactionRule(name="context", method="real", params=lines),
        budget=MemoryBudget(max_slots=256, recent_tokens=128, recent_frames=4, target_fraction=0.95, close_gaps=True),
    )
    for policy in (default_policy(max_slots=256), MemoryPolicy(budget=MemoryBudget(max_slots=256)), spelled_out):
        session = engine.session(memory=MemoryManager(policy))
        for i in range(12):
            session.append_tokens(random_tokens(60, seed=i), kind="text")
        sessions.append(session)
    assert sessions[0].compaction_log and sessions[0].cache.slots_per_head <= 256
    assert_same_state(state_of(sessions[0]), state_of(sessions[1]))
    assert_same_state(state_of(sessions[0]), state_of(sessions[2]))


def test_a_policy_file_extends_the_default_and_replaces_a_rule_by_name(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "extends: default\n"
        "rules:\n"
        "  - {name: task, match: {role: user, first: true}, ratio: 2}  # the task may be compacted after all\n"
        "  - {name: logs, match: {tool: run_*}, method: snapkv, ratio: 12}\n"
        "budget: {max_slots: 512}\n"
    )
    policy = MemoryPolicy.from_file(path)
    default = default_policy(max_slots=512)
    assert [r.name for r in policy.rules] == ["system", "task", "logs"]
    assert policy.rules[0] == default.rules[0] and not policy.rules[1].protected and policy.rules[1].ratio == 2
    assert policy.rules[2].method == "snapkv" and policy.rules[2].params == {}  # a named method: its own defaults
    assert policy.default == default.default and policy.budget == default.budget
    with pytest.raises(PolicyError, match="only 'default' can be extended"):
        MemoryPolicy.from_dict({"extends": "fast"})


def test_the_policy_that_never_compacts_refuses_what_would_not_fit():
    engine = Engine(tiny_model("llama"))
    session = engine.session(
        memory=MemoryManager(MemoryPolicy.never().model_copy(update={"budget": MemoryBudget(max_slots=64)}))
    )
    session.append_tokens(random_tokens(60), kind="text")
    before = list(session.tokens)
    with pytest.raises(MemoryCapError):
        session.append_tokens(random_tokens(10, seed=2), kind="text")
    assert session.tokens == before and not session.compaction_log


def test_the_example_policy_file_loads_over_the_default():
    from pathlib import Path

    policy = MemoryPolicy.from_file(Path(__file__).parents[1] / "examples" / "custom_policy.yaml")
    assert [r.name for r in policy.rules][:2] == ["system", "task"] and policy.budget.max_slots


def test_a_session_records_window_queries_only_where_its_policy_reads_them(tiny_engine):
    """The selector-window queries cost every session memory for as long as it lives. The default policy never
    reads them (one ranking by surprisal, one selection), so its sessions hold none; a method ranking by queries
    reads them, and so does sharing room between two rules by their attention. A manual compaction by a
    query method on a session without them reads its last tokens again for their queries."""

    def policy(*methods):
        rules = [{"name": f"r{i}", "match": {"role": "tool"}, "method": m} for i, m in enumerate(methods[1:])]
        return MemoryPolicy.from_dict({"rules": rules, "default": {"method": methods[0]}})

    held = {}
    for name, chosen in {
        "default": default_policy(max_slots=4096),
        "snapkv": policy("snapkv"),
        "two rules": policy("selective_context", "selective_context"),
    }.items():
        session = tiny_engine.session(memory=MemoryManager(chosen))
        session.append_tokens(random_tokens(80), kind="tool_output", tool_name="run_tests", role="tool")
        held[name] = session.stats().query_bytes
        if name == "default":
            record = session.compact(method="snapkv", ratio=2, keep_last=8)
            assert record.slots_after < record.slots_before and session.stats().query_bytes == 0
    assert held["default"] == 0 and held["snapkv"] > 0 and held["two rules"] > 0
