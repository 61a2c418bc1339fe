"""A plain reference Muon: one parameter and one matrix at a time, no batching, no routing.

It is the yardstick the tests hold the fast path (:class:`dmuon.Muon`) and the distributed
paths against: same algorithm, written as directly as possible. Pair it with
``torch.optim.AdamW`` for the parameters that Muon does not update.

It computes the momentum, the update and the lr factor itself. From the package it takes only
the Newton–Schulz core (``dmuon.orthogonalization.newton_schulz``, tested on its own against the
exact polynomial), the update rules (:mod:`dmuon.rules`, NorMuon's tested on its own against the
paper's algorithm) and what configures them: Muon's defaults, how a parameter is read as
matrices and row blocks (``dmuon.routing.matrix_shape``, ``dmuon.row_blocks.row_blocks``) and a dtype option's
name (``dmuon.hyperparameters.dtype_name``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from dmuon import momentum
from dmuon.hyperparameters import dtype_name
from dmuon.optimizer import Muon
from dmuon.orthogonalization import newton_schulz
from dmuon.routing import matrix_shape, row_shape
from dmuon.row_blocks import row_blocks
from dmuon.rules import RULES, apply_rule

# The hyperparameters the reference's step reads, listed here rather than taken from the fast
# path. Their defaults are Muon's own (read from its signature), so the two cannot drift apart;
# a key Muon no longer takes fails here, at import.
HYPERPARAMETERS = (
    "lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
    "adjust_lr_fn", "ns_method", "ns_dtype", "ns_restarts", "ns_blocks", "update_rule", "beta2", "momentum_dtype",
)
_DEFAULTS = {name: inspect.signature(Muon.__init__).parameters[name].default for name in HYPERPARAMETERS}


def lr_factor(adjust_lr_fn: str | None, m: int, n: int) -> float:
    """The lr multiplier of an m×n matrix (its own copy, not the fast path's): "original" or
    None (Keller) √max(1, m/n); "match_rms_adamw" (Moonlight) 0.2·√max(m, n);
    "spectral_unclamped" √(m/n)."""
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, m / n))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr_fn == "spectral_unclamped":
        return math.sqrt(m / n)
    raise ValueError(f"Invalid adjust_lr_fn={adjust_lr_fn!r}. Must be None, 'original', 'match_rms_adamw' or "
                     "'spectral_unclamped'.")


class ReferenceMuon(torch.optim.Optimizer):
    """Muon on every parameter given (each must be a matrix or a stack of them), with
    :class:`dmuon.Muon`'s Muon hyperparameters (``lr``, ``momentum``, ``ns_*``, …)."""

    def __init__(self, params: Iterable[Tensor], matrix_view: str = "auto", **hyperparameters: Any) -> None:
        unknown = set(hyperparameters) - set(HYPERPARAMETERS)
        if unknown:
            raise TypeError(f"Unknown hyperparameters {sorted(unknown)}; expected some of {HYPERPARAMETERS}.")
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
                    kept = group["momentum_dtype"]
                    dtype = p.dtype if kept is None else getattr(torch, dtype_name(kept, option="momentum_dtype"))
                    state.update(momentum.zeros(p, dtype))
                buf = momentum.value(state)  # 8-bit momentum: decoded into fp32, and below stored encoded
                # a buffer in another dtype than the gradient (momentum_dtype): the lerp in the wider one;
                # Newton–Schulz's input in the parameter's dtype
                wide = torch.promote_types(buf.dtype, p.grad.dtype)
                buf.copy_(buf.to(wide).lerp(p.grad.to(wide), 1 - group["momentum"]))
                momentum.store(state, buf)
                ns_input = p.grad.to(wide).lerp(buf.to(wide), group["momentum"]) if group["nesterov"] else buf
                ns_input = ns_input.to(p.dtype)
                count, m, n = matrix_shape(p.shape, group["matrix_view"])
                matrices = ns_input.reshape(count, m, n)
                blocks = row_blocks(group["ns_blocks"], m).indices()
                # fused weights: every block's rows orthogonalized (and below, ruled and scaled) as one matrix
                results = [[self._orthogonalize(matrices[i][rows], group) for rows in blocks] for i in range(count)]
                update = matrices.new_empty((count, m, n), dtype=results[0][0].dtype)
                for i, of_matrix in enumerate(results):
                    for rows, result in zip(blocks, of_matrix):
                        update[i, rows] = result
                rule = RULES[group["update_rule"]]
                if rule.fn is not None:
                    row_state = state.setdefault(rule.state, torch.zeros(row_shape(p.shape, group["matrix_view"]),
                                                                         device=p.device)).view(count, m)
                    for rows in blocks:
                        update[:, rows], row_state[:, rows] = apply_rule(rule, update[:, rows], row_state[:, rows],
                                                                         [len(rows)], group)
                scale = lr_factor(group["adjust_lr_fn"], m, n)
                if len(blocks) > 1:
                    for rows in blocks:
                        update[:, rows] = update[:, rows] * lr_factor(group["adjust_lr_fn"], len(rows), n)
                    scale = 1.0
                lr = float(group["lr"])
                p.mul_(1 - lr * group["weight_decay"])
                # the sum in at least fp32, rounded once: torch's CPU add of two bf16 tensors with
                # alpha rounds differently in its vectorized and scalar loops (so by position)
                p.add_(update.reshape(p.shape).to(torch.promote_types(p.dtype, torch.float32)), alpha=-lr * scale)
        return loss

    @staticmethod
    def _orthogonalize(matrix: Tensor, group: dict[str, Any]) -> Tensor:
        return newton_schulz(
            matrix, steps=group["ns_steps"], coefficients=group["ns_coefficients"], method=group["ns_method"],
            dtype=group["ns_dtype"], restarts=group["ns_restarts"], eps=group["eps"],
        )
