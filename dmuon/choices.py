"""The cost model's choices, in order (:func:`choose`): whether HSDP replicas split the work,
which 1-D sharded matrices run distributed Newton–Schulz on their column blocks, and which
matrices are split over gangs of ranks. Pure, like :mod:`dmuon.planner`, whose costs it compares:
the step plan and ``dmuon plan`` call the same function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from dmuon.column_block_ns import gram_all_reduces
from dmuon.layout import Layout
from dmuon.orthogonalization import NSConfig, newton_schulz_flops
from dmuon.planner import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FLOPS_PER_BYTE,
    Unit,
    balance_owners,
    costliest_first,
    exchange_groups,
    make_plan,
    owner_cost,
)


def column_block_flops(count: int, m: int, n: int, config: NSConfig, shards: int) -> int:
    """NS FLOPs of each of ``shards`` ranks orthogonalizing ``count`` m×n matrices together on
    their own column blocks (Gram side m; :func:`dmuon.column_block_ns.orthogonalize_column_blocks`)."""
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
