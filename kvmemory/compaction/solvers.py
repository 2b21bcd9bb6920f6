"""Per-head solvers for Attention Matching, batched over KV heads (no Python loop per head, no scipy).

Notation (per head): span logits S (m×n, β included), Φ = exp(S − rowmax), selected slots 𝒮 (t of them).
* mass fit:   min_{B ≥ 0} ‖Φ_𝒮 B − Φ·1‖²   →  β_new = β_old + log B
* output fit: min_{C_v} ‖X C_v − softmax(S) V‖² + λ‖C_v − V_𝒮‖²,  X = softmax(S_𝒮 + log B)
  (the ridge pulls toward the kept slots' own values, which is what eviction would keep)
Heads keep different numbers of slots: selections are padded, and padded columns are masked out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvmemory.cache.plan import pad_selection

NEG_INF = float("-inf")


def gather_columns(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (H, m, n), index (H, t) → (H, m, t)."""
    return torch.gather(x, 2, index[:, None, :].expand(-1, x.shape[1], -1))


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (H, n, d), index (H, t) → (H, t, d)."""
    return torch.gather(x, 1, index[:, :, None].expand(-1, -1, x.shape[-1]))


def reduce_attention(attn: torch.Tensor, how: str = "rms") -> torch.Tensor:
    """(H, m, n) attention → (H, n) per-slot importance over the reference queries."""
    if how == "rms":
        return torch.linalg.vector_norm(attn, dim=1) / attn.shape[1] ** 0.5
    if how == "max":
        return attn.amax(dim=1)
    if how == "mean":
        return attn.mean(dim=1)
    raise ValueError(f"unknown reduction {how!r}: use rms, max or mean")


def pool_scores(scores: torch.Tensor, kernel: int, how: str = "max") -> torch.Tensor:
    """Smooth (H, n) scores over neighbouring slots (SnapKV-style), keeping the length."""
    if kernel <= 1:
        return scores
    x = scores[:, None, :].float().nan_to_num(0.0, neginf=0.0)
    pad = kernel // 2
    pooled = (
        F.max_pool1d(x, kernel, 1, pad) if how == "max" else F.avg_pool1d(x, kernel, 1, pad, count_include_pad=False)
    )
    return pooled[:, 0, : scores.shape[1]]


def _spectral_norm_sq(apply_gram, shape, dtype, device, iters: int = 20) -> torch.Tensor:
    """Largest eigenvalue of each PSD (H, t, t) Gram matrix, given as a product, by power iteration."""
    v = torch.ones(*shape, 1, dtype=dtype, device=device)
    for _ in range(iters):
        v = apply_gram(v)
        v = v / v.norm(dim=1, keepdim=True).clamp_min(1e-30)
    return (v.transpose(1, 2) @ apply_gram(v)).squeeze(-1).squeeze(-1).clamp_min(1e-30)


def nnls_box(
    a: torch.Tensor,
    y: torch.Tensor,
    col_valid: torch.Tensor,
    lo: float,
    hi: float,
    steps: int = 15,
    ridge: float = 1e-6,
) -> torch.Tensor:
    """Batched box-constrained least squares  min_{lo ≤ B ≤ hi} ‖a B − y‖².

    a (H, m, t), y (H, m), col_valid (H, t). A ridge solve, clamped to the box, refined by projected
    gradient steps of size 1/‖a‖₂². With fewer rows than columns the ridge solve and the gradient use the
    m×m side (aᵀ(aaᵀ + λI)⁻¹y is the same solution), so cost grows with m²t, not t³. Padded columns → 0.
    """
    out_dtype = a.dtype
    a, y = a.double() * col_valid[:, None, :], y.double()  # normal equations square the condition number
    heads, m, t = a.shape
    lam = ridge * (a.square().sum(dim=(1, 2)) / t).clamp_min(1e-30)  # relative to the mean Gram diagonal
    rhs = (a.transpose(1, 2) @ y[..., None]).squeeze(-1)  # (H, t)
    if m >= t:
        gram = a.transpose(1, 2) @ a  # (H, t, t)
        eye = torch.eye(t, dtype=a.dtype, device=a.device)
        b = _spd_solve(gram + lam[:, None, None] * eye + (~col_valid)[:, None, :] * eye, rhs[..., None]).squeeze(-1)

        def apply_gram(v):
            return gram @ v
    else:
        eye = torch.eye(m, dtype=a.dtype, device=a.device)
        b = (a.transpose(1, 2) @ _spd_solve(a @ a.transpose(1, 2) + lam[:, None, None] * eye, y[..., None])).squeeze(-1)

        def apply_gram(v):
            return a.transpose(1, 2) @ (a @ v)

    b = b.clamp(lo, hi)
    step = 1.0 / _spectral_norm_sq(apply_gram, (heads, t), a.dtype, a.device)
    for _ in range(steps):
        grad = apply_gram(b[..., None]).squeeze(-1) - rhs
        b = (b - step[:, None] * grad).clamp(lo, hi)
    return (b * col_valid).to(out_dtype)


def ridge_lstsq(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    """Batched min ‖x c − y‖² + λ‖c‖² for x (H, m, t), y (H, m, d); dual form when m < t.

    λ = ridge × the mean squared column norm of x (the mean diagonal of xᵀx), the same on either side."""
    return _ridge_lstsq(x.double(), y.double(), ridge).to(x.dtype)


def _ridge_lstsq(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    m, t = x.shape[1], x.shape[2]
    lam = (ridge * x.square().sum(dim=(1, 2)) / t).clamp_min(1e-30)[:, None, None]
    if m >= t:
        eye = torch.eye(t, dtype=x.dtype, device=x.device)
        return _spd_solve(x.transpose(1, 2) @ x + lam * eye, x.transpose(1, 2) @ y)
    eye = torch.eye(m, dtype=x.dtype, device=x.device)
    return x.transpose(1, 2) @ _spd_solve(x @ x.transpose(1, 2) + lam * eye, y)


def _spd_solve(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Solve a x = b for symmetric positive-definite a (ridge-regularised Gram matrices) by Cholesky."""
    factor, info = torch.linalg.cholesky_ex(a)
    if bool((info != 0).any()):  # numerically indefinite: fall back to LU
        return torch.linalg.solve(a, b)
    return torch.cholesky_solve(b, factor)


