"""The collective entry points of :class:`dmuon.Muon` besides the step: construction,
``add_param_group`` and ``load_state_dict``.

Each runs in two parts. First this rank's part: its checks and changes, with no collective.
Then the agreement (:func:`dmuon.agreement.agreed_call`): the ranks compare the configuration
the first part gave them, so that a failure on any rank, or ranks that differ, raise the same
error on every rank before any data moves, and what the first part changed is undone. The
digest the ranks agreed on is what every later step compares (:meth:`dmuon.step.Stepper.agreed`).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmuon import loading, param_groups, torch_muon
from dmuon.agreement import Fingerprint, agreed_call, issued_number, record_number
from dmuon.exchange import GroupRef, collective_device
from dmuon.hyperparameters import ROUTE_REASONS, ROUTING_KEYS, EngineOptions, check_use_addmm, validate_defaults
from dmuon.layout import agreement_group, ranks_holding
from dmuon.routing import module_roles
from dmuon.step import Stepper


class Facade(Protocol):
    """What the entry points read and fill on a :class:`dmuon.Muon`, which declares each."""

    param_groups: list[dict[str, Any]]
    state: dict
    defaults: dict[str, Any]
    _stepper: Stepper
    _job: GroupRef
    _process_group: GroupRef
    _module_roles: dict[int, str]


def replica_group(params: Any, process_group: Any) -> dist.ProcessGroup | None:
    """The process group of the optimizer's plain (replicated) tensors: ``process_group``, else
    that of a ``DistributedDataParallel`` model passed as ``params`` (its replicas live on its
    ranks, which may be a sub-group: a pipeline stage).

    Raises:
        TypeError: ``process_group`` is not a process group.
        ValueError: it covers other ranks than the DDP model passed as ``params``.
    """
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"Invalid process_group={process_group!r}. Must be a torch.distributed.ProcessGroup "
                        "(dist.group.WORLD, dist.new_group(...), a DeviceMesh's get_group()) or None.")
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(params, DistributedDataParallel):
        return process_group
    if process_group is None:
        return params.process_group
    ours, theirs = dist.get_process_group_ranks(process_group), dist.get_process_group_ranks(params.process_group)
    if ours != theirs:
        raise ValueError(f"Invalid process_group: it covers ranks {ours}, but the DistributedDataParallel model "
                         f"passed as params reduces over ranks {theirs}. Leave process_group out (dmuon takes the "
                         "DDP model's) or pass the DDP model's process group.")
    return process_group


def construct(opt: Facade, params: nn.Module | Iterable[Any], defaults: dict[str, Any], options: EngineOptions,
              process_group: dist.ProcessGroup | None, use_addmm: bool) -> None:
    """:class:`dmuon.Muon`'s constructor: the groups built and checked, then agreed, the ranks
    also agreeing on the optimizer's number, so that a step of another optimizer is never taken
    for this one's."""
    # first: a failure below is shared with the other ranks; held weakly, like every group dmuon keeps
    replicas = replica_group(params, process_group)
    opt._process_group = GroupRef(replicas)
    if not isinstance(params, (nn.Module, Tensor, set)):
        params = list(params)  # read twice: for the ranks that hold them, then to build the groups
    # the ranks that share the parameters agree, not the whole job (pipeline stages)
    job = agreement_group(param_groups.tensors_in(params), replicas)
    if replicas is None and job is not None and job is not dist.group.WORLD:
        opt._process_group = GroupRef(job)  # plain tensors beside a stage's DTensors: replicas on its ranks
    opt._job = GroupRef(job)

    def build() -> Fingerprint:
        check_use_addmm(use_addmm)  # torch.optim.Muon's switch; dmuon's products are always fused
        _build(opt, params, defaults, options)
        return fingerprint(opt)

    job = opt._job()
    digest, agreed = agreed_call("construction", build, job, lambda: device_of(opt),
                                 number=issued_number(job) if job is not None else 0)
    stepper = opt._stepper
    stepper.number = agreed.number + 1 if agreed is not None else 0
    if job is not None:
        record_number(job, stepper.number)
    stepper.agreed(opt.param_groups, digest)  # from here on add_param_group is collective
    if options.symmetric_products == "auto":  # a collective: after the ranks agree on the options
        from dmuon.timing import choose_symmetric_products  # imported only when measuring

        stepper.symmetric_by_shape.update(choose_symmetric_products(
            param_groups.muon_params(opt.param_groups), device_of(opt), job))


