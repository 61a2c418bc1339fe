"""Train a small Llama-style model with dmuon.Muon (or AdamW) under DDP, FSDP2, HSDP or owner sharding.

    torchrun --nproc-per-node 2 examples/train_gpt.py --parallel fsdp2 --steps 200 --log-file muon.jsonl
    torchrun --nproc-per-node 2 examples/train_gpt.py --parallel fsdp2 --optimizer adamw --log-file adamw.jsonl
    python examples/plot_losses.py muon.jsonl adamw.jsonl --out losses.png

Without torchrun it runs as a single process. CPU ranks talk over gloo, CUDA ranks over NCCL.
Data: a seeded synthetic Markov chain (``dmuon.tools.models.SyntheticTokens``), or ``--data FILE``, any
local file read as bytes (vocabulary 256), so nothing is downloaded. Every batch is a pure
function of (seed, step): the step number is the whole data position a checkpoint must keep.

Per step, rank 0 appends one JSON line to ``--log-file``: step, loss (mean over ranks), lr, step and
optimizer-step milliseconds, gradient norm before clipping, ``dmuon.Muon.statistics()`` (this
rank's by default, the job's with ``--log-all-ranks``) and, with ``--parallel owner``, the bytes
the owner sharding sent. The first line holds the run's configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.optim.lr_scheduler import LambdaLR

import dmuon
from dmuon.tools.models import PRESETS, Llama, LlamaConfig, SyntheticTokens, get_config

PARALLEL = ("ddp", "fsdp2", "hsdp", "owner", "none")
BETAS = (0.9, 0.95)  # the same for AdamW and for dmuon's AdamW part, so the comparison is fair
LATEST = "latest"  # --resume without a path: the newest checkpoint in --ckpt-dir


# ------------------------------------------------------------------ data

def _batch_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**63)


class ByteTokens:
    """Random windows of a local file, one token per byte (vocabulary 256).

    Like :class:`SyntheticTokens`, batch ``step`` depends on ``(seed, step)`` only, so resuming
    at a step sees exactly the batches an uninterrupted run would have seen.
    """

    vocab_size = 256

    def __init__(self, path: str | os.PathLike, seed: int = 0) -> None:
        self.tokens = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8).long()
        self.seed = seed

    def local_batch(self, step: int, global_batch: int, seq_len: int, rank: int, world_size: int
                    ) -> tuple[Tensor, Tensor]:
        """Rank ``rank``'s contiguous share of the global batch ``step``: ``(inputs, targets)``."""
        if len(self.tokens) <= seq_len + 1:
            raise ValueError(f"the data file has {len(self.tokens)} bytes; --seq-len {seq_len} needs more")
        generator = torch.Generator().manual_seed(_batch_seed(self.seed, step))
        starts = torch.randint(len(self.tokens) - seq_len - 1, (global_batch,), generator=generator)
        per_rank = global_batch // world_size
        starts = starts[rank * per_rank:(rank + 1) * per_rank]
        windows = self.tokens[starts[:, None] + torch.arange(seq_len + 1)]
        return windows[:, :-1], windows[:, 1:]


# ------------------------------------------------------------------ setup

