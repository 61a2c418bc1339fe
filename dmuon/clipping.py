"""Gradient clipping by the global norm, for every layout ``dmuon.Muon`` supports.

``torch.nn.utils.clip_grad_norm_`` is right under DDP and FSDP2, whose gradients every rank
holds in full or as DTensor shards; under owner sharding a rank holds only the gradients of the
matrices it owns, so its own norm misses the others'. :func:`clip_grad_norm_` sums each
gradient element exactly once in the whole job (:func:`dmuon.layout.counted_here`) with one
all-reduce, then every rank scales the gradients it holds.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon.exchange import all_reduce_sum
from dmuon.layout import counted_here, owned_by

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float,
                    process_group: dist.ProcessGroup | None = None) -> Tensor:
    """Clip gradients to a global L2 norm of ``max_norm``, as ``torch.nn.utils.clip_grad_norm_``
    would on one process holding the whole model; return the norm before clipping (a 0-D
    tensor, the same on every rank). Collective when ``torch.distributed`` is initialized: every
    rank of the job calls it, each with its part of the model (a pipeline stage's), and the norm
    is the whole model's.

    Args:
        parameters: this rank's parameters (plain tensors, DTensors, owner-sharded matrices).
        max_norm: the norm to clip to; ``<= 0`` only measures.
        process_group: the ranks holding copies of the plain tensors among ``parameters`` (a
            pipeline stage's DDP group), whose first rank counts them; default: the world.
    """
    params = list(parameters)
    for sharding in {id(o.sharding): o.sharding for p in params if (o := owned_by(p)) is not None}.values():
        sharding.wait_for_gradients()  # the owners' gradients are complete only after it
    with_grad = [p for p in params if p.grad is not None]
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in with_grad]
    counted = [g.float().square().sum() for p, g in zip(with_grad, grads) if counted_here(p, process_group)]
    device = params[0].device if params else torch.device("cpu")
    total = torch.stack(counted).sum() if counted else torch.zeros((), device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        all_reduce_sum(total, dist.group.WORLD)
    norm = total.sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return norm
