"""``dmuon/step/plan.py``: the step plan's key and its bucket order, one process.

The bucket order (the backward pass's, for early start, or the cost order) is an input of the
plan: decided by :func:`dmuon.step.early.eligibility.follows_backward` from the plan's
:class:`~dmuon.step.early.eligibility.Eligibility`, which is part of the key, so a plan is
rebuilt exactly when that may change; reading ``opt.plans`` keeps nothing."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn

import dmuon
from dmuon.step.early.eligibility import Eligibility
from dmuon.step.plan import plan_key


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(n, m, bias=False) for n, m in [(16, 32), (32, 32), (32, 48), (48, 16)]])


def _step(model: nn.Module, opt: dmuon.Muon) -> None:
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_the_key_holds_each_input_of_early_starts_eligibility():
    model = _model()
    opt = dmuon.Muon(model, lr=0.02)
    entries = opt.stepper.stepped_here(opt.param_groups)
    base = Eligibility(None, "cuda", False, None)
    changed = [base._replace(setting=False), base._replace(setting=True), base._replace(device_type="cpu"),
               base._replace(compiled=True), base._replace(ddp_params=frozenset(id(p) for p in model.parameters()))]
    keys = [plan_key(entries, e) for e in [base, *changed]]
    assert len(set(keys)) == len(keys)
    assert plan_key(entries, base) == plan_key(entries, Eligibility(None, "cuda", False, None))


def test_the_plan_is_rebuilt_in_the_cost_order_when_early_start_turns_itself_off():
    """early_start=True on CPU plans in the backward order; once early start is off (as it turns
    itself off when the gradients change after the backward pass) the key differs and the next
    step's plan follows the cost order — with nobody having to ask for a new plan."""
    model = _model()
    opt = dmuon.Muon(model, lr=0.02, early_start=True)
    _step(model, opt)
    before = opt.stepper.plan
    assert before.follows_backward
    with pytest.warns(UserWarning, match="early start turned off"):
        opt.stepper.early.turn_off("a test turns it off")
    _step(model, opt)
    after = opt.stepper.plan
    assert after.key != before.key and not after.follows_backward
    _step(model, opt)
    assert opt.stepper.plan is after  # kept while nothing it depends on changes


def _as_on_cuda(setting, device_type):
    return setting if setting is not None else True


@pytest.mark.parametrize("early_start", [None, True, False])
def test_reading_plans_changes_nothing(early_start):
    """``opt.plans`` works the plans out and keeps nothing: the kept plan, the planner, and early
    start are as they were, and the plans read are those of the plan the next step runs.
    ``wanted`` is patched as on CUDA, where early_start=None chooses the backward order."""
    model = _model()
    with mock.patch("dmuon.step.plan.wanted", _as_on_cuda), \
            mock.patch("dmuon.step.early.eligibility.wanted", _as_on_cuda), \
            mock.patch("dmuon.step.early.start.wanted", _as_on_cuda):
        opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
        _step(model, opt)
        stepper = opt.stepper
        seen = (stepper.plan, dict(vars(stepper.planner)), stepper.early.state, stepper.early.setting)
        read = [opt.plans, opt.plans]
        assert (stepper.plan, dict(vars(stepper.planner)), stepper.early.state, stepper.early.setting) == seen
        assert read[0] == read[1] == [s.plan for s in stepper.plan.strategies]
        assert stepper.plan.follows_backward == (early_start is not False)


def test_reading_plans_changes_nothing_where_early_start_cannot_run_the_plan():
    """early_start=None as on CUDA with ``compile`` (which early start cannot run): reading
    ``opt.plans`` before the first step decides the cost order without keeping anything (the
    planner once kept the order it found), and the step then runs those plans."""
    torch._dynamo.reset()  # the compiled Newton–Schulz of earlier tests' shapes would count towards its limit
    model = _model()
    with mock.patch("dmuon.step.plan.wanted", _as_on_cuda), \
            mock.patch("dmuon.step.early.eligibility.wanted", _as_on_cuda):
        opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, compile="eager")
        stepper = opt.stepper
        seen = (stepper.plan, dict(vars(stepper.planner)), stepper.early.state)
        read = opt.plans
        assert (stepper.plan, dict(vars(stepper.planner)), stepper.early.state) == seen
        _step(model, opt)
        assert not stepper.plan.follows_backward
        assert read == opt.plans == [s.plan for s in stepper.plan.strategies]
