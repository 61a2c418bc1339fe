"""``dmuon.Muon``: Muon for hidden matrices and AdamW for the rest, in one ``torch.optim.Optimizer``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adamw import adamw as adamw_update

from dmuon.cuda_graphs import GraphedOrthogonalize
from dmuon.engine import Block, MatrixWork, Orthogonalizer, StepStats, unit_of
from dmuon.exchange import all_reduce_max, all_reduce_sum, check_ranks_agree
from dmuon.layout import detect_layout, owned_by
from dmuon.orthogonalization import (
    NORMALIZATION_EPS, SYMMETRIC_PRODUCTS, NSConfig, gram_all_reduces, newton_schulz_flops, orthogonalize,
    resolve_config,
)
from dmuon.planner import (
    DEFAULT_BUCKET_BYTES, Plan, choose_distributed, choose_gangs, distributed_cost, gang_costs,
    split_replicas_is_cheaper,
)
from dmuon.routing import ALGORITHMS, MATRIX_VIEWS, block_rows, default_route, matrix_shape, module_roles
from dmuon.triton_kernels import triton_usable

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
NONFINITE_POLICIES = ("skip", "raise", "ignore")

MUON_KEYS = (
    "lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
    "adjust_lr_fn", "ns_method", "ns_dtype", "ns_restarts", "ns_blocks",
)
ADAMW_KEYS = ("lr", "weight_decay", "betas", "eps")
# Keys a user's param group may carry besides hyperparameters.
_STRUCTURE_KEYS = frozenset({"params", "param_names", "algorithm", "matrix_view", "name", "initial_lr"})
_ADAMW_ALIASES = ("adamw_lr", "adamw_weight_decay", "adamw_betas", "adamw_eps")


def adjusted_lr_ratio(adjust_lr_fn: str | None, m: int, n: int) -> float:
    """Per-matrix lr multiplier, as in ``torch.optim.Muon``.

    "original" (Keller): √max(1, m/n); "match_rms_adamw" (Moonlight): 0.2·√max(m, n), which gives
    the update the RMS of an AdamW update so AdamW's lr and weight decay carry over.
    """
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    return math.sqrt(max(1.0, m / n))


def all_finite(tensor: Tensor) -> Tensor:
    """Whether every element is finite, as a 0-D bool tensor (no host sync).

    The minimum and maximum are finite exactly when every element is (NaN propagates through
    both); ``torch.aminmax`` is a vectorized reduction, about 25× faster on CPU than
    ``isfinite(t).all()``, whose element-wise pass is not vectorized there.
    """
    if tensor.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=tensor.device)
    return torch.isfinite(torch.stack(torch.aminmax(tensor))).all()


def update_momentum(buf: Tensor, grad: Tensor, momentum: Tensor) -> None:
    """``B ← μ·B + (1−μ)·G``, μ a 0-D tensor (compiled once for every μ)."""
    buf.lerp_(grad, 1 - momentum.to(buf.dtype))


def nesterov_input(grad: Tensor, buf: Tensor, momentum: Tensor) -> Tensor:
    """``G + μ·(B − G)``: the Newton–Schulz input with Nesterov momentum."""
    return torch.lerp(grad, buf, momentum.to(buf.dtype))


def apply_update(param: Tensor, update: Tensor, lr: Tensor, weight_decay: Tensor, scale: float) -> None:
    """``W ← W·(1 − lr·wd) − lr·scale·O``, lr and wd 0-D tensors (compiled once for every lr)."""
    param.mul_(1 - lr * weight_decay)
    param.sub_(update.to(param.dtype) * (lr * scale))


@dataclass(frozen=True)
class CompiledKernels:
    """The step's tensor code, each function compiled whole (``fullgraph=True``: a graph break
    is an error) for fixed shapes; hyperparameters enter as 0-D tensors, so changing the lr or
    momentum reuses the compiled code."""

    orthogonalize: Callable[[Tensor, NSConfig], Tensor]
    update_momentum: Callable[[Tensor, Tensor, Tensor], None]
    nesterov_input: Callable[[Tensor, Tensor, Tensor], Tensor]
    apply_update: Callable[[Tensor, Tensor, Tensor, Tensor, float], None]


def compile_kernels(backend: str | Callable = "inductor") -> CompiledKernels:
    def compiled(fn: Callable) -> Callable:
        return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)

    return CompiledKernels(*(compiled(fn) for fn in (orthogonalize, update_momentum, nesterov_input, apply_update)))


def _scalar(value: float | Tensor, device: torch.device) -> Tensor:
    """A hyperparameter as the 0-D fp32 tensor the compiled kernels take."""
    return torch.as_tensor(value, dtype=torch.float32, device=device)


def _splittable(p: Tensor, layout, process_group, blocks: tuple) -> bool:
    """Whether the ranks holding ``p``'s shards can orthogonalize it together on their own
    column blocks (distributed NS): a matrix sharded on one dim over one group — or on dim 0
    over every dim of a mesh of all ranks (FSDP + column-wise TP) — unfused."""
    return (isinstance(p, DTensor) and p.ndim == 2 and process_group is not None and not blocks
            and (not layout.gathered or layout.rows_partitioned) and layout.replicas == 1 and layout.shards > 1)


def _gang_eligible(work: MatrixWork) -> bool:
    """Whether ``work`` could be split over a gang (:meth:`Orthogonalizer._run_gangs`): one
    unfused matrix of a planned exchange group of several ranks."""
    return (work.group is not None and work.layout.size > 1 and not work.layout.gathered and not work.column_blocks
            and not work.blocks and work.count == 1 and len(work.layout.shape) == 2)


def _transposed(local_input: Callable[[], Tensor]) -> Tensor:
    return local_input().mT


def _gather_whole(local_input: Callable[[], Tensor], mesh, placements, shape, stride) -> Tensor:
    """The whole NS input of a DTensor parameter from this rank's piece (a collective)."""
    return DTensor.from_local(local_input(), mesh, placements, shape=shape, stride=stride).full_tensor()


