"""KV-Surgeon's quadratic surrogate (9), (10) and its compensation-aware elimination (11), (12), (14).

``design/ALGORITHMS.md`` §1 "Surrogate" and "Compensation-aware elimination": the ridge minimiser ``B`` of the
surrogate on a support and its inverse Gram matrix ``G``, the saliency of deleting one entry, and the exact update of
both when a block of entries is deleted. Public for testing against brute force; `eliminate_greedily` is the loop of
Algorithm 1, step 4.
"""

from __future__ import annotations

import torch

SHRINK_AT = 0.75  # eliminate_greedily drops deleted rows when the live ones are at most this share


def ridge_solve(
    attention: torch.Tensor, targets: torch.Tensor, ridge: float, retries: int = 3
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Minimiser of (9) on a support and its inverse Gram matrix (10): ``G = (P_SᵀP_S + λI)^{-1}``, ``B = G P_Sᵀ Y``.

    Cholesky of ``P_SᵀP_S + λI``; on failure ``λ`` is multiplied by 10, at most ``retries`` times.

    Args:
        attention: ``P_S [N, m]``.
        targets: ``Y [N, d_v + 1]``.
        ridge: ``λ > 0``.

    Returns:
        ``(B [m, d_v + 1], G [m, m], λ used)``.
    """
    return solve_normal_equations(attention.T @ attention, attention.T @ targets, ridge, retries)


def solve_normal_equations(
    gram: torch.Tensor, moments: torch.Tensor, ridge: float, retries: int = 3
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """`ridge_solve` from ``P_SᵀP_S [m, m]`` and ``P_SᵀY [m, d_v + 1]`` (e.g. accumulated over blocks of queries).

    Returns:
        ``(B [m, d_v + 1], G [m, m], λ used)``.
    """
    identity = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    for _ in range(retries + 1):
        factor, info = torch.linalg.cholesky_ex(gram + ridge * identity)
        if info.item() == 0:
            inverse = torch.cholesky_inverse(factor)
            return inverse @ moments, inverse, ridge
        ridge *= 10
    raise torch.linalg.LinAlgError(f"Cholesky of the ridge Gram matrix failed up to λ = {ridge / 10:g}")


def saliency(coefficients: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Compensated deletion cost (11) of every entry of the support: ``s_j = ‖B_j,:‖² / G_jj``.

    Args:
        coefficients: ``B [m, d_v + 1]``.
        inverse: ``G [m, m]``.

    Returns:
        ``[m]``.
    """
    return _deletion_cost(coefficients, inverse.diagonal())


def _deletion_cost(coefficients: torch.Tensor, diagonal: torch.Tensor) -> torch.Tensor:
    """(11) from the rows ``B [r, d_v + 1]`` and the matching diagonal entries ``G_jj [r]``, ``[r]``."""
    return coefficients.square().sum(dim=1) / diagonal


def _complement(size: int, block: torch.Tensor) -> torch.Tensor:
    """Positions of ``range(size)`` not in ``block``, ascending, ``[size − |block|]``."""
    keep = torch.ones(size, dtype=torch.bool, device=block.device)
    keep[block] = False
    return keep.nonzero().squeeze(1)


def downdate_(coefficients: torch.Tensor, inverse: torch.Tensor, block: torch.Tensor) -> None:
    """In place, the compensating update (14) of deleting the rows ``J = block``, on matrices that keep their size.

    ``B ← B − G_:J G_JJ^{-1} B_J``, ``G ← G − G_:J G_JJ^{-1} G_J:``. Restricted to the remaining rows ``R`` this is
    exactly (14); the rows (and columns) of ``J`` become zero up to rounding, and rows already deleted by earlier
    calls hold values that nothing reads. No copy of ``G``: one rank-``|J|`` update, so a caller can delete many
    blocks and drop the dead rows once in a while instead of copying ``G`` at every block (`eliminate_greedily`).

    Args:
        coefficients: ``B [m, d_v + 1]``, updated in place.
        inverse: ``G [m, m]``, updated in place.
        block: ``J``, LongTensor of distinct rows in ``[0, m)`` not deleted before.
    """
    cross = inverse[:, block]
    solved = torch.linalg.solve(cross[block], torch.cat([coefficients[block], inverse[block]], 1))
    width = coefficients.shape[1]
    coefficients.addmm_(cross, solved[:, :width], alpha=-1)
    inverse.addmm_(cross, solved[:, width:], alpha=-1)


def eliminate_block(
    coefficients: torch.Tensor, inverse: torch.Tensor, block: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Delete the rows ``J = block`` from the support with the exact compensating update (14).

    ``B ← B_R − G_RJ G_JJ^{-1} B_J``, ``G ← G_RR − G_RJ G_JJ^{-1} G_JR`` with ``R`` the remaining rows (kept in
    their order): the minimiser of (9) on ``R`` and its inverse Gram matrix. The inputs are not modified.

    Args:
        coefficients: ``B [m, d_v + 1]``.
        inverse: ``G [m, m]``.
        block: ``J``, LongTensor of distinct row positions in ``[0, m)``.

    Returns:
        ``(B [m − |J|, d_v + 1], G [m − |J|, m − |J|])``.
    """
    coefficients, inverse = coefficients.clone(), inverse.clone()
    downdate_(coefficients, inverse, block)
    return _restrict(coefficients, inverse, _complement(inverse.shape[0], block))


def _restrict(
    coefficients: torch.Tensor, inverse: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B_rows [r, d_v + 1], G_rows,rows [r, r])``, ``G`` symmetrised (rounding of the updates breaks symmetry)."""
    reduced = inverse[rows][:, rows]
    return coefficients[rows], (reduced + reduced.T) / 2


def eliminate_greedily(coefficients: torch.Tensor, inverse: torch.Tensor, budget: int, block_size: int) -> torch.Tensor:
    """Greedy block elimination (11), (14) until ``budget`` rows remain (Algorithm 1, step 4): each step deletes the
    ``min(block_size, |S| − budget)`` rows of smallest saliency with the compensating update. The inputs are not
    modified.

    Blocks are deleted in place on copies (`downdate_`); the matrices are cut down to the live rows whenever those
    are at most ``SHRINK_AT`` of the stored ones, so the cost is a rank-``n_b`` update per block, not a copy of ``G``.

    Args:
        coefficients: ``B [m, d_v + 1]``.
        inverse: ``G [m, m]``.
        budget: rows to keep, ``1 <= budget <= m``.
        block_size: ``n_b``, rows deleted per step.

    Returns:
        The kept rows, ``[budget]`` LongTensor, ascending.
    """
    kept = torch.arange(inverse.shape[0], device=inverse.device)
    live = kept.clone()
    coefficients, inverse = coefficients.clone(), inverse.clone()
    while kept.numel() > budget:
        if live.numel() <= SHRINK_AT * inverse.shape[0]:
            coefficients, inverse = _restrict(coefficients, inverse, live)
            live = torch.arange(live.numel(), device=live.device)
        scores = _deletion_cost(coefficients[live], inverse.diagonal()[live])
        block = torch.topk(scores, min(block_size, kept.numel() - budget), largest=False).indices
        downdate_(coefficients, inverse, live[block])
        rest = _complement(kept.numel(), block)
        kept, live = kept[rest], live[rest]
    return kept
