"""Ranks that disagree, or call the optimizer's collective entry points out of step, get the
same clear error on every rank — never a hang, never silently different weights."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmuon
from tests.harness import run_on_ranks
from tests.helpers import error_of

SHAPES = [(8, 4), (6, 6)]


def make_params(shapes=SHAPES, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def set_grads(params, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def muon(params, **kwargs) -> dmuon.Muon:
    return dmuon.Muon([{"params": params, "algorithm": "muon"}], lr=0.01, **kwargs)


def add_group_on_rank_0_only() -> None:
    params = make_params()
    opt = muon(params[:1])
    set_grads(params)
    if dist.get_rank() == 0:
        opt.add_param_group({"params": params[1:], "algorithm": "muon"})
    else:
        opt.step()


def add_group_with_lr_of_rank() -> None:
    params = make_params()
    opt = muon(params[:1])
    opt.add_param_group({"params": params[1:], "algorithm": "muon", "lr": 0.01 * (1 + dist.get_rank())})


def add_group_with_shape_of_rank() -> None:
    params = make_params()
    opt = muon(params[:1])
    extra = make_params([(5, 5 + dist.get_rank())], seed=2)
    opt.add_param_group({"params": extra, "algorithm": "muon"})


def unnamed_in_rank_order() -> None:
    a, b = make_params([(6, 6), (6, 6)])
    muon([a, b] if dist.get_rank() == 0 else [b, a])


def nonfinite_policy_of_rank() -> None:
    muon(make_params(), nonfinite_grads="raise" if dist.get_rank() == 0 else "skip")


def extra_named_matrix_on_rank_1() -> None:
    params = make_params([(8, 4), (6, 6), (5, 5)])
    named = list(zip(["a", "b", "c"], params))
    dmuon.Muon([{"params": named[: 2 + dist.get_rank()], "algorithm": "muon"}], lr=0.01)


def bad_lr_on_rank_1() -> None:
    muon(make_params(), weight_decay=float("inf") if dist.get_rank() == 1 else 0.1)


def load_on_rank_0_only() -> None:
    params = make_params()
    opt = muon(params)
    set_grads(params)
    opt.step()
    if dist.get_rank() == 0:
        opt.load_state_dict(opt.state_dict())
    else:
        opt.step()


def sparse_gradient_on_rank_1() -> None:
    params = make_params()
    opt = muon(params)
    set_grads(params)
    if dist.get_rank() == 1:
        params[0].grad = params[0].grad.to_sparse()
    opt.step()


@pytest.mark.parametrize("fn,expected", [
    (add_group_on_rank_0_only,
     r"RuntimeError: Ranks are in different optimizer calls: some called add_param_group, others step"),
    (add_group_with_lr_of_rank, r"ValueError: Ranks disagree .*param group 1's lr is 0.01 on rank 0 but 0.02 on rank 1"),
    (add_group_with_shape_of_rank,
     r"ValueError: Ranks disagree .*param group 1's Muon parameter 0 is an unnamed \(5, 5\) matrix .* on rank 0 "
     r"but an unnamed \(5, 6\) matrix"),
    (unnamed_in_rank_order, r"ValueError: Ranks disagree .*param group 0's Muon parameter 0 is an unnamed \(6, 6\) "
                            r"matrix with values summing to .*pass names"),
    (nonfinite_policy_of_rank, r"ValueError: Ranks disagree .*nonfinite_grads is 'raise' on rank 0 but 'skip' on rank 1"),
    (extra_named_matrix_on_rank_1,
     r"ValueError: Ranks disagree .*param group 0's Muon parameter 2 is missing on rank 0 but 'c' of shape \(5, 5\) "
     r"on rank 1"),
    (load_on_rank_0_only,
     r"RuntimeError: Ranks are in different optimizer calls: some called load_state_dict, others step"),
])
def test_every_rank_raises_the_same_error(fn, expected):
    errors = run_on_ranks(2, error_of, fn)
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert re.match(expected, errors[0]), errors[0]


@pytest.mark.parametrize("fn,expected", [
    (bad_lr_on_rank_1, "Invalid weight_decay=inf. Must be finite."),
    (sparse_gradient_on_rank_1, "Muon does not support sparse gradients: 'group0.param0'"),
])
def test_a_local_error_stops_every_rank_with_its_message(fn, expected):
    errors = run_on_ranks(3, error_of, fn)
    assert all(e is not None and expected in e for e in errors), errors
    assert "raised on rank 1" in errors[0] and "raised on rank 1" in errors[2]


def add_group_then_step() -> dict:
    params = make_params([(8, 4), (6, 6), (5, 7)])
    opt = muon(params[:1])
    opt.add_param_group({"params": params[1:], "algorithm": "muon", "lr": 0.02})
    set_grads(params)
    opt.step()
    return {"params": [p.detach().clone() for p in params], "groups": len(opt.param_groups)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_group_added_on_every_rank_steps_as_one_process(world):
    alone = run_on_ranks(1, add_group_then_step)[0]
    for result in run_on_ranks(world, add_group_then_step):
        assert result["groups"] == 2
        assert all(torch.equal(a, b) for a, b in zip(result["params"], alone["params"]))
