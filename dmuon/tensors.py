"""Tiny tensor helpers every floor uses: this rank's piece of a tensor, the finite checks, and
the digests of a tensor's values (early start's check that a gradient is unchanged; the
fingerprint of unnamed replicas). Imports nothing of dmuon."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def local(tensor: Tensor) -> Tensor:
    """This rank's piece of a tensor: the local shard of a DTensor (a view: writes go through)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def label(name: str | None, tensor: Tensor) -> str:
    """A parameter as messages name it: its name, or for an unnamed one its shape."""
    return repr(name) if name is not None else f"of shape {tuple(tensor.shape)}"


def same_bits(pairs: Sequence[tuple[Tensor, Tensor]]) -> bool:
    """Whether the two tensors of every pair hold the same bits (NaNs alike; +0 and -0 differ),
    as one bool (one host sync for all the pairs)."""
    return same_bits_each(pairs)[0]


def same_bits_each(*pair_lists: Sequence[tuple[Tensor, Tensor]]) -> list[bool]:
    """For each list of pairs, whether the two tensors of every pair hold the same bits (NaNs
    alike; +0 and -0 differ), with one host sync for all the lists."""
    differs: list[Tensor | bool] = []
    for pairs in pair_lists:
        if any(a.shape != b.shape or a.dtype != b.dtype for a, b in pairs):
            differs.append(True)
            continue
        flags = [torch.ne(a.view(as_int), b.view(as_int)).any()
                 for a, b in pairs for as_int in [_INTEGER_OF_SIZE[a.element_size()]]]
        differs.append(torch.stack(flags).any() if flags else False)
    read = iter(torch.stack([d for d in differs if isinstance(d, Tensor)]).tolist()
                if any(isinstance(d, Tensor) for d in differs) else [])
    return [not (next(read) if isinstance(d, Tensor) else d) for d in differs]


def owns_its_memory(tensor: Tensor) -> bool:
    """Whether ``tensor`` is the whole of its storage (not a view into a larger buffer, whose
    other views share its version counter)."""
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


_INTEGER_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def digest(tensor: Tensor) -> Tensor:
    """Two sums that move when ``tensor``'s values change, for a check where version counters do
    not (GradScaler's unscaling, foreach ops on DTensors, writes through ``.data``): its bits
    read as integers of its item size and summed in that size (wrapping around), and its values
    summed; as one tensor of two such integers (no host sync; compare with :func:`same_bits`).

    Changing one element moves the bit sum (its integer reading changes by less than the wrap).
    Scaling by a power of two (unscaling) scales the value sum exactly, so moves it unless it is
    0; scaling by another factor moves both, unless by coincidence. A change that keeps both (a
    permutation) is not seen. Both sums stay in the tensor's own dtypes: on CPU an int64
    accumulator runs about 30 times slower."""
    as_int = _INTEGER_OF_SIZE[tensor.element_size()]
    values = tensor.sum() if tensor.is_floating_point() else tensor.sum(dtype=tensor.dtype)  # (int8 codes)
    return torch.stack([tensor.view(as_int).sum(dtype=as_int), values.view(as_int)])


def grad_norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Each tensor's 2-norm accumulated in its own precision (at least fp32), as 0-d tensors (no
    host sync): one ``torch._foreach_norm`` call. ``tensors`` must not be empty.

    A quick look for non-finite tensors (``~torch.stack(grad_norms(t)).isfinite()``): it is not finite for
    every tensor holding a NaN or ±inf, and also for huge finite ones whose squares overflow
    (|x| ≳ 1.8e19 in fp32); :func:`finite_flags` tells the two apart for the few it flags.
    Faster on CPU than the exact check in fp64 (``benchmarks/kernel_choices.py``)."""
    wide = any(t.dtype == torch.float64 for t in tensors)
    return list(torch._foreach_norm(list(tensors), 2, dtype=torch.float64 if wide else torch.float32))


def finite_flags(tensors: Sequence[Tensor]) -> Tensor:
    """Whether each tensor is all finite, exactly, as a bool vector (no host sync).

    A tensor is finite exactly when its 2-norm accumulated in fp64 is: NaN and ±inf propagate,
    and squares of fp32/bf16/fp16 values (below 3.4e38) cannot overflow fp64, so huge but finite
    tensors pass. fp64 tensors take the infinity norm instead (a maximum cannot overflow;
    ``torch._foreach_norm`` computes it slower on CPU). Empty tensors are finite."""
    if tensors and all(t.dtype != torch.float64 and t.numel() for t in tensors):  # the usual case: one call
        return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float64)).isfinite()
    flags = torch.ones(len(tensors), dtype=torch.bool, device=tensors[0].device if tensors else None)
    for wide in (False, True):
        chosen = [i for i, t in enumerate(tensors) if t.numel() and (t.dtype == torch.float64) == wide]
        if not chosen:
            continue
        picked = [tensors[i] for i in chosen]
        norms = torch._foreach_norm(picked, float("inf")) if wide else \
            torch._foreach_norm(picked, 2, dtype=torch.float64)
        finite = torch.stack(norms).isfinite()
        if len(chosen) == len(tensors):
            return finite
        flags[chosen] = finite
    return flags


# A position-weighted sum of a tensor's bits: equal values in another order give another digest.
_DIGEST_CHUNK = 1 << 22
_INTEGER_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MULTIPLIER, _OFFSET = -7046029254386353131, 7146057691288625177  # 0x9E3779B97F4A7C15 as int64, 0x632BE59BD9B4E019


def value_digest(t: Tensor) -> int:
    """A 64-bit digest of ``t``'s values, bit for bit and position by position: integer
    arithmetic modulo 2⁶⁴, so every rank gets the same number for the same bits whatever the
    order of the sums."""
    bits = t.detach().reshape(-1).view(_INTEGER_VIEWS[t.element_size()]).to(torch.int64)
    total = 0
    for start in range(0, bits.numel(), _DIGEST_CHUNK):
        chunk = bits[start: start + _DIGEST_CHUNK]
        positions = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device)
        weights = (positions * _MULTIPLIER + _OFFSET) | 1  # odd, wrapping in int64
        total = (total + int((chunk * weights).sum())) % (1 << 64)
    return total
