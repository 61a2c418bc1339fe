"""End-to-end training parity (docs/testing.md row 4): a small Llama-style transformer trained with
dmuon.Muon under DDP, FSDP2 and HSDP, the data split across ranks, against one process on the
global batch — losses and parameters agree to the tolerance that reduction order allows."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.tools.models import Llama, SyntheticTokens, get_config
from tests.distributed import run_on_ranks

STEPS, GLOBAL_BATCH, SEQ_LEN = 5, 12, 16
HPARAMS = dict(lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32)


def train(parallel: str | None, replica_split=None, dtype: torch.dtype = torch.float32,
          mixed_precision: bool = False) -> dict:
    """Train the tiny model; ``parallel`` None is the single-process reference.

    ``dtype``: the parameters' dtype; ``mixed_precision``: FSDP2 computes in bf16 and reduces
    in fp32 while its sharded parameters stay fp32.
    """
    config = get_config("tiny")
    model = Llama(config, seed=0).to(dtype)
    rank, world = (dist.get_rank(), dist.get_world_size()) if parallel else (0, 1)
    if parallel == "ddp":
        model = DistributedDataParallel(model)
    elif parallel in ("fsdp", "hsdp"):
        shape = (2, world // 2) if parallel == "hsdp" else (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **({"mp_policy": policy} if policy else {}))
        fully_shard(model, mesh=mesh, **({"mp_policy": policy} if policy else {}))
    opt = dmuon.Muon(model, replica_split=replica_split, **HPARAMS)
    data = SyntheticTokens(config.vocab_size, seed=0)
    losses = []
    for step in range(STEPS):
        inputs, targets = data.local_batch(step, GLOBAL_BATCH, SEQ_LEN, rank, world)
        loss = lm_loss(model, inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        if parallel:
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        losses.append(global_loss.item())
    params = {
        name.removeprefix("module."): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }
    state_dtypes = {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}
    return dict(losses=losses, params=params, state_dtypes=state_dtypes)


def lm_loss(model, inputs, targets):
    """``Llama.loss`` through the (possibly DDP-wrapped) module's own forward, so DDP's hooks fire."""
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@pytest.fixture(scope="module")
def reference() -> dict:
    torch.set_num_threads(1)
    return train(None)


@pytest.mark.parametrize("parallel,world,replica_split", [
    ("ddp", 2, None), ("ddp", 3, None),
    ("fsdp", 2, None), ("fsdp", 3, None), ("fsdp", 4, None),
    ("hsdp", 4, True), ("hsdp", 4, False),
])
def test_training_matches_single_process(reference, parallel, world, replica_split):
    results = run_on_ranks(world, train, parallel, replica_split)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
        assert r["params"].keys() == reference["params"].keys()
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=1e-5, msg=name)
    assert reference["losses"][-1] < reference["losses"][0]
    # replicas stay identical
    for r in results[1:]:
        for name, value in r["params"].items():
            assert torch.equal(value, results[0]["params"][name]), name


def test_same_seed_twice_is_bitwise_equal_distributed():
    first, second = run_on_ranks(3, train, "fsdp"), run_on_ranks(3, train, "fsdp")
    for a, b in zip(first, second):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])


def test_bf16_parameters_under_fsdp_match_single_process_bf16():
    reference = train(None, dtype=torch.bfloat16)
    for r in run_on_ranks(2, train, "fsdp", None, torch.bfloat16):
        assert all(v.dtype == torch.bfloat16 for v in r["params"].values())
        assert r["state_dtypes"] == {torch.bfloat16}  # state follows the parameter's dtype
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=2e-2, atol=0)


def test_fsdp_mixed_precision_keeps_fp32_params_and_trains(reference):
    results = run_on_ranks(2, train, "fsdp", None, torch.float32, True)
    for r in results:
        assert all(v.dtype == torch.float32 for v in r["params"].values())
        assert r["state_dtypes"] == {torch.float32}
        # bf16 compute moves the losses only slightly off the fp32 reference
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=2e-2, atol=0)
    for name, value in results[1]["params"].items():
        assert torch.equal(value, results[0]["params"][name]), name
