"""Ranks that disagree, or call the optimizer's collective entry points out of step, get the
same clear error on every rank — never a hang, never silently different weights."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import dmuon
from tests.harness import run_on_ranks
from tests.helpers import assert_same_error, error_of, single_process

SHAPES = [(8, 4), (6, 6)]


def make_params(shapes=SHAPES, seed: int = 0) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def set_grads(params, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def muon(params, **kwargs) -> dmuon.Muon:
    return dmuon.Muon([{"params": params, "algorithm": "muon"}], lr=0.01, **kwargs)


def add_group_on_rank_0_only() -> None:
    params = make_params()
    opt = muon(params[:1])
    set_grads(params)
    if dist.get_rank() == 0:
        opt.add_param_group({"params": params[1:], "algorithm": "muon"})
    else:
        opt.step()


def add_group_with_lr_of_rank() -> None:
    params = make_params()
    opt = muon(params[:1])
    opt.add_param_group({"params": params[1:], "algorithm": "muon", "lr": 0.01 * (1 + dist.get_rank())})


def add_group_with_shape_of_rank() -> None:
    params = make_params()
    opt = muon(params[:1])
    extra = make_params([(5, 5 + dist.get_rank())], seed=2)
    opt.add_param_group({"params": extra, "algorithm": "muon"})


def unnamed_in_rank_order() -> None:
    a, b = make_params([(6, 6), (6, 6)])
    muon([a, b] if dist.get_rank() == 0 else [b, a])


def nonfinite_policy_of_rank() -> None:
    muon(make_params(), nonfinite_grads="raise" if dist.get_rank() == 0 else "skip")


def extra_named_matrix_on_rank_1() -> None:
    params = make_params([(8, 4), (6, 6), (5, 5)])
    named = list(zip(["a", "b", "c"], params))
    dmuon.Muon([{"params": named[: 2 + dist.get_rank()], "algorithm": "muon"}], lr=0.01)


def processors_of_two_kinds() -> None:
    """Rank 0 on a CPU with native bf16 products, rank 1 on one that emulates them: ns_dtype=None
    would resolve to bf16 on one and fp32 on the other."""
    import os

    from dmuon import ns_defaults

    os.environ[ns_defaults.CPU_BF16_OVERRIDE] = "native" if dist.get_rank() == 0 else "emulated"
    ns_defaults._cpu_bf16_native.cache_clear()
    try:
        muon(make_params())
    finally:
        del os.environ[ns_defaults.CPU_BF16_OVERRIDE]
        ns_defaults._cpu_bf16_native.cache_clear()


def momentum_dtype_of_rank() -> None:
    muon(make_params(), momentum_dtype="int8" if dist.get_rank() == 0 else "bfloat16")


def update_rule_set_on_rank_1_then_step() -> None:
    params = make_params()
    opt = muon(params)
    set_grads(params)
    opt.step()
    if dist.get_rank() == 1:
        opt.param_groups[0]["update_rule"] = "normuon"
    opt.step()


def bad_lr_on_rank_1() -> None:
    muon(make_params(), weight_decay=float("inf") if dist.get_rank() == 1 else 0.1)


def load_on_rank_0_only() -> None:
    params = make_params()
    opt = muon(params)
    set_grads(params)
    opt.step()
    if dist.get_rank() == 0:
        opt.load_state_dict(opt.state_dict())
    else:
        opt.step()


def sparse_gradient_on_rank_1() -> None:
    params = make_params()
    opt = muon(params)
    set_grads(params)
    if dist.get_rank() == 1:
        params[0].grad = params[0].grad.to_sparse()
    opt.step()


@pytest.mark.parametrize("fn,expected", [
    (add_group_on_rank_0_only,
     r"RuntimeError: Ranks are in different optimizer calls: some called add_param_group, others step"),
    (add_group_with_lr_of_rank,
     r"ValueError: Ranks disagree .*param group 1's lr is 0.01 on rank 0 but 0.02 on rank 1"),
    (add_group_with_shape_of_rank,
     r"ValueError: Ranks disagree .*param group 1's parameter 0 is unnamed \(5, 5\) float32 for muon .* on rank 0 "
     r"but unnamed \(5, 6\) float32 for muon"),
    (unnamed_in_rank_order, r"ValueError: Ranks disagree .*param group 0's parameter 0 is unnamed \(6, 6\) "
                            r"float32 for muon with values [0-9a-f]{16} .*pass names"),
    (nonfinite_policy_of_rank,
     r"ValueError: Ranks disagree .*nonfinite_grads is 'raise' on rank 0 but 'skip' on rank 1"),
    (extra_named_matrix_on_rank_1,
     r"ValueError: Ranks disagree .*param group 0's parameter 2 is missing on rank 0 but 'c' \(5, 5\) float32 for "
     r"muon on rank 1"),
    (load_on_rank_0_only,
     r"RuntimeError: Ranks are in different optimizer calls: some called load_state_dict, others step"),
    (momentum_dtype_of_rank,
     r"ValueError: Ranks disagree .*param group 0's momentum_dtype is 'int8' on rank 0 but 'bfloat16' on rank 1"),
    (update_rule_set_on_rank_1_then_step,
     r"ValueError: Ranks disagree .*param group 0's update_rule is 'muon' on rank 0 but 'normuon' on rank 1"),
    (processors_of_two_kinds, r"ValueError: Ranks disagree .*what ns_dtype=None resolves to is .*bfloat16 .*on rank 0 "
                              r"but .*float32 \(no AVX512-BF16 or AMX"),
])
def test_every_rank_raises_the_same_error(fn, expected):
    assert_same_error(run_on_ranks(2, error_of, fn), expected)


@pytest.mark.parametrize("fn,expected", [
    (bad_lr_on_rank_1, "Invalid weight_decay=inf. Must be finite."),
    (sparse_gradient_on_rank_1, "Muon does not support sparse gradients: 'group0.param0'"),
])
def test_a_local_error_stops_every_rank_with_its_message(fn, expected):
    errors = run_on_ranks(3, error_of, fn)
    assert all(e is not None and expected in e for e in errors), errors
    assert "raised on rank 1" in errors[0] and "raised on rank 1" in errors[2]


def add_group_then_step() -> dict:
    params = make_params([(8, 4), (6, 6), (5, 7)])
    opt = muon(params[:1])
    opt.add_param_group({"params": params[1:], "algorithm": "muon", "lr": 0.02})
    set_grads(params)
    opt.step()
    return {"params": [p.detach().clone() for p in params], "groups": len(opt.param_groups)}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_group_added_on_every_rank_steps_as_one_process(world):
    alone = run_on_ranks(1, add_group_then_step)[0]
    for result in run_on_ranks(world, add_group_then_step):
        assert result["groups"] == 2
        assert all(torch.equal(a, b) for a, b in zip(result["params"], alone["params"]))


# ---------------------------------------------------------------- matching parameters across ranks


def zero_replicas_unnamed() -> None:
    """Two zero-initialised matrices of one shape (LoRA-style): their order cannot be checked."""
    a, b = nn.Parameter(torch.zeros(6, 6)), nn.Parameter(torch.zeros(6, 6))
    muon([a, b])


def permuted_replicas_in_rank_order() -> None:
    """Two matrices whose values are a permutation of each other (equal sums), in another order
    on rank 1: the values' digest depends on positions, so the order shows."""
    a = torch.arange(36.0).reshape(6, 6)
    first, second = nn.Parameter(a.clone()), nn.Parameter(a.flip(0).clone())
    muon([first, second] if dist.get_rank() == 0 else [second, first])


