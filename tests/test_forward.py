"""The engine's forward pass: the direct layer loop computes what transformers' own forward computes, on
every supported architecture and cache shape, and fusing the projections changes no weight."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from kvmemory import Engine
from kvmemory.runtime.forward import DirectForward, TransformersForward
from kvmemory.runtime.weights import store_linear_weights
from tests.conftest import random_tokens, tiny_model
from tests.test_batching import build, run_together, slow_passes

SHAPES = ("plain", "matched", "uneven", "capped")


def engines(model) -> tuple[Engine, Engine]:
    """(the direct loop, transformers' forward) over the same weights; a hook makes the second fall back."""
    hooked = copy.deepcopy(model)
    hooked.model.layers[0].register_forward_hook(lambda *args: None)
    direct, transformers_forward = Engine(model), Engine(hooked)
    assert isinstance(direct.batcher.forward, DirectForward)
    assert isinstance(transformers_forward.batcher.forward, TransformersForward)
    return direct, transformers_forward


@pytest.mark.parametrize("shape", SHAPES)
def test_direct_forward_equals_transformers_on_every_cache_shape(arch, shape):
    results = []
    for engine in engines(tiny_model(arch, eos_token_id=None)):
        session = build(engine, shape)
        scored = session.logprobs(random_tokens(9, seed=5))
        reply = session.generate(max_new_tokens=10).token_ids
        results.append((scored, reply, session.cache.layers[-1].keys.clone()))
    (a_scored, a_reply, a_keys), (b_scored, b_reply, b_keys) = results
    torch.testing.assert_close(a_scored, b_scored, atol=1e-5, rtol=0)
    assert a_reply == b_reply
    torch.testing.assert_close(a_keys, b_keys, atol=1e-5, rtol=0)


def test_packed_passes_and_last_layer_inputs_match_transformers():
    recorded = []
    for engine in engines(tiny_model("qwen2")):
        sessions = [engine.session() for _ in range(3)]
        for session in sessions:
            session.record_last_layer_inputs()
        slow_passes(engine)
        prompts = [random_tokens(n, seed=n) for n in (7, 12, 30)]
        run_together(list(zip(sessions, prompts)), lambda pair: pair[0].append_tokens(pair[1]))
        assert engine.batcher.stats.largest > 1
        stores = [s.hidden_recorder.store for s in sessions]
        recorded.append([torch.stack([store[p] for p in sorted(store)]) for store in stores])
    for a, b in zip(*recorded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_a_wrapped_module_keeps_transformers_forward():
    model = tiny_model("llama")
    mlp = model.model.layers[1].mlp
    mlp.forward = functools.partial(type(mlp).forward, mlp)  # as accelerate's add_hook_to_module wraps it
    assert isinstance(Engine(model).batcher.forward, TransformersForward)


def test_biased_projections_fuse_with_their_biases():
    model = tiny_model("llama", attention_bias=True, mlp_bias=True)  # every projection has a bias
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_()  # initialised to zero
    results = []
    for engine in engines(model):
        session = build(engine, "matched")
        results.append(session.logprobs(random_tokens(9, seed=6)))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("weights", ["fp32", "bf16"])
def test_fused_projections_share_the_weights_they_fuse(weights):
    model = store_linear_weights(tiny_model("qwen2"), weights)  # q, k and v carry biases
    before = {name: p.clone() for name, p in model.named_parameters()}
    reference_logits = model(torch.tensor([random_tokens(12)])).logits
    engine = Engine(model)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys() and all(torch.equal(before[n], after[n]) for n in before)
    attention = model.model.layers[0].self_attn
    pointers = [attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]
    assert len({p.untyped_storage().data_ptr() for p in pointers}) == 1  # views of one fused weight
    torch.testing.assert_close(model(torch.tensor([random_tokens(12)])).logits, reference_logits)
    again = Engine(model)  # a second engine on the same model reuses the fused weights
    assert again.batcher.forward.layers[0].qkv == engine.batcher.forward.layers[0].qkv
