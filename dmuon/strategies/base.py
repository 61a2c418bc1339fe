"""What every strategy shares: the description of one matrix's work, the step's input/output
interface, the statistics, and the batched Newton–Schulz call.

A :class:`MatrixWork` is *static*: built once per step plan, it says how a parameter is laid
out and orthogonalized, never what its values are. The values flow through :class:`StepIO`,
which the optimizer provides each step: a strategy asks it for the Newton–Schulz inputs of the
works it is about to send or orthogonalize (in batches, so the element-wise work runs as
``torch._foreach_*`` calls), and hands it the updates as they arrive.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.exchange import CommCounter, GroupRef, all_reduce_sum
from dmuon.layout import Layout
from dmuon.orthogonalization import NSConfig, newton_schulz_flops
from dmuon.planner import Unit
from dmuon.row_blocks import describe_blocks, from_blocks, to_blocks
from dmuon.rules import RULES, UpdateRule


@dataclass(frozen=True)
class Block:
    """Rows of a fused matrix orthogonalized on their own, and the factor their result takes."""

    rows: int
    config: NSConfig
    scale: float


@dataclass(frozen=True, eq=False)
class MatrixWork:
    """One Muon parameter in the step plan: how it is orthogonalized, and where its values live
    (the same every step; the values themselves go through :class:`StepIO`).

    The whole Newton–Schulz input is ``count`` m×n matrices, laid out as ``layout.shape``; this
    rank's piece of it (and of the update) has ``local_shape``, in the exchange's orientation
    (:attr:`exchange_transposed`: the parameter's transpose). ``blocks``: for fused weights, the
    row blocks orthogonalized separately, each result scaled by its block's factor (empty: the
    whole matrix, with ``config``, unscaled, and ``lr_scale`` applies).
    """

    name: str
    param: Tensor
    param_group: dict[str, Any]  # lr, weight decay and momentum are read from it each step
    lr_scale: float  # r(m, n) of adjust_lr_fn (1 for fused weights: their blocks carry theirs)
    local_shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout
    process_group_ref: GroupRef  # the exchange's process group (held weakly)
    count: int
    m: int
    n: int
    config: NSConfig
    blocks: tuple[Block, ...] = ()
    # the matrix's rows block by block (dmuon.row_blocks), on the parameter's device; None: as held
    row_order: Tensor | None = None
    # distributed NS: the local input is this rank's column block (count, m, n_local) of a matrix
    # whose Gram side is m, and the update this rank's columns of the result
    column_blocks: bool = False
    # split over a gang of positions of the exchange group (choices.choose_gangs); empty: not
    gang: tuple[int, ...] = ()
    # the update is exactly in Newton–Schulz's dtype, narrower than the parameter's: its values
    # are that dtype's widened, so the exchanges (planned, gangs) send it back in that dtype, exactly
    # (the step plan decides where: no fused-block scale after it, kernels that round every product)
    narrow_return: bool = False
    # what the owner does to the whole update before it goes back (dmuon.rules)
    rule: UpdateRule = RULES["muon"]

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group of the exchange, None in one process."""
        return self.process_group_ref()

    @property
    def exchange_transposed(self) -> bool:
        """Whether the exchange sees the parameter's transpose: Shard(1) rows, or the column
        blocks of a Shard(0) matrix."""
        return self.layout.transposed != self.column_blocks

    @property
    def param_rows(self) -> int:
        """Rows of the parameter's matrices (of its own orientation, not the exchange's)."""
        return self.n if self.exchange_transposed else self.m

    @cached_property  # a frozen dataclass's cache: written to the instance's __dict__ directly
    def row_blocks(self) -> list[tuple[int, NSConfig]]:
        """(rows, config) of each Newton–Schulz call's matrix: the fused blocks, or the whole."""
        return [(b.rows, b.config) for b in self.blocks] or [(self.m, self.config)]


