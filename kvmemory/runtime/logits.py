"""What a decoded token needs from its logits: the greedy token (an argmax) and the surprisal of the token
before it (a log-sum-exp), over the whole vocabulary for every session on every step.

Both run on the compute thread after each pass, once per session in it. On one row of the default model's
49,152 logits torch's CPU ``argmax`` took ~65 µs and the surprisal's ``logsumexp`` (max, subtract, exp, sum
and log as separate passes) ~185 µs on a 2-core AVX2 EPYC; kvmemory's kernel
(``kvmemory/kernels/logits.cpp``: the argmax in one vectorised pass, the log-sum-exp in two) 26 and 56 µs,
side by side. Each row is computed alone, so a session's values do not depend on the other rows of a call.
Where the CPU kernels are unavailable, or on an accelerator, torch computes them.
"""

from __future__ import annotations

import torch

from kvmemory.kernels import cpu_ops


def _kernel_for(logits: torch.Tensor):
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return None
    return cpu_ops()


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value, (rows, V) → (rows,) int64, as ``torch.argmax``."""
    ops = _kernel_for(logits)
    return logits.argmax(-1) if ops is None else ops.argmax_rows(logits.contiguous())


def logsumexp_rows(logits: torch.Tensor) -> torch.Tensor:
    """log Σ exp of each row, (rows, V) → (rows,) fp32, as ``torch.logsumexp`` within float rounding."""
    ops = _kernel_for(logits)
    return torch.logsumexp(logits.float(), -1) if ops is None else ops.logsumexp_rows(logits.contiguous())
