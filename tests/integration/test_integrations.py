"""Smoke tests: ``dmuon.Muon`` inside Hugging Face Trainer, Accelerate (plain, and its FSDP2 path
at 2 ranks) and Lightning.

Each trains a tiny model built in code (nothing is downloaded) for a few steps on CPU, checks
that Muon updated the hidden matrices and AdamW the rest, saves a checkpoint through the
framework and resumes from it in a fresh run. Every batch is the same batch, so that a resumed
run must match the uninterrupted one bitwise whatever the framework's data-loader position.
Skipped, with the reason, when the framework is not installed (``pip install -e ".[trainers]"``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dmuon
from dmuon.integrations import hf_optimizer_cls_and_kwargs, muon_for_model
from dmuon.tools.models import Llama, SyntheticTokens, get_config
from tests.harness import run_on_ranks

# No network, no telemetry, no tokenizer threads: the tests build everything in code.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true",
}
CONFIG = get_config("tiny")
BATCH, SEQ_LEN = 4, 16
HIDDEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def require(module: str) -> ModuleType:
    """Import ``module`` or skip the test, saying what to install (``-ra`` prints the reason)."""
    return pytest.importorskip(module, reason=f"{module} is not installed; pip install -e '.[trainers]'")


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the block, then restore them (the worker pools outlive tests)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(autouse=True)
def offline() -> Iterator[None]:
    with environment(OFFLINE_ENV):
        yield


def the_batch(rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return SyntheticTokens(CONFIG.vocab_size).local_batch(0, BATCH, SEQ_LEN, rank, world_size)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def algorithm_of(optimizer: dmuon.Muon) -> dict[str, str]:
    """Parameter name -> "muon"/"adamw", read from the optimizer's routes."""
    return {name: route.algorithm for name, route in optimizer.routes().items()}


def assert_routed(optimizer: dmuon.Muon, embedding: str, head: str) -> None:
    routes = algorithm_of(optimizer)
    assert routes[embedding] == routes[head] == "adamw", optimizer.routing_summary()
    hidden = {name for name in routes if any(h in name for h in HIDDEN)}
    assert hidden and all(routes[name] == "muon" for name in hidden), optimizer.routing_summary()
    assert all(routes[name] == "adamw" for name in routes if name not in hidden), optimizer.routing_summary()
    assert optimizer.statistics()["matrices"] == len(hidden)  # the last step orthogonalized every one


