"""Owner-sharded data parallel: every Muon weight matrix lives whole on one owner rank.

Under FSDP2 each matrix is split row-wise over all ranks, so Muon must gather it to an owner and
send the update back — two extra transfers per step. Here the matrix is *stored* on its owner
instead (the DMuon paper's "dedicated ownership"), so the optimizer step moves nothing:

* **setup** (:func:`shard_by_owner`): the planner picks an owner per parameter, balancing
  Newton–Schulz FLOPs and bytes kept (:func:`dmuon.planner.plan_ownership`); the weights are
  broadcast from rank 0 once (as DDP does), then every other rank frees its copy (the tensor
  keeps its shape; its storage is resized to zero bytes).
* **forward**: before a layer runs, its matrices are broadcast from their owners (one call per
  owner and dtype per layer), and the next layer's broadcast is started so that it overlaps
  this layer's compute (the order is learnt from the first forward).
* **after forward**: ``reshard_after_forward=False`` ("Z2") keeps the broadcast weights until the
  layer's backward is done; ``True`` ("Z3") frees them at once and broadcasts them again when the
  backward reaches the layer — less memory, 3(N−1)/N·P bytes per step instead of 2(N−1)/N·P.
* **backward**: as soon as all gradients of a layer are ready, they are summed onto their owners
  (one ``reduce`` per owner and dtype, asynchronous) and the copies elsewhere are dropped; the
  owner's gradient becomes the average. Inside :meth:`OwnerSharding.no_sync` gradients only
  accumulate locally (gradient accumulation), and the reduce happens on the last micro-batch.
  Without ``no_sync`` every backward reduces, and gradients add up as under DDP: an owner sets
  its averaged gradient aside when the next backward reaches the parameter (a tensor hook runs
  before autograd accumulates), and adds the next average to it.
* **step**: :class:`dmuon.Muon` sees that a parameter is owner-sharded and, on its owner only,
  runs momentum, Newton–Schulz and the update locally; other ranks hold no state for it.

**HSDP** (a 2-D (replicate, shard) mesh): each replica holds every matrix once among its shard
ranks, as above; after the reduce within the replica, the holders' sums go on to the holder in
replica 0, which alone steps (each matrix is still orthogonalized once in the whole job), and its
updated weight reaches the other replicas' holders at the start of the next forward, every
layer's at once, so that it overlaps that forward.

Parameters Muon does not update stay with DDP/FSDP2 (``fully_shard(...,
ignored_params=sharding.params)``), or, with ``replicate_rest=True`` (the default), are kept
replicated here: broadcast from rank 0 at setup, gradients all-reduced (averaged) in backward.

Checkpoints: ``model.state_dict()`` holds, on each rank, the matrices it owns (whole, as plain
tensors), and the optimizer holds their state; ``torch.distributed.checkpoint`` therefore saves
each matrix once, from its owner, and loads it at any world size or into any other layout.

Only public torch APIs are used: module forward hooks, tensor gradient hooks,
``Tensor.register_post_accumulate_grad_hook``, ``UntypedStorage.resize_``, state-dict hooks and
``torch.distributed`` collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmuon.agreement import agreed_call
from dmuon.exchange import (
    CommCounter, GroupRef, default_device, start_all_reduce_sum, start_broadcast, start_reduce,
)
from dmuon.layout import OwnedParam, mark_owned
from dmuon.orthogonalization import newton_schulz_flops, resolve_config
from dmuon.planner import plan_ownership
from dmuon.routing import default_route, matrix_shape, module_roles


class Groups:
    """The process groups owner sharding runs on, held weakly (:class:`dmuon.exchange.GroupRef`:
    the model holds its sharding, and must not keep the groups alive). ``shard``: the ranks
    among which each matrix has one owner (None: a single rank); ``replica``: with HSDP, this
    rank's replica group — the ranks at the same shard position in each replica (None without
    replicas); ``everyone``: all of them (replicated parameters and the initial sync)."""

    def __init__(self, shard: dist.ProcessGroup | None, replica: dist.ProcessGroup | None = None,
                 everyone: dist.ProcessGroup | None = None) -> None:
        self._refs = GroupRef(shard), GroupRef(replica), GroupRef(everyone)

    @property
    def shard(self) -> dist.ProcessGroup | None:
        return self._refs[0]()

    @property
    def replica(self) -> dist.ProcessGroup | None:
        return self._refs[1]()

    @property
    def everyone(self) -> dist.ProcessGroup | None:
        return self._refs[2]()

    @property
    def replicas(self) -> int:
        return dist.get_world_size(self.replica) if self.replica is not None else 1


@dataclass
class _Layer:
    """The owner-sharded parameters one module's forward uses, and their state this step."""

    name: str
    module: nn.Module
    params: list[tuple[str, nn.Parameter]]
    valid_version: int = -1  # the weights' version the local copies hold; -1: freed
    pending: list = field(default_factory=list)  # broadcasts in flight
    pending_version: int = -1  # the weights' version those broadcasts carry
    replica_pending: list = field(default_factory=list)  # HSDP: updated weights coming from replica 0
    ready: set[int] = field(default_factory=set)  # ids of parameters whose gradient is ready

    def by_owner(self, owners: dict[int, int]) -> dict[tuple[int, torch.dtype], list[nn.Parameter]]:
        """Parameters grouped per (owner, dtype), in a rank-independent order."""
        groups: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
        for _, p in self.params:
            groups.setdefault((owners[id(p)], p.dtype), []).append(p)
        return dict(sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))))


