"""Early start (dmuon.step.early): Newton–Schulz begun in the backward pass gives the same bits as
the step without it, in every layout that supports it, at 1–4 ranks; where a layout does not
support it, or the gradients change after the backward pass, the step runs as without it. DDP,
with dmuon's comm hook: test_step_early_ddp.py."""

from __future__ import annotations

import contextlib
import copy
import re
import warnings

import pytest
import torch

import dmuon
from tests.harness import run_on_ranks
from tests.helpers import (
    GRADIENT_CHANGES,
    SMALL_BUCKET_BYTES,
    assert_same_run,
    change_gradients,
    failing_backward,
    single_process,
    tiny_mlp,
    train_llama,
    whole_params,
)


@pytest.mark.parametrize("parallel,world,dtype", [
    (None, 1, torch.float32), (None, 1, torch.bfloat16),
    ("fsdp", 1, torch.float32), ("fsdp", 2, torch.float32), ("fsdp", 3, torch.float32),
    ("fsdp", 3, torch.bfloat16), ("hsdp", 4, torch.float32),
    ("owner", 1, torch.float32), ("owner", 2, torch.float32), ("owner", 3, torch.bfloat16),
    ("fsdp+tp", 4, torch.float32), ("fsdp+tp", 4, torch.bfloat16),
])
def test_early_start_gives_the_same_bits_as_the_step_at_step(parallel, world, dtype):
    """On: every bucket begins in the backward pass (small buckets, so that there are several).
    Off (early_start=False): the buckets in the LPT order, all run at step()."""
    on_args = (parallel, None, dtype, False, True, SMALL_BUCKET_BYTES)
    off_args = (parallel, None, dtype, False, False, SMALL_BUCKET_BYTES)
    if parallel is None:
        ons, offs = [single_process(train_llama, *on_args)], [single_process(train_llama, *off_args)]
    else:
        ons, offs = run_on_ranks(world, train_llama, *on_args), run_on_ranks(world, train_llama, *off_args)
    for on, off in zip(ons, offs):
        assert on["early_start"].startswith("on") and off["early_start"].startswith("off")
        begun, buckets = on["early_buckets"]
        assert buckets > 1 and begun == buckets  # the last bucket's NS waits for step(); all began
        assert off["early_buckets"] == (0, 0)
        assert_same_run(on, off)
    for other in ons[1:]:  # every rank's view of every parameter, bitwise the same
        assert_same_run(other, ons[0])


