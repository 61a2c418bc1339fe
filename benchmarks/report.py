"""BENCHMARKS.md, written from the measurements' JSON in ``benchmarks/results/``.

    python benchmarks/report.py                       # rewrite BENCHMARKS.md from the JSON
    python benchmarks/report.py --measure             # rerun every measurement first (about 20 min, 2 cores)
    python benchmarks/report.py --measure bench-vla   # rerun some of them (names: MEASUREMENTS)

Each measurement is one or more commands of the ``dmuon`` tools with ``--json``; its file in
``benchmarks/results/`` holds their JSON with the command, the machine class, torch's version and
the commit it ran at, which its table prints beside it. A measurement that cannot run here (the
peers not installed) keeps its last file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PLAN_CASES = [  # (model, world size, extra flags): the paper's workloads at 64-1024 GPUs
    ("llama-3.1-8b", 64, []), ("llama-3.1-8b", 256, []), ("llama-3.1-70b", 256, []),
    ("llama-3.1-70b", 1024, []), ("qwen3-30b-a3b", 256, ["--tp", "4", "--pp", "4", "--ep", "8"]),
    ("vla", 64, []), ("pi0", 64, []), ("pi0", 256, []),
]


@dataclass(frozen=True)
class Measurement:
    question: str
    commands: list[list[str]]  # "{out}": the JSON path of each command


MEASUREMENTS = {
    "bench-llm": Measurement("What a step costs over AdamW and vanilla Muon: a Llama-style LLM",
                             [["dmuon", "bench", "--json", "{out}"]]),
    "bench-vla": Measurement("What a step costs over AdamW and vanilla Muon: the embodied model",
                             [["dmuon", "bench", "--preset", "vla", "--json", "{out}"]]),
    "bench-family": Measurement("The Muon family's optimizer step and state on the bench preset",
                                [["dmuon", "bench", "--preset", "bench", "--configs", "fsdp-adamw,fsdp-dmuon,"
                                  "fsdp-dmuon-aol,fsdp-dmuon-bf16mom,fsdp-dmuon-int8mom", "--json", "{out}"]]),
    "bench-fsdp-tp": Measurement("What FSDP2 × tensor parallel costs the step, beside FSDP2 alone",
                                 [["dmuon", "bench", "--layout", "fsdp-tp", "--world-size", "4", "--memory-steps",
                                   "0", "--max-seconds", "420", "--json", "{out}"]]),
    "bench-qk-clip": Measurement("What QK-clip costs the step",
                                 [["dmuon", "bench", "--configs", "fsdp-adamw,fsdp-dmuon,fsdp-dmuon-qkclip",
                                   "--memory-steps", "0", "--json", "{out}"]]),
    "peers": Measurement("The optimizer step beside other distributed Muons",
                         [["dmuon", "bench", "--peers", "--configs", "ddp-dmuon,fsdp-dmuon", "--json", "{out}"]]),
    "plan": Measurement("Predicted at scale: dmuon plan on H100s",
                        [["dmuon", "plan", "--model", model, "--world-size", str(world), "--hardware", "h100", *extra,
                          "--json", "{out}"] for model, world, extra in PLAN_CASES]),
    "exchange-bytes": Measurement("Bytes per rank in 2-D layouts",
                                  [[sys.executable, "benchmarks/exchange_bytes.py", "--json", "{out}"]]),
    "layout-drift": Measurement("How far training drifts between layouts whose steps are bitwise equal",
                                [[sys.executable, "benchmarks/layout_drift.py", "--steps", "200",
                                  "--muon-lr-multiple", "4", "--json", "{out}"]]),
    "polar-error": Measurement("Newton–Schulz recipes: distance to the polar factor, and FLOPs",
                               [[sys.executable, "-m", "dmuon.tools.ns_accuracy", "--polar-error", "--dtype",
                                 "float32", "--json", "{out}"]]),
    "quality": Measurement("Training quality on real text", [["dmuon", "quality", "--json", "{out}"]]),
    "quality-vla": Measurement("Training quality on the embodied model, and its lr",
                               [["dmuon", "quality", "--workload", "vla", "--seeds", "3", "--json", "{out}"]]),
    "quality-family": Measurement("The Muon family on real text: NorMuon, AOL and smaller momentum beside Muon",
                                  [["dmuon", "quality", "--optimizers", "adamw,torch-muon,dmuon,dmuon-normuon,"
                                    "dmuon-aol,dmuon-bf16mom,dmuon-int8mom", "--seeds", "3", "--json", "{out}"]]),
}


def machine_class() -> str:
    """E.g. "2-core Intel Xeon (AMX, AVX512-BF16), no GPU": what bf16 speed depends on."""
    flags = set()
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    features = [label for flag, label in (("amx_tile", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx2", "AVX2"))
                if flag in flags][:2]
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    cores = len(os.sched_getaffinity(0))
    return f"{cores}-core {name} ({', '.join(features) or 'no AVX2'}), {gpu}"


def measure(name: str) -> None:
    """Run measurement ``name``'s commands and write its results file."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, command in enumerate(MEASUREMENTS[name].commands):
            out = f"{tmp}/{i}.json"
            argv = [out if part == "{out}" else part for part in command]
            print("$", " ".join(argv), file=sys.stderr, flush=True)
            subprocess.run(argv, cwd=ROOT, check=True)
            shown = ["python" if p == sys.executable else "PATH" if p == "{out}" else p for p in command]
            runs.append({"command": " ".join(shown),
                         "result": json.loads(Path(out).read_text())})
    RESULTS.mkdir(exist_ok=True)
    record = {"machine": machine_class(), "torch": torch.__version__, "commit": commit, "runs": runs}
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1) + "\n")


