"""dmuon.Muon as a drop-in for torch.optim.Muon: its newer arguments (``adjust_lr_fn=
"spectral_unclamped"``, ``use_addmm``), the same exception types for the same misuse, and its
state dicts loading with the momentum carried over."""

from __future__ import annotations

import copy
import inspect
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import dmuon
from dmuon.hyperparameters import adjusted_lr_ratio
from dmuon.reference import ReferenceMuon

# the settings under which dmuon computes what torch.optim.Muon computes (docs/migration.md)
AS_TORCH = dict(ns_coefficients="keller", ns_method="standard", ns_dtype=torch.bfloat16, adjust_lr_fn="original",
                weight_decay=0.1)


def matrices(seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(16, 8, generator=g)), nn.Parameter(torch.randn(8, 24, generator=g))]


def set_grads(params: list[nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def test_spectral_unclamped_scales_by_the_square_root_of_the_aspect_ratio_without_a_floor():
    assert adjusted_lr_ratio("spectral_unclamped", 16, 4) == 2.0
    assert adjusted_lr_ratio("spectral_unclamped", 4, 16) == 0.5  # "original" would keep 1 here
    assert adjusted_lr_ratio("original", 4, 16) == 1.0
    params, ref_params = matrices(), matrices()
    hp = dict(lr=0.05, adjust_lr_fn="spectral_unclamped", ns_method="standard", ns_dtype=torch.float32)
    opt, ref = dmuon.Muon([{"params": params, "algorithm": "muon"}], **hp), ReferenceMuon(ref_params, **hp)
    for step in range(2):
        set_grads(params, step)
        set_grads(ref_params, step)
        opt.step()
        ref.step()
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_addmm", [False, True])
def test_use_addmm_is_accepted_and_changes_nothing(use_addmm):
    """dmuon's Newton–Schulz always fuses its products (what torch's use_addmm=True selects)."""
    runs = []
    for options in ({}, {"use_addmm": use_addmm}):
        params = matrices()
        opt = dmuon.Muon([{"params": params, "algorithm": "muon"}], **options)
        set_grads(params, 0)
        opt.step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    dmuon.Muon([{"params": matrices(), "algorithm": "muon", "use_addmm": use_addmm}])  # a group may carry it
    with pytest.raises(ValueError, match="Invalid use_addmm='yes'. Must be a bool."):
        dmuon.Muon(matrices(), use_addmm="yes")
    with pytest.raises(ValueError, match="Invalid use_addmm=1 in param group 0. Must be a bool."):
        dmuon.Muon([{"params": matrices(), "use_addmm": 1}])


def W(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape))


SHARED = W(4, 4)
MISUSE = {  # torch.optim.Muon and dmuon.Muon raise the same type for each (at construction or the first step)
    "negative lr": lambda: ([W(4, 4)], dict(lr=-1.0)),
    "a Tensor lr of two elements": lambda: ([W(4, 4)], dict(lr=torch.tensor([1.0, 2.0]))),
    "negative momentum": lambda: ([W(4, 4)], dict(momentum=-0.1)),
    "negative weight decay": lambda: ([W(4, 4)], dict(weight_decay=-0.1)),
    "an unknown adjust_lr_fn": lambda: ([W(4, 4)], dict(adjust_lr_fn="cubic")),
    "ns_steps of 100": lambda: ([W(4, 4)], dict(ns_steps=100)),
    "two coefficients": lambda: ([W(4, 4)], dict(ns_coefficients=(1.0, 2.0))),
    "no parameters": lambda: ([], {}),
    "a bare tensor for params": lambda: (W(4, 4), {}),
    "a number among the params": lambda: ([1], {}),
    "named and unnamed groups": lambda: ([{"params": [("a", W(4, 4))]}, {"params": [W(4, 4)]}], {}),
    "named and unnamed in a group": lambda: ([("a", W(4, 4)), W(4, 4)], {}),
    "a parameter in two groups": lambda: ([{"params": [SHARED]}, {"params": [SHARED]}], {}),
    "a non-leaf tensor": lambda: ([W(4, 4) * 2], {}),
    "a complex parameter": lambda: ([nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))], {}),
}


def error_type(optimizer_class, make) -> type | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            params, options = make()
            opt = optimizer_class(params, **options)
            for group in opt.param_groups:
                for p in group["params"]:
                    p.grad = torch.ones_like(p)
            opt.step()
        except Exception as err:  # noqa: BLE001 - the type is what is compared
            return type(err)
    return None


