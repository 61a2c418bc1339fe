"""What ``dmuon.Muon.load_state_dict`` checks before anything changes, and restores after torch's
loading: every saved group and state tensor checked against this optimizer's groups (keys,
hyperparameters, routes, shapes, layouts), keys added since a state dict was saved filled in, and
the state kept in a dtype of its own put back uncast."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from dmuon import momentum
from dmuon.hyperparameters import (
    GROUP_KEYS,
    ROUTING_KEYS,
    STATE_KEYS,
    validate_adamw_group,
    validate_muon_group,
)
from dmuon.layout import row_state_placements
from dmuon.param_groups import names_of
from dmuon.routing import is_stack, row_shape
from dmuon.rules import RULE_OPTIONS, RULES, rule_of


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
            _check_entry(state.get(key, {}), p, names[i], i, saved, mine)
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


def _check_entry(entry: Any, p: Tensor, name: str, i: int, saved: dict[str, Any], mine: dict[str, Any]) -> None:
    """One parameter's saved state (``entry``, of the ``i``-th parameter of group ``mine``, saved
    as ``saved``): the keys of its route here, each tensor shaped and laid out like ``p``."""
    if not isinstance(entry, dict):
        raise ValueError(f"The state of parameter {name!r} is a {type(entry).__name__}, not a dict.")
    algorithm = mine["algorithms"][i]
    kept = (*STATE_KEYS[algorithm], *_row_state_keys(mine, algorithm), *_scale_keys(saved, algorithm))
    others = sorted({k for k in entry if k not in kept} & set(_STATE_OWNER))
    if others:
        raise ValueError(f"Parameter {name!r} is routed to {algorithm} here, but its state in the state "
                         f"dict is {_STATE_OWNER[others[0]]}'s ({others}): it was saved by an optimizer that "
                         "routed it otherwise. Give its group the same \"algorithm\" as when it was saved.")
    for key in STATE_KEYS[algorithm] if entry else ():
        _check_state_tensor(entry.get(key), key, p, name)
    for key in _row_state_keys(mine, algorithm) if entry else ():
        _check_row_state(entry.get(key), key, p, mine["matrix_views"][i], name)
    for key in _scale_keys(saved, algorithm) if entry else ():
        _check_state_tensor(entry.get(key), key, p, name, momentum.scale_shape(p.shape))
        if entry["momentum_buffer"].dtype != torch.int8:
            raise ValueError(f"The state of parameter {name!r} has momentum_buffer in "
                             f"{entry['momentum_buffer'].dtype} beside momentum_dtype='int8': 8-bit momentum "
                             "keeps int8 codes there.")


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
