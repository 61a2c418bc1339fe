"""Single-process ``dmuon.Muon``: parity, routing, validation and the optimizer API (docs/testing.md
rows 2, 10, 11, 13–16, 18)."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from torch import nn

import dmuon
from dmuon.hyperparameters import adamw_hyperparameters
from dmuon.reference import ReferenceMuon

BF16_PARITY_TOL = 2e-2


class Net(nn.Module):
    """Every kind of parameter the routing rule distinguishes."""

    def __init__(self, vocab: int = 11, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(2 * dim)
        self.conv = nn.Conv1d(2, 3, kernel_size=3)
        self.experts = nn.Parameter(torch.randn(3, 2 * dim, dim) * 0.1)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.hidden(self.embed(tokens))))
        h = torch.einsum("bd,edk->bk", h, self.experts) / 3
        conv = self.conv(h.reshape(h.shape[0], 2, -1)).mean()
        return self.lm_head(h) + conv


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def set_random_grads(params, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)


def snapshot(params) -> list[torch.Tensor]:
    return [p.detach().clone() for p in params]


# ---------------------------------------------------------------- parity with torch.optim.Muon

@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_parity_with_torch_muon(adjust_lr_fn, nesterov, weight_decay):
    torch.manual_seed(0)
    params = [torch.randn(shape) * 0.1 for shape in [(32, 64), (64, 32), (48, 48), (7, 5)]]
    ours = [nn.Parameter(p.clone()) for p in params]
    theirs = [nn.Parameter(p.clone()) for p in params]
    kwargs = dict(lr=0.02, weight_decay=weight_decay, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    opt = dmuon.Muon([{"params": ours, "algorithm": "muon"}], ns_coefficients="keller",
                     ns_method="standard", ns_dtype=torch.bfloat16, **kwargs)
    ref = torch.optim.Muon(theirs, **kwargs)
    for step in range(5):
        set_random_grads(ours, step)
        set_random_grads(theirs, step)
        opt.step()
        ref.step()
    for p0, a, b in zip(params, ours, theirs):
        # momentum depends on gradients alone: identical
        assert torch.equal(opt.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"])
        # updates differ by bf16 rounding (torch normalizes in bf16, we in fp32)
        delta_ours, delta_theirs = a.detach() - p0, b.detach() - p0
        assert ((delta_ours - delta_theirs).norm() / delta_theirs.norm()).item() <= BF16_PARITY_TOL


def test_parity_fails_with_a_broken_coefficient():
    """The parity test above can fail: a changed Keller coefficient is caught."""
    torch.manual_seed(0)
    p0 = torch.randn(32, 64) * 0.1
    a, b = nn.Parameter(p0.clone()), nn.Parameter(p0.clone())
    opt = dmuon.Muon([{"params": [a], "algorithm": "muon"}], lr=0.02, ns_coefficients=(3.4445, -4.7750, 2.1),
                     ns_method="standard", ns_dtype=torch.bfloat16, adjust_lr_fn="original")
    ref = torch.optim.Muon([b], lr=0.02, adjust_lr_fn="original")
    for step in range(5):
        set_random_grads([a], step)
        set_random_grads([b], step)
        opt.step()
        ref.step()
    delta_ours, delta_theirs = a.detach() - p0, b.detach() - p0
    assert ((delta_ours - delta_theirs).norm() / delta_theirs.norm()).item() > BF16_PARITY_TOL


# ---------------------------------------------------------------- fast path == plain reference

@pytest.mark.parametrize("ns_method,ns_dtype", [("standard", torch.bfloat16), ("gram", torch.float32), ("auto", None)])
def test_fast_path_equals_reference_bitwise(ns_method, ns_dtype):
    net, ref_net = make_net(), make_net()
    kwargs = dict(lr=0.01, weight_decay=0.1, ns_method=ns_method, ns_dtype=ns_dtype)
    opt = dmuon.Muon(net, **kwargs)
    muon_names = {n for n, route in opt.routes().items() if route.algorithm == "muon"}
    ref_params = dict(ref_net.named_parameters())
    ref_muon = ReferenceMuon([ref_params[n] for n in sorted(muon_names) if n != "conv.weight"], **kwargs)
    ref_conv = ReferenceMuon([ref_params["conv.weight"]], matrix_view="flatten", **kwargs)
    ref_adamw = torch.optim.AdamW([p for n, p in ref_params.items() if n not in muon_names], lr=0.01, weight_decay=0.1)
    assert muon_names == {"hidden.weight", "conv.weight", "experts"}
    for step in range(4):
        set_random_grads(net.parameters(), step)
        set_random_grads(ref_net.parameters(), step)
        opt.step()
        for o in (ref_muon, ref_conv, ref_adamw):
            o.step()
    for (name, a), b in zip(net.named_parameters(), ref_net.parameters()):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------- routing

def test_routing_from_module():
    opt = dmuon.Muon(make_net())
    routes = {n: route.algorithm for n, route in opt.routes().items()}
    assert routes == {
        "embed.weight": "adamw", "hidden.weight": "muon", "hidden.bias": "adamw",
        "norm.weight": "adamw", "norm.bias": "adamw", "conv.weight": "muon", "conv.bias": "adamw",
        "experts": "muon", "lm_head.weight": "adamw",
    }
    summary = opt.routing_summary()
    assert "3 x 16x8" in summary  # the expert stack: 3 matrices
    assert "1 x 3x6" in summary  # the Conv1d kernel (3, 2, 3) flattened
    assert "routing" not in repr(opt) and "hidden.weight" in repr(opt)
    # why each parameter went where
    reasons = {n: route.reason for n, route in opt.routes().items()}
    assert reasons["embed.weight"] == "embedding" and reasons["lm_head.weight"] == "output head"
    assert reasons["conv.weight"] == "convolution kernel, flattened" and reasons["hidden.bias"].startswith("1-D")
    assert all(reason in summary for reason in reasons.values())


def test_tied_head_and_vocab_sized_head_go_to_adamw():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 4)
            self.out = nn.Linear(4, 10)  # not named like a head, but vocab-sized
            self.tied = nn.Linear(4, 10, bias=False)
            self.tied.weight = self.tok.weight

    opt = dmuon.Muon(Tied())
    routes = {n: route.algorithm for n, route in opt.routes().items()}
    assert routes["tok.weight"] == "adamw" and routes["out.weight"] == "adamw"
    assert routes["proj.weight"] == "muon"
    assert "tied.weight" not in routes  # the same tensor as tok.weight


def test_routing_from_named_parameters_and_plain_tensors():
    net = make_net()
    named = dmuon.Muon(net.named_parameters())
    named_routes = {n: route.algorithm for n, route in named.routes().items()}
    assert named_routes["embed.weight"] == "adamw" and named_routes["lm_head.weight"] == "adamw"
    matrices = [p for p in net.parameters() if p.ndim >= 2]
    with pytest.warns(UserWarning, match="routed 5 matrices to Muon by shape alone.*Pass the model"):
        plain = dmuon.Muon(matrices)
    # without names or modules only the shape rule applies: every matrix goes to Muon
    assert sum(route.algorithm == "muon" for route in plain.routes().values()) == 5
    # a whole model's bare tensors (nanoGPT's decay / no-decay groups): its embedding would go to Muon
    vectors = [p for p in net.parameters() if p.ndim < 2]
    with pytest.raises(ValueError, match=r"bare tensors of a whole model \(5 matrices, \d+ vectors.*Pass the model"):
        dmuon.Muon([{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}])
    with pytest.raises(ValueError, match="bare tensors of a whole model"):
        dmuon.Muon(net.parameters())
    named = [{"params": [(n, p) for n, p in net.named_parameters() if p.ndim >= 2], "weight_decay": 0.1},
             {"params": [(n, p) for n, p in net.named_parameters() if p.ndim < 2], "weight_decay": 0.0}]
    routes = {n: r.algorithm for n, r in dmuon.Muon(named).routes().items()}
    assert routes["embed.weight"] == "adamw" and routes["lm_head.weight"] == "adamw"


def test_explicit_groups_override_and_split():
    net = make_net()
    opt = dmuon.Muon([
        {"params": [net.hidden.weight, net.hidden.bias], "lr": 0.5},
        {"params": [net.lm_head.weight], "algorithm": "muon"},
        {"params": [net.experts], "algorithm": "adamw", "betas": (0.8, 0.9), "eps": 1e-6},
    ], lr=0.1, adamw_eps=1e-7)
    # one group per group given, routed per parameter inside
    assert [g["algorithms"] for g in opt.param_groups] == [["muon", "adamw"], ["muon"], ["adamw"]]
    assert [g["algorithm"] for g in opt.param_groups] == [None, "muon", "adamw"]
    adamw = [adamw_hyperparameters(g) for g in opt.param_groups]
    assert opt.param_groups[0]["lr"] == adamw[0]["lr"] == 0.5
    assert adamw[0]["eps"] == 1e-7  # a plain eps of a mixed group is Muon's
    assert adamw[2]["betas"] == (0.8, 0.9) and adamw[2]["eps"] == 1e-6 and adamw[2]["lr"] == 0.1
    assert opt.param_groups[1]["lr"] == 0.1


def test_ns_dtype_is_kept_by_name():
    """Param groups hold plain values only (DCP's full state dicts reject a torch.dtype)."""
    for given in (torch.float32, "float32", "torch.float32"):
        opt = dmuon.Muon(make_net(), ns_dtype=given)
        assert opt.param_groups[0]["ns_dtype"] == "float32"


def test_adamw_options():
    net = make_net()
    opt = dmuon.Muon(net, lr=0.1, weight_decay=0.2, adamw_lr=0.003, adamw_weight_decay=0.0, adamw_betas=(0.5, 0.6))
    adamw = adamw_hyperparameters(opt.param_groups[0])
    assert (adamw["lr"], adamw["weight_decay"], adamw["betas"], adamw["eps"]) == (0.003, 0.0, (0.5, 0.6), 1e-8)


# ---------------------------------------------------------------- validation (row 11)

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


# ---------------------------------------------------------------- non-finite and missing gradients

@pytest.mark.parametrize("bad_param", ["hidden.weight", "norm.bias"])
def test_nonfinite_grad_skips_whole_step(bad_param):
    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)
    set_random_grads(net.parameters(), 0)
    opt.step()
    before_params = snapshot(net.parameters())
    before_state = copy.deepcopy(opt.state_dict())
    set_random_grads(net.parameters(), 1)
    dict(net.named_parameters())[bad_param].grad.view(-1)[0] = float("nan")
    with pytest.warns(UserWarning, match=bad_param):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before_params, net.parameters()))
    after_state = opt.state_dict()
    for key, state in before_state["state"].items():
        for name, value in state.items():
            assert torch.equal(value, after_state["state"][key][name])
    assert opt.skipped_steps == 1


