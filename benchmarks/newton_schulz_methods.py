"""Time standard vs Gram Newton–Schulz on this machine, side by side in one run.

    python benchmarks/newton_schulz_methods.py [--threads 1] [--repeats 5]

Prints, per shape, the best-of-N time of each method/dtype and the Gram/standard ratios; the
aspect-ratio sweep at m = 512 is what `GRAM_MIN_ASPECT` in dmuon/orthogonalization.py rests on.
Then, per shape, the FLOP rate of standard Newton–Schulz in bf16 beside that of one plain GEMM
of its largest product (m×n by n×m) in the same dtype: how close Newton–Schulz runs to what this
core's products can do.
"""

from __future__ import annotations

import argparse

import torch

from dmuon.orthogonalization import newton_schulz, newton_schulz_flops
from dmuon.timing import best_seconds

CPU = torch.device("cpu")

SHAPES = [(512, 512), (512, 768), (512, 1024), (512, 1536), (512, 2048), (512, 4096), (1024, 1024)]
VARIANTS = [("standard", torch.bfloat16), ("standard", torch.float32), ("gram", torch.float32)]


def best_time(G: torch.Tensor, method: str, dtype: torch.dtype, repeats: int) -> float:
    return best_seconds(lambda: newton_schulz(G, method=method, dtype=dtype), CPU, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = [f"{method} {str(dtype).removeprefix('torch.')}" for method, dtype in VARIANTS]
    print(f"{'shape':<10} {'aspect':>6}  " + "  ".join(f"{name + ' ms':>18}" for name in names)
          + "  gram/standard(fp32)  gram(fp32)/standard(bf16)")
    for m, n in SHAPES:
        G = torch.randn(m, n, generator=torch.Generator().manual_seed(0))
        t = [best_time(G, method, dtype, args.repeats) for method, dtype in VARIANTS]
        cells = "  ".join(f"{x * 1e3:>18.1f}" for x in t)
        print(f"{f'{m}x{n}':<10} {n / m:>6.1f}  {cells}  {t[2] / t[1]:>19.2f}  {t[2] / t[0]:>25.2f}")
    print(f"\n{'shape':<10} {'NS bf16 GFLOP/s':>16} {'GEMM bf16 GFLOP/s':>18} {'NS / GEMM':>10}")
    for m, n in SHAPES:
        G = torch.randn(m, n, generator=torch.Generator().manual_seed(0))
        ns_rate = newton_schulz_flops(m, n, steps=5, method="standard") / best_time(G, "standard", torch.bfloat16,
                                                                                   args.repeats)
        a, b = G.bfloat16(), G.T.contiguous().bfloat16()
        gemm_rate = 2 * m * n * m / best_seconds(lambda: a @ b, CPU, args.repeats)
        print(f"{f'{m}x{n}':<10} {ns_rate / 1e9:>16.0f} {gemm_rate / 1e9:>18.0f} {ns_rate / gemm_rate:>10.2f}")


if __name__ == "__main__":
    main()
