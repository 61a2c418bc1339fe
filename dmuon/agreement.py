"""Ranks agree before any data moves: one small all-reduce at every collective entry point.

Every call that ranks make together — constructing the optimizer, ``add_param_group``,
``load_state_dict``, ``step``, ``shard_by_owner`` — starts with one ``all_reduce(MAX)`` of a
header of :data:`HEADER_LEN` float32 values: *which* call this is, a 63-bit digest of what the
call depends on (the configuration; at ``step`` also the hyperparameters as they are now, the
number of steps taken and which optimizer this is), and whether the rank already failed
locally. Carrying ``x`` and ``−x`` gives every rank both the maximum and the minimum of each
field, so one collective tells every rank whether all ranks are in the same call, with the same
configuration, and error-free. Only when they are not does a second collective (an all-gather
of bytes) fetch the details for the message — and then every rank raises the same error.

The header has the same length at every entry point, so two ranks in different calls (one
constructing an optimizer, another stepping one) still complete the all-reduce together and
both learn what went wrong: a collective of mismatched sizes would abort the processes or leave
one waiting. A call may add fields of its own to the header (``CALL_FIELDS``): the step's —
whether some gradient may be non-finite, which parameters have no gradient, early start's code,
the replicas' gradient norms — are :mod:`dmuon.step.agreement`'s.

A failure on one rank before the agreement — any exception of the rank's local part — travels
as the failing rank's number, and every other rank raises an error carrying its message.

Fields are whole numbers below 2²⁴, exact in float32.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from dmuon.exchange import CommCounter, all_gather_bytes, all_reduce_max

Fingerprint = Sequence[tuple[str, str]]
Words = tuple[int, int, int]

ENTRIES = ("construction", "add_param_group", "load_state_dict", "step", "shard_by_owner", "QKClip")
_WORD_BITS = 21
# the header's fields, by position
_ENTRY, _DIGEST, _FAILED, _NUMBER = 0, 2, 8, 9
HEADER_LEN = 22
CALL_FIELDS = slice(10, HEADER_LEN)  # the fields a call adds of its own (the step's: dmuon.step.agreement)


def digest_words(fingerprint: Fingerprint) -> Words:
    """A 63-bit digest of ``fingerprint`` as three 21-bit words (exact in float32)."""
    data = json.dumps(list(fingerprint)).encode()
    value = int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1
    mask = (1 << _WORD_BITS) - 1
    return tuple((value >> (_WORD_BITS * i)) & mask for i in range(3))  # type: ignore[return-value]


def both_signs(values: Sequence[int]) -> list[int]:
    return [v for value in values for v in (value, -value)]


def differs(fields: Sequence[float], start: int, count: int) -> bool:
    """Whether the ``count`` (x, −x) pairs from ``start`` differ between ranks (max ≠ min)."""
    return any(fields[start + 2 * i] != -fields[start + 2 * i + 1] for i in range(count))


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


@dataclass(frozen=True)
class Agreed:
    """The header after the all-reduce, as every rank reads it."""

    fields: tuple[float, ...]

    @property
    def number(self) -> int:
        """The highest optimizer number any rank has issued (construction)."""
        return int(self.fields[_NUMBER])

    @property
    def call_fields(self) -> tuple[float, ...]:
        """The fields the call added of its own (``CALL_FIELDS``), all-reduced."""
        return self.fields[CALL_FIELDS]


# A failure on another rank is raised here as the same type where it is one of these (else RuntimeError).
_SHARED_TYPES = {t.__name__: t for t in (ValueError, TypeError, RuntimeError, KeyError, IndexError,
                                          NotImplementedError, FloatingPointError, AttributeError)}


def agree(
    entry: str,
    fingerprint: Fingerprint | Callable[[], Fingerprint] | None,
    process_group: dist.ProcessGroup,
    device: torch.device,
    *,
    words: Words | None = None,
    error: BaseException | None = None,
    what: str = "optimizer configuration",
    counter: CommCounter | None = None,
    number: int = 0,
    call_fields: Sequence[float] = (),
    device_fields: Sequence[tuple[int, Tensor]] = (),
) -> Agreed:
    """Run the agreement of one collective call over ``process_group``.

    ``fingerprint`` describes what the call depends on (ordered (key, value) pairs, or a
    function that lists them, called only when needed); only its digest travels unless ranks
    differ. A caller that has the digest already passes ``words``. ``error`` is this rank's own
    failure, if any: every other rank then raises an error of its type (a built-in one's, else
    RuntimeError) carrying its message, and this rank re-raises it. ``number`` is the
    construction's field; ``call_fields`` a call's own (at most 12, the rest zeros), and
    ``device_fields`` (position among them, float32 values on ``device``) those of them that are
    on the device already: written there, with no extra host sync.
    Raises the same error on every rank when the ranks are in different calls, hold different
    configurations, or one of them failed.
    """
    if words is None:
        words = digest_words(fingerprint() if callable(fingerprint) else fingerprint or ())
    code = ENTRIES.index(entry) + 1
    extra = [*call_fields, *[0] * (CALL_FIELDS.stop - CALL_FIELDS.start - len(call_fields))]
    values = [code, -code, *both_signs(words), dist.get_rank() + 1 if error is not None else 0, number, *extra]
    header = _header(values, device, device_fields)
    fields = tuple(all_reduce_max(header, process_group, counter).tolist())  # the one host read
    codes = (int(fields[_ENTRY]), -int(fields[_ENTRY + 1]))
    if codes[0] != codes[1]:
        low, high = sorted(ENTRIES[c - 1] for c in codes)
        raise RuntimeError(
            f"Ranks are in different optimizer calls: some called {low}, others {high}. "
            "Construction, add_param_group, load_state_dict, step and shard_by_owner are collective: call them "
            "on every rank, in the same order, on the same optimizer."
        )
    if fields[_FAILED] > 0:
        _raise_shared(error, process_group, device)
    if differs(fields, _DIGEST, 3):
        described = fingerprint() if callable(fingerprint) else fingerprint
        if described is None:
            raise RuntimeError(f"Ranks disagree on the {what} (its digest differs between ranks).")
        everyone = all_gather_bytes(json.dumps(list(described)).encode(), process_group, device)
        raise ValueError(first_difference([json.loads(b.decode()) for b in everyone], what))
    return Agreed(fields)


def _header(values: list[int], device: torch.device, device_fields: Sequence[tuple[int, Tensor]]) -> Tensor:
    """The header's fields on ``device``, the call's device-side ones (no host read) written in."""
    header = torch.tensor(values, dtype=torch.float32)
    if device.type == "cuda":  # from pinned memory the copy does not wait for the step's kernels
        header = header.pin_memory()
    header = header.to(device, non_blocking=True)
    for at, field_values in device_fields:
        start = CALL_FIELDS.start + at
        header[start:start + field_values.numel()] = field_values
    return header


def _raise_shared(error: BaseException | None, process_group: dist.ProcessGroup, device: torch.device) -> None:
    """Some rank failed: this rank's own error, or one of the failed rank's type with its message."""
    sent = f"{type(error).__name__}\n{error}".encode() if error is not None else b""
    messages = all_gather_bytes(sent, process_group, device)
    failed = next(r for r, m in enumerate(messages) if m)
    if error is not None:
        raise error
    kind, message = messages[failed].decode().split("\n", 1)
    raise _SHARED_TYPES.get(kind, RuntimeError)(f"{message} (raised on rank {failed}; every rank stops here)")


def agreed_call(entry: str, local_part: Callable[[], Fingerprint], process_group: dist.ProcessGroup | None,
                device: Callable[[], torch.device], *, number: int = 0,
                what: str = "optimizer configuration") -> tuple[Fingerprint, Agreed | None]:
    """One collective entry point: this rank's ``local_part`` (its checks and changes, returning
    the fingerprint of the configuration they give), then the agreement over ``process_group``; the
    fingerprint and the agreed header (None without one), or on every rank the same error
    if a rank failed or the ranks differ. ``device`` is asked after ``local_part``, which may
    create the parameters it names."""
    error, fingerprint = None, []
    try:
        fingerprint = local_part()
    except Exception as err:  # any failure: the other ranks must not be left waiting in the agreement
        error = err
    agreed = None
    if process_group is not None:
        agreed = agree(entry, fingerprint, process_group, device(), error=error, number=number, what=what)
    if error is not None:
        raise error
    return fingerprint, agreed


# The highest optimizer number issued in this process, per agreement group: construction makes
# the ranks agree on the next one, so that two optimizers are never taken for each other.
_NUMBERS: dict[str, int] = {}


def issued_number(process_group: dist.ProcessGroup) -> int:
    return _NUMBERS.get(process_group.group_name, 0)


def record_number(process_group: dist.ProcessGroup, number: int) -> None:
    _NUMBERS[process_group.group_name] = number


