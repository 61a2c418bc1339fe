"""``benchmarks/layout_drift.py``: one short run through its command line. After a few steps
AdamW's and fp32-Newton–Schulz dmuon's losses in one process and under FSDP2 are at most a rounding apart, as
the single steps are exact; the JSON records a gap per optimizer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "layout_drift.py"


def test_a_short_run_reports_each_optimizers_gap(tmp_path):
    out = tmp_path / "drift.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--preset", "tiny", "--steps", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert sorted(results) == ["adamw", "dmuon-bf16", "dmuon-fp32"]
    for name in ("adamw", "dmuon-fp32"):
        assert results[name]["gaps"]["3"] < 1e-5, results
        assert results[name]["largest_gap"] >= results[name]["gaps"]["3"]
