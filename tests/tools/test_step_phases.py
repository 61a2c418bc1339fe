"""``benchmarks/step_phases.py``: one tiny run at 2 ranks, through its command line. Every phase it
times must be reached (a renamed dmuon function would silently drop out of the profile), and the
phases must account for the step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_phases.py"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_every_phase_is_timed_and_the_phases_add_up_to_the_step(tmp_path, parallel):
    out = tmp_path / "phases.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--parallel", parallel, "--preset", "tiny", "--steps", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "NS / step" in done.stdout
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2
    for rank in ranks:
        phases = rank["phases_s"]
        # DDP gathers nothing, but returns every update: an all-to-all per bucket either way
        assert all(rank["calls"].get(p, 0) >= 2 for p in
                   ("agree on the step", "momentum", "AdamW", "Nesterov inputs", "pack + start all-to-all",
                    "wait for an all-to-all", "apply updates")), rank["calls"]
        assert phases["Newton-Schulz"] > 0
        assert all(v >= 0 for k, v in phases.items() if k != "other")
        assert sum(phases.values()) == pytest.approx(rank["step_s"], rel=1e-9)
        assert phases["other"] > -1e-3  # the timed phases do not nest: they cannot add up to more than the step
