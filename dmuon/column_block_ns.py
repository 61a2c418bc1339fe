"""Distributed Newton–Schulz on column blocks: a stack that ranks hold as blocks of columns,
orthogonalized with all-reduces of m×m Gram matrices only, each rank keeping its own columns of
the result. The math takes ``all_reduce`` as a function: it never sees a process group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dmuon.orthogonalization import EXPONENT_FIELD, NSConfig, iterate, max_abs, power_of_two_scale, products


def gram_all_reduces(config: NSConfig) -> int:
    """Gram-matrix all-reduces :func:`orthogonalize_column_blocks` makes: Gram NS at the start
    and at each restart, standard NS at every step."""
    return 1 + len(config.restarts) if config.method == "gram" else config.steps



def _normalize_column_blocks(X: Tensor, eps: float, all_reduce: Callable[[Tensor], Tensor]) -> Tensor:
    """:func:`normalize` of a stack ``(B, m, n)`` that ranks hold as column blocks ``X``
    ``(B, m, n_r)`` (fp32 or fp64), with one all-reduce; this rank's columns of the result.

    No rank knows the global max|X| that :func:`normalize` scales by, and ``all_reduce`` only
    sums; so each rank sums its squares scaled by its own power of two 2^e_r (which cannot
    overflow) into slot e_r of a vector of every exponent, the ranks sum those vectors, and
    every rank reads off the same largest exponent E and ‖X‖_F/2^E = √(Σ_e S_e·4^(e−E)). The
    vector has 256 entries per matrix in fp32 (1 KiB on the wire; 2048 in fp64), a single
    collective as before.
    """
    int_dtype, _, shift, bias = EXPONENT_FIELD[X.dtype]
    levels = 2 * bias + 2  # biased exponents 0 … 2·bias+1 (the last one: inf and NaN)
    local_scale = power_of_two_scale(max_abs(X))
    level = (local_scale.view(int_dtype) >> shift).reshape(-1, 1).long()
    squares = (X / local_scale).square().sum(dim=(-2, -1)).reshape(-1, 1)
    sums = all_reduce(X.new_zeros(X.shape[0], levels).scatter_(1, level, squares))
    exponents = torch.arange(levels, device=X.device)
    top = torch.where(sums != 0, exponents, 0).amax(dim=1, keepdim=True).clamp_min(1)  # E, biased
    # 4^(e − E) for e ≤ E as bits (exact powers of two; 0 below the smallest normal, where the
    # terms are negligible, and above E, where there are none)
    relative = (2 * (exponents - top) + bias).clamp(0, bias)
    weights = (relative << shift).to(int_dtype).view(X.dtype)
    scaled_norm = (sums * weights).sum(dim=1).sqrt().reshape(-1, 1, 1)
    scale = (top << shift).to(int_dtype).view(X.dtype).reshape(-1, 1, 1)
    return (X / scale) / (scaled_norm + eps / scale)



def orthogonalize_column_blocks(X_local: Tensor, config: NSConfig, all_reduce: Callable[[Tensor], Tensor]) -> Tensor:
    """Distributed Newton–Schulz of a stack X ``(B, m, n)`` that ranks hold as column blocks
    ``X_local`` ``(B, m, n_r)``; returns this rank's columns of the result.

    Every product NS needs of the long dimension is a Gram matrix X·Xᵀ = Σ_r X_r·X_rᵀ, and every
    update is (m×m)·X_r: so the ranks all-reduce the m×m partial Gram matrices (and, once, the
    squared norms: :func:`_normalize_column_blocks`), run the m×m recurrence identically, and
    apply it to their own columns. Gram NS needs the all-reduce only at the start and at
    restarts; standard NS at every step. A row-split X
    goes through as its transpose (``orthogonalize_column_blocks(X_r.mT, ...).mT``), with
    Gram side n. ``all_reduce(t)`` returns the sum of ``t`` over the ranks (fp32 on the wire:
    partial sums of low-precision products lose less that way). Equal to :func:`orthogonalize`
    up to the order of the sums.
    """
    if X_local.ndim != 3:
        raise ValueError(f"orthogonalize_column_blocks takes a stack (B, m, n_local), got shape "
                         f"{tuple(X_local.shape)}.")
    X = _normalize_column_blocks(X_local.to(torch.promote_types(X_local.dtype, torch.float32)), config.eps,
                                 all_reduce).to(config.dtype)

    local_gram, symmetric = products(config)

    def gram(Y: Tensor) -> Tensor:
        return all_reduce(local_gram(Y).float()).to(Y.dtype)

    return iterate(X, config, gram, symmetric).to(X_local.dtype)
