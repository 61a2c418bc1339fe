"""How far training drifts between layouts whose single steps are bitwise equal.

    python benchmarks/layout_drift.py [--preset demo] [--steps 200] [--world-size 2] [--muon-lr-multiple 2]
                                      [--json PATH]

Given identical gradients, a dmuon step is bitwise the same in one process and under FSDP2. In
training the gradients are not identical: FSDP2 sums each rank's half of the batch (a
reduce-scatter), one process the whole batch, so they differ in their last bits, and every later
step starts from slightly different weights. This script trains the same model from the same
weights on the same batches (the standard library's source, byte by byte) in one process and
under FSDP2 on ``--world-size`` gloo ranks, with AdamW, with dmuon.Muon with a bf16
Newton–Schulz (its default on GPUs and on CPUs with native bf16 products; emulated, hence slow,
on other CPUs) and with dmuon.Muon with an fp32 Newton–Schulz, and prints, per optimizer, how far
the two layouts' losses are apart after 3, 30 and ``--steps`` steps, and the largest gap over the
run. AdamW's lr is ``--lr``, the Muons' ``--muon-lr-multiple`` times it.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from gloo_ranks import on_gloo_ranks

import dmuon
from dmuon.tools.corpus import VOCAB_SIZE, load_corpus, train_batch
from dmuon.tools.models import Llama, get_config

OPTIMIZERS = {"adamw": None, "dmuon-bf16": torch.bfloat16, "dmuon-fp32": torch.float32}  # name: NS dtype


def make_optimizer(name: str, model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    return dmuon.Muon(model, lr=args.muon_lr_multiple * args.lr, weight_decay=0.1, ns_dtype=OPTIMIZERS[name])


def train(args: argparse.Namespace, name: str, rank: int, world: int) -> list[float]:
    """The losses of one run (the global batch's mean at every step); FSDP2 when ``world`` > 1."""
    torch.set_num_threads(1)
    model = Llama(get_config(args.preset, vocab_size=VOCAB_SIZE), seed=0)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = make_optimizer(name, model, args)
    text = load_corpus().train
    losses = []
    for step in range(args.steps):
        inputs, targets = train_batch(text, step, args.batch_size, args.seq_len, seed=0)
        share = slice(rank * args.batch_size // world, (rank + 1) * args.batch_size // world)
        loss = model.loss(inputs[share], targets[share])
        opt.zero_grad()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def every_optimizer(rank: int, world: int, results: dict, args: argparse.Namespace) -> None:
    for name in OPTIMIZERS:
        losses = train(args, name, rank, world)
        if rank == 0:
            results[name] = losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--muon-lr-multiple", type=float, default=2.0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.batch_size % args.world_size:
        parser.error("--batch-size must be a multiple of --world-size")
    alone = {name: train(args, name, 0, 1) for name in OPTIMIZERS}
    sharded = on_gloo_ranks(args.world_size, every_optimizer, args)
    rows = {}
    marks = sorted({step for step in (3, 30, args.steps) if step <= args.steps})
    print(f"{args.preset} preset, {args.steps} steps, one process vs FSDP2 on {args.world_size} ranks: "
          "|loss gap| after each number of steps")
    print(f"{'optimizer':<11} {'final loss':>10} " + " ".join(f"{f'after {m}':>11}" for m in marks)
          + f" {'largest':>11}")
    for name in OPTIMIZERS:
        gaps = [abs(a - b) for a, b in zip(alone[name], sharded[name])]
        rows[name] = dict(final_loss=alone[name][-1], gaps={m: gaps[m - 1] for m in marks}, largest_gap=max(gaps))
        print(f"{name:<11} {alone[name][-1]:>10.4f} " + " ".join(f"{gaps[m - 1]:>11.2e}" for m in marks)
              + f" {max(gaps):>11.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=vars(args), results=rows), f, indent=1)


if __name__ == "__main__":
    main()
