"""``dmuon bench``: data-parallel training side by side — AdamW, vanilla Muon and dmuon.Muon
under DDP and FSDP2 — on ranks this command spawns itself (no torchrun).

Every configuration trains the same model from the same weights on the same batches:

    ddp-adamw        DDP + torch.optim.AdamW
    ddp-torch-muon   DDP + torch.optim.Muon on every rank (each rank orthogonalizes everything)
    fsdp-adamw       FSDP2 + torch.optim.AdamW
    fsdp-torch-muon  FSDP2 + torch.optim.Muon (Newton–Schulz on sharded DTensors)
    ddp-dmuon        DDP + dmuon.Muon
    fsdp-dmuon       FSDP2 + dmuon.Muon
    ownerz2-dmuon    dmuon.shard_by_owner (Muon matrices whole on their owners, kept from forward
                     to backward) + FSDP2 for the rest + dmuon.Muon
    ownerz3-dmuon    the same, re-broadcasting the matrices in backward (less memory)

With ``--peers``, every other distributed Muon implementation that is installed (``pip install
'dmuon[peers]'``; see :mod:`dmuon.tools.peers`) joins as ``<ddp|fsdp>-<package>`` for the modes it
supports; the ones that are not installed are listed with the reason.

Each configuration runs in freshly spawned ranks, so that its peak memory is its own: "peak
mem" is the largest rise of a rank's resident memory (CPU; sampled every 2 ms) or of its
allocated device memory (CUDA) over what the rank held before building the model. Times are
medians over the measured steps of the slowest rank; "bytes/step" is what dmuon's own collectives
sent, averaged over ranks: dmuon.Muon's exchange, and for the owner modes the broadcasts and
reduces of the owner-sharded matrices (DDP's and FSDP2's traffic is not counted). The owner modes
are compared with the FSDP2 configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from dmuon.owner import OwnerSharding, shard_by_owner
from dmuon.tools.cli import (
    UsageError, name_list, non_negative_float, non_negative_int, output_path, positive_float, positive_int,
)
from dmuon.tools.demo import CONFIGS as OPTIMIZERS
from dmuon.tools.demo import report_progress
from dmuon.tools.models import PRESETS, Llama, SyntheticTokens, get_config

CONFIGS = ("ddp-adamw", "ddp-torch-muon", "fsdp-adamw", "fsdp-torch-muon", "ddp-dmuon", "fsdp-dmuon",
           "ownerz2-dmuon", "ownerz3-dmuon")
# What each data-parallel mode is compared with (AdamW and vanilla Muon of that mode).
BASELINE_MODE = {"ddp": "ddp", "fsdp": "fsdp", "ownerz2": "fsdp", "ownerz3": "fsdp"}


@dataclass(frozen=True)
class BenchResult:
    """One configuration's numbers; also the ``--json`` record."""

    config: str
    world_size: int
    opt_step_ms: float
    step_ms: float
    bytes_per_step: float | None  # mean over ranks of what dmuon.Muon's collectives sent
    peak_mem_bytes: int  # largest per-rank rise over the memory held before the model existed
    final_loss: float


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


def _wrap(model: Llama, parallel: str, world: int, device: torch.device) -> tuple[nn.Module, OwnerSharding | None]:
    """The model under ``parallel``, and its owner sharding if it has one."""
    if parallel == "ddp":
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None), None
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


