"""Newton–Schulz throughput and per-rank optimizer cost on one device (the GPU part of
``dmuon bench``; it runs on CPU too, which is how it is tested).

* :func:`matmul_peak` — the measured dense matrix-product rate, the yardstick;
* :func:`ns_throughput` — effective FLOP/s of batched Newton–Schulz per method and shape
  (FLOPs counted by :func:`dmuon.orthogonalization.newton_schulz_flops`);
* :func:`rank_share` — the time one rank needs for its share of a named model's matrices at
  N ranks according to dmuon's plan (FSDP2 layout), against its FLOP lower bound and against
  ``torch.optim.AdamW`` (fused) on the same rank's shard of the parameters;
* :func:`symmetric_products_timing` — Gram NS with torch's products against the Triton
  one-triangle kernel, per matrix size (where Triton runs).

The timing itself (:func:`dmuon.timing.best_seconds`, :func:`dmuon.timing.symmetric_products_seconds`)
is the product's, which ``symmetric_products="auto"`` uses at construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dmuon.layout import Layout
from dmuon.orthogonalization import newton_schulz_flops, orthogonalize, resolve_config
from dmuon.planner import Unit, make_plan
from dmuon.timing import best_seconds, symmetric_products_seconds
from dmuon.tools.models import get_config, matrix_shapes, param_count
from dmuon.triton_kernels import triton_usable


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int = 4096, repeats: int = 5) -> float:
    """Measured FLOP/s of a size×size×size product in ``dtype`` on ``device``."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return 2 * size**3 / best_seconds(lambda: a @ b, device, repeats)


@dataclass(frozen=True)
class NSThroughput:
    shape: tuple[int, int]
    batch: int
    method: str
    dtype: str
    ms: float
    tflops: float  # effective, from the FLOP count of the method that ran
    fraction_of_peak: float


def ns_throughput(
    device: torch.device,
    shapes: Sequence[tuple[int, int]],
    batch: int,
    methods: Sequence[str] = ("standard", "gram"),
    dtype: torch.dtype | None = None,
    peak: float | None = None,
    repeats: int = 3,
) -> list[NSThroughput]:
    """Effective throughput of ``batch`` stacked m×n matrices per method (default dtype: dmuon's)."""
    rows = []
    for m, n in shapes:
        G = torch.randn(batch, m, n, device=device)
        for method in methods:
            config = resolve_config((m, n), device.type, method=method, dtype=dtype)
            seconds = best_seconds(lambda: orthogonalize(G, config), device, repeats)
            flops = batch * newton_schulz_flops(m, n, steps=config.steps, method=config.method,
                                                restarts=config.restarts)
            rate = peak or matmul_peak(device, config.dtype)
            rows.append(NSThroughput((m, n), batch, method, str(config.dtype).removeprefix("torch."),
                                     seconds * 1e3, flops / seconds / 1e12, flops / seconds / rate))
    return rows


@dataclass(frozen=True)
class RankShare:
    model: str
    world_size: int
    matrices: int
    ms: float
    lower_bound_ms: float  # the rank's NS FLOPs at the measured matrix-product peak
    adamw_ms: float  # torch.optim.AdamW (fused where the device has it) on the rank's 1/N of every parameter


