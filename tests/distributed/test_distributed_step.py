"""A distributed step equals the single-process step, bitwise, on identical full gradients
(docs/testing.md rows 3, 5, 6, 10–13): DDP, FSDP2-style Shard(0) and HSDP layouts, world sizes 1–4.

Every rank runs the single-process reference on the full tensors itself and compares its own
shard of the parameters and momentum with the reference's rows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

import dmuon
from dmuon.agreement import HEADER_LEN
from dmuon.reference import ReferenceMuon
from tests.harness import WORLD_SIZES, run_on_ranks
from tests.helpers import (
    as_layout,
    assert_same_error,
    dcp_load,
    dcp_save,
    error_of,
    full_tensor,
    full_tensors,
    local,
    params_and_reference,
    placements_for,
    rows_of,
    step_with_reference,
)

SHAPES = [(64, 32), (32, 96), (48, 48), (7, 5), (3, 16), (3, 8, 12), (16, 96), (16, 96)]
HPARAMS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, ns_method="standard", ns_dtype=torch.float32)


def step_parity(layout: str, shapes, steps: int, replica_split, comm_dtype=None, seed: int = 0,
                ns_dtype: torch.dtype = torch.float32, **options) -> dict:
    world = dist.get_world_size()
    mesh, placements = placements_for(layout, world)
    params, ref_params = params_and_reference(full_tensors(shapes, seed), mesh, placements)
    hparams = {**HPARAMS, "ns_dtype": ns_dtype, **options}
    opt = dmuon.Muon([{"params": params, "algorithm": "muon", "param_names": names_for(params)}],
                     replica_split=replica_split, comm_dtype=comm_dtype, **hparams)
    ref = ReferenceMuon(ref_params, **hparams)
    stats = []
    for step in range(steps):
        step_with_reference(opt, ref, params, ref_params, full_tensors(shapes, seed=100 + step), mesh, placements)
        stats.append(opt.last_step_stats)
    # expert stacks sharded on dim 0 are orthogonalized locally: a plan of their own
    positions = [(plan, plan.units[0].layout.group_ranks.index(dist.get_rank())) for plan in opt.plans]
    equal_params = [torch.equal(local(p), rows_of(r.detach(), p)) for p, r in zip(params, ref_params)]
    equal_momentum = [
        torch.equal(local(opt.state[p]["momentum_buffer"]), rows_of(ref.state[r]["momentum_buffer"], p))
        for p, r in zip(params, ref_params)
    ]
    # an update rule's row state: whole on every rank (experts sharded on dim 0: this rank's)
    equal_row_states = [
        torch.equal(local(opt.state[p][key]), rows_of(ref.state[r][key], opt.state[p][key]))
        for p, r in zip(params, ref_params) for key in ("row_second_moment",) if key in ref.state[r]
    ]
    close_params = [
        ((local(p) - rows_of(r.detach(), p)).norm() / (rows_of(r.detach(), p).norm() + 1e-12)).item()
        for p, r in zip(params, ref_params)
    ]
    return dict(
        equal_params=equal_params, equal_momentum=equal_momentum, equal_row_states=equal_row_states,
        close_params=close_params, momentum_dtypes={opt.state[p]["momentum_buffer"].dtype for p in params},
        matrices=[s.matrices_orthogonalized for s in stats], bytes_sent=[s.bytes_sent for s in stats],
        planned_bytes=sum(plan.bytes_sent(p) for plan, p in positions),
        planned_matrices=sum(plan.matrices(p) for plan, p in positions),
        placements_kept=all(
            not isinstance(p, DTensor) or tuple(p.placements) == tuple(placements) for p in params
        ),
    )


def names_for(params) -> list[str]:
    """Names for a list of parameters: unnamed DTensors of one shape cannot be matched across ranks."""
    return [f"p{i}" for i in range(len(params))]


def total_matrices(shapes) -> int:
    return sum(s[0] if len(s) == 3 else 1 for s in shapes)


def agreed_flag_bytes(world: int) -> int:
    """The per-step all-reduce of the agreement header (its float32 fields; the per-parameter
    flags travel only when ranks lack different gradients)."""
    return 0 if world == 1 else 4 * HEADER_LEN


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_step_is_bitwise_equal_to_single_process(layout, world):
    results = run_on_ranks(world, step_parity, layout, SHAPES, 3, None)
    for rank, r in enumerate(results):
        assert all(r["equal_momentum"]), (rank, r)
        assert all(r["equal_params"]), (rank, r["close_params"])
        assert r["placements_kept"]
    # every matrix orthogonalized exactly once job-wide, each step, as the plan says
    for step in range(3):
        assert sum(r["matrices"][step] for r in results) == total_matrices(SHAPES)
    for r in results:
        assert all(m == r["planned_matrices"] for m in r["matrices"])
        # bytes on the wire: the plan's prediction plus the flag all-reduce, exactly
        assert all(b == r["planned_bytes"] + agreed_flag_bytes(world) for b in r["bytes_sent"])


@pytest.mark.parametrize("layout,world", [("ddp", 2), ("ddp", 3), ("fsdp", 2), ("fsdp", 3), ("hsdp", 4)])
def test_updates_go_back_in_the_narrower_newton_schulz_dtype_losing_nothing(layout, world):
    """fp32 parameters, bf16 Newton–Schulz: the owners send the updates back in bf16 (they are bf16
    values), the gradients still go in fp32. The step stays bitwise the single process's, the
    plan counts the bytes exactly, and they are fewer than with fp32 both ways (comm_dtype)."""
    narrow = run_on_ranks(world, step_parity, layout, SHAPES, 2, None, None, 0, torch.bfloat16)
    wide = run_on_ranks(world, step_parity, layout, SHAPES, 2, None, torch.float32, 0, torch.bfloat16)
    for rank, (r, w) in enumerate(zip(narrow, wide)):
        assert all(r["equal_momentum"]) and all(r["equal_params"]), (rank, r["close_params"])
        assert all(w["equal_params"]), (rank, w["close_params"])
        assert all(b == r["planned_bytes"] + agreed_flag_bytes(world) for b in r["bytes_sent"])
    assert sum(r["planned_bytes"] for r in narrow) < sum(w["planned_bytes"] for w in wide)


@pytest.mark.parametrize("world,replica_split", [(2, True), (2, False), (4, True), (4, False), (4, None)])
def test_hsdp_step_is_bitwise_equal_to_single_process(world, replica_split):
    results = run_on_ranks(world, step_parity, "hsdp", SHAPES, 2, replica_split)
    for rank, r in enumerate(results):
        assert all(r["equal_momentum"]) and all(r["equal_params"]), (rank, r["close_params"])
        assert all(b == r["planned_bytes"] + agreed_flag_bytes(world) for b in r["bytes_sent"])
    done = sum(r["matrices"][0] for r in results)
    if replica_split:
        assert done == total_matrices(SHAPES)  # the replicas split the work
    elif replica_split is False:
        assert done == 2 * total_matrices(SHAPES)  # each of the 2 replica groups does it all


# shapes whose stacks CPU kernels once rounded by alignment (fp32/fp64: 9×130, 130×9, 5×31) or by
# batch size (bf16: 16×40, 16×16): an owner's stack and the reference's matrices alone differed
ODD_SHAPES = [(9, 130), (9, 130), (9, 130), (130, 9), (130, 9), (5, 31), (5, 31), (16, 40), (16, 40), (16, 16)]


@pytest.mark.parametrize("layout,world,ns_dtype", [("ddp", 2, torch.float32), ("fsdp", 3, torch.float32),
                                                   ("ddp", 3, torch.float64), ("fsdp", 2, torch.bfloat16)])
def test_odd_shapes_are_bitwise_equal_to_single_process(layout, world, ns_dtype):
    for rank, r in enumerate(run_on_ranks(world, step_parity, layout, ODD_SHAPES, 2, None, None, 0, ns_dtype)):
        assert all(r["equal_params"]) and all(r["equal_momentum"]), (rank, r["close_params"])


def test_more_ranks_than_matrices():
    results = run_on_ranks(4, step_parity, "fsdp", [(40, 24), (3, 16)], 2, None)
    assert all(all(r["equal_params"]) for r in results)
    assert sorted(r["matrices"][0] for r in results) == [0, 0, 1, 1]


def test_bf16_comm_dtype_halves_bytes_and_stays_close():
    exact = run_on_ranks(2, step_parity, "fsdp", SHAPES, 1, None)
    halved = run_on_ranks(2, step_parity, "fsdp", SHAPES, 1, None, torch.bfloat16)
    for e, h in zip(exact, halved):
        assert h["planned_bytes"] * 2 == e["planned_bytes"]
        assert max(h["close_params"]) < 1e-2


# ---------------------------------------------------------------- agreement before any collective

def bad_values_on_some_ranks(policy: str, values: dict[int, float]) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    init = full_tensors(SHAPES[:3], 0)
    params = [nn.Parameter(distribute_tensor(t.clone(), mesh, [Shard(0)])) for t in init]
    opt = dmuon.Muon([{"params": params, "algorithm": "muon"}], nonfinite_grads=policy, **HPARAMS)
    for p, g in zip(params, full_tensors(SHAPES[:3], 1)):
        p.grad = distribute_tensor(g, mesh, [Shard(0)])
    if dist.get_rank() in values:
        local(params[0].grad).view(-1)[0] = values[dist.get_rank()]
    before = [local(p).clone() for p in params]
    try:
        opt.step()
        outcome = "stepped"
    except FloatingPointError:
        outcome = "raised"
    unchanged = all(torch.equal(b, local(p)) for b, p in zip(before, params))
    finite = all(torch.isfinite(local(p)).all() for p in params)
    return dict(outcome=outcome, unchanged=unchanged, finite=finite, skipped=opt.skipped_steps, state=len(opt.state))


@pytest.mark.parametrize("policy,outcome", [("skip", "stepped"), ("raise", "raised")])
def test_nonfinite_gradient_on_one_rank_only(policy, outcome):
    results = run_on_ranks(3, bad_values_on_some_ranks, policy, {2: float("nan")})
    for r in results:
        assert r["outcome"] == outcome and r["unchanged"] and r["state"] == 0
        if policy == "skip":
            assert r["skipped"] == 1


@pytest.mark.parametrize("values,skipped", [({2: 1e20}, False), ({0: 1e20, 2: float("inf")}, True)])
def test_huge_finite_gradient_is_stepped_and_inf_beside_it_is_not(values, skipped):
    """The quick check flags 1e20 (its fp32 square overflows); the exact second look steps it,
    on every rank, unless some rank also has a truly non-finite gradient."""
    for r in run_on_ranks(3, bad_values_on_some_ranks, "skip", values):
        assert r["outcome"] == "stepped" and r["skipped"] == int(skipped) and r["unchanged"] == skipped
        assert r["finite"]


def missing_grads() -> dict:
    rank = dist.get_rank()
    init = full_tensors(SHAPES[:4], 0)
    params = [nn.Parameter(t.clone()) for t in init]
    opt = dmuon.Muon([{"params": params, "algorithm": "muon"}], **HPARAMS)
    grads = full_tensors(SHAPES[:4], 1)
    for i, (p, g) in enumerate(zip(params, grads)):
        # param 0: no grad anywhere; param 1: no grad on rank 0 only; the rest: everywhere
        p.grad = None if i == 0 or (i == 1 and rank == 0) else g
    opt.step()
    return dict(changed=[not torch.equal(t, p.detach()) for t, p in zip(init, params)],
                params=[p.detach() for p in params])


def test_missing_gradients_on_all_or_some_ranks():
    results = run_on_ranks(2, missing_grads)
    for r in results:
        assert r["changed"] == [False, False, True, True]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


def adamw_group_empty_on_some_ranks() -> None:
    """An AdamW group that holds a tensor on rank 0 only: the ranks could not agree on which
    parameters to leave alone when some lack a gradient, so it is refused."""
    params = [nn.Parameter(t) for t in full_tensors(SHAPES[:3], 0)]
    extra = [nn.Parameter(torch.ones(3))] if dist.get_rank() == 0 else []
    dmuon.Muon([{"params": params, "algorithm": "muon"}, {"params": extra, "algorithm": "adamw"}], **HPARAMS)


def test_adamw_group_empty_on_some_ranks_is_refused_on_every_rank():
    assert_same_error(run_on_ranks(3, error_of, adamw_group_empty_on_some_ranks),
                      r"ValueError: Ranks disagree .*param group 1's parameter 0 is unnamed \(3,\) float32 for adamw "
                      r"on rank 0 but missing on rank 1")


def divergent_lr() -> None:
    params = [nn.Parameter(t) for t in full_tensors(SHAPES[:2], 0)]
    dmuon.Muon(params, lr=0.01 * (1 + dist.get_rank()))


def muon_parameters_differ_across_ranks() -> None:
    shapes = [(8, 4), (6, 6)] if dist.get_rank() == 0 else [(8, 4), (6, 7)]
    dmuon.Muon([nn.Parameter(t) for t in full_tensors(shapes, 0)])


def partial_layout() -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    param = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Partial()]))
    dmuon.Muon([param])


@pytest.mark.parametrize("fn,expected", [
    (divergent_lr, r"ValueError: Ranks disagree .*param group 0's lr is 0.01 on rank 0 but 0.02 on rank 1"),
    (muon_parameters_differ_across_ranks,
     r"ValueError: Ranks disagree .*param group 0's parameter 1 is unnamed \(6, 6\) float32 for muon .* on rank 0 "
     r"but unnamed \(6, 7\) float32 for muon .* on rank 1"),
    (partial_layout, r"NotImplementedError: .*'group0.param0'.*Partial"),
])
def test_bad_setups_raise_the_same_error_on_every_rank(fn, expected):
    assert_same_error(run_on_ranks(2, error_of, fn), expected)


def step_statistics(layout: str) -> dict:
    """One step on SHAPES; the optimizer's statistics, this rank's and the job's."""
    world = dist.get_world_size()
    mesh, placements = placements_for(layout, world)
    params = [nn.Parameter(as_layout(t, mesh, placements)) for t in full_tensors(SHAPES, 0)]
    opt = dmuon.Muon([{"params": params, "algorithm": "muon", "name": "matrices", "param_names": names_for(params)}],
                     **HPARAMS)
    for p, g in zip(params, full_tensors(SHAPES, 100)):
        p.grad = as_layout(g, mesh, placements)
    opt.step()
    return dict(mine=opt.statistics(), job=opt.statistics(all_ranks=True))


