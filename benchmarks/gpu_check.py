"""The GPU checks, one section at a time (``benchmarks/gpu_check.sh`` runs them all in one call).

    python benchmarks/gpu_check.py SECTION --out DIR      # one section: DIR/SECTION.json
    python benchmarks/gpu_check.py --dry-run              # the sections, their time limits, the files
    python benchmarks/gpu_check.py SECTION --out DIR --smoke   # the same code on CPU, tiny sizes

A GPU run here is short and rare: every section has a time limit (the shell script kills it
there), the crash-prone ones come first, and each writes one JSON file, so that a failing
section costs only itself. ``--smoke`` runs every section on the CPU at toy sizes (what CI does:
a section that cannot run there says so), so that a Python error shows before the GPU run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
SETUP_SECONDS = 30  # installing dmuon into the device's torch, versions, nvidia-smi
GRACE_SECONDS = 5  # after a section's limit, before it is killed (gpu_rerun.sh's timeout --kill-after)
BUDGET_SECONDS = 480  # the whole call, on one H100
MAX_FILES = 8  # what comes back from the output folder: the log and one JSON per section


@dataclass(frozen=True)
class Sizes:
    """Problem sizes: a GPU's, or toy ones for the CPU smoke run."""

    width: int  # of the small models
    side: int  # of the Triton and CUDA-graph checks' matrices
    layers: int  # of Llama-3.1-8B's, for the optimizer step
    batch: int  # stacked matrices per Newton–Schulz call
    steps: int  # timed steps
    bench: list[str]  # dmuon bench's arguments


GPU = Sizes(width=1024, side=1024, layers=2, batch=4, steps=10,
            bench=["--device", "cuda", "--world-size", "1", "--preset", "bench", "--batch-size", "16",
                   "--seq-len", "512", "--steps", "4", "--warmup", "2"])
SMOKE = Sizes(width=32, side=48, layers=1, batch=2, steps=2,
              bench=["--device", "cpu", "--world-size", "1", "--preset", "tiny", "--steps", "1", "--warmup", "0",
                     "--memory-steps", "0", "--configs", "ddp-adamw,ddp-dmuon"])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def small_model(width: int, device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(3)]).to(device=device, dtype=dtype)


def train_small(device: torch.device, sizes: Sizes, steps: int = 3, dtype: torch.dtype = torch.float32,
                **options) -> tuple[nn.Module, object]:
    import dmuon

    model = small_model(sizes.width, device, dtype)
    opt = dmuon.Muon(model, lr=0.02, **options)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, sizes.width, generator=generator).to(device=device, dtype=dtype)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


# ------------------------------------------------------------------------------ the sections


def crash(device: torch.device, sizes: Sizes) -> dict:
    """The GPU code that can crash or silently differ: the step's Newton–Schulz time read right
    after ``step()``, the Triton kernel against fp64 products per dtype, CUDA graphs against eager
    (bitwise), and the host synchronizations of one step."""
    from dmuon.triton_kernels import symmetric_gram, triton_usable

    result: dict = {}
    _, opt = train_small(device, sizes)
    result["ns_seconds_right_after_step"] = opt.last_step_stats.ns_seconds
    if triton_usable(device):
        for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            if dtype == torch.bfloat16 and device.type == "cpu":
                continue  # Triton's interpreter has no bf16 tl.dot (it multiplies the bit patterns)
            X = torch.randn(2, sizes.side, 2 * sizes.side, device=device).to(dtype)
            exact = torch.bmm(X.double(), X.double().mT)
            result[f"triton_gram_{dtype}_rel_error"] = relative(symmetric_gram(X), exact)
            result[f"torch_bmm_{dtype}_rel_error"] = relative(torch.bmm(X, X.mT), exact)
    else:
        result["triton"] = "not usable here"
    if device.type != "cuda":
        result["cuda_graphs"] = result["host_syncs"] = "CUDA only"
        return result
    from dmuon.cuda_graphs import GraphedOrthogonalize
    from dmuon.orthogonalization import orthogonalize, resolve_config

    graphed = GraphedOrthogonalize(orthogonalize)
    G = torch.randn(sizes.batch, sizes.side, sizes.side, device=device)
    config = resolve_config(G.shape[-2:], "cuda")
    result["cuda_graph_ns_bitwise"] = torch.equal(graphed(G, config), orthogonalize(G, config))
    plain, _ = train_small(device, sizes)
    captured, _ = train_small(device, sizes, cuda_graphs=True)
    result["cuda_graph_steps_bitwise"] = all(torch.equal(a, b) for a, b in zip(plain.parameters(),
                                                                             captured.parameters()))
    for early in (False, True):
        model, opt = train_small(device, sizes, early_start=early)
        model(torch.randn(8, sizes.width, device=device)).square().mean().backward()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        torch.cuda.set_sync_debug_mode("default")
        result[f"host_syncs_early_start_{early}"] = [str(w.message).splitlines()[0] for w in caught]
    return result


