"""FLOPs, bytes and seconds of each phase of a data-parallel training step. Pure: no processes,
no measurements (those live in :mod:`dmuon.tools.hardware`); the schedule is :mod:`dmuon.tools.simulate`.

A step is: forward+backward (with the data-parallel collectives of FSDP2 or DDP), then the
optimizer. The optimizer phases are priced with the *real* dmuon plan — the same
:func:`dmuon.planner.make_plan` on the same units, with the Newton–Schulz method and dtype that
:func:`dmuon.orthogonalization.resolve_config` picks on the profile's device (CUDA: fp16, Gram NS
from aspect ratio 2; CPU: bf16 standard NS) — so FLOPs and bytes per rank are the plan's own.

Assumptions, each stated where it is used:

* Forward+backward FLOPs: ``6·P·T + 12·L·(heads·head_dim)·S·T`` for T tokens of sequences of
  length S, P the parameters that take part in products (hidden matrices and the output head;
  the embedding lookup is free). The attention term counts the full S×S score matrix (PaLM's
  convention: causal kernels do about half). Time = FLOPs / (listed rate · MFU).
* FSDP2 all-gathers every parameter in forward and again in backward (``reshard_after_forward``)
  and reduce-scatters the gradients; DDP all-reduces the gradients (2(N−1)/N·P·4 bytes, the ring
  cost). Ring collectives cross nodes at the inter-node bandwidth once N exceeds a node.
* Element-wise phases are memory-bound: bytes per element counted from the kernels that
  dmuon/optimizer.py, dmuon/step/values.py, torch's AdamW and the FSDP2/DDP wrappers run (constants
  below), at the workload's ``elementwise_efficiency`` of the profile's rates: 1 on GPUs; on a
  CPU, where a real step's kernels meet cold caches, fresh allocations and per-call dispatch
  that the profile's streaming benchmark does not, the share one rank's measured optimizer
  step reaches. Forward+backward wall time = products + wrapper copies, with the data-parallel
  collectives hidden behind them where the hardware overlaps communication (GPUs) and added
  where it does not (CPU).
* Ring collectives reach the link bandwidth times the profile's efficiency for their kind
  (NCCL: 1; gloo: measured), plus one latency per call.
* Owner-sharded data parallel (``dmuon.shard_by_owner``): each Muon matrix lives whole on its
  owner (chosen as the implementation does, :func:`dmuon.planner.plan_ownership`: shares of NS
  FLOPs and bytes balanced together); forward broadcasts it and
  backward reduces its gradient to the owner, 2(N−1)/N·P_muon bytes per rank; the other
  parameters stay under FSDP2; the optimizer communicates nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from dmuon.choices import (
    Choices,
    MatrixOptions,
    choose,
    column_block_cost,
    column_block_flops,
    column_blocks_fit,
    gang_member_flops,
    gang_slice_elements,
)
from dmuon.layout import Layout
from dmuon.orthogonalization import NSConfig, newton_schulz_flops, resolve_config
from dmuon.planner import DEFAULT_BUCKET_BYTES, Plan, Unit, exchange_plans, make_plan, plan_ownership
from dmuon.tools.hardware import RING_BYTES, HardwareProfile
from dmuon.tools.models import (
    MOE_PRESETS,
    PRESETS,
    VLA_PRESETS,
    LlamaConfig,
    VLAConfig,
    block_matrices,
    get_config,
    muon_units,
    param_count,
    trainable_params,
)

MODES = ("fsdp2", "ddp", "owner")
# torchtitan's tensor-parallel plan for a Llama block: these weights column-wise (Shard(0) on the
# tp dimension), o and down row-wise (Shard(1)); a mixture of experts' router stays replicated over tp
COLUMN_WISE = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
DEFAULT_TOKENS_PER_RANK = 8192
DEFAULT_SEQ_LEN = 4096
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb

# Bytes per element of each element-wise phase (reads + writes; fp32 parameters, gradients and
# momentum), counted from the code that runs:
CHECK_BYTES = 4  # the non-finite check (a min/max reduction) reads every local grad once
MOMENTUM_BYTES = 12  # buf.lerp_(grad): every local Muon element
NESTEROV_BYTES = 12  # grad.lerp(buf): the NS input, where and when the exchange needs it
APPLY_BYTES = 20  # p.mul_(1 − lr·wd) and p.add_(update): every local Muon element
FSDP_COPY_BYTES = 24  # per FSDP2 parameter: copy-out after both all-gathers, copy-in before the reduce-scatter
DDP_COPY_BYTES = 16  # per DDP parameter: gradient into its bucket and back
# AdamW per parameter: fused/foreach kernels read p, g, m, v and write p, m, v (docs/hardware.md §Bytes per element);
# on CPU torch runs its single-tensor loop (8 kernels, temporaries for sqrt and division).
ADAMW_BYTES = {"cuda": 28, "cpu": 80}
# torch.optim.Muon's recipe (docs/numerics.md §torch.optim.Muon's recipe): what "vanilla" Muon runs on every rank.
VANILLA_NS_DTYPE = torch.bfloat16


def pack_bytes(itemsize: int) -> int:
    """Per element sent: the engine concatenates the pieces of a collective (read + write)."""
    return 2 * itemsize


def normalize_bytes(compute_dtype: torch.dtype) -> int:
    """Per element orthogonalized: fp32 normalization (norm: read; divide: read + write), cast
    to the compute dtype and back to fp32."""
    c = torch.empty(0, dtype=compute_dtype).element_size()
    return 12 + (4 + c) + (c + 4)


def ns_prep_bytes(itemsize: int, compute_dtype: torch.dtype) -> int:
    """Per element of a matrix its owner orthogonalizes: assembling its rows and stacking
    same-shape matrices (two copies), then :func:`normalize_bytes`."""
    return 4 * itemsize + normalize_bytes(compute_dtype)


# ---------------------------------------------------------------------------- models


def config_from_hf(raw: Mapping[str, object]) -> LlamaConfig:
    """A :class:`LlamaConfig` from a Hugging Face ``config.json`` of a Llama-style decoder.

    Required keys: hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
    vocab_size. Optional: num_key_value_heads (default: the attention heads), head_dim (default
    hidden_size / heads), tie_word_embeddings (False), max_position_embeddings (4096),
    rms_norm_eps, rope_theta.
    """
    required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    missing = [key for key in required if key not in raw]
    if missing:
        raise ValueError(f"config.json lacks {missing}; a Llama-style config needs {list(required)}")
    heads, width = int(raw["num_attention_heads"]), int(raw["hidden_size"])
    if heads < 1 or ("head_dim" not in raw and width % heads):
        raise ValueError(f"num_attention_heads ({heads}) must divide hidden_size ({width}) when the config gives "
                         "no head_dim")
    return LlamaConfig(
        vocab_size=int(raw["vocab_size"]),
        dim=int(raw["hidden_size"]),
        ffn_dim=int(raw["intermediate_size"]),
        n_layers=int(raw["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
        max_seq_len=int(raw.get("max_position_embeddings") or DEFAULT_SEQ_LEN),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
    )


PRESET_NAMES = (*PRESETS, *MOE_PRESETS, *VLA_PRESETS)


def load_model_config(spec: str, layers: int | None = None) -> LlamaConfig | VLAConfig:
    """A preset name (:data:`PRESET_NAMES`) or a path to a ``config.json``; ``layers`` overrides
    the depth."""
    overrides = {"n_layers": layers} if layers else {}
    if spec in PRESET_NAMES:
        return get_config(spec, **overrides)
    if not os.path.isfile(spec):
        raise ValueError(f"{spec!r} is neither a model preset ({', '.join(PRESET_NAMES)}) nor a config.json file")
    with open(spec) as f:
        return dataclasses.replace(config_from_hf(json.load(f)), **overrides)


def muon_params(config: LlamaConfig) -> int:
    return sum(count * m * n for _, count, m, n in muon_units(config))


def expert_params(config: LlamaConfig) -> int:
    """Parameters of the expert stacks (0 for a dense model)."""
    return sum(count * m * n for name, count, m, n in muon_units(config) if ".experts." in name)


def active_params(config: LlamaConfig) -> float:
    """Parameters of the hidden matrices a token passes through: the experts it is routed to
    (``experts_per_token`` of ``n_experts``), every other matrix."""
    experts = expert_params(config)
    return muon_params(config) - experts + experts * config.experts_per_token / max(config.n_experts, 1)


def forward_backward_flops(config: LlamaConfig | VLAConfig, tokens: int, seq_len: int) -> float:
    """``6·P·T + 12·L·(heads·head_dim)·S·T`` (module docstring), P = hidden matrices a token
    passes through (:func:`active_params`) + head. A VLA: :func:`vla_forward_backward_flops`."""
    if isinstance(config, VLAConfig):
        return vla_forward_backward_flops(config, tokens / config.max_seq_len)
    in_products = active_params(config) + config.vocab_size * config.dim
    attention = 12 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return float(tokens) * (6 * in_products + attention)


def vla_forward_backward_flops(config: VLAConfig, samples: float) -> float:
    """The same count per stream of a VLA's ``samples``: the vision tower's products on the
    patches (forward only, 2·P·T, when frozen), the projector and language model on the patches
    and prompt, the head on the prompt, the action expert on the action tokens; attention over
    the tokens each stream's queries see."""
    vision, lm, act = config.vision, config.language, config.action
    patches, prefix, actions = vision.n_patches, config.prefix_tokens, config.action_steps
    tower = sum(m * n for _, m, n in vision.matrices()) * patches + 2 * vision.n_layers * vision.dim * patches**2
    tower *= 2 if config.freeze_vision else 6
    lm_block, act_block = (sum(m * n for _, m, n in block_matrices(c)) for c in (lm, act))
    attention = 12 * lm.n_layers * lm.n_heads * lm.head_dim * config.max_seq_len
    language = prefix * (6 * (lm.n_layers * lm_block + lm.dim * vision.dim) + attention)
    expert = actions * (6 * act.n_layers * act_block + attention)
    head = 6 * config.text_tokens * lm.vocab_size * lm.dim
    return samples * (tower + language + expert + head)


