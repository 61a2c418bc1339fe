"""A plain reference Muon: one parameter and one matrix at a time, no batching, no routing.

It is the yardstick the tests hold the fast path (:class:`dmuon.Muon`) and the distributed
paths against: same algorithm, written as directly as possible. Pair it with
``torch.optim.AdamW`` for the parameters that Muon does not update.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from dmuon.hyperparameters import MUON_KEYS, adjusted_lr_ratio
from dmuon.optimizer import Muon
from dmuon.orthogonalization import newton_schulz
from dmuon.routing import block_rows, matrix_shape


# The reference takes Muon's own defaults, so the two cannot drift apart.
_DEFAULTS = {
    name: parameter.default
    for name, parameter in inspect.signature(Muon.__init__).parameters.items()
    if name in MUON_KEYS
}


class ReferenceMuon(torch.optim.Optimizer):
    """Muon on every parameter given (each must be a matrix or a stack of them), with
    :class:`dmuon.Muon`'s Muon hyperparameters (``lr``, ``momentum``, ``ns_*``, …)."""

    def __init__(self, params: Iterable[Tensor], matrix_view: str = "auto", **hyperparameters: Any) -> None:
        unknown = set(hyperparameters) - set(MUON_KEYS)
        if unknown:
            raise TypeError(f"Unknown hyperparameters {sorted(unknown)}; expected some of {MUON_KEYS}.")
        super().__init__(params, {**_DEFAULTS, **hyperparameters, "matrix_view": matrix_view})

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
                rows = block_rows(group["ns_blocks"], m)
                if len(rows) == 1:
                    update = torch.stack([self._orthogonalize(matrices[i], group) for i in range(count)])
                    scale = adjusted_lr_ratio(group["adjust_lr_fn"], m, n)
                else:  # fused weights: every block orthogonalized and scaled for its own shape
                    update = torch.stack([
                        torch.cat([self._orthogonalize(block, group) * adjusted_lr_ratio(group["adjust_lr_fn"], r, n)
                                   for block, r in zip(matrices[i].split(rows), rows)])
                        for i in range(count)
                    ])
                    scale = 1.0
                lr = float(group["lr"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-lr * scale)
        return loss

    @staticmethod
    def _orthogonalize(matrix: Tensor, group: dict[str, Any]) -> Tensor:
        return newton_schulz(
            matrix, steps=group["ns_steps"], coefficients=group["ns_coefficients"], method=group["ns_method"],
            dtype=group["ns_dtype"], restarts=group["ns_restarts"], eps=group["eps"],
        )