def test_nonfinite_grad_raise_and_ignore_policies():
    net = make_net()
    set_random_grads(net.parameters(), 0)
    net.hidden.weight.grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="hidden.weight"):
        dmuon.Muon(net, nonfinite_grads="raise").step()
    dmuon.Muon(net, nonfinite_grads="ignore").step()
    assert not torch.isfinite(net.hidden.weight).all()  # "ignore" means exactly that


def test_missing_gradients_leave_params_and_state_alone():
    net = make_net()
    net.embed.weight.requires_grad_(False)
    opt = dmuon.Muon(net, lr=0.01)
    set_random_grads(net.parameters(), 0)
    net.embed.weight.grad = None
    net.experts.grad = None
    frozen, experts = net.embed.weight.clone(), net.experts.detach().clone()
    opt.step()
    assert torch.equal(frozen, net.embed.weight) and torch.equal(experts, net.experts)
    assert net.experts not in opt.state and net.embed.weight not in opt.state
    assert net.hidden.weight in opt.state


def test_zero_lr_and_zero_grads_leave_params_bit_identical():
    net = make_net()
    opt = dmuon.Muon(net, lr=0.0, weight_decay=0.1)
    before = snapshot(net.parameters())
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))
    assert all("momentum_buffer" in s or "exp_avg" in s for s in opt.state.values())


