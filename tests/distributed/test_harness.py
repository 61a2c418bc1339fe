"""Tests of the multi-process harness in ``tests/harness.py``."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from tests.harness import WORLD_SIZES, WorkerError, run_on_ranks

# Short gloo timeout for the hang test; a pool of its own, so others keep the default.
_SHORT_COLLECTIVE_TIMEOUT_S = 5.0


def _all_reduce_rank() -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _pid() -> int:
    return os.getpid()


def _raise_on_rank(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return dist.get_rank()


def _skip_collective_on_rank(skipping_rank: int) -> None:
    if dist.get_rank() != skipping_rank:
        dist.all_reduce(torch.ones(1))


def _abort_on_rank(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        os.abort()
    dist.all_reduce(torch.ones(1))


def _exit_on_rank(bad_rank: int) -> None:
    if dist.get_rank() == bad_rank:
        os._exit(3)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_of_rank(world_size: int) -> None:
    expected = world_size * (world_size - 1) / 2
    assert run_on_ranks(world_size, _all_reduce_rank) == [expected] * world_size


def test_pool_is_reused() -> None:
    """Workers persist across calls: respawning per test would cost seconds each."""
    pids = run_on_ranks(2, _pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert run_on_ranks(2, _pid) == pids


def test_exception_on_one_rank_names_it_and_pool_recovers() -> None:
    """The error points at the culprit, and the out-of-step pool is replaced."""
    old_pids = run_on_ranks(2, _pid)
    with pytest.raises(WorkerError) as excinfo:
        run_on_ranks(2, _raise_on_rank, 1)
    message = str(excinfo.value)
    assert excinfo.value.ranks == [1]
    assert "rank(s) [1]" in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert "Traceback" in message and "_raise_on_rank" in message

    assert run_on_ranks(2, _raise_on_rank, 5) == [0, 1]
    assert set(run_on_ranks(2, _pid)).isdisjoint(old_pids)


def test_skipped_collective_fails_within_collective_timeout() -> None:
    """A rank missing a collective is a bug to report in seconds, not a hung test run."""
    timeout = _SHORT_COLLECTIVE_TIMEOUT_S
    run_on_ranks(2, _pid, collective_timeout_s=timeout)  # spawn outside the timed part
    start = time.monotonic()
    with pytest.raises(WorkerError) as excinfo:
        run_on_ranks(2, _skip_collective_on_rank, 1, collective_timeout_s=timeout)
    elapsed = time.monotonic() - start
    assert excinfo.value.ranks == [0]  # rank 0 waited for rank 1 in all_reduce
    assert elapsed < timeout + 10


@pytest.mark.parametrize(
    "world_size, die, reason",
    [(2, _abort_on_rank, "died from signal SIGABRT"), (1, _exit_on_rank, "died (exit code 3)")],
)
def test_dead_worker_is_reported(world_size: int, die: Callable[[int], None], reason: str) -> None:
    """A crashed rank (as after a mismatched collective) fails the call instead of hanging it."""
    dying_rank = world_size - 1
    with pytest.raises(WorkerError) as excinfo:
        run_on_ranks(world_size, die, dying_rank)
    assert dying_rank in excinfo.value.ranks
    assert reason in str(excinfo.value)


def test_no_answer_within_timeout_s() -> None:
    """The parent's own deadline catches what no collective timeout can, e.g. a busy rank."""
    with pytest.raises(WorkerError, match="did not answer within 1 s") as excinfo:
        run_on_ranks(1, time.sleep, 30, timeout_s=1)
    assert excinfo.value.ranks == [0]
