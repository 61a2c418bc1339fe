"""Early start (dmuon.early_start): Newton–Schulz begun in the backward pass gives the same bits as
the step without it, in every layout that supports it, at 1–4 ranks; where a layout does not
support it, or the gradients change after the backward pass, the step runs as without it."""

from __future__ import annotations

import contextlib
import copy
import re
import warnings

import pytest
import torch

import dmuon
from tests.harness import run_on_ranks
from tests.helpers import single_process, train_llama, whole_params

BUCKET = 4 * 1024  # bytes of Newton–Schulz input per owner: the tiny model in several buckets


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), name


@pytest.mark.parametrize("parallel,world,dtype", [
    (None, 1, torch.float32), (None, 1, torch.bfloat16),
    ("fsdp", 1, torch.float32), ("fsdp", 2, torch.float32), ("fsdp", 3, torch.float32),
    ("fsdp", 3, torch.bfloat16), ("hsdp", 4, torch.float32),
    ("owner", 1, torch.float32), ("owner", 2, torch.float32), ("owner", 3, torch.bfloat16),
])
def test_early_start_gives_the_same_bits_as_the_step_at_step(parallel, world, dtype):
    """On: every bucket begins in the backward pass (small buckets, so that there are several).
    Off (early_start=False): the buckets in the LPT order, all run at step()."""
    on_args, off_args = (parallel, None, dtype, False, True, BUCKET), (parallel, None, dtype, False, False, BUCKET)
    if parallel is None:
        ons, offs = [single_process(train_llama, *on_args)], [single_process(train_llama, *off_args)]
    else:
        ons, offs = run_on_ranks(world, train_llama, *on_args), run_on_ranks(world, train_llama, *off_args)
    for on, off in zip(ons, offs):
        assert on["early_start"].startswith("on") and off["early_start"].startswith("off")
        begun, buckets = on["early_buckets"]
        assert buckets > 1 and begun == buckets  # the last bucket's NS waits for step(); all began
        assert off["early_buckets"] == (0, 0)
        _same(on, off)
    for other in ons[1:]:  # every rank's view of every parameter, bitwise the same
        _same(other, ons[0])


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
    on, off, plain = (run_on_ranks(world, train_llama, "ddp", None, dtype, False, early, BUCKET, None, hook, ddp)
                      for early, hook in ((True, True), (False, True), (False, False)))
    for rank in range(world):
        assert on[rank]["early_start"] == "on" and off[rank]["early_start"].startswith("off")
        begun, buckets = on[rank]["early_buckets"]
        assert buckets > 1 and begun >= 1  # DDP's last bucket is final at step(), after the backward pass
        _same(on[rank], off[rank])
        _same(on[rank], plain[rank])
        _same(on[rank], on[0])


@pytest.mark.parametrize("option", ["find_unused_parameters", "static_graph"])
def test_ddp_options_with_dmuons_comm_hook_give_the_same_bits(option):
    """DDP's find_unused_parameters and static_graph change when and how it marks gradients
    ready; with the comm hook, early start still gives plain DDP's bits."""
    ddp = dict(DDP_BUCKETS, **{option: True})
    on, plain = (run_on_ranks(2, train_llama, "ddp", None, torch.float32, False, early, BUCKET, None, hook, ddp)
                 for early, hook in ((True, True), (False, False)))
    for rank in range(2):
        assert on[rank]["early_start"] == "on" and on[rank]["early_buckets"][0] >= 1
        _same(on[rank], plain[rank])


_CHANGES = {"clip": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3),
            "scale": lambda m: [p.grad.mul_(0.5) for p in m.parameters()]}


