"""One process: the ``torch.optim.Optimizer`` contract — closures, state dicts (the routing kept,
its reasons not), ``add_param_group``, LR schedulers and AdamW's lr rule, tensor lr, step hooks,
swapped parameter objects, deep copies and pickles, ``torch.compile(opt.step)``, a model built on
the meta device (docs/testing.md row 15)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dmuon
from dmuon.hyperparameters import adamw_hyperparameters
from dmuon.reference import ReferenceMuon
from tests.unit.nets import Net, loss_of, make_net, set_random_grads, snapshot


def test_step_with_closure_returns_loss():
    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)

    def closure():
        opt.zero_grad()
        loss = loss_of(net)
        loss.backward()
        return loss

    first = opt.step(closure)
    assert isinstance(first, torch.Tensor)
    for _ in range(5):
        last = opt.step(closure)
    assert last < first
    opt.zero_grad()
    assert all(p.grad is None for p in net.parameters())


def test_state_dict_round_trip_resumes_bitwise():
    def run(steps, resume_at=None):
        net = make_net()
        opt = dmuon.Muon(net, lr=0.01)
        for step in range(steps):
            if step == resume_at:
                saved = copy.deepcopy(opt.state_dict())
                net_state = copy.deepcopy(net.state_dict())
                net = make_net(seed=99)
                net.load_state_dict(net_state)
                opt = dmuon.Muon(net, lr=0.01)
                opt.load_state_dict(state_dict=saved)  # by keyword, as DCP calls it
            set_random_grads(net.parameters(), step)
            opt.step()
        return snapshot(net.parameters()), opt.state_dict()

    straight, straight_state = run(4)
    for resume_at in (0, 2):  # before and after the first step
        resumed, resumed_state = run(4, resume_at)
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
        assert straight_state["param_groups"] == resumed_state["param_groups"]


def test_state_dicts_keep_every_group_key_and_loads_keep_the_live_reasons():
    model = make_net()
    opt = dmuon.Muon(model, lr=0.02)
    set_random_grads(model.parameters(), 0)
    opt.step()
    reasons = [list(g["route_reasons"]) for g in opt.param_groups]
    saved = opt.state_dict()
    # every key of the live groups, as frameworks that rebuild groups key by key expect (torchtitan)
    assert [sorted(g) for g in saved["param_groups"]] == [sorted(g) for g in opt.param_groups]
    assert all(g["algorithms"] and g["matrix_views"] for g in saved["param_groups"])
    fresh = dmuon.Muon(make_net(), lr=0.02)
    fresh.load_state_dict(copy.deepcopy(saved))
    assert [g["route_reasons"] for g in fresh.param_groups] == reasons
    assert fresh.routes() == opt.routes() and "why" in fresh.routing_summary()
    # reasons saved by another version: the load keeps this optimizer's own
    old = copy.deepcopy(saved)
    for group in old["param_groups"]:
        group["route_reasons"] = ["saved long ago"] * len(group["params"])
    fresh.load_state_dict(old)
    assert [g["route_reasons"] for g in fresh.param_groups] == reasons


def test_add_param_group_later():
    net = make_net()
    with pytest.warns(UserWarning, match="by shape alone"):
        opt = dmuon.Muon([net.hidden.weight], lr=0.01)
    opt.add_param_group({"params": [net.experts, net.norm.weight], "lr": 0.02})
    assert [g["algorithms"] for g in opt.param_groups] == [["muon"], ["muon", "adamw"]]
    set_random_grads(net.parameters(), 0)
    before = net.experts.detach().clone()
    opt.step()
    assert not torch.equal(before, net.experts)


def test_lr_scheduler_changes_applied_lr():
    def update_size(factor):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(16, 32))
        with pytest.warns(UserWarning, match="by shape alone"):
            opt = dmuon.Muon([p], lr=0.01, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: factor)
        before = p.detach().clone()
        set_random_grads([p], 0)
        opt.step()
        sched.step()
        return (p.detach() - before).norm().item(), opt.param_groups[0]["lr"]

    full, _ = update_size(1.0)
    half, lr_after = update_size(0.5)
    assert half == pytest.approx(full / 2, rel=1e-5)
    assert lr_after == pytest.approx(0.005)


def test_tensor_lr_matches_float_lr():
    """A 0-D tensor lr works; it is fp32, so it equals the float lr to fp32 rounding."""
    results = []
    for lr in (0.01, torch.tensor(0.01)):
        net = make_net()
        opt = dmuon.Muon(net, lr=lr)
        set_random_grads(net.parameters(), 0)
        opt.step()
        results.append(snapshot(net.parameters()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_step_hooks_run():
    net = make_net()
    opt = dmuon.Muon(net)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    set_random_grads(net.parameters(), 0)
    opt.step()
    assert calls == ["pre", "post"]


def test_parameter_objects_swapped_after_construction():
    """Accelerate replaces the parameter objects in param_groups after construction."""
    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)
    for group in opt.param_groups:
        group["params"] = [nn.Parameter(p.detach().clone()) for p in group["params"]]
    new_params = [p for g in opt.param_groups for p in g["params"]]
    set_random_grads(new_params, 0)
    before = snapshot(new_params)
    opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, new_params))
    assert set(opt.state) == set(new_params)


def test_a_deep_copy_and_an_unpickled_optimizer_step_like_the_original():
    import pickle

    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)
    set_random_grads(net.parameters(), 0)
    opt.step()
    twins = [copy.deepcopy((net, opt)), pickle.loads(pickle.dumps((net, opt)))]
    public = {k for k in opt.__dict__ if not k.startswith("_")}
    for _, twin in twins:  # torch's own check: every public attribute survives the copy
        assert {k for k in twin.__dict__ if not k.startswith("_")} == public
    for step in (1, 2):
        for model, o in [(net, opt), *twins]:
            set_random_grads(model.parameters(), step)
            o.step()
    for twin_net, _ in twins:
        assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin_net.parameters()))


def adamw_style_groups(net: Net) -> list[dict]:
    """The decay / no-decay split of a typical AdamW training script."""
    decay = [(n, p) for n, p in net.named_parameters() if p.ndim >= 2]
    no_decay = [(n, p) for n, p in net.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def test_param_groups_are_the_users_and_schedulers_follow():
    net = make_net()
    opt = dmuon.Muon(adamw_style_groups(net), lr=0.02, adamw_lr=0.004)
    assert len(opt.param_groups) == 2  # one group per group given, routed per parameter inside
    assert set(opt.param_groups[0]["algorithms"]) == {"muon", "adamw"}  # hidden matrices and the embedding
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda step: 0.5, lambda step: 0.25])
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.005]
    # an explicit adamw_lr follows its group's schedule
    assert [adamw_hyperparameters(g)["lr"] for g in opt.param_groups] == pytest.approx([0.002, 0.001])
    set_random_grads(net.parameters(), 0)
    opt.step()
    sched.step()
    state = opt.state_dict()
    again = dmuon.Muon(adamw_style_groups(net), lr=0.02, adamw_lr=0.004)
    again.load_state_dict(state)
    assert [g["lr"] for g in again.param_groups] == [0.01, 0.005]


def test_applied_adamw_lr_follows_the_scheduler():
    def change(factor: float) -> float:
        torch.manual_seed(0)
        bias = nn.Parameter(torch.randn(8))
        opt = dmuon.Muon([{"params": [("bias", bias)]}], lr=0.02, adamw_lr=0.004, weight_decay=0.0)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda step: factor)
        bias.grad = torch.ones(8)
        before = bias.detach().clone()
        opt.step()
        return (bias.detach() - before).abs().max().item()

    # AdamW's first step moves each element by about its lr
    assert change(1.0) == pytest.approx(0.004, rel=1e-3) and change(0.5) == pytest.approx(0.002, rel=1e-3)


def test_a_groups_own_lr_does_not_replace_adamw_lr():
    """adamw_lr is AdamW's: a group's lr is Muon's, except in an "algorithm": "adamw" group."""
    net = make_net()
    named = list(net.named_parameters())
    opt = dmuon.Muon([{"params": named[:4], "lr": 0.05}, {"params": named[4:], "lr": 0.07, "algorithm": "adamw"}],
                     lr=0.01, adamw_lr=0.003)
    assert [adamw_hyperparameters(g)["lr"] for g in opt.param_groups] == [0.003, 0.07]