def _storage_bytes(p: Tensor) -> int:
    return p.numel() * p.element_size()


def _free(p: Tensor) -> None:
    p.data.untyped_storage().resize_(0)


def _allocate(p: Tensor) -> None:
    storage = p.data.untyped_storage()
    if storage.nbytes() != _storage_bytes(p):
        storage.resize_(_storage_bytes(p))


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
    :func:`shard_by_owner`. Attributes: ``params`` (the owner-sharded parameters), ``owners``
    (name → the global rank that steps it), ``last_step_bytes`` (bytes this rank sent for them in the last
    forward+backward: broadcasts counted at the source once per receiver, reduces at each
    sender), ``rest_bytes`` (the same for the replicated rest)."""

    def __init__(
        self,
        model: nn.Module,
        named_params: list[tuple[str, nn.Parameter]],
        layers: list[_Layer],
        holders: list[int],
        owners: list[int],
        groups: Groups,
        reshard_after_forward: bool,
        rest: list[nn.Parameter] | None,
    ) -> None:
        self.model = model
        self.groups = groups
        self.size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.reshard_after_forward = reshard_after_forward
        self.params = [p for _, p in named_params]
        # _holder_of: the rank of this replica that keeps the weight and gathers its gradient;
        # _owner_of: the rank that steps it (the holder in replica 0; the same without replicas)
        self._holder_of = {id(p): rank for (_, p), rank in zip(named_params, holders)}
        self._owner_of = {id(p): rank for (_, p), rank in zip(named_params, owners)}
        self.owners = {name: self._owner_of[id(p)] for name, p in named_params}
        self._layers = layers
        self._rest = rest or []
        # replicate_rest: every other trainable parameter is this sharding's too (None: FSDP2's or DDP's)
        self._keeps_rest = rest is not None
        self._averaged: dict[int, Tensor] = {}  # an owner's averaged gradients, by id of the parameter
        self._set_aside: dict[int, Tensor] = {}  # those a later backward reached before the step used them
        self._version = 0
        self._sync = True
        self._order: list[int] = []  # layer indices in the order the first forward ran them
        self._reduces: list = []  # (parameters, flat buffer, work) of gradient reduces in flight
        self._rest_reduces: list = []
        self._layers_done = 0
        self._rest_ready: set[int] = set()
        self._backward_seen = False
        self._replicas_stale = False
        self._not_missing: set[str] = set()  # state-dict keys the owners load, not this rank
        self.counter = CommCounter()
        self.rest_counter = CommCounter()
        self.last_step_bytes = 0
        self.rest_bytes = 0
        self._handles: list = []
        for p in self.params:
            mark_owned(p, OwnedParam(self._owner_of[id(p)], self))

    # ------------------------------------------------------------------ queries

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The shard group: each matrix has one owner among its ranks."""
        return self.groups.shard

    def is_mine(self, param: Tensor) -> bool:
        """Whether this rank steps ``param`` (and keeps its optimizer state)."""
        return self._owner_of[id(param)] == self.rank

    def _holds(self, param: Tensor) -> bool:
        return self._holder_of[id(param)] == self.rank

    def owned_bytes(self, rank: int) -> int:
        """Bytes of weights ``rank`` (of this rank's shard group) keeps between steps; its
        gradients and Muon momentum take the same again each: the planner's memory balance."""
        return sum(_storage_bytes(p) for p in self.params if self._holder_of[id(p)] == rank)

    # ------------------------------------------------------------------ forward

    def _broadcast(self, members: list[nn.Parameter], src: int, group: dist.ProcessGroup) -> tuple:
        """Start one broadcast of ``members``' weights from ``src`` over ``group``."""
        sending = src == self.rank
        if len(members) == 1:  # straight into (or out of) the parameter: no copy
            flat = members[0].data.reshape(-1)
        elif sending:
            flat = torch.cat([p.data.reshape(-1) for p in members])
        else:
            flat = torch.empty(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
        return sending, members, flat, start_broadcast(flat, src, group, self.counter)

    @staticmethod
    def _receive(pending: list[tuple]) -> None:
        for sending, members, flat, work in pending:
            work.wait()
            if not sending and len(members) > 1:
                for p, piece in zip(members, flat.split([p.numel() for p in members])):
                    p.data.copy_(piece.view_as(p))  # through .data: autograd's version counter is not bumped

    def _start_replica_broadcasts(self) -> None:
        """HSDP: the weights replica 0's owners just updated go to the holders in the other
        replicas, every layer at once, so they travel while the forward begins."""
        self._replicas_stale = False
        for layer in self._layers:
            for (holder, _), members in layer.by_owner(self._holder_of).items():
                if holder == self.rank:
                    layer.replica_pending.append(self._broadcast(members, self._owner_of[id(members[0])],
                                                                 self.groups.replica))

    def _start_broadcast(self, layer: _Layer) -> None:
        if layer.pending:
            if layer.pending_version == self._version:
                return
            # A prefetch that the weights outdated (activation checkpointing re-runs forward hooks
            # in backward, which prefetch layers that will next run after the step): finish it
            # on every rank, then broadcast afresh.
            self._receive(layer.pending)
            layer.pending = []
        if layer.valid_version == self._version:
            return
        layer.pending_version = self._version
        if self._replicas_stale:
            self._start_replica_broadcasts()
        self._receive(layer.replica_pending)  # a holder sends only what it has received
        layer.replica_pending = []
        for (holder, _), members in layer.by_owner(self._holder_of).items():
            if holder != self.rank:
                for p in members:
                    _allocate(p)
            if self.group is not None:
                layer.pending.append(self._broadcast(members, holder, self.group))

    def _materialize(self, layer: _Layer) -> None:
        self._start_broadcast(layer)
        self._receive(layer.pending)
        layer.pending = []
        layer.valid_version = self._version

    def _release(self, layer: _Layer) -> None:
        """Free the copies of the layer's weights this rank does not own."""
        for _, p in layer.params:
            if not self._holds(p):
                _free(p)
        layer.valid_version = -1

    def _neighbour(self, index: int, step: int) -> _Layer | None:
        if index not in self._order:
            return None
        at = self._order.index(index) + step
        return self._layers[self._order[at]] if 0 <= at < len(self._order) else None

    def _before_forward(self, index: int) -> None:
        if index not in self._order:
            self._order.append(index)
        self._materialize(self._layers[index])
        following = self._neighbour(index, +1)
        if following is not None:
            self._start_broadcast(following)  # prefetch: overlaps this layer's compute

    def _after_forward(self, index: int, output: object) -> None:
        layer = self._layers[index]
        if not torch.is_grad_enabled():
            self._release(layer)
        elif self.reshard_after_forward:
            self._release(layer)
            fired = []

            def before_backward(grad: Tensor) -> Tensor:
                if not fired:  # once per output tensor set: the first gradient to arrive
                    fired.append(True)
                    self._materialize(layer)
                    previous = self._neighbour(index, -1)
                    if previous is not None:
                        self._start_broadcast(previous)
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

    def _gradient_ready(self, index: int, param: nn.Parameter) -> None:
        layer = self._layers[index]
        self._backward_seen = True
        layer.ready.add(id(param))
        if len(layer.ready) == len(layer.params):
            self._layer_backward_done(layer)
            self._maybe_finish()

    def _layer_backward_done(self, layer: _Layer) -> None:
        if self._sync:
            for (holder, _), members in layer.by_owner(self._holder_of).items():
                with_grad = [p for p in members if p.grad is not None]
                if with_grad:
                    self._reduces.append((holder, with_grad, *self._reduce(with_grad, holder, self.group)))
        layer.ready.clear()
        self._release(layer)
        self._layers_done += 1

    def _reduce(self, members: list[nn.Parameter], dst: int, group: dist.ProcessGroup | None,
                flat: Tensor | None = None) -> tuple[Tensor, dist.Work | None]:
        """Start summing ``members``' gradients (or ``flat``) onto ``dst``; elsewhere they are
        dropped, since the flat copy is what travels."""
        if flat is None:
            flat = torch.cat([p.grad.reshape(-1) for p in members])
        if group is None:
            return flat, None
        if dst != self.rank:
            for p in members:
                p.grad = None
        return flat, start_reduce(flat, dst, group, self.counter)

    def _rest_gradient_ready(self, param: nn.Parameter) -> None:
        if self._sync and self.groups.everyone is not None:
            self._rest_reduces.append((param, start_all_reduce_sum(param.grad, self.groups.everyone, self.rest_counter)))
        self._backward_seen = True
        self._rest_ready.add(id(param))
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        if self._layers_done == len(self._layers) and len(self._rest_ready) == len(self._rest):
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
        if not self._backward_seen:
            self._restore_set_aside()
            return
        self._backward_seen = False
        for layer in self._layers:
            if layer.ready:  # some of its parameters got gradients, others none
                self._layer_backward_done(layer)
        gathered = []
        for holder, members, flat, work in self._reduces:
            if work is not None:
                work.wait()
            if holder != self.rank:
                continue
            if self.groups.replica is not None:  # HSDP: the replicas' sums meet at replica 0
                flat, work = self._reduce(members, self._owner_of[id(members[0])], self.groups.replica, flat)
            gathered.append((members, flat, work))
        everyone = self.size * self.groups.replicas
        for members, flat, work in gathered:
            if work is not None:
                work.wait()
            if self.is_mine(members[0]):
                flat.div_(everyone)
                for p, piece in zip(members, flat.split([p.numel() for p in members])):
                    earlier = self._set_aside.pop(id(p), None)
                    p.grad = piece.view_as(p) if earlier is None else earlier.add_(piece.view_as(p))
                    self._averaged[id(p)] = p.grad
        self._restore_set_aside()
        for p, work in self._rest_reduces:
            work.wait()
            p.grad.div_(everyone)
        self._reduces, self._rest_reduces = [], []
        self._layers_done, self._rest_ready = 0, set()
        for layer in self._layers:
            if layer.pending:  # prefetched by a recomputation in backward: nothing needs it now
                self._receive(layer.pending)
                layer.pending = []
                self._release(layer)
        self.last_step_bytes, self.rest_bytes = self.counter.bytes_sent, self.rest_counter.bytes_sent
        self.counter.reset()
        self.rest_counter.reset()

    def _restore_set_aside(self) -> None:
        """Averages set aside for a backward that reduced nothing (inside ``no_sync``, or none
        ran): back into the gradient, which keeps what that backward accumulated."""
        for p in self.params:
            earlier = self._set_aside.pop(id(p), None)
            if earlier is not None:
                p.grad = earlier if p.grad is None else earlier.add_(p.grad)

    def _check_no_stray_gradients(self) -> None:
        if not self._keeps_rest:
            return
        known = set(self._owner_of) | {id(p) for p in self._rest}
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
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def weights_changed(self) -> None:
        """The owners' weights changed (an optimizer step, a load): local copies are stale."""
        self._version += 1
        self._replicas_stale = self.groups.replica is not None

    # ------------------------------------------------------------------ checkpoints

    def _drop_unowned(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        for name, p in module.named_parameters(recurse=False):
            if id(p) in self._owner_of and not self.is_mine(p):
                state_dict.pop(prefix + name, None)

    def _skip_unowned_on_load(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata, strict,
                              missing_keys, unexpected_keys, error_msgs) -> None:
        for name, p in module.named_parameters(recurse=False):
            if id(p) in self._owner_of and not self.is_mine(p):
                state_dict.pop(prefix + name, None)  # the owner loads it
                self._not_missing.add(prefix + name)

    def _forgive_unowned(self, module: nn.Module, incompatible_keys) -> None:
        for key in list(incompatible_keys.missing_keys):
            if key in self._not_missing:
                incompatible_keys.missing_keys.remove(key)
        self.weights_changed()

    # ------------------------------------------------------------------ setup

    def _install(self, sync_module_states: bool) -> None:
        for index, layer in enumerate(self._layers):
            module = layer.module
            self._handles.append(module.register_forward_pre_hook(lambda m, args, i=index: self._before_forward(i)))
            self._handles.append(module.register_forward_hook(
                lambda m, args, out, i=index: self._after_forward(i, out)))
            for _, p in layer.params:
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda param, i=index: self._gradient_ready(i, param)))
                self._handles.append(p.register_hook(partial(self._before_accumulation, p)))
        for p in self._rest:
            self._handles.append(p.register_post_accumulate_grad_hook(self._rest_gradient_ready))
        holding_modules = {id(m): m for m in self.model.modules()
                           if any(id(p) in self._owner_of for p in m.parameters(recurse=False))}
        for module in holding_modules.values():
            # partial: torch marks hooks with an attribute, which bound methods cannot take
            self._handles.append(module.register_state_dict_post_hook(partial(OwnerSharding._drop_unowned, self)))
            self._handles.append(module.register_load_state_dict_pre_hook(
                partial(OwnerSharding._skip_unowned_on_load, self)))
            self._handles.append(module.register_load_state_dict_post_hook(partial(OwnerSharding._forgive_unowned, self)))
        with torch.no_grad():
            everyone = self.groups.everyone
            if sync_module_states and everyone is not None:
                for p in self.params + self._rest:  # rank 0's initial values everywhere, as DDP does
                    start_broadcast(p.data, dist.get_global_rank(everyone, 0), everyone).wait()
            for layer in self._layers:
                self._release(layer)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _default_layers(model: nn.Module, managed: dict[int, str], layers: Iterable[nn.Module] | None
                    ) -> list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]:
    """(name, module, parameters) per layer: each given layer takes the managed parameters inside
    it; the rest go with the module that holds them directly."""
    chosen = list(layers or [])
    names = {id(m): n or "<model>" for n, m in model.named_modules()}
    for module in chosen:
        if id(module) not in names:
            raise ValueError(f"A module in layers is not part of the model: {type(module).__name__}.")
    chosen_ids = {id(m) for m in chosen}
    out, placed = [], {}
    for module in chosen + [m for m in model.modules() if id(m) not in chosen_ids]:
        direct = id(module) in chosen_ids
        members = []
        for _, p in module.named_parameters(recurse=direct):
            if id(p) not in managed:
                continue
            if id(p) in placed:
                if direct:
                    raise ValueError(f"Parameter {managed[id(p)]!r} is in two layers: {placed[id(p)]!r} "
                                     f"and {names[id(module)]!r}.")
                continue
            placed[id(p)] = names[id(module)]
            members.append((managed[id(p)], p))
        if members:
            out.append((names[id(module)], module, members))
    return out


