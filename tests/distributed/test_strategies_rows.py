"""``dmuon/strategies/rows.py``: the row exchange on real ranks, in several buckets. Each rank sends
exactly the bytes its plan says (gathers to the owners and the updates' return), and the step is
the single-process step bitwise (FSDP2 at 2 and 3 ranks; every layout's parity:
tests/distributed/test_distributed_step.py; its stages run by early start: test_step_early.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

import dmuon
from dmuon.agreement import HEADER_LEN
from dmuon.strategies.rows import RowExchange
from tests.harness import run_on_ranks
from tests.helpers import full_tensor, single_process

SHAPES = [(48, 16), (16, 64), (64, 64), (32, 16), (16, 96), (96, 32), (40, 24)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(n, m, bias=False) for m, n in SHAPES])


def _step(fsdp: bool) -> dict:
    model = _model()
    if fsdp:
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = dmuon.Muon(model, lr=0.02, ns_dtype=torch.float32, bucket_bytes=64 * 64 * 4, early_start=False)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=g)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) if fsdp else full
    opt.step()
    plan = opt.stepper.plan
    exchanges = [s for s in plan.strategies if isinstance(s, RowExchange)]
    out = dict(params=[full_tensor(p) for p in model.parameters()])
    if fsdp:
        (exchange,) = exchanges
        out.update(buckets=len(exchange.buckets), plan_bytes=exchange.plan.bytes_sent(exchange.me),
                   sent=opt.last_step_stats.bytes_sent)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_the_row_exchange_steps_as_one_process_with_its_plans_bytes_and_stages(world):
    reference = single_process(_step, False)
    for rank, result in enumerate(run_on_ranks(world, _step, True)):
        assert all(torch.equal(a, b) for a, b in zip(result["params"], reference["params"])), rank
        assert result["sent"] == result["plan_bytes"] + 4 * HEADER_LEN  # the agreement's header besides
        assert result["buckets"] > 1
