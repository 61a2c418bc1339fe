"""The step plan: everything that decides *what* a step does, worked out once.

For every Muon parameter it fixes the layout, the Newton–Schulz configuration (and fused row
blocks), the orientation the exchange sees, the lr factor, and the cost model's choices —
whether HSDP replicas split the work, which 1-D sharded matrices run distributed
Newton–Schulz on their column blocks, which matrices are split over gangs of ranks — and from
those the engine's strategies with their owners and buckets. The optimizer keeps one plan and
rebuilds it only when its key changes: other parameter objects (as after Accelerate's
``prepare``), other parameters with a gradient, a changed ``requires_grad``, other
Newton–Schulz options, or a new group or loaded state. A step then only moves values:
:class:`StepValues` answers the strategies' requests for inputs and applies their updates, in
``torch._foreach_*`` calls over the parameters of a group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon.cuda_graphs import GraphedOrthogonalize
from dmuon.elementwise import CompiledKernels, apply_updates_all, compile_kernels, nesterov_inputs_all, scalar
from dmuon.engine import Block, MatrixWork, Orthogonalizer, PreparedStep, unit_of
from dmuon.exchange import GroupRef, gather_whole
from dmuon.hyperparameters import EngineOptions, adjusted_lr_ratio, ns_config
from dmuon.layout import detect_layout, owned_by, piece_of
from dmuon.orthogonalization import gram_all_reduces, newton_schulz_flops, orthogonalize
from dmuon.planner import choose_distributed, choose_gangs, distributed_cost, gang_costs, split_replicas_is_cheaper
from dmuon.routing import block_rows, matrix_shape
from dmuon.tensors import local

# (name, parameter, its param group, its matrix view): a Muon parameter as the optimizer lists it
MuonEntry = tuple[str, Tensor, dict[str, Any], str]

# the param-group keys a plan depends on (the rest — lr, weight decay, momentum — is read each step)
PLANNED_KEYS = ("ns_coefficients", "eps", "ns_steps", "adjust_lr_fn", "ns_method", "ns_dtype", "ns_restarts",
                "ns_blocks")


def steps_here(param: Tensor) -> bool:
    """Whether this rank steps ``param``: always, unless it is owner-sharded to another rank."""
    owned = owned_by(param)
    return owned is None or owned.is_mine


def plan_key(entries: Sequence[MuonEntry]) -> tuple:
    """What a step plan depends on: the stepped parameters (objects, shapes, views) and their
    groups' Newton–Schulz options."""
    groups = {id(group): group for _, _, group, _ in entries}
    return (
        tuple((id(p), tuple(p.shape), view) for _, p, _, view in entries),
        tuple((gid, tuple(repr(group[k]) for k in PLANNED_KEYS)) for gid, group in groups.items()),
    )


@dataclass(frozen=True)
class Target:
    """Where one work's values live: its parameter, group (for lr, weight decay, momentum),
    whether the exchange sees the transpose, and its lr factor."""

    param: Tensor
    group: dict[str, Any]
    transpose: bool
    scale: float
    label: str


@dataclass(frozen=True)
class StepPlan:
    key: tuple
    works: tuple[MatrixWork, ...]
    targets: tuple[Target, ...]
    prepared: PreparedStep
    chunks: dict[tuple[int, ...], list] = field(default_factory=dict)  # StepValues' groupings (_Chunk)


def column_block_candidate(p: Tensor, layout, process_group, blocks: tuple) -> bool:
    """Whether the ranks holding ``p``'s shards can orthogonalize it together on their own
    column blocks (distributed NS): a matrix sharded on one dim over one group — or on dim 0
    over every dim of a mesh of all ranks (FSDP + column-wise TP) — unfused."""
    return (isinstance(p, DTensor) and p.ndim == 2 and process_group is not None and not blocks
            and (not layout.gathered or layout.rows_partitioned) and layout.replicas == 1 and layout.shards > 1)


def gang_eligible(work: MatrixWork) -> bool:
    """Whether ``work`` could be split over a gang (:mod:`dmuon.strategies.gangs`): one unfused
    matrix of a planned exchange group of several ranks."""
    return (work.group is not None and work.layout.size > 1 and not work.layout.gathered and not work.column_blocks
            and not work.blocks and work.count == 1 and len(work.layout.shape) == 2)