def _groups_and_ranks(mesh_or_group) -> tuple[Groups, list[int], list[int]]:
    """The groups, and per shard position the global rank of the holder in this rank's replica
    and of the owner (the holder in replica 0)."""
    if not (dist.is_available() and dist.is_initialized()):
        return Groups(None), [0], [0]
    if mesh_or_group is None or isinstance(mesh_or_group, dist.ProcessGroup):
        group = mesh_or_group or dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) == 1:  # one rank: nothing to move
            return Groups(None), ranks, ranks
        return Groups(group, None, group), ranks, ranks
    ndim = getattr(mesh_or_group, "ndim", None)
    if ndim == 1:
        return _groups_and_ranks(mesh_or_group.get_group(0))
    if ndim == 2 and mesh_or_group.size(0) == 1:
        return _groups_and_ranks(mesh_or_group.get_group(1))
    if ndim == 2:  # HSDP: (replicate, shard)
        table = mesh_or_group.mesh.tolist()
        if sorted(r for row in table for r in row) != list(range(dist.get_world_size())):
            raise NotImplementedError("shard_by_owner takes a 2-D mesh only when it spans all ranks.")
        shard, replica = mesh_or_group.get_group(1), mesh_or_group.get_group(0)
        return Groups(shard, replica, dist.group.WORLD), dist.get_process_group_ranks(shard), table[0]
    raise NotImplementedError(
        f"shard_by_owner takes a process group, or a 1-D or 2-D (replicate, shard) DeviceMesh; got {mesh_or_group!r}."
    )


