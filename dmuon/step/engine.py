"""Runs a step plan's strategies: the engine only dispatches.

What a step does — which strategy orthogonalizes which works, with which owners and buckets — is
decided once, in :mod:`dmuon.step.plan`. A step hands the engine those strategies and the step's
values (:class:`~dmuon.strategies.base.StepIO`); every rank runs every strategy in the plan's
order (:class:`~dmuon.strategies.base.Strategy`), with the engine's :class:`Context` (the
Newton–Schulz function, the wire dtype, this step's counters).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dmuon.orthogonalization import NSConfig, orthogonalize
from dmuon.strategies.base import Context, StepIO, StepStats, Strategy

__all__ = ["Engine", "StepStats"]


class Engine:
    """Runs strategies on every rank and keeps the last step's statistics; one per optimizer."""

    def __init__(self, comm_dtype: torch.dtype | None = None,
                 orthogonalize_fn: Callable[[Tensor, NSConfig], Tensor] = orthogonalize) -> None:
        self.context = Context(orthogonalize_fn, comm_dtype)

    @property
    def orthogonalize(self) -> Callable[[Tensor, NSConfig], Tensor]:
        """The Newton–Schulz function the strategies call (plain, compiled, or CUDA-graphed)."""
        return self.context.orthogonalize

    @property
    def counter(self):
        return self.context.counter

    @property
    def stats(self) -> StepStats:
        return self.context.stats

    def start_step(self) -> None:
        """Zero the step's statistics (the optimizer's own flag all-reduce counts too)."""
        self.context.counter.reset()
        self.context.stats = StepStats()

    def run(self, strategies: Sequence[Strategy], io: StepIO) -> None:
        """Orthogonalize every work of the step plan; the updates go to ``io.apply``."""
        for strategy in strategies:
            strategy.run(io, self.context)
        io.overlap()  # if no strategy had a wait to fill
        self.stats.bytes_sent = self.counter.bytes_sent
        self.stats.collectives = self.counter.collectives
