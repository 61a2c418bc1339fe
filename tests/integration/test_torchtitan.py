"""``dmuon.Muon`` inside torchtitan (0.3.0): its optimizer container, lr schedulers and DCP
checkpoint manager, on gloo ranks with FSDP2.

torchtitan's own models do not train on CPU (FlexAttention has no CPU backward), so the runs
train the tiny Llama of ``dmuon.tools.models`` through torchtitan's components; torchtitan's
Llama 3 is built (not trained) to check how its parameters are routed. torchtitan is in the test
extra; these tests need it, except on Python 3.10, which torchtitan does not support.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dmuon
from dmuon.tools.models import Llama, SyntheticTokens, get_config
from tests.harness import run_on_ranks
from tests.helpers import assert_same_error, error_of, lm_loss, single_process, whole_params

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="torchtitan 0.3.0 needs Python >= 3.11")

STEPS, SAVE_AT, GLOBAL_BATCH, SEQ_LEN = 5, 3, 12, 16
GROUP_OPTIONS = dict(lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32, adamw_lr=0.004)
WARMUP_STEPS = 2


def schedulers_for(optimizers):
    from torchtitan.components.optimizer import LRSchedulersContainer

    return LRSchedulersContainer.Config(warmup_steps=WARMUP_STEPS).build(optimizers=optimizers, training_steps=STEPS)


def sharded_model(dtype: torch.dtype):
    """The tiny Llama, under FSDP2 over every rank when there are several."""
    model = Llama(get_config("tiny"), seed=0).to(dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def flat_state(container) -> dict[str, object]:
    """The container's flat, FQN-keyed state dict with whole tensors (collective)."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in container.state_dict().items()}


def train(folder: str | None = None, *, resume: bool = False, dtype: torch.dtype = torch.float32,
          torchtitan: bool = True) -> dict:
    """Train ``STEPS`` steps with data split across ranks, as torchtitan's trainer steps:
    optimizers, then lr schedulers, then a checkpoint at ``SAVE_AT`` (into ``folder``); with
    ``resume``, load that checkpoint first and train the steps after it. ``torchtitan=False``:
    the reference, a plain ``dmuon.Muon(model)`` under the same lr schedule."""
    from torchtitan.components.checkpoint import CheckpointManager

    from dmuon.integrations.torchtitan import dmuon_optimizer_config

    torch.manual_seed(0)
    model = sharded_model(dtype)
    if torchtitan:
        optimizers = dmuon_optimizer_config(**GROUP_OPTIONS).build(model_parts=[model])
        (optimizer,) = optimizers.dmuon_optimizers
    else:
        optimizer = dmuon.Muon(model, **GROUP_OPTIONS)
        optimizers = [optimizer]
    schedulers = schedulers_for(optimizers)
    checkpoints = None
    if folder is not None:
        checkpoints = CheckpointManager(
            CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0),
            dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers, states={},
            sd_adapter=None, base_folder=folder)
    first = 0
    if resume:
        assert checkpoints.load(step=SAVE_AT)
        first = SAVE_AT
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    data = SyntheticTokens(get_config("tiny").vocab_size, seed=0)
    losses = []
    for step in range(first, STEPS):
        inputs, targets = data.local_batch(step, GLOBAL_BATCH, SEQ_LEN, rank, world)
        loss = lm_loss(model, inputs, targets)
        loss.backward()
        optimizers.step() if torchtitan else optimizer.step()
        schedulers.step()
        optimizers.zero_grad() if torchtitan else optimizer.zero_grad()
        if world > 1:
            dist.all_reduce(loss := loss.detach().clone(), op=dist.ReduceOp.AVG)
        losses.append(loss.item())
        if checkpoints is not None and step + 1 == SAVE_AT and not resume:
            assert checkpoints.save(curr_step=step + 1)
    if checkpoints is not None:
        checkpoints.close()
    return dict(losses=losses, params=whole_params(model), routes=optimizer.routes(),
                lrs=[g["lr"] for g in optimizer.param_groups],
                state=flat_state(optimizers) if torchtitan else None)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_container_trains_as_dmuon_muon_in_one_process(world):
    reference = single_process(train, torchtitan=False)
    for result in run_on_ranks(world, train):
        assert result["routes"] == reference["routes"]  # FQNs route as the model's module types do
        assert result["lrs"] == reference["lrs"]
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]),
                                   rtol=1e-5, atol=1e-6)
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert any(r.algorithm == "muon" for r in reference["routes"].values())
    assert {reference["routes"][n].algorithm for n in ("embed_tokens.weight", "lm_head.weight")} == {"adamw"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_round_trip_resumes_bitwise(tmp_path, dtype):
    """torchtitan's CheckpointManager saves the flat state dict through DCP at step 3; a fresh
    job (its container creating state by a zero-gradient step before the load) resumes and
    steps 4-5 equal the uninterrupted run's bitwise: weights, losses and every optimizer state
    entry and group key, dmuon's own included."""
    straight = run_on_ranks(2, train, str(tmp_path), dtype=dtype)
    resumed = run_on_ranks(2, train, str(tmp_path), resume=True, dtype=dtype)
    for a, b in zip(straight, resumed):
        assert a["losses"][SAVE_AT:] == b["losses"]
        assert a["params"].keys() == b["params"].keys()
        for name, value in a["params"].items():
            assert torch.equal(value, b["params"][name]), name
        assert a["state"].keys() == b["state"].keys()
        assert any(key.endswith(".route_reasons") for key in a["state"])
        for key, value in a["state"].items():
            same = torch.equal(value, b["state"][key]) if isinstance(value, torch.Tensor) else value == b["state"][key]
            assert same, key


def bad_configs():
    """Each config and the error it must raise, on every rank, before any collective."""
    from torchtitan.components.optimizer import ParamGroupConfig

    from dmuon.integrations.torchtitan import DMuonOptimizersContainer, dmuon_optimizer_config

    return [
        (dmuon_optimizer_config(momentun=0.9),
         r"ValueError: Unknown option\(s\) \['momentun'\] in param group 0.* Did you mean 'momentum'\?"),
        (dmuon_optimizer_config(muon_options={"comm_dtpye": torch.bfloat16}),
         r"TypeError: .*'comm_dtpye'.*'comm_dtype'"),
        (DMuonOptimizersContainer.Config(param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="Dmuon",
                                                                        optimizer_kwargs={"lr": 0.02})]),
         r"NotImplementedError: Unknown optimizer_name 'Dmuon'.* Did you mean 'DMuon'\?"),
    ]


