"""Early start: Newton–Schulz during the backward pass, the decision at ``step()``.

Without it, every Newton–Schulz call waits for ``step()``, after the whole backward pass, and
sits on the critical path in full. With it, a bucket of the step plan starts as soon as the
gradients of its matrices are final — from a post-accumulate-grad hook, which autograd calls
for plain tensors and FSDP2 calls after the reduce-scatter (and HSDP's all-reduce) of the
module's gradients — while the backward pass goes on with earlier layers:

    backward of layer L … 1       hook: bucket k's gradients final → its exchange and NS start
    step()                        finish the run → the ranks agree → apply the updates (or not)

The plan's buckets are cut in the order the backward pass finishes gradients (the model's order
reversed), and the run is the engine's staged run of the step plan (:meth:`Engine.stages`; with
several exchange groups, such as expert stacks beside matrices, one group's after the other's),
driven by the hooks instead of by ``step()``, so the same calls run on the same values as in a
step without early start: the same bits.

What runs early changes nothing the user can see: the momentum the Newton–Schulz input needs is
computed out of place, and the updates are held until ``step()``. There the run is finished
(every rank issues the rest of its collectives, so none is left waiting), the ranks agree, and
the held updates are applied only if every rank can use them: no rank skipped the step
(non-finite gradients), the step stepped the same parameters with the same plan, and on every
rank every gradient and momentum buffer is the tensor, at the version and with the values, that
the run read. A gradient changed after it was read — a second backward (gradient accumulation
outside ``Muon.accumulating()``, the layouts' ``no_sync()`` or FSDP2's
``set_requires_gradient_sync(False)``, which keep earlier micro-batches from starting anything),
clipping or unscaling between ``backward()`` and ``step()`` — makes the step run as without
early start, and early start turns itself off with a warning, since it would only repeat work.
A change is found by the gradient's version counter where the gradient has its memory to itself
(views of one buffer share a counter, so FSDP2's gradients, views of one reduce-scatter output,
count each other's accumulation), and always by its :func:`~dmuon.tensors.digest` (the sums of
its bits and of its values), which sees what the counter does not (GradScaler's unscaling,
foreach ops on DTensors such as ``clip_grad_norm_``'s, writes through ``.data``): a change of one
element or a scaling moves it; a change that keeps both sums (a permutation of a gradient's
elements, in place in a shared buffer or through ``.data``) would escape it.

Memory: the held updates are one tensor per Muon parameter (this rank's piece), as large as the
momentum; with the momentum, the state is then AdamW's two tensors per parameter.

Where it pays: ``early_start=None`` (the default) turns it on for CUDA parameters, where the
run's own stream fills the backward pass's idle time, and off on CPU, where the hooks run on the
backward pass's own thread and there is no idle time to fill (no gain beyond the noise was
measured, and the held updates cost memory). It does not pay on small models whose step is bound
by kernel launches: pass ``early_start=False`` there. ``True`` forces it. The measurements behind
these defaults are in docs/options.md ("Early start").

DDP: a parameter's gradient is final only once DDP's all-reduce of its bucket is done, after
its post-accumulate-grad hook. ``Muon.register_ddp_comm_hook(model)`` registers dmuon's comm hook
(:func:`reduce_ddp_bucket`): DDP's own reduction (scale by 1 / world size, one summing
all-reduce: the same bits), which also hands each bucket to the run. A bucket is taken as final
when DDP starts the next bucket's all-reduce (the hook waits for the one before), and the last
at ``step()``. DDP's gradients are then in its bucket, copied into ``param.grad`` only at the
end of the backward pass (unless ``gradient_as_bucket_view``), so ``step()`` checks that
``param.grad`` has the bits the run read. Under ``no_sync`` DDP calls no hook, so gradient
accumulation starts nothing before the last micro-batch. Without the comm hook, DDP's
parameters run as without early start.

Owner sharding (:mod:`dmuon.owner`): a matrix's gradient is final on its owner once the reduce
of its layer is done. The sharding tells early start (``notify_final_gradients``): while it
listens, it waits for a layer's reduce when the next layer's starts, instead of all at the end of
the backward pass. Each owner's plan holds only its own matrices and exchanges nothing, so each
rank's run goes at its own pace. Across replicas (HSDP) the sums meet only at the end of the
backward pass, and the step runs as without early start.

Where the step plan has strategies that do not run in stages (gangs, the pieces exchange of
FSDP + tensor parallel and 2-D blocks, distributed Newton–Schulz), or with ``compile`` or
``cuda_graphs``, or with row-wise tensor parallel, the step runs as without early start;
:attr:`EarlyStart.status` says why. On CUDA the early work runs on a stream of its own, so that
it can overlap the backward pass.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator, Sequence
from enum import Enum, IntEnum
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from dmuon import momentum
from dmuon.exchange import all_reduce_max, start_all_reduce_sum
from dmuon.layout import owned_by
from dmuon.param_groups import MuonParam
from dmuon.step.elementwise import momentum_out_of_place
from dmuon.step.engine import Bucket, Engine
from dmuon.step.plan import StepPlan
from dmuon.step.values import StepValues
from dmuon.strategies.planned import PlannedExchange
from dmuon.tensors import digest, local, owns_its_memory, same_bits_each


class RunUse(IntEnum):
    """What a rank's run can be used for at ``step()``; the ranks agree on the highest (it
    travels in the agreement's header as a number)."""

    USED = 0  # its held updates are applied
    NOT_USED = 1  # a gradient missing or a buffer changed: the step runs the plan itself
    CHANGED = 2  # the gradients changed after the backward pass: redone, and early start turned off


