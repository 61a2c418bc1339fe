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
import re
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
    """Statically, lazy imports inside functions included: no module of the product (its
    packages' included) but ``__main__.py`` (the ``python -m dmuon`` command line, which is the
    tools' CLI) imports ``dmuon.tools``."""
    assert (ROOT / "dmuon" / "tools" / "__init__.py").is_file()
    offenders = []
    for product in sorted((ROOT / "dmuon").rglob("*.py")):
        if product.name == "__main__.py" or "tools" in product.relative_to(ROOT / "dmuon").parts:
            continue
        for node in ast.walk(ast.parse(product.read_text(), str(product))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(name == "dmuon.tools" or name.startswith("dmuon.tools.") for name in names):
                offenders.append(f"{product.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def documented_layers() -> dict[str, int]:
    """Module → its row in docs/architecture.md's layer table (``strategies/`` stands for the
    package's modules)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| layer | modules |"):].split("\n\n", 1)[0].splitlines()[2:]
    layers = {}
    for row, line in enumerate(table):
        for name in re.findall(r"`([a-z_]+(?:\.py|/))`", line.split("|")[2]):
            if name.endswith("/"):  # a package: its modules and its sub-packages'
                for path in (ROOT / "dmuon" / name).rglob("[!_]*.py"):
                    layers[".".join(path.relative_to(ROOT).with_suffix("").parts)] = row
            elif (ROOT / "dmuon" / name).exists():  # not one of a folder's files, named beside it
                layers.setdefault(f"dmuon.{name[:-3]}", row)  # (a folder's agreement.py is not the top one)
    return layers


def dmuon_imports(path: Path) -> set[str]:
    """The dmuon modules a file imports, anywhere in it (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dmuon")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dmuon"):
            found |= {f"{node.module}.{a.name}" if node.module == "dmuon" else node.module for a in node.names}
    return found


def test_every_import_follows_the_documented_layers():
    layers = documented_layers()
    files = [p for p in (ROOT / "dmuon").rglob("*.py")
             if "tools" not in p.parts and p.stem not in ("__init__", "__main__")]
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in files}
    assert sorted(modules) == sorted(layers), "docs/architecture.md's table must list every module of the product"
    broken = [f"{module} (row {layers[module]}) imports {imported} (row {layers[imported]})"
              for module, path in modules.items() for imported in sorted(dmuon_imports(path))
              if imported in layers and layers[imported] > layers[module]]
    assert not broken, broken


def test_every_public_name_documents_its_arguments():
    """What ``dmuon`` exports says what each argument is, as torch's optimizers do (``Args:``)."""
    import inspect

    import dmuon

    undocumented = [name for name in dmuon.__all__ if "Args:" not in (inspect.getdoc(getattr(dmuon, name)) or "")]
    assert undocumented == []


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "barrier", "send", "recv", "isend", "irecv", "gather", "scatter"}


def test_every_collective_of_the_product_is_in_exchange_py():
    """``dist.<collective>(...)`` appears in ``dmuon/exchange.py`` only (the tools aside), so that
    every collective is counted there and found in one place."""
    offenders = []
    for path in sorted((ROOT / "dmuon").rglob("*.py")):
        if path.name == "exchange.py" or "tools" in path.relative_to(ROOT / "dmuon").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "dist"):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} dist.{node.func.attr}")
    assert offenders == []


def test_no_product_module_over_500_lines_class_over_250_nor_function_over_60():
    """The house's size limits (the tools aside): a module with one job, a class a newcomer reads
    in one sitting, a function that fits on a screen; and each module's docstring says its job."""
    too_long, undocumented = [], []
    for path in sorted((ROOT / "dmuon").rglob("*.py")):
        if "tools" in path.relative_to(ROOT / "dmuon").parts:
            continue
        text = path.read_text()
        if len(text.splitlines()) > 500:
            too_long.append(f"{path.relative_to(ROOT)} ({len(text.splitlines())} lines)")
        tree = ast.parse(text)
        if len(ast.get_docstring(tree) or "") < 40:
            undocumented.append(str(path.relative_to(ROOT)))
        for node in ast.walk(tree):
            limit = 250 if isinstance(node, ast.ClassDef) else 60 if isinstance(node, ast.FunctionDef) else None
            if limit is not None and node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert too_long == [] and undocumented == []


def _import_graph() -> dict[str, set[str]]:
    """Each product module (packages as their ``__init__``) → the product modules it imports,
    anywhere in the file: inside functions and under ``TYPE_CHECKING`` too (a name imported from
    a package, not a module of it, counts as the package)."""
    modules = {}
    for path in (ROOT / "dmuon").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if "tools" in parts or parts[-1] == "__main__":
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {module: ({name if name in modules else name.rsplit(".", 1)[0] for name in dmuon_imports(path)}
                     & set(modules)) - {module}
            for module, path in modules.items()}


def test_the_product_has_no_import_circle():
    """No chain of imports — type-only ones included — leads from a module back to itself."""
    graph = _import_graph()
    circles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                circles.append(path[path.index(imported):] + [imported])
            elif imported not in state:
                visit(imported, [*path, imported])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert circles == []
