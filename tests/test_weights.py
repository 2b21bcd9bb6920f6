"""16-bit and int4 linear weights under fp32 activations (``Engine.from_pretrained(weights=...)``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvmemory import Engine, InvalidArgumentError, SamplingParams
from kvmemory.compaction.registry import available_methods, get_method
from kvmemory.hardware import cpu_has_fbgemm
from kvmemory.kernels import cpu_ops
from kvmemory.runtime import weights
from kvmemory.runtime.forward import DirectForward, SideBySide, TransformersForward
from kvmemory.runtime.named_models import SMALL_MODEL
from kvmemory.runtime.session_compaction import compact_span
from kvmemory.runtime.weights import (
    DIRECT_ROWS,
    INT4_GROUP,
    Int4Linear,
    PackedFp16Linear,
    PackedInt4Linear,
    SixteenBitLinear,
    default_weights,
    quantize_int4,
    store_linear_weights,
)
from tests.conftest import tiny_model


def rounded(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.to(dtype).to(x.dtype)


def assert_decodes_as_a_full_forward(engine: Engine, model) -> None:
    """A session's greedy reply is the tokens a full forward of the model picks at each step."""
    prompt = list(range(3, 40))
    session = engine.session()
    session.append_tokens(prompt)
    reply = session.generate(params=SamplingParams(max_new_tokens=12, ignore_eos=True)).token_ids
    with torch.no_grad():
        ids = list(prompt)
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert reply == ids[len(prompt) :]


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
    assert engine.weights == "bf16" and Engine(tiny_model("llama")).weights == "fp32"
    assert_decodes_as_a_full_forward(engine, model)


def test_weight_format_errors_name_the_problem_before_anything_loads():
    with pytest.raises(InvalidArgumentError, match="weights must be one of"):
        Engine.from_pretrained("no-such-model", weights="int3")
    with pytest.raises(InvalidArgumentError, match="wider than the model"):
        store_linear_weights(tiny_model("llama").to(torch.bfloat16), "fp32")
    model = tiny_model("llama")
    assert store_linear_weights(model, "fp32") is model and any(type(m) is nn.Linear for m in model.modules())


def test_default_weights_per_device(monkeypatch):
    monkeypatch.setattr(weights, "cpu_ops", lambda: object())
    assert default_weights(torch.device("cpu"), torch.float32, gguf=True) == "gguf"
    assert default_weights(torch.device("cuda"), torch.bfloat16, gguf=True) == "bf16"
    monkeypatch.setattr(weights, "cpu_ops", lambda: None)  # no kernels: the blocks cannot be multiplied
    monkeypatch.setattr(weights, "cpu_has_native_bf16", lambda: True)
    assert default_weights(torch.device("cpu"), torch.float32, gguf=True) == "auto"
    assert default_weights(torch.device("cpu"), torch.float32) == "auto"
    monkeypatch.setattr(weights, "cpu_has_native_bf16", lambda: False)
    assert default_weights(torch.device("cpu"), torch.float32) == "fp16"
    assert default_weights(torch.device("cuda"), torch.bfloat16) == "bf16"
    assert default_weights(torch.device("cpu"), torch.float16) == "fp16"
    assert default_weights(torch.device("cpu"), torch.float64) is None  # left as loaded


def test_the_small_model_on_its_default_weights_scores_text_as_fp32_does(small_engine):
    """The quality bar of the default weights (the file's blocks; int4 or fp16 without kvmemory's kernels):
    teacher-forced NLL within 0.01 nats of fp32."""
    from benchmarks.texts import source_text

    fast = Engine.from_pretrained(SMALL_MODEL)
    ids = fast.tokenizer.encode(source_text(4000), add_special_tokens=False)[:384]
    nll = {}
    for name, engine in (("default", fast), ("fp32", small_engine)):
        session = engine.session()
        session.append_tokens(ids[:256])
        nll[name] = float(-session.logprobs(ids[256:]).mean())
    assert abs(nll["default"] - nll["fp32"]) < 0.01
    assert fast.weights == ("gguf" if cpu_ops() is not None else "int4" if weights.cpu_has_native_bf16() else "fp16")
    layers = [m for m in small_engine.model.model.layers.modules() if type(m) is nn.Linear]
    assert layers and all(quantize_int4(m.weight.detach())[2] for m in layers[:8])  # 4-bit, up to fp16 rounding


