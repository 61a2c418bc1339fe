"""Who orthogonalizes which matrix, in which order. Pure: takes sizes and a group shape, never a
process group, so every rank computes the same plan and tests need no processes.

Each Muon parameter is one *unit*: ``count`` matrices of m×n (an expert stack is one unit, so
its matrices stay together and run as one batched call). A unit gets one owner position in its
exchange group (see :mod:`dmuon.layout`); the owner gathers the unit's rows, orthogonalizes the
whole unit and sends every rank its rows of the update back.

Balancing is LPT (longest processing time first): units sorted by cost, largest first, each
given to the position with the least load so far. The cost of owning a unit is its
Newton–Schulz FLOPs (for the method that will actually run) plus the bytes the owner receives
and sends, converted at ``flops_per_byte``. Ties break on the unit's name, never on the order
parameters were passed in. Units of the same shape thus spread round-robin; those that land on
one owner in one bucket are stacked into one batched call at run time. No matrix is padded.

When there are fewer matrices than ranks, or one far larger than the rest, whole-matrix
ownership leaves ranks idle and the step can be no faster than the largest matrix:
:func:`dmuon.choices.choose_gangs` then splits the largest ones over disjoint *gangs* of ranks
that orthogonalize each together (distributed NS on slices of its long side), where that lowers
the makespan; :func:`dmuon.choices.choose_distributed` splits 1-D sharded matrices over their
whole group in place (the cost model's choices: :mod:`dmuon.choices`).

Buckets cut the LPT order into pieces of about ``bucket_bytes`` of NS input per owner, so that
the exchange of bucket k+1 overlaps the orthogonalization of bucket k, every rank computes in
every bucket, and transient memory per rank stays bounded.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from dmuon.layout import Layout, chunk_size_vector

DEFAULT_BUCKET_BYTES = 8 * 2**20
READY_BUCKETS = 8  # early start's plan: about this many buckets at most (ready_buckets)
# Cost-model exchange rate: one byte moved by the owner costs as much time as this many FLOPs
# (≈ a CPU core's ~100 GFLOP/s against ~1 GB/s of loopback gloo; a GPU's ratio is similar:
# ~800 TFLOP/s against ~50–450 GB/s). Only the relative cost of owners matters here.
DEFAULT_FLOPS_PER_BYTE = 100.0
# Bytes that cross HSDP replica groups usually cross nodes: InfiniBand NDR ≈ 50 GB/s per GPU
# against NVLink ≈ 450 GB/s per direction (docs/hardware.md), so they cost 9× more.
CROSS_REPLICA_COST_FACTOR = 9.0


@dataclass(frozen=True)
class Unit:
    """One Muon parameter as the planner sees it."""

    name: str
    layout: Layout
    count: int  # matrices in the parameter
    m: int
    n: int
    itemsize: int  # bytes per element on the wire to the owner
    flops: int  # Newton–Schulz FLOPs for all its matrices
    return_itemsize: int | None = None  # bytes per element of the update on its way back (None: itemsize)
    blocks: str = ""  # a fused weight's row blocks, each orthogonalized on its own (dmuon.row_blocks), described

    @property
    def back_itemsize(self) -> int:
        """Bytes per element of the update on its way back from the owner."""
        return self.return_itemsize or self.itemsize

    def _itemsize(self, returned: bool) -> int:
        return self.back_itemsize if returned else self.itemsize

    def chunk_bytes(self, position: int, *, returned: bool = False) -> int:
        """Bytes of this unit held by the rank at ``position`` of the exchange group (of its
        update on the way back, with ``returned``)."""
        shard = position % self.layout.shards
        return self.layout.chunk_rows(shard) * self.layout.row_numel * self._itemsize(returned)

    def chunk_bytes_by_position(self, *, returned: bool = False) -> torch.Tensor:
        """:meth:`chunk_bytes` of every position, as an int64 vector."""
        per_shard = chunk_size_vector(self.layout.shape[0], self.layout.shards)
        return (per_shard * self.layout.row_numel * self._itemsize(returned)).repeat(self.layout.replicas)

    @property
    def total_bytes(self) -> int:
        return self.count * self.m * self.n * self.itemsize

    @property
    def round_trip_bytes(self) -> int:
        """Bytes of the whole unit to its owner and of its update back."""
        return self.count * self.m * self.n * (self.itemsize + self.back_itemsize)


@dataclass(frozen=True)
class Plan:
    """Owners and buckets for the units of one exchange group (identical on every rank)."""

    units: tuple[Unit, ...]
    owners: tuple[int, ...]  # owner position of each unit
    buckets: tuple[tuple[int, ...], ...]  # unit indices, in execution order
    size: int  # positions in the exchange group
    replicas: int

    # ------------------------------------------------------------- who sends what to whom

    def replica_block(self, unit: int) -> range:
        """The positions of the owner's replica group: together they hold every row of ``unit``."""
        shards = self.size // self.replicas
        first = self.owners[unit] // shards * shards
        return range(first, first + shards)

    def gather_sources(self, unit: int) -> list[int]:
        """Positions that send their rows of ``unit`` to its owner: the owner's replica's shards."""
        return [p for p in self.replica_block(unit) if p != self.owners[unit]]

    def return_targets(self, unit: int) -> list[int]:
        """Positions that receive their rows of the update from the owner: everyone else."""
        return [p for p in range(self.size) if p != self.owners[unit]]

    def bytes_sent(self, position: int) -> int:
        """Bytes the rank at ``position`` sends per step (gathers and returns)."""
        return self._traffic[0][position]

    def bytes_received(self, position: int) -> int:
        return self._traffic[1][position]

    def cross_replica_bytes(self, position: int) -> int:
        """Of the bytes sent and received by ``position``, those to or from other replicas."""
        return self._traffic[2][position]

    @cached_property
    def _traffic(self) -> tuple[list[int], list[int], list[int]]:
        # Vectorized over positions (a plan may span thousands of ranks); same rule as
        # gather_sources / return_targets: the owner's replica sends it its rows, and the
        # owner returns every other position its rows.
        sent = torch.zeros(self.size, dtype=torch.int64)
        received = torch.zeros(self.size, dtype=torch.int64)
        cross = torch.zeros(self.size, dtype=torch.int64)  # only returns cross replicas
        for u, (unit, owner) in enumerate(zip(self.units, self.owners)):
            chunk, back = unit.chunk_bytes_by_position(), unit.chunk_bytes_by_position(returned=True)
            own, own_back = int(chunk[owner]), int(back[owner])
            block = slice(self.replica_block(u).start, self.replica_block(u).stop)
            sent[block] += chunk[block]
            sent[owner] -= own
            received[owner] += int(chunk[block].sum()) - own
            received += back
            received[owner] -= own_back
            sent[owner] += int(back.sum()) - own_back
            outside = back.clone()
            outside[block] = 0
            cross += outside
            cross[owner] += int(outside.sum())
        return sent.tolist(), received.tolist(), cross.tolist()

    def makespan_cost(self, flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE) -> float:
        """The busiest position's NS FLOPs plus its bytes in and out at ``flops_per_byte``
        (bytes crossing replica groups at CROSS_REPLICA_COST_FACTOR times that)."""
        cross_extra = flops_per_byte * (CROSS_REPLICA_COST_FACTOR - 1)
        return max(
            self.flops(p)
            + flops_per_byte * (self.bytes_sent(p) + self.bytes_received(p))
            + cross_extra * self.cross_replica_bytes(p)
            for p in range(self.size)
        )

    # ------------------------------------------------------------- balance

    @cached_property
    def _loads(self) -> tuple[list[int], list[int]]:
        flops, matrices = [0] * self.size, [0] * self.size
        for unit, owner in zip(self.units, self.owners):
            flops[owner] += unit.flops
            matrices[owner] += unit.count
        return flops, matrices

    def flops(self, position: int) -> int:
        """NS FLOPs of the units the rank at ``position`` owns."""
        return self._loads[0][position]

    def matrices(self, position: int) -> int:
        return self._loads[1][position]

    @property
    def imbalance(self) -> float:
        """max/mean NS FLOPs over positions (1.0 is perfect)."""
        loads = self._loads[0]
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean else 1.0

    @property
    def strategy(self) -> str:
        """How the group's matrices reach their owners (:func:`exchange_kind`)."""
        return exchange_kind(self.units[0].layout) if self.units else "no matrices"

    def table(self) -> str:
        """The strategy; per rank (global rank): matrices owned, NS GFLOPs, MB out and in; then
        the imbalance, and each fused weight's row blocks and owner."""
        ranks = self.units[0].layout.group_ranks if self.units else range(self.size)
        lines = [f"exchange: {self.strategy}",
                 f"{'rank':>4}  {'matrices':>8}  {'NS GFLOP':>9}  {'MB out':>8}  {'MB in':>8}"]
        for p in range(self.size):
            lines.append(
                f"{ranks[p]:>4}  {self.matrices(p):>8}  {self.flops(p) / 1e9:>9.3f}  "
                f"{self.bytes_sent(p) / 2**20:>8.2f}  {self.bytes_received(p) / 2**20:>8.2f}"
            )
        lines.append(f"imbalance (max/mean NS FLOPs): {self.imbalance:.3f}; buckets: {len(self.buckets)}")
        lines += [f"fused: {u.name} ({u.count} x {u.m}x{u.n}) in {u.blocks}, owner {ranks[owner]}"
                  for u, owner in zip(self.units, self.owners) if u.blocks]
        return "\n".join(lines)


