"""``dmuon bench``: data-parallel training side by side — AdamW, vanilla Muon and dmuon.Muon
under DDP and FSDP2 — on ranks this command spawns itself (no torchrun).

Every configuration trains the same model from the same weights on the same batches:

    ddp-adamw        DDP + torch.optim.AdamW
    ddp-torch-muon   DDP + torch.optim.Muon on every rank (each rank orthogonalizes everything)
    fsdp-adamw       FSDP2 + torch.optim.AdamW
    fsdp-torch-muon  FSDP2 + torch.optim.Muon (Newton–Schulz on sharded DTensors)
    ddp-dmuon        DDP + dmuon.Muon with its DDP comm hook (its default: early start on CUDA,
                     not on CPU)
    fsdp-dmuon       FSDP2 + dmuon.Muon (the same default)
    fsdp-dmuon-early the same with early_start=True: Newton–Schulz begun in the backward pass
                     (ddp-dmuon-early and ownerz2-dmuon-early likewise; ``-atstep``:
                     early_start=False)
    ownerz2-dmuon    dmuon.shard_by_owner (Muon matrices whole on their owners, kept from forward
                     to backward) + FSDP2 for the rest + dmuon.Muon
    ownerz3-dmuon    the same, re-broadcasting the matrices in backward (less memory)
    fsdp-dmuon-aol   fsdp-dmuon with ns_coefficients="aol" (AOL rescaling, 4 steps), to set beside
                     Polar Express at 5 in the same run (ddp-dmuon-aol likewise)
    fsdp-dmuon-bf16mom  fsdp-dmuon with momentum_dtype=torch.bfloat16 (``-int8mom``: 8-bit
                     blocks; ddp-dmuon-bf16mom and ddp-dmuon-int8mom likewise)
    fsdp-dmuon-qkclip  fsdp-dmuon with dmuon.QKClip.for_model (τ = 100): its max logits recorded
                     in every forward, the clip after every step; beside fsdp-dmuon, QK-clip's
                     share of the step (ddp-dmuon-qkclip likewise)
    fsdptp-adamw     FSDP2 × tensor parallel on a (world/2, 2) mesh (torchtitan's layout: q, k, v,
                     gate, up column-wise, o, down row-wise; the data split over the data-parallel
                     ranks) + torch.optim.AdamW (``fsdptp-torch-muon``, ``fsdptp-dmuon`` and its
                     ``-early``/``-atstep`` likewise)

The default run is the first six (the verdict's: dmuon against AdamW and vanilla Muon under
each data-parallel mode); ``--device cuda`` adds ``ddp-dmuon-atstep`` and ``fsdp-dmuon-atstep``
(early start off, which is on by default there), ``ownerz2-dmuon`` and ``ownerz2-dmuon-atstep``.
On CPU the rest are on request (``--configs``): with more configurations the default run cannot
settle its ratios in four minutes on two cores. ``--layout fsdp-tp`` runs AdamW, vanilla Muon
and dmuon under FSDP2 and under FSDP2 × TP side by side, so that a tensor-parallel user sees
what the layout costs dmuon's step against AdamW's beside FSDP2 alone.

With ``--peers``, every other distributed Muon implementation that is installed (``pip install
'dmuon[peers]'``, and Dion from its repository; see :mod:`dmuon.tools.peers`) joins as
``<ddp|fsdp>-<package>`` for the modes it supports; the ones that are not installed are listed
with the reason. Each dmuon configuration's optimizer step is then set beside every peer's of
its mode in the verdict. ``--ns-coefficients keller`` gives dmuon the Newton–Schulz polynomials
of torch.optim.Muon and four of the peers, ``you`` those of the other two (the same cost as its
default Polar Express); ``--comm-dtype bf16`` rounds dmuon's wire to bf16.

The model is the ``bench`` preset where bf16 products are native (CUDA; CPUs with AVX512-BF16 or
AMX) and the ``demo`` preset elsewhere (``--preset auto``): torch.optim.Muon always runs its
Newton–Schulz in bf16, which an AVX2-only CPU emulates at about a tenth of its fp32 rate, and on
the bench preset a vanilla step would take minutes there.

Timing: all configurations are built in ONE set of spawned ranks (each its own model, wrapper and
optimizer, from the same weights) and stepped round-robin: after ``--warmup`` steps each, every
round gives each configuration ``--steps-per-round`` steps, the order rotated by one place per
round, so a change of load between rounds hits every configuration alike. Per configuration and
round the bench keeps the slowest rank's optimizer-step and step times, the least of the round's
steps (interference — another job, the system, a page fault — only ever adds time, so the least
of a round's steps is the configuration's own time in that round; on 2 shared cores single steps
spike by tens of percent); a ratio (optimizer step vs vanilla Muon of the same mode, step vs AdamW of the same mode)
is the median of the per-round ratios, shown with the 95 % confidence interval of their geometric
mean (±, relative; ``--verbose``: their min-max too). Times are medians over the measured steps of
the slowest rank. The rounds go on past ``--steps`` while a headline ratio — each dmuon
configuration's step vs AdamW's and vs vanilla Muon's — is not within ``SETTLE_LIMIT`` (±10 %)
and the whole run's ``--max-seconds`` allow another round; the report says which happened. Such
an extra round steps only the configurations of the unsettled ratios and their baselines (a
ratio pairs the rounds both of its configurations ran), so a slow configuration whose ratios
settled does not use up the budget of the ones still moving. It prints
the verdict first (per dmuon configuration: its step against AdamW's, with the overhead in
percent, and against vanilla Muon's), with the model's size and the tokens
per step, then the table. A run warns — in the report and in ``--json`` (``warnings``,
``trustworthy``) — when other jobs took more than ``OTHER_LOAD_LIMIT`` (10 %) of the machine's
cores during the rounds (``/proc/stat`` busy time, steal included, minus the ranks' own CPU
time), when a headline ratio did not settle, or when there was only one round.

Peak memory is measured in a separate pass, each configuration alone in freshly spawned ranks
(``--memory-steps`` steps), so that its peak is its own: "peak mem" is the largest rise of a
rank's resident memory (CPU; sampled every 2 ms) or of its allocated device memory (CUDA) over
what the rank held before building the model. Traffic per step and rank (``--verbose``), the
same two things in every row: "opt MiB" is what the optimizer's own collectives sent (dmuon.Muon
counts its exchange and agreement, measured; AdamW and torch.optim.Muon on whole tensors send
nothing; "-" where an optimizer's DTensor operations communicate uncounted); "train MiB" is the
forward and backward pass's data-parallel traffic — DDP's gradient all-reduce, FSDP2's all-gathers
and reduce-scatters, owner sharding's broadcasts and reduces — from the model's parameter bytes
by the ring costs (:func:`training_traffic`). The owner modes are compared with the FSDP2
configurations.

"opt step efficiency" (dmuon.Muon only) is how close the optimizer step comes to its floor: the
busiest rank's Newton–Schulz time for the matrices it orthogonalizes — the same calls (shapes,
dtype, configuration, kernels) as its last step made, replayed alone on random inputs of those
shapes right after that step, with no communication and nothing else running in the rank —
divided by the measured optimizer-step time (the slowest rank's), as the median of its
per-round values. 1.0 means perfect balance with everything else (momentum, exchange,
apply) hidden or free; a distributed column-block call is replayed without its all-reduces.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import statistics
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dmuon.coefficients import NAMED_COEFFICIENTS
from dmuon.column_block_ns import orthogonalize_column_blocks
from dmuon.ns_defaults import native_bf16
from dmuon.orthogonalization import orthogonalize
from dmuon.owner import OwnerSharding, shard_by_owner
from dmuon.qk_clip import QKClip
from dmuon.tools.cli import (
    UsageError,
    check_fits,
    check_plot,
    check_seq_len,
    name_list,
    non_negative_float,
    non_negative_int,
    output_path,
    positive_float,
    positive_int,
    sample_seq_len,
)
from dmuon.tools.demo import CONFIGS as OPTIMIZERS
from dmuon.tools.demo import state_bytes
from dmuon.tools.hardware import available_memory, gpu_memory
from dmuon.tools.models import (
    PRESETS,
    VLA_PRESETS,
    VLAConfig,
    get_config,
    param_count,
    tensor_parallel_blocks,
    trainable_params,
    training_bytes,
)
from dmuon.tools.workloads import build_model, local_batch, make_data, training_loss

DEFAULT_SEQ_LEN = 128  # tokens per sequence of a Llama preset
# The default run (module docstring); the CUDA default adds early start off and owner sharding
CONFIGS = ("ddp-adamw", "ddp-torch-muon", "fsdp-adamw", "fsdp-torch-muon", "ddp-dmuon", "fsdp-dmuon")
# --layout fsdp-tp: FSDP2 alone and FSDP2 x tensor parallel, each with its AdamW and vanilla Muon
FSDP_TP_CONFIGS = ("fsdp-adamw", "fsdp-torch-muon", "fsdp-dmuon", "fsdptp-adamw", "fsdptp-torch-muon",
                   "fsdptp-dmuon")
TP_DEGREE = 2  # the tensor-parallel ranks of a data-parallel rank in the fsdptp configurations
CUDA_CONFIGS = (*CONFIGS, "ddp-dmuon-atstep", "fsdp-dmuon-atstep", "ownerz2-dmuon", "ownerz2-dmuon-atstep")
# Not run by default: dmuon with bf16 on the wire (comm_dtype=torch.bfloat16), to set beside the
# exact default in the same run
BF16_WIRE_CONFIGS = ("ddp-dmuon-bf16wire", "fsdp-dmuon-bf16wire")
# On request: early start forced on (early_start=True; off by default on CPU) or off (on by default
# on CUDA), owner sharding keeping the matrices from forward to backward (Z2) or re-broadcasting them
# in backward (Z3: less memory, the same step as Z2's within noise)
MORE_CONFIGS = ("ddp-dmuon-early", "fsdp-dmuon-early", "ownerz2-dmuon-early", "ddp-dmuon-atstep",
                "fsdp-dmuon-atstep", "ownerz2-dmuon-atstep", "ownerz2-dmuon", "ownerz3-dmuon", "ddp-dmuon-aol",
                "fsdp-dmuon-aol", "ddp-dmuon-bf16mom", "fsdp-dmuon-bf16mom", "ddp-dmuon-int8mom",
                "fsdp-dmuon-int8mom", "fsdptp-dmuon-early", "fsdptp-dmuon-atstep", "ddp-dmuon-qkclip",
                "fsdp-dmuon-qkclip")
# a configuration's name suffix: its dmuon.Muon options beside the run's
VARIANTS = {"bf16wire": {"comm_dtype": torch.bfloat16}, "early": {"early_start": True},
            "atstep": {"early_start": False}, "aol": {"ns_coefficients": "aol"},
            "bf16mom": {"momentum_dtype": torch.bfloat16}, "int8mom": {"momentum_dtype": torch.int8},
            "qkclip": {}}  # dmuon's defaults, and a dmuon.QKClip.for_model (QK_CLIP_THRESHOLD)
QK_CLIP_THRESHOLD = 100.0  # the ``-qkclip`` configurations' τ (Kimi K2's)
# What each data-parallel mode is compared with (AdamW and vanilla Muon of that mode).
BASELINE_MODE = {"ddp": "ddp", "fsdp": "fsdp", "ownerz2": "fsdp", "ownerz3": "fsdp", "fsdptp": "fsdptp"}


# A run is flagged as not trustworthy when other jobs used more than this fraction of the
# machine's cores while the timed rounds ran (measured: /proc/stat busy time, steal included,
# minus the ranks' own CPU time), or when a headline ratio's 95 % interval is wider than
# ±SETTLE_LIMIT (relative) once the rounds stop.
OTHER_LOAD_LIMIT = 0.1
SETTLE_LIMIT = 0.10
# Student's t, 97.5 % quantile, by degrees of freedom (the nearest listed below is taken)
_T975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 12: 2.18,
         15: 2.13, 20: 2.09, 30: 2.04, 60: 2.00}

# --comm-dtype: dmuon.Muon's comm_dtype
COMM_DTYPES = {"exact": None, "bf16": torch.bfloat16}
PRECISIONS = ("bf16-autocast", "fp32")
MAX_RANKS_PER_CORE = 4  # --device cpu spawns its ranks on this machine

# The clock of the timed rounds; a test replaces it with a fake one.
clock = time.perf_counter


@dataclass(frozen=True)
class BenchResult:
    """One configuration's numbers (the ``--json`` record holds these and the ratios)."""

    config: str
    world_size: int
    opt_step_ms: float  # median over the measured steps of the slowest rank's time
    step_ms: float
    opt_bytes_per_step: float | None  # the optimizer's own collectives, mean over ranks (None: not counted)
    train_bytes_per_step: float | None  # forward + backward data-parallel traffic per rank (training_traffic)
    peak_mem_bytes: int  # largest per-rank rise over the memory held before the model existed
    final_loss: float  # loss of the last step, mean over ranks (the last progress line's figure)
    # per round: the least of the round's steps of the slowest rank's times, NaN for a round the
    # configuration sat out (an extra round steps only what an unsettled ratio needs); empty: one
    # round of opt_step_ms / step_ms
    round_opt_step_ms: tuple[float, ...] = ()
    round_step_ms: tuple[float, ...] = ()
    # dmuon.Muon only: per round, the busiest rank's Newton–Schulz calls of a step timed alone
    round_ns_alone_ms: tuple[float, ...] = ()
    state_bytes: int = 0  # the optimizers' state on the rank holding the most (counted: its tensors' bytes)
    muon_state_bytes: int = 0  # the part of it kept for Muon's matrices (demo.MUON_STATE_KEYS)

    def rounds(self, what: str) -> tuple[float, ...]:
        values = getattr(self, f"round_{what}")
        return values or (getattr(self, what),)


