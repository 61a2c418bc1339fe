"""``dmuon plan``: dmuon's plan for a model at N ranks, and the predicted cost of a step.

    dmuon plan --model llama-3.1-8b --world-size 512 --hardware h100 --mode fsdp2
    dmuon plan --model qwen3-30b-a3b --world-size 256 --tp 4 --pp 4 --ep 8 --hardware h100

prints how each kind of matrix is orthogonalized, how the Newton–Schulz work and the bytes
spread over the ranks (every rank for small N, min/median/max beyond), the optimizer's memory,
then the predicted optimizer-step and step times of AdamW, vanilla distributed Muon and dmuon
(:func:`dmuon.tools.simulate.predict`). ``--model`` takes a preset name or the path of a Hugging
Face ``config.json``. With ``--tp``/``--pp``/``--ep`` the job is torchtitan's layout: pipeline
stages of world/pp ranks, each a (dp, tp) mesh with FSDP2 over dp and the block's matrices
column- or row-wise over tp, experts over an (ep, expert-FSDP) mesh of the stage's ranks; the
plan is the first stage's optimizer's (the stages differ in names only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from dmuon.planner import DEFAULT_BUCKET_BYTES
from dmuon.tools.cli import UsageError, fraction, output_path, positive_int, sample_seq_len
from dmuon.tools.costmodel import (
    DEFAULT_SEQ_LEN,
    DEFAULT_TOKENS_PER_RANK,
    MODES,
    PRESET_NAMES,
    Workload,
    load_model_config,
    measured_mfu,
    muon_params,
    stage_plan,
)
from dmuon.tools.hardware import DEFAULT_GPU_MFU, HARDWARE_NAMES, HardwareProfile, get_profile, measure_one_rank_seconds
from dmuon.tools.models import LlamaConfig, VLAConfig, muon_units, param_count, trainable_params
from dmuon.tools.simulate import Prediction, measured_elementwise_efficiency, predict

PER_RANK_TABLE_MAX = 16  # world sizes up to this print one row per rank
CPU_MEASURE_MAX_PARAMS = 200_000_000  # largest model of which `--hardware cpu` times a training step
# The plan keeps a few kB per rank (measured: 0.42 GB and 8 s at 4096 ranks, 0.68 GB and 13 s at
# 32768 for llama-3.1-8b on a 2-core EPYC); a million ranks would need about 9 GB.
MAX_WORLD_SIZE = 65536
MAX_LAYERS = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.1-8b",
                        help=f"preset name ({', '.join(PRESET_NAMES)}; vla and pi0: embodied models) or path to a "
                             "config.json (default: %(default)s)")
    parser.add_argument("--world-size", type=positive_int, default=8,
                        help="ranks in all: tp x pp x data-parallel ranks (default: %(default)s)")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks (default: %(default)s)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (default: %(default)s)")
    parser.add_argument("--ep", type=positive_int, default=1,
                        help="expert-parallel ranks, within a stage (default: %(default)s)")
    parser.add_argument("--hardware", choices=HARDWARE_NAMES, default="h100",
                        help="GPU datasheet profile, or cpu (measured now, on this machine) (default: %(default)s)")
    parser.add_argument("--mode", choices=MODES, default="fsdp2",
                        help="owner: owner-sharded data parallel (dmuon.shard_by_owner) (default: %(default)s)")
    parser.add_argument("--tokens-per-step", type=positive_int,
                        help=f"global tokens per step, at least one per rank (default: {DEFAULT_TOKENS_PER_RANK} "
                             "per rank)")
    parser.add_argument("--seq-len", type=positive_int,
                        help=f"tokens per sequence, at most the model's max_seq_len (default: {DEFAULT_SEQ_LEN}, "
                             "or the model's max_seq_len if that is smaller)")
    parser.add_argument("--layers", type=positive_int, help="override the model's depth (default: the model's)")
    parser.add_argument("--mfu", type=fraction,
                        help="forward+backward model FLOPs utilization, in (0, 1] (default: the profile's, "
                             f"{DEFAULT_GPU_MFU} on GPUs; cpu: measured)")
    parser.add_argument("--bucket-bytes", type=positive_int, default=DEFAULT_BUCKET_BYTES,
                        help="dmuon.Muon's bucket_bytes (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch threads per rank (cpu) (default: %(default)s)")
    parser.add_argument("--momentum-dtype", choices=("float32", "bfloat16", "int8"), default="float32",
                        help="dmuon.Muon's momentum_dtype (int8: 8-bit blocks), for the optimizer state "
                             "(default: %(default)s)")
    parser.add_argument("--update-rule", choices=("muon", "normuon"), default="muon",
                        help="dmuon.Muon's update_rule: normuon adds its row state and that state's all-reduce "
                             "(default: %(default)s)")
    parser.add_argument("--no-split", action="store_true",
                        help="keep every matrix whole on one owner (default: the planner may split large "
                             "matrices over gangs of ranks, as dmuon.Muon does)")
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="write the prediction as one JSON record (default: none)")


def _model_config(spec: str, layers: int | None) -> LlamaConfig | VLAConfig:
    """``--model``'s config, or a :class:`UsageError` that says what is wrong with it."""
    if spec not in PRESET_NAMES and not os.path.isfile(spec):
        looks_like_a_path = spec.endswith(".json") or os.sep in spec
        what = "no such file" if looks_like_a_path else "unknown model"
        raise UsageError("--model", f"invalid value {spec!r}: {what}; give a preset name "
                                    f"({', '.join(PRESET_NAMES)}) or the path of a config.json")
    try:
        return load_model_config(spec, layers)
    except (OSError, ValueError, TypeError) as err:  # json.JSONDecodeError is a ValueError
        raise UsageError("--model", f"invalid value {spec!r}: not a readable Llama-style config.json: {err}") from None


