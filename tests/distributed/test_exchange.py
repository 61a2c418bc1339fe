"""Multi-rank dmuon with only its declared dependencies: no numpy (the torch CPU wheel does not
pull it in, and the test extra's transformers hides its absence).

The ranks run in a child interpreter whose script blocks numpy (``sys.modules["numpy"] = None``)
before importing torch; spawned ranks re-run the script's top lines first, so they lack numpy
too. torch then works as it does without numpy installed: ``torch.distributed``'s ``*_object``
collectives raise "Numpy is not available", and dmuon must not use them.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from tests.helpers import run_child_script

_SCRIPT = textwrap.dedent('''
    import sys
    sys.modules["numpy"] = None  # as if numpy were not installed
    import json
    import os

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp


    def model(width):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4))


    def rank_main(rank, world, init_file, out_dir):
        import dmuon

        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
        result = {}
        try:
            try:
                import numpy  # noqa: F401
                result["numpy"] = "importable"
            except ImportError:
                result["numpy"] = "blocked"
            try:  # the premise: blocked this way, torch's own object collectives fail
                dist.all_gather_object([None] * world, {"rank": rank})
                result["torch_object_collective"] = "worked"
            except RuntimeError as error:
                result["torch_object_collective"] = str(error)
            torch.manual_seed(0)
            net = model(32)
            opt = dmuon.Muon(net, lr=0.02, symmetric_products="auto")  # agreement and the timings
            net(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            weights = net[0].weight.detach().reshape(-1)
            everyone = [torch.empty_like(weights) for _ in range(world)]
            dist.all_gather(everyone, weights)
            result["same_weights"] = all(torch.equal(w, everyone[0]) for w in everyone)
            # a configuration that differs between ranks: every rank must raise the ValueError
            try:
                dmuon.Muon(model(32 + 8 * rank), lr=0.02)
                result["mismatch"] = "no error"
            except ValueError as error:
                result["mismatch"] = str(error)

            from dmuon.exchange import all_gather_bytes, all_gather_object

            # uneven lengths, an empty message, non-ASCII text; dicts with tuple keys
            result["bytes"] = [b.decode() for b in all_gather_bytes(("σ₁ ≤ 1" * rank).encode(), dist.group.WORLD)]
            objects = all_gather_object({(rank, 3): {"torch": 0.5 + rank}}, dist.group.WORLD)
            result["objects"] = repr(objects)
        except Exception as error:  # reported, not hidden behind a hang or a bare exit code
            result["error"] = f"{type(error).__name__}: {error}"
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


    if __name__ == "__main__":
        out_dir = sys.argv[1]
        mp.spawn(rank_main, args=(2, os.path.join(out_dir, "init"), out_dir), nprocs=2)
''')


def test_multi_rank_muon_without_numpy(tmp_path: Path) -> None:
    done = run_child_script(tmp_path, "no_numpy_ranks.py", _SCRIPT, str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result.get("error") is None, f"rank {rank}: {result['error']}"
        assert result["numpy"] == "blocked"
        assert result["torch_object_collective"] == "Numpy is not available"
        assert result["bytes"] == ["", "σ₁ ≤ 1"]
        assert result["objects"] == repr([{(0, 3): {"torch": 0.5}}, {(1, 3): {"torch": 1.5}}])
        assert result["same_weights"]
        assert result["mismatch"].startswith("Ranks disagree on the optimizer configuration: "), result["mismatch"]
        assert "on rank 0 but" in result["mismatch"] and "on rank 1." in result["mismatch"]
    assert results[0]["mismatch"] == results[1]["mismatch"]  # the same verdict on every rank