@dataclass(frozen=True)
class Ratio:
    """Median of the per-round ratios of a time to its baseline's in the same round, their range,
    and the relative half-width of the 95 % confidence interval of their geometric mean (None
    with one round)."""

    median: float
    low: float
    high: float
    halfwidth: float | None = None

    @property
    def settled(self) -> bool:
        return self.halfwidth is not None and self.halfwidth <= SETTLE_LIMIT

    def text(self) -> str:
        return f"{self.median:.2f}" + (f" ±{self.halfwidth:.0%}" if self.halfwidth is not None else "")

    def range_text(self) -> str:
        return f"{self.median:.2f} ({self.low:.2f}-{self.high:.2f})"


def relative_halfwidth(ratios: list[float]) -> float | None:
    """The 95 % interval of the geometric mean of ``ratios``, as a relative half-width: the t
    interval of their logarithms (rounds are independent repeats under the same conditions)."""
    if len(ratios) < 2:
        return None
    logs = [math.log(r) for r in ratios]
    t = _T975[max(k for k in _T975 if k <= len(logs) - 1)]
    return math.exp(t * statistics.stdev(logs) / math.sqrt(len(logs))) - 1


def per_round_ratio(values: tuple[float, ...], bases: tuple[float, ...]) -> Ratio | None:
    """Ratios of ``values`` to ``bases`` round by round, over the rounds both were measured in (a
    round one of them sat out is NaN, which the comparisons leave out)."""
    ratios = [v / b for v, b in zip(values, bases) if b > 0 and v > 0]
    if not ratios:
        return None
    return Ratio(statistics.median(ratios), min(ratios), max(ratios), relative_halfwidth(ratios))


