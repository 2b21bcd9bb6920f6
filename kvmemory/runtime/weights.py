"""Linear weights stored in 16 bits or fewer while activations and the cache stay in the model's dtype.

Decoding one token reads every weight once; on a CPU that read is most of the decode step's cost. The
*kernels* table of ``python -m benchmarks.speed`` times one token through the default model's linear layers
per kernel. ``Engine.from_pretrained(weights=...)`` offers:

* ``"gguf"``: a GGUF file's own quantized blocks, multiplied by integer dot products on 8-bit input rows
  (``gguf_weights``: the file's 4.5-8.5 bits a weight read per token, as llama.cpp reads them); the CPU default
  for a GGUF file where kvmemory's kernels are built. Weights of types it does not keep get fp16.
* ``"fp16"``: each linear layer's weight in fp16 (half fp32's bytes), embeddings, norms, activations and the
  KV cache in fp32. On x86 the layers run a kernel that widens the weight in registers (``PackedFp16Linear``:
  kvmemory's own, else fbgemm's fp16 GEMM), which rounds nothing but the weight (the default model's
  full-cache NLL 0.0004 from fp32's, the *Weight formats* table).
  Elsewhere the 16-bit kernel rounds input and output too, and its narrower range is guarded where it is cheap: a
  layer whose fp16 result overflows in a pass over many rows (prefill) switches itself to bf16. The CPU
  default without bf16 dot products.
* ``"bf16"``: the same in bf16, the output head in fp16 (``store_linear_weights``).
* ``"int4"``: per group of 32 inputs, 4-bit levels with a step and a low value: a quarter of fp16's bytes (and
  the steps and lows). This is GGUF Q4_1's layout, so the weights of a Q4_1 file (the default model's) come
  back exactly from their dequantised values. Where kvmemory's CPU kernels are built they run
  ``PackedInt4Linear`` (``linear_int4.cpp``: fp32 activations, steps and lows in fp16 as the file has them,
  so nothing is rounded; one read of the weight for every row of a packed pass); elsewhere torch's CPU int4
  kernel on bf16 activations (``Int4Linear``), whose bf16 scales and bf16 input and output round them as bf16
  weights round theirs.
* ``"auto"``: int4 for every layer whose weight is 4-bit already (nothing lost), fp16 for the rest; the
  CPU default where bf16 dot products exist (AVX-512 BF16, AMX: the machines int4 was measured fastest on,
  with either kernel).

fp16 weights under fp32 activations on x86, the output head's in every format, run ``PackedFp16Linear``: fp32
in and out, one read of the weight for up to 48 rows (so a packed pass of 8 sessions costs little more than
one row), and 2-3× faster than widening over many rows. Other 16-bit layers over a few rows (decoding) run the
16-bit kernel directly. Over many rows (prefill chunks, scoring, a batched pass)
they widen the weight to the activation dtype first: CPUs without native 16-bit dot products (AVX2) run 16-bit
GEMM 6–7× slower than fp32 at 64+ rows, while widening costs one pass over the weight. bf16 weights on a CPU
with bf16 dot products run the bf16 kernel at every row count: 8 rows cost 1.04× one row there and 64 rows
2×, against 2.3× and 7.4× widened. Both paths round the input and the output to 16 bits and accumulate in
fp32, so a row's result depends on how many rows share its pass only where the two kernels' summation orders
round differently (the last place of a few elements).

Measured on a 2-core AVX-512 Xeon (bf16, FP16, AMX; ``python -m benchmarks.speed``'s *kernels* table: one
token, and one pass of 8 rows, through every linear weight of the default model's shapes, output head
included, every kernel's weights from memory): fp32 23 ms, bf16 30, kvmemory's fp16 11.3 (8 rows 12.4),
torch's int4 on bf16 activations 12.2 (23.2), kvmemory's int4 11.3 (18.3); torch's int8 and int4 weight-only
kernels (``torch._weight_int8pack_mm``, ``torch._weight_int4pack_mm_for_cpu``, which torchao's weight-only
configs run on CPU) take 51 and 120 ms on fp32 activations: they are vectorised for bf16 only. In the model
int4 decodes 1.24× as fast as fp16 (the *Weight formats* table). int8 weight-only (per-row scales) would suit
weights that are not 4-bit; it is not offered yet. fbgemm's dynamic int8 also quantises the activations and
moved the NLL by more than 0.01.
"""

from __future__ import annotations

import hashlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvmemory.errors import InvalidArgumentError
from kvmemory.hardware import cpu_has_fbgemm, cpu_has_native_bf16
from kvmemory.kernels import cpu_ops
from kvmemory.runtime.gguf_weights import GgufLinear

log = logging.getLogger("kvmemory.weights")
SIXTEEN_BIT = {"bf16": torch.bfloat16, "fp16": torch.float16}
FORMAT_OF_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
WEIGHT_FORMATS = ("gguf", "fp32", *SIXTEEN_BIT, "int4", "auto")
INT4_GROUP = 32  # inputs per scale and zero: GGUF Q4_1's block, so that file's weights are kept as they are
PANEL_COLUMNS = 16  # output columns per panel of kvmemory's fp16 and int4 kernels: fused parts fill whole panels
INT4_PACK_ROWS = 64  # the CPU kernel packs output rows in blocks of 64: fused weights split there
DIRECT_ROWS = 2  # up to this many rows the 16-bit kernel wins; past it widening the weight does (AVX2)
WIDEN_BLOCK_BYTES = 2 << 20  # widened weight blocks of this size stay in cache


class SixteenBitLinear(nn.Module):
    """``nn.Linear`` with its weight held in 16 bits; input and output keep the caller's dtype."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().to(dtype), requires_grad=False)
        self.bias = linear.bias  # tiny: kept in the activation dtype
        self.native = dtype == torch.bfloat16 and cpu_has_native_bf16()  # direct at every row count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native or x.numel() <= DIRECT_ROWS * self.in_features:
            out = F.linear(x.to(self.weight.dtype), self.weight)
        else:
            out = self._rounded_widened(x)
            if self.weight.dtype == torch.float16 and not out.isfinite().all() and x.isfinite().all():
                log.warning("fp16 overflows in a %s; that layer switches to bf16 weights", self.extra_repr())
                self.weight = nn.Parameter(self.weight.to(torch.bfloat16), requires_grad=False)
                out = self._rounded_widened(x)
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias

    def _rounded_widened(self, x: torch.Tensor) -> torch.Tensor:
        """The 16-bit kernel's rounding of input and output around an fp32 GEMM."""
        narrow = self.weight.dtype
        return self._widened(x.to(narrow).to(x.dtype)).to(narrow)

    def _widened(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weightᵀ in x's dtype, widening the weight a block of output rows at a time so each widened
        block stays in cache (widening the default model's 28M-parameter output head whole took 50–73 ms
        for 4–32 rows; in 2 MiB blocks 10–21 ms)."""
        rows = max(1, WIDEN_BLOCK_BYTES // (self.in_features * x.element_size()))
        if rows >= self.out_features:
            return F.linear(x, self.weight.to(x.dtype))
        blocks = [F.linear(x, self.weight[i : i + rows].to(x.dtype)) for i in range(0, self.out_features, rows)]
        return torch.cat(blocks, dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.weight.dtype}"


class PackedFp16Linear(nn.Module):
    """An fp16 weight run by a CPU kernel that widens it in registers, so input, sums and output stay fp32 and
    nothing but the weight is rounded (nothing can overflow either).

    Where kvmemory's CPU kernels are built (``kvmemory.kernels``, AVX2), the weight is packed in panels of 16
    output columns for ``linear_fp16.cpp``: it reads the weight once for up to 48 rows, so a packed pass of 8
    sessions costs little more than one, and each output is one fp32 sum in a fixed order, so a row's result
    is the same bit for bit whichever rows share its pass, and layers fuse (``fuse_linears``: parts whose
    outputs fill whole panels become views of the fused panels). Through every linear weight of the default
    model (2-core AVX2; ``python -m benchmarks.fp16_linear``) it took 11.4 ms for 1 row and 17.6 for 8, where
    fbgemm's fp16 GEMM, which blocks rows by 6 and so reads the weight twice for 7-12 rows, took 16.0 and
    24.6. On a CPU with AVX-512 the kernel runs on 16-float vectors, with the same bits: 8 rows then cost
    about what one does (12.6 against 10.7 ms on a 2-core Xeon, where 8-float vectors took 21.3). Elsewhere
    on x86 the weight goes to fbgemm's packed layout (``quantized::linear_dynamic_fp16``), whose kernel choice
    by row count can change a row's last bits. Either way ``weight`` is unpacked on first read."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias  # kept for readers; the kernels take their own fp32 copy
        self._bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        weight = linear.weight.detach().half()
        ops = cpu_ops()
        if ops is not None:
            self.panels, self.fbgemm = ops.pack_fp16_weight(weight), None
        else:
            self.panels, self.fbgemm = None, torch.ops.quantized.linear_prepack_fp16(weight.float(), self._bias)
        self._weight = None

    @classmethod
    def side_by_side(cls, parts: list[PackedFp16Linear]) -> PackedFp16Linear:
        """One layer computing ``parts`` (in kvmemory's panels, each filling whole panels) side by side: their
        panels and biases joined, the parts' becoming views of the joined ones (``fuse_linears``)."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.in_features, fused.out_features = parts[0].in_features, sum(p.out_features for p in parts)
        fused.panels, fused.fbgemm, fused._weight = torch.cat([p.panels for p in parts]), None, None
        fused.bias = fused._bias = None
        if parts[0].bias is not None:
            fused._bias = torch.cat([p._bias for p in parts])
            fused.bias = nn.Parameter(fused._bias.to(parts[0].bias.dtype), requires_grad=False)
        panel, row = 0, 0
        for part in parts:
            count = part.panels.shape[0]
            part.panels, part._weight = fused.panels[panel : panel + count], None
            if fused._bias is not None:
                part._bias = fused._bias[row : row + part.out_features]
            panel, row = panel + count, row + part.out_features
        return fused

    @property
    def weight(self) -> torch.Tensor:
        """The fp16 weight, unpacked on first read (0.2 s for the default model's head in fbgemm's layout) and
        kept from then on: only readers of single rows ask for it (counter-causal, the head's rows)."""
        if self._weight is None:
            if self.panels is not None:
                rows = self.panels.transpose(1, 2).reshape(-1, self.in_features)
                self._weight = rows[: self.out_features].contiguous()
            else:
                self._weight = torch.ops.quantized.linear_unpack_fp16(self.fbgemm)[0].half()
        return self._weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        if self.panels is not None:
            out = torch.ops.kvmemory.linear_fp16(rows, self.panels, self.out_features, self._bias)
        else:
            out = torch.ops.quantized.linear_dynamic_fp16(rows, self.fbgemm)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    @property
    def packed_bytes(self) -> int:
        """The bytes of the packed fp16 copy (held outside ``parameters()`` and ``buffers()``)."""
        return self.in_features * self.out_features * torch.float16.itemsize

    def extra_repr(self) -> str:
        layout = "panels" if self.panels is not None else "fbgemm"
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=fp16 ({layout})"


def _fuse_panels(parts: list) -> nn.Module | None:
    """``fuse_linears`` for weights in kvmemory's panels (all ``PackedFp16Linear`` or all ``PackedInt4Linear``).
    None unless every part fills whole panels of 16 columns and all share an input size and having a bias or
    not (fbgemm's packed fp16 weights never fuse)."""
    alike = len({(p.in_features, p.bias is None) for p in parts}) == 1
    fbgemm = any(type(p) is PackedFp16Linear and p.panels is None for p in parts)
    whole = all(p.out_features % PANEL_COLUMNS == 0 for p in parts)
    return type(parts[0]).side_by_side(parts) if alike and whole and not fbgemm else None


class Int4Linear(nn.Module):
    """``nn.Linear`` with its weight in 4 bits: per group of 32 inputs, w = scale·q + low with q in 0..15.

    That is the layout of GGUF's Q4_1, so the weights of such a file come back exactly from their dequantised
    fp32 values (``quantize_int4``), and only the kernel's bf16 scale and zero round them. The product runs in
    torch's CPU int4 kernel on bf16 activations, where it is vectorised (on fp32 or fp16 inputs the same kernel
    is 10-30× slower): the input and the output are rounded to bf16, as with bf16 weights, and keep the caller's
    dtype outside."""

    def __init__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, in_features: int, bias=None):
        super().__init__()
        self.in_features, self.out_features = in_features, packed.shape[0]
        self.register_buffer("packed", packed)  # (out, in / 2) uint8, the kernel's layout
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # (in / 32, out, 2) bf16
        self.bias = bias  # tiny: kept in the activation dtype

    @classmethod
    def of(cls, linear: nn.Linear, only_if_exact: bool = False) -> Int4Linear | None:
        """``linear`` in int4; with ``only_if_exact``, None unless its weight is 4-bit already (``quantize_int4``)."""
        packed, scales_and_zeros, exact = quantize_int4(linear.weight.detach())
        if only_if_exact and not exact:
            return None
        return cls(packed, scales_and_zeros, linear.in_features, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)
        # contiguous: a fused layer's part holds a strided view, which the kernel would misread
        scales_and_zeros = self.scales_and_zeros.contiguous()
        out = torch._weight_int4pack_mm_for_cpu(rows, self.packed, INT4_GROUP, scales_and_zeros)
        out = out.view(*x.shape[:-1], self.out_features).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=int4 (groups of 32)"


class PackedInt4Linear(nn.Module):
    """4-bit weights in ``Int4Linear``'s groups (w = step·q + low, GGUF Q4_1), run by kvmemory's CPU kernel on
    fp32 activations: input, sums and output stay fp32, and the steps and lows are kept in fp16, as Q4_1 stores
    them, so a Q4_1 file's weights are used exactly as dequantised (``Int4Linear`` rounds scales, input and
    output to bf16); a weight that is not 4-bit has its steps and lows rounded to fp16.

    ``linear_int4.cpp`` packs the levels in panels of 16 output columns, two inputs a byte, and reads them
    once per pass for every row, where torch's int4 kernel costs more per row. Each output is one fp32 sum
    in a fixed order, so a row's result is the same bit for bit whichever rows share its pass, and layers
    fuse (``fuse_linears``). Where the kernels are not built, 4-bit weights run ``Int4Linear``. Timings: the
    module docstring."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, out_features: int, bias=None):
        super().__init__()
        self.in_features, self.out_features = packed.shape[1] * 2, out_features
        self.packed, self.scales = packed, scales  # the kernel's layout (``pack_int4_weight``)
        self.bias = bias  # kept for readers; the kernel takes its own fp32 copy
        self._bias = None if bias is None else bias.detach().float().contiguous()

    @classmethod
    def of(cls, linear: nn.Linear, only_if_exact: bool = False) -> PackedInt4Linear | None:
        """``linear`` in int4; with ``only_if_exact``, None unless its weight is 4-bit already."""
        weight = linear.weight.detach()
        levels, step, low = int4_groups(weight)
        step, low = step.half().float(), low.half().float()  # as Q4_1 stores them
        if only_if_exact and not int4_is_exact(weight, levels, step, low):
            return None
        packed, scales = cpu_ops().pack_int4_weight(levels.reshape(weight.shape).to(torch.uint8), step, low)
        return cls(packed, scales, linear.out_features, linear.bias)

    @classmethod
    def side_by_side(cls, parts: list[PackedInt4Linear]) -> PackedInt4Linear:
        """One layer computing ``parts`` (each filling whole panels) side by side, the parts' panels becoming
        views of the joined ones (``fuse_linears``)."""
        packed, scales = torch.cat([p.packed for p in parts]), torch.cat([p.scales for p in parts])
        bias = None
        if parts[0].bias is not None:
            bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        panel = 0
        for part in parts:
            count = part.packed.shape[0]
            part.packed, part.scales = packed[panel : panel + count], scales[panel : panel + count]
            panel += count
        return cls(packed, scales, sum(p.out_features for p in parts), bias)

    @property
    def packed_bytes(self) -> int:
        """The bytes of the packed levels, steps and lows (held outside ``parameters()`` and ``buffers()``)."""
        return self.packed.numel() + self.scales.numel() * self.scales.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.ops.kvmemory.linear_int4(rows, self.packed, self.scales, self.out_features, self._bias)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=int4 (panels, groups of 32)"


def int4_layer(linear: nn.Linear, only_if_exact: bool) -> nn.Module | None:
    """``linear`` with 4-bit weights: kvmemory's kernel where it is built, else torch's (``Int4Linear``)."""
    return (PackedInt4Linear if cpu_ops() is not None else Int4Linear).of(linear, only_if_exact)


def int4_groups(weight: torch.Tensor):
    """Per group of ``INT4_GROUP`` inputs, the levels q (0..15), the step and the lowest value of ``weight``."""
    w = weight.float()
    groups = w.reshape(w.shape[0], -1, INT4_GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    step = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)  # a constant group: q = 0
    levels = ((groups - low[..., None]) / step[..., None]).round().clamp(0, 15)
    return levels, step, low


FOUR_BIT_TOLERANCE = 2.0**-9  # of a group's largest |weight|: a few fp16 roundings, far below half a 4-bit step


def int4_is_exact(weight: torch.Tensor, levels, step, low) -> bool:
    """Whether ``int4_groups``' levels give ``weight`` back up to 16-bit rounding: it was 4-bit already (say
    dequantised from a Q4_1 or Q4_K GGUF block when a GGUF model runs with ``weights="fp16"``), so int4 loses
    no more than fp16 would. Any other weight misses by up to half a step, a fifteenth of its group's range."""
    w = weight.float().reshape(levels.shape)
    rebuilt = levels * step[..., None] + low[..., None]
    bound = FOUR_BIT_TOLERANCE * w.abs().amax(-1, keepdim=True) + torch.finfo(torch.float32).tiny
    return bool(((rebuilt - w).abs() <= bound).all())


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(packed levels, scales and zeros) in the CPU kernel's layout, which dequantises (q − 8)·scale + zero
    (hence zero = low + 8·step), and whether ``weight`` was 4-bit already (say dequantised from a Q4_1
    GGUF): its levels give it back to fp32 rounding, so int4 loses nothing but the bf16 scale rounding."""
    levels, step, low = int4_groups(weight)
    exact = int4_is_exact(weight, levels, step, low)
    packed = torch._convert_weight_to_int4pack_for_cpu(levels.reshape(weight.shape).to(torch.int32), 1)
    scales_and_zeros = torch.stack([step.t(), (low + 8 * step).t()], dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros, exact


def fuse_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One linear layer computing ``parts`` side by side (their outputs concatenated), for projections of the
    same input (q, k and v; gate and up): one matrix product instead of several, each of which costs a
    kernel call and its 16-bit conversions. The parts' weights become views of the fused weight, so nothing
    is held twice and each part still computes what it did. None when the parts differ in kind, dtype,
    device or bias. (Should the fused layer switch itself to bf16 on an fp16 overflow, the parts keep
    their fp16 views.)"""
    if all(type(p) is Int4Linear for p in parts):
        return _fuse_int4(parts)
    if all(type(p) is GgufLinear for p in parts):
        return GgufLinear.side_by_side(parts)
    if len({type(p) for p in parts}) == 1 and type(parts[0]) in (PackedFp16Linear, PackedInt4Linear):
        return _fuse_panels(parts)
    if any(type(p) not in (nn.Linear, SixteenBitLinear) for p in parts):
        return None
    kinds = {(type(p), p.weight.dtype, p.weight.device, p.bias is None) for p in parts}
    if len(kinds) != 1:
        return None
    with torch.no_grad():
        weight = torch.cat([p.weight for p in parts])
        bias = None if parts[0].bias is None else torch.cat([p.bias for p in parts])
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    fused = linear if type(parts[0]) is nn.Linear else SixteenBitLinear(linear, weight.dtype)
    offset = 0
    for part in parts:
        rows = slice(offset, offset + part.weight.shape[0])
        part.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            part.bias = nn.Parameter(bias[rows], requires_grad=False)
        offset = rows.stop
    return fused


