"""The docs' code blocks that a reader copies whole, run as they are: each is marked in its
Markdown file by ``<!-- snippet: NAME -->`` above its fenced block (:func:`doc_snippet`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dmuon.tools.models import SyntheticTokens
from tests.helpers import torchrun_env

DOCS = Path(__file__).resolve().parents[2] / "docs"


def doc_snippet(doc: str, name: str) -> str:
    """The Python block under ``<!-- snippet: name -->`` in ``docs/<doc>``."""
    text = (DOCS / doc).read_text()
    found = re.search(rf"<!-- snippet: {re.escape(name)} -->\n```python\n(.*?)```", text, re.S)
    assert found, f"no snippet {name!r} in docs/{doc}"
    return found.group(1)


def test_the_pipeline_snippet_trains_under_torchrun_at_4_ranks(tmp_path):
    """docs/layouts.md's pipeline (2 stages x 2 FSDP2 ranks, one dmuon.Muon per stage): the last
    stage's loss falls, and every rank ends cleanly."""
    script = tmp_path / "pipeline.py"
    script.write_text(doc_snippet("layouts.md", "pipeline"))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                           str(script)], cwd=tmp_path, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+ loss (\S+)$", done.stdout, re.M)]
    assert len(losses) == 3 and losses[2] < 0.8 * losses[0], done.stdout


@pytest.mark.skipif(sys.version_info < (3, 11), reason="torchtitan 0.3.0 needs Python >= 3.11")
def test_the_torchtitan_cpu_snippets_train_torchtitans_llama3_on_cpu():
    """docs/integrations.md's two torchtitan blocks: torchtitan's Llama 3 debug model, its DMuon
    container and lr schedulers built from the CPU config, trained on generated tokens: the loss
    falls, and the routing is the documented one."""
    namespace: dict = {}
    exec(doc_snippet("integrations.md", "torchtitan-config") + doc_snippet("integrations.md", "torchtitan-cpu"),
         namespace)
    config = namespace["llama3_debugmodel_dmuon_cpu"]()
    torch.manual_seed(0)
    model = config.model_spec.model.build()
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=8)
    (optimizer,) = optimizers.dmuon_optimizers
    routes = optimizer.routes()
    assert routes["tok_embeddings.weight"].algorithm == "adamw" and routes["lm_head.weight"].algorithm == "adamw"
    assert all(r.algorithm == "muon" for n, r in routes.items() if n.startswith("layers.") and n.endswith("weight")
               and "norm" not in n)
    assert "wqkv.weight" in optimizer.routing_summary().split("note: ", 1)[1]
    data = SyntheticTokens(2048, seed=0)
    losses = []
    for step in range(8):
        inputs, targets = data.batch(step, 4, 64)
        loss = F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        schedulers.step()
        losses.append(loss.item())
    assert torch.isfinite(torch.tensor(losses)).all() and losses[-1] < losses[0] - 0.1, losses
