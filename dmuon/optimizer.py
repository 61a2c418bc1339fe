"""``dmuon.Muon``: Muon for hidden matrices and AdamW for the rest, in one ``torch.optim.Optimizer``."""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon import param_groups
from dmuon.agreement import Fingerprint, agree_on_step, agreed_call, digest_words, issued_number, record_number
from dmuon.early_start import (
    CHANGED,
    USED,
    DDPReduction,
    EarlyStart,
    unsupported_because,
    wanted,
)
from dmuon.elementwise import adamw_steps, update_momentum_of
from dmuon.engine import StepStats
from dmuon.exchange import GroupRef, collective_device
from dmuon.hyperparameters import (
    ROUTE_REASONS,
    EngineOptions,
    check_use_addmm,
    unexpected_option_message,
    validate_defaults,
)
from dmuon.layout import agreement_group, owned_by, owner_shardings, ranks_holding
from dmuon.orthogonalization import NORMALIZATION_EPS, default_dtype_reason
from dmuon.planner import DEFAULT_BUCKET_BYTES, Plan
from dmuon.routing import Route, module_roles
from dmuon.statistics import step_statistics
from dmuon.step_plan import StepPlan, build_engine, steps_here
from dmuon.step_values import StepValues


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


class StepCompanion(Protocol):
    """What follows an optimizer's steps (a :class:`dmuon.QKClip`): its figures join
    :meth:`Muon.statistics`, its fingerprint the step's agreement (so that the ranks compare it
    before anything moves), and ``zero_grad()`` tells it that the gradients are gone."""

    def statistics(self) -> dict[str, float]: ...

    def step_fingerprint(self) -> list[tuple[str, str]]: ...

    def discard(self) -> None: ...