def fit_bias_and_values(
    logits: torch.Tensor,
    values: torch.Tensor,
    keep: list[torch.Tensor],
    fixed: torch.Tensor | None = None,
    beta_box: tuple[float, float] = (-3.0, 3.0),
    ridge: float = 1e-3,
    nnls_steps: int = 30,
    mass_terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention Matching's fit for the selected slots of every head.

        logits (H, m, n) fp32 span logits (existing β included, padding −∞); values (H, n, Dv).
        mass_terms: (Φ, rowmax, ΣΦ) if the caller has them already.
        fixed (H, t_max) marks selected slots that stay verbatim (pivotal tokens): their B is 1 and their
        value is the original. Returns (log B: the shift to add to each selected slot's existing β, (H, t_max),
    −∞ for padding; new values (H, t_max, Dv)).
    """
    index, sel_valid = pad_selection(keep, logits.device)
    fixed = torch.zeros_like(sel_valid) if fixed is None else fixed & sel_valid
    free = sel_valid & ~fixed

    if mass_terms is None:
        row_max = logits.amax(dim=-1, keepdim=True).clamp_min(-1e30)
        phi = torch.exp(logits - row_max)  # (H, m, n)
        row_mass = phi.sum(-1)
    else:
        phi, row_max, row_mass = mass_terms
    phi_sel = gather_columns(phi, index) * sel_valid[:, None, :]
    target_mass = row_mass - (phi_sel * fixed[:, None, :]).sum(-1)
    lo, hi = (torch.exp(torch.tensor(b)).item() for b in beta_box)
    b = nnls_box(phi_sel, target_mass, free, lo, hi, steps=nnls_steps)
    b = torch.where(fixed, torch.ones_like(b), b)
    log_b = torch.log(b.clamp_min(1e-30))

    sel_logits = gather_columns(logits, index) + log_b[:, None, :]
    sel_logits = sel_logits.masked_fill(~sel_valid[:, None, :], NEG_INF)
    x = torch.softmax(sel_logits, dim=-1).nan_to_num(0.0)  # (H, m, t)
    y = (phi @ values.float()) / row_mass.clamp_min(1e-30)[..., None]  # (H, m, Dv) block-local outputs
    v_sel = gather_rows(values.float(), index)
    x_free = x * free[:, None, :]
    # fit the correction to the kept values, so the ridge (and any direction the queries leave
    # undetermined) falls back to the original value rather than to zero
    residual = y - x @ v_sel  # x is 0 on padded columns
    fitted = v_sel + ridge_lstsq(x_free, residual, ridge)
    new_values = torch.where(free[..., None], fitted, v_sel) * sel_valid[..., None]
    return log_b.masked_fill(~sel_valid, NEG_INF), new_values


def attention_output_error(
    logits: torch.Tensor,
    values: torch.Tensor,
    keep: list[torch.Tensor],
    new_logit_shift: torch.Tensor | None,
    new_values: torch.Tensor | None,
) -> float:
    """Relative error of the span's attention output *and* mass on the reference queries after compaction.

    Output of the whole cache mixes blocks by mass, so both matter; this returns
    ‖M′O′ − M O‖ / ‖M O‖ averaged over heads (M = span mass relative to the row max).
    """
    index, sel_valid = pad_selection(keep, logits.device)
    row_max = logits.amax(-1, keepdim=True).clamp_min(-1e30)
    phi = torch.exp(logits - row_max)
    full = phi @ values.float()  # M·O (unnormalised)
    sel = gather_columns(logits, index)
    if new_logit_shift is not None:
        sel = sel + new_logit_shift[:, None, :].nan_to_num(0.0, neginf=0.0)
    phi_c = torch.exp(sel - row_max).masked_fill(~sel_valid[:, None, :], 0.0)
    v_c = new_values.float() if new_values is not None else gather_rows(values.float(), index)
    approx = phi_c @ v_c
    err = (approx - full).norm(dim=(-2, -1)) / full.norm(dim=(-2, -1)).clamp_min(1e-30)
    return float(err.mean())