def _piece_of(whole: Tensor, mesh, placements) -> Tensor:
    """This rank's piece of a whole tensor every rank holds (no communication)."""
    return distribute_tensor(whole, mesh, placements, src_data_rank=None).to_local()


def _local(tensor: Tensor) -> Tensor:
    """This rank's piece of a tensor: the local shard of a DTensor (a view: writes go through)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _steps_here(param: Tensor) -> bool:
    """Whether this rank steps ``param``: always, unless it is owner-sharded to another rank."""
    owned = owned_by(param)
    return owned is None or owned.is_mine


def _check_range(name: str, value: Any, where: str, low: float, high: float | None = None,
                 low_open: bool = False) -> None:
    number = value.item() if isinstance(value, Tensor) and value.numel() == 1 else value
    if isinstance(number, bool) or not isinstance(number, (int, float)) or math.isnan(number):
        raise ValueError(f"Invalid {name}={value!r}{where}. Must be a number.")
    below = number <= low if low_open else number < low
    above = high is not None and number >= high
    if below or above:
        bound = f"{'>' if low_open else '>='} {low}" + (f" and < {high}" if high is not None else "")
        raise ValueError(f"Invalid {name}={value!r}{where}. Must be {bound}.")


def validate_muon_group(group: dict[str, Any], where: str = "") -> None:
    """Raise a ValueError naming the first bad Muon hyperparameter of a group."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"Invalid lr{where}: a Tensor lr must have one element, got shape {tuple(lr.shape)}.")
    _check_range("lr", lr, where, 0.0)
    _check_range("weight_decay", group["weight_decay"], where, 0.0)
    _check_range("momentum", group["momentum"], where, 0.0, 1.0)
    _check_range("eps", group["eps"], where, 0.0, low_open=True)
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"Invalid nesterov={group['nesterov']!r}{where}. Must be a bool.")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"Invalid adjust_lr_fn={group['adjust_lr_fn']!r}{where}. Must be one of {ADJUST_LR_FNS}.")
    try:  # resolving for a square and a wide shape exercises every option of the recipe
        for shape in ((8, 8), (8, 64)):
            for device_type in ("cpu", "cuda"):
                _ns_config(group, shape, device_type)
    except ValueError as err:
        raise ValueError(f"{err}{' (' + where.strip(' ,') + ')' if where else ''}") from None


def validate_adamw_group(group: dict[str, Any], where: str = "") -> None:
    """Raise a ValueError naming the first bad AdamW hyperparameter of a group."""
    _check_range("lr", group["lr"], where, 0.0)
    _check_range("weight_decay", group["weight_decay"], where, 0.0)
    _check_range("eps", group["eps"], where, 0.0, low_open=True)
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid betas={betas!r}{where}. Must be a pair.")
    for i, beta in enumerate(betas):
        _check_range(f"betas[{i}]", beta, where, 0.0, 1.0)