def _ddp_mlp(early_start: bool, view: bool = False, change: str | None = None, micro_batches: int = 1,
             poison_at: int | None = None, closure: bool = False) -> dict:
    """Three steps of the 4-layer MLP under DDP with dmuon's comm hook, each over ``micro_batches``
    (all but the last under no_sync); ``_CHANGES[change]`` runs between backward() and step();
    at step ``poison_at`` the last rank's batch holds an infinity; ``closure``: the micro-batches
    run in step()'s closure."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_tiny(), bucket_cap_mb=0.005, gradient_as_bucket_view=view)
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    opt.register_ddp_comm_hook(model)
    torch.manual_seed(1 + dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            batches = [torch.randn(8, 32) for _ in range(micro_batches)]
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
            if change is not None:
                _CHANGES[change](model)
            opt.step()
    return dict(params={n: p.detach().clone() for n, p in model.named_parameters()}, status=opt.early_start,
                early_buckets=opt.last_step_stats.early_buckets, skipped=opt.skipped_steps,
                warnings=sum("early start turned off" in str(w.message) for w in caught))


@pytest.mark.parametrize("case", ["clip", "scale"])
@pytest.mark.parametrize("view", [False, True])
def test_ddp_gradients_changed_after_backward_redo_the_work(case, view):
    """Clipping or scaling DDP's reduced gradients before step(): in param.grad, or in DDP's
    bucket itself (gradient_as_bucket_view): the step redoes the work, and early start turns off."""
    ons, offs = run_on_ranks(2, _ddp_mlp, True, view, case), run_on_ranks(2, _ddp_mlp, False, view, case)
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


def _owner_mlp(early_start: bool, accumulate: str | None = None, layers: int = 4) -> dict:
    """Three steps of the MLP owner-sharded (each Linear a layer), each over two micro-batches
    where ``accumulate`` says how: "no_sync" (the first inside the sharding's no_sync) or "twice"
    (two plain backward passes, both reduced)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model = _tiny(layers=layers)
    sharding = dmuon.shard_by_owner(model, init_device_mesh("cpu", (dist.get_world_size(),)), layers=list(model))
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    torch.manual_seed(1 + dist.get_rank())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt.zero_grad()
            for micro in range(1 if accumulate is None else 2):
                first = micro == 0 and accumulate == "no_sync"
                with sharding.no_sync() if first else contextlib.nullcontext():
                    model(torch.randn(8, 32)).square().mean().backward()
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


def _expert_stacks(early_start: bool) -> dict:
    """Three steps of linear layers and expert stacks, each module fully_shard-ed: the stacks
    (sharded on the expert dim) are orthogonalized where they live, in a plan of their own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), _Experts(), torch.nn.Linear(32, 32), _Experts(),
                                torch.nn.Linear(32, 32))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for module in model:
        fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    torch.manual_seed(1 + dist.get_rank())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 32)).square().mean().backward()
        opt.step()
    return dict(params=whole_params(model), status=opt.early_start, early_buckets=opt.last_step_stats.early_buckets,
                strategies=len(opt._plan.strategies))


@pytest.mark.parametrize("world", [2, 3])
def test_expert_stacks_and_matrices_under_fsdp2_give_the_same_bits(world):
    """Two exchange groups (the expert stacks, the matrices): their staged runs one after the
    other, every bucket begun in the backward pass, the same bits as without early start."""
    ons, offs = (run_on_ranks(world, _expert_stacks, early) for early in (True, False))
    for on, off in zip(ons, offs):
        begun, buckets = on["early_buckets"]
        assert on["status"] == "on" and on["strategies"] == 2 and begun == buckets > 1
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]), name


def _register(case: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_tiny())
    opt = dmuon.Muon(model)
    if case == "their hook":
        model.register_comm_hook(None, allreduce_hook)
    opt.register_ddp_comm_hook(model.module if case == "not DDP" else model)
    if case == "twice":
        opt.register_ddp_comm_hook(model)


@pytest.mark.parametrize("case,pattern", [
    ("not DDP", r"TypeError: register_ddp_comm_hook needs a DistributedDataParallel model, got Sequential"),
    ("twice", r"ValueError: register_ddp_comm_hook was called before"),
    ("their hook", r"RuntimeError: .*register_comm_hook .*once"),
])
def test_register_ddp_comm_hook_misuse_raises_on_every_rank(case, pattern):
    from tests.helpers import assert_same_error, error_of

    assert_same_error(run_on_ranks(2, error_of, _register, case), pattern)


def _a_second_optimizer_for_the_same_ddp_model() -> dict:
    """An optimizer dropped after a step, then another one for the same DDP model: its
    register_ddp_comm_hook takes dmuon's hook over (DDP would refuse a second hook)."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_tiny(), bucket_cap_mb=0.005)
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


def test_the_default_is_off_on_cpu_and_says_why():
    model, opt = _train(None, steps=2)
    assert opt.early_start.startswith("off: on CPU it does not pay")
    assert opt.last_step_stats.early_buckets == (0, 0)


def _tiny(seed: int = 0, layers: int = 4) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(layers)])


