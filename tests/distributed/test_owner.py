"""Owner-sharded data parallel (``dmuon.shard_by_owner``), on real gloo ranks at world sizes 1–4:
end-to-end parity with one process (Z2, Z3, gradient accumulation, composed with FSDP2), the
exact bytes per step, identical parameters before every forward, memory per rank as planned,
ranks that own nothing, and the errors. Checkpoints across world sizes: tests/distributed/test_checkpoint.py.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dmuon
from dmuon.tools.models import Llama, SyntheticTokens, get_config
from tests.harness import run_on_ranks
from tests.helpers import GLOBAL_BATCH, SEQ_LEN, error_of, failing_backward, single_process, whole_params
from tests.helpers import LLAMA_HPARAMS as HPARAMS
from tests.helpers import LLAMA_STEPS as STEPS
from tests.helpers import train_llama as train_reference


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (gradients may share one buffer)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def muon_bytes(sharding: dmuon.OwnerSharding) -> int:
    return sum(p.numel() * p.element_size() for p in sharding.params)


def train_owner(reshard_after_forward: bool = False, accumulate: int = 1, with_fsdp: bool = False,
                hsdp: bool = False, no_sync: bool = True) -> dict:
    """The tiny Llama of the parity tests, its Muon matrices owner-sharded, the data split across
    ranks (and, with ``accumulate``, each rank's share into micro-batches, all but the last
    inside ``sharding.no_sync()`` unless ``no_sync`` is False; then, as under DDP, every
    backward reduces and the gradients add up); ``hsdp``: on a 2×N/2 (replicate, shard) mesh.
    Without ``no_sync`` the gradients are zeroed between the first forward and its backward (the
    other common place for ``zero_grad``)."""
    config = get_config("tiny")
    model = Llama(config, seed=0)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2) if hsdp else (world,),
                            mesh_dim_names=("replicate", "shard") if hsdp else ("shard",))
    sharding = dmuon.shard_by_owner(model, mesh, layers=model.layers, reshard_after_forward=reshard_after_forward,
                                    replicate_rest=not with_fsdp)
    if with_fsdp:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, ignored_params=set(sharding.params))
        fully_shard(model, mesh=mesh, ignored_params=set(sharding.params))
    opt = dmuon.Muon(model, **HPARAMS)

    seen_before_forward: list[torch.Tensor] = []  # every block's parameters, as each forward saw them
    for layer in model.layers:  # registered after the sharding's hooks, so they see what forward sees
        layer.register_forward_pre_hook(lambda m, args: seen_before_forward.append(
            torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()))

    data = SyntheticTokens(config.vocab_size, seed=0)
    assert GLOBAL_BATCH // world % accumulate == 0, "equal micro-batches, or their mean is not the batch's"
    losses, step_bytes = [], []
    for step in range(STEPS):
        inputs, targets = data.local_batch(step, GLOBAL_BATCH, SEQ_LEN, rank, world)
        if no_sync:
            opt.zero_grad()
        total = torch.zeros(())
        for micro, (x, y) in enumerate(zip(inputs.chunk(accumulate), targets.chunk(accumulate))):
            last = micro == accumulate - 1
            with contextlib.nullcontext() if last or not no_sync else sharding.no_sync():
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / accumulate
                if micro == 0 and not no_sync:
                    opt.zero_grad()
                loss.backward()
            total += loss.detach()
        step_bytes.append(sharding.last_step_bytes)
        opt.step()
        dist.all_reduce(total)
        losses.append(total.item() / world)

    mine = [p for p in sharding.params if sharding.is_mine(p)]
    memory = dict(
        weights=storage_bytes(sharding.params),
        grads=storage_bytes([p.grad for p in sharding.params if p.grad is not None]),
        momentum=storage_bytes([opt.state[p]["momentum_buffer"] for p in mine]),
        predicted=sharding.owned_bytes(rank),
        per_rank=[sharding.owned_bytes(r) for r in range(world)],
    )
    return dict(losses=losses, params=whole_params(model), step_bytes=step_bytes, muon_bytes=muon_bytes(sharding),
                seen=seen_before_forward, memory=memory, owners=sorted(set(sharding.owners.values())))


@pytest.fixture(scope="module")
def reference() -> dict:
    return single_process(train_reference, None)


@pytest.mark.parametrize("world,z3,accumulate,with_fsdp", [
    (1, False, 1, False), (2, False, 1, False), (2, True, 1, False), (3, False, 1, False),
    (3, True, 1, False), (4, False, 1, False), (4, True, 1, False),
    (2, False, 3, False), (3, True, 2, False),  # gradient accumulation, Z2 and Z3
    (2, False, 1, True), (3, True, 1, True),  # the rest of the model under FSDP2
])
def test_owner_sharded_training_matches_single_process(reference, world, z3, accumulate, with_fsdp):
    check_parity(reference, run_on_ranks(world, train_owner, z3, accumulate, with_fsdp), accumulate)
    # the work is spread over every rank


@pytest.mark.parametrize("world,z3,hsdp,accumulate", [(2, False, False, 2), (3, True, False, 2), (4, False, True, 3),
                                                     (4, True, True, 3)])
def test_gradient_accumulation_without_no_sync_adds_up_as_under_ddp(reference, world, z3, hsdp, accumulate):
    """Every micro-batch's backward reduces (the loop that is right under DDP): an owner sets its
    averaged gradient aside when the next backward reaches the parameter and adds the next
    average to it, so the step sees the sum of the micro-batches' averages."""
    results = run_on_ranks(world, train_owner, z3, accumulate, False, hsdp, False)
    check_parity(reference, results, accumulate, owners=[0, 1] if hsdp else None)


