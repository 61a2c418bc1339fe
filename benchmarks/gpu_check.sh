#!/usr/bin/env bash
# All GPU checks in one call (one GPU; well under 8 minutes on an H100/H200):
#   1. correctness of Newton–Schulz on the GPU against the exact polynomial in float64;
#   2. NS throughput per method and shape against the measured matrix-product peak; the time
#      one rank needs for its share of Llama-3.1-8B at 8 and 64 ranks, against its FLOP lower bound
#      and against fused AdamW on the same rank's shard; Gram NS with torch's symmetric products
#      against the Triton one-triangle kernel per size (the data for a cut-off);
#   3. the side-by-side training table on one GPU (all three from dmuon bench --device cuda);
#   4. CUDA graphs: replayed Newton–Schulz against eager (results, time), Muon steps with and
#      without cuda_graphs (bitwise), and the host synchronizations of one step;
#   5. early start: one process, AdamW vs dmuon with and without it, and early start's plan with
#      its buckets begun in the backward pass vs all run at step() (bitwise), on the bench preset
#      and on 4 layers of Llama-3.2-3B's shapes; FSDP2 and DDP (dmuon's comm hook) on one GPU
#      with and without it, and under DDP its buckets begun in backward vs at step() (bitwise).
# Usage: bash benchmarks/gpu_check.sh [OUTPUT_DIR]   (default: gpu_check_results/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check_results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
python -m pytest -q tests/unit/test_orthogonalization.py -k "exact_polynomial or gram_equals_standard" \
    2>&1 | tee "$out/correctness_cpu.txt"
python -m dmuon.tools.ns_accuracy --device cuda --dtype float16 --bound 3e-2 \
    2>&1 | tee "$out/correctness_gpu.txt" || echo "GPU correctness FAIL: the other checks go on"
python - <<'PY' 2>&1 | tee "$out/cuda_graphs_and_syncs.txt"
# Newton–Schulz replayed from CUDA graphs against eager calls (results and time), a dmuon.Muon
# step with and without cuda_graphs (bitwise), and the host synchronizations of one step.
import warnings
import torch
from torch import nn
import dmuon
from dmuon.cuda_graphs import GraphedOrthogonalize
from dmuon.orthogonalization import orthogonalize, resolve_config
from dmuon.timing import best_seconds
device = torch.device("cuda")
graphed = GraphedOrthogonalize(orthogonalize)
for shape in [(16, 512, 512), (8, 1024, 1024), (4, 1024, 4096), (2, 4096, 14336)]:
    config = resolve_config(shape[-2:], "cuda")
    G = torch.randn(shape, device=device)
    same = torch.equal(graphed(G, config), orthogonalize(G, config))
    eager = best_seconds(lambda: orthogonalize(G, config), device, 10)
    replayed = best_seconds(lambda: graphed(G, config), device, 10)
    print(f"NS {shape}: graphed result {'bitwise equal' if same else 'DIFFERS'}; eager {eager * 1e3:.3f} ms, "
          f"replayed {replayed * 1e3:.3f} ms ({eager / replayed:.2f}x)")
weights = []
for graphs in (False, True):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)]).to(device)
    opt = dmuon.Muon(model, lr=0.02, cuda_graphs=graphs)
    for step in range(3):
        model(torch.randn(64, 1024, device=device)).square().mean().backward()
        if step == 2:
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            torch.cuda.set_sync_debug_mode("default")
            print(f"cuda_graphs={graphs}: host synchronizations in one step: {len(caught)}")
            for w in caught:
                print("   ", str(w.message).splitlines()[0])
        else:
            opt.step()
        opt.zero_grad()
    weights.append([p.detach().clone() for p in model.parameters()])
print("Muon steps with and without CUDA graphs:",
      "bitwise equal" if all(torch.equal(a, b) for a, b in zip(*weights)) else "DIFFER")
PY
dmuon bench --device cuda --world-size 1 --steps 5 --warmup 2 --batch-size 16 --seq-len 512 \
    --json "$out/bench.json" 2>&1 | tee "$out/bench.txt"
python benchmarks/early_start.py --device cuda --preset bench --batch-size 16 --seq-len 512 --rounds 10 \
    --json "$out/early_start_bench.json" 2>&1 | tee "$out/early_start_bench.txt"
python benchmarks/early_start.py --device cuda --preset llama-3.2-3b --layers 4 --batch-size 4 --seq-len 1024 \
    --rounds 8 --json "$out/early_start_3b.json" 2>&1 | tee "$out/early_start_3b.txt"
dmuon bench --device cuda --world-size 1 --preset bench --batch-size 16 --seq-len 512 --steps 6 --warmup 2 \
    --configs fsdp-adamw,fsdp-dmuon,fsdp-dmuon-atstep --max-seconds 0 2>&1 | tee "$out/early_start_fsdp.txt"
python benchmarks/early_start.py --device cuda --ddp-only --preset bench --batch-size 16 --seq-len 512 \
    2>&1 | tee "$out/early_start_ddp_bits.txt" || echo "DDP early start bits FAIL: the other checks go on"
dmuon bench --device cuda --world-size 1 --preset bench --batch-size 16 --seq-len 512 --steps 6 --warmup 2 \
    --configs ddp-adamw,ddp-dmuon,ddp-dmuon-atstep --max-seconds 0 2>&1 | tee "$out/early_start_ddp.txt"
