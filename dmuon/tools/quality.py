"""``dmuon quality``: AdamW vs torch.optim.Muon vs dmuon.Muon, validation loss vs step, each at
the best lr of its sweep, over one or more seeds.

``dmuon demo`` trains each optimizer once, at one lr, for a quick look. This command sweeps the
learning rates and measures validation loss on one of two workloads, with nothing downloaded:
``--workload text`` (default), a byte-level Llama on the source of the running Python's standard
library (:mod:`dmuon.tools.corpus`); ``--workload vla``, the embodied model ``vla-tiny``
(:mod:`dmuon.tools.vla`: a frozen vision tower, a language model and an action expert) on its
synthetic episodes, the validation set being episodes the run never trains on.

Method:

* **Corpus.** Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (or ``--corpus DIR``),
  sorted by relative path, read as bytes: one byte is one token (vocabulary 256). Files under
  ``site-packages`` / ``dist-packages`` are left out (third-party packages, different on every
  machine), and so is the top-level ``test`` package (several Linux distributions ship it
  separately). Every 20th file in that order is validation, the others are training, so the two
  share no file; each side is its files concatenated.
* **Batches.** A training batch is ``batch_size`` windows of ``seq_len + 1`` bytes at offsets
  drawn from a generator seeded by ``(seed, step)``: every run sees the same batches in the same
  order. The validation set is fixed: ``val_batches * batch_size`` windows at evenly spaced
  offsets over the whole validation text.
* **Runs.** Each optimizer (the factories of ``dmuon demo``) trains the model from the same seed,
  hence the same initial weights, once per learning rate of its sweep and seed (``--seeds``), for
  the same number of steps, under the same schedule (:func:`lr_factor`). The validation loss (text:
  mean cross-entropy in nats per byte; VLA: the prompt's cross-entropy plus the actions' mean
  squared error) is measured before training, every ``eval_every`` steps and after the last step.
  Over several seeds a run's curve is the mean of the seeds' curves (:func:`mean_over_seeds`).
* **Reading.** An optimizer's best learning rate is the one with the lowest final validation
  loss (over seeds: the lowest mean). Its steps to the target are those of the first evaluation at
  or below ``--target-loss`` (so they are exact to ``eval_every`` steps); its seconds are the training time (forward,
  backward, optimizer step) up to that evaluation, evaluations excluded. The runs go one after
  the other in one process, so seconds on a shared machine are noisier than steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from dmuon.tools.cli import (
    UsageError,
    check_fits,
    check_plot,
    name_list,
    non_negative_float,
    output_path,
    positive_float,
    positive_int,
)
from dmuon.tools.corpus import VAL_EVERY, VOCAB_SIZE, Corpus, load_corpus, train_batch, val_batches
from dmuon.tools.demo import CONFIGS, DEFAULT_CONFIGS, OptimizerFactory, state_bytes
from dmuon.tools.hardware import available_memory
from dmuon.tools.models import Llama, LlamaConfig, VLAConfig, get_config, param_count, training_bytes
from dmuon.tools.vla import VLA, SyntheticEpisodes
from dmuon.tools.workloads import Batch, training_loss

WORKLOADS = ("text", "vla")
VLA_PRESET = "vla-tiny"

HEAD_DIM = 32

# Per optimizer: a sweep around its good region at the default scale. torch-muon and dmuon use
# adjust_lr_fn="match_rms_adamw", so their lr is on AdamW's scale (and also drives the AdamW
# that trains their embeddings, head and norms).
# Four lrs each (the same budget), doubling, chosen after a first sweep of three (AdamW 2e-3,
# 4e-3, 8e-3; both Muons 4e-3, 8e-3, 1.6e-2) put AdamW's best at its lowest lr and the Muons'
# at their highest: each sweep now reaches past its best on the side where it was cut.
# The VLA: one sweep for all, doubling, after a first one (1e-3, 4e-3, 1.6e-2; seed 0, 300 steps)
# put AdamW's and dmuon's best at 1.6e-2 with 4e-3 close behind: this one reaches past it.
DEFAULT_LRS: dict[str, dict[str, tuple[float, ...]]] = {
    "text": {
        "adamw": (5e-4, 1e-3, 2e-3, 4e-3),
        "torch-muon": (4e-3, 8e-3, 1.6e-2, 3.2e-2),
        "dmuon": (4e-3, 8e-3, 1.6e-2, 3.2e-2),
        "dmuon-normuon": (4e-3, 8e-3, 1.6e-2, 3.2e-2),
        "dmuon-aol": (4e-3, 8e-3, 1.6e-2, 3.2e-2),
        "dmuon-bf16mom": (4e-3, 8e-3, 1.6e-2, 3.2e-2),
        "dmuon-int8mom": (4e-3, 8e-3, 1.6e-2, 3.2e-2),
    },
    "vla": {name: (2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2) for name in CONFIGS},
}
# Text: just above AdamW's best final loss in that first sweep (2.33), so that every optimizer can
# reach it within the default budget and steps to it compare them.
DEFAULT_TARGET_LOSS = {"text": 2.4, "vla": 1.8}
DEFAULT_STEPS = {"text": 200, "vla": 300}


# ---------------------------------------------------------------------------- training


def model_config(dim: int, layers: int, seq_len: int) -> LlamaConfig:
    """A byte-vocabulary Llama of width ``dim`` (a multiple of 32): 32-wide heads, two query heads
    per key/value head where there are two or more, SwiGLU width 3 * dim."""
    heads = dim // HEAD_DIM
    return LlamaConfig(vocab_size=VOCAB_SIZE, dim=dim, ffn_dim=3 * dim, n_layers=layers, n_heads=heads,
                       n_kv_heads=heads // 2 if heads % 2 == 0 else heads, head_dim=HEAD_DIM, max_seq_len=seq_len)


def lr_factor(step: int, steps: int) -> float:
    """Multiplier of the lr at 0-based ``step`` of ``steps``: linear warm-up over the first 5 %,
    constant, linear decay to 0 over the last 20 %. The same for every optimizer; the decay lets
    the final loss be read off the last evaluation instead of a noisy constant-lr plateau."""
    warmup, cooldown = max(1, steps // 20), max(1, steps // 5)
    return min(1.0, (step + 1) / warmup, (steps - step) / cooldown)


@dataclass(frozen=True)
class Task:
    """What the runs train: ``build(seed)`` the model, ``batches(seed)`` its training batch of each
    step and its validation batches, ``loss(model, batch)`` the mean loss of a batch."""

    build: Callable[[int], nn.Module]
    batches: Callable[[int], tuple[Callable[[int], Batch], list[Batch]]]
    loss: Callable[[nn.Module, Batch], torch.Tensor]


def text_task(corpus: Corpus, config: LlamaConfig, batch_size: int, val_count: int) -> Task:
    """The byte-level Llama on the corpus: batches drawn by (seed, step), one fixed validation set."""
    val = val_batches(corpus.val, val_count, batch_size, config.max_seq_len)

    def batches(seed: int) -> tuple[Callable[[int], Batch], list[Batch]]:
        return (lambda step: train_batch(corpus.train, step, batch_size, config.max_seq_len, seed)), val

    return Task(lambda seed: Llama(config, seed=seed), batches, lambda model, batch: model.loss(*batch))


# Validation episodes are those of steps the training never reaches (a batch is a pure function
# of the seed and its step), from the same task: each seed draws its own action function.
VAL_FIRST_STEP = 10**9


def vla_task(config: VLAConfig, batch_size: int, val_count: int) -> Task:
    """The embodied model on its synthetic episodes (the seed draws the weights and the task)."""
    def batches(seed: int) -> tuple[Callable[[int], Batch], list[Batch]]:
        episodes = SyntheticEpisodes(config, seed=seed)
        val = [episodes.batch(VAL_FIRST_STEP + i, batch_size) for i in range(val_count)]
        return (lambda step: episodes.batch(step, batch_size)), val

    return Task(lambda seed: VLA(config, seed=seed), batches, training_loss)


@dataclass(frozen=True)
class Run:
    """One optimizer at one learning rate: its validation curve (over several seeds, their mean)."""

    optimizer: str
    lr: float
    steps: int  # steps trained; fewer than asked if the training loss stopped being finite
    diverged: bool
    curve: tuple[tuple[int, float, float], ...]  # (step, training seconds so far, validation loss)
    seeds: tuple[int, ...] = (0,)
    finals: tuple[float, ...] = ()  # each seed's final validation loss, over several seeds
    optimizer_seconds: float = 0.0  # of the training seconds, the optimizers' steps (mean over seeds)
    state_bytes: int = 0  # the optimizers' state tensors at the end

    @property
    def final_val_loss(self) -> float | None:
        return None if self.diverged else self.curve[-1][2]


@torch.no_grad()
def evaluate(model: nn.Module, batches: Sequence[Batch], loss: Callable[[nn.Module, Batch], torch.Tensor]) -> float:
    """Mean validation loss over ``batches`` (equal-sized, so the mean of means is the sample mean)."""
    return sum(loss(model, batch).item() for batch in batches) / len(batches)


def train_run(
    optimizer: str,
    make_optimizer: OptimizerFactory,
    lr: float,
    *,
    task: Task,
    steps: int,
    eval_every: int,
    weight_decay: float,
    seed: int,
    progress: Callable[[int, float], None] | None = None,
) -> Run:
    """Train ``task``'s model of ``seed`` for ``steps`` steps at peak ``lr``.

    A run whose training loss is not finite stops there (``diverged``): its later steps would
    say nothing and cost as much as good ones. ``progress(step, val_loss)`` follows each evaluation.
    """
    model = task.build(seed)
    batch_of, val = task.batches(seed)
    optimizers = make_optimizer(model, lr, weight_decay)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_factor(s, steps)) for o in optimizers]
    curve = [(0, 0.0, evaluate(model, val, task.loss))]
    seconds = optimizer_seconds = 0.0
    for step in range(1, steps + 1):
        batch = batch_of(step - 1)
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = task.loss(model, batch)
        loss.backward()
        stepping = time.perf_counter()
        for opt, scheduler in zip(optimizers, schedulers):
            opt.step()
            scheduler.step()
        now = time.perf_counter()
        seconds, optimizer_seconds = seconds + now - start, optimizer_seconds + now - stepping
        if not math.isfinite(loss.item()):
            return Run(optimizer, lr, step, True, tuple(curve), (seed,))
        if step % eval_every == 0 or step == steps:
            curve.append((step, seconds, evaluate(model, val, task.loss)))
            if progress is not None:
                progress(step, curve[-1][2])
    return Run(optimizer, lr, steps, False, tuple(curve), (seed,), optimizer_seconds=optimizer_seconds,
               state_bytes=state_bytes(optimizers)[0])


def mean_over_seeds(runs: Sequence[Run]) -> list[Run]:
    """One run per (optimizer, lr), in first-seen order: the mean curve of its seeds' runs (their
    evaluations fall on the same steps), diverged if any seed diverged."""
    keys = list(dict.fromkeys((r.optimizer, r.lr) for r in runs))
    out = []
    for optimizer, lr in keys:
        group = [r for r in runs if (r.optimizer, r.lr) == (optimizer, lr)]
        if len(group) == 1:
            out.append(group[0])
            continue
        diverged = any(r.diverged for r in group)
        length = min(len(r.curve) for r in group)
        curve = tuple((group[0].curve[i][0], *(sum(r.curve[i][k] for r in group) / len(group) for k in (1, 2)))
                      for i in range(length))
        finals = () if diverged else tuple(r.curve[-1][2] for r in group)
        out.append(Run(optimizer, lr, min(r.steps for r in group), diverged, curve,
                       tuple(s for r in group for s in r.seeds), finals,
                       sum(r.optimizer_seconds for r in group) / len(group), group[0].state_bytes))
    return out


# ---------------------------------------------------------------------------- reading the runs


def time_to_target(curve: Sequence[tuple[int, float, float]], target: float) -> tuple[int, float] | None:
    """``(step, seconds)`` of the first point of ``curve`` at or below ``target``; None if none is."""
    return next(((step, seconds) for step, seconds, loss in curve if loss <= target), None)


def best_run(runs: Sequence[Run]) -> Run:
    """The run with the lowest final validation loss (diverged runs last; the first on ties)."""
    return min(runs, key=lambda r: math.inf if r.final_val_loss is None else r.final_val_loss)


def best_runs(runs: Sequence[Run]) -> dict[str, Run]:
    """Each optimizer's best run, in the order the optimizers first appear in ``runs``."""
    names = list(dict.fromkeys(r.optimizer for r in runs))
    return {name: best_run([r for r in runs if r.optimizer == name]) for name in names}


