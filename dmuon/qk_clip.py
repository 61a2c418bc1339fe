"""QK-clip (MuonClip): keep every attention head's largest logit under a threshold τ.

After each optimizer step, a head h whose largest pre-softmax logit S_h in that step exceeded τ
has its query rows (weight and bias) scaled by γ_h^α and its key rows by γ_h^(1−α), with
γ_h = τ/S_h, so that the same inputs would now give a logit of at most τ; heads under τ are not
touched, and the update rule is unchanged (Kimi K2's MuonClip; α = 0.5 by default). With
grouped-query attention a key head serves several query heads: it takes γ of the largest of
their logits, and each query head its own, so every head's logit still ends ≤ τ.

**Where S comes from.** The model hands each layer's per-head maxima of the step to
:meth:`QKClip.record` (from its own attention kernel), or lets :func:`max_logits` compute them
from q and k: one extra q·kᵀ product per layer, in chunks (about half the matmul FLOPs of the
attention itself, never the full score matrix at once). :meth:`QKClip.for_model` finds the
attention modules it knows (Hugging Face Llama-like ``q_proj``/``k_proj`` and GPT-2 ``c_attn``
modules, and dmuon's own test model; under tensor parallel, where each module counts its own
rank's heads, the layer's global counts from its DTensor weights' rows, and each rank's records
in the slots of the heads it holds) and records for them: for Hugging Face models through
their public attention-function and attention-mask registries (the mask the model's own
implementation gets, so that eager attention stays causal), with no change to the model's
outputs. Records are taken only while autograd is on (a training forward), and their maximum is
kept over micro-batches. They belong to the step whose gradients they came with: a record
counts once the backward pass reaches its forward pass's queries; a step takes the records
counted by the time it reads the gradients (with ``step(closure)``, as Lightning steps: after
the closure's backward pass), and a skipped or failed step, :meth:`QKClip.discard` and a dmuon
``Muon``'s ``zero_grad()`` drop what was recorded.

**Exact in every layout.** After the step, one all-reduce (max) over the job turns each rank's
records into the job's: data-parallel ranks saw other batches, tensor-parallel ranks other
heads. Every rank then derives the same scales (on the CPU, in fp32) and multiplies the rows of
q and k it holds: a whole replica (one process, DDP), its ``Shard`` rows (FSDP2, HSDP,
column-wise tensor parallel), the owner's copy (owner sharding). An element-wise product gives
the same bits wherever a row lives, so replicas stay identical and a sharded run matches one
process. A step that the optimizer skipped (a non-finite gradient) clips nothing.

Construction is local; the ranks compare their clips at the step (in a dmuon ``Muon``'s own
agreement, else in the clip's), before any weight changes. Bad records (a wrong head count, a
non-finite value, an unknown layer) raise the same error on every rank at the step, before any
weight changes.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon.agreement import agree
from dmuon.exchange import GroupRef, all_reduce_max, collective_device, job_group
from dmuon.layout import owned_by, piece_index_lists, piece_of

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


def check_layer(name: str, layer: AttentionLayer, in_optimizer: Collection[int]) -> None:
    """Raise a ValueError naming the layer and the value if ``layer`` is not a consistent
    description of parameters the optimizer updates."""
    for key in ("num_heads", "head_dim"):
        value = getattr(layer, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Invalid {key}={value!r} for attention layer {name!r}. Must be an int >= 1.")
    kv = layer.kv_heads
    if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or layer.num_heads % kv:
        raise ValueError(f"Invalid num_kv_heads={kv!r} for attention layer {name!r}: it must divide "
                         f"num_heads={layer.num_heads}.")
    if layer.out_dim not in (0, 1):
        raise ValueError(f"Invalid out_dim={layer.out_dim!r} for attention layer {name!r}. Must be 0 or 1.")
    for what, tensor, out_dim, offset in layer.targets():
        if not isinstance(tensor, Tensor):
            raise ValueError(f"{what} of attention layer {name!r} is a {type(tensor).__name__}, not a tensor.")
        if tensor.ndim != (2 if what.endswith("weight") else 1):
            raise ValueError(f"{what} of attention layer {name!r} has shape {tuple(tensor.shape)}; a weight "
                             "must be 2-D and a bias 1-D.")
        heads = layer.num_heads if what.startswith("q") else kv
        end = offset + heads * layer.head_dim
        if offset < 0 or end > tensor.shape[out_dim]:
            raise ValueError(f"Attention layer {name!r}: {heads} heads of {layer.head_dim} from row {offset} need "
                             f"rows up to {end}, but {what} has {tensor.shape[out_dim]} along dim {out_dim} (shape "
                             f"{tuple(tensor.shape)}).")
        if id(tensor) not in in_optimizer:
            raise ValueError(f"{what} of attention layer {name!r} (shape {tuple(tensor.shape)}) is not a parameter "
                             "of the optimizer: QK-clip scales the weights the optimizer updates.")
    if layer.q_weight is layer.k_weight:
        q_end = layer.q_offset + layer.num_heads * layer.head_dim
        k_end = layer.k_offset + kv * layer.head_dim
        if layer.q_offset < k_end and layer.k_offset < q_end:
            raise ValueError(f"Attention layer {name!r}: the query rows [{layer.q_offset}, {q_end}) and key rows "
                             f"[{layer.k_offset}, {k_end}) of its fused weight overlap.")


# ---------------------------------------------------------------- the clip's math (pure)


def head_scales(maxima: Tensor, threshold: float, alpha: float, kv_heads: int) -> tuple[Tensor, Tensor]:
    """Per query head and per key head, the factor its rows are multiplied by (fp32, CPU): γ^α
    and γ^(1−α) with γ = τ/S where S > τ, else 1. A key head's S is the largest of its query
    heads' (grouped-query attention: consecutive query heads share a key head)."""
    maxima = maxima.to(torch.float32)
    per_key = maxima.view(kv_heads, -1).amax(dim=1)

    def scale(s: Tensor, power: float) -> Tensor:
        over = s > threshold
        gamma = torch.where(over, threshold / torch.where(over, s, torch.ones_like(s)), torch.ones_like(s))
        return gamma.pow(power)

    return scale(maxima, alpha), scale(per_key, 1.0 - alpha)


