"""Prefill and decode speed on CPU: a kvmemory Session against llama.cpp on the same GGUF file and against
plain transformers, per weight format, and decode after compaction.

* ``weights``: each weight format kvmemory offers (``Engine.from_pretrained(weights=...)``): decode and
  prefill at 512 tokens, and the full-cache NLL and compaction results of ``benchmarks.quality`` (2,048-token
  windows of every text kind, SnapKV / AM under REAL / TAM at 10×) beside fp32's.
* ``contexts``: per context length, prefill and decode tok/s of a Session (default weights), llama.cpp
  through ``llama-cpp-python`` (optional: ``pip install -e ".[bench]"``; the column is skipped and the
  run says so when it is missing) and transformers (sdpa, DynamicCache, the Session's weights). Each runner
  is warmed up once, then they take turns run by run, so drift on a shared machine hits all; medians.
* ``callers``: decode at 512 tokens called from the main thread, a fresh thread per call and a long-lived
  worker thread (how a script, a server and an async API call a Session).
* ``recording``: prefill and decode at 2,048 tokens with each token's surprisal recorded (what the default
  policy's selective context reads) against without.
* ``compacted``: decode after compacting the longest context to 400 slots per head (even, and uneven heads
  of the same total) against the same session uncompacted and llama.cpp at that context, taking turns.
* ``kernels``: one token through every linear weight of a model of the default model's shapes, per kernel,
  and one pass of 8 rows (8 sessions decoding together): why kvmemory offers 16-bit and 4-bit weights and no
  int8.
* ``engines`` (``--model``, any named model or GGUF file): kvmemory against llama.cpp's own ``llama-bench`` on
  the same file and threads (``benchmarks.llama_bench``: its settings side by side), prefill of each context
  from empty and decode after it, and kvmemory's decode after compacting the longest context to 1/8 of its
  slots. Rows (``engine``, ``model``, ``phase``, ``context_tokens``, ``tokens_per_s``, ``cpu``, ``settings``)
  go to ``rows`` in the results, replacing the rows of the same model and contexts; the other sections run
  the bench model.
* ``bound`` (``--model``): the machine's read bandwidth and peak multiply-add rates (int8 and fp32, on the
  kernels' threads: ``benchmarks.peak_rate``), what a decoded token reads in each engine (weights as held, KV per
  context token) and the multiply-adds a token costs: the decode and prefill rates neither engine can pass,
  which the report sets beside the engines' rows.
* ``pauses`` (``--model``): an agent trace (``benchmarks/agent_traces``, ``billing``) sent step by step
  under a cap of 1/8 of its tokens, with the default policy and with each seed method composed as
  ``benchmarks.seed_methods`` composes it: each compaction's pause, seconds per 2,048 slots compacted, beside
  the seconds a prefill of 2,048 tokens takes on the same engine.

    python -m benchmarks.speed [--repeats 3] [--decode-tokens 32] [--contexts 512 2048 4096]
        [--skip weights kernels] [--only recording]   # --only: rerun sections, keep the rest of the saved run
    python -m benchmarks.speed --only engines --model qwen2.5-coder-1.5b --contexts 512 2048 8192 \
        --llama-bench PATH/llama-bench
    python -m benchmarks.speed --only bound pauses --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from benchmarks import llama_bench
from benchmarks.common import BENCH_MODEL, RESULTS, cpu_model, decode_once, decode_seconds, median_time, save, table
from benchmarks.peak_rate import multiply_add_rates
from benchmarks.quality import beside_the_first, scored_nll
from benchmarks.texts import source_text
from kvmemory import CompactionPlan, Engine, LayerPlan, SamplingParams, run_on_compute
from kvmemory.kernels import cpu_ops
from kvmemory.runtime.loading import gguf_source
from kvmemory.runtime.named_models import model_file, model_title
from kvmemory.runtime.weights import INT4_GROUP, Int4Linear, PackedFp16Linear, PackedInt4Linear, quantize_int4

WEIGHT_FORMATS = ["fp32", "bf16", "fp16", "int4"]
SECTIONS = ["kernels", "weights", "callers", "recording", "contexts", "compacted", "engines", "bound", "pauses"]
MODEL_SECTIONS = ["engines", "bound", "pauses"]  # run on ``--model``; the others on the bench model
ENGINE_SECTIONS = ["callers", "recording", "contexts", "compacted"]  # run on the default engine's weights


# ---- runners: each returns (prefill seconds, decode seconds) for ``ids`` then ``n`` greedy tokens ----------
def session_runner(engine, record_surprisal: bool = False):
    def run(ids, n):
        session = engine.session()
        if record_surprisal:
            session.record_surprisal()
        start = time.perf_counter()
        session.append_tokens(ids)
        prefilled = time.perf_counter()
        session.generate(params=SamplingParams(max_new_tokens=n, ignore_eos=True))
        done = time.perf_counter()
        session.close()
        return prefilled - start, done - prefilled

    return run


def transformers_runner(model):
    def run(ids, n):  # on kvmemory's compute thread, as a Session's forwards run (kvmemory.runtime.compute)
        return run_on_compute(forward, ids, n)

    def forward(ids, n):
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            start = time.perf_counter()
            out = model(torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)
            prefilled = time.perf_counter()
            for _ in range(n):
                out = model(out.logits[:, -1:].argmax(-1), cache=cache, use_cache=True, logits_to_keep=1)
            return prefilled - start, time.perf_counter() - prefilled

    return run


def llama_cpp_runner(n_ctx: int):
    """llama.cpp on the very GGUF file the default engine loads, with the thread count torch's kernels get (the
    compute thread's: callers of kvmemory run single-threaded); None if absent."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    threads = run_on_compute(torch.get_num_threads)
    llm = Llama(
        model_path=str(model_file(BENCH_MODEL)), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False
    )

    def run(ids, n):  # on the compute thread too, as every runner here
        return run_on_compute(generate, ids, n)

    def generate(ids, n):
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        prefilled = time.perf_counter()
        for _ in range(n):
            llm.eval([llm.sample(temp=0.0)])  # greedy, in llama.cpp's own sampler
        return prefilled - start, time.perf_counter() - prefilled

    return run


