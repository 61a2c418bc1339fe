"""``dmuon/step/statistics.py`` and the step's counters: ``Muon.statistics()`` describes the last step
(update RMS, lr, matrices, bytes), and ``last_step_stats`` prints as one readable line (docs/testing.md
row 16)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

import dmuon
from tests.unit.nets import make_net


def test_statistics_describe_the_last_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48, bias=False), nn.Linear(48, 16))
    opt = dmuon.Muon(model, lr=0.01, weight_decay=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(8, 32)).square().mean().backward()
    opt.step()
    stats = opt.statistics()
    # the Muon update's RMS before the lr is the parameters' change divided by the lr
    muon = [(p, b) for p, b in zip(model.parameters(), before) if p.ndim == 2]
    squares = sum(((b - p.detach()) / 0.01).square().sum() for p, b in muon)
    numel = sum(p.numel() for p, _ in muon)
    assert stats["muon/update_rms/0"] == pytest.approx(math.sqrt(squares / numel), rel=1e-4)
    assert stats["lr/0"] == 0.01 and "lr/1" not in stats  # the model is one group
    assert stats["matrices"] == 2 and stats["ns_gflop"] > 0 and stats["ns_seconds"] > 0
    assert stats["bytes_sent"] == stats["collectives"] == stats["skipped_steps"] == 0
    assert all(isinstance(v, float) for v in stats.values())


def test_last_step_stats_print_as_one_readable_line():
    net = make_net()
    opt = dmuon.Muon(net)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    text = repr(opt.last_step_stats)
    assert re.fullmatch(r"StepStats\(this rank: \d+ matrices orthogonalized, [\d.e+-]+ GFLOP in \d+ Newton–Schulz "
                        r"calls, [\d.]+ ms; 0 MiB sent in 0 collectives\)", text), text
    assert "ns_calls" not in text and "_ns_spans" not in text