@pytest.mark.parametrize("case", sorted(MISUSE))
def test_the_same_misuse_raises_the_same_exception_type_as_torch(case):
    expected = error_type(torch.optim.Muon, MISUSE[case])
    assert expected is not None
    assert error_type(dmuon.Muon, MISUSE[case]) is expected


def train_torch_muon(steps: int = 3) -> tuple[list[nn.Parameter], torch.optim.Muon]:
    params = matrices()
    opt = torch.optim.Muon(params, lr=0.02, weight_decay=0.1)
    for step in range(steps):
        set_grads(params, step)
        opt.step()
    return params, opt


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_torch_muon_state_dict_loads_with_its_momentum_and_hyperparameters(nesterov):
    params, torch_opt = train_torch_muon()
    for group in torch_opt.param_groups:
        group["lr"], group["nesterov"] = 0.03, nesterov  # as a scheduler or the user left them
    saved = copy.deepcopy(torch_opt.state_dict())  # as torch.save and torch.load give it: no shared tensors
    mine = [nn.Parameter(p.detach().clone()) for p in params]
    opt = dmuon.Muon([{"params": mine, "algorithm": "muon"}], **AS_TORCH)
    opt.load_state_dict(saved)
    for p, q in zip(params, mine):
        assert torch.equal(opt.state[q]["momentum_buffer"], torch_opt.state[p]["momentum_buffer"])
    assert opt.param_groups[0]["lr"] == 0.03 and opt.param_groups[0]["nesterov"] is nesterov
    assert opt.param_groups[0]["ns_coefficients"] == (3.4445, -4.775, 2.0315)
    assert opt.param_groups[0]["ns_dtype"] == "bfloat16"  # dmuon's own options stay
    set_grads(params, 3)
    set_grads(mine, 3)
    before = [p.detach().clone() for p in params]
    torch_opt.step()
    opt.step()
    for p, q, b in zip(params, mine, before):  # the next step continues alike (both normalize in bf16)
        assert (q - p).norm() / (p - b).norm() < 0.03  # "within about 2 %" (docs/migration.md)


def test_a_torch_muon_state_dict_of_other_parameters_is_refused_naming_them():
    _, torch_opt = train_torch_muon()
    saved = torch_opt.state_dict()
    with pytest.raises(ValueError, match="has 2 parameters, this optimizer's 3"):
        dmuon.Muon([{"params": [*matrices(), W(4, 4)], "algorithm": "muon"}]).load_state_dict(saved)
    with pytest.raises(ValueError, match="has 1 param groups, this optimizer 2"):
        a, b = matrices()
        dmuon.Muon([{"params": [a], "algorithm": "muon"}, {"params": [b], "algorithm": "muon"}]).load_state_dict(saved)
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 24, bias=False))  # the embedding goes to AdamW
    with pytest.raises(ValueError, match="Parameter '0.weight' is routed to adamw here"):
        dmuon.Muon(model).load_state_dict(saved)


def test_every_torch_argument_is_accepted_and_every_other_default_is_in_the_migration_guide():
    torch_defaults = {k: v.default for k, v in inspect.signature(torch.optim.Muon.__init__).parameters.items()
                      if k not in ("self", "params")}
    ours = inspect.signature(dmuon.Muon.__init__).parameters
    assert set(torch_defaults) <= set(ours)
    assert list(ours)[2:2 + len(torch_defaults)] == list(torch_defaults)  # in torch's order, after params
    guide = (Path(__file__).parents[2] / "docs" / "migration.md").read_text()
    for name, default in torch_defaults.items():
        if ours[name].default != default:
            assert f"`{name}`" in guide, name


@pytest.mark.parametrize("missing", ["ns_coefficients", "eps", "lr"])
def test_a_torch_muon_state_dict_missing_a_key_is_told_which(missing):
    _, torch_opt = train_torch_muon()
    saved = copy.deepcopy(torch_opt.state_dict())
    del saved["param_groups"][0][missing]
    opt = dmuon.Muon([{"params": matrices(), "algorithm": "muon"}])
    with pytest.raises(ValueError, match=rf"Param group 0 of the torch.optim.Muon state dict lacks \['{missing}'\]"):
        opt.load_state_dict(saved)