def unnamed_dtensors_of_one_shape() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = [nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])) for _ in range(2)]
    muon(params)


def two_optimizers_stepped_in_swapped_order() -> None:
    """Equal configurations (same shapes, same options): only their numbers tell them apart."""
    first, second = make_params([(6, 6)], seed=0), make_params([(6, 6)], seed=0)
    opts = [muon(first), muon(second)]
    set_grads(first + second)
    opts[dist.get_rank() % 2].step()


def stepping_another_copy() -> None:
    """The same optimizer number, but a deep copy that has taken fewer steps."""
    import copy

    params = make_params()
    opt = muon(params)
    set_grads(params)
    opt.step()
    copied = copy.deepcopy(opt)
    opt.step()
    (opt if dist.get_rank() == 0 else copied).step()


@pytest.mark.parametrize("fn,expected", [
    (zero_replicas_unnamed, r"ValueError: Muon parameters \['group0.param0', 'group0.param1'\] are unnamed, of the "
                            r"same shape \(6, 6\), and hold identical values.*Pass names"),
    (permuted_replicas_in_rank_order, r"ValueError: Ranks disagree .*param group 0's parameter 0 is unnamed \(6, 6\) "
                                      r"float32 for muon with values"),
    (unnamed_dtensors_of_one_shape, r"ValueError: Muon parameters .* are unnamed, of the same shape \(8, 4\), and are "
                                    r"DTensors or meta tensors"),
    (two_optimizers_stepped_in_swapped_order,
     r"ValueError: Ranks disagree on the optimizer configuration: the optimizer's number is \d+ on rank 0 but \d+ on "
     r"rank 1"),
    (stepping_another_copy, r"ValueError: Ranks disagree .*number of steps taken is 2 on rank 0 but 1 on rank 1"),
])
def test_parameters_that_cannot_be_matched_are_refused_on_every_rank(fn, expected):
    assert_same_error(run_on_ranks(2, error_of, fn), expected)


