"""``dmuon.Muon``: Muon for hidden matrices and AdamW for the rest, in one ``torch.optim.Optimizer``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dmuon import entry_points, param_groups
from dmuon.exchange import GroupRef
from dmuon.hyperparameters import EngineOptions, reject_unknown_keywords
from dmuon.orthogonalization import NORMALIZATION_EPS
from dmuon.planner import DEFAULT_BUCKET_BYTES, Plan
from dmuon.routing import Route
from dmuon.step import Stepper
from dmuon.step.engine import StepStats


class Muon(torch.optim.Optimizer):
    """Muon for hidden weight matrices, AdamW for everything else, in one optimizer.

    For each matrix parameter W (gradient G, momentum buffer B), a step:

    1. ``B ← μ·B + (1−μ)·G``; the Newton–Schulz input is ``M = G + μ·(B − G)`` (Nesterov) or B;
    2. ``O = NS(M)``, approximately U·Vᵀ for M = U·Σ·Vᵀ (:func:`dmuon.newton_schulz`);
    3. ``W ← W·(1 − lr·wd) − lr·r(m, n)·O``, r from ``adjust_lr_fn``.

    Embeddings, output heads, norms, biases and scalars get AdamW in the same object; conv kernels
    are flattened to (out, in·k…), 3-D stacks are batches of matrices (:mod:`dmuon.routing`,
    :meth:`routing_summary`). With ``adjust_lr_fn="match_rms_adamw"`` the Muon update has AdamW's
    RMS, so an AdamW run's lr and weight decay carry over. Under torch.distributed every matrix is
    orthogonalized once in the job, by its owner, AdamW running while the last bucket's exchange
    is in flight (:class:`dmuon.step.Stepper`). Construction, ``add_param_group``,
    ``load_state_dict`` and ``step`` are collective: the ranks first agree (:mod:`dmuon.entry_points`).
    A parameter whose ``grad`` is None is left alone, as in torch.optim. ``torch.optim.Muon``'s
    behaviour: ``ns_coefficients="keller"``, ``ns_method="standard"``, ``ns_dtype=torch.bfloat16``,
    ``adjust_lr_fn="original"``.

    Args:
        params: an ``nn.Module`` (recommended: routing sees module types and names), its
            ``named_parameters()``, tensors, or param-group dicts (each one group, its
            parameters routed one by one; an ``"algorithm"`` key sends all to one).
        lr: learning rate (float or 0-D tensor), Muon's and, without ``adamw_lr``, AdamW's.
        weight_decay: decoupled weight decay, Muon's and, without ``adamw_weight_decay``, AdamW's.
        momentum: μ, in [0, 1).
        nesterov: Newton–Schulz input ``G + μ·(B − G)`` instead of B.
        ns_coefficients: "polar_express", "keller", "you", "aol", "deepseek_v4", or (a, b, c) triple(s).
        eps: added to ‖M‖_F before normalizing (> 0).
        ns_steps: Newton–Schulz steps, 1–99; None: the recipe's (5; 4 for "aol", 10 for "deepseek_v4").
        adjust_lr_fn: the per-matrix lr factor: "match_rms_adamw" (0.2·√max(m, n)), "original"
            or None (√max(1, m/n)), "spectral_unclamped" (√(m/n)).
        use_addmm: ``torch.optim.Muon``'s switch, accepted (a bool) and inert.
        ns_method: "standard", "gram", or "auto" (Gram from aspect ratio 2 where the dtype allows).
        ns_dtype: Newton–Schulz's compute dtype; None fits the processor (fp16 on CUDA; bf16 for
            standard NS on CPUs with native bf16, else fp32).
        ns_restarts: Gram NS restart steps (None: placed for the schedule).
        ns_blocks: fused weights' row blocks, orthogonalized apart (:mod:`dmuon.row_blocks`): k, row counts,
            row-index lists, dmuon.interleaved(k), dmuon.per_head(heads, sizes).
        update_rule: after Newton–Schulz (:mod:`dmuon.rules`): "muon" (none), "normuon" (rows over their RMS).
        beta2: NorMuon's second-moment decay, in [0, 1).
        momentum_dtype: the momentum's dtype: None (the parameter's), bfloat16, float32, int8 (8-bit blocks).
        adamw_betas, adamw_eps: AdamW's betas and eps.
        adamw_lr: AdamW's lr where it differs from ``lr``; it then follows ``lr``'s schedule.
        adamw_weight_decay: AdamW's weight decay where it differs from ``weight_decay``.
        nonfinite_grads: on a non-finite gradient anywhere, "skip" the step on every rank (warned,
            counted in ``skipped_steps``), "raise" ``FloatingPointError`` naming the parameters,
            or "ignore" (no check).
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

    _stepper: Stepper  # the step's owner; these four filled by dmuon.entry_points.construct
    _job: GroupRef  # the ranks the optimizer agrees over
    _process_group: GroupRef  # the ranks that hold the plain (replicated) tensors
    _module_roles: dict[int, str]  # routing's view of the model's modules, while construction routes

    def __new__(cls, *args: Any, **kwargs: Any) -> Muon:
        reject_unknown_keywords(cls, kwargs)
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
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = "match_rms_adamw",
        use_addmm: bool = False,
        *,  # torch.optim.Muon's arguments above, in its order; dmuon's own by keyword only
        ns_method: str = "auto",
        ns_dtype: torch.dtype | str | None = None,
        ns_restarts: Sequence[int] | None = None,
        ns_blocks: int | Sequence[int] | Sequence[Sequence[int]] | dict | None = None,
        update_rule: str = "muon",
        beta2: float = 0.95,
        momentum_dtype: torch.dtype | str | None = None,
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
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
            eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_method=ns_method, ns_dtype=ns_dtype,
            ns_restarts=ns_restarts, ns_blocks=ns_blocks, update_rule=update_rule, beta2=beta2,
            momentum_dtype=momentum_dtype, adamw_betas=adamw_betas, adamw_eps=adamw_eps, adamw_lr=adamw_lr,
            adamw_weight_decay=adamw_weight_decay, nonfinite_grads=nonfinite_grads)
        options = EngineOptions(comm_dtype, bucket_bytes, replica_split, distributed_ns, symmetric_products, compile,
                                cuda_graphs, early_start)
        entry_points.construct(self, params, defaults, options, process_group, use_addmm)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add one group (collective: every rank calls it, with the same Muon parameters and options,
        compared before anything changes). It stays one group: each parameter is routed to Muon or
        AdamW (:meth:`routing_summary`), unless its ``"algorithm"`` key sends all of them to one."""
        entry_points.add_param_group(self, param_group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (collective under torch.distributed, as construction is).

        The groups' keys, hyperparameters and routing, and every state tensor's shape and layout,
        are checked against the optimizer's before anything changes, then the ranks compare the
        configuration; if any rank fails, every rank keeps its old state. A ``torch.optim.Muon``
        state dict of the same groups loads too (its momentum buffers and hyperparameters;
        dmuon's own options stay as they are)."""
        entry_points.load_state_dict(self, state_dict)

    def __getstate__(self) -> dict[str, Any]:
        """All of the optimizer but its step hooks, as torch.optim drops them; the stepper rebuilds its engine
        (a deep copy or an unpickled optimizer can step), and a :class:`dmuon.QKClip` stays with the original."""
        left_out = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
        return {k: v for k, v in self.__dict__.items() if k not in left_out}

    # torch.compile(opt.step) would trace a step's collectives and host logic: it runs eagerly (compile=True compiles)
    @torch.compiler.disable
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step (collective under torch.distributed); ``closure`` re-evaluates
        the model and returns the loss (:class:`dmuon.step.Stepper` runs the rest)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._stepper.step(self.param_groups, self.state, self.defaults["nonfinite_grads"])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's ``zero_grad``; then early start and a :class:`dmuon.QKClip` drop what they took of
        the gradients. Local, but where FSDP2 was left in a backward pass that raised (caught on
        every rank at the same point), it first finishes that pass as FSDP2 does (collective)."""
        self._stepper.zero_grad(partial(super().zero_grad, set_to_none))

    def register_ddp_comm_hook(self, model: nn.Module) -> None:
        """Let early start begin each bucket's Newton–Schulz once DDP's all-reduce of it is done.

        dmuon's comm hook reduces gradients as DDP's own reduction does (the same bits) and,
        once the ranks agree on it at the next ``step()``, hands each bucket to early start.
        Local: call it on every rank before that step; a rank that did not makes every rank raise.

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
        but the last) begin nothing, as their gradients are not final. DDP's and owner sharding's
        ``no_sync()`` and FSDP2's ``set_requires_gradient_sync(False)`` do this already. Local: a
        rank may enter it alone (the ranks agree before a backward pass's first exchange)."""
        return self._stepper.accumulating()

    # ------------------------------------------------------------------ what it reports

    def routes(self) -> dict[str, Route]:
        """Each parameter's route (algorithm, matrix view, reason), by name ("group{g}.param{i}" if unnamed)."""
        return param_groups.routes(self.param_groups)

    def routing_summary(self) -> str:
        """A table: every parameter, its shape, the algorithm, the matrices Muon sees, and why;
        then what ``ns_dtype=None`` resolves to here, and why, where a group leaves it to dmuon."""
        return "\n".join([param_groups.routing_summary(self.param_groups),
                          *param_groups.default_dtype_reasons(self.param_groups)])

    def __repr__(self) -> str:
        counts = {alg: sum(g["algorithms"].count(alg) for g in self.param_groups) for alg in ("muon", "adamw")}
        return (f"{type(self).__name__}(muon: {counts['muon']} params, adamw: {counts['adamw']} params, "
                f"groups: {len(self.param_groups)})\n{self.routing_summary()}")

    @property
    def plans(self) -> list[Plan]:
        """The plan of each exchange group (usually one): owners, buckets, bytes; see Plan.table()."""
        return self._stepper.plans(self.param_groups)

    @property
    def plan(self) -> Plan:
        """The plan, when all Muon parameters share one exchange group (the usual case)."""
        if len(plans := self.plans) != 1:
            raise ValueError(f"The Muon parameters span {len(plans)} exchange groups; use .plans.")
        return plans[0]

    @property
    def stepper(self) -> Stepper:
        """The step's owner, for what follows the steps (a :class:`dmuon.QKClip` joins its agreement)."""
        return self._stepper

    @property
    def last_step_stats(self) -> StepStats:
        """This rank's matrices orthogonalized, NS FLOPs and seconds, bytes sent and collectives, last step."""
        return self._stepper.stats

    def statistics(self, all_ranks: bool = False) -> dict[str, float]:
        """The last step in numbers, for logging: ``muon/update_rms/<group>`` (the Muon update's
        RMS before the lr, about 0.2 with ``match_rms_adamw``), ``lr/<group>``, ``ns_seconds``,
        ``ns_gflop``, ``matrices``, ``bytes_sent``, ``collectives``, ``skipped_steps``, and a
        :class:`dmuon.QKClip`'s ``qk_clip/…``. ``<group>``: the group's ``"name"`` or index. This
        rank's figures by default (no collective); ``all_ranks=True`` (collective) makes them the
        job's: RMS over whole matrices, sums of counts, the slowest ``ns_seconds``."""
        label = partial(param_groups.label_of, self.param_groups)
        return self._stepper.statistics(self.param_groups, label, all_ranks)

    @property
    def early_start(self) -> str:
        """Whether Newton–Schulz starts during the backward pass, and if not, why: "on", or "off: <reason>"."""
        return self._stepper.early.status

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (``nonfinite_grads="skip"``)."""
        return self._stepper.skipped_steps