def build_bad_configs() -> list[str | None]:
    model = sharded_model(torch.float32)
    return [error_of(lambda c=config: c.build(model_parts=[model])) for config, _ in bad_configs()]


def test_bad_configs_name_the_option_and_dmuons_nearest_on_every_rank():
    patterns = [pattern for _, pattern in bad_configs()]
    per_rank = run_on_ranks(2, build_bad_configs)
    for i, pattern in enumerate(patterns):
        assert_same_error([errors[i] for errors in per_rank], pattern)


def test_a_torchtitan_config_with_dmuon_builds_and_routes_torchtitans_llama3():
    """docs/integrations.md's snippet on torchtitan's Llama 3 debug config: its model (built on
    CPU, not trained) gets a ``dmuon.Muon`` whose token embedding and output head go to AdamW,
    hidden matrices to Muon, norms to AdamW; torchtitan's lr scheduler drives it."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from dmuon.integrations.torchtitan import DMuonOptimizersContainer, dmuon_optimizer_config

    config = llama3_debugmodel()
    config.optimizer = dmuon_optimizer_config(lr=0.02, weight_decay=0.1, adamw_lr=8e-4)
    torch.manual_seed(0)
    model = config.model_spec.model.build()
    optimizers = config.optimizer.build(model_parts=[model])
    assert isinstance(optimizers, DMuonOptimizersContainer)
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=config.training.steps)
    (optimizer,) = optimizers.dmuon_optimizers
    routes = optimizer.routes()
    hidden = [n for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("layers.")]
    assert hidden and all(routes[n].algorithm == "muon" for n in hidden)
    others = [n for n in routes if n not in hidden]
    assert any("tok_embeddings" in n for n in others) and any("lm_head" in n for n in others)
    assert all(routes[n].algorithm == "adamw" for n in others), {n: routes[n] for n in others}
    warmup = [group["lr"] for group in optimizer.param_groups]
    optimizers.step()  # as torchtitan's trainer steps: optimizers, then schedulers (no gradients: nothing moves)
    schedulers.step()
    assert all(after > before for after, before in zip([g["lr"] for g in optimizer.param_groups], warmup))