def row_scales(rows: int, blocks: list[tuple[int, Tensor]], head_dim: int) -> Tensor:
    """A factor per output row of one tensor: 1, but ``head_dim`` rows per head of each
    (first row, per-head factors) block."""
    out = torch.ones(rows, dtype=torch.float32)
    for offset, per_head in blocks:
        out[offset:offset + per_head.numel() * head_dim] = per_head.repeat_interleave(head_dim)
    return out


def scale_rows_(tensor: Tensor, out_dim: int, scales: Tensor) -> None:
    """Multiply, in place, the output rows of ``tensor`` this rank holds by ``scales`` (one per
    row of the whole tensor): a plain tensor whole, a DTensor its local piece (the scales, spread
    over the tensor's shape, cut as DTensor cuts the tensor: any ``Shard`` or ``_StridedShard``),
    an owner-sharded weight on its owner."""
    owned = owned_by(tensor)
    if owned is not None and not owned.is_mine:
        return  # its owner scales it; the copies here are refreshed from the owner before use
    shape = [1] * tensor.ndim
    shape[out_dim] = -1
    scales = scales.view(shape)
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        scales = piece_of(scales.to(local.device).expand(tensor.shape), tensor.device_mesh, tensor.placements)
    else:
        local = tensor.data
    local.mul_(scales.to(local.device))  # computed in fp32, rounded once to the tensor's dtype


# ---------------------------------------------------------------- recording the logits


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


def closure_then(args: tuple, kwargs: dict[str, Any], then: Callable[[], None]
                 ) -> tuple[tuple, dict[str, Any]] | None:
    """A step pre-hook's new arguments where the step (``args[0]``: the optimizer) runs a
    closure: the closure, followed by ``then`` (also where it raises); None where it runs none."""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None

    def closure_and_then() -> Any:
        try:
            return closure()
        finally:
            then()

    if "closure" in kwargs:
        return args, {**kwargs, "closure": closure_and_then}
    return (args[0], closure_and_then, *args[2:]), kwargs


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


