"""Fit the Newton–Schulz schedule that follows AOL rescaling (``ns_coefficients="aol"``).

    python benchmarks/fit_aol.py [--steps 4] [--json PATH]

AOL rescaling (Prach & Lampert, arXiv 2208.03160) divides each row i of X by √(Σ_j |X·Xᵀ|_ij):
the result has spectral norm at most 1, like X/‖X‖_F, but its singular values lie much closer to 1,
so Newton–Schulz needs fewer steps — if its polynomials are fitted to where they now lie. This
script fits them as Polar Express fits its own (each step the odd quintic closest to 1 in the
minimax sense on the interval the previous steps leave, greedily), for a lower end ℓ of the
singular values chosen from matrices like Muon's inputs: Gaussian and ill-conditioned matrices
of the bench preset's shapes, and the bench model's own gradients. For each ℓ it composes the
schedule and measures the polar error of AOL-rescaled matrices in exact arithmetic (fp64 SVD:
‖U·p(Σ)·Vᵀ − U·Vᵀ‖_F / ‖U·Vᵀ‖_F over the matrix's numerical rank); the ℓ with the lowest mean
error over the three kinds wins, and its raw
coefficients are what ``dmuon.coefficients.AOL_RAW`` holds (the safety factor
``POLAR_EXPRESS_SAFETY`` is applied in code, as for Polar Express). As a check it prints its first
step from ℓ = 1e-3 beside Polar Express's published one (near, not equal: Polar Express's own
fit differs in details this one does not copy).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence

import torch

from dmuon.coefficients import POLAR_EXPRESS_RAW, polar_express_schedule
from dmuon.orthogonalization import aol_rescale
from dmuon.tools.ns_accuracy import RANK_TOLERANCE, compose, polar_test_matrices

F64 = torch.float64
Coefficients = tuple[float, float, float]


def minimax_quintic(lo: float, hi: float, iterations: int = 1500) -> Coefficients:
    """The odd quintic a·x + b·x³ + c·x⁵ closest to 1 on [lo, hi] in the max norm (Lawson's
    iteratively reweighted least squares on a grid dense near both ends)."""
    x = torch.cat([torch.logspace(math.log10(lo), math.log10(hi), 2000, dtype=F64),
                   torch.linspace(lo, hi, 2000, dtype=F64)]).unique()
    basis = torch.stack([x, x**3, x**5], dim=1)
    weights = torch.full_like(x, 1 / len(x))
    for _ in range(iterations):  # the weighted least-squares fit by its 3×3 normal equations
        weighted = basis * weights[:, None]
        solution = torch.linalg.lstsq(basis.T @ weighted, weighted.sum(dim=0)[:, None]).solution.squeeze(1)
        error = (1 - basis @ solution).abs()
        weights = weights * error
        weights = weights / weights.sum()
    return tuple(solution.tolist())  # type: ignore[return-value]


def greedy_schedule(lo: float, steps: int) -> list[Coefficients]:
    """Each step the minimax quintic on the interval the steps before leave, from [lo, 1]."""
    schedule, low, high = [], lo, 1.0
    for _ in range(steps):
        a, b, c = minimax_quintic(low, high)
        schedule.append((a, b, c))
        grid = torch.linspace(low, high, 20001, dtype=F64)
        image = a * grid + b * grid**3 + c * grid**5
        low, high = image.min().item(), image.max().item()
    return schedule


def polar_error(singular_values: torch.Tensor, schedule: Sequence[Coefficients]) -> float:
    """‖U·p(Σ)·Vᵀ − U·Vᵀ‖_F / ‖U·Vᵀ‖_F of a rescaled matrix with these singular values, in exact
    arithmetic, over its numerical rank."""
    kept = singular_values[singular_values > RANK_TOLERANCE * singular_values.max()]
    return ((compose(schedule, kept) - 1).square().mean()).sqrt().item()


def frobenius(G: torch.Tensor) -> torch.Tensor:
    return G / G.norm()


def aol(G: torch.Tensor) -> torch.Tensor:
    return aol_rescale(frobenius(G)[None])[0][0]


def spectra(matrices: dict[str, list[torch.Tensor]], rescale) -> dict[str, list[torch.Tensor]]:
    """Each matrix's singular values after ``rescale`` (fp64)."""
    return {kind: [torch.linalg.svdvals(rescale(G)) for G in found] for kind, found in matrices.items()}


def errors(found: dict[str, list[torch.Tensor]], schedule: Sequence[Coefficients]) -> dict[str, float]:
    """The mean polar error of each kind of matrix."""
    return {kind: sum(polar_error(S, schedule) for S in values) / len(values) for kind, values in found.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    check = minimax_quintic(1e-3, 1.0)
    print("check: the fitter from l = 1e-3 gives", [round(v, 3) for v in check], "- Polar Express's first step",
          [round(v, 3) for v in POLAR_EXPRESS_RAW[0]], flush=True)
    after_aol = spectra(polar_test_matrices(), aol)
    scores = {}
    for lo in torch.logspace(-3.5, -1.5, 9, dtype=F64).tolist():
        schedule = polar_express_schedule(args.steps, raw=greedy_schedule(lo, args.steps))
        found = errors(after_aol, schedule)
        scores[lo] = (sum(found.values()) / len(found), schedule, found)
        print(f"l = {lo:.2e}: mean polar error per kind", {k: f"{v:.3f}" for k, v in found.items()}, flush=True)
    best = min(scores, key=lambda lo: scores[lo][0])
    raw = greedy_schedule(best, args.steps)
    print(f"chosen l = {best:.3g}; raw coefficients (AOL_RAW):")
    for triple in raw:
        print("    (" + ", ".join(repr(v) for v in triple) + "),")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lower_end": best, "raw": raw, "mean_error": scores[best][2]}, f, indent=1)


if __name__ == "__main__":
    main()
