"""``dmuon/step/agreement.py``: the agreement of a step across real ranks — a gradient missing on one
rank left alone everywhere, replicas whose gradients differ refused on every rank naming the
parameter (whatever its size; a DDP model with an unused parameter named as the cause)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmuon
from tests.distributed.test_agreement import two_ddp_stages
from tests.harness import run_on_ranks
from tests.helpers import assert_same_error, error_of


def adamw_grad_on_rank_0_only() -> dict:
    model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 4))
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    opt = dmuon.Muon(model, lr=0.01)
    model(torch.ones(2, 6)).sum().backward()
    if dist.get_rank() != 0:
        model[0].bias.grad = None  # an AdamW parameter
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "warned": any("'0.bias'" in str(w.message) for w in caught), "state": "0.bias" in {
                n for n, p in model.named_parameters() if opt.state.get(p)}}


def test_an_adamw_parameter_without_a_gradient_on_one_rank_is_left_alone_everywhere():
    results = run_on_ranks(3, adamw_grad_on_rank_0_only)
    for r in results:
        assert all(torch.equal(v, results[0]["params"][n]) for n, v in r["params"].items())
        assert r["warned"] == (r is results[0]) and not r["state"]


def test_replicas_whose_gradients_differ_between_ranks_are_refused_on_every_rank():
    """The inner model of each stage's DDP, with no process group: dmuon would take the other
    stage's matrices for replicas; their gradients differ, so every rank raises at the first
    step, naming a parameter, before any weight changes."""
    results = run_on_ranks(4, two_ddp_stages, "inner")
    assert_same_error([r["error"] for r in results], r"ValueError: Muon parameter '\d\.weight' is a plain tensor, "
                      r"which dmuon takes for a replica .*\(ranks \[0, 1, 2, 3\].* Pass the ranks that do as "
                      r"process_group=")
    assert all(r["unchanged"] for r in results)


def ddp_with_an_unused_parameter() -> str | None:
    """DDP's default (find_unused_parameters=False) with a Linear the forward never uses: DDP
    does not average the bucket it shares, so the replicas' gradients differ."""
    from torch.nn.parallel import DistributedDataParallel

    class OneUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    torch.manual_seed(0)
    ddp = DistributedDataParallel(OneUnused())
    opt = dmuon.Muon(ddp, lr=0.02)
    ddp(torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))).square().mean().backward()
    return error_of(opt.step)


def test_a_ddp_model_with_an_unused_parameter_is_refused_naming_the_cause():
    errors = run_on_ranks(2, ddp_with_an_unused_parameter)
    assert_same_error(errors, r"ValueError: Muon parameter 'module.used.weight' is a plain tensor, which dmuon "
                      r"takes for a replica .* find_unused_parameters=True")


def replicas_that_are_not(case: str) -> str | None:
    """Plain tensors on every rank, with gradients set by hand: a large true replica beside a
    small one that differs between ranks ("small"), or a replica whose gradient is huge but
    finite on rank 0 only, which the quick non-finite look flags ("huge")."""
    large, small = nn.Parameter(torch.zeros(8, 8)), nn.Parameter(torch.zeros(8, 8))
    opt = dmuon.Muon([{"params": [large, small], "param_names": ["large", "small"], "algorithm": "muon"}], lr=0.02)
    large.grad = torch.full((8, 8), 1e3)
    small.grad = torch.full((8, 8), 1e-3 * (1 + dist.get_rank()))
    if case == "huge":
        small.grad = torch.full((8, 8), 1e30 if dist.get_rank() == 0 else 1e-3)
    return error_of(opt.step)


@pytest.mark.parametrize("case", ["small", "huge"])
def test_a_non_replica_is_found_whatever_its_size(case):
    errors = run_on_ranks(3, replicas_that_are_not, case)
    assert_same_error(errors, r"ValueError: Muon parameter 'small' is a plain tensor, which dmuon takes for a replica")
