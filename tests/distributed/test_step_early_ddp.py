"""Early start under DDP (dmuon.step.early, ``Muon.register_ddp_comm_hook``): dmuon's comm hook
reduces as DDP does and starts each bucket once its all-reduce is done; the same bits as plain
DDP at 1–4 ranks, gradient accumulation under ``no_sync``, gradients changed before ``step()``,
misuse raising on every rank, and without the hook the step as without early start."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

import dmuon
from tests.harness import run_on_ranks
from tests.helpers import SMALL_BUCKET_BYTES, assert_same_run, change_gradients, tiny_mlp, train_llama


def test_ddp_without_dmuons_comm_hook_falls_back_and_says_why():
    for r in run_on_ranks(2, train_llama, "ddp"):
        assert r["early_start"].startswith("off: ") and "DDP" in r["early_start"]
        assert "register_ddp_comm_hook" in r["early_start"]
        assert r["early_buckets"] == (0, 0)


DDP_BUCKETS = dict(bucket_cap_mb=0.01)  # the tiny model in several DDP buckets


@pytest.mark.parametrize("world,dtype,view", [
    (1, torch.float32, False), (2, torch.float32, False), (2, torch.float32, True), (3, torch.float32, False),
    (3, torch.bfloat16, False), (3, torch.bfloat16, True), (4, torch.float32, True),
])
def test_ddp_with_dmuons_comm_hook_gives_the_same_bits(world, dtype, view):
    """With the comm hook, a bucket's Newton–Schulz begins once DDP's all-reduce of it is done;
    the same bits as early start off (the hook registered) and as DDP's own reduction (no hook),
    with DDP copying the reduced gradients into param.grad and with the gradients views of its
    buckets (gradient_as_bucket_view)."""
    ddp = dict(DDP_BUCKETS, gradient_as_bucket_view=view)
    on, off, plain = (run_on_ranks(world, train_llama, "ddp", None, dtype, False, early, SMALL_BUCKET_BYTES, None,
                                   hook, ddp)
                      for early, hook in ((True, True), (False, True), (False, False)))
    for rank in range(world):
        assert on[rank]["early_start"] == "on" and off[rank]["early_start"].startswith("off")
        begun, buckets = on[rank]["early_buckets"]
        assert buckets > 1 and begun >= 1  # DDP's last bucket is final at step(), after the backward pass
        assert_same_run(on[rank], off[rank])
        assert_same_run(on[rank], plain[rank])
        assert_same_run(on[rank], on[0])


@pytest.mark.parametrize("option", ["find_unused_parameters", "static_graph"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ddp_options_with_dmuons_comm_hook_give_the_same_bits(option, dtype):
    """DDP's find_unused_parameters and static_graph change when and how it marks gradients
    ready; with the comm hook, early start still gives plain DDP's bits."""
    ddp = dict(DDP_BUCKETS, **{option: True})
    on, plain = (run_on_ranks(2, train_llama, "ddp", None, dtype, False, early, SMALL_BUCKET_BYTES, None,
                              hook, ddp)
                 for early, hook in ((True, True), (False, False)))
    for rank in range(2):
        assert on[rank]["early_start"] == "on" and on[rank]["early_buckets"][0] >= 1
        assert_same_run(on[rank], plain[rank])