# ------------------------------------------------------------------------------------ tables


def ratio(value: float | None, halfwidth: float | None = None) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}×" + (f" ±{halfwidth:.0%}" if halfwidth else "")


def provenance(record: dict) -> str:
    # the interpreter as a reader types it, not this machine's path to it
    commands = "\n".join(re.sub(r"^\S*/python3?(?= )", "python", run["command"]) for run in record["runs"])
    return (f"```bash\n{commands}\n```\n\n{record['machine']}; torch {record['torch']}; "
            f"commit {record['commit']}.\n")


def bench_table(record: dict) -> str:
    records = record["runs"][0]["result"]
    lines = ["| configuration | step ms | step / AdamW's | step / vanilla Muon's | optimizer step / vanilla's "
             "| peak memory / AdamW's | optimizer MB sent per step |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        mb = "–" if r["opt_bytes_per_step"] is None else f"{r['opt_bytes_per_step'] / 1e6:.1f}"
        lines.append(f"| {r['config']} | {r['step_ms']:.0f} "
                     f"| {ratio(r['step_vs_adamw'], r['step_vs_adamw_halfwidth'])} "
                     f"| {ratio(r['step_vs_vanilla'], r['step_vs_vanilla_halfwidth'])} "
                     f"| {ratio(r['opt_step_vs_vanilla'], r['opt_step_vs_vanilla_halfwidth'])} "
                     f"| {ratio(r['mem_vs_adamw'])} | {mb} |")
    warnings = sorted({w for r in records for w in r["warnings"]})
    settled = "every ratio within ±10 % (95 % interval)" if not warnings else "not settled: " + "; ".join(warnings)
    return "\n".join(lines) + f"\n\n{settled}.\n"


def fsdp_tp_table(record: dict) -> str:
    """The bench table, then dmuon's step over AdamW's under FSDP2 × TP over the same under FSDP2."""
    by_config = {r["config"]: r for r in record["runs"][0]["result"]}
    tp, fsdp = by_config["fsdptp-dmuon"]["step_vs_adamw"], by_config["fsdp-dmuon"]["step_vs_adamw"]
    return (bench_table(record) + f"\ndmuon's step over AdamW's under FSDP2 × TP, over the same under FSDP2 alone: "
            f"{ratio(tp / fsdp if tp and fsdp else None)}.\n")


def qk_clip_table(record: dict) -> str:
    """The bench table, then QK-clip's share: the clipped run's step over the plain run's, less one."""
    by_config = {r["config"]: r for r in record["runs"][0]["result"]}
    clipped, plain = by_config["fsdp-dmuon-qkclip"]["step_vs_adamw"], by_config["fsdp-dmuon"]["step_vs_adamw"]
    share = f"{clipped / plain - 1:+.1%}" if clipped and plain else "–"
    return (bench_table(record)
            + f"\nQK-clip's share of dmuon's step (its step over AdamW's, against dmuon's): {share}.\n")


def family_bench_table(record: dict) -> str:
    """Each configuration's optimizer step against ``fsdp-dmuon``'s (median of per-round ratios)
    and its optimizer state against ``fsdp-dmuon``'s."""
    records = record["runs"][0]["result"]
    base = next(r for r in records if r["config"] == "fsdp-dmuon")
    lines = ["| configuration | optimizer step ms | optimizer step / fsdp-dmuon's (rounds' range) | step / AdamW's "
             "| optimizer state MiB per rank (Muon's part) | Muon's state / fsdp-dmuon's |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in records:
        ratios = sorted(a / b for a, b in zip(r["round_opt_step_ms"], base["round_opt_step_ms"]) if a and b)
        versus = f"{statistics.median(ratios):.2f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})" if ratios else "–"
        muon = f"{r['muon_state_bytes'] / base['muon_state_bytes']:.2f}×" if r["muon_state_bytes"] else "–"
        lines.append(f"| {r['config']} | {r['opt_step_ms']:.1f} | {versus} "
                     f"| {ratio(r['step_vs_adamw'], r['step_vs_adamw_halfwidth'])} "
                     f"| {r['state_bytes'] / 2**20:.1f} ({r['muon_state_bytes'] / 2**20:.1f}) | {muon} |")
    warnings = sorted({w for r in records for w in r["warnings"]})
    settled = "every ratio to AdamW within ±10 % (95 % interval)" if not warnings else \
        "not settled: " + "; ".join(warnings)
    return "\n".join(lines) + f"\n\n{settled}.\n"


def peers_table(record: dict) -> str:
    records = [r for r in record["runs"][0]["result"] if "dmuon" in r["config"]]
    peers = sorted({peer for r in records for peer in r["opt_step_vs_peer"]})
    lines = ["| dmuon in | " + " | ".join(f"optimizer step / {p}'s" for p in peers) + " |",
             "|---|" + "---:|" * len(peers)]
    for r in records:
        cells = [ratio(r["opt_step_vs_peer"][p]["median"], r["opt_step_vs_peer"][p]["halfwidth"])
                 if p in r["opt_step_vs_peer"] else "–" for p in peers]
        lines.append(f"| {r['config'].split('-')[0]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nBelow 1: dmuon's optimizer step is the shorter.\n"


def plan_table(record: dict) -> str:
    lines = ["| model | GPUs | layout | dmuon optimizer step ms | step over AdamW's | vanilla Muon's step over "
             "AdamW's | imbalance (max/mean NS) | optimizer state GB / rank (AdamW's) |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for run in record["runs"]:
        p = run["result"]
        parallel = (p["tp"], p["pp"], p["ep"]) != (1, 1, 1)
        layout = f"tp {p['tp']} × pp {p['pp']} × ep {p['ep']}" if parallel else p["mode"]
        lines.append(f"| {p['model']} | {p['world_size']} | {layout} | {p['dmuon_opt_ms']:.1f} "
                     f"| {p['overhead_vs_adamw']:+.1%} | {p['vanilla_overhead_vs_adamw']:+.1%} | {p['imbalance']:.2f} "
                     f"| {p['dmuon_state_gb']:.2f} ({p['adamw_state_gb']:.2f}) |")
    caveats = [f"{run['result']['model']}, {note}" for run in record["runs"]
               for note in run["result"].get("not_modelled", [])]
    return "\n".join(lines) + "\n" + "".join(f"\n{caveat}\n" for caveat in caveats)


def exchange_table(record: dict) -> str:
    rows = record["runs"][0]["result"]
    lines = ["| layout | mean kB | max kB | FSDP2's bound kB | mean / bound |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {r['mean_bytes'] / 1e3:.1f} | {r['max_bytes'] / 1e3:.1f} | {r['bound_bytes'] / 1e3:.1f} "
              f"| {r['mean_bytes'] / r['bound_bytes']:.2f} |" for name, r in rows.items()]
    return "\n".join(lines) + "\n"


def drift_table(record: dict) -> str:
    result = record["runs"][0]["result"]
    marks = list(next(iter(result["results"].values()))["gaps"])
    lines = ["| optimizer | final loss (one process) | " + " | ".join(f"gap after {m} steps" for m in marks)
             + " | largest gap |", "|---|---:|" + "---:|" * (len(marks) + 1)]
    for name, r in result["results"].items():
        lines.append(f"| {name} | {r['final_loss']:.4f} | " + " | ".join(f"{r['gaps'][m]:.1e}" for m in marks)
                     + f" | {r['largest_gap']:.1e} |")
    return "\n".join(lines) + "\n"


def polar_error_table(record: dict) -> str:
    result = record["runs"][0]["result"]
    kinds = list(result["rows"][0]["mean"])
    lines = ["| recipe | steps | GFLOP per 512×1536 | " + " | ".join(f"{k}: mean (worst)" for k in kinds) + " |",
             "|---|---:|---:|" + "---:|" * len(kinds)]
    for row in result["rows"]:
        lines.append(f"| {row['recipe']} | {row['steps']} | {row['flops'] / 1e9:.2f} | "
                     + " | ".join(f"{row['mean'][k]:.3f} ({row['worst'][k]:.3f})" for k in kinds) + " |")
    return "\n".join(lines) + "\n"


def quality_table(record: dict) -> str:
    result = record["runs"][0]["result"]
    target = result["settings"]["target_loss"]
    seeds = result["settings"].get("seeds", 1)
    loss = "final validation loss" + (f" (mean of {seeds} seeds; their range)" if seeds > 1 else "")
    costs = "state_bytes" in result["runs"][0]  # records since the optimizer's step time and state were kept
    lines = [f"| optimizer | lrs tried | best lr | {loss} | steps to {target} | seconds to {target} |"
             + (" optimizer step ms | state KiB |" if costs else ""),
             "|---|---|---:|---:|---:|---:|" + ("---:|---:|" if costs else "")]
    for optimizer in dict.fromkeys(r["optimizer"] for r in result["runs"]):
        runs = [r for r in result["runs"] if r["optimizer"] == optimizer]
        best = next(r for r in runs if r["best"])
        steps, seconds = best["steps_to_target"], best["seconds_to_target"]
        tried = ", ".join(f"{r['lr']:g}" for r in runs)
        finals = best.get("seed_final_val_losses") or []
        spread = f" ({min(finals):.4f}–{max(finals):.4f})" if len(finals) > 1 else ""
        lines.append(f"| {optimizer} | {tried} | {best['lr']:g} | {best['final_val_loss']:.4f}{spread} "
                     f"| {steps or 'not reached'} | {'–' if seconds is None else f'{seconds:.1f}'} |"
                     + (f" {best['optimizer_step_ms']:.2f} | {best['state_bytes'] / 1024:,.0f} |" if costs else ""))
    return "\n".join(lines) + "\n\n" + sweep_table(result)


def sweep_table(result: dict) -> str:
    """Final validation loss of every optimizer at every lr of the sweeps: how much the lr matters."""
    lrs = sorted({r["lr"] for r in result["runs"]})
    lines = ["| final validation loss at lr | " + " | ".join(f"{lr:g}" for lr in lrs) + " |",
             "|---|" + "---:|" * len(lrs)]
    for optimizer in dict.fromkeys(r["optimizer"] for r in result["runs"]):
        loss = {r["lr"]: r["final_val_loss"] for r in result["runs"] if r["optimizer"] == optimizer}
        cells = ["–" if lr not in loss else "diverged" if loss[lr] is None else f"{loss[lr]:.4f}" for lr in lrs]
        lines.append(f"| {optimizer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


SECTIONS = {  # measurement → (what the table shows, how to read it)
    "bench-llm": (bench_table, "`dmuon bench`'s default run: the bench preset (27 M parameters, native bf16 products) "
                  "or the demo preset where bf16 is emulated, 2 gloo ranks; every configuration steps in turn in the "
                  "same ranks, ratios are medians of per-round ratios."),
    "bench-vla": (bench_table, "The embodied preset `vla` (a frozen 6-layer ViT tower, a 512-wide language model and a "
                  "256-wide action expert; 26.5 M parameters, 20.7 M trained), 2 gloo ranks, as above."),
    "bench-family": (family_bench_table, "`dmuon bench --preset bench` (27 M parameters), 2 gloo ranks, FSDP2: "
                     "dmuon's Muon beside `ns_coefficients=\"aol\"` and `momentum_dtype` bfloat16 and int8 (8-bit "
                     "blocks), all stepping in turn in the same ranks. State: the optimizers' state tensors on the "
                     "rank holding the most, Muon's matrices' part in brackets."),
    "bench-fsdp-tp": (fsdp_tp_table, "`dmuon bench --layout fsdp-tp`: the demo or bench preset (as the default run) "
                      "at 4 gloo ranks, under FSDP2 and under FSDP2 × tensor parallel on a (2, 2) mesh (torchtitan's "
                      "plan: q, k, v, gate, up column-wise, o, down row-wise; the piece exchange), each with its "
                      "AdamW and vanilla Muon, all stepping in turn in the same ranks. Early start is off on CPU "
                      "(its default there)."),
    "bench-qk-clip": (qk_clip_table, "`dmuon bench` with `fsdp-dmuon-qkclip`: dmuon with `dmuon.QKClip.for_model` "
                      "(τ = 100; the max logits of every attention layer recorded in every forward — one more q·kᵀ "
                      "product per layer, `dmuon.max_logits` — all-reduced at the step, heads over τ scaled) beside "
                      "dmuon without it and AdamW, 2 gloo ranks, FSDP2, stepping in turn in the same ranks."),
    "peers": (peers_table, "`dmuon bench --peers`: dmuon's optimizer step against every installed peer's in the same "
              "ranks (the bench preset; Dion needs a git install and is left out where it is missing)."),
    "plan": (plan_table, "`dmuon plan`'s predictions on the H100 profile (datasheet rates, MFU 0.4): the step's "
             "overhead over AdamW's for dmuon and for vanilla distributed Muon."),
    "exchange-bytes": (exchange_table, "4 gloo ranks, one dmuon step per layout: kB sent per rank against FSDP2's "
                       "bound (exact byte counts, the same on every machine)."),
    "layout-drift": (drift_table, "The demo preset trained on the standard library's bytes from the same weights on "
                     "the same batches in one process and under FSDP2 on 2 gloo ranks: |loss gap| between the two. "
                     "A step is bitwise the same on the same gradients; the gradients differ in their last bits "
                     "(each rank sums its half of the batch), and the runs drift apart: within 30 steps faster with a "
                     "bf16 Newton–Schulz than with fp32 or AdamW, by 200 steps every optimizer's two runs alike, "
                     "AdamW's included."),
    "quality": (quality_table, "Byte-level language modelling of the Python standard library's source: each "
                "optimizer's best of four peak learning rates, 200 steps, one thread."),
    "polar-error": (polar_error_table, "‖NS(G) − U·Vᵀ‖_F / ‖U·Vᵀ‖_F in fp32 (standard Newton–Schulz), U·Vᵀ the "
                    "polar factor over G's numerical rank, for Gaussian and ill-conditioned (singular values "
                    "1 to 1e-3) matrices of the bench preset's four shapes and the bench model's 56 hidden "
                    "gradient matrices after 3 AdamW steps. \"aol\": AOL rescaling, then 4 steps fitted to it "
                    "(`python benchmarks/fit_aol.py`); its rescaling reuses the first step's Gram product, so "
                    "its FLOPs are 4 steps'."),
    "quality-family": (quality_table, "The text task of \"Training quality on real text\": each optimizer's best "
                       "of four peak learning rates by the mean over 3 seeds — `update_rule=\"normuon\"`, "
                       "`ns_coefficients=\"aol\"` (4 Newton–Schulz steps), `momentum_dtype` bfloat16 and int8 (8-bit "
                       "blocks) against dmuon's Muon, torch.optim.Muon and AdamW. Optimizer step: its mean time per "
                       "step at the best lr, one thread (the model is small: the step's fixed costs weigh more than "
                       "at scale); state: the optimizers' state tensors."),
    "quality-vla": (quality_table, "The embodied model `vla-tiny` (frozen vision tower, language model, action "
                    "expert) on synthetic episodes, validated on episodes no run trains on (prompt cross-entropy + "
                    "action MSE): each optimizer's best of five peak learning rates by the mean over 3 seeds, "
                    "300 steps, one thread."),
}


def render() -> str:
    parts = ["# Benchmarks\n",
             "Written by `python benchmarks/report.py` from the JSON in `benchmarks/results/`; `python "
             "benchmarks/report.py --measure` reruns every measurement on the machine at hand. Times on a shared "
             "CPU are noisy: compare ratios within one table, each from one run.\n"]
    for name, measurement in MEASUREMENTS.items():
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        record = json.loads(path.read_text())
        table, about = SECTIONS[name]
        parts.append(f"## {measurement.question}\n\n{about}\n\n{provenance(record)}\n{table(record)}")
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", nargs="*", metavar="NAME", choices=list(MEASUREMENTS),
                        help="rerun these measurements first (none named: all)")
    args = parser.parse_args()
    if args.measure is not None:
        for name in args.measure or list(MEASUREMENTS):
            measure(name)
    (ROOT / "BENCHMARKS.md").write_text(render())


if __name__ == "__main__":
    main()
