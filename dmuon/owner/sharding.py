"""``OwnerSharding``: the hooks that move an owner-sharded model's weights and gradients, layer by
layer (:class:`~dmuon.owner.layer.OwnedLayer`), gradient accumulation (``no_sync``), and the wait
for the gradients that :class:`dmuon.Muon` steps on."""

from __future__ import annotations

import contextlib
import enum
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dmuon.exchange import CommCounter, start_all_reduce_sum, start_broadcast
from dmuon.layout import OwnedParam, mark_owned
from dmuon.owner.checkpoint import install_state_dict_hooks
from dmuon.owner.layer import GradientReduce, Groups, LayerState, OwnedLayer, Ownership, storage_bytes


class TrainingState(enum.Enum):
    """Where the sharding is in a training step, on this rank."""

    IDLE = "idle"  # no gradient arrived since the last reduction finished
    BACKWARD = "backward"  # gradients arriving: each layer's reduce starts when all of its are in


def _tensors(value: object) -> Iterator[Tensor]:
    """The tensors inside a module's output (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class OwnerSharding:
    """The owner-sharded parameters of one model and the hooks that move them; made by
    :func:`dmuon.shard_by_owner`. Attributes: ``params`` (the owner-sharded parameters),
    ``owners`` (name → the global rank that steps it), ``last_step_bytes`` (bytes this rank sent
    for them in the last forward+backward: broadcasts counted at the source once per receiver,
    reduces at each sender), ``rest_bytes`` (the same for the replicated rest).

    Args:
        model: the model whose parameters it shards.
        named_params: the owner-sharded parameters, with their names.
        layers: (name, module, its owner-sharded parameters) of each layer moved together.
        holders: per parameter, the global rank of this replica that holds it.
        owners: per parameter, the global rank that steps it (replica 0's holder).
        groups: the process groups of the shard and replica dimensions.
        reshard_after_forward: "Z3" (True) or "Z2" (False).
        rest: the parameters kept replicated here, or None when FSDP2/DDP handles them.
    """

    def __init__(
        self,
        model: nn.Module,
        named_params: list[tuple[str, nn.Parameter]],
        layers: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]],
        holders: list[int],
        owners: list[int],
        groups: Groups,
        reshard_after_forward: bool,
        rest: list[nn.Parameter] | None,
    ) -> None:
        self.model = model
        self.groups = groups
        self.size = dist.get_world_size(groups.shard) if groups.shard is not None else 1
        self.reshard_after_forward = reshard_after_forward
        self.params = [p for _, p in named_params]
        self.ownership = Ownership(dist.get_rank() if dist.is_initialized() else 0,
                                   {id(p): rank for (_, p), rank in zip(named_params, holders)},
                                   {id(p): rank for (_, p), rank in zip(named_params, owners)}, groups)
        self.owners = {name: self.ownership.owner_of[id(p)] for name, p in named_params}
        self._layers = [OwnedLayer(name, module, members, self.ownership) for name, module, members in layers]
        # with replicate_rest, every other trainable parameter (gradients all-reduced here); None:
        # FSDP2's or DDP's
        self._rest = rest
        self.state = TrainingState.IDLE
        self._version = 0  # of the owners' weights: one more at every step and load
        self._replicas_version = 0  # HSDP: the version last sent from replica 0 to the other replicas
        self._reduce_gradients = True  # False inside no_sync()
        self._order: list[int] = []  # layer indices in the order the first forward ran them
        self._averaged: dict[int, Tensor] = {}  # an owner's averaged gradients, by id of the parameter
        self._set_aside: dict[int, Tensor] = {}  # those a later backward reached before the step used them
        self._reduces: list[GradientReduce] = []  # in flight, this backward
        self._rest_reduces: list[tuple[nn.Parameter, dist.Work]] = []
        self._layers_done = 0  # layers whose gradients all arrived, this backward
        self._rest_ready: set[int] = set()
        # a backward pass sent gradients and has not reached its end: if it is not running, it raised
        self._backward_open = False
        # told which of this rank's parameters have their final (averaged) gradient, layer by
        # layer during the backward pass (early start's; notify_final_gradients); an OrderedDict,
        # as RemovableHandle holds it weakly, which a dict cannot be
        self._final_listeners: OrderedDict[int, Callable[[Sequence[nn.Parameter] | None], None]] = OrderedDict()
        self.rest_counter = CommCounter()
        self.last_step_bytes = 0
        self.rest_bytes = 0
        self._handles: list = []
        for p in self.params:
            mark_owned(p, OwnedParam(self.ownership.owner_of[id(p)], self))

    # ------------------------------------------------------------------ queries

    @property
    def counter(self) -> CommCounter:
        """Bytes and collectives of the owner-sharded parameters, this forward+backward."""
        return self.ownership.counter

    def is_mine(self, param: Tensor) -> bool:
        """Whether this rank steps ``param`` (and keeps its optimizer state)."""
        return self.ownership.is_mine(param)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """Every rank of the sharding (None: a single rank)."""
        return self.groups.everyone

    @property
    def across_replicas(self) -> bool:
        """HSDP: the gradients go on from each replica's holder to replica 0's, which steps."""
        return self.groups.replica is not None

    def owned_bytes(self, rank: int) -> int:
        """Bytes of weights ``rank`` (of this rank's shard group) keeps between steps; its
        gradients and Muon momentum take the same again each: the planner's memory balance."""
        return sum(storage_bytes(p) for p in self.params if self.ownership.holder_of[id(p)] == rank)

    # ------------------------------------------------------------------ forward

    def _refresh_replicas(self) -> None:
        """HSDP: the weights replica 0's owners updated go to the holders in the other replicas,
        every layer's at once, so that they travel while the forward begins."""
        if self.groups.replica is not None and self._replicas_version != self._version:
            self._replicas_version = self._version
            for layer in self._layers:
                layer.receive_from_replica_0()

    def _prefetch(self, layer: OwnedLayer) -> None:
        layer.prefetch(self._version, self._refresh_replicas)

    def _materialize(self, layer: OwnedLayer) -> None:
        layer.materialize(self._version, self._refresh_replicas)

    def _neighbour(self, index: int, step: int) -> OwnedLayer | None:
        if index not in self._order:
            return None
        at = self._order.index(index) + step
        return self._layers[self._order[at]] if 0 <= at < len(self._order) else None

    def _before_forward(self, index: int) -> None:
        self._drop_a_failed_backward()
        if index not in self._order:
            self._order.append(index)
        self._materialize(self._layers[index])
        following = self._neighbour(index, +1)
        if following is not None:
            self._prefetch(following)  # overlaps this layer's compute

    def _after_forward(self, index: int, output: object) -> None:
        layer = self._layers[index]
        if not torch.is_grad_enabled():
            layer.release()
        elif self.reshard_after_forward:
            layer.release()
            fired = []

            def before_backward(grad: Tensor) -> Tensor:
                if not fired:  # once per output tensor set: the first gradient to arrive
                    fired.append(True)
                    self._materialize(layer)
                    previous = self._neighbour(index, -1)
                    if previous is not None:
                        self._prefetch(previous)
                return grad

            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(before_backward)

    # ------------------------------------------------------------------ backward

    def _before_accumulation(self, param: nn.Parameter, grad: Tensor) -> Tensor:
        """A backward reaches ``param`` while its owner still holds the average of an earlier
        one (gradient accumulation without ``no_sync``): set it aside, so that only this rank's
        new gradient is reduced, and add the new average to it afterwards."""
        if param.grad is not None and param.grad is self._averaged.get(id(param)):
            self._set_aside[id(param)] = param.grad
            param.grad = None
        return grad

    def _backward_reached(self) -> None:
        """A gradient arrived: this backward pass is open until autograd reaches its end (a
        callback autograd runs only when the pass completes, as FSDP2's and DDP's)."""
        self.state = TrainingState.BACKWARD
        if not self._backward_open:
            self._backward_open = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_completed)

    def _backward_completed(self) -> None:
        self._backward_open = False

    def _drop_a_failed_backward(self) -> None:
        """Where a backward pass raised (an out-of-memory error, a failing hook: caught, on every
        rank, at the same point), what it reduced is not a gradient of anything the step will
        see: wait for the reduces it started (every rank started them), keep none of their
        sums, and forget its bookkeeping, together with the averages of earlier backward passes
        set aside for it (a failed backward pass is followed by ``zero_grad()``). Runs before
        the next forward pass and at the step; not while a backward pass runs (activation
        checkpointing recomputes layers inside one)."""
        if not self._backward_open or torch._C._current_graph_task_id() != -1:
            return
        self._backward_open = False
        for reduce in self._reduces:
            if reduce.work is not None:
                reduce.work.wait()
        for _, work in self._rest_reduces:
            work.wait()
        self._reduces, self._rest_reduces = [], []
        for layer in self._layers:
            layer.ready.clear()
            layer.release()
        self._layers_done, self._rest_ready = 0, set()
        self._set_aside.clear()
        self.state = TrainingState.IDLE
        self.counter.reset()
        self.rest_counter.reset()
        for listener in list(self._final_listeners.values()):
            listener(None)

    def _gradient_ready(self, index: int, param: nn.Parameter) -> None:
        layer = self._layers[index]
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
        of all at its end, so that the owner can start on it (:mod:`dmuon.step.early_start`). Returns
        the handle that stops it."""
        handle = RemovableHandle(self._final_listeners)
        self._final_listeners[handle.id] = listener
        return handle

    def _layer_backward_done(self, layer: OwnedLayer) -> None:
        if self._reduce_gradients:
            started = layer.start_reduces()
            if self._final_listeners and not self.across_replicas:
                # the layers before this one: final once their reduces are done, while this one's goes on
                self._finish_reduces(self._reduces)
                self._reduces = []
            self._reduces += started
        layer.ready.clear()
        layer.release()
        self._layers_done += 1

    def _rest_gradient_ready(self, param: nn.Parameter) -> None:
        if self._reduce_gradients and self.groups.everyone is not None:
            work = start_all_reduce_sum(param.grad, self.groups.everyone, self.rest_counter)
            self._rest_reduces.append((param, work))
        self._backward_reached()
        self._rest_ready.add(id(param))
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self._layers_done == len(self._layers) and len(self._rest_ready) == len(self._rest or ()):
            self.wait_for_gradients()

    def wait_for_gradients(self) -> None:
        """Finish the gradient reduction of the last backward: afterwards each owner holds the
        averaged gradient of its parameters (added to the ones of earlier backward passes not
        yet zeroed) and other ranks none. Runs by itself when every parameter got its gradient;
        :class:`dmuon.Muon` calls it before stepping, for backward passes that left some
        parameters without one (which must be the same on every rank).

        Raises a ValueError naming a parameter that has a gradient although it was frozen when
        the sharding was made (with ``replicate_rest``): nothing averages its gradient."""
        self._check_no_stray_gradients()
        self._drop_a_failed_backward()
        if self.state is TrainingState.IDLE:
            self._restore_set_aside()
            return
        self.state = TrainingState.IDLE
        for layer in self._layers:
            if layer.ready:  # some of its parameters got gradients, others none
                self._layer_backward_done(layer)
        self._finish_reduces(self._reduces)
        self._restore_set_aside()
        everyone = self.size * self.groups.replicas
        for p, work in self._rest_reduces:
            work.wait()
            p.grad.div_(everyone)
        self._reduces, self._rest_reduces = [], []
        self._layers_done, self._rest_ready = 0, set()
        self._backward_open = False
        for layer in self._layers:
            if layer.state is LayerState.PREFETCHING:  # prefetched by a recomputation in backward: not needed now
                layer.release()
        self.last_step_bytes, self.rest_bytes = self.counter.bytes_sent, self.rest_counter.bytes_sent
        self.counter.reset()
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
        everyone = self.size * self.groups.replicas
        final: list[nn.Parameter] = []
        for reduce in gathered:
            if reduce.work is not None:
                reduce.work.wait()
            if self.is_mine(reduce.members[0]):
                reduce.flat.div_(everyone)
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
        for p in self.params:
            earlier = self._set_aside.pop(id(p), None)
            if earlier is not None:
                p.grad = earlier if p.grad is None else earlier.add_(p.grad)

    def _check_no_stray_gradients(self) -> None:
        if self._rest is None:
            return
        known = set(self.ownership.owner_of) | {id(p) for p in self._rest}
        stray = [name for name, p in self.model.named_parameters() if p.grad is not None and id(p) not in known]
        if stray:
            raise ValueError(
                f"Parameter {stray[0]!r} has a gradient, but it was frozen (requires_grad=False) when shard_by_owner "
                "ran, so nothing averages its gradient across ranks. Unfreeze every parameter that will train "
                "before calling shard_by_owner (freezing one later is fine).")

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside only accumulate gradients locally;
        the first backward after the block reduces the sum."""
        previous, self._reduce_gradients = self._reduce_gradients, False
        try:
            yield
        finally:
            self._reduce_gradients = previous

    def weights_changed(self) -> None:
        """The owners' weights changed (an optimizer step, a load): local copies are stale."""
        self._version += 1

    # ------------------------------------------------------------------ hooks

    def install(self, sync_module_states: bool) -> None:
        """Put the hooks on the model; with ``sync_module_states``, rank 0's initial values
        everywhere first (as DDP does); then free the copies this rank does not hold."""
        for index, layer in enumerate(self._layers):
            module = layer.module
            self._handles.append(module.register_forward_pre_hook(lambda m, args, i=index: self._before_forward(i)))
            self._handles.append(module.register_forward_hook(
                lambda m, args, out, i=index: self._after_forward(i, out)))
            for p in layer.params:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda param, i=index: self._gradient_ready(i, param)))
                self._handles.append(p.register_hook(partial(self._before_accumulation, p)))
        for p in self._rest or ():
            self._handles.append(p.register_post_accumulate_grad_hook(self._rest_gradient_ready))
        self._handles += install_state_dict_hooks(self.model, self.ownership, self.weights_changed)
        with torch.no_grad():
            everyone = self.groups.everyone
            if sync_module_states and everyone is not None:
                for p in self.params + (self._rest or []):
                    start_broadcast(p.data, dist.get_global_rank(everyone, 0), everyone).wait()
            for layer in self._layers:
                layer.release()

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