def winner(best: dict[str, Run], target: float) -> str | None:
    """The optimizer whose best run reached ``target`` in the fewest steps (then seconds); None if none did."""
    reached = {name: time_to_target(run.curve, target) for name, run in best.items()}
    reached = {name: hit for name, hit in reached.items() if hit is not None}
    return min(reached, key=lambda name: reached[name]) if reached else None


def _fmt_loss(loss: float | None) -> str:
    return "diverged" if loss is None else f"{loss:.4f}"


def _fmt_hit(run: Run, target: float) -> tuple[str, str]:
    hit = time_to_target(run.curve, target)
    return ("not reached", "-") if hit is None else (str(hit[0]), f"{hit[1]:.1f}")


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_runs(runs: Sequence[Run], target: float) -> str:
    """Every run: optimizer, lr, final validation loss, steps and seconds to ``target``; ``*`` marks
    each optimizer's best lr."""
    best = best_runs(runs)
    rows = [("optimizer", "lr", "best", "final val loss", f"steps to {target:g}", "seconds")]
    rows += [(r.optimizer, f"{r.lr:g}", "*" if best[r.optimizer] is r else "", _fmt_loss(r.final_val_loss),
              *_fmt_hit(r, target)) for r in runs]
    return _table(rows)


def seed_range(run: Run) -> str:
    """The lowest and highest of a run's seeds' final validation losses, or "-" for one seed."""
    return f"{min(run.finals):.4f}-{max(run.finals):.4f}" if len(run.finals) > 1 else "-"


