"""dmuon.Muon's param groups: one stored group per group the user gave, each parameter in it
routed to Muon or AdamW. Pure: these functions read parameters' shapes and names, never their
values (except :func:`fingerprint`'s checksum of unnamed replicas), and touch no process group.

A stored group holds the Muon hyperparameters (``MUON_KEYS``), AdamW's (``ADAMW_GROUP_KEYS``:
None for lr and weight decay means the group's own), ``"algorithm"`` (the user's override or
None), ``"base_lr"`` (the lr when the group was added: an explicit ``adamw_lr`` scales with the
group's lr from there), and per parameter, in lists parallel to ``"params"``: ``"algorithms"``,
``"matrix_views"`` and ``"route_reasons"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon.hyperparameters import (
    ADAMW_GROUP_KEYS, GROUP_KEYS, MUON_KEYS, STATE_KEYS, USER_KEYS, adamw_options, dtype_name, validate_adamw_group,
    validate_muon_group,
)
from dmuon.layout import owned_by
from dmuon.routing import ALGORITHMS, MATRIX_VIEWS, Route, block_rows, default_route, matrix_shape

Entry = tuple[str | None, Tensor]


def check_params_type(params: Any) -> None:
    """An optimizer's ``params`` must come in a stable order: a set or a lone tensor cannot."""
    if isinstance(params, (set, Tensor)):
        raise TypeError(f"params must be a module, or an ordered iterable of tensors or dicts, not a {type(params).__name__}.")


def build_group(param_group: dict[str, Any], defaults: dict[str, Any], index: int, roles: dict[int, str],
                names_from: Callable[[list[Entry], str], list[Entry]] | None) -> dict[str, Any]:
    """The stored form of the user's ``param_group`` (the ``index``-th group), validated.

    ``roles``: module roles of parameters (routing); ``names_from``: where to find the names of
    bare tensors when the optimizer's groups are named (torch requires all named, or none)."""
    where = f" in param group {index}"
    if not isinstance(param_group, dict):
        raise TypeError(f"A param group must be a dict, got {type(param_group).__name__}{where}.")
    unknown = set(param_group) - USER_KEYS - set(MUON_KEYS) - set(ADAMW_GROUP_KEYS)
    if unknown:
        raise ValueError(f"Unknown option(s) {sorted(unknown)}{where}.")
    algorithm = param_group.get("algorithm")
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ValueError(f"Invalid algorithm={algorithm!r}{where}. Must be one of {ALGORITHMS}.")
    view_override = param_group.get("matrix_view")
    if view_override is not None and view_override not in MATRIX_VIEWS:
        raise ValueError(f"Invalid matrix_view={view_override!r}{where}. Must be one of {MATRIX_VIEWS}.")

    entries = named_entries(param_group, where)
    if entries and entries[0][0] is None and names_from is not None:
        entries = names_from(entries, where)
    group = {k: v for k, v in param_group.items() if k in ("name", "initial_lr") or k in MUON_KEYS}
    for key in MUON_KEYS:
        group.setdefault(key, defaults[key])
    group["ns_dtype"] = dtype_name(group["ns_dtype"], where)
    if not isinstance(group["ns_blocks"], (int, type(None))):
        group["ns_blocks"] = list(group["ns_blocks"])  # plain values: DCP state dicts take them
    group.update(adamw_options(param_group, defaults), algorithm=algorithm, base_lr=float(group["lr"]))
    routes = [route(name, param, i, algorithm, view_override, group, roles, where)
              for i, (name, param) in enumerate(entries)]
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
    return group


def route(name: str | None, param: Tensor, index: int, algorithm: str | None, view_override: str | None,
          group: dict[str, Any], roles: dict[int, str], where: str) -> Route:
    """Where one parameter of a group goes: the group's ``algorithm``, else the default rule."""
    label = name or f"parameter {index}"
    if param.is_complex():
        raise ValueError(f"Muon does not support complex parameters: {label}{where}.")
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
    return chosen


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
    return entries


def names_in(model: nn.Module | None) -> Callable[[list[Entry], str], list[Entry]]:
    """A ``names_from`` for :func:`build_group`: bare tensors named as in ``model``."""

    def lookup(entries: list[Entry], where: str) -> list[Entry]:
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        missing = [i for i, (_, p) in enumerate(entries) if id(p) not in names]
        if missing:
            raise TypeError(
                f"The optimizer's param groups are named, but parameter {missing[0]}{where} is a bare tensor"
                + (" that is not in the model it was built from" if model is not None else "")
                + ": pass (name, tensor) pairs, e.g. {'params': list(module.named_parameters())}."
            )
        return [(names[id(p)], p) for _, p in entries]

    return lookup


def shape_routing_warning(groups: Sequence[dict[str, Any]]) -> str | None:
    """The warning for matrices that went to Muon by shape alone (no names, no module, no
    override), or None."""
    blind = sum(alg == "muon" for g in groups if g["algorithm"] is None and "param_names" not in g
                for alg in g["algorithms"])
    if not blind:
        return None
    return (f"dmuon.Muon routed {blind} {'matrix' if blind == 1 else 'matrices'} to Muon by shape alone: without "
            "names or modules it cannot tell embeddings and output heads (which should get AdamW) from hidden "
            "matrices. Pass the model (dmuon.Muon(model, ...)) or model.named_parameters(), or put those "
            "matrices in a group with \"algorithm\": \"muon\" (and the rest in one with \"algorithm\": \"adamw\").")


