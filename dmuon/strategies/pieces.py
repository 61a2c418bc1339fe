"""Every other DTensor sharding of a matrix (FSDP + tensor parallel: ``_StridedShard`` beside
``Shard``, 2-D blocks, expert stacks sharded on a matrix dimension): its owner receives exactly
the pieces of it from the ranks that hold them — one packed all-to-all over the mesh's ranks —
puts them in place, orthogonalizes the whole, and sends each rank its piece of the update back
in a second all-to-all. Per rank that is its pieces out and back: 2(N−1)/N of the matrices
spread over the N ranks, FSDP2's exchange, where gathering every matrix whole on every rank
would move N times as much.

A rank's piece of a tensor is the outer product of one index list per dimension: each
``Shard``/``_StridedShard`` placement picks indices along one dimension, ``Replicate`` none
(:func:`dmuon.layout.piece_index_lists`, which cuts tensors of indices as DTensor cuts the
parameter, so the pieces follow DTensor's own rules). The ranks exchange their lists once, at
the first step; where a replicated mesh dimension gives ranks the same piece, the first of them
sends it. Owners and buckets come from the planner (:func:`dmuon.planner.make_plan`, as for the row
exchange): owners by LPT, buckets of about ``bucket_bytes`` of input per owner that bound the
memory, run in stages as the row exchange's: bucket k+1's pieces go out while bucket k is
orthogonalized, and bucket k's update comes back while bucket k+1 is.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.exchange import PendingExchange, all_gather_object, start_all_to_all
from dmuon.layout import piece_index_lists
from dmuon.planner import Plan
from dmuon.strategies.base import Context, MatrixWork, StepIO, batches_of, share_row_states

IndexLists = tuple[Tensor, ...]  # one per dimension of a work's global shape


def take(whole: Tensor, lists: IndexLists) -> Tensor:
    """The piece of ``whole`` at the outer product of ``lists`` (a copy)."""
    return whole[_grid(lists)]


def put(whole: Tensor, lists: IndexLists, piece: Tensor) -> None:
    """Write ``piece`` into ``whole`` at the outer product of ``lists``."""
    whole[_grid(lists)] = piece.reshape([len(index) for index in lists])


def _grid(lists: IndexLists) -> tuple[Tensor, ...]:
    """Index tensors that broadcast to the outer product of ``lists``."""
    return tuple(index.view([-1 if d == i else 1 for d in range(len(lists))]) for i, index in enumerate(lists))


class PieceExchange:
    """The works of one exchange group whose pieces are not row chunks (see the module's docstring)."""

    def __init__(self, indices: Sequence[int], works: Sequence[MatrixWork], plan: Plan,
                 device: torch.device) -> None:
        self.indices, self.works, self.plan = list(indices), list(works), plan
        self.device = device
        self.size = plan.size
        self.me = works[0].layout.group_ranks.index(dist.get_rank())
        self.owners, self.buckets = plan.owners, plan.buckets
        self.lists: list[list[IndexLists]] | None = None  # per work, per position: found at the first run
        self.senders: list[list[int]] = []  # per work: the positions whose piece its owner receives

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.works[0].process_group

    def _find_pieces(self, ctx: Context) -> None:
        """Every position's index lists of every work (one all-gather, at the first run)."""
        mine = [piece_index_lists(w.param) for w in self.works]
        everyone = all_gather_object(mine, self.process_group, self.device, ctx.counter)
        self.lists = []
        for u in range(len(self.works)):
            first = {}
            for p in range(self.size):
                first.setdefault(tuple(tuple(index.tolist()) for index in everyone[p][u]), p)
            self.senders.append(sorted(first.values()))
            # on the device of the values they index: no copy at every step
            self.lists.append([tuple(index.to(self.device) for index in everyone[p][u]) for p in range(self.size)])

    def bucket_indices(self, k: int) -> tuple[int, ...]:
        """Bucket k's works, by index into the step plan's (what early start waits for)."""
        return tuple(self.indices[u] for u in self.buckets[k])

    def run(self, io: StepIO, ctx: Context) -> None:
        for _ in self.stages(io, ctx):
            pass

    def stages(self, io: StepIO, ctx: Context) -> Iterator[int]:
        """The run, in stages, as the row exchange's (:meth:`RowExchange.stages`): it yields ``k``
        before it first reads an input of bucket ``k``; bucket k+1's pieces go out before bucket
        k's Newton–Schulz, and bucket k's update comes back while bucket k+1's runs."""
        if self.lists is None:
            self._find_pieces(ctx)
        count = len(self.buckets)
        gathers: dict[int, PendingExchange] = {}
        returns: list[tuple[int, PendingExchange]] = []
        if count:
            yield 0
            gathers[0] = self._start_gather(0, io, ctx)
        for k in range(count):
            if k + 1 < count:
                yield k + 1
                gathers[k + 1] = self._start_gather(k + 1, io, ctx)
            returns.append((k, self._start_return(k, self._orthogonalize_owned(k, gathers.pop(k), io, ctx), ctx)))
            if k + 1 == count:
                io.overlap()  # nothing left to compute here: the last returns would only be waited for
            if len(returns) > 1:
                self._finish_return(*returns.pop(0), io)
        for k, pending in returns:
            self._finish_return(k, pending, io)
        share_row_states(self.indices, self.works, io, ctx)

    def _start_gather(self, k: int, io: StepIO, ctx: Context) -> PendingExchange:
        """Send this rank's pieces of bucket k's works to their owners (its own owned ones' to itself)."""
        bucket, lists, me = self.buckets[k], self.lists, self.me
        inputs = io.inputs([self.indices[u] for u in bucket])
        sends: list[list[Tensor]] = [[] for _ in range(self.size)]
        for u, x in zip(bucket, inputs):
            if me in self.senders[u]:
                sends[self.owners[u]].append(x)
        shapes = [[(_numel(lists[u][p]),) for u in bucket if self.owners[u] == me and p in self.senders[u]]
                  for p in range(self.size)]
        return start_all_to_all(sends, shapes, self.process_group, me, ctx.wire_dtype(self.works[bucket[0]]),
                                ctx.counter, self.device)

    def _orthogonalize_owned(self, k: int, pending: PendingExchange, io: StepIO, ctx: Context) -> dict[int, Tensor]:
        """Put the pieces of bucket k's works this rank owns in place, and orthogonalize them."""
        received = [iter(pieces) for pieces in pending.wait()]
        owned = [u for u in self.buckets[k] if self.owners[u] == self.me]
        wholes = {}
        for u in owned:
            work = self.works[u]
            whole = torch.empty(work.layout.shape, dtype=ctx.wire_dtype(work), device=self.device)
            for p in self.senders[u]:
                put(whole, self.lists[u][p], next(received[p]))
            wholes[u] = whole.reshape(work.count, work.m, work.n)
        return ctx.orthogonalize_whole(wholes, self.works, batches_of(owned, self.works),
                                       sum(self.plan.units[u].flops for u in owned), io, self.indices)

    def _start_return(self, k: int, updates: dict[int, Tensor], ctx: Context) -> PendingExchange:
        """Send every rank its piece of each owned update of bucket k (its own too), in the
        update's return dtype."""
        bucket, lists, me = self.buckets[k], self.lists, self.me
        owned = [u for u in bucket if self.owners[u] == me]
        returns = [[take(updates[u].reshape(self.works[u].layout.shape), lists[u][p]) for u in owned]
                   for p in range(self.size)]
        shapes = [[(_numel(lists[u][me]),) for u in bucket if self.owners[u] == p] for p in range(self.size)]
        return start_all_to_all(returns, shapes, self.process_group, me, ctx.return_dtype(self.works[bucket[0]]),
                                ctx.counter, self.device)

    def _finish_return(self, k: int, pending: PendingExchange, io: StepIO) -> None:
        received = [iter(pieces) for pieces in pending.wait()]
        bucket = self.buckets[k]
        io.apply([self.indices[u] for u in bucket],
                 [next(received[self.owners[u]]).view(self.works[u].local_shape) for u in bucket])


def _numel(lists: IndexLists) -> int:
    return math.prod(len(index) for index in lists)
