"""kvmemory's C++ CPU kernels, built once per machine into one library of ``torch.ops.kvmemory`` ops.

* ``decode_attention.cpp``: one decode step's attention over every session of a packed pass
  (``kvmemory.attention.decode_kernel``);
* ``linear_fp16.cpp``: linear layers with fp16 weights on fp32 activations (``kvmemory.runtime.weights``,
  ``PackedFp16Linear``);
* ``linear_int4.cpp``: linear layers with 4-bit weights (GGUF Q4_1's groups) on fp32 activations
  (``PackedInt4Linear``);
* ``linear_gguf.cpp``: linear layers whose weights stay in a GGUF file's quantized blocks (Q4_K, Q6_K, Q5_0,
  Q8_0), integer dot products against 8-bit input rows (``kvmemory.runtime.gguf_weights``, ``GgufLinear``);
* ``logits.cpp``: the argmax and the log-sum-exp of each row of logits (``kvmemory.runtime.logits``);
* ``rms_norm.cpp``: RMSNorm of fp32 rows (``kvmemory.runtime.forward``, ``rms_norm``);
* ``gated_mlp.cpp``: the gated MLP's silu(gate)·up (``kvmemory.runtime.forward``, ``gated_activation``);
* ``rope.cpp``: RoPE of the query and key heads, in place (``kvmemory.runtime.forward``, ``rotate``);
* ``simd.h``: the eight-float vector helpers they share.

``torch.utils.cpp_extension`` builds them with the C++ compiler torch's extensions use when the first CPU
engine is made (25 s on a 2-core AVX-512 Xeon, up to 2 minutes on slower machines, said on stderr as it
starts; then cached under ``TORCH_EXTENSIONS_DIR``, rebuilt when a source changes), for x86-64 CPUs with
AVX2, FMA and F16C; ``linear_fp16.cpp`` and ``linear_int4.cpp`` also hold a path on 16-float vectors that
they take where the CPU has AVX-512. Where they cannot be built (no compiler: one line says what to
install), or with ``KVMEMORY_CPU_KERNELS=0``, attention runs on sdpa, fp16 weights on fbgemm and int4 ones
on torch's int4 kernel.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
from contextlib import nullcontext
from pathlib import Path

import torch

from kvmemory.notices import one_time_work, warn

KERNELS = (
    "decode_attention.cpp",
    "linear_fp16.cpp",
    "linear_int4.cpp",
    "linear_gguf.cpp",
    "logits.cpp",
    "rms_norm.cpp",
    "gated_mlp.cpp",
    "rope.cpp",
)
SOURCES = [Path(__file__).with_name(name) for name in KERNELS]
HEADERS = [Path(__file__).with_name("simd.h")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # x86-64-v3: every AVX2 machine runs it
ENV_SWITCH = "KVMEMORY_CPU_KERNELS"
EXTENSION = "kvmemory_cpu_kernels"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ops": torch.ops.kvmemory once built, or None once a build failed or is off


def cpu_ops():
    """``torch.ops.kvmemory`` with the kernels loaded, built on first call; None where they are unavailable."""
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                _state["ops"] = _build()
    return _state["ops"]


def _build():
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        warn(
            "no C++ compiler (%s) found: install g++ (apt-get install g++) for kvmemory's CPU kernels; "
            "using torch's sdpa and fbgemm meanwhile (slower decoding)",
            compiler,
        )
        return None
    from torch.utils.cpp_extension import load

    put_ninja_on_path()
    flags = FLAGS + [f"-DKVMEMORY_HEADERS={headers_digest()}"]
    work = nullcontext() if _built_already() else one_time_work("building kvmemory's CPU kernels", "30 s to 2 minutes")
    try:
        with work:
            load(
                EXTENSION,
                [str(source) for source in SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
    except Exception as error:  # missing headers, a compiler that fails: sdpa and fbgemm instead, said once
        warn("kvmemory's CPU kernels could not be built (%s); using torch's sdpa and fbgemm", str(error)[:300])
        return None
    return torch.ops.kvmemory


def _built_already() -> bool:
    """Whether torch's extension cache holds a build newer than every source (then loading takes a second
    and says nothing; torch itself rebuilds when a source or a flag changes)."""
    from torch.utils.cpp_extension import _get_build_directory

    built = list(Path(_get_build_directory(EXTENSION, verbose=False)).glob(f"{EXTENSION}*.so"))
    newest_source = max(path.stat().st_mtime for path in SOURCES + HEADERS)
    return any(path.stat().st_mtime >= newest_source for path in built)


def headers_digest() -> str:
    """A digest of the shared headers: torch rebuilds an extension when its sources or flags change, not
    its headers, so the digest goes into the flags."""
    return hashlib.sha256(b"".join(path.read_bytes() for path in HEADERS)).hexdigest()[:16]


def put_ninja_on_path() -> None:
    """torch builds extensions with ninja, found on PATH: the ``ninja`` wheel's binary where none is there."""
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
