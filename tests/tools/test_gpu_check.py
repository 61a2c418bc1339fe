"""``benchmarks/gpu_check.sh``, checked without a GPU: the scripts parse, the plan of sections fits
8 minutes and 8 files, every section's code runs on the CPU at toy sizes, and a failing section
does not stop the next."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_rerun.sh"])
def test_the_shell_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], check=True)


def test_the_dry_run_fits_the_window():
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "/tmp/unused", "--dry-run"],
                          capture_output=True, text=True, check=True)
    total = gpu_check.SETUP_SECONDS + sum(s.seconds + gpu_check.GRACE_SECONDS for s in gpu_check.SECTIONS)
    assert total <= gpu_check.BUDGET_SECONDS == 480
    assert 1 + len(gpu_check.SECTIONS) <= gpu_check.MAX_FILES == 8
    assert f"total: at most {total} s of 480 s" in done.stdout
    assert [s.name for s in gpu_check.SECTIONS][:2] == ["crash", "reference"]  # crash-prone first


@pytest.mark.parametrize("section", [s.name for s in gpu_check.SECTIONS])
def test_every_section_runs_on_cpu_at_toy_sizes(section, tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(SCRIPT), section, "--out", str(tmp_path), "--smoke"], cwd=ROOT, env=env,
                   check=True, capture_output=True, text=True, timeout=300)
    result = json.loads((tmp_path / f"{section}.json").read_text())
    assert result["seconds"] > 0


def test_a_failing_section_does_not_stop_the_rest(tmp_path):
    """gpu_rerun.sh runs each section under its limit and logs its exit code: without a GPU the
    sections fail, and every one of them is still run and logged. OUT is relative, as a caller
    types it: it is taken from the caller's folder, not the repository's."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_rerun.sh"), "all", "out"], cwd=tmp_path, env=env,
                   check=True, timeout=600)
    assert not (ROOT / "out").exists()
    log = (tmp_path / "out" / "log.txt").read_text()
    for section in gpu_check.SECTIONS:
        assert f"== {section.name}: exit " in log, log[-2000:]