def _record_through_transformers(model: nn.Module, modules: dict[str, nn.Module],
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


# ---------------------------------------------------------------- the clip


NOT_RECORDED = -math.inf
_NONFINITE, _BAD_RECORD = 1.0, 2.0  # per-layer problem codes in the all-reduced records (0: none)


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


def check_settings(threshold: Any, alpha: Any, layers: Mapping[str, Any]) -> None:
    """QKClip's own options, before its layers are checked against the optimizer's parameters."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (
            math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"Invalid threshold={threshold!r}. Must be a finite number > 0.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"Invalid alpha={alpha!r}. Must be in [0, 1].")
    if not layers:
        raise ValueError("QKClip needs at least one attention layer.")
    for name, layer in layers.items():
        if not isinstance(layer, AttentionLayer):
            raise ValueError(f"Attention layer {name!r} is a {type(layer).__name__}, not an AttentionLayer.")


def raise_for_records(codes: Tensor, slots: Mapping[str, slice], problems: dict[str, str], unknown: list[str]) -> None:
    """The same error on every rank, naming the layer, when any rank's records were bad
    (``codes``: one per layer, then one for unknown names, as the ranks agreed on them)."""
    if codes[-1] > 0:
        names = ", ".join(unknown) if unknown else "on another rank"
        raise ValueError(f"QKClip.record was given a layer name it does not know ({names}); its layers are "
                         f"{sorted(slots)}. Nothing was clipped.")
    for i, name in enumerate(slots):
        if codes[i] == _BAD_RECORD:
            detail = problems.get(name, "a bad record on another rank")
            raise ValueError(f"QKClip: attention layer {name!r}: {detail}. Nothing was clipped.")
        if codes[i] == _NONFINITE:
            raise FloatingPointError(f"QKClip: attention layer {name!r} recorded a non-finite max logit (NaN or "
                                     "inf) this step. Nothing was clipped.")


def records_and_codes(records: Tensor, slots: Mapping[str, slice], problems: Mapping[str, str],
                      unknown: list[str]) -> Tensor:
    """What the ranks all-reduce (max) after a step: the records, non-finite ones as not
    recorded, then a problem code per layer and one for unknown names (computed on the
    records' device: no host read per layer)."""
    codes = torch.zeros(len(slots) + 1, dtype=torch.float32, device=records.device)
    nonfinite = records.isnan() | (records == math.inf)
    for i, (name, slot) in enumerate(slots.items()):
        codes[i] = _BAD_RECORD if name in problems else nonfinite[slot].any() * _NONFINITE
    codes[-1] = float(bool(unknown))
    return torch.cat([torch.where(nonfinite, NOT_RECORDED, records), codes])


def scale_heads(layer: AttentionLayer, maxima: Tensor, threshold: float, alpha: float) -> None:
    """Multiply the rows of every tensor of ``layer`` by its heads' factors (:func:`head_scales`)."""
    q_scales, k_scales = head_scales(maxima, threshold, alpha, layer.kv_heads)
    blocks: dict[int, tuple[Tensor, int, list[tuple[int, Tensor]]]] = {}
    for what, tensor, out_dim, offset in layer.targets():
        per_head = q_scales if what.startswith("q") else k_scales
        blocks.setdefault(id(tensor), (tensor, out_dim, []))[2].append((offset, per_head))
    with torch.no_grad():
        for tensor, out_dim, parts in blocks.values():  # a fused weight or bias: scaled once
            scale_rows_(tensor, out_dim, row_scales(tensor.shape[out_dim], parts, layer.head_dim))


def describe(threshold: float, alpha: float, layers: Mapping[str, AttentionLayer],
             positions: Mapping[str, tuple[int, ...]]) -> list[tuple[str, str]]:
    """What the ranks compare of a clip: its settings, and each layer's heads, rows, shapes and
    the positions of its tensors among the optimizer's parameters."""
    rows = [("threshold", repr(float(threshold))), ("alpha", repr(float(alpha)))]
    for name, layer in layers.items():
        shapes = [tuple(t.shape) for _, t, _, _ in layer.targets()]
        rows.append((f"attention layer {name!r}", repr((layer.num_heads, layer.kv_heads, layer.head_dim,
                                                        layer.q_offset, layer.k_offset, layer.out_dim, shapes,
                                                        positions[name]))))
    return rows


class QKClip:
    """QK-clip for the attention layers of a model trained by ``optimizer`` (see the module's
    docstring): after every ``optimizer.step()`` (a step post-hook), one all-reduce of the
    step's records, then the heads over the threshold scaled. It keeps no state: checkpoints
    are unchanged.

    **Records belong to the step whose gradients they came with.** A record taken with its
    forward pass's ``query`` (as :meth:`for_model`'s are) counts once the backward pass reaches
    that query (a forward pass whose backward never ran adds nothing); one without, at once. The
    next ``step()`` uses them (those of its closure too, where it runs one), or drops them where
    it skipped the step or raised, as do
    :meth:`discard` and a dmuon ``Muon``'s ``zero_grad()`` (the gradients they came with are
    gone). With another optimizer, call :meth:`discard` where the loop skips a step.

    **Under torch.distributed** construction is local. With a dmuon ``Muon`` the ranks compare
    their clips (settings and layers) in the agreement that begins each step, before any weight
    changes, and raise the same error if they differ or a rank has none; with another optimizer
    the clip compares them itself before its all-reduce.

    Args:
        optimizer: the optimizer whose steps the clip follows; every tensor the layers name
            must be one of its parameters.
        layers: name → :class:`AttentionLayer`, the same on every rank.
        threshold: τ, the largest logit a head may keep (Kimi K2 used 100).
        alpha: the share of the scaling that goes to the queries (the rest to the keys).
        process_group: the ranks whose records are combined (default: a dmuon ``Muon``'s group,
            else the world).
        model: the model, to check each layer's head counts against its attention module's
            configuration (default: the model a dmuon ``Muon`` was built from).

    Raises:
        ValueError: a threshold or alpha out of range, a layer that does not describe
            parameters of the optimizer, or head counts other than its module's.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, layers: Mapping[str, AttentionLayer], *,
                 threshold: float = 100.0, alpha: float = 0.5, process_group: dist.ProcessGroup | None = None,
                 model: nn.Module | None = None) -> None:
        self.optimizer, self.threshold, self.alpha = optimizer, threshold, alpha
        self.layers = dict(layers)
        # a dmuon Muon agrees on this clip in its step's agreement, over its own ranks
        stepper = getattr(optimizer, "_stepper", None)
        self._companions = stepper.companions if stepper is not None else None
        if process_group is None and stepper is not None:
            process_group = stepper.job()
        self._process_group = GroupRef(job_group(process_group))
        self._check(model if model is not None else stepper.model() if stepper is not None else None)
        self._slots: dict[str, slice] = {}
        start = 0
        for name, layer in self.layers.items():
            self._slots[name] = slice(start, start + layer.num_heads)
            start += layer.num_heads
        self._heads = start  # query heads of all layers: the records' length
        self._description = [(f"QKClip {key}", value)
                             for key, value in describe(self.threshold, self.alpha, self.layers, self._positions)]
        self._records: Tensor | None = None  # committed to the step
        self._problems: dict[str, str] = {}
        self._unknown: list[str] = []
        self._taken: tuple | None = None  # what the step in progress took
        self._last: dict[str, float] = {}
        self._warned: set[str] = set()
        self._undo: list[Callable[[], None]] = []  # for_model's recording, removed by remove()
        self._skipped_before = 0
        self._handles = [optimizer.register_step_pre_hook(self._before_step),
                         optimizer.register_step_post_hook(self._after_step)]
        if self._companions is not None:
            self._companions.append(self)

    @classmethod
    def for_model(cls, optimizer: torch.optim.Optimizer, model: nn.Module, *, threshold: float = 100.0,
                  alpha: float = 0.5, process_group: dist.ProcessGroup | None = None) -> QKClip:
        """A QKClip for every attention module of ``model`` (wrapped or not) that
        :func:`recordable_attention` finds, by module path, recording their max logits itself
        (dmuon's model through its hook; a Hugging Face model through its attention registry,
        with the mask its implementation builds). Raises as :func:`recordable_attention` does."""
        modules, others, inner = recordable_attention(model)
        clip = cls(optimizer, {name: attention_layer_of(m) for name, m in modules.items()}, threshold=threshold,
                   alpha=alpha, process_group=process_group, model=model)
        hooked = {name: m for name, m in modules.items() if name not in others}  # dmuon's: its own hook
        for name, module in hooked.items():
            module.qk_logits_hook = clip._logits_recorder(name, module)
            clip._undo.append(partial(setattr, module, "qk_logits_hook", None))
        if others:
            clip._undo.append(_record_through_transformers(inner, others, clip._logits_recorder))
        return clip

    # ------------------------------------------------------------ construction

    def _device(self) -> torch.device:
        return collective_device(self.optimizer.param_groups, self._process_group())

    def _check(self, model: nn.Module | None) -> None:
        check_settings(self.threshold, self.alpha, self.layers)
        positions = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        for name, layer in self.layers.items():
            check_layer(name, layer, positions.keys())
        if model is not None:
            check_against_modules(self.layers, model)
        for name, layer in self.layers.items():
            for left in leftover_rows(layer):
                warnings.warn(f"QKClip: attention layer {name!r}: {left}; the other rows are not clipped. Check "
                              "num_heads, num_kv_heads and head_dim if they should be.", stacklevel=3)
        self._positions = {name: tuple(positions[id(t)] for _, t, _, _ in layer.targets())
                           for name, layer in self.layers.items()}

    def step_fingerprint(self) -> list[tuple[str, str]]:
        """What a dmuon ``Muon``'s step agreement compares of this clip: its settings and layers."""
        return self._description

    def remove(self) -> None:
        """Stop clipping: remove the step hooks and the recording :meth:`for_model` installed."""
        for handle in self._handles:
            handle.remove()
        for undo in self._undo:
            undo()
        self._undo = []
        if self._companions is not None and self in self._companions:
            self._companions.remove(self)

    # ------------------------------------------------------------ recording

    def record(self, name: str, values: Tensor, heads: slice | None = None, *, query: Tensor | None = None) -> None:
        """Record layer ``name``'s per-head max logits (any device; kept: the maximum over calls
        until the step).

        Args:
            name: the layer's name in ``layers``.
            values: one max logit per head of ``heads`` (:func:`max_logits`).
            heads: which query heads ``values`` covers (tensor parallel: this rank's); default all.
            query: the forward pass's query tensor: the record counts once the backward pass
                reaches it (its gradient is computed). Without it the record counts at once,
                so a ``zero_grad()`` between this forward pass and its backward drops it.

        A wrong name, ``heads`` or shape is reported at the step, on every rank, before any
        weight changes."""
        slot = self._slots.get(name)
        if slot is None:
            self._unknown.append(repr(name))
            return
        count = slot.stop - slot.start
        if heads is not None and not isinstance(heads, slice):
            self._problems[name] = f"heads={heads!r} is not a slice of its {count} heads"
            return
        start, stop, step = (heads or slice(0, count)).indices(count)
        values = values.detach().reshape(-1) if isinstance(values, Tensor) else values
        if step != 1 or not isinstance(values, Tensor) or values.numel() != stop - start:
            got = tuple(values.shape) if isinstance(values, Tensor) else type(values).__name__
            self._problems[name] = (f"recorded {got} for heads [{start}, {stop}) of its {count} heads (one value "
                                    "per head)")
            return
        rows = slice(slot.start + start, slot.start + stop)
        if query is not None and query.requires_grad and torch.is_grad_enabled():
            query.register_hook(partial(self._commit_at_backward, rows, values))
        else:
            self._commit(rows, values)

    def _commit(self, rows: slice, values: Tensor) -> None:
        if self._records is None:
            self._records = torch.full((self._heads,), NOT_RECORDED, dtype=torch.float32, device=values.device)
        part = self._records[rows]
        torch.maximum(part, values.to(part.device, torch.float32), out=part)

    def _commit_at_backward(self, rows: slice, values: Tensor, grad: Tensor) -> None:
        self._commit(rows, values)

    def _logits_recorder(self, name: str, module: nn.Module) -> Callable[..., None]:
        """What a watched module calls with q and k (dmuon's model) or with its max logits and
        its query (Hugging Face), for the heads it computed (:func:`heads_in_forward`)."""
        heads_here = partial(heads_in_forward, module, self.layers[name], {})

        def recorder(q_or_maxima: Tensor, k: Tensor | None = None, *, query: Tensor | None = None) -> None:
            if not torch.is_grad_enabled():
                return  # evaluation: not the step's logits
            values = max_logits(q_or_maxima, k) if k is not None else q_or_maxima
            self.record(name, values, heads_here(values.numel()), query=q_or_maxima if k is not None else query)
        return recorder

    def discard(self) -> None:
        """Drop the records taken for the coming step (a dmuon ``Muon``'s ``zero_grad()`` calls
        it; with another optimizer call it where the loop skips a step). Local: not collective."""
        self._take()

    def _take(self) -> tuple[Tensor | None, dict[str, str], list[str]]:
        taken = self._records, self._problems, self._unknown
        self._records, self._problems, self._unknown = None, {}, []
        return taken

    # ------------------------------------------------------------ after the step

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict[str, Any]
                     ) -> tuple[tuple, dict[str, Any]] | None:
        """Take the records the step's gradients came with (a step that raises takes them with
        it): those taken so far, or where the step runs a closure, once it ran (:func:`closure_then`)."""
        self._skipped_before = getattr(optimizer, "skipped_steps", 0)
        self._taken = None
        wrapped = closure_then(args, kwargs, self._take_for_step)
        if wrapped is None:
            self._take_for_step()
        return wrapped

    def _take_for_step(self) -> None:
        self._taken = self._take()

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        skipped = getattr(optimizer, "skipped_steps", 0) != self._skipped_before
        taken, self._taken = self._taken or (None, {}, []), None
        self._clip(*taken, apply=not skipped, agreed=self._companions is not None)

    def clip(self, apply: bool = True) -> None:
        """Agree on the records taken so far (one all-reduce max) and scale the heads over τ
        (unless ``apply`` is False); then forget the records. Runs after every step by itself;
        collective under torch.distributed."""
        self._clip(*self._take(), apply=apply, agreed=False)

    def _clip(self, records: Tensor | None, problems: dict[str, str], unknown: list[str], apply: bool,
              agreed: bool) -> None:
        """``agreed``: the ranks compared their clips already (in a dmuon ``Muon``'s step)."""
        total, group = self._heads, self._process_group()
        if group is not None and not agreed:
            agree("QKClip", self._description, group, self._device(), what="QK-clip configuration")
        records = records if records is not None else torch.full((total,), NOT_RECORDED)
        values = records_and_codes(records.to(self._device()), self._slots, problems, unknown)
        if group is not None:
            all_reduce_max(values, group)
        values = values.cpu()
        raise_for_records(values[total:], self._slots, problems, unknown)
        self._last = {}
        heads_clipped, best = 0, NOT_RECORDED
        for name, slot in self._slots.items():
            maxima, layer = values[slot], self.layers[name]
            if bool((maxima == NOT_RECORDED).all()):
                if name not in self._warned:
                    self._warned.add(name)
                    warnings.warn(f"QKClip: no rank recorded max logits for attention layer {name!r} this step, so it "
                                  "was not clipped (record them every step; a record taken without query= before "
                                  "zero_grad() is dropped by it; this warning is shown once per layer).",
                                  stacklevel=2)
                continue
            self._last[f"qk_clip/max_logit/{name}"] = maxima.max().item()
            best = max(best, maxima.max().item())
            over = int((maxima > self.threshold).sum())
            heads_clipped += over
            if over and apply:
                scale_heads(layer, maxima, float(self.threshold), float(self.alpha))
        self._last.update({"qk_clip/max_logit": best, "qk_clip/heads_clipped": float(heads_clipped if apply else 0)})

    def statistics(self) -> dict[str, float]:
        """The last step's figures (the job's, the same on every rank): ``qk_clip/max_logit``,
        ``qk_clip/heads_clipped`` (query heads scaled) and ``qk_clip/max_logit/<layer>``."""
        return dict(self._last)
