"""What a training loop around ``dmuon.Muon`` commonly adds (README, "Works with"): a compiled
model, activation checkpointing, bf16 autocast, fp16 autocast with a ``GradScaler``, and
parameters of several dtypes in one optimizer. Each against the same loop without it, or against
what it must equal."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

import dmuon
from tests.harness import run_on_ranks
from tests.helpers import whole_params

HPARAMS = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
WIDTH, BATCH = 32, 8


class Blocks(nn.Module):
    """Four residual MLP blocks and a head; ``recompute``: each block under activation checkpointing."""

    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
                                    for _ in range(4))
        self.head = nn.Linear(WIDTH, 4)
        self.recompute = recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=False) if self.recompute else block(x))
        return self.head(x)


def batch(step: int, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    return x[rows], torch.randn(BATCH, 4, generator=generator)[rows]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 3, rows: slice = slice(None),
          autocast: torch.dtype | None = None, scaler: torch.amp.GradScaler | None = None) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = batch(step, rows)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = nn.functional.mse_loss(model(x).float(), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        losses.append(loss.item())
    return losses


def test_a_compiled_model_trains_as_the_eager_one():
    """``torch.compile(model)``: the optimizer holds the same parameters; aot_eager keeps the
    eager kernels, so the weights after three steps are the eager run's (to rounding)."""
    eager = Blocks()
    train(eager, dmuon.Muon(eager, **HPARAMS))
    model = Blocks()
    compiled = torch.compile(model, backend="aot_eager")
    train(compiled, dmuon.Muon(model, **HPARAMS))
    for name, weight in whole_params(eager).items():
        torch.testing.assert_close(whole_params(model)[name], weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("early_start", [False, True])
def test_activation_checkpointing_is_bitwise_the_same_training(early_start):
    """Recomputing the blocks in backward gives the same gradients, hence the same steps, with
    Newton–Schulz at ``step()`` or begun during the backward pass (early start)."""
    plain = Blocks()
    train(plain, dmuon.Muon(plain, early_start=early_start, **HPARAMS))
    recomputed = Blocks(recompute=True)
    opt = dmuon.Muon(recomputed, early_start=early_start, **HPARAMS)
    train(recomputed, opt)
    assert all(torch.equal(a, b) for a, b in zip(whole_params(recomputed).values(), whole_params(plain).values()))
    if early_start:
        assert opt.early_start.startswith("on")


def fsdp_with_checkpointing(recompute: bool, dtype: torch.dtype) -> dict:
    torch.set_num_threads(1)
    model = Blocks(recompute=recompute).to(dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    half = BATCH // dist.get_world_size()
    rank = dist.get_rank()
    train(model, dmuon.Muon(model, **HPARAMS), rows=slice(rank * half, (rank + 1) * half),
          autocast=None if dtype == torch.float32 else dtype)
    return whole_params(model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_checkpointing_under_fsdp2_is_bitwise_the_same_training(dtype):
    """bf16 parameters too (the forward then computes in bf16: autocast to their dtype)."""
    plain = run_on_ranks(2, fsdp_with_checkpointing, False, dtype)
    recomputed = run_on_ranks(2, fsdp_with_checkpointing, True, dtype)
    assert plain[0].keys() == recomputed[0].keys()
    assert all(torch.equal(plain[0][name], recomputed[0][name]) for name in plain[0])
    assert all(torch.equal(plain[0][name], plain[1][name]) for name in plain[0])  # every rank sees the same
    assert {p.dtype for p in plain[0].values()} == {dtype}


def test_bf16_autocast_trains_fp32_parameters_and_state():
    """Under autocast the gradients of fp32 parameters are fp32: dmuon steps them as without it,
    and keeps its momentum in fp32."""
    model = Blocks()
    opt = dmuon.Muon(model, **HPARAMS)
    losses = train(model, opt, steps=8, autocast=torch.bfloat16)
    assert losses[-1] < losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(t.dtype == torch.float32 for state in opt.state.values() for t in state.values()
               if isinstance(t, torch.Tensor) and t.is_floating_point())


def test_fp16_autocast_with_a_grad_scaler_skips_the_step_an_overflow_spoils():
    """``scaler.step(opt)`` unscales, then steps only where no gradient overflowed: a first scale
    of 2**40 overflows fp16's range (65504) in backward, so that step leaves the model alone and
    the scale falls; the loop then trains."""
    model = Blocks()
    before = whole_params(model)
    opt = dmuon.Muon(model, **HPARAMS)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    losses = train(model, opt, steps=1, autocast=torch.float16, scaler=scaler)
    assert all(torch.equal(p, before[name]) for name, p in whole_params(model).items())
    assert scaler.get_scale() < 2.0**40 and opt.skipped_steps == 0  # the scaler skipped it, not dmuon
    losses = train(model, opt, steps=12, autocast=torch.float16, scaler=scaler)
    assert losses[-1] < losses[0] and all(p.dtype == torch.float32 for p in model.parameters())


def test_parameters_of_several_dtypes_in_one_optimizer_step_as_each_dtype_alone():
    """A bf16 trunk with an fp32 head (and an fp64 block): one dmuon.Muon steps each parameter as
    an optimizer over that dtype's parameters alone would, bitwise; no dtype is cast to another.
    (No fp16 parameters: AdamW's fp16 state underflows to NaN updates, in torch.optim.AdamW as in
    dmuon's AdamW, which is torch's; fp16 training keeps fp32 parameters under autocast, above.)"""
    def mixed() -> Blocks:
        model = Blocks()
        model.blocks[:3].to(torch.bfloat16)
        model.blocks[3].to(torch.float64)
        return model

    model = mixed()
    opt = dmuon.Muon(model, **HPARAMS)
    train_mixed(model, [opt])
    assert opt.skipped_steps == 0
    alone = mixed()
    by_dtype: dict[torch.dtype, list] = {}
    for name, p in alone.named_parameters():
        by_dtype.setdefault(p.dtype, []).append((name, p))
    train_mixed(alone, [dmuon.Muon(named, **HPARAMS) for named in by_dtype.values()])
    for (name, a), b in zip(whole_params(model).items(), whole_params(alone).values()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16, torch.float64, torch.float32}


def train_mixed(model: Blocks, optimizers: list[torch.optim.Optimizer]) -> None:
    """Three steps; each block computes in its own parameters' dtype."""
    for step in range(3):
        x, y = batch(step)
        for opt in optimizers:
            opt.zero_grad()
        for block in model.blocks:
            x = (x.to(block[0].weight.dtype) + block(x.to(block[0].weight.dtype)))
        loss = nn.functional.mse_loss(model.head(x.float()), y)
        loss.backward()
        for opt in optimizers:
            opt.step()
