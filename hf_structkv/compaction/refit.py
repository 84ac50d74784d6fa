"""The shared final refit of a compacted head (KV-Surgeon seed §3.4 and appendix "Final refit", after Zweiger et al.).

On a fixed support ``S`` of ``t`` kept entries, two ordered solves:

1. multipliers ``w = argmin_{e^-β <= w_j <= e^β} ‖E_S w − s‖²`` (22, rows scaled by the original normalisers ``s``):
   unconstrained least squares by QR, clamped to the box, then projected-gradient steps with step ``1/‖E_S‖₂²``;
2. values ``V̂ = argmin ‖P̂ V̂ − O‖_F²`` (23) with ``P̂`` the attention over the kept entries with biases ``log w``.

Where a solve has many solutions (more kept entries than calibration queries, or dependent columns), each takes the
one nearest plain eviction (``w = 1``; the original values), not the smallest: keeping every entry then refits to
the full cache itself, and a support larger than the query set moves away from eviction only as far as the queries
ask.

Every function here works on plain float64 tensors, so the same code serves every calibrated selection rule.
"""

from __future__ import annotations

import math

import torch


def least_squares(matrix: torch.Tensor, rhs: torch.Tensor, anchor: torch.Tensor | None = None) -> torch.Tensor:
    """Least-squares solution of ``matrix @ X ≈ rhs`` closest to ``anchor`` (zero when None) where the solutions are
    many, i.e. ``anchor + argmin ‖X − anchor‖`` among the minimisers.

    Tall and numerically of full column rank (``|R_ii|`` above ``eps · max(N, k) · max|R_ii|``, the default cut-off
    of ``torch.linalg.pinv``): the unique solution by QR of ``matrix``. Wide (``N < k``) and of full row rank: the
    exact fit nearest the anchor, ``anchor + Q R⁻ᵀ (rhs − matrix @ anchor)`` from the QR of ``matrixᵀ`` (the same
    solution as the pseudo-inverse, at a fraction of an SVD's cost). Otherwise (duplicate or dependent columns or
    rows): through the pseudo-inverse.

    Args:
        matrix: ``[N, k]``.
        rhs: ``[N, r]``.
        anchor: ``[k, r]`` or None.

    Returns:
        ``[k, r]``.
    """
    rows, cols = matrix.shape
    if anchor is not None:
        return anchor + least_squares(matrix, rhs - matrix @ anchor)
    cutoff = torch.finfo(matrix.dtype).eps * max(rows, cols)
    if rows >= cols:
        q, r = torch.linalg.qr(matrix)
        diagonal = r.diagonal().abs()
        if diagonal.min() > cutoff * diagonal.max():
            return torch.linalg.solve_triangular(r, q.T @ rhs, upper=True)
    else:
        q, r = torch.linalg.qr(matrix.T)
        diagonal = r.diagonal().abs()
        if diagonal.min() > cutoff * diagonal.max():
            return q @ torch.linalg.solve_triangular(r.T, rhs, upper=False)
    return torch.linalg.pinv(matrix) @ rhs


def spectral_norm_sq(matrix: torch.Tensor, iterations: int = 3) -> torch.Tensor:
    """Estimate of ``‖matrix‖₂²`` (top eigenvalue of ``matrixᵀ matrix``) by power iteration from the all-ones vector.

    Args:
        matrix: ``[N, k]``.

    Returns:
        a scalar tensor (a lower bound of the true value; 0 for a zero matrix).
    """
    x = matrix.new_ones(matrix.shape[1])
    for _ in range(iterations):
        x = matrix.T @ (matrix @ x)
        x = x / x.norm().clamp_min(torch.finfo(matrix.dtype).tiny)
    return (matrix @ x).square().sum()