def exchange_kind(layout: Layout) -> str:
    """How the matrices of an exchange group of ``layout`` reach their owners, in a few words
    (a row-wise tensor-parallel matrix's row exchange is its transpose's)."""
    if layout.size == 1:
        return "no exchange: each rank its own matrices"
    if layout.pieces:
        return f"piece exchange over {layout.size} ranks"
    replicas = f", {layout.replicas} replicas" if layout.replicas > 1 else ""
    return f"row exchange over {layout.size} ranks{replicas}"


def owner_cost(unit: Unit, size: int, flops_per_byte: float) -> float:
    """Time-equivalent (in FLOPs) of owning ``unit``: NS plus the bytes the owner moves."""
    moved = unit.round_trip_bytes * (size - 1) / size if size > 1 else 0
    return unit.flops + flops_per_byte * moved


def costliest_first(costs: Sequence[float], names: Sequence[str]) -> list[int]:
    """Item indices by decreasing cost, ties broken by name: never by the order items came in."""
    return sorted(range(len(costs)), key=lambda i: (-costs[i], names[i]))


def balance_owners(costs: Sequence[float], names: Sequence[str], size: int) -> tuple[list[int], list[int]]:
    """LPT: give each item, costliest first (ties broken by name), to the position with the least
    load so far. Returns (owner of each item, the order items were placed in)."""
    order = costliest_first(costs, names)
    least_loaded = [(0.0, p) for p in range(size)]  # a heap: (load, position)
    owners = [0] * len(costs)
    for i in order:
        load, owner = heapq.heappop(least_loaded)
        owners[i] = owner
        heapq.heappush(least_loaded, (load + costs[i], owner))
    return owners, order


