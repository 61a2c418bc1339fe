"""The small kernel choices dmuon's code makes on CPU, timed side by side against the obvious
alternative (each pair interleaved, best of several repeats, one process):

* ``max |X|`` per matrix as max(max X, −min X) (``orthogonalization.max_abs``) vs
  ``X.abs().amax()``;
* a product with the transpose of a tall matrix as a contiguous copy
  (``orthogonalization._transposed``, made once per Newton–Schulz call for the products that read
  the input) vs as the strided view, the copy's own cost, and the copy a matrix at a time vs a
  batched one;
* the quick non-finite look (``tensors.grad_norms``: one fp32-accumulated
  ``torch._foreach_norm``) vs the exact check (fp64-accumulated norms);
* for fp64 tensors, the infinity norm ``tensors.finite_flags`` takes (a maximum cannot
  overflow) vs the 2-norm: the price of exactness;
* Newton–Schulz of a stack of 16 matrices in chunks that stay in cache
  (``orthogonalization.matrices_per_chunk``) vs the whole stack at once (these pairs take at most
  3 repeats: a call is a fraction of a second).

Prints one line per choice with the ratio (alternative / dmuon's choice: above 1, dmuon's is
faster). Run: ``python benchmarks/kernel_choices.py [--threads 1] [--repeats 30]``.
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import torch

from dmuon import orthogonalization
from dmuon.orthogonalization import _transposed, max_abs, orthogonalize, resolve_config
from dmuon.tensors import grad_norms
from dmuon.timing import best_seconds

CPU = torch.device("cpu")


def compare(name: str, ours: Callable[[], object], theirs: Callable[[], object], repeats: int) -> None:
    """Interleaved, so that a noisy moment hits both."""
    a, b = [], []
    for _ in range(3):
        a.append(best_seconds(ours, CPU, repeats))
        b.append(best_seconds(theirs, CPU, repeats))
    print(f"{name:<58} dmuon {1e3 * min(a):8.3f} ms   alternative {1e3 * min(b):8.3f} ms   "
          f"ratio {min(b) / min(a):5.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} thread(s)")

    X = torch.randn(8, 512, 1536, generator=g)
    compare("max |X| of 8 x 512x1536 fp32", lambda: max_abs(X), lambda: X.abs().amax(dim=(-2, -1), keepdim=True),
            args.repeats)

    for dtype in (torch.bfloat16, torch.float32):
        W = torch.randn(1, 1536, 512, generator=g).to(dtype)  # a tall matrix: NS works on its transpose
        A = torch.randn(1, 512, 512, generator=g).to(dtype)
        Wt = _transposed(W)  # made once per Newton–Schulz call, for the products that read the input
        compare(f"{str(dtype)[6:]} (512x512)·(512x1536): contiguous vs strided operand",
                lambda: torch.bmm(A, Wt), lambda: torch.bmm(A, W.mT), args.repeats)
        copy = best_seconds(lambda: _transposed(W), CPU, args.repeats)
        print(f"{str(dtype)[6:] + ' the transposed copy itself, 1536x512':<58} dmuon {1e3 * copy:8.3f} ms")
    stack = torch.randn(8, 1536, 512, generator=g).to(torch.bfloat16)
    compare("transposed copy of 8 x 1536x512 bf16: per matrix vs batched", lambda: _transposed(stack),
            lambda: stack.mT.contiguous(), args.repeats)

    tensors = [torch.randn(512, 1536, generator=g) for _ in range(16)]
    compare("non-finite look at 16 x 512x1536 fp32: fp32 vs fp64 norms",
            lambda: ~torch.stack(grad_norms(tensors)).isfinite(),
            lambda: torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).isfinite(), args.repeats)
    wide = [t.double() for t in tensors[:4]]
    compare("fp64 4 x 512x1536: infinity norm vs the 2-norm (may overflow)",
            lambda: torch._foreach_norm(wide, float("inf")), lambda: torch._foreach_norm(wide, 2), args.repeats)

    for shape, dtype in [((16, 512, 1536), torch.bfloat16), ((16, 512, 512), torch.bfloat16),
                         ((16, 512, 1536), torch.float32)]:
        G = torch.randn(*shape, generator=g)
        config = resolve_config(shape, "cpu", dtype=dtype, method="standard")
        chunk = orthogonalization.matrices_per_chunk(*shape[1:], dtype, "cpu")
        compare(f"NS {str(dtype)[6:]} 16 x {shape[1]}x{shape[2]}: chunks of {chunk} vs the whole stack",
                lambda: orthogonalize(G, config), lambda: whole_stack(G, config), min(args.repeats, 3))


def whole_stack(G: torch.Tensor, config: orthogonalization.NSConfig) -> torch.Tensor:
    """:func:`orthogonalize` with chunks as large as the stack."""
    saved, orthogonalization.CPU_CHUNK_BYTES = orthogonalization.CPU_CHUNK_BYTES, 1 << 62
    try:
        return orthogonalize(G, config)
    finally:
        orthogonalization.CPU_CHUNK_BYTES = saved


if __name__ == "__main__":
    main()
