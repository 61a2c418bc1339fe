"""Where a dmuon optimizer step's time goes, phase by phase, on every rank.

    python benchmarks/step_phases.py [--parallel fsdp|ddp|ownerz2|ownerz3] [--preset bench]
        [--world-size 2] [--steps 8] [--comm-dtype exact|bf16] [--json PATH]

The model of ``dmuon bench`` (``--preset``) trains under the wrapper ``--parallel`` with
``dmuon.Muon``, one thread per gloo rank; only ``opt.step()`` is timed, after 2 warm-up steps.
Each phase is the host time of dmuon's own functions, wrapped in this script's processes (the
package is not changed): the agreement on the gradients, momentum, AdamW, Newton–Schulz (the
step's ``last_step_stats``), the Nesterov inputs, packing and starting each all-to-all, waiting
for one, applying the updates. None of them runs inside another; "other" is the rest of the step
(the owners' assembly of gathered rows, Python). Figures: mean ms per step and share of the step,
per rank; ``NS / step`` is the optimizer-step efficiency of ``dmuon bench`` with the in-step
Newton–Schulz time.

On a CPU with gloo the exchange's bytes are copied by gloo's threads, which share the cores with
Newton–Schulz: there, waits show how much of the communication did not overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# (module, attribute, phase): the functions timed; each returns to dmuon's code, none calls another
TIMED = [
    ("dmuon.step.stepper", "agree_on_step", "agree on the step"),
    ("dmuon.step.stepper", "update_momentum_of", "momentum"),
    ("dmuon.step.elementwise", "adamw_step", "AdamW"),
    ("dmuon.step.values", "StepValues.inputs", "Nesterov inputs"),
    ("dmuon.strategies.rows", "start_all_to_all", "pack + start all-to-all"),
    ("dmuon.exchange", "PendingExchange.wait", "wait for an all-to-all"),
    ("dmuon.step.values", "StepValues.apply", "apply updates"),
]
PHASES = [phase for _, _, phase in TIMED] + ["Newton-Schulz", "other"]
WARMUP = 2


def time_phases(seconds: dict[str, float], calls: dict[str, int]) -> None:
    """Wrap the functions of TIMED so that each call adds its host seconds to its phase."""
    import importlib

    for module_name, attribute, phase in TIMED:
        owner = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        original = getattr(owner, name)

        def timed(*args, _original=original, _phase=phase, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                seconds[_phase] += time.perf_counter() - start
                calls[_phase] += 1

        setattr(owner, name, timed)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import dmuon
    from dmuon.tools.bench import COMM_DTYPES, wrap_model
    from dmuon.tools.models import Llama, SyntheticTokens, get_config

    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    time_phases(seconds, calls)
    config = get_config(args.preset)
    model = Llama(config, seed=0)
    wrapped, _ = wrap_model(model, args.parallel, world, torch.device("cpu"))
    opt = dmuon.Muon(model, lr=1e-3, weight_decay=0.1, comm_dtype=COMM_DTYPES[args.comm_dtype],
                     early_start=False)  # every phase inside step()
    data = SyntheticTokens(config.vocab_size, seed=0)
    steps = []
    for step in range(WARMUP + args.steps):
        inputs, targets = data.local_batch(step, 2 * world, min(256, config.max_seq_len), rank, world)
        loss = torch.nn.functional.cross_entropy(wrapped(inputs).flatten(0, 1).float(), targets.flatten())
        opt.zero_grad()
        loss.backward()
        dist.barrier()  # every rank starts the step together: a wait is the exchange's, not the backward's
        if step == WARMUP:
            seconds.clear()
            calls.clear()
        start = time.perf_counter()
        opt.step()
        if step >= WARMUP:
            steps.append(time.perf_counter() - start)
            seconds["Newton-Schulz"] += opt.last_step_stats.ns_seconds
    step_s = sum(steps) / len(steps)
    figures = {phase: seconds[phase] / len(steps) for phase in PHASES[:-1]}
    figures["other"] = step_s - sum(figures.values())
    queue.put((rank, {"step_s": step_s, "phases_s": figures, "calls": dict(calls)}))
    dist.barrier()
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> list[dict]:
    """Each rank's mean step seconds, phase seconds and calls per phase (over all steps)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, args, queue)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
        if p.exitcode:
            raise RuntimeError(f"a rank exited with code {p.exitcode}")
    return [results[r] for r in range(args.world_size)]


def table(ranks: list[dict]) -> str:
    lines = [f"{'phase':<26}" + "".join(f"{f'rank {r} ms':>12}{'share':>7}" for r in range(len(ranks)))]
    for phase in PHASES:
        lines.append(f"{phase:<26}" + "".join(
            f"{1e3 * r['phases_s'][phase]:12.1f}{r['phases_s'][phase] / r['step_s']:7.2f}" for r in ranks))
    lines.append(f"{'optimizer step':<26}" + "".join(f"{1e3 * r['step_s']:12.1f}{1:7.2f}" for r in ranks))
    busiest = max(r["phases_s"]["Newton-Schulz"] for r in ranks)
    slowest = max(r["step_s"] for r in ranks)
    lines.append(f"NS / step (busiest rank's NS over the slowest step): {busiest / slowest:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallel", choices=["ddp", "fsdp", "ownerz2", "ownerz3"], default="fsdp")
    parser.add_argument("--preset", default="bench", help="dmuon bench's model preset (default: %(default)s)")
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=8, help="measured steps (default: %(default)s)")
    parser.add_argument("--comm-dtype", choices=["exact", "bf16"], default="exact")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    if args.steps < 1 or args.world_size < 1:
        parser.error(f"Invalid --steps={args.steps} or --world-size={args.world_size}. Must be >= 1.")
    ranks = measure(args)
    print(f"{args.parallel}, {args.preset} preset, {args.world_size} gloo ranks x 1 thread, "
          f"comm dtype {args.comm_dtype}, mean of {args.steps} steps")
    print(table(ranks))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "ranks": ranks}, fh, indent=1)


if __name__ == "__main__":
    main()
