"""Setting owner sharding up: the process groups from a mesh, the layers whose parameters move
together, and each parameter's owner (:func:`dmuon.planner.plan_ownership`), agreed by every
rank before any data moves (:func:`shard_by_owner`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmuon.agreement import agreed_call
from dmuon.exchange import default_device
from dmuon.layout import owned_by
from dmuon.orthogonalization import newton_schulz_flops, resolve_config
from dmuon.owner.layer import Groups, storage_bytes
from dmuon.owner.sharding import OwnerSharding
from dmuon.planner import plan_ownership
from dmuon.routing import default_route, matrix_shape, module_roles


def find_layers(model: nn.Module, managed: dict[int, str], layers: Iterable[nn.Module] | None
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


def groups_and_ranks(mesh_or_group) -> tuple[Groups, list[int], list[int]]:
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
        return groups_and_ranks(mesh_or_group.get_group(0))
    if ndim == 2 and mesh_or_group.size(0) == 1:
        return groups_and_ranks(mesh_or_group.get_group(1))
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
class Setup:
    """What :func:`shard_by_owner` decides on each rank before the ranks agree."""

    layers: list[tuple[str, nn.Module, list[tuple[str, nn.Parameter]]]]
    ordered: list[tuple[str, nn.Parameter]]  # the owner-sharded parameters, layer by layer
    positions: list[int]  # each one's owner, by position in the shard group
    rest: list[nn.Parameter] | None  # replicated here (replicate_rest), else None


def plan_setup(model: nn.Module, params: Iterable[nn.Parameter] | None, layers: Iterable[nn.Module] | None, size: int,
          replicate_rest: bool) -> Setup:
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
        if owned_by(p) is not None:
            raise ValueError(f"Parameter {name!r} is owner-sharded already: shard_by_owner ran on this model before "
                             "(shard a model once; its OwnerSharding is the one to use).")
        if not isinstance(p, nn.Parameter) or type(p.data) is not Tensor:
            raise ValueError(f"Parameter {name!r} is a {type(p.data).__name__}: shard_by_owner needs plain "
                             "tensors (call it before fully_shard).")
        if not p.is_contiguous() or p.storage_offset() or p.untyped_storage().nbytes() != storage_bytes(p):
            raise ValueError(f"Parameter {name!r} shares its storage with other tensors; shard_by_owner "
                             "frees and refills whole storages.")
        if p.ndim < 2:
            raise ValueError(f"Parameter {name!r} has shape {tuple(p.shape)}; only matrices are owner-sharded.")
        if not p.requires_grad:
            raise ValueError(f"Parameter {name!r} is frozen (requires_grad=False): owner sharding needs the hooks "
                             "of a trainable parameter. Leave it out of params.")
    managed = {id(p): n for n, p in chosen}
    grouped = find_layers(model, managed, layers)
    ordered = [(n, p) for _, _, members in grouped for n, p in members]
    flops = []
    for _, p in ordered:
        count, m, n = matrix_shape(p.shape, "auto")
        config = resolve_config((m, n), p.device.type)
        flops.append(count * newton_schulz_flops(m, n, steps=config.steps, method=config.method,
                                                 restarts=config.restarts))
    positions = plan_ownership([n for n, _ in ordered], flops, [storage_bytes(p) for _, p in ordered], size)
    rest = [p for n, p in named.values() if p.requires_grad and id(p) not in managed] if replicate_rest else None
    return Setup(grouped, ordered, positions, rest)


def setup_fingerprint(setup: Setup, model: nn.Module, reshard_after_forward: bool) -> list[tuple[str, str]]:
    """What the ranks compare before they shard: every owner-sharded parameter, its layer, the options."""
    fingerprint = [(f"owner-sharded parameter {name!r}", f"{tuple(p.shape)} {p.dtype} in layer {layer}")
                   for layer, _, members in setup.layers for name, p in members]
    rest_ids = {id(p) for p in setup.rest or ()}
    rest = [n for n, p in model.named_parameters() if id(p) in rest_ids]
    return [*fingerprint, ("options", repr((reshard_after_forward, rest)))]


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
    """Store each Muon weight matrix of ``model`` whole on one owner rank (:mod:`dmuon.owner`).

    Call it on every rank with the same model, after moving it to its device (non-owners' tensors
    have no storage to move afterwards), before ``fully_shard`` and creating the optimizer.

    Args:
        model: the model, on its device.
        mesh_or_group: a process group or 1-D DeviceMesh (default: the world), or a 2-D
            (replicate, shard) mesh for HSDP: each replica holds every matrix once among its shard
            ranks; gradients are reduced within the replica, then to replica 0's holder, which
            alone steps; the updated weight goes back to the other replicas' holders at the start
            of the next forward.
        reshard_after_forward: False keeps broadcast weights until backward ("Z2"); True frees
            them after forward and broadcasts again in backward ("Z3").
        layers: modules whose owner-sharded parameters move together (one broadcast per owner per
            layer, e.g. the transformer blocks); by default each module holding such parameters.
        params: the parameters to owner-shard; by default those :class:`dmuon.Muon` routes to Muon.
        replicate_rest: keep every other parameter replicated (gradients all-reduced here, like
            DDP); pass False when FSDP2/DDP handles them
            (``fully_shard(..., ignored_params=sharding.params)``).
        sync_module_states: rank 0's initial values everywhere first, as DDP does.

    Returns:
        The :class:`OwnerSharding`, whose ``params`` FSDP2 or DDP should leave alone.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a frozen or unsupported parameter, or ranks that disagree (on every rank).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_by_owner takes an nn.Module, not a {type(model).__name__}.")
    groups, holder_ranks, owner_ranks = groups_and_ranks(mesh_or_group)
    planned: list[Setup] = []

    def local_part() -> list[tuple[str, str]]:
        planned.append(plan_setup(model, params, layers, len(holder_ranks), replicate_rest))
        return setup_fingerprint(planned[0], model, reshard_after_forward)

    def device() -> torch.device:
        ordered = planned[0].ordered if planned else []
        return next((p.device for _, p in ordered), default_device(groups.everyone))

    # before any data moves: every rank must shard the same model alike, and a failure on one
    # rank stops them all
    agreed_call("shard_by_owner", local_part, groups.everyone, device, what="owner sharding")
    setup = planned[0]
    sharding = OwnerSharding(model, setup.ordered, setup.layers, [holder_ranks[q] for q in setup.positions],
                             [owner_ranks[q] for q in setup.positions], groups, reshard_after_forward, setup.rest)
    sharding.install(sync_module_states)
    return sharding
