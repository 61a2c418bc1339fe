"""The row exchange (DDP, FSDP2, HSDP, tensor parallel, one process): each matrix
gathered to its owner, orthogonalized there once, and every rank sent its rows of the update —
bucket by bucket, communication overlapping compute::

    start gather(k+1)          # in flight while …
    wait gather(k); NS on the units this rank owns in k (same shape+config stacked)
    start return(k)
    wait return(k−1); apply its updates

and after starting the last return, while it and the one before are in flight, the step's work
that needs no exchange (AdamW, ``io.overlap()``).

Who sends what to whom in each bucket is worked out once, when the strategy is built; a step
only computes the inputs it sends or owns, runs the collectives and applies what arrives.

Memory stays bounded by buckets, not by the model: a work's Newton–Schulz input is computed
only when its bucket needs it (and only on the ranks that send or own it), and the updates of a
bucket are applied as soon as it arrives — at most two buckets of gathered inputs and two of
returned updates exist at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.exchange import PendingExchange, Shape, start_all_to_all
from dmuon.layout import Layout
from dmuon.planner import Plan
from dmuon.strategies.base import (
    Batch,
    Context,
    MatrixWork,
    StepIO,
    Timed,
    batches_of,
    share_row_states,
    update_norms,
)


def rows_of(full: Tensor, layout: Layout, shard: int) -> Tensor:
    """Shard ``shard``'s rows of a tensor of the layout's global shape, as a view: the rows are
    copied once, where they go (the send buffer, the parameter)."""
    start = sum(layout.chunk_rows(s) for s in range(shard))
    return full.reshape(layout.shape)[start: start + layout.chunk_rows(shard)]


@dataclass(frozen=True)
class _Bucket:
    """One bucket as this rank sees it (positions in the exchange group, units by index)."""

    units: tuple[int, ...]
    gathers: bool  # does any rank send anything (no: replicated layouts, nothing to gather)
    sends: tuple[tuple[int, int], ...]  # (unit, owner) this rank sends its rows of
    gather_shapes: tuple[tuple[Shape, ...], ...]  # by source: what this rank receives as an owner
    owned: tuple[tuple[int, tuple[int, ...]], ...]  # (unit, its replica block) this rank owns
    batches: tuple[Batch, ...]  # how the owned units are stacked for Newton–Schulz
    flops: int  # of the owned units
    indices: tuple[int, ...]  # of the bucket's units in the step plan's works
    # one process, plain matrices only: per batch, the positions in the bucket it stacks, and
    # where each position's result is in the batches laid end to end
    stacks: tuple[tuple[int, ...], ...] | None
    stack_order: Tensor | None
    returns: bool
    return_sends: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # owned unit, ((target, shard), ...)
    return_shapes: tuple[tuple[Shape, ...], ...]  # by source: the rows this rank gets back


class RowExchange:
    """The works of one exchange group, run as their :class:`~dmuon.planner.Plan` says."""

    def __init__(self, indices: Sequence[int], works: Sequence[MatrixWork], plan: Plan, device: torch.device) -> None:
        self.indices = list(indices)  # into the step plan's works
        self.works = list(works)
        self.plan = plan
        self.device = device  # of an empty send buffer (NCCL takes only device tensors), and of index tensors
        self.me = works[0].layout.group_ranks.index(dist.get_rank()) if self.process_group is not None else 0
        self.buckets = [self._bucket(k) for k in range(len(plan.buckets))]

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self.works[0].process_group

    def _bucket(self, k: int) -> _Bucket:
        plan, me = self.plan, self.me
        units = plan.buckets[k]

        def numel(u: int, p: int) -> int:
            return plan.units[u].chunk_bytes(p) // plan.units[u].itemsize

        gather_shapes: list[list[Shape]] = [[] for _ in range(plan.size)]
        return_shapes: list[list[Shape]] = [[] for _ in range(plan.size)]
        for u in units:
            owner = plan.owners[u]
            if owner == me:
                for p in plan.gather_sources(u):
                    gather_shapes[p].append((numel(u, p),))
            elif me in plan.return_targets(u):
                return_shapes[owner].append((numel(u, me),))
        shards = {u: plan.units[u].layout.shards for u in units}
        owned = [u for u in units if plan.owners[u] == me]
        batches = batches_of(owned, self.works)
        stacks = self._stacks(units, batches) if self.process_group is None else None
        laid_out = [j for positions in stacks for j in positions] if stacks else []
        return _Bucket(
            units=tuple(units),
            gathers=any(plan.gather_sources(u) for u in units),
            sends=tuple((u, plan.owners[u]) for u in units if me in plan.gather_sources(u)),
            gather_shapes=tuple(map(tuple, gather_shapes)),
            owned=tuple((u, tuple(plan.replica_block(u))) for u in owned),
            batches=tuple(batches),
            flops=sum(plan.units[u].flops for u in owned),
            indices=tuple(self.indices[u] for u in units),
            stacks=stacks,
            stack_order=torch.tensor(sorted(range(len(laid_out)), key=laid_out.__getitem__), device=self.device)
            if stacks else None,
            returns=any(plan.return_targets(u) for u in units),
            return_sends=tuple((u, tuple((p, p % shards[u]) for p in plan.return_targets(u)))
                               for u in units if plan.owners[u] == me),
            return_shapes=tuple(map(tuple, return_shapes)),
        )

    def _stacks(self, units: Sequence[int], batches: Sequence[Batch]) -> tuple[tuple[int, ...], ...] | None:
        """Where every work of a bucket is one whole 2-D matrix, with no update rule: each batch's positions."""
        plain = all(self.works[u].count == 1 and not self.works[u].blocks and len(self.works[u].local_shape) == 2
                    and self.works[u].rule.fn is None for u in units)
        position = {u: j for j, u in enumerate(units)}
        return tuple(tuple(position[u] for u, _, _, _ in members) for _, _, members in batches) if plain else None

    def bucket_indices(self, k: int) -> tuple[int, ...]:
        """Bucket k's works, by index into the step plan's (what early start waits for)."""
        return self.buckets[k].indices

    def run(self, io: StepIO, ctx: Context) -> None:
        for _ in self.stages(io, ctx):
            pass

    def stages(self, io: StepIO, ctx: Context) -> Iterator[int]:
        """The run, in stages: it yields ``k`` before it first reads an input of bucket ``k``, so
        that early start (:mod:`dmuon.step.early`) can resume it once bucket ``k``'s gradients
        are final, while the backward pass goes on. Every rank runs the same stages in the same
        order; only when each one runs may differ."""
        if self.process_group is None:
            yield from self._stages_alone(io, ctx)
            share_row_states(self.indices, self.works, io, ctx)
            return
        returns: list[tuple[int, PendingExchange | None, dict[int, Tensor]]] = []
        gathers = {}
        if self.buckets:
            yield 0
            gathers[0] = self._start_gather(0, io, ctx)
        for k in range(len(self.buckets)):
            # the next bucket's gather goes out before this bucket's Newton–Schulz, to overlap it;
            # with nothing to gather (replicated layouts) this bucket need not wait for the next
            gather_ahead = k + 1 < len(self.buckets) and self.buckets[k + 1].gathers
            if gather_ahead:
                yield k + 1
                gathers[k + 1] = self._start_gather(k + 1, io, ctx)
            owned = self._orthogonalize_owned(k, gathers.pop(k), io, ctx)
            returns.append((k, self._start_return(k, owned, ctx), owned))
            if k + 1 == len(self.buckets):
                io.overlap()  # nothing left to compute here: the last returns would only be waited for
            if len(returns) > 1:
                self._finish_return(*returns.pop(0), io)
            if k + 1 < len(self.buckets) and not gather_ahead:
                yield k + 1
                gathers[k + 1] = None
        for pending in returns:
            self._finish_return(*pending, io)
        share_row_states(self.indices, self.works, io, ctx)

    def _stages_alone(self, io: StepIO, ctx: Context) -> Iterator[int]:
        """One process: every matrix is whole here and nothing is exchanged, so a bucket is its
        inputs, its batched Newton–Schulz calls and its updates — the same calls on the same
        stacks as the exchange makes; plain matrices are stacked and unstacked without reshapes."""
        for k, bucket in enumerate(self.buckets):
            yield k
            dtype = self._dtype(k, ctx)
            values = [v if v.dtype == dtype else v.to(dtype) for v in io.inputs(bucket.indices)]
            if bucket.stacks is None:  # expert stacks, fused blocks or update rules: the general assembly
                inputs = {u: v.reshape(self.works[u].count, self.works[u].m, self.works[u].n)
                          for u, v in zip(bucket.units, values)}
                owned = ctx.orthogonalize_whole(inputs, self.works, bucket.batches, bucket.flops, io, self.indices)
                io.apply(bucket.indices, [owned[u].reshape(self.works[u].local_shape) for u in bucket.units])
                continue
            ctx.stats.ns_flops += bucket.flops
            updates: list[Tensor | None] = [None] * len(values)
            norms = []  # of the updates, a batch at a time (one call each, not one per matrix)
            for (config, _, _), positions in zip(bucket.batches, bucket.stacks):
                stacked = torch.stack([values[j] for j in positions])
                with Timed(ctx.stats, stacked, config):
                    results = ctx.orthogonalize(stacked, config)
                ctx.stats.matrices_orthogonalized += stacked.shape[0]
                norms.append(update_norms(results))
                for j, result in zip(positions, results.unbind(0)):
                    updates[j] = result
            by_position = torch.cat(norms)[bucket.stack_order] if norms else None
            io.apply(bucket.indices, updates, by_position)

    def _dtype(self, k: int, ctx: Context) -> torch.dtype:
        return ctx.wire_dtype(self.works[self.buckets[k].units[0]])

    def _start_gather(self, k: int, io: StepIO, ctx: Context) -> PendingExchange | None:
        bucket = self.buckets[k]
        if not bucket.gathers:
            return None  # nothing to gather (replicated layouts): no rank calls a collective
        sends: list[list[Tensor]] = [[] for _ in range(self.plan.size)]
        inputs = io.inputs([self.indices[u] for u, _ in bucket.sends])
        for (_, owner), x in zip(bucket.sends, inputs):
            sends[owner].append(x)
        return start_all_to_all(sends, [list(s) for s in bucket.gather_shapes], self.process_group, self.me,
                                self._dtype(k, ctx), ctx.counter, self.device)

    def _orthogonalize_owned(self, k: int, pending: PendingExchange | None, io: StepIO,
                             ctx: Context) -> dict[int, Tensor]:
        """Assemble, then orthogonalize, the units of bucket k this rank owns."""
        bucket = self.buckets[k]
        received = [iter(pieces) for pieces in pending.wait()] if pending is not None else None
        own = io.inputs([self.indices[u] for u, _ in bucket.owned])
        dtype = self._dtype(k, ctx)
        inputs: dict[int, Tensor | list[Tensor]] = {}
        for (u, block), mine in zip(bucket.owned, own):
            work = self.works[u]
            if len(block) == 1:  # the owner holds it whole (one process, DDP)
                inputs[u] = (mine if mine.dtype == dtype else mine.to(dtype)).reshape(work.count, work.m, work.n)
                continue
            # the rows of shard 0, 1, … in order (copied once, into the batch)
            inputs[u] = [mine.to(dtype) if p == self.me else next(received[p]) for p in block]
        return ctx.orthogonalize_whole(inputs, self.works, bucket.batches, bucket.flops, io, self.indices)

    def _start_return(self, k: int, owned: dict[int, Tensor], ctx: Context) -> PendingExchange | None:
        bucket = self.buckets[k]
        if not bucket.returns:
            return None
        sends: list[list[Tensor]] = [[] for _ in range(self.plan.size)]
        for u, targets in bucket.return_sends:
            layout = self.plan.units[u].layout
            for p, shard in targets:
                sends[p].append(rows_of(owned[u], layout, shard))
        # the update's own dtype where narrower than the wire's (MatrixWork.narrow_return): exact
        back = ctx.return_dtype(self.works[bucket.units[0]])
        return start_all_to_all(sends, [list(s) for s in bucket.return_shapes], self.process_group, self.me,
                                back, ctx.counter, self.device)

    def _finish_return(self, k: int, pending: PendingExchange | None, owned: dict[int, Tensor], io: StepIO) -> None:
        received = [iter(pieces) for pieces in pending.wait()] if pending is not None else None
        updates = []
        for u in self.buckets[k].units:
            work, owner = self.works[u], self.plan.owners[u]
            if owner != self.me:
                piece = next(received[owner])
            elif work.layout.shards == 1:  # this rank's rows are all of them
                piece = owned[u]
            else:
                piece = rows_of(owned[u], work.layout, self.me % work.layout.shards)
            updates.append(piece.reshape(work.local_shape))
        io.apply([self.indices[u] for u in self.buckets[k].units], updates)
