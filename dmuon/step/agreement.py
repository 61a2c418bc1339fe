"""The agreement of a step (:func:`agree_on_step`): this rank's checks of its gradients — a
quick finite check, which parameters have none, the replicas' norms — sent in the header of
:func:`dmuon.agreement.agree`, and the decision every rank takes from it alike: skip, raise, or
step the parameters every rank has a gradient for.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.agreement import Agreed, Fingerprint, Words, agree, both_signs, differs, digest_words
from dmuon.exchange import CommCounter, all_gather_bytes, all_reduce_max
from dmuon.tensors import finite_flags, grad_norms, local

# the step's fields in the agreement's header (its CALL_FIELDS), by position
_NONFINITE, _MISSING, _EARLY, _REPLICAS = 0, 1, 7, 8
# replicas' gradient norms agree to this relative tolerance (ranks may sum them in another order);
# the check compares sums of their logarithms, so that a small replica counts as much as a large one
REPLICA_RTOL = 1e-4
LOG_WEIGHTS_MAX = 7  # the largest weight of _log_norm_sums's second sum
_LOG_OF_NONFINITE = 100.0  # a norm that overflowed (a huge, finite gradient): above any fp32 norm's log (88.7)


def step_fields(missing: Words, early: int) -> list[float]:
    """The step's fields as this rank sends them, but for those on the device (:func:`device_step_fields`)."""
    return [0, *both_signs(missing), early, 0, 0, 0, 0]


def device_step_fields(nonfinite: Tensor | None, replica_sums: Tensor | None) -> list[tuple[int, Tensor]]:
    """The step's fields that are on the device (no host read), by position: whether some
    gradient may be non-finite (a bool tensor) and the two sums of the replicas' norms
    (:func:`_log_norm_sums`), each with its negation."""
    fields = []
    if nonfinite is not None:
        fields.append((_NONFINITE, nonfinite.to(torch.float32).reshape(1)))
    if replica_sums is not None:
        fields.append((_REPLICAS, torch.stack([replica_sums, -replica_sums], dim=1).reshape(-1)))
    return fields


class StepAgreed(NamedTuple):
    """The step's fields after the all-reduce, as every rank reads them."""

    fields: tuple[float, ...]

    @classmethod
    def of(cls, agreed: Agreed) -> StepAgreed:
        return cls(agreed.call_fields)

    @property
    def nonfinite(self) -> bool:
        """Some rank's quick look flagged a gradient."""
        return self.fields[_NONFINITE] > 0

    @property
    def early(self) -> int:
        """The highest early-start code of any rank: 0 use the early run's updates, 1 do not,
        2 do not and turn early start off."""
        return int(self.fields[_EARLY])

    @property
    def missing_differs(self) -> bool:
        """The ranks lack gradients for different parameters."""
        return differs(self.fields, _MISSING, 3)

    def replicas_differ(self, count: int) -> bool:
        """The sums of the logarithms of ``count`` replicas' gradient norms (:func:`_log_norm_sums`)
        differ between ranks beyond rounding: by more than ``REPLICA_RTOL`` for each replica,
        whatever its size."""
        pairs = [(self.fields[_REPLICAS + 2 * i], -self.fields[_REPLICAS + 2 * i + 1]) for i in range(2)]
        tolerance = REPLICA_RTOL * LOG_WEIGHTS_MAX * max(1, count)
        return any(high - low > tolerance for high, low in pairs)

class PreparedStep(NamedTuple):
    """This rank's part of a step before the agreement (its checks of its settings and gradients)."""

    params: list[Tensor]  # every parameter of the optimizer, in group order
    here: list[bool]  # whether this rank steps each (owner sharding: only the owner does)
    replicas: list[bool]  # whether each is a replica every rank holds whole (a plain-tensor Muon parameter)
    early: int  # this rank's early-start code (:attr:`StepAgreed.early`)