USED, NOT_USED, CHANGED = RunUse.USED, RunUse.NOT_USED, RunUse.CHANGED


class State(Enum):
    """Where an optimizer's early start stands; :attr:`EarlyStart.status` says it in words."""

    DISABLED = "off (early_start=False)"
    PENDING = "not yet: it starts after the first step"
    ON = "on"
    OFF = "off"  # where it cannot run or does not pay, or turned off: the reason goes with it


# a DDP bucket being all-reduced: (its parameters, their gradients in it, the all-reduce's future)
Reducing = tuple[list[Tensor], list[Tensor], torch.futures.Future]


def wanted(setting: bool | None, device_type: str) -> bool:
    """Whether early start should run for parameters on ``device_type`` (None: where it pays)."""
    return setting if setting is not None else device_type == "cuda"


def unsupported_because(plan: StepPlan, compiled: bool, ddp: DDPReduction | None = None,
                        ddp_may_follow: bool = False) -> str | None:
    """Why early start cannot run ``plan`` (None: it can); ``ddp``: the comm hook that tells when
    DDP's all-reduce of a parameter's gradient is done, if one is registered; ``ddp_may_follow``:
    replicated parameters pass, as that hook may still be registered (at construction)."""
    if compiled:
        return "compile or cuda_graphs: the compiled step runs as a whole"
    if not all(isinstance(s, PlannedExchange) for s in plan.strategies):
        return ("the plan has gangs, pieces exchanges (FSDP + tensor parallel, 2-D blocks) or distributed "
                "Newton-Schulz, which do not run in stages")
    for work in plan.works:
        p = work.param
        if ddp is not None and id(p) in ddp.params:
            continue  # final once DDP's all-reduce of its bucket is done: the comm hook says when
        owned = owned_by(p)
        if owned is not None:
            if owned.sharding.across_replicas:
                return (f"{work.name!r} is owner-sharded across replicas (HSDP): its gradient is final only "
                        "after the replicas' sums meet, at the end of the backward pass")
            continue  # final once the owner's reduce is done: the sharding says when
        if work.process_group is None:
            continue
        if not isinstance(p, DTensor):
            if ddp_may_follow:
                continue
            return (f"{work.name!r} is replicated (DDP): its gradient is final only after DDP's all-reduce; "
                    "optimizer.register_ddp_comm_hook(ddp_model) tells early start when that is done")
        if work.layout.transposed or any(not isinstance(pl, (Shard, Replicate)) or (isinstance(pl, Shard) and pl.dim)
                                         for pl in p.placements):
            return f"{work.name!r} is sharded on its columns (row-wise tensor parallel)"
    return None


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


