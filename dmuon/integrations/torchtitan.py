"""``dmuon.Muon`` as the optimizer of a torchtitan job (torchtitan 0.3.0, tested).

torchtitan builds its optimizers through ``OptimizersContainer``: one optimizer per model part
(per pipeline stage a rank holds) and per optimizer name in its ``ParamGroupConfig``s, from a
fixed table of names. :class:`DMuonOptimizersContainer` is that container with one more name,
``"DMuon"``; everything else (param groups by FQN pattern, the flat FQN-keyed state dict that
DCP saves and reshards, the zero-gradient step that creates state before a load, lr schedulers,
the checkpoint manager) is torchtitan's own.

What dmuon does with what the container gives it:

- ``fused`` and ``foreach``, which the container puts into every group, choose torch's AdamW
  kernels; dmuon steps its parameters in batches of its own whatever they say, so they are
  dropped from dmuon's groups (a ``"DMuon"`` group that sets them itself loses them too).
- ``param_names`` (FQNs) route each parameter as ``dmuon.Muon(model)`` would: embeddings,
  output heads and parameters under 2 dimensions to dmuon's AdamW, hidden matrices to Muon. One
  catch-all ``"DMuon"`` group is the usual configuration (:func:`dmuon_optimizer_config`).
- ``optimizer_factory_kwargs_by_name["DMuon"]`` goes to ``dmuon.Muon``'s constructor (e.g.
  ``process_group``, ``comm_dtype``), the group's ``optimizer_kwargs`` into the group (``lr``,
  ``weight_decay``, ``momentum``, ``adamw_lr``, …). An option dmuon does not have is refused on
  every rank, naming it and dmuon's nearest.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from dmuon.optimizer import Muon

DMUON = "DMuon"
# torchtitan's own names, as its container resolves them (0.3.0)
TORCHTITAN_OPTIMIZERS = ("Adam", "AdamW", "DistMuon")
IMPLEMENTATION_KEYS = frozenset({"fused", "foreach"})


def build_dmuon(param_groups: list[dict[str, Any]], **options: Any) -> Muon:
    """``dmuon.Muon`` over the container's param groups, less torch's kernel switches."""
    return Muon([{k: v for k, v in group.items() if k not in IMPLEMENTATION_KEYS} for group in param_groups],
                **options)


class DMuonOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also builds ``"DMuon"`` (``dmuon.Muon``).

    Args:
        config: the container's configuration; ``ParamGroupConfig(optimizer_name="DMuon", ...)``
            groups become one ``dmuon.Muon`` per model part.
        model_parts: the model parts this rank holds (one per pipeline stage it runs).

    Raises:
        NotImplementedError: for an optimizer name the container does not know, naming the
            nearest one.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Any:
        if name == DMUON:
            return build_dmuon
        if name not in TORCHTITAN_OPTIMIZERS:
            known = [DMUON, *TORCHTITAN_OPTIMIZERS]
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.5)
            raise NotImplementedError(f"Unknown optimizer_name {name!r}: DMuonOptimizersContainer builds {known}."
                                      + (f" Did you mean {close[0]!r}?" if close else ""))
        return OptimizersContainer._resolve_optimizer_factory(name)

    @property
    def dmuon_optimizers(self) -> list[Muon]:
        """The ``dmuon.Muon`` instances, one per model part that has ``"DMuon"`` groups."""
        return [optimizer for optimizer in self.optimizers if isinstance(optimizer, Muon)]


def dmuon_optimizer_config(lr: float = 0.02, weight_decay: float = 0.1, *, pattern: str = r".*",
                           muon_options: dict[str, Any] | None = None,
                           **group_options: Any) -> DMuonOptimizersContainer.Config:
    """A container config with one ``"DMuon"`` group matching ``pattern`` (every parameter).

    Args:
        lr: Muon's learning rate (and dmuon's AdamW's, unless ``adamw_lr`` is given).
        weight_decay: decoupled weight decay of every parameter in the group.
        pattern: regex over parameter FQNs; the default takes every trainable parameter.
        muon_options: ``dmuon.Muon`` constructor options that are not group options
            (``process_group``, ``comm_dtype``, ``bucket_bytes``, ``early_start``, …).
        **group_options: further group options (``momentum``, ``adamw_lr``, ``ns_steps``, …).
    """
    return DMuonOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=pattern, optimizer_name=DMUON,
                                       optimizer_kwargs={"lr": lr, "weight_decay": weight_decay, **group_options})],
        optimizer_factory_kwargs_by_name={DMUON: dict(muon_options or {})},
    )


__all__ = ["DMUON", "DMuonOptimizersContainer", "build_dmuon", "dmuon_optimizer_config"]
