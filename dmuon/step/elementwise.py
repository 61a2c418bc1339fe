"""The element-wise tensor code of a step, in two forms of the same kernels.

Over lists (``*_all``), with float hyperparameters: the eager step, one ``torch._foreach_*``
call per list instead of a Python loop over the parameters — per tensor the same operations as
the plain reference (:mod:`dmuon.reference`): ``lerp_``, ``lerp``, ``mul_`` then ``add_``, so the
two give the same bits. Per tensor (``update_momentum``, ``nesterov_input``, ``apply_update``),
with hyperparameters as 0-D tensors: what ``Muon(compile=...)`` compiles, once for every lr and
momentum (a compiled graph fuses them, so it matches the eager step to rounding, not bitwise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from dmuon import momentum
from dmuon.hyperparameters import adamw_hyperparameters
from dmuon.orthogonalization import NSConfig, orthogonalize
from dmuon.param_groups import MuonParam
from dmuon.tensors import local


def update_momentum(buf: Tensor, grad: Tensor, momentum: Tensor) -> None:
    """``B ← μ·B + (1−μ)·G``, μ a 0-D tensor (compiled once for every μ); a buffer of another
    dtype than the gradient's (``momentum_dtype``) as :func:`lerp_mixed` computes it."""
    if buf.dtype != grad.dtype:
        buf.copy_(lerp_mixed(buf, grad, 1 - momentum))
        return
    buf.lerp_(grad, 1 - momentum.to(buf.dtype))


def nesterov_input(grad: Tensor, buf: Tensor, momentum: Tensor) -> Tensor:
    """``G + μ·(B − G)``: the Newton–Schulz input with Nesterov momentum."""
    if buf.dtype != grad.dtype:
        return lerp_mixed(grad, buf, momentum)
    return torch.lerp(grad, buf, momentum.to(buf.dtype))


def lerp_mixed(start: Tensor, end: Tensor, weight: float | Tensor) -> Tensor:
    """``start + weight·(end − start)`` for tensors of two dtypes (a momentum buffer kept in
    ``momentum_dtype`` beside its gradient): computed in the wider dtype, one tensor at a time, so
    that no more than one parameter's worth of it exists at once."""
    wide = torch.promote_types(start.dtype, end.dtype)
    weight = weight.to(wide) if isinstance(weight, Tensor) else weight
    return torch.lerp(start.to(wide), end.to(wide), weight)


def apply_update(param: Tensor, update: Tensor, lr: Tensor, weight_decay: Tensor, scale: float) -> None:
    """``W ← W·(1 − lr·wd) − lr·scale·O``, lr and wd 0-D tensors (compiled once for every lr)."""
    param.mul_(1 - lr * weight_decay)
    param.sub_(update.to(param.dtype) * (lr * scale))


@dataclass(frozen=True)
class CompiledKernels:
    """The step's tensor code, each function compiled whole (``fullgraph=True``: a graph break
    is an error) for fixed shapes; hyperparameters enter as 0-D tensors, so changing the lr or
    momentum reuses the compiled code."""

    orthogonalize: Callable[[Tensor, NSConfig], Tensor]
    update_momentum: Callable[[Tensor, Tensor, Tensor], None]
    nesterov_input: Callable[[Tensor, Tensor, Tensor], Tensor]
    apply_update: Callable[[Tensor, Tensor, Tensor, Tensor, float], None]


def compile_kernels(backend: str | Callable = "inductor") -> CompiledKernels:
    def compiled(fn: Callable) -> Callable:
        return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)

    return CompiledKernels(*(compiled(fn) for fn in (orthogonalize, update_momentum, nesterov_input, apply_update)))


def scalar(value: float | Tensor, device: torch.device) -> Tensor:
    """A hyperparameter as the 0-D fp32 tensor the compiled kernels take: a number is filled in
    on the device (a fill kernel; ``as_tensor`` would copy it from the host and wait for the GPU)."""
    if isinstance(value, Tensor):
        return value.to(device=device, dtype=torch.float32)
    return torch.full((), value, dtype=torch.float32, device=device)


def update_momentum_all(bufs: list[Tensor], grads: list[Tensor], momentum: float) -> None:
    """:func:`update_momentum` of every (buffer, gradient) pair (one foreach call where their
    dtypes agree; a buffer in its own ``momentum_dtype`` through :func:`lerp_mixed`)."""
    if all(b.dtype == g.dtype for b, g in zip(bufs, grads)):
        torch._foreach_lerp_(bufs, grads, 1 - momentum)
        return
    for buf, grad in zip(bufs, grads):
        buf.copy_(lerp_mixed(buf, grad, 1 - momentum))


def momentum_out_of_place(bufs: list[Tensor], grads: list[Tensor], momentum: float) -> list[Tensor]:
    """What :func:`update_momentum_all` would leave in the buffers (the same bits), in new
    tensors: early start's, which must not touch the buffers before ``step()``."""
    if all(b.dtype == g.dtype for b, g in zip(bufs, grads)):
        return list(torch._foreach_lerp(bufs, grads, 1 - momentum))
    return [lerp_mixed(b, g, 1 - momentum).to(b.dtype) for b, g in zip(bufs, grads)]


def nesterov_inputs_all(grads: list[Tensor], bufs: list[Tensor], momentum: float) -> list[Tensor]:
    """:func:`nesterov_input` of every pair."""
    if all(b.dtype == g.dtype for b, g in zip(bufs, grads)):
        return list(torch._foreach_lerp(grads, bufs, momentum))
    return [lerp_mixed(g, b, momentum) for g, b in zip(grads, bufs)]