def _train(early_start, steps=3, between=None, accumulate=False, skip_at=None, accumulating=False):
    """A few steps of a 4-layer MLP; ``between(model)`` runs between backward() and step();
    ``accumulate``: a second micro-batch, the first one's backward inside ``opt.accumulating()``
    with ``accumulating``."""
    model = _tiny()
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    torch.manual_seed(1)
    for step in range(steps):
        x = torch.randn(8, 32)
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


def _compiled_model(early_start: bool, ddp: bool) -> dict:
    """Three steps of the MLP run through torch.compile (under DDP with dmuon's comm hook)."""
    from torch.nn.parallel import DistributedDataParallel

    model = _tiny()
    wrapped = DistributedDataParallel(model) if ddp else model
    opt = dmuon.Muon(model, lr=0.02, bucket_bytes=32 * 32 * 4, early_start=early_start)
    if ddp:
        opt.register_ddp_comm_hook(wrapped)
    run = torch.compile(wrapped)
    torch.manual_seed(1)
    for _ in range(3):
        opt.zero_grad()
        run(torch.randn(8, 32)).square().mean().backward()
        opt.step()
    return dict(params=[p.detach().clone() for p in model.parameters()], status=opt.early_start,
                early_buckets=opt.last_step_stats.early_buckets)


@pytest.mark.parametrize("ddp", [False, True])
def test_a_model_compiled_with_torch_compile_gives_the_same_bits(ddp):
    """torch.compile(model): its backward still accumulates into param.grad (the hooks fire) and
    DDP still calls the comm hook; the same bits as without early start. (DDP's default buckets
    hold this model in one, which is final only at step().)"""
    if ddp:
        ons, offs = (run_on_ranks(2, _compiled_model, early, True) for early in (True, False))
    else:
        ons, offs = ([single_process(_compiled_model, early, False)] for early in (True, False))
    for on, off in zip(ons, offs):
        assert on["status"] == "on" and (on["early_buckets"][0] >= 1 or ddp)
        assert all(torch.equal(a, b) for a, b in zip(on["params"], off["params"]))


@pytest.mark.parametrize("case", ["clip", "accumulate", "scale"])
def test_gradients_changed_after_backward_redo_the_work_and_turn_early_start_off(case):
    between = _CHANGES.get(case)
    reference, _ = _train(False, between=between, accumulate=case == "accumulate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = _train(True, between=between, accumulate=case == "accumulate")
    assert opt.early_start.startswith("off: the gradients changed")
    assert sum("early start turned off" in str(w.message) for w in caught) == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_accumulation_inside_accumulating_starts_with_the_last_micro_batch():
    """One process has no no_sync: opt.accumulating() keeps the first micro-batch's hooks from
    starting anything, so the last one's start the step's work: early start stays on, no
    warning, the same bits as without it."""
    reference, _ = _train(False, accumulate=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = _train(True, accumulate=True, accumulating=True)
    assert opt.early_start == "on" and not [w for w in caught if "early start" in str(w.message)]
    begun, buckets = opt.last_step_stats.early_buckets
    assert begun == buckets > 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_a_skipped_step_leaves_no_stale_update():
    """Non-finite gradients at step 1: nothing moves; the next step's early run is fresh."""
    reference, ref_opt = _train(False, skip_at=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
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
        dmuon.Muon(_tiny(), early_start=True, compile=True)


def _owner_across_replicas_with_early_start() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = _tiny()
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


def _ddp_with_early_start_and_no_hook() -> None:
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(_tiny())
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
    with mock.patch("dmuon.optimizer.wanted", on_cuda), mock.patch("dmuon.early_start.wanted", on_cuda):
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
