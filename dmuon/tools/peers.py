"""Other distributed Muon implementations from PyPI, as optimizer factories for ``dmuon bench``.

Each entry of ``PEERS`` wraps one third-party package in a factory with the signature of
``dmuon.tools.demo.CONFIGS`` (``factory(model, lr, weight_decay) -> list[Optimizer]``): the peer's
Muon on ``demo.hidden_matrices(model)`` and ``torch.optim.AdamW`` on everything else, exactly
as in the ``torch-muon`` configuration, so that only the Muon part differs between columns.

None of these packages is a dependency of dmuon. ``available_peers()`` returns the factories
whose packages import right now and silently leaves out the others; ``unavailable_peers()``
says why each missing one could not be imported. Install them into an environment that
already has torch with ``--no-deps`` (their metadata says plain ``torch``, and pip must not be
given a chance to replace a CPU or CUDA build), then add the light dependencies by hand::

    pip install --no-deps muon-optimizer==0.1.0 muon-fsdp2==0.3.0 muonium==0.2.0 dtensor-muon==0.1.0 heavyball==3.2.1
    pip install opt-einsum triton      # heavyball needs opt-einsum; muonium, dtensor-muon and dion import triton
    pip install --no-deps git+https://github.com/microsoft/dion@0a059a4   # Dion: not on PyPI

(or put a checkout of Dion's repository on ``PYTHONPATH``).

Hyperparameters: every factory maps ``(lr, weight_decay)`` onto the peer's own knobs so that,
up to the peer's numerics, its step is the step of ``torch.optim.Muon(adjust_lr_fn=
"match_rms_adamw")`` (what ``torch-muon`` runs): momentum 0.95 with Nesterov, 5 Newton–Schulz
steps, update RMS scaled by ``0.2 * sqrt(max(A, B))``, decoupled decay ``p *= 1 - lr * wd``.
Peers that scale by ``sqrt(max(1, A / B))`` themselves get one param group per matrix shape
with the learning rate and weight decay rescaled accordingly (see ``_rms_matched_groups``).

What each one does with the orthogonalization on several ranks (checked on 2 gloo ranks, CPU):

- muon-optimizer (DDP only): Keller Jordan's reference ``muon.MuonWithAuxAdam``; rank r
  updates matrices r, r + world, ... of each group, then ``all_gather`` shares the new
  parameters. (Its import name ``muon`` is also that of an unrelated PyPI package.)
- muon-fsdp2 (FSDP2 only): one owner rank per matrix, round-robin by position; the owner
  gathers the Shard(0) pieces, runs Newton–Schulz and scatters the rows back.
- muonium, dtensor-muon (DDP and FSDP2): no split on CPU; every rank all-gathers each
  matrix (``full_tensor()``) and orthogonalizes all of them. dtensor-muon 0.1.0 is the
  earlier release of muonium 0.2.0 (same code base, renamed).
- heavyball (DDP and FSDP2): no split; a single-device optimizer that all-gathers DTensor
  update, gradient and parameter and orthogonalizes every matrix on every rank.
- dion (DDP and FSDP2; Microsoft's Dion, from its repository): same-shape matrices form one
  batch, split over the ranks by all-to-all in bf16 (Shard(0) rows under FSDP2, the batch under
  DDP); each rank orthogonalizes its share and a second all-to-all sends the rows back.

Newton–Schulz (``PeerSpec.newton_schulz``, read from their sources at the pinned versions;
``PeerSpec.ns_coefficients`` names dmuon's schedule of the same polynomials, which ``dmuon bench
--ns-coefficients`` sets for dmuon's configurations). All of them, and both bench baselines, run
5 steps of the standard quintic iteration (three matrix products a step) on a bf16 copy of the
update; they differ only in the coefficients, which do not change the cost:

- ``torch-muon`` (torch.optim.Muon, the bench's vanilla Muon): Keller Jordan's quintic
  (3.4445, -4.775, 2.0315) at every step, bf16, normalized in bf16.
- ``dmuon`` in the bench (``demo.dmuon_muon``, dmuon.Muon's defaults): the Polar Express
  schedule (safety 1.05), standard NS in bf16 on CPU, normalized in fp32.
  ``--ns-coefficients keller`` makes it run what torch-muon and four of the peers run,
  ``you`` what heavyball and dion run.
- muon-optimizer, muon-fsdp2: Keller's quintic, hard-coded (muon-fsdp2 takes ``ns_steps``;
  muon-optimizer's ``MuonWithAuxAdam`` always runs 5), bf16.
- muonium, dtensor-muon: ``orthogonalization_strategy="newton_schulz"`` (set here) is Keller's
  quintic, bf16; their default ``"polar_express"`` is another Polar Express table (nanochat's:
  coefficients scaled for safety about 1.016, input norm times 1.02), not dmuon's, so Keller is
  the one setting they share with the others.
- dion: ``use_polar_express=False`` (set here) is You Jiacheng's 5-step schedule, bf16,
  normalized in bf16, ``torch.compile``d; its default is its own Polar Express table.
- heavyball: You Jiacheng's 5-step schedule, hard-coded (``assert steps == 5``), on a copy
  rounded to bf16 *stochastically*; its ``zeroth_power_mode`` switch reaches square matrices
  only (every other shape takes that schedule), so it cannot be set to Keller's.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from dmuon.tools.demo import OptimizerFactory, hidden_matrices
from dmuon.tools.models import Llama

__all__ = ["PeerSpec", "PEERS", "available_peers", "unavailable_peers"]

PARALLEL_MODES = frozenset({"ddp", "fsdp"})


@dataclass(frozen=True)
class PeerSpec:
    """One peer implementation: where it comes from, what it supports, how to build it.

    ``imports`` are the modules that must import for the factory to work (the package itself
    first, then any undeclared hard import of it), as ``"module:attribute"`` where the module
    name alone is ambiguous; ``parallel`` the bench modes it runs under on CPU/gloo;
    ``distributes`` one line on how it splits the orthogonalization over ranks;
    ``newton_schulz`` what its orthogonalization runs as configured here, and
    ``ns_coefficients`` the ``dmuon.newton_schulz`` schedule of the same polynomials.
    """

    package: str  # distribution name
    version: str  # the version (or commit) the adapter was written and checked against
    imports: tuple[str, ...]
    parallel: frozenset[str]
    factory: OptimizerFactory
    distributes: str
    newton_schulz: str
    ns_coefficients: str
    repository: str | None = None  # a peer that is not on PyPI: where its source is

    def install_command(self) -> str:
        """The pip line that installs the version the adapter was checked against."""
        if self.repository:
            return f"pip install --no-deps git+{self.repository}@{self.version}"
        return f"pip install --no-deps {self.package}=={self.version}"

    def import_error(self) -> str | None:
        """Why the peer cannot be used right now (``"ModuleNotFoundError: ..."``), or None."""
        for entry in self.imports:
            module, _, attribute = entry.partition(":")
            try:
                imported = importlib.import_module(module)
                if attribute:
                    getattr(imported, attribute)
            except Exception as err:  # noqa: BLE001 - a broken install is as unusable as a missing one
                return f"{type(err).__name__}: {err}"
        return None


# ------------------------------------------------------------------------------------------ helpers


def _split(model: Llama) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden matrices for Muon, every other parameter for AdamW), as in ``demo.torch_muon``."""
    matrices = hidden_matrices(model)
    ids = {id(p) for p in matrices}
    return matrices, [p for p in model.parameters() if id(p) not in ids]