def scheduled(name: str):
    return {
        "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: [1.0, 0.5, 0.0, 0.25, 1.0][step]),
        "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=4,
                                                                      cycle_momentum=False),
        "ReduceLROnPlateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0),
    }[name]


@pytest.mark.parametrize("name", ["LambdaLR", "OneCycleLR", "ReduceLROnPlateau"])
def test_adamw_lr_follows_every_scheduler_as_adamw_lr_times_lr_over_the_starting_lr(name):
    """The rule, step by step: Muon applies the group's lr; AdamW applies adamw_lr · lr / (the lr
    the group started with), bitwise as torch's AdamW and the reference given those lrs — and an
    lr of 0 moves neither."""
    torch.manual_seed(0)
    matrix, bias = nn.Parameter(torch.randn(8, 6)), nn.Parameter(torch.randn(6))
    ref_matrix, ref_bias = nn.Parameter(matrix.detach().clone()), nn.Parameter(bias.detach().clone())
    opt = dmuon.Muon([("w", matrix), ("b", bias)], lr=0.02, adamw_lr=0.004, weight_decay=0.1)
    ref = ReferenceMuon([ref_matrix], lr=0.02, weight_decay=0.1)
    ref_adamw = torch.optim.AdamW([ref_bias], lr=0.004, weight_decay=0.1)
    scheduler = scheduled(name)(opt)
    seen = []
    for step in range(4):
        lr = opt.param_groups[0]["lr"]
        seen.append(lr)
        ref.param_groups[0]["lr"] = lr
        ref_adamw.param_groups[0]["lr"] = 0.004 * lr / 0.02
        before = (matrix.detach().clone(), bias.detach().clone())
        set_random_grads([matrix, bias], step)
        set_random_grads([ref_matrix, ref_bias], step)
        opt.step()
        ref.step()
        ref_adamw.step()
        assert torch.equal(matrix, ref_matrix) and torch.equal(bias, ref_bias), (step, lr)
        if lr == 0:
            assert torch.equal(matrix, before[0]) and torch.equal(bias, before[1])
        scheduler.step(1.0) if name == "ReduceLROnPlateau" else scheduler.step()
    assert len(set(seen)) > 1, seen  # the schedule did change the lr


