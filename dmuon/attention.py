"""Attention layers for QK-clip: where a layer's query and key heads live (:class:`AttentionLayer`),
the largest logit per head (:func:`max_logits`), and finding the attention modules dmuon knows in a
model — Hugging Face Llama-like ``q_proj``/``k_proj`` and GPT-2 ``c_attn`` modules, and dmuon's own
test model — with the recording of their logits through transformers' public attention registries
(:func:`record_through_transformers`). :mod:`dmuon.qk_clip` clips with what is found here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon.layout import piece_index_lists

SCORES_PER_CHUNK = 1 << 24  # max_logits holds at most this many fp32 scores at a time (64 MiB)


HF_ATTENTION = "dmuon_qk_logits"  # the prefix of the names max-logit recording registers in transformers



@dataclass(frozen=True, eq=False)
class AttentionLayer:
    """Where one attention layer's query and key heads live.

    Head h of the queries is ``head_dim`` consecutive output features of ``q_weight`` from
    ``q_offset + h·head_dim``; likewise the key heads in ``k_weight``. ``out_dim`` is the weight
    dimension that indexes output features: 0 for ``nn.Linear``, 1 for GPT-2's ``Conv1D``. A
    fused QKV weight is both ``q_weight`` and ``k_weight``, with the key block's offset.

    Args:
        q_weight: the weight holding the query heads (a parameter of the optimizer).
        k_weight: the weight holding the key heads (the same tensor for a fused QKV).
        num_heads: query heads.
        head_dim: features per head.
        num_kv_heads: key heads (grouped-query attention; default ``num_heads``).
        q_offset: the first query feature in ``q_weight``'s output dimension.
        k_offset: the first key feature in ``k_weight``'s output dimension.
        out_dim: the weight dimension that indexes output features (0 or 1).
        q_bias: the query bias, scaled with its heads, if any.
        k_bias: the key bias, if any.
    """

    q_weight: Tensor
    k_weight: Tensor
    num_heads: int
    head_dim: int
    num_kv_heads: int | None = None  # None: as many as query heads
    q_offset: int = 0
    k_offset: int = 0
    out_dim: int = 0
    q_bias: Tensor | None = None
    k_bias: Tensor | None = None

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    def targets(self) -> list[tuple[str, Tensor, int, int]]:
        """(what, tensor, its output dim, first row) of every tensor the clip scales."""
        found = [("q_weight", self.q_weight, self.out_dim, self.q_offset),
                 ("k_weight", self.k_weight, self.out_dim, self.k_offset)]
        found += [("q_bias", self.q_bias, 0, self.q_offset)] if self.q_bias is not None else []
        found += [("k_bias", self.k_bias, 0, self.k_offset)] if self.k_bias is not None else []
        return found



def max_logits(q: Tensor, k: Tensor, scale: float | None = None, *, causal: bool = True,
               attention_mask: Tensor | None = None) -> Tensor:
    """The largest pre-softmax logit ``scale·q·kᵀ`` of each query head, over the batch and every
    position the mask lets through (fp32, shape ``(num_heads,)``).

    ``q``: (batch, heads, queries, head_dim); ``k``: (batch, kv_heads, keys, head_dim), kv_heads
    dividing heads (grouped-query attention, consecutive query heads sharing a key head).
    ``scale``: default head_dim^-½. ``attention_mask``: broadcastable to (batch, heads, queries,
    keys), bool (True: attend) or additive float; without it, ``causal`` masks key j > query i.
    Costs one q·kᵀ product, in chunks of at most ``SCORES_PER_CHUNK`` scores.

    Args:
        q: queries, (batch, heads, queries, head_dim).
        k: keys, (batch, kv_heads, keys, head_dim).
        scale: the logits' scale (default head_dim^-½).
        causal: mask key j > query i when no ``attention_mask`` is given.
        attention_mask: bool (True: attend) or additive float, broadcastable to the scores."""
    batch, heads, queries, head_dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"q has {heads} heads and k {kv_heads}: the key heads must divide the query heads.")
    scale = head_dim ** -0.5 if scale is None else scale
    with torch.no_grad():
        q = q.detach().reshape(batch, kv_heads, heads // kv_heads, queries, head_dim)
        k = k.detach().unsqueeze(2)
        best = torch.full((heads,), -math.inf, dtype=torch.float32, device=q.device)
        rows = max(1, SCORES_PER_CHUNK // max(1, batch * heads * keys))
        for start in range(0, queries, rows):
            stop = min(queries, start + rows)
            scores = (q[:, :, :, start:stop] @ k.transpose(-1, -2)).reshape(batch, heads, stop - start, keys)
            scores = scores.float() * scale
            if attention_mask is not None:
                mask = attention_mask[..., start:stop, :]
                scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
            elif causal:
                i = torch.arange(start, stop, device=q.device)[:, None]
                scores = scores.masked_fill(torch.arange(keys, device=q.device)[None, :] > i, -math.inf)
            best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best



def _attention_heads(module: nn.Module) -> tuple[int | None, int | None, int | None]:
    """(query heads, key heads, head_dim) as a module names them (its own attributes, then its
    Hugging Face config's)."""
    config = getattr(module, "config", None)

    def first(*names: str) -> int | None:
        for owner, name in [(module, n) for n in names] + [(config, n) for n in names]:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    heads = first("num_heads", "n_heads", "num_attention_heads")
    return heads, first("num_key_value_heads", "n_kv_heads") or heads, first("head_dim")



def tensor_parallel_degree(q_weight: Tensor, k_weight: Tensor, heads: int, kv_heads: int, head_dim: int) -> int:
    """How many ranks' heads a module's weights hold where the module counts one rank's: 1 where
    its head counts cover the weights' rows; f where the weights are DTensors (tensor parallel)
    with f times the rows of the module's query and key heads — the module then counts the heads
    of one tensor-parallel rank (torchtitan, Hugging Face tensor-parallel plans), and the
    layer's global counts are f times its own."""
    q_rows, k_rows = heads * head_dim, kv_heads * head_dim
    if not isinstance(q_weight, DTensor) or q_weight.shape[0] == q_rows or q_weight.shape[0] % q_rows:
        return 1
    degree = q_weight.shape[0] // q_rows
    return degree if k_weight.shape[0] == degree * k_rows else 1



def rows_held(weight: Tensor, out_dim: int) -> Tensor | None:
    """The output rows of ``weight`` this rank holds, as global indices (None: all of them)."""
    return piece_index_lists(weight)[out_dim] if isinstance(weight, DTensor) else None



def heads_of_rows(rows: Tensor | None, offset: int, head_dim: int, count: int) -> slice | None:
    """The ``count`` consecutive heads of ``head_dim`` rows from ``offset`` that ``rows`` (global
    row indices, in order) are, or None where they are not such heads."""
    if rows is None or rows.numel() != count * head_dim or count == 0:
        return None
    first = int(rows[0]) - offset
    if first % head_dim or not torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + rows.numel())):
        return None
    return slice(first // head_dim, first // head_dim + count)



def heads_in_forward(module: nn.Module, layer: AttentionLayer, found: dict, count: int) -> slice | None:
    """Which of ``layer``'s query heads the ``count`` that ``module``'s forward pass computed
    are: all (None), or under tensor parallel those of the rows of its query weight this rank
    holds in the forward pass (FSDP2 has gathered the weight's other dimensions by then); None
    too where they are no such heads (the record is then refused at the step). ``found``:
    the answers so far, by the weight's layout (the same every forward pass)."""
    if count == layer.num_heads:
        return None
    weight = getattr(getattr(module, "q_proj", None), "weight", None)
    key = (id(getattr(weight, "device_mesh", None)), tuple(getattr(weight, "placements", ())), count)
    if key not in found:
        rows = rows_held(weight, layer.out_dim) if isinstance(weight, Tensor) else None
        found[key] = heads_of_rows(rows, layer.q_offset, layer.head_dim, count)
    return found[key]



def attention_layer_of(module: nn.Module) -> AttentionLayer | None:
    """The :class:`AttentionLayer` of a module this file recognises, else None: separate
    ``q_proj``/``k_proj`` linears (Hugging Face Llama, Mistral, Qwen…; dmuon's test model; under
    tensor parallel with global head counts, :func:`tensor_parallel_degree`) or a GPT-2
    ``c_attn`` (a ``Conv1D`` of queries, keys and values side by side along dim 1)."""
    heads, kv_heads, head_dim = _attention_heads(module)
    if heads is None or head_dim is None:
        return None
    q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    if isinstance(getattr(q, "weight", None), Tensor) and isinstance(getattr(k, "weight", None), Tensor):
        degree = tensor_parallel_degree(q.weight, k.weight, heads, kv_heads or heads, head_dim)
        return AttentionLayer(q.weight, k.weight, heads * degree, head_dim, (kv_heads or heads) * degree,
                              q_bias=getattr(q, "bias", None), k_bias=getattr(k, "bias", None))
    fused, split = getattr(module, "c_attn", None), getattr(module, "split_size", None)
    if isinstance(getattr(fused, "weight", None), Tensor) and isinstance(split, int):
        return AttentionLayer(fused.weight, fused.weight, heads, head_dim, kv_heads, q_offset=0, k_offset=split,
                              out_dim=1, q_bias=getattr(fused, "bias", None), k_bias=getattr(fused, "bias", None))
    return None



def _recording_attention(module: nn.Module, query: Tensor, key: Tensor, *args: Any, **kwargs: Any) -> Any:
    """The attention function registered in transformers under the name of
    :func:`_registered_name`: records the module's max logits, then runs the implementation the
    model had."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # only ever called by transformers

    recorder = getattr(module, "_dmuon_qk_recorder", None)
    if recorder is not None and torch.is_grad_enabled():
        mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        recorder(max_logits(query, key, kwargs.get("scaling"), causal=causal and query.shape[2] > 1,
                            attention_mask=mask), query=query)
    inner = module._dmuon_inner_attention
    function = ALL_ATTENTION_FUNCTIONS[inner] if inner != "eager" else module._dmuon_eager_attention
    return function(module, query, key, *args, **kwargs)



def _registered_name(inner: str) -> str:
    """The name max-logit recording registers in transformers for a model whose attention is
    ``inner``: one per inner implementation, since the name also picks the attention mask the
    model builds (eager attention takes its causal mask from its caller: without ``inner``'s
    mask it would read the future). Hex digits after the prefix: transformers reads some words
    in a name ("flash", "paged") as requests of its own."""
    return f"{HF_ATTENTION}_{hashlib.sha256(inner.encode()).hexdigest()[:8]}"



def record_through_transformers(model: nn.Module, modules: dict[str, nn.Module],
                                 recorder: Callable[[str, nn.Module], Callable[..., None]]) -> Callable[[], None]:
    """Route a transformers model's attention through :func:`_recording_attention` (its public
    ``AttentionInterface``, ``AttentionMaskInterface`` and ``set_attn_implementation``), with the
    attention mask of the implementation it had; return what undoes it."""
    import importlib

    from transformers import AttentionInterface, AttentionMaskInterface

    inner = model.config._attn_implementation
    name = _registered_name(inner)
    AttentionInterface.register(name, _recording_attention)
    masks = AttentionMaskInterface._global_mapping  # where the model finds ``inner``'s mask function
    if inner in masks:  # else the model builds no mask for ``inner`` either
        AttentionMaskInterface.register(name, masks[inner])
    for module_name, module in modules.items():
        module._dmuon_inner_attention = inner
        # the model file's own eager function: eager is not in the registry
        source = importlib.import_module(type(module).__module__)
        module._dmuon_eager_attention = getattr(source, "eager_attention_forward", None)
        module._dmuon_qk_recorder = recorder(module_name, module)
    model.set_attn_implementation(name)

    def undo() -> None:
        model.set_attn_implementation(inner)
        for module in modules.values():
            module._dmuon_qk_recorder = None
    return undo



def _recording_taken(model: nn.Module, hooked: dict[str, nn.Module]) -> list[str]:
    """The attention modules whose max logits another QKClip records already."""
    taken = [name for name, m in hooked.items() if m.qk_logits_hook is not None]
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if isinstance(implementation, str) and implementation.startswith(HF_ATTENTION):
        taken.append(type(model).__name__)
    return taken



def check_against_modules(layers: Mapping[str, AttentionLayer], model: nn.Module) -> None:
    """Raise a ValueError where a layer's head counts differ from those of the attention module
    of ``model`` whose weights it names (:func:`attention_layer_of`: the module's own
    attributes or its Hugging Face config)."""
    known = {}
    for module_name, module in model.named_modules():
        found = attention_layer_of(module)
        if found is not None:
            known[id(found.q_weight)] = (module_name.removeprefix("module."), found)
    for name, layer in layers.items():
        module_name, found = known.get(id(layer.q_weight), (None, None))
        if found is None or found.k_weight is not layer.k_weight:
            continue
        for key in ("num_heads", "kv_heads", "head_dim", "q_offset", "k_offset", "out_dim"):
            given, own = getattr(layer, key), getattr(found, key)
            if given != own:
                raise ValueError(f"Attention layer {name!r}: {key}={given} but its module {module_name!r} has "
                                 f"{key}={own} (from its configuration): the clip would scale other rows than "
                                 "its heads'.")



def leftover_rows(layer: AttentionLayer) -> list[str]:
    """Rows of a layer's weights that no head covers, described (empty where they are all
    used): a separate q or k weight should be its heads exactly, a fused QKV weight its query,
    key and value heads."""
    q_rows, k_rows = layer.num_heads * layer.head_dim, layer.kv_heads * layer.head_dim
    q_total, k_total = layer.q_weight.shape[layer.out_dim], layer.k_weight.shape[layer.out_dim]
    if layer.q_weight is layer.k_weight:
        used = max(layer.q_offset + q_rows, layer.k_offset + k_rows) + k_rows  # the values follow
        return [f"its fused weight has {q_total} rows, {used} with the values' {k_rows}"] if q_total != used else []
    found = []
    if layer.q_offset + q_rows != q_total:
        found.append(f"its {layer.num_heads} query heads of {layer.head_dim} cover {q_rows} of q_weight's "
                     f"{q_total} rows")
    if layer.k_offset + k_rows != k_total:
        found.append(f"its {layer.kv_heads} key heads of {layer.head_dim} cover {k_rows} of k_weight's "
                     f"{k_total} rows")
    return found



def recordable_attention(model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Module], nn.Module]:
    """The attention modules of ``model`` that :func:`attention_layer_of` recognises, by module
    path in the model's order, and of those the ones without dmuon's ``qk_logits_hook``
    (recorded through a Hugging Face model's attention registry); then the model inside its DDP
    wrapper.

    Raises:
        ValueError: none is recognised, the others' logits cannot be recorded, or another
            QKClip records them already.
    """
    modules = {name.removeprefix("module."): m for name, m in model.named_modules()
               if attention_layer_of(m) is not None}
    if not modules:
        raise ValueError(f"No attention module that QKClip recognises in {type(model).__name__}: describe the "
                         "layers with AttentionLayer, build QKClip(optimizer, layers), and call record() from "
                         "your attention.")
    hooked = {name: m for name, m in modules.items() if hasattr(m, "qk_logits_hook")}
    others = {name: m for name, m in modules.items() if name not in hooked}
    inner = getattr(model, "module", model)  # under DDP
    if others and getattr(getattr(inner, "config", None), "_attn_implementation", None) is None:
        raise ValueError(f"QKClip cannot record the logits of {sorted(others)} by itself: build "
                         "QKClip(optimizer, layers) and call clip.record(name, max_logits(q, k), query=q) from "
                         "their attention.")
    taken = _recording_taken(inner, hooked)
    if taken:
        raise ValueError(f"Another QKClip records the max logits of {taken[0]!r} already: remove() it first "
                         "(one QKClip per model).")
    return modules, others, inner
