"""Multi-process test harness: run a function on every rank of a gloo process group.

Spawning workers and importing torch costs seconds, so each (world size, collective
timeout) gets one persistent pool of worker processes, created on first use and
reused by every later test.  A pool is thrown away after any failure, because its
ranks may be left out of step (one rank still inside a collective, another not).

Design choices, and why:

* ``spawn`` start method: forking a process that already runs torch threads is unsafe.
* The pytest process hosts the rendezvous ``TCPStore`` on port 0, so the OS picks a
  free port and no port can be stolen between choosing it and binding it.
* A short gloo timeout (``DMUON_TEST_COLLECTIVE_TIMEOUT``, default 20 s) turns a rank
  stuck in a collective into an exception within seconds instead of 30 minutes.
* Tasks and results cross the pipes as plain pickles (by value), so tensors need no
  shared-memory handles; exceptions cross as formatted tracebacks, since exception
  objects are not always picklable.
* Each worker's stdout/stderr (including C++ and faulthandler output, e.g. from an
  abort) goes to a log file of its pool; what a failing call wrote is put into the
  ``WorkerError`` message, so the output sits next to the failure, not lost in
  pytest's capture of some other test.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

WORLD_SIZES = (1, 2, 3, 4)

_HOST = "127.0.0.1"
_DEFAULT_COLLECTIVE_TIMEOUT_S = 20.0
# Extra time the parent waits beyond the collective timeout, so that a rank stuck in a
# collective normally reports gloo's own timeout error rather than a bare "no answer".
_RESULT_MARGIN_S = 30.0
# Generous: covers spawning and importing torch on a loaded machine.
_STARTUP_TIMEOUT_S = 120.0
_LOG_TAIL_CHARS = 8000


class WorkerError(RuntimeError):
    """A rank raised, died or did not answer; ``ranks`` lists the failing ranks."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def default_collective_timeout_s() -> float:
    """The gloo timeout of pools that do not ask for another one."""
    return float(os.environ.get("DMUON_TEST_COLLECTIVE_TIMEOUT", _DEFAULT_COLLECTIVE_TIMEOUT_S))


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float | None = None,
    collective_timeout_s: float | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank; return the results indexed by rank.

    ``fn`` must be importable by name (a module-level function), because the workers
    are spawned processes.  It runs with the default gloo process group initialised.
    ``collective_timeout_s`` selects the pool with that gloo timeout (default:
    ``DMUON_TEST_COLLECTIVE_TIMEOUT`` or 20 s); ``timeout_s`` bounds the wait for all
    results (default: collective timeout + 30 s).  The two names are reserved: they
    are never forwarded to ``fn``.

    Raises ``WorkerError`` naming the failing rank(s), with their tracebacks and
    output, if any rank raised, died or did not answer in time; the pool is then torn
    down and the next call gets a fresh one.
    """
    if collective_timeout_s is None:
        collective_timeout_s = default_collective_timeout_s()
    if timeout_s is None:
        timeout_s = collective_timeout_s + _RESULT_MARGIN_S
    payload = pickle.dumps((fn, args, kwargs))  # before any rank starts: all or none
    pool = _get_pool(world_size, collective_timeout_s)
    try:
        return pool.run(payload, getattr(fn, "__qualname__", repr(fn)), timeout_s)
    except BaseException:
        # Whatever went wrong (including Ctrl-C while waiting), the ranks are out of step.
        _discard_pool(pool)
        raise


def shutdown_pools() -> None:
    """Stop every pool cleanly; called at the end of the pytest session.

    All pools are told to stop before any is waited for, so that their workers'
    interpreter shutdowns (about a second each with torch loaded) overlap.
    """
    pools = list(_POOLS.values())
    _POOLS.clear()
    for pool in pools:
        pool.request_stop()
    for pool in pools:
        pool.reap()


_PoolKey = tuple[int, float]
_POOLS: dict[_PoolKey, _Pool] = {}


def _get_pool(world_size: int, collective_timeout_s: float) -> _Pool:
    key = (world_size, collective_timeout_s)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _Pool(world_size, collective_timeout_s)
        _POOLS[key] = pool
    return pool


def _discard_pool(pool: _Pool) -> None:
    if _POOLS.get(pool.key) is pool:
        del _POOLS[pool.key]
    pool.kill()


class _Pool:
    """``world_size`` spawned workers sharing one default process group."""

    def __init__(self, world_size: int, collective_timeout_s: float) -> None:
        self.key: _PoolKey = (world_size, collective_timeout_s)
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self._log_dir = tempfile.mkdtemp(prefix=f"dmuon-pool-w{world_size}-")
        # Hosted here, in the pytest process: port 0 lets the OS pick a free port.
        store = dist.TCPStore(_HOST, 0, None, True, wait_for_workers=False)
        self._store: dist.TCPStore | None = store
        ctx = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, world_size, store.port, collective_timeout_s,
                          child_end, self._log_path(rank)),
                    name=f"dmuon-w{world_size}-rank{rank}",
                )
                proc.start()
                child_end.close()
                self._conns.append(parent_end)
                self._procs.append(proc)
            self._collect("start-up", [0] * world_size, _STARTUP_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise

    def run(self, payload: bytes, name: str, timeout_s: float) -> list[Any]:
        offsets = [os.path.getsize(self._log_path(r)) for r in range(self.world_size)]
        for conn in self._conns:
            try:
                conn.send(("run", payload))
            except OSError:
                pass  # the worker is dead; _collect reports how it died
        return self._collect(name, offsets, timeout_s)

    def _collect(self, name: str, log_offsets: list[int], timeout_s: float) -> list[Any]:
        """Wait for one answer per rank; raise on the first failure(s) seen.

        Failures are reported as soon as they are seen, without waiting for the other
        ranks: those are often stuck in a collective with the failed rank.
        """
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                silent = {r: f"did not answer within {timeout_s:g} s" for r in sorted(pending)}
                raise self._error(name, silent, log_offsets)
            waitables = [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending]
            ready = multiprocessing.connection.wait(waitables, remaining)
            failures: dict[int, str] = {}
            for rank in sorted(pending):
                if self._conns[rank] not in ready and self._procs[rank].sentinel not in ready:
                    continue
                try:
                    status, value = self._conns[rank].recv()
                except (EOFError, OSError):
                    failures[rank] = self._death_reason(rank)
                    continue
                pending.discard(rank)
                if status == "ok":
                    results[rank] = pickle.loads(value)
                else:
                    failures[rank] = f"raised:\n{value}"
            if failures:
                raise self._error(name, failures, log_offsets)
        return results

    def _death_reason(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(timeout=5)
        code = proc.exitcode
        if code is not None and code < 0:
            return f"died from signal {signal.Signals(-code).name}"
        return f"died (exit code {code})"

    def _error(self, name: str, failures: dict[int, str], log_offsets: list[int]) -> WorkerError:
        ranks = sorted(failures)
        parts = [f"{name} failed on rank(s) {ranks} of world size {self.world_size}"]
        for rank in ranks:
            parts.append(f"--- rank {rank} {failures[rank]}")
            output = self._read_log(rank, log_offsets[rank])
            if output:
                parts.append(f"--- rank {rank} output:\n{output}")
        return WorkerError("\n".join(parts), ranks)

    def _read_log(self, rank: int, offset: int) -> str:
        try:
            with open(self._log_path(rank), errors="replace") as f:
                f.seek(offset)
                text = f.read()
        except OSError:
            return ""
        if len(text) > _LOG_TAIL_CHARS:
            text = "[...]" + text[-_LOG_TAIL_CHARS:]
        return text.rstrip()

    def _log_path(self, rank: int) -> str:
        return os.path.join(self._log_dir, f"rank{rank}.log")

    def request_stop(self) -> None:
        """Ask every rank to leave the process group together and exit."""
        try:
            for conn in self._conns:
                conn.send(("stop", None))
        except OSError:
            pass  # a worker is gone already; reap() kills the rest

    def reap(self) -> None:
        """Wait for the workers to exit after ``request_stop``, killing stragglers."""
        deadline = time.monotonic() + self.collective_timeout_s + 10
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Terminate whatever still runs and release every resource of the pool."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None
        shutil.rmtree(self._log_dir, ignore_errors=True)


def _worker_main(rank: int, world_size: int, port: int, collective_timeout_s: float,
                 conn: Connection, log_path: str) -> None:
    """Entry point of a worker: join the process group, then serve tasks until told to stop."""
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    sys.stdout.reconfigure(line_buffering=True)
    faulthandler.enable()  # a Python stack in the log if the worker aborts or segfaults
    torch.set_num_threads(1)  # 2-core machines run up to 10 workers at once

    try:
        store = dist.TCPStore(_HOST, port, world_size, False,
                              timeout=datetime.timedelta(seconds=_STARTUP_TIMEOUT_S))
        # All ranks arrive here before gloo connects, so slow imports on a loaded machine
        # cannot exceed a short collective timeout during initialisation.
        store.set(f"arrived/{rank}", "1")
        store.wait([f"arrived/{r}" for r in range(world_size)])
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", pickle.dumps(None)))

    while True:
        try:
            command, payload = conn.recv()
        except EOFError:  # the pytest process is gone
            return
        if command == "stop":
            dist.barrier()  # destroying while a peer still talks to us races
            dist.destroy_process_group()
            return
        try:
            fn, args, kwargs = pickle.loads(payload)
            answer = ("ok", pickle.dumps(fn(*args, **kwargs)))
        except BaseException:
            answer = ("error", traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(answer)


# Backstop for use outside pytest: multiprocessing joins live children at exit, and
# idle workers only exit when told to, so an unstopped pool would hang the exit.
atexit.register(shutdown_pools)
