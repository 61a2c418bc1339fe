"""One owner-sharded layer: the parameters one module's forward uses, where their weights are
(:class:`LayerState`), and the collectives that move them — the broadcast from their holders
before the layer runs, and the reduce of their gradients onto the holders after its backward.

:class:`Ownership` is what every layer of a sharding shares: who keeps and who steps each
parameter, seen from this rank, the process groups and the byte counter.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmuon.exchange import CommCounter, GroupRef, start_broadcast, start_reduce


def storage_bytes(p: Tensor) -> int:
    return p.numel() * p.element_size()


def free(p: Tensor) -> None:
    """Give back ``p``'s memory; the tensor keeps its shape, its storage shrinks to zero bytes."""
    p.data.untyped_storage().resize_(0)


def allocate(p: Tensor) -> None:
    storage = p.data.untyped_storage()
    if storage.nbytes() != storage_bytes(p):
        storage.resize_(storage_bytes(p))


class Groups:
    """The process groups owner sharding runs on, held weakly (:class:`dmuon.exchange.GroupRef`:
    the model holds its sharding, and must not keep the groups alive). ``shard``: the ranks
    among which each matrix has one holder (None: a single rank); ``replica``: with HSDP, this
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
class Broadcast:
    """Weights of ``members`` on their way from one rank to the others: ``flat`` is the
    parameter's own memory for a single member, else one buffer for all."""

    sending: bool
    members: list[nn.Parameter]
    flat: Tensor
    work: dist.Work

    def finish(self) -> None:
        self.work.wait()
        if not self.sending and len(self.members) > 1:
            for p, piece in zip(self.members, self.flat.split([p.numel() for p in self.members])):
                p.data.copy_(piece.view_as(p))  # through .data: autograd's version counter is not bumped


@dataclass
class GradientReduce:
    """The gradients of ``members`` being summed onto ``holder``: laid end to end in ``flat``."""

    holder: int
    members: list[nn.Parameter]
    flat: Tensor
    work: dist.Work | None  # None: a single rank, nothing to sum


@dataclass
class Ownership:
    """Who keeps and who steps each owner-sharded parameter, seen from this rank. The *holder*
    is the rank of this replica that keeps its weight and gathers its gradient; the *owner* the
    rank that steps it (the holder in replica 0; the same rank without replicas). Both by
    ``id`` of the parameter, as global ranks."""

    rank: int
    holder_of: dict[int, int]
    owner_of: dict[int, int]
    groups: Groups
    counter: CommCounter = field(default_factory=CommCounter)

    def holds(self, p: Tensor) -> bool:
        return self.holder_of[id(p)] == self.rank

    def is_mine(self, p: Tensor) -> bool:
        return self.owner_of[id(p)] == self.rank

    def by_holder(self, params: list[nn.Parameter]) -> dict[tuple[int, torch.dtype], list[nn.Parameter]]:
        """``params`` per (holder, dtype), in a rank-independent order: one collective each."""
        groups: dict[tuple[int, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            groups.setdefault((self.holder_of[id(p)], p.dtype), []).append(p)
        return dict(sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))))

    def broadcast(self, members: list[nn.Parameter], src: int, process_group: dist.ProcessGroup) -> Broadcast:
        """Start one broadcast of ``members``' weights from ``src``."""
        sending = src == self.rank
        if len(members) == 1:  # straight into (or out of) the parameter: no copy
            flat = members[0].data.reshape(-1)
        elif sending:
            flat = torch.cat([p.data.reshape(-1) for p in members])
        else:
            flat = torch.empty(sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device)
        return Broadcast(sending, members, flat, start_broadcast(flat, src, process_group, self.counter))

    def reduce(self, members: list[nn.Parameter], dst: int, process_group: dist.ProcessGroup | None,
               flat: Tensor | None = None) -> GradientReduce:
        """Start summing ``members``' gradients (or ``flat``) onto ``dst``; elsewhere they are
        dropped, since the flat copy is what travels."""
        if flat is None:
            flat = torch.cat([p.grad.reshape(-1) for p in members])
        if process_group is None:
            return GradientReduce(dst, members, flat, None)
        if dst != self.rank:
            for p in members:
                p.grad = None
        return GradientReduce(dst, members, flat, start_reduce(flat, dst, process_group, self.counter))


