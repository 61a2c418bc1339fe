"""dmuon.Muon's options: what a param group stores, how its values are checked, and what
each algorithm applies. Pure: no tensors are touched but the hyperparameters themselves."""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dmuon.ns_defaults import NS_DTYPES
from dmuon.orthogonalization import SYMMETRIC_PRODUCTS, NSConfig, resolve_config
from dmuon.rules import RULE_OPTIONS, check_rule_name

ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")
NONFINITE_POLICIES = ("skip", "raise", "ignore")

# The state of a parameter, by algorithm.
STATE_KEYS = {"muon": ("momentum_buffer",), "adamw": ("step", "exp_avg", "exp_avg_sq")}

MUON_KEYS = (
    "lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
    "adjust_lr_fn", "ns_method", "ns_dtype", "ns_restarts", "ns_blocks", "update_rule", *RULE_OPTIONS,
    "momentum_dtype",
)
# what momentum may be kept in besides the parameter's dtype (momentum_dtype=None); "int8":
# 8-bit blocks (dmuon.momentum)
MOMENTUM_DTYPES = ("bfloat16", "float32", "int8")
# AdamW's options as a param group stores them; None for lr and weight decay: the group's own.
ADAMW_GROUP_KEYS = ("adamw_lr", "adamw_weight_decay", "adamw_betas", "adamw_eps")
# Per-parameter routing, stored in each group (and in checkpoints): lists parallel to "params".
ROUTING_KEYS = ("algorithms", "matrix_views")
# Why each parameter is routed as it is, in each group, parallel to "params": saved in state dicts
# like every group key, but a load keeps the reasons worked out at construction.
ROUTE_REASONS = "route_reasons"
# Keys a user's param group may carry besides hyperparameters ("betas": AdamW's, by its torch name).
# "use_addmm": torch.optim.Muon's, accepted and checked; dmuon's Newton–Schulz always fuses its products.
USER_KEYS = frozenset({"params", "param_names", "algorithm", "matrix_view", "name", "initial_lr", "betas", "use_addmm"})
# What every stored group must have (checked when a state dict is loaded).
GROUP_KEYS = (*MUON_KEYS, *ADAMW_GROUP_KEYS, *ROUTING_KEYS, "algorithm", "base_lr")


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def adamw_options(group: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """AdamW's options of a user's group, as stored.

    The rule: in an ``"algorithm": "adamw"`` group the plain keys (``lr``, ``weight_decay``,
    ``betas``, ``eps``) are AdamW's own. Elsewhere the plain ``lr``/``weight_decay`` are Muon's,
    and AdamW takes, first found: the group's ``adamw_*`` key, the constructor's ``adamw_*``
    argument, the group's ``lr``/``weight_decay``. Stored ``adamw_lr``/``adamw_weight_decay``
    None mean "the group's lr / weight decay" (and that lr follows schedulers as they change it);
    an explicit ``adamw_lr`` follows them too (:func:`adamw_hyperparameters`)."""
    own = group.get("algorithm") == "adamw"
    return {
        "adamw_lr": _first(group.get("adamw_lr"), None if own and "lr" in group else defaults["adamw_lr"]),
        "adamw_weight_decay": _first(group.get("adamw_weight_decay"),
                                     None if own and "weight_decay" in group else defaults["adamw_weight_decay"]),
        "adamw_betas": tuple(_first(group.get("adamw_betas"), group.get("betas"), defaults["adamw_betas"])),
        "adamw_eps": _first(group.get("adamw_eps"), group.get("eps") if own else None, defaults["adamw_eps"]),
    }


def adamw_hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """The lr, weight decay, betas and eps AdamW applies to a group's AdamW parameters now.

    An explicit ``adamw_lr`` follows the group's lr as schedulers (or the user) change it: it is
    scaled by lr / ``base_lr``, the group's lr when the group was added (which must not be 0),
    so a scheduler that takes the lr to 0 takes AdamW's to 0 too."""
    lr = group["lr"]
    if group["adamw_lr"] is not None:
        lr = group["adamw_lr"] * float(lr) / float(group["base_lr"])
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
    early_start: bool | None = None

    def validate(self) -> None:
        comm_dtype, bucket_bytes = self.comm_dtype, self.bucket_bytes
        if comm_dtype is not None and comm_dtype not in NS_DTYPES:
            raise ValueError(f"Invalid {comm_dtype=}. Must be one of {[str(d) for d in NS_DTYPES]} or None.")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"Invalid {bucket_bytes=}. Must be a positive int.")
        for name in ("replica_split", "distributed_ns"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"Invalid {name}={getattr(self, name)!r}. Must be None (cost model), True or False.")
        if self.symmetric_products not in (*SYMMETRIC_PRODUCTS, "auto"):
            raise ValueError(f"Invalid symmetric_products={self.symmetric_products!r}. "
                             f"Must be one of {(*SYMMETRIC_PRODUCTS, 'auto')}.")
        if self.early_start not in (None, True, False):
            raise ValueError(f"Invalid early_start={self.early_start!r}. Must be None (where supported), True or "
                             "False.")
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"Invalid cuda_graphs={self.cuda_graphs!r}. Must be a bool.")
        if not (isinstance(self.compile, (bool, str)) or callable(self.compile)):
            raise ValueError(f"Invalid compile={self.compile!r}. Must be a bool, or a torch.compile backend "
                             "(name or callable).")

    def describe(self) -> str:
        """As the ranks compare it: a compile backend by its name, not its address."""
        backend = (self.compile if isinstance(self.compile, (bool, str))
                   else getattr(self.compile, "__name__", "callable"))
        return repr((self.comm_dtype, self.bucket_bytes, self.replica_split, self.distributed_ns,
                     self.symmetric_products, backend, self.cuda_graphs, self.early_start))