def assert_state_equal(a: dict, b: dict) -> None:
    """Optimizer state dicts (or parts of them) equal bitwise, tensors compared as tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_state_equal(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_state_equal(x, y)
    else:
        assert a == b


# ---------------------------------------------------------------- Hugging Face Trainer


def tiny_hf_llama(transformers: ModuleType) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=CONFIG.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def hf_train(transformers: ModuleType, output_dir: str, resume: str | None = None):
    inputs, _ = the_batch()
    dataset = [{"input_ids": inputs[0], "labels": inputs[0]}]  # one example: every step sees the same batch
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=3, per_device_train_batch_size=1, save_strategy="steps", save_steps=2,
        use_cpu=True, report_to="none", logging_strategy="no", disable_tqdm=True, seed=0,
    )
    trainer = transformers.Trainer(
        model=tiny_hf_llama(transformers), args=args, train_dataset=dataset,
        optimizer_cls_and_kwargs=hf_optimizer_cls_and_kwargs(lr=1e-2, weight_decay=0.1),
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_hf_trainer_routes_steps_and_resumes(tmp_path):
    transformers = require("transformers")
    initial = params_of(tiny_hf_llama(transformers))
    full = hf_train(transformers, str(tmp_path / "full"))
    optimizer = full.optimizer.optimizer  # Trainer's Accelerate wrapper around dmuon.Muon
    assert isinstance(optimizer, dmuon.Muon)
    assert_routed(optimizer, "model.embed_tokens.weight", "lm_head.weight")
    decay = {name: group["weight_decay"] for group in optimizer.param_groups for name in group["param_names"]}
    assert decay["model.norm.weight"] == 0.0
    assert decay["lm_head.weight"] == decay["model.layers.0.mlp.up_proj.weight"] == 0.1
    trained = params_of(full.model)
    assert all(not torch.equal(initial[name], trained[name]) for name in trained)

    resumed = hf_train(transformers, str(tmp_path / "resumed"), resume=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.state.global_step == 3
    assert_state_equal(params_of(resumed.model), trained)
    assert_state_equal(resumed.optimizer.optimizer.state_dict(), optimizer.state_dict())


def test_muon_for_model_routes_by_module_type_and_exempts_vectors():
    # No name gives the roles away: an nn.Embedding called "shared" (as in T5), a vocabulary-sized head.
    model = nn.ModuleDict({"shared": nn.Embedding(64, 16), "hidden": nn.Linear(16, 16),
                           "out": nn.Linear(16, 64, bias=False), "norm": nn.LayerNorm(16)})
    optimizer = muon_for_model(model, lr=1e-3, weight_decay=0.1)
    routes = algorithm_of(optimizer)
    decay = {name: group["weight_decay"] for group in optimizer.param_groups for name in group["param_names"]}
    assert routes == {"shared.weight": "adamw", "hidden.weight": "muon", "hidden.bias": "adamw",
                      "out.weight": "adamw", "norm.weight": "adamw", "norm.bias": "adamw"}, optimizer.routing_summary()
    assert decay == {"shared.weight": 0.1, "hidden.weight": 0.1, "hidden.bias": 0.0, "out.weight": 0.1,
                     "norm.weight": 0.0, "norm.bias": 0.0}


def test_hf_trainer_factory_errors_name_the_problem():
    with pytest.raises(TypeError, match="'params'"):
        hf_optimizer_cls_and_kwargs(lr=1e-3, params=[])
    factory, kwargs = hf_optimizer_cls_and_kwargs(lr=1e-3)
    with pytest.raises(TypeError, match="transformers >= 5.2"):  # an older Trainer calls it like a class
        factory([{"params": []}], **kwargs)


# ---------------------------------------------------------------- Accelerate


@contextlib.contextmanager
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps its state in process-wide singletons: start and leave them empty."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def accelerate_train(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, steps: int,
                     rank: int = 0, world_size: int = 1) -> None:
    inputs, targets = the_batch(rank, world_size)
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def test_accelerate_prepare_steps_and_resumes(tmp_path):
    accelerate = require("accelerate")
    with fresh_accelerate_state():
        accelerator = accelerate.Accelerator(cpu=True)
        model = Llama(CONFIG)
        initial = params_of(model)
        model, optimizer = accelerator.prepare(model, dmuon.Muon(model, lr=1e-2))
        accelerate_train(accelerator, model, optimizer, steps=2)
        assert_routed(optimizer.optimizer, "embed_tokens.weight", "lm_head.weight")
        assert all(not torch.equal(initial[name], p) for name, p in model.named_parameters())
        accelerator.save_state(str(tmp_path))

    with fresh_accelerate_state():  # a fresh run: its own Accelerator, model and optimizer
        accelerator = accelerate.Accelerator(cpu=True)
        fresh = Llama(CONFIG, seed=1)
        fresh, fresh_optimizer = accelerator.prepare(fresh, dmuon.Muon(fresh, lr=1e-2))
        accelerator.load_state(str(tmp_path))
        assert_state_equal(params_of(fresh), params_of(model))
        assert_state_equal(fresh_optimizer.state_dict(), optimizer.state_dict())
        accelerate_train(accelerator, fresh, fresh_optimizer, steps=1)


def fsdp2_accelerator():
    """An Accelerator on the worker's gloo group that takes its FSDP2 path on CPU.

    Accelerate reads the job from the environment (it finds the process group already
    initialized and keeps it) and enables its FSDP plugin only on accelerator devices, so the
    state is switched to FSDP by hand: ``prepare`` then runs the same FSDP2 code as on GPUs.
    """
    from accelerate import Accelerator, FullyShardedDataParallelPlugin, PartialState
    from accelerate.utils import DistributedType

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True,
                                            state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(cpu=True)
    accelerator.state.fsdp_plugin = plugin
    # Both singletons: Accelerate copies PartialState's type into AcceleratorState on every access.
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
    return accelerator


def accelerate_fsdp2_on_rank(path: str) -> dict:
    from torch.distributed.tensor import DTensor

    rank, world_size = dist.get_rank(), dist.get_world_size()
    job = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1", **OFFLINE_ENV}
    with environment(job), fresh_accelerate_state():
        accelerator = fsdp2_accelerator()
        assert accelerator.is_fsdp2
        model = Llama(CONFIG)
        optimizer = dmuon.Muon(model, lr=1e-2, ns_dtype=torch.float32)
        model, optimizer = accelerator.prepare(model, optimizer)
        # Accelerate swapped the optimizer's parameters for the sharded ones after construction.
        assert all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
        accelerate_train(accelerator, model, optimizer, steps=2, rank=rank, world_size=world_size)
        muon_stats = optimizer.optimizer.statistics(all_ranks=True)
        accelerator.save_state(path)
        trained = {name: p.full_tensor() for name, p in model.named_parameters()}
    with environment(job), fresh_accelerate_state():
        accelerator = fsdp2_accelerator()
        fresh = Llama(CONFIG, seed=1)
        fresh, fresh_optimizer = accelerator.prepare(fresh, dmuon.Muon(fresh, lr=1e-2, ns_dtype=torch.float32))
        accelerator.load_state(path)
        loaded_params = all(torch.equal(p.full_tensor(), trained[name]) for name, p in fresh.named_parameters())
        loaded_state = all(
            torch.equal(fresh_optimizer.state[fp][key].to_local(), optimizer.state[p][key].to_local())
            for fp, p in zip(fresh.parameters(), model.parameters()) for key in optimizer.state[p]
            if isinstance(optimizer.state[p][key], DTensor)
        )
        accelerate_train(accelerator, fresh, fresh_optimizer, steps=1, rank=rank, world_size=world_size)
    return {"matrices": muon_stats["matrices"], "routes": algorithm_of(optimizer.optimizer),
            "trained": trained, "loaded_params": loaded_params, "loaded_state": loaded_state}


def single_process_reference() -> dict[str, torch.Tensor]:
    """Two steps of the same run in one process, on the global batch."""
    model = Llama(CONFIG)
    optimizer = dmuon.Muon(model, lr=1e-2, ns_dtype=torch.float32)
    inputs, targets = the_batch()
    for _ in range(2):
        model.loss(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return params_of(model)


def test_accelerate_fsdp2_swaps_parameters_steps_and_resumes(tmp_path):
    require("accelerate")
    results = run_on_ranks(2, accelerate_fsdp2_on_rank, str(tmp_path), timeout_s=120)
    reference = single_process_reference()
    for rank, result in enumerate(results):
        assert result["loaded_params"] and result["loaded_state"], f"rank {rank} did not resume the saved state"
        assert result["matrices"] == sum(route == "muon" for route in result["routes"].values()) > 0
        for name, value in result["trained"].items():
            torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------- Lightning


def lightning_train(lightning: ModuleType, checkpoint_dir: str, resume: str | None = None):
    """Three steps (checkpointing after two), or the rest of them from ``resume``."""

    class TinyLlama(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Llama(CONFIG)

        def training_step(self, batch, batch_index):
            inputs, targets = batch
            return self.model.loss(inputs, targets)

        def configure_optimizers(self):
            return dmuon.Muon(self, lr=1e-2)

    inputs, targets = the_batch()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, targets), batch_size=BATCH)
    checkpoints = lightning.callbacks.ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=2, save_top_k=-1)
    trainer = lightning.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, callbacks=[checkpoints],
        enable_progress_bar=False, enable_model_summary=False,
    )
    module = TinyLlama()
    trainer.fit(module, loader, ckpt_path=resume)
    return trainer, module


# a fresh job resumes into its own folder, which Lightning notes against the checkpoint's
@pytest.mark.filterwarnings("ignore:The dirpath has changed")
def test_lightning_configure_optimizers_steps_and_resumes(tmp_path):
    lightning = require("lightning.pytorch")
    initial = params_of(Llama(CONFIG))
    trainer, module = lightning_train(lightning, str(tmp_path))
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, dmuon.Muon)
    assert_routed(optimizer, "model.embed_tokens.weight", "model.lm_head.weight")
    trained = params_of(module.model)
    assert all(not torch.equal(initial[name], trained[name]) for name in trained)  # the closure ran

    saved = sorted(os.listdir(tmp_path))
    assert saved == ["epoch=1-step=2.ckpt"], saved
    resumed_trainer, resumed = lightning_train(lightning, str(tmp_path / "resumed"), resume=str(tmp_path / saved[0]))
    assert resumed_trainer.global_step == 3
    assert_state_equal(params_of(resumed.model), trained)
    assert_state_equal(resumed_trainer.optimizers[0].state_dict(), optimizer.state_dict())


QK_TAU = 0.01  # under the tiny model's logits: the clip works at every step


class _Wrapped(nn.Module):
    """The tiny Llama under the attribute Lightning's module gives it, so that both runs route alike."""

    def __init__(self) -> None:
        super().__init__()
        self.model = Llama(CONFIG)


