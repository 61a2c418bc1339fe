"""Pipeline stages, as users build them: a (pp=2, dp=2) mesh of 4 gloo ranks, each stage a part
of the model under FSDP2 on the stage's ``mesh["dp"]``, one ``dmuon.Muon`` per stage (per model
part, two per rank in an interleaved schedule). Each optimizer agrees and exchanges over its
stage's ranks, never the whole job; trained through ``torch.distributed.pipelining`` (GPipe,
1F1B, interleaved 1F1B) against one process training the whole model on the global batch; the
optimizers built by hand, or by torchtitan's optimizer container over each rank's model parts."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmuon
from tests.harness import run_on_ranks
from tests.helpers import assert_same_error, error_of, single_process

WIDTH, BATCH, STEPS = 16, 8, 3  # BATCH: the global batch, split over the two dp ranks
HPARAMS = dict(lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32)


def whole_model(layers: int, dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers)]).to(dtype)


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, WIDTH, generator=g).to(dtype), torch.randn(BATCH, WIDTH, generator=g).to(dtype)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out.float() - target.float()).square().mean()


def one_process(layers: int, dtype: torch.dtype) -> dict:
    """The whole model on the global batch."""
    model = whole_model(layers, dtype)
    opt = dmuon.Muon(model, **HPARAMS)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, dtype)
        opt.zero_grad()
        loss = mse(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


def staged(schedule: str, layers: int, dtype: torch.dtype, torchtitan: bool = False) -> dict:
    """This rank's stages (``layers`` split evenly over 2 pipeline ranks, two stages each with
    an interleaved schedule), each under FSDP2 on the dp ranks with an optimizer of its own;
    ``torchtitan``: built as torchtitan builds them, by its optimizer container over the rank's
    model parts (``dmuon.integrations.torchtitan``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_coordinate()
    model = whole_model(layers, dtype)
    per_rank = 2 if schedule == "interleaved" else 1
    stages, optimizers, parts = [], [], {}
    for index in (pp, pp + 2) if per_rank == 2 else (pp,):
        size = layers // (2 * per_rank)
        names = [str(i) for i in range(index * size, (index + 1) * size)]
        part = nn.Sequential(*[model.get_submodule(n) for n in names])
        for block in part:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(part, mesh=mesh["dp"])
        optimizers.append(part if torchtitan else dmuon.Muon(part, **HPARAMS))
        stages.append(PipelineStage(part, index, 2 * per_rank, torch.device("cpu"), group=mesh["pp"].get_group()))
        parts.update({f"{n}.{k}": p for n, block in zip(names, part) for k, p in block.named_parameters()})
    if torchtitan:
        from dmuon.integrations.torchtitan import dmuon_optimizer_config

        container = dmuon_optimizer_config(**HPARAMS).build(model_parts=optimizers)
        optimizers = container.dmuon_optimizers  # one per model part, in the parts' order
        assert len(optimizers) == per_rank
    if schedule == "interleaved":
        run = ScheduleInterleaved1F1B(stages, n_microbatches=2, loss_fn=mse)
    else:
        run = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stages[0], n_microbatches=2, loss_fn=mse)
    losses = []
    for step in range(STEPS):
        x, y = batch(step, dtype)
        x, y = x.chunk(2)[dp], y.chunk(2)[dp]
        for opt in optimizers:
            opt.zero_grad()
        last = stages[-1].is_last
        step_losses: list[torch.Tensor] = []
        if stages[0].is_first:
            run.step(x, target=y, losses=step_losses) if last else run.step(x)
        else:
            run.step(target=y, losses=step_losses)
        for opt in reversed(optimizers):  # in any order, the same on the stage's ranks
            opt.step()
        if last:
            losses.append(torch.stack(step_losses).mean().item())
    return dict(losses=losses, params={n: p.full_tensor() for n, p in parts.items()},
                groups=[dist.get_process_group_ranks(opt._stepper.job()) for opt in optimizers])


TORCHTITAN = pytest.mark.skipif(sys.version_info < (3, 11), reason="torchtitan 0.3.0 needs Python >= 3.11")


@pytest.mark.parametrize("schedule,layers,dtype,torchtitan", [
    ("gpipe", 4, torch.float32, False), ("1f1b", 4, torch.float32, False), ("gpipe", 4, torch.bfloat16, False),
    ("interleaved", 8, torch.float32, False),
    pytest.param("1f1b", 4, torch.float32, True, marks=TORCHTITAN),
    pytest.param("interleaved", 8, torch.float32, True, marks=TORCHTITAN),
])
def test_pipeline_stages_under_fsdp2_train_as_one_process(schedule, layers, dtype, torchtitan):
    results = run_on_ranks(4, staged, schedule, layers, dtype, torchtitan)
    reference = single_process(one_process, layers, dtype)
    tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-5)
    for rank, r in enumerate(results):
        pp, dp = divmod(rank, 2)
        assert all(group == [2 * pp, 2 * pp + 1] for group in r["groups"])  # the stage's dp ranks
        for name, value in r["params"].items():
            assert torch.equal(value, results[rank ^ 1]["params"][name]), name  # the dp replicas, bitwise
            torch.testing.assert_close(value, reference["params"][name], **tolerance, msg=name)
        if r["losses"]:  # the last stage's ranks: the mean of their microbatches' losses
            other = results[rank ^ 1]["losses"]
            torch.testing.assert_close(torch.tensor(r["losses"]) / 2 + torch.tensor(other) / 2,
                                       torch.tensor(reference["losses"]), **tolerance)


