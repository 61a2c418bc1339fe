"""One backward pass's early run of a step plan: the engine's staged run, driven by the gradient
hooks, its updates held; at ``step()`` finished, then judged (:meth:`Run.verdict`).

The run moves through :class:`Phase`: it *waits* until the first bucket's gradients are final;
the ranks then agree whether any of them holds this backward pass back (``Muon.accumulating()``)
— if one does, the run is *held back* until a gradient comes again (the next backward pass) —
else it *runs*, a bucket at a time as their gradients become final. A gradient final twice (a
second backward pass) makes it *repeated*: nothing more starts, and its verdict is CHANGED.
``finish()`` at ``step()`` runs what is left, on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import Enum, IntEnum
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon import momentum
from dmuon.exchange import all_reduce_max
from dmuon.step.elementwise import momentum_out_of_place
from dmuon.step.engine import Bucket, Engine
from dmuon.step.plan import StepPlan
from dmuon.step.values import StepValues
from dmuon.tensors import digest, local, owns_its_memory, same_bits_each

# a DDP bucket being all-reduced: (its parameters, their gradients in it, the all-reduce's future)
Reducing = tuple[list[Tensor], list[Tensor], torch.futures.Future]


class RunUse(IntEnum):
    """What a rank's run can be used for at ``step()``; the ranks agree on the highest (it
    travels in the agreement's header as a number)."""

    USED = 0  # its held updates are applied
    NOT_USED = 1  # a gradient missing or a buffer changed: the step runs the plan itself
    CHANGED = 2  # the gradients changed after the backward pass: redone, and early start turned off


USED, NOT_USED, CHANGED = RunUse.USED, RunUse.NOT_USED, RunUse.CHANGED


class Phase(Enum):
    """Where a run stands (module docstring)."""

    WAITING = "waiting for its first bucket's gradients"
    HELD_BACK = "held back: some rank accumulates this backward pass"
    RUNNING = "running its buckets as their gradients become final"
    REPEATED = "a gradient was final twice: a second backward pass"


class Read(NamedTuple):
    """What a Newton–Schulz input was made of."""

    grad: Tensor | None  # the gradient read (None: missing)
    grad_version: int | None  # its version then
    grad_digest: Tensor | None  # its :func:`~dmuon.tensors.digest` then
    buffer: tuple  # the momentum buffer (object and version) and the momentum options
    buffer_digest: Tensor  # its :func:`~dmuon.tensors.digest` then (writes through .data leave the version)


def buffer_mark(buf: Tensor, group: dict[str, Any]) -> tuple:
    """A momentum buffer's identity and version, with the options the momentum is made with."""
    return id(buf), buf._version, group["momentum"], group["nesterov"]


class EarlyValues(StepValues):
    """The step plan's values during the backward pass: the Newton–Schulz inputs from the
    momentum computed out of place (the buffers are not touched), the updates held (the hold
    policy of :class:`StepValues`), AdamW left for ``step()``. It notes what it read, so that
    ``step()`` can tell whether it changed."""

    def __init__(self, plan: StepPlan, state: dict) -> None:
        super().__init__(plan, state, {}, None, {}, hold=True)
        self.read: dict[int, Read] = {}  # id(param) -> what the inputs were made of
        # id(param) -> its final gradient where that is not param.grad yet: DDP's all-reduced
        # bucket, which DDP copies into param.grad at the end of the backward pass
        self.final_grads: dict[int, Tensor] = {}

    def inputs(self, indices: Sequence[int]) -> list[Tensor]:
        by_group: dict[int, tuple[dict[str, Any], list[Tensor]]] = {}
        for i in indices:
            work = self.plan.works[i]
            by_group.setdefault(id(work.param_group), (work.param_group, []))[1].append(work.param)
        for group, params in by_group.values():
            stored = [local(self.state[p]["momentum_buffer"]) for p in params]
            bufs = [momentum.value(self.state[p]) for p in params]
            # a gradient that is missing here (the run is being finished at step()): zeros stand
            # in, and step() finds the missing gradient and does not use the run
            finals = [self.final_grads.get(id(p), p.grad) for p in params]
            grads = [local(g) if g is not None else torch.zeros_like(b) for g, b in zip(finals, bufs)]
            moved = momentum_out_of_place(bufs, grads, group["momentum"])
            for p, final, g, b, m in zip(params, finals, grads, stored, moved):
                self.grads_and_buffers[id(p)] = (g, m)
                mark, buffer_digest = buffer_mark(b, group), digest(b)
                self.read[id(p)] = Read(final, g._version, digest(g), mark, buffer_digest) if final is not None \
                    else Read(None, None, None, mark, buffer_digest)
        try:
            return super().inputs(indices)
        finally:
            for i in indices:
                self.grads_and_buffers.pop(id(self.plan.works[i].param), None)