@pytest.mark.parametrize("z3,accumulate,with_fsdp", [(False, 1, False), (True, 3, False), (False, 1, True)])
def test_hsdp_2x2_matches_single_process(reference, z3, accumulate, with_fsdp):
    """Two replicas of two shards: each replica holds every matrix once; replica 0's holders step."""
    results = run_on_ranks(4, train_owner, z3, accumulate, with_fsdp, True)
    check_parity(reference, results, accumulate, owners=[0, 1])
    if accumulate == 1:
        # per step: each replica's broadcasts and reduces (Z2: 2(S−1)·P, Z3: 3(S−1)·P), and the
        # gradient to replica 0 plus — from the second step on — the updated weight back: (R−1)·P each
        P, per_replica = results[0]["muon_bytes"], (3 if z3 else 2) * (2 - 1) * results[0]["muon_bytes"]
        for step in range(STEPS):
            expected = 2 * per_replica + (1 if step == 0 else 2) * (2 - 1) * P
            assert sum(r["step_bytes"][step] for r in results) == expected, step


def check_parity(reference: dict, results: list[dict], accumulate: int, owners: list[int] | None = None) -> None:
    world = len(results)
    for rank, r in enumerate(results):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)
        assert r["params"].keys() == reference["params"].keys()
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-4, atol=1e-5, msg=name)
            assert torch.equal(value, results[0]["params"][name]), (rank, name)
        # every rank ran every forward on bitwise the same parameters
        assert len(r["seen"]) == len(results[0]["seen"]) == STEPS * accumulate * get_config("tiny").n_layers
        assert all(torch.equal(a, b) for a, b in zip(r["seen"], results[0]["seen"])), rank
    assert results[0]["owners"] == (owners or list(range(world)))  # the work is spread over every rank


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("z3", [False, True])
def test_bytes_per_step_are_the_lower_bound(world, z3):
    """Per step, the Muon weights move 2(N−1)/N·P bytes per rank on average (a broadcast in
    forward, a reduce in backward), or 3(N−1)/N·P with Z3 (a second broadcast in backward)."""
    results = run_on_ranks(world, train_owner, z3)
    P = results[0]["muon_bytes"]
    for step in range(STEPS):
        per_rank = [r["step_bytes"][step] for r in results]
        assert sum(per_rank) == (3 if z3 else 2) * (world - 1) * P, (step, per_rank)  # the mean times N


@pytest.mark.parametrize("world", [2, 3, 4])
def test_memory_per_rank_is_the_planned_balance(world):
    """Between steps each rank keeps whole weights, gradients and momentum of exactly the
    matrices it owns (nothing of the others), as the plan predicts; the plan is balanced."""
    results = run_on_ranks(world, train_owner)
    for rank, r in enumerate(results):
        m = r["memory"]
        assert m["weights"] == m["grads"] == m["momentum"] == m["predicted"] > 0, (rank, m)
    per_rank = results[0]["memory"]["per_rank"]
    assert sum(per_rank) == results[0]["muon_bytes"]
    # LPT over 14 matrices of 2 shapes: within one largest matrix of perfect balance
    largest = 4 * 64 * 128  # the tiny model's MLP matrices, fp32
    assert max(per_rank) - min(per_rank) <= largest, per_rank


# ------------------------------------------------------------------ fewer matrices than ranks


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 16))