def stages_of_other_names() -> dict:
    """Two stages whose optimizers hold different parameters (a stage each of pp=2 over dp=2),
    trained apart: each agrees over its own dp ranks, so their names never meet."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_coordinate()
    model = whole_model(4, torch.float32)
    part = nn.ModuleDict({str(i): model[i] for i in range(2 * pp, 2 * pp + 2)})
    for block in part.values():
        fully_shard(block, mesh=mesh["dp"])
    opt = dmuon.Muon(part, **HPARAMS)
    for step in range(2):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + 2 * pp + dp))
        opt.zero_grad()
        for i in range(2 * pp, 2 * pp + 2):
            x = part[str(i)](x)
        x.square().mean().backward()
        opt.step()
    return dict(names=sorted(n for n, _ in part.named_parameters()))


def test_stages_with_other_parameters_agree_each_over_its_own_ranks():
    results = run_on_ranks(4, stages_of_other_names)
    assert results[0]["names"] == results[1]["names"] != results[2]["names"] == results[3]["names"]


def process_group_short_of_a_mesh() -> str | None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    model = whole_model(2, torch.float32)
    fully_shard(model, mesh=mesh["dp"])
    return error_of(lambda: dmuon.Muon(model, process_group=mesh["pp"].get_group()))


def test_a_process_group_that_does_not_cover_a_mesh_is_named():
    errors = run_on_ranks(4, process_group_short_of_a_mesh)
    for rank, error in enumerate(errors):
        pp_ranks, dp_ranks = [rank % 2, rank % 2 + 2], [rank - rank % 2, rank - rank % 2 + 1]
        assert error.startswith(f"ValueError: Invalid process_group: it covers ranks {pp_ranks}, but parameter "
                                f"'0.0.weight' lives on ranks {dp_ranks}"), error


def parts_on_two_meshes() -> str | None:
    """One optimizer over parameters on the two stages' meshes of different ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    a, b = whole_model(2, torch.float32), whole_model(2, torch.float32)
    fully_shard(a, mesh=mesh["dp"])
    fully_shard(b, mesh=mesh["pp"])
    return error_of(lambda: dmuon.Muon([{"params": list(a.parameters()) + list(b.parameters())}]))


def test_parameters_on_meshes_that_no_group_covers_are_refused():
    """Each rank's parameters live on its dp pair and its pp pair: three ranks, no group of them."""
    for rank, error in enumerate(run_on_ranks(4, parts_on_two_meshes)):
        ranks = sorted({rank - rank % 2, rank - rank % 2 + 1, rank % 2, rank % 2 + 2})
        expected = f"ValueError: The optimizer's parameters live on ranks {ranks} (parameter of shape (16, 16)"
        assert error.startswith(expected) and "Pass process_group= a group of them" in error, error


def two_d_mesh_in_each_stage(dtype: torch.dtype) -> dict:
    """Ranks {0, 1} and {2, 3}, each a stage whose matrices sit on a 2-D (dp=1, tp=2) mesh as
    2-D blocks: no mesh dimension's group has all of a stage's ranks, so the optimizer takes
    ``process_group=`` the stage's group (made on every rank up front), and the piece exchange
    runs over it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dmuon.reference import ReferenceMuon
    from tests.helpers import full_tensors

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    stage_group, _ = dist.new_subgroups(2)
    stage = dist.get_rank() // 2
    shapes = [(24, 40), (16, 16)]
    init = [t.to(dtype) for t in full_tensors(shapes, seed=stage)]
    placements = [Shard(0), Shard(1)]
    params = [nn.Parameter(distribute_tensor(t.clone(), mesh["dp", "tp"], placements, src_data_rank=None))
              for t in init]
    refs = [nn.Parameter(t.clone()) for t in init]
    opt = dmuon.Muon([{"params": params, "algorithm": "muon", "param_names": ["a", "b"]}], process_group=stage_group,
                     **HPARAMS)
    ref = ReferenceMuon(refs, **HPARAMS)
    for step in range(2):
        for p, r, g in zip(params, refs, full_tensors(shapes, seed=100 * stage + step)):
            p.grad = distribute_tensor(g.to(dtype), mesh["dp", "tp"], placements, src_data_rank=None)
            r.grad = g.to(dtype)
        opt.step()
        ref.step()
    return dict(equal=[torch.equal(p.full_tensor(), r.detach()) for p, r in zip(params, refs)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_two_d_mesh_inside_a_stage_exchanges_over_the_stages_group(dtype):
    for r in run_on_ranks(4, two_d_mesh_in_each_stage, dtype):
        assert all(r["equal"])


def clipped_across_ddp_stages() -> dict:
    """Two stages of a model under DDP on their own ranks ({0, 1}, {2, 3}), each with one
    batch: dmuon.clip_grad_norm_ over every rank, each counting its stage's plain tensors once
    (process_group: the stage's), gives the norm of the whole model."""
    from torch.nn.parallel import DistributedDataParallel

    stage_group, _ = dist.new_subgroups(2)
    stage = dist.get_rank() // 2
    model = whole_model(4, torch.float32)
    part = DistributedDataParallel(nn.Sequential(*list(model)[2 * stage:2 * stage + 2]), process_group=stage_group)
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(stage))
    part(x).square().mean().backward()
    norm = dmuon.clip_grad_norm_(part.parameters(), 0.0, process_group=stage_group)
    return dict(norm=norm.item(), grads=[p.grad.clone() for p in part.parameters()])


