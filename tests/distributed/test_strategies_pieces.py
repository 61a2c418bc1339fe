"""``dmuon/strategies/pieces.py``: the piece exchange, which takes every sharding the row exchange does
not (FSDP × column-wise TP, FSDP × row-wise TP, 2-D blocks, HSDP replicas over 2-D pieces): a step
as one process with FSDP2's bytes, and checkpoints across those layouts and world sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import distribute_tensor

import dmuon
from tests.distributed.test_tensor_parallel import HPARAMS, TWO_D, load_plain, save_and_load_tp
from tests.harness import run_on_ranks


@pytest.mark.parametrize("saved_as,loaded_as", [(("fsdp+tp", 4), ("tp", 2)), (("fsdp+tp", 4), ("fsdp", 3)),
                                               (("fsdp", 3), ("fsdp+tp", 4)), (("tp", 2), ("fsdp+tp", 4))],
                         ids=["fsdp+tp@4->tp@2", "fsdp+tp@4->fsdp@3", "fsdp@3->fsdp+tp@4", "tp@2->fsdp+tp@4"])
def test_checkpoint_loads_across_two_d_layouts_and_world_sizes(tmp_path, saved_as, loaded_as):
    """A torch.distributed.checkpoint of weights and momentum saved under one layout and world
    size loads bitwise under another (each rank takes its own piece)."""
    saved = run_on_ranks(saved_as[1], save_and_load_tp, str(tmp_path / "ckpt"), saved_as[0])[0]
    for rank, loaded in enumerate(run_on_ranks(loaded_as[1], load_plain, str(tmp_path / "ckpt"), loaded_as[0])):
        for part in ("params", "momentum"):
            assert saved[part].keys() == loaded[part].keys() and saved[part]
            for name in saved[part]:
                assert torch.equal(saved[part][name], loaded[part][name]), (rank, part, name)


def two_d_step(case: str, dtype: torch.dtype, steps: int = 2, bucket_bytes: int | None = None, repeat: int = 1
               ) -> dict:
    """``steps`` Muon steps of DTensors placed as ``TWO_D[case]`` on a (2, 2) mesh, beside the
    same steps in one process on the full tensors (the same gradients); the whole parameters,
    whether they are bitwise the reference's, and the bytes of the last step."""
    from dmuon.reference import ReferenceMuon
    from tests.helpers import full_tensors

    placements, shapes = TWO_D[case]
    shapes = shapes * repeat
    mesh = init_device_mesh("cpu", (2, 2))
    init = [t.to(dtype) for t in full_tensors(shapes, seed=0)]
    params = [nn.Parameter(distribute_tensor(t.clone(), mesh, placements, src_data_rank=None)) for t in init]
    refs = [nn.Parameter(t.clone()) for t in init]
    names = [f"p{i}" for i in range(len(params))]
    hparams = {**HPARAMS, "ns_dtype": torch.float32 if dtype == torch.float32 else torch.bfloat16}
    options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    opt = dmuon.Muon([{"params": params, "algorithm": "muon", "param_names": names}], **hparams, **options)
    ref = ReferenceMuon(refs, **hparams)
    for step in range(steps):
        for p, r, g in zip(params, refs, full_tensors(shapes, seed=100 + step)):
            p.grad = distribute_tensor(g.to(dtype), mesh, placements, src_data_rank=None)
            r.grad = g.to(dtype)
        opt.step()
        ref.step()
    return dict(equal=[torch.equal(p.full_tensor(), r.detach()) for p, r in zip(params, refs)],
                bytes=opt.last_step_stats.bytes_sent, matrices=opt.last_step_stats.matrices_orthogonalized,
                muon_bytes=sum(t.numel() * t.element_size() for t in init),
                buckets=sum(len(plan.buckets) for plan in opt.plans))


@pytest.mark.parametrize("case", sorted(TWO_D))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_d_layouts_step_as_one_process_and_exchange_as_fsdp2(case, dtype):
    """Each owner receives exactly the pieces of its matrices and returns every rank its piece:
    bitwise the single-process step, every matrix orthogonalized once, and per rank on average
    2(N-1)/N of the Muon weights spread over the N ranks (the header's all-reduce aside)."""
    from dmuon.agreement import HEADER_LEN

    results = run_on_ranks(4, two_d_step, case, dtype)
    for r in results:
        assert all(r["equal"]), (case, r["equal"])
    _, shapes = TWO_D[case]
    assert sum(r["matrices"] for r in results) == sum(s[0] if len(s) == 3 else 1 for s in shapes)
    exchanged, weights = sum(r["bytes"] - 4 * HEADER_LEN for r in results), results[0]["muon_bytes"]
    if "replicas" in case:  # one replica sends its halves; the owner returns every rank its half
        assert exchanged <= (1 + 3 / 2) * weights
    elif (7, 5) not in shapes:  # even pieces: exactly FSDP2's bound
        assert exchanged == 2 * 3 / 4 * weights, (exchanged, weights)
    else:  # uneven pieces: each matrix out and back once, less its owner's own piece
        assert exchanged <= 2 * weights


@pytest.mark.parametrize("case", ["fsdp x colwise tp", "expert stacks, efsdp dim 1"])
def test_two_d_buckets_overlap_and_give_the_same_bits(case):
    """Several buckets (tiny ones, over three copies of the shapes): bucket k+1's pieces go out
    before bucket k's Newton–Schulz and bucket k's update comes back during bucket k+1's (the row
    exchange's stages), bitwise as one process."""
    for r in run_on_ranks(4, two_d_step, case, torch.float32, 2, 64, 3):
        assert all(r["equal"]) and len(r["equal"]) == 3 * len(TWO_D[case][1]) and r["buckets"] >= 2, r
