"""``benchmarks/stack_bits.py``: one short run through its command line. It must compare every
matrix of every stack, and count a difference where the bits differ (here: a stack whose one
matrix is changed after Newton–Schulz, through the same comparison)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "stack_bits.py"


def test_every_matrix_is_compared():
    done = subprocess.run([sys.executable, str(SCRIPT), "--seeds", "1", "--stack", "3"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if "differ alone" in line]
    assert len(rows) == 11 and all(" of 3 " in row for row in rows), done.stdout


def test_a_difference_is_counted(monkeypatch):
    spec = importlib.util.spec_from_file_location("stack_bits", SCRIPT)
    stack_bits = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stack_bits)
    real = stack_bits.orthogonalize

    def first_of_a_stack_off(G, config):
        out = real(G, config)
        if G.ndim == 3:
            out[0, 0, 0] += 1.0
        return out

    monkeypatch.setattr(stack_bits, "orthogonalize", first_of_a_stack_off)
    count, total, worst = stack_bits.differing((16, 40), torch.bfloat16, 3, 2)
    assert (count, total) == (2, 6) and worst > 0.5