def _fuse_int4(parts: list[Int4Linear]) -> Int4Linear | None:
    """``fuse_linears`` for int4 parts: their packed rows and scales side by side, the parts' becoming views.
    None unless every part fills whole blocks of packed rows (then the blocks of the fused weight are
    exactly the parts' blocks) and all share an input size and having a bias or not."""
    alike = len({(p.in_features, p.bias is None) for p in parts}) == 1
    if not alike or any(p.out_features % INT4_PACK_ROWS for p in parts):
        return None
    packed = torch.cat([p.packed for p in parts])
    scales_and_zeros = torch.cat([p.scales_and_zeros for p in parts], dim=1)
    bias = None if parts[0].bias is None else nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    offset = 0
    for part in parts:
        rows = slice(offset, offset + part.out_features)
        part.packed, part.scales_and_zeros = packed[rows], scales_and_zeros[:, rows]
        if bias is not None:
            part.bias = nn.Parameter(bias[rows], requires_grad=False)
        offset = rows.stop
    return Int4Linear(packed, scales_and_zeros, parts[0].in_features, bias)


def default_weights(device: torch.device, dtype: torch.dtype, gguf: bool = False) -> str | None:
    """Under fp32 activations on CPU: a GGUF file's own blocks where kvmemory's kernels are built
    (``gguf_weights``: the file's bytes per weight, integer dot products); for other models, or without the
    kernels, "auto" where the CPU has bf16 dot products (int4 for every layer whose weight is 4-bit already:
    nothing lost, a quarter of fp16's bytes to read per token; fp16 for the rest), else fp16 (half the bytes
    of fp32; the fastest kernel there, see the module docstring). Otherwise the model's dtype (None for a
    dtype no format names: left as loaded)."""
    if device.type == "cpu" and dtype == torch.float32:
        if gguf and cpu_ops() is not None:
            return "gguf"
        return "auto" if cpu_has_native_bf16() else "fp16"
    return FORMAT_OF_DTYPE.get(dtype)


