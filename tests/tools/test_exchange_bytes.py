"""``benchmarks/exchange_bytes.py``: its run at 4 ranks; every layout without replicas sends on
average exactly FSDP2's bound per rank (the piece exchange), and the JSON holds every row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "exchange_bytes.py"


def test_every_layout_without_replicas_sends_fsdp2s_bytes(tmp_path):
    out = tmp_path / "bytes.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 7
    for name, row in rows.items():
        if "replicas" not in name:
            assert row["mean_bytes"] == row["bound_bytes"], (name, row)
