"""Newton–Schulz on a device against the exact polynomial it approximates: the correctness
table of the GPU check (``benchmarks/gpu_check.sh``); it runs on CPU too, which is how it is
tested.

    python -m dmuon.tools.ns_accuracy [--device cuda] [--dtype float16] [--bound 3e-2] [--shapes 512x2048,...]

For each shape, a Gaussian matrix and one with a fast-decaying spectrum (:func:`gradient_like`,
as real gradients have) go through standard and Gram NS in ``--dtype`` on ``--device``; each
result is compared with U·p(Σ)·Vᵀ computed in fp64 from the SVD (:func:`exact_polynomial`),
where p is the composed coefficient schedule. Exit status 1 if the worst relative error passes
``--bound``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from dmuon.orthogonalization import coefficient_schedule, newton_schulz

F64 = torch.float64
SHAPES = ((512, 2048), (2048, 512), (1024, 1024), (256, 4096))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖_F / ‖b‖_F in fp64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def compose(schedule: Sequence[tuple[float, float, float]], x: torch.Tensor) -> torch.Tensor:
    """The scalar polynomial of the whole schedule, applied elementwise to ``x``."""
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    return x


def exact_polynomial(G: torch.Tensor, schedule: Sequence[tuple[float, float, float]],
                     eps: float = 1e-7) -> torch.Tensor:
    """U·p(Σ)·Vᵀ in fp64 for the normalized G: what NS computes in exact arithmetic."""
    X = G.double() / (G.double().norm() + eps)
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    return U @ torch.diag(compose(schedule, S)) @ Vh


def gradient_like(m: int, n: int, seed: int = 0) -> torch.Tensor:
    """An m×n fp64 matrix with a fast-decaying spectrum (singular values 1 … 1e-3, log-spaced)."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=F64))
    V, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    k = min(m, n)
    return U[:, :k] @ torch.diag(torch.logspace(0, -3, k, dtype=F64)) @ V[:, :k].T


def accuracy_table(device: torch.device, dtype: torch.dtype = torch.float16,
                   shapes: Sequence[tuple[int, int]] = SHAPES, methods: Sequence[str] = ("standard", "gram"),
                   coefficients: str = "polar_express", steps: int = 5,
                   seed: int = 0) -> list[tuple[tuple[int, int], str, str, float]]:
    """(shape, matrix kind, method, relative error against the exact polynomial) per case."""
    schedule = coefficient_schedule(coefficients, steps)
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for m, n in shapes:
        matrices = {"gaussian": torch.randn(m, n, dtype=F64, generator=generator),
                    "gradient-like": gradient_like(m, n, seed)}
        for kind, G in matrices.items():
            expected = exact_polynomial(G, schedule)
            for method in methods:
                out = newton_schulz(G.to(device).float(), coefficients=coefficients, steps=steps, method=method,
                                    dtype=dtype)
                rows.append(((m, n), kind, method, rel(out.double().cpu(), expected)))
    return rows


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        return tuple((int(m), int(n)) for m, n in (item.lower().split("x") for item in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes are comma-separated MxN, e.g. 512x2048; got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dmuon.tools.ns_accuracy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32", "float64"])
    parser.add_argument("--bound", type=float, default=3e-2, help="largest relative error that passes")
    parser.add_argument("--shapes", type=_shapes, default=SHAPES, help="comma-separated MxN (default: %(default)s)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    worst = 0.0
    for (m, n), kind, method, err in accuracy_table(torch.device(args.device), dtype, args.shapes):
        worst = max(worst, err)
        print(f"{m}x{n} {kind:>13} {method:>8} {args.dtype} rel. error vs exact polynomial: {err:.2e}")
    print("worst", f"{worst:.2e}", "PASS" if worst <= args.bound else "FAIL")
    return 0 if worst <= args.bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