class Muon(torch.optim.Optimizer):
    """Muon for hidden weight matrices, AdamW for everything else, in one optimizer.

    **Algorithm.** For each matrix parameter W (gradient G, momentum buffer B):

    1. ``B ← μ·B + (1−μ)·G``; the Newton–Schulz input is ``M = G + μ·(B − G)`` (Nesterov) or B;
    2. ``O = NS(M)``: Newton–Schulz orthogonalization, approximately U·Vᵀ for M = U·Σ·Vᵀ
       (:func:`dmuon.newton_schulz`; Polar Express coefficients by default);
    3. ``W ← W·(1 − lr·wd) − lr·r(m, n)·O`` with r from ``adjust_lr_fn``.

    Parameters Muon does not suit (embeddings, output heads, norms, biases, scalars) get AdamW
    inside the same object; conv kernels are flattened to (out, in·k…), 3-D stacks are batches of
    matrices (rules: :mod:`dmuon.routing`; see :meth:`routing_summary`). With the default
    ``adjust_lr_fn="match_rms_adamw"`` the Muon update has AdamW's RMS, so the lr and weight decay
    of an ``AdamW(lr, weight_decay)`` run carry over unchanged to the whole model.

    **Shape of a step.** Agree on the gradients (one all-reduce under torch.distributed) →
    momentum, one ``torch._foreach_lerp_`` per group → run the step plan (:mod:`dmuon.step_plan`,
    built once: who orthogonalizes what, in which buckets, through which strategy), with AdamW
    run while the exchange's last bucket is in flight.

    **Param groups** (:mod:`dmuon.param_groups`). ``params``: an ``nn.Module`` (routing sees module
    types and names), ``named_parameters()``, tensors, or dicts, each dict one group whose
    parameters are routed one by one (``"algorithm"`` sends all to one). AdamW's parameters take
    ``adamw_lr``/``adamw_weight_decay`` when given, else the group's ``lr``/``weight_decay``.

    **Under torch.distributed** construction, ``add_param_group``, ``load_state_dict`` and ``step``
    are collective; each starts by checking that the ranks agree (:mod:`dmuon.agreement`).

    **Non-finite gradients** (``nonfinite_grads``): "skip" (default) leaves every parameter and
    state untouched for that step, warns and counts it in ``skipped_steps``; "raise" raises
    ``FloatingPointError`` naming the parameters; "ignore" does no check. A parameter whose
    ``grad`` is None is left alone (no state is created for it), as in ``torch.optim``.

    To match ``torch.optim.Muon``: ``ns_coefficients="keller"``, ``ns_method="standard"``,
    ``ns_dtype=torch.bfloat16``, ``adjust_lr_fn="original"``, ``weight_decay=0.1`` (momentum
    bitwise; updates within about 2 %, as torch normalizes in bf16).

    Args:
        params: an ``nn.Module`` (recommended: routing sees module types and names), its
            ``named_parameters()``, tensors, or param-group dicts.
        lr: learning rate (float or 0-D tensor), Muon's and, without ``adamw_lr``, AdamW's.
        weight_decay: decoupled weight decay, Muon's and, without ``adamw_weight_decay``, AdamW's.
        momentum: μ, in [0, 1).
        nesterov: Newton–Schulz input ``G + μ·(B − G)`` instead of B.
        ns_coefficients: "polar_express", "keller", "you", one (a, b, c), or a sequence of triples.
        eps: added to ‖M‖_F before normalizing (> 0).
        ns_steps: Newton–Schulz steps, 1–99.
        adjust_lr_fn: the per-matrix lr factor: "match_rms_adamw" (0.2·√max(m, n)), "original"
            or None (√max(1, m/n)), "spectral_unclamped" (√(m/n)).
        use_addmm: ``torch.optim.Muon``'s switch, accepted (a bool) and inert.
        ns_method: "standard", "gram", or "auto" (Gram from aspect ratio 2 where the dtype allows).
        ns_dtype: Newton–Schulz's compute dtype; None fits the processor (fp16 on CUDA; bf16 for
            standard NS on CPUs with native bf16, else fp32).
        ns_restarts: Gram NS restart steps (None: placed for the schedule).
        ns_blocks: fused weights' row blocks, orthogonalized apart: an int k or row counts.
        adamw_betas: AdamW's betas.
        adamw_eps: AdamW's eps.
        adamw_lr: AdamW's lr where it differs from ``lr``; it then follows ``lr``'s schedule.
        adamw_weight_decay: AdamW's weight decay where it differs from ``weight_decay``.
        nonfinite_grads: "skip", "raise" or "ignore" (above).
        process_group: the ranks holding copies of the plain (replicated) tensors, and the ranks
            the optimizer agrees over (default: a DDP model's group, else WORLD for plain tensors,
            else the group of the DTensors' meshes).
        comm_dtype: dtype on the wire (None: exact); ``torch.bfloat16`` both ways.
        bucket_bytes: Newton–Schulz input per owner per bucket (bounds transient memory).
        replica_split: HSDP: replicas split the work (True), work alone (False), or None (cost model).
        distributed_ns: 1-D sharded matrices on the ranks' column blocks (True), gathered to an
            owner (False), or None (cost model; it may also split matrices over gangs of ranks).
        symmetric_products: "torch", "triton" (CUDA or Triton's interpreter), or "auto" (timed
            per shape at construction, agreed across ranks).
        compile: True (inductor), a backend name or callable: compile Newton–Schulz and the
            element-wise updates.
        cuda_graphs: replay each distinct Newton–Schulz call on CUDA from a captured graph.
        early_start: begin Newton–Schulz in the backward pass (True: raise where it cannot; False:
            off; None: where the layout allows and the device pays, CUDA).

    Raises:
        ValueError: an invalid option, named with its group (``Invalid momentum=1.0 in param
            group 0. Must be >= 0.0 and < 1.0.``), an unknown group key with the nearest one, a
            layout no strategy takes, or ranks that disagree (the same error on every rank).
        TypeError: an unknown keyword argument, named with dmuon's nearest option; a
            ``process_group`` that is not a ``ProcessGroup``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Muon:
        # an option from another optimizer gets a pointer to dmuon's, not Python's bare TypeError;
        # a subclass whose __init__ takes **kwargs passes them on, or uses them itself: its business
        options = inspect.signature(cls.__init__).parameters
        if any(o.kind is inspect.Parameter.VAR_KEYWORD for o in options.values()):
            return super().__new__(cls)
        unknown = [k for k in kwargs if k not in options]
        if unknown:
            raise TypeError(unexpected_option_message(cls.__name__, unknown[0], [o for o in options if o != "self"]))
        return super().__new__(cls)

    def __init__(
        self,
        params: nn.Module | Iterable[Any],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = "polar_express",
        eps: float = NORMALIZATION_EPS,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        use_addmm: bool = False,
        *,  # torch.optim.Muon's arguments above, in its order; dmuon's own by keyword only
        ns_method: str = "auto",
        ns_dtype: torch.dtype | str | None = None,
        ns_restarts: Sequence[int] | None = None,
        ns_blocks: int | Sequence[int] | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_lr: float | Tensor | None = None,
        adamw_weight_decay: float | None = None,
        nonfinite_grads: str = "skip",
        process_group: dist.ProcessGroup | None = None,
        comm_dtype: torch.dtype | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        replica_split: bool | None = None,
        distributed_ns: bool | None = None,
        symmetric_products: str = "torch",
        compile: bool | str | Callable = False,
        cuda_graphs: bool = False,
        early_start: bool | None = None,
    ) -> None:
        # first: a failure below is shared with the other ranks; held weakly, like every group dmuon keeps
        replicas = replica_group(params, process_group)
        self._process_group = GroupRef(replicas)
        if not isinstance(params, (nn.Module, Tensor, set)):
            params = list(params)  # read twice: for the ranks that hold them, then to build the groups
        # the ranks that share the parameters agree, not the whole job (pipeline stages)
        self._job = GroupRef(agreement_group(param_groups.tensors_in(params), replicas))
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
            eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_method=ns_method, ns_dtype=ns_dtype,
            ns_restarts=ns_restarts, ns_blocks=ns_blocks, adamw_betas=adamw_betas, adamw_eps=adamw_eps,
            adamw_lr=adamw_lr, adamw_weight_decay=adamw_weight_decay, nonfinite_grads=nonfinite_grads,
        )
        options = EngineOptions(comm_dtype, bucket_bytes, replica_split, distributed_ns, symmetric_products, compile,
                                cuda_graphs, early_start)

        def build() -> Fingerprint:
            check_use_addmm(use_addmm)  # torch.optim.Muon's switch; dmuon's products are always fused
            self._build(params, defaults, options)
            return self._fingerprint(self.param_groups)

        # every rank learns of a failure on any rank, and raises too; the ranks agree on the
        # optimizer's number, so that a step of another optimizer is never taken for this one's
        job = self._agreement_group()
        fingerprint, agreed = agreed_call("construction", build, job, self._collective_device,
                                          number=issued_number(job) if job is not None else 0)
        self._number = agreed.number + 1 if agreed is not None else 0
        if job is not None:
            record_number(job, self._number)
        # from here on add_param_group is collective; the step's agreement carries this digest
        self._agreed(fingerprint)
        self._steps_taken = 0
        if symmetric_products == "auto":  # a collective: after the ranks agree on the options
            from dmuon.timing import choose_symmetric_products  # imported only when measuring

            self._symmetric_by_shape.update(choose_symmetric_products(
                param_groups.muon_params(self.param_groups), self._collective_device(), self._agreement_group()))

    def _build(self, params: nn.Module | Iterable[Any], defaults: dict[str, Any], options: EngineOptions) -> None:
        """Everything the constructor does before the ranks compare notes (purely local)."""
        validate_defaults(defaults, options)
        param_groups.check_params_type(params)
        self._module_roles: dict[int, str] = {}
        self._model: Callable[[], nn.Module | None] = lambda: None
        if isinstance(params, nn.Module):
            self._module_roles = module_roles(params)
            self._model = weakref.ref(params)  # add_param_group looks up the names of new parameters
            params = list(params.named_parameters())
        self.skipped_steps = 0
        self._number: int | None = None  # agreed after this
        self._update_squares: dict[int, list] = {}  # id(param group) -> [sum of squares, elements], last step
        self._companions: list[StepCompanion] = []  # what follows the steps (a QKClip)
        self._options = options
        self._early = EarlyStart(options.early_start)
        self._symmetric_by_shape: dict[tuple[int, int], str] = {}  # "auto": measured at construction
        self._make_engine()
        super().__init__(params, defaults)
        self._module_roles = {}  # used for routing at construction only; params may be swapped later
        param_groups.check_not_a_whole_model_by_shape(self.param_groups)
        blind = param_groups.shape_routing_warning(self.param_groups)
        if blind:
            warnings.warn(blind, stacklevel=5)  # _build <- build <- agreed_call <- __init__ <- the caller
        self._order_buckets()
        here = self._stepped_here()
        # every layout detected and planned now: an unsupported one raises before any collective
        self._planner.exchange_plans(self._planner.works(here))
        if options.early_start and here:  # early_start=True where the layouts cannot run it: raised now, on every rank
            self._early.check(self._planner.build(None, here, self._collective_device()),
                              self._compiled, ddp_may_follow=True)  # register_ddp_comm_hook comes after

    def _make_engine(self) -> None:
        """The compiled kernels, the engine and its planner, from the options (again after a
        deep copy or unpickling)."""
        self._kernels, self._engine, self._planner = build_engine(self._options, self._process_group(),
                                                                  self._symmetric_by_shape)
        self._plan: StepPlan | None = None

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add one group (collective under torch.distributed: every rank calls it, with the same
        Muon parameters and options, and the ranks compare them before anything changes).

        The group stays one group: each parameter in it is routed to Muon or AdamW
        (:meth:`routing_summary`), unless its ``"algorithm"`` key sends all of them to one."""
        named = bool(getattr(self, "param_groups", None)) and "param_names" in self.param_groups[0]

        def build() -> dict[str, Any]:
            return param_groups.build_group(param_group, self.defaults, len(self.param_groups), self._module_roles,
                                            param_groups.names_in(self._model()) if named else None)

        if not hasattr(self, "_structure_words"):  # from torch.optim.Optimizer.__init__: agreed after
            self._add_stored(build())
            return
        before = len(self.param_groups)

        def add() -> Fingerprint:
            self._add_stored(build())
            self._check_same_ranks()
            return self._fingerprint(self.param_groups)

        try:
            fingerprint, _ = agreed_call("add_param_group", add, self._agreement_group(), self._collective_device)
        except BaseException:
            del self.param_groups[before:]
            raise
        self._agreed(fingerprint)

    def _check_same_ranks(self) -> None:
        """An added group's parameters live on the optimizer's ranks: its agreement and exchanges
        run over those (an optimizer per set of ranks: a pipeline stage's)."""
        job = self._agreement_group()
        if job is None:
            return
        ranks = sorted(dist.get_process_group_ranks(job))
        g = len(self.param_groups) - 1
        for name, p in param_groups.all_entries(self.param_groups)[-len(self.param_groups[g]["params"]):]:
            held = ranks_holding(p, self._process_group())
            if not set(held) <= set(ranks):
                raise ValueError(f"Parameter {name!r} of param group {g} lives on ranks {list(held)}, this optimizer's "
                                 f"parameters on ranks {ranks}: give it an optimizer of its own.")

    def _add_stored(self, group: dict[str, Any]) -> None:
        # torch's add_param_group would copy the constructor's defaults into the group, including
        # the adamw_* aliases and nonfinite_grads; every key is filled already.
        defaults, self.defaults = self.defaults, {}
        try:
            super().add_param_group(group)
        finally:
            self.defaults = defaults

    def routes(self) -> dict[str, Route]:
        """Each parameter's route (algorithm, matrix view, reason), by name ("group{g}.param{i}" if unnamed)."""
        return param_groups.routes(self.param_groups)

    def routing_summary(self) -> str:
        """A table: every parameter, its shape, the algorithm, the matrices Muon sees, and why;
        then what ``ns_dtype=None`` resolves to here, and why, where a group leaves it to dmuon."""
        return "\n".join([param_groups.routing_summary(self.param_groups), *self._default_dtype_reasons()])

    def _default_dtype_reasons(self) -> list[str]:
        """One line per device type of the Muon parameters whose group has ``ns_dtype=None``."""
        types = sorted({m.param.device.type for m in param_groups.muon_params(self.param_groups)
                        if m.param_group["ns_dtype"] is None})
        return [default_dtype_reason(t) for t in types]

    def __repr__(self) -> str:
        counts = {alg: sum(g["algorithms"].count(alg) for g in self.param_groups) for alg in ("muon", "adamw")}
        return (f"{type(self).__name__}(muon: {counts['muon']} params, adamw: {counts['adamw']} params, "
                f"groups: {len(self.param_groups)})\n{self.routing_summary()}")

    def _group_label(self, group: dict[str, Any]) -> str:
        return param_groups.label_of(self.param_groups, group)

    def _fingerprint(self, groups: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
        return [*param_groups.fingerprint(groups, self._options.describe(), self.defaults["nonfinite_grads"],
                                          across_ranks=self._agreement_group() is not None),
                ("the optimizer's number", repr(self._number)),
                # a processor-fit default: ranks on processors of different kinds must not mix dtypes
                ("what ns_dtype=None resolves to", repr(self._default_dtype_reasons()))]

    def _agreed(self, fingerprint: Fingerprint) -> None:
        """After an entry point the ranks agreed on: what later steps compare."""
        self._structure_words = digest_words(fingerprint)
        self._checked_settings = param_groups.settings(self.param_groups)
        self._plan = None
        self._order_buckets()  # the parameters may have changed: early start may run again

    # ------------------------------------------------------------------ the plan

    @property
    def plans(self) -> list[Plan]:
        """The plan of each exchange group (usually one): owners, buckets, bytes; see Plan.table()."""
        # a frozen parameter (requires_grad=False, no gradient) is in no step: nor in its plan
        here = [m for m in self._stepped_here() if m.param.requires_grad or m.param.grad is not None]
        if self._planner.ready_order and self._early.setting is None and here:
            self._step_plan(here)  # the bucket order the next step will use
        return self._planner.exchange_plans(self._planner.works(here))

    def _stepped_here(self) -> list[param_groups.MuonParam]:
        """The Muon parameters this rank steps (all, unless owner-sharded to other ranks)."""
        return [m for m in param_groups.muon_params(self.param_groups) if steps_here(m.param)]

    @property
    def plan(self) -> Plan:
        """The plan, when all Muon parameters share one exchange group (the usual case)."""
        plans = self.plans
        if len(plans) != 1:
            raise ValueError(f"The Muon parameters span {len(plans)} exchange groups; use .plans.")
        return plans[0]

    @property
    def last_step_stats(self) -> StepStats:
        """This rank's matrices orthogonalized, NS FLOPs and seconds, bytes sent and collectives,
        last step."""
        return self._engine.stats

    def statistics(self, all_ranks: bool = False) -> dict[str, float]:
        """The last step in numbers, for logging (flat keys, float values):

        ``muon/update_rms/<group>`` — RMS of the Muon update before the lr (rms(O)·r(m, n); at
        most about 0.2 with ``match_rms_adamw``, less for low-rank gradients), ``lr/<group>``,
        ``ns_seconds``, ``ns_gflop``, ``matrices``, ``bytes_sent``, ``collectives``,
        ``skipped_steps``. ``<group>`` is the group's ``"name"`` or its index in ``param_groups``.
        With a :class:`dmuon.QKClip` on this optimizer, also its ``qk_clip/…`` figures (the job's).

        This rank's own figures by default, with no collective (on CUDA, reading them waits for
        the step's kernels). ``all_ranks=True`` (collective: every rank must call it) makes them
        the job's: update RMS over whole matrices, sums of the counts, the slowest rank's
        ``ns_seconds``.
        """
        figures = step_statistics(self._engine.stats, self._update_squares, self.param_groups, self._group_label,
                                  self.skipped_steps, self._agreement_group() if all_ranks else None,
                                  self._collective_device())
        for companion in self._companions:
            figures.update(companion.statistics())
        return figures

    # ------------------------------------------------------------------ state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (collective under torch.distributed, as construction is).

        Checked before anything changes, naming the offending group or parameter: the groups'
        keys, hyperparameters (as the constructor checks them) and routing, and every state
        tensor's shape and layout against its parameter's; then the ranks compare the
        configuration the state gives them. If any rank fails, every rank keeps its old state.

        A ``torch.optim.Muon`` state dict of the same parameters in the same groups loads too: its
        momentum buffers, and its hyperparameters (lr, weight decay, momentum, nesterov,
        coefficients, eps, steps, adjust_lr_fn) in place of the groups'; dmuon's own options
        (``ns_method``, ``ns_dtype``, …) stay as they are."""
        kept = self.state, self.param_groups

        def load() -> Fingerprint:
            loaded = state_dict
            if param_groups.is_torch_muon_state_dict(state_dict):
                loaded = param_groups.from_torch_muon(state_dict, self.param_groups)
            param_groups.check_loadable(loaded, self.param_groups)
            torch.optim.Optimizer.load_state_dict(self, loaded)
            # The routing is checked equal; its reasons are this build's (a checkpoint's may
            # come from another version, or from torch.optim.Muon, which has none).
            for group, before in zip(self.param_groups, kept[1]):
                group[ROUTE_REASONS] = before[ROUTE_REASONS]
            return self._fingerprint(self.param_groups)

        try:
            fingerprint, _ = agreed_call("load_state_dict", load, self._agreement_group(), self._collective_device)
        except BaseException:
            self.state, self.param_groups = kept
            raise
        self._agreed(fingerprint)

    def __getstate__(self) -> dict[str, Any]:
        """All of the optimizer but its engine, planner, plan and compiled kernels, which are
        rebuilt from the options (a deep copy or an unpickled optimizer can step), and, as
        torch.optim drops them, its step hooks (a :class:`dmuon.QKClip` stays with the original)."""
        left_out = ("_engine", "_kernels", "_model", "_planner", "_plan", "_companions",
                    "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
        return {k: v for k, v in self.__dict__.items() if k not in left_out}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._model = lambda: None
        self._companions = []
        self._make_engine()
        self._order_buckets()

    def _order_buckets(self) -> None:
        """Where early start may run, the plan's buckets follow the backward pass (the model's
        order reversed); elsewhere the cost order (:meth:`_step_plan`)."""
        self._planner.ready_order = wanted(self._options.early_start, self._collective_device().type)

    def _step_plan(self, entries: Sequence[param_groups.MuonParam]) -> StepPlan:
        """The plan kept, unless what it depends on changed. Early start's (buckets in the backward
        order, every matrix whole) only where early start can run it: where it cannot (a layout it
        does not support, DDP without :meth:`register_ddp_comm_hook`) and ``early_start=None``, the
        step is better served by the cost order, which may also split matrices."""
        device = self._collective_device()
        plan = self._planner.step_plan(self._plan, entries, device)
        ddp = self._early.ddp or self._early.registered_ddp  # (registered here: to be agreed at the step)
        if (self._planner.ready_order and self._early.setting is None
                and unsupported_because(plan, self._compiled, ddp) is not None):
            self._planner.ready_order = False
            plan = self._planner.build(plan.key, entries, device)
        return plan

    # ------------------------------------------------------------------ step

    # torch.compile(opt.step) would trace the collectives and the host decisions of a step;
    # it runs the step eagerly instead (compile=True compiles the step's tensor code)
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step; ``closure`` re-evaluates the model and returns the loss.

        Under ``torch.compile(opt.step)`` it runs eagerly: its collectives and agreed decisions
        are not graph material. ``Muon(..., compile=True)`` compiles its tensor code."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # what early start began in the backward pass, finished: on every rank, before the agreement
        run = self._early.finish()
        if run is None:
            self._engine.start_step()
        self._update_squares = {}
        # a rank without a run has nothing of its own to redo: where ranks' plans differ (owner
        # sharding, a rank that steps nothing) they exchange nothing; elsewhere none has a run
        params, here, left_alone, early = agree_on_step(
            self._prepare_step, self.defaults["nonfinite_grads"], self._agreement_group(), self._collective_device,
            self._step_fingerprint, self._engine.counter, lambda: param_groups.all_names(self.param_groups),
            lambda: run.code(self.state) if run is not None else USED)
        self._steps_taken += 1
        if self._early.registered_ddp is not None:
            self._use_registered_ddp_hook()
        if early == CHANGED:
            self._early.turn_off("the gradients changed between the backward pass and step() (a second backward "
                                 "pass for gradient accumulation, or clipping or unscaling them), so its work was "
                                 "redone; accumulate with all but the last micro-batch inside optimizer.accumulating() "
                                 "instead (or DDP's or owner sharding's no_sync(), FSDP2's "
                                 "set_requires_gradient_sync(False))")
        if left_alone is None:
            self.skipped_steps += 1
            self._arm_early_start()
            return loss
        for sharding in owner_shardings(params)[1]:
            sharding.weights_changed()
        stepped = {id(p) for i, (p, mine) in enumerate(zip(params, here)) if mine and i not in left_alone}
        muon = param_groups.muon_params(self.param_groups)
        for m in muon:
            if owned_by(m.param) is not None and not owned_by(m.param).is_mine:
                # An empty entry on the ranks that do not own it: every rank's optimizer state
                # then names every parameter, as torch.distributed.checkpoint requires to load.
                self.state[m.param]
        entries = [m for m in muon if id(m.param) in stepped]
        self._init_state(entries, stepped)
        adamw = partial(adamw_steps, self.param_groups, self.state, stepped)
        if not entries:
            adamw()
            self._arm_early_start()
            return loss
        # the plan kept, unless what it depends on changed; AdamW runs while the exchange waits
        plan = self._plan = self._step_plan(entries)
        if self._early.setting:  # early_start=True where this plan cannot run it: raised before anything moves
            self._early.check(plan, self._compiled)
        pieces = update_momentum_of(entries, self.state, self._kernels)
        values = StepValues(plan, pieces, self._kernels, self._update_squares, adamw)
        if run is not None and early == USED and run.plan is plan:
            for held in run.values.held:  # the updates the backward pass computed, on the same inputs
                values.apply(*held)
            values.overlap()
        else:
            if run is not None:
                self._engine.start_step()  # the statistics count this step's run, not the unused one
            self._engine.run(plan.strategies, values)
        self._arm_early_start()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; then what follows the steps (a :class:`dmuon.QKClip`) drops
        what it recorded for the gradients that are gone. Local: not collective."""
        super().zero_grad(set_to_none)
        for companion in self._companions:
            companion.discard()

    def _init_state(self, muon: Sequence[param_groups.MuonParam], stepped: set[int]) -> None:
        """The state of each parameter this step updates, created at its first step (as torch's
        ``_init_group`` does): Muon's momentum buffer, AdamW's step count and two moments, each
        shaped and placed like the parameter (a DTensor's: its placement)."""
        for m in muon:
            if "momentum_buffer" not in self.state[m.param]:
                self.state[m.param]["momentum_buffer"] = torch.zeros_like(m.param, memory_format=torch.preserve_format)
        for group in self.param_groups:
            for p, algorithm in zip(group["params"], group["algorithms"]):
                if algorithm == "adamw" and id(p) in stepped and not self.state[p]:
                    self.state[p].update(step=torch.zeros((), dtype=torch.float32),
                                         exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                         exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))

    @property
    def _compiled(self) -> bool:
        return bool(self._options.compile or self._options.cuda_graphs)

    def _arm_early_start(self) -> None:
        """Let the next backward pass start this step's plan (:mod:`dmuon.early_start`)."""
        self._early.arm(self._plan, self.state, self._engine.context, self._engine.start_step, self._compiled,
                        self._agreement_group())

    def register_ddp_comm_hook(self, model: nn.Module) -> None:
        """Let early start begin each bucket's Newton–Schulz once DDP's all-reduce of it is done.

        It registers dmuon's comm hook on ``model``, which reduces gradients as DDP's built-in
        reduction does (the same bits, one all-reduce per bucket) and, once the ranks have
        agreed on it at the next ``step()``, hands each bucket to early start
        (:mod:`dmuon.early_start`). Local: call it on every rank, before the step that should
        use it; a rank that did not is found at that step, and every rank raises. DDP takes one
        comm hook per model, so ``model`` must have no other (an optimizer made later for the
        same model takes dmuon's over).

        Args:
            model: the ``DistributedDataParallel`` model whose parameters this optimizer steps.

        Raises:
            TypeError: ``model`` is not a ``DistributedDataParallel`` model.
            ValueError: it reduces over other ranks than the optimizer's, holds none of its Muon
                parameters, or a hook was registered before on this optimizer.
        """
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"register_ddp_comm_hook needs a DistributedDataParallel model, got "
                            f"{type(model).__name__}.")
        ours, theirs = self._agreement_group(), model.process_group
        if ours is not None and dist.get_process_group_ranks(ours) != dist.get_process_group_ranks(theirs):
            raise ValueError(f"The DDP model reduces over ranks {dist.get_process_group_ranks(theirs)}, this "
                             f"optimizer works over ranks {dist.get_process_group_ranks(ours)}: build the optimizer "
                             "from the DDP model (dmuon.Muon(ddp_model)) or pass its process_group.")
        if self._early.ddp is not None or self._early.registered_ddp is not None:
            raise ValueError("register_ddp_comm_hook was called before on this optimizer: it serves one DDP model.")
        in_model = {id(p) for p in model.parameters()}
        replicated = [m for m in param_groups.muon_params(self.param_groups) if owned_by(m.param) is None]
        if replicated and not any(id(m.param) in in_model for m in replicated):
            raise ValueError(f"register_ddp_comm_hook: the DDP model ({type(model.module).__name__}) holds none of "
                             f"this optimizer's Muon parameters (such as {replicated[0].name!r}): pass the DDP model "
                             "of the parameters the optimizer steps.")
        self._early.registered_ddp = DDPReduction.of(model)  # DDP raises if the model has another comm hook
        self._plan = None  # the next step's plan: early start's, where it can now run
        self._order_buckets()

    def _use_registered_ddp_hook(self) -> None:
        """After a step's agreement, which compared whether each rank registered the DDP comm
        hook: from now on the hook hands its buckets to early start (the early runs' collectives
        then match on every rank)."""
        reduction, self._early.registered_ddp = self._early.registered_ddp, None
        reduction.hand_to(self._early)
        self._early.ddp = reduction
        self._plan = None  # early start's plan, where it can now run
        self._order_buckets()

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Gradient accumulation with early start: the backward passes inside (every micro-batch
        but the last) begin nothing, as their gradients are not final; the last one's, outside,
        begins the step's work. DDP's and owner sharding's ``no_sync()`` and FSDP2's
        ``set_requires_gradient_sync(False)`` do this already for their layouts. Local: a rank
        may enter it alone; where early start exchanges anything, the ranks agree before a
        backward pass's first bucket whether any of them holds it back, and none starts it then."""
        previous, self._early.paused = self._early.paused, True
        try:
            yield
        finally:
            self._early.paused = previous

    @property
    def early_start(self) -> str:
        """Whether Newton–Schulz starts during the backward pass (:mod:`dmuon.early_start`), and
        if not, why: "on", or "off: <reason>"."""
        return self._early.status

    def _prepare_step(self) -> tuple[list[Tensor], list[bool], list[bool]]:
        """This rank's part of a step before the ranks agree: the parameters (those the model
        replaced on leaving the meta device taken from it), whether this rank steps each and
        whether each is a replica every rank holds whole (a plain-tensor Muon parameter), the
        owner shardings' gradients, and the hyperparameters changed since they were last
        checked, checked as the constructor checks them."""
        param_groups.follow_meta_parameters(self.param_groups, self._model())
        params = [p for group in self.param_groups for p in group["params"]]
        replicas = [algorithm == "muon" and not isinstance(p, DTensor) and owned_by(p) is None
                    for group in self.param_groups for p, algorithm in zip(group["params"], group["algorithms"])]
        here, shardings = owner_shardings(params)  # here: this rank steps it
        for sharding in shardings:
            sharding.wait_for_gradients()
        now = param_groups.settings(self.param_groups)
        if now != self._checked_settings:
            param_groups.validate_groups(self.param_groups)
            self._checked_settings = now
        return params, here, replicas

    def _step_fingerprint(self) -> Fingerprint:
        """What a step depends on, as the ranks compare it: the configuration they agreed on
        last, which optimizer this is, the steps it has taken, and the hyperparameters now."""
        hook = self._early.ddp is not None or self._early.registered_ddp is not None
        return [("configuration digest", repr(self._structure_words)), ("the optimizer's number", repr(self._number)),
                ("number of steps taken", repr(self._steps_taken)), *self._checked_settings,
                ("register_ddp_comm_hook called", repr(hook)),
                *(row for companion in self._companions for row in companion.step_fingerprint())]

    def _collective_device(self) -> torch.device:
        return collective_device(getattr(self, "param_groups", ()), self._agreement_group())

    def _agreement_group(self) -> dist.ProcessGroup | None:
        return self._job()
