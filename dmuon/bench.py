"""``dmuon bench``: data-parallel training side by side — AdamW, vanilla Muon and dmuon.Muon
under DDP and FSDP2 — on gloo ranks this command spawns itself (no torchrun).

Every configuration trains the same model from the same weights on the same batches, in the
same processes, one after the other, so the ratios compare like with like on a noisy machine:

    ddp-adamw        DDP + torch.optim.AdamW
    ddp-torch-muon   DDP + torch.optim.Muon on every rank (each rank orthogonalizes everything)
    fsdp-adamw       FSDP2 + torch.optim.AdamW
    fsdp-torch-muon  FSDP2 + torch.optim.Muon (Newton–Schulz on sharded DTensors)
    ddp-dmuon        DDP + dmuon.Muon
    fsdp-dmuon       FSDP2 + dmuon.Muon

Times are medians over the measured steps of the slowest rank; "bytes/step" is what
dmuon.Muon's own collectives sent, averaged over ranks (the other optimizers' traffic is not
counted).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dmuon.demo import CONFIGS as OPTIMIZERS
from dmuon.models import PRESETS, Llama, SyntheticTokens, get_config

CONFIGS = ("ddp-adamw", "ddp-torch-muon", "fsdp-adamw", "fsdp-torch-muon", "ddp-dmuon", "fsdp-dmuon")


@dataclass(frozen=True)
class BenchResult:
    config: str
    world_size: int
    opt_step_ms: float
    step_ms: float
    bytes_per_step: float | None  # mean over ranks of what dmuon.Muon's collectives sent
    final_loss: float


def _wrap(model: Llama, parallel: str, world: int):
    if parallel == "ddp":
        return DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _run_config(name: str, args: argparse.Namespace, rank: int, world: int) -> BenchResult:
    parallel, optimizer = name.split("-", 1)
    config = get_config(args.preset)
    model = Llama(config, seed=args.seed)
    wrapped = _wrap(model, parallel, world)
    optimizers = OPTIMIZERS[optimizer](model, args.lr, args.weight_decay)
    data = SyntheticTokens(config.vocab_size, seed=args.seed)
    opt_times, step_times, losses, sent = [], [], [], []
    for step in range(args.warmup + args.steps):
        inputs, targets = data.local_batch(step, args.batch_size * world, args.seq_len, rank, world)
        start = time.perf_counter()
        logits = wrapped(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        opt_start = time.perf_counter()
        for opt in optimizers:
            opt.step()
        end = time.perf_counter()
        if step >= args.warmup:
            opt_times.append(end - opt_start)
            step_times.append(end - start)
            losses.append(loss.item())
            stats = getattr(optimizers[0], "last_step_stats", None)
            sent.append(stats.bytes_sent if stats is not None else None)
    slowest = torch.tensor([statistics.median(opt_times), statistics.median(step_times)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    averaged = torch.tensor([statistics.mean(losses[-3:]), sent[-1] or 0], dtype=torch.float64)
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    mean_sent = averaged[1].item() if sent[-1] is not None else None
    return BenchResult(name, world, slowest[0].item() * 1e3, slowest[1].item() * 1e3, mean_sent, averaged[0].item())


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name in args.configs:
            result = _run_config(name, args, rank, world)
            if rank == 0:
                print(f"  {name:<16} done: step {result.step_ms:8.1f} ms", file=sys.stderr, flush=True)
                queue.put(result)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def format_table(results: list[BenchResult]) -> str:
    """One row per configuration, with ratios against AdamW and vanilla Muon of the same parallelism."""
    by_name = {r.config: r for r in results}
    header = (f"{'config':<16} {'opt step ms':>11} {'step ms':>9} {'bytes/step':>11} {'loss':>7} "
              f"{'opt/vanilla':>11} {'step/adamw':>10}")
    lines = [header]
    for r in results:
        parallel = r.config.split("-", 1)[0]
        vanilla, adamw = by_name.get(f"{parallel}-torch-muon"), by_name.get(f"{parallel}-adamw")
        opt_ratio = f"{r.opt_step_ms / vanilla.opt_step_ms:.2f}" if vanilla else "-"
        step_ratio = f"{r.step_ms / adamw.step_ms:.2f}" if adamw else "-"
        sent = f"{r.bytes_per_step:,.0f}" if r.bytes_per_step is not None else "-"
        lines.append(f"{r.config:<16} {r.opt_step_ms:>11.1f} {r.step_ms:>9.1f} {sent:>11} {r.final_loss:>7.3f} "
                     f"{opt_ratio:>11} {step_ratio:>10}")
    for parallel in ("ddp", "fsdp"):
        names = [f"{parallel}-adamw", f"{parallel}-torch-muon", f"{parallel}-dmuon"]
        if all(n in by_name for n in names):
            base, vanilla, ours = (by_name[n].step_ms for n in names)
            if vanilla > base:
                lines.append(f"{parallel}: dmuon's step-time overhead over AdamW is "
                             f"{(ours - base) / (vanilla - base):.2f} of vanilla Muon's")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench")
    parser.add_argument("--steps", type=int, default=4, help="measured steps per configuration")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS),
                        help=f"comma-separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--json", metavar="PATH", help="write one record per configuration")


def run(args: argparse.Namespace) -> int:
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; choose from {CONFIGS}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    print(f"dmuon bench: {args.preset} preset, {args.world_size} gloo ranks x {args.threads} thread(s)",
          file=sys.stderr, flush=True)
    mp.start_processes(_worker, args=(args.world_size, port, args, queue), nprocs=args.world_size,
                       join=True, start_method="spawn")
    results = [queue.get() for _ in args.configs]
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0