# ---------------------------------------------------------------- optimizer API (row 15)

def loss_of(net: Net) -> torch.Tensor:
    return net(torch.arange(6) % 11).square().mean()


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


def test_add_param_group_later():
    net = make_net()
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


# ---------------------------------------------------------------- dtypes, determinism, state stability

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_param_dtype_is_kept_and_state_matches_it(dtype):
    net = make_net().to(dtype)
    opt = dmuon.Muon(net, lr=0.01)
    for step in range(2):
        set_random_grads(net.parameters(), step)
        opt.step()
    assert all(p.dtype == dtype for p in net.parameters())
    for p, state in opt.state.items():
        for name, value in state.items():
            if name != "step":
                assert value.dtype == dtype and value.shape == p.shape, name


def test_same_seed_twice_is_bitwise_equal():
    def run():
        net = make_net()
        opt = dmuon.Muon(net, lr=0.01)
        for _ in range(3):
            opt.zero_grad()
            loss_of(net).backward()
            opt.step()
        return snapshot(net.parameters())

    assert all(torch.equal(a, b) for a, b in zip(run(), run()))


def test_one_vs_two_threads():
    """Same result with 1 and 2 intra-op threads (to fp32 rounding: BLAS may split sums)."""
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            net = make_net()
            opt = dmuon.Muon(net, lr=0.01)
            for step in range(3):
                set_random_grads(net.parameters(), step)
                opt.step()
            results.append(snapshot(net.parameters()))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_is_stable_across_steps():
    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)
    set_random_grads(net.parameters(), 0)
    opt.step()
    layout = {id(p): {k: (v.shape, v.dtype, v.device) for k, v in s.items()} for p, s in opt.state.items()}
    for step in range(1, 4):
        set_random_grads(net.parameters(), step)
        opt.step()
    assert layout == {id(p): {k: (v.shape, v.dtype, v.device) for k, v in s.items()} for p, s in opt.state.items()}