def fit_multipliers(
    unnormalized: torch.Tensor,
    row_sums: torch.Tensor,
    bias_bound: float = 3.0,
    steps: int = 2,
    power_iterations: int = 3,
) -> torch.Tensor:
    """Attention multipliers of the kept entries, ``argmin ‖E_S w − s‖²`` over the box ``[e^-β, e^β]`` (22).

    Args:
        unnormalized: ``E_S [N, t]``, ``exp(Z − rowmax Z)`` on the kept columns (row max over all ``T`` columns).
        row_sums: ``s [N]``, the row sums of ``exp(Z − rowmax Z)`` over all ``T`` columns.
        bias_bound: ``β``; the logit biases ``log w`` lie in ``[−β, β]``.
        steps: projected-gradient steps after the clamped least-squares start.
        power_iterations: power iterations estimating ``‖E_S‖₂²`` for the step size.

    Returns:
        ``w [t]`` inside the box.
    """
    low, high = math.exp(-bias_bound), math.exp(bias_bound)
    anchor = unnormalized.new_ones(unnormalized.shape[1], 1)  # eviction's multipliers
    weights = least_squares(unnormalized, row_sums[:, None], anchor).squeeze(1).clamp(low, high)
    if steps > 0:
        lipschitz = spectral_norm_sq(unnormalized, power_iterations).clamp_min(torch.finfo(unnormalized.dtype).tiny)
        for _ in range(steps):
            gradient = unnormalized.T @ (unnormalized @ weights - row_sums)
            weights = (weights - gradient / lipschitz).clamp(low, high)
    return weights


def fit_values(
    attention: torch.Tensor,
    outputs: torch.Tensor,
    relative_ridge: float = 1e-6,
    prior: torch.Tensor | None = None,
    shrinkage: float = 0.0,
) -> torch.Tensor:
    """Refit values ``V̂ = argmin ‖P̂ V̂ − O‖_F²`` (23), optionally shrunk toward ``prior``.

    Without shrinkage: by least squares (`least_squares`, nearest ``prior`` where the solutions are many); if that
    fails numerically, the normal equations
    ``(P̂ᵀP̂ + relative_ridge · ā · I) V̂ = P̂ᵀ O`` by Cholesky, ``ā`` the mean diagonal of ``P̂ᵀP̂``. With
    ``shrinkage = s > 0``: ``argmin ‖P̂ V̂ − O‖² + s ā ‖V̂ − prior‖²``, i.e. ``(P̂ᵀP̂ + s ā I) V̂ = P̂ᵀ O + s ā prior``:
    directions the calibration queries barely constrain stay at the prior (the original values: eviction) instead
    of growing without bound when ``P̂`` is ill-conditioned.

    Args:
        attention: ``P̂ [N, t]``, the compacted attention (rows sum to one).
        outputs: ``O [N, D_v]``, the original attention outputs.
        prior: ``[t, D_v]`` values to shrink toward (needed when ``shrinkage > 0``); without shrinkage, the solution
            chosen nearest them where the solutions are many.
        shrinkage: ``s >= 0``, relative to ``ā``.

    Returns:
        ``V̂ [t, D_v]``.
    """
    if shrinkage > 0:
        if prior is None:
            raise ValueError("shrinkage > 0 needs the prior values to shrink toward")
        gram = attention.T @ attention
        weight = shrinkage * gram.diagonal().mean()
        factor = torch.linalg.cholesky(gram + weight * _eye_like(gram))
        return torch.cholesky_solve(attention.T @ outputs + weight * prior.to(gram.dtype), factor)
    try:
        anchor = None if prior is None else prior.to(attention.dtype)
        solution = least_squares(attention, outputs, anchor)
        if torch.isfinite(solution).all():
            return solution
    except torch.linalg.LinAlgError:
        pass
    gram = attention.T @ attention  # [t, t]: only for the two solves that need it (t² N, the largest product here)
    factor = torch.linalg.cholesky(gram + relative_ridge * gram.diagonal().mean() * _eye_like(gram))
    return torch.cholesky_solve(attention.T @ outputs, factor)


def _eye_like(gram: torch.Tensor) -> torch.Tensor:
    return torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
