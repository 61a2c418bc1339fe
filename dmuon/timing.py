"""Timing on one device, for the choices the optimizer makes by measuring:
``dmuon.Muon(symmetric_products="auto")`` times Newton–Schulz of each matrix shape with each
symmetric-product kernel at construction (:func:`symmetric_products_seconds`).

Part of the product, so that constructing or stepping the optimizer never loads a tool module;
the bench's throughput tables (``dmuon.tools.throughput``) use the same functions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from dmuon.orthogonalization import SYMMETRIC_PRODUCTS, NSConfig, orthogonalize


def best_seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Best-of-``repeats`` seconds of ``fn`` after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def symmetric_products_seconds(config: NSConfig, shape: tuple[int, ...], device: torch.device,
                               repeats: int = 3) -> dict[str, float]:
    """Seconds of :func:`orthogonalize` on a random stack of ``shape`` with each symmetric-product
    kernel (``config.symmetric`` ignored); Triton must be usable on ``device``. Its own random
    generator: measuring leaves the caller's random stream as it was."""
    G = torch.randn(shape, device=device, generator=torch.Generator(device).manual_seed(0))
    configs = {symmetric: replace(config, symmetric=symmetric) for symmetric in SYMMETRIC_PRODUCTS}
    return {symmetric: best_seconds(partial(orthogonalize, G, c), device, repeats) for symmetric, c in configs.items()}