def alternate(runners: dict, ids: list[int], n: int, repeats: int) -> dict:
    """Median (prefill, decode) seconds per runner: one warm-up each, then the runners take turns."""
    for run in runners.values():
        run(ids, n)
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, run in runners.items():
            times[name].append(run(ids, n))
    return {name: tuple(statistics.median(t[i] for t in runs) for i in (0, 1)) for name, runs in times.items()}


# ---- sections ----------------------------------------------------------------------------------------------
def weights_section(text_ids, n_dec, repeats):
    engines = {w: Engine.from_pretrained(BENCH_MODEL, weights=w) for w in WEIGHT_FORMATS}
    sessions = {}
    for name, engine in engines.items():
        sessions[name] = engine.session()
        sessions[name].append_tokens(text_ids[:512])
    decode = decode_seconds(sessions, n_dec, repeats)
    rows = []
    for name, engine in engines.items():
        prefill = statistics.median(session_runner(engine)(text_ids[:512], 0)[0] for _ in range(repeats))
        rows.append(
            {
                "weights": name,
                "decode_tok_s": n_dec / decode[name],
                "prefill_tok_s": 512 / prefill,
                "weight_mb": weight_bytes(engine.model) / 1e6,
                "nll": scored_nll(engine),
            }
        )
    beside_the_first(rows)
    columns = ["weights", "decode_tok_s", "prefill_tok_s", "weight_mb", "max_full_nll_change", "same_method_order"]
    print(table(rows, columns), flush=True)
    return rows


def weight_bytes(model) -> int:
    """Parameters and buffers (torch's int4 layers keep their packed weights as buffers), and the packed fp16
    and int4 weights of kvmemory's kernels and fbgemm's, which are neither."""
    tensors = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    packed = (PackedFp16Linear, PackedInt4Linear)
    return tensors + sum(m.packed_bytes for m in model.modules() if isinstance(m, packed))


