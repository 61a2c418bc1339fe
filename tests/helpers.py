"""Helpers shared by the tests, written once: tensors in a layout and back, the single-process
reference runs that distributed results are compared with, DCP save and load, and the error a
rank raised.

Functions here that run on ranks are called inside the workers of ``tests/harness.py``; the ones
that touch ``torch.distributed`` need its process group.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

import dmuon
from dmuon.layout import owned_by
from dmuon.tools.models import Llama, SyntheticTokens, get_config, tensor_parallel_blocks

# ---------------------------------------------------------------- tensors in a layout and back


def full_tensors(shapes, seed: int) -> list[torch.Tensor]:
    """Random full tensors of ``shapes``, the same on every rank for the same ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def placements_for(layout: str, world: int):
    """(mesh or None, placements) for a layout name: "ddp" (plain tensors), "fsdp" (``Shard(0)``
    on a 1-D mesh) or "hsdp" (``(Replicate(), Shard(0))``, 2 replicas when ``world`` is even)."""
    if layout == "ddp":
        return None, None
    if layout == "fsdp":
        return init_device_mesh("cpu", (world,)), [Shard(0)]
    replicas = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("replicate", "shard"))
    return mesh, [Replicate(), Shard(0)]


def as_layout(tensor: torch.Tensor, mesh, placements) -> torch.Tensor:
    """A copy of the full ``tensor``, distributed on ``mesh`` (a plain copy when ``mesh`` is None)."""
    return tensor.clone() if mesh is None else distribute_tensor(tensor.clone(), mesh, placements)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``t`` (the tensor itself, detached, when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t.detach()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole tensor (collective for a DTensor: every rank calls it in the same
    order; a replicated DTensor's would otherwise be its local tensor itself, which later steps change)."""
    return t.full_tensor().clone() if isinstance(t, DTensor) else t.detach().clone()


def rows_of(full: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """The rows of ``full`` that this rank's piece of ``sharded`` holds."""
    if not isinstance(sharded, DTensor):
        return full
    shard_dim = [i for i, p in enumerate(sharded.placements) if isinstance(p, Shard)]
    if not shard_dim:
        return full
    mesh_dim = shard_dim[0]
    size, index = sharded.device_mesh.size(mesh_dim), sharded.device_mesh.get_local_rank(mesh_dim)
    chunks = list(torch.chunk(full, size, dim=0))
    return chunks[index] if index < len(chunks) else full[:0]


# ---------------------------------------------------------------- single-process references


def params_and_reference(init: list[torch.Tensor], mesh=None, placements=None
                         ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Parameters from the full tensors ``init`` in a layout, and their single-process copies."""
    params = [nn.Parameter(as_layout(t, mesh, placements)) for t in init]
    ref_params = [nn.Parameter(t.clone()) for t in init]
    return params, ref_params


def step_with_reference(opt: torch.optim.Optimizer, ref: torch.optim.Optimizer, params, ref_params,
                        grads: list[torch.Tensor], mesh=None, placements=None) -> None:
    """One step of ``opt`` on ``params`` (in the layout of ``mesh``/``placements``) and of the
    single-process ``ref`` on ``ref_params``, both given the same full ``grads``."""
    for p, r, g in zip(params, ref_params, grads):
        p.grad = as_layout(g, mesh, placements)
        r.grad = g.clone()
    opt.step()
    ref.step()


def single_process(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in this process with one intra-op thread, as every rank runs: the
    single-process reference that the ranks' results are compared with."""
    torch.set_num_threads(1)
    return fn(*args, **kwargs)


# The tiny Llama run of the training-parity and owner-sharding tests.
LLAMA_STEPS, GLOBAL_BATCH, SEQ_LEN = 5, 12, 16
LLAMA_HPARAMS = dict(lr=0.02, weight_decay=0.1, ns_method="standard", ns_dtype=torch.float32)


def train_llama(parallel: str | None, replica_split=None, dtype: torch.dtype = torch.float32,
                mixed_precision: bool = False, early_start: bool | None = None, bucket_bytes: int | None = None,
                qk_threshold: float | None = None, ddp_comm_hook: bool = False,
                ddp_options: dict | None = None, update_rule: str = "muon",
                momentum_dtype: torch.dtype | None = None) -> dict:
    """Train the tiny model; ``parallel`` None is the single-process reference, else "ddp",
    "fsdp", "hsdp", "owner" (the blocks' matrices owner-sharded) or "fsdp+tp" (a (dp, 2) mesh,
    :func:`tensor_parallel_blocks`) with the data split across the data-parallel ranks.

    ``dtype``: the parameters' dtype; ``mixed_precision``: FSDP2 computes in bf16 and reduces
    in fp32 while its sharded parameters stay fp32. ``early_start``, ``bucket_bytes``, ``update_rule``,
    ``momentum_dtype``: dmuon's options;
    ``qk_threshold``: QK-clip's τ (``dmuon.QKClip.for_model``), None: no clip. ``ddp_comm_hook``:
    register dmuon's (``Muon.register_ddp_comm_hook``); ``ddp_options``: DistributedDataParallel's.
    """
    config = get_config("tiny")
    model = Llama(config, seed=0).to(dtype)
    rank, world = (dist.get_rank(), dist.get_world_size()) if parallel else (0, 1)
    if parallel == "ddp":
        model = DistributedDataParallel(model, **(ddp_options or {}))
    elif parallel in ("fsdp", "hsdp"):
        shape = (2, world // 2) if parallel == "hsdp" else (world,)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")[-len(shape):])
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision
                  else None)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **({"mp_policy": policy} if policy else {}))
        fully_shard(model, mesh=mesh, **({"mp_policy": policy} if policy else {}))
    elif parallel == "owner":
        dmuon.shard_by_owner(model, init_device_mesh("cpu", (world,)), layers=model.layers)
    elif parallel == "fsdp+tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel_blocks(model, mesh["tp"])
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        rank, world = mesh["dp"].get_local_rank(), world // 2  # tensor-parallel ranks see the same batch
    opt = dmuon.Muon(model, replica_split=replica_split, early_start=early_start, update_rule=update_rule,
                     momentum_dtype=momentum_dtype,
                     **({"bucket_bytes": bucket_bytes} if bucket_bytes else {}), **LLAMA_HPARAMS)
    if ddp_comm_hook:
        opt.register_ddp_comm_hook(model)
    clip = dmuon.QKClip.for_model(opt, model, threshold=qk_threshold) if qk_threshold else None
    data = SyntheticTokens(config.vocab_size, seed=0)
    losses, clipped = [], []
    for step in range(LLAMA_STEPS):
        inputs, targets = data.local_batch(step, GLOBAL_BATCH, SEQ_LEN, rank, world)
        loss = lm_loss(model, inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        if parallel:
            dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
        losses.append(global_loss.item())
        if clip is not None:
            clipped.append(clip.statistics()["qk_clip/heads_clipped"])
    state_dtypes = {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}
    return dict(losses=losses, params=whole_params(model), state_dtypes=state_dtypes, early_start=opt.early_start,
                early_buckets=opt.last_step_stats.early_buckets, heads_clipped=clipped)


def whole_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model``, whole, by name (collective: DTensors are gathered and
    owner-sharded matrices broadcast from their owners)."""
    params = {}
    for name, p in model.named_parameters():
        owned = owned_by(p)
        if owned is None:
            value = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        else:
            value = p.detach().clone() if owned.is_mine else torch.empty(p.shape, dtype=p.dtype)
            dist.broadcast(value, src=owned.owner)
        params[name.removeprefix("module.")] = value
    return params


def lm_loss(model, inputs, targets):
    """``Llama.loss`` through the (possibly DDP-wrapped) module's own forward, so DDP's hooks fire."""
    logits = model(inputs)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# ---------------------------------------------------------------- torch.distributed.checkpoint


def dcp_save(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Save the model and optimizer state through DCP (sharded, every rank its own part)."""
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def dcp_load(model: nn.Module, optim: torch.optim.Optimizer, path: str) -> None:
    """Load what :func:`dcp_save` saved, at this world size and in this layout, in place."""
    # get_state_dict on a fresh optimizer runs DCP's zero-grad, lr=0 step to create the state
    # that dcp.load then fills in place.
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])


# ---------------------------------------------------------------- child interpreters


def torchrun_env() -> dict[str, str]:
    """This process's environment for a ``torchrun`` child: without the rank variables of a job
    this process may itself be part of, one intra-op thread per rank."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1"}


def run_child_script(folder: Path, name: str, text: str, *arguments: str) -> subprocess.CompletedProcess:
    """``text`` run as script ``name`` (written into ``folder``) in a child interpreter that
    imports this checkout's dmuon, with ``arguments``."""
    script = folder / name
    script.write_text(text)
    root = Path(dmuon.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(script), *arguments], env=env, cwd=folder,
                          capture_output=True, text=True, timeout=240)


# ---------------------------------------------------------------- errors


def assert_same_error(errors: list[str | None], pattern: str) -> None:
    """Every rank raised, the same error (as :func:`error_of` gives it), matching ``pattern``."""
    assert errors[0] is not None and len(set(errors)) == 1, errors
    assert re.match(pattern, errors[0]), errors[0]


def error_of(fn, *args) -> str | None:
    """Run ``fn`` on this rank; the exception it raised, as "Type: message", or None."""
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001 - the test inspects whichever error it was
        return f"{type(err).__name__}: {err}"
    return None


# ---------------------------------------------------------------- early start

SMALL_BUCKET_BYTES = 4 * 1024  # bytes of Newton–Schulz input per owner: the tiny models in several buckets

def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]  # owner sharding: the owned ones