@pytest.mark.parametrize("layout,world", [("fsdp", 2), ("fsdp", 3), ("ddp", 3)])
def test_statistics_of_the_job_match_one_process(layout, world):
    alone = run_on_ranks(1, step_statistics, "ddp")[0]["job"]
    results = run_on_ranks(world, step_statistics, layout)
    matrices = sum(s[0] if len(s) == 3 else 1 for s in SHAPES)
    assert alone["matrices"] == matrices
    for r in results:
        job = r["job"]
        assert job["muon/update_rms/matrices"] == pytest.approx(alone["muon/update_rms/matrices"], rel=1e-6)
        assert job["matrices"] == matrices and job["ns_gflop"] == pytest.approx(alone["ns_gflop"])
        assert job["bytes_sent"] == sum(x["mine"]["bytes_sent"] for x in results) > 0
        assert job["ns_seconds"] == max(x["mine"]["ns_seconds"] for x in results)
        assert r["mine"]["matrices"] < matrices  # each rank did its share only


# ---------------------------------------------------------------- expert parallel


def expert_stack_step(mesh_shape: tuple[int, ...], experts: int) -> dict:
    """A stack of ``experts`` 8×12 matrices sharded on dim 0 over every dim of the mesh, and a
    plain matrix; expert 0 gets a zero gradient (it received no tokens)."""
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] * len(mesh_shape)
    init = full_tensors([(experts, 8, 12), (16, 24)], 0)
    params = [nn.Parameter(distribute_tensor(init[0].clone(), mesh, placements)), nn.Parameter(init[1].clone())]
    ref_params = [nn.Parameter(t.clone()) for t in init]
    opt = dmuon.Muon([{"params": params, "algorithm": "muon"}], **HPARAMS)
    ref = ReferenceMuon(ref_params, **HPARAMS)
    for step in range(2):
        grads = full_tensors([(experts, 8, 12), (16, 24)], 100 + step)
        grads[0][0] = 0.0
        params[0].grad = distribute_tensor(grads[0], mesh, placements)
        params[1].grad = grads[1].clone()
        for r, g in zip(ref_params, grads):
            r.grad = g.clone()
        opt.step()
        ref.step()
    stats = opt.last_step_stats
    return dict(
        equal=[torch.equal(params[0].full_tensor(), ref_params[0].detach()), torch.equal(params[1], ref_params[1])],
        momentum_equal=torch.equal(opt.state[params[0]]["momentum_buffer"].full_tensor(),
                                   ref.state[ref_params[0]]["momentum_buffer"]),
        placements=tuple(params[0].placements) == tuple(placements),
        local_experts=params[0].to_local().shape[0], matrices=stats.matrices_orthogonalized,
        bytes_sent=stats.bytes_sent, plain_matrix_bytes=opt.plans[0].bytes_sent(dist.get_rank()),
    )


