"""The gathered fallback: layouts the planned exchange does not cover (FSDP + row-wise tensor
parallel on a 2-D mesh, 2-D blocks). Each input is gathered whole on every rank, its owner (LPT
over NS FLOPs, chosen once) orthogonalizes it and broadcasts the update, and every rank keeps
its piece. Exact, but it moves each matrix N times: a fallback."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dmuon.exchange import start_broadcast
from dmuon.planner import Unit, balance_owners
from dmuon.strategies.base import Context, MatrixWork, StepIO, batches_of


class GatheredFallback:
    def __init__(self, indices: Sequence[int], works: Sequence[MatrixWork], units: Sequence[Unit]) -> None:
        self.indices, self.works, self.units = list(indices), list(works), list(units)
        self.owners, _ = balance_owners([u.flops for u in units], [u.name for u in units], works[0].layout.size)
        self.me = works[0].layout.group_ranks.index(dist.get_rank())

    def run(self, io: StepIO, ctx: Context) -> None:
        size = self.works[0].layout.size
        for u, (index, work, owner) in enumerate(zip(self.indices, self.works, self.owners)):
            whole = work.gather_whole(io.inputs([index])[0]).reshape(work.count, work.m, work.n)
            ctx.counter.bytes_sent += math.prod(work.local_shape) * whole.element_size() * (size - 1)
            ctx.counter.collectives += 1  # the gather
            if owner == self.me:
                # contiguous: the collective sends memory order (NS hands tall matrices back transposed)
                update = ctx.orthogonalize_whole({u: whole}, self.works, batches_of([u], self.works),
                                                 self.units[u].flops)[u].contiguous()
            else:  # contiguous, as the owner's is (a gathered tensor may come with any strides)
                update = torch.empty(whole.shape, dtype=whole.dtype, device=whole.device)
            start_broadcast(update, work.layout.group_ranks[owner], work.process_group, ctx.counter).wait()
            io.apply([index], [work.local_piece(update.reshape(work.layout.shape))])