def test_clipping_counts_each_stages_replicas_once():
    results = run_on_ranks(4, clipped_across_ddp_stages)
    expected = sum(g.double().square().sum() for r in (results[0], results[2]) for g in r["grads"]).sqrt().item()
    for r in results:
        assert r["norm"] == pytest.approx(expected, rel=1e-6)


def group_added_from_another_stage() -> str | None:
    """An optimizer of a stage's parameters (on its dp ranks), given a group of parameters that
    live on the pp ranks: refused, on the stage's ranks, before anything changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    mine, other = whole_model(2, torch.float32), whole_model(2, torch.float32)
    fully_shard(mine, mesh=mesh["dp"])
    fully_shard(other, mesh=mesh["pp"])
    opt = dmuon.Muon(mine, **HPARAMS)
    error = error_of(lambda: opt.add_param_group({"params": list(other.named_parameters())}))
    return error if len(opt.param_groups) == 1 else "the group was added"


def test_a_group_on_other_ranks_is_refused():
    for rank, error in enumerate(run_on_ranks(4, group_added_from_another_stage)):
        dp, pp = [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2]
        assert error == (f"ValueError: Parameter '0.0.weight' of param group 1 lives on ranks {pp}, this optimizer's "
                         f"parameters on ranks {dp}: give it an optimizer of its own."), error


def stage_with_a_plain_tensor(given: str | None, dtype: torch.dtype = torch.float32, ignored: str = "bias") -> dict:
    """A (pp=2, dp=2) job whose stages each hold a block under FSDP2 on ``mesh["dp"]`` with its
    last bias (or weight: a Muon matrix) kept out (``ignored_params``: a plain tensor, its
    gradient averaged over the stage's dp ranks by hand); ``given``: the optimizer's
    ``process_group`` ("world": the whole job's, wider than the stage)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh.get_coordinate()
    torch.manual_seed(pp)
    part = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH)).to(dtype)
    plain = getattr(part[2], ignored)
    fully_shard(part, mesh=mesh["dp"], ignored_params={plain})
    error = error_of(lambda: parts.append(dmuon.Muon(part, process_group=dist.group.WORLD if given == "world"
                                                     else None, **HPARAMS)))
    if error is not None:
        return dict(error=error)
    opt = parts[-1]
    for step in range(2):
        x, y = batch(10 * step + pp, dtype)
        mse(part(x.chunk(2)[dp]), y.chunk(2)[dp]).backward()
        dist.all_reduce(plain.grad, group=mesh["dp"].get_group())
        plain.grad /= 2
        opt.step()
        opt.zero_grad()
    return dict(error=None, stage=pp, params={n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                                             for n, p in part.named_parameters()})


parts: list = []  # the optimizer a stage builds, kept where error_of runs its construction


@pytest.mark.parametrize("dtype,ignored", [(torch.float32, "bias"), (torch.bfloat16, "bias"),
                                           (torch.float32, "weight")])
def test_a_stage_with_a_plain_tensor_agrees_over_its_own_ranks(dtype, ignored):
    """The plain tensor is a replica on the stage's ranks: the stage's optimizer agrees and
    exchanges over them (over the whole job it would wait for the other stage forever)."""
    results = run_on_ranks(4, stage_with_a_plain_tensor, None, dtype, ignored)
    for rank, r in enumerate(results):
        assert r["error"] is None, r["error"]
        replica = results[rank ^ 1]  # the other dp rank of the stage
        assert all(torch.equal(v, replica["params"][n]) for n, v in r["params"].items())


def test_a_process_group_wider_than_the_stage_is_refused_on_every_rank_before_any_collective():
    results = run_on_ranks(4, stage_with_a_plain_tensor, "world", timeout_s=30)
    for stage, others in ((0, "2, 3"), (1, "0, 1")):  # stage 0 on ranks 0 and 1
        assert_same_error([r["error"] for r in results[2 * stage:2 * stage + 2]],
                          r"ValueError: Invalid process_group: it covers ranks \[0, 1, 2, 3\], but the optimizer's "
                          rf"parameters live on ranks .*: ranks \[{others}\] hold none of them")