def format_summary(runs: Sequence[Run], target: float) -> str:
    """One row per optimizer: the lrs tried and what its best lr reached (over seeds: their mean,
    and the range of the seeds' final losses)."""
    rows = [("optimizer", "lrs tried", "best lr", "final val loss", "seeds' range", f"steps to {target:g}",
             "seconds")]
    for name, run in best_runs(runs).items():
        tried = ",".join(f"{r.lr:g}" for r in runs if r.optimizer == name)
        rows.append((name, tried, f"{run.lr:g}", _fmt_loss(run.final_val_loss), seed_range(run),
                     *_fmt_hit(run, target)))
    return _table(rows)


def summary_sentence(runs: Sequence[Run], target: float) -> str:
    """Who reached ``target`` first, at its best lr, in steps; and whether it was also first in seconds."""
    best = best_runs(runs)
    first = winner(best, target)
    if first is None:
        lowest = best_run(list(best.values()))
        return (f"No optimizer reached validation loss {target:g} within {lowest.steps} steps; the lowest final "
                f"validation loss was {lowest.optimizer}'s {_fmt_loss(lowest.final_val_loss)} (lr {lowest.lr:g}).")
    hits = {name: time_to_target(run.curve, target) for name, run in best.items()}
    others = [f"{name} at {hit[0]} ({hit[1]:.0f} s)" if hit else f"{name} did not reach it"
              for name, hit in hits.items() if name != first]
    fastest = min((name for name, hit in hits.items() if hit), key=lambda name: hits[name][1])
    in_seconds = ("it was also first in seconds" if fastest == first
                  else f"in training seconds {fastest} was first ({hits[fastest][1]:.0f} s)")
    step, seconds = hits[first]
    tied = [name for name, hit in hits.items() if name != first and hit and hit[0] == step]
    lead = (f"{first} reached validation loss {target:g} first" if not tied else
            f"{first} and {', '.join(tied)} reached validation loss {target:g} at the same evaluation, {first} "
            "first in seconds")
    return (f"{lead}, at its best lr {best[first].lr:g}: step {step} ({seconds:.0f} s), vs "
            f"{', '.join(others) or 'no other optimizer'}" + ("." if tied else f"; {in_seconds}."))