def build_engine(options: EngineOptions, process_group: dist.ProcessGroup | None,
                 measured: dict[tuple[int, int], str]) -> tuple[CompiledKernels | None, Orthogonalizer, StepPlanner]:
    """An optimizer's compiled kernels (None unless ``options.compile``), engine and planner;
    ``measured``: with ``symmetric_products="auto"``, the faster kernel per shape."""
    kernels = compile_kernels("inductor" if options.compile is True else options.compile) if options.compile else None
    ns = kernels.orthogonalize if kernels else orthogonalize
    engine = Orthogonalizer(options.bucket_bytes, options.comm_dtype,
                            orthogonalize_fn=GraphedOrthogonalize(ns) if options.cuda_graphs else ns)
    planner = StepPlanner(engine, process_group, options.replica_split, options.distributed_ns,
                          options.symmetric_products, measured)
    return kernels, engine, planner


class StepPlanner:
    """Builds step plans for one optimizer (its options and engine)."""

    def __init__(self, engine: Orthogonalizer, process_group: dist.ProcessGroup | None, replica_split: bool | None,
                 distributed_ns: bool | None, symmetric_products: str, measured: dict[tuple[int, int], str]) -> None:
        self.engine = engine
        self._process_group = GroupRef(process_group)
        self.replica_split = replica_split
        self.distributed_ns = distributed_ns
        self.symmetric_products = symmetric_products
        self.measured = measured  # with "auto": the faster kernel per shape, measured at construction

    def symmetric_for(self, shape: tuple[int, int]) -> str:
        """The symmetric-product kernel for an m×n Newton–Schulz: the option, or with "auto" the
        one measured faster for that shape (torch's for shapes not measured)."""
        if self.symmetric_products != "auto":
            return self.symmetric_products
        return self.measured.get(tuple(shape), "torch")

    def plan_for(self, kept: StepPlan | None, entries: Sequence[MuonEntry], labels: Callable[[dict], str],
                 device: torch.device) -> StepPlan:
        """The plan for stepping ``entries``: ``kept``, unless what it depends on (:func:`plan_key`) changed."""
        key = plan_key(entries)
        return kept if kept is not None and kept.key == key else self.build(key, entries, labels, device)

    def build(self, key: tuple, entries: Sequence[MuonEntry], labels: Callable[[dict], str],
              device: torch.device) -> StepPlan:
        works = self.works(entries)
        targets = tuple(self._target(e, w, labels) for e, w in zip(entries, works))
        return StepPlan(key, tuple(works), targets, self.engine.prepare(works, device))

    def _target(self, entry: MuonEntry, work: MatrixWork, labels: Callable[[dict], str]) -> Target:
        _, p, group, view = entry
        _, rows, cols = matrix_shape(p.shape, view)
        scale = 1.0 if work.blocks else adjusted_lr_ratio(group["adjust_lr_fn"], rows, cols)
        return Target(p, group, work.layout.transposed != work.column_blocks, scale, labels(group))

    # ------------------------------------------------------------------ the cost model's choices

    def works(self, entries: Sequence[MuonEntry]) -> list[MatrixWork]:
        """Each matrix to one owner, split across its group, or over a gang. Where early start
        runs (the engine's buckets follow the backward pass), the cost model keeps every matrix
        whole: early start runs the planned exchange only, and hides most of it in the backward
        pass (``distributed_ns=True`` still splits, and turns early start off)."""
        works = self._owned_works(entries)
        if self.distributed_ns is False or (self.distributed_ns is None and self.engine.ready_order):
            return works
        candidates = [i for i, ((_, p, _, _), w) in enumerate(zip(entries, works))
                      if column_block_candidate(p, w.layout, w.group, w.blocks)]
        if candidates:
            chosen = set(candidates) if self.distributed_ns else self._column_block_choice(entries, works, candidates)
            works = [self._work(e, split_replicas=False, column_blocks=True) if i in chosen else w
                     for i, (e, w) in enumerate(zip(entries, works))]
        return works if self.distributed_ns else self._gang_choice(works)

    def _owned_works(self, entries: Sequence[MuonEntry]) -> list[MatrixWork]:
        split_replicas = self.replica_split
        if split_replicas is None:  # HSDP: the cost model decides whether replicas split the work
            works = [self._work(e, split_replicas=True) for e in entries]
            if not any(w.layout.replicas > 1 and w.layout.shards > 1 for w in works):
                return works
            units = [unit_of(w, self.engine.wire_itemsize(w)) for w in works]
            if split_replicas_is_cheaper(units, self.engine.flops_per_byte):
                return works
            split_replicas = False
        return [self._work(e, split_replicas=split_replicas) for e in entries]

    def _column_block_choice(self, entries: Sequence[MuonEntry], works: list[MatrixWork],
                             candidates: list[int]) -> set[int]:
        """The cost model's choice of distributed NS (:func:`dmuon.planner.choose_distributed`),
        per exchange group."""
        chosen: set[int] = set()
        for members in self.engine.group_indices(works):
            units = [unit_of(works[i], self.engine.wire_itemsize(works[i])) for i in members]
            costs = [self._column_block_cost(self._work(entries[i], split_replicas=False, column_blocks=True))
                     if i in candidates
                     else None for i in members]
            layout = works[members[0]].layout
            picked = choose_distributed(units, costs, layout.size, layout.replicas,
                                        bucket_bytes=self.engine.bucket_bytes, flops_per_byte=self.engine.flops_per_byte)
            chosen.update(members[j] for j in picked)
        return chosen

    def _column_block_cost(self, work: MatrixWork) -> float:
        """What every rank of the group pays when ``work`` (in column-block form) is split."""
        config, size = work.config, work.layout.shards
        blocks_flops = work.count * newton_schulz_flops(work.m, -(-work.n // size), steps=config.steps,
                                                        method=config.method, restarts=config.restarts,
                                                        gram_side=work.m)
        return distributed_cost(blocks_flops, 4 * work.count * work.m**2, gram_all_reduces(config), size,
                                self.engine.flops_per_byte)

    def _gang_choice(self, works: list[MatrixWork]) -> list[MatrixWork]:
        """The cost model's choice of matrices to split over gangs of ranks
        (:func:`dmuon.planner.choose_gangs`), per exchange group."""
        eligible = [i for i, w in enumerate(works) if gang_eligible(w)]
        for members in self.engine.group_indices([works[i] for i in eligible]):
            group_works = [works[eligible[i]] for i in members]
            units = [unit_of(w, self.engine.wire_itemsize(w)) for w in group_works]
            layout, fpb = group_works[0].layout, self.engine.flops_per_byte
            costs = gang_costs(units, [w.config for w in group_works], fpb)
            for j, gang in choose_gangs(units, costs, layout.size, layout.replicas, flops_per_byte=fpb).items():
                works[eligible[members[j]]] = replace(works[eligible[members[j]]], gang=gang)
        return works

    # ------------------------------------------------------------------ one matrix

    def _work(self, entry: MuonEntry, *, split_replicas: bool, column_blocks: bool = False) -> MatrixWork:
        """One parameter's work: with ``split_replicas`` HSDP replicas share the exchange; with
        ``column_blocks`` (where the layout allows it) it runs distributed NS on column blocks."""
        name, p, group, view = entry
        stack = p.ndim == 3 and view in ("auto", "batch")
        layout, process_group = detect_layout(p, name, self._process_group(), split_replicas=split_replicas, stack=stack)
        # what NS sees: a local stack's own matrices, or for Shard(1) the transpose
        count, m, n = matrix_shape(layout.shape, view)
        _, rows_of_p, cols_of_p = matrix_shape(p.shape, view)
        config = ns_config(group, (m, n), p.device.type, self.symmetric_for((m, n)))
        rows = block_rows(group["ns_blocks"], rows_of_p)
        if len(rows) > 1 and layout.transposed:
            raise NotImplementedError(f"ns_blocks for parameter {name!r}: row blocks of a Shard(1) (row-wise "
                                      "tensor parallel) matrix are not supported.")
        # fused weights: each block is orthogonalized and scaled for its own shape by its owner
        blocks = () if len(rows) == 1 else tuple(
            Block(r, ns_config(group, (r, n), p.device.type, self.symmetric_for((r, n))),
                  adjusted_lr_ratio(group["adjust_lr_fn"], r, n))
            for r in rows
        )
        # distributed NS on the ranks' own column blocks: (Gram side, other side); a Shard(1)
        # matrix is split by columns already, a Shard(0) one by the columns of its transpose
        column_blocks = column_blocks and column_block_candidate(p, layout, process_group, blocks)
        if column_blocks:
            count, m, n = 1, *((rows_of_p, cols_of_p) if layout.transposed else (cols_of_p, rows_of_p))
            config = ns_config(group, (m, n), p.device.type, self.symmetric_for((m, n)))
        # the exchange of Shard(1) rows and the column blocks of Shard(0) see the transpose
        transpose = layout.transposed != column_blocks
        piece = local(p)
        whole = part = None
        if layout.gathered and not column_blocks:
            whole = partial(gather_whole, mesh=p.device_mesh, placements=p.placements, shape=p.shape, stride=p.stride())
            part = partial(piece_of, mesh=p.device_mesh, placements=p.placements)
        local_shape = tuple(piece.mT.shape if transpose else piece.shape)
        return MatrixWork(name, local_shape, piece.dtype, layout, GroupRef(process_group), count, m, n, config, blocks,
                          whole, part, column_blocks)


@dataclass(frozen=True)
class _Chunk:
    """Some of a request's works that one foreach call serves: same param group, same lr factor."""

    positions: tuple[int, ...]  # in the request
    targets: tuple[Target, ...]
    params: tuple[Tensor, ...]
    transposed: tuple[bool, ...]
    numel: int  # of this rank's pieces

    @classmethod
    def of(cls, positions: list[int], targets: list[Target]) -> _Chunk:
        return cls(tuple(positions), tuple(targets), tuple(t.param for t in targets),
                   tuple(t.transpose for t in targets), sum(local(t.param).numel() for t in targets))


class StepValues:
    """The values of one step for the engine's strategies (:class:`dmuon.engine.StepIO`): the
    Newton–Schulz inputs from the momentum (computed when asked, a group's at a time), and the
    updates applied to the parameters, with the update statistics accumulated on the device."""

    def __init__(self, plan: StepPlan, pieces: dict[int, tuple[Tensor, Tensor]], kernels: CompiledKernels | None,
                 squares: dict[str, list], independent: Callable[[], None] | None = None) -> None:
        self.plan, self.pieces, self.kernels, self.squares = plan, pieces, kernels, squares  # pieces: (grad, buffer)
        self.independent = independent  # what overlap() runs once

    def overlap(self) -> None:
        independent, self.independent = self.independent, None
        if independent is not None:
            independent()

    def _by_group(self, indices: Sequence[int]) -> list[_Chunk]:
        """``indices`` by (param group, lr factor): one foreach call each. The same requests
        come every step, so the answer is kept with the plan."""
        key = tuple(indices)
        chunks = self.plan.chunks.get(key)
        if chunks is None:
            by_key: dict[tuple, list[int]] = {}
            for k, i in enumerate(indices):
                target = self.plan.targets[i]
                by_key.setdefault((id(target.group), target.scale), []).append(k)
            chunks = self.plan.chunks[key] = [_Chunk.of(ks, [self.plan.targets[indices[k]] for k in ks])
                                              for ks in by_key.values()]
        return chunks

    def inputs(self, indices: Sequence[int]) -> list[Tensor]:
        out: list[Tensor | None] = [None] * len(indices)
        for chunk in self._by_group(indices):
            group = chunk.targets[0].group
            grads, bufs = zip(*[self.pieces[id(p)] for p in chunk.params])
            if not group["nesterov"]:
                values = bufs
            elif self.kernels is not None:
                mu = scalar(group["momentum"], bufs[0].device)
                values = [self.kernels.nesterov_input(g, b, mu) for g, b in zip(grads, bufs)]
            else:
                values = nesterov_inputs_all(list(grads), list(bufs), group["momentum"])
            for k, transposed, value in zip(chunk.positions, chunk.transposed, values):
                out[k] = value.mT if transposed else value
        return out  # type: ignore[return-value]

    def apply(self, indices: Sequence[int], updates: Sequence[Tensor], norms: Tensor | None = None) -> None:
        for chunk in self._by_group(indices):
            first = chunk.targets[0]
            group, ratio = first.group, first.scale
            params = [local(p) for p in chunk.params]
            mine = [updates[k].mT if transposed else updates[k] for k, transposed in zip(chunk.positions, chunk.transposed)]
            if norms is not None:
                own = norms[list(chunk.positions)]
            else:  # in fp32 at least, as the statistics always are (a norm cannot narrow fp64)
                wide = any(u.dtype == torch.float64 for u in mine)
                own = torch.stack(torch._foreach_norm(mine, 2, dtype=None if wide else torch.float32))
            squares = self.squares.setdefault(first.label, [torch.zeros((), device=params[0].device), 0])
            squares[0] += own.float().square().sum() * ratio**2  # a device tensor: no sync
            squares[1] += chunk.numel
            if self.kernels is not None:
                lr, wd = scalar(group["lr"], params[0].device), scalar(group["weight_decay"], params[0].device)
                for p, u in zip(params, mine):
                    self.kernels.apply_update(p, u, lr, wd, ratio)
            else:
                apply_updates_all(params, mine, float(group["lr"]), group["weight_decay"], ratio)
