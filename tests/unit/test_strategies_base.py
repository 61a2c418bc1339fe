"""``dmuon/strategies/base.py``: what the strategies share. Same-shape pieces — whole matrices and
the row blocks of fused weights — go into one batched Newton–Schulz call, in order; an update
goes back in Newton–Schulz's dtype only where that loses nothing; a rank alone takes its new row
states as they are (the exchange's all-reduce: tests/distributed/test_update_rules.py)."""

from __future__ import annotations

import torch
from torch import nn

import dmuon
from dmuon.strategies.base import batches_of, return_dtype, share_row_states, wire_dtype


def test_pieces_of_one_shape_share_a_batch_fused_blocks_included():
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(qkv=nn.Linear(16, 48, bias=False), a=nn.Linear(16, 16, bias=False),
                               wide=nn.Linear(16, 32, bias=False)))
    opt = dmuon.Muon([{"params": [model.qkv.weight], "ns_blocks": [16, 16, 16], "algorithm": "muon"},
                      {"params": [model.a.weight, model.wide.weight], "algorithm": "muon"}], lr=0.02,
                     ns_method="standard")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    works = opt.stepper.plan.works
    shapes = {w.param.shape[0]: i for i, w in enumerate(works)}
    qkv, a, wide = shapes[48], shapes[16], shapes[32]
    batches = batches_of(range(len(works)), works)
    by_rows = {(rows, works[members[0][0]].n): members for _, rows, members in batches}
    # the three 16-row blocks of the fused weight and the 16×16 matrix: one call, in order
    assert by_rows[(16, 16)] == ((qkv, 0, 0, False), (qkv, 1, 16, False), (qkv, 2, 32, False), (a, 0, 0, True))
    assert by_rows[(32, 16)] == ((wide, 0, 0, True),)
    assert sum(len(members) for _, _, members in batches) == 5


def test_updates_return_in_newton_schulz_dtype_only_where_it_is_exact():
    torch.manual_seed(0)
    layer = nn.Linear(16, 16, bias=False)
    opt = dmuon.Muon(layer, lr=0.02, ns_dtype=torch.bfloat16)
    layer.weight.grad = torch.randn_like(layer.weight)
    opt.step()
    (work,) = opt.stepper.plan.works
    assert work.narrow_return and return_dtype(work, None) == torch.bfloat16  # bf16 NS of an fp32 weight
    assert wire_dtype(work, None) == torch.float32  # the input crosses in the weight's dtype
    assert wire_dtype(work, torch.bfloat16) == return_dtype(work, torch.bfloat16) == torch.bfloat16


class _Recorder:
    def __init__(self, states: dict[int, torch.Tensor]) -> None:
        self.states, self.written = states, None

    def new_row_state(self, index: int) -> torch.Tensor | None:
        return self.states.get(index)

    def set_row_states(self, indices, states) -> None:
        self.written = (list(indices), [s.clone() for s in states])


def test_without_a_process_group_the_new_row_states_are_written_as_they_are():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12, bias=False), nn.Linear(12, 4, bias=False))
    opt = dmuon.Muon(model, lr=0.02, update_rule="normuon")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    works = opt.stepper.plan.works
    states = {7: torch.rand(works[0].param_rows), 9: torch.rand(works[1].param_rows)}
    io = _Recorder(states)
    share_row_states([7, 9], works, io, opt.stepper.engine.context)
    assert io.written[0] == [7, 9] and all(torch.equal(a, states[i]) for a, i in zip(io.written[1], (7, 9)))
