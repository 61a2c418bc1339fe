"""Update rules in one process (dmuon.rules): NorMuon equals the paper's Algorithm 1 written out
here from scratch (Keller's coefficients in fp32, the reference implementation's lr factor), its
options are checked, and its state follows the group's rule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import dmuon

KELLER = (3.4445, -4.7750, 2.0315)


def paper_normuon(weight: torch.Tensor, grads: list[torch.Tensor], lr: float, weight_decay: float, momentum: float,
                  beta2: float, eps: float = 1e-7) -> torch.Tensor:
    """NorMuon (arXiv 2510.05491, Algorithm 1) on one matrix in fp64, written from the paper: Nesterov
    momentum, five quintic Newton–Schulz steps with Keller's coefficients, the per-row second moment,
    each row divided by its RMS, the update's norm restored, √max(1, m/n) as the lr factor."""
    w, buf = weight.double().clone(), torch.zeros_like(weight, dtype=torch.float64)
    second = torch.zeros(weight.shape[0], dtype=torch.float64)
    m, n = weight.shape
    for grad in grads:
        g = grad.double()
        buf = momentum * buf + (1 - momentum) * g
        x = g + momentum * (buf - g)
        x = x / (x.norm() + eps)
        tall = m > n
        x = x.T if tall else x
        a, b, c = KELLER
        for _ in range(5):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        o = x.T if tall else x
        second = beta2 * second + (1 - beta2) * (o * o).mean(dim=1)
        normalized = o / (second.sqrt()[:, None] + 1e-10)
        normalized = normalized * o.norm() / (normalized.norm() + 1e-10)
        w = w * (1 - lr * weight_decay) - lr * math.sqrt(max(1.0, m / n)) * normalized
    return w


@pytest.mark.parametrize("shape", [(32, 16), (16, 48), (24, 24)])
def test_normuon_in_one_process_is_the_papers_algorithm(shape):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(shape))
    grads = [torch.randn(shape) for _ in range(4)]
    expected = paper_normuon(weight.detach(), grads, lr=0.05, weight_decay=0.1, momentum=0.9, beta2=0.95)
    opt = dmuon.Muon([{"params": [weight], "algorithm": "muon"}], lr=0.05, weight_decay=0.1, momentum=0.9,
                     update_rule="normuon", beta2=0.95, ns_coefficients=KELLER, ns_method="standard",
                     ns_dtype=torch.float32, eps=1e-7, adjust_lr_fn="original")
    for g in grads:
        weight.grad = g.clone()
        opt.step()
    error = ((weight.detach().double() - expected).norm() / expected.norm()).item()
    assert error < 1e-5, error  # fp32 rounding against fp64
    assert opt.state[weight]["row_second_moment"].shape == (shape[0],)


def test_normuon_differs_from_muon_and_equalizes_the_rows():
    torch.manual_seed(0)
    grad = torch.randn(16, 32) * torch.logspace(-2, 1, 16)[:, None]  # rows of very different scales
    steps = {}
    for rule in ("muon", "normuon"):
        w = nn.Parameter(torch.zeros(16, 32))
        opt = dmuon.Muon([{"params": [w], "algorithm": "muon"}], lr=1.0, weight_decay=0.0, update_rule=rule,
                         ns_dtype=torch.float32)
        w.grad = grad.clone()
        opt.step()
        steps[rule] = -w.detach()
    muon_rows, normuon_rows = steps["muon"].norm(dim=1), steps["normuon"].norm(dim=1)
    assert (normuon_rows.max() / normuon_rows.min()) < 1.01 < (muon_rows.max() / muon_rows.min())
    torch.testing.assert_close(steps["normuon"].norm(), steps["muon"].norm(), rtol=1e-5, atol=0)  # norm restored


def test_a_group_algorithm_normuon_and_the_constructor_switch():
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8))
    both = dmuon.Muon(model, update_rule="normuon")
    assert all(g["update_rule"] == "normuon" for g in both.param_groups)
    one = dmuon.Muon([{"params": [model[0].weight], "algorithm": "normuon"},
                      {"params": [model[1].weight], "algorithm": "muon"}])
    assert [g["update_rule"] for g in one.param_groups] == ["normuon", "muon"]
    assert one.param_groups[0]["algorithms"] == ["muon"]  # Muon's engine, NorMuon's rule