def train_small(parallel: bool, steps: int = 3, dtype: torch.dtype = torch.float32) -> dict:
    """Two Muon matrices (biases go to AdamW) on up to four ranks: some ranks own nothing."""
    model = small_mlp().to(dtype)
    rank, world = (dist.get_rank(), dist.get_world_size()) if parallel else (0, 1)
    sharding = dmuon.shard_by_owner(model) if parallel else None
    # fp16: an AdamW eps fp16 can hold, else the biases' updates are inf where their second moment underflows
    adamw_eps = 1e-4 if dtype == torch.float16 else 1e-8
    opt = dmuon.Muon(model, lr=0.05, ns_method="standard", ns_dtype=torch.float32, adamw_eps=adamw_eps)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(12, 16, generator=generator).to(dtype)
        opt.zero_grad()
        F.mse_loss(model(x.chunk(world)[rank]), x.chunk(world)[rank].flip(1)).backward()
        opt.step()
    owned = [sharding.is_mine(p) for p in sharding.params] if parallel else []
    osd = get_optimizer_state_dict(model, opt) if parallel else None  # must not hang on an idle rank
    return dict(params=whole_params(model), owned=owned, state_keys=sorted(osd["state"]) if osd else None)


@pytest.mark.parametrize("world", [3, 4])
def test_ranks_that_own_nothing(world):
    reference = train_small(False)
    results = run_on_ranks(world, train_small, True)
    assert sum(not any(r["owned"]) for r in results) == world - 2  # two matrices, two owners
    for r in results:
        for name, value in r["params"].items():
            torch.testing.assert_close(value, reference["params"][name], rtol=1e-5, atol=1e-6, msg=name)
        assert r["state_keys"] == results[0]["state_keys"]  # every rank names every parameter


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 3])
def test_low_precision_replicas_are_identical(world, dtype):
    """bf16/fp16 weights: the replicated rest (biases, AdamW) is bitwise the same on every rank,
    the owner-sharded matrices are what their owners broadcast, all close to one process (the
    gradients are averaged over ranks, so not bitwise)."""
    reference = train_small(False, dtype=dtype)
    results = run_on_ranks(world, train_small, True, 3, dtype)
    for rank, r in enumerate(results):
        for name, value in r["params"].items():
            assert value.dtype == dtype and torch.equal(value, results[0]["params"][name]), (rank, name)
            torch.testing.assert_close(value, reference["params"][name], rtol=2e-2, atol=2e-2, msg=name)


def train_small_compiled(compiled: bool, reshard_after_forward: bool) -> dict:
    """Three steps of the small MLP owner-sharded, its forward through ``torch.compile`` or not."""
    model = small_mlp()
    dmuon.shard_by_owner(model, reshard_after_forward=reshard_after_forward)
    opt = dmuon.Muon(model, lr=0.05, ns_method="standard", ns_dtype=torch.float32)
    forward = torch.compile(model) if compiled else model
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(3):
        x = torch.randn(4, 16, generator=generator)
        opt.zero_grad()
        F.mse_loss(forward(x), x.flip(1)).backward()
        opt.step()
    return whole_params(model)


@pytest.mark.parametrize("world,z3", [(2, False), (2, True)])
def test_a_compiled_model_gives_the_same_bits(world, z3):
    """torch.compile traces the layers between the sharding's hooks (which break the graph at
    their collectives) and takes the weights as they are when its code runs: materialized, with
    their own shape and strides. A placeholder of other strides in the copies a rank does not
    keep failed inductor's stride check (tried, reverted)."""
    compiled, eager = (run_on_ranks(world, train_small_compiled, c, z3) for c in (True, False))
    for rank in range(world):
        for name, value in compiled[rank].items():
            assert torch.equal(value, eager[rank][name]), (rank, name)


# ------------------------------------------------------------------ errors


def unfreeze_after_sharding() -> None:
    model = small_mlp()
    model[2].weight.requires_grad_(False)
    dmuon.shard_by_owner(model)
    opt = dmuon.Muon(model, lr=0.05)
    model[2].weight.requires_grad_(True)
    model(torch.randn(4, 16)).square().mean().backward()
    opt.step()


def test_a_matrix_unfrozen_after_sharding_is_refused_on_every_rank():
    """Its gradient would never be averaged across ranks (no hook can be put on a frozen tensor)."""
    messages = run_on_ranks(3, error_of, unfreeze_after_sharding)
    assert all(m is not None and "'2.weight' has a gradient, but it was frozen" in m for m in messages), messages