# ---------------------------------------------------------------- settings changed after construction


def changed_on_rank_1(key: str, value) -> None:
    params = make_params()
    opt = muon(params)
    set_grads(params)
    opt.step()
    if dist.get_rank() == 1:
        opt.param_groups[0][key] = value
    set_grads(params, seed=2)
    opt.step()


@pytest.mark.parametrize("key,value,expected", [
    ("lr", 0.02, r"ValueError: Ranks disagree .*param group 0's lr is 0.01 on rank 0 but 0.02 on rank 1"),
    ("ns_steps", 3, r"ValueError: Ranks disagree .*param group 0's ns_steps is None on rank 0 but 3 on rank 1"),
    ("ns_method", "gram", r"ValueError: Ranks disagree .*param group 0's ns_method is 'auto' on rank 0 but 'gram'"),
    ("ns_steps", 0, r"ValueError: Invalid ns_steps=0.* \(raised on rank 1; every rank stops here\)"),
    ("momentum", 1.5, r"ValueError: Invalid momentum=1.5 in param group 0.*raised on rank 1"),
])
def test_settings_changed_on_one_rank_are_caught_at_the_next_step(key, value, expected):
    """The step's agreement carries the hyperparameters as they are now (schedulers and users
    change them between steps), checked as the constructor checks them when they changed."""
    errors = run_on_ranks(3, error_of, changed_on_rank_1, key, value)
    assert errors[0] is not None and errors[0] == errors[2], errors
    assert re.match(expected, errors[0]), errors[0]


def changed_on_every_rank() -> dict:
    params = make_params()
    opt = muon(params)
    set_grads(params)
    opt.step()
    opt.param_groups[0]["lr"] = 0.03
    opt.param_groups[0]["ns_steps"] = 4
    set_grads(params, seed=2)
    opt.step()
    return {"params": [p.detach().clone() for p in params]}


def test_settings_changed_alike_on_every_rank_step_as_one_process():
    alone = run_on_ranks(1, changed_on_every_rank)[0]
    for r in run_on_ranks(3, changed_on_every_rank):
        assert all(torch.equal(a, b) for a, b in zip(r["params"], alone["params"]))


# ---------------------------------------------------------------- ranks in calls of different sizes


def construct_while_others_step() -> None:
    params = make_params()
    opt = muon(params)
    set_grads(params)
    if dist.get_rank() == 0:
        muon(make_params(seed=3))
    else:
        opt.step()


