"""One process: bad input raises early, naming the offending value or parameter — hyperparameters,
param groups, sparse gradients, state dicts of other shapes, settings changed between steps,
options of other optimizers (docs/testing.md row 11)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import dmuon
from tests.unit.nets import make_net, set_random_grads, snapshot


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1.0), "lr=-1.0"),
    (dict(lr=float("nan")), "lr=nan"),
    (dict(momentum=1.0), "momentum=1.0"),
    (dict(momentum=-0.1), "momentum=-0.1"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1"),
    (dict(eps=0.0), "eps=0.0"),
    (dict(ns_steps=0), "ns_steps=0"),
    (dict(ns_steps=100), "ns_steps=100"),
    (dict(ns_coefficients=(1.0, 2.0)), "coefficients"),
    (dict(ns_coefficients="fast"), "ns_coefficients='fast'"),
    (dict(ns_method="svd"), "ns_method='svd'"),
    (dict(ns_method="gram", ns_dtype=torch.bfloat16), "bfloat16"),
    (dict(ns_dtype=torch.int32), "ns_dtype"),
    (dict(ns_method="gram", ns_restarts=[7]), "restarts"),
    (dict(adjust_lr_fn="spectral"), "adjust_lr_fn='spectral'"),
    (dict(nesterov="yes"), "nesterov='yes'"),
    (dict(adamw_betas=(0.9, 1.0)), r"betas\[1\]=1.0"),
    (dict(adamw_eps=-1.0), "eps=-1.0"),
    (dict(nonfinite_grads="nan"), "nonfinite_grads='nan'"),
    (dict(lr=torch.tensor([0.1, 0.2])), "one element"),
    (dict(lr=float("inf")), "lr=inf. Must be finite"),
    (dict(weight_decay=float("inf")), "weight_decay=inf. Must be finite"),
    (dict(adamw_lr=float("inf")), "adamw_lr=inf. Must be finite"),
    (dict(adamw_weight_decay=float("-inf")), "adamw_weight_decay=-inf. Must be finite"),
    (dict(lr=torch.tensor(float("inf"))), "Must be finite"),
    # options that would pass a type check but break the step
    (dict(ns_coefficients=(100.0, -100.0, 100.0)), "after step 1 the Newton–Schulz polynomial maps"),
    (dict(ns_coefficients=(3.4445, -4.775, 2.3)), "after step 3"),
    (dict(ns_dtype=torch.float8_e4m3fn), "ns_dtype=torch.float8_e4m3fn"),
    (dict(comm_dtype=torch.float8_e5m2), "comm_dtype=torch.float8_e5m2"),
    (dict(lr=0.0, adamw_lr=1e-3), "Invalid lr=0.0 with adamw_lr=0.001"),
])
def test_bad_hyperparameters_raise_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dmuon.Muon(make_net(), **kwargs)


def test_bad_param_groups_raise_naming_the_problem():
    net = make_net()
    with pytest.raises(ValueError, match=r"Unknown option\(s\) \['lrr'\] in param group 0"):
        dmuon.Muon([{"params": [net.hidden.weight], "lrr": 0.1}])
    with pytest.raises(ValueError, match="algorithm='sgd'"):
        dmuon.Muon([{"params": [net.hidden.weight], "algorithm": "sgd"}])
    with pytest.raises(ValueError, match="hidden.bias in param group 0"):
        dmuon.Muon([{"params": [("hidden.bias", net.hidden.bias)], "algorithm": "muon"}])
    with pytest.raises(ValueError, match=r"momentum=2 in param group 1"):
        dmuon.Muon([{"params": [net.hidden.weight]}, {"params": [net.experts], "momentum": 2}])
    with pytest.raises(TypeError, match="set"):
        dmuon.Muon({net.hidden.weight})
    with pytest.raises(RuntimeError, match="complex"):
        dmuon.Muon([nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))])


def test_sparse_gradients_get_a_clear_error_under_every_policy():
    for policy in ("skip", "raise", "ignore"):
        table = nn.Embedding(10, 4, sparse=True)
        hidden = nn.Linear(4, 4)
        opt = dmuon.Muon(nn.ModuleDict({"embed": table, "hidden": hidden}), nonfinite_grads=policy)
        hidden(table(torch.tensor([1, 2]))).sum().backward()
        with pytest.raises(RuntimeError, match="does not support sparse gradients: 'embed.weight'"):
            opt.step()


def test_load_state_dict_checks_shapes_and_keys_naming_the_parameter():
    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)
    set_random_grads(net.parameters(), 0)
    opt.step()
    good = opt.state_dict()
    index = good["param_groups"][0]["param_names"].index("hidden.weight")
    key = good["param_groups"][0]["params"][index]
    wrong_shape = copy.deepcopy(good)
    wrong_shape["state"][key]["momentum_buffer"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="'hidden.weight' has momentum_buffer of shape \\(3, 3\\)"):
        opt.load_state_dict(wrong_shape)
    incomplete = copy.deepcopy(good)
    embed = good["param_groups"][0]["params"][good["param_groups"][0]["param_names"].index("embed.weight")]
    del incomplete["state"][embed]["exp_avg_sq"]
    with pytest.raises(ValueError, match="state of parameter 'embed.weight' lacks 'exp_avg_sq'"):
        opt.load_state_dict(incomplete)
    missing_key = copy.deepcopy(good)
    del missing_key["param_groups"][0]["ns_steps"]
    with pytest.raises(ValueError, match="Param group 0 of the state dict lacks \\['ns_steps'\\]"):
        opt.load_state_dict(missing_key)
    on_meta = copy.deepcopy(good)
    on_meta["state"][key]["momentum_buffer"] = torch.empty(good["state"][key]["momentum_buffer"].shape, device="meta")
    with pytest.raises(ValueError, match="'hidden.weight' has momentum_buffer on the meta device"):
        opt.load_state_dict(on_meta)
    negative_step = copy.deepcopy(good)
    negative_step["state"][embed]["step"] = torch.tensor(-5.0)
    with pytest.raises(ValueError, match="'embed.weight' has step=-5.0; AdamW's step count must be one number >= 0"):
        opt.load_state_dict(negative_step)
    routed_otherwise = copy.deepcopy(good)
    routed_otherwise["state"][key] = copy.deepcopy(good["state"][embed])
    with pytest.raises(ValueError, match="'hidden.weight' is routed to muon here, but its state in the state dict is "
                                         "adamw's \\(\\['exp_avg', 'exp_avg_sq', 'step'\\]\\)"):
        opt.load_state_dict(routed_otherwise)
    before = [p.detach().clone() for p in net.parameters()]
    opt.load_state_dict(good)  # the failed loads changed nothing; the good one still loads and steps
    set_random_grads(net.parameters(), 1)
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_settings_changed_after_construction_are_checked_at_the_next_step():
    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)
    set_random_grads(net.parameters(), 0)
    opt.step()
    opt.param_groups[0]["ns_steps"] = 0
    before = snapshot(net.parameters())
    with pytest.raises(ValueError, match=r"Invalid ns_steps=0.*param group 0"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    opt.param_groups[0]["ns_steps"] = 4  # a valid change is taken
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


@pytest.mark.parametrize("option,pointer", [
    ("betas", "AdamW's betas are adamw_betas=\\(beta1, beta2\\)"),
    ("lrr", "did you mean 'lr'\\?"),
    ("fused", "dmuon.Muon always runs batched"),
    ("use_muon", "use_muon belongs in a param group"),
])
def test_options_of_other_optimizers_point_to_dmuons(option, pointer):
    with pytest.raises(TypeError, match=f"Muon\\(\\) got an unexpected keyword argument '{option}': {pointer}"):
        dmuon.Muon(make_net(), **{option: (0.9, 0.95)})


def test_a_misspelt_group_option_gets_the_closest_name():
    with pytest.raises(ValueError, match="Unknown option\\(s\\) \\['weight_dacay'\\] in param group 0. Did you mean "
                                         "'weight_decay'\\?"):
        dmuon.Muon([{"params": [make_net().hidden.weight], "weight_dacay": 0.1}])


def test_fp16_parameters_on_adamw_with_an_eps_fp16_cannot_hold_are_warned_about():
    """AdamW's eps of 1e-8 is 0 in fp16, and the second moment of a gradient under ~8e-3
    underflows: the update is inf or NaN (torch.optim.AdamW's too). Warned at construction,
    naming the parameters; an eps fp16 holds, or fp32 parameters, are not."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).half()
    with pytest.warns(UserWarning, match=r"AdamW steps float16 parameters \(0.bias, 1.bias\) with eps=1e-08"):
        dmuon.Muon(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dmuon.Muon(model, adamw_eps=1e-4)
        dmuon.Muon(model.float())
    # what the warning is about: one AdamW step of a small gradient
    bias = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    bias.grad = torch.tensor([1e-3, 0.0], dtype=torch.float16)
    with pytest.warns(UserWarning, match="float16"):
        dmuon.Muon([("bias", bias)], lr=0.01).step()
    assert not bias.isfinite().any()