@pytest.fixture(params=["panels", "fbgemm"])
def fp16_layout(request, monkeypatch):
    """fp16 weights packed for kvmemory's kernel, or for fbgemm's (where kvmemory's kernels are not built)."""
    if request.param == "panels" and cpu_ops() is None:
        pytest.skip("kvmemory's CPU kernels are not built here")
    if request.param == "fbgemm":
        if not cpu_has_fbgemm():
            pytest.skip("fbgemm's fp16 GEMM is x86 only")
        monkeypatch.setattr(weights, "cpu_ops", lambda: None)
    return request.param


def test_packed_fp16_rounds_only_its_weight_alone_or_with_other_rows(fp16_layout):
    torch.manual_seed(0)
    linear = nn.Linear(64, 300)
    packed = PackedFp16Linear(linear)
    x = torch.randn(9, 64) * 40  # products far past fp16's range: the input and the output stay fp32
    many = packed(x)
    alone = torch.cat([packed(x[i : i + 1]) for i in range(len(x))])
    assert many.dtype == alone.dtype == torch.float32
    expected = F.linear(x.double(), linear.weight.half().double(), linear.bias.double())
    for out in (many, alone):  # fp32 sums of fp16 weights: only the order of the sums may differ
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-4)
    if fp16_layout == "panels":  # one order, whatever the rows: the same bits
        assert torch.equal(many, alone)
    assert packed._weight is None  # held once, packed, until a reader asks for the weight
    assert torch.equal(packed.weight, linear.weight.detach().half()) and torch.equal(packed(x), many)


def test_fp16_layers_fuse_where_they_fill_panels_and_decode_as_a_full_forward_does(fp16_layout):
    model = store_linear_weights(tiny_model("qwen2"), "fp16")  # q, k and v carry biases
    assert {type(m) for m in model.modules() if isinstance(m, (nn.Linear, PackedFp16Linear))} == {PackedFp16Linear}
    engine = Engine(model)
    assert engine.weights == "fp16" and isinstance(engine.batcher.forward, DirectForward)
    qkv = engine.batcher.forward.layers[0].qkv.__self__
    assert type(qkv) is (PackedFp16Linear if fp16_layout == "panels" else SideBySide)  # fbgemm's do not fuse
    assert_decodes_as_a_full_forward(engine, model)


def test_a_layer_whose_fp16_result_overflows_switches_to_bf16():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    linear.weight.data[0] = 2000.0  # row 0 sums to 64 · 2000 · |x| ≈ 1e5 > fp16's 65504
    sixteen = SixteenBitLinear(linear, torch.float16)
    x = torch.rand(8, 64) + 0.5
    out = sixteen(x)  # many rows: the guarded path
    assert sixteen.weight.dtype == torch.bfloat16 and out.isfinite().all()
    torch.testing.assert_close(out, linear(x), rtol=1e-2, atol=1e-2)


