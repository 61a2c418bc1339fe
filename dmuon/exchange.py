"""The collectives DMuon issues — all of them, in this one module — with byte accounting.

Every exchange is one packed ``all_to_all_single`` with exact split sizes: a rank's sends to
each peer are laid end to end in one buffer, so uneven and empty pieces need no padding, and a
rank with nothing to send still takes part (with zero-length splits), keeping every rank's
sequence of collectives identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass
class CommCounter:
    """Bytes this rank sent to *other* ranks, and how many collectives it issued."""

    bytes_sent: int = 0
    collectives: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0
        self.collectives = 0


@dataclass
class PendingExchange:
    """An all-to-all in flight; ``wait()`` returns the received pieces, one list per source."""

    output: Tensor
    recv_splits: list[int]
    work: dist.Work

    def wait(self) -> list[Tensor]:
        self.work.wait()
        return list(self.output.split(self.recv_splits))


def start_all_to_all(
    pieces_by_dest: list[list[Tensor]],
    recv_splits: list[int],
    group: dist.ProcessGroup,
    my_position: int,
    dtype: torch.dtype,
    counter: CommCounter,
) -> PendingExchange:
    """Send ``pieces_by_dest[q]`` (flat tensors, concatenated) to position q of ``group`` and
    receive ``recv_splits[q]`` elements from each q, asynchronously. Bytes a rank addresses to
    itself are not counted as sent."""
    send_splits = [sum(t.numel() for t in pieces) for pieces in pieces_by_dest]
    flat = [t.reshape(-1).to(dtype) for pieces in pieces_by_dest for t in pieces]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype)
    output = torch.empty(sum(recv_splits), dtype=dtype, device=send.device)
    counter.bytes_sent += (sum(send_splits) - send_splits[my_position]) * send.element_size()
    counter.collectives += 1
    work = dist.all_to_all_single(
        output, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
        group=group, async_op=True,
    )
    return PendingExchange(output, recv_splits, work)


def all_reduce_max(values: Tensor, group: dist.ProcessGroup | None, counter: CommCounter | None = None) -> Tensor:
    """Element-wise maximum over the group, in place (flags agreed before any work, the slowest
    rank's time)."""
    if group is not None:
        _count(counter, values.numel() * values.element_size())
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return values


def all_reduce_sum(values: Tensor, group: dist.ProcessGroup | None, counter: CommCounter | None = None) -> Tensor:
    """Sum over the group, in place (distributed Newton–Schulz's norms and partial Gram matrices,
    job-wide statistics and gradient norms)."""
    if group is not None:
        _count(counter, values.numel() * values.element_size())
        dist.all_reduce(values, group=group)
    return values


def start_all_reduce_sum(values: Tensor, group: dist.ProcessGroup, counter: CommCounter | None = None) -> dist.Work:
    """:func:`all_reduce_sum`, asynchronously (replicated gradients under owner sharding)."""
    _count(counter, values.numel() * values.element_size())
    return dist.all_reduce(values, group=group, async_op=True)


def start_broadcast(values: Tensor, src: int, group: dist.ProcessGroup, counter: CommCounter | None = None
                    ) -> dist.Work:
    """Broadcast from global rank ``src``, asynchronously; the sender counts one copy per receiver."""
    sent = values.numel() * values.element_size() * (dist.get_world_size(group) - 1)
    _count(counter, sent if dist.get_rank() == src else 0)
    return dist.broadcast(values, src=src, group=group, async_op=True)


def start_reduce(values: Tensor, dst: int, group: dist.ProcessGroup, counter: CommCounter | None = None) -> dist.Work:
    """Sum onto global rank ``dst``, asynchronously; every other rank counts its contribution."""
    _count(counter, 0 if dist.get_rank() == dst else values.numel() * values.element_size())
    return dist.reduce(values, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)


def _count(counter: CommCounter | None, nbytes: int) -> None:
    if counter is not None:
        counter.bytes_sent += nbytes
        counter.collectives += 1


def check_ranks_agree(fingerprint: dict[str, str], group: dist.ProcessGroup, what: str) -> None:
    """Raise the same ValueError on every rank of ``group`` if any rank's ``fingerprint`` differs
    from rank 0's, naming the first differing key (one collective; run before any other)."""
    everyone: list[dict[str, str]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(everyone, fingerprint, group=group)
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):  # the same verdict on every rank
        for key in sorted(set(first) | set(theirs)):
            if first.get(key) != theirs.get(key):
                raise ValueError(
                    f"Ranks disagree on the {what}: {key} is {first.get(key)} on rank 0 but "
                    f"{theirs.get(key)} on rank {rank}."
                )