def plan_ownership(names: Sequence[str], flops: Sequence[int], nbytes: Sequence[int], size: int) -> list[int]:
    """Owner-sharded data parallel: the owner position of each whole parameter.

    An owner does the parameter's Newton–Schulz *and* keeps its weight, gradient and momentum,
    so both must balance: each parameter costs its share of the total NS FLOPs plus its share of
    the total bytes, and LPT balances that sum.
    """
    total_flops, total_bytes = max(sum(flops), 1), max(sum(nbytes), 1)
    costs = [f / total_flops + b / total_bytes for f, b in zip(flops, nbytes)]
    return balance_owners(costs, names, size)[0]


def make_plan(
    units: Sequence[Unit],
    size: int,
    replicas: int = 1,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE,
    owners: Sequence[int] | None = None,
    ready_order: bool = False,
) -> Plan:
    """Assign an owner position to every unit (LPT, unless ``owners`` are given) and cut the
    order into buckets: the LPT order, or with ``ready_order`` the order in which the backward
    pass finishes the gradients (:func:`ready_buckets`)."""
    if size < 1 or replicas < 1 or size % replicas:
        raise ValueError(f"Invalid group shape: {size=} positions, {replicas=} replicas.")
    if bucket_bytes <= 0:
        raise ValueError(f"Invalid {bucket_bytes=}. Must be > 0.")
    costs = [owner_cost(u, size, flops_per_byte) for u in units]
    if ready_order and owners is None:
        owners, buckets = ready_buckets(units, costs, size, bucket_bytes)
        return Plan(tuple(units), tuple(owners), tuple(buckets), size, replicas)
    if owners is None:
        owners, order = balance_owners(costs, [u.name for u in units], size)
    else:
        owners, order = list(owners), costliest_first(costs, [u.name for u in units])
    # Buckets hold about ``bucket_bytes`` of NS input *per owner*: a bucket closes only when an
    # owner that already has work in it would go over, so every bucket gives every rank work
    # (one LPT round at least) and NS runs on all ranks at once, even when one matrix alone is
    # larger than the budget.
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    per_owner: dict[int, int] = {}
    for i in order:
        owner, unit_bytes = owners[i], units[i].total_bytes
        if per_owner.get(owner, 0) and per_owner[owner] + unit_bytes > bucket_bytes:
            buckets.append(tuple(current))
            current, per_owner = [], {}
        current.append(i)
        per_owner[owner] = per_owner.get(owner, 0) + unit_bytes
    if current:
        buckets.append(tuple(current))
    return Plan(tuple(units), tuple(owners), tuple(buckets), size, replicas)


