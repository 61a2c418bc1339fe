"""``Muon.statistics()``: the last step in numbers, this rank's or the job's."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dmuon.exchange import all_reduce_max, all_reduce_sum
from dmuon.strategies.base import StepStats


def step_statistics(stats: StepStats, squares: dict[int, list], param_groups: Sequence[dict[str, Any]],
                    label: Callable[[dict[str, Any]], str], skipped_steps: int,
                    process_group: dist.ProcessGroup | None, device: torch.device) -> dict[str, float]:
    """Flat float figures of the last step (see ``Muon.statistics``); with a ``process_group``
    (collective) the job's: sums of the counts and update squares, the slowest rank's seconds.
    ``squares``: the update's [sum of squares, elements] by ``id`` of the param group."""
    muon_groups = [g for g in param_groups if "muon" in g["algorithms"]]
    labels = [label(g) for g in muon_groups]
    mine = [squares.get(id(g), [torch.zeros(()), 0]) for g in muon_groups]
    sums = torch.tensor([float(sq) for sq, _ in mine] + [n for _, n in mine], dtype=torch.float64)
    counts = torch.tensor([stats.matrices_orthogonalized, stats.ns_flops, stats.bytes_sent, stats.collectives],
                          dtype=torch.float64)
    seconds = torch.tensor([stats.ns_seconds], dtype=torch.float64)
    if process_group is not None:
        sums, counts, seconds = (t.to(device) for t in (sums, counts, seconds))
        all_reduce_sum(sums, process_group)
        all_reduce_sum(counts, process_group)
        all_reduce_max(seconds, process_group)
    out = {}
    for i, name in enumerate(labels):
        numel = sums[len(labels) + i].item()
        out[f"muon/update_rms/{name}"] = math.sqrt(sums[i].item() / numel) if numel else 0.0
    for g in param_groups:
        out[f"lr/{label(g)}"] = float(g["lr"])
    matrices, flops, sent, collectives = counts.tolist()
    out.update(ns_seconds=seconds.item(), ns_gflop=flops / 1e9, matrices=matrices, bytes_sent=sent,
               collectives=collectives, skipped_steps=float(skipped_steps))
    return out
