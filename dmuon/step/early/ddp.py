"""DDP's comm hook for early start: DDP's own gradient reduction, which also hands each bucket
to the early run once its all-reduce has started.

A DDP parameter's gradient is final only once DDP's all-reduce of its bucket is done, after its
post-accumulate-grad hook. ``Muon.register_ddp_comm_hook(model)`` registers :func:`reduce_ddp_bucket`:
scale by 1 / world size, one summing all-reduce (the same bits as DDP's built-in reduction). A
bucket is taken as final when DDP starts the next bucket's all-reduce, and the last at ``step()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from dmuon.exchange import start_all_reduce_sum
from dmuon.step.early.run import Reducing


class DDPReduction:
    """The state of dmuon's DDP comm hook (:func:`reduce_ddp_bucket`): the DDP model's parameters
    and process group, and where it hands buckets (held weakly: a model that outlives its
    optimizer still reduces its gradients, and only that; nowhere until the ranks agreed on it).
    One per model (:meth:`of`): DDP takes one comm hook, and an optimizer made later for the same
    model takes the hook over."""

    _of_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, model: nn.Module) -> None:
        self.receiver: weakref.WeakMethod | None = None  # set by hand_to
        self.params = frozenset(id(p) for p in model.parameters())
        self.process_group = model.process_group

    @classmethod
    def of(cls, model: nn.Module) -> DDPReduction:
        """``model``'s reduction: the one its comm hook has, or a new one with the hook registered
        (DDP raises if the model has another comm hook)."""
        reduction = cls._of_model.get(model)
        if reduction is None:
            reduction = cls(model)
            model.register_comm_hook(reduction, reduce_ddp_bucket)
            cls._of_model[model] = reduction
        return reduction

    def hand_to(self, receiver: Callable[[Reducing], None]) -> None:
        """From now on, hand the buckets to ``receiver``, a bound method (all ranks agreed)."""
        self.receiver = weakref.WeakMethod(receiver)

    def hand_over(self, bucket: Reducing) -> None:
        receiver = self.receiver() if self.receiver is not None else None
        if receiver is not None:
            receiver(bucket)


# unannotated: DDP checks the annotations against dist.GradBucket and Future[Tensor], which this
# module's postponed (string) annotations would not be
def reduce_ddp_bucket(state, bucket):  # noqa: ANN001, ANN201
    """A DDP comm hook: DDP's own gradient reduction (the bucket scaled by 1 / world size, then
    summed by one all-reduce: the same bits as DDP's built-in one), which also hands the bucket to
    early start once its all-reduce has started. DDP calls comm hooks in the same bucket order on
    every rank, so the collectives the early run issues from here come in the same order too."""
    buffer = bucket.buffer()
    buffer.mul_(1.0 / state.process_group.size())
    done = start_all_reduce_sum(buffer, state.process_group).get_future()
    state.hand_over((bucket.parameters(), bucket.gradients(), done))
    return done.then(_the_tensor)


def _the_tensor(done: torch.futures.Future) -> Tensor:
    return done.value()[0]