def dtype_name(value: torch.dtype | str | None, where: str = "") -> str | None:
    """``ns_dtype`` as param groups keep it: a name ("bfloat16") or None, since DCP's full and
    CPU-offloaded state dicts accept only plain values in param groups."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"Invalid ns_dtype={value!r}{where}. Must be a floating torch.dtype, its name, or None.")
    return name


def _ns_config(group: dict[str, Any], shape: Sequence[int], device_type: str, symmetric: str = "torch") -> NSConfig:
    name = dtype_name(group["ns_dtype"])
    return resolve_config(
        shape, device_type, steps=group["ns_steps"], coefficients=group["ns_coefficients"],
        method=group["ns_method"], dtype=getattr(torch, name) if name else None,
        restarts=group["ns_restarts"], eps=group["eps"], symmetric=symmetric,
    )


class Muon(torch.optim.Optimizer):
    """Muon for hidden weight matrices, AdamW for everything else, in one optimizer.

    **Algorithm.** For each matrix parameter W (gradient G, momentum buffer B):

    1. ``B ← μ·B + (1−μ)·G``; the Newton–Schulz input is ``M = G + μ·(B − G)`` (Nesterov) or B;
    2. ``O = NS(M)``: Newton–Schulz orthogonalization, approximately U·Vᵀ for M = U·Σ·Vᵀ
       (:func:`dmuon.newton_schulz`; Polar Express coefficients by default);
    3. ``W ← W·(1 − lr·wd) − lr·r(m, n)·O`` with r from ``adjust_lr_fn``.

    Parameters Muon does not suit (embeddings, output heads, norms, biases, scalars) get AdamW
    inside the same object; conv kernels are flattened to (out, in·k…), 3-D stacks are batches of
    matrices (rules: :mod:`dmuon.routing`; see :meth:`routing_summary`). With the default
    ``adjust_lr_fn="match_rms_adamw"`` the Muon update has AdamW's RMS, so the lr and weight decay
    of an ``AdamW(lr, weight_decay)`` run carry over unchanged to the whole model.

    **Shape of a step.** Element-wise momentum on each parameter → one call that orthogonalizes
    the list of all Muon matrices (the place where the distributed engine takes over) →
    element-wise apply. AdamW runs on its parameters in the same step.

    **Param groups.** ``params`` is an ``nn.Module`` (routing then sees module types and names),
    ``named_parameters()``, an iterable of tensors, or dicts. A dict without ``"algorithm"``
    becomes two groups, a "muon" one and an "adamw" one (either may be empty, so every rank has
    the same groups), both carrying its options; ``"algorithm": "muon"|"adamw"`` keeps it whole.
    AdamW groups take ``adamw_lr``/``adamw_weight_decay`` when given, else ``lr``/``weight_decay``.

    **Non-finite gradients** (``nonfinite_grads``): "skip" (default) leaves every parameter and
    state untouched for that step, warns and counts it in ``skipped_steps``; "raise" raises
    ``FloatingPointError`` naming the parameters; "ignore" does no check. A parameter whose
    ``grad`` is None is left alone (no state is created for it), as in ``torch.optim``.

    To reproduce ``torch.optim.Muon`` exactly: ``ns_coefficients="keller"``,
    ``ns_method="standard"``, ``ns_dtype=torch.bfloat16``, ``adjust_lr_fn="original"``,
    ``weight_decay=0.1``.
    """

    def __init__(
        self,
        params: nn.Module | Iterable[Any],
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.01,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = "polar_express",
        eps: float = NORMALIZATION_EPS,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = "match_rms_adamw",
        ns_method: str = "auto",
        ns_dtype: torch.dtype | str | None = None,
        ns_restarts: Sequence[int] | None = None,
        ns_blocks: int | Sequence[int] | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_lr: float | Tensor | None = None,
        adamw_weight_decay: float | None = None,
        nonfinite_grads: str = "skip",
        process_group: dist.ProcessGroup | None = None,
        comm_dtype: torch.dtype | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        replica_split: bool | None = None,
        distributed_ns: bool | None = None,
        symmetric_products: str = "torch",
        compile: bool | str | Callable = False,
        cuda_graphs: bool = False,
    ) -> None:
        if nonfinite_grads not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid {nonfinite_grads=}. Must be one of {NONFINITE_POLICIES}.")
        if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point):
            raise ValueError(f"Invalid {comm_dtype=}. Must be a floating torch.dtype or None.")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"Invalid {bucket_bytes=}. Must be a positive int.")
        if replica_split not in (None, True, False):
            raise ValueError(f"Invalid {replica_split=}. Must be None (cost model), True or False.")
        if symmetric_products not in (*SYMMETRIC_PRODUCTS, "auto"):
            raise ValueError(f"Invalid {symmetric_products=}. Must be one of {(*SYMMETRIC_PRODUCTS, 'auto')}.")
        if not isinstance(cuda_graphs, bool):
            raise ValueError(f"Invalid {cuda_graphs=}. Must be a bool.")
        if distributed_ns not in (None, True, False):
            raise ValueError(f"Invalid {distributed_ns=}. Must be None (cost model), True or False.")
        if not (isinstance(compile, (bool, str)) or callable(compile)):
            raise ValueError(f"Invalid {compile=}. Must be a bool, or a torch.compile backend (name or callable).")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
            ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
            ns_method=ns_method, ns_dtype=ns_dtype, ns_restarts=ns_restarts, ns_blocks=ns_blocks,
            adamw_betas=adamw_betas, adamw_eps=adamw_eps, adamw_lr=adamw_lr,
            adamw_weight_decay=adamw_weight_decay, nonfinite_grads=nonfinite_grads,
        )
        validate_muon_group(defaults)
        validate_adamw_group(self._adamw_hparams({}, defaults))
        if isinstance(params, (set, Tensor)):
            raise TypeError(f"params must be a module, or an ordered iterable of tensors or dicts, not a {type(params).__name__}.")
        self._module_roles: dict[int, str] = {}
        if isinstance(params, nn.Module):
            self._module_roles = module_roles(params)
            params = list(params.named_parameters())
        self.skipped_steps = 0
        self._update_squares: dict[str, list] = {}  # group label -> [sum of squares, elements], last step
        self._user_groups = 0
        self._process_group = process_group
        self._replica_split = replica_split
        self._split_decisions: dict[tuple, bool] = {}
        self._distribution_decisions: dict[tuple, frozenset[int]] = {}
        self._gang_decisions: dict[tuple, dict[int, tuple[int, ...]]] = {}
        self._distributed_ns = distributed_ns
        self._symmetric = symmetric_products
        self._symmetric_by_shape: dict[tuple[int, int], str] = {}  # "auto": measured at construction
        self._engine_options = (comm_dtype, bucket_bytes, replica_split, distributed_ns, symmetric_products)
        self._kernels = compile_kernels("inductor" if compile is True else compile) if compile else None
        ns = self._kernels.orthogonalize if self._kernels else orthogonalize
        self._engine = Orthogonalizer(bucket_bytes, comm_dtype,
                                      orthogonalize_fn=GraphedOrthogonalize(ns) if cuda_graphs else ns)
        super().__init__(params, defaults)
        self._module_roles = {}  # used for routing at construction only; params may be swapped later
        self.plans  # detects every layout now: an unsupported one raises before any collective
        if self._agreement_group() is not None:
            self._check_ranks_agree()
        if symmetric_products == "auto":  # a collective: after the ranks agree on the options
            self._symmetric_by_shape = self._measure_symmetric_products()

    # ------------------------------------------------------------------ groups and routing

    @staticmethod
    def _adamw_hparams(group: dict[str, Any], defaults: dict[str, Any], explicit: bool = False) -> dict[str, Any]:
        """AdamW options of a group: the group's own keys first (``adamw_*`` before plain ones),
        then the constructor's. A plain ``eps`` is Muon's unless the group is explicitly AdamW."""

        def first(*values: Any) -> Any:
            return next((v for v in values if v is not None), None)

        return {
            "lr": first(group.get("adamw_lr"), group.get("lr"), defaults["adamw_lr"], defaults["lr"]),
            "weight_decay": first(
                group.get("adamw_weight_decay"), group.get("weight_decay"),
                defaults["adamw_weight_decay"], defaults["weight_decay"],
            ),
            "betas": first(group.get("adamw_betas"), group.get("betas"), defaults["adamw_betas"]),
            "eps": first(group.get("adamw_eps"), group.get("eps") if explicit else None, defaults["adamw_eps"]),
        }

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; without an ``"algorithm"`` key it is split into a Muon and an AdamW group."""
        # Name the group as the user numbered it (before any split).
        where = f" in param group {self._user_groups}"
        self._user_groups += 1
        unknown = set(param_group) - _STRUCTURE_KEYS - set(MUON_KEYS) - set(ADAMW_KEYS) - set(_ADAMW_ALIASES)
        if unknown:
            raise ValueError(f"Unknown option(s) {sorted(unknown)}{where}.")
        algorithm = param_group.get("algorithm")
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"Invalid algorithm={algorithm!r}{where}. Must be one of {ALGORITHMS}.")
        view_override = param_group.get("matrix_view")
        if view_override is not None and view_override not in MATRIX_VIEWS:
            raise ValueError(f"Invalid matrix_view={view_override!r}{where}. Must be one of {MATRIX_VIEWS}.")

        entries = self._named_entries(param_group)
        split = {alg: [] for alg in ((algorithm,) if algorithm else ALGORITHMS)}
        for index, (name, param) in enumerate(entries):
            label = name or f"parameter {index}"
            if param.is_complex():
                raise ValueError(f"Muon does not support complex parameters: {label}{where}.")
            route = default_route(param, name, self._module_roles.get(id(param)))
            chosen = algorithm or route.algorithm
            view = view_override or (route.matrix_view if chosen == route.algorithm else "auto")
            if chosen == "muon":
                try:
                    _, m, _ = matrix_shape(param.shape, view)
                except ValueError as err:
                    raise ValueError(f"{label}{where}: {err} Put it in an 'adamw' group.") from None
                try:
                    block_rows(param_group.get("ns_blocks", self.defaults["ns_blocks"]), m)
                except ValueError as err:
                    raise ValueError(f"{err} ({label}{where})") from None
            split[chosen].append((name, param, view))

        named = any(name is not None for name, _ in entries)
        for alg, members in split.items():
            group = {
                k: v for k, v in param_group.items()
                if k in ("name", "initial_lr") or (k in MUON_KEYS and alg == "muon")
            }
            group["algorithm"] = alg
            group["params"] = [(n, p) for n, p, _ in members] if named else [p for _, p, _ in members]
            if named and not members:  # torch tells named groups by their first entry
                group["param_names"] = []
            if alg == "muon":
                for key in MUON_KEYS:
                    group.setdefault(key, self.defaults[key])
                group["ns_dtype"] = dtype_name(group["ns_dtype"], where)
                if not isinstance(group["ns_blocks"], (int, type(None))):
                    group["ns_blocks"] = list(group["ns_blocks"])  # plain values: DCP state dicts take them
                group["matrix_views"] = [v for _, _, v in members]
                validate_muon_group(group, where)
            else:
                group.update(self._adamw_hparams(param_group, self.defaults, explicit=algorithm == "adamw"))
                validate_adamw_group(group, where)
            # torch's add_param_group would copy *all* defaults (both algorithms') into the group;
            # every key is already filled here.
            defaults, self.defaults = self.defaults, {}
            try:
                super().add_param_group(group)
            finally:
                self.defaults = defaults

    @staticmethod
    def _named_entries(param_group: dict[str, Any]) -> list[tuple[str | None, Tensor]]:
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError("Parameters must be an ordered collection (a list), not a set.")
        names = param_group.get("param_names")
        entries = []
        for i, item in enumerate(params):
            name, tensor = item if isinstance(item, tuple) else (names[i] if names else None, item)
            if not isinstance(tensor, Tensor):
                raise TypeError(f"Muon can only optimize Tensors, but got {type(tensor).__name__}.")
            entries.append((name, tensor))
        return entries

    def routing_summary(self) -> str:
        """A table: every parameter, its shape, the algorithm and the matrices Muon sees."""
        rows = [("group", "parameter", "shape", "algorithm", "matrices")]
        for g, group in enumerate(self.param_groups):
            names = group.get("param_names") or [f"#{i}" for i in range(len(group["params"]))]
            for i, (name, p) in enumerate(zip(names, group["params"])):
                if group["algorithm"] == "muon":
                    count, m, n = matrix_shape(p.shape, group["matrix_views"][i])
                    matrices = f"{count} x {m}x{n}"
                else:
                    matrices = "-"
                rows.append((str(g), name, "x".join(map(str, p.shape)), group["algorithm"], matrices))
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)

    def __repr__(self) -> str:
        counts = {alg: sum(len(g["params"]) for g in self.param_groups if g["algorithm"] == alg) for alg in ALGORITHMS}
        return (
            f"{type(self).__name__}(muon: {counts['muon']} params, adamw: {counts['adamw']} params, "
            f"groups: {len(self.param_groups)})\n{self.routing_summary()}"
        )

    # ------------------------------------------------------------------ distribution

    def _muon_params(self) -> list[tuple[str, Tensor, dict[str, Any], str]]:
        """(name, param, group, matrix view) of every Muon parameter, in group order."""
        out = []
        for g, group in enumerate(self.param_groups):
            if group["algorithm"] != "muon":
                continue
            names = group.get("param_names") or [f"group{g}.param{i}" for i in range(len(group["params"]))]
            out.extend(zip(names, group["params"], [group] * len(names), group["matrix_views"]))
        return out

    def _works(self, entries: list, inputs: dict[int, Callable[[], Tensor]]) -> list[MatrixWork]:
        """The orthogonalization work of Muon parameter ``entries`` (inputs: id → a function
        computing the local NS input): each matrix to one owner, or split across its group."""
        works = self._owned_works(entries, inputs)
        if self._distributed_ns is False:
            return works
        splittable = [i for i, ((_, p, _, _), w) in enumerate(zip(entries, works))
                      if _splittable(p, w.layout, w.group, w.blocks)]
        if splittable:
            chosen = set(splittable) if self._distributed_ns else self._split_choice(entries, inputs, works, splittable)
            works = [self._work(e, inputs, False, True) if i in chosen else w
                     for i, (e, w) in enumerate(zip(entries, works))]
        return works if self._distributed_ns else self._gang_choice(works)

    def _gang_choice(self, works: list[MatrixWork]) -> list[MatrixWork]:
        """The cost model's choice of matrices to split over gangs of ranks
        (:func:`dmuon.planner.choose_gangs`), per exchange group; cached as the plans are."""
        eligible = [i for i, w in enumerate(works) if _gang_eligible(w)]
        for members in self._engine.group_indices([works[i] for i in eligible]):
            group_works = [works[eligible[i]] for i in members]
            units = tuple(unit_of(w, self._engine.wire_itemsize(w)) for w in group_works)
            if units not in self._gang_decisions:
                layout = group_works[0].layout
                fpb = self._engine.flops_per_byte
                costs = gang_costs(units, [w.config for w in group_works], fpb)
                self._gang_decisions[units] = choose_gangs(units, costs, layout.size, layout.replicas, flops_per_byte=fpb)
            for j, gang in self._gang_decisions[units].items():
                works[eligible[members[j]]] = replace(works[eligible[members[j]]], gang=gang)
        return works

    def _split_choice(self, entries: list, inputs, works: list[MatrixWork], splittable: list[int]) -> set[int]:
        """The cost model's choice (:func:`dmuon.planner.choose_distributed`), per exchange group;
        cached by the group's matrices, as the plans are."""
        chosen: set[int] = set()
        for members in self._engine.group_indices(works):
            units = tuple(unit_of(works[i], self._engine.wire_itemsize(works[i])) for i in members)
            key = (units, tuple(i in splittable for i in members))
            if key not in self._distribution_decisions:
                costs = [self._distributed_cost(self._work(entries[i], inputs, False, True)) if i in splittable
                         else None for i in members]
                layout = works[members[0]].layout
                self._distribution_decisions[key] = choose_distributed(
                    units, costs, layout.size, layout.replicas, bucket_bytes=self._engine.bucket_bytes,
                    flops_per_byte=self._engine.flops_per_byte)
            chosen.update(members[j] for j in self._distribution_decisions[key])
        return chosen

    def _distributed_cost(self, work: MatrixWork) -> float:
        """What every rank of the group pays when ``work`` (in column-block form) is split."""
        config, size = work.config, work.layout.shards
        blocks_flops = work.count * newton_schulz_flops(work.m, -(-work.n // size), steps=config.steps,
                                                        method=config.method, restarts=config.restarts,
                                                        gram_side=work.m)
        return distributed_cost(blocks_flops, 4 * work.count * work.m**2, gram_all_reduces(config), size,
                                self._engine.flops_per_byte)

    def _owned_works(self, entries: list, inputs: dict[int, Callable[[], Tensor]]) -> list[MatrixWork]:
        split = self._replica_split
        if split is None:  # HSDP: the cost model decides whether replicas split the work
            works = [self._work(e, inputs, True) for e in entries]
            if not any(w.layout.replicas > 1 and w.layout.shards > 1 for w in works):
                return works
            units = tuple(unit_of(w, self._engine.wire_itemsize(w)) for w in works)
            if units not in self._split_decisions:
                self._split_decisions = {units: split_replicas_is_cheaper(units, self._engine.flops_per_byte)}
            if self._split_decisions[units]:
                return works
            split = False
        return [self._work(e, inputs, split) for e in entries]

    def _work(self, entry, inputs: dict[int, Callable[[], Tensor]], split: bool,
              distributed: bool = False) -> MatrixWork:
        name, p, group, view = entry
        stack = p.ndim == 3 and view in ("auto", "batch")
        layout, process_group = detect_layout(p, name, self._process_group, split, stack)
        # what NS sees: a local stack's own matrices, or for Shard(1) the transpose
        count, m, n = matrix_shape(layout.shape, view)
        _, rows_of_p, cols_of_p = matrix_shape(p.shape, view)  # the parameter's matrix: its lr factor
        config = _ns_config(group, (m, n), p.device.type, self._symmetric_for((m, n)))
        rows = block_rows(group["ns_blocks"], rows_of_p)
        if len(rows) > 1 and layout.transposed:
            raise NotImplementedError(f"ns_blocks for parameter {name!r}: row blocks of a Shard(1) (row-wise "
                                      "tensor parallel) matrix are not supported.")
        # fused weights: each block is orthogonalized and scaled for its own shape by its owner
        blocks = () if len(rows) == 1 else tuple(
            Block(r, _ns_config(group, (r, n), p.device.type, self._symmetric_for((r, n))),
                  adjusted_lr_ratio(group["adjust_lr_fn"], r, n))
            for r in rows
        )
        # distributed NS on the ranks' own column blocks: (Gram side, other side); a Shard(1)
        # matrix is split by columns already, a Shard(0) one by the columns of its transpose
        form = None
        if distributed and _splittable(p, layout, process_group, blocks):
            form = (rows_of_p, cols_of_p) if layout.transposed else (cols_of_p, rows_of_p)
        if form is not None:  # distributed NS on the ranks' own column blocks
            count, m, n = 1, *form
            config = _ns_config(group, form, p.device.type, self._symmetric_for(form))
        # the exchange of Shard(1) rows and the column blocks of Shard(0) see the transpose
        transpose = layout.transposed != (form is not None)
        local = _local(p)
        label = self._group_label(group)
        local_input = partial(_transposed, inputs[id(p)]) if transpose else inputs[id(p)]

        def apply(update: Tensor) -> None:
            update = (update.mT if transpose else update).reshape(local.shape)
            ratio = 1.0 if blocks else adjusted_lr_ratio(group["adjust_lr_fn"], rows_of_p, cols_of_p)
            squares = self._update_squares.setdefault(label, [torch.zeros((), device=local.device), 0])
            squares[0] += update.float().square().sum() * ratio**2  # a device tensor: no sync
            squares[1] += update.numel()
            if self._kernels is not None:
                hyper = (_scalar(group["lr"], local.device), _scalar(group["weight_decay"], local.device))
                self._kernels.apply_update(local, update, *hyper, ratio)
                return
            lr = float(group["lr"])
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(update.to(local.dtype), alpha=-lr * ratio)

        gather_whole = local_piece = None
        if layout.gathered and form is None:
            mesh, placements = p.device_mesh, p.placements
            gather_whole = partial(_gather_whole, local_input, mesh, placements, p.shape, p.stride())
            local_piece = partial(_piece_of, mesh=mesh, placements=placements)
        local_shape = tuple(local.mT.shape if transpose else local.shape)
        return MatrixWork(name, local_input, apply, local_shape, local.dtype, layout, process_group,
                          count, m, n, config, blocks, gather_whole, local_piece, form is not None)

    def _symmetric_for(self, shape: tuple[int, int]) -> str:
        """The symmetric-product kernel for an m×n Newton–Schulz: the option, or with "auto" the
        one measured faster for that shape (torch's for shapes not measured)."""
        if self._symmetric != "auto":
            return self._symmetric
        return self._symmetric_by_shape.get(tuple(shape), "torch")

    def _measure_symmetric_products(self) -> dict[tuple[int, int], str]:
        """``symmetric_products="auto"``: time Newton–Schulz of each distinct matrix shape with
        torch's products and with the Triton kernel (where Triton runs), and keep the faster.
        Under torch.distributed the ranks add up their timings (one all_gather_object), so that
        every rank makes the same choice: distributed NS needs the same recurrence everywhere."""
        device = self._collective_device()
        seconds: dict[tuple[int, int], dict[str, float]] = {}
        if triton_usable(device):
            from dmuon.throughput import symmetric_products_seconds  # measuring sits above the optimizer

            for _, p, group, view in self._muon_params():
                _, m, n = matrix_shape(p.shape, view)
                if (m, n) not in seconds:
                    config = _ns_config(group, (m, n), device.type)
                    seconds[m, n] = symmetric_products_seconds(config, (1, m, n), device)
        group = self._agreement_group()
        if group is not None:
            everyone: list[dict] = [{} for _ in range(dist.get_world_size(group))]
            dist.all_gather_object(everyone, seconds, group=group)
            seconds = {shape: {kind: sum(rank.get(shape, {}).get(kind, math.inf) for rank in everyone)
                               for kind in SYMMETRIC_PRODUCTS} for shape in everyone[0]}
        return {shape: min(times, key=times.get) for shape, times in seconds.items()}

    def _owner_shardings(self) -> list:
        """The owner shardings (:mod:`dmuon.owner`) of this optimizer's parameters."""
        found = {}
        for _, p, _, _ in self._muon_params():
            owned = owned_by(p)
            if owned is not None:
                found.setdefault(id(owned.sharding), owned.sharding)
        return list(found.values())

    @property
    def plans(self) -> list[Plan]:
        """The plan of each exchange group (usually one): owners, buckets, bytes; see Plan.table()."""
        entries = [e for e in self._muon_params() if _steps_here(e[1])]
        # a plan needs shapes and layouts only: no inputs are computed
        return self._engine.plans_for(self._works(entries, dict.fromkeys(id(p) for _, p, _, _ in entries)))

    @property
    def plan(self) -> Plan:
        """The plan, when all Muon parameters share one exchange group (the usual case)."""
        plans = self.plans
        if len(plans) != 1:
            raise ValueError(f"The Muon parameters span {len(plans)} exchange groups; use .plans.")
        return plans[0]

    @property
    def last_step_stats(self) -> StepStats:
        """This rank's matrices orthogonalized, NS FLOPs and seconds, bytes sent and collectives,
        last step."""
        return self._engine.stats

    def _group_label(self, group: dict[str, Any]) -> str:
        return str(group.get("name") or next(i for i, g in enumerate(self.param_groups) if g is group))

    def statistics(self, all_ranks: bool = False) -> dict[str, float]:
        """The last step in numbers, for logging (flat keys, float values):

        ``muon/update_rms/<group>`` — RMS of the Muon update before the lr (rms(O)·r(m, n); at
        most about 0.2 with ``match_rms_adamw``, less for low-rank gradients), ``lr/<group>``, ``ns_seconds``, ``ns_gflop``,
        ``matrices``, ``bytes_sent``, ``collectives``, ``skipped_steps``. ``<group>`` is the
        group's ``"name"`` or its index in ``param_groups``.

        This rank's own figures by default, with no collective (on CUDA, reading them waits for
        the step's kernels). ``all_ranks=True`` (collective: every rank must call it) makes them
        the job's: update RMS over whole matrices, sums of the counts, the slowest rank's
        ``ns_seconds``.
        """
        stats = self._engine.stats
        labels = [self._group_label(g) for g in self.param_groups if g["algorithm"] == "muon"]
        squares = [self._update_squares.get(label, [torch.zeros(()), 0]) for label in labels]
        sums = torch.tensor([float(sq) for sq, _ in squares] + [n for _, n in squares], dtype=torch.float64)
        counts = torch.tensor([stats.matrices_orthogonalized, stats.ns_flops, stats.bytes_sent, stats.collectives],
                              dtype=torch.float64)
        seconds = torch.tensor([stats.ns_seconds], dtype=torch.float64)
        group = self._agreement_group()
        if all_ranks and group is not None:
            sums, counts, seconds = (t.to(self._collective_device()) for t in (sums, counts, seconds))
            all_reduce_sum(sums, group)
            all_reduce_sum(counts, group)
            all_reduce_max(seconds, group)
        out = {}
        for i, label in enumerate(labels):
            numel = sums[len(labels) + i].item()
            out[f"muon/update_rms/{label}"] = math.sqrt(sums[i].item() / numel) if numel else 0.0
        for group_ in self.param_groups:
            out[f"lr/{self._group_label(group_)}"] = float(group_["lr"])
        matrices, flops, sent, collectives = counts.tolist()
        out.update(ns_seconds=seconds.item(), ns_gflop=flops / 1e9, matrices=matrices, bytes_sent=sent,
                   collectives=collectives, skipped_steps=float(self.skipped_steps))
        return out

    def _check_ranks_agree(self) -> None:
        """Raise on every rank if ranks were given different configurations (one collective).

        Muon groups must match exactly — their matrices take part in collectives. AdamW groups
        are element-wise and local, so only their hyperparameters must match: a rank may hold
        AdamW parameters that others lack (or none at all).
        """
        fingerprint = {"options": repr(self._engine_options)}
        for g, group in enumerate(self.param_groups):
            for key, value in group.items():
                if key not in ("params", "initial_lr", "param_names"):
                    fingerprint[f"param group {g} {key}"] = repr(value)
            if group["algorithm"] == "muon":
                fingerprint[f"param group {g} names"] = repr(group.get("param_names"))
                fingerprint[f"param group {g} shapes"] = repr([tuple(p.shape) for p in group["params"]])
        check_ranks_agree(fingerprint, self._process_group or dist.group.WORLD, "optimizer configuration")

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._engine.start_step()
        self._update_squares = {}
        shardings = self._owner_shardings()
        for sharding in shardings:
            sharding.wait_for_gradients()
        stepped = self._agree_on_gradients()
        if stepped is None:
            return loss
        for sharding in shardings:
            sharding.weights_changed()
        for _, p, _, _ in self._muon_params():
            if not _steps_here(p):
                # An empty entry on the ranks that do not own p: every rank's optimizer state
                # then names every parameter, as torch.distributed.checkpoint requires to load.
                self.state[p]
        inputs = {}
        for group in self.param_groups:
            if group["algorithm"] == "muon":
                inputs.update(self._momentum(group, stepped))
            else:
                self._adamw(group)
        entries = [e for e in self._muon_params() if id(e[1]) in inputs]
        self._engine.run(self._works(entries, inputs))
        return loss

    def _agree_on_gradients(self) -> set[int] | None:
        """The ids of the Muon parameters to step, or None to skip the whole step.

        Under torch.distributed every rank must take the same decisions (or the collectives
        would not match), so the flags are combined with one all-reduce first: the step is
        skipped if any rank saw a non-finite gradient, and a Muon parameter is stepped only if
        every rank has its gradient. The flags stay on the device until that all-reduce: reading
        its result is the step's one host synchronization (on CUDA; none follows).
        """
        muon = [(name, p) for name, p, _, _ in self._muon_params()]
        device = self._collective_device()
        flags: list[tuple[str, Tensor]] = []  # (name, finite?) as device tensors: no host sync
        if self.defaults["nonfinite_grads"] != "ignore":
            for g, group in enumerate(self.param_groups):
                names = group.get("param_names") or [f"group {g} param {i}" for i in range(len(group["params"]))]
                flags.extend((n, all_finite(_local(p.grad))) for n, p in zip(names, group["params"])
                             if p.grad is not None and _steps_here(p))
        # an owner-sharded parameter's gradient is its owner's business alone: others report none missing
        no_grad = torch.tensor([float(p.grad is None and _steps_here(p)) for _, p in muon])
        if device.type == "cuda":  # from pinned memory the copy does not wait for the step's kernels
            no_grad = no_grad.pin_memory().to(device, non_blocking=True)
        bad = torch.stack([~f for _, f in flags]).any().reshape(1) if flags else torch.zeros(1, dtype=torch.bool)
        local = torch.cat([bad.to(device=device, dtype=torch.float32), no_grad.to(device)])
        agreed = all_reduce_max(local, self._agreement_group(), self._engine.counter).tolist()  # the one host read
        if agreed[0] > 0:
            where = [n for n, f in flags if not f] or ["another rank's parameters"]
            if self.defaults["nonfinite_grads"] == "raise":
                raise FloatingPointError(f"Non-finite gradients in {where}.")
            self.skipped_steps += 1
            warnings.warn(f"Muon skipped a step: non-finite gradients in {where}.", stacklevel=3)
            return None
        partial = [name for (name, p), missing in zip(muon, agreed[1:])
                   if missing and p.grad is not None and _steps_here(p)]
        if partial:
            warnings.warn(f"Muon left {partial} alone: some ranks have no gradient for them.", stacklevel=3)
        return {id(p) for (_, p), missing in zip(muon, agreed[1:]) if not missing and _steps_here(p)}

    def _collective_device(self) -> torch.device:
        """Where the optimizer's small collectives run: the parameters' device (NCCL groups take
        only CUDA tensors)."""
        return next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))

    def _agreement_group(self) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return self._process_group or dist.group.WORLD

    def _params_with_grad(self, group: dict[str, Any]) -> list[Tensor]:
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients.")
        return params

    def _momentum(self, group: dict[str, Any], stepped: set[int]) -> dict[int, Callable[[], Tensor]]:
        """Update the momentum of the group's parameters; return functions computing their NS
        inputs (local pieces), called only where and when the exchange needs them."""
        momentum, nesterov = group["momentum"], group["nesterov"]
        inputs = {}
        for p in self._params_with_grad(group):
            if id(p) not in stepped:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf, grad = _local(state["momentum_buffer"]), _local(p.grad)
            if self._kernels is not None:
                mu = _scalar(momentum, buf.device)
                self._kernels.update_momentum(buf, grad, mu)
                inputs[id(p)] = partial(self._kernels.nesterov_input, grad, buf, mu) if nesterov else partial(torch.Tensor.view_as, buf, buf)
                continue
            buf.lerp_(grad, 1 - momentum)
            inputs[id(p)] = partial(torch.lerp, grad, buf, momentum) if nesterov else partial(torch.Tensor.view_as, buf, buf)
        return inputs

    def _adamw(self, group: dict[str, Any]) -> None:
        params = self._params_with_grad(group)
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not params:
            return
        beta1, beta2 = group["betas"]
        adamw_update(
            params, [p.grad for p in params],
            [self.state[p]["exp_avg"] for p in params],
            [self.state[p]["exp_avg_sq"] for p in params],
            [], [self.state[p]["step"] for p in params],
            amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
        )
