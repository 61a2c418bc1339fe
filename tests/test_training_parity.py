"""End-to-end training parity (TESTING.md row 4): a small Llama-style transformer trained with
dmuon.Muon under DDP, FSDP2 and HSDP, the data split across ranks, against one process on the
global batch — losses and parameters agree to the tolerance that reduction order allows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.models import Llama, SyntheticTokens, get_config
from tests.distributed import run_on_ranks

STEPS, GLOBAL_BATCH, SEQ_LEN = 5, 12, 16
HPARAMS = dict(lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32)


def train(parallel: str | None, replica_split=None) -> dict:
    """Train the tiny model; ``parallel`` None is the single-process reference."""
    config = get_config("tiny")
    model = Llama(config, seed=0)
    rank, world = (dist.get_rank(), dist.get_world_size()) if parallel else (0, 1)
    if parallel == "ddp":
        model = DistributedDataParallel(model)
    elif parallel in ("fsdp", "hsdp"):
        shape = (2, world // 2) if parallel == "hsdp" else (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, replica_split=replica_split, **HPARAMS)
    data = SyntheticTokens(config.vocab_size, seed=0)
    losses = []
    for step in range(STEPS):
        inputs, targets = data.local_batch(step, GLOBAL_BATCH, SEQ_LEN, rank, world)
        loss = lm_loss(model, inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        if parallel:
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        losses.append(global_loss.item())
    params = {
        name.removeprefix("module."): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    return dict(losses=losses, params=params)


def lm_loss(model, inputs, targets):
    """``Llama.loss`` through the (possibly DDP-wrapped) module's own forward, so DDP's hooks fire."""
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@pytest.fixture(scope="module")
def reference() -> dict:
    torch.set_num_threads(1)
    return train(None)


@pytest.mark.parametrize("parallel,world,replica_split", [
    ("ddp", 2, None), ("ddp", 3, None),
    ("fsdp", 2, None), ("fsdp", 3, None), ("fsdp", 4, None),
    ("hsdp", 4, True), ("hsdp", 4, False),
])
def test_training_matches_single_process(reference, parallel, world, replica_split):
    results = run_on_ranks(world, train, parallel, replica_split)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
        assert r["params"].keys() == reference["params"].keys()
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert reference["losses"][-1] < reference["losses"][0]
    # replicas stay identical
    for r in results[1:]:
        for name, value in r["params"].items():
            assert torch.equal(value, results[0]["params"][name]), name