class _Run:
    """One backward pass's early run of a step plan: the engine's staged run
    (:meth:`Engine.stages`), driven by the gradient hooks, its updates held.

    Before its first bucket starts, the ranks agree (one all-reduce over ``group``, where the
    plan exchanges anything) whether any of them holds this backward pass back
    (``Muon.accumulating()``); if one does, none starts anything until the next backward pass,
    so that every rank issues the run's collectives at the same points of the backward pass
    and ``accumulating()`` can stay local to a rank."""

    def __init__(self, plan: StepPlan, state: dict, engine: Engine, stream: Any,
                 group: dist.ProcessGroup | None = None) -> None:
        self.made_with = (plan, state, engine, stream, group)  # for :meth:`again`
        self.plan = plan
        self.values = EarlyValues(plan, state)
        self.engine, self.stream = engine, stream
        # the ranks that agree on holding a backward pass back: only where the run exchanges
        self.group = group if any(w.process_group is not None for w in plan.works) else None
        self.device = plan.works[0].param.device
        # the exchange groups' planned exchanges one after the other, as at step(); a bucket is
        # (the strategy's position, the bucket's), in the order the stages reach them
        self.stages: Iterator[Bucket] = engine.stages(plan.strategies, self.values)
        self.order: list[Bucket] = [(s, k) for s, strategy in enumerate(plan.strategies)
                                    for k in range(len(strategy.buckets))]
        self.waiting = self._waiting()
        self.seen: set[int] = set()
        self.agreed = False  # the ranks agreed to start its first bucket
        # the gradients seen in a backward pass some rank held back, until one comes again
        self.held_back: set[int] | None = None
        self.started = False
        self.next: Bucket | None = self.order[0] if self.order else None  # the bucket the run waits for
        self.repeated = False  # a gradient was final twice (a second backward pass)
        self.reducing: Reducing | None = None  # DDP's bucket whose all-reduce was started last

    @property
    def touched(self) -> bool:
        """Whether a gradient reached the run (it read something, or holds a backward pass back)."""
        return bool(self.seen) or self.held_back is not None or self.started or self.reducing is not None

    def again(self) -> _Run:
        """A new run of the same plan, for a backward pass that begins anew."""
        return _Run(*self.made_with)

    def _waiting(self) -> dict[Bucket, set[int]]:
        """The parameters each bucket waits for."""
        return {(s, k): {id(self.plan.works[i].param) for i in self.plan.strategies[s].buckets[k].indices}
                for s, k in self.order}

    def ready(self, p: Tensor, held: bool = False) -> None:
        """``p``'s gradient is final: start every bucket whose gradients all are, in order.
        ``held``: this rank holds this backward pass back (``Muon.accumulating()``)."""
        if self.held_back is not None:
            if id(p) not in self.held_back:
                self.held_back.add(id(p))
                return
            self.held_back = None  # p's gradient again: the next backward pass
        if id(p) in self.seen:
            self.repeated = True
            return
        self.seen.add(id(p))
        for waiting in self.waiting.values():
            waiting.discard(id(p))
        while self.next is not None and not self.waiting[self.next]:
            if not self.agreed:
                if self._held_anywhere(held):
                    self.held_back, self.seen, self.waiting = self.seen, set(), self._waiting()
                    return
                self.agreed = True
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
        self.agreed, self.held_back = True, None  # every rank is here: nothing to hold back
        if self.reducing is not None:  # DDP's last bucket: its all-reduce is done by now
            self._ready_reduced(self.reducing)
            self.reducing = None
        while self.next is not None:
            self._advance()
        if self.stream is not None:  # the stream of the run's device: not cuda:0's where set_device was never called
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self.engine.count_traffic()
        self.engine.stats.early_buckets = (begun, len(self.order))

    def _advance(self) -> None:
        if not self.started:
            self.started = True
            self.engine.start_step()  # the statistics count this run
        if self.stream is None:
            self.next = next(self.stages, None)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self.next = next(self.stages, None)

    def code(self, state: dict) -> RunUse:
        """Whether this rank can apply the held updates (:attr:`dmuon.agreement.Agreed.early`),
        once finished: USED when the gradients and buffers it read are there now, unchanged, with
        the same momentum options; NOT_USED when a gradient is missing, the state changed (a loaded
        state dict, a changed momentum, a momentum buffer written to, also through ``.data``);
        CHANGED when a gradient changed after it was read.

        A gradient is unchanged when the tensor read is at the version read and ``param.grad``
        either lies in the memory read with the digest read (some in-place changes leave the
        version as it was: GradScaler's unscaling, foreach ops on DTensors) or (DDP without
        ``gradient_as_bucket_view``, which copies its reduced bucket into ``param.grad`` at the
        end of the backward pass) has the bits of the tensor read."""
        if self.repeated:
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