def json_record(runs: Sequence[Run], target: float, settings: dict, corpus: Corpus | None) -> dict:
    """What ``--json`` writes: the settings, the corpus (text), every run (over several seeds: the
    mean over them, with ``seeds`` and each seed's ``seed_final_val_losses``) with its curve, and
    the winner."""
    best = best_runs(runs)

    def record(run: Run) -> dict:
        hit = time_to_target(run.curve, target)
        return {
            "optimizer": run.optimizer, "lr": run.lr, "steps": run.steps, "diverged": run.diverged,
            "best": best[run.optimizer] is run, "final_val_loss": run.final_val_loss,
            "steps_to_target": hit and hit[0], "seconds_to_target": hit and hit[1],
            "seeds": list(run.seeds), "seed_final_val_losses": list(run.finals),
            "optimizer_step_ms": run.optimizer_seconds / run.steps * 1e3, "state_bytes": run.state_bytes,
            "curve": [{"step": s, "seconds": t, "val_loss": v} for s, t, v in run.curve],
        }

    return {
        "settings": {**settings, "target_loss": target},
        "corpus": corpus and {"root": corpus.root, "python": sysconfig.get_python_version(),
                              "train_files": len(corpus.train_files), "val_files": len(corpus.val_files),
                              "train_bytes": len(corpus.train), "val_bytes": len(corpus.val)},
        "runs": [record(r) for r in runs],
        "winner": winner(best, target),
    }


