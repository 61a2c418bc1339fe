"""Checkpointing through ``torch.distributed.checkpoint`` (DCP) (docs/testing.md rows 7, 8, 9, 18).

* Row 7: FSDP2 at 2 ranks, save -> load into a fresh model and optimizer -> continue is bitwise
  equal to the uninterrupted run; the same for DDP (state replicated as plain tensors).
* Row 8: a checkpoint saved at 4 ranks (FSDP2) loads at 2 and 3 ranks (FSDP2) and in one
  process (plain module): the state is exactly the saved one, and the next steps match the
  4-rank continuation within reduction-order tolerance.
* Row 9: ``get_optimizer_state_dict`` before the first step (DCP then runs a zero-grad, lr=0
  ``step()`` itself) neither hangs nor changes a parameter bit; state keys are the same on all
  ranks; every per-rank state tensor is a DTensor; ``load_state_dict(state_dict=...)`` works.
* Row 18: every state tensor keeps its type, placements, dtype, shape and device across save,
  load and further steps.
* Full (unsharded) state dicts, ``StateDictOptions(full_state_dict=True)``, round-trip bitwise.

Every worker uses one model (the "tiny" Llama preset) and the same global batches, split across
ranks, so runs at different world sizes see the same data. Newton–Schulz runs in fp32 with the
standard method so that world sizes differ only by the order of the gradient reduction.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

import dmuon
from dmuon.layout import owned_by
from dmuon.tools.models import Llama, SyntheticTokens, get_config
from tests.harness import run_on_ranks
from tests.helpers import dcp_load, dcp_save, full_tensor, local

HPARAMS = dict(lr=0.02, weight_decay=0.1, momentum=0.9, ns_method="standard", ns_dtype=torch.float32)
GLOBAL_BATCH, SEQ_LEN = 12, 16
SAVED_AT = 2  # steps before the checkpoint
MORE = 2  # steps after it
# Cross-world continuation: only the order of the gradient reduction differs.
RTOL, ATOL = 1e-4, 1e-6


# ------------------------------------------------------------------ helpers run inside the workers

def build(layout: str, **overrides) -> tuple[nn.Module, dmuon.Muon]:
    """The tiny Llama (seed 0) in ``layout`` ("fsdp", "ddp", "owner", "owner+fsdp" or "plain")
    and its dmuon.Muon."""
    model = Llama(get_config("tiny"), seed=0)
    if layout.startswith("owner"):
        with_fsdp = layout == "owner+fsdp"
        sharding = dmuon.shard_by_owner(model, layers=model.layers, replicate_rest=not with_fsdp)
        if with_fsdp:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, ignored_params=set(sharding.params))
            fully_shard(model, mesh=mesh, ignored_params=set(sharding.params))
    elif layout == "fsdp":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        assert layout == "plain", layout
    return model, dmuon.Muon(model, **{**HPARAMS, **overrides})


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    """Steps ``steps`` of the global batch sequence, this rank's share of each batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    data = SyntheticTokens(get_config("tiny").vocab_size, seed=0)
    for step in steps:
        inputs, targets = data.local_batch(step, GLOBAL_BATCH, SEQ_LEN, rank, world)
        optim.zero_grad(set_to_none=True)
        # model(...) rather than model.loss(...): DDP only syncs gradients through its forward.
        logits = model(inputs)
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        optim.step()


def fqn(name: str) -> str:
    return name.removeprefix("module.")  # DDP's wrapper prefix


