"""``dmuon.Muon(cuda_graphs=True)``: Newton–Schulz replayed from CUDA graphs. The capture needs a
GPU (benchmarks/gpu_check.sh checks it there); everything around it runs here through the CPU twin
(``dmuon.cuda_graphs.eager_replay``), which keeps the same static buffers and bookkeeping."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.cuda_graphs import GraphedOrthogonalize, eager_replay
from dmuon.orthogonalization import orthogonalize, resolve_config
from tests.harness import run_on_ranks
from tests.helpers import full_tensor


def test_replays_equal_the_plain_calls_and_never_alias():
    graphed = GraphedOrthogonalize(orthogonalize, cpu_twin=eager_replay)
    generator = torch.Generator().manual_seed(0)
    first = None
    for shape in [(2, 16, 48), (2, 16, 48), (3, 48, 16), (2, 16, 48)]:
        for method in ("standard", "gram"):
            config = resolve_config(shape[-2:], "cpu", method=method, dtype=torch.float32)
            G = torch.randn(shape, generator=generator)
            got = graphed(G, config)
            assert torch.equal(got, orthogonalize(G, config)), (shape, method)
            if first is None:
                first, first_copy = got, got.clone()
    assert torch.equal(first, first_copy)  # later replays of its graph left it alone (a clone)
    assert len(graphed.replays) == 4  # one per (shape, dtype, device, config)


def test_without_a_twin_cpu_tensors_run_directly():
    calls = []

    def fn(G, config):
        calls.append(G.shape)
        return G * 2

    graphed = GraphedOrthogonalize(fn)
    config = resolve_config((4, 4), "cpu")
    assert torch.equal(graphed(torch.ones(1, 4, 4), config), torch.full((1, 4, 4), 2.0))
    assert calls == [(1, 4, 4)] and not graphed.replays


def train(parallel: str | None, graphs: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 24))
    if parallel == "fsdp":
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = dmuon.Muon(model, lr=0.02, ns_dtype=torch.float32, cuda_graphs=graphs)
    if graphs:  # what runs on a GPU as graphs runs here through the twin
        opt._stepper.engine.orthogonalize.cpu_twin = eager_replay
    data = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 24, generator=data)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    if graphs:
        assert opt._stepper.engine.orthogonalize.replays  # the calls went through the replay path
    return [full_tensor(p) for p in model.parameters()]


@pytest.mark.parametrize("parallel,world", [(None, 1), ("fsdp", 2)])
def test_training_with_graphs_is_bitwise_the_plain_training(parallel, world):
    run = (lambda graphs: [train(None, graphs)]) if world == 1 else \
        (lambda graphs: run_on_ranks(world, train, parallel, graphs))
    for plain, graphed in zip(run(False), run(True)):
        for a, b in zip(plain, graphed):
            assert torch.equal(a, b)


def test_cuda_graphs_must_be_a_bool():
    with pytest.raises(ValueError, match="Invalid cuda_graphs='yes'"):
        dmuon.Muon(nn.Linear(8, 8), cuda_graphs="yes")
