"""The collectives DMuon issues — all of them, in this one module — with byte accounting.

Every exchange is one packed ``all_to_all_single`` with exact split sizes: a rank's sends to
each peer are laid end to end in one buffer, so uneven and empty pieces need no padding, and a
rank with nothing to send still takes part (with zero-length splits), keeping every rank's
sequence of collectives identical.

Small host-side values (configuration fingerprints, timings, error messages) travel as byte
tensors too (:func:`all_gather_bytes`), never through torch's ``*_object`` collectives: those
convert through numpy, which is not one of dmuon's dependencies (the torch wheel does not pull
it in), and they would fail with "Numpy is not available" on a plain install.

The wrappers take a process group as ``group``, torch.distributed's own keyword; everywhere else
in dmuon a process group is ``process_group`` and ``group`` or ``param_group`` is a param group.
"""

from __future__ import annotations

import atexit
import functools
import math
import pickle
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

if dist.is_available():
    # torch.distributed.nn writes ``group.WORLD`` into its functions' defaults when first
    # imported, and torch.optim imports it (through torch._dynamo) when the first optimizer is
    # built. Imported then, after init_process_group, those defaults pin the default group for
    # the life of the interpreter: destroy_process_group cannot stop gloo's worker threads, and
    # one still releasing a finished collective's tensors when the interpreter shuts down aborts
    # the process ("terminate called without an active exception"). Imported here, with dmuon
    # and so usually before any process group exists, the defaults hold None.
    import torch.distributed.nn  # noqa: F401


# How long the interpreter waits at exit, GIL released, once this process ran a collective of
# dmuon's. A collective's worker thread (gloo's) releases the tensors of a finished collective
# after the caller has moved on; where it holds the last reference it needs the GIL to free
# them, and if the interpreter is shutting down by then the process aborts ("terminate called
# without an active exception": seen in a core dump as ~AsyncAlltoallWork in
# ProcessGroupGloo::runLoop waiting in take_gil during Py_FinalizeEx). A process group that
# outlives the script (held by torch.distributed.nn when it was first imported after
# init_process_group, as torch.optim does) keeps that thread alive until then.
EXIT_GRACE_SECONDS = 0.1


@functools.cache
def _grace_at_exit() -> None:
    """Once per process: let collective threads take the GIL and finish before the interpreter
    shuts down (an ``atexit`` handler runs before finalization)."""
    atexit.register(time.sleep, EXIT_GRACE_SECONDS)


class GroupRef:
    """A process group held weakly: ``ref()`` is the group (None for no group). An optimizer's
    plans and an owner sharding keep their process groups so, since a group that something
    still holds when ``destroy_process_group()`` runs is not freed, and its gloo threads then
    live on until the interpreter exits, where one of them can abort the process ("terminate
    called without an active exception")."""

    __slots__ = ("_ref",)

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self._ref = None if group is None else weakref.ref(group)

    def __call__(self) -> dist.ProcessGroup | None:
        if self._ref is None:
            return None
        group = self._ref()
        if group is None:
            raise RuntimeError("The process group dmuon was built on has been destroyed (destroy_process_group): "
                               "build the optimizer (or the owner sharding) again on the new process group.")
        return group


@dataclass
class CommCounter:
    """Bytes this rank sent to *other* ranks, and how many collectives it issued."""

    bytes_sent: int = 0
    collectives: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0
        self.collectives = 0


Shape = tuple[int, ...]


@dataclass
class PendingExchange:
    """An all-to-all in flight; ``wait()`` returns, per source position, the pieces it sent,
    shaped as announced."""

    output: Tensor
    shapes_by_source: list[list[Shape]]
    work: dist.Work

    def wait(self) -> list[list[Tensor]]:
        self.work.wait()
        received = self.output.split([sum(math.prod(s) for s in shapes) for shapes in self.shapes_by_source])
        return [list(zip_shapes(flat, shapes)) for flat, shapes in zip(received, self.shapes_by_source)]


def zip_shapes(flat: Tensor, shapes: list[Shape]):
    """Views of consecutive pieces of ``flat`` with the given shapes."""
    for piece, shape in zip(flat.split([math.prod(s) for s in shapes]), shapes):
        yield piece.view(shape)


def start_all_to_all(
    pieces_by_dest: list[list[Tensor]],
    shapes_by_source: list[list[Shape]],
    group: dist.ProcessGroup,
    my_position: int,
    dtype: torch.dtype,
    counter: CommCounter,
    device: torch.device | None = None,
) -> PendingExchange:
    """The one exchange pattern: send ``pieces_by_dest[q]`` (laid end to end, cast to ``dtype``)
    to position q of ``group``, and receive from each position q the pieces of
    ``shapes_by_source[q]``, asynchronously. Every rank calls it, also with nothing to send or
    receive (zero-length splits). Bytes a rank addresses to itself are not counted as sent."""
    send_splits = [sum(t.numel() for t in pieces) for pieces in pieces_by_dest]
    recv_splits = [sum(math.prod(s) for s in shapes) for shapes in shapes_by_source]
    send = pack([t for pieces in pieces_by_dest for t in pieces], dtype, device)
    output = torch.empty(sum(recv_splits), dtype=dtype, device=send.device)
    counter.bytes_sent += (sum(send_splits) - send_splits[my_position]) * send.element_size()
    counter.collectives += 1
    _grace_at_exit()
    work = dist.all_to_all_single(
        output, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
        group=group, async_op=True,
    )
    return PendingExchange(output, shapes_by_source, work)