def flex_max_scores(device: torch.device) -> dict:
    """FlexAttention's max scores (per query; CUDA only in torch) reduced to each head's largest
    logit, against ``dmuon.max_logits``'s: what QK-clip can record from the attention itself,
    without a second q·kᵀ (``clip.record(name, aux.max_scores.amax(dim=(0, 2)), query=q)``)."""
    if device.type != "cuda":
        return {"flex_max_scores": "not run: torch's FlexAttention returns max scores on CUDA only"}
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    import dmuon

    try:
        q, k, v = (torch.randn(2, 8, 256, 64, device=device) for _ in range(3))
        causal = create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256, device=device)
        _, aux = flex_attention(q, k, v, block_mask=causal, return_aux=AuxRequest(max_scores=True))
        from_flex = aux.max_scores.amax(dim=(0, 2)).float()
        return {"flex_max_scores_rel_error": relative(from_flex.cpu(), dmuon.max_logits(q, k).cpu())}
    except Exception as err:  # noqa: BLE001 - a check that cannot run says why, and the section goes on
        return {"flex_max_scores": f"failed: {type(err).__name__}: {err}"[:500]}


def reference(device: torch.device, sizes: Sizes) -> dict:
    """Three whole steps on the device against the same steps on the CPU in fp64 (Newton–Schulz
    in fp64 there): fp32 Newton–Schulz without TF32, and the device's default recipe; then
    FlexAttention's max scores against dmuon's max logits (:func:`flex_max_scores`)."""
    cpu, _ = train_small(torch.device("cpu"), sizes, dtype=torch.float64, ns_dtype=torch.float64,
                         ns_method="standard")
    result = {}
    for label, options in (("fp32_standard", dict(ns_dtype=torch.float32, ns_method="standard")),
                           ("default_recipe", {})):
        model, _ = train_small(device, sizes, **options)
        result[f"{label}_max_rel_error"] = max(relative(p.cpu(), q) for p, q in zip(model.parameters(),
                                                                                     cpu.parameters()))
    return {**result, **flex_max_scores(device)}


def newton_schulz(device: torch.device, sizes: Sizes) -> dict:
    """Newton–Schulz TFLOP/s, standard and Gram in fp16, standard in bf16 (dmuon refuses Gram NS
    in bf16), on Llama-3.1-8B's matrix shapes, against the measured matrix-product peak of each dtype."""
    from dmuon.tools.models import get_config, matrix_shapes
    from dmuon.tools.throughput import matmul_peak, ns_throughput

    shapes = sorted({(m, n) for _, m, n in matrix_shapes(get_config("llama-3.1-8b", n_layers=1))})
    if device.type == "cpu":
        shapes = [(sizes.side, 2 * sizes.side)]
    rows = []
    for dtype, methods in ((torch.float16, ("standard", "gram")), (torch.bfloat16, ("standard",))):
        peak = matmul_peak(device, dtype, size=4096 if device.type == "cuda" else 256)
        for row in ns_throughput(device, shapes, sizes.batch, methods, dtype=dtype, peak=peak):
            rows.append({**row.__dict__, "peak_tflops": peak / 1e12})
    return {"rows": rows}


def optimizer_step(device: torch.device, sizes: Sizes) -> dict:
    """One optimizer step on Llama-3.1-8B's block matrices (``sizes.layers`` layers), gradients
    given: dmuon.Muon, torch.optim.Muon (bf16 Newton–Schulz), and fused AdamW on the same weights."""
    import dmuon
    from dmuon.timing import best_seconds
    from dmuon.tools.models import get_config, matrix_shapes

    config = get_config("llama-3.1-8b", n_layers=sizes.layers)
    shapes = matrix_shapes(config) if device.type == "cuda" else [("w", sizes.side, 2 * sizes.side)] * 4
    generator = torch.Generator(device=device).manual_seed(0)
    params = [nn.Parameter(torch.randn(m, n, device=device, generator=generator) * 0.02) for _, m, n in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=generator)
    named = [(f"layers.{i}.weight", p) for i, p in enumerate(params)]
    optimizers = {
        "adamw_fused": torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda"),
        "torch_muon": torch.optim.Muon(params, lr=1e-4, adjust_lr_fn="match_rms_adamw"),
        "dmuon": dmuon.Muon([{"params": named, "algorithm": "muon"}], lr=1e-4),
    }
    result = {name: best_seconds(opt.step, device, sizes.steps) * 1e3 for name, opt in optimizers.items()}
    result = {f"{name}_ms": ms for name, ms in result.items()}
    result["matrices"], result["parameters"] = len(params), sum(p.numel() for p in params)
    return result


