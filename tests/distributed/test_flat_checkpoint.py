"""Flat (FQN-keyed) optimizer checkpoints across pipeline layouts: torch's
``flatten_optimizer_state_dict=True`` and torchtitan's container store every group key under
each parameter's name and rebuild a group from its first parameter's. A checkpoint of the model
in 2 parts (an optimizer each, as pipeline stages or an interleaved schedule's model parts have)
loads into 1 part and into 4: the state by FQN is the saved one, bitwise, each optimizer keeps
its own routing, and training goes on as the 2-part job does. fp32 and bf16 parameters."""

from __future__ import annotations

import copy
import dataclasses
import sys
import zlib

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import dmuon
from dmuon.tools.models import Llama, get_config
from tests.harness import run_on_ranks

CONFIG = dataclasses.replace(get_config("tiny"), n_layers=4)
HPARAMS = dict(lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32, adamw_lr=0.004)
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
# the layers each part holds; the first part also the embedding, the last the norm and the head
SPLITS = {1: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]], 4: [[0], [1], [2], [3]]}


NORMUON_8BIT = {"update_rule": "normuon", "momentum_dtype": "int8"}


def parts_of(model: Llama, parts: int) -> list[nn.Module]:
    """The model in ``parts`` pieces as torchtitan cuts pipeline stages: each a copy of the
    whole with the other layers gone, every parameter under its full model's name."""
    pieces = []
    for index, layers in enumerate(SPLITS[parts]):
        part = copy.deepcopy(model)
        part.layers = nn.ModuleDict({str(i): part.layers[i] for i in layers})
        if index > 0:
            del part.embed_tokens
        if index < parts - 1:
            del part.norm, part.lm_head
        pieces.append(part)
    return pieces


def set_grads(parts: list[nn.Module], step: int) -> None:
    """A gradient per parameter from its name and the step: the same in every layout."""
    for part in parts:
        for name, p in part.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * step)
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


class Job:
    """The model in ``parts`` parts, an optimizer each (``torchtitan``: built by its container)."""

    def __init__(self, parts: int, dtype: torch.dtype, torchtitan: bool, options: dict | None = None) -> None:
        self.parts = parts_of(Llama(CONFIG, seed=0).to(dtype), parts)
        self.torchtitan = torchtitan
        hparams = {**HPARAMS, **(options or {})}
        if torchtitan:
            from dmuon.integrations.torchtitan import dmuon_optimizer_config

            self.container = dmuon_optimizer_config(**hparams).build(model_parts=self.parts)
            self.optimizers = self.container.dmuon_optimizers
        else:
            self.optimizers = [dmuon.Muon(part, **hparams) for part in self.parts]

    def train(self, steps: range) -> None:
        for step in steps:
            set_grads(self.parts, step)
            for optimizer in self.optimizers:
                optimizer.step()
                optimizer.zero_grad()

    def flat_state_dict(self) -> dict:
        if self.torchtitan:
            return self.container.state_dict()
        return {k: v for part, optimizer in zip(self.parts, self.optimizers)
                for k, v in get_optimizer_state_dict(part, optimizer, options=FLAT).items()}

    def load(self, flat: dict) -> None:
        if self.torchtitan:
            self.container.load_state_dict(flat)
            return
        for part, optimizer in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, optimizer, optim_state_dict=flat, options=FLAT)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for part in self.parts:
                for name, p in part.named_parameters():
                    p.copy_(weights[name])

    def params(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for part in self.parts for name, p in part.named_parameters()}


def reshard(into: int, dtype: torch.dtype, torchtitan: bool, options: dict | None = None) -> dict:
    """2 parts trained 2 steps, their flat checkpoint loaded into ``into`` parts (trained to the
    same point first, so that loading replaces real state), then 2 more steps in each."""
    saved = Job(2, dtype, torchtitan, options)
    saved.train(range(2))
    flat = {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in saved.flat_state_dict().items()}
    loaded = Job(into, dtype, torchtitan, options)
    loaded.train(range(1))
    loaded.load_weights(saved.params())  # the model's checkpoint: FQN-keyed in any layout
    loaded.load(flat)
    reloaded = loaded.flat_state_dict()
    routes = [optimizer.routes() for optimizer in loaded.optimizers]
    saved.train(range(2, 4))
    loaded.train(range(2, 4))
    built = [Job(into, dtype, False, options).optimizers[i].routes() for i in range(into)]
    return dict(flat=flat, reloaded=reloaded, routes=routes, built=built, saved=saved.params(), loaded=loaded.params())


@pytest.mark.parametrize("torchtitan", [False, pytest.param(True, marks=pytest.mark.skipif(
    sys.version_info < (3, 11), reason="torchtitan 0.3.0 needs Python >= 3.11"))])
@pytest.mark.parametrize("into,dtype,options", [
    (1, torch.float32, None), (4, torch.float32, None), (1, torch.bfloat16, None), (4, torch.bfloat16, None),
    (4, torch.float32, NORMUON_8BIT), (1, torch.bfloat16, NORMUON_8BIT)])
def test_a_two_part_flat_checkpoint_loads_into_other_pipeline_layouts(into, dtype, options, torchtitan):
    """NorMuon's row state and 8-bit momentum's codes and scales too: flat keys of their own."""
    (result,) = run_on_ranks(1, reshard, into, dtype, torchtitan, options)
    state = {k: v for k, v in result["flat"].items() if k.startswith("state.")}
    assert state and all(torch.equal(v, result["reloaded"][k]) for k, v in state.items())
    if options:
        kept = {k.rsplit(".", 1)[1] for k in state}
        assert {"momentum_scale", "row_second_moment"} <= kept
        assert all(v.dtype == torch.int8 for k, v in state.items() if k.endswith(".momentum_buffer"))
    assert result["routes"] == result["built"]  # each optimizer's own routing, not the checkpoint's lists
    for name, value in result["saved"].items():
        assert torch.equal(result["loaded"][name], value), name
