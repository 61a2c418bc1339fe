"""Symmetric products for Newton–Schulz in Triton: the Gram matrix X·Xᵀ of a stack, computing only
the tiles on and below the diagonal and mirroring them — half the products of ``torch.bmm``.

Optional: used when ``dmuon.Muon(symmetric_products="triton")`` asks for it, on CUDA tensors, or
anywhere under Triton's interpreter (``TRITON_INTERPRET=1``, how CI tests it on CPU). The plain
``torch.bmm`` path is always there. Triton is imported on first use, so that dmuon never needs it
otherwise (and so that the interpreter setting, read when kernels are defined, can be made first).
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
from torch import Tensor

BLOCK_M = 64
BLOCK_K = 32


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: Triton installed, and a CUDA device or
    the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


@lru_cache(maxsize=None)
def _gram_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gram_lower(a_ptr, c_ptr, M, K, stride_ab, stride_am, stride_ak, stride_cb, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        batch, tile_i, tile_j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if tile_j > tile_i:  # the upper triangle is the mirror image of the lower
            return
        rows_i = tile_i * BLOCK_M + tl.arange(0, BLOCK_M)
        rows_j = tile_j * BLOCK_M + tl.arange(0, BLOCK_M)
        a = a_ptr + batch * stride_ab
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            a_i = tl.load(a + rows_i[:, None] * stride_am + cols[None, :] * stride_ak,
                          mask=(rows_i[:, None] < M) & (cols[None, :] < K), other=0.0)
            a_j = tl.load(a + rows_j[:, None] * stride_am + cols[None, :] * stride_ak,
                          mask=(rows_j[:, None] < M) & (cols[None, :] < K), other=0.0)
            acc += tl.dot(a_i, tl.trans(a_j))
        tile = acc.to(c_ptr.dtype.element_ty)
        c = c_ptr + batch * stride_cb
        inside = (rows_i[:, None] < M) & (rows_j[None, :] < M)
        tl.store(c + rows_i[:, None] * stride_cm + rows_j[None, :] * stride_cn, tile, mask=inside)
        tl.store(c + rows_j[None, :] * stride_cm + rows_i[:, None] * stride_cn, tile, mask=inside)

    return gram_lower


def symmetric_gram(X: Tensor) -> Tensor:
    """X·Xᵀ for a stack ``(B, m, k)``, accumulated in fp32 and returned in X's dtype; only the
    lower-triangle tiles are computed."""
    import triton

    if X.ndim != 3:
        raise ValueError(f"symmetric_gram takes a stack (B, m, k), got shape {tuple(X.shape)}.")
    batch, m, k = X.shape
    out = torch.empty(batch, m, m, dtype=X.dtype, device=X.device)
    tiles = triton.cdiv(m, BLOCK_M)
    _gram_kernel()[(batch, tiles, tiles)](X, out, m, k, *X.stride(), *out.stride(), BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K)
    return out