def check_weights(weights: str, gguf: bool, device: torch.device, dtype: torch.dtype) -> str:
    """``weights`` if the model can be stored so, else an ``InvalidArgumentError`` that says why."""
    if weights not in WEIGHT_FORMATS:
        raise InvalidArgumentError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if weights == "gguf":
        if not gguf:
            raise InvalidArgumentError("weights='gguf' keeps a GGUF file's blocks: load a .gguf file or a named model")
        if device.type != "cpu" or dtype != torch.float32:
            raise InvalidArgumentError(f"weights='gguf' runs on a CPU under float32 activations, not {device} {dtype}")
        if cpu_ops() is None:
            raise InvalidArgumentError("weights='gguf' needs kvmemory's CPU kernels (x86-64 with AVX2, a C++ compiler)")
    return weights


def weight_format(model: nn.Module) -> str:
    """How ``model``'s decoder linear layers store their weights ("gguf", "int4", "fp16", ...)."""
    head = model.get_output_embeddings()
    for module in model.modules():
        if type(module) is GgufLinear:
            return "gguf"
        if type(module) in (Int4Linear, PackedInt4Linear):
            return "int4"
        if type(module) is PackedFp16Linear and module is not head:
            return "fp16"
        if type(module) in (nn.Linear, SixteenBitLinear) and module is not head:
            return FORMAT_OF_DTYPE.get(module.weight.dtype, str(module.weight.dtype))
    return "fp32"


