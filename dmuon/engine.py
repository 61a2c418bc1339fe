"""Runs a plan: gathers each matrix to its owner, orthogonalizes it there once, and returns every
rank its rows of the update — bucket by bucket, with communication overlapping compute.

Per exchange group, for buckets k = 0, 1, …::

    start gather(k+1)          # in flight while …
    wait gather(k); NS on the units this rank owns in k (same shape+config stacked)
    start return(k)
    wait return(k−1); apply its updates

Matrices the planner splits over gangs of ranks (:func:`dmuon.planner.choose_gangs`) go first,
all gangs at once: each member is sent its slice of the long side, the gang runs distributed
Newton–Schulz in its own process group, and every rank is sent its rows back (``_run_gangs``).

Memory stays bounded by buckets, not by the model: a work's Newton–Schulz input is computed
only when its bucket needs it (and only on the ranks that send or own it), and each update is
applied as soon as it arrives — at most two buckets of gathered inputs and two of returned
updates exist at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.exchange import CommCounter, PendingExchange, all_reduce_sum, start_all_to_all, start_broadcast
from dmuon.layout import Layout, chunk_sizes
from dmuon.orthogonalization import NSConfig, newton_schulz_flops, orthogonalize, orthogonalize_column_blocks
from dmuon.planner import DEFAULT_BUCKET_BYTES, DEFAULT_FLOPS_PER_BYTE, Plan, Unit, balance_owners, make_plan


@dataclass(frozen=True)
class Block:
    """Rows of a fused matrix orthogonalized on their own, and the factor their result takes."""

    rows: int
    config: NSConfig
    scale: float


@dataclass
class MatrixWork:
    """One Muon parameter's orthogonalization in this step.

    ``local_input()`` computes what this rank holds of the Newton–Schulz input (its shard, or
    the whole tensor; shaped ``local_shape``); the whole input is ``count`` m×n matrices, laid
    out as ``layout.shape``. ``apply(update)`` consumes this rank's piece of the result.
    ``blocks``: for fused weights, the row blocks orthogonalized separately, each result scaled
    by its block's factor (empty: the whole matrix, with ``config``, unscaled).
    """

    name: str
    local_input: Callable[[], Tensor]
    apply: Callable[[Tensor], None]
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout
    group: dist.ProcessGroup | None
    count: int
    m: int
    n: int
    config: NSConfig
    blocks: tuple[Block, ...] = ()
    # gathered layouts only: the whole NS input on every rank (collective), and this rank's
    # piece of a whole update
    gather_whole: Callable[[], Tensor] | None = None
    local_piece: Callable[[Tensor], Tensor] | None = None
    # distributed NS: local_input() is this rank's column block (count, m, n_local) of a matrix
    # whose Gram side is m, and apply() takes this rank's columns of the result
    column_blocks: bool = False
    # split over a gang of positions of the exchange group (planner.choose_gangs); empty: not
    gang: tuple[int, ...] = ()


@dataclass
class StepStats:
    """What this rank did in the last step's orthogonalization. Reading it costs nothing and
    synchronizes nothing, except :attr:`ns_seconds` on CUDA (it waits for the step's last
    Newton–Schulz kernel)."""

    matrices_orthogonalized: int = 0
    ns_flops: int = 0
    bytes_sent: int = 0
    collectives: int = 0
    gangs: dict[str, tuple[int, ...]] = field(default_factory=dict)  # split matrices: name → global ranks
    # Newton–Schulz time: host seconds on CPU, (start, end) CUDA event pairs on CUDA, read lazily
    _ns_spans: list = field(default_factory=list)

    @property
    def ns_seconds(self) -> float:
        """Time this rank spent in Newton–Schulz calls."""
        total = 0.0
        for span in self._ns_spans:
            total += span if isinstance(span, float) else span[0].elapsed_time(span[1]) / 1e3
        return total


class _Timed:
    """Times a block of device work into ``stats``: host time on CPU; CUDA events otherwise, so
    that timing never synchronizes the step."""

    def __init__(self, stats: StepStats, device: torch.device) -> None:
        self.stats, self.cuda = stats, device.type == "cuda"

    def __enter__(self) -> None:
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats._ns_spans.append((self.start, end))
        else:
            self.stats._ns_spans.append(time.perf_counter() - self.start)


def unit_of(work: MatrixWork, itemsize: int) -> Unit:
    pieces = [(b.rows, b.config) for b in work.blocks] or [(work.m, work.config)]
    per_matrix = sum(
        newton_schulz_flops(rows, work.n, steps=c.steps, method=c.method, restarts=c.restarts) for rows, c in pieces
    )
    return Unit(work.name, work.layout, work.count, work.m, work.n, itemsize, work.count * per_matrix)


def _rows(full: Tensor, layout: Layout, shard: int) -> Tensor:
    """Shard ``shard``'s rows of a tensor of the layout's global shape, flattened."""
    start = sum(layout.chunk_rows(s) for s in range(shard))
    return full.reshape(layout.shape)[start : start + layout.chunk_rows(shard)].reshape(-1)


class _GangSlices:
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


class Orthogonalizer:
    """Orthogonalizes a list of :class:`MatrixWork` across ranks; one per optimizer.

    Plans are cached per exchange group and rebuilt only when the set of matrices changes.
    """

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        comm_dtype: torch.dtype | None = None,
        flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE,
        orthogonalize_fn: Callable[[Tensor, NSConfig], Tensor] = orthogonalize,
    ) -> None:
        self.orthogonalize = orthogonalize_fn  # the plain function, or its torch.compile'd form
        self.bucket_bytes = bucket_bytes
        self.comm_dtype = comm_dtype
        self.flops_per_byte = flops_per_byte
        self.counter = CommCounter()
        self.stats = StepStats()
        self._plans: dict[tuple, Plan] = {}
        self._gang_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def wire_dtype(self, work: MatrixWork) -> torch.dtype:
        return self.comm_dtype or work.dtype

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
        """The plan of each exchange group (gathered layouts have none: see _run_gathered)."""
        planned = [w for w in works if self._planned(w)]
        return [self.plan_for([planned[i] for i in members]) for members in self.group_indices(planned)]

    @staticmethod
    def _planned(work: MatrixWork) -> bool:
        return not (work.layout.gathered or work.column_blocks or work.gang)

    def plan_for(self, works: Sequence[MatrixWork]) -> Plan:
        """The (cached) plan of one exchange group's works."""
        units = [unit_of(w, self.wire_itemsize(w)) for w in works]
        layout = works[0].layout
        key = (layout.group_ranks, layout.replicas, tuple(units))
        if key not in self._plans:
            self._plans[key] = make_plan(
                units, layout.size, layout.replicas,
                bucket_bytes=self.bucket_bytes, flops_per_byte=self.flops_per_byte,
            )
        return self._plans[key]

    def start_step(self) -> None:
        """Zero the step's statistics (the optimizer's own flag all-reduce counts too)."""
        self.counter.reset()
        self.stats = StepStats()

    def run(self, works: Sequence[MatrixWork]) -> None:
        """Orthogonalize every work and hand each rank's piece of the update to ``work.apply``."""
        split = [w for w in works if w.gang]
        for members in self.group_indices(split):
            self._run_gangs([split[i] for i in members])
        planned = [w for w in works if self._planned(w)]
        for members in self.group_indices(planned):
            self._run_group([planned[i] for i in members])
        self._run_gathered([w for w in works if w.layout.gathered and not w.column_blocks])
        self._run_column_blocks([w for w in works if w.column_blocks])
        self.stats.bytes_sent = self.counter.bytes_sent
        self.stats.collectives = self.counter.collectives

    def _run_group(self, works: list[MatrixWork]) -> None:
        plan = self.plan_for(works)
        group = works[0].group
        me = plan.units[0].layout.group_ranks.index(dist.get_rank()) if group is not None else 0
        returns: list[tuple[int, PendingExchange | None, dict[int, Tensor]]] = []
        gathers = {0: self._start_gather(plan, 0, works, group, me)} if plan.buckets else {}
        for k in range(len(plan.buckets)):
            if k + 1 < len(plan.buckets):
                gathers[k + 1] = self._start_gather(plan, k + 1, works, group, me)
            owned = self._orthogonalize_owned(plan, k, works, gathers.pop(k), me)
            returns.append((k, self._start_return(plan, k, works, owned, group, me), owned))
            if len(returns) > 1:
                self._finish_return(plan, *returns.pop(0), works, me)
        for pending in returns:
            self._finish_return(plan, *pending, works, me)

    # ------------------------------------------------------------------ gather

    def _start_gather(self, plan: Plan, k: int, works, group, me: int) -> PendingExchange | None:
        bucket = plan.buckets[k]
        if not any(plan.gather_sources(u) for u in bucket):
            return None  # nothing to gather (replicated layouts): no rank calls a collective
        sends: list[list[Tensor]] = [[] for _ in range(plan.size)]
        recv_splits = [0] * plan.size
        for u in bucket:
            owner, sources = plan.owners[u], plan.gather_sources(u)
            if me in sources:
                sends[owner].append(works[u].local_input())
            if owner == me:
                for p in sources:
                    recv_splits[p] += plan.units[u].chunk_bytes(p) // plan.units[u].itemsize
        dtype = self.wire_dtype(works[bucket[0]])
        return start_all_to_all(sends, recv_splits, group, me, dtype, self.counter)

    def _run_gathered(self, works: list[MatrixWork]) -> None:
        """Layouts the planned exchange does not cover: each input is gathered whole on every
        rank, its owner (LPT over NS FLOPs) orthogonalizes it and broadcasts the update, and
        every rank keeps its piece. Exact, but it moves each matrix N times: a fallback."""
        if not works:
            return
        group, size = works[0].group, works[0].layout.size
        units = [unit_of(w, self.wire_itemsize(w)) for w in works]
        owners, _ = balance_owners([u.flops for u in units], [u.name for u in units], size)
        me = works[0].layout.group_ranks.index(dist.get_rank())
        for u, (work, owner) in enumerate(zip(works, owners)):
            whole = work.gather_whole().reshape(work.count, work.m, work.n)
            self.counter.bytes_sent += math.prod(work.local_shape) * whole.element_size() * (size - 1)
            self.counter.collectives += 1  # the gather
            if owner == me:
                # contiguous: the collective sends memory order (NS hands tall matrices back transposed)
                update = self._orthogonalize_inputs({u: whole}, works, units)[u].contiguous()
            else:  # contiguous, as the owner's is (a gathered tensor may come with any strides)
                update = torch.empty(whole.shape, dtype=whole.dtype, device=whole.device)
            start_broadcast(update, work.layout.group_ranks[owner], group, self.counter).wait()
            work.apply(work.local_piece(update.reshape(work.layout.shape)))

    def _run_column_blocks(self, works: list[MatrixWork]) -> None:
        """Distributed Newton–Schulz: the ranks holding a matrix's column blocks orthogonalize it
        together (:func:`dmuon.orthogonalization.orthogonalize_column_blocks`); nothing is
        gathered, and every rank of the group does the small-side recurrence."""
        for work in works:
            reduce = partial(all_reduce_sum, group=work.group, counter=self.counter)
            # the local width from the shape, not -1: an empty matrix has 0 elements either way
            block = work.local_input().reshape(work.count, work.m, work.local_shape[-1])
            with _Timed(self.stats, block.device):
                update = orthogonalize_column_blocks(block, work.config, reduce)
            self.stats.matrices_orthogonalized += work.count
            self.stats.ns_flops += work.count * newton_schulz_flops(
                work.m, block.shape[-1], steps=work.config.steps, method=work.config.method,
                restarts=work.config.restarts, gram_side=work.m)
            work.apply(update)

    def _run_gangs(self, works: list[MatrixWork]) -> None:
        """Matrices split over gangs (one exchange group's; gangs disjoint): each member receives
        its slice of the long side from the shards of its replica (one all-to-all for all), the
        gang runs distributed NS on the slices (Gram side the short one, all-reduced in the
        gang), and each member sends every rank its rows of its slice of the update (a second
        all-to-all)."""
        me = works[0].layout.group_ranks.index(dist.get_rank())
        slices = [_GangSlices(w) for w in works]
        blocks = self._gather_gang_slices(works, slices, me)
        updates = {i: self._orthogonalize_gang_slice(works[i], slices[i], block) for i, block in blocks.items()}
        self._return_gang_updates(works, slices, updates, me)

    def _gather_gang_slices(self, works: list[MatrixWork], slices: list[_GangSlices], me: int) -> dict[int, Tensor]:
        """Work index → this member's slice (exchange orientation), for the gangs ``me`` is in."""
        size = works[0].layout.size
        # this rank's rows, where a member of the gang is in its replica (itself included)
        local = {i: w.local_input() for i, (w, sl) in enumerate(zip(works, slices))
                 if any(sl.same_replica(member, me) for member in w.gang)}
        sends: list[list[Tensor]] = [[] for _ in range(size)]
        recv_splits = [0] * size
        for i, (work, sl) in enumerate(zip(works, slices)):
            for j, member in enumerate(work.gang):
                if member == me:
                    for source in sl.sources(me):
                        recv_splits[source] += sl.piece_numel(source, j)
                elif sl.same_replica(member, me):
                    sends[member].append(sl.input_piece(local[i], me, j))
        dtype = self.wire_dtype(works[0])
        received = start_all_to_all(sends, recv_splits, works[0].group, me, dtype, self.counter).wait()
        offsets = [0] * size
        blocks = {}
        for i, (work, sl) in enumerate(zip(works, slices)):
            if me not in work.gang:
                continue
            j = work.gang.index(me)
            pieces = []
            for source in sl.replica(me):
                if source == me:
                    pieces.append(sl.input_piece(local[i], me, j).to(dtype))
                    continue
                numel = sl.piece_numel(source, j)
                pieces.append(received[source][offsets[source] : offsets[source] + numel]
                              .reshape(sl.piece_shape(source, j)))
                offsets[source] += numel
            blocks[i] = torch.cat(pieces)  # rows in order
        return blocks

    def _orthogonalize_gang_slice(self, work: MatrixWork, sl: _GangSlices, block: Tensor) -> Tensor:
        """Distributed NS of this member's slice with the rest of its gang; its slice of the update."""
        reduce = partial(all_reduce_sum, group=self._gang_group(work), counter=self.counter)
        with _Timed(self.stats, block.device):
            update = orthogonalize_column_blocks(sl.to_column_block(block)[None], work.config, reduce)[0]
        self.stats.matrices_orthogonalized += 1
        self.stats.gangs[work.name] = tuple(work.layout.group_ranks[p] for p in work.gang)
        self.stats.ns_flops += newton_schulz_flops(sl.short, update.shape[-1], steps=work.config.steps,
                                                   method=work.config.method, restarts=work.config.restarts,
                                                   gram_side=sl.short)
        return sl.to_column_block(update)  # the transpose is its own inverse

    def _return_gang_updates(self, works: list[MatrixWork], slices: list[_GangSlices], updates: dict[int, Tensor],
                             me: int) -> None:
        """Every member sends every rank its rows of its slice; each rank applies its rows."""
        size = works[0].layout.size
        sends: list[list[Tensor]] = [[] for _ in range(size)]
        recv_splits = [0] * size
        for i, (work, sl) in enumerate(zip(works, slices)):
            for j, member in enumerate(work.gang):
                if member == me:
                    for p in range(size):
                        if p != me:
                            sends[p].append(sl.update_piece(updates[i], p, j))
                else:
                    recv_splits[member] += sl.piece_numel(me, j)
        dtype = self.wire_dtype(works[0])
        received = start_all_to_all(sends, recv_splits, works[0].group, me, dtype, self.counter).wait()
        offsets = [0] * size
        for i, (work, sl) in enumerate(zip(works, slices)):
            parts = []
            for j, member in enumerate(work.gang):
                if member == me:
                    parts.append(sl.update_piece(updates[i], me, j))
                    continue
                numel = sl.piece_numel(me, j)
                parts.append(received[member][offsets[member] : offsets[member] + numel]
                             .reshape(sl.piece_shape(me, j)))
                offsets[member] += numel
            work.apply(torch.cat(parts, dim=1 if sl.wide else 0).reshape(work.local_shape))

    def _gang_group(self, work: MatrixWork) -> dist.ProcessGroup:
        """The process group of ``work``'s gang: the exchange group itself when the gang is all of
        it, else one group per distinct set of ranks, made once by its members alone
        (``use_local_synchronization``: ranks outside the gang take no part)."""
        ranks = tuple(work.layout.group_ranks[p] for p in work.gang)
        if len(ranks) == work.layout.size:
            return work.group
        if ranks not in self._gang_groups:
            self._gang_groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
        return self._gang_groups[ranks]

    def _orthogonalize_owned(self, plan: Plan, k: int, works, pending, me: int) -> dict[int, Tensor]:
        """Assemble, then orthogonalize, the units of bucket k this rank owns; same-shape,
        same-config units share one batched call."""
        received = pending.wait() if pending is not None else None
        offsets = [0] * plan.size
        inputs: dict[int, Tensor] = {}
        for u in plan.buckets[k]:
            if plan.owners[u] != me:
                continue
            work = works[u]
            pieces = []
            for p in plan.replica_block(u):  # the rows of shard 0, 1, … in order
                if p == me:
                    pieces.append(work.local_input().reshape(-1).to(self.wire_dtype(work)))
                else:
                    size = plan.units[u].chunk_bytes(p) // plan.units[u].itemsize
                    pieces.append(received[p][offsets[p] : offsets[p] + size])
                    offsets[p] += size
            inputs[u] = torch.cat(pieces).reshape(work.count, work.m, work.n)
        return self._orthogonalize_inputs(inputs, works, plan.units)

    def _orthogonalize_inputs(self, inputs: dict[int, Tensor], works, units) -> dict[int, Tensor]:
        """Orthogonalize whole inputs (index → (count, m, n)); same-shape, same-config pieces —
        whole matrices, or the row blocks of fused ones — share one batched call."""
        batches: dict[tuple, list[tuple[int, int, int]]] = {}
        for u in inputs:
            work, start = works[u], 0
            for b, (rows, config) in enumerate([(b.rows, b.config) for b in work.blocks] or [(work.m, work.config)]):
                batches.setdefault((rows, work.n, config), []).append((u, b, start))
                start += rows
            self.stats.ns_flops += units[u].flops
        pieces: dict[tuple[int, int], Tensor] = {}
        for (rows, _, config), members in batches.items():
            stacked = torch.cat([inputs[u][:, start : start + rows] for u, _, start in members])
            with _Timed(self.stats, stacked.device):
                results = self.orthogonalize(stacked, config).split([works[u].count for u, _, _ in members])
            pieces.update(((u, b), r) for (u, b, _), r in zip(members, results))
            self.stats.matrices_orthogonalized += stacked.shape[0]
        outputs: dict[int, Tensor] = {}
        for u in inputs:
            blocks = works[u].blocks
            outputs[u] = pieces[u, 0] if not blocks else \
                torch.cat([pieces[u, b] * block.scale for b, block in enumerate(blocks)], dim=1)
        return outputs

    # ------------------------------------------------------------------ return

    def _start_return(self, plan: Plan, k: int, works, owned, group, me: int) -> PendingExchange | None:
        bucket = plan.buckets[k]
        if not any(plan.return_targets(u) for u in bucket):
            return None
        sends: list[list[Tensor]] = [[] for _ in range(plan.size)]
        recv_splits = [0] * plan.size
        for u in bucket:
            owner, layout = plan.owners[u], plan.units[u].layout
            if owner == me:
                for p in plan.return_targets(u):
                    sends[p].append(_rows(owned[u], layout, p % layout.shards))
            elif me in plan.return_targets(u):
                recv_splits[owner] += plan.units[u].chunk_bytes(me) // plan.units[u].itemsize
        dtype = self.wire_dtype(works[bucket[0]])
        return start_all_to_all(sends, recv_splits, group, me, dtype, self.counter)

    def _finish_return(self, plan: Plan, k: int, pending, owned, works, me: int) -> None:
        received = pending.wait() if pending is not None else None
        offsets = [0] * plan.size
        for u in plan.buckets[k]:
            work, layout, owner = works[u], plan.units[u].layout, plan.owners[u]
            if owner == me:
                piece = _rows(owned[u], layout, me % layout.shards)
            else:
                size = plan.units[u].chunk_bytes(me) // plan.units[u].itemsize
                piece = received[owner][offsets[owner] : offsets[owner] + size]
                offsets[owner] += size
            work.apply(piece.reshape(work.local_shape))