def contexts_section(engine, text_ids, contexts, n_dec, repeats):
    plain = engine.model  # the same weights, run by transformers' own attention and cache
    rows = []
    for ctx in contexts:
        runners = {"kvmemory": session_runner(engine)}
        llama = llama_cpp_runner(ctx + n_dec + 8)
        if llama is None and not rows:
            print("llama-cpp-python is not installed: the llama.cpp columns are skipped (pip install -e '.[bench]')")
        if llama is not None:
            runners["llama.cpp"] = llama
        runners["transformers"] = transformers_plain(plain)
        medians = alternate(runners, text_ids[:ctx], n_dec, repeats)
        row = {"context": ctx}
        for name, (prefill, decode) in medians.items():
            row[f"{name} prefill tok/s"] = ctx / prefill
            row[f"{name} decode tok/s"] = n_dec / decode
        if llama is not None:
            row["decode vs llama.cpp"] = row["kvmemory decode tok/s"] / row["llama.cpp decode tok/s"]
            row["prefill vs llama.cpp"] = row["kvmemory prefill tok/s"] / row["llama.cpp prefill tok/s"]
        rows.append(row)
        print(table([row], list(row)), flush=True)
    return rows


def callers_section(engine, text_ids, n_dec, repeats):
    """Decode at 512 tokens called from the main thread, from a fresh thread per call (a server's request)
    and from one long-lived worker (an async API's executor): the compute thread makes them equal."""
    own = session_runner(engine)

    def fresh_thread(ids, n):
        out = []
        thread = threading.Thread(target=lambda: out.append(own(ids, n)))
        thread.start()
        thread.join()
        return out[0]

    with ThreadPoolExecutor(1) as worker:

        def long_lived(ids, n):
            return worker.submit(own, ids, n).result()

        runners = {"main thread": own, "fresh thread": fresh_thread, "worker": long_lived}
        medians = alternate(runners, text_ids[:512], n_dec, repeats)
    row = {"context": 512} | {f"{name} decode tok/s": n_dec / decode for name, (_, decode) in medians.items()}
    print(table([row], list(row)), flush=True)
    return row


def recording_section(engine, text_ids, n_dec, repeats):
    """What recording each token's surprisal (the default policy's selective context) costs a session."""
    runners = {"plain": session_runner(engine), "surprisal recorded": session_runner(engine, record_surprisal=True)}
    medians = alternate(runners, text_ids[:2048], n_dec, repeats)
    row = {"context": 2048, "repeats": repeats}
    for name, (prefill, decode) in medians.items():
        row |= {f"{name} prefill tok/s": 2048 / prefill, f"{name} decode tok/s": n_dec / decode}
    row["prefill cost"] = row["plain prefill tok/s"] / row["surprisal recorded prefill tok/s"] - 1
    print(table([row], list(row)), flush=True)
    return row


def transformers_plain(model):
    """transformers' own sdpa attention over a DynamicCache, on the engine's model (restored after each run)."""
    inner = transformers_runner(model)

    def run(ids, n):
        previous = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            return inner(ids, n)
        finally:
            model.set_attn_implementation(previous)

    return run


def evenly_spaced_plan(session, slots: int, uneven: bool = False) -> CompactionPlan:
    """``slots`` evenly spaced slots per head; ``uneven``: head h of H keeps slots × (0.5 + h/(H−1)) instead
    (the same total per layer), rotated across layers."""
    n = session.cache.slots_per_head
    plans = []
    for li, layer in enumerate(session.cache.layers):
        heads = layer.num_heads
        shares = [0.5 + ((h + li) % heads) / max(heads - 1, 1) if uneven else 1.0 for h in range(heads)]
        keep = [torch.linspace(0, n - 1, round(slots * share)).round().long().unique() for share in shares]
        plans.append(LayerPlan(keep=keep))
    return CompactionPlan(plans)


