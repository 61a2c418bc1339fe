"""Update rules (dmuon.rules) and momentum in a smaller dtype on real processes: NorMuon's step
equals the single-process reference bitwise in fp32 under DDP, FSDP2 and HSDP at 1–4 ranks (bf16
and every other layout: tests/distributed/test_low_precision.py), under early start and owner
sharding, and so does bf16 momentum; the row state and the bf16 momentum round-trip through
torch.distributed.checkpoint across layouts and world sizes, and training goes on bitwise as it
would have without the round trip."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import dmuon
from tests.distributed.test_distributed_step import SHAPES, step_parity
from tests.harness import WORLD_SIZES, run_on_ranks
from tests.helpers import dcp_load, dcp_save, error_of, full_tensor, full_tensors, train_llama

ROW_STATE = "row_second_moment"


@pytest.mark.parametrize("layout,world", [*(("ddp", w) for w in WORLD_SIZES), *(("fsdp", w) for w in (2, 3, 4)),
                                          ("hsdp", 4)])
def test_normuon_step_is_bitwise_equal_to_single_process(layout, world):
    results = run_on_ranks(world, step_parity, layout, SHAPES, 3, None, update_rule="normuon", beta2=0.9)
    for rank, r in enumerate(results):
        assert len(r["equal_row_states"]) == len(SHAPES), rank
        assert all(r["equal_row_states"]) and all(r["equal_momentum"]) and all(r["equal_params"]), (rank, r)


@pytest.mark.parametrize("layout,world", [("ddp", 2), ("ddp", 3), ("fsdp", 2), ("fsdp", 3), ("hsdp", 4)])
def test_bf16_momentum_step_is_bitwise_equal_to_single_process(layout, world):
    """``momentum_dtype=torch.bfloat16`` beside fp32 weights: the buffers bf16, every rank's and the
    reference's the same bits (the reference keeps its momentum in bf16 too)."""
    for rank, r in enumerate(run_on_ranks(world, step_parity, layout, SHAPES, 3, None, momentum_dtype=torch.bfloat16,
                                          update_rule="normuon")):
        assert all(r["equal_row_states"]) and all(r["equal_momentum"]) and all(r["equal_params"]), (rank, r)
        assert r["momentum_dtypes"] == {torch.bfloat16}, rank


@pytest.mark.parametrize("parallel,world", [("owner", 3), ("fsdp", 2)])
def test_normuon_under_owner_sharding_and_early_start_trains_as_one_process(parallel, world):
    """The tiny Llama: owner sharding steps each matrix on its owner alone; FSDP2 with early
    start begins the owners' NorMuon in the backward pass and writes the row states at step()."""
    early = True if parallel == "fsdp" else None
    reference = run_on_ranks(1, train_llama, None, update_rule="normuon")[0]
    results = run_on_ranks(world, train_llama, parallel, early_start=early, update_rule="normuon")
    for r in results:
        if early:
            assert r["early_buckets"][0] > 0  # buckets begun in the backward pass
        torch.testing.assert_close(r["losses"], reference["losses"], rtol=1e-5, atol=1e-6)
        for name, value in reference["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kept", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("parallel,world", [("fsdp", 2), ("owner", 3)])
def test_small_momentum_under_early_start_is_bitwise_the_step_at_step_time(parallel, world, kept):
    """Early start computes the momentum out of place during the backward pass; with bf16 buffers
    or 8-bit blocks beside fp32 weights it gives the bits of the step computed at ``step()``."""
    on = run_on_ranks(world, train_llama, parallel, early_start=True, momentum_dtype=kept, update_rule="normuon")
    off = run_on_ranks(world, train_llama, parallel, early_start=False, momentum_dtype=kept, update_rule="normuon")
    for a, b in zip(on, off):
        assert a["early_buckets"][0] > 0 and a["state_dtypes"] == {torch.float32, kept}
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][name], value) for name, value in b["params"].items())