def plot(runs: Sequence[Run], target: float, title: str, path: str) -> None:
    """Validation loss vs step (PNG): each optimizer's best lr bold, its other lrs faint, the target dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_runs(runs)
    colors = dict(zip(best, ("tab:gray", "tab:blue", "tab:red", "tab:green")))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        steps, losses = [p[0] for p in run.curve], [p[2] for p in run.curve]
        is_best = best[run.optimizer] is run
        ax.plot(steps, losses, color=colors.get(run.optimizer), alpha=1.0 if is_best else 0.3,
                linewidth=2 if is_best else 1, label=f"{run.optimizer} lr {run.lr:g}" if is_best else None)
    ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
    # from the first evaluation after step 0 on: the untrained loss would squash the curves flat
    trained = [p[2] for r in runs for p in r.curve[1:]] + [target]
    ax.set_ylim(min(trained) - 0.05, max(trained) + 0.1)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ---------------------------------------------------------------------------- the command


def lr_list(text: str) -> list[float]:
    """``type=`` of a comma-separated, non-empty list of learning rates > 0."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: no learning rates given")
    return [positive_float(item) for item in items]


lr_list.__name__ = "learning-rate list"


def directory(text: str) -> str:
    """``type=`` of a folder that exists."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"invalid path {text!r}: not an existing folder")
    return text


def _lrs_option(name: str) -> str:
    return f"--{name}-lrs"


def _lrs_attribute(name: str) -> str:
    """Where argparse keeps :func:`_lrs_option`'s value."""
    return f"{name.replace('-', '_')}_lrs"


