"""``dmuon plan`` and ``dmuon.Muon`` decide alike: both call :func:`dmuon.choices.choose` and
:func:`dmuon.planner.exchange_plans`, so the plan the cost model prints for a model is the plan
the optimizer builds for it, on real ranks under DDP and FSDP2 at 2 and 4 ranks — owners,
buckets, the table, and the matrices split over gangs (the embodied model's mixed shapes, its
frozen tower left out, among them) — and with tensor, pipeline and expert parallel at 4 ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.tools.costmodel import Workload, build_plan, stage_plan
from dmuon.tools.hardware import PROFILES
from dmuon.tools.models import Llama, get_config
from dmuon.tools.simulate import predict
from dmuon.tools.workloads import build_model, local_batch, make_data, training_loss
from tests.harness import run_on_ranks

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
    model = build_model(config, seed=0)
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
    batch = local_batch(make_data(config), 0, 2 * world, 16, dist.get_rank(), world, torch.device("cpu"))
    training_loss(model, batch).backward()
    opt.step()
    described["gangs"] = {name.removeprefix("module."): ranks for name, ranks in opt.last_step_stats.gangs.items()}
    return described


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("preset,overrides", [("demo", {}), ("tiny", ONE_WIDE_BLOCK), ("vla-tiny", {})],
                         ids=["demo", "one-wide-block", "vla"])
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
    if preset == "tiny" and world == 2:  # the case is there to exercise a split
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


# ---------------------------------------------------------------- tensor, pipeline and expert parallel

TP_PLAN = {"attn.q_proj": "col", "attn.k_proj": "col", "attn.v_proj": "col", "attn.o_proj": "row",
           "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}
TINY_MOE = dict(vocab_size=128, dim=32, ffn_dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                expert_ffn_dim=16, experts_per_token=2)


def _stage_mesh(tp: int, pp: int):
    """This rank's stage's (dp, tp) mesh (a 1-D dp mesh without tensor parallel), carved out of
    one (pp, dp, tp) mesh made on every rank at once."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (pp, world // pp // tp, tp), mesh_dim_names=("pp", "dp", "tp"))
    return mesh["dp", "tp"] if tp > 1 else mesh["dp"], mesh["pp"].get_local_rank()


def _placements(kind: str, tp: int) -> list:
    """torchtitan's placements of a block's matrix under FSDP2 x TP: column-wise, row-wise, or
    (the router) replicated over tp."""
    dp = _StridedShard(0, split_factor=tp) if kind == "col" else Shard(0)
    return [dp, {"col": Shard(0), "row": Shard(1), "router": Replicate()}[kind]] if tp > 1 else [Shard(0)]


