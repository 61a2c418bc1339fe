"""dmuon.Muon's param groups: one stored group per group the user gave, each parameter in it
routed to Muon or AdamW. Pure: these functions read parameters' shapes and names, never their
values (except :func:`fingerprint`'s digest of unnamed replicas), and touch no process group.

A stored group holds the Muon hyperparameters (``MUON_KEYS``), AdamW's (``ADAMW_GROUP_KEYS``:
None for lr and weight decay means the group's own), ``"algorithm"`` (the user's override or
None), ``"base_lr"`` (the lr when the group was added: an explicit ``adamw_lr`` scales with the
group's lr from there), and per parameter, in lists parallel to ``"params"``: ``"algorithms"``,
``"matrix_views"`` and ``"route_reasons"`` (saved with the others, so that frameworks which
rebuild groups key by key from the live ones find every key; on load the live reasons stay).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon import momentum
from dmuon.hyperparameters import (
    ADAMW_GROUP_KEYS,
    GROUP_KEYS,
    MUON_KEYS,
    ROUTE_REASONS,
    ROUTING_KEYS,
    STATE_KEYS,
    USER_KEYS,
    adamw_options,
    check_use_addmm,
    dtype_name,
    validate_adamw_group,
    validate_muon_group,
)
from dmuon.layout import owned_by, row_state_placements
from dmuon.orthogonalization import default_dtype_reason
from dmuon.routing import ALGORITHMS, MATRIX_VIEWS, Route, block_rows, default_route, is_stack, matrix_shape, row_shape
from dmuon.rules import RULE_OPTIONS, RULES, rule_of
from dmuon.tensors import label

Entry = tuple[str | None, Tensor]
# a group's "algorithm": a route for all its parameters, or "normuon" (Muon with NorMuon's update rule)
GROUP_ALGORITHMS = (*ALGORITHMS, "normuon")


def check_params_type(params: Any) -> None:
    """An optimizer's ``params`` must come in a stable order: a set or a lone tensor cannot."""
    if isinstance(params, (set, Tensor)):
        raise TypeError("params must be a module, or an ordered iterable of tensors or dicts, not a "
                        f"{type(params).__name__}.")


def tensors_in(params: Any) -> list[Entry]:
    """(name or None, tensor) of every tensor an optimizer's ``params`` list (a module, tensors,
    (name, tensor) pairs or groups of them), for what must be known before they are checked
    (the ranks that hold them); malformed entries are skipped, and refused later."""
    if isinstance(params, nn.Module):
        return list(params.named_parameters())
    def entry(name: Any, item: Any) -> Entry | None:
        name, tensor = item if isinstance(item, tuple) and len(item) == 2 else (name, item)
        return (name if isinstance(name, str) else None, tensor) if isinstance(tensor, Tensor) else None

    found: list[Entry | None] = []
    for item in params if isinstance(params, (list, tuple)) else ():
        if isinstance(item, dict):
            inner = item.get("params", [])
            inner = [inner] if isinstance(inner, Tensor) else inner if isinstance(inner, (list, tuple)) else []
            names = item.get("param_names")
            names = names if isinstance(names, (list, tuple)) and len(names) == len(inner) else [None] * len(inner)
            found += [entry(n, e) for n, e in zip(names, inner)]
        else:
            found.append(entry(None, item))
    return [e for e in found if e is not None]


def check_listed_once(entries: Sequence[Entry], where: str) -> None:
    """Raise a ValueError naming a parameter that ``entries`` list twice (torch only warns)."""
    first: dict[int, int] = {}
    for i, (name, p) in enumerate(entries):
        j = first.setdefault(id(p), i)
        if j != i:
            raise ValueError(f"Parameter {label(name, p)} is listed twice{where} (positions {j} and {i}): list each "
                             "parameter once.")


