"""A plain reference Muon: one parameter and one matrix at a time, no batching, no routing.

It is the yardstick the tests hold the fast path (:class:`dmuon.Muon`) and the distributed
paths against: same algorithm, written as directly as possible. Pair it with
``torch.optim.AdamW`` for the parameters that Muon does not update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from dmuon.orthogonalization import NORMALIZATION_EPS, newton_schulz
from dmuon.optimizer import adjusted_lr_ratio
from dmuon.routing import matrix_shape


class ReferenceMuon(torch.optim.Optimizer):
    """Muon on every parameter given (each must be a matrix or a stack of them)."""

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = "polar_express",
        eps: float = NORMALIZATION_EPS,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        ns_method: str = "auto",
        ns_dtype: torch.dtype | None = None,
        ns_restarts: Sequence[int] | None = None,
        matrix_view: str = "auto",
    ) -> None:
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            ns_method=ns_method, ns_dtype=ns_dtype, ns_restarts=ns_restarts, matrix_view=matrix_view,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                ns_input = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                count, m, n = matrix_shape(p.shape, group["matrix_view"])
                matrices = ns_input.reshape(count, m, n)
                update = torch.stack([
                    newton_schulz(
                        matrices[i], steps=group["ns_steps"], coefficients=group["ns_coefficients"],
                        method=group["ns_method"], dtype=group["ns_dtype"],
                        restarts=group["ns_restarts"], eps=group["eps"],
                    )
                    for i in range(count)
                ])
                lr = float(group["lr"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-lr * adjusted_lr_ratio(group["adjust_lr_fn"], m, n))
        return loss