def measured_mfu(config: LlamaConfig, tokens: int, seq_len: int, seconds: float, profile: HardwareProfile) -> float:
    """The MFU a measured forward+backward of ``tokens`` tokens in ``seconds`` corresponds to."""
    return forward_backward_flops(config, tokens, seq_len) / seconds / profile.matmul_flops(profile.train_dtype)


# ---------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    """One training step of ``config`` on ``world_size`` data-parallel ranks of ``profile``."""

    config: LlamaConfig
    world_size: int
    mode: str
    profile: HardwareProfile
    tokens_per_rank: int = DEFAULT_TOKENS_PER_RANK
    seq_len: int = DEFAULT_SEQ_LEN
    mfu: float | None = None  # None: the profile's
    # share of the profile's element-wise rates (memory bandwidth, check rate) the optimizer's
    # element-wise phases reach in a real step: 1 on GPUs (memory-bound, an assumption); on a
    # CPU measured from one rank's step (:func:`dmuon.tools.simulate.measured_elementwise_efficiency`)
    elementwise_efficiency: float = 1.0
    wire_itemsize: int = 4  # dmuon's default comm dtype: the (fp32) gradient's
    split: bool = True  # whether the planner may split matrices over gangs of ranks (dmuon's default)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ready_order: bool = False  # buckets in the backward pass's order (early start), not the cost order
    tp: int = 1  # tensor-parallel ranks (torchtitan's plan: COLUMN_WISE, the rest row-wise)
    pp: int = 1  # pipeline stages, each of world_size / pp ranks: FSDP2 over its dp × TP over its tp
    ep: int = 1  # expert-parallel ranks: each stage's experts on an (ep, expert-FSDP) mesh of its ranks
    momentum_dtype: str = "float32"  # dmuon.Muon's momentum_dtype for fp32 weights ("int8": 8-bit blocks)
    update_rule: str = "muon"  # "normuon" keeps 4 bytes of row state per row, all-reduced every step

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Invalid mode={self.mode!r}. Must be one of {MODES}.")
        self._check_parallelism()
        if self.world_size < 1 or self.tokens_per_rank < 1 or self.seq_len < 1:
            raise ValueError(f"Invalid workload: world_size={self.world_size}, tokens_per_rank="
                             f"{self.tokens_per_rank}, seq_len={self.seq_len}; all must be >= 1.")
        if self.momentum_dtype not in ("float32", "bfloat16", "int8"):
            raise ValueError(f"Invalid momentum_dtype={self.momentum_dtype!r}. Must be float32, bfloat16 or int8.")
        if self.update_rule not in ("muon", "normuon"):
            raise ValueError(f"Invalid update_rule={self.update_rule!r}. Must be muon or normuon.")
        if not 0 < self.elementwise_efficiency <= 1:
            raise ValueError(f"Invalid elementwise_efficiency={self.elementwise_efficiency!r}. Must be in (0, 1].")
        if self.model_flops_utilization is None or not 0 < self.model_flops_utilization <= 1:
            raise ValueError(f"Invalid MFU {self.model_flops_utilization!r} for {self.profile.name}: must be in "
                             "(0, 1]; the CPU profile has none, so pass Workload(mfu=...) there "
                             "(dmuon plan --hardware cpu measures it).")

    def _check_parallelism(self) -> None:
        tp, pp, ep, config = self.tp, self.pp, self.ep, self.config
        if min(tp, pp, ep) < 1:
            raise ValueError(f"Invalid parallelism tp={tp}, pp={pp}, ep={ep}: each must be >= 1.")
        if (tp, pp, ep) != (1, 1, 1) and self.mode != "fsdp2":
            raise ValueError(f"Invalid mode={self.mode!r} with tp={tp}, pp={pp}, ep={ep}: tensor, pipeline and expert "
                             "parallel are modelled under fsdp2 only.")
        if self.world_size % (tp * pp):
            raise ValueError(f"Invalid world_size={self.world_size}: not a multiple of tp·pp = {tp * pp}.")
        if pp > config.n_layers:
            raise ValueError(f"Invalid pp={pp}: more pipeline stages than the model's {config.n_layers} layers.")
        if ep > 1 and not config.n_experts:
            raise ValueError(f"Invalid ep={ep}: the model has no experts.")
        if (tp, pp) != (1, 1) and isinstance(config, VLAConfig):
            raise ValueError(f"Invalid tp={tp}, pp={pp}: an embodied (VLA) model is planned for data parallel only.")
        sizes = {"query heads": config.n_heads, "key/value heads": config.n_kv_heads, "MLP width": config.ffn_dim} \
            if tp > 1 else {}
        split = {what: size for what, size in sizes.items() if size % tp}
        if split:
            raise ValueError(f"Invalid tp={tp}: tensor parallel splits whole heads and MLP columns, and the model's "
                             + ", ".join(f"{size} {what}" for what, size in split.items())
                             + f" do not divide by {tp}.")
        if self.group_size % ep or config.n_experts % ep:
            raise ValueError(f"Invalid ep={ep}: it must divide a stage's {self.group_size} ranks and the "
                             f"{config.n_experts} experts.")

    @property
    def group_size(self) -> int:
        """Ranks of one pipeline stage: the ranks its optimizer exchanges over."""
        return self.world_size // self.pp

    @property
    def dp(self) -> int:
        """Data-parallel (FSDP2) ranks of a stage."""
        return self.group_size // self.tp

    @property
    def stage_config(self) -> LlamaConfig:
        """The first pipeline stage's share of the model (the most layers: ⌈L/pp⌉), whose
        optimizer the plan describes; the stages differ only in names and in which holds the
        embeddings and the head."""
        if self.pp == 1:
            return self.config
        return dataclasses.replace(self.config, n_layers=-(-self.config.n_layers // self.pp))

    @property
    def model_flops_utilization(self) -> float | None:
        return self.mfu if self.mfu is not None else self.profile.mfu

    @property
    def share(self) -> float:
        """Fraction of a rank's measured compute, memory and (CPU) loopback rates it gets with its
        node's other ranks running (:meth:`HardwareProfile.share`)."""
        return self.profile.share(self.profile.ranks_on_node(self.world_size))

    @property
    def multi_node(self) -> bool:
        return self.profile.ranks_per_node is not None and self.world_size > self.profile.ranks_per_node

    def layout(self, name: str, shape: tuple[int, ...], rank: int = 0) -> Layout:
        """How the job stores a Muon parameter of the first stage (a matrix, or an (E, m, n)
        stack of experts), as :func:`dmuon.layout.detect_layout` describes it (on ``rank`` of the
        stage, for stacks each rank holds whole). DDP replicates a matrix; FSDP2 (and, for the
        plan's owners, owner mode) shards its rows over the stage's data-parallel ranks; with
        tensor parallel, a column-wise matrix is ``(_StridedShard(0), Shard(0))`` on the (dp, tp)
        mesh (its rows partitioned), a row-wise one ``(Shard(0), Shard(1))`` (2-D blocks), the
        router ``(Shard(0), Replicate())``: all three go through the piece exchange; without
        FSDP2 (dp = 1) they are 1-D ``Shard(0)``, ``Shard(1)`` and replicated."""
        ranks = tuple(range(self.group_size))
        if self.mode == "ddp":
            return Layout(shape, self.world_size, 1, ranks)
        if len(shape) == 3 and self.mode == "fsdp2":
            return self._expert_layout(shape, rank)
        kind = name.split(".")[-2]
        if self.tp == 1:
            return Layout(shape, 1, self.group_size, ranks)
        if self.dp > 1:
            return Layout(shape, 1, self.group_size, ranks, pieces=True, rows_partitioned=kind in COLUMN_WISE)
        if kind in COLUMN_WISE:
            return Layout(shape, 1, self.tp, ranks)
        if kind == "router":
            return Layout(shape, self.tp, 1, ranks)
        return Layout((shape[1], shape[0]), 1, self.tp, ranks, transposed=True)

    def _expert_layout(self, shape: tuple[int, ...], rank: int) -> Layout:
        """Experts split over ``ep`` (``Shard(0)``), each EP rank's experts stored over the
        stage's other ranks (expert FSDP) on dim 0 where they split evenly, else on dim 1 (as
        torchtitan stores them): whole matrices on every rank, which it orthogonalizes itself,
        or pieces."""
        experts, efsdp = shape[0], self.group_size // self.ep
        if (experts // self.ep) % efsdp == 0:
            return Layout((experts // self.group_size, *shape[1:]), 1, 1, (rank,))
        return Layout(shape, 1, self.group_size, tuple(range(self.group_size)), pieces=True)


def ns_config(m: int, n: int, device_type: str) -> NSConfig:
    """What ``dmuon.Muon`` with default options resolves for an m×n matrix on ``device_type``."""
    return resolve_config((m, n), device_type)


def _units(workload: Workload, rank: int = 0) -> tuple[list[Unit], list[NSConfig]]:
    """The first stage's Muon parameters as units (on ``rank`` of the stage), and their recipes."""
    units, configs = [], []
    for name, count, m, n in muon_units(workload.stage_config):
        layout = workload.layout(name, (count, m, n) if ".experts." in name else (m, n), rank)
        count, m, n = (1, *layout.shape) if len(layout.shape) == 2 else layout.shape  # what NS sees
        config = ns_config(m, n, workload.profile.device_type)
        flops = count * newton_schulz_flops(m, n, steps=config.steps, method=config.method, restarts=config.restarts)
        # the update goes back in Newton–Schulz's dtype where that is narrower (exact: dmuon's
        # MatrixWork.narrow_return), a bf16 wire stays bf16
        units.append(Unit(name, layout, count, m, n, workload.wire_itemsize, flops,
                          min(workload.wire_itemsize, config.dtype.itemsize)))
        configs.append(config)
    return units, configs


def _wire(workload: Workload, config: NSConfig) -> str:
    """The wire dtypes of a unit as dmuon.Muon names them (an exchange group never mixes them):
    the gradient's (fp32) or a bf16 wire to the owner, and back Newton–Schulz's dtype where
    that is narrower."""
    there = {4: torch.float32, 2: torch.bfloat16}[workload.wire_itemsize]
    back = config.dtype if config.dtype.itemsize < there.itemsize else there
    return str(there) if back == there else f"{there}>{back}"


def _replicas(workload: Workload) -> int:
    return workload.world_size if workload.mode == "ddp" else 1


def _plan(units: list[Unit], workload: Workload) -> Plan:
    owners = plan_ownership([u.name for u in units], [u.flops for u in units],
                            [u.m * u.n * workload.wire_itemsize for u in units], workload.world_size)
    return make_plan(units, workload.world_size, _replicas(workload), bucket_bytes=workload.bucket_bytes,
                     flops_per_byte=0.0, owners=owners, ready_order=workload.ready_order)


@dataclass(frozen=True)
class SplitUnit:
    """A matrix orthogonalized by several ranks together: over a gang of them
    (:func:`dmuon.choices.choose_gangs`; each member gets a slice of the long side), or by every
    rank of its group on the column blocks it holds (``column_blocks``: distributed NS in place;
    ``unit`` is then the transpose of a Shard(0) matrix, its Gram side ``unit.m``)."""

    unit: Unit
    config: NSConfig
    gang: tuple[int, ...]  # positions
    column_blocks: bool = False

    @property
    def member_flops(self) -> int:
        """NS FLOPs of each rank working on it."""
        if self.column_blocks:
            return column_block_flops(self.unit.count, self.unit.m, self.unit.n, self.config, len(self.gang))
        return gang_member_flops(self.unit, self.config, len(self.gang))

    @property
    def member_elements(self) -> int:
        """Elements of each rank's part of it: its column block, or its slice."""
        if self.column_blocks:
            return self.unit.count * self.unit.m * -(-self.unit.n // len(self.gang))
        return gang_slice_elements(self.unit, len(self.gang))

    @property
    def gram_side(self) -> int:
        return self.unit.m if self.column_blocks else min(self.unit.m, self.unit.n)


def matrix_options(workload: Workload, units: Sequence[Unit], configs: Sequence[NSConfig]) -> list[MatrixOptions]:
    """The first stage's Muon parameters (:func:`_units`) as :func:`dmuon.choices.choose` takes
    them, as ``dmuon.Muon`` would describe them: FSDP2's matrices are DTensors, which may run
    distributed NS on their column blocks where each rank holds whole rows (the transpose's:
    Gram side the columns) or whole columns; an unfused matrix with a process group may be split
    over a gang."""
    options = []
    for unit, config in zip(units, configs):
        cost = None
        if workload.mode == "fsdp2" and unit.count == 1 and column_blocks_fit(unit.layout):
            blocks = ns_config(unit.n, unit.m, workload.profile.device_type)
            cost = column_block_cost(unit.count, unit.n, unit.m, blocks, unit.layout.shards)
        options.append(MatrixOptions(unit, unit, config, _wire(workload, config), cost, splittable=unit.count == 1))
    return options


def choices(workload: Workload, units: Sequence[Unit], configs: Sequence[NSConfig]) -> Choices:
    """What ``dmuon.Muon`` with default options decides for the workload's ``units`` (owner mode,
    and ``workload.split`` off, keep every matrix whole)."""
    if workload.mode == "owner":
        return Choices(split_replicas=False)
    return choose(matrix_options(workload, units, configs), distributed_ns=None if workload.split else False,
                  ready_order=workload.ready_order, bucket_bytes=workload.bucket_bytes)


@dataclass(frozen=True)
class StagePlan:
    """dmuon's plan for one pipeline stage's optimizer (the whole model's without pipeline
    parallel), as ``dmuon.Muon`` makes it by default (:func:`choices`): the plan of each group of
    matrices owned whole, with their Newton–Schulz recipes, in the engine's order (planned
    exchanges, then piece exchanges); and the matrices split over several ranks — gangs first,
    then those on column blocks."""

    groups: tuple[tuple[Plan, tuple[NSConfig, ...]], ...]
    split: tuple[SplitUnit, ...]

    @property
    def plans(self) -> list[Plan]:
        return [plan for plan, _ in self.groups]

    @property
    def units(self) -> list[Unit]:
        """Every unit of the stage (on one rank: a stack each rank holds whole counts once)."""
        return [u for plan in self.plans for u in plan.units] + [s.unit for s in self.split]

    @property
    def configs(self) -> list[NSConfig]:
        return [c for _, configs in self.groups for c in configs] + [s.config for s in self.split]


def stage_plan(workload: Workload, rank: int = 0) -> StagePlan:
    """:class:`StagePlan` of the workload's first stage, as ``rank`` of it plans it (the plans of
    the stacks each rank holds whole name that rank). Owner mode takes the owners
    ``dmuon.shard_by_owner`` picks; its optimizer moves no bytes."""
    units, configs = _units(workload, rank)
    chosen = choices(workload, units, configs)
    split = tuple(SplitUnit(units[i], configs[i], chosen.gangs[i]) for i in sorted(chosen.gangs))
    split += tuple(SplitUnit(dataclasses.replace(units[i], m=units[i].n, n=units[i].m),
                             ns_config(units[i].n, units[i].m, workload.profile.device_type),
                             tuple(range(units[i].layout.size)), True)
                   for i in sorted(chosen.column_blocks))
    rest = [i for i in range(len(units)) if i not in chosen.gangs and i not in chosen.column_blocks]
    if workload.mode == "owner":
        return StagePlan(((_plan([units[i] for i in rest], workload), tuple(configs[i] for i in rest)),), split)
    groups = exchange_plans([units[i] for i in rest], [_wire(workload, configs[i]) for i in rest],
                            bucket_bytes=workload.bucket_bytes, ready_order=workload.ready_order)
    return StagePlan(tuple((plan, tuple(configs[rest[i]] for i in members)) for members, plan in groups), split)


def build_plan(workload: Workload) -> tuple[Plan, tuple[NSConfig, ...]]:
    """The plan of a data-parallel workload's Muon matrices, each whole on one owner (one
    exchange group), and the NS recipe of each unit."""
    groups = stage_plan(dataclasses.replace(workload, split=False)).groups
    if len(groups) != 1:
        raise ValueError(f"the workload's matrices form {len(groups)} exchange groups: use stage_plan")
    return groups[0]


# ---------------------------------------------------------------------------- phase costs


def compute_seconds(flops: float, dtype: torch.dtype, workload: Workload, efficiency: float = 1.0) -> float:
    """Matrix products of ``flops`` in ``dtype`` on one rank."""
    rate = workload.profile.matmul_flops(dtype) * efficiency * workload.share
    return flops / rate


def ns_seconds(flops: float, config: NSConfig, workload: Workload) -> float:
    """Newton–Schulz products at the profile's matmul efficiency."""
    return compute_seconds(flops, config.dtype, workload, workload.profile.matmul_efficiency)


def memory_seconds(nbytes: float, workload: Workload) -> float:
    """An element-wise (memory-bound) phase moving ``nbytes`` on one rank."""
    return nbytes / (workload.profile.memory_bandwidth * workload.elementwise_efficiency * workload.share)


def check_seconds(elements: float | Tensor, workload: Workload) -> float | Tensor:
    """The non-finite check (:func:`dmuon.tensors.finite_flags`) of ``elements`` gradient
    elements on one rank: at the profile's measured rate where it has one (CPU), else
    memory-bound at CHECK_BYTES per element."""
    rate = workload.profile.check_rate
    if rate is None:
        return memory_seconds(CHECK_BYTES * elements, workload)
    return elements / (rate * workload.elementwise_efficiency * workload.share)


def link(workload: Workload) -> tuple[float, float]:
    """(bandwidth, latency) of a ring collective over all ranks: inter-node once they span nodes."""
    p = workload.profile
    if workload.multi_node:
        return p.inter_bandwidth * workload.share, p.inter_latency
    return p.intra_bandwidth * workload.share, p.intra_latency


def forward_backward_seconds(workload: Workload) -> float:
    """Forward+backward products of one rank's tokens at the workload's MFU."""
    flops = forward_backward_flops(workload.config, workload.tokens_per_rank, workload.seq_len)
    return compute_seconds(flops, workload.profile.train_dtype, workload, workload.model_flops_utilization)


def fsdp_params(workload: Workload, mode: str) -> tuple[int, int]:
    """The model's parameters FSDP2 manages in ``mode``, as (the rest, the expert stacks): in
    owner mode only what is not Muon's (the owners hold the Muon matrices, experts included)."""
    total, config = param_count(workload.config), workload.config
    if mode == "owner":
        return total - muon_params(config), 0
    return total - expert_params(config), expert_params(config)


def frozen_params(config: LlamaConfig | VLAConfig) -> int:
    """Parameters no optimizer steps (a VLA's frozen tower): gathered, never reduced."""
    return param_count(config) - trainable_params(config)


def data_parallel_collectives(workload: Workload, mode: str | None = None) -> list[tuple[str, float, int]]:
    """(kind, bytes per rank, calls) of the forward+backward's own collectives in ``mode``
    (default: the workload's); kinds and their ring bytes as in :data:`dmuon.tools.hardware.RING_BYTES`.

    FSDP2: all-gathers of the parameters in the training dtype (forward, and again in backward)
    and a reduce-scatter of fp32 gradients (torchtitan's default mixed precision), one of each
    per block plus the root's; with tensor, pipeline and expert parallel, of the rank's stage's
    parameters over its data-parallel ranks (its experts' over the expert-FSDP ranks). DDP: an
    fp32 all-reduce in 25 MiB buckets; owner mode: each Muon matrix broadcast from its owner in
    the training dtype and its gradient reduced to the owner in fp32 (priced as a ring
    all-gather and reduce-scatter: (N−1)/N·P bytes each), the rest as FSDP2. Tensor parallel's
    own collectives, expert parallel's token all-to-alls and the pipeline's sends are not
    counted.
    """
    mode = mode or workload.mode
    n, config = workload.world_size, workload.config
    if n == 1:
        return []
    total = trainable_params(config)
    train = torch.empty(0, dtype=workload.profile.train_dtype).element_size()
    if mode == "ddp":
        return [("all_reduce", RING_BYTES["all_reduce"](n) * total * 4, -(-total * 4 // DDP_BUCKET_BYTES))]
    groups = workload.stage_config.n_layers + 1
    dense, experts = fsdp_params(workload, mode)
    frozen = frozen_params(config)  # in the dense group (data parallel only)
    full = [(dense / workload.pp / workload.tp, frozen, workload.dp),
            (experts / workload.pp / workload.ep, 0, workload.group_size // workload.ep)]
    collectives = [(kind, RING_BYTES[kind](ranks) * nbytes, calls)
                   for params, frozen, ranks in full if params and ranks > 1
                   for kind, nbytes, calls in (("all_gather", 2 * params * train, 2 * groups),
                                               ("reduce_scatter", (params - frozen) * 4, groups))]
    if mode == "owner":
        matrices = len(muon_units(config))
        collectives += [(kind, RING_BYTES[kind](n) * nbytes, matrices) for kind, nbytes in
                        (("all_gather", muon_params(config) * train), ("reduce_scatter", muon_params(config) * 4))]
    return collectives


def data_parallel_seconds(workload: Workload, mode: str | None = None) -> float:
    """Time of :func:`data_parallel_collectives` over the ring's link, one latency per call."""
    bandwidth, latency = link(workload)
    return sum(nbytes / (bandwidth * workload.profile.ring_efficiency(kind)) + calls * latency
               for kind, nbytes, calls in data_parallel_collectives(workload, mode))


def data_parallel_copy_seconds(workload: Workload, mode: str | None = None) -> float:
    """Element-wise copies the data-parallel wrapper adds to forward+backward: FSDP2 copies
    all-gathered parameters out (forward and backward) and gradients into the reduce-scatter
    buffer (24 bytes per parameter it gathers: its stage's, its tensor-parallel and
    expert-parallel share of them); DDP copies gradients into and out of its buckets (16 bytes
    per parameter)."""
    mode = mode or workload.mode
    if workload.world_size == 1:
        return 0.0
    if mode == "ddp":
        return memory_seconds(DDP_COPY_BYTES * trainable_params(workload.config), workload)
    dense, experts = fsdp_params(workload, mode)
    gathered = (dense / workload.tp + experts / workload.ep) / workload.pp
    return memory_seconds(FSDP_COPY_BYTES * gathered, workload)


def exposed_step_seconds(compute: float, communication: float, workload: Workload) -> float:
    """Forward+backward wall time: communication hides behind compute where the hardware
    overlaps them (GPUs), and adds to it where it does not (CPU, gloo)."""
    return max(compute, communication) if workload.profile.comm_overlaps_compute else compute + communication


def local_params(total: int, workload: Workload, mode: str) -> float:
    """Elements of ``total`` (sharded unless DDP) one rank holds."""
    return total if mode == "ddp" else total / workload.world_size


def adamw_params(config: LlamaConfig | VLAConfig) -> int:
    """Trained parameters dmuon gives to AdamW: embeddings, output head, norms."""
    return trainable_params(config) - muon_params(config)


def adamw_seconds(params: float, workload: Workload) -> float:
    return memory_seconds(ADAMW_BYTES[workload.profile.device_type] * params, workload)


def adamw_step_seconds(workload: Workload, mode: str) -> float:
    """``torch.optim.AdamW`` on every local trained parameter, memory-bound."""
    return adamw_seconds(local_params(trainable_params(workload.config), workload, mode), workload)


def vanilla_muon_step_seconds(workload: Workload, mode: str) -> float:
    """Vanilla distributed Muon (``torch.optim.Muon`` on every rank): each rank orthogonalizes
    every matrix with standard NS in bf16; under FSDP2 it first all-gathers each matrix (one
    bf16 all-gather per matrix: the least DTensor can move), one matrix after the other.
    Momentum, NS input and apply on the local rows (DDP: whole matrices); AdamW on the rest."""
    matrices = muon_units(workload.stage_config)  # every rank of a stage steps the stage's matrices
    ns = 0.0
    for _, count, m, n in matrices:
        config = resolve_config((m, n), workload.profile.device_type, method="standard", dtype=VANILLA_NS_DTYPE)
        flops = newton_schulz_flops(m, n, steps=config.steps, method="standard")
        ns += count * (ns_seconds(flops, config, workload)
                       + memory_seconds(m * n * normalize_bytes(config.dtype), workload))
    local_muon = local_params(muon_params(workload.config), workload, mode)
    elementwise = (check_seconds(local_muon, workload)
                   + memory_seconds(local_muon * (MOMENTUM_BYTES + NESTEROV_BYTES + APPLY_BYTES), workload))
    gather = 0.0
    if mode != "ddp" and workload.group_size > 1:
        bandwidth, latency = link(workload)
        ring = (workload.group_size - 1) / workload.group_size
        bandwidth *= workload.profile.ring_efficiency("all_gather")
        gather = sum(ring * count * m * n * 2 / bandwidth + latency for _, count, m, n in matrices)
    adamw = adamw_seconds(local_params(adamw_params(workload.config), workload, mode), workload)
    return ns + elementwise + gather + adamw