def adjusted_lr_ratio(adjust_lr_fn: str | None, m: int, n: int) -> float:
    """Per-matrix lr multiplier, as in ``torch.optim.Muon``.

    "original" (Keller): √max(1, m/n); "match_rms_adamw" (Moonlight): 0.2·√max(m, n), which gives
    the update the RMS of an AdamW update so AdamW's lr and weight decay carry over;
    "spectral_unclamped" (torch after 2.13): √(m/n), "original" without its floor of 1 for wide matrices.
    """
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    if adjust_lr_fn == "spectral_unclamped":
        return math.sqrt(m / n)
    return math.sqrt(max(1.0, m / n))


# Options of other optimizers that users carry over, and what dmuon.Muon calls them.
OTHER_OPTIMIZERS_OPTIONS = {
    "betas": "AdamW's betas are adamw_betas=(beta1, beta2) in dmuon.Muon (in a param group, \"betas\" works too)",
    "use_muon": "use_muon belongs in a param group ({\"params\": ..., \"use_muon\": True}), or give the group "
                "\"algorithm\": \"muon\" or \"adamw\"",
    "foreach": "dmuon.Muon always runs batched (foreach) kernels; there is no switch",
    "fused": "dmuon.Muon always runs batched (foreach) kernels; there is no switch",
    "maximize": "dmuon.Muon minimizes; negate the loss to maximize",
    "amsgrad": "dmuon.Muon's AdamW has no AMSGrad",
}


def unexpected_option_message(cls_name: str, name: str, known: Sequence[str]) -> str:
    """Python's message for an unknown keyword, with what dmuon calls it (or the closest of the
    ``known`` options)."""
    message = f"{cls_name}() got an unexpected keyword argument {name!r}"
    hint = OTHER_OPTIMIZERS_OPTIONS.get(name)
    if hint is None:
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f"did you mean {close[0]!r}?" if close else None
    return f"{message}: {hint}" if hint else message


def reject_unknown_keywords(cls: type, kwargs: dict[str, Any]) -> None:
    """An option of another optimizer gets a pointer to dmuon's, not Python's bare TypeError. A
    class whose ``__init__`` takes ``**kwargs`` (a subclass's) passes them on or uses them itself."""
    options = inspect.signature(cls.__init__).parameters
    if any(o.kind is inspect.Parameter.VAR_KEYWORD for o in options.values()):
        return
    unknown = [k for k in kwargs if k not in options]
    if unknown:
        raise TypeError(unexpected_option_message(cls.__name__, unknown[0], [o for o in options if o != "self"]))


def check_use_addmm(value: Any, where: str = "") -> None:
    """torch.optim.Muon's ``use_addmm``: a bool (dmuon's products are always fused, as with True)."""
    if not isinstance(value, bool):
        raise ValueError(f"Invalid use_addmm={value!r}{where}. Must be a bool.")


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