def agree_on_step(prepared: PreparedStep | Exception, policy: str, process_group: dist.ProcessGroup | None,
                  device: Callable[[], torch.device], fingerprint: Fingerprint, counter: CommCounter,
                  names: Callable[[], list[str]]) -> tuple[list[Tensor], list[bool], set[int] | None, int]:
    """The agreement of a step: ``prepared`` is this rank's part, or the exception it raised
    (shared with the other ranks, which raise too); ``fingerprint``, what the step depends on.
    Returns the parameters, whether this rank steps each, which parameters to leave alone, by
    position, or None to skip the whole step, and the agreed early-start code (at least 1 where
    ranks lack different gradients). ``device`` and ``names`` are asked only where needed.

    Every rank takes the same decisions (or the collectives would not match): the step is
    skipped if any rank saw a non-finite gradient (``policy`` "skip"; "raise" raises on every
    rank; "ignore" checks nothing), and a parameter is stepped only if every rank that steps it
    has its gradient. A failure of this rank's part, a sparse gradient and replicas whose gradients
    differ between ranks raise on every rank at once. The flags stay on the device until the
    header's all-reduce: reading it is the step's one host synchronization (on CUDA; none
    follows unless some rank flagged a gradient, ranks lack different gradients or replicas
    differ).
    """
    error = prepared if isinstance(prepared, Exception) else None
    params, here, replicas, code = PreparedStep([], [], [], 1) if error is not None else prepared
    checked = [i for i, p in enumerate(params) if here[i] and p.grad is not None]
    missing = [i for i, p in enumerate(params) if here[i] and p.grad is None]
    grads = [local(params[i].grad) for i in checked]
    sparse = next((i for i, g in zip(checked, grads) if g.is_sparse), None)
    suspect, replica_sums, replica_grads = None, None, []
    if error is None and sparse is not None:  # before any reduction (none runs on sparse tensors)
        error = RuntimeError(f"Muon does not support sparse gradients: {names()[sparse]!r} has one. Use dense "
                             "gradients (e.g. nn.Embedding(..., sparse=False)).")
    elif error is None and checked:
        suspect, replica_sums, replica_grads = _quick_checks(grads, [replicas[i] for i in checked], policy,
                                                             process_group is not None)
    missing_words = digest_words([("missing", json.dumps(missing))])
    agreed = None
    if process_group is not None:
        nonfinite = suspect.any() if suspect is not None else None
        agreed = StepAgreed.of(agree("step", fingerprint, process_group, device(), error=error, counter=counter,
                                     call_fields=step_fields(missing_words, code),
                                     device_fields=device_step_fields(nonfinite, replica_sums)))
        code = agreed.early
    if error is not None:
        raise error
    flagged = agreed.nonfinite if agreed is not None else suspect is not None and bool(suspect.any().item())
    left_alone = set(missing)
    if agreed is not None and agreed.missing_differs:
        code = max(code, 1)
        left_alone = _left_alone_everywhere(left_alone, len(params), checked, names, process_group, device(), counter)
    # the quick look flags huge finite gradients too: the exact check of those decides
    nonfinite = _confirm_nonfinite(grads, suspect, process_group, device(), counter) if flagged else None
    if nonfinite is not None:
        every = names()
        where = [every[checked[k]] for k in nonfinite] or ["another rank's parameters"]
        if policy == "raise":
            raise FloatingPointError(f"Non-finite gradients in {where}.")
        warnings.warn(f"Muon skipped a step: non-finite gradients in {where}.", stacklevel=4)
        return params, here, None, code
    if agreed is not None and not agreed.missing_differs and agreed.replicas_differ(len(replica_grads)):
        _raise_for_replicas(params, replicas, names(), process_group, device())
    return params, here, left_alone, code


def _quick_checks(grads: Sequence[Tensor], replica: Sequence[bool], policy: str, across_ranks: bool
                  ) -> tuple[Tensor | None, Tensor | None, list[int]]:
    """The quick finite check of this rank's gradients (a flag per gradient that may be
    non-finite; None with ``policy`` "ignore"), the sums of the replicas' norms (None without
    replicas or ranks to compare with), and which of ``grads`` are replicas'."""
    replica_grads = [k for k, is_replica in enumerate(replica) if is_replica] if across_ranks else []
    norms, suspect, replica_sums = None, None, None
    if policy != "ignore":
        norms = grad_norms(grads)
        suspect = ~torch.stack(norms).isfinite()
    if replica_grads:
        picked = [norms[k] for k in replica_grads] if norms is not None else \
            grad_norms([grads[k] for k in replica_grads])
        replica_sums = _log_norm_sums(torch.stack(picked))
    return suspect, replica_sums, replica_grads


def _left_alone_everywhere(missing: set[int], count: int, checked: Sequence[int], names: Callable[[], list[str]],
                           process_group: dist.ProcessGroup, device: torch.device, counter: CommCounter) -> set[int]:
    """Where ranks lack different gradients: every parameter some rank lacks, left alone on
    every rank (one all-reduce of a flag each), with a warning naming those this rank has."""
    flags = torch.tensor([float(i in missing) for i in range(count)], device=device)
    everywhere = all_reduce_max(flags, process_group, counter).tolist()
    left_alone = {i for i, f in enumerate(everywhere) if f > 0}
    lacking = [names()[i] for i in sorted(left_alone) if i in checked]
    if lacking:  # stacklevel: <- agree_on_step <- Stepper.step <- Muon.step <- its caller
        warnings.warn(f"Muon left {lacking} alone: some ranks have no gradient for them.", stacklevel=5)
    return left_alone


