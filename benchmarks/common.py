"""Helpers shared by the benchmarks: timing, tables, result files."""

from __future__ import annotations

import functools
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kvmemory import SamplingParams, run_on_compute

RESULTS = Path(__file__).parent / "results"

# The model every benchmark here runs unless it says otherwise: the results under benchmarks/results were measured
# on SmolLM2-135M, so a rerun reproduces them. (The demo runs the default coder model.)
BENCH_MODEL = "smollm2-135m"


def median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_once(session, tokens: int) -> float:
    """Seconds to decode exactly ``tokens`` greedy tokens from ``session``, which is left as it was."""
    state = session.snapshot()
    start = time.perf_counter()
    session.generate(params=SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start
    session.restore(state)
    return elapsed


def decode_seconds(sessions: dict, tokens: int, repeats: int) -> dict:
    """Median seconds to decode exactly ``tokens`` greedy tokens from each session, left as it was after every run:
    each warmed up once, then the sessions take turns run by run, so drift on a shared machine hits all."""
    for session in sessions.values():
        decode_once(session, tokens)
    times = {name: [] for name in sessions}
    for _ in range(repeats):
        for name, session in sessions.items():
            times[name].append(decode_once(session, tokens))
    return {name: statistics.median(t) for name, t in times.items()}


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": run_on_compute(torch.get_num_threads),  # what kernels get (callers run single-threaded)
        "cpu": platform.processor() or platform.machine(),
        **cpu_model(),
        "cuda": torch.cuda.is_available(),
    }


SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile")  # what kernels use


def cpu_model() -> dict:
    """The CPU's name and the vector extensions that decide which kernels are fast (Linux; else nothing):
    machines of one kind differ, so speed numbers say which CPU they came from."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {"cpu_model": fields.get("model name", ""), "cpu_flags": [f for f in SPEED_FLAGS if f in flags]}


def table(rows: list[dict], columns: list[str]) -> str:
    cells = [[str(c) for c in columns]] + [[_fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = [" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2, default=float))
    return path


@functools.cache
def bench_model_config():
    """The default model's transformers config, read from its GGUF file once (for shapes, without the weights)."""
    from transformers import AutoConfig

    from kvmemory.runtime.named_models import model_file

    path = model_file(BENCH_MODEL)
    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
