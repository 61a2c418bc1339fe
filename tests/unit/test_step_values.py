"""``dmuon/step/values.py``: a step's values. The hold policy (early start's) writes nothing: the
updates and row states it is handed wait, and ``apply_held`` makes the same writes, in the same
order, with the same bits as values that apply them at once (NorMuon's row states included)."""

from __future__ import annotations

import torch
from torch import nn

import dmuon
from dmuon.step.values import StepValues


def _stepped() -> tuple[nn.Module, dmuon.Muon]:
    """A model and its optimizer after one step (the same every call)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16, bias=False), nn.Linear(16, 8, bias=False))
    opt = dmuon.Muon(model, lr=0.02, update_rule="normuon", early_start=False)
    model(torch.randn(4, 12)).square().mean().backward()
    opt.step()
    return model, opt


def test_held_writes_are_made_by_apply_held_with_the_bits_of_direct_writes():
    model, opt = _stepped()
    twin_model, twin_opt = _stepped()
    updates = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in
               enumerate(model.parameters())]
    row_states = [torch.rand(p.shape[0]) for p in model.parameters()]
    indices = list(range(len(updates)))

    def write(values: StepValues) -> None:
        values.apply(indices, updates)
        values.set_row_states(indices, row_states)

    before = [p.detach().clone() for p in model.parameters()]
    plan = opt.stepper.plan
    held = StepValues(plan, opt.state, {}, None, {}, hold=True)
    write(held)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # nothing written yet
    assert [method.__name__ for method, _ in held.held] == ["apply", "set_row_states"]
    with torch.no_grad():  # as in a step
        StepValues(plan, opt.state, {}, None, {}).apply_held(held)
        write(StepValues(twin_opt.stepper.plan, twin_opt.state, {}, None, {}))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin_model.parameters()))
    assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for p, q in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(opt.state[p]["row_second_moment"], twin_opt.state[q]["row_second_moment"])