def _owner_mlp(early_start: bool, accumulate: str | None = None, layers: int = 4, change: str | None = None,
               on_rank: int | None = None, reshard_after_forward: bool = False,
               dtype: torch.dtype = torch.float32) -> dict:
    """Three steps of the MLP owner-sharded (each Linear a layer), each over two micro-batches
    where ``accumulate`` says how: "no_sync" (the first inside the sharding's no_sync) or "twice"
    (two plain backward passes, both reduced); ``GRADIENT_CHANGES[change]`` runs between
    backward() and step() on rank ``on_rank`` (None: on every rank); weights in ``dtype``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model = tiny_mlp(layers=layers, dtype=dtype)
    sharding = dmuon.shard_by_owner(model, init_device_mesh("cpu", (dist.get_world_size(),)), layers=list(model),
                                    reshard_after_forward=reshard_after_forward)
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * dtype.itemsize, early_start=early_start)
    torch.manual_seed(1 + dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            for micro in range(1 if accumulate is None else 2):
                first = micro == 0 and accumulate == "no_sync"
                with sharding.no_sync() if first else contextlib.nullcontext():
                    model(torch.randn(8, 32, dtype=dtype)).square().mean().backward()
            change_gradients(model, change, on_rank)
            opt.step()
    return dict(params=whole_params(model), status=opt.early_start, early_buckets=opt.last_step_stats.early_buckets,
                warnings=sum("early start turned off" in str(w.message) for w in caught))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("accumulate", [None, "no_sync", "twice"])
def test_owner_sharded_early_start_with_and_without_accumulation(world, accumulate):
    """Owner sharding tells early start when each layer's reduce is done; with its no_sync the
    reduce, and early start, come with the last micro-batch; two reduced backward passes change
    the gradients after they were read: the step redoes the work and early start turns off.
    The same bits as without early start, every time."""
    ons, offs = (run_on_ranks(world, _owner_mlp, early, accumulate) for early in (True, False))
    for on, off in zip(ons, offs):
        if accumulate == "twice":
            assert on["status"].startswith("off: the gradients changed") and on["warnings"] == 1
        else:
            assert on["status"] == "on" and on["warnings"] == 0 and on["early_buckets"][0] >= 1
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]) and torch.equal(value, ons[0]["params"][name]), name


@pytest.mark.parametrize("world,change,on_rank,z3,dtype", [
    (2, "dmuon clip", None, False, torch.float32), (3, "dmuon clip", None, True, torch.bfloat16),
    (2, "scale", 1, True, torch.float32), (3, "unscale", 2, False, torch.bfloat16),
])
def test_owner_sharded_gradients_changed_after_backward_redo_the_work(world, change, on_rank, z3, dtype):
    """The owners' reduced gradients clipped with dmuon.clip_grad_norm_ on every rank, or scaled
    or unscaled (GradScaler's op) on one rank only, after early start read them: every rank
    redoes the work, with one warning each, and the bits match the run without early start. (A
    replicated bias whose gradient one rank changes differs on that rank, with or without early
    start, as under DDP: only the owners' matrices are compared across ranks then.)"""
    ons, offs = (run_on_ranks(world, _owner_mlp, early, None, 4, change, on_rank, z3, dtype)
                 for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"].startswith("off: the gradients changed") and on["warnings"] == 1
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]), name
            if on_rank is None or name.endswith("weight"):
                assert torch.equal(value, ons[0]["params"][name]), name


def test_owner_sharded_early_start_with_a_rank_that_owns_nothing():
    """Two matrices over three ranks: the rank that owns none has no run, and nothing of its own
    to redo; the owners use what they began in the backward pass (its buckets counted in the
    step's statistics), with the same bits as without early start."""
    ons, offs = (run_on_ranks(3, _owner_mlp, early, None, 2) for early in (True, False))
    for rank, (on, off) in enumerate(zip(ons, offs)):
        begun, buckets = on["early_buckets"]
        assert (buckets > 0) == (rank < 2) and begun == buckets, (rank, on["early_buckets"])
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]), name


class _Experts(torch.nn.Module):
    """A stack of four 32×32 expert matrices, every one applied to every input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 32, 32) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bd,edk->bk", x, self.w) / 4


def _fully_shard_each(model: torch.nn.Sequential, mp_policy=None) -> None:
    """fully_shard every module of ``model``, then ``model`` itself, over every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in [*model, model]:
        fully_shard(module, mesh=mesh, **({"mp_policy": mp_policy} if mp_policy else {}))


