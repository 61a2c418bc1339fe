"""``dmuon/step/early/run.py``: one backward pass's run of the step plan, through its phases, in one
process (``early_start=True`` runs it on CPU): it waits for its first bucket, runs every bucket
as its gradients become final, is held back inside ``accumulating()`` until the next backward
pass, and a second backward pass makes it repeated, so that the step redoes its work. The bits
against early start off: tests/distributed/test_step_early.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dmuon
from dmuon.step.early.run import CHANGED, USED, Phase


def _backward(model: nn.Module, seed: int) -> None:
    model(torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))).square().mean().backward()


def _armed(early_start: bool = True) -> tuple[nn.Module, dmuon.Muon]:
    """A model of four matrices in four buckets, after a first step: early start's run armed."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16, bias=False) for _ in range(4)])
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=16 * 16 * 4, early_start=early_start)
    _backward(model, 0)
    opt.step()
    opt.zero_grad()
    return model, opt


def _without_early_start(seeds: tuple[int, ...]) -> nn.Module:
    """The same model after the same backward passes and a step with early start off."""
    model, opt = _armed(early_start=False)
    for seed in seeds:
        _backward(model, seed)
    opt.step()
    return model


def test_a_backward_pass_runs_every_bucket_and_the_step_uses_it():
    model, opt = _armed()
    run = opt.stepper.early._run
    assert run.phase is Phase.WAITING and run.next == run.order[0] and len(run.order) > 1
    _backward(model, 1)
    assert run.phase is Phase.RUNNING and run.next is None
    assert run.verdict(opt.state) == USED
    opt.step()
    assert opt.last_step_stats.early_buckets == (len(run.order), len(run.order))


def test_accumulating_holds_the_run_back_until_the_next_backward_pass():
    model, opt = _armed()
    run = opt.stepper.early._run
    with opt.accumulating():
        _backward(model, 1)
    assert run.phase is Phase.HELD_BACK and run.next == run.order[0]  # nothing started
    _backward(model, 2)
    assert run.phase is Phase.RUNNING and run.next is None
    opt.step()
    twin = _without_early_start((1, 2))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_a_second_backward_pass_repeats_the_run_and_the_step_redoes_its_work():
    model, opt = _armed()
    run = opt.stepper.early._run
    _backward(model, 1)
    _backward(model, 2)
    assert run.phase is Phase.REPEATED and run.verdict(opt.state) == CHANGED
    with pytest.warns(UserWarning, match="early start turned off: the gradients changed"):
        opt.step()
    twin = _without_early_start((1, 2))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


def test_zero_grad_after_a_backward_pass_starts_the_run_over():
    model, opt = _armed()
    _backward(model, 1)
    opt.zero_grad()
    run = opt.stepper.early._run
    assert run.phase is Phase.WAITING and not run.seen and run.next == run.order[0]