def _rows_cols(p: torch.Tensor) -> tuple[int, int]:
    return p.shape[0], math.prod(p.shape[1:])


def _rms_scale(p: torch.Tensor) -> float:
    """torch.optim.Muon's ``match_rms_adamw`` factor: ``0.2 * sqrt(max(A, B))``."""
    return 0.2 * math.sqrt(max(_rows_cols(p)))


def _shape_ratio(p: torch.Tensor) -> float:
    """The factor muon-optimizer, muonium, dtensor-muon and heavyball apply: ``sqrt(max(1, A / B))``."""
    rows, cols = _rows_cols(p)
    return math.sqrt(max(1.0, rows / cols))


def _rms_matched_groups(
    matrices: Iterable[nn.Parameter], lr: float, weight_decay: float, *, lr_key: str, wd_key: str,
    wd_times_ratio: bool,
) -> list[dict]:
    """One param group per matrix shape whose step equals ``match_rms_adamw``'s.

    The peer steps ``p -= glr * ratio * u`` with ``ratio = sqrt(max(1, A/B))``; we want
    ``lr * 0.2 * sqrt(max(A, B)) * u``, so ``glr = lr * rms_scale / ratio``. Its decay is
    ``glr * wd_g`` (heavyball) or ``glr * ratio * wd_g`` (muonium, ``wd_times_ratio``); we
    want ``lr * weight_decay``, which fixes ``wd_g``.
    """
    by_shape: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for p in matrices:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    groups = []
    for params in by_shape.values():
        ratio = _shape_ratio(params[0])
        group_lr = lr * _rms_scale(params[0]) / ratio
        decay_lr = group_lr * ratio if wd_times_ratio else group_lr
        groups.append({"params": params, lr_key: group_lr, wd_key: lr * weight_decay / decay_lr})
    return groups