def decoder(session):
    """A runner decoding ``n`` tokens from ``session`` as it stands (no prefill), leaving it as it was."""
    return lambda ids, n: (0.0, decode_once(session, n))


def compacted_section(engine, text_ids, ctx, n_dec, repeats):
    """Decode after compacting ``ctx`` tokens to 400 slots per head (even, and uneven heads of the same total)
    against the same session uncompacted and llama.cpp at that context, all taking turns run by run."""
    full, small, uneven = engine.session(), engine.session(), engine.session()
    for s in (full, small, uneven):
        s.append_tokens(text_ids[:ctx])
    small.apply_plan(evenly_spaced_plan(small, 400))
    uneven.apply_plan(evenly_spaced_plan(uneven, 400, uneven=True))
    runners = {"uncompacted": decoder(full), "compacted": decoder(small), "uneven": decoder(uneven)}
    llama = llama_cpp_runner(ctx + n_dec + 8)
    if llama is not None:
        runners["llama.cpp"] = llama
    seconds = {name: decode for name, (_, decode) in alternate(runners, text_ids[:ctx], n_dec, repeats).items()}
    row = {
        "context": ctx,
        "repeats": repeats,
        "slots": small.cache.slots_per_head,
        "uncompacted_decode_tok_s": n_dec / seconds["uncompacted"],
        "compacted_decode_tok_s": n_dec / seconds["compacted"],
        "uneven_decode_tok_s": n_dec / seconds["uneven"],
        "speedup": seconds["uncompacted"] / seconds["compacted"],
        "uneven_vs_even": seconds["compacted"] / seconds["uneven"],
        "uncompacted_kv_bytes": full.stats().kv_bytes,
        "compacted_kv_bytes": small.stats().kv_bytes,
        "uneven_kv_bytes": uneven.stats().kv_bytes,
    }
    if llama is not None:
        row["llama_cpp_decode_tok_s"] = n_dec / seconds["llama.cpp"]
        row["compacted_vs_llama_cpp"] = seconds["llama.cpp"] / seconds["compacted"]
    print(table([row], list(row)), flush=True)
    return row


def cpu_name() -> str:
    """The CPU's name and the vector extension the kernels run on, as each engine row records it."""
    info = cpu_model()
    return f"{info.get('cpu_model', '')} ({'AVX-512' if 'avx512f' in info.get('cpu_flags', ()) else 'AVX2'})"