# ---------------------------------------------------------------- checkpoints across layouts

CKPT_SHAPES = [(32, 48), (24, 16), (16, 16)]
CKPT_HPARAMS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, ns_method="standard", ns_dtype=torch.float32,
                    update_rule="normuon")
LAYOUT_MESHES = {"fsdp": (lambda w: (w,), [Shard(0)]), "fsdp x tp": (lambda w: (2, w // 2), [Shard(0), Shard(1)]),
                 "one process": (None, None)}


class Weights(nn.Module):
    """Matrices as parameters, in a layout: the optimizer sees DTensors as FSDP2 × TP gives them."""

    def __init__(self, layout: str, dtype: torch.dtype = torch.float32, shapes: list = CKPT_SHAPES) -> None:
        super().__init__()
        mesh_shape, placements = LAYOUT_MESHES[layout]
        self.mesh = init_device_mesh("cpu", mesh_shape(dist.get_world_size())) if mesh_shape else None
        self.placements, self.dtype, self.shapes = placements, dtype, shapes
        self.ws = nn.ParameterList(nn.Parameter(self.place(t)) for t in full_tensors(shapes, 0))

    def place(self, t: torch.Tensor) -> torch.Tensor:
        t = t.to(self.dtype)
        return t.clone() if self.mesh is None else distribute_tensor(t.clone(), self.mesh, self.placements)

    def step(self, opt: dmuon.Muon, step: int) -> None:
        for w, g in zip(self.ws, full_tensors(self.shapes, 100 + step)):
            w.grad = self.place(g)
        opt.step()


def saved_then_continued(path: str, steps: int, more: int, dtype: torch.dtype = torch.float32,
                         options: dict | None = None) -> dict:
    """FSDP2: ``steps`` steps, a checkpoint, then ``more`` steps without any round trip."""
    model = Weights("fsdp", dtype, _shapes(options))
    opt = dmuon.Muon([{"params": list(model.ws), "algorithm": "muon"}], **{**CKPT_HPARAMS, **(options or {})})
    for step in range(steps):
        model.step(opt, step)
    dcp_save(model, opt, path)
    saved = [full_tensor(opt.state[w][ROW_STATE]) for w in model.ws]
    momentum = [momentum_of(opt, w) for w in model.ws]
    for step in range(steps, steps + more):
        model.step(opt, step)
    return dict(saved_row_states=saved, saved_momentum=momentum, params=[full_tensor(w) for w in model.ws])


def momentum_of(opt: dmuon.Muon, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The whole momentum state of ``w``: its buffer, and 8-bit momentum's scales."""
    return tuple(full_tensor(opt.state[w][key]) for key in ("momentum_buffer", "momentum_scale")
                 if key in opt.state[w])


def _shapes(options: dict | None) -> list:
    return INT8_SHAPES if (options or {}).get("momentum_dtype") == torch.int8 else CKPT_SHAPES


def loaded_then_continued(path: str, layout: str, steps: int, more: int, dtype: torch.dtype = torch.float32,
                          options: dict | None = None) -> dict:
    model = Weights(layout, dtype, _shapes(options))
    opt = dmuon.Muon([{"params": list(model.ws), "algorithm": "muon"}], **{**CKPT_HPARAMS, **(options or {})})
    dcp_load(model, opt, path)
    loaded = [full_tensor(opt.state[w][ROW_STATE]) for w in model.ws]
    momentum = [momentum_of(opt, w) for w in model.ws]
    for step in range(steps, steps + more):
        model.step(opt, step)
    return dict(loaded_row_states=loaded, loaded_momentum=momentum, params=[full_tensor(w) for w in model.ws],
                row_states=[full_tensor(opt.state[w][ROW_STATE]) for w in model.ws])


BF16_MOMENTUM = {"momentum_dtype": torch.bfloat16}
INT8_MOMENTUM = {"momentum_dtype": torch.int8}
# 8-bit blocks of 128 columns, kept whole by the TP split of dim 1 over 2 ranks
INT8_SHAPES = [(32, 256), (24, 512), (9, 768)]


@pytest.mark.parametrize("layout,world,dtype,options", [
    ("fsdp x tp", 4, torch.float32, None), ("one process", 1, torch.float32, None), ("fsdp", 3, torch.float32, None),
    ("fsdp x tp", 4, torch.bfloat16, None), ("fsdp x tp", 4, torch.float32, BF16_MOMENTUM),
    ("one process", 1, torch.float32, BF16_MOMENTUM), ("fsdp x tp", 4, torch.float32, INT8_MOMENTUM),
    ("fsdp x tp", 4, torch.bfloat16, INT8_MOMENTUM), ("one process", 1, torch.bfloat16, INT8_MOMENTUM),
    ("fsdp", 3, torch.float32, INT8_MOMENTUM)])
def test_normuon_checkpoint_loads_across_layouts_and_training_goes_on_bitwise(tmp_path, layout, world, dtype, options):
    """bf16 weights too: their row state stays fp32 through the load (torch's load casts state to
    the parameter's dtype; dmuon puts it back uncast); and momentum kept in bf16 beside fp32
    weights, or in 8-bit blocks (int8 codes and fp32 scales, resharded as saved)."""
    path = str(tmp_path / "ckpt")
    saved = run_on_ranks(2, saved_then_continued, path, 2, 2, dtype, options)[0]
    for rank, loaded in enumerate(run_on_ranks(world, loaded_then_continued, path, layout, 2, 2, dtype, options)):
        for i, (got, want) in enumerate(zip(loaded["loaded_row_states"], saved["saved_row_states"])):
            assert got.dtype == torch.float32 and torch.equal(got, want), (rank, i)
        kept = (options or {}).get("momentum_dtype", dtype)
        for i, (got, want) in enumerate(zip(loaded["loaded_momentum"], saved["saved_momentum"])):
            assert [t.dtype for t in got] == [t.dtype for t in want] == [kept, torch.float32][:len(want)], (rank, i)
            assert len(want) == (2 if kept == torch.int8 else 1)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (rank, i)
            assert want[0].abs().sum() > 0  # a state worth carrying
        for i, (got, want) in enumerate(zip(loaded["params"], saved["params"])):
            assert torch.equal(got, want), f"rank {rank}: w{i} after the round trip differs"


def normuon_checkpoint_into_muon() -> list[str | None]:
    """A NorMuon state dict into a Muon optimizer and back: refused on every rank, nothing lost."""
    model = Weights("fsdp")
    options = {**CKPT_HPARAMS, "update_rule": "muon"}
    normuon = dmuon.Muon([{"params": list(model.ws), "algorithm": "normuon"}], **options)  # the group's own rule
    model.step(normuon, 0)
    plain = dmuon.Muon([{"params": list(model.ws), "algorithm": "muon"}], **options)
    model.step(plain, 0)
    before = [full_tensor(plain.state[w]["momentum_buffer"]) for w in model.ws]
    errors = [error_of(plain.load_state_dict, normuon.state_dict()),
              error_of(normuon.load_state_dict, plain.state_dict())]
    assert all(torch.equal(full_tensor(plain.state[w]["momentum_buffer"]), b) for w, b in zip(model.ws, before))
    assert all(ROW_STATE in normuon.state[w] and ROW_STATE not in plain.state[w] for w in model.ws)
    return errors


def test_normuon_checkpoint_into_a_muon_group_and_back_is_refused_on_every_rank():
    for errors in run_on_ranks(2, normuon_checkpoint_into_muon):
        assert "saved with update_rule='normuon', this optimizer's is 'muon'" in errors[0]
        assert "saved with update_rule='muon', this optimizer's is 'normuon'" in errors[1]
