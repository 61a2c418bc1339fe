"""``dmuon demo``: AdamW vs torch.optim.Muon vs dmuon.Muon, side by side on one CPU.

Every configuration trains the same model (same preset, same seed, hence the
same initial weights) on the same synthetic batches, each at the learning rate
the migration guide recommends for it: AdamW at ``--lr``, the two Muons at
``--muon-lr-multiple`` times it (the lr rule of docs/migration.md: 2x to start,
then a sweep of 1x-8x). Only ``optimizer.step()`` is in the "opt step"
column; the "step" column is forward + backward + step (the data is generated
outside the timed region). The last line is the verdict: dmuon's loss against
the others' (lower is better), and what its step costs beside theirs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, TextIO

import torch
from torch import nn

import dmuon
from dmuon.routing import default_route, module_roles
from dmuon.tensors import local
from dmuon.tools.cli import (
    check_fits,
    check_seq_len,
    name_list,
    non_negative_float,
    output_path,
    positive_float,
    positive_int,
)
from dmuon.tools.corpus import VOCAB_SIZE, load_corpus, train_batch
from dmuon.tools.hardware import OtherJobsCpu, available_memory, machine_cores
from dmuon.tools.models import PRESETS, Llama, SyntheticTokens, get_config, training_bytes

OptimizerFactory = Callable[[Llama, float, float], list[torch.optim.Optimizer]]
"""Builds the optimizer(s) of one configuration from ``(model, lr, weight_decay)``."""


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The trained 2-D parameters that ``dmuon.Muon(model)`` routes to Muon: what Muon is meant
    for (the transformer blocks' Linear weights, a VLA's projector), so that vanilla Muon and dmuon
    orthogonalize the same matrices.

    Embedding, ``lm_head`` and norm weights are not hidden matrices (their
    rows are looked up or scored independently), so they stay with AdamW.
    """
    roles = module_roles(model)
    return [p for name, p in model.named_parameters() if p.requires_grad and p.ndim == 2
            and default_route(p, name, roles.get(id(p))).algorithm == "muon"]


def adamw(model: Llama, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """Baseline (a): AdamW on every parameter."""
    return [torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)]


def torch_muon(model: Llama, lr: float, weight_decay: float) -> list[torch.optim.Optimizer]:
    """Configuration (b): ``torch.optim.Muon`` on hidden matrices plus AdamW on the rest.

    ``match_rms_adamw`` scales Muon's update to AdamW's typical RMS, which is
    what lets both optimizers share one ``lr`` and ``weight_decay``.
    """
    matrices = hidden_matrices(model)
    matrix_ids = {id(p) for p in matrices}
    others = [p for p in model.parameters() if id(p) not in matrix_ids]
    return [
        torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay),
    ]


def dmuon_muon(model: Llama, lr: float, weight_decay: float, **options: Any) -> list[torch.optim.Optimizer]:
    """Configuration (c): one ``dmuon.Muon`` that routes the parameters itself (``options``: more
    of its keyword arguments)."""
    return [dmuon.Muon(model, lr=lr, weight_decay=weight_decay, **options)]


CONFIGS: dict[str, OptimizerFactory] = {
    "adamw": adamw,
    "torch-muon": torch_muon,
    "dmuon": dmuon_muon,
    "dmuon-normuon": partial(dmuon_muon, update_rule="normuon"),
    "dmuon-aol": partial(dmuon_muon, ns_coefficients="aol"),
    "dmuon-bf16mom": partial(dmuon_muon, momentum_dtype=torch.bfloat16),
    "dmuon-int8mom": partial(dmuon_muon, momentum_dtype=torch.int8),
}
DEFAULT_CONFIGS = ("adamw", "torch-muon", "dmuon")  # what runs unless --optimizers names others


# the state keys of Muon's matrices (momentum, 8-bit momentum's scales, NorMuon's row state)
MUON_STATE_KEYS = ("momentum_buffer", "momentum_scale", "row_second_moment")


def state_bytes(optimizers: Sequence[torch.optim.Optimizer]) -> tuple[int, int]:
    """The bytes of this rank's part of the optimizers' state tensors: all of them, and the part
    kept for Muon's matrices (:data:`MUON_STATE_KEYS`)."""
    sizes = [(key, local(t).numel() * t.element_size()) for opt in optimizers for entry in opt.state.values()
             for key, t in entry.items() if isinstance(t, torch.Tensor)]
    return sum(size for _, size in sizes), sum(size for key, size in sizes if key in MUON_STATE_KEYS)


# the configurations that train with Muon, at --muon-lr-multiple times --lr
MUON_CONFIGS = ("torch-muon", "dmuon", "dmuon-normuon", "dmuon-aol", "dmuon-bf16mom", "dmuon-int8mom")
DEFAULT_MUON_LR_MULTIPLE = 2.0  # docs/migration.md's lr rule: start at 2x AdamW's, then sweep 1-8x


