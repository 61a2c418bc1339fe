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

from dmuon import momentum, tensors
from dmuon.hyperparameters import (
    ADAMW_GROUP_KEYS,
    MUON_KEYS,
    ROUTE_REASONS,
    USER_KEYS,
    adamw_options,
    check_use_addmm,
    dtype_name,
    validate_adamw_group,
    validate_muon_group,
)
from dmuon.layout import owned_by
from dmuon.ns_defaults import default_dtype_reason
from dmuon.routing import ALGORITHMS, MATRIX_VIEWS, Route, default_route, matrix_shape
from dmuon.row_blocks import check_pattern, plain_pattern, row_blocks
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
    group["ns_blocks"] = plain_pattern(group["ns_blocks"])  # plain values: DCP state dicts take them
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
        shard_rows = matrix_shape(tensors.local(param).shape, chosen.matrix_view)[1] if isinstance(param, DTensor) \
            else None
        check_pattern(group["ns_blocks"], m, shard_rows, f"{label}{where}")
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
            "ns_blocks (row counts, e.g. [q, kv, kv]; dmuon.interleaved(2) for alternating rows) orthogonalizes each "
            "block on its own")
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
                if group["ns_blocks"] is not None:
                    matrices += f" in {row_blocks(group['ns_blocks'], m).describe()}"
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
                digest = None if isinstance(p, DTensor) or p.is_meta else tensors.value_digest(p)
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


