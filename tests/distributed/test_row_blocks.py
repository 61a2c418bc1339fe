"""Fused weights' row blocks by index (``dmuon/row_blocks.py``): an interleaved ``w13``, a per-head
``wkv_b`` and explicit row-index lists step bitwise as the single-process reference (which
orthogonalizes each block's rows on their own) in every layout that cuts a block's rows across
ranks — FSDP2, FSDP2 × column-wise TP, HSDP, owner sharding — at 1–4 ranks, fp32 and bf16, with
NorMuon's row state; and a pattern written for one rank's shard is refused on every rank, naming
the parameter. The pattern's meaning (each block is the matrix it stands for):
tests/unit/test_row_blocks.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import dmuon
from dmuon.reference import ReferenceMuon
from tests.harness import run_on_ranks
from tests.helpers import error_of, full_tensor, full_tensors, whole_params

# (shape, ns_blocks): w13 with w1's and w3's rows alternating; wkv_b with a K and a V block per head
# (4 heads, 8 matrices); rows by explicit index; an expert stack of interleaved w13s
FUSED = {
    "w13": ((32, 24), dmuon.interleaved(2)),
    "wkv_b": ((40, 16), dmuon.per_head(4, [4, 6])),
    "picked": ((12, 20), [[0, 5, 7, 11], [1, 2, 3, 4, 6, 8, 9, 10]]),
    "experts_w13": ((2, 16, 12), dmuon.interleaved(2)),
}
TWO_D = ("w13", "wkv_b", "picked")  # the matrices of the 2-D layout (no expert stack)
HPARAMS = dict(lr=0.02, weight_decay=0.1, momentum=0.9)

# layout → (mesh shape for a world size, placements, Muon options); "owner": dmuon.shard_by_owner
LAYOUTS = {
    "one process": (None, None, {}),
    "fsdp": (lambda w: (w,), [Shard(0)], {}),
    "fsdp x colwise tp": (lambda w: (2, w // 2), [_StridedShard(0, split_factor=2), Shard(0)], {}),
    "hsdp": (lambda w: (2, w // 2), [Replicate(), Shard(0)], {"replica_split": True}),  # one owner in the job
    "owner": (None, None, {}),
}


class Fused(nn.Module):
    """The fused weights as parameters of their own modules (layers to owner sharding)."""

    def __init__(self, names: tuple[str, ...], init: list[torch.Tensor]) -> None:
        super().__init__()
        for name, value in zip(names, init):
            self.add_module(name, nn.Module())
            getattr(self, name).weight = nn.Parameter(value.clone())


def fused_steps(layout: str, dtype: torch.dtype, update_rule: str, steps: int = 2) -> dict:
    """``steps`` Muon steps of the fused weights in ``layout`` and of the reference in this
    process on whole tensors, given the same gradients."""
    names = TWO_D if layout == "fsdp x colwise tp" else tuple(FUSED)
    shapes = [FUSED[n][0] for n in names]
    init = [t.to(dtype) for t in full_tensors(shapes, 0)]
    mesh_shape, placements, options = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", mesh_shape(dist.get_world_size())) if mesh_shape else None
    model = Fused(names, init)
    sharding = dmuon.shard_by_owner(model) if layout == "owner" else None
    if mesh is not None:
        for name in names:
            module = getattr(model, name)
            module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, placements,
                                                           src_data_rank=None))
    params = [getattr(model, n).weight for n in names]
    hparams = {**HPARAMS, "update_rule": update_rule}
    opt = dmuon.Muon([{"params": [(n, p)], "algorithm": "muon", "ns_blocks": FUSED[n][1]}
                      for n, p in zip(names, params)], **hparams, **options)
    refs = [nn.Parameter(t.clone()) for t in init]
    ref = ReferenceMuon([{"params": [r], "ns_blocks": FUSED[n][1]} for n, r in zip(names, refs)], **hparams)
    for step in range(steps):
        for p, r, g in zip(params, refs, full_tensors(shapes, 100 + step)):
            r.grad = g.to(dtype)
            if mesh is not None:
                p.grad = distribute_tensor(g.to(dtype), mesh, placements, src_data_rank=None)
            elif sharding is None or sharding.is_mine(p):  # an owner-sharded matrix: its owner's gradient
                p.grad = g.to(dtype)
        opt.step()
        ref.step()
    got = whole_params(model) if sharding else {f"{n}.weight": full_tensor(p) for n, p in zip(names, params)}
    return dict(equal={n: torch.equal(got[f"{n}.weight"], r.detach()) for n, r in zip(names, refs)},
                dtype={v.dtype for v in got.values()}, matrices=opt.last_step_stats.matrices_orthogonalized,
                routing=opt.routing_summary(), tables="\n".join(plan.table() for plan in opt.plans))


@pytest.mark.parametrize("layout,world", [("one process", 1), ("fsdp", 3), ("fsdp", 4), ("fsdp x colwise tp", 4),
                                          ("hsdp", 4), ("owner", 3), ("owner", 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_by_index_step_as_the_reference_in_every_layout(layout, world, dtype):
    results = run_on_ranks(world, fused_steps, layout, dtype, "muon")
    for rank, r in enumerate(results):
        assert all(r["equal"].values()) and r["dtype"] == {dtype}, (rank, r["equal"])
    # every block once in the job: 2 + 8 + 2 matrices, and 2 experts of 2 blocks
    blocks = 2 + 8 + 2 + (0 if layout == "fsdp x colwise tp" else 2 * 2)
    assert sum(r["matrices"] for r in results) == blocks
    assert "2 blocks 16 rows each, rows by index" in results[0]["routing"]
    assert "8 blocks of 4, 6, 4, 6, 4, 6, … rows" in results[0]["routing"]
    tables = "\n".join(r["tables"] for r in results)  # owner sharding: each rank plans the matrices it owns
    assert "fused: w13 (1 x 32x24) in 2 blocks 16 rows each, rows by index, owner" in tables
    assert "fused: picked (1 x 12x20) in 2 blocks of 4, 8 rows, rows by index, owner" in tables


@pytest.mark.parametrize("layout,world", [("fsdp", 3), ("fsdp x colwise tp", 4), ("owner", 4)])
def test_row_states_follow_the_blocks_rows(layout, world):
    """NorMuon keeps a number per row: the rows that a pattern moves keep theirs."""
    for rank, r in enumerate(run_on_ranks(world, fused_steps, layout, torch.float32, "normuon")):
        assert all(r["equal"].values()), (rank, r["equal"])


def shard_pattern() -> None:
    """A pattern that counts this rank's 8 rows of a 32-row FSDP2 matrix, not its 32."""
    mesh = init_device_mesh("cpu", (4,))
    p = nn.Parameter(distribute_tensor(torch.zeros(32, 24), mesh, [Shard(0)]))
    dmuon.Muon([{"params": [("w13", p)], "algorithm": "muon", "ns_blocks": [[0, 2, 4, 6], [1, 3, 5, 7]]}])


def test_a_pattern_for_one_shard_is_refused_on_every_rank_naming_the_parameter():
    for rank, error in enumerate(run_on_ranks(4, error_of, shard_pattern)):
        assert error.startswith("ValueError") and "w13" in error, (rank, error)
        assert "8 rows of this rank's shard" in error and "32 global rows" in error, (rank, error)