def bad_params_on_rank_1() -> None:
    model = small_mlp()
    dmuon.shard_by_owner(model, params=[model[0].bias] if dist.get_rank() == 1 else None)


def test_a_failure_on_one_rank_stops_every_rank_before_any_data_moves():
    messages = run_on_ranks(3, error_of, bad_params_on_rank_1)
    assert all(m is not None and "'0.bias' has shape" in m for m in messages), messages
    assert "raised on rank 1" in messages[0] and "raised on rank 1" in messages[2]



def shard_after_fully_shard() -> None:
    model = small_mlp()
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    dmuon.shard_by_owner(model)


def test_sharding_an_fsdp_model_names_the_parameter():
    for message in run_on_ranks(2, error_of, shard_after_fully_shard):
        assert message.startswith("ValueError") and "'0.weight'" in message and "before fully_shard" in message


def shard_differently() -> None:
    width = 24 + dist.get_rank() % 2
    dmuon.shard_by_owner(nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 16)))


def test_ranks_that_disagree_get_the_same_error_before_any_data_moves():
    messages = run_on_ranks(3, error_of, shard_differently)
    assert len(set(messages)) == 1, messages
    assert "ValueError: Ranks disagree on the owner sharding: owner-sharded parameter '0.weight'" in messages[0]
    assert "(24, 16)" in messages[0] and "(25, 16)" in messages[0] and "rank 1" in messages[0]