def lightning_clipped(lightning: ModuleType, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """``steps`` Lightning steps (a closure each) with QK-clip; the weights and heads clipped per step."""
    clipped = []

    class ClippedLlama(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Llama(CONFIG)

        def training_step(self, batch, batch_index):
            return self.model.loss(*batch)

        def on_train_batch_end(self, outputs, batch, batch_index):
            clipped.append(self.clip.statistics()["qk_clip/heads_clipped"])

        def configure_optimizers(self):
            optimizer = dmuon.Muon(self, lr=1e-2)
            self.clip = dmuon.QKClip.for_model(optimizer, self.model, threshold=QK_TAU)
            return optimizer

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*the_batch()), batch_size=BATCH)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    module = ClippedLlama()
    trainer.fit(module, loader)
    return params_of(module.model), clipped


def test_qk_clip_under_lightning_clips_each_step_with_that_step_s_logits():
    """Lightning steps through a closure: the clip must use the closure's records, so the run
    equals a loop without closure bitwise, and no step is left unclipped."""
    import warnings

    lightning = require("lightning.pytorch")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="QKClip")
        trained, clipped = lightning_clipped(lightning, steps=3)
    wrapped = _Wrapped()
    optimizer = dmuon.Muon(wrapped, lr=1e-2)
    clip = dmuon.QKClip.for_model(optimizer, wrapped.model, threshold=QK_TAU)
    loop_clipped = []
    for _ in range(3):
        loss = wrapped.model.loss(*the_batch())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        loop_clipped.append(clip.statistics()["qk_clip/heads_clipped"])
    assert all(c > 0 for c in loop_clipped) and clipped == loop_clipped
    assert_state_equal(trained, params_of(wrapped.model))
