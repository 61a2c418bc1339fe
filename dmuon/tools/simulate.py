"""Simulates dmuon's optimizer step as :mod:`dmuon.step.engine` runs the plan, and predicts step times.

Every rank has a compute timeline (a vector over ranks); collectives run one after the other on
one communication stream, each starting once every rank has issued it (the slowest rank gates
an all-to-all). The engine's loop, per bucket k::

    compute the NS inputs of the rows this rank sends in bucket k+1, pack them; issue gather(k+1)
    wait gather(k); assemble and orthogonalize the matrices this rank owns in k; pack; issue return(k)
    wait return(k−1); apply its updates

so gather k+1 overlaps NS k and return k overlaps NS k+1 (at most two buckets in flight). An
all-to-all takes one latency plus the busiest rank's bytes over its links: bytes to and from
ranks of the same node (nodes of ``ranks_per_node`` consecutive ranks) over the intra-node link,
the others over the inter-node link, both links and both directions at once. Where the hardware
does not overlap communication with compute (CPU), every collective stalls all ranks until it
completes: gloo moves data on the cores the ranks compute on, so an all-to-all progresses when
every rank's core is free for it. (Measured at 4 ranks on 2 cores, this fits ``dmuon bench``
better than letting transfers run behind compute and only charging each rank its own bytes,
which predicted 25–38 % too little.)
Before the loop: the non-finite check, the momentum of every local Muon element, AdamW on the
other parameters, and the one all-reduce that agrees on skipped steps.

The simulation is deterministic, O(buckets · ranks), and is the optimizer term of
:func:`predict`, which adds forward+backward and the baselines from :mod:`dmuon.tools.costmodel`.

Early start (:mod:`dmuon.step.early`; in every mode: under DDP with dmuon's comm hook) is modelled
on top: the work of every bucket but the last may run during the backward pass (two thirds of
the forward+backward products), but only in the device time the backward pass leaves idle —
``HardwareProfile.backward_idle_fraction`` of it, 6 % on GPUs from one H200 measurement, 0 on
CPU. What stays after the backward pass is the last bucket's own step (simulated alone: the
step's fixed work, its exchange and Newton–Schulz, its apply) and the apply of the updates the
earlier buckets hold, so early start hides ``min(optimizer step − that, idle fraction ·
backward)``. Early start keeps every matrix whole (no gangs), so its optimizer step is the
whole-matrix plan's.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dmuon.column_block_ns import gram_all_reduces
from dmuon.orthogonalization import NSConfig
from dmuon.planner import Plan, Unit
from dmuon.tools.costmodel import (
    APPLY_BYTES,
    MOMENTUM_BYTES,
    NESTEROV_BYTES,
    SplitUnit,
    StagePlan,
    Workload,
    adamw_params,
    adamw_seconds,
    adamw_step_seconds,
    check_seconds,
    compute_seconds,
    data_parallel_copy_seconds,
    data_parallel_seconds,
    exposed_step_seconds,
    forward_backward_seconds,
    link,
    local_params,
    memory_seconds,
    muon_params,
    muon_units,
    normalize_bytes,
    ns_prep_bytes,
    ns_seconds,
    pack_bytes,
    stage_plan,
    vanilla_muon_step_seconds,
)
from dmuon.tools.models import trainable_params


@dataclass
class Traffic:
    """Bytes each rank sends and receives in one all-to-all, per link (int64 vectors over ranks)."""

    intra_out: Tensor
    intra_in: Tensor
    inter_out: Tensor
    inter_in: Tensor

    @classmethod
    def zeros(cls, size: int) -> Traffic:
        return cls(*(torch.zeros(size, dtype=torch.int64) for _ in range(4)))

    def add_to_owner(self, bytes_by_rank: Tensor, owner: int, same_node: Tensor) -> None:
        """Every rank sends ``bytes_by_rank`` to ``owner`` (a gather)."""
        intra, inter = _split(bytes_by_rank, same_node)
        self.intra_out += intra
        self.inter_out += inter
        self.intra_in[owner] += intra.sum()
        self.inter_in[owner] += inter.sum()

    def add_from_owner(self, bytes_by_rank: Tensor, owner: int, same_node: Tensor) -> None:
        """``owner`` sends every rank ``bytes_by_rank`` (a return)."""
        intra, inter = _split(bytes_by_rank, same_node)
        self.intra_in += intra
        self.inter_in += inter
        self.intra_out[owner] += intra.sum()
        self.inter_out[owner] += inter.sum()

    def add(self, other: Traffic) -> None:
        for name in ("intra_out", "intra_in", "inter_out", "inter_in"):
            getattr(self, name).add_(getattr(other, name))

    def link_seconds(self, workload: Workload) -> Tensor:
        """Per rank: the longer of its two links' busy times (each the larger direction)."""
        p, share = workload.profile, workload.share
        intra = torch.maximum(self.intra_out, self.intra_in).double() / (p.intra_bandwidth * share)
        inter = torch.maximum(self.inter_out, self.inter_in).double() / (p.inter_bandwidth * share)
        return torch.maximum(intra, inter)

    def seconds(self, workload: Workload) -> float:
        """Duration of the all-to-all: a latency plus its busiest rank's link time."""
        crosses = bool(self.inter_out.any() or self.inter_in.any())
        latency = workload.profile.inter_latency if crosses else workload.profile.intra_latency
        return latency + self.link_seconds(workload).max().item()


