"""Newton–Schulz orthogonalization: the math core of Muon (no ``torch.distributed`` here).

Muon replaces a weight's update direction G = U·Σ·Vᵀ by (approximately) its polar factor U·Vᵀ.
An odd matrix polynomial applied to X = G/‖G‖_F acts on the singular values alone,
p(X) = U·p(Σ)·Vᵀ, so composing a few well-chosen quintics p_t(x) = a·x + b·x³ + c·x⁵ pushes every
singular value in (0, 1] towards 1 using matrix products only.

Two algorithms compute the same composition:

* **standard** — per step ``A = X·Xᵀ; X = a·X + (b·A + c·A²)·X``; every step touches the long
  dimension n: (4α + 2)·m³ FLOPs per step for an m×n matrix with α = n/m ≥ 1.
* **gram** — iterate on the m×m Gram matrix R = X·Xᵀ and accumulate the polynomial in Q, so that
  only the first X·Xᵀ and the final Q·X touch n: with p_t(x) = x·h_t(x²),
  Z = h_t(R), Q ← Q·Z, R ← Z·R·Z, output Q·X. Equal in exact arithmetic; cheaper for wide
  matrices. In low precision R of a near-low-rank X has small negative eigenvalues that the
  recurrence amplifies, so Gram NS *restarts* (X ← Q·X, R ← X·Xᵀ, Q ← I) at chosen steps, and
  must not run in bf16.

Every matrix is processed as a 3-D batch ``(B, m, n)`` with batched kernels. Whether a matrix
then gives bitwise the same result alone (B = 1) as stacked with others of its shape — what the
distributed engine needs to match the single-process step exactly — is up to the GEMM kernels.
On CPU it holds in bf16 (small products padded so that torch picks one kernel for every batch:
``ONEDNN_MIN_WORK``), and in fp32 and fp64 with one intra-op thread
(``torch.get_num_threads() == 1``; matrices padded to 64-byte alignment: ``ALIGNED_SIDE``) for
every shape tested (tests/unit/test_numerics_edge_cases.py; docs/concepts.md, "Exactness").
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dmuon.coefficients import (
    Coefficients,
    CoefficientsSpec,
    check_bounded,
    coefficient_schedule,
    default_gram_restarts,
    validate_restarts,
)
from dmuon.ns_defaults import NS_DTYPES, Method, choose_method
from dmuon.triton_kernels import symmetric_baddbmm, symmetric_gram, triton_usable

NORMALIZATION_EPS = 1e-7


# Bit layout of the work dtypes: (integer view, exponent field mask, mantissa bits, exponent bias).
EXPONENT_FIELD = {
    torch.float32: (torch.int32, 0x7F800000, 23, 127),
    torch.float64: (torch.int64, 0x7FF0000000000000, 52, 1023),
}


def power_of_two_scale(amax: Tensor) -> Tensor:
    """2^⌊log₂ amax⌋ (amax ≥ 0), at least the dtype's smallest normal number: the exponent bits
    of ``amax`` alone (inf for inf or NaN). Dividing by it is exact: it only shifts exponents."""
    int_dtype, mask, _, _ = EXPONENT_FIELD[amax.dtype]
    scale = (amax.view(int_dtype) & mask).view(amax.dtype)
    return scale.clamp_min(torch.finfo(amax.dtype).tiny)


def max_abs(X: Tensor) -> Tensor:
    """max |X| per matrix of a stack ``(B, m, n)``, shaped (B, 1, 1); 0 for empty matrices.

    As max(max X, −min X): two reads and no |X| temporary (faster than ``X.abs().amax()``;
    ``benchmarks/kernel_choices.py``); the same values, NaN and inf included (a matrix of −0.0
    gives −0.0, whose exponent bits are those of 0)."""
    if X.numel() == 0:
        return X.new_zeros(X.shape[0], 1, 1)
    return torch.maximum(X.amax(dim=(-2, -1), keepdim=True), X.amin(dim=(-2, -1), keepdim=True).neg_())


# Where normalize takes the plain formula on CPU: ‖G‖_F finite (no square overflowed) and at least
# this, so that max|G| ≥ ‖G‖_F/√numel ≥ 2^-60 for any matrix under 2^40 entries: the largest
# squares are normal numbers, not lost to underflow.
PLAIN_NORM_MIN = 2.0**-40


def normalize(G: Tensor, eps: float = NORMALIZATION_EPS) -> Tensor:
    """G / (‖G‖_F + eps) per matrix, in at least fp32; the zero matrix maps to zeros.

    Where the plain formula would overflow or underflow, computed as Y / (‖Y‖_F + eps/s) with
    Y = G/s and s = 2^⌊log₂ max|G|⌋: the squares in the norm cannot overflow (|Y| < 2) for any
    finite G — G/(‖G‖_F + eps) in fp32 gives exactly 0 from |G| ≈ 1.8e19 on, where ‖G‖_F
    overflows. Dividing by a power of two only shifts exponents, so for every ordinary gradient
    the two formulas give the same bits. On CUDA every matrix takes the scaled one (choosing
    would cost a host sync), and so does a compiled graph. Eager on CPU, each matrix takes the
    plain one where its norm is finite and at least ``PLAIN_NORM_MIN``: three passes over the
    matrix where the scaled formula takes five (max, min, scale, norm, divide; memory-bound on
    CPU). The choice is per matrix, so a matrix's bits do not depend on the others in its stack.
    """
    work_dtype = torch.promote_types(G.dtype, torch.float32)
    X = G.to(work_dtype)
    if work_dtype not in EXPONENT_FIELD or X.ndim < 2:
        return X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)
    if X.device.type != "cpu" or torch.compiler.is_compiling():  # no data-dependent branch in a graph
        return _normalize_scaled(X, eps)
    stack = X.reshape(-1, *X.shape[-2:])
    norms = torch.linalg.matrix_norm(stack, keepdim=True)
    out = stack / (norms + eps)
    scaled = ~(norms.isfinite() & (norms >= PLAIN_NORM_MIN)).reshape(-1)
    if scaled.any():  # a host sync, free on CPU; rare: huge, tiny, zero or non-finite matrices
        which = scaled.nonzero().squeeze(1)
        out[which] = _normalize_scaled(stack[which], eps)
    return out.reshape(X.shape)


def _normalize_scaled(X: Tensor, eps: float) -> Tensor:
    """:func:`normalize` by the scaled formula, for every matrix of ``X``."""
    stack = X.reshape(-1, *X.shape[-2:])
    scale = power_of_two_scale(max_abs(stack)).reshape(*X.shape[:-2], 1, 1)
    Y = X / scale
    return Y / (torch.linalg.matrix_norm(Y, keepdim=True) + eps / scale)


SYMMETRIC_PRODUCTS = ("torch", "triton")


# torch's CPU products take one of two kernels by size: a batched product goes to oneDNN only where
# batch·m·k·n exceeds 16³, and runs a matrix at a time on another kernel below that. The two can
# round a near tie the other way (bf16 on CPUs with AVX512-BF16 or AMX; measured with
# `python benchmarks/stack_bits.py`: a lone 16×16 Gram matrix's b·A + c·A² took the second kernel,
# a stack of two of them the first), so a small matrix's bits would depend on how many others
# share its batch. A batch below that size is therefore padded with zero matrices past it: every
# batch takes oneDNN, and zero matrices leave the others' results alone. Running every small
# product a matrix at a time instead would keep lone matrices as fast as before but made stacks of
# 64 small matrices 5–9× slower; padding costs a lone matrix one oneDNN call (about 45 µs on a
# 2-core AMD EPYC) per padded product.
ONEDNN_MIN_WORK = 16**3


def _one_kernel_batch(A: Tensor, B: Tensor) -> int:
    """How many matrices the product of stacks A·B runs as: padded past ``ONEDNN_MIN_WORK`` where
    torch's CPU kernel would otherwise depend on the batch, else A's batch."""
    batch, m, k = A.shape
    work = m * k * B.shape[-1]
    if batch * work > ONEDNN_MIN_WORK or work == 0 or A.device.type != "cpu" or torch.compiler.is_compiling():
        return batch
    return ONEDNN_MIN_WORK // work + 1


def _padded(X: Tensor, batch: int) -> Tensor:
    """``X`` with zero matrices appended up to ``batch``, laid out like ``X`` (a transposed view of a
    contiguous stack stays one: the kernels' bits depend on the operands' layout too)."""
    if not X.is_contiguous() and X.mT.is_contiguous():
        return _padded(X.mT, batch).mT
    return torch.cat([X, X.new_zeros(batch - X.shape[0], *X.shape[1:])])


def _on_one_kernel(product: Callable[..., Tensor], *operands: Tensor, **scalars: float) -> Tensor:
    """``product(*operands, **scalars)``, a batched product whose last two operands are the
    factors, on one kernel for every batch of a shape (``ONEDNN_MIN_WORK``)."""
    A, B = operands[-2:]
    batch = _one_kernel_batch(A, B)
    if batch == A.shape[0]:
        return product(*operands, **scalars)
    return product(*(_padded(t, batch) for t in operands), **scalars)[: A.shape[0]]


def _bmm(A: Tensor, B: Tensor) -> Tensor:
    return _on_one_kernel(torch.bmm, A, B)


def _baddbmm(C: Tensor, A: Tensor, B: Tensor, *, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    return _on_one_kernel(torch.baddbmm, C, A, B, beta=beta, alpha=alpha)


def _local_gram(X: Tensor) -> Tensor:
    return _bmm(X, X.mT)


# ``gram(X)`` computes X·Xᵀ (locally, or all-reduced over column blocks); ``symmetric(C, A, B,
# beta=, alpha=)`` is :func:`_baddbmm` for the products known to be symmetric (polynomials of
# one symmetric matrix), which a one-triangle kernel may compute instead.
SymmetricProduct = Callable[..., Tensor]


def products(config: NSConfig) -> tuple[Callable[[Tensor], Tensor], SymmetricProduct]:
    """The Gram and symmetric-product kernels ``config.symmetric`` asks for."""
    if config.symmetric == "triton":
        return symmetric_gram, symmetric_baddbmm
    return _local_gram, _baddbmm


def aol_rescale(X: Tensor, gram: Callable[[Tensor], Tensor] = _local_gram) -> tuple[Tensor, Tensor]:
    """AOL rescaling (Prach & Lampert, arXiv 2208.03160) of a stack ``(B, m, n)``: row i divided by
    √(Σ_j |A_ij|), A = X·Xᵀ, which bounds the spectral norm by 1 as X/‖X‖_F does, with the singular
    values much nearer 1. Returns the rescaled X and its Gram matrix D·A·D, which the first
    Newton–Schulz step takes instead of a product of its own: the rescaling costs no product."""
    A = gram(X)
    sums = A.abs().sum(dim=-1, dtype=torch.promote_types(A.dtype, torch.float32))
    scale = torch.where(sums > 0, sums.rsqrt(), 0.0)  # a zero row (padding) stays zero
    return X * scale[..., None].to(X.dtype), A * (scale[..., :, None] * scale[..., None, :]).to(A.dtype)


def _standard(X: Tensor, schedule: Sequence[Coefficients], gram: Callable[[Tensor], Tensor] = _local_gram,
              symmetric: SymmetricProduct = _baddbmm, first_gram: Tensor | None = None) -> Tensor:
    for t, (a, b, c) in enumerate(schedule):
        A = first_gram if t == 0 and first_gram is not None else gram(X)
        B = symmetric(A, A, A, beta=b, alpha=c)  # b·A + c·A²
        X = _baddbmm(X, B, X, beta=a)  # a·X + B·X
    return X


def _gram(X: Tensor, schedule: Sequence[Coefficients], restarts: Sequence[int],
          gram: Callable[[Tensor], Tensor] = _local_gram, symmetric: SymmetricProduct = _baddbmm,
          first_gram: Tensor | None = None) -> Tensor:
    # Z_t = a·I + W_t with W_t = b·R + c·R². The a·I term never goes through a low-precision
    # product: it enters as the beta of baddbmm (Q·Z = a·Q + Q·W, R·Z = a·R + R·W), whose
    # scaling and accumulation the kernel does at its accumulator precision.
    R = gram(X) if first_gram is None else first_gram
    Q: Tensor | None = None  # None stands for the identity
    steps = len(schedule)
    for t, (a, b, c) in enumerate(schedule):
        if t in restarts:
            X = _bmm(Q, X)
            R = gram(X)
            Q = None
        W = symmetric(R, R, R, beta=b, alpha=c)
        if Q is None:
            Q = W.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = _baddbmm(Q, Q, W, beta=a)
        if t + 1 < steps and t + 1 not in restarts:
            RZ = symmetric(R, R, W, beta=a)
            R = symmetric(RZ, W, RZ, beta=a)  # Z·R·Z
            # Z·R·Z is symmetric in exact arithmetic; dropping the rounding's antisymmetric
            # part costs m² and cuts the fp16 error (docs/numerics.md §Gram Newton–Schulz).
            R = (R + R.mT) * 0.5
    assert Q is not None
    return _bmm(Q, X)


@dataclass(frozen=True)
class NSConfig:
    """A fully resolved orthogonalization recipe for one matrix shape (hashable: matrices with
    equal configs and shapes can share one batched call)."""

    schedule: tuple[Coefficients, ...]
    method: Method
    dtype: torch.dtype
    restarts: tuple[int, ...] = ()
    eps: float = NORMALIZATION_EPS
    symmetric: str = "torch"  # how X·Xᵀ is computed: torch.bmm, or the Triton lower-triangle kernel
    aol: bool = False  # AOL rescaling after the normalization (ns_coefficients="aol")

    @property
    def steps(self) -> int:
        return len(self.schedule)


def resolve_config(
    shape: Sequence[int],
    device_type: str,
    *,
    steps: int | None = None,
    coefficients: CoefficientsSpec = "polar_express",
    method: str = "auto",
    dtype: torch.dtype | None = None,
    restarts: Sequence[int] | None = None,
    eps: float = NORMALIZATION_EPS,
    symmetric: str = "torch",
) -> NSConfig:
    """Validate the user-facing options and resolve them for one matrix shape and device."""
    if symmetric not in SYMMETRIC_PRODUCTS:
        raise ValueError(f"Invalid symmetric_products={symmetric!r}. Must be one of {SYMMETRIC_PRODUCTS}.")
    if symmetric == "triton" and not triton_usable(torch.device(device_type)):
        raise ValueError("symmetric_products='triton' needs Triton installed and a CUDA device "
                         f"(or Triton's interpreter, TRITON_INTERPRET=1); got device {device_type!r}.")
    if len(shape) < 2:
        raise ValueError(f"Newton–Schulz needs a matrix or a stack of matrices, got shape {tuple(shape)}.")
    if not eps > 0:
        raise ValueError(f"Invalid {eps=}. Must be > 0.0.")
    if dtype is not None and dtype not in NS_DTYPES:
        raise ValueError(f"Invalid ns_dtype={dtype!r}. Must be one of {[str(d) for d in NS_DTYPES]} or None.")
    schedule = coefficient_schedule(coefficients, steps)
    check_bounded(schedule)
    resolved, compute_dtype = choose_method(shape, method, dtype, device_type)
    if resolved == "gram":
        restarts = default_gram_restarts(coefficients, len(schedule)) if restarts is None else restarts
        positions = validate_restarts(restarts, len(schedule))
    else:
        positions = ()
    return NSConfig(schedule, resolved, compute_dtype, positions, float(eps), symmetric, aol=coefficients == "aol")


def orthogonalize(G: Tensor, config: NSConfig) -> Tensor:
    """Run a resolved :class:`NSConfig` on a matrix ``(m, n)`` or a stack ``(..., m, n)``."""
    if G.ndim < 2:
        raise ValueError(f"Newton–Schulz needs a matrix or a stack of matrices, got shape {tuple(G.shape)}.")
    if G.numel() == 0:
        return torch.zeros_like(G)
    batch_shape, (m, n) = G.shape[:-2], G.shape[-2:]
    stack = G.reshape(-1, m, n)
    pieces = stack.shape[0] // matrices_per_chunk(m, n, config.dtype, G.device.type)  # near-equal chunks
    if pieces <= 1 or torch.compiler.is_compiling():
        X = _orthogonalize_stack(stack, config).reshape(*batch_shape, m, n)
        if X.dtype == G.dtype and X.is_contiguous():
            return X
        return torch.empty(X.shape, dtype=G.dtype, device=X.device).copy_(X)
    out = torch.empty(stack.shape, dtype=G.dtype, device=G.device)
    for rows, matrices in zip(out.tensor_split(pieces), stack.tensor_split(pieces)):
        rows.copy_(_orthogonalize_stack(matrices, config))
    return out.reshape(*batch_shape, m, n)


# On CPU a batched product runs one matrix after another, so each Newton–Schulz step sweeps the
# whole stack three times (X·Xᵀ, the polynomial, its product with X): a stack larger than the
# cache goes to memory on every sweep. Chunks whose working set (X, X·Xᵀ, the polynomial, the
# new X) stays within this many bytes keep it in cache: 10–20 % faster for stacks of 16 matrices
# of 512×512 or 512×1536 in bf16 (`python benchmarks/kernel_choices.py` measures chunked and whole).
# A chunk holds at least two matrices, so that no chunk runs a matrix alone where the whole stack
# would not: lone and stacked matrices were compared bit for bit only for the shapes of
# benchmarks/stack_bits.py (equal there; small products are padded, see ONEDNN_MIN_WORK).
CPU_CHUNK_BYTES = 8 << 20


def matrices_per_chunk(m: int, n: int, dtype: torch.dtype, device_type: str) -> int:
    """The fewest m×n matrices :func:`orthogonalize` runs through Newton–Schulz at once when it
    splits a stack: on CPU as many as keep the working set within ``CPU_CHUNK_BYTES``, at least
    two; elsewhere all of them (a GPU wants the largest batch)."""
    if device_type != "cpu":
        return sys.maxsize
    small, large = sorted((m, n))
    working_set = 2 * (small * large + small * small) * dtype.itemsize
    return max(2, CPU_CHUNK_BYTES // working_set)


def _orthogonalize_stack(stack: Tensor, config: NSConfig) -> Tensor:
    """Normalize and orthogonalize a stack ``(B, m, n)``: the result in ``config.dtype``, shaped
    like ``stack`` (transposed in memory for tall matrices)."""
    X = normalize(stack, config.eps).to(config.dtype)
    tall = stack.shape[-2] > stack.shape[-1]
    if tall:
        X = _transposed(X)
    m, n = X.shape[-2:]
    X = _aligned(X)
    gram, symmetric = products(config)
    X = iterate(X, config, gram, symmetric)
    X = X[:, :m, :n]
    # a tall result is the transpose of what the products left: the caller lays it out row-major
    # in its cast (one pass over the narrow dtype), not in every later copy of its rows. Always
    # row-major, even where no cast is needed: on CPU, adding a bf16 update into a parameter
    # rounds differently for strided and contiguous operands, and replicas must get the same bits.
    return X.mT if tall else X


# MKL's fp32 and fp64 products can round a matrix by where it lies in memory, even at one thread:
# a matrix on a 64-byte boundary (a lone one, or the first of a stack) and one off it (the later
# matrices of a stack whose matrices are not a multiple of 64 bytes) got other bits (on a 2-core
# AMD EPYC, 30 of 50 9×130 fp32 matrices differed stacked from alone; 20 of 50 in fp64). On CPU,
# Newton–Schulz in these dtypes therefore pads each matrix with zero rows and columns to sides that
# are multiples of ALIGNED_SIDE: every matrix of a stack and of its m×m products then starts on a
# 64-byte boundary. The zero rows and columns stay zero through every step and leave the rest
# unchanged in exact arithmetic.
ALIGNED_SIDE = 4


def _aligned(X: Tensor) -> Tensor:
    """The stack ``(B, m, n)`` padded with zero rows and columns to sides that are multiples of
    ``ALIGNED_SIDE``, where its products would otherwise depend on the matrices' alignment."""
    if X.device.type != "cpu" or X.dtype not in (torch.float32, torch.float64) or torch.compiler.is_compiling():
        return X
    missing_rows, missing_columns = -X.shape[-2] % ALIGNED_SIDE, -X.shape[-1] % ALIGNED_SIDE
    if not (missing_rows or missing_columns):
        return X
    return torch.nn.functional.pad(X, (0, missing_columns, 0, missing_rows))


