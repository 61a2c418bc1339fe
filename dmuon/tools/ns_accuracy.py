"""Newton–Schulz on a device against the exact polynomial it approximates: the correctness
table of the GPU check (``benchmarks/gpu_check.sh``); it runs on CPU too, which is how it is
tested. With ``--polar-error``, each recipe's distance to the polar factor instead.

    python -m dmuon.tools.ns_accuracy [--device cuda] [--dtype float16] [--bound 3e-2] [--shapes 512x2048,...]
    python -m dmuon.tools.ns_accuracy --polar-error [--dtype float32] [--json PATH]

For each shape, a Gaussian matrix and one with a fast-decaying spectrum (:func:`gradient_like`,
as real gradients have) go through standard and Gram NS in ``--dtype`` on ``--device``; each
result is compared with U·p(Σ)·Vᵀ computed in fp64 from the SVD (:func:`exact_polynomial`),
where p is the composed coefficient schedule. Exit status 1 if the worst relative error passes
``--bound``.

``--polar-error`` runs each recipe of :data:`RECIPES` (Polar Express at 5 and 4 steps, AOL at 4,
Keller's at 5, DeepSeek-V4's 8 + 2) on Gaussian and ill-conditioned matrices of the bench preset's shapes and on the
bench model's own gradients, and reports ‖NS(G) − U·Vᵀ‖_F / ‖U·Vᵀ‖_F (over G's numerical rank)
per kind of matrix, beside the recipe's FLOPs for a 512×1536 matrix.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch

from dmuon.coefficients import coefficient_schedule
from dmuon.orthogonalization import newton_schulz, newton_schulz_flops, resolve_config

F64 = torch.float64
SHAPES = ((512, 2048), (2048, 512), (1024, 1024), (256, 4096))
BENCH_SHAPES = ((512, 512), (256, 512), (1536, 512), (512, 1536))  # the bench preset's attention and MLP
RECIPES = (("polar_express", 5), ("polar_express", 4), ("aol", 4), ("keller", 5), ("deepseek_v4", 10))
# singular values below this fraction of the largest count as zero: U·Vᵀ has no direction there
RANK_TOLERANCE = 1e-7


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


def bench_gradients(steps: int = 3, seed: int = 0) -> list[torch.Tensor]:
    """The hidden matrices' gradients of the bench preset after ``steps`` AdamW steps on synthetic
    tokens (fp64): real gradient spectra."""
    from dmuon.routing import default_route, module_roles
    from dmuon.tools.models import Llama, SyntheticTokens, get_config

    config = get_config("bench")
    model = Llama(config, seed=seed)
    roles = module_roles(model)
    matrices = [p for name, p in model.named_parameters()
                if p.ndim == 2 and default_route(p, name, roles.get(id(p))).algorithm == "muon"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = SyntheticTokens(config.vocab_size, seed=seed)
    for step in range(steps):
        inputs, targets = data.batch(step, 8, 128)
        opt.zero_grad()
        model.loss(inputs, targets).backward()
        opt.step()
    return [p.grad.detach().to(F64).clone() for p in matrices]


def polar_test_matrices(shapes: Sequence[tuple[int, int]] = BENCH_SHAPES, gradients: bool = True,
                        seed: int = 0) -> dict[str, list[torch.Tensor]]:
    """Matrices like Muon's inputs, by kind (fp64)."""
    generator = torch.Generator().manual_seed(seed)
    found = {"gaussian": [torch.randn(m, n, dtype=F64, generator=generator) for m, n in shapes],
             "ill-conditioned": [gradient_like(m, n, seed) for m, n in shapes]}
    if gradients:
        found["bench gradients"] = bench_gradients(seed=seed)
    return found


def polar_error(out: torch.Tensor, G: torch.Tensor) -> float:
    """‖out − U·Vᵀ‖_F / ‖U·Vᵀ‖_F, U·Vᵀ the polar factor of G over its numerical rank (fp64)."""
    U, S, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    rank = int((S > RANK_TOLERANCE * S.max()).sum())
    polar = U[:, :rank] @ Vh[:rank]
    return ((out.double() - polar).norm() / polar.norm()).item()


def polar_error_table(device: torch.device, dtype: torch.dtype, matrices: dict[str, list[torch.Tensor]],
                      recipes: Sequence[tuple[str, int]] = RECIPES) -> list[dict]:
    """Per recipe: its FLOPs for a 512×1536 matrix and, per kind of matrix, the mean and worst
    polar error of Newton–Schulz in ``dtype`` on ``device``."""
    rows = []
    for coefficients, steps in recipes:
        config = resolve_config((512, 1536), device.type, steps=steps, coefficients=coefficients,
                                method="standard", dtype=dtype)
        errors = {kind: [polar_error(newton_schulz(G.to(device).float(), coefficients=coefficients, steps=steps,
                                                   method="standard", dtype=dtype).cpu(), G) for G in found]
                  for kind, found in matrices.items()}
        rows.append({"recipe": coefficients, "steps": steps,
                     "flops": newton_schulz_flops(512, 1536, steps=config.steps, method="standard"),
                     "mean": {k: sum(v) / len(v) for k, v in errors.items()},
                     "worst": {k: max(v) for k, v in errors.items()}})
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
    parser.add_argument("--shapes", type=_shapes, default=None,
                        help=f"comma-separated MxN (default: {SHAPES}; with --polar-error {BENCH_SHAPES})")
    parser.add_argument("--polar-error", action="store_true",
                        help="each recipe's distance to the polar factor, beside its FLOPs, instead")
    parser.add_argument("--no-gradients", action="store_true",
                        help="--polar-error without the bench model's gradients (no model trained)")
    parser.add_argument("--json", metavar="PATH", help="--polar-error: also write the table to PATH")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    if args.polar_error:
        matrices = polar_test_matrices(args.shapes or BENCH_SHAPES, gradients=not args.no_gradients)
        rows = polar_error_table(torch.device(args.device), dtype, matrices)
        for row in rows:
            errors = ", ".join(f"{kind} {row['mean'][kind]:.3f} (worst {row['worst'][kind]:.3f})"
                               for kind in row["mean"])
            print(f"{row['recipe']} x{row['steps']}: {row['flops'] / 1e9:.2f} GFLOP per 512x1536; "
                  f"polar error {errors}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"dtype": args.dtype, "device": args.device, "rows": rows}, f, indent=1)
        return 0
    args.shapes = args.shapes or SHAPES
    worst = 0.0
    for (m, n), kind, method, err in accuracy_table(torch.device(args.device), dtype, args.shapes):
        worst = max(worst, err)
        print(f"{m}x{n} {kind:>13} {method:>8} {args.dtype} rel. error vs exact polynomial: {err:.2e}")
    print("worst", f"{worst:.2e}", "PASS" if worst <= args.bound else "FAIL")
    return 0 if worst <= args.bound else 1


if __name__ == "__main__":
    raise SystemExit(main())
