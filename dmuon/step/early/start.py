"""An optimizer's early start: the hooks on its Muon parameters, the run of the current backward
pass, and the few calls the stepper makes — :meth:`EarlyStart.arm` after a step,
:meth:`~EarlyStart.finish` and :meth:`~EarlyStart.verdict` before the ranks agree,
:meth:`~EarlyStart.settle` and :meth:`~EarlyStart.held_updates` after.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator, Sequence
from enum import Enum
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from dmuon.layout import owned_by
from dmuon.param_groups import MuonParam
from dmuon.step.early.ddp import DDPReduction
from dmuon.step.early.eligibility import CPU_DOES_NOT_PAY, Eligibility, unsupported_because, wanted
from dmuon.step.early.run import CHANGED, USED, Reducing, Run, RunUse
from dmuon.step.engine import Engine
from dmuon.step.plan import StepPlan
from dmuon.step.values import StepValues
from dmuon.strategies.base import MatrixWork


class State(Enum):
    """Where an optimizer's early start stands; :attr:`EarlyStart.status` says it in words."""

    DISABLED = "off (early_start=False)"
    PENDING = "not yet: it starts after the first step"
    ON = "on"
    OFF = "off"  # where it cannot run or does not pay, or turned off: the reason goes with it


class EarlyStart:
    """An optimizer's early start: the hooks on its Muon parameters and the run of the current
    backward pass; DDP's comm hook, once registered (``ddp``) and once the ranks agreed on it
    (``ddp_agreed``); whether a backward pass is held back (``paused``, inside
    :meth:`accumulating`). ``setting``: the ``early_start`` option (None: wherever supported)."""

    def __init__(self, setting: bool | None) -> None:
        self.setting = setting
        self.state = State.DISABLED if setting is False else State.PENDING
        self.reason = ""  # why it is OFF
        # id(param) (or of an owner sharding) -> hook handle. The hooks hold this object weakly, and
        # go when it goes: a parameter must not keep an optimizer that was dropped alive, nor run its work.
        self._hooks: dict[int, RemovableHandle] = {}
        weakref.finalize(self, _remove, self._hooks)
        self._run: Run | None = None
        self._stream: torch.cuda.Stream | None = None
        self.ddp: DDPReduction | None = None  # the comm hook of a DDP model, once registered
        self.ddp_agreed = False  # every rank registered it (a step's agreement): it hands over its buckets
        self.paused = False  # inside Muon.accumulating(): gradients are not final yet

    def eligibility(self, device_type: str, compiled: bool) -> Eligibility:
        """What decides whether early start may run the next plan (part of the plan's key); a
        comm hook registered here counts before the step's agreement on it."""
        return Eligibility(self.setting, device_type, compiled, self.ddp.params if self.ddp is not None else None)

    def arm(self, plan: StepPlan | None, state: dict, engine: Engine, compiled: bool,
            group: dist.ProcessGroup | None = None) -> None:
        """After a step: run ``plan`` early in the next backward pass, where it can; ``group``:
        the optimizer's ranks, which agree before the run's first bucket (:class:`Run`)."""
        self._run = None
        if self.setting is False or plan is None:
            return
        params = [w.param for w in plan.works]
        why = unsupported_because(plan.works, compiled, self._agreed_params)
        if why is None and not wanted(self.setting, params[0].device.type):
            why = CPU_DOES_NOT_PAY
        if why is not None:
            self.state, self.reason = State.OFF, why
            self._remove_hooks()
            return
        self._hook(params)
        if params[0].device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(device=params[0].device)
        self._run = Run(plan, state, engine, self._stream, group)
        self.state = State.ON

    def _hook(self, params: Sequence[Tensor]) -> None:
        """Listen for ``params``' final gradients: DDP's through its comm hook, owner-sharded
        ones through their sharding, the others through post-accumulate-grad hooks."""
        owned = [owned_by(p) for p in params]
        agreed = self._agreed_params or frozenset()
        hooked = [p for p, o in zip(params, owned) if o is None and id(p) not in agreed]
        shardings = {id(o.sharding): o.sharding for o in owned if o is not None}
        if set(self._hooks) == {id(p) for p in hooked} | set(shardings):
            return
        self._remove_hooks()
        ready = partial(_ready_weakly, weakref.ref(self))
        self._hooks.update({id(p): p.register_post_accumulate_grad_hook(ready) for p in hooked})
        final = partial(_final_weakly, weakref.ref(self))
        self._hooks.update({key: s.notify_final_gradients(final) for key, s in shardings.items()})

    @property
    def _agreed_params(self) -> frozenset[int] | None:
        """The parameters of DDP's comm hook where it hands its buckets over (every rank registered it)."""
        return self.ddp.params if self.ddp is not None and self.ddp_agreed else None

    @property
    def status(self) -> str:
        """"on", or "off: <why>" (``Muon.early_start``)."""
        if self.state is State.OFF:
            return f"off: {self.reason}"
        if self.state is State.ON and self._stream is not None:
            return "on (a CUDA stream of its own)"
        return self.state.value

    def check(self, works: Sequence[MatrixWork], compiled: bool, ddp_may_follow: bool = False) -> None:
        """With ``early_start=True``: raise if it cannot run a plan of ``works``."""
        why = unsupported_because(works, compiled, self._agreed_params, ddp_may_follow)
        if why is not None:
            raise ValueError(f"Invalid early_start=True: {why}. Pass early_start=None (where supported) or False.")

    def register_ddp(self, model: nn.Module, job: dist.ProcessGroup | None, muon: Sequence[MuonParam]) -> None:
        """:meth:`dmuon.Muon.register_ddp_comm_hook`: checked, then registered; it hands DDP's
        buckets over once the ranks agree on it (:meth:`settle`)."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"register_ddp_comm_hook needs a DistributedDataParallel model, got "
                            f"{type(model).__name__}.")
        theirs = model.process_group
        if job is not None and dist.get_process_group_ranks(job) != dist.get_process_group_ranks(theirs):
            raise ValueError(f"The DDP model reduces over ranks {dist.get_process_group_ranks(theirs)}, this "
                             f"optimizer works over ranks {dist.get_process_group_ranks(job)}: build the optimizer "
                             "from the DDP model (dmuon.Muon(ddp_model)) or pass its process_group.")
        if self.ddp is not None:
            raise ValueError("register_ddp_comm_hook was called before on this optimizer: it serves one DDP model.")
        in_model = {id(p) for p in model.parameters()}
        replicated = [m for m in muon if owned_by(m.param) is None]
        if replicated and not any(id(m.param) in in_model for m in replicated):
            raise ValueError(f"register_ddp_comm_hook: the DDP model ({type(model.module).__name__}) holds none of "
                             f"this optimizer's Muon parameters (such as {replicated[0].name!r}): pass the DDP model "
                             "of the parameters the optimizer steps.")
        self.ddp = DDPReduction.of(model)  # DDP raises if the model has another comm hook

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """:meth:`dmuon.Muon.accumulating`."""
        previous, self.paused = self.paused, True
        try:
            yield
        finally:
            self.paused = previous

    # ------------------------------------------------------------------ at step()

    def finish(self) -> Run | None:
        """The current run, finished — started in the backward pass or not, so that every rank
        issues the same collectives (None if none was armed)."""
        run, self._run = self._run, None
        if run is not None:
            run.finish()
        return run

    @staticmethod
    def verdict(run: Run | None, state: dict) -> RunUse:
        """This rank's part of the agreement on ``run`` (:meth:`Run.verdict`); a rank without a run
        has nothing of its own to redo."""
        return run.verdict(state) if run is not None else USED

    def settle(self, agreed: RunUse) -> None:
        """After the ranks agreed on the step, which compared whether each registered the DDP
        comm hook: from now on that hook hands its buckets over (the runs' collectives then match
        on every rank); and early start turns itself off where a gradient changed after the
        backward pass (``agreed`` is CHANGED), since it would only repeat work."""
        if self.ddp is not None and not self.ddp_agreed:
            self.ddp.hand_to(self._reduced)
            self.ddp_agreed = True
        if agreed == CHANGED:
            self.turn_off("the gradients changed between the backward pass and step() (a second backward pass for "
                          "gradient accumulation, or clipping or unscaling them), so its work was redone; accumulate "
                          "with all but the last micro-batch inside optimizer.accumulating() instead (or DDP's or "
                          "owner sharding's no_sync(), FSDP2's set_requires_gradient_sync(False))")

    @staticmethod
    def held_updates(run: Run | None, agreed: RunUse, plan: StepPlan) -> StepValues | None:
        """The updates ``run`` held, where every rank may use them (``agreed`` is USED) and it ran ``plan``."""
        return run.values if run is not None and agreed == USED and run.plan is plan else None

    # ------------------------------------------------------------------ the hooks

    def _ready(self, p: Tensor) -> None:
        if self._run is not None:
            self._run.ready(p, self.paused)

    def _reduced(self, bucket: Reducing) -> None:
        if self._run is not None:
            self._run.reduced(bucket, self.paused)

    def restart(self) -> None:
        """The gradients the current run read are gone (zeroed; the backward pass that gave them
        raised): a run a gradient reached starts over on its plan. What it began, it began on
        every rank alike (each caught the failure at the same point), and it is let go."""
        if self._run is not None and self._run.touched:
            self._run = self._run.again()

    def turn_off(self, why: str) -> None:
        self.setting = False
        self.state, self.reason = State.OFF, why
        self._remove_hooks()
        warnings.warn(f"dmuon early start turned off: {why}. Steps are exact either way; pass early_start=False to "
                      "silence this.", stacklevel=5)  # <- settle <- Stepper.step <- Muon.step <- caller

    def _remove_hooks(self) -> None:
        _remove(self._hooks)

    def __deepcopy__(self, memo: dict) -> EarlyStart:
        return EarlyStart(self.setting)  # a copy of an optimizer starts without hooks or a run

    def __getstate__(self) -> dict[str, bool | None]:
        return {"setting": self.setting}

    def __setstate__(self, saved: dict[str, bool | None]) -> None:
        self.__init__(saved["setting"])


def _ready_weakly(early: weakref.ref, p: Tensor) -> None:
    """A parameter's hook: tell its optimizer's early start, if that still exists."""
    alive = early()
    if alive is not None:
        alive._ready(p)


def _final_weakly(early: weakref.ref, params: Sequence[Tensor] | None) -> None:
    """An owner sharding's listener: each parameter as its hook would (:func:`_ready_weakly`);
    None: the backward pass that gave the earlier ones raised, so the run starts over."""
    if params is None:
        alive = early()
        if alive is not None:
            alive.restart()
        return
    for p in params:
        _ready_weakly(early, p)


def _remove(hooks: dict[int, RemovableHandle]) -> None:
    for handle in hooks.values():
        handle.remove()
    hooks.clear()
