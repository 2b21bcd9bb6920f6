"""The CPU decode attention kernel computes what attention defines, on every cache shape and storage dtype,
and a session decodes the same with it as on sdpa, alone and batched."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmemory import Engine
from kvmemory.attention import decode_kernel
from kvmemory.cache import int8_rows
from kvmemory.cache.compact_cache import CompactCache
from kvmemory.cache.compact_layer import CompactLayer, LayerState, Slots
from kvmemory.runtime import batching
from tests.conftest import random_tokens, tiny_model
from tests.test_batching import KINDS, build, run_together, slow_passes

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def reference(query, sessions, scale):
    """softmax(scale·q·k + β)·v per query head in fp64, from each head's keys, values and β as stored (8-bit
    rows decoded)."""
    out = []
    for i, heads in enumerate(sessions):
        groups = query.shape[1] // len(heads)
        rows = []
        for h, (k, v, bias) in enumerate(heads):
            q = query[0, h * groups : (h + 1) * groups, i].double()
            k, v = (int8_rows.read(t, torch.float64) for t in (k, v))
            logits = scale * q @ k.T
            if bias is not None:
                logits = logits + bias.double()
            rows.append(logits.softmax(-1) @ v)
        out.append(torch.cat(rows))
    return torch.stack(out)[None].float()


@st.composite
def layers(draw):
    """Sessions of one layer: per KV head its own length (ragged or even), a storage dtype, β or none, and
    whether the kernel writes each head's last row itself (a decode step's new token)."""
    kv_heads, groups = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    dim = draw(st.sampled_from([8, 16, 40, 64, 128]))  # value chunks: 8-float tails, 32-float blocks, both
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8]))
    count = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    lengths = st.integers(1, 300)
    shapes = [
        [draw(lengths)] * kv_heads
        if draw(st.booleans())
        else draw(st.lists(lengths, min_size=kv_heads, max_size=kv_heads))
        for _ in range(count)
    ]
    biased = [draw(st.booleans()) for _ in range(count)]
    return kv_heads, groups, dim, dtype, shapes, biased, draw(st.booleans()), seed


def cache_layer(keys, values, bias, spare: int) -> CompactLayer:
    """A real cache layer holding these heads (rows as stored), each followed by ``spare`` unused rows."""
    lengths = tuple(len(k) for k in keys)
    capacities = tuple(n + spare for n in lengths)
    starts = tuple(sum(capacities[:h]) for h in range(len(keys)))
    rows, dim, dtype = sum(capacities), keys[0].shape[-1], keys[0].dtype
    slots = Slots(
        torch.zeros(rows, dim, dtype=dtype),
        torch.zeros(rows, dim, dtype=dtype),
        torch.zeros(rows, 4, dtype=torch.int32),
    )
    for h, (start, n) in enumerate(zip(starts, lengths)):
        slots.keys[start : start + n] = keys[h]
        slots.values[start : start + n] = values[h]
        if bias is not None:
            slots.bias[start : start + n] = bias[h]
    layer = CompactLayer()
    layer.restore(LayerState(slots, starts, capacities, lengths, (0,) * len(keys), bias is not None))
    return layer


@settings(max_examples=80, deadline=None)
@given(layers())
def test_the_kernel_computes_attention_on_every_cache_shape(layer):
    kv_heads, groups, dim, dtype, shapes, biased, writes, seed = layer
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, kv_heads * groups, len(shapes), dim, generator=generator)
    new_keys = torch.randn(1, kv_heads, len(shapes), dim, generator=generator)  # fp32, as the model hands them
    # the values as the model hands them too: a head-major view of token-major rows (the kernel reads strides)
    new_values = torch.randn(1, len(shapes), kv_heads, dim, generator=generator).transpose(1, 2)
    new_meta = torch.randint(0, 2**20, (len(shapes), 4), generator=generator, dtype=torch.int32)
    new_meta[:, 0] = 0  # a new token's β
    cache_layers, heads = [], []
    for i, (lengths, has_bias) in enumerate(zip(shapes, biased)):
        keys = [int8_rows.store(torch.randn(n, dim, generator=generator), dtype) for n in lengths]
        values = [int8_rows.store(torch.randn(n, dim, generator=generator), dtype) for n in lengths]
        bias = [torch.randn(n, generator=generator) * 3 for n in lengths] if has_bias else None  # fitted β
        if writes:  # the last row of each head comes from the new token, written by the kernel
            new = [(int8_rows.store(new_keys[0, h, i, None], dtype), int8_rows.store(new_values[0, h, i, None], dtype))
                   for h in range(kv_heads)]  # fmt: skip
            keys = [torch.cat([k[:-1], new[h][0]]) for h, k in enumerate(keys)]
            values = [torch.cat([v[:-1], new[h][1]]) for h, v in enumerate(values)]
            bias = None if bias is None else [torch.cat([b[:-1], torch.zeros(1)]) for b in bias]
            held = cache_layer([k[:-1] for k in keys], [v[:-1] for v in values], bias and [b[:-1] for b in bias], i)
            held.claim(1)  # grows the storage where there is no spare row (i = 0)
        else:
            held = cache_layer(keys, values, bias, spare=i * 5)
        cache_layers.append(held)
        heads.append([(k, v, None if bias is None else bias[h]) for h, (k, v) in enumerate(zip(keys, values))])
    new_rows = (new_keys, new_values, new_meta) if writes else None
    out = decode_kernel.decode_attention(query, cache_layers, dim**-0.5, new_rows)
    assert out.shape == (1, len(shapes), kv_heads * groups, dim)
    torch.testing.assert_close(out, reference(query, heads, dim**-0.5), atol=2e-6, rtol=1e-5)
    if writes:  # exactly the rows the cache would have written: rounded to the storage dtype, or encoded
        for i, held in enumerate(cache_layers):
            for h, (start, n) in enumerate(zip(held.starts, held.lengths)):
                assert torch.equal(held.slots.keys[start + n - 1], heads[i][h][0][-1])
                assert torch.equal(held.slots.values[start + n - 1], heads[i][h][1][-1])
                assert torch.equal(held.slots.meta[start + n - 1], new_meta[i])


def test_bad_input_is_refused_before_any_work():
    op = decode_kernel.decode_op()
    # one session, one KV head of two query heads: query (Hq, sessions, D), new rows (KV heads, sessions, D)
    query, meta, rows = torch.randn(2, 1, 8), [torch.zeros(5, 4, dtype=torch.int32)], torch.randn(1, 1, 8)
    with pytest.raises(RuntimeError, match="not inside its storage"):
        op(query, 0.5, [torch.randn(5, 8)], [torch.randn(5, 8)], meta, [False], [3, 4])
    with pytest.raises(RuntimeError, match="mixed cache dtypes"):
        op(query, 0.5, [torch.randn(5, 8)], [torch.randn(5, 8).half()], meta, [False], [0, 5])
    with pytest.raises(RuntimeError, match="multiples of 8"):
        op(torch.randn(2, 1, 6), 0.5, [torch.randn(5, 6)], [torch.randn(5, 6)], meta, [False], [0, 5])
    with pytest.raises(RuntimeError, match="query must be"):
        op(torch.randn(2, 2, 8), 0.5, [torch.randn(5, 8)], [torch.randn(5, 8)], meta, [False], [0, 5])
    with pytest.raises(RuntimeError, match="come together"):
        op(query, 0.5, [torch.randn(5, 8)], [torch.randn(5, 8)], meta, [False], [0, 5], rows)
    with pytest.raises(RuntimeError, match="new_keys and new_values must be"):
        op(query, 0.5, [torch.randn(5, 8)], [torch.randn(5, 8)], meta, [False], [0, 5], rows[0], rows, meta[0][:1])
    with pytest.raises(RuntimeError, match="new_meta must be"):
        op(query, 0.5, [torch.randn(5, 8)], [torch.randn(5, 8)], meta, [False], [0, 5], rows, rows, meta[0])


@pytest.fixture
def kernel_calls(monkeypatch) -> list:
    """Counts the kernel's calls, so a test knows the engine really decoded on it."""
    calls, attention = [], decode_kernel.decode_attention

    def counted(*args):
        calls.append(len(args[1]))
        return attention(*args)

    monkeypatch.setattr(decode_kernel, "decode_attention", counted)
    return calls