@dataclass(frozen=True)
class _Setup:
    """What :func:`shard_by_owner` decides on each rank before the ranks agree."""

    layers: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]
    ordered: list[tuple[str, nn.Parameter]]  # the owner-sharded parameters, layer by layer
    positions: list[int]  # each one's owner, by position in the shard group
    rest: list[nn.Parameter] | None  # replicated here (replicate_rest), else None


def _plan(model: nn.Module, params: Iterable[nn.Parameter] | None, layers: Iterable[nn.Module] | None, size: int,
          replicate_rest: bool) -> _Setup:
    """The parameters to owner-shard (checked), their layers and owners: no collective."""
    named = dict((id(p), (n, p)) for n, p in model.named_parameters())
    if params is None:
        roles = module_roles(model)
        chosen = [(n, p) for n, p in named.values()
                  if p.requires_grad and default_route(p, n, roles.get(id(p))).algorithm == "muon"]
    else:
        chosen = []
        for p in params:
            if id(p) not in named:
                raise ValueError(f"A parameter of shape {tuple(p.shape)} in params is not a parameter of the model.")
            chosen.append(named[id(p)])
    for name, p in chosen:
        if not isinstance(p, nn.Parameter) or type(p.data) is not Tensor:
            raise ValueError(f"Parameter {name!r} is a {type(p.data).__name__}: shard_by_owner needs plain "
                             "tensors (call it before fully_shard).")
        if not p.is_contiguous() or p.storage_offset() or p.untyped_storage().nbytes() != _storage_bytes(p):
            raise ValueError(f"Parameter {name!r} shares its storage with other tensors; shard_by_owner "
                             "frees and refills whole storages.")
        if p.ndim < 2:
            raise ValueError(f"Parameter {name!r} has shape {tuple(p.shape)}; only matrices are owner-sharded.")
        if not p.requires_grad:
            raise ValueError(f"Parameter {name!r} is frozen (requires_grad=False): owner sharding needs the hooks "
                             "of a trainable parameter. Leave it out of params.")
    managed = {id(p): n for n, p in chosen}
    grouped = _default_layers(model, managed, layers)
    ordered = [(n, p) for _, _, members in grouped for n, p in members]
    flops = []
    for _, p in ordered:
        count, m, n = matrix_shape(p.shape, "auto")
        config = resolve_config((m, n), p.device.type)
        flops.append(count * newton_schulz_flops(m, n, steps=config.steps, method=config.method,
                                                 restarts=config.restarts))
    positions = plan_ownership([n for n, _ in ordered], flops, [_storage_bytes(p) for _, p in ordered], size)
    rest = [p for n, p in named.values() if p.requires_grad and id(p) not in managed] if replicate_rest else None
    return _Setup(grouped, ordered, positions, rest)


