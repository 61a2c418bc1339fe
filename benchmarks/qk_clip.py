"""What QK-clip costs: a training step with ``dmuon.QKClip.for_model`` (max logits recorded in
every forward, the clip after every step) against the same step without it, in one process.

    python benchmarks/qk_clip.py [--device cuda] [--preset bench] [--batch-size 8] [--seq-len 256]
        [--rounds 10] [--threshold 100]

Both runs start from the same weights and see the same batches; they take turns step by step
(which goes first alternates) so that a change of load hits both alike. Printed: the median
full step (forward, backward, optimizer, clip) of each, and the clipped run's time as the median
of per-round ratios to the plain run's, with its range. The recording adds one q·kᵀ product per
layer (``dmuon.max_logits``); the clip adds one max all-reduce (none in one process) and, for
heads over the threshold, one multiplication of their q and k rows.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from early_start import train_step  # beside this script: the same timed step

import dmuon
from dmuon.tools.models import Llama, SyntheticTokens, get_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threshold", type=float, default=100.0)
    args = parser.parse_args()
    device = torch.device(args.device)
    config = get_config(args.preset)
    data = SyntheticTokens(config.vocab_size, seed=0)
    runs = {}
    for name in ("muon", "muon+qk-clip"):
        model = Llama(config, seed=0).to(device)
        opt = dmuon.Muon(model, lr=3e-4, weight_decay=0.1)
        clip = dmuon.QKClip.for_model(opt, model, threshold=args.threshold) if name != "muon" else None
        runs[name] = (model, opt, clip)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.warmup + args.rounds):
        batch = data.batch(step, args.batch_size, args.seq_len)
        for name in (list(runs) if step % 2 else list(runs)[::-1]):
            seconds = train_step(*runs[name][:2], batch, device)
            if step >= args.warmup:
                times[name].append(seconds)
    ratios = [c / p for c, p in zip(times["muon+qk-clip"], times["muon"])]
    params = sum(p.numel() for p in runs["muon"][0].parameters())
    print(f"QK-clip cost, one process: {args.preset} preset ({params / 1e6:.1f}M parameters, {config.n_layers} "
          f"layers of {config.n_heads} heads), {args.batch_size * args.seq_len} tokens per step, {args.device}; "
          f"{args.rounds} rounds after {args.warmup} warm-up steps")
    for name, values in times.items():
        print(f"  {name:13s} step {statistics.median(values) * 1e3:9.1f} ms")
    last = runs["muon+qk-clip"][2].statistics()
    print(f"  with QK-clip: {statistics.median(ratios):.3f}x the step without it "
          f"({min(ratios):.3f}-{max(ratios):.3f}); "
          f"last step: max logit {last['qk_clip/max_logit']:.2f}, {last['qk_clip/heads_clipped']:.0f} heads clipped")


if __name__ == "__main__":
    main()
