"""``dmuon.Muon``: Muon for hidden matrices and AdamW for the rest, in one ``torch.optim.Optimizer``."""

from __future__ import annotations

import copy
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adamw import adamw as adamw_update

from dmuon.agreement import agree, digest_words
from dmuon.cuda_graphs import GraphedOrthogonalize
from dmuon.engine import Block, MatrixWork, Orthogonalizer, StepStats, unit_of
from dmuon.exchange import all_gather_object, all_reduce_max, all_reduce_sum, default_device
from dmuon.layout import detect_layout, owned_by
from dmuon.orthogonalization import (
    NORMALIZATION_EPS, SYMMETRIC_PRODUCTS, NSConfig, gram_all_reduces, newton_schulz_flops, orthogonalize,
    resolve_config,
)
from dmuon.planner import (
    DEFAULT_BUCKET_BYTES, Plan, choose_distributed, choose_gangs, distributed_cost, gang_costs,
    split_replicas_is_cheaper,
)
from dmuon.routing import ALGORITHMS, MATRIX_VIEWS, Route, block_rows, default_route, matrix_shape, module_roles
from dmuon.triton_kernels import triton_usable

ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
NONFINITE_POLICIES = ("skip", "raise", "ignore")

# The state of a parameter, by algorithm.
_STATE_KEYS = {"muon": ("momentum_buffer",), "adamw": ("step", "exp_avg", "exp_avg_sq")}

