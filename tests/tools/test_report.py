"""BENCHMARKS.md is what ``python benchmarks/report.py`` writes from ``benchmarks/results/``:
edited by hand or left behind by a new measurement, it fails here."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import report  # noqa: E402


def test_benchmarks_md_is_the_reports_rendering_of_the_results():
    assert (ROOT / "BENCHMARKS.md").read_text() == report.render()


def test_every_table_names_its_command_machine_and_commit():
    text = report.render()
    for name in report.MEASUREMENTS:
        if (report.RESULTS / f"{name}.json").exists():
            assert f"## {report.MEASUREMENTS[name].question}" in text
    assert text.count("; commit ") == sum(1 for n in report.MEASUREMENTS if (report.RESULTS / f"{n}.json").exists())
    assert "/work/" not in text and "/tmp/" not in text  # no machine's paths
