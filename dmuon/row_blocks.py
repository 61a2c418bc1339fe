"""Fused weights' row blocks: which rows of a matrix Newton–Schulz orthogonalizes as one matrix
(a group's ``ns_blocks``). Pure.

A fused weight holds several matrices in one tensor: QKV, gate and up, a K and a V block per
head. Muon must orthogonalize each on its own. ``ns_blocks`` says which rows belong together:

- ``None``: the whole matrix;
- an int k: blocks of k consecutive rows (per head, say);
- row counts ``[q, kv, kv]``: consecutive blocks of those sizes;
- :func:`per_head` ``(heads, sizes)``: per head, consecutive blocks of ``sizes`` (DeepSeek's and
  Kimi's ``wkv_b``: a K block and a V block per head, 2·heads matrices);
- :func:`interleaved` ``(k)``: every k-th row, k blocks (a ``w13`` that stores the rows of w1 and
  w3 alternately: block 0 is rows 0, 2, 4, …);
- explicit row-index lists ``[[0, 2, 4], [1, 3, 5]]``, which must cover every row exactly once.

Every pattern is a row order and consecutive block sizes: the owner of a matrix, which holds it
whole, takes its rows in that order, orthogonalizes consecutive blocks, and puts the rows back.
Moving rows is exact, so a pattern is exact wherever the matrix's rows live — on one rank or cut
across FSDP2 shards, tensor-parallel ranks or pieces. Patterns count the matrix's global rows
(a DTensor's, not one rank's shard).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def interleaved(k: int) -> dict[str, int]:
    """``ns_blocks`` for a weight whose k fused matrices alternate row by row: block j is rows
    j, j + k, j + 2k, … (a plain value, so a param group holding it saves and loads as is).

    Args:
        k: how many matrices alternate (2 for a ``w13`` of w1 and w3 rows).
    """
    return {"interleaved": k}


def per_head(heads: int, sizes: Sequence[int]) -> dict[str, Any]:
    """``ns_blocks`` for a weight that holds, for each head in turn, consecutive blocks of
    ``sizes`` rows (``per_head(h, [k_dim, v_dim])``: a K and a V matrix per head).

    Args:
        heads: how many heads the weight holds, one after the other.
        sizes: the rows of each of one head's blocks, in order.
    """
    return {"heads": heads, "per_head": list(sizes)}


@dataclass(frozen=True)
class RowBlocks:
    """A pattern for an m-row matrix: the rows block by block (``order``; None: the matrix's own
    order), and each block's row count, in that order."""

    sizes: tuple[int, ...]
    order: tuple[int, ...] | None = None

    def indices(self) -> list[list[int]]:
        """The rows of each block."""
        order, start, out = self.order or range(sum(self.sizes)), 0, []
        for size in self.sizes:
            out.append(list(order[start: start + size]))
            start += size
        return out

    def describe(self) -> str:
        """A few words for the routing summary and plan tables."""
        return describe_blocks(self.sizes, by_index=self.order is not None)


