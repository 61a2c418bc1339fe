"""The step plan: everything that decides *what* a step does, worked out once.

For every Muon parameter it fixes the layout, the Newton–Schulz configuration (and fused row
blocks), the orientation the exchange sees, the lr factor, and the cost model's choices —
whether HSDP replicas split the work, which 1-D sharded matrices run distributed
Newton–Schulz on their column blocks, which matrices are split over gangs of ranks — and from
those the strategies (:mod:`dmuon.strategies`) with their owners, buckets and process groups. It is
the one place that decides: the cost model's choices come from :func:`dmuon.choices.choose`,
which ``dmuon plan`` calls too, and the engine (:mod:`dmuon.step.engine`) only runs what the plan
lists. The optimizer keeps one plan and rebuilds it only when its key changes: other parameter
objects (as after Accelerate's ``prepare``), other parameters with a gradient, a changed
``requires_grad``, other Newton–Schulz options, a change in whether early start may run it
(which decides its bucket order: :mod:`dmuon.step.early.eligibility`), or a new group or loaded
state. A step then only moves values (:mod:`dmuon.step.values`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon.choices import MatrixOptions, choose, column_block_cost, column_blocks_fit
from dmuon.exchange import GroupRef
from dmuon.hyperparameters import EngineOptions, adjusted_lr_ratio, ns_config
from dmuon.layout import detect_layout, owned_by
from dmuon.param_groups import MuonParam
from dmuon.planner import DEFAULT_FLOPS_PER_BYTE, Plan, Unit, exchange_groups, exchange_plans
from dmuon.routing import is_stack, matrix_shape
from dmuon.row_blocks import row_blocks
from dmuon.rules import UpdateRule, rule_of
from dmuon.step.early.eligibility import Eligibility, follows_backward, wanted
from dmuon.strategies.base import Block, MatrixWork, Strategy, return_dtype, unit_of, wire_dtype
from dmuon.strategies.column_blocks import ColumnBlocks
from dmuon.strategies.gangs import Gangs
from dmuon.strategies.pieces import PieceExchange
from dmuon.strategies.rows import RowExchange
from dmuon.tensors import local

# the param-group keys a plan depends on (the rest — lr, weight decay, momentum — is read each step)
PLANNED_KEYS = ("ns_coefficients", "eps", "ns_steps", "adjust_lr_fn", "ns_method", "ns_dtype", "ns_restarts",
                "ns_blocks", "update_rule")


def steps_here(param: Tensor) -> bool:
    """Whether this rank steps ``param``: always, unless it is owner-sharded to another rank."""
    owned = owned_by(param)
    return owned is None or owned.is_mine


def plan_key(entries: Sequence[MuonParam], early: Eligibility) -> tuple:
    """What a step plan depends on: the stepped parameters (objects, shapes, views), their
    groups' Newton–Schulz options, and what decides whether early start may run it (which
    decides its bucket order)."""
    groups = {id(e.param_group): e.param_group for e in entries}
    return (
        tuple((id(e.param), tuple(e.param.shape), e.view) for e in entries),
        tuple((gid, tuple(repr(group[k]) for k in PLANNED_KEYS)) for gid, group in groups.items()),
        early,
    )


@dataclass(frozen=True)
class StepPlan:
    """What a step does, decided once: one work per Muon parameter, and the strategies that
    orthogonalize them, in the order every rank runs them."""

    key: tuple
    works: tuple[MatrixWork, ...]
    strategies: tuple[Strategy, ...]
    follows_backward: bool  # buckets in the backward pass's order (for early start), not the cost order
    chunks: dict[tuple[int, ...], list] = field(default_factory=dict)  # StepValues' groupings


def column_blocks_possible(p: Tensor, process_group: dist.ProcessGroup | None, blocks: tuple, rule: UpdateRule
                           ) -> bool:
    """Whether ``p``'s kind allows distributed NS on the ranks' own column blocks: an unfused
    DTensor matrix with a process group and no update rule (which needs the whole update on one
    rank); its layout decides the rest (:func:`dmuon.choices.column_blocks_fit`)."""
    return isinstance(p, DTensor) and p.ndim == 2 and process_group is not None and not blocks and rule.fn is None


class StepPlanner:
    """Builds step plans for one optimizer, from its options."""

    def __init__(self, options: EngineOptions, process_group: dist.ProcessGroup | None,
                 measured: dict[tuple[int, int], str], flops_per_byte: float = DEFAULT_FLOPS_PER_BYTE) -> None:
        self._process_group = GroupRef(process_group)
        self.comm_dtype = options.comm_dtype
        self.bucket_bytes = options.bucket_bytes
        self.replica_split = options.replica_split
        self.distributed_ns = options.distributed_ns
        self.symmetric_products = options.symmetric_products
        # compiled Newton–Schulz may fuse its last product with the cast to the parameter's dtype,
        # leaving values its own dtype cannot hold: updates go back in the parameter's then
        self.narrow_returns = not options.compile
        self.measured = measured  # with "auto": the faster kernel per shape, measured at construction
        self.flops_per_byte = flops_per_byte

    def symmetric_for(self, shape: tuple[int, int]) -> str:
        """The symmetric-product kernel for an m×n Newton–Schulz: the option, or with "auto" the
        one measured faster for that shape (torch's for shapes not measured)."""
        if self.symmetric_products != "auto":
            return self.symmetric_products
        return self.measured.get(tuple(shape), "torch")

    def step_plan(self, kept: StepPlan | None, entries: Sequence[MuonParam], device: torch.device,
                  early: Eligibility) -> StepPlan:
        """The plan for stepping ``entries``: ``kept``, unless what it depends on (:func:`plan_key`) changed."""
        key = plan_key(entries, early)
        if kept is not None and kept.key == key:
            return kept
        backward, works = self.planned_works(entries, early)
        return StepPlan(key, tuple(works), self.strategies(works, device, backward), backward)

    def planned_works(self, entries: Sequence[MuonParam], early: Eligibility) -> tuple[bool, list[MatrixWork]]:
        """Whether the plan's buckets follow the backward pass, and its works: early start's
        (every matrix whole) where it can run them (:func:`dmuon.step.early.eligibility.follows_backward`),
        else the cost order's, which may also split matrices."""
        if wanted(early.setting, early.device_type):
            works = self.works(entries, follow_backward=True)
            if follows_backward(early, works):
                return True, works
        return False, self.works(entries, follow_backward=False)

    # ------------------------------------------------------------------ the cost model's choices

    def works(self, entries: Sequence[MuonParam], follow_backward: bool) -> list[MatrixWork]:
        """Each matrix to one owner, split across its group, or over a gang, as
        :func:`dmuon.choices.choose` decides. Where early start runs (buckets follow the backward
        pass) every matrix stays whole: early start runs the row exchange only, and hides
        most of it in the backward pass (``distributed_ns=True`` still splits, and turns early
        start off)."""
        shared = [self._work(e, split_replicas=self.replica_split is not False) for e in entries]
        per_replica = shared
        if self.replica_split is None and any(w.layout.replicas > 1 and w.layout.shards > 1 for w in shared):
            per_replica = [self._work(e, split_replicas=False) for e in entries]
        options = [MatrixOptions(self._unit(s), self._unit(r), s.config, self._wire(s),
                                 self._column_block_cost(e, r), self._splittable(s))
                   for e, s, r in zip(entries, shared, per_replica)]
        choices = choose(options, replica_split=self.replica_split, distributed_ns=self.distributed_ns,
                         ready_order=follow_backward, bucket_bytes=self.bucket_bytes,
                         flops_per_byte=self.flops_per_byte)
        works = shared if choices.split_replicas else per_replica
        return [self._work(e, split_replicas=False, column_blocks=True) if i in choices.column_blocks
                else replace(w, gang=choices.gangs[i]) if i in choices.gangs else w
                for i, (e, w) in enumerate(zip(entries, works))]

    def _column_block_cost(self, entry: MuonParam, work: MatrixWork) -> float | None:
        """What every rank of the group pays when ``entry`` (laid out as ``work``, replicas not
        split) runs distributed NS on its column blocks; None where it cannot."""
        if self.distributed_ns is False or not (column_blocks_possible(entry.param, work.process_group, work.blocks,
                                                                       work.rule)
                                                and column_blocks_fit(work.layout)):
            return None
        blocks = self._work(entry, split_replicas=False, column_blocks=True)
        return column_block_cost(blocks.count, blocks.m, blocks.n, blocks.config, blocks.layout.shards,
                                 self.flops_per_byte)

    @staticmethod
    def _splittable(work: MatrixWork) -> bool:
        """One unfused 2-D matrix with a process group and no update rule: a gang could split it."""
        return (work.process_group is not None and not work.blocks and work.count == 1 and len(work.layout.shape) == 2
                and work.rule.fn is None)

    def _wire(self, work: MatrixWork) -> str:
        """The dtypes ``work`` crosses the network in, to its owner and (where it differs) back:
        works of one exchange group share them."""
        there, back = wire_dtype(work, self.comm_dtype), return_dtype(work, self.comm_dtype)
        return str(there) if back == there else f"{there}>{back}"

    def _unit(self, work: MatrixWork) -> Unit:
        return unit_of(work, wire_dtype(work, self.comm_dtype).itemsize, return_dtype(work, self.comm_dtype).itemsize)

    # ------------------------------------------------------------------ exchange groups and strategies

    def _exchange_groups(self, works: Sequence[MatrixWork]) -> list[list[int]]:
        return exchange_groups([w.layout for w in works], [self._wire(w) for w in works])

    def _whole(self, works: Sequence[MatrixWork], follow_backward: bool) -> list[tuple[list[int], Plan]]:
        """Of ``works`` (each orthogonalized whole by one owner), the index and plan of each
        planned or piece exchange (:func:`dmuon.planner.exchange_plans`)."""
        return exchange_plans([self._unit(w) for w in works], [self._wire(w) for w in works],
                              bucket_bytes=self.bucket_bytes, flops_per_byte=self.flops_per_byte,
                              ready_order=follow_backward)

    def exchange_plans(self, works: Sequence[MatrixWork], follow_backward: bool) -> list[Plan]:
        """The plan of each planned or piece exchange (gangs and column blocks have none)."""
        return [plan for _, plan in self._whole([w for w in works if not (w.gang or w.column_blocks)],
                                                follow_backward)]

    def strategies(self, works: Sequence[MatrixWork], device: torch.device, follow_backward: bool
                   ) -> tuple[Strategy, ...]:
        """The strategies for ``works``, in the order every rank runs them: gangs first, then
        the row exchange of each exchange group, the piece exchange of each, and distributed
        NS on column blocks. Indices into ``works`` are what a step's StepIO answers to."""
        strategies: list[Strategy] = []

        def subset(keep: Callable[[MatrixWork], bool]) -> list[int]:
            return [i for i, w in enumerate(works) if keep(w)]

        split = subset(lambda w: bool(w.gang))
        for members in self._exchange_groups([works[i] for i in split]):
            indices = [split[i] for i in members]
            strategies.append(Gangs(indices, [works[i] for i in indices], device))
        whole = subset(lambda w: not (w.gang or w.column_blocks))
        for members, plan in self._whole([works[i] for i in whole], follow_backward):
            indices = [whole[i] for i in members]
            chosen = [works[i] for i in indices]
            exchange = PieceExchange if chosen[0].layout.pieces else RowExchange
            strategies.append(exchange(indices, chosen, plan, device))
        columns = subset(lambda w: w.column_blocks)
        if columns:
            strategies.append(ColumnBlocks(columns, [works[i] for i in columns]))
        return tuple(strategies)

    # ------------------------------------------------------------------ one matrix

    def _work(self, entry: MuonParam, *, split_replicas: bool, column_blocks: bool = False) -> MatrixWork:
        """One parameter's work: with ``split_replicas`` HSDP replicas share the exchange; with
        ``column_blocks`` (where the layout allows it) it runs distributed NS on column blocks."""
        name, p, group, view = entry.name, entry.param, entry.param_group, entry.view
        stack = is_stack(p, view)
        layout, process_group = detect_layout(p, name, self._process_group(), split_replicas=split_replicas,
                                              stack=stack)
        # what NS sees: a local stack's own matrices, or for Shard(1) the transpose
        count, m, n = matrix_shape(layout.shape, view)
        _, rows_of_p, cols_of_p = matrix_shape(p.shape, view)
        config = ns_config(group, (m, n), p.device.type, self.symmetric_for((m, n)))
        pattern = row_blocks(group["ns_blocks"], rows_of_p)
        rows = pattern.sizes
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
        rule = rule_of(group)
        column_blocks = (column_blocks and column_blocks_possible(p, process_group, blocks, rule)
                         and column_blocks_fit(layout))
        if column_blocks:
            count, m, n = 1, *((rows_of_p, cols_of_p) if layout.transposed else (cols_of_p, rows_of_p))
            config = ns_config(group, (m, n), p.device.type, self.symmetric_for((m, n)))
        # the exchange of Shard(1) rows and the column blocks of Shard(0) see the transpose
        transpose = layout.transposed != column_blocks
        piece = local(p)
        local_shape = tuple(piece.mT.shape if transpose else piece.shape)
        lr_scale = 1.0 if blocks else adjusted_lr_ratio(group["adjust_lr_fn"], rows_of_p, cols_of_p)
        # Newton–Schulz's last product rounds the update to its dtype; widened to the parameter's,
        # it holds those values still, so narrowing it back for the return is exact (a fused
        # block's scale or an update rule would follow the cast, and bf16 → fp16 or back is no narrowing)
        narrow_return = (self.narrow_returns and not blocks and rule.fn is None
                         and config.dtype.itemsize < piece.dtype.itemsize)
        order = None if pattern.order is None else torch.tensor(pattern.order, device=p.device)
        return MatrixWork(name, p, group, lr_scale, local_shape, piece.dtype, layout, GroupRef(process_group), count,
                          m, n, config, blocks, order, column_blocks, narrow_return=narrow_return, rule=rule)
