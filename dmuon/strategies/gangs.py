"""Matrices split over gangs of ranks (:func:`dmuon.choices.choose_gangs`), all gangs of one
exchange group at once: each member receives its slice of the long side from the shards of its
own replica (one all-to-all for all), the gang runs distributed Newton–Schulz on the slices
(Gram side the short one, all-reduced in the gang's own process group), and each member sends
every rank its rows of its slice of the update (a second all-to-all)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.column_block_ns import orthogonalize_column_blocks
from dmuon.exchange import GroupRef, all_reduce_sum, new_subgroup, start_all_to_all
from dmuon.layout import chunk_sizes
from dmuon.orthogonalization import newton_schulz_flops
from dmuon.strategies.base import Context, MatrixWork, StepIO, Timed


class GangSlices:
    """Who holds what of a matrix split over a gang (exchange orientation: m×n, rows sharded
    over ``layout.shards``; position p holds shard p mod S). Member j of the gang works on slice
    j of the long side — columns if the matrix is wide, rows if it is tall — which it gets from
    the shards of its own replica, and returns every position that position's rows of it."""

    def __init__(self, work: MatrixWork) -> None:
        self.layout, self.gang = work.layout, work.gang
        self.m, self.n = work.m, work.n
        self.wide = self.m <= self.n
        self.short = min(self.m, self.n)
        self.row_starts = [0, *accumulate(chunk_sizes(self.m, self.layout.shards))]
        self.slice_starts = [0, *accumulate(chunk_sizes(self.n if self.wide else self.m, len(self.gang)))]

    def replica(self, position: int) -> range:
        """The positions of ``position``'s replica: together they hold every row, in order."""
        first = position // self.layout.shards * self.layout.shards
        return range(first, first + self.layout.shards)

    def same_replica(self, a: int, b: int) -> bool:
        return a // self.layout.shards == b // self.layout.shards

    def sources(self, member: int) -> list[int]:
        return [p for p in self.replica(member) if p != member]

    def _rows(self, position: int) -> tuple[int, int]:
        shard = position % self.layout.shards
        return self.row_starts[shard], self.row_starts[shard + 1]

    def _overlap(self, position: int, j: int) -> tuple[int, int]:
        """Tall: the rows of slice j that ``position`` holds (global row indices)."""
        start, stop = self._rows(position)
        low = max(start, self.slice_starts[j])
        return low, max(low, min(stop, self.slice_starts[j + 1]))

    def piece_shape(self, position: int, j: int) -> tuple[int, int]:
        """Shape of ``position``'s rows of member j's slice: what it sends member j of the input,
        and what it receives back of the update."""
        if self.wide:
            start, stop = self._rows(position)
            return stop - start, self.slice_starts[j + 1] - self.slice_starts[j]
        start, stop = self._overlap(position, j)
        return stop - start, self.n

    def piece_numel(self, position: int, j: int) -> int:
        return math.prod(self.piece_shape(position, j))

    def input_piece(self, local: Tensor, position: int, j: int) -> Tensor:
        """Of ``position``'s rows (``local``), the part member j works on."""
        local = local.reshape(-1, self.n)
        if self.wide:
            return local[:, self.slice_starts[j] : self.slice_starts[j + 1]]
        start, stop = self._overlap(position, j)
        first = self._rows(position)[0]
        return local[start - first : stop - first]

    def to_column_block(self, piece: Tensor) -> Tensor:
        """A slice in the form distributed NS takes (Gram side first), and back."""
        return piece if self.wide else piece.mT

    def update_piece(self, update: Tensor, position: int, j: int) -> Tensor:
        """Of member j's slice of the update, ``position``'s rows."""
        if self.wide:
            start, stop = self._rows(position)
            return update[start:stop]
        start, stop = self._overlap(position, j)
        return update[start - self.slice_starts[j] : stop - self.slice_starts[j]]


