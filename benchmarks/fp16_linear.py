"""fp16 weights under fp32 activations on CPU: kvmemory's kernel against fbgemm's, by rows per pass.

A packed decode pass of S sessions runs every linear layer on S rows, so what a pass costs as S grows is
what batching buys. For R rows (1 = one session decoding, 8 = eight sessions, 48+ = a prefill chunk) this
times one pass through every linear weight of a model of the default model's shapes, each layer's weights
distinct so that they stream from memory as in the model, as each kernel runs them:

* ``kvmemory``: ``kvmemory/kernels/linear_fp16.cpp`` (``PackedFp16Linear``): weights in panels of 16 output
  columns, q/k/v and gate/up fused as the engine fuses them;
* ``kvmemory_256``: the same kernel held to 8-float (AVX2) vectors, on a CPU with AVX-512 where the kernel
  otherwise takes 16-float ones (``vector_bits``; without AVX-512 the two are the same run, timed once);
* ``fbgemm``: torch's ``quantized::linear_dynamic_fp16``, the kernel fp16 weights ran on before, one call
  per projection (its packed weights do not fuse).

The kernels take turns within each round (``--repeats`` rounds, medians). Writes ``fp16_linear.json`` and
``.png``.

    python -m benchmarks.fp16_linear [--rows 1 2 4 8 16 48 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import RESULTS, bench_model_config, save, table
from kvmemory import run_on_compute
from kvmemory.kernels import cpu_ops
from kvmemory.runtime.weights import PackedFp16Linear, fuse_linears


def model_shapes():
    """The default model's linear layers: per layer (out, in) of q, k, v, o, gate, up, down, then the head."""
    config = bench_model_config()
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    per_layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden)]
    return per_layer + [(hidden, inter)], layers, (config.vocab_size, hidden)


def prepared(per_layer, layers, head):
    """Per kernel, the (weight, input features) calls of one pass: fbgemm one per projection, kvmemory's fused."""
    generator = torch.Generator().manual_seed(0)
    calls = {"fbgemm": [], "kvmemory": [], "kvmemory_256": []}
    for _ in range(layers):
        linears = []
        for out_features, in_features in per_layer:
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            linear.weight.data = torch.randn(out_features, in_features, generator=generator) * 0.02
            linears.append(linear)
            packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().half().float(), None)
            calls["fbgemm"].append((lambda x, p=packed: torch.ops.quantized.linear_dynamic_fp16(x, p), in_features))
        panels = [PackedFp16Linear(linear) for linear in linears]
        q, k, v, o, gate, up, down = panels
        for module in (fuse_linears([q, k, v]), o, fuse_linears([gate, up]), down):
            calls["kvmemory"].append((module.forward, module.in_features))
            calls["kvmemory_256"].append((held_to_256(module), module.in_features))
    head_weight = torch.randn(*head, generator=generator) * 0.02
    packed_head = torch.ops.quantized.linear_prepack_fp16(head_weight.half().float(), None)
    calls["fbgemm"].append((lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed_head), head[1]))
    head_linear = torch.nn.Linear(head[1], head[0], bias=False)
    head_linear.weight.data = head_weight
    head_module = PackedFp16Linear(head_linear)
    calls["kvmemory"].append((head_module.forward, head[1]))
    calls["kvmemory_256"].append((held_to_256(head_module), head[1]))
    if cpu_ops().linear_fp16_vector_bits() == 256:
        del calls["kvmemory_256"]
    return calls


def held_to_256(module: PackedFp16Linear):
    """The module's product on 8-float vectors only (no bias: the benchmark's layers have none)."""
    return lambda x: cpu_ops().linear_fp16(x, module.panels, module.out_features, None, vector_bits=256)


def measure(rows_list: list[int], repeats: int) -> list[dict]:
    calls = prepared(*model_shapes())
    results = []
    for rows in rows_list:
        inputs = {k: torch.randn(rows, k) for k in {k for kernel in calls.values() for _, k in kernel}}
        seconds = {name: [] for name in calls}
        for _ in range(repeats + 1):  # the first round warms up
            for name, kernel in calls.items():
                start = time.perf_counter()
                for fn, in_features in kernel:
                    fn(inputs[in_features])
                seconds[name].append(time.perf_counter() - start)
        ms = {name: 1e3 * statistics.median(times[1:]) for name, times in seconds.items()}
        row = {"rows": rows, **{f"{name}_ms": value for name, value in ms.items()}}
        row["speedup"] = ms["fbgemm"] / ms["kvmemory"]
        results.append(row)
        print(f"{rows} rows: " + ", ".join(f"{name} {value:.1f} ms" for name, value in ms.items()), flush=True)
    for row in results:
        for name in calls:
            row[f"{name}_vs_one_row"] = row[f"{name}_ms"] / results[0][f"{name}_ms"]
    print(table(results, list(results[0])), flush=True)
    return results


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    counts = [r["rows"] for r in rows]
    labels = {
        "kvmemory_ms": "kvmemory (panels, fused)",
        "kvmemory_256_ms": "kvmemory on 8-float vectors",
        "fbgemm_ms": "fbgemm fp16",
    }
    for key, label in labels.items():
        if key in rows[0]:
            ax.plot(counts, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_xlabel("rows per pass (sessions decoding at once)")
    ax.set_ylabel("ms per pass through every linear weight")
    ax.set_title("fp16 weights, fp32 activations, default model's shapes")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 48, 256])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if cpu_ops() is None or "fbgemm" not in torch.backends.quantized.supported_engines:
        parser.error("needs kvmemory's CPU kernels and fbgemm (an x86-64 CPU with AVX2 and a C++ compiler)")
    rows = run_on_compute(measure, args.rows, args.repeats)  # on the thread every CPU forward runs on
    plot(rows, RESULTS / "fp16_linear.png")
    saved = {"repeats": args.repeats, "vector_bits": cpu_ops().linear_fp16_vector_bits(), "rows": rows}
    print(f"saved {save('fp16_linear', saved)}")


if __name__ == "__main__":
    main()
