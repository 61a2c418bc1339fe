"""The state-dict hooks of owner sharding: a rank's ``model.state_dict()`` holds the matrices it
owns (whole, as plain tensors) and leaves out the others, and ``load_state_dict`` loads each
matrix on its owner only, without reporting the others missing; so
``torch.distributed.checkpoint`` saves each matrix once and loads it at any world size."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch import nn

from dmuon.owner.layer import Ownership


def _drop_unowned(ownership: Ownership, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, p in module.named_parameters(recurse=False):
        if id(p) in ownership.owner_of and not ownership.is_mine(p):
            state_dict.pop(prefix + name, None)


def _skip_unowned_on_load(ownership: Ownership, not_missing: set[str], module: nn.Module, state_dict: dict,
                          prefix: str, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
    for name, p in module.named_parameters(recurse=False):
        if id(p) in ownership.owner_of and not ownership.is_mine(p):
            state_dict.pop(prefix + name, None)  # the owner loads it
            not_missing.add(prefix + name)


def _forgive_unowned(not_missing: set[str], weights_changed: Callable[[], None], module: nn.Module,
                     incompatible_keys) -> None:
    for key in list(incompatible_keys.missing_keys):
        if key in not_missing:
            incompatible_keys.missing_keys.remove(key)
    weights_changed()


def install_state_dict_hooks(model: nn.Module, ownership: Ownership, weights_changed: Callable[[], None]) -> list:
    """The hooks on every module that holds owner-sharded parameters; their handles. A load
    calls ``weights_changed`` (the next forward broadcasts the loaded weights)."""
    not_missing: set[str] = set()  # state-dict keys the owners load, not this rank
    handles = []
    for module in model.modules():
        if any(id(p) in ownership.owner_of for p in module.parameters(recurse=False)):
            # partial: torch marks hooks with an attribute, which bound methods cannot take
            handles.append(module.register_state_dict_post_hook(partial(_drop_unowned, ownership)))
            handles.append(module.register_load_state_dict_pre_hook(
                partial(_skip_unowned_on_load, ownership, not_missing)))
            handles.append(module.register_load_state_dict_post_hook(
                partial(_forgive_unowned, not_missing, weights_changed)))
    return handles