@pytest.mark.parametrize("mesh_shape,experts", [((2,), 4), ((3,), 5), ((4,), 5), ((4,), 3), ((2, 2), 6)])
def test_expert_stacks_are_orthogonalized_where_they_live(mesh_shape, experts):
    """Expert parallel (and FSDP2 on an expert stack, and both on a 2-D mesh): every rank
    orthogonalizes the experts it holds, as one batch — bitwise the single-process result, no
    bytes moved for them, every expert exactly once; a rank with no experts and an expert with
    a zero gradient are fine."""
    world = math.prod(mesh_shape)
    results = run_on_ranks(world, expert_stack_step, mesh_shape, experts)
    for rank, r in enumerate(results):
        assert all(r["equal"]) and r["momentum_equal"] and r["placements"], (rank, r)
        # only the plain matrix and the flags travel; the stack's matrices stay home
        flags = 4 * HEADER_LEN
        assert r["bytes_sent"] == r["plain_matrix_bytes"] + flags, (rank, r)
    assert sum(r["local_experts"] for r in results) == experts
    owned_plain = sum(r["matrices"] - r["local_experts"] for r in results)
    assert owned_plain == 1  # the plain 16x24 matrix, once in the job


# ---------------------------------------------------------------- fused weights


FUSED = [((48, 32), [32, 8, 8]), ((64, 24), 16), ((2, 12, 20), [6, 6])]  # GQA-style QKV, per head, gate/up stack