def test_bad_arguments_are_named():
    model = small_mlp()
    with pytest.raises(TypeError, match="nn.Module"):
        dmuon.shard_by_owner([model])
    with pytest.raises(ValueError, match=r"shape \(3, 3\) in params is not a parameter of the model"):
        dmuon.shard_by_owner(model, params=[nn.Parameter(torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="not part of the model"):
        dmuon.shard_by_owner(model, layers=[nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="'0.bias' has shape"):
        dmuon.shard_by_owner(model, params=[model[0].bias])
    with pytest.raises(ValueError, match="in two layers"):
        dmuon.shard_by_owner(model, layers=[model, model[0]])
    dmuon.shard_by_owner(model)
    with pytest.raises(ValueError, match="Parameter '0.weight' is owner-sharded already: shard_by_owner ran on this "
                                         "model before"):
        dmuon.shard_by_owner(model)


class Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward (its forward hooks fire again there)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, *args, use_reentrant=False)


def train_checkpointed(reshard_after_forward: bool) -> dict:
    config = get_config("tiny")
    model = Llama(config, seed=0)
    blocks = list(model.layers)
    model.layers = nn.ModuleList(Checkpointed(b) for b in blocks)
    dmuon.shard_by_owner(model, layers=blocks, reshard_after_forward=reshard_after_forward)
    opt = dmuon.Muon(model, **HPARAMS)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = SyntheticTokens(config.vocab_size, seed=0)
    losses = []
    for step in range(STEPS):
        x, y = data.local_batch(step, GLOBAL_BATCH, SEQ_LEN, rank, world)
        opt.zero_grad()
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return dict(losses=losses)


@pytest.mark.parametrize("z3", [False, True])
def test_activation_checkpointing(reference, z3):
    """Recomputation in backward runs the blocks' forward hooks again: no stale or extra
    broadcast may leak into the next step."""
    for r in run_on_ranks(2, train_checkpointed, z3):
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6)


def train_through_a_failed_backward(batches: list[int], fail_at: int | None, reshard_after_forward: bool,
                                    early_start: bool, dtype: torch.dtype) -> dict:
    """The 4-layer MLP owner-sharded (each Linear a layer), a step per entry of ``batches``
    (each rank its own share of batch b). Before the step at position ``fail_at`` a batch's
    backward pass raises on every rank after the two last layers' gradients went to their
    owners (an out-of-memory error, say), is caught, and the loop zeroes the gradients and
    carries on with the batch of that position."""
    from tests.helpers import SMALL_BUCKET_BYTES, tiny_mlp

    model = tiny_mlp(dtype=dtype)
    dmuon.shard_by_owner(model, layers=list(model), reshard_after_forward=reshard_after_forward)
    opt = dmuon.Muon(model, lr=0.02, early_start=early_start, bucket_bytes=SMALL_BUCKET_BYTES)
    backward, failing = failing_backward(model, dtype)

    def forward_backward(batch: int) -> None:
        backward(100 * batch)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for position, batch in enumerate(batches):
            if position == fail_at:
                failing.append(True)
                with pytest.raises(RuntimeError, match="a test's"):
                    forward_backward(1000 + batch)
                failing.clear()
                opt.zero_grad()
            forward_backward(batch)
            opt.step()
            opt.zero_grad()
    return dict(params=whole_params(model), early_start=opt.early_start,
                warnings=[str(w.message) for w in caught if "early start" in str(w.message)])


@pytest.mark.parametrize("world,z3,early_start,dtype", [
    (2, False, False, torch.float32), (2, True, True, torch.float32), (3, False, True, torch.float32),
    (3, True, False, torch.float32), (3, True, True, torch.bfloat16),
])
def test_a_caught_exception_in_the_backward_pass_leaves_nothing_behind(world, z3, early_start, dtype):
    """The failed backward's reduces are dropped: the run equals one where it never happened,
    bitwise (the control is the same job without the exception), and early start stays on."""
    args = (z3, early_start, dtype)
    failed = run_on_ranks(world, train_through_a_failed_backward, [0, 1, 2], 1, *args)
    control = run_on_ranks(world, train_through_a_failed_backward, [0, 1, 2], None, *args)
    for r, c in zip(failed, control):
        assert r["warnings"] == [] and r["early_start"] == c["early_start"]
        assert r["early_start"].startswith("on") == early_start
        for name, value in c["params"].items():
            assert torch.equal(r["params"][name], value), name


def accumulate_through_a_failed_backward(fail: bool, first_in_no_sync: bool, reshard_after_forward: bool,
                                         dtype: torch.dtype) -> dict:
    """Two steps of the 4-layer MLP, owner-sharded with its biases replicated, each accumulating
    micro-batches a and b (a inside ``no_sync()`` where ``first_in_no_sync``); with ``fail``, a
    third micro-batch's backward pass raises between them at the first step, after the two last
    layers' gradients went to their owners, and the loop goes on without ``zero_grad()``. Where
    the step refuses, the loop zeroes the gradients and runs the step's micro-batches again."""
    from tests.helpers import tiny_mlp

    model = tiny_mlp(dtype=dtype)
    sharding = dmuon.shard_by_owner(model, layers=list(model), reshard_after_forward=reshard_after_forward)
    opt = dmuon.Muon(model, lr=0.02)
    backward, failing = failing_backward(model, dtype)

    refused = []
    for step in range(2):
        with sharding.no_sync() if first_in_no_sync else contextlib.nullcontext():
            backward(100 * step)
        if fail and step == 0:
            failing.append(True)
            with pytest.raises(RuntimeError, match="a test's"):
                backward(1000)
            failing.clear()
        backward(100 * step + 50)
        try:
            opt.step()
        except RuntimeError as error:
            refused.append(str(error))
            opt.zero_grad()
            with sharding.no_sync():
                backward(100 * step)
            backward(100 * step + 50)
            opt.step()
        opt.zero_grad()
    return dict(params=whole_params(model), refused=refused)


@pytest.mark.parametrize("world,z3,dtype", [(2, False, torch.float32), (3, True, torch.float32),
                                            (4, False, torch.float32), (3, False, torch.bfloat16)])
def test_a_failed_micro_batch_during_accumulation_is_dropped_exactly(world, z3, dtype):
    """Plain accumulation (every micro-batch reduces, no zero_grad() after the failure): the
    step equals the same loop without the failed micro-batch, bitwise, replicas identical."""
    failed = run_on_ranks(world, accumulate_through_a_failed_backward, True, False, z3, dtype)
    control = run_on_ranks(world, accumulate_through_a_failed_backward, False, False, z3, dtype)
    for r, c in zip(failed, control):
        assert r["refused"] == []
        for name, value in c["params"].items():
            assert torch.equal(r["params"][name], value), name
            assert torch.equal(value, control[0]["params"][name]), name


def test_a_failed_micro_batch_after_no_sync_sums_is_refused_at_the_step_on_every_rank():
    """The pass that ends a no_sync() block reduces the local sums: a failure in it cannot be
    taken back out of them, so the step raises on every rank, asking for zero_grad(); the
    redone step is the control's."""
    failed = run_on_ranks(3, accumulate_through_a_failed_backward, True, True, False, torch.float32)
    control = run_on_ranks(3, accumulate_through_a_failed_backward, False, True, False, torch.float32)
    for r, c in zip(failed, control):
        assert len(r["refused"]) == 1 and "Call zero_grad()" in r["refused"][0]
        for name, value in c["params"].items():
            assert torch.equal(r["params"][name], value), name
