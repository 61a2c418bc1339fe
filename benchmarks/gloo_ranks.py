"""Gloo ranks for the benchmark scripts: ``on_gloo_ranks(world, fn, *args)`` spawns ``world``
processes on this machine, runs ``fn(rank, world, results, *args)`` in each (one intra-op thread),
and returns what they wrote into ``results``, a dict they share."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def on_gloo_ranks(world: int, fn: Callable[..., None], *args: Any) -> dict:
    with mp.Manager() as manager:
        shared = manager.dict()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_rank, args=(world, port, fn, args, shared), nprocs=world)
        return dict(shared)


def _rank(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        fn(rank, world, results, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
