"""``dmuon.Muon``: Muon for hidden matrices and AdamW for the rest, in one ``torch.optim.Optimizer``."""

from __future__ import annotations

import contextlib
import inspect
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmuon import param_groups
from dmuon.agreement import Fingerprint, agreed_call, issued_number, record_number
from dmuon.engine import StepStats
from dmuon.exchange import GroupRef, collective_device
from dmuon.hyperparameters import (
    ROUTE_REASONS,
    EngineOptions,
    check_use_addmm,
    unexpected_option_message,
    validate_defaults,
)
from dmuon.layout import agreement_group, ranks_holding
from dmuon.orthogonalization import NORMALIZATION_EPS, default_dtype_reason
from dmuon.planner import DEFAULT_BUCKET_BYTES, Plan
from dmuon.routing import Route, module_roles
from dmuon.step import StepCompanion, Stepper


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
        self._stepper.number = agreed.number + 1 if agreed is not None else 0
        if job is not None:
            record_number(job, self._stepper.number)
        # from here on add_param_group is collective; the step's agreement carries this digest
        self._agreed(fingerprint)
        if symmetric_products == "auto":  # a collective: after the ranks agree on the options
            from dmuon.timing import choose_symmetric_products  # imported only when measuring

            self._stepper.symmetric_by_shape.update(choose_symmetric_products(
                param_groups.muon_params(self.param_groups), self._collective_device(), self._agreement_group()))

    def _build(self, params: nn.Module | Iterable[Any], defaults: dict[str, Any], options: EngineOptions) -> None:
        """Everything the constructor does before the ranks compare notes (purely local)."""
        validate_defaults(defaults, options)
        param_groups.check_params_type(params)
        self._module_roles: dict[int, str] = {}
        self._stepper = Stepper(options, self._process_group, self._job)
        if isinstance(params, nn.Module):
            self._module_roles = module_roles(params)
            self._stepper.model = weakref.ref(params)  # add_param_group looks up the names of new parameters
            params = list(params.named_parameters())
        super().__init__(params, defaults)
        self._module_roles = {}  # used for routing at construction only; params may be swapped later
        param_groups.check_not_a_whole_model_by_shape(self.param_groups)
        blind = param_groups.shape_routing_warning(self.param_groups)
        if blind:
            warnings.warn(blind, stacklevel=5)  # _build <- build <- agreed_call <- __init__ <- the caller
        self._stepper.order_buckets(self.param_groups)
        self._stepper.check_layouts(self.param_groups)

    # ------------------------------------------------------------------ groups

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add one group (collective under torch.distributed: every rank calls it, with the same
        Muon parameters and options, and the ranks compare them before anything changes).

        The group stays one group: each parameter in it is routed to Muon or AdamW
        (:meth:`routing_summary`), unless its ``"algorithm"`` key sends all of them to one."""
        named = bool(getattr(self, "param_groups", None)) and "param_names" in self.param_groups[0]

        def build() -> dict[str, Any]:
            return param_groups.build_group(param_group, self.defaults, len(self.param_groups), self._module_roles,
                                            param_groups.names_in(self._stepper.model()) if named else None)

        if self._stepper.structure_words is None:  # from torch.optim.Optimizer.__init__: agreed after
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
        return [*param_groups.fingerprint(groups, self._stepper.options.describe(), self.defaults["nonfinite_grads"],
                                          across_ranks=self._agreement_group() is not None),
                ("the optimizer's number", repr(self._stepper.number)),
                # a processor-fit default: ranks on processors of different kinds must not mix dtypes
                ("what ns_dtype=None resolves to", repr(self._default_dtype_reasons()))]

    def _agreed(self, fingerprint: Fingerprint) -> None:
        """After an entry point the ranks agreed on: what later steps compare."""
        self._stepper.agreed(self.param_groups, fingerprint)

    # ------------------------------------------------------------------ the plan

    @property
    def plans(self) -> list[Plan]:
        """The plan of each exchange group (usually one): owners, buckets, bytes; see Plan.table()."""
        return self._stepper.plans(self.param_groups)

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
        return self._stepper.stats

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
        return self._stepper.statistics(self.param_groups, self._group_label, all_ranks)

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
        """All of the optimizer but, as torch.optim drops them, its step hooks; the stepper
        rebuilds its engine from the options (a deep copy or an unpickled optimizer can step), and
        a :class:`dmuon.QKClip` stays with the original."""
        left_out = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
        return {k: v for k, v in self.__dict__.items() if k not in left_out}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._stepper.order_buckets(self.param_groups)

    # ------------------------------------------------------------------ step

    # torch.compile(opt.step) would trace the collectives and the host decisions of a step;
    # it runs the step eagerly instead (compile=True compiles the step's tensor code)
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step (collective under torch.distributed); ``closure`` re-evaluates
        the model and returns the loss (:mod:`dmuon.step` runs the rest)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stepper.step(self.param_groups, self.state, self.defaults["nonfinite_grads"])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; then what follows the steps (a :class:`dmuon.QKClip`) drops
        what it recorded for the gradients that are gone. Local: not collective."""
        super().zero_grad(set_to_none)
        for companion in self._stepper.companions:
            companion.discard()

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
        self._stepper.register_ddp_comm_hook(self.param_groups, model)

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """Gradient accumulation with early start: the backward passes inside (every micro-batch
        but the last) begin nothing, as their gradients are not final; the last one's, outside,
        begins the step's work. DDP's and owner sharding's ``no_sync()`` and FSDP2's
        ``set_requires_gradient_sync(False)`` do this already for their layouts. Local: a rank
        may enter it alone; where early start exchanges anything, the ranks agree before a
        backward pass's first bucket whether any of them holds it back, and none starts it then."""
        return self._stepper.accumulating()

    @property
    def early_start(self) -> str:
        """Whether Newton–Schulz starts during the backward pass (:mod:`dmuon.early_start`), and
        if not, why: "on", or "off: <reason>"."""
        return self._stepper.early.status

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (``nonfinite_grads="skip"``)."""
        return self._stepper.skipped_steps

    @property
    def _companions(self) -> list[StepCompanion]:
        """What follows the steps (a :class:`dmuon.QKClip` adds itself)."""
        return self._stepper.companions

    @property
    def _model(self) -> Callable[[], nn.Module | None]:
        """The model the optimizer was built from, if any (held weakly)."""
        return self._stepper.model

    def _collective_device(self) -> torch.device:
        return collective_device(getattr(self, "param_groups", ()), self._agreement_group())

    def _agreement_group(self) -> dist.ProcessGroup | None:
        return self._job()