def _baseline_mode(config: str) -> str:
    parallel = config.split("-", 1)[0]
    return BASELINE_MODE.get(parallel, parallel)


def compare(results: list[BenchResult]) -> dict[str, dict[str, Ratio | float | None]]:
    """Per configuration: optimizer step vs vanilla Muon, step vs AdamW, the optimizer-step
    efficiency (all three medians of per-round ratios), peak memory vs AdamW (one figure: each
    measured alone)."""
    by_name = {r.config: r for r in results}
    out = {}
    for r in results:
        mode = _baseline_mode(r.config)
        vanilla, adamw = by_name.get(f"{mode}-torch-muon"), by_name.get(f"{mode}-adamw")
        out[r.config] = {
            "opt_step_vs_vanilla": vanilla and per_round_ratio(r.rounds("opt_step_ms"), vanilla.rounds("opt_step_ms")),
            "step_vs_adamw": adamw and per_round_ratio(r.rounds("step_ms"), adamw.rounds("step_ms")),
            "step_vs_vanilla": vanilla and per_round_ratio(r.rounds("step_ms"), vanilla.rounds("step_ms")),
            "mem_vs_adamw": (r.peak_mem_bytes / adamw.peak_mem_bytes
                             if adamw and adamw.peak_mem_bytes and r.peak_mem_bytes else None),
            "opt_step_efficiency": per_round_ratio(r.round_ns_alone_ms, r.rounds("opt_step_ms")),
        }
    return out


def peer_ratios(results: list[BenchResult]) -> dict[str, dict[str, Ratio]]:
    """Per dmuon configuration: its optimizer step against each peer's of the same mode (``--peers``),
    as the median of per-round ratios."""
    from dmuon.tools.peers import PEERS

    peers = [r for r in results if r.config.split("-", 1)[1] in PEERS]
    out = {}
    for r in results:
        if "-dmuon" not in r.config:
            continue
        mode = _baseline_mode(r.config)
        ratios = {peer.config: per_round_ratio(r.rounds("opt_step_ms"), peer.rounds("opt_step_ms"))
                  for peer in peers if peer.config.startswith(f"{mode}-")}
        out[r.config] = {name: ratio for name, ratio in ratios.items() if ratio is not None}
    return out


@dataclass(frozen=True)
class Load:
    """What else ran on the machine during the timed rounds."""

    other_cores: float  # cores' worth of CPU other jobs took (steal included), on average
    cores: int  # the machine's

    @property
    def limit(self) -> float:
        return OTHER_LOAD_LIMIT * self.cores


def headline(results: list[BenchResult]) -> list[tuple[str, str]]:
    """The ratios a reader acts on: each dmuon configuration's step vs AdamW's and vs vanilla
    Muon's (whole steps: the optimizer-step ratios, of short and noisier times, are shown but do
    not decide whether a run settled)."""
    return [(r.config, what) for r in results if "-dmuon" in r.config for what in ("step_vs_adamw", "step_vs_vanilla")]


def configs_to_settle(results: list[BenchResult]) -> list[str]:
    """The configurations an extra round must step: those of each unsettled headline ratio and their
    baselines (AdamW or vanilla Muon of the mode), in the run's order; none when all settled."""
    comparisons, needed = compare(results), set()
    for name, what in headline(results):
        ratio = comparisons[name][what]
        if isinstance(ratio, Ratio) and not ratio.settled:
            baseline = "adamw" if what == "step_vs_adamw" else "torch-muon"
            needed |= {name, f"{_baseline_mode(name)}-{baseline}"}
    return [r.config for r in results if r.config in needed]


def unsettled(results: list[BenchResult]) -> list[str]:
    """The headline ratios whose interval is wider than ±SETTLE_LIMIT, as "<config> <ratio>"."""
    comparisons = compare(results)
    return [f"{name} {what.replace('_', ' ')}" for name, what in headline(results)
            if isinstance(comparisons[name][what], Ratio) and not comparisons[name][what].settled]


def run_warnings(results: list[BenchResult], load: Load | None = None) -> list[str]:
    """Why this run's ratios should not be trusted, and what to do; empty when nothing says so."""
    warnings = []
    if load is not None and load.other_cores > load.limit:
        warnings.append(f"other jobs used {load.other_cores:.2f} of {load.cores} cores during the timed rounds "
                        f"(limit {load.limit:.2f} = {OTHER_LOAD_LIMIT:.0%} of the machine): the times are "
                        "inflated; the ratios are measured side by side, but check their intervals")
    rounds = max((len(r.rounds("step_ms")) for r in results), default=0)
    if rounds < 2:
        warnings.append("only one round: the ratios' intervals are unknown (use --steps 4 or more)")
        return warnings
    comparisons = compare(results)
    for name, what in headline(results):
        ratio = comparisons[name][what]
        if isinstance(ratio, Ratio) and not ratio.settled:
            warnings.append(f"{name} {what.replace('_', ' ')}: ±{ratio.halfwidth:.0%} after {rounds} rounds (target "
                            f"±{SETTLE_LIMIT:.0%}): the rounds disagree; rerun on a quieter machine, or give it more "
                            "--max-seconds")
    return warnings


def _state_cell(r: BenchResult) -> str:
    return f"{r.state_bytes / 2**20:,.1f} ({r.muon_state_bytes / 2**20:,.1f})" if r.state_bytes else "-"


def _mib(value: float | None) -> str:
    return f"{value / 2**20:,.2f}" if value is not None else "-"


def json_records(results: list[BenchResult], load: Load | None = None) -> list[dict]:
    """The ``--json`` records: the measurements, the ratios with their per-round range, the warnings."""
    comparisons, warnings, against_peers = compare(results), run_warnings(results, load), peer_ratios(results)
    records = []
    for r in results:
        record = asdict(r)
        for key, values in (("round_opt_step_ms", r.rounds("opt_step_ms")), ("round_step_ms", r.rounds("step_ms")),
                            ("round_ns_alone_ms", r.round_ns_alone_ms)):
            record[key] = [None if math.isnan(v) else v for v in values]  # null: a round it sat out
        for what, ratio in comparisons[r.config].items():
            if isinstance(ratio, Ratio):
                record.update({what: ratio.median, f"{what}_min": ratio.low, f"{what}_max": ratio.high,
                               f"{what}_halfwidth": ratio.halfwidth})
            else:
                record.update({what: ratio} if what == "mem_vs_adamw" else
                              {what: None, f"{what}_min": None, f"{what}_max": None, f"{what}_halfwidth": None})
        record["opt_step_vs_peer"] = {
            peer: {"median": ratio.median, "min": ratio.low, "max": ratio.high, "halfwidth": ratio.halfwidth}
            for peer, ratio in against_peers.get(r.config, {}).items()}
        record["other_jobs_cores"] = load.other_cores if load else None
        record["warnings"] = warnings
        record["trustworthy"] = not warnings
        records.append(record)
    return records


# --------------------------------------------------------------------------------------------
# Inside the ranks


