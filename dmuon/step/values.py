"""The values of one step: what the engine's strategies ask for and hand back.

The step plan (:mod:`dmuon.step.plan`) holds no tensor values; a step makes one
:class:`StepValues` from the plan and the parameters' gradients and momentum buffers. It answers
a strategy's request for Newton–Schulz inputs (computed then, from the momentum, a param group
at a time) and applies the updates the strategy hands back (``W ← W·(1 − lr·wd) − lr·r·O``),
both as ``torch._foreach_*`` calls over the parameters of a group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from dmuon.row_blocks import from_blocks, to_blocks
from dmuon.rules import apply_rule
from dmuon.step.elementwise import CompiledKernels, apply_updates_all, nesterov_inputs_all, scalar
from dmuon.step.plan import StepPlan
from dmuon.strategies.base import MatrixWork
from dmuon.tensors import local


@dataclass(frozen=True)
class _Chunk:
    """Some of a request's works that one foreach call serves: same param group, same lr factor."""

    positions: tuple[int, ...]  # in the request
    param_group: dict[str, Any]
    lr_scale: float
    params: tuple[Tensor, ...]
    transposed: tuple[bool, ...]
    numel: int  # of this rank's pieces

    indices: dict = field(default_factory=dict, compare=False)  # device -> positions there (a cache)

    @classmethod
    def of(cls, positions: list[int], works: list[MatrixWork]) -> _Chunk:
        return cls(tuple(positions), works[0].param_group, works[0].lr_scale, tuple(w.param for w in works),
                   tuple(w.exchange_transposed for w in works), sum(local(w.param).numel() for w in works))

    def of_request(self, values: Tensor) -> Tensor:
        """This chunk's entries of a request's ``values`` (on their device): a slice where the
        positions run in a row, else an index made on the device once. Indexing by a Python list
        would copy a new index to the GPU every step, and that copy waits for the GPU."""
        first, count = self.positions[0], len(self.positions)
        if self.positions == tuple(range(first, first + count)):
            return values[first:first + count]
        index = self.indices.get(values.device)
        if index is None:
            index = self.indices[values.device] = torch.tensor(self.positions, device=values.device)
        return values[index]


# a write held for another step's values to make: (the StepValues method, its arguments)
Held = tuple[Callable[..., None], tuple]


class StepValues:
    """The values of one step for the engine's strategies (:class:`dmuon.strategies.base.StepIO`): the
    Newton–Schulz inputs from the momentum (computed when asked, a group's at a time), and the
    updates applied to the parameters, with the update statistics accumulated on the device.

    An update rule's row states (:mod:`dmuon.rules`) are read from the optimizer's ``state`` and
    written back there once their owners have shared them.

    ``hold``: the updates and row states are held instead (:attr:`held`), for another step's values
    to write (:meth:`apply_held`): early start's run during the backward pass, whose updates wait
    for ``step()`` to decide whether they may be used."""

    def __init__(self, plan: StepPlan, state: dict, grads_and_buffers: dict[int, tuple[Tensor, Tensor]],
                 kernels: CompiledKernels | None, squares: dict[int, list],
                 independent: Callable[[], None] | None = None, *, hold: bool = False) -> None:
        self.plan, self.state, self.kernels = plan, state, kernels
        self.grads_and_buffers = grads_and_buffers  # id(param) -> this rank's pieces of them
        self.squares = squares  # id(param group) -> [sum of the update's squares, elements]
        self.independent = independent  # what overlap() runs once
        self.held: list[Held] | None = [] if hold else None
        self.new_row_states: dict[int, Tensor] = {}  # work index -> the row state its rule made here

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
                work = self.plan.works[i]
                by_key.setdefault((id(work.param_group), work.lr_scale), []).append(k)
            chunks = self.plan.chunks[key] = [_Chunk.of(ks, [self.plan.works[indices[k]] for k in ks])
                                              for ks in by_key.values()]
        return chunks

    def inputs(self, indices: Sequence[int]) -> list[Tensor]:
        out: list[Tensor | None] = [None] * len(indices)
        for chunk in self._by_group(indices):
            group = chunk.param_group
            grads, bufs = zip(*[self.grads_and_buffers[id(p)] for p in chunk.params])
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

    def apply_held(self, other: StepValues) -> None:
        """Make the writes ``other`` held (updates, row states), in the order it was handed them."""
        for method, args in other.held or ():
            method(self, *args)

    def ruled(self, indices: Sequence[int], updates: Sequence[Tensor]) -> list[Tensor]:
        out = []
        for i, update in zip(indices, updates):
            work = self.plan.works[i]
            # the rule sees the parameter's orientation, laid out as in one process (same sums, same bits)
            whole = (update.mT if work.exchange_transposed else update).contiguous()
            state = local(self.state[work.param][work.rule.state]).reshape(work.count, work.param_rows)
            rows = [block.rows for block in work.blocks] or [whole.shape[-2]]
            # the update's rows come block by block (dmuon.row_blocks): the row state's too, and back
            result, new_state = apply_rule(work.rule, whole, to_blocks(state, work.row_order, dim=1), rows,
                                           work.param_group)
            self.new_row_states[i] = from_blocks(new_state, work.row_order, dim=1)
            out.append(result.mT if work.exchange_transposed else result)
        return out

    def new_row_state(self, index: int) -> Tensor | None:
        return self.new_row_states.get(index)

    def set_row_states(self, indices: Sequence[int], states: Sequence[Tensor]) -> None:
        if self.held is not None:
            self.held.append((StepValues.set_row_states, (indices, list(states))))
            return
        for i, value in zip(indices, states):
            work = self.plan.works[i]
            target = local(self.state[work.param][work.rule.state])
            target.copy_(value.reshape(target.shape))

    def apply(self, indices: Sequence[int], updates: Sequence[Tensor], norms: Tensor | None = None) -> None:
        if self.held is not None:
            self.held.append((StepValues.apply, (indices, list(updates), norms)))
            return
        for chunk in self._by_group(indices):
            group, ratio = chunk.param_group, chunk.lr_scale
            params = [local(p) for p in chunk.params]
            mine = [updates[k].mT if transposed else updates[k]
                    for k, transposed in zip(chunk.positions, chunk.transposed)]
            if norms is not None:
                own = chunk.of_request(norms)
            else:  # in fp32 at least, as the statistics always are (a norm cannot narrow fp64)
                wide = any(u.dtype == torch.float64 for u in mine)
                own = torch.stack(torch._foreach_norm(mine, 2, dtype=None if wide else torch.float32))
            squares = self.squares.setdefault(id(group), [torch.zeros((), device=params[0].device), 0])
            squares[0] += own.float().square().sum() * ratio**2  # a device tensor: no sync
            squares[1] += chunk.numel
            if self.kernels is not None:
                lr, wd = scalar(group["lr"], params[0].device), scalar(group["weight_decay"], params[0].device)
                for p, u in zip(params, mine):
                    self.kernels.apply_update(p, u, lr, wd, ratio)
            else:
                apply_updates_all(params, mine, float(group["lr"]), group["weight_decay"], ratio)
