"""Host overhead of an optimizer step: many small matrices, side by side with AdamW and
torch.optim.Muon, at one process and at 2 gloo ranks (DDP and FSDP2).

    python benchmarks/host_overhead.py [--blocks 64] [--steps 20] [--world-size 2] [--json PATH]

The model is ``--blocks`` blocks of 7 small matrices (q 64×64, k and v 32×64, o 64×64, gate and
up 48×64, down 64×48) plus a norm gain each: 448 matrices by default, so Newton–Schulz itself is
a few milliseconds and the step time is mostly what the optimizer does per parameter on the
host. Only ``opt.step()`` is timed, on fixed gradients, one thread per process. The
configurations take turns (round-robin, the order rotated every round; each turn
``STEPS_PER_TURN`` steps, the first not counted), so load from other jobs lands on all of them
alike; each figure is a median over the counted steps.

Columns: ms per step (the slowest rank's), the ratio to AdamW (foreach) on the same parameters,
and for dmuon the step time outside its Newton–Schulz calls per matrix (``last_step_stats``),
the host work the step plan is meant to remove.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import dmuon

SHAPES = [(64, 64), (32, 64), (32, 64), (64, 64), (48, 64), (48, 64), (64, 48)]
# Steps a configuration takes each turn; the first of them is not counted: it runs on the caches
# the previous configuration left (torch.optim.Muon's step evicts everything), which would
# charge whoever follows it.
STEPS_PER_TURN = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.matrices = nn.ParameterList(nn.Parameter(torch.randn(s) / s[1] ** 0.5) for s in SHAPES)
        self.norm = nn.Parameter(torch.ones(64))

    def forward(self) -> None:  # never run: fully_shard wants modules with a forward
        raise NotImplementedError


class Model(nn.Module):
    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def forward(self) -> None:
        raise NotImplementedError


def make_model(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    return Model(blocks)


def optimizers(model: nn.Module) -> dict[str, Callable[[], torch.optim.Optimizer]]:
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    # named: unnamed FSDP2 shards of one shape could not be matched across ranks
    named_matrices = [(n, p) for n, p in model.named_parameters() if p.ndim == 2]
    named_rest = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]

    def dmuon_muon(**options) -> dmuon.Muon:
        groups = [{"params": named_matrices, "algorithm": "muon"}, {"params": named_rest, "algorithm": "adamw"}]
        return dmuon.Muon(groups, lr=1e-3, **options)

    return {
        "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True),
        "torch-muon": lambda: _Pair(torch.optim.Muon(matrices, lr=1e-3),
                                    torch.optim.AdamW(rest, lr=1e-3, foreach=True)),
        "dmuon": dmuon_muon,
        # fp32 Newton–Schulz: on a CPU without native bf16 products (AVX2 only) bf16 is emulated,
        # 10-18x slower than fp32, and would bury the host time this benchmark is about
        "dmuon-fp32": lambda: dmuon_muon(ns_dtype=torch.float32),
    }


class _Pair:
    """torch.optim.Muon takes only matrices: it runs beside an AdamW for the rest."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()


def set_grads(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=g)
        if isinstance(p, torch.distributed.tensor.DTensor):
            full = torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements)
        p.grad = full


def measure(blocks: int, steps: int, parallel: str, world: int) -> dict[str, dict[str, float]]:
    """Per configuration: median step seconds, and for dmuon the median non-NS seconds."""
    setups = {}
    # torch.optim.Muon on FSDP2's many small DTensors crashed a gloo rank here (glibc heap
    # corruption inside its step), so under FSDP2 dmuon is compared with AdamW alone.
    names = ("adamw", "dmuon", "dmuon-fp32") if parallel == "fsdp2" else ("adamw", "torch-muon", "dmuon", "dmuon-fp32")
    for name in names:
        model = make_model(blocks)
        if parallel == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        set_grads(model)
        setups[name] = optimizers(model)[name]()
    times: dict[str, list[float]] = {name: [] for name in setups}
    host: dict[str, list[float]] = {name: [] for name in setups if name.startswith("dmuon")}
    names = list(setups)
    for round_ in range(steps + 3):  # 3 warm-up rounds
        order = names[round_ % len(names):] + names[: round_ % len(names)]
        for name, repeat in ((n, r) for n in order for r in range(STEPS_PER_TURN)):
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
            setups[name].step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            stats = setups[name].last_step_stats if name in host else None
            outside_ns = torch.tensor([elapsed.item() - stats.ns_seconds if stats else 0.0], dtype=torch.float64)
            if world > 1:  # the slowest rank's
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                dist.all_reduce(outside_ns, op=dist.ReduceOp.MAX)
            if round_ >= 3 and repeat > 0:  # a turn's first step pays for the previous one's cache misses
                times[name].append(elapsed.item())
                if name in host:
                    host[name].append(outside_ns.item())
    out = {name: {"step_s": statistics.median(t)} for name, t in times.items()}
    for name, values in host.items():
        out[name]["outside_ns_s"] = statistics.median(values)
    return out


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, parallel: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = measure(args.blocks, args.steps, parallel, world)
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(args: argparse.Namespace, parallel: str) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, args, parallel, queue))
             for r in range(args.world_size)]
    for p in procs:
        p.start()
    result = queue.get(timeout=1800)
    for p in procs:
        p.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=64, help="blocks of 7 matrices (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=20, help="measured rounds (default: %(default)s)")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks of the DDP and FSDP2 runs (default: %(default)s)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    matrices = args.blocks * len(SHAPES)
    print(f"{matrices} matrices ({args.blocks} blocks), {args.steps} rounds, medians")
    print(f"{'layout':<12} {'optimizer':<11} {'step ms':>9} {'/ AdamW':>8} {'non-NS us/matrix':>17}", flush=True)
    results = {}
    layouts = ["none"] + (["ddp", "fsdp2"] if args.world_size > 1 else [])
    for parallel in layouts:
        layout = "one process" if parallel == "none" else f"{parallel} x{args.world_size}"
        figures = measure(args.blocks, args.steps, "none", 1) if parallel == "none" else run_ranks(args, parallel)
        results[layout] = figures
        adamw = figures["adamw"]["step_s"]
        for name, f in figures.items():
            per_matrix = f"{f['outside_ns_s'] / matrices * 1e6:17.1f}" if "outside_ns_s" in f else f"{'':>17}"
            print(f"{layout:<12} {name:<11} {f['step_s'] * 1e3:9.2f} {f['step_s'] / adamw:8.2f} {per_matrix}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"matrices": matrices, "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
