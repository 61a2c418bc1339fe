"""Tensor parallel (row-wise ``Shard(1)``, column-wise ``Shard(0)``) and FSDP + tensor parallel on a
2×2 mesh: ``dmuon.Muon`` orthogonalizes each full logical matrix once, and training matches one
process to the tolerance of the reduction order; placements never change; a TP checkpoint loads
into one process (unsupported layouts: tests/test_distributed_step.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import dmuon
from tests.distributed import run_on_ranks

HPARAMS = dict(lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32)
STEPS, GLOBAL_BATCH = 3, 8


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


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def build(parallel: str | None) -> tuple[nn.Module, dmuon.Muon, int, int]:
    """The MLP under ``parallel`` ("tp": 1-D TP mesh; "fsdp+tp": 2×2 (dp, tp) mesh; None: one
    process), its optimizer, and this rank's data-parallel index and count."""
    model = MLP()
    dp_rank, dp_size = 0, 1
    if parallel == "tp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    elif parallel == "fsdp+tp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        dp_rank, dp_size = mesh["dp"].get_local_rank(), 2
    return model, dmuon.Muon(model, **HPARAMS), dp_rank, dp_size


def train(parallel: str | None) -> dict:
    model, opt, dp_rank, dp_size = build(parallel)
    placements_before = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    losses = []
    for step in range(STEPS):
        x, y = (t.chunk(dp_size)[dp_rank] for t in batch(step))
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    placements_after = {n: tuple(p.placements) for n, p in model.named_parameters() if isinstance(p, DTensor)}
    return dict(params={n: full(p) for n, p in model.named_parameters()}, losses=losses,
                placements=(placements_before, placements_after), matrices=opt.last_step_stats.matrices_orthogonalized)


@pytest.fixture(scope="module")
def reference() -> dict:
    torch.set_num_threads(1)
    return train(None)


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


def save_and_load_tp(path: str) -> dict:
    model, opt, _, _ = build("tp")
    x, y = batch(0)
    F.mse_loss(model(x), y).backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    return dict(params={n: full(p) for n, p in model.named_parameters()},
                momentum={n: full(opt.state[p]["momentum_buffer"]) for n, p in model.named_parameters() if p.ndim == 2})


def load_plain(path: str) -> dict:
    model, opt, _, _ = build(None)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return dict(params={n: full(p) for n, p in model.named_parameters()},
                momentum={n: full(opt.state[p]["momentum_buffer"]) for n, p in model.named_parameters() if p.ndim == 2})


def test_tensor_parallel_checkpoint_loads_in_one_process(tmp_path):
    saved = run_on_ranks(2, save_and_load_tp, str(tmp_path / "tp"))[0]
    loaded = run_on_ranks(1, load_plain, str(tmp_path / "tp"))[0]
    for part in ("params", "momentum"):
        assert saved[part].keys() == loaded[part].keys() and saved[part]
        for name in saved[part]:
            assert torch.equal(saved[part][name], loaded[part][name]), (part, name)
