"""llama.cpp's own benchmark (``llama-bench``) on a GGUF file, as rows beside kvmemory's in ``benchmarks.speed``.

llama-bench is not a dependency: build it from the llama.cpp tree vendored in the ``llama-cpp-python`` sdist
(about 10 minutes on 2 cores) and pass its path (``--llama-bench``, or ``LLAMA_BENCH``, or on ``PATH``)::

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF
    cmake --build build -j2 --target llama-bench

Each setting (flash attention on or off, the KV cache in f16 or q8_0) runs prefill of each context from empty
(``-p``) and decode of ``n`` tokens after a prefilled context (``-n -d``), with the thread count kvmemory's
kernels get, and prefill at several micro-batch sizes where asked (``-ub``); every row keeps its setting, so a
reader can pick llama.cpp's best per row.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

SETTINGS = {  # name: llama-bench flags (q8_0 V needs flash attention in llama.cpp)
    "fa on, f16 KV": ["-fa", "on", "-ctk", "f16", "-ctv", "f16"],
    "fa off, f16 KV": ["-fa", "off", "-ctk", "f16", "-ctv", "f16"],
    "fa on, q8_0 KV": ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"],
}


def find(path: str | None) -> Path | None:
    """The llama-bench binary: ``path``, else ``LLAMA_BENCH``, else ``llama-bench`` on PATH; None if none."""
    candidate = path or os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench")
    return Path(candidate) if candidate and Path(candidate).is_file() else None


def run(binary: Path, gguf: Path, args: list[str], threads: int, repeats: int) -> list[dict]:
    command = [str(binary), "-m", str(gguf), "-t", str(threads), "-r", str(repeats), "-o", "json", *args]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def rows(
    binary: Path,
    gguf: Path,
    model: str,
    contexts: list[int],
    n_dec: int,
    threads: int,
    repeats: int,
    cpu: str,
    settings: list[str],
    phases: tuple[str, ...] = ("prefill", "decode"),
    ubatches: list[int] | None = None,
) -> list[dict]:
    """One row per (setting, phase, context): prefill tok/s of ``contexts`` from empty, decode tok/s of ``n_dec``
    tokens after each of ``contexts`` (each phase a run of its own: decode alone still prefills its context).
    ``ubatches``: prefill once per micro-batch size (``-ub``; llama.cpp's default is 512), a row each."""
    out = []
    for name in settings:
        flags = SETTINGS[name]
        prompts = ",".join(str(c) for c in contexts)
        results = []
        if "prefill" in phases:
            sizes = ["-ub", ",".join(str(u) for u in ubatches)] if ubatches else []
            results += run(binary, gguf, ["-p", prompts, "-n", "0", *sizes, *flags], threads, repeats)
        if "decode" in phases:
            results += run(binary, gguf, ["-p", "0", "-n", str(n_dec), "-d", prompts, *flags], threads, repeats)
        for r in results:
            prefill = r["n_gen"] == 0
            out.append(
                {
                    "engine": "llama.cpp",
                    "model": model,
                    "phase": "prefill" if prefill else "decode",
                    "context_tokens": r["n_prompt"] if prefill else r["n_depth"],
                    "tokens_per_s": r["avg_ts"],
                    "cpu": cpu,
                    "threads": r["n_threads"],
                    "settings": f"{name}, ub {r['n_ubatch']}, build {r['build_commit']}",
                    "repeats": repeats,
                }
            )
            print(
                f"llama.cpp {name}: {out[-1]['phase']} at {out[-1]['context_tokens']}: {r['avg_ts']:.1f} tok/s",
                flush=True,
            )
    return out
