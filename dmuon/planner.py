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
:func:`choose_gangs` then splits the largest ones over disjoint *gangs* of ranks that
orthogonalize each together (distributed NS on slices of its long side), where that lowers the
makespan; :func:`choose_distributed` splits 1-D sharded matrices over their whole group in place.

Buckets cut the LPT order into pieces of about ``bucket_bytes`` of NS input per owner, so that
the exchange of bucket k+1 overlaps the orthogonalization of bucket k, every rank computes in
every bucket, and transient memory per rank stays bounded.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch

from dmuon.layout import Layout, chunk_size_vector
from dmuon.orthogonalization import NSConfig, gram_all_reduces, newton_schulz_flops

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
        the imbalance."""
        ranks = self.units[0].layout.group_ranks if self.units else range(self.size)
        lines = [f"exchange: {self.strategy}",
                 f"{'rank':>4}  {'matrices':>8}  {'NS GFLOP':>9}  {'MB out':>8}  {'MB in':>8}"]
        for p in range(self.size):
            lines.append(
                f"{ranks[p]:>4}  {self.matrices(p):>8}  {self.flops(p) / 1e9:>9.3f}  "
                f"{self.bytes_sent(p) / 2**20:>8.2f}  {self.bytes_received(p) / 2**20:>8.2f}"
            )
        lines.append(f"imbalance (max/mean NS FLOPs): {self.imbalance:.3f}; buckets: {len(self.buckets)}")
        return "\n".join(lines)


def exchange_kind(layout: Layout) -> str:
    """How the matrices of an exchange group of ``layout`` reach their owners, in a few words
    (a row-wise tensor-parallel matrix's row exchange is its transpose's)."""
    if layout.size == 1:
        return "no exchange: each rank its own matrices"
    if layout.pieces:
        return f"pieces exchange over {layout.size} ranks"
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


def column_block_flops(count: int, m: int, n: int, config: NSConfig, shards: int) -> int:
    """NS FLOPs of each of ``shards`` ranks orthogonalizing ``count`` m×n matrices together on
    their own column blocks (Gram side m; :func:`dmuon.orthogonalization.orthogonalize_column_blocks`)."""
    return count * newton_schulz_flops(m, -(-n // shards), steps=config.steps, method=config.method,
                                       restarts=config.restarts, gram_side=m)


def column_block_cost(count: int, m: int, n: int, config: NSConfig, shards: int,
                      flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE) -> float:
    """What every rank of a group of ``shards`` pays when ``count`` m×n matrices (Gram side m)
    run distributed NS on their column blocks: :func:`column_block_flops` and the all-reduces
    of the fp32 Gram matrices (:func:`distributed_cost`)."""
    return distributed_cost(column_block_flops(count, m, n, config, shards), 4 * count * m**2,
                            gram_all_reduces(config), shards, flops_per_byte)


def distributed_cost(blocks_flops: int, gram_bytes: int, all_reduces: int, size: int,
                     flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE) -> float:
    """Time-equivalent (in FLOPs) that *every* rank of a group of ``size`` pays when a matrix is
    orthogonalized there with distributed NS on the ranks' own column blocks: its share of the
    products, the repeated small-side recurrence (``blocks_flops``), and ``all_reduces``
    all-reduces of ``gram_bytes``."""
    return blocks_flops + flops_per_byte * all_reduces * 2 * (size - 1) / size * gram_bytes


def choose_distributed(units: Sequence[Unit], costs: Sequence[float | None], size: int, replicas: int = 1, *,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                       flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE) -> frozenset[int]:
    """The units to split across the whole group — distributed NS, each rank paying ``costs[i]``
    (None: not possible for that unit) — instead of giving each to one owner.

    The candidates are taken costliest first; of the prefixes (split the k costliest, k = 0, 1,
    …) the one with the lowest makespan wins — the busiest rank's cost: :meth:`Plan.makespan_cost`
    of the units left to owners plus what every rank pays for the split ones. (Splitting one of
    two large matrices gains nothing while the other remains the floor; both together may.) It
    pays when there are fewer matrices than ranks or one matrix is far larger than the rest.
    """
    def makespan(split: frozenset[int]) -> float:
        rest = [u for i, u in enumerate(units) if i not in split]
        owned = make_plan(rest, size, replicas, bucket_bytes=bucket_bytes,
                          flops_per_byte=flops_per_byte).makespan_cost(flops_per_byte) if rest else 0.0
        return owned + sum(costs[i] for i in split)

    owner_costs = [owner_cost(u, size, flops_per_byte) for u in units]
    candidates = [i for i in costliest_first(owner_costs, [u.name for u in units]) if costs[i] is not None]
    chosen: frozenset[int] = frozenset()
    best = makespan(chosen)
    for k in range(1, len(candidates) + 1):
        trial = frozenset(candidates[:k])
        if sum(costs[i] for i in trial) >= best:
            break  # the split units alone already cost more, and more of them only add
        cost = makespan(trial)
        if cost < best:
            chosen, best = trial, cost
    return chosen


def gang_slice_elements(unit: Unit, k: int) -> int:
    """Elements of one member's slice when ``unit`` is split over a gang of ``k``: the short side
    by its share of the long side (the largest share, ⌈long/k⌉)."""
    short, long = sorted((unit.m, unit.n))
    return unit.count * short * -(-long // k)


def gang_member_flops(unit: Unit, config: NSConfig, k: int) -> int:
    """NS FLOPs of one member of a gang of ``k``: the products on its slice of the long side,
    and the short-side recurrence every member repeats."""
    short, long = sorted((unit.m, unit.n))
    return unit.count * newton_schulz_flops(short, -(-long // k), steps=config.steps, method=config.method,
                                            restarts=config.restarts, gram_side=short)


def gang_member_cost(unit: Unit, config: NSConfig, k: int, flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE
                     ) -> float | None:
    """Time-equivalent (in FLOPs) each member of a gang of ``k`` pays for orthogonalizing
    ``unit`` together (:func:`choose_gangs`): its NS products (:func:`gang_member_flops`), the
    all-reduces of the short-side Gram matrix (fp32), and receiving its slice and sending its
    update back. None where the long side has fewer rows or columns than members, or the
    matrix is empty (nothing to split)."""
    short = min(unit.m, unit.n)
    if k > max(unit.m, unit.n) or short == 0:
        return None
    gram_bytes = 4 * unit.count * short**2
    return (distributed_cost(gang_member_flops(unit, config, k), gram_bytes, gram_all_reduces(config), k,
                             flops_per_byte)
            + flops_per_byte * gang_slice_elements(unit, k) * (unit.itemsize + unit.back_itemsize))


def gang_costs(units: Sequence[Unit], configs: Sequence[NSConfig], flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE
               ) -> Callable[[int, int], float | None]:
    """:func:`gang_member_cost` as :func:`choose_gangs` takes it: (unit index, gang size) → cost."""
    return lambda i, k: gang_member_cost(units[i], configs[i], k, flops_per_byte)


def choose_gangs(units: Sequence[Unit], member_cost: Callable[[int, int], float | None], size: int,
                 replicas: int = 1, *, flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE
                 ) -> dict[int, tuple[int, ...]]:
    """The units to split over *gangs* of ranks, and each one's gang (positions): unit index →
    positions. ``member_cost(i, k)`` is what each member pays for unit i in a gang of k
    (:func:`gang_costs`), None where unit i cannot be split.

    The split units run first, each gang on its own ranks, all gangs at once (gangs are
    disjoint: consecutive positions, k each); then the other units go to owners as usual. The
    makespan of a choice is the costliest gang, plus every position sending its rows of the
    split units and receiving its rows of their updates, plus the busiest position's load from
    the rest (LPT, as :func:`make_plan`; its bytes estimated per position). Candidates are
    taken costliest first; tried are gang sizes k = 2, 4, 8, … and the whole group, each with
    as many units as fit (size // k) or fewer, cut where the unit cost changes (same-shape
    matrices are split all or none). No split wins unless it lowers the makespan: it pays when
    there are fewer matrices than ranks or one matrix is far larger than the rest.
    """
    shards = size // replicas
    owner_costs = [owner_cost(u, size, flops_per_byte) for u in units]
    names = [u.name for u in units]
    order = [i for i in costliest_first(owner_costs, names) if member_cost(i, 2) is not None]

    def owned_makespan(rest: list[int]) -> float:
        # a fast stand-in for make_plan(...).makespan_cost (thousands of ranks, tens of trials):
        # the busiest owner's LPT load, plus every position's rows of every unit out and back
        if not rest:
            return 0.0
        owners, _ = balance_owners([owner_costs[i] for i in rest], [names[i] for i in rest], size)
        loads = [0.0] * size
        for i, owner in zip(rest, owners):
            loads[owner] += owner_costs[i]
        return max(loads) + flops_per_byte * sum(-(-units[i].round_trip_bytes // shards) for i in rest)

    def makespan(split: Sequence[int], k: int) -> float:
        chosen = set(split)
        moved = sum(-(-units[i].round_trip_bytes // shards) for i in split)
        return (owned_makespan([i for i in range(len(units)) if i not in chosen])
                + max(member_cost(i, k) for i in split) + flops_per_byte * moved)

    best, choice = owned_makespan(list(range(len(units)))), ((), 0)
    levels = {t for t in range(1, len(order)) if owner_costs[order[t]] != owner_costs[order[t - 1]]}
    sizes = sorted({2**e for e in range(1, size.bit_length()) if 2**e <= size} | ({size} if size > 1 else set()))
    for k in sizes:
        fits = min(len(order), size // k)
        for t in sorted({t for t in levels if t <= fits} | ({fits} if fits else set())):
            if any(member_cost(i, k) is None for i in order[:t]):
                continue
            cost = makespan(order[:t], k)
            if cost < best:
                best, choice = cost, (tuple(order[:t]), k)
    split, k = choice
    return {i: tuple(range(g * k, (g + 1) * k)) for g, i in enumerate(split)}


def split_replicas_is_cheaper(units: Sequence[Unit], flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE) -> bool:
    """HSDP: should the R replica groups split the units between them (each matrix computed
    once, but updates cross replicas) rather than each replica group computing all of them?

    Compares the busiest rank's cost (:meth:`Plan.makespan_cost`) of the two plans; units are
    given in the split form (layouts with R replicas × S shards). Without replicas: False.
    """
    if not units or units[0].layout.replicas == 1:
        return False
    layout = units[0].layout
    replicas, shards = layout.replicas, layout.shards
    split = make_plan(units, replicas * shards, replicas, flops_per_byte=flops_per_byte)
    alone_units = [
        replace(u, layout=replace(u.layout, replicas=1, group_ranks=u.layout.group_ranks[:shards])) for u in units
    ]
    alone = make_plan(alone_units, shards, 1, flops_per_byte=flops_per_byte)
    return split.makespan_cost(flops_per_byte) < alone.makespan_cost(flops_per_byte)


# ---------------------------------------------------------------------------- the choices, in order


@dataclass(frozen=True)
class MatrixOptions:
    """One Muon matrix as :func:`choose` sees it: the two ways its layout may be owned whole,
    and what else could be done with it."""

    shared: Unit  # owned whole, HSDP replica groups sharing the work (the layout as the ranks hold it)
    per_replica: Unit  # owned whole, each HSDP replica group doing all its work (``shared`` without HSDP)
    config: NSConfig  # its Newton–Schulz recipe, owned whole
    wire: str  # the dtype its values cross the network in: an exchange group never mixes two
    # what every rank pays when its group runs distributed NS on its column blocks
    # (:func:`column_block_cost`); None where it cannot: not a 1-D sharded, unfused DTensor matrix
    column_block_cost: float | None = None
    splittable: bool = False  # one unfused 2-D matrix with a process group: a gang could split it


@dataclass(frozen=True)
class Choices:
    """What :func:`choose` decided: whether HSDP replica groups share the work, the matrices run
    as distributed NS on their column blocks, and those split over gangs (index → positions)."""

    split_replicas: bool
    column_blocks: frozenset[int] = frozenset()
    gangs: dict[int, tuple[int, ...]] = field(default_factory=dict)


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
    planned exchange of each exchange group, then the pieces exchange of each (an owner
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


def column_blocks_fit(layout: Layout) -> bool:
    """Whether a matrix held as ``layout`` can run distributed NS in place: its rows split over
    one group of several ranks, no replicas, whole rows on each rank."""
    return (not layout.pieces or layout.rows_partitioned) and layout.replicas == 1 and layout.shards > 1


def choose(matrices: Sequence[MatrixOptions], *, replica_split: bool | None = None,
           distributed_ns: bool | None = None, ready_order: bool = False,
           bucket_bytes: int = DEFAULT_BUCKET_BYTES, flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE) -> Choices:
    """Every choice the cost model makes for a step, in order; ``dmuon.Muon``'s step plan and
    ``dmuon plan``'s cost model both call it, so they cannot disagree.

    1. HSDP (``replica_split=None``): whether the replica groups share the work
       (:func:`split_replicas_is_cheaper`).
    2. With ``distributed_ns=None``, per exchange group, the 1-D sharded matrices that run
       distributed NS on their column blocks (:func:`choose_distributed`; ``True``: all that can);
       ``False``, or ``None`` where early start runs (``ready_order``), keeps every matrix whole.
    3. With ``distributed_ns=None``, per exchange group, the matrices split over gangs
       (:func:`choose_gangs`).
    """
    split_replicas = replica_split
    if split_replicas is None:
        shared = [m.shared for m in matrices]
        hsdp = any(u.layout.replicas > 1 and u.layout.shards > 1 for u in shared)
        split_replicas = not hsdp or split_replicas_is_cheaper(shared, flops_per_byte)
    units = [m.shared if split_replicas else m.per_replica for m in matrices]
    if distributed_ns is False or (distributed_ns is None and ready_order):
        return Choices(split_replicas)
    wires = [m.wire for m in matrices]
    costs = [m.column_block_cost if m.column_block_cost is not None and column_blocks_fit(u.layout) else None
             for m, u in zip(matrices, units)]
    column_blocks: frozenset[int] = frozenset(i for i, c in enumerate(costs) if c is not None)
    if distributed_ns:
        return Choices(split_replicas, column_blocks)
    if column_blocks:
        column_blocks = frozenset(
            members[j]
            for members in exchange_groups([u.layout for u in units], wires)
            for j in choose_distributed([units[i] for i in members], [costs[i] for i in members],
                                        units[members[0]].layout.size, units[members[0]].layout.replicas,
                                        bucket_bytes=bucket_bytes, flops_per_byte=flops_per_byte))
    eligible = [i for i, (m, u) in enumerate(zip(matrices, units))
                if m.splittable and i not in column_blocks and u.layout.size > 1 and not u.layout.pieces]
    gangs: dict[int, tuple[int, ...]] = {}
    for members in exchange_groups([units[i].layout for i in eligible], [wires[i] for i in eligible]):
        group = [eligible[i] for i in members]
        group_units = [units[i] for i in group]
        layout = group_units[0].layout
        chosen = choose_gangs(group_units, gang_costs(group_units, [matrices[i].config for i in group], flops_per_byte),
                              layout.size, layout.replicas, flops_per_byte=flops_per_byte)
        gangs.update((group[j], gang) for j, gang in chosen.items())
    return Choices(split_replicas, column_blocks, gangs)