class EarlyStart:
    """An optimizer's early start: the hooks on its Muon parameters and the run of the current
    backward pass; DDP's comm hook, once registered (``ddp``) and once the ranks agreed on it
    (``ddp_agreed``); whether a backward pass is held back (``paused``, inside
    :meth:`accumulating`). ``setting``: the ``early_start`` option (None: wherever supported)."""

    def __init__(self, setting: bool | None) -> None:
        self.setting = setting
        self.state = State.DISABLED if setting is False else State.PENDING
        self.reason = ""  # why it is OFF
        # id(param) (or of an owner sharding) -> hook handle. The hooks hold this object weakly, and
        # go when it goes: a parameter must not keep an optimizer that was dropped alive, nor run its work.
        self._hooks: dict[int, Any] = {}
        weakref.finalize(self, _remove, self._hooks)
        self._run: _Run | None = None
        self._stream: Any = None
        self.ddp: DDPReduction | None = None  # the comm hook of a DDP model, once registered
        self.ddp_agreed = False  # every rank registered it (a step's agreement): it hands over its buckets
        self.paused = False  # inside Muon.accumulating(): gradients are not final yet

    def arm(self, plan: StepPlan | None, state: dict, engine: Engine, compiled: bool,
            group: dist.ProcessGroup | None = None) -> None:
        """After a step: run ``plan`` early in the next backward pass, where it can; ``group``:
        the optimizer's ranks, which agree before the run's first bucket (:class:`_Run`)."""
        self._run = None
        if self.setting is False or plan is None:
            return
        why = unsupported_because(plan, compiled, self.agreed_ddp)
        params = [w.param for w in plan.works]
        if why is None and not wanted(self.setting, params[0].device.type):
            why = ("on CPU it does not pay: the hooks run on the backward pass's own thread, which leaves no idle "
                   "time to fill (measured no faster beyond the noise; early_start=True forces it)")
        if why is not None:
            self.state, self.reason = State.OFF, why
            self._remove_hooks()
            return
        # DDP's parameters: its comm hook says when they are final; owner-sharded ones: their sharding
        owned = [owned_by(p) for p in params]
        ddp = self.agreed_ddp
        hooked = [p for p, o in zip(params, owned) if o is None and (ddp is None or id(p) not in ddp.params)]
        shardings = {id(o.sharding): o.sharding for o in owned if o is not None}
        if set(self._hooks) != {id(p) for p in hooked} | set(shardings):
            self._remove_hooks()
            ready = partial(_ready_weakly, weakref.ref(self))
            self._hooks.update({id(p): p.register_post_accumulate_grad_hook(ready) for p in hooked})
            final = partial(_final_weakly, weakref.ref(self))
            self._hooks.update({key: s.notify_final_gradients(final) for key, s in shardings.items()})
        if params[0].device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(device=params[0].device)
        self._run = _Run(plan, state, engine, self._stream, group)
        self.state = State.ON

    @property
    def agreed_ddp(self) -> DDPReduction | None:
        """DDP's comm hook where it hands its buckets over (every rank registered it)."""
        return self.ddp if self.ddp_agreed else None

    @property
    def status(self) -> str:
        """"on", or "off: <why>" (``Muon.early_start``)."""
        if self.state is State.OFF:
            return f"off: {self.reason}"
        if self.state is State.ON and self._stream is not None:
            return "on (a CUDA stream of its own)"
        return self.state.value

    def check(self, plan: StepPlan, compiled: bool, ddp_may_follow: bool = False) -> None:
        """With ``early_start=True``: raise if it cannot run ``plan``."""
        why = unsupported_because(plan, compiled, self.agreed_ddp, ddp_may_follow)
        if why is not None:
            raise ValueError(f"Invalid early_start=True: {why}. Pass early_start=None (where supported) or False.")

    def register_ddp(self, model: nn.Module, job: dist.ProcessGroup | None, muon: Sequence[MuonParam]) -> None:
        """:meth:`dmuon.Muon.register_ddp_comm_hook`: checked, then registered; it hands DDP's
        buckets over once the ranks agree on it (:meth:`use_agreed_ddp`)."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"register_ddp_comm_hook needs a DistributedDataParallel model, got "
                            f"{type(model).__name__}.")
        theirs = model.process_group
        if job is not None and dist.get_process_group_ranks(job) != dist.get_process_group_ranks(theirs):
            raise ValueError(f"The DDP model reduces over ranks {dist.get_process_group_ranks(theirs)}, this "
                             f"optimizer works over ranks {dist.get_process_group_ranks(job)}: build the optimizer "
                             "from the DDP model (dmuon.Muon(ddp_model)) or pass its process_group.")
        if self.ddp is not None:
            raise ValueError("register_ddp_comm_hook was called before on this optimizer: it serves one DDP model.")
        in_model = {id(p) for p in model.parameters()}
        replicated = [m for m in muon if owned_by(m.param) is None]
        if replicated and not any(id(m.param) in in_model for m in replicated):
            raise ValueError(f"register_ddp_comm_hook: the DDP model ({type(model.module).__name__}) holds none of "
                             f"this optimizer's Muon parameters (such as {replicated[0].name!r}): pass the DDP model "
                             "of the parameters the optimizer steps.")
        self.ddp = DDPReduction.of(model)  # DDP raises if the model has another comm hook

    def use_agreed_ddp(self) -> bool:
        """After a step's agreement, which compared whether each rank registered the DDP comm
        hook: from now on it hands its buckets to this early start (the runs' collectives then
        match on every rank). Whether this changed anything (the plan then changes too)."""
        if self.ddp is None or self.ddp_agreed:
            return False
        self.ddp.hand_to(self)
        self.ddp_agreed = True
        return True

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """:meth:`dmuon.Muon.accumulating`."""
        previous, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = previous

    def _ready(self, p: Tensor) -> None:
        if self._run is not None:
            self._run.ready(p, self.paused)

    def _reduced(self, bucket: Reducing) -> None:
        if self._run is not None:
            self._run.reduced(bucket, self.paused)

    def finish(self) -> _Run | None:
        """At ``step()``: the current run, finished — started in the backward pass or not, so
        that every rank issues the same collectives (None if none was armed)."""
        run, self._run = self._run, None
        if run is not None:
            run.finish()
        return run

    def restart(self) -> None:
        """The gradients the current run read are gone (zeroed; the backward pass that gave them
        raised): a run a gradient reached starts over on its plan. What it began, it began on
        every rank alike (each caught the failure at the same point), and it is let go."""
        if self._run is not None and self._run.touched:
            self._run = self._run.again()

    def turn_off(self, why: str) -> None:
        self.setting = False
        self.state, self.reason = State.OFF, why
        self._remove_hooks()
        warnings.warn(f"dmuon early start turned off: {why}. Steps are exact either way; pass early_start=False to "
                      "silence this.", stacklevel=4)

    def _remove_hooks(self) -> None:
        _remove(self._hooks)

    def __deepcopy__(self, memo: dict) -> EarlyStart:
        return EarlyStart(self.setting)  # a copy of an optimizer starts without hooks or a run

    def __getstate__(self) -> dict[str, Any]:
        return {"setting": self.setting}

    def __setstate__(self, saved: dict[str, Any]) -> None:
        self.__init__(saved["setting"])


class DDPReduction:
    """The state of dmuon's DDP comm hook (:func:`reduce_ddp_bucket`): the DDP model's parameters
    and process group, and the early start it hands buckets to (held weakly: a model that
    outlives its optimizer still reduces its gradients, and only that; None until the ranks
    agreed on it). One per model (:meth:`of`): DDP takes one comm hook, and an optimizer made
    later for the same model takes the hook over."""

    _of_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, model: Any) -> None:
        self.early: weakref.ref | None = None  # set by hand_to
        self.params = {id(p) for p in model.parameters()}
        self.process_group = model.process_group

    @classmethod
    def of(cls, model: Any) -> DDPReduction:
        """``model``'s reduction: the one its comm hook has, or a new one with the hook registered
        (DDP raises if the model has another comm hook)."""
        reduction = cls._of_model.get(model)
        if reduction is None:
            reduction = cls(model)
            model.register_comm_hook(reduction, reduce_ddp_bucket)
            cls._of_model[model] = reduction
        return reduction

    def hand_to(self, early: EarlyStart) -> None:
        """From now on, hand the buckets to ``early`` (all ranks agreed)."""
        self.early = weakref.ref(early)


# unannotated: DDP checks the annotations against dist.GradBucket and Future[Tensor], which this
# module's postponed (string) annotations would not be
def reduce_ddp_bucket(state, bucket):  # noqa: ANN001, ANN201
    """A DDP comm hook: DDP's own gradient reduction (the bucket scaled by 1 / world size, then
    summed by one all-reduce: the same bits as DDP's built-in one), which also hands the bucket to
    early start once its all-reduce has started. DDP calls comm hooks in the same bucket order on
    every rank, so the collectives the early run issues from here come in the same order too."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / state.process_group.size())
    done = start_all_reduce_sum(buffer, state.process_group).get_future()
    early = state.early() if state.early is not None else None
    if early is not None:
        early._reduced((bucket.parameters(), bucket.gradients(), done))
    return done.then(_the_tensor)


def _the_tensor(done: torch.futures.Future) -> Tensor:
    return done.value()[0]


def _ready_weakly(early: weakref.ref, p: Tensor) -> None:
    """A parameter's hook: tell its optimizer's early start, if that still exists."""
    alive = early()
    if alive is not None:
        alive._ready(p)


def _final_weakly(early: weakref.ref, params: Sequence[Tensor] | None) -> None:
    """An owner sharding's listener: each parameter as its hook would (:func:`_ready_weakly`);
    None: the backward pass that gave the earlier ones raised, so the run starts over."""
    if params is None:
        alive = early()
        if alive is not None:
            alive.restart()
        return
    for p in params:
        _ready_weakly(early, p)


def _remove(hooks: dict[int, Any]) -> None:
    for handle in hooks.values():
        handle.remove()
    hooks.clear()
