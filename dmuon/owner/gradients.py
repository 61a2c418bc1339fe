"""The backward side of an owner sharding: each layer's gradients reduced to their owners as
they arrive, averaged there and added to what earlier backward passes left (gradient
accumulation), early start told which are final, and a backward pass that raised dropped.

A backward pass that raised (caught on every rank at the same point, the loop going on) is
dropped exactly where it reduced: every gradient it reached is put back as it was before it
(an earlier pass's average, or none), so the step sees the micro-batches as if the failed one
had been skipped. Inside ``no_sync()`` nothing is reduced, and what it added stays in the local
sums, as in one process. Where it reduced and reached a gradient holding such local sums (the
pass that ends a ``no_sync()`` block), they cannot be taken apart from it: the next step raises,
until the gradients are zeroed."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dmuon.exchange import CommCounter, start_all_reduce_sum
from dmuon.owner.layer import GradientReduce, Groups, LayerState, OwnedLayer, Ownership


class TrainingState(enum.Enum):
    """Where the sharding is in a training step, on this rank."""

    IDLE = "idle"  # no gradient arrived since the last reduction finished
    BACKWARD = "backward"  # gradients arriving: each layer's reduce starts when all of its are in


class GradientReduction:
    """The gradients of an owner sharding's parameters on this rank, through a backward pass:
    as every gradient of a layer arrives its reduce to the owners starts; at the pass's end (or
    when the step asks) the reduces are waited for and each owner's gradient becomes the
    average. ``reduce_gradients`` is False inside ``no_sync()``; ``last_step_bytes`` and
    ``rest_bytes`` are what the last backward pass sent.

    Args:
        model: the sharded model (a gradient of a parameter frozen at setup is refused).
        layers: the sharding's layers.
        params: the owner-sharded parameters.
        ownership: who holds and who steps each parameter.
        groups: the process groups of the shard and replica dimensions.
        rest: the parameters kept replicated here, or None when FSDP2/DDP handles them.
    """

    def __init__(self, model: nn.Module, layers: list[OwnedLayer], params: list[nn.Parameter],
                 ownership: Ownership, groups: Groups, rest: list[nn.Parameter] | None) -> None:
        self.model, self.layers, self.params, self.rest = model, layers, params, rest
        self.ownership, self.groups = ownership, groups
        # every rank's gradient is summed: the average divides by all of them, shards × replicas
        self.ranks = (dist.get_world_size(groups.shard) if groups.shard is not None else 1) * groups.replicas
        self.state = TrainingState.IDLE
        self.reduce_gradients = True
        self._averaged: dict[int, Tensor] = {}  # an owner's averaged gradients, by id of the parameter
        self._set_aside: dict[int, Tensor] = {}  # those a later backward reached before the step used them
        self._reduces: list[GradientReduce] = []  # in flight, this backward
        self._rest_reduces: list[tuple[nn.Parameter, dist.Work]] = []
        self._layers_done = 0  # layers whose gradients all arrived, this backward
        self._rest_ready: set[int] = set()
        # a backward pass sent gradients and has not reached its end: if it is not running, it raised
        self._backward_open = False
        self._pass_reduces = True  # the open pass's reduce_gradients (no_sync() may have ended since)
        # the parameters the open pass reached, each with whether its gradient held nothing of
        # this rank's own before the pass (None, or an average set aside): what a failure restores
        self._reached: dict[int, bool] = {}
        self.lost_sums = False  # a failed pass added to local no_sync() sums: refused until zeroed
        # told which of this rank's parameters have their final (averaged) gradient, layer by
        # layer during the backward pass (early start's; notify_final_gradients); an OrderedDict,
        # as RemovableHandle holds it weakly, which a dict cannot be
        self._final_listeners: OrderedDict[int, Callable[[Sequence[nn.Parameter] | None], None]] = OrderedDict()
        self.rest_counter = CommCounter()
        self.last_step_bytes = 0
        self.rest_bytes = 0

    def before_accumulation(self, param: nn.Parameter, grad: Tensor) -> Tensor:
        """A backward pass first reaches ``param`` (before autograd adds ``grad`` to its
        gradient): an average an earlier pass left (gradient accumulation without ``no_sync``)
        is set aside, so that only this rank's new gradient is reduced, and the new average is
        added to it afterwards; and what the gradient held is noted, for a pass that raises."""
        if id(param) in self._reached:
            return grad
        self._backward_reached()
        if param.grad is not None and param.grad is self._averaged.get(id(param)):
            self._set_aside[id(param)] = param.grad
            param.grad = None
        self._reached[id(param)] = param.grad is None
        return grad

    def _backward_reached(self) -> None:
        """A gradient arrived: this backward pass is open until autograd reaches its end (a
        callback autograd runs only when the pass completes, as FSDP2's and DDP's)."""
        self.state = TrainingState.BACKWARD
        if not self._backward_open:
            self._backward_open = True
            self._pass_reduces = self.reduce_gradients
            if self.lost_sums and all(p.grad is None for p in self._all_params()):
                self.lost_sums = False  # zeroed: the refused sums are gone
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_completed)

    def _backward_completed(self) -> None:
        self._backward_open = False
        self._reached = {}

    def _all_params(self) -> list[nn.Parameter]:
        return [*self.params, *(self.rest or ())]

    def _restore_reached(self) -> None:
        """Put back what a failed pass changed of the gradients it reached (module docstring)."""
        for p in self._all_params():
            nothing_before = self._reached.get(id(p))
            if nothing_before is None:
                continue
            earlier = self._set_aside.pop(id(p), None)
            if not self._pass_reduces:  # its partial gradients stay in the local sums, as in one process
                if earlier is not None:
                    p.grad = earlier if p.grad is None else earlier.add_(p.grad)
            elif earlier is not None or nothing_before:
                p.grad = earlier
            else:
                self.lost_sums = True
        self._reached = {}

    def drop_a_failed_backward(self) -> None:
        """Where a backward pass raised (an out-of-memory error, a failing hook: caught, on every
        rank, at the same point), what it reduced is not a gradient of anything the step will
        see: wait for the reduces it started (every rank started them), keep none of their
        sums, forget its bookkeeping, and put back the gradients it reached (module docstring).
        Runs before the next forward pass and at the step; not while a backward pass runs
        (activation checkpointing recomputes layers inside one)."""
        if not self._backward_open or torch._C._current_graph_task_id() != -1:
            return
        self._backward_open = False
        for reduce in self._reduces:
            if reduce.work is not None:
                reduce.work.wait()
        for _, work in self._rest_reduces:
            work.wait()
        self._reduces, self._rest_reduces = [], []
        for layer in self.layers:
            layer.ready.clear()
            layer.release()
        self._layers_done, self._rest_ready = 0, set()
        self._restore_reached()
        self.state = TrainingState.IDLE
        self.ownership.counter.reset()
        self.rest_counter.reset()
        for listener in list(self._final_listeners.values()):
            listener(None)

    def gradient_ready(self, index: int, param: nn.Parameter) -> None:
        layer = self.layers[index]
        self._backward_reached()
        layer.ready.add(id(param))
        if len(layer.ready) == len(layer.params):
            self._layer_backward_done(layer)
            self._maybe_finish()

    def notify_final_gradients(self, listener: Callable[[Sequence[nn.Parameter] | None], None]) -> RemovableHandle:
        """Tell ``listener`` which of this rank's parameters have their final (averaged) gradient
        in ``param.grad``, as they get it, and (with None) that the backward pass they came from
        raised, so that none of them is final. While one listens (and not across replicas), a
        layer's reduce is waited for when the next layer's starts, in the backward pass, instead
        of all at its end, so that the owner can start on it (:mod:`dmuon.step.early`). Returns
        the handle that stops it."""
        handle = RemovableHandle(self._final_listeners)
        self._final_listeners[handle.id] = listener
        return handle

    def _layer_backward_done(self, layer: OwnedLayer) -> None:
        if self.reduce_gradients:
            started = layer.start_reduces()
            if self._final_listeners and not self.groups.replica is not None:
                # the layers before this one: final once their reduces are done, while this one's goes on
                self._finish_reduces(self._reduces)
                self._reduces = []
            self._reduces += started
        layer.ready.clear()
        layer.release()
        self._layers_done += 1

    def rest_gradient_ready(self, param: nn.Parameter) -> None:
        if self.reduce_gradients and self.groups.everyone is not None:
            work = start_all_reduce_sum(param.grad, self.groups.everyone, self.rest_counter)
            self._rest_reduces.append((param, work))
        self._backward_reached()
        self._rest_ready.add(id(param))
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self._layers_done == len(self.layers) and len(self._rest_ready) == len(self.rest or ()):
            self.wait()

    def wait(self) -> None:
        """Finish the reduction of the last backward pass (:meth:`OwnerSharding.wait_for_gradients`)."""
        self._check_no_stray_gradients()
        self.drop_a_failed_backward()
        if self.state is TrainingState.IDLE:
            self._restore_set_aside()
            return
        self.state = TrainingState.IDLE
        for layer in self.layers:
            if layer.ready:  # some of its parameters got gradients, others none
                self._layer_backward_done(layer)
        self._finish_reduces(self._reduces)
        for p, work in self._rest_reduces:
            work.wait()
            p.grad.div_(self.ranks)
            earlier = self._set_aside.pop(id(p), None)
            p.grad = p.grad if earlier is None else earlier.add_(p.grad)
            self._averaged[id(p)] = p.grad
        self._restore_set_aside()
        self._reduces, self._rest_reduces = [], []
        self._layers_done, self._rest_ready = 0, set()
        self._backward_open = False
        for layer in self.layers:
            if layer.state is LayerState.PREFETCHING:  # prefetched by a recomputation in backward: not needed now
                layer.release()
        self.last_step_bytes, self.rest_bytes = self.ownership.counter.bytes_sent, self.rest_counter.bytes_sent
        self.ownership.counter.reset()
        self.rest_counter.reset()

    def _finish_reduces(self, reduces: list[GradientReduce]) -> None:
        """Wait for ``reduces`` (HSDP: and for the replicas' sums to meet at replica 0); the
        owners' averaged gradients into ``param.grad``, added to what an earlier backward left
        there; then tell the listeners."""
        rank = self.ownership.rank
        gathered = []
        for reduce in reduces:
            if reduce.work is not None:
                reduce.work.wait()
            if reduce.holder != rank:
                continue
            if self.groups.replica is not None:  # HSDP: the replicas' sums meet at replica 0
                reduce = self.ownership.reduce(reduce.members, self.ownership.owner_of[id(reduce.members[0])],
                                               self.groups.replica, reduce.flat)
            gathered.append(reduce)
        final: list[nn.Parameter] = []
        for reduce in gathered:
            if reduce.work is not None:
                reduce.work.wait()
            if self.ownership.is_mine(reduce.members[0]):
                reduce.flat.div_(self.ranks)
                for p, piece in zip(reduce.members, reduce.flat.split([p.numel() for p in reduce.members])):
                    earlier = self._set_aside.pop(id(p), None)
                    p.grad = piece.view_as(p) if earlier is None else earlier.add_(piece.view_as(p))
                    self._averaged[id(p)] = p.grad
                final += reduce.members
        if final:
            for listener in list(self._final_listeners.values()):
                listener(final)

    def _restore_set_aside(self) -> None:
        """Averages set aside for a backward that reduced nothing (inside ``no_sync``, or none
        ran): back into the gradient, which keeps what that backward accumulated."""
        for p in self._all_params():
            earlier = self._set_aside.pop(id(p), None)
            if earlier is not None:
                p.grad = earlier if p.grad is None else earlier.add_(p.grad)

    def check_sums_kept(self) -> None:
        """Raise if a failed backward pass added to local ``no_sync()`` sums (module docstring)."""
        if self.lost_sums:
            raise RuntimeError(
                "A backward pass raised after gradients had accumulated under no_sync() (owner sharding), and it "
                "reduced: what it added cannot be taken back out of those sums. Call zero_grad() and run this step's "
                "micro-batches again (a failed pass outside no_sync() is dropped by itself).")

    def _check_no_stray_gradients(self) -> None:
        if self.rest is None:
            return
        known = set(self.ownership.owner_of) | {id(p) for p in self.rest}
        stray = [name for name, p in self.model.named_parameters() if p.grad is not None and id(p) not in known]
        if stray:
            raise ValueError(
                f"Parameter {stray[0]!r} has a gradient, but it was frozen (requires_grad=False) when shard_by_owner "
                "ran, so nothing averages its gradient across ranks. Unfreeze every parameter that will train "
                "before calling shard_by_owner (freezing one later is fine).")
