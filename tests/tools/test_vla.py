"""The embodied (vision–language–action) workload of ``dmuon bench --preset vla`` and ``dmuon
plan --model vla|pi0``: its shapes as the cost model counts them equal the model's, it routes as
its docstring says (the frozen tower in no step), its data is a pure function of the step, and
dmuon trains it under DDP and FSDP2 as one process does."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.tools.cli import main
from dmuon.tools.models import VLA_PRESETS, get_config, muon_units, param_count, trainable_params, training_bytes
from dmuon.tools.vla import VLA, SyntheticEpisodes, vla_loss
from dmuon.tools.workloads import local_batch, training_loss
from tests.harness import run_on_ranks
from tests.helpers import held_and_saved_bytes, single_process, whole_params

TRAINED_TOWER = dataclasses.replace(get_config("vla-tiny"), freeze_vision=False)


def routed_muon(model: torch.nn.Module) -> list[tuple[str, int, int, int]]:
    """(name, 1, rows, columns) of what ``dmuon.Muon(model)`` orthogonalizes in a step."""
    routes = dmuon.Muon(model, lr=0.01).routes()
    return [(name, 1, *p.shape) for name, p in model.named_parameters()
            if p.requires_grad and routes[name].algorithm == "muon"]


@pytest.mark.parametrize("config", [get_config("vla-tiny"), get_config("vla"), TRAINED_TOWER],
                         ids=["vla-tiny", "vla", "trained-tower"])
def test_the_cost_models_shapes_are_the_models(config):
    model = VLA(config)
    assert param_count(config) == sum(p.numel() for p in model.parameters())
    assert trainable_params(config) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert muon_units(config) == routed_muon(model)


def test_pi0s_shapes_are_the_models_and_its_published_sizes():
    config = get_config("pi0")
    with torch.device("meta"):
        model = VLA(config)
    assert param_count(config) == sum(p.numel() for p in model.parameters())
    assert trainable_params(config) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # SigLIP So400m's tower about 0.4 B, Gemma 2B's 2.5 B with its embedding, the expert about 0.3 B
    assert 0.40e9 < param_count(config) - trainable_params(config) < 0.43e9
    assert 3.1e9 < param_count(config) < 3.4e9


def test_routing_sends_the_towers_input_embedding_to_adamw_and_its_blocks_to_muon():
    routes = dmuon.Muon(VLA(TRAINED_TOWER), lr=0.01).routes()
    assert routes["vision.patch_embed.weight"].algorithm == "adamw"  # a convolution named as an embedding
    assert routes["vision.pos_embed"].algorithm == "adamw"
    assert routes["vision.layers.0.q_proj.weight"].algorithm == "muon"
    assert routes["projector.weight"].algorithm == "muon"
    for name in ("embed_tokens.weight", "action_in_proj.weight", "action_out_proj.weight"):
        assert routes[name].algorithm == "adamw", name


def test_the_frozen_tower_is_in_no_plan_and_never_changes():
    config = get_config("vla-tiny")
    model = VLA(config)
    opt = dmuon.Muon(model, lr=0.02)
    assert [u.name for u in opt.plan.units] == [name for name, *_ in muon_units(config)]
    tower = {n: p.detach().clone() for n, p in model.vision.named_parameters()}
    data = SyntheticEpisodes(config)
    losses = []
    for step in range(8):
        batch = data.batch(step, 4)
        loss = vla_loss(model(batch.images, batch.tokens, batch.noisy_actions), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(p.grad is None and torch.equal(p, tower[n]) for n, p in model.vision.named_parameters())
    assert opt.last_step_stats.matrices_orthogonalized == len(muon_units(config))
    assert losses[-1] < losses[0]


def test_episodes_are_a_pure_function_of_the_step_and_split_by_rank():
    data = SyntheticEpisodes(get_config("vla-tiny"), seed=3)
    whole = data.batch(5, 6)
    again = SyntheticEpisodes(get_config("vla-tiny"), seed=3).batch(5, 6)
    assert all(torch.equal(a, b) for a, b in zip(whole, again))
    assert not torch.equal(whole.images, data.batch(6, 6).images)
    parts = [data.local_batch(5, 6, rank, 3) for rank in range(3)]
    assert all(torch.equal(torch.cat([p[i] for p in parts]), whole[i]) for i in range(len(whole)))


def test_the_memory_floor_is_below_what_a_training_step_holds():
    config = get_config("vla-tiny")
    held, saved = held_and_saved_bytes(VLA(config), SyntheticEpisodes(config).batch(0, 4))
    parameters, activations = training_bytes(config, 4, config.max_seq_len)
    assert parameters <= held and activations <= saved, (parameters, held, activations, saved)


STEPS, GLOBAL_BATCH = 4, 12


def train_vla(parallel: str | None, dtype: torch.dtype = torch.float32) -> dict:
    """The tiny VLA trained by ``dmuon.Muon``; ``parallel``: None (one process), "ddp" or "fsdp"
    (each joint layer and the root, as ``dmuon bench`` wraps it), the batch split over the ranks."""
    config = get_config("vla-tiny")
    model = VLA(config, seed=0).to(dtype)
    rank, world = (dist.get_rank(), dist.get_world_size()) if parallel else (0, 1)
    wrapped = model
    if parallel == "ddp":
        wrapped = DistributedDataParallel(model)
    elif parallel == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        wrapped = fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32)
    data = SyntheticEpisodes(config)
    losses = []
    for step in range(STEPS):
        batch = local_batch(data, step, GLOBAL_BATCH, config.max_seq_len, rank, world, torch.device("cpu"))
        batch = type(batch)(*(t.to(dtype) if t.is_floating_point() else t for t in batch))
        loss = training_loss(wrapped, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if parallel:
            dist.all_reduce(loss := loss.detach().clone(), op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    return dict(params=whole_params(model), matrices=opt.last_step_stats.matrices_orthogonalized, losses=losses)


@pytest.mark.parametrize("parallel,world,dtype", [
    ("fsdp", 1, torch.float32), ("fsdp", 2, torch.float32), ("fsdp", 3, torch.float32), ("fsdp", 4, torch.float32),
    ("ddp", 3, torch.float32), ("fsdp", 2, torch.bfloat16),
])
def test_dmuon_trains_the_vla_under_data_parallel_as_one_process(parallel, world, dtype):
    """fp32: the weights within reduction-order tolerance; bf16: the losses within 2 % (AdamW's
    sign-like updates of near-zero bf16 gradients differ by whole steps between reduction orders)."""
    reference = single_process(train_vla, None, dtype)
    results = run_on_ranks(world, train_vla, parallel, dtype)
    units = len(muon_units(get_config("vla-tiny")))
    assert sum(r["matrices"] for r in results) == units  # each orthogonalized once in the job
    for result in results:
        for name, value in result["params"].items():
            assert torch.equal(value, results[0]["params"][name]), name  # replicas bitwise
            if dtype == torch.float32:
                torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=1e-5, msg=name)
        loss_tolerance = dict(rtol=2e-2, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), **loss_tolerance)


def test_bench_runs_the_vla_and_gives_its_verdict(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--preset", "vla-tiny", "--steps", "2", "--warmup", "0", "--max-seconds", "0",
                 "--memory-steps", "0", "--configs", "fsdp-adamw,fsdp-torch-muon,fsdp-dmuon",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "vla-tiny preset" in printed and "the vision tower frozen" in printed and "fsdp-dmuon " in printed
    records = json.loads(out.read_text())
    # FSDP2's traffic at 2 ranks: half of (the root's parameters + twice the layers' + the trained gradients)
    model = VLA(get_config("vla-tiny"))
    total = 4 * sum(p.numel() for p in model.parameters())
    layers = 4 * sum(p.numel() for p in model.layers.parameters())
    frozen = 4 * sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert records[0]["train_bytes_per_step"] == pytest.approx(0.5 * ((total - layers) + 2 * layers + total - frozen))
    assert all(r["step_ms"] > 0 and r["final_loss"] > 0 for r in records)


@pytest.mark.parametrize("world", [64, 256])
def test_plan_predicts_pi0_and_prints_its_balance(world, capsys):
    assert main(["plan", "--model", "pi0", "--world-size", str(world), "--hardware", "h100"]) == 0
    printed = capsys.readouterr().out
    assert "pi0 (3.23 B parameters, 412 M frozen" in printed
    assert "imbalance (max/mean NS FLOPs)" in printed and "dmuon (fsdp2)" in printed
    assert "vision" not in printed  # the frozen tower has no Muon parameter


def test_every_vla_preset_is_valid_and_named_in_bench_and_plan():
    assert set(VLA_PRESETS) == {"vla-tiny", "vla", "pi0"}
    with pytest.raises(ValueError, match="attends with the language model"):
        dataclasses.replace(get_config("vla"), action=dataclasses.replace(get_config("vla").action, n_heads=4))