def four_bit(weight: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """A weight of ``weight``'s shape that is 4-bit already, as a Q4_1 GGUF's dequantised weights are: per group
    of 32 inputs, step · q + low with q in 0..15 and the step and low fp16 values, each group using both ends of
    its range."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = weight.shape
    levels = torch.randint(0, 16, (rows, cols // INT4_GROUP, INT4_GROUP), generator=g).float()
    levels[..., 0], levels[..., 1] = 0, 15
    step = (torch.rand(rows, cols // INT4_GROUP, 1, generator=g) * 0.01 + 1e-3).half().float()
    low = (-8 * step + torch.randn(rows, cols // INT4_GROUP, 1, generator=g) * 1e-3).half().float()
    return (levels * step + low).reshape(rows, cols)


def four_bit_model(arch: str = "llama", **overrides):
    """A tiny model whose decoder linear layers are 4-bit already (4 KV heads: q, k and v fill whole blocks of
    64 packed rows, so they fuse)."""
    model = tiny_model(arch, num_key_value_heads=4, **overrides)
    head = model.get_output_embeddings()
    for i, linear in enumerate(m for m in model.modules() if type(m) is nn.Linear and m is not head):
        linear.weight.data = four_bit(linear.weight, seed=i)
    return model


def test_int4_keeps_a_four_bit_weight_and_rounds_only_in_bf16():
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    gaussian = quantize_int4(linear.weight.detach())[2]
    linear.weight.data = four_bit(linear.weight)
    packed, scales_and_zeros, exact = quantize_int4(linear.weight.detach())
    assert exact and not gaussian  # a weight that is not 4-bit is told apart
    int4 = Int4Linear.of(linear)
    x = torch.randn(5, 3, 64)
    out = int4(x)
    assert out.shape == (5, 3, 96) and out.dtype == torch.float32
    # the kernel's product: bf16 input, the weight from bf16 scales and zeros, a bf16 result
    step, zero = scales_and_zeros.float().unbind(-1)
    levels = (
        (linear.weight - (zero - 8 * step).t().repeat_interleave(INT4_GROUP, 1))
        / step.t().repeat_interleave(INT4_GROUP, 1)
    ).round()
    rebuilt = (levels - 8) * step.t().repeat_interleave(INT4_GROUP, 1) + zero.t().repeat_interleave(INT4_GROUP, 1)
    expected = rounded(F.linear(rounded(x, torch.bfloat16), rebuilt), torch.bfloat16) + linear.bias
    torch.testing.assert_close(out, expected, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-5)
    torch.testing.assert_close(out, linear(x), rtol=0.03, atol=0.03)  # and near the fp32 layer


def test_auto_stores_int4_exactly_where_the_weights_are_four_bit_and_fp16_elsewhere():
    model = four_bit_model()
    model.model.layers[1].mlp.down_proj.weight.data = torch.randn(64, 128) * 0.02  # not 4-bit
    store_linear_weights(model, "auto")
    layers = model.model.layers
    int4 = PackedInt4Linear if cpu_ops() is not None else Int4Linear  # kvmemory's kernel where it is built
    assert type(layers[0].mlp.down_proj) is int4 and type(layers[1].self_attn.q_proj) is int4
    fp16 = PackedFp16Linear if cpu_ops() is not None or cpu_has_fbgemm() else SixteenBitLinear
    assert type(layers[1].mlp.down_proj) is fp16 and type(model.lm_head) is fp16
    assert model.lm_head.weight.dtype == torch.float16
    with pytest.raises(InvalidArgumentError, match="CPU int4 kernel"):
        store_linear_weights(four_bit_model().to("meta"), "int4")


def test_fused_int4_projections_compute_what_their_parts_do():
    model = store_linear_weights(four_bit_model("qwen2"), "int4")  # qwen2: q, k and v have biases
    direct, parts = DirectForward.of(model), TransformersForward(model)
    int4 = PackedInt4Linear if cpu_ops() is not None else Int4Linear
    assert direct is not None and type(direct.layers[0].qkv.__self__) is int4
    engine = Engine(model)
    ids = list(range(3, 30))
    logits = {}
    for name, forward in (("fused", direct), ("parts", parts)):
        engine.batcher.forward = forward
        session = engine.session()
        session.append_tokens(ids)
        logits[name] = session.logprobs(ids[1:])
    torch.testing.assert_close(logits["fused"], logits["parts"], rtol=0, atol=1e-5)


def test_a_session_on_int4_weights_decodes_as_a_full_forward_of_its_model_does():
    model = store_linear_weights(four_bit_model(), "int4")
    engine = Engine(model)
    assert engine.weights == "int4" and isinstance(engine.batcher.forward, DirectForward)
    assert_decodes_as_a_full_forward(engine, model)


@pytest.mark.parametrize("weights_format", ["int4", "fp16"])
@pytest.mark.parametrize("method_name", available_methods())
def test_every_compaction_method_runs_on_narrow_weights(method_name, weights_format):
    """Methods that run the model's layers themselves (counter-causal reruns attention and projections) read
    weights in every format, int4's packed ones included."""
    engine = Engine(store_linear_weights(four_bit_model(), weights_format))
    session = engine.session()
    session.record_queries(16, context=32)
    session.record_last_layer_inputs()
    session.record_surprisal()
    session.append_tokens(list(range(3, 123)))
    scores = {"scores": [[1.0, 2.0, 0.5, 1.5], [3.0, 0.5, 1.0, 2.0]]}
    kwargs = scores if method_name in ("real", "retrieval_lines") else {}
    record = compact_span(session, torch.arange(4, 100), get_method(method_name, **kwargs), 24)
    assert record.slots_after == 24
    assert len(session.generate(max_new_tokens=3).token_ids) == 3 and torch.isfinite(session._last_logits).all()