def _defaults_help(values: dict[str, object]) -> str:
    return "; ".join(f"{workload}: {value}" for workload, value in values.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``dmuon quality``; the defaults take about 7 minutes on this project's 2-core CPU
    (``--workload vla --seeds 3``: about 12)."""
    parser.add_argument("--workload", choices=WORKLOADS, default="text",
                        help="text: a byte-level Llama on this Python's standard library; vla: the embodied model "
                             f"{VLA_PRESET} on synthetic episodes (default: %(default)s)")
    parser.add_argument("--optimizers", type=name_list(CONFIGS), default=list(DEFAULT_CONFIGS),
                        help="comma-separated optimizers to compare, in order: adamw (AdamW on everything), "
                             "torch-muon (torch.optim.Muon on the block matrices + AdamW on the rest), dmuon "
                             "(dmuon.Muon), dmuon-normuon (dmuon.Muon with update_rule='normuon'), dmuon-aol "
                             "(ns_coefficients='aol'), dmuon-bf16mom and dmuon-int8mom (momentum_dtype bfloat16, "
                             "int8: 8-bit blocks) "
                             "(default: %(default)s)")
    for name in CONFIGS:
        lrs = {w: ",".join(f"{lr:g}" for lr in DEFAULT_LRS[w][name]) for w in WORKLOADS}
        parser.add_argument(_lrs_option(name), type=lr_list, metavar="LRS",
                            help=f"comma-separated peak learning rates of {name} (default: {_defaults_help(lrs)})")
    parser.add_argument("--seeds", type=positive_int, default=1,
                        help="seeds per optimizer and lr, counting up from the seed below; the curves are averaged "
                             "and the best lr is the lowest mean (default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help=f"steps of every run (default: {_defaults_help(DEFAULT_STEPS)})")
    parser.add_argument("--eval-every", type=positive_int, default=20,
                        help="steps between validation evaluations (default: %(default)s)")
    parser.add_argument("--val-batches", type=positive_int, default=8,
                        help="batches of the fixed validation set (default: %(default)s)")
    parser.add_argument("--target-loss", type=positive_float, default=None,
                        help="validation loss whose steps and seconds to reach are reported (default: "
                             f"{_defaults_help(DEFAULT_TARGET_LOSS)})")
    parser.add_argument("--dim", type=positive_int, default=64,
                        help="text: model width, a multiple of 32 (default: %(default)s)")
    parser.add_argument("--layers", type=positive_int, default=4,
                        help="text: transformer blocks (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=16,
                        help="sequences (text) or episodes (vla) per step (default: %(default)s)")
    parser.add_argument("--seq-len", type=positive_int, default=64,
                        help="text: bytes per sequence (default: %(default)s)")
    parser.add_argument("--weight-decay", type=non_negative_float, default=0.1,
                        help="decoupled weight decay (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch intra-op threads; on a busy machine 2 threads on 2 cores ran 20x slower than 1 "
                             "(default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="(first) seed of the weights and the batches (default: %(default)s)")
    parser.add_argument("--corpus", metavar="DIR", type=directory,
                        help="text: train on the *.py files under DIR instead (default: this Python's standard "
                             "library)")
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="write the settings, every run's curve and the winner to PATH (default: none)")
    parser.add_argument("--plot", metavar="PATH", type=output_path,
                        help="write a PNG of the validation curves; needs matplotlib (default: none)")


def _fill_workload_defaults(args: argparse.Namespace) -> None:
    for name in CONFIGS:
        if getattr(args, _lrs_attribute(name)) is None:
            setattr(args, _lrs_attribute(name), list(DEFAULT_LRS[args.workload][name]))
    if args.steps is None:
        args.steps = DEFAULT_STEPS[args.workload]
    if args.target_loss is None:
        args.target_loss = DEFAULT_TARGET_LOSS[args.workload]


def check_arguments(args: argparse.Namespace) -> None:
    """What spans several arguments or needs the corpus, checked before any training starts.

    Fills the workload's defaults. Reads the corpus (a second or so) and keeps it in
    ``args.corpus_data`` so that it is read once (``None`` for the VLA).
    """
    _fill_workload_defaults(args)
    check_plot(args.plot)
    args.corpus_data = None
    if args.workload == "vla":
        if args.corpus:
            raise UsageError("--corpus", "the vla workload trains on synthetic episodes, not on a corpus")
        return
    if args.dim % HEAD_DIM:
        raise UsageError("--dim", f"invalid value {args.dim}: must be a multiple of {HEAD_DIM} (the head width)")
    def needed(dim: int, layers: int, batch_size: int) -> tuple[int, int]:
        return training_bytes(model_config(dim, layers, args.seq_len), batch_size, args.seq_len)

    check_fits(needed, {"--dim": (args.dim, 64), "--layers": (args.layers, 4), "--batch-size": (args.batch_size, 16)},
               available_memory())
    corpus = load_corpus(args.corpus)
    for side, text in (("training", corpus.train), ("validation", corpus.val)):
        if len(text) <= args.seq_len:
            where = args.corpus or corpus.root
            raise UsageError("--corpus" if args.corpus else "--seq-len",
                             f"the {side} text of {where} has {len(text)} bytes, not more than --seq-len "
                             f"{args.seq_len}")
    args.corpus_data = corpus


def _runs_line(args: argparse.Namespace, what: str) -> str:
    seeds = f", seeds {args.seed}..{args.seed + args.seeds - 1} (curves averaged)" if args.seeds > 1 else ""
    return (f"{args.steps} steps of {args.batch_size} {what}, weight decay {args.weight_decay}, {args.threads} "
            f"thread(s){seeds}")


def describe(args: argparse.Namespace, corpus: Corpus | None, model: LlamaConfig | VLAConfig) -> str:
    """The two header lines: what the data is, and what is trained on it."""
    if isinstance(model, VLAConfig):
        return (f"data: synthetic episodes of {VLA_PRESET} (image, prompt, noisy actions), validation on "
                f"{args.val_batches} batches of episodes no run trains on\n"
                f"model: {VLA_PRESET}, {param_count(model) / 1e6:.2f} M parameters (vision tower frozen); "
                f"{_runs_line(args, 'episodes')}; loss: prompt cross-entropy + action MSE")
    layers = f"{args.layers} layer{'s' if args.layers > 1 else ''}"
    return (f"corpus: {len(corpus.train_files) + len(corpus.val_files)} *.py files under {corpus.root} "
            f"(Python {sysconfig.get_python_version()}), {len(corpus.train) / 1e6:.2f} MB training, "
            f"{len(corpus.val) / 1e6:.2f} MB validation (every {VAL_EVERY}th file)\n"
            f"model: d={args.dim}, {layers}, {param_count(model) / 1e6:.2f} M parameters; "
            f"{_runs_line(args, f'x{args.seq_len} bytes')}; "
            f"untrained loss ~ log({VOCAB_SIZE}) = {math.log(VOCAB_SIZE):.2f} nats per byte")


def sweep(args: argparse.Namespace, task: Task) -> list[Run]:
    """Every optimizer of ``args.optimizers`` at every lr of its sweep and every seed, one after the
    other; one line per run on stderr (on a terminal, rewritten at each evaluation while it goes on)."""
    todo = [(name, lr, seed) for name in args.optimizers for lr in getattr(args, _lrs_attribute(name))
            for seed in range(args.seed, args.seed + args.seeds)]
    carriage_return = "\r" if sys.stderr.isatty() else ""
    runs = []
    for i, (name, lr, seed) in enumerate(todo, start=1):
        label = f"[{i}/{len(todo)}] {name} lr {lr:g}" + (f" seed {seed}" if args.seeds > 1 else "")

        def progress(step: int, loss: float) -> None:
            sys.stderr.write(f"\r{label}: step {step}/{args.steps}, val loss {loss:.4f}")
            sys.stderr.flush()

        result = train_run(name, CONFIGS[name], lr, task=task, steps=args.steps, eval_every=args.eval_every,
                           weight_decay=args.weight_decay, seed=seed, progress=progress if carriage_return else None)
        runs.append(result)
        print(f"{carriage_return}{label}: final val loss {_fmt_loss(result.final_val_loss)} "
              f"after {result.steps} steps ({result.curve[-1][1]:.0f} s training)", file=sys.stderr, flush=True)
    return runs


def run(args: argparse.Namespace) -> int:
    """Train every optimizer at every lr of its sweep, then print the tables and the summary."""
    torch.set_num_threads(args.threads)
    corpus: Corpus | None = args.corpus_data
    if args.workload == "vla":
        model: LlamaConfig | VLAConfig = get_config(VLA_PRESET)
        task = vla_task(model, args.batch_size, args.val_batches)
        title = f"{VLA_PRESET}, synthetic episodes"
    else:
        model = model_config(args.dim, args.layers, args.seq_len)
        task = text_task(corpus, model, args.batch_size, args.val_batches)
        title = f"Python {sysconfig.get_python_version()} stdlib bytes, d={args.dim}, {args.layers} layers"
    print(describe(args, corpus, model), flush=True)
    runs = mean_over_seeds(sweep(args, task))
    print(format_runs(runs, args.target_loss))
    print()
    print(format_summary(runs, args.target_loss))
    print()
    print(summary_sentence(runs, args.target_loss))
    if args.json:
        settings = {k: getattr(args, k) for k in ("workload", "steps", "eval_every", "val_batches", "dim", "layers",
                                                  "batch_size", "seq_len", "weight_decay", "threads", "seed",
                                                  "seeds")}
        with open(args.json, "w") as f:
            json.dump(json_record(runs, args.target_loss, settings, corpus), f, indent=1)
            f.write("\n")
    if args.plot:
        plot(runs, args.target_loss, f"dmuon quality: {title}, {args.steps} steps of {args.batch_size}", args.plot)
    return 0
