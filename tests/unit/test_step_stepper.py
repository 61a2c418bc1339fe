"""One process: what a step does to parameters and state — non-finite and missing gradients, lr 0,
dtypes kept, determinism (the same seed twice, 1 vs 2 threads), state stable across steps,
training that learns, the statistics (docs/testing.md rows 10, 13, 16, 18)."""

from __future__ import annotations

import copy
import traceback
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import dmuon
from dmuon.step.elementwise import scalar
from tests.unit.nets import loss_of, make_net, set_random_grads, snapshot


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


class HostTraffic(TorchDispatchMode):
    """Where (the innermost dmuon function) a tensor's value is read on the host
    (``aten._local_scalar_dense``: ``item``, ``bool``, …) or Python data becomes a tensor
    (``aten.lift_fresh``: on a GPU a copy from pageable memory, which waits for the GPU)."""

    OPS = {torch.ops.aten._local_scalar_dense.default: "read", torch.ops.aten.lift_fresh.default: "from host"}

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[tuple[str, str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS:
            frame = next(f for f in reversed(traceback.extract_stack()) if f"{Path('dmuon')}/" in f.filename
                         and "/tests/" not in f.filename)
            self.sites.append((self.OPS[func], Path(frame.filename).name, frame.name))
        return func(*args, **(kwargs or {}))


# What a step does on the host, and why each is no wait on a GPU: the agreement's header is built
# on the host and copied from pinned memory without waiting; the one read of the agreed flags;
# AdamW's step counters, host tensors as in torch.optim; on CPU only (free there), the
# weight-decay factor as a float64 tensor and each Newton–Schulz call's check for the
# overflow-safe normalization.
STEP_HOST_SITES = {("from host", "agreement.py", "agree"), ("read", "agreement.py", "agree_on_step"),
                   ("from host", "elementwise.py", "adamw_step"), ("read", "elementwise.py", "adamw_step"),
                   ("from host", "elementwise.py", "_decay_factor"), ("read", "orthogonalization.py", "normalize")}


def test_a_step_moves_nothing_else_between_host_and_device():
    """Counted by op under a dispatch mode, by the site that issues it: nothing new may appear
    (an index built from a Python list per chunk, a hyperparameter copied from the host per call
    both waited for the GPU once each step)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 40))
    opt = dmuon.Muon(model, lr=0.01)
    for _ in range(2):  # the second step runs with state and its plan, as in training
        model(torch.randn(4, 16)).square().mean().backward()
        with HostTraffic() as traffic:
            opt.step()
        opt.zero_grad()
    assert set(traffic.sites) <= STEP_HOST_SITES, set(traffic.sites) - STEP_HOST_SITES
    assert sum(site[0] == "read" and site[1] == "agreement.py" for site in traffic.sites) == 1
    with HostTraffic() as traffic:  # the compiled kernels' hyperparameters: filled in on the device
        scalar(0.5, torch.device("cpu"))
    assert traffic.sites == []