MUON_KEYS = (
    "lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
    "adjust_lr_fn", "ns_method", "ns_dtype", "ns_restarts", "ns_blocks",
)
# AdamW's options as a param group stores them; None for lr and weight decay: the group's own.
ADAMW_GROUP_KEYS = ("adamw_lr", "adamw_weight_decay", "adamw_betas", "adamw_eps")
# Per-parameter routing, stored in each group: lists parallel to "params".
ROUTING_KEYS = ("algorithms", "matrix_views", "route_reasons")
# Keys a user's param group may carry besides hyperparameters ("betas": AdamW's, by its torch name).
_USER_KEYS = frozenset({"params", "param_names", "algorithm", "matrix_view", "name", "initial_lr", "betas"})
# What every stored group must have (checked when a state dict is loaded).
GROUP_KEYS = (*MUON_KEYS, *ADAMW_GROUP_KEYS, *ROUTING_KEYS, "algorithm", "base_lr")


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def _adamw_options(group: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """AdamW's options of a user's group, as stored: the group's ``adamw_*`` keys first, then
    (lr, weight decay, betas; eps only in an ``"algorithm": "adamw"`` group) its plain keys, then
    the constructor's. ``adamw_lr``/``adamw_weight_decay`` None mean "the group's lr / weight decay"."""
    explicit = group.get("algorithm") == "adamw"
    plain_lr = "lr" in group
    plain_wd = "weight_decay" in group
    return {
        "adamw_lr": _first(group.get("adamw_lr"), None if plain_lr else defaults["adamw_lr"]),
        "adamw_weight_decay": _first(group.get("adamw_weight_decay"),
                                     None if plain_wd else defaults["adamw_weight_decay"]),
        "adamw_betas": tuple(_first(group.get("adamw_betas"), group.get("betas"), defaults["adamw_betas"])),
        "adamw_eps": _first(group.get("adamw_eps"), group.get("eps") if explicit else None, defaults["adamw_eps"]),
    }


def adamw_hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """The lr, weight decay, betas and eps AdamW applies to a group's AdamW parameters now.

    An explicit ``adamw_lr`` follows the group's lr as schedulers change it: it is scaled by
    lr / ``base_lr``, the group's lr when the group was added."""
    lr = group["lr"]
    if group["adamw_lr"] is not None:
        base = float(group["base_lr"])
        lr = group["adamw_lr"] * float(lr) / base if base > 0 else group["adamw_lr"]
    return {
        "lr": lr,
        "weight_decay": _first(group["adamw_weight_decay"], group["weight_decay"]),
        "betas": group["adamw_betas"],
        "eps": group["adamw_eps"],
    }


@dataclass(frozen=True)
class EngineOptions:
    """The constructor's options that shape the distributed step (the same on every rank)."""

    comm_dtype: torch.dtype | None
    bucket_bytes: int
    replica_split: bool | None
    distributed_ns: bool | None
    symmetric_products: str
    compile: bool | str | Callable
    cuda_graphs: bool

    def validate(self) -> None:
        comm_dtype, bucket_bytes = self.comm_dtype, self.bucket_bytes
        if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point):
            raise ValueError(f"Invalid {comm_dtype=}. Must be a floating torch.dtype or None.")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"Invalid {bucket_bytes=}. Must be a positive int.")
        for name in ("replica_split", "distributed_ns"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}. Must be None (cost model), True or False.")
        if self.symmetric_products not in (*SYMMETRIC_PRODUCTS, "auto"):
            raise ValueError(f"Invalid symmetric_products={self.symmetric_products!r}. "
                             f"Must be one of {(*SYMMETRIC_PRODUCTS, 'auto')}.")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"Invalid cuda_graphs={self.cuda_graphs!r}. Must be a bool.")
        if not (isinstance(self.compile, (bool, str)) or callable(self.compile)):
            raise ValueError(f"Invalid compile={self.compile!r}. Must be a bool, or a torch.compile backend "
                             "(name or callable).")

    def describe(self) -> str:
        """As the ranks compare it: a compile backend by its name, not its address."""
        backend = self.compile if isinstance(self.compile, (bool, str)) else getattr(self.compile, "__name__", "callable")
        return repr((self.comm_dtype, self.bucket_bytes, self.replica_split, self.distributed_ns,
                     self.symmetric_products, backend, self.cuda_graphs))


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
    if isinstance(number, bool) or not isinstance(number, (int, float)):
        raise ValueError(f"Invalid {name}={value!r}{where}. Must be a number.")
    if not math.isfinite(number):
        raise ValueError(f"Invalid {name}={value!r}{where}. Must be finite.")
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
    """Raise a ValueError naming the first bad AdamW hyperparameter of a stored group."""
    for key in ("adamw_lr", "adamw_weight_decay"):
        if group[key] is not None:
            _check_range(key, group[key], where, 0.0)
    _check_range("adamw_eps", group["adamw_eps"], where, 0.0, low_open=True)
    betas = group["adamw_betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid adamw_betas={betas!r}{where}. Must be a pair.")
    for i, beta in enumerate(betas):
        _check_range(f"adamw_betas[{i}]", beta, where, 0.0, 1.0)


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
        self._process_group = process_group  # first: a failure below is shared with the other ranks
        error = None
        try:
            self._build(params, dict(
                lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                ns_method=ns_method, ns_dtype=ns_dtype, ns_restarts=ns_restarts, ns_blocks=ns_blocks,
                adamw_betas=adamw_betas, adamw_eps=adamw_eps, adamw_lr=adamw_lr,
                adamw_weight_decay=adamw_weight_decay, nonfinite_grads=nonfinite_grads,
            ), EngineOptions(comm_dtype, bucket_bytes, replica_split, distributed_ns, symmetric_products,
                             compile, cuda_graphs))
        except (ValueError, TypeError, NotImplementedError) as err:
            error = err
        group = self._agreement_group()
        fingerprint = []
        if group is not None:  # every rank learns of a failure on any rank, and raises too
            fingerprint = self._fingerprint(self.param_groups) if error is None else []
            agree("construction", fingerprint, group, self._collective_device(), error=error)
        # from here on add_param_group is collective; the step's agreement carries this digest
        self._fingerprint_words = digest_words(fingerprint)
        if error is not None:
            raise error
        if symmetric_products == "auto":  # a collective: after the ranks agree on the options
            self._symmetric_by_shape = self._measure_symmetric_products()

    def _build(self, params: nn.Module | Iterable[Any], defaults: dict[str, Any], options: EngineOptions) -> None:
        """Everything the constructor does before the ranks compare notes (purely local)."""
        options.validate()
        if defaults["nonfinite_grads"] not in NONFINITE_POLICIES:
            raise ValueError(f"Invalid nonfinite_grads={defaults['nonfinite_grads']!r}. Must be one of {NONFINITE_POLICIES}.")
        validate_muon_group(defaults)
        validate_adamw_group(_adamw_options({}, defaults))
        if isinstance(params, (set, Tensor)):
            raise TypeError(f"params must be a module, or an ordered iterable of tensors or dicts, not a {type(params).__name__}.")
        self._module_roles: dict[int, str] = {}
        self._model: Callable[[], nn.Module | None] = lambda: None
        if isinstance(params, nn.Module):
            self._module_roles = module_roles(params)
            self._model = weakref.ref(params)  # add_param_group looks up the names of new parameters
            params = list(params.named_parameters())
        self.skipped_steps = 0
        self._update_squares: dict[str, list] = {}  # group label -> [sum of squares, elements], last step
        self._options = options
        self._split_decisions: dict[tuple, bool] = {}
        self._distribution_decisions: dict[tuple, frozenset[int]] = {}
        self._gang_decisions: dict[tuple, dict[int, tuple[int, ...]]] = {}
        self._symmetric_by_shape: dict[tuple[int, int], str] = {}  # "auto": measured at construction
        self._make_engine()
        super().__init__(params, defaults)
        self._module_roles = {}  # used for routing at construction only; params may be swapped later
        self._warn_if_routed_by_shape_only()
        self.plans  # detects every layout now: an unsupported one raises before any collective

    def _make_engine(self) -> None:
        """The compiled kernels and the engine, from the options (again after a deep copy or unpickling)."""
        compile = self._options.compile
        self._kernels = compile_kernels("inductor" if compile is True else compile) if compile else None
        ns = self._kernels.orthogonalize if self._kernels else orthogonalize
        self._engine = Orthogonalizer(self._options.bucket_bytes, self._options.comm_dtype,
                                      orthogonalize_fn=GraphedOrthogonalize(ns) if self._options.cuda_graphs else ns)

    @property
    def _replica_split(self) -> bool | None:
        return self._options.replica_split

    @property
    def _distributed_ns(self) -> bool | None:
        return self._options.distributed_ns

    @property
    def _symmetric(self) -> str:
        return self._options.symmetric_products

    # ------------------------------------------------------------------ groups and routing

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add one group (collective under torch.distributed: every rank calls it, with the same
        Muon parameters and options, and the ranks compare them before anything changes).

        The group stays one group: each parameter in it is routed to Muon or AdamW
        (:meth:`routing_summary`), unless its ``"algorithm"`` key sends all of them to one."""
        if not hasattr(self, "_fingerprint_words"):  # from torch.optim.Optimizer.__init__: agreed after
            self._add_group(param_group)
            return
        group = self._agreement_group()
        error = None
        before = len(self.param_groups)
        try:
            self._add_group(param_group)
            fingerprint = self._fingerprint(self.param_groups)
        except (ValueError, TypeError, NotImplementedError) as err:
            error, fingerprint = err, []
        if group is not None:
            try:  # as many elements as step's agreement: a rank alone in here cannot hang the others
                flags = torch.zeros(1 + self._muon_count(self.param_groups[:before]))
                agree("add_param_group", fingerprint, group, self._collective_device(), payload=flags, error=error)
            except BaseException:
                del self.param_groups[before:]
                raise
            self._fingerprint_words = digest_words(fingerprint)
        if error is not None:
            del self.param_groups[before:]
            raise error

    def _add_group(self, param_group: dict[str, Any]) -> None:
        where = f" in param group {len(self.param_groups)}"
        if not isinstance(param_group, dict):
            raise TypeError(f"A param group must be a dict, got {type(param_group).__name__}{where}.")
        unknown = set(param_group) - _USER_KEYS - set(MUON_KEYS) - set(ADAMW_GROUP_KEYS)
        if unknown:
            raise ValueError(f"Unknown option(s) {sorted(unknown)}{where}.")
        algorithm = param_group.get("algorithm")
        if algorithm is not None and algorithm not in ALGORITHMS:
            raise ValueError(f"Invalid algorithm={algorithm!r}{where}. Must be one of {ALGORITHMS}.")
        view_override = param_group.get("matrix_view")
        if view_override is not None and view_override not in MATRIX_VIEWS:
            raise ValueError(f"Invalid matrix_view={view_override!r}{where}. Must be one of {MATRIX_VIEWS}.")

        entries = self._named_entries(param_group, where)
        group = {k: v for k, v in param_group.items() if k in ("name", "initial_lr") or k in MUON_KEYS}
        for key in MUON_KEYS:
            group.setdefault(key, self.defaults[key])
        group["ns_dtype"] = dtype_name(group["ns_dtype"], where)
        if not isinstance(group["ns_blocks"], (int, type(None))):
            group["ns_blocks"] = list(group["ns_blocks"])  # plain values: DCP state dicts take them
        group.update(_adamw_options(param_group, self.defaults), algorithm=algorithm, base_lr=float(group["lr"]))
        routes = [self._route(name, param, index, algorithm, view_override, group, where)
                  for index, (name, param) in enumerate(entries)]
        group["algorithms"] = [r.algorithm for r in routes]
        group["matrix_views"] = [r.matrix_view for r in routes]
        group["route_reasons"] = [r.reason for r in routes]
        if "muon" in group["algorithms"]:
            validate_muon_group(group, where)
        validate_adamw_group(group, where)
        named = any(name is not None for name, _ in entries)
        group["params"] = [(n, p) for n, p in entries] if named else [p for _, p in entries]
        if named and not entries:  # torch tells named groups by their first entry
            group["param_names"] = []
        # torch's add_param_group would copy the constructor's defaults into the group, including
        # the adamw_* aliases and nonfinite_grads; every key is filled here already.
        defaults, self.defaults = self.defaults, {}
        try:
            super().add_param_group(group)
        finally:
            self.defaults = defaults

    def _route(self, name: str | None, param: Tensor, index: int, algorithm: str | None, view_override: str | None,
               group: dict[str, Any], where: str) -> Route:
        """Where one parameter of a group goes: the group's ``algorithm``, else the default rule."""
        label = name or f"parameter {index}"
        if param.is_complex():
            raise ValueError(f"Muon does not support complex parameters: {label}{where}.")
        route = default_route(param, name, self._module_roles.get(id(param)))
        if algorithm is not None:
            view = route.matrix_view if algorithm == route.algorithm else "auto"
            route = Route(algorithm, view, f"the group's algorithm={algorithm!r}")
        if view_override is not None:
            route = replace(route, matrix_view=view_override, reason=f"{route.reason}; matrix_view={view_override!r}")
        if route.algorithm == "muon":
            try:
                _, m, _ = matrix_shape(param.shape, route.matrix_view)
            except ValueError as err:
                raise ValueError(f"{label}{where}: {err} Put it in an 'adamw' group.") from None
            try:
                block_rows(group["ns_blocks"], m)
            except ValueError as err:
                raise ValueError(f"{err} ({label}{where})") from None
        return route

    def _named_entries(self, param_group: dict[str, Any], where: str) -> list[tuple[str | None, Tensor]]:
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = [params]
        elif isinstance(params, set):
            raise TypeError(f"Parameters must be an ordered collection (a list), not a set{where}.")
        params = list(params)
        pairs = [isinstance(item, tuple) for item in params]
        if any(pairs) and not all(pairs):
            raise TypeError(f"Parameters{where} mix (name, tensor) pairs and bare tensors: give all of them "
                            "names or none.")
        names = param_group.get("param_names")
        if names is not None and len(names) != len(params):
            raise ValueError(f"param_names{where} has {len(names)} names for {len(params)} parameters.")
        entries = []
        for i, item in enumerate(params):
            name, tensor = item if isinstance(item, tuple) else (names[i] if names else None, item)
            if not isinstance(tensor, Tensor):
                raise TypeError(f"Muon can only optimize Tensors, but got {type(tensor).__name__}{where}.")
            entries.append((name, tensor))
        if entries and not any(pairs) and names is None and self._names_required():
            entries = self._names_from_model(entries, where)
        return entries

    def _names_required(self) -> bool:
        """Whether the groups so far are named (torch requires all groups named, or none)."""
        return bool(getattr(self, "param_groups", None)) and "param_names" in self.param_groups[0]

    def _names_from_model(self, entries: list[tuple[str | None, Tensor]], where: str) -> list[tuple[str, Tensor]]:
        """Bare tensors added to an optimizer whose groups are named: their names in the model the
        optimizer was built from."""
        model = self._model()
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        missing = [i for i, (_, p) in enumerate(entries) if id(p) not in names]
        if missing:
            raise TypeError(
                f"The optimizer's param groups are named, but parameter {missing[0]}{where} is a bare tensor"
                + (" that is not in the model it was built from" if model is not None else "")
                + ": pass (name, tensor) pairs, e.g. {'params': list(module.named_parameters())}."
            )
        return [(names[id(p)], p) for _, p in entries]

    def _warn_if_routed_by_shape_only(self) -> None:
        """Without names or a module, routing cannot tell an embedding or a head from a hidden matrix."""
        blind = [p for g in self.param_groups if g["algorithm"] is None and "param_names" not in g
                 for p, alg in zip(g["params"], g["algorithms"]) if alg == "muon"]
        if blind:
            warnings.warn(
                f"dmuon.Muon routed {len(blind)} {'matrix' if len(blind) == 1 else 'matrices'} to Muon by shape alone: without names or modules it "
                "cannot tell embeddings and output heads (which should get AdamW) from hidden matrices. Pass the "
                "model (dmuon.Muon(model, ...)) or model.named_parameters(), or put those matrices in a group with "
                "\"algorithm\": \"muon\" (and the rest in one with \"algorithm\": \"adamw\").",
                stacklevel=4,
            )

    def routes(self) -> dict[str, Route]:
        """Each parameter's route (algorithm, matrix view, reason), by name; an unnamed one is
        ``"group{g}.param{i}"``."""
        out = {}
        for g, group in enumerate(self.param_groups):
            names = group.get("param_names") or [f"group{g}.param{i}" for i in range(len(group["params"]))]
            out.update((name, Route(*route)) for name, *route
                       in zip(names, group["algorithms"], group["matrix_views"], group["route_reasons"]))
        return out

    def routing_summary(self) -> str:
        """A table: every parameter, its shape, the algorithm, the matrices Muon sees, and why."""
        rows = [("group", "parameter", "shape", "algorithm", "matrices", "why")]
        for g, group in enumerate(self.param_groups):
            names = group.get("param_names") or [f"#{i}" for i in range(len(group["params"]))]
            for i, (name, p) in enumerate(zip(names, group["params"])):
                algorithm = group["algorithms"][i]
                if algorithm == "muon":
                    count, m, n = matrix_shape(p.shape, group["matrix_views"][i])
                    matrices = f"{count} x {m}x{n}"
                else:
                    matrices = "-"
                rows.append((str(g), name, "x".join(map(str, p.shape)), algorithm, matrices,
                             group["route_reasons"][i]))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)

    def __repr__(self) -> str:
        counts = {alg: sum(g["algorithms"].count(alg) for g in self.param_groups) for alg in ALGORITHMS}
        return (
            f"{type(self).__name__}(muon: {counts['muon']} params, adamw: {counts['adamw']} params, "
            f"groups: {len(self.param_groups)})\n{self.routing_summary()}"
        )

    # ------------------------------------------------------------------ distribution

    def _muon_params(self) -> list[tuple[str, Tensor, dict[str, Any], str]]:
        """(name, param, group, matrix view) of every Muon parameter, in group order."""
        out = []
        for g, group in enumerate(self.param_groups):
            names = group.get("param_names") or [f"group{g}.param{i}" for i in range(len(group["params"]))]
            out.extend((name, p, group, view) for name, p, alg, view
                       in zip(names, group["params"], group["algorithms"], group["matrix_views"]) if alg == "muon")
        return out

    @staticmethod
    def _muon_count(groups: Sequence[dict[str, Any]]) -> int:
        return sum(g["algorithms"].count("muon") for g in groups)

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
        Under torch.distributed the ranks add up their timings (gathered as bytes), so that every
        rank makes the same choice: distributed NS needs the same recurrence everywhere."""
        device = self._collective_device()
        seconds: dict[tuple[int, int], dict[str, float]] = {}
        if triton_usable(device):
            from dmuon.timing import symmetric_products_seconds  # imported only when measuring

            for _, p, group, view in self._muon_params():
                _, m, n = matrix_shape(p.shape, view)
                if (m, n) not in seconds:
                    config = _ns_config(group, (m, n), device.type)
                    seconds[m, n] = symmetric_products_seconds(config, (1, m, n), device)
        group = self._agreement_group()
        if group is not None:
            everyone: list[dict] = all_gather_object(seconds, group, device)
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
        labels = [self._group_label(g) for g in self.param_groups if "muon" in g["algorithms"]]
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

    def _fingerprint(self, groups: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
        """What the ranks must agree on, as ordered (what, value) pairs: every option that shapes
        the step's collectives, every group's hyperparameters, and every Muon parameter (its name,
        shape and matrix view) — their matrices take part in collectives. AdamW is element-wise
        and local, so a rank may hold AdamW parameters that others lack.

        Unnamed parameters can only be matched by position: where they are replicas (plain
        tensors under DDP) a checksum of their values tells two same-shape matrices apart, so
        that a different order on some rank is caught."""
        out = [("options", self._options.describe()),
               ("nonfinite_grads", repr(self.defaults["nonfinite_grads"])),
               ("number of param groups", str(len(groups)))]
        for g, group in enumerate(groups):
            for key in (*MUON_KEYS, *ADAMW_GROUP_KEYS, "algorithm", "name"):
                value = group.get(key)
                out.append((f"param group {g}'s {key}", repr(float(value) if isinstance(value, Tensor) else value)))
            names = group.get("param_names")
            muon = [i for i, alg in enumerate(group["algorithms"]) if alg == "muon"]
            for j, i in enumerate(muon):
                p, view = group["params"][i], group["matrix_views"][i]
                shape = tuple(p.shape)
                if names:
                    what = f"{names[i]!r} of shape {shape}"
                elif isinstance(p, DTensor) or owned_by(p) is not None:
                    what = f"an unnamed {shape} matrix"
                else:
                    what = (f"an unnamed {shape} matrix with values summing to {p.detach().double().sum().item()!r} "
                            "(unnamed replicas are matched by position and values; pass names to match by name)")
                what += "" if view == "auto" else f" seen as {view!r}"
                key = f"param group {g}'s Muon parameter {j}"
                out.append((key, what))
        return out

    # ------------------------------------------------------------------ state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (collective under torch.distributed, as construction is).

        Checked before anything changes, naming the offending group or parameter: the groups'
        keys and routing, and every state tensor's shape against its parameter's; then the ranks
        compare the configuration the state would give them."""
        error = None
        try:
            self._check_loadable(state_dict)
            loaded = [{**saved, "params": mine["params"], **({"param_names": mine["param_names"]}
                                                              if "param_names" in mine else {})}
                      for saved, mine in zip(state_dict["param_groups"], self.param_groups)]
            fingerprint = self._fingerprint(loaded)
        except (ValueError, TypeError, KeyError) as err:
            error, fingerprint = err, []
        group = self._agreement_group()
        if group is not None:
            flags = torch.zeros(1 + self._muon_count(self.param_groups))
            agree("load_state_dict", fingerprint, group, self._collective_device(), payload=flags, error=error)
        if error is not None:
            raise error
        super().load_state_dict(state_dict)
        self._fingerprint_words = digest_words(fingerprint)
        self._split_decisions, self._distribution_decisions, self._gang_decisions = {}, {}, {}

    def _check_loadable(self, state_dict: dict[str, Any]) -> None:
        groups, state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, list) or not isinstance(state, dict):
            raise ValueError("Invalid state dict: it needs 'state' (a dict) and 'param_groups' (a list).")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"The state dict has {len(groups)} param groups, this optimizer {len(self.param_groups)}.")
        for g, (saved, mine) in enumerate(zip(groups, self.param_groups)):
            missing = [k for k in GROUP_KEYS if k not in saved]
            if missing:
                raise ValueError(f"Param group {g} of the state dict lacks {missing} (a dmuon.Muon state dict "
                                 "of another version or optimizer?).")
            if len(saved["params"]) != len(mine["params"]):
                raise ValueError(f"Param group {g} of the state dict has {len(saved['params'])} parameters, "
                                 f"this optimizer's {len(mine['params'])}.")
            names = mine.get("param_names") or [f"group {g} param {i}" for i in range(len(mine["params"]))]
            for i, (key, p) in enumerate(zip(saved["params"], mine["params"])):
                if saved["algorithms"][i] != mine["algorithms"][i]:
                    raise ValueError(f"Parameter {names[i]!r} is routed to {mine['algorithms'][i]} here but to "
                                     f"{saved['algorithms'][i]} in the state dict.")
                entry = state.get(key, {})
                needed = _STATE_KEYS[mine["algorithms"][i]] if entry else ()
                for name in needed:
                    value = entry.get(name)
                    if not isinstance(value, Tensor):
                        raise ValueError(f"The state of parameter {names[i]!r} lacks {name!r}.")
                    if name != "step" and tuple(value.shape) != tuple(p.shape):
                        raise ValueError(f"The state of parameter {names[i]!r} has {name} of shape "
                                         f"{tuple(value.shape)}; the parameter's shape is {tuple(p.shape)}.")

    def __getstate__(self) -> dict[str, Any]:
        """All of the optimizer but its engine and compiled kernels, which are rebuilt from the
        options (a deep copy or an unpickled optimizer can step)."""
        state = {k: v for k, v in self.__dict__.items() if k not in ("_engine", "_kernels", "_model")}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._model = lambda: None
        self._make_engine()

    def __deepcopy__(self, memo: dict[int, Any]) -> Muon:
        if self._process_group is not None:  # a process group is shared, not copied
            memo[id(self._process_group)] = self._process_group
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
        return copied

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
            inputs.update(self._momentum(group, stepped))
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
        named = [(group.get("param_names") or [f"group {g} param {i}" for i in range(len(group["params"]))], group)
                 for g, group in enumerate(self.param_groups)]
        sparse = next((n for names, group in named for n, p in zip(names, group["params"])
                       if p.grad is not None and p.grad.is_sparse), None)
        error = None
        if sparse is not None:  # before any reduction (none runs on sparse tensors), shared with the other ranks
            error = RuntimeError(f"Muon does not support sparse gradients: {sparse!r} has one. Use dense gradients "
                                 "(e.g. nn.Embedding(..., sparse=False)).")
        elif self.defaults["nonfinite_grads"] != "ignore":
            for names, group in named:
                flags.extend((n, all_finite(_local(p.grad))) for n, p in zip(names, group["params"])
                             if p.grad is not None and _steps_here(p))
        # an owner-sharded parameter's gradient is its owner's business alone: others report none missing
        no_grad = torch.tensor([float(p.grad is None and _steps_here(p)) for _, p in muon])
        if device.type == "cuda":  # from pinned memory the copy does not wait for the step's kernels
            no_grad = no_grad.pin_memory().to(device, non_blocking=True)
        bad = torch.stack([~f for _, f in flags]).any().reshape(1) if flags else torch.zeros(1, dtype=torch.bool)
        local = torch.cat([bad.to(device=device, dtype=torch.float32), no_grad.to(device)])
        group = self._agreement_group()
        if group is not None:  # the agreement's header travels with the flags, in one all-reduce
            local = agree("step", None, group, device, payload=local, words=self._fingerprint_words,
                          error=error, counter=self._engine.counter)
        if error is not None:
            raise error
        agreed = local.tolist()  # the one host read
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
        device = next((p.device for g in getattr(self, "param_groups", ()) for p in g["params"]), None)
        if device is None:  # no parameters (or construction failed before any): the backend's device
            device = default_device(self._agreement_group())
        return device

    def _agreement_group(self) -> dist.ProcessGroup | None:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return self._process_group or dist.group.WORLD

    @staticmethod
    def _params_with_grad(group: dict[str, Any], algorithm: str) -> list[Tensor]:
        """The group's parameters routed to ``algorithm`` that have a gradient."""
        return [p for p, alg in zip(group["params"], group["algorithms"]) if alg == algorithm and p.grad is not None]

    def _momentum(self, group: dict[str, Any], stepped: set[int]) -> dict[int, Callable[[], Tensor]]:
        """Update the momentum of the group's parameters; return functions computing their NS
        inputs (local pieces), called only where and when the exchange needs them."""
        momentum, nesterov = group["momentum"], group["nesterov"]
        inputs = {}
        for p in self._params_with_grad(group, "muon"):
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
        params = self._params_with_grad(group, "adamw")
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not params:
            return
        hyper = adamw_hyperparameters(group)
        beta1, beta2 = hyper["betas"]
        adamw_update(
            params, [p.grad for p in params],
            [self.state[p]["exp_avg"] for p in params],
            [self.state[p]["exp_avg_sq"] for p in params],
            [], [self.state[p]["step"] for p in params],
            amsgrad=False, beta1=beta1, beta2=beta2, lr=hyper["lr"],
            weight_decay=hyper["weight_decay"], eps=hyper["eps"], maximize=False,
        )
