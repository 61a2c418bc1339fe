"""Runs a step plan's strategies: the engine only dispatches.

What a step does — which strategy orthogonalizes which works, with which owners and buckets — is
decided once, in :mod:`dmuon.step.plan`. A step hands the engine those strategies and the step's
values (:class:`~dmuon.strategies.base.StepIO`); every rank runs every strategy in the plan's
order (:class:`~dmuon.strategies.base.Strategy`), with the engine's :class:`Context` (the
Newton–Schulz function, the wire dtype, this step's counters).

The run is staged (:meth:`Engine.stages`): a strategy that runs bucket by bucket (the planned
exchange) stops before it first reads each bucket's inputs. It has two drivers: :meth:`Engine.run`
takes every stage at ``step()``; early start (:mod:`dmuon.step.early`) takes each stage
from a gradient hook once the bucket's gradients are final, during the backward pass, and the
rest at ``step()``. Either way every rank issues the same calls in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor

from dmuon.orthogonalization import NSConfig, orthogonalize
from dmuon.strategies.base import Context, StepIO, StepStats, Strategy

__all__ = ["Bucket", "Engine", "StepStats"]

# a stage of a step plan's run: (its strategy's position in the plan, the bucket's in the strategy)
Bucket = tuple[int, int]


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

    def stages(self, strategies: Sequence[Strategy], io: StepIO) -> Iterator[Bucket]:
        """The plan's run, in stages: it yields ``(s, k)`` before strategy ``s`` first reads the
        inputs of its bucket ``k``; a strategy without stages runs whole, yielding nothing."""
        for s, strategy in enumerate(strategies):
            staged = getattr(strategy, "stages", None)
            if staged is None:
                strategy.run(io, self.context)
                continue
            for k in staged(io, self.context):
                yield s, k

    def run(self, strategies: Sequence[Strategy], io: StepIO) -> None:
        """Orthogonalize every work of the step plan; the updates go to ``io.apply``."""
        for _ in self.stages(strategies, io):
            pass
        io.overlap()  # if no strategy had a wait to fill
        self.count_traffic()

    def count_traffic(self) -> None:
        """The step's bytes sent and collectives into its statistics, once its run is done."""
        self.stats.bytes_sent = self.counter.bytes_sent
        self.stats.collectives = self.counter.collectives