def _route_cpu_off_triton(module, names: Iterable[str]) -> None:
    """Make ``module.<name>(G, ...)`` pass ``use_triton=False`` when ``G`` is not on CUDA.

    muonium and dtensor-muon always call their orthogonalization with the default
    ``use_triton=True``, whose Gram kernel asserts CUDA tensors; their pure-PyTorch loop
    (``use_triton=False``) is the same iteration. The optimizers expose no switch, so this
    rebinds the name in the peer's own module, once; CUDA tensors still take the Triton path.
    """
    for name in names:
        original = getattr(module, name)
        if getattr(original, "_dmuon_cpu_route", False):
            continue

        def routed(G, *args, _original=original, **kwargs):
            first = G[0] if isinstance(G, (list, tuple)) else G
            if not first.is_cuda:
                kwargs["use_triton"] = False
            return _original(G, *args, **kwargs)

        routed._dmuon_cpu_route = True
        setattr(module, name, routed)


def _adamw(others: list[nn.Parameter], lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay)


# ----------------------------------------------------------------------------------------- adapters


def keller_muon(model: Llama, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """``muon.MuonWithAuxAdam`` from ``muon-optimizer`` (Keller Jordan's reference; DDP only).

    Within each param group (sorted by size), rank ``r`` updates matrices ``r, r + world, ...``
    in full and ``dist.all_gather`` then copies every updated matrix to every rank, one window
    of ``world`` matrices at a time: the orthogonalization is split, at the price of one
    all-gather of the parameters per step. It needs plain tensors (DTensor parameters would
    make one rank enter collectives that the others skip), equal shapes inside each window
    (all-gather), and its window padding (``len % world`` extra tensors) is only right when
    that fills the last window; checked here. One group per shape also carries the
    ``match_rms_adamw`` rescaling; its Newton–Schulz (bf16, 3.4445/-4.775/2.0315) and EMA
    Nesterov momentum are torch.optim.Muon's, and it runs eagerly (nothing compiled).
    """
    import muon as peer
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    matrices, others = _split(model)
    if any(isinstance(p, DTensor) for p in matrices):
        raise ValueError("muon-optimizer's MuonWithAuxAdam supports replicated (DDP) parameters only, not DTensors")
    world = dist.get_world_size() if dist.is_initialized() else 1
    groups = _rms_matched_groups(matrices, lr, weight_decay, lr_key="lr", wd_key="weight_decay",
                                 wd_times_ratio=False)
    for group in groups:
        count = len(group["params"])
        if (count + count % world) % world:
            raise ValueError(f"muon-optimizer pads a group of {count} matrices with {count % world}, which does not "
                             f"fill its last all-gather window at world size {world}")
        group.update(use_muon=True, momentum=0.95)
    return [peer.MuonWithAuxAdam(groups), _adamw(others, lr, weight_decay)]


def muon_fsdp2(model: Llama, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """``muon_fsdp2.Muon`` (FSDP2 only): each matrix has one owner rank that orthogonalizes it.

    Matrix ``i`` of the group goes to rank ``i % world``: every rank ``gather``s its Shard(0)
    piece of the momentum-updated gradient to the owner, the owner runs Newton–Schulz in bf16
    (``torch.compile``d: about a minute for the first step on CPU, tiny preset) and
    ``scatter``s the rows back; up to 8 matrices are in flight at once. Owners are assigned by
    position, not by size, and not across groups. Its update rule is torch.optim.Muon's with
    ``rms_scale=True`` (0.2 * sqrt(max(A, B))), so no rescaling is needed. Limits, checked here so
    they fail at construction rather than in ``step()``: parameters must be DTensors on a 1-D
    mesh (plain tensors, i.e. DDP, hit a ``NameError`` in its single-device path in 0.3.0) with
    equal-sized shards (gloo ``gather`` needs ``A % world == 0``).
    """
    import muon_fsdp2 as peer
    from torch.distributed.tensor import DTensor

    matrices, others = _split(model)
    for p in matrices:
        if not isinstance(p, DTensor) or p.device_mesh.ndim != 1:
            raise ValueError("muon-fsdp2 supports FSDP2 parameters (DTensors on a 1-D mesh) only; "
                             f"got {type(p).__name__} of shape {tuple(p.shape)}")
        if p.shape[0] % p.device_mesh.size():
            raise ValueError(f"muon-fsdp2 needs equal shards: dim 0 of {tuple(p.shape)} is not divisible by "
                             f"the mesh size {p.device_mesh.size()}")
    muon = peer.Muon([dict(params=matrices, use_muon=True, lr=lr, weight_decay=weight_decay,
                           momentum=0.95, nesterov=True, ns_steps=5, rms_scale=True)])
    return [muon, _adamw(others, lr, weight_decay)]


def _muonium_family(peer_module, orthogonalize_module, names, model, lr, weight_decay):
    _route_cpu_off_triton(orthogonalize_module, names)
    matrices, others = _split(model)
    groups = _rms_matched_groups(matrices, lr, weight_decay, lr_key="lr", wd_key="wd", wd_times_ratio=True)
    muon = peer_module.Muon(groups, lr=lr, wd=weight_decay, use_cautious_wd=False, momentum=0.95, nesterov=True,
                            ns_steps=5, orthogonalization_strategy="newton_schulz")
    return [muon, _adamw(others, lr, weight_decay)]


def muonium(model: Llama, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """``muonium.Muon``: DTensor-aware, but on CPU every rank orthogonalizes every matrix.

    Off CUDA it takes its per-parameter driver: a Shard(0) gradient is ``full_tensor()``-ed
    (all-gather) on every rank, each rank runs Newton–Schulz on the whole matrix and keeps its
    rows; plain (DDP) tensors are orthogonalized by every rank. Its batched driver, which
    splits a stack of same-shape matrices over the ranks, hard-codes a CUDA round trip, and
    its collective-free path is for 3-D (expert) weights only. The update is ``torch.compile``d
    (dynamic shapes): the first step on CPU takes 0.5-2 minutes (tiny preset, cold compile
    cache). Configured with plain
    decay and Newton–Schulz (its defaults are cautious decay and Polar Express); its SGD-style
    momentum is proportional to torch's EMA form, so the direction is the same.
    """
    import muonium as peer
    import muonium.optim.algorithms.base as orthogonalize_module

    names = ("zeropower", "foreach_zeropower", "foreach_zeropower_3d_fsdp")
    return _muonium_family(peer, orthogonalize_module, names, model, lr, weight_decay)


def dtensor_muon(model: Llama, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """``dtensor_muon.Muon``: the earlier release of muonium (0.1.0), same strategy and caveats.

    Its ``MuonForeach`` moves every batch to ``cuda`` and cannot run on CPU; the plain ``Muon``
    gathers each Shard(0) matrix on every rank and orthogonalizes it redundantly.
    """
    import dtensor_muon as peer
    import dtensor_muon.optim.optim as orthogonalize_module

    return _muonium_family(peer, orthogonalize_module, ("zeropower",), model, lr, weight_decay)


def heavyball_muon(model: Llama, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """``heavyball.Muon``: a single-device optimizer that tolerates DTensors, no work split.

    Under FSDP2 its orthogonalization step ``full_tensor()``s the update, the gradient and
    the parameter (three all-gathers per matrix), every rank orthogonalizes the whole matrix
    and writes its rows back; under DDP every rank does all matrices. Its Newton–Schulz uses
    its own 5-step coefficient schedule (not torch's 3.4445/-4.775/2.0315) and rounds the
    input to bf16 *stochastically* with the global RNG; momentum here is its SGD-Nesterov
    form (``heavyball_momentum=True``), proportional to torch's. Because of the random
    rounding, DDP replicas drift apart unless every rank's global RNG is in the same state
    (measured: max |p_rank1 - p_rank0| = 1.6e-3 after 20 steps of the tiny preset), so this
    factory seeds the global RNG identically on every rank. Every update function is
    ``torch.compile``d in ``max-autotune-no-cudagraphs`` mode: the first CPU step takes
    20-60 s (tiny preset).
    """
    import heavyball as peer

    matrices, others = _split(model)
    torch.manual_seed(0)  # same stochastic-rounding stream on every rank (see docstring)
    groups = _rms_matched_groups(matrices, lr, weight_decay, lr_key="lr", wd_key="weight_decay",
                                 wd_times_ratio=False)
    muon = peer.Muon(groups, lr=lr, betas=(0.95, 0.99), weight_decay=weight_decay, nesterov=True,
                     heavyball_momentum=True)
    return [muon, _adamw(others, lr, weight_decay)]


def dion_muon(model: Llama, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """``dion.Muon`` from Microsoft's Dion (its public repository; not on PyPI).

    Same-shape matrices form one batch ("megabatch"): every rank sends its Shard(0) rows (FSDP2)
    or its share of the batch (DDP) by all-to-all, each rank orthogonalizes the matrices it then
    holds, and a second all-to-all sends the rows back. The momentum update, the Nesterov input
    and the cast to bf16 before the all-to-all are one ``torch.compile``d function, and so are the
    decay and the update after it; Newton–Schulz (``use_polar_express=False``: You Jiacheng's five
    coefficients, normalized in bf16) is compiled too. Its momentum is the SGD form
    ``M = mu*M + G``, proportional to torch's EMA form, so the direction is the same;
    ``adjust_lr="rms_norm"`` is torch's ``match_rms_adamw`` (0.2 * sqrt(max(A, B))) and its
    decay ``p *= 1 - lr * wd`` is torch's. The mesh is the parameters' own (FSDP2) or the
    default process group (DDP).
    """
    import torch.distributed as dist
    from dion import Muon as Dion
    from torch.distributed.tensor import DTensor

    matrices, others = _split(model)
    sharded = [p for p in matrices if isinstance(p, DTensor)]
    if sharded:
        mesh = sharded[0].device_mesh
    else:
        mesh = dist.group.WORLD if dist.is_initialized() else None
    muon = Dion(matrices, distributed_mesh=mesh, lr=lr, mu=0.95, weight_decay=weight_decay, nesterov=True,
                adjust_lr="rms_norm", use_polar_express=False)
    return [muon, _adamw(others, lr, weight_decay)]


PEERS: dict[str, PeerSpec] = {
    "muon-optimizer": PeerSpec(
        package="muon-optimizer", version="0.1.0", imports=("muon:MuonWithAuxAdam",), parallel=frozenset({"ddp"}),
        factory=keller_muon,
        distributes="round-robin per matrix within each shape group, then an all-gather of the parameters",
        newton_schulz="Keller (3.4445, -4.775, 2.0315) x 5, bf16; coefficients and steps fixed",
        ns_coefficients="keller",
    ),
    "muon-fsdp2": PeerSpec(
        package="muon-fsdp2", version="0.3.0", imports=("muon_fsdp2",), parallel=frozenset({"fsdp"}),
        factory=muon_fsdp2, distributes="owner rank per matrix (round-robin): gather, NS on the owner, scatter",
        newton_schulz="Keller (3.4445, -4.775, 2.0315) x 5 (ns_steps), bf16; coefficients fixed",
        ns_coefficients="keller",
    ),
    "muonium": PeerSpec(
        package="muonium", version="0.2.0", imports=("muonium", "triton"), parallel=PARALLEL_MODES,
        factory=muonium, distributes="none on CPU: every rank all-gathers and orthogonalizes every matrix",
        newton_schulz="Keller (3.4445, -4.775, 2.0315) x 5, bf16 (orthogonalization_strategy='newton_schulz')",
        ns_coefficients="keller",
    ),
    "dtensor-muon": PeerSpec(
        package="dtensor-muon", version="0.1.0", imports=("dtensor_muon", "triton"), parallel=PARALLEL_MODES,
        factory=dtensor_muon, distributes="none on CPU: every rank all-gathers and orthogonalizes every matrix",
        newton_schulz="Keller (3.4445, -4.775, 2.0315) x 5, bf16 (orthogonalization_strategy='newton_schulz')",
        ns_coefficients="keller",
    ),
    "heavyball": PeerSpec(
        package="heavyball", version="3.2.1", imports=("heavyball", "opt_einsum"), parallel=PARALLEL_MODES,
        factory=heavyball_muon, distributes="none: every rank all-gathers and orthogonalizes every matrix",
        newton_schulz="You Jiacheng's 5-step schedule, bf16 by stochastic rounding; schedule and steps fixed",
        ns_coefficients="you",
    ),
    "dion": PeerSpec(
        package="dion", version="0a059a4", repository="https://github.com/microsoft/dion", imports=("dion:Muon",),
        parallel=PARALLEL_MODES, factory=dion_muon,
        distributes="one all-to-all per shape batch: each rank orthogonalizes its share of the batch, in bf16 "
                    "on the wire both ways",
        newton_schulz="You Jiacheng's 5-step schedule (use_polar_express=False), bf16, normalized in bf16, compiled",
        ns_coefficients="you",
    ),
}


def available_peers() -> dict[str, OptimizerFactory]:
    """Factories of the peers whose packages import now, by name; the others are left out silently."""
    return {name: spec.factory for name, spec in PEERS.items() if spec.import_error() is None}


def unavailable_peers() -> dict[str, str]:
    """The peers that cannot be imported now, with the error (for the bench to say what it skipped)."""
    errors = {name: spec.import_error() for name, spec in PEERS.items()}
    return {name: error for name, error in errors.items() if error is not None}