def _ddp_mlp(early_start: bool, view: bool = False, change: str | None = None, micro_batches: int = 1,
             poison_at: int | None = None, closure: bool = False, dtype: torch.dtype = torch.float32) -> dict:
    """Three steps of the 4-layer MLP in ``dtype`` under DDP with dmuon's comm hook, each over
    ``micro_batches`` (all but the last under no_sync); ``GRADIENT_CHANGES[change]`` runs between
    backward() and step(); at step ``poison_at`` the last rank's batch holds an infinity;
    ``closure``: the micro-batches run in step()'s closure."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny_mlp(dtype=dtype), bucket_cap_mb=0.005, gradient_as_bucket_view=view)
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * dtype.itemsize, early_start=early_start)
    opt.register_ddp_comm_hook(model)
    torch.manual_seed(1 + dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            batches = [torch.randn(8, 32, dtype=dtype) for _ in range(micro_batches)]
            if step == poison_at and dist.get_rank() == dist.get_world_size() - 1:
                batches[0][0, 0] = float("inf")

            def backward() -> None:
                opt.zero_grad()
                for micro, x in enumerate(batches):
                    with model.no_sync() if micro + 1 < micro_batches else contextlib.nullcontext():
                        model(x).square().mean().backward()

            if closure:
                opt.step(backward)
                continue
            backward()
            change_gradients(model, change)
            opt.step()
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()}, status=opt.early_start,
                early_buckets=opt.last_step_stats.early_buckets, skipped=opt.skipped_steps,
                warnings=sum("early start turned off" in str(w.message) for w in caught))


@pytest.mark.parametrize("case,view,dtype", [
    *((case, view, torch.float32) for case in ("clip", "scale", "unscale") for view in (False, True)),
    ("clip", False, torch.bfloat16), ("unscale", True, torch.bfloat16),
])
def test_ddp_gradients_changed_after_backward_redo_the_work(case, view, dtype):
    """Clipping or scaling DDP's reduced gradients before step(): in param.grad, or in DDP's
    bucket itself (gradient_as_bucket_view): the step redoes the work, and early start turns off."""
    ons, offs = (run_on_ranks(2, _ddp_mlp, early, view, case, 1, None, False, dtype) for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"].startswith("off: the gradients changed") and on["warnings"] == 1
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]), name


@pytest.mark.parametrize("closure", [False, True])
def test_ddp_accumulation_under_no_sync_starts_with_the_last_micro_batch(closure):
    """DDP reduces, and calls the comm hook, only in the last micro-batch's backward pass: early
    start begins there, and gives the same bits as without it; also with the backward passes in
    step()'s closure."""
    ons, offs = (run_on_ranks(2, _ddp_mlp, early, False, None, 3, None, closure) for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"] == "on" and on["warnings"] == 0 and on["early_buckets"][0] >= 1
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]), name


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_a_non_finite_gradient_on_one_rank_skips_the_step_on_every_rank(world):
    """One rank's infinite input at step 1: DDP's all-reduce spreads it, every rank skips that
    step with early start's work unused, and the next step's early run is fresh: the same bits
    as without early start."""
    ons, offs = (run_on_ranks(world, _ddp_mlp, early, False, None, 1, 1) for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"] == "on" and on["skipped"] == off["skipped"] == 1
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]) and torch.equal(value, ons[0]["params"][name]), name


def _register(case: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    # "other ranks": each rank's DDP model reduces over that rank alone, the optimizer over both
    alone, _ = dist.new_subgroups(1) if case == "other ranks" else (None, None)
    model = DistributedDataParallel(tiny_mlp(), process_group=alone)
    opt = dmuon.Muon(model.module if case == "other ranks" else model)
    if case == "none of its parameters":
        opt.register_ddp_comm_hook(DistributedDataParallel(tiny_mlp()))
    if case == "their hook":
        model.register_comm_hook(None, allreduce_hook)
    opt.register_ddp_comm_hook(model.module if case == "not DDP" else model)
    if case == "twice":
        opt.register_ddp_comm_hook(model)


@pytest.mark.parametrize("case,pattern", [
    ("not DDP", r"TypeError: register_ddp_comm_hook needs a DistributedDataParallel model, got Sequential"),
    ("twice", r"ValueError: register_ddp_comm_hook was called before"),
    ("their hook", r"RuntimeError: .*register_comm_hook .*once"),
    ("none of its parameters", r"ValueError: register_ddp_comm_hook: the DDP model \(Sequential\) holds none of "
                               r"this optimizer's Muon parameters \(such as 'module\.0\.weight'\)"),
])
def test_register_ddp_comm_hook_misuse_raises_on_every_rank(case, pattern):
    from tests.helpers import assert_same_error, error_of

    assert_same_error(run_on_ranks(2, error_of, _register, case), pattern)


def test_register_ddp_comm_hook_with_a_ddp_model_over_other_ranks_raises_on_every_rank():
    """Each rank's DDP model reduces over that rank alone: every rank fails the check, and says
    which ranks its own DDP model reduces over."""
    from tests.helpers import error_of

    for rank, error in enumerate(run_on_ranks(2, error_of, _register, "other ranks")):
        assert error == (f"ValueError: The DDP model reduces over ranks [{rank}], this optimizer works over ranks "
                         "[0, 1]: build the optimizer from the DDP model (dmuon.Muon(ddp_model)) or pass its "
                         "process_group.")


def _a_second_optimizer_for_the_same_ddp_model() -> dict:
    """An optimizer dropped after a step, then another one for the same DDP model: its
    register_ddp_comm_hook takes dmuon's hook over (DDP would refuse a second hook)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny_mlp(), bucket_cap_mb=0.005)
    first = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=True)
    first.register_ddp_comm_hook(model)
    model(torch.randn(8, 32)).square().mean().backward()
    first.step()
    del first
    gc.collect()
    reference = copy.deepcopy(model.module)
    second = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=True)
    second.register_ddp_comm_hook(model)
    alone = dmuon.Muon(reference, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=False)
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(8, 32)
        for m, o in ((model, second), (reference, alone)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    return dict(status=second.early_start, begun=second.last_step_stats.early_buckets[0],
                same=all(torch.equal(a, b) for a, b in zip(model.module.parameters(), reference.parameters())))


def test_a_later_optimizer_takes_dmuons_ddp_comm_hook_over():
    """The second optimizer's early start runs from the hook the first one registered, and its
    steps match an optimizer stepping the rank's own (all-reduced, so equal) gradients alone."""
    for result in run_on_ranks(2, _a_second_optimizer_for_the_same_ddp_model):
        assert result["status"] == "on" and result["begun"] >= 1 and result["same"]


def _ddp_with_early_start_and_no_hook() -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(tiny_mlp())
    opt = dmuon.Muon(model, early_start=True)  # the comm hook may still come
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(8, 32)).sum().backward()
    try:
        opt.step()
    finally:
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # nothing moved


