"""How each Muon parameter is stored across ranks — the one module that reads DTensor and
process-group internals.

Every supported storage reduces to one picture: an *exchange group* of P ranks arranged as
R replicas × S shards (position p = replica·S + shard). The parameter's dim 0 is split into S
chunks the way DTensor's ``Shard(0)`` splits it (``torch.chunk``: ⌈D/S⌉ rows each, the last
ranks possibly empty); the rank at shard index s holds chunk s, and the R replicas hold the same.

=========================  ======================================  =====  =====
storage                    exchange group                          R      S
=========================  ======================================  =====  =====
plain tensor, no group     none (single process)                   1      1
plain tensor under DDP     ``process_group`` (default: WORLD)      P      1
FSDP2 ``(Shard(0),)``      the mesh's group                        1      P
HSDP ``(Replicate(), Shard(0))``, replicas split the work
                           all ranks of the 2-D mesh (WORLD)       R      S
HSDP, each replica alone   the mesh's shard-dim group              1      S
owner-sharded (whole on    none: the owner steps it alone          1      1
one owner rank)
stack of matrices (experts none: each rank orthogonalizes the      1      1
(E, m, n)) sharded on dim  matrices it holds (its local shape)
0 over every mesh dim
=========================  ======================================  =====  =====

Two more cases leave this picture: row-wise tensor parallel ``(Shard(1),)`` is exchanged as the
transpose (``Layout.transposed``), and any other DTensor sharding (FSDP + tensor parallel with
``_StridedShard``, 2-D blocks, expert stacks sharded on a matrix dimension) is exchanged piece by
piece (``Layout.pieces``: :mod:`dmuon.strategies.pieces`), over the mesh's ranks. ``Partial``
placements raise ``NotImplementedError`` naming the parameter, and so does a mesh of part of the
job's ranks with no process group of exactly its ranks (pass one as ``process_group``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from dmuon.tensors import label


@dataclass(frozen=True)
class Layout:
    """Where one parameter's pieces live. Hashable; equal on every rank of the group."""

    shape: tuple[int, ...]  # global shape (of the transpose, when ``transposed``)
    replicas: int  # R
    shards: int  # S
    group_ranks: tuple[int, ...]  # global ranks of the exchange group, by position
    # Shard(1) (row-wise tensor parallel): the exchange runs on the transpose, whose Shard(0)
    # rows are the parameter's columns; NS(Wᵀ) = NS(W)ᵀ
    transposed: bool = False
    # any other DTensor layout (FSDP + tensor parallel, 2-D blocks): each rank's piece goes to
    # the owner and its piece of the update comes back (dmuon.strategies.pieces)
    pieces: bool = False
    # pieces, but every placement shards dim 0 (FSDP + column-wise TP: _StridedShard(0),
    # Shard(0)): the ranks hold disjoint whole rows, so distributed NS can run on them in place
    rows_partitioned: bool = False

    @property
    def size(self) -> int:
        return self.replicas * self.shards

    def chunk_rows(self, shard: int) -> int:
        """Rows of dim 0 held at shard index ``shard`` (DTensor ``Shard(0)`` chunking)."""
        return chunk_sizes(self.shape[0], self.shards)[shard]

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])


