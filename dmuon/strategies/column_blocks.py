"""Distributed Newton–Schulz: the ranks holding a matrix's column blocks orthogonalize it
together (:func:`dmuon.column_block_ns.orthogonalize_column_blocks`); nothing is gathered,
and every rank of the group runs the small-side recurrence on all-reduced Gram matrices."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

from dmuon.column_block_ns import orthogonalize_column_blocks
from dmuon.exchange import all_reduce_sum
from dmuon.orthogonalization import newton_schulz_flops
from dmuon.strategies.base import Context, MatrixWork, StepIO, Timed


class ColumnBlocks:
    def __init__(self, indices: Sequence[int], works: Sequence[MatrixWork]) -> None:
        self.indices, self.works = list(indices), list(works)

    def run(self, io: StepIO, ctx: Context) -> None:
        for index, work in zip(self.indices, self.works):
            reduce = partial(all_reduce_sum, group=work.process_group, counter=ctx.counter)
            # the local width from the shape, not -1: an empty matrix has 0 elements either way
            block = io.inputs([index])[0].reshape(work.count, work.m, work.local_shape[-1])
            with Timed(ctx.stats, block, work.config, column_blocks=True):
                update = orthogonalize_column_blocks(block, work.config, reduce)
            ctx.stats.matrices_orthogonalized += work.count
            ctx.stats.ns_flops += work.count * newton_schulz_flops(
                work.m, block.shape[-1], steps=work.config.steps, method=work.config.method,
                restarts=work.config.restarts, gram_side=work.m)
            io.apply([index], [update.reshape(work.local_shape)])