def _log_norm_sums(norms: Tensor) -> Tensor:
    """Two sums of the logarithms of a rank's replica gradient norms (fp32; a zero norm as the
    log of 1e-30, one that overflowed as ``_LOG_OF_NONFINITE``): plain, and weighted by
    position, so that two replicas whose norms trade places still differ. A replica's share is
    its norm's relative size, whatever its magnitude, so one small non-replica among large
    replicas moves the sums as much as a large one would."""
    norms = norms.to(torch.float32)
    logs = torch.where(norms.isfinite(), norms.clamp_min(1e-30).log(), _LOG_OF_NONFINITE)
    weights = torch.arange(logs.numel(), device=logs.device, dtype=torch.float32).remainder_(LOG_WEIGHTS_MAX).add_(1)
    return torch.stack([logs.sum(), (logs * weights).sum()])


def _raise_for_replicas(params: Sequence[Tensor], replicas: Sequence[bool], every: Sequence[str],
                        process_group: dist.ProcessGroup, device: torch.device) -> None:
    """Replicas' gradients differ between ranks: every rank raises the same error, naming the
    first such parameter and its gradient norm on two ranks (an all-gather of every rank's
    replica norms; every rank comes here together)."""
    positions = [i for i, r in enumerate(replicas) if r]
    grads = [params[i].grad for i in positions]
    norms = torch.stack(grad_norms([g if g is not None else torch.zeros(0, device=device) for g in grads])).tolist()
    mine = [n if g is not None else None for n, g in zip(norms, grads)]
    everyone = [json.loads(b) for b in all_gather_bytes(json.dumps(mine).encode(), process_group, device)]
    ranks = dist.get_process_group_ranks(process_group)

    def spread(k: int) -> tuple[tuple[int, float], tuple[int, float]]:
        """(rank, norm) of the lowest and the highest norm of replica ``k`` (ranks that have its gradient)."""
        seen = [(ranks[r], norms_of[k]) for r, norms_of in enumerate(everyone) if norms_of[k] is not None]
        return min(seen, key=lambda rn: rn[1]), max(seen, key=lambda rn: rn[1])

    with_grad = [(k, i) for k, i in enumerate(positions) if any(n[k] is not None for n in everyone)]
    unused = [every[i] for k, i in enumerate(positions) if all(n[k] is None for n in everyone)]
    spreads = [(i, *spread(k)) for k, i in with_grad]
    # the first replica that differs (only the sums may have, by rounding at the tolerance's edge)
    i, low, high = next((s for s in spreads if not _close(s[1][1], s[2][1])), spreads[0])
    hint = (f" Under DDP, parameters the forward pass does not use ({unused}) keep DDP from averaging the "
            "gradients of their buckets: pass find_unused_parameters=True to DistributedDataParallel, or leave them "
            "out of the model." if unused else "")
    raise ValueError(
        f"Muon parameter {every[i]!r} is a plain tensor, which dmuon takes for a replica held whole on every rank "
        f"of its process group (ranks {ranks}), but its gradient differs between them (norm {low[1]:.6g} on rank "
        f"{low[0]}, {high[1]:.6g} on rank {high[0]}): the ranks do not hold copies of one model. Pass the ranks "
        "that do as process_group= (dmuon.Muon(ddp_model) takes a DDP model's own), or average the gradients "
        f"across the ranks (DDP) before step().{hint}")


def _close(low: float, high: float) -> bool:
    """Two ranks' norms of one replica agree to rounding (an overflowed norm equals only another)."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return low == high
    return high - low <= REPLICA_RTOL * abs(high)


def _confirm_nonfinite(grads: Sequence[Tensor], suspect: Tensor | None, process_group: dist.ProcessGroup | None,
                       device: torch.device, counter: CommCounter) -> list[int] | None:
    """After some rank's quick look flagged gradients: the positions in ``grads`` of this
    rank's truly non-finite ones, or None when no rank has any (huge finite gradients are then
    stepped). Every rank comes here together, so its one all-reduce matches; it runs only on
    this rare path."""
    flagged = [k for k, s in enumerate(suspect.tolist()) if s] if suspect is not None else []
    exact = finite_flags([grads[k] for k in flagged]).tolist() if flagged else []
    mine = [k for k, ok in zip(flagged, exact) if not ok]
    found = bool(mine)
    if process_group is not None:
        found = all_reduce_max(torch.tensor([float(found)], device=device), process_group, counter).item() > 0
    return mine if found else None
