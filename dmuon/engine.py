"""Runs a step plan: the strategies that orthogonalize every Muon matrix once in the job.

A :class:`PreparedStep` is made once per step plan (:meth:`Orthogonalizer.prepare`): the works
are split by strategy — gangs first (:mod:`dmuon.strategies.gangs`), then the planned owner
exchange of each exchange group (:mod:`dmuon.strategies.planned`), the gathered fallback
(:mod:`dmuon.strategies.gathered`) and distributed Newton–Schulz on column blocks
(:mod:`dmuon.strategies.column_blocks`) — each with its plan worked out. A step then only
dispatches: every strategy runs in that order, on every rank, with the step's values
(:class:`~dmuon.strategies.base.StepIO`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dmuon.orthogonalization import NSConfig, orthogonalize
from dmuon.planner import DEFAULT_BUCKET_BYTES, DEFAULT_FLOPS_PER_BYTE, Plan, make_plan
from dmuon.strategies.base import Block, Context, MatrixWork, StepIO, StepStats, unit_of
from dmuon.strategies.column_blocks import ColumnBlocks
from dmuon.strategies.gangs import Gangs
from dmuon.strategies.gathered import GatheredFallback
from dmuon.strategies.planned import PlannedExchange

__all__ = ["Block", "MatrixWork", "Orthogonalizer", "PreparedStep", "StepIO", "StepStats", "unit_of"]


@dataclass(frozen=True)
class PreparedStep:
    """The strategies of one step plan, in the order every rank runs them."""

    strategies: tuple
    plans: tuple[Plan, ...]


class Orthogonalizer:
    """Orthogonalizes the works of a step plan across ranks; one per optimizer."""

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        comm_dtype: torch.dtype | None = None,
        flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE,
        orthogonalize_fn: Callable[[Tensor, NSConfig], Tensor] = orthogonalize,
        ready_order: bool = False,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.ready_order = ready_order  # buckets in the backward pass's order (early start)
        self.flops_per_byte = flops_per_byte
        self.context = Context(orthogonalize_fn, comm_dtype)

    def wire_dtype(self, work: MatrixWork) -> torch.dtype:
        return self.context.wire_dtype(work)

    def wire_itemsize(self, work: MatrixWork) -> int:
        return torch.empty(0, dtype=self.wire_dtype(work)).element_size()

    def group_indices(self, works: Sequence[MatrixWork]) -> list[list[int]]:
        """Work indices per exchange group and wire dtype (a bucket never mixes dtypes), larger
        groups first, then by ranks: the same order on every rank, so no rank waits in one group
        while its peer waits in another."""
        groups: dict[tuple, list[int]] = {}
        for i, work in enumerate(works):
            key = (-work.layout.size, work.layout.group_ranks, work.layout.replicas, str(self.wire_dtype(work)))
            groups.setdefault(key, []).append(i)
        return [groups[key] for key in sorted(groups)]

    def plans_for(self, works: Sequence[MatrixWork]) -> list[Plan]:
        """The plan of each exchange group (gathered layouts have none)."""
        planned = [w for w in works if self._planned(w)]
        return [self.plan_for([planned[i] for i in members]) for members in self.group_indices(planned)]

    @staticmethod
    def _planned(work: MatrixWork) -> bool:
        return not (work.layout.gathered or work.column_blocks or work.gang)

    def plan_for(self, works: Sequence[MatrixWork]) -> Plan:
        """The plan of one exchange group's works."""
        units = [unit_of(w, self.wire_itemsize(w)) for w in works]
        layout = works[0].layout
        return make_plan(units, layout.size, layout.replicas, bucket_bytes=self.bucket_bytes,
                         flops_per_byte=self.flops_per_byte, ready_order=self.ready_order)

    def prepare(self, works: Sequence[MatrixWork], device: torch.device) -> PreparedStep:
        """The strategies for ``works`` (indices into it are what a step's StepIO answers to)."""
        strategies: list = []
        plans: list[Plan] = []

        def subset(keep: Callable[[MatrixWork], bool]) -> list[int]:
            return [i for i, w in enumerate(works) if keep(w)]

        split = subset(lambda w: bool(w.gang))
        for members in self.group_indices([works[i] for i in split]):
            indices = [split[i] for i in members]
            strategies.append(Gangs(indices, [works[i] for i in indices], device))
        planned = subset(self._planned)
        for members in self.group_indices([works[i] for i in planned]):
            indices = [planned[i] for i in members]
            plan = self.plan_for([works[i] for i in indices])
            plans.append(plan)
            strategies.append(PlannedExchange(indices, [works[i] for i in indices], plan, device))
        gathered = subset(lambda w: w.layout.gathered and not w.column_blocks)
        if gathered:
            chosen = [works[i] for i in gathered]
            strategies.append(GatheredFallback(gathered, chosen, [unit_of(w, self.wire_itemsize(w)) for w in chosen]))
        columns = subset(lambda w: w.column_blocks)
        if columns:
            strategies.append(ColumnBlocks(columns, [works[i] for i in columns]))
        return PreparedStep(tuple(strategies), tuple(plans))

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

    def run(self, step: PreparedStep, io: StepIO) -> None:
        """Orthogonalize every work of the step plan; the updates go to ``io.apply``."""
        for strategy in step.strategies:
            strategy.run(io, self.context)
        io.overlap()  # if no strategy had a wait to fill
        self.stats.bytes_sent = self.counter.bytes_sent
        self.stats.collectives = self.counter.collectives