def pack(pieces: Sequence[Tensor], dtype: torch.dtype, device: torch.device | None = None) -> Tensor:
    """``pieces`` flattened and laid end to end in one 1-D ``dtype`` buffer: a view where they
    already lie so (:func:`laid_end_to_end`), else one ``torch._foreach_copy_`` into a new buffer,
    which casts and reads strided pieces (an owner's transposed updates) in the same pass — a
    ``reshape(-1)`` first would copy each strided piece twice."""
    if not pieces:
        return torch.empty(0, dtype=dtype, device=device)
    view = laid_end_to_end(pieces) if all(t.dtype == dtype for t in pieces) else None
    if view is not None:
        return view
    numels = [t.numel() for t in pieces]
    send = torch.empty(sum(numels), dtype=dtype, device=pieces[0].device)
    torch._foreach_copy_([slot.view(t.shape) for slot, t in zip(send.split(numels), pieces)], list(pieces))
    return send


def laid_end_to_end(pieces: Sequence[Tensor]) -> Tensor | None:
    """One 1-D view of ``pieces`` where they are contiguous and already lie end to end in one
    storage (an owner's updates returned whole, as one batched Newton–Schulz call left them),
    else None: the send buffer then needs no copy."""
    first = pieces[0]
    storage, end = first.untyped_storage().data_ptr(), first.data_ptr()
    for t in pieces:
        if not t.is_contiguous() or t.data_ptr() != end or t.untyped_storage().data_ptr() != storage:
            return None
        end += t.numel() * t.element_size()
    return first.as_strided((sum(t.numel() for t in pieces),), (1,))


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
    """:func:`all_reduce_sum`, asynchronously (replicated gradients under owner sharding, DDP's
    buckets in dmuon's comm hook)."""
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
    """Count one collective (every one of dmuon's goes through here or start_all_to_all)."""
    _grace_at_exit()
    if counter is not None:
        counter.bytes_sent += nbytes
        counter.collectives += 1


def default_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device for a small collective on ``group`` when the caller names none: the current
    CUDA device for an NCCL group (NCCL takes only CUDA tensors), the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def job_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group an optimizer's ranks agree over (``process_group``, else the world), or None
    in a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return process_group or dist.group.WORLD


def collective_device(param_groups: Sequence[dict], process_group: dist.ProcessGroup | None) -> torch.device:
    """Where an optimizer's small collectives run: its parameters' device (NCCL groups take
    only CUDA tensors), else the backend's (also for parameters on the meta device, as a model
    is before ``to_empty``)."""
    device = next((p.device for g in param_groups for p in g["params"] if p.device.type != "meta"), None)
    if device is None:
        return default_device(process_group) if process_group is not None else torch.device("cpu")
    return device


def all_gather_bytes(data: bytes, group: dist.ProcessGroup, device: torch.device | None = None,
                     counter: CommCounter | None = None) -> list[bytes]:
    """Every rank's ``data``, indexed by position in ``group``: two all-gathers of tensors on
    ``device`` (the lengths as int64, then the bytes as uint8, padded to the longest)."""
    device = default_device(group) if device is None else torch.device(device)
    size = dist.get_world_size(group)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(size)]
    _count(counter, length.element_size() * (size - 1))
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in torch.cat(lengths).tolist()]
    longest = max(sizes)
    local = torch.zeros(longest, dtype=torch.uint8)
    if data:
        local[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    local = local.to(device)
    received = [torch.empty_like(local) for _ in range(size)]
    _count(counter, longest * (size - 1))
    dist.all_gather(received, local, group=group)
    return [bytes(t[:n].tolist()) for t, n in zip(received, sizes)]


def all_gather_object(obj: Any, group: dist.ProcessGroup, device: torch.device | None = None,
                      counter: CommCounter | None = None) -> list[Any]:
    """Every rank's ``obj`` (pickled: dmuon's own dicts from the ranks of one job), without
    numpy: :func:`all_gather_bytes` of the pickles."""
    return [pickle.loads(b) for b in all_gather_bytes(pickle.dumps(obj), group, device, counter)]


def new_subgroup(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A process group of ``ranks``, made by those ranks alone (``use_local_synchronization``:
    the others take no part), for a gang's distributed Newton–Schulz."""
    return dist.new_group(list(ranks), use_local_synchronization=True)
