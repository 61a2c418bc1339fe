"""The product apart from its tools: ``import dmuon`` and an optimizer step never import a module
of ``dmuon.tools`` (bench, demo, plan CLI, cost model, simulator, hardware profiles, peers, the
workload models).

Each check runs in a fresh interpreter, so that no other test's imports are in ``sys.modules``.
``symmetric_products="auto"`` is used because it times Newton–Schulz at construction — the path
that once imported the bench's throughput module; ``TRITON_INTERPRET=1`` makes Triton usable on
CPU so that the timing really runs (where Triton is installed).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

STEP_AND_REPORT = r"""
import sys
import torch
from torch import nn
import dmuon

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
opt = dmuon.Muon(model, lr=0.02, symmetric_products="auto")
for _ in range(2):
    model(torch.randn(4, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
print("\n".join(sorted(name for name in sys.modules if name == "dmuon.tools" or name.startswith("dmuon.tools."))))
"""


def _run(code: str) -> list[str]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line.strip()]


def test_import_and_step_import_no_tool_module():
    assert _run(STEP_AND_REPORT) == []


def test_no_product_module_imports_a_tool():
    """Statically, lazy imports inside functions included: no ``dmuon/*.py`` but ``__main__.py``
    (the ``python -m dmuon`` command line, which is the tools' CLI) imports ``dmuon.tools``."""
    assert (ROOT / "dmuon" / "tools" / "__init__.py").is_file()
    offenders = []
    for product in sorted((ROOT / "dmuon").glob("*.py")):
        if product.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(product.read_text(), str(product))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(name == "dmuon.tools" or name.startswith("dmuon.tools.") for name in names):
                offenders.append(f"{product.name}:{node.lineno}")
    assert offenders == []
