"""The CUDA-only paths, checked on CPU with fake streams and events: which device's stream early
start waits on, and that a step's Newton–Schulz time waits for its end event before reading it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dmuon.step.early.run import Phase, Run
from dmuon.step.engine import Engine
from dmuon.strategies.base import StepStats

DEVICE = torch.device("cuda", 1)


class FakeStream:
    """A stream of ``DEVICE`` that records what it was made to wait for."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.waited_for = device, []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_for.append(other)


@pytest.fixture
def current_streams(monkeypatch) -> dict:
    """``torch.cuda.current_stream(device)`` faked: one stream per device asked for (None: the
    current device, cuda:0 in a process that never called set_device)."""
    streams: dict = {}

    def current_stream(device=None):
        device = torch.device("cuda", 0) if device is None else torch.device(device)
        return streams.setdefault(device, FakeStream(device))

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return streams


def early_run(stream: FakeStream) -> Run:
    run = Run.__new__(Run)
    run.order, run.next, run.reducing, run.stream, run.phase = [], None, None, stream, Phase.RUNNING
    run.stages = iter(())
    run.engine = Engine()
    return run


def test_early_start_waits_on_its_own_devices_stream(current_streams):
    """A process on cuda:1 that never called ``set_device(1)``: its run's stream waits for
    cuda:1's compute stream, and cuda:1's for the run's — never cuda:0's."""
    side = FakeStream(DEVICE)
    run = early_run(side)
    run._advance()  # a stage starts on the side stream after what the compute stream queued
    run.finish()  # the compute stream waits for what the side stream ran
    assert set(current_streams) == {DEVICE}
    assert side.waited_for == [current_streams[DEVICE]]
    assert current_streams[DEVICE].waited_for == [side]


class FakeEvent:
    """An event that, like a CUDA event, has no time until it has completed."""

    def __init__(self, at_ms: float) -> None:
        self.at_ms, self.done = at_ms, False

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: FakeEvent) -> float:
        if not end.done:
            raise RuntimeError("CUDA error: device not ready")
        return end.at_ms - self.at_ms


def test_newton_schulz_seconds_wait_for_the_end_event():
    """Reading ``last_step_stats.ns_seconds`` right after ``step()`` once raised "device not
    ready"; it now waits for each call's end event."""
    stats = StepStats()
    stats._ns_spans = [0.5, (FakeEvent(1.0), FakeEvent(4.0)), (FakeEvent(10.0), FakeEvent(12.0))]
    assert stats.ns_seconds == pytest.approx(0.5 + 0.003 + 0.002)


@pytest.mark.parametrize("method,dtype", [("standard", torch.float16), ("standard", torch.bfloat16),
                                          ("gram", torch.float16), ("standard", torch.float32),
                                          ("gram", torch.float32)])
@pytest.mark.parametrize("shape", [(3, 64, 192), (1, 300, 100), (2, 1, 50)])
def test_newton_schulz_runs_its_cuda_branches_on_the_meta_device(method, dtype, shape):
    """The meta device takes every branch a CUDA tensor takes (no CPU padding, no data-dependent
    normalization, no chunking by CPU cache) and has no values: a host read there raises, so
    this runs the CUDA path's Python without a GPU and shows it reads nothing."""
    from dmuon.orthogonalization import orthogonalize, resolve_config

    G = torch.empty(shape, device="meta")
    config = resolve_config(shape[-2:], "cuda", method=method, dtype=dtype)
    out = orthogonalize(G, config)
    assert out.shape == G.shape and out.device.type == "meta"