def describe_blocks(sizes: Sequence[int], by_index: bool) -> str:
    """Blocks of ``sizes`` rows, in a few words; ``by_index``: rows taken by index, not in order."""
    if len(sizes) == 1:
        return "one block"
    shapes = (f"{sizes[0]} rows each" if len(set(sizes)) == 1
              else "of " + ", ".join(map(str, sizes[:6])) + (", …" if len(sizes) > 6 else "") + " rows")
    return f"{len(sizes)} blocks {shapes}{', rows by index' if by_index else ''}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def row_blocks(ns_blocks: Any, m: int) -> RowBlocks:
    """The blocks ``ns_blocks`` (module docstring) makes of an m-row matrix; ValueError where it
    does not cover every row exactly once."""
    if ns_blocks is None:
        return RowBlocks((m,))
    if _is_int(ns_blocks):
        if ns_blocks < 1 or m % ns_blocks:
            raise ValueError(f"Invalid ns_blocks={ns_blocks}: blocks of {ns_blocks} rows do not tile {m} rows.")
        return RowBlocks((ns_blocks,) * (m // ns_blocks))
    if isinstance(ns_blocks, dict):
        return _named(ns_blocks, m)
    if not isinstance(ns_blocks, (list, tuple)):
        raise ValueError(f"Invalid ns_blocks={ns_blocks!r}. Must be None, an int, row counts, row-index lists, "
                         "dmuon.interleaved(k) or dmuon.per_head(heads, sizes).")
    blocks = list(ns_blocks)
    if blocks and all(isinstance(b, (list, tuple)) for b in blocks):
        return _by_index(blocks, m)
    if not blocks or not all(_is_int(r) and r >= 1 for r in blocks) or sum(blocks) != m:
        raise ValueError(f"Invalid ns_blocks={blocks}: row counts must be positive ints adding up to {m} "
                         "(or row-index lists, one per block).")
    return RowBlocks(tuple(blocks))


def _named(pattern: dict[str, Any], m: int) -> RowBlocks:
    if set(pattern) == {"interleaved"}:
        k = pattern["interleaved"]
        if not _is_int(k) or k < 1 or m % k:
            raise ValueError(f"Invalid ns_blocks={pattern}: every {k}-th row does not make {k} blocks of "
                             f"equal size out of {m} rows.")
        return RowBlocks((m // k,) * k, tuple(row for j in range(k) for row in range(j, m, k)))
    if set(pattern) == {"heads", "per_head"}:
        heads, sizes = pattern["heads"], list(pattern["per_head"])
        if not _is_int(heads) or heads < 1 or not sizes or not all(_is_int(s) and s >= 1 for s in sizes):
            raise ValueError(f"Invalid ns_blocks={pattern}: heads must be a positive int and per_head positive "
                             "row counts.")
        if heads * sum(sizes) != m:
            raise ValueError(f"Invalid ns_blocks={pattern}: {heads} heads of {sum(sizes)} rows are "
                             f"{heads * sum(sizes)} rows, not {m}.")
        return RowBlocks(tuple(sizes) * heads)
    raise ValueError(f"Invalid ns_blocks={pattern}: a named pattern is dmuon.interleaved(k) or "
                     "dmuon.per_head(heads, sizes).")


def _by_index(blocks: list, m: int) -> RowBlocks:
    rows = [row for block in blocks for row in block]
    if not all(blocks) or not all(_is_int(r) for r in rows):
        raise ValueError("Invalid ns_blocks: row-index lists must be non-empty lists of ints.")
    outside = [r for r in rows if not 0 <= r < m]
    if outside:
        raise ValueError(f"Invalid ns_blocks: row {outside[0]} is outside the matrix's {m} rows.")
    seen: set[int] = set()
    repeated = [r for r in rows if r in seen or seen.add(r)]
    if repeated:
        raise ValueError(f"Invalid ns_blocks: row {repeated[0]} is in more than one block.")
    if len(seen) != m:
        missing = min(set(range(m)) - seen)
        raise ValueError(f"Invalid ns_blocks: row {missing} of {m} is in no block.")
    order = tuple(rows)
    if len(blocks) == 1:  # one block: the whole matrix, whatever order its rows were listed in
        return RowBlocks((m,))
    return RowBlocks(tuple(len(b) for b in blocks), None if order == tuple(range(m)) else order)


def pattern_rows(ns_blocks: Any) -> int | None:
    """The row count ``ns_blocks`` was written for, where it fixes one (row counts, per head,
    index lists); None for a block size or ``interleaved``, which fit many."""
    if ns_blocks is None or _is_int(ns_blocks):
        return None
    if isinstance(ns_blocks, dict):
        if set(ns_blocks) == {"heads", "per_head"} and _is_int(ns_blocks["heads"]):
            return ns_blocks["heads"] * sum(s for s in ns_blocks["per_head"] if _is_int(s))
        return None
    if not isinstance(ns_blocks, (list, tuple)):
        return None
    return sum(len(b) if isinstance(b, (list, tuple)) else b for b in ns_blocks if isinstance(b, (list, tuple, int)))


def plain_pattern(ns_blocks: Any) -> Any:
    """``ns_blocks`` as plain lists, ints and dicts (what a checkpoint of the param group holds)."""
    if isinstance(ns_blocks, dict):
        return {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in ns_blocks.items()}
    if ns_blocks is None or isinstance(ns_blocks, (int, str, bytes, Tensor)) or not hasattr(ns_blocks, "__iter__"):
        return ns_blocks  # a single value: row_blocks accepts an int, and names what else it got
    return [list(b) if isinstance(b, (list, tuple)) else b for b in ns_blocks]


def check_pattern(ns_blocks: Any, m: int, shard_rows: int | None, label: str) -> None:
    """Raise a ValueError naming the parameter (``label``) where ``ns_blocks`` does not cover its
    m rows exactly once; where it fits the ``shard_rows`` of this rank's shard instead, say so."""
    try:
        row_blocks(ns_blocks, m)
    except ValueError as err:
        hint = ""
        if shard_rows not in (None, m) and pattern_rows(ns_blocks) == shard_rows:
            hint = (f" It covers the {shard_rows} rows of this rank's shard: give ns_blocks over the matrix's "
                    f"{m} global rows (its owner orthogonalizes the matrix whole).")
        raise ValueError(f"{err} ({label}){hint}") from None


def to_blocks(x: Tensor, order: Tensor | None, dim: int) -> Tensor:
    """``x`` with its rows (along ``dim``) in the pattern's order: each block's rows together."""
    return x if order is None else x.index_select(dim, order)


def from_blocks(x: Tensor, order: Tensor | None, dim: int) -> Tensor:
    """The inverse of :func:`to_blocks`: rows back where the matrix holds them."""
    return x if order is None else torch.empty_like(x).index_copy_(dim, order, x)