# what a training loop may do to the gradients between backward() and step()
# "unscale" is what GradScaler.unscale_ runs on the gradients: it leaves their version counters;
# "dmuon clip" is the clipping owner sharding needs (each gradient element counted once in the job)
GRADIENT_CHANGES = {"clip": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3),
                    "dmuon clip": lambda m: dmuon.clip_grad_norm_(m.parameters(), 1e-3),
                    "scale": lambda m: [g.mul_(0.5) for g in _grads(m)],
                    "unscale": lambda m: torch._amp_foreach_non_finite_check_and_unscale_(
                        _grads(m), torch.zeros(1), torch.full((1,), 0.5))}


def change_gradients(model: nn.Module, change: str | None, on_rank: int | None = None) -> None:
    """Run ``GRADIENT_CHANGES[change]`` on ``model`` (nothing for None) on rank ``on_rank``
    (None: on every rank)."""
    if change is not None and on_rank in (None, dist.get_rank()):
        GRADIENT_CHANGES[change](model)


def tiny_mlp(seed: int = 0, layers: int = 4, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``layers`` Linear(32, 32): a 32×32 Muon matrix and an AdamW bias each, in ``dtype``."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)]).to(dtype)


def failing_backward(model: nn.Module, dtype: torch.dtype) -> tuple[Callable[[int], None], list]:
    """For :func:`tiny_mlp`: ``backward(seed)``, a backward pass of each rank's own batch of that
    seed, and ``failing``, a switch: while it holds an item, a backward pass raises an
    out-of-memory error (a test's) after the gradients of the layers above ``model[1]`` (the
    two last) arrived, as a caught OOM in the middle of a backward pass does."""
    failing: list = []

    def fail_later(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if failing:
            out.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("out of memory (a test's)")))

    model[1].register_forward_hook(fail_later)

    def backward(seed: int) -> None:
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(seed + dist.get_rank())).to(dtype)
        model(x).float().square().mean().backward()

    return backward, failing


def assert_same_run(a: dict, b: dict) -> None:
    """Two of :func:`train_llama`'s results: the same losses and bitwise the same parameters."""
    assert a["losses"] == b["losses"]
    for name, value in a["params"].items():
        assert torch.equal(value, b["params"][name]), name


def held_and_saved_bytes(model: nn.Module, batch) -> tuple[int, int]:
    """One AdamW training step of ``model`` on ``batch`` (:func:`dmuon.tools.workloads.training_loss`):
    the bytes it holds (parameters, gradients, AdamW's state) and the bytes of the activations
    autograd saves (a saved-tensors hook; parameters left out)."""
    from dmuon.tools.workloads import training_loss

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    weights = {p.data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.data_ptr() not in weights:
            saved[t.data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = training_loss(model, batch)
    loss.backward()
    opt.step()
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(),
                                                        *(p.grad for p in model.parameters() if p.grad is not None),
                                                        *(v for s in opt.state.values() for v in s.values())])
    return held, sum(saved.values())