def _transposed(X: Tensor) -> Tensor:
    """Each matrix of a stack ``(B, m, n)`` transposed, for the products: on CPU a contiguous
    copy, a matrix at a time, made once per Newton–Schulz call for the products that read the
    input (the first step's, and Gram NS's restarts): where strided operands slow those, it pays,
    and a 2-D copy takes torch's blocked transpose where a batched one is slower. On some CPUs
    strided operands cost nothing and the copy is a small loss (``benchmarks/kernel_choices.py``
    measures both). CUDA's products read strided operands at full speed: there it
    stays a view."""
    if X.device.type != "cpu":
        return X.mT
    out = X.new_empty(X.shape[0], X.shape[2], X.shape[1])
    for matrix, transposed in zip(X, out):
        transposed.copy_(matrix.T)
    return out


def iterate(X: Tensor, config: NSConfig, gram: Callable[[Tensor], Tensor], symmetric: SymmetricProduct) -> Tensor:
    """The Newton–Schulz steps of ``config`` on a normalized stack, after AOL rescaling where the
    recipe asks for it (its Gram matrix then serves the first step)."""
    first = None
    if config.aol:
        X, first = aol_rescale(X, gram)
    if config.method == "gram":
        return _gram(X, config.schedule, config.restarts, gram, symmetric, first)
    return _standard(X, config.schedule, gram, symmetric, first)


