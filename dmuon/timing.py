"""Timing on one device, for the choices the optimizer makes by measuring:
``dmuon.Muon(symmetric_products="auto")`` times Newton–Schulz of each matrix shape with each
symmetric-product kernel at construction (:func:`choose_symmetric_products`).

Part of the product, so that constructing or stepping the optimizer never loads a tool module;
the bench's throughput tables (``dmuon.tools.throughput``) use the same functions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist

from dmuon.exchange import all_gather_object
from dmuon.hyperparameters import ns_config
from dmuon.orthogonalization import SYMMETRIC_PRODUCTS, NSConfig, orthogonalize
from dmuon.param_groups import MuonParam
from dmuon.routing import matrix_shape
from dmuon.triton_kernels import triton_usable


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


def choose_symmetric_products(entries: Sequence[MuonParam], device: torch.device,
                              process_group: dist.ProcessGroup | None) -> dict[tuple[int, int], str]:
    """``symmetric_products="auto"``: time Newton–Schulz of each matrix shape with torch's
    products and with the Triton kernel (where Triton runs), and keep the faster. Under
    torch.distributed the ranks add up their timings (gathered as bytes), so that every rank
    makes the same choice: distributed NS needs the same recurrence everywhere."""
    shapes: dict[tuple[int, int], NSConfig] = {}
    for m in entries:
        shape = matrix_shape(m.param.shape, m.view)[1:]
        shapes.setdefault(shape, ns_config(m.param_group, shape, device.type))
    seconds = {shape: symmetric_products_seconds(config, (1, *shape), device) for shape, config in shapes.items()} \
        if triton_usable(device) else {}
    if process_group is not None:
        everyone: list[dict] = all_gather_object(seconds, process_group, device)
        seconds = {shape: {kind: sum(rank.get(shape, {}).get(kind, math.inf) for rank in everyone)
                           for kind in SYMMETRIC_PRODUCTS} for shape in everyone[0]}
    return {shape: min(times, key=times.get) for shape, times in seconds.items()}