def paired_engines(kv_dtype=None) -> tuple[Engine, Engine]:
    """(kernel decode, sdpa everywhere) over the same weights."""
    model = tiny_model("qwen2", eos_token_id=None)
    return Engine(model, kv_dtype=kv_dtype), Engine(model, attention_path="mask", kv_dtype=kv_dtype)


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16", "int8"])
@pytest.mark.parametrize("shape", KINDS)
def test_a_session_decodes_the_same_on_the_kernel_as_on_sdpa(shape, kv_dtype, kernel_calls):
    results = []
    for engine in paired_engines(kv_dtype):
        kernel_calls.clear()
        session = build(engine, shape)
        reply = session.generate(max_new_tokens=12)
        results.append((reply.token_ids, session.logprobs(random_tokens(6, seed=7))))
        assert bool(kernel_calls) == (engine.batcher.attention_path is None)
    (kernel_ids, kernel_scores), (sdpa_ids, sdpa_scores) = results
    assert kernel_ids == sdpa_ids
    torch.testing.assert_close(kernel_scores, sdpa_scores, atol=1e-5, rtol=0)


def test_batched_sessions_decode_the_same_on_the_kernel_as_on_sdpa(kernel_calls):
    replies = []
    for engine in paired_engines():
        sessions = [build(engine, kind) for kind in KINDS]
        slow_passes(engine)
        replies.append(run_together(sessions, lambda s: s.generate(max_new_tokens=10).token_ids))
        assert engine.batcher.stats.largest > 1
    assert max(kernel_calls) > 1  # sessions shared a kernel call
    assert replies[0] == replies[1]


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16", "int8"])
def test_the_kernel_writes_a_decode_step_as_the_cache_would(monkeypatch, kv_dtype):
    """A decode step's rows written by the kernel (``PackedCache.kernel_writes``) leave every cache shape
    bit-identical to rows written by ``CompactLayer.update`` and then read by the same kernel. Sessions run
    one after another: batched, a row's linear layers could round differently with the pass's row count
    (several sessions per kernel call are checked bit for bit in the property test above)."""
    model, runs, claims = tiny_model("qwen2", eos_token_id=None), [], []
    claim, made = CompactCache.claim, batching.PackedCache.__init__
    monkeypatch.setattr(CompactCache, "claim", lambda self, *a: claims.append(1) or claim(self, *a))

    def updates_instead(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.kernel_writes = False

    for writes in (True, False):
        if not writes:
            monkeypatch.setattr(batching.PackedCache, "__init__", updates_instead)
        engine = Engine(model, kv_dtype=kv_dtype)
        sessions = [build(engine, kind) for kind in KINDS]
        claims.clear()
        replies = [s.generate(max_new_tokens=10).token_ids for s in sessions]
        assert bool(claims) == writes
        runs.append((replies, [[layer.snapshot().live() for layer in s.cache.layers] for s in sessions]))
    (replies, caches), (expected_replies, expected_caches) = runs
    assert replies == expected_replies
    for layers, expected in zip(caches, expected_caches):
        for live, want in zip(layers, expected):
            assert all(torch.equal(a, b) for a, b in zip(live, want))