@dataclass
class BucketCost:
    """One bucket as the simulator sees it: its two all-to-alls (None where the engine issues
    none) and, per rank, the compute seconds before each."""

    gather: Traffic | None
    ret: Traffic | None
    gather_prep: Tensor  # NS inputs of the rows sent, packing; before the gather is issued
    owner: Tensor  # NS inputs of own rows, assembly, normalization, NS, packing the return
    apply: Tensor  # applying the returned rows


def node_of(workload: Workload) -> Tensor:
    """Node index of every rank of the (first) stage (ranks fill nodes in order)."""
    ranks = torch.arange(workload.group_size)
    per_node = workload.profile.ranks_per_node
    return ranks // per_node if per_node is not None else torch.zeros_like(ranks)


def chunk_vectors(plan: Plan, *, returned: bool = False) -> list[Tensor]:
    """:meth:`Unit.chunk_bytes_by_position` of every unit (of its update on the way back, with
    ``returned``), computed once per distinct layout and item size."""
    cache: dict[tuple, Tensor] = {}
    keys = [(u.layout, u.itemsize, u.return_itemsize) for u in plan.units]
    for u, key in zip(plan.units, keys):
        if key not in cache:
            cache[key] = u.chunk_bytes_by_position(returned=returned)
    return [cache[key] for key in keys]


def _split(bytes_by_rank: Tensor, same_node: Tensor) -> tuple[Tensor, Tensor]:
    return bytes_by_rank * same_node, bytes_by_rank * ~same_node


