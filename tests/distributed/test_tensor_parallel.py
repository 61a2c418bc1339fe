"""Tensor parallel (row-wise ``Shard(1)``, column-wise ``Shard(0)``) and FSDP + tensor parallel on a
2×2 mesh: ``dmuon.Muon`` orthogonalizes each full logical matrix once, and training matches one
process to the tolerance of the reduction order; placements never change; a TP checkpoint loads
into one process (unsupported layouts: tests/distributed/test_distributed_step.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import dmuon
from tests.harness import run_on_ranks
from tests.helpers import dcp_load, dcp_save, full_tensor, single_process

HPARAMS = dict(lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32)
STEPS, GLOBAL_BATCH = 3, 12  # divisible by every data-parallel size used (2, 3)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(16, 40)  # column-wise: weight Shard(0)
        self.down = nn.Linear(40, 24)  # row-wise: weight Shard(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 24, generator=g)


def build(parallel: str | None, dtype: torch.dtype = torch.float32,
          **options) -> tuple[nn.Module, dmuon.Muon, int, int]:
    """The MLP (its parameters in ``dtype``) under ``parallel`` ("tp": 1-D TP mesh; "fsdp+tp":
    2×2 (dp, tp) mesh; None: one process), its optimizer, and this rank's data-parallel index
    and count."""
    model = MLP().to(dtype)
    dp_rank, dp_size = 0, 1
    if parallel == "tp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    elif parallel == "fsdp+tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        dp_rank, dp_size = mesh["dp"].get_local_rank(), 2
    elif parallel == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        dp_rank, dp_size = dist.get_rank(), dist.get_world_size()
    return model, dmuon.Muon(model, **HPARAMS, **options), dp_rank, dp_size


def train(parallel: str | None, dtype: torch.dtype = torch.float32, **options) -> dict:
    model, opt, dp_rank, dp_size = build(parallel, dtype, **options)
    placements_before = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    losses = []
    for step in range(STEPS):
        x, y = (t.chunk(dp_size)[dp_rank].to(dtype) for t in batch(step))
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    placements_after = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return dict(params={n: full_tensor(p) for n, p in model.named_parameters()}, losses=losses,
                placements=(placements_before, placements_after), matrices=opt.last_step_stats.matrices_orthogonalized,
                planned=[len(plan.units) for plan in opt.plans])


@pytest.fixture(scope="module")
def reference() -> dict:
    return single_process(train, None)


@pytest.mark.parametrize("parallel,world", [("tp", 2), ("tp", 4), ("fsdp+tp", 4)])
def test_tensor_parallel_matches_single_process(reference, parallel, world):
    results = run_on_ranks(world, train, parallel)
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=f"{rank} {name}")
        before, after = r["placements"]
        assert before == after and before, rank
    if parallel == "tp":  # the same data everywhere: the same loss
        torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(reference["losses"]))
    assert sum(r["matrices"] for r in results) == 2  # each logical matrix once in the job


@pytest.mark.parametrize("parallel,world", [("tp", 2), ("fsdp+tp", 4)])
def test_bf16_parameters_under_tensor_parallel_stay_identical_across_ranks(parallel, world):
    """bf16 weights: every rank's full view of every parameter is bitwise the same (the TP
    shards are put together from the same updates; under FSDP + TP the two data-parallel
    replicas of each TP shard agree), and close to one process (bf16 rounding; TP splits the
    forward's sums)."""
    reference = single_process(train, None, torch.bfloat16)
    results = run_on_ranks(world, train, parallel, torch.bfloat16)
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, results[0]["params"][name]), (rank, name)
            torch.testing.assert_close(value, reference["params"][name], rtol=3e-2, atol=3e-2, msg=name)


def save_and_load_tp(path: str, parallel: str = "tp") -> dict:
    model, opt, _, _ = build(parallel)
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    opt.step()
    dcp_save(model, opt, path)
    return dict(params={n: full_tensor(p) for n, p in model.named_parameters()},
                momentum={n: full_tensor(opt.state[p]["momentum_buffer"])
                          for n, p in model.named_parameters() if p.ndim == 2})


def load_plain(path: str, parallel: str | None = None) -> dict:
    model, opt, _, _ = build(parallel)
    dcp_load(model, opt, path)
    return dict(params={n: full_tensor(p) for n, p in model.named_parameters()},
                momentum={n: full_tensor(opt.state[p]["momentum_buffer"])
                          for n, p in model.named_parameters() if p.ndim == 2})


@pytest.mark.parametrize("parallel,world", [("tp", 2), ("fsdp+tp", 4)])
def test_tensor_parallel_checkpoint_loads_in_one_process(tmp_path, parallel, world):
    saved = run_on_ranks(world, save_and_load_tp, str(tmp_path / "tp"), parallel)[0]
    loaded = run_on_ranks(1, load_plain, str(tmp_path / "tp"))[0]
    for part in ("params", "momentum"):
        assert saved[part].keys() == loaded[part].keys() and saved[part]
        for name in saved[part]:
            assert torch.equal(saved[part][name], loaded[part][name]), (part, name)


# ---------------------------------------------------------------- distributed Newton–Schulz


def test_planner_splits_a_matrix_only_when_it_lowers_the_makespan():
    """Splitting (distributed NS on every rank of the group) pays for one matrix much larger than
    the rest, and for fewer matrices than ranks; not when there are enough to balance."""
    from dmuon.choices import choose_distributed, distributed_cost
    from dmuon.layout import Layout
    from dmuon.orthogonalization import newton_schulz_flops
    from dmuon.planner import Unit

    def unit(name: str, m: int, n: int, size: int) -> tuple[Unit, float]:
        layout = Layout((m, n), 1, size, tuple(range(size)))
        full = newton_schulz_flops(m, n, steps=5, method="standard")
        blocks = newton_schulz_flops(n, -(-m // size), steps=5, method="standard", gram_side=n)  # rows split
        return Unit(name, layout, 1, m, n, 4, full), distributed_cost(blocks, 4 * n * n, 5, size)

    def choice(shapes, size):
        units, costs = zip(*(unit(f"w{i}", m, n, size) for i, (m, n) in enumerate(shapes)))
        return choose_distributed(units, costs, size)

    assert choice([(256, 256)] * 64, 8) == frozenset()  # 8 matrices a rank: LPT balances them
    assert choice([(16384, 256)] + [(256, 256)] * 8, 8) == {0}  # one large tall matrix: split it
    assert choice([(8192, 512)] * 2, 8) == {0, 1}  # fewer matrices than ranks


# ---------------------------------------------------------------- 2-D meshes: the piece exchange

TWO_D = {  # placements on a (2, 2) mesh, and the shapes stepped with them
    "fsdp x colwise tp": ([_StridedShard(0, split_factor=2), Shard(0)], [(40, 16), (16, 24), (8, 8)]),
    "fsdp x rowwise tp": ([Shard(0), Shard(1)], [(24, 40), (16, 24), (7, 5)]),
    "2-D blocks, columns first": ([Shard(1), Shard(0)], [(24, 40), (16, 16)]),
    "expert stacks, efsdp dim 1": ([Shard(0), Shard(1)], [(4, 16, 32), (4, 32, 16)]),
    "expert stacks, efsdp dim 2": ([Shard(0), Shard(2)], [(4, 16, 32), (4, 32, 16)]),
    "hsdp replicas x rowwise tp": ([Replicate(), Shard(1)], [(24, 40), (16, 24)]),
}


