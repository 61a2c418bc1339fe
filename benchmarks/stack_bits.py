"""How often a matrix's Newton–Schulz bits differ alone from in a stack, on this machine.

    python benchmarks/stack_bits.py [--dtype bfloat16] [--stack 7] [--seeds 20] [--threads 1]

For each shape, ``--seeds`` random stacks of ``--stack`` matrices: each matrix orthogonalized
in its stack and alone (a batch of one), compared bit for bit. Prints, per shape, how many
matrices differ and by how much at most. torch's CPU products run a batch of under 16³
multiply-adds on another kernel than a larger one; dmuon pads such batches
(``orthogonalization.ONEDNN_MIN_WORK``), so every row should read 0. docs/concepts.md
("Exactness") quotes a run.
"""

from __future__ import annotations

import argparse

import torch

from dmuon.orthogonalization import orthogonalize, resolve_config

SHAPES = [(40, 16), (16, 40), (16, 16), (12, 30), (8, 64), (64, 8), (9, 130), (48, 48), (64, 256), (256, 512),
          (512, 512)]


def differing(shape: tuple[int, int], dtype: torch.dtype, stack: int, seeds: int) -> tuple[int, int, float]:
    """(matrices that differ, matrices compared, largest |difference|) for ``shape``."""
    config = resolve_config(shape, "cpu", dtype=dtype, method="standard")
    count, total, worst = 0, 0, 0.0
    for seed in range(seeds):
        generator = torch.Generator().manual_seed(seed)
        matrices = torch.randn(stack, *shape, generator=generator, dtype=torch.float64).float()
        stacked = orthogonalize(matrices, config)
        for matrix, in_stack in zip(matrices, stacked):
            alone = orthogonalize(matrix, config)
            total += 1
            if not torch.equal(alone, in_stack):
                count += 1
                worst = max(worst, (alone - in_stack).abs().max().item())
    return count, total, worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--stack", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"Newton–Schulz in {args.dtype}, stacks of {args.stack}, {args.seeds} seeds, {args.threads} thread(s)")
    for shape in SHAPES:
        count, total, worst = differing(shape, dtype, args.stack, args.seeds)
        print(f"{f'{shape[0]}x{shape[1]}':<9} {count:>4} of {total:<5} differ alone (max |diff| {worst:.2e})")


if __name__ == "__main__":
    main()