class Gangs:
    def __init__(self, indices: Sequence[int], works: Sequence[MatrixWork], device: torch.device) -> None:
        self.indices, self.works, self.device = list(indices), list(works), device
        self.me = works[0].layout.group_ranks.index(dist.get_rank())
        self.slices = [GangSlices(w) for w in works]
        # the process group of each gang this rank is in: made now, by its members alone, in the
        # works' order on every member, one per distinct set of ranks; a step only uses them
        self._groups: dict[int, GroupRef] = {}
        made: dict[tuple[int, ...], GroupRef] = {}
        for i, work in enumerate(works):
            if self.me in work.gang:
                ranks = tuple(work.layout.group_ranks[p] for p in work.gang)
                if ranks not in made:
                    whole = len(ranks) == work.layout.size  # the exchange group itself
                    made[ranks] = work.process_group_ref if whole else GroupRef(new_subgroup(ranks))
                self._groups[i] = made[ranks]  # torch.distributed's registry holds the group

    def run(self, io: StepIO, ctx: Context) -> None:
        blocks = self._gather_slices(io, ctx)
        updates = {i: self._orthogonalize_slice(i, block, ctx) for i, block in blocks.items()}
        self._return_updates(updates, io, ctx)

    def _gather_slices(self, io: StepIO, ctx: Context) -> dict[int, Tensor]:
        """Work index → this member's slice (exchange orientation), for the gangs it is in."""
        me, works, size = self.me, self.works, self.works[0].layout.size
        # this rank's rows, where a member of the gang is in its replica (itself included)
        needed = [i for i, (w, sl) in enumerate(zip(works, self.slices))
                  if any(sl.same_replica(member, me) for member in w.gang)]
        local = dict(zip(needed, io.inputs([self.indices[i] for i in needed])))
        sends: list[list[Tensor]] = [[] for _ in range(size)]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in range(size)]
        for i, (work, sl) in enumerate(zip(works, self.slices)):
            for j, member in enumerate(work.gang):
                if member == me:
                    for source in sl.sources(me):
                        shapes[source].append(sl.piece_shape(source, j))
                elif sl.same_replica(member, me):
                    sends[member].append(sl.input_piece(local[i], me, j))
        dtype = ctx.wire_dtype(works[0])
        received = [iter(p) for p in
                    start_all_to_all(sends, shapes, works[0].process_group, me, dtype, ctx.counter, self.device).wait()]
        blocks = {}
        for i, (work, sl) in enumerate(zip(works, self.slices)):
            if me not in work.gang:
                continue
            j = work.gang.index(me)
            blocks[i] = torch.cat([sl.input_piece(local[i], me, j).to(dtype) if source == me else next(received[source])
                                   for source in sl.replica(me)])  # rows in order
        return blocks

    def _orthogonalize_slice(self, i: int, block: Tensor, ctx: Context) -> Tensor:
        """Distributed NS of this member's slice with the rest of its gang; its slice of the update."""
        work, sl = self.works[i], self.slices[i]
        reduce = partial(all_reduce_sum, group=self._groups[i](), counter=ctx.counter)
        column_block = sl.to_column_block(block)[None]
        with Timed(ctx.stats, column_block, work.config, column_blocks=True):
            update = orthogonalize_column_blocks(column_block, work.config, reduce)[0]
        ctx.stats.matrices_orthogonalized += 1
        ctx.stats.gangs[work.name] = tuple(work.layout.group_ranks[p] for p in work.gang)
        ctx.stats.ns_flops += newton_schulz_flops(sl.short, update.shape[-1], steps=work.config.steps,
                                                  method=work.config.method, restarts=work.config.restarts,
                                                  gram_side=sl.short)
        return sl.to_column_block(update)  # the transpose is its own inverse

    def _return_updates(self, updates: dict[int, Tensor], io: StepIO, ctx: Context) -> None:
        """Every member sends every rank its rows of its slice; each rank applies its rows."""
        me, works, size = self.me, self.works, self.works[0].layout.size
        sends: list[list[Tensor]] = [[] for _ in range(size)]
        shapes: list[list[tuple[int, ...]]] = [[] for _ in range(size)]
        for i, (work, sl) in enumerate(zip(works, self.slices)):
            for j, member in enumerate(work.gang):
                if member == me:
                    for p in range(size):
                        if p != me:
                            sends[p].append(sl.update_piece(updates[i], p, j))
                else:
                    shapes[member].append(sl.piece_shape(me, j))
        dtype = ctx.return_dtype(works[0])
        received = [iter(p) for p in
                    start_all_to_all(sends, shapes, works[0].process_group, me, dtype, ctx.counter, self.device).wait()]
        mine = []
        for i, (work, sl) in enumerate(zip(works, self.slices)):
            parts = [sl.update_piece(updates[i], me, j) if member == me else next(received[member])
                     for j, member in enumerate(work.gang)]
            mine.append(torch.cat(parts, dim=1 if sl.wide else 0).reshape(work.local_shape))
        io.apply(self.indices, mine)