@pytest.mark.parametrize("options,message", [
    ({"update_rule": "adam"}, r"Invalid update_rule='adam'\. Must be one of \('muon', 'normuon'\)"),
    ({"beta2": 1.0}, r"Invalid beta2=1.0\. Must be >= 0.0 and < 1.0"),
    ({"beta2": -0.1}, r"Invalid beta2=-0.1"),
])
def test_bad_rule_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        dmuon.Muon([{"params": [nn.Parameter(torch.randn(4, 4))], "algorithm": "muon"}], **options)


def test_bad_rule_options_in_a_group_name_the_group():
    w = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"Invalid beta2=2 in param group 0"):
        dmuon.Muon([{"params": [w], "beta2": 2}])
    with pytest.raises(ValueError, match=r"algorithm='normuon' and update_rule='muon' disagree in param group 0"):
        dmuon.Muon([{"params": [w], "algorithm": "normuon", "update_rule": "muon"}])
    with pytest.raises(ValueError, match=r"Invalid algorithm='adam' in param group 0\. Must be one of "
                                         r"\('muon', 'adamw', 'normuon'\)"):
        dmuon.Muon([{"params": [w], "algorithm": "adam"}])


def test_switching_the_rule_creates_and_drops_its_state():
    w = nn.Parameter(torch.randn(8, 4))
    opt = dmuon.Muon([{"params": [w], "algorithm": "muon"}], ns_dtype=torch.float32)
    w.grad = torch.randn(8, 4)
    opt.step()
    assert set(opt.state[w]) == {"momentum_buffer"}
    opt.param_groups[0]["update_rule"] = "normuon"
    opt.step()
    assert opt.state[w]["row_second_moment"].shape == (8,) and opt.state[w]["row_second_moment"].gt(0).all()
    opt.param_groups[0]["update_rule"] = "muon"
    opt.step()
    assert set(opt.state[w]) == {"momentum_buffer"}


def test_an_old_state_dict_without_the_rule_keys_loads_as_muon():
    """A state dict saved before update rules existed has no ``update_rule``/``beta2``: it was Muon's."""
    w = nn.Parameter(torch.randn(8, 4))
    opt = dmuon.Muon([{"params": [w], "algorithm": "muon"}], ns_dtype=torch.float32)
    w.grad = torch.randn(8, 4)
    opt.step()
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["update_rule"], group["beta2"], group["momentum_dtype"]
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["update_rule"] == "muon" and opt.param_groups[0]["beta2"] == 0.95
    assert opt.param_groups[0]["momentum_dtype"] is None


@pytest.mark.parametrize("dtype,view,shape,rows", [(torch.float64, "auto", (8, 4), (8,)),
                                                   (torch.bfloat16, "auto", (8, 4), (8,)),
                                                   (torch.float32, "flatten", (8, 4, 6), (8,)),
                                                   (torch.float32, "batch", (2, 3, 4, 5), (2, 3, 4))])
def test_normuon_row_state_is_fp32_one_number_per_row(dtype, view, shape, rows):
    w = nn.Parameter(torch.randn(shape, dtype=dtype))
    opt = dmuon.Muon([{"params": [w], "algorithm": "normuon", "matrix_view": view}])
    w.grad = torch.randn(shape, dtype=dtype)
    opt.step()
    state = opt.state[w]["row_second_moment"]
    assert w.dtype == dtype and state.dtype == torch.float32 and state.shape == rows and state.gt(0).all()


def test_a_state_dict_round_trip_keeps_the_fp32_row_state_of_bf16_weights():
    """torch's load casts state to the parameter's dtype; NorMuon's row state stays fp32, bit for bit."""
    w = nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16))
    opt = dmuon.Muon([{"params": [w], "algorithm": "normuon"}])
    w.grad = torch.randn(8, 4, dtype=torch.bfloat16)
    opt.step()
    saved = opt.state[w]["row_second_moment"].clone()
    fresh = dmuon.Muon([{"params": [w], "algorithm": "normuon"}])
    fresh.load_state_dict(opt.state_dict())
    loaded = fresh.state[w]["row_second_moment"]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, saved)
    assert fresh.state[w]["momentum_buffer"].dtype == torch.bfloat16
