"""The step's owner: everything a :class:`dmuon.Muon` step runs on, in one object.

A step, in order: early start's run from the backward pass finished → the ranks agree on the
gradients and the hyperparameters (one all-reduce, :func:`dmuon.agreement.agree_on_step`) →
state created for parameters stepped for the first time → momentum → the step plan kept or
rebuilt (:mod:`dmuon.step.plan`) → its strategies run by the engine, AdamW while the exchange's
last bucket is in flight, or early start's held updates applied → early start armed for the next
backward pass. The optimizer hands the stepper its param groups and state; the stepper never
calls back into it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon import momentum, param_groups
from dmuon.agreement import Fingerprint, digest_words
from dmuon.cuda_graphs import GraphedOrthogonalize
from dmuon.exchange import GroupRef, collective_device
from dmuon.hyperparameters import EngineOptions, momentum_dtype
from dmuon.layout import (
    finish_fsdp_backward,
    fsdp_left_in_backward,
    fsdp_states,
    owned_by,
    owner_shardings,
    row_state_zeros,
)
from dmuon.orthogonalization import orthogonalize
from dmuon.planner import Plan
from dmuon.routing import is_stack, row_shape
from dmuon.rules import ROW_STATE_KEYS, rule_of
from dmuon.step.agreement import PreparedStep, agree_on_step
from dmuon.step.early.eligibility import Eligibility
from dmuon.step.early.run import Run, RunUse
from dmuon.step.early.start import EarlyStart
from dmuon.step.elementwise import CompiledKernels, adamw_steps, compile_kernels, update_momentum_of
from dmuon.step.engine import Engine, StepStats
from dmuon.step.plan import StepPlan, StepPlanner, steps_here
from dmuon.step.statistics import step_statistics
from dmuon.step.values import StepValues
from dmuon.strategies.base import MatrixWork

Groups = Sequence[dict[str, Any]]


class StepCompanion(Protocol):
    """What follows an optimizer's steps (a :class:`dmuon.QKClip`): its figures join the step's
    statistics, its fingerprint the step's agreement (so that the ranks compare it before
    anything moves), and ``zero_grad()`` tells it that the gradients are gone."""

    def statistics(self) -> dict[str, float]: ...

    def step_fingerprint(self) -> list[tuple[str, str]]: ...

    def discard(self) -> None: ...


class Stepper:
    """The compiled kernels, the engine, the planner with the plan it keeps, early start (its
    hooks, DDP's comm hook, accumulation), and the step's agreement and statistics.

    Args:
        options: the optimizer's engine options.
        replicas: the process group of the plain (replicated) tensors.
        job: the process group the optimizer agrees over.
    """

    # rebuilt from the options after a deep copy or unpickling; the companions stay with the original
    _LEFT_OUT = ("kernels", "engine", "planner", "plan", "companions", "model", "fsdp")

    def __init__(self, options: EngineOptions, replicas: GroupRef, job: GroupRef) -> None:
        self.options, self.replicas, self.job = options, replicas, job
        self.early = EarlyStart(options.early_start)
        self.symmetric_by_shape: dict[tuple[int, int], str] = {}  # "auto": measured at construction
        self.skipped_steps = 0
        self.steps_taken = 0
        self.number: int | None = None  # the optimizer's, agreed at construction
        self.update_squares: dict[int, list] = {}  # id(param group) -> [sum of squares, elements], last step
        self.companions: list[StepCompanion] = []
        self.model: Callable[[], nn.Module | None] = lambda: None  # whose meta parameters a step follows
        self.fsdp: list[Any] | None = None  # the model's FSDP2 states, once looked up
        self.structure_words: list[int] | None = None  # the configuration the ranks agreed on last
        self.checked_settings: list[tuple[str, str]] = []
        self.build()

    def build(self) -> None:
        self.kernels, self.engine = build_engine(self.options)
        self.planner = StepPlanner(self.options, self.replicas(), self.symmetric_by_shape)
        self.plan: StepPlan | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in self._LEFT_OUT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.companions, self.model, self.fsdp = [], lambda: None, None
        self.build()

    def zero_grad(self, clear: Callable[[], None]) -> None:
        """:meth:`dmuon.Muon.zero_grad`: FSDP2 left in a backward pass that raised is finished
        first (:func:`dmuon.layout.finish_fsdp_backward`: collective then, as every rank caught
        it), then ``clear()``; early start's run and the companions drop what they took."""
        finish_fsdp_backward(self.fsdp_states())
        clear()
        self.early.restart()
        for companion in self.companions:
            companion.discard()

    def fsdp_states(self) -> list[Any]:
        if self.fsdp is None:
            self.fsdp = fsdp_states(self.model())
        return self.fsdp

    # ------------------------------------------------------------------ agreement and plans

    def device(self, groups: Groups) -> torch.device:
        return collective_device(groups, self.job())

    @property
    def compiled(self) -> bool:
        return bool(self.options.compile or self.options.cuda_graphs)

    def agreed(self, groups: Groups, fingerprint: Fingerprint) -> None:
        """After an entry point the ranks agreed on: what later steps compare."""
        self.structure_words = digest_words(fingerprint)
        self.checked_settings = param_groups.settings(groups)
        self.plan = None  # the parameters may have changed

    def eligibility(self, device: torch.device) -> Eligibility:
        """What decides whether early start may run the next plan, and so its bucket order."""
        return self.early.eligibility(device.type, self.compiled)

    def check_layouts(self, groups: Groups) -> None:
        """At construction: every layout detected and planned, so that an unsupported one raises
        before any collective; with ``early_start=True``, where the layouts cannot run it."""
        here = self.stepped_here(groups)
        works, _ = self._exchange_plans(groups, here)
        if self.options.early_start and here:
            self.early.check(works, self.compiled, ddp_may_follow=True)  # register_ddp_comm_hook comes after

    def stepped_here(self, groups: Groups) -> list[param_groups.MuonParam]:
        """The Muon parameters this rank steps (all, unless owner-sharded to other ranks)."""
        return [m for m in param_groups.muon_params(groups) if steps_here(m.param)]

    def plans(self, groups: Groups) -> list[Plan]:
        """The exchange plans the next step would run, worked out without keeping anything."""
        # a frozen parameter (requires_grad=False, no gradient) is in no step: nor in its plan
        here = [m for m in self.stepped_here(groups) if m.param.requires_grad or m.param.grad is not None]
        return self._exchange_plans(groups, here)[1]

    def _exchange_plans(self, groups: Groups, entries: Sequence[param_groups.MuonParam]
                        ) -> tuple[list[MatrixWork], list[Plan]]:
        """The works of a plan for ``entries`` and the plan of each of its exchanges, worked out
        as the next step would (:meth:`step_plan`), its strategies not built and nothing kept."""
        follows_backward, works = self.planner.planned_works(entries, self.eligibility(self.device(groups)))
        return works, self.planner.exchange_plans(works, follows_backward)

    def step_plan(self, groups: Groups, entries: Sequence[param_groups.MuonParam]) -> StepPlan:
        """The plan kept, unless what it depends on changed (:func:`dmuon.step.plan.plan_key`).
        Early start's (buckets in the backward order, every matrix whole) only where early start
        can run it: where it cannot (a layout it does not support, DDP without
        ``register_ddp_comm_hook``) and ``early_start=None``, the cost order, which may also
        split matrices (:meth:`dmuon.step.plan.StepPlanner.planned_works`)."""
        device = self.device(groups)
        return self.planner.step_plan(self.plan, entries, device, self.eligibility(device))

    # ------------------------------------------------------------------ the step

    def step(self, groups: Groups, state: dict, nonfinite_grads: str) -> None:
        """One step of the optimizer whose param groups and state these are (module docstring)."""
        run = self.early.finish()  # what the backward pass began, finished: on every rank, before the agreement
        if run is None:
            self.engine.start_step()
        self.update_squares = {}
        try:
            prepared: PreparedStep | Exception = self._prepare(groups, state, run)
        except Exception as err:  # noqa: BLE001 - shared with the other ranks in the agreement, which raise too
            prepared = err
        job = self.job()
        params, here, left_alone, agreed_use = agree_on_step(
            prepared, nonfinite_grads, job, partial(collective_device, groups, job),
            self._fingerprint() if job is not None else [], self.engine.counter,
            partial(param_groups.all_names, groups))
        self.steps_taken += 1
        self.early.settle(RunUse(agreed_use))
        if left_alone is None:
            self.skipped_steps += 1
        else:
            self._update(groups, state, params, here, left_alone, run, RunUse(agreed_use))
        self.early.arm(self.plan, state, self.engine, self.compiled, job)

    def _update(self, groups: Groups, state: dict, params: list[Tensor], here: list[bool], left_alone: set[int],
                run: Run | None, agreed_use: RunUse) -> None:
        """The agreed step: state, momentum, the plan's strategies, or the updates early start's
        ``run`` held where every rank may use them (``agreed_use``) and it ran this plan."""
        for sharding in owner_shardings(params)[1]:
            sharding.weights_changed()
        stepped = {id(p) for i, (p, mine) in enumerate(zip(params, here)) if mine and i not in left_alone}
        muon = param_groups.muon_params(groups)
        for m in muon:
            if owned_by(m.param) is not None and not owned_by(m.param).is_mine:
                # An empty entry on the ranks that do not own it: every rank's optimizer state
                # then names every parameter, as torch.distributed.checkpoint requires to load.
                state[m.param]
        entries = [m for m in muon if id(m.param) in stepped]
        init_state(groups, state, entries, stepped)
        adamw = partial(adamw_steps, groups, state, stepped)
        if not entries:
            adamw()
            return
        # the plan kept, unless what it depends on changed; AdamW runs while the exchange waits
        plan = self.plan = self.step_plan(groups, entries)
        if self.early.setting:  # early_start=True where this plan cannot run it: raised before anything moves
            self.early.check(plan.works, self.compiled)
        pieces = update_momentum_of(entries, state, self.kernels)
        values = StepValues(plan, state, pieces, self.kernels, self.update_squares, adamw)
        held = self.early.held_updates(run, agreed_use, plan)
        if held is not None:
            values.apply_held(held)  # the updates the backward pass computed, on the same inputs
            values.overlap()
            return
        if run is not None:
            self.engine.start_step()  # the statistics count this step's run, not the unused one
        self.engine.run(plan.strategies, values)

    def _prepare(self, groups: Groups, state: dict, run: Run | None) -> PreparedStep:
        """This rank's part of a step before the ranks agree: the parameters (those the model
        replaced on leaving the meta device taken from it), whether this rank steps each and
        whether each is a replica every rank holds whole (a plain-tensor Muon parameter), the
        owner shardings' gradients, the hyperparameters changed since they were last checked,
        checked as the constructor checks them, and whether early start's ``run`` can be used.
        A rank without a run has nothing of its own to redo: where ranks' plans differ (owner
        sharding, a rank that steps nothing) they exchange nothing; elsewhere none has a run."""
        if fsdp_left_in_backward(self.fsdp_states()):
            raise RuntimeError("FSDP2 is still in a backward pass that raised (it resets itself only when one "
                               "completes): it no longer reduces gradients, so this step would change nothing. Call "
                               "the optimizer's zero_grad() after catching the exception, on every rank: it finishes "
                               "FSDP2's pass first.")
        param_groups.follow_meta_parameters(groups, self.model())
        params = [p for group in groups for p in group["params"]]
        replicas = [algorithm == "muon" and not isinstance(p, DTensor) and owned_by(p) is None
                    for group in groups for p, algorithm in zip(group["params"], group["algorithms"])]
        here, shardings = owner_shardings(params)  # here: this rank steps it
        for sharding in shardings:
            sharding.wait_for_gradients()
        now = param_groups.settings(groups)
        if now != self.checked_settings:
            param_groups.validate_groups(groups)
            self.checked_settings = now
        return PreparedStep(params, here, replicas, self.early.verdict(run, state))

    def _fingerprint(self) -> Fingerprint:
        """What a step depends on, as the ranks compare it: the configuration they agreed on
        last, which optimizer this is, the steps it has taken, and the hyperparameters now."""
        hook = self.early.ddp is not None
        return [("configuration digest", repr(self.structure_words)), ("the optimizer's number", repr(self.number)),
                ("number of steps taken", repr(self.steps_taken)), *self.checked_settings,
                ("register_ddp_comm_hook called", repr(hook)),
                *(row for companion in self.companions for row in companion.step_fingerprint())]

    def statistics(self, groups: Groups, label: Callable[[dict[str, Any]], str], all_ranks: bool) -> dict[str, float]:
        figures = step_statistics(self.engine.stats, self.update_squares, groups, label, self.skipped_steps,
                                  self.job() if all_ranks else None, self.device(groups))
        for companion in self.companions:
            figures.update(companion.statistics())
        return figures

    @property
    def stats(self) -> StepStats:
        return self.engine.stats

    # ------------------------------------------------------------------ early start's hooks

    def register_ddp_comm_hook(self, groups: Groups, model: nn.Module) -> None:
        """:meth:`dmuon.Muon.register_ddp_comm_hook`."""
        self.early.register_ddp(model, self.job(), param_groups.muon_params(groups))

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        """:meth:`dmuon.Muon.accumulating`."""
        return self.early.accumulating()


def build_engine(options: EngineOptions) -> tuple[CompiledKernels | None, Engine]:
    """An optimizer's compiled kernels (None unless ``options.compile``) and the engine that runs
    its plans with them (CUDA-graphed with ``options.cuda_graphs``)."""
    kernels = compile_kernels("inductor" if options.compile is True else options.compile) if options.compile else None
    ns = kernels.orthogonalize if kernels else orthogonalize
    return kernels, Engine(options.comm_dtype, orthogonalize_fn=GraphedOrthogonalize(ns) if options.cuda_graphs else ns)


def init_state(groups: Groups, state: dict, muon: Sequence[param_groups.MuonParam], stepped: set[int]) -> None:
    """The state of each parameter this step updates, created at its first step (as torch's
    ``_init_group`` does): Muon's momentum (in the group's ``momentum_dtype``, :mod:`dmuon.momentum`,
    converted when that changes), AdamW's step count and two moments, each shaped and placed like the parameter
    (a DTensor's: its placement); the row state of a Muon group's update rule
    (:func:`dmuon.layout.row_state_zeros`), created when the rule is set, and dropped when the
    group's rule no longer keeps it."""
    for m in muon:
        entry, dtype = state[m.param], momentum_dtype(m.param_group, m.param)
        if "momentum_buffer" not in entry:
            entry.update(momentum.zeros(m.param, dtype))
        elif entry["momentum_buffer"].dtype != dtype:  # the group's momentum_dtype changed
            converted = momentum.converted(entry, m.param, dtype)
            entry.pop(momentum.SCALE_KEY, None)
            entry.update(converted)
        kept = rule_of(m.param_group).state
        for key in ROW_STATE_KEYS:
            if key != kept:
                entry.pop(key, None)
        if kept is not None and kept not in entry:
            entry[kept] = row_state_zeros(m.param, row_shape(m.param.shape, m.view), is_stack(m.param, m.view))
    for group in groups:
        for p, algorithm in zip(group["params"], group["algorithms"]):
            if algorithm == "adamw" and id(p) in stepped and not state[p]:
                state[p].update(step=torch.zeros((), dtype=torch.float32),
                                exp_avg=torch.zeros_like(p, memory_format=torch.preserve_format),
                                exp_avg_sq=torch.zeros_like(p, memory_format=torch.preserve_format))
