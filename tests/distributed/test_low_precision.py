"""bf16 and fp16 parameters in every layout: replicas stay bitwise identical on every rank, and
the step equals the single-process reference (bitwise where the same kernels run on the same
matrices; to bf16/fp16 rounding where distributed Newton–Schulz sums Gram matrices across ranks,
or row-wise tensor parallel orthogonalizes the transpose).

The fp32 tests elsewhere cannot show what went wrong here once: an owner added its own update
from a strided view while the ranks it sent to added a contiguous copy, and on CPU a bf16 add
rounds differently on the two — the replicas of a DDP weight drifted apart after one step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import dmuon
from dmuon.reference import ReferenceMuon
from tests.harness import run_on_ranks
from tests.helpers import full_tensor, full_tensors

SHAPES = [(64, 32), (32, 96), (48, 48), (7, 5), (3, 16)]  # tall, wide, square, odd, fewer rows than ranks
GANG_SHAPES = [(48, 400), (8, 8), (12, 8)]  # one matrix large enough to be split over a gang
STACK = [(6, 8, 12), (16, 24)]  # experts, and a plain matrix
FUSED = [(48, 32), (64, 24), (2, 12, 20)]  # a GQA-style QKV, per-head blocks, a gate/up stack
BLOCKS = [[32, 8, 8], 16, [6, 6]]  # their row blocks (ns_blocks), orthogonalized separately
HPARAMS = dict(lr=0.02, weight_decay=0.1, momentum=0.9)  # Newton–Schulz in its default dtype (bf16 on CPU)

# layout → (mesh shape from the world size, placements, Muon options, shapes)
LAYOUTS = {
    "ddp": (None, None, {}, SHAPES),
    "fsdp": (lambda w: (w,), [Shard(0)], {}, SHAPES),
    "hsdp, replicas split": (lambda w: (2, w // 2), [Replicate(), Shard(0)], {"replica_split": True}, SHAPES),
    "hsdp, replicas alone": (lambda w: (2, w // 2), [Replicate(), Shard(0)], {"replica_split": False}, SHAPES),
    "row-wise tp": (lambda w: (w,), [Shard(1)], {}, SHAPES),
    "2-d blocks": (lambda w: (2, w // 2), [Shard(0), Shard(1)], {}, SHAPES),
    "expert stacks": (lambda w: (w,), [Shard(0)], {}, STACK),
    "column blocks": (lambda w: (w,), [Shard(0)], {"distributed_ns": True}, SHAPES),
    "fsdp, fused blocks": (lambda w: (w,), [Shard(0)], {}, FUSED),
    "ddp, gangs": (None, None, {}, GANG_SHAPES),
    "fsdp, gangs": (lambda w: (w,), [Shard(0)], {}, GANG_SHAPES),
}
ROW_STATE = "row_second_moment"  # NorMuon's
SCALES = "momentum_scale"  # 8-bit momentum's
# equal to the single-process step up to rounding, not bitwise: distributed Newton–Schulz sums
# partial Gram matrices over ranks, and row-wise TP orthogonalizes the transpose (NS(Wᵀ)ᵀ, whose
# products differ from NS(W)'s for a square W)
ROUNDED = {"column blocks", "ddp, gangs", "fsdp, gangs", "row-wise tp"}


def low_precision_steps(layout: str, dtype: torch.dtype, steps: int = 2, update_rule: str = "muon",
                        momentum_dtype: torch.dtype | None = None, shapes: list | None = None) -> dict:
    mesh_shape, placements, options, layout_shapes = LAYOUTS[layout]
    shapes = shapes or layout_shapes
    hparams = {**HPARAMS, "update_rule": update_rule, "momentum_dtype": momentum_dtype}
    mesh = init_device_mesh("cpu", mesh_shape(dist.get_world_size())) if mesh_shape else None

    def place(t: torch.Tensor, i: int) -> torch.Tensor:
        if mesh is None or (layout == "expert stacks" and i > 0):  # the stack's neighbour is a plain replica
            return t.clone()
        return distribute_tensor(t.clone(), mesh, placements)

    init = [t.to(dtype) for t in full_tensors(shapes, 0)]
    params = [nn.Parameter(place(t, i)) for i, t in enumerate(init)]
    ref_params = [nn.Parameter(t.clone()) for t in init]
    names = [f"w{i}" for i in range(len(params))]
    if shapes is FUSED:  # one group per weight, each with its row blocks
        opt = dmuon.Muon([{"params": [p], "algorithm": "muon", "param_names": [n], "ns_blocks": blocks}
                          for p, n, blocks in zip(params, names, BLOCKS)], **hparams, **options)
        ref = ReferenceMuon([{"params": [r], "ns_blocks": blocks} for r, blocks in zip(ref_params, BLOCKS)],
                            **hparams)
    else:
        opt = dmuon.Muon([{"params": params, "algorithm": "muon", "param_names": names}], **hparams, **options)
        ref = ReferenceMuon(ref_params, **hparams)
    for step in range(steps):
        grads = [g.to(dtype) for g in full_tensors(shapes, 100 + step)]
        for i, (p, r, g) in enumerate(zip(params, ref_params, grads)):
            p.grad, r.grad = place(g, i), g.clone()
        opt.step()
        ref.step()
    return dict(
        params=[full_tensor(p) for p in params],
        momentum=[full_tensor(opt.state[p]["momentum_buffer"]) for p in params],
        reference=[r.detach() for r in ref_params],
        ref_momentum=[ref.state[r]["momentum_buffer"] for r in ref_params],
        dtypes={p.dtype for p in params} | {opt.state[p]["momentum_buffer"].dtype for p in params},
        gangs=opt.last_step_stats.gangs,
        row_states=[full_tensor(opt.state[p][ROW_STATE]) for p in params if ROW_STATE in opt.state[p]],
        ref_row_states=[ref.state[r][ROW_STATE] for r in ref_params if ROW_STATE in ref.state[r]],
        scales=[full_tensor(opt.state[p][SCALES]) for p in params if SCALES in opt.state[p]],
        ref_scales=[ref.state[r][SCALES] for r in ref_params if SCALES in ref.state[r]],
    )


def assert_weights_match(first: dict, rounded: bool) -> None:
    """Rank 0's weights against the reference's: bitwise, or within 2e-3 (relative) where ``rounded``."""
    for i, (got, ref) in enumerate(zip(first["params"], first["reference"])):
        if rounded:
            error = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            assert error < 2e-3, (i, error)
        else:
            assert torch.equal(got, ref), f"w{i}: {(got != ref).sum().item()} of {got.numel()} elements differ"


CASES = [(layout, world) for layout in LAYOUTS for world in (1, 2, 3, 4)
         if world > 1 or layout == "ddp"  # one process: every layout is the plain one
         if LAYOUTS[layout][0] is None or len(LAYOUTS[layout][0](world)) == 1 or world % 2 == 0
         if not (layout.endswith("gangs") and world < 3)]  # the cost model splits from 3 ranks on


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout,world", CASES)
def test_low_precision_replicas_are_identical_and_match_one_process(layout, world, dtype):
    results = run_on_ranks(world, low_precision_steps, layout, dtype)
    first = results[0]
    for rank, r in enumerate(results):
        assert r["dtypes"] == {dtype}, rank  # no silent precision change of parameters or state
        for i, (got, ref) in enumerate(zip(r["params"], first["params"])):
            assert torch.equal(got, ref), f"rank {rank}'s replica of w{i} differs from rank 0's"
        for i, (got, ref) in enumerate(zip(r["momentum"], first["momentum"])):
            assert torch.equal(got, ref), f"rank {rank}'s momentum of w{i} differs from rank 0's"
    for i, (got, ref) in enumerate(zip(first["momentum"], first["ref_momentum"])):
        assert torch.equal(got, ref), f"momentum of w{i}"  # element-wise: bitwise in every layout
    assert_weights_match(first, layout in ROUNDED and world > 1)
    if layout.endswith("gangs"):
        assert first["gangs"], "the cost model split no matrix over a gang"


@pytest.mark.parametrize("layout,world", CASES)
def test_normuon_in_every_layout_matches_one_process(layout, world):
    """NorMuon's row normalization on the owner, its row state shared with every rank holding
    the parameter: bf16 replicas and row states identical on every rank, and the step the single
    process's. The whole update is on one rank, so no matrix is split (gangs, column blocks), and
    those layouts are bitwise too."""
    results = run_on_ranks(world, low_precision_steps, layout, torch.bfloat16, 2, "normuon")
    first = results[0]
    assert len(first["row_states"]) == len(first["params"]) == len(first["ref_row_states"])
    for rank, r in enumerate(results):
        for name in ("params", "momentum", "row_states"):
            for i, (got, ref) in enumerate(zip(r[name], first[name])):
                assert torch.equal(got, ref), f"rank {rank}'s {name} of w{i} differs from rank 0's"
        assert not r["gangs"]
    assert_weights_match(first, layout == "row-wise tp" and world > 1)
    for i, (got, ref) in enumerate(zip(first["row_states"], first["ref_row_states"])):
        if layout == "row-wise tp" and world > 1:
            assert torch.allclose(got, ref, rtol=2e-2, atol=1e-6), i
        else:
            assert torch.equal(got, ref), f"row state of w{i}"


@pytest.mark.parametrize("layout,world", [("ddp", 3), ("fsdp", 2), ("hsdp, replicas split", 4), ("row-wise tp", 2),
                                          ("2-d blocks", 4), ("expert stacks", 3), ("fsdp, fused blocks", 3),
                                          ("fsdp, gangs", 4)])
def test_fp32_momentum_beside_bf16_weights_in_every_layout(layout, world):
    """``momentum_dtype=torch.float32`` with bf16 parameters: the buffers fp32 on every rank and
    bitwise the reference's; weights as bf16 momentum gives them (bitwise, or to rounding where
    the layout sums or transposes)."""
    results = run_on_ranks(world, low_precision_steps, layout, torch.bfloat16, 2, "muon", torch.float32)
    first = results[0]
    for rank, r in enumerate(results):
        assert r["dtypes"] == {torch.bfloat16, torch.float32}, rank
        for name in ("params", "momentum"):
            for i, (got, ref) in enumerate(zip(r[name], first[name])):
                assert torch.equal(got, ref), f"rank {rank}'s {name} of w{i} differs from rank 0's"
    for i, (got, ref) in enumerate(zip(first["momentum"], first["ref_momentum"])):
        assert got.dtype == torch.float32 and torch.equal(got, ref), f"momentum of w{i}"
    assert_weights_match(first, layout in ROUNDED)


# last dims a row-wise split over 2, 3 or 4 ranks cuts at multiples of 128 columns (whole 8-bit blocks)
WIDE = [(16, 1536), (40, 1536), (6, 3072)]
INT8_CASES = [("ddp", 1), ("ddp", 3), ("fsdp", 2), ("fsdp", 3), ("fsdp", 4), ("hsdp, replicas split", 4),
              ("row-wise tp", 2), ("row-wise tp", 3), ("2-d blocks", 4), ("expert stacks", 3), ("column blocks", 2),
              ("fsdp, fused blocks", 3), ("fsdp, gangs", 4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout,world", INT8_CASES)
def test_8bit_momentum_in_every_layout_matches_one_process(layout, world, dtype):
    """``momentum_dtype=torch.int8``: codes and scales on every rank the reference's, bitwise (each
    block is encoded on the rank holding it, from its own elements); weights as the reference's
    (bitwise, or to rounding where the layout sums or transposes)."""
    wide = layout in ("row-wise tp", "2-d blocks")
    results = run_on_ranks(world, low_precision_steps, layout, dtype, 2, "muon", torch.int8, WIDE if wide else None)
    first = results[0]
    assert len(first["scales"]) == len(first["params"]) == len(first["ref_scales"])
    for rank, r in enumerate(results):
        assert r["dtypes"] == {dtype, torch.int8}, rank
        for name in ("params", "momentum", "scales"):
            for i, (got, ref) in enumerate(zip(r[name], first[name])):
                assert torch.equal(got, ref), f"rank {rank}'s {name} of w{i} differs from rank 0's"
    for name in ("momentum", "scales"):
        for i, (got, ref) in enumerate(zip(first[name], first[f"ref_{name}"])):
            assert torch.equal(got, ref), f"{name} of w{i}"
    assert_weights_match(first, layout in ROUNDED and world > 1)


def row_wise_8bit(columns: int) -> str | None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    w = nn.Parameter(distribute_tensor(torch.zeros(4, columns), mesh, [Shard(1)]))
    try:
        dmuon.Muon([{"params": [w], "algorithm": "muon", "param_names": ["proj"], "momentum_dtype": "int8"}])
    except ValueError as err:
        return str(err)
    return None


def test_8bit_momentum_refuses_a_split_that_cuts_its_blocks_on_every_rank():
    """200 columns over 2 ranks: 100 each, so the block of columns 0–127 would lie on both."""
    for error in run_on_ranks(2, row_wise_8bit, 200):
        assert error is not None and "momentum of proj in param group 0 in 8-bit blocks of 128 columns" in error
        assert "split over 2 ranks at 100 columns each" in error and "momentum_dtype='bfloat16'" in error
    assert run_on_ranks(2, row_wise_8bit, 512) == [None, None]