def init_distributed(device_choice: str) -> torch.device:
    """Join the torchrun job, or form a one-rank group when started without torchrun, so that
    every --parallel mode (FSDP2 needs a process group) also runs as a single process."""
    use_cuda = device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())
    backend = "nccl" if use_cuda else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def build_model(config: LlamaConfig, parallel: str, device: torch.device, seed: int = 0, replicas: int | None = None,
                reshard_after_forward: bool = False) -> tuple[nn.Module, dmuon.OwnerSharding | None]:
    """The model (every rank builds the same weights from ``seed``) wrapped for ``parallel``,
    and the owner sharding when ``parallel == "owner"``."""
    model = Llama(config, seed=seed).to(device)  # built on CPU: the same weights on any device
    world = dist.get_world_size()
    if parallel == "none":
        if world != 1:
            raise ValueError("--parallel none runs a single process; pick ddp, fsdp2, hsdp or owner")
        return model, None
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(model), None
    if parallel == "owner":
        mesh = init_device_mesh(device.type, (world,))
        sharding = dmuon.shard_by_owner(model, mesh, layers=model.layers,
                                        reshard_after_forward=reshard_after_forward)
        return model, sharding
    if parallel == "hsdp":
        replicas = replicas or (2 if world % 2 == 0 else 1)
        if world % replicas:
            raise ValueError(f"--replicas {replicas} does not divide the world size {world}")
        mesh = init_device_mesh(device.type, (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(device.type, (world,))
    for layer in model.layers:  # one all-gather per block, prefetched by FSDP2
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model, None


def build_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=BETAS)
    return dmuon.Muon(model, lr=lr, weight_decay=weight_decay, adamw_betas=BETAS)


def lr_factor(step: int, warmup: int, total: int, final: float = 0.1) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine from 1 down to ``final`` at ``total``.
    ``step`` is the index of the step about to be taken (LambdaLR's ``last_epoch``)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return final + (1 - final) * 0.5 * (1 + math.cos(math.pi * progress))


# ------------------------------------------------------------------ one step

def sync_gradients(model: nn.Module, sharding: dmuon.OwnerSharding | None, sync: bool
                   ) -> contextlib.AbstractContextManager:
    """The context of one micro-batch's forward and backward: gradients are reduced across
    ranks only when ``sync`` (the last micro-batch); before that they accumulate locally."""
    if sync:
        return contextlib.nullcontext()
    if sharding is not None:
        return sharding.no_sync()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # a setting that persists: switched back on leaving
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    step_ms: float
    opt_step_ms: float


def train_step(model: nn.Module, sharding: dmuon.OwnerSharding | None, optimizer: torch.optim.Optimizer,
               inputs: Tensor, targets: Tensor, grad_accum: int, clip: float) -> StepResult:
    """Forward and backward over ``grad_accum`` micro-batches of this rank's batch, clip, step."""
    device = inputs.device
    _synchronize(device)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    micro_batches = list(zip(inputs.chunk(grad_accum), targets.chunk(grad_accum)))
    for index, (x, y) in enumerate(micro_batches):
        with sync_gradients(model, sharding, sync=index == len(micro_batches) - 1):
            # model(...) rather than model.loss(...): DDP syncs gradients through its own forward
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / grad_accum
            loss.backward()
        total += loss.detach()
    norm = dmuon.clip_grad_norm_(model.parameters(), clip)
    _synchronize(device)
    before_step = time.perf_counter()
    optimizer.step()
    _synchronize(device)
    end = time.perf_counter()
    dist.all_reduce(total)  # every rank's batch has as many tokens: the mean is the global loss
    return StepResult(total.item() / dist.get_world_size(), norm.item(), 1e3 * (end - start),
                      1e3 * (end - before_step))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ checkpoints

class TrainState(Stateful):
    """Everything a resumed run needs, in one object ``torch.distributed.checkpoint`` saves and
    loads in place: model, optimizer (sharded as the model is), LR scheduler, and the step."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "scheduler": self.scheduler.state_dict(),
                "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])
        self.scheduler.load_state_dict(state_dict["scheduler"])
        self.step = state_dict["step"]


def checkpoint_path(ckpt_dir: str, step: int) -> Path:
    return Path(ckpt_dir) / f"step_{step:06d}"


def latest_checkpoint(ckpt_dir: str) -> Path | None:
    """The newest complete checkpoint: DCP writes ``.metadata`` last, so one without it was cut short."""
    done = sorted(p for p in Path(ckpt_dir).glob("step_*") if (p / ".metadata").exists())
    return done[-1] if done else None


# ------------------------------------------------------------------ logging

def step_record(step: int, result: StepResult, lr: float, optimizer: torch.optim.Optimizer,
                sharding: dmuon.OwnerSharding | None, all_ranks: bool) -> dict[str, float]:
    """One JSON line. ``statistics(all_ranks=True)`` is a collective: every rank calls this."""
    record: dict[str, float] = {"step": step, "loss": result.loss, "lr": lr, "step_ms": result.step_ms,
                                "opt_step_ms": result.opt_step_ms, "grad_norm": result.grad_norm}
    if isinstance(optimizer, dmuon.Muon):
        record.update(optimizer.statistics(all_ranks=all_ranks))
    if sharding is not None:
        record.update(owner_bytes_sent=sharding.last_step_bytes, owner_rest_bytes_sent=sharding.rest_bytes)
    return record


def open_log(path: str | None, resumed: bool) -> TextIO | None:
    """Rank 0's log: appended to when resuming, so that one file holds the whole run."""
    if path is None or dist.get_rank() != 0:
        return None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "a" if resumed else "w")


# ------------------------------------------------------------------ main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--parallel", choices=PARALLEL, default="ddp",
                        help="how the model is spread over ranks (none: one process, no wrapper)")
    parser.add_argument("--optimizer", choices=("dmuon", "adamw"), default="dmuon")
    parser.add_argument("--preset", choices=list(PRESETS), default="demo", help="model shape")
    parser.add_argument("--steps", type=int, default=200, help="total optimizer steps (also when resuming)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, in sequences")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step and rank")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak lr, of Muon and AdamW alike")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=20, help="linear warm-up steps before the cosine")
    parser.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    parser.add_argument("--data", metavar="PATH", help="a local file to train on, as bytes (default: synthetic)")
    parser.add_argument("--replicas", type=int, help="--parallel hsdp: replica groups (default: 2 for an even "
                        "world size, else 1)")
    parser.add_argument("--reshard-after-forward", action="store_true",
                        help="FSDP2/owner: free gathered weights after forward (less memory, more traffic)")
    parser.add_argument("--ckpt-dir", metavar="DIR", help="where to save checkpoints (DCP, one folder per step)")
    parser.add_argument("--save-every", type=int, default=0, help="save every N steps, and at the end (0: at the end)")
    parser.add_argument("--resume", nargs="?", const=LATEST, metavar="CHECKPOINT",
                        help="continue from CHECKPOINT, or without it from the newest one in --ckpt-dir")
    # torchrun takes "--log" for an abbreviation of its own --log-dir and stops: hence --log-file
    parser.add_argument("--log-file", "--log", dest="log", metavar="PATH", help="JSON lines, one per step (rank 0)")
    parser.add_argument("--log-all-ranks", action="store_true",
                        help="log the job's optimizer statistics (one more collective per step)")
    parser.add_argument("--print-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)
    if args.resume == LATEST and not args.ckpt_dir:
        parser.error("--resume without a checkpoint needs --ckpt-dir")
    if args.parallel == "owner" and args.optimizer != "dmuon":
        # between steps a rank holds only the matrices it owns: only dmuon.Muon knows to step those alone
        parser.error("--parallel owner needs --optimizer dmuon")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = init_distributed(args.device)
    try:
        train(args, device)
        # The owner sharding's hooks tie it and the model into reference cycles: free them, and
        # the tensors its finished collectives held, while the process group is still alive.
        gc.collect()
        dist.barrier()  # no rank tears the group down while another still talks to it
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % (world * args.grad_accum):
        raise ValueError(f"--batch-size {args.batch_size} must be a multiple of world size x --grad-accum "
                         f"({world} x {args.grad_accum}): every micro-batch must be the same size")
    data = ByteTokens(args.data, args.seed) if args.data else None
    config = get_config(args.preset, **({"vocab_size": ByteTokens.vocab_size} if data else {}))
    if args.seq_len > config.max_seq_len:
        raise ValueError(f"--seq-len {args.seq_len} exceeds the preset's max_seq_len {config.max_seq_len}")
    data = data or SyntheticTokens(config.vocab_size, seed=args.seed)

    model, sharding = build_model(config, args.parallel, device, args.seed, args.replicas,
                                  args.reshard_after_forward)
    optimizer = build_optimizer(args.optimizer, model, args.lr, args.weight_decay)
    scheduler = LambdaLR(optimizer, lambda step: lr_factor(step, args.warmup, args.steps))
    state = TrainState(model, optimizer, scheduler)
    checkpoint = latest_checkpoint(args.ckpt_dir) if args.resume == LATEST else args.resume
    if checkpoint is not None:
        dcp.load({"train": state}, checkpoint_id=str(checkpoint))
    if rank == 0:
        where = f"resumed from {checkpoint} at step {state.step}" if checkpoint else "from scratch"
        print(f"{args.optimizer} / {args.parallel} on {world} x {device.type}, preset {args.preset}, {where}")

    log = open_log(args.log, resumed=checkpoint is not None)
    try:
        if log is not None and checkpoint is None:
            log.write(json.dumps({"config": {**vars(args), "world_size": world}}) + "\n")
        while state.step < args.steps:
            inputs, targets = data.local_batch(state.step, args.batch_size, args.seq_len, rank, world)
            lr = scheduler.get_last_lr()[0]  # the lr of this step, before the scheduler moves on
            result = train_step(model, sharding, optimizer, inputs.to(device), targets.to(device),
                                args.grad_accum, args.clip)
            record = step_record(state.step + 1, result, lr, optimizer, sharding, args.log_all_ranks)
            scheduler.step()  # after the record: its "lr/<group>" entries show the lr just used
            state.step += 1
            if log is not None:
                log.write(json.dumps(record) + "\n")
                log.flush()
            if rank == 0 and (state.step % args.print_every == 0 or state.step == args.steps):
                print(f"step {state.step:5d}  loss {result.loss:.4f}  lr {lr:.2e}  "
                      f"step {result.step_ms:7.1f} ms  opt step {result.opt_step_ms:6.1f} ms")
            if args.ckpt_dir and ((args.save_every and state.step % args.save_every == 0)
                                  or state.step == args.steps):
                dcp.save({"train": state}, checkpoint_id=str(checkpoint_path(args.ckpt_dir, state.step)))
    finally:
        if log is not None:
            log.close()


if __name__ == "__main__":
    main()