def test_torch_compile_of_the_step_runs_it_eagerly():
    """torch.compile(opt.step) gives the eager step's bits (the step is not graph material:
    collectives and agreed decisions); compile=True still compiles its tensor code."""
    nets = [make_net(), make_net()]
    opts = [dmuon.Muon(net, lr=0.01) for net in nets]
    steps = [opts[0].step, torch.compile(opts[1].step)]
    for i in range(2):
        for net, step in zip(nets, steps):
            set_random_grads(net.parameters(), i)
            step()
    assert all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))


def test_an_optimizer_built_on_the_meta_device_follows_to_empty():
    """The standard way to build a large model: on the meta device, then ``to_empty`` (which
    makes new parameter objects) and initialization. An optimizer built from the model before
    ``to_empty`` takes the new parameters by name; one built from bare tensors says what to do."""
    with torch.device("meta"):
        early_net = Net()
    early = dmuon.Muon(early_net, lr=0.01)
    early_net.to_empty(device="cpu")
    early_net.load_state_dict(make_net().state_dict())
    net = make_net()
    late = dmuon.Muon(net, lr=0.01)
    for i in range(2):
        for model, opt in ((early_net, early), (net, late)):
            set_random_grads(model.parameters(), i)
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(early_net.parameters(), net.parameters()))
    with torch.device("meta"):
        bare = nn.Linear(4, 4)
    opt = dmuon.Muon(list(bare.named_parameters()), lr=0.01)
    bare.to_empty(device="cpu")
    set_random_grads(bare.parameters(), 0)
    with pytest.raises(ValueError, match="'weight' is still on the meta device.*Build the optimizer after"):
        opt.step()


def test_a_subclass_that_passes_its_keyword_arguments_on_is_built_and_steps():
    """As PyTorch's optimizer tests and frameworks subclass optimizers: ``**kwargs`` forwarded."""
    class Forwarding(dmuon.Muon):
        def __init__(self, params, **kwargs):
            self.tag = kwargs.pop("tag", None)
            super().__init__(params, **kwargs)

    net = make_net()
    opt = Forwarding(net, lr=0.01, weight_decay=0.0, tag="mine")
    assert opt.tag == "mine" and opt.param_groups[0]["lr"] == 0.01
    set_random_grads(list(net.parameters()), 0)
    opt.step()

    class Explicit(dmuon.Muon):
        def __init__(self, params, lr=1e-3):
            super().__init__(params, lr=lr)

    with pytest.raises(TypeError, match="betas"):  # without **kwargs: dmuon's message, naming its option
        Explicit(make_net(), betas=(0.9, 0.95))


def test_a_parameter_listed_twice_is_named():
    net = make_net()
    with pytest.raises(ValueError, match=r"Parameter 'hidden.weight' is listed twice in param group 0 \(positions "
                                         r"0 and 2\)"):
        dmuon.Muon([{"params": [net.hidden.weight, net.lm_head.weight, net.hidden.weight],
                     "param_names": ["hidden.weight", "lm_head.weight", "hidden.weight"], "algorithm": "muon"}])
    with pytest.raises(ValueError, match=r"Parameter of shape \(\d+, \d+\) is listed twice in param group 0"):
        dmuon.Muon([{"params": [net.hidden.weight, net.hidden.weight], "algorithm": "muon"}])
