"""benchmarks/fit_aol.py: the coefficients ``ns_coefficients="aol"`` uses are what the fit gives
from the lower end it chose, and the fitter's minimax quintic equioscillates."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from dmuon.coefficients import AOL_RAW

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fit_aol  # noqa: E402


def test_the_stored_schedule_is_the_fit_from_the_chosen_lower_end():
    """Its first step (each later one is fitted to the interval the earlier ones leave; all four
    take about 40 s here)."""
    chosen = torch.logspace(-3.5, -1.5, 9, dtype=torch.float64)[5].item()  # 5.62e-3, the candidate the script chose
    fitted = fit_aol.greedy_schedule(chosen, 1)
    # the reweighting amplifies the rounding of its sums, which depends on the thread count: to 1e-3
    torch.testing.assert_close(torch.tensor(fitted, dtype=torch.float64),
                               torch.tensor(AOL_RAW[:1], dtype=torch.float64), rtol=1e-3, atol=0)


def test_the_minimax_quintic_equioscillates():
    a, b, c = fit_aol.minimax_quintic(0.1, 1.0)
    x = torch.linspace(0.1, 1.0, 10001, dtype=torch.float64)
    error = 1 - (a * x + b * x**3 + c * x**5)
    peak = error.abs().max()
    # both ends and the interior extremes reach the same error, with alternating signs
    assert abs(error[0].abs() - peak) < 1e-3 * peak and abs(error[-1].abs() - peak) < 1e-3 * peak
    assert error[0] * error[-1] < 0
