"""Splitting one matrix over a *gang* of k ranks (dmuon.choices.choose_gangs, the engine's
_run_gangs): the planner splits only where that lowers the makespan; training with split
matrices matches one process at 3 and 4 ranks, under DDP (replicated), FSDP2 (row shards),
row-wise tensor parallel (column shards) and HSDP (2 × 2), for wide and tall matrices, with
gangs of part of the group and of all of it, placements unchanged; a checkpoint taken between
split steps resumes bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import dmuon
from dmuon.choices import choose_gangs, gang_costs
from dmuon.layout import Layout
from dmuon.orthogonalization import newton_schulz_flops, resolve_config
from dmuon.planner import Unit
from tests.harness import run_on_ranks
from tests.helpers import dcp_load, dcp_save, full_tensor

HPARAMS = dict(lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32)


def units_of(shapes: list[tuple[int, int]], size: int) -> tuple[list[Unit], list]:
    units, configs = [], []
    for i, (m, n) in enumerate(shapes):
        config = resolve_config((m, n), "cpu")
        flops = newton_schulz_flops(m, n, steps=config.steps, method=config.method, restarts=config.restarts)
        units.append(Unit(f"w{i:03d}", Layout((m, n), 1, size, tuple(range(size))), 1, m, n, 4, flops))
        configs.append(config)
    return units, configs


def gangs_for(shapes: list[tuple[int, int]], size: int) -> dict[int, tuple[int, ...]]:
    units, configs = units_of(shapes, size)
    return choose_gangs(units, gang_costs(units, configs), size)


def test_planner_splits_only_where_the_makespan_drops():
    assert gangs_for([(256, 256)] * 64, 8) == {}  # 8 matrices a rank: LPT balances them
    assert gangs_for([(256, 2048)] + [(64, 64)] * 8, 4) == {0: (0, 1, 2, 3)}  # one dominant matrix
    assert gangs_for([(2048, 256)] + [(64, 64)] * 3, 3) == {0: (0, 1, 2)}  # tall, at 3 ranks
    # gangs are disjoint: two dominant matrices at 3 ranks cannot both be split, and one alone
    # gains nothing while the other stays the floor
    assert gangs_for([(256, 2048), (2048, 256)] + [(64, 64)] * 3, 3) == {}
    # fewer matrices than ranks: gangs of part of the group, disjoint
    gangs = gangs_for([(512, 4096)] * 4, 16)
    assert sorted(gangs) == [0, 1, 2, 3] and all(len(g) == 4 for g in gangs.values())
    assert sorted(p for g in gangs.values() for p in g) == list(range(16))


@pytest.mark.parametrize("model,world,split", [
    ("llama-3.1-8b", 64, False), ("llama-3.1-8b", 512, True), ("llama-3.1-70b", 512, False),
    ("llama-3.1-70b", 4096, True),
])
def test_when_splitting_pays_at_scale(model, world, split):
    """Fewer matrices than ranks (8B: 224 at 512 ranks; 70B: 560 at 4096) is when gangs pay.
    70B at 512 ranks: each of its 240 largest matrices fits one rank, and a gang of 2 would
    save only their long-side products (Gram NS repeats the 8192² recurrence on every member)
    while the 8192×8192 ones would still follow: no split lowers the makespan."""
    from dmuon.tools.costmodel import Workload, build_plan, load_model_config
    from dmuon.tools.hardware import PROFILES

    plan, configs = build_plan(Workload(load_model_config(model), world, "fsdp2", PROFILES["h100"]))
    units = list(plan.units)
    gangs = choose_gangs(units, gang_costs(units, configs), world)
    assert bool(gangs) == split
    positions = [p for g in gangs.values() for p in g]
    assert len(positions) == len(set(positions)) <= world and all(len(g) >= 2 for g in gangs.values())


SMALL = [(8, 8), (12, 8)]
CASES = {  # name → shapes; the first ones are large enough to be split
    "wide": [(48, 400), *SMALL], "tall": [(400, 48), *SMALL], "both": [(48, 400), (400, 48), *SMALL],
}


def init(i: int, shape: tuple[int, int], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100 + i))


def split_steps(case: str, parallel: str | None, steps: int = 2, ns_dtype: torch.dtype = torch.float32) -> dict:
    """Two steps on a case's matrices: plain tensors (one process, or replicated as under DDP)
    or FSDP2 row shards."""
    torch.set_num_threads(1)
    shapes = CASES[case]
    mesh, placements = None, None
    if parallel == "fsdp":
        mesh, placements = init_device_mesh("cpu", (dist.get_world_size(),)), [Shard(0)]
    elif parallel == "tp":  # row-wise tensor parallel: column shards, exchanged as the transpose
        mesh, placements = init_device_mesh("cpu", (dist.get_world_size(),)), [Shard(1)]
    elif parallel == "hsdp":
        mesh, placements = init_device_mesh("cpu", (2, dist.get_world_size() // 2)), [Replicate(), Shard(0)]
    place = (lambda t: distribute_tensor(t, mesh, placements)) if mesh is not None else (lambda t: t)
    params = [nn.Parameter(place(init(i, s, 0))) for i, s in enumerate(shapes)]
    before = [tuple(p.placements) for p in params if isinstance(p, DTensor)]
    names = [f"w{i}" for i in range(len(shapes))]
    # HSDP: replicas split the matrices, so an exchange group spans both replicas (2 × 2)
    split = {"replica_split": True} if parallel == "hsdp" else {}
    opt = dmuon.Muon([{"params": params, "algorithm": "muon", "param_names": names}],
                     **{**HPARAMS, "ns_dtype": ns_dtype}, **split)
    for step in range(steps):
        for i, (p, s) in enumerate(zip(params, shapes)):
            p.grad = place(init(i, s, step + 1))
        opt.step()
    assert [tuple(p.placements) for p in params if isinstance(p, DTensor)] == before  # placements unchanged
    return dict(params=[full_tensor(p) for p in params], gangs=opt.last_step_stats.gangs)


@pytest.mark.parametrize("parallel,case,world,gang_sizes", [
    (None, "wide", 3, {3}), (None, "tall", 3, {3}), (None, "wide", 4, {4}), (None, "both", 4, {2}),
    ("fsdp", "wide", 3, {3}), ("fsdp", "both", 4, {2}),
    # FSDP2's row shards of a tall matrix are column blocks of its transpose already: alone, it
    # is split over the whole group in place (distributed NS, nothing resharded), not by a gang
    ("fsdp", "tall", 3, set()),
    ("tp", "tall", 3, {3}), ("tp", "both", 4, {2}),
    ("hsdp", "wide", 4, {4}), ("hsdp", "both", 4, {2}),  # members take their slices from their own replica
])
def test_split_training_matches_one_process(case, world, gang_sizes, parallel):
    """Parity with one process, and the gangs the cost model chose: the whole group for one
    dominant matrix, two disjoint gangs of 2 ranks for two at 4 ranks."""
    reference = split_steps(case, None)
    results = run_on_ranks(world, split_steps, case, parallel)
    for rank, r in enumerate(results):
        for i, (got, expected) in enumerate(zip(r["params"], reference["params"])):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"rank {rank} w{i}")
    gangs = {name: ranks for r in results for name, ranks in r["gangs"].items()}
    assert {len(ranks) for ranks in gangs.values()} == gang_sizes, gangs
    members = [rank for ranks in gangs.values() for rank in ranks]
    assert len(members) == len(set(members))  # gangs are disjoint


class Matrices(nn.Module):
    def __init__(self, shapes: list[tuple[int, int]]) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(init(i, s, 0)) for i, s in enumerate(shapes)])


def resume_with_gangs(path: str, case: str, steps: int, save_after: int | None) -> dict:
    """``steps`` steps of a case under DDP-style replication; a DCP checkpoint after
    ``save_after`` steps, then a fresh model and optimizer loaded from it for the rest."""
    torch.set_num_threads(1)
    shapes = CASES[case]

    def fresh() -> tuple[Matrices, dmuon.Muon]:
        model = Matrices(shapes)
        return model, dmuon.Muon([{"params": list(model.weights), "algorithm": "muon"}], **HPARAMS)

    model, opt = fresh()
    gangs = {}
    for step in range(steps):
        if step == save_after:
            dcp_save(model, opt, path)
            model, opt = fresh()
            dcp_load(model, opt, path)
        for i, (p, s) in enumerate(zip(model.weights, shapes)):
            p.grad = init(i, s, step + 1)
        opt.step()
        gangs.update(opt.last_step_stats.gangs)
    return dict(params=[p.detach().clone() for p in model.weights], gangs=gangs)


def test_checkpoint_resume_with_gangs(tmp_path):
    """Gangs keep no state of their own: momentum stays with each parameter, so a DCP checkpoint
    taken between split steps resumes to the same parameters as an uninterrupted run."""
    straight = run_on_ranks(4, resume_with_gangs, str(tmp_path / "unused"), "both", 3, None)
    resumed = run_on_ranks(4, resume_with_gangs, str(tmp_path / "ckpt"), "both", 3, 1)
    assert {len(g) for r in resumed for g in r["gangs"].values()} == {2}
    for a, b in zip(straight, resumed):
        for got, expected in zip(b["params"], a["params"]):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("parallel,case,world", [(None, "wide", 3), ("fsdp", "both", 4)])
def test_gangs_send_bf16_updates_back_into_fp32_weights(parallel, case, world):
    """bf16 Newton–Schulz, fp32 parameters: the members send their slices of the update back in
    bf16 (exact: they are bf16 values). Every rank ends with the same bits, close to one process."""
    reference = split_steps(case, None, ns_dtype=torch.bfloat16)
    results = run_on_ranks(world, split_steps, case, parallel, 2, torch.bfloat16)
    assert any(r["gangs"] for r in results)
    for rank, r in enumerate(results):
        for i, (got, expected, first) in enumerate(zip(r["params"], reference["params"], results[0]["params"])):
            assert torch.equal(got, first), f"rank {rank} w{i} differs from rank 0"
            torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3, msg=f"rank {rank} w{i}")
