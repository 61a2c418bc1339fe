"""Early start in one process: a training step with Newton–Schulz begun in the backward pass
against the same step without it, and AdamW's, side by side.

    python benchmarks/early_start.py [--device cuda] [--preset bench] [--layers N] [--batch-size 8]
        [--seq-len 256] [--rounds 10] [--json PATH]
    python benchmarks/early_start.py --ddp-only [--ddp-bucket-mb 25] [--device cuda] [--preset ...]

The model of ``dmuon bench`` (``--preset``) trains with AdamW, ``dmuon.Muon(early_start=False)``
and ``dmuon.Muon()`` (early start on where supported: one process is), each from the same
weights on the same batches; the configurations take turns step by step (the order rotated
every round) so that a change of load hits them alike. Printed: the median full-step time
(forward, backward, optimizer; on CUDA the step ends with a synchronization), each one's ratio
to AdamW's as the median of per-round ratios, and whether the two Muon runs' parameters are
bitwise equal after the last step. The two plans cut their buckets in different orders (early
start follows the backward pass), so where a batched product's bits depend on how many matrices
it stacks (cuBLAS) they may differ; a second check therefore runs early start's own plan with
the hooks firing and with every bucket run at step() (gradients assigned, not accumulated, so no
hook fires) and compares those bitwise: early start must change when the work runs, not its
result. On CUDA the early work runs on a stream of its own, beside the backward pass.

``--ddp-only`` runs that second check alone under DDP (one rank: NCCL on CUDA, gloo on CPU) with
dmuon's comm hook, where DDP's all-reduce of each bucket is what starts early start's buckets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.tools.models import Llama, SyntheticTokens, get_config

CONFIGS = ("adamw", "muon-at-step", "muon-early")


def build(name: str, config, device: torch.device,
          early_start: bool | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``name``'s model and optimizer; ``early_start``: muon-early's option (None: the default)."""
    model = Llama(config, seed=0).to(device)
    if name == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    early_start = early_start if name == "muon-early" else False
    return model, dmuon.Muon(model, lr=3e-4, weight_decay=0.1, early_start=early_start)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch, device: torch.device) -> float:
    tokens, targets = (t.to(device) for t in batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model.loss(tokens, targets).backward()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def same_plan_bits(config, device: torch.device, data: SyntheticTokens, batch_size: int, seq_len: int,
                   steps: int = 3, ddp: bool = False, ddp_bucket_mb: float = 25.0) -> bool:
    """Early start's plan with the buckets begun in the backward pass, and with all of them run at
    step(): bitwise equal parameters after ``steps`` steps? ``ddp``: both models under DDP (one
    rank, buckets of ``ddp_bucket_mb``) with dmuon's comm hook; the first runs its forward through
    DDP, so that DDP's reduction and the comm hook start the buckets, the second goes around DDP."""
    models = []
    for hooks in (True, False):
        model, opt = build("muon-early", config, device, early_start=True)  # on CPU too, where it is off by default
        wrapped = model
        if ddp:
            wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                              bucket_cap_mb=ddp_bucket_mb)
            opt.register_ddp_comm_hook(wrapped)
        for step in range(steps):
            tokens, targets = (t.to(device) for t in data.batch(step, batch_size, seq_len))
            opt.zero_grad(set_to_none=True)
            forward = wrapped if hooks else model
            loss = F.cross_entropy(forward(tokens).flatten(0, 1).float(), targets.flatten())
            if hooks:
                loss.backward()
            else:  # no accumulation into .grad: no post-accumulate-grad hook fires
                params = [p for p in model.parameters() if p.requires_grad]
                for p, g in zip(params, torch.autograd.grad(loss, params)):
                    p.grad = g
            opt.step()
        begun = opt.last_step_stats.early_buckets[0]
        assert (begun > 0) == hooks, f"buckets begun in the backward pass: {begun} (hooks {hooks})"
        models.append(model)
    return all(torch.equal(a, b) for a, b in zip(models[0].parameters(), models[1].parameters()))


def ddp_bits(args: argparse.Namespace, device: torch.device) -> bool:
    """Early start under DDP, on one rank: :func:`same_plan_bits` with DDP and dmuon's comm hook."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        config = get_config(args.preset, **({"n_layers": args.layers} if args.layers else {}))
        data = SyntheticTokens(config.vocab_size, seed=0)
        same = same_plan_bits(config, device, data, args.batch_size, args.seq_len, ddp=True,
                              ddp_bucket_mb=args.ddp_bucket_mb)
    finally:
        dist.destroy_process_group()
    print(f"early start under DDP (one rank, dmuon's comm hook), {args.preset} preset, {args.device}: buckets "
          f"begun in the backward pass vs all run at step(): {'bitwise equal' if same else 'DIFFER'}")
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--layers", type=int, default=None, help="the preset's layers, fewer (default: all)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--ddp-only", action="store_true",
                        help="only the bits under DDP (one rank, dmuon's comm hook): early start's plan with the "
                             "buckets begun in the backward pass vs all run at step(); exit 1 if they differ")
    parser.add_argument("--ddp-bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (default: 25)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if args.ddp_only:
        sys.exit(0 if ddp_bits(args, device) else 1)
    config = get_config(args.preset, **({"n_layers": args.layers} if args.layers else {}))
    data = SyntheticTokens(config.vocab_size, seed=0)
    runs = {name: build(name, config, device) for name in CONFIGS}
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for step in range(args.warmup + args.rounds):
        batch = data.batch(step, args.batch_size, args.seq_len)
        order = CONFIGS[step % 3:] + CONFIGS[:step % 3]
        for name in order:
            seconds = train_step(*runs[name], batch, device)
            if step >= args.warmup:
                times[name].append(seconds)
    early = runs["muon-early"][1]
    same = all(torch.equal(a, b) for a, b in zip(runs["muon-at-step"][0].parameters(),
                                                  runs["muon-early"][0].parameters()))
    tokens = args.batch_size * args.seq_len
    params = sum(p.numel() for p in runs["adamw"][0].parameters())
    print(f"early start, one process: {args.preset} preset, {config.n_layers} layers ({params / 1e6:.1f}M "
          f"parameters), {tokens} tokens per step, {args.device}; {args.rounds} rounds after {args.warmup} "
          "warm-up steps")
    print(f"early start: {early.early_start}; buckets begun in the backward pass at the last step: "
          f"{early.last_step_stats.early_buckets[0]} of {early.last_step_stats.early_buckets[1]}")
    result = {"device": args.device, "preset": args.preset, "tokens_per_step": tokens, "parameters": params,
              "bitwise_equal": same, "early_start": early.early_start}
    for name in CONFIGS:
        ratios = [t / a for t, a in zip(times[name], times["adamw"])]
        median_ms = statistics.median(times[name]) * 1e3
        ratio = statistics.median(ratios)
        result[name] = {"median_ms": median_ms, "ratio_to_adamw": ratio, "ratio_range": [min(ratios), max(ratios)]}
        print(f"  {name:13s} step {median_ms:9.2f} ms   {ratio:5.3f}x AdamW ({min(ratios):.3f}-{max(ratios):.3f})"
              f"   overhead {100 * (ratio - 1):+6.1f} %")
    print(f"muon-early vs muon-at-step parameters after {args.warmup + args.rounds} steps: "
          f"{'bitwise equal' if same else 'DIFFER'}")
    result["same_plan_bitwise_equal"] = same_plan_bits(config, device, data, args.batch_size, args.seq_len)
    print("early start's plan, buckets begun in the backward pass vs all run at step(): "
          f"{'bitwise equal' if result['same_plan_bitwise_equal'] else 'DIFFER'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
