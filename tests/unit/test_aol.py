"""AOL rescaling and its fitted schedule (``ns_coefficients="aol"``): the rescaling bounds the
spectral norm by 1 and hands the first step its Gram matrix; Newton–Schulz after it is the exact
composed polynomial of the rescaled matrix (standard and Gram alike); 4 steps unless told; and
on the matrices it was fitted for, its polar error at 4 steps is below Polar Express's at 4."""

from __future__ import annotations

import pytest
import torch

import dmuon
from dmuon.coefficients import coefficient_schedule
from dmuon.orthogonalization import aol_rescale, newton_schulz, newton_schulz_flops, normalize, resolve_config
from dmuon.tools.ns_accuracy import compose, gradient_like

F64 = torch.float64


@pytest.mark.parametrize("shape", [(16, 40), (40, 40), (3, 8, 24)])
def test_aol_rescaling_bounds_the_norm_and_returns_the_rescaled_gram(shape):
    X = normalize(torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(0)))
    X = X.reshape(-1, *X.shape[-2:])
    scaled, gram = aol_rescale(X)
    assert (torch.linalg.matrix_norm(scaled, ord=2) <= 1 + 1e-12).all()
    torch.testing.assert_close(gram, scaled @ scaled.mT, rtol=1e-12, atol=1e-14)
    # it only rescales rows, and moves the spectral norm closer to 1 than the Frobenius normalization does
    ratios = scaled / X
    torch.testing.assert_close(ratios, ratios[..., :1].expand_as(ratios))
    assert (torch.linalg.matrix_norm(scaled, ord=2) > torch.linalg.matrix_norm(X, ord=2)).all()


def test_a_zero_row_stays_zero():
    X = torch.randn(1, 6, 10, dtype=torch.float16)
    X[0, 2] = 0
    scaled, gram = aol_rescale(X)
    assert scaled[0, 2].eq(0).all() and gram.isfinite().all() and scaled.isfinite().all()


@pytest.mark.parametrize("method", ["standard", "gram"])
def test_newton_schulz_after_aol_is_the_exact_polynomial_of_the_rescaled_matrix(method):
    G = torch.randn(24, 64, dtype=F64, generator=torch.Generator().manual_seed(1))
    out = newton_schulz(G, coefficients="aol", method=method, dtype=F64)
    X = aol_rescale(normalize(G)[None])[0][0]
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    expected = U @ torch.diag(compose(coefficient_schedule("aol", None), S)) @ Vh
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-11)


def test_aol_takes_four_steps_unless_told_and_a_step_less_of_flops():
    assert resolve_config((64, 256), "cpu", coefficients="aol").steps == 4
    assert resolve_config((64, 256), "cpu", coefficients="aol", steps=6).steps == 6
    assert resolve_config((64, 256), "cpu").steps == 5
    aol = newton_schulz_flops(512, 1536, steps=4, method="standard")
    assert aol == 0.8 * newton_schulz_flops(512, 1536, steps=5, method="standard")


def polar_error(out: torch.Tensor, G: torch.Tensor) -> float:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    return ((out.double() - polar).norm() / polar.norm()).item()


def test_aol_at_four_steps_beats_polar_express_at_four():
    """Gaussian and ill-conditioned matrices of the bench preset's shapes, fp32 Newton–Schulz."""
    generator = torch.Generator().manual_seed(0)
    for m, n in ((512, 512), (256, 512), (512, 1536)):
        for G in (torch.randn(m, n, generator=generator), gradient_like(m, n).float()):
            aol = polar_error(newton_schulz(G, coefficients="aol", dtype=torch.float32), G)
            four = polar_error(newton_schulz(G, steps=4, dtype=torch.float32), G)
            assert aol < four, (m, n, aol, four)


def test_the_optimizer_takes_aol_per_group():
    w, v = torch.nn.Parameter(torch.randn(8, 16)), torch.nn.Parameter(torch.randn(8, 16))
    opt = dmuon.Muon([{"params": [w], "algorithm": "muon", "ns_coefficients": "aol"},
                      {"params": [v], "algorithm": "muon"}], ns_dtype=torch.float32)
    w.grad, v.grad = torch.randn(8, 16), torch.randn(8, 16)
    opt.step()
    configs = [c for _, _, c, _ in opt.last_step_stats.ns_calls]
    assert sorted((c.aol, c.steps) for c in configs) == [(False, 5), (True, 4)]
