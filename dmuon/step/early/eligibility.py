"""Whether early start can run a step plan, and so whether the plan's buckets follow the
backward pass: pure functions of the plan's works and of :class:`Eligibility`, which is part of
the plan's key (:func:`dmuon.step.plan.plan_key`), so that a plan is rebuilt whenever the answer
may change (``early_start`` turned off, a DDP comm hook registered, another device).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

from torch.distributed.tensor import DTensor

from dmuon.layout import owned_by
from dmuon.strategies.base import MatrixWork

CPU_DOES_NOT_PAY = ("on CPU it does not pay: the hooks run on the backward pass's own thread, which leaves no idle "
                    "time to fill (measured no faster beyond the noise; early_start=True forces it)")


class Eligibility(NamedTuple):
    """What decides whether early start may run a step plan: an input of the plan, in its key."""

    setting: bool | None  # the early_start option now (False once early start turned itself off)
    device_type: str  # where the optimizer's collectives run
    compiled: bool  # compile or cuda_graphs: the step runs as a whole
    ddp_params: frozenset[int] | None  # ids of the parameters a registered DDP comm hook reports on


def wanted(setting: bool | None, device_type: str) -> bool:
    """Whether early start should run for parameters on ``device_type`` (None: where it pays)."""
    return setting if setting is not None else device_type == "cuda"


def follows_backward(early: Eligibility, works: Sequence[MatrixWork]) -> bool:
    """Whether a step plan's buckets follow the backward pass (the model's order reversed) rather
    than the cost order: where early start is wanted and, unless ``early_start=True`` forces it
    (and raises at the step where it cannot run), can run ``works`` as planned for it."""
    if not wanted(early.setting, early.device_type):
        return False
    return early.setting is True or unsupported_because(works, early.compiled, early.ddp_params) is None


def unsupported_because(works: Sequence[MatrixWork], compiled: bool, ddp_params: Collection[int] | None = None,
                        ddp_may_follow: bool = False) -> str | None:
    """Why early start cannot run a plan of ``works`` (None: it can); ``ddp_params``: the
    parameters a DDP comm hook reports on (their gradients are final once DDP's all-reduce of
    their bucket is done), if one is registered; ``ddp_may_follow``: replicated parameters pass,
    as that hook may still be registered (at construction)."""
    if compiled:
        return "compile or cuda_graphs: the compiled step runs as a whole"
    if any(w.gang or w.column_blocks for w in works):
        return "the plan has gangs or distributed Newton-Schulz, which do not run in stages"
    for work in works:
        why = _unsupported_param(work, ddp_params, ddp_may_follow)
        if why is not None:
            return why
    return None


def _unsupported_param(work: MatrixWork, ddp_params: Collection[int] | None, ddp_may_follow: bool) -> str | None:
    """Why early start cannot tell when ``work``'s gradient is final (None: it can)."""
    p = work.param
    if ddp_params is not None and id(p) in ddp_params:
        return None  # final once DDP's all-reduce of its bucket is done: the comm hook says when
    owned = owned_by(p)
    if owned is not None:
        if owned.sharding.across_replicas:
            return (f"{work.name!r} is owner-sharded across replicas (HSDP): its gradient is final only "
                    "after the replicas' sums meet, at the end of the backward pass")
        return None  # final once the owner's reduce is done: the sharding says when
    if work.process_group is None:
        return None
    if not isinstance(p, DTensor):
        if ddp_may_follow:
            return None
        return (f"{work.name!r} is replicated (DDP): its gradient is final only after DDP's all-reduce; "
                "optimizer.register_ddp_comm_hook(ddp_model) tells early start when that is done")
    if work.layout.transposed:
        return f"{work.name!r} is sharded on its columns alone (row-wise tensor parallel)"
    return None
