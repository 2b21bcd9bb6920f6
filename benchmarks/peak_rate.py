"""The machine's peak multiply-add rates, measured rather than quoted: ``peak_rate.c`` (int8 pairs summed as
maddubs sums them, and fp32 fused multiply-adds, in register-only chains) built with the C compiler once per
source, then run on ``threads`` threads at once (ctypes lets go of the GIL during the call).

    python -m benchmarks.peak_rate
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import threading
import time
from pathlib import Path

import torch

from kvmemory.runtime.named_models import CACHE_DIR

SOURCE = Path(__file__).with_name("peak_rate.c")
STEPS = 50_000_000  # rounds per thread: a tenth to a fifth of a second


def library() -> ctypes.CDLL:
    """``peak_rate.c`` compiled for this CPU (``-march=native``), cached by the source's digest."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    built = CACHE_DIR / "benchmarks" / f"peak_rate-{digest}.so"
    if not built.exists():
        built.parent.mkdir(parents=True, exist_ok=True)
        compiler = os.environ.get("CC", "cc")
        partial = built.with_suffix(".tmp")
        flags = ["-O2", "-march=native", "-shared", "-fPIC"]
        subprocess.run([compiler, *flags, str(SOURCE), "-o", str(partial)], check=True)
        partial.replace(built)
    lib = ctypes.CDLL(str(built))
    lib.int8_rounds.argtypes = lib.fp32_rounds.argtypes = [ctypes.c_long]
    lib.fp32_rounds.restype = ctypes.c_float
    return lib


def rate(rounds, lanes: int, chains: int, threads: int, repeats: int) -> float:
    """Multiply-adds per second of ``rounds`` run on ``threads`` threads at once: the best of ``repeats`` after
    one run that warms the cores' clocks up (a peak is what the machine reaches, not what it usually gets)."""

    def once() -> float:
        workers = [threading.Thread(target=rounds, args=(STEPS,)) for _ in range(threads)]
        started = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return STEPS * chains * lanes * threads / (time.perf_counter() - started)

    once()
    return max(once() for _ in range(repeats))


def multiply_add_rates(threads: int | None = None, repeats: int = 7) -> dict:
    """Peak int8 and fp32 multiply-adds per second on ``threads`` threads (torch's thread count by default)."""
    lib, threads = library(), threads or torch.get_num_threads()
    chains = lib.chain_count()
    return {
        "int8_multiply_adds_per_s": rate(lib.int8_rounds, lib.int8_lanes(), chains, threads, repeats),
        "fp32_multiply_adds_per_s": rate(lib.fp32_rounds, lib.fp32_lanes(), chains, threads, repeats),
    }


if __name__ == "__main__":
    for name, value in multiply_add_rates().items():
        print(f"{name}: {value / 1e9:.1f} G")
