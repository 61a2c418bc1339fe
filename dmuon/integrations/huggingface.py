"""Using ``dmuon.Muon`` from Hugging Face Trainer, Accelerate and Lightning.

**Hugging Face Trainer** needs the helper below. Given an optimizer *class*, Trainer calls it
with two param groups of bare tensors (split by weight decay, without names), so routing cannot
tell an embedding or an output head from a hidden matrix: every 2-D tensor would go to Muon.
Trainer also accepts a *factory* in ``optimizer_cls_and_kwargs`` (transformers ≥ 5.2), which it
calls with the model itself; :func:`hf_optimizer_cls_and_kwargs` returns one.

**Accelerate** (``accelerator.prepare(model, optimizer)``, including its FSDP2 path, which swaps
the optimizer's parameter objects for sharded ones after construction) and **Lightning**
(``configure_optimizers`` returning ``dmuon.Muon``; Lightning passes a closure to ``step``) need
no helper: ``dmuon.Muon`` is an ordinary ``torch.optim.Optimizer`` for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from dmuon.optimizer import Muon
from dmuon.routing import default_route, module_roles


def muon_for_model(model: nn.Module, **muon_kwargs: Any) -> Muon:
    """``dmuon.Muon`` for ``model`` with the weight-decay convention of Trainer's default AdamW.

    Parameters with fewer than 2 dimensions (biases, norm gains, scalars) get no weight decay;
    all others get ``muon_kwargs["weight_decay"]``. Parameters with ``requires_grad=False`` are
    left out, as Trainer does. Routing sees the parameter names and the module structure, as
    ``dmuon.Muon(model)`` does: embeddings (tied or not) and output heads go to AdamW, hidden
    matrices to Muon.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"muon_for_model needs the model (an nn.Module), got {type(model).__name__}.")
    # Routed here, where the module structure is known, and handed over as explicit groups:
    # a module type (an nn.Embedding named "shared", a vocabulary-sized head) is lost once
    # parameters travel in groups.
    roles = module_roles(model)
    groups: dict[tuple[str, str, bool], list[tuple[str, Tensor]]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            route = default_route(param, name, roles.get(id(param)))
            groups.setdefault((route.algorithm, route.matrix_view, param.ndim >= 2), []).append((name, param))
    return Muon(
        [
            {"params": params, "algorithm": algorithm, "matrix_view": view, **({} if decay else {"weight_decay": 0.0})}
            for (algorithm, view, decay), params in groups.items()
        ],
        **muon_kwargs,
    )


def _trainer_factory(*params: Any, **kwargs: Any) -> Callable[..., Muon]:
    # Trainer first calls the factory with no arguments, then calls what it returns with
    # (model, **kwargs). A Trainer without factory support calls it like an optimizer class.
    if params or kwargs:
        raise TypeError(
            "This transformers version passes param groups to optimizer_cls_and_kwargs's first element "
            "instead of calling it as a factory with the model; use transformers >= 5.2 (tested: 5.23.0), "
            "or Trainer(optimizers=(dmuon.integrations.muon_for_model(model, ...), None))."
        )
    return muon_for_model


def hf_optimizer_cls_and_kwargs(**muon_kwargs: Any) -> tuple[Callable[[], Callable[..., Muon]], dict[str, Any]]:
    """``Trainer(optimizer_cls_and_kwargs=hf_optimizer_cls_and_kwargs(lr=3e-4, weight_decay=0.1))``.

    Trainer then builds the optimizer with :func:`muon_for_model` on its model (after moving it
    to the device; under FSDP2, before Accelerate shards it). ``muon_kwargs`` are
    ``dmuon.Muon``'s options; Trainer does not apply ``TrainingArguments.learning_rate`` or
    ``weight_decay`` to an optimizer given this way, so pass ``lr`` and ``weight_decay`` here
    (its lr scheduler, warmup included, still scales every group's lr).
    """
    invalid = sorted(set(muon_kwargs) & {"params", "model"})
    if invalid:
        raise TypeError(f"hf_optimizer_cls_and_kwargs takes Muon's options only, not {invalid}: Trainer passes the "
                        "model.")
    return _trainer_factory, muon_kwargs