def parallel_optimizer_plans(config, tp: int, pp: int, ep: int, moe: bool) -> dict:
    """On every rank: the plans of the optimizer of this rank's pipeline stage. A dense model is
    the real one, parallelized as torchtitan does (ColwiseParallel / RowwiseParallel, then
    fully_shard over dp); a mixture of experts is its parameters placed as torchtitan places
    them, experts on an (ep, expert-FSDP) mesh of the stage's ranks."""
    import torch
    from torch import nn
    from torch.distributed.tensor import distribute_tensor

    from dmuon.tools.models import muon_units

    stage_config = dataclasses.replace(config, n_layers=config.n_layers // pp)
    mesh, stage = _stage_mesh(tp, pp)
    # a stage's 2-D mesh is part of the job's ranks: its optimizer agrees and exchanges over a
    # group of exactly them, made on every rank at once
    group = mesh._flatten().get_group() if pp > 1 and tp > 1 else None
    if not moe:
        model = Llama(stage_config, seed=0)
        dp = mesh["dp"] if tp > 1 else mesh
        for block in model.layers:
            if tp > 1:
                styles = {"col": ColwiseParallel(), "row": RowwiseParallel()}
                parallelize_module(block, mesh["tp"], {name: styles[kind] for name, kind in TP_PLAN.items()})
            if dp.size() > 1:  # torchtitan applies FSDP2 where there are data-parallel ranks
                fully_shard(block, mesh=dp)
        opt = dmuon.Muon(model, lr=0.01, process_group=group)
    else:
        ranks = mesh.mesh.flatten().tolist()
        experts_mesh = init_device_mesh("cpu", (ep, len(ranks) // ep), mesh_dim_names=("ep", "efsdp")) if pp == 1 \
            else None  # the MoE cases run one stage
        params, names = [], []
        for name, count, m, n in muon_units(stage_config):
            whole = torch.randn((count, m, n) if ".experts." in name else (m, n), generator=torch.Generator())
            if ".experts." in name:
                dim = 0 if (count // ep) % (len(ranks) // ep) == 0 else 1
                piece = distribute_tensor(whole, experts_mesh, [Shard(0), Shard(dim)], src_data_rank=None)
            else:
                kind = "router" if "router" in name else TP_PLAN[name.split(".", 2)[-1].removesuffix(".weight")]
                piece = distribute_tensor(whole, mesh, _placements(kind, tp), src_data_rank=None)
            params.append(nn.Parameter(piece))
            names.append(name)
        opt = dmuon.Muon([{"params": params, "param_names": names, "algorithm": "muon"}], lr=0.01)
    return dict(stage=stage, plans=[_described(plan) for plan in opt.plans])


PARALLEL_CASES = {  # (preset, overrides, tp, pp, ep)
    "fsdp x tp": ("tiny", {}, 2, 1, 1),
    "tp alone": ("tiny", {"n_kv_heads": 4}, 4, 1, 1),  # whole key/value heads on each of the 4 ranks
    "pipeline stages": ("tiny", {"n_layers": 4}, 1, 2, 1),
    "pipeline x tp": ("tiny", {"n_layers": 4}, 2, 2, 1),  # each stage TP alone
    "experts on dim 0": ("qwen3-30b-a3b", dict(TINY_MOE, n_experts=4), 1, 1, 2),
    "experts on dim 1": ("qwen3-30b-a3b", dict(TINY_MOE, n_experts=2), 1, 1, 2),
    "experts x tp": ("qwen3-30b-a3b", dict(TINY_MOE, n_experts=8), 2, 1, 4),
}


@pytest.mark.parametrize("case", list(PARALLEL_CASES))
def test_dmuon_plan_with_tp_pp_ep_prints_the_optimizers_plans(case):
    """``dmuon plan --tp/--pp/--ep`` plans the first stage's optimizer as ``dmuon.Muon`` does on
    the layout it describes, at 4 ranks: every exchange group's owners, buckets, table and the
    matrices it holds, on every rank of the first stage (each rank's own stacks name that rank);
    the other stage plans its matrices alike."""
    preset, overrides, tp, pp, ep = PARALLEL_CASES[case]
    config = get_config(preset, **overrides)
    workload = Workload(config, 4, "fsdp2", CPU, mfu=0.5, tp=tp, pp=pp, ep=ep)
    assert workload.stage_config.n_layers == config.n_layers // pp
    results = run_on_ranks(4, parallel_optimizer_plans, config, tp, pp, ep, bool(config.n_experts))
    for rank, got in enumerate(results):
        expected = [_described(plan) for plan in stage_plan(workload, rank % workload.group_size).plans]
        if got["stage"] > 0:  # the same plans over other ranks
            for plans in (got["plans"], expected):
                for plan in plans:
                    del plan["table"], plan["layouts"]
        assert got["plans"] == expected, f"rank {rank}"
    strategies = {how for _, _, how in predict(workload).strategies}
    if tp > 1 and workload.dp > 1:
        assert any(how.startswith("piece exchange") for how in strategies)
    if "dim 0" in case:
        assert any(how.startswith("no exchange: each rank its own") for how in strategies)