def _expert_stacks(early_start: bool, dtype: torch.dtype) -> dict:
    """Three steps of linear layers and expert stacks in ``dtype``, each module fully_shard-ed: the
    stacks (sharded on the expert dim) are orthogonalized where they live, in a plan of their own."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), _Experts(), torch.nn.Linear(32, 32), _Experts(),
                                torch.nn.Linear(32, 32)).to(dtype)
    _fully_shard_each(model)
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 32, dtype=dtype)).square().mean().backward()
        opt.step()
    return dict(params=whole_params(model), status=opt.early_start, early_buckets=opt.last_step_stats.early_buckets,
                strategies=len(opt._stepper.plan.strategies))


@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (3, torch.float32), (3, torch.bfloat16)])
def test_expert_stacks_and_matrices_under_fsdp2_give_the_same_bits(world, dtype):
    """Two exchange groups (the expert stacks, the matrices): their staged runs one after the
    other, every bucket begun in the backward pass, the same bits as without early start."""
    ons, offs = (run_on_ranks(world, _expert_stacks, early, dtype) for early in (True, False))
    for on, off in zip(ons, offs):
        begun, buckets = on["early_buckets"]
        assert on["status"] == "on" and on["strategies"] == 2 and begun == buckets > 1
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]), name


def test_the_default_is_off_on_cpu_and_says_why():
    model, opt = _train(None, steps=2)
    assert opt.early_start.startswith("off: on CPU it does not pay")
    assert opt.last_step_stats.early_buckets == (0, 0)


def _train(early_start, steps=3, between=None, accumulate=False, skip_at=None, accumulating=False,
           dtype=torch.float32):
    """A few steps of a 4-layer MLP in ``dtype``; ``between(model)`` runs between backward() and
    step(); ``accumulate``: a second micro-batch, the first one's backward inside
    ``opt.accumulating()`` with ``accumulating``."""
    model = tiny_mlp(dtype=dtype)
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    torch.manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 32, dtype=dtype)
        if step == skip_at:
            x[0, 0] = float("nan")  # non-finite gradients from the backward pass itself
        opt.zero_grad()
        with opt.accumulating() if accumulating else contextlib.nullcontext():
            model(x).square().mean().backward()
        if accumulate:
            model(2 * x).square().mean().backward()
        if between is not None:
            between(model)
        opt.step()
    return model, opt


def _compiled_model(early_start: bool, ddp: bool, dtype: torch.dtype) -> dict:
    """Three steps of the MLP in ``dtype`` run through torch.compile (under DDP with dmuon's comm
    hook)."""
    from torch.nn.parallel import DistributedDataParallel

    model = tiny_mlp(dtype=dtype)
    wrapped = DistributedDataParallel(model) if ddp else model
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    if ddp:
        opt.register_ddp_comm_hook(wrapped)
    run = torch.compile(wrapped)
    torch.manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        run(torch.randn(8, 32, dtype=dtype)).square().mean().backward()
        opt.step()
    return dict(params=[p.detach().clone() for p in model.parameters()], status=opt.early_start,
                early_buckets=opt.last_step_stats.early_buckets)


@pytest.mark.parametrize("ddp,dtype", [(False, torch.float32), (False, torch.bfloat16), (True, torch.float32),
                                       (True, torch.bfloat16)])
def test_a_model_compiled_with_torch_compile_gives_the_same_bits(ddp, dtype):
    """torch.compile(model): its backward still accumulates into param.grad (the hooks fire) and
    DDP still calls the comm hook; the same bits as without early start. (DDP's default buckets
    hold this model in one, which is final only at step().)"""
    if ddp:
        ons, offs = (run_on_ranks(2, _compiled_model, early, True, dtype) for early in (True, False))
    else:
        ons, offs = ([single_process(_compiled_model, early, False, dtype)] for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"] == "on" and (on["early_buckets"][0] >= 1 or ddp)
        assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))


@pytest.mark.parametrize("case", ["clip", "accumulate", "scale", "unscale"])
def test_gradients_changed_after_backward_redo_the_work_and_turn_early_start_off(case):
    between = GRADIENT_CHANGES.get(case)
    reference, _ = _train(False, between=between, accumulate=case == "accumulate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = _train(True, between=between, accumulate=case == "accumulate")
    assert opt.early_start.startswith("off: the gradients changed")
    assert sum("early start turned off" in str(w.message) for w in caught) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def _with_grad_scaler(early_start: bool) -> tuple[torch.nn.Module, dmuon.Muon]:
    """Three steps of the MLP through torch.amp.GradScaler: scaler.step(opt) unscales the
    gradients (in place, their version counters as they were) before opt.step()."""
    model = tiny_mlp()
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    torch.manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(8, 32)).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
    return model, opt


def test_a_grad_scaler_unscaling_before_step_redoes_the_work():
    reference, _ = _with_grad_scaler(False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = _with_grad_scaler(True)
    assert opt.early_start.startswith("off: the gradients changed")
    assert sum("early start turned off" in str(w.message) for w in caught) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def _fsdp_mlp(early_start: bool, change: str | None, on_rank: int | None, dtype: torch.dtype,
              poison_at: int | None = None, mixed_precision: bool = False) -> dict:
    """Three steps of the MLP in ``dtype``, each Linear fully_shard-ed (DTensor gradients);
    ``GRADIENT_CHANGES[change]`` runs between backward() and step() on rank ``on_rank`` (None:
    on every rank); at step ``poison_at`` the last rank's batch holds an infinity;
    ``mixed_precision``: FSDP2 computes in bf16 and reduces in fp32."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = tiny_mlp(dtype=dtype)
    _fully_shard_each(model, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                      if mixed_precision else None)
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    torch.manual_seed(1 + dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            opt.zero_grad()
            x = torch.randn(8, 32, dtype=dtype)
            if step == poison_at and dist.get_rank() == dist.get_world_size() - 1:
                x[0, 0] = float("inf")
            model(x).square().mean().backward()
            change_gradients(model, change, on_rank)
            opt.step()
    return dict(params=whole_params(model), status=opt.early_start, skipped=opt.skipped_steps,
                early_buckets=opt.last_step_stats.early_buckets,
                warnings=sum("early start turned off" in str(w.message) for w in caught))


@pytest.mark.parametrize("world,change,on_rank,dtype", [
    (2, "clip", None, torch.float32), (3, "clip", None, torch.bfloat16),
    (2, "scale", 1, torch.float32), (3, "scale", 2, torch.bfloat16),
])
def test_fsdp2_gradients_changed_after_backward_redo_the_work(world, change, on_rank, dtype):
    """Under FSDP2 the gradients are DTensors, whose version counters clip_grad_norm_'s foreach
    ops leave as they were, and whose local shards' counters their own in-place ops leave: the
    change is still found, on one rank as on all, and every rank redoes the work: the same bits
    as without early start."""
    ons, offs = (run_on_ranks(world, _fsdp_mlp, early, change, on_rank, dtype) for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"].startswith("off: the gradients changed") and on["warnings"] == 1
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]) and torch.equal(value, ons[0]["params"][name]), name


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", ["non-finite on one rank", "mixed precision"])
def test_fsdp2_early_start_with_a_non_finite_gradient_or_mixed_precision(world, case):
    """An infinity in the last rank's batch at step 1: every rank skips that step, early start's
    work unused, and the next step's early run is fresh; FSDP2's mixed precision (bf16 compute,
    fp32 reduce): the buckets begin in the backward pass. The same bits as without early start."""
    poison, mixed = (1, False) if case == "non-finite on one rank" else (None, True)
    ons, offs = (run_on_ranks(world, _fsdp_mlp, early, None, None, torch.float32, poison, mixed)
                 for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"] == "on" and on["early_buckets"][0] == on["early_buckets"][1] > 1
        assert on["skipped"] == off["skipped"] == (1 if poison else 0)
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]) and torch.equal(value, ons[0]["params"][name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulation_inside_accumulating_starts_with_the_last_micro_batch(dtype):
    """One process has no no_sync: opt.accumulating() keeps the first micro-batch's hooks from
    starting anything, so the last one's start the step's work: early start stays on, no
    warning, the same bits as without it."""
    reference, _ = _train(False, accumulate=True, dtype=dtype)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = _train(True, accumulate=True, accumulating=True, dtype=dtype)
    assert opt.early_start == "on" and not [w for w in caught if "early start" in str(w.message)]
    begun, buckets = opt.last_step_stats.early_buckets
    assert begun == buckets > 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_a_skipped_step_leaves_no_stale_update():
    """Non-finite gradients at step 1: nothing moves; the next step's early run is fresh."""
    with pytest.warns(UserWarning, match="Muon skipped a step: non-finite gradients"):
        reference, ref_opt = _train(False, skip_at=1)
    with pytest.warns(UserWarning, match="Muon skipped a step: non-finite gradients"):
        model, opt = _train(True, skip_at=1)
    assert opt.skipped_steps == ref_opt.skipped_steps == 1 and opt.early_start == "on"
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_an_abandoned_backward_is_not_applied():
    """A backward pass whose step() never comes (an exception, a skipped batch): the next step
    applies the next backward's updates only."""
    model, opt = _train(True, steps=1)
    reference, ref_opt = _train(False, steps=1)
    for m in (model, reference):
        m(torch.randn(8, 32)).sum().backward()  # abandoned
    x = torch.randn(8, 32)
    for m, o in ((model, opt), (reference, ref_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_early_start_true_where_it_cannot_run_raises_at_construction():
    with pytest.raises(ValueError, match="early_start=True: compile"):
        dmuon.Muon(tiny_mlp(), early_start=True, compile=True)


def _owner_across_replicas_with_early_start() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = tiny_mlp()
    dmuon.shard_by_owner(model, init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
                         layers=list(model))
    dmuon.Muon(model, early_start=True)


def test_early_start_true_with_owner_sharding_across_replicas_raises_on_every_rank():
    """HSDP owner sharding: the gradients are final only at the end of the backward pass. The
    owners in replica 0 each name a matrix of theirs, the other ranks the first owner's."""
    from tests.helpers import error_of

    errors = run_on_ranks(4, error_of, _owner_across_replicas_with_early_start)
    for error in errors:
        assert re.match(r"ValueError: Invalid early_start=True: '\d.weight' is owner-sharded across replicas", error)
    assert errors[2].endswith("(raised on rank 0; every rank stops here)") and errors[3] == errors[2]


def test_state_dict_round_trip_between_backward_and_step():
    """load_state_dict between backward() and step(): the step uses the loaded momentum, and
    early start stays on (its run is not used once, as the state it read is gone)."""
    model, opt = _train(True, steps=2)
    reference, ref_opt = _train(False, steps=2)
    saved = ref_opt.state_dict()
    x = torch.randn(8, 32)
    for m, o in ((model, opt), (reference, ref_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.load_state_dict(copy.deepcopy(saved))  # loading keeps the given tensors: one copy each
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert opt.early_start == "on" and opt.last_step_stats.early_buckets == (0, 0)


def _column_wise_tp(early_start: bool) -> dict:
    """Two column-wise tensor-parallel layers (weights Shard(0), outputs gathered) on a 1-D mesh
    of every rank, the same data everywhere: three steps."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tests.helpers import full_tensor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.Tanh(), torch.nn.Linear(40, 24))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {name: ColwiseParallel(output_layouts=Replicate()) for name in ("0", "2")}
    parallelize_module(model, mesh, plan)
    opt = dmuon.Muon(model, lr=0.02, ns_dtype=torch.float32, bucket_bytes=1024, early_start=early_start)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(12, 16, generator=g), torch.randn(12, 24, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return dict(params={n: full_tensor(p) for n, p in model.named_parameters()}, status=opt.early_start,
                early_buckets=opt.last_step_stats.early_buckets)


@pytest.mark.parametrize("world", [2, 3])
def test_column_wise_tensor_parallel_early_start_gives_the_same_bits(world):
    ons, offs = run_on_ranks(world, _column_wise_tp, True), run_on_ranks(world, _column_wise_tp, False)
    for on, off in zip(ons, offs):
        assert on["status"] == "on" and on["early_buckets"][0] == on["early_buckets"][1] >= 1
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]), name


def test_a_dropped_optimizer_leaves_no_hook_behind():
    """The hooks hold the optimizer weakly: once it is gone, a backward pass runs none of its work."""
    import gc

    model, opt = _train(True, steps=1)
    assert opt.early_start == "on"
    assert all(p._post_accumulate_grad_hooks for p in model.parameters() if p.ndim == 2)
    del opt
    gc.collect()
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    model(torch.randn(8, 32)).sum().backward()  # nothing to run, nothing raised


def _hyperparameter_schedule(early_start: bool, key: str) -> tuple[torch.nn.Module, dmuon.Muon, list, int]:
    """Four steps of the MLP, ``param_groups[0][key]`` changed between each backward() and step()."""
    model = tiny_mlp()
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    schedule = {"momentum": lambda s: 0.9 + 0.01 * s, "lr": lambda s: 0.01 * (s + 1)}[key]
    torch.manual_seed(1)
    begun = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(8, 32)).square().mean().backward()
            opt.param_groups[0][key] = schedule(step)
            opt.step()
            begun.append(opt.last_step_stats.early_buckets[0])
    return model, opt, begun, sum("early start" in str(w.message) for w in caught)


@pytest.mark.parametrize("key", ["momentum", "lr"])
def test_a_schedule_set_between_backward_and_step(key):
    """A momentum set just before step() differs from the one the early run used: the step
    redoes the work, with no warning, and early start stays on; an lr applies at step() and
    leaves the early work in use. The same bits as without early start either way."""
    model, opt, begun, warned = _hyperparameter_schedule(True, key)
    reference, *_ = _hyperparameter_schedule(False, key)
    assert opt.early_start == "on" and warned == 0
    assert begun[1:] == ([0, 0, 0] if key == "momentum" else [4, 4, 4])  # the hooks arm at the first step
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def _momentum_written(early_start: bool, write: str, parallel: str | None, dtype: torch.dtype) -> dict:
    """Three steps of the MLP (``parallel``: None, "fsdp" or "owner"); before the last step,
    between backward() and step(), every momentum buffer is halved, in place (``write``
    "zero_": zeroed) or through ``.data``, which leaves its version counter as it was."""
    model = tiny_mlp(dtype=dtype)
    if parallel == "fsdp":
        _fully_shard_each(model)
    elif parallel == "owner":
        dmuon.shard_by_owner(model, layers=list(model))
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    torch.manual_seed(1)
    for step in range(3):
        opt.zero_grad()
        model(torch.randn(8, 32, dtype=dtype)).square().mean().backward()
        if step == 2:
            for state in opt.state.values():
                if "momentum_buffer" in state:
                    buf = state["momentum_buffer"]
                    if write == "zero_":
                        buf.zero_()
                    else:
                        buf.data.mul_(0.5)
        opt.step()
    return dict(params=whole_params(model) if parallel else [p.detach().clone() for p in model.parameters()],
                status=opt.early_start)


@pytest.mark.parametrize("write,parallel,world,dtype", [
    (".data", None, 1, torch.float32), (".data", None, 1, torch.bfloat16), ("zero_", None, 1, torch.float32),
    (".data", "fsdp", 2, torch.float32), (".data", "owner", 3, torch.float32),
])
def test_a_momentum_buffer_written_between_backward_and_step_is_seen(write, parallel, world, dtype):
    """The step uses the buffer as it is at step(): the held updates are not applied, and early
    start stays on (not a change of the gradients)."""
    if parallel is None:
        on, off = (single_process(_momentum_written, early, write, None, dtype) for early in (True, False))
        ons, offs = [on], [off]
    else:
        ons, offs = (run_on_ranks(world, _momentum_written, early, write, parallel, dtype) for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"] == "on"
        if parallel is None:
            assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))
        else:
            for name, value in off["params"].items():
                assert torch.equal(on["params"][name], value), name


def _held_back_on_one_rank(early_start: bool, layout: str, dtype: torch.dtype) -> dict:
    """Three steps of the MLP under DDP (with dmuon's comm hook) or FSDP2, each over two
    micro-batches whose first backward pass rank 0 alone runs inside ``opt.accumulating()``: the
    ranks agree to hold that backward pass back, so none starts a bucket there (or the early
    runs' collectives would not match)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = tiny_mlp(dtype=dtype)
    if layout == "fsdp":
        _fully_shard_each(model)
        run = model
    else:
        run = DistributedDataParallel(model, bucket_cap_mb=0.005)
    opt = dmuon.Muon(run, lr=0.02, bucket_bytes=32 * 32 * dtype.itemsize, early_start=early_start)
    if layout == "ddp":
        opt.register_ddp_comm_hook(run)
    torch.manual_seed(1 + dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            with opt.accumulating() if dist.get_rank() == 0 else contextlib.nullcontext():
                run(torch.randn(8, 32, dtype=dtype)).square().mean().backward()
            run(torch.randn(8, 32, dtype=dtype)).square().mean().backward()
            opt.step()
    return dict(params=whole_params(model), status=opt.early_start, begun=opt.last_step_stats.early_buckets[0],
                warnings=sum("early start turned off" in str(w.message) for w in caught))


@pytest.mark.parametrize("layout,dtype", [("ddp", torch.float32), ("ddp", torch.bfloat16), ("fsdp", torch.float32)])
def test_accumulating_entered_on_one_rank_only_neither_hangs_nor_changes_a_bit(layout, dtype):
    ons, offs = (run_on_ranks(2, _held_back_on_one_rank, early, layout, dtype) for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"] == "on" and on["warnings"] == 0 and on["begun"] >= 1
        for name, value in off["params"].items():
            assert torch.equal(on["params"][name], value) and torch.equal(value, offs[0]["params"][name]), name


def _fsdp_zeroed_in_place(early_start: bool, dtype: torch.dtype) -> dict:
    """Three steps of the MLP under FSDP2, its gradients zeroed in place (zero_grad(set_to_none=
    False)): FSDP2 then adds each reduced gradient into one view of a shared buffer, which moves
    the version counter of every other view, though their values stay as the run read them."""
    model = tiny_mlp(dtype=dtype)
    _fully_shard_each(model)
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * dtype.itemsize, early_start=early_start)
    torch.manual_seed(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad(set_to_none=False)
            model(torch.randn(8, 32, dtype=dtype)).square().mean().backward()
            opt.step()
    return dict(params=whole_params(model), status=opt.early_start,
                warnings=sum("early start turned off" in str(w.message) for w in caught))


@pytest.mark.parametrize("world,dtype", [(2, torch.float32), (3, torch.bfloat16)])
def test_fsdp2_gradients_zeroed_in_place_keep_early_start_on_and_the_bits(world, dtype):
    ons, offs = (run_on_ranks(world, _fsdp_zeroed_in_place, early, dtype) for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"] == "on" and on["warnings"] == 0
        for name, value in off["params"].items():
            assert torch.equal(on["params"][name], value), name


def _fsdp_through_a_failed_backward(fail: bool, zero_grad_by: str, early_start: bool, dtype: torch.dtype) -> dict:
    """Three steps of the MLP, each Linear fully_shard-ed; with ``fail``, before the second
    step a backward pass raises on every rank after the two last layers' gradients were
    reduced (an out-of-memory error, caught), and the loop zeroes the gradients by
    ``zero_grad_by`` ("optimizer" or "model") and goes on."""

    model = tiny_mlp(dtype=dtype)
    _fully_shard_each(model)
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    backward, failing = failing_backward(model, dtype)

    early, error = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            if fail and step == 1:
                failing.append(True)
                with pytest.raises(RuntimeError, match="a test's"):
                    backward(1000)
                failing.clear()
                (opt if zero_grad_by == "optimizer" else model).zero_grad()
            backward(10 * step)
            try:
                opt.step()
            except RuntimeError as err:
                error = str(err)
                break
            opt.zero_grad()
            early.append(opt.last_step_stats.early_buckets)
    return dict(params=whole_params(model) if error is None else None, early=early, status=opt.early_start,
                error=error, warnings=[str(w.message) for w in caught if "early start" in str(w.message)])


@pytest.mark.parametrize("world,early_start,dtype", [(2, True, torch.float32), (3, True, torch.float32),
                                                     (2, True, torch.bfloat16), (2, False, torch.float32)])
def test_fsdp2_after_a_caught_backward_exception_trains_on_with_early_start(world, early_start, dtype):
    """FSDP2 (torch 2.13) stays in a backward pass that raises and reduces no later gradient;
    the optimizer's zero_grad() finishes that pass as FSDP2 would, so the run equals the one
    without the failed pass, bitwise, and early start goes on beginning every bucket early."""
    failed = run_on_ranks(world, _fsdp_through_a_failed_backward, True, "optimizer", early_start, dtype)
    control = run_on_ranks(world, _fsdp_through_a_failed_backward, False, "optimizer", early_start, dtype)
    for r, c in zip(failed, control):
        assert r["error"] is None and r["warnings"] == [] and r["status"] == c["status"]
        assert r["early"] == c["early"]
        if early_start:
            assert all(0 < begun == total for begun, total in r["early"][1:]), r["early"]  # all begun in backward
        for name, value in c["params"].items():
            assert torch.equal(r["params"][name], value), name


def test_a_step_after_fsdp2_was_left_in_a_failed_backward_is_refused_on_every_rank():
    """The model's own zero_grad() leaves FSDP2 in the failed pass: the step would change
    nothing, and every rank says so, naming the fix."""
    results = run_on_ranks(2, _fsdp_through_a_failed_backward, True, "model", True, torch.float32)
    assert all(r["error"] is not None and "FSDP2 is still in a backward pass that raised" in r["error"]
               and "zero_grad()" in r["error"] for r in results)