def test_early_start_true_under_ddp_without_the_hook_raises_on_every_rank_at_the_first_step():
    from tests.helpers import assert_same_error, error_of

    assert_same_error(run_on_ranks(2, error_of, _ddp_with_early_start_and_no_hook),
                      r"ValueError: Invalid early_start=True: .*replicated \(DDP\).*register_ddp_comm_hook")


def _plans_under_ddp_as_on_cuda() -> dict:
    """The buckets of the plan a step runs under DDP where early_start=None turns early start on
    (CUDA, stood in for by patching ``wanted``): before and after register_ddp_comm_hook, and those
    of the cost order (early_start=False) and of early start's order (early_start=True)."""
    from unittest import mock

    from torch.nn.parallel import DistributedDataParallel

    def on_cuda(setting, device_type):
        return setting if setting is not None else True

    torch.manual_seed(0)
    sizes = [(48, 16), (16, 64), (64, 64), (32, 16), (16, 96), (96, 32)]
    model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(n, m, bias=False) for n, m in sizes]))
    buckets, status = {}, {}
    with mock.patch("dmuon.step.plan.wanted", on_cuda), mock.patch("dmuon.step.early.eligibility.wanted", on_cuda), \
            mock.patch("dmuon.step.early.start.wanted", on_cuda):
        for name, setting in (("cost", False), ("early", True), ("default", None)):
            opt = dmuon.Muon(model, lr=0.02, bucket_bytes=64 * 64 * 4, early_start=setting)
            if name == "default":
                _, status["before"] = opt.plan, opt.early_start
                buckets["before"] = opt.plan.buckets
                opt.register_ddp_comm_hook(model)
            buckets[name] = opt.plan.buckets
    return dict(buckets=buckets, status=status)


def test_where_early_start_cannot_run_the_step_plans_in_the_cost_order():
    """early_start=None where it would run (CUDA) under DDP without dmuon's comm hook: the step's
    plan is the cost order's, not early start's (which keeps every matrix whole and follows the
    backward pass); once the hook is registered, early start's."""
    for result in run_on_ranks(2, _plans_under_ddp_as_on_cuda):
        buckets = result["buckets"]
        assert buckets["cost"] != buckets["early"]  # the two orders differ for this model
        assert buckets["before"] == buckets["cost"] and buckets["default"] == buckets["early"]


def _registered_on_rank_0_only() -> dict:
    """register_ddp_comm_hook on rank 0 only: it is local (DDP's reduction on both ranks issues
    one all-reduce per bucket), and the next step refuses on every rank before anything moves."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tests.helpers import error_of

    model = DistributedDataParallel(tiny_mlp(), bucket_cap_mb=0.005)
    opt = dmuon.Muon(model, lr=0.02, early_start=True)
    if dist.get_rank() == 0:
        opt.register_ddp_comm_hook(model)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(8, 32)).square().mean().backward()
    return dict(error=error_of(opt.step), unchanged=all(torch.equal(a, p) for a, p in zip(before, model.parameters())))


def test_register_ddp_comm_hook_on_one_rank_only_is_refused_at_the_next_step_on_every_rank():
    from tests.helpers import assert_same_error

    results = run_on_ranks(2, _registered_on_rank_0_only)
    assert_same_error([r["error"] for r in results], r"ValueError: Ranks disagree on the optimizer configuration: "
                      r"register_ddp_comm_hook called is True on rank 0 but False on rank 1\.")
    assert all(r["unchanged"] for r in results)