def newton_schulz(
    G: Tensor,
    *,
    steps: int | None = None,
    coefficients: CoefficientsSpec = "polar_express",
    method: str = "auto",
    dtype: torch.dtype | None = None,
    restarts: Sequence[int] | None = None,
    eps: float = NORMALIZATION_EPS,
) -> Tensor:
    """Approximate polar factor U·Vᵀ of a matrix ``(m, n)`` or a stack ``(..., m, n)``.

    Args:
        G: input; any floating dtype. The result has G's shape and dtype.
        steps: number of polynomial steps T (1–99); None: the recipe's (5; 4 for "aol", 10
            for "deepseek_v4").
        coefficients: "polar_express" (default, safety factor 1.05), "keller", "you", "aol"
            (AOL rescaling, then a schedule fitted to it), "deepseek_v4" (Keller's quintic,
            then two stabilizing steps), one (a, b, c), or a sequence of triples (the last
            repeats).
        method: "standard", "gram", or "auto" (Gram NS for aspect ratios from
            GRAM_MIN_ASPECT on, when the compute dtype allows it).
        dtype: compute dtype; default from :func:`default_dtype`. Normalization is always
            done in at least fp32.
        restarts: Gram NS restart steps; default from :func:`default_gram_restarts`.
        eps: added to ‖G‖_F before dividing.
    """
    config = resolve_config(
        G.shape, G.device.type, steps=steps, coefficients=coefficients, method=method,
        dtype=dtype, restarts=restarts, eps=eps,
    )
    return orthogonalize(G, config)


