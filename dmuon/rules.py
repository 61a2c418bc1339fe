"""Update rules: what the owner of a matrix does to its orthogonalized update before the update
goes back to the ranks, by name (a Muon param group's ``"update_rule"``).

A rule sees the whole orthogonalized update of one parameter — ``(count, rows, cols)`` in the
parameter's orientation, fp32 — and at most one piece of state: one fp32 number per row of each
matrix (``(count, rows)``), which it reads and returns anew. Nothing else crosses ranks, so a rule
is exact in every layout: the whole update exists on exactly one rank (its owner), the rule runs
there, and the new row state is shared with the other ranks that hold the parameter, unchanged
(:func:`dmuon.strategies.base.share_row_states`). Those ranks store it whole (m numbers per m×n
matrix; a DTensor replicated on the parameter's mesh, :func:`dmuon.layout.row_state_placements`),
which ``torch.distributed.checkpoint`` reshards like any replicated tensor.

Adding a rule: one function of that signature and one :class:`UpdateRule` entry in
:data:`RULES` (its group options in :data:`RULE_OPTIONS`, their defaults as :class:`dmuon.Muon`'s
arguments). It stays exact in every layout as long as it reads only the whole update, its own
row state and the group's options, and returns an update of the same shape: the engine never
splits such a matrix over ranks (no gangs, no column blocks), and its result goes back in the
parameter's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# NorMuon's floor under the row RMS and the update's norm (the reference implementation's)
NORMUON_EPS = 1e-10

RuleFn = Callable[[Tensor, Tensor, dict[str, Any]], tuple[Tensor, Tensor]]


def normuon(update: Tensor, second_moment: Tensor, group: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """NorMuon (Li et al., arXiv 2510.05491, Algorithm 1): each row (output neuron) of the
    orthogonalized update divided by the RMS of its running second moment (β2 = ``group["beta2"]``),
    then the whole update rescaled to the Frobenius norm it had. Returns the update and the new
    second moment; the lr factor (``adjust_lr_fn``) applies afterwards."""
    norm = torch.linalg.vector_norm(update, dim=(-2, -1), keepdim=True)
    moment = second_moment.lerp(update.square().mean(dim=-1).to(second_moment.dtype), 1 - group["beta2"])
    normalized = update * (moment.sqrt() + NORMUON_EPS).reciprocal().unsqueeze(-1)
    restored = normalized * (norm / (torch.linalg.vector_norm(normalized, dim=(-2, -1), keepdim=True) + NORMUON_EPS))
    return restored, moment


@dataclass(frozen=True)
class UpdateRule:
    """A rule by name: its function (None: the update as Newton–Schulz gives it) and the name
    of its row state in the optimizer's state (None: it keeps none)."""

    name: str
    fn: RuleFn | None
    state: str | None


RULES: dict[str, UpdateRule] = {
    "muon": UpdateRule("muon", None, None),
    "normuon": UpdateRule("normuon", normuon, "row_second_moment"),
}
# every rule's group options (their defaults: dmuon.Muon's arguments): the range each must be in, [low, high)
RULE_OPTIONS: dict[str, tuple[float, float]] = {"beta2": (0.0, 1.0)}
ROW_STATE_KEYS = tuple(r.state for r in RULES.values() if r.state is not None)


def rule_of(group: dict[str, Any]) -> UpdateRule:
    return RULES[group["update_rule"]]


def check_rule_name(name: Any, where: str = "") -> None:
    if name not in RULES:
        raise ValueError(f"Invalid update_rule={name!r}{where}. Must be one of {tuple(RULES)}.")


def apply_rule(rule: UpdateRule, update: Tensor, row_state: Tensor, rows: Sequence[int], group: dict[str, Any]
               ) -> tuple[Tensor, Tensor]:
    """``rule`` on a parameter's whole update ``(count, m, n)`` (parameter orientation) and its
    row state ``(count, m)``, each row block of ``rows`` (fused weights) as its own matrix, in fp32
    at least. Returns the update, in its dtype, and the new row state."""
    wide = update.to(torch.promote_types(update.dtype, torch.float32))
    parts = [rule.fn(matrices, states, group) for matrices, states in zip(wide.split(list(rows), dim=-2),
                                                                             row_state.split(list(rows), dim=-1))]
    return torch.cat([u for u, _ in parts], dim=-2).to(update.dtype), torch.cat([s for _, s in parts], dim=-1)