def fused_step(layout: str) -> dict:
    """Parameters whose row blocks are orthogonalized separately (``ns_blocks``), one group each."""
    world = dist.get_world_size()
    mesh, placements = placements_for(layout, world)
    params, ref_params = params_and_reference(full_tensors([shape for shape, _ in FUSED], 0), mesh, placements)
    groups = [{"params": [p], "algorithm": "muon", "ns_blocks": blocks} for p, (_, blocks) in zip(params, FUSED)]
    opt = dmuon.Muon(groups, **HPARAMS)
    ref = ReferenceMuon([{"params": [p], "ns_blocks": blocks} for p, (_, blocks) in zip(ref_params, FUSED)], **HPARAMS)
    for step in range(2):
        grads = full_tensors([shape for shape, _ in FUSED], 100 + step)
        step_with_reference(opt, ref, params, ref_params, grads, mesh, placements)
    return dict(equal=[torch.equal(local(p), rows_of(r.detach(), p)) for p, r in zip(params, ref_params)],
                matrices=opt.last_step_stats.matrices_orthogonalized)


@pytest.mark.parametrize("layout,world", [("ddp", 1), ("fsdp", 2), ("fsdp", 3), ("ddp", 3)])
def test_fused_weights_blocks_match_single_process(layout, world):
    results = run_on_ranks(world, fused_step, layout)
    for rank, r in enumerate(results):
        assert all(r["equal"]), (rank, r)
    # 3 + 4 blocks, and 2 stacked matrices of 2 blocks (the stack is local under FSDP2)
    assert sum(r["matrices"] for r in results) == 3 + 4 + 2 * 2