def _bench(out: Path, sizes: Sizes, precision: str, extra: list[str]) -> dict:
    path = out / f"bench_{precision.split('-')[0]}.json"
    command = [sys.executable, "-m", "dmuon", "bench", *sizes.bench, "--precision", precision, *extra,
               "--json", str(path)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print(done.stdout + done.stderr[-4000:])
    if done.returncode:
        raise RuntimeError(f"dmuon bench exited {done.returncode}")
    return {"command": " ".join(command[1:]), "records": json.loads(path.read_text())}


def bench_bf16(device: torch.device, sizes: Sizes, out: Path) -> dict:
    """``dmuon bench`` on one GPU in bf16 autocast (how GPU jobs train): the step against AdamW's
    and vanilla Muon's, peak memory."""
    extra = ["--max-seconds", "40"] + (["--memory-steps", "1"] if device.type == "cuda" else [])
    return _bench(out, sizes, "bf16-autocast", extra)


def bench_fp32(device: torch.device, sizes: Sizes, out: Path) -> dict:
    """The same in fp32 throughout (products without TF32), labelled: AdamW's share of such a
    step is small, so its overhead figures read low against bf16 training."""
    extra = ["--max-seconds", "15", "--memory-steps", "0", "--configs", "ddp-adamw,ddp-dmuon,fsdp-adamw,fsdp-dmuon"]
    return _bench(out, sizes, "fp32", extra if device.type == "cuda" else [])


def early_graphs(device: torch.device, sizes: Sizes) -> dict:
    """Early start and CUDA graphs on and off, one process, bf16 autocast: step times and whether
    the parameters come out bitwise the same."""
    import dmuon
    from dmuon.tools.models import Llama, SyntheticTokens, get_config

    config = get_config("bench" if device.type == "cuda" else "tiny")
    data = SyntheticTokens(config.vocab_size)
    variants = {"adamw": None, "early_on": dict(early_start=True), "early_off": dict(early_start=False),
                "graphs": dict(early_start=False, cuda_graphs=True)}
    result, weights = {}, {}
    for name, options in variants.items():
        if device.type != "cuda" and name in ("early_on", "graphs"):
            result[name] = "CUDA only"
            continue
        model = Llama(config, seed=0).to(device)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda") if options is None
               else dmuon.Muon(model, lr=1e-3, **options))
        times = []
        for step in range(sizes.steps + 2):
            inputs, targets = (t.to(device) for t in data.batch(step, 8, 256 if device.type == "cuda" else 16))
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                model.loss(inputs, targets).backward()
            opt.step()
            opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        result[f"{name}_step_ms"] = 1e3 * min(times[2:])
        weights[name] = [p.detach().clone() for p in model.parameters()]
    if "early_on" in weights:
        result["early_on_bitwise_early_off"] = all(map(torch.equal, weights["early_on"], weights["early_off"]))
        result["graphs_bitwise_early_off"] = all(map(torch.equal, weights["graphs"], weights["early_off"]))
    return result


@dataclass(frozen=True)
class Section:
    name: str
    seconds: int  # its time limit on one H100
    run: Callable[..., dict]
    needs_out: bool = False


SECTIONS = [  # crash-prone first
    Section("crash", 50, crash),
    Section("reference", 40, reference),
    Section("newton_schulz", 55, newton_schulz),
    Section("optimizer_step", 50, optimizer_step),
    Section("early_graphs", 60, early_graphs),
    Section("bench_bf16", 110, bench_bf16, needs_out=True),
    Section("bench_fp32", 50, bench_fp32, needs_out=True),
]


def plan() -> str:
    """The dry run: what runs, in which order, under which limit, and the files it writes."""
    lines = [f"{'section':<16} {'limit s':>8}  file", f"{'setup':<16} {SETUP_SECONDS:>8}  log.txt (versions, GPU)"]
    lines += [f"{s.name:<16} {s.seconds:>8}  {s.name}.json" for s in SECTIONS]
    total = SETUP_SECONDS + sum(s.seconds + GRACE_SECONDS for s in SECTIONS)
    files = 1 + len(SECTIONS)
    lines.append(f"total: at most {total} s of {BUDGET_SECONDS} s (each limit + {GRACE_SECONDS} s to stop); {files} "
                 f"files of at most {MAX_FILES}")
    if total > BUDGET_SECONDS or files > MAX_FILES:
        raise SystemExit("\n".join(lines) + "\nover budget")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("section", nargs="?", choices=[s.name for s in SECTIONS])
    parser.add_argument("--out", type=Path, default=Path("gpu_check_results"))
    parser.add_argument("--smoke", action="store_true", help="on CPU at toy sizes")
    parser.add_argument("--dry-run", action="store_true", help="print the plan of sections and exit")
    args = parser.parse_args()
    if args.dry_run or args.section is None:
        print(plan())
        return 0
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    sizes = SMOKE if args.smoke else GPU
    section = next(s for s in SECTIONS if s.name == args.section)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    result = section.run(device, sizes, args.out) if section.needs_out else section.run(device, sizes)
    result["seconds"] = time.perf_counter() - started
    (args.out / f"{section.name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(json.dumps(result, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