@dataclass(frozen=True)
class RunResult:
    """Outcome of one configuration; also the ``--json`` record."""

    config: str
    steps: int
    final_loss: float  # mean training loss over the last few steps
    opt_step_ms: float  # median time of optimizer.step() alone
    step_ms: float  # median time of forward + backward + optimizer.step()
    lr: float = math.nan  # the learning rate it trained at


def train(
    config: str,
    make_optimizer: OptimizerFactory,
    *,
    preset: str,
    steps: int,
    lr: float,
    weight_decay: float,
    batch_size: int,
    seq_len: int,
    seed: int,
    text: torch.Tensor | None = None,
    loss_window: int = 10,
    progress: TextIO | None = None,
) -> RunResult:
    """Train ``Llama(preset, seed)`` with one optimizer configuration on ``text`` (bytes, as
    :mod:`dmuon.tools.corpus` gives them; the model then has a byte vocabulary) or, without it,
    on ``SyntheticTokens(seed)``.

    ``config`` only labels the result. ``final_loss`` averages the last
    ``loss_window`` steps because a single step's loss is noisy.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    model_config = get_config(preset, **({"vocab_size": VOCAB_SIZE} if text is not None else {}))
    model = Llama(model_config, seed=seed)
    optimizers = make_optimizer(model, lr, weight_decay)
    if text is None:
        synthetic = SyntheticTokens(model_config.vocab_size, seed=seed)
    losses: list[float] = []
    opt_times: list[float] = []
    step_times: list[float] = []
    began = time.perf_counter()
    for step in range(steps):
        inputs, targets = train_batch(text, step, batch_size, seq_len, seed) if text is not None else \
            synthetic.batch(step, batch_size, seq_len)
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = model.loss(inputs, targets)
        loss.backward()
        opt_start = time.perf_counter()
        for optimizer in optimizers:
            optimizer.step()
        end = time.perf_counter()
        losses.append(loss.item())
        opt_times.append(end - opt_start)
        step_times.append(end - start)
        if progress is not None:
            report_progress(progress, config, step + 1, steps, losses[-1], end - began)
    return RunResult(
        config=config,
        steps=steps,
        final_loss=statistics.fmean(losses[-loss_window:]),
        opt_step_ms=1e3 * statistics.median(opt_times),
        step_ms=1e3 * statistics.median(step_times),
        lr=lr,
    )


PROGRESS_LINES = 10  # without a terminal: a line at every tenth of a configuration's steps


def report_progress(stream: TextIO, config: str, step: int, steps: int, loss: float, seconds: float) -> None:
    """A configuration's progress with the time it has taken and an estimate of what is left:
    rewritten in place on a terminal; elsewhere (a log, a pipe) one line every tenth of its steps."""
    left = seconds / step * (steps - step)
    line = f"{config}: step {step}/{steps}  loss {loss:.3f}  {seconds:.0f} s" + (
        f", about {left:.0f} s left" if step < steps else "")
    if stream.isatty():
        stream.write(f"\r{line}\x1b[K" + ("\n" if step == steps else ""))
        stream.flush()
    elif step == steps or step % max(1, steps // PROGRESS_LINES) == 0:
        stream.write(line + "\n")
        stream.flush()


def default_threads(cores: int, other_jobs: float) -> tuple[int, str]:
    """Intra-op threads for the cores other jobs leave free (at least one), and why: two threads
    on two cores that another job also uses run slower than one."""
    free = max(1, min(cores, int(cores - other_jobs + 0.5)))
    threads = f"{free} thread{'s' if free > 1 else ''}"
    if free == cores:
        return cores, f"{threads}, one per core"
    return free, f"{threads}: other jobs use {other_jobs:.1f} of {cores} cores"


def format_table(results: Sequence[RunResult], baseline: str = "adamw") -> str:
    """Plain-text table of ``results``; time ratios are relative to ``baseline`` (or the first result)."""
    if not results:
        return ""
    base = next((r for r in results if r.config == baseline), results[0])
    header = ("config", "lr", "steps", "final loss", "opt step ms", f"x {base.config}", "step ms", f"x {base.config}")
    rows = [header] + [
        (
            r.config,
            f"{r.lr:g}",
            str(r.steps),
            f"{r.final_loss:.4f}",
            f"{r.opt_step_ms:.2f}",
            f"{r.opt_step_ms / base.opt_step_ms:.2f}",
            f"{r.step_ms:.2f}",
            f"{r.step_ms / base.step_ms:.2f}",
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def verdict(results: Sequence[RunResult], subject: str = "dmuon") -> str:
    """The line a reader acts on: ``subject``'s final loss against every other configuration's
    (lower is better), each with the ratio of their whole steps' times."""
    mine = next((r for r in results if r.config == subject), None)
    if mine is None or len(results) < 2:
        return ""
    against = []
    for other in results:
        if other is not mine:
            gap = mine.final_loss - other.final_loss
            against.append(f"{abs(gap):.4f} {'below' if gap < 0 else 'above'} {other.config}'s (lr {other.lr:g}) "
                           f"with a step {mine.step_ms / other.step_ms:.2f}x its")
    return (f"verdict: {subject} (lr {mine.lr:g}) ended at loss {mine.final_loss:.4f} after {mine.steps} steps: "
            + "; ".join(against) + ".")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``dmuon demo``; the defaults take about a minute on two free cores with native
    bf16 products, about 5 minutes where bf16 is emulated (torch.optim.Muon's bf16 Newton–Schulz)."""
    parser.add_argument("--steps", type=positive_int, default=200,
                        help="steps per configuration (default: %(default)s)")
    parser.add_argument("--preset", choices=list(PRESETS), default="demo", help="model preset (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="AdamW's learning rate (default: %(default)s)")
    parser.add_argument("--muon-lr-multiple", type=positive_float, default=DEFAULT_MUON_LR_MULTIPLE,
                        help="the Muons' learning rate, as a multiple of --lr: the lr rule's start (docs/migration.md; "
                             "the best measured lay at 1x to 8x) (default: %(default)s)")
    parser.add_argument("--weight-decay", type=non_negative_float, default=0.1,
                        help="decoupled weight decay (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="sequences per step (default: %(default)s)")
    parser.add_argument("--seq-len", type=positive_int, default=64,
                        help="tokens per sequence, at most the preset's max_seq_len (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch intra-op threads (default: one per core that other jobs leave free, "
                             "measured for half a second)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
    parser.add_argument("--data", choices=("text", "synthetic"), default="text",
                        help="text: the bytes of this Python's standard library source (nothing downloaded); "
                             "synthetic: a seeded Markov chain of tokens (default: %(default)s)")
    parser.add_argument(
        "--configs",
        type=name_list(CONFIGS),
        default=list(DEFAULT_CONFIGS),
        help="comma-separated configurations to run, in order: adamw (AdamW on everything), torch-muon "
        "(torch.optim.Muon on the block matrices + AdamW on the rest), dmuon (dmuon.Muon), dmuon-normuon "
        "(dmuon.Muon with update_rule='normuon') (default: %(default)s)",
    )
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="also write one JSON record per configuration to PATH (default: none)")


def check_arguments(args: argparse.Namespace) -> None:
    """What spans several arguments, checked before any training starts."""
    check_seq_len(args.seq_len, args.preset, PRESETS[args.preset].max_seq_len)

    def needed(preset: str, batch_size: int) -> tuple[int, int]:  # the vocabulary run() trains: bytes on text
        return training_bytes(get_config(preset, **({"vocab_size": VOCAB_SIZE} if args.data == "text" else {})),
                              batch_size, args.seq_len)

    check_fits(needed, {"--preset": (args.preset, "demo"), "--batch-size": (args.batch_size, 16)}, available_memory())


def run(args: argparse.Namespace) -> int:
    """Run the configurations in ``args.configs`` and print the comparison table."""
    threads, why = args.threads, f"{args.threads} threads (--threads)"
    if threads is None:
        with OtherJobsCpu() as others:
            time.sleep(0.5)
        threads, why = default_threads(machine_cores(), others.cores_used)
    torch.set_num_threads(threads)
    text = load_corpus().train if args.data == "text" else None
    vocab_size = VOCAB_SIZE if text is not None else get_config(args.preset).vocab_size
    muon_lr = args.lr * args.muon_lr_multiple
    data = "the standard library's source, byte by byte" if text is not None else "a synthetic Markov chain"
    print(
        f"preset {args.preset} on {data}, {args.steps} steps of {args.batch_size}x{args.seq_len} tokens, lr "
        f"{args.lr:g} (AdamW) and {muon_lr:g} (the Muons), weight decay {args.weight_decay}; {why}; "
        f"untrained loss ~ log({vocab_size}) = {math.log(vocab_size):.2f}",
        flush=True,
    )
    results = [
        train(
            name,
            CONFIGS[name],
            preset=args.preset,
            steps=args.steps,
            lr=muon_lr if name in MUON_CONFIGS else args.lr,
            weight_decay=args.weight_decay,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            seed=args.seed,
            text=text,
            progress=sys.stderr,
        )
        for name in args.configs
    ]
    print(format_table(results))
    print(verdict(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
            f.write("\n")
    return 0
