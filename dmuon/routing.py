"""Which parameters Muon updates, and how it sees each one as a (batch of) matrices. Pure.

Default rule, in order (first match wins):

1. fewer than 2 dimensions (biases, norm gains, scalars), or matrices
   with a dimension of 1 (vectors in disguise, e.g. a ``(1, 1, d)`` token)  → AdamW
2. an embedding table (``nn.Embedding``/``nn.EmbeddingBag`` weight, or a
   parameter or module whose name contains ``embed``, or is ``wte``/``wpe``) → AdamW
3. an output head: its module is named ``lm_head``, ``output``, ``head``,
   ``classifier``, ``score`` or ``embed_out``, or it is a Linear whose
   ``out_features`` equals an embedding's vocabulary (tied heads are
   caught by rule 2, since they *are* the embedding's tensor)       → AdamW
   — and a robot policy's action and state input/output projections, by
   their module's name (:data:`ACTION_IO_NAME`: openpi's and LeRobot's
   ``action_in_proj``, ``action_out_proj``, ``state_proj``): they map a
   low-dimensional action or state vector into the model's width and back,
   the embedding and head of a vision–language–action model         → AdamW
4. a convolution kernel (``nn.Conv*`` weight) → Muon on the kernel flattened to (out, in·k…)
5. 2-D → Muon on the matrix; other 3-D → Muon on a stack of matrices (expert weights ``(E, m, n)``);
   4-D and more → Muon on the flattened kernel (the layout of conv weights).

Rules 2–4 need names or the module: pass the model (or ``named_parameters()``) for them to apply.
A param group's ``"algorithm"`` key ("muon"/"adamw") and ``"matrix_view"`` key override the rule.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, nn

Algorithm = Literal["muon", "adamw"]
MatrixView = Literal["auto", "flatten", "batch"]
ALGORITHMS: tuple[str, ...] = ("muon", "adamw")
MATRIX_VIEWS: tuple[str, ...] = ("auto", "flatten", "batch")

HEAD_MODULE_NAMES = frozenset({"lm_head", "output", "head", "classifier", "score", "embed_out"})
EMBEDDING_NAMES = frozenset({"wte", "wpe"})
# A policy's action/state input and output layers, by module name (openpi's and LeRobot's π0,
# π0.5 and SmolVLA: action_in_proj, action_out_proj, state_proj): the name, not the shape,
# decides, since a shape rule (a side of a few dozen) would also take LoRA factors and small heads.
ACTION_IO_NAME = re.compile(r"(action|actions|state|proprio)_(in_|out_)?proj")
_CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class Route:
    """Where one parameter goes, and why (shown in the optimizer's routing summary)."""

    algorithm: Algorithm
    matrix_view: MatrixView
    reason: str


def module_roles(model: nn.Module) -> dict[int, str]:
    """Map ``id(param)`` to "embedding", "head" or "conv" for the parameters whose role the
    module structure reveals. A parameter shared by several modules keeps the first role found
    for an embedding (so a tied head stays with its embedding)."""
    roles: dict[int, str] = {}
    vocab_sizes = {
        m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
    }
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, Tensor):
            continue
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            roles[id(weight)] = "embedding"
        elif isinstance(module, _CONV_TYPES):
            roles.setdefault(id(weight), "conv")
        elif isinstance(module, nn.Linear) and (
            name.rsplit(".", 1)[-1] in HEAD_MODULE_NAMES or module.out_features in vocab_sizes
        ):
            roles.setdefault(id(weight), "head")
    return roles


def _role_from_name(name: str | None) -> str | None:
    if not name:
        return None
    # Only the owning module's name and the parameter's own: a Linear *inside* a
    # "time_embedding" block is an ordinary hidden matrix.
    module_name, _, param_name = name.lower().rpartition(".")
    module_name = module_name.rpartition(".")[2]
    if any("embed" in part or part in EMBEDDING_NAMES for part in (module_name, param_name)):
        return "embedding"
    if module_name in HEAD_MODULE_NAMES:
        return "head"
    if ACTION_IO_NAME.fullmatch(module_name):
        return "action/state projection"
    return None


def default_route(param: Tensor, name: str | None = None, role: str | None = None) -> Route:
    """The default routing rule (module docstring) for one parameter."""
    if param.ndim < 2:
        return Route("adamw", "auto", f"{param.ndim}-D (bias, norm or scalar)")
    # rules 2 and 3 before 4: a convolution named as an embedding (a ViT's patch_embed) is one
    named = _role_from_name(name)
    role = named if role in (None, "conv") and named else role
    if role == "embedding":
        return Route("adamw", "auto", "embedding")
    if role == "head":
        return Route("adamw", "auto", "output head")
    if role == "action/state projection":
        return Route("adamw", "auto", "action/state input or output projection")
    if role == "conv" or param.ndim >= 4:
        # "auto" already flattens 4-D and more; only a 3-D (Conv1d) kernel needs saying so.
        route = Route("muon", "flatten" if param.ndim == 3 else "auto", "convolution kernel, flattened")
    elif param.ndim == 3:
        route = Route("muon", "auto", "stack of matrices (experts)")
    else:
        route = Route("muon", "auto", "hidden matrix")
    if min(matrix_shape(param.shape, route.matrix_view)[1:]) == 1:
        return Route("adamw", "auto", "degenerate matrix (a dimension of 1)")
    return route


def matrix_shape(shape: Iterable[int], matrix_view: str) -> tuple[int, int, int]:
    """``(count, m, n)``: how Muon sees a parameter of ``shape`` as ``count`` m×n matrices.

    "auto" means: 2-D as is, 3-D as a stack, ≥ 4-D flattened (see the routing rule).
    """
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"Muon needs at least 2-D parameters, got shape {shape}.")
    if matrix_view == "auto":
        matrix_view = "flatten" if len(shape) >= 4 else "batch"
    if matrix_view == "flatten":
        return 1, shape[0], math.prod(shape[1:])
    if matrix_view == "batch":
        return math.prod(shape[:-2]), shape[-2], shape[-1]
    raise ValueError(f"Invalid matrix_view={matrix_view!r}. Must be one of {MATRIX_VIEWS}.")


def row_shape(shape: Iterable[int], matrix_view: str) -> tuple[int, ...]:
    """One number per row of the matrices Muon sees in a parameter of ``shape`` (an update
    rule's row state, :mod:`dmuon.rules`): the shape without its last dimension, or for a
    flattened parameter its first."""
    shape = tuple(shape)
    count, m, _ = matrix_shape(shape, matrix_view)
    return shape[:-1] if count * m == math.prod(shape[:-1]) else shape[:1]


def is_stack(param: Tensor, matrix_view: str) -> bool:
    """Whether Muon sees ``param`` as a stack of matrices along dim 0 (3-D expert weights)."""
    return param.ndim == 3 and matrix_view in ("auto", "batch")