def rank_share(model: str, world_size: int, device: torch.device, peak: float | None = None,
               layers: int | None = None, repeats: int = 3) -> RankShare:
    """Time the Newton–Schulz work that dmuon's plan gives the busiest rank (FSDP2 layout)."""
    config = get_config(model, **({"n_layers": layers} if layers else {}))
    shapes = matrix_shapes(config)
    ranks = tuple(range(world_size))
    configs = [resolve_config((m, n), device.type) for _, m, n in shapes]
    units = [
        Unit(name, Layout((m, n), 1, world_size, ranks), 1, m, n, 4,
             newton_schulz_flops(m, n, steps=c.steps, method=c.method, restarts=c.restarts))
        for (name, m, n), c in zip(shapes, configs)
    ]
    plan = make_plan(units, world_size)
    busiest = max(range(world_size), key=plan.flops)
    batches: dict[tuple, int] = {}
    for u, owner in enumerate(plan.owners):
        if owner == busiest:
            key = (units[u].m, units[u].n, configs[u])
            batches[key] = batches.get(key, 0) + 1
    inputs = {key: torch.randn(count, key[0], key[1], device=device) for key, count in batches.items()}

    def run_share() -> None:
        for (_, _, config), G in inputs.items():
            orthogonalize(G, config)

    seconds = best_seconds(run_share, device, repeats)
    rate = peak or matmul_peak(device, configs[0].dtype)
    shard = -(-param_count(config) // world_size)
    return RankShare(model, world_size, plan.matrices(busiest), seconds * 1e3, plan.flops(busiest) / rate * 1e3,
                     adamw_seconds(shard, device, repeats) * 1e3)


def adamw_seconds(params: int, device: torch.device, repeats: int = 3) -> float:
    """One ``torch.optim.AdamW`` step (fused on CUDA) on ``params`` fp32 parameters."""
    weight = torch.nn.Parameter(torch.zeros(params, device=device))
    weight.grad = torch.randn(params, device=device)
    optimizer = torch.optim.AdamW([weight], lr=1e-3, fused=device.type == "cuda")
    return best_seconds(optimizer.step, device, repeats)


@dataclass(frozen=True)
class SymmetricTiming:
    shape: tuple[int, int]
    batch: int
    torch_ms: float
    triton_ms: float


def symmetric_products_timing(device: torch.device, sides: Sequence[int] = (512, 1024, 2048, 4096, 8192),
                              aspect: int = 4, batch: int = 2, repeats: int = 3) -> list[SymmetricTiming]:
    """Gram NS (fp16 on CUDA) of ``batch`` stacked side×(aspect·side) matrices with the symmetric
    products from ``torch.bmm``/``baddbmm`` and from the Triton one-triangle kernel: the data for
    choosing ``symmetric_products`` by shape. Empty where Triton cannot run."""
    if not triton_usable(device):
        return []
    rows = []
    for side in sides:
        config = resolve_config((side, aspect * side), device.type, method="gram")
        seconds = symmetric_products_seconds(config, (batch, side, aspect * side), device, repeats)
        rows.append(SymmetricTiming((side, aspect * side), batch, seconds["torch"] * 1e3, seconds["triton"] * 1e3))
    return rows


def gpu_report(device: torch.device, models: Sequence[str] = ("llama-3.1-8b", "llama-3.1-70b"),
               world_sizes: Sequence[int] = (8, 64), batch: int = 4) -> str:
    """The extra tables ``dmuon bench --device cuda`` prints: NS throughput on the distinct
    matrix shapes of ``models`` (``batch`` stacked) and the first model's per-rank share."""
    lines = []
    for dtype in (torch.float16, torch.bfloat16):
        lines.append(f"matrix-product peak {str(dtype).removeprefix('torch.')}: "
                     f"{matmul_peak(device, dtype) / 1e12:.1f} TFLOP/s (measured)")
    shapes = sorted({(m, n) for model in models for _, m, n in matrix_shapes(get_config(model, n_layers=1))})
    lines.append(f"{'shape':>12} {'batch':>5} {'method':>8} {'dtype':>8} {'ms':>9} {'TFLOP/s':>8} {'of peak':>7}")
    for row in ns_throughput(device, shapes, batch):
        lines.append(f"{'x'.join(map(str, row.shape)):>12} {row.batch:>5} {row.method:>8} {row.dtype:>8} "
                     f"{row.ms:>9.2f} {row.tflops:>8.1f} {row.fraction_of_peak:>7.0%}")
    for world_size in world_sizes:
        share = rank_share(models[0], world_size, device)
        lines.append(f"{share.model} at {world_size} ranks: busiest rank orthogonalizes {share.matrices} matrices "
                     f"in {share.ms:.1f} ms (FLOP lower bound {share.lower_bound_ms:.1f} ms, "
                     f"{share.ms / share.lower_bound_ms:.2f}x); AdamW on the rank's 1/{world_size} of the "
                     f"parameters {share.adamw_ms:.1f} ms ({share.ms / share.adamw_ms:.1f}x)")
    timings = symmetric_products_timing(device)
    if not timings:
        lines.append("symmetric products: Triton cannot run here (not installed, or no CUDA device)")
    for t in timings:
        lines.append(f"Gram NS fp16 {t.batch}x{t.shape[0]}x{t.shape[1]}: symmetric products torch {t.torch_ms:.2f} ms, "
                     f"triton {t.triton_ms:.2f} ms ({t.torch_ms / t.triton_ms:.2f}x)")
    return "\n".join(lines)