def bucket_costs(plan: Plan, configs: tuple[NSConfig, ...], workload: Workload) -> list[BucketCost]:
    """Traffic and per-rank compute of every bucket, following the engine and the plan.

    Gather: every other rank of the owner's replica sends the owner its rows. Return: the owner
    sends every other rank its rows. In owner mode the matrices already live on their owners:
    no collectives, and the owner does the momentum and apply of whole matrices.
    """
    size, node = plan.size, node_of(workload)[:plan.size]
    owner_mode = workload.mode == "owner"
    chunks, backs = chunk_vectors(plan), chunk_vectors(plan, returned=True)
    costs = []
    for bucket in plan.buckets:
        gather, ret = Traffic.zeros(size), Traffic.zeros(size)
        prep_bytes = torch.zeros(size, dtype=torch.float64)
        owner_bytes = torch.zeros(size, dtype=torch.float64)
        owner_seconds = torch.zeros(size, dtype=torch.float64)  # NS; in owner mode also the check
        apply_bytes = torch.zeros(size, dtype=torch.float64)
        for u in bucket:
            unit, owner, config = plan.units[u], plan.owners[u], configs[u]
            numel = unit.count * unit.m * unit.n
            owner_seconds[owner] += ns_seconds(unit.flops, config, workload)
            owner_bytes[owner] += numel * ns_prep_bytes(unit.itemsize, config.dtype)
            if owner_mode:
                owner_seconds[owner] += check_seconds(numel, workload)
                owner_bytes[owner] += numel * (MOMENTUM_BYTES + NESTEROV_BYTES + APPLY_BYTES)
                continue
            chunk = chunks[u]
            elements = (chunk // unit.itemsize).double()
            same = node == node[owner]
            senders = torch.zeros(size, dtype=torch.bool)
            senders[plan.gather_sources(u)] = True
            gather.add_to_owner(chunk * senders, owner, same)
            prep_bytes += elements * senders * (NESTEROV_BYTES + pack_bytes(unit.itemsize))
            others = torch.ones(size, dtype=torch.bool)
            others[owner] = False
            ret.add_from_owner(backs[u] * others, owner, same)
            returned = (elements * others).sum()
            # packing the returns reads the update and writes it in the return's dtype
            packed = (pack_bytes(unit.itemsize) + pack_bytes(unit.back_itemsize)) / 2
            owner_bytes[owner] += elements[owner] * NESTEROV_BYTES + returned * packed
            apply_bytes += elements * APPLY_BYTES
        has_gather = not owner_mode and any(plan.units[u].layout.shards > 1 for u in bucket)
        has_return = not owner_mode and size > 1
        costs.append(BucketCost(
            gather if has_gather else None, ret if has_return else None,
            memory_seconds(prep_bytes, workload),
            owner_seconds + memory_seconds(owner_bytes, workload),
            memory_seconds(apply_bytes, workload),
        ))
    return costs


def stage_costs(stage: StagePlan, workload: Workload) -> list[BucketCost]:
    """:func:`bucket_costs` of every group of the stage, in the engine's order."""
    return [cost for plan, configs in stage.groups for cost in bucket_costs(plan, configs, workload)]


def before_exchange_seconds(stage: StagePlan, workload: Workload) -> Tensor:
    """Per rank, before the first bucket: non-finite check of every local gradient, momentum of
    the local Muon elements (owner mode: done per matrix by its owner), AdamW on the rest."""
    muon = torch.zeros(workload.group_size, dtype=torch.float64)
    if workload.mode != "owner":
        for plan in stage.plans:  # a group of one rank's own stacks: every rank holds as many
            for unit, chunk in zip(plan.units, chunk_vectors(plan)):
                muon += (chunk // unit.itemsize).double()
    adamw_mode = "ddp" if workload.mode == "ddp" else "fsdp2"
    others = local_params(adamw_params(workload.config), workload, adamw_mode)
    check = check_seconds(others + muon, workload) + memory_seconds(MOMENTUM_BYTES * muon, workload)
    return check + adamw_seconds(others, workload)


class _Streams:
    """Per-rank compute clocks and one communication stream shared by the group."""

    def __init__(self, start: Tensor, workload: Workload) -> None:
        self.now = start.clone()
        self.comm_free = 0.0
        self.workload = workload

    def issue(self, traffic: Traffic | None, latency: float = 0.0) -> float:
        """Issue a collective (``traffic``, or a payload-free one of ``latency``) on every rank
        now; returns when it completes. It starts once the last rank has issued it and the
        stream is free. Where the hardware does not overlap communication with compute, the
        ranks stall until it completes."""
        duration = traffic.seconds(self.workload) if traffic is not None else latency
        start = max(self.comm_free, self.now.max().item())
        self.comm_free = start + duration
        if not self.workload.profile.comm_overlaps_compute:
            self.now.fill_(self.comm_free)
        return self.comm_free

    def wait(self, end: float | None) -> None:
        if end is not None:
            self.now.clamp_(min=end)


def simulate_optimizer_step(stage: StagePlan, workload: Workload, costs: list[BucketCost] | None = None) -> Tensor:
    """Seconds from the start of ``optimizer.step()`` to each rank's last applied update; of the
    stage's split matrices, those over gangs go first and those on column blocks last, as in the
    engine. The groups' buckets follow each other as one sequence (where the engine finishes one
    group before it starts the next: a little optimistic where there are several)."""
    costs = stage_costs(stage, workload) if costs is None else costs
    split = stage.split
    streams = _Streams(before_exchange_seconds(stage, workload) + gang_phase_seconds(split, workload), workload)
    if workload.world_size > 1:  # the all-reduce agreeing on skipped steps (blocking)
        profile = workload.profile
        streams.wait(streams.issue(None, profile.inter_latency if workload.multi_node else profile.intra_latency))

    def start_gather(k: int) -> float | None:
        streams.now += costs[k].gather_prep
        return streams.issue(costs[k].gather) if costs[k].gather is not None else None

    gathers = {0: start_gather(0)} if costs else {}
    returns: list[tuple[int, float | None]] = []
    for k, cost in enumerate(costs):
        if k + 1 < len(costs):
            gathers[k + 1] = start_gather(k + 1)
        streams.wait(gathers.pop(k))
        streams.now += cost.owner
        returns.append((k, streams.issue(cost.ret) if cost.ret is not None else None))
        if len(returns) > 1:
            done, end = returns.pop(0)
            streams.wait(end)
            streams.now += costs[done].apply
    for done, end in returns:
        streams.wait(end)
        streams.now += costs[done].apply
    return streams.now + column_block_phase_seconds(split, workload)


def measured_elementwise_efficiency(workload: Workload, optimizer_step: float, newton_schulz: float) -> float:
    """The share of the profile's element-wise rates a real optimizer step reaches, from one rank
    alone stepping the workload's model (:func:`dmuon.tools.hardware.measure_one_rank_seconds`): the
    step's element-wise phases as simulated at full rates, over what the measured step took
    beyond its Newton–Schulz calls (whose normalization and casts are therefore left out of
    the simulated side too). At most 1."""
    alone = dataclasses.replace(workload, world_size=1, elementwise_efficiency=1.0, split=False)
    stage = stage_plan(alone)
    newton_schulz_modelled = sum(
        ns_seconds(u.flops, c, alone) + memory_seconds(u.count * u.m * u.n * normalize_bytes(c.dtype), alone)
        for u, c in zip(stage.units, stage.configs))
    elementwise = simulate_optimizer_step(stage, alone).max().item() - newton_schulz_modelled
    measured = optimizer_step - newton_schulz
    return min(1.0, elementwise / measured) if measured > 0 else 1.0


def _row_shards(workload: Workload) -> int:
    """Shards of each Muon matrix's rows: one under DDP (replicated), every rank of the stage otherwise."""
    return 1 if workload.mode == "ddp" else workload.group_size


def _distributed_ns_seconds(s: SplitUnit, workload: Workload) -> float:
    """One member's distributed NS of a split matrix: its share of the products, the repeated
    Gram-side recurrence, and an all-reduce of the Gram matrix per restart (Gram NS) or step
    (standard) among its ranks."""
    bandwidth, latency = link(workload)
    k = len(s.gang)
    gram_bytes = 4 * s.unit.count * s.gram_side**2
    ring = latency + 2 * (k - 1) / k * gram_bytes / (bandwidth * workload.profile.ring_efficiency("all_reduce"))
    return (ns_seconds(s.member_flops, s.config, workload)
            + memory_seconds(s.member_elements * normalize_bytes(s.config.dtype), workload)
            + gram_all_reduces(s.config) * ring)


def _local_elementwise_seconds(split: Sequence[SplitUnit], workload: Workload) -> float:
    """Every rank's element-wise work on its rows of ``split``: check, momentum, NS input, apply."""
    local = sum(s.unit.count * s.unit.m * s.unit.n for s in split) / _row_shards(workload)
    return check_seconds(local, workload) + memory_seconds(
        local * (MOMENTUM_BYTES + NESTEROV_BYTES + APPLY_BYTES), workload)


def gang_phase_seconds(split: tuple[SplitUnit, ...], workload: Workload) -> float:
    """The matrices split over gangs, before the owned ones (the engine runs gangs first): every
    rank sends the members its rows of the split matrices, each gang runs distributed NS, and
    every rank gets its rows back. The gangs run at once: the costliest one decides. Both
    all-to-alls take the busier of a member (its slice in, and out to everyone) and a
    non-member (its rows of every split matrix)."""
    gangs = [s for s in split if not s.column_blocks]
    if not gangs:
        return 0.0
    bandwidth, latency = link(workload)
    shards = _row_shards(workload)
    rows = sum(-(-s.unit.total_bytes // shards) for s in gangs) if shards > 1 else 0
    rows_back = sum(-(-s.unit.total_bytes * s.unit.back_itemsize // s.unit.itemsize // shards)
                    for s in gangs) if shards > 1 else 0
    member_bytes = max(s.member_elements * s.unit.itemsize for s in gangs)
    member_back = max(s.member_elements * s.unit.back_itemsize for s in gangs)
    exchange = 2 * latency + (max(rows, member_bytes) + max(rows_back, member_back)) / bandwidth
    return (_local_elementwise_seconds(gangs, workload) + max(_distributed_ns_seconds(s, workload) for s in gangs)
            + exchange)


def column_block_phase_seconds(split: tuple[SplitUnit, ...], workload: Workload) -> float:
    """The matrices on column blocks, after the owned ones (the engine runs them last): every rank
    of the group runs distributed NS on the columns it holds, one matrix after another; nothing
    moves but the Gram matrices."""
    blocks = [s for s in split if s.column_blocks]
    if not blocks:
        return 0.0
    return _local_elementwise_seconds(blocks, workload) + sum(_distributed_ns_seconds(s, workload) for s in blocks)


def total_traffic(costs: list[BucketCost], size: int) -> Traffic:
    """Bytes per rank and link summed over every collective of the step."""
    total = Traffic.zeros(size)
    for cost in costs:
        for traffic in (cost.gather, cost.ret):
            if traffic is not None:
                total.add(traffic)
    return total


def lower_bound_seconds(units: Sequence[Unit], configs: Sequence[NSConfig], workload: Workload,
                        traffic: Traffic) -> float:
    """No schedule of this plan can beat it: Newton–Schulz at the listed peak rate, spread
    perfectly (where matrices stay whole — owner mode, or ``workload.split`` off — at least the
    largest one), and the busiest rank's bytes at full link bandwidth. The two add up where
    the hardware cannot overlap them."""
    peak = [compute_seconds(u.flops, c.dtype, workload) for u, c in zip(units, configs)]
    whole = workload.mode == "owner" or not workload.split
    # a unit of a one-rank group is a stack each rank holds its own of: every rank has one
    spread = sum(t * (workload.group_size if u.layout.size == 1 else 1) for u, t in zip(units, peak))
    compute = max(spread / workload.group_size, max(peak, default=0.0) if whole else 0.0)
    communication = traffic.link_seconds(workload).max().item()
    if workload.profile.comm_overlaps_compute:
        return max(compute, communication)
    return compute + communication


@dataclass(frozen=True)
class Prediction:
    """Predicted times of one training step (milliseconds; overheads as fractions)."""

    model: str
    mode: str
    hardware: str
    world_size: int
    tp: int
    pp: int
    ep: int
    tokens_per_rank: int
    seq_len: int
    mfu: float
    elementwise_efficiency: float
    ns_recipe: str
    buckets: int
    ns_gflop_total: float
    ns_gflop_per_rank: tuple[float, float, float]  # min, median, max
    mb_sent_per_rank: tuple[float, float, float]  # optimizer traffic: min, median, max
    imbalance: float  # max/mean NS FLOPs
    split_matrices: int  # split over gangs of ranks, or over the whole group on column blocks
    gang_size: int  # ranks per gang (0: no gang)
    column_block_matrices: int  # of those, on column blocks (distributed NS in place)
    strategies: tuple[tuple[str, int, str], ...]  # (kind of matrix, parameters of that kind in a stage, how)
    dmuon_state_gb: float  # optimizer state per rank
    adamw_state_gb: float
    exchange_buffer_gb: float  # dmuon's exchange buffers at most, per rank: two buckets in flight
    forward_backward_ms: float  # products alone, at the MFU
    data_parallel_comm_ms: float  # FSDP2 / DDP / owner-mode collectives of forward+backward
    adamw_opt_ms: float
    adamw_step_ms: float
    vanilla_opt_ms: float
    vanilla_step_ms: float
    dmuon_opt_ms: float
    dmuon_step_ms: float
    lower_bound_opt_ms: float
    overhead_vs_adamw: float  # dmuon step / AdamW step − 1
    vanilla_overhead_vs_adamw: float
    opt_speedup_vs_vanilla: float
    step_speedup_vs_vanilla: float
    early_start_hidden_ms: float = 0.0  # of the optimizer step, in the backward pass (0: not modelled here)
    dmuon_early_opt_ms: float = 0.0  # what is left of the optimizer step after the backward pass
    dmuon_early_step_ms: float = 0.0
    early_overhead_vs_adamw: float = 0.0


def _spread(values: list[float]) -> tuple[float, float, float]:
    return min(values), statistics.median(values), max(values)


def ns_recipe(units: Sequence[Unit], configs: Sequence[NSConfig]) -> str:
    """E.g. "gram float16 x160, standard float16 x64": matrices per NS method and dtype."""
    counts: Counter[tuple[str, str]] = Counter()
    for unit, config in zip(units, configs):
        counts[config.method, str(config.dtype).removeprefix("torch.")] += unit.count
    return ", ".join(f"{method} {dtype} x{n}" for (method, dtype), n in sorted(counts.items()))


# The backward pass's share of the forward+backward products (2 of the 3 products per weight)
BACKWARD_SHARE = 2 / 3


def early_start_hidden(optimizer_step: float, after_backward: float, backward: float, workload: Workload) -> float:
    """Seconds of the optimizer step early start hides in the backward pass: all but what must
    follow it (``after_backward``), at most the backward pass's idle device time (module docstring)."""
    return max(0.0, min(optimizer_step - after_backward, workload.profile.backward_idle_fraction * backward))


def after_backward_seconds(stage: StagePlan, workload: Workload, costs: list[BucketCost]) -> float:
    """What of early start's optimizer step follows the backward pass: the last bucket's step
    alone (its gradients are final only at the end) and the apply of the earlier buckets'
    held updates."""
    if not costs:
        return 0.0
    last = simulate_optimizer_step(stage, workload, costs[-1:]).max().item()
    return last + sum(cost.apply.max().item() for cost in costs[:-1])


def strategy_counts(stage: StagePlan) -> tuple[tuple[str, int, str], ...]:
    """(kind of matrix — its name less the layer —, parameters of that kind, how they are
    orthogonalized) for every kind and way in the stage, in the model's order."""
    hows = [(u, plan.strategy) for plan in stage.plans for u in plan.units]
    hows += [(s.unit, f"column blocks over {len(s.gang)} ranks" if s.column_blocks else
              f"gangs of {len(s.gang)} ranks") for s in stage.split]
    counts: Counter[tuple[str, str]] = Counter()
    for unit, how in hows:
        counts[unit.name.split(".", 2)[-1] if unit.name.startswith("layers.") else unit.name, how] += 1
    return tuple((kind, n, how) for (kind, how), n in counts.items())


def _flops_per_rank(stage: StagePlan, workload: Workload) -> Tensor:
    """NS FLOPs of every rank of the stage: its owned units (a one-rank group's on every rank,
    each holding its own), its share of the split matrices."""
    flops = torch.zeros(workload.group_size, dtype=torch.float64)
    for plan in stage.plans:
        flops += torch.tensor([plan.flops(p) for p in range(plan.size)], dtype=torch.float64)
    for s in stage.split:
        flops[list(s.gang)] += s.member_flops
    return flops


# bytes of momentum state per Muon weight, by momentum_dtype (fp32 weights): 8-bit blocks keep
# an fp32 scale per 128 weights of a row
MOMENTUM_STATE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "int8": 1 + 4 / 128}


def optimizer_state_bytes(workload: Workload) -> tuple[float, float]:
    """Per rank, the optimizer state of (dmuon, AdamW): dmuon keeps one momentum per Muon element
    (in its ``momentum_dtype``), NorMuon's fp32 row state of every matrix the rank holds a piece
    of, and AdamW's two moments for the rest; AdamW two moments for every trained element."""
    mode = "ddp" if workload.mode == "ddp" else "fsdp2"
    local_muon = local_params(muon_params(workload.config), workload, mode)
    local_all = local_params(trainable_params(workload.config), workload, mode)
    momentum = MOMENTUM_STATE_BYTES[workload.momentum_dtype] * local_muon
    return momentum + row_state_bytes(workload) + 8 * (local_all - local_muon), 8 * local_all


def row_state_bytes(workload: Workload) -> float:
    """NorMuon's row state (4 bytes per row of every Muon matrix), whole on every rank; 0 for Muon."""
    if workload.update_rule != "normuon":
        return 0.0
    return 4.0 * sum(count * m for _, count, m, _ in muon_units(workload.config))


def row_state_traffic(workload: Workload) -> float:
    """Bytes one rank sends per step to share NorMuon's row states: one ring all-reduce of every
    row state over the ranks of the exchange (none in one process)."""
    size = workload.group_size
    return 2 * (size - 1) / size * row_state_bytes(workload) if size > 1 else 0.0


def predict(workload: Workload, model: str = "") -> Prediction:
    """Optimizer-step and end-to-end predictions for dmuon, AdamW and vanilla distributed Muon.

    The baselines run under the workload's mode, except in owner mode, whose baselines are
    FSDP2's (the setup owner-sharding would replace). With pipeline stages, the optimizer is
    the first stage's (the most layers).
    """
    stage = stage_plan(workload)
    costs = stage_costs(stage, workload)
    dmuon_opt = simulate_optimizer_step(stage, workload, costs).max().item()
    baseline_mode = "fsdp2" if workload.mode == "owner" else workload.mode
    compute = forward_backward_seconds(workload)
    ours_dp = data_parallel_seconds(workload)
    ours_fb = exposed_step_seconds(compute + data_parallel_copy_seconds(workload), ours_dp, workload)
    base_fb = exposed_step_seconds(compute + data_parallel_copy_seconds(workload, baseline_mode),
                                   data_parallel_seconds(workload, baseline_mode), workload)
    adamw_opt = adamw_step_seconds(workload, baseline_mode)
    vanilla_opt = vanilla_muon_step_seconds(workload, baseline_mode)
    size = workload.group_size
    traffic = total_traffic(costs, size)
    sent = (traffic.intra_out + traffic.inter_out).double() + row_state_traffic(workload)
    flops = _flops_per_rank(stage, workload)
    shards = _row_shards(workload)
    for s in stage.split:
        if not s.column_blocks:  # a rank's rows out to the gang; a member's slice out to every other rank
            sent += -(-s.unit.total_bytes // shards) if shards > 1 else 0
            sent[list(s.gang)] += s.member_elements * s.unit.back_itemsize * (size - 1) / size
    units, all_configs = stage.units, stage.configs
    adamw_step, vanilla_step, dmuon_step = base_fb + adamw_opt, base_fb + vanilla_opt, ours_fb + dmuon_opt
    # early start's own plan: every matrix whole (it does not run gangs), buckets in the backward
    # pass's order; it does not run where a piece exchange is in the plan
    early_opt, hidden = dmuon_opt, 0.0
    pieces = any(u.layout.pieces for u in units)
    if workload.profile.backward_idle_fraction and not pieces:
        early = dataclasses.replace(workload, split=False, ready_order=True)
        early_stage = stage_plan(early)
        early_costs = stage_costs(early_stage, early)
        early_opt = simulate_optimizer_step(early_stage, early, early_costs).max().item()
        after = after_backward_seconds(early_stage, early, early_costs)
        hidden = early_start_hidden(early_opt, after, BACKWARD_SHARE * compute, workload)
        if not hidden:
            early_opt = dmuon_opt
    dmuon_state, adamw_state = optimizer_state_bytes(workload)
    largest = max((u.total_bytes for u in units), default=0)
    ms, gb = 1e3, 2**30
    return Prediction(
        model=model, mode=workload.mode, hardware=workload.profile.name,
        world_size=workload.world_size, tp=workload.tp, pp=workload.pp, ep=workload.ep,
        tokens_per_rank=workload.tokens_per_rank, seq_len=workload.seq_len,
        mfu=workload.model_flops_utilization, elementwise_efficiency=workload.elementwise_efficiency,
        ns_recipe=ns_recipe(units, all_configs), buckets=sum(len(plan.buckets) for plan in stage.plans),
        ns_gflop_total=sum(u.flops * (size if u.layout.size == 1 else 1) for u in units) / 1e9,
        ns_gflop_per_rank=_spread((flops / 1e9).tolist()), mb_sent_per_rank=_spread((sent / 2**20).tolist()),
        imbalance=(flops.max() / flops.mean()).item() if flops.sum() else 1.0,
        split_matrices=len(stage.split),
        gang_size=max((len(s.gang) for s in stage.split if not s.column_blocks), default=0),
        column_block_matrices=sum(s.column_blocks for s in stage.split),
        strategies=strategy_counts(stage),
        dmuon_state_gb=dmuon_state / gb, adamw_state_gb=adamw_state / gb,
        exchange_buffer_gb=2 * max(workload.bucket_bytes, largest) / gb if size > 1 else 0.0,
        forward_backward_ms=compute * ms, data_parallel_comm_ms=ours_dp * ms,
        adamw_opt_ms=adamw_opt * ms, adamw_step_ms=adamw_step * ms,
        vanilla_opt_ms=vanilla_opt * ms, vanilla_step_ms=vanilla_step * ms,
        dmuon_opt_ms=dmuon_opt * ms, dmuon_step_ms=dmuon_step * ms,
        lower_bound_opt_ms=lower_bound_seconds(units, all_configs, workload, traffic) * ms,
        overhead_vs_adamw=dmuon_step / adamw_step - 1,
        vanilla_overhead_vs_adamw=vanilla_step / adamw_step - 1,
        opt_speedup_vs_vanilla=vanilla_opt / dmuon_opt,
        step_speedup_vs_vanilla=vanilla_step / dmuon_step,
        early_start_hidden_ms=hidden * ms, dmuon_early_opt_ms=(early_opt - hidden) * ms,
        dmuon_early_step_ms=(ours_fb + early_opt - hidden) * ms,
        early_overhead_vs_adamw=(ours_fb + early_opt - hidden) / adamw_step - 1,
    )