class LayerState(enum.Enum):
    """Where a layer's weights are, on this rank."""

    RELEASED = "released"  # with their holders only: the other ranks' copies have no storage
    PREFETCHING = "prefetching"  # broadcasts from the holders in flight (:attr:`OwnedLayer.version`)
    MATERIALIZED = "materialized"  # on every rank of the shard group (:attr:`OwnedLayer.version`)


class OwnedLayer:
    """The owner-sharded parameters one module's forward uses; their weights move together (one
    broadcast per holder and dtype), and so do their gradients (one reduce per holder and dtype).

    ``version`` counts the owners' weights (the sharding's count of optimizer steps and loads):
    a layer prefetching or materialized holds the weights of that version, and materializes
    again when they are outdated."""

    def __init__(self, name: str, module: nn.Module, params: list[tuple[str, nn.Parameter]],
                 ownership: Ownership) -> None:
        self.name, self.module, self.ownership = name, module, ownership
        self.params = [p for _, p in params]
        self.state = LayerState.RELEASED
        self.version: int | None = None  # of the weights prefetching or materialized
        self._broadcasts: list[Broadcast] = []
        self._from_replica_0: list[Broadcast] = []  # HSDP: updated weights coming from replica 0's owners
        self.ready: set[int] = set()  # ids of parameters whose gradient is ready, this backward

    def holds_version(self, version: int) -> bool:
        return self.state is not LayerState.RELEASED and self.version == version

    def prefetch(self, version: int, before_sending: Callable[[], None] = lambda: None) -> None:
        """Start broadcasting the weights of ``version`` from their holders, unless they are
        here or on their way; ``before_sending`` runs first when they are not (the sharding
        starts HSDP's replica broadcasts there)."""
        if self.state is LayerState.PREFETCHING:
            if self.version == version:
                return
            # a prefetch the weights outdated (activation checkpointing re-runs forward hooks in
            # backward, which prefetch layers that next run after the step): finish it on every
            # rank, then broadcast afresh
            self._finish()
        if self.holds_version(version):
            return
        before_sending()
        for broadcast in self._from_replica_0:  # a holder sends only what it has received
            broadcast.finish()
        self._from_replica_0 = []
        shard = self.ownership.groups.shard
        for (holder, _), members in self.ownership.by_holder(self.params).items():
            if holder != self.ownership.rank:
                for p in members:
                    allocate(p)
            if shard is not None:
                self._broadcasts.append(self.ownership.broadcast(members, holder, shard))
        self.state, self.version = LayerState.PREFETCHING, version

    def materialize(self, version: int, before_sending: Callable[[], None] = lambda: None) -> None:
        """The weights of ``version`` on this rank, now."""
        self.prefetch(version, before_sending)
        self._finish()

    def _finish(self) -> None:
        for broadcast in self._broadcasts:
            broadcast.finish()
        self._broadcasts = []
        self.state = LayerState.MATERIALIZED

    def release(self) -> None:
        """Free the copies of the weights this rank does not hold (after any broadcast into them
        has finished)."""
        if self.state is LayerState.PREFETCHING:
            self._finish()
        for p in self.params:
            if not self.ownership.holds(p):
                free(p)
        self.state, self.version = LayerState.RELEASED, None

    def receive_from_replica_0(self) -> None:
        """HSDP: start receiving the weights replica 0's owners just updated (a holder here) or
        sending them (an owner)."""
        ownership = self.ownership
        for (holder, _), members in ownership.by_holder(self.params).items():
            if holder == ownership.rank:
                self._from_replica_0.append(ownership.broadcast(members, ownership.owner_of[id(members[0])],
                                                                ownership.groups.replica))

    def start_reduces(self) -> list[GradientReduce]:
        """Start summing the gradients of this layer's parameters that have one onto their holders."""
        reduces = []
        for (holder, _), members in self.ownership.by_holder(self.params).items():
            with_grad = [p for p in members if p.grad is not None]
            if with_grad:
                reduces.append(self.ownership.reduce(with_grad, holder, self.ownership.groups.shard))
        return reduces