def names_of(group: dict[str, Any], g: int) -> list[str]:
    """The group's parameter names; an unnamed one is ``"group{g}.param{i}"``."""
    return group.get("param_names") or [f"group{g}.param{i}" for i in range(len(group["params"]))]


def muon_entries(groups: Sequence[dict[str, Any]]) -> list[tuple[str, Tensor, dict[str, Any], str]]:
    """(name, param, group, matrix view) of every Muon parameter, in group order."""
    return [(name, p, group, view) for g, group in enumerate(groups)
            for name, p, alg, view in zip(names_of(group, g), group["params"], group["algorithms"], group["matrix_views"])
            if alg == "muon"]


def all_names(groups: Sequence[dict[str, Any]]) -> list[str]:
    """Every parameter's name, in group order (unnamed: ``"group{g}.param{i}"``)."""
    return [n for g, group in enumerate(groups) for n in names_of(group, g)]


def label_of(groups: Sequence[dict[str, Any]], group: dict[str, Any]) -> str:
    """A group's label in statistics: its ``"name"``, else its index."""
    return str(group.get("name") or next(i for i, g in enumerate(groups) if g is group))


def routes(groups: Sequence[dict[str, Any]]) -> dict[str, Route]:
    """Each parameter's route by name."""
    out = {}
    for g, group in enumerate(groups):
        out.update((name, Route(*r)) for name, *r in
                   zip(names_of(group, g), group["algorithms"], group["matrix_views"], group["route_reasons"]))
    return out


def routing_summary(groups: Sequence[dict[str, Any]]) -> str:
    """A table: every parameter, its shape, the algorithm, the matrices Muon sees, and why."""
    rows = [("group", "parameter", "shape", "algorithm", "matrices", "why")]
    for g, group in enumerate(groups):
        names = group.get("param_names") or [f"#{i}" for i in range(len(group["params"]))]
        for i, (name, p) in enumerate(zip(names, group["params"])):
            algorithm = group["algorithms"][i]
            if algorithm == "muon":
                count, m, n = matrix_shape(p.shape, group["matrix_views"][i])
                matrices = f"{count} x {m}x{n}"
            else:
                matrices = "-"
            rows.append((str(g), name, "x".join(map(str, p.shape)), algorithm, matrices, group["route_reasons"][i]))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def fingerprint(groups: Sequence[dict[str, Any]], options: str, nonfinite_grads: str) -> list[tuple[str, str]]:
    """What the ranks must agree on, as ordered (what, value) pairs: every option that shapes
    the step's collectives, every group's hyperparameters, and every Muon parameter (its name,
    shape and matrix view) — their matrices take part in collectives. AdamW is element-wise
    and local, so a rank may hold AdamW parameters that others lack.

    Unnamed parameters can only be matched by position: where they are replicas (plain
    tensors under DDP) the sum of their values tells two same-shape matrices apart, so that a
    different order on some rank is caught."""
    out = [("options", options), ("nonfinite_grads", repr(nonfinite_grads)),
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
            out.append((f"param group {g}'s Muon parameter {j}", what))
    return out


def check_loadable(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]) -> None:
    """Raise a ValueError naming the group or parameter if ``state_dict`` cannot be loaded
    into these groups: missing keys, other routing, state tensors of other shapes."""
    saved_groups, state = state_dict.get("param_groups"), state_dict.get("state")
    if not isinstance(saved_groups, list) or not isinstance(state, dict):
        raise ValueError("Invalid state dict: it needs 'state' (a dict) and 'param_groups' (a list).")
    if len(saved_groups) != len(groups):
        raise ValueError(f"The state dict has {len(saved_groups)} param groups, this optimizer {len(groups)}.")
    for g, (saved, mine) in enumerate(zip(saved_groups, groups)):
        missing = [k for k in GROUP_KEYS if k not in saved]
        if missing:
            raise ValueError(f"Param group {g} of the state dict lacks {missing} (a dmuon.Muon state dict "
                             "of another version or optimizer?).")
        if len(saved["params"]) != len(mine["params"]):
            raise ValueError(f"Param group {g} of the state dict has {len(saved['params'])} parameters, "
                             f"this optimizer's {len(mine['params'])}.")
        names = names_of(mine, g)
        for i, (key, p) in enumerate(zip(saved["params"], mine["params"])):
            if saved["algorithms"][i] != mine["algorithms"][i]:
                raise ValueError(f"Parameter {names[i]!r} is routed to {mine['algorithms'][i]} here but to "
                                 f"{saved['algorithms'][i]} in the state dict.")
            entry = state.get(key, {})
            for name in STATE_KEYS[mine["algorithms"][i]] if entry else ():
                value = entry.get(name)
                if not isinstance(value, Tensor):
                    raise ValueError(f"The state of parameter {names[i]!r} lacks {name!r}.")
                if name != "step" and tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"The state of parameter {names[i]!r} has {name} of shape "
                                     f"{tuple(value.shape)}; the parameter's shape is {tuple(p.shape)}.")


def loaded_groups(state_dict: dict[str, Any], groups: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups ``state_dict`` would give: its saved options with the current parameters (and names)."""
    return [{**saved, "params": mine["params"], **({"param_names": mine["param_names"]} if "param_names" in mine else {})}
            for saved, mine in zip(state_dict["param_groups"], groups)]