def build_group(param_group: dict[str, Any], defaults: dict[str, Any], index: int, roles: dict[int, str],
                names_from: Callable[[list[Entry], str], list[Entry]] | None) -> dict[str, Any]:
    """The stored form of the user's ``param_group`` (the ``index``-th group), validated.

    ``roles``: module roles of parameters (routing); ``names_from``: where to find the names of
    bare tensors when the optimizer's groups are named (torch requires all named, or none)."""
    where = f" in param group {index}"
    if not isinstance(param_group, dict):
        raise TypeError(f"A param group must be a dict, got {type(param_group).__name__}{where}.")
    param_group = from_use_muon(param_group, where)
    known = USER_KEYS | set(MUON_KEYS) | set(ADAMW_GROUP_KEYS)
    unknown = sorted(set(param_group) - known, key=str)
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), sorted(known), n=1)
        raise ValueError(f"Unknown option(s) {unknown}{where}." + (f" Did you mean {close[0]!r}?" if close else "")
                         + f" A group takes: {', '.join(sorted(known - {'params'}))}.")
    check_use_addmm(param_group.get("use_addmm", False), where)
    algorithm = param_group.get("algorithm")
    if algorithm is not None and algorithm not in GROUP_ALGORITHMS:
        raise ValueError(f"Invalid algorithm={algorithm!r}{where}. Must be one of {GROUP_ALGORITHMS}.")
    if algorithm == "normuon" and param_group.get("update_rule", "normuon") != "normuon":
        raise ValueError(f"algorithm='normuon' and update_rule={param_group['update_rule']!r} disagree{where}: "
                         "give one.")
    view_override = param_group.get("matrix_view")
    if view_override is not None and view_override not in MATRIX_VIEWS:
        raise ValueError(f"Invalid matrix_view={view_override!r}{where}. Must be one of {MATRIX_VIEWS}.")

    entries = named_entries(param_group, where)
    if entries and entries[0][0] is None and names_from is not None:
        entries = names_from(entries, where)
    check_listed_once(entries, where)
    group = {k: v for k, v in param_group.items() if k in ("name", "initial_lr") or k in MUON_KEYS}
    for key in MUON_KEYS:
        group.setdefault(key, defaults[key])
    group["ns_dtype"] = dtype_name(group["ns_dtype"], where)
    group["momentum_dtype"] = dtype_name(group["momentum_dtype"], where, "momentum_dtype")
    if not isinstance(group["ns_blocks"], (int, type(None))):
        group["ns_blocks"] = list(group["ns_blocks"])  # plain values: DCP state dicts take them
    group.update(adamw_options(param_group, defaults), algorithm=algorithm, base_lr=float(group["lr"]))
    if algorithm == "normuon":  # Muon's engine, with NorMuon's rule
        group["update_rule"] = "normuon"
    routes = [route(name, param, i, "muon" if algorithm == "normuon" else algorithm, view_override, group, roles,
                    where)
              for i, (name, param) in enumerate(entries)]
    group["algorithms"] = [r.algorithm for r in routes]
    group["matrix_views"] = [r.matrix_view for r in routes]
    group[ROUTE_REASONS] = [r.reason for r in routes]
    if "muon" in group["algorithms"]:
        validate_muon_group(group, where)
    validate_adamw_group(group, where)
    named = any(name is not None for name, _ in entries)
    group["params"] = [(n, p) for n, p in entries] if named else [p for _, p in entries]
    if named and not entries:  # torch tells named groups by their first entry
        group["param_names"] = []
    return group


def route(name: str | None, param: Tensor, index: int, algorithm: str | None, view_override: str | None,
          group: dict[str, Any], roles: dict[int, str], where: str) -> Route:
    """Where one parameter of a group goes: the group's ``algorithm``, else the default rule."""
    label = name or f"parameter {index}"
    if param.is_complex():
        raise RuntimeError(f"Muon does not support complex parameters: {label}{where}.")  # torch's type
    chosen = default_route(param, name, roles.get(id(param)))
    if algorithm is not None:
        view = chosen.matrix_view if algorithm == chosen.algorithm else "auto"
        chosen = Route(algorithm, view, f"the group's algorithm={algorithm!r}")
    if view_override is not None:
        chosen = replace(chosen, matrix_view=view_override, reason=f"{chosen.reason}; matrix_view={view_override!r}")
    if chosen.algorithm == "muon":
        try:
            _, m, _ = matrix_shape(param.shape, chosen.matrix_view)
        except ValueError as err:
            raise ValueError(f"{label}{where}: {err} Put it in an 'adamw' group.") from None
        try:
            block_rows(group["ns_blocks"], m)
        except ValueError as err:
            raise ValueError(f"{err} ({label}{where})") from None
        check_momentum_blocks(group, param, label, where)
    return chosen


def check_momentum_blocks(group: dict[str, Any], param: Tensor, label: str, where: str) -> None:
    """Raise a ValueError naming ``param`` where ``group`` keeps 8-bit momentum that the
    parameter's layout would cut between ranks (:func:`dmuon.momentum.split_error`)."""
    blockwise = dtype_name(group["momentum_dtype"], where, "momentum_dtype") == momentum.BLOCKWISE
    reason = momentum.split_error(param) if blockwise else None
    if reason is not None:
        raise ValueError(f"momentum_dtype='int8' cannot keep the momentum of {label}{where} in 8-bit blocks of "
                         f"{momentum.BLOCK} columns: {reason}. Give it a group with momentum_dtype='bfloat16', or "
                         f"split its last dim so that each rank's columns start at a multiple of {momentum.BLOCK}.")