def construct_while_others_load() -> None:
    params = make_params()
    opt = muon(params)
    state = opt.state_dict()
    if dist.get_rank() == 0:
        muon(make_params(seed=3))
    else:
        opt.load_state_dict(state)


def load_malformed_on_rank_1() -> dict:
    """A state dict that torch's own loading would fail on with a TypeError, on one rank."""
    params = make_params()
    opt = muon(params)
    set_grads(params)
    opt.step()
    state = opt.state_dict()
    zeroed = {**state, "state": {k: {"momentum_buffer": torch.zeros_like(v["momentum_buffer"])}
                                 for k, v in state["state"].items()}}  # loads fine alone: must be undone
    broken = {**state, "param_groups": [{**g, "params": 5} for g in state["param_groups"]]}
    before = [opt.state[p]["momentum_buffer"].clone() for p in params]
    error = error_of(opt.load_state_dict, broken if dist.get_rank() == 1 else zeroed)
    kept = all(torch.equal(b, opt.state[p]["momentum_buffer"]) for b, p in zip(before, params))
    set_grads(params, seed=2)
    opt.step()  # every rank kept its state and still steps together
    return {"error": error, "kept": kept, "params": [p.detach().clone() for p in params]}


@pytest.mark.parametrize("fn,expected", [
    (construct_while_others_step, "some called construction, others step"),
    (construct_while_others_load, "some called construction, others load_state_dict"),
])
def test_ranks_in_calls_of_different_sizes_all_raise(fn, expected):
    """Every entry point sends a header of the same length, so no rank is left waiting."""
    errors = run_on_ranks(2, error_of, fn)
    assert all(e is not None and expected in e for e in errors), errors


def test_a_load_that_fails_on_one_rank_fails_on_every_rank_and_changes_nothing():
    results = run_on_ranks(3, load_malformed_on_rank_1)
    assert all(r["error"] is not None and "'params' as a int" in r["error"] for r in results), results
    assert "raised on rank 1" in results[0]["error"]
    for r in results:
        assert r["kept"] and all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"]))


def load_bad_hyperparameters(key: str, value) -> None:
    params = make_params()
    opt = muon(params)
    state = opt.state_dict()
    state["param_groups"][0][key] = value
    opt.load_state_dict(state)


@pytest.mark.parametrize("key,value,expected", [
    ("lr", float("nan"), "Invalid lr=nan in param group 0 of the state dict. Must be finite."),
    ("lr", -1.0, "Invalid lr=-1.0 in param group 0 of the state dict. Must be >= 0.0."),
    ("momentum", 1.5, "Invalid momentum=1.5 in param group 0 of the state dict"),
    ("adamw_betas", (1.0, 0.999), "Invalid adamw_betas[0]=1.0 in param group 0 of the state dict"),
    ("ns_coefficients", (100.0, -100.0, 100.0), "Invalid ns_coefficients: after step 1"),
])
def test_load_state_dict_refuses_what_the_constructor_refuses(key, value, expected):
    errors = run_on_ranks(2, error_of, load_bad_hyperparameters, key, value)
    assert all(e is not None and e.startswith("ValueError") and expected in e for e in errors), errors


