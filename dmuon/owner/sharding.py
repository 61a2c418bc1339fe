"""``OwnerSharding``: the hooks that move an owner-sharded model's weights, layer by layer
(:class:`~dmuon.owner.layer.OwnedLayer`), and gradient accumulation (``no_sync``); the gradients'
side of a backward pass is :class:`~dmuon.owner.gradients.GradientReduction`'s."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dmuon.exchange import CommCounter, start_broadcast
from dmuon.layout import OwnedParam, mark_owned
from dmuon.owner.checkpoint import install_state_dict_hooks
from dmuon.owner.gradients import GradientReduction
from dmuon.owner.layer import Groups, OwnedLayer, Ownership, storage_bytes


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
        self._version = 0  # of the owners' weights: one more at every step and load
        self._replicas_version = 0  # HSDP: the version last sent from replica 0 to the other replicas
        self._order: list[int] = []  # layer indices in the order the first forward ran them
        self.gradients = GradientReduction(model, self._layers, self.params, self.ownership, groups, rest)
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
        self.gradients.drop_a_failed_backward()
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

    def wait_for_gradients(self) -> None:
        """Finish the gradient reduction of the last backward: afterwards each owner holds the
        averaged gradient of its parameters (added to the ones of earlier backward passes not
        yet zeroed) and other ranks none. Runs by itself when every parameter got its gradient;
        :class:`dmuon.Muon` calls it before stepping, for backward passes that left some
        parameters without one (which must be the same on every rank).

        Raises a ValueError naming a parameter that has a gradient although it was frozen when
        the sharding was made (with ``replicate_rest``): nothing averages its gradient; a
        RuntimeError where a backward pass that raised added to gradients accumulated under
        ``no_sync()`` (they are not zeroed since)."""
        self.gradients.wait()
        self.gradients.check_sums_kept()

    def notify_final_gradients(self, listener: Callable[[Sequence[nn.Parameter] | None], None]) -> RemovableHandle:
        """Tell ``listener`` which of this rank's parameters have their final (averaged) gradient
        in ``param.grad``, as they get it, and (with None) that the backward pass they came from
        raised (:meth:`GradientReduction.notify_final_gradients`). Returns the handle that stops it."""
        return self.gradients.notify_final_gradients(listener)

    @property
    def last_step_bytes(self) -> int:
        return self.gradients.last_step_bytes

    @property
    def rest_bytes(self) -> int:
        return self.gradients.rest_bytes

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside only accumulate gradients locally;
        the first backward after the block reduces the sum."""
        previous, self.gradients.reduce_gradients = self.gradients.reduce_gradients, False
        try:
            yield
        finally:
            self.gradients.reduce_gradients = previous

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
                    lambda param, i=index: self.gradients.gradient_ready(i, param)))
                self._handles.append(p.register_hook(partial(self.gradients.before_accumulation, p)))
        for p in self._rest or ():
            self._handles.append(p.register_post_accumulate_grad_hook(self.gradients.rest_gradient_ready))
            self._handles.append(p.register_hook(partial(self.gradients.before_accumulation, p)))
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