def from_use_muon(param_group: dict[str, Any], where: str) -> dict[str, Any]:
    """Keller Jordan's ``MuonWithAuxAdam`` groups in dmuon's words: ``"use_muon": True/False`` is
    ``"algorithm": "muon"/"adamw"``, and in an AdamW group his ``"eps"`` is AdamW's."""
    if "use_muon" not in param_group:
        return param_group
    use = param_group["use_muon"]
    if not isinstance(use, bool):
        raise ValueError(f"Invalid use_muon={use!r}{where}. Must be a bool (or give \"algorithm\": \"muon\" or "
                         "\"adamw\").")
    algorithm = "muon" if use else "adamw"
    if param_group.get("algorithm", algorithm) != algorithm:
        raise ValueError(f"use_muon={use} and algorithm={param_group['algorithm']!r} disagree{where}: give one.")
    group = {k: v for k, v in param_group.items() if k != "use_muon"}
    group["algorithm"] = algorithm
    if not use and "eps" in group:
        if "adamw_eps" in group:
            raise ValueError(f"An AdamW group (use_muon=False) with both eps and adamw_eps{where}: give one.")
        group["adamw_eps"] = group.pop("eps")
    return group


def named_entries(param_group: dict[str, Any], where: str) -> list[Entry]:
    """(name or None, tensor) of every parameter of a user's group."""
    params = param_group["params"]
    if isinstance(params, Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError(f"Parameters must be an ordered collection (a list), not a set{where}.")
    params = list(params)
    pairs = [isinstance(item, tuple) for item in params]
    if any(pairs) and not all(pairs):
        raise ValueError(f"Parameters{where} mix (name, tensor) pairs and bare tensors: give all of them "
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
    return entries


def names_in(model: nn.Module | None) -> Callable[[list[Entry], str], list[Entry]]:
    """A ``names_from`` for :func:`build_group`: bare tensors named as in ``model``."""

    def lookup(entries: list[Entry], where: str) -> list[Entry]:
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        missing = [i for i, (_, p) in enumerate(entries) if id(p) not in names]
        if missing:
            raise ValueError(  # torch.optim raises a ValueError for named and unnamed groups mixed
                f"The optimizer's param groups are named, but parameter {missing[0]}{where} is a bare tensor"
                + (" that is not in the model it was built from" if model is not None else "")
                + ": pass (name, tensor) pairs, e.g. {'params': list(module.named_parameters())}."
            )
        return [(names[id(p)], p) for _, p in entries]

    return lookup


def _routed_by_shape(groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups routed by shape alone: no names, no module, no ``"algorithm"``."""
    return [g for g in groups if g["algorithm"] is None and "param_names" not in g]


def check_not_a_whole_model_by_shape(groups: Sequence[dict[str, Any]]) -> None:
    """Refuse the bare tensors of a whole model routed by shape alone (e.g. ``model.parameters()``
    or nanoGPT's decay / no-decay groups): their embeddings and output head would go to Muon. A
    model's, here: at least two matrices and two vectors (norms, biases) with no names and no
    ``"algorithm"``. Matrices alone (what ``torch.optim.Muon`` takes), or a layer's weight and
    bias, only get :func:`shape_routing_warning`'s warning."""
    matrices = sum(alg == "muon" for g in _routed_by_shape(groups) for alg in g["algorithms"])
    vectors = sum(p.ndim < 2 for g in groups for p in g["params"] if isinstance(p, Tensor))
    if matrices >= 2 and vectors >= 2:
        raise ValueError(
            f"dmuon.Muon was given the bare tensors of a whole model ({matrices} matrices, {vectors} vectors such as "
            "norms and biases) and no names: routed by shape alone, its embeddings and output head would go to Muon, "
            "which does not suit them. Pass the model (dmuon.Muon(model, ...)), or build your groups from "
            "model.named_parameters() (e.g. {\"params\": [(n, p) for n, p in model.named_parameters() if p.ndim >= "
            "2], \"weight_decay\": 0.1}: each parameter is then routed by its name and module), or give each group "
            "\"algorithm\": \"muon\" or \"adamw\".")


def shape_routing_warning(groups: Sequence[dict[str, Any]]) -> str | None:
    """The warning for matrices that went to Muon by shape alone (no names, no module, no
    override), or None."""
    blind = sum(alg == "muon" for g in _routed_by_shape(groups) for alg in g["algorithms"])
    if not blind:
        return None
    return (f"dmuon.Muon routed {blind} {'matrix' if blind == 1 else 'matrices'} to Muon by shape alone: without "
            "names or modules it cannot tell embeddings and output heads (which should get AdamW) from hidden "
            "matrices. Pass the model (dmuon.Muon(model, ...)) or model.named_parameters(), or put those "
            "matrices in a group with \"algorithm\": \"muon\" (and the rest in one with \"algorithm\": \"adamw\").")


# fp16's smallest normal number: an AdamW eps below it leaves the update's denominator at (or near)
# 0 wherever the second moment underflows, which (1 - beta2)·g² does for |g| below about 8e-3.
FP16_TINY = torch.finfo(torch.float16).tiny


def fp16_adamw_warning(groups: Sequence[dict[str, Any]]) -> str | None:
    """The warning for fp16 parameters that AdamW steps with an eps fp16 cannot hold, or None."""
    found = [(name, eps) for g, group in enumerate(groups)
             if (eps := group["adamw_eps"]) < FP16_TINY
             for name, p, alg in zip(names_of(group, g), group["params"], group["algorithms"])
             if alg == "adamw" and p.dtype == torch.float16]
    if not found:
        return None
    names = ", ".join(name for name, _ in found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    return (f"AdamW steps float16 parameters ({names}) with eps={found[0][1]:g}, below float16's smallest normal "
            f"{FP16_TINY:.2g}: their second moment underflows to 0 for gradients below about 8e-3, and the update "
            "becomes inf or NaN, as in torch.optim.AdamW. Keep fp32 parameters (fp16 autocast computes in fp16 "
            "all the same), or pass adamw_eps=1e-4 or more.")


def names_of(group: dict[str, Any], g: int) -> list[str]:
    """The group's parameter names; an unnamed one is ``"group{g}.param{i}"``."""
    return group.get("param_names") or [f"group{g}.param{i}" for i in range(len(group["params"]))]


@dataclass(frozen=True, eq=False)
class MuonParam:
    """One Muon parameter as the optimizer lists it: its name, the tensor, its param group, and
    how Muon sees it as matrices (its matrix view, :mod:`dmuon.routing`)."""

    name: str
    param: Tensor
    param_group: dict[str, Any]
    view: str


def muon_params(groups: Sequence[dict[str, Any]]) -> list[MuonParam]:
    """Every Muon parameter, in group order."""
    return [MuonParam(name, p, group, view) for g, group in enumerate(groups)
            for name, p, alg, view in zip(names_of(group, g), group["params"], group["algorithms"],
                                          group["matrix_views"])
            if alg == "muon"]


def all_names(groups: Sequence[dict[str, Any]]) -> list[str]:
    """Every parameter's name, in group order (unnamed: ``"group{g}.param{i}"``)."""
    return [n for g, group in enumerate(groups) for n in names_of(group, g)]


def all_entries(groups: Sequence[dict[str, Any]]) -> list[Entry]:
    """(name, tensor) of every parameter, in group order (names as :func:`all_names` gives them)."""
    return list(zip(all_names(groups), (p for group in groups for p in group["params"])))


def label_of(groups: Sequence[dict[str, Any]], group: dict[str, Any]) -> str:
    """A group's label in statistics: its ``"name"``, else its index."""
    return str(group.get("name") or next(i for i, g in enumerate(groups) if g is group))


def routes(groups: Sequence[dict[str, Any]]) -> dict[str, Route]:
    """Each parameter's route by name."""
    out = {}
    for g, group in enumerate(groups):
        out.update((name, Route(*r)) for name, *r in
                   zip(names_of(group, g), group["algorithms"], group["matrix_views"], group[ROUTE_REASONS]))
    return out


# Names of fused projections (several weights stacked in one): Newton–Schulz of the whole differs
# from that of each block, which ``ns_blocks`` gives. "in_proj" only at the start of a name's part
# (nn.MultiheadAttention's in_proj_weight): a policy's action_in_proj is one projection.
FUSED_NAMES = ("qkv", "query_key_value", "gate_up", "w13", "c_attn")


def looks_fused(name: str) -> bool:
    """Whether a parameter's name says it holds several projections stacked in one."""
    parts = name.lower().split(".")
    return any(f in part for part in parts for f in FUSED_NAMES) or any(p.startswith("in_proj") for p in parts)


def default_dtype_reasons(groups: Sequence[dict[str, Any]]) -> list[str]:
    """What ``ns_dtype=None`` resolves to, and why: one line per device type of the Muon
    parameters whose group leaves the dtype to dmuon."""
    types = sorted({m.param.device.type for m in muon_params(groups) if m.param_group["ns_dtype"] is None})
    return [default_dtype_reason(t) for t in types]


def fused_hint(name: str, m: int, n: int) -> str:
    """What to know about a matrix whose name says it fuses several projections."""
    text = (f"note: {name} ({m}x{n}) looks like fused projections, orthogonalized here as one matrix; a param group's "
            "ns_blocks (row counts, e.g. [q, kv, kv]) orthogonalizes each block on its own")
    if "c_attn" in name:  # GPT-2's Conv1D stores (in, out): its q, k and v sit side by side in columns
        text += ", but GPT-2's Conv1D holds its blocks side by side along dim 1, which ns_blocks does not split"
    return text


def routing_summary(groups: Sequence[dict[str, Any]]) -> str:
    """A table: every parameter, its shape, the algorithm (", frozen" where it does not require a
    gradient: in no step while so), the matrices Muon sees, and why; then a note for each trained
    matrix whose name says it fuses projections (see :func:`fused_hint`)."""
    rows = [("group", "parameter", "shape", "algorithm", "matrices", "why")]
    notes = []
    for g, group in enumerate(groups):
        names = group.get("param_names") or [f"#{i}" for i in range(len(group["params"]))]
        for i, (name, p) in enumerate(zip(names, group["params"])):
            algorithm = group["algorithms"][i]
            if algorithm == "muon":
                count, m, n = matrix_shape(p.shape, group["matrix_views"][i])
                matrices = f"{count} x {m}x{n}"
                if group["ns_blocks"] is None and p.requires_grad and looks_fused(name):
                    notes.append(fused_hint(name, m, n))
            else:
                matrices = "-"
            shown = algorithm if p.requires_grad else f"{algorithm}, frozen"
            rows.append((str(g), name, "x".join(map(str, p.shape)), shown, matrices, group[ROUTE_REASONS][i]))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(table + notes)


def settings(groups: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """Every group's hyperparameters as the ranks compare them: at construction and at every
    step, since schedulers and users change them between steps."""
    out = []
    for g, group in enumerate(groups):
        for key in (*MUON_KEYS, *ADAMW_GROUP_KEYS, "algorithm", "name"):
            value = group.get(key)
            out.append((f"param group {g}'s {key}", repr(float(value) if isinstance(value, Tensor) else value)))
    return out


def fingerprint(groups: Sequence[dict[str, Any]], options: str, nonfinite_grads: str, *,
                across_ranks: bool) -> list[tuple[str, str]]:
    """What the ranks must agree on, as ordered (what, value) pairs: every option that shapes
    the step's collectives, every group's hyperparameters, and every parameter (its name,
    shape, dtype and algorithm): Muon matrices take part in collectives, and a parameter is
    stepped only if every rank has its gradient, which the ranks tell by position.

    ``across_ranks`` (a job of several ranks): unnamed Muon parameters are matched by position
    too, so a different order on some rank must show. Unnamed replicas (plain tensors) carry a
    digest of their values; where two of the same shape cannot be told apart that way (equal
    values, DTensors, meta tensors), a ValueError asks for names."""
    out = [("options", options), ("nonfinite_grads", repr(nonfinite_grads)),
           ("number of param groups", str(len(groups)))]
    out += settings(groups)
    unnamed: dict[tuple, list[tuple[str, Tensor, int | None]]] = {}
    for g, group in enumerate(groups):
        names = group.get("param_names")
        for i, (p, algorithm, view) in enumerate(zip(group["params"], group["algorithms"], group["matrix_views"])):
            what = f"{names[i]!r}" if names else "unnamed"
            what += f" {tuple(p.shape)} {str(p.dtype).removeprefix('torch.')} for {algorithm}"
            what += "" if view == "auto" else f" seen as {view!r}"
            if across_ranks and not names and algorithm == "muon" and owned_by(p) is None:
                digest = None if isinstance(p, DTensor) or p.is_meta else value_digest(p)
                unnamed.setdefault((tuple(p.shape), p.dtype, view), []).append((f"group{g}.param{i}", p, digest))
                if digest is not None:
                    what += f" with values {digest:016x} (matched by position and values: pass names to match by name)"
            out.append((f"param group {g}'s parameter {i}", what))
    for (shape, _, _), matches in unnamed.items():
        digests = [d for _, _, d in matches]
        if len(matches) > 1 and (None in digests or len(set(digests)) < len(digests)):
            labels = [label for label, _, _ in matches]
            labels = labels if len(labels) <= 4 else [*labels[:3], f"{len(labels) - 3} more"]
            why = ("are DTensors or meta tensors" if None in digests else "hold identical values")
            raise ValueError(
                f"Muon parameters {labels} are unnamed, of the same shape {shape}, and {why}: dmuon cannot check "
                "that every rank lists them in the same order, and a different order would exchange their updates. "
                "Pass names: dmuon.Muon(model, ...) or dmuon.Muon(model.named_parameters(), ...).")
    return out


# A position-weighted sum of a tensor's bits: equal values in another order give another digest.
_DIGEST_CHUNK = 1 << 22
_INTEGER_VIEWS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MULTIPLIER, _OFFSET = -7046029254386353131, 7146057691288625177  # 0x9E3779B97F4A7C15 as int64, 0x632BE59BD9B4E019


def value_digest(t: Tensor) -> int:
    """A 64-bit digest of ``t``'s values, bit for bit and position by position: integer
    arithmetic modulo 2⁶⁴, so every rank gets the same number for the same bits whatever the
    order of the sums."""
    bits = t.detach().reshape(-1).view(_INTEGER_VIEWS[t.element_size()]).to(torch.int64)
    total = 0
    for start in range(0, bits.numel(), _DIGEST_CHUNK):
        chunk = bits[start: start + _DIGEST_CHUNK]
        positions = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=chunk.device)
        weights = (positions * _MULTIPLIER + _OFFSET) | 1  # odd, wrapping in int64
        total = (total + int((chunk * weights).sum())) % (1 << 64)
    return total


def follow_meta_parameters(groups: Sequence[dict[str, Any]], model: nn.Module | None) -> None:
    """Replace parameters on the meta device by the model's parameters of the same names:
    ``model.to_empty(device=...)`` gives a model built on the meta device new parameter objects,
    and an optimizer built before it would otherwise hold the stale ones and step nothing.
    Raises a ValueError naming a meta parameter that cannot be found so."""
    current: dict[str, Tensor] | None = None
    for g, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            if not p.is_meta:
                continue
            name = names_of(group, g)[i]
            if current is None:
                current = dict(model.named_parameters()) if model is not None and "param_names" in group else {}
            found = current.get(name)
            if found is None or found.is_meta or found.shape != p.shape:
                raise ValueError(
                    f"Parameter {name!r} is still on the meta device, and "
                    + ("the model holds no materialized parameter of that name and shape" if model is not None
                       else "the optimizer was not built from the model, so it cannot find its replacement")
                    + ". Build the optimizer after model.to_empty(device=...), or build it from the model "
                    "(dmuon.Muon(model, ...)).")
            group["params"][i] = found


def validate_groups(groups: Sequence[dict[str, Any]]) -> None:
    """Raise a ValueError naming the group and value of the first bad hyperparameter of stored
    groups (after a scheduler, a user or a state dict changed them)."""
    for g, group in enumerate(groups):
        where = f" in param group {g}"
        if "muon" in group["algorithms"]:
            validate_muon_group(group, where)
            for name, p, algorithm in zip(names_of(group, g), group["params"], group["algorithms"]):
                if algorithm == "muon":
                    check_momentum_blocks(group, p, name, where)
        validate_adamw_group(group, where)


# The hyperparameters a torch.optim.Muon param group stores that mean the same in dmuon.
TORCH_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn")
_TORCH_MUON_MARKS = ("ns_coefficients", "ns_steps", "adjust_lr_fn")  # in its groups, in no other torch optimizer's


def is_torch_muon_state_dict(state_dict: Any) -> bool:
    """Whether ``state_dict`` is ``torch.optim.Muon``'s: groups with some of its Newton–Schulz
    hyperparameters and none of dmuon's routing (:func:`from_torch_muon` names any it lacks)."""
    saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    return bool(saved) and isinstance(saved, list) and all(
        isinstance(g, dict) and "algorithms" not in g and any(k in g for k in _TORCH_MUON_MARKS) for g in saved)


def from_torch_muon(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``torch.optim.Muon``'s state dict in dmuon's form, for these groups (the same parameters
    in the same groups): each momentum buffer carried over, torch's hyperparameters
    (``TORCH_MUON_KEYS``) in place of the groups', dmuon's own options and routing kept. Raises a
    ValueError naming the group or parameter that does not match."""
    saved_groups, state = state_dict["param_groups"], state_dict.get("state", {})
    if len(saved_groups) != len(groups):
        raise ValueError(f"The torch.optim.Muon state dict has {len(saved_groups)} param groups, this optimizer "
                         f"{len(groups)}: build dmuon.Muon with the same groups of the same parameters.")
    converted_groups, converted_state = [], {}
    for g, (saved, mine) in enumerate(zip(saved_groups, groups)):
        missing = [k for k in (*TORCH_MUON_KEYS, "params") if k not in saved]
        if missing:
            raise ValueError(f"Param group {g} of the torch.optim.Muon state dict lacks {missing} (torch.optim.Muon "
                             f"saves {', '.join(TORCH_MUON_KEYS)} and params in each group).")
        keys = saved["params"]
        if len(keys) != len(mine["params"]):
            raise ValueError(f"Param group {g} of the torch.optim.Muon state dict has {len(keys)} parameters, this "
                             f"optimizer's {len(mine['params'])}.")
        names = names_of(mine, g)
        for i, key in enumerate(keys):
            if mine["algorithms"][i] != "muon":
                raise ValueError(f"Parameter {names[i]!r} is routed to {mine['algorithms'][i]} here, so its "
                                 "torch.optim.Muon momentum cannot carry over: give its group "
                                 "\"algorithm\": \"muon\" (see routing_summary()).")
            if "momentum_buffer" in state.get(key, {}):
                converted_state[key] = {"momentum_buffer": state[key]["momentum_buffer"]}
        group = {k: v for k, v in mine.items() if k != "params"}
        group.update({k: saved[k] for k in TORCH_MUON_KEYS}, params=list(keys))
        converted_groups.append(group)
    return {"state": converted_state, "param_groups": converted_groups}


def with_new_keys(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A state dict saved before update rules and ``momentum_dtype`` existed, its groups as they
    were stepped: update rule "muon", momentum in the parameter's dtype, and this optimizer's
    values of the rules' options (which Muon's ignores)."""
    saved = state_dict.get("param_groups")
    keys = ("update_rule", "momentum_dtype")
    if not isinstance(saved, list) or all(not isinstance(g, dict) or all(k in g for k in keys) for g in saved):
        return state_dict
    added = [{"update_rule": "muon", "momentum_dtype": None, **{key: mine[key] for key in RULE_OPTIONS}}
             for mine in groups]
    return {**state_dict, "param_groups": [{**new, **g} if isinstance(g, dict) else g
                                           for g, new in zip(saved, added)] + saved[len(added):]}


def restore_kept_dtypes(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]], state: dict) -> None:
    """After torch's ``load_state_dict``, which casts every state tensor to its parameter's dtype:
    the state dmuon keeps in another dtype (an update rule's fp32 row state beside bf16 weights,
    momentum in its ``momentum_dtype``, 8-bit momentum's codes and scales) put back from
    ``state_dict`` uncast, so that no bit is lost (a step converts a momentum saved in another
    dtype to the group's)."""
    saved = state_dict["state"]
    for saved_group, group in zip(state_dict["param_groups"], groups):
        for key, p, algorithm in zip(saved_group["params"], group["params"], group["algorithms"]):
            kept = (*_row_state_keys(group, algorithm), *_scale_keys(group, algorithm),
                    *(("momentum_buffer",) if algorithm == "muon" and group["momentum_dtype"] is not None else ()))
            for name in kept:
                value = saved.get(key, {}).get(name)
                if isinstance(value, Tensor) and state[p][name].dtype != value.dtype:
                    state[p][name] = value.to(device=p.device)


def check_loadable(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]) -> None:
    """Raise a ValueError naming the group or parameter if ``state_dict`` cannot be loaded
    into these groups: missing keys, hyperparameters the constructor would refuse, state of
    another algorithm than the parameter's route here, state tensors of other shapes, of
    another layout (a DTensor's state saved under DDP, or the reverse), on the meta device, or
    a negative AdamW step count.

    The per-parameter facts of a saved group (``ROUTING_KEYS``, ``ROUTE_REASONS``) are not
    read: they are derived here, from this optimizer's groups and parameters. A flattened state
    dict (``flatten_optimizer_state_dict=True``, torchtitan's) stores every group key under each
    parameter's name and rebuilds a group from its first parameter's, so those lists may come
    from a group of another pipeline layout; a parameter's own state says how it was stepped."""
    saved_groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(state, dict):
        raise ValueError("Invalid state dict: it needs 'state' (a dict) and 'param_groups' (a list).")
    if len(saved_groups) != len(groups):
        raise ValueError(f"The state dict has {len(saved_groups)} param groups, this optimizer {len(groups)}.")
    for g, (saved, mine) in enumerate(zip(saved_groups, groups)):
        if not isinstance(saved, dict):
            raise ValueError(f"Param group {g} of the state dict is a {type(saved).__name__}, not a dict.")
        missing = [k for k in (*GROUP_KEYS, "params") if k not in saved and k not in ROUTING_KEYS]
        if missing:
            raise ValueError(f"Param group {g} of the state dict lacks {missing} (a dmuon.Muon state dict "
                             "of another version or optimizer?).")
        if not isinstance(saved["params"], list) or len(saved["params"]) != len(mine["params"]):
            raise ValueError(f"Param group {g} of the state dict has 'params' {_length(saved['params'])}, for "
                             f"this optimizer's {len(mine['params'])} parameters.")
        if "muon" in mine["algorithms"] and saved["update_rule"] != mine["update_rule"]:
            raise ValueError(f"Param group {g} of the state dict was saved with update_rule={saved['update_rule']!r}, "
                             f"this optimizer's is {mine['update_rule']!r}: give the group the rule it was saved with "
                             "to load it (to switch rules, set the group's \"update_rule\" after loading; a rule's "
                             "state starts at zero).")
        names = names_of(mine, g)
        for i, (key, p) in enumerate(zip(saved["params"], mine["params"])):
            entry = state.get(key, {})
            if not isinstance(entry, dict):
                raise ValueError(f"The state of parameter {names[i]!r} is a {type(entry).__name__}, not a dict.")
            algorithm = mine["algorithms"][i]
            kept = (*STATE_KEYS[algorithm], *_row_state_keys(mine, algorithm), *_scale_keys(saved, algorithm))
            others = sorted({k for k in entry if k not in kept} & set(_STATE_OWNER))
            if others:
                raise ValueError(f"Parameter {names[i]!r} is routed to {algorithm} here, but its state in the state "
                                 f"dict is {_STATE_OWNER[others[0]]}'s ({others}): it was saved by an optimizer that "
                                 "routed it otherwise. Give its group the same \"algorithm\" as when it was saved.")
            for name in STATE_KEYS[algorithm] if entry else ():
                _check_state_tensor(entry.get(name), name, p, names[i])
            for name in _row_state_keys(mine, algorithm) if entry else ():
                _check_row_state(entry.get(name), name, p, mine["matrix_views"][i], names[i])
            for name in _scale_keys(saved, algorithm) if entry else ():
                _check_state_tensor(entry.get(name), name, p, names[i], momentum.scale_shape(p.shape))
                if entry["momentum_buffer"].dtype != torch.int8:
                    raise ValueError(f"The state of parameter {names[i]!r} has momentum_buffer in "
                                     f"{entry['momentum_buffer'].dtype} beside momentum_dtype='int8': 8-bit momentum "
                                     "keeps int8 codes there.")
    keys = [key for saved in saved_groups for key in saved["params"]]
    if len(set(keys)) != len(keys):
        raise ValueError(f"The state dict's param groups list a parameter key twice: {keys}.")
    stray = [key for key in state if key not in set(keys)]
    if stray:
        raise ValueError(f"The state dict has state for parameter key {stray[0]!r}, which none of its param groups "
                         "lists.")
    for g, (saved, mine) in enumerate(zip(saved_groups, groups)):
        where = f" in param group {g} of the state dict"
        if "muon" in mine["algorithms"]:
            validate_muon_group(saved, where)
        validate_adamw_group(saved, where)


# which algorithm (or Muon's update rule) keeps each state key
_STATE_OWNER = {**{key: algorithm for algorithm, keys in STATE_KEYS.items() for key in keys},
                momentum.SCALE_KEY: "muon",
                **{rule.state: rule.name for rule in RULES.values() if rule.state is not None}}


def _row_state_keys(group: dict[str, Any], algorithm: str) -> tuple[str, ...]:
    """The row state a parameter of ``group`` routed to ``algorithm`` keeps: its update rule's, for Muon."""
    state = rule_of(group).state if algorithm == "muon" else None
    return () if state is None else (state,)


def _scale_keys(group: dict[str, Any], algorithm: str) -> tuple[str, ...]:
    """The 8-bit momentum scales a parameter of ``group`` routed to ``algorithm`` keeps (:mod:`dmuon.momentum`)."""
    blockwise = group.get("momentum_dtype") in (momentum.BLOCKWISE, torch.int8)
    return (momentum.SCALE_KEY,) if algorithm == "muon" and blockwise else ()


def _check_row_state(value: Any, key: str, param: Tensor, view: str, name: str) -> None:
    """An update rule's row state against its parameter: a tensor of :func:`row_shape`, laid out
    as :func:`dmuon.layout.row_state_placements` places it."""
    if not isinstance(value, Tensor) or value.is_meta:
        raise ValueError(f"The state of parameter {name!r} lacks {key!r} (or it is not a tensor with values): it was "
                         "saved with another update rule?")
    expected = row_shape(param.shape, view)
    if tuple(value.shape) != expected:
        raise ValueError(f"The state of parameter {name!r} has {key} of shape {tuple(value.shape)}; one number per "
                         f"row of the parameter's matrices is shape {expected}.")
    placements = row_state_placements(param, is_stack(param, view)) if isinstance(param, DTensor) else None
    elsewhere = placements is not None and (tuple(value.placements) != placements
                                            or value.device_mesh != param.device_mesh)
    if isinstance(value, DTensor) != isinstance(param, DTensor) or elsewhere:
        raise ValueError(f"The state of parameter {name!r} has {key} in another layout than this optimizer keeps it "
                         f"({'placements ' + str(placements) if placements else 'a plain tensor'}): load it through "
                         "torch.distributed.checkpoint (get_optimizer_state_dict/set_optimizer_state_dict), which "
                         "reshards.")


def _length(value: Any) -> str:
    return f"of {len(value)} entries" if isinstance(value, list) else f"as a {type(value).__name__}"


def _check_state_tensor(value: Any, key: str, param: Tensor, name: str, shape: tuple[int, ...] | None = None) -> None:
    """One state tensor against its parameter: a tensor, of the parameter's shape (or ``shape``:
    8-bit momentum's scales) and layout."""
    if not isinstance(value, Tensor):
        raise ValueError(f"The state of parameter {name!r} lacks {key!r} (or it is not a tensor).")
    if value.is_meta:
        raise ValueError(f"The state of parameter {name!r} has {key} on the meta device (no values): load a state "
                         "dict with the values, or build the optimizer's state by stepping.")
    if key == "step":
        count = value.detach().cpu() if value.numel() == 1 else None
        if count is None or not bool(torch.isfinite(count).all()) or float(count) < 0:
            raise ValueError(f"The state of parameter {name!r} has step={count.item() if count is not None else value}"
                             "; AdamW's step count must be one number >= 0.")
        return
    expected = tuple(param.shape) if shape is None else shape
    if tuple(value.shape) != expected:
        raise ValueError(f"The state of parameter {name!r} has {key} of shape {tuple(value.shape)}; the "
                         f"parameter's shape{'' if shape is None else ' counted in blocks'} is {expected}.")
    if isinstance(value, DTensor) != isinstance(param, DTensor) or (
            isinstance(param, DTensor) and (tuple(value.placements) != tuple(param.placements)
                                            or value.device_mesh != param.device_mesh)):
        def layout(t: Tensor) -> str:
            return f"a DTensor with placements {tuple(t.placements)}" if isinstance(t, DTensor) else "a plain tensor"

        raise ValueError(f"The state of parameter {name!r} has {key} as {layout(value)}, but the parameter is "
                         f"{layout(param)}: the state dict was saved in another layout (FSDP2 and DDP or one "
                         "process, say). Load it through torch.distributed.checkpoint (get_optimizer_state_dict/"
                         "set_optimizer_state_dict), which reshards.")