def ready_buckets(units: Sequence[Unit], costs: Sequence[float], size: int,
                  bucket_bytes: int) -> tuple[list[int], list[tuple[int, ...]]]:
    """Early start's plan: buckets in the order the backward pass finishes gradients (the units'
    order reversed, as units come in the model's order), each balanced on its own.

    A bucket closes once it holds at least one unit per position, a ``READY_BUCKETS``-th of all
    units, and about ``bucket_bytes`` of NS input per position; then LPT gives its units owners,
    the least loaded in this bucket first and, among equals, the least loaded so far. Balance
    per bucket is what counts: every bucket's exchange waits for its slowest owner, so buckets
    must be large enough to balance; at most about ``READY_BUCKETS`` of them still let early
    start begin all but the last in the backward pass. (Simulated for Llama-3.1-8B and -70B on
    8 to 512 H100s, ``dmuon plan``: one unit per position alone balanced 8 ranks worse than the
    cost order did.) Returns (owner of each unit, buckets)."""
    buckets: list[tuple[int, ...]] = []
    current: list[int] = []
    nbytes = 0
    for i in reversed(range(len(units))):
        current.append(i)
        nbytes += units[i].total_bytes
        if len(current) >= max(size, -(-len(units) // READY_BUCKETS)) and nbytes >= size * bucket_bytes:
            buckets.append(tuple(current))
            current, nbytes = [], 0
    if current:
        buckets.append(tuple(current))
    owners, total = [0] * len(units), [0.0] * size
    for bucket in buckets:
        heap = [(0.0, 0.0, p) for p in range(size)]  # (load in this bucket, load so far, position)
        for j in costliest_first([costs[i] for i in bucket], [units[i].name for i in bucket]):
            i = bucket[j]
            load, _, p = heapq.heappop(heap)
            owners[i] = p
            total[p] += costs[i]
            heapq.heappush(heap, (load + costs[i], total[p], p))
    return owners, buckets




def exchange_groups(layouts: Sequence[Layout], wires: Sequence[str]) -> list[list[int]]:
    """Indices per exchange group and wire dtype (a bucket never mixes dtypes), larger groups
    first, then by ranks: the same order on every rank, so no rank waits in one group while its
    peer waits in another."""
    groups: dict[tuple, list[int]] = {}
    for i, (layout, wire) in enumerate(zip(layouts, wires)):
        groups.setdefault((-layout.size, layout.group_ranks, layout.replicas, wire), []).append(i)
    return [groups[key] for key in sorted(groups)]


def exchange_plans(units: Sequence[Unit], wires: Sequence[str], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE,
                   ready_order: bool = False) -> list[tuple[list[int], Plan]]:
    """The units each orthogonalized whole by one owner, grouped as the engine runs them: the
    row exchange of each exchange group, then the piece exchange of each (an owner
    receives a whole unit either way, so both plan alike: :func:`make_plan`); per group, its
    unit indices and its plan."""
    plans = []
    for pieces in (False, True):
        kind = [i for i, u in enumerate(units) if u.layout.pieces == pieces]
        for members in exchange_groups([units[i].layout for i in kind], [wires[i] for i in kind]):
            indices = [kind[j] for j in members]
            layout = units[indices[0]].layout
            plans.append((indices, make_plan([units[i] for i in indices], layout.size, layout.replicas,
                                             bucket_bytes=bucket_bytes, flops_per_byte=flops_per_byte,
                                             ready_order=ready_order)))
    return plans