def newton_schulz_flops(
    m: int, n: int, *, steps: int, method: Method, restarts: Sequence[int] = (), gram_side: int | None = None
) -> int:
    """Dense-GEMM FLOPs of one m×n orthogonalization (one multiply-add = 2 FLOPs).

    Counts the products the implementation above runs: standard T·(4m²n + 2m³) for the wide
    orientation; Gram 2·m²n per pass over the long side (initial X·Xᵀ, final Q·X, two per
    restart) plus 2m³ per m×m product. ``gram_side``: the side the m×m products are on, when
    the caller fixes it (:func:`orthogonalize_column_blocks` on a block of n columns);
    default the smaller one. An empty Gram side (``gram_side`` 0) costs 0.
    """
    if gram_side is None:
        m, n = min(m, n), max(m, n)
    else:  # an empty matrix (gram_side 0) costs nothing
        m, n = gram_side, m * n // gram_side if gram_side else 0
    if method == "standard":
        return steps * (4 * m * m * n + 2 * m**3)
    long_passes = 2 + 2 * len(restarts)
    square_products = 0
    fresh_q = True
    for t in range(steps):
        if t in restarts:
            fresh_q = True
        square_products += 1 if fresh_q else 2  # R², then Q·W unless Q is fresh
        fresh_q = False
        if t + 1 < steps and t + 1 not in restarts:
            square_products += 2  # R·Z and Z·(R·Z)
    return long_passes * 2 * m * m * n + square_products * 2 * m**3