class _Trainer:
    """One configuration in this rank: its own model (same weights as every other), wrapper and optimizers."""

    def __init__(self, name: str, args: argparse.Namespace, rank: int, world: int, device: torch.device,
                 mesh=None) -> None:
        parallel, optimizer = name.split("-", 1)
        self.name, self.args, self.rank, self.world, self.device = name, args, rank, world, device
        config = preset_config(args)
        self.model = build_model(config, seed=args.seed).to(device)
        self.wrapped, self.sharding = wrap_model(self.model, parallel, world, device, mesh)
        # tensor-parallel ranks see the same batch: the data is split over the data-parallel ranks
        self.data_rank, self.data_world = (rank // TP_DEGREE, world // TP_DEGREE) if parallel == "fsdptp" \
            else (rank, world)
        owned = sum(p.numel() * p.element_size() for p in self.sharding.params) if self.sharding else 0
        layers = sum(p.numel() * p.element_size() for p in self.model.layers.parameters())
        root = sum(p.numel() * p.element_size() for p in self.model.parameters()) - layers
        frozen = sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.requires_grad)
        self.train_bytes = training_traffic(parallel, world, root, layers, owned, frozen)  # the same every step
        variant = next((v for v in VARIANTS if optimizer.endswith(f"-{v}")), None)
        optimizer = optimizer.removesuffix(f"-{variant}")
        options = {"ns_coefficients": args.ns_coefficients, "comm_dtype": COMM_DTYPES[args.comm_dtype],
                   "early_start": None, **VARIANTS.get(variant, {})} if optimizer == "dmuon" else {}
        self.optimizers = _factory(optimizer)(self.model, args.lr, args.weight_decay, **options)
        if optimizer == "dmuon" and parallel == "ddp":
            self.optimizers[0].register_ddp_comm_hook(self.wrapped)  # early start under DDP (on CUDA by default)
        if variant == "qkclip":  # max logits recorded in every forward, the clip after every step
            QKClip.for_model(self.optimizers[0], self.model, threshold=QK_CLIP_THRESHOLD)
        self.data = make_data(config, seed=args.seed)

    def forward_backward(self, step: int) -> torch.Tensor:
        args = self.args
        batch = local_batch(self.data, step, args.batch_size * self.world, args.seq_len, self.data_rank,
                            self.data_world, self.device)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-autocast"):
            loss = training_loss(self.wrapped, batch)
        for opt in self.optimizers:
            opt.zero_grad()
        loss.backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def sync(self) -> None:
        _sync(self.device)

    def _last_step_stats(self):
        """dmuon.Muon's statistics of its last step; None for other optimizers."""
        return getattr(self.optimizers[0], "last_step_stats", None)

    def traffic(self) -> tuple[float | None, float]:
        """(the optimizer's bytes sent in the last step, or None where they are not counted; the
        step's forward and backward data-parallel bytes per rank, :func:`training_traffic`)."""
        stats = self._last_step_stats()
        parallel, optimizer = self.name.split("-", 1)
        sent = stats.bytes_sent if stats is not None else (
            0.0 if optimizer == "adamw" or (optimizer == "torch-muon" and parallel == "ddp") else None)
        return sent, self.train_bytes

    def ns_alone_s(self) -> float | None:
        """dmuon.Muon's Newton–Schulz calls of the last step on this rank, timed alone (None for
        other optimizers)."""
        stats = self._last_step_stats()
        return None if stats is None else time_ns_calls(stats.ns_calls, self.device)

    def release(self) -> None:
        """Free the gradients between steps (the other configurations step meanwhile)."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)


def time_ns_calls(calls: list, device: torch.device) -> float:
    """Seconds of the Newton–Schulz ``calls`` (``StepStats.ns_calls``) run one after another on
    random inputs of their shapes and dtypes; column-block calls without their all-reduces."""
    inputs = [torch.randn(shape, dtype=dtype, device=device) for shape, dtype, _, _ in calls]
    _sync(device)
    start = clock()
    for x, (_, _, config, column_blocks) in zip(inputs, calls):
        if column_blocks:
            orthogonalize_column_blocks(x, config, lambda local_sum: local_sum)  # one rank: the sum is its own
        else:
            orthogonalize(x, config)
    _sync(device)
    return clock() - start


@dataclass
class StepRecord:
    config: str
    round: int  # -1: warm-up
    step: int
    opt_s: float
    step_s: float
    loss: float
    ns_s: float | None = None  # the step's Newton–Schulz calls timed alone (dmuon.Muon only)


# the stand-in record of a round a configuration sat out
_SAT_OUT = StepRecord("", 0, 0, math.nan, math.nan, math.nan, math.nan)


def round_order(configs: list[str], round_index: int) -> list[str]:
    """The configurations in round ``round_index``: rotated by one place per round."""
    k = round_index % len(configs)
    return configs[k:] + configs[:k]


def rounds_of(steps: int, steps_per_round: int) -> list[int]:
    """Measured steps in each round (the last round may be shorter)."""
    return [min(steps_per_round, steps - start) for start in range(0, steps, steps_per_round)]


def run_rounds(trainers: dict, *, warmup: int, steps: int, steps_per_round: int, log=None,
               mean_loss=float, bytes_hook=None, more=None) -> list[StepRecord]:
    """Step every configuration of ``trainers`` round-robin: warm-up steps one configuration after
    another, then rounds in which each configuration does ``steps_per_round`` steps, the order
    rotated by round, so a change of load lands on every configuration alike. After each measured
    step, the trainer times that step's Newton–Schulz calls alone (``ns_alone_s``). Times come from
    :data:`clock`; ``mean_loss`` turns a rank's loss into the figure printed (all ranks' mean).
    ``more(records)``, asked after the planned rounds and after each extra one, names the
    configurations to step in another round, in any order (none: stop; every rank must get the
    same answer)."""
    configs, done, records = list(trainers), {name: 0 for name in trainers}, []
    planned = rounds_of(steps, steps_per_round)

    def rounds():
        yield -1, list(configs), warmup
        for i, n in enumerate(planned):
            yield i, round_order(configs, i), n
        i = len(planned)
        while more is not None and (chosen := set(more(records))):
            yield i, round_order([name for name in configs if name in chosen], i), steps_per_round
            i += 1

    for round_index, order, n in rounds():
        for name in order:
            trainer = trainers[name]
            for _ in range(n):
                step = done[name]
                trainer.sync()
                start = clock()
                loss = trainer.forward_backward(step)
                trainer.sync()
                opt_start = clock()
                trainer.optimizer_step()
                trainer.sync()
                end = clock()
                ns_s = trainer.ns_alone_s() if round_index >= 0 else None  # warm-up figures are not kept
                if bytes_hook is not None:
                    bytes_hook(name, trainer)
                trainer.release()
                done[name] += 1
                loss = mean_loss(loss)
                records.append(StepRecord(name, round_index, step, end - opt_start, end - start, loss, ns_s))
                if log is not None:
                    where = ("warm-up" if round_index < 0 else f"round {round_index + 1}/{len(planned)}"
                             if round_index < len(planned) else f"round {round_index + 1} (extra)")
                    log.write(f"{where}  {name:<18} step {step + 1}/{warmup + steps}  loss {loss:.3f}  "
                              f"opt step {(end - opt_start) * 1e3:.0f} ms  step {(end - start) * 1e3:.0f} ms\n")
                    log.flush()
    return records


def summarize(records: list[StepRecord], world: int) -> dict[str, BenchResult]:
    """Per configuration: medians over measured steps, and per round the least, of the (already
    slowest-rank) times; NaN for a round it sat out."""
    out = {}
    rounds = sorted({r.round for r in records if r.round >= 0})
    for name in dict.fromkeys(r.config for r in records):
        mine = [r for r in records if r.config == name]
        measured = [r for r in mine if r.round >= 0]
        per_round = [[r for r in measured if r.round == i] or [_SAT_OUT] for i in rounds]
        out[name] = BenchResult(
            name, world,
            statistics.median(r.opt_s for r in measured) * 1e3, statistics.median(r.step_s for r in measured) * 1e3,
            None, None, 0, mine[-1].loss,
            tuple(min(r.opt_s for r in rs) * 1e3 for rs in per_round),
            tuple(min(r.step_s for r in rs) * 1e3 for rs in per_round),
            tuple(min(r.ns_s for r in rs) * 1e3 for rs in per_round)
            if all(r.ns_s is not None for r in measured) else (),
        )
    return out


def _timed(names: list[str], args: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    mesh = init_device_mesh(device.type, (world,)) if any(not n.startswith("ddp") for n in names) else None
    trainers = {name: _Trainer(name, args, rank, world, device, mesh) for name in names}
    sent: dict[str, tuple[float | None, float]] = {}

    def mean_loss(loss: torch.Tensor) -> float:
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        return loss.item()

    def bytes_hook(name: str, trainer: _Trainer) -> None:
        sent[name] = trainer.traffic()

    def slowest(records: list[StepRecord]) -> list[StepRecord]:
        """The records with the slowest rank's times of every step, and the busiest rank's
        Newton–Schulz time alone (a collective)."""
        times = torch.tensor([[r.opt_s, r.step_s, -1.0 if r.ns_s is None else r.ns_s] for r in records],
                             dtype=torch.float64, device=device).reshape(-1, 3)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return [dataclasses.replace(r, opt_s=opt_s, step_s=step_s, ns_s=None if ns_s < 0 else ns_s)
                for r, (opt_s, step_s, ns_s) in zip(records, times.tolist())]

    def more(records: list[StepRecord]) -> list[str]:
        """The configurations of the unsettled headline ratios, for another round, while the run's
        time allows one (the same answer on every rank: from the slowest rank's times and the
        latest clock)."""
        now = torch.tensor([time.time()], dtype=torch.float64, device=device)
        dist.all_reduce(now, op=dist.ReduceOp.MAX)
        measured = slowest([r for r in records if r.round >= 0])
        chosen = configs_to_settle(list(summarize(measured, world).values()))
        latest = {r.config: r.step_s for r in measured}  # each configuration's last step
        if now.item() + sum(latest[name] for name in chosen) * args.steps_per_round > args.deadline:
            return []
        return chosen

    dist.barrier()
    start = time.perf_counter()  # the machine's monotonic clock: the parent compares it with its own
    records = run_rounds(trainers, warmup=args.warmup, steps=args.steps, steps_per_round=args.steps_per_round,
                         log=sys.stderr if rank == 0 else None, mean_loss=mean_loss, bytes_hook=bytes_hook,
                         more=more if args.deadline else None)
    records = slowest(records)
    warm = [r for r in records if r.round < 0]
    measured_start = start + sum(r.step_s for r in warm)  # about when the rounds began
    averaged = torch.tensor([[opt or 0.0, train] for opt, train in (sent[n] for n in names)], dtype=torch.float64,
                            device=device)
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    states = torch.tensor([state_bytes(trainers[n].optimizers) for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(states, op=dist.ReduceOp.MAX)
    results = summarize(records, world)
    for name, (opt, train), (state, muon_state) in zip(names, averaged.tolist(), states.tolist()):
        opt_bytes = opt if sent[name][0] is not None else None
        results[name] = dataclasses.replace(results[name], opt_bytes_per_step=opt_bytes, train_bytes_per_step=train,
                                            state_bytes=int(state), muon_state_bytes=int(muon_state))
    return {"results": results, "rounds_start": measured_start}


def _memory(name: str, args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    """The peak memory rise of this configuration alone, in fresh ranks, over ``--memory-steps`` steps."""
    memory = PeakMemory(device)
    trainer = _Trainer(name, args, rank, world, device)
    for step in range(args.memory_steps):
        trainer.forward_backward(step)
        trainer.optimizer_step()
    peak = torch.tensor([memory.stop()], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return int(peak.item())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, world: int, port: int, names: list[str], mode: str, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    result = _timed(names, args, rank, world, device) if mode == "timed" else _memory(names[0], args, rank, world,
                                                                                        device)
    if rank == 0:
        queue.put(result)
    dist.barrier()
    # Leave without tearing the process group down: on CPU, gloo's teardown after FSDP2 has
    # aborted a rank ("terminate called without an active exception") although every collective
    # had completed. The result is already delivered, and the process is about to end anyway.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(names: str | list[str], args: argparse.Namespace, mode: str = "memory"):
    """Spawn ``args.world_size`` fresh ranks and run there: ``mode="memory"``, configuration
    ``names`` alone (its peak memory, bytes); ``"timed"``, all of ``names`` round-robin (a dict
    of BenchResults and when the rounds began)."""
    names = [names] if isinstance(names, str) else list(names)
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(args.world_size, _free_port(), names, mode, args, queue),
                       nprocs=args.world_size, join=True, start_method="spawn")
    return queue.get()


def _cell(ratio: Ratio | float | None, text=Ratio.text) -> str:
    return text(ratio) if isinstance(ratio, Ratio) else "-"


def verdict(results: list[BenchResult], about: str = "") -> list[str]:
    """The lines a reader acts on, first (within 100 columns): per dmuon configuration its step
    against AdamW's (and the overhead in percent) and its optimizer step against vanilla Muon's,
    each with its interval, and its optimizer step against each peer's of its mode (``--peers``);
    then whether the ratios settled."""
    comparisons, against_peers = compare(results), peer_ratios(results)
    rounds = max((len(r.rounds("step_ms")) for r in results), default=0)
    lines = ["dmuon bench verdict" + (f" ({about})" if about else "")]
    for r in results:
        if "-dmuon" not in r.config:
            continue
        c = comparisons[r.config]
        parts = []
        for what, baseline in (("step_vs_adamw", "AdamW"), ("step_vs_vanilla", "vanilla Muon")):
            ratio = c[what]
            if isinstance(ratio, Ratio):
                parts.append(f"{ratio.median:.2f}x {baseline} ({ratio.median - 1:+.0%}"
                             + (f" ±{ratio.halfwidth:.0%})" if ratio.halfwidth is not None else ")"))
        if parts:
            lines.append(f"  {r.config:<18} step " + "; ".join(parts)
                         + ("; Newton-Schulz begun in the backward pass" if r.config.endswith("-early") else ""))
        for peer, ratio in against_peers.get(r.config, {}).items():
            lines.append(f"  {r.config:<18} optimizer step {ratio.median:.2f}x {peer}'s"
                         + (f" (±{ratio.halfwidth:.0%})" if ratio.halfwidth is not None else ""))
    left = unsettled(results)
    if not any(isinstance(comparisons[name][what], Ratio) for name, what in headline(results)):
        lines.append("  no AdamW or vanilla Muon of the same mode in this run: no step ratios to settle (see the "
                     "table)")
    elif rounds < 2:
        lines.append("  one round: no interval (use --steps 4 or more)")
    elif left:
        lines.append(f"  NOT settled after {rounds} rounds, the time budget spent (--max-seconds): "
                     f"{', '.join(left)} not within ±{SETTLE_LIMIT:.0%}")
    else:
        lines.append(f"  settled: every step ratio above within ±{SETTLE_LIMIT:.0%} (95 % interval) after {rounds} "
                     "rounds")
    return [wrapped for line in lines for wrapped in textwrap.wrap(line, 100, subsequent_indent="    ")]


def format_table(results: list[BenchResult], load: Load | None = None, about: str = "",
                 verbose: bool = False, your_job: Sequence[str] = ()) -> str:
    """The verdict (:func:`verdict`), then one row per configuration (within 100 columns) with
    ratios against AdamW and vanilla Muon of the same parallelism (medians of per-round ratios,
    ± their 95 % interval), the warnings; ``verbose``: a second table with the bytes, memory,
    loss, the ratios' ranges and the optimizer-step efficiency; ``your_job``: the verdict's last
    lines (:func:`plan_pointer`)."""
    comparisons = compare(results)
    lines = [*verdict(results, about), *your_job, ""]
    columns = [("config", 20), ("step ms", 9), ("step/AdamW", 11), ("overhead", 8), ("opt step ms", 11),
               ("opt/vanilla", 11), ("mem/AdamW", 9), ("state (Muon)", 13)]

    def row(cells: list[str], widths: list[tuple[str, int]]) -> str:
        return " ".join(f"{cell:<{w}}" if i == 0 else f"{cell:>{w}}"
                        for i, (cell, (_, w)) in enumerate(zip(cells, widths)))

    lines.append(row([title for title, _ in columns], columns))
    for r in results:
        c = comparisons[r.config]
        step = c["step_vs_adamw"]
        lines.append(row([r.config, f"{r.step_ms:.1f}", _cell(step),
                          f"{step.median - 1:+.1%}" if isinstance(step, Ratio) else "-", f"{r.opt_step_ms:.1f}",
                          _cell(c["opt_step_vs_vanilla"]), f"{c['mem_vs_adamw']:.2f}" if c["mem_vs_adamw"] else "-",
                          _state_cell(r)], columns))
    rounds = max(len(r.rounds("step_ms")) for r in results) if results else 0
    lines += textwrap.wrap(f"times: median over the measured steps of the slowest rank; ratios: median of {rounds} "
                           "per-round ratio(s) of the rounds' least steps, ± the 95 % interval of their geometric "
                           "mean, the configurations stepped in turn in the same ranks; mem: peak, each "
                           "configuration alone in fresh ranks; state: MiB of the optimizers' state tensors on the "
                           "rank holding the most (Muon: the part kept for Muon's matrices: momentum, 8-bit "
                           "momentum's scales, NorMuon's rows)", 100)
    if verbose:
        detail = [("config", 20), ("opt MiB", 8), ("train MiB", 9), ("peak MiB", 9), ("loss", 6),
                  ("step/AdamW range", 17), ("opt/vanilla range", 17), ("NS/opt step", 11)]
        lines += ["", row([title for title, _ in detail], detail)]
        for r in results:
            c = comparisons[r.config]
            lines.append(row([r.config, _mib(r.opt_bytes_per_step), _mib(r.train_bytes_per_step),
                              f"{r.peak_mem_bytes / 2**20:,.0f}" if r.peak_mem_bytes else "-", f"{r.final_loss:.3f}",
                              _cell(c["step_vs_adamw"], Ratio.range_text),
                              _cell(c["opt_step_vs_vanilla"], Ratio.range_text),
                              _cell(c["opt_step_efficiency"], Ratio.text)], detail))
        lines += textwrap.wrap("per step and rank: opt MiB, what the optimizer's own collectives sent (measured; "
                               "-: not counted), train MiB, the forward and backward pass's data-parallel traffic "
                               "(DDP's all-reduce, FSDP2's gathers and reduce-scatters, owner sharding's broadcasts "
                               "and reduces; ring costs); loss: the last step's, mean over ranks; NS/opt step: the "
                               "busiest rank's Newton-Schulz calls timed alone over the optimizer step (1.0 = the "
                               "floor)", 100)
    if load is not None:
        lines.append(f"other jobs during the timed rounds: {load.other_cores:.2f} of {load.cores} cores "
                     f"(warning above {load.limit:.2f})")
    lines.extend(f"WARNING: {w}" for w in run_warnings(results, load))
    return "\n".join(lines)


class PeakMemory:
    """Largest resident (CPU) or allocated (CUDA) memory of this process above a baseline."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = self._current()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        else:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._current())

    def stop(self) -> int:
        """The peak rise over the baseline, in bytes."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._current())
        else:
            self.peak = torch.cuda.max_memory_allocated(self.device)
        return self.peak - self.baseline


def training_traffic(parallel: str, world: int, root_bytes: int, layer_bytes: int, owned_bytes: int,
                     frozen_bytes: int = 0) -> float:
    """Bytes one rank sends, on average, for a step's forward and backward data-parallel traffic,
    by the ring costs: (N−1)/N of the bytes per all-gather, reduce-scatter, broadcast or reduce,
    2(N−1)/N per all-reduce.

    ``root_bytes``: the parameters outside the model's layers (embeddings, final norm, head);
    ``layer_bytes``: those in its layers, of which ``owned_bytes`` are owner-sharded. ddp: every
    gradient all-reduced. fsdp (one group per layer and the root, as :func:`wrap_model` builds it):
    the root's parameters gathered once, each layer's twice (FSDP2 reshards a layer after forward
    and gathers it again for backward; the root it keeps), every gradient reduce-scattered. ownerz2 /
    ownerz3: FSDP2's traffic for the parameters not owner-sharded, and the owner-sharded matrices
    broadcast from their owners once (Z2) or twice (Z3) and their gradients reduced onto them.
    ``frozen_bytes``: of the root's, those without gradients (a VLA's frozen tower): gathered,
    never reduced. fsdptp: FSDP2's over the data-parallel ranks, of each rank's tensor-parallel
    part of the layers (the tensor-parallel activations' all-reduces not counted)."""
    if parallel == "fsdptp":  # FSDP2 over world/TP_DEGREE ranks; each holds its tensor-parallel part of the layers
        return training_traffic("fsdp", world // TP_DEGREE, root_bytes, layer_bytes // TP_DEGREE, 0, frozen_bytes)
    share = (world - 1) / world
    if parallel == "ddp":
        return 2 * share * (root_bytes + layer_bytes - frozen_bytes)
    rest = layer_bytes - owned_bytes
    fsdp = share * ((root_bytes + 2 * rest) + (root_bytes - frozen_bytes + rest))
    broadcasts = {"fsdp": 0, "ownerz2": 1, "ownerz3": 2}[parallel]
    return fsdp + share * (broadcasts + (1 if broadcasts else 0)) * owned_bytes


def wrap_model(model: nn.Module, parallel: str, world: int, device: torch.device,
               mesh=None) -> tuple[nn.Module, OwnerSharding | None]:
    """The model under ``parallel``, and its owner sharding if it has one."""
    if parallel == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None), None
    if parallel == "fsdptp":  # FSDP2 over the data-parallel ranks of TP_DEGREE-way tensor-parallel blocks
        mesh = init_device_mesh(device.type, (world // TP_DEGREE, TP_DEGREE), mesh_dim_names=("dp", "tp"))
        tensor_parallel_blocks(model, mesh["tp"])
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"]), None
    if mesh is None:
        mesh = init_device_mesh(device.type, (world,))
    sharding, ignored = None, None
    if parallel.startswith("owner"):
        sharding = shard_by_owner(model, mesh, layers=model.layers, reshard_after_forward=parallel == "ownerz3",
                                  replicate_rest=False)
        ignored = set(sharding.params)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    return fully_shard(model, mesh=mesh, ignored_params=ignored), sharding


def _factory(optimizer: str):
    if optimizer in OPTIMIZERS:
        return OPTIMIZERS[optimizer]
    from dmuon.tools.peers import PEERS

    return PEERS[optimizer].factory


def peer_configs() -> tuple[list[str], dict[str, str]]:
    """Bench configurations of the installed peers, and why the others are missing."""
    from dmuon.tools.peers import PEERS, available_peers, unavailable_peers

    available = available_peers()
    configs = [f"{mode}-{name}" for mode in ("ddp", "fsdp") for name in PEERS
               if name in available and mode in PEERS[name].parallel]
    return configs, unavailable_peers()


def plot(results: list[BenchResult], path: str) -> None:
    """Bar charts of step time, optimizer-step time and peak memory per configuration (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'dmuon[bench]'") from None
    names = [r.config for r in results]
    panels = [("step ms", [r.step_ms for r in results]), ("optimizer step ms", [r.opt_step_ms for r in results]),
              ("peak memory MB", [r.peak_mem_bytes / 2**20 for r in results])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (title, values) in zip(axes, panels):
        ax.barh(names, values, color=["tab:red" if "dmuon" in n else "tab:gray" for n in names])
        ax.set_title(title)
        ax.invert_yaxis()
    fig.suptitle(f"dmuon bench, world size {results[0].world_size}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=positive_int, default=2,
                        help="ranks to spawn (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo ranks; cuda: one GPU per rank with NCCL (default: %(default)s)")
    parser.add_argument("--preset", choices=["auto", *sorted(PRESETS), *sorted(VLA_PRESETS)], default="auto",
                        help="model preset; auto: bench where bf16 products are native (CUDA, or a CPU with "
                             "AVX512-BF16 or AMX), else demo, since vanilla Muon's bf16 Newton-Schulz would take "
                             "minutes per step on the bench preset there; vla: the embodied model (a frozen vision "
                             "tower, a language model and an action expert) (default: %(default)s)")
    parser.add_argument("--layers", type=positive_int,
                        help="override the preset's depth: real shapes, fewer layers (default: the preset's; of a "
                             "vla preset the language model's and action expert's)")
    parser.add_argument("--steps", type=positive_int, default=4,
                        help="measured steps per configuration at least, in rounds of --steps-per-round; more rounds "
                             "follow while a headline ratio is not within ±10 %% and --max-seconds allow "
                             "(default: %(default)s)")
    parser.add_argument("--max-seconds", type=non_negative_float, default=230,
                        help="the whole run's time budget: no extra round starts that would end after it; 0: no "
                             "extra rounds (default: %(default)s)")
    parser.add_argument("--steps-per-round", type=positive_int, default=1,
                        help="steps each configuration does in a round before the next one's turn, of which the "
                             "least counts; the order rotates by round (default: %(default)s: on 2 cores, more "
                             "rounds of one step settled the ratios sooner than fewer of two)")
    parser.add_argument("--warmup", type=non_negative_int, default=2,
                        help="unmeasured steps of each configuration before the rounds (FSDP2 + AdamW's second "
                             "step is still slow) (default: %(default)s)")
    parser.add_argument("--memory-steps", type=non_negative_int, default=2,
                        help="steps of the peak-memory pass, each configuration alone in fresh ranks; 0 skips "
                             "it (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank (default: %(default)s)")
    parser.add_argument("--tokens-per-step", type=positive_int, default=None,
                        help="tokens per step over all ranks, instead of --batch-size: it must be a multiple of "
                             "--world-size x --seq-len (default: --batch-size's)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help="tokens per sequence, at most the preset's max_seq_len (default: 128; a vla preset's "
                             "samples have a length of their own: image patches, prompt and action tokens)")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="the forward and backward's: fp32 weights with bf16 autocast (how GPU jobs train: "
                             "AdamW's share of a step is then realistic), or fp32 throughout, products without TF32 "
                             "(default: bf16-autocast on cuda, fp32 on cpu)")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="learning rate (default: %(default)s)")
    parser.add_argument("--weight-decay", type=non_negative_float, default=0.1,
                        help="decoupled weight decay (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
    parser.add_argument("--layout", choices=("dp", "fsdp-tp"), default="dp",
                        help="the default configurations: dp (DDP and FSDP2) or fsdp-tp (FSDP2 and FSDP2 x tensor "
                             "parallel on a (world/2, 2) mesh, each with AdamW and vanilla Muon) "
                             "(default: %(default)s)")
    parser.add_argument("--configs", type=name_list(CONFIGS + BF16_WIRE_CONFIGS + MORE_CONFIGS + FSDP_TP_CONFIGS),
                        default=None,
                        help=f"comma-separated subset of {','.join(CONFIGS)}, or of those and "
                             f"{','.join(BF16_WIRE_CONFIGS)} (dmuon with bf16 on the wire beside its exact default), "
                             f"{','.join(MORE_CONFIGS)}, {','.join(FSDP_TP_CONFIGS[3:])} "
                             f"(default: {','.join(CONFIGS)}; "
                             f"with --device cuda also {','.join(CUDA_CONFIGS[len(CONFIGS):])}; with --layout fsdp-tp "
                             f"{','.join(FSDP_TP_CONFIGS)})")
    parser.add_argument("--ns-coefficients", choices=NAMED_COEFFICIENTS, default="polar_express",
                        help="dmuon.Muon's Newton–Schulz coefficients; keller is what torch.optim.Muon and four of "
                             "the six peers run, you what heavyball and dion run (same cost: 5 quintic steps in "
                             "bf16) (default: %(default)s)")
    parser.add_argument("--comm-dtype", choices=sorted(COMM_DTYPES), default="exact",
                        help="dmuon.Muon's wire dtype: exact (each tensor's own to the owners, the updates back "
                             "in Newton-Schulz's dtype where narrower; results bitwise as one process's) or bf16 "
                             "(both ways, rounded) (default: %(default)s)")
    parser.add_argument("--peers", action="store_true",
                        help="add every installed peer implementation (pip install 'dmuon[peers]') (default: off)")
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="write one record per configuration (default: none)")
    parser.add_argument("--verbose", action="store_true",
                        help="a second table: bytes sent, peak memory, final loss, the ratios' ranges and the "
                             "optimizer-step efficiency (default: off)")
    parser.add_argument("--plot", metavar="PATH", type=output_path,
                        help="write a PNG of the results; needs matplotlib (default: none)")


def check_arguments(args: argparse.Namespace) -> None:
    """What spans several arguments or needs a look at the machine, checked before any rank starts."""
    if args.configs is None:
        args.configs = list(FSDP_TP_CONFIGS if args.layout == "fsdp-tp" else
                            CUDA_CONFIGS if args.device == "cuda" else CONFIGS)
    if any(name.startswith("fsdptp-") for name in args.configs) and args.world_size % TP_DEGREE:
        raise UsageError("--world-size", f"invalid value {args.world_size}: FSDP2 x tensor parallel runs on a "
                                         f"(world/{TP_DEGREE}, {TP_DEGREE}) mesh; give a multiple of {TP_DEGREE}")
    if args.precision is None:
        args.precision = "bf16-autocast" if args.device == "cuda" else "fp32"
    if args.preset == "auto":
        args.preset = "bench" if native_bf16(args.device) else "demo"
        if args.preset == "demo":
            print("preset auto: demo, since this CPU emulates bf16 products (no AVX512-BF16 or AMX) and vanilla "
                  "Muon's bf16 Newton-Schulz would take minutes per step on the bench preset; --preset bench "
                  "forces it", file=sys.stderr)
    config = get_config(args.preset)
    args.seq_len = sample_seq_len(args.seq_len, args.preset, config)
    if args.seq_len is None:
        args.seq_len = DEFAULT_SEQ_LEN
    check_seq_len(args.seq_len, args.preset, config.max_seq_len)
    if args.tokens_per_step is not None:
        per_sequence_step = args.world_size * args.seq_len
        if args.tokens_per_step % per_sequence_step:
            raise UsageError("--tokens-per-step", f"invalid value {args.tokens_per_step}: must be a multiple of "
                                                  f"--world-size x --seq-len = {per_sequence_step}")
        args.batch_size = args.tokens_per_step // per_sequence_step
    most = MAX_RANKS_PER_CORE * (os.cpu_count() or 1)
    if args.device == "cpu" and args.world_size > most:
        raise UsageError("--world-size", f"invalid value {args.world_size}: at most {most} here ({MAX_RANKS_PER_CORE} "
                                         "per CPU core; each rank is a process of its own with a copy of the model)")
    if args.device == "cuda":
        visible = torch.cuda.device_count()
        if not visible:
            raise UsageError("--device", "invalid value 'cuda': no GPU is visible")
        if args.world_size > visible:
            raise UsageError("--world-size", f"invalid value {args.world_size}: --device cuda runs one rank per "
                                             f"GPU, and {visible} are visible")
    check_memory(args)
    check_plot(args.plot)


def check_memory(args: argparse.Namespace) -> None:
    """Refuse a run whose ranks would not fit in memory (each holds every configuration's model
    in the timed rounds): on CPU all ranks in this machine's, on CUDA each in its GPU's."""
    def needed(layers: int | None, batch_size: int = 4, tokens_per_step: int | None = None) -> tuple[int, int]:
        config = get_config(args.preset, **({"n_layers": layers} if layers else {}))  # the override's size
        sequences = tokens_per_step // (ranks * args.seq_len) if tokens_per_step else batch_size
        params, activations = training_bytes(config, sequences, args.seq_len, models=len(args.configs))
        return (params, activations) if args.device == "cuda" else (ranks * params, ranks * activations)

    ranks = args.world_size
    batch = ("--tokens-per-step", (args.tokens_per_step, None)) if args.tokens_per_step else \
        ("--batch-size", (args.batch_size, 4))
    options = dict([("--layers", (args.layers, None)), batch])
    model = ("--preset", args.preset)
    if args.device == "cuda":
        check_fits(needed, options, gpu_memory(), "on one GPU", model)
    else:
        check_fits(needed, options, available_memory(), f"here for {ranks} ranks", model)


def preset_config(args: argparse.Namespace):
    """The ``--preset`` model's config at ``--layers``."""
    return get_config(args.preset, **({"n_layers": args.layers} if args.layers else {}))


def model_summary(args: argparse.Namespace) -> str:
    """E.g. "bench preset, 27.3M parameters, 2 ranks x 4 sequences x 128 tokens = 1,024 tokens per step"."""
    config = preset_config(args)
    parameters, trained = param_count(config), trainable_params(config)
    tokens = args.world_size * args.batch_size * args.seq_len
    size = f"{parameters / 1e6:.1f}M" if parameters >= 100_000 else f"{parameters:,}"
    if isinstance(config, VLAConfig):
        return (f"{args.preset} preset, {size} parameters ({trained / 1e6:.1f}M trained, the vision tower "
                f"{'frozen' if config.freeze_vision else 'trained'}), {args.world_size} ranks x {args.batch_size} "
                f"samples x {args.seq_len} tokens ({config.vision.n_patches} image patches, {config.text_tokens} "
                f"prompt, {config.action_steps} action) = {tokens:,} tokens per step, {args.precision}")
    return (f"{args.preset} preset, {size} parameters, {args.world_size} ranks x {args.batch_size} "
            f"sequences x {args.seq_len} tokens = {tokens:,} tokens per step, {args.precision}")


def plan_pointer(args: argparse.Namespace) -> list[str]:
    """How this run's figure relates to the reader's job, and the ``dmuon plan`` command that
    predicts this run (to check the prediction here) and, with their own values, theirs."""
    hardware = "cpu"
    if args.device == "cuda":
        name = torch.cuda.get_device_name(0).lower()
        hardware = next((h for h in ("h200", "h100", "b200", "a800", "a100") if h in name), "h100")
    tokens = args.world_size * args.batch_size * args.seq_len
    layers = f" --layers {args.layers}" if args.layers else ""
    this_run = (f"dmuon plan --model {args.preset}{layers} --world-size {args.world_size} --hardware {hardware} "
                f"--tokens-per-step {tokens} --seq-len {args.seq_len}")
    text = (f"  your job: these ratios are this run's ({args.world_size} {args.device.upper()} ranks, "
            f"{tokens // args.world_size:,} tokens per rank). dmuon's step over AdamW's is its optimizer step "
            "(mostly Newton-Schulz, fixed by the model and the ranks) over the forward and backward pass (growing "
            "with the tokens per rank): more tokens per rank, a faster device for the products, or more ranks to "
            f"share Newton-Schulz shrink it. `{this_run}` predicts this run; with your model, ranks, hardware and "
            "tokens per step (`dmuon plan --model llama-3.1-8b --world-size 64 --hardware h100 --tokens-per-step "
            "524288`) it predicts your job.")
    return textwrap.wrap(text, 100, subsequent_indent="    ", break_on_hyphens=False)


def run(args: argparse.Namespace) -> int:
    from dmuon.tools.hardware import OtherJobsCpu

    if args.peers:
        peers, missing = peer_configs()
        args.configs = [*args.configs, *peers]
        for package, reason in missing.items():
            print(f"peer {package} skipped: {reason}", file=sys.stderr)
    started = time.perf_counter()
    # a wall-clock time every rank can read: when no extra round may end later
    args.deadline = time.time() + args.max_seconds if args.max_seconds else None
    n = len(args.configs)
    print(f"dmuon bench: {args.preset} preset, {args.world_size} {args.device} ranks x {args.threads} thread(s), "
          f"{n} configurations", file=sys.stderr, flush=True)
    peaks = {}
    if args.memory_steps:
        print(f"peak memory: each configuration alone in fresh ranks, {args.memory_steps} step(s)",
              file=sys.stderr, flush=True)
        for i, name in enumerate(args.configs, start=1):
            peaks[name] = run_config(name, args)
            print(f"[{i}/{n}] {name}: peak memory {peaks[name] / 2**20:,.1f} MiB per rank", file=sys.stderr,
                  flush=True)
    rounds = len(rounds_of(args.steps, args.steps_per_round))
    print(f"timing: the {n} configurations in the same ranks, {args.warmup} warm-up step(s) each, then {rounds} "
          f"round(s) of {args.steps_per_round} step(s) each, the order rotated by round", file=sys.stderr, flush=True)
    with OtherJobsCpu() as others:
        timed = run_config(args.configs, args, mode="timed")
    measured = timed["results"]
    # the rounds come last in the ranks' run: the load that matters is the run's tail
    rounds_seconds = sum(math.fsum(t for t in r.rounds("step_ms") if not math.isnan(t)) * max(1, args.steps_per_round)
                         for r in measured.values()) / 1e3
    load = Load(others.cores_used_in_last(rounds_seconds), os.cpu_count() or 1)
    results = [dataclasses.replace(measured[name], peak_mem_bytes=peaks.get(name, 0)) for name in args.configs]
    print(format_table(results, load, about=model_summary(args), verbose=args.verbose, your_job=plan_pointer(args)))
    print(f"(bench took {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.device == "cuda":
        from dmuon.tools.throughput import gpu_report

        print(gpu_report(torch.device("cuda", 0)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_records(results, load), f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0
