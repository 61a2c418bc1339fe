"""Symmetric products for Newton–Schulz in Triton — the Gram matrix X·Xᵀ of a stack, and the
products of its polynomials (b·A + c·A², R·Z, Z·R·Z) — computing only the tiles on and below
the diagonal and mirroring them: half the products of ``torch.bmm``/``baddbmm``.

Optional: used when ``dmuon.Muon(symmetric_products="triton")`` asks for it, on CUDA tensors, or
anywhere under Triton's interpreter (``TRITON_INTERPRET=1``, how CI tests it on CPU). The plain
``torch.bmm`` path is always there. Triton is imported on first use, so that dmuon never needs it
otherwise (and so that the interpreter setting, read when kernels are defined, can be made first).
"""

from __future__ import annotations

import os
from functools import cache

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


@cache
def _lower_product_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def lower_product(a_ptr, b_ptr, c_ptr, out_ptr, M, K, beta, alpha,
                      stride_ab, stride_am, stride_ak, stride_bb, stride_bm, stride_bk,
                      stride_cb, stride_cm, stride_cn, stride_ob, stride_om, stride_on,
                      HAS_C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                      ACC: tl.constexpr, PRECISION: tl.constexpr):
        # int64 offsets: a stack's batch · stride passes 2³¹ elements well before memory runs out
        batch = tl.program_id(0).to(tl.int64)
        tile_i, tile_j = tl.program_id(1), tl.program_id(2)
        if tile_j > tile_i:  # the upper triangle is the mirror image of the lower
            return
        rows_i = (tile_i * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rows_j = (tile_j * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        a = a_ptr + batch * stride_ab
        b = b_ptr + batch * stride_bb
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=ACC)
        for k0 in range(0, K, BLOCK_K):
            cols = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
            a_i = tl.load(a + rows_i[:, None] * stride_am + cols[None, :] * stride_ak,
                          mask=(rows_i[:, None] < M) & (cols[None, :] < K), other=0.0)
            b_j = tl.load(b + rows_j[:, None] * stride_bm + cols[None, :] * stride_bk,
                          mask=(rows_j[:, None] < M) & (cols[None, :] < K), other=0.0)
            acc += tl.dot(a_i, tl.trans(b_j), input_precision=PRECISION, out_dtype=ACC)
        inside = (rows_i[:, None] < M) & (rows_j[None, :] < M)
        acc = acc * alpha
        if HAS_C:
            c = c_ptr + batch * stride_cb
            acc += beta * tl.load(c + rows_i[:, None] * stride_cm + rows_j[None, :] * stride_cn,
                                  mask=inside, other=0.0).to(ACC)
        tile = acc.to(out_ptr.dtype.element_ty)
        out = out_ptr + batch * stride_ob
        # each element once, on or below the diagonal (a diagonal tile holds both triangles), and
        # its mirror: the result is exactly symmetric
        lower = inside & (rows_i[:, None] >= rows_j[None, :])
        tl.store(out + rows_i[:, None] * stride_om + rows_j[None, :] * stride_on, tile, mask=lower)
        tl.store(out + rows_j[None, :] * stride_om + rows_i[:, None] * stride_on, tile, mask=lower)

    return lower_product


def kernel_options(dtype: torch.dtype) -> dict:
    """The accumulator and product precision for inputs of ``dtype``: fp64 in fp64; fp32 in true
    fp32 ("ieee": Triton's default for fp32 is TF32, 10 mantissa bits, which ``torch.bmm`` does
    not use unless ``torch.backends.cuda.matmul.allow_tf32`` says so); bf16/fp16 on tensor
    cores into fp32."""
    import triton.language as tl

    if dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"Invalid dtype={dtype} for the symmetric products: they take float64, float32, bfloat16 "
                         "or float16.")
    if dtype == torch.float64:
        return {"ACC": tl.float64, "PRECISION": "ieee"}
    return {"ACC": tl.float32, "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _lower_product(A: Tensor, B: Tensor, C: Tensor | None, beta: float, alpha: float) -> Tensor:
    import triton

    if A.ndim != 3 or A.shape != B.shape or (C is not None and C.shape != (A.shape[0], A.shape[1], A.shape[1])):
        raise ValueError(f"symmetric products take stacks A, B (batch, m, k) of one shape and C (batch, m, m); got "
                         f"{tuple(A.shape)}, {tuple(B.shape)}, {None if C is None else tuple(C.shape)}.")
    batch, m, k = A.shape
    out = torch.empty(batch, m, m, dtype=A.dtype, device=A.device)
    tiles = triton.cdiv(m, BLOCK_M)
    c = out if C is None else C  # not read without HAS_C
    _lower_product_kernel()[(batch, tiles, tiles)](
        A, B, c, out, m, k, beta, alpha, *A.stride(), *B.stride(), *c.stride(), *out.stride(),
        HAS_C=C is not None, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, **kernel_options(A.dtype))
    return out


def symmetric_gram(X: Tensor) -> Tensor:
    """X·Xᵀ for a stack ``(B, m, k)``, accumulated in fp32 (fp64 for fp64) and returned in X's
    dtype; only the lower-triangle tiles are computed."""
    if X.ndim != 3:
        raise ValueError(f"symmetric_gram takes a stack (B, m, k), got shape {tuple(X.shape)}.")
    return _lower_product(X, X, None, 0.0, 1.0)


def symmetric_baddbmm(C: Tensor, A: Tensor, B: Tensor, *, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """``torch.baddbmm(C, A, B, beta=beta, alpha=alpha)`` for square stacks whose result is known
    to be symmetric — C symmetric, and A·B symmetric, as for polynomials of one symmetric matrix
    (R·R, R·W, W·(R·Z) in Newton–Schulz) — computing only the lower-triangle tiles, from A and
    Bᵀ (= B here: B is symmetric too, so no transpose is read). fp32 accumulation (fp64 for fp64)."""
    return _lower_product(A, B, C, beta, alpha)