def load_across_layouts(direction: str) -> None:
    """The state of a DDP (plain) optimizer loaded into an FSDP2 one, or the reverse."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    init = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    plain = nn.Parameter(init.clone())
    sharded = nn.Parameter(distribute_tensor(init.clone(), mesh, [Shard(0)]))
    source, target = (plain, sharded) if direction == "ddp->fsdp" else (sharded, plain)
    opt = dmuon.Muon([("w", source)], lr=0.01)
    source.grad = source.detach() * 0 + 1
    opt.step()
    dmuon.Muon([("w", target)], lr=0.01).load_state_dict(opt.state_dict())


@pytest.mark.parametrize("direction,saved,current", [
    ("ddp->fsdp", "a plain tensor", "a DTensor with placements (Shard(dim=0),)"),
    ("fsdp->ddp", "a DTensor with placements (Shard(dim=0),)", "a plain tensor"),
])
def test_a_state_dict_of_another_layout_is_refused_at_load(direction, saved, current):
    errors = run_on_ranks(2, error_of, load_across_layouts, direction)
    for e in errors:
        assert e is not None and f"'w' has momentum_buffer as {saved}, but the parameter is {current}" in e, e
        assert "torch.distributed.checkpoint" in e


# ---------------------------------------------------------------- gradients missing on some ranks


# ---------------------------------------------------------------- a model built on the meta device


def built_on_meta(shard: bool) -> dict:
    """The usual way to build a large model: on the meta device, FSDP2 applied there, the
    optimizer built, then ``to_empty`` and initialization (here: the same values everywhere)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    if shard:
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    opt = dmuon.Muon(model, lr=0.02)  # no collective may run on meta tensors
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(distribute_tensor(torch.randn(p.shape), p.device_mesh, p.placements) if shard else
                    torch.randn(p.shape))
    for step in range(2):
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: (p.full_tensor() if shard else p.detach()).clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("shard", [False, True])
def test_an_optimizer_built_on_the_meta_device_steps_after_to_empty(shard):
    results = run_on_ranks(2, built_on_meta, shard)
    moved = {n: not torch.equal(v, results[0][n]) for n, v in results[1].items()}
    assert not any(moved.values()), moved  # the replicas agree
    torch.manual_seed(0)
    init = [torch.randn(s) for s in [(16, 8), (16,), (8, 16), (8,)]]
    assert all(not torch.equal(v, i) for v, i in zip(results[0].values(), init))  # and every parameter trained


def two_ddp_stages(given: str, dtype: torch.dtype = torch.float32) -> dict:
    """Ranks {0, 1} and {2, 3} train two models of the same architecture and initial values
    (pipeline stages, say), each under DDP on its own sub-group, each with its own optimizer:
    built from the DDP model (``given`` "ddp"), or from the inner model with no process group
    ("inner"), where dmuon takes the whole job for its replicas."""
    from torch.nn.parallel import DistributedDataParallel

    from tests.helpers import tiny_mlp

    stage_group, _ = dist.new_subgroups(2)
    stage = dist.get_rank() // 2
    model = tiny_mlp(layers=3, dtype=dtype)
    ddp = DistributedDataParallel(model, process_group=stage_group)
    opt = dmuon.Muon(ddp if given == "ddp" else model, lr=0.02)
    before = [p.detach().clone() for p in model.parameters()]
    error = None
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + stage)).to(dtype)
        opt.zero_grad()
        ddp(x.chunk(2)[dist.get_rank() % 2]).float().square().mean().backward()
        error = error_of(opt.step)
        if error is not None:
            break
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return dict(error=error, unchanged=unchanged, params=[p.detach().clone() for p in model.parameters()])


def one_stage_alone(stage: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """What a stage's two ranks compute, in one process on their whole batch."""
    from tests.helpers import tiny_mlp

    model = tiny_mlp(layers=3, dtype=dtype)
    opt = dmuon.Muon(model, lr=0.02)
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + stage)).to(dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_optimizer_of_a_ddp_model_on_a_sub_group_steps_with_that_group(dtype):
    results = run_on_ranks(4, two_ddp_stages, "ddp", dtype)
    for rank, r in enumerate(results):
        assert r["error"] is None
        alone = single_process(one_stage_alone, rank // 2, dtype)
        for got, want, replica in zip(r["params"], alone, results[rank ^ 1]["params"]):
            assert torch.equal(got, replica)  # the stage's replicas, bitwise
            tolerance = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got, want, **tolerance)


def process_group_of_another_kind() -> str | None:
    return error_of(lambda: dmuon.Muon(make_params(), process_group="world"))


def test_a_process_group_that_is_not_one_is_named():
    errors = run_on_ranks(2, process_group_of_another_kind)
    assert_same_error(errors, r"TypeError: Invalid process_group='world'\. Must be a torch\.distributed\.ProcessGroup")