def wire_dtype(work: MatrixWork, comm_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``work``'s values cross the network in: ``comm_dtype``, or the parameter's."""
    return comm_dtype or work.dtype


def return_dtype(work: MatrixWork, comm_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``work``'s update goes back from its owner in: ``comm_dtype``, or Newton–Schulz's
    where that loses nothing (:attr:`MatrixWork.narrow_return`), or the parameter's."""
    if comm_dtype is not None:
        return comm_dtype
    return work.config.dtype if work.narrow_return else work.dtype


def unit_of(work: MatrixWork, itemsize: int, return_itemsize: int | None = None) -> Unit:
    """The planner's view of a work: its shape, layout, bytes per element on the wire (to the
    owner, and back if that differs), FLOPs."""
    per_matrix = sum(newton_schulz_flops(rows, work.n, steps=c.steps, method=c.method, restarts=c.restarts)
                     for rows, c in work.row_blocks)
    blocks = describe_blocks([b.rows for b in work.blocks], work.row_order is not None) if work.blocks else ""
    return Unit(work.name, work.layout, work.count, work.m, work.n, itemsize, work.count * per_matrix,
                return_itemsize, blocks)


class StepIO(Protocol):
    """The values of one step, by index into the step plan's works."""

    def inputs(self, indices: Sequence[int]) -> list[Tensor]:
        """This rank's Newton–Schulz inputs of those works (shaped ``local_shape``), computed now."""

    def apply(self, indices: Sequence[int], updates: Sequence[Tensor], norms: Tensor | None = None) -> None:
        """Apply this rank's pieces of those works' updates (shaped ``local_shape``); ``norms``:
        their 2-norms (in fp32 at least), where the caller has them from a batch already."""

    def ruled(self, indices: Sequence[int], updates: Sequence[Tensor]) -> list[Tensor]:
        """On their owner: those works' whole updates (``(count, m, n)``, exchange orientation)
        after their update rules (:mod:`dmuon.rules`), a fused work's blocks each as its own
        matrix; the new row states are kept for :meth:`new_row_state`."""

    def new_row_state(self, index: int) -> Tensor | None:
        """The row state :meth:`ruled` made for that work on this rank (its owner), else None."""

    def set_row_states(self, indices: Sequence[int], states: Sequence[Tensor]) -> None:
        """Those works' new row states, from their owners (written, or held with the updates)."""

    def overlap(self) -> None:
        """Run the step's work that needs nothing from the exchange (AdamW), the first time it
        is called: a strategy calls it where it would otherwise only wait on the network, and
        the engine after the last strategy."""


class Strategy(Protocol):
    """How some of a step plan's works are orthogonalized across ranks (one module of
    :mod:`dmuon.strategies` each). Built once per step plan, with the indices of its works and
    everything it needs worked out (owners, buckets, process groups); every rank runs every
    strategy of the plan, in the plan's order."""

    indices: list[int]  # its works, by index into the step plan's

    def run(self, io: StepIO, ctx: Context) -> None:
        """Ask ``io`` for the inputs, orthogonalize, and hand ``io`` this rank's updates. A
        strategy that can run bucket by bucket also has ``buckets``, ``stages(io, ctx)``, an
        iterator that yields each bucket's index before it first reads that bucket's inputs
        (:meth:`dmuon.step.engine.Engine.stages` prefers it), and ``bucket_indices(k)``, bucket
        k's works by index into the step plan's (the row and piece exchanges)."""


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
    # early start (dmuon.step.early): buckets begun in the backward pass, of how many in all
    early_buckets: tuple[int, int] = (0, 0)
    # every Newton–Schulz call, in order: (input shape, dtype, config, on column blocks), so that a
    # benchmark can time the same calls alone (dmuon bench's optimizer-step efficiency)
    ns_calls: list[tuple[tuple[int, ...], torch.dtype, NSConfig, bool]] = field(default_factory=list)
    # Newton–Schulz time: host seconds on CPU, (start, end) CUDA event pairs on CUDA, read lazily
    _ns_spans: list = field(default_factory=list)

    @property
    def ns_seconds(self) -> float:
        """Time this rank spent in Newton–Schulz calls (on CUDA it waits for their kernels: an
        event's time is there only once it has completed)."""
        total = 0.0
        for span in self._ns_spans:
            if isinstance(span, float):
                total += span
            else:
                span[1].synchronize()
                total += span[0].elapsed_time(span[1]) / 1e3
        return total

    def __repr__(self) -> str:
        """A line a person reads (on CUDA it waits for the step's Newton–Schulz kernels)."""
        text = (f"StepStats(this rank: {self.matrices_orthogonalized} matrices orthogonalized, "
                f"{self.ns_flops / 1e9:.3g} GFLOP in {len(self.ns_calls)} Newton–Schulz calls, "
                f"{self.ns_seconds * 1e3:.1f} ms; {self.bytes_sent / 2**20:.3g} MiB sent in {self.collectives} "
                f"collectives")
        if self.early_buckets[1]:
            text += f"; {self.early_buckets[0]} of {self.early_buckets[1]} buckets begun in the backward pass"
        if self.gangs:
            text += f"; {len(self.gangs)} matrices split over gangs"
        return text + ")"


class Timed:
    """Times one Newton–Schulz call on ``x`` into ``stats`` and lists it there: host time on CPU;
    CUDA events otherwise, so that timing never synchronizes the step."""

    def __init__(self, stats: StepStats, x: Tensor, config: NSConfig, *, column_blocks: bool = False) -> None:
        self.stats, self.cuda = stats, x.device.type == "cuda"
        stats.ns_calls.append((tuple(x.shape), x.dtype, config, column_blocks))

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


@dataclass
class Context:
    """What a strategy uses while it runs: the Newton–Schulz function (plain, compiled or
    graphed), the wire dtypes, and this step's byte counter and statistics."""

    orthogonalize: Callable[[Tensor, NSConfig], Tensor]
    comm_dtype: torch.dtype | None
    counter: CommCounter = field(default_factory=CommCounter)
    stats: StepStats = field(default_factory=StepStats)

    def wire_dtype(self, work: MatrixWork) -> torch.dtype:
        return wire_dtype(work, self.comm_dtype)

    def return_dtype(self, work: MatrixWork) -> torch.dtype:
        return return_dtype(work, self.comm_dtype)

    def orthogonalize_whole(self, inputs: dict[int, Tensor | list[Tensor]], works: Sequence[MatrixWork],
                            batches: Sequence[Batch], flops: int, io: StepIO, indices: Sequence[int]
                            ) -> dict[int, Tensor]:
        """Orthogonalize whole inputs in ``batches`` (from :func:`batches_of`, worked out once):
        work index → its (count, m, n) input, or the flat pieces that laid end to end are that
        input (an owner's gather: copied once, straight into the batch). ``flops``: theirs in
        total, for the statistics. Then each work's update rule (``io.ruled``; ``indices``: the
        works' in the step plan), then each fused block's lr factor: the rule sees the blocks
        as the matrices they are, before the lr factor, as in one process."""
        self.stats.ns_flops += flops
        for u, value in inputs.items():
            if not isinstance(value, Tensor) and len(works[u].row_blocks) > 1:  # row blocks slice the whole
                value = torch.cat([v.reshape(-1) for v in value]).reshape(works[u].count, works[u].m, works[u].n)
            if len(works[u].row_blocks) > 1:
                inputs[u] = to_blocks(value, works[u].row_order, dim=1)
        results: dict[tuple[int, int], Tensor] = {}  # (work, block) -> its update
        for config, rows, members in batches:
            # one contiguous copy, as every call before it: the same memory layout, the same result
            stacked = self._stack(inputs, works, rows, members)
            with Timed(self.stats, stacked, config):
                updates = self.orthogonalize(stacked, config).split([works[u].count for u, _, _, _ in members])
            results.update(((u, b), r) for (u, b, _, _), r in zip(members, updates))
            self.stats.matrices_orthogonalized += stacked.shape[0]
        outputs = {u: results[u, 0] if not works[u].blocks else
                   torch.cat([results[u, b] for b in range(len(works[u].blocks))], dim=1) for u in inputs}
        ruled = [u for u in outputs if works[u].rule.fn is not None]
        if ruled:
            outputs.update(zip(ruled, io.ruled([indices[u] for u in ruled], [outputs[u] for u in ruled])))
        for u, output in outputs.items():
            start = 0
            for block in works[u].blocks:
                output[:, start: start + block.rows].mul_(block.scale)
                start += block.rows
        return {u: from_blocks(output, works[u].row_order, dim=1) for u, output in outputs.items()}

    @staticmethod
    def _stack(inputs: dict[int, Tensor | list[Tensor]], works: Sequence[MatrixWork], rows: int,
               members: Sequence[tuple[int, int, int, bool]]) -> Tensor:
        first = inputs[members[0][0]]
        like = first if isinstance(first, Tensor) else first[0]
        count = sum(works[u].count for u, _, _, _ in members)
        stacked = torch.empty((count, rows, works[members[0][0]].n), dtype=like.dtype, device=like.device)
        offset = 0
        for u, _, start, whole in members:
            slot, value = stacked[offset: offset + works[u].count], inputs[u]
            offset += works[u].count
            if isinstance(value, Tensor):
                slot.copy_(value if whole else value[:, start: start + rows])
                continue
            flat = slot.view(-1)
            for piece in value:
                flat[: piece.numel()].copy_(piece.reshape(-1))
                flat = flat[piece.numel():]
        return stacked


def share_row_states(indices: Sequence[int], works: Sequence[MatrixWork], io: StepIO, ctx: Context) -> None:
    """After a strategy's run: every rank of the works' exchange group takes the new row state
    of each work with an update rule that keeps one from its owner, unchanged — one all-reduce
    of the states laid end to end, the owner's own and zeros elsewhere (x + 0 = x, exactly).
    ``indices``: the works' in the step plan."""
    ruled = [u for u, work in enumerate(works) if work.rule.state is not None]
    if not ruled:
        return
    states = [io.new_row_state(indices[u]) for u in ruled]
    group = works[0].process_group
    if group is not None:
        sizes = [works[u].count * works[u].param_rows for u in ruled]
        device = next((s.device for s in states if s is not None), works[0].param.device)
        flat = torch.cat([torch.zeros(size, device=device) if s is None else s.reshape(-1)
                          for s, size in zip(states, sizes)])
        states = list(all_reduce_sum(flat, group, ctx.counter).split(sizes))
    io.set_row_states([indices[u] for u in ruled], states)


# (config, rows, members): one batched Newton–Schulz call over the pieces (work index, block,
# first row, whether it is the whole matrix) of the same shape and configuration
Batch = tuple[NSConfig, int, tuple[tuple[int, int, int, bool], ...]]


def update_norms(batch: Tensor) -> Tensor:
    """The 2-norm of each matrix of a batch of updates, in fp32 at least (the statistics' dtype),
    in one call."""
    return torch.linalg.vector_norm(batch, dim=(-2, -1), dtype=None if batch.dtype == torch.float64 else torch.float32)


def batches_of(indices: Sequence[int], works: Sequence[MatrixWork]) -> list[Batch]:
    """How :meth:`Context.orthogonalize_whole` stacks these works: same-shape, same-config pieces
    — whole matrices, or the row blocks of fused ones — share one batched call, in order."""
    batches: dict[tuple, list[tuple[int, int, int, bool]]] = {}
    for u in indices:
        start = 0
        for b, (rows, config) in enumerate(works[u].row_blocks):
            batches.setdefault((rows, works[u].n, config), []).append((u, b, start, len(works[u].row_blocks) == 1))
            start += rows
    return [(config, rows, tuple(members)) for (rows, _, config), members in batches.items()]