def check_arguments(args: argparse.Namespace) -> None:
    """Check what spans several arguments before measuring or predicting anything, and fill in
    ``args.config`` (the model), ``args.seq_len`` and ``args.tokens_per_step`` where not given."""
    if args.layers is not None and args.layers > MAX_LAYERS:
        raise UsageError("--layers", f"invalid value {args.layers}: at most {MAX_LAYERS} (the deepest models have "
                                     "about 130; the simulation's time grows with the layers)")
    if args.world_size > MAX_WORLD_SIZE:
        raise UsageError("--world-size", f"invalid value {args.world_size}: at most {MAX_WORLD_SIZE} (the plan "
                                         "keeps a few kB per rank)")
    args.config = config = _model_config(args.model, args.layers)
    args.seq_len = sample_seq_len(args.seq_len, args.model, config)
    if args.seq_len is None:
        args.seq_len = min(DEFAULT_SEQ_LEN, config.max_seq_len)
    elif args.seq_len > config.max_seq_len:
        raise UsageError("--seq-len", f"invalid value {args.seq_len}: above {args.model}'s max_seq_len "
                                      f"{config.max_seq_len}")
    if args.tokens_per_step is None:
        args.tokens_per_step = DEFAULT_TOKENS_PER_RANK * args.world_size
    elif args.tokens_per_step < args.world_size:
        raise UsageError("--tokens-per-step", f"invalid value {args.tokens_per_step}: fewer than one token for "
                                              f"each of the {args.world_size} ranks")
    try:  # tp, pp and ep against the world size, the mode and the model
        Workload(config, args.world_size, args.mode, get_profile("h100"), tp=args.tp, pp=args.pp, ep=args.ep)
    except ValueError as err:
        raise UsageError("--tp/--pp/--ep", str(err)) from None
    if args.hardware == "cpu" and config.n_experts:
        raise UsageError("--hardware", f"cpu times a training step of dmuon's dense model, and {args.model} is a "
                                       "mixture of experts: pick a GPU profile")
    if args.hardware == "cpu" and param_count(config) > CPU_MEASURE_MAX_PARAMS:
        raise UsageError("--hardware", f"cpu times one rank's training step, and {args.model} is too big for that "
                                       f"here ({param_count(config) / 1e9:.2f} B parameters, at most "
                                       f"{CPU_MEASURE_MAX_PARAMS / 1e9:.2f} B): pass fewer --layers")


