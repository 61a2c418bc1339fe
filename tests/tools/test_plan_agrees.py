"""``dmuon plan`` and ``dmuon.Muon`` decide alike: both call :func:`dmuon.planner.choose`, so the
plan the cost model prints for a model is the plan the optimizer builds for it, on real ranks
under DDP and FSDP2 at 2 and 4 ranks — owners, buckets, the table, and the matrices split over
gangs."""

from __future__ import annotations

import dataclasses

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.tools.costmodel import Workload, build_plan, stage_plan
from dmuon.tools.hardware import PROFILES
from dmuon.tools.models import Llama, SyntheticTokens, get_config
from tests.harness import run_on_ranks
from tests.helpers import lm_loss

# the plan depends on the profile only through its device type (the Newton–Schulz recipe); the
# CPU profile would be measured first, which takes seconds and changes nothing here
CPU = dataclasses.replace(PROFILES["h100"], device_type="cpu")
# one block whose down projection dominates: at 2 ranks the cost model splits it over a gang
ONE_WIDE_BLOCK = dict(dim=32, ffn_dim=1024, n_layers=1)


def _described(plan) -> dict:
    return dict(table=plan.table(), owners=plan.owners, buckets=plan.buckets,
                names=[u.name.removeprefix("module.") for u in plan.units], layouts=[u.layout for u in plan.units])


def optimizer_plan(mode: str, preset: str, overrides: dict, **options) -> dict:
    """On every rank: the plan of ``dmuon.Muon(model, **options)`` for the model under ``mode``,
    and the matrices one step split over gangs."""
    config = get_config(preset, **overrides)
    model = Llama(config, seed=0)
    world = dist.get_world_size()
    if mode == "ddp":
        model = DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.01, **options)
    described = _described(opt.plan)
    inputs, targets = SyntheticTokens(config.vocab_size, seed=0).local_batch(0, 2 * world, 16, dist.get_rank(), world)
    lm_loss(model, inputs, targets).backward()
    opt.step()
    described["gangs"] = {name.removeprefix("module."): ranks for name, ranks in opt.last_step_stats.gangs.items()}
    return described


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("preset,overrides", [("demo", {}), ("tiny", ONE_WIDE_BLOCK)], ids=["demo", "one-wide-block"])
def test_dmuon_plan_prints_the_optimizers_plan(world, mode, preset, overrides):
    workload = Workload(get_config(preset, **overrides), world, mode, CPU, mfu=0.5)
    stage = stage_plan(workload)
    (plan, _), = stage.groups
    expected = _described(plan)
    expected["gangs"] = {s.unit.name: s.gang for s in stage.split}  # positions are global ranks here
    if not stage.split:  # what `dmuon plan` prints then: the per-rank table of the whole-matrix plan
        assert build_plan(workload)[0].table() == plan.table()
    for rank, got in enumerate(run_on_ranks(world, optimizer_plan, mode, preset, overrides)):
        assert got == expected, f"rank {rank}"
    if preset != "demo" and world == 2:  # the case is there to exercise a split
        assert expected["gangs"], "the cost model no longer splits this block's matrix"


def test_early_start_plans_agree_too():
    """Where early start runs, both cut buckets in the backward pass's order and keep every
    matrix whole (here on CPU, where it is not the default)."""
    workload = Workload(get_config("tiny", **ONE_WIDE_BLOCK), 2, "fsdp2", CPU, mfu=0.5, ready_order=True)
    stage = stage_plan(workload)
    (plan, _), = stage.groups
    expected = dict(_described(plan), gangs={})
    assert not stage.split
    for rank, got in enumerate(run_on_ranks(2, optimizer_plan, "fsdp2", "tiny", ONE_WIDE_BLOCK, early_start=True)):
        assert got == expected, f"rank {rank}"
