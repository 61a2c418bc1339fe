"""QK-clip across ranks, against one process: a step with given records in every layout (DDP
replicas, FSDP2 and HSDP shards, column-wise tensor parallel with each rank recording its own
heads), bitwise; training with the clip under DDP, FSDP2, HSDP and owner sharding, to the
tolerance of the training-parity tests, with identical replicas; bad records refused on every
rank before any weight changes."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import dmuon
from dmuon import AttentionLayer, QKClip
from dmuon.reference import ReferenceMuon
from tests.harness import run_on_ranks
from tests.helpers import (
    as_layout,
    assert_same_error,
    error_of,
    full_tensor,
    full_tensors,
    placements_for,
    single_process,
    train_llama,
)

HPARAMS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, ns_method="standard", ns_dtype=torch.float32)
TAU, HEAD_DIM, DIM, STEPS = 1.0, 3, 10, 2
NAMES = ["q", "k", "qkv_rows", "qkv_cols", "q_bias", "k_bias", "qkv_bias"]
MATRICES = 4  # the first four: Muon's; the biases get no gradient, so only the clip moves them


def shapes(world: int) -> list[tuple[int, ...]]:
    """q and k of a grouped-query layer (2·world query heads, world key heads: whole heads on
    each tensor-parallel rank), a fused QKV along dim 0 and one along dim 1 (GPT-2's Conv1D);
    then the biases of q, k and the fused QKV."""
    heads, kv = 2 * world, world
    fused = (heads + 2 * kv) * HEAD_DIM
    return [(heads * HEAD_DIM, DIM), (kv * HEAD_DIM, DIM), (fused, DIM), (DIM, fused),
            (heads * HEAD_DIM,), (kv * HEAD_DIM,), (fused,)]


def layers_of(params: list[torch.Tensor], world: int, fused: bool) -> dict[str, AttentionLayer]:
    heads, kv = 2 * world, world
    layers = {"sep": AttentionLayer(params[0], params[1], heads, HEAD_DIM, kv, q_bias=params[4], k_bias=params[5])}
    if fused:
        k_rows = heads * HEAD_DIM
        layers["rows"] = AttentionLayer(params[2], params[2], heads, HEAD_DIM, kv, k_offset=k_rows,
                                        q_bias=params[6], k_bias=params[6])
        layers["cols"] = AttentionLayer(params[3], params[3], heads, HEAD_DIM, kv, k_offset=k_rows, out_dim=1)
    return layers


def records(rank: int, step: int, heads: int) -> torch.Tensor:
    """What ``rank`` records for one layer at ``step``: about half of the heads over τ."""
    return torch.rand(heads, generator=torch.Generator().manual_seed(1000 * step + rank)) * 2 * TAU


def clip_steps(layout: str | None, dtype: torch.dtype, world: int, recorders: int = 1, fused: bool = True) -> dict:
    """STEPS steps of Muon and QK-clip on the layers above (``fused``: the fused ones too);
    ``layout`` None: the single-process reference, recording for each head the largest of what
    ``recorders`` ranks record."""
    rank = dist.get_rank() if layout else 0
    if layout == "tp":
        mesh, placements = init_device_mesh("cpu", (world,)), [Shard(0)]
    elif layout == "fsdp+tp":  # the rows of q, k and their biases over a (dp, tp) mesh, as FSDP over TP holds them
        mesh, placements = init_device_mesh("cpu", (2, world // 2)), [_StridedShard(0, split_factor=2), Shard(0)]
    else:
        mesh, placements = placements_for(layout, world) if layout else (None, None)
    place = partial(distribute_tensor, device_mesh=mesh, placements=placements, src_data_rank=None) \
        if layout == "fsdp+tp" else partial(as_layout, mesh=mesh, placements=placements)
    params = [nn.Parameter(place(t.to(dtype))) for t in full_tensors(shapes(world), seed=0)]
    if layout:
        opt = dmuon.Muon([{"params": params[:MATRICES], "algorithm": "muon", "param_names": NAMES[:MATRICES]},
                          {"params": params[MATRICES:], "algorithm": "adamw", "param_names": NAMES[MATRICES:]}],
                         **HPARAMS)
    else:
        opt = ReferenceMuon(params, **HPARAMS)
    clip = QKClip(opt, layers_of(params, world, fused), threshold=TAU)
    clipped = []
    for step in range(STEPS):
        for p, g in zip(params[:MATRICES], full_tensors(shapes(world)[:MATRICES], seed=100 + step)):
            p.grad = place(g.to(dtype))
        for i, name in enumerate(clip.layers):
            heads = 2 * world
            if layout == "tp":  # every rank saw the batch, and computed its own heads
                clip.record(name, records(0, step + 10 * i, heads)[2 * rank:2 * rank + 2],
                            heads=slice(2 * rank, 2 * rank + 2))
            elif layout:
                clip.record(name, records(rank, step + 10 * i, heads))
            else:
                every = [records(r, step + 10 * i, heads) for r in range(recorders)]
                clip.record(name, torch.stack(every).amax(dim=0))
        opt.step()
        clipped.append(clip.statistics()["qk_clip/heads_clipped"])
    return dict(params=[full_tensor(p) for p in params], clipped=clipped)


@pytest.mark.parametrize("layout,world,dtype", [
    ("ddp", 1, torch.float32), ("ddp", 2, torch.float32), ("ddp", 3, torch.float32), ("ddp", 2, torch.bfloat16),
    ("fsdp", 2, torch.float32), ("fsdp", 3, torch.float32), ("fsdp", 3, torch.bfloat16),
    ("hsdp", 4, torch.float32), ("tp", 2, torch.float32), ("tp", 3, torch.float32), ("tp", 3, torch.bfloat16),
    ("fsdp+tp", 4, torch.float32), ("fsdp+tp", 4, torch.bfloat16),
])
def test_a_clipped_step_matches_one_process_bitwise(layout, world, dtype):
    # a fused weight's heads are not whole on each rank under tensor parallel's Shard(0), and its
    # 10 rows do not split evenly over FSDP x TP's four
    fused = layout not in ("tp", "fsdp+tp")
    results = run_on_ranks(world, clip_steps, layout, dtype, world, fused=fused)
    # tensor-parallel ranks record the same batch's heads, data-parallel ranks their own batches'
    reference = single_process(clip_steps, None, dtype, world, 1 if layout == "tp" else world, fused)
    assert all(c > 0 for c in reference["clipped"])  # the clip had work to do at every step
    for r in results:
        assert r["clipped"] == reference["clipped"]
        for name, got, want in zip(NAMES, r["params"], reference["params"]):
            assert torch.equal(got, want), name


CLIP_TAU = 0.01  # under the tiny model's logits: the clip works at every step


@pytest.fixture(scope="module")
def clipped_reference() -> dict:
    return single_process(train_llama, None, qk_threshold=CLIP_TAU)


@pytest.mark.parametrize("parallel,world", [("ddp", 2), ("ddp", 3), ("fsdp", 3), ("hsdp", 4), ("owner", 2),
                                            ("owner", 3)])
def test_training_with_the_clip_matches_one_process(clipped_reference, parallel, world):
    unclipped = single_process(train_llama, None)
    results = run_on_ranks(world, train_llama, parallel, qk_threshold=CLIP_TAU)
    assert all(c > 0 for c in clipped_reference["heads_clipped"])
    q = "layers.0.attn.q_proj.weight"
    assert not torch.allclose(clipped_reference["params"][q], unclipped["params"][q], rtol=1e-3, atol=0)
    for r in results:
        assert r["heads_clipped"] == clipped_reference["heads_clipped"]
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(clipped_reference["losses"]), rtol=1e-5,
                                   atol=1e-6)
        for name, value in r["params"].items():
            torch.testing.assert_close(value, clipped_reference["params"][name], rtol=1e-4, atol=1e-5, msg=name)
        for name, value in r["params"].items():  # replicas stay identical
            assert torch.equal(value, results[0]["params"][name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_for_model_under_fsdp_and_tensor_parallel_clips_the_heads_one_process_clips(clipped_reference, dtype):
    """(dp=2, tp=2), each attention module counting its rank's heads (torchtitan's layout): the
    clip takes the global head counts from the weights and records each rank's heads in their
    own slots, so the run is one process's (fp32: to the training-parity tolerance; bf16: the
    same heads clipped, identical replicas)."""
    reference = clipped_reference if dtype == torch.float32 else single_process(
        train_llama, None, dtype=dtype, qk_threshold=CLIP_TAU)
    results = run_on_ranks(4, train_llama, "fsdp+tp", dtype=dtype, qk_threshold=CLIP_TAU)
    for r in results:
        assert r["heads_clipped"] == reference["heads_clipped"] and all(c > 0 for c in r["heads_clipped"])
        for name, value in r["params"].items():
            assert torch.equal(value, results[0]["params"][name]), name
            if dtype == torch.float32:
                torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=1e-5, msg=name)
        if dtype == torch.float32:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=1e-5,
                                       atol=1e-6)


def plain_params_and_optimizer() -> tuple[list[nn.Parameter], dmuon.Muon]:
    params = [nn.Parameter(t.clone()) for t in full_tensors(shapes(2), seed=0)]
    return params, dmuon.Muon([{"params": params, "param_names": NAMES}], **HPARAMS)


def a_bad_record_on_one_rank() -> dict:
    """A step whose clip fails, beside the same step with no clip: the weights must match."""
    results = []
    for with_clip in (True, False):
        params, opt = plain_params_and_optimizer()
        if with_clip:
            clip = QKClip(opt, layers_of(params, 2, fused=True), threshold=TAU)
            for name in clip.layers:
                clip.record(name, torch.full((4,), 10 * TAU))  # every head over τ
            if dist.get_rank() == 1:
                clip.record("sep", torch.ones(3))
        for p, g in zip(params, full_tensors(shapes(2), seed=1)):
            p.grad = g
        results.append((error_of(opt.step), [p.detach().clone() for p in params]))
    (error, clipped), (_, plain) = results
    return dict(error=error, unscaled=all(torch.equal(a, b) for a, b in zip(clipped, plain)))


def test_a_bad_record_on_one_rank_is_raised_on_every_rank_before_the_clip_changes_a_weight():
    results = run_on_ranks(2, a_bad_record_on_one_rank)
    assert_same_error([r["error"].replace("recorded (3,) for heads [0, 4) of its 4 heads (one value per head)",
                                          "a bad record on another rank") for r in results],
                      r"ValueError: QKClip: attention layer 'sep': a bad record on another rank\. "
                      r"Nothing was clipped\.")
    assert "recorded (3,)" in results[1]["error"]
    assert all(r["unscaled"] for r in results)  # the optimizer stepped; the clip scaled nothing


def ranks_with_other_clips(case: str) -> dict:
    """A QKClip built on one rank only (``"one rank"``) or with other layers on rank 1: its
    construction is local, and the step refuses on every rank before any weight changes."""
    params, opt = plain_params_and_optimizer()
    layers = layers_of(params, 2, fused=True)
    if case == "other layers" and dist.get_rank() == 1:
        layers["sep"] = AttentionLayer(params[0], params[1], 4, HEAD_DIM, 1, k_bias=params[5])
    if case == "other layers" or dist.get_rank() == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rank 1's k_weight has rows no head covers
            QKClip(opt, layers, threshold=TAU)
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, full_tensors(shapes(2), seed=1)):
        p.grad = g
    return dict(error=error_of(opt.step), unchanged=all(torch.equal(a, p) for a, p in zip(before, params)))


@pytest.mark.parametrize("case,pattern", [
    ("other layers", r"ValueError: Ranks disagree on the optimizer configuration: QKClip attention layer 'sep' is "
                     r"\(4, 2, 3.* on rank 0 but \(4, 1, 3.* on rank 1"),
    ("one rank", r"ValueError: Ranks disagree on the optimizer configuration: QKClip threshold is 1.0 on rank 0 but "
                 r"missing on rank 1"),
])
def test_ranks_with_other_clips_are_refused_at_the_step_on_every_rank(case, pattern):
    results = run_on_ranks(2, ranks_with_other_clips, case)
    assert_same_error([r["error"] for r in results], pattern)
    assert all(r["unchanged"] for r in results)