def from_owner(p: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    """``t`` (``p`` or a state tensor of ``p``) as its owner holds it, on every rank (collective)."""
    owner = owned_by(p).owner
    out = t.detach().clone() if dist.get_rank() == owner else torch.empty(p.shape, dtype=p.dtype)
    dist.broadcast(out, src=owner)
    return out


def snapshot(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Full params and full optimizer state, by parameter name, in a rank-independent order."""
    params, state = {}, {}
    for name, p in model.named_parameters():
        if owned_by(p) is None:
            params[fqn(name)] = full_tensor(p)
            for key in sorted(optim.state.get(p, {})):
                state[f"{fqn(name)}.{key}"] = full_tensor(optim.state[p][key])
            continue
        params[fqn(name)] = from_owner(p, p)
        keys = [sorted(optim.state.get(p, {}))]  # only the owner has state for p
        dist.broadcast_object_list(keys, src=owned_by(p).owner)
        for key in keys[0]:
            state[f"{fqn(name)}.{key}"] = from_owner(p, optim.state[p][key] if key in optim.state.get(p, {}) else None)
    return dict(params=params, state=state)


def describe(t: torch.Tensor) -> tuple:
    """What must not change about a state tensor (row 18)."""
    if isinstance(t, DTensor):
        return ("DTensor", tuple(t.placements), tuple(t.device_mesh.mesh.tolist()), t.dtype,
                tuple(t.shape), tuple(t.to_local().shape), t.device.type)
    return ("Tensor", None, None, t.dtype, tuple(t.shape), tuple(t.shape), t.device.type)


def state_layout(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    out = {}
    for name, p in model.named_parameters():
        for key, value in optim.state.get(p, {}).items():
            out[f"{fqn(name)}.{key}"] = describe(value)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of a float tensor: equal views mean bitwise-equal tensors (-0.0, NaN)."""
    ints = {torch.float32: torch.int32, torch.float64: torch.int64,
            torch.bfloat16: torch.int16, torch.float16: torch.int16}
    t = local(t).contiguous()
    return t.view(ints[t.dtype]) if t.dtype in ints else t


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors, or of this rank's pieces of two DTensors."""
    a, b = local(a), local(b)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


# ------------------------------------------------------------------ worker functions

def resume_same_world(layout: str, path: str) -> dict:
    """Uninterrupted run vs a fresh model + optimizer resumed from the step-2 checkpoint."""
    model, optim = build(layout)
    train(model, optim, range(SAVED_AT))
    dcp_save(model, optim, path)
    saved, saved_layout = snapshot(model, optim), state_layout(model, optim)
    train(model, optim, range(SAVED_AT, SAVED_AT + MORE))
    uninterrupted, uninterrupted_layout = snapshot(model, optim), state_layout(model, optim)

    model2, optim2 = build(layout)
    dcp_load(model2, optim2, path)
    loaded, loaded_layout = snapshot(model2, optim2), state_layout(model2, optim2)
    train(model2, optim2, range(SAVED_AT, SAVED_AT + MORE))
    resumed, resumed_layout = snapshot(model2, optim2), state_layout(model2, optim2)
    return dict(
        saved=saved, uninterrupted=uninterrupted, loaded=loaded, resumed=resumed,
        layouts=dict(saved=saved_layout, uninterrupted=uninterrupted_layout, loaded=loaded_layout,
                     resumed=resumed_layout),
    )


def save_at_world(path: str, layout: str = "fsdp") -> dict:
    """The reference run: save after SAVED_AT steps, then continue MORE steps."""
    model, optim = build(layout)
    train(model, optim, range(SAVED_AT))
    dcp_save(model, optim, path)
    saved, saved_layout = snapshot(model, optim), state_layout(model, optim)
    train(model, optim, range(SAVED_AT, SAVED_AT + MORE))
    return dict(saved=saved, continued=snapshot(model, optim), layout=saved_layout)


def resume_at_world(layout: str, path: str) -> dict:
    model, optim = build(layout)
    dcp_load(model, optim, path)
    loaded, loaded_layout = snapshot(model, optim), state_layout(model, optim)
    train(model, optim, range(SAVED_AT, SAVED_AT + MORE))
    return dict(loaded=loaded, continued=snapshot(model, optim), loaded_layout=loaded_layout,
                continued_layout=state_layout(model, optim))


def state_dict_before_first_step() -> dict:
    """Row 9 at the calling world size."""
    model, optim = build("fsdp")
    before = {name: local(p).clone() for name, p in model.named_parameters()}
    osd = get_optimizer_state_dict(model, optim)  # runs the zero-grad, lr=0 step
    unchanged = {name: bitwise_equal(before[name], p) for name, p in model.named_parameters()}

    keys = {fqn: sorted(s) for fqn, s in osd["state"].items()}
    group_keys = [sorted(k for k in g if k != "params") for g in osd["param_groups"]]
    group_params = [list(g["params"]) for g in osd["param_groups"]]
    # A state tensor that is not a scalar differs per rank (it has the parameter's shape): it
    # must be a DTensor laid out like the parameter, or DCP would silently save rank 0's copy.
    # The scalars (the AdamW step count) must agree on every rank.
    params = {fqn(n): p for n, p in model.named_parameters()}
    not_dtensor, replicated = [], {}
    for name, s in osd["state"].items():
        for key, value in s.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                p = params[name]
                if not (isinstance(value, DTensor) and value.shape == p.shape
                        and value.placements == p.placements and value.device_mesh == p.device_mesh):
                    not_dtensor.append(f"{name}.{key}")
            else:
                replicated[f"{name}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else value
    all_zero = all(torch.count_nonzero(local(v)).item() == 0
                   for s in osd["state"].values() for k, v in s.items() if k != "step")

    # DCP's set_optimizer_state_dict calls load_state_dict(state_dict=...) by keyword; so do we.
    set_optimizer_state_dict(model, optim, osd)
    optim.load_state_dict(state_dict=optim.state_dict())
    unchanged_after_load = all(bitwise_equal(before[n], p) for n, p in model.named_parameters())

    # The zero step leaves no trace on the Muon matrices: one real step from here equals one
    # real step of an optimizer that never saw get_optimizer_state_dict. (AdamW parameters do
    # differ: their step count is 1 after DCP's initial step, which is torch's behaviour.)
    train(model, optim, range(1))
    ref_model, ref_optim = build("fsdp")
    train(ref_model, ref_optim, range(1))
    muon = {id(p) for g in optim.param_groups for p, alg in zip(g["params"], g["algorithms"]) if alg == "muon"}
    muon_same = {
        fqn(n): bitwise_equal(p, rp)
        for (n, p), rp in zip(model.named_parameters(), ref_model.parameters()) if id(p) in muon
    }
    return dict(unchanged=unchanged, keys=keys, group_keys=group_keys, group_params=group_params,
                not_dtensor=not_dtensor, replicated=replicated, all_zero=all_zero,
                unchanged_after_load=unchanged_after_load, muon_same=muon_same)


def full_state_dict_round_trip(ns_dtype) -> dict:
    """Full (unsharded) state dicts, the form used to export or to hand to a non-DCP loader."""
    full_options = StateDictOptions(full_state_dict=True)
    model, optim = build("fsdp", ns_dtype=ns_dtype)
    train(model, optim, range(SAVED_AT))
    model_sd, optim_sd = get_state_dict(model, optim, options=full_options)
    plain = all(type(v) is torch.Tensor for s in optim_sd["state"].values() for v in s.values())
    saved = snapshot(model, optim)
    # Through a file, as an exported checkpoint would go: get_state_dict hands out the
    # optimizer's own plain tensors (the AdamW step counts) and load_state_dict keeps "step"
    # tensors by reference, so without the copy both optimizers would share their step counts.
    buffer = io.BytesIO()
    torch.save({"model": model_sd, "optim": optim_sd}, buffer)
    buffer.seek(0)
    from_file = torch.load(buffer, weights_only=True)
    model2, optim2 = build("fsdp", ns_dtype=ns_dtype)
    set_state_dict(model2, optim2, model_state_dict=from_file["model"], optim_state_dict=from_file["optim"],
                   options=full_options)
    loaded = snapshot(model2, optim2)
    train(model, optim, range(SAVED_AT, SAVED_AT + 1))
    train(model2, optim2, range(SAVED_AT, SAVED_AT + 1))
    return dict(plain=plain, saved=saved, loaded=loaded, continued=snapshot(model, optim),
                resumed=snapshot(model2, optim2))


# ------------------------------------------------------------------ assertions in the pytest process

def assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), (what, sorted(set(a) ^ set(b)))
    bad = [k for k in a if not bitwise_equal(a[k], b[k])]
    assert not bad, f"{what}: not bitwise equal: {bad}"


def max_relative_excess(a: dict, b: dict) -> tuple[float, float]:
    """(max |a-b|, max |a-b| / (atol + rtol·|b|)) over all tensors: the second must be <= 1."""
    diff = ratio = 0.0
    for k in a:
        d = (a[k].double() - b[k].double()).abs()
        diff = max(diff, d.max().item())
        ratio = max(ratio, (d / (ATOL + RTOL * b[k].double().abs())).max().item())
    return diff, ratio


def assert_placed_like_params(layout_of_state: dict, layout: str, world: int) -> None:
    """Per-parameter state is sharded like FSDP2's parameters (Shard(0) over all ranks), or a
    plain tensor without FSDP2 and for owner-sharded matrices (whole, on their owner); the AdamW
    step count is a plain fp32 scalar."""
    for name, d in layout_of_state.items():
        if name.endswith(".step"):
            assert d[0] == "Tensor" and d[3] == torch.float32 and d[4] == (), (name, d)
        elif layout == "fsdp" or (layout == "owner+fsdp" and not name.endswith("momentum_buffer")):
            assert d[0] == "DTensor" and d[1] == (Shard(0),) and d[2] == tuple(range(world)), (name, d)
        else:
            assert d[0] == "Tensor", (name, d)


def assert_same_on_all_ranks(results: list[dict], key: str) -> None:
    for rank, r in enumerate(results[1:], start=1):
        for part in ("params", "state"):
            assert_bitwise(results[0][key][part], r[key][part], f"{key} {part} rank 0 vs {rank}")


@pytest.mark.parametrize("layout", ["fsdp", "ddp", "owner", "owner+fsdp"])
def test_resume_at_same_world_size_is_bitwise(layout, tmp_path):
    """Row 7 (and row 18 across save/load/steps), FSDP2, DDP and owner-sharded at 2 ranks."""
    results = run_on_ranks(2, resume_same_world, layout, str(tmp_path / "ckpt"))
    # under DDP the snapshots are each rank's own replicated copies: they must agree
    for key in ("saved", "uninterrupted", "loaded", "resumed"):
        assert_same_on_all_ranks(results, key)
    r = results[0]
    # the state is complete: momentum for every Muon matrix, AdamW moments for the rest
    assert r["saved"]["state"] and len(r["saved"]["state"]) == len(r["loaded"]["state"])
    for part in ("params", "state"):
        assert_bitwise(r["saved"][part], r["loaded"][part], f"loaded {part}")
        assert_bitwise(r["uninterrupted"][part], r["resumed"][part], f"resumed {part}")
    # the resumed run really moved: the comparison is not of two frozen copies
    assert any(not torch.equal(r["saved"]["params"][k], r["resumed"]["params"][k]) for k in r["saved"]["params"])
    layouts = r["layouts"]
    assert layouts["saved"] == layouts["uninterrupted"] == layouts["loaded"] == layouts["resumed"]
    assert_placed_like_params(layouts["saved"], layout, 2)


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("dcp") / "world4")
    results = run_on_ranks(4, save_at_world, path)
    assert_same_on_all_ranks(results, "continued")
    return path, results[0]


@pytest.fixture(scope="module")
def owner_saved_at_4(tmp_path_factory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("dcp") / "owner4")
    results = run_on_ranks(4, save_at_world, path, "owner")
    assert_same_on_all_ranks(results, "continued")
    return path, results[0]


@pytest.mark.parametrize("world,layout", [(2, "fsdp"), (3, "fsdp"), (1, "plain"), (3, "owner"), (2, "owner+fsdp")])
def test_resume_at_another_world_size(saved_at_4, world, layout):
    """Row 8: saved at 4 ranks (FSDP2), loaded at 2, 3 (FSDP2, owner-sharded) and 1 (plain module)."""
    check_resume(saved_at_4, world, layout)


@pytest.mark.parametrize("world,layout", [(2, "owner"), (3, "owner+fsdp"), (1, "plain"), (2, "fsdp")])
def test_owner_sharded_checkpoint_resumes_anywhere(owner_saved_at_4, world, layout):
    """Saved owner-sharded at 4 ranks (each matrix once, by its owner), loaded owner-sharded at
    2 and 3 ranks, into one plain process and into FSDP2."""
    check_resume(owner_saved_at_4, world, layout)


@pytest.fixture(scope="module")
def plain_saved_at_1(tmp_path_factory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("dcp") / "plain1")
    return path, run_on_ranks(1, save_at_world, path, "plain")[0]


def test_single_process_checkpoint_resumes_owner_sharded(plain_saved_at_1):
    """And back: a checkpoint of single-process training continues owner-sharded at 3 ranks."""
    check_resume(plain_saved_at_1, 3, "owner")


def check_resume(saved: tuple[str, dict], world: int, layout: str) -> None:
    path, ref = saved
    results = run_on_ranks(world, resume_at_world, layout, path)
    if world > 1:
        assert_same_on_all_ranks(results, "continued")
    r = results[0]
    # the loaded state is exactly what was saved (momentum, exp_avg, exp_avg_sq, step) ...
    assert_bitwise(ref["saved"]["params"], r["loaded"]["params"], "loaded params")
    assert_bitwise(ref["saved"]["state"], r["loaded"]["state"], "loaded state")
    assert any(k.endswith("momentum_buffer") for k in r["loaded"]["state"])
    assert any(k.endswith("exp_avg") for k in r["loaded"]["state"])
    # ... and the next steps agree with the 4-rank continuation up to the reduction order.
    for part in ("params", "state"):
        diff, ratio = max_relative_excess(r["continued"][part], ref["continued"][part])
        print(f"world {world} ({layout}) vs world 4 after {MORE} steps: {part} max |diff| {diff:.3g}, "
              f"max diff / (atol + rtol*|ref|) {ratio:.3g}")
        assert ratio <= 1.0, (part, diff, ratio)
    # row 18: the state keeps the layout it was loaded with
    assert r["loaded_layout"] == r["continued_layout"]
    assert_placed_like_params(r["loaded_layout"], layout, world)
    # same dtype, global shape and device as at 4 ranks (of owner-sharded matrices, rank 0
    # holds the state of those it owns only; the snapshots above cover all of it)
    def kept(d: tuple) -> tuple:
        return d[3], d[4], d[6]

    shared = r["loaded_layout"].keys() & ref["layout"].keys()
    assert shared and all(kept(r["loaded_layout"][k]) == kept(ref["layout"][k]) for k in shared)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_optimizer_state_dict_before_first_step(world):
    """Row 9 (at 3 ranks the shards are uneven: 32 rows -> 11, 11, 10)."""
    results = run_on_ranks(world, state_dict_before_first_step)
    for rank, r in enumerate(results):
        assert all(r["unchanged"].values()), (rank, [n for n, ok in r["unchanged"].items() if not ok])
        assert r["unchanged_after_load"], rank
        assert not r["not_dtensor"], (rank, r["not_dtensor"])
        assert r["all_zero"], rank
        assert all(r["muon_same"].values()) and r["muon_same"], (rank, r["muon_same"])
        # the same state entries, param groups and replicated values on every rank
        assert r["keys"] == results[0]["keys"], rank
        assert r["group_keys"] == results[0]["group_keys"], rank
        assert r["group_params"] == results[0]["group_params"], rank
        assert r["replicated"].keys() == results[0]["replicated"].keys(), rank
        for key, value in r["replicated"].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(results[0]["replicated"][key])), (rank, key)
    keys = results[0]["keys"]
    assert keys, "no optimizer state was created"
    assert {tuple(v) for v in keys.values()} == {("momentum_buffer",), ("exp_avg", "exp_avg_sq", "step")}


@pytest.mark.parametrize("ns_dtype", [None, torch.float32])
def test_full_state_dict_round_trip(ns_dtype):
    """get_state_dict / set_state_dict with full_state_dict=True at 3 ranks: plain full tensors
    on every rank, loaded bitwise, and the next step matches."""
    results = run_on_ranks(3, full_state_dict_round_trip, ns_dtype)
    for rank, r in enumerate(results):
        assert r["plain"], rank
        for part in ("params", "state"):
            assert_bitwise(r["saved"][part], r["loaded"][part], f"rank {rank} loaded {part}")
            assert_bitwise(r["continued"][part], r["resumed"][part], f"rank {rank} resumed {part}")
