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

import math
import warnings
from collections.abc import Callable, Collection, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from dmuon.agreement import agree
from dmuon.attention import (
    AttentionLayer,
    attention_layer_of,
    check_against_modules,
    heads_in_forward,
    leftover_rows,
    max_logits,
    record_through_transformers,
    recordable_attention,
)
from dmuon.exchange import GroupRef, all_reduce_max, collective_device, job_group
from dmuon.layout import owned_by, piece_of
from dmuon.optimizer import Muon


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


# ---------------------------------------------------------------- the step's closure


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


# ---------------------------------------------------------------- the clip


NOT_RECORDED = -math.inf
_NONFINITE, _BAD_RECORD = 1.0, 2.0  # per-layer problem codes in the all-reduced records (0: none)


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
        stepper = optimizer.stepper if isinstance(optimizer, Muon) else None
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
            clip._undo.append(record_through_transformers(inner, others, clip._logits_recorder))
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