def apply_updates_all(params: list[Tensor], updates: list[Tensor], lr: float, weight_decay: float,
                      scale: float) -> None:
    """:func:`apply_update` of every (parameter, update) pair with one lr factor ``scale``.

    An update narrower than its parameter (bf16 off the wire into fp32 weights) goes into the
    add as it is: type promotion widens it exactly inside the add's own pass, with the same bits
    as widening it first, where a separate ``.to()`` would be a pass of its own (on CPU, bf16 →
    fp32 conversion of a step's updates takes longer than the add). Only a wider update is
    rounded to the parameter's dtype first, as :func:`apply_update` does.

    The bits must not depend on where an element sits, since shards and replicas hold the same
    element at different places: into bf16/fp16 parameters the update goes as fp32 (on CPU,
    torch's add of two bf16 tensors with ``alpha`` rounds in its vectorized loop where its scalar
    loop does not, so the result depended on the position in the tensor and on its strides; the
    mixed-dtype add rounds once, like ``(W + α·O)`` computed exactly), and a strided update (the
    transpose a row-wise sharded matrix's exchange hands back) is made contiguous first."""
    torch._foreach_mul_(params, _decay_factor(1 - lr * weight_decay, params[0].device))
    torch._foreach_add_(params, [_addable(u, p.dtype) for p, u in zip(params, updates)], alpha=-lr * scale)


def _decay_factor(factor: float, device: torch.device) -> float | Tensor:
    """The weight-decay factor as ``torch._foreach_mul_`` takes it exactly: on CPU it rounds a
    Python scalar to a bf16/fp16 tensor's dtype before multiplying (0.998 becomes 0.996 in bf16:
    twice the decay), and multiplies by a 0-D float64 tensor as ``Tensor.mul_`` does by the scalar."""
    return torch.tensor(factor, dtype=torch.float64) if device.type == "cpu" else factor


def _addable(update: Tensor, dtype: torch.dtype) -> Tensor:
    """``update`` as :func:`apply_updates_all` adds it to a ``dtype`` parameter: rounded to
    ``dtype`` first if it is wider (as one process's update is, in the parameter's dtype), then
    in fp32 for a bf16/fp16 parameter, contiguous."""
    if torch.promote_types(update.dtype, dtype) != dtype:
        update = update.to(dtype)
    if dtype in (torch.bfloat16, torch.float16):
        return update.to(torch.float32, memory_format=torch.contiguous_format)
    return update.contiguous()


def update_momentum_of(entries: Sequence[MuonParam], state: dict, kernels: CompiledKernels | None
                       ) -> dict[int, tuple[Tensor, Tensor]]:
    """``B ← μ·B + (1−μ)·G`` for the Muon parameters of ``entries``, whose buffers the optimizer
    has created; one call per group (8-bit momentum: decoded, updated in fp32, stored encoded).
    Returns this rank's pieces of each parameter's gradient and momentum (the fp32 value of 8-bit
    momentum), by ``id`` of the parameter (the step's Newton–Schulz inputs are made of them)."""
    pieces: dict[int, tuple[Tensor, Tensor]] = {}
    by_group: dict[int, list] = {}
    for m in entries:
        by_group.setdefault(id(m.param_group), [m.param_group]).append(m.param)
    for group, *params in by_group.values():
        bufs = [momentum.value(state[p]) for p in params]
        grads = [local(p.grad) for p in params]
        if kernels is not None:
            mu = scalar(group["momentum"], bufs[0].device)
            for buf, grad in zip(bufs, grads):
                kernels.update_momentum(buf, grad, mu)
        else:
            update_momentum_all(bufs, grads, group["momentum"])
        for p, buf in zip(params, bufs):
            momentum.store(state[p], buf)
        pieces.update(zip(map(id, params), zip(grads, bufs)))
    return pieces


def adamw_steps(groups: Sequence[dict], state: dict, stepped: set[int]) -> None:
    """:func:`adamw_step` of every group."""
    for group in groups:
        adamw_step(group, state, stepped)


def adamw_step(group: dict, state: dict, stepped: set[int]) -> None:
    """torch's AdamW on a group's AdamW parameters whose ``id`` is in ``stepped`` (they have a
    gradient on every rank), with the group's AdamW hyperparameters
    (:func:`dmuon.hyperparameters.adamw_hyperparameters`), whose state the optimizer has created."""
    chosen = [p for p, alg in zip(group["params"], group["algorithms"]) if alg == "adamw" and id(p) in stepped]
    if not chosen:
        return
    hyper = adamw_hyperparameters(group)
    beta1, beta2 = hyper["betas"]
    # torch's foreach kernels take DTensors of one mesh, or plain tensors, not a mix (a bias FSDP2
    # ignores beside its sharded weights): one call for each
    kinds: dict[int | None, list[Tensor]] = {}
    for p in chosen:
        kinds.setdefault(id(p.device_mesh) if isinstance(p, DTensor) else None, []).append(p)
    for params in kinds.values():
        adamw(
            params, [p.grad for p in params],
            [state[p]["exp_avg"] for p in params], [state[p]["exp_avg_sq"] for p in params],
            [], [state[p]["step"] for p in params],
            amsgrad=False, beta1=beta1, beta2=beta2, lr=hyper["lr"],
            weight_decay=hyper["weight_decay"], eps=hyper["eps"], maximize=False,
            foreach=_foreach_adamw(params, hyper["lr"]),
        )


def _foreach_adamw(params: Sequence[Tensor], lr: float | Tensor) -> bool:
    """Whether torch's foreach AdamW gives the single-tensor one's bits: it takes a float lr
    only, and on CPU it rounds its weight-decay factor to a bf16/fp16 parameter's dtype (see
    :func:`_decay_factor`), where the single-tensor AdamW multiplies exactly."""
    return not isinstance(lr, Tensor) and all(p.device.type != "cpu" or p.dtype in (torch.float32, torch.float64)
                                              for p in params)