def engines_section(
    model: str, contexts: list[int], n_dec: int, repeats: int, binary, settings, llama_phases, ubatches=None
) -> list[dict]:
    """kvmemory's rows (prefill from empty, decode after each context, decode after compacting the longest to
    1/8 of its slots; medians of ``repeats``) and llama-bench's (``llama_phases`` of them), on ``model``."""
    engine = Engine.from_pretrained(model)
    text_ids = engine.tokenizer.encode(source_text(8 * max(contexts)), add_special_tokens=False)
    if len(text_ids) < max(contexts):
        raise ValueError(f"the source text gives {len(text_ids)} tokens, {max(contexts)} were asked for")
    cpu, name = cpu_name(), model_title(model)
    threads = run_on_compute(torch.get_num_threads)
    base = {"engine": "kvmemory", "model": name, "cpu": cpu, "threads": threads, "repeats": repeats}
    rows = []
    for ctx in contexts:
        runs = [session_runner(engine)(text_ids[:ctx], n_dec) for _ in range(repeats + 1)][1:]  # one warm-up
        prefill, decode = (statistics.median(r[i] for r in runs) for i in (0, 1))
        weights = f"{engine.weights} weights, {str(engine.kv_dtype).removeprefix('torch.')} KV"
        rows.append(
            base | {"phase": "prefill", "context_tokens": ctx, "tokens_per_s": ctx / prefill, "settings": weights}
        )
        rows.append(
            base | {"phase": "decode", "context_tokens": ctx, "tokens_per_s": n_dec / decode, "settings": weights}
        )
        print(
            f"kvmemory: prefill at {ctx}: {ctx / prefill:.1f} tok/s, decode after it {n_dec / decode:.1f}", flush=True
        )
    ctx = max(contexts)
    session = engine.session()
    session.append_tokens(text_ids[:ctx])
    session.apply_plan(evenly_spaced_plan(session, ctx // 8))
    decode_once(session, n_dec)  # the first decode after a compaction lays the cache out afresh: a warm-up
    seconds = statistics.median(decode_once(session, n_dec) for _ in range(repeats))
    rows.append(
        base
        | {
            "phase": "decode",
            "context_tokens": ctx,
            "tokens_per_s": n_dec / seconds,
            "settings": f"{weights}, compacted to {ctx // 8} slots per head",
        }
    )
    print(f"kvmemory: decode after compacting {ctx} to {ctx // 8} slots: {n_dec / seconds:.1f} tok/s", flush=True)
    del session, engine
    if binary is None:
        print("no llama-bench found (--llama-bench, LLAMA_BENCH or PATH): the llama.cpp rows are skipped")
        return rows
    gguf = gguf_source(model)
    return rows + llama_bench.rows(
        binary, gguf, name, contexts, n_dec, threads, repeats, cpu, settings, llama_phases, ubatches
    )


def read_bandwidth(repeats: int = 5) -> float:
    """Bytes per second a sum over 1 GiB of fp32 reads on the kernels' threads (the median of ``repeats``)."""
    data = torch.ones(2**28)
    seconds = statistics.median(run_on_compute(lambda: median_time(data.sum, 1)) for _ in range(repeats))
    return data.numel() * 4 / seconds


def bound_section(model: str) -> dict:
    """What a decoded token must read: each engine's weights (the linear layers and the output head as held;
    an embedding lookup reads a few rows) and KV per context token, beside the machine's read bandwidth; the
    multiply-adds a token costs in the linear layers and head (one per weight), beside the machine's rates.
    llama.cpp's are its file's tensors but the embedding (the head's where it is tied) and its f16 cache."""
    from torch import nn

    from kvmemory.runtime.gguf_files import prepared
    from kvmemory.runtime.gguf_weights import GgufEmbedding, GgufLinear

    engine = Engine.from_pretrained(model)
    weights, multiply_adds = 0, 0
    for module in engine.model.modules():
        if isinstance(module, (nn.Linear, GgufLinear, PackedFp16Linear, PackedInt4Linear)):
            multiply_adds += module.in_features * module.out_features
        if isinstance(module, GgufLinear):
            weights += module.blocks.numel()
        elif isinstance(module, (PackedFp16Linear, PackedInt4Linear)):
            weights += module.packed_bytes
        elif isinstance(module, nn.Linear):
            weights += module.weight.numel() * module.weight.element_size()
        elif not isinstance(module, (nn.Embedding, GgufEmbedding)):
            weights += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
    table = json.loads((prepared(gguf_source(model)) / "tensors.json").read_text())["tensors"]
    tied = all(t["name"] != "output.weight" for t in table)
    file_weights = sum(t["bytes"] for t in table if t["name"] != "token_embd.weight" or tied)
    config = engine.config
    llama_kv = config.num_hidden_layers * 2 * config.num_key_value_heads * engine.head_dim * 2
    # each query head: a multiply-add per dimension with every key (scores) and every value (output)
    attention = config.num_hidden_layers * config.num_attention_heads * engine.head_dim * 2
    return {
        "model": model_title(model),
        "read_bytes_per_s": read_bandwidth(),
        "kvmemory_weight_bytes": weights,
        "kvmemory_kv_bytes_per_token": engine.kv_bytes_per_token,
        "llama_cpp_weight_bytes": file_weights,
        "llama_cpp_kv_bytes_per_token": llama_kv,
        "multiply_adds_per_token": multiply_adds,
        "attention_multiply_adds_per_context_token": attention,
        **multiply_add_rates(run_on_compute(torch.get_num_threads)),
        "cpu": cpu_name(),
    }


PAUSE_TRACE = "billing"
PAUSE_CONDITIONS = ["kvmemory-default", "counter-causal", "cc-lines", "am-lines", "tam-lines"]


def pauses_section(model: str, repeats: int) -> dict:
    """Each condition's compaction pauses over ``PAUSE_TRACE`` sent step by step under 1/8 of its tokens, and
    the seconds a 2,048-token prefill takes (median of ``repeats``) on the same engine."""
    from benchmarks.agent_memory import pauses_of, setup, step_through
    from benchmarks.agent_traces import load_traces

    engine = Engine.from_pretrained(model)
    ids = engine.tokenizer.encode(source_text(8 * 2048), add_special_tokens=False)[:2048]
    prefill = statistics.median(session_runner(engine)(ids, 1)[0] for _ in range(repeats + 1))
    trace = next(t for t in load_traces(trace_set="tuning") if t["name"] == PAUSE_TRACE)
    length = len(engine.session().renderer.render(trace["messages"]))
    rows = []
    for condition in PAUSE_CONDITIONS:
        engine_of, view, memory, _ = setup(engine, condition, length // 8)
        session = engine_of.session(memory=memory)
        step_through(session, view, trace["messages"], scored=0)
        pauses = pauses_of(memory)
        slots = sum(r["slots_before"] for r in session.compaction_log)
        session.close()
        rows.append(
            {
                "condition": condition,
                "compactions": len(pauses),
                "pause_median_s": statistics.median(pauses) if pauses else 0.0,
                "pause_worst_s": max(pauses, default=0.0),
                "pause_s_per_2048_slots": sum(pauses) / slots * 2048 if slots else 0.0,
            }
        )
        print(f"pauses: {condition}: {rows[-1]}", flush=True)
    return {
        "model": model_title(model),
        "trace": PAUSE_TRACE,
        "trace_tokens": length,
        "cap_tokens": length // 8,
        "prefill_s_per_2048_tokens": prefill,
        "rows": rows,
        "cpu": cpu_name(),
    }


def plot_engines(rows: list[dict]) -> None:
    """Per model and phase, kvmemory's tok/s beside llama.cpp's best setting's at each context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.4 * len(models)), squeeze=False)
    for row_axes, model in zip(axes, models):
        for ax, phase in zip(row_axes, ("prefill", "decode")):
            mine = [r for r in rows if r["model"] == model and r["phase"] == phase]
            contexts = sorted({r["context_tokens"] for r in mine})
            plain = [r for r in mine if "compacted" not in r["settings"]]
            for i, engine in enumerate(("kvmemory", "llama.cpp")):
                best = [
                    max(
                        (r["tokens_per_s"] for r in plain if r["engine"] == engine and r["context_tokens"] == c),
                        default=0,
                    )
                    for c in contexts
                ]
                ax.bar(
                    [j + 0.4 * i for j in range(len(contexts))],
                    best,
                    0.4,
                    label=engine if engine == "kvmemory" else "llama.cpp (best setting)",
                )
            ax.set_xticks([j + 0.2 for j in range(len(contexts))], [str(c) for c in contexts])
            ax.set_title(f"{model}: {phase}", fontsize=9)
            ax.set_xlabel("context tokens")
            ax.set_ylabel("tokens/s")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "speed_engines.png", dpi=120)


def kernels_section(config, repeats):
    """Milliseconds for one token, and for a pass of 8 rows, through every decoder linear layer and the output
    head, per kernel."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    shapes = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (inter, hidden), (inter, hidden)]
    shapes += [(hidden, inter)]
    shapes = shapes * config.num_hidden_layers + [(config.vocab_size, hidden)]
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=generator) * 0.02 for n, k in shapes]

    def int8_rows(w, dtype=torch.float32):  # the scales' dtype is the activations'
        scale = w.abs().amax(1) / 127
        return (w / scale[:, None]).round().to(torch.int8), scale.to(dtype)

    def int4_fp32_scales(w):  # kvmemory's int4 layout, its scales and zeros in the fp32 activations' dtype
        packed, scales_and_zeros, _ = quantize_int4(w)
        return packed, scales_and_zeros.float()

    def as_linear(w):
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        return linear

    def fbgemm_dynamic(w):
        linear = as_linear(w)
        linear.qconfig = torch.ao.quantization.default_dynamic_qconfig
        return torch.ao.nn.quantized.dynamic.Linear.from_float(linear)

    kernels = {
        "fp32": (lambda w: w, lambda x, w: F.linear(x, w)),
        "bf16": (torch.Tensor.bfloat16, lambda x, w: F.linear(x.bfloat16(), w).float()),
        "fp16": (torch.Tensor.half, lambda x, w: F.linear(x.half(), w).float()),
        "fp16 weights, fp32 activations (fbgemm)": (
            lambda w: torch.ops.quantized.linear_prepack_fp16(w.half().float(), None),
            lambda x, p: torch.ops.quantized.linear_dynamic_fp16(x, p),
        ),
        "fp16 weights, fp32 activations (kvmemory's panels)": (
            lambda w: cpu_ops().pack_fp16_weight(w.half()),
            lambda x, p: cpu_ops().linear_fp16(x, p, p.shape[0] * p.shape[2]),
        ),
        "int8 weight-only (_weight_int8pack_mm)": (int8_rows, lambda x, p: torch._weight_int8pack_mm(x, *p)),
        "int8 weight-only, bf16 activations": (
            lambda w: int8_rows(w, torch.bfloat16),
            lambda x, p: torch._weight_int8pack_mm(x.bfloat16(), *p).float(),
        ),
        "int4 weight-only (_weight_int4pack_mm_for_cpu)": (
            int4_fp32_scales,
            lambda x, p: torch._weight_int4pack_mm_for_cpu(x, p[0], INT4_GROUP, p[1]),
        ),
        "int4 weight-only, bf16 activations (Int4Linear: torch's kernel)": (
            lambda w: Int4Linear(*quantize_int4(w)[:2], w.shape[1]),
            lambda x, layer: layer(x),
        ),
        "int4 weights, fp32 activations (kvmemory's panels)": (
            lambda w: PackedInt4Linear.of(as_linear(w)),
            lambda x, layer: layer(x),
        ),
        "int8 dynamic (fbgemm)": (fbgemm_dynamic, lambda x, m: m(x)),
    }
    inputs = {n: {k: torch.randn(n, k, generator=generator) for k in {k for _, k in shapes}} for n in (1, 8)}
    rows = []
    for name, (prepare, apply) in kernels.items():
        try:
            prepared = [prepare(w) for w in weights]
        except (RuntimeError, NotImplementedError, AttributeError) as err:  # a kernel this machine lacks
            print(f"{name}: unavailable ({err})")
            continue
        row = {"kernel": name}
        for n, key in ((1, "ms_per_token"), (8, "ms_8_rows")):  # one session decoding, and eight in one pass
            calls = [(inputs[n][k], p) for (_, k), p in zip(shapes, prepared)]
            token = lambda: [apply(x, p) for x, p in calls]  # noqa: E731
            token()  # warm-up
            row[key] = 1e3 * median_time(token, max(repeats, 5))
        rows.append(row)
    print(table(rows, ["kernel", "ms_per_token", "ms_8_rows"]), flush=True)
    return rows


def plot(out: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["contexts"]
    runners = [k.removesuffix(" decode tok/s") for k in rows[0] if k.endswith(" decode tok/s")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / (len(runners) + 1)
    for i, name in enumerate(runners):
        ax.bar([j + i * width for j in range(len(rows))], [r[f"{name} decode tok/s"] for r in rows], width, label=name)
    c = out["compacted"]
    last = len(rows) - 1
    ax.bar(last + len(runners) * width, c["compacted_decode_tok_s"], width, label=f"kvmemory, {c['slots']} slots")
    ax.set_xticks([j + width * len(runners) / 2 for j in range(len(rows))], [str(r["context"]) for r in rows])
    ax.set_xlabel("context tokens")
    ax.set_ylabel("decode tokens/s")
    threads = run_on_compute(torch.get_num_threads)
    ax.set_title(f"Decode on {threads} CPU threads, default model ({out['weights_default']} weights)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(RESULTS / "speed.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--skip", nargs="*", default=[], choices=SECTIONS)
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, help="run only these sections, keeping the others from the saved run"
    )
    parser.add_argument("--model", default=BENCH_MODEL, help=f"model of {', '.join(MODEL_SECTIONS)}: name or GGUF")
    parser.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (else LLAMA_BENCH, else PATH)")
    parser.add_argument("--llama-settings", nargs="+", default=list(llama_bench.SETTINGS), choices=llama_bench.SETTINGS)
    parser.add_argument(
        "--llama-phases",
        nargs="+",
        default=["prefill", "decode"],
        choices=["prefill", "decode"],
        help="llama.cpp's runs (each prefills its contexts: at 16k, leaving out prefill saves a long run)",
    )
    parser.add_argument(
        "--llama-ubatch", type=int, nargs="+", help="llama.cpp's prefill at each of these micro-batch sizes (-ub)"
    )
    args = parser.parse_args()

    n_dec = args.decode_tokens
    run = [name for name in (args.only or SECTIONS) if name not in args.skip]
    fresh_run = {"decode_tokens": n_dec, "repeats": args.repeats}
    out = json.loads((RESULTS / "speed.json").read_text()) if args.only else fresh_run
    if any(name not in MODEL_SECTIONS for name in run):  # the bench model's sections
        engine = Engine.from_pretrained(BENCH_MODEL)
        text_ids = engine.tokenizer.encode(source_text(200_000), add_special_tokens=False)
        # the saved run's settings describe its sections; a rerun section records its own repeats
        kept = [name for name in ENGINE_SECTIONS if name in out and name not in run]
        if args.only and out.get("weights_default") != engine.weights and kept:
            parser.error(
                f"the saved run's sections {kept} used {out.get('weights_default')} weights, this engine "
                f"{engine.weights}: rerun them too"
            )
        out["weights_default"] = engine.weights
    if "kernels" in run:
        out["kernels"] = run_on_compute(kernels_section, engine.config, args.repeats)
    if "weights" in run:
        out["weights"] = weights_section(text_ids, n_dec, args.repeats)
    if "callers" in run:
        out["callers"] = callers_section(engine, text_ids, n_dec, args.repeats)
    if "recording" in run:
        out["recording"] = recording_section(engine, text_ids, n_dec, args.repeats)
    if "contexts" in run:
        out["contexts"] = contexts_section(engine, text_ids, args.contexts, n_dec, args.repeats)
    if "compacted" in run:
        out["compacted"] = compacted_section(engine, text_ids, max(args.contexts), n_dec, args.repeats)
    if "engines" in run:
        binary = llama_bench.find(args.llama_bench)
        fresh = engines_section(
            args.model,
            args.contexts,
            n_dec,
            args.repeats,
            binary,
            args.llama_settings,
            args.llama_phases,
            args.llama_ubatch,
        )
        replaced = {(r["model"], r["context_tokens"]) for r in fresh}
        out["rows"] = [r for r in out.get("rows", []) if (r["model"], r["context_tokens"]) not in replaced] + fresh
        print(table(fresh, ["engine", "phase", "context_tokens", "tokens_per_s", "settings"]))
        plot_engines(out["rows"])
    if "bound" in run:
        bound = bound_section(args.model)
        out["bound"] = [b for b in out.get("bound", []) if b["model"] != bound["model"]] + [bound]
        print(table([bound], list(bound)))
    if "pauses" in run:
        pauses = pauses_section(args.model, args.repeats)
        out["pauses"] = [p for p in out.get("pauses", []) if p["model"] != pauses["model"]] + [pauses]
        print(table(pauses["rows"], list(pauses["rows"][0])))
    if "contexts" in out:
        print()
        print(table(out["contexts"], list(out["contexts"][0])))
        plot(out)
    print(f"\nsaved {save('speed', out)}")


if __name__ == "__main__":
    main()
