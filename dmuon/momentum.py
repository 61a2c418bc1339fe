"""Muon's momentum buffers as they are kept: in the parameter's dtype, in a float dtype of their
own (``momentum_dtype="bfloat16"`` or ``"float32"``), or in 8-bit blocks (``momentum_dtype="int8"``).

8-bit blocks. Each row of a buffer (its last dim) is cut into blocks of :data:`BLOCK` columns,
counted from column 0; a block keeps one fp32 scale, its largest magnitude / 127, and one int8
code per element, ``round(value / scale)``. That is 1 + 4/BLOCK bytes per weight, where fp32
momentum takes 4. A step decodes the buffer into fp32, computes the momentum there from the
gradient, uses that value as it would use fp32 momentum, and stores it encoded again: the only
rounding the 8-bit format adds is the store's, and it is the same wherever a block is stored,
since a block is encoded from its own elements alone.

Where the blocks lie. The codes (``momentum_buffer``) are shaped and placed as the parameter;
the scales (``momentum_scale``) as the parameter with its last dim counted in blocks. Every
split of another dim (FSDP2's dim 0, column-wise TP, expert stacks) hands each rank whole
blocks, and a split of the last dim (row-wise TP) does where each rank's columns start at a
multiple of BLOCK and torch's chunking of the scales gives each rank the scales of its own
blocks; :func:`split_error` refuses a layout where it does not. ``torch.distributed.checkpoint``
then reshards codes and scales as any other state, and a block's values survive bit for bit.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from dmuon.layout import last_dim_splits, placed_like
from dmuon.tensors import local

BLOCK = 128  # columns per 8-bit block
BLOCKWISE = "int8"  # the momentum_dtype of 8-bit blocks
SCALE_KEY = "momentum_scale"
_LEVELS = 127  # the largest code: symmetric, so that -x is coded as -code(x)


def scale_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The scales' shape for a buffer of ``shape``: its last dim counted in blocks."""
    return (*shape[:-1], math.ceil(shape[-1] / BLOCK))


def encode(value: Tensor) -> tuple[Tensor, Tensor]:
    """``value`` (any float dtype, last dim the columns) as int8 codes and fp32 block scales."""
    blocks = _blocks(value.float())
    scales = blocks.abs().amax(-1) / _LEVELS
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block codes as zeros
    codes = torch.round(blocks / divisors.unsqueeze(-1)).clamp_(-_LEVELS, _LEVELS).to(torch.int8)
    return codes.flatten(-2)[..., :value.shape[-1]], scales


def decode(codes: Tensor, scales: Tensor) -> Tensor:
    """The fp32 values int8 ``codes`` with block ``scales`` stand for, contiguous (the step's
    kernels must see the same strides in every layout: on CPU a strided operand can take a loop
    that rounds differently)."""
    return (_blocks(codes).float() * scales.unsqueeze(-1)).flatten(-2)[..., :codes.shape[-1]].contiguous()


def _blocks(value: Tensor) -> Tensor:
    """``value``'s last dim as (blocks, BLOCK), the last block padded with zeros (a view where
    the columns fill whole blocks)."""
    pad = -value.shape[-1] % BLOCK
    padded = F.pad(value, (0, pad)) if pad else value
    return padded.reshape(*padded.shape[:-1], padded.shape[-1] // BLOCK, BLOCK)  # (an empty shard too)


def split_error(param: Tensor) -> str | None:
    """Why ``param``'s layout cuts its 8-bit blocks between ranks, or None where every rank holds
    whole blocks and, for each, its scales (see the module's docstring)."""
    splits = last_dim_splits(param)
    if not splits:
        return None
    if len(splits) > 1 or not splits[0][1]:
        return (f"its last dim is split over {len(splits)} mesh dims" if len(splits) > 1
                else "its last dim is split in strided chunks (_StridedShard)")
    size, columns = splits[0][0], param.shape[-1]
    # torch cuts the columns into chunks of ceil(columns / size), and the scales' blocks likewise
    chunk, blocks_chunk = math.ceil(columns / size), math.ceil(math.ceil(columns / BLOCK) / size)
    if size > 1 and chunk != blocks_chunk * BLOCK:
        return (f"its last dim of {columns} is split over {size} ranks at {chunk} columns each, where whole blocks "
                f"of {BLOCK} would need {blocks_chunk * BLOCK}")
    return None


def zeros(param: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """A zero momentum state for ``param`` kept in ``dtype`` (torch.int8: 8-bit blocks)."""
    buffer = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
    if dtype != torch.int8:
        return {"momentum_buffer": buffer}
    scales = torch.zeros(scale_shape(local(param).shape), device=param.device)  # this rank's blocks' (split_error)
    return {"momentum_buffer": buffer, SCALE_KEY: placed_like(scales, param, scale_shape(param.shape))}


def converted(entry: dict[str, Tensor], param: Tensor, dtype: torch.dtype) -> dict[str, Tensor]:
    """``entry``'s momentum kept in ``dtype`` instead (a group's ``momentum_dtype`` changed)."""
    state = zeros(param, dtype)
    store(state, value(entry))
    return state


def value(entry: dict[str, Tensor]) -> Tensor:
    """This rank's momentum of ``entry`` as a step computes with it: the buffer itself (written
    in place), or the 8-bit buffer decoded into a new fp32 tensor (stored back by :func:`store`)."""
    if SCALE_KEY not in entry:
        return local(entry["momentum_buffer"])
    return decode(local(entry["momentum_buffer"]), local(entry[SCALE_KEY]))


def store(entry: dict[str, Tensor], new: Tensor) -> None:
    """Keep ``new`` as ``entry``'s momentum (encoded into 8-bit blocks where it is kept so); a
    no-op for the buffer :func:`value` handed out, written in place."""
    buffer = local(entry["momentum_buffer"])
    if SCALE_KEY in entry:
        codes, scales = encode(new)
        buffer.copy_(codes)
        local(entry[SCALE_KEY]).copy_(scales)
    elif new is not buffer:
        buffer.copy_(new)