def _train(name: str, args: argparse.Namespace, rank: int, world: int, device: torch.device) -> BenchResult:
    parallel, optimizer = name.split("-", 1)
    config = get_config(args.preset, **({"n_layers": args.layers} if args.layers else {}))
    memory = PeakMemory(device)
    model = Llama(config, seed=args.seed).to(device)
    wrapped, sharding = _wrap(model, parallel, world, device)
    optimizers = _factory(optimizer)(model, args.lr, args.weight_decay)
    data = SyntheticTokens(config.vocab_size, seed=args.seed)
    opt_times, step_times, losses, sent = [], [], [], []
    for step in range(args.warmup + args.steps):
        inputs, targets = (t.to(device) for t in data.local_batch(step, args.batch_size * world, args.seq_len, rank, world))
        _sync(device)
        start = time.perf_counter()
        logits = wrapped(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        _sync(device)
        opt_start = time.perf_counter()
        for opt in optimizers:
            opt.step()
        _sync(device)
        end = time.perf_counter()
        losses.append(loss.item())
        if step >= args.warmup:
            opt_times.append(end - opt_start)
            step_times.append(end - start)
            stats = getattr(optimizers[0], "last_step_stats", None)
            sent.append(None if stats is None else stats.bytes_sent + (sharding.last_step_bytes if sharding else 0))
        if rank == 0:
            report_progress(sys.stderr, name, step + 1, args.warmup + args.steps, losses[-1])
    peak = memory.stop()
    slowest = torch.tensor([statistics.median(opt_times), statistics.median(step_times), peak],
                           dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    averaged = torch.tensor([statistics.mean(losses[-3:]), sent[-1] or 0], dtype=torch.float64, device=device)
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    return BenchResult(
        name, world, slowest[0].item() * 1e3, slowest[1].item() * 1e3,
        averaged[1].item() if sent[-1] is not None else None, int(slowest[2].item()), averaged[0].item(),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _worker(rank: int, world: int, port: int, name: str, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    result = _train(name, args, rank, world, device)
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


def run_config(name: str, args: argparse.Namespace) -> BenchResult:
    """Spawn ``args.world_size`` fresh ranks, train configuration ``name`` there, return its result."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_worker, args=(args.world_size, _free_port(), name, args, queue),
                       nprocs=args.world_size, join=True, start_method="spawn")
    return queue.get()


def format_table(results: list[BenchResult]) -> str:
    """One row per configuration, with ratios against AdamW and vanilla Muon of the same parallelism."""
    by_name = {r.config: r for r in results}
    header = (f"{'config':<20} {'opt step ms':>11} {'step ms':>9} {'bytes/step':>12} {'peak mem MB':>11} "
              f"{'loss':>7} {'opt/vanilla':>11} {'step/adamw':>10} {'mem/adamw':>9}")
    lines = [header]
    for r in results:
        parallel = BASELINE_MODE.get(r.config.split("-", 1)[0], r.config.split("-", 1)[0])
        vanilla, adamw = by_name.get(f"{parallel}-torch-muon"), by_name.get(f"{parallel}-adamw")
        opt_ratio = f"{r.opt_step_ms / vanilla.opt_step_ms:.2f}" if vanilla else "-"
        step_ratio = f"{r.step_ms / adamw.step_ms:.2f}" if adamw else "-"
        mem_ratio = f"{r.peak_mem_bytes / adamw.peak_mem_bytes:.2f}" if adamw and adamw.peak_mem_bytes else "-"
        sent = f"{r.bytes_per_step:,.0f}" if r.bytes_per_step is not None else "-"
        lines.append(f"{r.config:<20} {r.opt_step_ms:>11.1f} {r.step_ms:>9.1f} {sent:>12} "
                     f"{r.peak_mem_bytes / 2**20:>11.1f} {r.final_loss:>7.3f} {opt_ratio:>11} "
                     f"{step_ratio:>10} {mem_ratio:>9}")
    for parallel in ("ddp", "fsdp"):
        names = [f"{parallel}-adamw", f"{parallel}-torch-muon", f"{parallel}-dmuon"]
        if all(n in by_name for n in names):
            base, vanilla, ours = (by_name[n].step_ms for n in names)
            if vanilla > base:
                lines.append(f"{parallel}: dmuon's step-time overhead over AdamW is "
                             f"{(ours - base) / (vanilla - base):.2f} of vanilla Muon's")
    return "\n".join(lines)


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
    parser.add_argument("--preset", choices=sorted(PRESETS), default="bench",
                        help="model preset (default: %(default)s)")
    parser.add_argument("--layers", type=positive_int,
                        help="override the preset's depth: real shapes, fewer layers (default: the preset's)")
    parser.add_argument("--steps", type=positive_int, default=4,
                        help="measured steps per configuration (default: %(default)s)")
    parser.add_argument("--warmup", type=non_negative_int, default=1,
                        help="unmeasured steps before them (default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=4, help="sequences per rank (default: %(default)s)")
    parser.add_argument("--seq-len", type=positive_int, default=128,
                        help="tokens per sequence, at most the preset's max_seq_len (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=3e-3, help="learning rate (default: %(default)s)")
    parser.add_argument("--weight-decay", type=non_negative_float, default=0.1,
                        help="decoupled weight decay (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the data (default: %(default)s)")
    parser.add_argument("--configs", type=name_list(CONFIGS), default=list(CONFIGS),
                        help=f"comma-separated subset of {','.join(CONFIGS)} (default: all)")
    parser.add_argument("--peers", action="store_true",
                        help="add every installed peer implementation (pip install 'dmuon[peers]') (default: off)")
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help="write one record per configuration (default: none)")
    parser.add_argument("--plot", metavar="PATH", type=output_path,
                        help="write a PNG of the results; needs matplotlib (default: none)")


def check_arguments(args: argparse.Namespace) -> None:
    """What spans several arguments or needs a look at the machine, checked before any rank starts."""
    max_seq_len = PRESETS[args.preset].max_seq_len
    if args.seq_len > max_seq_len:
        raise UsageError("--seq-len", f"invalid value {args.seq_len}: above the {args.preset} preset's "
                                      f"max_seq_len {max_seq_len}")
    if args.device == "cuda":
        visible = torch.cuda.device_count()
        if not visible:
            raise UsageError("--device", "invalid value 'cuda': no GPU is visible")
        if args.world_size > visible:
            raise UsageError("--world-size", f"invalid value {args.world_size}: --device cuda runs one rank per "
                                             f"GPU, and {visible} are visible")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot", "needs matplotlib: pip install 'dmuon[bench]'") from None


def run(args: argparse.Namespace) -> int:
    if args.peers:
        peers, missing = peer_configs()
        args.configs = [*args.configs, *peers]
        for package, reason in missing.items():
            print(f"peer {package} skipped: {reason}", file=sys.stderr)
    print(f"dmuon bench: {args.preset} preset, {args.world_size} {args.device} ranks x {args.threads} thread(s), "
          f"{len(args.configs)} configurations", file=sys.stderr, flush=True)
    results = []
    for i, name in enumerate(args.configs, start=1):
        print(f"[{i}/{len(args.configs)}] {name}", file=sys.stderr, flush=True)
        results.append(run_config(name, args))
    print(format_table(results))
    if args.device == "cuda":
        from dmuon.tools.throughput import gpu_report

        print(gpu_report(torch.device("cuda", 0)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0