def _build(opt: Facade, params: nn.Module | Iterable[Any], defaults: dict[str, Any], options: EngineOptions) -> None:
    """Everything the constructor does before the ranks compare notes (purely local)."""
    validate_defaults(defaults, options)
    param_groups.check_params_type(params)
    opt._module_roles = {}
    opt._stepper = Stepper(options, opt._process_group, opt._job)
    if isinstance(params, nn.Module):
        opt._module_roles = module_roles(params)
        opt._stepper.model = weakref.ref(params)  # add_param_group looks up the names of new parameters
        params = list(params.named_parameters())
    torch.optim.Optimizer.__init__(opt, params, defaults)
    opt._module_roles = {}  # used for routing at construction only; params may be swapped later
    param_groups.check_not_a_whole_model_by_shape(opt.param_groups)
    for warning in (param_groups.shape_routing_warning(opt.param_groups),
                    param_groups.fp16_adamw_warning(opt.param_groups)):
        if warning:
            warnings.warn(warning, stacklevel=6)  # _build <- build <- agreed_call <- construct <- __init__ <- caller
    opt._stepper.check_layouts(opt.param_groups)


def add_param_group(opt: Facade, param_group: dict[str, Any]) -> None:
    """:meth:`dmuon.Muon.add_param_group`: agreed, unless torch's constructor calls it (the
    constructor's agreement then covers the group)."""
    named = bool(getattr(opt, "param_groups", None)) and "param_names" in opt.param_groups[0]

    def build() -> dict[str, Any]:
        return param_groups.build_group(param_group, opt.defaults, len(opt.param_groups), opt._module_roles,
                                        param_groups.names_in(opt._stepper.model()) if named else None)

    if opt._stepper.structure_words is None:
        _add_stored(opt, build())
        return
    before = len(opt.param_groups)

    def add() -> Fingerprint:
        _add_stored(opt, build())
        _check_same_ranks(opt)
        return fingerprint(opt)

    try:
        digest, _ = agreed_call("add_param_group", add, opt._job(), lambda: device_of(opt))
    except BaseException:
        del opt.param_groups[before:]
        raise
    opt._stepper.agreed(opt.param_groups, digest)


def _add_stored(opt: Facade, group: dict[str, Any]) -> None:
    # torch's add_param_group would copy the constructor's defaults into the group, including
    # the adamw_* aliases and nonfinite_grads; every key is filled already.
    defaults, opt.defaults = opt.defaults, {}
    try:
        torch.optim.Optimizer.add_param_group(opt, group)
    finally:
        opt.defaults = defaults


def _check_same_ranks(opt: Facade) -> None:
    """An added group's parameters live on the optimizer's ranks: its agreement and exchanges
    run over those (an optimizer per set of ranks: a pipeline stage's)."""
    job = opt._job()
    if job is None:
        return
    ranks = sorted(dist.get_process_group_ranks(job))
    g = len(opt.param_groups) - 1
    for name, p in param_groups.all_entries(opt.param_groups)[-len(opt.param_groups[g]["params"]):]:
        held = ranks_holding(p, opt._process_group())
        if not set(held) <= set(ranks):
            raise ValueError(f"Parameter {name!r} of param group {g} lives on ranks {list(held)}, this optimizer's "
                             f"parameters on ranks {ranks}: give it an optimizer of its own.")


def load_state_dict(opt: Facade, state_dict: dict[str, Any]) -> None:
    """:meth:`dmuon.Muon.load_state_dict`: checked, loaded and agreed; on a failure anywhere,
    every rank keeps its old state."""
    kept = opt.state, opt.param_groups

    def load() -> Fingerprint:
        loaded = state_dict
        if torch_muon.is_torch_muon_state_dict(state_dict):
            loaded = torch_muon.from_torch_muon(state_dict, opt.param_groups)
        loaded = loading.with_new_keys(loaded, opt.param_groups)
        loading.check_loadable(loaded, opt.param_groups)
        torch.optim.Optimizer.load_state_dict(opt, loaded)
        # The per-parameter facts are this build's: derived from the groups and parameters, never
        # read from a checkpoint (a flattened one holds another layout's lists; torch.optim.Muon's none).
        for group, before in zip(opt.param_groups, kept[1]):
            group.update({key: before[key] for key in (*ROUTING_KEYS, ROUTE_REASONS, "param_names") if key in before})
        loading.restore_kept_dtypes(loaded, opt.param_groups, opt.state)  # by this build's routes
        return fingerprint(opt)

    try:
        digest, _ = agreed_call("load_state_dict", load, opt._job(), lambda: device_of(opt))
    except BaseException:
        opt.state, opt.param_groups = kept
        raise
    opt._stepper.agreed(opt.param_groups, digest)


def fingerprint(opt: Facade) -> Fingerprint:
    """What the ranks compare at every entry point: the groups and options
    (:func:`dmuon.param_groups.fingerprint`), the optimizer's number, and what ``ns_dtype=None``
    resolves to (a processor-fit default: ranks on processors of different kinds must not mix dtypes)."""
    return [*param_groups.fingerprint(opt.param_groups, opt._stepper.options.describe(),
                                      opt.defaults["nonfinite_grads"], across_ranks=opt._job() is not None),
            ("the optimizer's number", repr(opt._stepper.number)),
            ("what ns_dtype=None resolves to", repr(param_groups.default_dtype_reasons(opt.param_groups)))]


def device_of(opt: Facade) -> torch.device:
    """The device the optimizer's collectives run on."""
    return collective_device(getattr(opt, "param_groups", ()), opt._job())
