"""Ranks agree before any data moves: one small all-reduce at every collective entry point.

Every call that ranks make together — constructing the optimizer, ``add_param_group``,
``load_state_dict``, ``step`` — starts with one ``all_reduce(MAX)`` whose first
:data:`HEADER_LEN` elements say, on each rank, *which* call this is, a 63-bit digest of the
configuration the call would run with, and whether the rank already failed locally. Carrying
``x`` and ``−x`` gives every rank both the maximum and the minimum of each field, so one
collective tells every rank whether all ranks are in the same call, with the same
configuration, and error-free. Only when they are not does a second collective (an all-gather
of bytes) fetch the details for the message — and then every rank raises the same error.

Why the call kind travels too: a rank that calls ``add_param_group`` alone would otherwise
sit in its agreement while the others enter ``step``'s collective, and hang. Both calls send
the same number of elements (the header plus one flag per Muon parameter and one more), so
the mismatched pair still completes and says what went wrong.

Fields are whole numbers below 2²⁴, exact in the float32 the step's flags travel in.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.elementwise import finite_flags, local, maybe_nonfinite
from dmuon.exchange import CommCounter, all_gather_bytes, all_reduce_max

Fingerprint = Sequence[tuple[str, str]]

ENTRIES = ("construction", "add_param_group", "load_state_dict", "step", "shard_by_owner")
HEADER_LEN = 9  # entry, −entry, three digest words and their negatives, failing rank + 1
_WORD_BITS = 21


def digest_words(fingerprint: Fingerprint) -> tuple[int, int, int]:
    """A 63-bit digest of ``fingerprint`` as three 21-bit words (exact in float32)."""
    data = json.dumps(list(fingerprint)).encode()
    value = int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1
    mask = (1 << _WORD_BITS) - 1
    return tuple((value >> (_WORD_BITS * i)) & mask for i in range(3))  # type: ignore[return-value]


def header(entry: str, words: tuple[int, int, int], failed: bool) -> list[float]:
    code = ENTRIES.index(entry) + 1
    fields = [code, -code]
    for w in words:
        fields += [w, -w]
    return [float(v) for v in fields] + [float(dist.get_rank() + 1 if failed else 0)]


def first_difference(fingerprints: Sequence[Fingerprint], what: str) -> str:
    """The message for ranks whose fingerprints differ: the first differing entry, in the order
    rank 0 lists them (then any entry only another rank has), with both values."""
    tables = [dict(f) for f in fingerprints]
    for rank, theirs in enumerate(tables[1:], start=1):
        keys = [k for k, _ in fingerprints[0]] + [k for k, _ in fingerprints[rank] if k not in tables[0]]
        for key in keys:
            ours, other = tables[0].get(key, "missing"), theirs.get(key, "missing")
            if ours != other:
                return f"Ranks disagree on the {what}: {key} is {ours} on rank 0 but {other} on rank {rank}."
    return f"Ranks disagree on the {what}, but no difference was found in its description."


def agree(
    entry: str,
    fingerprint: Fingerprint | None,
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    payload: Tensor | None = None,
    words: tuple[int, int, int] | None = None,
    error: BaseException | None = None,
    what: str = "optimizer configuration",
    counter: CommCounter | None = None,
) -> Tensor | None:
    """Run the agreement of one collective call; return ``payload`` MAX-reduced over ``group``.

    ``fingerprint`` describes the configuration (ordered (key, value) pairs; only its digest
    travels unless ranks differ); a caller that has the digest already passes ``words`` and
    may omit the fingerprint. ``error`` is this rank's own failure, if any: every other rank
    then raises a ValueError carrying its message (and this rank should re-raise it).
    Raises the same error on every rank when the ranks are in different calls, hold
    different configurations, or one of them failed.
    """
    if words is None:
        words = digest_words(fingerprint or ())
    values = header(entry, words, error is not None)
    local = torch.tensor(values, dtype=torch.float32, device=device)
    if payload is not None:
        local = torch.cat([local, payload.to(device=device, dtype=torch.float32)])
    reduced = all_reduce_max(local, group, counter)
    fields = reduced[:HEADER_LEN].tolist()  # the one host read
    codes = (int(fields[0]), -int(fields[1]))
    if codes[0] != codes[1]:
        low, high = sorted(ENTRIES[c - 1] for c in codes)
        raise RuntimeError(
            f"Ranks are in different optimizer calls: some called {low}, others {high}. "
            "Construction, add_param_group, load_state_dict and step are collective: call them on every rank, "
            "in the same order."
        )
    if fields[8] > 0:
        messages = all_gather_bytes(str(error or "").encode(), group, device)
        failed = next(r for r, m in enumerate(messages) if m)
        if error is not None:
            raise error
        raise ValueError(f"{messages[failed].decode()} (raised on rank {failed}; every rank stops here)")
    if any(fields[2 + 2 * i] != -fields[3 + 2 * i] for i in range(3)):
        if fingerprint is None:
            raise RuntimeError(f"Ranks disagree on the {what} (its digest differs between ranks).")
        everyone = all_gather_bytes(json.dumps(list(fingerprint)).encode(), group, device)
        raise ValueError(first_difference([json.loads(b.decode()) for b in everyone], what))
    return None if payload is None else reduced[HEADER_LEN:]


# What a rank's own part of a collective call raises for bad input: shared with the other ranks.
LOCAL_ERRORS = (ValueError, TypeError, NotImplementedError, KeyError)


def agreed_call(entry: str, local_part: Callable[[], Fingerprint], group: dist.ProcessGroup | None,
                device: Callable[[], torch.device], *, payload: Tensor | None = None) -> Fingerprint:
    """One collective entry point: this rank's ``local_part`` (its checks and changes, returning
    the fingerprint of the configuration they give), then the agreement over ``group``; the
    fingerprint, or on every rank the same error if a rank failed or the ranks differ.
    ``device`` is asked after ``local_part``, which may create the parameters it names."""
    error, fingerprint = None, []
    try:
        fingerprint = local_part()
    except LOCAL_ERRORS as err:
        error = err
    if group is not None:
        agree(entry, fingerprint, group, device(), payload=payload, error=error)
    if error is not None:
        raise error
    return fingerprint


def agree_on_gradients(groups: Sequence[dict], muon: Sequence[tuple], here: Sequence[bool], policy: str,
                       group: dist.ProcessGroup | None, device: torch.device, words: tuple[int, int, int],
                       counter: CommCounter, names: Callable[[], list[str]]) -> list[bool] | None:
    """Which Muon parameters of ``muon`` ((name, param, group, view)) to step, or None to skip
    the whole step; ``here``: whether this rank steps each (owner sharding).

    Under torch.distributed every rank must take the same decisions (or the collectives would
    not match), so the flags travel in the step's agreement all-reduce: the step is skipped if
    any rank saw a non-finite gradient (``policy`` "skip"; "raise" raises on every rank;
    "ignore" checks nothing), and a Muon parameter is stepped only if every rank has its
    gradient. The flags stay on the device until that all-reduce: reading its result is the
    step's one host synchronization (on CUDA; none follows).
    """
    params = [p for g in groups for p in g["params"]]
    mine = {id(p): ok for (_, p, _, _), ok in zip(muon, here)}
    checked = [i for i, p in enumerate(params) if p.grad is not None and mine.get(id(p), True)]
    grads = [local(params[i].grad) for i in checked]
    sparse = next((i for i, g in zip(checked, grads) if g.is_sparse), None)
    error, suspect = None, None
    if sparse is not None:  # before any reduction (none runs on sparse tensors), shared with the other ranks
        error = RuntimeError(f"Muon does not support sparse gradients: {names()[sparse]!r} has one. Use dense "
                             "gradients (e.g. nn.Embedding(..., sparse=False)).")
    elif policy != "ignore" and checked:
        suspect = maybe_nonfinite(grads)
    # an owner-sharded parameter's gradient is its owner's business alone: others report none missing
    no_grad = torch.tensor([float(p.grad is None and ok) for (_, p, _, _), ok in zip(muon, here)])
    if device.type == "cuda":  # from pinned memory the copy does not wait for the step's kernels
        no_grad = no_grad.pin_memory().to(device, non_blocking=True)
    bad = suspect.any().reshape(1) if suspect is not None else torch.zeros(1, dtype=torch.bool)
    flags = torch.cat([bad.to(device=device, dtype=torch.float32), no_grad.to(device)])
    if group is not None:  # the agreement's header travels with the flags, in one all-reduce
        flags = agree("step", None, group, device, payload=flags, words=words, error=error, counter=counter)
    if error is not None:
        raise error
    agreed = flags.tolist()  # the one host read
    # the quick look flags huge finite gradients too: the exact check of those decides
    nonfinite = _confirm_nonfinite(grads, suspect, group, device, counter) if agreed[0] > 0 else None
    if nonfinite is not None:
        every = names()
        where = [every[checked[k]] for k in nonfinite] or ["another rank's parameters"]
        if policy == "raise":
            raise FloatingPointError(f"Non-finite gradients in {where}.")
        warnings.warn(f"Muon skipped a step: non-finite gradients in {where}.", stacklevel=4)
        return None
    partial = [name for (name, p, _, _), ok, missing in zip(muon, here, agreed[1:])
               if missing and p.grad is not None and ok] if any(agreed[1:]) else []
    if partial:
        warnings.warn(f"Muon left {partial} alone: some ranks have no gradient for them.", stacklevel=4)
    return [not missing and ok for ok, missing in zip(here, agreed[1:])]


def _confirm_nonfinite(grads: Sequence[Tensor], suspect: Tensor | None, group: dist.ProcessGroup | None,
                       device: torch.device, counter: CommCounter) -> list[int] | None:
    """After some rank's quick look flagged gradients: the positions in ``grads`` of this
    rank's truly non-finite ones, or None when no rank has any (huge finite gradients are then
    stepped). Every rank comes here together, so its one all-reduce matches; it runs only on
    this rare path."""
    flagged = [k for k, s in enumerate(suspect.tolist()) if s] if suspect is not None else []
    exact = finite_flags([grads[k] for k in flagged]).tolist() if flagged else []
    mine = [k for k, ok in zip(flagged, exact) if not ok]
    found = bool(mine)
    if group is not None:
        found = all_reduce_max(torch.tensor([float(found)], device=device), group, counter).item() > 0
    return mine if found else None
