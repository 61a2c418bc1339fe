"""A step's calls through dmuon's files: every chain of calls from ``Muon.step`` down crosses at
most 8 files, and none turns back into a file already on the chain (no callbacks into the
optimizer or the stepper), in one process and under FSDP2 and DDP."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

import dmuon
from tests.harness import run_on_ranks

ROOT = os.path.dirname(dmuon.__file__)
MAX_FILES = 8


def walk_of_a_step(layout: str, early_start: bool | None = False) -> tuple[list[str], dict[str, int]]:
    """The longest chain of distinct dmuon files on the call stack during one ``opt.step()``
    (the third: plans kept, early start armed), and each call into a file already on the
    chain below the caller's."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    if layout == "fsdp2":
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = dmuon.Muon(model, lr=0.01, early_start=early_start)
    for _ in range(2):
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        opt.zero_grad()
    model(torch.randn(4, 32)).sum().backward()
    stack: list[str | None] = []
    turns: dict[str, int] = {}
    longest: list[str] = []

    def profile(frame, event, arg) -> None:  # noqa: ANN001
        if event not in ("call", "return"):
            return
        if event == "return":
            if stack:
                stack.pop()
            return
        path = frame.f_code.co_filename
        here = os.path.relpath(path, ROOT) if path.startswith(ROOT) else None
        chain = list(dict.fromkeys(f for f in stack if f))
        if here is not None and chain and here != chain[-1] and here in chain:
            key = f"{chain[-1]} -> {here}:{frame.f_code.co_name}"
            turns[key] = turns.get(key, 0) + 1
        stack.append(here)
        if here is not None and here not in chain and len(chain) + 1 > len(longest):
            longest[:] = [*chain, here]

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return longest, turns


def check(longest: list[str], turns: dict[str, int]) -> None:
    assert longest[:2] == ["optimizer.py", "step/stepper.py"]
    assert len(longest) <= MAX_FILES, longest
    assert turns == {}


@pytest.mark.parametrize("early_start", [False, True])
def test_one_process(early_start):
    check(*walk_of_a_step("plain", early_start))


def walk_on_rank(layout: str) -> tuple[list[str], dict[str, int]]:
    return walk_of_a_step(layout)


@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_two_ranks(layout):
    for longest, turns in run_on_ranks(2, walk_on_rank, layout):
        check(longest, turns)
