"""16-bit linear weights under fp32 activations (``Engine.from_pretrained(weights=...)``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvmemory import Engine, InvalidArgumentError, SamplingParams
from kvmemory.runtime import weights
from kvmemory.runtime.weights import DIRECT_ROWS, SixteenBitLinear, default_weights, store_linear_weights
from tests.conftest import tiny_model


def rounded(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype).to(x.dtype)


@pytest.mark.parametrize("block_rows", [None, 10])  # 10: the weight is widened in 10 blocks
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_row_gets_the_same_result_alone_or_in_a_large_pass(dtype, block_rows, monkeypatch):
    if block_rows is not None:
        monkeypatch.setattr(weights, "WIDEN_BLOCK_BYTES", block_rows * 64 * 4)
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    sixteen = SixteenBitLinear(linear, dtype)
    sixteen.native = False  # widen over many rows whatever this CPU offers
    x = torch.randn(9, 64)
    many = sixteen(x)  # widened path
    alone = torch.cat([sixteen(x[i : i + 1]) for i in range(len(x))])  # 16-bit kernel
    assert x[:1].numel() <= DIRECT_ROWS * 64 < x.numel()
    assert many.dtype == alone.dtype == torch.float32
    if dtype == torch.bfloat16:
        assert torch.equal(many, alone)
    else:  # the fp16 kernel differs in the last place on a few elements
        torch.testing.assert_close(many, alone, rtol=2e-3, atol=1e-6)
    # both are the fp32 product of the rounded input and weight, rounded once at the end (to within the last
    # place: another summation order may round the other way)
    expected = rounded(F.linear(rounded(x, dtype), rounded(linear.weight, dtype)), dtype) + linear.bias
    torch.testing.assert_close(many, expected, rtol=torch.finfo(dtype).eps, atol=1e-6)


def test_bf16_runs_its_own_kernel_at_every_row_count_where_the_cpu_has_bf16_dot_products(monkeypatch):
    linear = nn.Linear(64, 96)
    monkeypatch.setattr(weights, "cpu_has_native_bf16", lambda: True)
    native, fp16 = SixteenBitLinear(linear, torch.bfloat16), SixteenBitLinear(linear, torch.float16)
    monkeypatch.setattr(weights, "cpu_has_native_bf16", lambda: False)
    assert native.native and not fp16.native and not SixteenBitLinear(linear, torch.bfloat16).native
    x = torch.randn(9, 64)
    monkeypatch.setattr(SixteenBitLinear, "_widened", lambda *a: pytest.fail("widened"))
    expected = F.linear(x.bfloat16(), linear.weight.bfloat16()).float() + linear.bias
    torch.testing.assert_close(native(x), expected)


def test_storing_16_bit_weights_replaces_every_linear_and_keeps_activations_fp32():
    model = tiny_model("qwen2")  # q/k/v biases
    reference = tiny_model("qwen2")
    store_linear_weights(model, "bf16")
    assert not [m for m in model.modules() if type(m) is nn.Linear]
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.float16  # logits keep an 11-bit mantissa
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()


def test_a_session_on_16_bit_weights_decodes_as_a_full_forward_of_its_model_does():
    model = store_linear_weights(tiny_model("llama"), "bf16")
    engine = Engine(model)
    prompt = list(range(3, 40))
    lone = engine.session()
    lone.append_tokens(prompt)
    reply = lone.generate(params=SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
    with torch.no_grad():  # the same greedy tokens from a full forward of the model each step
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert reply == ids[len(prompt) :]


def test_weight_format_errors_name_the_problem_before_anything_loads():
    with pytest.raises(InvalidArgumentError, match="weights must be one of"):
        Engine.from_pretrained("no-such-model", weights="int3")
    with pytest.raises(InvalidArgumentError, match="wider than the model"):
        store_linear_weights(tiny_model("llama").to(torch.bfloat16), "fp32")
    model = tiny_model("llama")
    assert store_linear_weights(model, "fp32") is model and any(type(m) is nn.Linear for m in model.modules())


def test_default_weights_per_device():
    assert default_weights(torch.device("cpu"), torch.float32) == "fp16"
    assert default_weights(torch.device("cuda"), torch.bfloat16) == "bf16"
    assert default_weights(torch.device("cpu"), torch.float16) == "fp16"
    assert default_weights(torch.device("cpu"), torch.float64) is None  # left as loaded


def test_the_default_model_on_16_bit_weights_scores_text_as_fp32_does(default_engine):
    """The quality bar of 16-bit weights: teacher-forced NLL within 0.01 nats of the fp32 reference."""
    from benchmarks.texts import source_text

    fast = Engine.from_pretrained("default")
    ids = fast.tokenizer.encode(source_text(4000), add_special_tokens=False)[:384]
    nll = {}
    for name, engine in (("default", fast), ("fp32", default_engine)):
        session = engine.session()
        session.append_tokens(ids[:256])
        nll[name] = float(-session.logprobs(ids[256:]).mean())
    assert abs(nll["default"] - nll["fp32"]) < 0.01
    assert fast.model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float16


def test_a_layer_whose_fp16_result_overflows_switches_to_bf16():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    linear.weight.data[0] = 2000.0  # row 0 sums to 64 · 2000 · |x| ≈ 1e5 > fp16's 65504
    sixteen = SixteenBitLinear(linear, torch.float16)
    x = torch.rand(8, 64) + 0.5
    out = sixteen(x)  # many rows: the guarded path
    assert sixteen.weight.dtype == torch.bfloat16 and out.isfinite().all()
    torch.testing.assert_close(out, linear(x), rtol=1e-2, atol=1e-2)