def store_linear_weights(model: nn.Module, weights: str) -> nn.Module:
    """Swap every linear layer of ``model`` for a 16-bit or int4 one when ``weights`` is narrower than the
    activations. The output head is kept in fp16 under bf16 and int4 weights: logits of 10–30 would be
    rounded to steps of 0.06–0.125 in bf16 (8× finer in fp16, far inside its range); a tied head gets its own
    copy. fp16 weights, the head's included, run fbgemm's fp16 GEMM under fp32 activations on an x86 CPU
    (``PackedFp16Linear``: only the weight is rounded). int4 runs on CPU only (``int4_layer``: kvmemory's
    kernel or torch's CPU one); a layer whose inputs do not split into groups of 32 keeps fp16. Under "gguf"
    the layers still ``nn.Linear`` (a GGUF file's weights whose blocks are not kept) get fp16 too."""
    if weights not in WEIGHT_FORMATS:
        raise InvalidArgumentError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    activations = next(model.parameters()).dtype
    on_cpu = next(model.parameters()).device.type == "cpu"
    if weights in ("int4", "auto") and not on_cpu:
        raise InvalidArgumentError(
            f"weights={weights!r} runs a CPU int4 kernel (kvmemory's or torch's); on an accelerator: bf16, fp16"
        )
    dtype = {"fp32": torch.float32, **SIXTEEN_BIT}.get(weights, torch.float16)  # gguf, int4, auto: the rest in fp16
    if dtype == activations and weights not in ("int4", "auto"):
        return model
    if dtype.itemsize > activations.itemsize:
        raise InvalidArgumentError(f"weights={weights!r} is wider than the model's {activations}; pass dtype too")
    head = model.get_output_embeddings()
    packed_fp16 = activations == torch.float32 and on_cpu and (cpu_ops() is not None or cpu_has_fbgemm())
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            four_bit = weights in ("int4", "auto") and child is not head and child.in_features % INT4_GROUP == 0
            replaced = int4_layer(child, only_if_exact=weights == "auto") if four_bit else None
            wanted = torch.float16 if child is head and weights == "bf16" else dtype
            if replaced is None and wanted == torch.float16 and packed_fp16:
                replaced = PackedFp16Linear(child)
            if replaced is None:
                replaced = SixteenBitLinear(child, wanted)
            setattr(parent, name, replaced)
    model.config.tie_word_embeddings = False  # the head's 16-bit copy no longer shares the embedding
    return model


def weights_digest(model: nn.Module) -> str:
    """sha256 of every tensor of ``model``'s state (names, shapes and bytes): which weights these are, for a
    model that came from no file with a kept digest."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().cpu().contiguous()
        digest.update(f"{name}{tuple(data.shape)}{data.dtype}".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().data if data.numel() else b"")
    return digest.hexdigest()