class Run:
    """One backward pass's early run of ``plan`` (module docstring); ``stream``: the CUDA stream
    it runs on (None on CPU); ``group``: the optimizer's ranks, which agree before its first
    bucket whether any of them holds the backward pass back, so that every rank issues the run's
    collectives at the same points of the backward pass and ``accumulating()`` stays local."""

    def __init__(self, plan: StepPlan, state: dict, engine: Engine, stream: torch.cuda.Stream | None,
                 group: dist.ProcessGroup | None = None) -> None:
        self.made_with = (plan, state, engine, stream, group)  # for :meth:`again`
        self.plan = plan
        self.values = EarlyValues(plan, state)
        self.engine, self.stream = engine, stream
        # the ranks that agree on holding a backward pass back: only where the run exchanges
        self.group = group if any(w.process_group is not None for w in plan.works) else None
        self.device = plan.works[0].param.device
        # the exchange groups' row and piece exchanges one after the other, as at step(); a bucket is
        # (the strategy's position, the bucket's), in the order the stages reach them
        self.stages: Iterator[Bucket] = engine.stages(plan.strategies, self.values)
        self.order: list[Bucket] = [(s, k) for s, strategy in enumerate(plan.strategies)
                                    for k in range(len(strategy.buckets))]
        self.waiting = self._waiting()
        self.phase = Phase.WAITING
        self.seen: set[int] = set()  # the parameters whose gradients are final (held back: in the pass held)
        self.next: Bucket | None = self.order[0] if self.order else None  # the bucket the run waits for
        self.reducing: Reducing | None = None  # DDP's bucket whose all-reduce was started last

    @property
    def touched(self) -> bool:
        """Whether a gradient reached the run (it read something, or holds a backward pass back)."""
        return self.phase is not Phase.WAITING or bool(self.seen) or self.reducing is not None

    def again(self) -> Run:
        """A new run of the same plan, for a backward pass that begins anew."""
        return Run(*self.made_with)

    def _waiting(self) -> dict[Bucket, set[int]]:
        """The parameters each bucket waits for."""
        return {(s, k): {id(self.plan.works[i].param) for i in self.plan.strategies[s].bucket_indices(k)}
                for s, k in self.order}

    def ready(self, p: Tensor, held: bool = False) -> None:
        """``p``'s gradient is final: start every bucket whose gradients all are, in order.
        ``held``: this rank holds this backward pass back (``Muon.accumulating()``)."""
        if self.phase is Phase.REPEATED:
            return
        if self.phase is Phase.HELD_BACK:
            if id(p) not in self.seen:
                self.seen.add(id(p))
                return
            self.phase, self.seen = Phase.WAITING, set()  # p's gradient again: the next backward pass
        if id(p) in self.seen:
            self.phase = Phase.REPEATED
            return
        self.seen.add(id(p))
        for waiting in self.waiting.values():
            waiting.discard(id(p))
        while self.next is not None and not self.waiting[self.next]:
            if self.phase is Phase.WAITING:
                if self._held_anywhere(held):
                    self.phase, self.waiting = Phase.HELD_BACK, self._waiting()
                    return
                self._start()
            self._advance()

    def _held_anywhere(self, held: bool) -> bool:
        """Whether some rank holds this backward pass back (collective over ``group``: every rank
        gets here at the same hook, the one that completes the first bucket)."""
        if self.group is None:
            return held
        # one host read in the backward pass, where early start begins: every rank must know
        # whether to issue the run's collectives
        flag = torch.full((1,), float(held), device=self.device)
        return all_reduce_max(flag, self.group, self.engine.counter).item() > 0

    def reduced(self, bucket: Reducing, held: bool = False) -> None:
        """DDP started the all-reduce of ``bucket``: the one it started before is final once its
        own all-reduce is done, and it goes on now, while this one is in flight."""
        before, self.reducing = self.reducing, bucket
        if before is not None:
            self._ready_reduced(before, held)

    def _ready_reduced(self, bucket: Reducing, held: bool = False) -> None:
        params, grads, done = bucket
        if self.stream is None:
            done.wait()
        else:
            with torch.cuda.stream(self.stream):  # the run's stream waits for the all-reduce, not the backward's
                done.wait()
        for p, g in zip(params, grads):
            self.values.final_grads[id(p)] = g
        for p in params:
            self.ready(p, held)

    def finish(self) -> None:
        """Run what is left (at ``step()``): every rank issues the rest of its collectives."""
        begun = len(self.order) if self.next is None else self.order.index(self.next)
        if self.phase is Phase.HELD_BACK:  # every rank is here: nothing to hold back
            self.phase, self.seen = Phase.WAITING, set()
        if self.phase is Phase.WAITING and self.next is not None:
            self._start()  # every rank is here: no need to agree first
        if self.reducing is not None:  # DDP's last bucket: its all-reduce is done by now
            self._ready_reduced(self.reducing)
            self.reducing = None
        while self.next is not None:
            self._advance()
        if self.stream is not None:  # the stream of the run's device: not cuda:0's where set_device was never called
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self.engine.count_traffic()
        self.engine.stats.early_buckets = (begun, len(self.order))

    def _start(self) -> None:
        self.phase = Phase.RUNNING
        self.engine.start_step()  # the statistics count this run

    def _advance(self) -> None:
        if self.stream is None:
            self.next = next(self.stages, None)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self.next = next(self.stages, None)

    def verdict(self, state: dict) -> RunUse:
        """Whether this rank can apply the held updates, once finished: USED when the gradients and
        buffers it read are there now, unchanged, with the same momentum options; NOT_USED when a
        gradient is missing or the state changed (a loaded state dict, a changed momentum, a
        momentum buffer written to, also through ``.data``); CHANGED when a gradient changed
        after it was read, or was final twice.

        A gradient is unchanged when the tensor read is at the version read and ``param.grad``
        either lies in the memory read with the digest read (some in-place changes leave the
        version as it was: GradScaler's unscaling, foreach ops on DTensors) or (DDP without
        ``gradient_as_bucket_view``, which copies its reduced bucket into ``param.grad`` at the
        end of the backward pass) has the bits of the tensor read."""
        if self.phase is Phase.REPEATED:
            return CHANGED
        code = USED
        copies = []  # (param.grad, the tensor read), to compare by their bits
        digests = []  # (param.grad's digest now, then)
        buffers = []  # (the momentum buffer's digest now, then)
        for work in self.plan.works:
            p = work.param
            read = self.values.read.get(id(p))
            if read is None:
                continue  # not an input here (DDP: another rank owns it, and checks it)
            buf = state.get(p, {}).get("momentum_buffer")
            if buf is None or p.grad is None or read.grad is None:
                code = max(code, NOT_USED)
                continue
            now, then = local(p.grad), local(read.grad)
            if then._version != read.grad_version and owns_its_memory(then):
                return CHANGED  # (a view of a shared buffer counts its neighbours' writes too: the digest decides)
            if now.data_ptr() == then.data_ptr():  # the tensor read, or (DDP's bucket views) its memory
                digests.append((digest(now), read.grad_digest))
            else:
                # DDP's copy of its reduced bucket: compared bit by bit (a digest's value sum could
                # round differently where the two are aligned differently)
                copies.append((now, then))
            if read.buffer != buffer_mark(local(buf), work.param_group):
                code = max(code, NOT_USED)
            else:
                buffers.append((digest(local(buf)), read.buffer_digest))
        grads_same, buffers_same = same_bits_each(copies + digests, buffers)
        if not grads_same:
            return CHANGED
        return code if buffers_same else max(code, NOT_USED)
