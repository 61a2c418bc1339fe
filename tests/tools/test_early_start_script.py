"""``benchmarks/early_start.py``, the GPU check's early-start script, on CPU through its command
line: its bit checks (early start's plan with the buckets begun in the backward pass against the
same plan run at step()) in one process and under DDP with dmuon's comm hook."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "early_start.py"
SMALL = ["--preset", "bench", "--layers", "2", "--batch-size", "2", "--seq-len", "32"]


def test_one_process_run_times_every_configuration_and_finds_the_same_bits(tmp_path):
    out = tmp_path / "early.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *SMALL, "--warmup", "1", "--rounds", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["same_plan_bitwise_equal"] is True
    assert all(result[name]["median_ms"] > 0 for name in ("adamw", "muon-at-step", "muon-early"))


def test_ddp_check_finds_the_same_bits():
    done = subprocess.run([sys.executable, str(SCRIPT), "--ddp-only", "--ddp-bucket-mb", "1", *SMALL],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "bitwise equal" in done.stdout