def validate_defaults(defaults: dict[str, Any], options: EngineOptions) -> None:
    """The constructor's arguments: the engine options, ``nonfinite_grads`` and both groups' defaults."""
    options.validate()
    if defaults["nonfinite_grads"] not in NONFINITE_POLICIES:
        raise ValueError(f"Invalid nonfinite_grads={defaults['nonfinite_grads']!r}. Must be one of "
                         f"{NONFINITE_POLICIES}.")
    validate_muon_group(defaults)
    validate_adamw_group({**adamw_options({}, defaults), "base_lr": defaults["lr"]})


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
    name = dtype_name(group["momentum_dtype"], where, "momentum_dtype")
    if name is not None and name not in MOMENTUM_DTYPES:
        raise ValueError(f"Invalid momentum_dtype={name!r}{where}. Must be None (the parameter's "
                         f"dtype) or one of {MOMENTUM_DTYPES}.")
    check_rule_name(group["update_rule"], where)
    for name, (low, high) in RULE_OPTIONS.items():
        _check_range(name, group[name], where, low, high)
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"Invalid adjust_lr_fn={group['adjust_lr_fn']!r}{where}. Must be one of {ADJUST_LR_FNS}.")
    try:  # resolving for a square and a wide shape exercises every option of the recipe
        for shape in ((8, 8), (8, 64)):
            for device_type in ("cpu", "cuda"):
                ns_config(group, shape, device_type)
    except ValueError as err:
        raise ValueError(f"{err}{' (' + where.strip(' ,') + ')' if where else ''}") from None


def validate_adamw_group(group: dict[str, Any], where: str = "") -> None:
    """Raise a ValueError naming the first bad AdamW hyperparameter of a stored group."""
    for key in ("adamw_lr", "adamw_weight_decay"):
        if group[key] is not None:
            _check_range(key, group[key], where, 0.0)
    if group["adamw_lr"] is not None and float(group["base_lr"]) == 0:
        raise ValueError(f"Invalid lr=0.0 with adamw_lr={group['adamw_lr']!r}{where}: AdamW's lr follows the "
                         "group's as adamw_lr * lr / (the lr the group started with), which needs a starting lr > 0. "
                         "Start from lr > 0 (a scheduler may take it to 0), or leave adamw_lr out.")
    _check_range("adamw_eps", group["adamw_eps"], where, 0.0, low_open=True)
    betas = group["adamw_betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid adamw_betas={betas!r}{where}. Must be a pair.")
    for i, beta in enumerate(betas):
        _check_range(f"adamw_betas[{i}]", beta, where, 0.0, 1.0)


def dtype_name(value: torch.dtype | str | None, where: str = "", option: str = "ns_dtype") -> str | None:
    """A dtype option (``ns_dtype``, ``momentum_dtype``) as param groups keep it: a name
    ("bfloat16") or None, since DCP's full and CPU-offloaded state dicts accept only plain values
    in param groups."""
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    dtype = getattr(torch, name, None)
    blockwise = option == "momentum_dtype" and dtype == torch.int8  # 8-bit blocks
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or blockwise):
        kinds = "a floating torch.dtype, torch.int8 (8-bit blocks)" if option == "momentum_dtype" \
            else "a floating torch.dtype"
        raise ValueError(f"Invalid {option}={value!r}{where}. Must be {kinds}, its name, or None.")
    return name


def momentum_dtype(group: dict[str, Any], param: Tensor) -> torch.dtype:
    """The dtype ``param``'s momentum buffer is kept in: the group's ``momentum_dtype`` (torch.int8:
    8-bit blocks, :mod:`dmuon.momentum`), or the parameter's."""
    name = dtype_name(group["momentum_dtype"], option="momentum_dtype")  # (a user may set a torch.dtype)
    return getattr(torch, name) if name is not None else param.dtype


def ns_config(group: dict[str, Any], shape: Sequence[int], device_type: str, symmetric: str = "torch") -> NSConfig:
    name = dtype_name(group["ns_dtype"])
    return resolve_config(
        shape, device_type, steps=group["ns_steps"], coefficients=group["ns_coefficients"],
        method=group["ns_method"], dtype=getattr(torch, name) if name else None,
        restarts=group["ns_restarts"], eps=group["eps"], symmetric=symmetric,
    )