@functools.lru_cache(maxsize=4096)
def chunk_sizes(rows: int, shards: int) -> tuple[int, ...]:
    """``torch.chunk`` sizes of ``rows`` over ``shards``: ⌈rows/shards⌉ each until rows run out
    (kept: a step asks for them per matrix, and a plan of 65536 ranks for few distinct ones)."""
    per = -(-rows // shards) if rows else 0
    return tuple(max(0, min(per, rows - s * per)) for s in range(shards))


@functools.lru_cache(maxsize=4096)
def chunk_size_vector(rows: int, shards: int) -> Tensor:
    """:func:`chunk_sizes` as an int64 vector (shared: never written to)."""
    return torch.tensor(chunk_sizes(rows, shards), dtype=torch.int64)


class OwnerShardingHandle(Protocol):
    """What the optimizer needs from an owner sharding (:mod:`dmuon.owner`)."""

    def wait_for_gradients(self) -> None: ...

    def weights_changed(self) -> None: ...

    @property
    def across_replicas(self) -> bool: ...

    def notify_final_gradients(self, listener: Callable[[Sequence[Tensor]], None]) -> Any: ...

    @property
    def process_group(self) -> dist.ProcessGroup | None: ...


@dataclass(frozen=True)
class OwnedParam:
    """Marks a parameter stored whole on one owner rank of its sharding's group."""

    owner: int  # global rank
    sharding: OwnerShardingHandle

    @property
    def is_mine(self) -> bool:
        return self.owner == (dist.get_rank() if dist.is_initialized() else 0)


_OWNED_ATTR = "_dmuon_owned"


def mark_owned(param: Tensor, owned: OwnedParam) -> None:
    setattr(param, _OWNED_ATTR, owned)


def owned_by(param: Tensor) -> OwnedParam | None:
    """The ownership of an owner-sharded parameter, or None for any other storage."""
    return getattr(param, _OWNED_ATTR, None)


def owner_shardings(params: Sequence[Tensor]) -> tuple[list[bool], list[OwnerShardingHandle]]:
    """Whether this rank steps each of ``params`` (always, unless it is owner-sharded to another
    rank), and the owner shardings they belong to, once each."""
    owned = [owned_by(p) for p in params]
    shardings = {id(o.sharding): o.sharding for o in owned if o is not None}
    return [o is None or o.is_mine for o in owned], list(shardings.values())


def counted_here(param: Tensor, replicas: dist.ProcessGroup | None = None) -> bool:
    """Whether this rank's piece of ``param`` (or of its gradient) is the copy that counts in a
    job-wide sum, so that every element counts exactly once: owner-sharded parameters on their
    owner; DTensor shards on every rank, but replicated mesh dims at coordinate 0 only; plain
    (replicated) tensors on the first rank of ``replicas``, the group holding their copies
    (default: the world, rank 0)."""
    owned = owned_by(param)
    if owned is not None:
        return owned.is_mine
    if isinstance(param, DTensor):
        coordinate = param.device_mesh.get_coordinate() or []
        return all(c == 0 for c, p in zip(coordinate, param.placements) if p.is_replicate())
    if not dist.is_initialized():
        return True
    return dist.get_rank() == (dist.get_global_rank(replicas, 0) if replicas is not None else 0)


def ranks_holding(param: Tensor, process_group: dist.ProcessGroup | None) -> tuple[int, ...]:
    """The ranks that hold ``param`` (its pieces or copies): a plain tensor's are
    ``process_group``'s (default: the world's)."""
    groups = _groups_of(param)
    return groups[0] if groups is not None else tuple(sorted(_group_ranks(process_group or dist.group.WORLD)))


def _groups_of(param: Tensor) -> tuple[tuple[int, ...], list[dist.ProcessGroup]] | None:
    """The ranks that hold ``param`` (its pieces or copies) and the process groups made for
    them up front (a DTensor's mesh dimensions, an owner sharding's group); None for a plain
    tensor, whose ranks are its optimizer's ``process_group``'s."""
    owned = owned_by(param)
    if owned is not None:
        group = owned.sharding.process_group
        return (tuple(_group_ranks(group)), [group]) if group is not None else ((owned.owner,), [])
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        return tuple(sorted(mesh.mesh.flatten().tolist())), [mesh.get_group(d) for d in range(mesh.ndim)]
    return None


def agreement_group(params: Sequence[tuple[str | None, Tensor]],
                    process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The process group over which an optimizer of ``params`` agrees: the ranks that share its
    parameters, not the whole job, so that the optimizers of pipeline stages (or of anything on
    disjoint ranks) never meet. ``process_group`` (the ranks holding copies of the plain
    tensors) where given; else the world where every parameter is a plain tensor (a replica on
    every rank); else the group, among those the parameters' meshes and owner shardings were
    built with (DeviceMesh makes them up front, on every rank at once), whose ranks are all the
    ranks holding a DTensor or owner-sharded parameter — the plain tensors among them (a bias
    FSDP2 ignores, say) are replicas on those ranks. None in a single process.

    Raises a ValueError naming a parameter held on ranks ``process_group`` lacks, or ranks of
    ``process_group`` that hold none of the DTensor or owner-sharded parameters (a pipeline
    stage's optimizer given the whole job's group: the other stages would never join its
    collectives), or where no group has exactly the ranks holding the parameters (parameters
    on meshes of different parts of the job, a 2-D mesh over part of it): then pass
    ``process_group=``.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    held = [(name, tensor, _groups_of(tensor)) for name, tensor in params]
    placed = [(name, tensor, groups) for name, tensor, groups in held if groups is not None]
    union = tuple(sorted({rank for _, _, (ranks, _) in placed for rank in ranks}))
    if process_group is not None:
        ranks = set(_group_ranks(process_group))
        for name, tensor, groups in placed:
            if not set(groups[0]) <= ranks:
                raise ValueError(f"Invalid process_group: it covers ranks {sorted(ranks)}, but parameter "
                                 f"{label(name, tensor)} lives on ranks {list(groups[0])}. Pass a group of every "
                                 "rank holding the optimizer's parameters (or leave process_group out).")
        if placed and ranks != set(union):
            name, tensor, _ = placed[0]
            raise ValueError(f"Invalid process_group: it covers ranks {sorted(ranks)}, but the optimizer's parameters "
                             f"live on ranks {list(union)} (parameter {label(name, tensor)} on ranks "
                             f"{list(placed[0][2][0])}): ranks {sorted(ranks - set(union))} hold none of them and "
                             "would never join its collectives. Pass a group of exactly the ranks holding them (a "
                             "pipeline stage's: its mesh's group), or leave process_group out.")
        return process_group
    if not placed:
        return dist.group.WORLD
    group = _group_of_exactly(union, [g for _, _, (_, groups) in placed for g in groups])
    if group is not None:
        return group
    name, tensor, (ranks, _) = placed[0]
    raise ValueError(f"The optimizer's parameters live on ranks {list(union)} (parameter {label(name, tensor)} on "
                     f"ranks {list(ranks)}), part of the job, and none of their meshes has a process group of exactly "
                     "those ranks. Pass process_group= a group of them, created on every rank of the job at the same "
                     "point (dist.new_group, or a DeviceMesh dimension made up front).")


def _splits_dim0_only(placements: tuple) -> bool:
    """Sharded on dim 0 over every mesh dim (plain or strided): every rank holds whole slices
    along dim 0, and no two ranks the same (with a Replicate dim, replicas would repeat the
    work; those stacks go through the exchange, which can split it)."""
    return all(getattr(p, "dim", None) == 0 for p in placements)  # Shard(0), _StridedShard(0)


def row_state_placements(param: DTensor, stack: bool) -> tuple:
    """Where an update rule's row state of ``param`` lives (:mod:`dmuon.rules`): whole on every
    rank holding a piece of the parameter (replicated: its owner needs every row), except for a
    stack whose ranks hold whole matrices (:func:`detect_layout`'s local stacks), sharded as it is."""
    placements = tuple(param.placements)
    if stack and _splits_dim0_only(placements):
        return placements
    return (Replicate(),) * len(placements)


def row_state_zeros(param: Tensor, shape: tuple[int, ...], stack: bool) -> Tensor:
    """A zero row state of ``shape`` (fp32) for ``param``, placed as :func:`row_state_placements` says."""
    zeros = torch.zeros(shape, dtype=torch.float32, device=param.device)
    if not isinstance(param, DTensor):
        return zeros
    return distribute_tensor(zeros, param.device_mesh, row_state_placements(param, stack), src_data_rank=None)


def last_dim_splits(param: Tensor) -> list[tuple[int, bool]]:
    """The mesh dims that split ``param``'s last dim: each one's size, and whether it is a plain
    ``Shard`` (torch's even chunks; not a ``_StridedShard``)."""
    if not isinstance(param, DTensor):
        return []
    last = param.ndim - 1
    return [(param.device_mesh.size(d), type(p) is Shard) for d, p in enumerate(param.placements)
            if isinstance(p, Shard) and p.dim % param.ndim == last]


def placed_like(piece: Tensor, param: Tensor, shape: tuple[int, ...]) -> Tensor:
    """This rank's ``piece`` of a tensor of global ``shape`` (contiguous), placed as ``param`` is:
    a DTensor on its mesh with its placements, or ``piece`` itself beside a plain tensor. The
    caller has made ``piece`` what those placements give this rank."""
    if not isinstance(param, DTensor):
        return piece
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(piece, param.device_mesh, param.placements, run_check=False, shape=shape, stride=stride)


def _group_ranks(process_group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(process_group))


def _replicated_layout(param: Tensor, process_group: dist.ProcessGroup | None
                       ) -> tuple[Layout, dist.ProcessGroup | None]:
    """A plain tensor's layout: a replica on every rank of ``process_group`` (the world's by default)."""
    if not dist.is_available() or not dist.is_initialized():
        return Layout(tuple(param.shape), 1, 1, (0,)), None
    exchange_group = process_group or dist.group.WORLD
    ranks = _group_ranks(exchange_group)
    if len(ranks) == 1:
        return Layout(tuple(param.shape), 1, 1, ranks), None
    return Layout(tuple(param.shape), len(ranks), 1, ranks), exchange_group


def detect_layout(
    param: Tensor, name: str, process_group: dist.ProcessGroup | None, *, split_replicas: bool,
    stack: bool = False,
) -> tuple[Layout, dist.ProcessGroup | None]:
    """The layout of ``param`` and the process group its exchange runs on (None: no exchange).

    ``split_replicas``: for HSDP, whether the replicas split the work (exchange over all mesh
    ranks) or each replica group orthogonalizes everything alone (exchange over its shards).
    ``stack``: Muon sees ``param`` as a stack of matrices along dim 0 (expert weights), so a
    Shard(0) split hands every rank whole matrices, which it orthogonalizes itself.
    """
    if owned_by(param) is not None:  # whole on its owner, which steps it alone
        return Layout(tuple(param.shape), 1, 1, (owned_by(param).owner,)), None
    if stack and isinstance(param, DTensor) and _splits_dim0_only(tuple(param.placements)):
        rank = dist.get_rank() if dist.is_initialized() else 0
        return Layout(tuple(param.to_local().shape), 1, 1, (rank,)), None
    if not isinstance(param, DTensor):
        return _replicated_layout(param, process_group)
    mesh, placements = param.device_mesh, tuple(param.placements)
    shape = tuple(param.shape)
    if len(placements) == 1 and type(placements[0]) is Shard and placements[0].dim == 0:
        exchange_group = mesh.get_group(0)
        return Layout(shape, 1, mesh.size(0), _group_ranks(exchange_group)), exchange_group
    if (
        len(placements) == 2
        and type(placements[0]) is Replicate
        and type(placements[1]) is Shard
        and placements[1].dim == 0
    ):
        replicas, shards = mesh.size(0), mesh.size(1)
        mesh_ranks = tuple(mesh.mesh.flatten().tolist())
        world = dist.get_world_size()
        if split_replicas and mesh_ranks == tuple(range(world)):
            return Layout(shape, replicas, shards, mesh_ranks), dist.group.WORLD
        exchange_group = mesh.get_group(1)
        return Layout(shape, 1, shards, _group_ranks(exchange_group)), exchange_group
    if all(type(p) is Replicate for p in placements):
        exchange_group = mesh.get_group(0) if mesh.ndim == 1 else None
        if exchange_group is not None:
            return Layout(shape, mesh.size(0), 1, _group_ranks(exchange_group)), exchange_group
    if len(placements) == 1 and type(placements[0]) is Shard and placements[0].dim == 1 and len(shape) == 2:
        exchange_group = mesh.get_group(0)
        layout = Layout((shape[1], shape[0]), 1, mesh.size(0), _group_ranks(exchange_group), transposed=True)
        return layout, exchange_group
    mesh_ranks = tuple(sorted(mesh.mesh.flatten().tolist()))
    exchange_group = _group_of_exactly(mesh_ranks, [process_group])
    if not any(p.is_partial() for p in placements) and exchange_group is not None:
        return Layout(shape, 1, len(mesh_ranks), _group_ranks(exchange_group), pieces=True,
                      rows_partitioned=len(shape) == 2 and _splits_dim0_only(placements)), exchange_group
    raise NotImplementedError(
        f"dmuon.Muon does not support the layout of parameter {name!r}: placements "
        f"{placements} on a {mesh.ndim}-D mesh of ranks {list(mesh_ranks)}. "
        + ("Partial placements: reduce them first." if any(p.is_partial() for p in placements) else
           "Its mesh covers part of the job's ranks, and no process group of exactly those ranks is known: pass "
           "one as process_group= (created on every rank at the same point, e.g. right after init_device_mesh).")
    )


def _group_of_exactly(ranks: tuple[int, ...],
                      candidates: Sequence[dist.ProcessGroup | None]) -> dist.ProcessGroup | None:
    """A process group whose ranks are exactly ``ranks`` (sorted): the world, or the first of
    ``candidates`` (groups made up front) that is; None where none is."""
    if ranks == tuple(range(dist.get_world_size())):
        return dist.group.WORLD
    return next((g for g in candidates if g is not None and tuple(sorted(_group_ranks(g))) == ranks), None)


def piece_index_lists(param: DTensor) -> tuple[Tensor, ...]:
    """This rank's piece of ``param`` as one index list per dimension (int64, CPU): the piece is
    their outer product, in the order of the local tensor. Each list comes from cutting a tensor
    of indices as DTensor cuts the parameter (its other dimensions just long enough that every
    rank's piece of them has an element), so the pieces follow DTensor's own rules, ``Shard``
    and ``_StridedShard`` alike."""
    mesh, placements, shape = param.device_mesh, param.placements, tuple(param.shape)
    enough = math.prod(mesh.shape) * math.prod(getattr(p, "split_factor", 1) for p in placements)
    lists = []
    for d, size in enumerate(shape):
        sizes = [size if i == d else enough for i in range(len(shape))]
        view = [size if i == d else 1 for i in range(len(shape))]
        cut = piece_of(torch.arange(size).view(view).expand(sizes), mesh, placements)
        first = tuple(slice(None) if i == d else 0 for i in range(len(shape)))
        lists.append(cut[first].cpu() if cut.numel() else torch.zeros(cut.shape[d], dtype=torch.int64))
    return tuple(lists)


def piece_of(whole: Tensor, mesh, placements) -> Tensor:
    """This rank's piece of a whole tensor every rank holds, for a DTensor layout (no
    communication: every rank cuts its own)."""
    return distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()


# ---------------------------------------------------------------- FSDP2 after a backward pass that raised


def fsdp_states(model: nn.Module | None) -> list[Any]:
    """The FSDP2 states of ``model``'s modules (none without FSDP2 or a model)."""
    try:  # FSDP2's private module (torch 2.6 and later, as tested with 2.13)
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    except ImportError:
        return []
    if model is None:
        return []

    return [state for module in model.modules() if (state := _get_module_fsdp_state(module)) is not None]


def fsdp_left_in_backward(states: Sequence[Any]) -> bool:
    """Whether FSDP2 is still in a backward pass that raised: outside any backward pass, some
    module's parameters are in its backward states. FSDP2 (torch 2.13) resets them only at the
    end of a backward pass that completes; until then its modules keep their unsharded
    parameters and no later backward pass reduces a gradient (the sharded parameters get none)."""
    if not states or torch._C._current_graph_task_id() != -1:
        return False
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    stuck = (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD)
    return any(getattr(getattr(s, "_fsdp_param_group", None), "_training_state", None) in stuck for s in states)


def finish_fsdp_backward(states: Sequence[Any]) -> bool:
    """Where FSDP2 is left in a backward pass that raised (:func:`fsdp_left_in_backward`), run
    the end of that pass as FSDP2 does when one completes (its root's final callback: the
    reduce-scatters of the gradients the pass reached — collective, as every rank caught the
    failure at the same point —, resharding, its states reset). Whether it did."""
    if not fsdp_left_in_backward(states):
        return False
    for root in [s for s in states if getattr(s, "_is_root", False)]:
        root._root_post_backward_final_callback()
    return True