def shard_by_owner(
    model: nn.Module,
    mesh_or_group: dist.ProcessGroup | object | None = None,
    *,
    reshard_after_forward: bool = False,
    layers: Iterable[nn.Module] | None = None,
    params: Iterable[nn.Parameter] | None = None,
    replicate_rest: bool = True,
    sync_module_states: bool = True,
) -> OwnerSharding:
    """Store each Muon weight matrix of ``model`` whole on one owner rank (module docstring).

    ``mesh_or_group``: a process group or 1-D DeviceMesh (default: the world), or a 2-D
    (replicate, shard) mesh for HSDP: each replica holds every matrix once among its shard ranks;
    gradients are reduced within the replica, then to replica 0's holder, which alone steps; the
    updated weight goes back to the other replicas' holders at the start of the next forward.
    ``reshard_after_forward``: False keeps broadcast weights until backward ("Z2"); True frees
    them after forward and broadcasts again in backward ("Z3").
    ``layers``: modules whose owner-sharded parameters move together (one broadcast per owner per
    layer, e.g. the transformer blocks); by default each module holding such parameters.
    ``params``: the parameters to owner-shard; by default those :class:`dmuon.Muon` routes to Muon.
    ``replicate_rest``: keep every other parameter replicated (gradients all-reduced here, like
    DDP); pass False when FSDP2/DDP handles them (``fully_shard(..., ignored_params=sharding.params)``).

    Call it after moving the model to its device (non-owners' tensors have no storage to move
    afterwards), before ``fully_shard`` and before creating the optimizer; every rank must call it
    with the same model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_by_owner takes an nn.Module, not a {type(model).__name__}.")
    groups, holder_ranks, owner_ranks = _groups_and_ranks(mesh_or_group)
    planned: list[_Setup] = []

    def local_part() -> list[tuple[str, str]]:
        planned.append(_plan(model, params, layers, len(holder_ranks), replicate_rest))
        setup = planned[0]
        fingerprint = [(f"owner-sharded parameter {name!r}", f"{tuple(p.shape)} {p.dtype} in layer {layer}")
                       for layer, _, members in setup.layers for name, p in members]
        rest_ids = {id(p) for p in setup.rest or ()}
        rest = [n for n, p in model.named_parameters() if id(p) in rest_ids]
        return [*fingerprint, ("options", repr((reshard_after_forward, rest)))]

    def device() -> torch.device:
        ordered = planned[0].ordered if planned else []
        return next((p.device for _, p in ordered), default_device(groups.everyone))

    # before any data moves: every rank must shard the same model alike, and a failure on one
    # rank stops them all
    agreed_call("shard_by_owner", local_part, groups.everyone, device, what="owner sharding")
    setup = planned[0]
    sharding = OwnerSharding(model, setup.ordered, [_Layer(*g) for g in setup.layers],
                             [holder_ranks[q] for q in setup.positions], [owner_ranks[q] for q in setup.positions],
                             groups, reshard_after_forward, setup.rest)
    sharding._install(sync_module_states)
    return sharding