def test_training_reduces_loss():
    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        losses = []
        for _ in range(20):
            opt.zero_grad()
            loss = loss_of(net)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_statistics_describe_the_last_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 16))
    opt = dmuon.Muon(model, lr=0.01, weight_decay=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    stats = opt.statistics()
    # the Muon update's RMS before the lr is the parameters' change divided by the lr
    muon = [(p, b) for p, b in zip(model.parameters(), before) if p.ndim == 2]
    squares = sum(((b - p.detach()) / 0.01).square().sum() for p, b in muon)
    numel = sum(p.numel() for p, _ in muon)
    assert stats["muon/update_rms/0"] == pytest.approx(math.sqrt(squares / numel), rel=1e-4)
    assert stats["lr/0"] == 0.01 and "lr/1" not in stats  # the model is one group
    assert stats["matrices"] == 2 and stats["ns_gflop"] > 0 and stats["ns_seconds"] > 0
    assert stats["bytes_sent"] == stats["collectives"] == stats["skipped_steps"] == 0
    assert all(isinstance(v, float) for v in stats.values())


def test_fused_weight_blocks_are_orthogonalized_separately():
    torch.manual_seed(0)
    qkv = nn.Parameter(torch.randn(48, 32))
    grad = torch.randn(48, 32)
    rows = [32, 8, 8]  # grouped-query attention: q, k, v
    results = {}
    for blocks in (None, rows):
        p = nn.Parameter(qkv.detach().clone())
        opt = dmuon.Muon([{"params": [p], "algorithm": "muon", "ns_blocks": blocks}], lr=0.1, weight_decay=0.0,
                         ns_dtype=torch.float32, ns_method="standard")
        p.grad = grad.clone()
        opt.step()
        results[str(blocks)] = (qkv.detach() - p.detach()) / 0.1  # the applied update, lr removed
        assert opt.param_groups[0]["ns_blocks"] == blocks
    split = results[str(rows)].split(rows)
    # each block is an orthogonalized matrix scaled for its own shape: its rows are orthogonal,
    # with the squared norm its scale gives them (0.2·√max(rows, 32))²
    for block, r in zip(split, rows):
        scale = 0.2 * math.sqrt(max(r, 32))
        gram = block @ block.T / scale**2
        torch.testing.assert_close(gram, torch.eye(r), atol=0.3, rtol=0)
    assert not torch.allclose(results["None"], results[str(rows)], atol=1e-3)


@pytest.mark.parametrize("blocks,message", [
    (5, "blocks of 5 rows do not tile 48 rows"), ([32, 8], "adding up to 48"), ([48, 0], "positive ints"),
])
def test_bad_ns_blocks_are_named(blocks, message):
    with pytest.raises(ValueError, match=message) as info:
        dmuon.Muon([{"params": [nn.Parameter(torch.zeros(48, 32))], "algorithm": "muon", "ns_blocks": blocks}])
    assert "parameter 0 in param group 0" in str(info.value)


def test_named_groups_that_route_to_one_algorithm():
    """A group of (name, tensor) pairs all routed to one algorithm leaves the other half empty;
    it must still count as named, or torch refuses to mix named and unnamed groups."""
    w, b = nn.Parameter(torch.randn(4, 4)), nn.Parameter(torch.randn(4))
    opt = dmuon.Muon([{"params": [("w", w)]}, {"params": [("b", b)]}])
    assert [g["param_names"] for g in opt.param_groups] == [["w"], ["b"]]
    w.grad, b.grad = torch.randn(4, 4), torch.randn(4)
    opt.step()
    opt.load_state_dict(opt.state_dict())


def test_a_step_reads_the_device_once(monkeypatch):
    """Apart from AdamW's step counters (host tensors, as in torch.optim), a step reads one
    tensor value on the host: the agreed flags (in one process, whether some gradient may be
    non-finite). On CUDA that is the step's only synchronization;
    the non-finite checks and everything after the agreement stay on the device. On CPU, where a
    read costs nothing, each Newton–Schulz call also asks whether a matrix needs the scaled
    normalization (:func:`dmuon.orthogonalization.normalize`; never on CUDA)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    opt = dmuon.Muon(model, lr=0.01)
    for _ in range(2):  # the second step runs with state, as in training
        model(torch.randn(4, 16)).square().mean().backward()
        reads = []
        for name in ("tolist", "item", "__bool__", "__float__", "__int__"):
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _original=original, _name=name, **kwargs):
                if not any(state.get("step") is self for state in opt.state.values()):
                    reads.append(_name)
                return _original(self, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        opt.step()
        monkeypatch.undo()
        assert reads == ["item"] + ["__bool__"] * len(opt.last_step_stats.ns_calls)


# ---------------------------------------------------------------- misuse that must not pass silently

def test_sparse_gradients_get_a_clear_error_under_every_policy():
    for policy in ("skip", "raise", "ignore"):
        table = nn.Embedding(10, 4, sparse=True)
        hidden = nn.Linear(4, 4)
        opt = dmuon.Muon(nn.ModuleDict({"embed": table, "hidden": hidden}), nonfinite_grads=policy)
        hidden(table(torch.tensor([1, 2]))).sum().backward()
        with pytest.raises(RuntimeError, match="does not support sparse gradients: 'embed.weight'"):
            opt.step()


def test_a_deep_copy_and_an_unpickled_optimizer_step_like_the_original():
    import pickle

    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)
    set_random_grads(net.parameters(), 0)
    opt.step()
    twins = [copy.deepcopy((net, opt)), pickle.loads(pickle.dumps((net, opt)))]
    public = {k for k in opt.__dict__ if not k.startswith("_")}
    for twin_net, twin in twins:  # torch's own check: every public attribute survives the copy
        assert {k for k in twin.__dict__ if not k.startswith("_")} == public
    for step in (1, 2):
        for model, o in [(net, opt), *twins]:
            set_random_grads(model.parameters(), step)
            o.step()
    for twin_net, _ in twins:
        assert all(torch.equal(a, b) for a, b in zip(net.parameters(), twin_net.parameters()))


def test_mixed_named_and_bare_parameters_are_rejected():
    net = make_net()
    with pytest.raises(ValueError, match="mix \\(name, tensor\\) pairs and bare tensors"):
        dmuon.Muon([("hidden.weight", net.hidden.weight), net.experts])


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
    before = [p.detach().clone() for p in net.parameters()]
    opt.load_state_dict(good)  # the failed loads changed nothing; the good one still loads and steps
    set_random_grads(net.parameters(), 1)
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


# ---------------------------------------------------------------- migrating from AdamW

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


def test_add_param_group_with_bare_tensors_finds_their_names_in_the_model():
    net = make_net()
    opt = dmuon.Muon(net, lr=0.01)
    net.extra = nn.Linear(8, 8)  # a module added to the model later
    opt.add_param_group({"params": list(net.extra.parameters())})
    assert opt.param_groups[1]["param_names"] == ["extra.weight", "extra.bias"]
    assert opt.param_groups[1]["algorithms"] == ["muon", "adamw"]
    other = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="not in the model it was built from: pass \\(name, tensor\\) pairs"):
        opt.add_param_group({"params": list(other.parameters())})
    assert len(opt.param_groups) == 2


# ---------------------------------------------------------------- AdamW's lr, schedulers


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


# ---------------------------------------------------------------- misuse that must not pass silently


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


@pytest.mark.parametrize("option,pointer", [
    ("betas", "AdamW's betas are adamw_betas=\\(beta1, beta2\\)"),
    ("lrr", "did you mean 'lr'\\?"),
    ("fused", "dmuon.Muon always runs batched"),
    ("use_muon", "use_muon belongs in a param group"),
])
def test_options_of_other_optimizers_point_to_dmuons(option, pointer):
    with pytest.raises(TypeError, match=f"Muon\\(\\) got an unexpected keyword argument '{option}': {pointer}"):
        dmuon.Muon(make_net(), **{option: (0.9, 0.95)})


def test_keller_use_muon_groups_are_accepted():
    """MuonWithAuxAdam's groups: use_muon chooses the algorithm; an AdamW group's eps is AdamW's."""
    net = make_net()
    hidden = [net.hidden.weight]
    rest = [p for p in net.parameters() if p is not net.hidden.weight]
    opt = dmuon.Muon([dict(params=hidden, use_muon=True, lr=0.02, weight_decay=0.01),
                      dict(params=rest, use_muon=False, lr=3e-4, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)])
    assert opt.param_groups[0]["algorithms"] == ["muon"]
    assert set(opt.param_groups[1]["algorithms"]) == {"adamw"}
    assert opt.param_groups[1]["adamw_eps"] == 1e-10 and opt.param_groups[1]["adamw_betas"] == (0.9, 0.95)
    assert opt.param_groups[1]["eps"] == opt.defaults["eps"]  # Newton–Schulz's eps untouched
    with pytest.raises(ValueError, match="use_muon=True and algorithm='adamw' disagree in param group 0"):
        dmuon.Muon([dict(params=hidden, use_muon=True, algorithm="adamw")])
    with pytest.raises(ValueError, match="Invalid use_muon=1 in param group 0"):
        dmuon.Muon([dict(params=hidden, use_muon=1)])


def test_a_misspelt_group_option_gets_the_closest_name():
    with pytest.raises(ValueError, match="Unknown option\\(s\\) \\['weight_dacay'\\] in param group 0. Did you mean "
                                         "'weight_decay'\\?"):
        dmuon.Muon([{"params": [make_net().hidden.weight], "weight_dacay": 0.1}])


def test_last_step_stats_print_as_one_readable_line():
    net = make_net()
    opt = dmuon.Muon(net)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    text = repr(opt.last_step_stats)
    assert re.fullmatch(r"StepStats\(this rank: \d+ matrices orthogonalized, [\d.e+-]+ GFLOP in \d+ Newton–Schulz "
                        r"calls, [\d.]+ ms; 0 MiB sent in 0 collectives\)", text), text
    assert "ns_calls" not in text and "_ns_spans" not in text


def test_routing_summary_points_fused_projections_to_ns_blocks():
    fused = nn.ModuleDict({"qkv": nn.Linear(8, 24, bias=False), "out": nn.Linear(8, 8, bias=False)})
    summary = dmuon.Muon(fused).routing_summary()
    assert "note: qkv.weight (24x8) looks like fused projections" in summary and "ns_blocks" in summary
    assert "out.weight" in summary and "note: out.weight" not in summary
    blocked = dmuon.Muon([{"params": list(fused.qkv.named_parameters("qkv")), "ns_blocks": [8, 8, 8]},
                          {"params": list(fused.out.named_parameters("out"))}]).routing_summary()
    assert "note:" not in blocked.split("ns_dtype=None")[0]
