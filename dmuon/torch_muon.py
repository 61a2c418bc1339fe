"""``torch.optim.Muon``'s state dicts: recognised, and converted to dmuon's form for the same
param groups, so that ``dmuon.Muon.load_state_dict`` takes over a run that torch's Muon began."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dmuon.param_groups import names_of

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
