#!/usr/bin/env bash
# All GPU checks in one call (one GPU; well under 8 minutes on an H100/H200):
#   1. correctness of Newton–Schulz on the GPU against the exact polynomial in float64;
#   2. NS throughput per method and shape against the measured matrix-product peak; the time
#      one rank needs for its share of Llama-3.1-8B at 8 and 64 ranks, against its FLOP lower bound
#      and against fused AdamW on the same rank's shard; Gram NS with torch's symmetric products
#      against the Triton one-triangle kernel per size (the data for a cut-off);
#   3. the side-by-side training table on one GPU (all three from dmuon bench --device cuda).
# Usage: bash bench/gpu_check.sh [OUTPUT_DIR]   (default: gpu_check_results/)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu_check_results}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
python -m pytest -q tests/test_orthogonalization.py -k "exact_polynomial or gram_equals_standard" \
    2>&1 | tee "$out/correctness_cpu.txt"
python - <<'PY' 2>&1 | tee "$out/correctness_gpu.txt"
import torch
from dmuon.orthogonalization import coefficient_schedule, newton_schulz
from tests.test_orthogonalization import exact_polynomial, gradient_like, rel
torch.manual_seed(0)
worst = 0.0
for m, n in [(512, 2048), (2048, 512), (1024, 1024), (256, 4096)]:
    for make in (lambda: torch.randn(m, n, dtype=torch.float64), lambda: gradient_like(m, n)):
        G = make()
        expected = exact_polynomial(G, coefficient_schedule("polar_express", 5))
        for method in ("standard", "gram"):
            out = newton_schulz(G.cuda().float(), method=method, dtype=torch.float16).double().cpu()
            err = rel(out, expected)
            worst = max(worst, err)
            print(f"{m}x{n} {method:>8} fp16 rel. error vs exact polynomial: {err:.2e}")
print("worst", worst, "PASS" if worst <= 3e-2 else "FAIL")
PY
dmuon bench --device cuda --world-size 1 --steps 5 --warmup 2 --batch-size 16 --seq-len 512 \
    --json "$out/bench.json" 2>&1 | tee "$out/bench.txt"