def expert_checkpoint(path: str, mesh_shape: tuple[int, ...] | None) -> dict:
    """Save (sharded over experts on ``mesh_shape``) or load (``None``: one process) a stack and
    its momentum through torch.distributed.checkpoint."""
    model = nn.Module()
    stack = full_tensors([(6, 8, 12)], 0)[0]
    if mesh_shape:
        stack = distribute_tensor(stack, init_device_mesh("cpu", mesh_shape), [Shard(0)] * len(mesh_shape))
    model.experts = nn.Parameter(stack)
    opt = dmuon.Muon(model, **HPARAMS)
    if mesh_shape:
        model.experts.grad = distribute_tensor(full_tensors([(6, 8, 12)], 1)[0], model.experts.device_mesh,
                                               model.experts.placements)
        opt.step()
        dcp_save(model, opt, path)
    else:
        dcp_load(model, opt, path)
    return dict(experts=full_tensor(model.experts), momentum=full_tensor(opt.state[model.experts]["momentum_buffer"]))


def test_expert_parallel_checkpoint_loads_in_one_process(tmp_path):
    saved = run_on_ranks(4, expert_checkpoint, str(tmp_path / "ep"), (2, 2))[0]
    loaded = run_on_ranks(1, expert_checkpoint, str(tmp_path / "ep"), None)[0]
    assert torch.equal(saved["experts"], loaded["experts"]) and torch.equal(saved["momentum"], loaded["momentum"])
    assert torch.count_nonzero(loaded["momentum"]) > 0