def measure_cpu_rank(config: LlamaConfig, tokens_per_rank: int, seq_len: int, profile: HardwareProfile,
                     mfu: float | None) -> tuple[float, float]:
    """(MFU, element-wise efficiency) of this CPU, measured now on one rank training ``config``
    alone; a given ``mfu`` is kept.

    A measured MFU above 1 means the profile's product rate (measured first, in a few short
    runs) read low: other jobs slowed those runs more than the training step. The prediction then
    goes on at MFU 1, the most the profile allows, with a warning that says so."""
    seq = min(seq_len, tokens_per_rank)
    batch = max(1, tokens_per_rank // seq)
    alone = measure_one_rank_seconds(config, batch, seq, profile.threads)
    if mfu is None:
        mfu = measured_mfu(config, batch * seq, seq, alone.forward_backward, profile)
        if mfu > 1:  # a rate over a positive time: never <= 0
            print(f"dmuon plan: warning: the measured MFU came out {mfu:.2f}, above 1: this machine was busy "
                  f"while its product rate was measured, so that rate reads low; going on with MFU 1 (pass "
                  f"--mfu to choose one, or rerun on a quieter machine)", file=sys.stderr)
            mfu = 1.0
    one_rank = Workload(config, 1, "ddp", profile, batch * seq, seq, mfu)
    return mfu, measured_elementwise_efficiency(one_rank, alone.optimizer_step, alone.newton_schulz)


def count_text(count: int) -> str:
    """A parameter count as people write it: 8.03 B, 27.3 M, 920 k."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}" if size < 1e9 else f"{count / size:.2f} {unit}"
    return str(count)


def balance_summary(prediction: Prediction) -> str:
    low, mid, high = prediction.ns_gflop_per_rank
    lo_b, mid_b, hi_b = prediction.mb_sent_per_rank
    return "\n".join([
        f"{'per rank':<22} {'min':>10} {'median':>10} {'max':>10}",
        f"{'NS GFLOP':<22} {low:>10.1f} {mid:>10.1f} {high:>10.1f}",
        f"{'optimizer MB sent':<22} {lo_b:>10.1f} {mid_b:>10.1f} {hi_b:>10.1f}",
        f"imbalance (max/mean NS FLOPs): {prediction.imbalance:.2f}; buckets: {prediction.buckets}",
    ])


def predictions_table(p: Prediction, whole: Prediction | None = None) -> str:
    """The predicted times; ``whole``: the same with every matrix kept whole, for comparison."""
    base = "fsdp2" if p.mode == "owner" else p.mode
    rows = [
        (f"AdamW ({base})", p.adamw_opt_ms, p.adamw_step_ms),
        (f"vanilla Muon ({base})", p.vanilla_opt_ms, p.vanilla_step_ms),
        (f"dmuon ({p.mode})", p.dmuon_opt_ms, p.dmuon_step_ms),
    ]
    if whole is not None:
        rows.append(("dmuon, matrices whole", whole.dmuon_opt_ms, whole.dmuon_step_ms))
    if p.early_start_hidden_ms:
        rows.append(("dmuon, early start", p.dmuon_early_opt_ms, p.dmuon_early_step_ms))
    lines = [f"{'predicted, ms':<24} {'optimizer step':>14} {'step':>10} {'vs AdamW':>9}"]
    for name, opt, step in rows:
        lines.append(f"{name:<24} {opt:>14.1f} {step:>10.1f} {step / p.adamw_step_ms - 1:>+9.1%}")
    if p.early_start_hidden_ms:
        lines.append(f"early start: {p.early_start_hidden_ms:.1f} ms of the optimizer step run in the backward pass's "
                     "idle device time (an assumed 6 % of it, from one H200 measurement); its row's optimizer step "
                     "is what is left after the backward pass, of the whole-matrix plan")
        if p.dmuon_early_step_ms > p.dmuon_step_ms:
            lines.append("early start is predicted slower here than the step's own plan (its buckets follow the "
                         "backward pass and keep every matrix whole): pass early_start=False")
    if p.split_matrices:
        gangs = p.split_matrices - p.column_block_matrices
        parts = ([f"{gangs} matrices over gangs of {p.gang_size} ranks"] if gangs else []) + (
            [f"{p.column_block_matrices} over all ranks on their column blocks"] if p.column_block_matrices else [])
        lines.append("dmuon splits " + " and ".join(parts)
                     + ("; with early start (CUDA's default) every matrix stays whole" if p.early_start_hidden_ms
                        else ""))
    lines += [
        f"{'dmuon lower bound':<24} {p.lower_bound_opt_ms:>14.1f}",
        f"forward+backward products {p.forward_backward_ms:.1f} ms at MFU {p.mfu:.2f}; element-wise phases at "
        f"{p.elementwise_efficiency:.2f} of the profile's rates; "
        f"data-parallel collectives {p.data_parallel_comm_ms:.1f} ms",
        f"dmuon vs vanilla Muon: optimizer step {p.opt_speedup_vs_vanilla:.2f}x faster, "
        f"step {p.step_speedup_vs_vanilla:.2f}x faster",
    ]
    return "\n".join(lines)


def strategies_table(p: Prediction, layers: int) -> str:
    """How each kind of matrix of a stage is orthogonalized."""
    lines = [f"{f'Muon parameters of a stage ({layers} layers)':<40} {'count':>6}  how"]
    lines += [f"{kind:<40} {count:>6}  {how}" for kind, count, how in p.strategies]
    return "\n".join(lines)


def memory_lines(p: Prediction) -> str:
    return (f"optimizer state per rank: dmuon {p.dmuon_state_gb:.2f} GB, AdamW {p.adamw_state_gb:.2f} GB; dmuon's "
            f"exchange buffers at most {p.exchange_buffer_gb:.2f} GB (two buckets in flight)")


def left_out(tp: int, pp: int, ep: int) -> list[str]:
    """What the prediction leaves out for a tensor-, pipeline- or expert-parallel layout: each adds
    time to AdamW's step and dmuon's alike, so the printed overheads over AdamW are upper bounds
    of what those collectives would dilute, not of the step."""
    missing = [what for degree, what in ((tp, "tensor parallel's activation all-reduces / all-gathers"),
                                         (ep, "expert parallel's token all-to-alls (dispatch and combine)"),
                                         (pp, "the pipeline's activation sends and its bubble (idle stages)"))
               if degree > 1]
    if not missing:
        return []
    return ["not modelled: " + "; ".join(missing) + ". They lengthen AdamW's step and dmuon's alike, so the real "
            "step is longer and dmuon's overhead over AdamW smaller than printed; only the data-parallel collectives "
            "and the optimizer are priced."]


def run(args: argparse.Namespace) -> int:
    """Predict and print; ``args`` as :func:`check_arguments` left them."""
    config, tokens = args.config, args.tokens_per_step
    if args.hardware == "cpu":
        print("dmuon plan: measuring this machine first (product, memory and loopback rates, then one rank "
              "training the model; about 20 s on 2 free cores, longer when other jobs share them)...",
              file=sys.stderr, flush=True)
    profile = get_profile(args.hardware, args.threads)
    mfu, efficiency = args.mfu, 1.0
    if profile.device_type == "cpu":
        mfu, efficiency = measure_cpu_rank(config, tokens // args.world_size, args.seq_len, profile, args.mfu)
    workload = Workload(config, args.world_size, args.mode, profile, tokens // args.world_size, args.seq_len,
                        mfu, efficiency, bucket_bytes=args.bucket_bytes, split=not args.no_split,
                        tp=args.tp, pp=args.pp, ep=args.ep, momentum_dtype=args.momentum_dtype,
                        update_rule=args.update_rule)
    prediction = predict(workload, args.model)
    whole = predict(replace(workload, split=False), args.model) if prediction.split_matrices else None
    units = muon_units(config)
    stacks = [count for name, count, _, _ in units if ".experts." in name]
    in_stacks = f", {len(stacks)} of them stacks of {stacks[0]} experts" if stacks else ""
    layout = (f", tp {args.tp} x pp {args.pp} x ep {args.ep}: stages of {workload.group_size} ranks, "
              f"dp {workload.dp}" if (args.tp, args.pp, args.ep) != (1, 1, 1) else "")
    frozen = param_count(config) - trainable_params(config)
    frozen_text = f", {count_text(frozen)} frozen" if frozen else ""
    print(f"dmuon plan: {args.model} ({count_text(param_count(config))} parameters{frozen_text}, "
          f"{count_text(muon_params(config))} in {len(units)} Muon parameters{in_stacks}), "
          f"{args.world_size} x {profile.name}, {args.mode}{layout}")
    sequences = "samples" if isinstance(config, VLAConfig) else "sequences"
    print(f"tokens per step {tokens:,} ({workload.tokens_per_rank:,} per rank, {sequences} of {args.seq_len:,}); "
          f"Newton–Schulz: {prediction.ns_recipe}")
    print(f"hardware: {profile.source}\n")
    print(strategies_table(prediction, workload.stage_config.n_layers) + "\n")
    plans = stage_plan(workload).plans
    if (workload.group_size <= PER_RANK_TABLE_MAX and args.mode != "owner" and not prediction.split_matrices
            and len(plans) == 1):
        print(plans[0].table() + "\n")
    else:
        print(balance_summary(prediction) + "\n")
    print(memory_lines(prediction))
    print(predictions_table(prediction, whole))
    caveats = left_out(args.tp, args.pp, args.ep)
    for line in caveats:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**asdict(prediction), "not_modelled": caveats}, f, indent=1)
            f.write("\n")
    return 0
