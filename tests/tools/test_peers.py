"""The peer Muon implementations of ``dmuon.tools.peers``: a few real steps on 2 gloo ranks each.

None of the peers is a dependency of dmuon: each test is skipped, naming the missing module,
when its package is not installed (see dmuon/tools/peers.py for the install line). When it is, the
peer trains the tiny Llama under DDP or FSDP2 beside ``torch.optim.Muon`` (``demo.torch_muon``)
from the same weights on the same batch, and must (a) lower the loss, (b) leave every rank with
the same full parameters, and (c) move the hidden matrices the way torch's Muon does, within
the peer's numerics (bf16 Newton–Schulz everywhere; heavyball's own coefficients).

The default tests run the peers with ``torch.compile`` forced to eager, since compiling their
kernels on CPU takes tens of seconds to minutes per peer; ``-m slow`` runs them compiled, as
they ship.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from dmuon.tools import demo
from dmuon.tools.models import Llama, SyntheticTokens, get_config
from dmuon.tools.peers import PEERS, _rms_matched_groups, available_peers, unavailable_peers
from tests.harness import run_on_ranks

LR, WEIGHT_DECAY, STEPS = 3e-3, 0.1, 3
# max over hidden matrices of |dp_peer - dp_torch| / |dp_torch| after STEPS steps, dp = p - p0.
# Measured on CPU (eager): torch.optim.Muon against itself under DDP vs FSDP2 (only the
# reduction order differs) 0.08; muon-fsdp2 0.11, muonium and dtensor-muon 0.14 (bf16
# Newton-Schulz, normalized slightly differently); heavyball 0.27 and dion 0.26 (You's coefficients).
TOLERANCE = {"muon-optimizer": 0.25, "muon-fsdp2": 0.25, "muonium": 0.25, "dtensor-muon": 0.25, "heavyball": 0.5,
             "dion": 0.5}

PEER_MODES = [pytest.param(name, mode, id=f"{mode}-{name}") for name, spec in PEERS.items()
              for mode in sorted(spec.parallel)]


def require(name: str) -> None:
    """Skip unless every module the peer needs imports."""
    spec = PEERS[name]
    install = f"{spec.install_command()} (see dmuon/tools/peers.py)"
    for entry in spec.imports:
        module, _, attribute = entry.partition(":")
        imported = pytest.importorskip(module, reason=f"peer {name!r} needs {module!r}: {install}")
        if attribute and not hasattr(imported, attribute):
            pytest.skip(f"peer {name!r}: the installed {module!r} is another package (no {attribute}): {install}")


def wrap(model: Llama, parallel: str):
    if parallel == "ddp":
        return DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train(factory, parallel: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` steps on one fixed batch; (local losses, full parameters afterwards)."""
    config = get_config("tiny")
    model = Llama(config, seed=0)
    wrapped = wrap(model, parallel)
    optimizers = factory(model, LR, WEIGHT_DECAY)
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, targets = SyntheticTokens(config.vocab_size, seed=0).local_batch(0, 4 * world, 16, rank, world)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(wrapped(inputs).flatten(0, 1).float(), targets.flatten())
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    return losses, full


def peer_against_torch_muon(name: str, parallel: str, steps: int, compiled: bool) -> dict:
    stance = contextlib.nullcontext() if compiled else torch.compiler.set_stance("force_eager")
    with torch.random.fork_rng(), stance:  # heavyball's factory seeds the global RNG
        losses, params = train(PEERS[name].factory, parallel, steps)
        _, reference = train(demo.torch_muon, parallel, steps)
    model = Llama(get_config("tiny"), seed=0)
    matrix_ids = {id(p) for p in demo.hidden_matrices(model)}
    initial = {n: p.detach() for n, p in model.named_parameters()}
    deviation = max(((params[n] - reference[n]).norm() / (reference[n] - p0).norm()).item()
                    for n, p0 in initial.items() if id(model.get_parameter(n)) in matrix_ids)
    return dict(losses=losses, params=params, deviation=deviation)


def check(results: list[dict], name: str) -> None:
    for r in results:
        assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][-1] < r["losses"][0], r["losses"]
        assert r["deviation"] < TOLERANCE[name], r["deviation"]
    for key, value in results[0]["params"].items():
        assert torch.equal(value, results[1]["params"][key]), f"ranks disagree on {key}"


@pytest.mark.parametrize("name,parallel", PEER_MODES)
def test_peer_steps_like_torch_muon(name, parallel):
    require(name)
    check(run_on_ranks(2, peer_against_torch_muon, name, parallel, STEPS, False, timeout_s=180), name)


@pytest.mark.slow
@pytest.mark.parametrize("name,parallel", PEER_MODES)
def test_peer_steps_like_torch_muon_compiled(name, parallel):
    """Compiling a peer's kernels on CPU takes minutes: deselected by default (``-m slow``)."""
    require(name)
    results = run_on_ranks(2, peer_against_torch_muon, name, parallel, STEPS, True,
                           timeout_s=1800, collective_timeout_s=1200)
    check(results, name)


def test_muon_fsdp2_rejects_plain_tensors():
    require("muon-fsdp2")
    with pytest.raises(ValueError, match="FSDP2 parameters"):
        PEERS["muon-fsdp2"].factory(Llama(get_config("tiny")), LR, WEIGHT_DECAY)


def test_available_and_unavailable_partition_the_peers():
    available, unavailable = available_peers(), unavailable_peers()
    assert set(available).isdisjoint(unavailable) and set(available) | set(unavailable) == set(PEERS)
    assert all(available[name] is PEERS[name].factory for name in available)
    assert all(spec.parallel <= {"ddp", "fsdp"} and spec.parallel for spec in PEERS.values())


@pytest.mark.parametrize("wd_times_ratio", [True, False])
def test_rms_matched_groups_reproduce_torch_muon_step_sizes(wd_times_ratio):
    """Per shape: the peer's own ``sqrt(max(1, A/B))`` times the group lr is torch's
    ``match_rms_adamw`` step, and the group's decay is ``lr * weight_decay``."""
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in [(64, 32), (32, 64), (64, 32), (16, 16)]]
    groups = _rms_matched_groups(params, LR, WEIGHT_DECAY, lr_key="lr", wd_key="wd", wd_times_ratio=wd_times_ratio)
    assert [len(g["params"]) for g in groups] == [2, 1, 1]
    for g in groups:
        rows, cols = g["params"][0].shape
        ratio = math.sqrt(max(1, rows / cols))
        assert g["lr"] * ratio == pytest.approx(LR * 0.2 * math.sqrt(max(rows, cols)))
        decay = g["lr"] * g["wd"] * (ratio if wd_times_ratio else 1)
        assert decay == pytest.approx(LR * WEIGHT_DECAY)


def test_every_peer_names_a_dmuon_schedule_of_its_newton_schulz():
    """``dmuon bench --ns-coefficients`` takes what a peer's ``ns_coefficients`` names."""
    from dmuon.coefficients import NAMED_COEFFICIENTS

    assert all(spec.ns_coefficients in NAMED_COEFFICIENTS and spec.newton_schulz for spec in PEERS.values())
